//! Parity layouts (raid5, raid6, ec k+m): row geometry, the parity code, per-row locks and
//! the stripe journal's slices that close the write hole. The layout's synchronous face
//! (rebuild, scrub, format) is `layout/parity_sync.rs`, journal recovery
//! `layout/journal_recovery.rs`, and the per-core asynchronous datapath `parity_io`.
//!
//! A row is one chunk on every device: `k` data chunks and `m` parity chunks, the parity
//! rotating over the devices (docs/format.md §2). Every write to a row holds the row's
//! lock, an entry in a fixed table of atomics taken with a compare-and-swap — no global
//! lock, and rows far apart never contend. Taking the lock also hands out the row's next
//! *version*, which orders the row's journal records for recovery (format §2.1).

use std::collections::VecDeque;
use std::sync::atomic::{
    AtomicU64, Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::sync::{Mutex, OnceLock};
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::counters::{CounterRegistry, Counters};
use tessera_io::sync::MutexExt;

use tessera_parity::{pq_gen, pq_recover, pq_update, xor_into, xor_parity, ReedSolomon};

use crate::format::header_fields;
pub(crate) use crate::format::{encode_header, RecordHead, StripeRecord, KIND_CHUNK, KIND_FULL};

use crate::format::DEV_DATA_START;
use crate::layout::kind::LayoutKind;
use crate::layout::LayoutError;

/// The stripe journal: 16 MiB per device right after the label.
pub const JOURNAL_LEN: u64 = 16 << 20;
/// Device offset of row 0.
pub const PARITY_DATA_START: u64 = DEV_DATA_START + JOURNAL_LEN;
/// The journal is 8 slices; row `r` always journals in slice `r mod 8`, so the records of
/// one row are overwritten oldest first (recovery relies on it).
pub const SLICES: u64 = 8;
pub const SLICE_LEN: u64 = JOURNAL_LEN / SLICES;
/// Largest chunk: a record (header + one chunk) must fit a slice several times over.
pub const MAX_CHUNK: u64 = 256 << 10;
/// Recovery looks for record headers at every multiple of this.
pub(crate) const SCAN_STEP: usize = 512;
/// Entries of the row-lock table (rows `r` and `r + LOCKS` share one).
const LOCKS: usize = 4096;
const HELD: u64 = 1 << 63;

/// The erasure code of a parity layout.
pub(crate) enum Code {
    /// raid5: P = XOR of the data.
    Xor,
    /// raid6: P and Q as Linux md.
    Pq,
    /// ec: systematic Cauchy Reed-Solomon.
    Rs(ReedSolomon),
}

/// Geometry and shared state of a parity layout (one per `Layout`).
pub struct Parity {
    pub k: usize,
    pub m: usize,
    pub n: usize,
    pub chunk: u64,
    pub row_bytes: u64,
    pub rows: u64,
    pub(crate) code: Code,
    locks: Box<[AtomicU64]>,
    /// The pool's UUID, stamped into journal records (set once the pool knows it).
    pub(crate) uuid: OnceLock<[u8; 16]>,
    /// The journal's slices, each a ring shared (under a short lock) by the writers of
    /// its rows; each on cache lines of its own, so that cores writing different slices
    /// do not contend for one line.
    rings: Box<[SliceLock]>,
    /// Journal block: a record's header takes one, its payload starts at the next. 512,
    /// or the devices' largest logical block size (O_DIRECT alignment).
    pub block: u64,
    /// What the row engines of every core waited for (`ParityCounters`), summed when read.
    pub(crate) counters: CounterRegistry<ParityCounters>,
}

/// One core's row engine's figures: how its row writes went and what they waited for.
/// Written by that core alone (plain loads and stores), summed when read
/// (`Layout::parity_totals`).
#[derive(Default)]
#[repr(align(64))]
pub(crate) struct ParityCounters {
    row_writes: AtomicU64,
    lock_waits: AtomicU64,
    journal_waits: AtomicU64,
    ring_contended: AtomicU64,
}

/// The parity datapath's figures since the layout opened (every core's summed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParityTotals {
    /// Row writes finished.
    pub row_writes: u64,
    /// Rounds a row operation waited because another one held its row's lock.
    pub lock_waits: u64,
    /// Rounds a row write waited because its journal slice was full of unfinished writes.
    pub journal_waits: u64,
    /// Journal-slice allocations or releases that found the slice's lock held by
    /// another core.
    pub ring_contended: u64,
}

