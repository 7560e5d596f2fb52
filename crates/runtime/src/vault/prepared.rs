//! A standby builds its incarnation's state ahead, from the records it
//! read ahead ([`super::ahead`]).
//!
//! Reading the records ahead took the listing off a reboot's path, but not
//! what a component makes of them: ramfs parsing its metadata and linking
//! its tree took about 650 ns a record in a freshly activated incarnation
//! (130 µs for 201 files, over 1 ms for 1,000). NewtOS's storage server
//! hands a restarted server its state; a warm standby can go one step
//! further and hold the state already built. A component names, before
//! [`crate::run`] (so that it is part of the pristine image), how its state
//! is built from its records ([`prepare_ahead`]); the standby builds it from
//! the copy of the records it reads ahead once they have stood unchanged
//! for one refresh ([`super::REFRESH`]), drops it when they change, and
//! builds it again once they stand. At activation, [`Vault::list_prepared`] asks the vault what
//! changed since: if nothing did, the incarnation takes the state as built;
//! otherwise it gets the records, as [`Vault::list`] gives them.
//!
//! The standby must not change the vault (the live incarnation owns it):
//! whatever the building finds wrong with a record (ramfs quarantines it)
//! travels in the built state for the incarnation to act on.

use std::any::Any;
use std::sync::{Arc, OnceLock};

use super::{FirstListing, Vault, VaultError, VaultRecord};

/// How a component builds its state from its records (its type erased).
#[derive(Clone)]
pub struct Builder(Arc<BuildFn>);

type BuildFn = dyn Fn(Vec<VaultRecord>) -> Box<dyn Any + Send> + Send + Sync;

impl Builder {
    pub fn new<P: Send + 'static>(build: fn(Vec<VaultRecord>) -> P) -> Self {
        Self(Arc::new(move |records| Box::new(build(records))))
    }

    /// The state built from copies of `records` (each descriptor
    /// duplicated); None if a descriptor cannot be.
    pub(super) fn build<'r>(
        &self,
        records: impl Iterator<Item = &'r VaultRecord>,
    ) -> Option<Box<dyn Any + Send>> {
        let copies: Result<Vec<VaultRecord>, std::io::Error> = records
            .map(|r| {
                Ok(VaultRecord {
                    key: r.key.clone(),
                    value: r.value.clone(),
                    fd: r.fd.as_ref().map(|fd| fd.try_clone()).transpose()?,
                })
            })
            .collect();
        match copies {
            Ok(copies) => Some((self.0)(copies)),
            Err(e) => {
                tracing::debug!("standby: state not built ahead: {e}");
                None
            }
        }
    }
}

static REGISTERED: OnceLock<Builder> = OnceLock::new();

/// Names how this component builds its state from its vault's records, for
/// its standbys to build it ahead (see the module's doc). Call it before
/// [`crate::run`]; a second call is ignored. `build` is given copies of the
/// records (each descriptor duplicated), so it may keep them.
pub fn prepare_ahead<P: Send + 'static>(build: fn(Vec<VaultRecord>) -> P) {
    let _ = REGISTERED.set(Builder::new(build));
}

/// What [`prepare_ahead`] named, for the runtime's standbys.
pub(crate) fn registered() -> Option<Builder> {
    REGISTERED.get().cloned()
}

/// What [`Vault::list_prepared`] found.
pub enum Listing<P> {
    /// The state the standby built from records that have not changed since.
    Prepared(P),
    /// The records, as [`Vault::list`] gives them: build the state from them.
    Records(Vec<VaultRecord>),
}

impl Vault {
    /// The same, building its state with `builder` from every copy of the
    /// records [`Vault::read_ahead_until`] reads.
    pub fn building_ahead(mut self, builder: Builder) -> Self {
        self.builder = Some(builder);
        self
    }

    /// [`Vault::list`] for a component that names how its state is built
    /// ([`prepare_ahead`]): the state its standby built, if the records
    /// have not changed since, else the records.
    pub fn list_prepared<P: 'static>(&self) -> Result<Listing<P>, VaultError> {
        match self.caught_up()? {
            Some(FirstListing::Built(built)) => match built.downcast::<P>() {
                Ok(state) => Ok(Listing::Prepared(*state)),
                // Built as another type than asked: list again.
                Err(_) => Ok(Listing::Records(self.list_prefix("")?)),
            },
            Some(FirstListing::Records(records)) => Ok(Listing::Records(records)),
            None => Ok(Listing::Records(self.list_prefix("")?)),
        }
    }
}
