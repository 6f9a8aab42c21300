//! Readahead for pools without a cache tier (issue 24): a handle whose reads of a
//! region the access-pattern detector calls sequential reads the next
//! `CHUNKS` × `CHUNK` bytes of the volume ahead of the stream into buffers of its own,
//! and serves the stream's reads from them. A read that finds its bytes still being read
//! ahead waits for them (parked on the fill) rather than reading them twice. With a
//! cache tier the tier's own readahead fills the cache instead (`read_ahead` in
//! `volume/mod.rs`).
//!
//! Reads above `MAX_READ` start none. A device that answers at once (the first fill completed before its submission
//! returned: RAM, null) gets no readahead: it would only copy every byte twice.
//!
//! **Bounded.** The buffers of one pool's streams on one core are at most
//! `CORE_BUDGET` bytes; a stream that finds the budget spent reads without readahead.
//!
//! **Never stale.** Buffers hold a copy of the volume, so they are used only while
//! every change to it comes through this handle: while it is the volume's only open
//! handle, and no other handle was opened since the stream started (`Volume::opens`;
//! one opened and closed again meanwhile may have written). This handle's own writes,
//! trims and write-zeroes drop the buffers they overlap (one still being filled is
//! dropped when its read ends: reads parked on it are concurrent with the write and get
//! the bytes read). A stream with several connections to a volume gets no readahead.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tessera_io::cast::{u32_of, usize_of};
use tessera_io::{AlignedBuf, Continuation, CoreIo, IoOp, Tag};

use super::VolumeHandle;
use crate::core_engine::{core_engine, CoreEngine};
use crate::pool::PoolCore;

/// Bytes of one readahead buffer (a unit of the pool at the default unit size would
/// be 1 MiB; half keeps a QD1 stream of 128 KiB reads fed with less memory).
pub(crate) const CHUNK: u64 = 512 << 10;
/// Buffers a stream keeps ahead of itself: 4 MiB, enough to cover a slow device's
/// latency at the rate a stream consumes them (as the cache tier's `READAHEAD`).
pub(crate) const CHUNKS: u64 = 8;
/// Reads larger than this start no readahead: they keep a device busy by themselves,
/// and reading ahead would only compete with them (a stream of 1 MiB reads at QD8 on a
/// file was a third slower with it).
pub(crate) const MAX_READ: u64 = CHUNK / 2;
/// Readahead buffers of one pool's streams on one core, at most.
pub(crate) const CORE_BUDGET: usize = 32 << 20;

/// A read waiting for a buffer being filled.
struct Parked {
    /// Offset of the read in the buffer.
    at: usize,
    len: usize,
    buf: *mut u8,
    tag: Tag,
}

/// A buffer being read from the volume.
struct Fill {
    stream: Weak<RefCell<Stream>>,
    start: u64,
    /// Bytes of the budget it holds.
    len: usize,
    data: AlignedBuf,
    parked: Vec<Parked>,
}

enum ChunkState {
    /// Being read: slot `u32` of the engine's fills.
    Filling(u32),
    Ready(AlignedBuf),
}

struct Chunk {
    start: u64,
    len: u64,
    state: ChunkState,
    /// Written over while being filled: dropped when the fill ends.
    stale: bool,
}

/// One handle's readahead state (a stream).
pub(crate) struct Stream {
    chunks: VecDeque<Chunk>,
    /// `Volume::opens` when the stream started.
    opens: u64,
    budget: Rc<Cell<usize>>,
    /// A fill completed before its submission returned: the pool's devices answer at
    /// once (RAM, null), so reading ahead would only copy the bytes twice. The stream
    /// stops reading ahead.
    pointless: bool,
}

impl Stream {
    /// Forget a chunk: a ready buffer goes back to the budget now, one being filled when
    /// its read ends.
    fn release(&self, c: &Chunk) {
        if matches!(c.state, ChunkState::Ready(_)) {
            self.budget.set(self.budget.get() - usize_of(c.len));
        }
    }

