//! Snapshots and clones: chains of thin volumes that share units (docs/format.md §3.4).
//!
//! A snapshot takes its volume's map (and the layer id its units carry in the owner
//! table) as it is; the volume goes on with an empty map that reads through the snapshot
//! where it has nothing of its own (redirect on write). The first write into a unit that
//! the chain has data for allocates a *partial* unit: only the blocks written land there,
//! a presence bitmap says which, and reads of the other blocks fall through to the parent.
//! So a 4 KiB write after a snapshot writes 4 KiB (plus, for a write smaller than a block,
//! the rest of its block read from the parent), never a whole unit. Here is the metadata
//! half of that first write, taken under the pool lock (`plan_first_write`,
//! `finish_first_write`); its data goes through the per-core datapath (`volume::first_write`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{ChainRecord, CHAIN_BLOCK_MAPPED, CHAIN_SNAPSHOT, OWNER_FREE};
use crate::pool::{now_secs, LayerChore, Pool, PoolCore, State};
use crate::volume::{UnitMap, Volume, HOLE};
use tessera_api::SnapshotInfo;
use tessera_io::cast::u32_of;

/// Which volumes read through `id`.
fn children_of(s: &State, id: u32) -> Vec<Arc<Volume>> {
    s.volumes
        .values()
        .filter(|v| v.parent_id() == Some(id))
        .cloned()
        .collect()
}

impl Pool {
    /// Take a snapshot of `vol` named `name`: metadata only (the snapshot takes the
    /// volume's map as it is, the volume goes on with an empty one reading through it),
    /// durable when this returns. Writes acknowledged before the call are in it.
    pub fn create_snapshot(&self, vol: &Arc<Volume>, name: &str) -> Result<Arc<Volume>> {
        self.create_snapshots(&[(vol.clone(), name.to_string())])
            .map(|mut v| v.remove(0))
    }

