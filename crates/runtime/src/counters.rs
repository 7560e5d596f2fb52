//! Named counters a component publishes to the supervisor and to tools that
//! watch a running system (campaigns, benchmarks): a small table in the
//! component's control block, which every incarnation maps, so a counter
//! keeps its value across micro-reboots.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Counters per component.
pub const COUNTERS: usize = 32;
/// Longest counter name, in bytes.
pub const NAME_LEN: usize = 24;

/// A short name in shared memory, claimed once by the first process that
/// needs it (counters here, watched code sections in [`crate::watchdog`]).
#[repr(C)]
pub struct SharedName {
    /// 0 free, 1 being named, 2 named.
    state: AtomicU32,
    len: AtomicU32,
    name: [AtomicU64; NAME_LEN / 8],
}

const FREE: u32 = 0;
const NAMING: u32 = 1;
const NAMED: u32 = 2;

impl SharedName {
    /// The name, once claimed.
    pub fn get(&self) -> Option<String> {
        if self.state.load(Ordering::Acquire) != NAMED {
            return None;
        }
        let mut bytes = [0u8; NAME_LEN];
        for (chunk, word) in bytes.chunks_mut(8).zip(&self.name) {
            chunk.copy_from_slice(&word.load(Ordering::Relaxed).to_le_bytes());
        }
        let len = (self.len.load(Ordering::Relaxed) as usize).min(NAME_LEN);
        Some(String::from_utf8_lossy(&bytes[..len]).into_owned())
    }

    /// Names a free entry `name` and says so; leaves an entry that is named,
    /// or being named, as it is (never waits: a process that died while
    /// naming it must not hold up the next). Names longer than [`NAME_LEN`]
    /// are cut.
    pub fn name_once(&self, name: &str) -> bool {
        let mut cut = name.len().min(NAME_LEN);
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        if self
            .state
            .compare_exchange(FREE, NAMING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.write(&name[..cut]);
        true
    }

    fn write(&self, name: &str) {
        let mut bytes = [0u8; NAME_LEN];
        bytes[..name.len()].copy_from_slice(name.as_bytes());
        for (chunk, word) in bytes.chunks(8).zip(&self.name) {
            word.store(
                u64::from_le_bytes(chunk.try_into().expect("8 bytes")),
                Ordering::Relaxed,
            );
        }
        self.len.store(name.len() as u32, Ordering::Relaxed);
        self.state.store(NAMED, Ordering::Release);
    }

    /// Names a free entry `name` (true), or waits for a concurrent claim to
    /// end and says whether it was for the same name.
    fn claim(&self, name: &str) -> bool {
        if self
            .state
            .compare_exchange(FREE, NAMING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.write(name);
            return true;
        }
        while self.state.load(Ordering::Acquire) == NAMING {
            std::hint::spin_loop();
        }
        self.get().as_deref() == Some(name)
    }
}

/// The entry of `entries` named `name`, claimed now if none is yet; `None`
/// when the name is unusable or every entry is taken.
pub(crate) fn claim_by_name<'a, T>(
    entries: &'a [T],
    name: &str,
    name_of: impl Fn(&T) -> &SharedName,
) -> Option<&'a T> {
    if name.is_empty() || name.len() > NAME_LEN {
        return None;
    }
    if let Some(e) = entries
        .iter()
        .find(|e| name_of(e).get().as_deref() == Some(name))
    {
        return Some(e);
    }
    entries.iter().find(|e| name_of(e).claim(name))
}

/// One counter: a name claimed once, and its value.
#[repr(C)]
pub struct Counter {
    name: SharedName,
    value: AtomicU64,
}

impl Counter {
    pub fn add(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
    }

    pub fn set(&self, v: u64) {
        self.value.store(v, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// The table, embedded in [`crate::abi::boot::ControlBlock`].
#[repr(C)]
pub struct CounterTable {
    counters: [Counter; COUNTERS],
}
// SAFETY: repr(C), atomics only; all-zero is an empty table.
unsafe impl crate::abi::shm::SharedPod for CounterTable {}

/// Why a counter could not be had.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CounterError {
    #[error("counter name `{0}` is empty or longer than {NAME_LEN} bytes")]
    BadName(String),
    #[error("no room for counter `{0}`: a component has at most {COUNTERS}")]
    Full(String),
}

impl CounterTable {
    /// The counter called `name`, claimed now if no incarnation has yet.
    pub fn get(&self, name: &str) -> Result<&Counter, CounterError> {
        if name.is_empty() || name.len() > NAME_LEN {
            return Err(CounterError::BadName(name.to_string()));
        }
        claim_by_name(&self.counters, name, |c| &c.name)
            .ok_or_else(|| CounterError::Full(name.to_string()))
    }

    /// Every named counter and its value, in the order they were claimed.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        self.counters
            .iter()
            .filter_map(|c| c.name.get().map(|n| (n, c.get())))
            .collect()
    }
}

/// The counters a checking workload publishes, which campaigns read:
/// `ops` (operations done), `errors` (calls that failed: errors a client
/// saw) and `corrupt` (answers its checker found wrong).
pub struct WorkloadCounters<'a> {
    ops: &'a Counter,
    errors: &'a Counter,
    corrupt: &'a Counter,
}

