//! A pool's cache tier (issue 24): 1 MiB units of the pool's logical address space kept
//! on faster devices, found through an index in RAM (docs/format.md §16).
//!
//! - [`CacheTier`]: the slots, their index and the policy (`crate::cache_policy`'s 2Q),
//!   sharded by unit so cores rarely meet on one lock; the counters `pool cache show`
//!   and the metrics print (`tessera_api::CacheInfo`).
//! - `handle`: the per-core datapath ([`TierHandle`]), which every volume request goes
//!   through; a pool without a cache pays one atomic load per request there.
//!
//! Modes: write-through (writes go to both tiers and are acknowledged when both have
//! them), write-around (writes go to the pool's devices only and invalidate what the
//! cache holds), pass-through (the cache is not used). The pool's devices always hold
//! every acknowledged write, so the index lives in RAM only: a restart starts cold.
//!
//! What keeps a read from returning stale bytes: a 4 KiB block of a slot is marked valid
//! only by a writer of the slot (a fill after a read miss, or a write-through write) that
//! claimed the block before its bytes went out, and only if no other change touched the
//! block while the claim was held. Claims are per block, so writers of different blocks
//! of one unit run side by side; a request that finds its blocks claimed goes to the
//! pool's devices only. Every change that does not go through a claim (write-around, a
//! write whose blocks were claimed, a discard, a unit changing owner) clears the blocks it
//! touches, and spoils the claims on them, both when it starts and when it ends, so a
//! fill that read the pool's devices before such a write landed never validates what it
//! read. A slot is reused for another unit only when no read of it and no claim on it is
//! in flight.

mod cleaner;
mod handle;
mod records;
mod writeback;

use std::collections::HashMap;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_device::BlockDevice;
use tessera_io::sync::{MutexExt, RwLockExt};

use crate::cache_policy::{Outcome, TwoQ};
use crate::format::{BLOCK, DEV_DATA_START};
use crate::layout::{Layout, LayoutKind};
use crate::{Error, Result};
use records::Geometry;
pub use tessera_api::CacheInfo;

pub use handle::TierHandle;

/// Bytes of the pool's address space one slot caches, by default: 1 MiB. A tier may use
/// smaller units, down to `MIN_UNIT` (`CacheTier::new`): scattered hot blocks waste less
/// of the cache, at more RAM per GiB of it.
pub const CACHE_UNIT: u64 = 1 << 20;
/// The smallest cache unit: 16 KiB.
pub const MIN_UNIT: u64 = 16 << 10;
/// Validity is tracked per 4 KiB block: 256 bits per slot.
const BLOCK_SHIFT: u32 = 12;
/// The cache label's magic (docs/format.md §16).
pub const CACHE_MAGIC: &[u8; 8] = b"TSRCACH1";
/// RAM a tier's readahead buffers may hold at once.
const PREFETCH_BUDGET: u64 = 64 << 20;
/// A tier needs this many slots at least (the policy's queues need four per shard).
const MIN_SLOTS: u64 = 8;

/// How the tier treats writes (docs/format.md §16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    WriteThrough = 0,
    WriteAround = 1,
    PassThrough = 2,
    WriteBack = 3,
}

impl CacheMode {
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::WriteThrough => "write-through",
            CacheMode::WriteAround => "write-around",
            CacheMode::PassThrough => "pass-through",
            CacheMode::WriteBack => "write-back",
        }
    }

    /// A mode as the user writes it.
    pub fn parse(s: &str) -> Result<CacheMode> {
        Ok(match s {
            "write-through" | "writethrough" | "wt" => CacheMode::WriteThrough,
            "write-around" | "writearound" | "wa" => CacheMode::WriteAround,
            "pass-through" | "passthrough" | "pt" => CacheMode::PassThrough,
            "write-back" | "writeback" | "wb" => CacheMode::WriteBack,
            other => {
                return Err(Error::invalid(format!(
                    "unknown cache mode '{other}': write-through, write-around, pass-through \
                     or write-back"
                )))
            }
        })
    }

    fn from_u8(b: u8) -> CacheMode {
        match b {
            0 => CacheMode::WriteThrough,
            1 => CacheMode::WriteAround,
            3 => CacheMode::WriteBack,
            _ => CacheMode::PassThrough,
        }
    }
}

/// One slot's state. Guarded by its shard's lock.
#[derive(Clone, Copy)]
struct Slot {
    /// The unit it caches (meaningful while `mapped`).
    key: u64,
    mapped: bool,
    /// Blocks whose bytes on the cache device are the unit's current bytes.
    valid: Blocks,
    /// Blocks a writer (fill or write-through) has bytes in flight for.
    claimed: Blocks,
    /// Claimed blocks some other change touched meanwhile: not validated at the end.
    spoiled: Blocks,
    /// Reads of the slot in flight.
    pins: u32,
    /// Write-back: blocks whose bytes the pool's devices may not have (a subset of
    /// `valid` while the tier works).
    dirty: Blocks,
    /// Blocks a record on the cache devices may still say are dirty (a superset of
    /// `dirty`: a clean record is only trusted once synced). Until it is empty the slot
    /// is not given to another unit, and nothing but the slot changes those blocks.
    durable_dirty: Blocks,
    /// The unit was freed by its volume with dirty blocks here: the slot keeps its record
    /// as it was until the commit that frees the unit is durable (`release_units`).
    freed: bool,
    /// The policy let the unit go while it had dirty blocks: the slot is freed once the
    /// cleaner cleaned it.
    evicted: bool,
}

/// A set of a unit's 256 blocks.
type Blocks = [u64; 4];

const NONE: Blocks = [0; 4];

