//! Thin volumes: a map from volume units to pool units, filled on first write.
//!
//! The map ([`UnitMap`]) is two levels: a top-level array of pointers, one per
//! `LEAF_UNITS` volume units, and leaves of `AtomicU32` entries allocated when the first
//! unit under them gets space. Holes read as holes without a leaf, so a 1 PiB volume with
//! 1 GiB written costs its top-level array (8 bytes per 4 GiB of virtual size at 1 MiB
//! units: 2 MiB) and one 16 KiB leaf per 4 GiB region written, not 4 bytes per virtual
//! unit. Readers load the leaf pointer and the entry (two plain atomic loads, no lock,
//! no allocation) on every I/O. The map changes only on allocation, release and resize,
//! which take the pool lock; readers on other cores see a new mapping after it was
//! published (Release/Acquire), and a unit is zeroed before it is published, so no reader
//! ever sees another volume's old data.

mod dedup_io;
mod first_write;
mod readahead;

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize};
use tessera_io::sync::{MutexExt, RwLockExt};

use crate::format::ChainRecord;
use std::sync::{Arc, Mutex, RwLock};

use tessera_export::{ExportHandle, ExportTarget, StatsRegistry};
pub use tessera_export::{IoClass, IoStats, StatsSnapshot};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

use crate::cache_tier::TierHandle;
use crate::inflight::{inflight_for, CoreInflight};
use crate::pattern::{Direction, HandlePatterns, PatternCounts, PatternTotals};
use crate::pool::PoolCore;
use tessera_io::cast::{u32_of, usize_of};

/// Map entry of a unit that has no space yet: it reads as zeros.
pub const HOLE: u32 = u32::MAX;

/// Volume units per leaf: 4096 entries (16 KiB) cover 4 GiB at the default 1 MiB unit.
/// Smaller leaves waste less on scattered writes but make the top-level array larger
/// (8 bytes per leaf of virtual size, allocated or not); at 4096 a volume at the largest
/// unit count the records can name (2^32 units) has an 8 MiB top level, and 1 PiB at
/// 1 MiB units 2 MiB.
const LEAF_BITS: u32 = 12;
pub const LEAF_UNITS: u64 = 1 << LEAF_BITS;
const LEAF_MASK: u64 = LEAF_UNITS - 1;

/// One page of the map. Reference counted (the top-level slots hold `Arc` pointers): a
/// map rebuilt for a resize or a compaction shares the leaves of the one it replaces, and
/// handles still reading the old map keep its leaves alive until they drop it.
///
/// Snapshots and clones can build on the same sharing: a snapshot's map takes a
/// reference to each of the origin's leaves; a leaf whose count is above one is then
/// read-only, and a write into it first copies it and publishes the copy by installing a
/// new top-level array in the writer's map (as [`UnitMap::grown`] and
/// [`UnitMap::compacted`] do), so readers of the old array never see a leaf freed under
/// them.
struct Leaf {
    entries: [AtomicU32; usize_of(LEAF_UNITS)],
    /// Entries that are not holes: a leaf that drops to 0 is left out at the next
    /// compaction. Changed only under the pool lock.
    mapped: AtomicU32,
}

impl Leaf {
    fn new_empty() -> Arc<Leaf> {
        Arc::new(Leaf {
            entries: [const { AtomicU32::new(HOLE) }; usize_of(LEAF_UNITS)],
            mapped: AtomicU32::new(0),
        })
    }
}

pub struct UnitMap {
    units: u64,
    /// Null, or a pointer from `Arc::into_raw(Arc<Leaf>)` this map holds a reference to.
    /// A slot of a published map only ever goes from null to a leaf (by compare and
    /// swap); leaves leave a map only when the map is replaced.
    leaves: Box<[AtomicPtr<Leaf>]>,
}

