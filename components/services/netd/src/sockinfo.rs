//! What the kernel knows about a TCP stream's offsets, for a new incarnation
//! of netd that takes its sockets back from the vault: how many bytes it has
//! taken from the receive queue, and how many the application has written.

use std::os::fd::{AsRawFd, BorrowedFd};

/// `SIOCOUTQ`: bytes in the send queue, sent but unacknowledged or unsent.
const SIOCOUTQ: libc::c_ulong = 0x5411;
/// `TCP_CLOSE_WAIT`, `TCP_LAST_ACK`, `TCP_CLOSING`, `TCP_TIME_WAIT`: the peer's FIN was received (it counts one byte of sequence space).
const FIN_RECEIVED: [u8; 4] = [8, 9, 11, 6];

/// A stream's offsets as the kernel sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offsets {
    /// Bytes read out of the receive queue so far.
    pub consumed: u64,
    /// Bytes the application has written so far.
    pub written: u64,
}

fn tcp_info(fd: BorrowedFd<'_>) -> std::io::Result<libc::tcp_info> {
    // SAFETY: tcp_info is plain old data (all-zero is valid); the kernel
    // writes at most `len` bytes into it and `fd` is a live socket.
    unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let r = libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(info)
    }
}

fn queued(fd: BorrowedFd<'_>, request: libc::c_ulong) -> std::io::Result<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD and SIOCOUTQ write one int through the pointer.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, &mut n as *mut libc::c_int) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as u64)
}

/// `TCP_ESTABLISHED` and `TCP_CLOSE_WAIT`: open both ways, or closed by the
/// peer only (this side has not shut down its writes).
const OPEN_HERE: [u8; 2] = [1, 8];

/// True if this side of the connection is still open.
pub fn established_or_peer_closed(fd: BorrowedFd<'_>) -> bool {
    tcp_info(fd).is_ok_and(|i| OPEN_HERE.contains(&i.tcpi_state))
}

/// The stream's offsets, read until two readings agree (data may arrive or
/// be acknowledged between the calls).
pub fn offsets(fd: BorrowedFd<'_>) -> std::io::Result<Offsets> {
    let mut previous = None;
    loop {
        let info = tcp_info(fd)?;
        let unread = queued(fd, libc::FIONREAD as libc::c_ulong)?;
        let unsent = queued(fd, SIOCOUTQ)?;
        let fin = FIN_RECEIVED.contains(&info.tcpi_state) as u64;
        let now = Offsets {
            consumed: info.tcpi_bytes_received - fin - unread,
            written: info.tcpi_bytes_acked + unsent,
        };
        if previous == Some(now) {
            return Ok(now);
        }
        previous = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn offsets_count_what_was_read_and_written() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(&[7u8; 1000]).unwrap();
        let mut buf = [0u8; 300];
        server.read_exact(&mut buf).unwrap();
        server.write_all(&[1u8; 5000]).unwrap();
        let mut got = vec![0u8; 5000];
        client.read_exact(&mut got).unwrap();
        // Wait until all 1000 bytes have arrived.
        while queued(server.as_fd(), libc::FIONREAD as libc::c_ulong).unwrap() < 700 {
            std::thread::yield_now();
        }
        let o = offsets(server.as_fd()).unwrap();
        assert_eq!(
            o,
            Offsets {
                consumed: 300,
                written: 5000
            }
        );
        client.shutdown(std::net::Shutdown::Write).unwrap();
        while tcp_info(server.as_fd()).unwrap().tcpi_state != 8 {
            std::thread::yield_now();
        }
        assert_eq!(offsets(server.as_fd()).unwrap().consumed, 300);
    }
}