/// Blocks `b0..=b1`.
fn span(b0: u64, b1: u64) -> Blocks {
    let mut m = NONE;
    for (w, word) in m.iter_mut().enumerate() {
        let lo = (w as u64) * 64;
        let (a, b) = (b0.max(lo), b1.min(lo + 63));
        if a <= b {
            let bits = b - a + 1;
            *word = if bits == 64 {
                u64::MAX
            } else {
                ((1u64 << bits) - 1) << (a - lo)
            };
        }
    }
    m
}

fn and(a: Blocks, b: Blocks) -> Blocks {
    [a[0] & b[0], a[1] & b[1], a[2] & b[2], a[3] & b[3]]
}
fn or(a: Blocks, b: Blocks) -> Blocks {
    [a[0] | b[0], a[1] | b[1], a[2] | b[2], a[3] | b[3]]
}
fn minus(a: Blocks, b: Blocks) -> Blocks {
    [a[0] & !b[0], a[1] & !b[1], a[2] & !b[2], a[3] & !b[3]]
}
fn is_empty(a: Blocks) -> bool {
    a == NONE
}
/// How many blocks `m` holds.
fn count_of(m: Blocks) -> u64 {
    m.iter().map(|w| u64::from(w.count_ones())).sum()
}

const EMPTY_SLOT: Slot = Slot {
    key: 0,
    mapped: false,
    valid: NONE,
    claimed: NONE,
    spoiled: NONE,
    pins: 0,
    dirty: NONE,
    durable_dirty: NONE,
    freed: false,
    evicted: false,
};

impl Slot {
    fn all_valid(&self, b0: u64, b1: u64) -> bool {
        let m = span(b0, b1);
        and(self.valid, m) == m
    }
    fn valid_blocks(&self) -> u32 {
        self.valid.iter().map(|w| w.count_ones()).sum()
    }
    /// A change that does not go through a claim touches `m`.
    fn touch(&mut self, m: Blocks) {
        self.valid = minus(self.valid, m);
        self.spoiled = or(self.spoiled, and(self.claimed, m));
    }
    /// Claim `m` for a writer, if no one holds any of it.
    fn claim(&mut self, m: Blocks) -> bool {
        if !is_empty(and(self.claimed, m)) {
            return false;
        }
        self.claimed = or(self.claimed, m);
        self.spoiled = minus(self.spoiled, m);
        true
    }
    fn idle(&self) -> bool {
        self.pins == 0
            && is_empty(self.claimed)
            && is_empty(self.dirty)
            && is_empty(self.durable_dirty)
            && !self.freed
    }
    fn dirty_blocks(&self) -> u64 {
        self.dirty.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

/// A share of the slots and the policy over them: unit `k` belongs to shard
/// `k % shards`, slot `s` to shard `s % shards`.
struct Shard {
    policy: TwoQ,
    slot_of: HashMap<u64, u32>,
    /// Local indices of slots that cache nothing (some may still be pinned).
    free: Vec<u32>,
    slots: Vec<Slot>,
    /// Write-back: the CRC32C of each block of a slot with dirty blocks (by local slot).
    crcs: HashMap<u32, Box<[u32]>>,
    /// Slots of units freed with dirty blocks, waiting for `release_units`.
    freed_of: HashMap<u64, u32>,
    /// Write-back: where the next search for a clean slot to take starts (a clock hand).
    hand: usize,
}

/// What a read of one unit's blocks does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadPlan {
    /// Read the cache slot (pinned until `end_hit`).
    Hit { slot: u32 },
    /// Read the pool's devices, then write what was read to the slot (the blocks are
    /// claimed until `end_write`).
    Fill { slot: u32 },
    /// Read the pool's devices only.
    Backing,
    /// Write-back: the range has dirty blocks but the slot does not hold all of it:
    /// the blocks in `valid` are read from the slot (pinned until `end_hit`), the others
    /// from the pool's devices.
    Mixed { slot: u32, valid: Blocks },
}

/// What a write of one unit's blocks does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WritePlan {
    /// Write both tiers; the whole blocks are claimed until `end_write`.
    Both { slot: u32 },
    /// Write the pool's devices only; the blocks were invalidated (and are again by
    /// `invalidate` when the write ends).
    Backing,
    /// Write-back: write the cache only (the whole blocks are claimed); the write is
    /// acknowledged once the slot's record is written (`note_dirty`, `end_write`).
    Back { slot: u32 },
    /// Write-back: the write touches blocks that are dirty or being written and cannot
    /// go to the cache whole; try again shortly.
    Busy,
}

/// Counters of one tier, since it was attached.
#[derive(Default)]
pub struct CacheCounters {
    pub read_hits: AtomicU64,
    pub read_misses: AtomicU64,
    pub read_hit_bytes: AtomicU64,
    pub read_miss_bytes: AtomicU64,
    pub write_hits: AtomicU64,
    pub write_misses: AtomicU64,
    /// Units given a slot.
    pub promotions: AtomicU64,
    /// Units that lost their slot to another.
    pub evictions: AtomicU64,
    /// Bytes written into the cache by fills after read misses.
    pub fill_bytes: AtomicU64,
    /// Bytes of requests the detector called sequential, which did not go into the cache.
    pub bypassed_bytes: AtomicU64,
    /// Bytes read ahead of sequential streams into the cache.
    pub prefetch_bytes: AtomicU64,
    /// Bytes the cleaner copied from the cache to the pool's devices (write-back).
    pub cleaned_bytes: AtomicU64,
    pub errors: AtomicU64,
}

/// Where a pool keeps its cache tier: the tier, if any, and a generation that changes
/// whenever one is attached or detached (the datapath handles look it up again then).
#[derive(Default)]
pub struct CacheSlot {
    pub(crate) tier: std::sync::RwLock<Option<Arc<CacheTier>>>,
    pub(crate) gen: AtomicU64,
    /// A write-back tier the pool had could not be opened: every request fails until
    /// it is back or its loss is accepted (docs/format.md §16).
    pub(crate) lost: AtomicBool,
}

