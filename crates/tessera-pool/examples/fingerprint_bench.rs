//! Issue 25 (inline dedup): which hash fingerprints 4 KiB blocks fastest on this CPU.
//! Hashes a 64 MiB buffer of distinct 4 KiB blocks (larger than the L2 cache, as a
//! write stream is) with each candidate, one core, and prints ns per block and GB/s.
//!
//! `cargo run --release -p tessera-pool --example fingerprint_bench [-- SECONDS]`
//!
//! Candidates: BLAKE3 (SIMD across a block's four 1 KiB chunks), SHA-256 from the sha2
//! crate and from ring (both use the SHA extensions where the CPU has them), and
//! XXH3-128 (not cryptographic: a match must then be confirmed by reading the block
//! back and comparing, which is why it is here only as a floor).

use std::hint::black_box;
use std::time::{Duration, Instant};

/// A candidate: hash one block, return a byte of the digest (so nothing is optimised out).
type Hasher = Box<dyn FnMut(&[u8]) -> u8>;

const BLOCK: usize = 4096;
const BUF: usize = 64 << 20;

fn fill(buf: &mut [u8]) {
    let mut x: u64 = 0x243f_6a88_85a3_08d3;
    for chunk in buf.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
}

/// Hash every block of `buf` with `f` for at least `secs`; ns per block.
fn measure(buf: &[u8], secs: f64, mut f: impl FnMut(&[u8]) -> u8) -> f64 {
    let limit = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut blocks = 0u64;
    let mut sink = 0u8;
    while start.elapsed() < limit {
        for b in buf.chunks_exact(BLOCK) {
            sink ^= f(black_box(b));
        }
        blocks += (buf.len() / BLOCK) as u64;
    }
    black_box(sink);
    start.elapsed().as_nanos() as f64 / blocks as f64
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2.0);
    let mut buf = vec![0u8; BUF];
    fill(&mut buf);
    let features = ["sha", "avx2", "avx512f", "avx512vl"]
        .iter()
        .filter(|f| match **f {
            "sha" => std::arch::is_x86_feature_detected!("sha"),
            "avx2" => std::arch::is_x86_feature_detected!("avx2"),
            "avx512f" => std::arch::is_x86_feature_detected!("avx512f"),
            _ => std::arch::is_x86_feature_detected!("avx512vl"),
        })
        .copied()
        .collect::<Vec<_>>();
    println!(
        "CPU features used by the candidates: {}",
        features.join(" ")
    );
    let candidates: Vec<(&str, Hasher)> = vec![
        ("blake3", Box::new(|b| blake3::hash(b).as_bytes()[0])),
        (
            "sha256-sha2",
            Box::new(|b| {
                use sha2::Digest;
                sha2::Sha256::digest(b)[0]
            }),
        ),
        (
            "sha256-ring",
            Box::new(|b| ring::digest::digest(&ring::digest::SHA256, b).as_ref()[0]),
        ),
        (
            "xxh3-128",
            Box::new(|b| xxhash_rust::xxh3::xxh3_128(b).to_le_bytes()[0]),
        ),
    ];
    for (name, mut f) in candidates {
        let ns = measure(&buf, secs, &mut f);
        let gbs = BLOCK as f64 / ns;
        println!(
            "RESULT hash={name} ns_per_4k={ns:.0} gb_per_s={gbs:.2} blocks_per_s_per_core={:.0}",
            1e9 / ns
        );
    }
}
