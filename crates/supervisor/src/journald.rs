//! Entries for systemd's journal in its native protocol
//! (systemd.io/JOURNAL_NATIVE_PROTOCOL): one datagram per entry to
//! `/run/systemd/journal/socket`, each field `NAME=value\n`, or, for a
//! value holding a newline, `NAME\n`, its length as a little-endian u64,
//! the value and `\n`.
//!
//! The supervisor's own `tracing` lines go to the journal through
//! `tracing-journald`; this module carries what that layer cannot: lines
//! relayed from components (whose fields are known only when a line is
//! read: `COMPONENT`, `COMPONENT_PID`, `EPOCH`, and each field of the
//! component's own JSON line) and the supervisor's events with their own
//! fields (`EVENT=rebooted`, `TOOK_US=…`). An entry is at most
//! [`MAX_ENTRY`] bytes (relayed lines are cut before that), so no entry
//! needs the protocol's memfd form.

use std::io;
use std::os::unix::net::UnixDatagram;

/// Where journald listens for native entries.
pub const SOCKET: &str = "/run/systemd/journal/socket";

/// The largest entry sent; a value that would pass it is cut.
pub const MAX_ENTRY: usize = 48 * 1024;

/// syslog priorities, as journald's `PRIORITY` field holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    Error = 3,
    Warning = 4,
    Notice = 5,
    Info = 6,
    Debug = 7,
}

impl Priority {
    /// The priority of a `tracing` level's name (`"WARN"`, `"info"`, …),
    /// as `tracing-journald` maps the supervisor's own levels (`INFO` a
    /// notice, `DEBUG` informational); unknown names are notices.
    pub fn of_level(level: &str) -> Self {
        match level.to_ascii_uppercase().as_str() {
            "ERROR" => Self::Error,
            "WARN" | "WARNING" => Self::Warning,
            "DEBUG" => Self::Info,
            "TRACE" => Self::Debug,
            _ => Self::Notice,
        }
    }
}

/// One journal entry being built.
#[derive(Debug, Clone)]
pub struct Entry {
    buf: Vec<u8>,
}

impl Entry {
    /// An entry with its `PRIORITY`, `MESSAGE` and `SYSLOG_IDENTIFIER`
    /// (`kintsugi`: every entry of a system, the supervisor's and its
    /// components', is found with `journalctl -t kintsugi`).
    pub fn new(priority: Priority, message: &str) -> Self {
        let mut entry = Self { buf: Vec::new() };
        entry.field("PRIORITY", &(priority as u8).to_string());
        entry.field("SYSLOG_IDENTIFIER", "kintsugi");
        entry.field("MESSAGE", message);
        entry
    }

    /// Adds a field; `name` is made a valid journal field name (see
    /// [`field_name`]); a value that would make the entry too large is cut.
    pub fn field(&mut self, name: &str, value: &str) -> &mut Self {
        let name = field_name(name);
        let room = MAX_ENTRY.saturating_sub(self.buf.len() + name.len() + 10);
        let mut value = value;
        if value.len() > room {
            let cut = (0..=room)
                .rev()
                .find(|&i| value.is_char_boundary(i))
                .unwrap_or(0);
            value = &value[..cut];
        }
        self.buf.extend_from_slice(name.as_bytes());
        if value.contains('\n') {
            self.buf.push(b'\n');
            self.buf
                .extend_from_slice(&(value.len() as u64).to_le_bytes());
        } else {
            self.buf.push(b'=');
        }
        self.buf.extend_from_slice(value.as_bytes());
        self.buf.push(b'\n');
        self
    }

    /// Adds every field of a JSON object, nested objects' fields joined to
    /// their parent's name by `_` (`{"fields":{"took_us":5}}` gives
    /// `FIELDS_TOOK_US=5`, unless `flatten` names `fields` as a level to
    /// pass through); strings as they are, other values as JSON.
    pub fn json_fields(
        &mut self,
        prefix: &str,
        object: &serde_json::Map<String, serde_json::Value>,
        flatten: &[&str],
    ) -> &mut Self {
        for (key, value) in object {
            let name = match (prefix.is_empty(), flatten.contains(&key.as_str())) {
                (_, true) => prefix.to_string(),
                (true, false) => key.clone(),
                (false, false) => format!("{prefix}_{key}"),
            };
            match value {
                serde_json::Value::Object(inner) => {
                    self.json_fields(&name, inner, flatten);
                }
                serde_json::Value::String(s) => {
                    self.field(&name, s);
                }
                other => {
                    self.field(&name, &other.to_string());
                }
            }
        }
        self
    }

