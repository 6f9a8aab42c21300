//! Rebuild of mirrored pools: a failed device comes back (blank), is rebuilt unit by
//! unit while a client keeps writing, becomes healthy, and then serves every byte alone
//! once the other copy fails — also after a reopen.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use tessera_api::{DeviceHealth, PoolState};

use common::*;
use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{IoHandle, IoOp, Tag};
use tessera_pool::{LayoutKind, Pool, PoolOptions};

const DEV_SIZE: u64 = 24 << 20;
const VOL_SIZE: usize = 8 << 20;

/// A batch of concurrent, non-overlapping random writes, recorded in `model`.
fn write_batch(io: &mut tessera_io::CoreIo, h: &mut dyn IoHandle, model: &mut [u8], rng: &mut Rng) {
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for _ in 0..8 {
        let len = 512 * (1 + rng.below(64) as usize);
        let off = 512 * rng.below(((VOL_SIZE - len) / 512) as u64) as usize;
        if ranges.iter().any(|&(o, l)| off < o + l && o < off + len) {
            continue;
        }
        ranges.push((off, len));
        let b = pattern(rng.next(), len);
        model[off..off + len].copy_from_slice(&b);
        bufs.push(b);
        let b = bufs.last().unwrap();
        // SAFETY: `bufs` keeps every write's data, and outlives the drain below.
        unsafe {
            h.submit(
                io,
                IoOp::Write {
                    offset: off as u64,
                    len: len as u32,
                    buf: b.as_ptr(),
                },
                Tag::task(0, ranges.len() as u32),
            )
        };
    }
    let mut n = 0;
    io.run_until_idle(|_, _, r| {
        assert!(r >= 0, "write failed with {r}");
        n += 1;
    });
    assert_eq!(n, ranges.len());
}

