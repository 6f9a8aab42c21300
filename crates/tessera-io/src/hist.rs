//! A log-linear latency histogram with fixed memory, cheap enough to record every I/O.
//!
//! Values (nanoseconds) are bucketed by their power of two and 16 linear sub-buckets
//! inside it, so any reported percentile is within 1/16 (6.25%) of the true value.

const SUB_BITS: u32 = 4;
const SUB: usize = 1 << SUB_BITS;
const GROUPS: usize = 64 - SUB_BITS as usize;

#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    sum: u128,
    max: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; GROUPS * SUB + SUB],
            total: 0,
            sum: 0,
            max: 0,
        }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < SUB as u64 {
            #[allow(clippy::cast_possible_truncation)] // below SUB
            return v as usize;
        }
        let msb = 63 - v.leading_zeros();
        let shift = msb - SUB_BITS;
        #[allow(clippy::cast_possible_truncation)] // masked to below SUB
        let sub = ((v >> shift) as usize) & (SUB - 1);
        (shift as usize + 1) * SUB + sub
    }

    /// The upper bound of values in bucket `i`.
    fn value_of(i: usize) -> u64 {
        if i < SUB {
            return i as u64;
        }
        #[allow(clippy::cast_possible_truncation)] // a bucket index: at most 64
        let shift = (i / SUB - 1) as u32;
        let sub = (i % SUB) as u64;
        ((SUB as u64 | sub) << shift) + (1u64 << shift) - 1
    }

    #[inline]
    pub fn record(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.total += 1;
        self.sum += v as u128;
        if v > self.max {
            self.max = v;
        }
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    /// Sum of every recorded value.
    pub fn sum(&self) -> u128 {
        self.sum
    }

    /// How many recorded values are below `2^k` (exact: a power of two is where one
    /// bucket group ends and the next begins). For histograms with power-of-two bounds.
    pub fn count_below_pow2(&self, k: u32) -> u64 {
        if k >= 64 {
            return self.total;
        }
        let top = (1u64 << k) - 1;
        self.counts[..=Self::index(top)].iter().sum()
    }

    pub fn mean(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum as f64 / self.total as f64
        }
    }

    pub fn max(&self) -> u64 {
        self.max
    }

    /// The value at quantile `q` (0.0..=1.0).
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        // A float-to-int cast saturates: a rank outside 1..=total is clamped into it.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let want = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Self::value_of(i).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_bucket_precision() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v);
        }
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 - 50_000.0).abs() / 50_000.0 < 0.07, "p50 {p50}");
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 - 99_000.0).abs() / 99_000.0 < 0.07, "p99 {p99}");
        assert_eq!(h.quantile(1.0), 100_000);
        assert!((h.mean() - 50_000.5).abs() < 1.0);
    }

    #[test]
    fn counts_below_powers_of_two_are_exact() {
        let mut h = Histogram::default();
        for v in [0, 1, 1023, 1024, 1025, 4095, 4096, 1 << 40] {
            h.record(v);
        }
        assert_eq!(h.count_below_pow2(0), 1);
        assert_eq!(h.count_below_pow2(1), 2);
        assert_eq!(h.count_below_pow2(10), 3);
        assert_eq!(h.count_below_pow2(11), 5);
        assert_eq!(h.count_below_pow2(12), 6);
        assert_eq!(h.count_below_pow2(13), 7);
        assert_eq!(h.count_below_pow2(41), 8);
        assert_eq!(h.count_below_pow2(64), 8);
    }

    #[test]
    fn small_values_are_exact() {
        let mut h = Histogram::default();
        for v in 0..16 {
            h.record(v);
        }
        assert_eq!(h.quantile(0.0625), 0);
        assert_eq!(h.quantile(1.0), 15);
    }
}

/// A histogram written by one thread and read by others: the writer uses plain loads and
/// stores (no atomic read-modify-write, so no locked instructions on the datapath); a
/// reader's snapshot may miss the last few records, never more.
pub struct SharedHistogram {
    counts: Box<[std::sync::atomic::AtomicU64]>,
    total: std::sync::atomic::AtomicU64,
    sum: std::sync::atomic::AtomicU64,
    max: std::sync::atomic::AtomicU64,
}

impl Default for SharedHistogram {
    fn default() -> Self {
        use std::sync::atomic::AtomicU64;
        SharedHistogram {
            counts: (0..GROUPS * SUB + SUB).map(|_| AtomicU64::new(0)).collect(),
            total: AtomicU64::new(0),
            sum: AtomicU64::new(0),
            max: AtomicU64::new(0),
        }
    }
}

impl SharedHistogram {
    /// Record a value. Only one thread may call this for a given histogram.
    #[inline]
    pub fn record_single_writer(&self, v: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let bump = |a: &std::sync::atomic::AtomicU64, by: u64| {
            a.store(a.load(Relaxed).wrapping_add(by), Relaxed)
        };
        bump(&self.counts[Histogram::index(v)], 1);
        bump(&self.total, 1);
        bump(&self.sum, v);
        if v > self.max.load(Relaxed) {
            self.max.store(v, Relaxed);
        }
    }

    /// Add this histogram's current contents to `into`.
    pub fn snapshot_into(&self, into: &mut Histogram) {
        use std::sync::atomic::Ordering::Relaxed;
        for (a, b) in into.counts.iter_mut().zip(self.counts.iter()) {
            *a += b.load(Relaxed);
        }
        into.total += self.total.load(Relaxed);
        into.sum += self.sum.load(Relaxed) as u128;
        into.max = into.max.max(self.max.load(Relaxed));
    }
}

impl Histogram {
    /// What was recorded after `earlier` (a snapshot of the same source).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        Histogram {
            counts: self
                .counts
                .iter()
                .zip(&earlier.counts)
                .map(|(a, b)| a.saturating_sub(*b))
                .collect(),
            total: self.total.saturating_sub(earlier.total),
            sum: self.sum.saturating_sub(earlier.sum),
            // The maximum of a window is not recoverable from two snapshots; keep the
            // later one's as an upper bound.
            max: self.max,
        }
    }
}

#[cfg(test)]
mod shared_tests {
    use super::*;

    #[test]
    fn shared_snapshot_and_window() {
        let s = SharedHistogram::default();
        for v in 1..=1000 {
            s.record_single_writer(v * 1000);
        }
        let mut a = Histogram::default();
        s.snapshot_into(&mut a);
        assert_eq!(a.count(), 1000);
        for _ in 0..1000 {
            s.record_single_writer(5_000_000);
        }
        let mut b = Histogram::default();
        s.snapshot_into(&mut b);
        let w = b.since(&a);
        assert_eq!(w.count(), 1000);
        let p50 = w.quantile(0.5) as f64;
        assert!((p50 - 5_000_000.0).abs() / 5_000_000.0 < 0.07, "{p50}");
    }
}
