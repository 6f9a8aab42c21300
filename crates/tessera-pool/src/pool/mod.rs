//! A pool: devices under a layout, a metadata region, the unit allocator, the volumes
//! carved from it, and the commit thread that makes thin-map changes durable.
//!
//! Here: the pool's state (`State`, behind the pool lock) and its shared core, creating
//! and opening a pool (labels, layout, metadata), status, rebuild of units, shutdown.
//! The rest is one file per part: `allocator` (free units, the reserve, the zeroer),
//! `committer` (journal and checkpoints, device syncs, FLUSH), `catalog` (volumes and
//! exports by name, sizes, overcommit) and `first_write_plan` (the metadata half of a
//! first write into a snapshot chain's unit).

mod allocator;
mod cache;
mod catalog;
mod committer;
mod first_write_plan;

pub(crate) use allocator::{NEEDS_REDIRECT, NEEDS_RESERVE};
pub use catalog::{validate_name, validate_overcommit};
pub(crate) use committer::CommitRequest;
pub(crate) use first_write_plan::{BlockRun, ChainRead, FirstWritePlan};
pub use tessera_io::units::human_bytes;

use allocator::zeroer_loop;
use catalog::provisioned;
use committer::{committer_loop, JournalCursor};
use tessera_io::sync::MutexExt;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tessera_api::{DeviceHealth, DeviceState, PoolInfo, PoolState};
use tessera_device::{format_size, BlockDevice};

use crate::error::{Error, ErrorKind, Result};
use crate::format::*;
use crate::layout::{Layout, LayoutKind};
use crate::meta::MetaStore;
use crate::volume::{UnitMap, Volume, HOLE};
use tessera_io::cast::{u32_of, usize_of};

/// Default allocation unit; see docs/architecture.md for the reasoning.
pub const DEFAULT_UNIT_SIZE: u64 = 1 << 20;
/// Default overcommit ratio: the virtual size of a pool's volumes may reach this many
/// times its capacity before `create_volume` / `resize_volume` refuse without `force`.
/// 20x is the figure OpenStack Cinder (`max_over_subscription_ratio`) and LINSTOR
/// (`MaxOversubscriptionRatio`) ship with: room for the usual thin provisioning (volumes
/// mostly empty, sized for growth), while a size typo (`1P` for `1T` on a 4 TiB pool)
/// is caught. The thin map's memory no longer depends on it (it follows allocated
/// space), so the ratio is about promising space, not about the node's RAM.
pub const DEFAULT_OVERCOMMIT: f64 = 20.0;
/// Unflushed thin-map changes are committed at least this often.
pub const COMMIT_INTERVAL: Duration = Duration::from_secs(5);
/// Mirrored pools: how soon a device failure is recorded in the labels.
pub const FAILURE_POLL: Duration = Duration::from_millis(100);

/// How a new pool is made ([`Pool::create`]).
#[derive(Clone, Copy, Debug)]
pub struct PoolOptions {
    pub layout: LayoutKind,
    pub unit_size: u64,
    /// Overwrite devices that carry another pool's label.
    pub force: bool,
    /// How it behaves while open.
    pub tuning: PoolTuning,
    /// Deduplicate (docs/format.md §17): see [`Pool::enable_dedup`].
    pub dedup: bool,
}

/// How a new volume is made ([`Pool::create_volume_opts`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct VolumeOptions {
    /// Create it even beyond the pool's overcommit ratio.
    pub force: bool,
    /// Whether it deduplicates (docs/format.md §17): `None` follows the pool (a dedup
    /// pool with dedup on makes block-mapped volumes); `Some(false)` opts a volume of a
    /// dedup pool out (a plain thin volume); `Some(true)` is refused where the pool does
    /// not deduplicate now.
    pub dedup: Option<bool>,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            layout: LayoutKind::Concat,
            unit_size: DEFAULT_UNIT_SIZE,
            force: false,
            tuning: PoolTuning::default(),
            dedup: false,
        }
    }
}

/// How an open pool behaves: the node's configuration, not stored in the pool. Given to
/// [`Pool::create`] (in [`PoolOptions`]) and [`Pool::open_with`].
#[derive(Clone, Copy, Debug)]
pub struct PoolTuning {
    /// A redundant pool's device whose I/O has not completed for this long is marked
    /// failed (the node's `device_timeout_ms`).
    pub device_timeout: Duration,
    /// Parity pools flush their stripe-journal records before writing rows in place (the
    /// node's `parity_journal_flush`): what closes the write hole across a power loss on
    /// devices with a volatile write cache. Off, it is closed for a process crash only
    /// (devices with power-loss protection make the flush nearly free anyway).
    pub journal_flush: bool,
    /// Sequential readers of a pool without a cache tier are read ahead of into
    /// buffers of their handles (the node's `readahead`; `volume::readahead`).
    pub readahead: bool,
    /// Under the QoS share scheduler, a read of a region its handle's detector calls
    /// random goes before the connection's writes waiting for a share round (the node's
    /// `random_reads_first`; seed 004's QoS).
    pub random_reads_first: bool,
}

impl Default for PoolTuning {
    fn default() -> Self {
        PoolTuning {
            device_timeout: crate::layout::DEFAULT_DEVICE_TIMEOUT,
            journal_flush: true,
            readahead: true,
            random_reads_first: true,
        }
    }
}

pub(crate) struct State {
    pub owners: Vec<(u32, u32)>,
    /// Free data units; popped from the end, so kept descending (lowest units first).
    pub free: Vec<u32>,
    /// Released units whose release is not yet durable.
    pub pending_free: Vec<u32>,
    /// Free units zeroed by the zeroer since this open, lowest first (memory only: after
    /// a restart they are plain free units again). Not in `free`.
    pub zeroed: VecDeque<u32>,
    /// The unit the zeroer has taken from `free` and is zeroing now.
    pub zeroing: Option<u32>,
    /// Bumped when units zeroed so far may not read as zeroes on every copy any more (a
    /// rebuild starts: it copies allocated units only); a unit the zeroer finishes under
    /// an older epoch goes back to `free`.
    pub zero_epoch: u64,
    /// The pool is closing: the zeroer returns.
    pub zeroer_stop: bool,
    /// An allocation asked for zeroed units (the first partial write since the open, or
    /// one after the zeroer failed): the zeroer keeps the reserve full while set.
    pub zeroer_wanted: bool,
    /// Parity pools: the allocation reserve (docs/format.md §3.5), units whose
    /// reservation is durable: the only units `allocate` hands out. Lowest first.
    pub reserve: VecDeque<u32>,
    /// Units reserved (owner `OWNER_RESERVED`) whose reservation is not durable yet: they
    /// join `reserve` when the commit or checkpoint that records them succeeds.
    pub reserving: Vec<u32>,
    /// An allocation asked the commit thread to top the reserve up (asked once).
    pub reserve_wanted: bool,
    /// The last commit that should have made reservations durable failed: an allocation
    /// that finds the reserve empty fails (EIO) instead of waiting.
    pub reserve_failed: bool,
    /// The commit thread has returned (the pool is closing): nothing tops the reserve up.
    pub committer_stopped: bool,
    /// A unit of the reserve that a rebuild is zero-filling on the rebuilt device
    /// (`Pool::rebuild_free_unit`): out of the reserve meanwhile, so no write reaches it,
    /// and still free space.
    pub rebuild_held: Option<u32>,
    pub records: Vec<Record>,
    pub volumes: BTreeMap<u32, Arc<Volume>>,
    pub exports: Vec<ExportRecord>,
    pub next_volume_id: u32,
    /// Partial units (docs/format.md §3.4): owned, with some block still the parent's.
    pub partial: std::collections::BTreeSet<u32>,
    /// Blocks of partial units that a first write in flight is filling (bit per block,
    /// memory only): no other write takes them until it completes (`chain.rs`).
    pub copying: std::collections::HashMap<u32, [u64; 4]>,
    /// Changes of block-mapped layers that a catalog change (a delete, a rollback) made
    /// and the dedup metadata still has to follow: applied outside this lock, whose
    /// order comes after the dedup lock (`PoolCore::apply_layer_chores`).
    pub layer_chores: Vec<LayerChore>,
}