/// Which figure of `ParityCounters` an event adds to.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ParityEvent {
    RowWrite,
    LockWait,
    JournalWait,
    RingContended,
}

impl ParityCounters {
    #[inline]
    pub(crate) fn count(&self, e: ParityEvent) {
        let a = match e {
            ParityEvent::RowWrite => &self.row_writes,
            ParityEvent::LockWait => &self.lock_waits,
            ParityEvent::JournalWait => &self.journal_waits,
            ParityEvent::RingContended => &self.ring_contended,
        };
        a.store(a.load(Relaxed).wrapping_add(1), Relaxed);
    }
}

impl Counters for ParityCounters {
    type Totals = ParityTotals;
    fn add_to(&self, t: &mut ParityTotals) {
        t.row_writes += self.row_writes.load(Relaxed);
        t.lock_waits += self.lock_waits.load(Relaxed);
        t.journal_waits += self.journal_waits.load(Relaxed);
        t.ring_contended += self.ring_contended.load(Relaxed);
    }
}

impl Parity {
    /// The geometry of parity layout `kind` over `n` devices of at least `min_usable`
    /// bytes past the label, with logical blocks of `align` bytes.
    pub(crate) fn new(
        kind: LayoutKind,
        n: usize,
        min_usable: u64,
        align: u64,
    ) -> Result<Parity, LayoutError> {
        let (kind_m, chunk) = (kind.parity() as usize, kind.stripe());
        if let LayoutKind::Ec { k, m, .. } = kind {
            if (k + m) as usize != n {
                return Err(LayoutError::EcDevices {
                    k,
                    m,
                    need: k + m,
                    devices: n,
                });
            }
        }
        if !chunk.is_power_of_two() || !(4096..=MAX_CHUNK).contains(&chunk) {
            return Err(LayoutError::Chunk(chunk));
        }
        if n > 64 || kind_m == 0 || n < kind_m + 2 {
            return Err(LayoutError::ParityDevices {
                devices: n,
                parity: kind_m,
                need: kind_m + 2,
            });
        }
        let k = n - kind_m;
        let rows = min_usable.saturating_sub(JOURNAL_LEN) / chunk;
        if rows == 0 {
            return Err(LayoutError::ParityTooSmall(
                (DEV_DATA_START + JOURNAL_LEN) >> 20,
            ));
        }
        // The largest record (a write to part of a row: at most every chunk of it, plus a
        // header) must fit a journal slice.
        let header = ((header_fields(n) + 4) as u64).next_multiple_of(align.max(SCAN_STEP as u64));
        if header + n as u64 * chunk > SLICE_LEN {
            return Err(LayoutError::ChunkForJournal {
                devices: n,
                max_kib: (((SLICE_LEN - header) / n as u64).next_power_of_two() / 2) >> 10,
            });
        }
        let code = match kind {
            LayoutKind::Raid5 { .. } => Code::Xor,
            LayoutKind::Raid6 { .. } => Code::Pq,
            _ => Code::Rs(ReedSolomon::new(k, kind_m)?),
        };
        Ok(Parity {
            k,
            m: kind_m,
            n,
            chunk,
            row_bytes: k as u64 * chunk,
            rows,
            code,
            locks: (0..LOCKS).map(|_| AtomicU64::new(0)).collect(),
            uuid: OnceLock::new(),
            rings: (0..SLICES)
                .map(|s| SliceLock(Mutex::new(Ring::new(s))))
                .collect(),
            block: align.max(SCAN_STEP as u64).next_power_of_two(),
            counters: CounterRegistry::default(),
        })
    }

    /// Device holding shard `s` (data `0..k`, then parity `k..n`) of row `r`.
    #[inline]
    pub fn shard_dev(&self, r: u64, s: usize) -> usize {
        // 32-bit division when the row number allows: several times cheaper than 64-bit
        // on the read path (every read maps through here).
        let rem = match u32::try_from(r) {
            Ok(r) => (r % u32_of(self.n)) as usize,
            Err(_) => usize_of(r % self.n as u64),
        };
        let at = self.n - 1 - rem + if s < self.k { self.m + s } else { s - self.k };
        if at >= self.n {
            at - self.n
        } else {
            at
        }
    }

    /// Device offset of row `r`.
    #[inline]
    pub fn row_offset(&self, r: u64) -> u64 {
        PARITY_DATA_START + r * self.chunk
    }

