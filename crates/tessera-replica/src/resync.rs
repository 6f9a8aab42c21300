//! Bringing a leg back in sync: a supervisor thread per replicated volume notices legs
//! out of sync that can be reached again, and a resync task on a reactor core copies
//! their dirty regions from an in-sync leg, while clients keep writing.
//!
//! Copy protocol per region (the region's state for the leg, `Leg::regions`):
//! the task stores COPYING, reads the region from the source and writes it to the leg,
//! then compare-exchanges COPYING → CLEAN. Every write to the region meanwhile sets
//! REDIRTY (at submission and at completion, `handle.rs`), which makes the exchange fail
//! and the region be copied again; from CLEAN on, writes go to the leg too. Cleaned
//! regions are reported to the persister only after a flush of the leg (format rule 5);
//! when a pass finds nothing left, the supervisor asks the persister to declare the leg
//! in sync.

use std::rc::Rc;
use std::sync::atomic::Ordering::*;
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::sync::{MutexExt, RwLockExt};

use tessera_device::BlockDevice;
use tessera_io::reactor::Task;
use tessera_io::{AlignedBuf, CoreIo, IoOp, Tag};
use tracing::{info, warn};

use crate::handle::ReplicaCore;
use crate::meta::LegState;
use crate::persist::Req;
use crate::{
    connect_remote, in_sync, resyncing, LegDev, ReplicatedVolume, CLEAN, COPYING, DIRTY, STATE,
};

/// Bytes one copy operation moves.
const CHUNK: u64 = 256 << 10;
/// Copies of one region redone because writes kept hitting it, before it is left for the
/// next pass.
const MAX_RETRIES: u32 = 8;
/// Cleaned regions reported per flush of the leg.
const REPORT_EVERY: usize = 64;
const SLOT_FLUSH: u32 = 1 << 20;
const SLOT_TIMER: u32 = (1 << 20) + 1;
const SLOT_END: u32 = (1 << 20) + 2;
const SLOT_LOCKED: u32 = (1 << 20) + 3;
/// Copies of one region redone under the lock (writes held) before the pass gives up on
/// it: only the writes in flight when the lock was taken can overlap them.
const MAX_LOCKED_RETRIES: u32 = 64;

/// The supervisor: every half second, reconnect legs that are away and start a resync for
/// those out of sync and reachable; declare a leg in sync when its resync found nothing
/// left.
pub(crate) fn supervise(vol: Weak<ReplicatedVolume>) {
    let mut next_try: Vec<Instant> = Vec::new();
    let mut backoff: Vec<Duration> = Vec::new();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let Some(v) = vol.upgrade() else { return };
        if v.closing.load(Acquire) {
            return;
        }
        if next_try.is_empty() {
            next_try = vec![Instant::now(); v.legs.len()];
            backoff = vec![Duration::from_millis(500); v.legs.len()];
        }
        let m = v.masks.load(Acquire);
        for (i, l) in v.legs.iter().enumerate() {
            let bit = 1u64 << i;
            if l.is_vacant() {
                continue;
            }
            if in_sync(m) & bit != 0 {
                backoff[i] = Duration::from_millis(500);
                continue;
            }
            if resyncing(m) & bit != 0 {
                if !l.progress.running.load(Acquire) {
                    finish(&v, i);
                }
                continue;
            }
            if Instant::now() < next_try[i] {
                continue;
            }
            next_try[i] = Instant::now() + backoff[i];
            backoff[i] = (backoff[i] * 2).min(Duration::from_secs(10));
            if !reachable(&v, i) {
                continue;
            }
            // The leg answers: connections lost before now (the outage a resync repairs,
            // the probe's reconnect) are accounted for by its dirty regions; one lost
            // from now on, once it resyncs, drops it again (`persist::watch_legs`). (A
            // next pass of a running resync, `finish`, keeps the count it had.)
            if let LegDev::Remote(Some(d)) = &*l.dev.read_locked() {
                l.breaks_seen.store(d.breaks(), Release);
            }
            let Some(source) = pick_source(&v, m) else {
                continue;
            };
            start(&v, i, source);
        }
    }
}

