//! What every background job (scrub, resync, rebuild) shares: the [`Job`] its thread and
//! the node hold (stop flag, progress), how it paces itself ([`Pacer`]: bandwidth
//! bucket, latency feedback, CPU priority) and how it reports progress over pool units,
//! rate, ETA and its controller's state ([`Figures`]).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tessera_io::cast::u64_of_f64;
use tessera_io::sync::MutexExt;

use tessera_io::hist::Histogram;
use tessera_pool::Pool;
use tessera_qos::background::{BackgroundLimits, Feedback, FEEDBACK_TICK};
use tessera_qos::TokenBucket;

use tessera_api::{ClassFigures, JobProgress, JobState, JOB_RUNNING};

/// The CPU priority of a background-job thread. It runs at idle priority (`SCHED_IDLE`):
/// it only gets CPU time that the reactors and the clients leave, which keeps a QD1
/// client at 83–87% of its IOPS during a rebuild (60% at normal priority,
/// docs/benchmarks.md). The class's bandwidth limit and latency feedback bound the job's
/// device load; this bounds its CPU load, which the feedback cannot see (a busy CPU delays
/// a client's next request, not the node's service time). On a machine with no idle CPU
/// that would starve the job, and a rebuild must progress: a feedback tick in which the
/// job did less than a tenth of what its limit allowed lifts it to nice 19 (a small but
/// guaranteed share) until a tick goes well again.
pub(crate) struct CpuPriority {
    idle: bool,
    done_at_tick: u64,
}

impl CpuPriority {
    /// Put the calling thread at idle priority.
    pub fn start() -> CpuPriority {
        let mut p = CpuPriority {
            idle: false,
            done_at_tick: 0,
        };
        p.set(true);
        p
    }

    /// Once per feedback tick: `done` bytes so far, `limit` bytes the tick allowed.
    pub fn tick(&mut self, done: u64, limit: u64) {
        let progressed = done.saturating_sub(self.done_at_tick);
        self.done_at_tick = done;
        self.set(progressed >= limit / 10);
    }

    fn set(&mut self, idle: bool) {
        if idle == self.idle {
            return;
        }
        let (policy, nice) = if idle {
            (libc::SCHED_IDLE, 0)
        } else {
            (libc::SCHED_OTHER, 19)
        };
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: plain syscalls on the calling thread with a valid parameter block.
        let ok = unsafe {
            libc::sched_setscheduler(0, policy, &param) == 0
                && libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) == 0
        };
        if ok {
            self.idle = idle;
        }
    }
}

/// The p99 of every client request of `pool`'s volumes completed since `last`
/// (updated to now); `None` if there were none.
pub(crate) fn client_p99(pool: &Pool, last: &mut Vec<(u32, Histogram)>) -> Option<f64> {
    let mut window = Histogram::default();
    let mut now = Vec::new();
    for v in pool.volumes() {
        let h = v.stats().latency;
        if let Some((_, before)) = last.iter().find(|(id, _)| *id == v.id) {
            window.merge(&h.since(before));
        }
        now.push((v.id, h));
    }
    *last = now;
    (window.count() > 0).then(|| window.quantile(0.99) as f64 / 1000.0)
}

/// Feedback ticks the clients' baseline p99 is measured over before a job starts.
///
/// One tick was not enough: a QD1 client's p99 over 100 ms is the 13th slowest of about
/// 1,300 requests, and one tick with a hiccup in it set a target the job never crossed
/// while the client lost a third of its rate (docs/benchmarks.md, "Scrub feedback").
const BASELINE_TICKS: usize = 5;

/// The baseline from the per-tick p99s before the job: their median (the lower one of
/// an even count), so that one unlucky tick does not raise the target; ticks without
/// client I/O are left out, and `None` when every tick was idle.
fn baseline_p99(ticks: &[Option<f64>]) -> Option<f64> {
    let mut busy: Vec<f64> = ticks.iter().flatten().copied().collect();
    busy.sort_by(f64::total_cmp);
    busy.get(busy.len().checked_sub(1)? / 2).copied()
}

