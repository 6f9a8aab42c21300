//! Write-back's cleaner: a thread per tier that copies dirty blocks from the cache to
//! the pool's devices, syncs them, and only then marks them clean and rewrites the
//! slots' records (docs/format.md §16, step 3).
//!
//! How hard it works is the controller's call, on the share of the cache that is dirty:
//! a trickle in the background while little is, more copies in parallel as it fills,
//! everything it has while a mode switch drains the tier. Writes that find no clean slot
//! go to the pool's devices directly, so a cache full of dirty data costs the pool no
//! more than its capacity tier's own speed.
//!
//! A request that waits for a unit's dirty blocks (an overwrite of a dirty block, an
//! unaligned write, a discard: `urgent`) is served by a second thread, the urgent
//! cleaner, which copies only those blocks: its wait is one copy and two syncs, never
//! the rest of a background pass. Background passes are kept short (a few copies per
//! worker) so that a block they claimed is not held long either. The two threads'
//! copies overlap; from clearing dirty bits to the synced records that say so they take
//! turns (`clean_commit`).

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tessera_io::sync::{MutexExt, RwLockExt};

use super::{and, is_empty, minus, span, Blocks, CacheMode, CacheTier, BLOCK_SHIFT};
use crate::layout::Layout;

/// One slot's share of a pass: its dirty blocks claimed by the cleaner.
struct Item {
    key: u64,
    shard: usize,
    local: u32,
    blocks: Blocks,
    ok: bool,
}

/// How a pass runs: parallel copies, blocks at most, and the pause after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Effort {
    pub workers: usize,
    pub blocks: u64,
    pub pause: Duration,
}

/// The controller: the effort for a tier with `dirty` of `capacity` blocks dirty.
///
/// Below a tenth dirty it trickles (like bcache's writeback target): the cache absorbs
/// bursts, and rewrites of hot blocks stay in it. Above, it copies in parallel, and
/// with half the cache dirty (or a drain, or a request waiting) as fast as it can.
pub(crate) fn effort(dirty: u64, capacity: u64, hurry: bool) -> Effort {
    // Blocks a pass gives each worker: a pass (and so the time a block it claimed is
    // held from a waiting request) is a few device latencies long.
    const PER_WORKER: u64 = 32;
    let share = dirty as f64 / capacity.max(1) as f64;
    if hurry || share >= 0.5 {
        Effort {
            workers: 16,
            blocks: 16 * PER_WORKER,
            pause: Duration::ZERO,
        }
    } else if share >= 0.1 {
        Effort {
            workers: 4,
            blocks: 4 * PER_WORKER,
            pause: Duration::ZERO,
        }
    } else {
        Effort {
            workers: 1,
            blocks: 64,
            pause: Duration::from_millis(100),
        }
    }
}

pub(super) fn start(tier: &Arc<CacheTier>, backing: &Arc<Layout>) {
    spawn(tier, backing, "cache-cleaner", cleaner_loop);
    spawn(tier, backing, "cache-urgent", urgent_loop);
}

/// A thread of the tier named `name` running `body`; it holds the tier weakly (it ends
/// when the tier goes) and is joined when the tier stops.
fn spawn(
    tier: &Arc<CacheTier>,
    backing: &Arc<Layout>,
    name: &str,
    body: fn(Weak<CacheTier>, Arc<Layout>),
) {
    let weak = Arc::downgrade(tier);
    let backing = backing.clone();
    let h = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || body(weak, backing))
        .unwrap_or_else(|e| panic!("spawning the cache tier's thread {name}: {e}"));
    tier.threads.locked().push(h);
}

