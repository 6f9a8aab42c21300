//! Replicated volumes: one thin volume kept identical on several nodes.
//!
//! A [`ReplicatedVolume`] is an export target (`tessera-export`) whose legs are a thin
//! volume of the owning node's pool and thin volumes of other nodes reached over NVMe/TCP
//! ([`tessera_remote::RemoteDevice`], Tessera's initiator on the reactors). The owner
//! serves it over NBD and NVMe/TCP like a local volume.
//!
//! - Writes go to every in-sync leg in parallel and complete when all acknowledged
//!   (synchronous replication); flushes reach every leg. Reads are served by the local leg
//!   when it is in sync, else by an in-sync remote one, failing over on error. In a
//!   cluster, only under the read lease ([`lease`]): while every remote leg in sync
//!   answered the owner recently, so a partitioned owner stops serving stale data.
//! - A leg that fails (a remote that stayed away past its timeout, a local device error)
//!   is marked out of sync on disk before any write completes without it ([`persist`]).
//!   So is a remote leg whose connection broke, even if the reconnect hid it from every
//!   I/O: its node may have restarted and lost what it had acknowledged but not made
//!   durable. Either way it is marked dirty for every region written since its last
//!   completed flush (flush epochs: [`ReplicatedVolume::written`], `Leg::flushed`).
//! - The activity log and the per-leg dirty bitmaps ([`meta`], docs/format.md §11) make a
//!   returning leg, and the legs after a crash of the owner, catch up by copying only the
//!   regions that may differ ([`resync`]).
//!
//! Per I/O, the datapath ([`handle`]) costs one atomic load of the legs' state and, per
//! region a write touches, one atomic add at submission and one at completion (the count
//! of writes in flight that keeps a region in the activity log), plus, at completion,
//! one load of the flush epoch and a store of it in the region's cell when it changed. A
//! flush costs one atomic add more. The network round trip to a replica is three orders
//! of magnitude larger.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use std::{fs, io};
use tessera_io::sync::{MutexExt, RwLockExt};

use tessera_api::{ReplicaInfo, ReplicaState};
use tessera_export::{ExportTarget, IoStats, StatsRegistry, StatsSnapshot};
use tessera_io::reactor::{Mailbox, SpawnFn, Task};
use tessera_io::CoreIo;
use tessera_pool::Volume;
use tessera_remote::{RemoteConfig, RemoteDevice, RemoteSpec};
use tracing::{info, warn};

pub mod handle;
pub mod lease;
pub mod meta;
pub mod persist;
pub mod resync;

pub use handle::ReplicaHandle;
pub use meta::{LegDesc, LegState, SetDesc};

/// A region's word, changed by one atomic add per write at submission ([`START`]) and one
/// subtraction at completion ([`INFLIGHT_ONE`]): bit 0 says the region is in the activity
/// log on disk (writes to it may start without waiting), bits 1-16 count the writes in
/// flight, bits 17-31 count writes started (wrapping), so the persister can tell a region
/// nobody wrote since its last look and let it leave the log.
pub(crate) const HOT: u32 = 1;
pub(crate) const INFLIGHT_ONE: u32 = 2;
pub(crate) const INFLIGHT: u32 = 0xFFFF << 1;
pub(crate) const STARTED_SHIFT: u32 = 17;
pub(crate) const START: u32 = INFLIGHT_ONE + (1 << STARTED_SHIFT);

/// A leg's view of one region while it is out of sync (`Leg::regions`).
pub(crate) const CLEAN: u8 = 0;
pub(crate) const DIRTY: u8 = 1;
pub(crate) const COPYING: u8 = 2;
pub(crate) const STATE: u8 = 3;
/// Set by every write that touches the region while a resync may be copying it: a copy
/// that started before the write is redone.
pub(crate) const REDIRTY: u8 = 4;

/// Tunables of a replica set.
#[derive(Clone, Debug)]
pub struct ReplicaOptions {
    /// Region size asked for (rounded, see [`meta::region_size_for`]).
    pub region_size: u64,
    /// Most regions in the activity log at once: what a crash of the owner may have to
    /// reconcile.
    pub al_capacity: u32,
    /// How long a remote leg may stay unreachable before it is dropped out of sync.
    pub timeout: Duration,
    /// Most bytes per second a resync copies (0: unlimited).
    pub resync_rate: u64,
    /// Host NQN presented to the peers.
    pub hostnqn: String,
}