fn rebuild_scenario(kind: LayoutKind, ndev: usize, victim: usize, other: usize, seed: u64) {
    let ram = ram_devices(ndev, DEV_SIZE);
    let (devs, cfgs) = wrap(&ram);
    let pool = Arc::new(
        Pool::create(
            "r",
            devs.clone(),
            PoolOptions {
                layout: kind,
                unit_size: 64 << 10,
                force: false,
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let vol = pool.create_volume("v", VOL_SIZE as u64).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let mut model = pattern(seed, VOL_SIZE);
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    let mut rng = Rng(seed | 1);

    // The victim vanishes; writes continue degraded.
    cfgs[victim].vanish();
    for _ in 0..20 {
        write_batch(&mut io, &mut h, &mut model, &mut rng);
    }
    assert_eq!(flush(&mut io, &mut h), 0);
    assert!(pool.core.layout.is_failed(victim));
    // It comes back blank (a replacement in the same slot).
    ram[victim]
        .write_zeroes_at(0, DEV_SIZE)
        .expect("blank the device");
    cfgs[victim].vanished.store(false, Relaxed);

    pool.start_rebuild(victim).unwrap();
    assert_eq!(pool.status().state, PoolState::Rebuilding);
    let units = pool.rebuild_units();
    let done = Arc::new(AtomicBool::new(false));
    let t = {
        let (pool, done) = (pool.clone(), done.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 << 10];
            let mut bytes = 0;
            for &u in &units {
                bytes += pool.rebuild_unit(victim, u, &mut buf).unwrap();
                // Give the client a chance to race each unit.
                std::thread::yield_now();
            }
            done.store(true, Relaxed);
            bytes
        })
    };
    // A client writes all along the rebuild.
    let mut batches = 0;
    while !done.load(Relaxed) {
        write_batch(&mut io, &mut h, &mut model, &mut rng);
        batches += 1;
    }
    let bytes = t.join().unwrap();
    assert!(bytes > 0);
    assert!(batches > 0);
    pool.finish_rebuild(victim).unwrap();
    let st = pool.status();
    assert_eq!(st.state, PoolState::Online);
    assert!(st
        .device_states
        .iter()
        .all(|d| d.state == DeviceHealth::Online));
    verify_all(&mut io, &mut h, &model, "rebuild");

    // The other copy fails: every byte comes from the rebuilt device.
    // (Writes reach every copy, so they find it gone whatever the reads' rotation.)
    cfgs[other].vanish();
    for _ in 0..10 {
        write_batch(&mut io, &mut h, &mut model, &mut rng);
    }
    assert!(pool.core.layout.is_failed(other));
    verify_all(&mut io, &mut h, &model, "rebuild");
    assert_eq!(flush(&mut io, &mut h), 0);
    drop(h);
    drop(vol);
    let pool = Arc::try_unwrap(pool).ok().expect("no other reference");
    pool.shutdown().unwrap();
    drop(pool);

    // Reopen with the other copy still gone: the labels say the rebuilt device is good.
    let pool = Pool::open(devs).unwrap();
    assert!(pool.core.layout.is_failed(other));
    assert!(!pool.core.layout.is_failed(victim));
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    verify_all(&mut io, &mut h, &model, "rebuild");
}

#[test]
fn raid1_rebuild_with_client_writes_then_other_copy_fails() {
    rebuild_scenario(LayoutKind::Raid1 { copies: 2 }, 2, 1, 0, 0x5eed);
    rebuild_scenario(LayoutKind::Raid1 { copies: 2 }, 2, 0, 1, 0xbeef);
}

#[test]
fn raid10_rebuild_with_client_writes_then_other_copy_fails() {
    rebuild_scenario(
        LayoutKind::Raid10 {
            copies: 2,
            stripe: 64 << 10,
        },
        4,
        3,
        2,
        0x1234,
    );
}

#[test]
fn a_device_mid_rebuild_stays_failed_after_reopen() {
    let ram: Vec<Arc<RamDevice>> = (0..2).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let cfgs: Vec<Arc<FaultConfig>> = ram.iter().map(|_| Arc::default()).collect();
    let devs: Vec<Arc<dyn BlockDevice>> = ram
        .iter()
        .zip(&cfgs)
        .map(|(r, c)| FaultDevice::new(r.clone(), c.clone()) as Arc<dyn BlockDevice>)
        .collect();
    let pool = Pool::create(
        "r",
        devs.clone(),
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
    let model = pattern(7, VOL_SIZE);
    cfgs[1].vanish();
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    assert_eq!(flush(&mut io, &mut h), 0);
    cfgs[1].vanished.store(false, Relaxed);
    pool.start_rebuild(1).unwrap();
    let units = pool.rebuild_units();
    let mut buf = vec![0u8; 64 << 10];
    for &u in &units[..units.len() / 2] {
        pool.rebuild_unit(1, u, &mut buf).unwrap();
    }
    pool.commit().unwrap();
    drop(h);
    drop(vol);
    pool.shutdown().unwrap();
    drop(pool);
    let pool = Pool::open(devs).unwrap();
    assert!(
        pool.core.layout.is_failed(1),
        "half-rebuilt device must stay failed"
    );
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    verify_all(&mut io, &mut h, &model, "rebuild");
}

/// A client that rewrites the same blocks without pause, through the datapath (several
/// writes in flight) and through the synchronous face, must not starve a rebuild or a
/// scrub: after a few disturbed attempts, new writes to the range being copied wait for
/// one copy. Without that hold this test never ends (it fails at its deadline).
#[test]
fn blocks_rewritten_without_pause_do_not_starve_rebuild_or_scrub() {
    use std::sync::mpsc;
    use std::time::Duration;
    use tessera_pool::layout::{FailReason, Layout};

    let ram: Vec<Arc<RamDevice>> = (0..2).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    // Datapath writes take 500 µs: with 16 always in flight, every copy attempt (which
    // waits for the writes begun before it) sees new writes to its range begin.
    let (devs, cfgs) = wrap(&ram);
    for c in &cfgs {
        c.latency_us.store(500, Relaxed);
    }
    let layout = Arc::new(Layout::new(LayoutKind::Raid1 { copies: 2 }, devs).unwrap());
    let hot = 1u64 << 20; // the datapath writer's block
    let hot_sync = 3u64 << 20; // the synchronous writer's block
    let stop = Arc::new(AtomicBool::new(false));
    let writers = {
        let (l1, s1) = (layout.clone(), stop.clone());
        let (l2, s2) = (layout.clone(), stop.clone());
        [
            std::thread::spawn(move || {
                let mut io = core();
                let mut h = l1.open_handle();
                let mut n = 0u64;
                while !s1.load(Relaxed) {
                    let bufs: Vec<Vec<u8>> = (0..16).map(|i| pattern(n + i, 4096)).collect();
                    for (i, b) in bufs.iter().enumerate() {
                        // SAFETY: `bufs` keeps every write's data, and outlives the drain
                        // below.
                        unsafe {
                            h.submit(
                                &mut io,
                                IoOp::Write {
                                    offset: hot,
                                    len: 4096,
                                    buf: b.as_ptr(),
                                },
                                Tag::task(0, i as u32),
                            )
                        };
                    }
                    io.run_until_idle(|_, _, r| assert!(r >= 0, "write failed: {r}"));
                    n += 16;
                }
            }),
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !s2.load(Relaxed) {
                    l2.write_at(hot_sync, &pattern(n, 4096)).unwrap();
                    n += 1;
                }
            }),
        ]
    };
    std::thread::sleep(Duration::from_millis(20));
    let run = |what: &'static str, f: Box<dyn FnOnce() + Send>| {
        let (tx, rx) = mpsc::channel();
        let t = std::thread::spawn(move || {
            f();
            tx.send(()).unwrap();
        });
        if rx.recv_timeout(Duration::from_secs(15)).is_err() {
            stop.store(true, Relaxed);
            panic!("{what} starved by the rewritten blocks (no end after 15 s; it takes under a second)");
        }
        t.join().unwrap();
    };
    // Rebuild device 1 (as if replaced) while both writers run.
    layout.mark_failed(1, FailReason::Gone);
    layout.start_rebuild(1).unwrap();
    let l = layout.clone();
    run(
        "rebuild",
        Box::new(move || {
            let mut buf = vec![0u8; 1 << 20];
            let mut at = 0;
            while at < l.size {
                let n = (l.size - at).min(1 << 20) as usize;
                l.rebuild_range(1, at, &mut buf[..n]).unwrap();
                at += n as u64;
            }
            l.finish_rebuild(1);
        }),
    );
    // Scrub (with repair) while both writers still run.
    let l = layout.clone();
    run(
        "scrub",
        Box::new(move || {
            let _t = l.track_writes();
            let f = l.scrub_range(0, l.size, true).unwrap();
            assert_eq!(f.repaired, 0, "the rebuilt copy differs: {f:?}");
        }),
    );
    stop.store(true, Relaxed);
    for w in writers {
        w.join().unwrap();
    }
    // Both copies hold the same bytes, the writers' last ones included.
    let (mut a, mut b) = (vec![0u8; DEV_SIZE as usize], vec![0u8; DEV_SIZE as usize]);
    ram[0].read_at(0, &mut a).unwrap();
    ram[1].read_at(0, &mut b).unwrap();
    assert!(
        a[1 << 20..] == b[1 << 20..],
        "the copies differ after the rebuild"
    );
}
