//! The node's state and every management operation. The API and the CLI are thin layers
//! over these methods. Management runs on control-plane threads, never on a reactor.
//!
//! The node is being split into services that each own their state and its lock, which
//! `Node` only holds and wires together. So far:
//!
//! - jobs (`jobs.rs`, [`Jobs`], [`Node::jobs`]): the pools' scrub, resync and rebuild,
//!   which exclude each other per pool, and the background classes' limits;
//! - exports and protocols (`exports.rs`, [`Exports`], [`Node::exports`]): NBD TLS and
//!   addresses, every listener's connection cap, the client buffer budget, and how an
//!   export looks to clients. Adding and removing an export stays a `Node` operation
//!   in the same file: it needs the admin lock (below) and the pools;
//! - replicas (`replicas.rs`, [`Replicas`], [`Node::replicas`]): the replicated volumes
//!   this node owns, those it does not serve and why, and the `[replication]` settings
//!   (the resync rate falls back on the jobs service's "resync" class). Creating one,
//!   adding or removing a replica and deleting one stay `Node` operations in the same
//!   file (admin lock, pools, peers, cluster); the peer side of a replica too;
//! - cluster (`cluster.rs`, [`Cluster`], [`Node::cluster`]): the membership once
//!   joined, the volumes this node owns with their epoch, and the stale copies of
//!   given-up volumes still to delete. Its operations need the pools, replicas and
//!   exports too and stay `Node` methods: joining, the cluster view and the specs
//!   (`cluster.rs`), the owner's side (`ownership.rs`), the watcher that takes volumes
//!   over and gives them up (`failover.rs`), fences (`fencing.rs`);
//! - pools (`pools.rs`, [`Pools`], [`Node::pools`]): the open pools, the offline ones
//!   with the reason, and the registry; every part looks pools and volumes up through
//!   it. Creating (with the config's declarations, below), destroying (which forgets
//!   the pool's jobs and slots) and updating a pool stay `Node` operations in the same
//!   file;
//! - spares (`spares.rs`, [`Spares`]): the redundant pools' swappable device slots and
//!   the opened hot spares. Replacing a device and the hot spare watcher stay `Node`
//!   operations there: they ask the jobs service whether a pool is busy and start the
//!   rebuild onto the new device through it.
//!
//! The other operations are still grouped by what they manage, one `impl Node` per
//! file: volumes (`volumes.rs`), snapshots (`snapshots.rs`), the NBD proxy to other
//! nodes' volumes (`proxy.rs`), QoS groups (`qos.rs`), NVMe/TCP (`nvmf.rs`),
//! iSCSI targets and their listener (`iscsi.rs`, over `crate::iscsi`),
//! and the devices the pools are opened on (`devices.rs`); a volume's own snapshot
//! history (`lineage.rs`, a leaf the others share). This file holds the state, starting
//! the node and the lookups every part uses. Operations answer with the types of
//! `tessera_api`; the JSON is made at the API edge (crate::api).

mod cluster;
pub use cluster::Cluster;
mod devices;
mod exports;
mod failover;
pub use exports::Exports;
pub mod fencing;
mod jobs;
pub use jobs::Jobs;
pub mod iscsi;
mod lineage;
pub mod nvmf;
mod ownership;
pub use nvmf::ClusterPath;
mod pool_cache;
mod pools;
pub use pools::Pools;
pub mod proxy;
mod qos;
pub mod replicas;
pub use replicas::Replicas;
mod snapshots;
mod spares;
pub use spares::Spares;
#[cfg(feature = "test-hooks")]
mod test_hooks;
/// RAM pools and an in-process node for tests: this crate's unit tests, and (with the
/// `harness` feature, which only this crate's own dev-dependency turns on) its
/// integration tests under `tests/`.
#[cfg(any(test, feature = "harness"))]
pub mod test_pools;
mod volumes;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use tessera_io::sync::MutexExt;

