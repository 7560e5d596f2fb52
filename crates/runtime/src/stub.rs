//! The types that generated stubs are written against.
//!
//! Server stubs implement [`Service`] by decoding a request, checking its
//! arguments and calling the component's trait; client stubs keep a
//! [`DescTable`] of the descriptors the server handed out and turn transport
//! [`Fault`]s into recovery and retries, surfacing only [`CallError`]s that a
//! caller must see.

use thiserror::Error;

pub use crate::field_table::{FieldTable, Fields, Looked};
pub use crate::table::{DescTable, Location};
use crate::wire::{Reader, WireError, Writer};

/// Static facts about one interface, emitted by the IDL compiler.
#[derive(Debug)]
pub struct InterfaceInfo {
    /// The interface's name, as written in the system description.
    pub name: &'static str,
    /// A hash of the interface's normalized definition; client and server
    /// must agree on it.
    pub hash: u64,
    /// Function names, indexed by function id.
    pub functions: &'static [&'static str],
    /// The ids of the functions that change nothing in the server
    /// (`readonly` in the IDL): a checkpoint-recovered server does not log
    /// them (`journal`), and a client posts one again whatever became of
    /// its first attempt.
    pub readonly: &'static [u32],
}

impl InterfaceInfo {
    /// Whether function `func` is `readonly`.
    pub fn is_readonly(&self, func: u32) -> bool {
        self.readonly.contains(&func)
    }
}

/// The component that made an invocation, as the supervisor wired it: the
/// channel identifies the caller, so it cannot be forged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Caller {
    /// The client component's id in the system.
    pub component: u32,
    /// The channel slot (one per client thread) the call came on.
    pub slot: u32,
}

/// The callers a component may hear from: client component ids with their
/// channel slot counts ([`crate::Runtime::callers`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Callers(pub Vec<(u32, u32)>);

impl Callers {
    /// Whether `caller` could have made an invocation of this component.
    pub fn contains(&self, caller: Caller) -> bool {
        self.0
            .iter()
            .any(|&(component, slots)| component == caller.component && caller.slot < slots)
    }

    /// Whether `component` is a client of this component.
    pub fn has_component(&self, component: u32) -> bool {
        self.0.iter().any(|&(c, _)| c == component)
    }
}

/// Why a server stub refused an invocation without running it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Refusal {
    #[error("no function with id {0}")]
    UnknownFunction(u32),
    #[error("malformed arguments: {0}")]
    Malformed(WireError),
    #[error("argument `{0}` out of range")]
    OutOfRange(&'static str),
    #[error("interface mismatch")]
    InterfaceMismatch,
    #[error("no descriptor {0:#x}")]
    UnknownDescriptor(u64),
    #[error("creation records unavailable")]
    Records,
    /// The server's answer does not fit in a channel slot
    /// ([`crate::abi::channel::MAX_PAYLOAD`]): a limit of the transport
    /// that a correct server meets too (a list too long for one reply), so
    /// the caller is told and the server is not suspected.
    #[error("the reply does not fit in a channel slot")]
    ReplyTooLarge,
}

impl Refusal {
    /// A compact code for the response header.
    pub fn code(self) -> u32 {
        match self {
            Refusal::UnknownFunction(_) => 1,
            Refusal::Malformed(_) => 2,
            Refusal::OutOfRange(_) => 3,
            Refusal::InterfaceMismatch => 4,
            Refusal::UnknownDescriptor(_) => 5,
            Refusal::Records => 6,
            Refusal::ReplyTooLarge => 7,
        }
    }

    /// Whether a refusal with this code shows a fault of the server when a
    /// generated client stub made the call: its function ids and encodings
    /// are right by construction, it sends no argument outside its declared
    /// range ([`unsendable`]), and the server's creation records are the
    /// server's own. (A descriptor unknown may be the caller's doing, and
    /// a reply too large for a slot the transport's.) A code no server
    /// stub gives (a flip in the refusing worker, seen in a timer campaign)
    /// is one too.
    pub fn is_server_fault(code: u32) -> bool {
        ![
            Refusal::InterfaceMismatch,
            Refusal::UnknownDescriptor(0),
            Refusal::ReplyTooLarge,
        ]
        .iter()
        .any(|r| r.code() == code)
    }
}

impl From<WireError> for Refusal {
    fn from(e: WireError) -> Self {
        Refusal::Malformed(e)
    }
}

