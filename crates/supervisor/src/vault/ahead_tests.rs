//! A standby's read of its vault ahead of its activation, through the
//! real protocol: a reader's socket, its copy brought up to date while the
//! live incarnation changes the records, and the first listing made from
//! it with one request.

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kintsugi_runtime::abi::fdpass;
use kintsugi_runtime::vault::{
    Builder, Listing, Vault, VaultError, VaultMessage, VaultRecord, VaultRequest,
};
use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};

use super::tests::served;
use super::VaultStore;

/// A served component: its store, its socket, what the vault thread has
/// taken, and the live incarnation's client.
struct Served {
    _store: VaultStore,
    sock: std::os::fd::OwnedFd,
    activity: Arc<super::VaultActivity>,
    live: Vault,
}

fn component() -> Served {
    let store = VaultStore::default();
    let (sock, activity) = served(&store);
    let live = Vault::new(sock.try_clone().unwrap());
    Served {
        _store: store,
        sock,
        activity,
        live,
    }
}

impl Served {
    /// A standby's client on the component's socket.
    fn standby(&self) -> Arc<Vault> {
        Arc::new(Vault::new(self.sock.try_clone().unwrap()))
    }

    /// `standby`'s first listing, as comparable, and the requests it made.
    fn listed_by(&self, standby: &Vault) -> (Vec<(String, String, Option<String>)>, u64) {
        let before = self.activity.taking.load(Ordering::SeqCst);
        let listed = seen(standby.list().unwrap());
        (listed, self.activity.taking.load(Ordering::SeqCst) - before)
    }
}

/// Records as comparable: key, value, and the contents of a file or the
/// kind of any other descriptor.
fn seen(records: Vec<VaultRecord>) -> Vec<(String, String, Option<String>)> {
    records
        .into_iter()
        .map(|r| {
            let fd = r.fd.map(|fd| {
                let st = rustix::fs::fstat(&fd).unwrap();
                match rustix::fs::FileType::from_raw_mode(st.st_mode) {
                    rustix::fs::FileType::RegularFile => {
                        // From the start: the offset is the writer's too.
                        let mut bytes = vec![0; st.st_size as usize];
                        std::fs::File::from(fd)
                            .read_exact_at(&mut bytes, 0)
                            .unwrap();
                        String::from_utf8(bytes).unwrap()
                    }
                    other => format!("{other:?}"),
                }
            });
            (r.key, r.value.to_string(), fd)
        })
        .collect()
}

fn file(vault: &Vault, key: &str, contents: &str) {
    let fd = vault.create_file(key, serde_json::json!(key)).unwrap();
    std::fs::File::from(fd)
        .write_all(contents.as_bytes())
        .unwrap();
}

