//! The replica set's persister: the one thread that changes the replica-set file. The
//! datapath asks it (through a channel) to put regions in the activity log and to drop a
//! failed leg out of sync, and waits for its answer through the core's mailbox; requests
//! that arrive together share one write and one `fdatasync`.

use std::io;
use std::sync::atomic::Ordering::*;
use std::sync::{mpsc, Weak};
use std::time::Duration;
use tessera_io::cast::usize_of;
use tessera_io::sync::{MutexExt, RwLockExt};

use tessera_io::reactor::RemoteCompleter;
use tessera_io::Tag;
use tracing::{error, info, warn};

use tessera_device::BlockDevice;

use crate::meta::{LegDesc, LegState, MetaFile, FLAG_CLEAN};
use crate::{
    in_sync, resyncing, unflushed, LegDev, ReplicatedVolume, CLEAN, DIRTY, HOT, INFLIGHT,
    INFLIGHT_ONE, REDIRTY, STARTED_SHIFT, STATE,
};

/// Who waits for a request: a tag on a reactor core.
pub(crate) struct Done {
    pub(crate) rc: RemoteCompleter,
    pub(crate) tag: Tag,
}

impl Done {
    fn complete(self, res: i32) {
        self.rc.complete(self.tag, res);
    }
}

pub(crate) enum Req {
    /// Put regions `[first, first + count)` in the activity log (rule 1), then complete.
    Hot { first: u64, count: u64, done: Done },
    /// Leg `leg` failed an I/O with `res`: mark it out of sync (rule 2) and complete
    /// `done` with 0, or with `res` when it is the last leg in sync (that I/O fails).
    LegFailed {
        leg: usize,
        res: i32,
        done: Option<Done>,
    },
    /// A resync made these regions of `leg` durable: clear their dirty bits (rule 5).
    Cleaned { leg: usize, regions: Vec<u64> },
    /// A resync of `leg` found nothing left to copy: the leg is in sync again (reply
    /// false if it failed meanwhile).
    ResyncDone {
        leg: usize,
        reply: mpsc::Sender<bool>,
    },
    /// Flush the remote legs in mask `legs` (those that received writes), then write an
    /// empty activity log and the clean flag if no write is in flight.
    Close { legs: u64, reply: mpsc::Sender<()> },
    /// A resync copies `region` with writes to it held (its copies kept being overlapped
    /// by writes): take it out of the activity log in memory, so that new writes to it
    /// ask here first, and hold them until [`Req::Unlock`]; then complete `done`.
    Lock { region: u64, done: Done },
    /// The held copy of `region` is over: the writes held for it go on.
    Unlock { region: u64 },
    /// Hold every write that starts from now on (as [`Req::Lock`] does for one region)
    /// and reply once none is in flight on any leg: the legs in sync are then identical,
    /// and stay so until [`Req::Resume`] (a snapshot on every replica at one point).
    Quiesce { reply: mpsc::Sender<()> },
    /// The quiesce is over: the held writes go on.
    Resume,
    /// Put a new replica in a vacant slot, needing a full copy.
    AddLeg {
        desc: LegDesc,
        reply: mpsc::Sender<io::Result<()>>,
    },
    /// Take leg `leg` out of the set (refused for the last one in sync).
    RemoveLeg {
        leg: usize,
        reply: mpsc::Sender<io::Result<()>>,
    },
    /// A full copy of `leg` from `source` starts: turn "needs a full copy" into "out of
    /// sync" with the source's allocated regions dirty (reply false if it could not).
    BeginFull {
        leg: usize,
        source: usize,
        reply: mpsc::Sender<bool>,
    },
}

/// The leg reads are served from after a crash: the local one if in sync, else the first
/// in sync.
pub(crate) fn source_leg(states: &[LegState], local: Option<usize>) -> Option<usize> {
    local
        .filter(|&l| states[l] == LegState::InSync)
        .or_else(|| states.iter().position(|s| *s == LegState::InSync))
}

