//! The committer: makes the allocator's records durable (journal records, then
//! checkpoints when the journal fills), syncs devices first and records device failures
//! found while doing so, and answers FLUSH requests from the datapath. Runs on its own
//! thread (`committer_loop`); the control plane calls `commit`/`checkpoint` directly.

use super::{PoolCore, State, COMMIT_INTERVAL, FAILURE_POLL};
use crate::error::{Error, Result};
use crate::format::*;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, MutexGuard};
use tessera_io::sync::MutexExt;
use tessera_io::{RemoteCompleter, Tag};

pub(crate) enum CommitRequest {
    Flush(RemoteCompleter, Tag),
    /// The allocation reserve of a parity pool runs low: commit to top it up.
    Refill,
    Stop,
}

pub(super) struct JournalCursor {
    pub(super) next_seq: u64,
    /// Journal sequence of the newest durable checkpoint.
    pub(super) ckpt_seq: u64,
    pub(super) ckpt_gen: u64,
    pub(super) newest_is_a: bool,
    /// A failed commit may have left the journal in doubt: the next commit checkpoints.
    pub(super) force_checkpoint: bool,
}

impl PoolCore {
    pub(super) fn journal(&self) -> MutexGuard<'_, JournalCursor> {
        self.journal.locked()
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
    pub(super) fn sync_devices(&self, what: &str) -> Result<()> {
        self.layout.sync().map_err(|e| Error::io(what, e))?;
        // Write-back: acknowledged writes whose only copy is on the cache devices (data
        // and slot records) become durable with the pool's own.
        if let Some(t) = self.cache.get() {
            if t.wb_active() && !t.failed() {
                if let Err(e) = t.layout.sync() {
                    t.fail();
                    return Err(Error::io("syncing the cache devices", e));
                }
            }
        }
        self.persist_device_state()
    }

