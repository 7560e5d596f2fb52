//! The state vault's protocol and its client.
//!
//! The vault keeps, per component, the records and descriptors that must
//! outlive an incarnation: ramfs's metadata and the files holding file
//! contents, netd's sockets. It lives in the supervisor, which survives every
//! component, and optionally in a directory, which survives the supervisor
//! (`[system] vault = { dir }`): then the files it makes ([`Vault::create_file`])
//! are files in that directory, and its records a log there. Each request is applied whole or not at all, so a component
//! that dies mid-request leaves the vault as it was before or after it.
//! Requests carry ids because a reply meant for a dead incarnation may still
//! be queued on the socket when its successor starts.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::sync::Mutex;

mod ahead;
mod prepared;
pub use ahead::REFRESH;
use ahead::{Ahead, FirstListing};
pub(crate) use prepared::registered as registered_builder;
pub use prepared::{prepare_ahead, Builder, Listing};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::abi::fdpass;

/// One change to a component's records.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub enum VaultOp {
    /// Sets `key` to `value`; with `fd` the request carries a descriptor that
    /// replaces the one kept under `key` (without, a kept descriptor stays).
    Put {
        key: String,
        value: serde_json::Value,
        fd: bool,
    },
    /// Removes `key` and its descriptor.
    Delete { key: String },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum VaultRequest {
    Apply {
        id: u64,
        ops: Vec<VaultOp>,
    },
    /// Applies `ops` like `Apply`, but sends no reply: a change the component
    /// need not wait for (netd keeping an accepted socket). Requests on one
    /// socket are applied in order, so a later round trip sees it done.
    Post {
        ops: Vec<VaultOp>,
    },
    /// Records with keys after `after` that start with `prefix`, in key
    /// order, a page at a time; with `keys_only`, their keys alone (each
    /// value null, no descriptor).
    List {
        id: u64,
        after: Option<String>,
        #[serde(default)]
        prefix: String,
        #[serde(default)]
        keys_only: bool,
    },
    /// The record under `key`: one record in the reply, or none.
    Get {
        id: u64,
        key: String,
    },
    /// Puts `value` under `key` with a new, empty file that the vault
    /// makes (a memfd, or a file in its directory when it is kept on
    /// disk) and sends back in the reply's one record: contents written to
    /// it are kept as long as the record, and persisted with the vault.
    Create {
        id: u64,
        key: String,
        value: serde_json::Value,
    },
    /// Posted with one socket, on which the vault then serves this
    /// component's reads (`List`, `Get`, `Changes`) and nothing else: a
    /// standby's own connection, to read ahead of its activation while
    /// the live incarnation uses the component's ([`ahead`]). Its
    /// listings leave out records whose descriptor is not a file (a
    /// socket, whose peer must see it closed when the record goes), which
    /// `Changes` always gives.
    Reader,
    /// What changed since the reply numbered `since` (a reply's `seq`):
    /// the records written since, in the reply's records (on the
    /// component's socket, with every record whose descriptor is no file,
    /// which a reader was never given), and the keys deleted since, in
    /// `deleted`; or `relist` if the changes are not all known any more or
    /// would not fit in one reply.
    Changes {
        id: u64,
        since: u64,
    },
    /// The record that this component's server of `interface` lent it:
    /// the server's record under [`lent_key`]`(this component's id, key)`,
    /// as the reply's one record (keyed `key`), or none. A component
    /// reads another's records only so, and only those lent to it by a
    /// server it uses (mm's pages, [`lent_key`]).
    Borrow {
        id: u64,
        interface: String,
        key: String,
    },
}

/// The key under which a server keeps a record lent to client component
/// `client` as `key` ([`VaultRequest::Borrow`]).
pub fn lent_key(client: u32, key: &str) -> String {
    format!("{LENT}{client}/{key}")
}

/// The prefix of every key [`lent_key`] makes.
pub const LENT: &str = "lent/";

/// The client and the key a [`lent_key`] names, if it is one.
pub fn parse_lent_key(lent: &str) -> Option<(u32, &str)> {
    let (client, key) = lent.strip_prefix(LENT)?.split_once('/')?;
    Some((client.parse().ok()?, key))
}

impl VaultRequest {
    /// Whether it only reads (and may come on a reader's socket).
    pub fn reads_only(&self) -> bool {
        matches!(
            self,
            Self::List { .. } | Self::Get { .. } | Self::Changes { .. }
        )
    }