/// A change to the dedup maps that follows a catalog change (see `State::layer_chores`).
#[derive(Debug)]
pub(crate) enum LayerChore {
    /// The layer is gone: its references are dropped and its map units freed.
    Remove(u32),
    /// A hidden snapshot's layer gives back what every child (these layers) covers.
    Covered(u32, Vec<u32>),
}

/// Shared between the control plane, the commit thread and every volume handle.
pub struct PoolCore {
    pub name: String,
    pub uuid: Uuid,
    pub layout: Arc<Layout>,
    pub(crate) meta: MetaStore,
    pub(crate) state: Mutex<State>,
    journal: Mutex<JournalCursor>,
    pub unit_shift: u32,
    pub(crate) commit_tx: Mutex<Sender<CommitRequest>>,
    /// Generation of the device state in the labels, and each device's label.
    dev_state: Mutex<(u64, Vec<Label>)>,
    /// Wakes the zeroer (the reserve of zeroed units runs low, or the pool closes).
    zero_wanted: Condvar,
    /// Wakes an allocator waiting for the unit the zeroer holds (`State::zeroing`).
    zero_done: Condvar,
    /// The overcommit ratio (`f64` bits): volumes' virtual sizes may add up to this many
    /// times the capacity. The node's setting, not stored in the pool.
    overcommit: std::sync::atomic::AtomicU64,
    /// Presence bitmaps of partial units (snapshots and clones, docs/format.md §3.4).
    pub(crate) presence: crate::presence::PresenceTable,
    /// Requests in flight on the volumes, per core: what a release of units (and a
    /// snapshot) waits for (`inflight`).
    pub(crate) inflight: Arc<crate::inflight::IoEpochs>,
    /// The cache tier, if the pool has one (`cache`).
    pub(crate) cache: Arc<crate::cache_tier::CacheSlot>,
    /// A dedup pool's metadata (`dedup::store`), set once when dedup is turned on or the
    /// pool is opened.
    pub(crate) dedup: std::sync::OnceLock<Arc<crate::dedup::DedupCore>>,
    /// `PoolTuning::readahead`.
    pub(crate) readahead: std::sync::atomic::AtomicBool,
    /// `PoolTuning::random_reads_first`.
    pub(crate) random_reads_first: std::sync::atomic::AtomicBool,
}

pub struct Pool {
    pub core: Arc<PoolCore>,
    committer: Mutex<Option<JoinHandle<()>>>,
    /// The zeroer thread (pools without parity; see `zeroer_loop`).
    zeroer: Mutex<Option<JoinHandle<()>>>,
    /// The previous run ended with a clean shutdown (its newest checkpoint carries
    /// `CKPT_FLAG_CLEAN`); true for a new pool. See `opened_clean`.
    was_clean: std::sync::atomic::AtomicBool,
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn random_uuid() -> Uuid {
    let mut u = [0u8; 16];
    // SAFETY: getrandom writes at most 16 bytes into u.
    let n = unsafe { libc::getrandom(u.as_mut_ptr() as *mut libc::c_void, 16, 0) };
    if n != 16 {
        // Extremely unlikely; fall back to time and address entropy.
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let salt = &t as *const u128 as u128;
        u.copy_from_slice(&(t ^ salt).to_le_bytes());
    }
    u
}

pub fn uuid_string(u: &Uuid) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

impl PoolCore {
    /// The switches of `tuning` the datapath reads while the pool is open.
    fn apply_tuning(&self, tuning: &PoolTuning) {
        use std::sync::atomic::Ordering::Relaxed;
        self.readahead.store(tuning.readahead, Relaxed);
        self.random_reads_first
            .store(tuning.random_reads_first, Relaxed);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.locked()
    }

    /// The dedup metadata of a dedup pool.
    pub fn dedup(&self) -> Option<&Arc<crate::dedup::DedupCore>> {
        self.dedup.get()
    }

    pub fn unit_size(&self) -> u64 {
        1 << self.unit_shift
    }

    /// The cache tier, if there is one.
    pub fn cache_tier(&self) -> Option<Arc<crate::cache_tier::CacheTier>> {
        self.cache.get()
    }

    /// Pool unit `p` changes owner (allocated or freed): what the cache tier holds of it
    /// belongs to the previous owner's data.
    pub(crate) fn uncache_unit(&self, p: u32) {
        if let Some(t) = self.cache.get() {
            t.invalidate(u64::from(p) << self.unit_shift, self.unit_size());
        }
    }

    /// Pool unit `p` was freed by its volume: what the cache holds of it is garbage,
    /// and dirty write-back data of it is dropped once the free is durable (`release`).
    pub(crate) fn cache_unit_freed(&self, p: u32) {
        if let Some(t) = self.cache.get() {
            t.unit_freed(u64::from(p) << self.unit_shift, self.unit_size());
        }
    }

