//! Generates one interface's Rust module: types, the `Server` trait and its
//! server stub, and the `Client` stub that tracks descriptors and rebuilds
//! them after the server's micro-reboots.

use crate::model::*;

/// Rust text, indented by four spaces per level.
struct Out {
    s: String,
    depth: usize,
}

impl Out {
    fn at(depth: usize) -> Self {
        Self {
            s: String::new(),
            depth,
        }
    }

    fn line(&mut self, l: impl AsRef<str>) {
        let l = l.as_ref();
        if !l.is_empty() {
            for _ in 0..self.depth {
                self.s.push_str("    ");
            }
            self.s.push_str(l);
        }
        self.s.push('\n');
    }

    fn lines(&mut self, ls: Vec<String>) {
        for l in ls {
            self.line(l);
        }
    }

    fn open(&mut self, l: impl AsRef<str>) {
        self.line(l);
        self.depth += 1;
    }

    fn close(&mut self, l: impl AsRef<str>) {
        self.depth -= 1;
        self.line(l);
    }
}

/// `NotFound` -> `not found`.
fn words(camel: &str) -> String {
    let mut s = String::new();
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            s.push(' ');
        }
        s.push(c.to_ascii_lowercase());
    }
    s
}

/// `OpenFile` -> `open_file`.
pub(crate) fn snake(camel: &str) -> String {
    words(camel).replace(' ', "_")
}

fn is_scalar(ty: &Type) -> bool {
    ty.is_int() || matches!(ty, Type::Bool | Type::Descriptor(_))
}

/// The wire method of a scalar (descriptors travel as their server's `u64` id).
fn wire_fn(ty: &Type) -> &'static str {
    match ty {
        Type::U8 => "u8",
        Type::U32 => "u32",
        Type::U64 | Type::Descriptor(_) => "u64",
        Type::I64 => "i64",
        Type::Bool => "bool",
        Type::Str => "str",
        Type::Bytes => "bytes",
        _ => unreachable!("not a wire primitive: {ty:?}"),
    }
}

/// An owned value of `ty`; descriptors as the server's `u64` ids.
fn owned(ty: &Type) -> String {
    match ty {
        Type::Unit => "()".into(),
        Type::Str => "rt::String".into(),
        Type::Bytes => "rt::Vec<u8>".into(),
        Type::List(t) => format!("rt::Vec<{}>", owned(t)),
        Type::Record(n) => n.clone(),
        Type::Descriptor(_) => "u64".into(),
        t => wire_fn(t).into(),
    }
}

/// An argument of `ty` as a borrowed parameter; descriptors as `u64` ids.
fn param(ty: &Type) -> String {
    match ty {
        Type::Str => "&str".into(),
        Type::Bytes => "&[u8]".into(),
        Type::List(t) => format!("&[{}]", owned(t)),
        Type::Record(n) => format!("&{n}"),
        t => owned(t),
    }
}

/// An argument of `ty` as a client passes it: descriptors as handles.
fn client_param(ty: &Type) -> String {
    match ty {
        Type::Descriptor(d) => d.clone(),
        t => param(t),
    }
}

fn rust_literal(lit: &Literal, ty: &Type) -> String {
    match (lit, ty) {
        (Literal::Str(s), Type::Bytes) => format!("{s:?}.as_bytes()"),
        (l, _) => l.idl(),
    }
}

/// Statements encoding `expr` (a reference if `by_ref`) into writer `w`;
/// `q` follows each fallible call (`?` or `.map_err(malformed)?`).
fn encode(ty: &Type, expr: &str, by_ref: bool, depth: usize, q: &str) -> Vec<String> {
    match ty {
        Type::Unit => vec![],
        Type::Str | Type::Bytes => {
            let r = if by_ref {
                expr.to_string()
            } else {
                format!("&{expr}")
            };
            vec![format!("w.{}({r}){q};", wire_fn(ty))]
        }
        Type::Record(_) => vec![format!("{expr}.encode(w){q};")],
        Type::List(t) => {
            let item = format!("item{depth}");
            let mut v = vec![
                format!("w.u32(list_len({expr}.len()){q}){q};"),
                format!("for {item} in {expr}.iter() {{"),
            ];
            v.extend(
                encode(t, &item, true, depth + 1, q)
                    .into_iter()
                    .map(|l| format!("    {l}")),
            );
            v.push("}".into());
            v
        }
        t => {
            let v = if by_ref {
                format!("*{expr}")
            } else {
                expr.to_string()
            };
            vec![format!("w.{}({v}){q};", wire_fn(t))]
        }
    }
}

