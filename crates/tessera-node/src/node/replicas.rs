//! The replicas service, and the node's replicated-volume operations (docs/architecture.md
//! "Replicated volumes").
//!
//! [`Replicas`] owns the replicated volumes this node owns, by name, and the ones whose
//! replica set could not be opened or that were held back or given up (their local leg
//! is not served alone: the other replicas would miss the writes), with the reason. Both
//! maps are under one lock, so a volume moves from served to blocked (given up) in one
//! step; no lock is held while a replica set is opened, closed or asked for its status.
//! It also owns where the replica-set files are (`DATA_DIR/replicas`) and the
//! `[replication]` settings a set opens with.
//!
//! How it relates to the other services: a set's resync rate is `[replication]
//! resync_rate`, else the jobs service's "resync" background class (the caller passes
//! [`Jobs::background`](super::Jobs::background) in); the exports, NVMe/TCP and
//! snapshot operations ask [`Replicas::blocked`] before they serve or change a volume,
//! and a volume's status shows [`Replicas::infos`]. Cluster ownership
//! (node/ownership.rs, node/failover.rs) holds sets back at start, confirms, fences,
//! takes over and gives up through it.
//!
//! The operations that need several services stay `Node` methods below, under the admin
//! lock: creating a replicated volume (a pool's volume, the peers' replicas, the set,
//! its cluster spec), adding and removing a replica, deleting a replicated volume
//! (refused while exported), and the peer side (`POST /v1/replicas`: a thin volume
//! exported to the owner over NVMe/TCP).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tessera_io::sync::RwLockExt;

use tessera_api::{CreateReplica, RemovedReplica, ReplicaInfo, ReplicaTarget, VolumeInfo};
use tessera_http::{request, Endpoint};
use tessera_io::Mailbox;
use tessera_pool::Volume;
use tessera_replica::{Cores, LegDesc, LegState, ReplicaOptions, ReplicatedVolume, SetDesc};
use tracing::{error, info, warn};

use super::{size_arg, Error, Node, Result};
use crate::background::Background;
use crate::config::{NodeConfig, PeerDecl, ReplicationConfig};

/// The NQN under which a node exports a replica to its owner.
pub fn replica_nqn(owner: &str, volume: &str) -> String {
    format!("nqn.2026-11.io.tessera:replica:{owner}:{volume}")
}

/// What the replicas service keeps under its lock.
#[derive(Default)]
struct Sets {
    /// Replicated volumes this node owns and serves, by name.
    open: BTreeMap<String, Arc<ReplicatedVolume>>,
    /// Replicated volumes not served, by name, with the reason: their set could not be
    /// opened, the cluster has not confirmed this node owns them, or they were given up.
    blocked: BTreeMap<String, String>,
}

pub struct Replicas {
    /// Where the replica-set files are (`DATA_DIR/replicas`).
    dir: PathBuf,
    /// `[replication]`: how a set opens.
    settings: ReplicationConfig,
    /// This node's NVMe host NQN: a replica's fence admits its owner's only.
    host_nqn: String,
    /// Whether the node is in a cluster (`[cluster] etcd`): a set opened at start is
    /// held back until the cluster confirms this node owns it.
    in_cluster: bool,
    /// The node's reactors, which run the sets' I/O.
    reactors: Vec<Arc<Mailbox>>,
    sets: RwLock<Sets>,
}

impl Replicas {
    /// The service of the node `cfg` sets up, its sets' I/O on `reactors`; no set is
    /// open yet ([`Replicas::open_all`]).
    pub fn new(cfg: &NodeConfig, reactors: Vec<Arc<Mailbox>>) -> Replicas {
        Replicas {
            dir: cfg.data_dir.join("replicas"),
            settings: cfg.replication.clone(),
            host_nqn: super::fencing::host_nqn(&cfg.node_name()),
            in_cluster: !cfg.cluster.etcd.is_empty(),
            reactors,
            sets: RwLock::new(Sets::default()),
        }
    }

    /// The directory of the replica-set files.
    pub(super) fn dir(&self) -> PathBuf {
        self.dir.clone()
    }

