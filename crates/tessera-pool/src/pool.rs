//! A pool: devices under a layout, a metadata region, the unit allocator, the volumes
//! carved from it, and the commit thread that makes thin-map changes durable.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tessera_api::{DeviceHealth, DeviceState, PoolInfo, PoolState};
use tessera_device::{format_size, BlockDevice};
use tessera_io::{RemoteCompleter, Tag};

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
/// Free units the zeroer keeps zeroed ahead of allocation (non-parity pools; see
/// `zeroer_loop`). Enough to absorb a burst of first writes while it catches up; they
/// stay free (counted as free space), so the reserve costs no capacity.
const ZERO_RESERVE: usize = 32;

/// Bytes of free units a parity pool keeps in its allocation reserve (docs/format.md
/// §3.5): what an unclean open zeroes at most (healthy rows are zeroed with the devices'
/// write-zeroes; rows with a failed device go through the stripe journal, seconds for
/// ~100 MiB on a busy machine). At 1 MiB units, 64 allocations between two commits; a
/// burst of first writes beyond half of it asks for a commit early (one per 32 MiB).
const ALLOCATION_RESERVE_BYTES: u64 = 64 << 20;
/// Bounds on the reserve in units, whatever the unit size.
const ALLOCATION_RESERVE_UNITS: (u64, u64) = (2, 1024);

/// How a new pool is made ([`Pool::create`]).
#[derive(Clone, Copy, Debug)]
pub struct PoolOptions {
    pub layout: LayoutKind,
    pub unit_size: u64,
    /// Overwrite devices that carry another pool's label.
    pub force: bool,
    /// How it behaves while open.
    pub tuning: PoolTuning,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            layout: LayoutKind::Concat,
            unit_size: DEFAULT_UNIT_SIZE,
            force: false,
            tuning: PoolTuning::default(),
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
}

impl Default for PoolTuning {
    fn default() -> Self {
        PoolTuning {
            device_timeout: crate::layout::DEFAULT_DEVICE_TIMEOUT,
            journal_flush: true,
        }
    }
}

pub(crate) enum CommitRequest {
    Flush(RemoteCompleter, Tag),
    /// The allocation reserve of a parity pool runs low: commit to top it up.
    Refill,
    Stop,
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
}

impl State {
    fn catalog(&self) -> Catalog {
        Catalog {
            next_volume_id: self.next_volume_id,
            volumes: self
                .volumes
                .values()
                .map(|v| VolumeRecord {
                    id: v.id,
                    size: v.size(),
                    created: v.created,
                    name: v.name.clone(),
                    qos: v.legacy_qos().unwrap_or_default(),
                    chain: v.chain_record(),
                })
                .collect(),
            exports: self.exports.clone(),
            partial: Vec::new(),
        }
    }
}

struct JournalCursor {
    next_seq: u64,
    /// Journal sequence of the newest durable checkpoint.
    ckpt_seq: u64,
    ckpt_gen: u64,
    newest_is_a: bool,
    /// A failed commit may have left the journal in doubt: the next commit checkpoints.
    force_checkpoint: bool,
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
}

/// `PoolCore::allocate` for a volume whose chain has data at the unit: the write must
/// take the first-write path (`volume::first_write`). Not an errno.
pub(crate) const NEEDS_REDIRECT: i32 = i32::MIN;

