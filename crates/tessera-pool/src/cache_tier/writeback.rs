//! Write-back (docs/format.md §16, "Write-back ordering"): the plan of a write-back
//! write, the dirty state it leaves and the records that make it durable, units freed
//! with dirty data, the records read back when a tier is reopened, and what a tier that
//! failed with dirty data still lets through.
//!
//! The rules that keep every acknowledged write:
//! - a write-back write claims its whole blocks, writes them to the slot, marks them
//!   dirty with their CRCs (`note_dirty`), has the slot's record written and only then
//!   is acknowledged;
//! - anything else that would change a dirty block or one a write-back write holds (an
//!   unaligned write, a discard, a read the slot cannot serve whole) waits (`Busy`)
//!   while the cleaner cleans the unit first, so the pool's devices never get a change
//!   that a dirty block would later overwrite;
//! - a dirty slot is never given to another unit: the policy may let the unit go, the
//!   slot stays until the cleaner has cleaned it (`evicted`).

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};
use std::sync::Arc;

use tessera_io::sync::{MutexExt, RwLockExt};

use super::records::{self, Record};
use super::{
    and, count_of as count, is_empty, minus, or, span, Blocks, CacheTier, WritePlan, BLOCK_SHIFT,
    NONE,
};
use crate::layout::Layout;

impl CacheTier {
    /// The plan for a write while write-back rules apply (`wb_active`): in write-back,
    /// a write of whole blocks goes to the cache only; while draining, to both tiers
    /// (which leaves the blocks clean). Unaligned writes go to the pool's devices once
    /// no block they touch is dirty or held.
    pub(super) fn plan_write_back(
        &self,
        key: u64,
        touch: (u64, u64),
        full: Option<(u64, u64)>,
        sequential: bool,
    ) -> WritePlan {
        let wb = self.mode() == super::CacheMode::WriteBack;
        let aligned = full == Some(touch);
        let t = span(touch.0, touch.1);
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        let mut slot = sh.slot_of.get(&key).copied();
        if slot.is_some() {
            self.counters.write_hits.fetch_add(1, Relaxed);
        } else {
            self.counters.write_misses.fetch_add(1, Relaxed);
        }
        if slot.is_none() {
            if !aligned || sequential || !wb {
                // Nothing of the unit is cached: the pool's devices take it.
                return WritePlan::Backing;
            }
            // A free slot first, outside the policy's queues (it is freed again once
            // cleaned, like a write buffer's): a burst fills the cache before anything
            // waits for the cleaner. With none free, the policy picks a unit to evict.
            slot = match Self::take_slot(&mut sh) {
                Some(s) => {
                    self.assign_slot(&mut sh, s, key, true);
                    Some(s)
                }
                None => {
                    let outcome = sh.policy.access(key, false);
                    // The policy's victim may be dirty (kept until cleaned): then any
                    // clean, idle slot does, so that the write is not sent to the slow
                    // tier while the cleaner keeps up.
                    self.slot_for(&mut sh, key, outcome)
                        .or_else(|| self.steal_clean(&mut sh, key))
                }
            };
            if slot.is_none() {
                // No clean slot to take (a cache full of dirty data): the pool's
                // devices take the write, at their own speed.
                return WritePlan::Backing;
            }
        }
        let s = slot.expect("set above");
        let st = &mut sh.slots[s as usize];
        if !aligned {
            // The pool's devices may take it only where no record could bring older
            // bytes back over it after a crash.
            if !is_empty(and(t, or(st.durable_dirty, st.claimed))) {
                drop(sh);
                self.ask_clean(key);
                return WritePlan::Busy;
            }
            st.touch(t);
            return WritePlan::Backing;
        }
        if wb && !is_empty(and(t, st.dirty)) {
            // Overwriting dirty bytes in place: if a power loss kept the new bytes but
            // not their record, the old (flushed) ones would be gone from both tiers.
            // The cleaner puts them on the pool's devices first.
            drop(sh);
            self.ask_clean(key);
            return WritePlan::Busy;
        }
        if !st.claim(t) {
            return WritePlan::Busy;
        }
        self.inflight.fetch_add(1, Relaxed);
        if wb {
            self.wb_inflight.fetch_add(1, Relaxed);
            return WritePlan::Back { slot: s };
        }
        st.valid = minus(st.valid, t);
        WritePlan::Both { slot: s }
    }