/// What a feedback tick decided, for the job's status.
pub(crate) struct Tick {
    pub rate: u64,
    pub backoffs: u64,
    pub client_p99_us: Option<f64>,
}

/// How a background job paces itself, the same for every job: its class's bandwidth
/// bucket, the AIMD feedback on the pool's clients' p99 (re-read every
/// `FEEDBACK_TICK`), and the job thread's CPU priority.
pub(crate) struct Pacer {
    hist: Vec<(u32, Histogram)>,
    fb: Feedback,
    bucket: TokenBucket,
    next_tick: Instant,
    cpu: CpuPriority,
    /// Bytes per request: the bucket always holds at least one.
    chunk: u64,
}

impl Pacer {
    /// Measure the clients' baseline p99 (unless the class has a latency target of its
    /// own) and start at the class's rate; puts the calling thread at idle CPU priority.
    pub fn start(pool: &Pool, limits: &BackgroundLimits, chunk: u64) -> Pacer {
        let mut hist = Vec::new();
        client_p99(pool, &mut hist);
        let baseline = if limits.latency_target_us.is_some() {
            None
        } else {
            let ticks: Vec<Option<f64>> = (0..BASELINE_TICKS)
                .map(|_| {
                    std::thread::sleep(FEEDBACK_TICK);
                    client_p99(pool, &mut hist)
                })
                .collect();
            baseline_p99(&ticks)
        };
        let fb = Feedback::new(limits, limits.target_us(baseline));
        let now = Instant::now();
        Pacer {
            hist,
            bucket: TokenBucket::new(fb.rate(), fb.rate() / 10, 0, now),
            fb,
            next_tick: now + FEEDBACK_TICK,
            cpu: CpuPriority::start(),
            chunk,
        }
    }

    pub fn target_us(&self) -> f64 {
        self.fb.target_us()
    }

    /// Before each request of `len` bytes. At a feedback tick the rate follows the
    /// clients' p99 and the CPU priority the job's progress (`bytes_done`, read only
    /// then), and the tick's figures are returned for the status. `Err(wait)`: the
    /// bucket is empty; sleep that long and ask again.
    pub fn pace(
        &mut self,
        pool: &Pool,
        len: u64,
        bytes_done: impl FnOnce() -> u64,
    ) -> (Option<Tick>, Result<(), Duration>) {
        let now = Instant::now();
        let mut tick = None;
        if now >= self.next_tick {
            self.next_tick = now + FEEDBACK_TICK;
            let p99 = client_p99(pool, &mut self.hist);
            let limit = self.fb.rate();
            let rate = self.fb.observe(p99);
            self.bucket.set_rate(rate, (rate / 10).max(self.chunk), now);
            self.cpu.tick(
                bytes_done(),
                u64_of_f64(limit as f64 * FEEDBACK_TICK.as_secs_f64()),
            );
            tick = Some(Tick {
                rate,
                backoffs: self.fb.backoffs(),
                client_p99_us: p99,
            });
        }
        let admit = self
            .bucket
            .try_consume(len, now)
            .map_err(|wait| wait.min(FEEDBACK_TICK));
        (tick, admit)
    }
}

/// A job's progress and controller figures: what every job's status shows besides its
/// own findings. Each job keeps one under its progress mutex.
#[derive(Default)]
pub struct Figures {
    /// Running, then done, stopped or failed.
    pub state: JobState,
    /// Unix time the job started.
    pub started_unix: u64,
    pub elapsed: Duration,
    pub bytes_done: u64,
    pub units_done: u64,
    pub units_total: u64,
    /// Units already done when this run started (a resumed job): the ETA is computed
    /// from the units this run did.
    pub counted_from: u64,
    pub rate_limit_bps: u64,
    pub target_us: f64,
    pub client_p99_us: Option<f64>,
    pub backoffs: u64,
}

impl Figures {
    /// A job running from now on, at its class's bandwidth limit.
    pub(crate) fn start(rate_limit_bps: u64) -> Figures {
        Figures {
            state: JOB_RUNNING,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            rate_limit_bps,
            ..Default::default()
        }
    }

    pub(crate) fn is_running(&self) -> bool {
        self.state == JOB_RUNNING
    }

