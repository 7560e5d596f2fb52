//! The wire encoding of invocation arguments and results.
//!
//! Little-endian scalars; `str` and `bytes` as a `u32` length then the bytes;
//! lists as a `u32` count then the elements; records as their fields in order.
//! Writers encode straight into a channel slot's shared memory and readers
//! borrow from it, so a byte payload is copied once on each side at most.

use thiserror::Error;

/// A malformed or oversized encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error, serde::Serialize, serde::Deserialize)]
pub enum WireError {
    #[error("payload does not fit in the channel slot")]
    Overflow,
    #[error("payload ends early")]
    Truncated,
    #[error("string is not valid UTF-8")]
    BadUtf8,
    #[error("{0} trailing bytes after the last argument")]
    Trailing(usize),
    #[error("boolean encoded as {0}")]
    BadBool(u8),
    /// A reply larger than the call allows (`at_most` in the IDL): a
    /// write that claims more bytes than it was given, say.
    #[error("reply of {value} is beyond the call's bound of {bound}")]
    Beyond { value: u64, bound: u64 },
    /// A reply not above what the call allows (`above` in the IDL): a
    /// timer tick that goes back.
    #[error("reply of {value} is not above {bound}")]
    NotAbove { value: u64, bound: u64 },
    /// An error the call does not fail with from a correct server
    /// (`fails` in the IDL): a timer's `Invalid` for a well-formed `wait`.
    #[error("error code {code} is not one a correct server answers this call with")]
    Impossible { code: u32 },
}

/// Encodes values into a borrowed buffer.
pub struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl<'a> Writer<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }

    fn take(&mut self, n: usize) -> Result<&mut [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Overflow)?;
        let out = self.buf.get_mut(self.pos..end).ok_or(WireError::Overflow)?;
        self.pos = end;
        Ok(out)
    }

    pub fn u8(&mut self, v: u8) -> Result<(), WireError> {
        self.take(1)?[0] = v;
        Ok(())
    }
    pub fn bool(&mut self, v: bool) -> Result<(), WireError> {
        self.u8(v as u8)
    }
    pub fn u32(&mut self, v: u32) -> Result<(), WireError> {
        self.take(4)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }
    pub fn u64(&mut self, v: u64) -> Result<(), WireError> {
        self.take(8)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }
    pub fn i64(&mut self, v: i64) -> Result<(), WireError> {
        self.take(8)?.copy_from_slice(&v.to_le_bytes());
        Ok(())
    }
    pub fn bytes(&mut self, v: &[u8]) -> Result<(), WireError> {
        let len = u32::try_from(v.len()).map_err(|_| WireError::Overflow)?;
        self.u32(len)?;
        self.take(v.len())?.copy_from_slice(v);
        Ok(())
    }
    pub fn str(&mut self, v: &str) -> Result<(), WireError> {
        self.bytes(v.as_bytes())
    }

    /// Lets `fill` write a byte string of at most `max` bytes in place (no
    /// intermediate buffer); `fill` returns how many bytes it wrote.
    pub fn bytes_with<E>(
        &mut self,
        max: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<usize, E>,
    ) -> Result<Result<(), E>, WireError> {
        let header = self.pos;
        self.take(4)?;
        let room = (self.buf.len() - self.pos).min(max);
        let area = &mut self.buf[self.pos..self.pos + room];
        match fill(area) {
            Ok(n) => {
                let n = n.min(room);
                self.buf[header..header + 4].copy_from_slice(&(n as u32).to_le_bytes());
                self.pos += n;
                Ok(Ok(()))
            }
            Err(e) => {
                self.pos = header;
                Ok(Err(e))
            }
        }
    }
}

/// The most a reply's encoding may take: a channel slot's response buffer.
pub const MAX_REPLY: usize = crate::abi::channel::MAX_PAYLOAD;

/// What is left of one reply for a list: a server that answers "as many
/// as fit" (a page of names, of pairs) adds items while [`Self::take`]
/// says they fit, and the caller asks again from the last one for the
/// rest. A reply that does not fit is refused whole
/// ([`crate::stub::Refusal::ReplyTooLarge`]), so the server must count.
#[derive(Debug, Clone)]
pub struct ReplyBudget {
    left: usize,
}

