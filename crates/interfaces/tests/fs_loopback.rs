//! End to end over real shared memory: the generated `fs` client and server
//! stubs, a tiny in-memory file server, and micro-reboots of that server.
//! The client keeps its `File` handles across reboots; the generated stub
//! replays `open` and `seek` to rebuild them.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_interfaces::fs::{self, Error, File, Stat};
use kintsugi_runtime::stub::{CallError, Caller, Dispatched, Fault, InterfaceError, Refusal};
use kintsugi_runtime::testing::Loopback;
use kintsugi_runtime::wire::{ReplyBudget, WireError, Writer};

const CREATE: u32 = 1;
const TRUNCATE: u32 = 2;

/// What survives a reboot (the state vault's part): file contents, and a log
/// of the calls the server served.
#[derive(Default)]
struct Storage {
    files: Mutex<BTreeMap<String, Vec<u8>>>,
    log: Mutex<Vec<String>>,
    /// `open`s with flags 0: in the threaded test, only recovery replays.
    replays: AtomicU64,
    /// Replies to `read` and `write` to make too large (a faulty server's),
    /// and by how much: each such reply takes one.
    lies: AtomicU64,
    /// Calls on a descriptor to answer as if it had never been opened (a
    /// fault damaged the table of open descriptors): each takes one.
    forgets: AtomicU64,
    /// `readdir` answers every name at once, whether or not they fit in
    /// one reply.
    unpaged: std::sync::atomic::AtomicBool,
}

impl Storage {
    /// Whether to forget the descriptor of this call.
    fn maybe_forget(&self) -> bool {
        self.forgets
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
            .is_ok()
    }

    /// `n` too large by the lie's amount, if one is left to tell.
    fn maybe_lie(&self, n: u64) -> u64 {
        let lie = self
            .lies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
            .is_ok();
        n + if lie { LIE } else { 0 }
    }
}

/// How much a lying reply adds (a flip of bit 11).
const LIE: u64 = 2048;

/// One incarnation of the file server: its open descriptors die with it.
struct RamFs {
    store: Arc<Storage>,
    /// Ids differ between incarnations, so that a stale id would be caught.
    next: AtomicU64,
    open: Mutex<HashMap<u64, (String, u64)>>,
}

impl RamFs {
    fn new(store: &Arc<Storage>, incarnation: u64) -> Arc<Self> {
        Arc::new(RamFs {
            store: store.clone(),
            next: AtomicU64::new(incarnation * 1000),
            open: Mutex::default(),
        })
    }

    fn log(&self, s: String) {
        self.store.log.lock().unwrap().push(s);
    }

    fn with_fd<T>(&self, fd: u64, f: impl FnOnce(&mut (String, u64)) -> T) -> Result<T, Error> {
        let mut open = self.open.lock().unwrap();
        if self.store.maybe_forget() {
            open.remove(&fd);
        }
        open.get_mut(&fd).map(f).ok_or(Error::BadFd)
    }
}

