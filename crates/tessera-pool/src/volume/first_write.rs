//! The per-core datapath of first writes into shared units (docs/architecture.md
//! "Snapshots"): the write into a block that a volume of a chain does not own yet.
//!
//! The decision is taken under the pool lock and touches metadata only
//! (`PoolCore::plan_first_write`: allocate the partial unit, claim the absent blocks);
//! the data then goes through the layout's ordinary asynchronous datapath, like any
//! write: for a write that covers its blocks whole, the client's buffer is written
//! straight into the new unit; for the blocks it covers in part, the rest of each block
//! is first read from the chain into a core-local buffer. When the writes complete,
//! `PoolCore::finish_first_write` marks the blocks present (and journals it), so a
//! reader on any core goes on reading the parent's block until the whole new block is
//! on the devices, and never sees it half written. A second write into a claimed block
//! (another connection or core) is retried in the next round until the first one is
//! done, so the later merge starts from the settled block and no bytes are lost.
//!
//! Nothing here blocks the reactor or holds the pool lock during I/O, so parity layouts
//! (whose writes may wait for a row lock this very core's I/O holds) take it too.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use tessera_io::cast::{u32_of, usize_of};
use tessera_io::{Continuation, CoreIo, IoHandle, IoOp, Tag};

use super::{Volume, HOLE};
use crate::cache_tier::TierHandle;
use crate::core_engine::CoreEngine;
use crate::pool::PoolCore;
use crate::pool::{BlockRun, ChainRead, FirstWritePlan};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a block another first write holds: plan again.
    Retry,
    /// Reading the chain's parts of partly written blocks.
    Reading,
    /// Writing the blocks into the volume's unit.
    Writing,
}

/// One first write in flight (a slot of `FirstWrites::slots`; reused).
struct Slot {
    vol: Option<Arc<Volume>>,
    parent: Tag,
    unit: u64,
    at: u64,
    len: u64,
    /// The client's bytes (`len` of them, alive until `parent` completes), or null for
    /// zeros (write-zeroes).
    data: *const u8,
    /// The request's token (`inflight`): while the volume is held for a snapshot, a
    /// write that began after the snapshot did waits.
    epoch: u64,
    p: u32,
    layer: u32,
    phase: Phase,
    runs: Vec<BlockRun>,
    reads: Vec<ChainRead>,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            vol: None,
            parent: Tag::NO_PARENT,
            unit: 0,
            at: 0,
            len: 0,
            data: std::ptr::null(),
            epoch: 0,
            p: HOLE,
            layer: 0,
            phase: Phase::Retry,
            runs: Vec::new(),
            reads: Vec::new(),
        }
    }
}

/// The first-write engine of one pool on one core (created on first use, in the core's
/// `locals`). Borrows of its cells are never held across a submission or a completion:
/// either may call back into it (a layout can complete synchronously).
pub(crate) struct FirstWrites {
    hook: Cell<u32>,
    slots: RefCell<Vec<Slot>>,
    free: RefCell<Vec<u32>>,
    /// Layout handles for this engine's own I/O (one per nesting level in use).
    /// Handles of the pool's datapath below the thin map (through its cache tier, whose
    /// write-back data a merge must see).
    layouts: RefCell<Vec<TierHandle>>,
    /// Scratch lists of the operations of one phase (submitted after the borrows end;
    /// one per nesting level in use, as a synchronous completion may start the next
    /// phase while one is being submitted).
    ops: RefCell<Vec<Vec<IoOp>>>,
}

impl CoreEngine for FirstWrites {
    type Owner = PoolCore;
    const TAG: usize = 0x6669_7273;

    fn create(_pool: &Arc<PoolCore>) -> Self {
        FirstWrites {
            hook: Cell::new(0),
            slots: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            layouts: RefCell::new(Vec::new()),
            ops: RefCell::new(Vec::new()),
        }
    }

    fn set_hook(&self, id: u32) {
        self.hook.set(id)
    }

    fn retire(&self) -> Option<u32> {
        if let Ok(mut l) = self.layouts.try_borrow_mut() {
            l.clear();
        }
        None
    }
}

