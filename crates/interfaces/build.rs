//! Compiles every interface in `idl/*.kidl` into `$OUT_DIR/<name>.rs`.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    if let Err(e) = kintsugi_idl::compile_dir(&manifest.join("idl"), &out_dir) {
        // `interfaces/fs.kidl:12:24: ...`, as the build's error.
        panic!("{e}");
    }
    // Test-only interfaces that exercise every feature of the generator.
    if let Err(e) =
        kintsugi_idl::compile_dir(&manifest.join("tests/idl"), &out_dir.join("test_idl"))
    {
        panic!("{e}");
    }
}
