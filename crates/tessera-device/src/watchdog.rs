//! Hang detection: a device whose I/O does not complete within a timeout is reported, so
//! a redundant pool can mark it failed ("a device that returns errors, times out or
//! disappears is marked failed").
//!
//! One [`Watchdog`] is shared by every core (an `Arc`); [`Watchdog::wrap`] puts a device's
//! per-core handle behind it. The wrapper forwards every operation unchanged and notes, in
//! this core's state, the *tick* in which it was submitted. The operation's completion is
//! routed through a [`CoreIo::tracked`] join to this core's hook, which forgets it and
//! passes the result on; an operation is never completed early (its buffer may still be in
//! the kernel's hands), so a request on a hung device waits for the device.
//!
//! The check is a per-core timer ([`CoreIo::complete_after_background`], so
//! `run_until_idle` does not wait for it), armed only while I/O is in flight: every
//! `timeout / 4` it advances the core's tick and looks for operations submitted more than
//! 4 ticks ago, i.e. in flight for at least `timeout`. A hang is found between `timeout`
//! and `1.25 × timeout` after the operation was submitted. An idle core arms no timer
//! (one last tick after its last I/O completes disarms it), so an idle reactor sleeps.
//!
//! Cost per I/O when nothing hangs: a free-list slot (no allocation once the core has seen
//! its peak queue depth), a join, one hook call and one relaxed load of a shared flag
//! that is written only when a hang starts or ends; no clock read, no lock.
//!
//! The callback is called once per hang of a device, on the reactor core that noticed it
//! (keep it short and lock free, e.g. `Layout::mark_failed`). A hang ends when none of the
//! device's overdue operations is in flight any more; the next operation that then
//! completes promptly (within `timeout / 2`) re-arms the device, so a later hang is
//! reported again. Callbacks are counted in [`Watchdog::hangs`].

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::sync::MutexExt;

use tessera_io::Continuation;

use crate::{CoreIo, IoHandle, IoOp, Tag};

/// Ticks per timeout: the check runs every `timeout / TICKS`.
const TICKS: u32 = 4;
/// `ctx` of the check's timer (operations use their slot number).
const TICK_CTX: u64 = u64::MAX;
/// Slot states.
const FREE: u8 = 0;
const LIVE: u8 = 1;
const OVERDUE: u8 = 2;

/// What a hang callback is given: the index passed to [`Watchdog::wrap`].
pub type HangCallback = Arc<dyn Fn(usize) + Send + Sync>;

/// Detects devices whose I/O hangs; shared by every core.
pub struct Watchdog {
    timeout: Duration,
    period: Duration,
    on_hang: HangCallback,
    /// Shared per-device state, by device index (locked by `wrap` only).
    devices: Mutex<Vec<Option<Arc<DevState>>>>,
    hangs: AtomicU64,
}

/// One device's state, shared by its wrappers on every core.
struct DevState {
    index: usize,
    /// The callback was called for the current hang.
    reported: AtomicBool,
    /// Operations (all cores) found overdue and still in flight.
    overdue: AtomicU32,
}

