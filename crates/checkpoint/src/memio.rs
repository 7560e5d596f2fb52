//! Copying runs of pages between a target process and an [`Area`]:
//! `process_vm_readv`/`process_vm_writev` with up to 512 runs per system
//! call, and `/proc/<pid>/mem` for a batch those refuse (a mapping without
//! read permission, or one that changed under a partial transfer).

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;

use nix::sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec};
use nix::unistd::Pid;

use crate::image::Area;
use crate::maps::PAGE;

const BATCH: usize = 512;

/// Bytes above which a read is split between two threads (a thread costs
/// tens of µs to start; 256 pages take about half a millisecond to read).
const SPLIT: usize = 256 * PAGE as usize;

/// Disjoint mutable slices of `data` (which starts at `base`) for sorted,
/// non-overlapping absolute ranges.
fn slices_mut<'a>(data: &'a mut [u8], base: u64, ranges: &[(u64, u64)]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut rest = data;
    let mut at = base;
    for &(s, e) in ranges {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut((s - at) as usize);
        let (mine, tail) = tail.split_at_mut((e - s) as usize);
        out.push(mine);
        rest = tail;
        at = e;
    }
    out
}

fn remote(ranges: &[(u64, u64)]) -> Vec<RemoteIoVec> {
    ranges
        .iter()
        .map(|&(s, e)| RemoteIoVec {
            base: s as usize,
            len: (e - s) as usize,
        })
        .collect()
}

pub(crate) fn total(ranges: &[(u64, u64)]) -> usize {
    ranges.iter().map(|&(s, e)| (e - s) as usize).sum()
}

/// Reads `ranges` (sorted, within the area) of process `pid` into `area`.
pub fn read_into(
    pid: u32,
    mem: &File,
    area: &mut Area,
    ranges: &[(u64, u64)],
) -> std::io::Result<u64> {
    let base = area.map.start;
    read_slices(pid, mem, slices_mut(&mut area.data, base, ranges), ranges)?;
    for &(s, e) in ranges {
        area.mark(s, e);
    }
    Ok(total(ranges) as u64)
}

/// Reads `ranges` (sorted) of process `pid`, one after the other, into
/// the start of `buf` (as long as their total at least).
pub fn read(pid: u32, mem: &File, ranges: &[(u64, u64)], buf: &mut [u8]) -> std::io::Result<()> {
    let mut slices = Vec::with_capacity(ranges.len());
    let mut rest = buf;
    for &(s, e) in ranges {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut((e - s) as usize);
        slices.push(mine);
        rest = tail;
    }
    read_slices(pid, mem, slices, ranges)
}

/// `ranges` (sorted) cut into batches of at most `max` bytes each (a range
/// longer than that is split; `max` a multiple of the page size).
pub fn batches(ranges: &[(u64, u64)], max: u64) -> Vec<Vec<(u64, u64)>> {
    let mut out = vec![Vec::new()];
    let mut room = max;
    for &(mut s, e) in ranges {
        while s < e {
            if room == 0 {
                out.push(Vec::new());
                room = max;
            }
            let end = e.min(s + room);
            out.last_mut().expect("one batch at least").push((s, end));
            room -= end - s;
            s = end;
        }
    }
    out
}

/// Reads range `i` of `ranges` into `slices[i]`: in two threads, half the
/// bytes each, when there are more than [`SPLIT`] of them (the target is
/// held still, so both CPUs are free; each page costs its pinning and copy,
/// which is per page, not per call), else in this one.
fn read_slices(
    pid: u32,
    mem: &File,
    mut slices: Vec<&mut [u8]>,
    ranges: &[(u64, u64)],
) -> std::io::Result<()> {
    let bytes = total(ranges);
    if bytes <= SPLIT || ranges.len() < 2 {
        return read_batches(pid, mem, slices, ranges);
    }
    let mut half = 0;
    let mut sum = 0;
    while half < ranges.len() - 1 && sum < bytes / 2 {
        sum += (ranges[half].1 - ranges[half].0) as usize;
        half += 1;
    }
    let second = slices.split_off(half);
    let (first_ranges, second_ranges) = ranges.split_at(half);
    std::thread::scope(|scope| {
        let helper = scope.spawn(move || read_batches(pid, mem, second, second_ranges));
        let mine = read_batches(pid, mem, slices, first_ranges);
        let theirs = helper
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("a thread reading pages panicked")));
        mine.and(theirs)
    })
}

/// Reads range `i` of `ranges` into `slices[i]`, as many runs per system
/// call as it takes.
fn read_batches(
    pid: u32,
    mem: &File,
    mut slices: Vec<&mut [u8]>,
    ranges: &[(u64, u64)],
) -> std::io::Result<()> {
    for (slices, batch) in slices.chunks_mut(BATCH).zip(ranges.chunks(BATCH)) {
        let want = total(batch);
        let mut local: Vec<IoSliceMut<'_>> =
            slices.iter_mut().map(|s| IoSliceMut::new(s)).collect();
        let got = process_vm_readv(Pid::from_raw(pid as i32), &mut local, &remote(batch));
        if got.ok() != Some(want) {
            drop(local);
            for (s, &(start, _)) in slices.iter_mut().zip(batch) {
                mem.read_exact_at(s, start)?;
            }
        }
    }
    Ok(())
}

/// Writes `ranges` of `area` back into process `pid`.
pub fn write_from(
    pid: u32,
    mem: &File,
    area: &Area,
    ranges: &[(u64, u64)],
) -> std::io::Result<u64> {
    for batch in ranges.chunks(BATCH) {
        let local: Vec<IoSlice<'_>> = batch
            .iter()
            .map(|&(s, e)| IoSlice::new(area.bytes(s, e)))
            .collect();
        let want = total(batch);
        let put = process_vm_writev(Pid::from_raw(pid as i32), &local, &remote(batch));
        if put.ok() != Some(want) {
            for &(s, e) in batch {
                mem.write_all_at(area.bytes(s, e), s)?;
            }
        }
    }
    Ok(total(ranges) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_exactly_the_ranges() {
        let mut data: Vec<u8> = (0..100).collect();
        let s = slices_mut(&mut data, 1000, &[(1000, 1003), (1010, 1012), (1099, 1100)]);
        assert_eq!(s.len(), 3);
        assert_eq!(&*s[0], &[0, 1, 2]);
        assert_eq!(&*s[1], &[10, 11]);
        assert_eq!(&*s[2], &[99]);
    }

    #[test]
    fn batches_hold_at_most_their_size_and_every_byte_once() {
        let ranges = [(0, 3 * 4096), (8 * 4096, 9 * 4096), (10 * 4096, 15 * 4096)];
        let b = batches(&ranges, 4 * 4096);
        assert_eq!(
            b,
            [
                vec![(0, 3 * 4096), (8 * 4096, 9 * 4096)],
                vec![(10 * 4096, 14 * 4096)],
                vec![(14 * 4096, 15 * 4096)],
            ]
        );
        assert_eq!(batches(&[], 4096), [Vec::<(u64, u64)>::new()]);
    }
}
