//! Ownership of cluster volumes, the owner's side (issue 13; docs/architecture.md
//! "Cluster", rules in docs/format.md §12); the watcher that takes volumes over and
//! gives them up is node/failover.rs, the state both use is [`super::Cluster`].
//!
//! An owner holds its volumes at an epoch ([`super::Cluster::owned_epoch`]). Every change
//! of a volume's replica states goes to the spec in etcd as a compare-and-swap that only
//! succeeds while the spec still names this node at that epoch: dropping an in-sync
//! replica (the persister asks [`SpecFence::before_drop`] before it acknowledges any
//! write without it) and a replica back in sync. A volume this node makes is owned at
//! the epoch of the spec it wrote and exported under its name; the volumes opened at
//! start are held back until the cluster confirms their owner at join.
//!
//! The exports a cluster volume gets or loses here and in failover.rs are changed on
//! the pool directly, without `Node::add_export`: every caller already holds the admin
//! lock (create, add/remove replica, take-over, give-up), and [`Node::find_export`]
//! checks the name across the pools first.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tessera_api::ClusterVolume;
use tessera_cluster::{volume_key, Membership, PREFIX};
use tessera_replica::{FenceError, LegDesc, LegFence, ReplicatedVolume};
use tracing::{error, info, warn};

use super::{Error, Node, Result};

