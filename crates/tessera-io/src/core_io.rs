//! The per-core I/O context and the block interface every layer implements.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use io_uring::{squeue, IoUring};

use crate::buf::BufPool;
use crate::reactor::RemoteCompleter;
use crate::tag::Tag;

/// A join's index in its tag's low 32 bits. A core holds at most one join per operation
/// in flight, far below 2^32.
#[inline]
fn join_index(idx: usize) -> u32 {
    debug_assert!(u32::try_from(idx).is_ok());
    #[allow(clippy::cast_possible_truncation)] // see above
    let i = idx as u32;
    i
}

/// Placeholder for contexts that have no reactor mailbox (unit tests, tools).
pub const REMOTE_COMPLETER_NONE: Option<RemoteCompleter> = None;

/// One block operation. Offsets and lengths are bytes. Buffers are raw pointers because
/// they cross into the kernel (io_uring) and must outlive the call; the submitter keeps
/// them alive and untouched until the completion arrives (the contract of
/// [`IoHandle::submit`], which is why it is `unsafe`).
#[derive(Clone, Copy, Debug)]
pub enum IoOp {
    Read {
        offset: u64,
        len: u32,
        buf: *mut u8,
    },
    Write {
        offset: u64,
        len: u32,
        buf: *const u8,
    },
    /// Make every write completed before this one durable.
    Flush,
    /// The range's contents become undefined and its space may be given back.
    Discard {
        offset: u64,
        len: u64,
    },
    /// The range reads back as zeros. `may_unmap` allows giving the space back.
    WriteZeroes {
        offset: u64,
        len: u64,
        may_unmap: bool,
    },
}

/// A per-core handle to a block target (device, pool or volume).
///
/// Contract: every `submit` results in exactly one completion for `tag`, delivered through
/// `io` (possibly before `submit` returns, via the ready queue — never re-entrantly). The
/// result is negative errno on failure, anything else on success.
pub trait IoHandle {
    /// Start `op`; its completion arrives for `tag`.
    ///
    /// # Safety
    /// For a [`IoOp::Read`] or [`IoOp::Write`], `buf` must point to `len` bytes that are
    /// valid (writable, for a read) and stay so until the completion for `tag` has been
    /// delivered: not freed, not moved, and not touched by anyone else meanwhile (the
    /// kernel or a device may read or write them at any time until then). The other
    /// operations carry no pointer.
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag);
    /// Size of the target in bytes.
    fn size(&self) -> u64;
}

struct Join {
    parent: Tag,
    remaining: u32,
    result: i32,
    delay: Duration,
    /// Set by [`CoreIo::hooked`]: on an error, the hook decides how `parent` completes.
    hook: Option<(u32, IoOp, u64)>,
    /// Set by [`CoreIo::tracked`]: the hook sees every completion, not only errors.
    always: bool,
    /// Set by [`CoreIo::watched`]: the hook sees the raw result (a byte count), not 0.
    raw: bool,
}

/// A layer's own code that runs when one of its operations ends, registered once per
/// core ([`CoreIo::register_hook`]) and addressed by id, so a pending operation carries
/// no closure. Two uses:
///
/// - error handling, for a [`CoreIo::hooked`] operation: [`Continuation::on_error`] is
///   called (instead of passing the error on) with the failed operation and the caller's
///   context (mirrors fail over to another copy);
/// - continuations, for a [`CoreIo::tracked`] operation or [`CoreIo::defer_hook`]:
///   [`Continuation::on_done`] is called for every completion (the mirrors' rebuild
///   tracking, the parity engine's next step, a retry of held writes).
///
/// Either must complete `parent` exactly once, except for the layer's own steps made with
/// parent 0 (`defer_hook`, the parity engine's tracked phases), which complete nothing.
pub trait Continuation {
    /// A [`CoreIo::hooked`] operation failed with `res`.
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32);

    /// Called for every completion of a [`CoreIo::tracked`] operation (errors included);
    /// must complete `parent` exactly once.
    fn on_done(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        if res < 0 {
            self.on_error(io, parent, op, ctx, res)
        } else {
            io.complete(parent, res)
        }
    }
}

