//! What a node exports: a thin volume of one of its pools, a volume replicated onto
//! other nodes whose local leg is such a volume, or a cluster volume another node owns,
//! proxied over NVMe/TCP (crate::proxy). Protocols are generic over the target; this
//! enum lets one server serve all three with a static branch per I/O, no virtual call.

use std::sync::Arc;

use tessera_export::{ExportHandle, ExportTarget, IoStats, StatsSnapshot};
use tessera_io::{CoreIo, IoOp, Tag};
use tessera_pool::{Volume, VolumeHandle};
use tessera_replica::{ReplicaHandle, ReplicatedVolume};

use crate::proxy::{ProxyHandle, ProxyVolume};

pub enum NodeTarget {
    Local(Arc<Volume>),
    Replicated(Arc<ReplicatedVolume>),
    Proxy(Arc<ProxyVolume>),
}

pub enum NodeHandle {
    Local(VolumeHandle),
    Replicated(ReplicaHandle),
    Proxy(ProxyHandle),
}

impl ExportTarget for NodeTarget {
    type Handle = NodeHandle;

    fn size(&self) -> u64 {
        match self {
            NodeTarget::Local(v) => v.size(),
            NodeTarget::Replicated(r) => r.size(),
            NodeTarget::Proxy(p) => p.size(),
        }
    }

    // One volume is served through a new `NodeTarget` per connection: its identity is the
    // volume's, so the connections share per-target state (NBD edge-block locks).
    fn identity(&self) -> usize {
        match self {
            NodeTarget::Local(v) => ExportTarget::identity(&**v),
            NodeTarget::Replicated(r) => ExportTarget::identity(&**r),
            // One proxy per volume per node, shared by its connections.
            NodeTarget::Proxy(p) => Arc::as_ptr(p) as usize,
        }
    }

    fn read_only(&self) -> bool {
        match self {
            NodeTarget::Local(v) => ExportTarget::read_only(&**v),
            NodeTarget::Replicated(r) => r.read_only(),
            // The owner refuses writes itself if its export is read-only (EROFS).
            NodeTarget::Proxy(_) => false,
        }
    }

    fn allocated_bytes(&self) -> u64 {
        match self {
            NodeTarget::Local(v) => v.allocated_bytes(),
            NodeTarget::Replicated(r) => ExportTarget::allocated_bytes(&**r),
            // The owner's allocation map is not visible through NVMe/TCP: all of it
            // counts as allocated (clients then read holes as data, which is correct).
            NodeTarget::Proxy(p) => p.size(),
        }
    }

    fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        match self {
            NodeTarget::Local(v) => v.allocation_runs(offset, len, max_runs),
            NodeTarget::Replicated(r) => r.allocation_runs(offset, len, max_runs),
            NodeTarget::Proxy(p) => {
                let len = len.min(p.size().saturating_sub(offset));
                if len == 0 || max_runs == 0 {
                    Vec::new()
                } else {
                    vec![(len, true)]
                }
            }
        }
    }

    // A replicated volume reports its local replica's chain (snapshots are taken on every
    // replica at one point); a proxied volume's chain is on its owner.
    fn change_bases(&self) -> Vec<String> {
        match self {
            NodeTarget::Local(v) => v.change_bases(),
            NodeTarget::Replicated(r) => r.change_bases(),
            NodeTarget::Proxy(_) => Vec::new(),
        }
    }

    fn change_base(&self, name: &str) -> Option<u64> {
        match self {
            NodeTarget::Local(v) => ExportTarget::change_base(&**v, name),
            NodeTarget::Replicated(r) => ExportTarget::change_base(&**r, name),
            NodeTarget::Proxy(_) => None,
        }
    }

    fn changed_runs(
        &self,
        base: u64,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        match self {
            NodeTarget::Local(v) => ExportTarget::changed_runs(&**v, base, offset, len, max_runs),
            NodeTarget::Replicated(r) => {
                ExportTarget::changed_runs(&**r, base, offset, len, max_runs)
            }
            NodeTarget::Proxy(_) => None,
        }
    }

    // Stats live with the local volume either way, so `volume stats` and metrics see a
    // replicated volume's client I/O under its name. A proxy's are the node's figures of
    // the proxied volume (metrics: `tessera_proxy_*`).
    fn register_stats(&self) -> Arc<IoStats> {
        if let NodeTarget::Proxy(p) = self {
            return p.register_stats();
        }
        self.stats_volume()
            .map_or_else(|| Arc::new(IoStats::default()), |v| v.register_stats())
    }

    fn unregister_stats(&self, stats: &Arc<IoStats>) {
        if let NodeTarget::Proxy(p) = self {
            return p.unregister_stats(stats);
        }
        if let Some(v) = self.stats_volume() {
            v.unregister_stats(stats)
        }
    }

    fn stats(&self) -> StatsSnapshot {
        if let NodeTarget::Proxy(p) = self {
            return p.stats();
        }
        self.stats_volume()
            .map_or_else(StatsSnapshot::default, |v| v.stats())
    }

    fn open(self: &Arc<Self>) -> NodeHandle {
        match &**self {
            NodeTarget::Local(v) => NodeHandle::Local(v.open_handle()),
            NodeTarget::Replicated(r) => NodeHandle::Replicated(r.open()),
            NodeTarget::Proxy(p) => NodeHandle::Proxy(p.open_handle()),
        }
    }
}

impl NodeTarget {
    fn stats_volume(&self) -> Option<Arc<Volume>> {
        match self {
            NodeTarget::Local(v) => Some(v.clone()),
            NodeTarget::Replicated(r) => r.local_volume(),
            NodeTarget::Proxy(_) => None,
        }
    }
}

impl ExportHandle for NodeHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        match self {
            // SAFETY: forwarded under the caller's contract.
            NodeHandle::Local(h) => unsafe { ExportHandle::submit(h, io, op, tag) },
            // SAFETY: as above.
            NodeHandle::Replicated(h) => unsafe { ExportHandle::submit(h, io, op, tag) },
            // SAFETY: as above.
            NodeHandle::Proxy(h) => unsafe { h.submit(io, op, tag) },
        }
    }

    #[inline]
    fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        match self {
            NodeHandle::Local(h) => ExportHandle::is_hole(h, offset, len),
            NodeHandle::Replicated(h) => h.is_hole(offset, len),
            // Every block of a proxied volume counts as allocated (see allocated_bytes).
            NodeHandle::Proxy(_) => false,
        }
    }

    #[inline]
    fn reads_first_at(&self, offset: u64) -> bool {
        match self {
            NodeHandle::Local(h) => ExportHandle::reads_first_at(h, offset),
            // A replicated volume's reads are served by a leg the handle picks per
            // request; its legs' detectors are not consulted here.
            NodeHandle::Replicated(_) | NodeHandle::Proxy(_) => false,
        }
    }
}