impl fs::Server for RamFs {
    fn open(&self, _: &Caller, path: &str, flags: u32) -> Result<u64, Error> {
        self.log(format!("open {path} {flags}"));
        if flags == 0 {
            self.store.replays.fetch_add(1, Ordering::Relaxed);
        }
        let mut files = self.store.files.lock().unwrap();
        match files.get_mut(path) {
            Some(data) if flags & TRUNCATE != 0 => data.clear(),
            Some(_) => {}
            None if flags & CREATE != 0 => {
                files.insert(path.to_string(), Vec::new());
            }
            None => return Err(Error::NotFound),
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.open.lock().unwrap().insert(id, (path.to_string(), 0));
        Ok(id)
    }

    fn read(&self, _: &Caller, fd: u64, len: u32, out: &mut [u8]) -> Result<usize, Error> {
        self.log(format!("read {len}"));
        let files = self.store.files.lock().unwrap();
        self.with_fd(fd, |(path, offset)| {
            let data = &files[path.as_str()];
            let start = (*offset as usize).min(data.len());
            let n = (len as usize).min(data.len() - start).min(out.len());
            out[..n].copy_from_slice(&data[start..start + n]);
            *offset += n as u64;
            self.store.maybe_lie(n as u64) as usize
        })
    }

    fn write(&self, _: &Caller, fd: u64, data: &[u8]) -> Result<u32, Error> {
        self.log(format!("write {}", data.len()));
        let mut files = self.store.files.lock().unwrap();
        self.with_fd(fd, |(path, offset)| {
            let file = files.get_mut(path.as_str()).unwrap();
            let end = *offset as usize + data.len();
            if file.len() < end {
                file.resize(end, 0);
            }
            file[*offset as usize..end].copy_from_slice(data);
            *offset = end as u64;
            self.store.maybe_lie(data.len() as u64) as u32
        })
    }

    fn seek(&self, _: &Caller, fd: u64, pos: u64) -> Result<u64, Error> {
        self.log(format!("seek {pos}"));
        self.with_fd(fd, |(_, offset)| {
            *offset = pos;
            pos
        })
    }

    fn truncate(&self, _: &Caller, fd: u64, len: u64) -> Result<(), Error> {
        let path = self.with_fd(fd, |(path, _)| path.clone())?;
        self.store
            .files
            .lock()
            .unwrap()
            .get_mut(&path)
            .unwrap()
            .resize(len as usize, 0);
        Ok(())
    }

    fn close(&self, _: &Caller, fd: u64) -> Result<(), Error> {
        self.log("close".into());
        self.open
            .lock()
            .unwrap()
            .remove(&fd)
            .map(|_| ())
            .ok_or(Error::BadFd)
    }

    fn stat(&self, _: &Caller, path: &str) -> Result<Stat, Error> {
        let files = self.store.files.lock().unwrap();
        let is_dir = files.keys().any(|k| k.starts_with(&format!("{path}/")));
        match files.get(path) {
            Some(data) => Ok(Stat {
                size: data.len() as u64,
                is_dir: false,
                counter: 0,
            }),
            None if is_dir => Ok(Stat {
                size: 0,
                is_dir: true,
                counter: 0,
            }),
            None => Err(Error::NotFound),
        }
    }

    fn unlink(&self, _: &Caller, path: &str) -> Result<(), Error> {
        self.store
            .files
            .lock()
            .unwrap()
            .remove(path)
            .map(|_| ())
            .ok_or(Error::NotFound)
    }

    fn mkdir(&self, _: &Caller, _: &str) -> Result<(), Error> {
        Err(Error::Exists)
    }

    fn rename(&self, _: &Caller, from: &str, to: &str) -> Result<(), Error> {
        let mut files = self.store.files.lock().unwrap();
        let data = files.remove(from).ok_or(Error::NotFound)?;
        files.insert(to.to_string(), data);
        Ok(())
    }

    fn readdir(&self, _: &Caller, path: &str, after: &str) -> Result<Vec<String>, Error> {
        let prefix = format!("{path}/");
        let files = self.store.files.lock().unwrap();
        let mut reply = ReplyBudget::list();
        let unpaged = self.store.unpaged.load(Ordering::SeqCst);
        Ok(files
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .filter(|name| *name > after)
            .take_while(|name| unpaged || reply.take(&[name.len()]))
            .map(str::to_string)
            .collect())
    }
}

struct Setup {
    store: Arc<Storage>,
    lb: Loopback,
    client: Arc<fs::Client>,
    incarnation: u64,
}

impl Setup {
    fn new() -> Self {
        let store = Arc::new(Storage::default());
        let lb = Loopback::new(fs::service(RamFs::new(&store, 1)));
        let client = Arc::new(fs::Client::from_connection(lb.connection()));
        Setup {
            store,
            lb,
            client,
            incarnation: 1,
        }
    }

    /// A micro-reboot: a fresh server that has the files but no descriptors.
    fn reboot(&mut self) {
        self.incarnation += 1;
        self.lb
            .reboot(fs::service(RamFs::new(&self.store, self.incarnation)));
        self.store.log.lock().unwrap().clear();
    }

