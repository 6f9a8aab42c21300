//! The datapath of block-mapped (dedup) volumes (docs/format.md §17).
//!
//! A read looks its blocks' map entries up under the dedup lock and reads each run of
//! store blocks through the layout's asynchronous datapath (holes read as zeros). A
//! write fingerprints each 4 KiB block: an all-zero block becomes a hole, a block the
//! index knows (confirmed by comparing the stored bytes) takes one more reference, and
//! the rest get new store blocks, written asynchronously; only when those writes have
//! completed are the new map entries published (`DedupCore::publish`), so a reader on
//! any core sees either the old block or the whole new one, never a half-written one.
//! Sub-block edges are read, merged and written whole, one write at a time per block
//! (`DedupCore::begin_merge`; a second waits a round): two merges from the same old bytes
//! would lose the first one's part. A whole-block write that publishes while a merge of
//! the block is in flight makes that merge write again (`publish` checks the entry it
//! merged from). A write-zeroes' partial edges are writes of zeros through this path.
//!
//! A write of a block whose bytes a write in flight is storing as a new block (a client
//! that writes the same data twice in quick succession, as fio's `dedupe_percentage`
//! does) waits for that one to be published and then shares it: it is deferred to the
//! core's next round, for at most `MAX_WAITS` rounds.
//!
//! A volume of a chain (docs/format.md §3.4) reads through its parent's layer where its
//! own has no entry (`DedupCore::chained`); its writes go to its own layer only, so a
//! snapshot's blocks are never overwritten in place (their entries are in another
//! layer). While a snapshot of the volume is being taken, a change that began after the
//! drain waits (`Held`, retried each round) and then goes to the volume's new layer.
//!
//! Index buckets and compared blocks are read synchronously on the reactor: dedup pools
//! have no parity (whose row locks, held by this core's writes, such a read could wait
//! for) and no cache tier (which the synchronous reads would not see).

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tessera_io::cast::{u32_of, usize_of};
use tessera_io::{AlignedBuf, Continuation, CoreIo, IoHandle, IoOp, Tag};

use super::{Volume, VolumeHandle};
use crate::cache_tier::TierHandle;
use crate::core_engine::{core_engine, CoreEngine};
use crate::dedup::store::{
    is_zero, DedupCore, Placement, BLOCKS_PER_UNIT, DBLOCK, MERGE_CONFLICT, UNHASHED,
};
use crate::dedup::Fingerprint;
use crate::format::BLOCK;
use crate::pool::PoolCore;

/// A write whose new blocks are being written: published when they all complete.
struct PendingWrite {
    dedup: Arc<DedupCore>,
    pool: Arc<PoolCore>,
    layer: u32,
    first: u64,
    placements: Vec<Placement>,
    /// Merged edge blocks the writes read from (alive until they complete).
    _edges: Vec<AlignedBuf>,
    /// The blocks merged and the entries they were merged from (`begin_merge`).
    merged: Vec<(u64, u64)>,
    /// The request, to write it again when a merged block changed meanwhile.
    offset: u64,
    len: u64,
    buf: *const u8,
    rounds: u32,
}

/// A write deferred because a block of it is being stored by another write.
struct Waiting {
    dedup: Arc<DedupCore>,
    pool: Arc<PoolCore>,
    layer: u32,
    offset: u64,
    len: u64,
    /// The client's bytes (alive until `tag` completes).
    buf: *const u8,
    tag: Tag,
    rounds: u32,
}

/// A change that began while a snapshot of its volume is being taken: it waits until
/// the volume has its new layer.
struct Held {
    vol: Arc<Volume>,
    dedup: Arc<DedupCore>,
    op: IoOp,
    epoch: u64,
    tag: Tag,
}

/// Writes up to this size count as small for the gain detector.
const SMALL_WRITE: u32 = 64 << 10;

/// Rounds a write waits for an identical block in flight before storing its own copy.
const MAX_WAITS: u32 = 100_000;
/// Hook contexts of deferred writes carry this bit; those of pending writes do not.
const WAIT_CTX: u64 = 1 << 63;
/// Hook contexts of held changes carry this bit.
const HELD_CTX: u64 = 1 << 62;