/// The urgent cleaner: whenever a request asks (`ask_clean`), the units it waits for.
/// Blocks a background pass holds are left to it; the request asks again on its retry.
fn urgent_loop(tier: Weak<CacheTier>, backing: Arc<Layout>) {
    loop {
        {
            let Some(t) = tier.upgrade() else { return };
            if t.stop.load(Acquire) {
                return;
            }
            if !t.failed() {
                t.urgent_pass(&backing);
            }
            let (m, cv) = &t.urgent_wake;
            let mut woken = m.locked();
            if !*woken {
                woken = cv
                    .wait_timeout(woken, Duration::from_millis(100))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
            *woken = false;
        }
    }
}

fn cleaner_loop(tier: Weak<CacheTier>, backing: Arc<Layout>) {
    let mut cursor = 0usize;
    loop {
        let pause = {
            let Some(t) = tier.upgrade() else { return };
            if t.stop.load(Acquire) {
                return;
            }
            if t.failed() {
                Some(Duration::from_millis(100))
            } else {
                t.clean_pass(&backing, &mut cursor)
            }
        };
        let Some(pause) = pause else { continue };
        let Some(t) = tier.upgrade() else { return };
        let (m, cv) = &t.wake;
        let mut woken = m.locked();
        if !*woken && !pause.is_zero() {
            woken = cv
                .wait_timeout(woken, pause)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        *woken = false;
    }
}

impl CacheTier {
    /// One pass. Returns the pause before the next (`None`: go on at once).
    fn clean_pass(&self, backing: &Layout, cursor: &mut usize) -> Option<Duration> {
        self.finish_drain();
        self.tidy_records();
        let dirty = self.dirty_blocks.load(Acquire);
        if dirty == 0 {
            return Some(Duration::from_millis(50));
        }
        let hurry = self.draining.load(Relaxed);
        if !hurry && self.cleaner_paused.load(Relaxed) {
            return Some(Duration::from_millis(50));
        }
        // The share that counts is the larger of dirty blocks and dirty slots: scattered
        // small writes fill every slot with a little dirty data, and a slot with any
        // cannot take another unit.
        let capacity = self.geo.slots * self.geo.blocks as u64;
        let by_slots = self.dirty_slots.load(Relaxed) * self.geo.blocks as u64;
        let e = effort(dirty.max(by_slots), capacity, hurry);
        let gate = self.gate.read_locked();
        let mut items = Vec::new();
        let mut taken = 0u64;
        let n = self.shards.len();
        let mut visited = 0usize;
        while taken < e.blocks && visited < n {
            let i = *cursor % n;
            *cursor = cursor.wrapping_add(1);
            visited += 1;
            let mut sh = self.shards[i].locked();
            for s in 0..sh.slots.len() {
                if taken >= e.blocks {
                    break;
                }
                let st = &mut sh.slots[s];
                if st.mapped && !is_empty(st.dirty) {
                    taken += Self::claim_dirty(
                        st,
                        i,
                        u32::try_from(s).expect("fewer than 2^32 slots"),
                        &mut items,
                    );
                }
            }
        }
        if items.is_empty() {
            return Some(Duration::from_millis(1));
        }
        self.clean_items(backing, &mut items, e.workers, gate);
        Some(e.pause)
    }

    /// What requests wait for (`urgent`): only those units' dirty blocks, at once.
    fn urgent_pass(&self, backing: &Layout) {
        let urgent: Vec<u64> = std::mem::take(&mut *self.urgent.locked());
        if urgent.is_empty() {
            return;
        }
        let gate = self.gate.read_locked();
        let mut items = Vec::new();
        for key in urgent {
            let (i, _) = self.shard_of(key);
            let mut sh = self.shards[i].locked();
            if let Some(&s) = sh.slot_of.get(&key) {
                Self::claim_dirty(&mut sh.slots[s as usize], i, s, &mut items);
            }
        }
        if items.is_empty() {
            return;
        }
        let workers = items.len().min(16);
        self.clean_items(backing, &mut items, workers, gate);
    }

    /// Copy `items` (claimed) to the pool's devices with `workers` copies in flight,
    /// sync them, then clear the blocks' dirty bits and rewrite and sync the records of
    /// slots left clean. `gate` (held shared since the claims) goes once the dirty bits
    /// are settled.
    fn clean_items(
        &self,
        backing: &Layout,
        items: &mut [Item],
        workers: usize,
        gate: std::sync::RwLockReadGuard<'_, ()>,
    ) {
        self.copy_out(backing, items, workers);
        let synced = backing.sync();
        if let Err(err) = &synced {
            tracing::error!(error = %err, "syncing the pool's devices after cleaning failed");
        }
        let commit = self.clean_commit.locked();
        let mut rewrite = Vec::new();
        let mut cleaned = 0u64;
        for it in items.iter() {
            let mut sh = self.shards[it.shard].locked();
            let st = &mut sh.slots[it.local as usize];
            st.claimed = minus(st.claimed, it.blocks);
            let good = it.ok && synced.is_ok() && st.mapped && st.key == it.key;
            if good {
                let done = minus(and(st.dirty, it.blocks), st.spoiled);
                let was = !is_empty(st.dirty);
                st.dirty = minus(st.dirty, done);
                if was && is_empty(st.dirty) {
                    self.dirty_slots.fetch_sub(1, Relaxed);
                }
                let c = super::count_of(done);
                cleaned += c;
                self.dirty_blocks.fetch_sub(c, Relaxed);
                if is_empty(st.dirty) {
                    sh.crcs.remove(&it.local);
                    rewrite.push((self.global(it.shard, it.local), it.shard, it.local));
                }
            }
            let st = &mut sh.slots[it.local as usize];
            st.spoiled = minus(st.spoiled, it.blocks);
        }
        self.counters
            .cleaned_bytes
            .fetch_add(cleaned << BLOCK_SHIFT, Relaxed);
        drop(gate);
        self.rewrite_clean(&rewrite);
        drop(commit);
    }

    /// Claim slot `s`'s dirty blocks nobody holds; returns how many.
    fn claim_dirty(st: &mut super::Slot, shard: usize, s: u32, items: &mut Vec<Item>) -> u64 {
        let d = minus(st.dirty, st.claimed);
        if is_empty(d) {
            return 0;
        }
        st.claimed = super::or(st.claimed, d);
        st.spoiled = minus(st.spoiled, d);
        items.push(Item {
            key: st.key,
            shard,
            local: s,
            blocks: d,
            ok: false,
        });
        super::count_of(d)
    }

    /// Copy each item's blocks (in runs) from its slot to the pool's devices, with
    /// `workers` copies in flight.
    fn copy_out(&self, backing: &Layout, items: &mut [Item], workers: usize) {
        let next = AtomicUsize::new(0);
        let results: Vec<std::sync::Mutex<bool>> =
            items.iter().map(|_| std::sync::Mutex::new(false)).collect();
        let items_ro: &[Item] = items;
        std::thread::scope(|sc| {
            for _ in 0..workers.min(items_ro.len()) {
                sc.spawn(|| {
                    // Aligned for O_DIRECT: an unaligned write costs the device a read.
                    let mut buf = tessera_io::buf::AlignedBuf::zeroed(1usize << self.unit_shift);
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(it) = items_ro.get(k) else { break };
                        let ok = self.copy_item(backing, it, buf.as_mut_slice());
                        *results[k].locked() = ok;
                    }
                });
            }
        });
        for (it, r) in items.iter_mut().zip(results) {
            it.ok = r.into_inner().unwrap_or_else(|e| e.into_inner());
        }
    }

    fn copy_item(&self, backing: &Layout, it: &Item, buf: &mut [u8]) -> bool {
        let slot_at = self.slot_offset(it.shard, it.local);
        let pool_at = it.key << self.unit_shift;
        for (b0, b1) in runs(it.blocks, self.geo.blocks as u64) {
            let off = b0 << BLOCK_SHIFT;
            let len = usize::try_from((b1 - b0 + 1) << BLOCK_SHIFT).expect("small");
            if let Err(e) = self.layout.read_at(slot_at + off, &mut buf[..len]) {
                tracing::error!(error = %e, "reading dirty data from the cache failed");
                self.fail();
                return false;
            }
            if let Err(e) = backing.write_at(pool_at + off, &buf[..len]) {
                tracing::error!(error = %e, "writing dirty data to the pool's devices failed; retried later");
                return false;
            }
        }
        true
    }

    /// Rewrite the records of slots that are clean now (`done`: global, shard, local);
    /// evicted slots among them are freed once their record says clean.
    fn rewrite_clean(&self, done: &[(u64, usize, u32)]) {
        if done.is_empty() {
            return;
        }
        let slots: Vec<u64> = done.iter().map(|d| d.0).collect();
        if let Err(e) = self.write_records_of(&slots, true) {
            tracing::error!(error = %e, "rewriting cache records failed");
            self.fail();
            return;
        }
        self.records_clean(done);
        for &(_, i, s) in done {
            let mut sh = self.shards[i].locked();
            let st = &sh.slots[s as usize];
            if st.evicted && st.mapped && is_empty(st.dirty) {
                let key = st.key;
                self.drop_key(&mut sh, key);
                if sh.slots[s as usize].mapped {
                    self.tidy.store(true, Relaxed);
                }
            }
        }
    }

    /// Slots whose record still says dirty though they are clean (written to both tiers
    /// while draining, or dropped): rewrite those records. Evicted slots that are clean
    /// and idle are freed.
    fn tidy_records(&self) {
        if !self.tidy.swap(false, Relaxed) {
            return;
        }
        let _commit = self.clean_commit.locked();
        let mut done = Vec::new();
        let mut again = false;
        for (i, sh) in self.shards.iter().enumerate() {
            let mut sh = sh.locked();
            for s in 0..sh.slots.len() {
                let st = &sh.slots[s];
                let s32 = u32::try_from(s).expect("small");
                if st.durable_dirty != st.dirty && !st.freed {
                    if is_empty(st.claimed) {
                        done.push((self.global(i, s32), i, s32));
                    } else {
                        again = true;
                    }
                } else if st.evicted && st.mapped && is_empty(st.dirty) {
                    if is_empty(st.claimed) && st.pins == 0 {
                        let key = st.key;
                        self.drop_key(&mut sh, key);
                    } else {
                        again = true;
                    }
                }
            }
        }
        if again {
            self.tidy.store(true, Relaxed);
        }
        self.rewrite_clean(&done);
    }

    /// A drain out of write-back is done once nothing is dirty or being written back:
    /// the new mode takes over (pass-through empties the index).
    fn finish_drain(&self) {
        if !self.draining.load(Acquire) {
            return;
        }
        let guards: Vec<_> = self.shards.iter().map(|s| s.locked()).collect();
        if self.wb_inflight.load(Acquire) > 0 || self.dirty_blocks.load(Acquire) > 0 {
            return;
        }
        self.draining.store(false, Release);
        drop(guards);
        tracing::info!(
            mode = self.mode().name(),
            "cache drained: the new mode is in effect"
        );
        if self.mode() == CacheMode::PassThrough {
            self.invalidate_all();
        }
    }
}

/// The runs of consecutive blocks in `m` (of `blocks`).
fn runs(m: Blocks, blocks: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut start = None;
    for b in 0..blocks {
        let set = !is_empty(and(m, span(b, b)));
        match (set, start) {
            (true, None) => start = Some(b),
            (false, Some(a)) => {
                out.push((a, b - 1));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(a) = start {
        out.push((a, blocks - 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_clean_blocks() {
        let m = super::super::or(span(0, 2), span(5, 5));
        assert_eq!(runs(m, 8), vec![(0, 2), (5, 5)]);
        assert_eq!(runs(span(250, 255), 256), vec![(250, 255)]);
    }

    #[test]
    fn the_controller_works_harder_as_the_cache_fills() {
        let low = effort(10, 1000, false);
        let mid = effort(300, 1000, false);
        let high = effort(900, 1000, false);
        assert!(low.workers < mid.workers && mid.workers < high.workers);
        assert!(!low.pause.is_zero() && high.pause.is_zero());
        assert_eq!(effort(1, 1000, true), high);
    }
}
