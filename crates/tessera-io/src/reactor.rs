//! The reactor loop: one thread per core, one io_uring, many tasks.

use crate::sync::MutexExt;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{opcode, types, types::SubmitArgs, types::Timespec};

use crate::core_io::CoreIo;
use crate::poll::{PollOutcome, PollPolicy};
use crate::tag::Tag;

/// Work living on one core: a connection, a benchmark driver. All its operations carry
/// tags made with [`Tag::task`]`(id, slot)`.
pub trait Task {
    /// Called once when the task is installed on its core; `id` goes into its tags.
    fn start(&mut self, io: &mut CoreIo, id: u32);
    /// A completion for one of this task's operations (`slot` = the tag's [`Tag::slot`]).
    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32);
    /// Called at the end of each loop iteration in which the task got completions: the
    /// place to batch replies into one send.
    fn flush(&mut self, _io: &mut CoreIo) {}
    /// True once the task has nothing in flight and may be dropped.
    fn finished(&self) -> bool;
}

/// A factory run on the target core, so tasks need not be `Send` themselves.
pub type SpawnFn = Box<dyn FnOnce(&mut CoreIo) -> Box<dyn Task> + Send>;

pub enum Msg {
    Spawn(SpawnFn),
    Complete(Tag, i32),
    Stop,
}

/// A core's inbox for cross-core work; wakes the reactor through an eventfd that sits in
/// its io_uring. Used for rare events (new connections, flush completions), never per I/O.
pub struct Mailbox {
    queue: Mutex<Vec<Msg>>,
    efd: RawFd,
    pub core: usize,
    /// Where the core's time goes, for metrics.
    pub load: CoreLoad,
}

/// How a reactor spent its time since it started: sleeping in the kernel and polling
/// its ring for completions (hybrid polling); the rest is work. Written only by the
/// reactor thread (plain loads and stores, one pair per sleep or poll window, never per
/// I/O), read by metrics. Aligned so the reactor's stores do not share a cache line with
/// the mailbox queue other cores lock.
#[repr(align(64))]
pub struct CoreLoad {
    started: std::time::Instant,
    sleep_ns: std::sync::atomic::AtomicU64,
    poll_ns: std::sync::atomic::AtomicU64,
}

/// A reading of [`CoreLoad`], in nanoseconds since the reactor started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CoreTime {
    pub total_ns: u64,
    pub sleep_ns: u64,
    pub poll_ns: u64,
}

impl CoreTime {
    /// Time spent running tasks and the loop itself: neither asleep nor polling.
    pub fn busy_ns(&self) -> u64 {
        self.total_ns
            .saturating_sub(self.sleep_ns)
            .saturating_sub(self.poll_ns)
    }
}

impl CoreLoad {
    fn new() -> CoreLoad {
        CoreLoad {
            started: std::time::Instant::now(),
            sleep_ns: Default::default(),
            poll_ns: Default::default(),
        }
    }

    fn add(counter: &std::sync::atomic::AtomicU64, d: Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        counter.store(counter.load(Relaxed).wrapping_add(ns), Relaxed);
    }

    pub fn read(&self) -> CoreTime {
        use std::sync::atomic::Ordering::Relaxed;
        CoreTime {
            total_ns: u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX),
            sleep_ns: self.sleep_ns.load(Relaxed),
            poll_ns: self.poll_ns.load(Relaxed),
        }
    }
}

impl Mailbox {
    fn new(core: usize) -> std::io::Result<Arc<Mailbox>> {
        // SAFETY: plain syscall; the fd is owned by the mailbox and closed in Drop.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Arc::new(Mailbox {
            queue: Mutex::new(Vec::new()),
            efd,
            core,
            load: CoreLoad::new(),
        }))
    }

    pub fn send(&self, m: Msg) {
        self.queue.locked().push(m);
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.efd, &one as *const u64 as *const libc::c_void, 8) };
    }

    pub fn spawn(&self, f: SpawnFn) {
        self.send(Msg::Spawn(f));
    }

    fn take(&self) -> Vec<Msg> {
        std::mem::take(&mut *self.queue.locked())
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: closing the eventfd we own.
        unsafe { libc::close(self.efd) };
    }
}

