//! Pools: the service that owns them ([`Pools`]: the open pools, those the registry lists
//! but could not open, and the registry itself), and the node's operations on them
//! (create, destroy, update, list, and how a pool is shown), which also need the admin
//! lock, the jobs and the device slots.

use super::pool_tuning;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use tessera_io::sync::{MutexExt, RwLockExt};
use tracing::info;

use tessera_api::{LayoutSpec, OfflinePool, PoolEntry, PoolInfo, PoolState, UpdatePool};
use tessera_device::DeviceSpec;
use tessera_pool::{LayoutKind, Pool, PoolOptions, Volume, DEFAULT_UNIT_SIZE};

use super::devices::{canonical_spec, fit_slots, open_devices, spec_path, wrap_slots};
use super::{Error, Node, Result};
use crate::registry::{PoolEntry as RegistryEntry, Registry};

/// The node's pools and their registry (`DATA_DIR/pools.json`), each under its own lock.
/// The registry's entries and the open pools change together only through the node's
/// operations, which hold the admin lock; lookups take no admin lock.
pub struct Pools {
    open: RwLock<BTreeMap<String, Arc<Pool>>>,
    /// Pools listed in the registry (or declared in the config) that could not be
    /// opened, with the reason.
    offline: RwLock<BTreeMap<String, String>>,
    registry: Registry,
    entries: Mutex<Vec<RegistryEntry>>,
}

impl Pools {
    /// No pool open yet; `entries` as the registry holds them.
    pub(super) fn new(registry: Registry, entries: Vec<RegistryEntry>) -> Pools {
        Pools {
            open: RwLock::new(BTreeMap::new()),
            offline: RwLock::new(BTreeMap::new()),
            registry,
            entries: Mutex::new(entries),
        }
    }

    /// The open pools, by name.
    pub fn list(&self) -> Vec<Arc<Pool>> {
        self.open.read_locked().values().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Result<Arc<Pool>> {
        self.open
            .read_locked()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::missing("pool", name))
    }

    /// Volume (or snapshot) `name` and its pool: names are unique across the node.
    pub fn find_volume(&self, name: &str) -> Result<(Arc<Pool>, Arc<Volume>)> {
        for p in self.list() {
            if let Some(v) = p.volume(name) {
                return Ok((p, v));
            }
        }
        Err(Error::missing("volume", name))
    }

