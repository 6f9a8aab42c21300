//! The jobs service: a pool's background copy jobs — scrub, resync (after an unclean
//! shutdown of a mirrored pool) and rebuild — and the background classes' limits they
//! run under (`DATA_DIR/background.json`, crate::background).
//!
//! It owns, by pool name, the running or last job of each kind (what `status` shows
//! until the node stops or the pool is destroyed; a pool is not destroyed while one
//! runs), under one lock: starting a job checks the others and records
//! the new one in the same critical section, so two requests cannot both start. It
//! owns the rebuild cursors' directory (the data directory) too: a rebuild a stopped
//! node left resumes from its cursor ([`Jobs::resume_rebuild`]).
//!
//! What excludes what: scrub, resync and rebuild of one pool exclude each other (they
//! share the layout's copy protocol), and each kind runs once per pool. The one
//! exception is the resync the node starts at start-up after a rebuild it resumed: it
//! is started anyway and waits for the rebuild (crate::scrub). Jobs of different pools
//! are independent. Device replacement asks [`Jobs::busy`] before it swaps a device in.
//!
//! The pool itself is resolved by the caller (the node's pools), so a job of a pool
//! that is not open is never started or shown; the methods take the open pool.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use tessera_io::sync::MutexExt;

use tessera_api::{RebuildStatus, ScrubStatus};
use tessera_pool::Pool;
use tracing::error;

use crate::background::Background;
use crate::error::{Error, Result, StartError};
use crate::rebuild::RebuildJob;
use crate::scrub::ScrubJob;

/// The kinds of copy job, in the order a busy pool names the one it runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Scrub,
    Resync,
    Rebuild,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Scrub => "scrub",
            Kind::Resync => "resync",
            Kind::Rebuild => "rebuild",
        }
    }
}

/// One pool's running or last job of each kind.
#[derive(Default)]
struct PoolJobs {
    scrub: Option<Arc<ScrubJob>>,
    resync: Option<Arc<ScrubJob>>,
    rebuild: Option<Arc<RebuildJob>>,
}

impl PoolJobs {
    fn is_running(&self, kind: Kind) -> bool {
        match kind {
            Kind::Scrub => self.scrub.as_ref().is_some_and(|j| j.is_running()),
            Kind::Resync => self.resync.as_ref().is_some_and(|j| j.is_running()),
            Kind::Rebuild => self.rebuild.as_ref().is_some_and(|j| j.is_running()),
        }
    }

    /// The running job of a kind other than `except`, if any.
    fn running_besides(&self, except: Option<Kind>) -> Option<&'static str> {
        [Kind::Scrub, Kind::Resync, Kind::Rebuild]
            .into_iter()
            .find(|&k| Some(k) != except && self.is_running(k))
            .map(Kind::name)
    }
}

pub struct Jobs {
    /// Where the rebuild cursors are kept (crate::rebuild::cursor_path).
    data_dir: PathBuf,
    /// The background classes' limits a job starts with.
    background: Background,
    jobs: Mutex<BTreeMap<String, PoolJobs>>,
}

impl Jobs {
    /// The jobs service of the node whose data directory is `data_dir`: no job yet, the
    /// background classes as `background.json` sets them.
    pub fn load(data_dir: &Path) -> std::result::Result<Jobs, StartError> {
        Ok(Jobs {
            data_dir: data_dir.to_path_buf(),
            background: Background::load(data_dir)?,
            jobs: Mutex::new(BTreeMap::new()),
        })
    }

    /// The background classes' limits (`/v1/background`); a change applies to the jobs
    /// started after it.
    pub fn background(&self) -> &Background {
        &self.background
    }

