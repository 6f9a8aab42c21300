//! Device replacement (`pool replace`) and hot spares: a new device is checked, recorded
//! and swapped into a redundant pool's slot live, and rebuilt (docs/architecture.md
//! "Device replacement and hot spares").

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tessera_io::sync::MutexExt;

use tessera_api::{ReplaceReply, ReplaceState, SpareList};
use tessera_device::{format_size, BlockDevice, SwappableDevice};
use tessera_pool::Pool;
use tracing::{error, info, warn};

use super::devices::{canonical_spec, open_devices, slot_need, spec_path};
use super::{Error, Node, Result, SPARE_TICK};

/// How a device comes to replace a pool's failed one.
#[derive(Clone, Copy)]
struct Replacement {
    /// Taken from the pool's own hot spares.
    spare: bool,
    /// The operator said to overwrite another pool's label (`--force`).
    force: bool,
}

/// The devices a replacement or a hot spare goes into: each redundant pool's swappable
/// device slots, and the hot spares the node has opened (which pool lists which is in
/// the pools' registry).
#[derive(Default)]
pub struct Spares {
    slots: Mutex<BTreeMap<String, Vec<Arc<SwappableDevice>>>>,
    /// Opened hot spares, by spec.
    devs: Mutex<BTreeMap<String, Arc<dyn BlockDevice>>>,
}

impl Spares {
    /// Pool `pool`'s device slots (none for a pool that is not redundant).
    pub(super) fn set_slots(&self, pool: &str, slots: Vec<Arc<SwappableDevice>>) {
        if !slots.is_empty() {
            self.slots.locked().insert(pool.to_string(), slots);
        }
    }

    /// Slot `index` of pool `pool`, if it has swappable slots.
    fn slot(&self, pool: &str, index: usize) -> Option<Arc<SwappableDevice>> {
        self.slots
            .locked()
            .get(pool)
            .and_then(|s| s.get(index).cloned())
    }

    /// The opened hot spare `spec`, if it is open.
    fn device(&self, spec: &str) -> Option<Arc<dyn BlockDevice>> {
        self.devs.locked().get(spec).cloned()
    }

    pub(super) fn keep_open(&self, spec: &str, dev: Arc<dyn BlockDevice>) {
        self.devs.locked().insert(spec.to_string(), dev);
    }

    fn close(&self, spec: &str) {
        self.devs.locked().remove(spec);
    }

    /// A destroyed pool: its slots and its hot spares (`spares`, its registry entry's).
    pub(super) fn forget_pool(&self, pool: &str, spares: Vec<String>) {
        self.slots.locked().remove(pool);
        let mut devs = self.devs.locked();
        for s in &spares {
            devs.remove(s);
        }
    }
}

impl Node {
    /// Put device spec `with` in place of failed device `index` of redundant pool `pool`,
    /// live: the new device is checked (size, not volatile, not another pool's), its
    /// label block cleared, its spec written to pools.json with a rebuild cursor at unit
    /// 0, it is swapped into the slot and the rebuild onto it starts at once
    /// (docs/architecture.md "Device replacement and hot spares"). If the slot cannot
    /// take it live (see `replace_live`), the replacement is only recorded and takes
    /// effect at the next node start. `force`: take a device that carries another pool's
    /// label (never one that is in use: that is refused when it is opened).
    pub fn replace_device(
        &self,
        pool: &str,
        index: usize,
        with: &str,
        force: bool,
    ) -> Result<ReplaceReply> {
        let _admin = self.admin();
        let p = self.pools().get(pool)?;
        let dev = open_devices(std::slice::from_ref(&with.to_string()))?.remove(0);
        // Canonical once the device exists (a `path:SIZE` file is created by the open).
        let spec = canonical_spec(with);
        self.replace_live(
            &p,
            index,
            &spec,
            dev,
            Replacement {
                spare: false,
                force,
            },
        )
    }

