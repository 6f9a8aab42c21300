//! The per-core datapath of the parity layouts (raid5, raid6, ec).
//!
//! Reads of healthy chunks go straight to their device, like raid0: no lock, no state.
//! Everything else is a *row operation*, a small state machine kept in a per-core slab
//! (one engine per core and layout, shared by every handle on the core):
//!
//! 1. **Lock** the row (a CAS in the shared row-lock table; if it is held, retry next
//!    round with `CoreIo::defer`, so the core keeps serving other work).
//! 2. **Plan and read**: a write that covers every data chunk of its column range needs no
//!    read (*full*); otherwise read-modify-write (old data + old parity) or
//!    reconstruct-write (the untouched data), whichever reads fewer chunks; with a device
//!    failed or being rebuilt, *degraded*: read every readable chunk and decode the rest.
//! 3. **Journal**: one record with the write's new bytes (a header-only marker for a
//!    full row with no failed device) on each of the row's parity devices (format §2.1),
//!    completed before anything goes in place.
//! 4. **Flush** (devices that keep data only): the record's holders are flushed before
//!    any chunk is overwritten — one flush per core shared by every row write waiting
//!    (power-loss ordering, format §2.1 *Durability*).
//! 5. **In place**: the new data and parity chunks.
//! 6. **Settle** (same devices): the devices written are flushed before the record is
//!    released, since recovery never replays a released record.
//! 7. **Done**: release the journal space and the row lock, complete the request.
//!
//! A device error marks the device failed (lock free, `Layout::mark_failed`); a phase
//! that read from a device that has failed meanwhile is planned again (degraded). The
//! client sees an error only when more than m devices are gone.
//!
//! Completions arrive through the core's hook mechanism, possibly while the engine is
//! itself submitting (devices may complete synchronously), so every event goes through a
//! queue that one trampoline loop drains: the engine is never re-entered.

// Not yet audited for the workspace lint (57 casts, mostly u64 lengths and offsets to
// usize on this 64-bit-only code): remove this line and fix or justify each one.
#![allow(clippy::cast_possible_truncation)]

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::{Arc, Weak};

use tessera_io::buf::AlignedBuf;
use tessera_io::{Continuation, CoreIo, IoOp, Tag};

use crate::layout::{reason_of, Layout};
use crate::parity::{encode_header, Parity, RecordHead, KIND_CHUNK, KIND_FULL, MAX_CHUNK};

/// Hook contexts: a device I/O inside a row operation, a direct (healthy) read, a flush.
/// Which kind of device operation of the engine failed, with the device's index: the
/// `ctx` of its `hooked` tag (`Engine::on_error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DevOp {
    /// A piece of a direct read (no row operation): the request is re-planned.
    FastRead(usize),
    /// A device's flush for a FLUSH request: it fails only if data is lost.
    Flush(usize),
    /// An I/O of a row operation: its phase sees the failed bit and plans again.
    RowOp(usize),
}

impl DevOp {
    const ROW_OP: u64 = 1 << 62;
    const FAST_READ: u64 = 1 << 61;
    const FLUSH: u64 = 1 << 60;
    /// The device index, in the low byte.
    const DEV: u64 = 0xff;

    #[inline]
    fn ctx(self) -> u64 {
        match self {
            DevOp::FastRead(d) => Self::FAST_READ | d as u64,
            DevOp::Flush(d) => Self::FLUSH | d as u64,
            DevOp::RowOp(d) => Self::ROW_OP | d as u64,
        }
    }

    #[inline]
    fn of(ctx: u64) -> DevOp {
        let d = (ctx & Self::DEV) as usize;
        if ctx & Self::FAST_READ != 0 {
            DevOp::FastRead(d)
        } else if ctx & Self::FLUSH != 0 {
            DevOp::Flush(d)
        } else {
            DevOp::RowOp(d)
        }
    }

    fn dev(self) -> usize {
        match self {
            DevOp::FastRead(d) | DevOp::Flush(d) | DevOp::RowOp(d) => d,
        }
    }
}
/// `Event::Step` id of the group flush's completion.
const GROUP_FLUSH: u32 = u32::MAX;
/// Attempts at planning one row operation (each failure marks a device failed first).
const MAX_TRIES: u8 = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Lock,
    Plan,
    Compute,
    Journal,
    /// Waiting for the records to be durable (a group flush of their non-volatile holders).
    Flush,
    InPlace,
    /// Waiting for the in-place writes to be durable before the record is released
    /// (group flush of the devices written).
    Settle,
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Full,
    Rmw,
    Rcw,
    Degraded,
}

/// One data chunk's part of a row operation: bytes `[off, off+len)` of data shard
/// `shard`, from (writes) or to (reads) `ptr`.
#[derive(Clone, Copy, Debug)]
struct Seg {
    shard: usize,
    off: u64,
    len: u64,
    ptr: usize,
}

