//! The kintsugi runtime, linked into every component.
pub mod stub;
pub mod wire;
