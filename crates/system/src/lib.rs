//! System descriptions.
