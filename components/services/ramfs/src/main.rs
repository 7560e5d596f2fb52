//! ramfs: a hierarchical RAM file system served over the `fs` interface.
//!
//! Every file's and directory's metadata (parent, name, kind) is a record
//! in the state vault, and every file's contents live in a file the vault
//! made for that record (a memfd; a file in the vault's directory when the
//! system keeps its vault on disk, so that the files outlive the system). A crash of ramfs therefore loses nothing:
//! the next incarnation lists the vault and rebuilds its tree, and the
//! clients' stubs reopen their descriptors through the interface (a warm
//! standby builds the tree ahead, so that a reboot finds it built unless
//! the vault changed since). Each
//! metadata change is one atomic vault request, so a crash leaves the tree
//! as it was before or after the change.

#![forbid(unsafe_code)]

mod restore;
mod tree;

use std::sync::Arc;

use kintsugi_interfaces::fs;
use kintsugi_runtime::Incarnation;

fn main() {
    // Its standbys build the tree ahead from the records they read ahead.
    kintsugi_runtime::vault::prepare_ahead(tree::Built::from_records);
    kintsugi_runtime::run(|rt| {
        let fs = tree::RamFs::restore(rt.clone())?;
        tracing::debug!(epoch = rt.epoch(), "ramfs restored");
        Ok(Incarnation::serve(vec![fs::service(Arc::new(fs))]))
    })
}