    /// What the pacer decided at a feedback tick, `elapsed` into the job.
    pub(crate) fn record_tick(&mut self, tick: &Tick, elapsed: Duration) {
        self.rate_limit_bps = tick.rate;
        self.backoffs = tick.backoffs;
        self.client_p99_us = tick.client_p99_us;
        self.elapsed = elapsed;
    }

    /// The common status fields of a job of background class `class`; a job's status
    /// adds its own.
    pub(crate) fn progress(&self, class: &str) -> JobProgress {
        let secs = self.elapsed.as_secs_f64();
        let rate = if secs > 0.0 {
            self.bytes_done as f64 / secs
        } else {
            0.0
        };
        let pct = if self.units_total == 0 {
            100.0
        } else {
            self.units_done as f64 * 100.0 / self.units_total as f64
        };
        let left = self.units_total.saturating_sub(self.units_done);
        let done_here = self.units_done.saturating_sub(self.counted_from);
        let eta =
            (done_here > 0 && self.is_running()).then(|| secs / done_here as f64 * left as f64);
        JobProgress {
            elapsed_s: (secs * 10.0).round() / 10.0,
            percent: (pct * 10.0).round() / 10.0,
            units_total: self.units_total,
            units_done: self.units_done,
            bytes_done: self.bytes_done,
            rate_mibps: (rate / 1048576.0 * 10.0).round() / 10.0,
            eta_s: eta.map(|e| e.round()),
            background: ClassFigures {
                class: class.to_string(),
                rate_limit_bps: self.rate_limit_bps,
                latency_target_us: self.target_us.round(),
                client_p99_us: self.client_p99_us.map(f64::round),
                backoffs: self.backoffs,
            },
        }
    }
}

/// A background job as its thread and the node share it: the pool it works on, the stop
/// flag the thread polls, and the progress (`P`: the job's [`Figures`] and its own
/// findings) the status reads. Each job's status is an `impl` on its `Job<P>`.
pub struct Job<P> {
    pub(crate) pool: String,
    stop: AtomicBool,
    progress: Mutex<P>,
}

impl<P: AsMut<Figures>> Job<P> {
    pub(crate) fn new(pool: &str, progress: P) -> Job<P> {
        Job {
            pool: pool.to_string(),
            stop: AtomicBool::new(false),
            progress: Mutex::new(progress),
        }
    }

    pub(crate) fn progress(&self) -> MutexGuard<'_, P> {
        self.progress.locked()
    }

    pub(crate) fn is_running(&self) -> bool {
        self.progress().as_mut().is_running()
    }

    /// Ask the job's thread to stop (it does before its next request).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// Before each request of `len` bytes: wait until `pacer` admits it, recording its
    /// feedback ticks in the progress (`t0`: when the job started). False, at once, when
    /// the job was asked to stop.
    pub(crate) fn wait_turn(&self, pacer: &mut Pacer, pool: &Pool, len: u64, t0: Instant) -> bool {
        loop {
            if self.stopping() {
                return false;
            }
            let (tick, admit) = pacer.pace(pool, len, || self.progress().as_mut().bytes_done);
            if let Some(t) = tick {
                self.progress().as_mut().record_tick(&t, t0.elapsed());
            }
            match admit {
                Ok(()) => return true,
                Err(wait) => std::thread::sleep(wait),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::baseline_p99;

    #[test]
    fn one_slow_tick_does_not_set_the_baseline() {
        // Four quiet ticks and one with a hiccup: the hiccup's p99 is not the baseline
        // (a one-tick baseline taking it would put the target at 1.5x 900 us).
        let ticks = [
            Some(110.0),
            Some(900.0),
            Some(100.0),
            Some(120.0),
            Some(105.0),
        ];
        assert_eq!(baseline_p99(&ticks), Some(110.0));
        // Idle ticks are left out; an even count takes the lower middle.
        assert_eq!(
            baseline_p99(&[None, Some(300.0), Some(100.0), None]),
            Some(100.0)
        );
        assert_eq!(baseline_p99(&[None, None]), None);
        assert_eq!(baseline_p99(&[]), None);
    }
}