/// A device write of a row operation: `len` bytes at device offset `at` from `ptr`.
#[derive(Clone, Copy, Debug)]
struct DevWrite {
    shard: usize,
    dev: usize,
    chunk_off: u64,
    len: u64,
    ptr: usize,
}

struct RowOp {
    parent: Tag,
    row: u64,
    write: bool,
    segs: Vec<Seg>,
    lo: u64,
    hi: u64,
    phase: Phase,
    mode: Mode,
    version: u64,
    /// Devices read in this attempt (a failure among them means: plan again).
    read_set: u64,
    /// Shards not read (rebuilt by decoding in degraded mode).
    erased: Vec<usize>,
    /// Read-modify-write builds its journal record in place (`jbuf`): parity is read
    /// into and updated inside the record's parity entries, so nothing is copied twice.
    /// (offset of the first parity entry, bytes per parity entry, offset of the old-data
    /// scratch after the record)
    rmw: Option<(usize, usize, usize)>,
    buf: Option<AlignedBuf>,
    jbuf: Option<AlignedBuf>,
    ring_id: Option<u64>,
    /// Devices the journal record (or marker) went to.
    holders: u64,
    writes: Vec<DevWrite>,
    tries: u8,
    result: i32,
}

impl RowOp {
    fn new() -> RowOp {
        RowOp {
            parent: Tag::NO_PARENT,
            row: 0,
            write: false,
            segs: Vec::new(),
            lo: 0,
            hi: 0,
            phase: Phase::Lock,
            mode: Mode::Full,
            version: 0,
            read_set: 0,
            erased: Vec::new(),
            rmw: None,
            buf: None,
            jbuf: None,
            ring_id: None,
            holders: 0,
            writes: Vec::new(),
            tries: 0,
            result: 0,
        }
    }
}

enum Event {
    /// A new request from a handle.
    Request(IoOp, Tag),
    /// A row operation's phase finished (or its lock retry is due).
    Step(u32),
    /// A direct read failed: serve it degraded.
    ReadFailed {
        parent: Tag,
        dev: usize,
        offset: u64,
        len: u64,
        buf: usize,
    },
}

struct State {
    handles: Vec<crate::devstats::DeviceHandle>,
    ops: Vec<RowOp>,
    free: Vec<u32>,
    zeros: AlignedBuf,
    /// Group commit of journal records (power-loss ordering, docs/format.md §2.1): the
    /// row operations whose records the flush in flight covers, and those waiting for
    /// the next flush (their records completed after it was issued), with the devices
    /// each group must flush.
    flushing: Vec<u32>,
    flushing_busy: bool,
    flush_next: Vec<u32>,
    flush_next_devs: u64,
}

/// The parity datapath of one layout on one core.
pub(crate) struct Engine {
    layout: Weak<Layout>,
    hook: Cell<u32>,
    st: RefCell<State>,
    pending: RefCell<VecDeque<Event>>,
    active: Cell<bool>,
}

/// The engine of `layout` on this core (created on first use).
pub(crate) fn engine_for(io: &mut CoreIo, layout: &Arc<Layout>) -> Rc<Engine> {
    let key = Arc::as_ptr(layout) as usize ^ 0x7061_7269;
    if let Some((e, w)) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<(Rc<Engine>, Weak<Layout>)>())
    {
        if std::ptr::eq(w.as_ptr(), Arc::as_ptr(layout)) && w.strong_count() > 0 {
            return e.clone();
        }
    }
    // Engines of layouts that are gone (pools closed or deleted) give their device
    // handles back; the core's hook table keeps only their empty shell.
    io.locals.retain(
        |_, b| match b.downcast_ref::<(Rc<Engine>, Weak<Layout>)>() {
            Some((e, w)) if w.strong_count() == 0 => {
                if let Ok(mut st) = e.st.try_borrow_mut() {
                    st.handles.clear();
                    st.ops.clear();
                }
                false
            }
            _ => true,
        },
    );
    let e = Rc::new(Engine {
        layout: Arc::downgrade(layout),
        hook: Cell::new(0),
        st: RefCell::new(State {
            handles: layout.device_handles(),
            ops: Vec::new(),
            free: Vec::new(),
            zeros: AlignedBuf::zeroed(MAX_CHUNK as usize),
            flushing: Vec::new(),
            flushing_busy: false,
            flush_next: Vec::new(),
            flush_next_devs: 0,
        }),
        pending: RefCell::new(VecDeque::new()),
        active: Cell::new(false),
    });
    let id = io.register_hook(e.clone());
    e.hook.set(id);
    io.locals
        .insert(key, Box::new((e.clone(), Arc::downgrade(layout))));
    e
}