impl Watchdog {
    /// A watchdog that calls `on_hang(device index)` when an operation of a wrapped device
    /// has been in flight for `timeout` (checked every `timeout / 4`, at least every 1 ms).
    ///
    /// The callback must not own what owns the watchdog (a layout that keeps the watchdog
    /// should be captured as a `Weak`), or neither is ever freed.
    pub fn new(timeout: Duration, on_hang: HangCallback) -> Arc<Watchdog> {
        Arc::new(Watchdog {
            timeout,
            period: (timeout / TICKS).max(Duration::from_millis(1)),
            on_hang,
            devices: Mutex::new(Vec::new()),
            hangs: AtomicU64::new(0),
        })
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How many times the callback has been called.
    pub fn hangs(&self) -> u64 {
        self.hangs.load(Relaxed)
    }

    /// Device `dev_index` has a hang reported and not yet over (see the module docs).
    pub fn is_hung(&self, dev_index: usize) -> bool {
        let devs = self.devices.locked();
        devs.get(dev_index)
            .and_then(|d| d.as_ref())
            .is_some_and(|d| d.reported.load(Relaxed))
    }

    /// Put a device's per-core handle behind the watchdog; `dev_index` is what the
    /// callback is given. Handles of one device on different cores share its state.
    pub fn wrap(self: &Arc<Self>, dev_index: usize, inner: Box<dyn IoHandle>) -> Box<dyn IoHandle> {
        let dev = {
            let mut devs = self.devices.locked();
            if devs.len() <= dev_index {
                devs.resize(dev_index + 1, None);
            }
            devs[dev_index]
                .get_or_insert_with(|| {
                    Arc::new(DevState {
                        index: dev_index,
                        reported: AtomicBool::new(false),
                        overdue: AtomicU32::new(0),
                    })
                })
                .clone()
        };
        Box::new(Watched {
            dog: self.clone(),
            dev,
            inner,
            attached: None,
        })
    }
}

/// One operation in flight on a core.
#[derive(Clone, Copy)]
struct Slot {
    /// The core's tick when it was submitted.
    tick: u32,
    /// Index in `CoreState::devs`.
    dev: u32,
    state: u8,
}

/// A watchdog's state on one core: the hook registered on the core's `CoreIo`.
struct CoreWatch {
    dog: Weak<Watchdog>,
    /// This hook's id on the core.
    hook: Cell<u32>,
    st: RefCell<CoreState>,
}

struct CoreState {
    slots: Vec<Slot>,
    free: Vec<u32>,
    inflight: usize,
    tick: u32,
    /// The check's timer is pending.
    armed: bool,
    /// The devices whose handles submitted on this core.
    devs: Vec<Arc<DevState>>,
}

/// What a wrapper learnt on its first submission on a core.
struct Attached {
    io: *const CoreIo,
    core: Rc<CoreWatch>,
    hook: u32,
    /// Index of the device in `CoreState::devs`.
    dev: u32,
}

struct Watched {
    dog: Arc<Watchdog>,
    dev: Arc<DevState>,
    inner: Box<dyn IoHandle>,
    attached: Option<Attached>,
}

impl Watched {
    /// Find (or create) this watchdog's state on the core of `io`.
    #[cold]
    fn attach(&mut self, io: &mut CoreIo) {
        let key = Arc::as_ptr(&self.dog) as usize ^ 0x7761_7463_6864_6f67;
        let known = io
            .locals
            .get(&key)
            .and_then(|b| b.downcast_ref::<Rc<CoreWatch>>())
            .filter(|c| std::ptr::eq(c.dog.as_ptr(), Arc::as_ptr(&self.dog)))
            .filter(|c| c.dog.strong_count() > 0)
            .cloned();
        let core = match known {
            Some(c) => c,
            None => {
                let c = Rc::new(CoreWatch {
                    dog: Arc::downgrade(&self.dog),
                    hook: Cell::new(u32::MAX),
                    st: RefCell::new(CoreState {
                        slots: Vec::new(),
                        free: Vec::new(),
                        inflight: 0,
                        tick: 0,
                        armed: false,
                        devs: Vec::new(),
                    }),
                });
                let hook: Rc<dyn Continuation> = c.clone();
                c.hook.set(io.register_hook(hook));
                io.locals.insert(key, Box::new(c.clone()));
                c
            }
        };
        let dev = {
            let mut st = core.st.borrow_mut();
            match st.devs.iter().position(|d| Arc::ptr_eq(d, &self.dev)) {
                Some(i) => u32_of(i),
                None => {
                    st.devs.push(self.dev.clone());
                    u32_of(st.devs.len() - 1)
                }
            }
        };
        self.attached = Some(Attached {
            io: io as *const CoreIo,
            hook: core.hook.get(),
            core,
            dev,
        });
    }
}

impl IoHandle for Watched {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        if !matches!(&self.attached, Some(a) if std::ptr::eq(a.io, &*io)) {
            self.attach(io);
        }
        let Some(a) = &self.attached else {
            unreachable!("attached above")
        };
        let (slot, arm) = {
            let mut st = a.core.st.borrow_mut();
            let s = Slot {
                tick: st.tick,
                dev: a.dev,
                state: LIVE,
            };
            let slot = match st.free.pop() {
                Some(i) => {
                    st.slots[i as usize] = s;
                    i
                }
                None => {
                    st.slots.push(s);
                    u32_of(st.slots.len() - 1)
                }
            };
            st.inflight += 1;
            let arm = !st.armed;
            st.armed = true;
            (slot, arm)
        };
        if arm {
            arm_check(io, a.hook, self.dog.period);
        }
        let t = io.tracked(tag, 1, a.hook, slot as u64);
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { self.inner.submit(io, op, t) };
    }

