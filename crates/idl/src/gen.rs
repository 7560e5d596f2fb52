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
        Type::Str => "String".into(),
        Type::Bytes => "Vec<u8>".into(),
        Type::List(t) => format!("Vec<{}>", owned(t)),
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
                format!("let mut {target} = Vec::with_capacity({n}.min(1024) as usize);"),
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

fn has_list(ty: &Type) -> bool {
    matches!(ty, Type::List(_))
}

struct Ctx<'a> {
    iface: &'a Interface,
}

pub(crate) fn generate(iface: &Interface) -> String {
    let cx = Ctx { iface };
    let mut o = Out {
        s: String::new(),
        depth: 0,
    };
    cx.header(&mut o);
    cx.types(&mut o);
    cx.server(&mut o);
    cx.client(&mut o);
    o.s
}

impl Ctx<'_> {
    fn uses_lists(&self) -> bool {
        self.iface
            .functions
            .iter()
            .any(|f| has_list(&f.ret) || f.args.iter().any(|a| has_list(&a.ty)))
    }

    fn header(&self, o: &mut Out) {
        let i = self.iface;
        o.line(format!(
            "// Generated by kintsugi-idl from {}; do not edit.",
            i.path.display()
        ));
        o.line("");
        o.line("use std::sync::Arc;");
        if !i.descriptors.is_empty() {
            o.line("use std::sync::Mutex;");
        }
        o.line("");
        let mut stub = vec!["CallError", "Caller"];
        if !i.descriptors.is_empty() {
            stub.push("DescTable");
        }
        stub.extend([
            "Dispatched",
            "Fault",
            "InterfaceInfo",
            "Refusal",
            "ReplyStatus",
            "Service",
        ]);
        o.line(format!(
            "use kintsugi_runtime::stub::{{{}}};",
            stub.join(", ")
        ));
        o.line("use kintsugi_runtime::wire::{Reader, WireError, Writer};");
        o.line("use kintsugi_runtime::{ConnectError, Connection, Runtime};");
        o.line("");
        o.line(format!("/// Static facts about interface `{}`.", i.name));
        o.open("pub static INFO: InterfaceInfo = InterfaceInfo {");
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
            o.line(format!("/// Function id of `{}`.", f.name));
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
        o.line(format!("/// The errors of interface `{}`.", i.name));
        o.line("#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]");
        o.open("pub enum Error {");
        for e in &i.errors {
            o.line(format!("{},", e.name));
        }
        o.close("}");
        o.line("");
        o.open("impl Error {");
        o.line("/// The error's code on the wire: 1, 2, ... in declaration order.");
        o.open("pub fn code(self) -> u32 {");
        o.open("match self {");
        for e in &i.errors {
            o.line(format!("Error::{} => {},", e.name, e.code));
        }
        o.close("}");
        o.close("}");
        o.line("");
        o.open("pub fn from_code(code: u32) -> Option<Error> {");
        if i.errors.is_empty() {
            o.line("let _ = code;");
            o.line("None");
        } else {
            o.open("match code {");
            for e in &i.errors {
                o.line(format!("{} => Some(Error::{}),", e.code, e.name));
            }
            o.line("_ => None,");
            o.close("}");
        }
        o.close("}");
        o.close("}");
        o.line("");
        o.open("impl std::fmt::Display for Error {");
        o.open("fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {");
        if i.errors.is_empty() {
            o.line("let _ = f;");
            o.line("match *self {}");
        } else {
            o.open("f.write_str(match *self {");
            for e in &i.errors {
                o.line(format!("Error::{} => {:?},", e.name, words(&e.name)));
            }
            o.close("})");
        }
        o.close("}");
        o.close("}");
        o.line("");
        o.line("impl std::error::Error for Error {}");
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
            o.open("fn encode(&self, w: &mut Writer<'_>) -> Result<(), WireError> {");
            for f in &r.fields {
                o.lines(encode(&f.ty, &format!("self.{}", f.name), false, 0, "?"));
            }
            o.line("Ok(())");
            o.close("}");
            o.line("");
            o.open("fn decode(r: &mut Reader<'_>) -> Result<Self, WireError> {");
            o.open(format!("Ok({} {{", r.name));
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
            o.line("#[derive(Debug, Clone, Default)]");
            o.open(format!("pub struct {}Record {{", d.name));
            for a in creator.args.iter().filter(|a| a.remember) {
                o.line(format!("/// `{}` as passed to `{}`.", a.name, creator.name));
                o.line(format!("pub {}: {},", a.name, owned(&a.ty)));
            }
            for f in &d.fields {
                o.line(format!("/// Tracked field `{}`.", f.name));
                o.line(format!("pub {}: u64,", f.name));
            }
            o.close("}");
            o.line("");
        }
        if !i.descriptors.is_empty() {
            o.line("/// Where a descriptor lives in the server's current incarnation.");
            o.line("#[derive(Debug, Clone, Copy)]");
            o.open("struct Current {");
            o.line("server_id: u64,");
            o.line("epoch: u64,");
            o.close("}");
            o.line("");
        }
    }

    fn server(&self, o: &mut Out) {
        let i = self.iface;
        o.line(format!(
            "/// What a component implements to serve `{}`. Descriptors are the",
            i.name
        ));
        o.line("/// server's own `u64` ids; the client stubs map them to stable handles.");
        o.open("pub trait Server: Send + Sync + 'static {");
        for (n, f) in i.functions.iter().enumerate() {
            if n > 0 {
                o.line("");
            }
            let mut params = vec!["&self".to_string(), "caller: &Caller".to_string()];
            params.extend(
                f.args
                    .iter()
                    .map(|a| format!("{}: {}", a.name, param(&a.ty))),
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
                "fn {}({}) -> Result<{ret}, Error>;",
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
        o.open("pub fn service<S: Server>(server: Arc<S>) -> Arc<dyn Service> {");
        o.line("Arc::new(ServerStub(server))");
        o.close("}");
        o.line("");
        o.line("struct ServerStub<S>(Arc<S>);");
        o.line("");
        o.open("impl<S: Server> Service for ServerStub<S> {");
        o.open("fn interface(&self) -> &'static InterfaceInfo {");
        o.line("&INFO");
        o.close("}");
        o.line("");
        o.open("fn client_died(&self, client: u32) {");
        o.line("self.0.client_died(client)");
        o.close("}");
        o.line("");
        o.open("fn dispatch(&self, caller: &Caller, func: u32, request: &[u8], response: &mut [u8]) -> Dispatched {");
        o.line("let r = Reader::new(request);");
        o.line("let mut w = Writer::new(response);");
        o.open("let done = match func {");
        for f in &i.functions {
            o.line(format!(
                "FN_{} => self.serve_{}(caller, r, &mut w),",
                f.name.to_uppercase(),
                f.name
            ));
        }
        o.line("_ => return Dispatched::Refused(Refusal::UnknownFunction(func)),");
        o.close("};");
        o.open("match done {");
        o.line("Ok(()) => Dispatched::Ok(w.len()),");
        o.line("Err(refused_or_failed) => refused_or_failed,");
        o.close("}");
        o.close("}");
        o.close("}");
        o.line("");

        o.open("impl<S: Server> ServerStub<S> {");
        for (n, f) in i.functions.iter().enumerate() {
            if n > 0 {
                o.line("");
            }
            self.serve_fn(o, f);
        }
        o.close("}");
        o.line("");

        o.open("fn malformed(e: WireError) -> Dispatched {");
        o.line("Dispatched::Refused(Refusal::Malformed(e))");
        o.close("}");
        o.line("");
        if i.functions
            .iter()
            .any(|f| f.args.iter().any(|a| a.range.is_some() || a.max.is_some()))
        {
            o.open("fn out_of_range(arg: &'static str) -> Dispatched {");
            o.line("Dispatched::Refused(Refusal::OutOfRange(arg))");
            o.close("}");
            o.line("");
        }
        o.open("fn app_error(e: Error) -> Dispatched {");
        o.line("Dispatched::AppError(e.code())");
        o.close("}");
        o.line("");
        if self.uses_lists() {
            o.open("fn list_len(n: usize) -> Result<u32, WireError> {");
            o.line("u32::try_from(n).map_err(|_| WireError::Overflow)");
            o.close("}");
            o.line("");
        }
    }

    fn serve_fn(&self, o: &mut Out, f: &Function) {
        let q = ".map_err(malformed)?";
        let r = if f.args.is_empty() { "r" } else { "mut r" };
        let w = if f.ret == Type::Unit { "_" } else { "w" };
        o.open(format!(
            "fn serve_{}(&self, caller: &Caller, {r}: Reader<'_>, {w}: &mut Writer<'_>) -> Result<(), Dispatched> {{",
            f.name
        ));
        for a in &f.args {
            o.lines(decode(&a.ty, &a.name, true, 0, q));
        }
        o.line(format!("r.finish(){q};"));
        for a in &f.args {
            if let Some((lo, hi)) = a.range {
                o.open(format!("if !({lo}..={hi}).contains(&{}) {{", a.name));
                o.line(format!("return Err(out_of_range({:?}));", a.name));
                o.close("}");
            }
            if let Some(max) = a.max {
                o.open(format!("if {}.len() > {max} {{", a.name));
                o.line(format!("return Err(out_of_range({:?}));", a.name));
                o.close("}");
            }
        }
        // `S::name(&self.0, ..)` rather than `self.0.name(..)`: `Arc`'s own
        // methods (`drop`, `clone`, ...) must not shadow the server's.
        let mut args = vec!["&self.0".to_string(), "caller".to_string()];
        args.extend(f.args.iter().map(|a| match a.ty {
            Type::List(_) | Type::Record(_) => format!("&{}", a.name),
            _ => a.name.clone(),
        }));
        match &f.ret {
            Type::Bytes => {
                args.push("out".into());
                o.line(format!(
                    "w.bytes_with(usize::MAX, |out| S::{}({})){q}.map_err(app_error)?;",
                    f.name,
                    args.join(", ")
                ));
            }
            Type::Unit => o.line(format!(
                "S::{}({}).map_err(app_error)?;",
                f.name,
                args.join(", ")
            )),
            ret => {
                o.line(format!(
                    "let ret = S::{}({}).map_err(app_error)?;",
                    f.name,
                    args.join(", ")
                ));
                o.lines(encode(ret, "ret", false, 0, q));
            }
        }
        o.line("Ok(())");
        o.close("}");
    }

    fn client(&self, o: &mut Out) {
        let i = self.iface;
        // Raw invocations.
        o.line("/// The invocations as they go on the wire: descriptors as the server's ids,");
        o.line("/// and faults left to the caller.");
        o.line("struct Raw<'a>(&'a Connection);");
        o.line("");
        o.open("impl Raw<'_> {");
        for (n, f) in i.functions.iter().enumerate() {
            if n > 0 {
                o.line("");
            }
            self.raw_fn(o, f);
        }
        o.close("}");
        o.line("");
        o.line("/// Sorts a reply into a result, an interface error or a fault.");
        o.open(
            "fn settle<T>(reply: Result<Result<T, u32>, Fault>) -> Result<T, CallError<Error>> {",
        );
        o.open("match reply {");
        o.line("Ok(Ok(value)) => Ok(value),");
        o.open("Ok(Err(code)) => match Error::from_code(code) {");
        o.line("Some(e) => Err(CallError::Server(e)),");
        o.line(format!(
            "None => Err(CallError::Fault(Fault::Refused(format!(\"error code {{code}} is not declared by interface `{}`\")))),",
            i.name
        ));
        o.close("},");
        o.line("Err(fault) => Err(CallError::Fault(fault)),");
        o.close("}");
        o.close("}");
        o.line("");

        // The client.
        o.line(format!(
            "/// The client stub of `{}`. It tracks the descriptors it hands out and,",
            i.name
        ));
        o.line("/// when the server has been micro-rebooted, rebuilds each one the next time");
        o.line("/// it is used, so that callers do not notice the reboot.");
        o.open("pub struct Client {");
        o.line("conn: Connection,");
        for d in &i.descriptors {
            o.line(format!("{}s: DescTable<{}Record>,", snake(&d.name), d.name));
        }
        if !i.descriptors.is_empty() {
            o.line("/// Held while a descriptor is rebuilt, so that it is rebuilt once.");
            o.line("recovery: Mutex<()>,");
        }
        o.close("}");
        o.line("");
        o.open("impl Client {");
        o.line(format!(
            "/// Connects to the `{}` server the system description grants this component.",
            i.name
        ));
        o.open("pub fn connect(rt: &Runtime) -> Result<Self, ConnectError> {");
        o.line("rt.connect(&INFO).map(Self::from_connection)");
        o.close("}");
        o.line("");
        o.open("pub fn from_connection(conn: Connection) -> Self {");
        o.open("Self {");
        o.line("conn,");
        for d in &i.descriptors {
            o.line(format!("{}s: DescTable::default(),", snake(&d.name)));
        }
        if !i.descriptors.is_empty() {
            o.line("recovery: Mutex::new(()),");
        }
        o.close("}");
        o.close("}");
        o.line("");
        o.open("pub fn connection(&self) -> &Connection {");
        o.line("&self.conn");
        o.close("}");
        for d in &i.descriptors {
            let s = snake(&d.name);
            o.line("");
            o.line(format!(
                "/// How many `{}` descriptors this client holds.",
                d.name
            ));
            o.open(format!("pub fn tracked_{s}s(&self) -> usize {{"));
            o.line(format!("self.{s}s.len()"));
            o.close("}");
        }
        for f in &i.functions {
            o.line("");
            self.client_fn(o, f);
        }
        o.line("");
        o.open("fn raw(&self) -> Raw<'_> {");
        o.line("Raw(&self.conn)");
        o.close("}");
        for d in &i.descriptors {
            o.line("");
            self.recovery_fns(o, d);
        }
        o.close("}");
    }

    fn raw_fn(&self, o: &mut Out, f: &Function) {
        let mut params = vec!["&self".to_string(), "epoch: Option<u64>".to_string()];
        params.extend(
            f.args
                .iter()
                .map(|a| format!("{}: {}", a.name, param(&a.ty))),
        );
        allow_many(o, params.len());
        o.open(format!(
            "fn {}({}) -> Result<{}, CallError<Error>> {{",
            f.name,
            params.join(", "),
            owned(&f.ret)
        ));
        o.open("let reply = self.0.call(");
        o.line(format!("FN_{},", f.name.to_uppercase()));
        o.line("epoch,");
        if f.args.is_empty() {
            o.line("|_| Ok(()),");
        } else {
            o.open("|w| {");
            for a in &f.args {
                o.lines(encode(&a.ty, &a.name, !is_scalar(&a.ty), 0, "?"));
            }
            o.line("Ok(())");
            o.close("},");
        }
        o.open("|status| match status {");
        let r = if f.ret == Type::Unit { "r" } else { "mut r" };
        o.open(format!("ReplyStatus::Ok({r}) => {{"));
        o.lines(decode(&f.ret, "ret", false, 0, "?"));
        o.line("r.finish()?;");
        o.line(if f.ret == Type::Unit {
            "Ok(Ok(()))"
        } else {
            "Ok(Ok(ret))"
        });
        o.close("}");
        o.line("ReplyStatus::AppError(code) => Ok(Err(code)),");
        o.close("},");
        o.close(");");
        o.line("settle(reply)");
        o.close("}");
    }

    fn client_fn(&self, o: &mut Out, f: &Function) {
        let i = self.iface;
        let ret = match &f.ret {
            Type::Descriptor(d) => d.clone(),
            t => owned(t),
        };
        let mut params = vec!["&self".to_string()];
        params.extend(
            f.args
                .iter()
                .map(|a| format!("{}: {}", a.name, client_param(&a.ty))),
        );
        let role = match f.role {
            Role::Create => " Creates a descriptor.",
            Role::Terminal => " Closes the descriptor.",
            Role::Plain => "",
        };
        o.line(format!("/// Invokes `{}`.{role}", f.name));
        allow_many(o, params.len());
        o.open(format!(
            "pub fn {}({}) -> Result<{ret}, CallError<Error>> {{",
            f.name,
            params.join(", ")
        ));
        let retry_ok = !f.retry_ok.is_empty();
        if retry_ok {
            o.line("// Set once an attempt's fate is unknown: it may have taken effect.");
            o.line("let mut interrupted = false;");
        }
        o.open("loop {");
        let desc_args: Vec<(&Arg, &str)> = f.descriptor_args().collect();
        let epoch = match (f.role, desc_args.first()) {
            (Role::Create, _) => {
                o.line("let epoch = self.conn.epoch();");
                "Some(epoch)".to_string()
            }
            (Role::Terminal, Some((a, d))) => {
                o.line(format!(
                    "let {}_now = self.peek_{}({})?;",
                    a.name,
                    snake(d),
                    a.name
                ));
                o.open(format!("if {}_now.epoch != self.conn.epoch() {{", a.name));
                o.line(format!("// The server rebooted since `{}` was built: its new incarnation never had it.", a.name));
                o.line(format!("self.{}s.remove({}.0);", snake(d), a.name));
                o.line("return Ok(());");
                o.close("}");
                format!("Some({}_now.epoch)", a.name)
            }
            (_, Some((first, _))) => {
                for (a, d) in &desc_args {
                    o.line(format!(
                        "let {}_now = self.current_{}({})?;",
                        a.name,
                        snake(d),
                        a.name
                    ));
                }
                for (a, _) in &desc_args[1..] {
                    o.open(format!(
                        "if {}_now.epoch != {}_now.epoch {{",
                        a.name, first.name
                    ));
                    o.line("continue;");
                    o.close("}");
                }
                format!("Some({}_now.epoch)", first.name)
            }
            (_, None) => "None".to_string(),
        };
        let mut args = vec![epoch];
        args.extend(f.args.iter().map(|a| match a.ty {
            Type::Descriptor(_) => format!("{}_now.server_id", a.name),
            _ => a.name.clone(),
        }));
        o.open(format!(
            "match self.raw().{}({}) {{",
            f.name,
            args.join(", ")
        ));
        // Success: apply the call's effect on the tracked descriptors.
        let mut effects: Vec<String> = Vec::new();
        let update = |a: &str, body: String| -> String {
            let d = match f.arg_type(a) {
                Some(Type::Descriptor(d)) => snake(d),
                _ => unreachable!("checked"),
            };
            format!("self.{d}s.update({a}.0, |t| {body});")
        };
        if let Some(r) = &f.advance {
            let by = match f.ret {
                Type::Bytes => "ret.len() as u64",
                Type::U64 => "ret",
                _ => "u64::from(ret)",
            };
            let field = format!("t.record.{}", r.field);
            effects.push(update(
                &r.arg,
                format!("{field} = {field}.wrapping_add({by})"),
            ));
        }
        for a in &f.args {
            if let Some(r) = &a.set {
                effects.push(update(&r.arg, format!("t.record.{} = {}", r.field, a.name)));
            }
        }
        match (&f.role, &f.ret) {
            (Role::Create, Type::Descriptor(d)) => {
                let creator = i.creator(d).expect("checked");
                let desc = i.descriptor(d).expect("checked");
                o.open("Ok(server_id) => {");
                let mut fields: Vec<String> = creator
                    .args
                    .iter()
                    .filter(|a| a.remember)
                    .map(|a| {
                        let v = match a.ty {
                            Type::Str => format!("{}.to_owned()", a.name),
                            Type::Bytes | Type::List(_) => format!("{}.to_vec()", a.name),
                            Type::Record(_) => format!("{}.clone()", a.name),
                            _ => a.name.clone(),
                        };
                        if v == a.name {
                            v
                        } else {
                            format!("{}: {v}", a.name)
                        }
                    })
                    .collect();
                fields.extend(desc.fields.iter().map(|x| format!("{}: 0", x.name)));
                let record = if fields.is_empty() {
                    format!("{d}Record {{}}")
                } else {
                    format!("{d}Record {{ {} }}", fields.join(", "))
                };
                o.line(format!("let record = {record};"));
                o.line(format!(
                    "return Ok({d}(self.{}s.insert(server_id, epoch, record)));",
                    snake(d)
                ));
                o.close("}");
            }
            (Role::Terminal, _) => {
                let (a, d) = desc_args[0];
                o.open("Ok(()) => {");
                o.line(format!("self.{}s.remove({}.0);", snake(d), a.name));
                o.line("return Ok(());");
                o.close("}");
            }
            _ if effects.is_empty() => o.line("Ok(ret) => return Ok(ret),"),
            _ => {
                o.open("Ok(ret) => {");
                o.lines(effects);
                o.line("return Ok(ret);");
                o.close("}");
            }
        }
        if retry_ok {
            o.line("Err(CallError::Fault(Fault::Stale)) => continue,");
            o.line("Err(CallError::Fault(Fault::Interrupted)) => interrupted = true,");
            let errs: Vec<String> = f.retry_ok.iter().map(|e| format!("Error::{e}")).collect();
            o.line("// The interrupted attempt did it: a harmless duplicate beats a loss.");
            o.line(format!(
                "Err(CallError::Server({})) if interrupted => return Ok(()),",
                errs.join(" | ")
            ));
        } else {
            o.line("Err(CallError::Fault(Fault::Stale | Fault::Interrupted)) => continue,");
        }
        o.line("Err(e) => return Err(e),");
        o.close("}");
        o.close("}");
        o.close("}");
    }

    fn recovery_fns(&self, o: &mut Out, d: &Descriptor) {
        let i = self.iface;
        let s = snake(&d.name);
        let creator = i.creator(&d.name).expect("checked");
        o.line(format!("/// Where `{s}` lives now, without rebuilding it."));
        o.open(format!(
            "fn peek_{s}(&self, {s}: {}) -> Result<Current, CallError<Error>> {{",
            d.name
        ));
        o.line("let mut current = None;");
        o.line(format!(
            "self.{s}s.update({s}.0, |t| current = Some(Current {{ server_id: t.server_id, epoch: t.epoch }}));"
        ));
        o.line(format!("current.ok_or(CallError::BadDescriptor({s}.0))"));
        o.close("}");
        o.line("");
        o.line(format!(
            "/// Where `{s}` lives now, rebuilt first if the server rebooted since it was built."
        ));
        o.open(format!(
            "fn current_{s}(&self, {s}: {}) -> Result<Current, CallError<Error>> {{",
            d.name
        ));
        o.line(format!("let current = self.peek_{s}({s})?;"));
        o.open("if current.epoch == self.conn.epoch() {");
        o.line("return Ok(current);");
        o.close("}");
        let restores: Vec<&Function> = d
            .fields
            .iter()
            .filter_map(|x| i.restorer(&d.name, &x.name))
            .collect();
        o.line(format!(
            "// Rebuild it in the server's new incarnation: replay `{}`{}.",
            creator.name,
            if restores.is_empty() {
                String::new()
            } else {
                ", then restore its tracked fields".to_string()
            }
        ));
        o.line("let _one_at_a_time = self.recovery.lock().unwrap_or_else(|e| e.into_inner());");
        o.open("loop {");
        o.line(format!(
            "let entry = self.{s}s.get({s}.0).ok_or(CallError::BadDescriptor({s}.0))?;"
        ));
        o.line("let epoch = self.conn.epoch();");
        o.open("if entry.epoch == epoch {");
        o.line("// Another thread rebuilt it meanwhile.");
        o.line("return Ok(Current { server_id: entry.server_id, epoch });");
        o.close("}");
        let mut args = vec!["Some(epoch)".to_string()];
        args.extend(creator.args.iter().map(|a| match (&a.replay, &a.ty) {
            (Some(lit), ty) => rust_literal(lit, ty),
            (None, ty) if is_scalar(ty) => format!("entry.record.{}", a.name),
            (None, _) => format!("&entry.record.{}", a.name),
        }));
        o.open(format!(
            "let server_id = match self.raw().{}({}) {{",
            creator.name,
            args.join(", ")
        ));
        o.line("Ok(server_id) => server_id,");
        o.line("Err(CallError::Fault(Fault::Stale | Fault::Interrupted)) => continue,");
        o.line("Err(e) => return Err(e),");
        o.close("};");
        for field in &d.fields {
            let Some(rf) = i.restorer(&d.name, &field.name) else {
                continue;
            };
            let value = format!("entry.record.{}", field.name);
            let args: Vec<String> = std::iter::once("Some(epoch)".to_string())
                .chain(rf.args.iter().map(|a| match a.ty {
                    Type::Descriptor(_) => "server_id".to_string(),
                    _ => value.clone(),
                }))
                .collect();
            o.open(format!("if {value} != 0 {{"));
            o.open(format!(
                "match self.raw().{}({}) {{",
                rf.name,
                args.join(", ")
            ));
            o.line("Ok(_) => {}");
            o.line("Err(CallError::Fault(Fault::Stale | Fault::Interrupted)) => continue,");
            o.line("Err(e) => return Err(e),");
            o.close("}");
            o.close("}");
        }
        o.open(format!("self.{s}s.update({s}.0, |t| {{"));
        o.line("t.server_id = server_id;");
        o.line("t.epoch = epoch;");
        o.close("});");
        o.line("self.conn.note_recovered(1);");
        o.line("return Ok(Current { server_id, epoch });");
        o.close("}");
        o.close("}");
    }
}
