//! The checked model of one interface, as the generator sees it.
//!
//! Spans point into the IDL text for error messages; they take no part in the
//! interface hash, which is computed from [`Interface::normalized`].

use std::fmt::Write as _;
use std::path::PathBuf;

/// A 1-based position in the IDL text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Span {
    pub line: usize,
    pub col: usize,
}

/// A value type of the IDL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Type {
    U8,
    U32,
    U64,
    I64,
    Bool,
    Str,
    Bytes,
    Unit,
    /// `[T]`.
    List(Box<Type>),
    /// A `record` of this interface.
    Record(String),
    /// A `descriptor` of this interface.
    Descriptor(String),
}

impl Type {
    pub fn is_int(&self) -> bool {
        matches!(self, Type::U8 | Type::U32 | Type::U64 | Type::I64)
    }

    /// The smallest and largest value of an integer type.
    pub fn int_bounds(&self) -> Option<(i128, i128)> {
        match self {
            Type::U8 => Some((0, u8::MAX as i128)),
            Type::U32 => Some((0, u32::MAX as i128)),
            Type::U64 => Some((0, u64::MAX as i128)),
            Type::I64 => Some((i64::MIN as i128, i64::MAX as i128)),
            _ => None,
        }
    }

    /// The type as written in the IDL.
    pub fn idl(&self) -> String {
        match self {
            Type::U8 => "u8".into(),
            Type::U32 => "u32".into(),
            Type::U64 => "u64".into(),
            Type::I64 => "i64".into(),
            Type::Bool => "bool".into(),
            Type::Str => "str".into(),
            Type::Bytes => "bytes".into(),
            Type::Unit => "unit".into(),
            Type::List(t) => format!("[{}]", t.idl()),
            Type::Record(n) | Type::Descriptor(n) => n.clone(),
        }
    }
}

/// A literal value in the IDL (`replay(0)`, `replay(false)`, `replay("")`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Literal {
    Int(i128),
    Bool(bool),
    Str(String),
}

impl Literal {
    pub fn idl(&self) -> String {
        match self {
            Literal::Int(n) => n.to_string(),
            Literal::Bool(b) => b.to_string(),
            Literal::Str(s) => format!("{s:?}"),
        }
    }
}

/// One interface: the contents of one `.kidl` file.
#[derive(Debug, Clone)]
pub struct Interface {
    pub path: PathBuf,
    pub name: String,
    pub name_span: Span,
    /// Declared errors; their codes are 1, 2, ... in order.
    pub errors: Vec<ErrorDef>,
    pub records: Vec<Record>,
    pub descriptors: Vec<Descriptor>,
    /// Functions; a function's id is its index.
    pub functions: Vec<Function>,
}

#[derive(Debug, Clone)]
pub struct ErrorDef {
    pub name: String,
    pub code: u32,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub struct Record {
    pub name: String,
    pub span: Span,
    pub fields: Vec<RecordField>,
}

#[derive(Debug, Clone)]
pub struct RecordField {
    pub name: String,
    pub span: Span,
    pub ty: Type,
    pub ty_span: Span,
}

/// Whether descriptor ids are private to each client (`local`) or shared by
/// all clients, so that recovery must ask for the same id (`global`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Namespace {
    Local,
    Global,
}

/// What closing a descriptor closes: itself only (`self`) or its children too
/// (`subtree`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    Own,
    Subtree,
}

/// What the server does with a descriptor's object when it reboots: loses
/// it (`forgets`: the client stub rebuilds it by replaying its creation
/// when it is next used, and just forgets it if it is being closed), or
/// keeps it (`keeps`: in the state vault, say; a closing call is rebuilt
/// and made too, since the new incarnation still has the object).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reboot {
    Forgets,
    Keeps,
}

/// What a descriptor's creation depends on: nothing, or a parent descriptor
/// of the same type (passed to its `create` function as a `parent` argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parent {
    None,
    Same,
}

#[derive(Debug, Clone)]
pub struct Descriptor {
    pub name: String,
    pub span: Span,
    pub namespace: Namespace,
    pub close: Close,
    pub reboot: Reboot,
    pub parent: Parent,
    /// State the client stub tracks per descriptor (all `u64`).
    pub fields: Vec<DescField>,
    /// The states of its state machine, the first one initial (none: no
    /// state machine).
    pub states: Vec<(String, Span)>,
    /// The declared error the server answers for a descriptor it does not
    /// hold (`unknown: Err;`, local descriptors only). For a descriptor the
    /// client stub holds in the call's epoch, no correct server gives it.
    pub unknown: Option<(String, Span)>,
}