impl Drop for UnitMap {
    fn drop(&mut self) {
        for slot in self.leaves.iter_mut() {
            let p = *slot.get_mut();
            if !p.is_null() {
                // SAFETY: a non-null slot holds one reference from `Arc::into_raw`,
                // released exactly once, here.
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

impl UnitMap {
    pub fn new(units: u64) -> Arc<UnitMap> {
        Arc::new(UnitMap {
            units,
            leaves: (0..units.div_ceil(LEAF_UNITS))
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        })
    }

    /// A map of `units` units holding `old`'s leaves (shared: a later change through
    /// either map is seen by both). Called under the pool lock.
    fn with_leaves(old: &UnitMap, units: u64, keep: impl Fn(&Leaf) -> bool) -> Arc<UnitMap> {
        let new = UnitMap::new(units);
        for (i, slot) in old.leaves.iter().enumerate().take(new.leaves.len()) {
            let p = slot.load(Acquire);
            // SAFETY: non-null slots point at a live leaf `old` holds a reference to.
            if !p.is_null() && keep(unsafe { &*p }) {
                // SAFETY: as above; the new map takes its own reference.
                unsafe { Arc::increment_strong_count(p) };
                new.leaves[i].store(p, Release);
            }
        }
        new
    }

    /// `old` grown to `units` units, sharing its leaves.
    pub(crate) fn grown(old: &UnitMap, units: u64) -> Arc<UnitMap> {
        Self::with_leaves(old, units.max(old.units), |_| true)
    }

    /// `old` without its leaves that map nothing any more (after a release).
    pub(crate) fn compacted(old: &UnitMap) -> Arc<UnitMap> {
        Self::with_leaves(old, old.units, |l| l.mapped.load(Relaxed) != 0)
    }

    #[inline]
    fn leaf(&self, index: usize) -> Option<&Leaf> {
        let p = self.leaves.get(index)?.load(Acquire);
        // SAFETY: non-null slots point at a leaf this map holds a reference to for as
        // long as it lives, and a slot of a live map is never cleared.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    #[inline]
    pub fn get(&self, unit: u64) -> u32 {
        match self.leaf((unit >> LEAF_BITS) as usize) {
            Some(leaf) => leaf.entries[(unit & LEAF_MASK) as usize].load(Acquire),
            None => HOLE,
        }
    }

    /// Map `unit` to pool unit `p` (or [`HOLE`]). Called under the pool lock; a leaf is
    /// installed by compare and swap, so readers never wait for it.
    pub(crate) fn set(&self, unit: u64, p: u32) {
        assert!(
            unit < self.units,
            "unit {unit} beyond a map of {}",
            self.units
        );
        let index = (unit >> LEAF_BITS) as usize;
        let leaf = match self.leaf(index) {
            Some(leaf) => leaf,
            None if p == HOLE => return,
            None => {
                let fresh = Arc::into_raw(Leaf::new_empty()).cast_mut();
                match self.leaves[index].compare_exchange(
                    std::ptr::null_mut(),
                    fresh,
                    AcqRel,
                    Acquire,
                ) {
                    // SAFETY: installed: the map now holds the reference `fresh` carries.
                    Ok(_) => unsafe { &*fresh },
                    Err(winner) => {
                        // SAFETY: `fresh` was never published; its one reference is ours.
                        drop(unsafe { Arc::from_raw(fresh) });
                        // SAFETY: `winner` is a leaf the map holds a reference to.
                        unsafe { &*winner }
                    }
                }
            }
        };
        let old = leaf.entries[(unit & LEAF_MASK) as usize].swap(p, AcqRel);
        match (old == HOLE, p == HOLE) {
            (true, false) => {
                leaf.mapped.fetch_add(1, Relaxed);
            }
            (false, true) => {
                leaf.mapped.fetch_sub(1, Relaxed);
            }
            _ => {}
        }
    }

    pub fn len(&self) -> u64 {
        self.units
    }

    pub fn is_empty(&self) -> bool {
        self.units == 0
    }

    /// Whether unit `from` is mapped, and the first unit in `(from, to)` whose state
    /// differs (`to` when none does; units beyond the map are holes). Regions without a leaf are skipped whole, so a run
    /// of holes across a huge sparse volume costs one step per leaf slot, not per unit.
    pub fn run_from(&self, from: u64, to: u64) -> (bool, u64) {
        if from >= to {
            return (false, to);
        }
        let mapped = self.get(from) != HOLE;
        let mut u = from;
        while u < to {
            let index = (u >> LEAF_BITS) as usize;
            let leaf_end = ((index as u64 + 1) << LEAF_BITS).min(to);
            match self.leaf(index).filter(|l| l.mapped.load(Relaxed) != 0) {
                None if mapped => return (true, u),
                None => u = leaf_end,
                Some(leaf) => {
                    while u < leaf_end {
                        let e = leaf.entries[(u & LEAF_MASK) as usize].load(Acquire);
                        if (e != HOLE) != mapped {
                            return (mapped, u);
                        }
                        u += 1;
                    }
                }
            }
        }
        (mapped, to)
    }

    /// Every mapped unit in `[first, end)` as (volume unit, pool unit), in volume order,
    /// skipping leaves that map nothing.
    pub fn mapped_in(&self, first: u64, end: u64) -> impl Iterator<Item = (u64, u32)> + '_ {
        let end = end.min(self.units);
        // Leaf indexes, end exclusive (empty when the range is).
        let leaves = if first < end {
            (first >> LEAF_BITS) as usize..((end - 1) >> LEAF_BITS) as usize + 1
        } else {
            0..0
        };
        leaves
            .filter_map(|i| self.leaf(i).map(|l| (i, l)))
            .filter(|(_, l)| l.mapped.load(Relaxed) != 0)
            .flat_map(move |(i, l)| {
                let base = (i as u64) << LEAF_BITS;
                let from = first.max(base) - base;
                let to = end.min(base + LEAF_UNITS) - base;
                (from..to).filter_map(move |j| {
                    let p = l.entries[usize_of(j)].load(Acquire);
                    (p != HOLE).then_some((base + j, p))
                })
            })
    }

    /// Whether a leaf under `[first, end)` maps nothing any more (a compaction would
    /// drop it).
    pub(crate) fn has_empty_leaf_in(&self, first: u64, end: u64) -> bool {
        let end = end.min(self.units);
        first < end
            && ((first >> LEAF_BITS)..=((end - 1) >> LEAF_BITS)).any(|i| {
                self.leaf(usize_of(i))
                    .is_some_and(|l| l.mapped.load(Relaxed) == 0)
            })
    }

    /// Leaves allocated (memory: 16 KiB each).
    pub fn leaves(&self) -> usize {
        (0..self.leaves.len())
            .filter(|&i| self.leaf(i).is_some())
            .count()
    }
}

pub struct Volume {
    pub id: u32,
    pub name: String,
    pub created: u64,
    size: AtomicU64,
    map: RwLock<Arc<UnitMap>>,
    /// Bumped whenever `map` is replaced (resize), so handles know to reload it.
    map_gen: AtomicU64,
    pub(crate) allocated: AtomicU64,
    /// A release left a map leaf empty: the commit thread compacts the map (not the
    /// reactor that released it: a compaction copies the top-level array).
    pub(crate) compact_wanted: AtomicBool,
    open_handles: AtomicUsize,
    /// Handles ever opened (readahead buffers are good only while no other handle was).
    opens: AtomicU64,
    /// Reads served from readahead buffers, and their bytes (`volume::readahead`).
    pub(crate) readahead_hits: AtomicU64,
    pub(crate) readahead_bytes: AtomicU64,
    deleted: AtomicBool,
    stats: StatsRegistry,
    /// Requests by the access pattern of their region (`crate::pattern`), as the
    /// handles add them.
    patterns: PatternTotals,
    /// QoS limits found in pool metadata written before QoS moved to the node's catalog
    /// (docs/format.md §3.2, legacy). Written back by every checkpoint until the node has
    /// taken them into its catalog ([`Volume::clear_legacy_qos`]), so a crash in between
    /// loses nothing. New volumes have none.
    legacy_qos: Mutex<Option<tessera_qos::QosLimits>>,
    /// The id its own units carry in the owner table (docs/format.md §3.4): its volume
    /// id until a snapshot takes its units, a fresh one after each.
    layer: AtomicU32,
    /// The snapshot it reads through where it has no data of its own.
    parent: RwLock<Option<Arc<Volume>>>,
    /// A snapshot: read-only.
    snapshot: AtomicBool,
    /// A deleted snapshot kept because some volume still reads through it.
    hidden: AtomicBool,
    /// A dedup volume (chain flag `CHAIN_BLOCK_MAPPED`), fixed at creation.
    block_mapped: AtomicBool,
    /// While a snapshot of this volume is being taken: the first epoch (`inflight`) whose
    /// writes wait until the snapshot has its map, so that none lands in what becomes
    /// the snapshot's units; `u64::MAX` otherwise. See [`Volume::held`].
    hold_from: AtomicU64,
    pub(crate) pool: Arc<PoolCore>,
}

impl Volume {
    pub(crate) fn new(
        pool: Arc<PoolCore>,
        id: u32,
        name: String,
        size: u64,
        created: u64,
        map: Arc<UnitMap>,
        legacy_qos: tessera_qos::QosLimits,
    ) -> Arc<Volume> {
        Arc::new(Volume {
            id,
            name,
            created,
            size: AtomicU64::new(size),
            map: RwLock::new(map),
            map_gen: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            compact_wanted: AtomicBool::new(false),
            open_handles: AtomicUsize::new(0),
            opens: AtomicU64::new(0),
            readahead_hits: AtomicU64::new(0),
            readahead_bytes: AtomicU64::new(0),
            deleted: AtomicBool::new(false),
            stats: StatsRegistry::default(),
            patterns: PatternTotals::default(),
            legacy_qos: Mutex::new(
                (legacy_qos != tessera_qos::QosLimits::default()).then_some(legacy_qos),
            ),
            layer: AtomicU32::new(id),
            parent: RwLock::new(None),
            snapshot: AtomicBool::new(false),
            hidden: AtomicBool::new(false),
            block_mapped: AtomicBool::new(false),
            hold_from: AtomicU64::new(u64::MAX),
            pool,
        })
    }

    /// Its place in a chain, as the catalog records it (set while the pool assembles or
    /// a snapshot or clone is made, before any handle exists).
    pub(crate) fn set_chain(&self, chain: ChainRecord, parent: Option<Arc<Volume>>) {
        self.layer.store(chain.layer, Release);
        self.snapshot
            .store(chain.flags & crate::format::CHAIN_SNAPSHOT != 0, Release);
        self.hidden
            .store(chain.flags & crate::format::CHAIN_HIDDEN != 0, Release);
        self.block_mapped.store(
            chain.flags & crate::format::CHAIN_BLOCK_MAPPED != 0,
            Release,
        );
        *self.parent.write_locked() = parent;
    }

    pub(crate) fn chain_record(&self) -> ChainRecord {
        ChainRecord {
            flags: crate::presence::chain_flags(self.is_snapshot(), self.is_hidden())
                | if self.block_mapped() {
                    crate::format::CHAIN_BLOCK_MAPPED
                } else {
                    0
                },
            layer: self.layer(),
            parent: self.parent_id().unwrap_or(0),
        }
    }

    pub(crate) fn layer(&self) -> u32 {
        self.layer.load(Acquire)
    }

    /// A read-only snapshot.
    pub fn is_snapshot(&self) -> bool {
        self.snapshot.load(Acquire)
    }

    pub(crate) fn is_hidden(&self) -> bool {
        self.hidden.load(Acquire)
    }

    pub(crate) fn hide(&self) {
        self.hidden.store(true, Release);
    }

    /// Whether a change to this volume by a request whose token carries `epoch` must
    /// wait: a snapshot is being taken and the request began after it did.
    #[inline]
    pub(crate) fn held(&self, epoch: u64) -> bool {
        epoch >= self.hold_from.load(Acquire)
    }

    /// Hold changes of requests from `epoch` on (`u64::MAX`: release them).
    pub(crate) fn hold_from(&self, epoch: u64) {
        self.hold_from.store(epoch, Release);
    }

    /// The snapshot this volume reads through, if any.
    pub fn parent(&self) -> Option<Arc<Volume>> {
        self.parent.read_locked().clone()
    }

    pub(crate) fn parent_id(&self) -> Option<u32> {
        self.parent.read_locked().as_ref().map(|p| p.id)
    }

    /// The parent a listing names: the nearest ancestor that was not deleted (a deleted
    /// snapshot stays, hidden, while volumes read through it, but it no longer exists
    /// for its users; naming it would also let a new snapshot that reuses its name
    /// appear as its own descendant's parent).
    pub fn listed_parent(&self) -> Option<Arc<Volume>> {
        let mut at = self.parent();
        while let Some(p) = at {
            if !p.is_hidden() {
                return Some(p);
            }
            at = p.parent();
        }
        None
    }

    /// Its parent, the parent's parent, and so on.
    pub fn ancestors(&self) -> Vec<Arc<Volume>> {
        let mut out = Vec::new();
        let mut at = self.parent();
        while let Some(p) = at {
            at = p.parent();
            out.push(p);
        }
        out
    }

    /// The maps of its ancestors, nearest first: where its reads fall through to.
    pub(crate) fn ancestor_maps(&self) -> Vec<Arc<UnitMap>> {
        self.ancestors().iter().map(|a| a.current_map()).collect()
    }

    /// Start a new layer (a snapshot took the old one, or a rollback dropped it): an
    /// empty map read through `parent`. Under the pool lock; handles reload at their
    /// next request (the parent is in place before the map generation moves).
    pub(crate) fn take_new_layer(&self, layer: u32, parent: Arc<Volume>, map: Arc<UnitMap>) {
        self.layer.store(layer, Release);
        *self.parent.write_locked() = Some(parent);
        self.replace_map(map);
    }

    pub fn size(&self) -> u64 {
        self.size.load(Acquire)
    }

    /// QoS limits this volume's pool metadata still carries from before QoS moved to the
    /// node's catalog, if any (read once by the node, which migrates them).
    pub fn legacy_qos(&self) -> Option<tessera_qos::QosLimits> {
        self.legacy_qos.locked().clone()
    }

    /// The node's catalog holds the legacy limits now: the next checkpoint drops them.
    pub fn clear_legacy_qos(&self) {
        *self.legacy_qos.locked() = None;
    }

    /// Bytes of pool space this volume holds.
    pub fn allocated_bytes(&self) -> u64 {
        if let Some(d) = self.pool.dedup().filter(|_| self.block_mapped()) {
            // A dedup volume's referenced blocks (shared ones counted in full).
            return d.layer_bytes(self.layer());
        }
        self.allocated.load(Relaxed) << self.pool.unit_shift
    }

    /// Make every write completed on this volume so far durable, with the thin-map
    /// changes that find it (a pool commit). Blocks: not for a reactor thread.
    pub fn sync(&self) -> crate::Result<()> {
        self.pool.commit()
    }

    pub fn pool_name(&self) -> &str {
        &self.pool.name
    }

    pub fn open_handles(&self) -> usize {
        self.open_handles.load(Relaxed)
    }

    /// Handles opened so far (ever).
    pub(crate) fn opens(&self) -> u64 {
        self.opens.load(Relaxed)
    }

    /// Reads served from readahead buffers (pools without a cache tier), and their bytes.
    pub fn readahead_served(&self) -> (u64, u64) {
        (
            self.readahead_hits.load(Relaxed),
            self.readahead_bytes.load(Relaxed),
        )
    }

    pub(crate) fn is_deleted(&self) -> bool {
        self.deleted.load(Acquire)
    }

    pub(crate) fn mark_deleted(&self) {
        self.deleted.store(true, Release);
    }

    pub(crate) fn current_map(&self) -> Arc<UnitMap> {
        self.map.read_locked().clone()
    }

    /// Publish `new` as the volume's map: handles pick it up at their next request and
    /// drop the old one (and the leaves only it holds) then. Called under the pool lock.
    fn replace_map(&self, new: Arc<UnitMap>) {
        *self.map.write_locked() = new;
        self.map_gen.fetch_add(1, Release);
    }

    /// Called under the pool lock, so no allocation races the copy.
    pub(crate) fn grow(&self, new_size: u64, units: u64) {
        let old = self.current_map();
        self.replace_map(UnitMap::grown(&old, units));
        self.size.store(new_size, Release);
    }

    /// Drop the leaves that map nothing any more, so a volume's map memory follows its
    /// allocated space after a trim too. Called under the pool lock, by the commit thread
    /// after a release asked for it (`compact_wanted`).
    pub(crate) fn compact_map(&self) {
        let map = self.current_map();
        if map.has_empty_leaf_in(0, map.len()) {
            self.replace_map(UnitMap::compacted(&map));
        }
    }

    /// Leaves of the thin map in memory (16 KiB each, plus 8 bytes of top-level array
    /// per `LEAF_UNITS` units of virtual size).
    pub fn map_leaves(&self) -> usize {
        self.current_map().leaves()
    }

    /// Whether `[offset, offset+len)` is allocated, as runs of (length, allocated).
    /// Lengths are clipped to the range; adjacent runs with the same state are merged.
    /// Regions without a map leaf are skipped whole: a huge sparse range costs one step
    /// per 4096 units.
    pub fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        if let Some(d) = self.pool.dedup().filter(|_| self.block_mapped()) {
            let len = offset
                .saturating_add(len)
                .min(self.size())
                .saturating_sub(offset);
            return d.allocation_runs(self.layer(), offset, len, max_runs);
        }
        if self.parent().is_some() {
            return self.chain_allocation_runs(offset, len, max_runs);
        }
        let map = self.current_map();
        let shift = self.pool.unit_shift;
        let end = offset.saturating_add(len).min(self.size());
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut at = offset;
        while at < end && runs.len() < max_runs {
            let last = (end - 1) >> shift;
            let (alloc, next_unit) = map.run_from(at >> shift, last + 1);
            // `next_unit` is past `at`'s unit, so every run moves forward.
            let run_end = if next_unit > last {
                end
            } else {
                next_unit << shift
            };
            runs.push((run_end - at, alloc));
            at = run_end;
        }
        runs
    }

    /// [`Volume::allocation_runs`] of a volume in a chain: a unit is allocated when it
    /// or an ancestor has space there (a hole of its own may read its parent's data).
    fn chain_allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        let mut maps = vec![self.current_map()];
        maps.extend(self.ancestor_maps());
        let shift = self.pool.unit_shift;
        let end = offset.saturating_add(len).min(self.size());
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut at = offset;
        while at < end && runs.len() < max_runs {
            let last = (end - 1) >> shift;
            let u = at >> shift;
            let steps: Vec<(bool, u64)> = maps.iter().map(|m| m.run_from(u, last + 1)).collect();
            let alloc = steps.iter().any(|s| s.0);
            // Holes everywhere: up to the first unit any map has. Allocated somewhere:
            // one unit at a time (bounded by the space the chain holds).
            let next_unit = if alloc {
                u + 1
            } else {
                steps.iter().map(|s| s.1).min().unwrap_or(last + 1)
            };
            let run_end = if next_unit > last {
                end
            } else {
                next_unit << shift
            };
            match runs.last_mut() {
                Some(r) if r.1 == alloc => r.0 += run_end - at,
                _ => runs.push((run_end - at, alloc)),
            }
            at = run_end;
        }
        runs
    }

    /// A stats block for one connection; hand it back with [`Volume::unregister_stats`].
    pub fn register_stats(&self) -> Arc<IoStats> {
        self.stats.register()
    }

    /// Fold a closed connection's figures into the volume's totals.
    pub fn unregister_stats(&self, s: &Arc<IoStats>) {
        self.stats.unregister(s)
    }

    /// Cumulative figures of every connection, open or closed.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Requests and bytes by access pattern: those of closed handles, and of open ones
    /// up to [`crate::pattern::FLUSH_EVERY`] requests each.
    pub fn pattern_counts(&self) -> PatternCounts {
        self.patterns.snapshot()
    }

    /// A datapath handle for the calling core.
    pub fn open_handle(self: &Arc<Self>) -> VolumeHandle {
        self.opens.fetch_add(1, Relaxed);
        self.open_handles.fetch_add(1, Relaxed);
        let gen = self.map_gen.load(Acquire);
        let map = self.current_map();
        VolumeHandle {
            gen,
            read_only: self.is_snapshot(),
            chain: self.ancestor_maps().into_boxed_slice(),
            map,
            layout: TierHandle::new(&self.pool.layout, &self.pool.cache),
            shift: self.pool.unit_shift,
            vol: self.clone(),
            first_writes: None,
            read_runs: Vec::new(),
            inflight: None,
            epoch: 0,
            patterns: Box::default(),
            ra_next: 0,
            ra: None,
            dedup: self.block_mapped() && self.pool.dedup().is_some(),
        }
    }

    /// A dedup volume (docs/format.md §17): its blocks are references to the pool's
    /// dedup store.
    pub fn block_mapped(&self) -> bool {
        self.block_mapped.load(Acquire)
    }
}

/// How far ahead of a sequential reader a handle reads into the pool's cache tier:
/// enough to cover a slow device's latency at the rate a stream consumes the cache.
const READAHEAD: u64 = 4 << 20;

/// One core's handle to a volume.
pub struct VolumeHandle {
    vol: Arc<Volume>,
    map: Arc<UnitMap>,
    /// The ancestors' maps, nearest first (empty for a volume outside any chain, whose
    /// datapath is then exactly the plain one). Boxed: the handle's size matters where
    /// it is held by value.
    chain: Box<[Arc<UnitMap>]>,
    /// A snapshot's handle: every change is refused (fixed for a volume's life).
    read_only: bool,
    gen: u64,
    /// The pool's layout, through its cache tier when it has one.
    layout: TierHandle,
    shift: u32,
    /// This core's first-write engine of the pool (`volume::first_write`), found on first use.
    first_writes: Option<std::rc::Rc<first_write::FirstWrites>>,
    /// Scratch for `read_chained`: the runs of one unit's read, decided once.
    read_runs: Vec<(u32, u64)>,
    /// This core's count of the pool's requests in flight (`inflight`), found on first use.
    inflight: Option<std::rc::Rc<CoreInflight>>,
    /// The token of the request being submitted (the epoch it counts under).
    epoch: u64,
    /// This handle's access-pattern detectors (`crate::pattern`; about 6 KiB, boxed
    /// to keep the handle small where it is moved by value).
    patterns: Box<HandlePatterns>,
    /// Readahead: the first volume unit not yet asked for.
    ra_next: u64,
    /// Readahead into buffers of its own, on a pool without a cache tier
    /// (`volume::readahead`).
    ra: Option<std::rc::Rc<std::cell::RefCell<readahead::Stream>>>,
    /// A block-mapped volume of a dedup pool: requests go to `dedup_io` (a flag, beside
    /// `read_only`: the handle's size matters where it is held by value).
    dedup: bool,
}

impl Drop for VolumeHandle {
    fn drop(&mut self) {
        self.patterns.flush(&self.vol.patterns);
        self.vol.open_handles.fetch_sub(1, Relaxed);
    }
}

impl VolumeHandle {
    pub fn volume(&self) -> &Arc<Volume> {
        &self.vol
    }

    /// True when no byte of `[offset, offset+len)` has space, so it reads as zeros without
    /// device I/O. Uses this core's cached map: no lock, no shared write, no allocation.
    /// A caller that finds a hole answers the read itself, without `submit`: the read is
    /// noted by the access-pattern detector here instead (a stream over a sparse
    /// volume is still a stream).
    pub fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        self.refresh();
        let last = (offset + len.max(1) - 1) >> self.shift;
        let hole = match self.vol.pool.dedup().filter(|_| self.dedup) {
            Some(d) => d.is_hole(self.vol.layer(), offset, len.max(1)),
            None => ((offset >> self.shift)..=last)
                .all(|u| self.map.get(u) == HOLE && self.chain.iter().all(|m| m.get(u) == HOLE)),
        };
        if hole {
            self.patterns
                .observe(Direction::Read, offset, len, &self.vol.patterns);
        }
        hole
    }

    #[inline]
    fn refresh(&mut self) {
        let g = self.vol.map_gen.load(Acquire);
        if g != self.gen {
            self.map = self.vol.current_map();
            self.chain = self.vol.ancestor_maps().into_boxed_slice();
            self.gen = g;
        }
    }

    /// The pool unit that holds block `b` of unit `u` as this volume reads it (its own
    /// unit where the block is present, else the nearest ancestor's), or [`HOLE`].
    #[inline]
    fn block_source(&self, u: u64, b: u32) -> u32 {
        let pres = &self.vol.pool.presence;
        std::iter::once(&self.map)
            .chain(self.chain.iter())
            .map(|m| m.get(u))
            .find(|&p| p != HOLE && pres.present(p, b))
            .unwrap_or(HOLE)
    }

    /// Where `[pos, end)` of unit `u` begins to be read: the source of `pos`'s block and
    /// the end of the run of blocks with the same source.
    #[inline]
    fn source_run(&self, u: u64, pos: u64, end: u64) -> (u32, u64) {
        let bshift = self.vol.pool.presence.block_shift;
        let mask = (1u64 << self.shift) - 1;
        let block = |at: u64| u32_of((at & mask) >> bshift);
        let src = self.block_source(u, block(pos));
        let mut next = ((pos >> bshift) + 1) << bshift;
        while next < end && self.block_source(u, block(next)) == src {
            next += 1 << bshift;
        }
        (src, next.min(end))
    }

    /// A read of `[at, at + seg)` of unit `u` of a volume in a chain into `b`: one
    /// device read per run of blocks with one source, zeros where no one has data.
    fn read_chained(&mut self, io: &mut CoreIo, u: u64, at: u64, seg: u64, b: *mut u8, tag: Tag) {
        let end = at + seg;
        // The runs are decided once, before anything is submitted: a first write on
        // another core may make a block present at any moment, and the join must get
        // exactly as many parts as are submitted (counting in one pass and submitting
        // from a second look-up left a join one part short, a read that never completed).
        let mut runs = std::mem::take(&mut self.read_runs);
        runs.clear();
        let mut pos = at;
        while pos < end {
            let (src, next) = self.source_run(u, pos, end);
            runs.push((src, next));
            pos = next;
        }
        let t = if runs.len() > 1 {
            io.join(tag, u32_of(runs.len()))
        } else {
            tag
        };
        let mut pos = at;
        for &(src, next) in runs.iter() {
            // SAFETY: pos - at + (next - pos) <= seg: inside this unit's part of the
            // submitter's buffer.
            let pb = unsafe { b.add(usize_of(pos - at)) };
            // SAFETY: `pb` spans `next - pos` bytes of the submitter's buffer, which it
            // keeps alive until the request completes (`IoHandle::submit`).
            unsafe { self.read_piece(io, src, pos, next - pos, pb, t) };
            pos = next;
        }
        self.read_runs = runs;
    }

    /// Whether a write of `[at, at + seg)` into unit `u` can go straight to the volume's
    /// own unit `p`: every block it touches is present there.
    #[inline]
    fn owns_blocks(&self, p: u32, at: u64, seg: u64) -> bool {
        let pres = &self.vol.pool.presence;
        let mask = (1u64 << self.shift) - 1;
        let b0 = u32_of((at & mask) >> pres.block_shift);
        let b1 = u32_of(((at + seg - 1) & mask) >> pres.block_shift);
        pres.all_present(p, b0, b1)
    }

    #[inline]
    fn pool_offset(&self, p: u32, at: u64) -> u64 {
        ((p as u64) << self.shift) | (at & ((1u64 << self.shift) - 1))
    }

    /// Split `[offset, offset+len)` at unit boundaries; call `f(unit, at, seg_len, range_off, tag)`.
    #[inline]
    fn for_units(
        &mut self,
        io: &mut CoreIo,
        offset: u64,
        len: u64,
        tag: Tag,
        mut f: impl FnMut(&mut Self, &mut CoreIo, u64, u64, u64, u64, Tag),
    ) {
        let first = offset >> self.shift;
        let last = (offset + len - 1) >> self.shift;
        if first == last {
            return f(self, io, first, offset, len, 0, tag);
        }
        let t = io.join(tag, u32_of(last - first + 1));
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let u = at >> self.shift;
            let seg = (((u + 1) << self.shift).min(end)) - at;
            f(self, io, u, at, seg, at - offset, t);
            at += seg;
        }
    }
}

