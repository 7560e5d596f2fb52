//! The IDL grammar:
//!
//! ```text
//! file       := "interface" NAME ";" item*
//! item       := errors | record | descriptor | function
//! errors     := "errors" "{" NAME ("," NAME)* ","? "}"
//! record     := "record" NAME "{" NAME ":" type ("," NAME ":" type)* ","? "}"
//! descriptor := "descriptor" NAME "{" property* "}"
//! property   := "field" NAME ":" type ";" | "states" ":" NAME ("," NAME)* ";"
//!             | NAME ":" NAME ("(" values ")")? ";"
//! function   := "fn" NAME "(" (arg ("," arg)* ","?)? ")" ("->" type)? annotation* ";"
//! arg        := NAME ":" type annotation*
//! annotation := NAME ("(" values ")")?
//! values     := value ("," value)*
//! value      := "-"? INT | NAME ("." NAME)? | STRING
//! type       := NAME | "[" type "]"
//! ```
//!
//! Annotations and descriptor properties share one shape, so new ones need no
//! new syntax: only a new name in the tables below.

use std::path::Path;

use crate::lexer::{Tok, Token};
use crate::model::*;
use crate::Fail;

/// Annotations an argument may carry.
pub(crate) const ARG_ANNOTATIONS: &[&str] = &[
    "remember", "replay", "range", "max", "set", "parent", "from",
];
/// Annotations a function may carry.
pub(crate) const FN_ANNOTATIONS: &[&str] = &[
    "create",
    "terminal",
    "advance",
    "at_most",
    "above",
    "restore",
    "retry_ok",
    "fails",
    "infallible",
    "store",
    "named_by",
    "block",
    "wakeup",
    "transition",
    "readonly",
];
/// Properties a descriptor may declare.
pub(crate) const DESC_PROPERTIES: &[&str] = &[
    "namespace",
    "close",
    "parent",
    "reboot",
    "field",
    "states",
    "unknown",
];

/// One value inside an annotation's parentheses.
#[derive(Debug, Clone)]
enum Value {
    Int(i128),
    Name(String),
    Path(String, String),
    Str(String),
}

impl Value {
    fn describe(&self) -> String {
        match self {
            Value::Int(n) => format!("`{n}`"),
            Value::Name(n) => format!("`{n}`"),
            Value::Path(a, b) => format!("`{a}.{b}`"),
            Value::Str(s) => format!("{s:?}"),
        }
    }
}

struct Annotation {
    name: String,
    span: Span,
    values: Vec<(Value, Span)>,
}

struct Parser {
    toks: Vec<Token>,
    pos: usize,
}

pub(crate) fn parse(path: &Path, toks: Vec<Token>) -> Result<Interface, Fail> {
    let mut p = Parser { toks, pos: 0 };
    let start = p.peek().clone();
    if start.tok != Tok::Ident("interface".into()) {
        return Err(Fail::new(
            start.span,
            format!(
                "expected `interface NAME;` first, found {}",
                start.tok.describe()
            ),
        ));
    }
    p.bump();
    let (name, name_span) = p.ident("the interface name")?;
    p.punct(";")?;
    let mut iface = Interface {
        path: path.to_path_buf(),
        name,
        name_span,
        errors: Vec::new(),
        records: Vec::new(),
        descriptors: Vec::new(),
        functions: Vec::new(),
    };
    let mut errors_seen = false;
    loop {
        let t = p.peek().clone();
        match &t.tok {
            Tok::Eof => break,
            Tok::Ident(kw) if kw == "errors" => {
                if errors_seen {
                    return Err(Fail::new(
                        t.span,
                        "a second `errors` block; list all errors in one",
                    ));
                }
                errors_seen = true;
                p.bump();
                p.errors(&mut iface)?;
            }
            Tok::Ident(kw) if kw == "record" => {
                p.bump();
                let r = p.record()?;
                iface.records.push(r);
            }
            Tok::Ident(kw) if kw == "descriptor" => {
                p.bump();
                let d = p.descriptor()?;
                iface.descriptors.push(d);
            }
            Tok::Ident(kw) if kw == "fn" => {
                p.bump();
                let id = iface.functions.len() as u32;
                let f = p.function(id)?;
                iface.functions.push(f);
            }
            other => {
                return Err(Fail::new(
                    t.span,
                    format!(
                        "expected `errors`, `record`, `descriptor` or `fn`, found {}",
                        other.describe()
                    ),
                ))
            }
        }
    }
    Ok(iface)
}

