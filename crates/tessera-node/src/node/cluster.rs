//! This node as a member of a cluster (`[cluster]`, docs/architecture.md "Cluster"):
//! joining under a lease with a record of where it is and what it has, the cluster view
//! (`GET /v1/cluster`), other members as peers for replicas, placement of a new volume's
//! replicas, and the volume specs in etcd.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

use tessera_api::{ClusterNode, ClusterPool, ClusterStatus, ClusterVolume};
use tessera_cluster::{
    placement, read_password_file, volume_key, Etcd, EtcdOptions, Membership, MembershipConfig,
};
use tracing::{info, warn};

use super::{Error, Node, Result};
use crate::config::PeerDecl;

/// The cluster service's state: the membership once joined, the volumes this node owns
/// with the epoch it holds, and the stale copies of given-up volumes still to delete.
/// Each part has its own lock, none held while another is taken or while etcd is asked.
/// The operations on it are the `Node` methods of this file (joining, the cluster view,
/// specs), node/ownership.rs (the owner's side: publishing under its epoch, confirming
/// at join) and node/failover.rs (the watcher: take-over, give-up, re-adding and
/// replacing lost replicas); they need the pools, the replicas and the exports too.
#[derive(Default)]
pub struct Cluster {
    /// Membership of the cluster (`[cluster]`), once joined.
    membership: OnceLock<Arc<Membership>>,
    /// Cluster volumes this node owns, with the epoch it holds.
    owned: Mutex<BTreeMap<String, u64>>,
    /// Given-up volumes whose stale copy was still in use, by volume: local volume.
    stale_copies: Mutex<BTreeMap<String, String>>,
}

impl Cluster {
    /// The membership, when this node is in a cluster.
    pub fn membership(&self) -> Option<&Arc<Membership>> {
        self.membership.get()
    }

    /// The node joined: set once (a second join keeps the first).
    fn joined(&self, m: Arc<Membership>) {
        let _ = self.membership.set(m);
    }

    /// The epoch at which this node owns `volume`, if it does.
    pub fn owned_epoch(&self, volume: &str) -> Option<u64> {
        self.owned.locked().get(volume).copied()
    }

    /// This node owns `volume` at `epoch` from now on (`None`: no longer).
    pub(super) fn set_owned(&self, volume: &str, epoch: Option<u64>) {
        let mut o = self.owned.locked();
        match epoch {
            Some(e) => o.insert(volume.to_string(), e),
            None => o.remove(volume),
        };
    }

    /// Given-up `volume`'s stale copy `local` is still in use: delete it later.
    pub(super) fn keep_stale(&self, volume: &str, local: &str) {
        self.stale_copies
            .locked()
            .insert(volume.to_string(), local.to_string());
    }

    /// The stale copies still to delete, as (volume, local volume).
    pub(super) fn stale(&self) -> Vec<(String, String)> {
        self.stale_copies
            .locked()
            .iter()
            .map(|(a, b)| (a.clone(), b.clone()))
            .collect()
    }

    /// Given-up `volume`'s stale copy is gone.
    pub(super) fn forget_stale(&self, volume: &str) {
        self.stale_copies.locked().remove(volume);
    }
}

impl Node {
    /// Join the cluster named in `[cluster]`, if any. Called once the listeners are up,
    /// so that the record says where they are. A node whose config names a cluster it
    /// cannot reach does not start (it would otherwise run alone without saying so).
    pub fn join_cluster(self: &Arc<Self>) -> Result<()> {
        let c = &self.cfg.cluster;
        if c.etcd.is_empty() {
            return Ok(());
        }
        let mut opts = EtcdOptions::new(Duration::from_millis(c.etcd_timeout_ms.max(100)));
        opts.ca = c.etcd_ca.clone();
        opts.cert = c.etcd_cert.clone();
        opts.key = c.etcd_key.clone();
        opts.user = c.etcd_user.clone();
        if let Some(f) = &c.etcd_password_file {
            opts.password = Some(
                read_password_file(f)
                    .map_err(|e| Error::invalid(format!("[cluster] etcd_password_file: {e}")))?,
            );
        }
        let etcd = Etcd::with_options(&c.etcd, opts)
            .map_err(|e| Error::invalid(format!("[cluster] etcd: {e}")))?;
        let weak = Arc::downgrade(self);
        let cfg = MembershipConfig {
            ttl: Duration::from_millis(c.lease_ttl_ms.max(2000)),
            ..MembershipConfig::default()
        };
        let record = Box::new(move || match weak.upgrade() {
            Some(n) => n.cluster_record(),
            None => ClusterNode::default(),
        });
        let m =
            Membership::join(etcd, cfg, record).map_err(|e| Error::io("joining the cluster", e))?;
        // Follow the specs and members by watches from now on (the ownership rounds
        // read them); a failure here is retried by the first round.
        if let Err(e) = m.follow() {
            warn!(error = %e, "cannot follow the cluster state yet");
        }
        self.cluster.joined(m);
        self.confirm_ownership();
        self.start_ownership_watch();
        Ok(())
    }

