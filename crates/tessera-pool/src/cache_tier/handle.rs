//! The cache tier's per-core datapath: [`TierHandle`] stands where a volume handle used
//! to hold its pool's layout handle, and sends each piece of a request (split at 1 MiB
//! cache units) to the cache, the pool's devices or both, as `CacheTier`'s plans say.
//!
//! Follow-up steps (a fill after a read miss, a read retried on the pool's devices after
//! the cache failed) are queued and submitted from a deferred call of the core's hook,
//! never from inside a completion: a completion may arrive while a handle of this core
//! is in the middle of a submission.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::{Arc, Weak};

use tessera_io::buf::AlignedBuf;
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::{Continuation, CoreIo, IoHandle, IoOp, Tag};

use super::CacheSlot;
use super::{CacheTier, ReadPlan, WritePlan, BLOCK_SHIFT};
use crate::layout::{Layout, LayoutHandle};

/// The pool's layout handle, and the pool's cache tier's when it has one.
pub struct TierHandle {
    backing: LayoutHandle,
    layout: Arc<Layout>,
    slot: Arc<CacheSlot>,
    /// `CacheSlot::gen` when `cache` was looked up.
    gen: u64,
    /// Boxed: a handle without a cache stays small (replica legs hold handles by value).
    cache: Option<Box<CacheSide>>,
    /// The access-pattern detector called the request being submitted sequential: it
    /// is not admitted to the cache (a stream is read once).
    pub(crate) sequential: bool,
}

struct CacheSide {
    tier: Arc<CacheTier>,
    handle: LayoutHandle,
    hook: Rc<CacheHook>,
}

impl TierHandle {
    pub(crate) fn new(layout: &Arc<Layout>, slot: &Arc<CacheSlot>) -> TierHandle {
        TierHandle {
            backing: layout.open_handle(),
            layout: layout.clone(),
            slot: slot.clone(),
            gen: u64::MAX,
            cache: None,
            sequential: false,
        }
    }

    /// Pick up a cache attached or detached since the last request.
    #[inline]
    fn refresh(&mut self, io: &mut CoreIo) {
        let g = self.slot.gen.load(Acquire);
        if g != self.gen {
            self.gen = g;
            self.cache = self.slot.get().map(|tier| {
                Box::new(CacheSide {
                    handle: tier.layout.open_handle(),
                    hook: CacheHook::for_core(io, &tier, &self.layout, &self.slot),
                    tier,
                })
            });
        }
    }

