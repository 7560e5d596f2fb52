//! What the owner and the sink share: the control page's layout, the bytes
//! every page must hold, the error tally, and the kernel's view of a mapping.

use std::time::Duration;

use kintsugi_interfaces::mm::{self, Page};
use kintsugi_interfaces::mm_map::{Mapped, Mapper, PAGE_MEMFD};
pub use kintsugi_runtime::counters::Failures;
use kintsugi_runtime::Runtime;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use crate::Config;

/// The control page's words (byte offsets; u32 unless noted). The owner
/// writes everything else before it stores `MAGIC`, and a round's alias ids
/// and count before it stores the round in `PUBLISHED`.
pub const AT_MAGIC: usize = 0;
pub const MAGIC: u32 = 0x6b6d_6d31;
/// u64: the sink's alias of the keeper.
pub const AT_KEEPER: usize = 8;
/// The last round the owner published, and how many aliases it has.
pub const AT_PUBLISHED: usize = 16;
pub const AT_COUNT: usize = 20;
/// The last round whose aliases the sink has verified.
pub const AT_ACKED: usize = 24;
/// The last round whose grants the owner has revoked (every revoke returned).
pub const AT_REVOKED: usize = 28;
/// The last round whose unmapping the sink has checked.
pub const AT_CHECKED: usize = 32;
/// Set (to 1) once the owner has started over with a new control page and
/// keeper: a sink that still sees this page looks for them.
pub const AT_MOVED: usize = 36;
/// u64 each: the round's alias ids, in grant order.
pub const AT_ALIASES: usize = 64;
pub const MAX_GRANTS: usize = 64;
/// The keeper's bytes are those of this round.
pub const KEEPER_ROUND: u64 = u64::MAX;

/// How long a side sleeps between looks at a control word.
pub const POLL: Duration = Duration::from_micros(100);
/// How long the owner waits for the sink to answer a round before it
/// counts the round failed.
pub const SINK_PATIENCE: Duration = Duration::from_secs(2);
/// Failed rounds in a row after which the owner starts over with a new
/// control page and keeper (a faulty mm may have lost or garbled the old
/// ones, so that the sink cannot answer).
pub const START_OVER_AFTER: u32 = 3;

/// What every role works with.
pub struct Env<'a> {
    pub rt: &'a Runtime,
    pub client: &'a mm::Client,
    pub mapper: &'a Mapper<'a>,
    pub config: &'a Config,
}

/// The bytes page `index` of `round` holds.
pub fn pattern(seed: u64, round: u64, index: u64, len: usize) -> Vec<u8> {
    let key = seed
        ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ index.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    let mut bytes = vec![0; len];
    StdRng::seed_from_u64(key).fill_bytes(&mut bytes);
    bytes
}

