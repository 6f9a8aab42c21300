//! Rebuild of a redundant pool's device (mirror or parity): a background job like scrub
//! (its own thread at idle CPU priority, the "rebuild" background class: a bandwidth limit
//! lowered while the pool's clients see their p99 latency rise), that copies (mirrors) or
//! reconstructs (parity) the metadata units and every allocated unit onto a write-only
//! member (tessera_pool::Layout::start_rebuild, docs/architecture.md).
//!
//! The cursor (the next pool unit to copy) is kept in `DATA_DIR/rebuild-POOL.json`,
//! written after a device sync every `CURSOR_EVERY` units: a node that restarts resumes
//! from it (units below it were copied, and every later write reached the device).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tessera_api::RebuildStatus;
use tessera_pool::Pool;
use tessera_qos::background::BackgroundLimits;
use tracing::{error, info};

/// Bytes copied per step: small enough that a client request queued behind one on a
/// shared disk does not wait long.
const CHUNK: usize = 64 << 10;
/// Units between two persisted cursors.
const CURSOR_EVERY: u64 = 16;

#[derive(Default)]
struct Progress {
    state: String,
    device: usize,
    started_unix: u64,
    elapsed: Duration,
    resumed_from: u64,
    units_total: u64,
    units_done: u64,
    bytes_done: u64,
    error: Option<String>,
    rate_limit_bps: u64,
    target_us: f64,
    backoffs: u64,
    client_p99_us: Option<f64>,
}

pub struct RebuildJob {
    pool: String,
    stop: AtomicBool,
    progress: Mutex<Progress>,
}

/// The persisted cursor of a pool's rebuild.
pub fn cursor_path(data_dir: &Path, pool: &str) -> PathBuf {
    data_dir.join(format!("rebuild-{pool}.json"))
}

/// `(device, next unit)` of an unfinished rebuild of `pool`, if any.
pub fn load_cursor(data_dir: &Path, pool: &str) -> Option<(usize, u64)> {
    let t = std::fs::read_to_string(cursor_path(data_dir, pool)).ok()?;
    let c: Cursor = serde_json::from_str(&t).ok()?;
    Some((c.device, c.next_unit))
}

/// `DATA_DIR/rebuild-POOL.json`.
#[derive(Serialize, Deserialize)]
struct Cursor {
    device: usize,
    next_unit: u64,
}

pub(crate) fn save_cursor(path: &Path, device: usize, next: u64) {
    let text = serde_json::to_string(&Cursor {
        device,
        next_unit: next,
    })
    .expect("a cursor serialises");
    if let Err(e) = crate::registry::write_atomic(path, text.as_bytes()) {
        error!(cursor = %path.display(), device, error = %e, "cannot save the rebuild cursor");
    }
}

impl RebuildJob {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_running(&self) -> bool {
        self.progress().state == "running"
    }

    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    pub fn status(&self) -> RebuildStatus {
        let p = self.progress();
        let progress = crate::job::Figures {
            class: "rebuild",
            running: p.state == "running",
            elapsed: p.elapsed,
            bytes_done: p.bytes_done,
            units_done: p.units_done,
            units_total: p.units_total,
            counted_from: p.resumed_from,
            rate_limit_bps: p.rate_limit_bps,
            target_us: p.target_us,
            client_p99_us: p.client_p99_us,
            backoffs: p.backoffs,
        }
        .progress();
        RebuildStatus {
            pool: self.pool.clone(),
            device: p.device,
            state: p.state.to_string(),
            started: p.started_unix,
            resumed_at_unit_count: p.resumed_from,
            error: p.error.clone(),
            progress,
        }
    }
}

