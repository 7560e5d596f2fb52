//! Compiles every interface in `idl/*.kidl` into `$OUT_DIR/<name>.rs`, and
//! the test-only interfaces of `tests/idl` into `$OUT_DIR/test_idl/`.

fn main() -> Result<(), kintsugi_idl::IdlError> {
    // An error reads `idl/fs.kidl:12:24: ...`.
    kintsugi_idl::configure().compile_dir("idl")?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    kintsugi_idl::configure()
        .out_dir(out.join("test_idl"))
        .compile_dir("tests/idl")?;
    Ok(())
}
