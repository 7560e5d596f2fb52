//! The parser never panics, and every error points inside the text.

use std::path::Path;

use proptest::prelude::*;

const FS: &str = include_str!("../../interfaces/idl/fs.kidl");

/// Pieces that keep a mutated spec close to valid, so the fuzzer reaches
/// the checker and the generator too.
const PIECES: &[&str] = &[
    "fn",
    "(",
    ")",
    ";",
    ":",
    ",",
    ".",
    "->",
    "[",
    "]",
    "{",
    "}",
    "-",
    "create",
    "terminal",
    "reboot: keeps;",
    "remember",
    "replay(0)",
    "range(0, 9)",
    "max(4)",
    "set(fd.offset)",
    "advance(fd.offset)",
    "restore(fd.offset)",
    "retry_ok(NotFound)",
    "File",
    "Stat",
    "u8",
    "u64",
    "i64",
    "str",
    "bytes",
    "unit",
    "[str]",
    "fd",
    "x",
    "\"s\"",
    "\n",
    " ",
    "//",
    "9",
    "descriptor",
    "record",
    "errors",
    "field",
    "namespace",
    "global",
    "parent",
    "none",
    "same",
];

fn check(text: &str) {
    match kintsugi_idl::parse(Path::new("f.kidl"), text) {
        Ok(iface) => {
            let code = kintsugi_idl::generate(&iface);
            assert!(code.contains("pub struct Client"));
        }
        Err(e) => {
            let lines: Vec<&str> = text.split('\n').collect();
            assert!(
                e.line >= 1 && e.line <= lines.len(),
                "{e}: line outside the text"
            );
            let width = lines[e.line - 1].chars().count();
            assert!(
                e.col >= 1 && e.col <= width + 1,
                "{e}: column outside line {:?}",
                lines[e.line - 1]
            );
            assert!(e
                .to_string()
                .starts_with(&format!("f.kidl:{}:{}: ", e.line, e.col)));
        }
    }
}

#[derive(Debug, Clone)]
enum Edit {
    Delete(usize, usize),
    Insert(usize, usize),
    Duplicate(usize, usize),
}

fn apply(text: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    for e in edits {
        let n = chars.len().max(1);
        match *e {
            Edit::Delete(at, len) => {
                let at = at % n;
                let end = (at + len % 12).min(chars.len());
                chars.drain(at.min(end)..end);
            }
            Edit::Insert(at, piece) => {
                let at = at % (chars.len() + 1);
                let piece = PIECES[piece % PIECES.len()];
                let tail = chars.split_off(at);
                chars.extend(piece.chars().chain([' ']));
                chars.extend(tail);
            }
            Edit::Duplicate(at, len) => {
                let at = at % n;
                let end = (at + len % 40).min(chars.len());
                let copy: Vec<char> = chars[at.min(end)..end].to_vec();
                let tail = chars.split_off(end);
                chars.extend(copy);
                chars.extend(tail);
            }
        }
    }
    chars.into_iter().collect()
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Delete(a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Insert(a, b)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Edit::Duplicate(a, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        check(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn random_text_never_panics(text in "\\PC{0,200}") {
        check(&text);
        check(&format!("interface t;\n{text}"));
    }

    #[test]
    fn mutated_fs_never_panics(edits in proptest::collection::vec(edit(), 1..6)) {
        check(&apply(FS, &edits));
    }
}

#[test]
fn the_unmutated_spec_is_valid() {
    assert!(kintsugi_idl::parse(Path::new("f.kidl"), FS).is_ok());
}
