//! Attaching, switching and detaching a pool's cache tier (`crate::cache_tier`).

use std::sync::atomic::Ordering::Release;
use std::sync::Arc;
use std::time::Duration;

use tessera_device::BlockDevice;
use tessera_io::sync::RwLockExt;

use super::Pool;
use crate::cache_tier::{
    device_claim, encode_label, read_label, CacheInfo, CacheMode, CacheTier, DeviceClaim,
};
use crate::{Error, Result};

/// How long a detach waits for the tier's operations in flight.
const DETACH_WAIT: Duration = Duration::from_secs(30);

/// Why attaching a cache device is refused, or `None`.
fn refuse(claim: &DeviceClaim, pool_uuid: &[u8; 16], reopen: bool) -> Option<&'static str> {
    match claim {
        DeviceClaim::PoolDevice => Some("it carries a pool's device label"),
        DeviceClaim::CacheOf(u) if u != pool_uuid => Some("it is another pool's cache device"),
        DeviceClaim::CacheOf(_) => None,
        DeviceClaim::Blank if reopen => Some("it carries no cache label of this pool"),
        DeviceClaim::Blank => None,
    }
}

impl Pool {
    /// Give the pool a cache tier on `devices` (one, or two that mirror each other):
    /// each is labelled for this pool (docs/format.md §16) and the tier starts empty.
    /// A device that carries a pool's label or another pool's cache label is refused
    /// unless `force`. `reopen`: the devices are this pool's cache from an earlier run
    /// (their labels must say so, except on volatile devices, which lost theirs). `unit`:
    /// the cache unit, 16 KiB to 1 MiB (`cache_tier::CACHE_UNIT` by default).
    ///
    /// Write-back needs devices that keep their data across a restart, and two of them
    /// unless `force` (one device's failure would lose the writes only it has). Reopened,
    /// a tier reads its slot records back first: the dirty data found is drained in the
    /// background (and at once when the mode is no longer write-back).
    pub fn attach_cache(
        &self,
        devices: Vec<Arc<dyn BlockDevice>>,
        mode: CacheMode,
        unit: u64,
        force: bool,
        reopen: bool,
    ) -> Result<()> {
        crate::cache_tier::check_unit(unit)?;
        if self.core.dedup().is_some() {
            return Err(Error::invalid(format!(
                "pool '{}' deduplicates: a cache tier on a dedup pool is not available yet",
                self.core.name
            )));
        }
        let mut slot = self.core.cache.tier.write_locked();
        if slot.is_some() {
            return Err(Error::AlreadyExists(format!(
                "pool '{}' already has a cache: remove it first",
                self.core.name
            )));
        }
        if mode == CacheMode::WriteBack {
            check_write_back(&devices, force || reopen)?;
        }
        let uuid = self.core.uuid;
        let count = u32::try_from(devices.len()).unwrap_or(u32::MAX);
        // The epoch of a tier reopened from labels that describe it as it is now: its
        // records count. Otherwise a new one, which makes every old record stale.
        let mut epoch = None;
        if reopen {
            let labels: Vec<_> = devices
                .iter()
                .filter_map(|d| read_label(d.as_ref()).ok().flatten())
                .filter(|l| l.uuid == uuid && l.unit == unit && l.epoch != 0)
                .collect();
            epoch = labels.first().map(|l| (l.epoch, l.meta_len, l.slots));
        }
        for (i, d) in devices.iter().enumerate() {
            let claim = device_claim(d.as_ref())?;
            let reopen = reopen && !d.is_volatile();
            if let Some(why) = refuse(&claim, &uuid, reopen) {
                if !force || reopen {
                    return Err(Error::invalid(format!(
                        "cache device {i} cannot be used: {why}{}",
                        if reopen {
                            ""
                        } else {
                            " (force to overwrite it)"
                        }
                    )));
                }
            }
        }
        let fresh = super::random_uuid();
        let new_epoch = u64::from_le_bytes(fresh[..8].try_into().expect("8 bytes")) | 1;
        let tier = CacheTier::new(devices.clone(), mode, unit, new_epoch)?;
        let (epoch, load) = match epoch {
            Some((e, m, s)) if m == tier.geo.meta_len && s == tier.geo.slots => (e, true),
            _ => (new_epoch, false),
        };
        let tier = if epoch == new_epoch {
            tier
        } else {
            CacheTier::new(devices.clone(), mode, unit, epoch)?
        };
        for (i, d) in devices.iter().enumerate() {
            let label = encode_label(
                &uuid,
                u32::try_from(i).unwrap_or(u32::MAX),
                count,
                unit,
                epoch,
                tier.geo.meta_len,
                tier.geo.slots,
            );
            d.write_at(0, &label)
                .and_then(|()| d.sync())
                .map_err(|e| Error::io("writing a cache label", e))?;
        }
        let tier = Arc::new(tier);
        if load {
            let core = &self.core;
            let owned = |offset: u64| core.unit_owned(offset);
            let found = tier
                .load_records(&owned)
                .map_err(|e| Error::io("reading the cache's slot records", e))?;
            if found > 0 {
                tracing::info!(pool = %core.name, dirty_bytes = found, "write-back data found on the cache devices: it is drained to the pool's devices");
                tier.drain_if_dirty();
            }
        }
        tier.start(&self.core.layout);
        *slot = Some(tier);
        self.core.cache.lost.store(false, Release);
        self.core.cache.gen.fetch_add(1, Release);
        Ok(())
    }

