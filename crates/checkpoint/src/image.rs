//! A checkpoint held in memory (RTCR's hot storage): the layout of the
//! process's private mappings, the contents of the checkpointed ones, its
//! program break, and every thread's registers. Each checkpoint updates it
//! in place with the pages written since the previous one, so it always
//! holds the latest state whole.

use std::collections::BTreeMap;

use nix::libc::user_regs_struct;
use serde::{Deserialize, Serialize};

use crate::maps::{Mapping, PAGE};

/// One thread's registers at a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadState {
    pub tid: u32,
    /// `user_regs_struct` in its field order (instruction pointer, stack,
    /// general-purpose registers, `fs_base` for thread-local storage).
    pub regs: [u64; 27],
    /// The `xsave` area: x87, SSE, AVX and whatever else the CPU has.
    pub xstate: Vec<u8>,
    /// Where the thread's C library keeps its id, the word the kernel
    /// clears when the thread exits (`clear_child_tid`; 0 if none): a
    /// restore into another process points its thread there and writes
    /// the new id.
    pub tid_address: u64,
    /// The thread's restartable-sequences area, which the kernel keeps
    /// writing (address 0 if none): a restore into another process moves
    /// the registration there.
    pub rseq: Rseq,
}

/// A restartable-sequences registration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rseq {
    pub address: u64,
    pub len: u32,
    pub signature: u32,
}

impl ThreadState {
    pub fn new(tid: u32, regs: &user_regs_struct, xstate: Vec<u8>) -> Self {
        let r = regs;
        Self {
            tid,
            tid_address: 0,
            rseq: Rseq::default(),
            regs: [
                r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx,
                r.rdx, r.rsi, r.rdi, r.orig_rax, r.rip, r.cs, r.eflags, r.rsp, r.ss, r.fs_base,
                r.gs_base, r.ds, r.es, r.fs, r.gs,
            ],
            xstate,
        }
    }

    pub fn user_regs(&self) -> user_regs_struct {
        let a = &self.regs;
        user_regs_struct {
            r15: a[0],
            r14: a[1],
            r13: a[2],
            r12: a[3],
            rbp: a[4],
            rbx: a[5],
            r11: a[6],
            r10: a[7],
            r9: a[8],
            r8: a[9],
            rax: a[10],
            rcx: a[11],
            rdx: a[12],
            rsi: a[13],
            rdi: a[14],
            orig_rax: a[15],
            rip: a[16],
            cs: a[17],
            eflags: a[18],
            rsp: a[19],
            ss: a[20],
            fs_base: a[21],
            gs_base: a[22],
            ds: a[23],
            es: a[24],
            fs: a[25],
            gs: a[26],
        }
    }

    pub fn rip(&self) -> u64 {
        self.regs[16]
    }

    pub fn rsp(&self) -> u64 {
        self.regs[19]
    }

    pub fn fs_base(&self) -> u64 {
        self.regs[21]
    }
}

/// The contents of one checkpointed mapping.
#[derive(Debug, Clone)]
pub struct Area {
    pub map: Mapping,
    /// Its bytes as of the latest checkpoint; a page never populated reads
    /// as zeros (allocated lazily: untouched pages cost no memory here).
    pub data: Vec<u8>,
    /// One bit per page: captured at least once (what an image file
    /// stores; the others are zero).
    pub populated: Vec<u64>,
    /// Registered for write-protection, so that only written pages are
    /// copied; an area the kernel refused is copied whole every time.
    pub tracked: bool,
}

impl Area {
    pub fn new(map: Mapping) -> Self {
        let pages = (map.len() / PAGE) as usize;
        Self {
            data: vec![0; map.len() as usize],
            populated: vec![0; pages.div_ceil(64)],
            map,
            tracked: false,
        }
    }

    pub fn pages(&self) -> usize {
        (self.map.len() / PAGE) as usize
    }

    /// Marks `[start, end)` (absolute addresses, page-aligned) captured.
    pub fn mark(&mut self, start: u64, end: u64) {
        let first = ((start - self.map.start) / PAGE) as usize;
        let last = ((end - self.map.start) / PAGE) as usize;
        for p in first..last {
            self.populated[p / 64] |= 1 << (p % 64);
        }
    }

    pub fn is_populated(&self, page: usize) -> bool {
        self.populated[page / 64] & (1 << (page % 64)) != 0
    }

    /// The runs of populated pages, as absolute `[start, end)` ranges.
    pub fn populated_runs(&self) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut p = 0;
        let n = self.pages();
        while p < n {
            if !self.is_populated(p) {
                p += 1;
                continue;
            }
            let s = p;
            while p < n && self.is_populated(p) {
                p += 1;
            }
            runs.push((
                self.map.start + s as u64 * PAGE,
                self.map.start + p as u64 * PAGE,
            ));
        }
        runs
    }

    /// The bytes of `[start, end)` (absolute addresses).
    pub fn bytes(&self, start: u64, end: u64) -> &[u8] {
        &self.data[(start - self.map.start) as usize..(end - self.map.start) as usize]
    }
}

/// A whole checkpoint.
#[derive(Debug, Clone, Default)]
pub struct Image {
    /// The process checkpointed.
    pub pid: u32,
    /// Its executable (`/proc/<pid>/exe`), for telling a foreign process.
    pub exe: String,
    /// How many checkpoints this image has absorbed.
    pub seq: u64,
    /// Every private mapping (checkpointed or not), in address order.
    pub layout: Vec<Mapping>,
    /// Every shared mapping (channels, the vault's memfds, durable memory),
    /// never copied: a process the image is restored into must have each
    /// where the image's memory expects it.
    pub shared: Vec<Mapping>,
    /// `start_brk` and `brk`.
    pub brk: (u64, u64),
    /// The checkpointed mappings' contents, by start address.
    pub areas: BTreeMap<u64, Area>,
    /// Every thread, leader first.
    pub threads: Vec<ThreadState>,
    /// Named bytes that travel with the image in its file (see
    /// [`crate::file`]); not part of the process.
    pub attachments: BTreeMap<String, Vec<u8>>,
}

impl Image {
    /// Bytes of memory the image holds (populated pages).
    pub fn populated_bytes(&self) -> u64 {
        self.areas
            .values()
            .map(|a| {
                a.populated
                    .iter()
                    .map(|w| w.count_ones() as u64)
                    .sum::<u64>()
                    * PAGE
            })
            .sum()
    }
}