impl Descriptor {
    /// The index of state `name`.
    pub fn state(&self, name: &str) -> Option<usize> {
        self.states.iter().position(|(s, _)| s == name)
    }
}

#[derive(Debug, Clone)]
pub struct DescField {
    pub name: String,
    pub span: Span,
    pub ty: Type,
    pub ty_span: Span,
}

/// A function's role in its descriptor's state machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Neither creates nor closes a descriptor.
    Plain,
    /// Returns a new descriptor (`create`).
    Create,
    /// Closes its descriptor argument (`terminal`).
    Terminal,
}

/// `d.field`: a tracked field of the descriptor passed as argument `d`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRef {
    pub arg: String,
    pub field: String,
    pub span: Span,
}

impl FieldRef {
    pub fn idl(&self) -> String {
        format!("{}.{}", self.arg, self.field)
    }
}

/// How a function's result relates to one of its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundKind {
    /// The result (an unsigned integer, or the length of bytes or a
    /// string) is at most the argument (its value, or its length).
    AtMost,
    /// The result (an unsigned integer) is greater than the argument.
    Above,
}

impl BoundKind {
    pub fn idl(self) -> &'static str {
        match self {
            BoundKind::AtMost => "at_most",
            BoundKind::Above => "above",
        }
    }
}

/// Which errors a correct server answers a call with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Fails {
    /// Any error the interface declares (no annotation).
    #[default]
    Declared,
    /// Only these, one or more (`fails(A, B)`).
    Only(Vec<String>),
    /// None at all (`infallible`).
    Never,
}

impl Fails {
    /// The errors named by `fails(..)` (none otherwise).
    pub fn named(&self) -> &[String] {
        match self {
            Fails::Only(names) => names,
            Fails::Declared | Fails::Never => &[],
        }
    }

    /// Whether a correct server may answer the call with error `e`.
    pub fn allows(&self, e: &str) -> bool {
        match self {
            Fails::Declared => true,
            Fails::Only(names) => names.iter().any(|n| n == e),
            Fails::Never => false,
        }
    }
}

/// A bound of a function's result by one of its arguments.
#[derive(Debug, Clone)]
pub struct Bound {
    pub kind: BoundKind,
    pub arg: String,
    pub span: Span,
}

#[derive(Debug, Clone)]
pub struct Arg {
    pub name: String,
    pub span: Span,
    pub ty: Type,
    pub ty_span: Span,
    /// Kept in the client's descriptor record, to replay creation.
    pub remember: bool,
    /// The value this argument takes when creation is replayed.
    pub replay: Option<Literal>,
    /// Inclusive bounds of an integer argument.
    pub range: Option<(i128, i128)>,
    /// Largest byte length of a `str` or `bytes` argument.
    pub max: Option<u64>,
    /// The tracked field this argument sets.
    pub set: Option<FieldRef>,
    /// The parent descriptor of the one a `create` function makes.
    pub parent: bool,
    /// Filled in by the client stub from this tracked field; the caller does
    /// not pass it.
    pub from: Option<FieldRef>,
}

#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    pub span: Span,
    pub id: u32,
    pub args: Vec<Arg>,
    pub ret: Type,
    pub ret_span: Span,
    pub role: Role,
    /// On success, the returned integer (or byte count) is added to this field.
    pub advance: Option<FieldRef>,
    /// Bounds of the result by arguments (`at_most`, `above`): the client
    /// stub takes a reply outside them for a faulty server's.
    pub bounds: Vec<Bound>,
    /// This function brings this field back during recovery.
    pub restore: Option<FieldRef>,
    /// Errors that mean success when the call is retried after its first
    /// attempt's fate was unknown.
    pub retry_ok: Vec<String>,
    /// The errors a correct server answers this call with: the client
    /// stub takes any other for a faulty server's reply.
    pub fails: Fails,
    /// On success, the returned integer becomes this field's value.
    pub store: Option<FieldRef>,
    /// A `create` whose server-side object already exists, named by this
    /// argument (`named_by(arg)`): the client stub makes the descriptor
    /// without a call (the server's id is the argument), and calls only to
    /// rebuild it on a new incarnation.
    pub named_by: Option<(String, Span)>,
    /// May wait inside the server (re-issued after the server's reboot).
    pub block: bool,
    /// Wakes threads that wait inside the server.
    pub wakeup: bool,
    /// Changes nothing in the server's state (`readonly`): a
    /// checkpoint-recovered server neither logs nor replays it, and a
    /// client may post it again whatever became of its first attempt.
    pub readonly: bool,
    /// Moves its descriptor from one state to another: `(from, to, span)`.
    pub transition: Option<(String, String, Span)>,
}

