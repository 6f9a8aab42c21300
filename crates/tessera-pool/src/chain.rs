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
use crate::format::{ChainRecord, Record, CHAIN_SNAPSHOT, OWNER_FREE};
use crate::pool::{now_secs, Pool, PoolCore, State};
use crate::presence::{presence_record, PARTIAL_MAX};
use crate::volume::{UnitMap, Volume, HOLE};
use tessera_api::SnapshotInfo;
use tessera_io::cast::u32_of;

/// One run of blocks of a first write into a shared unit (`PoolCore::plan_first_write`):
/// blocks `[first, last]`, all present in the writer's unit or all absent (still the
/// parent's, claimed by this write until it completes).
pub(crate) struct BlockRun {
    pub first: u32,
    pub last: u32,
    pub present: bool,
    /// Absent runs that the write does not cover whole: the whole run is written from
    /// this buffer (the chain's blocks read into it, the write's bytes copied over).
    pub buf: Option<tessera_io::AlignedBuf>,
}

/// A read from the chain into an absent run's buffer: blocks `[first, first + count)`
/// of the run's unit, from pool unit `src` (or zeros when `src` is [`HOLE`]).
#[derive(Clone, Copy)]
pub(crate) struct ChainRead {
    pub run: u32,
    pub first: u32,
    pub count: u32,
    pub src: u32,
}

/// What `PoolCore::plan_first_write` decided.
pub(crate) enum FirstWritePlan {
    /// Refused: -errno.
    Fail(i32),
    /// A block it needs is being written by another first write (on any core): retry
    /// in the next round.
    Busy,
    /// The chain has nothing at this unit: a plain unit `p` was allocated (zeroed unless
    /// written whole), written like any other.
    Plain(u32),
    /// Partial unit `p` of layer `layer`: `runs` and `reads` say what to do.
    Partial { p: u32, layer: u32 },
}

impl PoolCore {
    /// Unit `u`'s data in some ancestor of the chain `chain` (nearest first)?
    fn chain_has(chain: &[Arc<UnitMap>], u: u64) -> bool {
        chain.iter().any(|m| m.get(u) != HOLE)
    }

