//! Tessera's cluster state, kept in etcd (docs/architecture.md "Cluster").
//!
//! A node started with `[cluster] etcd = [...]` registers itself under a lease
//! ([`membership`]), publishing where its API and exports are, its failure-domain labels
//! and its pools' free capacity; it vanishes from the cluster when the lease expires.
//! Volumes created with a replica count are placed by [`placement`] and their spec (size,
//! replicas, owner, epoch) is written under [`volume_key`] with a create-only
//! transaction, so a name is taken once cluster-wide. Without `[cluster]` none of this
//! runs: a single node needs no etcd.
//!
//! Key layout (every value is JSON; `PREFIX` is `/tessera/v1/`):
//! - `PREFIX/nodes/NAME`: [`NodeRecord`], attached to the node's lease.
//! - `PREFIX/volumes/NAME`: [`VolumeSpec`], no lease (it outlives its owner).
//!
//! The datapath never calls etcd: a running volume keeps serving I/O when etcd is down.

pub mod etcd;
pub mod membership;
pub mod placement;

pub use etcd::{
    read_password_file, Etcd, EtcdError, EtcdOptions, Kv, PrefixCache, Secret, Watch, WatchEvent,
    WatchHandle,
};
pub use membership::{Membership, MembershipConfig};
pub use placement::{place, Placed};
/// The records kept in etcd are the API's types: what `GET /v1/cluster` shows is what
/// etcd holds.
pub use tessera_api::{
    ClusterNode as NodeRecord, ClusterPool as PoolRecord, ClusterVolume as VolumeSpec,
};

/// Where Tessera's keys live in etcd (a version in the path leaves room for a new layout).
pub const PREFIX: &str = "/tessera/v1/";

/// The key of node `name`'s record.
pub fn node_key(name: &str) -> String {
    format!("{PREFIX}nodes/{name}")
}

/// The key of volume `name`'s spec.
pub fn volume_key(name: &str) -> String {
    format!("{PREFIX}volumes/{name}")
}

/// A node's failure domain at `level` (`zone`, `rack`, ...): its label, else the node
/// itself (a node without the label is a domain of its own).
pub fn domain(n: &NodeRecord, level: &str) -> String {
    n.labels
        .get(level)
        .map(|v| format!("{level}={v}"))
        .unwrap_or_else(|| format!("node={}", n.name))
}

/// A node's emptiest pool (most free bytes; by name on a tie).
pub fn best_pool(n: &NodeRecord) -> Option<&PoolRecord> {
    n.pools
        .iter()
        .max_by_key(|p| (p.free, std::cmp::Reverse(&p.name)))
}