    /// One piece of a request, inside one cache unit.
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn submit_piece(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let Some(side) = self.cache.as_mut() else {
            // SAFETY: our caller upholds the contract.
            return unsafe { self.backing.submit(io, op, tag) };
        };
        let tier = &side.tier;
        let c = &tier.counters;
        let (shift, mask) = (tier.unit_shift, tier.unit_mask());
        match op {
            IoOp::Read { offset, len, buf } => {
                let key = offset >> shift;
                let (b0, b1) = blocks_touched(offset & mask, u64::from(len));
                match tier.plan_read(key, b0, b1, self.sequential) {
                    ReadPlan::Hit { slot } => {
                        c.read_hits.fetch_add(1, Relaxed);
                        c.read_hit_bytes.fetch_add(u64::from(len), Relaxed);
                        let (shard, local) = slot_parts(tier, key, slot);
                        let at = tier.slot_offset(shard, local) + (offset & mask);
                        let ctx = side.hook.push(Op::Hit {
                            key,
                            slot,
                            parent: tag,
                            offset,
                            len,
                            buf,
                        });
                        let t = io.tracked(Tag::NO_PARENT, 1, side.hook.id.get(), ctx);
                        let op = IoOp::Read {
                            offset: at,
                            len,
                            buf,
                        };
                        // SAFETY: `buf` is the caller's, alive until `tag` completes, which
                        // happens only after this read ended (`CacheHook::on_done`).
                        unsafe { side.handle.submit(io, op, t) }
                    }
                    ReadPlan::Fill { slot } => {
                        c.read_misses.fetch_add(1, Relaxed);
                        c.read_miss_bytes.fetch_add(u64::from(len), Relaxed);
                        let ctx = side.hook.push(Op::Miss {
                            key,
                            slot,
                            claimed: (b0, b1),
                            parent: tag,
                            offset,
                            len,
                            buf,
                        });
                        let t = io.tracked(Tag::NO_PARENT, 1, side.hook.id.get(), ctx);
                        // SAFETY: as above.
                        unsafe { self.backing.submit(io, op, t) }
                    }
                    ReadPlan::Mixed { slot, valid } => {
                        c.read_hits.fetch_add(1, Relaxed);
                        c.read_hit_bytes.fetch_add(u64::from(len), Relaxed);
                        let (shard, local) = slot_parts(tier, key, slot);
                        let slot_at = tier.slot_offset(shard, local);
                        let runs = mixed_runs(offset & mask, u64::from(len), valid);
                        let ctx = side.hook.push(Op::Mixed {
                            key,
                            slot,
                            parent: tag,
                            left: u32_of(runs.len()),
                            res: 0,
                        });
                        let id = side.hook.id.get();
                        let base = offset & !mask;
                        for (from_cache, at, n) in runs {
                            let t = io.tracked(Tag::NO_PARENT, 1, id, ctx);
                            let skip = usize_of(at - (offset & mask));
                            // SAFETY: `at..at + n` lies inside the request's range.
                            let b = unsafe { buf.add(skip) };
                            let len = u32_of(n);
                            // SAFETY: the caller's buffer stays alive until `tag`
                            // completes, after every part ended (`Op::Mixed`).
                            unsafe {
                                if from_cache {
                                    let op = IoOp::Read {
                                        offset: slot_at + at,
                                        len,
                                        buf: b,
                                    };
                                    side.handle.submit(io, op, t)
                                } else {
                                    let op = IoOp::Read {
                                        offset: base + at,
                                        len,
                                        buf: b,
                                    };
                                    self.backing.submit(io, op, t)
                                }
                            }
                        }
                    }
                    ReadPlan::Backing => {
                        c.read_misses.fetch_add(1, Relaxed);
                        c.read_miss_bytes.fetch_add(u64::from(len), Relaxed);
                        if self.sequential {
                            c.bypassed_bytes.fetch_add(u64::from(len), Relaxed);
                        }
                        // SAFETY: our caller upholds the contract.
                        unsafe { self.backing.submit(io, op, tag) }
                    }
                }
            }
            IoOp::Write { offset, len, buf } => {
                let key = offset >> shift;
                let touch = blocks_touched(offset & mask, u64::from(len));
                let full = blocks_whole(offset & mask, u64::from(len));
                if self.sequential {
                    c.bypassed_bytes.fetch_add(u64::from(len), Relaxed);
                }
                match tier.plan_write(key, touch, full, self.sequential) {
                    WritePlan::Both { slot } => {
                        let (b0, b1) = full.expect("planned with whole blocks");
                        let (shard, local) = slot_parts(tier, key, slot);
                        let unit_off = offset & mask;
                        let skip = (b0 << BLOCK_SHIFT) - unit_off;
                        let clen = (b1 - b0 + 1) << BLOCK_SHIFT;
                        let ctx = side.hook.push(Op::Both {
                            key,
                            slot,
                            blocks: (b0, b1),
                            parent: tag,
                            left: 2,
                            backing_res: 0,
                            cache_ok: true,
                        });
                        let id = side.hook.id.get();
                        let tb = io.tracked(Tag::NO_PARENT, 1, id, ctx);
                        let tc = io.tracked(Tag::NO_PARENT, 1, id, ctx | CACHE_PART);
                        let cop = IoOp::Write {
                            offset: tier.slot_offset(shard, local) + (b0 << BLOCK_SHIFT),
                            len: u32_of(clen),
                            // SAFETY: the whole blocks lie inside the caller's buffer.
                            buf: unsafe { buf.add(usize_of(skip)) },
                        };
                        // SAFETY: the caller's buffer stays alive until `tag` completes,
                        // after both writes ended.
                        unsafe {
                            self.backing.submit(io, op, tb);
                            side.handle.submit(io, cop, tc);
                        }
                    }
                    WritePlan::Back { slot } => {
                        let (b0, b1) = full.expect("planned with whole blocks");
                        let (shard, local) = slot_parts(tier, key, slot);
                        let ctx = side.hook.push(Op::Back {
                            key,
                            slot,
                            blocks: (b0, b1),
                            parent: tag,
                            buf,
                            recorded: false,
                        });
                        let t = io.tracked(Tag::NO_PARENT, 1, side.hook.id.get(), ctx);
                        let cop = IoOp::Write {
                            offset: tier.slot_offset(shard, local) + (b0 << BLOCK_SHIFT),
                            len,
                            buf,
                        };
                        // SAFETY: the caller's buffer stays alive until `tag` completes,
                        // after the write and its record.
                        unsafe { side.handle.submit(io, cop, t) }
                    }
                    WritePlan::Busy => {
                        // SAFETY: as above.
                        unsafe { side.hook.wait(io, op, tag) }
                    }
                    WritePlan::Backing => {
                        // SAFETY: as above.
                        unsafe { self.submit_around(io, op, offset, u64::from(len), tag) }
                    }
                }
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                if tier.wb_active() && tier.holds(offset, len) {
                    // SAFETY: no buffer.
                    return unsafe { side.hook.wait(io, op, tag) };
                }
                tier.invalidate(offset, len);
                // SAFETY: no buffer.
                unsafe { self.submit_around(io, op, offset, len, tag) }
            }
            // SAFETY: no buffer.
            IoOp::Flush => unsafe { self.backing.submit(io, op, tag) },
        }
    }