impl IoHandle for VolumeHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let size = self.vol.size();
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, len as u64)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => {
                match io.remote_completer() {
                    Some(rc) => self.vol.pool.request_flush(rc, tag),
                    None => {
                        let r = self.vol.pool.commit().map_or(-libc::EIO, |_| 0);
                        io.complete(tag, r);
                    }
                }
                return;
            }
        };
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return io.complete(tag, -libc::EINVAL);
        }
        if len == 0 {
            return io.complete(tag, 0);
        }
        if self.read_only && !matches!(op, IoOp::Read { .. }) {
            return io.complete(tag, -libc::EROFS);
        }
        // A stream bypasses the cache tier's admission (`cache_tier`).
        let label = match op {
            IoOp::Read { .. } => {
                self.patterns
                    .observe(Direction::Read, offset, len, &self.vol.patterns)
            }
            IoOp::Write { .. } => {
                self.patterns
                    .observe(Direction::Write, offset, len, &self.vol.patterns)
            }
            _ => crate::pattern::Pattern::Unknown,
        };
        let sequential = label == crate::pattern::Pattern::Sequential;
        self.layout.sequential = sequential;
        // Counted in flight from before the map is looked at until it completes: a
        // snapshot or a release of units waits for it (`inflight`).
        if self.inflight.is_none() {
            self.inflight = Some(inflight_for(io, &self.vol.pool.inflight));
        }
        let (epoch, tag) = {
            let counter = self.inflight.as_deref().expect("set above");
            let epoch = counter.begin();
            (epoch, counter.track(io, tag, epoch))
        };
        self.epoch = epoch;
        if self.dedup {
            let pool = self.vol.pool.clone();
            let d = pool
                .dedup()
                .expect("set before any block-mapped volume exists");
            // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
            return unsafe { self.submit_dedup(io, d, op, tag) };
        }
        self.refresh();
        if !matches!(op, IoOp::Read { .. }) && self.ra.is_some() {
            self.readahead_invalidate(offset, len);
        }
        if self.vol.held(epoch) && !matches!(op, IoOp::Read { .. }) {
            // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
            return unsafe { self.submit_held(io, op, tag) };
        }
        match op {
            IoOp::Read { buf, .. } => {
                let caching = self.layout.caching();
                if !caching && self.readahead_serve(io, offset, len, buf, tag) {
                    if sequential {
                        self.readahead_extend(io, offset + len);
                    }
                    return;
                }
                // SAFETY: our caller upholds `IoHandle::submit`'s contract for `buf`.
                unsafe { self.read_volume(io, offset, len, buf, tag) };
                if sequential && caching && self.chain.is_empty() {
                    self.read_ahead(io, offset + len);
                } else if sequential && !caching && len <= readahead::MAX_READ {
                    self.readahead_extend(io, offset + len);
                }
            }
            IoOp::Write { buf, .. } => {
                self.for_units(io, offset, len, tag, |h, io, u, at, seg, roff, t| {
                    let mut p = h.map.get(u);
                    // SAFETY: roff + seg <= len, within the submitter's buffer.
                    let b = unsafe { buf.add(usize_of(roff)) };
                    if !h.chain.is_empty() && (p == HOLE || !h.owns_blocks(p, at, seg)) {
                        // SAFETY: the submitter keeps `b` alive until `t` completes.
                        return unsafe { h.first_write(io, u, at, seg, b, t) };
                    }
                    if p == HOLE {
                        match h.vol.pool.allocate(&h.vol, u, seg == 1u64 << h.shift) {
                            Ok(n) => p = n,
                            // The chain has data here, or the allocation reserve is
                            // being topped up: the first-write path plans (again).
                            Err(crate::pool::NEEDS_REDIRECT | crate::pool::NEEDS_RESERVE) => {
                                // SAFETY: as above.
                                return unsafe { h.first_write(io, u, at, seg, b, t) };
                            }
                            Err(e) => return io.complete(t, e),
                        }
                    }
                    let off = h.pool_offset(p, at);
                    // SAFETY: `b` is in the submitter's buffer (above), kept alive by our caller
                    // until `t` completes.
                    unsafe {
                        h.layout.submit(
                            io,
                            IoOp::Write {
                                offset: off,
                                len: u32_of(seg),
                                buf: b,
                            },
                            t,
                        )
                    };
                })
            }
            IoOp::Discard { .. } => {
                // In a chain only the units the chain below has nothing at are given
                // back (a released shared unit would show the parent's data again).
                self.release_whole_units(offset, len);
                io.complete(tag, 0);
            }
            IoOp::WriteZeroes { may_unmap, .. } => {
                self.write_zeroes(io, offset, len, may_unmap, tag)
            }
            IoOp::Flush => unreachable!("handled above"),
        }
    }

    fn size(&self) -> u64 {
        self.vol.size()
    }
}