impl Default for ReplicaOptions {
    fn default() -> Self {
        ReplicaOptions {
            region_size: 1 << 20,
            al_capacity: 1024,
            timeout: Duration::from_secs(5),
            resync_rate: 256 << 20,
            hostnqn: tessera_remote::RemoteConfig::default().hostnqn,
        }
    }
}

/// The node's reactor cores, where resync tasks run and where each core's share of a
/// replicated volume is released when it closes.
pub struct Cores {
    mailboxes: Vec<Arc<Mailbox>>,
    next: AtomicUsize,
}

impl Cores {
    pub fn new(mailboxes: Vec<Arc<Mailbox>>) -> Arc<Cores> {
        Arc::new(Cores {
            mailboxes,
            next: AtomicUsize::new(0),
        })
    }

    /// Run `f` on the next core (round robin).
    pub(crate) fn spawn(&self, f: SpawnFn) {
        let i = self.next.fetch_add(1, Relaxed) % self.mailboxes.len().max(1);
        if let Some(m) = self.mailboxes.get(i) {
            m.spawn(f);
        }
    }

    /// Run `f` once on every core and wait (bounded) until all did.
    pub(crate) fn on_each(&self, f: impl Fn(&mut CoreIo) + Send + Sync + Clone + 'static) {
        let (tx, rx) = mpsc::channel();
        for m in &self.mailboxes {
            let (f, tx) = (f.clone(), tx.clone());
            m.spawn(Box::new(move |io: &mut CoreIo| {
                f(io);
                let _ = tx.send(());
                Box::new(Oneshot) as Box<dyn Task>
            }));
        }
        for _ in &self.mailboxes {
            if rx.recv_timeout(Duration::from_secs(5)).is_err() {
                warn!("a reactor did not answer within 5 s");
                return;
            }
        }
    }
}

/// A task with nothing to do: it completes one tag to itself so the reactor retires it.
#[derive(Default)]
struct Oneshot;

impl Task for Oneshot {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        io.complete(tessera_io::Tag::task(id, 0), 0);
    }
    fn on_complete(&mut self, _io: &mut CoreIo, _slot: u32, _res: i32) {}
    fn finished(&self) -> bool {
        true
    }
}

/// A leg's device, as the owner reaches it.
pub(crate) enum LegDev {
    Local(Arc<Volume>),
    /// `None` until the peer could be reached.
    Remote(Option<Arc<RemoteDevice>>),
}

/// Resync progress of one leg, for status.
#[derive(Default)]
pub(crate) struct Progress {
    pub(crate) total: AtomicU64,
    pub(crate) copied: AtomicU64,
    pub(crate) running: AtomicBool,
    pub(crate) started: Mutex<Option<Instant>>,
    /// Bytes of regions every resync of this leg brought in sync since the node started.
    pub(crate) copied_total: AtomicU64,
    /// Bytes copied again because a client wrote the region during its copy.
    pub(crate) recopied_total: AtomicU64,
    pub(crate) regions_total: AtomicU64,
}

pub(crate) struct Leg {
    /// Where the leg lives (`LegDesc::Vacant` for a free slot); changes only when a
    /// replica is added or removed.
    pub(crate) desc: RwLock<LegDesc>,
    pub(crate) dev: RwLock<LegDev>,
    /// Bumped when `dev` changes, so per-core handles reopen.
    pub(crate) gen: AtomicU64,
    /// Per region: CLEAN / DIRTY / COPYING (+ REDIRTY), meaningful while the leg is not
    /// in sync.
    pub(crate) regions: Box<[AtomicU8]>,
    /// The persisted state (mirror of the header, for status).
    pub(crate) state: AtomicU8,
    pub(crate) dirty_regions: AtomicU64,
    pub(crate) progress: Progress,
    pub(crate) last_error: Mutex<Option<String>>,
    /// Every write released (`ReplicatedVolume::written`) before this flush epoch is
    /// durable on the leg: the epoch a flush took when it was sent, plus one, once the
    /// leg completed it. Meaningful while the leg receives writes.
    pub(crate) flushed: AtomicU32,
    /// The remote device's [`RemoteDevice::breaks`] when the persister last looked (or
    /// when a resync started): a different count means the connection broke since, and
    /// the leg may have lost what it had not made durable.
    pub(crate) breaks_seen: AtomicU64,
    /// The read lease's view of the leg ([`lease`]).
    pub(crate) lease: lease::LegLease,
}