/// `PoolCore::allocate` in a parity pool whose allocation reserve is empty while free
/// units remain: a commit that reserves more is under way; the write retries later (the
/// first-write path's retry), the reactor never waits for it. Not an errno.
pub(crate) const NEEDS_RESERVE: i32 = i32::MIN + 1;

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
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn unit_size(&self) -> u64 {
        1 << self.unit_shift
    }

    /// Allocate a unit for (`vol`, `unit`) unless one is already mapped; it reads as
    /// zeroes unless the caller is about to overwrite it whole. Runs on a reactor core,
    /// under the pool lock: this is the slow path taken once per unit.
    ///
    /// A partial first write takes a unit the zeroer has zeroed ahead of time, so the
    /// reactor does not zero a whole unit under the pool lock; only when the reserve has
    /// run dry (a burst faster than the zeroer) does it zero the unit here, as before.
    /// A whole-unit write takes a unit that was not zeroed, leaving the zeroed ones to
    /// partial writes. Parity layouts keep every free unit zeroed (see `zero_freed`):
    /// zeroing here, on a reactor, could wait for a row lock that this very reactor's
    /// in-flight I/O holds (a unit's edge row is shared with the next). They hand out
    /// units of their allocation reserve only (`take_reserved`), so a unit written before
    /// its allocation is committed is zeroed again after a power loss.
    pub(crate) fn allocate(
        &self,
        vol: &Volume,
        unit: u64,
        whole: bool,
    ) -> std::result::Result<u32, i32> {
        let mut s = self.lock();
        if vol.is_deleted() {
            return Err(-libc::ESHUTDOWN);
        }
        let map = vol.current_map();
        let existing = map.get(unit);
        if existing != HOLE {
            return Ok(existing);
        }
        // A snapshot was taken since the caller looked: the chain's data must show
        // through the blocks this write does not cover.
        if vol.parent().is_some() && vol.ancestor_maps().iter().any(|m| m.get(unit) != HOLE) {
            return Err(NEEDS_REDIRECT);
        }
        if self.layout.parity.is_some() {
            let p = self.take_reserved(&mut s)?;
            return Ok(self.map_allocated(&mut s, vol, &map, unit, p));
        }
        let (mut s, p) = self.take_free(s, !whole);
        let p = p?;
        Ok(self.map_allocated(&mut s, vol, &map, unit, p))
    }

    /// A free unit of a pool without parity, for a first write: zeroed on every copy
    /// when `zeroed` (a partial write), else preferably one that was not (a whole-unit
    /// write leaves the zeroer's reserve to partial ones). Takes the zeroer's reserve
    /// first and zeroes the unit here (on the caller's reactor, under the pool lock) only
    /// when the reserve has run dry. Gives the guard back.
    pub(crate) fn take_free<'a>(
        &'a self,
        mut s: MutexGuard<'a, State>,
        zeroed: bool,
    ) -> (MutexGuard<'a, State>, std::result::Result<u32, i32>) {
        let (p, is_zero) = loop {
            let pick = if zeroed {
                s.zeroed.pop_front().map(|p| (p, true))
            } else {
                s.free.pop().map(|p| (p, false))
            };
            let pick = pick.or_else(|| match zeroed {
                false => s.zeroed.pop_back().map(|p| (p, true)),
                true => s.free.pop().map(|p| (p, false)),
            });
            if let Some(pick) = pick {
                break pick;
            }
            if s.zeroing.is_none() {
                return (s, Err(-libc::ENOSPC));
            }
            // The last free unit is being zeroed: it is ours in at most one unit's zeroing.
            s = self.zero_done.wait(s).unwrap_or_else(|e| e.into_inner());
        };
        if zeroed {
            // The reserve was used (or is empty): the zeroer tops it up.
            self.zero_wanted.notify_one();
        }
        if zeroed && !is_zero {
            if let Err(e) = self
                .layout
                .write_zeroes_at((p as u64) << self.unit_shift, self.unit_size())
            {
                s.free.push(p);
                return (s, Err(-e.raw_os_error().unwrap_or(libc::EIO)));
            }
        }
        (s, Ok(p))
    }

    /// Record pool unit `p` as `vol`'s unit `unit` (a full unit) and publish it.
    fn map_allocated(
        &self,
        s: &mut State,
        vol: &Volume,
        map: &crate::volume::UnitMap,
        unit: u64,
        p: u32,
    ) -> u32 {
        s.owners[p as usize] = (vol.layer(), u32_of(unit));
        self.presence.set_full(p);
        s.records.push(Record {
            pool_unit: p,
            volume_id: vol.layer(),
            volume_unit: u32_of(unit),
        });
        map.set(unit, p);
        vol.allocated.fetch_add(1, Relaxed);
        p
    }

    /// A parity pool's next unit for a volume: from the allocation reserve only (its
    /// reservation is durable, so a power loss before this allocation is committed
    /// leaves it reserved, and the next open zeroes it: docs/format.md §3.5). Asks the
    /// commit thread for more when half of the reserve is used; never waits for it.
    pub(crate) fn take_reserved(&self, s: &mut State) -> std::result::Result<u32, i32> {
        let p = s.reserve.pop_front();
        if p.is_none() {
            if s.free.is_empty() && s.reserving.is_empty() && s.rebuild_held.is_none() {
                return Err(-libc::ENOSPC);
            }
            if s.reserve_failed {
                return Err(-libc::EIO);
            }
            if s.committer_stopped {
                return Err(-libc::ESHUTDOWN);
            }
        }
        let low = s.reserve.len() * 2 < self.reserve_target();
        if low && !s.reserve_wanted && !(s.free.is_empty() && s.reserving.is_empty()) {
            let tx = self.commit_tx.lock().unwrap_or_else(|e| e.into_inner());
            if tx.send(CommitRequest::Refill).is_err() {
                // The commit thread is gone (the pool is closing): nothing will refill.
                return p.ok_or(-libc::ESHUTDOWN);
            }
            s.reserve_wanted = true;
        }
        p.ok_or(NEEDS_RESERVE)
    }

    /// Units a parity pool's allocation reserve holds at most.
    fn reserve_target(&self) -> usize {
        let (lo, hi) = ALLOCATION_RESERVE_UNITS;
        usize_of((ALLOCATION_RESERVE_BYTES >> self.unit_shift).clamp(lo, hi))
    }

    /// Parity pools: move free units into the allocation reserve (owner `OWNER_RESERVED`,
    /// a journal record each) until it is full. The new units wait in `reserving`, with
    /// those a failed commit left there, until the commit or checkpoint that this call is
    /// part of (under the journal lock) calls `reservation_done`. They stay counted there
    /// all along: an allocation that finds the reserve empty meanwhile waits for them
    /// (`NEEDS_RESERVE`) instead of failing with ENOSPC, and free space does not dip.
    fn top_up_reserve(&self, s: &mut State) {
        if self.layout.parity.is_none() {
            return;
        }
        s.reserve_wanted = false;
        while s.reserve.len() + s.reserving.len() < self.reserve_target() {
            let Some(p) = s.free.pop() else { break };
            s.owners[p as usize] = (OWNER_RESERVED, 0);
            s.records.push(Record {
                pool_unit: p,
                volume_id: OWNER_RESERVED,
                volume_unit: 0,
            });
            s.reserving.push(p);
        }
    }

    /// The commit or checkpoint that followed `top_up_reserve` made every unit in
    /// `reserving` durably reserved (they join the reserve), or failed (they wait for the
    /// next one, whose records or checkpoint carry them again). Caller holds the journal
    /// lock, so nothing added to `reserving` since that top-up.
    fn reservation_done(&self, durable: bool) {
        if self.layout.parity.is_none() {
            return;
        }
        let mut s = self.lock();
        s.reserve_failed = !durable;
        if durable {
            let reserved = std::mem::take(&mut s.reserving);
            s.reserve.extend(reserved);
        }
    }

    /// Units zeroed so far stop counting as zeroed: called when a rebuild starts, since
    /// a rebuild copies allocated units only and a free unit's zeroes are then missing
    /// on the device being rebuilt. Zeroes written from now on reach that device too.
    pub(crate) fn forget_zeroed(&self) {
        let mut s = self.lock();
        s.zero_epoch += 1;
        let zeroed = std::mem::take(&mut s.zeroed);
        s.free.extend(zeroed.into_iter().rev());
    }

    /// Free units ready for a volume: the free list, the zeroed reserve and the unit
    /// being zeroed.
    pub(crate) fn free_units(s: &State) -> usize {
        s.free.len()
            + s.zeroed.len()
            + usize::from(s.zeroing.is_some())
            + s.reserve.len()
            + s.reserving.len()
            + usize::from(s.rebuild_held.is_some())
    }

    /// Give units `[first, last]` of `vol` back to the pool.
    pub(crate) fn unmap_units(&self, vol: &Volume, first: u64, last: u64) {
        let mut s = self.lock();
        let map = vol.current_map();
        // Only mapped units are visited: a discard of a huge sparse range skips the
        // regions without a map leaf.
        let mapped: Vec<(u64, u32)> = map.mapped_in(first, last + 1).collect();
        for (u, p) in mapped {
            map.set(u, HOLE);
            s.owners[p as usize] = (OWNER_FREE, 0);
            s.pending_free.push(p);
            s.partial.remove(&p);
            self.presence.set_full(p);
            s.records.push(Record {
                pool_unit: p,
                volume_id: OWNER_FREE,
                volume_unit: 0,
            });
            vol.allocated.fetch_sub(1, Relaxed);
        }
        if map.has_empty_leaf_in(first, last + 1) {
            vol.compact_wanted.store(true, Relaxed);
        }
    }

    fn journal(&self) -> MutexGuard<'_, JournalCursor> {
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Record newly failed devices in the labels of the healthy ones (a new state
    /// generation), so a restart never reads a device that missed writes. Runs on the
    /// commit thread (and before every commit), never on a reactor.
    pub fn persist_device_state(&self) -> Result<()> {
        self.write_device_state(false)
    }

    /// Sync the devices, then record any device the sync failed. A redundant layout's
    /// sync succeeds while a copy is left and only marks a copy whose flush failed
    /// failed in memory; until the healthy copies' labels say so, a power loss brings
    /// that copy back as healthy without what its cache lost, to be read (and copied by
    /// the resync) in place of the good one. So whatever counts on a sync (a commit, and
    /// the FLUSH or FUA it answers) waits for the record too.
    fn sync_devices(&self, what: &str) -> Result<()> {
        self.layout.sync().map_err(|e| Error::io(what, e))?;
        self.persist_device_state()
    }

    /// As [`PoolCore::persist_device_state`]; with `always`, the labels are written even
    /// when the durable failed set looks current. A rebuilt device needs that: its label
    /// was cleared when it was put in, and if the device it replaced failed after the last
    /// label write (the commit thread had not recorded it yet), the failed set before and
    /// after the rebuild is the same and nothing would write the new device's label, so
    /// the pool could not open from it alone.
    fn write_device_state(&self, always: bool) -> Result<()> {
        let l = &self.layout;
        let mut st = self.dev_state.lock().unwrap_or_else(|e| e.into_inner());
        // A device being rebuilt stays failed in the labels until its rebuild is done.
        let unreadable = || l.health.failed.load(Relaxed) | l.health.rebuilding.load(Relaxed);
        let mut always = always;
        loop {
            let failed = unreadable();
            if failed == l.health.failed_durable.load(Relaxed) && !always {
                return Ok(());
            }
            always = false;
            let gen = st.0 + 1;
            let mut reasons = [0u8; 64];
            for (i, r) in l.health.fail_reason.iter().enumerate() {
                reasons[i] = r.load(Relaxed);
            }
            let mut written = 0;
            for (i, d) in l.devices.iter().enumerate() {
                if failed & (1 << i) != 0 {
                    continue;
                }
                let label = Label {
                    state_gen: gen,
                    failed,
                    fail_reason: reasons,
                    ..st.1[i].clone()
                };
                match d.write_at(0, &label.encode()).and_then(|()| d.sync()) {
                    Ok(()) => written += 1,
                    Err(_) => l.mark_failed(i, crate::layout::FailReason::Write),
                }
            }
            if written == 0 {
                // No label can say so: the writes waiting for the record would wait
                // forever (and the pool has lost more than it can bear anyway).
                l.health.recorder.store(false, Relaxed);
                return Err(Error::io(
                    "recording failed devices",
                    std::io::Error::from_raw_os_error(libc::EIO),
                ));
            }
            st.0 = gen;
            if unreadable() == failed {
                l.health.failed_durable.store(failed, Relaxed);
                return Ok(());
            }
        }
    }

    /// Units of a parity pool are zeroed before they go back to the free list (the
    /// commit that frees them comes after), so allocation never zeroes on a reactor and a
    /// unit is zero whenever it is free, also after a crash. Units that cannot be zeroed
    /// stay pending. Runs on the commit thread (never a reactor).
    ///
    /// Before anything else, the requests that may still reach the units (they looked a
    /// map up before the units were unmapped) are waited for: a stalled write must not
    /// land after the unit was zeroed or handed to another volume, nor a stalled read
    /// return the next owner's data. Where the caller's own core has such requests (a
    /// test or tool thread driving a private core), the units stay pending.
    fn zero_freed(&self, freed: Vec<u32>) -> Vec<u32> {
        if freed.is_empty() {
            return freed;
        }
        if !self.inflight.drain(|_| ()) {
            self.lock().pending_free.extend(freed);
            return Vec::new();
        }
        if self.layout.parity.is_none() {
            return freed;
        }
        let unit = self.unit_size();
        let (ok, bad): (Vec<u32>, Vec<u32>) = freed.into_iter().partition(|&p| {
            self.layout
                .write_zeroes_at((p as u64) << self.unit_shift, unit)
                .is_ok()
        });
        if !bad.is_empty() {
            self.lock().pending_free.extend(bad);
        }
        ok
    }

    /// Make every completed write and every thin-map change so far durable.
    pub fn commit(&self) -> Result<()> {
        self.persist_device_state()?;
        let mut cur = self.journal();
        let (records, freed) = {
            let mut s = self.lock();
            for v in s.volumes.values() {
                if v.compact_wanted.swap(false, Relaxed) {
                    v.compact_map();
                }
            }
            self.top_up_reserve(&mut s);
            (
                std::mem::take(&mut s.records),
                std::mem::take(&mut s.pending_free),
            )
        };
        let freed = self.zero_freed(freed);
        let blocks = records.len().div_ceil(RECORDS_PER_BLOCK) as u64;
        if cur.force_checkpoint
            || cur.next_seq + blocks - cur.ckpt_seq > self.meta.sb.journal_blocks
        {
            // The snapshot taken by the checkpoint contains these records' effects; it
            // makes the reservations durable too (and hands them to the reserve).
            let r = self.checkpoint_locked(&mut cur);
            self.release(freed, r.is_ok());
            return r;
        }
        let r = (|| {
            self.sync_devices("syncing data devices")?;
            if !records.is_empty() {
                self.meta
                    .write_journal(cur.next_seq, &records)
                    .map_err(|e| Error::io("writing the journal", e))?;
                self.sync_devices("syncing the journal")?;
            }
            Ok(())
        })();
        match r {
            Ok(()) => {
                cur.next_seq += blocks;
                self.release(freed, true);
                self.reservation_done(true);
                Ok(())
            }
            Err(e) => {
                // Keep the changes in memory; the next commit writes a full checkpoint.
                cur.force_checkpoint = true;
                self.lock().records.splice(0..0, records);
                self.release(freed, false);
                self.reservation_done(false);
                Err(e)
            }
        }
    }

    fn release(&self, freed: Vec<u32>, durable: bool) {
        let mut s = self.lock();
        if durable {
            s.free.extend(freed);
        } else {
            s.pending_free.extend(freed);
        }
    }

    /// Apply the catalog change `f` and write a checkpoint, with no commit in between:
    /// a commit could otherwise make durable thin-map records that name a layer only
    /// the new catalog knows (a snapshot's volume writing into its new layer).
    pub(crate) fn change_and_checkpoint<T>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        self.quiesce_change_and_checkpoint(|| (), f)
    }

    /// [`PoolCore::change_and_checkpoint`], with `quiesce` run first, outside the pool
    /// lock (it may wait for requests in flight, which may need that lock) and inside
    /// the journal lock (no commit, which waits for requests too, runs meanwhile).
    pub(crate) fn quiesce_change_and_checkpoint<T>(
        &self,
        quiesce: impl FnOnce(),
        f: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        let mut cur = self.journal();
        quiesce();
        let out = f(&mut self.lock())?;
        let freed = std::mem::take(&mut self.lock().pending_free);
        let freed = self.zero_freed(freed);
        let r = self.checkpoint_locked(&mut cur);
        self.release(freed, r.is_ok());
        r.map(|()| out)
    }

    /// Write a full checkpoint of the current state (after catalog changes).
    pub fn checkpoint(&self) -> Result<()> {
        let mut cur = self.journal();
        let freed = std::mem::take(&mut self.lock().pending_free);
        let freed = self.zero_freed(freed);
        let r = self.checkpoint_locked(&mut cur);
        self.release(freed, r.is_ok());
        r
    }

    fn checkpoint_locked(&self, cur: &mut JournalCursor) -> Result<()> {
        self.checkpoint_flags(cur, 0)
    }

    /// A checkpoint with `flags` (`CKPT_FLAG_CLEAN` only from `Pool::shutdown`).
    fn checkpoint_flags(&self, cur: &mut JournalCursor, flags: u32) -> Result<()> {
        // Snapshot first, sync data second: every unit the snapshot maps was zeroed or
        // written before the snapshot, so the sync covers it.
        let (catalog, owners) = {
            let mut s = self.lock();
            self.top_up_reserve(&mut s);
            s.records.clear();
            let mut catalog = s.catalog();
            catalog.partial = s
                .partial
                .iter()
                .map(|&p| (p, self.presence.bits(p)))
                .collect();
            (catalog.encode()?, s.owners.clone())
        };
        let generation = cur.ckpt_gen + 1;
        let slot_a = !cur.newest_is_a;
        // A full ring ahead: no block of an earlier, possibly unfinished commit can match.
        let journal_seq = cur.next_seq + self.meta.sb.journal_blocks;
        let r = (|| {
            self.sync_devices("syncing data devices")?;
            self.meta
                .write_checkpoint(slot_a, flags, generation, journal_seq, &catalog, &owners)
                .map_err(|e| Error::io("writing a metadata checkpoint", e))?;
            self.sync_devices("syncing a metadata checkpoint")
        })();
        match r {
            Ok(()) => {
                cur.ckpt_gen = generation;
                cur.ckpt_seq = journal_seq;
                cur.next_seq = journal_seq;
                cur.newest_is_a = slot_a;
                cur.force_checkpoint = false;
                self.reservation_done(true);
                Ok(())
            }
            Err(e) => {
                cur.force_checkpoint = true;
                self.reservation_done(false);
                Err(e)
            }
        }
    }

    /// Threads waiting now for volume requests in flight to complete (a snapshot being
    /// taken, or units being released): for diagnostics and tests.
    pub fn io_drains_waiting(&self) -> u64 {
        self.inflight.waiting()
    }

    pub(crate) fn request_flush(&self, rc: RemoteCompleter, tag: Tag) {
        let tx = self.commit_tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.send(CommitRequest::Flush(rc.clone(), tag)).is_err() {
            rc.complete(tag, -libc::ESHUTDOWN);
        }
    }
}

