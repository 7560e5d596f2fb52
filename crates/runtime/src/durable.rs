//! Durable memory: shared memory that outlives every incarnation of a
//! component.
//!
//! The supervisor creates each memfd once, when the system starts, and holds
//! it until the system stops. The pristine image maps it at boot and every
//! incarnation forked from it inherits the mapping, so a micro-reboot
//! discards the failed incarnation's heap but not these pages:
//!
//! - the **arena** (`arena_kib`): the component's own;
//! - its **pool** (`pool_kib`): shared with its clients, each of which maps
//!   the pages the server granted it ([`Region::map_range`]);
//! - its **servers' pools**: the pool of each server it uses that has one.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::Arc;

use crate::abi::boot::BootInfo;
use crate::abi::shm::Region;

/// A component's durable memory, mapped at boot.
pub(crate) struct Durable {
    pub(crate) arena: Option<Region>,
    pub(crate) pool: Option<Region>,
    /// By used interface: the pool of its server, mapped once per server.
    pub(crate) server_pools: HashMap<String, Arc<Region>>,
}

impl Durable {
    /// Maps the durable memory that `info` names; `adopt` maps one inherited
    /// descriptor, and is called once per descriptor.
    pub(crate) fn map(
        info: &BootInfo,
        mut adopt: impl FnMut(RawFd) -> std::io::Result<Region>,
    ) -> std::io::Result<Self> {
        let arena = info.arena_fd.map(&mut adopt).transpose()?;
        let pool = info.pool_fd.map(&mut adopt).transpose()?;
        // Every edge to one server carries the same descriptor.
        let mut by_fd: HashMap<RawFd, Arc<Region>> = HashMap::new();
        let mut server_pools = HashMap::new();
        for used in &info.uses {
            let Some(fd) = used.pool_fd else { continue };
            let region = match by_fd.entry(fd) {
                Entry::Occupied(e) => e.get().clone(),
                Entry::Vacant(e) => e.insert(Arc::new(adopt(fd)?)).clone(),
            };
            server_pools.insert(used.interface.clone(), region);
        }
        Ok(Self {
            arena,
            pool,
            server_pools,
        })
    }
}