    /// Write-back, no free slot and the policy's victim was dirty: take a mapped slot
    /// that is clean and idle for unit `key`, outside the policy's queues like a free
    /// slot's (`evicted`: freed once cleaned). The policy may still count the unit it
    /// cached as cached; its next access maps it again. A clock hand bounds the search.
    fn steal_clean(&self, sh: &mut super::Shard, key: u64) -> Option<u32> {
        /// Slots looked at per attempt: a cache full of dirty data costs a write little.
        const LOOK: usize = 64;
        let n = sh.slots.len();
        for k in 0..LOOK.min(n) {
            let s = (sh.hand + k) % n;
            let st = &sh.slots[s];
            if !(st.mapped && st.idle()) {
                continue;
            }
            sh.hand = (s + 1) % n;
            let old = st.key;
            sh.slot_of.remove(&old);
            sh.slots[s].touch(span(0, 255));
            self.counters.evictions.fetch_add(1, Relaxed);
            let s = u32::try_from(s).expect("fewer than 2^32 slots");
            self.assign_slot(sh, s, key, true);
            return Some(s);
        }
        sh.hand = (sh.hand + LOOK) % n.max(1);
        None
    }

    /// A write-back write's bytes are in slot `slot` (of unit `key`): blocks `blocks`,
    /// whose CRCs are `crcs`, are dirty. Returns the slot's global index, whose record is
    /// to be written before the write is acknowledged, or `None` when the unit left the
    /// slot meanwhile (freed: nothing to keep).
    pub(crate) fn note_dirty(
        &self,
        key: u64,
        slot: u32,
        blocks: (u64, u64),
        crcs: &[u32],
    ) -> Option<u64> {
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        let bpu = self.geo.blocks;
        let st = &mut sh.slots[slot as usize];
        if !st.mapped || st.key != key {
            return None;
        }
        let m = minus(span(blocks.0, blocks.1), st.spoiled);
        let new = minus(m, st.dirty);
        if is_empty(st.dirty) && !is_empty(m) {
            self.dirty_slots.fetch_add(1, Relaxed);
        }
        st.dirty = or(st.dirty, m);
        st.durable_dirty = or(st.durable_dirty, m);
        self.dirty_blocks.fetch_add(count(new), Relaxed);
        let c = sh
            .crcs
            .entry(slot)
            .or_insert_with(|| vec![0u32; bpu].into_boxed_slice());
        for (n, b) in (blocks.0..=blocks.1).enumerate() {
            c[usize::try_from(b).expect("small")] = crcs[n];
        }
        Some(self.global(i, slot))
    }

    /// A write-back write ended (its record written, or it failed): its blocks are valid
    /// when `ok` and nothing spoiled them; the claim goes.
    pub(crate) fn end_back(&self, key: u64, slot: u32, blocks: (u64, u64), ok: bool) {
        let (i, _) = self.shard_of(key);
        let mut sh = self.shards[i].locked();
        let st = &mut sh.slots[slot as usize];
        let c = span(blocks.0, blocks.1);
        if ok && st.mapped && st.key == key {
            st.valid = or(st.valid, minus(c, st.spoiled));
        }
        st.claimed = minus(st.claimed, c);
        st.spoiled = minus(st.spoiled, c);
        drop(sh);
        self.wb_inflight.fetch_sub(1, Release);
        self.inflight.fetch_sub(1, Relaxed);
    }

    /// Write-back rules: whether a change of `[offset, offset + len)` that does not go
    /// through the cache (a discard, write-zeroes) must wait, because it touches blocks
    /// that are dirty or being written; the cleaner is asked to clean those units.
    pub(crate) fn holds(&self, offset: u64, len: u64) -> bool {
        let mut keys = Vec::new();
        self.each_unit(offset, len, |st, b0, b1, _| {
            let held = !is_empty(and(span(b0, b1), or(st.durable_dirty, st.claimed)));
            if held {
                keys.push(st.key);
            }
            held
        });
        for k in &keys {
            self.ask_clean(*k);
        }
        !keys.is_empty()
    }

