//! The interface's types: its errors, records and descriptor handles, and
//! the records the client stub keeps to rebuild descriptors.

use super::wire::*;
use super::{words, Ctx, Out};
use crate::model::*;

impl Ctx<'_> {
    pub(super) fn types(&self, o: &mut Out) {
        let i = self.iface;
        let errors: Vec<String> = i
            .errors
            .iter()
            .map(|e| format!("{} = {:?}", e.name, words(&e.name)))
            .collect();
        // The parser numbers errors in declaration order, as the macro does.
        o.line(format!(
            "kintsugi_runtime::interface_errors!({:?} {{ {} }});",
            i.name,
            errors.join(", ")
        ));
        o.line("");

        for r in &i.records {
            o.line(format!("/// Record `{}`.", r.name));
            o.line("#[derive(Debug, Clone, PartialEq, Eq, Default)]");
            o.open(format!("pub struct {} {{", r.name));
            for f in &r.fields {
                o.line(format!("pub {}: {},", f.name, owned(&f.ty)));
            }
            o.close("}");
            o.line("");
            o.open(format!("impl {} {{", r.name));
            o.open("fn encode(&self, w: &mut rt::Writer<'_>) -> rt::Result<(), rt::WireError> {");
            for f in &r.fields {
                o.lines(encode(&f.ty, &format!("self.{}", f.name), false, 0, "?"));
            }
            o.line("rt::Ok(())");
            o.close("}");
            o.line("");
            o.open("fn decode(r: &mut rt::Reader<'_>) -> rt::Result<Self, rt::WireError> {");
            o.open(format!("rt::Ok({} {{", r.name));
            for f in &r.fields {
                let v = match f.ty {
                    Type::Str => "r.str()?.to_owned()".to_string(),
                    Type::Bytes => "r.bytes()?.to_vec()".to_string(),
                    ref t => format!("r.{}()?", wire_fn(t)),
                };
                o.line(format!("{}: {v},", f.name));
            }
            o.close("})");
            o.close("}");
            o.close("}");
            o.line("");
        }

        for d in &i.descriptors {
            if d.namespace == Namespace::Global {
                self.global_types(o, d);
            } else {
                self.local_types(o, d);
            }
        }
        if self.has_local() {
            o.line("/// Where a descriptor lives in the server's current incarnation.");
            o.line("#[derive(Debug, Clone, Copy)]");
            o.open("struct Current {");
            o.line("server_id: u64,");
            o.line("epoch: u64,");
            o.close("}");
            o.line("");
        }
    }

    pub(super) fn global_types(&self, o: &mut Out, d: &Descriptor) {
        o.line(format!(
            "/// A `{}` descriptor: a global id, the same in every component that uses it",
            d.name
        ));
        o.line("/// and across reboots of the server.");
        o.line("#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]");
        o.line(format!("pub struct {}(pub u64);", d.name));
        o.line("");
        if d.fields.is_empty() {
            return;
        }
        o.line(format!(
            "/// What this client tracks of a `{}` for itself.",
            d.name
        ));
        o.line("#[derive(Debug, Clone, Default, PartialEq)]");
        o.open(format!("pub struct {}Record {{", d.name));
        for f in &d.fields {
            o.line(format!("/// Tracked field `{}`.", f.name));
            o.line(format!("pub {}: u64,", f.name));
        }
        o.close("}");
        // Its words, for the client stub's lock-free table.
        let names: Vec<&str> = d.fields.iter().map(|f| f.name.as_str()).collect();
        let n = names.len();
        o.open(format!("impl rt::Fields<{n}> for {}Record {{", d.name));
        o.open(format!("fn to_words(&self) -> [u64; {n}] {{"));
        let words: Vec<String> = names.iter().map(|f| format!("self.{f}")).collect();
        o.line(format!("[{}]", words.join(", ")));
        o.close("}");
        o.open(format!(
            "fn from_words([{}]: [u64; {n}]) -> Self {{",
            names.join(", ")
        ));
        o.line(format!("Self {{ {} }}", names.join(", ")));
        o.close("}");
        o.close("}");
        o.line("");
    }

    pub(super) fn local_types(&self, o: &mut Out, d: &Descriptor) {
        let i = self.iface;
        let creator = i.creator(&d.name).expect("checked");
        o.line(format!(
            "/// A `{}` descriptor, as a client holds it: a virtual id that stays valid",
            d.name
        ));
        o.line("/// across reboots of the server.");
        o.line("#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]");
        o.line(format!("pub struct {}(pub u32);", d.name));
        o.line("");
        o.line(format!(
            "/// What the client stub keeps per `{}` to rebuild it after a reboot.",
            d.name
        ));
        o.line("#[derive(Debug, Clone, Default, PartialEq)]");
        o.open(format!("pub struct {}Record {{", d.name));
        for a in creator.args.iter().filter(|a| a.remember) {
            o.line(format!("/// `{}` as passed to `{}`.", a.name, creator.name));
            o.line(format!("pub {}: {},", a.name, owned(&a.ty)));
        }
        for f in &d.fields {
            o.line(format!("/// Tracked field `{}`.", f.name));
            o.line(format!("pub {}: u64,", f.name));
        }
        if !d.states.is_empty() {
            let states: Vec<String> = d
                .states
                .iter()
                .enumerate()
                .map(|(n, (s, _))| format!("{n} = {s}"))
                .collect();
            o.line(format!("/// State: {}.", states.join(", ")));
            o.line("pub state: u8,");
        }
        for f in i.transitions(&d.name) {
            for a in f.args.iter().filter(|a| a.remember) {
                o.line(format!("/// `{}` as last passed to `{}`.", a.name, f.name));
                o.line(format!("pub {}_{}: {},", f.name, a.name, owned(&a.ty)));
            }
        }
        o.close("}");
        o.line("");
    }
}
