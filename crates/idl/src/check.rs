//! Semantic checks: resolves named types and enforces the rules that make the
//! generated recovery code correct (every descriptor can be recreated, every
//! tracked field can be restored, ...).

use std::collections::HashSet;

use crate::model::*;
use crate::Fail;

/// Words that cannot name anything, since every name becomes a Rust identifier.
const RUST_KEYWORDS: &[&str] = &[
    "abstract", "as", "async", "await", "become", "box", "break", "const", "continue", "crate",
    "do", "dyn", "else", "enum", "extern", "false", "final", "fn", "for", "gen", "if", "impl",
    "in", "let", "loop", "macro", "match", "mod", "move", "mut", "override", "priv", "pub", "ref",
    "return", "self", "Self", "static", "struct", "super", "trait", "true", "try", "type",
    "typeof", "union", "unsafe", "unsized", "use", "virtual", "where", "while", "yield",
];

/// Type names the generated module gives its own items (and `S`, its
/// server stub's type parameter). Everything else it names from std or the
/// runtime goes through `rt::`, which no interface name can shadow.
const RESERVED_TYPES: &[&str] = &[
    "Error",
    "Client",
    "Server",
    "ServerStub",
    "Inner",
    "Current",
    "S",
];
/// Methods of the generated `Client` besides the interface's functions.
const RESERVED_FNS: &[&str] = &["connect", "connection", "from_connection", "recover_all"];

fn is_snake(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && !s.contains("__")
        && !s.ends_with('_')
}

fn is_camel(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase()) && s.chars().all(|c| c.is_ascii_alphanumeric())
}

fn name_ok(name: &str, span: Span, what: &str, camel: bool) -> Result<(), Fail> {
    if RUST_KEYWORDS.contains(&name) {
        return Err(Fail::new(
            span,
            format!("`{name}` is a Rust keyword and cannot name {what}"),
        ));
    }
    if camel && !is_camel(name) {
        return Err(Fail::new(
            span,
            format!("{what} name `{name}` must be UpperCamelCase"),
        ));
    }
    if !camel && !is_snake(name) {
        return Err(Fail::new(
            span,
            format!("{what} name `{name}` must be lower_snake_case"),
        ));
    }
    Ok(())
}

/// Adds `name` to `seen`, failing if it is already there.
fn unique(seen: &mut HashSet<String>, name: &str, span: Span, what: &str) -> Result<(), Fail> {
    if !seen.insert(name.to_string()) {
        return Err(Fail::new(span, format!("duplicate {what} `{name}`")));
    }
    Ok(())
}