/// Lets another thread complete a tag on a given core.
pub type RemoteCompleter = Arc<Mailbox>;

impl Mailbox {
    pub fn complete(&self, tag: Tag, res: i32) {
        self.send(Msg::Complete(tag, res));
    }
}

#[derive(Clone, Debug)]
pub struct ReactorConfig {
    /// Number of reactor threads (cores used).
    pub cores: usize,
    /// Pin reactor i to CPU i (modulo the CPUs available).
    pub pin: bool,
    /// Spin instead of sleeping in the kernel when idle.
    pub busy_poll: bool,
    /// After every batch of work, keep polling the ring this long before sleeping
    /// (hybrid polling): a request arriving within the window costs no wakeup, which on
    /// a VM is worth more than serving a small request. A pending timer shortens the
    /// window to its deadline. Zero disables; a reactor with nothing to do for longer
    /// than this sleeps in the kernel. The reactor skips the poll while it waits for a
    /// peer node on this host and after polls kept finding nothing ([`crate::poll`]).
    pub poll_window: Duration,
    /// io_uring submission queue entries per core.
    pub ring_entries: u32,
    /// Leave the loop once the last task has finished (benchmarks).
    pub exit_when_idle: bool,
}

impl Default for ReactorConfig {
    fn default() -> Self {
        ReactorConfig {
            cores: 1,
            pin: true,
            busy_poll: false,
            poll_window: Duration::from_micros(50),
            ring_entries: 1024,
            exit_when_idle: false,
        }
    }
}

/// The reactor's read of its mailbox eventfd.
const MAILBOX_TAG: Tag = Tag::reactor(1);

pub struct Reactor {
    io: CoreIo,
    tasks: Vec<Option<Box<dyn Task>>>,
    free_ids: Vec<u32>,
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    mailbox: Arc<Mailbox>,
    efd_buf: Box<u64>,
    cfg: ReactorConfig,
    live: usize,
    /// A task has been installed at least once (exit_when_idle waits for the first).
    had_task: bool,
    poll: PollPolicy,
}

impl Reactor {
    pub fn new(core: usize, cfg: ReactorConfig) -> std::io::Result<Reactor> {
        let mailbox = Mailbox::new(core)?;
        let io = CoreIo::new(core, cfg.ring_entries, Some(mailbox.clone()))?;
        let poll = PollPolicy::new(cfg.poll_window);
        Ok(Reactor {
            poll,
            io,
            tasks: Vec::new(),
            free_ids: Vec::new(),
            dirty: Vec::new(),
            is_dirty: Vec::new(),
            mailbox,
            efd_buf: Box::new(0),
            cfg,
            live: 0,
            had_task: false,
        })
    }

    pub fn mailbox(&self) -> Arc<Mailbox> {
        self.mailbox.clone()
    }

    fn arm_mailbox(&mut self) {
        let e = opcode::Read::new(
            types::Fd(self.mailbox.efd),
            &mut *self.efd_buf as *mut u64 as *mut u8,
            8,
        )
        .build()
        .user_data(MAILBOX_TAG.user_data());
        // SAFETY: efd_buf is boxed and lives as long as the reactor; the eventfd too.
        unsafe { self.io.push_raw(e) };
    }

    fn install(&mut self, f: SpawnFn) {
        let task = f(&mut self.io);
        let id = match self.free_ids.pop() {
            Some(id) => id,
            None => {
                self.tasks.push(None);
                self.is_dirty.push(false);
                u32::try_from(self.tasks.len() - 1).expect("fewer than 2^32 tasks on a core")
            }
        };
        self.tasks[id as usize] = Some(task);
        self.live += 1;
        self.had_task = true;
        if let Some(t) = self.tasks[id as usize].as_mut() {
            t.start(&mut self.io, id);
        }
        self.mark(id);
    }