    fn retain(&mut self, mut keep: impl FnMut(&Chunk) -> bool) {
        let mut i = 0;
        while i < self.chunks.len() {
            if keep(&self.chunks[i]) {
                i += 1;
            } else {
                let c = self.chunks.remove(i).expect("in range");
                self.release(&c);
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        for c in &self.chunks {
            self.release(c);
        }
    }
}

/// One pool's readahead fills on one core (in the core's `locals`).
pub(crate) struct Readaheads {
    hook: Cell<u32>,
    fills: RefCell<Vec<Option<Fill>>>,
    free: RefCell<Vec<u32>>,
    budget: Rc<Cell<usize>>,
}

impl CoreEngine for Readaheads {
    type Owner = PoolCore;
    const TAG: usize = 0x7265_6164;

    fn create(_pool: &Arc<PoolCore>) -> Self {
        Readaheads {
            hook: Cell::new(0),
            fills: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            budget: Rc::new(Cell::new(0)),
        }
    }

    fn set_hook(&self, id: u32) {
        self.hook.set(id)
    }

    /// A fill in flight still completes into the hook: it is released only when none is.
    fn retire(&self) -> Option<u32> {
        let idle = self.fills.borrow().iter().all(Option::is_none);
        idle.then(|| self.hook.get())
    }
}

impl Continuation for Readaheads {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        let i = u32_of(ctx);
        let fill = self.fills.borrow_mut()[usize_of(ctx)]
            .take()
            .expect("a fill completes once");
        self.free.borrow_mut().push(i);
        // The reads that waited for it get its bytes (or its error).
        for p in &fill.parked {
            if res >= 0 {
                // SAFETY: the parked read's buffer is its submitter's, valid until its
                // tag completes; the range lies in both buffers (checked when parked).
                unsafe {
                    std::ptr::copy_nonoverlapping(fill.data.as_ptr().add(p.at), p.buf, p.len)
                };
            }
        }
        for p in &fill.parked {
            io.complete(p.tag, res.min(0));
        }
        let len = fill.len;
        if let Some(stream) = fill.stream.upgrade() {
            let mut s = stream.borrow_mut();
            if let Some(pos) = s.chunks.iter().position(|c| {
                c.start == fill.start && matches!(c.state, ChunkState::Filling(f) if f == i)
            }) {
                if res >= 0 && !s.chunks[pos].stale {
                    s.chunks[pos].state = ChunkState::Ready(fill.data);
                    return;
                }
                s.chunks.remove(pos);
            }
        }
        self.budget.set(self.budget.get() - len);
    }
}

impl VolumeHandle {
    /// Whether this handle may serve reads from readahead buffers now (see the module's
    /// "Never stale"); drops its stream when not.
    fn readahead_valid(&mut self) -> bool {
        let alone = self.vol.open_handles() == 1;
        match &self.ra {
            Some(s) if alone && s.borrow().opens == self.vol.opens() => true,
            Some(_) => {
                self.ra = None;
                false
            }
            None => false,
        }
    }

    /// Serve a read of `[offset, offset+len)` into `buf` from a readahead buffer, or
    /// park it on the one being filled: `true` when it was taken (its tag completes from
    /// here or from the fill).
    pub(super) fn readahead_serve(
        &mut self,
        io: &mut CoreIo,
        offset: u64,
        len: u64,
        buf: *mut u8,
        tag: Tag,
    ) -> bool {
        if self.ra.is_none() || !self.readahead_valid() {
            return false;
        }
        let stream = self.ra.clone().expect("checked");
        let s = stream.borrow();
        let Some(c) = s
            .chunks
            .iter()
            .find(|c| c.start <= offset && offset + len <= c.start + c.len && !c.stale)
        else {
            return false;
        };
        let at = usize_of(offset - c.start);
        // One handle's counters: not contended (another core's handle turns this off).
        self.vol.readahead_hits.fetch_add(1, Relaxed);
        self.vol.readahead_bytes.fetch_add(len, Relaxed);
        match &c.state {
            ChunkState::Ready(data) => {
                // SAFETY: `buf` holds `len` bytes (the submitter's contract), and the
                // range lies in the chunk (found above).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(at), buf, usize_of(len)) };
                drop(s);
                io.complete(tag, 0);
            }
            &ChunkState::Filling(f) => {
                drop(s);
                let engine = core_engine::<Readaheads>(io, &self.vol.pool);
                let mut fills = engine.fills.borrow_mut();
                let fill = fills[usize_of(u64::from(f))]
                    .as_mut()
                    .expect("a chunk being filled has its fill");
                fill.parked.push(Parked {
                    at,
                    len: usize_of(len),
                    buf,
                    tag,
                });
            }
        }
        true
    }