/// "one of a, b, c" for error messages.
pub(crate) fn one_of(names: &[&str]) -> String {
    format!("one of {}", names.join(", "))
}

impl Parser {
    fn peek(&self) -> &Token {
        &self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn bump(&mut self) -> Token {
        let t = self.peek().clone();
        if self.pos < self.toks.len() - 1 {
            self.pos += 1;
        }
        t
    }

    fn is_punct(&self, p: &str) -> bool {
        matches!(&self.peek().tok, Tok::Punct(q) if *q == p)
    }

    fn eat_punct(&mut self, p: &str) -> bool {
        let found = self.is_punct(p);
        if found {
            self.bump();
        }
        found
    }

    fn punct(&mut self, p: &str) -> Result<Span, Fail> {
        let t = self.peek().clone();
        if self.eat_punct(p) {
            Ok(t.span)
        } else {
            Err(Fail::new(
                t.span,
                format!("expected `{p}`, found {}", t.tok.describe()),
            ))
        }
    }

    fn ident(&mut self, what: &str) -> Result<(String, Span), Fail> {
        let t = self.bump();
        match t.tok {
            Tok::Ident(s) => Ok((s, t.span)),
            other => Err(Fail::new(
                t.span,
                format!("expected {what}, found {}", other.describe()),
            )),
        }
    }

    /// `{ A, B, C }` after `errors`.
    fn errors(&mut self, iface: &mut Interface) -> Result<(), Fail> {
        self.punct("{")?;
        while !self.eat_punct("}") {
            let (name, span) = self.ident("an error name")?;
            let code = iface.errors.len() as u32 + 1;
            iface.errors.push(ErrorDef { name, code, span });
            if !self.eat_punct(",") {
                self.punct("}")?;
                break;
            }
        }
        Ok(())
    }

    fn record(&mut self) -> Result<Record, Fail> {
        let (name, span) = self.ident("a record name")?;
        let mut fields = Vec::new();
        self.punct("{")?;
        while !self.eat_punct("}") {
            let (fname, fspan) = self.ident("a field name")?;
            self.punct(":")?;
            let (ty, ty_span) = self.ty()?;
            fields.push(RecordField {
                name: fname,
                span: fspan,
                ty,
                ty_span,
            });
            if !self.eat_punct(",") {
                self.punct("}")?;
                break;
            }
        }
        Ok(Record { name, span, fields })
    }

    fn descriptor(&mut self) -> Result<Descriptor, Fail> {
        let (name, span) = self.ident("a descriptor name")?;
        let mut d = Descriptor {
            name,
            span,
            namespace: Namespace::Local,
            close: Close::Own,
            reboot: Reboot::Forgets,
            parent: Parent::None,
            fields: Vec::new(),
            states: Vec::new(),
            unknown: None,
        };
        let mut seen: Vec<String> = Vec::new();
        self.punct("{")?;
        while !self.eat_punct("}") {
            let (prop, pspan) = self.ident("a descriptor property")?;
            if prop == "field" {
                let (fname, fspan) = self.ident("a field name")?;
                self.punct(":")?;
                let (ty, ty_span) = self.ty()?;
                d.fields.push(DescField {
                    name: fname,
                    span: fspan,
                    ty,
                    ty_span,
                });
                self.punct(";")?;
                continue;
            }
            if !DESC_PROPERTIES.contains(&prop.as_str()) {
                return Err(Fail::new(
                    pspan,
                    format!(
                        "unknown descriptor property `{prop}`; expected {}",
                        one_of(DESC_PROPERTIES)
                    ),
                ));
            }
            if seen.contains(&prop) {
                return Err(Fail::new(
                    pspan,
                    format!("`{prop}` is already set for `{}`", d.name),
                ));
            }
            seen.push(prop.clone());
            self.punct(":")?;
            if prop == "states" {
                loop {
                    d.states.push(self.ident("a state name")?);
                    if !self.eat_punct(",") {
                        break;
                    }
                }
                self.punct(";")?;
                continue;
            }
            if prop == "unknown" {
                d.unknown = Some(self.ident("an error name")?);
                self.punct(";")?;
                continue;
            }
            let value = self.annotation("a value")?;
            let choice = |choices: &[&str]| -> Result<(), Fail> {
                if !choices.contains(&value.name.as_str()) {
                    return Err(Fail::new(
                        value.span,
                        format!(
                            "unknown {prop} `{}`; expected {}",
                            value.name,
                            choices.join(" or ")
                        ),
                    ));
                }
                if let Some((_, vspan)) = value.values.first() {
                    return Err(Fail::new(
                        *vspan,
                        format!("`{}` takes no arguments", value.name),
                    ));
                }
                Ok(())
            };
            match prop.as_str() {
                "namespace" => {
                    choice(&["local", "global"])?;
                    d.namespace = if value.name == "local" {
                        Namespace::Local
                    } else {
                        Namespace::Global
                    };
                }
                "close" => {
                    choice(&["self", "subtree"])?;
                    d.close = if value.name == "self" {
                        Close::Own
                    } else {
                        Close::Subtree
                    };
                }
                "reboot" => {
                    choice(&["forgets", "keeps"])?;
                    d.reboot = if value.name == "forgets" {
                        Reboot::Forgets
                    } else {
                        Reboot::Keeps
                    };
                }
                _ => {
                    choice(&["none", "same"])?;
                    d.parent = if value.name == "none" {
                        Parent::None
                    } else {
                        Parent::Same
                    };
                }
            }
            self.punct(";")?;
        }
        Ok(d)
    }

    fn function(&mut self, id: u32) -> Result<Function, Fail> {
        let (name, span) = self.ident("a function name")?;
        let mut args = Vec::new();
        self.punct("(")?;
        while !self.eat_punct(")") {
            args.push(self.arg()?);
            if !self.eat_punct(",") {
                self.punct(")")?;
                break;
            }
        }
        let (ret, ret_span) = if self.eat_punct("->") {
            self.ty()?
        } else {
            (Type::Unit, span)
        };
        let mut f = Function {
            name,
            span,
            id,
            args,
            ret,
            ret_span,
            role: Role::Plain,
            advance: None,
            bounds: Vec::new(),
            restore: None,
            retry_ok: Vec::new(),
            fails: Fails::Declared,
            store: None,
            named_by: None,
            block: false,
            wakeup: false,
            readonly: false,
            transition: None,
        };
        let mut seen: Vec<String> = Vec::new();
        while !self.eat_punct(";") {
            let a = self.annotation("an annotation or `;`")?;
            let hint = if ARG_ANNOTATIONS.contains(&a.name.as_str()) {
                " (argument annotations go right after the argument's type)"
            } else {
                ""
            };
            a.admit(FN_ANNOTATIONS, hint, &mut seen)?;
            match a.name.as_str() {
                "create" | "terminal" => {
                    a.arity(0, "")?;
                    let role = if a.name == "create" {
                        Role::Create
                    } else {
                        Role::Terminal
                    };
                    if f.role != Role::Plain {
                        return Err(Fail::new(
                            a.span,
                            "a function is either `create` or `terminal`, not both",
                        ));
                    }
                    f.role = role;
                }
                "advance" => f.advance = Some(a.field_ref()?),
                "at_most" | "above" => {
                    let kind = [BoundKind::AtMost, BoundKind::Above]
                        .into_iter()
                        .find(|k| k.idl() == a.name)
                        .expect("matched");
                    let (arg, span) = a.arg_name()?;
                    f.bounds.push(Bound { kind, arg, span });
                }
                "restore" => f.restore = Some(a.field_ref()?),
                "store" => f.store = Some(a.field_ref()?),
                "named_by" => f.named_by = Some(a.arg_name()?),
                "block" => {
                    a.arity(0, "")?;
                    f.block = true;
                }
                "wakeup" => {
                    a.arity(0, "")?;
                    f.wakeup = true;
                }
                "readonly" => {
                    a.arity(0, "")?;
                    f.readonly = true;
                }
                "transition" => {
                    a.arity(2, "from_state, to_state")?;
                    let state = |i: usize| match &a.values[i] {
                        (Value::Name(n), _) => Ok(n.clone()),
                        (other, span) => Err(Fail::new(
                            *span,
                            format!(
                                "`transition` expects state names, found {}",
                                other.describe()
                            ),
                        )),
                    };
                    f.transition = Some((state(0)?, state(1)?, a.span));
                }
                "fails" | "infallible" => {
                    let fails = match a.name.as_str() {
                        "fails" => Fails::Only(a.error_names()?),
                        _ => {
                            a.arity(0, "")?;
                            Fails::Never
                        }
                    };
                    if f.fails != Fails::Declared {
                        return Err(Fail::new(
                            a.span,
                            "a function takes `fails(..)` or `infallible`, not both",
                        ));
                    }
                    f.fails = fails;
                }
                _ => f.retry_ok = a.error_names()?,
            }
        }
        Ok(f)
    }

    fn arg(&mut self) -> Result<Arg, Fail> {
        let (name, span) = self.ident("an argument name")?;
        self.punct(":")?;
        let (ty, ty_span) = self.ty()?;
        let mut arg = Arg {
            name,
            span,
            ty,
            ty_span,
            remember: false,
            replay: None,
            range: None,
            max: None,
            set: None,
            parent: false,
            from: None,
        };
        let mut seen: Vec<String> = Vec::new();
        while matches!(self.peek().tok, Tok::Ident(_)) {
            let a = self.annotation("an annotation")?;
            a.admit(ARG_ANNOTATIONS, "", &mut seen)?;
            match a.name.as_str() {
                "remember" => {
                    a.arity(0, "")?;
                    arg.remember = true;
                }
                "replay" => {
                    a.arity(1, "a literal")?;
                    let (v, vspan) = &a.values[0];
                    arg.replay = Some(match v {
                        Value::Int(n) => Literal::Int(*n),
                        Value::Str(s) => Literal::Str(s.clone()),
                        Value::Name(b) if b == "true" || b == "false" => Literal::Bool(b == "true"),
                        other => {
                            return Err(Fail::new(
                                *vspan,
                                format!("`replay` expects a literal (integer, true, false or string), found {}", other.describe()),
                            ))
                        }
                    });
                }
                "range" => {
                    a.arity(2, "lo, hi")?;
                    let lo = a.int(0)?;
                    let hi = a.int(1)?;
                    if lo > hi {
                        return Err(Fail::new(
                            a.values[0].1,
                            format!("empty range: {lo} is greater than {hi}"),
                        ));
                    }
                    arg.range = Some((lo, hi));
                }
                "max" => {
                    a.arity(1, "a byte length")?;
                    let n = a.int(0)?;
                    if !(0..=u32::MAX as i128).contains(&n) {
                        return Err(Fail::new(
                            a.values[0].1,
                            format!("`max` must be between 0 and {}", u32::MAX),
                        ));
                    }
                    arg.max = Some(n as u64);
                }
                "parent" => {
                    a.arity(0, "")?;
                    arg.parent = true;
                }
                "from" => arg.from = Some(a.field_ref()?),
                _ => arg.set = Some(a.field_ref()?),
            }
        }
        Ok(arg)
    }

    /// `name` or `name(value, ...)`.
    fn annotation(&mut self, what: &str) -> Result<Annotation, Fail> {
        let (name, span) = self.ident(what)?;
        let mut values = Vec::new();
        if self.eat_punct("(") {
            loop {
                values.push(self.value()?);
                if !self.eat_punct(",") {
                    break;
                }
            }
            self.punct(")")?;
        }
        Ok(Annotation { name, span, values })
    }

    fn value(&mut self) -> Result<(Value, Span), Fail> {
        let t = self.bump();
        let v = match t.tok {
            Tok::Int(n) => Value::Int(n as i128),
            Tok::Punct("-") => {
                let n = self.bump();
                match n.tok {
                    Tok::Int(n) => Value::Int(-(n as i128)),
                    other => {
                        return Err(Fail::new(
                            n.span,
                            format!("expected an integer after `-`, found {}", other.describe()),
                        ))
                    }
                }
            }
            Tok::Str(s) => Value::Str(s),
            Tok::Ident(a) => {
                if self.eat_punct(".") {
                    let (b, _) = self.ident("a field name")?;
                    Value::Path(a, b)
                } else {
                    Value::Name(a)
                }
            }
            other => {
                return Err(Fail::new(
                    t.span,
                    format!("expected a value, found {}", other.describe()),
                ))
            }
        };
        Ok((v, t.span))
    }

    fn ty(&mut self) -> Result<(Type, Span), Fail> {
        self.ty_nested(0)
    }

    fn ty_nested(&mut self, depth: usize) -> Result<(Type, Span), Fail> {
        let t = self.bump();
        let ty = match t.tok {
            Tok::Punct("[") if depth >= 8 => {
                return Err(Fail::new(
                    t.span,
                    "lists nest too deeply (at most 8 levels)",
                ))
            }
            Tok::Punct("[") => {
                let (inner, _) = self.ty_nested(depth + 1)?;
                self.punct("]")?;
                Type::List(Box::new(inner))
            }
            Tok::Ident(name) => match name.as_str() {
                "u8" => Type::U8,
                "u32" => Type::U32,
                "u64" => Type::U64,
                "i64" => Type::I64,
                "bool" => Type::Bool,
                "str" => Type::Str,
                "bytes" => Type::Bytes,
                "unit" => Type::Unit,
                // Resolved to a record or a descriptor by the checker.
                _ => Type::Record(name),
            },
            other => {
                return Err(Fail::new(
                    t.span,
                    format!("expected a type, found {}", other.describe()),
                ))
            }
        };
        Ok((ty, t.span))
    }
}

impl Annotation {
    /// Checks that this annotation is one of `allowed` and not a repeat of one
    /// in `seen`, then records it there.
    fn admit(&self, allowed: &[&str], hint: &str, seen: &mut Vec<String>) -> Result<(), Fail> {
        if !allowed.contains(&self.name.as_str()) {
            return Err(Fail::new(
                self.span,
                format!(
                    "unknown annotation `{}`; expected {}{hint}",
                    self.name,
                    one_of(allowed)
                ),
            ));
        }
        if seen.contains(&self.name) {
            return Err(Fail::new(
                self.span,
                format!("duplicate annotation `{}`", self.name),
            ));
        }
        seen.push(self.name.clone());
        Ok(())
    }