/// Statements declaring `target` decoded from reader `r`: owned, or
/// borrowing `str`/`bytes` from the reader if `borrow`.
fn decode(ty: &Type, target: &str, borrow: bool, depth: usize, q: &str) -> Vec<String> {
    match ty {
        Type::Unit => vec![],
        Type::Str if !borrow => vec![format!("let {target} = r.str(){q}.to_owned();")],
        Type::Bytes if !borrow => vec![format!("let {target} = r.bytes(){q}.to_vec();")],
        Type::Record(n) => vec![format!("let {target} = {n}::decode(&mut r){q};")],
        Type::List(t) => {
            let (n, item) = (format!("n{depth}"), format!("item{depth}"));
            let mut v = vec![
                format!("let {n} = r.u32(){q};"),
                format!("let mut {target} = rt::Vec::with_capacity({n}.min(1024) as usize);"),
                format!("for _ in 0..{n} {{"),
            ];
            v.extend(
                decode(t, &item, false, depth + 1, q)
                    .into_iter()
                    .map(|l| format!("    {l}")),
            );
            v.push(format!("    {target}.push({item});"));
            v.push("}".into());
            v
        }
        t => vec![format!("let {target} = r.{}(){q};", wire_fn(t))],
    }
}

/// Functions take as many arguments as the interface says.
fn allow_many(o: &mut Out, params: usize) {
    if params > 7 {
        o.line("#[allow(clippy::too_many_arguments)]");
    }
}

/// Names the stubs give their own parameters and locals.
const LOCALS: &[&str] = &[
    "caller",
    "reuse",
    "out",
    "r",
    "w",
    "ret",
    "epoch",
    "e",
    "t",
    "id",
    "at",
    "record",
    "creator",
    "current",
    "entry",
    "server_id",
    "done",
    "published",
    "gone",
    "subtree",
    "child",
    "rebuilt",
    "request",
    "response",
    "func",
    "inner",
    "recoverer",
    "desc",
    "runtime",
    "server",
    "records",
    "globals",
];

/// The Rust name of IDL argument `name`: itself, unless the stubs name one
/// of their own locals so (`r`, `n0`, `fd_now`); then with a trailing `_`,
/// which no IDL name has. An interface may thus name its arguments freely.
fn ident(name: &str) -> String {
    let numbered = |p: &str| {
        name.strip_prefix(p)
            .is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
    };
    if LOCALS.contains(&name) || name.ends_with("_now") || numbered("n") || numbered("item") {
        format!("{name}_")
    } else {
        name.to_string()
    }
}

fn has_list(ty: &Type) -> bool {
    matches!(ty, Type::List(_))
}

struct Ctx<'a> {
    iface: &'a Interface,
}

pub(crate) fn generate(iface: &Interface) -> String {
    let cx = Ctx { iface };
    let mut body = Out::at(0);
    cx.types(&mut body);
    cx.server(&mut body);
    cx.client(&mut body);
    let mut o = Out::at(0);
    cx.header(&mut o);
    o.s + &body.s
}