impl Env<'_> {
    /// Publishes a finished round and what `tally` grew by since `seen`
    /// as the counters `ops`, `errors` and `corrupt`.
    pub fn publish(&self, tally: &Failures, seen: &mut [u64; 2], round_done: bool) {
        if let Ok(c) = self.rt.workload_counters() {
            if round_done {
                c.op();
            }
            c.publish(seen, tally);
        }
    }

    /// True once the supervisor asked this component to stop.
    pub fn stopping(&self) -> bool {
        self.rt.stop_requested()
    }

    /// Waits until the control word at `at` reaches `want`; false if told
    /// to stop first. Fails if the page is gone, if the owner moved from it
    /// ([`AT_MOVED`]), or after `patience`.
    pub fn wait_for(
        &self,
        control: Page,
        at: usize,
        want: u32,
        patience: Option<Duration>,
    ) -> anyhow::Result<bool> {
        let started = std::time::Instant::now();
        while self.mapper.load_u32(control, at)? < want {
            if self.stopping() {
                return Ok(false);
            }
            anyhow::ensure!(!self.moved(control), "the owner started over");
            if let Some(p) = patience {
                anyhow::ensure!(
                    started.elapsed() < p,
                    "no answer within {} ms",
                    p.as_millis()
                );
            }
            std::thread::sleep(POLL);
        }
        Ok(true)
    }

    /// Whether the owner started over and left `control` ([`AT_MOVED`]).
    pub fn moved(&self, control: Page) -> bool {
        self.mapper
            .load_u32(control, AT_MOVED)
            .is_ok_and(|m| m != 0)
    }

    /// Waits until `page` is no longer mapped here (an UNMAP upcall), at most
    /// `deadline`; the caller then checks.
    pub fn wait_unmapped(&self, page: Page, deadline: Duration) {
        let started = std::time::Instant::now();
        while self.mapper.is_mapped(page) && started.elapsed() < deadline {
            std::thread::sleep(POLL);
        }
    }

    pub fn store_u64(&self, page: Page, at: usize, v: u64) -> anyhow::Result<()> {
        Ok(self.mapper.write(page, at, &v.to_le_bytes())?)
    }

    pub fn load_u64(&self, page: Page, at: usize) -> anyhow::Result<u64> {
        let mut b = [0; 8];
        self.mapper.read(page, at, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Checks that mapped `page` (of `len` bytes) holds `round`'s page `index`.
    pub fn verify(&self, page: Page, len: usize, round: u64, index: u64) -> anyhow::Result<bool> {
        let mut found = vec![0; len];
        self.mapper.read(page, 0, &mut found)?;
        Ok(found == pattern(self.config.seed, round, index, len))
    }

    /// Checks the keeper through the mapping made at the start; a mismatch
    /// is an error. Returns whether it held its bytes.
    pub fn check_keeper(
        &self,
        keeper: Page,
        len: usize,
        tally: &mut Failures,
    ) -> anyhow::Result<bool> {
        if !self.mapper.is_mapped(keeper) {
            tally.corrupt(format!("the keeper {:#x} is no longer mapped", keeper.0));
            return Ok(false);
        }
        let intact = self.verify(keeper, len, KEEPER_ROUND, 0)?;
        if !intact {
            tally.corrupt(format!(
                "the keeper {:#x} does not hold its bytes",
                keeper.0
            ));
        }
        Ok(intact)
    }

    /// Checks that the mapper and the kernel agree that `mapped` (of page
    /// `page`) is gone after its revoke returned.
    pub fn check_unmapped(
        &self,
        page: Page,
        mapped: Mapped,
        tally: &mut Failures,
    ) -> anyhow::Result<()> {
        if self.mapper.is_mapped(page) {
            tally.corrupt(format!(
                "page {:#x} is still in the mapper after its revoke",
                page.0
            ));
        } else if kernel_maps(mapped)? {
            tally.corrupt(format!(
                "page {:#x}: its memory is still mapped at {:#x}+{} after its revoke",
                page.0, mapped.addr, mapped.len
            ));
        }
        Ok(())
    }
}

/// True if any of the bytes `m` covered is still mapped, as the kernel
/// shows it (`/proc/self/maps`), from an mm page (a memfd named
/// [`PAGE_MEMFD`]).
pub fn kernel_maps(m: Mapped) -> anyhow::Result<bool> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let name = format!("/memfd:{PAGE_MEMFD} ");
    for line in maps.lines() {
        // start-end perms offset dev inode [path]
        let Some((range, _)) = line.split_once(' ') else {
            continue;
        };
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let start = usize::from_str_radix(start, 16)?;
        let end = usize::from_str_radix(end, 16)?;
        if start < m.addr + m.len && m.addr < end && line.contains(&name) {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kintsugi_runtime::abi::shm::Mapping;
    use std::os::fd::AsFd;

    #[test]
    fn patterns_differ_by_seed_round_and_index() {
        let p = pattern(7, 1, 0, 256);
        assert_eq!(p, pattern(7, 1, 0, 256));
        assert_ne!(p, pattern(8, 1, 0, 256));
        assert_ne!(p, pattern(7, 2, 0, 256));
        assert_ne!(p, pattern(7, 1, 1, 256));
    }

    #[test]
    fn the_kernel_shows_a_page_mapping_until_it_is_dropped() {
        let ps = kintsugi_runtime::abi::shm::page_size();
        let fd = rustix::fs::memfd_create(
            PAGE_MEMFD,
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, 2 * ps as u64).unwrap();
        rustix::fs::fcntl_add_seals(&fd, rustix::fs::SealFlags::SHRINK).unwrap();
        let m = Mapping::of_sealed(fd.as_fd(), 2 * ps).unwrap();
        let at = Mapped {
            addr: m.as_ptr() as usize,
            len: m.len(),
        };
        assert!(kernel_maps(at).unwrap());
        drop(m);
        assert!(!kernel_maps(at).unwrap());
    }
}
