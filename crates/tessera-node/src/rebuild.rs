//! Rebuild of a redundant pool's device (mirror or parity): a background job like scrub
//! (its own thread at idle CPU priority, the "rebuild" background class: a bandwidth limit
//! lowered while the pool's clients see their p99 latency rise), that copies (mirrors) or
//! reconstructs (parity) the metadata units and every allocated unit onto a write-only
//! member (tessera_pool::Layout::start_rebuild, docs/architecture.md); a parity pool's
//! free units are zero-filled there (`Pool::rebuild_free_unit`).
//!
//! The cursor (the next pool unit to copy) is kept in `DATA_DIR/rebuild-POOL.json`,
//! written after a device sync every `CURSOR_EVERY` units: a node that restarts resumes
//! from it (units below it were copied, and every later write reached the device).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tessera_io::cast::usize_of;

use serde::{Deserialize, Serialize};
use tessera_api::{JobState, RebuildStatus};
use tessera_pool::Pool;
use tessera_qos::background::BackgroundLimits;
use tracing::{error, info};

use crate::job::{Figures, Job, Pacer};

/// Bytes copied per step: small enough that a client request queued behind one on a
/// shared disk does not wait long.
const CHUNK: usize = 64 << 10;
/// Units between two persisted cursors.
const CURSOR_EVERY: u64 = 16;

/// A rebuild's progress: the common figures (`counted_from`: the units a resumed rebuild
/// skipped), the device it rebuilds and why it failed.
pub struct Progress {
    job: Figures,
    device: usize,
    error: Option<String>,
}

impl AsMut<Figures> for Progress {
    fn as_mut(&mut self) -> &mut Figures {
        &mut self.job
    }
}

pub type RebuildJob = Job<Progress>;

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
    pub fn status(&self) -> RebuildStatus {
        let p = self.progress();
        RebuildStatus {
            pool: self.pool.clone(),
            device: p.device,
            state: p.job.state,
            started: p.job.started_unix,
            resumed_at_unit_count: p.job.counted_from,
            error: p.error.clone(),
            progress: p.job.progress("rebuild"),
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
    let all = plan(&pool);
    let skipped = all
        .iter()
        .filter(|w| w.0 < from && w.0 >= meta_units)
        .count() as u64;
    let job = Arc::new(Job::new(
        pool.name(),
        Progress {
            job: Figures {
                units_total: all.len() as u64,
                units_done: skipped,
                counted_from: skipped,
                ..Figures::start(limits.bps)
            },
            device,
            error: None,
        },
    ));
    let j = job.clone();
    std::thread::Builder::new()
        .name(format!("tessera-rebuild-{}", pool.name()))
        .spawn(move || run(&pool, &j, device, from, &limits, &path))
        .map_err(|e| tessera_pool::Error::io("starting the rebuild thread", e))?;
    Ok(job)
}

/// The units a rebuild goes through, in pool order (the cursor's order): each with
/// whether it is free (zero-filled) rather than copied or reconstructed.
fn plan(pool: &Pool) -> Vec<(u64, bool)> {
    let mut all: Vec<(u64, bool)> = pool
        .rebuild_units()
        .into_iter()
        .map(|u| (u, false))
        .collect();
    all.extend(pool.rebuild_free_units().into_iter().map(|u| (u, true)));
    all.sort_unstable();
    all
}

/// Why a rebuild failed: the unit it was at and the pool's or the device's error (kept as
/// the source), or finishing it. The job reports its message.
#[derive(Debug, thiserror::Error)]
enum RebuildFailure {
    #[error("unit {unit}: {source}")]
    FreeUnit {
        unit: u64,
        #[source]
        source: tessera_pool::Error,
    },
    #[error("unit {unit}: {source}")]
    Copy {
        unit: u64,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Finish(tessera_pool::Error),
}

fn run(pool: &Pool, job: &RebuildJob, d: usize, from: u64, limits: &BackgroundLimits, path: &Path) {
    let t0 = Instant::now();
    let all = plan(pool);
    let unit = pool.core.unit_size();
    // A resumed rebuild copies the metadata units again: the pool's open wrote them
    // (a checkpoint) while the device was still failed.
    let meta_units = pool.status().metadata / unit;
    let todo = |u: u64| u >= from || u < meta_units;
    let skipped = all.iter().filter(|w| !todo(w.0)).count() as u64;
    {
        let mut p = job.progress();
        p.job.units_total = all.len() as u64;
        p.job.units_done = skipped;
        p.job.counted_from = skipped;
    }
    let mut pacer = Pacer::start(pool, limits, CHUNK as u64);
    job.progress().job.target_us = pacer.target_us();
    if from > 0 {
        info!(
            pool = %job.pool, device = d, unit = from, done = skipped, units = all.len(),
            "rebuild resumes"
        );
    }
    let mut buf = vec![0u8; CHUNK];
    let mut since_save = 0;
    let mut outcome: Result<bool, RebuildFailure> = Ok(true);
    'units: for &(u, free) in all.iter().filter(|w| todo(w.0)) {
        if free {
            // A few write-zeroes: not paced by bytes, but the turn still answers a stop.
            if !job.wait_turn(&mut pacer, pool, 0, t0) {
                outcome = Ok(false);
                break 'units;
            }
            match pool.rebuild_free_unit(d, u, &mut buf) {
                Ok(n) => job.progress().job.bytes_done += n,
                Err(source) => {
                    outcome = Err(RebuildFailure::FreeUnit { unit: u, source });
                    break 'units;
                }
            }
            // Cheap to redo after a restart: no cursor save (a device sync) for it.
            job.progress().job.units_done += 1;
            continue;
        }
        let mut off = 0u64;
        while off < unit {
            let len = usize_of((unit - off).min(CHUNK as u64));
            if !job.wait_turn(&mut pacer, pool, len as u64, t0) {
                outcome = Ok(false);
                break 'units;
            }
            let at = u * unit + off;
            match pool.core.layout.rebuild_range(d, at, &mut buf[..len]) {
                Ok(n) => job.progress().job.bytes_done += n,
                Err(source) => {
                    outcome = Err(RebuildFailure::Copy { unit: u, source });
                    break 'units;
                }
            }
            off += len as u64;
        }
        job.progress().job.units_done += 1;
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
            pool.finish_rebuild(d).map_err(RebuildFailure::Finish)?;
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
    p.job.elapsed = t0.elapsed();
    match outcome {
        Ok(true) => {
            p.job.state = JobState::Done;
            info!(
                pool = %job.pool, device = d, units = p.job.units_done,
                seconds = p.job.elapsed.as_secs_f64(),
                "rebuild done"
            );
        }
        Ok(false) => p.job.state = JobState::Stopped,
        Err(e) => {
            error!(pool = %job.pool, device = d, error = %e, "rebuild failed");
            p.job.state = JobState::Failed;
            p.error = Some(e.to_string());
        }
    }
}
