//! The datapath of a replicated volume on one core.
//!
//! Every handle of one volume on one core shares a [`ReplicaCore`]: the legs' per-core
//! handles (one NVMe/TCP queue per core per peer, however many clients the core serves)
//! and the continuation ([`Continuation`]) that finishes replicated I/Os. Write flow:
//!
//! 1. count the write in flight on each region it touches; a region not yet in the
//!    activity log is sent to the persister first and the write waits (mailbox);
//! 2. send it to every in-sync leg, and to every resyncing leg whose region is already
//!    copied, in parallel, under one join;
//! 3. a leg that fails is dropped out of sync by the persister, which then completes the
//!    leg's part with success (or the error, when no other leg is in sync);
//! 4. when all parts are in: uncount the regions, complete the client.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, Weak};
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::sync::RwLockExt;

use tessera_device::IoHandle;
use tessera_export::ExportHandle;
use tessera_io::{Continuation, CoreIo, IoOp, Tag};
use tessera_pool::VolumeHandle;
use tessera_remote::RemoteHandle;
use tracing::error;

use crate::persist::{Done, Req};
use crate::{
    in_sync, resyncing, LegDev, ReplicatedVolume, CLEAN, INFLIGHT, INFLIGHT_ONE, REDIRTY, START,
    STATE,
};

/// A leg as one core reaches it.
pub(crate) enum LegHandle {
    Local(VolumeHandle),
    Remote(RemoteHandle),
    /// Not connected (a remote that was unreachable).
    Absent,
}

impl LegHandle {
    /// # Safety
    /// As [`IoHandle::submit`].
    pub(crate) unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        match self {
            // SAFETY: forwarded under the caller's contract.
            LegHandle::Local(h) => unsafe { IoHandle::submit(h, io, op, tag) },
            // SAFETY: as above.
            LegHandle::Remote(h) => unsafe { IoHandle::submit(h, io, op, tag) },
            LegHandle::Absent => io.complete(tag, -libc::ENOTCONN),
        }
    }

    pub(crate) fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        match self {
            LegHandle::Local(h) => h.is_hole(offset, len),
            _ => false,
        }
    }
}

// What a continuation context is about (top 4 bits); the rest is per kind.
const KIND_SHIFT: u32 = 60;
/// A write's activity-log entry is on disk: low bits = slot of the parked write.
const K_PARKED: u64 = 1;
/// All legs answered a write: low bits = first region (bits 0-29) and count (30-59).
const K_WRITE_DONE: u64 = 2;
/// One leg's part of a write or flush: low bits = leg.
const K_LEG: u64 = 3;
/// A read from one leg: low bits = legs tried so far (mask).
const K_READ: u64 = 4;
/// One leg's part of a flush: low bits = leg (bits 0-7) and the flush's epoch (8-39).
const K_FLUSH: u64 = 5;
const EPOCH_SHIFT: u32 = 8;
/// A read waiting for the read lease (`lease`), retried each round: low bits = slot of
/// the parked read (bits 0-23) and when it began to wait, in ms (24-55, wrapping).
const K_LEASE: u64 = 6;
const LEASE_SLOT_BITS: u32 = 24;
const LEASE_SLOT_MASK: u64 = (1 << LEASE_SLOT_BITS) - 1;
/// How long a read waits for the read lease before it fails with EIO: longer than the
/// replication timeout (5 s), after which a silent replica is dropped and the others
/// carry the lease; a fenced old owner's lease never comes back, and its reads fail then.
const LEASE_WAIT_MS: u64 = 8_000;
/// In a read's context: the leg it was sent to last (the one that failed, on error).
const LAST_SHIFT: u32 = 48;
const TRIED_MASK: u64 = 0xFF;
const REGION_BITS: u32 = 30;
const REGION_MASK: u64 = (1 << REGION_BITS) - 1;

fn ctx(kind: u64, low: u64) -> u64 {
    kind << KIND_SHIFT | low
}

/// Where a core keeps its [`ReplicaCore`] of `vol` (`CoreIo::locals`).
pub(crate) fn core_key(vol: &ReplicatedVolume) -> usize {
    vol as *const ReplicatedVolume as usize ^ 0x7265_706c
}

