//! Single-thread throughput of the parity kernels.
//!
//! `cargo run --release -p tessera-parity --example parity_bench [-- SECONDS]`
//!
//! Figures are data bytes in per second (k × chunk per stripe, 1 GB = 10^9 bytes), on one
//! thread, each case run for about SECONDS (default 1). Buffers are reused, so a 4 KiB stripe
//! lives in L1/L2 and a 64 KiB stripe of 8 chunks (512 KiB) in L2/LLC, as on a datapath that
//! just received or read the chunks.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use tessera_parity::kernels::{self, Backend};
use tessera_parity::{pq_gen, pq_recover, pq_update, ReedSolomon};

fn fill(n: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (s >> 33) as u8
                })
                .collect()
        })
        .collect()
}

/// Runs `f` for about `secs`, returns (ops per second, GB/s) given `bytes` per op.
fn measure(secs: f64, bytes: usize, mut f: impl FnMut()) -> (f64, f64) {
    // warm up
    let warm = Instant::now();
    while warm.elapsed() < Duration::from_millis(50) {
        f();
    }
    let mut ops = 0u64;
    let mut batch = 1u64;
    let start = Instant::now();
    loop {
        for _ in 0..batch {
            f();
        }
        ops += batch;
        let el = start.elapsed().as_secs_f64();
        if el >= secs {
            return (ops as f64 / el, ops as f64 * bytes as f64 / el / 1e9);
        }
        if el < secs / 20.0 {
            batch *= 2;
        }
    }
}

fn row(name: &str, chunk: usize, be: Backend, r: (f64, f64)) {
    println!(
        "| {name:<34} | {:>3} KiB | {:<10} | {:>7.2} | {:>10.0} |",
        chunk / 1024,
        format!("{be:?}"),
        r.1,
        r.0
    );
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1.0);
    let det = Backend::detect();
    let all = Backend::available();
    println!("detected backend: {det:?}; available: {all:?}");
    println!("| case | chunk | backend | GB/s data in | ops/s |");
    println!("|---|---|---|---|---|");
    for chunk in [4096usize, 65536] {
        for k in [4usize, 8] {
            let data = fill(k, chunk, k as u64);
            let d: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let mut p = vec![0u8; chunk];
            for &be in &all {
                let r = measure(secs, k * chunk, || {
                    kernels::xor_gen_with(be, black_box(&mut p), black_box(&d));
                });
                row(&format!("raid5 P (xor) {k}+1"), chunk, be, r);
            }
        }
        for k in [4usize, 8] {
            let data = fill(k, chunk, 3 + k as u64);
            let d: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let (mut p, mut q) = (vec![0u8; chunk], vec![0u8; chunk]);
            for &be in &all {
                let r = measure(secs, k * chunk, || {
                    kernels::pq_gen_with(be, black_box(&d), black_box(&mut p), black_box(&mut q));
                });
                row(&format!("raid6 P+Q {k}+2"), chunk, be, r);
            }
            pq_gen(&d, &mut p, &mut q);
            // recovery of one data block (from P) and of two (the costliest RAID6 case)
            let mut stripe = data.clone();
            stripe.push(p.clone());
            stripe.push(q.clone());
            for missing in [vec![0usize], vec![0, 1]] {
                let mut s: Vec<&mut [u8]> = stripe.iter_mut().map(|v| v.as_mut_slice()).collect();
                let r = measure(secs, k * chunk, || {
                    pq_recover(black_box(&mut s), &missing).unwrap();
                });
                let name = format!("raid6 {k}+2 recover {} data", missing.len());
                row(&name, chunk, det, r);
            }
        }
        for (k, m) in [(4usize, 2usize), (8, 3)] {
            let rs = ReedSolomon::new(k, m).unwrap();
            let data = fill(k, chunk, 11 + k as u64);
            let d: Vec<&[u8]> = data.iter().map(|v| v.as_slice()).collect();
            let mut parity = vec![vec![0u8; chunk]; m];
            let mut pm: Vec<&mut [u8]> = parity.iter_mut().map(|v| v.as_mut_slice()).collect();
            // encode is exactly the parity rows of the generator applied to the data
            let rows = &rs.generator().as_slice()[k * k..];
            for &be in &all {
                let r = measure(secs, k * chunk, || {
                    if be == det {
                        rs.encode(black_box(&d), black_box(&mut pm)).unwrap();
                    } else {
                        kernels::dot_prod_with(be, rows, black_box(&d), &mut pm, false);
                    }
                });
                row(&format!("RS {k}+{m} encode"), chunk, be, r);
            }
            rs.encode(&d, &mut pm).unwrap();
            let mut stripe = data.clone();
            stripe.extend(parity.clone());
            for erasures in [vec![0usize], vec![0, 1]] {
                let mut s: Vec<&mut [u8]> = stripe.iter_mut().map(|v| v.as_mut_slice()).collect();
                let r = measure(secs, k * chunk, || {
                    rs.reconstruct(black_box(&mut s), &erasures).unwrap();
                });
                let name = format!("RS {k}+{m} reconstruct {} data", erasures.len());
                row(&name, chunk, det, r);
            }
        }
    }
    // read-modify-write of one 4 KiB block inside a stripe (bytes = the 4 KiB written)
    let blk = 4096;
    let v = fill(4, blk, 99);
    let (old, new) = (&v[0], &v[1]);
    let (mut p, mut q) = (v[2].clone(), v[3].clone());
    for &be in &all {
        let r = measure(secs, blk, || {
            kernels::pq_update_with(be, black_box(old), black_box(new), 32, &mut p, &mut q);
        });
        row("raid6 pq_update (4 KiB write)", blk, be, r);
    }
    let r = measure(secs, blk, || {
        pq_update(black_box(old), black_box(new), 5, &mut p, &mut q);
    });
    row("raid6 pq_update via public fn", blk, det, r);
    let rs = ReedSolomon::new(8, 3).unwrap();
    let mut par = fill(3, blk, 5);
    let mut delta = old.clone();
    let r = measure(secs, blk, || {
        delta.copy_from_slice(old);
        tessera_parity::xor_into(&mut delta, new);
        let mut pm: Vec<&mut [u8]> = par.iter_mut().map(|v| v.as_mut_slice()).collect();
        rs.update_parity(black_box(&delta), 5, &mut pm).unwrap();
    });
    row("RS 8+3 update_parity (incl. delta)", blk, det, r);
}