impl CacheSlot {
    pub fn get(&self) -> Option<Arc<CacheTier>> {
        self.tier.read_locked().clone()
    }
}

/// A pool's cache tier.
pub struct CacheTier {
    /// Over the cache devices: concat for one, raid1 for two.
    pub(crate) layout: Arc<Layout>,
    mode: AtomicU8,
    shards: Box<[Mutex<Shard>]>,
    slots: u64,
    /// log2 of the cache unit (16 KiB to 1 MiB; each holds up to 256 blocks of 4 KiB).
    pub(crate) unit_shift: u32,
    /// The tier's devices failed (an I/O error the layout could not hide): uncached.
    failed: AtomicBool,
    /// Detached from its pool: no new request uses it.
    detached: AtomicBool,
    /// Operations of the datapath in flight (a detach waits for them).
    inflight: AtomicU64,
    /// Bytes of readahead buffers in flight, up to `PREFETCH_BUDGET`: however fast
    /// clients stream, readahead holds no more RAM than this per tier.
    prefetching: AtomicU64,
    pub counters: CacheCounters,
    /// Where records and slots lie (docs/format.md §16).
    pub(crate) geo: Geometry,
    /// The label's epoch: records of another one are stale.
    pub(crate) epoch: u64,
    /// Dirty blocks of mapped slots (what the cleaner has to do).
    dirty_blocks: AtomicU64,
    /// Mapped slots with a dirty block (none of them can take another unit).
    dirty_slots: AtomicU64,
    /// Write-back writes in flight (a switch out of write-back waits for them).
    wb_inflight: AtomicU64,
    /// The mode is no longer write-back but dirty data remains: it is drained first.
    draining: AtomicBool,
    /// The tier failed with dirty data on it: reads of those blocks fail.
    lost: AtomicBool,
    /// One record writer at a time (`records::write_record_blocks`).
    record_io: Mutex<()>,
    records_tx: Mutex<Option<std::sync::mpsc::Sender<records::RecordRequest>>>,
    /// The record writer and the cleaner.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Set when the tier goes away: its threads stop.
    stop: AtomicBool,
    /// Units whose dirty blocks hold up a request: cleaned first.
    urgent: Mutex<Vec<u64>>,
    /// Some slot's record is dirtier than the slot, or an evicted slot waits to be
    /// freed: the cleaner's next pass looks for them (`tidy_records`).
    tidy: AtomicBool,
    /// Background cleaning paused (`Pool::pause_cache_cleaner`); drains and requests
    /// waiting for a unit are still served.
    cleaner_paused: AtomicBool,
    /// Wakes the cleaner.
    wake: (Mutex<bool>, std::sync::Condvar),
    /// Wakes the urgent cleaner (a request waits for a unit).
    urgent_wake: (Mutex<bool>, std::sync::Condvar),
    /// Held from clearing dirty bits to the synced records that say so
    /// (`records_clean`): with two cleaners, one's records must never be taken as
    /// durable for bits the other cleared after they were built.
    clean_commit: Mutex<()>,
    /// Held (shared) by a cleaner pass, (exclusively) by `release_units`: a freed unit's
    /// blocks are never written to the pool's devices after it is released.
    gate: std::sync::RwLock<()>,
}

impl CacheTier {
    /// A tier over `devices` (already labelled) for a pool, with cache units of `unit`
    /// bytes (a power of two from `MIN_UNIT` to `CACHE_UNIT`), starting empty.
    pub fn new(
        devices: Vec<Arc<dyn BlockDevice>>,
        mode: CacheMode,
        unit: u64,
        epoch: u64,
    ) -> Result<CacheTier> {
        check_unit(unit)?;
        let unit_shift = unit.trailing_zeros();
        let kind = match devices.len() {
            1 => LayoutKind::Concat,
            2 => LayoutKind::Raid1 { copies: 2 },
            0 => return Err(Error::invalid("a cache needs one or two devices")),
            n => {
                return Err(Error::invalid(format!(
                    "a cache has one device or two mirrored ones, not {n}"
                )))
            }
        };
        let layout = Arc::new(Layout::new(kind, devices)?);
        let geo = Geometry::new(layout.size, unit_shift);
        let slots = geo.slots;
        if slots < MIN_SLOTS {
            return Err(Error::invalid(format!(
                "a cache device needs more than 1 MiB (its label) plus its slot records plus \
                 {MIN_SLOTS} cache units of {}",
                tessera_device::format_size(unit)
            )));
        }
        // Enough shards that cores rarely meet, few enough that each has room for the
        // policy's queues.
        let mut n = 16u64;
        while n > 1 && slots / n < 16 {
            n /= 2;
        }
        let shards = (0..n)
            .map(|i| {
                let count = (slots - i).div_ceil(n);
                let cap = usize::try_from(count).expect("slots fit usize").max(4);
                Mutex::new(Shard {
                    policy: TwoQ::new(cap),
                    slot_of: HashMap::with_capacity(cap),
                    free: (0..u32::try_from(count).expect("fewer than 2^32 slots"))
                        .rev()
                        .collect(),
                    slots: vec![EMPTY_SLOT; cap],
                    crcs: HashMap::new(),
                    freed_of: HashMap::new(),
                    hand: 0,
                })
            })
            .collect();
        Ok(CacheTier {
            layout,
            mode: AtomicU8::new(mode as u8),
            shards,
            slots,
            unit_shift,
            failed: AtomicBool::new(false),
            detached: AtomicBool::new(false),
            inflight: AtomicU64::new(0),
            prefetching: AtomicU64::new(0),
            counters: CacheCounters::default(),
            geo,
            epoch,
            dirty_blocks: AtomicU64::new(0),
            dirty_slots: AtomicU64::new(0),
            wb_inflight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            record_io: Mutex::new(()),
            records_tx: Mutex::new(None),
            threads: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            urgent: Mutex::new(Vec::new()),
            tidy: AtomicBool::new(false),
            cleaner_paused: AtomicBool::new(false),
            wake: (Mutex::new(false), std::sync::Condvar::new()),
            urgent_wake: (Mutex::new(false), std::sync::Condvar::new()),
            clean_commit: Mutex::new(()),
            gate: std::sync::RwLock::new(()),
        })
    }