pub(crate) fn check(iface: &mut Interface) -> Result<(), Fail> {
    name_ok(&iface.name, iface.name_span, "an interface", false)?;

    // Names.
    let mut seen = HashSet::new();
    for e in &iface.errors {
        name_ok(&e.name, e.span, "an error", true)?;
        unique(&mut seen, &e.name, e.span, "error")?;
    }
    let mut types = HashSet::new();
    let record_names: Vec<String> = iface
        .descriptors
        .iter()
        .map(|d| format!("{}Record", d.name))
        .collect();
    let type_spans = iface
        .records
        .iter()
        .map(|r| (&r.name, r.span))
        .chain(iface.descriptors.iter().map(|d| (&d.name, d.span)));
    for (name, span) in type_spans {
        name_ok(name, span, "a type", true)?;
        if RESERVED_TYPES.contains(&name.as_str()) || record_names.contains(name) {
            return Err(Fail::new(
                span,
                format!("type name `{name}` is reserved by the generated stubs"),
            ));
        }
        unique(&mut types, name, span, "type")?;
    }
    let mut fns = HashSet::new();
    for f in &iface.functions {
        name_ok(&f.name, f.span, "a function", false)?;
        let helper = iface
            .descriptors
            .iter()
            .any(|d| f.name == format!("tracked_{}s", crate::gen::snake(&d.name)));
        if RESERVED_FNS.contains(&f.name.as_str()) || helper {
            return Err(Fail::new(
                f.span,
                format!(
                    "function name `{}` is reserved by the generated stubs",
                    f.name
                ),
            ));
        }
        unique(&mut fns, &f.name, f.span, "function")?;
    }

    // Types.
    let descs: HashSet<String> = iface.descriptors.iter().map(|d| d.name.clone()).collect();
    let resolve = |ty: &mut Type, span: Span| resolve(ty, span, &types, &descs);
    for r in &mut iface.records {
        let mut fields = HashSet::new();
        for f in &mut r.fields {
            name_ok(&f.name, f.span, "a field", false)?;
            unique(&mut fields, &f.name, f.span, "field")?;
            resolve(&mut f.ty, f.ty_span)?;
            if !(f.ty.is_int() || matches!(f.ty, Type::Bool | Type::Str | Type::Bytes)) {
                return Err(Fail::new(
                    f.ty_span,
                    format!("record field `{}` has type `{}`; record fields are integers, bool, str or bytes", f.name, f.ty.idl()),
                ));
            }
        }
    }
    for d in &mut iface.descriptors {
        let mut fields = HashSet::new();
        for f in &mut d.fields {
            name_ok(&f.name, f.span, "a field", false)?;
            unique(&mut fields, &f.name, f.span, "field")?;
            resolve(&mut f.ty, f.ty_span)?;
            if f.ty != Type::U64 {
                return Err(Fail::new(
                    f.ty_span,
                    format!("descriptor field `{}` must be u64", f.name),
                ));
            }
        }
        let mut states = HashSet::new();
        for (st, span) in &d.states {
            name_ok(st, *span, "a state", false)?;
            unique(&mut states, st, *span, "state")?;
        }
        if d.namespace == Namespace::Global && !d.states.is_empty() {
            return Err(Fail::new(
                d.states[0].1,
                format!("`{}`: a global descriptor is shared by its clients, so it cannot have per-client states; keep such state in the server", d.name),
            ));
        }
        if d.reboot == Reboot::Keeps && d.namespace == Namespace::Global {
            return Err(Fail::new(
                d.span,
                format!("`{}`: `reboot: keeps` is for local descriptors (the server stub rebuilds global ones from its creation records)", d.name),
            ));
        }
        if d.parent == Parent::Same && d.namespace == Namespace::Local {
            return Err(Fail::new(
                d.span,
                format!("`{}`: parent dependencies need `namespace: global` (the server stub rebuilds parents before children from creation records)", d.name),
            ));
        }
        if let Some((e, span)) = &d.unknown {
            if d.namespace == Namespace::Global {
                return Err(Fail::new(
                    *span,
                    format!("`{}`: `unknown` is for local descriptors (the server stub refuses a global descriptor it does not know)", d.name),
                ));
            }
            if !iface.errors.iter().any(|x| &x.name == e) {
                let declared: Vec<&str> = iface.errors.iter().map(|e| e.name.as_str()).collect();
                return Err(Fail::new(
                    *span,
                    format!(
                        "`unknown: {e}`: unknown error `{e}`; declared: {}",
                        declared.join(", ")
                    ),
                ));
            }
        }
        if d.parent == Parent::Same && d.close != Close::Subtree {
            return Err(Fail::new(
                d.span,
                format!("`{}` has a parent, so it must declare `close: subtree` (closing a descriptor removes its children)", d.name),
            ));
        }
    }
    for f in &mut iface.functions {
        for a in &mut f.args {
            resolve(&mut a.ty, a.ty_span)?;
        }
        resolve(&mut f.ret, f.ret_span)?;
    }

    let snapshot = iface.clone();
    for f in &iface.functions {
        check_function(&snapshot, f)?;
    }
    check_descriptors(&snapshot)
}

