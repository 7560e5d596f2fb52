//! What components print (issue 18): each component's stdout and stderr
//! are pipes that its zygote, and so every incarnation, inherits, and that
//! one relay thread of the supervisor reads. Every line names its
//! component: one that does not already (a panic message, a raw
//! `eprintln!`) is prefixed with `name: `, as the runtime's log lines are,
//! and a JSON object (a report on stdout) gets a `"component"` field first
//! instead, so that it stays JSON. The last lines of each component's
//! stderr stay in the roster, for `kintsugi status`. A component no longer
//! writes to whatever the supervisor's output is: when that goes away (a
//! reader that closed the pipe), its lines are dropped, and it does not
//! die of `EPIPE`. With the supervisor's logs in the journal, each
//! stderr line (a JSON log line then) becomes a journal entry with the
//! component's fields instead (`journald.rs`).

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use rustix::event::epoll;
use rustix::pipe::{pipe_with, PipeFlags};

use crate::journald::{self, Journal};
use crate::roster::Roster;
use crate::turns::Turns;

/// The longest line relayed whole; longer ones are cut there.
const MAX_LINE: usize = 16 * 1024;

/// A component's ends of its output pipes, handed to each of its zygotes.
#[derive(Debug)]
pub(crate) struct Pipes {
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Where the supervisor writes what components print on their stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComponentStdout {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

/// One pipe's read end and the part of a line read so far.
struct Reader {
    component: String,
    stream: Stream,
    fd: OwnedFd,
    partial: Vec<u8>,
}

/// The relay thread, and how to end it.
pub(crate) struct Relay {
    epoll: Arc<OwnedFd>,
    readers: Arc<Mutex<Vec<Reader>>>,
    /// Written to end the thread.
    stop: OwnedFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The token of the stop pipe in the epoll set.
const STOP: u64 = u64::MAX;

impl Relay {
    /// Starts the relay thread, which counts a turn at least every
    /// `turns.timeout()`.
    pub fn start(
        roster: Arc<Roster>,
        journal: Option<Arc<Journal>>,
        stdout_to: ComponentStdout,
        turns: Turns,
    ) -> std::io::Result<Self> {
        let epoll = Arc::new(epoll::create(epoll::CreateFlags::CLOEXEC)?);
        let (stop_r, stop) = pipe_with(PipeFlags::CLOEXEC)?;
        epoll::add(
            &epoll,
            &stop_r,
            epoll::EventData::new_u64(STOP),
            epoll::EventFlags::IN,
        )?;
        let readers: Arc<Mutex<Vec<Reader>>> = Arc::default();
        let thread = {
            let (epoll, readers) = (epoll.clone(), readers.clone());
            std::thread::Builder::new()
                .name("output".into())
                .spawn(move || {
                    let out = Out {
                        roster: &roster,
                        journal: journal.as_deref(),
                        stdout_to,
                    };
                    relay(&epoll, &readers, out, stop_r, turns)
                })?
        };
        Ok(Self {
            epoll,
            readers,
            stop,
            thread: Some(thread),
        })
    }

    /// New pipes for `component`, whose read ends this relay reads.
    pub fn pipes(&self, component: &str) -> std::io::Result<Pipes> {
        Ok(Pipes {
            stdout: self.pipe(component, Stream::Stdout)?,
            stderr: self.pipe(component, Stream::Stderr)?,
        })
    }

    /// One pipe whose read end this relay reads; returns its write end.
    fn pipe(&self, component: &str, stream: Stream) -> std::io::Result<OwnedFd> {
        let (r, w) = pipe_with(PipeFlags::CLOEXEC)?;
        rustix::fs::fcntl_setfl(&r, rustix::fs::OFlags::NONBLOCK)?;
        let mut readers = self.readers.lock().unwrap_or_else(|p| p.into_inner());
        epoll::add(
            &*self.epoll,
            &r,
            epoll::EventData::new_u64(readers.len() as u64),
            epoll::EventFlags::IN,
        )?;
        readers.push(Reader {
            component: component.to_string(),
            stream,
            fd: r,
            partial: Vec::new(),
        });
        Ok(w)
    }

    /// Relays what is left in every pipe and ends the thread: called once
    /// every process that could write is gone.
    pub fn finish(&mut self) {
        let _ = rustix::io::write(&self.stop, b"x");
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Where relayed lines go.
#[derive(Clone, Copy)]
struct Out<'a> {
    /// Keeps each component's last stderr lines.
    roster: &'a Roster,
    /// Takes stderr lines as entries, if the logs go to the journal.
    journal: Option<&'a Journal>,
    stdout_to: ComponentStdout,
}

/// The relay thread: lines as they come, then, once stopped, what is left.
fn relay(
    epoll: &OwnedFd,
    readers: &Mutex<Vec<Reader>>,
    out: Out<'_>,
    _stop: OwnedFd,
    turns: Turns,
) {
    let mut buf = [std::mem::MaybeUninit::<epoll::Event>::uninit(); 16];
    let timeout = turns.timeout();
    loop {
        let waited = epoll::wait(epoll, &mut buf, timeout.as_ref());
        turns.turned();
        let Ok((events, _)) = waited else {
            continue; // EINTR
        };
        let mut readers = readers.lock().unwrap_or_else(|p| p.into_inner());
        let mut stopping = false;
        for e in events.iter() {
            match e.data.u64() {
                STOP => stopping = true,
                i => {
                    if let Some(r) = readers.get_mut(i as usize) {
                        drain(r, out);
                    }
                }
            }
        }
        if stopping {
            for r in readers.iter_mut() {
                drain(r, out);
                if !r.partial.is_empty() {
                    let line = std::mem::take(&mut r.partial);
                    emit(r, &line, out);
                }
            }
            return;
        }
    }
}

/// Reads what `r`'s pipe holds, relaying each whole line.
fn drain(r: &mut Reader, out: Out<'_>) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match rustix::io::read(&r.fd, &mut buf) {
            Ok(0) | Err(_) => return, // end of stream, or nothing more now
            Ok(n) => n,
        };
        r.partial.extend_from_slice(&buf[..n]);
        while let Some(at) = r.partial.iter().position(|&b| b == b'\n') {
            let rest = r.partial.split_off(at + 1);
            let mut line = std::mem::replace(&mut r.partial, rest);
            line.pop();
            emit(r, &line, out);
        }
        if r.partial.len() > MAX_LINE {
            let line = std::mem::take(&mut r.partial);
            emit(r, &line, out);
        }
    }
}

/// Writes one line to the supervisor's own stream (dropped if that is
/// gone) or a stderr line to the journal, and keeps a stderr line in the
/// roster.
fn emit(r: &Reader, line: &[u8], out: Out<'_>) {
    let text = String::from_utf8_lossy(line);
    let text = text.trim_end_matches('\r');
    if let (Some(j), Stream::Stderr) = (out.journal, r.stream) {
        let _ = j.send(&journald::line_entry(&r.component, text));
        if !text.trim().is_empty() {
            out.roster.note_line(&r.component, text);
        }
        return;
    }
    let line = named(&r.component, text);
    let _ = match (r.stream, out.stdout_to) {
        (Stream::Stdout, ComponentStdout::Stdout) => {
            std::io::stdout().lock().write_all(line.as_bytes())
        }
        _ => std::io::stderr().lock().write_all(line.as_bytes()),
    };
    if r.stream == Stream::Stderr && !text.trim().is_empty() {
        out.roster.note_line(&r.component, line.trim_end());
    }
}

/// `text` with its component's name, ending in a newline: a JSON object
/// (a report on stdout, a log line in JSON) gets a `"component"` field
/// first unless it has one, so that it stays JSON; other lines get
/// `name: ` in front unless they start so (the runtime's text log lines).
fn named(component: &str, text: &str) -> String {
    // The runtime's own JSON lines begin so: no need to parse them.
    if text.starts_with("{\"component\":") {
        return format!("{text}\n");
    }
    let object = || match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(fields)) => Some(fields),
        _ => None,
    };
    if let Some(fields) = text.trim_start().starts_with('{').then(object).flatten() {
        if fields.contains_key("component") {
            return format!("{text}\n");
        }
        let rest = text.trim_start().strip_prefix('{').unwrap_or_default();
        let comma = match fields.is_empty() {
            true => "",
            false => ",",
        };
        // Names are [a-z0-9_-] (the system file's rule): no escaping.
        return format!("{{\"component\":\"{component}\"{comma}{rest}\n");
    }
    match text
        .strip_prefix(component)
        .is_some_and(|rest| rest.starts_with(':'))
    {
        true => format!("{text}\n"),
        false => format!("{component}: {text}\n"),
    }
}

