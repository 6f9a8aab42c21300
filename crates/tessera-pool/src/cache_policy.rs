//! Which cache units stay in the cache tier (issue 24): admission and eviction that keep
//! a hot set through a one-time scan, which a plain LRU does not.
//!
//! The policy is 2Q (Johnson and Shasha, 1994) in its full form, plus a bypass:
//! - a unit seen for the first time enters a FIFO (`recent`, a quarter of the cache) and
//!   leaves it without ever displacing the hot set;
//! - a unit evicted from that FIFO is remembered by key only (`ghosts`, half the cache's
//!   count of keys, no data); a miss on a ghost proves reuse and admits the unit to the
//!   main LRU (`frequent`);
//! - hits in `frequent` move a unit to its head; its tail is what goes when `recent` is
//!   within its share;
//! - a request the access-pattern detector (`crate::pattern`) calls sequential may
//!   bypass admission altogether (bcache's sequential cutoff): a stream is read once;
//! - with an admission threshold N above 1 (Open CAS's "nhit"), a full cache admits a
//!   unit only at its N-th miss: until then it is remembered as a ghost with a count, so
//!   units read once (a scan the detector missed, a random one-off) never displace
//!   anything. A cache with free room admits at the first miss whatever N is.
//!
//! State: a 24-byte list entry (key, links, queue) and a hash-map slot per cached unit
//! and per ghost key (half as many as units), allocated up front for a full cache.
//! [`TwoQ::state_bytes`] measures it: 63-95 bytes per cached unit (the hash table's
//! size rounds to a power of two; the `cache_policy_replay` example prints it), so with
//! 1 MiB units 63-95 KiB of RAM per GiB of cache. dm-cache's smq spends about 25 bytes
//! per cache block of 32 KiB or more: up to 800 KiB per GiB.

use std::collections::HashMap;

/// No entry (end of a list).
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Queue {
    Recent = 0,
    Frequent = 1,
    Ghost = 2,
}

#[derive(Clone, Copy)]
struct Entry {
    key: u64,
    prev: u32,
    next: u32,
    queue: Queue,
    /// Misses seen while a ghost (for the admission threshold); fits the padding.
    hits: u8,
}

/// A doubly linked list threaded through the arena: head is the most recent.
#[derive(Clone, Copy)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// What one access did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The unit is cached.
    Hit,
    /// Not cached; `admitted` says whether it is now (the caller fills it), `evicted` the
    /// unit whose place it took (the caller writes it back first if it is dirty).
    Miss {
        admitted: bool,
        evicted: Option<u64>,
    },
}

/// The policy for a cache of `capacity` units (keys are unit numbers).
pub struct TwoQ {
    capacity: usize,
    /// Misses a unit needs before a full cache admits it (1: the first).
    admit_hits: u8,
    recent_share: usize,
    ghost_share: usize,
    entries: Vec<Entry>,
    free: Vec<u32>,
    index: HashMap<u64, u32>,
    lists: [List; 3],
}

impl TwoQ {
    pub fn new(capacity: usize) -> TwoQ {
        TwoQ::with_admit_hits(capacity, 1)
    }

    /// A policy whose full cache admits a unit at its `admit_hits`-th miss (at least 1).
    pub fn with_admit_hits(capacity: usize, admit_hits: u8) -> TwoQ {
        assert!(capacity >= 4, "a cache of at least 4 units");
        let ghost_share = capacity / 2;
        TwoQ {
            capacity,
            admit_hits: admit_hits.max(1),
            recent_share: capacity / 4,
            ghost_share,
            entries: Vec::with_capacity(capacity + ghost_share + 1),
            free: Vec::new(),
            index: HashMap::with_capacity(capacity + ghost_share + 1),
            lists: [EMPTY; 3],
        }
    }

    /// Misses a unit needs before a full cache admits it.
    pub fn admit_hits(&self) -> u8 {
        self.admit_hits
    }