    /// Is device `d` of `p` one a replacement may take the place of?
    fn check_replaceable(&self, p: &Pool, d: usize) -> Result<()> {
        let l = &p.core.layout;
        let pool = p.name();
        if !l.kind.is_redundant() {
            return Err(Error::invalid(format!(
                "pool '{pool}' is {}: only devices of redundant pools (raid1/raid10/raid5/raid6/ec) can be replaced",
                l.kind.name()
            )));
        }
        if d >= l.devices.len() || !l.is_failed(d) {
            return Err(Error::invalid(format!(
                "device {d} of pool '{pool}' is not failed"
            )));
        }
        if let Some(job) = self.jobs.busy(pool) {
            return Err(Error::busy(format!(
                "a {job} of pool '{pool}' is running: replace the device when it ends"
            )));
        }
        Ok(())
    }

    /// Can `dev` (spec `spec`) join pool `p` in a slot that needs `need` bytes? Not
    /// volatile, large enough, not used by another pool of this node (`how.spare`: the
    /// spare being put to use is), no other pool's label (unless `how.force`).
    fn check_new_device(
        &self,
        p: &Pool,
        spec: &str,
        dev: &dyn BlockDevice,
        need: u64,
        how: Replacement,
    ) -> Result<()> {
        let except_spare = how.spare;
        if dev.is_volatile() {
            return Err(Error::invalid(format!(
                "device {spec} does not keep its contents across a restart (ram/null): it cannot replace a pool device"
            )));
        }
        if dev.size() < need {
            return Err(Error::invalid(format!(
                "device {spec} is smaller than the pool's devices ({} < {})",
                format_size(dev.size()),
                format_size(need)
            )));
        }
        if let Some(path) = spec_path(spec) {
            let entries = self.pools.entries();
            for e in entries.iter() {
                let member = e
                    .devices
                    .iter()
                    .any(|x| spec_path(x).as_ref() == Some(&path));
                let spare = e
                    .spares
                    .iter()
                    .any(|x| spec_path(x).as_ref() == Some(&path));
                if member || (spare && !(except_spare && e.name == p.name())) {
                    return Err(Error::already_exists(format!(
                        "device {spec} is already {} pool '{}'",
                        if member {
                            "a device of"
                        } else {
                            "a hot spare of"
                        },
                        e.name
                    )));
                }
            }
        }
        if how.force {
            return Ok(());
        }
        let mut b = vec![0u8; tessera_pool::format::LABEL_AREA];
        if dev.read_at(0, &mut b).is_ok() {
            if let Ok(Some((lab, _))) = tessera_pool::format::Label::decode_area(&b) {
                let uuid = tessera_pool::uuid_string(&lab.uuid);
                if uuid != p.uuid() {
                    return Err(Error::already_exists(format!(
                        "device {spec} belongs to pool '{}' (uuid {uuid}); destroy that pool first, or pass --force to wipe its label",
                        lab.pool_name
                    )));
                }
            }
        }
        Ok(())
    }

