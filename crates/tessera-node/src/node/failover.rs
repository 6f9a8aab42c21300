//! Failover (issue 13; docs/architecture.md "Cluster", rules in docs/format.md §12): the
//! watcher every member runs (node/ownership.rs has the owner's side: the epoch it holds
//! and the spec it changes under it). Each round it
//! - takes over a volume whose owner's lease expired when this node holds an in-sync
//!   replica (epoch + 1; fence its own replica, claim the others, open the volume with
//!   them needing a copy from this node's replica, export it);
//! - gives up a volume another node took over (the stale owner's replica set closes,
//!   every I/O on it fails, its copy is deleted: the new owner adds it back as a fresh
//!   replica), retrying the stale copies whose connections kept them;
//! - on an owner: re-adds a lost node's replica when the node is back, replaces it on
//!   another node after the grace period, within a cluster-wide limit of concurrent
//!   copies.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_io::cast::DurationU64;

use tessera_api::{ClusterVolume, LostReplica};
use tessera_cluster::{placement, volume_key, PREFIX};
use tessera_replica::{LegDesc, LegState, ReplicatedVolume, SetDesc};
use tracing::{error, info, warn};

use super::ownership::{node_of, now_ms, rebuild_key};
use super::{Error, Node, Result};

impl Node {
    /// Give up `volume` from a thread (the caller may hold locks the give-up takes).
    pub(super) fn give_up_later(&self, volume: &str, why: &str) {
        let Some(me) = self.self_ref.get().cloned() else {
            return;
        };
        let (volume, why) = (volume.to_string(), why.to_string());
        let _ = std::thread::Builder::new()
            .name("tessera-giveup".into())
            .spawn(move || {
                if let Some(n) = me.upgrade() {
                    n.give_up(&volume, &why);
                }
            });
    }