impl Continuation for Engine {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        let Some(l) = self.layout.upgrade() else {
            return io.complete(parent, res);
        };
        let what = DevOp::of(ctx);
        let dev = what.dev();
        l.mark_failed(dev, reason_of(&op, res));
        if let DevOp::FastRead(_) = what {
            if let IoOp::Read { offset, len, buf } = op {
                self.pending.borrow_mut().push_back(Event::ReadFailed {
                    parent,
                    dev,
                    offset,
                    len: len as u64,
                    buf: buf as usize,
                });
                return self.run(io);
            }
        }
        if let DevOp::Flush(_) = what {
            let m = l.parity_geo().m as u32;
            return io.complete(
                parent,
                if l.failed_bits().count_ones() <= m {
                    0
                } else {
                    res
                },
            );
        }
        // Inside a row operation: the phase sees the failed bit and plans again.
        io.complete(parent, 0)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, _res: i32) {
        self.pending.borrow_mut().push_back(Event::Step(ctx as u32));
        self.run(io)
    }
}

impl Engine {
    /// Take a request (queued when the engine is busy; its buffer is used until it
    /// completes).
    ///
    /// # Safety
    /// As [`tessera_io::IoHandle::submit`] for `op`'s buffer.
    pub(crate) unsafe fn submit(&self, io: &mut CoreIo, layout: &Layout, op: IoOp, tag: Tag) {
        if let IoOp::Read { offset, len, buf } = op {
            if self.read_direct(io, layout, offset, len as u64, buf as usize, tag) {
                return;
            }
        }
        self.pending.borrow_mut().push_back(Event::Request(op, tag));
        self.run(io)
    }

