//! The unit allocator: free units handed out (zeroed first where the layout needs it),
//! the durable allocation reserve of parity pools, units given back (TRIM, delete) and
//! released only after the I/O in flight to them drains, and the zeroer thread that keeps
//! a reserve of zeroed units. Every change is made under the pool lock (`State`) and
//! recorded for the committer (`committer`).

use super::{CommitRequest, PoolCore, State};
use crate::format::*;
use crate::volume::{UnitMap, Volume, HOLE};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, MutexGuard};
use tessera_io::cast::{u32_of, usize_of};
use tessera_io::sync::{CondvarExt, MutexExt};

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

/// `PoolCore::allocate` for a volume whose chain has data at the unit: the write must
/// take the first-write path (`volume::first_write`). Not an errno.
pub(crate) const NEEDS_REDIRECT: i32 = i32::MIN;

/// `PoolCore::allocate` in a parity pool whose allocation reserve is empty while free
/// units remain: a commit that reserves more is under way; the write retries later (the
/// first-write path's retry), the reactor never waits for it. Not an errno.
pub(crate) const NEEDS_RESERVE: i32 = i32::MIN + 1;

impl PoolCore {
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
            s = self.zero_done.wait_locked(s);
        };
        if zeroed {
            // The reserve was used (or is empty): the zeroer tops it up. The flag, not
            // the notification alone, carries the request: a zeroer that is not waiting
            // yet (its thread not scheduled since the open) or is busy would miss it.
            s.zeroer_wanted = true;
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

    /// A free unit owned from now on by (`owner`, `second`): a dedup pool's store, map,
    /// refcount or index unit (docs/format.md §17). Its old bytes are never read as
    /// data: every page in it validates by CRC, pool uuid, number and generation, and a
    /// store block is read only once a map entry names it, after it was written. Dedup
    /// pools have no parity, so no reserve is involved.
    ///
    /// It is zeroed (on every copy) all the same
    /// - on a mirror, as a first write's partial unit is (`plan_first_write` says why):
    ///   the copies of a free unit may differ (a replacement's old bytes), and the blocks
    ///   not yet written would differ between the copies of an allocated unit, which a
    ///   scrub reports as damage;
    /// - when it is a map or refcount unit, on every layout: a commit that a power loss
    ///   undid may have written pages into this unit under this very owner, with a
    ///   generation the journal has not reached yet, which would become valid once it
    ///   does (a page this owner never rewrites; `DedupCore::open` erases such pages in
    ///   the units it owns). These units are few: one per 256 MiB of a volume, or per
    ///   512 MiB of store.
    pub(crate) fn alloc_owned(&self, owner: u32, second: u32) -> std::result::Result<u32, i32> {
        use crate::dedup::store::{MAP_UNIT, OWNER_REFCOUNT};
        // A map unit is owned by its layer, `second` being `MAP_UNIT | k`.
        let pages = owner == OWNER_REFCOUNT || second & MAP_UNIT != 0;
        let s = self.lock();
        let (mut s, p) = self.take_free(s, pages || self.layout.kind.is_mirror());
        let p = p?;
        s.owners[p as usize] = (owner, second);
        self.uncache_unit(p);
        s.records.push(Record {
            pool_unit: p,
            volume_id: owner,
            volume_unit: second,
        });
        Ok(p)
    }

    /// Ask the commit thread for a commit soon (a dedup pool's freed blocks are waiting
    /// for one while free blocks run low).
    pub(crate) fn request_refill(&self) {
        let _ = self.commit_tx.locked().send(CommitRequest::Refill);
    }

    /// Give unit `p` (owned by something other than a volume's unit map) back, free once
    /// the commit that records it is durable.
    pub(crate) fn free_owned(&self, s: &mut State, p: u32) {
        s.owners[p as usize] = (OWNER_FREE, 0);
        self.cache_unit_freed(p);
        s.pending_free.push(p);
        s.records.push(Record {
            pool_unit: p,
            volume_id: OWNER_FREE,
            volume_unit: 0,
        });
    }

    /// Record pool unit `p` as `vol`'s unit `unit` (a full unit) and publish it.
    pub(super) fn map_allocated(
        &self,
        s: &mut State,
        vol: &Volume,
        map: &crate::volume::UnitMap,
        unit: u64,
        p: u32,
    ) -> u32 {
        s.owners[p as usize] = (vol.layer(), u32_of(unit));
        self.uncache_unit(p);
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
            let tx = self.commit_tx.locked();
            if tx.send(CommitRequest::Refill).is_err() {
                // The commit thread is gone (the pool is closing): nothing will refill.
                return p.ok_or(-libc::ESHUTDOWN);
            }
            s.reserve_wanted = true;
        }
        p.ok_or(NEEDS_RESERVE)
    }

    /// Units a parity pool's allocation reserve holds at most.
    pub(super) fn reserve_target(&self) -> usize {
        let (lo, hi) = ALLOCATION_RESERVE_UNITS;
        usize_of((ALLOCATION_RESERVE_BYTES >> self.unit_shift).clamp(lo, hi))
    }

    /// Parity pools: move free units into the allocation reserve (owner `OWNER_RESERVED`,
    /// a journal record each) until it is full. The new units wait in `reserving`, with
    /// those a failed commit left there, until the commit or checkpoint that this call is
    /// part of (under the journal lock) calls `reservation_done`. They stay counted there
    /// all along: an allocation that finds the reserve empty meanwhile waits for them
    /// (`NEEDS_RESERVE`) instead of failing with ENOSPC, and free space does not dip.
    pub(super) fn top_up_reserve(&self, s: &mut State) {
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
    pub(super) fn reservation_done(&self, durable: bool) {
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

    /// Unit `u` of `map` (pool unit `p`) goes back to the pool: a hole in the map, a free
    /// owner, a record for the next commit, and onto the list of units released once the
    /// commit is durable and the I/O in flight to them has drained (`release`). The one
    /// place this bookkeeping is written (TRIM, volume and snapshot delete, rollback).
    pub(crate) fn free_unit(&self, s: &mut State, map: &UnitMap, u: u64, p: u32) {
        map.set(u, HOLE);
        s.owners[usize_of(u64::from(p))] = (OWNER_FREE, 0);
        self.cache_unit_freed(p);
        s.pending_free.push(p);
        s.partial.remove(&p);
        self.presence.set_full(p);
        s.records.push(Record {
            pool_unit: p,
            volume_id: OWNER_FREE,
            volume_unit: 0,
        });
    }

    /// Give units `[first, last]` of `vol` back to the pool.
    pub(crate) fn unmap_units(&self, vol: &Volume, first: u64, last: u64) {
        let mut s = self.lock();
        let map = vol.current_map();
        // Only mapped units are visited: a discard of a huge sparse range skips the
        // regions without a map leaf.
        let mapped: Vec<(u64, u32)> = map.mapped_in(first, last + 1).collect();
        for (u, p) in mapped {
            self.free_unit(&mut s, &map, u, p);
            vol.allocated.fetch_sub(1, Relaxed);
        }
        if map.has_empty_leaf_in(first, last + 1) {
            vol.compact_wanted.store(true, Relaxed);
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
    pub(super) fn zero_freed(&self, freed: Vec<u32>) -> Vec<u32> {
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

    pub(super) fn release(&self, freed: Vec<u32>, durable: bool) {
        if durable && !freed.is_empty() {
            // Write-back records of freed units go before the units can be reused.
            if let Some(t) = self.cache.get() {
                let unit = self.unit_size();
                let ranges: Vec<(u64, u64)> = freed
                    .iter()
                    .map(|&p| (u64::from(p) << self.unit_shift, unit))
                    .collect();
                t.release_units(&ranges);
            }
        }
        let mut s = self.lock();
        if durable {
            s.free.extend(freed);
        } else {
            s.pending_free.extend(freed);
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
pub(super) fn zeroer_loop(core: Arc<PoolCore>) {
    let unit = core.unit_size();
    let mut s = core.lock();
    loop {
        if s.zeroer_stop {
            return;
        }
        // Sleep until an allocation asks for zeroed units (`State::zeroer_wanted`).
        if !s.zeroer_wanted || s.zeroed.len() >= ZERO_RESERVE || s.free.is_empty() {
            s = core.zero_wanted.wait_locked(s);
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
            s.zeroer_wanted = false;
        }
    }
}