impl Interface {
    pub fn descriptor(&self, name: &str) -> Option<&Descriptor> {
        self.descriptors.iter().find(|d| d.name == name)
    }

    pub fn record(&self, name: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.name == name)
    }

    pub fn function(&self, name: &str) -> Option<&Function> {
        self.functions.iter().find(|f| f.name == name)
    }

    /// The functions that create descriptors of type `desc` (one for a local
    /// descriptor; a global one may have several).
    pub fn creators<'a>(&'a self, desc: &str) -> impl Iterator<Item = &'a Function> {
        let ty = Type::Descriptor(desc.to_string());
        self.functions
            .iter()
            .filter(move |f| f.role == Role::Create && f.ret == ty)
    }

    /// The (first) function that creates descriptors of type `desc`.
    pub fn creator(&self, desc: &str) -> Option<&Function> {
        self.functions
            .iter()
            .find(|f| f.role == Role::Create && f.ret == Type::Descriptor(desc.to_string()))
    }

    /// The functions that move descriptors of type `desc` between states.
    pub fn transitions(&self, desc: &str) -> impl Iterator<Item = &Function> {
        let ty = Type::Descriptor(desc.to_string());
        self.functions.iter().filter(move |f| {
            f.transition.is_some() && f.descriptor_args().next().is_some_and(|(a, _)| a.ty == ty)
        })
    }

    /// The shortest sequence of transitions that brings a new descriptor of
    /// type `desc` from the initial state into each state (`None`: unreachable).
    pub fn replay_paths(&self, desc: &Descriptor) -> Vec<Option<Vec<&Function>>> {
        let mut paths: Vec<Option<Vec<&Function>>> = vec![None; desc.states.len()];
        if paths.is_empty() {
            return paths;
        }
        paths[0] = Some(Vec::new());
        let mut queue = std::collections::VecDeque::from([0]);
        while let Some(at) = queue.pop_front() {
            for f in self.transitions(&desc.name) {
                let (from, to, _) = f.transition.as_ref().expect("a transition");
                let (Some(from), Some(to)) = (desc.state(from), desc.state(to)) else {
                    continue;
                };
                if from == at && paths[to].is_none() {
                    let mut path = paths[at].clone().expect("reached");
                    path.push(f);
                    paths[to] = Some(path);
                    queue.push_back(to);
                }
            }
        }
        paths
    }

    /// The function that restores field `field` of descriptor type `desc`.
    pub fn restorer(&self, desc: &str, field: &str) -> Option<&Function> {
        self.functions.iter().find(|f| match &f.restore {
            Some(r) => {
                r.field == field && f.arg_type(&r.arg) == Some(&Type::Descriptor(desc.to_string()))
            }
            None => false,
        })
    }

    /// A canonical rendering of the model, without comments or layout: two
    /// definitions that mean the same render the same.
    pub fn normalized(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "interface {};", self.name);
        let errors: Vec<_> = self
            .errors
            .iter()
            .map(|e| format!("{}={}", e.name, e.code))
            .collect();
        let _ = writeln!(s, "errors {{ {} }}", errors.join(", "));
        for r in &self.records {
            let fields: Vec<_> = r
                .fields
                .iter()
                .map(|f| format!("{}: {}", f.name, f.ty.idl()))
                .collect();
            let _ = writeln!(s, "record {} {{ {} }}", r.name, fields.join(", "));
        }
        for d in &self.descriptors {
            let ns = match d.namespace {
                Namespace::Local => "local",
                Namespace::Global => "global",
            };
            let close = match d.close {
                Close::Own => "self",
                Close::Subtree => "subtree",
            };
            let parent = match d.parent {
                Parent::None => "none",
                Parent::Same => "same",
            };
            let _ = write!(
                s,
                "descriptor {} {{ namespace: {ns}; close: {close}; parent: {parent};",
                d.name
            );
            if d.reboot == Reboot::Keeps {
                s.push_str(" reboot: keeps;");
            }
            if !d.states.is_empty() {
                let states: Vec<&str> = d.states.iter().map(|(n, _)| n.as_str()).collect();
                let _ = write!(s, " states: {};", states.join(", "));
            }
            if let Some((e, _)) = &d.unknown {
                let _ = write!(s, " unknown: {e};");
            }
            for f in &d.fields {
                let _ = write!(s, " field {}: {};", f.name, f.ty.idl());
            }
            let _ = writeln!(s, " }}");
        }
        for f in &self.functions {
            let args: Vec<_> = f
                .args
                .iter()
                .map(|a| {
                    let mut t = format!("{}: {}", a.name, a.ty.idl());
                    if a.remember {
                        t += " remember";
                    }
                    if let Some(l) = &a.replay {
                        t += &format!(" replay({})", l.idl());
                    }
                    if let Some((lo, hi)) = a.range {
                        t += &format!(" range({lo}, {hi})");
                    }
                    if let Some(m) = a.max {
                        t += &format!(" max({m})");
                    }
                    if let Some(r) = &a.set {
                        t += &format!(" set({})", r.idl());
                    }
                    if a.parent {
                        t += " parent";
                    }
                    if let Some(r) = &a.from {
                        t += &format!(" from({})", r.idl());
                    }
                    t
                })
                .collect();
            let _ = write!(
                s,
                "fn {}#{}({}) -> {}",
                f.name,
                f.id,
                args.join(", "),
                f.ret.idl()
            );
            match f.role {
                Role::Plain => {}
                Role::Create => s += " create",
                Role::Terminal => s += " terminal",
            }
            if let Some(r) = &f.advance {
                let _ = write!(s, " advance({})", r.idl());
            }
            for b in &f.bounds {
                let _ = write!(s, " {}({})", b.kind.idl(), b.arg);
            }
            if let Some(r) = &f.restore {
                let _ = write!(s, " restore({})", r.idl());
            }
            for e in &f.retry_ok {
                let _ = write!(s, " retry_ok({e})");
            }
            match &f.fails {
                Fails::Declared => {}
                Fails::Only(names) => {
                    let _ = write!(s, " fails({})", names.join(", "));
                }
                Fails::Never => s.push_str(" infallible"),
            }
            if let Some(r) = &f.store {
                let _ = write!(s, " store({})", r.idl());
            }
            if let Some((arg, _)) = &f.named_by {
                let _ = write!(s, " named_by({arg})");
            }
            if f.block {
                s += " block";
            }
            if f.wakeup {
                s += " wakeup";
            }
            if f.readonly {
                s += " readonly";
            }
            if let Some((from, to, _)) = &f.transition {
                let _ = write!(s, " transition({from}, {to})");
            }
            let _ = writeln!(s, ";");
        }
        s
    }

    /// FNV-1a 64 of [`Interface::normalized`]: client and server stubs
    /// compare it to know they were built from the same definition.
    pub fn hash(&self) -> u64 {
        fnv1a64(self.normalized().as_bytes())
    }
}

impl Function {
    pub fn arg(&self, name: &str) -> Option<&Arg> {
        self.args.iter().find(|a| a.name == name)
    }

    pub fn arg_type(&self, name: &str) -> Option<&Type> {
        self.arg(name).map(|a| &a.ty)
    }

    /// The arguments the caller passes (not those filled in from tracked fields).
    pub fn passed_args(&self) -> impl Iterator<Item = &Arg> {
        self.args.iter().filter(|a| a.from.is_none())
    }

    /// The arguments that are descriptors, with their descriptor type.
    pub fn descriptor_args(&self) -> impl Iterator<Item = (&Arg, &str)> {
        self.args.iter().filter_map(|a| match &a.ty {
            Type::Descriptor(d) => Some((a, d.as_str())),
            _ => None,
        })
    }
}

/// The 64-bit FNV-1a hash.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