    /// Whether requests use a cache tier now (readahead goes into it).
    #[inline]
    pub(crate) fn caching(&self) -> bool {
        self.cache.as_ref().is_some_and(|s| !s.tier.bypassed())
    }

    /// Read `[offset, offset + len)` of the pool into the cache, ahead of a stream: every
    /// cache unit in it that is not cached whole and not being written is read from the
    /// pool's devices whole, then filled like a miss. Nothing waits for it.
    pub(crate) fn prefetch(&mut self, io: &mut CoreIo, offset: u64, len: u64) {
        let Some(side) = self.cache.as_mut() else {
            return;
        };
        let tier = &side.tier;
        let shift = tier.unit_shift;
        let unit = 1u64 << shift;
        let blocks = (unit >> BLOCK_SHIFT) - 1;
        let mut key = offset >> shift;
        while key << shift < offset + len {
            if let Some(slot) = tier.plan_prefetch(key) {
                let (shard, _) = tier.shard_of(key);
                let mut data = AlignedBuf::zeroed(usize_of(unit));
                let buf = data.as_mut_ptr();
                let ctx = side.hook.push(Op::Ahead {
                    key,
                    slot,
                    blocks: (0, blocks),
                    at: tier.slot_offset(shard, slot),
                    data,
                });
                let t = io.tracked(Tag::NO_PARENT, 1, side.hook.id.get(), ctx);
                let op = IoOp::Read {
                    offset: key << shift,
                    len: u32_of(unit),
                    buf,
                };
                // SAFETY: the buffer is the operation's own, kept in the hook's table
                // until the operation ends (moving the `AlignedBuf` does not move its
                // heap allocation).
                unsafe { self.backing.submit(io, op, t) };
            }
            key += 1;
        }
    }

    /// A request to a pool whose write-back tier failed with dirty data: reads of lost
    /// blocks fail, as do writes that cover one only in part; the rest go to the pool's
    /// devices, and a write heals the lost blocks it covers whole when it ends.
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn submit_lost(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let side = self.cache.as_ref().expect("called with a cache");
        let (offset, len, read) = match op {
            IoOp::Read { offset, len, .. } => (offset, u64::from(len), true),
            IoOp::Write { offset, len, .. } => (offset, u64::from(len), false),
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                (offset, len, false)
            }
            // SAFETY: no buffer.
            IoOp::Flush => return unsafe { self.backing.submit(io, op, tag) },
        };
        if side.tier.lost_conflict(offset, len, read) {
            return io.complete(tag, -libc::EIO);
        }
        if read {
            // SAFETY: our caller upholds the contract.
            return unsafe { self.backing.submit(io, op, tag) };
        }
        // SAFETY: our caller upholds the contract.
        unsafe { self.submit_around(io, op, offset, len, tag) }
    }

    /// A change that goes to the pool's devices only: what the cache holds of the range
    /// is invalidated again when it ends (a fill that read the old bytes meanwhile must
    /// not validate them).
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn submit_around(&mut self, io: &mut CoreIo, op: IoOp, offset: u64, len: u64, tag: Tag) {
        let side = self.cache.as_ref().expect("called with a cache");
        let ctx = side.hook.push(Op::Around {
            offset,
            len,
            parent: tag,
        });
        let t = io.tracked(Tag::NO_PARENT, 1, side.hook.id.get(), ctx);
        // SAFETY: our caller upholds the contract.
        unsafe { self.backing.submit(io, op, t) }
    }
}