    /// A sequential reader reached `end`: keep the `CHUNKS` buffers from the one it
    /// reads next on filled or being filled, dropping those it has passed.
    pub(super) fn readahead_extend(&mut self, io: &mut CoreIo, end: u64) {
        if self.ra.is_none() {
            if self.vol.open_handles() != 1 || !self.vol.pool.readahead.load(Relaxed) {
                return;
            }
            let engine = core_engine::<Readaheads>(io, &self.vol.pool);
            self.ra = Some(Rc::new(RefCell::new(Stream {
                chunks: VecDeque::new(),
                opens: self.vol.opens(),
                budget: engine.budget.clone(),
                pointless: false,
            })));
        }
        if !self.readahead_valid() || self.ra.as_ref().is_some_and(|s| s.borrow().pointless) {
            return;
        }
        let stream = self.ra.clone().expect("set above");
        let cur = end / CHUNK * CHUNK;
        let last = cur + CHUNKS * CHUNK;
        let size = self.vol.size();
        stream
            .borrow_mut()
            .retain(|c| c.start + c.len > cur && c.start < last);
        let mut at = cur;
        while at < last.min(size) {
            let have = stream.borrow().chunks.iter().any(|c| c.start == at);
            if !have && !self.readahead_fill(io, &stream, at, CHUNK.min(size - at)) {
                break;
            }
            at += CHUNK;
        }
    }

    /// Read `len` bytes at `start` into a new buffer of `stream`; `false` when the
    /// core's budget is spent.
    fn readahead_fill(
        &mut self,
        io: &mut CoreIo,
        stream: &Rc<RefCell<Stream>>,
        start: u64,
        len: u64,
    ) -> bool {
        let engine = core_engine::<Readaheads>(io, &self.vol.pool);
        if engine.budget.get() + usize_of(len) > CORE_BUDGET {
            return false;
        }
        engine.budget.set(engine.budget.get() + usize_of(len));
        let mut data = AlignedBuf::zeroed(usize_of(len));
        let buf = data.as_mut_ptr();
        let fill = Fill {
            stream: Rc::downgrade(stream),
            start,
            len: usize_of(len),
            data,
            parked: Vec::new(),
        };
        let i = {
            let mut fills = engine.fills.borrow_mut();
            match engine.free.borrow_mut().pop() {
                Some(i) => {
                    fills[usize_of(u64::from(i))] = Some(fill);
                    i
                }
                None => {
                    fills.push(Some(fill));
                    u32_of(fills.len() as u64 - 1)
                }
            }
        };
        {
            let mut s = stream.borrow_mut();
            let pos = s.chunks.partition_point(|c| c.start < start);
            s.chunks.insert(
                pos,
                Chunk {
                    start,
                    len,
                    state: ChunkState::Filling(i),
                    stale: false,
                },
            );
        }
        let t = io.tracked(Tag::NO_PARENT, 1, engine.hook.get(), u64::from(i));
        // Counted in flight like a client's read: a snapshot or a release of units
        // waits for it.
        let counter = self.inflight.clone().expect("set by submit");
        let epoch = counter.begin();
        let t = counter.track(io, t, epoch);
        // SAFETY: the buffer is the fill's own, kept in the engine's table until the
        // read ends (moving the `AlignedBuf` does not move its heap allocation).
        unsafe { self.read_volume(io, start, len, buf, t) };
        let mut s = stream.borrow_mut();
        let done = s
            .chunks
            .iter()
            .any(|c| c.start == start && matches!(c.state, ChunkState::Ready(_)));
        if done {
            s.pointless = true;
            s.retain(|_| false);
            return false;
        }
        true
    }

    /// This handle changes `[offset, offset+len)`: buffers over it are dropped (one being
    /// filled when its read ends).
    pub(super) fn readahead_invalidate(&mut self, offset: u64, len: u64) {
        let Some(stream) = &self.ra else {
            return;
        };
        let end = offset.saturating_add(len);
        let mut s = stream.borrow_mut();
        for c in s.chunks.iter_mut() {
            if c.start < end && offset < c.start + c.len {
                c.stale = true;
            }
        }
        s.retain(|c| !(c.stale && matches!(c.state, ChunkState::Ready(_))));
    }
}
