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

mod journal;
mod request;
mod row;

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::{Arc, Weak};

use tessera_io::buf::AlignedBuf;
use tessera_io::{Continuation, CoreIo, IoOp, Tag};

use crate::layout::parity::{Parity, ParityCounters, ParityEvent, MAX_CHUNK};
use crate::layout::{reason_of, Layout};
use tessera_io::cast::{u32_of, usize_of};

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
/// The longest a row write waits for a device failure to be recorded in the labels
/// (the commit thread does it within `FAILURE_POLL`, 100 ms): a bound, so that a commit
/// thread held up behind this very write (a drain) cannot deadlock with it; past it the
/// write goes on, logged.
const FAILURE_RECORD_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

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
    /// When this op began to wait for a device failure to be recorded in the labels
    /// (`Engine::held_for_failure_record`).
    held_since: Option<std::time::Instant>,
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
            held_since: None,
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
    /// This core's figures (`Parity::counters`), handed back when the engine goes.
    counters: Arc<ParityCounters>,
    /// Layout handles on this core using the engine. When the last one goes and no
    /// request is left, the engine gives its device handles back: they hold the devices
    /// open (a file device's lock with them), and the core keeps the engine itself (its
    /// hook) after the layout is gone, so a pool deleted or closed would otherwise keep
    /// its devices until the core next opens a parity engine. A handle opened later
    /// takes them again (`engine_for`).
    users: Cell<usize>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(l) = self.layout.upgrade() {
            l.parity_geo().counters.unregister(&self.counters);
        }
    }
}

/// The engine of `layout` on this core (created on first use).
pub(crate) fn engine_for(io: &mut CoreIo, layout: &Arc<Layout>) -> Rc<Engine> {
    crate::core_engine::core_engine::<Engine>(io, layout)
}

impl crate::core_engine::CoreEngine for Engine {
    type Owner = Layout;
    const TAG: usize = 0x7061_7269;

    fn create(layout: &Arc<Layout>) -> Self {
        Engine {
            layout: Arc::downgrade(layout),
            hook: Cell::new(0),
            st: RefCell::new(State {
                handles: layout.device_handles(),
                ops: Vec::new(),
                free: Vec::new(),
                zeros: AlignedBuf::zeroed(usize_of(MAX_CHUNK)),
                flushing: Vec::new(),
                flushing_busy: false,
                flush_next: Vec::new(),
                flush_next_devs: 0,
            }),
            pending: RefCell::new(VecDeque::new()),
            active: Cell::new(false),
            counters: layout.parity_geo().counters.register(),
            users: Cell::new(1),
        }
    }

    fn set_hook(&self, id: u32) {
        self.hook.set(id)
    }

    /// A new user: the device handles given back when the last one went are taken
    /// again.
    fn reused(&self, layout: &Arc<Layout>) {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            if st.handles.is_empty() {
                st.handles = layout.device_handles();
            }
        }
        self.users.set(self.users.get() + 1);
    }

    /// Completions may still reach it after its layout is gone (`on_error` checks):
    /// the hook stays.
    fn retire(&self) -> Option<u32> {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            st.handles.clear();
            st.ops.clear();
        }
        None
    }
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
            let m = u32_of(l.parity_geo().m);
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
        self.pending
            .borrow_mut()
            .push_back(Event::Step(u32_of(ctx)));
        self.run(io)
    }
}

impl Engine {
    /// A layout handle of this core is done with the engine (`LayoutHandle`'s drop).
    pub(crate) fn release_user(&self) {
        self.users.set(self.users.get().saturating_sub(1));
        self.give_back_devices_if_unused();
    }

    /// With no layout handle using the engine and nothing in flight, let go of the
    /// device handles (see `users`).
    fn give_back_devices_if_unused(&self) {
        if self.users.get() != 0 || self.active.get() || !self.pending.borrow().is_empty() {
            return;
        }
        let Ok(mut st) = self.st.try_borrow_mut() else {
            return;
        };
        let idle = st.ops.len() == st.free.len()
            && !st.flushing_busy
            && st.flushing.is_empty()
            && st.flush_next.is_empty();
        if idle {
            st.handles.clear();
        }
    }

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
        let t = if n == 1 { tag } else { io.join(tag, u32_of(n)) };
        self.active.set(true);
        let mut done = 0;
        while done < len {
            let (r, i, off) = p.locate(offset + done);
            let piece = (p.chunk - off).min(len - done);
            let d = p.shard_dev(r, i);
            let sub = IoOp::Read {
                offset: p.row_offset(r) + off,
                len: u32_of(piece),
                buf: (ptr + usize_of(done)) as *mut u8,
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
        // The last handle went while requests were in flight: they are done now.
        if self.users.get() == 0 {
            self.give_back_devices_if_unused();
        }
    }

    fn new_op(&self, st: &mut State, parent: Tag, row: u64, write: bool) -> u32 {
        let id = match st.free.pop() {
            Some(i) => i,
            None => {
                st.ops.push(RowOp::new());
                u32_of(st.ops.len() - 1)
            }
        };
        let op = &mut st.ops[id as usize];
        op.parent = parent;
        op.row = row;
        op.write = write;
        op.segs.clear();
        op.phase = Phase::Lock;
        op.tries = 0;
        op.held_since = None;
        op.result = 0;
        op.ring_id = None;
        op.holders = 0;
        op.writes.clear();
        op.rmw = None;
        id
    }

    fn finish(&self, io: &mut CoreIo, l: &Layout, p: &Parity, st: &mut State, id: u32) {
        let State { ops, free, .. } = st;
        let op = &mut ops[id as usize];
        if let Some(r) = op.ring_id.take() {
            p.ring_counted(op.row, &self.counters).release(r);
        }
        if op.write {
            self.counters.count(ParityEvent::RowWrite);
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