    /// The replica-set file of volume `name`.
    pub(super) fn set_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.rset"))
    }

    /// How a set opens: `[replication]`, the resync rate as [`Replicas::resync_rate`].
    pub(super) fn options(&self, background: &Background) -> Result<ReplicaOptions> {
        let r = &self.settings;
        Ok(ReplicaOptions {
            region_size: size_arg("[replication] region_size", &r.region_size)?,
            al_capacity: r.al_regions.max(1),
            timeout: Duration::from_millis(r.timeout_ms.max(1)),
            resync_rate: self.resync_rate(background)?,
            hostnqn: self.host_nqn.clone(),
        })
    }

    /// `[replication] resync_rate`, else the "resync" background class's bandwidth.
    fn resync_rate(&self, background: &Background) -> Result<u64> {
        match &self.settings.resync_rate {
            Some(r) => size_arg("[replication] resync_rate", r),
            None => Ok(background.limits("resync")?.bps),
        }
    }

    /// The "resync" background class changed: resyncs started from now on use it.
    pub fn refresh_rates(&self, background: &Background) {
        let Ok(rate) = self.resync_rate(background) else {
            return;
        };
        for rv in self.all() {
            rv.set_resync_rate(rate);
        }
    }

    /// The reactors a new set runs on.
    pub(super) fn cores(&self) -> Arc<Cores> {
        Cores::new(self.reactors.clone())
    }

    /// The replicated volume this node owns under `name`, if open.
    pub fn get(&self, name: &str) -> Option<Arc<ReplicatedVolume>> {
        self.sets.read_locked().open.get(name).cloned()
    }

    /// The replicated volume whose local leg is `vol`, if any.
    pub fn of(&self, vol: &Volume) -> Option<Arc<ReplicatedVolume>> {
        // A volume taken over from another owner may have a local leg named otherwise
        // (`VOLUME.OWNER`, a replica made outside a cluster): look by leg, not by name.
        let sets = self.sets.read_locked();
        sets.open
            .get(&vol.name)
            .into_iter()
            .chain(sets.open.values())
            .find(|r| r.local_volume().is_some_and(|v| std::ptr::eq(&*v, vol)))
            .cloned()
    }

    /// Whether `vol` is the local leg of a replicated volume that is not served, and
    /// why: it must not be served on its own (the other replicas would miss the writes).
    pub fn blocked(&self, vol: &Volume) -> Option<String> {
        self.sets.read_locked().blocked.get(&vol.name).cloned()
    }

    /// The names of the replicated volumes open here.
    pub(super) fn names(&self) -> Vec<String> {
        self.sets.read_locked().open.keys().cloned().collect()
    }

    /// The replicated volumes open here.
    pub(super) fn all(&self) -> Vec<Arc<ReplicatedVolume>> {
        self.sets.read_locked().open.values().cloned().collect()
    }

    /// Serve `rv` as replicated volume `name`.
    pub(super) fn insert(&self, name: &str, rv: Arc<ReplicatedVolume>) {
        self.sets.write_locked().open.insert(name.to_string(), rv);
    }

    /// Serve `rv` as replicated volume `name`, which was blocked (taken over).
    pub(super) fn insert_unblocked(&self, name: &str, rv: Arc<ReplicatedVolume>) {
        let mut sets = self.sets.write_locked();
        sets.open.insert(name.to_string(), rv);
        sets.blocked.remove(name);
    }

    /// Stop serving replicated volume `name` (deleted): its set, if it was open.
    pub(super) fn remove(&self, name: &str) -> Option<Arc<ReplicatedVolume>> {
        self.sets.write_locked().open.remove(name)
    }

    /// Stop serving replicated volume `name` because another node owns it now: it is
    /// blocked with `why` from this moment, and its set (if it was open) is returned to
    /// be closed.
    pub(super) fn give_up(&self, name: &str, why: &str) -> Option<Arc<ReplicatedVolume>> {
        let mut sets = self.sets.write_locked();
        sets.blocked
            .insert(name.to_string(), format!("given up: {why}"));
        sets.open.remove(name)
    }

    /// Serve replicated volume `name` again (the cluster confirmed it), or let its name
    /// be used again (its stale copy is gone).
    pub(super) fn unblock(&self, name: &str) {
        self.sets.write_locked().blocked.remove(name);
    }

    /// A volume's replicas and their status, when it is the local leg of a replicated
    /// volume.
    pub(super) fn infos(&self, vol: &Volume) -> Option<Vec<ReplicaInfo>> {
        Some(self.of(vol)?.status())
    }

    /// Every replicated volume this node owns, with its legs' status (for metrics).
    pub fn statuses(&self) -> Vec<(String, Vec<ReplicaInfo>)> {
        let open: Vec<(String, Arc<ReplicatedVolume>)> = self
            .sets
            .read_locked()
            .open
            .iter()
            .map(|(n, rv)| (n.clone(), rv.clone()))
            .collect();
        open.into_iter().map(|(n, rv)| (n, rv.status())).collect()
    }

    /// Close every replicated volume cleanly (node shutdown).
    pub(super) fn close_all(&self) {
        for rv in self.all() {
            rv.close();
        }
    }

    /// Open every replica set in the directory (node start), its local leg found with
    /// `local_volume` (the node's pools); the resync rate as `background` sets it. A set
    /// that cannot be opened is blocked with the reason; in a cluster an opened one is
    /// blocked too until the cluster confirms this node owns it (node/ownership.rs, at
    /// join).
    pub(super) fn open_all(
        &self,
        background: &Background,
        local_volume: impl Fn(&str) -> Option<Arc<Volume>>,
    ) {
        let Ok(dir) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let opts = match self.options(background) {
            Ok(o) => o,
            Err(e) => {
                error!(error = %e, "bad [replication] settings: replicated volumes stay closed");
                return;
            }
        };
        for ent in dir.flatten() {
            let path = ent.path();
            if path.extension().is_none_or(|e| e != "rset") {
                continue;
            }
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let opened = ReplicatedVolume::read_desc(&path).and_then(|desc| {
                let local = desc.legs.iter().find_map(|l| match l {
                    LegDesc::Local { volume, .. } => Some(volume.clone()),
                    LegDesc::Remote { .. } | LegDesc::Vacant => None,
                });
                let local = match local {
                    Some(v) => Some(local_volume(&v).ok_or_else(|| {
                        std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            format!("its local volume '{v}' is missing (pool offline?)"),
                        )
                    })?),
                    None => None,
                };
                ReplicatedVolume::open(&path, local, opts.clone(), self.cores())
            });
            let mut sets = self.sets.write_locked();
            match opened {
                Ok(v) => {
                    if self.in_cluster {
                        sets.blocked.insert(
                            name.clone(),
                            "waiting for the cluster to confirm this node owns it".into(),
                        );
                    }
                    sets.open.insert(name, v);
                }
                Err(e) => {
                    error!(volume = %name, error = %e, "replicated volume cannot be opened: it is not served");
                    sets.blocked.insert(name, e.to_string());
                }
            }
        }
    }
}

