//! The node's state and every management operation. The API and the CLI are thin layers
//! over these methods. Management runs on control-plane threads, never on a reactor.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;

use serde_json::{json, Value};
use tessera_device::{
    format_size, open_device, parse_size, BlockDevice, DeviceSpec, SwappableDevice,
};
use tessera_io::{spawn_reactors, Mailbox, ReactorConfig};
use tessera_nbd::handshake::{ExportCatalog, ExportInfo};
use tessera_pool::{
    Error, ErrorKind, ExportRecord, LayoutKind, Pool, PoolOptions, Volume, DEFAULT_UNIT_SIZE,
};

use crate::config::NodeConfig;
use crate::registry::{PoolEntry, Registry};

pub type Result<T> = std::result::Result<T, Error>;

pub struct Node {
    pub cfg: NodeConfig,
    pools: RwLock<BTreeMap<String, Arc<Pool>>>,
    /// Pools listed in the registry that could not be opened, with the reason.
    offline: RwLock<BTreeMap<String, String>>,
    registry: Registry,
    entries: Mutex<Vec<PoolEntry>>,
    /// Serialises management operations so that checks and changes do not interleave.
    admin: Mutex<()>,
    pub reactors: Vec<Arc<Mailbox>>,
    next_core: AtomicUsize,
    pub started: Instant,
    pub nbd_addresses: RwLock<Vec<String>>,
    /// NVMe/TCP subsystems and target (crate::nvmf).
    pub nvmf: crate::nvmf::NvmfState,
    /// QoS groups (tenants) and their stepped bursts.
    pub groups: crate::groups::Groups,
    /// Background classes' limits and the scrub jobs, by pool.
    pub background: crate::background::Background,
    scrubs: Mutex<BTreeMap<String, Arc<crate::scrub::ScrubJob>>>,
    rebuilds: Mutex<BTreeMap<String, Arc<crate::rebuild::RebuildJob>>>,
    /// Mirror resyncs after an unclean shutdown (crate::scrub::start_resync), by pool.
    resyncs: Mutex<BTreeMap<String, Arc<crate::scrub::ScrubJob>>>,
    /// The device slots of each redundant pool: a replacement or a hot spare is swapped
    /// into them live (docs/architecture.md "Device replacement and hot spares").
    slots: Mutex<BTreeMap<String, Vec<Arc<SwappableDevice>>>>,
    /// Hot spares the node has opened, by spec (which pool lists which: `entries`).
    spare_devs: Mutex<BTreeMap<String, Arc<dyn BlockDevice>>>,
}

/// How often the node looks for a failed device a hot spare can replace.
pub const SPARE_TICK: std::time::Duration = std::time::Duration::from_millis(500);

/// How this node's pools behave while open (`device_timeout_ms`, `parity_journal_flush`).
fn pool_tuning(cfg: &NodeConfig) -> tessera_pool::PoolTuning {
    tessera_pool::PoolTuning {
        device_timeout: std::time::Duration::from_millis(cfg.device_timeout_ms.max(1)),
        journal_flush: cfg.parity_journal_flush,
    }
}

fn not_found(what: &str, name: &str) -> Error {
    Error::new(ErrorKind::NotFound, format!("{what} '{name}' not found"))
}

fn size_arg(what: &str, v: &str) -> Result<u64> {
    parse_size(v).map_err(|e| Error::invalid(format!("{what}: {e}")))
}

