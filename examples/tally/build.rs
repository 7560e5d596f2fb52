//! Compiles `idl/tally.kidl` into `$OUT_DIR/tally.rs`, which `src/lib.rs`
//! includes.

fn main() -> Result<(), kintsugi_idl::IdlError> {
    // An error reads `idl/tally.kidl:3:14: ...`.
    kintsugi_idl::compile(&["idl/tally.kidl"])?;
    Ok(())
}