    pub fn mode(&self) -> CacheMode {
        CacheMode::from_u8(self.mode.load(Relaxed))
    }

    /// Switch modes online. Into pass-through the index is emptied: writes no longer
    /// keep it current, so nothing in it may be trusted afterwards. Out of write-back,
    /// the dirty data is drained first (`draining`): until it is, writes to cached units
    /// go to both tiers and the cleaner runs at full speed; the new mode takes over when
    /// nothing is dirty.
    pub fn set_mode(&self, mode: CacheMode) {
        let guards: Vec<_> = self.shards.iter().map(|s| s.locked()).collect();
        let was_wb = self.wb_active();
        self.mode.store(mode as u8, Release);
        let drain = mode != CacheMode::WriteBack
            && was_wb
            && (self.dirty_blocks.load(Acquire) > 0 || self.wb_inflight.load(Acquire) > 0);
        self.draining.store(drain, Release);
        drop(guards);
        if drain {
            self.wake_cleaner();
        } else if mode == CacheMode::PassThrough {
            self.invalidate_all();
        }
    }

    /// True when requests should not use the tier at all.
    #[inline]
    pub(crate) fn bypassed(&self) -> bool {
        self.failed.load(Relaxed)
            || self.detached.load(Relaxed)
            || (self.mode.load(Relaxed) == CacheMode::PassThrough as u8
                && !self.draining.load(Relaxed))
    }

    /// Write-back rules apply: the mode is write-back, or dirty data from it is being
    /// drained.
    #[inline]
    pub(crate) fn wb_active(&self) -> bool {
        self.mode.load(Relaxed) == CacheMode::WriteBack as u8 || self.draining.load(Relaxed)
    }