    fn size(&self) -> u64 {
        self.inner.size()
    }
}

/// Arm the core's check: a tracked tag (ctx `TICK_CTX`, no parent to complete) on a
/// background timer.
#[cold]
fn arm_check(io: &mut CoreIo, hook: u32, period: Duration) {
    let t = io.tracked(Tag::NO_PARENT, 1, hook, TICK_CTX);
    io.complete_after_background(period, t, 0);
}

impl CoreWatch {
    /// The periodic check: advance the tick, flag operations in flight for `TICKS` full
    /// ticks, report their devices once per hang, re-arm while I/O is in flight.
    #[cold]
    fn check(&self, io: &mut CoreIo) {
        let dog = self.dog.upgrade();
        let mut hung = Vec::new();
        let arm = {
            let mut st = self.st.borrow_mut();
            let st = &mut *st;
            st.tick = st.tick.wrapping_add(1);
            if st.inflight > 0 {
                for s in st.slots.iter_mut().filter(|s| s.state != FREE) {
                    // Submitted in tick `s.tick`, so in flight for at least
                    // `(age - 1)` full periods: `age > TICKS` means at least `timeout`.
                    if s.state == LIVE && st.tick.wrapping_sub(s.tick) > TICKS {
                        s.state = OVERDUE;
                        st.devs[s.dev as usize].overdue.fetch_add(1, Relaxed);
                    }
                    let d = &st.devs[s.dev as usize];
                    // Checked on every tick (not only when flagged): a prompt completion
                    // on another core may have re-armed the device in a race.
                    if s.state == OVERDUE
                        && !d.reported.load(Relaxed)
                        && !d.reported.swap(true, Relaxed)
                    {
                        hung.push(d.index);
                    }
                }
            }
            st.armed = st.inflight > 0 && dog.is_some();
            st.armed
        };
        let Some(dog) = dog else { return };
        if arm {
            arm_check(io, self.hook.get(), dog.period);
        }
        for d in hung {
            dog.hangs.fetch_add(1, Relaxed);
            (dog.on_hang)(d);
        }
    }
}

impl Continuation for CoreWatch {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, _ctx: u64, res: i32) {
        // Not used: `tracked` joins call `on_done`.
        io.complete(parent, res)
    }

    #[inline]
    fn on_done(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        if ctx == TICK_CTX {
            return self.check(io);
        }
        {
            let mut st = self.st.borrow_mut();
            let i = usize_of(ctx);
            let s = st.slots[i];
            st.slots[i].state = FREE;
            st.free.push(u32_of(i));
            st.inflight -= 1;
            let d = &st.devs[s.dev as usize];
            if s.state == OVERDUE {
                d.overdue.fetch_sub(1, Relaxed);
            } else if st.tick.wrapping_sub(s.tick) <= 1 && d.reported.load(Relaxed) {
                // A prompt completion (within two periods) once no overdue operation is
                // left: the hang is over, a new one will be reported.
                rearm(d);
            }
        }
        io.complete(parent, res)
    }
}

#[cold]
fn rearm(d: &DevState) {
    if d.overdue.load(Relaxed) == 0 {
        d.reported.store(false, Relaxed);
    }
}