impl FirstWrites {
    /// Write `len` bytes at volume offset `at` (all inside one unit) of `vol` from `data`
    /// (null: zeros) through the first-write path, for a request whose token is `epoch`;
    /// `parent` completes once, with the result.
    ///
    /// # Safety
    /// `data`, when not null, points to `len` bytes that stay valid and unchanged until
    /// `parent` completes (the contract of `IoHandle::submit`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn submit(
        &self,
        io: &mut CoreIo,
        vol: &Arc<Volume>,
        epoch: u64,
        at: u64,
        len: u64,
        data: *const u8,
        parent: Tag,
    ) {
        let unit = at >> vol.pool.unit_shift;
        let idx = {
            let mut slots = self.slots.borrow_mut();
            let idx = match self.free.borrow_mut().pop() {
                Some(i) => i,
                None => {
                    slots.push(Slot::default());
                    u32_of(slots.len() - 1)
                }
            };
            let s = &mut slots[idx as usize];
            s.vol = Some(vol.clone());
            s.parent = parent;
            (s.unit, s.at, s.len, s.data, s.epoch) = (unit, at, len, data, epoch);
            s.phase = Phase::Retry;
            idx
        };
        self.start(io, idx);
    }

    /// Plan (under the pool lock, metadata only), then start the reads or the writes.
    fn start(&self, io: &mut CoreIo, idx: u32) {
        let (vol, unit, at, len, data, epoch, mut runs, mut reads) = {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[idx as usize];
            (
                s.vol.clone().expect("a slot in use has its volume"),
                s.unit,
                s.at,
                s.len,
                s.data,
                s.epoch,
                std::mem::take(&mut s.runs),
                std::mem::take(&mut s.reads),
            )
        };
        let pool = &vol.pool;
        let plan = pool.plan_first_write(&vol, epoch, unit, at, len, &mut runs, &mut reads);
        let shift = pool.unit_shift;
        let within = at - (unit << shift);
        match plan {
            FirstWritePlan::Fail(e) => {
                self.put_back(idx, runs, reads);
                self.done(io, idx, e);
            }
            FirstWritePlan::Busy => {
                self.put_back(idx, runs, reads);
                self.slots.borrow_mut()[idx as usize].phase = Phase::Retry;
                io.defer_hook(self.hook.get(), idx as u64);
            }
            FirstWritePlan::Plain(p) => {
                self.put_back(idx, runs, reads);
                let parent = self.release(idx);
                let offset = ((p as u64) << shift) | within;
                let op = if data.is_null() {
                    IoOp::WriteZeroes {
                        offset,
                        len,
                        may_unmap: false,
                    }
                } else {
                    IoOp::Write {
                        offset,
                        len: u32_of(len),
                        buf: data,
                    }
                };
                // SAFETY: `data` is the submitter's buffer, alive until `parent`
                // completes (see `submit`).
                unsafe { self.submit_layout(io, pool, op, parent) };
            }
            FirstWritePlan::Partial { p, layer } => {
                let bshift = pool.presence.block_shift;
                // Buffers for the absent runs the write does not cover whole.
                for (i, r) in runs.iter_mut().enumerate() {
                    if !r.present && reads.iter().any(|c| c.run == u32_of(i)) {
                        let bytes = ((r.last - r.first + 1) as u64) << bshift;
                        r.buf = Some(io.bufs.get(usize_of(bytes)));
                    }
                }
                let mut ops = self.take_ops();
                for c in &reads {
                    let r = &mut runs[c.run as usize];
                    let buf = r.buf.as_mut().expect("a run with reads has a buffer");
                    let from = usize_of(((c.first - r.first) as u64) << bshift);
                    let bytes = usize_of((c.count as u64) << bshift);
                    if c.src == HOLE {
                        buf.as_mut_slice()[from..from + bytes].fill(0);
                    } else {
                        ops.push(IoOp::Read {
                            offset: ((c.src as u64) << shift) + ((c.first as u64) << bshift),
                            len: u32_of(bytes),
                            // SAFETY: `from + bytes` is inside the run's buffer.
                            buf: unsafe { buf.as_mut_ptr().add(from) },
                        });
                    }
                }
                {
                    let mut slots = self.slots.borrow_mut();
                    let s = &mut slots[idx as usize];
                    (s.p, s.layer, s.runs, s.reads) = (p, layer, runs, reads);
                    s.phase = Phase::Reading;
                }
                if ops.is_empty() {
                    self.ops.borrow_mut().push(ops);
                    return self.write(io, idx);
                }
                let t = io.tracked(
                    Tag::NO_PARENT,
                    u32_of(ops.len()),
                    self.hook.get(),
                    idx as u64,
                );
                for op in ops.drain(..) {
                    // SAFETY: the buffers belong to the slot, which is kept until every
                    // part of `t` has completed.
                    unsafe { self.submit_layout(io, pool, op, t) };
                }
                self.ops.borrow_mut().push(ops);
            }
        }
    }

    /// The chain's parts are in the buffers: write every run into the volume's unit.
    fn write(&self, io: &mut CoreIo, idx: u32) {
        let mut ops = self.take_ops();
        let pool = {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[idx as usize];
            s.phase = Phase::Writing;
            let vol = s.vol.clone().expect("a slot in use has its volume");
            let shift = vol.pool.unit_shift;
            let bshift = vol.pool.presence.block_shift;
            let within = s.at - (s.unit << shift);
            let write_end = within + s.len;
            let base = (s.p as u64) << shift;
            let data = s.data;
            for r in &mut s.runs {
                let run_start = (r.first as u64) << bshift;
                let run_end = ((r.last as u64) + 1) << bshift;
                let (from, to) = (run_start.max(within), run_end.min(write_end));
                match r.buf.as_mut() {
                    Some(buf) => {
                        // The run's blocks whole: the chain's bytes, the write's over them.
                        if from < to {
                            let dst = &mut buf.as_mut_slice()
                                [usize_of(from - run_start)..usize_of(to - run_start)];
                            if data.is_null() {
                                dst.fill(0);
                            } else {
                                // SAFETY: `[from - within, to - within)` lies inside the
                                // submitter's `len` bytes, alive until the parent completes.
                                let src = unsafe {
                                    std::slice::from_raw_parts(
                                        data.add(usize_of(from - within)),
                                        usize_of(to - from),
                                    )
                                };
                                dst.copy_from_slice(src);
                            }
                        }
                        ops.push(IoOp::Write {
                            offset: base + run_start,
                            len: u32_of(run_end - run_start),
                            buf: buf.as_ptr(),
                        });
                    }
                    // Present blocks (only the bytes written: another core may be writing
                    // the rest of them), or absent ones the write covers whole.
                    None if from < to => ops.push(if data.is_null() {
                        IoOp::WriteZeroes {
                            offset: base + from,
                            len: to - from,
                            may_unmap: false,
                        }
                    } else {
                        IoOp::Write {
                            offset: base + from,
                            len: u32_of(to - from),
                            // SAFETY: inside the submitter's buffer, as above.
                            buf: unsafe { data.add(usize_of(from - within)) },
                        }
                    }),
                    None => {}
                }
            }
            vol.pool.clone()
        };
        if ops.is_empty() {
            self.ops.borrow_mut().push(ops);
            return self.finish(io, idx, 0);
        }
        let t = io.tracked(
            Tag::NO_PARENT,
            u32_of(ops.len()),
            self.hook.get(),
            idx as u64,
        );
        for op in ops.drain(..) {
            // SAFETY: the slot's buffers and the submitter's stay alive until every part
            // of `t` has completed.
            unsafe { self.submit_layout(io, &pool, op, t) };
        }
        self.ops.borrow_mut().push(ops);
    }

    /// An empty scratch list of operations (give it back to `ops` after use).
    fn take_ops(&self) -> Vec<IoOp> {
        let mut ops = self.ops.borrow_mut().pop().unwrap_or_default();
        ops.clear();
        ops
    }

    /// Every write of the slot completed with `res`: mark the blocks, answer the client.
    fn finish(&self, io: &mut CoreIo, idx: u32, res: i32) {
        let (vol, p, layer, unit, runs) = {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[idx as usize];
            (
                s.vol.clone().expect("a slot in use has its volume"),
                s.p,
                s.layer,
                s.unit,
                std::mem::take(&mut s.runs),
            )
        };
        vol.pool.finish_first_write(p, layer, unit, &runs, res);
        let mut runs = runs;
        for r in &mut runs {
            if let Some(b) = r.buf.take() {
                io.bufs.put(b);
            }
        }
        let reads = std::mem::take(&mut self.slots.borrow_mut()[idx as usize].reads);
        self.put_back(idx, runs, reads);
        self.done(io, idx, res);
    }

    /// Hand the slot's lists back (keeping their capacity for the next user).
    fn put_back(&self, idx: u32, runs: Vec<BlockRun>, reads: Vec<ChainRead>) {
        let mut slots = self.slots.borrow_mut();
        let s = &mut slots[idx as usize];
        s.runs = runs;
        s.reads = reads;
    }

    /// Free the slot; returns its parent tag.
    fn release(&self, idx: u32) -> Tag {
        let parent = {
            let mut slots = self.slots.borrow_mut();
            let s = &mut slots[idx as usize];
            s.vol = None;
            s.data = std::ptr::null();
            s.runs.clear();
            s.reads.clear();
            s.parent
        };
        self.free.borrow_mut().push(idx);
        parent
    }

    fn done(&self, io: &mut CoreIo, idx: u32, res: i32) {
        let parent = self.release(idx);
        io.complete(parent, res);
    }

    /// Submit `op` through one of this engine's layout handles.
    ///
    /// # Safety
    /// As `IoHandle::submit` for `op`'s buffer.
    unsafe fn submit_layout(&self, io: &mut CoreIo, pool: &PoolCore, op: IoOp, tag: Tag) {
        let mut h = self
            .layouts
            .borrow_mut()
            .pop()
            .unwrap_or_else(|| TierHandle::new(&pool.layout, &pool.cache));
        // SAFETY: forwarded to the caller.
        unsafe { h.submit(io, op, tag) };
        self.layouts.borrow_mut().push(h);
    }
}

impl Continuation for FirstWrites {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        let idx = u32_of(ctx);
        let phase = self.slots.borrow()[idx as usize].phase;
        match phase {
            Phase::Retry => self.start(io, idx),
            Phase::Reading if res < 0 => self.finish(io, idx, res),
            Phase::Reading => self.write(io, idx),
            Phase::Writing => self.finish(io, idx, res),
        }
    }
}
