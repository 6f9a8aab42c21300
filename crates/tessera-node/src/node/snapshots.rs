//! Snapshots, clones, rollback and changed extents (issue 14; docs/format.md §3.4). A
//! snapshot and a clone are volumes of their pool, so exports, NVMe/TCP namespaces, QoS
//! and statistics take them as they take any volume; a snapshot is exported read-only.

//!
//! A snapshot of a replicated volume is taken on every replica in sync at one point of
//! the write stream: the owner holds the volume's writes until none is in flight
//! (`ReplicatedVolume::quiesce`), snapshots its own replica and asks each replica's node
//! to snapshot its copy (`POST /v1/replicas/VOLUME/snapshots`), then lets the writes go
//! on. Each copy is an ordinary local snapshot on its node, so a new owner after a
//! failover has the snapshots of its own replica.
//!
//! In a cluster the create is made atomic across the nodes by an intent in the volume's
//! spec (`snapshot_intent`, docs/format.md §12): written (compare-and-swap, as the owner
//! at its epoch) before any copy is taken, removed once every copy is; the create
//! answers only after that. An owner that finds an intent outside its own create (it took
//! the volume over from an owner that died midway, or its own create could not record
//! the end) undoes it: deletes every copy it names, then removes it. So a snapshot is on
//! every replica that was in sync at its point, or on none.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_api::{
    ChangedExtents, DeletedSnapshot, Extent, ReplicaSnapshot, SnapshotInfo, SnapshotIntent,
    VolumeInfo,
};
use tessera_pool::{Pool, Volume};
use tessera_replica::{LegDesc, ReplicatedVolume};
use tracing::{info, warn};

use super::ownership::SpecRefusal;
use super::replicas::replica_nqn;
use super::{Error, Node, Result};

/// The node of a `NODE:POOL` place.
fn node_of(place: &str) -> &str {
    place.split(':').next().unwrap_or(place)
}

/// A volume a snapshot is asked of: the local volume that takes it and, for a replicated
/// volume, its replica set (the other replicas take a copy).
struct SnapshotSource {
    pool: Arc<Pool>,
    local: Arc<Volume>,
    name: String,
    set: Option<Arc<ReplicatedVolume>>,
}

/// One replica's copy of a snapshot, asked of its node.
struct RemoteCopy {
    place: String,
    node: String,
    volume: String,
    name: String,
}

impl Node {
    fn find_snapshot(&self, name: &str) -> Result<(Arc<Pool>, Arc<Volume>)> {
        match self.pools().find_volume(name) {
            Ok((p, v)) if v.is_snapshot() => Ok((p, v)),
            Ok(_) => Err(Error::invalid(format!(
                "'{name}' is a volume, not a snapshot"
            ))),
            Err(_) => Err(Error::missing("snapshot", name)),
        }
    }