    /// Volume `name`, if an open pool has it.
    pub fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        self.find_volume(name).ok().map(|(_, v)| v)
    }

    /// Volume `id` of the pool with UUID `pool_uuid` (how targets and subsystems record
    /// their volumes), if that pool is open and has it.
    pub fn volume_by_id(&self, pool_uuid: &str, id: u32) -> Option<Arc<Volume>> {
        self.list()
            .into_iter()
            .find(|p| p.uuid() == pool_uuid)
            .and_then(|p| p.volume_by_id(id))
    }

    /// Why pool `name` is offline (it is listed but could not be opened), if it is.
    pub fn offline_reason(&self, name: &str) -> Option<String> {
        self.offline.read_locked().get(name).cloned()
    }

    /// The offline pools' names.
    pub fn offline_names(&self) -> Vec<String> {
        self.offline.read_locked().keys().cloned().collect()
    }

    pub(super) fn mark_offline(&self, name: &str, reason: String) {
        self.offline.write_locked().insert(name.to_string(), reason);
    }

    /// Serve `pool`, opened from its registry entry or just created and recorded.
    pub(super) fn insert(&self, pool: Arc<Pool>) {
        self.open
            .write_locked()
            .insert(pool.name().to_string(), pool);
    }

    /// Add `entry` to the registry and save it; the entries stay as they were when the
    /// save fails.
    pub(super) fn record(&self, entry: RegistryEntry) -> Result<()> {
        let mut entries = self.entries.locked();
        entries.push(entry);
        if let Err(e) = self.registry.save(&entries) {
            entries.pop();
            return Err(e.into());
        }
        Ok(())
    }

    /// Drop pool `name` (open or offline) and its registry entry, and save the registry;
    /// the removed entry, for its hot spares.
    pub(super) fn forget(&self, name: &str) -> Result<Option<RegistryEntry>> {
        self.open.write_locked().remove(name);
        self.offline.write_locked().remove(name);
        let mut entries = self.entries.locked();
        let removed = entries.iter().position(|e| e.name == name);
        let removed = removed.map(|i| entries.remove(i));
        self.registry.save(&entries)?;
        Ok(removed)
    }

    /// Change pool `pool`'s registry entry with `f` and save the registry; when `f` or
    /// the save fails, the entries stay as they were.
    pub(super) fn edit_entry<T>(
        &self,
        pool: &str,
        f: impl FnOnce(&mut RegistryEntry) -> Result<T>,
    ) -> Result<T> {
        let mut entries = self.entries.locked();
        let before = entries.clone();
        let e = entries
            .iter_mut()
            .find(|e| e.name == pool)
            .ok_or_else(|| Error::missing("pool", pool))?;
        let r = f(e).and_then(|r| self.registry.save(&entries).map(|()| r).map_err(Into::into));
        if r.is_err() {
            *entries = before;
        }
        r
    }

    /// Pool `name`'s registry entry, if it has one.
    pub(super) fn entry(&self, name: &str) -> Option<RegistryEntry> {
        self.entries().iter().find(|e| e.name == name).cloned()
    }

    /// The registry's entries, to read (their changes go through `record`, `forget` and
    /// `edit_entry`).
    pub(super) fn entries(&self) -> MutexGuard<'_, Vec<RegistryEntry>> {
        self.entries.locked()
    }

    /// The pool (by name) that has the file at `path` as a device or a hot spare.
    pub(super) fn using_file(&self, path: &PathBuf) -> Option<String> {
        self.entries()
            .iter()
            .find(|e| {
                e.devices
                    .iter()
                    .chain(&e.spares)
                    .chain(&e.cache)
                    .any(|x| spec_path(x).as_ref() == Some(path))
            })
            .map(|e| e.name.clone())
    }

    /// The hot spares of `pool` (specs, in the order they are used).
    pub fn spares_of(&self, pool: &str) -> Vec<String> {
        self.entries()
            .iter()
            .find(|e| e.name == pool)
            .map(|e| e.spares.clone())
            .unwrap_or_default()
    }
}

impl Node {
    /// A new pool `name` on `devices`; `stripe` (default 64K) and `unit` (default 1M)
    /// in bytes.
    pub fn create_pool(
        &self,
        name: &str,
        devices: &[String],
        layout: LayoutSpec,
        stripe: Option<u64>,
        unit: Option<u64>,
        force: bool,
    ) -> Result<PoolInfo> {
        let _g = self.admin();
        if self.pools.get(name).is_ok() {
            return Err(Error::already_exists(format!(
                "pool '{name}' already exists"
            )));
        }
        tessera_pool::validate_name("pool", name)?;
        if devices.is_empty() {
            return Err(Error::invalid("a pool needs at least one device"));
        }
        let stripe = stripe.unwrap_or(64 << 10);
        let unit_size = unit.unwrap_or(DEFAULT_UNIT_SIZE);
        let kind = layout_kind(layout, stripe, devices.len())?;
        let mut seen = std::collections::HashSet::new();
        for d in devices {
            if let Ok(DeviceSpec::File { path, .. }) = DeviceSpec::parse(d) {
                // The registry records canonical paths: compare the same spelling (a file
                // reached another way is still refused, by its lock, when it is opened).
                let path = std::fs::canonicalize(&path).unwrap_or(path);
                if !seen.insert(path.clone()) {
                    return Err(Error::invalid(format!(
                        "device {} is listed twice",
                        path.display()
                    )));
                }
                if self.pools.using_file(&path).is_some() {
                    return Err(Error::already_exists(format!(
                        "device {} is already used by a pool of this node",
                        path.display()
                    )));
                }
            }
        }
        let devs = open_devices(devices)?;
        let (devs, slots) = wrap_slots(kind.is_redundant(), devs);
        let pool = Pool::create(
            name,
            devs,
            PoolOptions {
                layout: kind,
                unit_size,
                force,
                tuning: pool_tuning(&self.cfg),
                dedup: false,
            },
        )?;
        fit_slots(&pool, &slots);
        let st = pool.status();
        let entry = RegistryEntry {
            name: name.to_string(),
            uuid: st.uuid.clone(),
            // Record plain paths: a file is created once, with its size, and never again.
            devices: devices.iter().map(|d| canonical_spec(d)).collect(),
            layout: kind.spec().to_string(),
            stripe_size: st.stripe_size,
            unit_size,
            spares: Vec::new(),
            overcommit: None,
            cache: Vec::new(),
            cache_mode: None,
            cache_unit: None,
            cache_admit_hits: None,
            dedup: false,
        };
        self.pools.record(entry)?;
        let v = self.pool_info(&pool);
        self.pools.insert(Arc::new(pool));
        self.spares.set_slots(name, slots);
        Ok(v)
    }

