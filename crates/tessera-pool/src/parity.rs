//! Parity layouts (raid5, raid6, ec k+m): row geometry, the parity code, per-row locks,
//! the stripe journal that closes the write hole, and the synchronous face (metadata,
//! rebuild, scrub, recovery). The per-core asynchronous datapath is in `parity_io`.
//!
//! A row is one chunk on every device: `k` data chunks and `m` parity chunks, the parity
//! rotating over the devices (docs/format.md §2). Every write to a row holds the row's
//! lock, an entry in a fixed table of atomics taken with a compare-and-swap — no global
//! lock, and rows far apart never contend. Taking the lock also hands out the row's next
//! *version*, which orders the row's journal records for recovery (format §2.1).

// Not yet audited for the workspace lint (40 casts, mostly u64 lengths and offsets to
// usize on this 64-bit-only code): remove this line and fix or justify each one.
#![allow(clippy::cast_possible_truncation)]

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::AcqRel, Ordering::Acquire, Ordering::Release};
use std::sync::{Mutex, OnceLock};

use tessera_parity::{pq_gen, pq_recover, pq_update, xor_into, xor_parity, ReedSolomon};

use crate::format::header_fields;
pub(crate) use crate::format::{encode_header, RecordHead, StripeRecord, KIND_CHUNK, KIND_FULL};

use crate::format::DEV_DATA_START;
use crate::layout::{error_reason, FailReason, Layout, LayoutKind};

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
const SCAN_STEP: usize = 512;
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
    /// its rows.
    rings: Box<[Mutex<Ring>]>,
    /// Journal block: a record's header takes one, its payload starts at the next. 512,
    /// or the devices' largest logical block size (O_DIRECT alignment).
    pub block: u64,
}

