//! The cluster (`GET /v1/cluster`): the members and volume specs kept in etcd. These are
//! also the records stored there (crate `tessera-cluster`, docs/format.md "Cluster state
//! in etcd").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `GET /v1/cluster`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterStatus {
    /// This node's name.
    pub name: String,
    /// The etcd members it was given.
    pub etcd: Vec<String>,
    /// How long this node's lease surely holds from now (milliseconds); absent when it
    /// may have expired (etcd unreachable for longer than the TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_valid_ms: Option<u64>,
    /// Live members (their lease holds), by name.
    pub nodes: Vec<ClusterNode>,
    /// Every volume spec in the cluster, by name.
    pub volumes: Vec<ClusterVolume>,
}

/// What a node publishes about itself (under its lease).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterNode {
    pub name: String,
    /// How other nodes reach its management API (`unix:PATH` on one machine, or
    /// `https://HOST:PORT`).
    pub api: String,
    /// Its NVMe/TCP listener (`HOST:PORT`), if it serves NVMe/TCP.
    #[serde(default)]
    pub nvmf: Option<String>,
    /// Its NBD listeners (`nbd://HOST:PORT`).
    #[serde(default)]
    pub nbd: Vec<String>,
    /// Failure-domain labels, e.g. `zone`, `rack`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub pools: Vec<ClusterPool>,
    /// Unix time (seconds) the node process started.
    #[serde(default)]
    pub started: u64,
}

/// One pool of a node, as placement sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterPool {
    pub name: String,
    /// Usable bytes.
    pub size: u64,
    /// Bytes not allocated to any volume.
    pub free: u64,
}

/// A volume's cluster-wide spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterVolume {
    pub name: String,
    pub size: u64,
    /// `NODE:POOL` of each replica.
    pub replicas: Vec<String>,
    /// The node that serves the volume (writes go through it).
    pub owner: String,
    /// Bumped at every change of owner; replicas refuse writes from an older epoch.
    pub epoch: u64,
    /// The number of replicas wanted (0: as many as `replicas` lists).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub copies: usize,
    /// Replicas of `replicas` that may lack an acknowledged write (dropped by the owner,
    /// or being copied): not eligible to take the volume over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub out_of_sync: Vec<String>,
    /// Replicas whose node was lost, waiting to be re-added (the node is back within the
    /// grace period) or replaced elsewhere (after it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<LostReplica>,
    /// A snapshot whose copies the owner is taking on the replicas (written before it
    /// asks any replica, removed once every copy is taken): while it is here the
    /// snapshot is not promised, and an owner that finds it outside its own snapshot
    /// create (after a takeover, or a create cut off) deletes its copies and removes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_intent: Option<SnapshotIntent>,
    /// The volume's iSCSI persistent reservation state (registrations and the
    /// reservation; docs/format.md §15's bytes, in hex), saved by the owner at every
    /// change so that it follows the volume to a new owner; absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iscsi_pr: Option<String>,
}

/// A snapshot create in progress on a replicated volume (docs/format.md §12).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotIntent {
    /// The snapshot's name.
    pub name: String,
    /// The owner's epoch when it started.
    pub epoch: u64,
    /// `NODE:POOL` of the replicas that may hold a copy (the owner's first); those whose
    /// copy was deleted leave the list.
    pub replicas: Vec<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A replica taken out of a volume's set because its node was lost.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LostReplica {
    /// `NODE:POOL`.
    pub place: String,
    /// Unix milliseconds when the owner noticed.
    pub since_ms: u64,
}

impl ClusterVolume {
    /// The replica count wanted.
    pub fn wanted_copies(&self) -> usize {
        if self.copies == 0 {
            self.replicas.len() + self.lost.len()
        } else {
            self.copies
        }
    }

    /// Whether the replica on `node` holds every acknowledged write (rule 4 of
    /// docs/format.md §12).
    pub fn in_sync_on(&self, node: &str) -> bool {
        self.replicas
            .iter()
            .find(|p| p.split(':').next() == Some(node))
            .is_some_and(|p| !self.out_of_sync.contains(p))
    }

    /// The place (`NODE:POOL`) of the replica on `node`.
    pub fn place_on(&self, node: &str) -> Option<&str> {
        self.replicas
            .iter()
            .find(|p| p.split(':').next() == Some(node))
            .map(|s| s.as_str())
    }
}

/// `POST /v1/replicas/{volume}/claim`: an owner (new, or confirming) claims a replica
/// this node holds, at its epoch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClaimReplica {
    /// The owning node's name.
    pub owner: String,
    /// Its ownership epoch (from the volume's spec).
    pub epoch: u64,
}

/// The replica's fence after a claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReplicaFence {
    pub volume: String,
    /// The owner whose writes the replica takes, and its epoch: the highest seen.
    pub owner: String,
    pub epoch: u64,
    /// Controllers of other hosts (older owners) ended by this claim.
    pub evicted: usize,
    /// Where the owner reaches the replica (`nvme-tcp://HOST:PORT/NQN/NSID`).
    #[serde(default)]
    pub spec: Option<String>,
}
