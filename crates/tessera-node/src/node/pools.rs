//! Pools: create, destroy, list, and how a pool is shown.

use super::pool_tuning;
use std::sync::Arc;
use tessera_io::sync::{MutexExt, RwLockExt};
use tracing::info;

use tessera_api::{LayoutSpec, OfflinePool, PoolEntry, PoolInfo, PoolState, UpdatePool};
use tessera_device::DeviceSpec;
use tessera_pool::{LayoutKind, Pool, PoolOptions, DEFAULT_UNIT_SIZE};

use super::devices::{canonical_spec, fit_slots, open_devices, spec_path, wrap_slots};
use super::{Error, Node, Result};
use crate::registry::PoolEntry as RegistryEntry;

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
        if self.pool(name).is_ok() {
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
                if self.entries.locked().iter().any(|e| {
                    e.devices
                        .iter()
                        .chain(&e.spares)
                        .any(|x| spec_path(x) == Some(path.clone()))
                }) {
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
        };
        let mut entries = self.entries.locked();
        entries.push(entry);
        if let Err(e) = self.save_registry(&entries) {
            entries.pop();
            return Err(e);
        }
        drop(entries);
        let v = self.pool_info(&pool);
        self.pools
            .write_locked()
            .insert(name.to_string(), Arc::new(pool));
        if !slots.is_empty() {
            self.slots_map().insert(name.to_string(), slots);
        }
        Ok(v)
    }

    pub fn destroy_pool(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        if let Some(_reason) = self.offline.write_locked().remove(name) {
            let mut entries = self.entries.locked();
            entries.retain(|e| e.name != name);
            return self.save_registry(&entries);
        }
        let pool = self.pool(name)?;
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
        pool.shutdown()?;
        // Wipe the labels so the devices can be used again.
        for d in &pool.core.layout.devices {
            let _ = d.write_at(0, &[0u8; 4096]);
            let _ = d.sync();
        }
        self.pools.write_locked().remove(name);
        self.slots_map().remove(name);
        self.jobs.forget(name);
        let mut entries = self.entries.locked();
        if let Some(e) = entries.iter().find(|e| e.name == name) {
            let mut sd = self.spare_devs();
            for s in &e.spares {
                sd.remove(s);
            }
        }
        entries.retain(|e| e.name != name);
        self.save_registry(&entries)
    }

    /// Change what can be changed of a pool (`PATCH /v1/pools/NAME`): its overcommit
    /// ratio, live and in the registry.
    pub fn update_pool(&self, name: &str, u: &UpdatePool) -> Result<PoolInfo> {
        let _g = self.admin();
        let p = self.pool(name)?;
        if let Some(r) = u.overcommit {
            tessera_pool::validate_overcommit(r)?;
            self.edit_entry(name, |e| {
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
            spares: self.spares(p.name()),
            ..p.status()
        }
    }

    /// A pool with its running or last rebuild and resync, if any.
    pub fn pool_detail(&self, name: &str) -> Result<PoolInfo> {
        let p = self.pool(name)?;
        Ok(PoolInfo {
            rebuild: self.jobs.rebuild_status(&p).ok(),
            resync: self.jobs.resync_status(&p).ok(),
            ..self.pool_info(&p)
        })
    }

    /// The open pools, then those of the registry that could not be opened.
    pub fn list_pools(&self) -> Vec<PoolEntry> {
        let mut v: Vec<PoolEntry> = self
            .pools()
            .iter()
            .map(|p| PoolEntry::Online(Box::new(self.pool_info(p))))
            .collect();
        for (name, reason) in self.offline.read_locked().iter() {
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
    LayoutKind::from_spec(spec, stripe, ndev).map_err(Error::invalid)
}

/// A layout as the registry and the config write it (see `LayoutSpec`).
pub(super) fn parse_layout(text: &str) -> Result<LayoutSpec> {
    text.parse().map_err(Error::invalid)
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
        node.pool(name).unwrap()
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
        assert!(node.pool("p").is_ok(), "the refused destroy left the pool");

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