impl Parity {
    /// The geometry of parity layout `kind` over `n` devices of at least `min_usable`
    /// bytes past the label, with logical blocks of `align` bytes.
    pub(crate) fn new(
        kind: LayoutKind,
        n: usize,
        min_usable: u64,
        align: u64,
    ) -> Result<Parity, String> {
        let (kind_m, chunk) = (kind.parity() as usize, kind.stripe());
        if let LayoutKind::Ec { k, m, .. } = kind {
            if (k + m) as usize != n {
                return Err(format!("ec {k}+{m} needs {} devices, got {n}", k + m));
            }
        }
        if !chunk.is_power_of_two() || !(4096..=MAX_CHUNK).contains(&chunk) {
            return Err(format!(
                "chunk (stripe) size {chunk} must be a power of two between 4K and 256K for parity layouts"
            ));
        }
        if n > 64 || kind_m == 0 || n < kind_m + 2 {
            return Err(format!(
                "{n} devices cannot hold {kind_m} parity chunk(s) per row: at least {} devices are needed",
                kind_m + 2
            ));
        }
        let k = n - kind_m;
        let rows = min_usable.saturating_sub(JOURNAL_LEN) / chunk;
        if rows == 0 {
            return Err(format!(
                "devices are too small for a parity layout (each needs more than {} MiB)",
                (DEV_DATA_START + JOURNAL_LEN) >> 20
            ));
        }
        // The largest record (a write to part of a row: at most every chunk of it, plus a
        // header) must fit a journal slice.
        let header = ((header_fields(n) + 4) as u64).next_multiple_of(align.max(SCAN_STEP as u64));
        if header + n as u64 * chunk > SLICE_LEN {
            return Err(format!(
                "a {n}-device parity layout supports chunks up to {} KiB (the stripe journal holds a whole row per record)",
                (((SLICE_LEN - header) / n as u64).next_power_of_two() / 2) >> 10
            ));
        }
        let code = match kind {
            LayoutKind::Raid5 { .. } => Code::Xor,
            LayoutKind::Raid6 { .. } => Code::Pq,
            _ => Code::Rs(ReedSolomon::new(k, kind_m).map_err(|e| e.to_string())?),
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
            rings: (0..SLICES).map(|s| Mutex::new(Ring::new(s))).collect(),
            block: align.max(SCAN_STEP as u64).next_power_of_two(),
        })
    }

    /// Device holding shard `s` (data `0..k`, then parity `k..n`) of row `r`.
    #[inline]
    pub fn shard_dev(&self, r: u64, s: usize) -> usize {
        // 32-bit division when the row number allows: several times cheaper than 64-bit
        // on the read path (every read maps through here).
        let rem = match u32::try_from(r) {
            Ok(r) => (r % self.n as u32) as usize,
            Err(_) => (r % self.n as u64) as usize,
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
            Ok(c) => ((c / self.k as u32) as u64, (c % self.k as u32) as usize),
            Err(_) => (c / self.k as u64, (c % self.k as u64) as usize),
        };
        (r, i, offset & (self.chunk - 1))
    }

    // ---- row locks -------------------------------------------------------------------

    /// Take row `r`'s lock if it is free; returns the row's new version.
    #[inline]
    pub(crate) fn try_lock(&self, r: u64) -> Option<u64> {
        let e = &self.locks[(r % LOCKS as u64) as usize];
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
        self.locks[(r % LOCKS as u64) as usize].store(version, Release);
    }

    /// Blocking lock for the synchronous face (never called on a reactor thread).
    fn lock_sync(&self, r: u64) -> RowGuard<'_> {
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
        self.rings[(r % SLICES) as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        if let Some(e) = self.live.get_mut((id - self.base) as usize) {
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

/// What a synchronous row write changes: data shard, offset in the chunk, bytes.
struct Seg<'a> {
    shard: usize,
    off: u64,
    data: &'a [u8],
}

// ---- the synchronous face ----------------------------------------------------------------

impl Layout {
    pub(crate) fn parity_geo(&self) -> &Parity {
        self.parity.as_ref().expect("a parity layout")
    }

    /// Read `[lo, hi)` of every shard of row `r` into `buf` (n × (hi−lo) bytes), the
    /// unreadable ones rebuilt from the others. Caller holds the row lock.
    fn read_row_sync(&self, r: u64, lo: u64, hi: u64, buf: &mut [u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let span = (hi - lo) as usize;
        loop {
            let mut erased = Vec::new();
            let mut retry = false;
            for s in 0..p.n {
                let d = p.shard_dev(r, s);
                if !self.is_readable(d) {
                    erased.push(s);
                    continue;
                }
                let b = &mut buf[s * span..(s + 1) * span];
                if let Err(e) = self.devices[d].read_at(p.row_offset(r) + lo, b) {
                    self.mark_failed(d, error_reason(&e, FailReason::Read));
                    retry = true;
                    break;
                }
            }
            if retry {
                continue;
            }
            if erased.len() > p.m {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            let mut shards: Vec<&mut [u8]> = buf[..p.n * span].chunks_mut(span).collect();
            p.reconstruct(&mut shards, &erased);
            return Ok(());
        }
    }

    /// Synchronous read of pool range `[offset, offset+len)`.
    pub(crate) fn parity_read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let mut done = 0usize;
        while done < buf.len() {
            let (r, i, off) = p.locate(offset + done as u64);
            let n = ((p.chunk - off) as usize).min(buf.len() - done);
            let d = p.shard_dev(r, i);
            let dst = &mut buf[done..done + n];
            let direct = self.is_readable(d)
                && match self.devices[d].read_at(p.row_offset(r) + off, dst) {
                    Ok(()) => true,
                    Err(e) => {
                        self.mark_failed(d, error_reason(&e, FailReason::Read));
                        false
                    }
                };
            if !direct {
                let _g = p.lock_sync(r);
                let mut row = vec![0u8; p.n * n];
                self.read_row_sync(r, off, off + n as u64, &mut row)?;
                dst.copy_from_slice(&row[i * n..(i + 1) * n]);
            }
            done += n;
        }
        Ok(())
    }

    /// Synchronous write (metadata, tests): row by row, with the journal.
    pub(crate) fn parity_write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let mut done = 0usize;
        while done < data.len() {
            let (r, _, _) = p.locate(offset + done as u64);
            let row_end = ((r + 1) * p.row_bytes - offset) as usize;
            let end = row_end.min(data.len());
            let mut segs = Vec::new();
            let mut at = done;
            while at < end {
                let (_, i, off) = p.locate(offset + at as u64);
                let n = ((p.chunk - off) as usize).min(end - at);
                segs.push(Seg {
                    shard: i,
                    off,
                    data: &data[at..at + n],
                });
                at += n;
            }
            self.write_row_sync(r, &segs)?;
            done = end;
        }
        Ok(())
    }

    /// Zero pool range `[offset, offset+len)` (a unit going back to the free list): whole
    /// rows are zeroed on every device — data and parity, so the row stays consistent —
    /// after a full-row marker (docs/format.md §2.1) so that a crash in between gets the
    /// row's parity resynced; rows shared with a neighbouring range get their part
    /// written as zeros through the journaled row write. Synchronous face: never on a
    /// reactor thread (it waits for row locks held by reactor I/O).
    pub(crate) fn parity_zero(&self, offset: u64, len: u64) -> io::Result<()> {
        let p = self.parity_geo();
        let end = offset + len;
        let mut at = offset;
        let zeros = vec![0u8; p.row_bytes as usize];
        while at < end {
            let r = at / p.row_bytes;
            let row_start = r * p.row_bytes;
            let row_end = row_start + p.row_bytes;
            // A degraded row is zeroed through the journaled row write instead: a torn
            // row missing a chunk cannot be resynced from a marker.
            let healthy = (0..p.n).all(|s| !self.is_failed(p.shard_dev(r, s)));
            if at == row_start && row_end <= end && healthy {
                let g = p.lock_sync(r);
                let failed = self.failed_bits();
                let holders = p.record_holders(r, failed);
                let hl = p.header_len();
                let (jat, id, watermark) = loop {
                    if let Some(a) = p.ring(r).alloc(hl) {
                        break a;
                    }
                    std::thread::yield_now();
                };
                let mut jb = vec![0u8; hl as usize];
                encode_header(
                    &p.uuid(),
                    RecordHead {
                        seq: id,
                        watermark,
                        row: r,
                        version: g.version,
                        kind: KIND_FULL,
                        payload: 0,
                        holders,
                        payload_crc: None,
                    },
                    &[],
                    &mut jb,
                );
                for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
                    if self.devices[d].write_at(jat, &jb).is_err() {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                self.flush_durable(holders);
                for d in 0..p.n {
                    if self.is_failed(d) {
                        continue;
                    }
                    if self.devices[d]
                        .write_zeroes_at(p.row_offset(r), p.chunk)
                        .is_err()
                    {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                self.flush_durable(u64::MAX);
                p.ring(r).release(id);
                drop(g);
                at = row_end;
            } else {
                let n = (row_end.min(end) - at) as usize;
                self.parity_write_at(at, &zeros[..n])?;
                at += n as u64;
            }
        }
        if self.failed_bits().count_ones() as usize > p.m {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Make what was just written to devices `devs` durable (the synchronous face of the
    /// datapath's group flush): journal records before the row is written in place, the
    /// in-place writes before their record is released.
    fn flush_durable(&self, devs: u64) {
        let devs = devs & self.journal_flush_devs();
        for d in (0..self.devices.len()).filter(|d| devs & (1 << d) != 0) {
            if !self.is_failed(d) && self.devices[d].sync().is_err() {
                self.mark_failed(d, FailReason::Write);
            }
        }
    }

    /// Reconstruct-write of one row on the synchronous face: read the row's `[lo, hi)`
    /// (rebuilding what is unreadable), apply the segments, recompute parity, journal the
    /// changed chunks, then write them in place.
    fn write_row_sync(&self, r: u64, segs: &[Seg<'_>]) -> io::Result<()> {
        let p = self.parity_geo();
        let lo = segs.iter().map(|s| s.off).min().unwrap_or(0);
        let hi = segs
            .iter()
            .map(|s| s.off + s.data.len() as u64)
            .max()
            .unwrap_or(0);
        let span = (hi - lo) as usize;
        let g = p.lock_sync(r);
        let mut row = vec![0u8; p.n * span];
        self.read_row_sync(r, lo, hi, &mut row)?;
        for s in segs {
            let a = s.shard * span + (s.off - lo) as usize;
            row[a..a + s.data.len()].copy_from_slice(s.data);
        }
        {
            let mut shards: Vec<&mut [u8]> = row.chunks_mut(span).collect();
            p.encode(&mut shards);
        }
        // What goes where: the changed data ranges and every parity chunk's [lo, hi).
        let mut writes: Vec<(usize, u64, &[u8])> = Vec::new();
        for s in segs {
            let a = s.shard * span + (s.off - lo) as usize;
            writes.push((s.shard, s.off, &row[a..a + s.data.len()]));
        }
        for s in p.k..p.n {
            writes.push((s, lo, &row[s * span..(s + 1) * span]));
        }
        let failed = self.failed_bits();
        let holders = p.record_holders(r, failed);
        let payload: u64 = writes.iter().map(|w| p.entry_len(w.2.len() as u64)).sum();
        let hl = p.header_len() as usize;
        let rec_len = hl as u64 + payload;
        let mut jb = vec![0u8; rec_len as usize];
        let mut at_p = hl;
        for &(_, _, bytes) in &writes {
            jb[at_p..at_p + bytes.len()].copy_from_slice(bytes);
            at_p += p.entry_len(bytes.len() as u64) as usize;
        }
        let entries: Vec<(u8, u32, u32)> = writes
            .iter()
            .map(|w| (w.0 as u8, w.1 as u32, w.2.len() as u32))
            .collect();
        let (at, id, watermark) = loop {
            // Full of unfinished writes (reactors finish them on their own): wait.
            if let Some(a) = p.ring(r).alloc(rec_len) {
                break a;
            }
            std::thread::yield_now();
        };
        let payload_crc = (holders & self.journal_flush_devs() != 0)
            .then(|| crc32c::crc32c(&jb[hl..rec_len as usize]));
        encode_header(
            &p.uuid(),
            RecordHead {
                seq: id,
                watermark,
                row: r,
                version: g.version,
                kind: KIND_CHUNK,
                payload: payload as u32,
                holders,
                payload_crc,
            },
            &entries,
            &mut jb[..hl],
        );
        for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
            if self.devices[d].write_at(at, &jb).is_err() {
                self.mark_failed(d, FailReason::Write);
            }
        }
        self.flush_durable(holders);
        for &(s, off, bytes) in &writes {
            let d = p.shard_dev(r, s);
            if self.failed_bits() & (1 << d) != 0 {
                continue;
            }
            if self.devices[d]
                .write_at(p.row_offset(r) + off, bytes)
                .is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        self.flush_durable(writes.iter().fold(0, |a, w| a | 1 << p.shard_dev(r, w.0)));
        p.ring(r).release(id);
        drop(g);
        if self.failed_bits().count_ones() as usize > p.m {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Rebuild device `d`'s chunks of the rows that `[offset, offset+len)` touches, from
    /// the other devices. Each row is locked while it is rebuilt, so client writes (which
    /// also reach `d`, a write-only member) cannot interleave. Returns bytes written.
    pub(crate) fn parity_rebuild_range(&self, d: usize, offset: u64, len: u64) -> io::Result<u64> {
        let p = self.parity_geo();
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let span = p.chunk as usize;
        let mut row = vec![0u8; p.n * span];
        let mut written = 0;
        for r in first..=last {
            if self.rebuilding_bits() & (1 << d) == 0 {
                return Err(io::Error::other(format!(
                    "device {d} failed during the rebuild"
                )));
            }
            let _g = p.lock_sync(r);
            self.read_row_sync(r, 0, p.chunk, &mut row)?;
            let s = (0..p.n)
                .find(|&s| p.shard_dev(r, s) == d)
                .expect("every device holds a shard");
            if let Err(e) =
                self.devices[d].write_at(p.row_offset(r), &row[s * span..(s + 1) * span])
            {
                self.mark_failed(d, FailReason::Write);
                return Err(e);
            }
            written += p.chunk;
        }
        Ok(written)
    }

    /// Parity scrub of the rows `[offset, offset+len)` touches: with every shard readable,
    /// parity recomputed from the data must equal the stored parity; with `repair`, wrong
    /// parity is rewritten (data is what the clients wrote; parity is derived from it).
    pub(crate) fn parity_scrub_rows(
        &self,
        offset: u64,
        len: u64,
        repair: bool,
    ) -> io::Result<RowScrub> {
        let p = self.parity_geo();
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let span = p.chunk as usize;
        let mut row = vec![0u8; p.n * span];
        let mut want = vec![0u8; p.m * span];
        let (mut checked, mut bad, mut fixed, mut lost) = (0, 0, 0, 0);
        let mut ranges = Vec::new();
        for r in first..=last {
            let _g = p.lock_sync(r);
            let unreadable = (0..p.n)
                .filter(|&s| !self.is_readable(p.shard_dev(r, s)))
                .count();
            if unreadable > p.m {
                lost += p.row_bytes;
                continue;
            }
            if unreadable > 0 {
                // Degraded: nothing to compare parity with; the data is reconstructible.
                checked += p.row_bytes;
                continue;
            }
            if self.read_row_sync(r, 0, p.chunk, &mut row).is_err() {
                lost += p.row_bytes;
                continue;
            }
            want.copy_from_slice(&row[p.k * span..]);
            {
                let mut shards: Vec<&mut [u8]> = row.chunks_mut(span).collect();
                p.encode(&mut shards);
            }
            checked += p.row_bytes;
            if want != row[p.k * span..] {
                bad += (p.m * span) as u64;
                if ranges.len() < 100 {
                    ranges.push((r * p.row_bytes, p.row_bytes));
                }
                if repair {
                    let mut ok = true;
                    for s in p.k..p.n {
                        let d = p.shard_dev(r, s);
                        if self.devices[d]
                            .write_at(p.row_offset(r), &row[s * span..(s + 1) * span])
                            .is_err()
                        {
                            self.mark_failed(d, FailReason::Write);
                            ok = false;
                        }
                    }
                    if ok {
                        fixed += (p.m * span) as u64;
                    }
                }
            }
        }
        Ok(RowScrub {
            checked,
            mismatched: bad,
            repaired: fixed,
            unreadable: lost,
            ranges,
        })
    }

    /// Zero every device's journal and data area (a new parity pool: zero data, zero
    /// parity — every row consistent from the start).
    pub(crate) fn parity_format(&self) -> io::Result<()> {
        let p = self.parity_geo();
        for d in &self.devices {
            d.write_zeroes_at(DEV_DATA_START, JOURNAL_LEN + p.rows * p.chunk)?;
        }
        Ok(())
    }

    /// Recover after an unclean stop (docs/format.md §2.1): replay complete journaled
    /// writes, resync the parity of rows whose last write may be torn, then empty the
    /// journals. Returns (writes replayed, rows resynced, degraded rows left as they were).
    /// Empty the stripe journal of every healthy device (a clean shutdown: every row write
    /// has finished, so the next open has nothing to replay).
    pub fn clear_journal(&self) -> io::Result<()> {
        if self.parity.is_none() {
            return Ok(());
        }
        for (d, dev) in self.devices.iter().enumerate() {
            if self.is_failed(d) {
                continue;
            }
            if dev
                .write_zeroes_at(DEV_DATA_START, JOURNAL_LEN)
                .and_then(|()| dev.sync())
                .is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        Ok(())
    }

    /// Finish or undo the row writes a crash interrupted (docs/format.md §2.1): find
    /// every valid record on every readable device, keep each row's newest unfinished
    /// one, roll chunk updates forward, recompute the parity of full-row writes, then
    /// empty the journal. Returns (writes replayed, rows resynced, degraded rows left).
    pub fn recover_journal(&self) -> io::Result<(u64, u64, u64)> {
        let Some(p) = self.parity.as_ref() else {
            return Ok((0, 0, 0));
        };
        let uuid = *p
            .uuid
            .get()
            .ok_or_else(|| io::Error::other("pool UUID not set"))?;
        let found = self.scan_journal(p, &uuid);
        let newest = unfinished_writes(found);
        let (replayed, resync) = self.roll_forward(p, &newest);
        let (synced, degraded) = self.resync_rows(p, &resync);
        for d in 0..p.n {
            if self.is_failed(d) {
                continue;
            }
            // In-place writes first, then the journal goes: a crash in between replays again.
            if self.devices[d].sync().is_err()
                || self.devices[d]
                    .write_zeroes_at(DEV_DATA_START, JOURNAL_LEN)
                    .is_err()
                || self.devices[d].sync().is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        if replayed + synced + degraded > 0 {
            tracing::warn!(
                replayed,
                synced,
                degraded,
                "stripe journal: writes replayed, rows' parity resynced, degraded rows left as they were"
            );
        }
        Ok((replayed, synced, degraded))
    }

    /// Every valid record of every readable device's journal: (slice, record, payload).
    fn scan_journal(&self, p: &Parity, uuid: &[u8; 16]) -> Vec<(u64, StripeRecord, Vec<u8>)> {
        // Every valid record found: (slice, record, payload).
        let mut found: Vec<(u64, StripeRecord, Vec<u8>)> = Vec::new();
        let mut area = vec![0u8; JOURNAL_LEN as usize];
        let hl = p.header_len() as usize;
        for d in 0..p.n {
            if !self.is_readable(d) {
                continue;
            }
            if let Err(e) = self.devices[d].read_at(DEV_DATA_START, &mut area) {
                self.mark_failed(d, error_reason(&e, FailReason::Read));
                continue;
            }
            // Every header position is examined, not only the ends of records found:
            // a slice is shared by rows whose records go to different devices, so this
            // device may still hold an old record's header whose span a newer record
            // (written only where the old one's tail was) has since overwritten in part.
            // Skipping that old span would miss the newer record.
            let mut here: Vec<(usize, usize, StripeRecord)> = Vec::new();
            for at in (0..=area.len() - hl).step_by(SCAN_STEP) {
                let Some(rec) = StripeRecord::decode(uuid, &area[at..at + hl]) else {
                    continue;
                };
                let end = at + hl + rec.head.payload as usize;
                // A record whose payload does not match its checksum was torn by a power
                // loss before its flush completed: its row was not written in place.
                let ok = end <= area.len()
                    && rec.head.row < p.rows
                    && rec.head.holders & (1 << d) != 0
                    && (rec.head.kind == KIND_FULL || rec.head.kind == KIND_CHUNK)
                    && rec
                        .head
                        .payload_crc
                        .is_none_or(|c| crc32c::crc32c(&area[at + hl..end]) == c);
                if ok {
                    here.push((at, end, rec));
                }
            }
            // Of two overlapping records, the one with the lower sequence was overwritten
            // (a record's bytes are reused only after its write finished): dropped.
            let mut live = vec![true; here.len()];
            for i in 0..here.len() {
                for j in i + 1..here.len() {
                    if here[j].0 >= here[i].1 {
                        break;
                    }
                    if here[i].2.head.seq < here[j].2.head.seq {
                        live[i] = false;
                    } else {
                        live[j] = false;
                    }
                }
            }
            for ((at, end, rec), live) in here.into_iter().zip(live) {
                if live {
                    found.push((at as u64 / SLICE_LEN, rec, area[at + hl..end].to_vec()));
                }
            }
        }
        found
    }

    /// Roll the rows' chunk updates forward; returns how many, and the rows of full-row
    /// writes, whose parity must be recomputed.
    fn roll_forward(
        &self,
        p: &Parity,
        newest: &BTreeMap<u64, (StripeRecord, Vec<u8>)>,
    ) -> (u64, Vec<u64>) {
        // Only a row's newest write can be unfinished (the row lock orders a row's
        // writes). A chunk update is
        // rolled forward from any copy of its record; a full-row write (no payload) gets
        // its parity recomputed from the data.
        let mut resync = Vec::new();
        let mut replayed = 0;
        for (&row, (rec, payload)) in newest {
            if rec.head.kind != KIND_CHUNK {
                resync.push(row);
                continue;
            }
            let mut at = 0usize;
            for &(shard, off, len) in &rec.entries {
                let (shard, len) = (shard as usize, len as usize);
                if shard < p.n && off as u64 + len as u64 <= p.chunk && at + len <= payload.len() {
                    let d = p.shard_dev(row, shard);
                    if !self.is_failed(d)
                        && self.devices[d]
                            .write_at(p.row_offset(row) + off as u64, &payload[at..at + len])
                            .is_err()
                    {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                at += p.entry_len(len as u64) as usize;
            }
            replayed += 1;
        }
        (replayed, resync)
    }

    /// Recompute the parity of `rows` from their data; returns (rows resynced, rows left
    /// as they were because a data chunk is unreadable).
    fn resync_rows(&self, p: &Parity, rows: &[u64]) -> (u64, u64) {
        let (mut synced, mut degraded) = (0, 0);
        let span = p.chunk as usize;
        let mut buf = vec![0u8; p.n * span];
        for &r in rows {
            let all_data = (0..p.k).all(|s| self.is_readable(p.shard_dev(r, s)));
            if !all_data {
                degraded += 1;
                continue;
            }
            let mut ok = true;
            for s in 0..p.k {
                let d = p.shard_dev(r, s);
                if self.devices[d]
                    .read_at(p.row_offset(r), &mut buf[s * span..(s + 1) * span])
                    .is_err()
                {
                    self.mark_failed(d, FailReason::Read);
                    ok = false;
                }
            }
            if !ok {
                degraded += 1;
                continue;
            }
            {
                let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
                p.encode(&mut shards);
            }
            for s in p.k..p.n {
                let d = p.shard_dev(r, s);
                if self.is_failed(d) {
                    continue;
                }
                if self.devices[d]
                    .write_at(p.row_offset(r), &buf[s * span..(s + 1) * span])
                    .is_err()
                {
                    self.mark_failed(d, FailReason::Write);
                }
            }
            synced += 1;
        }
        (synced, degraded)
    }
}

/// Each row's newest record that may belong to an unfinished write.
fn unfinished_writes(
    found: Vec<(u64, StripeRecord, Vec<u8>)>,
) -> BTreeMap<u64, (StripeRecord, Vec<u8>)> {
    // A record older than its slice's newest watermark belongs to a finished write
    // (and may be older than a write whose record is already overwritten): ignored.
    let mut wm = [0u64; SLICES as usize];
    for (slice, rec, _) in &found {
        let w = &mut wm[*slice as usize];
        *w = (*w).max(rec.head.watermark);
    }
    let mut newest: BTreeMap<u64, (StripeRecord, Vec<u8>)> = BTreeMap::new();
    for (slice, rec, payload) in found {
        if rec.head.seq < wm[slice as usize] {
            continue;
        }
        if newest
            .get(&rec.head.row)
            .is_none_or(|n| n.0.head.version < rec.head.version)
        {
            newest.insert(rec.head.row, (rec, payload));
        }
    }
    newest
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tessera_device::{BlockDevice, RamDevice};

    /// Write a record (header, then each entry's bytes on its own journal block) at
    /// `at` bytes into `dev`'s journal.
    fn put_record(
        l: &Layout,
        dev: usize,
        at: u64,
        head: RecordHead,
        entries: &[(u8, u32, Vec<u8>)],
    ) {
        let p = l.parity_geo();
        let desc: Vec<(u8, u32, u32)> = entries
            .iter()
            .map(|(s, o, b)| (*s, *o, b.len() as u32))
            .collect();
        let hl = p.header_len() as usize;
        let mut rec = vec![0u8; hl + head.payload as usize];
        let mut pos = hl;
        for (_, _, b) in entries {
            rec[pos..pos + b.len()].copy_from_slice(b);
            pos += p.entry_len(b.len() as u64) as usize;
        }
        // A checksum, when asked for, is the payload's.
        let head = RecordHead {
            payload_crc: head.payload_crc.map(|_| crc32c::crc32c(&rec[hl..])),
            ..head
        };
        encode_header(&p.uuid(), head, &desc, &mut rec[..hl]);
        l.devices[dev].write_at(DEV_DATA_START + at, &rec).unwrap();
    }

    /// A slice is shared by rows whose records go to different devices, so a device can
    /// keep an old record's header while a newer record (of another row, also held by
    /// this device) overwrote the old record's tail. Recovery must find the newer record
    /// instead of skipping the old record's whole span.
    #[test]
    fn recovery_finds_a_record_written_over_an_old_records_tail() {
        let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
            .map(|_| RamDevice::new(24 << 20).unwrap() as Arc<dyn BlockDevice>)
            .collect();
        let l = Layout::new(LayoutKind::Raid5 { stripe: 4096 }, devs).unwrap();
        l.set_pool_uuid([7; 16]);
        l.format_parity().unwrap();
        let p = l.parity_geo();
        // Two rows of slice 0 whose parity (and so whose records) is on the same device.
        let newer_row = 8;
        let holder = p.shard_dev(newer_row, 2);
        let old_row = (16..)
            .step_by(SLICES as usize)
            .find(|&r| p.shard_dev(r, 2) == holder)
            .unwrap();
        let hl = p.header_len();
        // The old record: a whole data chunk, its header intact at the slice's start.
        put_record(
            &l,
            holder,
            0,
            RecordHead {
                seq: 3,
                watermark: 3,
                row: old_row,
                version: 1,
                kind: KIND_CHUNK,
                payload: 4096,
                holders: 1 << holder,
                payload_crc: None,
            },
            &[(0, 0, vec![0xAA; 4096])],
        );
        // The newer record starts inside the old one's payload: one sector of data and
        // its parity (the other data chunk is zero, so parity = data).
        let new = vec![0x5C; 512];
        put_record(
            &l,
            holder,
            hl + 2048,
            RecordHead {
                seq: 9,
                watermark: 9,
                row: newer_row,
                version: 1,
                kind: KIND_CHUNK,
                payload: 1024,
                holders: 1 << holder,
                payload_crc: None,
            },
            &[(0, 512, new.clone()), (2, 512, new.clone())],
        );
        let (replayed, _, _) = l.recover_journal().unwrap();
        assert_eq!(replayed, 1, "only the newer record is live");
        let mut got = vec![0u8; 512];
        for s in [0, 2] {
            l.devices[p.shard_dev(newer_row, s)]
                .read_at(p.row_offset(newer_row) + 512, &mut got)
                .unwrap();
            assert_eq!(
                got, new,
                "shard {s} of the newer record's row was not rolled forward"
            );
        }
        // The overwritten old record was not replayed.
        l.devices[p.shard_dev(old_row, 0)]
            .read_at(p.row_offset(old_row), &mut got)
            .unwrap();
        assert_eq!(got, vec![0u8; 512]);
    }

    /// A record written with a payload checksum (journal flushes on) is replayed when
    /// its payload is whole, and ignored when a power loss tore it (a sector of the
    /// payload never reached the media): its row was never written in place.
    #[test]
    fn recovery_ignores_a_torn_record_and_replays_a_whole_one() {
        for torn in [false, true] {
            let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
                .map(|_| RamDevice::new(24 << 20).unwrap() as Arc<dyn BlockDevice>)
                .collect();
            let l = Layout::new(LayoutKind::Raid5 { stripe: 4096 }, devs).unwrap();
            l.set_pool_uuid([9; 16]);
            l.format_parity().unwrap();
            let p = l.parity_geo();
            let row = 5;
            let holder = p.shard_dev(row, 2);
            let new = vec![0x3C; 1024];
            put_record(
                &l,
                holder,
                (row % SLICES) * SLICE_LEN,
                RecordHead {
                    seq: 0,
                    watermark: 0,
                    row,
                    version: 1,
                    kind: KIND_CHUNK,
                    payload: 2048,
                    holders: 1 << holder,
                    payload_crc: Some(0),
                },
                &[(0, 0, new.clone()), (2, 0, new.clone())],
            );
            if torn {
                // The payload's last sector still holds what was there before.
                l.devices[holder]
                    .write_at(
                        DEV_DATA_START + (row % SLICES) * SLICE_LEN + p.header_len() + 1536,
                        &[0u8; 512],
                    )
                    .unwrap();
            }
            let (replayed, _, _) = l.recover_journal().unwrap();
            let mut got = vec![0u8; 1024];
            l.devices[p.shard_dev(row, 0)]
                .read_at(p.row_offset(row), &mut got)
                .unwrap();
            if torn {
                assert_eq!(replayed, 0, "a torn record was replayed");
                assert_eq!(got, vec![0u8; 1024]);
            } else {
                assert_eq!(replayed, 1);
                assert_eq!(got, new);
            }
        }
    }
}