    fn log(&self) -> Vec<String> {
        self.store.log.lock().unwrap().clone()
    }
}

#[test]
fn descriptors_survive_reboots() {
    let mut s = Setup::new();
    let c = s.client.clone();
    let f = c.open("/a", CREATE | TRUNCATE).unwrap();
    assert_eq!(c.write(f, b"hello world").unwrap(), 11);
    assert_eq!(c.seek(f, 6).unwrap(), 6);
    assert_eq!(c.read(f, 3).unwrap(), b"wor");
    assert_eq!(c.tracked_files(), 1);

    s.reboot();
    // Same handle, right bytes at the right offset (6 + 3).
    assert_eq!(c.read(f, 100).unwrap(), b"ld");
    // Recovery replayed `open` with flags 0 (no truncation), then `seek`.
    assert_eq!(s.log(), ["open /a 0", "seek 9", "read 100"]);
    assert_eq!(c.tracked_files(), 1);

    // A descriptor still at offset 0 needs no seek.
    let g = c.open("/a", 0).unwrap();
    s.reboot();
    assert_eq!(c.read(g, 5).unwrap(), b"hello");
    assert_eq!(s.log(), ["open /a 0", "read 5"]);
    // Writes advance the tracked offset too.
    assert_eq!(c.write(f, b"!!").unwrap(), 2);
    s.reboot();
    assert_eq!(c.write(f, b"?").unwrap(), 1);
    assert_eq!(s.log(), ["open /a 0", "seek 13", "write 1"]);
    assert_eq!(s.store.files.lock().unwrap()["/a"], b"hello world!!?");
    assert_eq!(
        c.stat("/a").unwrap(),
        Stat {
            size: 14,
            is_dir: false,
            counter: 0
        }
    );
}

/// A write that claims more bytes than it was given, or a read that
/// returns more than was asked (`at_most` in the IDL), is a faulty
/// server's reply: the watched client stub has the server rebooted and
/// runs the call again, and the offset it tracks never takes in the lie.
/// The test plays the watchdog.
#[test]
fn a_reply_beyond_its_call_has_the_server_rebooted() {
    let store = Arc::new(Storage::default());
    let lb = Arc::new(Loopback::new(fs::service(RamFs::new(&store, 1))));
    let client = Arc::new(fs::Client::from_connection(lb.watched_connection()));
    let watchdog = Watchdog::start(&lb, &store);
    let f = client.open("/a", CREATE).unwrap();
    store.lies.store(1, Ordering::SeqCst);
    assert_eq!(client.write(f, b"hello").unwrap(), 5);
    assert_eq!(lb.epoch(), 2, "the lying server was rebooted");
    assert_eq!(client.write(f, b" world").unwrap(), 6);
    assert_eq!(store.files.lock().unwrap()["/a"], b"hello world");

    // A read's lie, in another thread.
    let reader = client.clone();
    let got = std::thread::spawn(move || {
        reader.seek(f, 6).unwrap();
        store.lies.store(1, Ordering::SeqCst);
        let got = reader.read(f, 3).unwrap();
        (got, reader.read(f, 100).unwrap())
    })
    .join()
    .unwrap();
    assert_eq!(got, (b"wor".to_vec(), b"ld".to_vec()));
    assert_eq!(lb.epoch(), 3);
    watchdog.stop();
}

/// A directory larger than one reply is listed a page at a time, and a
/// reply that cannot fit in a slot (a server that answers every name at
/// once) is an error for the caller, not a fault of the server: the
/// server is neither suspected nor rebooted, where taking it for faulty
/// would reboot it on every such call.
#[test]
fn a_directory_larger_than_a_reply_is_paged_and_an_unpaged_one_suspects_no_one() {
    let store = Arc::new(Storage::default());
    let lb = Arc::new(Loopback::new(fs::service(RamFs::new(&store, 1))));
    let client = Arc::new(fs::Client::from_connection(lb.watched_connection()));
    let watchdog = Watchdog::start(&lb, &store);
    let names: Vec<String> = (0..400)
        .map(|i| format!("{i:03}{}", "n".repeat(250)))
        .collect();
    for name in &names {
        client.open(&format!("/big/{name}"), CREATE).unwrap();
    }
    let first = client.readdir("/big", "").unwrap();
    assert!(
        !first.is_empty() && first.len() < names.len(),
        "{} names in the first page",
        first.len()
    );
    assert_eq!(first[..], names[..first.len()]);
    assert_eq!(client.readdir_all("/big").unwrap(), names);

    store.unpaged.store(true, Ordering::SeqCst);
    match client.readdir("/big", "") {
        Err(CallError::Fault(Fault::Refused(why))) => {
            assert!(why.contains("does not fit"), "{why}")
        }
        other => panic!("an unpaged listing answered {other:?}"),
    }
    // A page that fits is still answered, by the same incarnation.
    assert_eq!(client.readdir("/big", &names[398]).unwrap(), names[399..]);
    assert_eq!(lb.epoch(), 1, "no reboot");
    assert_eq!(lb.suspected(), 0, "no suspicion");
    watchdog.stop();
}

/// Plays the watchdog: reboots the server whenever a client suspects the
/// live incarnation.
struct Watchdog {
    done: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<()>,
}

impl Watchdog {
    fn start(lb: &Arc<Loopback>, store: &Arc<Storage>) -> Self {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (lb, store, stop) = (lb.clone(), store.clone(), done.clone());
        let thread = std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if lb.suspected() == lb.epoch() {
                    lb.reboot(fs::service(RamFs::new(&store, lb.epoch() + 1)));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        });
        Self { done, thread }
    }

