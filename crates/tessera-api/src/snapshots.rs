//! `/v1/snapshots`, `/v1/clones` and the chain operations on volumes: snapshots, clones,
//! rollback and the changed extents an incremental backup reads.

use serde::{Deserialize, Serialize};

/// `GET /v1/snapshots` entries, and the reply to `POST /v1/snapshots`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotInfo {
    pub name: String,
    pub pool: String,
    /// Its ID in the pool (a snapshot is a read-only volume).
    pub id: u32,
    /// Unix time of creation.
    pub created: u64,
    /// Virtual size in bytes (the volume's when it was taken).
    pub size: u64,
    /// The older snapshot it reads through, if any.
    pub parent: Option<String>,
    /// The volumes, clones and snapshots that read through it.
    pub children: Vec<String>,
    /// Bytes only this snapshot holds: given back when it is deleted.
    pub exclusive: u64,
    /// Bytes of this snapshot that a child still reads.
    pub shared: u64,
    /// Reply to a create on a replicated volume: the replicas (`NODE:POOL`) that hold a
    /// copy of the snapshot, all taken at one point of the write stream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Reply to a create on a replicated volume: the replicas without a copy, and why
    /// (out of sync at the point, or their node refused).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
}

/// `POST /v1/replicas/VOLUME/snapshots` (owner to replica holder): a snapshot of the
/// replica, taken while the owner holds the volume's writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaSnapshot {
    pub name: String,
    /// The node that owns the replicated volume (checked against the replica's fence).
    pub owner: String,
}

/// Reply to `DELETE /v1/snapshots/NAME`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeletedSnapshot {
    pub deleted: String,
    /// For a snapshot of a replicated volume: the replicas whose copy could not be
    /// deleted, and why (it stays there until deleted on that node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_deleted: Vec<String>,
}

/// `POST /v1/snapshots`: a snapshot `name` of `volume`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateSnapshot {
    pub volume: String,
    pub name: String,
}

/// `POST /v1/snapshot-groups`: snapshots of several volumes of one pool at one point in
/// time (no write acknowledged on one after the point and missing on another).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateSnapshotGroup {
    pub snapshots: Vec<CreateSnapshot>,
}

/// `POST /v1/clones`: a writable volume `name` sharing the data of `snapshot`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CloneVolume {
    pub snapshot: String,
    pub name: String,
    /// Create it even if the pool's volumes then exceed its overcommit ratio.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `POST /v1/volumes/NAME/rollback`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Rollback {
    /// The snapshot of the volume to go back to.
    pub to: String,
}

/// One byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Extent {
    pub offset: u64,
    pub length: u64,
}

/// `GET /v1/volumes/NAME/changes?since=SNAP`: the ranges of volume (or snapshot) NAME
/// that may differ from its older snapshot SNAP, sorted and merged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChangedExtents {
    pub volume: String,
    pub since: String,
    pub size: u64,
    /// Bytes in `extents`.
    pub changed: u64,
    pub extents: Vec<Extent>,
}