    /// The tier failed with dirty data on it: some reads must fail (`lost_conflict`).
    #[inline]
    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Relaxed)
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Relaxed)
    }

    /// An I/O error the cache layout could not hide: the tier goes uncached (nothing is
    /// lost: the pool's devices have every write) and empties its index.
    pub(crate) fn fail(&self) {
        self.counters.errors.fetch_add(1, Relaxed);
        if !self.failed.swap(true, Relaxed) {
            let dirty = self.dirty_blocks.load(Acquire);
            if dirty > 0 {
                // The dirty bits stay: they say which blocks now fail to read.
                self.lost.store(true, Release);
                tracing::error!(
                    dirty_bytes = dirty << BLOCK_SHIFT,
                    "write-back cache tier failed with dirty data: reads of it fail until \
                     it is written again; the rest of the pool goes on uncached"
                );
            } else {
                tracing::error!("cache tier failed: the pool goes on uncached");
            }
            self.invalidate_all();
        }
    }

    fn shard_of(&self, key: u64) -> (usize, u64) {
        let n = self.shards.len() as u64;
        (usize::try_from(key % n).expect("fits"), n)
    }

    /// Device-layout offset of slot `local` of shard `shard`.
    pub(crate) fn slot_offset(&self, shard: usize, local: u32) -> u64 {
        self.geo.meta_len + (self.global(shard, local) << self.unit_shift)
    }

    /// The global index of slot `local` of shard `shard` (its place on the devices).
    pub(crate) fn global(&self, shard: usize, local: u32) -> u64 {
        let n = self.shards.len() as u64;
        u64::from(local) * n + shard as u64
    }

    /// Offset within a cache unit.
    #[inline]
    pub(crate) fn unit_mask(&self) -> u64 {
        (1u64 << self.unit_shift) - 1
    }

    pub fn unit_size(&self) -> u64 {
        1 << self.unit_shift
    }

    /// A free slot of the shard that no read or writer still uses.
    fn take_slot(sh: &mut Shard) -> Option<u32> {
        let i = sh.free.iter().rposition(|&s| sh.slots[s as usize].idle())?;
        Some(sh.free.swap_remove(i))
    }

    /// Unit `key` leaves the cache: its slot is free (reused once idle). A slot with
    /// dirty blocks stays mapped, marked evicted, until the cleaner has cleaned it.
    fn drop_key(&self, sh: &mut Shard, key: u64) {
        let Some(&s) = sh.slot_of.get(&key) else {
            return;
        };
        let slot = &mut sh.slots[s as usize];
        // Write-back: a slot with dirty blocks, or whose record may still name some
        // (another slot must not take the unit then: after a crash the older record
        // would be read back), or with a write-back write in flight (its bytes will be
        // the only copy), is freed by the cleaner later.
        if !is_empty(slot.durable_dirty) || (self.wb_active() && !is_empty(slot.claimed)) {
            slot.evicted = true;
            self.tidy.store(true, Relaxed);
            return;
        }
        sh.slot_of.remove(&key);
        slot.mapped = false;
        slot.evicted = false;
        slot.touch(span(0, 255));
        sh.free.push(s);
        self.counters.evictions.fetch_add(1, Relaxed);
    }

    /// Give `key` a slot (policy already admitted it).
    fn map_key(&self, sh: &mut Shard, key: u64) -> Option<u32> {
        if let Some(&s) = sh.slot_of.get(&key) {
            sh.slots[s as usize].evicted = false;
            return Some(s);
        }
        let s = Self::take_slot(sh)?;
        self.assign_slot(sh, s, key, false);
        Some(s)
    }

    /// Free slot `s` now holds unit `key`, with no valid block yet. `outside_policy`: a
    /// write-back write took it and the policy does not count the unit as cached, so
    /// the slot is freed again once cleaned (`evicted`).
    fn assign_slot(&self, sh: &mut Shard, s: u32, key: u64, outside_policy: bool) {
        let slot = &mut sh.slots[s as usize];
        slot.key = key;
        slot.mapped = true;
        slot.evicted = outside_policy;
        slot.valid = NONE;
        sh.slot_of.insert(key, s);
        self.counters.promotions.fetch_add(1, Relaxed);
    }

    /// The plan for reading blocks `b0..=b1` of unit `key`; `sequential`: the detector
    /// calls the request part of a stream (it is not admitted).
    pub(crate) fn plan_read(&self, key: u64, b0: u64, b1: u64, sequential: bool) -> ReadPlan {
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        if self.bypassed() {
            return ReadPlan::Backing;
        }
        if self.wb_active() {
            // Dirty blocks the read needs but the slot does not hold all of it: the
            // pool's devices have older bytes of those, so each block comes from where
            // its current bytes are.
            if let Some(&s) = sh.slot_of.get(&key) {
                let st = &mut sh.slots[s as usize];
                let m = span(b0, b1);
                if !st.all_valid(b0, b1) && !is_empty(and(st.dirty, m)) {
                    st.pins += 1;
                    self.inflight.fetch_add(1, Relaxed);
                    return ReadPlan::Mixed {
                        slot: s,
                        valid: st.valid,
                    };
                }
            }
        }
        let outcome = sh.policy.access(key, sequential);
        // A unit with a slot is read from it whatever the policy says: the policy may
        // have let it go while its slot still holds write-back data (evicted, or read
        // back at an open), which the pool's devices do not have.
        let Some(s) = self
            .slot_for(&mut sh, key, outcome)
            .or_else(|| sh.slot_of.get(&key).copied())
        else {
            return ReadPlan::Backing;
        };
        let st = &mut sh.slots[s as usize];
        if st.all_valid(b0, b1) {
            st.pins += 1;
            self.inflight.fetch_add(1, Relaxed);
            return ReadPlan::Hit { slot: s };
        }
        if !st.claim(span(b0, b1)) {
            return ReadPlan::Backing;
        }
        self.inflight.fetch_add(1, Relaxed);
        ReadPlan::Fill { slot: s }
    }

    /// Readahead of unit `key`: a slot with every block claimed for it, or `None` (the
    /// unit is cached whole already, or being written, or the policy refuses it, or no
    /// slot is idle). The policy never lets readahead displace the hot set
    /// (`TwoQ::prefetch`).
    pub(crate) fn plan_prefetch(&self, key: u64) -> Option<u32> {
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        if self.bypassed() {
            return None;
        }
        if self.prefetching.load(Relaxed) >= PREFETCH_BUDGET {
            return None;
        }
        let outcome = sh.policy.prefetch(key);
        let slot = self.slot_for(&mut sh, key, outcome)?;
        let all = span(0, (1 << (self.unit_shift - BLOCK_SHIFT)) - 1);
        let st = &mut sh.slots[slot as usize];
        // Never over dirty blocks: the pool's devices have older bytes.
        if and(st.valid, all) == all || !is_empty(st.dirty) || !st.claim(all) {
            return None;
        }
        self.inflight.fetch_add(1, Relaxed);
        self.prefetching.fetch_add(self.unit_size(), Relaxed);
        Some(slot)
    }

    /// A readahead's buffer was given back.
    pub(crate) fn end_prefetch(&self) {
        self.prefetching.fetch_sub(self.unit_size(), Relaxed);
    }

    /// The slot of unit `key` after the policy's `outcome` for it: the one it has, or a
    /// new one when the policy admitted it (the evicted unit's slot freed first).
    fn slot_for(&self, sh: &mut Shard, key: u64, outcome: Outcome) -> Option<u32> {
        match outcome {
            Outcome::Hit => sh
                .slot_of
                .get(&key)
                .copied()
                .or_else(|| self.map_key(sh, key)),
            Outcome::Miss {
                admitted: true,
                evicted,
            } => {
                if let Some(k) = evicted {
                    self.drop_key(sh, k);
                }
                self.map_key(sh, key)
            }
            Outcome::Miss {
                admitted: false, ..
            } => None,
        }
    }

    /// A hit's read of the slot ended.
    pub(crate) fn end_hit(&self, key: u64, slot: u32) {
        let (i, _) = self.shard_of(key);
        self.shards[i].locked().slots[slot as usize].pins -= 1;
        self.inflight.fetch_sub(1, Relaxed);
    }

    /// The plan for writing blocks `touch0..=touch1` of unit `key`, of which `full`
    /// (a block range, possibly empty) are written whole. Blocks touched are invalid
    /// from now on unless the write goes to both tiers and ends undisturbed.
    pub(crate) fn plan_write(
        &self,
        key: u64,
        touch: (u64, u64),
        full: Option<(u64, u64)>,
        sequential: bool,
    ) -> WritePlan {
        if self.wb_active() && !self.bypassed() {
            return self.plan_write_back(key, touch, full, sequential);
        }
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        let admit = full.is_some() && !sequential && self.mode() == CacheMode::WriteThrough;
        let mut slot = sh.slot_of.get(&key).copied();
        if slot.is_some() {
            self.counters.write_hits.fetch_add(1, Relaxed);
        } else {
            self.counters.write_misses.fetch_add(1, Relaxed);
        }
        if admit && !self.bypassed() {
            match sh.policy.access(key, false) {
                Outcome::Hit => {}
                Outcome::Miss { admitted, evicted } => {
                    if let Some(k) = evicted {
                        self.drop_key(&mut sh, k);
                    }
                    if admitted {
                        slot = self.map_key(&mut sh, key);
                    }
                }
            }
        }
        let Some(s) = slot else {
            return WritePlan::Backing;
        };
        let st = &mut sh.slots[s as usize];
        let whole = full.map_or(NONE, |(a, b)| span(a, b));
        if admit && !self.bypassed() && st.claim(whole) {
            // The partial blocks at the edges are not written to the cache.
            st.touch(minus(span(touch.0, touch.1), whole));
            st.valid = minus(st.valid, whole);
            self.inflight.fetch_add(1, Relaxed);
            return WritePlan::Both { slot: s };
        }
        st.touch(span(touch.0, touch.1));
        WritePlan::Backing
    }

    /// A slot's writer ended: it releases its claim on `claimed`; the blocks `written`
    /// (within it) become valid when no other change touched them meanwhile.
    pub(crate) fn end_write(
        &self,
        key: u64,
        slot: u32,
        claimed: (u64, u64),
        written: Option<(u64, u64)>,
    ) {
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        let st = &mut sh.slots[slot as usize];
        let c = span(claimed.0, claimed.1);
        if let Some((b0, b1)) = written {
            if st.mapped && st.key == key {
                let good = minus(and(span(b0, b1), c), st.spoiled);
                st.valid = or(st.valid, good);
                // Written to both tiers while draining: the pool's devices have them.
                let cleaned = and(st.dirty, good);
                if !is_empty(cleaned) {
                    st.dirty = minus(st.dirty, cleaned);
                    self.dirty_blocks.fetch_sub(count_of(cleaned), Relaxed);
                    if is_empty(st.dirty) {
                        self.dirty_slots.fetch_sub(1, Relaxed);
                    }
                    self.tidy.store(true, Relaxed);
                }
            }
        }
        st.claimed = minus(st.claimed, c);
        st.spoiled = minus(st.spoiled, c);
        drop(sh);
        self.inflight.fetch_sub(1, Relaxed);
    }

    /// `[offset, offset + len)` of the pool changed other than through a slot's writer:
    /// what the cache holds of it is no longer valid.
    pub fn invalidate(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = offset + len;
        let shift = self.unit_shift;
        let mut key = offset >> shift;
        while key << shift < end {
            let base = key << shift;
            let b0 = (offset.max(base) - base) >> BLOCK_SHIFT;
            let b1 = ((end.min(base + (1 << shift)) - 1) - base) >> BLOCK_SHIFT;
            let (i, _) = self.shard_of(key);
            let mut sh = self.shards[i].locked();
            if let Some(&s) = sh.slot_of.get(&key) {
                sh.slots[s as usize].touch(span(b0, b1));
            }
            key += 1;
        }
    }

    fn invalidate_all(&self) {
        for sh in self.shards.iter() {
            let mut sh = sh.locked();
            for st in sh.slots.iter_mut() {
                st.touch(span(0, 255));
            }
        }
    }

    /// Stop using the tier and wait (up to `timeout`) for its operations in flight.
    pub(crate) fn detach(&self, timeout: Duration) -> bool {
        for sh in self.shards.iter() {
            let _g = sh.locked();
            self.detached.store(true, Release);
        }
        let t = std::time::Instant::now();
        while self.inflight.load(Acquire) > 0 {
            if t.elapsed() > timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Misses a unit needs before a full cache admits it (Open CAS's nhit; 1, the
    /// default, admits at the first). A higher count keeps units read once or twice out
    /// of a full cache, at the cost of admitting the hot ones later.
    pub fn set_admit_hits(&self, admit_hits: u8) {
        for sh in self.shards.iter() {
            sh.locked().policy.set_admit_hits(admit_hits);
        }
    }

    /// What `pool cache show` prints (the node adds the pool's name and device specs).
    pub fn status(&self) -> CacheInfo {
        let admit_hits = self.shards[0].locked().policy.admit_hits();
        let mut cached = 0u64;
        let mut valid = 0u64;
        let mut ram = 0u64;
        for sh in self.shards.iter() {
            let sh = sh.locked();
            ram += sh
                .crcs
                .values()
                .map(|c| (c.len() * 4 + 16) as u64)
                .sum::<u64>();
            cached += sh.slot_of.len() as u64;
            valid += sh
                .slots
                .iter()
                .filter(|s| s.mapped)
                .map(|s| u64::from(s.valid_blocks()))
                .sum::<u64>();
            ram += (sh.policy.state_bytes()
                + sh.slot_of.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
                + sh.slots.capacity() * std::mem::size_of::<Slot>()
                + sh.free.capacity() * 4) as u64;
        }
        let c = &self.counters;
        let failed_devs = self.layout.health.failed.load(Relaxed).count_ones();
        let ratio = |hits: u64, misses: u64| {
            if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            }
        };
        CacheInfo {
            pool: String::new(),
            devices: Vec::new(),
            admit_hits,
            read_hit_ratio: ratio(c.read_hits.load(Relaxed), c.read_misses.load(Relaxed)),
            write_hit_ratio: ratio(c.write_hits.load(Relaxed), c.write_misses.load(Relaxed)),
            mode: self.mode().name().to_string(),
            state: if self.lost() {
                "failed, dirty data lost"
            } else if self.failed() {
                "failed"
            } else if self.draining.load(Relaxed) {
                "draining"
            } else if failed_devs > 0 {
                "degraded"
            } else {
                "ok"
            }
            .to_string(),
            capacity: self.slots << self.unit_shift,
            unit_size: 1 << self.unit_shift,
            cached_units: cached,
            valid_bytes: valid << BLOCK_SHIFT,
            dirty_bytes: self.dirty_blocks.load(Relaxed) << BLOCK_SHIFT,
            cleaned_bytes: c.cleaned_bytes.load(Relaxed),
            read_hits: c.read_hits.load(Relaxed),
            read_misses: c.read_misses.load(Relaxed),
            read_hit_bytes: c.read_hit_bytes.load(Relaxed),
            read_miss_bytes: c.read_miss_bytes.load(Relaxed),
            write_hits: c.write_hits.load(Relaxed),
            write_misses: c.write_misses.load(Relaxed),
            promotions: c.promotions.load(Relaxed),
            evictions: c.evictions.load(Relaxed),
            fill_bytes: c.fill_bytes.load(Relaxed),
            bypassed_bytes: c.bypassed_bytes.load(Relaxed),
            prefetch_bytes: c.prefetch_bytes.load(Relaxed),
            errors: c.errors.load(Relaxed),
            ram_bytes: ram,
        }
    }
}

/// A cache unit size this version takes.
pub fn check_unit(unit: u64) -> Result<()> {
    if !unit.is_power_of_two() || !(MIN_UNIT..=CACHE_UNIT).contains(&unit) {
        return Err(Error::invalid(format!(
            "cache unit {} is not a power of two from 16K to 1M",
            tessera_device::format_size(unit)
        )));
    }
    Ok(())
}

/// Refuse an admission threshold of 0 misses (1 admits at the first).
pub fn check_admit_hits(admit_hits: u8) -> Result<()> {
    if admit_hits == 0 {
        return Err(Error::invalid(
            "cache admit hits: 1 (admit at the first miss) or more",
        ));
    }
    Ok(())
}

/// The cache label of device `index` of `count` for pool `uuid` (docs/format.md §16).
pub fn encode_label(
    uuid: &[u8; 16],
    index: u32,
    count: u32,
    unit: u64,
    epoch: u64,
    meta_len: u64,
    slots: u64,
) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    b[..8].copy_from_slice(CACHE_MAGIC);
    b[8..12].copy_from_slice(&LABEL_VERSION.to_le_bytes());
    b[16..32].copy_from_slice(uuid);
    b[32..36].copy_from_slice(&index.to_le_bytes());
    b[36..40].copy_from_slice(&count.to_le_bytes());
    b[40..48].copy_from_slice(&unit.to_le_bytes());
    b[48..56].copy_from_slice(&epoch.to_le_bytes());
    b[56..64].copy_from_slice(&meta_len.to_le_bytes());
    b[64..72].copy_from_slice(&slots.to_le_bytes());
    let crc = crate::format::crc(&b[..BLOCK - 4]);
    b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The cache label's version: 2 has the epoch and the record area.
const LABEL_VERSION: u32 = 2;

/// A cache label's fields (docs/format.md §16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheLabel {
    pub uuid: [u8; 16],
    pub version: u32,
    pub unit: u64,
    /// 0 for a version 1 label (no records).
    pub epoch: u64,
    pub meta_len: u64,
    pub slots: u64,
}