pub(crate) fn run(vol: Weak<ReplicatedVolume>, mut m: MetaFile, rx: mpsc::Receiver<Req>) {
    let mut cursor = 0u64;
    // Per region, the started-writes count seen at the last idle check.
    let mut seen: Vec<u16> = vec![0; usize_of(m.header.regions)];
    let mut last_tick = std::time::Instant::now();
    // Regions a resync copies with writes held, and the writes' log requests held for them.
    let mut locked: std::collections::BTreeSet<u64> = Default::default();
    let mut held: Vec<(u64, u64, Done)> = Vec::new();
    // A quiesce holds every region's writes; its caller waits until nothing is in flight.
    let mut frozen = false;
    let mut quiesce_waiter: Option<mpsc::Sender<()>> = None;
    loop {
        if let Some(tx) = quiesce_waiter.take() {
            match vol.upgrade() {
                Some(v) if !drained(&v, &held) => quiesce_waiter = Some(tx),
                _ => {
                    let _ = tx.send(());
                }
            }
        }
        if last_tick.elapsed() >= IDLE_TICK {
            last_tick = std::time::Instant::now();
            let Some(v) = vol.upgrade() else { return };
            if evict_idle(&v, &mut m, &mut seen) {
                if let Err(e) = m.commit() {
                    error!(volume = %v.name, error = %e, "replicated volume: cannot write the replica-set file");
                }
                v.hot_regions.store(m.count(0), Relaxed);
            }
        }
        // At least every half second (the longest wait below), and before any request:
        // a remote leg whose connection broke is out of sync before anything else.
        if let Some(v) = vol.upgrade() {
            if watch_legs(&v, &mut m) {
                if let Err(e) = m.commit() {
                    error!(volume = %v.name, error = %e, "replicated volume: cannot write the replica-set file");
                }
            }
        }
        // While a quiesce waits for the writes in flight to end, look again soon.
        let wait = if quiesce_waiter.is_some() {
            Duration::from_micros(200)
        } else {
            Duration::from_millis(500)
        };
        let first = match rx.recv_timeout(wait) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if vol.strong_count() == 0 {
                    return;
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let Some(v) = vol.upgrade() else { return };
        let mut batch = vec![first];
        while let Ok(r) = rx.try_recv() {
            batch.push(r);
        }
        let mut after: Vec<Action> = Vec::new();
        let mut closing = None;
        for req in batch {
            match req {
                Req::Hot { first, count, done } => {
                    if frozen || (first..first + count).any(|r| locked.contains(&r)) {
                        held.push((first, count, done));
                        continue;
                    }
                    hot(&v, &mut m, first, count);
                    after.push(Action::Hot { first, count, done });
                }
                Req::Lock { region, done } => {
                    locked.insert(region);
                    // Out of the log in memory: a write that starts now asks here first
                    // (and is held); the log on disk keeps it until a lazy clear (rule 4).
                    cool(&v.regions[usize_of(region)]);
                    after.push(Action::Complete(done, 0));
                }
                Req::Unlock { region } => {
                    locked.remove(&region);
                    if !frozen {
                        release_held(&v, &mut m, &mut held, &locked, &mut after);
                    }
                }
                Req::Quiesce { reply } => {
                    frozen = true;
                    v.regions.iter().for_each(cool);
                    quiesce_waiter = Some(reply);
                }
                Req::Resume => {
                    frozen = false;
                    quiesce_waiter = None;
                    release_held(&v, &mut m, &mut held, &locked, &mut after);
                }
                Req::LegFailed { leg, res, done } => {
                    let durable = v.legs[leg].flushed.load(Acquire);
                    let res = leg_failed(&v, &mut m, leg, res, durable);
                    if let Some(d) = done {
                        after.push(Action::Complete(d, res));
                    }
                }
                Req::Cleaned { leg, regions } => {
                    if m.header.states[leg] != LegState::InSync {
                        for r in regions {
                            if v.legs[leg].regions[usize_of(r)].load(Acquire) & STATE == CLEAN {
                                m.set_dirty(leg, r, false);
                            }
                        }
                        v.legs[leg].dirty_regions.store(m.count(1 + leg), Relaxed);
                    }
                }
                Req::ResyncDone { leg, reply } => {
                    let ok = resync_done(&v, &mut m, leg);
                    after.push(Action::Reply(reply, ok));
                }
                Req::Close { legs, reply } => {
                    flush_for_close(&v, &mut m, legs);
                    closing = Some(reply);
                }
                Req::AddLeg { desc, reply } => {
                    let _ = reply.send(add_leg(&v, &mut m, desc));
                }
                Req::RemoveLeg { leg, reply } => {
                    let _ = reply.send(remove_leg(&v, &mut m, leg));
                }
                Req::BeginFull { leg, source, reply } => {
                    let _ = reply.send(begin_full(&v, &mut m, leg, source));
                }
            }
        }
        evict(&v, &mut m, &mut cursor, closing.is_some());
        if closing.is_some() && m.count(0) == 0 {
            m.set_flags(FLAG_CLEAN);
        }
        let ok = match m.commit() {
            Ok(()) => true,
            Err(e) => {
                // Nothing that waits may proceed as if its log entry were on disk: those
                // I/Os fail (EIO) instead of being acknowledged.
                error!(volume = %v.name, error = %e, "replicated volume: cannot write the replica-set file; failing the I/Os that wait for it");
                false
            }
        };
        v.al_writes.fetch_add(1, Relaxed);
        for a in after {
            match a {
                Action::Hot { first, count, done } => {
                    // A region held meanwhile (a lock or a quiesce later in this batch)
                    // stays out of the log in memory, so its next writes still ask here;
                    // this write itself was admitted and is waited for as in flight.
                    if ok && !frozen {
                        for r in (first..first + count).filter(|r| !locked.contains(r)) {
                            v.regions[usize_of(r)].fetch_or(HOT, Release);
                        }
                    }
                    done.complete(if ok { 0 } else { -libc::EIO });
                }
                Action::Complete(d, res) => d.complete(if ok { res } else { -libc::EIO }),
                Action::Reply(tx, res) => {
                    let _ = tx.send(ok && res);
                }
            }
        }
        v.hot_regions.store(m.count(0), Relaxed);
        if let Some(reply) = closing {
            for (_, _, done) in held.drain(..) {
                done.complete(-libc::EIO);
            }
            info!(volume = %v.name, clean = m.header.flags & FLAG_CLEAN != 0, "replicated volume closed");
            let _ = reply.send(());
            return;
        }
    }
}

/// Take a region out of the activity log in memory: a write that starts on it from now
/// on asks the persister first (the log on disk keeps it until a lazy clear, rule 4).
fn cool(w: &std::sync::atomic::AtomicU32) {
    let mut x = w.load(Acquire);
    while let Err(now) = w.compare_exchange(x, x & !HOT, AcqRel, Acquire) {
        x = now;
    }
}

/// Let the held writes that no locked region covers go on (logged with this batch).
fn release_held(
    v: &ReplicatedVolume,
    m: &mut MetaFile,
    held: &mut Vec<(u64, u64, Done)>,
    locked: &std::collections::BTreeSet<u64>,
    after: &mut Vec<Action>,
) {
    let (go, stay): (Vec<_>, Vec<_>) = std::mem::take(held)
        .into_iter()
        .partition(|(f, c, _)| !(*f..*f + *c).any(|r| locked.contains(&r)));
    *held = stay;
    for (first, count, done) in go {
        hot(v, m, first, count);
        after.push(Action::Hot { first, count, done });
    }
}

/// Whether no write is in flight on any leg: every region's in-flight count is made only
/// of writes held here (they were counted when they started, before they asked).
fn drained(v: &ReplicatedVolume, held: &[(u64, u64, Done)]) -> bool {
    let mut waiting = vec![0u32; v.regions.len()];
    for (first, count, _) in held {
        for r in *first..first + count {
            waiting[usize_of(r)] += 1;
        }
    }
    v.regions
        .iter()
        .zip(waiting)
        .all(|(w, h)| (w.load(Acquire) & INFLIGHT) / INFLIGHT_ONE == h)
}

/// What to do once a batch is on disk.
enum Action {
    Hot { first: u64, count: u64, done: Done },
    Complete(Done, i32),
    Reply(mpsc::Sender<bool>, bool),
}

fn hot(v: &ReplicatedVolume, m: &mut MetaFile, first: u64, count: u64) {
    let masks = v.masks.load(Acquire);
    for r in first..first + count {
        m.set_hot(r, true);
        // Rule 3: a leg out of sync (resyncing or not) gets the region's dirty bit in the
        // same write. A leg that is not resyncing will not receive the write: its view of
        // the region becomes DIRTY too, so a resync started later copies it. (A resyncing
        // leg receives writes to its clean regions; the bit covers a failure before one
        // lands.)
        for l in 0..m.header.states.len() {
            if m.header.states[l] != LegState::OutOfSync {
                continue;
            }
            if m.set_dirty(l, r, true) {
                v.legs[l].dirty_regions.fetch_add(1, Relaxed);
            }
            if resyncing(masks) & (1 << l) == 0 {
                let _ = v.legs[l].regions[usize_of(r)].fetch_update(AcqRel, Acquire, |x| {
                    (x & STATE == CLEAN).then_some(DIRTY | REDIRTY)
                });
            }
        }
    }
}

/// Leg `leg` failed an I/O with `res` (or its connection broke: `res` is `-ENOTCONN`);
/// `durable` is its `flushed` epoch, read before anything could move it past a break
/// (see `watch_legs`).
fn leg_failed(v: &ReplicatedVolume, m: &mut MetaFile, leg: usize, res: i32, durable: u32) -> i32 {
    let masks = v.masks.load(Acquire);
    let bit = 1u64 << leg;
    if in_sync(masks) & bit != 0 && in_sync(masks) & !bit == 0 {
        // The last leg in sync stays so (it holds the only current copy); the I/O fails.
        warn!(volume = %v.name, leg = %v.legs[leg].place(), error = res,
            "replicated volume: the last in-sync replica failed an I/O; the I/O fails");
        return res;
    }
    if in_sync(masks) & bit == 0 && resyncing(masks) & bit == 0 {
        return 0; // already out of sync and idle: nothing it lacks is unrecorded
    }
    // In a cluster, the drop is recorded in the volume's spec first (docs/format.md §12
    // rule 4): an owner that lost the volume cannot record it, so it never acknowledges
    // a write without a replica that a new owner may hold.
    if in_sync(masks) & bit != 0 {
        if let Some(f) = v.leg_fence() {
            if let Err(why) = f.before_drop(&v.name, &v.legs[leg].place()) {
                error!(volume = %v.name, leg = %v.legs[leg].place(), error = res, reason = %why,
                    "replicated volume: the replica cannot be dropped; the I/O fails");
                return res;
            }
        }
    }
    // Datapath first: no new I/O goes to the leg, the resync (if any) stops.
    v.masks.fetch_and(!(bit | bit << 8), AcqRel);
    let l = &v.legs[leg];
    *l.last_error.locked() = Some(format!(
        "I/O failed: {}",
        std::io::Error::from_raw_os_error(-res)
    ));
    if m.header.states[leg] == LegState::InSync {
        m.set_state(leg, LegState::OutOfSync);
    }
    mark_lost(v, m, leg, durable);
    l.state.store(m.header.states[leg] as u8, Relaxed);
    let full = m.header.states[leg] == LegState::NeedsFull;
    for (r, s) in l.regions.iter().enumerate() {
        let d = full || crate::meta::bit(&m.dirty[leg], r as u64);
        // DIRTY|REDIRTY makes a copy in progress fail its final compare-exchange.
        s.store(if d { DIRTY | REDIRTY } else { CLEAN }, Release);
    }
    l.dirty_regions.store(
        if full {
            m.header.regions
        } else {
            m.count(1 + leg)
        },
        Relaxed,
    );
    warn!(volume = %v.name, leg = %l.place(), error = res,
        dirty_regions = l.dirty_regions.load(Relaxed),
        "replicated volume: replica dropped out of sync");
    0
}

/// Rule 2: mark dirty for `leg` (already out of the state word) every region it may lack:
/// those with a write in flight (or waiting for the log), and those written since its
/// last completed flush (flush epoch `durable`): a leg that failed because its node
/// stopped lost what it had acknowledged but not made durable. A write that starts now
/// skips the leg; such a write must find its region out of the activity log, so that it
/// comes here (rule 3, the leg now out of sync) before it starts: a region in the log is
/// taken out of it in memory. Precise: a leg that fails after a quiet, flushed spell
/// lacks nothing.
fn mark_lost(v: &ReplicatedVolume, m: &mut MetaFile, leg: usize, durable: u32) {
    for (r, w) in v.regions.iter().enumerate() {
        let r64 = r as u64;
        loop {
            let x = w.load(Acquire);
            if x & INFLIGHT != 0 {
                m.set_dirty(leg, r64, true);
                break;
            }
            // A write is released (its in-flight count taken back) after its epoch was
            // stored: one seen done here has its epoch seen too.
            if unflushed(v.written[r].load(Acquire), durable) {
                m.set_dirty(leg, r64, true);
            }
            if x & HOT == 0 || w.compare_exchange(x, x & !HOT, AcqRel, Acquire).is_ok() {
                break;
            }
        }
    }
}

/// Drop every remote leg that receives writes and whose connection broke since the last
/// look: its node may have restarted and lost its unflushed writes, which a reconnect
/// and resubmission hide from the I/Os. True if the replica-set file changed.
fn watch_legs(v: &ReplicatedVolume, m: &mut MetaFile) -> bool {
    let masks = v.masks.load(Acquire);
    let mut changed = false;
    for (i, l) in v.legs.iter().enumerate() {
        if (in_sync(masks) | resyncing(masks)) & (1 << i) == 0 || v.closing.load(Acquire) {
            continue;
        }
        let breaks = match &*l.dev.read_locked() {
            LegDev::Remote(Some(d)) => d.breaks(),
            _ => continue,
        };
        if breaks == l.breaks_seen.load(Acquire) {
            continue;
        }
        // Read before `breaks_seen` moves: until then no flush answered after the break
        // advances it (handle.rs, `K_FLUSH`).
        let durable = l.flushed.load(Acquire);
        l.breaks_seen.store(breaks, Release);
        warn!(volume = %v.name, leg = %l.place(),
            "replicated volume: the connection to a replica broke; it may have lost its unflushed writes");
        leg_failed(v, m, i, -libc::ENOTCONN, durable);
        changed = true;
    }
    changed
}

/// Closing: flush every remote leg in `legs` (the owner's clean close empties the
/// activity log, and a leg's node could still lose what it holds unflushed); one whose
/// flush fails, or whose connection broke, is marked out of sync as a failed leg is.
fn flush_for_close(v: &ReplicatedVolume, m: &mut MetaFile, legs: u64) {
    for (i, l) in v.legs.iter().enumerate() {
        if legs & (1 << i) == 0 {
            continue;
        }
        let dev = match &*l.dev.read_locked() {
            LegDev::Remote(Some(d)) => d.clone(),
            _ => continue,
        };
        let durable = l.flushed.load(Acquire);
        let flushed = dev.sync();
        if flushed.is_ok() && dev.breaks() == l.breaks_seen.load(Acquire) {
            continue;
        }
        warn!(volume = %v.name, leg = %l.place(), error = ?flushed.err(),
            "replicated volume: a replica could not be flushed at close; it is out of sync");
        if m.header.states[i] == LegState::InSync {
            m.set_state(i, LegState::OutOfSync);
            l.state.store(LegState::OutOfSync as u8, Relaxed);
        }
        mark_lost(v, m, i, durable);
    }
}

fn resync_done(v: &ReplicatedVolume, m: &mut MetaFile, leg: usize) -> bool {
    let bit = 1u64 << leg;
    let l = &v.legs[leg];
    if resyncing(v.masks.load(Acquire)) & bit == 0
        || l.regions.iter().any(|s| s.load(Acquire) & STATE != CLEAN)
    {
        return false;
    }
    m.clear_dirty_all(leg);
    m.set_state(leg, LegState::InSync);
    if let Err(e) = m.commit() {
        error!(volume = %v.name, error = %e, "replicated volume: cannot record a finished resync");
        return false;
    }
    l.state.store(LegState::InSync as u8, Relaxed);
    l.dirty_regions.store(0, Relaxed);
    // In sync before not resyncing: a writer reading the word in between sees one of
    // the two and sends to the leg either way.
    v.masks.fetch_or(bit, AcqRel);
    v.masks.fetch_and(!(bit << 8), AcqRel);
    *l.last_error.locked() = None;
    info!(volume = %v.name, leg = %l.place(), "replicated volume: replica back in sync");
    if let Some(f) = v.leg_fence() {
        f.after_in_sync(&v.name, &l.place());
    }
    true
}

/// How often regions nobody wrote since the previous look leave the activity log (besides
/// leaving it when it is over capacity): what the owner's crash leaves to reconcile
/// shrinks once writes move elsewhere, at the cost of one log write when a region idle
/// that long is written again.
const IDLE_TICK: Duration = Duration::from_secs(30);

/// Whether region `r`'s writes are durable on every leg that receives writes (mask
/// `masks`): only then may it leave the activity log (rule 4). After the owner's crash
/// the restart reconciles the log's regions only, so a region out of the log must read
/// the same on every leg whatever the crash lost; and a write not yet flushed may be
/// lost on one leg and kept on another (the owner's own pool loses a first write whose
/// allocation it had not committed; a replica's node keeps it).
fn durable_everywhere(v: &ReplicatedVolume, r: usize, masks: u64) -> bool {
    let written = v.written[r].load(Acquire);
    let mut legs = in_sync(masks) | resyncing(masks);
    while legs != 0 {
        let l = legs.trailing_zeros() as usize;
        legs &= legs - 1;
        if unflushed(written, v.legs[l].flushed.load(Acquire)) {
            return false;
        }
    }
    true
}

/// Flush every leg that receives writes, as a client's FLUSH does (the local volume by
/// a pool commit, a remote one by a FLUSH), so that the regions released so far become
/// durable everywhere and may leave the activity log. Called when the log must shrink
/// and its candidates are not durable yet: a client that never flushes still gets a
/// log within its capacity. A leg whose flush fails, or whose connection broke
/// meanwhile, keeps its flush epoch: its regions stay in the log (the datapath or
/// [`watch_legs`] drops the leg).
fn flush_legs(v: &ReplicatedVolume) {
    let masks = v.masks.load(Acquire);
    // Writes released before this are covered (as in `ReplicaCore::fan_out`'s flush).
    let durable = v.flush_epoch.fetch_add(1, SeqCst).wrapping_add(1);
    let mut legs = in_sync(masks) | resyncing(masks);
    while legs != 0 {
        let i = legs.trailing_zeros() as usize;
        legs &= legs - 1;
        let l = &v.legs[i];
        let dev = match &*l.dev.read_locked() {
            LegDev::Local(vol) => Ok(vol.clone()),
            LegDev::Remote(Some(d)) => Err(d.clone()),
            LegDev::Remote(None) => continue,
        };
        let flushed = match dev {
            Ok(vol) => vol.sync().map_err(|e| e.to_string()),
            // This thread is the one that moves `breaks_seen`: a break during the flush
            // shows as a count that differs from it.
            Err(d) => match d.sync() {
                Ok(()) if d.breaks() == l.breaks_seen.load(Acquire) => Ok(()),
                Ok(()) => Err("the connection broke".to_string()),
                Err(e) => Err(e.to_string()),
            },
        };
        match flushed {
            Ok(()) => {
                let _ = l.flushed.fetch_update(AcqRel, Acquire, |d| {
                    unflushed(durable, d.wrapping_add(1)).then_some(durable)
                });
            }
            Err(e) => warn!(volume = %v.name, leg = %l.place(), error = %e,
                "replicated volume: flushing a replica for the activity log failed; its regions stay in the log"),
        }
    }
}

/// Let regions with no write in flight and none started since the last tick leave the
/// activity log once durable on every leg (flushing the legs first if some are not);
/// their clear is written lazily, rule 4. True if any left.
fn evict_idle(v: &ReplicatedVolume, m: &mut MetaFile, seen: &mut [u16]) -> bool {
    let idle = |seen: u16, x: u32| {
        x & HOT != 0 && x & INFLIGHT == 0 && (x >> STARTED_SHIFT) as u16 == seen
    };
    let masks = v.masks.load(Acquire);
    if v.regions.iter().enumerate().any(|(r, w)| {
        let x = w.load(Acquire);
        idle(seen[r], x) && !durable_everywhere(v, r, masks)
    }) {
        flush_legs(v);
    }
    let masks = v.masks.load(Acquire);
    let mut any = false;
    for (r, w) in v.regions.iter().enumerate() {
        let x = w.load(Acquire);
        // Durability is read between the load and the exchange: a write that starts or
        // ends in between changes the word (its in-flight or started count).
        if idle(seen[r], x)
            && durable_everywhere(v, r, masks)
            && w.compare_exchange(x, x & !HOT, AcqRel, Relaxed).is_ok()
        {
            m.set_hot(r as u64, false);
            any = true;
        }
        seen[r] = (x >> STARTED_SHIFT) as u16;
    }
    any
}

/// Keep the activity log within its capacity (or empty it, closing): regions with no
/// write in flight and durable on every leg leave it (rule 4); when too few are, the
/// legs are flushed first.
fn evict(v: &ReplicatedVolume, m: &mut MetaFile, cursor: &mut u64, all: bool) {
    let cap = u64::from(m.header.al_capacity.max(1));
    let mut hot = m.count(0);
    if !all && hot <= cap {
        return;
    }
    let target = if all { 0 } else { cap * 3 / 4 };
    let n = m.header.regions;
    let masks = v.masks.load(Acquire);
    let ready = (0..n)
        .filter(|&r| crate::meta::bit(&m.hot, r))
        .filter(|&r| {
            v.regions[usize_of(r)].load(Acquire) & INFLIGHT == 0
                && durable_everywhere(v, usize_of(r), masks)
        })
        .count() as u64;
    if hot.saturating_sub(ready) > target {
        flush_legs(v);
    }
    let masks = v.masks.load(Acquire);
    for _ in 0..n {
        if hot <= target {
            break;
        }
        let r = *cursor;
        *cursor = (*cursor + 1) % n;
        if !crate::meta::bit(&m.hot, r) {
            continue;
        }
        let w = &v.regions[usize_of(r)];
        let x = w.load(Acquire);
        if x & INFLIGHT == 0
            && durable_everywhere(v, usize_of(r), masks)
            && w.compare_exchange(x, x & !HOT, AcqRel, Relaxed).is_ok()
        {
            m.set_hot(r, false);
            hot -= 1;
        }
    }
}

fn add_leg(v: &ReplicatedVolume, m: &mut MetaFile, desc: LegDesc) -> io::Result<()> {
    // A slot whose previous resync task is still winding down is left alone.
    let slot = v
        .legs
        .iter()
        .position(|l| l.is_vacant() && !l.progress.running.load(Acquire))
        .filter(|&s| s <= m.header.states.len())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "volume '{}' has {} replicas already, the most a replica set holds",
                    v.name,
                    crate::meta::MAX_LEGS
                ),
            )
        })?;
    m.set_leg(slot, desc.clone(), LegState::NeedsFull)?;
    if let Err(e) = m.commit() {
        m.set_leg(slot, LegDesc::Vacant, LegState::Vacant)?;
        return Err(e);
    }
    let l = &v.legs[slot];
    *l.desc.write_locked() = desc;
    *l.dev.write_locked() = LegDev::Remote(None);
    v.bump_gen(slot);
    for s in l.regions.iter() {
        s.store(DIRTY, Release);
    }
    l.dirty_regions.store(m.header.regions, Relaxed);
    let p = &l.progress;
    for c in [
        &p.total,
        &p.copied,
        &p.copied_total,
        &p.recopied_total,
        &p.regions_total,
    ] {
        c.store(0, Relaxed);
    }
    l.set_error(None);
    // Last: from here the supervisor sees the leg and starts its copy.
    l.state.store(LegState::NeedsFull as u8, Release);
    info!(volume = %v.name, leg = %l.place(), slot, "replicated volume: replica added, it needs a full copy");
    Ok(())
}