fn resolve(
    ty: &mut Type,
    span: Span,
    types: &HashSet<String>,
    descs: &HashSet<String>,
) -> Result<(), Fail> {
    match ty {
        Type::List(inner) => {
            resolve(inner, span, types, descs)?;
            match **inner {
                Type::Unit => Err(Fail::new(span, "a list of `unit` carries nothing")),
                Type::Descriptor(ref d) => Err(Fail::new(
                    span,
                    format!("descriptors (`{d}`) cannot be in lists"),
                )),
                _ => Ok(()),
            }
        }
        Type::Record(name) if descs.contains(name.as_str()) => {
            *ty = Type::Descriptor(name.clone());
            Ok(())
        }
        Type::Record(name) if !types.contains(name.as_str()) => {
            Err(Fail::new(span, format!("unknown type `{name}`")))
        }
        _ => Ok(()),
    }
}

/// A `readonly` function changes nothing in the server, so it may not
/// make, close or move a descriptor, nor wake waiters.
fn readonly(f: &Function) -> Result<(), Fail> {
    let changes = match (f.role, &f.transition, f.wakeup) {
        (Role::Create, _, _) => Some("`create`"),
        (Role::Terminal, _, _) => Some("`terminal`"),
        (_, Some(_), _) => Some("`transition`"),
        (_, _, true) => Some("`wakeup`"),
        _ => None,
    };
    match (f.readonly, changes) {
        (true, Some(what)) => Err(Fail::new(
            f.span,
            format!(
                "`{}` is `readonly` and {what}: a read-only function changes nothing in the server",
                f.name
            ),
        )),
        _ => Ok(()),
    }
}

/// `at_most(arg)`: an unsigned integer or a length on both sides;
/// `above(arg)`: unsigned integers.
fn bound(f: &Function, b: &Bound) -> Result<(), Fail> {
    let (name, arg) = (b.kind.idl(), &b.arg);
    let unsigned = |t: &Type| t.is_int() && *t != Type::I64;
    let fits = |t: &Type| match b.kind {
        BoundKind::AtMost => unsigned(t) || *t == Type::Bytes || *t == Type::Str,
        BoundKind::Above => unsigned(t),
    };
    let what = match b.kind {
        BoundKind::AtMost => "an unsigned integer, bytes or a string",
        BoundKind::Above => "an unsigned integer",
    };
    if !fits(&f.ret) {
        return Err(Fail::new(
            f.ret_span,
            format!(
                "`{name}({arg})` needs a function returning {what}, and `{}` returns `{}`",
                f.name,
                f.ret.idl()
            ),
        ));
    }
    match f.arg_type(arg) {
        Some(t) if fits(t) => Ok(()),
        Some(t) => Err(Fail::new(
            b.span,
            format!(
                "`{name}({arg})`: argument `{arg}` is a `{}`, not {what}",
                t.idl()
            ),
        )),
        None => Err(Fail::new(
            b.span,
            format!("`{name}({arg})`: `{}` has no argument `{arg}`", f.name),
        )),
    }
}

/// `named_by(arg)`: only on a function that creates a local descriptor,
/// and `arg` a remembered `u64` (the server's id, kept to rebuild it).
fn named_by(iface: &Interface, f: &Function, arg: &str, span: Span) -> Result<(), Fail> {
    let local = match (&f.role, &f.ret) {
        (Role::Create, Type::Descriptor(d)) => iface
            .descriptor(d)
            .is_some_and(|d| d.namespace == Namespace::Local),
        _ => false,
    };
    if !local {
        return Err(Fail::new(
            span,
            format!(
                "`named_by({arg})` needs a `create` function returning a local descriptor, and `{}` is not one",
                f.name
            ),
        ));
    }
    match f.arg(arg) {
        Some(a) if a.ty == Type::U64 && a.remember => Ok(()),
        Some(a) => Err(Fail::new(
            span,
            format!(
                "`named_by({arg})`: argument `{arg}` must be a `u64` marked `remember` (the stub rebuilds the descriptor from it), and it is a `{}`{}",
                a.ty.idl(),
                if a.remember { "" } else { " without `remember`" }
            ),
        )),
        None => Err(Fail::new(
            span,
            format!("`named_by({arg})`: `{}` has no argument `{arg}`", f.name),
        )),
    }
}

