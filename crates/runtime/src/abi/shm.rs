//! Shared memory regions: memfd-backed mappings shared between processes.
//!
//! The supervisor creates every region (a memfd), hands the descriptor to the
//! components it wires together, and each side maps it `MAP_SHARED`. Nothing
//! is ever named in `/dev/shm`, so nothing is left behind when the processes
//! are gone. This module holds the unsafe code that views a region's bytes
//! as typed, atomics-only headers.
//!
//! A [`Region`] maps its whole memfd; [`Region::map_range`] maps a part of
//! it a second time, at its own address (a client's view of the pages a
//! server granted it).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

/// A shared mapping of (part of) a memfd, unmapped on drop.
pub struct Mapping {
    map: MmapRaw,
}

/// A mapped memfd: its whole [`Mapping`] (through `Deref`) and its descriptor.
pub struct Region {
    map: Mapping,
    file: File,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len()).finish()
    }
}

/// Marker for types that may be viewed in shared memory: `repr(C)`, made
/// only of atomics (or plain integers never written after creation), valid
/// for every bit pattern including all zeroes.
///
/// # Safety
/// Implementors must satisfy the above.
pub unsafe trait SharedPod: Sync {}

// SAFETY: an atomic integer has its integer's layout, every bit pattern is a
// valid value, and it is only ever changed atomically.
unsafe impl SharedPod for AtomicU32 {}
// SAFETY: as above.
unsafe impl SharedPod for AtomicU64 {}

impl Region {
    /// Creates a zero-filled memfd region of `len` bytes (rounded up to a page).
    pub fn create(name: &str, len: usize) -> std::io::Result<Self> {
        let len = len.next_multiple_of(page_size());
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // The size is fixed for life: a peer can never shrink it under a mapping.
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        Self::map(File::from(fd))
    }

    /// Maps an inherited region descriptor.
    ///
    /// # Safety
    /// `fd` must be an open descriptor that the caller owns from now on.
    pub unsafe fn from_raw_fd(fd: RawFd) -> std::io::Result<Self> {
        // SAFETY: ownership of `fd` is transferred to us by the caller's contract.
        let file = unsafe { File::from_raw_fd(fd) };
        Self::map(file)
    }

    fn map(file: File) -> std::io::Result<Self> {
        let map = Mapping {
            map: MmapOptions::new().map_raw(&file)?,
        };
        Ok(Self { map, file })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// A duplicate of the region's descriptor (for handing to a child).
    pub fn dup_fd(&self) -> std::io::Result<OwnedFd> {
        self.file.as_fd().try_clone_to_owned()
    }

    /// A second, separate mapping of the bytes `offset..offset+len` (for
    /// example the pages of a server's pool granted to a client). `offset`
    /// must be a multiple of the page size.
    pub fn map_range(&self, offset: usize, len: usize) -> std::io::Result<Mapping> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        if !offset.is_multiple_of(page_size()) {
            return Err(invalid(format!("offset {offset} is not page-aligned")));
        }
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(invalid(format!(
                "range {offset}+{len} is empty or outside the region's {} bytes",
                self.len()
            )));
        }
        let map = MmapOptions::new()
            .offset(offset as u64)
            .len(len)
            .map_raw(&self.file)?;
        Ok(Mapping { map })
    }
}

impl Mapping {
    /// Maps the first `len` bytes of the memfd `fd`, which another process
    /// made and sent (a page an mm client borrowed): only if it is sealed
    /// against shrinking and holds `len` bytes, so that no holder can
    /// shrink it under this mapping and no access through it can fault.
    pub fn of_sealed(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<Mapping> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        let seals = rustix::fs::fcntl_get_seals(fd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(invalid("the memfd is not sealed against shrinking".into()));
        }
        let size = rustix::fs::fstat(fd)?.st_size;
        if len == 0 || !u64::try_from(size).is_ok_and(|size| size >= len as u64) {
            return Err(invalid(format!("{len} bytes asked of a memfd of {size}")));
        }
        let map = MmapOptions::new().len(len).map_raw(fd.as_raw_fd())?;
        Ok(Mapping { map })
    }
}

impl std::ops::Deref for Region {
    type Target = Mapping;

    fn deref(&self) -> &Mapping {
        &self.map
    }
}

impl Mapping {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte of the mapping; valid as long as `self`, and shared
    /// with every other process that maps these pages.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// A typed view of the mapping at `offset`.
    pub fn at<T: SharedPod>(&self, offset: usize) -> &T {
        assert!(
            offset.is_multiple_of(std::mem::align_of::<T>()),
            "misaligned shared view"
        );
        assert!(
            offset + std::mem::size_of::<T>() <= self.len(),
            "shared view out of bounds"
        );
        // SAFETY: the range is inside the mapping (checked above) and aligned; the
        // mapping lives as long as `self`; `T: SharedPod` is valid for any bytes and
        // only mutated through atomics, so shared references from several processes
        // are sound.
        unsafe { &*(self.map.as_ptr().add(offset) as *const T) }
    }

