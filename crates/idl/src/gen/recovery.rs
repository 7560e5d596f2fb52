//! The client stub's rebuild of a local descriptor after the server's
//! micro-reboot: replay its creation, restore its tracked fields, replay
//! its transitions, and publish it only if no call changed it meanwhile.

use super::wire::*;
use super::{snake, Ctx, Out};
use crate::model::*;

impl Ctx<'_> {
    /// Arguments replaying `f` for the descriptor rebuilt as `server_id`,
    /// from its tracked record `entry.record`.
    pub(super) fn replay_args(&self, f: &Function, prefix: &str) -> Vec<String> {
        let mut args = vec!["rt::Some(epoch)".to_string()];
        args.extend(f.args.iter().map(|a| {
            let stored = format!("entry.record.{prefix}{}", a.name);
            match (&a.ty, &a.replay, &a.from) {
                (Type::Descriptor(_), _, _) => "server_id".to_string(),
                (_, Some(lit), _) => rust_literal(lit, &a.ty),
                (_, None, Some(r)) => format!("entry.record.{}", r.field),
                (ty, None, None) if is_scalar(ty) => stored,
                _ => format!("&{stored}"),
            }
        }));
        args
    }

    /// `match self.raw_f(args) { .. }` inside the rebuild loop.
    pub(super) fn replay_call(&self, o: &mut Out, f: &Function, args: Vec<String>, bind: &str) {
        o.open(format!(
            "{bind}match self.raw_{}({}) {{",
            f.name,
            args.join(", ")
        ));
        o.line(if bind.is_empty() {
            "rt::Ok(_) => {}"
        } else {
            "rt::Ok(server_id) => server_id,"
        });
        o.line(
            "rt::Err(rt::CallError::Fault(rt::Fault::Stale | rt::Fault::Interrupted)) => continue,",
        );
        o.line("rt::Err(e) => return rt::Err(e),");
        o.close(if bind.is_empty() { "}" } else { "};" });
    }

    pub(super) fn recovery_fns(&self, o: &mut Out, d: &Descriptor) {
        let i = self.iface;
        let s = snake(&d.name);
        let creator = i.creator(&d.name).expect("checked");
        o.line(format!("/// Where `{s}` lives now, without rebuilding it."));
        o.open(format!(
            "fn peek_{s}(&self, desc: {}) -> rt::Result<Current, rt::CallError<Error>> {{",
            d.name
        ));
        o.line(format!(
            "let at = self.{s}s.locate(desc.0).ok_or(rt::CallError::BadDescriptor(desc.0))?;"
        ));
        o.line("rt::Ok(Current { server_id: at.server_id, epoch: at.epoch })");
        o.close("}");
        o.line("");
        if d.reboot == Reboot::Keeps {
            o.line(format!(
                "/// [`Inner::current_{s}`], or none if the server refuses to rebuild it (it was closed before its reboot): then forgotten."
            ));
            o.open(format!(
                "fn kept_{s}(&self, desc: {}) -> rt::Result<rt::Option<Current>, rt::CallError<Error>> {{",
                d.name
            ));
            o.open(format!("match self.current_{s}(desc) {{"));
            o.line("rt::Ok(now) => rt::Ok(rt::Some(now)),");
            o.open("rt::Err(rt::CallError::Server(_)) => {");
            o.line(format!("self.{s}s.remove(desc.0);"));
            o.line("rt::Ok(rt::None)");
            o.close("}");
            o.line("rt::Err(e) => rt::Err(e),");
            o.close("}");
            o.close("}");
            o.line("");
        }
        o.line(format!(
            "/// Where `{s}` lives now, rebuilt first if the server rebooted since it was built."
        ));
        o.open(format!(
            "fn current_{s}(&self, desc: {}) -> rt::Result<Current, rt::CallError<Error>> {{",
            d.name
        ));
        o.line(format!("let current = self.peek_{s}(desc)?;"));
        o.open("if current.epoch == self.conn.epoch() {");
        o.line("return rt::Ok(current);");
        o.close("}");
        let restores: Vec<&Function> = d
            .fields
            .iter()
            .filter_map(|x| i.restorer(&d.name, &x.name))
            .collect();
        let mut steps = vec![format!("replay `{}`", creator.name)];
        if !restores.is_empty() {
            steps.push("restore its tracked fields".into());
        }
        if !d.states.is_empty() {
            steps.push("replay the transitions into its state".into());
        }
        o.line(format!(
            "// Rebuild it in the server's new incarnation: {}.",
            steps.join(", then ")
        ));
        o.line("let _recovering = rt::RecoveryScope::enter();");
        o.open("loop {");
        o.line(format!(
            "let entry = self.{s}s.get(desc.0).ok_or(rt::CallError::BadDescriptor(desc.0))?;"
        ));
        o.line("let epoch = self.conn.epoch();");
        o.open("if entry.epoch == epoch {");
        o.line("// Another thread rebuilt it meanwhile.");
        o.line("return rt::Ok(Current { server_id: entry.server_id, epoch });");
        o.close("}");
        o.line("let _one_at_a_time = self.recovery.lock().unwrap_or_else(|e| e.into_inner());");
        o.open(format!("if self.peek_{s}(desc)?.epoch == epoch {{"));
        o.line("continue;");
        o.close("}");
        self.replay_call(
            o,
            creator,
            self.replay_args(creator, ""),
            "let server_id = ",
        );
        for field in &d.fields {
            let Some(rf) = i.restorer(&d.name, &field.name) else {
                continue;
            };
            let value = format!("entry.record.{}", field.name);
            let args: Vec<String> = std::iter::once("rt::Some(epoch)".to_string())
                .chain(rf.args.iter().map(|a| match a.ty {
                    Type::Descriptor(_) => "server_id".to_string(),
                    _ => value.clone(),
                }))
                .collect();
            o.open(format!("if {value} != 0 {{"));
            self.replay_call(o, rf, args, "");
            o.close("}");
        }
        let paths: Vec<(usize, Vec<&Function>)> = i
            .replay_paths(d)
            .into_iter()
            .enumerate()
            .filter_map(|(n, p)| Some((n, p?)).filter(|(_, p)| !p.is_empty()))
            .collect();
        let replay = |o: &mut Out, path: &[&Function]| {
            for f in path {
                let args = self.replay_args(f, &format!("{}_", f.name));
                self.replay_call(o, f, args, "");
            }
        };
        match paths.as_slice() {
            [] => {}
            [(n, path)] => {
                o.open(format!("if entry.record.state == {n} {{"));
                replay(o, path);
                o.close("}");
            }
            _ => {
                o.open("match entry.record.state {");
                for (n, path) in &paths {
                    o.open(format!("{n} => {{"));
                    replay(o, path);
                    o.close("}");
                }
                o.line("_ => {}");
                o.close("}");
            }
        }
        // Published only if no call changed the record meanwhile (a thread's
        // call can complete while another thread, eager recovery's, rebuilds
        // from the record as it was): else the server's descriptor would lag
        // the client's fields. Rebuild again from the newer record.
        o.line("let mut published = false;");
        o.open(format!("self.{s}s.update(desc.0, |t| {{"));
        o.open("if t.record == entry.record {");
        o.line("t.server_id = server_id;");
        o.line("t.epoch = epoch;");
        o.line("published = true;");
        o.close("}");
        o.close("});");
        o.open("if !published {");
        o.line("continue;");
        o.close("}");
        o.line("self.conn.note_recovered(1);");
        o.line("return rt::Ok(Current { server_id, epoch });");
        o.close("}");
        o.close("}");
    }
}
