//! Rebuild of mirrored pools: a failed device comes back (blank), is rebuilt unit by
//! unit while a client keeps writing, becomes healthy, and then serves every byte alone
//! once the other copy fails — also after a reopen.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use common::*;
use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{IoHandle, IoOp};
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
        h.submit(
            io,
            IoOp::Write {
                offset: off as u64,
                len: len as u32,
                buf: b.as_ptr(),
            },
            ranges.len() as u64,
        );
    }
    let mut n = 0;
    io.run_until_idle(|_, _, r| {
        assert!(r >= 0, "write failed with {r}");
        n += 1;
    });
    assert_eq!(n, ranges.len());
}

fn rebuild_scenario(kind: LayoutKind, ndev: usize, victim: usize, other: usize, seed: u64) {
    let ram: Vec<Arc<RamDevice>> = (0..ndev)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap())
        .collect();
    let cfgs: Vec<Arc<FaultConfig>> = ram.iter().map(|_| Arc::default()).collect();
    let devs: Vec<Arc<dyn BlockDevice>> = ram
        .iter()
        .zip(&cfgs)
        .map(|(r, c)| FaultDevice::new(r.clone(), c.clone()) as Arc<dyn BlockDevice>)
        .collect();
    let pool = Arc::new(
        Pool::create(
            "r",
            devs.clone(),
            PoolOptions {
                layout: kind,
                unit_size: 64 << 10,
                force: false,
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
    assert_eq!(pool.status().state, "rebuilding");
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
    assert_eq!(st.state, "online");
    assert!(st.device_states.iter().all(|(s, _)| s == "online"));
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