    /// The id its reply carries (0 for one that has no reply).
    pub fn id(&self) -> u64 {
        match self {
            Self::Apply { id, .. }
            | Self::List { id, .. }
            | Self::Get { id, .. }
            | Self::Create { id, .. }
            | Self::Changes { id, .. }
            | Self::Borrow { id, .. } => *id,
            Self::Post { .. } | Self::Reader => 0,
        }
    }
}

/// A request as it travels: with the priority of the thread it is made for
/// (the caller's, when a server rebuilds a descriptor on its behalf), which
/// the vault's thread takes on while it serves the request.
#[derive(Debug, Serialize, Deserialize)]
pub struct VaultMessage {
    /// [`crate::priority::Priority::word`]; 0 for none.
    pub priority: u32,
    pub request: VaultRequest,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct VaultReply {
    pub id: u64,
    pub error: Option<String>,
    pub records: Vec<RecordHeader>,
    pub more: bool,
    /// For `List` and `Changes`: the number of the latest change to the
    /// component's records when the reply was made.
    #[serde(default)]
    pub seq: u64,
    /// For `Changes`: the keys deleted.
    #[serde(default)]
    pub deleted: Vec<String>,
    /// For `Changes`: the vault cannot say what changed in one reply;
    /// list again.
    #[serde(default)]
    pub relist: bool,
}

/// A record as listed; when `fd` is set its descriptor rides along, in order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordHeader {
    pub key: String,
    pub value: serde_json::Value,
    pub fd: bool,
}

/// Records per list page at most (each may carry a descriptor); a page
/// also ends before its reply would pass [`fdpass::MAX_MESSAGE`].
pub const LIST_PAGE: usize = 128;

/// The most one record may take as listed ([`RecordHeader`] as JSON,
/// [`listed_bytes`]): any record fits in a reply by itself, with room for
/// the reply's own fields. The vault refuses a larger one.
pub const MAX_RECORD: usize = fdpass::MAX_MESSAGE - 256;

/// The bytes a record of `key` and `value` takes in a reply's list, its
/// separator included.
pub fn listed_bytes(key: &str, value: &serde_json::Value) -> usize {
    /// [`RecordHeader`]'s fields, borrowed.
    #[derive(Serialize)]
    struct Listed<'a> {
        key: &'a str,
        value: &'a serde_json::Value,
        fd: bool,
    }
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(1);
    // `false`, the longer of the two.
    let listed = Listed {
        key,
        value,
        fd: false,
    };
    serde_json::to_writer(&mut n, &listed).expect("a JSON value serializes");
    n.0
}

#[derive(Debug, Error)]
pub enum VaultError {
    #[error("state vault: {0}")]
    Io(#[from] std::io::Error),
    #[error("state vault: malformed message: {0}")]
    Protocol(String),
    #[error("state vault refused: {0}")]
    Refused(String),
}

/// A record fetched back from the vault.
#[derive(Debug)]
pub struct VaultRecord {
    pub key: String,
    pub value: serde_json::Value,
    pub fd: Option<OwnedFd>,
}

/// A component's handle on its part of the vault.
pub struct Vault {
    sock: OwnedFd,
    /// One request at a time: its id, and the buffer replies are read into
    /// (kept: a fresh zeroed 128 KiB per round trip is 32 page faults, and
    /// giving it back unmaps it, a TLB shootdown across the machine).
    conn: Mutex<Conn>,
    /// The records a standby read ahead, for the first [`Vault::list`].
    ahead: Mutex<Ahead>,
    /// Raised by a listing: see [`Vault::noting_lists`].
    lists: Option<&'static AtomicU32>,
    /// How a standby builds the component's state ahead ([`prepared`]).
    builder: Option<Builder>,
}

struct Conn {
    next_id: u64,
    buf: Vec<u8>,
}

impl Vault {
    pub fn new(sock: OwnedFd) -> Self {
        // Ids start from the clock so that a new incarnation never reuses an id
        // whose reply a dead one left queued.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            sock,
            conn: Mutex::new(Conn {
                next_id: seed,
                buf: Vec::new(),
            }),
            ahead: Mutex::new(Ahead::Unread),
            lists: None,
            builder: None,
        }
    }

