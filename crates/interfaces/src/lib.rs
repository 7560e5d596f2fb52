//! Generated interface stubs.