    /// A request waits for unit `key`'s dirty blocks: the urgent cleaner takes it, apart
    /// from the background passes, so the wait is one copy and two syncs.
    pub(crate) fn ask_clean(&self, key: u64) {
        {
            let mut u = self.urgent.locked();
            if !u.contains(&key) {
                u.push(key);
            }
        }
        self.wake_urgent();
    }

    fn wake_urgent(&self) {
        let (m, cv) = &self.urgent_wake;
        *m.locked() = true;
        cv.notify_one();
    }

    pub(crate) fn wake_cleaner(&self) {
        let (m, cv) = &self.wake;
        *m.locked() = true;
        cv.notify_one();
    }

    /// Pool range `[offset, offset + len)` was freed by its volume (TRIM, delete,
    /// rollback): what the cache holds of it is garbage. Dirty slots keep their record
    /// (the free is not durable yet) and are set aside until `release_units`.
    pub(crate) fn unit_freed(&self, offset: u64, len: u64) {
        let shift = self.unit_shift;
        let mut key = offset >> shift;
        while key << shift < offset + len {
            let (i, _) = self.shard_of(key);
            let mut sh = self.shards[i].locked();
            if let Some(&s) = sh.slot_of.get(&key) {
                let st = &mut sh.slots[s as usize];
                st.touch(span(0, 255));
                if !is_empty(st.durable_dirty) {
                    self.dirty_blocks.fetch_sub(st.dirty_blocks(), Relaxed);
                    if !is_empty(st.dirty) {
                        self.dirty_slots.fetch_sub(1, Relaxed);
                    }
                    st.mapped = false;
                    st.freed = true;
                    st.evicted = false;
                    sh.slot_of.remove(&key);
                    sh.freed_of.insert(key, s);
                    sh.free.push(s);
                }
            }
            key += 1;
        }
    }

    /// The commit that freed `units` (pool byte ranges) is durable: their slots'
    /// records are rewritten clean and the cache devices synced before the units can be
    /// allocated again. A cleaner pass in flight is waited for first (`gate`).
    pub(crate) fn release_units(&self, units: &[(u64, u64)]) {
        let _gate = self.gate.write_locked();
        let mut globals = Vec::new();
        let shift = self.unit_shift;
        for &(offset, len) in units {
            let mut key = offset >> shift;
            while key << shift < offset + len {
                let (i, _) = self.shard_of(key);
                let mut sh = self.shards[i].locked();
                if let Some(s) = sh.freed_of.remove(&key) {
                    let st = &mut sh.slots[s as usize];
                    st.freed = false;
                    st.dirty = NONE;
                    sh.crcs.remove(&s);
                    globals.push((self.global(i, s), i, s));
                }
                key += 1;
            }
        }
        if globals.is_empty() {
            return;
        }
        let slots: Vec<u64> = globals.iter().map(|g| g.0).collect();
        match self.write_records_of(&slots, true) {
            Ok(()) => self.records_clean(&globals),
            Err(e) => {
                tracing::error!(error = %e, "clearing the cache records of freed units failed");
                self.fail();
            }
        }
    }

    /// Records of slots `done` (global, shard, local) were written with the state they
    /// had and synced: the durable record has no dirty block that RAM does not (only the
    /// cleaner clears dirty blocks, and it waits for this).
    pub(crate) fn records_clean(&self, done: &[(u64, usize, u32)]) {
        for &(_, i, s) in done {
            let mut sh = self.shards[i].locked();
            let st = &mut sh.slots[s as usize];
            if !st.freed {
                st.durable_dirty = st.dirty;
            }
        }
    }