/// An interface's error type, generated from its `errors { … }` list. On
/// the wire an error is its place in [`InterfaceError::ALL`], from 1.
pub trait InterfaceError: Copy + PartialEq + 'static {
    /// The interface's name, for the fault an undeclared code becomes.
    const INTERFACE: &'static str;
    /// Every error in declaration order, with its description.
    const ALL: &'static [(Self, &'static str)];

    /// The error's code on the wire: 1, 2, ... in declaration order.
    fn code(self) -> u32 {
        Self::ALL
            .iter()
            .position(|(e, _)| *e == self)
            .map_or(0, |i| i as u32 + 1)
    }

    fn from_code(code: u32) -> Option<Self> {
        let i = usize::try_from(code.checked_sub(1)?).ok()?;
        Self::ALL.get(i).map(|(e, _)| *e)
    }

    /// `not found` for `NotFound`.
    fn describe(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(e, _)| *e == self)
            .map_or("?", |(_, d)| d)
    }
}

/// Runs a server stub's decoding and dispatch of one request: `body` reads
/// the arguments from the request and writes the result into the response;
/// its error is the refusal or the interface error to answer with.
pub fn serve(
    request: &[u8],
    response: &mut [u8],
    body: impl FnOnce(Reader<'_>, &mut Writer<'_>) -> Result<(), Dispatched>,
) -> Dispatched {
    let mut w = Writer::new(response);
    match body(Reader::new(request), &mut w) {
        Ok(()) => Dispatched::Ok(w.len()),
        Err(refused_or_failed) => refused_or_failed,
    }
}

/// Declares an interface's `Error` enum with its [`InterfaceError`] table,
/// `Display` (the descriptions) and `std::error::Error`: what the IDL
/// compiler emits for `errors { … }`.
#[macro_export]
macro_rules! interface_errors {
    ($interface:literal { $($name:ident = $text:literal),* $(,)? }) => {
        /// The interface's errors; on the wire, each is its place in the list, from 1.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Error {
            $($name),*
        }

        impl $crate::stub::InterfaceError for Error {
            const INTERFACE: &'static str = $interface;
            const ALL: &'static [(Self, &'static str)] = &[$((Error::$name, $text)),*];
        }

        impl ::std::fmt::Display for Error {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str($crate::stub::InterfaceError::describe(*self))
            }
        }

        impl ::std::error::Error for Error {}
    };
}

/// A server stub's answer for an interface error.
pub fn app_error<E: InterfaceError>(e: E) -> Dispatched {
    Dispatched::AppError(e.code())
}

/// A server stub's refusal of arguments that do not decode.
pub fn malformed(e: WireError) -> Dispatched {
    Dispatched::Refused(Refusal::Malformed(e))
}

/// A server stub's refusal to send a result that does not fit in the
/// slot's response buffer (the only way encoding a result fails).
pub fn too_large(_: WireError) -> Dispatched {
    Dispatched::Refused(Refusal::ReplyTooLarge)
}

/// A server stub's refusal of an argument outside its declared range.
pub fn out_of_range(arg: &'static str) -> Dispatched {
    Dispatched::Refused(Refusal::OutOfRange(arg))
}

/// A client stub's refusal to send an argument outside its declared range
/// (`range`, `max` in the IDL): the server stub would refuse it, so it is
/// not sent, and a server that refuses an argument its client checked is
/// faulty ([`Refusal::is_server_fault`]).
pub fn unsendable<E>(arg: &str) -> CallError<E> {
    CallError::Fault(Fault::Refused(format!(
        "argument `{arg}` out of range: not sent"
    )))
}

/// A client stub's check of a reply against its call's bound (`at_most`
/// in the IDL): a reply beyond it does not decode, so the client takes
/// the server for faulty (see [`crate::client`]).
pub fn at_most(value: u64, bound: u64) -> Result<(), WireError> {
    if value > bound {
        return Err(WireError::Beyond { value, bound });
    }
    Ok(())
}

/// [`at_most`]'s other side (`above` in the IDL): the reply must be
/// greater than `bound`.
pub fn above(value: u64, bound: u64) -> Result<(), WireError> {
    if value <= bound {
        return Err(WireError::NotAbove { value, bound });
    }
    Ok(())
}

/// A server stub's refusal when the creation records cannot be read or written.
pub fn records_unavailable(_: crate::records::RecordError) -> Dispatched {
    Dispatched::Refused(Refusal::Records)
}

/// Runs a client stub's call until its fate is known: a call that a reboot
/// refused ([`Fault::Stale`]) or interrupted ([`Fault::Interrupted`]) is
/// issued again (its descriptors rebuilt by the next attempt); anything
/// else is the answer.
pub fn retry<T, E>(mut call: impl FnMut() -> Result<T, CallError<E>>) -> Result<T, CallError<E>> {
    loop {
        match call() {
            Err(CallError::Fault(Fault::Stale | Fault::Interrupted)) => continue,
            done => return done,
        }
    }
}

