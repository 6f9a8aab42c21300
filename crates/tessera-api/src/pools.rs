//! `/v1/pools`: pools, their devices, hot spares and device replacement.

use serde::{Deserialize, Serialize};

use crate::jobs::{RebuildStatus, ScrubStatus};
use crate::layout::LayoutSpec;
use crate::SizeArg;

wire_state! {
    /// A device of a pool: how it serves.
    pub enum DeviceHealth {
        Online => "online",
        /// Failed: reads and writes go around it.
        Failed => "failed",
        /// Being rebuilt (a replacement, or a device given back).
        Rebuilding => "rebuilding",
    }
}

wire_state! {
    /// A pool's state (`state` of a pool and of an entry of `GET /v1/pools`).
    pub enum PoolState {
        Online => "online",
        /// A device failed; every block still has a copy.
        Degraded => "degraded",
        /// A device is being rebuilt.
        Rebuilding => "rebuilding",
        /// Data is lost (more devices failed than the layout survives).
        Failed => "failed",
        /// Listed in the registry, but the node could not open it.
        Offline => "offline",
    }
}

/// One device of a pool and its health.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeviceState {
    pub device: String,
    /// "online", "failed" or "rebuilding".
    pub state: DeviceHealth,
    /// Why the device failed (absent while it is online).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl DeviceState {
    pub fn is_failed(&self) -> bool {
        self.state == DeviceHealth::Failed
    }
}

/// A pool the node has open (`GET /v1/pools/NAME`, and the entries of `GET /v1/pools`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolInfo {
    pub name: String,
    /// "online", "degraded" (a device failed, every block still has a copy), "rebuilding"
    /// or "failed".
    pub state: PoolState,
    pub uuid: String,
    pub layout: String,
    pub stripe_size: u64,
    pub copies: u32,
    /// Parity chunks per row (raid5 1, raid6 2, ec m; 0 otherwise).
    pub parity: u32,
    /// The layout as `pool create --layout` takes it (e.g. `raid1:2`, `ec:4+2`).
    #[schema(value_type = String)]
    pub layout_spec: LayoutSpec,
    pub device_states: Vec<DeviceState>,
    pub devices: Vec<String>,
    pub unit_size: u64,
    /// Bytes available to volumes (metadata excluded).
    pub capacity: u64,
    pub allocated: u64,
    pub free: u64,
    pub metadata: u64,
    pub volumes: usize,
    /// On RAM or null devices: recreated empty at every node start.
    pub volatile: bool,
    /// Sum of the volumes' virtual sizes, in bytes.
    #[serde(default)]
    pub provisioned: u64,
    /// Overcommit ratio: `provisioned` may reach this many times `capacity` before
    /// volume creation and growth are refused without `force`.
    #[serde(default)]
    pub overcommit: f64,
    /// `capacity` in binary units, for people (e.g. "4.0G").
    pub capacity_human: String,
    /// Hot spares (device specs, in the order they are used).
    #[serde(default)]
    pub spares: Vec<String>,
    /// The running or last rebuild (only in `GET /v1/pools/NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildStatus>,
    /// The running or last resync after an unclean shutdown (only in `GET /v1/pools/NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resync: Option<ScrubStatus>,
    /// Deduplication, when the pool deduplicates (`pool create --dedup`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupInfo>,
}

/// A dedup pool's figures (docs/format.md §17). Counters count since the pool was opened.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DedupInfo {
    /// Whether writes are deduplicated now (`pool update --dedup on|off`). Off, blocks
    /// already shared stay shared, new writes are stored without a lookup, and new
    /// volumes are plain.
    pub enabled: bool,
    /// Bytes the volumes' map entries reference (what they would take without dedup;
    /// zero blocks and holes excluded).
    pub logical_bytes: u64,
    /// Bytes of store blocks referenced: what the data takes.
    pub physical_bytes: u64,
    /// `logical_bytes / physical_bytes` (1 when nothing is stored).
    pub ratio: f64,
    /// Bytes of store units held (referenced, free, and freed but not yet committed).
    pub store_bytes: u64,
    /// Blocks written that shared a stored block.
    pub hits: u64,
    /// Blocks written that took a new store block.
    pub new_blocks: u64,
    /// All-zero blocks written (stored as holes, never looked up).
    pub zero_blocks: u64,
    /// Blocks written without a lookup: small random writes in regions where lookups
    /// were finding nothing (the gain detector).
    pub skipped_blocks: u64,
    /// Blocks written without a lookup because dedup was off.
    pub off_blocks: u64,
    /// Regions (1 GiB of a volume) that skip lookups now.
    pub skipping_regions: u64,
    /// Index candidates whose bytes differed from the block written.
    pub compare_mismatches: u64,
    /// Index lookups, and those its RAM filter answered with no I/O.
    pub index_lookups: u64,
    pub index_filtered: u64,
    /// Lookups whose 16-bit short fingerprint matched an entry whose full one did not.
    pub short_collisions: u64,
    pub index_entries: u64,
    pub index_buckets: u64,
    /// The index's bytes on the pool's devices, and its RAM (short fingerprints).
    pub index_device_bytes: u64,
    pub index_ram_bytes: u64,
    /// RAM held by map and refcount pages.
    pub page_ram_bytes: u64,
}