    fn mark(&mut self, id: u32) {
        if !self.is_dirty[id as usize] {
            self.is_dirty[id as usize] = true;
            self.dirty.push(id);
        }
    }

    fn dispatch_ready(&mut self) {
        while let Some((tag, res)) = self.io.pop_ready() {
            debug_assert!(!tag.is_internal());
            let id = tag.task_id();
            if let Some(Some(t)) = self.tasks.get_mut(id as usize) {
                t.on_complete(&mut self.io, tag.slot(), res);
                self.mark(id);
            }
        }
    }

    /// Returns false when the reactor should stop.
    fn handle_mailbox(&mut self) -> bool {
        let mut keep = true;
        for m in self.mailbox.take() {
            match m {
                Msg::Spawn(f) => self.install(f),
                Msg::Complete(tag, res) => self.io.complete(tag, res),
                Msg::Stop => keep = false,
            }
        }
        keep
    }

    /// Run until told to stop (or, with `exit_when_idle`, until no task is left).
    pub fn run(&mut self) {
        self.arm_mailbox();
        let mut mailbox_fired = true; // drain anything sent before we started
        let mut enter_errors = 0u64;
        loop {
            if mailbox_fired {
                mailbox_fired = false;
                if !self.handle_mailbox() {
                    return;
                }
            }
            // Drain synchronous completions until quiet; they may cascade.
            while self.io.has_ready() {
                self.dispatch_ready();
            }
            // Batch end: let every task that saw activity flush its replies.
            let dirty = std::mem::take(&mut self.dirty);
            if !dirty.is_empty() {
                self.io.refresh_now();
            }
            for &id in &dirty {
                self.is_dirty[id as usize] = false;
                let Some(t) = self.tasks[id as usize].as_mut() else {
                    continue;
                };
                t.flush(&mut self.io);
                if t.finished() {
                    self.tasks[id as usize] = None;
                    self.free_ids.push(id);
                    self.live -= 1;
                }
            }
            self.dirty = dirty;
            self.dirty.clear();
            // Flushing may have produced more ready completions (e.g. a task resubmitting).
            if self.io.has_ready() {
                continue;
            }
            if self.cfg.exit_when_idle && self.had_task && self.live == 0 {
                return;
            }
            if self.io.has_deferred() {
                // A task yielded: submit what this round produced (its replies leave
                // now), pick up what arrived meanwhile, then resume the deferred work
                // behind those arrivals. No sleeping: there is work.
                let pending = self.io.sq_pending();
                // SAFETY: GETEVENTS with min_complete 0 and no argument struct.
                let _ = unsafe {
                    self.io
                        .ring
                        .submitter()
                        .enter::<libc::sigset_t>(pending, 0, 1, None)
                };
                mailbox_fired |= self.reap_ring();
                self.io.fire_timers();
                self.io.release_deferred();
                continue;
            }
            let next_timer = self.io.fire_timers();
            // A timer's owner may have completed something or deferred work (a request
            // parked until a later round): either way there is work, no sleeping.
            if self.io.has_ready() || self.io.has_deferred() {
                continue;
            }
            // Poll briefly before sleeping (hybrid polling). A pending timer (a keep-alive
            // tick, a QoS retry) only shortens the poll: it used to cancel it, which cost
            // every NVMe/TCP queue (its keep-alive tick is always armed) a wakeup per
            // request at queue depth 1. Polling is not gated on a connection's hint that
            // its client answers fast (that made QD1 NBD 22 -> 64 us, measured) but on
            // what the core waits for and on what its polls found (see `crate::poll`).
            let window = if self.cfg.busy_poll {
                Duration::ZERO
            } else {
                self.poll.window(next_timer, self.io.peer_waits() > 0)
            };
            if !window.is_zero() {
                let outcome = self.poll_briefly(window);
                self.poll.record(outcome, window);
                if outcome != PollOutcome::Nothing {
                    mailbox_fired |= self.reap_ring();
                    continue;
                }
            }
            let sleep_from = std::time::Instant::now();
            let res = if self.cfg.busy_poll {
                // GETEVENTS with min_complete 0: run deferred task work without sleeping.
                let pending = self.io.sq_pending();
                // SAFETY: no argument struct is passed.
                unsafe {
                    self.io
                        .ring
                        .submitter()
                        .enter::<libc::sigset_t>(pending, 0, 1, None)
                }
            } else if let Some(d) = next_timer {
                let ts = Timespec::from(d.max(Duration::from_micros(1)));
                let args = SubmitArgs::new().timespec(&ts);
                self.io.ring.submitter().submit_with_args(1, &args)
            } else {
                self.io.ring.submit_and_wait(1)
            };
            if !self.cfg.busy_poll {
                CoreLoad::add(&self.mailbox.load.sleep_ns, sleep_from.elapsed());
            }
            if let Err(e) = res {
                // ETIME: timer expired; EINTR/EBUSY: just retry.
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) {
                    // Logged at the 1st, 2nd, 4th, 8th, ... failure: a ring that keeps
                    // failing must not flood the log from the busiest loop in the node.
                    enter_errors += 1;
                    if enter_errors.is_power_of_two() {
                        tracing::error!(core = self.io.core, error = %e, failures = enter_errors,
                            "io_uring_enter failed");
                    }
                }
            }
            mailbox_fired |= self.reap_ring();
        }
    }

    /// Take every completion off the ring; true when the mailbox's read completed (it is
    /// armed again at once, and the caller handles the mailbox in its next round).
    #[inline]
    fn reap_ring(&mut self) -> bool {
        self.io.tick();
        let mut fired = false;
        self.io.reap(&mut |tag, _res| {
            if tag == MAILBOX_TAG {
                fired = true;
            }
        });
        if fired {
            self.arm_mailbox();
        }
        fired
    }
}