impl Node {
    /// [`Replicas::options`] with the jobs service's background classes.
    pub(super) fn replica_options(&self) -> Result<ReplicaOptions> {
        self.replicas.options(self.jobs.background())
    }

    pub(super) fn peer_call(
        &self,
        peer: &PeerDecl,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, String)> {
        let token = match &peer.token_file {
            Some(f) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| Error::io(&format!("reading {}", f.display()), e))?
                    .trim()
                    .to_string(),
            ),
            None => None,
        };
        let ep = Endpoint::parse(&peer.api).with_credentials(token, peer.ca_cert.clone());
        request(&ep, method, path, body)
            .map_err(|e| Error::io(&format!("peer '{}' ({})", peer.name, peer.api), e))
    }

    /// Create a replicated volume: its local leg in one of this node's pools, a replica on
    /// each named peer, and the replica-set file.
    pub fn create_replicated_volume(
        &self,
        name: &str,
        size: u64,
        replicas: &[String],
        force: bool,
    ) -> Result<VolumeInfo> {
        let _g = self.admin();
        tessera_pool::validate_name("volume", name)?;
        if self.pools().find_volume(name).is_ok() {
            return Err(Error::already_exists(format!(
                "volume '{name}' already exists"
            )));
        }
        let me = self.cfg.node_name();
        let mut places = Vec::new();
        for r in replicas {
            let (node, pool) = r
                .split_once(':')
                .ok_or_else(|| Error::invalid(format!("replica '{r}': expected NODE:POOL")))?;
            if places.iter().any(|(n, _): &(String, String)| n == node) {
                return Err(Error::invalid(format!(
                    "two replicas on node '{node}': each replica goes to a different node"
                )));
            }
            places.push((node.to_string(), pool.to_string()));
        }
        if !(2..=tessera_replica::meta::MAX_LEGS).contains(&places.len()) {
            return Err(Error::invalid(format!(
                "a replicated volume has 2 to {} replicas",
                tessera_replica::meta::MAX_LEGS
            )));
        }
        let Some((_, local_pool)) = places.iter().find(|(n, _)| *n == me) else {
            return Err(Error::invalid(format!(
                "this node ('{me}') owns the volume and holds one of its replicas: list \
                 '{me}:POOL' among --replicas"
            )));
        };
        for (n, _) in &places {
            if *n != me {
                self.peer(n)?;
            }
        }
        let p = self.pools().get(local_pool)?;
        let opts = self.replica_options()?;
        // In a cluster, the name is claimed there first (create-only in etcd).
        self.claim_volume_spec(name, size, replicas)?;
        let vopts = tessera_pool::VolumeOptions {
            force,
            ..Default::default()
        };
        let local = match p.create_volume_opts(name, size, vopts) {
            Ok(v) => v,
            Err(e) => {
                self.release_volume_spec(name);
                return Err(e.into());
            }
        };
        // From here, undo what was made if a later step fails.
        let mut made: Vec<(PeerDecl, String)> = Vec::new();
        let result = (|| -> Result<Arc<ReplicatedVolume>> {
            let mut legs = Vec::new();
            for (n, pool) in &places {
                if *n == me {
                    legs.push(LegDesc::Local {
                        pool: pool.clone(),
                        volume: name.to_string(),
                    });
                    continue;
                }
                let (peer, leg) = self.peer_replica(n, pool, name, size, false)?;
                if let LegDesc::Remote { volume, .. } = &leg {
                    made.push((peer, volume.clone()));
                }
                legs.push(leg);
            }
            let desc = SetDesc {
                name: name.to_string(),
                legs,
            };
            ReplicatedVolume::create(
                &self.replicas.dir(),
                desc,
                size,
                Some(local.clone()),
                opts,
                self.replicas.cores(),
            )
            .map_err(|e| Error::io("creating the replica set", e))
        })();
        match result {
            Ok(rv) => {
                info!(volume = %name, replicas = ?replicas, "replicated volume created");
                self.replicas.insert(name, rv);
                self.own_new_volume(name);
                Ok(self.volume_info(&p, &local))
            }
            Err(e) => {
                for (peer, vol) in made {
                    if let Err(err) =
                        self.peer_call(&peer, "DELETE", &format!("/v1/replicas/{vol}"), None)
                    {
                        warn!(peer = %peer.name, volume = %vol, error = %err, "could not remove a replica after a failed create");
                    }
                }
                let _ = std::fs::remove_file(self.replicas.set_path(name));
                self.release_volume_spec(name);
                if let Err(err) = p.delete_volume(&local) {
                    warn!(volume = %name, error = %err, "could not remove the local leg after a failed create");
                }
                Err(e)
            }
        }
    }

    /// Ask peer `node` for a replica of volume `name` in its pool `pool` (`fresh`: it
    /// must be a new, empty volume there).
    fn peer_replica(
        &self,
        node: &str,
        pool: &str,
        name: &str,
        size: u64,
        fresh: bool,
    ) -> Result<(PeerDecl, LegDesc)> {
        let me = self.cfg.node_name();
        let peer = self.peer(node)?;
        // In a cluster a name is taken once cluster-wide, so a replica is named like its
        // volume (a new owner then serves it under that name); between `[[peer]]`s the
        // owner's name keeps two owners' volumes of one name apart.
        let volume = if self.cluster.membership().is_some() {
            name.to_string()
        } else {
            format!("{name}.{me}")
        };
        let req = CreateReplica {
            volume,
            pool: pool.to_string(),
            size,
            owner: me.clone(),
            fresh,
        };
        let body = serde_json::to_value(&req).map_err(|e| Error::invalid(e.to_string()))?;
        let (status, text) = self.peer_call(&peer, "POST", "/v1/replicas", Some(&body))?;
        if !(200..300).contains(&status) {
            return Err(Error::invalid(format!(
                "peer '{node}' refused the replica (HTTP {status}): {}",
                text.trim()
            )));
        }
        let t: ReplicaTarget = serde_json::from_str(&text)
            .map_err(|e| Error::io(&format!("peer '{node}' answered"), e))?;
        let leg = LegDesc::Remote {
            node: node.to_string(),
            pool: pool.to_string(),
            volume: t.volume,
            spec: reachable_spec(&t.spec, &peer.api),
        };
        Ok((peer, leg))
    }

    /// Ask peer `node` to delete the replica volume `volume`: None when it did (or had
    /// none), else why not.
    fn drop_peer_replica(&self, node: &str, volume: &str) -> Option<String> {
        let r = self
            .peer(node)
            .and_then(|p| self.peer_call(&p, "DELETE", &format!("/v1/replicas/{volume}"), None));
        match r {
            Ok((s, _)) if (200..300).contains(&s) || s == 404 => None,
            Ok((s, t)) => {
                warn!(peer = %node, volume = %volume, status = s, answer = %t.trim(), "peer did not delete its replica");
                Some(format!(
                    "node '{node}' did not delete '{volume}' (HTTP {s}: {})",
                    t.trim()
                ))
            }
            Err(e) => {
                warn!(peer = %node, volume = %volume, error = %e, "peer unreachable: its replica stays until removed there");
                Some(format!("node '{node}' could not be reached ({e})"))
            }
        }
    }

    /// Give volume `name` one more replica, `place` = `NODE:POOL` on a peer. A replicated
    /// volume gets a new leg; a plain volume of this node becomes replicated (its data
    /// stays in place as the local replica). The new replica starts empty and gets a copy
    /// of the allocated regions in the background (`volume status` shows it), while
    /// clients keep writing.
    pub fn add_replica(&self, name: &str, place: &str) -> Result<VolumeInfo> {
        let _g = self.admin();
        let (p, v) = self.pools().find_volume(name)?;
        let (node, pool) = place
            .split_once(':')
            .ok_or_else(|| Error::invalid(format!("replica '{place}': expected NODE:POOL")))?;
        let me = self.cfg.node_name();
        if node == me {
            return Err(Error::invalid(format!(
                "this node ('{me}') owns '{name}' and holds its local replica: a new replica \
                 goes to another node"
            )));
        }
        if v.is_snapshot() {
            return Err(Error::invalid(format!(
                "'{name}' is a snapshot: only a volume can be replicated"
            )));
        }
        if let Some(why) = self.replicas.blocked(&v) {
            return Err(Error::invalid(format!(
                "replicated volume '{name}' is not open ({why})"
            )));
        }
        self.peer(node)?;
        let existing = self.replicas.of(&v);
        match &existing {
            Some(rv) => {
                if rv
                    .descs()
                    .iter()
                    .any(|d| matches!(d, LegDesc::Remote { node: n, .. } if n == node))
                {
                    return Err(Error::already_exists(format!(
                        "volume '{name}' already has a replica on node '{node}'"
                    )));
                }
                if rv.descs().len() >= tessera_replica::meta::MAX_LEGS {
                    return Err(Error::invalid(format!(
                        "volume '{name}' has {} replicas, the most a volume has",
                        tessera_replica::meta::MAX_LEGS
                    )));
                }
            }
            None => {
                // Connections opened before the change would keep writing to the local
                // volume alone: only a volume nobody uses becomes replicated.
                let exports: Vec<String> = p
                    .exports()
                    .into_iter()
                    .filter(|e| e.volume_id == v.id)
                    .map(|e| e.name)
                    .collect();
                let nqn = self.nvmf.subsystem_using(&p.uuid(), v.id);
                let iqn = self.iscsi.target_using(&p.uuid(), v.id);
                if !exports.is_empty() || nqn.is_some() || iqn.is_some() || v.open_handles() > 0 {
                    let mut uses = Vec::new();
                    if !exports.is_empty() {
                        uses.push(format!("exported as {}", exports.join(", ")));
                    }
                    if let Some(n) = nqn {
                        uses.push(format!("a namespace of NVMe subsystem '{n}'"));
                    }
                    if let Some(t) = iqn {
                        uses.push(format!("a LUN of iSCSI target '{t}'"));
                    }
                    if v.open_handles() > 0 {
                        uses.push(format!("{} open connections", v.open_handles()));
                    }
                    return Err(Error::busy(format!(
                        "volume '{name}' is in use ({}): a local volume becomes replicated \
                         only while nobody uses it; remove its exports, add the replica, \
                         then export it again",
                        uses.join("; ")
                    )));
                }
            }
        }
        let (_, leg) = self.peer_replica(node, pool, name, v.size(), true)?;
        let LegDesc::Remote { volume: rvol, .. } = &leg else {
            unreachable!("a peer's replica is remote");
        };
        let rvol = rvol.clone();
        let added = match &existing {
            Some(rv) => rv
                .add_leg(leg)
                .map_err(|e| Error::io("adding the replica", e)),
            None => {
                let desc = SetDesc {
                    name: name.to_string(),
                    legs: vec![
                        LegDesc::Local {
                            pool: p.name().to_string(),
                            volume: name.to_string(),
                        },
                        leg,
                    ],
                };
                self.replica_options().and_then(|opts| {
                    ReplicatedVolume::create_with(
                        &self.replicas.dir(),
                        desc,
                        vec![LegState::InSync, LegState::NeedsFull],
                        v.size(),
                        Some(v.clone()),
                        opts,
                        self.replicas.cores(),
                    )
                    .map_err(|e| Error::io("creating the replica set", e))
                    .map(|rv| {
                        self.replicas.insert(name, rv);
                    })
                })
            }
        };
        if let Err(e) = added {
            if let Some(why) = self.drop_peer_replica(node, &rvol) {
                warn!(volume = %name, replica = %place, reason = %why, "could not remove the new replica after a failed add");
            }
            return Err(e);
        }
        info!(volume = %name, replica = %place, "replica added; its copy runs in the background");
        self.publish_replica_places(name);
        Ok(self.volume_info(&p, &v))
    }

    /// In a cluster, the volume's spec lists its replicas as they are now.
    fn publish_replica_places(&self, name: &str) {
        let Some(rv) = self.replicas.get(name) else {
            return;
        };
        let me = self.cfg.node_name();
        let places: Vec<String> = rv
            .descs()
            .iter()
            .filter_map(|d| match d {
                LegDesc::Local { pool, .. } => Some(format!("{me}:{pool}")),
                LegDesc::Remote { node, pool, .. } => Some(format!("{node}:{pool}")),
                LegDesc::Vacant => None,
            })
            .collect();
        if self.cluster.membership().is_none() {
            return;
        }
        if self.cluster.owned_epoch(name).is_none() {
            // A volume that just became replicated: its spec is written now.
            self.update_volume_spec_replicas(name, rv.size(), &places);
            self.own_new_volume(name);
        }
        self.publish_replica_states_logged(name);
    }

    /// Remove volume `name`'s replica at `place` (`NODE:POOL`) and ask that node to
    /// delete its volume. The owner's own replica and the last one in sync stay.
    pub fn remove_replica(&self, name: &str, place: &str) -> Result<RemovedReplica> {
        let _g = self.admin();
        let (_, v) = self.pools().find_volume(name)?;
        let rv = self
            .replicas
            .of(&v)
            .ok_or_else(|| Error::invalid(format!("volume '{name}' is not replicated")))?;
        let desc = rv.remove_leg(place).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::not_found(e.to_string()),
            std::io::ErrorKind::InvalidInput => Error::invalid(e.to_string()),
            _ => Error::io("removing the replica", e),
        })?;
        let LegDesc::Remote { node, volume, .. } = desc else {
            unreachable!("only remote replicas are removed");
        };
        self.publish_replica_places(name);
        let note = self.drop_peer_replica(&node, &volume).map(|why| {
            format!(
                "{why}: '{volume}' stays on '{node}' until deleted there; it is no longer \
                 a replica of '{name}'"
            )
        });
        Ok(RemovedReplica {
            volume: name.to_string(),
            replica: place.to_string(),
            replica_volume_deleted: note.is_none(),
            replica_volume: volume,
            note,
        })
    }

    /// Delete a replicated volume this node owns: its replica set, its replicas on the
    /// peers (those that answer; the others are named in the log) and its local leg.
    pub(super) fn delete_replicated(&self, rv: &Arc<ReplicatedVolume>) -> Result<()> {
        if let Some(v) = rv.local_volume() {
            let (p, _) = self.pools().find_volume(&v.name)?;
            if let Some(e) = p.exports().into_iter().find(|e| e.volume_id == v.id) {
                return Err(Error::busy(format!(
                    "volume '{}' is exported as '{}'; remove the export first",
                    v.name, e.name
                )));
            }
        }
        rv.close();
        for d in rv.descs() {
            if let LegDesc::Remote { node, volume, .. } = d {
                // Logged by the call when the peer keeps it.
                let _ = self.drop_peer_replica(&node, &volume);
            }
        }
        std::fs::remove_file(rv.path()).map_err(|e| Error::io("removing the replica set", e))?;
        self.release_volume_spec(&rv.name);
        self.replicas.remove(&rv.name);
        Ok(())
    }

    /// Peer side of `POST /v1/replicas`: a thin volume of this node, exported over
    /// NVMe/TCP to the owner. Asking again for the same replica answers the same.
    pub fn create_replica(&self, req: &CreateReplica) -> Result<ReplicaTarget> {
        if !self.cfg.nvmf.enabled {
            return Err(Error::invalid(
                "this node does not serve NVMe/TCP ([nvmf] enabled = false): it cannot hold replicas",
            ));
        }
        let nqn = replica_nqn(&req.owner, &req.volume);
        match self.pools().find_volume(&req.volume) {
            Ok(_) if req.fresh => {
                return Err(Error::already_exists(format!(
                    "volume '{}' already exists here (left from an earlier replica?): a new \
                     replica starts empty; delete it on this node first (its NVMe/TCP \
                     subsystem '{nqn}', then the volume)",
                    req.volume
                )))
            }
            Ok((_, v)) if v.size() == req.size => {}
            Ok(_) => {
                return Err(Error::already_exists(format!(
                    "volume '{}' exists with another size",
                    req.volume
                )))
            }
            Err(_) => {
                self.create_volume(&req.volume, &req.pool, req.size, false)?;
            }
        }
        let sub = match self.nvmf_get(&nqn) {
            Ok(s) => s,
            Err(_) => self.nvmf_add_subsystem(&nqn, true, &[])?,
        };
        if sub.namespaces.is_empty() {
            self.nvmf_add_namespace(&nqn, &req.volume, 1)?;
        }
        info!(volume = %req.volume, owner = %req.owner, nqn = %nqn, "holding a replica for another node");
        Ok(ReplicaTarget {
            volume: req.volume.clone(),
            spec: format!("nvme-tcp://{}/{nqn}?nsid=1", self.cfg.nvmf.listen),
        })
    }

    /// Peer side of `DELETE /v1/replicas/VOLUME`: the replica volume goes with its
    /// snapshots (copies of the owner's, which its owner no longer reaches; one a clone
    /// reads through stays, with the older ones).
    pub fn delete_replica(&self, volume: &str) -> Result<()> {
        let snapshots: Vec<String> = match self.pools().find_volume(volume) {
            Ok((p, v)) => super::lineage::own_snapshots(&p, &v)
                .into_iter()
                .map(|s| s.name.clone())
                .collect(),
            Err(_) => Vec::new(),
        };
        self.delete_replica_volume(volume)?;
        for s in snapshots {
            match self.delete_volume(&s) {
                Ok(()) => info!(volume, snapshot = %s, "snapshot of a deleted replica deleted"),
                Err(e) => {
                    warn!(volume, snapshot = %s, error = %e, "a snapshot of a deleted replica stays: delete it by hand")
                }
            }
        }
        Ok(())
    }

    fn delete_replica_volume(&self, volume: &str) -> Result<()> {
        let subs = self.nvmf_list();
        for s in subs {
            if s.nqn.starts_with("nqn.2026-11.io.tessera:replica:")
                && s.namespaces.iter().any(|n| n.volume == volume)
            {
                // The owner closed its connections just before asking; they may take a
                // moment to end here.
                let deadline = std::time::Instant::now() + Duration::from_secs(3);
                loop {
                    match self.nvmf_remove_subsystem(&s.nqn) {
                        Err(crate::error::Error::Busy(_))
                            if std::time::Instant::now() < deadline =>
                        {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        r => break r?,
                    }
                }
            }
        }
        // The controllers' handles of the volume close as their connections end.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        loop {
            match self.delete_volume(volume) {
                Err(Error::Busy(_)) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                r => return r,
            }
        }
    }
}