    /// Change how many misses a full cache waits for (at least 1); the misses the queues
    /// already counted stay counted.
    pub fn set_admit_hits(&mut self, admit_hits: u8) {
        self.admit_hits = admit_hits.max(1);
    }

    /// Bytes of RAM the policy's state takes (its entries and its index's table, as
    /// allocated).
    pub fn state_bytes(&self) -> usize {
        let slot = std::mem::size_of::<(u64, u32)>() + 1; // the map's entry and control byte
        self.entries.capacity() * std::mem::size_of::<Entry>() + self.index.capacity() * slot
    }

    /// Units cached now (ghosts excluded).
    pub fn cached(&self) -> usize {
        self.lists[Queue::Recent as usize].len + self.lists[Queue::Frequent as usize].len
    }

    pub fn contains(&self, key: u64) -> bool {
        self.index
            .get(&key)
            .is_some_and(|&i| self.entries[i as usize].queue != Queue::Ghost)
    }

    /// An access to unit `key`; `bypass`: do not admit it on a miss (a sequential
    /// stream's unit). A hit is a hit either way.
    pub fn access(&mut self, key: u64, bypass: bool) -> Outcome {
        match self.index.get(&key).copied() {
            Some(i) => match self.entries[i as usize].queue {
                Queue::Frequent => {
                    self.unlink(i);
                    self.push_head(Queue::Frequent, i);
                    Outcome::Hit
                }
                // FIFO: a hit while recent does not move it (a burst of hits on a new
                // unit is not reuse).
                Queue::Recent => Outcome::Hit,
                Queue::Ghost => {
                    if bypass {
                        return Outcome::Miss {
                            admitted: false,
                            evicted: None,
                        };
                    }
                    let e = &mut self.entries[i as usize];
                    e.hits = e.hits.saturating_add(1);
                    if e.hits < self.admit_hits && self.cached() >= self.capacity {
                        // Not yet seen often enough to displace anything: counted only.
                        self.unlink(i);
                        self.push_head(Queue::Ghost, i);
                        return Outcome::Miss {
                            admitted: false,
                            evicted: None,
                        };
                    }
                    // Seen again after leaving: reuse. It goes to the main LRU.
                    self.unlink(i);
                    let evicted = self.make_room();
                    self.push_head(Queue::Frequent, i);
                    Outcome::Miss {
                        admitted: true,
                        evicted,
                    }
                }
            },
            None if bypass => Outcome::Miss {
                admitted: false,
                evicted: None,
            },
            None if self.admit_hits > 1 && self.cached() >= self.capacity => {
                // A full cache with an admission threshold: the first miss is counted.
                let i = self.alloc(key);
                self.entries[i as usize].hits = 1;
                self.push_ghost(i);
                Outcome::Miss {
                    admitted: false,
                    evicted: None,
                }
            }
            None => {
                let evicted = self.make_room();
                let i = self.alloc(key);
                self.push_head(Queue::Recent, i);
                Outcome::Miss {
                    admitted: true,
                    evicted,
                }
            }
        }
    }

    /// Make entry `i` the newest ghost, forgetting the oldest beyond the ghosts' share.
    fn push_ghost(&mut self, i: u32) {
        self.push_head(Queue::Ghost, i);
        if self.lists[Queue::Ghost as usize].len > self.ghost_share {
            let g = self.lists[Queue::Ghost as usize].tail;
            self.unlink(g);
            self.release(g);
        }
    }

