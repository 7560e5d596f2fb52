//! Messages with file descriptors attached (SCM_RIGHTS) over Unix seqpacket
//! sockets: how the state vault receives and hands back memfds and sockets.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};

/// Most descriptors one message carries (the kernel's SCM_MAX_FD is 253).
pub const MAX_FDS: usize = 200;
/// Largest message.
pub const MAX_MESSAGE: usize = 128 * 1024;

/// Sends one message with `fds` attached. It allocates nothing (the
/// control buffer is on the stack), so a process that must not allocate
/// may call it: netd's keeper, a child forked from a threaded process.
pub fn send(sock: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(std::io::Error::other(
            "too many descriptors for one message",
        ));
    }
    let n = sendmsg(
        sock,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if n != bytes.len() {
        return Err(std::io::Error::other("short send on a seqpacket socket"));
    }
    Ok(())
}

/// Receives one message; returns its bytes (empty at end of stream) and the
/// descriptors attached to it.
pub fn recv(sock: impl AsFd) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = Vec::new();
    let (n, fds) = recv_into(sock, &mut buf)?;
    buf.truncate(n);
    Ok((buf, fds))
}

/// [`recv`] into `buf`, which is grown to the largest message once and
/// reused (a fresh zeroed 128 KiB per message cost the vault's thread 2 %
/// of the web server's CPU time); returns the message's length. A message
/// larger than [`MAX_MESSAGE`] is consumed and refused whole
/// ([`std::io::ErrorKind::InvalidData`]), never read cut short.
///
/// The buffer is allocated zeroed (`calloc`: pages the kernel maps zeroed
/// when first written), not filled with zeros: filling wrote all 32 pages,
/// 0.1–0.5 ms of a new incarnation's first vault request on the VMs
/// measured (`docs/benchmarks.md`), where a small reply writes one.
pub fn recv_into(sock: impl AsFd, buf: &mut Vec<u8>) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    receive(sock, buf, RecvFlags::CMSG_CLOEXEC)
}

/// [`recv_into`], leaving the message queued (`MSG_PEEK`: the descriptors
/// returned are duplicates of those it carries): a reader that may die
/// before it has made the message's effect last takes it off the queue
/// with [`discard`] only once it has, and a successor reading the same
/// socket finds it. A message too large is refused as by [`recv_into`],
/// and stays queued too.
pub fn peek_into(sock: impl AsFd, buf: &mut Vec<u8>) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    receive(sock, buf, RecvFlags::CMSG_CLOEXEC | RecvFlags::PEEK)
}

/// Takes the next message off the queue unread, closing the descriptors
/// it carries.
pub fn discard(sock: impl AsFd) -> std::io::Result<()> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let _taken = loop {
        match recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC | RecvFlags::TRUNC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r?,
        }
    };
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            // Owned, so closed here.
            fds.for_each(drop);
        }
    }
    Ok(())
}

fn receive(
    sock: impl AsFd,
    buf: &mut Vec<u8>,
    flags: RecvFlags,
) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    if buf.len() < MAX_MESSAGE {
        *buf = vec![0; MAX_MESSAGE];
    }
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match recvmsg(&sock, &mut [IoSliceMut::new(buf)], &mut control, flags) {
            Err(rustix::io::Errno::INTR) => continue,
            r => break r?,
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(it) = m {
            fds.extend(it);
        }
    }
    if msg.flags.contains(ReturnFlags::TRUNC) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a message larger than {MAX_MESSAGE} bytes"),
        ));
    }
    Ok((msg.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
    use std::io::{Read, Seek, Write};

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    #[test]
    fn a_memfd_crosses_a_socket() {
        let (a, b) = seqpacket_pair();
        let memfd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(memfd);
        f.write_all(b"kept").unwrap();
        send(&a, b"hello", &[f.as_fd()]).unwrap();
        let (bytes, fds) = recv(&b).unwrap();
        assert_eq!(bytes, b"hello");
        let mut g = std::fs::File::from(fds.into_iter().next().unwrap());
        g.seek(std::io::SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kept");
    }

    #[test]
    fn a_peeked_message_stays_queued_with_its_descriptor_until_discarded() {
        let (a, b) = seqpacket_pair();
        let memfd = rustix::fs::memfd_create("p", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        send(&a, b"first", &[memfd.as_fd()]).unwrap();
        send(&a, b"second", &[]).unwrap();
        let mut buf = Vec::new();
        for _ in 0..2 {
            let (n, fds) = peek_into(&b, &mut buf).unwrap();
            assert_eq!(&buf[..n], b"first");
            assert_eq!(fds.len(), 1, "a duplicate of its descriptor each time");
        }
        discard(&b).unwrap();
        let (n, fds) = peek_into(&b, &mut buf).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"second"[..], 0));
        discard(&b).unwrap();
        rustix::net::shutdown(&a, rustix::net::Shutdown::Write).unwrap();
        assert_eq!(recv(&b).unwrap().0, b"", "nothing left");
    }

    #[test]
    fn a_message_larger_than_the_limit_is_refused_whole_and_the_next_one_read() {
        let (a, b) = seqpacket_pair();
        rustix::net::sockopt::set_socket_send_buffer_size(&a, 4 * MAX_MESSAGE).unwrap();
        let big = vec![b'x'; MAX_MESSAGE + 1];
        send(&a, &big, &[]).unwrap();
        send(&a, b"next", &[]).unwrap();
        let e = recv(&b).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
        assert_eq!(recv(&b).unwrap().0, b"next");
        let fits = vec![b'y'; MAX_MESSAGE];
        send(&a, &fits, &[]).unwrap();
        assert_eq!(recv(&b).unwrap().0, fits);
    }
}