    fn jobs(&self) -> MutexGuard<'_, BTreeMap<String, PoolJobs>> {
        self.jobs.locked()
    }

    /// The copy job running on `pool`, if any (a device must not be swapped in under
    /// one).
    pub fn busy(&self, pool: &str) -> Option<&'static str> {
        self.jobs().get(pool)?.running_besides(None)
    }

    /// Drop what is recorded of pool `pool`'s jobs: the pool was destroyed, and a new
    /// pool of the same name must not show them. The caller has checked [`Jobs::busy`]
    /// (a pool is not destroyed under a running job).
    pub(crate) fn forget(&self, pool: &str) {
        self.jobs().remove(pool);
    }

    /// Start a scrub of `p` in the scrub background class; `repair`: rewrite mirror
    /// copies that differ from the first readable one.
    pub fn start_scrub(&self, p: &Arc<Pool>, repair: bool) -> Result<ScrubStatus> {
        let pool = p.name();
        let limits = self.background.limits(Kind::Scrub.name())?;
        let mut jobs = self.jobs();
        if let Some(running) = jobs.get(pool) {
            if let Some(job) = running.running_besides(Some(Kind::Scrub)) {
                return Err(Error::busy(format!(
                    "a {job} of pool '{pool}' is running: scrub it after"
                )));
            }
            if running.is_running(Kind::Scrub) {
                return Err(Error::busy(format!(
                    "a scrub of pool '{pool}' is already running"
                )));
            }
        }
        let job = crate::scrub::start(p.clone(), limits, repair)
            .map_err(|e| Error::io("starting the scrub thread", e))?;
        let v = job.status();
        jobs.entry(pool.to_string()).or_default().scrub = Some(job);
        Ok(v)
    }

    pub fn stop_scrub(&self, p: &Pool) -> Result<ScrubStatus> {
        let pool = p.name();
        match self.jobs().get(pool).and_then(|j| j.scrub.as_ref()) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::not_found(format!(
                "no scrub of pool '{pool}' is running"
            ))),
        }
    }

    /// The running or last scrub of `p`.
    pub fn scrub_status(&self, p: &Pool) -> Result<ScrubStatus> {
        let pool = p.name();
        self.jobs()
            .get(pool)
            .and_then(|j| j.scrub.as_ref())
            .map(|j| j.status())
            .ok_or_else(|| {
                Error::not_found(format!(
                    "pool '{pool}' has not been scrubbed since the node started"
                ))
            })
    }

    /// Resync the mirror copies of `p`, whose previous run did not end with a clean
    /// shutdown, in the resync background class. Not refused while a rebuild runs: the
    /// node starts it after resuming a rebuild, and the resync waits for that to end.
    pub(crate) fn start_resync(&self, p: &Arc<Pool>) -> Result<ScrubStatus> {
        let limits = self.background.limits(Kind::Resync.name())?;
        let job = crate::scrub::start_resync(p.clone(), limits)
            .map_err(|e| Error::io("starting the resync thread", e))?;
        let v = job.status();
        self.jobs().entry(p.name().to_string()).or_default().resync = Some(job);
        Ok(v)
    }

    /// The running or last resync of `p` (started at node start after an unclean
    /// shutdown of a mirrored pool).
    pub fn resync_status(&self, p: &Pool) -> Result<ScrubStatus> {
        let pool = p.name();
        self.jobs()
            .get(pool)
            .and_then(|j| j.resync.as_ref())
            .map(|j| j.status())
            .ok_or_else(|| {
                Error::not_found(format!(
                    "pool '{pool}' has not been resynced since the node started"
                ))
            })
    }

    /// Rebuild failed device `device` of redundant pool `p` (the only failed one when
    /// `None`) in place — a device that came back, or a blank one at the same spec — in
    /// the rebuild background class. `force`: rebuild a healthy device too (a full
    /// resync of that copy).
    pub fn start_rebuild(
        &self,
        p: &Arc<Pool>,
        device: Option<usize>,
        force: bool,
    ) -> Result<RebuildStatus> {
        let pool = p.name();
        let l = &p.core.layout;
        let d = match device {
            Some(d) => d,
            None => {
                let failed: Vec<usize> = (0..l.devices.len()).filter(|&i| l.is_failed(i)).collect();
                match failed[..] {
                    [d] => d,
                    [] => return Err(Error::invalid(format!("pool '{pool}' has no failed device"))),
                    _ => return Err(Error::invalid(format!("pool '{pool}' has several failed devices ({failed:?}): name one with \"device\""))),
                }
            }
        };
        if d >= l.devices.len() || !(force || l.is_failed(d)) {
            return Err(Error::invalid(format!(
                "device {d} of pool '{pool}' is not failed"
            )));
        }
        self.rebuild(p, d, 0)
    }

    /// Rebuild device `device` of `p` from pool unit `from` on (0: all): what
    /// [`Jobs::start_rebuild`] starts once it knows the device, and what a device
    /// replacement starts onto the new device.
    pub(crate) fn rebuild(&self, p: &Arc<Pool>, device: usize, from: u64) -> Result<RebuildStatus> {
        let pool = p.name();
        let limits = self.background.limits(Kind::Rebuild.name())?;
        let mut jobs = self.jobs();
        if let Some(running) = jobs.get(pool) {
            if let Some(job) = running.running_besides(Some(Kind::Rebuild)) {
                return Err(Error::busy(format!(
                    "a {job} of pool '{pool}' is running: stop it or wait"
                )));
            }
            if running.is_running(Kind::Rebuild) {
                return Err(Error::busy(format!(
                    "a rebuild of pool '{pool}' is already running"
                )));
            }
        }
        let job = crate::rebuild::start(p.clone(), device, from, limits, &self.data_dir)?;
        let v = job.status();
        jobs.entry(pool.to_string()).or_default().rebuild = Some(job);
        Ok(v)
    }

    /// Resume the rebuild of `p` the node was running when it stopped, if its cursor
    /// says there was one. Runs at start, before any client can write (the device
    /// missed nothing below the cursor); a rebuild that cannot resume is logged, and
    /// the device stays as the pool opened it.
    pub(crate) fn resume_rebuild(&self, p: &Arc<Pool>) {
        if let Some((d, next)) = crate::rebuild::load_cursor(&self.data_dir, p.name()) {
            if let Err(e) = self.rebuild(p, d, next) {
                error!(pool = %p.name(), device = d, error = %e, "cannot resume the rebuild");
            }
        }
    }

    pub fn stop_rebuild(&self, p: &Pool) -> Result<RebuildStatus> {
        let pool = p.name();
        match self.jobs().get(pool).and_then(|j| j.rebuild.as_ref()) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::not_found(format!(
                "no rebuild of pool '{pool}' is running"
            ))),
        }
    }

    /// The running or last rebuild of `p`.
    pub fn rebuild_status(&self, p: &Pool) -> Result<RebuildStatus> {
        let pool = p.name();
        self.jobs()
            .get(pool)
            .and_then(|j| j.rebuild.as_ref())
            .map(|j| j.status())
            .ok_or_else(|| {
                Error::not_found(format!(
                    "pool '{pool}' has not been rebuilt since the node started"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tessera_api::JobState;
    use tessera_device::BlockDevice;
    use tessera_pool::format::DEV_DATA_START;
    use tessera_pool::LayoutKind;
    use tessera_qos::BackgroundLimits;

    use crate::node::test_pools::{ram_pool, UNIT};

    /// Pool "p", a two-way mirror, and its RAM devices.
    fn mirror() -> (Arc<Pool>, Vec<Arc<tessera_device::RamDevice>>) {
        ram_pool("p", LayoutKind::Raid1 { copies: 2 }, 2)
    }

    /// A jobs service on data directory `dir` whose class `slow` runs at the lowest rate
    /// there is (4 KiB/s: a 64 KiB step each 16 s), so that a job of it is still running
    /// whatever the test does next, until it is stopped.
    fn service(dir: &tempfile::TempDir, slow: &str) -> Jobs {
        let jobs = Jobs::load(dir.path()).unwrap();
        jobs.background()
            .put(slow, Some(BackgroundLimits::new(4096)))
            .unwrap();
        jobs
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !done() {
            assert!(t0.elapsed() < Duration::from_secs(30), "{what}: timed out");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Scrub `p` to its end and return what it reports.
    fn scrub(jobs: &Jobs, p: &Arc<Pool>, repair: bool) -> ScrubStatus {
        jobs.start_scrub(p, repair).unwrap();
        wait_until("scrub", || jobs.busy("p").is_none());
        jobs.scrub_status(p).unwrap()
    }

    fn busy_message(r: Result<impl std::fmt::Debug>) -> String {
        match r {
            Err(Error::Busy(m)) => m,
            other => panic!("expected a busy error, got {other:?}"),
        }
    }

    #[test]
    fn a_running_rebuild_refuses_a_scrub_until_it_ends() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = service(&dir, "rebuild");
        let (p, _ram) = mirror();
        let r = jobs.start_rebuild(&p, Some(1), true).unwrap();
        assert_eq!((r.state, r.device), (JobState::Running, 1));
        assert_eq!(jobs.busy("p"), Some("rebuild"));
        assert_eq!(jobs.busy("other"), None);

        assert_eq!(
            busy_message(jobs.start_scrub(&p, false)),
            "a rebuild of pool 'p' is running: scrub it after"
        );
        assert!(
            matches!(jobs.scrub_status(&p), Err(Error::NotFound(_))),
            "a refused scrub is not recorded"
        );
        assert_eq!(
            busy_message(jobs.start_rebuild(&p, Some(1), true)),
            "a rebuild of pool 'p' is already running"
        );

        assert_eq!(jobs.stop_rebuild(&p).unwrap().device, 1);
        wait_until("the rebuild to stop", || jobs.busy("p").is_none());
        assert_eq!(jobs.rebuild_status(&p).unwrap().state, JobState::Stopped);
        assert!(matches!(jobs.stop_rebuild(&p), Err(Error::NotFound(_))));
        // Once the rebuild has ended the pool may be scrubbed.
        assert_eq!(scrub(&jobs, &p, false).state, JobState::Done);
    }

    #[test]
    fn a_running_scrub_refuses_a_rebuild_and_another_scrub() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = service(&dir, "scrub");
        let (p, _ram) = mirror();
        assert_eq!(jobs.start_scrub(&p, true).unwrap().state, JobState::Running);
        assert_eq!(jobs.busy("p"), Some("scrub"));

        assert_eq!(
            busy_message(jobs.start_rebuild(&p, Some(1), true)),
            "a scrub of pool 'p' is running: stop it or wait"
        );
        assert!(matches!(jobs.rebuild_status(&p), Err(Error::NotFound(_))));
        // The refused rebuild did not make device 1 a write-only member.
        let rebuilding = &p.core.layout.health.rebuilding;
        assert_eq!(rebuilding.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert_eq!(
            busy_message(jobs.start_scrub(&p, false)),
            "a scrub of pool 'p' is already running"
        );

        let s = jobs.stop_scrub(&p).unwrap();
        assert!(s.repair, "the status is the running scrub's");
        wait_until("the scrub to stop", || jobs.busy("p").is_none());
        assert_eq!(jobs.scrub_status(&p).unwrap().state, JobState::Stopped);
        assert!(matches!(jobs.stop_scrub(&p), Err(Error::NotFound(_))));
    }

    #[test]
    fn a_pool_without_jobs_has_no_status() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::load(dir.path()).unwrap();
        let (p, _ram) = mirror();
        let not_found = |r: Result<String>| match r {
            Err(Error::NotFound(m)) => m,
            other => panic!("expected not found, got {other:?}"),
        };
        let scrub = not_found(jobs.scrub_status(&p).map(|s| s.pool));
        assert_eq!(
            scrub,
            "pool 'p' has not been scrubbed since the node started"
        );
        let resync = not_found(jobs.resync_status(&p).map(|s| s.pool));
        assert_eq!(
            resync,
            "pool 'p' has not been resynced since the node started"
        );
        let rebuild = not_found(jobs.rebuild_status(&p).map(|s| s.pool));
        assert_eq!(
            rebuild,
            "pool 'p' has not been rebuilt since the node started"
        );
        assert!(matches!(jobs.stop_scrub(&p), Err(Error::NotFound(_))));
        assert_eq!(jobs.busy("p"), None);
    }

    #[test]
    fn a_finished_scrub_reports_what_it_found() {
        let dir = tempfile::tempdir().unwrap();
        let jobs = Jobs::load(dir.path()).unwrap();
        let (p, ram) = mirror();
        // Device 1's copy of the last metadata unit gets other bytes than device 0's (a
        // mirror keeps pool offset X at device offset DEV_DATA_START + X on each copy).
        let last_meta = p.status().metadata - UNIT;
        let at = last_meta + 4096;
        ram[1].write_at(DEV_DATA_START + at, &[0xa5; 4096]).unwrap();

        let found = scrub(&jobs, &p, false);
        assert_eq!(found.state, JobState::Done);
        let units = p.rebuild_units().len() as u64;
        assert_eq!(found.progress.units_total, units);
        assert_eq!(found.progress.units_done, units);
        assert!(found.mismatched_bytes > 0, "{found:?}");
        assert_eq!(found.repaired_bytes, 0);
        assert!(
            found
                .mismatched_ranges
                .iter()
                .any(|r| r.offset <= at && at < r.offset + r.len),
            "{found:?}"
        );

        let repaired = scrub(&jobs, &p, true);
        assert_eq!(repaired.state, JobState::Done);
        assert!(repaired.repaired_bytes > 0, "{repaired:?}");
        // The status is the last scrub's: after the repair the copies are equal.
        let after = scrub(&jobs, &p, false);
        assert_eq!((after.mismatched_bytes, after.repaired_bytes), (0, 0));
        assert!(after.mismatched_ranges.is_empty(), "{after:?}");
    }
}