use tessera_api::NodeStatus;
use tessera_device::{parse_size, BlockDevice, SwappableDevice};
use tessera_io::{spawn_reactors, Mailbox, ReactorConfig};
use tessera_nbd::handshake::{ExportCatalog, ExportInfo};
use tessera_pool::{Pool, PoolOptions};
use tracing::{error, info, warn};

use crate::config::NodeConfig;
pub use crate::error::{Error, Result, StartError};
use crate::registry::{PoolEntry, Registry};
use devices::{fit_slots, open_devices, wrap_slots, MissingDevice};
use pools::{layout_kind, parse_layout};

pub struct Node {
    pub cfg: NodeConfig,
    /// The open pools, the offline ones and the registry (node/pools.rs).
    pools: Pools,
    /// Serialises management operations so that checks and changes do not interleave.
    admin: Mutex<()>,
    pub reactors: Vec<Arc<Mailbox>>,
    next_core: AtomicUsize,
    pub started: Instant,
    /// NBD TLS and addresses, listener caps and the client buffer budget
    /// (node/exports.rs).
    exports: Exports,
    /// NVMe/TCP subsystems and target (crate::nvmf).
    pub nvmf: crate::nvmf::NvmfState,
    /// iSCSI targets and their live target (crate::iscsi).
    pub iscsi: crate::iscsi::IscsiState,
    /// QoS groups (tenants) and their stepped bursts.
    pub groups: crate::groups::Groups,
    /// Scrub, resync and rebuild of the pools, and the background classes' limits
    /// (node/jobs.rs).
    jobs: Jobs,
    /// The device slots of each redundant pool, which a replacement or a hot spare is
    /// swapped into live, and the opened hot spares (node/spares.rs;
    /// docs/architecture.md "Device replacement and hot spares").
    spares: Spares,
    /// Replicated volumes this node owns, and those not served with the reason
    /// (node/replicas.rs).
    replicas: Replicas,
    /// Cluster membership, the volumes this node owns and the stale copies of given-up
    /// ones (node/cluster.rs, ownership.rs, failover.rs).
    cluster: Cluster,
    /// The node itself, for threads and hooks that must not keep it alive.
    self_ref: std::sync::OnceLock<std::sync::Weak<Node>>,
    /// Set at shutdown: background watchers end.
    stopping: std::sync::atomic::AtomicBool,
    /// Cluster volumes other nodes own that NBD clients reach through this node
    /// (node/proxy.rs).
    proxies: proxy::Proxies,
    /// This node's claim on its data directory, held until the process ends.
    _dir_lock: crate::datadir::DataDirLock,
}

/// How often the node looks for a failed device a hot spare can replace.
pub const SPARE_TICK: std::time::Duration = std::time::Duration::from_millis(500);

/// How this node's pools behave while open (`device_timeout_ms`, `parity_journal_flush`,
/// `readahead`, `random_reads_first`).
pub(crate) fn pool_tuning(cfg: &NodeConfig) -> tessera_pool::PoolTuning {
    tessera_pool::PoolTuning {
        device_timeout: std::time::Duration::from_millis(cfg.device_timeout_ms.max(1)),
        journal_flush: cfg.parity_journal_flush,
        readahead: cfg.readahead,
        random_reads_first: cfg.random_reads_first,
    }
}

fn size_arg(what: &str, v: &str) -> Result<u64> {
    parse_size(v).map_err(|e| Error::invalid(format!("{what}: {e}")))
}

