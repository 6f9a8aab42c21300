//! A dedup pool's metadata (docs/format.md §17): the store of 4 KiB blocks with their
//! reference counts, the map of every block-mapped layer, and the fingerprint index.
//!
//! Everything here changes under one lock ([`DedupCore::state`]) and in RAM first; the
//! commit thread makes it durable by writing the dirty map and refcount pages as shadow
//! pages (`take_dirty` / `pages_done`) that its journal block makes valid. This first
//! cut keeps every map and refcount page resident (8 bytes per mapped 4 KiB block and
//! 4 bytes per store block); bounded page caches come next (docs/format.md §17, "RAM").
//!
//! Lock order: this lock, then the pool's (allocating a unit for the store or a map).
//! The commit thread takes this lock before the pool's too.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_io::cast::usize_of;
use tessera_io::sync::MutexExt;
use tessera_io::AlignedBuf;

use super::index::{BucketArea, Fingerprint, FingerprintIndex};
use super::pages::{self, PageId, ABSENT, COUNTS, MAP_ENTRIES, PAGES_PER_UNIT, PAIR, ZERO};
use crate::format::{Uuid, BLOCK};
use crate::layout::Layout;

/// Map pages a scan of a whole layer (removal, `drop_covered`, `exclusive_bytes`)
/// handles per hold of the dedup lock, which every dedup write takes: 64 pages of 256
/// entries, tens of microseconds.
const SCAN_CHUNK_PAGES: usize = 64;
/// Steps (a block, or a volume unit without pages) a range scan (block status, changed
/// extents) takes per hold of the dedup lock.
const SCAN_STEPS: usize = 1 << 14;

/// What `publish` answers when a block the write merged was changed by another write
/// meanwhile: write again (not an errno; never reaches a client).
pub(crate) const MERGE_CONFLICT: i32 = -(1 << 20);

/// Owner-table ids of dedup units (docs/format.md §17).
pub const OWNER_STORE: u32 = 0xFFFF_FFFC;
pub const OWNER_REFCOUNT: u32 = 0xFFFF_FFFB;
pub const OWNER_INDEX: u32 = 0xFFFF_FFFA;
/// The second owner field of a block-mapped layer's map unit `k` is `MAP_UNIT | k`.
pub const MAP_UNIT: u32 = 0x8000_0000;

/// Bytes of a dedup block.
pub const DBLOCK: u64 = BLOCK as u64;
/// Blocks per store unit and per map page (dedup pools have 1 MiB units).
pub const BLOCKS_PER_UNIT: u64 = MAP_ENTRIES as u64;
/// Free store blocks below which a write asks for an early commit (when blocks freed
/// since the last one wait for it): 64 MiB of writes.
const REFILL_BELOW: usize = 16384;
/// Stale index entries queued for the commit thread to drop (64 KiB of RAM at most).
const STALE_QUEUE: usize = 4096;

/// The one unit size dedup supports in this cut.
pub const DEDUP_UNIT: u64 = BLOCKS_PER_UNIT * DBLOCK;

/// Which slot of a page holds its newest durable copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    None,
    A,
    B,
}

impl Slot {
    /// The slot a new copy goes to: never the newest durable one.
    fn other(self) -> Slot {
        match self {
            Slot::B => Slot::A,
            _ => Slot::B,
        }
    }
}

struct MapPage {
    entries: Box<[u64; MAP_ENTRIES]>,
    slot: Slot,
}

/// Blocks per region of the gain detector (1 GiB).
const GAIN_REGION_BLOCKS: u64 = 1 << 18;
/// Lookups a region's verdict is based on.
const GAIN_WINDOW: u32 = 4096;
/// While a region skips, one write in this many is still looked up (to see a change).
const GAIN_SAMPLE: u32 = 64;

/// Whether dedup pays in one region of a layer: over each window of `GAIN_WINDOW`
/// lookups, a region whose lookups found a stored block for under 1% of them skips
/// fingerprinting for small random writes until a later window finds more (the seed's
/// access-pattern detection: small random I/O where dedup is not gaining is not
/// deduplicated).
#[derive(Default)]
struct Gain {
    lookups: u32,
    hits: u32,
    skipping: bool,
    writes: u32,
}

/// One block-mapped layer's map.
#[derive(Default)]
struct LayerMap {
    /// Map unit `k` → pool unit.
    units: BTreeMap<u32, u32>,
    /// Volume unit → its page (only pages ever written).
    pages: HashMap<u32, MapPage, FpBuild>,
    /// Per region of `GAIN_REGION_BLOCKS`, whether dedup is paying there.
    gain: HashMap<u64, Gain, FpBuild>,
    dirty: BTreeSet<u32>,
    /// Entries that reference a store block.
    mapped: u64,
}

struct CountPage {
    counts: Box<[u32; COUNTS]>,
    slot: Slot,
}

/// Fingerprints are uniformly random and PBAs are dense: their own low bits hash them
/// (the default SipHash cost more than the rest of a lookup).
#[derive(Default)]
pub(crate) struct FpHasher(u64);