/// Checks that `r` names a descriptor argument of `f` and one of its fields.
fn field_of<'a>(
    iface: &'a Interface,
    f: &Function,
    r: &FieldRef,
    what: &str,
) -> Result<&'a Descriptor, Fail> {
    let desc = match f.arg_type(&r.arg) {
        Some(Type::Descriptor(d)) => iface.descriptor(d).expect("resolved"),
        _ => {
            return Err(Fail::new(
                r.span,
                format!(
                    "`{what}({})`: `{}` is not a descriptor argument of `{}`",
                    r.idl(),
                    r.arg,
                    f.name
                ),
            ))
        }
    };
    if !desc.fields.iter().any(|x| x.name == r.field) {
        return Err(Fail::new(
            r.span,
            format!(
                "`{what}({})`: descriptor `{}` has no field `{}`",
                r.idl(),
                desc.name,
                r.field
            ),
        ));
    }
    Ok(desc)
}

fn check_function(iface: &Interface, f: &Function) -> Result<(), Fail> {
    let mut names = HashSet::new();
    for a in &f.args {
        name_ok(&a.name, a.span, "an argument", false)?;
        unique(&mut names, &a.name, a.span, "argument")?;
        if a.ty == Type::Unit {
            return Err(Fail::new(
                a.ty_span,
                format!("argument `{}` cannot be `unit`", a.name),
            ));
        }
        if let Some((lo, hi)) = a.range {
            let Some((min, max)) = a.ty.int_bounds() else {
                return Err(Fail::new(
                    a.span,
                    format!(
                        "`range` applies to integer arguments, and `{}` is `{}`",
                        a.name,
                        a.ty.idl()
                    ),
                ));
            };
            for b in [lo, hi] {
                if b < min || b > max {
                    return Err(Fail::new(
                        a.span,
                        format!("range bound {b} does not fit in `{}`", a.ty.idl()),
                    ));
                }
            }
        }
        if a.max.is_some() && !matches!(a.ty, Type::Str | Type::Bytes) {
            return Err(Fail::new(
                a.span,
                format!(
                    "`max` applies to str and bytes arguments, and `{}` is `{}`",
                    a.name,
                    a.ty.idl()
                ),
            ));
        }
        if (a.remember || a.replay.is_some()) && f.role != Role::Create && f.transition.is_none() {
            return Err(Fail::new(
                a.span,
                format!(
                    "`{}`: `remember` and `replay` apply only to arguments of a `create` or `transition` function",
                    a.name
                ),
            ));
        }
        if a.parent {
            let own = match (&f.role, &f.ret) {
                (Role::Create, Type::Descriptor(d)) if a.ty == f.ret => iface.descriptor(d),
                _ => None,
            };
            if !own.is_some_and(|d| d.parent == Parent::Same) {
                return Err(Fail::new(
                    a.span,
                    format!("`{}`: `parent` marks the argument of a `create` function that is the parent of the descriptor it makes (same type, declared `parent: same`)", a.name),
                ));
            }
        }
        if let Some(r) = &a.from {
            field_of(iface, f, r, "from")?;
            if a.ty != Type::U64 || a.remember || a.replay.is_some() || a.set.is_some() {
                return Err(Fail::new(
                    a.span,
                    format!("`from({})` fills in a u64 argument from a tracked field; `{}` must be u64 without other tracking annotations", r.idl(), a.name),
                ));
            }
        }
        if a.remember && a.replay.is_some() {
            return Err(Fail::new(
                a.span,
                format!("`{}`: use either `remember` or `replay`, not both", a.name),
            ));
        }
        if let Some(lit) = &a.replay {
            let fits = match (lit, &a.ty) {
                (Literal::Int(n), t) if t.is_int() => {
                    let (min, max) = a.range.or(t.int_bounds()).expect("integer");
                    (min..=max).contains(n)
                }
                (Literal::Bool(_), Type::Bool) => true,
                (Literal::Str(s), Type::Str | Type::Bytes) => {
                    a.max.is_none_or(|m| s.len() as u64 <= m)
                }
                _ => false,
            };
            if !fits {
                return Err(Fail::new(
                    a.span,
                    format!(
                        "`replay({})` is not a valid value for `{}: {}`",
                        lit.idl(),
                        a.name,
                        a.ty.idl()
                    ),
                ));
            }
        }
        if let Some(r) = &a.set {
            let desc = field_of(iface, f, r, "set")?;
            let _ = desc;
            if a.ty != Type::U64 {
                return Err(Fail::new(
                    a.span,
                    format!(
                        "`set({})` needs a u64 argument, and `{}` is `{}`",
                        r.idl(),
                        a.name,
                        a.ty.idl()
                    ),
                ));
            }
        }
    }

    match f.role {
        Role::Create => {
            if !matches!(f.ret, Type::Descriptor(_)) {
                return Err(Fail::new(
                    f.span,
                    format!("`create` function `{}` must return a descriptor", f.name),
                ));
            }
            if let Some((a, _)) = f.descriptor_args().find(|(a, _)| !a.parent) {
                return Err(Fail::new(
                    a.span,
                    format!("`create` function `{}` can take a descriptor only as its `parent`, and `{}` is not marked so", f.name, a.name),
                ));
            }
            let parents = f.args.iter().filter(|a| a.parent).count();
            if parents > 1 {
                return Err(Fail::new(
                    f.span,
                    format!(
                        "`{}` takes {parents} `parent` arguments; a descriptor has one parent",
                        f.name
                    ),
                ));
            }
            if let Some(a) = f
                .args
                .iter()
                .find(|a| !a.remember && a.replay.is_none() && !a.parent)
            {
                return Err(Fail::new(
                    a.span,
                    format!("argument `{}` of `create` function `{}` needs `remember` or `replay(..)`: recovery replays creation", a.name, f.name),
                ));
            }
        }
        Role::Terminal => {
            if f.descriptor_args().count() != 1 {
                return Err(Fail::new(
                    f.span,
                    format!(
                        "`terminal` function `{}` must take exactly one descriptor",
                        f.name
                    ),
                ));
            }
            if f.ret != Type::Unit {
                return Err(Fail::new(
                    f.ret_span,
                    format!("`terminal` function `{}` must return unit", f.name),
                ));
            }
        }
        Role::Plain => {
            if let Type::Descriptor(d) = &f.ret {
                return Err(Fail::new(
                    f.ret_span,
                    format!("only a `create` function may return a descriptor (`{d}`)"),
                ));
            }
        }
    }
    if let Some(r) = &f.advance {
        field_of(iface, f, r, "advance")?;
        if !(f.ret.is_int() || f.ret == Type::Bytes) || f.ret == Type::I64 {
            return Err(Fail::new(
                r.span,
                format!("`advance({})` needs a function returning an unsigned integer or bytes, and `{}` returns `{}`", r.idl(), f.name, f.ret.idl()),
            ));
        }
    }
    for b in &f.bounds {
        bound(f, b)?;
    }
    if let Some((arg, span)) = &f.named_by {
        named_by(iface, f, arg, *span)?;
    }
    if let Some(r) = &f.restore {
        field_of(iface, f, r, "restore")?;
        let setter = f.args.iter().any(|a| {
            a.set
                .as_ref()
                .is_some_and(|s| s.arg == r.arg && s.field == r.field)
        });
        if f.role != Role::Plain || f.args.len() != 2 || !setter {
            return Err(Fail::new(
                r.span,
                format!(
                    "`restore({})`: a restore function takes exactly the descriptor `{}` and one argument with `set({})`",
                    r.idl(),
                    r.arg,
                    r.idl()
                ),
            ));
        }
    }
    if let Some(r) = &f.store {
        field_of(iface, f, r, "store")?;
        if !f.ret.is_int() || f.ret == Type::I64 {
            return Err(Fail::new(
                r.span,
                format!("`store({})` needs a function returning an unsigned integer, and `{}` returns `{}`", r.idl(), f.name, f.ret.idl()),
            ));
        }
    }
    readonly(f)?;
    if f.block && f.role == Role::Create {
        return Err(Fail::new(
            f.span,
            format!("`create` function `{}` cannot `block`", f.name),
        ));
    }
    if let Some((from, to, span)) = &f.transition {
        let mut descs = f.descriptor_args();
        let desc = match (descs.next(), descs.next(), f.role) {
            (Some((_, d)), None, Role::Plain) => iface.descriptor(d).expect("resolved"),
            _ => {
                return Err(Fail::new(
                    *span,
                    format!("`transition` needs a plain function taking exactly one descriptor, and `{}` is not", f.name),
                ))
            }
        };
        for st in [from, to] {
            if desc.state(st).is_none() {
                let declared: Vec<&str> = desc.states.iter().map(|(n, _)| n.as_str()).collect();
                return Err(Fail::new(
                    *span,
                    format!(
                        "`transition({from}, {to})`: `{}` has no state `{st}`; declared: [{}]",
                        desc.name,
                        declared.join(", ")
                    ),
                ));
            }
        }
        if let Some(a) = f.args.iter().find(|a| {
            !matches!(a.ty, Type::Descriptor(_))
                && !a.remember
                && a.replay.is_none()
                && a.from.is_none()
        }) {
            return Err(Fail::new(
                a.span,
                format!("argument `{}` of transition `{}` needs `remember`, `replay(..)` or `from(..)`: recovery replays transitions", a.name, f.name),
            ));
        }
    }
    for (what, names) in [("retry_ok", &f.retry_ok[..]), ("fails", f.fails.named())] {
        for e in names {
            if !iface.errors.iter().any(|x| &x.name == e) {
                let declared: Vec<&str> = iface.errors.iter().map(|e| e.name.as_str()).collect();
                return Err(Fail::new(
                    f.span,
                    format!(
                        "`{what}({e})`: unknown error `{e}`; declared: {}",
                        declared.join(", ")
                    ),
                ));
            }
        }
    }
    if let Some(e) = f.retry_ok.iter().find(|e| !f.fails.allows(e)) {
        let says = match f.fails {
            Fails::Never => "`infallible`",
            _ => "`fails`",
        };
        return Err(Fail::new(
            f.span,
            format!(
                "`retry_ok({e})` names an error that {says} says a correct server never answers `{}` with",
                f.name
            ),
        ));
    }
    if !f.retry_ok.is_empty() && (f.ret != Type::Unit || f.role != Role::Plain) {
        return Err(Fail::new(
            f.span,
            format!(
                "`retry_ok` needs a plain function that returns unit, and `{}` does not",
                f.name
            ),
        ));
    }
    Ok(())
}