#[test]
fn a_copy_read_ahead_and_kept_up_to_date_lists_what_the_vault_holds_in_one_request() {
    let c = component();
    let live = &c.live;
    // More than two pages: 150 files, 150 plain records, and a socket.
    for i in 0..150 {
        file(live, &format!("f{i:03}"), &format!("contents {i}"));
        live.put(&format!("p{i:03}"), serde_json::json!(i), None)
            .unwrap();
    }
    let (peer, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    live.put("sock", serde_json::json!("s"), Some(peer.as_fd()))
        .unwrap();
    drop(peer);

    let standby = c.standby();
    read_ahead_for(&standby, std::time::Duration::ZERO, || {
        // Changes while it reads and between its refreshes.
        std::thread::sleep(std::time::Duration::from_millis(50));
        for i in 0..10 {
            live.delete(&format!("f{i:03}")).unwrap();
            live.put(&format!("p{i:03}"), serde_json::json!("new"), None)
                .unwrap();
        }
        file(live, "f900", "made while the standby waited");
        std::thread::sleep(
            kintsugi_runtime::vault::REFRESH * 2 + kintsugi_runtime::vault::REFRESH / 2,
        );
        live.delete("p149").unwrap();
        file(live, "f010", "written again");
    });

    let (listed, requests) = c.listed_by(&standby);
    let truth = seen(live.list_prefix("").unwrap());
    assert_eq!(listed, truth);
    assert_eq!(listed.len(), 150 - 10 + 1 + 150 - 1 + 1, "{listed:?}");
    assert!(listed.contains(&("sock".into(), "\"s\"".into(), Some("Socket".into()))));
    assert_eq!(requests, 1, "the first listing asked what changed, once");
    // Later listings ask the vault.
    assert_eq!(seen(standby.list().unwrap()), truth);
}

#[test]
fn a_readers_socket_serves_reads_only_and_never_a_socket() {
    let c = component();
    let live = &c.live;
    file(live, "f", "file");
    let (peer, _other) = std::os::unix::net::UnixStream::pair().unwrap();
    live.put("sock", serde_json::json!("s"), Some(peer.as_fd()))
        .unwrap();
    let (mine, theirs) = socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let message = VaultMessage {
        priority: 0,
        request: VaultRequest::Reader,
    };
    let bytes = serde_json::to_vec(&message).unwrap();
    fdpass::send(c.sock.as_fd(), &bytes, &[theirs.as_fd()]).unwrap();
    drop(theirs);
    let reader = Vault::new(mine);
    let listed = seen(reader.list_prefix("").unwrap());
    assert_eq!(
        listed,
        vec![("f".into(), "\"f\"".into(), Some("file".into()))]
    );
    let refused = reader.put("x", serde_json::json!(1), None);
    assert!(
        matches!(&refused, Err(VaultError::Refused(why)) if why.contains("reads only")),
        "{refused:?}"
    );
    assert_eq!(
        seen(live.list_prefix("").unwrap()).len(),
        2,
        "nothing written"
    );
}

/// More changes than one reply holds since the copy was read: the first
/// listing lists again, and is as right.
#[test]
fn a_copy_with_more_changes_than_a_reply_holds_is_listed_again() {
    let c = component();
    let live = &c.live;
    for i in 0..10 {
        file(live, &format!("f{i}"), "before");
    }
    let standby = c.standby();
    let reading = {
        let standby = standby.clone();
        // Reads once, then stops at the first refresh.
        std::thread::spawn(move || standby.read_ahead_until(|| true).unwrap())
    };
    reading.join().unwrap();
    for i in 0..200 {
        live.put(&format!("p{i:03}"), serde_json::json!(i), None)
            .unwrap();
    }
    let (listed, requests) = c.listed_by(&standby);
    assert_eq!(listed, seen(live.list_prefix("").unwrap()));
    assert_eq!(listed.len(), 210);
    assert_eq!(requests, 1 + 2, "asked what changed, then two pages");
}

/// The state a standby builds from what it read ahead: built once the
/// records stood for a refresh, taken as built if they did not change
/// since, the records given otherwise.
#[test]
fn a_state_built_ahead_is_taken_only_while_its_records_stand() {
    type Seen = Vec<(String, String, Option<String>)>;
    let refresh = kintsugi_runtime::vault::REFRESH;
    let c = component();
    let live = &c.live;
    for i in 0..20 {
        file(live, &format!("f{i:02}"), &format!("contents {i}"));
        live.put(&format!("p{i:02}"), serde_json::json!(i), None)
            .unwrap();
    }
    let building = || {
        let vault = Vault::new(c.sock.try_clone().unwrap());
        Arc::new(vault.building_ahead(Builder::new(seen)))
    };
    let first_listing = |standby: &Vault| {
        let before = c.activity.taking.load(Ordering::SeqCst);
        let listing = standby.list_prepared::<Seen>().unwrap();
        (listing, c.activity.taking.load(Ordering::SeqCst) - before)
    };

    // Activated before a refresh: not built yet, the records.
    let standby = building();
    read_ahead_for(&standby, refresh / 2, || {});
    let (listing, requests) = first_listing(&standby);
    assert!(matches!(&listing, Listing::Records(r) if r.len() == 40));
    assert_eq!(requests, 1, "asked what changed, once");

    // The records stood for a refresh, and nothing changed since: the state
    // as built, one request.
    let standby = building();
    read_ahead_for(&standby, refresh * 2, || {});
    let (listing, requests) = first_listing(&standby);
    let Listing::Prepared(state) = listing else {
        panic!("the records stood, yet the state was not taken");
    };
    assert_eq!(state, seen(live.list_prefix("").unwrap()));
    assert_eq!(state.len(), 40);
    assert_eq!(requests, 1, "asked what changed, once");

    // A record changed after it built: the records, up to date.
    let standby = building();
    read_ahead_for(&standby, refresh * 2, || {});
    live.put("p03", serde_json::json!("changed"), None).unwrap();
    live.delete("f07").unwrap();
    let Listing::Records(records) = first_listing(&standby).0 else {
        panic!("the records changed, yet the state built before was taken");
    };
    assert_eq!(seen(records), seen(live.list_prefix("").unwrap()));

    // Changed while it waited, then stood: built again.
    let standby = building();
    read_ahead_for(&standby, refresh * 3, || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        file(live, "f99", "made while the standby waited");
    });
    let Listing::Prepared(state) = first_listing(&standby).0 else {
        panic!("the state was not built again once the records stood");
    };
    assert_eq!(state, seen(live.list_prefix("").unwrap()));
    assert!(state.contains(&(
        "f99".into(),
        "\"f99\"".into(),
        Some("made while the standby waited".into())
    )));

    // Asked as another type than built: the records.
    let standby = building();
    read_ahead_for(&standby, refresh * 2, || {});
    let listing = standby.list_prepared::<u32>().unwrap();
    assert!(matches!(&listing, Listing::Records(r) if r.len() == state.len()));
}

/// A standby's read of its records ahead, activated after `wait` or once
/// `meanwhile` has run, whichever is later.
fn read_ahead_for(standby: &Arc<Vault>, wait: std::time::Duration, meanwhile: impl FnOnce()) {
    let activated = Arc::new(AtomicBool::new(false));
    let reading = {
        let (standby, activated) = (standby.clone(), activated.clone());
        std::thread::spawn(move || {
            standby
                .read_ahead_until(|| activated.load(Ordering::SeqCst))
                .unwrap()
        })
    };
    let start = std::time::Instant::now();
    meanwhile();
    std::thread::sleep(wait.saturating_sub(start.elapsed()));
    activated.store(true, Ordering::SeqCst);
    reading.thread().unpark();
    reading.join().unwrap();
}
