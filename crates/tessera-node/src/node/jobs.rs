//! Background jobs of a pool: scrub, resync (after an unclean shutdown) and rebuild,
//! which exclude each other.

use std::collections::BTreeMap;
use std::sync::{Arc, MutexGuard};
use tessera_io::sync::MutexExt;

use tessera_api::{RebuildStatus, ScrubStatus};
use tessera_pool::Pool;

use super::{Error, Node, Result};

impl Node {
    pub(super) fn scrubs(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::scrub::ScrubJob>>> {
        self.scrubs.locked()
    }

    pub(super) fn resyncs(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::scrub::ScrubJob>>> {
        self.resyncs.locked()
    }

    /// The running or last resync of `pool` (started at node start after an unclean
    /// shutdown of a mirrored pool).
    pub fn resync_status(&self, pool: &str) -> Result<ScrubStatus> {
        self.pool(pool)?;
        self.resyncs().get(pool).map(|j| j.status()).ok_or_else(|| {
            Error::not_found(format!(
                "pool '{pool}' has not been resynced since the node started"
            ))
        })
    }

    /// Scrub, resync and rebuild of one pool exclude each other (they share the
    /// layout's copy protocol). Checked with one job map locked at a time.
    pub(super) fn busy_with_copy_job(&self, pool: &str, except: &str) -> Option<&'static str> {
        let running = |m: &BTreeMap<String, Arc<crate::scrub::ScrubJob>>| {
            m.get(pool).is_some_and(|j| j.is_running())
        };
        if except != "scrub" && running(&self.scrubs()) {
            return Some("scrub");
        }
        if except != "resync" && running(&self.resyncs()) {
            return Some("resync");
        }
        if except != "rebuild" && self.rebuilds().get(pool).is_some_and(|j| j.is_running()) {
            return Some("rebuild");
        }
        None
    }

    /// Start a scrub of `pool` in the scrub background class; `repair`: rewrite mirror
    /// copies that differ from the first readable one.
    pub fn start_scrub(&self, pool: &str, repair: bool) -> Result<ScrubStatus> {
        let p = self.pool(pool)?;
        if let Some(job) = self.busy_with_copy_job(pool, "scrub") {
            return Err(Error::busy(format!(
                "a {job} of pool '{pool}' is running: scrub it after"
            )));
        }
        let mut scrubs = self.scrubs();
        if scrubs.get(pool).is_some_and(|j| j.is_running()) {
            return Err(Error::busy(format!(
                "a scrub of pool '{pool}' is already running"
            )));
        }
        let limits = self.background.limits("scrub")?;
        let job = crate::scrub::start(p, limits, repair)
            .map_err(|e| Error::io("starting the scrub thread", e))?;
        let v = job.status();
        scrubs.insert(pool.to_string(), job);
        Ok(v)
    }

    pub fn stop_scrub(&self, pool: &str) -> Result<ScrubStatus> {
        self.pool(pool)?;
        let scrubs = self.scrubs();
        match scrubs.get(pool) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::not_found(format!(
                "no scrub of pool '{pool}' is running"
            ))),
        }
    }

    pub(super) fn rebuilds(
        &self,
    ) -> MutexGuard<'_, BTreeMap<String, Arc<crate::rebuild::RebuildJob>>> {
        self.rebuilds.locked()
    }

    pub(super) fn run_rebuild(
        &self,
        p: &Arc<Pool>,
        device: usize,
        from: u64,
    ) -> Result<RebuildStatus> {
        if let Some(job) = self.busy_with_copy_job(p.name(), "rebuild") {
            return Err(Error::busy(format!(
                "a {job} of pool '{}' is running: stop it or wait",
                p.name()
            )));
        }
        let mut jobs = self.rebuilds();
        if jobs.get(p.name()).is_some_and(|j| j.is_running()) {
            return Err(Error::busy(format!(
                "a rebuild of pool '{}' is already running",
                p.name()
            )));
        }
        let limits = self.background.limits("rebuild")?;
        let job = crate::rebuild::start(p.clone(), device, from, limits, &self.cfg.data_dir)?;
        let v = job.status();
        jobs.insert(p.name().to_string(), job);
        Ok(v)
    }

    /// Rebuild failed device `device` of mirrored pool `pool` (the only failed one when
    /// `None`) in place — a device that came back, or a blank one at the same spec — in
    /// the rebuild background class. `force`: rebuild a healthy device too (a full
    /// resync of that copy).
    pub fn start_rebuild(
        &self,
        pool: &str,
        device: Option<usize>,
        force: bool,
    ) -> Result<RebuildStatus> {
        let p = self.pool(pool)?;
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
        self.run_rebuild(&p, d, 0)
    }

    pub fn stop_rebuild(&self, pool: &str) -> Result<RebuildStatus> {
        self.pool(pool)?;
        match self.rebuilds().get(pool) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::not_found(format!(
                "no rebuild of pool '{pool}' is running"
            ))),
        }
    }

    /// The running or last rebuild of `pool`.
    pub fn rebuild_status(&self, pool: &str) -> Result<RebuildStatus> {
        self.pool(pool)?;
        self.rebuilds()
            .get(pool)
            .map(|j| j.status())
            .ok_or_else(|| {
                Error::not_found(format!(
                    "pool '{pool}' has not been rebuilt since the node started"
                ))
            })
    }

    /// The running or last scrub of `pool`.
    pub fn scrub_status(&self, pool: &str) -> Result<ScrubStatus> {
        self.pool(pool)?;
        self.scrubs().get(pool).map(|j| j.status()).ok_or_else(|| {
            Error::not_found(format!(
                "pool '{pool}' has not been scrubbed since the node started"
            ))
        })
    }
}
