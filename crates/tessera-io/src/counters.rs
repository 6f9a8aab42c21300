//! Per-owner counter blocks and the registry that sums them: the shape of every I/O
//! figure Tessera keeps (a connection's client I/O, a per-core handle's device I/O).
//!
//! Each owner (a connection, a per-core handle) gets a block of its own that only its
//! core writes, with plain loads and stores: no atomic read-modify-write and no shared
//! cache line on the datapath. The registry lists the live blocks and folds a block's
//! figures into its retired totals when its owner hands it back, so the totals keep
//! counting closed connections and dropped handles. Registering, unregistering and
//! summing take a mutex: control plane only, never per I/O.

use crate::sync::MutexExt;
use std::sync::{Arc, Mutex, MutexGuard};

/// A block of counters one owner writes, and how its figures add into totals.
pub trait Counters: Default {
    /// The summed figures (plain integers, histograms).
    type Totals: Clone + Default;

    /// Add this block's current figures to `totals`.
    fn add_to(&self, totals: &mut Self::Totals);
}

/// The counter blocks of one target (an export, a device slot), live and retired.
pub struct CounterRegistry<C: Counters> {
    inner: Mutex<Registered<C>>,
}

struct Registered<C: Counters> {
    live: Vec<Arc<C>>,
    /// Figures of blocks handed back.
    retired: C::Totals,
}

impl<C: Counters> Default for CounterRegistry<C> {
    fn default() -> Self {
        CounterRegistry {
            inner: Mutex::new(Registered {
                live: Vec::new(),
                retired: C::Totals::default(),
            }),
        }
    }
}

impl<C: Counters> CounterRegistry<C> {
    fn lock(&self) -> MutexGuard<'_, Registered<C>> {
        self.inner.locked()
    }

    /// A new block for one owner; hand it back with [`CounterRegistry::unregister`].
    pub fn register(&self) -> Arc<C> {
        let c = Arc::new(C::default());
        self.lock().live.push(c.clone());
        c
    }

    /// Fold a block whose owner is done into the retired totals.
    pub fn unregister(&self, c: &Arc<C>) {
        let mut r = self.lock();
        r.live.retain(|x| !Arc::ptr_eq(x, c));
        c.add_to(&mut r.retired);
    }

    /// The figures of every block, live or retired.
    pub fn snapshot(&self) -> C::Totals {
        let r = self.lock();
        let mut t = r.retired.clone();
        for c in &r.live {
            c.add_to(&mut t);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::atomic::Ordering::Relaxed;

    #[derive(Default)]
    struct Ops(AtomicU64);

    impl Counters for Ops {
        type Totals = u64;
        fn add_to(&self, totals: &mut u64) {
            *totals += self.0.load(Relaxed);
        }
    }

    #[test]
    fn retired_blocks_keep_counting_and_are_not_counted_twice() {
        let reg = CounterRegistry::<Ops>::default();
        let a = reg.register();
        let b = reg.register();
        a.0.store(3, Relaxed);
        b.0.store(4, Relaxed);
        assert_eq!(reg.snapshot(), 7);
        reg.unregister(&a);
        // A block written after it was handed back no longer counts: its figures were
        // folded in when its owner was done.
        a.0.store(100, Relaxed);
        b.0.store(5, Relaxed);
        assert_eq!(reg.snapshot(), 8);
        reg.unregister(&b);
        assert_eq!(reg.snapshot(), 8);
    }
}
