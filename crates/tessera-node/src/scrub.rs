//! Scrub: a background pass over a pool that re-reads every allocated unit and the
//! metadata, and reports what it found. It runs in the "scrub" background class: its
//! own bandwidth limit, lowered automatically while the pool's clients see their p99
//! latency rise (tessera_qos::background). On the redundant layouts it is the place
//! where mirrors and parity are compared and repaired (the redundancy issue); on concat
//! and raid0 it finds unreadable ranges before a client does.
//!
//! The pass runs on its own thread with the devices' synchronous face: it is background
//! work by definition, and the feedback loop (not a reactor's budget) decides how much
//! of the machine it may take.
//!
//! Each chunk goes through `Layout::scrub_range` (tessera-pool/src/scrub.rs): mirrors
//! compare their copies and, with `repair` (the default), rewrite the ones that differ
//! from the first readable copy. The same job, in the "resync" background class and
//! always repairing, is the mirror resync a node starts when a pool was not shut down
//! cleanly (`start_resync`).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tessera_io::hist::Histogram;
use tessera_pool::{Pool, ScrubFindings};
use tessera_qos::background::{BackgroundLimits, Feedback, FEEDBACK_TICK};
use tessera_qos::TokenBucket;

/// Bytes read per device request: small enough that a client request queued behind one
/// on a shared disk does not wait long.
const CHUNK: usize = 64 << 10;
/// Read errors remembered in detail (all are counted).
const MAX_REPORTED: usize = 100;

#[derive(Default)]
struct Progress {
    state: &'static str,
    started_unix: u64,
    elapsed: Duration,
    units_total: u64,
    units_done: u64,
    bytes_done: u64,
    read_errors: u64,
    /// What `scrub_range` found, summed over the pass (ranges capped at 100).
    found: ScrubFindings,
    errors: Vec<String>,
    metadata: Vec<String>,
    rate_limit_bps: u64,
    target_us: f64,
    backoffs: u64,
    client_p99_us: Option<f64>,
}

pub struct ScrubJob {
    pool: String,
    /// Background class: "scrub", or "resync" (after an unclean shutdown).
    class: &'static str,
    repair: bool,
    stop: AtomicBool,
    progress: Mutex<Progress>,
}