impl Leg {
    /// A slot with nothing in it: no leg was put there, or its replica was removed.
    fn vacant(nregions: usize) -> Leg {
        Leg {
            desc: RwLock::new(LegDesc::Vacant),
            dev: RwLock::new(LegDev::Remote(None)),
            gen: AtomicU64::new(0),
            regions: (0..nregions).map(|_| AtomicU8::new(DIRTY)).collect(),
            state: AtomicU8::new(LegState::Vacant as u8),
            dirty_regions: AtomicU64::new(0),
            progress: Progress::default(),
            last_error: Mutex::new(None),
            flushed: AtomicU32::new(FIRST_EPOCH),
            breaks_seen: AtomicU64::new(0),
            lease: lease::LegLease::default(),
        }
    }

    pub(crate) fn persisted_state(&self) -> LegState {
        match self.state.load(Acquire) {
            0 => LegState::InSync,
            1 => LegState::OutOfSync,
            2 => LegState::NeedsFull,
            _ => LegState::Vacant,
        }
    }

    pub(crate) fn is_vacant(&self) -> bool {
        self.persisted_state() == LegState::Vacant
    }

    pub(crate) fn desc(&self) -> LegDesc {
        self.desc.read_locked().clone()
    }

    pub(crate) fn place(&self) -> String {
        self.desc.read_locked().place()
    }

    pub(crate) fn is_local(&self) -> bool {
        matches!(*self.desc.read_locked(), LegDesc::Local { .. })
    }

    pub(crate) fn set_error(&self, e: Option<String>) {
        *self.last_error.locked() = e;
    }
}

/// The legs' datapath state in one word, read once per I/O: bit L = leg L in sync (reads
/// and writes), bit 8 + L = leg L resyncing (writes to its clean regions only).
pub(crate) fn in_sync(m: u64) -> u64 {
    m & 0xFF
}
pub(crate) fn resyncing(m: u64) -> u64 {
    (m >> 8) & 0xFF
}

/// The flush epoch a volume starts at: writes of an earlier run (the regions' `written`
/// start at 0) count as durable, what this run writes does not until a flush.
pub(crate) const FIRST_EPOCH: u32 = 1;

/// Whether a write released at flush epoch `written` may not be durable on a leg whose
/// `flushed` is `durable` (epochs wrap: serial-number order, as long as they are less
/// than 2^31 apart; an older one then reads as newer, which only costs a copy).
pub(crate) fn unflushed(written: u32, durable: u32) -> bool {
    written.wrapping_sub(durable) as i32 >= 0
}

/// A volume replicated on several legs; see the crate documentation.
pub struct ReplicatedVolume {
    pub name: String,
    pub uuid: [u8; 16],
    size: u64,
    pub(crate) region_shift: u32,
    pub(crate) regions: Box<[AtomicU32]>,
    /// Per region, the flush epoch when its last write was released (all legs answered):
    /// with `Leg::flushed`, which regions a leg may lose if its node restarts.
    pub(crate) written: Box<[AtomicU32]>,
    /// Taken (and bumped) by every flush as it is sent to the legs.
    pub(crate) flush_epoch: AtomicU32,
    /// [`meta::MAX_LEGS`] slots, so a replica can be added or removed while the datapath
    /// runs (leg numbers, the bits of `masks`, never change); free ones are vacant.
    pub(crate) legs: Vec<Leg>,
    /// Bumped with any leg's `gen`: one load per I/O tells a core whether to reopen.
    pub(crate) legs_gen: AtomicU64,
    pub(crate) masks: AtomicU64,
    pub(crate) tx: Mutex<mpsc::Sender<persist::Req>>,
    /// Index of the local leg, if the owner holds one.
    pub(crate) local: Option<usize>,
    pub(crate) opts: ReplicaOptions,
    pub(crate) cores: Arc<Cores>,
    stats: StatsRegistry,
    pub(crate) closing: AtomicBool,
    path: PathBuf,
    persister: Mutex<Option<std::thread::JoinHandle<()>>>,
    supervisor: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Hot regions (activity log), for status.
    pub(crate) hot_regions: AtomicU64,
    pub(crate) al_writes: AtomicU64,
    /// Bytes per second a resync started from now on copies (0: unlimited).
    pub(crate) resync_rate: AtomicU64,
    /// The cluster's say on dropping a replica (none for a volume outside a cluster).
    fence: RwLock<Option<Arc<dyn LegFence>>>,
    /// The read lease in nanoseconds (0: off, outside a cluster; [`lease`]).
    pub(crate) read_lease: AtomicU64,
    /// Reads are refused now (the lease lapsed): logged once per change.
    pub(crate) reads_refused: AtomicBool,
    pub(crate) read_lease_lapses: AtomicU64,
}

