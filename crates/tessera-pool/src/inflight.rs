//! Requests in flight on a pool's volumes, counted per core, and the epoch that lets a
//! snapshot or a release of units wait for the requests that started before it.
//!
//! Every volume-datapath request (read, write, write-zeroes, discard) takes a token
//! before it looks anything up in a thin map, and gives it back when it completes. A
//! token is a count on the submitting core's own counter for the pool (a cache line
//! per core and pool that only that core writes: the common path bounces nothing
//! between cores), under the parity of the pool's epoch. [`IoEpochs::drain`] moves the
//! epoch on and waits until the counts of the old parity are zero on every core. Then
//! every request that took its token before the drain has completed, and every request
//! that takes one after it sees what was changed before the drain began (a unit
//! unmapped by a trim, a volume held for a snapshot), because its token re-reads the
//! epoch after counting itself (see [`CoreInflight::begin`]).

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, Release, SeqCst};
use std::sync::{Arc, Mutex, Weak};
use std::thread::ThreadId;
use std::time::Duration;
use tessera_io::sync::MutexExt;

use tessera_io::{Continuation, CoreIo, IoOp, Tag};

/// One core's counts for one pool, by epoch parity. Aligned to its own cache lines: the
/// core writes it on every request, drains only read it.
#[repr(align(128))]
struct CoreCount {
    counts: [AtomicU64; 2],
    /// The thread that drives the core: a drain on that thread cannot wait for it.
    thread: ThreadId,
}

/// A pool's epoch and the per-core counts registered with it.
pub(crate) struct IoEpochs {
    epoch: AtomicU64,
    cores: Mutex<Vec<Weak<CoreCount>>>,
    /// Drains one at a time: each waits for the parity the one before it left behind.
    drain: Mutex<()>,
    /// Threads waiting in a drain now (diagnostics and tests).
    waiting: AtomicU64,
}

impl IoEpochs {
    pub(crate) fn new() -> Arc<IoEpochs> {
        Arc::new(IoEpochs {
            epoch: AtomicU64::new(0),
            cores: Mutex::new(Vec::new()),
            drain: Mutex::new(()),
            waiting: AtomicU64::new(0),
        })
    }

    /// Call `before(next)` with the epoch the drain is about to start (requests whose
    /// token carries it or a later one began after the drain), move the epoch on, and
    /// wait until every request counted under the old one has completed, on every core
    /// except the caller's own (a thread cannot wait for the completions it delivers).
    /// Returns false when the caller's own core had such requests in flight: they were
    /// not waited for.
    ///
    /// Never called with the pool lock held: a request in flight may need it (an
    /// allocation, a first write).
    pub(crate) fn drain(&self, before: impl FnOnce(u64)) -> bool {
        let _one = self.drain.locked();
        before(self.epoch.load(SeqCst) + 1);
        let old = self.epoch.fetch_add(1, SeqCst);
        let slot = (old & 1) as usize;
        let cores: Vec<Arc<CoreCount>> = {
            let mut c = self.cores.locked();
            c.retain(|w| w.strong_count() > 0);
            c.iter().filter_map(Weak::upgrade).collect()
        };
        let me = std::thread::current().id();
        let mut own_busy = false;
        self.waiting.fetch_add(1, SeqCst);
        for c in &cores {
            if c.thread == me {
                own_busy |= c.counts[slot].load(SeqCst) != 0;
                continue;
            }
            // Requests complete within a device round trip, or within the device
            // timeout of a redundant pool when a device hangs: spin briefly, then sleep
            // so that a long wait leaves the CPUs to the reactors.
            let mut spins = 0u32;
            while c.counts[slot].load(SeqCst) != 0 {
                spins += 1;
                if spins < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50 * u64::from((spins - 63).min(20))));
                }
            }
        }
        self.waiting.fetch_sub(1, SeqCst);
        !own_busy
    }

    /// Threads waiting in [`IoEpochs::drain`] now.
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting.load(SeqCst)
    }
}

/// This core's counter for one pool, and the continuation that gives a token back when
/// its request completes. Lives in the core's `locals` (see [`inflight_for`]).
pub(crate) struct CoreInflight {
    epochs: Arc<IoEpochs>,
    count: Arc<CoreCount>,
    hook: Cell<u32>,
}

impl CoreInflight {
    /// Count a request that starts now; returns its token (the epoch it counts under).
    ///
    /// The count is made before the epoch is read again: a drain that moved the epoch
    /// before that second read is seen by it (the request then counts under the new
    /// epoch, and everything the drain changed before moving it is visible to it), and
    /// a drain that moves it after is certain to see the count (all four accesses are
    /// sequentially consistent).
    #[inline]
    pub(crate) fn begin(&self) -> u64 {
        let mut e = self.epochs.epoch.load(SeqCst);
        loop {
            self.count.counts[(e & 1) as usize].fetch_add(1, SeqCst);
            let now = self.epochs.epoch.load(SeqCst);
            if now == e {
                return e;
            }
            self.end(e);
            e = now;
        }
    }

    /// Give token `epoch` back.
    #[inline]
    pub(crate) fn end(&self, epoch: u64) {
        // This core is the only writer of its counts: no read-modify-write needed.
        let c = &self.count.counts[(epoch & 1) as usize];
        c.store(c.load(Relaxed) - 1, Release);
    }

    /// A tag that gives token `epoch` back when it completes, then completes `parent`.
    #[inline]
    pub(crate) fn track(&self, io: &mut CoreIo, parent: Tag, epoch: u64) -> Tag {
        io.tracked(parent, 1, self.hook.get(), epoch & 1)
    }
}

impl Continuation for CoreInflight {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    #[inline]
    fn on_done(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        self.end(ctx);
        io.complete(parent, res);
    }
}

/// This core's counter for the pool whose epochs are `epochs` (made and registered on
/// first use; kept in the core's `locals`).
pub(crate) fn inflight_for(io: &mut CoreIo, epochs: &Arc<IoEpochs>) -> Rc<CoreInflight> {
    let key = Arc::as_ptr(epochs) as usize ^ 0x696e_666c;
    if let Some(c) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<Rc<CoreInflight>>())
    {
        return c.clone();
    }
    // Counters of pools that are gone (only this core still holds their epochs) go; the
    // core's hook table keeps only their shells.
    io.locals.retain(|_, b| {
        b.downcast_ref::<Rc<CoreInflight>>()
            .is_none_or(|c| Arc::strong_count(&c.epochs) > 1)
    });
    let count = Arc::new(CoreCount {
        counts: [AtomicU64::new(0), AtomicU64::new(0)],
        thread: std::thread::current().id(),
    });
    epochs.cores.locked().push(Arc::downgrade(&count));
    let c = Rc::new(CoreInflight {
        epochs: epochs.clone(),
        count,
        hook: Cell::new(0),
    });
    let id = io.register_hook(c.clone());
    c.hook.set(id);
    io.locals.insert(key, Box::new(c.clone()));
    c
}