    /// Turn deduplication on for a pool (docs/format.md §17): its volumes created from
    /// now on are deduplicated.
    pub fn enable_pool_dedup(&self, name: &str) -> Result<PoolInfo> {
        let _g = self.admin();
        let p = self.pools.get(name)?;
        p.enable_dedup()?;
        self.pools.edit_entry(name, |e| {
            e.dedup = true;
            Ok(())
        })?;
        info!(pool = %name, "dedup on");
        Ok(self.pool_info(&p))
    }

    pub fn destroy_pool(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        if self.pools.offline_reason(name).is_some() {
            return self.pools.forget(name).map(drop);
        }
        let pool = self.pools.get(name)?;
        // The job holds the pool open and writes to its devices, whose labels are wiped
        // below.
        if let Some(job) = self.jobs.busy(name) {
            return Err(Error::busy(format!(
                "a {job} of pool '{name}' is running: stop it or wait before destroying the pool"
            )));
        }
        let n = pool.volumes().len();
        if n > 0 {
            return Err(Error::busy(format!(
                "pool '{name}' still has {n} volume(s); delete them first"
            )));
        }
        if pool.cache_status().is_some() {
            pool.detach_cache()?;
        }
        pool.shutdown()?;
        // Wipe the labels so the devices can be used again.
        for d in &pool.core.layout.devices {
            let _ = d.write_at(0, &[0u8; tessera_pool::format::LABEL_AREA]);
            let _ = d.sync();
        }
        self.jobs.forget(name);
        let removed = self.pools.forget(name)?;
        self.spares
            .forget_pool(name, removed.map(|e| e.spares).unwrap_or_default());
        Ok(())
    }

    /// Change what can be changed of a pool (`PATCH /v1/pools/NAME`): its overcommit
    /// ratio and whether it deduplicates, live and in the registry.
    pub fn update_pool(&self, name: &str, u: &UpdatePool) -> Result<PoolInfo> {
        let _g = self.admin();
        let p = self.pools.get(name)?;
        if let Some(on) = u.dedup {
            p.set_dedup(on)?;
            self.pools.edit_entry(name, |e| {
                e.dedup = on;
                Ok(())
            })?;
            info!(pool = %name, "dedup {}", if on { "on" } else { "off" });
        }
        if let Some(r) = u.overcommit {
            tessera_pool::validate_overcommit(r)?;
            self.pools.edit_entry(name, |e| {
                e.overcommit = Some(r);
                Ok(())
            })?;
            p.set_overcommit(r)?;
            info!(pool = %name, overcommit = r, "overcommit ratio set");
        }
        Ok(self.pool_info(&p))
    }

