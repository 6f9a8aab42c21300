//! Crash consistency: run random writes, trims and flushes against a pool on
//! crash-simulating devices, "lose power" at random moments (unflushed writes dropped,
//! one possibly torn), reopen, and check that
//! - the metadata always opens (never corrupt),
//! - every block whose last write was followed by a completed flush reads back,
//! - space accounting adds up (no leaks, no unit owned twice),
//!
//! The reopened pool survives a second crash the same way.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use common::*;
use tessera_device::BlockDevice;
use tessera_io::IoOp;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

const BLK: u64 = 4096;
const UNIT: u64 = 64 << 10;

fn crash_devs(images: Option<Vec<Vec<u8>>>) -> Vec<Arc<CrashDevice>> {
    match images {
        None => (0..2).map(|_| CrashDevice::new(12 << 20)).collect(),
        Some(imgs) => imgs.into_iter().map(CrashDevice::from_image).collect(),
    }
}

fn as_block(devs: &[Arc<CrashDevice>]) -> Vec<Arc<dyn BlockDevice>> {
    devs.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

/// Per block: the content guaranteed after a crash (None = unknown since last flush).
type Durable = HashMap<u64, Option<Vec<u8>>>;

fn workload(pool: &Pool, vol_name: &str, rng: &mut Rng, steps: usize, durable: &mut Durable) {
    let vol = pool.volume(vol_name).unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    let blocks = vol.size() / BLK;
    // Content written since the last flush, per block.
    let mut pending: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    for _ in 0..steps {
        match rng.next() % 10 {
            0..=5 => {
                let b = rng.next() % (blocks - 4);
                let n = 1 + rng.next() % 4;
                let data = pattern(rng.next(), (n * BLK) as usize);
                assert!(write(&mut io, &mut h, b * BLK, &data) >= 0);
                for i in 0..n {
                    let s = (i * BLK) as usize;
                    pending.insert(b + i, Some(data[s..s + BLK as usize].to_vec()));
                }
            }
            6 => {
                // Trim one whole unit: its contents become unknown.
                let u = rng.next() % (vol.size() / UNIT);
                assert_eq!(
                    run(
                        &mut io,
                        &mut h,
                        IoOp::Discard {
                            offset: u * UNIT,
                            len: UNIT
                        }
                    ),
                    0
                );
                for b in u * UNIT / BLK..(u + 1) * UNIT / BLK {
                    pending.insert(b, None);
                }
            }
            _ => {
                assert_eq!(flush(&mut io, &mut h), 0);
                for (b, v) in pending.drain() {
                    durable.insert(b, v);
                }
            }
        }
    }
    // Whatever is pending at the crash is unknown afterwards.
    for (b, _) in pending.drain() {
        durable.insert(b, None);
    }
}

fn verify(pool: &Pool, vol_name: &str, durable: &Durable) {
    let vol = pool.volume(vol_name).expect("volume survives the crash");
    let mut h = vol.open_handle();
    let mut io = core();
    for b in 0..vol.size() / BLK {
        let got = read(&mut io, &mut h, b * BLK, BLK as usize).unwrap();
        match durable.get(&b) {
            Some(Some(want)) => assert_eq!(&got, want, "flushed block {b} lost"),
            Some(None) => {}
            None => assert!(
                got.iter().all(|&x| x == 0),
                "never-written block {b} is not zero"
            ),
        }
    }
    let st = pool.status();
    assert_eq!(
        st.allocated,
        vol.allocated_bytes(),
        "space leaked or double-owned"
    );
    assert_eq!(st.allocated + st.free, st.capacity);
}

#[test]
fn flushed_data_and_metadata_survive_random_crashes() {
    for seed in 1..=12u64 {
        let mut rng = Rng(seed.wrapping_mul(0x2545F4914F6CDD1D));
        let devs = crash_devs(None);
        let layout = if seed % 2 == 0 {
            LayoutKind::Raid0 { stripe: 16384 }
        } else {
            LayoutKind::Concat
        };
        let pool = Pool::create(
            "p",
            as_block(&devs),
            PoolOptions {
                layout,
                unit_size: UNIT,
                force: false,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        pool.create_volume("v", 4 << 20).unwrap();
        let mut durable = Durable::new();
        workload(&pool, "v", &mut rng, 300, &mut durable);
        // Power loss: every device loses its unflushed writes independently.
        let images: Vec<Vec<u8>> = devs.iter().map(|d| d.crash_image(rng.next())).collect();
        drop(pool);
        let devs2 = crash_devs(Some(images));
        let pool2 = Pool::open(as_block(&devs2))
            .unwrap_or_else(|e| panic!("seed {seed}: metadata corrupt after crash: {e}"));
        verify(&pool2, "v", &durable);
        // Keep going on the recovered pool and crash again.
        workload(&pool2, "v", &mut rng, 200, &mut durable);
        let images: Vec<Vec<u8>> = devs2.iter().map(|d| d.crash_image(rng.next())).collect();
        drop(pool2);
        let pool3 = Pool::open(as_block(&crash_devs(Some(images)))).unwrap();
        verify(&pool3, "v", &durable);
    }
}

/// A pool on two crash devices on one power switch, with the switch's count at the end
/// of the pool's creation.
fn pool_on_power(power: &Arc<PowerSwitch>) -> (Pool, Vec<Arc<CrashDevice>>) {
    let devs: Vec<_> = (0..2)
        .map(|_| CrashDevice::on_power(12 << 20, power))
        .collect();
    let pool = Pool::create(
        "p",
        as_block(&devs),
        PoolOptions {
            unit_size: UNIT,
            ..Default::default()
        },
    )
    .unwrap();
    (pool, devs)
}

#[test]
fn crash_during_volume_creation_leaves_a_consistent_catalog() {
    // How many device writes and flushes a volume creation makes.
    let power = PowerSwitch::new();
    let (pool, _devs) = pool_on_power(&power);
    let before = power.ops();
    pool.create_volume("a", 1 << 20).unwrap();
    let during = power.ops() - before;
    assert!(during > 0, "creating a volume wrote nothing");
    eprintln!("a volume creation makes {during} device writes and flushes");
    drop(pool);

    // The power goes out before each of those operations (and after the last), with
    // several choices of which unflushed writes land: the pool opens, and the volume is
    // either whole (its full size, writable, reads back) or absent (and its name free).
    for cut in 0..=during {
        for seed in 1..=3u64 {
            let power = PowerSwitch::new();
            let (pool, devs) = pool_on_power(&power);
            power.cut_after(cut);
            pool.create_volume("a", 1 << 20).unwrap();
            let images: Vec<Vec<u8>> = devs.iter().map(|d| d.crash_image(seed)).collect();
            drop(pool);
            let pool2 = Pool::open(as_block(&crash_devs(Some(images)))).unwrap_or_else(|e| {
                panic!("power cut after {cut} of {during} operations (seed {seed}): {e}")
            });
            let vol = match pool2.volume("a") {
                Some(v) => v,
                None => {
                    assert!(
                        cut < during,
                        "the volume is lost after its creation completed"
                    );
                    pool2.create_volume("a", 1 << 20).unwrap_or_else(|e| {
                        panic!(
                            "cut after {cut}: the name of a volume that is not there is taken: {e}"
                        )
                    })
                }
            };
            assert_eq!(vol.size(), 1 << 20, "cut after {cut} (seed {seed})");
            let data = pattern(cut * 10 + seed, 2 * BLK as usize);
            let mut h = vol.open_handle();
            let mut io = core();
            assert!(write(&mut io, &mut h, 3 * BLK, &data) >= 0);
            assert_eq!(read(&mut io, &mut h, 3 * BLK, data.len()).unwrap(), data);
            drop(h);
            let st = pool2.status();
            assert_eq!(st.allocated, vol.allocated_bytes(), "cut after {cut}");
            assert_eq!(st.allocated + st.free, st.capacity, "cut after {cut}");
        }
    }
}
