//! Attaching, switching and detaching a pool's cache tier (`crate::cache_tier`).

use std::sync::atomic::Ordering::Release;
use std::sync::Arc;
use std::time::Duration;

use tessera_device::BlockDevice;
use tessera_io::sync::RwLockExt;

use super::Pool;
use crate::cache_tier::{device_claim, encode_label, CacheInfo, CacheMode, CacheTier, DeviceClaim};
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
    pub fn attach_cache(
        &self,
        devices: Vec<Arc<dyn BlockDevice>>,
        mode: CacheMode,
        unit: u64,
        force: bool,
        reopen: bool,
    ) -> Result<()> {
        crate::cache_tier::check_unit(unit)?;
        let mut slot = self.core.cache.tier.write_locked();
        if slot.is_some() {
            return Err(Error::AlreadyExists(format!(
                "pool '{}' already has a cache: remove it first",
                self.core.name
            )));
        }
        let uuid = self.core.uuid;
        let count = u32::try_from(devices.len()).unwrap_or(u32::MAX);
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
            d.write_at(
                0,
                &encode_label(&uuid, u32::try_from(i).unwrap_or(u32::MAX), count, unit),
            )
            .and_then(|()| d.sync())
            .map_err(|e| Error::io("writing a cache label", e))?;
        }
        let tier = CacheTier::new(devices, mode, unit)?;
        *slot = Some(Arc::new(tier));
        self.core.cache.gen.fetch_add(1, Release);
        Ok(())
    }

    /// Remove the cache tier: requests stop using it at once; its operations in flight
    /// are waited for (the pool's devices have every write, so nothing is lost) and the
    /// devices' cache labels are cleared. Returns the devices it had.
    pub fn detach_cache(&self) -> Result<Vec<Arc<dyn BlockDevice>>> {
        let tier =
            self.core.cache.tier.write_locked().take().ok_or_else(|| {
                Error::NotFound(format!("pool '{}' has no cache", self.core.name))
            })?;
        self.core.cache.gen.fetch_add(1, Release);
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

    pub fn set_cache_mode(&self, mode: CacheMode) -> Result<()> {
        let tier = self
            .core
            .cache_tier()
            .ok_or_else(|| Error::NotFound(format!("pool '{}' has no cache", self.core.name)))?;
        tier.set_mode(mode);
        Ok(())
    }

    pub fn cache_status(&self) -> Option<CacheInfo> {
        self.core.cache_tier().map(|t| t.status())
    }
}