    /// A pool's status (`Pool::status`) with the node's view of it: its hot spares.
    pub fn pool_info(&self, p: &Pool) -> PoolInfo {
        PoolInfo {
            spares: self.pools.spares_of(p.name()),
            ..p.status()
        }
    }

    /// A pool with its running or last rebuild and resync, if any.
    pub fn pool_detail(&self, name: &str) -> Result<PoolInfo> {
        let p = self.pools.get(name)?;
        Ok(PoolInfo {
            rebuild: self.jobs.rebuild_status(&p).ok(),
            resync: self.jobs.resync_status(&p).ok(),
            ..self.pool_info(&p)
        })
    }

    /// The open pools, then those of the registry that could not be opened.
    pub fn list_pools(&self) -> Vec<PoolEntry> {
        let mut v: Vec<PoolEntry> = self
            .pools
            .list()
            .iter()
            .map(|p| PoolEntry::Online(Box::new(self.pool_info(p))))
            .collect();
        for (name, reason) in self.pools.offline.read_locked().iter() {
            v.push(PoolEntry::Offline(OfflinePool {
                name: name.clone(),
                state: PoolState::Offline,
                error: reason.clone(),
            }));
        }
        v
    }
}

/// The layout `spec` names, on `ndev` devices.
pub(super) fn layout_kind(spec: LayoutSpec, stripe: u64, ndev: usize) -> Result<LayoutKind> {
    Ok(LayoutKind::from_spec(spec, stripe, ndev)?)
}

/// A layout as the registry and the config write it (see `LayoutSpec`).
pub(super) fn parse_layout(text: &str) -> Result<LayoutSpec> {
    Ok(text.parse::<LayoutSpec>()?)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tessera_api::JobState;
    use tessera_qos::BackgroundLimits;

    use super::super::test_pools::{test_node, UNIT};
    use super::*;

    fn mirror_on_ram(node: &Node, name: &str) -> Arc<Pool> {
        let devs = vec!["ram:16M".to_string(), "ram:16M".to_string()];
        let layout = parse_layout("raid1").unwrap();
        node.create_pool(name, &devs, layout, None, Some(UNIT), false)
            .unwrap();
        node.pools().get(name).unwrap()
    }

    /// A destroyed pool's jobs go with it: a new pool of the same name has none, and a
    /// pool is not destroyed under a running one.
    #[test]
    fn destroying_a_pool_forgets_its_jobs_and_waits_for_a_running_one() {
        let dir = tempfile::tempdir().unwrap();
        let node = test_node(dir.path());
        // The lowest rate there is: the rebuild is still running when destroy is asked.
        node.jobs()
            .background()
            .put("rebuild", Some(BackgroundLimits::new(4096)))
            .unwrap();
        let p = mirror_on_ram(&node, "p");
        node.jobs().start_rebuild(&p, Some(1), true).unwrap();

        match node.destroy_pool("p") {
            Err(Error::Busy(m)) => assert_eq!(
                m,
                "a rebuild of pool 'p' is running: stop it or wait before destroying the pool"
            ),
            other => panic!("expected busy, got {other:?}"),
        }
        assert!(
            node.pools().get("p").is_ok(),
            "the refused destroy left the pool"
        );

        node.jobs().stop_rebuild(&p).unwrap();
        let t0 = Instant::now();
        while node.jobs().busy("p").is_some() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the rebuild did not stop"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            node.jobs().rebuild_status(&p).unwrap().state,
            JobState::Stopped
        );
        drop(p);
        node.destroy_pool("p").unwrap();

        let again = mirror_on_ram(&node, "p");
        assert!(
            matches!(node.jobs().rebuild_status(&again), Err(Error::NotFound(_))),
            "the new pool 'p' shows the destroyed one's rebuild"
        );
        assert!(node.pool_detail("p").unwrap().rebuild.is_none());
        node.shutdown();
    }
}
