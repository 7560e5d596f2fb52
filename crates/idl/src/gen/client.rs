//! The `Client` stub: each method retries its raw invocation through the
//! runtime's `retry`, keeps the descriptors it hands out and applies each
//! call's effect on their tracked fields.

use super::wire::*;
use super::{ident, out_of_range, snake, Ctx, Out};
use crate::model::*;

/// A client method whose retried call needs no bookkeeping, as written by
/// `value` of type `ty` as the `u64` a bound compares: an
/// integer itself, bytes or a string by length.
fn measure(ty: &Type, value: &str) -> String {
    if *ty == Type::U64 {
        value.to_string()
    } else if ty.is_int() {
        format!("u64::from({value})")
    } else {
        format!("{value}.len() as u64")
    }
}

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
    pub(super) fn client(&self, o: &mut Out) {
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
                "{}s: rt::FieldTable<{}Record, {}>,",
                snake(&d.name),
                d.name,
                d.fields.len()
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

    pub(super) fn raw_fn(&self, o: &mut Out, f: &Function) {
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
        // What the server stub would refuse is not sent: so a refusal of
        // it shows a faulty server.
        for (check, name) in out_of_range(f) {
            o.open(format!("if {check} {{"));
            o.line(format!("return rt::Err(rt::unsendable({name:?}));"));
            o.close("}");
        }
        match &f.fails {
            Fails::Declared => o.open(format!(
                "self.conn.invoke(FN_{}, epoch,",
                f.name.to_uppercase()
            )),
            // Any other error is a reply no correct server gives.
            fails => {
                let allowed = match fails.named() {
                    [] => "|_| false".to_string(),
                    names => {
                        let errs: Vec<String> =
                            names.iter().map(|e| format!("Error::{e}")).collect();
                        format!("|e| matches!(e, {})", errs.join(" | "))
                    }
                };
                o.open(format!(
                    "self.conn.invoke_failing(FN_{}, epoch, {allowed},",
                    f.name.to_uppercase()
                ));
            }
        }
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
        let bounds: Vec<String> = f
            .bounds
            .iter()
            .map(|b| {
                let ty = f.arg_type(&b.arg).expect("checked");
                format!(
                    "rt::{}({}, {})?;",
                    b.kind.idl(),
                    measure(&f.ret, "ret"),
                    measure(ty, &ident(&b.arg))
                )
            })
            .collect();
        let decoded = decode(&f.ret, "ret", false, 0, "?");
        let single = match decoded.as_slice() {
            _ if !bounds.is_empty() => None,
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
            o.lines(bounds);
            o.line("rt::Ok(ret)");
            o.close("},");
        }
        o.close(")");
        o.close("}");
    }

    /// Whether `f` reads or changes a tracked field of its argument `arg`.
    fn fields_touched(&self, f: &Function, arg: &str) -> bool {
        let names = |r: &Option<FieldRef>| r.as_ref().is_some_and(|r| r.arg == arg);
        names(&f.advance)
            || names(&f.store)
            || f.args.iter().any(|a| names(&a.from) || names(&a.set))
    }

    /// `self.0.{table}.update(..)` applying `body` to descriptor argument `a`'s
    /// tracked record, which `body` names `@`.
    pub(super) fn update(&self, f: &Function, a: &str, body: String) -> String {
        let d = match f.arg_type(a) {
            Some(Type::Descriptor(d)) => d,
            _ => unreachable!("checked"),
        };
        // `{name}_now` is the generated local holding where the descriptor
        // lives; `ident` never ends so, as an argument's name is renamed if it does.
        let (name, a) = (a, ident(a));
        if self.is_global(d) {
            let body = body.replace("@.", "t.");
            return format!(
                "self.0.{}s.update_looked(&{name}_now, {a}.0, |t| {body});",
                snake(d)
            );
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

    pub(super) fn client_fn(&self, o: &mut Out, f: &Function) {
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
            Role::Create if f.named_by.is_some() => {
                " Creates a descriptor without a call (the server's object is named by an argument); a call rebuilds it on a new incarnation."
            }
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
            (Role::Terminal, Some((a, d))) if self.kept(d) => {
                // The new incarnation kept it: rebuilt, then closed there.
                o.open(format!(
                    "let rt::Some({}_now) = self.0.kept_{}({})? else {{",
                    a.name,
                    snake(d),
                    ident(&a.name)
                ));
                o.line("return rt::Ok(());");
                o.close("};");
                format!("rt::Some({}_now.epoch)", a.name)
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
        // Each global descriptor whose fields the call reads or changes is
        // looked up once, before it; the update after starts where its
        // fields were found.
        for (a, d) in f
            .descriptor_args()
            .filter(|(a, d)| self.is_global(d) && self.fields_touched(f, &a.name))
        {
            o.line(format!(
                "let {}_now = self.0.{}s.look({}.0);",
                a.name,
                snake(d),
                ident(&a.name)
            ));
        }
        for a in &f.args {
            let Some(r) = &a.from else { continue };
            let d = match f.arg_type(&r.arg) {
                Some(Type::Descriptor(d)) => d,
                _ => unreachable!("checked"),
            };
            if self.is_global(d) {
                o.line(format!(
                    "let {} = {}_now.fields.{};",
                    ident(&a.name),
                    r.arg,
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
        match &f.named_by {
            // The server's object exists already: its id is the argument.
            Some((arg, _)) => o.open(format!(
                "match rt::Result::<u64, rt::CallError<Error>>::Ok({}) {{",
                ident(arg)
            )),
            None => o.open(format!(
                "match self.0.raw_{}({}) {{",
                f.name,
                args.join(", ")
            )),
        }
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
        match self.disowned(f) {
            Some(arm) => o.line(arm),
            None => o.line("rt::Err(e) => rt::Err(e),"),
        }
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

    /// The arm of a call on a local descriptor whose type names the error
    /// for a descriptor the server does not hold (`unknown`): that error,
    /// while the stub still holds the descriptor in the epoch the call was
    /// made in, is a reply no correct server gives (the server lost what it
    /// handed out), so the server is suspected and the call, which did not
    /// run, is made again on the descriptor rebuilt (the runtime's `Connection::disowned`).
    fn disowned(&self, f: &Function) -> Option<String> {
        if f.named_by.is_some() {
            return None;
        }
        let (a, d, e) = f.descriptor_args().find_map(|(a, d)| {
            let desc = self.iface.descriptor(d).filter(|_| !self.is_global(d))?;
            desc.unknown.as_ref().map(|(e, _)| (a, d, e))
        })?;
        Some(format!(
            "rt::Err(e) => rt::Err(self.0.conn.disowned(e, Error::{e}, self.0.{}s.holds({}.0, {}_now.epoch))),",
            snake(d),
            ident(&a.name),
            a.name
        ))
    }

    /// The statement that stops tracking descriptor argument `a` after it
    /// was closed, if the client stub tracks it at all.
    pub(super) fn forget(&self, a: &Arg, d: &str) -> Option<String> {
        let desc = self.iface.descriptor(d).expect("checked");
        // A global descriptor is tracked only for its fields.
        let tracked = desc.namespace == Namespace::Local || !desc.fields.is_empty();
        tracked.then(|| format!("self.0.{}s.remove({}.0);", snake(d), ident(&a.name)))
    }
}