    /// The same, raising `flag` at every [`Vault::list`]: the component's
    /// standbys read ahead only if it lists ([`ahead`]).
    pub fn noting_lists(mut self, flag: &'static AtomicU32) -> Self {
        self.lists = Some(flag);
        self
    }

    /// Applies `ops` atomically; `fds` are the descriptors of the `Put { fd: true }` ops, in order.
    pub fn apply(&self, ops: Vec<VaultOp>, fds: &[BorrowedFd<'_>]) -> Result<(), VaultError> {
        announced(&ops, fds)?;
        self.round_trip(|id| VaultRequest::Apply { id, ops }, fds)
            .map(|_| ())
    }

    /// Applies `ops` atomically without waiting for the vault: once this
    /// returns, the request (and its descriptors) is queued on the vault's
    /// socket and will be applied even if this incarnation dies now. A
    /// refused request is only logged by the vault.
    pub fn post(&self, ops: Vec<VaultOp>, fds: &[BorrowedFd<'_>]) -> Result<(), VaultError> {
        announced(&ops, fds)?;
        self.send_only(VaultRequest::Post { ops }, fds)
    }

    /// [`Vault::post`] of one `Put` with its descriptor, allocating
    /// nothing: the message is encoded into `buf` (1 KiB holds a short key
    /// and a small value) and sent with the descriptor from the stack, at
    /// no priority. For a process that must not allocate: netd's keeper, a
    /// child forked from a threaded process, which posts the connections
    /// its dead netd had not as the supervisor dies. Only an error (a
    /// `buf` too small, a closed socket) allocates.
    pub fn post_put_unallocated(
        &self,
        buf: &mut [u8],
        key: &str,
        value: &impl Serialize,
        fd: BorrowedFd<'_>,
    ) -> Result<(), VaultError> {
        let message = unallocated::Message {
            priority: 0,
            request: unallocated::Request::Post {
                ops: [unallocated::Op::Put {
                    key,
                    value,
                    fd: true,
                }],
            },
        };
        let room = buf.len();
        let mut rest = &mut buf[..];
        serde_json::to_writer(&mut rest, &message)
            .map_err(|e| VaultError::Protocol(e.to_string()))?;
        let n = room - rest.len();
        fdpass::send(self.sock.as_fd(), &buf[..n], &[fd])?;
        Ok(())
    }

    /// Sends a request that has no reply.
    fn send_only(&self, request: VaultRequest, fds: &[BorrowedFd<'_>]) -> Result<(), VaultError> {
        let message = VaultMessage {
            priority: crate::priority::current().word(),
            request,
        };
        fdpass::send(self.sock.as_fd(), &encoded(&message)?, fds)?;
        Ok(())
    }

    pub fn put(
        &self,
        key: &str,
        value: serde_json::Value,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), VaultError> {
        let op = VaultOp::Put {
            key: key.to_string(),
            value,
            fd: fd.is_some(),
        };
        self.apply(vec![op], fd.as_slice())
    }

    pub fn delete(&self, key: &str) -> Result<(), VaultError> {
        self.apply(
            vec![VaultOp::Delete {
                key: key.to_string(),
            }],
            &[],
        )
    }

    /// Puts `value` under `key` with a new empty file made by the vault,
    /// and returns that file: what is written to it lives as long as the
    /// record does, across incarnations, and across restarts of the whole
    /// system when the vault is kept in a directory. Replaces a record
    /// already under `key`.
    pub fn create_file(&self, key: &str, value: serde_json::Value) -> Result<OwnedFd, VaultError> {
        let (reply, fds) = self.round_trip(
            |id| VaultRequest::Create {
                id,
                key: key.to_string(),
                value,
            },
            &[],
        )?;
        let mut records = records(reply.records, fds)?;
        match (records.pop(), records.is_empty()) {
            (Some(VaultRecord { fd: Some(fd), .. }), true) => Ok(fd),
            _ => Err(VaultError::Protocol(
                "a create was answered without its one file".into(),
            )),
        }
    }

    /// The record kept under `key`, if there is one.
    pub fn get(&self, key: &str) -> Result<Option<VaultRecord>, VaultError> {
        let (reply, fds) = self.round_trip(
            |id| VaultRequest::Get {
                id,
                key: key.to_string(),
            },
            &[],
        )?;
        one_record(records(reply.records, fds)?)
    }

    /// The keys of the records whose keys start with `prefix`, in order:
    /// a listing without values or descriptors.
    pub fn keys(&self, prefix: &str) -> Result<Vec<String>, VaultError> {
        let listed = self.every_page(prefix, true)?;
        Ok(listed.into_iter().map(|r| r.key).collect())
    }

    /// The record the server of `interface` lent this component as `key`
    /// (see [`VaultRequest::Borrow`]), if it did.
    pub fn borrow(&self, interface: &str, key: &str) -> Result<Option<VaultRecord>, VaultError> {
        let (reply, fds) = self.round_trip(
            |id| VaultRequest::Borrow {
                id,
                interface: interface.to_string(),
                key: key.to_string(),
            },
            &[],
        )?;
        one_record(records(reply.records, fds)?)
    }

    /// Every record this component has kept, in key order: its own and
    /// those its server stubs keep (creation records under `<interface>/`).
    /// The first call in an incarnation whose standby read them ahead
    /// ([`Vault::read_ahead_until`]) asks the vault only what changed since.
    pub fn list(&self) -> Result<Vec<VaultRecord>, VaultError> {
        match self.caught_up()? {
            Some(FirstListing::Records(listed)) => Ok(listed),
            // Built by a standby of a component that names how, yet lists:
            // the records it was built from are not kept, so ask again.
            Some(FirstListing::Built(_)) | None => self.list_prefix(""),
        }
    }

    /// The records whose keys start with `prefix`, in key order (chosen by
    /// the vault: the others are not sent).
    pub fn list_prefix(&self, prefix: &str) -> Result<Vec<VaultRecord>, VaultError> {
        self.every_page(prefix, false)
    }

    /// Every page of a listing of `prefix` (of keys alone with `keys_only`).
    fn every_page(&self, prefix: &str, keys_only: bool) -> Result<Vec<VaultRecord>, VaultError> {
        let mut out = Vec::new();
        loop {
            let after = out.last().map(|r: &VaultRecord| r.key.as_str());
            let page = self.page(prefix, after, keys_only)?;
            out.extend(page.records);
            if !page.more {
                return Ok(out);
            }
        }
    }

    /// One round trip of [`Vault::list_prefix`]: up to [`LIST_PAGE`]
    /// records (fewer if they would not fit in one reply) with keys after `after` (all, for none) that start with
    /// `prefix`, in key order, and whether more follow.
    pub fn list_page(
        &self,
        prefix: &str,
        after: Option<&str>,
    ) -> Result<(Vec<VaultRecord>, bool), VaultError> {
        let page = self.page(prefix, after, false)?;
        Ok((page.records, page.more))
    }

    /// One page of a listing, with the number of the latest change when it
    /// was made.
    fn page(&self, prefix: &str, after: Option<&str>, keys_only: bool) -> Result<Page, VaultError> {
        let (reply, fds) = self.round_trip(
            |id| VaultRequest::List {
                id,
                after: after.map(str::to_string),
                prefix: prefix.to_string(),
                keys_only,
            },
            &[],
        )?;
        Ok(Page {
            more: reply.more,
            seq: reply.seq,
            records: records(reply.records, fds)?,
        })
    }

    fn round_trip(
        &self,
        make: impl FnOnce(u64) -> VaultRequest,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(VaultReply, Vec<OwnedFd>), VaultError> {
        let mut conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        conn.next_id += 1;
        let id = conn.next_id;
        let message = VaultMessage {
            priority: crate::priority::current().word(),
            request: make(id),
        };
        fdpass::send(self.sock.as_fd(), &encoded(&message)?, fds)?;
        loop {
            let (n, fds) = fdpass::recv_into(self.sock.as_fd(), &mut conn.buf)?;
            let bytes = &conn.buf[..n];
            if bytes.is_empty() {
                return Err(VaultError::Io(std::io::Error::other(
                    "the vault closed the connection",
                )));
            }
            let reply: VaultReply =
                serde_json::from_slice(bytes).map_err(|e| VaultError::Protocol(e.to_string()))?;
            if reply.id == 0 {
                // The vault could not read the request at all.
                let why = reply.error.unwrap_or_else(|| "unreadable request".into());
                return Err(VaultError::Protocol(why));
            }
            if reply.id != id {
                continue; // a reply meant for a dead incarnation
            }
            if let Some(e) = reply.error {
                return Err(VaultError::Refused(e));
            }
            return Ok((reply, fds));
        }
    }
}

/// The record of a reply that carries one or none.
fn one_record(mut records: Vec<VaultRecord>) -> Result<Option<VaultRecord>, VaultError> {
    match records.len() {
        0 | 1 => Ok(records.pop()),
        n => Err(VaultError::Protocol(format!("{n} records for one key"))),
    }
}

/// One page of a listing.
struct Page {
    records: Vec<VaultRecord>,
    more: bool,
    seq: u64,
}

/// Borrowing twins of [`VaultMessage`], [`VaultRequest`] and [`VaultOp`]
/// for one post of one `Put`, which serialize to what the owned ones do
/// (checked by a test) without a `String` or a `Value` to allocate.
mod unallocated {
    use serde::Serialize;

    #[derive(Serialize)]
    pub struct Message<'a, V> {
        pub priority: u32,
        pub request: Request<'a, V>,
    }

    #[derive(Serialize)]
    pub enum Request<'a, V> {
        Post { ops: [Op<'a, V>; 1] },
    }

    #[derive(Serialize)]
    pub enum Op<'a, V> {
        Put {
            key: &'a str,
            value: &'a V,
            fd: bool,
        },
    }
}

/// `message` as sent, refused here if the vault could not read it whole.
fn encoded(message: &VaultMessage) -> Result<Vec<u8>, VaultError> {
    let bytes = serde_json::to_vec(message).map_err(|e| VaultError::Protocol(e.to_string()))?;
    if bytes.len() > fdpass::MAX_MESSAGE {
        return Err(VaultError::Refused(format!(
            "a request of {} bytes is larger than the vault reads ({})",
            bytes.len(),
            fdpass::MAX_MESSAGE
        )));
    }
    Ok(bytes)
}

fn fds_announced(ops: &[VaultOp]) -> usize {
    ops.iter()
        .filter(|op| matches!(op, VaultOp::Put { fd: true, .. }))
        .count()
}

/// Checks that `fds` are the descriptors the `Put { fd: true }` ops announce.
fn announced(ops: &[VaultOp], fds: &[BorrowedFd<'_>]) -> Result<(), VaultError> {
    let wanted = fds_announced(ops);
    if wanted != fds.len() {
        return Err(VaultError::Protocol(format!(
            "{wanted} descriptors announced, {} given",
            fds.len()
        )));
    }
    Ok(())
}

/// Joins listed records with the descriptors that rode along, in order.
fn records(headers: Vec<RecordHeader>, fds: Vec<OwnedFd>) -> Result<Vec<VaultRecord>, VaultError> {
    let mut fds = fds.into_iter();
    headers
        .into_iter()
        .map(|h| {
            let fd = match h.fd {
                true => Some(
                    fds.next()
                        .ok_or_else(|| VaultError::Protocol("missing descriptor".into()))?,
                ),
                false => None,
            };
            Ok(VaultRecord {
                key: h.key,
                value: h.value,
                fd,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Conn {
        holder: (u32, u32),
        rb: u64,
    }

    #[test]
    fn a_post_sent_unallocated_reads_as_the_owned_post() {
        let (ours, vault) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let client = Vault::new(ours);
        let value = Conn {
            holder: (3, 7),
            rb: 12,
        };
        let (kept, _other) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut buf = [0u8; 1024];
        client
            .post_put_unallocated(&mut buf, "c/00000000000000ff", &value, kept.as_fd())
            .unwrap();
        let (bytes, fds) = fdpass::recv(&vault).unwrap();
        let message: VaultMessage = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(message.priority, 0);
        let VaultRequest::Post { ops } = message.request else {
            panic!("not a post: {:?}", message.request);
        };
        assert_eq!(
            ops,
            [VaultOp::Put {
                key: "c/00000000000000ff".into(),
                value: serde_json::to_value(&value).unwrap(),
                fd: true,
            }]
        );
        assert_eq!(fds.len(), 1);
        let inode = |fd: BorrowedFd<'_>| rustix::fs::fstat(fd).unwrap().st_ino;
        assert_eq!(inode(fds[0].as_fd()), inode(kept.as_fd()));

        // Too small a buffer: refused, nothing sent.
        let mut small = [0u8; 16];
        let refused = client.post_put_unallocated(&mut small, "k", &value, kept.as_fd());
        assert!(
            matches!(refused, Err(VaultError::Protocol(_))),
            "{refused:?}"
        );
    }
}