    /// Another node owns `volume` now: stop serving it and delete this node's stale copy
    /// (every acknowledged write is on the new owner's replicas, docs/architecture.md
    /// "Cluster"); the new owner adds this node back as a fresh replica.
    pub(super) fn give_up(&self, volume: &str, why: &str) {
        let _g = self.admin();
        if self.cluster.owned_epoch(volume).is_none() && self.replicas.get(volume).is_none() {
            return;
        }
        warn!(volume = %volume, reason = %why, "this node no longer owns the volume: giving it up");
        self.cluster.set_owned(volume, None);
        let rv = self.replicas.give_up(volume, why);
        // Inaccessible here before its data goes (hosts move to the owner's path).
        if let Some(rv) = &rv {
            self.set_cluster_path(volume, false, rv.size());
        }
        let Some(rv) = rv else { return };
        rv.close();
        let local = rv.local_volume();
        let _ = std::fs::remove_file(rv.path());
        let Some(v) = local else { return };
        let Ok((p, _)) = self.pools().find_volume(&v.name) else {
            return;
        };
        for e in p.exports() {
            if e.volume_id == v.id {
                if let Err(err) = p.remove_export(&e.name) {
                    warn!(export = %e.name, error = %err, "cannot remove the export of a given-up volume");
                }
            }
        }
        drop(rv);
        // Connections still open on it end with errors; deleting waits for them a little,
        // then the watcher tries again each round.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !self.delete_stale_copy(volume, &v.name) {
            if Instant::now() >= deadline {
                warn!(volume = %v.name, "the stale copy of a given-up volume is still in use: it is not served, and deleted once its connections end");
                self.cluster.keep_stale(volume, &v.name);
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Delete the stale copy `local` of given-up volume `volume` if nothing uses it any
    /// more, with its snapshots (the new owner's replicas have them; a snapshot a clone
    /// reads through stays, with the older ones: the clone is a user's volume); true when
    /// it is gone.
    fn delete_stale_copy(&self, volume: &str, local: &str) -> bool {
        let Ok((p, v)) = self.pools().find_volume(local) else {
            return true;
        };
        let snapshots = super::lineage::own_snapshots(&p, &v);
        if p.delete_volume(&v).is_err() {
            return false;
        }
        info!(volume = %local, "stale copy of a given-up volume deleted");
        self.groups.forget_volume(local);
        for s in snapshots {
            for e in p.exports() {
                if e.volume_id == s.id {
                    let _ = p.remove_export(&e.name);
                }
            }
            match p.delete_volume(&s) {
                Ok(()) => {
                    info!(volume = %local, snapshot = %s.name, "snapshot of the given-up copy deleted");
                    self.groups.forget_volume(&s.name);
                }
                Err(e) => {
                    warn!(volume = %local, snapshot = %s.name, error = %e, "a snapshot of the given-up copy stays: delete it by hand")
                }
            }
        }
        // The name is free again: a new replica of it may come here.
        self.replicas.unblock(volume);
        true
    }

    /// Stale copies whose connections kept them: try again.
    fn retry_stale_copies(&self) {
        let stale = self.cluster.stale();
        for (volume, local) in stale {
            let _g = self.admin();
            if self.delete_stale_copy(&volume, &local) {
                self.cluster.forget_stale(&volume);
            }
        }
    }

    /// The replica of `volume` this node holds for another owner: its volume name and
    /// NVMe/TCP subsystem.
    fn held_replica(&self, volume: &str) -> Option<(String, String)> {
        let prefix = format!("{volume}.");
        self.nvmf_list().into_iter().find_map(|s| {
            if !s.nqn.starts_with("nqn.2026-11.io.tessera:replica:") {
                return None;
            }
            s.namespaces
                .iter()
                .find(|n| n.volume == volume || n.volume.starts_with(&prefix))
                .map(|n| (n.volume.clone(), s.nqn.clone()))
        })
    }

    /// Take `volume` over (rule 5 of docs/format.md §12): its owner's lease expired and
    /// this node holds an in-sync replica.
    fn take_over(&self, volume: &str) -> Result<bool> {
        let _g = self.admin();
        let m = self.in_cluster()?;
        let me = self.cfg.node_name();
        let Some((spec, rev)) = self.read_spec(m, volume)? else {
            return Ok(false);
        };
        let live = m.nodes().map_err(|e| Error::io("reading the cluster", e))?;
        if spec.owner == me
            || live.iter().any(|n| n.name == spec.owner)
            || !spec.in_sync_on(&me)
            || m.lease_valid_until().is_none()
        {
            return Ok(false);
        }
        let Some((replica_vol, my_nqn)) = self.held_replica(volume) else {
            return Ok(false);
        };
        let (pool, local) = self.pools().find_volume(&replica_vol)?;
        let my_place = spec.place_on(&me).unwrap_or_default().to_string();
        let old_place = spec.place_on(&spec.owner).map(str::to_string);
        let mut next = spec.clone();
        next.owner = me.clone();
        next.epoch = spec.epoch + 1;
        next.copies = spec.wanted_copies();
        next.replicas
            .retain(|p| Some(p) != old_place.as_ref() && *p != my_place);
        next.replicas.insert(0, my_place.clone());
        if let Some(p) = &old_place {
            next.lost.push(LostReplica {
                place: p.clone(),
                since_ms: now_ms(),
            });
        }
        next.out_of_sync = next.replicas[1..].to_vec();
        let value = serde_json::to_vec(&next).map_err(|e| Error::invalid(e.to_string()))?;
        let started = Instant::now();
        match m.etcd().swap(&volume_key(volume), rev, &value, 0) {
            Ok(true) => {}
            Ok(false) => return Ok(false), // another member was first
            Err(e) => return Err(Error::io("taking the volume over", e)),
        }
        let epoch = next.epoch;
        warn!(volume = %volume, old_owner = %spec.owner, epoch, "owner lost: taking the volume over");
        self.cluster.set_owned(volume, Some(epoch));
        // 1. This node's own replica first: once the claim returns, nothing the old
        // owner sends reaches it, so nothing it acknowledges from now on lacks it.
        let own = self.claim_replica_locked(&replica_vol, &me, epoch)?;
        let claimed_at = Instant::now();
        self.nvmf_remove_subsystem_waiting(&my_nqn);
        // 2. The others: claimed at the new epoch; each gets a copy of this node's
        // replica (the old owner's activity log, which said where they may differ, is
        // gone with it).
        let mut legs = vec![LegDesc::Local {
            pool: pool.name().to_string(),
            volume: replica_vol.clone(),
        }];
        let mut states = vec![LegState::InSync];
        let mut unreachable = Vec::new();
        for place in &next.replicas[1..] {
            let (node, ppool) = place.split_once(':').unwrap_or((place, ""));
            let claimed = self.peer(node).and_then(|peer| {
                let body = serde_json::json!({"owner": me, "epoch": epoch});
                let rvol = self
                    .peer_replica_volume(&peer, volume)
                    .unwrap_or_else(|| volume.to_string());
                let (status, text) = self.peer_call(
                    &peer,
                    "POST",
                    &format!("/v1/replicas/{rvol}/claim"),
                    Some(&body),
                )?;
                if !(200..300).contains(&status) {
                    return Err(Error::invalid(format!(
                        "claim refused (HTTP {status}): {}",
                        text.trim()
                    )));
                }
                let f: tessera_api::ReplicaFence =
                    serde_json::from_str(&text).map_err(|e| Error::io("claim answer", e))?;
                let spec = f
                    .spec
                    .ok_or_else(|| Error::invalid("the claim answer has no NVMe/TCP address"))?;
                Ok(LegDesc::Remote {
                    node: node.to_string(),
                    pool: ppool.to_string(),
                    volume: f.volume,
                    spec: super::replicas::reachable_spec(&spec, &peer.api),
                })
            });
            match claimed {
                Ok(leg) => {
                    legs.push(leg);
                    states.push(LegState::NeedsFull);
                }
                Err(e) => {
                    warn!(volume = %volume, replica = %place, error = %e, "replica not claimed at takeover: treated as lost");
                    unreachable.push(place.clone());
                }
            }
        }
        // 3. Open the volume on this node: its replica in sync, the others to be copied.
        let path = self.replicas.set_path(volume);
        let _ = std::fs::remove_file(&path);
        let rv = ReplicatedVolume::create_with(
            &self.replicas.dir(),
            SetDesc {
                name: volume.to_string(),
                legs,
            },
            states,
            spec.size,
            Some(local.clone()),
            self.replica_options()?,
            self.replicas.cores(),
        )
        .map_err(|e| Error::io("opening the volume taken over", e))?;
        self.fence_volume(&rv);
        self.replicas.insert_unblocked(volume, rv);
        // Replicas that could not be claimed leave the set (they are re-added or
        // replaced like a lost node's).
        if !unreachable.is_empty() {
            let since = now_ms();
            let _ = self.edit_owned_spec(volume, |s| {
                for p in &unreachable {
                    s.replicas.retain(|x| x != p);
                    s.out_of_sync.retain(|x| x != p);
                    if !s.lost.iter().any(|l| &l.place == p) {
                        s.lost.push(LostReplica {
                            place: p.clone(),
                            since_ms: since,
                        });
                    }
                }
            });
        }
        // A snapshot create the old owner did not complete is undone before the volume
        // is served (what cannot be deleted now, the watcher retries).
        if let Err(why) = self.resolve_snapshot_intent_locked(volume) {
            warn!(volume = %volume, reason = %why, "a cut-off snapshot is not undone yet");
        }
        // 4. Served under the volume's name, as on the old owner. If the claim ended a
        // connection of the old owner, it may have had an answer from this replica just
        // before, and serve reads until that answer is a read lease old: no write is
        // taken here before then, so no read there returns data older than a write
        // acknowledged here (a killed owner's connections are gone: no wait).
        if own.evicted > 0 {
            let wait = self.read_lease().saturating_sub(claimed_at.elapsed());
            info!(volume = %volume, wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                  "the old owner was still connected: waiting out its read lease before serving");
            std::thread::sleep(wait);
        }
        self.set_cluster_path(volume, true, spec.size);
        self.export_owned(volume);
        info!(volume = %volume, epoch, took_ms = started.elapsed().millis_u64(),
              "volume taken over: serving");
        Ok(true)
    }

    /// The name of the replica volume a peer holds for cluster volume `volume` (cluster
    /// replicas are named like the volume; older ones `VOLUME.OWNER`).
    fn peer_replica_volume(&self, peer: &crate::config::PeerDecl, volume: &str) -> Option<String> {
        let (status, text) = self
            .peer_call(peer, "GET", "/v1/nvmf/subsystems", None)
            .ok()?;
        if !(200..300).contains(&status) {
            return None;
        }
        let subs: Vec<tessera_api::SubsystemInfo> = serde_json::from_str(&text).ok()?;
        let prefix = format!("{volume}.");
        subs.into_iter()
            .filter(|s| s.nqn.starts_with("nqn.2026-11.io.tessera:replica:"))
            .flat_map(|s| s.namespaces)
            .map(|n| n.volume)
            .find(|v| v == volume || v.starts_with(&prefix))
    }

    /// Remove an NVMe/TCP subsystem whose connections are ending.
    fn nvmf_remove_subsystem_waiting(&self, nqn: &str) {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match self.nvmf_remove_subsystem(nqn) {
                Err(crate::error::Error::Busy(_)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    warn!(nqn = %nqn, error = %e, "cannot remove the replica subsystem");
                    return;
                }
                Ok(()) => return,
            }
        }
    }

    /// Start the watcher (at join).
    pub(super) fn start_ownership_watch(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let every = Duration::from_millis((self.cfg.cluster.lease_ttl_ms / 4).clamp(250, 2000));
        let _ = std::thread::Builder::new()
            .name("tessera-owners".into())
            .spawn(move || {
                let mut absent: BTreeMap<String, Instant> = BTreeMap::new();
                loop {
                    std::thread::sleep(every);
                    let Some(n) = weak.upgrade() else { return };
                    if n.stopping.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    n.watch_once(&mut absent);
                }
            });
    }

    fn watch_once(&self, absent: &mut BTreeMap<String, Instant>) {
        self.retry_stale_copies();
        let Some(m) = self.cluster.membership() else {
            return;
        };
        if m.lease_valid_until().is_none() {
            return;
        }
        let me = self.cfg.node_name();
        // The specs and members as the watches delivered them (no listing per round:
        // docs/cluster-scale.md); a round is skipped while a watch reconnects, as it
        // was when a read failed.
        let (Some(Ok(specs)), Some(Ok(live))) = (self.cached_cluster_volumes(), m.cached_nodes())
        else {
            return;
        };
        let addrs: BTreeMap<String, String> = live
            .iter()
            .filter_map(|n| n.nvmf.clone().map(|a| (n.name.clone(), a)))
            .collect();
        let live: Vec<String> = live.into_iter().map(|n| n.name).collect();
        for spec in specs {
            self.advertise_paths(&spec, &addrs);
            let mine = self.cluster.owned_epoch(&spec.name);
            if spec.owner == me {
                if mine == Some(spec.epoch) {
                    self.maintain(&spec, &live, absent);
                } else if mine.is_none() && self.replicas.get(&spec.name).is_some() {
                    // Held back at start because etcd did not answer then: confirm now.
                    self.confirm_ownership();
                }
                continue;
            }
            if mine.is_some() {
                self.give_up(
                    &spec.name,
                    &format!("'{}' owns it at epoch {}", spec.owner, spec.epoch),
                );
                continue;
            }
            if self.cfg.cluster.failover && !live.contains(&spec.owner) && spec.in_sync_on(&me) {
                if let Err(e) = self.take_over(&spec.name) {
                    error!(volume = %spec.name, error = %e, "takeover failed");
                }
            }
        }
    }

    /// A replica holder serves a standby NVMe/TCP path of the volume, and every holder's
    /// discovery lists the other holders' paths, so a multipath host finds them all and
    /// the owner's is the optimized one. Likewise over iSCSI: a standby path, and every
    /// holder's REPORT TARGET PORT GROUPS lists the others' groups with their states.
    fn advertise_paths(&self, spec: &ClusterVolume, addrs: &BTreeMap<String, String>) {
        if !self.cfg.nvmf.enabled && !self.iscsi_serves() {
            return;
        }
        let me = self.cfg.node_name();
        if spec.place_on(&me).is_none() {
            return;
        }
        if spec.owner != me && self.cluster.owned_epoch(&spec.name).is_none() {
            self.set_cluster_path(&spec.name, false, spec.size);
        }
        self.set_iscsi_groups(spec);
        if !self.cfg.nvmf.enabled {
            return;
        }
        let others: Vec<String> = spec
            .replicas
            .iter()
            .map(|p| node_of(p))
            .filter(|n| *n != me)
            .filter_map(|n| addrs.get(n).cloned())
            .collect();
        let _ = self.set_discovery_paths(&spec.name, &others);
    }

    /// An owner's care of its volume's replicas: a replica whose node stays away past the
    /// grace period becomes lost; a lost one is re-added when its node is back, or
    /// replaced on another node after the grace period.
    fn maintain(
        &self,
        spec: &ClusterVolume,
        live: &[String],
        absent: &mut BTreeMap<String, Instant>,
    ) {
        let me = self.cfg.node_name();
        // The spec lags the replica set when etcd was away as a replica came back in
        // sync (or a change was not recorded): catch up.
        let rv = self.replicas.get(&spec.name);
        if let Some(rv) = rv {
            let (places, out) = self.replica_places(&rv);
            if places != spec.replicas || out != spec.out_of_sync {
                let _ = self.publish_replica_states(&spec.name);
            }
        }
        // A snapshot create left open (cut off, or its end not recorded): undo it.
        if spec.snapshot_intent.is_some() {
            let _g = self.admin();
            let _ = self.resolve_snapshot_intent_locked(&spec.name);
        }
        let grace = Duration::from_millis(self.cfg.cluster.grace_ms);
        for place in spec.replicas.iter().filter(|p| node_of(p) != me) {
            let key = format!("{}/{place}", spec.name);
            if live.iter().any(|n| n == node_of(place)) {
                absent.remove(&key);
                continue;
            }
            let since = *absent.entry(key.clone()).or_insert_with(Instant::now);
            if since.elapsed() < grace {
                continue;
            }
            warn!(volume = %spec.name, replica = %place, "replica's node lost past the grace period: replacing it");
            match self.remove_replica(&spec.name, place) {
                Ok(_) => {
                    absent.remove(&key);
                    let p = place.clone();
                    let _ = self.edit_owned_spec(&spec.name, |s| {
                        if !s.lost.iter().any(|l| l.place == p) {
                            s.lost.push(LostReplica {
                                place: p.clone(),
                                since_ms: now_ms().saturating_sub(grace.millis_u64()),
                            });
                        }
                    });
                }
                Err(e) => {
                    warn!(volume = %spec.name, replica = %place, error = %e, "cannot remove the lost replica")
                }
            }
        }
        for lost in &spec.lost {
            let back = live.iter().any(|n| n == node_of(&lost.place));
            let expired = now_ms().saturating_sub(lost.since_ms) >= grace.millis_u64();
            if !back && !expired {
                continue;
            }
            let Some(m) = self.cluster.membership() else {
                return;
            };
            let running = m
                .etcd()
                .list(&format!("{PREFIX}rebuilds/"))
                .map_or(usize::MAX, |l| l.len());
            if running >= self.cfg.cluster.max_rebuilds.max(1) {
                return;
            }
            let place = if back {
                lost.place.clone()
            } else {
                let Ok(nodes) = m.nodes() else { return };
                let fixed: Vec<&str> = spec.replicas.iter().map(|p| node_of(p)).collect();
                let want = fixed.len() + 1;
                match placement::place(&nodes, want, &fixed, placement::DEFAULT_LEVELS) {
                    Ok(placed) => match placed
                        .iter()
                        .map(|p| p.to_string())
                        .find(|p| !fixed.contains(&node_of(p)))
                    {
                        Some(p) => p,
                        None => continue,
                    },
                    Err(why) => {
                        warn!(volume = %spec.name, reason = %why, "no node to replace a lost replica on");
                        continue;
                    }
                }
            };
            let value = serde_json::json!({"volume": spec.name, "place": place, "owner": me});
            if !matches!(
                m.etcd().create(
                    &rebuild_key(&spec.name),
                    value.to_string().as_bytes(),
                    m.lease()
                ),
                Ok(true)
            ) {
                return;
            }
            info!(volume = %spec.name, replica = %place, lost = %lost.place, node_back = back,
                  "adding a replica in place of a lost one");
            match self.add_replica(&spec.name, &place) {
                Ok(_) => {
                    let lp = lost.place.clone();
                    let _ = self.edit_owned_spec(&spec.name, |s| s.lost.retain(|l| l.place != lp));
                }
                Err(e) => {
                    warn!(volume = %spec.name, replica = %place, error = %e, "cannot add the replacement replica yet");
                    let _ = m.etcd().delete(&rebuild_key(&spec.name));
                }
            }
            // One copy started per volume and round.
            return;
        }
    }
}