    /// The bytes at `offset..offset+len`, as atomics (safe to share).
    pub fn bytes(&self, offset: usize, len: usize) -> &[AtomicU8] {
        assert!(offset + len <= self.len(), "shared bytes out of bounds");
        // SAFETY: in bounds; AtomicU8 has the layout of u8 and every value is valid.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(offset) as *const AtomicU8, len) }
    }

    /// The bytes at `offset..offset+len` as a plain slice.
    ///
    /// # Safety
    /// The caller must own this range under the channel protocol: no other
    /// process or thread writes it while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len(), "shared bytes out of bounds");
        // SAFETY: in bounds; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(offset), len) }
    }
}

impl Mapping {
    /// Copies `dst.len()` bytes at `offset` out of the mapping with volatile
    /// reads. Bytes that a peer process may be writing (a faulty peer, out
    /// of turn) are read this way, never through a Rust reference: what it
    /// writes meanwhile lands as garbage in `dst` (which the stubs then
    /// refuse or check), not as undefined behaviour in this process.
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset + dst.len() <= self.len(),
            "shared bytes out of bounds"
        );
        let src = self.as_ptr().wrapping_add(offset);
        let head = src.align_offset(8).min(dst.len());
        let words = (dst.len() - head) / 8;
        for (i, b) in dst[..head].iter_mut().enumerate() {
            // SAFETY: in bounds (asserted); a byte read needs no alignment.
            *b = unsafe { std::ptr::read_volatile(src.add(i)) };
        }
        for w in 0..words {
            let at = head + w * 8;
            // SAFETY: in bounds (asserted), and `src + head` is 8-aligned.
            let word = unsafe { std::ptr::read_volatile(src.add(at) as *const u64) };
            dst[at..at + 8].copy_from_slice(&word.to_ne_bytes());
        }
        let tail = head + words * 8;
        for (i, b) in dst[tail..].iter_mut().enumerate() {
            // SAFETY: in bounds (asserted).
            *b = unsafe { std::ptr::read_volatile(src.add(tail + i)) };
        }
    }

    /// Copies `src` into the mapping at `offset` with volatile writes: for
    /// bytes a peer may read at any time (a request log that the next
    /// incarnation replays), written without a Rust reference to them.
    pub fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(
            offset + src.len() <= self.len(),
            "shared bytes out of bounds"
        );
        let dst = self.as_ptr().wrapping_add(offset);
        let head = dst.align_offset(8).min(src.len());
        let words = (src.len() - head) / 8;
        for (i, b) in src[..head].iter().enumerate() {
            // SAFETY: in bounds (asserted); a byte write needs no alignment.
            unsafe { std::ptr::write_volatile(dst.add(i), *b) };
        }
        for w in 0..words {
            let at = head + w * 8;
            let word = u64::from_ne_bytes(src[at..at + 8].try_into().expect("8 bytes"));
            // SAFETY: in bounds (asserted), and `dst + head` is 8-aligned.
            unsafe { std::ptr::write_volatile(dst.add(at) as *mut u64, word) };
        }
        let tail = head + words * 8;
        for (i, b) in src[tail..].iter().enumerate() {
            // SAFETY: in bounds (asserted).
            unsafe { std::ptr::write_volatile(dst.add(tail + i), *b) };
        }
    }
}

impl Mapping {
    /// Sends `head` and then the mapping's bytes `offset..offset+len` on the
    /// socket `fd` in one `sendmsg` (`MSG_DONTWAIT | MSG_NOSIGNAL`); what
    /// the kernel took. The kernel copies the mapped bytes
    /// itself: they are never seen through a Rust reference, so a peer
    /// writing them meanwhile puts garbage on the wire, nothing worse.
    /// Never blocks: a caller that holds the mapping alive (under a lock
    /// its unmapping waits for) waits for the socket elsewhere.
    pub fn send_after(
        &self,
        fd: BorrowedFd<'_>,
        head: &[u8],
        offset: usize,
        len: usize,
    ) -> std::io::Result<usize> {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len()),
            "shared bytes out of bounds"
        );
        let iov = [
            libc::iovec {
                iov_base: head.as_ptr() as *mut libc::c_void,
                iov_len: head.len(),
            },
            libc::iovec {
                iov_base: self.as_ptr().wrapping_add(offset) as *mut libc::c_void,
                iov_len: len,
            },
        ];
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = iov.len();
        let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        // SAFETY: both iovecs lie in live memory for the call (`head` is
        // borrowed; the mapped range is in bounds, asserted, and mapped as
        // long as `self`); the kernel only reads them.
        let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, flags) };
        match n {
            n if n >= 0 => Ok(n as usize),
            _ => Err(std::io::Error::last_os_error()),
        }
    }
}