/// The volume closed: drop this core's leg handles (the hook stays registered, idle).
pub(crate) fn release_core(io: &mut CoreIo, key: usize) {
    let Some(b) = io.locals.remove(&key) else {
        return;
    };
    if let Some((c, _)) = b.downcast_ref::<(Rc<ReplicaCore>, Weak<ReplicatedVolume>)>() {
        for l in &c.legs {
            *l.borrow_mut() = LegHandle::Absent;
        }
        c.gens.iter().for_each(|g| g.set(u64::MAX - 1));
        c.closed.set(true);
    }
}

/// A replica was added or removed: reopen this core's leg handles now (a removed
/// replica's NVMe/TCP queue is closed at once, not at the core's next I/O).
pub(crate) fn refresh_core(io: &mut CoreIo, key: usize) {
    if let Some((c, _)) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<(Rc<ReplicaCore>, Weak<ReplicatedVolume>)>())
    {
        c.refresh();
    }
}

/// The shared per-core state of one replicated volume.
pub(crate) struct ReplicaCore {
    vol: Arc<ReplicatedVolume>,
    hook: Cell<u32>,
    pub(crate) legs: Vec<RefCell<LegHandle>>,
    gens: Vec<Cell<u64>>,
    /// The volume's `legs_gen` when the handles were last checked.
    legs_gen: Cell<u64>,
    /// Writes waiting for their activity-log entry: (op, client tag).
    parked: RefCell<Vec<Option<(IoOp, Tag)>>>,
    free_parked: RefCell<Vec<usize>>,
    /// The volume closed and this core released its legs: `refresh` reopens nothing.
    closed: Cell<bool>,
}

