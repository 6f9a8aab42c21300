//! The metadata half of a first write into a unit that a snapshot chain has data for,
//! taken under the pool lock (docs/format.md §3.4): which blocks the writer's partial
//! unit already holds, which the write claims, and what to read from the chain; and
//! TRIM in a chain. The data half is the per-core datapath (`volume::first_write`).

use crate::format::Record;
use crate::pool::{PoolCore, State};
use crate::presence::{presence_record, PARTIAL_MAX};
use crate::volume::{UnitMap, Volume, HOLE};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use tessera_io::cast::u32_of;

/// One run of blocks of a first write into a shared unit (`PoolCore::plan_first_write`):
/// blocks `[first, last]`, all present in the writer's unit or all absent (still the
/// parent's, claimed by this write until it completes).
pub(crate) struct BlockRun {
    pub first: u32,
    pub last: u32,
    pub present: bool,
    /// Absent runs that the write does not cover whole: the whole run is written from
    /// this buffer (the chain's blocks read into it, the write's bytes copied over).
    pub buf: Option<tessera_io::AlignedBuf>,
}

/// A read from the chain into an absent run's buffer: blocks `[first, first + count)`
/// of the run's unit, from pool unit `src` (or zeros when `src` is [`HOLE`]).
#[derive(Clone, Copy)]
pub(crate) struct ChainRead {
    pub run: u32,
    pub first: u32,
    pub count: u32,
    pub src: u32,
}

/// What `PoolCore::plan_first_write` decided.
pub(crate) enum FirstWritePlan {
    /// Refused: -errno.
    Fail(i32),
    /// A block it needs is being written by another first write (on any core): retry
    /// in the next round.
    Busy,
    /// The chain has nothing at this unit: a plain unit `p` was allocated (zeroed unless
    /// written whole), written like any other.
    Plain(u32),
    /// Partial unit `p` of layer `layer`: `runs` and `reads` say what to do.
    Partial { p: u32, layer: u32 },
}

impl PoolCore {
    /// Unit `u`'s data in some ancestor of the chain `chain` (nearest first)?
    fn chain_has(chain: &[Arc<UnitMap>], u: u64) -> bool {
        chain.iter().any(|m| m.get(u) != HOLE)
    }

    /// Whether block `b` of pool unit `p` is claimed by a first write in flight.
    fn claimed(s: &State, p: u32, b: u32) -> bool {
        s.copying
            .get(&p)
            .is_some_and(|w| w[(b / 64) as usize] & (1 << (b % 64)) != 0)
    }