impl Node {
    /// Start the reactors and bring back every pool in the registry.
    pub fn start(cfg: NodeConfig) -> std::result::Result<Arc<Node>, String> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(|e| {
            format!(
                "cannot create data directory {}: {e}",
                cfg.data_dir.display()
            )
        })?;
        let rcfg = ReactorConfig {
            cores: cfg.core_count(),
            busy_poll: cfg.busy_poll,
            pin: cfg.pin_cores,
            poll_window: std::time::Duration::from_micros(cfg.poll_us),
            ..ReactorConfig::default()
        };
        let reactors = spawn_reactors(&rcfg)
            .map_err(|e| format!("cannot start reactors (is io_uring available?): {e}"))?;
        let registry = Registry::new(&cfg.data_dir);
        let entries = registry.load()?;
        let nvmf = crate::nvmf::NvmfState::load(&cfg.data_dir)?;
        let groups = crate::groups::Groups::load(&cfg.data_dir)?;
        let background = crate::background::Background::load(&cfg.data_dir)?;
        let node = Arc::new(Node {
            cfg,
            pools: RwLock::new(BTreeMap::new()),
            offline: RwLock::new(BTreeMap::new()),
            registry,
            entries: Mutex::new(entries.clone()),
            admin: Mutex::new(()),
            reactors: reactors.into_iter().map(|(m, _h)| m).collect(),
            next_core: AtomicUsize::new(0),
            started: Instant::now(),
            nbd_addresses: RwLock::new(Vec::new()),
            nvmf,
            groups,
            background,
            scrubs: Mutex::new(BTreeMap::new()),
            rebuilds: Mutex::new(BTreeMap::new()),
            resyncs: Mutex::new(BTreeMap::new()),
            slots: Mutex::new(BTreeMap::new()),
            spare_devs: Mutex::new(BTreeMap::new()),
        });
        for e in entries {
            for s in &e.spares {
                match open_devices(std::slice::from_ref(s)) {
                    Ok(mut d) => {
                        node.spare_devs().insert(s.clone(), d.remove(0));
                    }
                    Err(err) => eprintln!(
                        "tessera: pool '{}': hot spare {s} cannot be opened (it is tried again when needed): {err}",
                        e.name
                    ),
                }
            }
            match node.restore_pool(&e) {
                Ok((p, slots)) => {
                    node.pools
                        .write()
                        .unwrap_or_else(|x| x.into_inner())
                        .insert(e.name.clone(), Arc::new(p));
                    if !slots.is_empty() {
                        node.slots_map().insert(e.name.clone(), slots);
                    }
                }
                Err(err) => {
                    eprintln!("tessera: pool '{}' is offline: {err}", e.name);
                    node.offline
                        .write()
                        .unwrap_or_else(|x| x.into_inner())
                        .insert(e.name.clone(), err.to_string());
                }
            }
        }
        // A rebuild the node was running when it stopped resumes from its cursor, before
        // any client can write (the device missed nothing below the cursor).
        for p in node.pools() {
            if let Some((d, next)) = crate::rebuild::load_cursor(&node.cfg.data_dir, p.name()) {
                if let Err(e) = node.run_rebuild(&p, d, next) {
                    eprintln!(
                        "tessera: pool '{}': cannot resume the rebuild of device {d}: {e}",
                        p.name()
                    );
                }
            }
        }
        // A mirrored pool whose previous run did not end with a clean shutdown may have
        // copies that differ where a write was cut between them: resync it in the
        // background (after a resumed rebuild). Parity pools recover from their journal.
        for p in node.pools() {
            if !p.opened_clean() && p.core.layout.kind.is_mirror() {
                eprintln!(
                    "tessera: pool '{}' was not shut down cleanly: resyncing its mirror copies",
                    p.name()
                );
                match node.background.limits("resync").and_then(|l| {
                    crate::scrub::start_resync(p.clone(), l)
                        .map_err(|e| Error::io("starting the resync thread", e))
                }) {
                    Ok(job) => {
                        node.resyncs().insert(p.name().to_string(), job);
                    }
                    Err(e) => eprintln!("tessera: pool '{}': cannot resync: {e}", p.name()),
                }
            }
        }
        node.apply_declarations()?;
        node.groups.bind_all(|n| node.volume_by_name(n));
        node.start_ladder();
        node.start_spare_watch();
        Ok(node)
    }

    fn restore_pool(&self, e: &PoolEntry) -> Result<(Pool, Vec<Arc<SwappableDevice>>)> {
        let redundant = e.layout.starts_with("raid1")
            || layout_kind(&e.layout, e.stripe_size, e.devices.len())
                .is_ok_and(|k| k.is_redundant());
        let devs = if redundant {
            // A redundant pool comes up without a device that cannot be opened (it is
            // failed; a hot spare or `pool replace` can take its place).
            let devs: Vec<Arc<dyn BlockDevice>> = e
                .devices
                .iter()
                .map(|s| match open_devices(std::slice::from_ref(s)) {
                    Ok(mut d) => d.remove(0),
                    Err(err) => {
                        eprintln!("tessera: pool '{}': {err}", e.name);
                        Arc::new(MissingDevice(s.clone())) as Arc<dyn BlockDevice>
                    }
                })
                .collect();
            devs
        } else {
            open_devices(&e.devices)?
        };
        let volatile = devs.iter().any(|d| d.is_volatile());
        let (devs, slots) = wrap_slots(redundant, devs);
        if volatile {
            // RAM/null contents did not survive the restart: recreate the pool empty.
            eprintln!(
                "tessera: pool '{}' is on volatile devices; recreated empty",
                e.name
            );
            let layout = layout_kind(&e.layout, e.stripe_size, devs.len())?;
            let p = Pool::create(
                &e.name,
                devs,
                PoolOptions {
                    layout,
                    unit_size: e.unit_size,
                    force: true,
                    tuning: pool_tuning(&self.cfg),
                },
            )?;
            fit_slots(&p, &slots);
            return Ok((p, slots));
        }
        let p = Pool::open_with(devs, pool_tuning(&self.cfg))?;
        fit_slots(&p, &slots);
        Ok((p, slots))
    }

    /// Create what the config declares and does not exist yet.
    fn apply_declarations(&self) -> std::result::Result<(), String> {
        let cfg = self.cfg.clone();
        for p in &cfg.pools {
            if self.pool(&p.name).is_err()
                && !self
                    .offline
                    .read()
                    .unwrap_or_else(|x| x.into_inner())
                    .contains_key(&p.name)
            {
                self.create_pool(
                    &p.name,
                    &p.devices,
                    &p.layout,
                    p.stripe_size.as_deref(),
                    p.unit_size.as_deref(),
                    false,
                )
                .map_err(|e| format!("creating pool '{}' from the config: {e}", p.name))?;
            }
        }
        for v in &cfg.volumes {
            if self.find_volume(&v.name).is_err() {
                let size = size_arg("volume size", &v.size).map_err(|e| e.to_string())?;
                self.create_volume(&v.name, &v.pool, size)
                    .map_err(|e| format!("creating volume '{}' from the config: {e}", v.name))?;
            }
        }
        for x in &cfg.exports {
            if self.find_export(&x.name).is_none() {
                self.add_export(&x.name, &x.volume, x.read_only)
                    .map_err(|e| format!("creating export '{}' from the config: {e}", x.name))?;
            }
        }
        Ok(())
    }

    fn admin(&self) -> MutexGuard<'_, ()> {
        self.admin.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn pools(&self) -> Vec<Arc<Pool>> {
        self.pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn pool(&self, name: &str) -> Result<Arc<Pool>> {
        self.pools
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| not_found("pool", name))
    }

    pub fn find_volume(&self, name: &str) -> Result<(Arc<Pool>, Arc<Volume>)> {
        for p in self.pools() {
            if let Some(v) = p.volume(name) {
                return Ok((p, v));
            }
        }
        Err(not_found("volume", name))
    }

    pub fn find_export(&self, name: &str) -> Option<(Arc<Pool>, ExportRecord)> {
        self.pools().into_iter().find_map(|p| {
            p.exports()
                .into_iter()
                .find(|e| e.name == name)
                .map(|e| (p.clone(), e))
        })
    }

    /// The volume behind an export, for a connection that negotiated it.
    pub fn resolve_export(&self, name: &str) -> Option<(Arc<Volume>, bool)> {
        let (p, e) = self.find_export(name)?;
        Some((p.volume_by_id(e.volume_id)?, e.read_only))
    }

    /// The next reactor core for a new connection (round robin).
    pub fn next_reactor(&self) -> Arc<Mailbox> {
        let i = self.next_core.fetch_add(1, Relaxed) % self.reactors.len();
        self.reactors[i].clone()
    }

    fn save_registry(&self, entries: &[PoolEntry]) -> Result<()> {
        self.registry
            .save(entries)
            .map_err(|e| Error::new(ErrorKind::Io, e))
    }

    /// Change pool `pool`'s registry entry with `f` and save the registry; when `f` or the
    /// save fails, the entries stay as they were.
    fn edit_entry<T>(&self, pool: &str, f: impl FnOnce(&mut PoolEntry) -> Result<T>) -> Result<T> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let before = entries.clone();
        let e = entries
            .iter_mut()
            .find(|e| e.name == pool)
            .ok_or_else(|| not_found("pool", pool))?;
        let r = f(e).and_then(|r| self.save_registry(&entries).map(|()| r));
        if r.is_err() {
            *entries = before;
        }
        r
    }

    pub fn create_pool(
        &self,
        name: &str,
        devices: &[String],
        layout: &str,
        stripe: Option<&str>,
        unit: Option<&str>,
        force: bool,
    ) -> Result<Value> {
        let _g = self.admin();
        if self.pool(name).is_ok() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("pool '{name}' already exists"),
            ));
        }
        tessera_pool::validate_name("pool", name)?;
        if devices.is_empty() {
            return Err(Error::invalid("a pool needs at least one device"));
        }
        let stripe = match stripe {
            Some(s) => size_arg("stripe size", s)?,
            None => 64 << 10,
        };
        let unit_size = match unit {
            Some(u) => size_arg("unit size", u)?,
            None => DEFAULT_UNIT_SIZE,
        };
        let kind = layout_kind(layout, stripe, devices.len())?;
        let mut seen = std::collections::HashSet::new();
        for d in devices {
            if let Ok(DeviceSpec::File { path, .. }) = DeviceSpec::parse(d) {
                if !seen.insert(path.clone()) {
                    return Err(Error::invalid(format!(
                        "device {} is listed twice",
                        path.display()
                    )));
                }
                if self
                    .entries
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .any(|e| {
                        e.devices
                            .iter()
                            .chain(&e.spares)
                            .any(|x| spec_path(x) == Some(path.clone()))
                    })
                {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!(
                            "device {} is already used by a pool of this node",
                            path.display()
                        ),
                    ));
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
        let entry = PoolEntry {
            name: name.to_string(),
            uuid: st.uuid.clone(),
            // Record plain paths: a file is created once, with its size, and never again.
            devices: devices.iter().map(|d| canonical_spec(d)).collect(),
            layout: layout_spec(&kind),
            stripe_size: st.stripe_size,
            unit_size,
            spares: Vec::new(),
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.push(entry);
        if let Err(e) = self.save_registry(&entries) {
            entries.pop();
            return Err(e);
        }
        drop(entries);
        let v = self.pool_value(&pool);
        self.pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), Arc::new(pool));
        if !slots.is_empty() {
            self.slots_map().insert(name.to_string(), slots);
        }
        Ok(v)
    }

    pub fn destroy_pool(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        if let Some(_reason) = self
            .offline
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
        {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            entries.retain(|e| e.name != name);
            return self.save_registry(&entries);
        }
        let pool = self.pool(name)?;
        let n = pool.volumes().len();
        if n > 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("pool '{name}' still has {n} volume(s); delete them first"),
            ));
        }
        pool.shutdown()?;
        // Wipe the labels so the devices can be used again.
        for d in &pool.core.layout.devices {
            let _ = d.write_at(0, &[0u8; 4096]);
            let _ = d.sync();
        }
        self.pools
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        self.slots_map().remove(name);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = entries.iter().find(|e| e.name == name) {
            let mut sd = self.spare_devs();
            for s in &e.spares {
                sd.remove(s);
            }
        }
        entries.retain(|e| e.name != name);
        self.save_registry(&entries)
    }

    pub fn create_volume(&self, name: &str, pool: &str, size: u64) -> Result<Value> {
        let _g = self.admin();
        if self.find_volume(name).is_ok() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("volume '{name}' already exists"),
            ));
        }
        let p = self.pool(pool)?;
        let v = p.create_volume(name, size)?;
        Ok(self.volume_json(&p, &v))
    }

    pub fn resize_volume(&self, name: &str, size: u64) -> Result<Value> {
        let _g = self.admin();
        let (p, v) = self.find_volume(name)?;
        p.resize_volume(&v, size)?;
        Ok(self.volume_json(&p, &v))
    }

    fn volume_by_name(&self, name: &str) -> Option<Arc<Volume>> {
        self.find_volume(name).ok().map(|(_, v)| v)
    }

    /// The stepped-burst control loop of the QoS groups, on its own thread; it stops
    /// when the node is dropped.
    fn start_ladder(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tessera-qos-ladder".into())
            .spawn(move || {
                let mut last = Instant::now();
                loop {
                    std::thread::sleep(crate::groups::LADDER_TICK);
                    let Some(node) = weak.upgrade() else { return };
                    let now = Instant::now();
                    node.groups
                        .ladder_tick(now - last, &|n| node.volume_by_name(n));
                    last = now;
                }
            });
        if let Err(e) = spawned {
            eprintln!("tessera: cannot start the QoS ladder thread: {e}");
        }
    }

    fn scrubs(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::scrub::ScrubJob>>> {
        self.scrubs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn resyncs(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::scrub::ScrubJob>>> {
        self.resyncs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The running or last resync of `pool` (started at node start after an unclean
    /// shutdown of a mirrored pool).
    pub fn resync_status(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        self.resyncs().get(pool).map(|j| j.status()).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("pool '{pool}' has not been resynced since the node started"),
            )
        })
    }

    /// Scrub, resync and rebuild of one pool exclude each other (they share the
    /// layout's copy protocol). Checked with one job map locked at a time.
    fn busy_with_copy_job(&self, pool: &str, except: &str) -> Option<&'static str> {
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
    pub fn start_scrub(&self, pool: &str, repair: bool) -> Result<Value> {
        let p = self.pool(pool)?;
        if let Some(job) = self.busy_with_copy_job(pool, "scrub") {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("a {job} of pool '{pool}' is running: scrub it after"),
            ));
        }
        let mut scrubs = self.scrubs();
        if scrubs.get(pool).is_some_and(|j| j.is_running()) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("a scrub of pool '{pool}' is already running"),
            ));
        }
        let limits = self.background.limits("scrub")?;
        let job = crate::scrub::start(p, limits, repair)
            .map_err(|e| Error::io("starting the scrub thread", e))?;
        let v = job.status();
        scrubs.insert(pool.to_string(), job);
        Ok(v)
    }

    pub fn stop_scrub(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        let scrubs = self.scrubs();
        match scrubs.get(pool) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::new(
                ErrorKind::NotFound,
                format!("no scrub of pool '{pool}' is running"),
            )),
        }
    }

    fn rebuilds(&self) -> MutexGuard<'_, BTreeMap<String, Arc<crate::rebuild::RebuildJob>>> {
        self.rebuilds.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn run_rebuild(&self, p: &Arc<Pool>, device: usize, from: u64) -> Result<Value> {
        if let Some(job) = self.busy_with_copy_job(p.name(), "rebuild") {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("a {job} of pool '{}' is running: stop it or wait", p.name()),
            ));
        }
        let mut jobs = self.rebuilds();
        if jobs.get(p.name()).is_some_and(|j| j.is_running()) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("a rebuild of pool '{}' is already running", p.name()),
            ));
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
    pub fn start_rebuild(&self, pool: &str, device: Option<usize>, force: bool) -> Result<Value> {
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

    /// Put device spec `with` in place of failed device `index` of redundant pool `pool`,
    /// live: the new device is checked (size, not volatile, not another pool's), its
    /// label block cleared, its spec written to pools.json with a rebuild cursor at unit
    /// 0, it is swapped into the slot and the rebuild onto it starts at once
    /// (docs/architecture.md "Device replacement and hot spares"). If the slot cannot
    /// take it live (see `replace_live`), the replacement is only recorded and takes
    /// effect at the next node start.
    pub fn replace_device(&self, pool: &str, index: usize, with: &str) -> Result<Value> {
        let _admin = self.admin();
        let p = self.pool(pool)?;
        let dev = open_devices(std::slice::from_ref(&with.to_string()))?.remove(0);
        // Canonical once the device exists (a `path:SIZE` file is created by the open).
        let spec = canonical_spec(with);
        self.replace_live(&p, index, &spec, dev, false)
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
        if let Some(job) = self.busy_with_copy_job(pool, "") {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("a {job} of pool '{pool}' is running: replace the device when it ends"),
            ));
        }
        Ok(())
    }

    /// Can `dev` (spec `spec`) join pool `p` in a slot that needs `need` bytes? Not
    /// volatile, large enough, not used by another pool of this node (`except_spare`:
    /// the spare being put to use), no other pool's label.
    fn check_new_device(
        &self,
        p: &Pool,
        spec: &str,
        dev: &dyn BlockDevice,
        need: u64,
        except_spare: bool,
    ) -> Result<()> {
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
            let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
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
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!(
                            "device {spec} is already {} pool '{}'",
                            if member {
                                "a device of"
                            } else {
                                "a hot spare of"
                            },
                            e.name
                        ),
                    ));
                }
            }
        }
        let mut b = vec![0u8; 4096];
        if dev.read_at(0, &mut b).is_ok() {
            if let Ok(Some(lab)) = tessera_pool::format::Label::decode(&b) {
                if tessera_pool::uuid_string(&lab.uuid) != p.status().uuid {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!(
                            "device {spec} belongs to pool '{}'; destroy that pool first",
                            lab.pool_name
                        ),
                    ));
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
        spare: bool,
    ) -> Result<Value> {
        let pool = p.name();
        self.check_replaceable(p, index)?;
        let need = slot_need(p, index);
        self.check_new_device(p, spec, &*dev, need, spare)?;
        // A cleared label: the pool (re)opens it as failed, and the rebuild writes a full one.
        dev.write_at(0, &[0u8; 4096])
            .and_then(|()| dev.sync())
            .map_err(|e| Error::io("clearing the new device's label", e))?;
        let old = self.edit_entry(pool, |e| {
            if spare {
                e.spares.retain(|s| s != spec);
            }
            Ok(std::mem::replace(&mut e.devices[index], spec.to_string()))
        })?;
        if spare {
            self.spare_devs().remove(spec);
        }
        crate::rebuild::save_cursor(
            &crate::rebuild::cursor_path(&self.cfg.data_dir, pool),
            index,
            0,
        );
        let slot = self
            .slots_map()
            .get(pool)
            .and_then(|s| s.get(index).cloned());
        let swapped = match slot {
            Some(slot) => slot.swap(dev),
            None => Err("the pool was opened without swappable device slots".to_string()),
        };
        if let Err(why) = swapped {
            eprintln!(
                "tessera: pool '{pool}': device {index} cannot be replaced live ({why}); {spec} takes its place at the next node start"
            );
            return Ok(json!({
                "pool": pool, "device": index, "replaced": old, "with": spec, "live": false,
                "state": format!("recorded ({why}): restart the node; the rebuild onto the new device then starts by itself"),
            }));
        }
        eprintln!(
            "tessera: pool '{pool}': device {index} ({old}) replaced by {spec}{}; rebuilding onto it",
            if spare { " (hot spare)" } else { "" }
        );
        let mut v = json!({
            "pool": pool, "device": index, "replaced": old, "with": spec, "live": true,
            "spare": spare, "state": "rebuilding",
        });
        match self.run_rebuild(p, index, 0) {
            Ok(r) => v["rebuild"] = r,
            Err(e) => {
                // The device is in place and recorded; the cursor makes the next start
                // rebuild it, and `pool rebuild` can start it now.
                eprintln!("tessera: pool '{pool}': the rebuild onto {spec} did not start: {e}");
                v["state"] = json!(format!("replaced; the rebuild did not start: {e}"));
            }
        }
        Ok(v)
    }

    fn slots_map(&self) -> MutexGuard<'_, BTreeMap<String, Vec<Arc<SwappableDevice>>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spare_devs(&self) -> MutexGuard<'_, BTreeMap<String, Arc<dyn BlockDevice>>> {
        self.spare_devs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The hot spares of `pool` (specs, in the order they are used).
    pub fn spares(&self, pool: &str) -> Vec<String> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|e| e.name == pool)
            .map(|e| e.spares.clone())
            .unwrap_or_default()
    }

    pub fn list_spares(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        Ok(json!({"pool": pool, "spares": self.spares(pool)}))
    }

    /// Add hot spare `spec` to redundant pool `pool`: the device is opened and checked
    /// (not volatile, at least as large as what any of the pool's devices holds, not
    /// another pool's) but not written until it replaces a failed device.
    pub fn add_spare(&self, pool: &str, spec: &str) -> Result<Value> {
        let _g = self.admin();
        let p = self.pool(pool)?;
        let l = &p.core.layout;
        if !l.kind.is_redundant() {
            return Err(Error::invalid(format!(
                "pool '{pool}' is {}: only redundant pools (raid1/raid10/raid5/raid6/ec) have hot spares",
                l.kind.name()
            )));
        }
        let dev = open_devices(std::slice::from_ref(&spec.to_string()))?.remove(0);
        let canon = canonical_spec(spec);
        if self.spares(pool).contains(&canon) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("{canon} is already a hot spare of pool '{pool}'"),
            ));
        }
        let need = (0..l.devices.len())
            .map(|i| slot_need(&p, i))
            .max()
            .unwrap_or(0);
        self.check_new_device(&p, &canon, &*dev, need, false)?;
        self.edit_entry(pool, |e| {
            e.spares.push(canon.clone());
            Ok(())
        })?;
        self.spare_devs().insert(canon, dev);
        self.list_spares(pool)
    }

    /// Remove hot spare `spec` (as added, or its canonical form) from `pool`.
    pub fn remove_spare(&self, pool: &str, spec: &str) -> Result<Value> {
        let _g = self.admin();
        self.pool(pool)?;
        let canon = canonical_spec(spec);
        let path = spec_path(spec).map(|p| std::fs::canonicalize(&p).unwrap_or(p));
        let same = |s: &String| {
            *s == spec
                || *s == canon
                || (path.is_some()
                    && spec_path(s).map(|p| std::fs::canonicalize(&p).unwrap_or(p)) == path)
        };
        let removed = self.edit_entry(pool, |e| {
            let removed: Vec<String> = e.spares.iter().filter(|s| same(s)).cloned().collect();
            if removed.is_empty() {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!("{spec} is not a hot spare of pool '{pool}'"),
                ));
            }
            e.spares.retain(|s| !same(s));
            Ok(removed)
        })?;
        let mut sd = self.spare_devs();
        for s in removed {
            sd.remove(&s);
        }
        drop(sd);
        self.list_spares(pool)
    }

    /// Watch the redundant pools with hot spares every `SPARE_TICK` (its own thread; it
    /// stops when the node is dropped).
    fn start_spare_watch(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tessera-spares".into())
            .spawn(move || loop {
                std::thread::sleep(SPARE_TICK);
                let Some(node) = weak.upgrade() else { return };
                node.spare_tick();
            });
        if let Err(e) = spawned {
            eprintln!("tessera: cannot start the hot spare thread: {e}");
        }
    }

    /// One look at the pools: a failed device (not being rebuilt) of a pool that has a
    /// hot spare, no copy job running and no lost data is replaced by the first usable
    /// spare, live, and rebuilt. A spare that cannot be used (gone, too small, another
    /// pool's label...) is dropped from the list, with the reason on stderr.
    fn spare_tick(&self) {
        let candidates: Vec<String> = self
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|e| !e.spares.is_empty())
            .map(|e| e.name.clone())
            .collect();
        for name in candidates {
            let Ok(p) = self.pool(&name) else { continue };
            let l = &p.core.layout;
            let failed = |l: &tessera_pool::Layout| (0..l.devices.len()).find(|&i| l.is_failed(i));
            if !l.kind.is_redundant()
                || failed(l).is_none()
                || l.has_lost_data()
                || self.busy_with_copy_job(&name, "").is_some()
            {
                continue;
            }
            let _g = self.admin();
            // Again under the admin lock: a `pool replace` may have just run.
            let Some(d) = failed(l) else { continue };
            if self.busy_with_copy_job(&name, "").is_some() {
                continue;
            }
            for spec in self.spares(&name) {
                let dev = match self.spare_devs().get(&spec).cloned() {
                    Some(d) => Ok(d),
                    None => open_devices(std::slice::from_ref(&spec)).map(|mut d| d.remove(0)),
                };
                let r = dev.and_then(|dev| self.replace_live(&p, d, &spec, dev, true));
                match r {
                    Ok(_) => break,
                    Err(e) if e.kind == ErrorKind::Busy => break,
                    Err(e) => {
                        eprintln!(
                            "tessera: pool '{name}': hot spare {spec} cannot replace device {d}: {e}; removed from the spare list"
                        );
                        let _ = self.edit_entry(&name, |e| {
                            e.spares.retain(|s| *s != spec);
                            Ok(())
                        });
                        self.spare_devs().remove(&spec);
                    }
                }
            }
        }
    }

    /// A pool's JSON (`pool_json`) with the node's view of it: its hot spares.
    pub fn pool_value(&self, p: &Pool) -> Value {
        let mut v = pool_json(p);
        v["spares"] = json!(self.spares(p.name()));
        v
    }

    pub fn stop_rebuild(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        match self.rebuilds().get(pool) {
            Some(j) if j.is_running() => {
                j.stop();
                Ok(j.status())
            }
            _ => Err(Error::new(
                ErrorKind::NotFound,
                format!("no rebuild of pool '{pool}' is running"),
            )),
        }
    }

    /// The running or last rebuild of `pool`.
    pub fn rebuild_status(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        self.rebuilds()
            .get(pool)
            .map(|j| j.status())
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::NotFound,
                    format!("pool '{pool}' has not been rebuilt since the node started"),
                )
            })
    }

    /// The running or last scrub of `pool`.
    pub fn scrub_status(&self, pool: &str) -> Result<Value> {
        self.pool(pool)?;
        self.scrubs().get(pool).map(|j| j.status()).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("pool '{pool}' has not been scrubbed since the node started"),
            )
        })
    }

    pub fn put_group(
        &self,
        name: &str,
        limits: tessera_qos::QosLimits,
        step: Option<tessera_qos::StepBurst>,
    ) -> Result<Value> {
        let _g = self.admin();
        self.groups.put(name, limits, step)
    }

    pub fn delete_group(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        self.groups.delete(name, |n| self.volume_by_name(n))
    }

    pub fn add_group_member(&self, name: &str, volume: &str) -> Result<Value> {
        let _g = self.admin();
        let (_, v) = self.find_volume(volume)?;
        self.groups.add_member(name, &v)
    }

    pub fn remove_group_member(&self, name: &str, volume: &str) -> Result<Value> {
        let _g = self.admin();
        self.groups
            .remove_member(name, volume, self.volume_by_name(volume))
    }

    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        let (p, v) = self.find_volume(name)?;
        if let Some(nqn) = self.nvmf.subsystem_using(&p.status().uuid, v.id) {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "volume '{name}' is a namespace of NVMe subsystem '{nqn}'; remove it first"
                ),
            ));
        }
        p.delete_volume(&v)?;
        self.groups.forget_volume(name);
        Ok(())
    }

    pub fn add_export(&self, name: &str, volume: &str, read_only: bool) -> Result<Value> {
        let _g = self.admin();
        if self.find_export(name).is_some() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("export '{name}' already exists"),
            ));
        }
        let (p, v) = self.find_volume(volume)?;
        p.add_export(ExportRecord {
            name: name.to_string(),
            volume_id: v.id,
            read_only,
        })?;
        Ok(self.export_json(
            &p,
            &ExportRecord {
                name: name.to_string(),
                volume_id: v.id,
                read_only,
            },
        ))
    }

    pub fn remove_export(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        let (p, _) = self
            .find_export(name)
            .ok_or_else(|| not_found("export", name))?;
        p.remove_export(name)
    }

    pub fn volume_json(&self, p: &Pool, v: &Volume) -> Value {
        let exports: Vec<String> = p
            .exports()
            .into_iter()
            .filter(|e| e.volume_id == v.id)
            .map(|e| e.name)
            .collect();
        json!({
            "name": v.name, "pool": p.name(), "id": v.id, "size": v.size(), "allocated": v.allocated_bytes(),
            "exports": exports, "connections": v.open_handles(), "created": v.created,
            "qos": serde_json::to_value(v.qos.limits()).unwrap_or(Value::Null),
            "group": self.groups.group_of(&v.name),
        })
    }

    /// Replace a volume's QoS limits (empty limits clear them). Live and persistent.
    pub fn set_volume_qos(&self, name: &str, limits: tessera_qos::QosLimits) -> Result<Value> {
        let _g = self.admin();
        let (p, v) = self.find_volume(name)?;
        p.set_volume_qos(&v, limits)?;
        Ok(serde_json::to_value(v.qos.limits()).unwrap_or(Value::Null))
    }

    /// Client I/O of a volume over a window of `interval`: rates, latency percentiles,
    /// and the cumulative totals since the node started. Blocks for `interval`.
    pub fn volume_stats(&self, name: &str, interval: std::time::Duration) -> Result<Value> {
        let (_, v) = self.find_volume(name)?;
        let a = v.stats();
        std::thread::sleep(interval);
        let b = v.stats();
        let secs = interval.as_secs_f64().max(1e-3);
        let rate = |x: u64, y: u64| (y.saturating_sub(x)) as f64 / secs;
        let mib = |x: u64, y: u64| rate(x, y) / 1048576.0;
        let w = b.latency.since(&a.latency);
        let us = |ns: u64| ns as f64 / 1000.0;
        Ok(json!({
            "volume": name,
            "interval_ms": interval.as_millis() as u64,
            "read_iops": rate(a.reads, b.reads),
            "write_iops": rate(a.writes, b.writes),
            "other_iops": rate(a.others, b.others),
            "read_mibps": mib(a.read_bytes, b.read_bytes),
            "write_mibps": mib(a.write_bytes, b.write_bytes),
            "errors": b.errors.saturating_sub(a.errors),
            "throttled_ms": b.throttled_ns.saturating_sub(a.throttled_ns) as f64 / 1e6,
            "latency_us": {
                "requests": w.count(),
                "mean": w.mean() / 1000.0,
                "p50": us(w.quantile(0.5)),
                "p99": us(w.quantile(0.99)),
                "p999": us(w.quantile(0.999)),
            },
            "totals": {
                "reads": b.reads, "writes": b.writes, "others": b.others,
                "read_bytes": b.read_bytes, "write_bytes": b.write_bytes, "errors": b.errors,
                "throttled_ms": b.throttled_ns as f64 / 1e6,
            },
        }))
    }

    pub fn export_json(&self, p: &Pool, e: &ExportRecord) -> Value {
        let vol = p.volume_by_id(e.volume_id);
        let addrs = self
            .nbd_addresses
            .read()
            .unwrap_or_else(|x| x.into_inner())
            .clone();
        json!({
            "name": e.name, "volume": vol.as_ref().map(|v| v.name.clone()), "read_only": e.read_only,
            "size": vol.as_ref().map(|v| v.size()), "connections": vol.as_ref().map(|v| v.open_handles()),
            "uris": addrs.iter().map(|a| format!("{a}/{}", e.name)).collect::<Vec<_>>(),
        })
    }

    pub fn list_pools(&self) -> Value {
        let mut v: Vec<Value> = self.pools().iter().map(|p| self.pool_value(p)).collect();
        for (name, reason) in self
            .offline
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            v.push(json!({"name": name, "state": "offline", "error": reason}));
        }
        Value::Array(v)
    }

    pub fn list_volumes(&self) -> Value {
        let mut out = Vec::new();
        for p in self.pools() {
            for v in p.volumes() {
                out.push(self.volume_json(&p, &v));
            }
        }
        Value::Array(out)
    }

    pub fn list_exports(&self) -> Value {
        let mut out = Vec::new();
        for p in self.pools() {
            for e in p.exports() {
                out.push(self.export_json(&p, &e));
            }
        }
        Value::Array(out)
    }

    pub fn status(&self) -> Value {
        let pools = self.pools();
        let (mut cap, mut alloc, mut vols) = (0u64, 0u64, 0usize);
        for p in &pools {
            let s = p.status();
            cap += s.capacity;
            alloc += s.allocated;
            vols += s.volumes;
        }
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": self.started.elapsed().as_secs(),
            "cores": self.reactors.len(),
            "data_dir": self.cfg.data_dir,
            "api_socket": self.cfg.api_socket(),
            "nbd": *self.nbd_addresses.read().unwrap_or_else(|e| e.into_inner()),
            "capacity": cap, "allocated": alloc, "free": cap - alloc,
            "pools": self.list_pools(), "volumes": vols,
            "exports": self.list_exports(),
        })
    }

    /// Commit every pool (called at shutdown).
    pub fn shutdown(&self) {
        for p in self.pools() {
            if let Err(e) = p.shutdown() {
                eprintln!("tessera: pool {}: final commit failed: {e}", p.name());
            }
        }
    }
}

