//! The protocol between the supervisor and a component's pristine image
//! (its zygote), on their socket: one command, one reply, 12 bytes each.

/// What the supervisor asks of the pristine image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Fork a warm standby that will use lifeline `bank` (0 or 1);
    /// `generation` numbers the request, and comes back in the reply.
    Fork { generation: u32, bank: u8 },
}

/// The pristine image's answer to [`Command::Fork`]: the standby's pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forked {
    pub generation: u32,
    pub pid: u32,
}

const FORK: u32 = 1;
const FORKED: u32 = 2;

fn words(b: &[u8]) -> Option<[u32; 3]> {
    let b: &[u8; 12] = b.try_into().ok()?;
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Some([w(0), w(4), w(8)])
}

fn bytes(words: [u32; 3]) -> [u8; 12] {
    let mut b = [0u8; 12];
    for (chunk, w) in b.chunks_mut(4).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    b
}

impl Command {
    pub fn encode(self) -> [u8; 12] {
        match self {
            Command::Fork { generation, bank } => bytes([FORK, generation, u32::from(bank)]),
        }
    }

    /// `None` for anything but a well-formed command.
    pub fn decode(b: &[u8]) -> Option<Command> {
        match words(b)? {
            [FORK, generation, bank @ (0 | 1)] => Some(Command::Fork {
                generation,
                bank: bank as u8,
            }),
            _ => None,
        }
    }
}

impl Forked {
    pub fn encode(self) -> [u8; 12] {
        bytes([FORKED, self.generation, self.pid])
    }

    pub fn decode(b: &[u8]) -> Option<Forked> {
        match words(b)? {
            [FORKED, generation, pid] if pid != 0 => Some(Forked { generation, pid }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_malformed_ones_are_refused() {
        for bank in [0, 1] {
            let c = Command::Fork {
                generation: 7,
                bank,
            };
            assert_eq!(Command::decode(&c.encode()), Some(c));
        }
        let f = Forked {
            generation: 9,
            pid: 4242,
        };
        assert_eq!(Forked::decode(&f.encode()), Some(f));
        assert_eq!(Command::decode(&f.encode()), None, "a reply is no command");
        assert_eq!(
            Forked::decode(
                &Command::Fork {
                    generation: 1,
                    bank: 0
                }
                .encode()
            ),
            None
        );
        assert_eq!(Command::decode(&bytes([FORK, 1, 2])), None, "bank 2");
        assert_eq!(Command::decode(&[1, 0, 0]), None, "short");
        assert_eq!(Forked::decode(&bytes([FORKED, 1, 0])), None, "pid 0");
    }
}
