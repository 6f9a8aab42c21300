//! The admission gate a protocol connection (NBD, NVMe/TCP) puts in front of
//! its volume: QoS limits (the volume's and its group's), then the core's
//! share scheduler. One gate per connection; the limiters and the scheduler
//! behind it are per core and shared by every connection on that core.
//!
//! A request offered to the gate either passes at once or is held; held
//! requests come back, in order, from [`Gate::wake`] when the gate's timer
//! (limits) or round (shares) tag completes on the connection's task.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_io::{CoreIo, Tag};

use crate::limiter::ShareFigures;
use crate::shares::{cost, Admit, FlowId};
use crate::{CoreLimiter, ShareScheduler, VolumeQos};

/// Share figures a connection keeps before adding them to its volume's (one atomic
/// add per this many events, not one per request).
const SHARE_BATCH: u64 = 64;

/// What a request costs the limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// No limit applies (flushes, metadata queries); the share scheduler still
    /// orders it, at the cost of an empty write.
    Free,
    /// A read of this many bytes.
    Read(u64),
    /// A read of this many bytes that goes before writes waiting for a share round: the
    /// access-pattern detector calls its region random (a random read waits on a device
    /// while a write is absorbed; seed 004's QoS puts such reads first).
    ReadFirst(u64),
    /// A write of this many bytes (0 for trims and write-zeroes: they count as
    /// an operation, not as bandwidth).
    Write(u64),
}

impl Charge {
    /// `(is_write, bytes)` for the limiters, `None` when no limit applies.
    fn limited(self) -> Option<(bool, u64)> {
        match self {
            Charge::Free => None,
            Charge::Read(b) | Charge::ReadFirst(b) => Some((false, b)),
            Charge::Write(b) => Some((true, b)),
        }
    }
}

/// A request that left the gate after being held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    pub slot: u16,
    /// It waited for the QoS limits (not only for a share round): the time
    /// it was held counts as throttled time.
    pub throttled: bool,
}

#[derive(Clone, Copy)]
struct Held {
    slot: u16,
    charge: Charge,
    throttled: bool,
}

/// The calling core's limiter for `qos`, shared by every connection to that
/// volume (or group) on this core, so the core's share of the limit is not
/// multiplied by its connections.
pub fn core_limiter(io: &mut CoreIo, qos: &Arc<VolumeQos>) -> Rc<RefCell<CoreLimiter>> {
    let key = Arc::as_ptr(qos) as usize;
    if let Some(rc) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<Weak<RefCell<CoreLimiter>>>())
        .and_then(Weak::upgrade)
    {
        return rc;
    }
    let rc = Rc::new(RefCell::new(CoreLimiter::new(
        qos.clone(),
        io.core,
        Instant::now(),
    )));
    io.locals.insert(key, Box::new(Rc::downgrade(&rc)));
    rc
}

/// The calling core's share scheduler (one per core).
pub fn core_scheduler(io: &mut CoreIo) -> Rc<RefCell<ShareScheduler>> {
    // The address of a private static: a key no volume's `Arc` can have.
    static KEY: u8 = 0;
    let key = &KEY as *const u8 as usize;
    if let Some(rc) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<Rc<RefCell<ShareScheduler>>>())
    {
        return rc.clone();
    }
    let rc = Rc::new(RefCell::new(ShareScheduler::new()));
    io.locals.insert(key, Box::new(rc.clone()));
    rc
}

pub struct Gate {
    qos: Arc<VolumeQos>,
    limiter: Rc<RefCell<CoreLimiter>>,
    group_generation: u64,
    group: Option<Rc<RefCell<CoreLimiter>>>,
    sched: Rc<RefCell<ShareScheduler>>,
    flow: FlowId,
    /// Limits generation the flow's weight was read at.
    sched_generation: u64,
    reads_first: bool,
    /// Waiting for tokens, in arrival order.
    held: VecDeque<Held>,
    /// Admitted by the limits, waiting for a share round.
    deferred: VecDeque<Held>,
    timer_tag: Tag,
    round_tag: Tag,
    timer_armed: bool,
    round_armed: bool,
    /// This connection's share figures not yet added to the volume's.
    shares: ShareFigures,
}