/// The parts of a read of `len` bytes at `u` in its unit: runs of blocks the slot holds
/// (`valid`) and runs it does not, as (from the cache, offset in the unit, bytes).
fn mixed_runs(u: u64, len: u64, valid: super::Blocks) -> Vec<(bool, u64, u64)> {
    let bsize = 1u64 << BLOCK_SHIFT;
    let end = u + len;
    let mut runs: Vec<(bool, u64, u64)> = Vec::new();
    let mut at = u;
    while at < end {
        let b = at >> BLOCK_SHIFT;
        let next = ((b + 1) * bsize).min(end);
        let cached = valid[usize_of(b / 64)] >> (b % 64) & 1 == 1;
        match runs.last_mut() {
            Some((c, _, n)) if *c == cached => *n += next - at,
            _ => runs.push((cached, at, next - at)),
        }
        at = next;
    }
    runs
}

/// The blocks a range at `u` in its unit touches.
fn blocks_touched(u: u64, len: u64) -> (u64, u64) {
    (u >> BLOCK_SHIFT, (u + len.max(1) - 1) >> BLOCK_SHIFT)
}

/// The blocks a range at `u` in its unit covers whole, if any.
fn blocks_whole(u: u64, len: u64) -> Option<(u64, u64)> {
    let b0 = u.div_ceil(1 << BLOCK_SHIFT);
    let end = (u + len) >> BLOCK_SHIFT;
    (end > b0).then(|| (b0, end - 1))
}

fn slot_parts(tier: &CacheTier, key: u64, slot: u32) -> (usize, u32) {
    (tier.shard_of(key).0, slot)
}

impl IoHandle for TierHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        self.refresh(io);
        if self.slot.lost.load(Relaxed) {
            // A write-back cache that could not be opened: any unit may have data there.
            return io.complete(tag, -libc::EIO);
        }
        let bypass = self.cache.as_ref().is_none_or(|s| s.tier.bypassed());
        if bypass {
            if self.cache.as_ref().is_some_and(|s| s.tier.lost()) {
                // SAFETY: our caller upholds the contract.
                return unsafe { self.submit_lost(io, op, tag) };
            }
            // SAFETY: our caller upholds the contract.
            return unsafe { self.backing.submit(io, op, tag) };
        }
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, u64::from(len))
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            // SAFETY: no buffer.
            IoOp::Flush => return unsafe { self.backing.submit(io, op, tag) },
        };
        let shift = self.cache.as_ref().map_or(20, |s| s.tier.unit_shift);
        let first = offset >> shift;
        let last = (offset + len.max(1) - 1) >> shift;
        if first == last || matches!(op, IoOp::Discard { .. } | IoOp::WriteZeroes { .. }) {
            // SAFETY: our caller upholds the contract.
            return unsafe { self.submit_piece(io, op, tag) };
        }
        let t = io.join(tag, u32_of(last - first + 1));
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let seg = (((at >> shift) + 1) << shift).min(end) - at;
            let skip = usize_of(at - offset);
            let piece = match op {
                IoOp::Read { buf, .. } => IoOp::Read {
                    offset: at,
                    len: u32_of(seg),
                    // SAFETY: inside the caller's buffer.
                    buf: unsafe { buf.add(skip) },
                },
                IoOp::Write { buf, .. } => IoOp::Write {
                    offset: at,
                    len: u32_of(seg),
                    // SAFETY: inside the caller's buffer.
                    buf: unsafe { buf.add(skip) },
                },
                _ => unreachable!("split only reads and writes"),
            };
            // SAFETY: each piece is a sub-range of the caller's buffer.
            unsafe { self.submit_piece(io, piece, t) };
            at += seg;
        }
    }

    fn size(&self) -> u64 {
        self.backing.size()
    }
}

/// Marks an operation's second part (the cache side of a write to both tiers).
const CACHE_PART: u64 = 1 << 32;
/// The deferred call that submits queued follow-up steps.
const DRAIN: u64 = u64::MAX;
/// How long a request that waits for the cleaner pauses before it is planned again.
const WAIT: std::time::Duration = std::time::Duration::from_micros(200);

