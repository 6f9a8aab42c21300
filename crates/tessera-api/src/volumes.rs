//! `/v1/volumes`: thin volumes, their QoS and their I/O statistics.

use crate::qos::QosLimits;
use serde::{Deserialize, Serialize};

use crate::SizeArg;

wire_state! {
    /// A replica's state.
    pub enum ReplicaState {
        /// Holds every write.
        InSync => "in_sync",
        /// Lacks some writes (`dirty_bytes`), no resync running.
        Degraded => "degraded",
        /// Being brought in sync.
        Resyncing => "resyncing",
        /// Degraded and unreachable (or its last I/O failed).
        Failed => "failed",
    }
}

/// `GET /v1/volumes/NAME`, and the entries of `GET /v1/volumes`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VolumeInfo {
    pub name: String,
    pub pool: String,
    /// The volume's ID in its pool.
    pub id: u32,
    /// Virtual size in bytes.
    pub size: u64,
    /// Bytes of pool space it holds.
    pub allocated: u64,
    /// Names of the NBD exports of this volume.
    pub exports: Vec<String>,
    /// Open handles (client connections).
    pub connections: usize,
    /// Unix time of creation.
    pub created: u64,
    pub qos: QosLimits,
    /// The QoS group it belongs to.
    pub group: Option<String>,
    /// A read-only snapshot (exports of it refuse writes).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot: bool,
    /// The snapshot it reads through where it has no data of its own (a volume after a
    /// snapshot, a clone, an older snapshot's successor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// A replicated volume's replicas (absent for a volume of this node only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<ReplicaInfo>>,
    /// A dedup volume: its blocks are references into its pool's dedup store
    /// (docs/format.md §17). Its writes are looked up while the pool has dedup on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dedup: bool,
}

/// One replica of a replicated volume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaInfo {
    /// `NODE:POOL` (`local:POOL` for the owner's own).
    pub place: String,
    /// The thin volume holding it, on that node.
    pub volume: String,
    /// `in_sync`, `degraded` (lacks `dirty_bytes`), `resyncing`, or `failed` (degraded
    /// and unreachable).
    pub state: ReplicaState,
    pub local: bool,
    pub connected: bool,
    /// Bytes it lacks (whole dirty regions).
    pub dirty_bytes: u64,
    pub resync_percent: Option<f64>,
    pub resync_rate_bytes_per_sec: Option<f64>,
    pub resync_eta_secs: Option<f64>,
    /// Bytes of regions resyncs brought in sync since the owner started (each region
    /// once per resync).
    pub resync_copied_bytes_total: u64,
    /// Bytes copied again because clients wrote a region while it was being copied.
    pub resync_recopied_bytes_total: u64,
    pub resync_regions_total: u64,
    pub last_error: Option<String>,
}

/// `POST /v1/replicas` (node to node): make a thin volume of this node a replica of a
/// volume another node owns, exported to it over NVMe/TCP.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateReplica {
    /// Name of the replica's volume on this node.
    pub volume: String,
    pub pool: String,
    pub size: u64,
    /// The owning node's name.
    pub owner: String,
    /// The replica must start empty (a replica added to a volume with data: its copy
    /// skips the source's holes): a volume of that name already here is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fresh: bool,
}

/// `POST /v1/volumes/NAME/replicas`: give a volume one more replica, on another node. A
/// volume that is not replicated yet becomes so (it must not be in use).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AddReplica {
    /// `NODE:POOL`: a `[[peer]]` of this node and one of its pools.
    pub replica: String,
}

/// The answer to `DELETE /v1/volumes/NAME/replicas/NODE:POOL`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RemovedReplica {
    pub volume: String,
    /// `NODE:POOL` of the replica removed.
    pub replica: String,
    /// The replica's volume on that node.
    pub replica_volume: String,
    /// Whether that node deleted it; if not, `note` says why and what to do.
    pub replica_volume_deleted: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The answer to `POST /v1/replicas`: where the owner reaches the replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaTarget {
    pub volume: String,
    /// `nvme-tcp://HOST:PORT/NQN?nsid=1`.
    pub spec: String,
}

/// `POST /v1/volumes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateVolume {
    pub name: String,
    /// The pool (of this node) to create it in; with `replicas`, leave it empty.
    #[serde(default)]
    pub pool: String,
    pub size: SizeArg,
    /// Replicate it: `NODE:POOL` per replica (this node's own name for its local one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Replicate it on this many nodes of the cluster, placed by free capacity and
    /// failure domain (this node holds one); instead of `replicas` and `pool`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_count: Option<u32>,
    /// Create it even if the pool's volumes then exceed its overcommit ratio.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
    /// Whether it deduplicates: left out, it follows its pool (a pool with dedup on makes
    /// dedup volumes); `false` opts a volume of a dedup pool out (a plain thin volume,
    /// for data that does not repeat); `true` is refused where the pool has dedup off.
    /// Not with `replicas` or `replica_count`: replicas follow their pools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<bool>,
}

/// `PATCH /v1/volumes/NAME`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResizeVolume {
    pub size: SizeArg,
    /// Grow it even if the pool's volumes then exceed its overcommit ratio.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// Latency over a stats window, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LatencyWindow {
    pub requests: u64,
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
}

/// Totals since the node started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IoTotals {
    pub reads: u64,
    pub writes: u64,
    pub others: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub throttled_ms: f64,
    /// Cost units (a 4 KiB request is 1) dispatched in core rounds that this volume and
    /// another one both wanted more of: the work share weights split. Two saturated
    /// volumes on one core have shared units in the proportion of their weights.
    #[serde(default)]
    pub shared_units: u64,
    /// Times a request waited for the next round because the volume had used its share.
    #[serde(default)]
    pub share_deferrals: u64,
}

/// `GET /v1/volumes/NAME/stats?interval_ms=N`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VolumeStats {
    pub volume: String,
    pub interval_ms: u64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub other_iops: f64,
    pub read_mibps: f64,
    pub write_mibps: f64,
    pub errors: u64,
    pub throttled_ms: f64,
    pub latency_us: LatencyWindow,
    pub totals: IoTotals,
}