impl Gate {
    /// A gate on the calling core for a connection to the volume whose QoS
    /// state is `qos`. `timer_tag` and `round_tag` are two of the
    /// connection's task tags; when either completes, call [`Gate::wake`].
    pub fn new(io: &mut CoreIo, qos: &Arc<VolumeQos>, timer_tag: Tag, round_tag: Tag) -> Gate {
        let limiter = core_limiter(io, qos);
        let sched = core_scheduler(io);
        let flow = sched.borrow_mut().register(Arc::as_ptr(qos) as usize);
        let mut g = Gate {
            qos: qos.clone(),
            limiter,
            group_generation: u64::MAX,
            group: None,
            sched,
            flow,
            sched_generation: u64::MAX,
            reads_first: false,
            held: VecDeque::new(),
            deferred: VecDeque::new(),
            timer_tag,
            round_tag,
            timer_armed: false,
            round_armed: false,
            shares: ShareFigures::default(),
        };
        g.refresh(io);
        g
    }

    /// Tags are usually only known once the task has its id.
    pub fn set_tags(&mut self, timer_tag: Tag, round_tag: Tag) {
        self.timer_tag = timer_tag;
        self.round_tag = round_tag;
    }

    /// Pick up a changed group or weight (one load each per request).
    #[inline]
    fn refresh(&mut self, io: &mut CoreIo) {
        let gg = self.qos.group_generation();
        if gg != self.group_generation {
            self.group_generation = gg;
            self.group = self.qos.group().map(|g| core_limiter(io, &g));
        }
        let lg = self.qos.generation();
        if lg != self.sched_generation {
            self.sched_generation = lg;
            let l = self.qos.limits();
            self.reads_first = l.reads_first;
            self.sched
                .borrow_mut()
                .configure(self.flow, l.weight_or_default(), l.reads_first);
        }
    }

    /// Both limiters (volume, group) admit the request now, or the longest wait.
    fn limits(&mut self, charge: Charge, now: Instant) -> Result<(), Duration> {
        let Some((write, bytes)) = charge.limited() else {
            return Ok(());
        };
        let mut vol = self.limiter.borrow_mut();
        let a = vol.check(write, bytes, now);
        let b = match &self.group {
            Some(g) => g.borrow_mut().check(write, bytes, now),
            None => Ok(()),
        };
        match (a, b) {
            (Ok(()), Ok(())) => {
                vol.commit(write, bytes);
                if let Some(g) = &self.group {
                    g.borrow_mut().commit(write, bytes);
                }
                Ok(())
            }
            (Err(x), Err(y)) => Err(x.max(y)),
            (Err(x), _) | (_, Err(x)) => Err(x),
        }
    }

    fn share(&mut self, io: &CoreIo, charge: Charge) -> bool {
        let (write, bytes) = charge.limited().unwrap_or((true, 0));
        let units = cost(bytes);
        let admit = self
            .sched
            .borrow_mut()
            .admit(self.flow, write, units, io.round(), io.now());
        match admit {
            Admit::Free => return true,
            Admit::Shared => self.shares.shared_units += u64::from(units),
            Admit::Deferred => self.shares.deferrals += 1,
        }
        if self.shares.shared_units + self.shares.deferrals >= SHARE_BATCH {
            self.qos.add_share_figures(std::mem::take(&mut self.shares));
        }
        admit.dispatched()
    }

    fn arm_timer(&mut self, io: &mut CoreIo, wait: Duration) {
        if !self.timer_armed {
            self.timer_armed = true;
            io.complete_after(wait, self.timer_tag, 0);
        }
    }

    fn arm_round(&mut self, io: &mut CoreIo) {
        if !self.round_armed {
            self.round_armed = true;
            io.defer(self.round_tag);
        }
    }

    /// Offer a request: `true` means dispatch it now; `false` means the gate
    /// holds it and will hand it back from [`wake`](Self::wake). A
    /// connection's requests leave in order, except that a read that goes first (the
    /// volume's reads-first, or [`Charge::ReadFirst`]) passes writes waiting for a share
    /// round: it is dispatched now if its share allows, else queued before them.
    pub fn offer(&mut self, io: &mut CoreIo, slot: u16, charge: Charge) -> bool {
        self.refresh(io);
        if self.held.is_empty() {
            match self.limits(charge, io.now()) {
                Ok(()) => {
                    let first = self.goes_first(charge);
                    let may_pass = self.deferred.is_empty() || first;
                    if may_pass && self.share(io, charge) {
                        return true;
                    }
                    self.defer(Held {
                        slot,
                        charge,
                        throttled: false,
                    });
                    self.arm_round(io);
                    return false;
                }
                Err(wait) => self.arm_timer(io, wait),
            }
        }
        self.held.push_back(Held {
            slot,
            charge,
            throttled: true,
        });
        false
    }