/// The dedup write engine of one pool on one core (in the core's `locals`). Borrows of
/// its cells are never held across a submission or a completion.
pub(crate) struct DedupWrites {
    hook: Cell<u32>,
    slots: RefCell<Vec<Option<PendingWrite>>>,
    free: RefCell<Vec<u32>>,
    waiting: RefCell<Vec<Option<Waiting>>>,
    waiting_free: RefCell<Vec<u32>>,
    held: RefCell<Vec<Option<Held>>>,
    held_free: RefCell<Vec<u32>>,
    /// Layout handles for retried writes (one per nesting level in use: a layout may
    /// complete synchronously, into a hook that retries another write).
    layouts: RefCell<Vec<TierHandle>>,
    /// A block for comparisons with stored blocks.
    scratch: RefCell<AlignedBuf>,
}

/// Put `v` in a free slot of `slab`; its index.
fn slab_put<T>(slab: &RefCell<Vec<Option<T>>>, free: &RefCell<Vec<u32>>, v: T) -> u32 {
    let mut slots = slab.borrow_mut();
    match free.borrow_mut().pop() {
        Some(i) => {
            slots[i as usize] = Some(v);
            i
        }
        None => {
            slots.push(Some(v));
            u32_of(slots.len() - 1)
        }
    }
}

impl CoreEngine for DedupWrites {
    type Owner = PoolCore;
    const TAG: usize = 0x6465_6475;

    fn create(_pool: &Arc<PoolCore>) -> Self {
        DedupWrites {
            hook: Cell::new(0),
            slots: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            waiting: RefCell::new(Vec::new()),
            waiting_free: RefCell::new(Vec::new()),
            held: RefCell::new(Vec::new()),
            held_free: RefCell::new(Vec::new()),
            layouts: RefCell::new(Vec::new()),
            scratch: RefCell::new(AlignedBuf::zeroed(BLOCK)),
        }
    }

    fn set_hook(&self, id: u32) {
        self.hook.set(id)
    }

    /// Its pending and deferred writes hold the pool: none is left once the pool is
    /// gone, so the hook goes too.
    fn retire(&self) -> Option<u32> {
        if let Ok(mut l) = self.layouts.try_borrow_mut() {
            l.clear();
        }
        Some(self.hook.get())
    }
}

impl Continuation for DedupWrites {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        if ctx & HELD_CTX != 0 {
            let i = ctx & !HELD_CTX;
            let h = self.held.borrow_mut()[usize_of(i)]
                .take()
                .expect("a held change is retried once");
            self.held_free.borrow_mut().push(u32_of(i));
            if h.vol.held(h.epoch) {
                let i = slab_put(&self.held, &self.held_free, h);
                io.defer_hook(self.hook.get(), HELD_CTX | u64::from(i));
                return;
            }
            let pool = h.vol.pool.clone();
            let taken = self.layouts.borrow_mut().pop();
            let mut layout = taken.unwrap_or_else(|| TierHandle::new(&pool.layout, &pool.cache));
            // SAFETY: the client's buffer stays valid until `h.tag` completes.
            unsafe {
                dedup_op(
                    io,
                    &h.dedup,
                    &pool,
                    &mut layout,
                    h.vol.layer(),
                    h.op,
                    h.tag,
                    false,
                )
            };
            self.layouts.borrow_mut().push(layout);
            return;
        }
        if ctx & WAIT_CTX != 0 {
            let i = ctx & !WAIT_CTX;
            let w = self.waiting.borrow_mut()[usize_of(i)]
                .take()
                .expect("a deferred write is retried once");
            self.waiting_free.borrow_mut().push(u32_of(i));
            let taken = self.layouts.borrow_mut().pop();
            let mut layout =
                taken.unwrap_or_else(|| TierHandle::new(&w.pool.layout, &w.pool.cache));
            // SAFETY: the client's buffer stays valid until `w.tag` completes.
            unsafe {
                write_dedup(
                    io,
                    &w.dedup,
                    &w.pool,
                    &mut layout,
                    (w.layer, w.offset, w.len, w.buf),
                    (w.tag, w.rounds + 1, false),
                )
            };
            self.layouts.borrow_mut().push(layout);
            return;
        }
        let w = self.slots.borrow_mut()[usize_of(ctx)]
            .take()
            .expect("a pending write completes once");
        self.free.borrow_mut().push(u32_of(ctx));
        let res = finish(&w, res);
        if res == MERGE_CONFLICT {
            // A block it merged was rewritten meanwhile: merge again with the new bytes.
            let again = Waiting {
                dedup: w.dedup.clone(),
                pool: w.pool.clone(),
                layer: w.layer,
                offset: w.offset,
                len: w.len,
                buf: w.buf,
                tag: parent,
                rounds: w.rounds,
            };
            let i = slab_put(&self.waiting, &self.waiting_free, again);
            io.defer_hook(self.hook.get(), WAIT_CTX | u64::from(i));
            return;
        }
        io.complete(parent, res);
    }
}

