//! Snapshots and clones: chains of thin volumes that share units (docs/format.md §3.4).
//!
//! A snapshot takes its volume's map (and the layer id its units carry in the owner
//! table) as it is; the volume goes on with an empty map that reads through the snapshot
//! where it has nothing of its own (redirect on write). The first write into a unit that
//! the chain has data for allocates a *partial* unit: only the blocks written land there,
//! a presence bitmap says which, and reads of the other blocks fall through to the parent.
//! So a 4 KiB write after a snapshot writes 4 KiB (plus, for a write smaller than a block,
//! the rest of its block read from the parent), never a whole unit.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::{Relaxed, Release};
use std::sync::Arc;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{ChainRecord, Record, CHAIN_SNAPSHOT, OWNER_FREE};
use crate::pool::{now_secs, Pool, PoolCore, State};
use crate::presence::{presence_record, PARTIAL_MAX};
use crate::volume::{UnitMap, Volume, HOLE};
use tessera_io::cast::{u32_of, usize_of};

/// Space of one snapshot, as `snapshot list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub id: u32,
    pub created: u64,
    pub size: u64,
    /// The snapshot this one reads through (an older snapshot of the same chain).
    pub parent: Option<String>,
    /// Volumes and snapshots that read through this one.
    pub children: Vec<String>,
    /// Bytes only this snapshot holds: given back when it is deleted.
    pub exclusive: u64,
    /// Bytes of this snapshot that a child still reads.
    pub shared: u64,
}

impl PoolCore {
    /// Unit `u`'s data in some ancestor of the chain `chain` (nearest first)?
    fn chain_has(chain: &[Arc<UnitMap>], u: u64) -> bool {
        chain.iter().any(|m| m.get(u) != HOLE)
    }

    /// Read block `b` of unit `u` as the chain `chain` (nearest first) shows it.
    fn read_chain_block(&self, chain: &[Arc<UnitMap>], u: u64, b: u32, out: &mut [u8]) -> i32 {
        for m in chain {
            let p = m.get(u);
            if p != HOLE && self.presence.present(p, b) {
                let off =
                    ((p as u64) << self.unit_shift) + ((b as u64) << self.presence.block_shift);
                return match self.layout.read_at(off, out) {
                    Ok(()) => 0,
                    Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
                };
            }
        }
        out.fill(0);
        0
    }

