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

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tessera_io::cast::usize_of;

use tessera_api::{JobState, Range, ScrubStatus};
use tessera_pool::{Pool, ScrubFindings};
use tessera_qos::background::{BackgroundLimits, FEEDBACK_TICK};
use tracing::info;

use crate::job::{Figures, Job, Pacer};

/// Bytes read per device request: small enough that a client request queued behind one
/// on a shared disk does not wait long.
const CHUNK: usize = 64 << 10;
/// Read errors remembered in detail (all are counted).
const MAX_REPORTED: usize = 100;

/// A scrub's progress: the common figures and what the pass found.
pub struct Progress {
    job: Figures,
    /// Background class: "scrub", or "resync" (after an unclean shutdown).
    class: &'static str,
    repair: bool,
    read_errors: u64,
    /// What `scrub_range` found, summed over the pass (ranges capped at 100).
    found: ScrubFindings,
    errors: Vec<String>,
    metadata: Vec<String>,
    /// The dedup metadata check's figures, once it ran.
    dedup: Option<tessera_api::DedupScrubInfo>,
}

impl AsMut<Figures> for Progress {
    fn as_mut(&mut self) -> &mut Figures {
        &mut self.job
    }
}

pub type ScrubJob = Job<Progress>;

impl ScrubJob {
    pub fn status(&self) -> ScrubStatus {
        let p = self.progress();
        ScrubStatus {
            pool: self.pool.clone(),
            state: p.job.state,
            started: p.job.started_unix,
            repair: p.repair,
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
            dedup: p.dedup.clone(),
            progress: p.job.progress(p.class),
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
    let job = Arc::new(Job::new(
        pool.name(),
        Progress {
            job: Figures::start(limits.bps),
            class,
            repair,
            read_errors: 0,
            found: ScrubFindings::default(),
            errors: Vec::new(),
            metadata: Vec::new(),
            dedup: None,
        },
    ));
    let j = job.clone();
    std::thread::Builder::new()
        .name(format!("tessera-{class}-{}", pool.name()))
        .spawn(move || run(&pool, &j, &limits, class, repair))?;
    Ok(job)
}

fn run(pool: &Pool, job: &ScrubJob, limits: &BackgroundLimits, class: &str, repair: bool) {
    let layout = &pool.core.layout;
    // A rebuild (resumed at start) uses the same copy protocol: the resync waits for it.
    while layout.health.rebuilding.load(Relaxed) != 0 && !job.stopping() {
        std::thread::sleep(FEEDBACK_TICK);
    }
    let t0 = Instant::now();
    // Mirrors: client writes are tracked for the whole pass, so a repair never writes
    // a stale copy over one (tessera_pool::scrub).
    let _track = layout.kind.is_mirror().then(|| layout.track_writes());
    // The clients' latency just before we start is the baseline the target derives from.
    let mut pacer = Pacer::start(pool, limits, CHUNK as u64);
    let metadata = pool.verify_metadata();
    // The metadata units too: on a mirror their copies are compared like data.
    let units = pool.rebuild_units();
    let unit = pool.core.unit_size();
    {
        let mut p = job.progress();
        p.metadata = metadata;
        p.job.units_total = units.len() as u64;
        p.job.target_us = pacer.target_us();
    }
    let mut stopped = false;
    'units: for &u in &units {
        let base = u * unit;
        let mut off = 0u64;
        while off < unit {
            let len = usize_of((unit - off).min(CHUNK as u64));
            if !job.wait_turn(&mut pacer, pool, len as u64, t0) {
                stopped = true;
                break 'units;
            }
            let at = base + off;
            let r = layout.scrub_range(at, len as u64, repair);
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
            job.progress().job.bytes_done += len as u64;
        }
        job.progress().job.units_done += 1;
    }
    // The dedup metadata after the data: on a mirror, the blocks the index entries are
    // checked against have been made equal first.
    if !stopped {
        if let Some((info, findings)) = pool.scrub_dedup(repair, &|| job.stopping()) {
            stopped = job.stopping();
            let mut p = job.progress();
            let room = MAX_REPORTED.saturating_sub(p.metadata.len());
            p.metadata.extend(findings.into_iter().take(room));
            p.dedup = Some(info);
        }
    }
    let mut p = job.progress();
    p.job.elapsed = t0.elapsed();
    p.job.state = if stopped {
        JobState::Stopped
    } else {
        JobState::Done
    };
    if !stopped {
        info!(
            job = class, pool = %job.pool, units = p.job.units_done,
            read_errors = p.read_errors, mismatched_bytes = p.found.mismatched,
            repaired_bytes = p.found.repaired, metadata_findings = p.metadata.len(),
            "{class} done"
        );
    }
}