    /// The metadata half of a write of `len` bytes at volume offset `at` inside unit
    /// `unit` of a volume in a chain, where the fast path could not take it (the unit
    /// has no space of its own yet, or some block it touches is still the parent's).
    /// Under the pool lock and without any data I/O (but a mirror's zeroing of the new
    /// unit when the zeroer's reserve has run dry, as `allocate` does): allocates the
    /// unit (partial; zeroed on mirrors only) if needed, splits the blocks the write touches into `runs`, claims the
    /// absent ones, and lists in `reads` where the parts of absent blocks the write does
    /// not cover come from. The data is then written through the per-core datapath
    /// (`volume::first_write`), and `finish_first_write` marks the blocks present once it is on
    /// the devices. A block another first write has claimed makes this `Busy`: its
    /// contents are not settled until that write completes (two writers each merging
    /// the parent's block with their own bytes would lose one of them). So does a write
    /// whose request (token `epoch`) began after a snapshot of the volume did, until the
    /// snapshot has taken the map (`create_snapshots`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan_first_write(
        &self,
        vol: &Volume,
        epoch: u64,
        unit: u64,
        at: u64,
        len: u64,
        runs: &mut Vec<BlockRun>,
        reads: &mut Vec<ChainRead>,
    ) -> FirstWritePlan {
        if vol.is_snapshot() {
            return FirstWritePlan::Fail(-libc::EROFS);
        }
        if vol.held(epoch) {
            return FirstWritePlan::Busy;
        }
        let mut s = self.lock();
        if vol.is_deleted() {
            return FirstWritePlan::Fail(-libc::ESHUTDOWN);
        }
        let map = vol.current_map();
        let chain = vol.ancestor_maps();
        let unit_size = self.unit_size();
        let within = at - (unit << self.unit_shift);
        let mut p = map.get(unit);
        if p == HOLE {
            if !Self::chain_has(&chain, unit) {
                // Nothing to share here: a plain unit, zeroed unless written whole.
                drop(s);
                return match self.allocate(vol, unit, len == unit_size) {
                    Ok(p) => FirstWritePlan::Plain(p),
                    // A snapshot came in between, or a parity pool's allocation reserve
                    // is being topped up: plan again.
                    Err(crate::pool::NEEDS_REDIRECT | crate::pool::NEEDS_RESERVE) => {
                        FirstWritePlan::Busy
                    }
                    Err(e) => FirstWritePlan::Fail(e),
                };
            }
            // Its absent blocks are never read (§3.4). A parity pool's unit comes from
            // its reserve (zero on every device): after a power loss before this
            // allocation is committed, the unit must not go back to the free list with
            // data in it.
            //
            // A mirror's unit is zeroed on every copy, as a plain partial first write's is
            // (`PoolCore::allocate`): the copies of a free unit need not be equal (a
            // replacement's old bytes, which a rebuild does not copy over free units; a
            // write that reached one copy of a unit whose allocation a power loss undid,
            // which the resync after an unclean open does not cover), and the absent
            // blocks of an allocated unit would otherwise differ between copies, which a
            // scrub reports and a scrub repair or rebuild copies either way. Zeroing here
            // is the cheapest way to make them equal: one unit's write-zeroes per
            // allocation, mostly taken from the zeroer's reserve (off the reactor), where
            // making free units equal would cost a copy or zero-fill of all free space at
            // every rebuild and every unclean open. Concat and raid0 keep one copy whose
            // absent blocks are never read: nothing to zero.
            p = if self.layout.parity.is_some() {
                match self.take_reserved(&mut s) {
                    Ok(q) => q,
                    Err(crate::pool::NEEDS_RESERVE) => return FirstWritePlan::Busy,
                    Err(e) => return FirstWritePlan::Fail(e),
                }
            } else if self.layout.kind.is_mirror() {
                let (g, q) = self.take_free(s, true);
                s = g;
                let q = match q {
                    Ok(q) => q,
                    Err(e) => return FirstWritePlan::Fail(e),
                };
                // `take_free` may have waited for the zeroer (the lock released): plan
                // again if the volume or its unit changed meanwhile.
                if vol.is_deleted() || map.get(unit) != HOLE {
                    s.free.push(q);
                    return FirstWritePlan::Busy;
                }
                q
            } else {
                let Some(q) = s.free.pop().or_else(|| s.zeroed.pop_back()) else {
                    return FirstWritePlan::Fail(-libc::ENOSPC);
                };
                q
            };
            // The presence marker first: a replay never takes this unit as full.
            s.records.push(presence_record(p, 0, 0));
            s.records.push(Record {
                pool_unit: p,
                volume_id: vol.layer(),
                volume_unit: u32_of(unit),
            });
            self.presence.make_partial(p);
            s.partial.insert(p);
            s.owners[p as usize] = (vol.layer(), u32_of(unit));
            self.uncache_unit(p);
            map.set(unit, p);
            vol.allocated.fetch_add(1, Relaxed);
        }
        let bshift = self.presence.block_shift;
        let bsize = 1u64 << bshift;
        let (mut b0, mut b1) = (
            u32_of(within >> bshift),
            u32_of((within + len - 1) >> bshift),
        );
        if s.partial.len() > PARTIAL_MAX && !self.presence.is_full(p) {
            // Too many partial units for the catalog: make this one whole now.
            (b0, b1) = (0, self.presence.blocks - 1);
        }
        let write_end = within + len;
        runs.clear();
        reads.clear();
        let mut b = b0;
        while b <= b1 {
            let present = self.presence.present(p, b);
            let mut e = b;
            while e < b1 && self.presence.present(p, e + 1) == present {
                e += 1;
            }
            if !present {
                let run = u32_of(runs.len());
                for blk in b..=e {
                    if Self::claimed(&s, p, blk) {
                        return FirstWritePlan::Busy;
                    }
                    let bs = (blk as u64) << bshift;
                    if bs >= within && bs + bsize <= write_end {
                        continue;
                    }
                    // Partly written or not at all: the rest comes from the chain.
                    let mut src = HOLE;
                    for m in &chain {
                        let q = m.get(unit);
                        if q == HOLE {
                            continue;
                        }
                        // An ancestor's block still being written (a snapshot took the
                        // unit while a first write into it was in flight).
                        if Self::claimed(&s, q, blk) {
                            return FirstWritePlan::Busy;
                        }
                        if self.presence.present(q, blk) {
                            src = q;
                            break;
                        }
                    }
                    match reads.last_mut() {
                        Some(r) if r.run == run && r.first + r.count == blk && (r.src == src) => {
                            r.count += 1
                        }
                        _ => reads.push(ChainRead {
                            run,
                            first: blk,
                            count: 1,
                            src,
                        }),
                    }
                }
            }
            runs.push(BlockRun {
                first: b,
                last: e,
                present,
                buf: None,
            });
            b = e + 1;
        }
        // Claim the absent blocks until the write completes.
        let claims = s.copying.entry(p).or_default();
        for r in runs.iter().filter(|r| !r.present) {
            for blk in r.first..=r.last {
                claims[(blk / 64) as usize] |= 1 << (blk % 64);
            }
        }
        FirstWritePlan::Partial {
            p,
            layer: vol.layer(),
        }
    }

    /// A first write planned by `plan_first_write` completed with `res`: its absent
    /// blocks are released and, when it succeeded, marked present (journaled after the
    /// data write completed: a commit syncs the data before it writes this record).
    /// Nothing is marked when the unit changed hands meanwhile (freed by a delete).
    pub(crate) fn finish_first_write(
        &self,
        p: u32,
        layer: u32,
        unit: u64,
        runs: &[BlockRun],
        res: i32,
    ) {
        let mut s = self.lock();
        if let Some(claims) = s.copying.get_mut(&p) {
            for r in runs.iter().filter(|r| !r.present) {
                for blk in r.first..=r.last {
                    claims[(blk / 64) as usize] &= !(1 << (blk % 64));
                }
            }
            if claims.iter().all(|&w| w == 0) {
                s.copying.remove(&p);
            }
        }
        if res < 0 || s.owners.get(p as usize) != Some(&(layer, u32_of(unit))) {
            return;
        }
        for r in runs.iter().filter(|r| !r.present) {
            let count = r.last - r.first + 1;
            s.records.push(presence_record(p, r.first, count));
            if self.presence.set(p, r.first, count) {
                s.partial.remove(&p);
            }
        }
    }

    /// Give back units `[first, last]` of `vol` (in a chain) that the chain below has
    /// nothing at: released, they read as zeros, as on a plain volume. A unit the chain
    /// has data at stays (releasing it would show the parent's data again; discard is
    /// advisory).
    pub(crate) fn unmap_unshared_units(&self, vol: &Volume, first: u64, last: u64) {
        let mut s = self.lock();
        let map = vol.current_map();
        let chain = vol.ancestor_maps();
        let mapped: Vec<(u64, u32)> = map
            .mapped_in(first, last + 1)
            .filter(|&(u, p)| !Self::chain_has(&chain, u) && !s.copying.contains_key(&p))
            .collect();
        for (u, p) in mapped {
            self.free_unit(&mut s, &map, u, p);
            vol.allocated.fetch_sub(1, Relaxed);
        }
        if map.has_empty_leaf_in(first, last + 1) {
            vol.compact_wanted.store(true, Relaxed);
        }
    }
}
