//! Pools' cache tiers (issue 24): `pool cache add|remove|show|mode`, the cache given at
//! `pool create`, and the tier brought back at start from the registry
//! (docs/format.md §5, §16). The datapath is `tessera_pool::cache_tier`.

use std::sync::Arc;

use tessera_api::{CacheInfo, CacheRequest};
use tessera_device::BlockDevice;
use tessera_pool::cache_tier::{CacheMode, CACHE_UNIT};
use tessera_pool::Pool;
use tracing::{info, warn};

use super::devices::{canonical_spec, open_devices, spec_path};
use super::{Error, Node, Result};
use crate::registry::PoolEntry as RegistryEntry;

impl Node {
    /// `GET /v1/pools/NAME/cache`.
    pub fn pool_cache(&self, name: &str) -> Result<CacheInfo> {
        let p = self.pools().get(name)?;
        let entry = self.pools().entry(name);
        let devices = entry.as_ref().map(|e| e.cache.clone()).unwrap_or_default();
        match p.cache_status() {
            Some(s) => Ok(CacheInfo {
                pool: name.to_string(),
                devices,
                ..s
            }),
            None if !devices.is_empty() => Ok(CacheInfo {
                pool: name.to_string(),
                mode: entry
                    .and_then(|e| e.cache_mode)
                    .unwrap_or_else(|| CacheMode::WriteThrough.name().to_string()),
                state: "missing".to_string(),
                devices,
                ..CacheInfo::default()
            }),
            None => Err(Error::not_found(format!("pool '{name}' has no cache"))),
        }
    }

    /// `POST /v1/pools/NAME/cache`: give pool `name` a cache tier.
    pub fn add_pool_cache(&self, name: &str, req: &CacheRequest) -> Result<CacheInfo> {
        let _g = self.admin();
        let p = self.pools().get(name)?;
        let mode = CacheMode::parse(req.mode.as_deref().unwrap_or("write-through"))?;
        let unit = match &req.unit {
            None => CACHE_UNIT,
            Some(u) => tessera_device::parse_size(&u.as_text())
                .map_err(|e| Error::invalid(format!("cache unit: {e}")))?,
        };
        tessera_pool::cache_tier::check_unit(unit)?;
        let admit_hits = req.admit_hits.unwrap_or(1);
        tessera_pool::cache_tier::check_admit_hits(admit_hits)?;
        let canon = self.check_cache_devices(name, &req.devices)?;
        let devs = open_devices(&req.devices)?;
        p.attach_cache(devs, mode, unit, req.force, false)?;
        let recorded = p
            .set_cache_admit_hits(admit_hits)
            .map_err(Error::from)
            .and_then(|()| {
                self.pools().edit_entry(name, |e| {
                    e.cache = canon.clone();
                    e.cache_mode = Some(mode.name().to_string());
                    e.cache_unit = (unit != CACHE_UNIT).then_some(unit);
                    e.cache_admit_hits = (admit_hits != 1).then_some(admit_hits);
                    Ok(())
                })
            });
        if let Err(e) = recorded {
            let _ = p.detach_cache();
            return Err(e);
        }
        info!(pool = %name, devices = ?canon, mode = mode.name(), "cache tier added");
        self.pool_cache(name)
    }

    /// `DELETE /v1/pools/NAME/cache`: the pool goes on uncached. A write-back tier that
    /// could not be opened (its volumes fail I/O meanwhile) is given up only with
    /// `force`: what it held that the pool's devices did not is lost.
    pub fn remove_pool_cache(&self, name: &str, force: bool) -> Result<CacheInfo> {
        let _g = self.admin();
        let p = self.pools().get(name)?;
        let before = self.pool_cache(name)?;
        if let Some(c) = p.cache_status() {
            if c.mode == CacheMode::WriteBack.name() {
                // Drain first (the registry records the new mode at once, as a mode
                // switch does): the removal waits for the drain a while.
                p.set_cache_mode(CacheMode::WriteThrough, false)?;
                self.pools().edit_entry(name, |e| {
                    e.cache_mode = Some(CacheMode::WriteThrough.name().to_string());
                    Ok(())
                })?;
            }
            p.detach_cache()?;
        } else if p.cache_lost() {
            if !force {
                return Err(Error::busy(format!(
                    "pool '{name}' had a write-back cache that cannot be opened: it may hold \
                     the newest bytes of any volume, which fail I/O until it is back. Bring \
                     its devices back and restart, or remove it with force to accept the loss"
                )));
            }
            warn!(pool = %name, "write-back cache given up: its volumes serve the pool's devices' bytes");
            p.accept_cache_loss();
        }
        self.pools().edit_entry(name, |e| {
            e.cache.clear();
            e.cache_mode = None;
            e.cache_unit = None;
            e.cache_admit_hits = None;
            Ok(())
        })?;
        info!(pool = %name, "cache tier removed");
        Ok(before)
    }

