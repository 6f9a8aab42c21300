//! Presence bitmaps of partial units (docs/format.md §3.4): which 4 KiB blocks of a unit
//! a volume of a snapshot chain has written itself. The pool core holds the table and
//! replays its journal records at open; the chain operations (`chain.rs`) and the volume
//! datapath read and set it. Kept apart from `chain.rs` so that the pool and the volume
//! need nothing from the chain operations.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicPtr;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Release};

use crate::format::{
    Record, CHAIN_HIDDEN, CHAIN_SNAPSHOT, OWNER_FREE, PRESENCE_BYTES, PRESENCE_RECORD,
};

/// Partial units a pool keeps at most (their bitmaps live in the catalog, which is
/// bounded: 16384 × 36 bytes is about half of it). Beyond, a first write into a shared
/// unit copies the rest of the unit from the chain (a full unit, as copy-on-write would).
pub const PARTIAL_MAX: usize = 16384;

/// Presence bitmap of one partial unit: bit `b` set = block `b` holds the owner's data.
pub(crate) struct Presence {
    words: [AtomicU64; 4],
}

/// One presence bitmap slot per pool unit. Null means the unit is full (every block
/// present); a slot, once allocated, lives until the pool is dropped, so a reader never
/// loads a pointer to freed memory (a unit made full again just has every bit set).
pub(crate) struct PresenceTable {
    slots: Box<[AtomicPtr<Presence>]>,
    /// Blocks per unit (at most 256) and the log2 of a block's size.
    pub blocks: u32,
    pub block_shift: u32,
}

impl Drop for PresenceTable {
    fn drop(&mut self) {
        for slot in self.slots.iter_mut() {
            let p = *slot.get_mut();
            if !p.is_null() {
                // SAFETY: a non-null slot holds a pointer from `Box::into_raw`, freed
                // exactly once, here (the table is the only owner).
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

impl PresenceTable {
    pub(crate) fn new(total_units: u64, unit_shift: u32) -> PresenceTable {
        let blocks_log = unit_shift.saturating_sub(12).min(8);
        PresenceTable {
            slots: (0..total_units)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            blocks: 1 << blocks_log,
            block_shift: unit_shift - blocks_log,
        }
    }

    #[inline]
    fn get(&self, p: u32) -> Option<&Presence> {
        let ptr = self.slots.get(p as usize)?.load(Acquire);
        // SAFETY: non-null slots point at a live bitmap the table owns until it drops.
        (!ptr.is_null()).then(|| unsafe { &*ptr })
    }

    /// Whether block `b` of pool unit `p` holds its owner's data.
    #[inline]
    pub(crate) fn present(&self, p: u32, b: u32) -> bool {
        match self.get(p) {
            None => true,
            Some(m) => m.words[(b / 64) as usize].load(Acquire) & (1 << (b % 64)) != 0,
        }
    }

    /// Whether every block of `[from, to]` of unit `p` is present.
    #[inline]
    pub(crate) fn all_present(&self, p: u32, from: u32, to: u32) -> bool {
        self.get(p).is_none() || (from..=to).all(|b| self.present(p, b))
    }

    fn full_word(&self, w: usize) -> u64 {
        let bits = (self.blocks as usize).saturating_sub(w * 64).min(64);
        if bits == 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        }
    }

    pub(crate) fn is_full(&self, p: u32) -> bool {
        match self.get(p) {
            None => true,
            Some(m) => (0..4).all(|w| m.words[w].load(Acquire) == self.full_word(w)),
        }
    }

    /// Unit `p` holds no block of its own yet. Under the pool lock.
    pub(crate) fn make_partial(&self, p: u32) {
        match self.get(p) {
            Some(m) => m.words.iter().for_each(|w| w.store(0, Release)),
            None => {
                let fresh = Box::into_raw(Box::new(Presence {
                    words: [const { AtomicU64::new(0) }; 4],
                }));
                self.slots[p as usize].store(fresh, Release);
            }
        }
    }

    /// Unit `p` is whole (allocated as a plain unit, or freed). Under the pool lock.
    pub(crate) fn set_full(&self, p: u32) {
        if let Some(m) = self.get(p) {
            for (w, word) in m.words.iter().enumerate() {
                word.store(self.full_word(w), Release);
            }
        }
    }

    /// Blocks `[first, first + count)` of `p` are present now. Returns whether the unit
    /// is full. Under the pool lock.
    pub(crate) fn set(&self, p: u32, first: u32, count: u32) -> bool {
        if let Some(m) = self.get(p) {
            for b in first..first + count {
                m.words[(b / 64) as usize].fetch_or(1 << (b % 64), Release);
            }
        }
        self.is_full(p)
    }

    pub(crate) fn bits(&self, p: u32) -> [u8; PRESENCE_BYTES] {
        let mut out = [0u8; PRESENCE_BYTES];
        if let Some(m) = self.get(p) {
            for (w, word) in m.words.iter().enumerate() {
                out[w * 8..w * 8 + 8].copy_from_slice(&word.load(Acquire).to_le_bytes());
            }
        }
        out
    }

    pub(crate) fn load_bits(&self, p: u32, bits: &[u8; PRESENCE_BYTES]) {
        self.make_partial(p);
        if let Some(m) = self.get(p) {
            for (w, word) in m.words.iter().enumerate() {
                let v = u64::from_le_bytes(bits[w * 8..w * 8 + 8].try_into().expect("8"));
                word.store(v & self.full_word(w), Release);
            }
        }
    }
}

/// Apply one journal presence record to the partial units being rebuilt at open.
pub(crate) fn replay_presence(partial: &mut BTreeMap<u32, [u8; PRESENCE_BYTES]>, r: &Record) {
    if r.volume_id == OWNER_FREE {
        partial.remove(&r.pool_unit);
        return;
    }
    if r.volume_id != PRESENCE_RECORD {
        return;
    }
    let first = r.volume_unit & 0xFFFF;
    let count = r.volume_unit >> 16;
    if count == 0 {
        partial.insert(r.pool_unit, [0; PRESENCE_BYTES]);
    } else if let Some(bits) = partial.get_mut(&r.pool_unit) {
        for b in first..(first + count).min(256) {
            bits[(b / 8) as usize] |= 1 << (b % 8);
        }
    }
}

pub(crate) fn presence_record(p: u32, first: u32, count: u32) -> Record {
    Record {
        pool_unit: p,
        volume_id: PRESENCE_RECORD,
        volume_unit: first | (count << 16),
    }
}

/// Chain record flags of a volume.
pub(crate) fn chain_flags(snapshot: bool, hidden: bool) -> u8 {
    (if snapshot { CHAIN_SNAPSHOT } else { 0 }) | (if hidden { CHAIN_HIDDEN } else { 0 })
}
