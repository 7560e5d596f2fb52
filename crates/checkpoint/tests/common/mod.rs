//! The testbench's target process (`kintsugi-ckpt-target`) driven over
//! its stdin and stdout.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The workspace's binaries: next to the test executable's folder.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build --release --workspace` first",
        path.display()
    );
    path
}

pub struct Target {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Target {
    pub fn start(seed: u64, heap: u64, maps: u64, threads: u64, spin: bool) -> Self {
        // Address randomization off, so that a second process of the same
        // program has its code where the first had it (a new incarnation
        // forked from one pristine image has that by construction).
        let mut cmd = Command::new("setarch");
        cmd.arg("-R")
            .arg(binary("kintsugi-ckpt-target"))
            .args(["--seed", &seed.to_string()])
            .args(["--heap", &heap.to_string()])
            .args(["--maps", &maps.to_string()])
            .args(["--threads", &threads.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if spin {
            cmd.arg("--spin");
        }
        let mut child = cmd.spawn().expect("start kintsugi-ckpt-target");
        let input = child.stdin.take().unwrap();
        let output = BufReader::new(child.stdout.take().unwrap());
        let mut t = Target {
            child,
            input,
            output,
        };
        assert_eq!(t.line().unwrap(), "ready");
        t
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn line(&mut self) -> Result<String, String> {
        let mut s = String::new();
        self.output.read_line(&mut s).map_err(|e| e.to_string())?;
        if s.is_empty() {
            self.reap_traced();
            let status = self.child.wait().map_err(|e| e.to_string())?;
            return Err(format!("target {} exited: {status}", self.child.id()));
        }
        Ok(s.trim().to_string())
    }

    /// Sends a command; its answer, or how the target died.
    pub fn cmd(&mut self, c: &str) -> Result<String, String> {
        self.send(c)?;
        self.line()
    }

    /// Sends a command without waiting for its answer ([`Self::reply`]).
    pub fn send(&mut self, c: &str) -> Result<(), String> {
        writeln!(self.input, "{c}").map_err(|e| format!("target {}: {e}", self.child.id()))?;
        self.input.flush().map_err(|e| e.to_string())
    }

    /// The answer to the command sent last.
    pub fn reply(&mut self) -> Result<String, String> {
        self.line()
    }

    /// The digest, which must be `ok`.
    pub fn digest(&mut self) -> Result<String, String> {
        let d = self.cmd("digest")?;
        if !d.starts_with("ok ") {
            return Err(format!("target says {d}"));
        }
        Ok(d)
    }
}

impl Target {
    /// The signal that ended the target, waiting at most `timeout`; `None`
    /// if it still runs then (or ended otherwise).
    pub fn killed_by(&mut self, timeout: std::time::Duration) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            self.reap_traced();
            if let Some(status) = self.child.try_wait().ok()? {
                return status.signal();
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        None
    }

    /// A thread that died while this thread traced it is a zombie that
    /// only its tracer may collect: collect each, or waiting for the
    /// process hangs.
    fn reap_traced(&self) {
        let tids = kintsugi_checkpoint::thread_ids(self.pid()).unwrap_or_default();
        for tid in tids.into_iter().filter(|&t| t != self.pid()) {
            let _ = nix::sys::wait::waitpid(
                nix::unistd::Pid::from_raw(tid as i32),
                Some(nix::sys::wait::WaitPidFlag::__WALL | nix::sys::wait::WaitPidFlag::WNOHANG),
            );
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        self.reap_traced();
        let _ = self.child.wait();
    }
}