impl VolumeHandle {
    /// Read `[offset, offset+len)` of the volume into `buf` (through its chain, holes
    /// as zeros).
    ///
    /// # Safety
    /// As [`IoHandle::submit`]: `buf` holds `len` bytes, valid until `tag` completes.
    unsafe fn read_volume(
        &mut self,
        io: &mut CoreIo,
        offset: u64,
        len: u64,
        buf: *mut u8,
        tag: Tag,
    ) {
        self.for_units(io, offset, len, tag, |h, io, u, at, seg, roff, t| {
            // SAFETY: roff + seg <= len, within the submitter's buffer.
            let b = unsafe { buf.add(usize_of(roff)) };
            if !h.chain.is_empty() {
                return h.read_chained(io, u, at, seg, b, t);
            }
            let p = h.map.get(u);
            // SAFETY: `b` is in the submitter's buffer (above), kept alive by our
            // caller until `t` completes.
            unsafe { h.read_piece(io, p, at, seg, b, t) };
        });
    }

    /// Read `len` bytes at volume offset `at` from pool unit `p` into `buf` (zeros for
    /// a `HOLE`), completing `t`.
    ///
    /// # Safety
    /// `buf` holds `len` bytes, valid until `t` completes.
    #[inline]
    unsafe fn read_piece(
        &mut self,
        io: &mut CoreIo,
        p: u32,
        at: u64,
        len: u64,
        buf: *mut u8,
        t: Tag,
    ) {
        if p == HOLE {
            // SAFETY: our caller's contract.
            unsafe { std::ptr::write_bytes(buf, 0, usize_of(len)) };
            io.complete(t, 0);
            return;
        }
        let offset = self.pool_offset(p, at);
        // SAFETY: as above.
        unsafe {
            self.layout.submit(
                io,
                IoOp::Read {
                    offset,
                    len: u32_of(len),
                    buf,
                },
                t,
            )
        };
    }