/// Whether leg `i` answers now (connecting a remote that never was).
fn reachable(v: &ReplicatedVolume, i: usize) -> bool {
    let l = &v.legs[i];
    let dev = match &*l.dev.read_locked() {
        LegDev::Local(_) => return true,
        LegDev::Remote(d) => d.clone(),
    };
    let dev = match dev {
        Some(d) => d,
        None => {
            let crate::meta::LegDesc::Remote { spec, .. } = &l.desc() else {
                return false;
            };
            match connect_remote(spec, &v.opts) {
                Ok(d) => {
                    *l.dev.write_locked() = LegDev::Remote(Some(d.clone()));
                    v.bump_gen(i);
                    d
                }
                Err(e) => {
                    *l.last_error.locked() = Some(e.to_string());
                    return false;
                }
            }
        }
    };
    if dev.size() < v.size() {
        *l.last_error.locked() = Some(format!(
            "the replica has {} bytes, the volume {}",
            dev.size(),
            v.size()
        ));
        return false;
    }
    // A read through the synchronous queue: the peer serves I/O again.
    let mut probe = vec![0u8; 4096];
    let sent = Instant::now();
    match dev.read_at(0, &mut probe) {
        Ok(()) => {
            l.lease.answered_at(sent);
            // The per-core queues that gave up on the peer reconnect on their next I/O
            // instead of failing it (and dropping the leg again) while their backoff runs.
            dev.revive();
            true
        }
        Err(e) => {
            *l.last_error.locked() = Some(e.to_string());
            false
        }
    }
}

fn pick_source(v: &ReplicatedVolume, m: u64) -> Option<usize> {
    let ok = in_sync(m);
    match v.local {
        Some(l) if ok & (1 << l) != 0 => Some(l),
        _ => (ok != 0).then(|| ok.trailing_zeros() as usize),
    }
}

fn start(v: &Arc<ReplicatedVolume>, leg: usize, source: usize) {
    let l = &v.legs[leg];
    let full = l.persisted_state() == LegState::NeedsFull;
    if full {
        // A new replica: its dirty regions become the source's allocated ones (thin).
        let (tx, rx) = mpsc::channel();
        v.send(Req::BeginFull {
            leg,
            source,
            reply: tx,
        });
        if !rx.recv_timeout(Duration::from_secs(30)).unwrap_or(false) {
            return;
        }
    }
    let dirty = l
        .regions
        .iter()
        .filter(|s| s.load(Acquire) & STATE != CLEAN)
        .count() as u64;
    let p = &l.progress;
    p.total.store(dirty * v.region_size(), Relaxed);
    p.copied.store(0, Relaxed);
    *p.started.locked() = Some(Instant::now());
    p.running.store(true, Release);
    v.masks.fetch_or(1 << (8 + leg), AcqRel);
    info!(volume = %v.name, leg = %l.place(), source = %v.legs[source].place(),
        dirty_regions = dirty, full, "replicated volume: resync started");
    let vol = v.clone();
    v.cores.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(ResyncTask::new(vol, leg, source)) as Box<dyn Task>
    }));
}

/// The resync task ended: in sync if it left nothing behind, else (it stopped early, or
/// writes kept some regions busy) the next supervisor round starts another pass.
fn finish(v: &Arc<ReplicatedVolume>, leg: usize) {
    let l = &v.legs[leg];
    let left = l
        .regions
        .iter()
        .filter(|s| s.load(Acquire) & STATE != CLEAN)
        .count();
    if left == 0 {
        let (tx, rx) = mpsc::channel();
        v.send(Req::ResyncDone { leg, reply: tx });
        let ok = rx.recv_timeout(Duration::from_secs(30)).unwrap_or(false);
        if ok {
            let secs = l
                .progress
                .started
                .lock()
                .ok()
                .and_then(|s| s.map(|t| t.elapsed().as_secs_f64()))
                .unwrap_or(0.0);
            info!(volume = %v.name, leg = %l.place(),
                copied_bytes = l.progress.copied.load(Relaxed), secs,
                "replicated volume: resync finished");
            return;
        }
    }
    // Start over from the regions still dirty (the bit stays set: writes keep going to
    // the leg's clean regions).
    if resyncing(v.masks.load(Acquire)) & (1 << leg) != 0 && !v.closing.load(Acquire) {
        let m = v.masks.load(Acquire);
        if let Some(source) = pick_source(v, m) {
            v.masks.fetch_and(!(1 << (8 + leg)), AcqRel);
            start(v, leg, source);
        }
    }
}

fn vol_rate(v: &ReplicatedVolume) -> u64 {
    v.resync_rate.load(Relaxed)
}

struct Chunk {
    buf: AlignedBuf,
    offset: u64,
    len: u64,
}

struct ResyncTask {
    vol: Arc<ReplicatedVolume>,
    leg: usize,
    source: usize,
    id: u32,
    core: Option<Rc<ReplicaCore>>,
    cursor: u64,
    region: Option<u64>,
    retries: u32,
    /// The region copied with writes to it held (persister `Lock`), if any.
    locked: Option<u64>,
    chunks: Vec<Chunk>,
    pending: u32,
    error: bool,
    cleaned: Vec<u64>,
    flushing: bool,
    waiting: bool,
    done: bool,
    started: Instant,
    /// Bytes per second (0: unlimited), fixed when the task starts.
    rate: u64,
}

