//! The `Server` trait and the server stub: decode and check each
//! invocation (refusing malformed and out-of-range arguments), rebuild
//! global descriptors from their creation records, call the server.

use super::wire::*;
use super::{ident, out_of_range, snake, Ctx, Out};
use crate::model::*;

impl Ctx<'_> {
    pub(super) fn server(&self, o: &mut Out) {
        let i = self.iface;
        o.line(format!(
            "/// What a component implements to serve `{}`. Descriptors are the",
            i.name
        ));
        o.line("/// server's own `u64` ids; the client stubs map them to stable handles.");
        o.open("pub trait Server: rt::Send + rt::Sync + 'static {");
        for (n, f) in i.functions.iter().enumerate() {
            if n > 0 {
                o.line("");
            }
            let mut params = vec!["&self".to_string(), "caller: &rt::Caller".to_string()];
            if self.reuses(f) {
                o.line(
                    "/// With `reuse`, the stub rebuilds a descriptor after a reboot: create it",
                );
                o.line("/// again with exactly that id, for `caller` (its creator).");
                params.push("reuse: rt::Option<u64>".into());
            }
            params.extend(
                f.args
                    .iter()
                    .map(|a| format!("{}: {}", ident(&a.name), param(&a.ty))),
            );
            let ret = if f.ret == Type::Bytes {
                o.line("/// Writes the result into `out` and returns its length.");
                params.push("out: &mut [u8]".into());
                "usize".to_string()
            } else {
                owned(&f.ret)
            };
            allow_many(o, params.len());
            o.line(format!(
                "fn {}({}) -> rt::Result<{ret}, Error>;",
                f.name,
                params.join(", ")
            ));
        }
        o.line("");
        o.line("/// Client component `client` died: release what it held.");
        o.open("fn client_died(&self, client: u32) {");
        o.line("let _ = client;");
        o.close("}");
        o.line("");
        o.line("/// Checks the server's own state, with no call in flight, before a");
        o.line("/// checkpoint keeps it: an error (what is wrong) has a checkpoint-");
        o.line("/// recovered server killed and recovered from its last sound checkpoint.");
        o.open("fn audit(&self) -> rt::Result<(), rt::String> {");
        o.line("rt::Ok(())");
        o.close("}");
        o.close("}");
        o.line("");
        o.line("/// The server stub: decodes and checks invocations, then calls `server`.");
        if self.has_global() {
            o.line(
                "/// `records` keeps the creation records of global descriptors across reboots.",
            );
            o.open("pub fn service<S: Server>(server: rt::Arc<S>, records: rt::Arc<dyn rt::RecordStore>) -> rt::Arc<dyn rt::Service> {");
            o.line("let globals = rt::GlobalRecords::new(records, INFO.name);");
            o.line("rt::Arc::new(ServerStub { server, globals })");
        } else {
            o.open("pub fn service<S: Server>(server: rt::Arc<S>) -> rt::Arc<dyn rt::Service> {");
            o.line("rt::Arc::new(ServerStub { server })");
        }
        o.close("}");
        o.line("");
        o.open("struct ServerStub<S> {");
        o.line("server: rt::Arc<S>,");
        if self.has_global() {
            o.line("globals: rt::GlobalRecords,");
        }
        o.close("}");
        o.line("");
        o.open("impl<S: Server> rt::Service for ServerStub<S> {");
        o.open("fn interface(&self) -> &'static rt::InterfaceInfo {");
        o.line("&INFO");
        o.close("}");
        o.line("");
        o.open("fn client_died(&self, client: u32) {");
        o.line("self.server.client_died(client)");
        o.close("}");
        o.line("");
        o.open("fn audit(&self) -> rt::Result<(), rt::String> {");
        o.line("self.server.audit()");
        o.close("}");
        o.line("");
        o.open("fn dispatch(&self, caller: &rt::Caller, func: u32, request: &[u8], response: &mut [u8]) -> rt::Dispatched {");
        let r = if i.functions.iter().any(|f| !f.args.is_empty()) {
            "mut r"
        } else {
            "r"
        };
        let w = if i.functions.iter().any(|f| f.ret != Type::Unit) {
            "w"
        } else {
            "_"
        };
        o.open(format!(
            "rt::serve(request, response, |{r}, {w}| match func {{"
        ));
        for f in &i.functions {
            self.serve_fn(o, f);
        }
        o.line("_ => rt::Err(rt::Dispatched::Refused(rt::Refusal::UnknownFunction(func))),");
        o.close("})");
        o.close("}");
        o.close("}");
        o.line("");

        if self.has_global() {
            o.open("impl<S: Server> ServerStub<S> {");
            for (n, d) in self.globals().enumerate() {
                if n > 0 {
                    o.line("");
                }
                self.ensure_fn(o, d);
            }
            o.close("}");
            o.line("");
        }

        if self.uses_lists() {
            o.open("fn list_len(n: usize) -> rt::Result<u32, rt::WireError> {");
            o.line("u32::try_from(n).map_err(|_| rt::WireError::Overflow)");
            o.close("}");
            o.line("");
        }
    }

    /// Rebuilds a global descriptor (and the ancestors it depends on) from
    /// its creation records, the first time the incarnation sees it.
    pub(super) fn ensure_fn(&self, o: &mut Out, d: &Descriptor) {
        let q = ".map_err(rt::malformed)?";
        o.line(format!(
            "/// Makes sure this incarnation holds `{}` `id`, rebuilding it (parents first) from",
            d.name
        ));
        o.line("/// its creation record if it was created in an earlier one.");
        o.open(format!(
            "fn ensure_{}(&self, id: u64) -> rt::Result<(), rt::Dispatched> {{",
            snake(&d.name)
        ));
        o.open(format!(
            "self.globals.ensure({:?}, id, |at, record, creator| {{",
            d.name
        ));
        o.line("let mut r = rt::Reader::new(&record.args);");
        o.open("match record.func {");
        for creator in self.iface.creators(&d.name) {
            o.open(format!("FN_{} => {{", creator.name.to_uppercase()));
            for a in &creator.args {
                let target = if a.replay.is_some() {
                    format!("_{}", a.name)
                } else {
                    ident(&a.name)
                };
                o.lines(decode(&a.ty, &target, true, 0, q));
                if let Some(lit) = &a.replay {
                    o.line(format!(
                        "let {} = {};",
                        ident(&a.name),
                        rust_literal(lit, &a.ty)
                    ));
                }
            }
            o.line(format!("r.finish(){q};"));
            let mut args = vec![
                "&self.server".to_string(),
                "creator".to_string(),
                "rt::Some(at)".to_string(),
            ];
            args.extend(creator.args.iter().map(|a| match a.ty {
                Type::List(_) | Type::Record(_) => format!("&{}", ident(&a.name)),
                _ => ident(&a.name),
            }));
            o.line(format!(
                "S::{}({}).map_err(rt::app_error)",
                creator.name,
                args.join(", ")
            ));
            o.close("}");
        }
        o.line("_ => rt::Err(rt::Dispatched::Refused(rt::Refusal::UnknownDescriptor(at))),");
        o.close("}");
        o.close("})");
        o.close("}");
    }

    pub(super) fn serve_fn(&self, o: &mut Out, f: &Function) {
        let q = ".map_err(rt::malformed)?";
        // Encoding a result fails only when it does not fit in the slot.
        let too_large = ".map_err(rt::too_large)?";
        o.open(format!("FN_{} => {{", f.name.to_uppercase()));
        for a in &f.args {
            o.lines(decode(&a.ty, &ident(&a.name), true, 0, q));
        }
        o.line(format!("r.finish(){q};"));
        for (check, name) in out_of_range(f) {
            o.open(format!("if {check} {{"));
            o.line(format!("return rt::Err(rt::out_of_range({name:?}));"));
            o.close("}");
        }
        for (a, d) in f.descriptor_args().filter(|(_, d)| self.is_global(d)) {
            o.line(format!("self.ensure_{}({})?;", snake(d), ident(&a.name)));
        }
        // A global terminal closes what the records say it holds, so every
        // descendant must be rebuilt first for the server to close it.
        let global_terminal = match (f.role, f.descriptor_args().next()) {
            (Role::Terminal, Some((a, d))) if self.is_global(d) => {
                let desc = self.iface.descriptor(d).expect("checked");
                if desc.close == Close::Own {
                    o.line(format!("let gone = [{}];", ident(&a.name)));
                } else {
                    o.line(format!("let mut gone = vec![{}];", ident(&a.name)));
                    o.line(format!(
                        "let subtree = self.globals.subtree({:?}, {}).map_err(rt::records_unavailable)?;",
                        d, ident(&a.name)
                    ));
                    o.open("for &child in &subtree {");
                    o.line(format!("self.ensure_{}(child)?;", snake(d)));
                    o.close("}");
                    o.line("gone.extend(subtree);");
                }
                Some(d)
            }
            _ => None,
        };
        // `S::name(&self.server, ..)` rather than `self.server.name(..)`:
        // `Arc`'s own methods (`drop`, `clone`, ...) must not shadow the server's.
        let mut args = vec!["&self.server".to_string(), "caller".to_string()];
        if self.reuses(f) {
            args.push("rt::None".into());
        }
        args.extend(f.args.iter().map(|a| match a.ty {
            Type::List(_) | Type::Record(_) => format!("&{}", ident(&a.name)),
            _ => ident(&a.name),
        }));
        match &f.ret {
            Type::Bytes => {
                args.push("out".into());
                o.line(format!(
                    "w.bytes_with(usize::MAX, |out| S::{}({})){too_large}.map_err(rt::app_error)?;",
                    f.name,
                    args.join(", ")
                ));
            }
            Type::Unit if global_terminal.is_none() => {
                // The server's answer is the arm's.
                o.line(format!(
                    "S::{}({}).map_err(rt::app_error)",
                    f.name,
                    args.join(", ")
                ));
                o.close("}");
                return;
            }
            Type::Unit => o.line(format!(
                "S::{}({}).map_err(rt::app_error)?;",
                f.name,
                args.join(", ")
            )),
            ret => {
                o.line(format!(
                    "let ret = S::{}({}).map_err(rt::app_error)?;",
                    f.name,
                    args.join(", ")
                ));
                if let (true, Type::Descriptor(d)) = (self.reuses(f), ret) {
                    let parent = f
                        .args
                        .iter()
                        .find(|a| a.parent)
                        .map_or("rt::None".to_string(), |a| {
                            format!("rt::Some({})", ident(&a.name))
                        });
                    o.line(format!(
                        "self.globals.record_creation({d:?}, ret, FN_{}, caller, {parent}, request)?;",
                        f.name.to_uppercase()
                    ));
                }
                o.lines(encode(ret, "ret", false, 0, too_large));
            }
        }
        if let Some(d) = global_terminal {
            o.line(format!(
                "self.globals.closed({d:?}, &gone).map_err(rt::records_unavailable)?;"
            ));
        }
        o.line("rt::Ok(())");
        o.close("}");
    }
}