    /// Whether the pool unit at byte `offset` belongs to a volume (not free, not in the
    /// allocation reserve).
    pub(crate) fn unit_owned(&self, offset: u64) -> bool {
        let s = self.lock();
        let p = usize::try_from(offset >> self.unit_shift).unwrap_or(usize::MAX);
        s.owners
            .get(p)
            .is_some_and(|&(o, _)| o != OWNER_FREE && o != OWNER_RESERVED)
    }
}

impl Pool {
    /// Format `devices` as a new pool.
    pub fn create(
        name: &str,
        devices: Vec<Arc<dyn BlockDevice>>,
        opts: PoolOptions,
    ) -> Result<Pool> {
        validate_name("pool", name)?;
        let unit = opts.unit_size;
        if !unit.is_power_of_two() || !(64 << 10..=1 << 30).contains(&unit) {
            return Err(Error::invalid(format!(
                "allocation unit {unit} must be a power of two between 64K and 1G"
            )));
        }
        if !opts.force {
            for d in &devices {
                let mut b = vec![0u8; LABEL_AREA];
                if d.read_at(0, &mut b).is_ok() {
                    if let Ok(Some((l, _))) = Label::decode_area(&b) {
                        return Err(Error::new(
                            ErrorKind::AlreadyExists,
                            format!("device {} already belongs to pool '{}' (uuid {}); destroy that pool first, or pass --force to overwrite it", d.describe(), l.pool_name, uuid_string(&l.uuid)),
                        ));
                    }
                }
            }
        }
        let layout = Arc::new(Layout::new(opts.layout, devices)?);
        layout.apply_tuning(opts.tuning.journal_flush, opts.tuning.device_timeout);
        let total_units = layout.size / unit;
        if total_units >= u32::MAX as u64 {
            return Err(Error::invalid(
                "pool has too many allocation units; use a larger unit size",
            ));
        }
        let uuid = random_uuid();
        layout.set_pool_uuid(uuid);
        layout
            .format_parity()
            .map_err(|e| Error::io("zeroing the parity pool's devices", e))?;
        let sb = Superblock::plan(uuid, unit, total_units, now_secs());
        if total_units <= sb.meta_units {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "pool too small: its metadata needs {} MiB and the devices give {} MiB",
                    (sb.meta_units * unit) >> 20,
                    layout.size >> 20
                ),
            ));
        }
        let stripe = opts.layout.stripe();
        let code = match opts.layout {
            LayoutKind::Concat => LayoutCode::Concat,
            LayoutKind::Raid0 { .. } => LayoutCode::Raid0,
            LayoutKind::Raid1 { .. } => LayoutCode::Raid1,
            LayoutKind::Raid10 { .. } => LayoutCode::Raid10,
            LayoutKind::Raid5 { .. } => LayoutCode::Raid5,
            LayoutKind::Raid6 { .. } => LayoutCode::Raid6,
            LayoutKind::Ec { .. } => LayoutCode::Ec,
        };
        // Mirrors record their copies, parity layouts their parity chunks per row.
        let copies = if opts.layout.is_mirror() {
            opts.layout.copies()
        } else {
            opts.layout.parity()
        };
        fn ioe(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
            move |e| Error::io(what, e)
        }
        let mut labels = Vec::new();
        for (i, d) in layout.devices.iter().enumerate() {
            let label = Label {
                uuid,
                index: u32_of(i),
                count: u32_of(layout.devices.len()),
                layout: code,
                stripe,
                data_len: layout.dev_data_len[i],
                unit_size: unit,
                pool_name: name.to_string(),
                copies,
                state_gen: 0,
                failed: 0,
                fail_reason: [0; 64],
            };
            labels.push(label.clone());
            // Both slots (docs/format.md §1): a stale label of an earlier use of the
            // device must not be left in slot 1.
            d.write_at(0, &label.encode_area())
                .map_err(ioe(&format!("writing the label of {}", d.describe())))?;
        }
        let meta = MetaStore {
            layout: layout.clone(),
            sb: sb.clone(),
        };
        meta.write_superblock()
            .map_err(ioe("writing the pool superblock"))?;
        meta.clear_slot(false)
            .map_err(ioe("clearing checkpoint slot B"))?;
        let owners = initial_owners(&sb);
        let catalog = Catalog {
            next_volume_id: 1,
            ..Default::default()
        }
        .encode()?;
        meta.write_checkpoint(true, 0, 1, 1, &catalog, &owners)
            .map_err(ioe("writing the first checkpoint"))?;
        layout.sync().map_err(ioe("syncing the new pool"))?;
        let pool = Self::assemble(
            name,
            meta,
            Catalog::decode(&catalog)?,
            owners,
            (1, 1, true),
            (0, labels),
        )?;
        if pool.core.layout.parity.is_some() {
            // Fill the allocation reserve (docs/format.md §3.5) before the first write.
            pool.core.checkpoint()?;
        }
        if opts.dedup {
            pool.enable_dedup()?;
        }
        pool.core.apply_tuning(&opts.tuning);
        Ok(pool)
    }

    /// Open an existing pool from its devices (in label order), tuned by default.
    pub fn open(devices: Vec<Arc<dyn BlockDevice>>) -> Result<Pool> {
        Pool::open_with(devices, PoolTuning::default())
    }

    /// Open an existing pool from its devices (in label order).
    pub fn open_with(devices: Vec<Arc<dyn BlockDevice>>, tuning: PoolTuning) -> Result<Pool> {
        let (first, labels, missing) = Self::read_labels(&devices)?;
        let layout = Self::open_layout(devices, &first, &labels, &missing, tuning)?;
        let sb = MetaStore::read_superblock(&layout)?;
        if sb.uuid != first.uuid
            || sb.unit_size != first.unit_size
            || sb.total_units * sb.unit_size > layout.size
        {
            return Err(Error::corrupt(
                "pool superblock does not match the device labels",
            ));
        }
        let meta = MetaStore { layout, sb };
        let ck = meta.load_newest_checkpoint()?;
        let mut owners = ck.owners;
        let total = owners.len();
        let mut catalog = ck.catalog;
        let dedup = (catalog.dedup || catalog.index_buckets > 0).then_some(catalog.index_buckets);
        let dedup_on = catalog.dedup;
        let mut partial: BTreeMap<u32, [u8; PRESENCE_BYTES]> =
            std::mem::take(&mut catalog.partial).into_iter().collect();
        let next_seq = meta.replay(ck.header.journal_seq, |r| {
            crate::presence::replay_presence(&mut partial, &r);
            if (r.pool_unit as usize) < total && r.volume_id != PRESENCE_RECORD {
                owners[r.pool_unit as usize] = (r.volume_id, r.volume_unit);
            }
        })?;
        catalog.partial = partial.into_iter().collect();
        let dedup_units = dedup.map(|_| {
            let layers = catalog
                .volumes
                .iter()
                .filter(|v| v.chain.flags & crate::format::CHAIN_BLOCK_MAPPED != 0)
                .map(|v| v.chain.layer)
                .collect();
            crate::dedup::store::DedupUnits::from_owners(&owners, &layers)
        });
        let clean = ck.header.flags & crate::format::CKPT_FLAG_CLEAN != 0;
        if !clean && meta.layout.parity.is_some() {
            Self::zero_reserved(&first.pool_name, &meta, &owners)?;
        }
        let pool = Self::assemble(
            &first.pool_name,
            meta,
            catalog,
            owners,
            (ck.header.generation, next_seq, ck.slot_is_a),
            (first.state_gen, labels),
        )?;
        {
            let mut cur = pool.core.journal();
            cur.ckpt_seq = ck.header.journal_seq;
        }
        pool.was_clean
            .store(clean, std::sync::atomic::Ordering::Relaxed);
        if let (Some(buckets), Some(units)) = (dedup, dedup_units) {
            // Pages are valid up to the last journal block replayed (docs/format.md §17).
            let d = crate::dedup::DedupCore::open(
                pool.core.layout.clone(),
                pool.core.uuid,
                pool.core.unit_shift,
                units,
                buckets,
                next_seq - 1,
            )
            .map_err(|e| Error::io("opening the dedup metadata", e))?;
            d.set_active(dedup_on);
            // Each block-mapped layer reads through its volume's parent's layer.
            let chains: Vec<(u32, Option<u32>)> = pool
                .core
                .lock()
                .volumes
                .values()
                .filter(|v| v.block_mapped())
                .map(|v| (v.layer(), v.parent().map(|p| p.layer())))
                .collect();
            for (layer, parent) in chains {
                d.add_layer(layer, parent);
            }
            let _ = pool.core.dedup.set(Arc::new(d));
        }
        // Fold the replayed journal into a fresh checkpoint (and skip a journal lap).
        // It has no clean flag: until the next clean shutdown the pool counts as open.
        pool.core.checkpoint()?;
        pool.core.apply_tuning(&tuning);
        Ok(pool)
    }

    /// After an unclean shutdown of a parity pool: zero every unit of its allocation
    /// reserve (docs/format.md §3.5). Any of them may have been handed out and written
    /// after the last commit, which then never recorded its new owner; a later partial
    /// write into it would otherwise leave that data readable around it. The reserve is
    /// bounded (`ALLOCATION_RESERVE_BYTES`), so is this work. The rows inside a unit are
    /// zeroed without the stripe journal (`Layout::zero_at_open`): a crash during this
    /// leaves the units reserved in the durable metadata, and the next (unclean) open
    /// zeroes them again; the rows a unit shares with its neighbours are journaled.
    fn zero_reserved(name: &str, meta: &MetaStore, owners: &[(u32, u32)]) -> Result<()> {
        let unit = meta.sb.unit_size;
        let started = std::time::Instant::now();
        let mut zeroed = 0u64;
        for (p, o) in owners.iter().enumerate() {
            if o.0 != OWNER_RESERVED || (p as u64) < meta.sb.meta_units {
                continue;
            }
            meta.layout
                .zero_at_open(p as u64 * unit, unit)
                .map_err(|e| Error::io(&format!("zeroing reserved unit {p}"), e))?;
            zeroed += 1;
        }
        if zeroed > 0 {
            // Durable before any of them is handed out (the open's checkpoint syncs too).
            meta.layout
                .sync()
                .map_err(|e| Error::io("syncing the zeroed reserved units", e))?;
            tracing::info!(
                pool = %name,
                units = zeroed,
                bytes = zeroed * unit,
                ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                "zeroed the allocation reserve after an unclean shutdown"
            );
        }
        Ok(())
    }

    /// Read every device's label. Returns the device state of the newest readable label
    /// (folded into the first device's label), every device's label, and the devices
    /// whose label could not be read: a mirror opens without them (they are failed),
    /// other layouts need all.
    fn read_labels(devices: &[Arc<dyn BlockDevice>]) -> Result<(Label, Vec<Label>, Vec<usize>)> {
        let mut found = Vec::new();
        for d in devices {
            let mut b = vec![0u8; LABEL_AREA];
            let l = d
                .read_at(0, &mut b)
                .map_err(|e| Error::io(&format!("reading the label of {}", d.describe()), e))
                .and_then(|()| {
                    Label::decode_area(&b)
                        .map_err(|e| Error::corrupt(format!("{}: {e}", d.describe())))?
                        .ok_or_else(|| {
                            Error::corrupt(format!("{} carries no Tessera label", d.describe()))
                        })
                })
                .map(|(l, slot)| {
                    // A label found outside the slot its generation names (a version 1
                    // label of an odd generation): copy it there first, so the next
                    // generation's write (to the other slot) leaves a whole copy behind.
                    if slot != l.slot() {
                        if let Err(e) = d.write_at(l.slot(), &l.encode()).and_then(|()| d.sync()) {
                            tracing::warn!(device = %d.describe(), error = %e, "cannot copy the label to its slot");
                        }
                    }
                    l
                });
            found.push(l);
        }
        let newest = found
            .iter()
            .filter_map(|l| l.as_ref().ok())
            .max_by_key(|l| l.state_gen)
            .cloned();
        let mut missing = Vec::new();
        let mut labels = Vec::new();
        for (i, l) in found.into_iter().enumerate() {
            match (l, &newest) {
                (Ok(l), _) => labels.push(l),
                (Err(e), Some(n)) if n.layout.is_redundant(n.copies) => {
                    tracing::warn!(pool = %n.pool_name, error = %e, "device label unreadable; the device is failed");
                    let mut l = n.clone();
                    l.index = u32_of(i);
                    missing.push(i);
                    labels.push(l);
                }
                (Err(e), _) => return Err(e),
            }
        }
        let first = labels
            .first()
            .ok_or_else(|| Error::invalid("a pool needs at least one device"))?
            .clone();
        let first = Label {
            state_gen: newest.as_ref().map_or(0, |n| n.state_gen),
            failed: newest.as_ref().map_or(0, |n| n.failed),
            fail_reason: newest.as_ref().map_or([0; 64], |n| n.fail_reason),
            ..first
        };
        for (i, (l, d)) in labels.iter().zip(devices).enumerate() {
            if l.uuid != first.uuid || l.count as usize != devices.len() || l.index as usize != i {
                return Err(Error::corrupt(format!(
                    "device {} is device {} of {} of pool '{}' ({}), expected device {i} of {} of pool {}",
                    d.describe(),
                    l.index,
                    l.count,
                    l.pool_name,
                    uuid_string(&l.uuid),
                    devices.len(),
                    uuid_string(&first.uuid)
                )));
            }
        }
        Ok((first, labels, missing))
    }

    /// The layout the labels describe, with their failed devices (and the `missing`
    /// ones) failed, checked against the devices, and its stripe journal recovered.
    fn open_layout(
        devices: Vec<Arc<dyn BlockDevice>>,
        first: &Label,
        labels: &[Label],
        missing: &[usize],
        tuning: PoolTuning,
    ) -> Result<Arc<Layout>> {
        let kind = layout_kind_of(first);
        // The labels name a layout their devices cannot hold: the labels are wrong, not
        // the request, so this is corruption (with the layout's reason as the message).
        let layout =
            Arc::new(Layout::new(kind, devices).map_err(|e| Error::corrupt(e.to_string()))?);
        layout.apply_tuning(tuning.journal_flush, tuning.device_timeout);
        // Devices recorded failed stay failed: they missed writes. So do missing ones.
        for i in 0..layout.devices.len() {
            if first.failed & (1 << i) != 0 {
                layout.restore_failed(
                    i,
                    crate::layout::FailReason::from_byte(first.fail_reason[i])
                        .filter(|&r| r > crate::layout::FailReason::Missing)
                        .unwrap_or(crate::layout::FailReason::Missing),
                );
            }
        }
        layout
            .health
            .failed_durable
            .store(first.failed, std::sync::atomic::Ordering::Relaxed);
        for &i in missing {
            layout.restore_failed(i, crate::layout::FailReason::Missing);
        }
        if layout.has_lost_data() {
            return Err(Error::corrupt(format!(
                "pool '{}': every copy of some data is on failed or missing devices",
                first.pool_name
            )));
        }
        for (i, l) in labels.iter().enumerate() {
            if layout.dev_data_len[i] < l.data_len {
                return Err(Error::corrupt(format!(
                    "device {} shrank since the pool was created",
                    layout.devices[i].describe()
                )));
            }
        }
        // Parity layouts: finish or undo the row writes a crash interrupted before the
        // metadata is read through them (docs/format.md §2.1).
        layout.set_pool_uuid(first.uuid);
        layout
            .recover_journal()
            .map_err(|e| Error::io("recovering the stripe journal", e))?;
        Ok(layout)
    }

    fn assemble(
        name: &str,
        meta: MetaStore,
        catalog: Catalog,
        mut owners: Vec<(u32, u32)>,
        (gen, next_seq, newest_is_a): (u64, u64, bool),
        (state_gen, labels): (u64, Vec<Label>),
    ) -> Result<Pool> {
        let unit_shift = meta.sb.unit_size.trailing_zeros();
        let (tx, rx) = channel();
        let core = Arc::new(PoolCore {
            name: name.to_string(),
            uuid: meta.sb.uuid,
            layout: meta.layout.clone(),
            state: Mutex::new(State {
                owners: Vec::new(),
                free: Vec::new(),
                pending_free: Vec::new(),
                layer_chores: Vec::new(),
                zeroed: VecDeque::new(),
                zeroing: None,
                zero_epoch: 0,
                zeroer_stop: false,
                zeroer_wanted: false,
                reserve: VecDeque::new(),
                reserving: Vec::new(),
                reserve_wanted: false,
                reserve_failed: false,
                committer_stopped: false,
                rebuild_held: None,
                records: Vec::new(),
                volumes: BTreeMap::new(),
                exports: catalog.exports.clone(),
                next_volume_id: catalog.next_volume_id.max(1),
                partial: std::collections::BTreeSet::new(),
                copying: std::collections::HashMap::new(),
            }),
            presence: crate::presence::PresenceTable::new(meta.sb.total_units, unit_shift),
            meta,
            journal: Mutex::new(JournalCursor {
                next_seq,
                ckpt_seq: next_seq,
                ckpt_gen: gen,
                newest_is_a,
                force_checkpoint: false,
            }),
            unit_shift,
            commit_tx: Mutex::new(tx),
            dev_state: Mutex::new((state_gen, labels)),
            zero_wanted: Condvar::new(),
            zero_done: Condvar::new(),
            overcommit: std::sync::atomic::AtomicU64::new(DEFAULT_OVERCOMMIT.to_bits()),
            inflight: crate::inflight::IoEpochs::new(),
            cache: Arc::default(),
            dedup: std::sync::OnceLock::new(),
            readahead: std::sync::atomic::AtomicBool::new(true),
            random_reads_first: std::sync::atomic::AtomicBool::new(true),
        });
        {
            let mut s = core.lock();
            let mut vols = BTreeMap::new();
            for v in &catalog.volumes {
                let units = v.size.div_ceil(core.unit_size());
                vols.insert(
                    v.id,
                    Volume::new(
                        core.clone(),
                        v.id,
                        v.name.clone(),
                        v.size,
                        v.created,
                        UnitMap::new(units),
                        v.qos.clone(),
                    ),
                );
            }
            for v in &catalog.volumes {
                let parent = match v.chain.parent {
                    0 => None,
                    id => Some(vols.get(&id).cloned().ok_or_else(|| {
                        Error::corrupt(format!(
                            "volume '{}' reads through volume {id}, which the catalog lacks",
                            v.name
                        ))
                    })?),
                };
                vols[&v.id].set_chain(v.chain, parent);
            }
            let meta_units = usize_of(core.meta.sb.meta_units);
            let maps: BTreeMap<u32, (&Arc<Volume>, Arc<UnitMap>)> = vols
                .values()
                .map(|v| (v.layer(), (v, v.current_map())))
                .collect();
            let mut free = Vec::new();
            let parity = core.layout.parity.is_some();
            let block_mapped: std::collections::BTreeSet<u32> = catalog
                .volumes
                .iter()
                .filter(|v| v.chain.flags & crate::format::CHAIN_BLOCK_MAPPED != 0)
                .map(|v| v.chain.layer)
                .collect();
            for (p, o) in owners.iter_mut().enumerate() {
                if p < meta_units {
                    *o = (OWNER_META, 0);
                    continue;
                }
                if parity && o.0 == OWNER_RESERVED {
                    // Zeroed by `open_with` after an unclean shutdown.
                    *o = (OWNER_RESERVED, 0);
                    s.reserve.push_back(u32_of(p));
                    continue;
                }
                if crate::dedup::store::is_dedup_owner(*o, &block_mapped) {
                    continue;
                }
                match maps.get(&o.0) {
                    Some((v, map)) if (o.1 as u64) < map.len() && map.get(o.1 as u64) == HOLE => {
                        map.set(o.1 as u64, u32_of(p));
                        v.allocated.fetch_add(1, Relaxed);
                    }
                    _ => {
                        // Free, or naming a volume/unit that no longer exists (a deleted
                        // volume whose last checkpoint raced a crash): the unit is free.
                        *o = (OWNER_FREE, 0);
                        free.push(u32_of(p));
                    }
                }
            }
            drop(maps);
            for (p, bits) in &catalog.partial {
                let owned = owners
                    .get(*p as usize)
                    .is_some_and(|o| ![OWNER_FREE, OWNER_META, OWNER_RESERVED].contains(&o.0));
                if owned {
                    core.presence.load_bits(*p, bits);
                    if !core.presence.is_full(*p) {
                        s.partial.insert(*p);
                    }
                }
            }
            free.reverse();
            s.free = free;
            s.owners = owners;
            s.volumes = vols;
        }
        let c2 = core.clone();
        let h = std::thread::Builder::new()
            .name(format!("tessera-commit-{name}"))
            .spawn(move || committer_loop(c2, rx))
            .map_err(|e| Error::io("starting the commit thread", e))?;
        let zeroer = match core.layout.parity {
            Some(_) => None,
            None => {
                let c2 = core.clone();
                Some(
                    std::thread::Builder::new()
                        .name(format!("tessera-zero-{name}"))
                        .spawn(move || zeroer_loop(c2))
                        .map_err(|e| Error::io("starting the zeroing thread", e))?,
                )
            }
        };
        Ok(Pool {
            core,
            committer: Mutex::new(Some(h)),
            zeroer: Mutex::new(zeroer),
            was_clean: std::sync::atomic::AtomicBool::new(true),
        })
    }

    pub fn name(&self) -> &str {
        &self.core.name
    }

    /// Turn deduplication on (docs/format.md §17): volumes created from now on are
    /// block-mapped; volumes that exist stay as they are. Takes the fingerprint index's
    /// units (0.6% of the capacity). Refused on parity layouts, with a cache tier, and
    /// at unit sizes other than 1 MiB: the first cut does not handle them.
    pub fn enable_dedup(&self) -> Result<()> {
        let core = &self.core;
        if core.dedup().is_some() {
            return Ok(());
        }
        if core.layout.parity.is_some() {
            return Err(Error::invalid(
                "dedup is not available on parity layouts (raid5, raid6, ec) yet; use \
                 concat, raid0, raid1 or raid10",
            ));
        }
        if core.cache.get().is_some() {
            return Err(Error::invalid(
                "dedup is not available on a pool with a cache tier yet; remove the cache first",
            ));
        }
        if core.unit_size() != crate::dedup::store::DEDUP_UNIT {
            return Err(Error::invalid(format!(
                "dedup needs the default 1 MiB allocation unit; this pool has {}",
                tessera_io::units::human_bytes(core.unit_size())
            )));
        }
        let capacity = core.meta.sb.total_units * core.unit_size();
        let (nunits, buckets) = crate::dedup::DedupCore::index_size(capacity);
        let mut units = crate::dedup::store::DedupUnits::default();
        let mut taken = Vec::new();
        let r = (|| {
            for i in 0..nunits {
                let i = u32_of(i);
                let p = core
                    .alloc_owned(crate::dedup::store::OWNER_INDEX, i)
                    .map_err(|_| {
                        Error::new(
                            ErrorKind::NoSpace,
                            format!("no space for the dedup index ({nunits} MiB)"),
                        )
                    })?;
                taken.push(p);
                // An index starts empty: old bytes must not look like buckets.
                core.layout
                    .write_zeroes_at(u64::from(p) << core.unit_shift, core.unit_size())
                    .map_err(|e| Error::io("zeroing the dedup index", e))?;
                units.index.insert(i, p);
            }
            crate::dedup::DedupCore::open(
                core.layout.clone(),
                core.uuid,
                core.unit_shift,
                units,
                buckets,
                0,
            )
            .map_err(|e| Error::io("opening the dedup index", e))
        })();
        let d = match r {
            Ok(d) => d,
            Err(e) => {
                let mut s = core.lock();
                for p in taken {
                    core.free_owned(&mut s, p);
                }
                return Err(e);
            }
        };
        let _ = core.dedup.set(Arc::new(d));
        core.checkpoint()
    }

    /// Turn deduplication on or off (`pool update --dedup on|off`), durable when this
    /// returns. On, the first time, is [`Pool::enable_dedup`]. Off keeps the store, the
    /// maps and the index: blocks already shared stay shared and dedup volumes stay
    /// readable and writable, but writes store their blocks without a lookup and new
    /// volumes are plain. On again looks writes up again (blocks written while off are
    /// not in the index, so they are not found for sharing).
    pub fn set_dedup(&self, on: bool) -> Result<()> {
        match self.core.dedup() {
            None if on => self.enable_dedup(),
            None => Ok(()),
            Some(d) if d.active() == on => Ok(()),
            Some(d) => {
                d.set_active(on);
                self.core.checkpoint().inspect_err(|_| d.set_active(!on))
            }
        }
    }

    /// Whether dedup is on: new volumes are block-mapped and writes are looked up.
    pub fn dedup_enabled(&self) -> bool {
        self.core.dedup().is_some_and(|d| d.active())
    }

    /// Dedup figures, when the pool has dedup metadata (on, or off after being on).
    pub fn dedup_stats(&self) -> Option<tessera_api::DedupInfo> {
        self.core.dedup().map(|d| d.stats())
    }

    /// The scrub of a dedup pool's metadata (`None` on other pools): reference counts
    /// against the maps and index entries against their blocks, repaired with `repair`;
    /// the index walk ends early when `stop` says so. The findings are the damage found.
    pub fn scrub_dedup(
        &self,
        repair: bool,
        stop: &dyn Fn() -> bool,
    ) -> Option<(tessera_api::DedupScrubInfo, Vec<String>)> {
        self.core.dedup().map(|d| d.scrub(repair, stop))
    }

    /// Dedup metadata problems (counts against references): empty when none or when
    /// dedup is off.
    pub fn verify_dedup(&self) -> Vec<String> {
        self.core.dedup().map_or_else(Vec::new, |d| d.verify())
    }

    /// The pool's UUID, as `status().uuid` shows it (without taking the pool's lock).
    pub fn uuid(&self) -> String {
        uuid_string(&self.core.uuid)
    }

    /// The pool as the API shows it. What the pool does not know is left empty for the
    /// node to fill in: `spares`, `rebuild`, `resync`.
    pub fn status(&self) -> PoolInfo {
        // Before the pool lock: the dedup lock is always taken first.
        let dedup = self.dedup_stats();
        let s = self.core.lock();
        let unit = self.core.unit_size();
        let sb = &self.core.meta.sb;
        let l = &self.core.layout;
        let data_units = sb.total_units - sb.meta_units;
        let free_units = (PoolCore::free_units(&s) + s.pending_free.len()) as u64;
        let devices: Vec<String> = l.devices.iter().map(|d| d.describe()).collect();
        let capacity = data_units * unit;
        PoolInfo {
            name: self.core.name.clone(),
            uuid: uuid_string(&self.core.uuid),
            layout: l.kind.name().to_string(),
            stripe_size: l.kind.stripe(),
            state: if l.has_lost_data() {
                PoolState::Failed
            } else if l.health.rebuilding.load(Relaxed) != 0 {
                PoolState::Rebuilding
            } else if l.health.failed.load(Relaxed) != 0 {
                PoolState::Degraded
            } else {
                PoolState::Online
            },
            copies: l.kind.copies(),
            parity: l.kind.parity(),
            layout_spec: l.kind.spec(),
            device_states: devices
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let (state, reason) = if l.is_failed(i) {
                        let r = l.health.fail_reason[i].load(Relaxed);
                        let why = crate::layout::fail_reason_name(r);
                        (
                            DeviceHealth::Failed,
                            (!why.is_empty()).then(|| why.to_string()),
                        )
                    } else if l.health.rebuilding.load(Relaxed) & (1 << i) != 0 {
                        (DeviceHealth::Rebuilding, None)
                    } else {
                        (DeviceHealth::Online, None)
                    };
                    DeviceState {
                        device: d.clone(),
                        state,
                        reason,
                    }
                })
                .collect(),
            devices,
            unit_size: unit,
            capacity,
            capacity_human: format_size(capacity),
            allocated: (data_units - free_units) * unit,
            free: free_units * unit,
            metadata: sb.meta_units * unit,
            volumes: s.volumes.len(),
            volatile: l.is_volatile(),
            provisioned: provisioned(&s),
            overcommit: self.overcommit(),
            spares: Vec::new(),
            rebuild: None,
            dedup,
            resync: None,
        }
    }

    /// Set (or, with all fields empty, clear) a volume's QoS limits, live and durably.
    /// Pool units (indexes) that hold volume data, in pool order: what a background pass
    /// (scrub, rebuild) has to cover on a thin pool.
    pub fn allocated_units(&self) -> Vec<u64> {
        let s = self.core.lock();
        s.owners
            .iter()
            .enumerate()
            .filter(|(_, o)| ![OWNER_FREE, OWNER_META, OWNER_RESERVED].contains(&o.0))
            .map(|(p, _)| p as u64)
            .collect()
    }

    /// Pool units a rebuild has to copy: the metadata units and every allocated unit.
    /// Units of a parity pool's allocation reserve are free space and skipped like free
    /// units (a rebuild would otherwise copy up to the whole reserve more).
    pub fn rebuild_units(&self) -> Vec<u64> {
        let s = self.core.lock();
        s.owners
            .iter()
            .enumerate()
            .filter(|(_, o)| o.0 != OWNER_FREE && o.0 != OWNER_RESERVED)
            .map(|(p, _)| p as u64)
            .collect()
    }

    /// Free units zeroed ahead of allocation right now (see `zeroer_loop`).
    pub fn zeroed_units(&self) -> usize {
        self.core.lock().zeroed.len()
    }

    /// Make device `d` of a mirror a write-only member to be rebuilt (see
    /// `Layout::start_rebuild`).
    pub fn start_rebuild(&self, d: usize) -> Result<()> {
        self.core.layout.start_rebuild(d)?;
        // After the layout counts `d` in: zeroes written from now on reach it.
        self.core.forget_zeroed();
        Ok(())
    }

    /// Copy pool unit `u` onto the rebuilding device `d` (`buf`: scratch, any size that
    /// divides the unit). Returns the bytes written to `d`.
    pub fn rebuild_unit(&self, d: usize, u: u64, buf: &mut [u8]) -> Result<u64> {
        let unit = self.core.unit_size();
        let mut done = 0;
        let mut off = 0;
        while off < unit {
            let len = usize_of((unit - off).min(buf.len() as u64));
            done += self
                .core
                .layout
                .rebuild_range(d, u * unit + off, &mut buf[..len])
                .map_err(|e| Error::io("rebuilding", e))?;
            off += len as u64;
        }
        Ok(done)
    }

    /// Parity pools: the units `rebuild_units` leaves out (free or in the allocation
    /// reserve), which a rebuild zero-fills on the rebuilt device (`rebuild_free_unit`).
    /// Empty for other layouts: a mirror's free units may keep other bytes on the rebuilt
    /// device, since a mirror zeroes a unit on every copy when it hands it out
    /// (`PoolCore::allocate`, `plan_first_write`), which costs far less than zero-filling
    /// all free space at every rebuild (and does not need one: a power loss can make the
    /// copies of a free unit differ too).
    pub fn rebuild_free_units(&self) -> Vec<u64> {
        if self.core.layout.parity.is_none() {
            return Vec::new();
        }
        let s = self.core.lock();
        s.owners
            .iter()
            .enumerate()
            .filter(|(_, o)| o.0 == OWNER_FREE || o.0 == OWNER_RESERVED)
            .map(|(p, _)| p as u64)
            .collect()
    }

    /// Rebuild pool unit `u`, free when `rebuild_free_units` listed it, onto the
    /// rebuilding device `d` of a parity pool: its rows there become zero, as they are on
    /// every other device, whatever `d` held (a replacement's old contents, or data of a
    /// unit freed while `d` was away: freeing zeroes the readable devices only). Without
    /// this a partial write into the unit later would read those bytes back and compute
    /// the row's parity from them. The unit is kept free while `d` is zero-filled, which
    /// no row lock covers: the journal lock holds off the commit that would move a unit
    /// of the free list into the allocation reserve, and a unit of the reserve is taken
    /// out of it meanwhile (`rebuild_held`). A unit that is no longer free (allocated
    /// since, or freed but not zeroed yet) is reconstructed instead. Other layouts:
    /// nothing to do. Returns the bytes written to `d`.
    pub fn rebuild_free_unit(&self, d: usize, u: u64, buf: &mut [u8]) -> Result<u64> {
        let l = &self.core.layout;
        if l.parity.is_none() {
            return Ok(0);
        }
        let unit = self.core.unit_size();
        let p = u32_of(u);
        let cur = self.core.journal();
        let held = {
            let mut s = self.core.lock();
            match s.owners[usize_of(u)].0 {
                // In the free list (not waiting to be zeroed): only a top-up, which
                // waits for the journal lock, could hand it out.
                OWNER_FREE if !s.pending_free.contains(&p) => Some(false),
                OWNER_RESERVED => match s.reserve.iter().position(|&q| q == p) {
                    Some(i) => {
                        s.reserve.remove(i);
                        s.rebuild_held = Some(p);
                        Some(true)
                    }
                    None => None,
                },
                _ => None,
            }
        };
        let Some(in_reserve) = held else {
            drop(cur);
            return self.rebuild_unit(d, u, buf);
        };
        if in_reserve {
            // Commits may go on: the held unit is in no list a top-up takes from.
            drop(cur);
            let r = l.rebuild_free_range(d, u * unit, unit);
            let mut s = self.core.lock();
            s.rebuild_held = None;
            s.reserve.push_front(p);
            drop(s);
            r.map_err(|e| Error::io("rebuilding", e))
        } else {
            let r = l.rebuild_free_range(d, u * unit, unit);
            drop(cur);
            r.map_err(|e| Error::io("rebuilding", e))
        }
    }

    /// Device `d` holds every copied unit: it becomes readable, and the labels (a new
    /// state generation, written to every healthy device including `d`) record it.
    pub fn finish_rebuild(&self, d: usize) -> Result<()> {
        let l = &self.core.layout;
        l.sync()
            .map_err(|e| Error::io("syncing before the rebuild completes", e))?;
        l.finish_rebuild(d);
        // Every readable device's label, the rebuilt one's first of all, is written now.
        self.core.write_device_state(true)
    }

    /// Re-read and check the metadata (superblock, both checkpoint slots) against their
    /// checksums. Returns one line per finding; a slot that is merely older or cleared is
    /// not a finding, both slots invalid is.
    pub fn verify_metadata(&self) -> Vec<String> {
        let mut found = Vec::new();
        if let Err(e) = crate::meta::MetaStore::read_superblock(&self.core.layout) {
            found.push(format!("superblock: {e}"));
        }
        if let Err(e) = self.core.meta.load_newest_checkpoint() {
            found.push(format!("checkpoints: {e}"));
        }
        found.extend(self.verify_chains());
        found
    }

    /// Commit now (used by tests and at shutdown).
    pub fn commit(&self) -> Result<()> {
        self.core.commit()?;
        if let Some(d) = self.core.dedup() {
            d.flush_index();
        }
        Ok(())
    }

    /// Stop the zeroer and wait for it: once a pool is closed, nothing of it may write
    /// to its devices (they may be reopened at once, by this process too).
    fn stop_zeroer(&self) {
        self.core.lock().zeroer_stop = true;
        self.core.zero_wanted.notify_all();
        if let Some(h) = self.zeroer.locked().take() {
            let _ = h.join();
        }
    }

    /// Final commit; stop the commit and zeroing threads.
    pub fn shutdown(&self) -> Result<()> {
        self.stop_zeroer();
        let _ = self.core.commit_tx.locked().send(CommitRequest::Stop);
        if let Some(h) = self.committer.locked().take() {
            let _ = h.join();
        }
        self.commit()?;
        // Every write is on every copy: record it (docs/format.md §3.2, clean-shutdown
        // flag). Writes that arrive after this point are not covered by it.
        let mut cur = self.core.journal();
        let freed = std::mem::take(&mut self.core.lock().pending_free);
        let freed = self.core.zero_freed(freed);
        let r = self
            .core
            .checkpoint_flags(&mut cur, crate::format::CKPT_FLAG_CLEAN);
        self.core.release(freed, r.is_ok());
        r?;
        // Parity layouts: every row write has finished; nothing to replay at the next open.
        self.core
            .layout
            .clear_journal()
            .map_err(|e| Error::io("emptying the stripe journal", e))
    }

    /// Whether the previous run of this pool ended with a clean shutdown (`shutdown`);
    /// after an unclean one the copies of a mirror may differ and need a resync. Always
    /// true for a pool created by this process.
    pub fn opened_clean(&self) -> bool {
        self.was_clean.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop_zeroer();
        let _ = self.core.commit_tx.locked().send(CommitRequest::Stop);
        // Break the volume → pool reference cycle.
        self.core.lock().volumes.clear();
        // The commit thread holds the pool's core, and with it the devices and their
        // locks: a pool dropped gives its devices back when the drop returns, not when
        // that thread next runs (on a loaded machine, a new pool on the same files was
        // refused them as "in use").
        if let Some(h) = self.committer.locked().take() {
            let _ = h.join();
        }
    }
}