/// End a write whose data writes ended with `res`: publish it, or give its blocks back
/// ([`MERGE_CONFLICT`]: write it again).
fn finish(w: &PendingWrite, res: i32) -> i32 {
    let res = if res < 0 {
        res
    } else {
        let alloc = |o: u32, s: u32| w.pool.alloc_owned(o, s);
        match w
            .dedup
            .publish(w.layer, w.first, &w.placements, &w.merged, &alloc)
        {
            Ok(()) => {
                w.dedup.end_merge(w.layer, &w.merged);
                return 0;
            }
            Err(e) => e,
        }
    };
    w.dedup.untake(&w.placements);
    w.dedup.unshare(&w.placements);
    w.dedup.end_merge(w.layer, &w.merged);
    res
}

impl VolumeHandle {
    /// A request to a block-mapped volume (bounds, read-only and the request's token
    /// already checked and taken by `submit`).
    ///
    /// # Safety
    /// As [`IoHandle::submit`]: the request's buffer stays valid until `tag` completes.
    pub(super) unsafe fn submit_dedup(
        &mut self,
        io: &mut CoreIo,
        d: &Arc<DedupCore>,
        op: IoOp,
        tag: Tag,
    ) {
        if self.vol.held(self.epoch) && !matches!(op, IoOp::Read { .. }) {
            // A snapshot of the volume is being taken: wait for its new layer.
            let engine = core_engine::<DedupWrites>(io, &self.vol.pool);
            let h = Held {
                vol: self.vol.clone(),
                dedup: d.clone(),
                op,
                epoch: self.epoch,
                tag,
            };
            let i = slab_put(&engine.held, &engine.held_free, h);
            return io.defer_hook(engine.hook.get(), HELD_CTX | u64::from(i));
        }
        // Small and not sequential: the gain detector may skip it.
        let random = !self.layout.sequential;
        // SAFETY: our caller's contract.
        unsafe {
            dedup_op(
                io,
                d,
                &self.vol.pool,
                &mut self.layout,
                self.vol.layer(),
                op,
                tag,
                random,
            )
        }
    }
}

/// Request `op` to block-mapped `layer` (a volume's current layer) through `layout`;
/// `random`: the access-pattern detector did not call it sequential.
///
/// # Safety
/// As [`IoHandle::submit`]: the request's buffer stays valid until `tag` completes.
#[allow(clippy::too_many_arguments)]
unsafe fn dedup_op(
    io: &mut CoreIo,
    d: &Arc<DedupCore>,
    pool: &Arc<PoolCore>,
    layout: &mut TierHandle,
    layer: u32,
    op: IoOp,
    tag: Tag,
    random: bool,
) {
    match op {
        IoOp::Read { offset, len, buf } => {
            // SAFETY: our caller's contract.
            unsafe { read_dedup(io, d, layout, layer, offset, u64::from(len), buf, tag) }
        }
        IoOp::Write { offset, len, buf } => {
            // SAFETY: as above.
            unsafe {
                write_dedup(
                    io,
                    d,
                    pool,
                    layout,
                    (layer, offset, u64::from(len), buf),
                    (tag, 0, random && len <= SMALL_WRITE),
                )
            }
        }
        IoOp::Discard { offset, len } => {
            // Whole blocks only: a discard is a hint.
            let first = offset.div_ceil(DBLOCK);
            let end = (offset + len) / DBLOCK;
            let alloc = |o: u32, s: u32| pool.alloc_owned(o, s);
            let r = if end > first {
                d.clear(layer, first, end - first, &alloc)
            } else {
                Ok(())
            };
            io.complete(tag, r.err().unwrap_or(0));
        }
        IoOp::WriteZeroes { offset, len, .. } => {
            // Whole blocks become holes; the partial edges are writes of zeros,
            // merged (one at a time per block) like any partial write.
            let first_full = offset.div_ceil(DBLOCK);
            let end_full = (offset + len) / DBLOCK;
            if end_full > first_full {
                let alloc = |o: u32, s: u32| pool.alloc_owned(o, s);
                if let Err(e) = d.clear(layer, first_full, end_full - first_full, &alloc) {
                    return io.complete(tag, e);
                }
            }
            let pieces = partial_pieces(offset, len);
            if pieces.is_empty() {
                return io.complete(tag, 0);
            }
            let t = io.join(tag, u32_of(pieces.len() as u64));
            for (at, n) in pieces {
                // SAFETY: `ZEROS` is static, and each piece is at most one block.
                unsafe {
                    write_dedup(
                        io,
                        d,
                        pool,
                        layout,
                        (layer, at, n, ZEROS.as_ptr()),
                        (t, 0, false),
                    )
                }
            }
        }
        IoOp::Flush => unreachable!("handled by submit"),
    }
}