impl ReplicaCore {
    /// This core's instance for `vol` (made on first use).
    pub(crate) fn get(io: &mut CoreIo, vol: &Arc<ReplicatedVolume>) -> Rc<ReplicaCore> {
        let key = core_key(vol);
        let known = io
            .locals
            .get(&key)
            .and_then(|b| b.downcast_ref::<(Rc<ReplicaCore>, Weak<ReplicatedVolume>)>())
            .filter(|(_, w)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(vol)) && w.strong_count() > 0)
            .map(|(c, _)| c.clone());
        if let Some(c) = known {
            return c;
        }
        let c = Rc::new(ReplicaCore {
            vol: vol.clone(),
            hook: Cell::new(0),
            legs: vol
                .legs
                .iter()
                .map(|_| RefCell::new(LegHandle::Absent))
                .collect(),
            gens: vol.legs.iter().map(|_| Cell::new(u64::MAX)).collect(),
            legs_gen: Cell::new(u64::MAX),
            parked: RefCell::new(Vec::new()),
            free_parked: RefCell::new(Vec::new()),
            closed: Cell::new(false),
        });
        c.hook.set(io.register_hook(c.clone()));
        io.locals
            .insert(key, Box::new((c.clone(), Arc::downgrade(vol))));
        c
    }

    /// Reopen legs whose device changed (a remote that connected).
    pub(crate) fn refresh(&self) {
        let all = self.vol.legs_gen.load(Acquire);
        if self.closed.get() || all == self.legs_gen.get() {
            return;
        }
        self.legs_gen.set(all);
        for (i, l) in self.vol.legs.iter().enumerate() {
            let g = l.gen.load(Acquire);
            if g == self.gens[i].get() {
                continue;
            }
            let h = match &*l.dev.read_locked() {
                LegDev::Local(v) => LegHandle::Local(v.open_handle()),
                LegDev::Remote(Some(d)) => LegHandle::Remote(RemoteHandle::open(d)),
                LegDev::Remote(None) => LegHandle::Absent,
            };
            *self.legs[i].borrow_mut() = h;
            self.gens[i].set(g);
        }
    }

    fn regions(&self, offset: u64, len: u64) -> (u64, u64) {
        let s = self.vol.region_shift;
        let first = offset >> s;
        let last = (offset + len.max(1) - 1) >> s;
        (first, last - first + 1)
    }

    /// # Safety
    /// As [`IoHandle::submit`].
    pub(crate) unsafe fn submit(&self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        self.refresh();
        let range = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                Some((offset, u64::from(len)))
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                Some((offset, len))
            }
            IoOp::Flush => None,
        };
        if let Some((offset, len)) = range {
            if offset.checked_add(len).is_none_or(|e| e > self.vol.size()) {
                return io.complete(tag, -libc::EINVAL);
            }
        }
        match (op, range) {
            (IoOp::Read { .. }, _) => {
                let m = self.vol.masks.load(Acquire);
                // A cut-off owner stops serving reads once its replicas stop answering it
                // (a new owner's claim ends its connections): `lease`.
                if !self.vol.read_lease_holds(io.now(), in_sync(m)) {
                    // Wait for the lease (an answer, or the silent replica's drop) rather
                    // than fail at once: a replica node that dies unannounced holds the
                    // writes up to the replication timeout anyway, and a client takes a
                    // slow read better than EIO. Bounded: `LEASE_WAIT_NS`.
                    let slot = self.park(op, tag);
                    let since = crate::lease::ns(io.now()) / 1_000_000;
                    let low = slot & LEASE_SLOT_MASK | (since & 0xFFFF_FFFF) << LEASE_SLOT_BITS;
                    return io.defer_hook(self.hook.get(), ctx(K_LEASE, low));
                }
                // SAFETY: forwarded under the caller's contract.
                unsafe { self.read(io, op, tag, in_sync(m), 0) }
            }
            (IoOp::Flush, _) => {
                // SAFETY: a flush carries no buffer.
                unsafe { self.fan_out(io, op, tag, 0, 0) }
            }
            (_, Some((offset, len))) => {
                let (first, count) = self.regions(offset, len);
                let mut cold = false;
                for r in first..first + count {
                    let w = self.vol.regions[usize_of(r)].fetch_add(START, AcqRel);
                    cold |= w & crate::HOT == 0;
                }
                if !cold {
                    // SAFETY: forwarded under the caller's contract.
                    return unsafe { self.fan_out(io, op, tag, first, count) };
                }
                let Some(rc) = io.remote_completer() else {
                    error!(volume = %self.vol.name, "replicated volume used without a reactor mailbox");
                    self.release(first, count);
                    return io.complete(tag, -libc::EIO);
                };
                let slot = self.park(op, tag);
                let t = io.tracked(Tag::NO_PARENT, 1, self.hook.get(), ctx(K_PARKED, slot));
                self.vol.send(Req::Hot {
                    first,
                    count,
                    done: Done { rc, tag: t },
                });
            }
            (_, None) => unreachable!("only flushes have no range"),
        }
    }

    fn park(&self, op: IoOp, tag: Tag) -> u64 {
        let mut p = self.parked.borrow_mut();
        let slot = match self.free_parked.borrow_mut().pop() {
            Some(s) => {
                p[s] = Some((op, tag));
                s
            }
            None => {
                p.push(Some((op, tag)));
                p.len() - 1
            }
        };
        slot as u64
    }

    /// Take the request parked in `slot` back (once).
    fn unpark(&self, slot: usize) -> (IoOp, Tag) {
        let r = self.parked.borrow_mut()[slot]
            .take()
            .expect("a parked request is resumed once");
        self.free_parked.borrow_mut().push(slot);
        r
    }

    fn release(&self, first: u64, count: u64) {
        let m = self.vol.masks.load(Acquire);
        // Every leg answered before this load: a flush that took an epoch after it was
        // sent after they did, and covers this write (`Leg::flushed`).
        let epoch = self.vol.flush_epoch.load(SeqCst);
        for r in first..first + count {
            let e = &self.vol.written[usize_of(r)];
            if e.load(Relaxed) != epoch {
                e.store(epoch, Release);
            }
            // A copy of this region that overlapped the write is redone (resync.rs).
            let mut rs = resyncing(m);
            while rs != 0 {
                let l = rs.trailing_zeros() as usize;
                rs &= rs - 1;
                self.vol.legs[l].regions[usize_of(r)].fetch_or(REDIRTY, AcqRel);
            }
            let old = self.vol.regions[usize_of(r)].fetch_sub(INFLIGHT_ONE, AcqRel);
            debug_assert!(old & INFLIGHT > 0);
        }
    }

    /// Send a write (or trim, zeroes, flush) to every leg that must have it.
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn fan_out(&self, io: &mut CoreIo, op: IoOp, tag: Tag, first: u64, count: u64) {
        let m = self.vol.masks.load(Acquire);
        let mut targets = in_sync(m);
        let mut resync = resyncing(m);
        while resync != 0 {
            let l = resync.trailing_zeros() as usize;
            resync &= resync - 1;
            // Mark the regions (a copy running on them is redone); a region still to be
            // copied does not get the write: the copy brings it later.
            let mut clean = true;
            for r in first..first + count {
                let old = self.vol.legs[l].regions[usize_of(r)].fetch_or(REDIRTY, AcqRel);
                clean &= old & STATE == CLEAN;
            }
            if clean {
                targets |= 1 << l;
            }
        }
        let parts = targets.count_ones();
        if parts == 0 {
            self.release(first, count);
            return io.complete(tag, -libc::EIO);
        }
        let hook = self.hook.get();
        let done = io.tracked(
            tag,
            parts,
            hook,
            ctx(K_WRITE_DONE, first | count << REGION_BITS),
        );
        // A flush's epoch: once a leg completes it, every write released before now is
        // durable there. Writes pay nothing for this; a flush one atomic add.
        let epoch = matches!(op, IoOp::Flush).then(|| self.vol.flush_epoch.fetch_add(1, SeqCst));
        let mut t = targets;
        while t != 0 {
            let l = t.trailing_zeros() as usize;
            t &= t - 1;
            let child = match epoch {
                Some(e) => io.tracked(
                    done,
                    1,
                    hook,
                    ctx(K_FLUSH, l as u64 | u64::from(e) << EPOCH_SHIFT),
                ),
                None => io.hooked(done, hook, op, ctx(K_LEG, l as u64)),
            };
            // SAFETY: forwarded under the caller's contract; the client's buffer stays
            // valid until `tag` completes, which waits for every leg.
            unsafe { self.legs[l].borrow_mut().submit(io, op, child) };
        }
    }

    /// Read from the preferred in-sync leg not in `tried`.
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    unsafe fn read(&self, io: &mut CoreIo, op: IoOp, tag: Tag, ok: u64, tried: u64) {
        let candidates = ok & !tried;
        let pick = match self.vol.local {
            Some(l) if candidates & (1 << l) != 0 => Some(l),
            _ => (candidates != 0).then(|| candidates.trailing_zeros() as usize),
        };
        let Some(l) = pick else {
            return io.complete(tag, -libc::EIO);
        };
        let c = ctx(K_READ, (tried | 1 << l) | (l as u64) << LAST_SHIFT);
        let child = io.hooked(tag, self.hook.get(), op, c);
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.legs[l].borrow_mut().submit(io, op, child) };
    }

    fn report_failure(&self, io: &mut CoreIo, leg: usize, res: i32, wait: Option<Tag>) {
        let done = match (wait, io.remote_completer()) {
            (Some(tag), Some(rc)) => Some(Done { rc, tag }),
            (Some(tag), None) => {
                io.complete(tag, res);
                None
            }
            (None, _) => None,
        };
        self.vol.send(Req::LegFailed { leg, res, done });
    }
}

