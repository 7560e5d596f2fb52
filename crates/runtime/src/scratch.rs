//! Per-thread buffers that requests and replies are copied into out of
//! shared memory ([`crate::abi::channel::Edge::copy_request`]), so that a
//! stub decodes private bytes that no peer can change under it (the
//! vm-memory rule: memory a faulty peer may write is read through volatile
//! copies, never through a reference).

use std::cell::RefCell;

thread_local! {
    /// Buffers not in use; nested uses (a server calling another server
    /// while it handles a request) each take their own.
    static FREE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `use_` on `len` private bytes that `fill` has written.
pub(crate) fn with_copy<R>(
    len: usize,
    fill: impl FnOnce(&mut [u8]),
    use_: impl FnOnce(&[u8]) -> R,
) -> R {
    if len == 0 {
        return use_(&[]);
    }
    with_buffer(len, |buf| {
        fill(buf);
        use_(buf)
    })
}

/// Runs `use_` on a private buffer of `len` bytes (their contents are
/// whatever the buffer last held): where a checkpoint-recovered server
/// makes a logged request's reply before it logs it and copies it into
/// the slot (`server.rs`).
pub(crate) fn with_buffer<R>(len: usize, use_: impl FnOnce(&mut [u8]) -> R) -> R {
    let mut buf = FREE.with(|f| f.borrow_mut().pop()).unwrap_or_default();
    if buf.len() < len {
        buf.resize(len, 0);
    }
    let r = use_(&mut buf[..len]);
    FREE.with(|f| f.borrow_mut().push(buf));
    r
}

#[cfg(test)]
mod tests {
    use super::with_copy;

    #[test]
    fn nested_copies_get_their_own_buffers() {
        let outer = with_copy(
            4,
            |b| b.copy_from_slice(b"abcd"),
            |a| {
                let inner = with_copy(2, |b| b.copy_from_slice(b"xy"), |b| b.to_vec());
                (a.to_vec(), inner)
            },
        );
        assert_eq!(outer, (b"abcd".to_vec(), b"xy".to_vec()));
        // A reused, longer buffer is cut to the length asked for.
        assert_eq!(with_copy(1, |b| b[0] = b'z', |b| b.to_vec()), b"z");
    }
}