/// A client method whose retried call needs no bookkeeping, as written by
/// `client_fn`, shortened: `retry(|| { match CALL { Ok(ret) => Ok(ret),
/// Err(e) => Err(e), } })` becomes `retry(|| CALL)`, and
/// `Ok(id) => Ok(D(id))` becomes `retry(|| CALL).map(D)`.
fn direct_retry(method: &str) -> String {
    let lines: Vec<&str> = method.lines().collect();
    let at = |i: usize| lines.get(i).map_or("", |l| l.trim());
    let Some(open) = lines.iter().position(|l| l.trim().ends_with("(|| {")) else {
        return method.to_string();
    };
    let opener = lines[open].trim().trim_end_matches('{');
    let call = match at(open + 1).strip_prefix("match ") {
        Some(rest) => rest.trim_end_matches(" {"),
        None => return method.to_string(),
    };
    let ok = at(open + 2);
    let map = if ok == "rt::Ok(ret) => rt::Ok(ret)," {
        String::new()
    } else if let Some(d) = ok
        .strip_prefix("rt::Ok(id) => rt::Ok(")
        .and_then(|r| r.strip_suffix("(id)),"))
    {
        format!(".map({d})")
    } else {
        return method.to_string();
    };
    let closer = at(open + 5);
    if at(open + 3) != "rt::Err(e) => rt::Err(e),"
        || at(open + 4) != "}"
        || !closer.starts_with('}')
    {
        return method.to_string();
    }
    let indent = &lines[open][..lines[open].len() - lines[open].trim_start().len()];
    let mut out: Vec<String> = lines[..open].iter().map(|l| l.to_string()).collect();
    out.push(format!("{indent}{opener}{call}{}{map}", &closer[1..]));
    out.extend(lines[open + 6..].iter().map(|l| l.to_string()));
    out.join("\n") + "\n"
}