    /// The write (`data`, or zeros when `None`) of `len` bytes at volume offset `at`
    /// inside unit `unit` of a volume in a chain, where the fast path could not take it:
    /// the unit has no space of its own yet, or some block it touches is still the
    /// parent's. Runs on a reactor, synchronously, under the pool lock, like a first
    /// write's zeroing: it is taken once per block after a snapshot. Returns 0 or -errno.
    pub(crate) fn write_redirected(
        &self,
        vol: &Volume,
        unit: u64,
        at: u64,
        len: u64,
        data: Option<&[u8]>,
    ) -> i32 {
        if vol.is_snapshot() {
            return -libc::EROFS;
        }
        let mut s = self.lock();
        if vol.is_deleted() {
            return -libc::ESHUTDOWN;
        }
        let map = vol.current_map();
        let chain = vol.ancestor_maps();
        let unit_size = self.unit_size();
        let within = at - (unit << self.unit_shift);
        let mut p = map.get(unit);
        if p == HOLE {
            if !Self::chain_has(&chain, unit) {
                // Nothing to share here: a plain unit, zeroed unless written whole.
                drop(s);
                p = match self.allocate(vol, unit, len == unit_size) {
                    Ok(p) => p,
                    Err(e) => return e,
                };
                let zeros;
                let bytes = match data {
                    Some(d) => d,
                    None => {
                        zeros = vec![0u8; usize_of(len)];
                        &zeros
                    }
                };
                let off = ((p as u64) << self.unit_shift) + within;
                return match self.layout.write_at(off, bytes) {
                    Ok(()) => 0,
                    Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
                };
            }
            // Not zeroed: its absent blocks are never read (§3.4).
            let Some(q) = s.free.pop().or_else(|| s.zeroed.pop_back()) else {
                return -libc::ENOSPC;
            };
            p = q;
            // The presence marker first: a replay never takes this unit as full.
            s.records.push(presence_record(p, 0, 0));
            s.records.push(Record {
                pool_unit: p,
                volume_id: vol.layer(),
                volume_unit: u32_of(unit),
            });
            self.presence.make_partial(p);
            s.partial.insert(p);
            s.owners[p as usize] = (vol.layer(), u32_of(unit));
            map.set(unit, p);
            vol.allocated.fetch_add(1, Relaxed);
        }
        let bshift = self.presence.block_shift;
        let bsize = 1u64 << bshift;
        let (mut b0, mut b1) = (
            u32_of(within >> bshift),
            u32_of((within + len - 1) >> bshift),
        );
        if s.partial.len() > PARTIAL_MAX && !self.presence.is_full(p) {
            // Too many partial units for the catalog: make this one whole now.
            (b0, b1) = (0, self.presence.blocks - 1);
        }
        let base = (p as u64) << self.unit_shift;
        let write_end = within + len;
        let mut b = b0;
        while b <= b1 {
            let present = self.presence.present(p, b);
            let mut e = b;
            while e < b1 && self.presence.present(p, e + 1) == present {
                e += 1;
            }
            let run_start = (b as u64) << bshift;
            let run_end = ((e as u64) + 1) << bshift;
            let r = if present {
                // The owner's own blocks: only the bytes written (another core may be
                // writing the rest of them now).
                let (from, to) = (run_start.max(within), run_end.min(write_end));
                if from < to {
                    let bytes = match data {
                        Some(d) => d[usize_of(from - within)..usize_of(to - within)].to_vec(),
                        None => vec![0u8; usize_of(to - from)],
                    };
                    self.layout
                        .write_at(base + from, &bytes)
                        .map_or_else(|e| -e.raw_os_error().unwrap_or(libc::EIO), |_| 0)
                } else {
                    0
                }
            } else {
                // Blocks still the parent's: whole blocks, the bytes not written taken
                // from the chain, then marked present.
                let mut buf = vec![0u8; usize_of(run_end - run_start)];
                let mut r = 0;
                for blk in b..=e {
                    let bs = (blk as u64) << bshift;
                    if bs >= within && bs + bsize <= write_end {
                        continue;
                    }
                    let piece =
                        &mut buf[usize_of(bs - run_start)..usize_of(bs - run_start + bsize)];
                    r = self.read_chain_block(&chain, unit, blk, piece);
                    if r != 0 {
                        break;
                    }
                }
                let (from, to) = (run_start.max(within), run_end.min(write_end));
                if r == 0 && from < to {
                    let dst = &mut buf[usize_of(from - run_start)..usize_of(to - run_start)];
                    match data {
                        Some(d) => {
                            dst.copy_from_slice(&d[usize_of(from - within)..usize_of(to - within)])
                        }
                        None => dst.fill(0),
                    }
                }
                if r == 0 {
                    r = self
                        .layout
                        .write_at(base + run_start, &buf)
                        .map_or_else(|e| -e.raw_os_error().unwrap_or(libc::EIO), |_| 0);
                }
                if r == 0 {
                    // After the data: a commit syncs the data before it journals this.
                    s.records.push(presence_record(p, b, e - b + 1));
                    if self.presence.set(p, b, e - b + 1) {
                        s.partial.remove(&p);
                    }
                }
                r
            };
            if r != 0 {
                return r;
            }
            b = e + 1;
        }
        0
    }
}

/// Which volumes read through `id`.
fn children_of(s: &State, id: u32) -> Vec<Arc<Volume>> {
    s.volumes
        .values()
        .filter(|v| v.parent_id() == Some(id))
        .cloned()
        .collect()
}

impl Pool {
    fn volume_named_in(s: &State, name: &str) -> bool {
        s.volumes.values().any(|v| !v.is_hidden() && v.name == name)
    }

