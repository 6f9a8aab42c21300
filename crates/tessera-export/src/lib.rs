//! The export layer: what a block target must offer to be served over a protocol, and
//! the connection machinery the protocols (NBD, NVMe/TCP, iSCSI) share.
//!
//! - [`ExportTarget`]: the contract of an exported target (size, read-only flag, block
//!   status, changes since a snapshot, stats, per-core handles). The thin volume of
//!   `tessera-pool` implements it; a snapshot (read-only), a clone or a replicated volume
//!   implement the same trait and the protocols serve them unchanged.
//! - [`ExportHandle`]: one core's handle to a target, the per-I/O face. Protocols are
//!   generic over the target type, so each I/O is a static call, never a virtual one.
//! - [`Export`]: a target as a protocol receives it, bound to its QoS state.
//! - [`conn`]: receive buffer, slot free list, gathered `sendmsg` with partial-send
//!   advance, batched stats, socket teardown.
//! - [`budget`]: bytes of request buffers in flight per connection and per node
//!   (back-pressure), connections per listener.
//! - [`accept`]: the accept loop the listeners share (cap, failed accepts).
//! - [`stats`]: per-connection I/O figures and the per-target registry summing them.

use std::sync::Arc;

use tessera_io::{CoreIo, IoOp, Tag};

pub mod accept;
pub mod budget;
pub mod conn;
pub mod log_limit;
pub mod stats;

pub use stats::{IoClass, IoStats, StatsRegistry, StatsSnapshot};
/// The QoS admission a connection puts in front of its target (limits, group, shares).
pub use tessera_qos::gate::{Charge, Gate, Released};
pub use tessera_qos::VolumeQos;

/// A block target that can be exported: a thin volume today; a snapshot, a clone or a
/// volume replicated on other nodes later. Shared by every core serving it (`Arc`).
///
/// Everything here but [`ExportTarget::open`] is control plane or per-connection work
/// (block status replies excepted, which are rare); the per-I/O path is the handle.
pub trait ExportTarget: Send + Sync + 'static {
    /// One core's handle (see [`ExportHandle`]).
    type Handle: ExportHandle;

    /// Size in bytes. May grow while exported (resize).
    fn size(&self) -> u64;

    /// Writes are refused (a snapshot). Protocols answer every write, trim and
    /// write-zeroes with their read-only error without submitting it.
    fn read_only(&self) -> bool {
        false
    }

    /// What identifies the target across its exports and connections (state shared by
    /// every connection to it, such as the NBD edge-block locks, is keyed by it): the
    /// target's address by default; a wrapper answers for what it wraps, so two wrappers
    /// of one volume share that state.
    fn identity(&self) -> usize {
        self as *const Self as *const () as usize
    }

    /// Bytes of backing space the target holds (thin provisioning figures).
    fn allocated_bytes(&self) -> u64;

    /// Whether `[offset, offset+len)` is allocated, as at most `max_runs` runs of
    /// (length, allocated), clipped to the range, adjacent runs of one state merged.
    /// Unallocated ranges read as zeros.
    fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)>;

    /// The snapshots this target can report its changes since (NBD exports them as
    /// `qemu:dirty-bitmap:NAME` metadata contexts), nearest first: for a volume, clone
    /// or snapshot, the snapshots it descends from. None for a target outside a chain.
    fn change_bases(&self) -> Vec<String> {
        Vec::new()
    }

    /// The snapshot `name` of [`ExportTarget::change_bases`] as a token for
    /// [`ExportTarget::changed_runs`]. The token names that snapshot for good: it stays
    /// valid when the snapshot is deleted while the target still reads through it, and
    /// never means another snapshot given the name later.
    fn change_base(&self, _name: &str) -> Option<u64> {
        None
    }

    /// Which parts of `[offset, offset+len)` may differ from the change base `base` (a
    /// token of [`ExportTarget::change_base`]), as at most `max_runs` runs of (length,
    /// changed), clipped to the range, adjacent runs of one state merged. `None` when
    /// `base` is no longer an ancestor of the target (nothing can be said).
    fn changed_runs(
        &self,
        _base: u64,
        _offset: u64,
        _len: u64,
        _max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        None
    }

    /// A stats block for one connection; hand it back with
    /// [`ExportTarget::unregister_stats`] when the connection closes.
    fn register_stats(&self) -> Arc<IoStats>;

    /// Fold a closed connection's figures into the target's totals.
    fn unregister_stats(&self, stats: &Arc<IoStats>);

    /// Cumulative figures of every connection, open or closed.
    fn stats(&self) -> StatsSnapshot;

    /// A handle for the calling core. Handles are not shared between cores.
    fn open(self: &Arc<Self>) -> Self::Handle;
}

/// One core's handle to an [`ExportTarget`].
pub trait ExportHandle: 'static {
    /// Start `op`; it completes exactly once for `tag` through `io`, possibly before this
    /// returns (through the core's ready queue, never re-entrantly) and possibly from
    /// another thread (a flush served by a commit thread, a replica's acknowledgement)
    /// through the core's mailbox. The result is `-errno` on failure (`EINVAL` out of
    /// range, `EIO`, `ENOSPC`, `EROFS`...), anything else on success.
    ///
    /// # Safety
    /// The buffer of a `Read` or `Write` must hold `len` bytes and stay valid, and not be
    /// touched by anyone else, until the completion for `tag` arrives.
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag);

    /// True when no byte of `[offset, offset+len)` has backing space, so it reads as
    /// zeros without I/O. Must be cheap: no lock, no shared write, no allocation.
    fn is_hole(&mut self, offset: u64, len: u64) -> bool;

    /// Whether a read at `offset` should go before writes waiting for a QoS share
    /// round (`Charge::ReadFirst`): its region's recent reads look random. Asked only
    /// while writes wait; must be as cheap as `is_hole`. None by default.
    fn reads_first_at(&self, _offset: u64) -> bool {
        false
    }
}

/// A target as a protocol serves it: the target and the QoS state its connections are
/// admitted by (limits and group live with the export layer, not in the target).
pub struct Export<T> {
    pub target: Arc<T>,
    pub qos: Arc<VolumeQos>,
}

impl<T> Clone for Export<T> {
    fn clone(&self) -> Self {
        Export {
            target: self.target.clone(),
            qos: self.qos.clone(),
        }
    }
}