    /// Snapshots of several volumes at one point (a consistency group): one change
    /// under the pool lock, one checkpoint, so no write is in one and missing from
    /// another that was acknowledged before it.
    pub fn create_snapshots(&self, what: &[(Arc<Volume>, String)]) -> Result<Vec<Arc<Volume>>> {
        for (i, (vol, name)) in what.iter().enumerate() {
            crate::pool::validate_name("snapshot", name)?;
            if vol.is_snapshot() {
                return Err(Error::invalid(format!(
                    "'{}' is a snapshot already; clone it to get a volume",
                    vol.name
                )));
            }
            if what[..i]
                .iter()
                .any(|(v, n)| n == name || Arc::ptr_eq(v, vol))
            {
                return Err(Error::invalid(format!(
                    "snapshot '{name}' or volume '{}' named twice",
                    vol.name
                )));
            }
        }
        // Quiesced: writes to the volumes that began before the snapshot complete before
        // it takes their maps (a write landing in a unit after the snapshot took it would
        // be missing from the volume wherever a later first write copies the block), and
        // writes that begin meanwhile wait (`Volume::held`) and go to the new layer. The
        // wait is for the requests in flight on the pool (one device round trip, or the
        // device timeout at worst). A caller's own core is not waited for (see
        // `IoEpochs::drain`): drive it from another thread.
        let release = || {
            for (vol, _) in what {
                vol.hold_from(u64::MAX);
            }
        };
        // Ids for the snapshots and the volumes' new layers, taken first: a dedup
        // volume's new layer must read through the snapshot's in the dedup metadata
        // before the volume switches to it (a read meanwhile would find nothing), and
        // the dedup lock comes before the pool's.
        let first_id = {
            let mut s = self.core.lock();
            let id = s.next_volume_id;
            s.next_volume_id += 2 * u32_of(what.len() as u64);
            id
        };
        let dedup_layers: Vec<(u32, u32)> = what
            .iter()
            .enumerate()
            .filter(|(_, (v, _))| v.block_mapped())
            .map(|(i, (v, _))| (first_id + 2 * u32_of(i as u64) + 1, v.layer()))
            .collect();
        let d = self.core.dedup().filter(|_| !dedup_layers.is_empty());
        if let Some(d) = d {
            for &(new, old) in &dedup_layers {
                d.add_layer(new, Some(old));
            }
        }
        let unused = || {
            if let Some(d) = d {
                for &(new, _) in &dedup_layers {
                    d.remove_layer(new);
                }
            }
        };
        let quiesce = || {
            self.core.inflight.drain(|next| {
                for (vol, _) in what {
                    vol.hold_from(next);
                }
            });
        };
        let made = self.core.quiesce_change_and_checkpoint(quiesce, |s| {
            for (vol, name) in what {
                s.name_free(name)?;
                if vol.is_deleted() || !s.volumes.contains_key(&vol.id) {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        format!("volume '{}' not found", vol.name),
                    ));
                }
            }
            if dedup_layers
                .iter()
                .any(|&(_, old)| !what.iter().any(|(v, _)| v.layer() == old))
            {
                return Err(Error::new(
                    ErrorKind::Busy,
                    "a snapshot of the same volume was taken meanwhile; try again",
                ));
            }
            let mut made = Vec::new();
            for (i, (vol, name)) in what.iter().enumerate() {
                let id = first_id + 2 * u32_of(i as u64);
                let layer = id + 1;
                let snap = Volume::new(
                    self.core.clone(),
                    id,
                    name.clone(),
                    vol.size(),
                    now_secs(),
                    vol.current_map(),
                    Default::default(),
                );
                snap.set_chain(
                    ChainRecord {
                        flags: CHAIN_SNAPSHOT
                            | if vol.block_mapped() {
                                CHAIN_BLOCK_MAPPED
                            } else {
                                0
                            },
                        layer: vol.layer(),
                        parent: 0,
                    },
                    vol.parent(),
                );
                snap.allocated
                    .store(vol.allocated.swap(0, Relaxed), Relaxed);
                let units = vol.size().div_ceil(self.core.unit_size());
                vol.take_new_layer(layer, snap.clone(), UnitMap::new(units));
                s.volumes.insert(id, snap.clone());
                made.push(snap);
            }
            // The new maps are in place: held writes go on (into them), before the
            // checkpoint's syncs.
            release();
            Ok(made)
        });
        release();
        if made.is_err() {
            unused();
        }
        made
    }

    /// A writable volume `name` that reads through snapshot `snap` (a clone). Counts
    /// against the overcommit ratio like a new volume of the snapshot's size.
    pub fn clone_snapshot(
        &self,
        snap: &Arc<Volume>,
        name: &str,
        force: bool,
    ) -> Result<Arc<Volume>> {
        crate::pool::validate_name("volume", name)?;
        if !snap.is_snapshot() || snap.is_hidden() {
            return Err(Error::invalid(format!(
                "'{}' is not a snapshot: take a snapshot of it and clone that",
                snap.name
            )));
        }
        let made = self.core.change_then_checkpoint(
            || (),
            |s| {
                s.name_free(name)?;
                if !s.volumes.contains_key(&snap.id) {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        format!("snapshot '{}' not found", snap.name),
                    ));
                }
                self.check_overcommit(
                    s,
                    &format!(
                        "clone '{name}' of {}",
                        crate::pool::human_bytes(snap.size())
                    ),
                    snap.size(),
                    force,
                )?;
                let id = s.next_volume_id;
                s.next_volume_id += 1;
                let vol = Volume::new(
                    self.core.clone(),
                    id,
                    name.to_string(),
                    snap.size(),
                    now_secs(),
                    UnitMap::new(snap.size().div_ceil(self.core.unit_size())),
                    Default::default(),
                );
                vol.set_chain(
                    ChainRecord {
                        flags: if snap.block_mapped() {
                            CHAIN_BLOCK_MAPPED
                        } else {
                            0
                        },
                        layer: id,
                        parent: snap.id,
                    },
                    Some(snap.clone()),
                );
                s.volumes.insert(id, vol.clone());
                Ok(vol)
            },
            |vol| {
                if let Some(d) = self.core.dedup().filter(|_| vol.block_mapped()) {
                    d.add_layer(vol.layer(), Some(snap.layer()));
                }
            },
        );
        made
    }

    /// Give volume `vol` the contents of its snapshot `snap` back: its own units are
    /// freed and it reads through `snap` again. Refused while clients hold it open.
    pub fn rollback_volume(&self, vol: &Arc<Volume>, snap: &Arc<Volume>) -> Result<()> {
        let open = vol.open_handles();
        if open > 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "volume '{}' is in use ({open} open connection(s)): stop its clients \
                     and remove its exports before a rollback",
                    vol.name
                ),
            ));
        }
        if vol.is_snapshot() {
            return Err(Error::invalid(format!("'{}' is a snapshot", vol.name)));
        }
        if !vol.ancestors().iter().any(|a| Arc::ptr_eq(a, snap)) {
            return Err(Error::invalid(format!(
                "'{}' is not a snapshot of volume '{}'",
                snap.name, vol.name
            )));
        }
        self.core.change_then_checkpoint(
            || (),
            |s| {
                s.not_exported(vol, "before a rollback")?;
                let old_parent = vol.parent();
                free_own_units(&self.core, s, vol);
                let units = vol.size().div_ceil(self.core.unit_size());
                vol.take_new_layer(vol.layer(), snap.clone(), UnitMap::new(units));
                if let Some(p) = old_parent {
                    drop_unneeded(&self.core, s, &p);
                }
                Ok(())
            },
            |()| {
                // The layer's entries are dropped (`free_own_units`), then it reads
                // through the snapshot.
                self.core.apply_layer_chores();
                if let Some(d) = self.core.dedup().filter(|_| vol.block_mapped()) {
                    d.add_layer(vol.layer(), Some(snap.layer()));
                }
            },
        )
    }

    /// Delete a volume, snapshot or clone that no other volume reads through, or hide a
    /// snapshot that some still do (its units that no child reads any more are freed;
    /// the rest go with its last child). Called by `delete_volume`, under its checks.
    pub(crate) fn delete_in_chain(&self, s: &mut State, vol: &Arc<Volume>) {
        if children_of(s, vol.id).is_empty() {
            let parent = vol.parent();
            vol.mark_deleted();
            free_own_units(&self.core, s, vol);
            s.volumes.remove(&vol.id);
            if let Some(p) = parent {
                drop_unneeded(&self.core, s, &p);
            }
        } else {
            vol.hide();
            drop_unneeded(&self.core, s, vol);
        }
    }

    /// The pool's snapshots (hidden ones left out) with their space, as the API lists
    /// them (`replicas` and `missing`, which the node knows, left empty). A snapshot's
    /// `parent` is the nearest older snapshot of the same chain that still exists
    /// (deleted ones that volumes still read through are skipped:
    /// `Volume::listed_parent`); its `children` are the volumes and snapshots that list it
    /// as their parent.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let s = self.core.lock();
        let unit = self.core.unit_size();
        let mut dedup_layers = Vec::new();
        let mut list: Vec<SnapshotInfo> = s
            .volumes
            .values()
            .filter(|v| v.is_snapshot() && !v.is_hidden())
            .map(|v| {
                let children = children_of(&s, v.id);
                // As listed: the volumes whose nearest existing ancestor it is.
                let listed_children = s
                    .volumes
                    .values()
                    .filter(|c| {
                        !c.is_hidden() && c.listed_parent().is_some_and(|p| Arc::ptr_eq(&p, v))
                    })
                    .map(|c| c.name.clone())
                    .collect();
                let unread = unread_units(&self.core, v, &children).len() as u64;
                let own = v.allocated.load(Relaxed);
                if v.block_mapped() {
                    // Counted below, under the dedup lock (taken before the pool's).
                    let readers: Vec<u32> = children.iter().map(|c| c.layer()).collect();
                    dedup_layers.push((v.id, v.layer(), readers));
                }
                SnapshotInfo {
                    name: v.name.clone(),
                    pool: self.core.name.clone(),
                    id: v.id,
                    created: v.created,
                    size: v.size(),
                    parent: v.listed_parent().map(|p| p.name.clone()),
                    children: listed_children,
                    exclusive: unread * unit,
                    shared: own.saturating_sub(unread) * unit,
                    replicas: Vec::new(),
                    missing: Vec::new(),
                }
            })
            .collect();
        drop(s);
        if let Some(d) = self.core.dedup() {
            // A dedup snapshot's own blocks: exclusive where no other entry references
            // the block (shared with its volume, a clone or other data otherwise).
            for (id, layer, readers) in dedup_layers {
                let all = d.layer_bytes(layer);
                let exclusive = d.exclusive_bytes(layer, &readers);
                if let Some(i) = list.iter_mut().find(|i| i.id == id) {
                    i.exclusive = exclusive;
                    i.shared = all.saturating_sub(exclusive);
                }
            }
        }
        list
    }

    /// The byte ranges of `to` that may differ from snapshot `from`, an ancestor of
    /// `to` (an older snapshot of the same volume, or the snapshot a clone was made
    /// from): every block some member of the chain between them wrote. Sorted, merged.
    pub fn changed_extents(&self, from: &Arc<Volume>, to: &Arc<Volume>) -> Result<Vec<(u64, u64)>> {
        // Under the lock: no write is redirected, no snapshot taken while it is read (a
        // dedup chain is read under the dedup lock, which comes before the pool's).
        let _s = (!to.block_mapped()).then(|| self.core.lock());
        let runs = to
            .changed_runs(from.id, 0, to.size(), usize::MAX)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "'{}' is not an older snapshot of '{}'",
                    from.name, to.name
                ))
            })?;
        let mut at = 0;
        let mut out = Vec::new();
        for (len, changed) in runs {
            if changed {
                out.push((at, len));
            }
            at += len;
        }
        Ok(out)
    }

    /// Consistency of the chains: every owner names a layer of a volume and a unit
    /// inside it, every partial unit is owned, every parent is a snapshot of the pool,
    /// no chain loops. One line per finding.
    pub fn verify_chains(&self) -> Vec<String> {
        let s = self.core.lock();
        let mut found = Vec::new();
        let layers: BTreeMap<u32, &Arc<Volume>> =
            s.volumes.values().map(|v| (v.layer(), v)).collect();
        for (p, &(layer, u)) in s.owners.iter().enumerate() {
            if [
                OWNER_FREE,
                crate::format::OWNER_META,
                crate::format::OWNER_RESERVED,
            ]
            .contains(&layer)
            {
                continue;
            }
            // Dedup units (docs/format.md §17; `Pool::verify_dedup` checks their use).
            let block_mapped: BTreeSet<u32> = BTreeSet::new();
            if crate::dedup::store::is_dedup_owner((layer, u), &block_mapped)
                || (u & crate::dedup::store::MAP_UNIT != 0
                    && layers.get(&layer).is_some_and(|v| v.block_mapped()))
            {
                continue;
            }
            match layers.get(&layer) {
                None => found.push(format!(
                    "unit {p}: owned by layer {layer}, which no volume has"
                )),
                Some(v) if v.current_map().get(u as u64) != u32_of(p) => found.push(format!(
                    "unit {p}: owned by '{}' unit {u}, which maps elsewhere",
                    v.name
                )),
                Some(_) => {}
            }
        }
        for &p in &s.partial {
            if s.owners.get(p as usize).is_none_or(|o| o.0 == OWNER_FREE) {
                found.push(format!("unit {p}: partial but free"));
            }
        }
        for v in s.volumes.values() {
            let mut seen = BTreeSet::new();
            let mut at = v.parent();
            while let Some(p) = at {
                if !p.is_snapshot() || !s.volumes.contains_key(&p.id) {
                    found.push(format!(
                        "'{}': parent '{}' is not a snapshot of the pool",
                        v.name, p.name
                    ));
                    break;
                }
                if !seen.insert(p.id) {
                    found.push(format!("'{}': its chain loops", v.name));
                    break;
                }
                at = p.parent();
            }
        }
        found
    }
}