impl std::hash::Hasher for FpHasher {
    fn finish(&self) -> u64 {
        // Spread dense PBAs over the table's high bits too.
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes.iter().take(8) {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = u64::try_from(v & u128::from(u64::MAX)).expect("masked to 64 bits");
    }
}

type FpBuild = std::hash::BuildHasherDefault<FpHasher>;
type FpMap<V> = HashMap<u128, V, FpBuild>;

/// The fingerprint of a block written without one (the gain detector skipped it).
pub(crate) const UNHASHED: u128 = 0;

/// Slots of `State::recent` (a power of two; 24 bytes each: 96 KiB).
const RECENT_SLOTS: usize = 4096;

/// The `recent` slot of fingerprint `fp` (bits the bucket number and the short
/// fingerprint do not use).
fn recent_slot(fp: u128) -> usize {
    usize_of(u64::try_from(fp >> 96).expect("32 bits")) & (RECENT_SLOTS - 1)
}

/// Record that `pba` now holds `fp` for the index (replacing its older pending entry).
fn note_index(st: &mut State, fp: u128, pba: u64) {
    if fp == UNHASHED {
        // Its new bytes are not known: its pending entry (if any) is stale.
        if let Some(old) = st.pending_by_pba.remove(&pba) {
            if st.pending_index.get(&old) == Some(&pba) {
                st.pending_index.remove(&old);
            }
        }
        return;
    }
    if let Some(old) = st.pending_by_pba.insert(pba, fp) {
        if old != fp && st.pending_index.get(&old) == Some(&pba) {
            st.pending_index.remove(&old);
        }
    }
    st.pending_index.insert(fp, pba);
    st.recent[recent_slot(fp)] = (fp, pba);
}

pub(crate) struct State {
    /// Store unit `s` → pool unit.
    store_units: Vec<u32>,
    /// Refcount pages, by page number.
    count_pages: Vec<CountPage>,
    /// Refcount unit `r` → pool unit.
    count_units: Vec<u32>,
    dirty_counts: BTreeSet<u32>,
    /// Free store blocks, popped from the end (kept descending: lowest first).
    free: Vec<u64>,
    /// Blocks whose count reached zero since the last commit: free once it is durable.
    pending_free: Vec<u64>,
    layers: HashMap<u32, LayerMap, FpBuild>,
    /// Layer → the layer it reads through where it has no entry (its volume's parent
    /// snapshot's layer, docs/format.md §3.4): absent entries fall through, a `ZERO`
    /// entry stops there.
    parents: HashMap<u32, u32, FpBuild>,
    /// Index entries not on the device yet (the commit thread writes them), and the
    /// same by block: a block's newer contents replace its older pending entry, so this
    /// never holds more entries than the store has blocks.
    pending_index: FpMap<u64>,
    /// Blocks shared or stored lately, by fingerprint (direct-mapped, `RECENT_SLOTS`;
    /// `UNHASHED` = empty): a hint like the index, tried before its bucket is read.
    recent: Box<[(u128, u64)]>,
    pending_by_pba: HashMap<u64, u128, FpBuild>,
    /// Device index entries a lookup found stale (their block referenced, steady, and
    /// holding other bytes: an overwrite in place leaves its block's old entry behind):
    /// `flush_index` drops them. At most `STALE_QUEUE`; the scrub finds the rest.
    stale_index: Vec<(u128, u64)>,
    /// Fingerprints of new blocks being written (taken, not yet published): a write of
    /// the same bytes waits for them to be published, then shares them.
    in_flight: FpMap<u64>,
    /// Blocks being overwritten in place (`Placement::InPlace`): never shared meanwhile.
    overwriting: std::collections::HashSet<u64>,
    /// Blocks whose count dropped (and stayed above zero) since the dirty pages were
    /// last taken, and those whose drop the commit in flight (or a failed one) carries.
    /// The durable maps may still reference such a block more often than its count
    /// says: overwritten in place now, a power loss would bring back a map entry that
    /// reads the new bytes. So it is not overwritten in place until that commit is
    /// durable.
    released: std::collections::HashSet<u64>,
    releasing: std::collections::HashSet<u64>,
    /// Blocks (layer, block) a write is merging now: read, merged with the client's
    /// part of it, stored whole. Another write of part of such a block waits for it
    /// (both would merge into the same old bytes, and the second to publish would undo
    /// the first), and none overwrites it in place.
    merging: std::collections::HashSet<(u32, u64)>,
    /// References taken by writes in flight (`share`: counted, not yet in a map), by
    /// block. Every count equals the map references plus these whenever the lock is
    /// free, which is what the scrub checks on a live pool.
    sharing: HashMap<u64, u32, FpBuild>,
    /// A commit was asked for because free blocks ran low (cleared by the commit).
    refill_asked: bool,
    /// Store blocks referenced.
    used: u64,
}

/// What a dedup pool did since it was opened.
#[derive(Default)]
pub(crate) struct Counters {
    pub hits: AtomicU64,
    pub new_blocks: AtomicU64,
    pub zero_blocks: AtomicU64,
    /// Blocks written without a lookup: the gain detector found their region not
    /// gaining from dedup.
    pub skipped_blocks: AtomicU64,
    /// Blocks written without a lookup because dedup was off (`pool update --dedup off`).
    pub off_blocks: AtomicU64,
    /// Candidates whose bytes differed (a fingerprint match that was not a duplicate, or
    /// a stale index entry).
    pub compare_mismatches: AtomicU64,
}

pub struct DedupCore {
    pub(crate) state: Mutex<State>,
    pub(crate) index: FingerprintIndex,
    pub(crate) buckets: u64,
    pub(crate) counters: Counters,
    pub(crate) layout: Arc<Layout>,
    uuid: Uuid,
    shift: u32,
    /// Whether writes look their blocks up and new volumes are block-mapped (the catalog's
    /// pool flag bit 0). Off, the store, the maps and the index stay: shared blocks stay
    /// shared, and writes store their blocks without a lookup.
    active: AtomicBool,
}

/// How a block of a write is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Already stored at this PBA; its count was raised for this write.
    Shared(u64),
    /// Written to this newly taken PBA (count raised at publication).
    New(u64, u128),
    /// Written over this PBA, which only this block referenced (no count changes):
    /// a random overwrite of unshared data costs no new block and no metadata.
    InPlace(u64, u128),
    /// All zeros: no block.
    Zero,
}

/// Dirty pages taken by a commit: written, then reported back with `pages_done`.
#[derive(Default)]
pub(crate) struct PageBatch {
    items: Vec<BatchItem>,
    /// Blocks freed by the changes in this batch.
    pub(crate) freed: Vec<u64>,
}

struct BatchItem {
    /// Layer and volume unit of a map page, or `None` and the refcount page number.
    layer: Option<u32>,
    number: u32,
    slot: Slot,
    offset: u64,
    content: Content,
}

enum Content {
    Map(Box<[u64; MAP_ENTRIES]>),
    Counts(Box<[u32; COUNTS]>),
}

impl PageBatch {
    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// The pool's index units as one byte range.
pub(crate) struct IndexArea {
    pub layout: Arc<Layout>,
    pub units: Vec<u32>,
    pub shift: u32,
}

impl IndexArea {
    fn each(
        &self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(u64, usize, usize) -> io::Result<()>,
    ) -> io::Result<()> {
        let unit = 1u64 << self.shift;
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            let i = usize_of(at >> self.shift);
            let p = *self.units.get(i).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "beyond the index units")
            })?;
            let within = at & (unit - 1);
            let n = (len - done).min(usize_of(unit - within));
            f((u64::from(p) << self.shift) + within, done, n)?;
            done += n;
        }
        Ok(())
    }
}

impl BucketArea for IndexArea {
    fn size(&self) -> u64 {
        (self.units.len() as u64) << self.shift
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let len = buf.len();
        self.each(offset, len, |at, from, n| {
            self.layout.read_at(at, &mut buf[from..from + n])
        })
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.each(offset, buf.len(), |at, from, n| {
            self.layout.write_at(at, &buf[from..from + n])
        })
    }
}

/// What a loaded pool's owner table says about its dedup units.
#[derive(Default)]
pub(crate) struct DedupUnits {
    pub store: BTreeMap<u32, u32>,
    pub counts: BTreeMap<u32, u32>,
    pub index: BTreeMap<u32, u32>,
    /// Layer → map unit `k` → pool unit.
    pub maps: HashMap<u32, BTreeMap<u32, u32>>,
}