    /// Whether block `b` of pool unit `p` is claimed by a first write in flight.
    fn claimed(s: &State, p: u32, b: u32) -> bool {
        s.copying
            .get(&p)
            .is_some_and(|w| w[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    /// The metadata half of a write of `len` bytes at volume offset `at` inside unit
    /// `unit` of a volume in a chain, where the fast path could not take it (the unit
    /// has no space of its own yet, or some block it touches is still the parent's).
    /// Under the pool lock and without any data I/O (but a mirror's zeroing of the new
    /// unit when the zeroer's reserve has run dry, as `allocate` does): allocates the
    /// unit (partial; zeroed on mirrors only) if needed, splits the blocks the write touches into `runs`, claims the
    /// absent ones, and lists in `reads` where the parts of absent blocks the write does
    /// not cover come from. The data is then written through the per-core datapath
    /// (`volume::first_write`), and `finish_first_write` marks the blocks present once it is on
    /// the devices. A block another first write has claimed makes this `Busy`: its
    /// contents are not settled until that write completes (two writers each merging
    /// the parent's block with their own bytes would lose one of them). So does a write
    /// whose request (token `epoch`) began after a snapshot of the volume did, until the
    /// snapshot has taken the map (`create_snapshots`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan_first_write(
        &self,
        vol: &Volume,
        epoch: u64,
        unit: u64,
        at: u64,
        len: u64,
        runs: &mut Vec<BlockRun>,
        reads: &mut Vec<ChainRead>,
    ) -> FirstWritePlan {
        if vol.is_snapshot() {
            return FirstWritePlan::Fail(-libc::EROFS);
        }
        if vol.held(epoch) {
            return FirstWritePlan::Busy;
        }
        let mut s = self.lock();
        if vol.is_deleted() {
            return FirstWritePlan::Fail(-libc::ESHUTDOWN);
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
                return match self.allocate(vol, unit, len == unit_size) {
                    Ok(p) => FirstWritePlan::Plain(p),
                    // A snapshot came in between, or a parity pool's allocation reserve
                    // is being topped up: plan again.
                    Err(crate::pool::NEEDS_REDIRECT | crate::pool::NEEDS_RESERVE) => {
                        FirstWritePlan::Busy
                    }
                    Err(e) => FirstWritePlan::Fail(e),
                };
            }
            // Its absent blocks are never read (§3.4). A parity pool's unit comes from
            // its reserve (zero on every device): after a power loss before this
            // allocation is committed, the unit must not go back to the free list with
            // data in it.
            //
            // A mirror's unit is zeroed on every copy, as a plain partial first write's is
            // (`PoolCore::allocate`): the copies of a free unit need not be equal (a
            // replacement's old bytes, which a rebuild does not copy over free units; a
            // write that reached one copy of a unit whose allocation a power loss undid,
            // which the resync after an unclean open does not cover), and the absent
            // blocks of an allocated unit would otherwise differ between copies, which a
            // scrub reports and a scrub repair or rebuild copies either way. Zeroing here
            // is the cheapest way to make them equal: one unit's write-zeroes per
            // allocation, mostly taken from the zeroer's reserve (off the reactor), where
            // making free units equal would cost a copy or zero-fill of all free space at
            // every rebuild and every unclean open. Concat and raid0 keep one copy whose
            // absent blocks are never read: nothing to zero.
            p = if self.layout.parity.is_some() {
                match self.take_reserved(&mut s) {
                    Ok(q) => q,
                    Err(crate::pool::NEEDS_RESERVE) => return FirstWritePlan::Busy,
                    Err(e) => return FirstWritePlan::Fail(e),
                }
            } else if self.layout.kind.is_mirror() {
                let (g, q) = self.take_free(s, true);
                s = g;
                let q = match q {
                    Ok(q) => q,
                    Err(e) => return FirstWritePlan::Fail(e),
                };
                // `take_free` may have waited for the zeroer (the lock released): plan
                // again if the volume or its unit changed meanwhile.
                if vol.is_deleted() || map.get(unit) != HOLE {
                    s.free.push(q);
                    return FirstWritePlan::Busy;
                }
                q
            } else {
                let Some(q) = s.free.pop().or_else(|| s.zeroed.pop_back()) else {
                    return FirstWritePlan::Fail(-libc::ENOSPC);
                };
                q
            };
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
        let write_end = within + len;
        runs.clear();
        reads.clear();
        let mut b = b0;
        while b <= b1 {
            let present = self.presence.present(p, b);
            let mut e = b;
            while e < b1 && self.presence.present(p, e + 1) == present {
                e += 1;
            }
            if !present {
                let run = u32_of(runs.len());
                for blk in b..=e {
                    if Self::claimed(&s, p, blk) {
                        return FirstWritePlan::Busy;
                    }
                    let bs = (blk as u64) << bshift;
                    if bs >= within && bs + bsize <= write_end {
                        continue;
                    }
                    // Partly written or not at all: the rest comes from the chain.
                    let mut src = HOLE;
                    for m in &chain {
                        let q = m.get(unit);
                        if q == HOLE {
                            continue;
                        }
                        // An ancestor's block still being written (a snapshot took the
                        // unit while a first write into it was in flight).
                        if Self::claimed(&s, q, blk) {
                            return FirstWritePlan::Busy;
                        }
                        if self.presence.present(q, blk) {
                            src = q;
                            break;
                        }
                    }
                    match reads.last_mut() {
                        Some(r) if r.run == run && r.first + r.count == blk && (r.src == src) => {
                            r.count += 1
                        }
                        _ => reads.push(ChainRead {
                            run,
                            first: blk,
                            count: 1,
                            src,
                        }),
                    }
                }
            }
            runs.push(BlockRun {
                first: b,
                last: e,
                present,
                buf: None,
            });
            b = e + 1;
        }
        // Claim the absent blocks until the write completes.
        let claims = s.copying.entry(p).or_default();
        for r in runs.iter().filter(|r| !r.present) {
            for blk in r.first..=r.last {
                claims[(blk / 64) as usize] |= 1 << (blk % 64);
            }
        }
        FirstWritePlan::Partial {
            p,
            layer: vol.layer(),
        }
    }

    /// A first write planned by `plan_first_write` completed with `res`: its absent
    /// blocks are released and, when it succeeded, marked present (journaled after the
    /// data write completed: a commit syncs the data before it writes this record).
    /// Nothing is marked when the unit changed hands meanwhile (freed by a delete).
    pub(crate) fn finish_first_write(
        &self,
        p: u32,
        layer: u32,
        unit: u64,
        runs: &[BlockRun],
        res: i32,
    ) {
        let mut s = self.lock();
        if let Some(claims) = s.copying.get_mut(&p) {
            for r in runs.iter().filter(|r| !r.present) {
                for blk in r.first..=r.last {
                    claims[(blk / 64) as usize] &= !(1 << (blk % 64));
                }
            }
            if claims.iter().all(|&w| w == 0) {
                s.copying.remove(&p);
            }
        }
        if res < 0 || s.owners.get(p as usize) != Some(&(layer, u32_of(unit))) {
            return;
        }
        for r in runs.iter().filter(|r| !r.present) {
            let count = r.last - r.first + 1;
            s.records.push(presence_record(p, r.first, count));
            if self.presence.set(p, r.first, count) {
                s.partial.remove(&p);
            }
        }
    }

    /// Give back units `[first, last]` of `vol` (in a chain) that the chain below has
    /// nothing at: released, they read as zeros, as on a plain volume. A unit the chain
    /// has data at stays (releasing it would show the parent's data again; discard is
    /// advisory).
    pub(crate) fn unmap_unshared_units(&self, vol: &Volume, first: u64, last: u64) {
        let mut s = self.lock();
        let map = vol.current_map();
        let chain = vol.ancestor_maps();
        let mapped: Vec<(u64, u32)> = map
            .mapped_in(first, last + 1)
            .filter(|&(u, p)| !Self::chain_has(&chain, u) && !s.copying.contains_key(&p))
            .collect();
        for (u, p) in mapped {
            free_unit(self, &mut s, &map, u, p);
            vol.allocated.fetch_sub(1, Relaxed);
        }
        if map.has_empty_leaf_in(first, last + 1) {
            vol.compact_wanted.store(true, Relaxed);
        }
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
        let quiesce = || {
            self.core.inflight.drain(|next| {
                for (vol, _) in what {
                    vol.hold_from(next);
                }
            });
        };
        let made = self.core.quiesce_change_and_checkpoint(quiesce, |s| {
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
            // The new maps are in place: held writes go on (into them), before the
            // checkpoint's syncs.
            release();
            Ok(made)
        });
        release();
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

    /// The pool's snapshots (hidden ones left out) with their space, as the API lists
    /// them (`replicas` and `missing`, which the node knows, left empty). A snapshot's
    /// `parent` is the nearest older snapshot of the same chain that still exists
    /// (deleted ones that volumes still read through are skipped:
    /// `Volume::listed_parent`); its `children` are the volumes and snapshots that list it
    /// as their parent.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let s = self.core.lock();
        let unit = self.core.unit_size();
        s.volumes
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
            if [
                OWNER_FREE,
                crate::format::OWNER_META,
                crate::format::OWNER_RESERVED,
            ]
            .contains(&layer)
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