impl PoolCore {
    /// Make the dedup maps follow the catalog changes queued in `layer_chores` (taken
    /// under the pool lock, applied under the dedup lock, then the map units of removed
    /// layers freed under the pool lock again).
    pub(crate) fn apply_layer_chores(&self) {
        let chores = std::mem::take(&mut self.lock().layer_chores);
        let Some(d) = self.dedup() else {
            return;
        };
        let mut units = Vec::new();
        for c in chores {
            match c {
                LayerChore::Remove(layer) => units.extend(d.remove_layer(layer)),
                LayerChore::Covered(layer, children) => d.drop_covered(layer, &children),
            }
        }
        if !units.is_empty() {
            let mut s = self.lock();
            for p in units {
                self.free_owned(&mut s, p);
            }
        }
    }
}

/// Free every unit `vol` owns (it is being deleted or rolled back); a block-mapped
/// volume's references and map units go with `apply_layer_chores`.
fn free_own_units(core: &PoolCore, s: &mut State, vol: &Volume) {
    if vol.block_mapped() {
        s.layer_chores.push(LayerChore::Remove(vol.layer()));
    }
    let map = vol.current_map();
    let mapped: Vec<(u64, u32)> = map.mapped_in(0, map.len()).collect();
    for (u, p) in mapped {
        core.free_unit(s, &map, u, p);
    }
    vol.allocated.store(0, Release);
}