impl Continuation for ReplicaCore {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, parent: Tag, op: IoOp, c: u64, res: i32) {
        let low = c & ((1 << KIND_SHIFT) - 1);
        match c >> KIND_SHIFT {
            K_PARKED => {
                let (op, tag) = self.unpark(low as usize);
                let (first, count) = match op {
                    IoOp::Write { offset, len, .. } => self.regions(offset, u64::from(len)),
                    IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                        self.regions(offset, len)
                    }
                    _ => unreachable!("only writes are parked with K_PARKED"),
                };
                if res < 0 {
                    self.release(first, count);
                    return io.complete(tag, res);
                }
                // SAFETY: the client's buffer is valid until `tag` completes (the
                // caller's contract when it was parked).
                unsafe { self.fan_out(io, op, tag, first, count) }
            }
            K_LEASE => {
                let slot = usize_of(low & LEASE_SLOT_MASK);
                let m = self.vol.masks.load(Acquire);
                if self.vol.read_lease_holds(io.now(), in_sync(m)) {
                    let (op, tag) = self.unpark(slot);
                    // SAFETY: the client's buffer is valid until `tag` completes (the
                    // caller's contract when it was parked).
                    return unsafe { self.read(io, op, tag, in_sync(m), 0) };
                }
                let since = low >> LEASE_SLOT_BITS;
                let now = (crate::lease::ns(io.now()) / 1_000_000) & 0xFFFF_FFFF;
                if now.wrapping_sub(since) & 0xFFFF_FFFF >= LEASE_WAIT_MS {
                    let (_, tag) = self.unpark(slot);
                    return io.complete(tag, -libc::EIO);
                }
                io.defer_hook(self.hook.get(), c);
            }
            K_WRITE_DONE => {
                let first = low & REGION_MASK;
                let count = low >> REGION_BITS;
                self.release(first, count);
                io.complete(parent, res)
            }
            K_LEG => {
                // Only errors get here (a hooked part): the persister drops the leg out
                // of sync, then completes this part.
                self.report_failure(io, low as usize, res, Some(parent));
            }
            K_FLUSH => {
                let leg = (low & 0xFF) as usize;
                if res < 0 {
                    return self.report_failure(io, leg, res, Some(parent));
                }
                // A flush answered after the connection broke (resubmitted, perhaps to a
                // restarted node) proves nothing about the writes before the break: only
                // one answered while the count is the persister's may advance `flushed`
                // (the link counts a break before it resubmits anything).
                let l = &self.vol.legs[leg];
                let same_peer = match &*self.legs[leg].borrow() {
                    LegHandle::Remote(h) => h.device_breaks() == l.breaks_seen.load(Acquire),
                    _ => true,
                };
                if same_peer {
                    let e = u32_of(low >> EPOCH_SHIFT).wrapping_add(1);
                    let _ = l.flushed.fetch_update(AcqRel, Acquire, |d| {
                        crate::unflushed(e, d.wrapping_add(1)).then_some(e)
                    });
                }
                io.complete(parent, res)
            }
            K_READ => {
                let tried = low & TRIED_MASK;
                let failed = ((low >> LAST_SHIFT) & 0xFF) as usize;
                self.report_failure(io, failed, res, None);
                let m = self.vol.masks.load(Acquire);
                // SAFETY: the read's buffer is valid until `parent` completes.
                unsafe { self.read(io, op, parent, in_sync(m) & !(1 << failed), tried) }
            }
            _ => unreachable!("unknown replica continuation"),
        }
    }
}