    /// Readahead wants unit `key` in the cache. It never displaces the hot set: it takes
    /// a free place, or the oldest recent unit's (which leaves without becoming a ghost:
    /// a stream's units are not reuse), and is refused when neither exists or the unit is
    /// a ghost (its next access decides). A unit cached already is a hit, and not moved.
    pub fn prefetch(&mut self, key: u64) -> Outcome {
        match self
            .index
            .get(&key)
            .map(|&i| self.entries[i as usize].queue)
        {
            Some(Queue::Recent | Queue::Frequent) => return Outcome::Hit,
            Some(Queue::Ghost) => {
                return Outcome::Miss {
                    admitted: false,
                    evicted: None,
                }
            }
            None => {}
        }
        let mut evicted = None;
        if self.cached() >= self.capacity {
            let tail = self.lists[Queue::Recent as usize].tail;
            if tail == NIL {
                return Outcome::Miss {
                    admitted: false,
                    evicted: None,
                };
            }
            evicted = Some(self.entries[tail as usize].key);
            self.unlink(tail);
            self.release(tail);
        }
        let i = self.alloc(key);
        self.push_head(Queue::Recent, i);
        Outcome::Miss {
            admitted: true,
            evicted,
        }
    }

    /// Free one unit's place if the cache is full: the oldest recent unit while recent
    /// holds more than its share (it becomes a ghost), else the least recently used
    /// frequent one. Returns the unit that left.
    fn make_room(&mut self) -> Option<u64> {
        if self.cached() < self.capacity {
            return None;
        }
        let recent = self.lists[Queue::Recent as usize];
        if recent.len > self.recent_share || self.lists[Queue::Frequent as usize].len == 0 {
            let i = recent.tail;
            self.unlink(i);
            // It was cached once: that counts as its first miss.
            self.entries[i as usize].hits = 1;
            self.push_ghost(i);
            Some(self.entries[i as usize].key)
        } else {
            let i = self.lists[Queue::Frequent as usize].tail;
            let key = self.entries[i as usize].key;
            self.unlink(i);
            self.release(i);
            Some(key)
        }
    }

