//! Issue 25 (inline dedup): what the fingerprint index (docs/format.md §17) costs, on a
//! RAM device so that the figures are the index's own CPU and RAM, not a device's.
//!
//! `cargo run --release -p tessera-pool --example dedup_index_bench [-- ENTRIES]`
//!
//! Sizes an index for ENTRIES 4 KiB blocks (default 1,048,576: 4 GiB of unique data),
//! fills it to that many entries, then measures per operation, one core: a lookup of
//! a fingerprint the index does not have (answered by the short fingerprints in RAM
//! alone, or by a bucket read when a short one matches), a lookup of one it has (a
//! bucket read), and an insert (a bucket read and write). Prints the RAM it takes per
//! entry and per TiB of unique data.

use std::sync::Arc;
use std::time::Instant;

use tessera_device::{BlockDevice, RamDevice};
use tessera_pool::dedup::{Fingerprint, FingerprintIndex, OnDevice};

fn fp(i: u64, salt: u64) -> Fingerprint {
    // Distinct, well spread fingerprints without hashing 4 KiB per entry.
    let x = u128::from(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt);
    Fingerprint(x.wrapping_mul(0xD6E8_FEB8_6659_FD93_3C6E_F372_FE94_F82B) ^ (x << 64))
}

fn main() {
    let entries: u64 = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("ENTRIES: a number"))
        .unwrap_or(1 << 20);
    let buckets = FingerprintIndex::buckets_for(entries);
    let dev: Arc<dyn BlockDevice> =
        RamDevice::new(FingerprintIndex::device_bytes(buckets)).expect("RAM device");
    let idx = FingerprintIndex::open(Arc::new(OnDevice(dev)), 0, buckets).expect("open");
    let t = Instant::now();
    for i in 0..entries {
        idx.insert(fp(i, 0), i).expect("insert");
    }
    let fill = t.elapsed();
    let held = idx.entries();
    let ram = idx.ram_bytes();
    println!(
        "index for {entries} entries: {buckets} buckets, {} MiB on its device; {held} held after {entries} inserts ({} dropped from full buckets)",
        FingerprintIndex::device_bytes(buckets) >> 20,
        idx.stats().dropped
    );
    println!(
        "insert (bucket read + write, RAM device): {:.0} ns",
        fill.as_nanos() as f64 / entries as f64
    );
    let n = entries.min(1 << 20);
    let before = idx.stats();
    let t = Instant::now();
    let mut found = 0;
    for i in 0..n {
        found += idx.candidates(fp(i, 0x5A5A)).expect("lookup").len();
    }
    let miss = t.elapsed();
    let s = idx.stats();
    println!(
        "lookup of an absent fingerprint: {:.0} ns; {:.2}% needed a bucket read (a short match), {found} false candidates",
        miss.as_nanos() as f64 / n as f64,
        100.0 * (s.bucket_reads - before.bucket_reads) as f64 / n as f64
    );
    let t = Instant::now();
    let mut hits = 0;
    for i in 0..n {
        hits += idx.candidates(fp(i, 0)).expect("lookup").len();
    }
    println!(
        "lookup of a present fingerprint (bucket read): {:.0} ns, {hits} of {n} found",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    let per_entry = ram as f64 / held as f64;
    println!(
        "RAM: {} KiB, {per_entry:.2} bytes per entry = {:.0} MiB per TiB of unique 4 KiB blocks",
        ram >> 10,
        per_entry * (1u64 << 28) as f64 / f64::from(1u32 << 20)
    );
}