    /// A change that began while a snapshot of the volume is being taken: it waits in
    /// the first-write path (which retries it each round until the snapshot has its
    /// map) and then goes to the volume's new layer. A discard is dropped (it is
    /// advisory; releasing units now would take them from the snapshot).
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn submit_held(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let (offset, len, buf) = match op {
            IoOp::Write { offset, len, buf } => (offset, len as u64, buf),
            IoOp::WriteZeroes { offset, len, .. } => (offset, len, std::ptr::null()),
            _ => return io.complete(tag, 0),
        };
        self.for_units(io, offset, len, tag, |h, io, u, at, seg, roff, t| {
            let b = if buf.is_null() {
                buf
            } else {
                // SAFETY: roff + seg <= len, within the submitter's buffer.
                unsafe { buf.add(usize_of(roff)) }
            };
            // SAFETY: the submitter keeps `b` alive until `t` completes.
            unsafe { h.first_write(io, u, at, seg, b, t) }
        });
    }

    /// A sequential reader reached `end`: ask the cache tier for the volume units up to
    /// `READAHEAD` beyond it that were not asked for yet (holes and units in a chain are
    /// skipped; a stream that jumps starts over from where it is).
    fn read_ahead(&mut self, io: &mut CoreIo, end: u64) {
        let cur = (end - 1) >> self.shift;
        let last = (cur + (READAHEAD >> self.shift).max(1)).min(self.map.len().saturating_sub(1));
        let first = if self.ra_next > cur && self.ra_next <= last + 1 {
            self.ra_next
        } else {
            cur + 1
        };
        for u in first..=last {
            let p = self.map.get(u);
            if p != HOLE {
                self.layout
                    .prefetch(io, u64::from(p) << self.shift, 1 << self.shift);
            }
        }
        self.ra_next = last + 1;
    }