    /// Encode record `group` of slot `s` (global index) as RAM has it now.
    pub(crate) fn encode_record(&self, s: u64, group: u32, out: &mut [u8]) {
        let n = self.shards.len() as u64;
        let i = usize::try_from(s % n).expect("small");
        let local = u32::try_from(s / n).expect("fewer than 2^32 slots");
        let sh = self.shards[i].locked();
        let Some(st) = sh.slots.get(local as usize) else {
            return;
        };
        let g = group as usize;
        let keep = st.mapped || st.freed;
        let crcs = sh
            .crcs
            .get(&local)
            .map(|c| &c[g * records::GROUP..((g + 1) * records::GROUP).min(c.len())]);
        let r = Record {
            key: st.key,
            group,
            dirty: if keep { st.dirty[g] } else { 0 },
            crcs,
        };
        records::encode(self.epoch, &r, out);
    }

    /// Read the records back (a tier reopened): each dirty block whose bytes match its
    /// CRC becomes valid and dirty, in a slot the cleaner will clean and then free.
    /// `owned(offset)`: whether the pool unit at that byte offset belongs to a volume
    /// (records of free units are stale: their free was durable). Every record block
    /// that said anything is rewritten from RAM and synced before this returns. Returns
    /// the dirty bytes found.
    pub(crate) fn load_records(&self, owned: &dyn Fn(u64) -> bool) -> std::io::Result<u64> {
        let geo = self.geo;
        let n = self.shards.len() as u64;
        let bsize = 1usize << BLOCK_SHIFT;
        let len = usize::try_from(geo.record_blocks()).expect("small") * crate::format::BLOCK;
        let mut area = vec![0u8; len];
        self.layout.read_at(0, &mut area)?;
        // Per slot: its unit and its dirty blocks with their CRCs, from its records.
        let mut said: std::collections::BTreeMap<u64, (u64, Blocks, Vec<u32>, bool)> =
            std::collections::BTreeMap::new();
        for (q, sector) in area.chunks(records::SECTOR).enumerate() {
            let Some((key, group, bits, crcs)) = records::decode(self.epoch, sector) else {
                continue;
            };
            let q = q as u64;
            let s = q / geo.groups;
            if s >= geo.slots || u64::from(group) != q % geo.groups {
                continue;
            }
            let e = said
                .entry(s)
                .or_insert_with(|| (key, NONE, vec![0u32; geo.blocks], true));
            // Records of one slot that name different units: trust none of them.
            e.3 &= e.0 == key;
            let g = group as usize;
            e.1[g] = bits;
            let base = g * records::GROUP;
            for (k, c) in crcs.iter().enumerate() {
                if base + k < geo.blocks {
                    e.2[base + k] = *c;
                }
            }
        }
        // Every record block is rewritten from RAM: with two devices, the other copy may
        // hold records that this one lost.
        let rewrite: std::collections::BTreeSet<u64> = (0..geo.record_blocks()).collect();
        let mut found = 0u64;
        let mut data = vec![0u8; 1usize << self.unit_shift];
        for (s, (key, dirty, crcs, consistent)) in said {
            if !consistent || key % n != s % n || !owned(key << self.unit_shift) {
                continue;
            }
            self.layout
                .read_at(geo.meta_len + (s << self.unit_shift), &mut data)?;
            let mut good = NONE;
            for b in 0..geo.blocks {
                let bit = span(b as u64, b as u64);
                if is_empty(and(dirty, bit)) {
                    continue;
                }
                if crate::format::crc(&data[b * bsize..(b + 1) * bsize]) == crcs[b] {
                    good = or(good, bit);
                }
            }
            if is_empty(good) {
                continue;
            }
            // Two cache devices may have kept different writes: the copy read here,
            // the one whose CRCs were checked, becomes both copies.
            if self.layout.devices.len() > 1 {
                self.layout
                    .write_at(geo.meta_len + (s << self.unit_shift), &data)?;
            }
            let i = usize::try_from(s % n).expect("small");
            let local = u32::try_from(s / n).expect("small");
            let mut sh = self.shards[i].locked();
            if sh.slot_of.contains_key(&key) {
                continue;
            }
            if let Some(p) = sh.free.iter().position(|&f| f == local) {
                sh.free.swap_remove(p);
            }
            sh.slot_of.insert(key, local);
            sh.crcs.insert(local, crcs.into_boxed_slice());
            let st = &mut sh.slots[local as usize];
            st.key = key;
            st.mapped = true;
            st.valid = good;
            st.dirty = good;
            st.durable_dirty = good;
            // Not in the policy's queues: freed once clean.
            st.evicted = true;
            found += count(good);
            self.dirty_slots.fetch_add(1, Relaxed);
        }
        self.dirty_blocks.fetch_add(found, AcqRel);
        self.write_record_blocks(&rewrite)?;
        self.layout.sync()?;
        Ok(found << BLOCK_SHIFT)
    }