    /// As [`PoolCore::persist_device_state`]; with `always`, the labels are written even
    /// when the durable failed set looks current. A rebuilt device needs that: its label
    /// was cleared when it was put in, and if the device it replaced failed after the last
    /// label write (the commit thread had not recorded it yet), the failed set before and
    /// after the rebuild is the same and nothing would write the new device's label, so
    /// the pool could not open from it alone.
    pub(super) fn write_device_state(&self, always: bool) -> Result<()> {
        let l = &self.layout;
        let mut st = self.dev_state.locked();
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
                // Into the slot of this generation: the other keeps the last one
                // whole if a power loss tears this write (docs/format.md §1).
                match d
                    .write_at(label.slot(), &label.encode())
                    .and_then(|()| d.sync())
                {
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

    /// Make every completed write and every thin-map change so far durable.
    pub fn commit(&self) -> Result<()> {
        self.persist_device_state()?;
        let mut cur = self.journal();
        // Dedup pages before the owner records: every unit a page names was allocated
        // (and recorded) before the page changed, so it is in these records.
        let pages = self.dedup().map(|d| d.take_dirty());
        let (mut records, freed) = {
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
        if records.is_empty() && pages.as_ref().is_some_and(|p| !p.is_empty()) {
            // Pages become valid with a journal block of this commit: there must be one.
            records.push(Record {
                pool_unit: u32::MAX,
                volume_id: OWNER_FREE,
                volume_unit: 0,
            });
        }
        let blocks = records.len().div_ceil(RECORDS_PER_BLOCK) as u64;
        if cur.force_checkpoint
            || cur.next_seq + blocks - cur.ckpt_seq > self.meta.sb.journal_blocks
        {
            // The pages go with the checkpoint, which takes them again.
            if let (Some(d), Some(p)) = (self.dedup(), pages) {
                d.pages_done(p, false);
            }
            // The snapshot taken by the checkpoint contains these records' effects; it
            // makes the reservations durable too (and hands them to the reserve).
            let r = self.checkpoint_locked(&mut cur);
            self.release(freed, r.is_ok());
            return r;
        }
        let gen = cur.next_seq + blocks - 1;
        let r = (|| {
            if let (Some(d), Some(p)) = (self.dedup(), &pages) {
                d.write_batch(p, gen)
                    .map_err(|e| Error::io("writing dedup map and refcount pages", e))?;
            }
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
                self.dedup_pages_done(pages, true);
                Ok(())
            }
            Err(e) => {
                // Keep the changes in memory; the next commit writes a full checkpoint.
                cur.force_checkpoint = true;
                self.dedup_pages_done(pages, false);
                records.retain(|r| r.pool_unit != u32::MAX);
                self.lock().records.splice(0..0, records);
                self.release(freed, false);
                self.reservation_done(false);
                Err(e)
            }
        }
    }

    /// Apply the catalog change `f` and write a checkpoint, with no commit in between
    /// (a commit could otherwise make durable thin-map records that name a layer only
    /// the new catalog knows: a snapshot's volume writing into its new layer), with
    /// `quiesce` run first, outside the pool lock (it may wait for requests in flight,
    /// which may need that lock) and inside the journal lock (no commit, which waits
    /// for requests too, runs meanwhile).
    pub(crate) fn quiesce_change_and_checkpoint<T>(
        &self,
        quiesce: impl FnOnce(),
        f: impl FnOnce(&mut State) -> Result<T>,
    ) -> Result<T> {
        self.change_then_checkpoint(quiesce, f, |_| ())
    }

    /// [`PoolCore::quiesce_change_and_checkpoint`], with `after` run once `f` succeeded,
    /// outside the pool lock and before the checkpoint: the dedup metadata of the
    /// change (whose lock comes before the pool's), so that the checkpoint records both
    /// and no commit makes one durable without the other.
    pub(crate) fn change_then_checkpoint<T>(
        &self,
        quiesce: impl FnOnce(),
        f: impl FnOnce(&mut State) -> Result<T>,
        after: impl FnOnce(&T),
    ) -> Result<T> {
        let mut cur = self.journal();
        quiesce();
        let out = f(&mut self.lock())?;
        after(&out);
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

    pub(super) fn checkpoint_locked(&self, cur: &mut JournalCursor) -> Result<()> {
        self.checkpoint_flags(cur, 0)
    }

    /// A checkpoint with `flags` (`CKPT_FLAG_CLEAN` only from `Pool::shutdown`).
    pub(super) fn checkpoint_flags(&self, cur: &mut JournalCursor, flags: u32) -> Result<()> {
        // Dedup pages first, then the owners (see `commit`).
        let pages = self.dedup().map(|d| d.take_dirty());
        // Snapshot first, sync data second: every unit the snapshot maps was zeroed or
        // written before the snapshot, so the sync covers it.
        let (catalog, owners) = {
            let mut s = self.lock();
            self.top_up_reserve(&mut s);
            s.records.clear();
            let mut catalog = s.catalog();
            if let Some(d) = self.dedup() {
                catalog.dedup = d.active();
                catalog.index_buckets = d.buckets;
            }
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
            if let (Some(d), Some(p)) = (self.dedup(), &pages) {
                // Valid once this checkpoint is the newest (docs/format.md §17).
                d.write_batch(p, journal_seq - 1)
                    .map_err(|e| Error::io("writing dedup map and refcount pages", e))?;
            }
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
                self.dedup_pages_done(pages, true);
                Ok(())
            }
            Err(e) => {
                cur.force_checkpoint = true;
                self.reservation_done(false);
                self.dedup_pages_done(pages, false);
                Err(e)
            }
        }
    }

    /// A commit or checkpoint that wrote `pages` ended. The store blocks it freed are
    /// usable once no request that began before can still reach them (the drain, as
    /// for units in `zero_freed`); where this thread's own core has such requests, they
    /// stay pending for a later commit.
    fn dedup_pages_done(&self, pages: Option<crate::dedup::store::PageBatch>, durable: bool) {
        let (Some(d), Some(p)) = (self.dedup(), pages) else {
            return;
        };
        let freed = d.pages_done(p, durable);
        if !freed.is_empty() {
            let drained = self.inflight.drain(|_| ());
            d.release_free(freed, drained);
        }
    }

    /// Threads waiting now for volume requests in flight to complete (a snapshot being
    /// taken, or units being released): for diagnostics and tests.
    pub fn io_drains_waiting(&self) -> u64 {
        self.inflight.waiting()
    }

    pub(crate) fn request_flush(&self, rc: RemoteCompleter, tag: Tag) {
        let tx = self.commit_tx.locked();
        if tx.send(CommitRequest::Flush(rc.clone(), tag)).is_err() {
            rc.complete(tag, -libc::ESHUTDOWN);
        }
    }
}

pub(super) fn committer_loop(core: Arc<PoolCore>, rx: Receiver<CommitRequest>) {
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
        // The fingerprint index is advisory: its new entries are written after the
        // waiters are answered, off every FLUSH's path.
        if let Some(d) = core.dedup() {
            d.flush_index();
        }
        if stop {
            return;
        }
    }
}
