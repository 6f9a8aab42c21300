//! Issue 24: the cache tier's policy against a plain LRU of the same size, on one trace
//! with a scan in the middle. The trace is zipf(1.1) over a working set four times the
//! cache (1 MiB units), then a sequential scan of three times the cache, then the same
//! zipf again. It prints each policy's hit ratio in the window before the scan and in
//! the window after it (the hot set's), and their ratio; the target is at least
//! 90% for Tessera's policy.
//!
//! `cargo run --release -p tessera-pool --example cache_policy_replay [-- CACHE_UNITS]`
//!
//! Tessera's policy runs as 2Q alone, 2Q with the access-pattern detector's bypass
//! (requests the detector labels sequential are not admitted), as the cache tier runs
//! it, and with an admission threshold (nhit: a full cache admits a unit at its N-th
//! miss) with and without the detector. Offsets given to the detector are the units'
//! (unit << 20), one request per unit access.

use std::collections::{HashMap, VecDeque};

use tessera_pool::cache_policy::{Outcome, TwoQ};
use tessera_pool::pattern::{Detector, Pattern};

/// A plain LRU of `capacity` units (the baseline).
struct Lru {
    capacity: usize,
    stamp: u64,
    last: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl Lru {
    fn new(capacity: usize) -> Lru {
        Lru {
            capacity,
            stamp: 0,
            last: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// True on a hit.
    fn access(&mut self, key: u64) -> bool {
        self.stamp += 1;
        let hit = self.last.insert(key, self.stamp).is_some();
        self.order.push_back((key, self.stamp));
        while self.last.len() > self.capacity {
            let (k, s) = self.order.pop_front().expect("entries");
            if self.last.get(&k) == Some(&s) {
                self.last.remove(&k);
            }
        }
        // Drop stale order entries now and then so the queue stays bounded.
        if self.order.len() > 4 * self.capacity {
            let last = &self.last;
            self.order.retain(|(k, s)| last.get(k) == Some(s));
        }
        hit
    }
}

struct Zipf {
    cdf: Vec<f64>,
    x: u64,
}

impl Zipf {
    fn new(n: usize, s: f64, seed: u64) -> Zipf {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf, x: seed | 1 }
    }

    fn next(&mut self) -> u64 {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        let u = (self.x >> 11) as f64 / (1u64 << 53) as f64;
        let rank = self.cdf.partition_point(|&c| c < u);
        // Spread the ranks over the working set so that hot units are not neighbours
        // (a neighbour would look like a stream to the detector).
        (rank as u64).wrapping_mul(0x9e37_79b9) % self.cdf.len() as u64
    }
}

fn main() {
    let cache: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let working = 4 * cache;
    // Short enough that a flushed cache has not warmed up again by its end.
    let window = 2 * cache;
    let mut trace: Vec<u64> = Vec::new();
    let mut z = Zipf::new(working, 1.1, 42);
    // Warm-up, the window before, the scan, the window after.
    for _ in 0..window * 10 {
        trace.push(z.next());
    }
    let scan_at = trace.len();
    let scan_base = 1u64 << 30; // far from the working set's units
    for k in 0..(3 * cache) as u64 {
        trace.push(scan_base + k);
    }
    let after_at = trace.len();
    for _ in 0..window {
        trace.push(z.next());
    }
    let before = (scan_at - window)..scan_at;
    let after = after_at..after_at + window;
    let ratio = |hits: &[bool], r: &std::ops::Range<usize>| {
        hits[r.clone()].iter().filter(|&&h| h).count() as f64 / r.len() as f64
    };

    let mut lru = Lru::new(cache);
    let lru_hits: Vec<bool> = trace.iter().map(|&k| lru.access(k)).collect();
    let mut q = TwoQ::new(cache);
    let q_hits: Vec<bool> = trace
        .iter()
        .map(|&k| q.access(k, false) == Outcome::Hit)
        .collect();
    let mut q2 = TwoQ::new(cache);
    let mut det = Detector::default();
    let mut bypassed = 0u64;
    let q2_hits: Vec<bool> = trace
        .iter()
        .map(|&k| {
            let seq = det.observe(k << 20, 1 << 20) == Pattern::Sequential;
            bypassed += u64::from(seq);
            q2.access(k, seq) == Outcome::Hit
        })
        .collect();
    // The admission threshold (nhit) without and with the detector.
    let nhit = |n: u8, detect: bool| -> Vec<bool> {
        let mut q = TwoQ::with_admit_hits(cache, n);
        let mut det = Detector::default();
        trace
            .iter()
            .map(|&k| {
                let seq = detect && det.observe(k << 20, 1 << 20) == Pattern::Sequential;
                q.access(k, seq) == Outcome::Hit
            })
            .collect()
    };
    let (n2, n3, n2d) = (nhit(2, false), nhit(3, false), nhit(2, true));

    println!(
        "cache {cache} units, working set {working}, zipf 1.1, scan {} units, windows of {window} accesses",
        3 * cache
    );
    for (name, hits) in [
        ("lru", &lru_hits),
        ("2q", &q_hits),
        ("2q+detector", &q2_hits),
        ("2q+nhit2", &n2),
        ("2q+nhit3", &n3),
        ("2q+detector+nhit2", &n2d),
    ] {
        let (b, a) = (ratio(hits, &before), ratio(hits, &after));
        println!(
            "RESULT policy={name} hit_before={b:.3} hit_after={a:.3} after_over_before={:.3}",
            a / b
        );
    }
    println!("RESULT detector_bypassed_accesses={bypassed}");
    println!(
        "RESULT policy_state_bytes={} per_cached_unit={:.1}",
        q2.state_bytes(),
        q2.state_bytes() as f64 / cache as f64
    );
}
