//! What every iSCSI connection (on every core) serving one volume shares.
//!
//! - COMPARE AND WRITE's and ORWRITE's atomicity: the block range such a command holds
//!   from the start of its read to the end of its write. While a range is held,
//!   another COMPARE AND WRITE, ORWRITE, WRITE or WRITE SAME from iSCSI that overlaps it
//!   is answered BUSY (the initiator retries), so no iSCSI write lands between the read
//!   and the write. Writes already in flight when the range is taken, and writes from
//!   NBD or NVMe/TCP, are not ordered by it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tessera_io::sync::MutexExt;

#[derive(Default)]
pub struct LuShared {
    /// How many ranges are held: writes look at the table only when it is non-zero, so
    /// a volume without COMPARE AND WRITE pays one atomic load per write.
    count: AtomicUsize,
    /// Held ranges: (first block, blocks).
    held: Mutex<Vec<(u64, u64)>>,
}

fn overlap(a: (u64, u64), lba: u64, blocks: u64) -> bool {
    a.0 < lba.saturating_add(blocks) && lba < a.0.saturating_add(a.1)
}

impl LuShared {
    /// The table of the volume whose export target has identity `key`.
    pub fn of(key: usize) -> Arc<LuShared> {
        static TABLES: Mutex<Vec<(usize, Weak<LuShared>)>> = Mutex::new(Vec::new());
        let mut t = TABLES.locked();
        t.retain(|(_, w)| w.strong_count() > 0);
        if let Some(l) = t
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return l;
        }
        let l = Arc::new(LuShared::default());
        t.push((key, Arc::downgrade(&l)));
        l
    }

    /// Hold `[lba, lba+blocks)`, unless an overlapping range is held.
    pub fn try_take(&self, lba: u64, blocks: u64) -> bool {
        let mut h = self.held.locked();
        if h.iter().any(|&r| overlap(r, lba, blocks)) {
            return false;
        }
        h.push((lba, blocks));
        self.count.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Let go of a range [`try_take`](Self::try_take) took.
    pub fn release(&self, lba: u64, blocks: u64) {
        let mut h = self.held.locked();
        if let Some(i) = h.iter().position(|&r| r == (lba, blocks)) {
            h.swap_remove(i);
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A write to `[lba, lba+blocks)` would land inside a held range.
    pub fn busy(&self, lba: u64, blocks: u64) -> bool {
        if self.count.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.held.locked().iter().any(|&r| overlap(r, lba, blocks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_ranges_are_refused_until_released() {
        let l = LuShared::of(0x1234_5678);
        assert!(Arc::ptr_eq(&l, &LuShared::of(0x1234_5678)));
        assert!(!l.busy(0, 1000));
        assert!(l.try_take(10, 5));
        assert!(!l.try_take(14, 1));
        assert!(l.try_take(15, 1));
        assert!(l.busy(12, 1) && l.busy(0, 11) && !l.busy(0, 10) && !l.busy(16, 4));
        l.release(10, 5);
        assert!(l.try_take(14, 1));
        l.release(14, 1);
        l.release(15, 1);
        assert!(!l.busy(0, u64::MAX));
    }
}