    fn stop(self) {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap();
    }
}

/// `BadFd` (the `unknown` error of `File`) for a descriptor the client
/// stub holds in the call's epoch: the server lost what it handed out. The
/// watched stub has it rebooted and makes the call again on the descriptor
/// rebuilt; an unwatched one returns the error.
#[test]
fn a_server_that_loses_a_descriptor_it_handed_out_is_rebooted() {
    let store = Arc::new(Storage::default());
    let lb = Arc::new(Loopback::new(fs::service(RamFs::new(&store, 1))));
    let client = fs::Client::from_connection(lb.watched_connection());
    let watchdog = Watchdog::start(&lb, &store);
    let f = client.open("/a", CREATE).unwrap();
    assert_eq!(client.write(f, b"hello").unwrap(), 5);
    store.log.lock().unwrap().clear();
    store.forgets.store(1, Ordering::SeqCst);
    assert_eq!(client.write(f, b" world").unwrap(), 6);
    assert_eq!(
        lb.epoch(),
        2,
        "the server that lost a descriptor was rebooted"
    );
    assert_eq!(
        store.log.lock().unwrap()[1..],
        ["open /a 0", "seek 5", "write 6"]
    );
    assert_eq!(store.files.lock().unwrap()["/a"], b"hello world");
    watchdog.stop();

    let s = Setup::new();
    let f = s.client.open("/b", CREATE).unwrap();
    s.store.forgets.store(1, Ordering::SeqCst);
    assert_eq!(
        s.client.write(f, b"x"),
        Err(CallError::Server(Error::BadFd))
    );
    assert_eq!(s.lb.epoch(), 1);
}

#[test]
fn several_reboots_in_a_row_and_seek_back_to_zero() {
    let mut s = Setup::new();
    let c = s.client.clone();
    let f = c.open("/b", CREATE).unwrap();
    c.write(f, b"0123456789").unwrap();
    for _ in 0..3 {
        s.reboot();
    }
    assert_eq!(c.read(f, 2).unwrap(), b"");
    assert_eq!(c.seek(f, 0).unwrap(), 0);
    s.reboot();
    assert_eq!(c.read(f, 4).unwrap(), b"0123");
    assert_eq!(s.log(), ["open /b 0", "read 4"]);
}

#[test]
fn close_after_reboot_is_local() {
    let mut s = Setup::new();
    let c = s.client.clone();
    let f = c.open("/c", CREATE).unwrap();
    let g = c.open("/c", 0).unwrap();
    c.close(g).unwrap();
    assert_eq!(s.log().last().unwrap(), "close");
    s.reboot();
    c.close(f).unwrap();
    // The new incarnation never had `f`: nothing to tell it.
    assert!(s.log().is_empty());
    assert_eq!(c.tracked_files(), 0);
    assert_eq!(c.read(f, 1), Err(CallError::BadDescriptor(f.0)));
    assert_eq!(c.close(f), Err(CallError::BadDescriptor(f.0)));
    assert_eq!(c.read(File(999), 1), Err(CallError::BadDescriptor(999)));
}

#[test]
fn interface_errors_reach_the_caller() {
    let s = Setup::new();
    let c = &s.client;
    assert_eq!(
        c.open("/missing", 0),
        Err(CallError::Server(Error::NotFound))
    );
    assert_eq!(c.stat("/missing"), Err(CallError::Server(Error::NotFound)));
    // Without an interrupted first attempt, retry_ok errors are plain errors.
    assert_eq!(
        c.unlink("/missing"),
        Err(CallError::Server(Error::NotFound))
    );
    assert_eq!(c.mkdir("/d"), Err(CallError::Server(Error::Exists)));
    c.open("/d/x", CREATE).unwrap();
    c.open("/d/y", CREATE).unwrap();
    assert_eq!(c.readdir_all("/d").unwrap(), ["x", "y"]);
    assert_eq!(
        c.stat("/d").unwrap(),
        Stat {
            size: 0,
            is_dir: true,
            counter: 0
        }
    );
    c.rename("/d/x", "/d/z").unwrap();
    c.unlink("/d/y").unwrap();
    assert_eq!(c.readdir_all("/d").unwrap(), ["z"]);
    assert_eq!(Error::NotFound.to_string(), "not found");
    assert_eq!(Error::from_code(Error::BadFd.code()), Some(Error::BadFd));
    assert_eq!(Error::from_code(0), None);
}