/// Writes of a replicated volume held by [`ReplicatedVolume::quiesce`]; they go on when
/// this is dropped.
pub struct Quiesced<'a> {
    vol: &'a ReplicatedVolume,
}

impl Quiesced<'_> {
    /// The replicas in sync now (they had every acknowledged write): vacant slots and
    /// replicas out of sync or resyncing are left out.
    pub fn in_sync(&self) -> Vec<LegDesc> {
        let m = in_sync(self.vol.masks.load(Acquire));
        self.vol
            .legs
            .iter()
            .enumerate()
            .filter(|(i, l)| m & (1 << i) != 0 && !l.is_vacant())
            .map(|(_, l)| l.desc())
            .collect()
    }
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.vol.send(persist::Req::Resume);
    }
}

/// Why [`LegFence::before_drop`] could not record a dropped replica: the replica stays,
/// and the I/O that failed on it fails.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The node is shutting down: nothing can be recorded any more.
    #[error("the node is stopping")]
    Stopping,
    /// This node no longer owns the volume (another node, or another epoch, does).
    #[error("{0}")]
    Lost(String),
    /// The record could not be made within `wait`; `why` is the last attempt's failure.
    #[error("etcd did not record the dropped replica within {wait:?}: {why}")]
    NotRecorded { wait: Duration, why: String },
}

/// What the owner's cluster layer does around a change of a replica's sync state
/// (docs/format.md §12 rule 4): the persister asks before it drops an in-sync replica,
/// and says when one is in sync again.
pub trait LegFence: Send + Sync {
    /// Record, where another owner would look, that replica `place` of `volume` may lack
    /// writes. An error means the replica must not be dropped (this node no longer owns
    /// the volume, or the record could not be made in time): the I/O that failed on it
    /// fails.
    fn before_drop(&self, volume: &str, place: &str) -> Result<(), FenceError>;
    /// Replica `place` of `volume` is in sync again (already recorded in the replica-set
    /// file). Must not block: it runs on the persister.
    fn after_in_sync(&self, volume: &str, place: &str);
}

impl ReplicatedVolume {
    /// Create the replica-set file for a new volume and open it. `local` is the owner's
    /// own leg's volume (when `desc` has a local leg).
    pub fn create(
        dir: &Path,
        desc: SetDesc,
        size: u64,
        local: Option<Arc<Volume>>,
        opts: ReplicaOptions,
        cores: Arc<Cores>,
    ) -> io::Result<Arc<ReplicatedVolume>> {
        // The local leg starts with the volume's data (empty: just created); remote legs
        // are new thin volumes that read as zeros, so they are in sync too.
        let states = vec![LegState::InSync; desc.legs.len()];
        Self::create_with(dir, desc, states, size, local, opts, cores)
    }

    /// Create the replica-set file with the legs in `states` (a local volume with data
    /// becoming replicated: its new replicas need a full copy) and open it.
    pub fn create_with(
        dir: &Path,
        desc: SetDesc,
        states: Vec<LegState>,
        size: u64,
        local: Option<Arc<Volume>>,
        opts: ReplicaOptions,
        cores: Arc<Cores>,
    ) -> io::Result<Arc<ReplicatedVolume>> {
        fs::create_dir_all(dir)?;
        let path = dir.join(format!("{}.rset", desc.name));
        let m = meta::MetaFile::create(
            &path,
            desc,
            tessera_pool::random_uuid(),
            size,
            opts.region_size,
            opts.al_capacity,
            states,
        )?;
        Self::start(path, m, local, opts, cores)
    }

    /// Open an existing replica set (node start), reconciling after a crash.
    pub fn open(
        path: &Path,
        local: Option<Arc<Volume>>,
        opts: ReplicaOptions,
        cores: Arc<Cores>,
    ) -> io::Result<Arc<ReplicatedVolume>> {
        let m = meta::MetaFile::open(path)?;
        Self::start(path.to_path_buf(), m, local, opts, cores)
    }

    /// The description stored in a replica-set file (to find its local volume first).
    pub fn read_desc(path: &Path) -> io::Result<SetDesc> {
        Ok(meta::MetaFile::open(path)?.header.desc)
    }