impl Node {
    /// Start the reactors and bring back every pool in the registry. `dir_lock` is the
    /// data directory's lock ([`crate::DataDirLock::acquire`]), taken before anything else
    /// so that a second node on the same directory opens nothing.
    pub fn start(
        cfg: NodeConfig,
        dir_lock: crate::datadir::DataDirLock,
    ) -> std::result::Result<Arc<Node>, StartError> {
        let rcfg = ReactorConfig {
            cores: cfg.core_count(),
            busy_poll: cfg.busy_poll,
            pin: cfg.pin_cores,
            poll_window: std::time::Duration::from_micros(cfg.poll_us),
            ..ReactorConfig::default()
        };
        // A bad certificate or key stops the start before any pool is opened.
        let exports = Exports::load(&cfg)?;
        let reactors = spawn_reactors(&rcfg).map_err(StartError::Reactors)?;
        let registry = Registry::new(&cfg.data_dir);
        let entries = registry.load()?;
        let nvmf = crate::nvmf::NvmfState::load(&cfg.data_dir).map_err(StartError::Catalog)?;
        let iscsi = crate::iscsi::IscsiState::load(&cfg.data_dir).map_err(StartError::Catalog)?;
        let groups = crate::groups::Groups::load(&cfg.data_dir).map_err(StartError::Catalog)?;
        let jobs = Jobs::load(&cfg.data_dir)?;
        let reactors: Vec<Arc<Mailbox>> = reactors.into_iter().map(|(m, _h)| m).collect();
        let replicas = Replicas::new(&cfg, reactors.clone());
        let node = Arc::new(Node {
            cfg,
            pools: Pools::new(registry, entries.clone()),
            admin: Mutex::new(()),
            reactors,
            next_core: AtomicUsize::new(0),
            started: Instant::now(),
            exports,
            nvmf,
            iscsi,
            groups,
            jobs,
            spares: Spares::default(),
            replicas,
            cluster: Cluster::default(),
            self_ref: std::sync::OnceLock::new(),
            stopping: std::sync::atomic::AtomicBool::new(false),
            proxies: proxy::Proxies::default(),
            _dir_lock: dir_lock,
        });
        let _ = node.self_ref.set(Arc::downgrade(&node));
        for e in entries {
            for s in &e.spares {
                match open_devices(std::slice::from_ref(s)) {
                    Ok(mut d) => node.spares.keep_open(s, d.remove(0)),
                    Err(err) => warn!(
                        pool = %e.name, device = %s, error = %err,
                        "hot spare cannot be opened (it is tried again when needed)"
                    ),
                }
            }
            match node.restore_pool(&e) {
                Ok((p, slots)) => {
                    node.pools.insert(Arc::new(p));
                    node.spares.set_slots(&e.name, slots);
                }
                Err(err) => {
                    error!(pool = %e.name, error = %err, "pool is offline");
                    node.pools.mark_offline(&e.name, err.to_string());
                }
            }
        }
        // A rebuild the node was running when it stopped resumes from its cursor, before
        // any client can write.
        for p in node.pools().list() {
            node.jobs.resume_rebuild(&p);
        }
        // A mirrored pool whose previous run did not end with a clean shutdown may have
        // copies that differ where a write was cut between them: resync it in the
        // background (after a resumed rebuild). Parity pools recover from their journal.
        for p in node.pools().list() {
            if !p.opened_clean() && p.core.layout.kind.is_mirror() {
                warn!(
                    pool = %p.name(),
                    "pool was not shut down cleanly: resyncing its mirror copies"
                );
                if let Err(e) = node.jobs.start_resync(&p) {
                    error!(pool = %p.name(), error = %e, "cannot resync");
                }
            }
        }
        node.replicas
            .open_all(node.jobs.background(), |v| node.pools().volume(v));
        node.apply_declarations()?;
        node.groups.bind_all(|n| node.pools().volume(n));
        node.start_ladder();
        node.start_spare_watch();
        Ok(node)
    }

    fn restore_pool(&self, e: &PoolEntry) -> Result<(Pool, Vec<Arc<SwappableDevice>>)> {
        let (p, slots) = self.open_pool(e)?;
        let recreated = p.core.layout.devices.iter().any(|d| d.is_volatile());
        self.restore_pool_cache(&p, e, recreated);
        let ratio = e.overcommit.unwrap_or(tessera_pool::DEFAULT_OVERCOMMIT);
        if let Err(err) = p.set_overcommit(ratio) {
            warn!(pool = %e.name, error = %err, "bad overcommit ratio in the registry: using the default");
        }
        Ok((p, slots))
    }