    /// Put `dev` (spec `spec`; `spare`: taken from the pool's hot spares) in place of
    /// failed device `index` of `p` and start the rebuild onto it. The caller holds the
    /// admin lock. Order, so that a crash at any point leaves a pool a restart handles:
    /// clear the new device's label block (it then opens as failed), record the spec in
    /// pools.json (and drop it from the spares), save a rebuild cursor at unit 0, swap
    /// the device into the slot, start the rebuild (which makes it a write-only member).
    /// A slot that cannot take the device live (a pool opened without swappable slots,
    /// or a device with a coarser alignment than the slot's I/O) leaves the replacement
    /// recorded for the next start, as `"state"` says.
    fn replace_live(
        &self,
        p: &Arc<Pool>,
        index: usize,
        spec: &str,
        dev: Arc<dyn BlockDevice>,
        how: Replacement,
    ) -> Result<ReplaceReply> {
        let pool = p.name();
        let spare = how.spare;
        self.check_replaceable(p, index)?;
        let need = slot_need(p, index);
        self.check_new_device(p, spec, &*dev, need, how)?;
        // A cleared label: the pool (re)opens it as failed, and the rebuild writes a full one.
        dev.write_at(0, &[0u8; tessera_pool::format::LABEL_AREA])
            .and_then(|()| dev.sync())
            .map_err(|e| Error::io("clearing the new device's label", e))?;
        let old = self.pools.edit_entry(pool, |e| {
            if spare {
                e.spares.retain(|s| s != spec);
            }
            Ok(std::mem::replace(&mut e.devices[index], spec.to_string()))
        })?;
        if spare {
            self.spares.close(spec);
        }
        crate::rebuild::save_cursor(
            &crate::rebuild::cursor_path(&self.cfg.data_dir, pool),
            index,
            0,
        );
        let slot = self.spares.slot(pool, index);
        // The reason travels to the client as text (`ReplaceState::Recorded`).
        let swapped = match slot {
            Some(slot) => slot.swap(dev).map_err(|e| e.to_string()),
            None => Err("the pool was opened without swappable device slots".to_string()),
        };
        if let Err(why) = swapped {
            warn!(
                pool, device = index, with = spec, reason = %why,
                "device cannot be replaced live; the new device takes its place at the next node start"
            );
            return Ok(ReplaceReply {
                pool: pool.to_string(),
                device: index,
                replaced: old,
                with: spec.to_string(),
                live: false,
                spare: None,
                state: ReplaceState::Recorded { why },
                rebuild: None,
            });
        }
        info!(
            pool, device = index, replaced = %old, with = spec, hot_spare = spare,
            "device {index} ({old}) replaced by {spec}{}; rebuilding onto it",
            if spare { " (hot spare)" } else { "" }
        );
        let mut v = ReplaceReply {
            pool: pool.to_string(),
            device: index,
            replaced: old,
            with: spec.to_string(),
            live: true,
            spare: Some(spare),
            state: ReplaceState::Rebuilding,
            rebuild: None,
        };
        match self.jobs.rebuild(p, index, 0) {
            Ok(r) => v.rebuild = Some(r),
            Err(e) => {
                // The device is in place and recorded; the cursor makes the next start
                // rebuild it, and `pool rebuild` can start it now.
                error!(pool, with = spec, error = %e, "the rebuild onto the new device did not start");
                v.state = ReplaceState::RebuildNotStarted {
                    error: e.to_string(),
                };
            }
        }
        Ok(v)
    }

    pub fn list_spares(&self, pool: &str) -> Result<SpareList> {
        self.pools().get(pool)?;
        Ok(SpareList {
            pool: pool.to_string(),
            spares: self.pools().spares_of(pool),
        })
    }

    /// Add hot spare `spec` to redundant pool `pool`: the device is opened and checked
    /// (not volatile, at least as large as what any of the pool's devices holds, not
    /// another pool's) but not written until it replaces a failed device. `force`: a
    /// device with another pool's label is taken, and that label wiped now.
    pub fn add_spare(&self, pool: &str, spec: &str, force: bool) -> Result<SpareList> {
        let _g = self.admin();
        let p = self.pools().get(pool)?;
        let l = &p.core.layout;
        if !l.kind.is_redundant() {
            return Err(Error::invalid(format!(
                "pool '{pool}' is {}: only redundant pools (raid1/raid10/raid5/raid6/ec) have hot spares",
                l.kind.name()
            )));
        }
        let dev = open_devices(std::slice::from_ref(&spec.to_string()))?.remove(0);
        let canon = canonical_spec(spec);
        if self.pools().spares_of(pool).contains(&canon) {
            return Err(Error::already_exists(format!(
                "{canon} is already a hot spare of pool '{pool}'"
            )));
        }
        let need = (0..l.devices.len())
            .map(|i| slot_need(&p, i))
            .max()
            .unwrap_or(0);
        self.check_new_device(
            &p,
            &canon,
            &*dev,
            need,
            Replacement {
                spare: false,
                force,
            },
        )?;
        if force {
            dev.write_at(0, &[0u8; tessera_pool::format::LABEL_AREA])
                .and_then(|()| dev.sync())
                .map_err(|e| Error::io("wiping the spare's label", e))?;
        }
        self.pools.edit_entry(pool, |e| {
            e.spares.push(canon.clone());
            Ok(())
        })?;
        self.spares.keep_open(&canon, dev);
        self.list_spares(pool)
    }