fn check_descriptors(iface: &Interface) -> Result<(), Fail> {
    for d in &iface.descriptors {
        let ty = Type::Descriptor(d.name.clone());
        let mut creators = iface
            .functions
            .iter()
            .filter(|f| f.role == Role::Create && f.ret == ty);
        let Some(first) = creators.next() else {
            return Err(Fail::new(
                d.span,
                format!("descriptor `{}` has no `create` function", d.name),
            ));
        };
        if let (Some(second), Namespace::Local) = (creators.next(), d.namespace) {
            return Err(Fail::new(
                second.span,
                format!("descriptor `{}` is already created by `{}`; a local descriptor has one `create` function (a global one may have several)", d.name, first.name),
            ));
        }
        let parented = iface
            .functions
            .iter()
            .any(|f| f.role == Role::Create && f.ret == ty && f.args.iter().any(|a| a.parent));
        if d.parent == Parent::Same && !parented {
            return Err(Fail::new(
                d.span,
                format!("`{}` declares `parent: same`, but no `create` function takes a `parent` argument", d.name),
            ));
        }
        for field in &d.fields {
            let refers = |r: &FieldRef, f: &Function| {
                r.field == field.name && f.arg_type(&r.arg) == Some(&ty)
            };
            let mut restorers = iface
                .functions
                .iter()
                .filter(|f| f.restore.as_ref().is_some_and(|r| refers(r, f)));
            let restorer = restorers.next();
            if let Some(second) = restorers.next() {
                return Err(Fail::new(
                    second.span,
                    format!(
                        "field `{}` of `{}` is already restored by `{}`",
                        field.name,
                        d.name,
                        restorer.expect("first").name
                    ),
                ));
            }
            if let (Namespace::Global, Some(r)) = (d.namespace, restorer) {
                return Err(Fail::new(
                    r.span,
                    format!("`{}` restores a field of global descriptor `{}`; a global descriptor's fields are per-client bookkeeping (`store`/`from`), never server state", r.name, d.name),
                ));
            }
            // Fields set by `store` are the client's own bookkeeping, passed
            // back with `from`: only `advance` and `set` mirror server state.
            let changer = iface.functions.iter().find(|f| {
                f.advance.as_ref().is_some_and(|r| refers(r, f))
                    || f.args
                        .iter()
                        .any(|a| a.set.as_ref().is_some_and(|r| refers(r, f)))
            });
            if let (Namespace::Global, Some(c)) = (d.namespace, changer) {
                return Err(Fail::new(
                    c.span,
                    format!("`{}` changes field `{}` of global descriptor `{}` with `advance`/`set`; use `store`", c.name, field.name, d.name),
                ));
            }
            // A field a call passes back with `from` tells the server its
            // value with that call: client bookkeeping, with nothing to
            // restore (net's stream offsets).
            let passed_back = iface.functions.iter().any(|f| {
                f.args
                    .iter()
                    .any(|a| a.from.as_ref().is_some_and(|r| refers(r, f)))
            });
            if let (Some(changer), None, false) = (changer, restorer, passed_back) {
                return Err(Fail::new(
                    field.span,
                    format!(
                        "field `{}` of `{}` is changed by `{}` but no function restores it; add `restore(..{})` to one",
                        field.name, d.name, changer.name, field.name
                    ),
                ));
            }
        }
        if let Some(f) = &d.fields.iter().find(|f| {
            iface
                .creator(&d.name)
                .is_some_and(|c| c.arg(&f.name).is_some())
        }) {
            return Err(Fail::new(
                f.span,
                format!(
                    "field `{}` has the same name as an argument of `{}`",
                    f.name, first.name
                ),
            ));
        }
        // The client's record also holds `state`, `parent` and each transition's
        // remembered arguments as `{function}_{argument}`.
        let mut members: HashSet<String> = ["state", "parent"].map(String::from).into();
        let remembered = first
            .args
            .iter()
            .filter(|a| a.remember)
            .map(|a| (a.name.clone(), a.span));
        let fields = d.fields.iter().map(|f| (f.name.clone(), f.span));
        let transition_args = iface.transitions(&d.name).flat_map(|f| {
            f.args
                .iter()
                .filter(|a| a.remember)
                .map(move |a| (format!("{}_{}", f.name, a.name), a.span))
        });
        for (name, span) in remembered.chain(fields).chain(transition_args) {
            if !members.insert(name.clone()) {
                return Err(Fail::new(
                    span,
                    format!(
                        "`{name}` would name two things in the client's record of `{}`",
                        d.name
                    ),
                ));
            }
        }
        for ((st, span), path) in d.states.iter().zip(iface.replay_paths(d)) {
            if path.is_none() {
                return Err(Fail::new(
                    *span,
                    format!("state `{st}` of `{}` cannot be reached from `{}` by any transition, so recovery could not bring a descriptor back into it", d.name, d.states[0].0),
                ));
            }
        }
    }
    Ok(())
}