impl ScrubJob {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_running(&self) -> bool {
        self.progress().state == "running"
    }

    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    pub fn status(&self) -> Value {
        let p = self.progress();
        let mut m = crate::job::Figures {
            class: self.class,
            running: p.state == "running",
            elapsed: p.elapsed,
            bytes_done: p.bytes_done,
            units_done: p.units_done,
            units_total: p.units_total,
            counted_from: 0,
            rate_limit_bps: p.rate_limit_bps,
            target_us: p.target_us,
            client_p99_us: p.client_p99_us,
            backoffs: p.backoffs,
        }
        .to_json();
        for (k, v) in [
            ("pool", json!(self.pool)),
            ("state", json!(p.state)),
            ("started", json!(p.started_unix)),
            ("repair", json!(self.repair)),
            ("read_errors", json!(p.read_errors)),
            ("mismatched_bytes", json!(p.found.mismatched)),
            ("repaired_bytes", json!(p.found.repaired)),
            ("unreadable_bytes", json!(p.found.unreadable)),
            (
                "mismatched_ranges",
                json!(p
                    .found
                    .ranges
                    .iter()
                    .map(|&(o, l)| json!({"offset": o, "len": l}))
                    .collect::<Vec<_>>()),
            ),
            ("errors", json!(p.errors)),
            ("metadata_findings", json!(p.metadata)),
        ] {
            m.insert(k.to_string(), v);
        }
        Value::Object(m)
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

/// Start a scrub of `pool` in the background (`repair`: make differing mirror copies
/// equal); the returned job reports progress.
pub fn start(
    pool: Arc<Pool>,
    limits: BackgroundLimits,
    repair: bool,
) -> std::io::Result<Arc<ScrubJob>> {
    spawn(pool, limits, "scrub", repair)
}

/// Start the resync of a mirrored pool whose previous run did not end with a clean
/// shutdown: a scrub with repair in the "resync" class over the metadata and every
/// allocated unit (docs/architecture.md "Scrub and resync"). It starts after a rebuild
/// of the pool (resumed at start) completes, and keeps no cursor: a node that stops
/// before it completes resyncs from the start at the next start (the pool is still
/// marked unclean then).
pub fn start_resync(pool: Arc<Pool>, limits: BackgroundLimits) -> std::io::Result<Arc<ScrubJob>> {
    spawn(pool, limits, "resync", true)
}

fn spawn(
    pool: Arc<Pool>,
    limits: BackgroundLimits,
    class: &'static str,
    repair: bool,
) -> std::io::Result<Arc<ScrubJob>> {
    let job = Arc::new(ScrubJob {
        pool: pool.name().to_string(),
        class,
        repair,
        stop: AtomicBool::new(false),
        progress: Mutex::new(Progress {
            state: "running",
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            rate_limit_bps: limits.bps,
            ..Default::default()
        }),
    });
    let j = job.clone();
    std::thread::Builder::new()
        .name(format!("tessera-{class}-{}", pool.name()))
        .spawn(move || run(&pool, &j, &limits))?;
    Ok(job)
}

fn run(pool: &Pool, job: &ScrubJob, limits: &BackgroundLimits) {
    let layout = &pool.core.layout;
    // A rebuild (resumed at start) uses the same copy protocol: the resync waits for it.
    while layout.rebuilding.load(Relaxed) != 0 && !job.stop.load(Relaxed) {
        std::thread::sleep(FEEDBACK_TICK);
    }
    let t0 = Instant::now();
    // Mirrors: client writes are tracked for the whole pass, so a repair never writes
    // a stale copy over one (tessera_pool::scrub).
    let _track = layout.kind.is_mirror().then(|| layout.track_writes());
    // The clients' latency just before we start is the baseline the target derives from.
    let mut hist = Vec::new();
    client_p99(pool, &mut hist);
    std::thread::sleep(FEEDBACK_TICK);
    let baseline = client_p99(pool, &mut hist);
    let mut fb = Feedback::new(limits, limits.target_us(baseline));
    let metadata = pool.verify_metadata();
    // The metadata units too: on a mirror their copies are compared like data.
    let units = pool.rebuild_units();
    let unit = pool.core.unit_size();
    {
        let mut p = job.progress();
        p.metadata = metadata;
        p.units_total = units.len() as u64;
        p.target_us = fb.target_us();
    }
    let now = Instant::now();
    // A bucket of 100 ms of the rate: smooth, and a rate change applies within a tick.
    let mut bucket = TokenBucket::new(fb.rate(), fb.rate() / 10, 0, now);
    let mut next_tick = now + FEEDBACK_TICK;
    let mut cpu = crate::job::CpuPriority::start();
    let mut stopped = false;
    'units: for &u in &units {
        let base = u * unit;
        let mut off = 0u64;
        while off < unit {
            if job.stop.load(Relaxed) {
                stopped = true;
                break 'units;
            }
            let now = Instant::now();
            if now >= next_tick {
                next_tick = now + FEEDBACK_TICK;
                let p99 = client_p99(pool, &mut hist);
                let limit = fb.rate();
                let rate = fb.observe(p99);
                bucket.set_rate(rate, (rate / 10).max(CHUNK as u64), now);
                let mut p = job.progress();
                cpu.tick(
                    p.bytes_done,
                    (limit as f64 * FEEDBACK_TICK.as_secs_f64()) as u64,
                );
                p.rate_limit_bps = rate;
                p.backoffs = fb.backoffs();
                p.client_p99_us = p99;
                p.elapsed = t0.elapsed();
            }
            let len = (unit - off).min(CHUNK as u64) as usize;
            if let Err(wait) = bucket.try_consume(len as u64, now) {
                std::thread::sleep(wait.min(FEEDBACK_TICK));
                continue;
            }
            let at = base + off;
            let r = layout.scrub_range(at, len as u64, job.repair);
            let mut p = job.progress();
            match r {
                Ok(f) => {
                    p.found.add(&f);
                    if f.unreadable > 0 {
                        p.read_errors += 1;
                        if p.errors.len() < MAX_REPORTED {
                            p.errors.push(format!(
                                "unit {u}: {} of {len} bytes at pool offset {at} unreadable on every copy",
                                f.unreadable
                            ));
                        }
                    }
                }
                Err(e) => {
                    p.read_errors += 1;
                    if p.errors.len() < MAX_REPORTED {
                        p.errors.push(format!(
                            "unit {u}: scrub of {len} bytes at pool offset {at} failed: {e}"
                        ));
                    }
                }
            }
            drop(p);
            off += len as u64;
            job.progress().bytes_done += len as u64;
        }
        job.progress().units_done += 1;
    }
    let mut p = job.progress();
    p.elapsed = t0.elapsed();
    p.state = if stopped { "stopped" } else { "done" };
    if !stopped {
        eprintln!(
            "tessera: {} of pool '{}' done: {} units, {} read errors, {} bytes mismatched, {} repaired, {} metadata findings",
            job.class,
            job.pool,
            p.units_done,
            p.read_errors,
            p.found.mismatched,
            p.found.repaired,
            p.metadata.len()
        );
    }
}
