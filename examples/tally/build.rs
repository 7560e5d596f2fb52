//! Compiles `idl/*.kidl` into `$OUT_DIR/<interface>.rs`.

fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    if let Err(e) = kintsugi_idl::compile_dir(std::path::Path::new("idl"), &out) {
        panic!("{e}"); // `idl/tally.kidl:3:14: ...`
    }
}