impl PoolInfo {
    /// Is any device failed, or the pool not fully online?
    pub fn is_degraded(&self) -> bool {
        self.state != PoolState::Online || self.device_states.iter().any(DeviceState::is_failed)
    }
}

/// A pool listed in the registry that the node could not open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OfflinePool {
    pub name: String,
    /// Always "offline".
    pub state: PoolState,
    /// Why it could not be opened.
    pub error: String,
}

/// An entry of `GET /v1/pools`: an open pool, or one that could not be opened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum PoolEntry {
    Online(Box<PoolInfo>),
    Offline(OfflinePool),
}

impl PoolEntry {
    pub fn name(&self) -> &str {
        match self {
            PoolEntry::Online(p) => &p.name,
            PoolEntry::Offline(p) => &p.name,
        }
    }

    pub fn state(&self) -> PoolState {
        match self {
            PoolEntry::Online(p) => p.state,
            PoolEntry::Offline(p) => p.state,
        }
    }
}

/// `POST /v1/pools`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatePool {
    pub name: String,
    /// Device specs: /path, /path:SIZE, ram:SIZE, null:SIZE, fault:INNER;key=value...
    pub devices: Vec<String>,
    /// concat (default), raid0, raid1[:COPIES], raid10[:COPIES], raid5, raid6 or ec:K+M.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub layout: Option<LayoutSpec>,
    /// Mirrors: copies of each block (raid1 and raid10 without copies in `layout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copies: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe_size: Option<SizeArg>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit_size: Option<SizeArg>,
    /// Overwrite devices that carry another pool's label.
    #[serde(default)]
    pub force: bool,
    /// Overcommit ratio (default 20): the volumes' virtual sizes may add up to this many
    /// times the capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit: Option<f64>,
    /// A cache tier on faster devices (one, or two that mirror each other).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache: Vec<String>,
    /// The cache's mode: write-through (default), write-around, pass-through or write-back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_mode: Option<String>,
    /// The cache unit: a power of two from 16K to 1M (default 1M).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_unit: Option<SizeArg>,
    /// Misses a unit needs before a full cache admits it (default 1: the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_admit_hits: Option<u8>,
    /// Deduplicate the volumes created in it (docs/format.md §17).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dedup: bool,
}

/// `POST /v1/pools/NAME/cache`: give the pool a cache tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CacheRequest {
    /// One device spec, or two (mirrored).
    pub devices: Vec<String>,
    /// write-through (default), write-around, pass-through or write-back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Take devices that carry another pool's cache label.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
    /// The cache unit: a power of two from 16K to 1M (default 1M). Smaller units keep
    /// scattered hot blocks in less cache, at more RAM per GiB of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<SizeArg>,
    /// Misses a unit needs before a full cache admits it (Open CAS's nhit; default 1,
    /// the first). 2 or 3 keep units read once (a scan the detector did not call
    /// sequential) out of a full cache, and admit the hot ones a miss or two later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admit_hits: Option<u8>,
}

/// `PATCH /v1/pools/NAME/cache`: switch the mode online.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CacheModeRequest {
    pub mode: String,
    /// Into write-back on one cache device (its failure would lose the writes only it
    /// holds).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `GET /v1/pools/NAME/cache`: the tier and its counters since it was attached (or
/// since the node started).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CacheInfo {
    pub pool: String,
    pub devices: Vec<String>,
    pub mode: String,
    /// Misses a unit needs before the full cache admits it (1: the first).
    #[serde(default)]
    pub admit_hits: u8,
    /// ok, degraded (a mirrored tier lost a device), draining (a switch out of
    /// write-back: dirty data is being copied to the pool's devices first), failed
    /// (requests go uncached), "failed, dirty data lost" (write-back data that was on
    /// the failed devices only: reads of it fail), or missing (the registry lists
    /// devices that could not be opened at start).
    pub state: String,
    pub capacity: u64,
    pub unit_size: u64,
    pub cached_units: u64,
    pub valid_bytes: u64,
    /// Write-back: bytes the pool's devices do not have yet.
    pub dirty_bytes: u64,
    /// Write-back: bytes the cleaner copied to the pool's devices.
    #[serde(default)]
    pub cleaned_bytes: u64,
    pub read_hits: u64,
    pub read_misses: u64,
    /// read_hits / (read_hits + read_misses), 0 before any read.
    pub read_hit_ratio: f64,
    pub read_hit_bytes: u64,
    pub read_miss_bytes: u64,
    pub write_hits: u64,
    pub write_misses: u64,
    pub write_hit_ratio: f64,
    pub promotions: u64,
    pub evictions: u64,
    pub fill_bytes: u64,
    /// Bytes of requests the access-pattern detector called sequential, kept out of the
    /// cache.
    pub bypassed_bytes: u64,
    /// Bytes read ahead of sequential readers into the cache.
    pub prefetch_bytes: u64,
    pub errors: u64,
    /// RAM the tier's index and policy take.
    pub ram_bytes: u64,
}