    /// Snapshots need the first write after one to write synchronously on its reactor;
    /// on a parity layout that write could wait for a row lock the same reactor holds.
    fn check_chain_layout(&self) -> Result<()> {
        if self.core.layout.parity.is_some() {
            return Err(Error::invalid(format!(
                "pool '{}' has a parity layout: snapshots and clones are supported on \
                 concat, raid0, raid1 and raid10 pools for now",
                self.core.name
            )));
        }
        Ok(())
    }

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
        self.check_chain_layout()?;
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
        self.core.change_and_checkpoint(|s| {
            for (vol, name) in what {
                if Self::volume_named_in(s, name) {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!("a volume or snapshot named '{name}' already exists"),
                    ));
                }
                if vol.is_deleted() || !s.volumes.contains_key(&vol.id) {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        format!("volume '{}' not found", vol.name),
                    ));
                }
            }
            let mut made = Vec::new();
            for (vol, name) in what {
                let id = s.next_volume_id;
                let layer = id + 1;
                s.next_volume_id += 2;
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
                        flags: CHAIN_SNAPSHOT,
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
            Ok(made)
        })
    }

    /// A writable volume `name` that reads through snapshot `snap` (a clone). Counts
    /// against the overcommit ratio like a new volume of the snapshot's size.
    pub fn clone_snapshot(
        &self,
        snap: &Arc<Volume>,
        name: &str,
        force: bool,
    ) -> Result<Arc<Volume>> {
        self.check_chain_layout()?;
        crate::pool::validate_name("volume", name)?;
        if !snap.is_snapshot() || snap.is_hidden() {
            return Err(Error::invalid(format!(
                "'{}' is not a snapshot: take a snapshot of it and clone that",
                snap.name
            )));
        }
        self.core.change_and_checkpoint(|s| {
            if Self::volume_named_in(s, name) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("a volume or snapshot named '{name}' already exists"),
                ));
            }
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
                    flags: 0,
                    layer: id,
                    parent: snap.id,
                },
                Some(snap.clone()),
            );
            s.volumes.insert(id, vol.clone());
            Ok(vol)
        })
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
        self.core.change_and_checkpoint(|s| {
            if let Some(e) = s.exports.iter().find(|e| e.volume_id == vol.id) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "volume '{}' is exported as '{}'; remove the export before a rollback",
                        vol.name, e.name
                    ),
                ));
            }
            let old_parent = vol.parent();
            free_own_units(&self.core, s, vol);
            let units = vol.size().div_ceil(self.core.unit_size());
            vol.take_new_layer(vol.layer(), snap.clone(), UnitMap::new(units));
            if let Some(p) = old_parent {
                drop_unneeded(&self.core, s, &p);
            }
            Ok(())
        })
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

    /// The pool's snapshots (hidden ones left out) with their space.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let s = self.core.lock();
        let unit = self.core.unit_size();
        s.volumes
            .values()
            .filter(|v| v.is_snapshot() && !v.is_hidden())
            .map(|v| {
                let children = children_of(&s, v.id);
                let unread = unread_units(&self.core, v, &children).len() as u64;
                let own = v.allocated.load(Relaxed);
                SnapshotInfo {
                    name: v.name.clone(),
                    id: v.id,
                    created: v.created,
                    size: v.size(),
                    parent: v.parent().map(|p| p.name.clone()),
                    children: children.iter().map(|c| c.name.clone()).collect(),
                    exclusive: unread * unit,
                    shared: own.saturating_sub(unread) * unit,
                }
            })
            .collect()
    }

    /// The byte ranges of `to` that may differ from snapshot `from`, an ancestor of
    /// `to` (an older snapshot of the same volume, or the snapshot a clone was made
    /// from): every block some member of the chain between them wrote. Sorted, merged.
    pub fn changed_extents(&self, from: &Arc<Volume>, to: &Arc<Volume>) -> Result<Vec<(u64, u64)>> {
        // Under the lock: no write is redirected, no snapshot taken while it is read.
        let _s = self.core.lock();
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
            if layer == OWNER_FREE || layer == crate::format::OWNER_META {
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

/// Free every unit `vol` owns (it is being deleted or rolled back).
fn free_own_units(core: &PoolCore, s: &mut State, vol: &Volume) {
    let map = vol.current_map();
    let mapped: Vec<(u64, u32)> = map.mapped_in(0, map.len()).collect();
    for (u, p) in mapped {
        free_unit(core, s, &map, u, p);
    }
    vol.allocated.store(0, Release);
}

fn free_unit(core: &PoolCore, s: &mut State, map: &UnitMap, u: u64, p: u32) {
    map.set(u, HOLE);
    s.owners[p as usize] = (OWNER_FREE, 0);
    s.pending_free.push(p);
    s.partial.remove(&p);
    core.presence.set_full(p);
    s.records.push(Record {
        pool_unit: p,
        volume_id: OWNER_FREE,
        volume_unit: 0,
    });
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
            let map = v.current_map();
            for (u, p) in unread_units(core, &v, &children) {
                free_unit(core, s, &map, u, p);
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