    /// Remove hot spare `spec` (as added, or its canonical form) from `pool`.
    pub fn remove_spare(&self, pool: &str, spec: &str) -> Result<SpareList> {
        let _g = self.admin();
        self.pools().get(pool)?;
        let canon = canonical_spec(spec);
        let path = spec_path(spec).map(|p| std::fs::canonicalize(&p).unwrap_or(p));
        let same = |s: &String| {
            *s == spec
                || *s == canon
                || (path.is_some()
                    && spec_path(s).map(|p| std::fs::canonicalize(&p).unwrap_or(p)) == path)
        };
        let removed = self.pools.edit_entry(pool, |e| {
            let removed: Vec<String> = e.spares.iter().filter(|s| same(s)).cloned().collect();
            if removed.is_empty() {
                return Err(Error::not_found(format!(
                    "{spec} is not a hot spare of pool '{pool}'"
                )));
            }
            e.spares.retain(|s| !same(s));
            Ok(removed)
        })?;
        for s in removed {
            self.spares.close(&s);
        }
        self.list_spares(pool)
    }

    /// Watch the redundant pools with hot spares every `SPARE_TICK` (its own thread; it
    /// stops when the node is dropped).
    pub(super) fn start_spare_watch(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tessera-spares".into())
            .spawn(move || loop {
                std::thread::sleep(SPARE_TICK);
                let Some(node) = weak.upgrade() else { return };
                node.spare_tick();
            });
        if let Err(e) = spawned {
            error!(error = %e, "cannot start the hot spare thread");
        }
    }

    /// One look at the pools: a failed device (not being rebuilt) of a pool that has a
    /// hot spare, no copy job running and no lost data is replaced by the first usable
    /// spare, live, and rebuilt. A spare that cannot be used (gone, too small, another
    /// pool's label...) is dropped from the list, with the reason on stderr.
    fn spare_tick(&self) {
        let candidates: Vec<String> = self
            .pools
            .entries()
            .iter()
            .filter(|e| !e.spares.is_empty())
            .map(|e| e.name.clone())
            .collect();
        for name in candidates {
            let Ok(p) = self.pools.get(&name) else {
                continue;
            };
            let l = &p.core.layout;
            let failed = |l: &tessera_pool::Layout| (0..l.devices.len()).find(|&i| l.is_failed(i));
            if !l.kind.is_redundant()
                || failed(l).is_none()
                || l.has_lost_data()
                || self.jobs.busy(&name).is_some()
            {
                continue;
            }
            let _g = self.admin();
            // Again under the admin lock: a `pool replace` may have just run.
            let Some(d) = failed(l) else { continue };
            if self.jobs.busy(&name).is_some() {
                continue;
            }
            for spec in self.pools.spares_of(&name) {
                let dev = match self.spares.device(&spec) {
                    Some(d) => Ok(d),
                    None => open_devices(std::slice::from_ref(&spec)).map(|mut d| d.remove(0)),
                };
                let how = Replacement {
                    spare: true,
                    force: false,
                };
                let r = dev.and_then(|dev| self.replace_live(&p, d, &spec, dev, how));
                match r {
                    Ok(_) => break,
                    Err(Error::Busy(_)) => break,
                    Err(e) => {
                        warn!(
                            pool = %name, device = %spec, index = d, error = %e,
                            "hot spare cannot replace the failed device; removed from the spare list"
                        );
                        let _ = self.pools.edit_entry(&name, |e| {
                            e.spares.retain(|s| *s != spec);
                            Ok(())
                        });
                        self.spares.close(&spec);
                    }
                }
            }
        }
    }
}