/// Keeps up to `ZERO_RESERVE` free units zeroed for `PoolCore::allocate` (pools without
/// parity, whose free units are not zeroed otherwise). It starts on demand: only the
/// first partial write after an open (or after the reserve ran dry) zeroes on its reactor.
///
/// Crash safety is the allocator's as before: a unit's zeroes are written before its
/// mapping can become durable, because a commit syncs the data devices before it writes
/// the journal records that map the unit. The reserve lives in memory only, so a restart
/// forgets it and nothing on disk claims that a free unit is zeroed.
fn zeroer_loop(core: Arc<PoolCore>) {
    let unit = core.unit_size();
    let mut s = core.lock();
    // Sleep until the first allocation asks for zeroed units.
    let mut wanted = false;
    loop {
        if s.zeroer_stop {
            return;
        }
        if !wanted || s.zeroed.len() >= ZERO_RESERVE || s.free.is_empty() {
            s = core.zero_wanted.wait(s).unwrap_or_else(|e| e.into_inner());
            wanted = true;
            continue;
        }
        let Some(p) = s.free.pop() else { continue };
        s.zeroing = Some(p);
        let epoch = s.zero_epoch;
        drop(s);
        let r = core
            .layout
            .fill_zeroes_at((p as u64) << core.unit_shift, unit);
        s = core.lock();
        s.zeroing = None;
        if r.is_ok() && s.zero_epoch == epoch {
            s.zeroed.push_back(p);
        } else {
            s.free.push(p);
        }
        core.zero_done.notify_all();
        if let Err(e) = r {
            tracing::error!(pool = %core.name, error = %e, "zeroing a free unit failed");
            // Leave it to the allocator (which reports the error to its client) until
            // the next allocation asks again.
            wanted = false;
        }
    }
}