/// The layout a pool's label records.
fn layout_kind_of(first: &Label) -> LayoutKind {
    match first.layout {
        LayoutCode::Concat => LayoutKind::Concat,
        LayoutCode::Raid0 => LayoutKind::Raid0 {
            stripe: first.stripe,
        },
        LayoutCode::Raid1 => LayoutKind::Raid1 {
            copies: first.copies,
        },
        LayoutCode::Raid10 => LayoutKind::Raid10 {
            copies: first.copies,
            stripe: first.stripe,
        },
        LayoutCode::Raid5 => LayoutKind::Raid5 {
            stripe: first.stripe,
        },
        LayoutCode::Raid6 => LayoutKind::Raid6 {
            stripe: first.stripe,
        },
        LayoutCode::Ec => LayoutKind::Ec {
            k: first.count - first.copies,
            m: first.copies,
            stripe: first.stripe,
        },
    }
}

fn initial_owners(sb: &Superblock) -> Vec<(u32, u32)> {
    (0..sb.total_units)
        .map(|p| {
            if p < sb.meta_units {
                (OWNER_META, 0)
            } else {
                (OWNER_FREE, 0)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_device::{BlockDevice, RamDevice};
    use tessera_io::IoOp;
    use tessera_testkit::blockio::{core, read, run, write};

    use super::*;

    fn raid5_pool() -> Pool {
        let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
            .map(|_| RamDevice::new(48 << 20).unwrap() as Arc<dyn BlockDevice>)
            .collect();
        let opts = PoolOptions {
            layout: LayoutKind::Raid5 { stripe: 16 << 10 },
            ..PoolOptions::default()
        };
        Pool::create("p", devs, opts).unwrap()
    }

    /// Run `op` on a thread of its own (its own core context and handle of `v`) while
    /// this thread holds the journal lock, which every commit and checkpoint takes before
    /// it tops the allocation reserve up: with the reserve emptied into the free list
    /// first, the allocation of `op` finds it empty, and nothing can refill it until
    /// the lock is let go. Checks that `op` then asks for a refill and keeps waiting
    /// (it neither fails nor completes), and returns its result once the commit thread
    /// has reserved more.
    fn with_the_reserve_empty(pool: &Pool, v: &Arc<Volume>, op: IoOp) -> i32 {
        let cur = pool.core.journal();
        {
            let mut s = pool.core.lock();
            assert!(!s.reserve.is_empty(), "the reserve was not filled");
            assert!(s.reserving.is_empty(), "no top-up is in flight");
            let units = std::mem::take(&mut s.reserve);
            s.free.extend(units.into_iter().rev());
            // As after a burst whose refill request was served: the next allocation
            // that finds the reserve low asks again.
            s.reserve_wanted = false;
        }
        // The raw pointers of `op` are the caller's buffers, alive until the join below.
        struct SendOp(IoOp);
        // SAFETY: see above; the op is only submitted on the spawned thread.
        unsafe impl Send for SendOp {}
        let op = SendOp(op);
        let v = v.clone();
        let t = std::thread::spawn(move || {
            let op = op;
            let mut io = core();
            let mut h = v.open_handle();
            run(&mut io, &mut h, op.0)
        });
        // Bounded wait for the allocation to have found the reserve empty (it asked
        // for a refill, and nothing else can have asked since the drain above).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !pool.core.lock().reserve_wanted {
            assert!(
                !t.is_finished(),
                "the write ended without asking for a refill"
            );
            assert!(std::time::Instant::now() < deadline, "no allocation ran");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(pool.core.lock().reserve.is_empty());
        assert!(!t.is_finished(), "the write did not wait for the reserve");
        drop(cur);
        t.join().unwrap()
    }

    /// A write into a new unit that finds a parity pool's reserve empty neither fails
    /// nor blocks its reactor: it is retried until the commit thread has reserved more
    /// (a partial write, a whole-unit write and a write-zeroes each find it empty). Once
    /// the pool is full, a new unit is ENOSPC as before. Deterministic: the reserve
    /// stays empty until the test lets the commit thread go (`with_the_reserve_empty`).
    #[test]
    fn parity_allocation_waits_for_the_reserve_off_the_reactor() {
        let pool = raid5_pool();
        let unit = pool.core.unit_size();
        let units = pool.status().free / unit;
        let v = pool.create_volume("v", units * unit).unwrap();
        let mut io = core();
        let mut h = v.open_handle();
        let small = [7u8; 4096];
        let partial = IoOp::Write {
            offset: 4096,
            len: 4096,
            buf: small.as_ptr(),
        };
        assert_eq!(with_the_reserve_empty(&pool, &v, partial), 0);
        let whole = vec![9u8; usize_of(unit)];
        let full = IoOp::Write {
            offset: unit,
            len: u32_of(unit),
            buf: whole.as_ptr(),
        };
        assert_eq!(with_the_reserve_empty(&pool, &v, full), 0);
        let zeroes = IoOp::WriteZeroes {
            offset: 2 * unit + 512,
            len: 8192,
            may_unmap: false,
        };
        assert_eq!(with_the_reserve_empty(&pool, &v, zeroes), 0);
        assert_eq!(v.allocated_bytes(), 3 * unit);
        let got = read(&mut io, &mut h, 0, usize_of(2 * unit)).unwrap();
        assert!(got[..4096].iter().all(|&b| b == 0));
        assert!(got[4096..8192].iter().all(|&b| b == 7));
        assert!(got[8192..usize_of(unit)].iter().all(|&b| b == 0));
        assert!(got[usize_of(unit)..] == whole[..]);
        {
            // Only reserved units were handed out, and the reserve is all that is free.
            let s = pool.core.lock();
            let reserved = s.owners.iter().filter(|o| o.0 == OWNER_RESERVED).count();
            assert_eq!(reserved, s.reserve.len() + s.reserving.len());
            assert!(
                s.free.is_empty(),
                "a small pool's free units all fit the reserve"
            );
        }
        // Fill the rest (each unit from the reserve), then the pool is full.
        for u in 3..units {
            assert_eq!(write(&mut io, &mut h, u * unit, &[1u8; 512]), 0, "unit {u}");
        }
        assert_eq!(pool.status().free, 0);
        let w = pool.create_volume("w", unit).unwrap();
        let mut hw = w.open_handle();
        assert_eq!(write(&mut io, &mut hw, 0, &[1u8; 512]), -libc::ENOSPC);
    }

    /// Units a commit is reserving are still free space while it writes them: an
    /// allocation that finds the reserve empty then waits for them (`NEEDS_RESERVE`)
    /// instead of failing with ENOSPC, and the pool's free space does not dip. The
    /// commit's first step is done here by hand under the journal lock, so the commit
    /// thread cannot finish it: the state is the one a write sees while it runs.
    #[test]
    fn units_being_reserved_are_not_out_of_space() {
        let pool = raid5_pool();
        let free = pool.status().free;
        let _cur = pool.core.journal();
        let mut s = pool.core.lock();
        let units = std::mem::take(&mut s.reserve);
        s.free.extend(units.into_iter().rev());
        assert!(
            pool.core.reserve_target() > PoolCore::free_units(&s),
            "a small pool"
        );
        pool.core.top_up_reserve(&mut s);
        assert!(s.free.is_empty() && s.reserve.is_empty());
        assert_eq!(
            (PoolCore::free_units(&s) as u64) << pool.core.unit_shift,
            free,
            "units being reserved count as free"
        );
        assert_eq!(pool.core.take_reserved(&mut s), Err(NEEDS_RESERVE));
        drop(s);
        pool.core.reservation_done(true);
        let mut s = pool.core.lock();
        assert!(pool.core.take_reserved(&mut s).is_ok());
    }
}