impl Reactor {
    /// Poll the ring without sleeping for up to the poll window. Completions found are
    /// left in the CQ for the caller to reap.
    fn poll_briefly(&mut self, window: Duration) -> PollOutcome {
        let from = std::time::Instant::now();
        let until = from + window;
        // The clock as last read in the loop: the time spent polling is accounted with
        // it, so a poll that finds a completion costs no extra clock read.
        let mut last = from;
        let mut outcome = PollOutcome::Ready;
        loop {
            let pending = self.io.sq_pending();
            // GETEVENTS with min_complete 0 runs deferred task work without sleeping.
            // SAFETY: no argument struct is passed.
            let _ = unsafe {
                self.io
                    .ring
                    .submitter()
                    .enter::<libc::sigset_t>(pending, 0, 1, None)
            };
            if !self.io.ring.completion().is_empty() {
                CoreLoad::add(&self.mailbox.load.poll_ns, last - from);
                return outcome;
            }
            outcome = PollOutcome::Arrived;
            last = std::time::Instant::now();
            if last >= until {
                CoreLoad::add(&self.mailbox.load.poll_ns, last - from);
                return PollOutcome::Nothing;
            }
            std::hint::spin_loop();
        }
    }
}

fn pin_to_cpu(core: usize) {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let n = usize::try_from(libc::sysconf(libc::_SC_NPROCESSORS_ONLN).max(1)).unwrap_or(1);
        libc::CPU_SET(core % n, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Start `cfg.cores` reactor threads; returns each core's mailbox and join handle.
pub fn spawn_reactors(cfg: &ReactorConfig) -> std::io::Result<Vec<(Arc<Mailbox>, JoinHandle<()>)>> {
    let mut out = Vec::new();
    for core in 0..cfg.cores {
        let cfg = cfg.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::Builder::new()
            .name(format!("tessera-core{core}"))
            .spawn(move || {
                if cfg.pin {
                    pin_to_cpu(core);
                }
                match Reactor::new(core, cfg) {
                    Ok(mut r) => {
                        let _ = tx.send(Ok(r.mailbox()));
                        r.run();
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })?;
        let mb = rx
            .recv()
            .map_err(|_| std::io::Error::other("reactor thread died during start"))??;
        out.push((mb, h));
    }
    Ok(out)
}
