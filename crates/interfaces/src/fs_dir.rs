//! A whole directory through `fs.readdir`'s pages.
//!
//! One reply holds as many names as fit in a channel slot, so `readdir`
//! answers a page of names after a given one; [`fs::Client::readdir_all`]
//! asks page after page until one is empty.

use kintsugi_runtime::stub::{CallError, Fault};

use crate::fs::{self, Error};

impl fs::Client {
    /// Every name in directory `path`, in order. Names made or removed
    /// while it runs may be listed or not (as with POSIX `readdir`); every
    /// name present throughout is listed once. A page that does not go on
    /// strictly in order from the name before it is a faulty reply,
    /// refused rather than asked past (it could make the listing endless).
    pub fn readdir_all(&self, path: &str) -> Result<Vec<String>, CallError<Error>> {
        let mut names: Vec<String> = Vec::new();
        loop {
            let after = names.last().map_or("", String::as_str);
            let page = self.readdir(path, after)?;
            if page.is_empty() {
                return Ok(names);
            }
            let mut last = after;
            for name in &page {
                if name.as_str() <= last {
                    return Err(CallError::Fault(Fault::Refused(format!(
                        "readdir {path:?} after {after:?} answered {name:?} after {last:?}"
                    ))));
                }
                last = name;
            }
            names.extend(page);
        }
    }
}