/// `PATCH /v1/pools/NAME`: fields left out stay as they are.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct UpdatePool {
    /// New overcommit ratio (above 0; volumes already beyond it stay).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit: Option<f64>,
    /// Turn deduplication on or off. On takes the fingerprint index's space the first
    /// time (refused on layouts and pools that cannot have dedup). Off stops looking up
    /// new writes and makes new volumes plain; blocks already shared stay shared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<bool>,
}

/// `GET/POST/DELETE /v1/pools/NAME/spares`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpareList {
    pub pool: String,
    pub spares: Vec<String>,
}

/// `POST /v1/pools/NAME/spares`, and `DELETE` (or `?device=`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpareRequest {
    pub device: String,
    /// Adding: take a device that carries another pool's label, and wipe that label.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `POST /v1/pools/NAME/replace`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplaceRequest {
    /// Index of the failed device.
    pub device: usize,
    /// Spec of the device that takes its place.
    pub with: String,
    /// Take a device that carries another pool's label (its label is wiped).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// The reply to a replacement (by `pool replace` or by a hot spare).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplaceReply {
    pub pool: String,
    pub device: usize,
    /// The spec the slot had.
    pub replaced: String,
    pub with: String,
    /// Swapped in now (`false`: recorded, takes effect at the next node start).
    pub live: bool,
    /// The new device was a hot spare (only for a live replacement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare: Option<bool>,
    /// "rebuilding", or what happened instead.
    #[schema(value_type = String)]
    pub state: ReplaceState,
    /// The rebuild onto the new device, when it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildStatus>,
}

/// What became of a replacement (`state` of [`ReplaceReply`]). On the wire it is a
/// sentence: `rebuilding`, `recorded (WHY): restart the node; ...` or
/// `replaced; the rebuild did not start: ERROR`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum ReplaceState {
    /// Swapped in; the rebuild onto it runs.
    Rebuilding,
    /// Recorded only: the device could not be swapped live (`why`); it takes the slot,
    /// and is rebuilt, at the next node start.
    Recorded { why: String },
    /// Swapped in, but the rebuild did not start (`error`); the next start, or
    /// `pool rebuild`, starts it.
    RebuildNotStarted { error: String },
}

const RECORDED: (&str, &str) = (
    "recorded (",
    "): restart the node; the rebuild onto the new device then starts by itself",
);
const NOT_STARTED: &str = "replaced; the rebuild did not start: ";

impl std::fmt::Display for ReplaceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplaceState::Rebuilding => f.write_str("rebuilding"),
            ReplaceState::Recorded { why } => write!(f, "{}{why}{}", RECORDED.0, RECORDED.1),
            ReplaceState::RebuildNotStarted { error } => write!(f, "{NOT_STARTED}{error}"),
        }
    }
}

impl TryFrom<String> for ReplaceState {
    type Error = crate::Invalid;

    fn try_from(s: String) -> Result<ReplaceState, crate::Invalid> {
        if s == "rebuilding" {
            return Ok(ReplaceState::Rebuilding);
        }
        if let Some(why) = s
            .strip_prefix(RECORDED.0)
            .and_then(|r| r.strip_suffix(RECORDED.1))
        {
            return Ok(ReplaceState::Recorded { why: why.into() });
        }
        if let Some(error) = s.strip_prefix(NOT_STARTED) {
            return Ok(ReplaceState::RebuildNotStarted {
                error: error.into(),
            });
        }
        Err(crate::Invalid::ReplaceState(s))
    }
}

impl From<ReplaceState> for String {
    fn from(s: ReplaceState) -> String {
        s.to_string()
    }
}

/// `POST /v1/pools/NAME/rebuild`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebuildRequest {
    /// Device index (default: the only failed device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<usize>,
    /// Rebuild `device` even if it is healthy.
    #[serde(default)]
    pub force: bool,
}

/// `POST /v1/pools/NAME/scrub`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScrubRequest {
    /// Rewrite mirror copies that differ from the first readable one (default true).
    #[serde(default = "yes")]
    pub repair: bool,
}

impl Default for ScrubRequest {
    fn default() -> ScrubRequest {
        ScrubRequest { repair: true }
    }
}

fn yes() -> bool {
    true
}