    /// The datagram.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// The entry for one of the supervisor's events: its text as `MESSAGE`,
/// `EVENT` its kind, and each of its fields (`COMPONENT`, `COMPONENT_PID`,
/// `EPOCH`, `TOOK_US`, …); a give-up is an error, a death, a fault found
/// or a backoff a warning, the rest notices (as `INFO` log lines are).
pub fn event_entry(event: &crate::Event) -> Entry {
    use crate::Event as E;
    let priority = match event {
        E::GaveUp { .. } => Priority::Error,
        E::Crashed {
            exit: crate::Exit::Code(0),
            ..
        } => Priority::Notice,
        E::Crashed { .. } | E::FaultReported { .. } | E::BackingOff { .. } => Priority::Warning,
        _ => Priority::Notice,
    };
    let mut entry = Entry::new(priority, &event.to_string());
    if let Ok(serde_json::Value::Object(mut fields)) = serde_json::to_value(event) {
        rename(&mut fields, "pid", "component_pid");
        entry.json_fields("", &fields, &[]);
    }
    entry
}

/// The entry for one line a component wrote to its stderr: its JSON log
/// line's fields (`COMPONENT`, `COMPONENT_PID`, `EPOCH`, the event's own
/// fields, `PRIORITY` from its level), or, for a line that is not one (a
/// panic message: a component's logs are JSON lines in journal mode), the
/// line as an error of `component`.
pub fn line_entry(component: &str, line: &str) -> Entry {
    let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_str(line) else {
        let mut entry = Entry::new(Priority::Error, line);
        entry.field("COMPONENT", component);
        return entry;
    };
    let level = match fields.remove("level") {
        Some(serde_json::Value::String(level)) => Priority::of_level(&level),
        _ => Priority::Notice,
    };
    let message = match fields.get_mut("fields") {
        Some(serde_json::Value::Object(inner)) => match inner.remove("message") {
            Some(serde_json::Value::String(m)) => m,
            Some(other) => other.to_string(),
            None => String::new(),
        },
        _ => String::new(),
    };
    rename(&mut fields, "pid", "component_pid");
    fields
        .entry("component")
        .or_insert_with(|| component.into());
    let mut entry = Entry::new(level, &message);
    entry.json_fields("", &fields, &["fields"]);
    entry
}

/// Renames a field of a JSON object, if it has it.
fn rename(object: &mut serde_json::Map<String, serde_json::Value>, from: &str, to: &str) {
    if let Some(v) = object.remove(from) {
        object.insert(to.into(), v);
    }
}

/// A valid journal field name for `name`: upper case letters, digits and
/// `_`, not starting with `_` (those are journald's trusted fields) or a
/// digit, at most 64 bytes; what does not fit is replaced or prefixed
/// with `F_`.
pub fn field_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' => c.to_ascii_uppercase(),
            'A'..='Z' | '0'..='9' | '_' => c,
            _ => '_',
        })
        .collect();
    if out.is_empty() || out.starts_with('_') || out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert_str(0, "F_");
    }
    out.truncate(64);
    out
}

/// A connection to journald.
#[derive(Debug)]
pub struct Journal {
    socket: UnixDatagram,
}

impl Journal {
    /// Connects to journald's socket; fails if none listens there.
    pub fn connect() -> io::Result<Self> {
        let socket = UnixDatagram::unbound()?;
        socket.connect(SOCKET)?;
        Ok(Self { socket })
    }

    /// Sends one entry; an entry journald cannot take now is dropped (a
    /// log must not stop the system) and the error returned.
    pub fn send(&self, entry: &Entry) -> io::Result<()> {
        self.socket.send(entry.bytes()).map(|_| ())
    }
}