/// Why a change of an owned volume's spec did not happen.
pub(super) enum SpecRefusal {
    /// Another node owns the volume, or this node at another epoch: it must stop.
    Lost(String),
    /// etcd did not answer (or kept changing): try again.
    Unavailable(String),
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn node_of(place: &str) -> &str {
    place.split(':').next().unwrap_or(place)
}

pub(super) fn rebuild_key(volume: &str) -> String {
    format!("{PREFIX}rebuilds/{volume}")
}

/// The persister's link to the volume's spec (see the module documentation).
struct SpecFence {
    node: Weak<Node>,
}

impl LegFence for SpecFence {
    fn before_drop(&self, volume: &str, place: &str) -> std::result::Result<(), FenceError> {
        let Some(node) = self.node.upgrade() else {
            return Err(FenceError::Stopping);
        };
        let wait = Duration::from_millis(node.cfg.cluster.fence_wait_ms.max(100));
        let deadline = Instant::now() + wait;
        loop {
            let r = node.edit_owned_spec(volume, |s| {
                if !s.out_of_sync.iter().any(|p| p == place) {
                    s.out_of_sync.push(place.to_string());
                }
            });
            match r {
                Ok(()) => {
                    info!(volume = %volume, replica = %place, "replica recorded out of sync in the cluster");
                    return Ok(());
                }
                Err(SpecRefusal::Lost(why)) => {
                    node.give_up_later(volume, &why);
                    return Err(FenceError::Lost(why));
                }
                Err(SpecRefusal::Unavailable(why)) => {
                    if Instant::now() >= deadline {
                        return Err(FenceError::NotRecorded { wait, why });
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    fn after_in_sync(&self, volume: &str, _place: &str) {
        let node = self.node.clone();
        let volume = volume.to_string();
        // Off the persister: etcd may be slow. Until it is recorded, the replica only
        // counts as out of sync, which is the safe side.
        let _ = std::thread::Builder::new()
            .name("tessera-spec".into())
            .spawn(move || {
                if let Some(n) = node.upgrade() {
                    for _ in 0..20 {
                        match n.publish_replica_states(&volume) {
                            Err(SpecRefusal::Unavailable(_)) => {
                                std::thread::sleep(Duration::from_millis(500))
                            }
                            _ => break,
                        }
                    }
                    if let Some(m) = n.cluster().membership() {
                        let _ = m.etcd().delete(&rebuild_key(&volume));
                    }
                }
            });
    }
}

impl Node {
    pub(super) fn read_spec(
        &self,
        m: &Membership,
        volume: &str,
    ) -> Result<Option<(ClusterVolume, i64)>> {
        match m.etcd().get(&volume_key(volume)) {
            Ok(None) => Ok(None),
            Ok(Some(kv)) => serde_json::from_slice(&kv.value)
                .map(|s| Some((s, kv.mod_revision)))
                .map_err(|e| Error::Corrupt(format!("volume spec {} in etcd: {e}", kv.key))),
            Err(e) => Err(Error::io("reading the volume spec", e)),
        }
    }

    /// Change the spec of a volume this node owns (compare-and-swap, rule 3 of
    /// docs/format.md §12): refused when the spec names another owner or epoch.
    pub(super) fn edit_owned_spec(
        &self,
        volume: &str,
        edit: impl Fn(&mut ClusterVolume),
    ) -> std::result::Result<(), SpecRefusal> {
        let Some(m) = self.cluster.membership() else {
            return Err(SpecRefusal::Unavailable(
                "not joined to the cluster yet".into(),
            ));
        };
        let Some(epoch) = self.cluster.owned_epoch(volume) else {
            return Err(SpecRefusal::Lost(format!(
                "this node does not own volume '{volume}'"
            )));
        };
        let me = self.cfg.node_name();
        for _ in 0..5 {
            let (mut spec, rev) = match self.read_spec(m, volume) {
                Ok(Some(s)) => s,
                Ok(None) => {
                    return Err(SpecRefusal::Lost(format!(
                        "volume '{volume}' has no spec in the cluster"
                    )))
                }
                Err(e) => return Err(SpecRefusal::Unavailable(e.to_string())),
            };
            if spec.owner != me || spec.epoch != epoch {
                return Err(SpecRefusal::Lost(format!(
                    "volume '{volume}' is owned by '{}' at epoch {} (this node held epoch {epoch})",
                    spec.owner, spec.epoch
                )));
            }
            let before = spec.clone();
            edit(&mut spec);
            if spec == before {
                return Ok(());
            }
            let value = serde_json::to_vec(&spec).unwrap_or_default();
            match m.etcd().swap(&volume_key(volume), rev, &value, 0) {
                Ok(true) => return Ok(()),
                Ok(false) => continue,
                Err(e) => return Err(SpecRefusal::Unavailable(e.to_string())),
            }
        }
        Err(SpecRefusal::Unavailable("the spec kept changing".into()))
    }

    /// The replica places of an owned volume as its replica set has them (the local one
    /// first) and those not in sync.
    pub(super) fn replica_places(&self, rv: &ReplicatedVolume) -> (Vec<String>, Vec<String>) {
        let me = self.cfg.node_name();
        let mut places = Vec::new();
        for d in rv.descs() {
            match d {
                LegDesc::Local { pool, .. } => places.insert(0, format!("{me}:{pool}")),
                LegDesc::Remote { node, pool, .. } => places.push(format!("{node}:{pool}")),
                LegDesc::Vacant => {}
            }
        }
        let out = rv
            .leg_sync_states()
            .into_iter()
            .filter(|(_, ok)| !ok)
            .map(|(p, _)| p)
            .collect();
        (places, out)
    }

    /// Write an owned volume's replicas and their sync states to its spec.
    pub(super) fn publish_replica_states(
        &self,
        volume: &str,
    ) -> std::result::Result<(), SpecRefusal> {
        let rv = self.replicas.get(volume);
        let Some(rv) = rv else {
            return Err(SpecRefusal::Lost(format!(
                "volume '{volume}' is not open here"
            )));
        };
        let (places, out) = self.replica_places(&rv);
        self.edit_owned_spec(volume, |s| {
            // A place that left the set (removed) is no longer listed; one that came
            // back (re-added) leaves `lost`.
            s.lost.retain(|l| !places.contains(&l.place));
            s.replicas = places.clone();
            s.out_of_sync = out.clone();
        })
    }

    /// This node's NVMe/TCP path of cluster volume `volume` (`nqn...:cluster:VOLUME`,
    /// ANA, docs/architecture.md "NVMe/TCP target"): Optimized and backed by the local
    /// replica on the owner, Inaccessible without data elsewhere. Changed only when it
    /// differs (a change sends hosts an ANA notice).
    ///
    /// On a node serving iSCSI, the volume's iSCSI path follows the same way
    /// ([`Node::set_iscsi_cluster_path`]: active/optimized or standby, ALUA).
    pub(super) fn set_cluster_path(&self, volume: &str, owner: bool, size: u64) {
        if self.iscsi_serves() {
            if let Err(e) = self.set_iscsi_cluster_path(volume, owner, size) {
                warn!(volume = %volume, owner, error = %e, "cannot set the volume's iSCSI cluster path");
            }
        }
        if !self.cfg.nvmf.enabled {
            return;
        }
        let now = self
            .cluster_paths()
            .into_iter()
            .find(|(v, _, _)| v == volume)
            .map(|(_, backed, _)| backed);
        if now == Some(owner) {
            return;
        }
        let path = if owner {
            super::ClusterPath::Owner
        } else {
            super::ClusterPath::Standby { size }
        };
        if let Err(e) = self.export_cluster_path(volume, path) {
            warn!(volume = %volume, owner, error = %e, "cannot set the volume's NVMe/TCP cluster path");
        }
    }

    /// [`Node::publish_replica_states`], a failure logged (the watcher catches up).
    pub(super) fn publish_replica_states_logged(&self, volume: &str) {
        if let Err(SpecRefusal::Lost(why) | SpecRefusal::Unavailable(why)) =
            self.publish_replica_states(volume)
        {
            warn!(volume = %volume, reason = %why, "the volume's spec was not updated");
        }
    }

    /// Put an owned replicated volume under the cluster's fence: for writes (dropping a
    /// replica needs the spec), and for reads (the read lease).
    pub(super) fn fence_volume(&self, rv: &Arc<ReplicatedVolume>) {
        if let Some(me) = self.self_ref.get() {
            rv.set_leg_fence(Arc::new(SpecFence { node: me.clone() }));
        }
        rv.set_read_lease(self.read_lease());
    }

    /// The read lease of owned volumes (tessera_replica::lease): half the ownership lease
    /// as etcd grants it (whole seconds, at least 2). An owner cut off from etcd and its
    /// replicas stops serving reads within it, before its ownership lease can expire.
    pub(super) fn read_lease(&self) -> Duration {
        let ttl_s = (self.cfg.cluster.lease_ttl_ms.max(2000) / 1000).max(2);
        Duration::from_millis(ttl_s * 1000 / 2)
    }

    /// A replicated volume this node just made (created, or a plain one replicated) is
    /// owned at the epoch of the spec it wrote.
    pub(super) fn own_new_volume(&self, volume: &str) {
        let Some(m) = self.cluster.membership() else {
            return;
        };
        match self.read_spec(m, volume) {
            Ok(Some((spec, _))) if spec.owner == self.cfg.node_name() => {
                self.cluster.set_owned(volume, Some(spec.epoch))
            }
            Ok(_) => return,
            Err(e) => {
                warn!(volume = %volume, error = %e, "cannot read the new volume's spec");
                return;
            }
        }
        let rv = self.replicas.get(volume);
        if let Some(rv) = rv {
            self.fence_volume(&rv);
            self.set_cluster_path(volume, true, rv.size());
            self.export_owned(volume);
        }
    }

    /// Serve a cluster volume this node owns over NBD under its own name, as the other
    /// nodes' proxies do (and as a new owner after a takeover does), unless an export of
    /// that name exists already. The caller holds the admin lock, so the name checked
    /// is still free when the export is added.
    pub(super) fn export_owned(&self, volume: &str) {
        if self.find_export(volume).is_some() {
            return;
        }
        let Ok((pool, local)) = self.pools().find_volume(volume) else {
            return;
        };
        let record = tessera_pool::ExportRecord {
            name: volume.to_string(),
            volume_id: local.id,
            read_only: false,
            tls_required: None,
        };
        if let Err(e) = pool.add_export(record) {
            warn!(volume = %volume, error = %e, "cannot export the owned volume over NBD");
        }
    }

    /// At join: the replicated volumes opened at start were held back until the cluster
    /// says whose they are. Ours (or with no spec yet) are published and served; those
    /// another node took over meanwhile are given up.
    pub(super) fn confirm_ownership(&self) {
        let Some(m) = self.cluster.membership() else {
            return;
        };
        let me = self.cfg.node_name();
        let names: Vec<String> = self.replicas.names();
        for name in names {
            match self.read_spec(m, &name) {
                Ok(Some((spec, _))) if spec.owner != me => {
                    self.give_up(
                        &name,
                        &format!(
                            "'{}' took the volume over at epoch {} while this node was away",
                            spec.owner, spec.epoch
                        ),
                    );
                    continue;
                }
                Ok(Some((spec, _))) => self.cluster.set_owned(&name, Some(spec.epoch)),
                Ok(None) => {
                    // A volume replicated before the node joined a cluster: its spec
                    // starts now, at epoch 1.
                    let rv = self.replicas.get(&name);
                    if let Some(rv) = rv {
                        let (places, _) = self.replica_places(&rv);
                        self.update_volume_spec_replicas(&name, rv.size(), &places);
                    }
                    self.cluster.set_owned(&name, Some(1));
                }
                Err(e) => {
                    error!(volume = %name, error = %e, "cannot confirm ownership: the volume stays held back");
                    continue;
                }
            }
            let rv = self.replicas.get(&name);
            if let Some(rv) = &rv {
                self.fence_volume(rv);
            }
            match self.publish_replica_states(&name) {
                Ok(()) => {
                    self.replicas.unblock(&name);
                    if let Some(rv) = &rv {
                        self.set_cluster_path(&name, true, rv.size());
                    }
                    info!(volume = %name, epoch = self.cluster.owned_epoch(&name), "owned volume confirmed by the cluster: serving");
                }
                Err(SpecRefusal::Lost(why)) => self.give_up(&name, &why),
                Err(SpecRefusal::Unavailable(why)) => {
                    error!(volume = %name, error = %why, "cannot publish the replica states: the volume stays held back")
                }
            }
        }
    }
}