    /// A write-back tier the pool had cannot be opened: every request to the pool's
    /// volumes fails with EIO until it is attached again or its loss is accepted
    /// (`accept_cache_loss`), since any unit may have its newest bytes there.
    pub fn mark_cache_lost(&self) {
        self.core.cache.lost.store(true, Release);
        self.core.cache.gen.fetch_add(1, Release);
    }

    /// Whether the pool's volumes fail I/O for a write-back tier that is missing.
    pub fn cache_lost(&self) -> bool {
        self.core
            .cache
            .lost
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Give up on a missing write-back tier: the volumes serve what the pool's devices
    /// have (older bytes where the cache had newer ones).
    pub fn accept_cache_loss(&self) {
        self.core.cache.lost.store(false, Release);
        self.core.cache.gen.fetch_add(1, Release);
    }

    /// Remove the cache tier: requests stop using it at once; its operations in flight
    /// are waited for (the pool's devices have every write, so nothing is lost) and the
    /// devices' cache labels are cleared. Returns the devices it had.
    pub fn detach_cache(&self) -> Result<Vec<Arc<dyn BlockDevice>>> {
        let slot = self.core.cache.tier.write_locked();
        let Some(t) = slot.as_ref() else {
            return Err(self.no_cache());
        };
        if t.mode() == CacheMode::WriteBack {
            return Err(Error::Busy(format!(
                "the cache of pool '{}' is in write-back mode: switch it to write-through \
                 first (which drains it), then remove it",
                self.core.name
            )));
        }
        // A drain under way (out of write-back): wait for it a while.
        let t = t.clone();
        drop(slot);
        let start = std::time::Instant::now();
        while t.has_dirty() && start.elapsed() < DETACH_WAIT {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut slot = self.core.cache.tier.write_locked();
        if t.has_dirty() {
            return Err(Error::Busy(format!(
                "the cache of pool '{}' is still draining ({} bytes dirty): `pool cache show` \
                 follows it; remove it when it is clean",
                self.core.name,
                t.dirty_bytes()
            )));
        }
        let tier = slot.take().expect("checked");
        drop(slot);
        self.core.cache.gen.fetch_add(1, Release);
        tier.stop_threads();
        if !tier.detach(DETACH_WAIT) {
            tracing::warn!(pool = %self.core.name, "cache operations still in flight after the wait; their results are ignored");
        }
        let devs = tier.layout.devices.clone();
        for d in &devs {
            if let Err(e) = d
                .write_at(0, &[0u8; crate::format::BLOCK])
                .and_then(|()| d.sync())
            {
                tracing::warn!(pool = %self.core.name, error = %e, "clearing a cache label failed");
            }
        }
        Ok(devs)
    }

    /// The attached cache tier, or the error that says the pool has none.
    fn tier(&self) -> Result<Arc<CacheTier>> {
        self.core.cache_tier().ok_or_else(|| self.no_cache())
    }

    fn no_cache(&self) -> Error {
        Error::NotFound(format!("pool '{}' has no cache", self.core.name))
    }

    /// How many misses a unit needs before the full cache admits it (at least 1; see
    /// [`CacheTier::set_admit_hits`]).
    pub fn set_cache_admit_hits(&self, admit_hits: u8) -> Result<()> {
        let tier = self.tier()?;
        crate::cache_tier::check_admit_hits(admit_hits)?;
        tier.set_admit_hits(admit_hits);
        Ok(())
    }

    /// Switch the tier's mode online. Into write-back, as `attach_cache` checks (one
    /// device needs `force`). Out of it, the dirty data drains in the background first
    /// (`pool cache show` says "draining" and how much is left).
    pub fn set_cache_mode(&self, mode: CacheMode, force: bool) -> Result<()> {
        let tier = self.tier()?;
        if mode == CacheMode::WriteBack {
            check_write_back(&tier.layout.devices, force)?;
            if tier.failed() {
                return Err(Error::invalid(
                    "the cache tier failed: remove it and add working devices first",
                ));
            }
        }
        tier.set_mode(mode);
        Ok(())
    }

    pub fn cache_status(&self) -> Option<CacheInfo> {
        self.core.cache_tier().map(|t| t.status())
    }
}

/// Write-back keeps the only copy of acknowledged writes on the cache devices until they
/// are cleaned: they must survive a restart, and one alone needs `force`.
fn check_write_back(devices: &[Arc<dyn BlockDevice>], force: bool) -> Result<()> {
    if let Some(d) = devices.iter().find(|d| d.is_volatile()) {
        return Err(Error::invalid(format!(
            "write-back needs cache devices that keep their data across a restart: {} \
             does not (use write-through)",
            d.describe()
        )));
    }
    if devices.len() < 2 && !force {
        return Err(Error::invalid(
            "write-back on one cache device: if it fails, the writes only it holds are lost. \
             Give two devices (they mirror each other), or force it",
        ));
    }
    Ok(())
}