impl ExportCatalog for Node {
    fn list(&self) -> Vec<String> {
        self.pools()
            .iter()
            .flat_map(|p| p.exports().into_iter().map(|e| e.name))
            .collect()
    }
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        let (p, e) = self.find_export(name)?;
        let v = p.volume_by_id(e.volume_id)?;
        Some(ExportInfo {
            size: v.size(),
            read_only: e.read_only,
            description: format!("Tessera volume {} in pool {}", v.name, p.name()),
        })
    }
}

/// `layout` as users write it (see `LayoutKind::parse`).
fn layout_kind(layout: &str, stripe: u64, ndev: usize) -> Result<LayoutKind> {
    LayoutKind::parse(layout, stripe, ndev).map_err(Error::invalid)
}

/// How the registry records a layout: mirrors with their copies, ec with k+m.
fn layout_spec(kind: &LayoutKind) -> String {
    kind.spec()
}

fn open_devices(specs: &[String]) -> Result<Vec<Arc<dyn BlockDevice>>> {
    specs
        .iter()
        .map(|s| {
            let spec = DeviceSpec::parse(s).map_err(|e| Error::invalid(e.to_string()))?;
            open_device(&spec).map_err(|e| Error::new(ErrorKind::Io, format!("device {s}: {e}")))
        })
        .collect()
}