    fn arity(&self, n: usize, what: &str) -> Result<(), Fail> {
        if self.values.len() == n {
            return Ok(());
        }
        let msg = match n {
            0 => format!("`{}` takes no arguments", self.name),
            1 => format!(
                "`{}` takes one argument ({what}), found {}",
                self.name,
                self.values.len()
            ),
            _ => format!(
                "`{}` takes {n} arguments ({what}), found {}",
                self.name,
                self.values.len()
            ),
        };
        Err(Fail::new(
            self.values.first().map_or(self.span, |v| v.1),
            msg,
        ))
    }

    fn int(&self, i: usize) -> Result<i128, Fail> {
        match &self.values[i] {
            (Value::Int(n), _) => Ok(*n),
            (other, span) => Err(Fail::new(
                *span,
                format!(
                    "`{}` expects integers, found {}",
                    self.name,
                    other.describe()
                ),
            )),
        }
    }

    /// The one or more error names of `retry_ok` and `fails`.
    fn error_names(&self) -> Result<Vec<String>, Fail> {
        if self.values.is_empty() {
            return Err(Fail::new(
                self.span,
                format!("`{}` takes one or more error names", self.name),
            ));
        }
        self.values
            .iter()
            .map(|(v, span)| match v {
                Value::Name(e) => Ok(e.clone()),
                other => Err(Fail::new(
                    *span,
                    format!(
                        "`{}` expects error names, found {}",
                        self.name,
                        other.describe()
                    ),
                )),
            })
            .collect()
    }

    /// The single argument name of `at_most` and `above`.
    fn arg_name(&self) -> Result<(String, Span), Fail> {
        self.arity(1, "an argument's name")?;
        match &self.values[0] {
            (Value::Name(n), span) => Ok((n.clone(), *span)),
            (other, span) => Err(Fail::new(
                *span,
                format!(
                    "`{}` expects an argument's name, found {}",
                    self.name,
                    other.describe()
                ),
            )),
        }
    }

    /// The single `d.field` argument of `set`, `advance`, `restore`, `store`
    /// and `from`.
    fn field_ref(&self) -> Result<FieldRef, Fail> {
        self.arity(1, "descriptor.field")?;
        match &self.values[0] {
            (Value::Path(arg, field), span) => Ok(FieldRef {
                arg: arg.clone(),
                field: field.clone(),
                span: *span,
            }),
            (other, span) => Err(Fail::new(
                *span,
                format!(
                    "`{}` expects `descriptor_arg.field`, found {}",
                    self.name,
                    other.describe()
                ),
            )),
        }
    }
}