    /// The common read: every chunk it touches is readable and the engine is idle, so
    /// the pieces go straight to the devices (no queue, no row operation). Returns false
    /// when the read needs the general path.
    fn read_direct(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        offset: u64,
        len: u64,
        ptr: usize,
        tag: Tag,
    ) -> bool {
        let p = l.parity_geo();
        if self.active.get()
            || len == 0
            || offset.checked_add(len).is_none_or(|e| e > l.size)
            || l.failed_bits() | l.rebuilding_bits() != 0
        {
            return false;
        }
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return false;
        };
        let hook = self.hook.get();
        let first = offset / p.chunk;
        let n = (offset + len - 1) / p.chunk - first + 1;
        let t = if n == 1 { tag } else { io.join(tag, n as u32) };
        self.active.set(true);
        let mut done = 0;
        while done < len {
            let (r, i, off) = p.locate(offset + done);
            let piece = (p.chunk - off).min(len - done);
            let d = p.shard_dev(r, i);
            let sub = IoOp::Read {
                offset: p.row_offset(r) + off,
                len: piece as u32,
                buf: (ptr + done as usize) as *mut u8,
            };
            let h = io.hooked(t, hook, sub, DevOp::FastRead(d).ctx());
            // SAFETY: `ptr` is the request's buffer, valid until the request completes
            // (Engine::submit's contract); the request completes through `t`, after
            // this piece.
            unsafe { st.handles[d].submit(io, sub, h) };
            done += piece;
        }
        drop(st);
        self.active.set(false);
        // A device error during the submits queued a degraded read: serve it now.
        if !self.pending.borrow().is_empty() {
            self.run(io);
        }
        true
    }

    /// Drain the event queue unless an outer call is already doing it.
    fn run(&self, io: &mut CoreIo) {
        if self.active.replace(true) {
            return;
        }
        let Some(l) = self.layout.upgrade() else {
            // The pool is gone: fail what is queued.
            while let Some(e) = self.pending.borrow_mut().pop_front() {
                if let Event::Request(_, tag) = e {
                    io.complete(tag, -libc::ENODEV);
                }
            }
            self.active.set(false);
            return;
        };
        loop {
            let ev = self.pending.borrow_mut().pop_front();
            let Some(ev) = ev else { break };
            let mut st = self.st.borrow_mut();
            match ev {
                Event::Request(op, tag) => self.request(io, &l, &mut st, op, tag),
                Event::Step(GROUP_FLUSH) => self.group_flushed(io, &l, &mut st),
                Event::Step(id) => self.step(io, &l, &mut st, id),
                Event::ReadFailed {
                    parent,
                    dev,
                    offset,
                    len,
                    buf,
                } => self.read_failed(io, &l, &mut st, parent, dev, offset, len, buf),
            }
        }
        self.active.set(false);
    }

    fn new_op(&self, st: &mut State, parent: Tag, row: u64, write: bool) -> u32 {
        let id = match st.free.pop() {
            Some(i) => i,
            None => {
                st.ops.push(RowOp::new());
                (st.ops.len() - 1) as u32
            }
        };
        let op = &mut st.ops[id as usize];
        op.parent = parent;
        op.row = row;
        op.write = write;
        op.segs.clear();
        op.phase = Phase::Lock;
        op.tries = 0;
        op.result = 0;
        op.ring_id = None;
        op.holders = 0;
        op.writes.clear();
        op.rmw = None;
        id
    }

    fn request(&self, io: &mut CoreIo, l: &Layout, st: &mut State, op: IoOp, tag: Tag) {
        let p = l.parity_geo();
        let (offset, len, ptr) = match op {
            IoOp::Read { offset, len, buf } => (offset, len as u64, buf as usize),
            IoOp::Write { offset, len, buf } => (offset, len as u64, buf as usize),
            IoOp::WriteZeroes { offset, len, .. } => (offset, len, 0),
            // Discarding part of a row would leave its parity describing bytes that are
            // no longer there; the space stays allocated (docs/architecture.md).
            IoOp::Discard { .. } => return io.complete(tag, 0),
            IoOp::Flush => return self.flush(io, l, st, tag),
        };
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > l.size) {
            return io.complete(tag, if len == 0 { 0 } else { -libc::EINVAL });
        }
        let hook = self.hook.get();
        if let IoOp::Read { .. } = op {
            let first = offset / p.chunk;
            let last = (offset + len - 1) / p.chunk;
            let n = last - first + 1;
            let t = if n == 1 { tag } else { io.join(tag, n as u32) };
            let unreadable = l.failed_bits() | l.rebuilding_bits();
            let mut done = 0;
            while done < len {
                let (r, i, off) = p.locate(offset + done);
                let piece = (p.chunk - off).min(len - done);
                let d = p.shard_dev(r, i);
                if unreadable & (1 << d) == 0 {
                    let sub = IoOp::Read {
                        offset: p.row_offset(r) + off,
                        len: piece as u32,
                        buf: (ptr + done as usize) as *mut u8,
                    };
                    let h = io.hooked(t, hook, sub, DevOp::FastRead(d).ctx());
                    // SAFETY: `ptr` is the request's buffer, valid until the request
                    // completes (Engine::submit's contract); the request completes
                    // through `t`, after this piece.
                    unsafe { st.handles[d].submit(io, sub, h) };
                } else {
                    let id = self.new_op(st, t, r, false);
                    st.ops[id as usize].segs.push(Seg {
                        shard: i,
                        off,
                        len: piece,
                        ptr: ptr + done as usize,
                    });
                    self.pending.borrow_mut().push_back(Event::Step(id));
                }
                done += piece;
            }
            return;
        }
        // Writes and zeroes: one row operation per row.
        let zeros = matches!(op, IoOp::WriteZeroes { .. });
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let rows = last - first + 1;
        let t = if rows == 1 {
            tag
        } else {
            io.join(tag, rows as u32)
        };
        let zero_ptr = st.zeros.as_ptr() as usize;
        let mut done = 0;
        for r in first..=last {
            let id = self.new_op(st, t, r, true);
            let row_end = ((r + 1) * p.row_bytes - offset).min(len);
            while done < row_end {
                let (_, i, off) = p.locate(offset + done);
                let piece = (p.chunk - off).min(row_end - done);
                st.ops[id as usize].segs.push(Seg {
                    shard: i,
                    off,
                    len: piece,
                    ptr: if zeros { zero_ptr } else { ptr + done as usize },
                });
                done += piece;
            }
            self.pending.borrow_mut().push_back(Event::Step(id));
        }
    }

    fn flush(&self, io: &mut CoreIo, l: &Layout, st: &mut State, tag: Tag) {
        let failed = l.failed_bits();
        let live: Vec<usize> = (0..st.handles.len())
            .filter(|d| failed & (1 << d) == 0)
            .collect();
        if live.is_empty() {
            return io.complete(tag, -libc::EIO);
        }
        let t = if live.len() == 1 {
            tag
        } else {
            io.join(tag, live.len() as u32)
        };
        let hook = self.hook.get();
        for d in live {
            let h = io.hooked(t, hook, IoOp::Flush, DevOp::Flush(d).ctx());
            // SAFETY: a flush carries no buffer.
            unsafe { st.handles[d].submit(io, IoOp::Flush, h) };
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read_failed(
        &self,
        _io: &mut CoreIo,
        l: &Layout,
        st: &mut State,
        parent: Tag,
        dev: usize,
        offset: u64,
        len: u64,
        buf: usize,
    ) {
        let p = l.parity_geo();
        let rel = offset - crate::parity::PARITY_DATA_START;
        let (r, off) = (rel / p.chunk, rel % p.chunk);
        let shard = (0..p.k)
            .find(|&s| p.shard_dev(r, s) == dev)
            .expect("a direct read goes to a data shard");
        let id = self.new_op(st, parent, r, false);
        st.ops[id as usize].segs.push(Seg {
            shard,
            off,
            len,
            ptr: buf,
        });
        self.pending.borrow_mut().push_back(Event::Step(id));
    }

    /// Advance row operation `id` as far as it goes without waiting.
    fn step(&self, io: &mut CoreIo, l: &Layout, st: &mut State, id: u32) {
        let p = l.parity_geo();
        let hook = self.hook.get();
        loop {
            let phase = st.ops[id as usize].phase;
            match phase {
                Phase::Lock => {
                    let op = &mut st.ops[id as usize];
                    match p.try_lock(op.row) {
                        Some(v) => {
                            op.version = v;
                            op.phase = Phase::Plan;
                        }
                        None => {
                            // Held by another request: try again next round.
                            io.defer_hook(hook, id as u64);
                            return;
                        }
                    }
                }
                Phase::Plan => {
                    let op = &mut st.ops[id as usize];
                    op.tries += 1;
                    if op.tries > MAX_TRIES {
                        op.result = -libc::EIO;
                        op.phase = Phase::Done;
                        continue;
                    }
                    let reads = self.plan(io, l, p, st, id, hook);
                    let op = &mut st.ops[id as usize];
                    if op.phase == Phase::Done {
                        continue;
                    }
                    op.phase = Phase::Compute;
                    if reads > 0 {
                        return;
                    }
                }
                Phase::Compute => {
                    let op = &mut st.ops[id as usize];
                    if op.read_set & l.failed_bits() != 0 {
                        // A device failed under our reads: plan again, degraded.
                        op.phase = Phase::Plan;
                        continue;
                    }
                    compute(p, op);
                    if !op.write {
                        op.phase = Phase::Done;
                        continue;
                    }
                    op.phase = Phase::Journal;
                }
                Phase::Journal => {
                    match self.journal(io, l, p, st, id, hook) {
                        None => {
                            // The journal slice is full of unfinished writes: next round.
                            io.defer_hook(hook, id as u64);
                            return;
                        }
                        Some(n) => {
                            st.ops[id as usize].phase = Phase::Flush;
                            if n > 0 {
                                return;
                            }
                        }
                    }
                }
                Phase::Flush => {
                    // The records must be durable before any chunk is overwritten: a
                    // device with a volatile cache may otherwise keep an in-place write
                    // and lose the record across a power loss.
                    let op = &mut st.ops[id as usize];
                    op.phase = Phase::InPlace;
                    let devs = op.holders & l.journal_flush_devs();
                    if devs != 0 {
                        return self.join_group_flush(io, l, st, id, devs);
                    }
                }
                Phase::InPlace => {
                    let n = self.in_place(io, l, p, st, id, hook);
                    st.ops[id as usize].phase = Phase::Settle;
                    if n > 0 {
                        return;
                    }
                }
                Phase::Settle => {
                    // Released records are never replayed, so a record outlives its row
                    // write only until the chunks it describes are durable.
                    let op = &mut st.ops[id as usize];
                    op.phase = Phase::Done;
                    let devs = if op.ring_id.is_some() {
                        op.writes.iter().fold(0u64, |a, w| a | 1 << w.dev) & l.journal_flush_devs()
                    } else {
                        0
                    };
                    if devs != 0 {
                        return self.join_group_flush(io, l, st, id, devs);
                    }
                }
                Phase::Done => return self.finish(io, l, p, st, id),
            }
        }
    }

    /// Choose how to do the row operation and issue its reads; returns how many.
    fn plan(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> u32 {
        let failed = l.failed_bits();
        let unreadable = failed | l.rebuilding_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        let row = op.row;
        let lo = op.segs.iter().map(|s| s.off).min().unwrap_or(0);
        let hi = op.segs.iter().map(|s| s.off + s.len).max().unwrap_or(0);
        op.lo = lo;
        op.hi = hi;
        let span = hi - lo;
        let readable = |s: usize| unreadable & (1 << p.shard_dev(row, s)) == 0;
        let covered = |s: usize| {
            op.segs
                .iter()
                .any(|g| g.shard == s && g.off == lo && g.len == span)
        };
        op.mode = if !op.write {
            Mode::Degraded
        } else if (0..p.k).all(covered) {
            Mode::Full
        } else {
            let rmw_ok = op.segs.iter().all(|g| readable(g.shard))
                && (p.k..p.n).all(|s| l.rebuilding_bits() & (1 << p.shard_dev(row, s)) == 0);
            let rcw_ok = (0..p.k).all(|s| covered(s) || readable(s));
            let rmw_cost = op.segs.len() + (p.k..p.n).filter(|&s| readable(s)).count();
            let rcw_cost = (0..p.k).filter(|&s| !covered(s)).count();
            if rmw_ok && (!rcw_ok || rmw_cost <= rcw_cost) {
                Mode::Rmw
            } else if rcw_ok {
                Mode::Rcw
            } else {
                Mode::Degraded
            }
        };
        // A full-row write needs room for its parity only (the data stays in the
        // request): a smaller buffer, more of which stays in the caches.
        let need = if op.mode == Mode::Full {
            p.m * span as usize
        } else {
            p.n * span as usize
        };
        if op.buf.as_ref().is_none_or(|b| b.capacity() < need) {
            if let Some(b) = op.buf.take() {
                io.bufs.put(b);
            }
            op.buf = Some(io.bufs.get(need));
        }
        let base = op.buf.as_mut().expect("allocated above").as_mut_ptr() as usize;
        op.rmw = None;
        if op.mode == Mode::Rmw {
            // The journal record, laid out now: header, data entries, parity entries;
            // then scratch for the old data.
            let hl = p.header_len() as usize;
            let data: usize = op.segs.iter().map(|g| p.entry_len(g.len) as usize).sum();
            let el = p.entry_len(span) as usize;
            let pe = hl + data;
            let od = pe + p.m * el;
            let total = od
                + op.segs
                    .iter()
                    .map(|g| p.entry_len(g.len) as usize)
                    .sum::<usize>();
            if op.jbuf.as_ref().is_none_or(|b| b.capacity() < total) {
                if let Some(b) = op.jbuf.take() {
                    io.bufs.put(b);
                }
                op.jbuf = Some(io.bufs.get(total));
            }
            op.rmw = Some((pe, el, od));
        }
        // (shard, offset in chunk, length, buffer address)
        let mut reads: [(usize, u64, u64, usize); 64] = [(0, 0, 0, 0); 64];
        let mut nreads = 0;
        op.erased.clear();
        match op.mode {
            Mode::Full => {}
            Mode::Rmw => {
                let (pe, el, od) = op.rmw.expect("laid out above");
                let jb = op.jbuf.as_mut().expect("allocated above").as_mut_ptr() as usize;
                let mut at = jb + od;
                for g in &op.segs {
                    reads[nreads] = (g.shard, g.off, g.len, at);
                    at += p.entry_len(g.len) as usize;
                    nreads += 1;
                }
                for s in p.k..p.n {
                    if readable(s) {
                        reads[nreads] = (s, lo, span, jb + pe + (s - p.k) * el);
                        nreads += 1;
                    }
                }
            }
            Mode::Rcw => {
                for s in 0..p.k {
                    if !covered(s) {
                        reads[nreads] = (s, lo, span, base + s * span as usize);
                        nreads += 1;
                    }
                }
            }
            Mode::Degraded => {
                // Any k chunks determine the row: read k readable ones (data first, so a
                // parity shard is computed only when it must be) and rebuild the rest.
                for s in 0..p.n {
                    if readable(s) && nreads < p.k {
                        reads[nreads] = (s, lo, span, base + s * span as usize);
                        nreads += 1;
                    } else {
                        op.erased.push(s);
                    }
                }
                if op.erased.len() > p.m {
                    op.result = -libc::EIO;
                    op.phase = Phase::Done;
                    return 0;
                }
            }
        }
        op.read_set = reads[..nreads]
            .iter()
            .fold(0, |a, r| a | 1 << p.shard_dev(row, r.0));
        if nreads == 0 {
            return 0;
        }
        let t = io.tracked(Tag::NO_PARENT, nreads as u32, hook, id as u64);
        for &(s, off, len, at) in &reads[..nreads] {
            let d = p.shard_dev(row, s);
            let sub = IoOp::Read {
                offset: p.row_offset(row) + off,
                len: len as u32,
                buf: at as *mut u8,
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(d).ctx());
            // SAFETY: `at` points into this row op's buffer, which the op keeps until
            // `finish`, after every read of the op has completed.
            unsafe { handles[d].submit(io, sub, h) };
        }
        nreads as u32
    }

    /// Write the row's journal record to its holders (docs/format.md §2.1); returns how
    /// many writes were issued, or None while the journal slice is full.
    fn journal(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> Option<u32> {
        let failed = l.failed_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        let row = op.row;
        let span = op.hi - op.lo;
        let base = op.buf.as_ref().expect("planned").as_ptr() as usize;
        // Where the new parity is: the record's parity entries (read-modify-write) or the
        // row buffer's parity slots.
        let parity_at = |s: usize| match op.rmw {
            Some((pe, el, _)) => {
                op.jbuf.as_ref().expect("planned").as_ptr() as usize + pe + (s - p.k) * el
            }
            None if op.mode == Mode::Full => base + (s - p.k) * span as usize,
            None => base + s * span as usize,
        };
        if op.writes.is_empty() {
            for g in &op.segs {
                op.writes.push(DevWrite {
                    shard: g.shard,
                    dev: p.shard_dev(row, g.shard),
                    chunk_off: g.off,
                    len: g.len,
                    ptr: g.ptr,
                });
            }
            for s in p.k..p.n {
                op.writes.push(DevWrite {
                    shard: s,
                    dev: p.shard_dev(row, s),
                    chunk_off: op.lo,
                    len: span,
                    ptr: parity_at(s),
                });
            }
        }
        // A full-row write on a healthy row journals a marker only: recovery recomputes
        // the parity of a torn row from its data. With a chunk of the row missing that
        // cannot be done, so a degraded full-row write journals its bytes like any other.
        let row_devs = (0..p.n).fold(0u64, |a, s| a | 1 << p.shard_dev(row, s));
        let full = op.mode == Mode::Full && failed & row_devs == 0;
        let holders = p.record_holders(row, failed);
        op.holders = holders;
        if holders == 0 {
            // No parity left to protect: the chunks go straight in place.
            return Some(0);
        }
        let live = |w: &&DevWrite| failed & (1 << w.dev) == 0;
        let hl = p.header_len();
        let payload: u64 = if full {
            0
        } else if let Some((pe, el, _)) = op.rmw {
            // Every entry, laid out at planning (writes to failed devices included:
            // recovery skips failed devices).
            (pe + p.m * el) as u64 - hl
        } else {
            op.writes
                .iter()
                .filter(live)
                .map(|w| p.entry_len(w.len))
                .sum()
        };
        let rec_len = hl + payload;
        let (at, rid, watermark) = p.ring(row).alloc(rec_len)?;
        op.ring_id = Some(rid);
        if op.rmw.is_none()
            && op
                .jbuf
                .as_ref()
                .is_none_or(|b| b.capacity() < rec_len as usize)
        {
            if let Some(b) = op.jbuf.take() {
                io.bufs.put(b);
            }
            op.jbuf = Some(io.bufs.get(rec_len as usize));
        }
        let jb = op.jbuf.as_mut().expect("allocated above").as_mut_slice();
        let mut entries = [(0u8, 0u32, 0u32); 64];
        let mut ne = 0;
        let mut at_p = hl as usize;
        if !full {
            // Entries in write order. Read-modify-write laid the record out at planning
            // (every write has an entry, its parity is already in place); otherwise the
            // writes to live devices are copied in.
            let rmw = op.rmw.is_some();
            for w in op.writes.iter().filter(|w| rmw || live(w)) {
                if !(rmw && w.shard >= p.k) {
                    // SAFETY: w.ptr points at w.len bytes: the client's buffer (alive
                    // until the request completes), the engine's zero chunk or this op's
                    // buffer.
                    let src =
                        unsafe { std::slice::from_raw_parts(w.ptr as *const u8, w.len as usize) };
                    jb[at_p..at_p + w.len as usize].copy_from_slice(src);
                }
                at_p += p.entry_len(w.len) as usize;
                entries[ne] = (w.shard as u8, w.chunk_off as u32, w.len as u32);
                ne += 1;
            }
        }
        // Records that are flushed for power-loss safety carry a payload checksum: one
        // torn by a power loss before its flush must not be replayed.
        let payload_crc = (!full && holders & l.journal_flush_devs() != 0)
            .then(|| crc32c::crc32c(&jb[hl as usize..rec_len as usize]));
        let hdr = &mut jb[..hl as usize];
        encode_header(
            &p.uuid(),
            RecordHead {
                seq: rid,
                watermark,
                row,
                version: op.version,
                kind: if full { KIND_FULL } else { KIND_CHUNK },
                payload: payload as u32,
                holders,
                payload_crc,
            },
            &entries[..ne],
            hdr,
        );
        let n = holders.count_ones();
        let t = io.tracked(Tag::NO_PARENT, n, hook, id as u64);
        for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
            let sub = IoOp::Write {
                offset: at,
                len: rec_len as u32,
                buf: jb.as_ptr(),
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(d).ctx());
            // SAFETY: `jb` is this row op's journal buffer (`op.jbuf`), kept until
            // `finish`, after every write of the record has completed.
            unsafe { handles[d].submit(io, sub, h) };
        }
        Some(n)
    }

    fn in_place(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> u32 {
        let failed = l.failed_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        let n = op
            .writes
            .iter()
            .filter(|w| failed & (1 << w.dev) == 0)
            .count() as u32;
        if n == 0 {
            return 0;
        }
        let t = io.tracked(Tag::NO_PARENT, n, hook, id as u64);
        for w in op.writes.iter().filter(|w| failed & (1 << w.dev) == 0) {
            let sub = IoOp::Write {
                offset: p.row_offset(op.row) + w.chunk_off,
                len: w.len as u32,
                buf: w.ptr as *const u8,
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(w.dev).ctx());
            // SAFETY: `w.ptr` points at `w.len` bytes that stay valid until the op
            // finishes, after these writes: the client's buffer (its request
            // completes only then), the engine's zero chunk or this op's buffer.
            unsafe { handles[w.dev].submit(io, sub, h) };
        }
        n
    }

    /// Row operation `id` continues (in its next phase) once `devs` are flushed.
    fn join_group_flush(&self, io: &mut CoreIo, l: &Layout, st: &mut State, id: u32, devs: u64) {
        st.flush_next.push(id);
        st.flush_next_devs |= devs;
        if !st.flushing_busy {
            self.start_group_flush(io, l, st);
        }
    }

    /// Flush the devices of the operations waiting for one; they go in place when it
    /// completes (`group_flushed`). One flush covers every record completed before it.
    fn start_group_flush(&self, io: &mut CoreIo, l: &Layout, st: &mut State) {
        let devs = st.flush_next_devs & !l.failed_bits();
        st.flush_next_devs = 0;
        std::mem::swap(&mut st.flushing, &mut st.flush_next);
        st.flushing_busy = true;
        let hook = self.hook.get();
        let n = devs.count_ones();
        let t = io.tracked(Tag::NO_PARENT, n.max(1), hook, GROUP_FLUSH as u64);
        if n == 0 {
            return io.complete(t, 0);
        }
        for d in (0..st.handles.len()).filter(|d| devs & (1 << d) != 0) {
            // A failed flush marks the device failed (its records no longer count).
            let h = io.hooked(t, hook, IoOp::Flush, DevOp::RowOp(d).ctx());
            // SAFETY: a flush carries no buffer.
            unsafe { st.handles[d].submit(io, IoOp::Flush, h) };
        }
    }

    fn group_flushed(&self, io: &mut CoreIo, l: &Layout, st: &mut State) {
        st.flushing_busy = false;
        for id in std::mem::take(&mut st.flushing) {
            self.pending.borrow_mut().push_back(Event::Step(id));
        }
        if !st.flush_next.is_empty() {
            self.start_group_flush(io, l, st);
        }
    }

    fn finish(&self, io: &mut CoreIo, l: &Layout, p: &Parity, st: &mut State, id: u32) {
        let State { ops, free, .. } = st;
        let op = &mut ops[id as usize];
        if let Some(r) = op.ring_id.take() {
            p.ring(op.row).release(r);
        }
        if op.tries > 0 {
            p.unlock(op.row, op.version);
        }
        let mut res = op.result;
        if res == 0 && op.write && l.failed_bits().count_ones() as usize > p.m {
            res = -libc::EIO;
        }
        if let Some(b) = op.buf.take() {
            io.bufs.put(b);
        }
        if let Some(b) = op.jbuf.take() {
            io.bufs.put(b);
        }
        let parent = op.parent;
        free.push(id);
        io.complete(parent, res);
    }
}

/// The arithmetic of a row operation once its reads are in.
fn compute(p: &Parity, op: &mut RowOp) {
    let span = (op.hi - op.lo) as usize;
    let lo = op.lo;
    let buf = op.buf.as_mut().expect("planned").as_mut_slice();
    if op.mode == Mode::Full {
        // Every data chunk of the column range is in the request: encode from it (no
        // copy); the in-place data writes come from it too. `buf` holds the parity only.
        let mut data: [&[u8]; 64] = [&[]; 64];
        for g in &op.segs {
            // SAFETY: the request's source, g.len (= span) bytes.
            data[g.shard] =
                unsafe { std::slice::from_raw_parts(g.ptr as *const u8, g.len as usize) };
        }
        let mut parity: Vec<&mut [u8]> = buf[..p.m * span].chunks_mut(span).collect();
        p.encode_from(&data[..p.k], &mut parity);
        return;
    }
    let buf = &mut buf[..p.n * span];
    match op.mode {
        Mode::Rmw => {
            let (pe, el, od) = op.rmw.expect("planned");
            let jb = op.jbuf.as_mut().expect("planned").as_mut_slice();
            let (head, scratch) = jb.split_at_mut(od);
            let parity = &mut head[pe..pe + p.m * el];
            let mut at = 0;
            for g in &op.segs {
                let a = (g.off - lo) as usize;
                let b = a + g.len as usize;
                // SAFETY: g.ptr points at g.len bytes of the request's source.
                let new = unsafe { std::slice::from_raw_parts(g.ptr as *const u8, g.len as usize) };
                let old = &mut scratch[at..at + g.len as usize];
                at += p.entry_len(g.len) as usize;
                let mut ps: Vec<&mut [u8]> = parity.chunks_mut(el).map(|c| &mut c[a..b]).collect();
                p.update(old, new, g.shard, &mut ps);
            }
        }
        Mode::Full | Mode::Rcw | Mode::Degraded => {
            if op.mode == Mode::Degraded {
                let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
                p.reconstruct(&mut shards, &op.erased);
            }
            if !op.write {
                for g in &op.segs {
                    let a = g.shard * span + (g.off - lo) as usize;
                    // SAFETY: g.ptr is the reader's buffer of g.len bytes.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(g.ptr as *mut u8, g.len as usize) };
                    dst.copy_from_slice(&buf[a..a + g.len as usize]);
                }
                return;
            }
            for g in &op.segs {
                let a = g.shard * span + (g.off - lo) as usize;
                // SAFETY: as above, the request's source.
                let new = unsafe { std::slice::from_raw_parts(g.ptr as *const u8, g.len as usize) };
                buf[a..a + g.len as usize].copy_from_slice(new);
            }
            let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
            p.encode(&mut shards);
        }
    }
}