    /// Release every unit wholly inside the range; partial units are left alone
    /// (discard is advisory).
    fn release_whole_units(&mut self, offset: u64, len: u64) {
        let unit = 1u64 << self.shift;
        let first = offset.div_ceil(unit);
        let end = offset + len;
        // The volume's last unit may be partial: it counts as whole when the range
        // reaches the end of the volume.
        let last_excl = if end >= self.vol.size() {
            end.div_ceil(unit)
        } else {
            end / unit
        };
        if last_excl > first {
            if self.chain.is_empty() {
                self.vol.pool.unmap_units(&self.vol, first, last_excl - 1);
            } else {
                self.vol
                    .pool
                    .unmap_unshared_units(&self.vol, first, last_excl - 1);
            }
        }
    }

    fn write_zeroes(&mut self, io: &mut CoreIo, offset: u64, len: u64, may_unmap: bool, tag: Tag) {
        if !self.chain.is_empty() {
            return self.write_zeroes_chained(io, offset, len, may_unmap, tag);
        }
        if may_unmap {
            self.release_whole_units(offset, len);
        }
        // What is left, unit by unit (like reads and writes: one join, no allocation):
        // mapped parts get zeros written; holes already read as zeros, but NO_HOLE asks
        // for space, so they are allocated (allocation zeroes them).
        self.for_units(io, offset, len, tag, |h, io, u, at, seg, _roff, t| {
            let p = h.map.get(u);
            if p != HOLE {
                let offset = h.pool_offset(p, at);
                // SAFETY: WriteZeroes carries no buffer.
                unsafe {
                    h.layout.submit(
                        io,
                        IoOp::WriteZeroes {
                            offset,
                            len: seg,
                            may_unmap: false,
                        },
                        t,
                    )
                };
            } else if may_unmap {
                io.complete(t, 0);
            } else {
                match h.vol.pool.allocate(&h.vol, u, false) {
                    Ok(_) => io.complete(t, 0),
                    // SAFETY: zeros: no buffer.
                    Err(crate::pool::NEEDS_REDIRECT | crate::pool::NEEDS_RESERVE) => unsafe {
                        h.first_write(io, u, at, seg, std::ptr::null(), t)
                    },
                    Err(e) => io.complete(t, e),
                }
            }
        });
    }

    /// Write-zeroes on a volume in a chain: only units the chain below has nothing at
    /// are released (a shared one would show its parent's data again); blocks it owns
    /// get zeros written, the others go the first-write path.
    fn write_zeroes_chained(
        &mut self,
        io: &mut CoreIo,
        offset: u64,
        len: u64,
        may_unmap: bool,
        tag: Tag,
    ) {
        if may_unmap {
            self.release_whole_units(offset, len);
        }
        self.for_units(io, offset, len, tag, |h, io, u, at, seg, _roff, t| {
            let p = h.map.get(u);
            if p == HOLE && may_unmap && h.chain.iter().all(|m| m.get(u) == HOLE) {
                // Reads as zeros already, and no space was asked for.
                return io.complete(t, 0);
            }
            if p != HOLE && h.owns_blocks(p, at, seg) {
                let offset = h.pool_offset(p, at);
                // SAFETY: WriteZeroes carries no buffer.
                unsafe {
                    h.layout.submit(
                        io,
                        IoOp::WriteZeroes {
                            offset,
                            len: seg,
                            may_unmap: false,
                        },
                        t,
                    )
                };
            } else {
                // SAFETY: zeros: no buffer.
                unsafe { h.first_write(io, u, at, seg, std::ptr::null(), t) };
            }
        });
    }