    fn snapshot_info(&self, p: &Pool, name: &str) -> Result<SnapshotInfo> {
        p.snapshots()
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| Error::missing("snapshot", name))
    }

    /// Snapshot `volume` as `name` (metadata only; durable when it returns).
    pub fn create_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotInfo> {
        self.create_snapshot_group(&[(volume.to_string(), name.to_string())])
            .map(|mut v| v.remove(0))
    }

    /// Snapshots of several volumes at one point in time; they must share a pool (one
    /// pool's metadata makes the point atomic). A replicated volume's snapshot is taken
    /// on each of its replicas in sync, with its writes held meanwhile.
    pub fn create_snapshot_group(&self, what: &[(String, String)]) -> Result<Vec<SnapshotInfo>> {
        let _g = self.admin();
        if what.is_empty() {
            return Err(Error::invalid("no snapshot asked for"));
        }
        let mut sources: Vec<(SnapshotSource, String)> = Vec::new();
        for (volume, name) in what {
            if self.pools().find_volume(name).is_ok() {
                return Err(Error::already_exists(format!(
                    "a volume or snapshot named '{name}' already exists"
                )));
            }
            let src = self.snapshot_source(volume)?;
            if let Some((first, _)) = sources.first() {
                if !Arc::ptr_eq(&first.pool, &src.pool) {
                    return Err(Error::invalid(format!(
                        "volumes '{}' and '{volume}' are in different pools: a group \
                         snapshot is taken in one pool",
                        what[0].0
                    )));
                }
            }
            sources.push((src, name.clone()));
        }
        let p = sources[0].0.pool.clone();
        // In a cluster: an intent in each replicated volume's spec before any copy.
        let mut intents: Vec<(String, SnapshotIntent)> = Vec::new();
        for (src, name) in &sources {
            let Some(set) = &src.set else { continue };
            let Some(intent) = self.begin_snapshot_intent(set, name).inspect_err(|_| {
                self.abandon_snapshot_intents(&intents);
            })?
            else {
                continue;
            };
            intents.push((set.name.clone(), intent));
        }
        let result = self.take_snapshot_group(&sources, &p, what);
        if result.is_err() {
            self.abandon_snapshot_intents(&intents);
            return result;
        }
        // The create is complete once every intent is gone; until then it may be undone.
        let mut unrecorded = Vec::new();
        for (volume, intent) in &intents {
            let r = self.edit_owned_spec(volume, |s| {
                if s.snapshot_intent.as_ref() == Some(intent) {
                    s.snapshot_intent = None;
                }
            });
            if let Err(SpecRefusal::Lost(why) | SpecRefusal::Unavailable(why)) = r {
                unrecorded.push(format!("{volume}: {why}"));
            }
        }
        if !unrecorded.is_empty() {
            warn!(snapshots = ?what, why = ?unrecorded, "the snapshot's end was not recorded in the cluster: its copies are deleted");
            self.abandon_snapshot_intents(&intents);
            return Err(Error::busy(format!(
                "the snapshot was taken but its completion could not be recorded in the \
                 cluster ({}), so it was undone on every replica; try again",
                unrecorded.join("; ")
            )));
        }
        result
    }

    /// The copies of a group snapshot (see [`Node::create_snapshot_group`]).
    fn take_snapshot_group(
        &self,
        sources: &[(SnapshotSource, String)],
        p: &Arc<Pool>,
        what: &[(String, String)],
    ) -> Result<Vec<SnapshotInfo>> {
        let t = Instant::now();
        // Hold the writes of every replicated volume of the group; the replicas in sync
        // then hold the same data until the guards drop.
        let wait = self.replica_options()?.timeout + Duration::from_secs(2);
        let mut held = Vec::new();
        let mut remote: Vec<(usize, RemoteCopy)> = Vec::new();
        let mut missing: Vec<Vec<String>> = vec![Vec::new(); sources.len()];
        for (i, (src, name)) in sources.iter().enumerate() {
            let Some(set) = &src.set else { continue };
            let q = set
                .quiesce(wait)
                .map_err(|e| Error::busy(format!("cannot snapshot '{}': {e}", src.name)))?;
            let legs = q.in_sync();
            if !legs.iter().any(|l| matches!(l, LegDesc::Local { .. })) {
                return Err(Error::busy(format!(
                    "cannot snapshot '{}': this node's replica is out of sync (snapshot it \
                     once its resync is over)",
                    src.name
                )));
            }
            for d in set.descs() {
                match d {
                    LegDesc::Remote {
                        ref node,
                        ref volume,
                        ..
                    } if legs.contains(&d) => {
                        remote.push((
                            i,
                            RemoteCopy {
                                place: d.place(),
                                node: node.clone(),
                                volume: volume.clone(),
                                name: name.clone(),
                            },
                        ));
                    }
                    LegDesc::Remote { .. } => missing[i].push(format!(
                        "{}: out of sync at the snapshot's point",
                        d.place()
                    )),
                    LegDesc::Local { .. } | LegDesc::Vacant => {}
                }
            }
            held.push(q);
        }
        let quiesced_ms = t.elapsed().as_secs_f64() * 1e3;
        let pairs: Vec<(Arc<Volume>, String)> = sources
            .iter()
            .map(|(src, name)| (src.local.clone(), name.clone()))
            .collect();
        #[cfg(feature = "test-hooks")]
        let one_by_one = self.hook_snapshot_kill_after();
        #[cfg(not(feature = "test-hooks"))]
        let one_by_one: Option<usize> = None;
        // This node's snapshots and the replicas' copies are taken in parallel, so the
        // writes are held for the slowest of them, not their sum.
        let (local, answers) = if let Some(kill_after) = one_by_one {
            let local = p.create_snapshots(&pairs);
            let mut answers = Vec::new();
            for (_, c) in &remote {
                answers.push(self.snapshot_on_replica(c));
                #[cfg(feature = "test-hooks")]
                if answers.iter().filter(|a| a.is_ok()).count() >= kill_after {
                    super::test_hooks::kill_self("snapshot-kill-after-copies");
                }
            }
            let _ = kill_after;
            (local, answers)
        } else {
            std::thread::scope(|sc| {
                let asks: Vec<_> = remote
                    .iter()
                    .map(|(_, c)| sc.spawn(|| self.snapshot_on_replica(c)))
                    .collect();
                let local = p.create_snapshots(&pairs);
                let answers: Vec<Result<()>> = asks
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(Error::invalid("a snapshot request panicked")))
                    })
                    .collect();
                (local, answers)
            })
        };
        drop(held);
        let paused_ms = t.elapsed().as_secs_f64() * 1e3;
        if let Err(e) = local {
            // The copies already taken on replicas go too: the snapshot does not exist.
            for ((_, c), a) in remote.iter().zip(&answers) {
                if a.is_ok() {
                    if let Some(why) = self.drop_snapshot_on_replica(&c.node, &c.volume, &c.name) {
                        warn!(snapshot = %c.name, replica = %c.place, why = %why, "a replica's copy of a failed snapshot stays");
                    }
                }
            }
            return Err(e.into());
        }
        let mut held_on: Vec<Vec<String>> = sources
            .iter()
            .map(|(src, _)| {
                src.set
                    .as_ref()
                    .and_then(|set| {
                        set.descs()
                            .into_iter()
                            .find(|d| matches!(d, LegDesc::Local { .. }))
                    })
                    .and_then(|d| match d {
                        LegDesc::Local { pool, .. } => {
                            Some(vec![format!("{}:{pool}", self.cfg.node_name())])
                        }
                        LegDesc::Remote { .. } | LegDesc::Vacant => None,
                    })
                    .unwrap_or_default()
            })
            .collect();
        for ((i, c), a) in remote.iter().zip(answers) {
            match a {
                Ok(()) => held_on[*i].push(c.place.clone()),
                Err(e) => {
                    warn!(snapshot = %c.name, replica = %c.place, error = %e, "a replica did not take its copy of the snapshot");
                    missing[*i].push(format!("{}: {e}", c.place));
                }
            }
        }
        info!(pool = %p.name(), snapshots = ?what, ms = t.elapsed().as_secs_f64() * 1e3,
            quiesced_ms, paused_ms, "snapshots created");
        sources
            .iter()
            .enumerate()
            .map(|(i, (_, n))| {
                let mut info = self.snapshot_info(p, n)?;
                info.replicas = std::mem::take(&mut held_on[i]);
                info.missing = std::mem::take(&mut missing[i]);
                Ok(info)
            })
            .collect()
    }

    /// In a cluster, write the intent of snapshot `name` of replicated volume `set` to
    /// its spec (the admin lock held), after undoing one an earlier create left; None
    /// outside a cluster (no failover, no intent).
    fn begin_snapshot_intent(
        &self,
        set: &ReplicatedVolume,
        name: &str,
    ) -> Result<Option<SnapshotIntent>> {
        if self.cluster.membership().is_none() && self.cfg.cluster.etcd.is_empty() {
            return Ok(None);
        }
        let volume = &set.name;
        let Some(epoch) = self.cluster.owned_epoch(volume) else {
            return Err(Error::busy(format!(
                "cannot snapshot '{volume}': the cluster has not confirmed that this node \
                 owns it (not joined yet, or another node took it over)"
            )));
        };
        self.resolve_snapshot_intent_locked(volume).map_err(|why| {
            Error::busy(format!(
                "cannot snapshot '{volume}': an earlier snapshot create of it was cut off \
                 and is not undone yet ({why}); try again later"
            ))
        })?;
        let intent = SnapshotIntent {
            name: name.to_string(),
            epoch,
            replicas: self.replica_places(set).0,
        };
        match self.edit_owned_spec(volume, |s| s.snapshot_intent = Some(intent.clone())) {
            Ok(()) => Ok(Some(intent)),
            Err(SpecRefusal::Lost(why) | SpecRefusal::Unavailable(why)) => {
                Err(Error::busy(format!(
                    "cannot snapshot '{volume}': its intent could not be recorded in the \
                     cluster ({why}); nothing was taken"
                )))
            }
        }
    }

    /// A create that will not complete: undo its intents (copies deleted, intents
    /// removed; what cannot be done now the watcher does later).
    fn abandon_snapshot_intents(&self, intents: &[(String, SnapshotIntent)]) {
        for (volume, intent) in intents {
            let left = self.undo_snapshot_copies(volume, intent);
            let r = self.edit_owned_spec(volume, |s| {
                if s.snapshot_intent.as_ref().map(|i| &i.name) == Some(&intent.name) {
                    s.snapshot_intent = if left.is_empty() {
                        None
                    } else {
                        Some(SnapshotIntent {
                            replicas: left.iter().map(|(p, _)| p.clone()).collect(),
                            ..intent.clone()
                        })
                    };
                }
            });
            if !left.is_empty() || r.is_err() {
                warn!(volume = %volume, snapshot = %intent.name, left = ?left,
                      "a snapshot create that did not complete is not undone everywhere yet: the owner finishes the undo");
            }
        }
    }

    /// Undo an intent left in the spec of owned volume `volume` by a create that did not
    /// complete (the admin lock held): delete every copy it names, then remove it. Err
    /// says what stays (the intent then names only those replicas).
    pub(super) fn resolve_snapshot_intent_locked(&self, volume: &str) -> Result<()> {
        let Some(m) = self.cluster.membership() else {
            return Ok(());
        };
        let me = self.cfg.node_name();
        let intent = match self.read_spec(m, volume) {
            Ok(Some((spec, _)))
                if spec.owner != me || Some(spec.epoch) != self.cluster.owned_epoch(volume) =>
            {
                return Err(Error::busy(format!(
                    "'{}' owns the volume at epoch {}",
                    spec.owner, spec.epoch
                )))
            }
            Ok(Some((spec, _))) => match spec.snapshot_intent {
                Some(i) => i,
                None => return Ok(()),
            },
            Ok(None) => return Ok(()),
            Err(e) => return Err(e),
        };
        warn!(volume = %volume, snapshot = %intent.name, epoch = intent.epoch, replicas = ?intent.replicas,
              "a snapshot create was cut off before it completed (its owner died or failed midway): deleting its copies");
        let left = self.undo_snapshot_copies(volume, &intent);
        let places: Vec<String> = left.iter().map(|(p, _)| p.clone()).collect();
        let r = self.edit_owned_spec(volume, |s| {
            if s.snapshot_intent.as_ref() == Some(&intent) {
                s.snapshot_intent = if places.is_empty() {
                    None
                } else {
                    Some(SnapshotIntent {
                        replicas: places.clone(),
                        ..intent.clone()
                    })
                };
            }
        });
        if let Err(SpecRefusal::Lost(why) | SpecRefusal::Unavailable(why)) = r {
            return Err(Error::unavailable(format!(
                "the spec was not updated: {why}"
            )));
        }
        if left.is_empty() {
            info!(volume = %volume, snapshot = %intent.name, "the cut-off snapshot is undone: no replica holds a copy");
            Ok(())
        } else {
            let why: Vec<String> = left.into_iter().map(|(p, w)| format!("{p}: {w}")).collect();
            warn!(volume = %volume, snapshot = %intent.name, left = ?why, "copies of the cut-off snapshot stay for now: retried");
            Err(Error::unavailable(format!(
                "the copies of snapshot '{}' on {} are not deleted yet",
                intent.name,
                why.join("; ")
            )))
        }
    }

    /// Delete the copies of `intent`'s snapshot on the replicas of owned volume `volume`:
    /// what stays, with why. A place no longer among the volume's replicas (the old
    /// owner's, a lost or removed one) is not asked: its copy goes with its replica volume
    /// (a given-up copy and a deleted replica take their snapshots with them).
    fn undo_snapshot_copies(&self, volume: &str, intent: &SnapshotIntent) -> Vec<(String, String)> {
        let me = self.cfg.node_name();
        let Some(rv) = self.replicas.get(volume) else {
            return intent
                .replicas
                .iter()
                .map(|p| (p.clone(), "the volume is not open on its owner".to_string()))
                .collect();
        };
        let mut left = Vec::new();
        for place in &intent.replicas {
            let node = node_of(place);
            if node == me {
                if let Some(why) = self.drop_local_copy(&rv, &intent.name) {
                    left.push((place.clone(), why));
                }
                continue;
            }
            let remote = rv.descs().into_iter().find_map(|d| match d {
                LegDesc::Remote {
                    node: n, volume, ..
                } if n == node => Some(volume),
                _ => None,
            });
            if let Some(rvol) = remote {
                if let Some(why) = self.drop_snapshot_on_replica(node, &rvol, &intent.name) {
                    left.push((place.clone(), why));
                }
            }
        }
        left
    }

    /// Delete snapshot `name` of this node's replica of `rv` if it is in that replica's
    /// chain: None when it is gone (or was never taken), else why not.
    fn drop_local_copy(&self, rv: &ReplicatedVolume, name: &str) -> Option<String> {
        let local = rv.local_volume()?;
        let (p, snap) = self.find_snapshot(name).ok()?;
        if !local.ancestors().iter().any(|a| Arc::ptr_eq(a, &snap)) {
            return None;
        }
        match p.delete_volume(&snap) {
            Ok(()) => {
                self.groups.forget_volume(name);
                None
            }
            Err(e) => Some(e.to_string()),
        }
    }

    /// What takes a snapshot of `volume` here: a plain volume, or the local replica of a
    /// replicated volume this node owns (the other replicas take copies).
    fn snapshot_source(&self, volume: &str) -> Result<SnapshotSource> {
        if let Some(set) = self.replicas.get(volume) {
            let local = set.local_volume().ok_or_else(|| {
                Error::invalid(format!(
                    "volume '{volume}' has no replica on this node: a snapshot is taken \
                     where the owner holds one"
                ))
            })?;
            let (pool, local) = self.pools().find_volume(&local.name)?;
            return Ok(SnapshotSource {
                pool,
                local,
                name: volume.to_string(),
                set: Some(set),
            });
        }
        let (pool, v) = self.pools().find_volume(volume)?;
        if let Some(why) = self.replicas.blocked(&v) {
            return Err(Error::busy(format!(
                "volume '{volume}' is replicated and not served now ({why}): no snapshot"
            )));
        }
        if let Some(owner) = self.replica_held_for(volume) {
            return Err(Error::invalid(format!(
                "volume '{volume}' is a replica held for node '{owner}': snapshot the \
                 volume on its owner, which takes a copy on every replica at one point"
            )));
        }
        let set = self.replicas.of(&v);
        Ok(SnapshotSource {
            pool,
            local: v,
            name: volume.to_string(),
            set,
        })
    }

    /// The owner this node holds replica volume `volume` for, if it is one.
    fn replica_held_for(&self, volume: &str) -> Option<String> {
        let prefix = replica_nqn("", "");
        let prefix = prefix.trim_end_matches(':');
        self.nvmf_list()
            .into_iter()
            .filter(|s| s.namespaces.iter().any(|n| n.volume == volume))
            .find_map(|s| {
                let rest = s.nqn.strip_prefix(prefix)?.strip_prefix(':')?;
                let (owner, vol) = rest.split_once(':')?;
                (vol == volume).then(|| owner.to_string())
            })
    }

    /// Ask a replica's node for its copy of a snapshot.
    fn snapshot_on_replica(&self, c: &RemoteCopy) -> Result<()> {
        let peer = self.peer(&c.node)?;
        let body = serde_json::to_value(ReplicaSnapshot {
            name: c.name.clone(),
            owner: self.cfg.node_name(),
        })
        .map_err(|e| Error::invalid(e.to_string()))?;
        let path = format!("/v1/replicas/{}/snapshots", c.volume);
        match self.peer_call(&peer, "POST", &path, Some(&body))? {
            (s, _) if (200..300).contains(&s) => Ok(()),
            (s, t) => Err(Error::invalid(format!(
                "node '{}' refused (HTTP {s}): {}",
                c.node,
                t.trim()
            ))),
        }
    }

    /// Ask a replica's node to delete its copy of a snapshot: None when it did (or had
    /// none), else why not.
    fn drop_snapshot_on_replica(&self, node: &str, volume: &str, name: &str) -> Option<String> {
        let path = format!(
            "/v1/replicas/{volume}/snapshots/{name}?owner={}",
            self.cfg.node_name()
        );
        match self
            .peer(node)
            .and_then(|p| self.peer_call(&p, "DELETE", &path, None))
        {
            Ok((s, _)) if (200..300).contains(&s) || s == 404 => None,
            Ok((s, t)) => Some(format!("node '{node}' (HTTP {s}): {}", t.trim())),
            Err(e) => Some(format!("node '{node}' could not be reached ({e})")),
        }
    }

    /// Replica holder side of `POST /v1/replicas/VOLUME/snapshots`: a snapshot of the
    /// replica this node holds for `owner` (its owner holds the volume's writes).
    pub fn snapshot_replica(&self, volume: &str, req: &ReplicaSnapshot) -> Result<SnapshotInfo> {
        let _g = self.admin();
        self.check_replica_owner(volume, &req.owner)?;
        if self.pools().find_volume(&req.name).is_ok() {
            return Err(Error::already_exists(format!(
                "a volume or snapshot named '{}' already exists on this node",
                req.name
            )));
        }
        let (p, v) = self.pools().find_volume(volume)?;
        p.create_snapshots(&[(v, req.name.clone())])?;
        info!(volume, snapshot = %req.name, owner = %req.owner, "snapshot of a replica taken for its owner");
        self.snapshot_info(&p, &req.name)
    }

    /// Replica holder side of `DELETE /v1/replicas/VOLUME/snapshots/NAME`.
    pub fn delete_replica_snapshot(&self, volume: &str, name: &str, owner: &str) -> Result<()> {
        {
            let _g = self.admin();
            self.check_replica_owner(volume, owner)?;
            let (_, v) = self.pools().find_volume(volume)?;
            if !v.ancestors().iter().any(|a| a.name == name) {
                return Err(Error::missing(
                    "snapshot",
                    &format!("{name} (of replica '{volume}')"),
                ));
            }
        }
        self.delete_volume(name)
    }

    /// Only the replica's owner (its fence's, once claimed) may snapshot it.
    fn check_replica_owner(&self, volume: &str, owner: &str) -> Result<()> {
        let holder = match self.replica_fence(volume)? {
            Some((fenced, _)) => Some(fenced),
            None => self.replica_held_for(volume),
        };
        match holder {
            Some(o) if o == owner => Ok(()),
            Some(o) => Err(Error::busy(format!(
                "replica '{volume}' is held for node '{o}', not '{owner}'"
            ))),
            None => Err(Error::missing("replica", volume)),
        }
    }

    pub fn list_snapshots(&self) -> Vec<SnapshotInfo> {
        let mut out = Vec::new();
        for p in self.pools().list() {
            for s in p.snapshots() {
                if let Ok(i) = self.snapshot_info(&p, &s.name) {
                    out.push(i);
                }
            }
        }
        out
    }

    /// Delete a snapshot (refused while exported, like a volume). Its space comes back
    /// once no volume reads through it. A snapshot of a replicated volume this node owns
    /// is deleted on its replicas too.
    pub fn delete_snapshot(&self, name: &str) -> Result<DeletedSnapshot> {
        let (_, s) = self.find_snapshot(name)?;
        // The replicated volumes reading through it (before the chain changes).
        let sets: Vec<Arc<ReplicatedVolume>> = self
            .replicas
            .all()
            .into_iter()
            .filter(|rv| {
                rv.local_volume()
                    .is_some_and(|v| v.ancestors().iter().any(|a| Arc::ptr_eq(a, &s)))
            })
            .collect();
        self.delete_volume(name)?;
        let mut not_deleted = Vec::new();
        for rv in sets {
            for d in rv.descs() {
                if let LegDesc::Remote { node, volume, .. } = &d {
                    if let Some(why) = self.drop_snapshot_on_replica(node, volume, name) {
                        warn!(snapshot = name, replica = %d.place(), why = %why, "a replica's copy of the snapshot stays");
                        not_deleted.push(format!("{}: {why}", d.place()));
                    }
                }
            }
        }
        Ok(DeletedSnapshot {
            deleted: name.to_string(),
            not_deleted,
        })
    }

    /// A writable clone `name` of snapshot `snapshot`.
    pub fn clone_volume(&self, snapshot: &str, name: &str, force: bool) -> Result<VolumeInfo> {
        let _g = self.admin();
        if self.pools().find_volume(name).is_ok() {
            return Err(Error::already_exists(format!(
                "volume '{name}' already exists"
            )));
        }
        let (p, s) = self.find_snapshot(snapshot)?;
        let v = p.clone_snapshot(&s, name, force)?;
        tracing::info!(pool = %p.name(), snapshot, volume = name, "clone created");
        Ok(self.volume_info(&p, &v))
    }

    /// Roll `volume` back to its snapshot `to`; refused while it is exported or open.
    pub fn rollback_volume(&self, volume: &str, to: &str) -> Result<VolumeInfo> {
        let _g = self.admin();
        let (p, v) = self.pools().find_volume(volume)?;
        self.refuse_replicated(&v)?;
        if let Some(nqn) = self.nvmf.subsystem_using(&p.uuid(), v.id) {
            return Err(Error::busy(format!(
                "volume '{volume}' is a namespace of NVMe subsystem '{nqn}'; remove it before a rollback"
            )));
        }
        if let Some(iqn) = self.iscsi.target_using(&p.uuid(), v.id) {
            return Err(Error::busy(format!(
                "volume '{volume}' is a LUN of iSCSI target '{iqn}'; delete the target before a rollback"
            )));
        }
        let (sp, s) = self.find_snapshot(to)?;
        if !Arc::ptr_eq(&p, &sp) {
            return Err(Error::invalid(format!(
                "'{to}' is not a snapshot of volume '{volume}'"
            )));
        }
        p.rollback_volume(&v, &s)?;
        tracing::info!(pool = %p.name(), volume, snapshot = to, "volume rolled back");
        Ok(self.volume_info(&p, &v))
    }

    /// The ranges of `volume` (a volume, clone or snapshot) that may differ from its
    /// older snapshot `since`.
    pub fn changed_extents(&self, volume: &str, since: &str) -> Result<ChangedExtents> {
        let (p, v) = self.pools().find_volume(volume)?;
        let (_, s) = self.find_snapshot(since)?;
        let extents: Vec<Extent> = p
            .changed_extents(&s, &v)?
            .into_iter()
            .map(|(offset, length)| Extent { offset, length })
            .collect();
        Ok(ChangedExtents {
            volume: volume.to_string(),
            since: since.to_string(),
            size: v.size(),
            changed: extents.iter().map(|e| e.length).sum(),
            extents,
        })
    }

    /// A rollback acts on one node's copy: on a replicated volume it would have to
    /// happen on every replica at one point with the volume not served, which is not
    /// built; a clone of the snapshot is the way back.
    fn refuse_replicated(&self, v: &tessera_pool::Volume) -> Result<()> {
        if self.replicas.of(v).is_some() || self.replicas.blocked(v).is_some() {
            return Err(Error::invalid(format!(
                "volume '{}' is replicated: it cannot be rolled back in place (every replica \
                 would have to go back at once); clone the snapshot instead (`tessera volume \
                 clone SNAPSHOT --name NEW`) and serve the clone",
                v.name
            )));
        }
        if let Some(owner) = self.replica_held_for(&v.name) {
            return Err(Error::invalid(format!(
                "volume '{}' is a replica held for node '{owner}': it cannot be rolled back here",
                v.name
            )));
        }
        Ok(())
    }
}