/// Whether `JOURNAL_STREAM` (which systemd sets to the `device:inode` of
/// the stream it connected a service's stdout or stderr to) names this
/// process's stderr: then its log lines are to be journal entries
/// (systemd.exec(5) asks programs to check this way).
pub fn stderr_is_journal() -> bool {
    let Ok(stream) = std::env::var("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.split_once(':') else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    rustix::fs::fstat(std::io::stderr()).is_ok_and(|st| st.st_dev == dev && st.st_ino == ino)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of a datagram, decoded as journald would.
    fn decode(mut bytes: &[u8]) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let nl = bytes.iter().position(|&b| b == b'\n').unwrap();
            let line = &bytes[..nl];
            if let Some(eq) = line.iter().position(|&b| b == b'=') {
                let name = String::from_utf8(line[..eq].to_vec()).unwrap();
                let value = String::from_utf8(line[eq + 1..].to_vec()).unwrap();
                out.push((name, value));
                bytes = &bytes[nl + 1..];
            } else {
                let name = String::from_utf8(line.to_vec()).unwrap();
                let len = u64::from_le_bytes(bytes[nl + 1..nl + 9].try_into().unwrap()) as usize;
                let value = String::from_utf8(bytes[nl + 9..nl + 9 + len].to_vec()).unwrap();
                assert_eq!(bytes[nl + 9 + len], b'\n');
                out.push((name, value));
                bytes = &bytes[nl + 10 + len..];
            }
        }
        out
    }

    #[test]
    fn an_entry_carries_plain_multi_line_and_json_fields() {
        let json: serde_json::Value = serde_json::from_str(
            r#"{"component":"ramfs","pid":7,"fields":{"message":"hi","took_us":12,"x":{"y":true}}}"#,
        )
        .unwrap();
        let mut e = Entry::new(Priority::Warning, "two\nlines");
        e.json_fields("", json.as_object().unwrap(), &["fields"]);
        let fields = decode(e.bytes());
        let get = |n: &str| {
            fields
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.as_str())
                .unwrap_or_else(|| panic!("no {n} in {fields:?}"))
        };
        assert_eq!(get("PRIORITY"), "4");
        assert_eq!(get("SYSLOG_IDENTIFIER"), "kintsugi");
        assert_eq!(get("MESSAGE"), "two\nlines");
        assert_eq!(get("COMPONENT"), "ramfs");
        assert_eq!(get("PID"), "7");
        assert_eq!(get("TOOK_US"), "12");
        assert_eq!(get("X_Y"), "true");
    }

    #[test]
    fn a_components_json_line_becomes_an_entry_with_its_fields() {
        let line = r#"{"component":"ramfs","pid":42,"epoch":3,"timestamp":"t","level":"WARN","fields":{"message":"slow","took_us":900}}"#;
        let fields = decode(line_entry("ramfs", line).bytes());
        for (name, value) in [
            ("PRIORITY", "4"),
            ("MESSAGE", "slow"),
            ("COMPONENT", "ramfs"),
            ("COMPONENT_PID", "42"),
            ("EPOCH", "3"),
            ("TOOK_US", "900"),
        ] {
            assert!(
                fields.iter().any(|(k, v)| k == name && v == value),
                "{name}={value} not in {fields:?}"
            );
        }
        assert_eq!(fields.iter().filter(|(k, _)| k == "MESSAGE").count(), 1);
        assert!(!fields.iter().any(|(k, _)| k == "LEVEL" || k == "PID"));
        let raw = decode(line_entry("httpd", "thread 'main' panicked at x.rs:1:2").bytes());
        assert!(raw.contains(&("PRIORITY".into(), "3".into())));
        assert!(raw.contains(&("COMPONENT".into(), "httpd".into())));
    }

    #[test]
    fn an_event_becomes_an_entry_with_its_kind_and_fields() {
        let e = crate::Event::Rebooted {
            component: "ramfs".into(),
            epoch: 2,
            pid: 9,
            took: std::time::Duration::from_micros(150),
            init: std::time::Duration::from_micros(20),
        };
        let fields = decode(event_entry(&e).bytes());
        for (name, value) in [
            ("PRIORITY", "5"),
            ("EVENT", "rebooted"),
            ("COMPONENT", "ramfs"),
            ("COMPONENT_PID", "9"),
            ("EPOCH", "2"),
            ("TOOK_US", "150"),
            ("INIT_US", "20"),
        ] {
            assert!(
                fields.iter().any(|(k, v)| k == name && v == value),
                "{name}={value} not in {fields:?}"
            );
        }
        assert!(fields
            .iter()
            .any(|(k, v)| k == "MESSAGE" && v == &e.to_string()));
    }

    #[test]
    fn field_names_are_made_valid() {
        assert_eq!(field_name("took_us"), "TOOK_US");
        assert_eq!(field_name("_PID"), "F__PID");
        assert_eq!(field_name("9lives"), "F_9LIVES");
        assert_eq!(field_name("a.b-c"), "A_B_C");
        assert_eq!(field_name(""), "F_");
        assert_eq!(field_name(&"x".repeat(100)).len(), 64);
    }

    #[test]
    fn a_long_value_is_cut_to_fit_one_datagram() {
        let mut e = Entry::new(Priority::Info, "m");
        e.field("BIG", &"é".repeat(MAX_ENTRY));
        assert!(e.bytes().len() <= MAX_ENTRY);
        let fields = decode(e.bytes());
        assert!(fields
            .iter()
            .any(|(k, v)| k == "BIG" && v.len() > MAX_ENTRY / 2));
    }

    #[test]
    fn journal_stream_must_name_stderr() {
        // The test harness's stderr is not what a made-up JOURNAL_STREAM
        // names; the variable's absence or malformation is no match.
        std::env::set_var("JOURNAL_STREAM", "1:1");
        assert!(!stderr_is_journal());
        let st = rustix::fs::fstat(std::io::stderr()).unwrap();
        std::env::set_var("JOURNAL_STREAM", format!("{}:{}", st.st_dev, st.st_ino));
        assert!(stderr_is_journal());
        std::env::set_var("JOURNAL_STREAM", "garbage");
        assert!(!stderr_is_journal());
        std::env::remove_var("JOURNAL_STREAM");
        assert!(!stderr_is_journal());
    }
}