    /// Hand a write (of `seg` bytes from `data`, or zeros when null) at `at` in unit `u`
    /// to the first-write path (`volume::first_write`).
    ///
    /// # Safety
    /// `data`, when not null, points to `seg` bytes kept alive until `t` completes.
    unsafe fn first_write(
        &mut self,
        io: &mut CoreIo,
        u: u64,
        at: u64,
        seg: u64,
        data: *const u8,
        t: Tag,
    ) {
        let engine = match &self.first_writes {
            Some(e) => e.clone(),
            None => {
                let e =
                    crate::core_engine::core_engine::<first_write::FirstWrites>(io, &self.vol.pool);
                self.first_writes = Some(e.clone());
                e
            }
        };
        debug_assert_eq!(u, at >> self.shift);
        // SAFETY: forwarded to the caller.
        unsafe { engine.submit(io, &self.vol, self.epoch, at, seg, data, t) };
    }
}

/// The thin volume as an export target: what NBD and NVMe/TCP serve.
impl ExportTarget for Volume {
    type Handle = VolumeHandle;

    fn size(&self) -> u64 {
        Volume::size(self)
    }

    fn read_only(&self) -> bool {
        self.is_snapshot()
    }

    fn allocated_bytes(&self) -> u64 {
        Volume::allocated_bytes(self)
    }

    fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        Volume::allocation_runs(self, offset, len, max_runs)
    }

    fn change_bases(&self) -> Vec<String> {
        Volume::change_bases(self)
    }

    fn change_base(&self, name: &str) -> Option<u64> {
        Volume::change_base(self, name).map(u64::from)
    }

    fn changed_runs(
        &self,
        base: u64,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        Volume::changed_runs(self, u32::try_from(base).ok()?, offset, len, max_runs)
    }

    fn register_stats(&self) -> Arc<IoStats> {
        Volume::register_stats(self)
    }

    fn unregister_stats(&self, stats: &Arc<IoStats>) {
        Volume::unregister_stats(self, stats)
    }

    fn stats(&self) -> StatsSnapshot {
        Volume::stats(self)
    }

    fn open(self: &Arc<Self>) -> VolumeHandle {
        self.open_handle()
    }
}