impl ReplyBudget {
    /// A reply that is a list: its count taken, `MAX_REPLY` less 4 left.
    pub fn list() -> Self {
        Self {
            left: MAX_REPLY - 4,
        }
    }

    /// Takes an item of `parts`, strings or byte strings of these lengths
    /// (each encoded as its length and its bytes), if it fits.
    pub fn take(&mut self, parts: &[usize]) -> bool {
        let size = parts
            .iter()
            .try_fold(0usize, |n, len| n.checked_add(len.checked_add(4)?));
        match size {
            Some(size) if size <= self.left => {
                self.left -= size;
                true
            }
            _ => false,
        }
    }
}

/// Decodes values from a borrowed buffer.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let out = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn bool(&mut self) -> Result<bool, WireError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(WireError::BadBool(b)),
        }
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn i64(&mut self) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let len = self.u32()? as usize;
        self.take(len)
    }
    pub fn str(&mut self) -> Result<&'a str, WireError> {
        std::str::from_utf8(self.bytes()?).map_err(|_| WireError::BadUtf8)
    }

    /// Checks that every byte was consumed.
    pub fn finish(self) -> Result<(), WireError> {
        match self.buf.len() - self.pos {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_all_kinds() {
        let mut buf = [0u8; 64];
        let mut w = Writer::new(&mut buf);
        w.u32(7).unwrap();
        w.u64(u64::MAX).unwrap();
        w.i64(-3).unwrap();
        w.bool(true).unwrap();
        w.str("héllo").unwrap();
        w.bytes(&[1, 2, 3]).unwrap();
        let n = w.len();
        let mut r = Reader::new(&buf[..n]);
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.i64().unwrap(), -3);
        assert!(r.bool().unwrap());
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.bytes().unwrap(), &[1, 2, 3]);
        r.finish().unwrap();
    }

    #[test]
    fn malformed_input_is_rejected() {
        assert_eq!(Reader::new(&[1, 0]).u32(), Err(WireError::Truncated));
        assert_eq!(
            Reader::new(&[9, 0, 0, 0, 1]).bytes(),
            Err(WireError::Truncated)
        );
        assert_eq!(Reader::new(&[2]).bool(), Err(WireError::BadBool(2)));
        assert_eq!(
            Reader::new(&[1, 0, 0, 0, 0xff]).str(),
            Err(WireError::BadUtf8)
        );
        assert_eq!(Reader::new(&[0]).finish(), Err(WireError::Trailing(1)));
        let mut small = [0u8; 3];
        assert_eq!(Writer::new(&mut small).u32(1), Err(WireError::Overflow));
    }

    #[test]
    fn a_reply_budget_admits_exactly_what_encodes_into_a_reply() {
        let mut budget = ReplyBudget::list();
        let name = "n".repeat(1000);
        let mut names = Vec::new();
        while budget.take(&[name.len()]) {
            names.push(name.clone());
        }
        // One more would not have fitted; these do, to the byte.
        let mut buf = vec![0u8; MAX_REPLY];
        let mut w = Writer::new(&mut buf);
        w.u32(names.len() as u32).unwrap();
        for n in &names {
            w.str(n).unwrap();
        }
        assert!(w.len() + 4 + name.len() > MAX_REPLY, "{}", w.len());
        assert_eq!(w.str(&name), Err(WireError::Overflow));
        assert!(!ReplyBudget::list().take(&[usize::MAX - 2]));
        assert!(!ReplyBudget::list().take(&[MAX_REPLY]));
    }

    #[test]
    fn bytes_with_writes_in_place_and_rolls_back_on_error() {
        let mut buf = [0u8; 16];
        let mut w = Writer::new(&mut buf);
        w.bytes_with(8, |area| {
            area[..3].copy_from_slice(b"abc");
            Ok::<_, ()>(3)
        })
        .unwrap()
        .unwrap();
        assert_eq!(w.len(), 7);
        assert!(w.bytes_with(8, |_| Err::<usize, _>(())).unwrap().is_err());
        assert_eq!(w.len(), 7);
        let mut r = Reader::new(&buf[..7]);
        assert_eq!(r.bytes().unwrap(), b"abc");
    }
}