/// Stands in for a mirror's device that could not be opened: every I/O fails with ENODEV,
/// so the pool marks it failed. Its size is large enough never to limit the layout.
struct MissingDevice(String);

struct MissingHandle;

impl tessera_io::IoHandle for MissingHandle {
    unsafe fn submit(
        &mut self,
        io: &mut tessera_io::CoreIo,
        _op: tessera_io::IoOp,
        tag: tessera_io::Tag,
    ) {
        io.complete(tag, -libc::ENODEV)
    }
    fn size(&self) -> u64 {
        1 << 60
    }
}

impl BlockDevice for MissingDevice {
    fn describe(&self) -> String {
        format!("{} (missing)", self.0)
    }
    fn size(&self) -> u64 {
        1 << 60
    }
    fn read_at(&self, _: u64, _: &mut [u8]) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn write_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn write_zeroes_at(&self, _: u64, _: u64) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn sync(&self) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::ENODEV))
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn tessera_io::IoHandle> {
        Box::new(MissingHandle)
    }
}

/// Wrap the devices of a redundant pool in swappable slots (other layouts: as they are).
fn wrap_slots(
    redundant: bool,
    devs: Vec<Arc<dyn BlockDevice>>,
) -> (Vec<Arc<dyn BlockDevice>>, Vec<Arc<SwappableDevice>>) {
    if !redundant {
        return (devs, Vec::new());
    }
    let slots: Vec<Arc<SwappableDevice>> = devs.into_iter().map(SwappableDevice::new).collect();
    let devs = slots
        .iter()
        .map(|s| s.clone() as Arc<dyn BlockDevice>)
        .collect();
    (devs, slots)
}