/// A cache operation in flight on a core.
enum Op {
    Free,
    /// A read of a slot; falls back to the pool's devices if it fails.
    Hit {
        key: u64,
        slot: u32,
        parent: Tag,
        offset: u64,
        len: u32,
        buf: *mut u8,
    },
    /// A read of the pool's devices whose blocks (claimed) then fill the slot.
    Miss {
        key: u64,
        slot: u32,
        claimed: (u64, u64),
        parent: Tag,
        offset: u64,
        len: u32,
        buf: *mut u8,
    },
    /// Writing what a miss read into the slot: the client already has its data.
    Fill {
        key: u64,
        slot: u32,
        claimed: (u64, u64),
        /// The whole blocks of the read, which are written.
        blocks: (u64, u64),
        at: u64,
        data: AlignedBuf,
        submitted: bool,
        /// A readahead's (its buffer counts against the tier's budget).
        ahead: bool,
    },
    /// A write going to both tiers.
    Both {
        key: u64,
        slot: u32,
        /// Claimed and written.
        blocks: (u64, u64),
        parent: Tag,
        left: u8,
        backing_res: i32,
        cache_ok: bool,
    },
    /// A change to the pool's devices only.
    Around {
        offset: u64,
        len: u64,
        parent: Tag,
    },
    /// Readahead: a whole unit read from the pool's devices into `data`, which then
    /// fills the (claimed) slot.
    Ahead {
        key: u64,
        slot: u32,
        blocks: (u64, u64),
        at: u64,
        data: AlignedBuf,
    },
    /// A write-back write: its whole blocks go to the slot, then the slot's record is
    /// written (`recorded` from then), then the client is answered.
    Back {
        key: u64,
        slot: u32,
        blocks: (u64, u64),
        parent: Tag,
        /// The client's bytes (alive until `parent` completes).
        buf: *const u8,
        recorded: bool,
    },
    /// A read whose parts come from the slot (pinned) and from the pool's devices.
    Mixed {
        key: u64,
        slot: u32,
        parent: Tag,
        left: u32,
        res: i32,
    },
    /// A request that waits for the cleaner (write-back rules): submitted again after a
    /// short pause.
    Wait {
        op: IoOp,
        parent: Tag,
        due: bool,
    },
    /// A read of the pool's devices after the cache failed it.
    Retry {
        parent: Tag,
        offset: u64,
        len: u32,
        buf: *mut u8,
        submitted: bool,
    },
}

/// One per (core, tier): the continuation of the core's cache operations.
struct CacheHook {
    tier: Weak<CacheTier>,
    id: Cell<u32>,
    ops: RefCell<Vec<Op>>,
    free: RefCell<Vec<u32>>,
    /// Operations whose next step is to be submitted (`DRAIN`).
    queue: RefCell<VecDeque<u32>>,
    /// Handles for the queued steps: the cache's and the pool's (made when needed).
    handles: RefCell<Option<(LayoutHandle, LayoutHandle)>>,
    backing: Weak<Layout>,
    /// Where waiting requests are submitted again (made when needed).
    again: RefCell<Option<TierHandle>>,
    slot: Weak<CacheSlot>,
}

impl CacheHook {
    fn for_core(
        io: &mut CoreIo,
        tier: &Arc<CacheTier>,
        backing: &Arc<Layout>,
        slot: &Arc<CacheSlot>,
    ) -> Rc<CacheHook> {
        let key = Arc::as_ptr(tier) as usize ^ 0x6361_6368;
        let known = io
            .locals
            .get(&key)
            .and_then(|b| b.downcast_ref::<Rc<CacheHook>>())
            .filter(|h| std::ptr::eq(h.tier.as_ptr(), Arc::as_ptr(tier)))
            .filter(|h| h.tier.strong_count() > 0)
            .cloned();
        if let Some(h) = known {
            return h;
        }
        let h = Rc::new(CacheHook {
            tier: Arc::downgrade(tier),
            id: Cell::new(0),
            ops: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            queue: RefCell::new(VecDeque::new()),
            handles: RefCell::new(None),
            backing: Arc::downgrade(backing),
            again: RefCell::new(None),
            slot: Arc::downgrade(slot),
        });
        h.id.set(io.register_hook(h.clone()));
        if let Some(old) = io.locals.insert(key, Box::new(h.clone())) {
            if let Ok(old) = old.downcast::<Rc<CacheHook>>() {
                io.release_hook(old.id.get());
            }
        }
        h
    }

