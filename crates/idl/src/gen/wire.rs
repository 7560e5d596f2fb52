//! IDL types as Rust types and as calls on the wire's reader and writer.

use super::Out;
use crate::model::*;

pub(super) fn is_scalar(ty: &Type) -> bool {
    ty.is_int() || matches!(ty, Type::Bool | Type::Descriptor(_))
}

/// The wire method of a scalar (descriptors travel as their server's `u64` id).
pub(super) fn wire_fn(ty: &Type) -> &'static str {
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
pub(super) fn owned(ty: &Type) -> String {
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
pub(super) fn param(ty: &Type) -> String {
    match ty {
        Type::Str => "&str".into(),
        Type::Bytes => "&[u8]".into(),
        Type::List(t) => format!("&[{}]", owned(t)),
        Type::Record(n) => format!("&{n}"),
        t => owned(t),
    }
}

/// An argument of `ty` as a client passes it: descriptors as handles.
pub(super) fn client_param(ty: &Type) -> String {
    match ty {
        Type::Descriptor(d) => d.clone(),
        t => param(t),
    }
}

pub(super) fn rust_literal(lit: &Literal, ty: &Type) -> String {
    match (lit, ty) {
        (Literal::Str(s), Type::Bytes) => format!("{s:?}.as_bytes()"),
        (l, _) => l.idl(),
    }
}

/// Statements encoding `expr` (a reference if `by_ref`) into writer `w`;
/// `q` follows each fallible call (`?` or `.map_err(malformed)?`).
pub(super) fn encode(ty: &Type, expr: &str, by_ref: bool, depth: usize, q: &str) -> Vec<String> {
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
pub(super) fn decode(ty: &Type, target: &str, borrow: bool, depth: usize, q: &str) -> Vec<String> {
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
pub(super) fn allow_many(o: &mut Out, params: usize) {
    if params > 7 {
        o.line("#[allow(clippy::too_many_arguments)]");
    }
}
