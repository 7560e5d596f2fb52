//! parse() never panics, and every error points inside the text.

use std::path::Path;

use kintsugi_system::{parse, SystemError};
use proptest::prelude::*;

const DEMO: &str = include_str!("../../../systems/demo.toml");
/// The numeric fields of issue 3, so that mutations reach their checks.
const DURABLE: &str = "[system]\nname = \"d\"\n\n[[component]]\nname = \"mm\"\nbinary = \"mm\"\n\
provides = [\"mem\"]\npool_kib = 64\narena_kib = 1048576\nrealtime = 10\nrecovery = \"eager\"\n\n\
[[component]]\nname = \"app\"\nbinary = \"app\"\nuses = [\"mem\"]\nrealtime = 99\n";

fn check(text: &str) {
    match parse(Path::new("f.toml"), text) {
        Ok(_) => {}
        Err(e @ SystemError::Invalid { .. }) => {
            let loc = e.location().expect("every parse error has a location");
            let lines: Vec<&str> = text.split('\n').collect();
            assert!(
                loc.line >= 1 && loc.line <= lines.len(),
                "{e} (text has {} lines)",
                lines.len()
            );
            let len = lines[loc.line - 1].chars().count();
            assert!(
                loc.col >= 1 && loc.col <= len + 1,
                "{e} (line has {len} chars)"
            );
            let prefix = format!("f.toml:{}:{}: ", loc.line, loc.col);
            assert!(e.to_string().starts_with(&prefix), "{e}");
        }
        Err(e) => panic!("parse cannot fail to read: {e}"),
    }
}

#[test]
fn durable_base_is_valid() {
    parse(Path::new("d.toml"), DURABLE).unwrap();
}

#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Insert(usize, u8),
    Delete(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    // Bytes biased towards TOML punctuation so that mutations stay near-valid.
    let byte = prop_oneof![
        3 => prop::sample::select(b"[]{}=\"'.,#@-_ \n0123456789abcxyz".to_vec()),
        1 => any::<u8>(),
    ];
    prop_oneof![
        (any::<usize>(), byte.clone()).prop_map(|(i, b)| Edit::Set(i, b)),
        (any::<usize>(), byte).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Delete),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_text(text in ".*") {
        check(&text);
    }

    #[test]
    fn random_tomlish_text(text in "[\\[\\]{}=\"'.,#@ \\na-z0-9_-]{0,200}") {
        check(&text);
    }

    #[test]
    fn mutated_demo(durable in any::<bool>(), edits in prop::collection::vec(edit(), 1..8)) {
        let mut bytes = if durable { DURABLE } else { DEMO }.as_bytes().to_vec();
        for e in edits {
            match e {
                Edit::Set(i, b) if !bytes.is_empty() => { let n = bytes.len(); bytes[i % n] = b; }
                Edit::Insert(i, b) => { let n = bytes.len() + 1; bytes.insert(i % n, b); }
                Edit::Delete(i) if !bytes.is_empty() => { let n = bytes.len(); bytes.remove(i % n); }
                _ => {}
            }
        }
        check(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn mutated_demo_lines(
        durable in any::<bool>(),
        drop in prop::collection::vec(any::<bool>(), 0..40),
        dup in any::<usize>(),
    ) {
        // Drop or duplicate whole lines: reaches the semantic checks more often.
        let lines: Vec<&str> = if durable { DURABLE } else { DEMO }.lines().collect();
        let mut out: Vec<&str> = lines.iter().enumerate()
            .filter(|(i, _)| !drop.get(*i).copied().unwrap_or(false)).map(|(_, l)| *l).collect();
        if !out.is_empty() { let k = dup % out.len(); let l = out[k]; out.insert(k, l); }
        check(&out.join("\n"));
    }
}