    /// `PATCH /v1/pools/NAME/cache`: switch modes online (out of write-back, the dirty
    /// data drains first; the registry records the new mode at once, and an open drains
    /// whatever the records still say is dirty).
    pub fn set_pool_cache_mode(&self, name: &str, mode: &str, force: bool) -> Result<CacheInfo> {
        let _g = self.admin();
        let p = self.pools().get(name)?;
        let mode = CacheMode::parse(mode)?;
        p.set_cache_mode(mode, force)?;
        self.pools().edit_entry(name, |e| {
            e.cache_mode = Some(mode.name().to_string());
            Ok(())
        })?;
        info!(pool = %name, mode = mode.name(), "cache mode set");
        self.pool_cache(name)
    }

    /// The cache devices' canonical specs, after checking that none is a device or
    /// spare of a pool or another pool's cache, and that none is listed twice.
    fn check_cache_devices(&self, pool: &str, devices: &[String]) -> Result<Vec<String>> {
        if devices.is_empty() || devices.len() > 2 {
            return Err(Error::invalid(format!(
                "a cache has one device or two mirrored ones, not {}",
                devices.len()
            )));
        }
        let canon: Vec<String> = devices.iter().map(|d| canonical_spec(d)).collect();
        let paths: Vec<_> = canon.iter().filter_map(|d| spec_path(d)).collect();
        if paths.len() == 2 && paths[0] == paths[1] {
            return Err(Error::invalid("the two cache devices are the same file"));
        }
        for e in self.pools().entries().iter() {
            for path in &paths {
                let uses = |l: &Vec<String>| l.iter().any(|x| spec_path(x).as_ref() == Some(path));
                let what = if uses(&e.devices) {
                    "a device of"
                } else if uses(&e.spares) {
                    "a hot spare of"
                } else if uses(&e.cache) {
                    "the cache of"
                } else {
                    continue;
                };
                if e.name == pool && what == "the cache of" {
                    return Err(Error::already_exists(format!(
                        "pool '{pool}' already has a cache"
                    )));
                }
                return Err(Error::already_exists(format!(
                    "device {} is already {what} pool '{}'",
                    path.display(),
                    e.name
                )));
            }
        }
        Ok(canon)
    }

    /// At start: bring back the cache tier the registry lists for an opened pool. A
    /// cache that cannot be opened leaves the pool uncached (nothing is lost: the tier
    /// never holds the only copy), with the reason logged and shown as "missing".
    pub(super) fn restore_pool_cache(&self, p: &Pool, e: &RegistryEntry, recreated: bool) {
        if e.cache.is_empty() {
            return;
        }
        let mode = e
            .cache_mode
            .as_deref()
            .map(CacheMode::parse)
            .transpose()
            .unwrap_or_else(|err| {
                warn!(pool = %e.name, error = %err, "bad cache mode in the registry: write-through");
                None
            })
            .unwrap_or(CacheMode::WriteThrough);
        let attached = open_devices(&e.cache).and_then(|devs: Vec<Arc<dyn BlockDevice>>| {
            // A pool recreated on volatile devices has a new UUID: its cache is
            // labelled afresh.
            let unit = e.cache_unit.unwrap_or(CACHE_UNIT);
            p.attach_cache(devs, mode, unit, recreated, !recreated)?;
            p.set_cache_admit_hits(e.cache_admit_hits.unwrap_or(1))
                .map_err(Error::from)
        });
        match attached {
            Ok(()) => info!(pool = %e.name, mode = mode.name(), "cache tier attached"),
            Err(err) if mode == CacheMode::WriteBack => {
                // Any unit may have its newest bytes there: serving the pool's devices'
                // bytes would serve stale data.
                tracing::error!(pool = %e.name, error = %err, "the pool's write-back cache cannot be opened: its volumes fail I/O until it is back (or `pool cache remove --force`)");
                p.mark_cache_lost();
            }
            Err(err) => {
                warn!(pool = %e.name, error = %err, "the pool's cache cannot be opened: it runs uncached")
            }
        }
    }
}
