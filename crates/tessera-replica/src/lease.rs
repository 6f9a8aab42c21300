//! The read lease of a replicated volume in a cluster (issue 20 item 8).
//!
//! Writes are fenced at the replicas (a new owner's claim ends the old owner's
//! connections, and the old owner cannot drop a claimed replica: `LegFence`). Reads are
//! served from the owner's local replica, which no claim reaches, so they need a bound of
//! their own, and it must not depend on etcd (volumes keep serving while etcd is down).
//!
//! The rule: **a read is served only while every remote replica in sync answered this
//! owner within the read lease `W`** (the node sets `W` to half the ownership lease TTL).
//! "Answered" means an I/O of the synchronous queue completed (a ping, one block read,
//! every `W / 4`, off the datapath), or the connection was set up; its time is when it was
//! *sent*, so the proof is never later than the peer's answer. A new owner's claim ends
//! the old owner's connections and refuses its reconnects, so from the claim on the old
//! owner's pings fail and its reads stop at most `W` after the claim (the new owner waits
//! that long after its own claim, when it ended an old owner's connection, before it
//! serves). A full partition stops the old owner's reads within `W` of the cut: before
//! any new owner can exist (takeover needs the old lease to expire, at least 2/3 of the
//! TTL after the cut, as the lease is renewed every TTL/3).
//!
//! No remote replica in sync (a single-node volume, or every other replica dropped: each
//! drop was recorded in the cluster's spec first, so no other node can take the volume
//! over): reads need nothing. A ping that fails reports the replica as failed to the
//! persister (as a failed I/O would), which drops it out of sync once the cluster recorded
//! it; the other replicas then carry the lease. While that cannot be recorded (etcd away,
//! or the volume lost), the replica stays in sync and reads fail with EIO.
//!
//! A read that finds the lease lapsed is not failed at once: it is parked and retried
//! each reactor round (`handle.rs`, `K_LEASE`) until the lease holds again (an answer,
//! or the silent replica dropped, which a dead replica node's writes wait for anyway) or
//! 8 s went by, then it fails with EIO.
//!
//! Per read, the datapath pays one relaxed load (the lease is off outside a cluster) and,
//! per remote replica in sync, one load of its last answer's time against the reactor's
//! clock of this round: no shared write, no system call.

use std::sync::atomic::Ordering::*;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{OnceLock, Weak};
use std::time::{Duration, Instant};
use tessera_io::sync::RwLockExt;

use tracing::{info, warn};

use crate::{in_sync, persist, resyncing, LegDev, ReplicatedVolume};

/// How often a replica whose ping keeps failing is reported again (the first failure is
/// reported at once). A report that cannot be recorded holds the persister up to the
/// cluster's fence wait, so they are not repeated faster.
const REPORT_AGAIN_NS: u64 = 30_000_000_000;

/// Nanoseconds since a process-wide origin (monotonic clock), as the lease stores times.
pub(crate) fn ns(t: Instant) -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let o = *ORIGIN.get_or_init(|| {
        let now = Instant::now();
        now.checked_sub(Duration::from_secs(1)).unwrap_or(now)
    });
    u64::try_from(t.saturating_duration_since(o).as_nanos()).unwrap_or(u64::MAX)
}

/// A leg's lease state.
#[derive(Default)]
pub(crate) struct LegLease {
    /// When the last proof that the peer serves this owner was sent (`ns`; 0: never).
    pub(crate) answered: AtomicU64,
    /// A ping of the leg is running.
    pub(crate) pinging: AtomicBool,
    /// The last ping failed.
    pub(crate) failing: AtomicBool,
    /// When a failed ping was last reported to the persister (`ns`).
    pub(crate) reported: AtomicU64,
}

impl LegLease {
    /// The peer answered something sent at `sent`.
    pub(crate) fn answered_at(&self, sent: Instant) {
        self.answered.fetch_max(ns(sent), AcqRel);
    }
}

/// Whether reads may be served at `now` (ns) under lease `w` (ns, 0: off), given the
/// times the remote legs in sync (`remote`, a mask) last answered.
#[inline]
pub(crate) fn holds(now: u64, w: u64, mut remote: u64, answered: impl Fn(usize) -> u64) -> bool {
    if w == 0 {
        return true;
    }
    while remote != 0 {
        let l = remote.trailing_zeros() as usize;
        remote &= remote - 1;
        if now.saturating_sub(answered(l)) >= w {
            return false;
        }
    }
    true
}

impl ReplicatedVolume {
    /// Serve reads only under a read lease of `w` (see the module documentation), and
    /// ping the remote replicas every `w / 4` to keep it. For a volume in a cluster, where
    /// another node may take it over; `w` must be shorter than the ownership lease.
    pub fn set_read_lease(self: &std::sync::Arc<Self>, w: Duration) {
        let w_ns = u64::try_from(w.as_nanos()).unwrap_or(u64::MAX).max(1);
        if self.read_lease.swap(w_ns, AcqRel) != 0 {
            return;
        }
        info!(volume = %self.name, read_lease_ms = w_ns / 1_000_000,
            "replicated volume: reads served under a lease on the replicas' answers");
        let v = std::sync::Arc::downgrade(self);
        let every = (w / 4).max(Duration::from_millis(10));
        let _ = std::thread::Builder::new()
            .name(format!("rping-{}", self.name))
            .spawn(move || pinger(v, every));
    }