impl ResyncTask {
    fn new(vol: Arc<ReplicatedVolume>, leg: usize, source: usize) -> ResyncTask {
        let rate = vol_rate(&vol);
        ResyncTask {
            vol,
            leg,
            source,
            id: 0,
            core: None,
            cursor: 0,
            region: None,
            retries: 0,
            locked: None,
            chunks: Vec::new(),
            pending: 0,
            error: false,
            cleaned: Vec::new(),
            flushing: false,
            waiting: false,
            done: false,
            started: Instant::now(),
            rate,
        }
    }

    fn active(&self) -> bool {
        resyncing(self.vol.masks.load(Acquire)) & (1 << self.leg) != 0
            && in_sync(self.vol.masks.load(Acquire)) & (1 << self.source) != 0
            && !self.vol.closing.load(Acquire)
    }

    fn core(&self) -> &ReplicaCore {
        self.core.as_ref().expect("set at start")
    }

    /// Pick the next region and start copying it, or flush and end.
    fn next(&mut self, io: &mut CoreIo) {
        if !self.active() || self.error {
            return self.end(io);
        }
        if self.cleaned.len() >= REPORT_EVERY {
            return self.flush(io);
        }
        // Pace to the configured rate.
        let rate = self.rate;
        if rate > 0 {
            let copied = self.vol.legs[self.leg].progress.copied.load(Relaxed);
            let due = Duration::from_secs_f64(copied as f64 / rate as f64);
            let elapsed = self.started.elapsed();
            if due > elapsed + Duration::from_millis(1) {
                self.waiting = true;
                return io.complete_after(due - elapsed, Tag::task(self.id, SLOT_TIMER), 0);
            }
        }
        let states = &self.vol.legs[self.leg].regions;
        let n = states.len() as u64;
        let found = (self.cursor..n).find(|&r| states[usize_of(r)].load(Acquire) & STATE != CLEAN);
        let Some(r) = found else {
            self.cursor = n;
            return self.flush(io);
        };
        self.cursor = r + 1;
        self.retries = 0;
        self.copy(io, r);
    }

    fn copy(&mut self, io: &mut CoreIo, r: u64) {
        let rs = self.vol.region_size();
        let start = r * rs;
        let end = (start + rs).min(self.vol.size());
        self.vol.legs[self.leg].regions[usize_of(r)].store(COPYING, Release);
        self.region = Some(r);
        self.chunks.clear();
        let mut at = start;
        while at < end {
            let len = (end - at).min(CHUNK);
            self.chunks.push(Chunk {
                buf: io.bufs.get(len as usize),
                offset: at,
                len,
            });
            at += len;
        }
        self.pending = u32_of(self.chunks.len());
        let core = self.core.clone().expect("set at start");
        for i in 0..self.chunks.len() {
            let (offset, len) = (self.chunks[i].offset, self.chunks[i].len);
            let hole = core.legs[self.source].borrow_mut().is_hole(offset, len);
            if hole {
                let op = IoOp::WriteZeroes {
                    offset,
                    len,
                    may_unmap: true,
                };
                // SAFETY: no buffer.
                unsafe {
                    core.legs[self.leg].borrow_mut().submit(
                        io,
                        op,
                        Tag::task(self.id, 2 * u32_of(i) + 1),
                    )
                };
            } else {
                let op = IoOp::Read {
                    offset,
                    len: u32_of(len),
                    buf: self.chunks[i].buf.as_mut_ptr(),
                };
                // SAFETY: the chunk's buffer lives in the task until its write completes.
                unsafe {
                    core.legs[self.source].borrow_mut().submit(
                        io,
                        op,
                        Tag::task(self.id, 2 * u32_of(i)),
                    )
                };
            }
        }
    }

