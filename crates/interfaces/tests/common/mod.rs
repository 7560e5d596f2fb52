//! What the loopback tests share.

use std::sync::Mutex;

/// The calls a test server saw, in order, across its incarnations.
#[derive(Default)]
pub struct Log(Mutex<Vec<String>>);

impl Log {
    pub fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }

    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}