    /// Whether a read may be served now (`now`: the reactor's clock), the legs in sync
    /// being `ok`. Logs (and counts) the transitions, not every refused read.
    #[inline]
    pub(crate) fn read_lease_holds(&self, now: Instant, ok: u64) -> bool {
        let w = self.read_lease.load(Relaxed);
        if w == 0 {
            return true;
        }
        let remote = ok & !self.local.map_or(0, |l| 1u64 << l);
        let good = holds(ns(now), w, remote, |l| {
            self.legs[l].lease.answered.load(Acquire)
        });
        let refused = self.reads_refused.load(Relaxed);
        if good == refused {
            // A transition (rare): one swap decides who logs it.
            if self.reads_refused.swap(!good, AcqRel) != good {
                return good;
            }
            if good {
                info!(volume = %self.name, "replicated volume: the replicas answer again: reads served");
            } else {
                self.read_lease_lapses.fetch_add(1, Relaxed);
                warn!(volume = %self.name, read_lease_ms = w / 1_000_000,
                    "replicated volume: a replica in sync did not answer within the read lease \
                     (partitioned, or fenced by a new owner): reads wait (up to 8 s, then fail) until it answers or is dropped");
            }
        }
        good
    }

    /// How many times reads stopped because the read lease lapsed.
    pub fn read_lease_lapses(&self) -> u64 {
        self.read_lease_lapses.load(Relaxed)
    }
}

/// Every `every`, ping each remote leg that is in sync or resyncing (one ping in flight
/// per leg, each on a thread of its own: a peer that hangs delays no other).
fn pinger(vol: Weak<ReplicatedVolume>, every: Duration) {
    loop {
        {
            let Some(v) = vol.upgrade() else { return };
            if v.closing.load(Acquire) {
                return;
            }
            let m = v.masks.load(Acquire);
            let mut legs = in_sync(m) | resyncing(m);
            while legs != 0 {
                let i = legs.trailing_zeros() as usize;
                legs &= legs - 1;
                let l = &v.legs[i];
                let LegDev::Remote(Some(dev)) = &*l.dev.read_locked() else {
                    continue;
                };
                if l.lease.pinging.swap(true, AcqRel) {
                    continue;
                }
                let (dev, w) = (dev.clone(), vol.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("rping-{}-{i}", v.name))
                    .spawn(move || ping(&w, i, &dev));
                if spawned.is_err() {
                    l.lease.pinging.store(false, Release);
                }
            }
        }
        std::thread::sleep(every);
    }
}

fn ping(vol: &Weak<ReplicatedVolume>, i: usize, dev: &tessera_remote::RemoteDevice) {
    // A leg removed since the pinger looked is left alone (its device was disconnected:
    // a synchronous I/O would connect it again).
    let gone = vol.upgrade().is_none_or(|v| {
        let m = v.masks.load(Acquire);
        (in_sync(m) | resyncing(m)) & (1 << i) == 0 || v.closing.load(Acquire)
    });
    if gone {
        if let Some(v) = vol.upgrade() {
            v.legs[i].lease.pinging.store(false, Release);
        }
        return;
    }
    let mut buf = vec![0u8; dev.block_size() as usize];
    let sent = Instant::now();
    let r = tessera_device::BlockDevice::read_at(dev, 0, &mut buf);
    let Some(v) = vol.upgrade() else { return };
    let l = &v.legs[i];
    match r {
        Ok(()) => {
            l.lease.answered_at(sent);
            if l.lease.failing.swap(false, AcqRel) {
                info!(volume = %v.name, leg = %l.place(), "replicated volume: replica answers pings again");
            }
        }
        Err(e) => {
            let first = !l.lease.failing.swap(true, AcqRel);
            let now = ns(Instant::now());
            let last = l.lease.reported.load(Acquire);
            let in_sync_now = in_sync(v.masks.load(Acquire)) & (1 << i) != 0;
            if first || now.saturating_sub(last) >= REPORT_AGAIN_NS {
                l.lease.reported.store(now, Release);
                warn!(volume = %v.name, leg = %l.place(), error = %e, in_sync = in_sync_now,
                    "replicated volume: replica did not answer a ping");
                if !v.closing.load(Acquire) {
                    v.send(persist::Req::LegFailed {
                        leg: i,
                        res: -e.raw_os_error().unwrap_or(libc::EIO),
                        done: None,
                    });
                }
            }
        }
    }
    l.lease.pinging.store(false, Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn off_no_remote_in_sync_and_fresh_answers_hold() {
        // Off (outside a cluster): anything goes.
        assert!(holds(100 * S, 0, 0b110, |_| 0));
        // No remote replica in sync: the owner is alone, nobody else can own the volume.
        assert!(holds(100 * S, S, 0, |_| 0));
        // Every remote in sync answered within the lease.
        assert!(holds(100 * S, S, 0b110, |_| 100 * S - S / 2));
    }

    #[test]
    fn one_silent_remote_in_sync_stops_reads() {
        // Leg 2 answered 1 s ago exactly (lease 1 s): lapsed, though leg 1 is fresh.
        let answered = |l: usize| if l == 2 { 99 * S } else { 100 * S };
        assert!(!holds(100 * S, S, 0b110, answered));
        // Out of sync, leg 2 no longer counts.
        assert!(holds(100 * S, S, 0b010, answered));
        // Never answered (0): lapsed.
        assert!(!holds(100 * S, S, 0b010, |_| 0));
        // An answer timed after `now` (sent on another thread after the reactor's round
        // began) holds.
        assert!(holds(100 * S, S, 0b010, |_| 100 * S + 5));
    }

    #[test]
    fn times_are_monotonic_and_answers_only_move_forward() {
        let t = Instant::now();
        assert!(ns(t) > 0);
        assert!(ns(t + Duration::from_millis(5)) >= ns(t) + 5_000_000);
        let l = LegLease::default();
        l.answered_at(t + Duration::from_secs(2));
        l.answered_at(t);
        assert_eq!(l.answered.load(Relaxed), ns(t + Duration::from_secs(2)));
    }
}