fn committer_loop(core: Arc<PoolCore>, rx: Receiver<CommitRequest>) {
    core.layout.health.recorder.store(true, Relaxed);
    commit_requests(&core, &rx);
    // Nobody records failures any more: parity writes must not wait for it.
    core.layout.health.recorder.store(false, Relaxed);
    // A write waiting for the allocation reserve must not wait for this thread any more.
    core.lock().committer_stopped = true;
}

fn commit_requests(core: &PoolCore, rx: &Receiver<CommitRequest>) {
    let mut last = std::time::Instant::now();
    loop {
        // Mirrors: a device failure is recorded within FAILURE_POLL (and before any
        // FLUSH is answered, since every commit records it first and after each sync).
        let wait = if core.layout.kind.is_redundant() {
            FAILURE_POLL
        } else {
            COMMIT_INTERVAL
        };
        let first = match rx.recv_timeout(wait) {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Timeout) => {
                let l = &core.layout;
                if l.health.failed.load(Relaxed) != l.health.failed_durable.load(Relaxed) {
                    if let Err(e) = core.persist_device_state() {
                        tracing::error!(pool = %core.name, error = %e, "cannot record the device states");
                    }
                }
                if last.elapsed() < COMMIT_INTERVAL {
                    continue;
                }
                None
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        last = std::time::Instant::now();
        // Group commit: everything queued now rides on one commit.
        let mut waiters = Vec::new();
        let mut stop = false;
        for r in first.into_iter().chain(rx.try_iter()) {
            match r {
                CommitRequest::Flush(rc, tag) => waiters.push((rc, tag)),
                CommitRequest::Refill => {}
                CommitRequest::Stop => stop = true,
            }
        }
        let res = match core.commit() {
            Ok(()) => 0,
            Err(e) => {
                tracing::error!(pool = %core.name, error = %e, "commit failed");
                -libc::EIO
            }
        };
        for (rc, tag) in waiters {
            rc.complete(tag, res);
        }
        if stop {
            return;
        }
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
                let mut b = vec![0u8; BLOCK];
                if d.read_at(0, &mut b).is_ok() {
                    if let Ok(Some(l)) = Label::decode(&b) {
                        return Err(Error::new(
                            ErrorKind::AlreadyExists,
                            format!("device {} already belongs to pool '{}' (uuid {}); destroy that pool first, or pass --force to overwrite it", d.describe(), l.pool_name, uuid_string(&l.uuid)),
                        ));
                    }
                }
            }
        }
        let layout = Arc::new(Layout::new(opts.layout, devices).map_err(Error::invalid)?);
        layout.apply_tuning(&opts.tuning);
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
            d.write_at(0, &label.encode())
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
        let mut partial: BTreeMap<u32, [u8; PRESENCE_BYTES]> =
            std::mem::take(&mut catalog.partial).into_iter().collect();
        let next_seq = meta.replay(ck.header.journal_seq, |r| {
            crate::presence::replay_presence(&mut partial, &r);
            if (r.pool_unit as usize) < total && r.volume_id != PRESENCE_RECORD {
                owners[r.pool_unit as usize] = (r.volume_id, r.volume_unit);
            }
        })?;
        catalog.partial = partial.into_iter().collect();
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
        // Fold the replayed journal into a fresh checkpoint (and skip a journal lap).
        // It has no clean flag: until the next clean shutdown the pool counts as open.
        pool.core.checkpoint()?;
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
            let mut b = vec![0u8; BLOCK];
            let l = d
                .read_at(0, &mut b)
                .map_err(|e| Error::io(&format!("reading the label of {}", d.describe()), e))
                .and_then(|()| {
                    Label::decode(&b)
                        .map_err(|e| Error::corrupt(format!("{}: {e}", d.describe())))?
                        .ok_or_else(|| {
                            Error::corrupt(format!("{} carries no Tessera label", d.describe()))
                        })
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
        let layout = Arc::new(Layout::new(kind, devices).map_err(Error::corrupt)?);
        layout.apply_tuning(&tuning);
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
                zeroed: VecDeque::new(),
                zeroing: None,
                zero_epoch: 0,
                zeroer_stop: false,
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

    /// The pool as the API shows it. What the pool does not know is left empty for the
    /// node to fill in: `spares`, `rebuild`, `resync`.
    pub fn status(&self) -> PoolInfo {
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
            resync: None,
        }
    }

    /// Volumes, snapshots and clones (hidden snapshots left out).
    pub fn volumes(&self) -> Vec<Arc<Volume>> {
        self.core
            .lock()
            .volumes
            .values()
            .filter(|v| !v.is_hidden())
            .cloned()
            .collect()
    }

    pub fn volume(&self, name: &str) -> Option<Arc<Volume>> {
        self.core
            .lock()
            .volumes
            .values()
            .find(|v| v.name == name && !v.is_hidden())
            .cloned()
    }

    pub fn volume_by_id(&self, id: u32) -> Option<Arc<Volume>> {
        self.core.lock().volumes.get(&id).cloned()
    }

    /// The overcommit ratio in force (see [`DEFAULT_OVERCOMMIT`]).
    pub fn overcommit(&self) -> f64 {
        f64::from_bits(self.core.overcommit.load(Relaxed))
    }

    /// Set the overcommit ratio (the node keeps it in its registry). Volumes already
    /// beyond a lowered ratio stay; only new volumes and growth are checked.
    pub fn set_overcommit(&self, ratio: f64) -> Result<()> {
        validate_overcommit(ratio)?;
        self.core.overcommit.store(ratio.to_bits(), Relaxed);
        Ok(())
    }

    /// Refuse to bring the volumes' virtual sizes, now `provisioned`, to `provisioned +
    /// more` if that exceeds the overcommit ratio, unless `force`.
    pub(crate) fn check_overcommit(
        &self,
        s: &State,
        what: &str,
        more: u64,
        force: bool,
    ) -> Result<()> {
        let ratio = self.overcommit();
        let sb = &self.core.meta.sb;
        let capacity = (sb.total_units - sb.meta_units) * self.core.unit_size();
        let total = provisioned(s).saturating_add(more);
        let limit = ratio * capacity as f64;
        if force || total as f64 <= limit {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "{what} would bring the volumes of pool '{}' to {} ({total} bytes) on {} of \
                 capacity ({capacity} bytes), {:.1}x; the pool allows {ratio}x ({}); use \
                 --force (API: \"force\": true) to overcommit anyway, or raise the ratio \
                 (`pool update {} --overcommit N`)",
                self.core.name,
                human_bytes(total),
                human_bytes(capacity),
                total as f64 / capacity.max(1) as f64,
                human_bytes(saturating_bytes(limit)),
                self.core.name,
            ),
        ))
    }

    /// Create a thin volume of `size` bytes (a multiple of 512). No space is taken yet.
    /// Refused beyond the pool's overcommit ratio.
    pub fn create_volume(&self, name: &str, size: u64) -> Result<Arc<Volume>> {
        self.create_volume_opts(name, size, false)
    }

    /// [`Pool::create_volume`]; `force` creates it beyond the overcommit ratio.
    pub fn create_volume_opts(&self, name: &str, size: u64, force: bool) -> Result<Arc<Volume>> {
        validate_name("volume", name)?;
        validate_volume_size(size, self.core.unit_size())?;
        let vol = {
            let mut s = self.core.lock();
            if s.volumes.values().any(|v| v.name == name && !v.is_hidden()) {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("volume '{name}' already exists"),
                ));
            }
            self.check_overcommit(
                &s,
                &format!("volume '{name}' of {}", human_bytes(size)),
                size,
                force,
            )?;
            let id = s.next_volume_id;
            s.next_volume_id += 1;
            let vol = Volume::new(
                self.core.clone(),
                id,
                name.to_string(),
                size,
                now_secs(),
                UnitMap::new(size.div_ceil(self.core.unit_size())),
                Default::default(),
            );
            s.volumes.insert(id, vol.clone());
            vol
        };
        if let Err(e) = self.core.checkpoint() {
            self.core.lock().volumes.remove(&vol.id);
            return Err(e);
        }
        Ok(vol)
    }

    /// Grow a volume. Shrinking is refused: it would silently drop data. Growing beyond
    /// the pool's overcommit ratio is refused.
    pub fn resize_volume(&self, vol: &Arc<Volume>, new_size: u64) -> Result<()> {
        self.resize_volume_opts(vol, new_size, false)
    }

    /// [`Pool::resize_volume`]; `force` grows it beyond the overcommit ratio.
    pub fn resize_volume_opts(&self, vol: &Arc<Volume>, new_size: u64, force: bool) -> Result<()> {
        validate_volume_size(new_size, self.core.unit_size())?;
        if vol.is_snapshot() {
            return Err(Error::invalid(format!(
                "'{}' is a snapshot: its size is the volume's when it was taken",
                vol.name
            )));
        }
        let old = vol.size();
        if new_size < old {
            return Err(Error::invalid(format!(
                "volume '{}' is {old} bytes; shrinking to {new_size} is not supported",
                vol.name
            )));
        }
        if new_size == old {
            return Ok(());
        }
        {
            let s = self.core.lock();
            self.check_overcommit(
                &s,
                &format!("growing volume '{}' to {}", vol.name, human_bytes(new_size)),
                new_size - old,
                force,
            )?;
            vol.grow(new_size, new_size.div_ceil(self.core.unit_size()));
        }
        self.core.checkpoint()
    }

    /// Delete a volume and give all its space back. Refused while clients hold it open.
    pub fn delete_volume(&self, vol: &Arc<Volume>) -> Result<()> {
        let open = vol.open_handles();
        if open > 0 {
            return Err(Error::new(
                ErrorKind::Busy,
                format!("volume '{}' is busy: {open} open connection(s)", vol.name),
            ));
        }
        {
            let mut s = self.core.lock();
            if let Some(e) = s.exports.iter().find(|e| e.volume_id == vol.id) {
                return Err(Error::new(
                    ErrorKind::Busy,
                    format!(
                        "volume '{}' is exported as '{}'; remove the export first",
                        vol.name, e.name
                    ),
                ));
            }
            // A snapshot that other volumes read through is hidden, not removed; a
            // volume's removal may free hidden snapshots it was the last reader of.
            self.delete_in_chain(&mut s, vol);
        }
        self.core.checkpoint()
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
        self.core.layout.start_rebuild(d).map_err(Error::invalid)?;
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

    pub fn exports(&self) -> Vec<ExportRecord> {
        self.core.lock().exports.clone()
    }

    pub fn add_export(&self, e: ExportRecord) -> Result<()> {
        validate_name("export", &e.name)?;
        {
            let mut s = self.core.lock();
            if !s.volumes.contains_key(&e.volume_id) {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    "volume not found in this pool",
                ));
            }
            s.exports.push(e.clone());
        }
        if let Err(err) = self.core.checkpoint() {
            self.core.lock().exports.retain(|x| x.name != e.name);
            return Err(err);
        }
        Ok(())
    }

    pub fn remove_export(&self, name: &str) -> Result<()> {
        self.core.lock().exports.retain(|x| x.name != name);
        self.core.checkpoint()
    }

    /// Commit now (used by tests and at shutdown).
    pub fn commit(&self) -> Result<()> {
        self.core.commit()
    }

    /// Stop the zeroer and wait for it: once a pool is closed, nothing of it may write
    /// to its devices (they may be reopened at once, by this process too).
    fn stop_zeroer(&self) {
        self.core.lock().zeroer_stop = true;
        self.core.zero_wanted.notify_all();
        if let Some(h) = self.zeroer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Final commit; stop the commit and zeroing threads.
    pub fn shutdown(&self) -> Result<()> {
        self.stop_zeroer();
        let _ = self
            .core
            .commit_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(CommitRequest::Stop);
        if let Some(h) = self
            .committer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = h.join();
        }
        self.core.commit()?;
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
        let _ = self
            .core
            .commit_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(CommitRequest::Stop);
        // Break the volume → pool reference cycle.
        self.core.lock().volumes.clear();
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

/// A byte count computed in floating point (a ratio of a capacity), saturated into u64.
#[allow(clippy::cast_possible_truncation)] // `as` saturates; the fraction of a byte goes
fn saturating_bytes(x: f64) -> u64 {
    x as u64
}

/// Names are what users type on command lines and in NBD URIs: keep them plain.
pub fn validate_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!("bad {what} name '{name}': use 1-64 characters from A-Z a-z 0-9 - _ . (not starting with '.')")))
    }
}

/// Sum of the virtual sizes of the pool's volumes (snapshots promise no new space: they
/// only keep what their volume had).
fn provisioned(s: &State) -> u64 {
    s.volumes
        .values()
        .filter(|v| !v.is_snapshot())
        .map(|v| v.size())
        .sum()
}

pub fn validate_overcommit(ratio: f64) -> Result<()> {
    if ratio.is_finite() && ratio > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "overcommit ratio {ratio} must be a number above 0 (e.g. 1 for none, 20)"
        )))
    }
}

/// Bytes in binary units for messages ("4.0 GiB"; exact below 1 KiB).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", UNITS[i])
}

fn validate_volume_size(size: u64, unit: u64) -> Result<()> {
    if size == 0 || !size.is_multiple_of(512) {
        return Err(Error::invalid(format!(
            "volume size {size} must be a non-zero multiple of 512 bytes"
        )));
    }
    if size.div_ceil(unit) >= u32::MAX as u64 {
        return Err(Error::invalid(
            "volume too large for this pool's allocation unit",
        ));
    }
    Ok(())
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