impl<'a> WorkloadCounters<'a> {
    pub fn new(table: &'a CounterTable) -> Result<Self, CounterError> {
        Ok(Self {
            ops: table.get("ops")?,
            errors: table.get("errors")?,
            corrupt: table.get("corrupt")?,
        })
    }

    pub fn op(&self) {
        self.ops.add(1);
    }

    /// Publishes what a thread's running totals grew by since `seen`:
    /// `failures` counts every failure, of which `corrupt` were wrong
    /// answers (the rest are errors).
    pub fn catch_up(&self, seen: &mut [u64; 2], failures: u64, corrupt: u64) {
        self.errors
            .add((failures - corrupt).saturating_sub(seen[0]));
        self.corrupt.add(corrupt.saturating_sub(seen[1]));
        *seen = [failures - corrupt, corrupt];
    }

    /// [`catch_up`](Self::catch_up) with a thread's [`Failures`].
    pub fn publish(&self, seen: &mut [u64; 2], failures: &Failures) {
        self.catch_up(seen, failures.errors, failures.corrupt);
    }
}

/// How many failures a workload's report spells out.
const FIRST_ERRORS: usize = 10;

/// What a checking workload saw go wrong: every failure in `errors`, of
/// which `corrupt` were wrong answers (the rest, calls that failed), and
/// the first few spelled out. A workload's report carries it flattened:
/// `"errors"`, `"corrupt"`, `"first_errors"`.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Failures {
    pub errors: u64,
    pub corrupt: u64,
    pub first_errors: Vec<String>,
}

impl Failures {
    /// A call that failed.
    pub fn error(&mut self, what: String) {
        self.errors += 1;
        if self.first_errors.len() < FIRST_ERRORS {
            tracing::error!("{what}");
            self.first_errors.push(what);
        }
    }

    /// A wrong answer the checker found.
    pub fn corrupt(&mut self, what: String) {
        self.corrupt += 1;
        self.error(what);
    }

    /// Adds another thread's failures.
    pub fn merge(&mut self, other: Failures) {
        self.errors += other.errors;
        self.corrupt += other.corrupt;
        let room = FIRST_ERRORS.saturating_sub(self.first_errors.len());
        self.first_errors
            .extend(other.first_errors.into_iter().take(room));
    }

    /// Whether nothing failed; else the count and the first failure, for a
    /// workload to end with after printing its report.
    pub fn check(&self) -> Result<(), WorkloadFailed> {
        match self.errors {
            0 => Ok(()),
            errors => Err(WorkloadFailed {
                errors,
                first: self.first_errors.first().cloned().unwrap_or_default(),
            }),
        }
    }
}

/// A checking workload that saw failures ([`Failures::check`]).
#[derive(Debug, thiserror::Error)]
#[error("{errors} errors; first: {first}")]
pub struct WorkloadFailed {
    pub errors: u64,
    pub first: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::shm::Region;

    #[test]
    fn counters_are_found_by_name_and_keep_their_values() {
        let region = Region::create("counters-test", std::mem::size_of::<CounterTable>()).unwrap();
        let table: &CounterTable = region.at(0);
        table.get("ops").unwrap().add(3);
        table.get("errors").unwrap().add(1);
        table.get("ops").unwrap().add(4);
        assert_eq!(
            table.snapshot(),
            vec![("ops".to_string(), 7), ("errors".to_string(), 1)]
        );
        assert_eq!(
            table.get("").err(),
            Some(CounterError::BadName(String::new()))
        );
        for i in 0..COUNTERS - 2 {
            table.get(&format!("c{i}")).unwrap();
        }
        assert!(matches!(
            table.get("one-too-many"),
            Err(CounterError::Full(_))
        ));
    }

    #[test]
    fn failures_count_wrong_answers_among_errors_and_keep_the_first_ten() {
        let mut a = Failures::default();
        assert!(a.check().is_ok());
        a.error("call 1 failed".into());
        a.corrupt("answer 2 wrong".into());
        let mut b = Failures::default();
        for i in 0..12 {
            b.error(format!("b{i}"));
        }
        a.merge(b);
        assert_eq!((a.errors, a.corrupt), (14, 1));
        assert_eq!(a.first_errors.len(), 10);
        assert_eq!(
            a.first_errors[..3],
            ["call 1 failed", "answer 2 wrong", "b0"]
        );
        let failed = a.check().unwrap_err();
        assert_eq!(failed.to_string(), "14 errors; first: call 1 failed");
        let json = serde_json::to_value(&a).unwrap();
        assert_eq!(
            (json["errors"].as_u64(), json["corrupt"].as_u64()),
            (Some(14), Some(1))
        );
    }

    #[test]
    fn workload_counters_publish_growth_once() {
        let region = Region::create("counters-test", std::mem::size_of::<CounterTable>()).unwrap();
        let table: &CounterTable = region.at(0);
        let w = WorkloadCounters::new(table).unwrap();
        let mut seen = [0; 2];
        w.op();
        w.catch_up(&mut seen, 3, 1);
        w.catch_up(&mut seen, 3, 1);
        w.catch_up(&mut seen, 5, 2);
        assert_eq!(
            table.snapshot(),
            vec![
                ("ops".into(), 1),
                ("errors".into(), 3),
                ("corrupt".into(), 2)
            ]
        );
    }
}