    /// This node's cluster membership and what it owns there.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub(super) fn in_cluster(&self) -> Result<&Arc<Membership>> {
        self.cluster.membership().ok_or_else(|| {
            Error::invalid("this node is not in a cluster ([cluster] etcd = [...] in its config)")
        })
    }

    /// What this node publishes about itself.
    fn cluster_record(&self) -> ClusterNode {
        let api = self.cfg.cluster.advertise_api.clone().unwrap_or_else(|| {
            let sock = self.cfg.api_socket();
            let abs = std::path::absolute(&sock).unwrap_or(sock);
            format!("unix:{}", abs.display())
        });
        let pools = self
            .pools()
            .list()
            .iter()
            .map(|p| {
                let i = self.pool_info(p);
                ClusterPool {
                    name: i.name,
                    size: i.capacity,
                    free: i.free,
                }
            })
            .collect();
        ClusterNode {
            name: self.cfg.node_name(),
            api,
            nvmf: self.cfg.nvmf.enabled.then(|| self.cfg.nvmf.listen.clone()),
            nbd: self.exports.nbd_addresses(),
            labels: self.cfg.cluster.labels.clone(),
            pools,
            started: std::time::SystemTime::now()
                .checked_sub(self.started.elapsed())
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs()),
        }
    }

    /// `GET /v1/cluster`.
    pub fn cluster_status(&self) -> Result<ClusterStatus> {
        let m = self.in_cluster()?;
        let nodes = m.nodes().map_err(|e| Error::io("reading the cluster", e))?;
        let volumes = self.cluster_volumes()?;
        Ok(ClusterStatus {
            name: m.name.clone(),
            etcd: self.cfg.cluster.etcd.clone(),
            lease_valid_ms: m.lease_valid_until().map(|t| {
                u64::try_from(t.saturating_duration_since(Instant::now()).as_millis())
                    .unwrap_or(u64::MAX)
            }),
            nodes,
            volumes,
        })
    }

    pub(super) fn cluster_volumes(&self) -> Result<Vec<ClusterVolume>> {
        let m = self.in_cluster()?;
        m.etcd()
            .list(&format!("{}volumes/", tessera_cluster::PREFIX))
            .map_err(|e| Error::io("reading the cluster", e))?
            .into_iter()
            .map(|kv| {
                serde_json::from_slice(&kv.value)
                    .map_err(|e| Error::Corrupt(format!("volume spec {} in etcd: {e}", kv.key)))
            })
            .collect()
    }

    /// The volume specs as this node's watch last delivered them (None: the watch is
    /// reconnecting).
    pub(super) fn cached_cluster_volumes(&self) -> Option<Result<Vec<ClusterVolume>>> {
        let m = self.cluster.membership()?;
        let kvs = m.cached_volumes()?;
        Some(
            kvs.into_iter()
                .map(|kv| {
                    serde_json::from_slice(&kv.value)
                        .map_err(|e| Error::Corrupt(format!("volume spec {} in etcd: {e}", kv.key)))
                })
                .collect(),
        )
    }

    /// A node replicas may go to: a `[[peer]]` of the config, else a live cluster member
    /// (reached at the API it publishes, with `[cluster] peer_token_file`/`peer_ca_cert`).
    pub(super) fn peer(&self, name: &str) -> Result<PeerDecl> {
        if let Some(p) = self.cfg.peers.iter().find(|p| p.name == name) {
            return Ok(p.clone());
        }
        if let Some(m) = self.cluster.membership() {
            let nodes = m.nodes().map_err(|e| Error::io("reading the cluster", e))?;
            return match nodes.into_iter().find(|n| n.name == name) {
                Some(n) => Ok(PeerDecl {
                    name: n.name,
                    api: n.api,
                    token_file: self.cfg.cluster.peer_token_file.clone(),
                    ca_cert: self.cfg.cluster.peer_ca_cert.clone(),
                }),
                None => Err(Error::invalid(format!(
                    "node '{name}' is not a live member of the cluster (tessera cluster nodes)"
                ))),
            };
        }
        Err(Error::invalid(format!(
            "no peer named '{name}' ([[peer]] in the config lists the nodes replicas may go to)"
        )))
    }

    /// Places for `count` replicas of a new volume owned by this node: this node first,
    /// then the emptiest members, spread over failure domains.
    pub fn place_replicas(&self, count: usize) -> Result<Vec<String>> {
        let m = self.in_cluster().map_err(|_| {
            Error::invalid(
                "a replica count needs a cluster ([cluster] etcd = [...]); without one, \
                 name the places: --replicas NODE:POOL,NODE:POOL",
            )
        })?;
        let nodes = m.nodes().map_err(|e| Error::io("reading the cluster", e))?;
        let me = self.cfg.node_name();
        let placed = placement::place(&nodes, count, &[me.as_str()], placement::DEFAULT_LEVELS)
            .map_err(|e| Error::Rejected(Box::new(e)))?;
        Ok(placed.iter().map(|p| p.to_string()).collect())
    }

    /// Claim `name` cluster-wide before anything is created: the spec is written with a
    /// create-only transaction, so two nodes cannot both create the volume.
    pub(super) fn claim_volume_spec(
        &self,
        name: &str,
        size: u64,
        replicas: &[String],
    ) -> Result<()> {
        let Some(m) = self.cluster.membership() else {
            return Ok(());
        };
        let spec = ClusterVolume {
            name: name.to_string(),
            size,
            replicas: replicas.to_vec(),
            owner: self.cfg.node_name(),
            epoch: 1,
            copies: replicas.len(),
            out_of_sync: Vec::new(),
            lost: Vec::new(),
            snapshot_intent: None,
            iscsi_pr: None,
        };
        let value = serde_json::to_vec(&spec).map_err(|e| Error::invalid(e.to_string()))?;
        match m.etcd().create(&volume_key(name), &value, 0) {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::already_exists(format!(
                "volume '{name}' already exists in the cluster (tessera cluster volumes)"
            ))),
            Err(e) => Err(Error::io("writing the volume spec to etcd", e)),
        }
    }

    /// The volume's replicas changed (added, removed): rewrite the spec's list with a
    /// compare-and-swap, keeping its owner and epoch; a volume that became replicated gets
    /// its spec now. A spec another node owns is left alone (this node lost the volume).
    /// etcd trouble is logged, not returned: the replica set file is the datapath's truth,
    /// and the spec catches up at the next change.
    pub(super) fn update_volume_spec_replicas(&self, name: &str, size: u64, replicas: &[String]) {
        let Some(m) = self.cluster.membership() else {
            return;
        };
        let key = volume_key(name);
        let me = self.cfg.node_name();
        for _ in 0..5 {
            let r = match m.etcd().get(&key) {
                Ok(None) => {
                    let spec = ClusterVolume {
                        name: name.to_string(),
                        size,
                        replicas: replicas.to_vec(),
                        owner: me.clone(),
                        epoch: 1,
                        copies: replicas.len(),
                        out_of_sync: Vec::new(),
                        lost: Vec::new(),
                        snapshot_intent: None,
                        iscsi_pr: None,
                    };
                    let value = serde_json::to_vec(&spec).unwrap_or_default();
                    m.etcd().create(&key, &value, 0)
                }
                Ok(Some(kv)) => {
                    let mut spec: ClusterVolume = match serde_json::from_slice(&kv.value) {
                        Ok(s) => s,
                        Err(e) => {
                            warn!(volume = %name, error = %e, "unreadable volume spec in etcd: not updated");
                            return;
                        }
                    };
                    if spec.owner != me {
                        warn!(volume = %name, owner = %spec.owner, epoch = spec.epoch,
                              "the volume's spec names another owner: not updated");
                        return;
                    }
                    spec.replicas = replicas.to_vec();
                    let value = serde_json::to_vec(&spec).unwrap_or_default();
                    m.etcd().swap(&key, kv.mod_revision, &value, 0)
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(true) => return,
                // Changed under us: read again.
                Ok(false) => continue,
                Err(e) => {
                    warn!(volume = %name, error = %e, "cannot update the volume spec in etcd");
                    return;
                }
            }
        }
        warn!(volume = %name, "the volume spec kept changing: not updated");
    }

    /// The volume is gone (or its creation failed): drop its spec.
    pub(super) fn release_volume_spec(&self, name: &str) {
        if let Some(m) = self.cluster.membership() {
            match m.etcd().delete(&volume_key(name)) {
                Ok(_) => info!(volume = %name, "volume spec removed from the cluster"),
                Err(e) => warn!(volume = %name, error = %e,
                                "cannot remove the volume spec from etcd: remove it by hand"),
            }
        }
    }

    /// Leave the cluster (node shutdown): the record goes at once.
    pub(super) fn leave_cluster(&self) {
        if let Some(m) = self.cluster.membership() {
            m.leave();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_and_stale_copies_are_kept_by_volume() {
        let c = Cluster::default();
        assert!(c.membership().is_none(), "not joined");
        assert_eq!(c.owned_epoch("v"), None);
        c.set_owned("v", Some(3));
        c.set_owned("w", Some(1));
        assert_eq!(c.owned_epoch("v"), Some(3));
        c.set_owned("v", Some(4));
        assert_eq!(c.owned_epoch("v"), Some(4), "a take-over raises the epoch");
        c.set_owned("v", None);
        assert_eq!(c.owned_epoch("v"), None);
        assert_eq!(c.owned_epoch("w"), Some(1), "only the given-up volume goes");

        assert!(c.stale().is_empty());
        c.keep_stale("v", "v.n1");
        c.keep_stale("x", "x");
        assert_eq!(
            c.stale(),
            vec![
                ("v".to_string(), "v.n1".to_string()),
                ("x".into(), "x".into())
            ]
        );
        c.forget_stale("v");
        assert_eq!(c.stale(), vec![("x".to_string(), "x".to_string())]);
    }
}