/// Hooks registered and not yet dropped, on every core of the process (a leak check: a
/// hook whose owner went away and was never released stays counted).
static LIVE_HOOKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Hooks registered on the cores of this process and not yet dropped (see
/// [`CoreIo::release_hook`]); the node reports it in its metrics.
pub fn live_hooks() -> usize {
    LIVE_HOOKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// One registered hook and the operations still addressed to it.
struct HookSlot {
    /// `None` once released and dropped: the slot waits in `free_hooks` for reuse.
    hook: Option<std::rc::Rc<dyn Continuation>>,
    /// Joins outstanding that name this hook (their completion still goes to it).
    pending: u32,
    /// Its owner released it: dropped as soon as `pending` is 0.
    released: bool,
}

/// A pending timer: (deadline, sequence, tag, result, background); see
/// [`CoreIo::complete_after_background`].
type Timer = (Instant, u64, Tag, i32, bool);

/// Everything a core's datapath needs: its io_uring, its ready queue of synchronous
/// completions, join/delay bookkeeping for split requests, timers and buffers.
pub struct CoreIo {
    pub core: usize,
    pub(crate) ring: IoUring,
    ready: VecDeque<(Tag, i32)>,
    joins: Vec<Join>,
    free_joins: Vec<u32>,
    timers: BinaryHeap<Reverse<Timer>>,
    timer_seq: u64,
    /// How many of `timers` are background timers.
    background_timers: usize,
    /// SQEs pushed whose completions have not been reaped (excluding the reactor's own).
    pub(crate) ring_inflight: usize,
    pub bufs: BufPool,
    remote: Option<RemoteCompleter>,
    /// Per-core state that layers above share between their tasks on this core (e.g. a
    /// volume's QoS limiter), keyed by the owner's choice.
    pub locals: std::collections::HashMap<usize, Box<dyn std::any::Any>>,
    /// The time at the start of this reactor iteration: one clock read per batch of
    /// completions instead of one per request.
    now: Instant,
    /// Counts polls of the ring: work between two polls is one round (see `defer`).
    round: u64,
    /// Tags to complete in the next round, after the ring has been polled.
    deferred: Vec<Tag>,
    hooks: Vec<HookSlot>,
    /// Slots of released hooks, reused by the next registrations.
    free_hooks: Vec<u32>,
    /// Operations outstanding on this core whose completion comes from a peer node on
    /// this host (see [`CoreIo::note_peer_waits`]); the reactor sleeps instead of polling
    /// while there are any.
    peer_waits: usize,
}

impl Drop for CoreIo {
    fn drop(&mut self) {
        // The hooks still registered go with the core: keep the process-wide count exact.
        LIVE_HOOKS.fetch_sub(self.hook_count(), std::sync::atomic::Ordering::Relaxed);
    }
}

impl CoreIo {
    /// A context with its own ring. `remote` lets other threads complete tags on this core.
    pub fn new(
        core: usize,
        entries: u32,
        remote: Option<RemoteCompleter>,
    ) -> std::io::Result<CoreIo> {
        // DEFER_TASKRUN: completions' task work runs inside our own io_uring_enter(GETEVENTS),
        // so a wakeup costs no IPI and no extra context switch (measured: lower QD1 latency).
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .setup_taskrun_flag()
            .setup_cqsize(entries * 4)
            .build(entries)
            .or_else(|_| IoUring::builder().setup_cqsize(entries * 4).build(entries))?;
        Ok(CoreIo {
            core,
            ring,
            ready: VecDeque::with_capacity(1024),
            joins: Vec::new(),
            free_joins: Vec::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            background_timers: 0,
            ring_inflight: 0,
            bufs: BufPool::default(),
            remote,
            now: Instant::now(),
            locals: std::collections::HashMap::new(),
            round: 0,
            deferred: Vec::new(),
            hooks: Vec::new(),
            free_hooks: Vec::new(),
            peer_waits: 0,
        })
    }

    /// The time this batch of completions arrived (refreshed once per reactor iteration).
    #[inline]
    pub fn now(&self) -> Instant {
        self.now
    }

    pub(crate) fn tick(&mut self) {
        self.now = Instant::now();
        self.round = self.round.wrapping_add(1);
    }

    /// Re-read the clock without starting a new round: the reactor does it once before
    /// its tasks flush a batch, so replies are timestamped when they leave, not when the
    /// batch began (per-volume latency would read 0 for anything served within a round).
    pub(crate) fn refresh_now(&mut self) {
        self.now = Instant::now();
    }

    /// The current round: it changes every time the ring is polled.
    #[inline]
    pub fn round(&self) -> u64 {
        self.round
    }

    /// Complete `tag` (with 0) in the next round: after the replies queued so far have
    /// been submitted and the ring polled for new arrivals, which are handled first.
    /// A task uses it to yield the core (see the share scheduler in tessera-qos).
    pub fn defer(&mut self, tag: Tag) {
        self.deferred.push(tag);
    }

    /// Call hook `hook`'s `on_done` with `ctx` in the next round: a layer's own
    /// continuation that must wait (a parity row whose lock is held, a write held back by
    /// a rebuild), yielding the core meanwhile.
    pub fn defer_hook(&mut self, hook: u32, ctx: u64) {
        let t = self.tracked(Tag::NO_PARENT, 1, hook, ctx);
        self.defer(t);
    }

    pub(crate) fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// Start the next round's deferred work (after the caller polled the ring).
    pub(crate) fn release_deferred(&mut self) {
        // Through `complete`: a deferred internal tag (a layer's own continuation, e.g.
        // a parity row waiting for its lock) resolves its join like any completion.
        for tag in std::mem::take(&mut self.deferred) {
            self.complete(tag, 0);
        }
    }

    /// A user of this core (a remote initiator's queue) now has `now` operations waiting
    /// for a peer node on this host, instead of `before`. While the core has any, the
    /// reactor sleeps rather than polls (`crate::poll`): the answer needs that peer's
    /// reactor, which shares our CPUs. Each user reports its own count's changes, so the
    /// core's total stays exact without per-I/O bookkeeping here.
    #[inline]
    pub fn note_peer_waits(&mut self, before: usize, now: usize) {
        debug_assert!(
            self.peer_waits >= before,
            "more peer waits released than noted"
        );
        self.peer_waits = self.peer_waits.saturating_sub(before) + now;
    }

    /// Operations outstanding on this core that wait for a peer node on this host.
    #[inline]
    pub fn peer_waits(&self) -> usize {
        self.peer_waits
    }

    /// Something other threads can use to complete a tag on this core (e.g. a flush served
    /// by a pool's metadata thread).
    pub fn remote_completer(&self) -> Option<RemoteCompleter> {
        self.remote.clone()
    }

    /// Queue an io_uring operation whose completion is delivered for `tag` (carried as the
    /// entry's user_data, which this sets).
    ///
    /// # Safety
    /// Every buffer and file descriptor the entry refers to must stay valid until its
    /// completion is delivered.
    pub unsafe fn push_sqe(&mut self, entry: squeue::Entry, tag: Tag) {
        // SAFETY: forwarded to the caller.
        unsafe { self.push_raw(entry.user_data(tag.user_data())) };
        self.ring_inflight += 1;
    }

    pub(crate) unsafe fn push_raw(&mut self, entry: squeue::Entry) {
        loop {
            // SAFETY: the caller guarantees the entry's buffers outlive it.
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                return;
            }
            // Submission queue full: hand what we have to the kernel and retry.
            let _ = self.ring.submit();
        }
    }

    /// Deliver a completion. Internal tags resolve their join immediately; task tags go to
    /// the ready queue, which the reactor drains in order.
    pub fn complete(&mut self, mut tag: Tag, mut res: i32) {
        while tag.is_internal() {
            let idx = tag.internal_index();
            let j = &mut self.joins[idx];
            if (res < 0 && j.result >= 0) || j.raw {
                j.result = res;
            }
            j.remaining -= 1;
            if j.remaining > 0 {
                return;
            }
            let (parent, result, delay, hook) = (j.parent, j.result, j.delay, j.hook);
            let always = j.always;
            self.free_joins.push(join_index(idx));
            if let Some((h, op, ctx)) = hook {
                if always || result < 0 {
                    let c = self.hooks[h as usize]
                        .hook
                        .clone()
                        .expect("a hook with operations pending is not dropped");
                    if always {
                        c.on_done(self, parent, op, ctx, result);
                    } else {
                        c.on_error(self, parent, op, ctx, result);
                    }
                    // After the call: operations it addressed to its hook meanwhile keep
                    // a released hook alive.
                    self.hook_op_done(h);
                    return;
                }
                self.hook_op_done(h);
            }
            if !delay.is_zero() {
                self.complete_after(delay, parent, result);
                return;
            }
            tag = parent;
            res = result;
        }
        self.ready.push_back((tag, res));
    }

    fn new_join(&mut self, parent: Tag, parts: u32, delay: Duration) -> Tag {
        let j = Join {
            parent,
            remaining: parts,
            result: 0,
            delay,
            hook: None,
            always: false,
            raw: false,
        };
        let idx = match self.free_joins.pop() {
            Some(i) => {
                self.joins[i as usize] = j;
                i
            }
            None => {
                self.joins.push(j);
                join_index(self.joins.len() - 1)
            }
        };
        Tag::internal(idx)
    }

    /// A child tag that completes `parent` once it has received `parts` completions, with
    /// the first error seen (or 0). Used by layers that split one request into several.
    pub fn join(&mut self, parent: Tag, parts: u32) -> Tag {
        debug_assert!(parts > 0);
        self.new_join(parent, parts, Duration::ZERO)
    }

    /// Join entries allocated and free (a leak check for layers' tests).
    pub fn join_slots(&self) -> (usize, usize) {
        (self.joins.len(), self.free_joins.len())
    }

    /// Register an error hook on this core; the returned id is for [`CoreIo::hooked`].
    /// The core keeps the hook until [`CoreIo::release_hook`]: an owner that goes away
    /// (a connection, a per-connection handle) must release it, or it and everything it
    /// holds stay for the life of the core.
    pub fn register_hook(&mut self, hook: std::rc::Rc<dyn Continuation>) -> u32 {
        LIVE_HOOKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let slot = HookSlot {
            hook: Some(hook),
            pending: 0,
            released: false,
        };
        if let Some(id) = self.free_hooks.pop() {
            self.hooks[id as usize] = slot;
            return id;
        }
        self.hooks.push(slot);
        u32::try_from(self.hooks.len() - 1).expect("fewer than 2^32 hooks on a core")
    }

    /// The owner of hook `hook` is done with it: the core drops it once no operation
    /// addressed to it is outstanding (at once if none is), and reuses its id. Until then
    /// its completions still reach it, so a hook whose ring operations point into its own
    /// buffers stays alive until the kernel is done with them. Never use `hook` for new
    /// operations after this returns, except from the hook's own completions.
    pub fn release_hook(&mut self, hook: u32) {
        let slot = &mut self.hooks[hook as usize];
        debug_assert!(slot.hook.is_some() && !slot.released, "hook released twice");
        slot.released = true;
        self.drop_hook_if_idle(hook);
    }

    /// Hooks registered on this core and not yet dropped.
    pub fn hook_count(&self) -> usize {
        self.hooks.len() - self.free_hooks.len()
    }

    fn pin_hook(&mut self, hook: u32) {
        self.hooks[hook as usize].pending += 1;
    }

    fn hook_op_done(&mut self, hook: u32) {
        self.hooks[hook as usize].pending -= 1;
        self.drop_hook_if_idle(hook);
    }

    fn drop_hook_if_idle(&mut self, hook: u32) {
        let slot = &mut self.hooks[hook as usize];
        if slot.released && slot.pending == 0 && slot.hook.is_some() {
            // Taken out before it drops: its destructor may not look at the table.
            let gone = slot.hook.take();
            self.free_hooks.push(hook);
            LIVE_HOOKS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            drop(gone);
        }
    }

    /// A child tag for one operation `op`: success passes on to `parent`, an error goes to
    /// hook `hook` (with `op` and `ctx`) instead, which then completes `parent`.
    pub fn hooked(&mut self, parent: Tag, hook: u32, op: IoOp, ctx: u64) -> Tag {
        let t = self.new_join(parent, 1, Duration::ZERO);
        self.joins[t.internal_index()].hook = Some((hook, op, ctx));
        self.pin_hook(hook);
        t
    }

    /// A child tag that completes `parent` after `parts` completions, through hook
    /// `hook`'s `on_done` (with `ctx`) whatever the result: for layers that must see a
    /// request end (the mirrors' rebuild tracks writes in flight).
    pub fn tracked(&mut self, parent: Tag, parts: u32, hook: u32, ctx: u64) -> Tag {
        let t = self.new_join(parent, parts, Duration::ZERO);
        let j = &mut self.joins[t.internal_index()];
        j.hook = Some((hook, IoOp::Flush, ctx));
        j.always = true;
        self.pin_hook(hook);
        t
    }

    /// A tag for one ring operation of a layer's own (a socket receive or send) whose
    /// result, as the kernel gave it (a byte count or a negative errno), goes to hook
    /// `hook`'s `on_done` with `ctx`. Completes nothing itself.
    pub fn watched(&mut self, hook: u32, ctx: u64) -> Tag {
        let t = self.tracked(Tag::NO_PARENT, 1, hook, ctx);
        self.joins[t.internal_index()].raw = true;
        t
    }

    /// A child tag whose completion is passed on to `parent` after `delay` (fault injection).
    pub fn delayed(&mut self, parent: Tag, delay: Duration) -> Tag {
        self.new_join(parent, 1, delay)
    }

    /// Complete `tag` with `res` once `delay` has passed.
    pub fn complete_after(&mut self, delay: Duration, tag: Tag, res: i32) {
        self.push_timer(delay, tag, res, false);
    }

    /// Like [`CoreIo::complete_after`], for housekeeping (a watchdog's periodic check):
    /// the reactor fires it like any timer, but [`CoreIo::run_until_idle`] does not wait
    /// for it once nothing else is pending (it fires in a later call when due).
    pub fn complete_after_background(&mut self, delay: Duration, tag: Tag, res: i32) {
        self.background_timers += 1;
        self.push_timer(delay, tag, res, true);
    }

    fn push_timer(&mut self, delay: Duration, tag: Tag, res: i32, background: bool) {
        self.timer_seq += 1;
        let when = Instant::now() + delay;
        self.timers
            .push(Reverse((when, self.timer_seq, tag, res, background)));
    }

    pub(crate) fn pop_ready(&mut self) -> Option<(Tag, i32)> {
        self.ready.pop_front()
    }

    /// Entries waiting in the submission queue (bounded by the ring's size, a u32).
    pub(crate) fn sq_pending(&mut self) -> u32 {
        u32::try_from(self.ring.submission().len()).unwrap_or(u32::MAX)
    }

    pub(crate) fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Move due timers to the ready queue; return the time until the next one.
    pub(crate) fn fire_timers(&mut self) -> Option<Duration> {
        let now = Instant::now();
        // The timers' owners run next and judge by `now()`: it must not be older than the
        // deadline that woke them (a QoS retry computed from a stale clock would be refused
        // again, and the reactor would spin on a due timer without ever sleeping).
        self.now = now;
        while let Some(Reverse((when, _, tag, res, background))) = self.timers.peek().copied() {
            if when > now {
                return Some(when - now);
            }
            self.timers.pop();
            if background {
                self.background_timers -= 1;
            }
            self.complete(tag, res);
        }
        None
    }

    /// Reap completed io_uring entries; returns how many task/device completions arrived.
    /// Reactor-internal entries are returned through `internal`.
    pub(crate) fn reap(&mut self, internal: &mut impl FnMut(Tag, i32)) -> usize {
        let mut n = 0;
        // Collect first: completing may need &mut self while the CQ is borrowed.
        let mut batch: [(u64, i32); 256] = [(0, 0); 256];
        loop {
            let mut got = 0;
            for cqe in self.ring.completion() {
                batch[got] = (cqe.user_data(), cqe.result());
                got += 1;
                if got == batch.len() {
                    break;
                }
            }
            if got == 0 {
                return n;
            }
            for &(ud, res) in &batch[..got] {
                let tag = Tag::from_user_data(ud);
                if tag.is_reactor() {
                    internal(tag, res);
                } else {
                    self.ring_inflight -= 1;
                    self.complete(tag, res);
                    n += 1;
                }
            }
        }
    }

    /// Drive this context without a reactor until nothing is in flight, handing every task
    /// completion to `sink`. For tests and control-plane tools that use the datapath.
    pub fn run_until_idle(&mut self, mut sink: impl FnMut(&mut CoreIo, Tag, i32)) {
        loop {
            while let Some((tag, res)) = self.pop_ready() {
                sink(self, tag, res);
            }
            let next_timer = self.fire_timers();
            if self.has_ready() {
                continue;
            }
            if self.has_deferred() {
                let _ = self.ring.submit();
                self.tick();
                self.reap(&mut |_, _| {});
                self.release_deferred();
                continue;
            }
            if self.ring_inflight == 0 {
                // Background timers alone do not keep the caller waiting.
                let foreground = self.timers.len() > self.background_timers;
                match next_timer {
                    Some(d) if foreground => {
                        std::thread::sleep(d);
                        continue;
                    }
                    _ => return,
                }
            }
            let _ = self.ring.submit_and_wait(1);
            self.tick();
            self.reap(&mut |_, _| {});
        }
    }
}