#[test]
fn out_of_range_arguments_are_refused() {
    let s = Setup::new();
    let c = &s.client;
    let f = c.open("/r", CREATE).unwrap();
    match c.read(f, 65537) {
        Err(CallError::Fault(Fault::Refused(why))) => assert!(why.contains("`len`"), "{why}"),
        other => panic!("{other:?}"),
    }
    match c.write(f, &vec![7u8; 65537]) {
        Err(CallError::Fault(Fault::Refused(why))) => assert!(why.contains("`data`"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Refused by the client stub, not sent: no effect.
    assert_eq!(s.log(), ["open /r 1"]);
    assert_eq!(c.write(f, &[1; 65536]).unwrap(), 65536);
    assert_eq!(c.read(f, 65536).unwrap(), b"");
}

#[test]
fn server_stub_refuses_bad_requests() {
    let store = Arc::new(Storage::default());
    let svc = fs::service(RamFs::new(&store, 1));
    let caller = Caller {
        component: 1,
        slot: 0,
    };
    let mut out = [0u8; 64];
    assert_eq!(svc.interface().name, "fs");
    assert_eq!(svc.interface().functions[fs::FN_SEEK as usize], "seek");
    assert_eq!(
        svc.dispatch(&caller, 99, &[], &mut out),
        Dispatched::Refused(Refusal::UnknownFunction(99))
    );
    // `stat` with a truncated string, then with trailing bytes.
    let truncated = [9, 0, 0, 0, b'/'];
    let refused = svc.dispatch(&caller, fs::FN_STAT, &truncated, &mut out);
    assert_eq!(
        refused,
        Dispatched::Refused(Refusal::Malformed(WireError::Truncated))
    );
    let trailing = [1, 0, 0, 0, b'/', 0];
    let refused = svc.dispatch(&caller, fs::FN_STAT, &trailing, &mut out);
    assert_eq!(
        refused,
        Dispatched::Refused(Refusal::Malformed(WireError::Trailing(1)))
    );
    // What a generated client does not send, the server refuses too.
    let mut long = [0u8; 12];
    let mut w = Writer::new(&mut long);
    w.u64(1).unwrap();
    w.u32(65537).unwrap();
    assert_eq!(
        svc.dispatch(&caller, fs::FN_READ, &long, &mut out),
        Dispatched::Refused(Refusal::OutOfRange("len"))
    );
    let missing = [2, 0, 0, 0, b'/', b'x'];
    assert_eq!(
        svc.dispatch(&caller, fs::FN_STAT, &missing, &mut out),
        Dispatched::AppError(Error::NotFound.code())
    );
}

#[test]
fn generated_module_matches_the_idl() {
    let text = include_str!("../idl/fs.kidl");
    let iface = kintsugi_idl::parse(std::path::Path::new("interfaces/fs.kidl"), text).unwrap();
    assert_eq!(fs::INFO.hash, iface.hash());
    let names: Vec<&str> = iface.functions.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(fs::INFO.functions, names.as_slice());
}

#[test]
fn threads_share_a_client_across_reboots() {
    const WRITES: u32 = 2000;
    let mut s = Setup::new();
    let finished = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..3)
        .map(|t| {
            let client = s.client.clone();
            let finished = finished.clone();
            std::thread::spawn(move || {
                let f = client.open(&format!("/t{t}"), CREATE).unwrap();
                for i in 0..WRITES {
                    client.write(f, &i.to_le_bytes()).unwrap();
                }
                client.seek(f, 0).unwrap();
                let mut all = Vec::new();
                loop {
                    let chunk = client.read(f, 37).unwrap();
                    if chunk.is_empty() {
                        break;
                    }
                    all.extend(chunk);
                }
                client.close(f).unwrap();
                finished.fetch_add(1, Ordering::SeqCst);
                all
            })
        })
        .collect();
    let mut reboots = 0;
    while finished.load(Ordering::SeqCst) < 3 {
        s.reboot();
        reboots += 1;
        std::thread::sleep(std::time::Duration::from_micros(200));
        // The next reboot waits for the new incarnation to serve a call:
        // beside CPU hogs, rebooting on a clock alone could come faster
        // than the clients rebuild, and the test would make no progress.
        while s.log().is_empty() && finished.load(Ordering::SeqCst) < 3 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
    let expected: Vec<u8> = (0..WRITES).flat_map(|i| i.to_le_bytes()).collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), expected);
    }
    assert_eq!(s.client.tracked_files(), 0);
    let replays = s.store.replays.load(Ordering::Relaxed);
    assert!(
        replays > 0,
        "no descriptor was rebuilt in {reboots} reboots"
    );
    eprintln!("{reboots} reboots, {replays} descriptors rebuilt");
}