    fn push(&self, op: Op) -> u64 {
        let mut ops = self.ops.borrow_mut();
        match self.free.borrow_mut().pop() {
            Some(i) => {
                ops[i as usize] = op;
                u64::from(i)
            }
            None => {
                ops.push(op);
                (ops.len() - 1) as u64
            }
        }
    }

    /// Park `op` (of request `parent`) for a short while, then submit it again.
    ///
    /// # Safety
    /// As [`IoHandle::submit`]: `op`'s buffer stays alive until `parent` completes.
    unsafe fn wait(&self, io: &mut CoreIo, op: IoOp, parent: Tag) {
        let ctx = self.push(Op::Wait {
            op,
            parent,
            due: false,
        });
        let t = io.tracked(Tag::NO_PARENT, 1, self.id.get(), ctx);
        io.complete_after(WAIT, t, 0);
    }

    fn take(&self, i: u32) -> Op {
        let op = std::mem::replace(&mut self.ops.borrow_mut()[i as usize], Op::Free);
        self.free.borrow_mut().push(i);
        op
    }

    /// Queue operation `i`'s next step; the first one queued schedules the drain.
    fn enqueue(&self, io: &mut CoreIo, i: u32) {
        let mut q = self.queue.borrow_mut();
        if q.is_empty() {
            io.defer_hook(self.id.get(), DRAIN);
        }
        q.push_back(i);
    }

    fn drain(&self, io: &mut CoreIo) {
        let Some(tier) = self.tier.upgrade() else {
            self.fail_queued(io);
            return;
        };
        let Some(backing) = self.backing.upgrade() else {
            self.fail_queued(io);
            return;
        };
        loop {
            let Some(i) = self.queue.borrow_mut().pop_front() else {
                break;
            };
            if matches!(self.ops.borrow()[i as usize], Op::Wait { .. }) {
                let Op::Wait { op, parent, .. } = self.take(i) else {
                    unreachable!("checked")
                };
                let mut again = self.again.borrow_mut();
                if again.is_none() {
                    match self.slot.upgrade() {
                        Some(slot) => *again = Some(TierHandle::new(&backing, &slot)),
                        None => {
                            io.complete(parent, -libc::ESHUTDOWN);
                            continue;
                        }
                    }
                }
                let h = again.as_mut().expect("made above");
                // SAFETY: the request's buffer is alive until `parent` completes.
                unsafe { h.submit(io, op, parent) };
                continue;
            }
            let step = {
                let mut ops = self.ops.borrow_mut();
                match &mut ops[i as usize] {
                    Op::Fill {
                        at,
                        data,
                        blocks,
                        submitted,
                        ..
                    } => {
                        *submitted = true;
                        Some((
                            true,
                            IoOp::Write {
                                offset: *at,
                                len: u32_of(((blocks.1 - blocks.0) + 1) << BLOCK_SHIFT),
                                buf: data.as_ptr(),
                            },
                        ))
                    }
                    Op::Retry {
                        offset,
                        len,
                        buf,
                        submitted,
                        ..
                    } => {
                        *submitted = true;
                        Some((
                            false,
                            IoOp::Read {
                                offset: *offset,
                                len: *len,
                                buf: *buf,
                            },
                        ))
                    }
                    _ => None,
                }
            };
            let Some((to_cache, op)) = step else { continue };
            let mut hs = self.handles.borrow_mut();
            let (ch, bh) =
                hs.get_or_insert_with(|| (tier.layout.open_handle(), backing.open_handle()));
            let t = io.tracked(Tag::NO_PARENT, 1, self.id.get(), u64::from(i));
            // SAFETY: a fill's buffer is the operation's own (kept in `ops` until it
            // ends); a retry's is the client's, whose request completes only when the
            // retry ended.
            unsafe {
                if to_cache {
                    ch.submit(io, op, t)
                } else {
                    bh.submit(io, op, t)
                }
            }
        }
        if tier.detached.load(Relaxed) {
            // Let the cache devices go once this tier is gone.
            self.handles.borrow_mut().take();
        }
    }

    /// The tier or the pool went away with steps queued: retries fail, fills are dropped.
    fn fail_queued(&self, io: &mut CoreIo) {
        let queued: Vec<u32> = self.queue.borrow_mut().drain(..).collect();
        for i in queued {
            if let Op::Retry { parent, .. } | Op::Wait { parent, .. } = self.take(i) {
                io.complete(parent, -libc::EIO);
            }
        }
    }
}

