//! The generated `bench` stubs: an `Obj` rebuilt by replaying `make(tag)` and
//! restoring `pos` with `put`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kintsugi_interfaces::bench::{self, Error};
use kintsugi_runtime::testing::Loopback;
use kintsugi_runtime::{CallError, Caller, Fault};

#[derive(Default)]
struct Bench {
    next: AtomicU64,
    /// (id, tag, pos) of live objects.
    objs: Mutex<Vec<(u64, u64, u64)>>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Bench {
    fn obj<T>(&self, o: u64, f: impl FnOnce(&mut (u64, u64, u64)) -> T) -> Result<T, Error> {
        self.objs
            .lock()
            .unwrap()
            .iter_mut()
            .find(|x| x.0 == o)
            .map(f)
            .ok_or(Error::Failed)
    }
}

impl bench::Server for Bench {
    fn null(&self, _: &Caller) -> Result<(), Error> {
        Ok(())
    }
    fn echo(&self, _: &Caller, data: &[u8], out: &mut [u8]) -> Result<usize, Error> {
        out[..data.len()].copy_from_slice(data);
        Ok(data.len())
    }
    fn grow(&self, _: &Caller, mib: u32) -> Result<u64, Error> {
        Ok(mib as u64)
    }
    fn crash(&self, _: &Caller) -> Result<(), Error> {
        Err(Error::Failed)
    }
    fn make(&self, _: &Caller, tag: u64) -> Result<u64, Error> {
        self.log.lock().unwrap().push(format!("make {tag}"));
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.objs.lock().unwrap().push((id, tag, 0));
        Ok(id)
    }
    fn touch(&self, _: &Caller, o: u64, step: u64) -> Result<u64, Error> {
        self.obj(o, |x| {
            x.2 += step;
            step
        })
    }
    fn put(&self, _: &Caller, o: u64, pos: u64) -> Result<u64, Error> {
        self.log.lock().unwrap().push(format!("put {pos}"));
        self.obj(o, |x| {
            x.2 = pos;
            pos
        })
    }
    fn drop(&self, _: &Caller, o: u64) -> Result<(), Error> {
        let mut objs = self.objs.lock().unwrap();
        objs.retain(|x| x.0 != o);
        Ok(())
    }
}

#[test]
fn bench_objects_survive_reboots() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let fresh = || {
        bench::service(Arc::new(Bench {
            log: log.clone(),
            ..Bench::default()
        }))
    };
    let lb = Loopback::new(fresh());
    let c = bench::Client::from_connection(lb.connection());
    c.null().unwrap();
    assert_eq!(c.echo(b"ping").unwrap(), b"ping");
    assert_eq!(c.grow(4096).unwrap(), 4096);
    assert!(matches!(
        c.grow(4097),
        Err(CallError::Fault(Fault::Refused(_)))
    ));
    let o = c.make(77).unwrap();
    assert_eq!(c.touch(o, 5).unwrap(), 5);
    assert_eq!(c.touch(o, 6).unwrap(), 6);
    log.lock().unwrap().clear();
    lb.reboot(fresh());
    assert_eq!(c.touch(o, 1).unwrap(), 1);
    assert_eq!(*log.lock().unwrap(), ["make 77", "put 11"]);
    c.drop(o).unwrap();
    assert_eq!(c.tracked_objs(), 0);
}
