//! Mirrored layouts (raid1, raid10) over fault-injecting devices: under a random-write
//! load, one device fails at a random moment (vanishes, or every read or write to its
//! data area fails); every byte stays correct against an in-memory model, the device shows
//! as failed and the pool as degraded, and both survive a reopen. Losing every copy of a
//! mirror set gives EIO for that set's stripes only.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;
use tessera_api::{DeviceHealth, PoolState};

use common::*;
use tessera_device::{BlockDevice, RamDevice};
use tessera_io::{IoHandle, IoOp, Tag};
use tessera_pool::format::DEV_DATA_START;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

const DEV_SIZE: u64 = 24 << 20;
const VOL_SIZE: usize = 8 << 20;

fn scenario(kind: LayoutKind, ndev: usize, victim: usize, fault: Fault, seed: u64) {
    let ram: Vec<Arc<RamDevice>> = (0..ndev)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap())
        .collect();
    let (devs, cfgs) = wrap(&ram);
    let pool = Pool::create(
        "m",
        devs,
        PoolOptions {
            layout: kind,
            unit_size: 64 << 10,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let vol = pool.create_volume("v", VOL_SIZE as u64).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let mut model = vec![0u8; VOL_SIZE];
    let mut rng = Rng(seed | 1);
    let ops = 600;
    let fail_at = 50 + rng.below(ops - 100);
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut op = 0;
    while op < ops {
        // A batch of concurrent writes; the fault may hit in the middle of one.
        bufs.clear();
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        let batch = 1 + rng.below(8) as usize;
        let mut tags = 0;
        for _ in 0..batch {
            if op == fail_at {
                inject(&cfgs[victim], fault);
            }
            op += 1;
            let len = 512 * (1 + rng.below(128) as usize);
            let off = 512 * rng.below(((VOL_SIZE - len) / 512) as u64) as usize;
            // Concurrent writes never overlap, so the model is order independent.
            let b = pattern(rng.next(), len);
            if ranges.iter().any(|&(o, l)| off < o + l && o < off + len) {
                continue;
            }
            ranges.push((off, len));
            model[off..off + len].copy_from_slice(&b);
            bufs.push(b);
            let b = bufs.last().unwrap();
            // SAFETY: `bufs` keeps every write's data, and outlives the drain below.
            unsafe {
                h.submit(
                    &mut io,
                    IoOp::Write {
                        offset: off as u64,
                        len: len as u32,
                        buf: b.as_ptr(),
                    },
                    Tag::task(0, tags),
                )
            };
            tags += 1;
        }
        let mut done = 0;
        io.run_until_idle(|_, _, r| {
            assert!(r >= 0, "write failed with {r} while a copy was healthy");
            done += 1;
        });
        assert_eq!(done, tags);
        // And a verifying read now and then.
        if rng.below(4) == 0 {
            let len = 512 * (1 + rng.below(64) as usize);
            let off = 512 * rng.below(((VOL_SIZE - len) / 512) as u64) as usize;
            let got = read(&mut io, &mut h, off as u64, len).expect("read");
            assert!(got == model[off..off + len], "read differs at {off}+{len}");
        }
    }
    assert_eq!(flush(&mut io, &mut h), 0);
    verify_all(&mut io, &mut h, &model, "mirror");
    let st = pool.status();
    assert_eq!(
        st.device_states[victim].state,
        DeviceHealth::Failed,
        "{kind:?} {fault:?}"
    );
    for (i, s) in st.device_states.iter().enumerate() {
        if i != victim {
            assert_eq!(s.state, DeviceHealth::Online);
        }
    }
    assert_eq!(st.state, PoolState::Degraded);
    drop(h);
    pool.shutdown().unwrap();
    drop(vol);
    drop(pool);

    // Restart with every device healthy again: the victim missed writes and stays failed.
    let (devs, _cfgs) = wrap(&ram);
    let pool = Pool::open(devs).unwrap();
    let st = pool.status();
    assert_eq!(st.device_states[victim].state, DeviceHealth::Failed);
    assert_eq!(st.state, PoolState::Degraded);
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    verify_all(&mut io, &mut h, &model, "mirror");
    drop(h);
    pool.shutdown().unwrap();
    drop(vol);
    drop(pool);

    // The victim replaced by a blank device (no label): the pool opens degraded with it
    // failed, and the data is still there.
    let mut ram2 = ram.clone();
    ram2[victim] = RamDevice::new(DEV_SIZE).unwrap();
    let (devs, _cfgs) = wrap(&ram2);
    let pool = Pool::open(devs).unwrap();
    let st = pool.status();
    assert_eq!(st.device_states[victim].state, DeviceHealth::Failed);
    assert_eq!(st.state, PoolState::Degraded);
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    verify_all(&mut io, &mut h, &model, "mirror");
}

#[test]
fn raid1_survives_any_one_device_failing() {
    let mut seed = 11;
    for ndev in [2usize, 3] {
        for victim in 0..ndev {
            for fault in [Fault::Vanish, Fault::FailReads, Fault::FailWrites] {
                seed += 7;
                scenario(
                    LayoutKind::Raid1 {
                        copies: ndev as u32,
                    },
                    ndev,
                    victim,
                    fault,
                    seed,
                );
            }
        }
    }
}

#[test]
fn raid10_survives_any_one_device_failing() {
    let mut seed = 5;
    for victim in 0..4 {
        for fault in [Fault::Vanish, Fault::FailReads, Fault::FailWrites] {
            seed += 13;
            scenario(
                LayoutKind::Raid10 {
                    copies: 2,
                    stripe: 16 << 10,
                },
                4,
                victim,
                fault,
                seed,
            );
        }
    }
}

#[test]
fn losing_every_copy_of_a_set_fails_only_its_stripes() {
    let stripe = 16u64 << 10;
    let ram: Vec<Arc<RamDevice>> = (0..4).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let (devs, cfgs) = wrap(&ram);
    let pool = Pool::create(
        "m",
        devs,
        PoolOptions {
            layout: LayoutKind::Raid10 { copies: 2, stripe },
            unit_size: 64 << 10,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let layout = pool.core.layout.clone();
    let base = pool.status().metadata;
    let mut io = core();
    let mut h = layout.open_handle();
    let n = 16u64;
    for s in 0..n {
        let data = pattern(s, stripe as usize);
        assert_eq!(write(&mut io, &mut h, base + s * stripe, &data), 0);
    }
    // Both copies of mirror set 0 (devices 0 and 1) go.
    cfgs[0].vanish();
    cfgs[1].fail_reads(DEV_DATA_START, u64::MAX);
    for s in 0..n {
        let off = base + s * stripe;
        let set = (off / stripe) % 2;
        let r = read(&mut io, &mut h, off, stripe as usize);
        if set == 0 {
            assert_eq!(r.unwrap_err(), -libc::EIO, "stripe {s}");
        } else {
            assert!(r.unwrap() == pattern(s, stripe as usize), "stripe {s}");
        }
    }
    // A read spanning both sets fails; the good set alone still reads.
    assert!(read(&mut io, &mut h, base, 2 * stripe as usize).is_err());
    assert_eq!(pool.status().state, PoolState::Failed);
    assert_eq!(pool.status().device_states[0].state, DeviceHealth::Failed);
    assert_eq!(pool.status().device_states[1].state, DeviceHealth::Failed);
}

#[test]
fn layouts_reject_bad_geometry() {
    let rams = |n: usize| -> Vec<Arc<dyn BlockDevice>> {
        (0..n)
            .map(|_| RamDevice::new(DEV_SIZE).unwrap() as Arc<dyn BlockDevice>)
            .collect()
    };
    assert!(tessera_pool::Layout::new(LayoutKind::Raid1 { copies: 3 }, rams(2)).is_err());
    assert!(tessera_pool::Layout::new(LayoutKind::Raid1 { copies: 1 }, rams(1)).is_err());
    assert!(tessera_pool::Layout::new(
        LayoutKind::Raid10 {
            copies: 2,
            stripe: 65536
        },
        rams(3)
    )
    .is_err());
    let l = tessera_pool::Layout::new(
        LayoutKind::Raid10 {
            copies: 2,
            stripe: 65536,
        },
        rams(6),
    )
    .unwrap();
    assert_eq!(l.size, 3 * ((DEV_SIZE - DEV_DATA_START) & !65535));
}

/// A FLUSH that fails on one copy of a mirror is answered (the other copy has the data),
/// but only once that copy is recorded failed in the healthy copy's label: the power goes
/// the moment the FLUSH is answered, the copy whose write cache was lost (it is the first
/// copy, the one reads and the resync prefer) comes back failed, and what the FLUSH made
/// durable reads back, also after the resync that follows an unclean stop.
#[test]
fn a_copy_whose_flush_failed_is_stale_after_a_power_loss() {
    use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
    use tessera_device::{FaultConfig, FaultDevice};
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let caches: Vec<Arc<CacheDevice>> = (0..2)
        .map(|_| CacheDevice::new(RamDevice::new(DEV_SIZE).unwrap(), budget.clone()))
        .collect();
    let devs = |cfgs: &[Arc<FaultConfig>]| -> Vec<Arc<dyn BlockDevice>> {
        caches
            .iter()
            .zip(cfgs)
            .map(|(c, f)| FaultDevice::new(c.clone(), f.clone()) as Arc<dyn BlockDevice>)
            .collect()
    };
    let cfgs: Vec<Arc<FaultConfig>> = (0..2).map(|_| Arc::default()).collect();
    let pool = Pool::create(
        "m",
        devs(&cfgs),
        PoolOptions {
            layout: LayoutKind::Raid1 { copies: 2 },
            unit_size: 64 << 10,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let vol = pool.create_volume("v", VOL_SIZE as u64).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    // Whole units into fresh space: nothing is zeroed in the background meanwhile.
    let data = pattern(0x5eed, 4 << 16);
    assert!(write(&mut io, &mut h, 0, &data) >= 0, "write");
    cfgs[0].fail_flushes(true);
    assert_eq!(
        flush(&mut io, &mut h),
        0,
        "the flush fails on one copy only"
    );
    // Power lost right after the answer: every write since a device's last successful
    // flush survives or not, by chance.
    budget.store(0, SeqCst);
    drop(h);
    drop(vol);
    drop(pool);
    let mut rng = Rng(7);
    for c in &caches {
        c.power_loss(&mut rng);
    }
    budget.store(i64::MAX, SeqCst);

    let cfgs: Vec<Arc<FaultConfig>> = (0..2).map(|_| Arc::default()).collect();
    let pool = Pool::open(devs(&cfgs)).unwrap();
    let st = pool.status();
    assert_eq!(
        (
            st.device_states[0].state.as_str(),
            st.device_states[1].state.as_str()
        ),
        ("failed", "online"),
        "the copy whose flush failed must open stale: {:?}",
        st.device_states
    );
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    assert!(
        read(&mut io, &mut h, 0, data.len()).unwrap() == data,
        "data acknowledged by the flush was lost"
    );
    // The resync after an unclean stop copies from healthy copies only.
    let l = &pool.core.layout;
    l.scrub_range(0, l.size, true).unwrap();
    assert!(
        read(&mut io, &mut h, 0, data.len()).unwrap() == data,
        "data acknowledged by the flush was lost by the resync"
    );
}