/// The cache label on `dev`, if it has a good one.
pub fn read_label(dev: &dyn BlockDevice) -> Result<Option<CacheLabel>> {
    let mut b = vec![0u8; BLOCK];
    dev.read_at(0, &mut b)
        .map_err(|e| Error::io("reading a cache device's label", e))?;
    if &b[..8] != CACHE_MAGIC || crate::format::crc(&b[..BLOCK - 4]).to_le_bytes() != b[BLOCK - 4..]
    {
        return Ok(None);
    }
    let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&b[16..32]);
    let v2 = version >= 2;
    Ok(Some(CacheLabel {
        uuid,
        version,
        unit: u64_at(40),
        epoch: if v2 { u64_at(48) } else { 0 },
        meta_len: if v2 { u64_at(56) } else { 0 },
        slots: if v2 { u64_at(64) } else { 0 },
    }))
}

/// What a device's first 4 KiB say about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceClaim {
    /// No label of ours.
    Blank,
    /// Part of a pool (a device label, docs/format.md §1).
    PoolDevice,
    /// A cache device of the pool with this UUID.
    CacheOf([u8; 16]),
}

/// Read a device's first block and say who claims it.
pub fn device_claim(dev: &dyn BlockDevice) -> Result<DeviceClaim> {
    let mut b = vec![0u8; BLOCK];
    dev.read_at(0, &mut b)
        .map_err(|e| Error::io("reading a cache device's label", e))?;
    if &b[..8] == crate::format::LABEL_MAGIC {
        return Ok(DeviceClaim::PoolDevice);
    }
    if &b[..8] == CACHE_MAGIC && crate::format::crc(&b[..BLOCK - 4]).to_le_bytes() == b[BLOCK - 4..]
    {
        let mut u = [0u8; 16];
        u.copy_from_slice(&b[16..32]);
        return Ok(DeviceClaim::CacheOf(u));
    }
    Ok(DeviceClaim::Blank)
}

