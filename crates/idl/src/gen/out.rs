//! Rust text, indented by four spaces per level.

/// Rust text, indented by four spaces per level.
pub(super) struct Out {
    pub(super) s: String,
    pub(super) depth: usize,
}

impl Out {
    pub(super) fn at(depth: usize) -> Self {
        Self {
            s: String::new(),
            depth,
        }
    }

    pub(super) fn line(&mut self, l: impl AsRef<str>) {
        let l = l.as_ref();
        if !l.is_empty() {
            for _ in 0..self.depth {
                self.s.push_str("    ");
            }
            self.s.push_str(l);
        }
        self.s.push('\n');
    }

    pub(super) fn lines(&mut self, ls: Vec<String>) {
        for l in ls {
            self.line(l);
        }
    }

    pub(super) fn open(&mut self, l: impl AsRef<str>) {
        self.line(l);
        self.depth += 1;
    }

    pub(super) fn close(&mut self, l: impl AsRef<str>) {
        self.depth -= 1;
        self.line(l);
    }
}