fn remove_leg(v: &ReplicatedVolume, m: &mut MetaFile, leg: usize) -> io::Result<()> {
    let bit = 1u64 << leg;
    let masks = v.masks.load(Acquire);
    if in_sync(masks) & bit != 0 && in_sync(masks) & !bit == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is the only replica of '{}' in sync: it cannot be removed",
                v.legs[leg].place(),
                v.name
            ),
        ));
    }
    // Datapath first (no new I/O to it, its resync stops), then the file. A crash in
    // between finds the leg in sync on disk and reconciles the activity log's regions,
    // which hold every write it missed.
    v.masks.fetch_and(!(bit | bit << 8), AcqRel);
    m.set_leg(leg, LegDesc::Vacant, LegState::Vacant)?;
    let r = m.commit();
    if let Err(e) = &r {
        error!(volume = %v.name, error = %e, "replicated volume: cannot record a removed replica; it stays out of the datapath");
    }
    v.legs[leg].state.store(LegState::Vacant as u8, Release);
    v.legs[leg].set_error(None);
    r
}

fn begin_full(v: &ReplicatedVolume, m: &mut MetaFile, leg: usize, source: usize) -> bool {
    match m.header.states.get(leg) {
        Some(LegState::NeedsFull) => {}
        Some(LegState::OutOfSync) => return true,
        // Removed meanwhile (or in sync): nothing to copy.
        _ => return false,
    }
    let shift = v.region_shift;
    let size = v.size();
    // Thin: the source's allocated regions, from the local pool's map. A remote source's
    // allocation is unknown: everything.
    let local = (v.local == Some(source))
        .then(|| v.local_volume())
        .flatten();
    match local {
        Some(vol) => {
            let mut at = 0u64;
            while at < size {
                let runs = vol.allocation_runs(at, size - at, 4096);
                let before = at;
                for (len, allocated) in runs {
                    if allocated && len > 0 {
                        for r in (at >> shift)..=((at + len - 1) >> shift) {
                            m.set_dirty(leg, r, true);
                        }
                    }
                    at += len;
                }
                if at == before {
                    break;
                }
            }
        }
        None => {
            for r in 0..m.header.regions {
                m.set_dirty(leg, r, true);
            }
        }
    }
    // Writes in flight may allocate regions the map does not show yet; they are all in
    // the activity log. Later writes to other regions pass through `hot` (rule 3).
    for r in 0..m.header.regions {
        if crate::meta::bit(&m.hot, r) {
            m.set_dirty(leg, r, true);
        }
    }
    m.set_state(leg, LegState::OutOfSync);
    if let Err(e) = m.commit() {
        error!(volume = %v.name, error = %e, "replicated volume: cannot start a full copy");
        m.set_state(leg, LegState::NeedsFull);
        return false;
    }
    let l = &v.legs[leg];
    for (r, s) in l.regions.iter().enumerate() {
        let d = crate::meta::bit(&m.dirty[leg], r as u64);
        s.store(if d { DIRTY } else { CLEAN }, Release);
    }
    let dirty = m.count(1 + leg);
    l.dirty_regions.store(dirty, Relaxed);
    l.state.store(LegState::OutOfSync as u8, Release);
    info!(volume = %v.name, leg = %l.place(), source = %v.legs[source].place(),
        regions = dirty, of = m.header.regions,
        "replicated volume: full copy of the allocated regions starts");
    true
}