    fn start(
        path: PathBuf,
        mut m: meta::MetaFile,
        local: Option<Arc<Volume>>,
        opts: ReplicaOptions,
        cores: Arc<Cores>,
    ) -> io::Result<Arc<ReplicatedVolume>> {
        let h = m.header.clone();
        let local_idx = h
            .desc
            .legs
            .iter()
            .position(|l| matches!(l, LegDesc::Local { .. }));
        if local_idx.is_some() && local.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "replicated volume '{}': its local volume is missing",
                    h.desc.name
                ),
            ));
        }
        // Crash recovery (docs/format.md §11): the regions of the activity log may differ
        // between the legs that were in sync; all but the source catch up from it.
        if h.flags & meta::FLAG_CLEAN == 0 && m.count(0) > 0 {
            let source = persist::source_leg(&h.states, local_idx);
            let hot = m.count(0);
            for l in 0..h.states.len() {
                if Some(l) != source && h.states[l] == LegState::InSync {
                    m.dirty_from_hot(l);
                    m.set_state(l, LegState::OutOfSync);
                }
            }
            warn!(volume = %h.desc.name, hot_regions = hot, source = ?source,
                "replicated volume: the owner stopped uncleanly; the activity log's regions are reconciled from the source leg");
        }
        for r in 0..h.regions {
            m.set_hot(r, false);
        }
        m.set_flags(0);
        m.commit()?;
        let nregions = usize::try_from(h.regions).map_err(|_| io::ErrorKind::InvalidData)?;
        let mut legs = Vec::new();
        let mut mask = 0u64;
        for (i, d) in h.desc.legs.iter().enumerate() {
            let dev = match d {
                LegDesc::Local { .. } => LegDev::Local(local.clone().expect("checked above")),
                LegDesc::Remote { .. } | LegDesc::Vacant => LegDev::Remote(None),
            };
            let st = m.header.states[i];
            let regions: Box<[AtomicU8]> = (0..nregions)
                .map(|r| {
                    let dirty = st == LegState::NeedsFull || meta::bit(&m.dirty[i], r as u64);
                    AtomicU8::new(if dirty { DIRTY } else { CLEAN })
                })
                .collect();
            let dirty_regions = if st == LegState::NeedsFull {
                h.regions
            } else {
                m.count(1 + i)
            };
            legs.push(Leg {
                desc: RwLock::new(d.clone()),
                dev: RwLock::new(dev),
                gen: AtomicU64::new(0),
                regions,
                state: AtomicU8::new(st as u8),
                dirty_regions: AtomicU64::new(dirty_regions),
                progress: Progress::default(),
                last_error: Mutex::new(None),
                flushed: AtomicU32::new(FIRST_EPOCH),
                breaks_seen: AtomicU64::new(0),
                lease: lease::LegLease::default(),
            });
            if st == LegState::InSync && matches!(d, LegDesc::Local { .. }) {
                mask |= 1 << i;
            }
        }
        while legs.len() < meta::MAX_LEGS {
            legs.push(Leg::vacant(nregions));
        }
        // Remote legs in sync on disk are connected before the volume serves: one that
        // cannot be reached is marked out of sync now, so no write ever waits for it.
        for (i, l) in legs.iter().enumerate() {
            if let LegDesc::Remote { spec, .. } = &l.desc() {
                let sent = Instant::now();
                match connect_remote(spec, &opts) {
                    Ok(dev) => {
                        // The peer let this owner connect: the read lease's first answer.
                        l.lease.answered_at(sent);
                        *l.dev.write_locked() = LegDev::Remote(Some(dev));
                        if m.header.states[i] == LegState::InSync {
                            mask |= 1 << i;
                        }
                    }
                    Err(e) => {
                        warn!(volume = %h.desc.name, leg = %l.place(), error = %e,
                            "replicated volume: replica unreachable at open");
                        *l.last_error.locked() = Some(e.to_string());
                        if m.header.states[i] == LegState::InSync {
                            m.set_state(i, LegState::OutOfSync);
                            l.state.store(LegState::OutOfSync as u8, Relaxed);
                        }
                    }
                }
            }
        }
        if mask == 0 {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!(
                    "replicated volume '{}': no replica is both in sync and reachable",
                    h.desc.name
                ),
            ));
        }
        m.commit()?;
        let (tx, rx) = mpsc::channel();
        let rate = opts.resync_rate;
        let vol = Arc::new(ReplicatedVolume {
            name: h.desc.name.clone(),
            uuid: h.uuid,
            size: h.size,
            region_shift: h.region_size.trailing_zeros(),
            regions: (0..nregions).map(|_| AtomicU32::new(0)).collect(),
            written: (0..nregions).map(|_| AtomicU32::new(0)).collect(),
            flush_epoch: AtomicU32::new(FIRST_EPOCH),
            legs,
            legs_gen: AtomicU64::new(0),
            masks: AtomicU64::new(mask),
            tx: Mutex::new(tx),
            local: local_idx,
            opts,
            cores,
            stats: StatsRegistry::default(),
            closing: AtomicBool::new(false),
            path,
            persister: Mutex::new(None),
            supervisor: Mutex::new(None),
            hot_regions: AtomicU64::new(0),
            al_writes: AtomicU64::new(0),
            resync_rate: AtomicU64::new(rate),
            fence: RwLock::new(None),
            read_lease: AtomicU64::new(0),
            reads_refused: AtomicBool::new(false),
            read_lease_lapses: AtomicU64::new(0),
        });
        let w = Arc::downgrade(&vol);
        let t = std::thread::Builder::new()
            .name(format!("rset-{}", vol.name))
            .spawn(move || persist::run(w, m, rx))?;
        *vol.persister.locked() = Some(t);
        let w = Arc::downgrade(&vol);
        let t = std::thread::Builder::new()
            .name(format!("rsup-{}", vol.name))
            .spawn(move || resync::supervise(w))?;
        *vol.supervisor.locked() = Some(t);
        info!(volume = %vol.name, legs = h.desc.legs.len(), region_size = h.region_size,
            "replicated volume open");
        Ok(vol)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bandwidth of resyncs started from now on (bytes per second, 0: unlimited).
    /// Put the volume under a cluster's fence (before it serves).
    pub fn set_leg_fence(&self, f: Arc<dyn LegFence>) {
        *self.fence.write_locked() = Some(f);
    }

    pub(crate) fn leg_fence(&self) -> Option<Arc<dyn LegFence>> {
        self.fence.read_locked().clone()
    }

    /// Each leg's place and whether it is in sync (persisted state), vacant slots left out.
    pub fn leg_sync_states(&self) -> Vec<(String, bool)> {
        self.legs
            .iter()
            .filter(|l| !l.is_vacant())
            .map(|l| (l.place(), l.persisted_state() == LegState::InSync))
            .collect()
    }

    pub fn set_resync_rate(&self, bps: u64) {
        self.resync_rate.store(bps, Relaxed);
    }

    pub fn region_size(&self) -> u64 {
        1 << self.region_shift
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The replicas (vacant slots left out).
    pub fn descs(&self) -> Vec<LegDesc> {
        self.legs
            .iter()
            .filter(|l| !l.is_vacant())
            .map(Leg::desc)
            .collect()
    }

    /// Leg `i`'s device changed: every core reopens its handle before its next I/O.
    pub(crate) fn bump_gen(&self, i: usize) {
        self.legs[i].gen.fetch_add(1, AcqRel);
        self.legs_gen.fetch_add(1, AcqRel);
    }

    /// Add a replica: a new, empty thin volume of another node (format rules in
    /// docs/format.md §11). It starts needing a full copy, which the supervisor runs
    /// (allocated regions only) once the peer answers, while clients keep writing.
    pub fn add_leg(&self, desc: LegDesc) -> io::Result<()> {
        if !matches!(desc, LegDesc::Remote { .. }) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "only a remote replica can be added",
            ));
        }
        let place = desc.place();
        if self.descs().iter().any(|d| d.place() == place) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("volume '{}' already has a replica on {place}", self.name),
            ));
        }
        let (tx, rx) = mpsc::channel();
        self.send(persist::Req::AddLeg { desc, reply: tx });
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the replica set did not answer",
                ))
            })
    }

    /// Remove the replica at `place` (`NODE:POOL`): the datapath stops using it, its slot
    /// is marked vacant on disk, and this node lets go of its connections to it. Returns
    /// what it was. The owner's local replica and the last in-sync one stay.
    pub fn remove_leg(&self, place: &str) -> io::Result<LegDesc> {
        let Some(i) = self
            .legs
            .iter()
            .position(|l| !l.is_vacant() && l.place() == place)
        else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("volume '{}' has no replica on {place}", self.name),
            ));
        };
        let l = &self.legs[i];
        if l.is_local() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{place} is the owner's own replica of '{}': it cannot be removed",
                    self.name
                ),
            ));
        }
        let (tx, rx) = mpsc::channel();
        self.send(persist::Req::RemoveLeg { leg: i, reply: tx });
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the replica set did not answer",
                ))
            })?;
        // A resync of it sees the leg gone and stops; wait (bounded) so that its task no
        // longer uses the core's handle.
        let end = Instant::now() + Duration::from_secs(10);
        while l.progress.running.load(Acquire) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let desc = std::mem::replace(&mut *l.desc.write_locked(), LegDesc::Vacant);
        let old = std::mem::replace(&mut *l.dev.write_locked(), LegDev::Remote(None));
        if let LegDev::Remote(Some(d)) = old {
            d.disconnect();
        }
        self.bump_gen(i);
        // Each core drops its NVMe/TCP queue to the peer now, so that the peer can
        // delete the replica's subsystem.
        let key = handle::core_key(self);
        self.cores.on_each(move |io| handle::refresh_core(io, key));
        info!(volume = %self.name, leg = %place, "replicated volume: replica removed");
        Ok(desc)
    }

    /// Hold every write that starts from now on and wait (at most `timeout`) until none
    /// is in flight on any leg. Until the returned guard is dropped the replicas in sync
    /// ([`Quiesced::in_sync`]) hold the same data and take no write: a snapshot taken on
    /// each of them then is one point in time of the volume. Reads, flushes and resync
    /// copies go on; held writes go on when the guard drops.
    pub fn quiesce(&self, timeout: Duration) -> io::Result<Quiesced<'_>> {
        let (tx, rx) = mpsc::channel();
        self.send(persist::Req::Quiesce { reply: tx });
        let guard = Quiesced { vol: self };
        match rx.recv_timeout(timeout) {
            Ok(()) => Ok(guard),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "volume '{}': the writes in flight did not end within {} ms",
                    self.name,
                    timeout.as_millis()
                ),
            )),
        }
    }

    /// The local leg's volume while it is in sync (it then has the volume's data).
    fn local_in_sync(&self) -> Option<Arc<Volume>> {
        let l = self.local?;
        (in_sync(self.masks.load(Acquire)) & (1 << l) != 0)
            .then(|| self.local_volume())
            .flatten()
    }

    /// The local leg's volume, if the owner holds a replica.
    pub fn local_volume(&self) -> Option<Arc<Volume>> {
        let l = &self.legs[self.local?];
        match &*l.dev.read_locked() {
            LegDev::Local(v) => Some(v.clone()),
            LegDev::Remote(_) => None,
        }
    }

    pub(crate) fn send(&self, r: persist::Req) {
        let tx = self.tx.locked();
        // A closed channel means the set is closing; whoever waits is completed by
        // `persist::run`'s drain (or gets EIO from a dropped `Done`).
        let _ = tx.send(r);
    }

    /// Each leg's state, dirty bytes and resync progress.
    pub fn status(&self) -> Vec<ReplicaInfo> {
        let m = self.masks.load(Acquire);
        let rs = self.region_size();
        self.legs
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_vacant())
            .map(|(i, l)| {
                let connected = match &*l.dev.read_locked() {
                    LegDev::Local(_) => true,
                    LegDev::Remote(d) => d.is_some(),
                };
                let p = &l.progress;
                let running = p.running.load(Relaxed) && resyncing(m) & (1 << i) != 0;
                let state = if in_sync(m) & (1 << i) != 0 {
                    ReplicaState::InSync
                } else if running {
                    ReplicaState::Resyncing
                } else if !connected || l.last_error.lock().map(|e| e.is_some()).unwrap_or(false) {
                    ReplicaState::Failed
                } else {
                    ReplicaState::Degraded
                };
                let dirty = if in_sync(m) & (1 << i) != 0 {
                    0
                } else {
                    (l.dirty_regions.load(Relaxed) * rs).min(self.size)
                };
                let (mut pct, mut rate, mut eta) = (None, None, None);
                if running {
                    let total = p.total.load(Relaxed).max(1);
                    let copied = p.copied.load(Relaxed);
                    pct = Some(100.0 * copied as f64 / total as f64);
                    let secs = p
                        .started
                        .lock()
                        .ok()
                        .and_then(|s| s.map(|t| t.elapsed().as_secs_f64()))
                        .unwrap_or(0.0);
                    if secs > 0.0 {
                        let r = copied as f64 / secs;
                        rate = Some(r);
                        if r > 0.0 {
                            eta = Some(total.saturating_sub(copied) as f64 / r);
                        }
                    }
                }
                let desc = l.desc();
                let volume = match &desc {
                    LegDesc::Local { volume, .. } | LegDesc::Remote { volume, .. } => {
                        volume.clone()
                    }
                    LegDesc::Vacant => String::new(),
                };
                ReplicaInfo {
                    place: desc.place(),
                    volume,
                    state,
                    local: l.is_local(),
                    connected,
                    dirty_bytes: dirty,
                    resync_percent: pct,
                    resync_rate_bytes_per_sec: rate,
                    resync_eta_secs: eta,
                    resync_copied_bytes_total: p.copied_total.load(Relaxed),
                    resync_recopied_bytes_total: p.recopied_total.load(Relaxed),
                    resync_regions_total: p.regions_total.load(Relaxed),
                    last_error: l.last_error.lock().ok().and_then(|e| e.clone()),
                }
            })
            .collect()
    }

    /// Regions in the activity log now, and activity-log writes so far.
    pub fn activity(&self) -> (u64, u64) {
        (self.hot_regions.load(Relaxed), self.al_writes.load(Relaxed))
    }

    /// Stop: no new resync, wait for the persister to write a clean close (when no write
    /// is in flight). Exports must be gone first.
    pub fn close(self: &Arc<Self>) {
        if self.closing.swap(true, SeqCst) {
            return;
        }
        // From now on every I/O fails at once (no leg in the state word), and each core
        // lets go of its leg handles (the local volume's handles, the NVMe/TCP queues).
        let m = self.masks.swap(0, SeqCst);
        let key = handle::core_key(self);
        self.cores.on_each(move |io| handle::release_core(io, key));
        // The persister flushes the remote legs that received writes before it empties
        // the activity log (they could lose what they hold unflushed after a clean
        // close too), so the synchronous queues stay until it answered.
        let (tx, rx) = mpsc::channel();
        self.send(persist::Req::Close {
            legs: in_sync(m) | resyncing(m),
            reply: tx,
        });
        let _ = rx.recv_timeout(Duration::from_secs(30));
        // And the admin and synchronous queues: the peers see the owner go.
        for l in &self.legs {
            let mut d = l.dev.write_locked();
            if let LegDev::Remote(r) = &mut *d {
                if let Some(dev) = r.take() {
                    dev.disconnect();
                }
            }
        }
        for t in [&self.supervisor, &self.persister] {
            if let Some(t) = t.locked().take() {
                let _ = t.join();
            }
        }
    }
}