/// Units of `snap` that none of `children` reads: each has a full unit of its own there.
fn unread_units(core: &PoolCore, snap: &Volume, children: &[Arc<Volume>]) -> Vec<(u64, u32)> {
    let map = snap.current_map();
    let child_maps: Vec<Arc<UnitMap>> = children.iter().map(|c| c.current_map()).collect();
    map.mapped_in(0, map.len())
        .filter(|&(u, _)| {
            child_maps.iter().all(|m| {
                let q = m.get(u);
                q != HOLE && core.presence.is_full(q)
            })
        })
        .collect()
}

/// A hidden snapshot gives back what its children no longer read, and goes (with its
/// hidden ancestors, in turn) once no volume reads through it.
fn drop_unneeded(core: &PoolCore, s: &mut State, snap: &Arc<Volume>) {
    let mut at = Some(snap.clone());
    while let Some(v) = at {
        if !v.is_hidden() {
            return;
        }
        let children = children_of(s, v.id);
        if !children.is_empty() {
            if v.block_mapped() {
                let layers = children.iter().map(|c| c.layer()).collect();
                s.layer_chores.push(LayerChore::Covered(v.layer(), layers));
            }
            let map = v.current_map();
            for (u, p) in unread_units(core, &v, &children) {
                core.free_unit(s, &map, u, p);
                v.allocated.fetch_sub(1, Relaxed);
            }
            if map.has_empty_leaf_in(0, map.len()) {
                v.compact_wanted.store(true, Relaxed);
            }
            return;
        }
        let parent = v.parent();
        v.mark_deleted();
        free_own_units(core, s, &v);
        s.volumes.remove(&v.id);
        at = parent;
    }
}