    /// Pool offset -> (row, data shard, offset within the chunk).
    #[inline]
    pub fn locate(&self, offset: u64) -> (u64, usize, u64) {
        // Chunks are powers of two: offset -> chunk index by a shift, then one small
        // division by k (32-bit when it fits).
        let c = offset >> self.chunk.trailing_zeros();
        let (r, i) = match u32::try_from(c) {
            Ok(c) => ((c / u32_of(self.k)) as u64, (c % u32_of(self.k)) as usize),
            Err(_) => (c / self.k as u64, usize_of(c % self.k as u64)),
        };
        (r, i, offset & (self.chunk - 1))
    }

    // ---- row locks -------------------------------------------------------------------

    /// Take row `r`'s lock if it is free; returns the row's new version.
    #[inline]
    pub(crate) fn try_lock(&self, r: u64) -> Option<u64> {
        let e = &self.locks[usize_of(r % LOCKS as u64)];
        let cur = e.load(Acquire);
        if cur & HELD != 0 {
            return None;
        }
        let v = (cur + 1) & !HELD;
        e.compare_exchange(cur, v | HELD, AcqRel, Acquire)
            .ok()
            .map(|_| v)
    }

    #[inline]
    pub(crate) fn unlock(&self, r: u64, version: u64) {
        self.locks[usize_of(r % LOCKS as u64)].store(version, Release);
    }

    /// Blocking lock for the synchronous face (never called on a reactor thread).
    pub(crate) fn lock_sync(&self, r: u64) -> RowGuard<'_> {
        let mut spins = 0u32;
        loop {
            if let Some(v) = self.try_lock(r) {
                return RowGuard {
                    p: self,
                    row: r,
                    version: v,
                };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// The pool's UUID as stamped into journal records.
    pub(crate) fn uuid(&self) -> [u8; 16] {
        *self.uuid.get().unwrap_or(&[0; 16])
    }

    /// The journal ring row `r` writes its records in.
    #[inline]
    pub(crate) fn ring(&self, r: u64) -> std::sync::MutexGuard<'_, Ring> {
        self.rings[(r % SLICES) as usize].0.locked()
    }

    /// `ring`, counting in `c` when another core holds the slice's lock.
    #[inline]
    pub(crate) fn ring_counted(
        &self,
        r: u64,
        c: &ParityCounters,
    ) -> std::sync::MutexGuard<'_, Ring> {
        let m = &self.rings[(r % SLICES) as usize].0;
        match m.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                c.count(ParityEvent::RingContended);
                m.locked()
            }
        }
    }

    // ---- the code ----------------------------------------------------------------------

    /// Compute every parity shard from the data shards. `shards` holds n equal slices.
    pub(crate) fn encode(&self, shards: &mut [&mut [u8]]) {
        let (data, parity) = shards.split_at_mut(self.k);
        let data: Vec<&[u8]> = data.iter().map(|d| &**d).collect();
        self.encode_from(&data, parity);
    }

    /// Compute the m parity shards from k data shards held anywhere (a full-row write
    /// encodes straight from the client's buffers).
    pub(crate) fn encode_from(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) {
        match &self.code {
            Code::Xor => xor_parity(parity[0], data),
            Code::Pq => {
                let (p, q) = parity.split_at_mut(1);
                pq_gen(data, p[0], q[0]);
            }
            Code::Rs(rs) => rs
                .encode(data, parity)
                .expect("shard shapes match the code"),
        }
    }

    /// Read-modify-write of data shard `i`: `old` (overwritten: scratch) and `new` cover the
    /// same range as each slice of `parity` (the m old parity shards, updated in place).
    pub(crate) fn update(&self, old: &mut [u8], new: &[u8], i: usize, parity: &mut [&mut [u8]]) {
        match &self.code {
            Code::Xor => {
                xor_into(parity[0], old);
                xor_into(parity[0], new);
            }
            Code::Pq => {
                let (p, q) = parity.split_at_mut(1);
                pq_update(old, new, i, p[0], q[0]);
            }
            Code::Rs(rs) => {
                xor_into(old, new);
                rs.update_parity(old, i, parity)
                    .expect("shard shapes match the code");
            }
        }
    }

    /// Rebuild the shards listed in `erased` (at most m) from the others.
    pub(crate) fn reconstruct(&self, shards: &mut [&mut [u8]], erased: &[usize]) {
        if erased.is_empty() {
            return;
        }
        match &self.code {
            Code::Xor => {
                let e = erased[0];
                let (before, rest) = shards.split_at_mut(e);
                let (dst, after) = rest.split_first_mut().expect("index in range");
                let others: Vec<&[u8]> = before.iter().chain(after.iter()).map(|s| &**s).collect();
                xor_parity(dst, &others);
            }
            Code::Pq => pq_recover(shards, erased).expect("at most two erasures"),
            Code::Rs(rs) => rs.reconstruct(shards, erased).expect("at most m erasures"),
        }
    }
}