impl Ctx<'_> {
    fn uses_lists(&self) -> bool {
        self.iface
            .functions
            .iter()
            .any(|f| has_list(&f.ret) || f.args.iter().any(|a| has_list(&a.ty)))
    }

    fn is_global(&self, desc: &str) -> bool {
        self.iface
            .descriptor(desc)
            .is_some_and(|d| d.namespace == Namespace::Global)
    }

    fn locals(&self) -> impl Iterator<Item = &Descriptor> {
        self.iface
            .descriptors
            .iter()
            .filter(|d| d.namespace == Namespace::Local)
    }

    fn globals(&self) -> impl Iterator<Item = &Descriptor> {
        self.iface
            .descriptors
            .iter()
            .filter(|d| d.namespace == Namespace::Global)
    }

    fn has_local(&self) -> bool {
        self.locals().next().is_some()
    }

    fn has_global(&self) -> bool {
        self.globals().next().is_some()
    }

    /// Global descriptors whose clients keep per-client fields.
    fn global_fields(&self) -> impl Iterator<Item = &Descriptor> {
        self.globals().filter(|d| !d.fields.is_empty())
    }

    /// The creator of a global descriptor gets the id to rebuild it with.
    fn reuses(&self, f: &Function) -> bool {
        f.role == Role::Create && matches!(&f.ret, Type::Descriptor(d) if self.is_global(d))
    }

    fn header(&self, o: &mut Out) {
        let i = self.iface;
        o.line(format!(
            "// Generated by kintsugi-idl from {}; do not edit.",
            i.path.display()
        ));
        o.line("");
        // Everything the stubs name from std and the runtime, under one path
        // that no name of the interface can shadow.
        o.line("use kintsugi_runtime::generated as rt;");
        o.line("");
        o.line(format!("/// Static facts about interface `{}`.", i.name));
        o.open("pub static INFO: rt::InterfaceInfo = rt::InterfaceInfo {");
        o.line(format!("name: {:?},", i.name));
        o.line(format!("hash: {:#018x},", i.hash()));
        let names: Vec<String> = i
            .functions
            .iter()
            .map(|f| format!("{:?}", f.name))
            .collect();
        o.line(format!("functions: &[{}],", names.join(", ")));
        o.close("};");
        o.line("");
        for f in &i.functions {
            o.line(format!(
                "pub const FN_{}: u32 = {};",
                f.name.to_uppercase(),
                f.id
            ));
        }
        o.line("");
    }

    fn types(&self, o: &mut Out) {
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

    fn global_types(&self, o: &mut Out, d: &Descriptor) {
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
        o.line("");
    }

    fn local_types(&self, o: &mut Out, d: &Descriptor) {
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

    fn server(&self, o: &mut Out) {
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
    fn ensure_fn(&self, o: &mut Out, d: &Descriptor) {
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

    fn serve_fn(&self, o: &mut Out, f: &Function) {
        let q = ".map_err(rt::malformed)?";
        o.open(format!("FN_{} => {{", f.name.to_uppercase()));
        for a in &f.args {
            o.lines(decode(&a.ty, &ident(&a.name), true, 0, q));
        }
        o.line(format!("r.finish(){q};"));
        for a in &f.args {
            if let Some((lo, hi)) = a.range {
                o.open(format!(
                    "if !({lo}..={hi}).contains(&{}) {{",
                    ident(&a.name)
                ));
                o.line(format!("return rt::Err(rt::out_of_range({:?}));", a.name));
                o.close("}");
            }
            if let Some(max) = a.max {
                o.open(format!("if {}.len() > {max} {{", ident(&a.name)));
                o.line(format!("return rt::Err(rt::out_of_range({:?}));", a.name));
                o.close("}");
            }
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
                    "w.bytes_with(usize::MAX, |out| S::{}({})){q}.map_err(rt::app_error)?;",
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
                o.lines(encode(ret, "ret", false, 0, q));
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

    fn client(&self, o: &mut Out) {
        let i = self.iface;
        // Raw invocations.
        // The client.
        o.line(format!(
            "/// The client stub of `{}`. It tracks the descriptors it hands out and,",
            i.name
        ));
        o.line("/// when the server has been micro-rebooted, rebuilds each one the next time");
        o.line("/// it is used (or at once, when the server recovers eagerly), so that callers");
        o.line("/// do not notice the reboot.");
        o.line("pub struct Client(rt::Arc<Inner>);");
        o.line("");
        o.line("/// The connection and the tracked descriptors, shared with the recovery upcall.");
        o.open("struct Inner {");
        o.line("conn: rt::Connection,");
        for d in self.locals() {
            o.line(format!(
                "{}s: rt::DescTable<{}Record>,",
                snake(&d.name),
                d.name
            ));
        }
        for d in self.global_fields() {
            o.line(format!(
                "{}s: rt::FieldTable<{}Record>,",
                snake(&d.name),
                d.name
            ));
        }
        if self.has_local() {
            o.line("/// Held while a descriptor is rebuilt, so that it is rebuilt once.");
            o.line("recovery: rt::Mutex<()>,");
        }
        o.close("}");
        o.line("");
        o.open("impl Client {");
        o.line(format!(
            "/// Connects to the `{}` server the system description grants this component.",
            i.name
        ));
        o.open("pub fn connect(runtime: &rt::Runtime) -> rt::Result<Self, rt::ConnectError> {");
        o.line("runtime.connect(&INFO).map(Self::from_connection)");
        o.close("}");
        o.line("");
        o.open("pub fn from_connection(conn: rt::Connection) -> Self {");
        o.open("let inner = rt::Arc::new(Inner {");
        o.line("conn,");
        for d in self.locals() {
            o.line(format!("{}s: rt::DescTable::default(),", snake(&d.name)));
        }
        for d in self.global_fields() {
            o.line(format!("{}s: rt::FieldTable::default(),", snake(&d.name)));
        }
        if self.has_local() {
            o.line("recovery: rt::Mutex::new(()),");
        }
        o.close("});");
        if self.has_local() {
            o.line("let recoverer: rt::Weak<dyn rt::Recover> = rt::Arc::downgrade(&inner) as rt::Weak<Inner>;");
            o.line("inner.conn.register_recoverer(recoverer);");
        }
        o.line("Self(inner)");
        o.close("}");
        o.line("");
        o.open("pub fn connection(&self) -> &rt::Connection {");
        o.line("&self.0.conn");
        o.close("}");
        for d in self.locals().chain(self.global_fields()) {
            let s = snake(&d.name);
            o.line("");
            o.line(format!(
                "/// How many `{}` descriptors this client tracks.",
                d.name
            ));
            o.open(format!("pub fn tracked_{s}s(&self) -> usize {{"));
            o.line(format!("self.0.{s}s.len()"));
            o.close("}");
        }
        if self.has_local() {
            o.line("");
            o.line("/// Rebuilds every descriptor the server's current incarnation lacks, now");
            o.line("/// (what eager recovery does at reboot); returns how many.");
            o.open("pub fn recover_all(&self) -> u64 {");
            o.line("rt::Recover::recover_all(&*self.0)");
            o.close("}");
        }
        for f in &i.functions {
            o.line("");
            let mut method = Out::at(o.depth);
            self.client_fn(&mut method, f);
            o.s.push_str(&direct_retry(&method.s));
        }
        o.close("}");
        o.line("");
        o.open("impl Inner {");
        // The invocations as they go on the wire (`raw_<function>`):
        // descriptors as the server's ids, and faults left to the caller.
        for (n, f) in i.functions.iter().enumerate() {
            if n > 0 {
                o.line("");
            }
            self.raw_fn(o, f);
        }
        for d in self.locals() {
            o.line("");
            self.recovery_fns(o, d);
        }
        o.close("}");
        if self.has_local() {
            o.line("");
            o.open("impl rt::Recover for Inner {");
            o.open("fn recover_all(&self) -> u64 {");
            o.line("let epoch = self.conn.epoch();");
            o.line("let mut rebuilt = 0;");
            for d in self.locals() {
                let s = snake(&d.name);
                o.open(format!("for id in self.{s}s.stale(epoch) {{"));
                o.open(format!("if self.current_{s}({}(id)).is_ok() {{", d.name));
                o.line("rebuilt += 1;");
                o.close("}");
                o.close("}");
            }
            o.line("rebuilt");
            o.close("}");
            o.close("}");
        }
    }

    fn raw_fn(&self, o: &mut Out, f: &Function) {
        let mut params = vec!["&self".to_string(), "epoch: rt::Option<u64>".to_string()];
        params.extend(
            f.args
                .iter()
                .map(|a| format!("{}: {}", ident(&a.name), param(&a.ty))),
        );
        allow_many(o, params.len());
        o.open(format!(
            "fn raw_{}({}) -> rt::Result<{}, rt::CallError<Error>> {{",
            f.name,
            params.join(", "),
            owned(&f.ret)
        ));
        o.open(format!(
            "self.conn.invoke(FN_{}, epoch,",
            f.name.to_uppercase()
        ));
        if f.args.is_empty() {
            o.line("|_| rt::Ok(()),");
        } else {
            let statements: Vec<String> = f
                .args
                .iter()
                .flat_map(|a| encode(&a.ty, &ident(&a.name), !is_scalar(&a.ty), 0, "?"))
                .collect();
            match statements.as_slice() {
                [one] if one.starts_with("w.") && one.ends_with("?;") => {
                    o.line(format!("|w| {},", &one[..one.len() - 2]));
                }
                _ => {
                    o.open("|w| {");
                    o.lines(statements);
                    o.line("rt::Ok(())");
                    o.close("},");
                }
            }
        }
        let decoded = decode(&f.ret, "ret", false, 0, "?");
        let single = match decoded.as_slice() {
            [one] => one
                .strip_prefix("let ret = ")
                .and_then(|e| e.strip_suffix(';')),
            _ => None,
        };
        if let Some(expr) = single.filter(|e| e.starts_with("r.") && !e.contains("(&mut r)")) {
            // One read: `|r| r.u64()`, or `|r| Ok(r.str()?.to_owned())`.
            match expr.strip_suffix('?').filter(|e| !e.contains('?')) {
                Some(read) => o.line(format!("|r| {read},")),
                None => o.line(format!("|r| rt::Ok({expr}),")),
            }
        } else if f.ret == Type::Unit {
            o.line("|_| rt::Ok(()),");
        } else {
            o.open("|r| {");
            // `r` is already the `&mut Reader` a record's `decode` takes.
            o.lines(
                decode(&f.ret, "ret", false, 0, "?")
                    .into_iter()
                    .map(|l| l.replace("(&mut r)", "(r)"))
                    .collect(),
            );
            o.line("rt::Ok(ret)");
            o.close("},");
        }
        o.close(")");
        o.close("}");
    }

    /// `self.0.{table}.update(..)` applying `body` to descriptor argument `a`'s
    /// tracked record, which `body` names `@`.
    fn update(&self, f: &Function, a: &str, body: String) -> String {
        let d = match f.arg_type(a) {
            Some(Type::Descriptor(d)) => d,
            _ => unreachable!("checked"),
        };
        // `{name}_now` is the generated local holding where the descriptor
        // lives; `ident` never ends so, as an argument's name is renamed if it does.
        let (name, a) = (a, ident(a));
        if self.is_global(d) {
            let body = body.replace("@.", "t.");
            return format!("self.0.{}s.update({a}.0, |t| {body});", snake(d));
        }
        // A call's effect lands on a descriptor that another thread may have
        // rebuilt since the call (eager recovery) from the record without
        // it: then its server descriptor lags, and the next use rebuilds it
        // again (epoch 0 is no server's).
        let body = body.replace("@.", "t.record.");
        format!(
            "self.0.{}s.update({a}.0, |t| {{ {body}; if t.epoch != {name}_now.epoch {{ t.epoch = 0; }} }});",
            snake(d)
        )
    }

    fn client_fn(&self, o: &mut Out, f: &Function) {
        let i = self.iface;
        let ret = match &f.ret {
            Type::Descriptor(d) => d.clone(),
            t => owned(t),
        };
        let mut params = vec!["&self".to_string()];
        params.extend(
            f.passed_args()
                .map(|a| format!("{}: {}", ident(&a.name), client_param(&a.ty))),
        );
        let role = match f.role {
            Role::Create => " Creates a descriptor.",
            Role::Terminal => " Closes the descriptor.",
            Role::Plain if f.block => " May block; re-issued if the server reboots meanwhile.",
            Role::Plain => "",
        };
        o.line(format!("/// Invokes `{}`.{role}", f.name));
        allow_many(o, params.len());
        o.open(format!(
            "pub fn {}({}) -> rt::Result<{ret}, rt::CallError<Error>> {{",
            f.name,
            params.join(", ")
        ));
        let retry_ok = !f.retry_ok.is_empty();
        // A global descriptor's close whose first attempt was interrupted
        // may have closed it: the retry then finds no such descriptor.
        let global_close = f.role == Role::Terminal
            && f.descriptor_args()
                .next()
                .is_some_and(|(_, d)| self.is_global(d));
        // Each attempt is a closure the runtime retries; a call that an
        // interrupted attempt may have done already goes to
        // `retry_idempotent`, which takes its duplicate's complaint for success.
        // What a global close must forget once it is done.
        let forget_after = f
            .descriptor_args()
            .next()
            .filter(|_| global_close)
            .and_then(|(a, d)| self.forget(a, d));
        if forget_after.is_some() {
            o.open("let done = rt::retry_idempotent(|| {");
        } else if retry_ok || global_close {
            o.open("rt::retry_idempotent(|| {");
        } else {
            o.open("rt::retry(|| {");
        }
        let locals: Vec<(&Arg, &str)> = f
            .descriptor_args()
            .filter(|(_, d)| !self.is_global(d))
            .collect();
        let epoch = match (f.role, locals.first()) {
            (Role::Create, _) if self.reuses(f) => "rt::None".to_string(),
            (Role::Create, _) => {
                o.line("let epoch = self.0.conn.epoch();");
                "rt::Some(epoch)".to_string()
            }
            (Role::Terminal, Some((a, d))) => {
                let s = snake(d);
                o.line(format!(
                    "let {}_now = self.0.peek_{s}({})?;",
                    a.name,
                    ident(&a.name)
                ));
                o.open(format!("if {}_now.epoch != self.0.conn.epoch() {{", a.name));
                o.line(format!("// The server rebooted since `{}` was built: its new incarnation never had it.", a.name));
                if let Some(forget) = self.forget(a, d) {
                    o.line(forget);
                }
                o.line("return rt::Ok(());");
                o.close("}");
                format!("rt::Some({}_now.epoch)", a.name)
            }
            (_, Some((first, _))) => {
                for (a, d) in &locals {
                    o.line(format!(
                        "let {}_now = self.0.current_{}({})?;",
                        a.name,
                        snake(d),
                        ident(&a.name)
                    ));
                }
                for (a, _) in &locals[1..] {
                    o.open(format!(
                        "if {}_now.epoch != {}_now.epoch {{",
                        a.name, first.name
                    ));
                    // Rebuilt in different incarnations: try again.
                    o.line("return rt::Err(rt::CallError::Fault(rt::Fault::Stale));");
                    o.close("}");
                }
                format!("rt::Some({}_now.epoch)", first.name)
            }
            (_, None) => "rt::None".to_string(),
        };
        for a in &f.args {
            let Some(r) = &a.from else { continue };
            let d = match f.arg_type(&r.arg) {
                Some(Type::Descriptor(d)) => d,
                _ => unreachable!("checked"),
            };
            if self.is_global(d) {
                o.line(format!(
                    "let {} = self.0.{}s.get({}.0).{};",
                    ident(&a.name),
                    snake(d),
                    ident(&r.arg),
                    r.field
                ));
            } else {
                o.line(format!(
                    "let {} = self.0.{}s.get({}.0).ok_or(rt::CallError::BadDescriptor({}.0))?.record.{};",
                    ident(&a.name),
                    snake(d),
                    ident(&r.arg),
                    ident(&r.arg),
                    r.field
                ));
            }
        }
        let mut args = vec![epoch];
        args.extend(f.args.iter().map(|a| match &a.ty {
            Type::Descriptor(d) if self.is_global(d) => format!("{}.0", ident(&a.name)),
            Type::Descriptor(_) => format!("{}_now.server_id", a.name),
            _ => ident(&a.name),
        }));
        o.open(format!(
            "match self.0.raw_{}({}) {{",
            f.name,
            args.join(", ")
        ));
        // Success: apply the call's effect on the tracked descriptors.
        let mut effects: Vec<String> = Vec::new();
        let as_u64 = |ty: &Type| match ty {
            Type::Bytes => "ret.len() as u64",
            Type::U64 => "ret",
            _ => "u64::from(ret)",
        };
        if let Some(r) = &f.advance {
            let field = format!("@.{}", r.field);
            effects.push(self.update(
                f,
                &r.arg,
                format!("{field} = {field}.wrapping_add({})", as_u64(&f.ret)),
            ));
        }
        if let Some(r) = &f.store {
            effects.push(self.update(f, &r.arg, format!("@.{} = {}", r.field, as_u64(&f.ret))));
        }
        for a in &f.args {
            if let Some(r) = &a.set {
                effects.push(self.update(f, &r.arg, format!("@.{} = {}", r.field, ident(&a.name))));
            }
        }
        if let (Some((_, to, _)), Some((d, desc))) = (&f.transition, locals.first()) {
            let desc = i.descriptor(desc).expect("checked");
            let mut sets = vec![format!("@.state = {};", desc.state(to).expect("checked"))];
            for a in f.args.iter().filter(|a| a.remember) {
                let v = match a.ty {
                    Type::Str => format!("{}.to_owned()", ident(&a.name)),
                    Type::Bytes | Type::List(_) => format!("{}.to_vec()", ident(&a.name)),
                    Type::Record(_) => format!("{}.clone()", ident(&a.name)),
                    _ => ident(&a.name),
                };
                sets.push(format!("@.{}_{} = {v};", f.name, a.name));
            }
            effects.push(self.update(f, &d.name, format!("{{ {} }}", sets.join(" "))));
        }
        match (&f.role, &f.ret) {
            (Role::Create, Type::Descriptor(d)) if self.is_global(d) => {
                o.line(format!("rt::Ok(id) => rt::Ok({d}(id)),"));
            }
            (Role::Create, Type::Descriptor(d)) => {
                let creator = i.creator(d).expect("checked");
                let desc = i.descriptor(d).expect("checked");
                o.open("rt::Ok(server_id) => {");
                let mut fields: Vec<String> = creator
                    .args
                    .iter()
                    .filter(|a| a.remember)
                    .map(|a| {
                        let v = match a.ty {
                            Type::Str => format!("{}.to_owned()", ident(&a.name)),
                            Type::Bytes | Type::List(_) => format!("{}.to_vec()", ident(&a.name)),
                            Type::Record(_) => format!("{}.clone()", ident(&a.name)),
                            _ => ident(&a.name),
                        };
                        if v == a.name {
                            v
                        } else {
                            format!("{}: {v}", a.name)
                        }
                    })
                    .collect();
                let all = fields.len()
                    == creator.args.iter().filter(|a| a.remember).count()
                        + desc.fields.len()
                        + usize::from(!desc.states.is_empty())
                        + i.transitions(d)
                            .map(|t| t.args.iter().filter(|a| a.remember).count())
                            .sum::<usize>();
                if !all {
                    fields.push("..rt::Default::default()".into());
                }
                let record = if fields.is_empty() {
                    format!("{d}Record {{}}")
                } else {
                    format!("{d}Record {{ {} }}", fields.join(", "))
                };
                o.line(format!("let record = {record};"));
                o.line(format!(
                    "rt::Ok({d}(self.0.{}s.insert(server_id, epoch, record)))",
                    snake(d)
                ));
                o.close("}");
            }
            // A global close forgets after `retry_idempotent`, which may
            // report the duplicate's success.
            (Role::Terminal, _) if global_close => o.line("rt::Ok(ret) => rt::Ok(ret),"),
            (Role::Terminal, _) => {
                let (a, d) = f.descriptor_args().next().expect("checked");
                o.open("rt::Ok(()) => {");
                if let Some(forget) = self.forget(a, d) {
                    o.line(forget);
                }
                o.line("rt::Ok(())");
                o.close("}");
            }
            _ if effects.is_empty() => o.line("rt::Ok(ret) => rt::Ok(ret),"),
            _ => {
                o.open("rt::Ok(ret) => {");
                o.lines(effects);
                o.line("rt::Ok(ret)");
                o.close("}");
            }
        }
        o.line("rt::Err(e) => rt::Err(e),");
        o.close("}");
        if retry_ok {
            let errs: Vec<String> = f.retry_ok.iter().map(|e| format!("Error::{e}")).collect();
            o.close(format!(
                "}}, |e| matches!(e, rt::CallError::Server({})))",
                errs.join(" | ")
            ));
        } else if !global_close {
            o.close("})");
        } else if forget_after.is_none() {
            o.close("}, |e| matches!(e, rt::CallError::Fault(rt::Fault::NoDescriptor(_))))");
        } else {
            o.close("}, |e| matches!(e, rt::CallError::Fault(rt::Fault::NoDescriptor(_))));");
            o.open("if done.is_ok() {");
            o.lines(forget_after.into_iter().collect());
            o.close("}");
            o.line("done");
        }
        o.close("}");
    }

    /// The statement that stops tracking descriptor argument `a` after it
    /// was closed, if the client stub tracks it at all.
    fn forget(&self, a: &Arg, d: &str) -> Option<String> {
        let desc = self.iface.descriptor(d).expect("checked");
        // A global descriptor is tracked only for its fields.
        let tracked = desc.namespace == Namespace::Local || !desc.fields.is_empty();
        tracked.then(|| format!("self.0.{}s.remove({}.0);", snake(d), ident(&a.name)))
    }

    /// Arguments replaying `f` for the descriptor rebuilt as `server_id`,
    /// from its tracked record `entry.record`.
    fn replay_args(&self, f: &Function, prefix: &str) -> Vec<String> {
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
    fn replay_call(&self, o: &mut Out, f: &Function, args: Vec<String>, bind: &str) {
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

    fn recovery_fns(&self, o: &mut Out, d: &Descriptor) {
        let i = self.iface;
        let s = snake(&d.name);
        let creator = i.creator(&d.name).expect("checked");
        o.line(format!("/// Where `{s}` lives now, without rebuilding it."));
        o.open(format!(
            "fn peek_{s}(&self, desc: {}) -> rt::Result<Current, rt::CallError<Error>> {{",
            d.name
        ));
        o.line("let mut current = rt::None;");
        o.line(format!(
            "self.{s}s.update(desc.0, |t| current = rt::Some(Current {{ server_id: t.server_id, epoch: t.epoch }}));"
        ));
        o.line("current.ok_or(rt::CallError::BadDescriptor(desc.0))");
        o.close("}");
        o.line("");
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