    fn open_pool(&self, e: &PoolEntry) -> Result<(Pool, Vec<Arc<SwappableDevice>>)> {
        let redundant = e.layout.starts_with("raid1")
            || parse_layout(&e.layout)
                .and_then(|l| layout_kind(l, e.stripe_size, e.devices.len()))
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
                        warn!(pool = %e.name, device = %s, error = %err, "device cannot be opened: it is failed");
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
            info!(pool = %e.name, "pool is on volatile devices; recreated empty");
            let layout = layout_kind(parse_layout(&e.layout)?, e.stripe_size, devs.len())?;
            let p = Pool::create(
                &e.name,
                devs,
                PoolOptions {
                    layout,
                    unit_size: e.unit_size,
                    force: true,
                    tuning: pool_tuning(&self.cfg),
                    dedup: e.dedup,
                },
            )?;
            fit_slots(&p, &slots);
            return Ok((p, slots));
        }
        let p = Pool::open_with(devs, pool_tuning(&self.cfg))?;
        fit_slots(&p, &slots);
        Ok((p, slots))
    }

    /// Create what the config declares and the registry lacks. One pool that cannot come
    /// up does not stop the node: a declared pool whose devices fail is offline (with the
    /// reason, as one the registry could not open is), and the volumes and exports that
    /// need an offline pool are skipped with an error logged, while the rest is served.
    /// A declaration that is wrong in itself (`Error::Invalid`) still stops the start.
    fn apply_declarations(&self) -> std::result::Result<(), StartError> {
        let cfg = self.cfg.clone();
        for p in &cfg.pools {
            if self.pools().get(&p.name).is_ok() || self.pools().offline_reason(&p.name).is_some() {
                continue;
            }
            let size = |what: &str, v: &Option<String>| v.as_deref().map(|v| size_arg(what, v));
            let created = (|| {
                let stripe = size("stripe size", &p.stripe_size).transpose()?;
                let unit = size("unit size", &p.unit_size).transpose()?;
                let layout = parse_layout(&p.layout)?;
                self.create_pool(&p.name, &p.devices, layout, stripe, unit, false)?;
                if p.dedup {
                    self.enable_pool_dedup(&p.name)?;
                }
                if !p.cache.is_empty() {
                    let req = tessera_api::CacheRequest {
                        devices: p.cache.clone(),
                        mode: p.cache_mode.clone(),
                        force: false,
                        unit: p.cache_unit.clone().map(tessera_api::SizeArg::Text),
                        admit_hits: p.cache_admit_hits,
                    };
                    self.add_pool_cache(&p.name, &req)?;
                }
                Ok(())
            })();
            match created {
                Ok(_) => {}
                Err(source @ (Error::Invalid(_) | Error::Rejected(_))) => {
                    return Err(StartError::Declaration {
                        what: "pool",
                        name: p.name.clone(),
                        source,
                    })
                }
                Err(err) => {
                    error!(pool = %p.name, error = %err, "pool from the config cannot be created: it is offline");
                    self.pools.mark_offline(&p.name, err.to_string());
                }
            }
        }
        for v in &cfg.volumes {
            if self.pools().find_volume(&v.name).is_ok() {
                continue;
            }
            if let Some(why) = self.pools().offline_reason(&v.pool) {
                error!(volume = %v.name, pool = %v.pool, reason = %why, "volume from the config skipped: its pool is offline");
                continue;
            }
            size_arg("volume size", &v.size)
                .and_then(|size| {
                    let opts = tessera_pool::VolumeOptions {
                        force: false,
                        dedup: v.dedup,
                    };
                    self.create_volume_opts(&v.name, &v.pool, size, opts)
                })
                .map_err(|source| StartError::Declaration {
                    what: "volume",
                    name: v.name.clone(),
                    source,
                })?;
        }
        for x in &cfg.exports {
            if self.find_export(&x.name).is_some() {
                continue;
            }
            // A volume not found may live in an offline pool (the config need not declare
            // it): its export waits for that pool too.
            let offline = self.pools.offline_names();
            if self.pools().find_volume(&x.volume).is_err() && !offline.is_empty() {
                error!(export = %x.name, volume = %x.volume, offline_pools = ?offline, "export from the config skipped: its volume is not open (is its pool offline?)");
                continue;
            }
            self.add_export(&x.name, &x.volume, x.read_only, x.tls)
                .map_err(|source| StartError::Declaration {
                    what: "export",
                    name: x.name.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    /// The pools' background jobs (scrub, resync, rebuild) and the background classes.
    pub fn jobs(&self) -> &Jobs {
        &self.jobs
    }

    /// The protocols' shared state: NBD TLS and addresses, listener caps, client
    /// buffers, and how an export looks to its clients.
    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// The replicated volumes this node owns, and those it does not serve (with why).
    pub fn replicas(&self) -> &Replicas {
        &self.replicas
    }

    fn admin(&self) -> MutexGuard<'_, ()> {
        self.admin.locked()
    }

    /// The pools: open, offline, and the registry.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    /// The next reactor core for a new connection (round robin).
    pub fn next_reactor(&self) -> Arc<Mailbox> {
        let i = self.next_core.fetch_add(1, Relaxed) % self.reactors.len();
        self.reactors[i].clone()
    }

    /// [`next_reactor`](Self::next_reactor) for an accept thread, holding the node weakly
    /// as the NBD listeners do: a node dropped in process (an in-process test node that is
    /// stopped and started again on its data directory) is not kept alive, with its data
    /// directory's lock, by a listener blocked in accept. A connection that arrives after
    /// that goes to the old node's first core, where its target finds nothing to serve.
    pub(crate) fn reactor_picker(self: &Arc<Self>) -> impl Fn() -> Arc<Mailbox> + Send + 'static {
        let node = Arc::downgrade(self);
        let first = self.reactors[0].clone();
        move || {
            node.upgrade()
                .map_or_else(|| first.clone(), |n| n.next_reactor())
        }
    }

    pub fn status(&self) -> NodeStatus {
        let pools = self.pools().list();
        let (mut cap, mut alloc, mut vols) = (0u64, 0u64, 0usize);
        for p in &pools {
            let s = p.status();
            cap += s.capacity;
            alloc += s.allocated;
            vols += s.volumes;
        }
        NodeStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            uptime_seconds: self.started.elapsed().as_secs(),
            cores: self.reactors.len(),
            data_dir: self.cfg.data_dir.clone(),
            api_socket: self.cfg.api_socket(),
            nbd: self.exports.nbd_addresses(),
            capacity: cap,
            allocated: alloc,
            free: cap - alloc,
            pools: self.list_pools(),
            volumes: vols,
            exports: self.exports.list(&pools),
        }
    }

    /// Commit every pool (called at shutdown).
    pub fn shutdown(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        self.leave_cluster();
        self.replicas.close_all();
        for p in self.pools().list() {
            if let Err(e) = p.shutdown() {
                error!(pool = %p.name(), error = %e, "final commit failed");
            }
        }
    }
}

impl ExportCatalog for Node {
    fn list(&self) -> Vec<String> {
        self.pools()
            .list()
            .iter()
            .flat_map(|p| p.exports().into_iter().map(|e| e.name))
            .collect()
    }
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        let (p, e) = self.find_export(name)?;
        let v = p.volume_by_id(e.volume_id)?;
        Some(ExportInfo {
            size: v.size(),
            // A snapshot is read-only whatever its export says: the handshake flags
            // tell the client before its first write.
            read_only: e.read_only || v.is_snapshot(),
            description: format!("Tessera volume {} in pool {}", v.name, p.name()),
            tls_required: self.exports.tls_required(&e),
        })
    }
    /// The snapshots the export's volume descends from: `qemu:dirty-bitmap:NAME`
    /// contexts whose block status marks what changed since NAME.
    fn dirty_bitmaps(&self, name: &str) -> Vec<String> {
        use tessera_export::ExportTarget;
        let Some((p, e)) = self.find_export(name) else {
            return Vec::new();
        };
        p.volume_by_id(e.volume_id)
            .map_or_else(Vec::new, |v| self.target_of(&v).change_bases())
    }
}