/// A held row lock on the synchronous face.
pub(crate) struct RowGuard<'a> {
    p: &'a Parity,
    row: u64,
    pub version: u64,
}

impl Drop for RowGuard<'_> {
    fn drop(&mut self) {
        self.p.unlock(self.row, self.version);
    }
}

// ---- journal ring ----------------------------------------------------------------------

/// A journal slice's ring under its lock, alone on its cache lines (two, since
/// x86 prefetches lines in adjacent pairs).
#[repr(align(128))]
struct SliceLock(Mutex<Ring>);

/// One writer's slice of the journal, used as a ring: records are placed in order and a
/// record is not overwritten until the row write it protects has finished.
pub(crate) struct Ring {
    slice: u64,
    /// Logical bytes handed out (physical = head mod SLICE_LEN).
    head: u64,
    /// Records not yet released, oldest first: (logical start, released).
    live: VecDeque<(u64, bool)>,
    /// Id of `live[0]`.
    base: u64,
}

impl Ring {
    pub(crate) fn new(slice: u64) -> Ring {
        Ring {
            slice,
            head: 0,
            live: VecDeque::new(),
            base: 0,
        }
    }

    /// Room for a record of `len` bytes: (device offset, id, watermark), or None while
    /// the ring is full of unfinished writes. Ids number the slice's records in order
    /// (the record's sequence number); the watermark is the id of the oldest record not
    /// yet released — every older one belongs to a finished row write.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<(u64, u64, u64)> {
        debug_assert!(len <= SLICE_LEN && len.is_multiple_of(SCAN_STEP as u64));
        let mut at = self.head;
        if (self.live.is_empty() && !at.is_multiple_of(SLICE_LEN))
            || at % SLICE_LEN + len > SLICE_LEN
        {
            // Start a new lap: when nothing is in flight, so that a lightly loaded slice
            // keeps reusing its first bytes (they stay in the CPU caches); every record
            // before this one is finished, which its watermark says.
            at = at.next_multiple_of(SLICE_LEN);
        }
        let oldest = self.live.front().map_or(at, |&(s, _)| s);
        if at + len - oldest > SLICE_LEN {
            return None;
        }
        self.head = at + len;
        self.live.push_back((at, false));
        let id = self.base + self.live.len() as u64 - 1;
        Some((
            DEV_DATA_START + self.slice * SLICE_LEN + at % SLICE_LEN,
            id,
            self.base,
        ))
    }

    pub(crate) fn release(&mut self, id: u64) {
        if let Some(e) = self.live.get_mut(usize_of(id - self.base)) {
            e.1 = true;
        }
        while self.live.front().is_some_and(|e| e.1) {
            self.live.pop_front();
            self.base += 1;
        }
    }
}

impl Parity {
    /// Bytes of a record header: room for an entry per device, in journal blocks.
    #[inline]
    pub(crate) fn header_len(&self) -> u64 {
        ((header_fields(self.n) + 4) as u64).next_multiple_of(self.block)
    }

    /// Payload bytes an entry of `len` bytes takes (entries start on journal blocks).
    #[inline]
    pub(crate) fn entry_len(&self, len: u64) -> u64 {
        len.next_multiple_of(self.block)
    }

    /// The devices that keep a row write's record (or a full-row write's marker): the
    /// row's writable parity devices. If all of them are lost, every data chunk of the
    /// row is readable as it is, so the record is only needed while one of them lives.
    pub(crate) fn record_holders(&self, r: u64, failed: u64) -> u64 {
        (self.k..self.n)
            .map(|s| 1u64 << self.shard_dev(r, s))
            .fold(0, |a, b| a | b)
            & !failed
    }
}

/// What a parity scrub of some rows found (bytes).
#[derive(Default, Debug, Clone)]
pub struct RowScrub {
    pub checked: u64,
    /// Parity bytes that did not match the data.
    pub mismatched: u64,
    pub repaired: u64,
    /// Bytes of rows with more chunks unreadable than the code can rebuild.
    pub unreadable: u64,
    /// Pool ranges (offset, length) of the rows that mismatched (at most 100).
    pub ranges: Vec<(u64, u64)>,
}
