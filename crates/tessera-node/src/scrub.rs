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

use tessera_api::{Range, ScrubStatus};
use tessera_pool::{Pool, ScrubFindings};
use tessera_qos::background::{BackgroundLimits, FEEDBACK_TICK};
use tracing::info;

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

    pub fn status(&self) -> ScrubStatus {
        let p = self.progress();
        let progress = crate::job::Figures {
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
        .progress();
        ScrubStatus {
            pool: self.pool.clone(),
            state: p.state.to_string(),
            started: p.started_unix,
            repair: self.repair,
            read_errors: p.read_errors,
            mismatched_bytes: p.found.mismatched,
            repaired_bytes: p.found.repaired,
            unreadable_bytes: p.found.unreadable,
            mismatched_ranges: p
                .found
                .ranges
                .iter()
                .map(|&(offset, len)| Range { offset, len })
                .collect(),
            errors: p.errors.clone(),
            metadata_findings: p.metadata.clone(),
            progress,
        }
    }
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
    while layout.health.rebuilding.load(Relaxed) != 0 && !job.stop.load(Relaxed) {
        std::thread::sleep(FEEDBACK_TICK);
    }
    let t0 = Instant::now();
    // Mirrors: client writes are tracked for the whole pass, so a repair never writes
    // a stale copy over one (tessera_pool::scrub).
    let _track = layout.kind.is_mirror().then(|| layout.track_writes());
    // The clients' latency just before we start is the baseline the target derives from.
    let mut pacer = crate::job::Pacer::start(pool, limits, CHUNK as u64);
    let metadata = pool.verify_metadata();
    // The metadata units too: on a mirror their copies are compared like data.
    let units = pool.rebuild_units();
    let unit = pool.core.unit_size();
    {
        let mut p = job.progress();
        p.metadata = metadata;
        p.units_total = units.len() as u64;
        p.target_us = pacer.target_us();
    }
    let mut stopped = false;
    'units: for &u in &units {
        let base = u * unit;
        let mut off = 0u64;
        while off < unit {
            if job.stop.load(Relaxed) {
                stopped = true;
                break 'units;
            }
            let len = (unit - off).min(CHUNK as u64) as usize;
            let (tick, admit) = pacer.pace(pool, len as u64, || job.progress().bytes_done);
            if let Some(t) = tick {
                let mut p = job.progress();
                p.rate_limit_bps = t.rate;
                p.backoffs = t.backoffs;
                p.client_p99_us = t.client_p99_us;
                p.elapsed = t0.elapsed();
            }
            if let Err(wait) = admit {
                std::thread::sleep(wait);
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
        info!(
            job = job.class, pool = %job.pool, units = p.units_done,
            read_errors = p.read_errors, mismatched_bytes = p.found.mismatched,
            repaired_bytes = p.found.repaired, metadata_findings = p.metadata.len(),
            "{} done", job.class
        );
    }
}