/// One connection's handle to a replicated volume.
pub struct ReplicaHandle {
    vol: Arc<ReplicatedVolume>,
    core: Option<Rc<ReplicaCore>>,
    /// The local leg's volume, for hole checks without a core.
    local: Option<VolumeHandle>,
}

impl ReplicaHandle {
    pub(crate) fn new(vol: Arc<ReplicatedVolume>) -> ReplicaHandle {
        let local = vol.local_volume().map(|v| v.open_handle());
        ReplicaHandle {
            vol,
            core: None,
            local,
        }
    }
}

impl ExportHandle for ReplicaHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let core = match &self.core {
            Some(c) => c.clone(),
            None => {
                let c = ReplicaCore::get(io, &self.vol);
                self.core = Some(c.clone());
                c
            }
        };
        // SAFETY: forwarded under the caller's contract.
        unsafe { core.submit(io, op, tag) }
    }

    fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        let m = self.vol.masks.load(Acquire);
        // A hole is answered without a read: only under the read lease (`lease`).
        if !self
            .vol
            .read_lease_holds(std::time::Instant::now(), in_sync(m))
        {
            return false;
        }
        match (self.vol.local, &mut self.local) {
            (Some(l), Some(h)) if in_sync(m) & (1 << l) != 0 => h.is_hole(offset, len),
            _ => false,
        }
    }
}