/// [`retry`] for a call that an interrupted attempt may already have done
/// (a removal, a close): once an attempt's fate was unknown, an error that
/// `done` recognizes as the duplicate's complaint ("not found" after a
/// removal) counts as success. A harmless duplicate beats a loss.
pub fn retry_idempotent<E>(
    mut call: impl FnMut() -> Result<(), CallError<E>>,
    done: impl Fn(&CallError<E>) -> bool,
) -> Result<(), CallError<E>> {
    let mut interrupted = false;
    loop {
        match call() {
            Err(CallError::Fault(Fault::Stale)) => continue,
            Err(CallError::Fault(Fault::Interrupted)) => interrupted = true,
            Err(e) if interrupted && done(&e) => return Ok(()),
            result => return result,
        }
    }
}

/// What a server stub's dispatch produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatched {
    /// Success; the response payload holds this many encoded bytes.
    Ok(usize),
    /// The component returned one of the interface's declared errors.
    AppError(u32),
    /// The stub refused the invocation before it reached the component.
    Refused(Refusal),
}

/// A server stub: decodes invocations of one interface and dispatches them to
/// the component's implementation.
pub trait Service: Send + Sync + 'static {
    fn interface(&self) -> &'static InterfaceInfo;
    /// Client component `client` died: its descriptors and anything it
    /// held or was blocked on can be released.
    fn client_died(&self, client: u32);
    /// Checks the service's own state at a safe point, before a checkpoint
    /// keeps it (the runtime's `audit.rs`); `Err` says what is wrong.
    fn audit(&self) -> Result<(), String> {
        Ok(())
    }
    /// Runs function `func` with the encoded arguments `request`, writing the
    /// encoded result into `response`.
    fn dispatch(
        &self,
        caller: &Caller,
        func: u32,
        request: &[u8],
        response: &mut [u8],
    ) -> Dispatched;
}

/// A reply that reached the client.
pub enum ReplyStatus<'a> {
    Ok(Reader<'a>),
    AppError(u32),
}

/// Why an invocation did not produce a reply. Client stubs handle every
/// variant but `Lost` and `Refused` themselves.
#[derive(Debug, Clone, PartialEq, Eq, Error, serde::Serialize, serde::Deserialize)]
pub enum Fault {
    /// The server was rebooted before the call ran: the call had no effect.
    #[error("server rebooted before the call ran")]
    Stale,
    /// The server failed while the call was in flight: it may or may not have
    /// taken effect.
    #[error("server failed during the call")]
    Interrupted,
    /// The server is gone for good (its restart policy gave up, or the system
    /// is stopping).
    #[error("server component `{0}` is gone")]
    Lost(String),
    /// The server stub refused the invocation (the server's reason).
    #[error("invocation refused: {0}")]
    Refused(String),
    /// The server stub knows no such global descriptor (never created, or
    /// closed; after an interrupted close, closed by that attempt).
    #[error("invocation refused: {0}")]
    NoDescriptor(String),
    /// The request did not fit the channel slot.
    #[error("request encoding: {0}")]
    Encode(WireError),
    /// The reply did not decode.
    #[error("reply decoding: {0}")]
    Decode(WireError),
}

impl From<WireError> for Fault {
    fn from(e: WireError) -> Self {
        Fault::Decode(e)
    }
}

/// What a client stub's caller sees: an interface error, or a failure that
/// recovery cannot hide.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CallError<E> {
    #[error("{0}")]
    Server(E),
    #[error("descriptor {0} is not open")]
    BadDescriptor(u32),
    #[error(transparent)]
    Fault(Fault),
}

/// One descriptor tracked by a client stub.
#[derive(Debug, Clone)]
pub struct Tracked<R> {
    /// The id the current server incarnation knows the descriptor by.
    pub server_id: u64,
    /// The server epoch in which `server_id` was valid.
    pub epoch: u64,
    /// The interface-specific record: creation data and tracked fields.
    pub record: R,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_bounds_admit_the_edge_and_refuse_past_it() {
        assert_eq!(at_most(5, 5), Ok(()));
        assert_eq!(
            at_most(2053, 5),
            Err(WireError::Beyond {
                value: 2053,
                bound: 5
            })
        );
        assert_eq!(above(8, 7), Ok(()));
        assert_eq!(above(7, 7), Err(WireError::NotAbove { value: 7, bound: 7 }));
        assert_eq!(
            Fault::from(above(3, 7).unwrap_err()).to_string(),
            "reply decoding: reply of 3 is not above 7"
        );
    }
}