    fn alloc(&mut self, key: u64) -> u32 {
        let e = Entry {
            key,
            prev: NIL,
            next: NIL,
            queue: Queue::Recent,
            hits: 0,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                i
            }
            None => {
                self.entries.push(e);
                u32::try_from(self.entries.len() - 1).expect("fewer than 2^32 entries")
            }
        };
        self.index.insert(key, i);
        i
    }

    fn release(&mut self, i: u32) {
        self.index.remove(&self.entries[i as usize].key);
        self.free.push(i);
    }

    fn push_head(&mut self, q: Queue, i: u32) {
        let l = &mut self.lists[q as usize];
        let old = l.head;
        l.head = i;
        if old == NIL {
            l.tail = i;
        }
        l.len += 1;
        let e = &mut self.entries[i as usize];
        e.queue = q;
        e.prev = NIL;
        e.next = old;
        if old != NIL {
            self.entries[old as usize].prev = i;
        }
    }

    fn unlink(&mut self, i: u32) {
        let Entry {
            prev, next, queue, ..
        } = self.entries[i as usize];
        if prev == NIL {
            self.lists[queue as usize].head = next;
        } else {
            self.entries[prev as usize].next = next;
        }
        if next == NIL {
            self.lists[queue as usize].tail = prev;
        } else {
            self.entries[next as usize].prev = prev;
        }
        self.lists[queue as usize].len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_never_displaces_the_frequent_units() {
        let mut q = TwoQ::new(8);
        // 0 and 1 become frequent: seen, pushed out to the ghosts by 8 and 9, seen again.
        for k in 0..10 {
            q.access(k, false);
        }
        assert_eq!(q.access(0, false), miss(true, Some(2)));
        assert_eq!(q.access(1, false), miss(true, Some(3)));
        for k in 100..200 {
            let o = q.prefetch(k);
            assert!(
                matches!(o, Outcome::Miss { admitted: true, .. }),
                "{k}: {o:?}"
            );
        }
        assert!(
            q.contains(0) && q.contains(1),
            "readahead displaced the hot set"
        );
        assert_eq!(q.prefetch(199), Outcome::Hit);
        assert_eq!(q.prefetch(0), Outcome::Hit);
        assert_eq!(q.cached(), 8);
        // A ghost is left to its next access.
        assert_eq!(q.prefetch(2), miss(false, None));
    }

    fn miss(admitted: bool, evicted: Option<u64>) -> Outcome {
        Outcome::Miss { admitted, evicted }
    }

    #[test]
    fn a_full_cache_with_a_threshold_admits_at_the_nth_miss() {
        let mut q = TwoQ::with_admit_hits(8, 3);
        // Room: admitted at once whatever the threshold.
        for k in 0..8 {
            assert_eq!(q.access(k, false), miss(true, None));
        }
        // Full: counted twice, admitted at the third miss, displacing the oldest.
        assert_eq!(q.access(100, false), miss(false, None));
        assert_eq!(q.access(100, false), miss(false, None));
        assert!(!q.contains(100));
        assert_eq!(q.access(100, false), miss(true, Some(0)));
        assert!(q.contains(100) && q.access(100, false) == Outcome::Hit);
        // A one-time scan displaces nothing.
        for k in 1000..1100 {
            assert_eq!(q.access(k, false), miss(false, None));
        }
        assert_eq!(q.cached(), 8);
        for k in 1..8 {
            assert!(q.contains(k), "{k} kept through the scan");
        }
        // A bypassed request is never counted.
        assert_eq!(q.access(200, true), miss(false, None));
        assert!(!q.contains(200));
    }

    #[test]
    fn first_sight_goes_to_recent_and_reuse_after_it_to_frequent() {
        let mut q = TwoQ::new(8);
        for k in 0..8 {
            assert_eq!(q.access(k, false), miss(true, None));
        }
        assert_eq!(q.cached(), 8);
        assert_eq!(q.access(3, false), Outcome::Hit);
        // Full: the oldest recent unit (0) leaves and is remembered.
        assert_eq!(q.access(100, false), miss(true, Some(0)));
        assert!(!q.contains(0));
        // Seen again: admitted to the main LRU.
        assert_eq!(q.access(0, false), miss(true, Some(1)));
        assert!(q.contains(0));
        assert_eq!(q.lists[Queue::Frequent as usize].len, 1);
        assert_eq!(q.cached(), 8);
    }

    #[test]
    fn a_scan_does_not_displace_the_hot_set() {
        let mut q = TwoQ::new(16);
        // A hot set of 8 units, each seen, evicted to ghost and seen again: frequent.
        for round in 0..3 {
            for k in 0..8 {
                q.access(k, false);
            }
            for k in 0..16 {
                q.access(1000 * (round + 1) + k, false);
            }
        }
        for k in 0..8 {
            q.access(k, false);
        }
        assert!(
            (0..8).all(|k| q.contains(k)),
            "hot set cached before the scan"
        );
        // A scan of 10x the cache, not marked sequential: it cycles through recent only.
        for k in 0..160 {
            q.access(50_000 + k, false);
        }
        assert!(
            (0..8).all(|k| q.contains(k)),
            "the hot set survived the scan"
        );
        // Marked sequential, a scan is not even admitted.
        let before = q.cached();
        for k in 0..160 {
            assert_eq!(q.access(90_000 + k, true), miss(false, None));
        }
        assert_eq!(q.cached(), before);
        assert_eq!(q.access(0, true), Outcome::Hit);
    }

    #[test]
    fn lists_stay_consistent_under_a_random_workload() {
        let mut q = TwoQ::new(32);
        let mut x: u64 = 12345;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 200;
            let before = q.contains(key);
            let out = q.access(key, x & 16 == 0);
            assert_eq!(before, out == Outcome::Hit);
            assert!(q.cached() <= 32);
            assert!(q.lists[Queue::Ghost as usize].len <= 16);
        }
        let total: usize = q.lists.iter().map(|l| l.len).sum();
        assert_eq!(total, q.index.len());
        for (qi, l) in q.lists.iter().enumerate() {
            let (mut n, mut i) = (0, l.head);
            while i != NIL {
                assert_eq!(q.entries[i as usize].queue as usize, qi);
                n += 1;
                i = q.entries[i as usize].next;
            }
            assert_eq!(n, l.len);
        }
    }
}