/// How many lines of each component's stderr the roster keeps.
pub const TAIL: usize = 20;

/// Each component's last stderr lines.
#[derive(Debug, Default)]
pub(crate) struct Tails(HashMap<String, std::collections::VecDeque<String>>);

impl Tails {
    pub fn push(&mut self, component: &str, line: &str) {
        let tail = self.0.entry(component.to_string()).or_default();
        if tail.len() == TAIL {
            tail.pop_front();
        }
        let mut line = line.to_string();
        if line.len() > 500 {
            let cut = (0..=500)
                .rev()
                .find(|&i| line.is_char_boundary(i))
                .unwrap_or(0);
            line.truncate(cut);
            line.push('…');
        }
        tail.push_back(line);
    }

    pub fn of(&self, component: &str) -> Vec<String> {
        self.0
            .get(component)
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::named;

    #[test]
    fn every_line_names_its_component_and_json_stays_json() {
        assert_eq!(named("fs", "plain"), "fs: plain\n");
        assert_eq!(named("fs", "fs: INFO x"), "fs: INFO x\n");
        assert_eq!(named("fs", "fsx: y"), "fs: fsx: y\n");
        assert_eq!(
            named("fs", r#"{"ops":3}"#),
            "{\"component\":\"fs\",\"ops\":3}\n"
        );
        assert_eq!(named("fs", "{}"), "{\"component\":\"fs\"}\n");
        let kept = r#"{"component":"ramfs","pid":1}"#;
        assert_eq!(named("fs", kept), format!("{kept}\n"));
        // Not an object: a prefix.
        assert_eq!(named("fs", "[1,2]"), "fs: [1,2]\n");
        assert_eq!(named("fs", "{broken"), "fs: {broken\n");
        let v: serde_json::Value =
            serde_json::from_str(&named("w", r#" {"a":{"component":1}}"#)).unwrap();
        assert_eq!(
            (v["component"].as_str(), v["a"]["component"].as_u64()),
            (Some("w"), Some(1))
        );
    }
}
