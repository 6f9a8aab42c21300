//! Pools and thin volumes.
//!
//! - [`layout`]: how the pool's address space maps onto devices (concat, raid0, raid1,
//!   raid10, raid5, raid6, ec k+m).
//!   Parity layouts live under it: [`parity`] (`layout::parity`: geometry, row locks, the
//!   stripe journal and its recovery) and `layout::parity_io` (the per-core parity
//!   datapath). [`scrub`]: verify and repair.
//! - [`format`]: byte-exact codecs of `docs/format.md`.
//! - [`meta`]: superblock, checkpoints and journal on the pool's metadata region.
//! - [`pool`]: allocation, commits, volume and export management.
//! - [`volume`]: the thin map and the per-core volume datapath.
//! - [`chain`]: snapshots and clones; `changes`: what changed since a snapshot.
//! - [`cache_tier`]: a cache on faster devices in front of the pool's own (issue 24),
//!   with [`cache_policy`] deciding what stays in it.
//! - `inflight`: volume requests in flight per core, which snapshots and releases of
//!   units wait for.

pub mod cache_policy;
pub mod cache_tier;
pub mod chain;
mod changes;
mod core_engine;
pub mod dedup;
pub mod devstats;
pub mod error;
pub mod format;
mod inflight;
pub mod layout;
pub mod meta;
pub mod pattern;
pub use layout::parity;
pub mod pool;
mod presence;
pub mod scrub;
pub mod volume;

pub use devstats::DeviceTotals;
pub use error::{Error, ErrorKind, Result};
pub use format::ExportRecord;
pub use layout::{Layout, LayoutHandle, LayoutKind};
pub use pool::{
    human_bytes, random_uuid, uuid_string, validate_name, validate_overcommit, Pool, PoolOptions,
    PoolTuning, VolumeOptions, DEFAULT_OVERCOMMIT, DEFAULT_UNIT_SIZE,
};
pub use scrub::ScrubFindings;
pub use volume::{IoClass, IoStats, StatsSnapshot, Volume, VolumeHandle, HOLE};