/// A read of block-mapped `layer`: runs of store blocks through `layout`, zeros for
/// holes.
///
/// # Safety
/// As [`IoHandle::submit`].
#[allow(clippy::too_many_arguments)]
unsafe fn read_dedup(
    io: &mut CoreIo,
    d: &DedupCore,
    layout: &mut TierHandle,
    layer: u32,
    offset: u64,
    len: u64,
    buf: *mut u8,
    tag: Tag,
) {
    let unit = DBLOCK * crate::dedup::store::BLOCKS_PER_UNIT;
    // Runs of (pool offset, length, offset in the buffer): the first apart, so that
    // a read of one run (every 4 KiB read) allocates nothing and needs no join.
    let mut first: Option<(u64, u64, u64)> = None;
    let mut runs: Vec<(u64, u64, u64)> = Vec::new();
    {
        let st = d.lock();
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let b = at / DBLOCK;
            let next = ((b + 1) * DBLOCK).min(end);
            let n = next - at;
            let boff = at - offset;
            match d.resolve(&st, layer, b) {
                None => {
                    // SAFETY: boff + n <= len, within the submitter's buffer.
                    unsafe { std::ptr::write_bytes(buf.add(usize_of(boff)), 0, usize_of(n)) };
                }
                Some(po) => {
                    let po = po + at % DBLOCK;
                    let last = if runs.is_empty() {
                        first.as_mut()
                    } else {
                        runs.last_mut()
                    };
                    match last {
                        Some(r)
                            if r.0 + r.1 == po && r.2 + r.1 == boff && !po.is_multiple_of(unit) =>
                        {
                            r.1 += n
                        }
                        Some(_) => runs.push((po, n, boff)),
                        None => first = Some((po, n, boff)),
                    }
                }
            }
            at = next;
        }
    }
    let Some(one) = first else {
        return io.complete(tag, 0);
    };
    let t = if runs.is_empty() {
        tag
    } else {
        io.join(tag, u32_of(runs.len() + 1))
    };
    for (po, n, boff) in std::iter::once(one).chain(runs) {
        // SAFETY: the run lies in the submitter's buffer, kept alive until `tag`
        // (which `t` completes) completes.
        unsafe {
            layout.submit(
                io,
                IoOp::Read {
                    offset: po,
                    len: u32_of(n),
                    buf: buf.add(usize_of(boff)),
                },
                t,
            )
        };
    }
}