/// Device offset where slot data starts (the first MiB is the label's).
pub const CACHE_DATA_START: u64 = DEV_DATA_START;

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_device::RamDevice;

    fn tier() -> CacheTier {
        let d: Arc<dyn BlockDevice> = RamDevice::new(40 << 20).unwrap();
        CacheTier::new(vec![d], CacheMode::WriteThrough, CACHE_UNIT, 1).unwrap()
    }

    /// Reads of unit 5, blocks 0..=3, until the unit is admitted and filled.
    fn fill(t: &CacheTier) -> u32 {
        loop {
            if let ReadPlan::Fill { slot } = t.plan_read(5, 0, 3, false) {
                return slot;
            }
        }
    }

    /// Write-back with no free slot: when the policy's victim is dirty (it keeps its slot
    /// until cleaned), a write takes another slot that is clean and idle rather than
    /// going to the pool's devices.
    #[test]
    fn a_write_back_write_takes_a_clean_slot_when_the_victim_is_dirty() {
        let d: Arc<dyn BlockDevice> = RamDevice::new(40 << 20).unwrap();
        let t = CacheTier::new(vec![d], CacheMode::WriteBack, CACHE_UNIT, 1).unwrap();
        // Units of shard 0 only (unit k * m); n of them fill its slots.
        let m = t.shards.len() as u64;
        let n = t.shards[0].locked().slots.len() as u64;
        // Reads fill every slot with a clean unit, in the policy's FIFO in this order.
        for k in (0..n).map(|k| k * m) {
            let ReadPlan::Fill { slot } = t.plan_read(k, 0, 0, false) else {
                panic!("unit {k} was not filled");
            };
            t.end_write(k, slot, (0, 0), Some((0, 0)));
        }
        // The oldest, the policy's next victim, gets dirty.
        let WritePlan::Back { slot: s0 } = t.plan_write(0, (1, 1), Some((1, 1)), false) else {
            panic!("a write-back write of a cached unit was not taken");
        };
        assert!(t.note_dirty(0, s0, (1, 1), &[7]).is_some());
        t.end_back(0, s0, (1, 1), true);
        // A new unit: its victim (unit 0) is dirty, another slot is taken.
        let new = (n + 5) * m;
        let WritePlan::Back { slot } = t.plan_write(new, (0, 0), Some((0, 0)), false) else {
            panic!("a write-back write went to the slow tier with clean slots at hand");
        };
        assert_ne!(slot, s0, "the dirty slot was given away");
        assert!(t.note_dirty(new, slot, (0, 0), &[9]).is_some());
        t.end_back(new, slot, (0, 0), true);
        // Unit 0 is still read from its slot (its dirty block is only there).
        assert_eq!(t.plan_read(0, 1, 1, false), ReadPlan::Hit { slot: s0 });
        t.end_hit(0, s0);
    }

    /// The race a write-around (or any write the cache does not take) runs against a
    /// fill: the fill read the pool's devices before the write landed, and must not
    /// validate what it read, whether the write started before its end or ended before.
    #[test]
    fn a_change_during_a_fill_spoils_it() {
        let t = tier();
        let s = fill(&t);
        t.invalidate(5 << 20, 4096); // block 0 changes meanwhile
        t.end_write(5, s, (0, 3), Some((0, 3)));
        // Blocks 1..=3 are valid, block 0 is not.
        assert_eq!(t.plan_read(5, 1, 3, false), ReadPlan::Hit { slot: s });
        t.end_hit(5, s);
        assert_eq!(t.plan_read(5, 0, 0, false), ReadPlan::Fill { slot: s });
        t.end_write(5, s, (0, 0), None);
    }

    /// Writers of different blocks of one unit run side by side and both validate; a
    /// writer of claimed blocks goes to the pool's devices and spoils the claim.
    #[test]
    fn claims_are_per_block() {
        let t = tier();
        let s = fill(&t);
        let WritePlan::Both { slot } = t.plan_write(5, (8, 9), Some((8, 9)), false) else {
            panic!("a write of other blocks was not taken");
        };
        assert_eq!(slot, s);
        // Blocks 2..=3 are claimed by the fill: this write may not take them.
        assert_eq!(
            t.plan_write(5, (3, 4), Some((3, 4)), false),
            WritePlan::Backing
        );
        t.end_write(5, s, (8, 9), Some((8, 9)));
        t.end_write(5, s, (0, 3), Some((0, 3)));
        assert_eq!(t.plan_read(5, 8, 9, false), ReadPlan::Hit { slot: s });
        t.end_hit(5, s);
        assert_eq!(t.plan_read(5, 0, 2, false), ReadPlan::Hit { slot: s });
        t.end_hit(5, s);
        // Block 3 was spoiled by the write that went around.
        assert!(matches!(t.plan_read(5, 3, 3, false), ReadPlan::Fill { .. }));
    }

    /// A slot is not given to another unit while a read of it or a claim on it is in
    /// flight.
    #[test]
    fn busy_slots_are_not_reused() {
        let d: Arc<dyn BlockDevice> = RamDevice::new(10 << 20).unwrap();
        let t = CacheTier::new(vec![d], CacheMode::WriteThrough, CACHE_UNIT, 1).unwrap();
        assert_eq!(t.shards.len(), 1);
        let s = fill(&t);
        t.end_write(5, s, (0, 3), Some((0, 3)));
        assert_eq!(t.plan_read(5, 0, 3, false), ReadPlan::Hit { slot: s });
        // Many other units come and go; unit 5's slot is pinned by the hit.
        for k in 100..200 {
            if let ReadPlan::Fill { slot } = t.plan_read(k, 0, 0, false) {
                assert_ne!(slot, s, "a pinned slot was reused");
                t.end_write(k, slot, (0, 0), None);
            }
        }
        t.end_hit(5, s);
    }

    #[test]
    fn spans() {
        assert_eq!(span(0, 0), [1, 0, 0, 0]);
        assert_eq!(span(0, 255), [u64::MAX; 4]);
        assert_eq!(span(63, 64), [1 << 63, 1, 0, 0]);
        assert_eq!(span(130, 130), [0, 0, 1 << 2, 0]);
    }
}