/// Bytes device `i` of `p` must have: its data start (1 MiB; 17 MiB for parity layouts,
/// whose stripe journal precedes the data, docs/format.md §1) plus its data length.
fn slot_need(p: &Pool, i: usize) -> u64 {
    let l = &p.core.layout;
    let start = if l.kind.is_parity() {
        tessera_pool::format::DEV_DATA_START + (16 << 20)
    } else {
        tessera_pool::format::DEV_DATA_START
    };
    l.dev_data_len[i] + start
}

/// What a device swapped into a slot must hold: what the layout uses of the slot (a
/// stand-in for a missing device claims a huge size).
fn fit_slots(p: &Pool, slots: &[Arc<SwappableDevice>]) {
    for (i, s) in slots.iter().enumerate() {
        s.set_required_size(slot_need(p, i));
    }
}

fn spec_path(s: &str) -> Option<std::path::PathBuf> {
    match DeviceSpec::parse(s) {
        Ok(DeviceSpec::File { path, .. }) => Some(path),
        _ => None,
    }
}

/// The spec to remember in the registry: files by path alone (they exist now).
fn canonical_spec(s: &str) -> String {
    match DeviceSpec::parse(s) {
        Ok(DeviceSpec::File { path, .. }) => std::fs::canonicalize(&path)
            .unwrap_or(path)
            .display()
            .to_string(),
        _ => s.to_string(),
    }
}

pub fn pool_json(p: &Pool) -> Value {
    let s = p.status();
    json!({
        "name": s.name, "state": s.state, "uuid": s.uuid, "layout": s.layout, "stripe_size": s.stripe_size,
        "copies": s.copies, "parity": s.parity, "layout_spec": s.spec,
        "device_states": s.devices.iter().zip(&s.device_states).map(|(d, (st, why))| {
            if why.is_empty() { json!({"device": d, "state": st}) } else { json!({"device": d, "state": st, "reason": why}) }
        }).collect::<Vec<_>>(),
        "devices": s.devices, "unit_size": s.unit_size, "capacity": s.capacity, "allocated": s.allocated,
        "free": s.free, "metadata": s.metadata, "volumes": s.volumes, "volatile": s.volatile,
        "capacity_human": format_size(s.capacity),
    })
}