/// The current bytes of block `vblock` of `layer` into `out` (zeros for a hole).
fn read_block(d: &DedupCore, layer: u32, vblock: u64, out: &mut [u8]) -> Result<(), i32> {
    let at = {
        let st = d.lock();
        d.resolve(&st, layer, vblock)
    };
    match at {
        None => {
            out.fill(0);
            Ok(())
        }
        Some(po) => d
            .layout
            .read_at(po, out)
            .map_err(|e| -e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

/// How to store one whole block: a hole, a shared block, or a new one (PBA taken later);
/// `None` when `wait` and the same bytes are being stored by a write in flight.
/// With `skip` (the gain detector's verdict) a non-zero block is stored without a
/// lookup.
fn place(
    d: &DedupCore,
    block: &[u8],
    scratch: &mut AlignedBuf,
    wait: bool,
    skip: bool,
) -> Option<Placement> {
    if is_zero(block) {
        return Some(Placement::Zero);
    }
    if skip {
        return Some(Placement::New(u64::MAX, UNHASHED));
    }
    let fp = Fingerprint::of(block);
    if wait && d.writing(fp.0) {
        return None;
    }
    Some(match d.share(fp, block, scratch) {
        Some(pba) => Placement::Shared(pba),
        None => Placement::New(u64::MAX, fp.0),
    })
}

/// A write of `len` bytes at `offset` of `layer` from `buf`, through `layout`; `rounds`:
/// how often it has waited for an identical block in flight so far (a retried write is
/// never skipped); `random`: a small write the access-pattern detector did not call
/// sequential, which the gain detector may skip.
///
/// # Safety
/// `buf` holds `len` bytes that stay valid and unchanged until `tag` completes.
unsafe fn write_dedup(
    io: &mut CoreIo,
    d: &Arc<DedupCore>,
    pool: &Arc<PoolCore>,
    layout: &mut TierHandle,
    (layer, offset, len, buf): (u32, u64, u64, *const u8),
    (tag, rounds, random): (Tag, u32, bool),
) {
    let engine = core_engine::<DedupWrites>(io, pool);
    // Dedup off: stored without a lookup, like a region the gain detector skips.
    let off = !d.active();
    let skip = off || (random && rounds == 0 && d.skips(layer, offset / DBLOCK));
    let first = offset / DBLOCK;
    let last = (offset + len - 1) / DBLOCK;
    let wait = |io: &mut CoreIo| {
        let w = Waiting {
            dedup: d.clone(),
            pool: pool.clone(),
            layer,
            offset,
            len,
            buf,
            tag,
            rounds,
        };
        let i = slab_put(&engine.waiting, &engine.waiting_free, w);
        io.defer_hook(engine.hook.get(), WAIT_CTX | u64::from(i));
    };
    // Partial edge blocks are merged: one write at a time per block.
    let partial = |b: u64| b * DBLOCK < offset || (b + 1) * DBLOCK > offset + len;
    let edge_blocks: Vec<u64> = [first, last]
        .into_iter()
        .enumerate()
        .filter(|&(i, b)| partial(b) && (i == 0 || b != first))
        .map(|(_, b)| b)
        .collect();
    let merged = if edge_blocks.is_empty() {
        Vec::new()
    } else {
        match d.begin_merge(layer, &edge_blocks) {
            Some(m) => m,
            None => return wait(io),
        }
    };
    // Each block's bytes: the client's, or for a partial edge block the merged block.
    let mut edges: Vec<AlignedBuf> = Vec::new();
    let mut sources: Vec<*const u8> = Vec::with_capacity(usize_of(last - first + 1));
    for b in first..=last {
        let start = b * DBLOCK;
        if start >= offset && start + DBLOCK <= offset + len {
            // SAFETY: the block lies within the submitter's buffer.
            sources.push(unsafe { buf.add(usize_of(start - offset)) });
            continue;
        }
        let mut m = AlignedBuf::zeroed(BLOCK);
        if let Err(e) = read_block(d, layer, b, &mut m.as_mut_slice()[..BLOCK]) {
            d.end_merge(layer, &merged);
            return io.complete(tag, e);
        }
        let lo = offset.max(start);
        let hi = (offset + len).min(start + DBLOCK);
        // SAFETY: [lo, hi) lies within the submitter's buffer.
        let client = unsafe {
            std::slice::from_raw_parts(buf.add(usize_of(lo - offset)), usize_of(hi - lo))
        };
        m.as_mut_slice()[usize_of(lo - start)..usize_of(hi - start)].copy_from_slice(client);
        sources.push(m.as_ptr());
        edges.push(m);
    }
    let mut placements: Vec<Placement> = Vec::with_capacity(sources.len());
    {
        let mut scratch = engine.scratch.borrow_mut();
        for &s in &sources {
            // SAFETY: each source is a whole block, in the submitter's buffer or in
            // `edges`, both alive for this call.
            let block = unsafe { std::slice::from_raw_parts(s, BLOCK) };
            match place(d, block, &mut scratch, rounds < MAX_WAITS, skip) {
                Some(p) => placements.push(p),
                None => {
                    // The same bytes are being stored: try again next round (the
                    // references taken so far go back meanwhile).
                    d.unshare(&placements);
                    d.end_merge(layer, &merged);
                    drop(scratch);
                    return wait(io);
                }
            }
        }
    }
    let count = |f: fn(&Placement) -> bool| placements.iter().filter(|p| f(p)).count() as u64;
    let fresh = count(|p| matches!(p, Placement::New(..)));
    d.counters
        .hits
        .fetch_add(count(|p| matches!(p, Placement::Shared(_))), Relaxed);
    d.counters
        .zero_blocks
        .fetch_add(count(|p| *p == Placement::Zero), Relaxed);
    d.counters.new_blocks.fetch_add(fresh, Relaxed);
    let unhashed = count(|p| matches!(p, Placement::New(_, UNHASHED)));
    if off {
        d.counters.off_blocks.fetch_add(unhashed, Relaxed);
    } else if skip {
        d.counters.skipped_blocks.fetch_add(unhashed, Relaxed);
    } else {
        let looked = count(|p| matches!(p, Placement::New(..) | Placement::Shared(_)));
        let shared = count(|p| matches!(p, Placement::Shared(_)));
        d.note_gain(layer, first, u32_of(looked), u32_of(shared));
    }
    let alloc = |o: u32, s: u32| pool.alloc_owned(o, s);
    if fresh == 0 {
        let r = d.publish(layer, first, &placements, &merged, &alloc);
        if r.is_err() {
            d.unshare(&placements);
        }
        d.end_merge(layer, &merged);
        return match r {
            Ok(()) => io.complete(tag, 0),
            Err(MERGE_CONFLICT) => wait(io),
            Err(e) => io.complete(tag, e),
        };
    }
    // Unshared blocks are overwritten where they are.
    d.claim_in_place(layer, first, &mut placements);
    let fresh = placements
        .iter()
        .filter(|p| matches!(p, Placement::New(..)))
        .count();
    if d.wants_refill() {
        pool.request_refill();
    }
    match d.take_blocks(fresh, &alloc) {
        Ok(pbas) => {
            let mut it = pbas.into_iter();
            for p in placements.iter_mut() {
                if let Placement::New(pba, _) = p {
                    *pba = it.next().expect("one per new block");
                }
            }
            d.begin_new(&placements);
        }
        Err(e) => {
            d.untake(&placements);
            d.unshare(&placements);
            d.end_merge(layer, &merged);
            return io.complete(tag, e);
        }
    }
    // Runs of new blocks: consecutive store blocks (one store unit) from consecutive
    // source bytes become one write.
    let mut runs: Vec<(u64, u64, *const u8)> = Vec::new();
    {
        let st = d.lock();
        for (i, p) in placements.iter().enumerate() {
            let (Placement::New(pba, _) | Placement::InPlace(pba, _)) = *p else {
                continue;
            };
            let po = d.pba_offset(&st, pba);
            let src = sources[i];
            match runs.last_mut() {
                Some(r)
                    if r.0 + r.1 == po
                        && r.2.wrapping_add(usize_of(r.1)) == src
                        && pba % BLOCKS_PER_UNIT != 0 =>
                {
                    r.1 += DBLOCK
                }
                _ => runs.push((po, DBLOCK, src)),
            }
        }
    }
    let w = PendingWrite {
        dedup: d.clone(),
        pool: pool.clone(),
        layer,
        first,
        placements,
        _edges: edges,
        merged,
        offset,
        len,
        buf,
        rounds,
    };
    let slot = slab_put(&engine.slots, &engine.free, w);
    let t = io.tracked(tag, u32_of(runs.len()), engine.hook.get(), u64::from(slot));
    for (po, n, src) in runs {
        // SAFETY: the bytes are the submitter's (alive until `tag` completes, which waits
        // for `t`) or an edge block the pending write holds until then.
        unsafe {
            layout.submit(
                io,
                IoOp::Write {
                    offset: po,
                    len: u32_of(n),
                    buf: src,
                },
                t,
            )
        };
    }
}

/// The bytes of a zeroed part of a block (a write-zeroes' partial edges are written
/// from here).
static ZEROS: [u8; BLOCK] = [0; BLOCK];

/// The partial edge blocks of `len` bytes at `offset`, as (offset, length) pieces.
fn partial_pieces(offset: u64, len: u64) -> Vec<(u64, u64)> {
    let end = offset + len;
    let (fb, lb) = (offset / DBLOCK, (end - 1) / DBLOCK);
    let partial = |b: u64| b * DBLOCK < offset || (b + 1) * DBLOCK > end;
    if fb == lb {
        return if partial(fb) {
            vec![(offset, len)]
        } else {
            Vec::new()
        };
    }
    let mut v = Vec::new();
    if partial(fb) {
        v.push((offset, (fb + 1) * DBLOCK - offset));
    }
    if partial(lb) {
        v.push((lb * DBLOCK, end - lb * DBLOCK));
    }
    v
}