/// A peer's NVMe/TCP address as the owner can reach it: a wildcard listen address
/// becomes the host the peer's API was reached at (loopback for a Unix socket).
pub(super) fn reachable_spec(spec: &str, api: &str) -> String {
    let host = match Endpoint::parse(api) {
        Endpoint::Https(h) => h.addr.rsplit_once(':').map(|(h, _)| h.to_string()),
        Endpoint::Tcp(a) => a.rsplit_once(':').map(|(h, _)| h.to_string()),
        Endpoint::Unix(_) => None,
    }
    .unwrap_or_else(|| "127.0.0.1".into());
    for wild in ["0.0.0.0", "[::]"] {
        let from = format!("nvme-tcp://{wild}:");
        if let Some(rest) = spec.strip_prefix(&from) {
            return format!("nvme-tcp://{host}:{rest}");
        }
    }
    spec.to_string()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use tessera_io::{spawn_reactors, ReactorConfig};
    use tessera_pool::{LayoutKind, Pool};
    use tessera_qos::BackgroundLimits;

    use super::*;
    use crate::node::test_pools::ram_pool;

    /// Node "n1"'s config on `dir`; `cluster`: with an etcd endpoint (never reached:
    /// the service only asks whether there is one).
    fn config(dir: &Path, cluster: bool) -> NodeConfig {
        let mut cfg = NodeConfig {
            data_dir: dir.to_path_buf(),
            name: Some("n1".into()),
            ..NodeConfig::default()
        };
        if cluster {
            cfg.cluster.etcd = vec!["127.0.0.1:1".into()];
        }
        cfg
    }

    fn service(cfg: &NodeConfig) -> Replicas {
        let rcfg = ReactorConfig {
            cores: 1,
            pin: false,
            ..ReactorConfig::default()
        };
        let reactors = spawn_reactors(&rcfg).unwrap();
        Replicas::new(cfg, reactors.into_iter().map(|(m, _h)| m).collect())
    }

    /// Pool "p" with volume "v", and a replica set "v" whose only leg is "v" (the
    /// remote legs are what the CLI tests cover), closed as at a clean shutdown.
    fn local_set(cfg: &NodeConfig) -> (Arc<Pool>, Arc<Volume>) {
        let (p, _ram) = ram_pool("p", LayoutKind::Concat, 1);
        let v = p.create_volume("v", 4 << 20).unwrap();
        let made = service(cfg);
        let bg = Background::load(&cfg.data_dir).unwrap();
        let desc = SetDesc {
            name: "v".into(),
            legs: vec![LegDesc::Local {
                pool: "p".into(),
                volume: "v".into(),
            }],
        };
        let rv = ReplicatedVolume::create(
            &made.dir(),
            desc,
            v.size(),
            Some(v.clone()),
            made.options(&bg).unwrap(),
            made.cores(),
        )
        .unwrap();
        rv.close();
        (p, v)
    }

    #[test]
    fn a_volume_that_is_not_replicated_has_no_set_and_is_not_blocked() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), false);
        let replicas = service(&cfg);
        let (p, _ram) = ram_pool("p", LayoutKind::Concat, 1);
        let v = p.create_volume("v", 4 << 20).unwrap();
        replicas.open_all(&Background::load(dir.path()).unwrap(), |_| None);
        assert!(replicas.get("v").is_none());
        assert!(replicas.of(&v).is_none());
        assert_eq!(replicas.blocked(&v), None);
        assert!(replicas.infos(&v).is_none());
        assert!(replicas.statuses().is_empty());
        assert!(replicas.names().is_empty());
    }

    #[test]
    fn a_set_whose_local_volume_is_missing_is_blocked_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), false);
        let (_p, v) = local_set(&cfg);
        let bg = Background::load(dir.path()).unwrap();

        // As at a start with pool "p" offline.
        let replicas = service(&cfg);
        replicas.open_all(&bg, |_| None);
        assert!(replicas.get("v").is_none());
        assert!(replicas.of(&v).is_none());
        assert_eq!(
            replicas.blocked(&v).as_deref(),
            Some("its local volume 'v' is missing (pool offline?)")
        );
        assert!(
            replicas.statuses().is_empty(),
            "a blocked set has no status"
        );

        // With the pool there, outside a cluster: served at once.
        let replicas = service(&cfg);
        replicas.open_all(&bg, |name| (name == "v").then(|| v.clone()));
        let rv = replicas.get("v").expect("the set is open");
        assert!(replicas.of(&v).is_some_and(|r| Arc::ptr_eq(&r, &rv)));
        assert_eq!(replicas.blocked(&v), None);
        assert_eq!(replicas.infos(&v).map(|i| i.len()), Some(1));
        let statuses = replicas.statuses();
        assert_eq!(statuses.len(), 1);
        assert_eq!(statuses[0].0, "v");
        assert_eq!(replicas.names(), vec!["v".to_string()]);
        replicas.close_all();
    }

    #[test]
    fn in_a_cluster_a_set_waits_for_its_owner_and_a_given_up_one_stays_blocked() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), true);
        let (_p, v) = local_set(&cfg);
        let bg = Background::load(dir.path()).unwrap();
        let replicas = service(&cfg);
        replicas.open_all(&bg, |name| (name == "v").then(|| v.clone()));
        assert!(replicas.get("v").is_some(), "opened, to be confirmed");
        assert_eq!(
            replicas.blocked(&v).as_deref(),
            Some("waiting for the cluster to confirm this node owns it")
        );
        replicas.unblock("v");
        assert_eq!(replicas.blocked(&v), None);

        let rv = replicas
            .give_up("v", "'n2' took it over")
            .expect("it was open");
        assert!(replicas.get("v").is_none());
        assert!(replicas.of(&v).is_none());
        assert_eq!(
            replicas.blocked(&v).as_deref(),
            Some("given up: 'n2' took it over")
        );
        assert!(
            replicas.give_up("v", "again").is_none(),
            "nothing left to close"
        );
        rv.close();
    }

    #[test]
    fn the_resync_rate_is_the_resync_class_unless_replication_sets_one() {
        let dir = tempfile::tempdir().unwrap();
        let bg = Background::load(dir.path()).unwrap();
        let replicas = service(&config(dir.path(), false));
        let class = bg.limits("resync").unwrap().bps;
        let opts = replicas.options(&bg).unwrap();
        assert_eq!(opts.resync_rate, class);
        assert_eq!(opts.hostnqn, super::super::fencing::host_nqn("n1"));
        bg.put("resync", Some(BackgroundLimits::new(1 << 20)))
            .unwrap();
        assert_eq!(replicas.options(&bg).unwrap().resync_rate, 1 << 20);

        let mut cfg = config(dir.path(), false);
        cfg.replication.resync_rate = Some("8M".into());
        let replicas = service(&cfg);
        assert_eq!(replicas.options(&bg).unwrap().resync_rate, 8 << 20);
        cfg.replication.region_size = "lots".into();
        let bad = service(&cfg).options(&bg).map(|_| ());
        assert!(matches!(bad, Err(Error::Invalid(_))), "{bad:?}");
    }
}
