//! The kintsugi IDL compiler.
