//! Golden files: the generated code of every interface in `crates/interfaces/idl/` and
//! of the generator's test interfaces is compared with the expected text in
//! `tests/golden/<name>.rs`, so that a change to the generator shows in
//! review as a change to what it emits. After an intended change, bless the
//! new output with `KINTSUGI_BLESS=1 cargo test -p kintsugi-idl --test golden`.

use std::path::{Path, PathBuf};

fn kidl_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kidl"))
        .collect();
    files.sort();
    files
}

#[test]
fn generated_code_matches_the_golden_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let golden = root.join("tests/golden");
    let bless = std::env::var_os("KINTSUGI_BLESS").is_some();
    let mut inputs = kidl_files(&root.join("../interfaces/idl"));
    inputs.extend(kidl_files(&root.join("../interfaces/tests/idl")));
    assert!(inputs.len() >= 10, "interfaces found: {inputs:?}");
    let mut differ = Vec::new();
    for input in &inputs {
        let name = input.file_stem().unwrap().to_str().unwrap();
        let shown = Path::new(input.parent().unwrap().file_name().unwrap())
            .join(input.file_name().unwrap());
        let text = std::fs::read_to_string(input).unwrap();
        let iface = kintsugi_idl::parse(&shown, &text).unwrap_or_else(|e| panic!("{e}"));
        let generated = kintsugi_idl::generate(&iface);
        let expected_path = golden.join(format!("{name}.rs"));
        if bless {
            std::fs::write(&expected_path, &generated).unwrap();
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != generated {
            let line = expected
                .lines()
                .zip(generated.lines())
                .position(|(a, b)| a != b)
                .map_or(
                    expected.lines().count().min(generated.lines().count()),
                    |i| i,
                )
                + 1;
            differ.push(format!(
                "{} (first difference at line {line})",
                expected_path.display()
            ));
        }
    }
    assert!(
        differ.is_empty(),
        "generated code differs from its golden file (bless an intended change with KINTSUGI_BLESS=1):\n{}",
        differ.join("\n")
    );
}