    /// A tier that failed with dirty data: whether a request on `[offset, offset + len)`
    /// must fail. Reads fail on a lost block; writes on a lost block they do not cover
    /// whole (the lost bytes of it cannot be merged).
    pub(crate) fn lost_conflict(&self, offset: u64, len: u64, read: bool) -> bool {
        self.each_unit(offset, len, |st, b0, b1, whole| {
            let lost = and(st.dirty, span(b0, b1));
            if read {
                !is_empty(lost)
            } else {
                !is_empty(minus(lost, whole))
            }
        })
    }

    /// A write to a failed tier's lost blocks ended: those it covered whole are the
    /// pool's again.
    pub(crate) fn heal(&self, offset: u64, len: u64) {
        self.each_unit(offset, len, |st, _, _, whole| {
            st.dirty = minus(st.dirty, whole);
            false
        });
    }

    /// Run `f` on the slot of each unit `[offset, offset + len)` touches, with the
    /// blocks touched and those covered whole; true if any call was.
    fn each_unit(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut super::Slot, u64, u64, Blocks) -> bool,
    ) -> bool {
        let end = offset + len.max(1);
        let shift = self.unit_shift;
        let mut key = offset >> shift;
        let mut any = false;
        while key << shift < end {
            let base = key << shift;
            let lo = offset.max(base) - base;
            let hi = end.min(base + (1 << shift)) - base;
            let (b0, b1) = (lo >> BLOCK_SHIFT, (hi - 1) >> BLOCK_SHIFT);
            let w0 = lo.div_ceil(1 << BLOCK_SHIFT);
            let w1 = hi >> BLOCK_SHIFT;
            let whole = if w1 > w0 { span(w0, w1 - 1) } else { NONE };
            let (i, _) = self.shard_of(key);
            let mut sh = self.shards[i].locked();
            if let Some(&s) = sh.slot_of.get(&key) {
                any |= f(&mut sh.slots[s as usize], b0, b1, whole);
            }
            key += 1;
        }
        any
    }

    /// Start the tier's threads: the record writer, and the cleaner over `backing`.
    pub(crate) fn start(self: &Arc<Self>, backing: &Arc<Layout>) {
        self.start_writer();
        super::cleaner::start(self, backing);
    }

    /// Stop the tier's record writer and cleaner and wait for them: when its pool lets
    /// it go, and in tests that image its devices as a killed process leaves them.
    /// Write-back writes on reactors fail from then on.
    pub fn stop_threads(&self) {
        self.stop.store(true, Release);
        self.records_tx.locked().take();
        self.wake_cleaner();
        self.wake_urgent();
        let threads = std::mem::take(&mut *self.threads.locked());
        for h in threads {
            let _ = h.join();
        }
    }

    /// Dirty data was found on reopening a tier whose mode is no longer write-back:
    /// drain it before the mode takes over.
    pub(crate) fn drain_if_dirty(&self) {
        if self.mode() != super::CacheMode::WriteBack && self.has_dirty() {
            self.draining.store(true, Release);
        }
    }

    /// Pause or resume background cleaning (bcache's `writeback_running`): dirty data
    /// stays in the cache meanwhile, except what a drain or a waiting request needs.
    pub fn pause_cleaner(&self, paused: bool) {
        self.cleaner_paused.store(paused, Release);
        self.wake_cleaner();
    }

    /// Dirty bytes now.
    pub fn dirty_bytes(&self) -> u64 {
        self.dirty_blocks.load(Acquire) << BLOCK_SHIFT
    }

    /// Whether write-back left data the pool's devices do not have yet.
    pub fn has_dirty(&self) -> bool {
        self.dirty_blocks.load(Acquire) > 0 || self.wb_inflight.load(Acquire) > 0
    }
}