/// Start rebuilding device `device` of `pool` from pool unit `from` on (0: all), in the
/// background; the device becomes a write-only member before this returns.
pub fn start(
    pool: Arc<Pool>,
    device: usize,
    from: u64,
    limits: BackgroundLimits,
    data_dir: &Path,
) -> tessera_pool::Result<Arc<RebuildJob>> {
    pool.start_rebuild(device)?;
    let path = cursor_path(data_dir, pool.name());
    save_cursor(&path, device, from);
    // What a resumed rebuild skips, known before the thread starts: status right after
    // a restart shows where it resumed (a test read 0 on a busy machine otherwise).
    let unit = pool.core.unit_size();
    let meta_units = pool.status().metadata / unit;
    let all = pool.rebuild_units();
    let skipped = all.iter().filter(|&&u| u < from && u >= meta_units).count() as u64;
    let job = Arc::new(RebuildJob {
        pool: pool.name().to_string(),
        stop: AtomicBool::new(false),
        progress: Mutex::new(Progress {
            state: "running".into(),
            device,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            rate_limit_bps: limits.bps,
            units_total: all.len() as u64,
            units_done: skipped,
            resumed_from: skipped,
            ..Default::default()
        }),
    });
    let j = job.clone();
    std::thread::Builder::new()
        .name(format!("tessera-rebuild-{}", pool.name()))
        .spawn(move || run(&pool, &j, device, from, &limits, &path))
        .map_err(|e| tessera_pool::Error::io("starting the rebuild thread", e))?;
    Ok(job)
}

fn run(pool: &Pool, job: &RebuildJob, d: usize, from: u64, limits: &BackgroundLimits, path: &Path) {
    let t0 = Instant::now();
    let all = pool.rebuild_units();
    let unit = pool.core.unit_size();
    // A resumed rebuild copies the metadata units again: the pool's open wrote them
    // (a checkpoint) while the device was still failed.
    let meta_units = pool.status().metadata / unit;
    let todo = |u: u64| u >= from || u < meta_units;
    let skipped = all.iter().filter(|&&u| !todo(u)).count() as u64;
    {
        let mut p = job.progress();
        p.units_total = all.len() as u64;
        p.units_done = skipped;
        p.resumed_from = skipped;
    }
    let mut pacer = crate::job::Pacer::start(pool, limits, CHUNK as u64);
    job.progress().target_us = pacer.target_us();
    if from > 0 {
        info!(
            pool = %job.pool, device = d, unit = from, done = skipped, units = all.len(),
            "rebuild resumes"
        );
    }
    let mut buf = vec![0u8; CHUNK];
    let mut since_save = 0;
    let mut outcome: Result<bool, String> = Ok(true);
    'units: for &u in all.iter().filter(|&&u| todo(u)) {
        let mut off = 0u64;
        while off < unit {
            if job.stop.load(Relaxed) {
                outcome = Ok(false);
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
            let at = u * unit + off;
            match pool.core.layout.rebuild_range(d, at, &mut buf[..len]) {
                Ok(n) => job.progress().bytes_done += n,
                Err(e) => {
                    outcome = Err(format!("unit {u}: {e}"));
                    break 'units;
                }
            }
            off += len as u64;
        }
        job.progress().units_done += 1;
        since_save += 1;
        if since_save >= CURSOR_EVERY {
            since_save = 0;
            // The copied units must be durable before the cursor says so.
            if pool.core.layout.sync().is_ok() {
                save_cursor(path, d, (u + 1).max(meta_units));
            }
        }
    }
    let outcome = outcome.and_then(|complete| {
        if complete {
            pool.finish_rebuild(d).map_err(|e| e.to_string())?;
        }
        Ok(complete)
    });
    // Only a node that dies mid-rebuild resumes from the cursor: a stopped or failed
    // rebuild leaves the device failed (it misses writes from now on), so the next
    // rebuild starts over.
    if !matches!(outcome, Ok(true)) {
        pool.core
            .layout
            .restore_failed(d, tessera_pool::layout::FailReason::Missing);
    }
    let _ = std::fs::remove_file(path);
    let mut p = job.progress();
    p.elapsed = t0.elapsed();
    match outcome {
        Ok(true) => {
            p.state = "done".into();
            info!(
                pool = %job.pool, device = d, units = p.units_done,
                seconds = p.elapsed.as_secs_f64(),
                "rebuild done"
            );
        }
        Ok(false) => p.state = "stopped".into(),
        Err(e) => {
            error!(pool = %job.pool, device = d, error = %e, "rebuild failed");
            p.state = "failed".into();
            p.error = Some(e);
        }
    }
}