pub fn page_size() -> usize {
    rustix::param::page_size()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// A memfd of `len` bytes, with `seals`.
    fn memfd(len: u64, seals: SealFlags) -> OwnedFd {
        let fd =
            rustix::fs::memfd_create("sealed", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        fd
    }

    #[test]
    fn only_a_memfd_sealed_against_shrinking_and_long_enough_is_mapped() {
        let ps = page_size();
        let unsealed = memfd(2 * ps as u64, SealFlags::GROW);
        let e = Mapping::of_sealed(unsealed.as_fd(), ps).err().unwrap();
        assert!(e.to_string().contains("not sealed"), "{e}");
        let short = memfd(ps as u64, SealFlags::SHRINK);
        let e = Mapping::of_sealed(short.as_fd(), 2 * ps).err().unwrap();
        assert!(e.to_string().contains("of a memfd of"), "{e}");
        assert!(Mapping::of_sealed(short.as_fd(), 0).is_err());
        let m = Mapping::of_sealed(short.as_fd(), ps).unwrap();
        m.copy_in(ps - 2, b"ok");
        let mut back = [0; 2];
        m.copy_out(ps - 2, &mut back);
        assert_eq!(&back, b"ok");
        // Shrinking it under the mapping is refused by the kernel.
        assert!(rustix::fs::ftruncate(&short, 0).is_err());
    }

    #[test]
    fn copy_out_reads_every_byte_at_any_alignment_and_length() {
        let r = Region::create("copy-out", 256).unwrap();
        // SAFETY: this test is the region's only user.
        let bytes = unsafe { r.bytes_mut(0, 256) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        for offset in 0..17 {
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 100] {
                let mut dst = vec![0u8; len];
                r.copy_out(offset, &mut dst);
                let want: Vec<u8> = (offset..offset + len).map(|i| (i * 7 + 3) as u8).collect();
                assert_eq!(dst, want, "offset {offset}, len {len}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn copy_out_past_the_end_panics() {
        let r = Region::create("copy-out-end", 64).unwrap();
        let len = r.len();
        r.copy_out(len - 4, &mut [0u8; 8]);
    }

    #[test]
    fn send_after_puts_the_head_then_the_mapped_bytes_on_the_socket() {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        let r = Region::create("send-after", 3 * page_size()).unwrap();
        let data: Vec<u8> = (0..r.len()).map(|i| (i * 13 + 5) as u8).collect();
        r.copy_in(0, &data);
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let (offset, len) = (page_size() - 3, page_size() + 10);
        let n = r.send_after(a.as_fd(), b"head:", offset, len).unwrap();
        assert_eq!(n, 5 + len);
        let mut got = vec![0u8; n];
        let mut at = 0;
        while at < n {
            at += rustix::io::read(&b, &mut got[at..]).unwrap();
        }
        assert_eq!(&got[..5], b"head:");
        assert!(got[5..] == data[offset..offset + len], "the mapped bytes");
        // A full socket: `WouldBlock`, never a wait.
        let err = loop {
            match r.send_after(a.as_fd(), &[], 0, r.len()) {
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn send_after_past_the_end_panics() {
        let r = Region::create("send-after-end", 64).unwrap();
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let _ = r.send_after(a.as_fd(), &[], r.len() - 4, 8);
    }

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let a = Region::create("test", 100).unwrap();
        assert_eq!(a.len(), page_size());
        let fd = a.dup_fd().unwrap();
        use std::os::fd::IntoRawFd;
        // SAFETY: we own the duplicated descriptor.
        let b = unsafe { Region::from_raw_fd(fd.into_raw_fd()) }.unwrap();
        a.at::<AtomicU64>(64).store(0xfeed, Ordering::SeqCst);
        assert_eq!(b.at::<AtomicU64>(64).load(Ordering::SeqCst), 0xfeed);
        assert!(
            rustix::fs::ftruncate(a.fd(), 0).is_err(),
            "sealed against shrinking"
        );
    }

    #[test]
    fn a_range_mapped_apart_shares_the_regions_pages() {
        let page = page_size();
        let region = Region::create("test", 4 * page).unwrap();
        region
            .at::<AtomicU64>(2 * page + 8)
            .store(7, Ordering::SeqCst);
        let range = region.map_range(2 * page, page).unwrap();
        assert_eq!(range.len(), page);
        assert_ne!(range.as_ptr(), region.as_ptr().wrapping_add(2 * page));
        assert_eq!(range.at::<AtomicU64>(8).load(Ordering::SeqCst), 7);
        range.bytes(100, 1)[0].store(0xab, Ordering::SeqCst);
        assert_eq!(
            region.bytes(2 * page + 100, 1)[0].load(Ordering::SeqCst),
            0xab
        );

        assert!(region.map_range(1, page).is_err(), "unaligned offset");
        assert!(
            region.map_range(3 * page, 2 * page).is_err(),
            "past the end"
        );
        assert!(region.map_range(0, 0).is_err(), "empty");
        assert!(
            region.map_range(usize::MAX & !(page - 1), page).is_err(),
            "overflow"
        );
    }
}