    /// Queue `h` for a share round: a read that goes first after the reads already
    /// queued first, before the rest; anything else last.
    fn defer(&mut self, h: Held) {
        if self.goes_first(h.charge) {
            let at = self
                .deferred
                .iter()
                .position(|d| !self.goes_first(d.charge))
                .unwrap_or(self.deferred.len());
            self.deferred.insert(at, h);
        } else {
            self.deferred.push_back(h);
        }
    }

    /// Whether a request of `charge` passes writes waiting for a share round.
    fn goes_first(&self, charge: Charge) -> bool {
        match charge {
            Charge::ReadFirst(_) => true,
            Charge::Read(_) => self.reads_first,
            _ => false,
        }
    }

    /// Requests wait for a share round: a read offered now is worth asking whether it
    /// goes first (see [`Charge::ReadFirst`]; the question costs the caller a lookup).
    pub fn has_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// The timer or round tag completed (`tag` says which): hand back, in
    /// order, the held requests that may now be dispatched.
    pub fn wake(&mut self, io: &mut CoreIo, tag: Tag, out: &mut Vec<Released>) {
        self.refresh(io);
        if tag == self.timer_tag {
            self.timer_armed = false;
        } else {
            self.round_armed = false;
        }
        // Requests waiting for a round first: they passed the limits earlier.
        while let Some(h) = self.deferred.front().copied() {
            if !self.share(io, h.charge) {
                self.arm_round(io);
                break;
            }
            self.deferred.pop_front();
            out.push(Released {
                slot: h.slot,
                throttled: h.throttled,
            });
        }
        while let Some(h) = self.held.front().copied() {
            if let Err(wait) = self.limits(h.charge, io.now()) {
                self.arm_timer(io, wait);
                break;
            }
            self.held.pop_front();
            if self.deferred.is_empty() && self.share(io, h.charge) {
                out.push(Released {
                    slot: h.slot,
                    throttled: true,
                });
            } else {
                self.defer(h);
                self.arm_round(io);
            }
        }
    }

    /// The client is gone: give back every held request (nobody waits for
    /// them); the caller releases their resources.
    pub fn drain(&mut self, out: &mut Vec<u16>) {
        out.extend(self.deferred.drain(..).map(|h| h.slot));
        out.extend(self.held.drain(..).map(|h| h.slot));
    }

    /// Several volumes compete for this core, or this connection has requests waiting
    /// for a share round: the connection should take in only about a round's worth of
    /// new requests at a time (receiving and copying a deep queue's payloads is work the
    /// scheduler cannot split once it has been done).
    pub fn contended(&self) -> bool {
        !self.deferred.is_empty() || self.sched.borrow().active() > 1
    }

    /// Nothing held and no wake-up pending: the connection may finish.
    pub fn is_idle(&self) -> bool {
        self.held.is_empty() && self.deferred.is_empty() && !self.timer_armed && !self.round_armed
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.qos.add_share_figures(self.shares);
        self.sched.borrow_mut().unregister(self.flow);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::QosLimits;

    fn qos() -> Arc<VolumeQos> {
        Arc::new(VolumeQos::new(QosLimits::default(), Instant::now()))
    }

    /// With writes waiting for a share round, a read marked first is queued before them
    /// (after earlier such reads); a plain read waits behind them.
    #[test]
    fn a_read_first_passes_writes_waiting_for_a_round() {
        let mut io = CoreIo::new(0, 64, None).expect("io_uring");
        let (a, b) = (qos(), qos());
        let mut ga = Gate::new(&mut io, &a, Tag::task(0, 1), Tag::task(0, 2));
        let mut gb = Gate::new(&mut io, &b, Tag::task(1, 1), Tag::task(1, 2));
        // Another volume active on the core: shares apply.
        assert!(gb.offer(&mut io, 0, Charge::Write(4096)));
        let mut slot = 0u16;
        while ga.offer(&mut io, slot, Charge::Write(128 << 10)) {
            slot += 1;
            assert!(slot < 10_000, "a write was never deferred");
        }
        let writes: Vec<u16> = (slot..slot + 3).collect();
        for &w in &writes[1..] {
            assert!(!ga.offer(&mut io, w, Charge::Write(128 << 10)));
        }
        assert!(ga.has_deferred());
        assert!(!ga.offer(&mut io, 900, Charge::Read(4096)));
        assert!(!ga.offer(&mut io, 901, Charge::ReadFirst(4096)));
        assert!(!ga.offer(&mut io, 902, Charge::ReadFirst(4096)));
        assert!(!ga.offer(&mut io, 903, Charge::Write(4096)));
        let mut order = Vec::new();
        ga.drain(&mut order);
        let mut want = vec![901, 902];
        want.extend(&writes);
        want.extend([900, 903]);
        assert_eq!(order, want);
    }
}