fn pba_of(entry: u64) -> Option<u64> {
    (entry >= 2).then(|| entry - 2)
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl DedupCore {
    /// Open the dedup metadata of a pool: read every map and refcount page of `units`
    /// (valid when no newer than journal sequence `durable`) and the index.
    pub(crate) fn open(
        layout: Arc<Layout>,
        uuid: Uuid,
        shift: u32,
        units: DedupUnits,
        buckets: u64,
        durable: u64,
    ) -> io::Result<DedupCore> {
        let unit = 1u64 << shift;
        if unit != DEDUP_UNIT {
            return Err(invalid(format!(
                "dedup needs 1 MiB units, this pool has {unit}"
            )));
        }
        let dense = |m: &BTreeMap<u32, u32>, what: &str| -> io::Result<Vec<u32>> {
            m.iter()
                .enumerate()
                .map(|(i, (&k, &p))| {
                    if k as usize == i {
                        Ok(p)
                    } else {
                        Err(invalid(format!(
                            "{what} unit {i} is missing from the owner table"
                        )))
                    }
                })
                .collect()
        };
        let store_units = dense(&units.store, "store")?;
        let count_units = dense(&units.counts, "refcount")?;
        let index_units = dense(&units.index, "index")?;
        let mut buf = AlignedBuf::zeroed(usize_of(unit));
        // Refcount pages: one per 1000 store blocks.
        let blocks = store_units.len() as u64 * BLOCKS_PER_UNIT;
        let npages = blocks.div_ceil(COUNTS as u64);
        let mut count_pages = Vec::new();
        // Slots written by a commit that a power loss took (device offsets): erased
        // below, before any commit of this open reaches their generation.
        let mut future = Vec::new();
        let mut note_future = |pair: &[u8], id: PageId, at: u64| {
            for (half, slot) in pair.chunks(BLOCK).enumerate() {
                if pages::is_future(slot, id, &uuid, durable) {
                    future.push(at + half as u64 * DBLOCK);
                }
            }
        };
        for (r, &p) in count_units.iter().enumerate() {
            let base = u64::from(p) << shift;
            layout.read_at(base, buf.as_mut_slice())?;
            for i in 0..PAGES_PER_UNIT {
                let number = r as u64 * PAGES_PER_UNIT + i;
                let id = PageId {
                    refcount: true,
                    layer: 0,
                    number: u32::try_from(number).expect("page numbers fit u32"),
                };
                let pair = &buf.as_slice()[usize_of(i * PAIR)..usize_of((i + 1) * PAIR)];
                // Pages past the store's end too: the lost commit may have grown it.
                note_future(pair, id, base + i * PAIR);
                if number >= npages {
                    continue;
                }
                count_pages.push(match pages::newest(pair, id, &uuid, durable) {
                    Some((b, bytes)) => CountPage {
                        counts: pages::decode_counts(bytes),
                        slot: if b { Slot::B } else { Slot::A },
                    },
                    None => CountPage {
                        counts: Box::new([0; COUNTS]),
                        slot: Slot::None,
                    },
                });
            }
        }
        while (count_pages.len() as u64) < npages {
            // A page whose unit was never allocated: no block of it was ever counted.
            count_pages.push(CountPage {
                counts: Box::new([0; COUNTS]),
                slot: Slot::None,
            });
        }
        let mut layers: HashMap<u32, LayerMap, FpBuild> = HashMap::default();
        for (layer, map_units) in units.maps {
            let mut lm = LayerMap {
                units: map_units.clone(),
                ..Default::default()
            };
            for (&k, &p) in &map_units {
                let base = u64::from(p) << shift;
                layout.read_at(base, buf.as_mut_slice())?;
                for i in 0..PAGES_PER_UNIT {
                    let vunit = u64::from(k) * PAGES_PER_UNIT + i;
                    let Ok(vunit) = u32::try_from(vunit) else {
                        break;
                    };
                    let id = PageId {
                        refcount: false,
                        layer,
                        number: vunit,
                    };
                    let pair = &buf.as_slice()[usize_of(i * PAIR)..usize_of((i + 1) * PAIR)];
                    note_future(pair, id, base + i * PAIR);
                    if let Some((b, bytes)) = pages::newest(pair, id, &uuid, durable) {
                        let entries = pages::decode_map(bytes);
                        lm.mapped +=
                            entries.iter().filter(|&&e| pba_of(e).is_some()).count() as u64;
                        lm.pages.insert(
                            vunit,
                            MapPage {
                                entries,
                                slot: if b { Slot::B } else { Slot::A },
                            },
                        );
                    }
                }
            }
            layers.insert(layer, lm);
        }
        if !future.is_empty() {
            // Made durable before the pool writes its first journal block of this open
            // (the caller opens the dedup store before it commits anything).
            for &at in &future {
                layout.write_zeroes_at(at, DBLOCK)?;
            }
            layout.sync()?;
            tracing::info!(
                slots = future.len(),
                "dedup pages of a commit lost at a power loss erased"
            );
        }
        let mut st = State {
            store_units,
            count_pages,
            count_units,
            dirty_counts: BTreeSet::new(),
            free: Vec::new(),
            pending_free: Vec::new(),
            layers,
            parents: HashMap::default(),
            pending_index: FpMap::default(),
            recent: vec![(UNHASHED, 0); RECENT_SLOTS].into_boxed_slice(),
            pending_by_pba: HashMap::default(),
            stale_index: Vec::new(),
            in_flight: FpMap::default(),
            overwriting: std::collections::HashSet::new(),
            released: std::collections::HashSet::new(),
            releasing: std::collections::HashSet::new(),
            merging: std::collections::HashSet::new(),
            sharing: HashMap::default(),
            refill_asked: false,
            used: 0,
        };
        // The counts are checked against the maps: a crash can leave neither more nor
        // fewer references than the counts say (both change in one commit), so any
        // difference is damage, repaired here towards the maps (a block the maps
        // reference is never freed; one they do not is).
        let mut refs = vec![0u32; usize_of(blocks)];
        for lm in st.layers.values() {
            for page in lm.pages.values() {
                for &e in page.entries.iter() {
                    if let Some(pba) = pba_of(e) {
                        let r = refs.get_mut(usize_of(pba)).ok_or_else(|| {
                            invalid(format!(
                                "a map entry references block {pba}, beyond the store"
                            ))
                        })?;
                        *r += 1;
                    }
                }
            }
        }
        let mut repaired = 0u64;
        for pba in (0..blocks).rev() {
            let (page, i) = (usize_of(pba / COUNTS as u64), usize_of(pba % COUNTS as u64));
            let want = refs[usize_of(pba)];
            if st.count_pages[page].counts[i] != want {
                st.count_pages[page].counts[i] = want;
                st.dirty_counts.insert(u32::try_from(page).expect("fits"));
                repaired += 1;
            }
            if want == 0 {
                st.free.push(pba);
            } else {
                st.used += 1;
            }
        }
        if repaired > 0 {
            tracing::warn!(
                blocks = repaired,
                "dedup reference counts repaired from the maps"
            );
        }
        let area = IndexArea {
            layout: layout.clone(),
            units: index_units,
            shift,
        };
        let index = FingerprintIndex::open(Arc::new(area), 0, buckets)?;
        Ok(DedupCore {
            state: Mutex::new(st),
            index,
            buckets,
            counters: Counters::default(),
            layout,
            uuid,
            shift,
            active: AtomicBool::new(true),
        })
    }

    /// Whether dedup is on (see `active`).
    pub(crate) fn active(&self) -> bool {
        self.active.load(Relaxed)
    }

    pub(crate) fn set_active(&self, on: bool) {
        self.active.store(on, Relaxed)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Index units a pool of `capacity` bytes needs, and its bucket count: one entry per
    /// 4 KiB block of the capacity.
    pub(crate) fn index_size(capacity: u64) -> (u64, u64) {
        let buckets = FingerprintIndex::buckets_for(capacity / DBLOCK);
        let units = FingerprintIndex::device_bytes(buckets).div_ceil(DEDUP_UNIT);
        (units, buckets)
    }

    /// A block-mapped layer (a new volume, a snapshot's volume's new layer, a clone, or
    /// one loaded at open) that reads through `parent` where it has no entry.
    pub(crate) fn add_layer(&self, layer: u32, parent: Option<u32>) {
        let mut st = self.lock();
        st.layers.entry(layer).or_default();
        match parent {
            Some(p) => st.parents.insert(layer, p),
            None => st.parents.remove(&layer),
        };
    }

    /// Referenced bytes of `layer`.
    pub(crate) fn layer_bytes(&self, layer: u32) -> u64 {
        self.lock()
            .layers
            .get(&layer)
            .map_or(0, |l| l.mapped * DBLOCK)
    }

    /// What `pool show` and the API report (one type: the API's).
    pub fn stats(&self) -> tessera_api::DedupInfo {
        let st = self.lock();
        let logical = st.layers.values().map(|l| l.mapped).sum::<u64>() * DBLOCK;
        let physical = st.used * DBLOCK;
        let pages: u64 = st.layers.values().map(|l| l.pages.len() as u64).sum();
        let c = &self.counters;
        let index = self.index.stats();
        tessera_api::DedupInfo {
            enabled: self.active(),
            logical_bytes: logical,
            physical_bytes: physical,
            ratio: if physical == 0 {
                1.0
            } else {
                logical as f64 / physical as f64
            },
            store_bytes: st.store_units.len() as u64 * DEDUP_UNIT,
            hits: c.hits.load(Relaxed),
            new_blocks: c.new_blocks.load(Relaxed),
            zero_blocks: c.zero_blocks.load(Relaxed),
            skipped_blocks: c.skipped_blocks.load(Relaxed),
            off_blocks: c.off_blocks.load(Relaxed),
            skipping_regions: st
                .layers
                .values()
                .map(|l| l.gain.values().filter(|g| g.skipping).count() as u64)
                .sum(),
            compare_mismatches: c.compare_mismatches.load(Relaxed),
            index_lookups: index.lookups,
            index_filtered: index.filtered,
            short_collisions: index.short_collisions,
            index_entries: self.index.entries(),
            index_buckets: self.buckets,
            index_device_bytes: FingerprintIndex::device_bytes(self.buckets),
            index_ram_bytes: self.index.ram_bytes(),
            page_ram_bytes: pages * (MAP_ENTRIES as u64 * 8)
                + st.count_pages.len() as u64 * (COUNTS as u64 * 4),
        }
    }

    /// The pool byte offset of store block `pba`.
    pub(crate) fn pba_offset(&self, st: &State, pba: u64) -> u64 {
        let s = usize_of(pba / BLOCKS_PER_UNIT);
        (u64::from(st.store_units[s]) << self.shift) + (pba % BLOCKS_PER_UNIT) * DBLOCK
    }

    /// The entry of block `vblock` of `layer` ([`ABSENT`] when none).
    pub(crate) fn entry(st: &State, layer: u32, vblock: u64) -> u64 {
        let Ok(vunit) = u32::try_from(vblock / BLOCKS_PER_UNIT) else {
            return ABSENT;
        };
        st.layers
            .get(&layer)
            .and_then(|l| l.pages.get(&vunit))
            .map_or(ABSENT, |p| p.entries[usize_of(vblock % BLOCKS_PER_UNIT)])
    }

    /// Whether a small random write at `vblock` of `layer` skips fingerprinting now (its
    /// region is not gaining from dedup, and this write is not a sample).
    pub(crate) fn skips(&self, layer: u32, vblock: u64) -> bool {
        let mut st = self.lock();
        let Some(lm) = st.layers.get_mut(&layer) else {
            return false;
        };
        let g = lm.gain.entry(vblock / GAIN_REGION_BLOCKS).or_default();
        if !g.skipping {
            return false;
        }
        g.writes = g.writes.wrapping_add(1);
        g.writes % GAIN_SAMPLE != 0
    }

    /// A write at `vblock` of `layer` looked `lookups` blocks up and shared `hits`.
    pub(crate) fn note_gain(&self, layer: u32, vblock: u64, lookups: u32, hits: u32) {
        if lookups == 0 {
            return;
        }
        let mut st = self.lock();
        let Some(lm) = st.layers.get_mut(&layer) else {
            return;
        };
        let g = lm.gain.entry(vblock / GAIN_REGION_BLOCKS).or_default();
        g.lookups += lookups;
        g.hits += hits;
        // A skipping region decides on its samples: as many as a window has writes
        // sampled, so it comes back as fast as it went.
        let window = if g.skipping {
            GAIN_WINDOW / GAIN_SAMPLE
        } else {
            GAIN_WINDOW
        };
        if g.lookups >= window {
            g.skipping = g.hits * 100 < g.lookups;
            g.lookups = 0;
            g.hits = 0;
        }
    }

    /// The entry block `vblock` of `layer` reads: its own, or where it has none, its
    /// parent layer's, and so on up the chain ([`ABSENT`] when no layer has one).
    pub(crate) fn chained(st: &State, layer: u32, vblock: u64) -> u64 {
        let mut at = layer;
        loop {
            let e = Self::entry(st, at, vblock);
            if e != ABSENT {
                return e;
            }
            match st.parents.get(&at) {
                Some(&p) => at = p,
                None => return ABSENT,
            }
        }
    }

    /// `layer` and the layers it reads through, nearest first.
    fn chain_of(st: &State, layer: u32) -> Vec<u32> {
        let mut out = vec![layer];
        while let Some(&p) = st.parents.get(out.last().expect("not empty")) {
            out.push(p);
        }
        out
    }

    /// Where block `vblock` of `layer` reads from (through its chain): a pool offset,
    /// or `None` for zeros.
    pub(crate) fn resolve(&self, st: &State, layer: u32, vblock: u64) -> Option<u64> {
        pba_of(Self::chained(st, layer, vblock)).map(|pba| self.pba_offset(st, pba))
    }

    fn count_mut(st: &mut State, pba: u64) -> &mut u32 {
        let page = pba / COUNTS as u64;
        st.dirty_counts
            .insert(u32::try_from(page).expect("page numbers fit u32"));
        &mut st.count_pages[usize_of(page)].counts[usize_of(pba % COUNTS as u64)]
    }

    fn count(st: &State, pba: u64) -> u32 {
        st.count_pages[usize_of(pba / COUNTS as u64)].counts[usize_of(pba % COUNTS as u64)]
    }

    /// Add one reference to `pba`.
    fn reference(st: &mut State, pba: u64) {
        let c = Self::count_mut(st, pba);
        *c += 1;
        if *c == 1 {
            st.used += 1;
        }
    }

    /// Drop one reference to `pba`; the last one frees it (after the next commit).
    fn unreference(st: &mut State, pba: u64) {
        let c = Self::count_mut(st, pba);
        debug_assert!(*c > 0, "a reference dropped from an unreferenced block");
        *c = c.saturating_sub(1);
        if *c == 0 {
            st.used -= 1;
            st.pending_free.push(pba);
        } else {
            st.released.insert(pba);
        }
    }

    /// A reference `share` took is published or dropped.
    fn shared_done(st: &mut State, pba: u64) {
        if let Some(n) = st.sharing.get_mut(&pba) {
            *n -= 1;
            if *n == 0 {
                st.sharing.remove(&pba);
            }
        }
    }

    /// Whether a block with fingerprint `fp` is being written as a new block now.
    pub(crate) fn writing(&self, fp: u128) -> bool {
        self.lock().in_flight.contains_key(&fp)
    }

    /// Turn each new block of a write at `first..` of `layer` whose entry references a
    /// block nothing else does into an overwrite of that block in place.
    pub(crate) fn claim_in_place(&self, layer: u32, first: u64, placements: &mut [Placement]) {
        let mut st = self.lock();
        for (i, p) in placements.iter_mut().enumerate() {
            let Placement::New(_, fp) = *p else { continue };
            let Some(old) = pba_of(Self::entry(&st, layer, first + i as u64)) else {
                continue;
            };
            if Self::count(&st, old) == 1
                && !st.merging.contains(&(layer, first + i as u64))
                && !st.released.contains(&old)
                && !st.releasing.contains(&old)
                && st.overwriting.insert(old)
            {
                *p = Placement::InPlace(old, fp);
            }
        }
    }

    /// Whether free blocks run low while freed ones wait for a commit: the caller asks
    /// the commit thread for one (once until it ran).
    pub(crate) fn wants_refill(&self) -> bool {
        let mut st = self.lock();
        let low = st.free.len() < REFILL_BELOW && !st.pending_free.is_empty();
        let ask = low && !st.refill_asked;
        st.refill_asked |= ask;
        ask
    }

    /// Note the new blocks of a write in flight (`placements` with their PBAs).
    pub(crate) fn begin_new(&self, placements: &[Placement]) {
        let mut st = self.lock();
        for p in placements {
            if let Placement::New(pba, fp) = *p {
                if fp != UNHASHED {
                    st.in_flight.entry(fp).or_insert(pba);
                }
            }
        }
    }

    /// The new blocks of a write are published or given back.
    fn end_new(st: &mut State, placements: &[Placement]) {
        for p in placements {
            match *p {
                Placement::New(pba, fp) if st.in_flight.get(&fp) == Some(&pba) => {
                    st.in_flight.remove(&fp);
                }
                Placement::InPlace(pba, _) => {
                    st.overwriting.remove(&pba);
                }
                _ => {}
            }
        }
    }

    /// A store block that holds exactly `block`, with one more reference taken for the
    /// caller, when the index knows one. The bytes of each candidate are compared (the
    /// index is only a hint); runs on the caller's thread (sync reads). The index's
    /// entries not written yet and the recently shared or stored blocks (`recent`) are
    /// tried first: a block written again and again is found without a bucket read.
    pub(crate) fn share(
        &self,
        fp: Fingerprint,
        block: &[u8],
        scratch: &mut AlignedBuf,
    ) -> Option<u64> {
        let (pending, recent) = {
            let st = self.lock();
            let r = st.recent[recent_slot(fp.0)];
            (
                st.pending_index.get(&fp.0).copied(),
                (r.0 == fp.0).then_some(r.1),
            )
        };
        let recent = recent.filter(|r| Some(*r) != pending);
        for pba in pending.into_iter().chain(recent) {
            if self.try_share(fp, pba, block, scratch, Some(pba) == pending) {
                return Some(pba);
            }
        }
        let found = self.index.candidates(fp).ok()?;
        found
            .into_iter()
            .filter(|&c| Some(c) != pending && Some(c) != recent)
            .find(|&pba| self.try_share(fp, pba, block, scratch, false))
    }

    /// Take a reference to `pba` when it holds exactly `block` (fingerprint `fp`); a
    /// candidate that does not is forgotten by `recent`, and queued as a stale index
    /// entry unless it came from the entries not written yet (`pending`).
    fn try_share(
        &self,
        fp: Fingerprint,
        pba: u64,
        block: &[u8],
        scratch: &mut AlignedBuf,
        pending: bool,
    ) -> bool {
        // Under the lock from the check to the new reference: a block with a count
        // cannot be freed (nor reused) meanwhile, and its bytes never change while it
        // is referenced.
        let mut st = self.lock();
        if pba >= st.store_units.len() as u64 * BLOCKS_PER_UNIT
            || Self::count(&st, pba) == 0
            || st.overwriting.contains(&pba)
        {
            return false;
        }
        let at = self.pba_offset(&st, pba);
        let buf = &mut scratch.as_mut_slice()[..BLOCK];
        if self.layout.read_at(at, buf).is_err() {
            return false;
        }
        let slot = recent_slot(fp.0);
        if buf == block {
            Self::reference(&mut st, pba);
            *st.sharing.entry(pba).or_default() += 1;
            st.recent[slot] = (fp.0, pba);
            return true;
        }
        self.counters.compare_mismatches.fetch_add(1, Relaxed);
        if st.recent[slot] == (fp.0, pba) {
            st.recent[slot] = (UNHASHED, 0);
        }
        if !pending && st.stale_index.len() < STALE_QUEUE {
            st.stale_index.push((fp.0, pba));
        }
        false
    }

    /// `n` free store blocks, as consecutive as the free list gives them; a new store
    /// unit is taken from the pool (`alloc_unit`) when the list runs dry.
    pub(crate) fn take_blocks(
        &self,
        n: usize,
        alloc_unit: &dyn Fn(u32, u32) -> Result<u32, i32>,
    ) -> Result<Vec<u64>, i32> {
        let mut st = self.lock();
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if let Some(pba) = st.free.pop() {
                out.push(pba);
                continue;
            }
            let s = u32::try_from(st.store_units.len()).map_err(|_| -libc::ENOSPC)?;
            let p = match alloc_unit(OWNER_STORE, s) {
                Ok(p) => p,
                Err(e) => {
                    // Give back what was taken: nothing references it.
                    st.free.extend(out.into_iter().rev());
                    return Err(e);
                }
            };
            st.store_units.push(p);
            let first = u64::from(s) * BLOCKS_PER_UNIT;
            st.free.extend((first..first + BLOCKS_PER_UNIT).rev());
            let blocks = st.store_units.len() as u64 * BLOCKS_PER_UNIT;
            while (st.count_pages.len() as u64) * (COUNTS as u64) < blocks {
                st.count_pages.push(CountPage {
                    counts: Box::new([0; COUNTS]),
                    slot: Slot::None,
                });
            }
        }
        Ok(out)
    }

    /// Give back the new blocks of a write that failed: they were never published.
    pub(crate) fn untake(&self, placements: &[Placement]) {
        let mut st = self.lock();
        Self::end_new(&mut st, placements);
        // An overwrite in place that failed leaves its block as the device has it, like
        // a failed write of a plain volume; its old index entry may be stale, which the
        // byte comparison tolerates.
        for p in placements.iter().rev() {
            // (A block not given its PBA yet has none to give back.)
            if let Placement::New(pba, _) = *p {
                if pba != u64::MAX {
                    st.free.push(pba);
                }
            }
        }
    }

    /// Make sure `layer` has the map unit that holds volume unit `vunit`'s page and the
    /// refcount units for every store block: allocating either takes a pool unit.
    fn ensure_units(
        st: &mut State,
        layer: u32,
        vunit: u32,
        alloc_unit: &dyn Fn(u32, u32) -> Result<u32, i32>,
    ) -> Result<(), i32> {
        let k = u32::try_from(u64::from(vunit) / PAGES_PER_UNIT).expect("fits");
        let lm = st.layers.get_mut(&layer).ok_or(-libc::ESHUTDOWN)?;
        if let std::collections::btree_map::Entry::Vacant(e) = lm.units.entry(k) {
            e.insert(alloc_unit(layer, MAP_UNIT | k)?);
        }
        let pages = st.count_pages.len() as u64;
        while (st.count_units.len() as u64) * PAGES_PER_UNIT < pages {
            let r = u32::try_from(st.count_units.len()).map_err(|_| -libc::ENOSPC)?;
            let p = alloc_unit(OWNER_REFCOUNT, r)?;
            st.count_units.push(p);
        }
        Ok(())
    }

    /// Publish a write of `placements` at blocks `first..` of `layer`: each entry now
    /// names its block, the blocks they named lose a reference, new blocks gain theirs
    /// and enter the index. Shared blocks already hold the reference `share` took.
    ///
    /// `merged`: the merged blocks of the write (`begin_merge`) and the entries they
    /// were merged from. When one of those entries changed meanwhile (a write of the
    /// whole block published), nothing is done and the result is [`MERGE_CONFLICT`]: the
    /// caller gives its blocks back and writes again, merging with the new bytes.
    pub(crate) fn publish(
        &self,
        layer: u32,
        first: u64,
        placements: &[Placement],
        merged: &[(u64, u64)],
        alloc_unit: &dyn Fn(u32, u32) -> Result<u32, i32>,
    ) -> Result<(), i32> {
        let mut st = self.lock();
        if merged
            .iter()
            .any(|&(b, was)| Self::entry(&st, layer, b) != was)
        {
            return Err(MERGE_CONFLICT);
        }
        Self::end_new(&mut st, placements);
        // Units first, so that a failure changes nothing.
        let mut last = None;
        for i in 0..placements.len() as u64 {
            let vunit = u32::try_from((first + i) / BLOCKS_PER_UNIT).map_err(|_| -libc::EINVAL)?;
            if last != Some(vunit) {
                Self::ensure_units(&mut st, layer, vunit, alloc_unit)?;
                last = Some(vunit);
            }
        }
        for (i, pl) in placements.iter().enumerate() {
            let value = match *pl {
                Placement::Shared(pba) => {
                    Self::shared_done(&mut st, pba);
                    pba + 2
                }
                Placement::New(pba, fp) => {
                    Self::reference(&mut st, pba);
                    note_index(&mut st, fp, pba);
                    pba + 2
                }
                Placement::InPlace(pba, fp) => {
                    // Still this block's entry (a write published meanwhile may have
                    // replaced it, and freed the block): then it now holds `fp`.
                    if Self::entry(&st, layer, first + i as u64) == pba + 2 {
                        note_index(&mut st, fp, pba);
                    }
                    continue;
                }
                // Over a parent's block, a hole must not read through to it.
                Placement::Zero if st.parents.contains_key(&layer) => ZERO,
                Placement::Zero => ABSENT,
            };
            let old = Self::set_entry(&mut st, layer, first + i as u64, value);
            if let Some(pba) = pba_of(old) {
                Self::unreference(&mut st, pba);
            }
        }
        Ok(())
    }

    /// Start merging the partial blocks `vblocks` of `layer` (at most two: a write's
    /// edges): the entries they are merged from, for `publish` to check; None when one
    /// of them is being merged by another write, or overwritten in place (its bytes are
    /// changing): the caller waits a round and tries again.
    pub(crate) fn begin_merge(&self, layer: u32, vblocks: &[u64]) -> Option<Vec<(u64, u64)>> {
        let mut st = self.lock();
        for &b in vblocks {
            let busy = st.merging.contains(&(layer, b))
                || pba_of(Self::entry(&st, layer, b)).is_some_and(|p| st.overwriting.contains(&p));
            if busy {
                return None;
            }
        }
        Some(
            vblocks
                .iter()
                .map(|&b| {
                    st.merging.insert((layer, b));
                    (b, Self::entry(&st, layer, b))
                })
                .collect(),
        )
    }

    /// The write that merged `merged` (from `begin_merge`) has ended, published or not.
    pub(crate) fn end_merge(&self, layer: u32, merged: &[(u64, u64)]) {
        if merged.is_empty() {
            return;
        }
        let mut st = self.lock();
        for &(b, _) in merged {
            st.merging.remove(&(layer, b));
        }
    }

    /// Set one entry; returns the old one. Counts the layer's mapped entries.
    fn set_entry(st: &mut State, layer: u32, vblock: u64, value: u64) -> u64 {
        let vunit = u32::try_from(vblock / BLOCKS_PER_UNIT).expect("checked by the caller");
        let Some(lm) = st.layers.get_mut(&layer) else {
            return ABSENT;
        };
        let page = lm.pages.entry(vunit).or_insert_with(|| MapPage {
            entries: Box::new([ABSENT; MAP_ENTRIES]),
            slot: Slot::None,
        });
        let e = &mut page.entries[usize_of(vblock % BLOCKS_PER_UNIT)];
        let old = std::mem::replace(e, value);
        if old != value {
            lm.dirty.insert(vunit);
            lm.mapped =
                lm.mapped + u64::from(pba_of(value).is_some()) - u64::from(pba_of(old).is_some());
        }
        old
    }

    /// Drop a write's shared references again (it failed).
    pub(crate) fn unshare(&self, placements: &[Placement]) {
        let mut st = self.lock();
        for pl in placements {
            if let Placement::Shared(pba) = *pl {
                Self::shared_done(&mut st, pba);
                Self::unreference(&mut st, pba);
            }
        }
    }

    /// Blocks `first..first+n` of `layer` read as zeros from now on (TRIM, write-zeroes,
    /// a shrink): their references are dropped, and where the layer's chain has a block
    /// below, a `ZERO` entry hides it. Only pages that exist in the chain are visited.
    /// A `ZERO` entry may need a new map page, so a map unit (`alloc_unit`); when none
    /// can be had nothing changes.
    pub(crate) fn clear(
        &self,
        layer: u32,
        first: u64,
        n: u64,
        alloc_unit: &dyn Fn(u32, u32) -> Result<u32, i32>,
    ) -> Result<(), i32> {
        let mut st = self.lock();
        let end = first + n;
        let (Ok(u0), u1) = (
            u32::try_from(first / BLOCKS_PER_UNIT),
            u32::try_from((end - 1) / BLOCKS_PER_UNIT).unwrap_or(u32::MAX),
        ) else {
            return Ok(());
        };
        let chain = Self::chain_of(&st, layer);
        let mut vunits = BTreeSet::new();
        for l in &chain {
            match st.layers.get(l) {
                Some(lm) if u64::from(u1 - u0) < lm.pages.len() as u64 => {
                    vunits.extend((u0..=u1).filter(|v| lm.pages.contains_key(v)))
                }
                Some(lm) => {
                    vunits.extend(lm.pages.keys().copied().filter(|v| (u0..=u1).contains(v)))
                }
                None => {}
            }
        }
        let parent = chain.get(1).copied();
        let mut changes = Vec::new();
        for v in vunits {
            let base = u64::from(v) * BLOCKS_PER_UNIT;
            let mut zeroed = false;
            for b in base.max(first)..(base + BLOCKS_PER_UNIT).min(end) {
                let below = parent.is_some_and(|p| pba_of(Self::chained(&st, p, b)).is_some());
                let value = if below { ZERO } else { ABSENT };
                if Self::entry(&st, layer, b) != value {
                    changes.push((b, value));
                    zeroed |= value == ZERO;
                }
            }
            if zeroed {
                // Its page must reach the device: units first, so a failure changes
                // nothing.
                Self::ensure_units(&mut st, layer, v, alloc_unit)?;
            }
        }
        for (b, value) in changes {
            let old = Self::set_entry(&mut st, layer, b, value);
            if let Some(pba) = pba_of(old) {
                Self::unreference(&mut st, pba);
            }
        }
        Ok(())
    }

    /// Forget a deleted layer: every reference it holds is dropped; returns its map
    /// units for the pool to free.
    pub(crate) fn remove_layer(&self, layer: u32) -> Vec<u32> {
        let lm = {
            let mut st = self.lock();
            st.parents.remove(&layer);
            let Some(lm) = st.layers.remove(&layer) else {
                return Vec::new();
            };
            lm
        };
        // No reader finds the layer any more; its references go a chunk of pages per
        // lock hold (the callers hold off commits until the checkpoint that records the
        // removal, `PoolCore::change_then_checkpoint`).
        let pages: Vec<&MapPage> = lm.pages.values().collect();
        for chunk in pages.chunks(SCAN_CHUNK_PAGES) {
            let mut st = self.lock();
            for page in chunk {
                for &e in page.entries.iter() {
                    if let Some(pba) = pba_of(e) {
                        Self::unreference(&mut st, pba);
                    }
                }
            }
        }
        lm.units.into_values().collect()
    }

    /// A hidden snapshot's layer gives back the references no child reads any more:
    /// those of blocks every one of `children` (the layers reading through it) has an
    /// entry of its own for (docs/format.md §3.4, "Deleting").
    pub(crate) fn drop_covered(&self, layer: u32, children: &[u32]) {
        // Each block is decided under the lock, a chunk of pages per hold: a child's
        // entry, once there, goes only with a catalog change, which waits for this one.
        let Some(keys) = self.page_keys(layer) else {
            return;
        };
        for chunk in keys.chunks(SCAN_CHUNK_PAGES) {
            let mut st = self.lock();
            for &v in chunk {
                let base = u64::from(v) * BLOCKS_PER_UNIT;
                let Some(page) = st.layers.get(&layer).and_then(|lm| lm.pages.get(&v)) else {
                    continue;
                };
                let covered: Vec<u64> = (base..)
                    .zip(page.entries.iter())
                    .filter(|&(b, &e)| {
                        e != ABSENT && children.iter().all(|&c| Self::entry(&st, c, b) != ABSENT)
                    })
                    .map(|(b, _)| b)
                    .collect();
                for b in covered {
                    let old = Self::set_entry(&mut st, layer, b, ABSENT);
                    if let Some(pba) = pba_of(old) {
                        Self::unreference(&mut st, pba);
                    }
                }
            }
        }
    }

    /// The volume units `layer` has map pages for, or `None` for no such layer.
    fn page_keys(&self, layer: u32) -> Option<Vec<u32>> {
        let st = self.lock();
        st.layers
            .get(&layer)
            .map(|lm| lm.pages.keys().copied().collect())
    }

    /// Bytes of `layer`'s blocks that deleting it would give back: blocks no other
    /// entry references and none of `children` (the layers reading through it) reads.
    /// Counted a chunk of pages per lock hold, so writes going on meanwhile may make it
    /// a little off (it is a figure for `snapshot list`).
    pub(crate) fn exclusive_bytes(&self, layer: u32, children: &[u32]) -> u64 {
        let Some(keys) = self.page_keys(layer) else {
            return 0;
        };
        let mut n = 0u64;
        for chunk in keys.chunks(SCAN_CHUNK_PAGES) {
            let st = self.lock();
            for &v in chunk {
                let base = u64::from(v) * BLOCKS_PER_UNIT;
                let Some(page) = st.layers.get(&layer).and_then(|lm| lm.pages.get(&v)) else {
                    continue;
                };
                for (b, &e) in (base..).zip(page.entries.iter()) {
                    if pba_of(e).is_some_and(|pba| Self::count(&st, pba) == 1)
                        && children.iter().all(|&c| Self::entry(&st, c, b) != ABSENT)
                    {
                        n += 1;
                    }
                }
            }
        }
        n * DBLOCK
    }

    /// Runs of `(length, changed)` over `[offset, offset+len)`: a block is changed when
    /// one of `layers` has an entry of its own for it (the layers between a volume and
    /// an older snapshot of it), at most `max_runs`.
    pub(crate) fn changed_runs(
        &self,
        layers: &[u32],
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Vec<(u64, bool)> {
        self.runs(layers, offset, len, max_runs, |st, b| {
            layers.iter().any(|&l| Self::entry(st, l, b) != ABSENT)
        })
    }

    /// Runs of `(length, f(block))` over `[offset, offset+len)`, at most `max_runs`,
    /// where `f` is false for every block of a volume unit none of `layers` has a map
    /// page for (the scan jumps over such units). The lock is given back every
    /// `SCAN_STEPS` steps: a scan of a large volume (block status, changed extents) must
    /// not hold up the pool's dedup writes.
    fn runs(
        &self,
        layers: &[u32],
        offset: u64,
        len: u64,
        max_runs: usize,
        f: impl Fn(&State, u64) -> bool,
    ) -> Vec<(u64, bool)> {
        const UNIT: u64 = BLOCKS_PER_UNIT * DBLOCK;
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let end = offset.saturating_add(len);
        if end == offset {
            return runs;
        }
        let paged = self.paged_units(layers, offset / UNIT, (end - 1) / UNIT);
        let mut next = 0;
        let mut at = offset;
        while at < end && runs.len() <= max_runs {
            let st = self.lock();
            for _ in 0..SCAN_STEPS {
                if at >= end || runs.len() > max_runs {
                    break;
                }
                let b = at / DBLOCK;
                let vunit = b / BLOCKS_PER_UNIT;
                while paged.get(next).is_some_and(|&u| u < vunit) {
                    next += 1;
                }
                let (to, v) = if paged.get(next) == Some(&vunit) {
                    (((b + 1) * DBLOCK).min(end), f(&st, b))
                } else {
                    // Up to the next unit with a page, or the end.
                    (paged.get(next).map_or(end, |&u| (u * UNIT).min(end)), false)
                };
                match runs.last_mut() {
                    Some((l, m)) if *m == v => *l += to - at,
                    _ => runs.push((to - at, v)),
                }
                at = to;
            }
        }
        runs.truncate(max_runs.max(1));
        runs
    }

    /// The volume units `u0..=u1` for which some layer of `layers` has a map page,
    /// ascending. Costs the smaller of the range and the layers' page counts, a chunk
    /// of lookups per lock hold.
    fn paged_units(&self, layers: &[u32], u0: u64, u1: u64) -> Vec<u64> {
        let mut out = BTreeSet::new();
        for &l in layers {
            let pages = self
                .lock()
                .layers
                .get(&l)
                .map_or(0, |lm| lm.pages.len() as u64);
            if u1 - u0 < pages {
                let mut u = u0;
                while u <= u1 {
                    let st = self.lock();
                    let Some(lm) = st.layers.get(&l) else {
                        break;
                    };
                    let stop = u.saturating_add(SCAN_STEPS as u64).min(u1 + 1);
                    out.extend(
                        (u..stop)
                            .filter(|&v| u32::try_from(v).is_ok_and(|v| lm.pages.contains_key(&v))),
                    );
                    u = stop;
                }
            } else if let Some(keys) = self.page_keys(l) {
                out.extend(
                    keys.into_iter()
                        .map(u64::from)
                        .filter(|v| (u0..=u1).contains(v)),
                );
            }
        }
        out.into_iter().collect()
    }

    /// Whether every block of `[offset, offset+len)` of `layer` reads as zeros.
    pub(crate) fn is_hole(&self, layer: u32, offset: u64, len: u64) -> bool {
        let st = self.lock();
        (offset / DBLOCK..=(offset + len - 1) / DBLOCK)
            .all(|b| pba_of(Self::chained(&st, layer, b)).is_none())
    }

    /// Runs of `(length, referenced)` over `[offset, offset+len)` of `layer`, at most
    /// `max_runs` (block status for NBD and `qemu-img map`).
    pub(crate) fn allocation_runs(
        &self,
        layer: u32,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Vec<(u64, bool)> {
        let chain = Self::chain_of(&self.lock(), layer);
        self.runs(&chain, offset, len, max_runs, |st, b| {
            pba_of(Self::chained(st, layer, b)).is_some()
        })
    }

    /// Take the dirty pages and the blocks freed so far, for a commit. The pages are
    /// encoded by [`DedupCore::write_batch`] with the commit's generation.
    pub(crate) fn take_dirty(&self) -> PageBatch {
        let mut guard = self.lock();
        let st = &mut *guard;
        let mut batch = PageBatch {
            items: Vec::new(),
            freed: std::mem::take(&mut st.pending_free),
        };
        // The drops this batch makes durable (with those of a failed batch before it).
        let released = std::mem::take(&mut st.released);
        st.releasing.extend(released);
        for (&layer, lm) in st.layers.iter_mut() {
            for v in std::mem::take(&mut lm.dirty) {
                let (Some(page), Some(&unit)) = (
                    lm.pages.get(&v),
                    lm.units
                        .get(&u32::try_from(u64::from(v) / PAGES_PER_UNIT).expect("fits")),
                ) else {
                    continue;
                };
                let slot = page.slot.other();
                batch.items.push(BatchItem {
                    layer: Some(layer),
                    number: v,
                    slot,
                    offset: self.page_offset(unit, u64::from(v), slot),
                    content: Content::Map(page.entries.clone()),
                });
            }
        }
        for n in std::mem::take(&mut st.dirty_counts) {
            let unit = st.count_units[usize_of(u64::from(n) / PAGES_PER_UNIT)];
            let page = &st.count_pages[n as usize];
            let slot = page.slot.other();
            batch.items.push(BatchItem {
                layer: None,
                number: n,
                slot,
                offset: self.page_offset(unit, u64::from(n), slot),
                content: Content::Counts(page.counts.clone()),
            });
        }
        batch
    }

    fn page_offset(&self, unit: u32, number: u64, slot: Slot) -> u64 {
        (u64::from(unit) << self.shift)
            + (number % PAGES_PER_UNIT) * PAIR
            + if slot == Slot::B { DBLOCK } else { 0 }
    }

    /// Write a batch's pages with generation `gen` (not synced: the commit syncs).
    pub(crate) fn write_batch(&self, batch: &PageBatch, gen: u64) -> io::Result<()> {
        let mut buf = AlignedBuf::zeroed(BLOCK);
        for it in &batch.items {
            let bytes = match &it.content {
                Content::Map(e) => pages::encode_map(
                    PageId {
                        refcount: false,
                        layer: it.layer.expect("map pages have a layer"),
                        number: it.number,
                    },
                    gen,
                    &self.uuid,
                    e,
                ),
                Content::Counts(c) => pages::encode_counts(
                    PageId {
                        refcount: true,
                        layer: 0,
                        number: it.number,
                    },
                    gen,
                    &self.uuid,
                    c,
                ),
            };
            buf.as_mut_slice()[..BLOCK].copy_from_slice(&bytes);
            self.layout.write_at(it.offset, &buf.as_slice()[..BLOCK])?;
        }
        Ok(())
    }

    /// The commit that wrote `batch` ended: on success each page's newest durable copy is
    /// the slot just written and the freed blocks are handed back (`release_free`); on
    /// failure the pages are dirty again (the next commit rewrites the same slots) and
    /// the blocks stay pending.
    pub(crate) fn pages_done(&self, batch: PageBatch, durable: bool) -> Vec<u64> {
        let mut guard = self.lock();
        let st = &mut *guard;
        st.refill_asked = false;
        if durable {
            st.releasing.clear();
        }
        for it in batch.items {
            match it.layer {
                Some(layer) => {
                    if let Some(lm) = st.layers.get_mut(&layer) {
                        if let Some(p) = lm.pages.get_mut(&it.number) {
                            if durable {
                                p.slot = it.slot;
                            } else {
                                lm.dirty.insert(it.number);
                            }
                        }
                    }
                }
                None => {
                    if durable {
                        st.count_pages[it.number as usize].slot = it.slot;
                    } else {
                        st.dirty_counts.insert(it.number);
                    }
                }
            }
        }
        if durable {
            batch.freed
        } else {
            st.pending_free.extend(batch.freed);
            Vec::new()
        }
    }

    /// Freed blocks whose freeing is durable and that no request in flight can reach
    /// any more: free for new writes.
    pub(crate) fn release_free(&self, freed: Vec<u64>, usable: bool) {
        if freed.is_empty() {
            return;
        }
        let mut st = self.lock();
        if usable {
            st.free.extend(freed);
            st.free.sort_unstable_by(|a, b| b.cmp(a));
        } else {
            st.pending_free.extend(freed);
        }
    }

    /// Write the index entries of new blocks (the commit thread, after a commit). An
    /// entry whose block was freed meanwhile is written anyway: the byte comparison of a
    /// later lookup tolerates it.
    pub(crate) fn flush_index(&self) {
        // Stale entries go first: a block freed and written again meanwhile may hold the
        // same bytes again, and its new entry (pending now) must survive.
        let stale = std::mem::take(&mut self.lock().stale_index);
        for (fp, pba) in stale {
            if let Err(e) = self.index.remove(Fingerprint(fp), pba) {
                tracing::warn!(error = %e, "cannot drop a stale dedup index entry");
            }
        }
        let pending: Vec<(Fingerprint, u64)> = {
            let st = self.lock();
            st.pending_index
                .iter()
                .map(|(&f, &p)| (Fingerprint(f), p))
                .collect()
        };
        if pending.is_empty() {
            return;
        }
        if let Err(e) = self.index.insert_batch(pending.clone()) {
            tracing::warn!(error = %e, "cannot write dedup index buckets; entries stay in memory");
            return;
        }
        let mut st = self.lock();
        for (fp, pba) in pending {
            if st.pending_index.get(&fp.0) == Some(&pba) {
                st.pending_index.remove(&fp.0);
            }
            if st.pending_by_pba.get(&pba) == Some(&fp.0) {
                st.pending_by_pba.remove(&pba);
            }
        }
    }

    /// The scrub's check of the reference counts on a live pool: each count must equal
    /// the map references to its block plus those writes in flight took (`sharing`).
    /// Returns the blocks whose count differed, as findings, and how many were repaired
    /// (`repair`): a count below its references (the block could be freed while a
    /// volume still reads it) is raised, and the block taken out of the free lists; a
    /// count above them (a leak) is lowered, freeing the block after the next commit
    /// when nothing references it. Holds the dedup lock for one pass over the maps.
    pub(crate) fn scrub_counts(&self, repair: bool) -> (Vec<String>, u64) {
        let mut st = self.lock();
        let blocks = st.store_units.len() as u64 * BLOCKS_PER_UNIT;
        let mut want = vec![0u32; usize_of(blocks)];
        for lm in st.layers.values() {
            for page in lm.pages.values() {
                for pba in page.entries.iter().filter_map(|&e| pba_of(e)) {
                    if let Some(w) = want.get_mut(usize_of(pba)) {
                        *w += 1;
                    }
                }
            }
        }
        for (&pba, &n) in &st.sharing {
            if let Some(w) = want.get_mut(usize_of(pba)) {
                *w += n;
            }
        }
        let (mut found, mut repaired) = (Vec::new(), 0);
        for (pba, &w) in want.iter().enumerate() {
            let pba = pba as u64;
            let have = Self::count(&st, pba);
            if have == w {
                continue;
            }
            found.push(format!(
                "dedup store block {pba}: reference count {have}, referenced {w} times{}",
                if repair { " (repaired)" } else { "" }
            ));
            if !repair {
                continue;
            }
            repaired += 1;
            if have < w {
                if have == 0 {
                    // Free or about to be: it must not be handed out again.
                    st.free.retain(|&p| p != pba);
                    st.pending_free.retain(|&p| p != pba);
                }
                for _ in have..w {
                    Self::reference(&mut st, pba);
                }
            } else {
                for _ in w..have {
                    Self::unreference(&mut st, pba);
                }
            }
        }
        (found, repaired)
    }

    /// Damage for the scrub's tests: set `pba`'s count to `count`, as a bug would, and
    /// (at 0) put it on the free list. The store block `vblock` of `layer` references.
    #[cfg(test)]
    pub(crate) fn damage_count(&self, layer: u32, vblock: u64, count: u32) -> u64 {
        let mut st = self.lock();
        let pba = pba_of(Self::entry(&st, layer, vblock)).expect("a mapped block");
        let was = std::mem::replace(Self::count_mut(&mut st, pba), count);
        if count == 0 && was > 0 {
            st.used -= 1;
            st.free.push(pba);
        }
        pba
    }

    /// Whether `pba` is on a free list (the scrub's tests).
    #[cfg(test)]
    pub(crate) fn is_free(&self, pba: u64) -> bool {
        let st = self.lock();
        st.free.contains(&pba) || st.pending_free.contains(&pba)
    }

    /// The pool offset of store block `pba` while it is referenced (`None`: free).
    pub(crate) fn live_offset(&self, pba: u64) -> Option<u64> {
        let st = self.lock();
        let live = pba < st.store_units.len() as u64 * BLOCKS_PER_UNIT && Self::count(&st, pba) > 0;
        live.then(|| self.pba_offset(&st, pba))
    }

    /// Whether store block `pba` is referenced and holds bytes with fingerprint `fp`
    /// now (`None`: it is being overwritten in place, so it cannot be told). Reads it
    /// under the lock, as `share` does: a referenced block cannot change or be freed
    /// meanwhile.
    pub(crate) fn holds(
        &self,
        pba: u64,
        fp: Fingerprint,
        scratch: &mut AlignedBuf,
    ) -> Option<bool> {
        let st = self.lock();
        if pba >= st.store_units.len() as u64 * BLOCKS_PER_UNIT || Self::count(&st, pba) == 0 {
            return Some(false);
        }
        if st.overwriting.contains(&pba) {
            return None;
        }
        let buf = &mut scratch.as_mut_slice()[..BLOCK];
        self.layout.read_at(self.pba_offset(&st, pba), buf).ok()?;
        Some(Fingerprint::of(buf) == fp)
    }

    /// Problems the metadata has (empty when none): every count equals the references
    /// the maps hold, and every referenced block lies in the store.
    pub fn verify(&self) -> Vec<String> {
        let st = self.lock();
        let blocks = st.store_units.len() as u64 * BLOCKS_PER_UNIT;
        let mut refs = vec![0u32; usize_of(blocks)];
        let mut out = Vec::new();
        for (layer, lm) in &st.layers {
            for (v, page) in &lm.pages {
                for (i, &e) in page.entries.iter().enumerate() {
                    if let Some(pba) = pba_of(e) {
                        match refs.get_mut(usize_of(pba)) {
                            Some(r) => *r += 1,
                            None => out.push(format!(
                                "layer {layer} block {} references {pba}, beyond the store",
                                u64::from(*v) * BLOCKS_PER_UNIT + i as u64
                            )),
                        }
                    }
                }
            }
        }
        for (pba, &want) in refs.iter().enumerate() {
            let have = Self::count(&st, pba as u64);
            if have != want {
                out.push(format!(
                    "store block {pba}: count {have}, referenced {want} times"
                ));
            }
        }
        out
    }
}

/// Whether `b` (a whole block) is all zeros.
pub(crate) fn is_zero(b: &[u8]) -> bool {
    let words = b.chunks_exact(8);
    let rest = words.remainder();
    words.into_iter().all(|c| c == [0u8; 8]) && rest.iter().all(|&x| x == 0)
}

/// Whether owner-table entry `o` is a dedup unit of a pool whose block-mapped layers are
/// `layers` (a map unit of a layer no volume has any more is not: it is free).
pub(crate) fn is_dedup_owner(o: (u32, u32), layers: &std::collections::BTreeSet<u32>) -> bool {
    matches!(o.0, OWNER_STORE | OWNER_REFCOUNT | OWNER_INDEX)
        || (o.1 & MAP_UNIT != 0 && layers.contains(&o.0))
}

impl DedupUnits {
    /// The dedup units of an owner table.
    pub(crate) fn from_owners(
        owners: &[(u32, u32)],
        layers: &std::collections::BTreeSet<u32>,
    ) -> DedupUnits {
        let mut u = DedupUnits::default();
        for (p, &o) in owners.iter().enumerate() {
            let p = u32::try_from(p).expect("unit numbers fit u32");
            match o.0 {
                OWNER_STORE => {
                    u.store.insert(o.1, p);
                }
                OWNER_REFCOUNT => {
                    u.counts.insert(o.1, p);
                }
                OWNER_INDEX => {
                    u.index.insert(o.1, p);
                }
                l if o.1 & MAP_UNIT != 0 && layers.contains(&l) => {
                    u.maps.entry(l).or_default().insert(o.1 & !MAP_UNIT, p);
                }
                _ => {}
            }
        }
        for &l in layers {
            u.maps.entry(l).or_default();
        }
        u
    }
}