impl Continuation for CacheHook {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        if ctx == DRAIN {
            return self.drain(io);
        }
        let mut res = res;
        let i = u32_of(ctx & (CACHE_PART - 1));
        let cache_part = ctx & CACHE_PART != 0;
        let tier = self.tier.upgrade();
        let mut ops = self.ops.borrow_mut();
        match &mut ops[i as usize] {
            Op::Both {
                left,
                backing_res,
                cache_ok,
                ..
            } => {
                if cache_part {
                    *cache_ok = res >= 0;
                } else {
                    *backing_res = res;
                }
                *left -= 1;
                if *left > 0 {
                    return;
                }
            }
            Op::Wait { due, .. } => {
                *due = true;
                drop(ops);
                self.enqueue(io, i);
                return;
            }
            Op::Mixed { left, res: r, .. } => {
                if res < 0 && *r == 0 {
                    *r = res;
                }
                *left -= 1;
                if *left > 0 {
                    return;
                }
                res = *r;
            }
            Op::Back {
                key,
                slot,
                blocks,
                buf,
                recorded,
                ..
            } if !*recorded && res >= 0 => {
                let (key, slot, blocks, buf) = (*key, *slot, *blocks, *buf);
                let bsize = 1usize << BLOCK_SHIFT;
                let crcs: Vec<u32> = (0..usize_of(blocks.1 - blocks.0 + 1))
                    .map(|k| {
                        // SAFETY: the client's bytes, `blocks` whole blocks of them, are
                        // alive until its request completes, which has not happened.
                        let b = unsafe { std::slice::from_raw_parts(buf.add(k * bsize), bsize) };
                        crate::format::crc(b)
                    })
                    .collect();
                let noted = tier
                    .as_ref()
                    .and_then(|t| t.note_dirty(key, slot, blocks, &crcs));
                if let (Some(g), Some(t)) = (noted, &tier) {
                    if let Some(rc) = io.remote_completer() {
                        *recorded = true;
                        drop(ops);
                        let tt = io.tracked(Tag::NO_PARENT, 1, self.id.get(), u64::from(i));
                        t.request_record(g, Some((rc, tt)));
                        return;
                    }
                    // A core without a mailbox (a tool or test driving its own): the
                    // record is written here.
                    if t.write_records_of(&[g], false).is_err() {
                        t.fail();
                        res = -libc::EIO;
                    }
                }
            }
            Op::Miss { .. } if res >= 0 => {
                // The client's data is in: copy the whole blocks for the fill, answer the
                // client, and queue the fill.
                let Op::Miss {
                    key,
                    slot,
                    claimed,
                    parent,
                    offset,
                    len,
                    buf,
                } = std::mem::replace(&mut ops[i as usize], Op::Free)
                else {
                    unreachable!()
                };
                let whole = tier
                    .as_ref()
                    .and_then(|t| blocks_whole(offset & t.unit_mask(), u64::from(len)));
                match whole {
                    Some((b0, b1)) if tier.is_some() => {
                        let tier = tier.expect("checked");
                        let unit_off = offset & tier.unit_mask();
                        let skip = usize_of((b0 << BLOCK_SHIFT) - unit_off);
                        let n = usize_of((b1 - b0 + 1) << BLOCK_SHIFT);
                        let mut data = AlignedBuf::zeroed(n);
                        // SAFETY: the read filled `len` bytes at `buf`, and the whole
                        // blocks lie inside them; the client's request has not completed.
                        let src = unsafe { std::slice::from_raw_parts(buf.add(skip), n) };
                        data.as_mut_slice()[..n].copy_from_slice(src);
                        let (shard, _) = tier.shard_of(key);
                        ops[i as usize] = Op::Fill {
                            key,
                            slot,
                            claimed,
                            blocks: (b0, b1),
                            at: tier.slot_offset(shard, slot) + (b0 << BLOCK_SHIFT),
                            data,
                            submitted: false,
                            ahead: false,
                        };
                        drop(ops);
                        self.enqueue(io, i);
                    }
                    _ => {
                        drop(ops);
                        self.take(i);
                        if let Some(t) = &tier {
                            t.end_write(key, slot, claimed, None);
                        }
                    }
                }
                io.complete(parent, 0);
                return;
            }
            Op::Ahead { .. } if res >= 0 => {
                let Op::Ahead {
                    key,
                    slot,
                    blocks,
                    at,
                    data,
                } = std::mem::replace(&mut ops[i as usize], Op::Free)
                else {
                    unreachable!()
                };
                if let Some(t) = &tier {
                    t.counters
                        .prefetch_bytes
                        .fetch_add((blocks.1 + 1) << BLOCK_SHIFT, Relaxed);
                }
                ops[i as usize] = Op::Fill {
                    key,
                    slot,
                    claimed: blocks,
                    blocks,
                    at,
                    data,
                    submitted: false,
                    ahead: true,
                };
                drop(ops);
                self.enqueue(io, i);
                return;
            }
            Op::Hit { .. } if res < 0 => {
                let Op::Hit {
                    key,
                    slot,
                    parent,
                    offset,
                    len,
                    buf,
                } = std::mem::replace(&mut ops[i as usize], Op::Free)
                else {
                    unreachable!()
                };
                if let Some(t) = &tier {
                    t.end_hit(key, slot);
                    t.fail();
                    if t.lost() && t.lost_conflict(offset, u64::from(len), true) {
                        // Write-back data that only the cache had: the pool's devices
                        // have older bytes, which must not be served.
                        drop(ops);
                        self.take(i);
                        io.complete(parent, -libc::EIO);
                        return;
                    }
                }
                ops[i as usize] = Op::Retry {
                    parent,
                    offset,
                    len,
                    buf,
                    submitted: false,
                };
                drop(ops);
                self.enqueue(io, i);
                return;
            }
            _ => {}
        }
        drop(ops);
        match self.take(i) {
            Op::Hit {
                key, slot, parent, ..
            } => {
                if let Some(t) = &tier {
                    t.end_hit(key, slot);
                }
                io.complete(parent, res);
            }
            Op::Miss {
                key,
                slot,
                claimed,
                parent,
                ..
            } => {
                if let Some(t) = &tier {
                    t.end_write(key, slot, claimed, None);
                }
                io.complete(parent, res);
            }
            Op::Fill {
                key,
                slot,
                claimed,
                blocks,
                data,
                ahead,
                ..
            } => {
                if let Some(t) = &tier {
                    if ahead {
                        t.end_prefetch();
                    }
                    t.end_write(key, slot, claimed, (res >= 0).then_some(blocks));
                    if res < 0 {
                        t.fail();
                    } else {
                        drop(data);
                        t.counters
                            .fill_bytes
                            .fetch_add((blocks.1 - blocks.0 + 1) << BLOCK_SHIFT, Relaxed);
                    }
                }
            }
            Op::Both {
                key,
                slot,
                blocks,
                parent,
                backing_res,
                cache_ok,
                ..
            } => {
                if let Some(t) = &tier {
                    let ok = cache_ok && backing_res >= 0;
                    t.end_write(key, slot, blocks, ok.then_some(blocks));
                    if !cache_ok {
                        t.fail();
                    }
                }
                io.complete(parent, backing_res);
            }
            Op::Around {
                offset,
                len,
                parent,
            } => {
                if let Some(t) = &tier {
                    t.invalidate(offset, len);
                    if t.lost() && res >= 0 {
                        t.heal(offset, len);
                    }
                }
                io.complete(parent, res);
            }
            Op::Back {
                key,
                slot,
                blocks,
                parent,
                recorded,
                ..
            } => {
                if let Some(t) = &tier {
                    if res < 0 && !recorded {
                        // The cache devices refused the data.
                        t.fail();
                    }
                    t.end_back(key, slot, blocks, res >= 0);
                }
                io.complete(parent, res.min(0));
            }
            Op::Wait { parent, .. } => io.complete(parent, -libc::EIO),
            Op::Mixed {
                key, slot, parent, ..
            } => {
                if let Some(t) = &tier {
                    t.end_hit(key, slot);
                    if res < 0 {
                        // A part failed: the cache's (the pool's devices do not have
                        // those bytes) or the pool's; either way the read fails.
                        t.counters.errors.fetch_add(1, Relaxed);
                    }
                }
                io.complete(parent, res);
            }
            Op::Retry { parent, .. } => io.complete(parent, res),
            // A readahead whose read failed: nothing waits for it.
            Op::Ahead {
                key, slot, blocks, ..
            } => {
                if let Some(t) = &tier {
                    t.end_prefetch();
                    t.end_write(key, slot, blocks, None);
                }
            }
            Op::Free => {}
        }
    }
}
