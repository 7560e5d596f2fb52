//! What a readiness in the supervisor's epoll set is about: each watched
//! descriptor is registered with a typed [`Source`], carried in the epoll
//! token and typed again when it fires.

use std::os::fd::{AsFd, OwnedFd};

use rustix::event::epoll;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// A watched process (pidfd) exited.
    Exit(u32),
    /// SIGINT or SIGTERM arrived (the signal pipe).
    Signal,
    /// A lifeline watcher found an incarnation dead.
    Lifeline,
    /// The watchdog or a checker reported a fault.
    Fault,
    /// Component `idx`'s zygote socket has a message.
    Zygote(usize),
}

impl Source {
    /// The kind in the token's high bits; a pid or an index in the low 32.
    const KIND_SHIFT: u32 = 32;

    fn token(self) -> u64 {
        let (kind, low) = match self {
            Source::Exit(pid) => (0, u64::from(pid)),
            Source::Signal => (1, 0),
            Source::Lifeline => (2, 0),
            Source::Fault => (3, 0),
            Source::Zygote(idx) => (4, idx as u64),
        };
        kind << Self::KIND_SHIFT | low
    }

    /// The source an epoll event is about (`None` for a token no source makes).
    pub(crate) fn of(event: &epoll::Event) -> Option<Source> {
        Self::of_token(event.data.u64())
    }

    fn of_token(token: u64) -> Option<Source> {
        let low = token & u64::from(u32::MAX);
        Some(match token >> Self::KIND_SHIFT {
            0 => Source::Exit(low as u32),
            1 => Source::Signal,
            2 => Source::Lifeline,
            3 => Source::Fault,
            4 => Source::Zygote(low as usize),
            _ => return None,
        })
    }
}

/// Adds `fd` to the supervisor's epoll set; its readiness comes back as `source`.
pub(crate) fn listen(epoll: &OwnedFd, fd: impl AsFd, source: Source) -> rustix::io::Result<()> {
    epoll::add(
        epoll,
        fd,
        epoll::EventData::new_u64(source.token()),
        epoll::EventFlags::IN,
    )
}

#[cfg(test)]
mod tests {
    use super::Source;

    #[test]
    fn every_source_comes_back_from_its_token() {
        let sources = [
            Source::Exit(1),
            Source::Exit(u32::MAX),
            Source::Signal,
            Source::Lifeline,
            Source::Fault,
            Source::Zygote(0),
            Source::Zygote(4095),
        ];
        for s in sources {
            assert_eq!(Source::of_token(s.token()), Some(s), "{s:?}");
        }
        let tokens: std::collections::HashSet<u64> = sources.iter().map(|s| s.token()).collect();
        assert_eq!(tokens.len(), sources.len(), "tokens are distinct");
        assert_eq!(
            Source::of_token(99 << 32),
            None,
            "an unknown kind is no source"
        );
    }
}