impl ExportHandle for VolumeHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        // SAFETY: the same contract, which our caller upholds.
        unsafe { IoHandle::submit(self, io, op, tag) }
    }

    #[inline]
    fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        VolumeHandle::is_hole(self, offset, len)
    }

    /// A read of a region this handle's detector calls random goes first (seed 004's
    /// QoS: random reads before writes).
    fn reads_first_at(&self, offset: u64) -> bool {
        self.vol.pool.random_reads_first.load(Relaxed)
            && self.patterns.label_at(Direction::Read, offset) == crate::pattern::Pattern::Random
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data patterns wrap on purpose
mod tests {
    use std::sync::Arc;

    use tessera_device::{BlockDevice, RamDevice};
    use tessera_qos::QosLimits;

    use super::{UnitMap, HOLE, LEAF_UNITS};
    use crate::{Pool, PoolOptions};

    /// Volumes may add up to the overcommit ratio times the capacity; beyond, creation
    /// and growth are refused with the figures, unless forced.
    #[test]
    fn overcommit_ratio_is_enforced_unless_forced() {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
        let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
        let cap = pool.status().capacity;
        assert_eq!(pool.overcommit(), crate::DEFAULT_OVERCOMMIT);
        pool.create_volume("a", 12 * cap).unwrap();
        let Err(e) = pool.create_volume("b", 9 * cap) else {
            panic!("a volume beyond the ratio was created")
        };
        assert_eq!(e.kind(), crate::ErrorKind::NoSpace);
        let m = e.to_string();
        assert!(m.contains("20x") && m.contains("--force"), "{e}");
        assert!(m.contains(&format!("{} bytes", 21 * cap)), "{e}");
        assert!(pool.volume("b").is_none());
        pool.create_volume("b", 8 * cap).unwrap();
        let b = pool.volume("b").unwrap();
        assert_eq!(
            pool.resize_volume(&b, 8 * cap + (1 << 20))
                .unwrap_err()
                .kind(),
            crate::ErrorKind::NoSpace
        );
        assert_eq!(b.size(), 8 * cap);
        pool.resize_volume_opts(&b, 9 * cap, true).unwrap();
        assert_eq!(b.size(), 9 * cap);
        pool.create_volume_opts(
            "c",
            1 << 50,
            crate::VolumeOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(pool.status().provisioned, 21 * cap + (1 << 50));
        assert!(pool.set_overcommit(0.0).is_err());
        assert!(pool.set_overcommit(f64::NAN).is_err());
        pool.set_overcommit(1e9).unwrap();
        pool.create_volume("d", 1 << 40).unwrap();
        pool.set_overcommit(1.0).unwrap();
        assert_eq!(pool.status().overcommit, 1.0);
        assert!(pool.create_volume("e", 512).is_err());
    }

    /// 1 PiB of 1 MiB units.
    const PIB_UNITS: u64 = 1 << 30;

    #[test]
    fn sparse_map_reads_holes_without_leaves() {
        let map = UnitMap::new(PIB_UNITS);
        assert_eq!(map.len(), PIB_UNITS);
        assert_eq!(map.leaves(), 0);
        for u in [
            0,
            1,
            LEAF_UNITS,
            PIB_UNITS / 2,
            PIB_UNITS - 1,
            PIB_UNITS + 7,
        ] {
            assert_eq!(map.get(u), HOLE);
        }
        // Clearing a hole allocates nothing.
        map.set(12345, HOLE);
        assert_eq!(map.leaves(), 0);
        map.set(PIB_UNITS / 2, 42);
        map.set(PIB_UNITS - 1, 43);
        assert_eq!(map.leaves(), 2);
        assert_eq!(map.get(PIB_UNITS / 2), 42);
        assert_eq!(map.get(PIB_UNITS / 2 - 1), HOLE);
        assert_eq!(map.get(PIB_UNITS / 2 + 1), HOLE);
        assert_eq!(map.get(PIB_UNITS - 1), 43);
        assert_eq!(
            map.mapped_in(0, PIB_UNITS).collect::<Vec<_>>(),
            vec![(PIB_UNITS / 2, 42), (PIB_UNITS - 1, 43)]
        );
        assert_eq!(map.mapped_in(0, PIB_UNITS / 2).count(), 0);
        assert_eq!(
            map.mapped_in(PIB_UNITS / 2, PIB_UNITS / 2 + 1)
                .collect::<Vec<_>>(),
            vec![(PIB_UNITS / 2, 42)]
        );
    }

    #[test]
    fn runs_skip_missing_leaves() {
        let map = UnitMap::new(PIB_UNITS);
        for u in [5, 6, PIB_UNITS / 2] {
            map.set(u, u as u32);
        }
        let t = std::time::Instant::now();
        assert_eq!(map.run_from(0, PIB_UNITS), (false, 5));
        assert_eq!(map.run_from(5, PIB_UNITS), (true, 7));
        assert_eq!(map.run_from(7, PIB_UNITS), (false, PIB_UNITS / 2));
        assert_eq!(
            map.run_from(PIB_UNITS / 2, PIB_UNITS),
            (true, PIB_UNITS / 2 + 1)
        );
        assert_eq!(
            map.run_from(PIB_UNITS / 2 + 1, PIB_UNITS),
            (false, PIB_UNITS)
        );
        assert_eq!(map.run_from(3, 5), (false, 5));
        // A leaf that was used and emptied again is a hole too.
        map.set(PIB_UNITS / 2, HOLE);
        assert_eq!(map.run_from(7, PIB_UNITS), (false, PIB_UNITS));
        // A walk per unit would take seconds; one per leaf slot takes microseconds.
        assert!(t.elapsed() < std::time::Duration::from_millis(500));
    }

    #[test]
    fn grown_and_compacted_maps_share_leaves() {
        let old = UnitMap::new(3 * LEAF_UNITS);
        old.set(1, 10);
        old.set(LEAF_UNITS + 1, 11);
        let grown = UnitMap::grown(&old, 10 * LEAF_UNITS);
        assert_eq!(grown.len(), 10 * LEAF_UNITS);
        assert_eq!((grown.get(1), grown.get(LEAF_UNITS + 1)), (10, 11));
        // Shared: a change through the new map is seen through the old one (handles
        // still reading it until their next request).
        grown.set(2, 12);
        assert_eq!(old.get(2), 12);
        grown.set(LEAF_UNITS + 1, HOLE);
        assert!(grown.has_empty_leaf_in(0, grown.len()));
        let compacted = UnitMap::compacted(&grown);
        assert_eq!(compacted.leaves(), 1);
        assert_eq!((compacted.get(1), compacted.get(2)), (10, 12));
        drop(grown);
        drop(compacted);
        // The old map still owns its leaves.
        assert_eq!(
            (old.get(1), old.get(2), old.get(LEAF_UNITS + 1)),
            (10, 12, HOLE)
        );
    }

    /// Readers on other threads, loading without a lock while leaves are installed and
    /// the map is compacted and replaced: every load is a hole or the unit's mapping,
    /// and once seen mapped a unit stays mapped.
    #[test]
    fn concurrent_readers_during_leaf_installs() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::RwLock;
        let units = 64 * LEAF_UNITS;
        let current = Arc::new(RwLock::new(UnitMap::new(units)));
        let done = Arc::new(AtomicBool::new(false));
        let mapping = |u: u64| (u * 7 % 1_000_003) as u32;
        let readers: Vec<_> = (0..3)
            .map(|r| {
                let (current, done) = (current.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut seen = vec![false; units as usize];
                    let mut loads = 0u64;
                    // At least one pass, even when this thread first runs after the
                    // writer finished (a loaded machine): the count below then still
                    // proves the reader read something.
                    loop {
                        let finished = done.load(Ordering::Acquire);
                        let map = current.read().unwrap().clone();
                        for i in 0..4096 {
                            let u = (i * 131 + r * 17 + loads) % units;
                            let p = map.get(u);
                            if p == HOLE {
                                assert!(!seen[u as usize], "unit {u} went back to a hole");
                            } else {
                                assert_eq!(p, mapping(u), "unit {u}");
                                seen[u as usize] = true;
                            }
                        }
                        loads += 1;
                        if finished {
                            break;
                        }
                    }
                    seen.iter().filter(|&&s| s).count()
                })
            })
            .collect();
        // The writer: one unit per leaf first (every leaf installed under the readers),
        // then the rest; empty leaves appear and are compacted away between.
        for u in (0..units).step_by(LEAF_UNITS as usize).chain(0..units) {
            let map = current.read().unwrap().clone();
            if map.get(u) == HOLE {
                map.set(u, mapping(u));
            }
            if u % 1024 == 0 {
                let compacted = UnitMap::compacted(&map);
                *current.write().unwrap() = compacted;
            }
        }
        done.store(true, Ordering::Release);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
        let map = current.read().unwrap().clone();
        assert_eq!(map.leaves(), 64);
        assert!((0..units).all(|u| map.get(u) == mapping(u)));
    }

    /// A 1 PiB volume on a small pool: block status over the whole volume reports the
    /// few written units, without walking a billion entries.
    #[test]
    fn allocation_runs_of_a_huge_sparse_volume() {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
        let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
        let vol = pool
            .create_volume_opts(
                "v",
                1 << 50,
                crate::VolumeOptions {
                    force: true,
                    ..Default::default()
                },
            )
            .unwrap();
        let unit = 1u64 << 20;
        for u in [0u64, 1, 1 << 29] {
            pool.core.allocate(&vol, u, true).unwrap();
        }
        assert_eq!(vol.map_leaves(), 2);
        let t = std::time::Instant::now();
        assert_eq!(
            vol.allocation_runs(0, 1 << 50, 16),
            vec![
                (2 * unit, true),
                (((1 << 29) - 2) * unit, false),
                (unit, true),
                ((1 << 50) - ((1 << 29) + 1) * unit, false),
            ]
        );
        // Clipped to the range, partial units included.
        assert_eq!(
            vol.allocation_runs(2 * unit - 512, 4096, 16),
            vec![(512, true), (4096 - 512, false)]
        );
        assert_eq!(vol.allocation_runs(0, 1 << 50, 1), vec![(2 * unit, true)]);
        assert!(t.elapsed() < std::time::Duration::from_millis(500));
        // Trim gives the leaf back at the next commit.
        pool.core.unmap_units(&vol, 1 << 29, 1 << 29);
        assert_eq!(vol.map_leaves(), 2);
        pool.commit().unwrap();
        assert_eq!(vol.map_leaves(), 1);
        assert_eq!(
            vol.allocation_runs(0, 1 << 50, 16),
            vec![(2 * unit, true), ((1 << 50) - 2 * unit, false)]
        );
    }

    /// QoS limits in pool metadata (written before QoS moved to the node's catalog) are
    /// read back, and written back by checkpoints, until the node has taken them.
    #[test]
    fn legacy_qos_limits_are_kept_until_cleared() {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
        let pool = Pool::create("p", vec![dev.clone()], PoolOptions::default()).unwrap();
        let vol = pool.create_volume("v", 8 << 20).unwrap();
        assert_eq!(vol.legacy_qos(), None);
        let limits = QosLimits {
            iops: Some(1000),
            ..QosLimits::default()
        };
        // As an older version wrote it.
        *vol.legacy_qos.lock().unwrap() = Some(limits.clone());
        pool.core.checkpoint().unwrap();
        drop((vol, pool));

        let pool = Pool::open(vec![dev.clone()]).unwrap();
        let vol = pool.volume_by_id(1).unwrap();
        assert_eq!(vol.legacy_qos(), Some(limits));
        vol.clear_legacy_qos();
        pool.core.checkpoint().unwrap();
        drop((vol, pool));

        let pool = Pool::open(vec![dev]).unwrap();
        assert_eq!(pool.volume_by_id(1).unwrap().legacy_qos(), None);
    }
}