    fn region_done(&mut self, io: &mut CoreIo) {
        let r = self.region.take().expect("a region was being copied");
        for c in self.chunks.drain(..) {
            io.bufs.put(c.buf);
        }
        let vol = self.vol.clone();
        let l = &vol.legs[self.leg];
        if self.error {
            return self.end(io);
        }
        let s = &l.regions[usize_of(r)];
        let bytes = (self.vol.size() - r * self.vol.region_size()).min(self.vol.region_size());
        if s.compare_exchange(COPYING, CLEAN, AcqRel, Acquire).is_ok() {
            self.unlock();
            self.cleaned.push(r);
            l.progress.copied.fetch_add(bytes, Relaxed);
            l.progress.copied_total.fetch_add(bytes, Relaxed);
            l.progress.regions_total.fetch_add(1, Relaxed);
            return self.next(io);
        }
        // A write overlapped the copy: copy again (a leg failure meanwhile stored
        // DIRTY|REDIRTY and cleared the resync bit, which `next` sees).
        self.retries += 1;
        l.progress.recopied_total.fetch_add(bytes, Relaxed);
        if self.active() {
            if self.retries < MAX_RETRIES
                || (self.locked.is_some() && self.retries < MAX_RETRIES + MAX_LOCKED_RETRIES)
            {
                return self.copy(io, r);
            }
            // Writes keep hitting the region (a hot spot): copy it once more with new
            // writes to it held, so the copy ends (a region that is never quiet would
            // otherwise never be in sync).
            if self.locked.is_none() {
                if let Some(rc) = io.remote_completer() {
                    self.region = Some(r);
                    self.waiting = true;
                    self.vol.send(Req::Lock {
                        region: r,
                        done: crate::persist::Done {
                            rc,
                            tag: Tag::task(self.id, SLOT_LOCKED),
                        },
                    });
                    return;
                }
            }
        }
        self.unlock();
        let _ = s.compare_exchange(COPYING, DIRTY, AcqRel, Acquire);
        self.next(io)
    }

    fn flush(&mut self, io: &mut CoreIo) {
        self.flushing = true;
        let core = self.core.clone().expect("set at start");
        // SAFETY: a flush carries no buffer.
        unsafe {
            core.legs[self.leg]
                .borrow_mut()
                .submit(io, IoOp::Flush, Tag::task(self.id, SLOT_FLUSH))
        };
    }

    /// Let the writes held for the locked region go on.
    fn unlock(&mut self) {
        if let Some(r) = self.locked.take() {
            self.vol.send(Req::Unlock { region: r });
        }
    }

    fn end(&mut self, io: &mut CoreIo) {
        self.unlock();
        if !self.done {
            // A completion to itself, so the reactor sees the task finished and retires it.
            io.complete(Tag::task(self.id, SLOT_END), 0);
        }
        self.done = true;
        self.vol.legs[self.leg]
            .progress
            .running
            .store(false, Release);
    }

    fn fail(&mut self, leg: usize, res: i32) {
        self.error = true;
        warn!(volume = %self.vol.name, leg = %self.vol.legs[leg].place(), error = res,
            "replicated volume: resync I/O failed");
        self.vol.send(Req::LegFailed {
            leg,
            res,
            done: None,
        });
    }
}

impl Task for ResyncTask {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.core = Some(ReplicaCore::get(io, &self.vol));
        self.core().refresh();
        self.started = Instant::now();
        self.next(io);
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        if slot == SLOT_END {
            return;
        }
        if slot == SLOT_TIMER {
            self.waiting = false;
            return self.next(io);
        }
        if slot == SLOT_LOCKED {
            self.waiting = false;
            let r = self.region.take().expect("the region to lock");
            self.locked = Some(r);
            if res < 0 || !self.active() {
                self.unlock();
                return self.next(io);
            }
            return self.copy(io, r);
        }
        if slot == SLOT_FLUSH {
            self.flushing = false;
            if res < 0 {
                self.fail(self.leg, res);
                return self.end(io);
            }
            if !self.cleaned.is_empty() {
                let regions = std::mem::take(&mut self.cleaned);
                self.vol.send(Req::Cleaned {
                    leg: self.leg,
                    regions,
                });
            }
            let n = self.vol.legs[self.leg].regions.len() as u64;
            if self.cursor >= n || self.error || !self.active() {
                return self.end(io);
            }
            return self.next(io);
        }
        let i = (slot / 2) as usize;
        if res < 0 {
            let who = if slot.is_multiple_of(2) {
                self.source
            } else {
                self.leg
            };
            if !self.error {
                self.fail(who, res);
            }
        } else if slot.is_multiple_of(2) && !self.error {
            // Read from the source done: write the chunk to the leg.
            let c = &self.chunks[i];
            let op = IoOp::Write {
                offset: c.offset,
                len: u32_of(c.len),
                buf: c.buf.as_ptr(),
            };
            let core = self.core.clone().expect("set at start");
            // SAFETY: the chunk's buffer lives in the task until this write completes.
            unsafe {
                core.legs[self.leg]
                    .borrow_mut()
                    .submit(io, op, Tag::task(self.id, slot + 1))
            };
            return;
        }
        self.pending -= 1;
        if self.pending == 0 {
            self.region_done(io);
        }
    }

    fn finished(&self) -> bool {
        self.done && self.pending == 0 && !self.flushing && !self.waiting
    }
}