/// Connect to a remote leg (blocking: setup, off the reactors).
pub(crate) fn connect_remote(spec: &str, opts: &ReplicaOptions) -> io::Result<Arc<RemoteDevice>> {
    let cfg = RemoteConfig {
        timeout: opts.timeout,
        hostnqn: opts.hostnqn.clone(),
        ..RemoteConfig::default()
    };
    RemoteDevice::open_with(RemoteSpec::parse(spec)?, cfg)
}

impl ExportTarget for ReplicatedVolume {
    type Handle = ReplicaHandle;

    fn size(&self) -> u64 {
        self.size
    }

    fn allocated_bytes(&self) -> u64 {
        self.local_volume().map_or(0, |v| v.allocated_bytes())
    }

    fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        match self.local_in_sync() {
            Some(v) => v.allocation_runs(offset, len, max_runs),
            None => vec![(len.min(self.size.saturating_sub(offset)), true)],
        }
    }

    // Snapshots are taken on every replica in sync at one point (`quiesce`), so the
    // local replica's chain, while it is in sync, is the volume's.
    fn change_bases(&self) -> Vec<String> {
        self.local_in_sync()
            .map(|v| v.change_bases())
            .unwrap_or_default()
    }

    fn change_base(&self, name: &str) -> Option<u64> {
        ExportTarget::change_base(&*self.local_in_sync()?, name)
    }

    fn changed_runs(
        &self,
        base: u64,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Option<Vec<(u64, bool)>> {
        ExportTarget::changed_runs(&*self.local_in_sync()?, base, offset, len, max_runs)
    }

    fn register_stats(&self) -> Arc<IoStats> {
        self.stats.register()
    }

    fn unregister_stats(&self, stats: &Arc<IoStats>) {
        self.stats.unregister(stats)
    }

    fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    fn open(self: &Arc<Self>) -> ReplicaHandle {
        ReplicaHandle::new(self.clone())
    }
}

impl Drop for ReplicatedVolume {
    fn drop(&mut self) {
        warn_if_not_closed(self);
    }
}

fn warn_if_not_closed(v: &ReplicatedVolume) {
    if !v.closing.load(Relaxed) {
        warn!(volume = %v.name, "replicated volume dropped without close");
    }
}
