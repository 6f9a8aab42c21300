//! Write-back (issue 24) against a model: every acknowledged write survives a kill -9
//! (the devices' current bytes) and every flushed one a power loss (the test kit's
//! model: each device keeps a random part of its unflushed writes, one maybe torn); the
//! cleaner drains to the pool's devices; freed units, snapshots, a mode switch that
//! drains, and a cache that fails with dirty data on it.

// Test sizes are small constants: their casts to usize do not truncate.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tessera_device::{BlockDevice, CrashDevice, FaultConfig, FaultDevice, PowerSwitch};
use tessera_io::{CoreIo, IoOp};
use tessera_pool::cache_tier::{CacheInfo, CacheMode};
use tessera_pool::{Pool, PoolOptions, VolumeHandle};
use tessera_testkit::node::wait_for_every;

const MIB: u64 = 1 << 20;
const BLK: u64 = 4096;
/// Cache units of 64 KiB: many slots in a small cache.
const CUNIT: u64 = 64 << 10;
/// How often a wait polls the tier's state: the cleaner's steps take milliseconds.
const FAST: Duration = Duration::from_millis(5);

struct Rig {
    pool: Pool,
    pdev: Arc<CrashDevice>,
    cdevs: Vec<Arc<CrashDevice>>,
}

fn dyns(d: &[Arc<CrashDevice>]) -> Vec<Arc<dyn BlockDevice>> {
    d.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

/// A pool of `pool_mib` on a crash device with a mirrored write-back cache of about
/// `cache_mib` on two more, all on one machine's power.
fn rig(pool_mib: u64, cache_mib: u64) -> Rig {
    rig_on(pool_mib, cache_mib, &PowerSwitch::new())
}

fn rig_on(pool_mib: u64, cache_mib: u64, power: &Arc<PowerSwitch>) -> Rig {
    let pdev = CrashDevice::on_power(pool_mib * MIB, power);
    let pool = Pool::create(
        "p",
        dyns(std::slice::from_ref(&pdev)),
        PoolOptions {
            unit_size: 64 << 10,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let cdevs: Vec<_> = (0..2)
        .map(|_| CrashDevice::on_power((cache_mib + 2) * MIB, power))
        .collect();
    pool.attach_cache(dyns(&cdevs), CacheMode::WriteBack, CUNIT, false, false)
        .unwrap();
    Rig { pool, pdev, cdevs }
}

/// The pool and its cache again, from device images (a restart after a crash).
fn reopen(pool_img: Vec<u8>, cache_imgs: Vec<Vec<u8>>, mode: CacheMode) -> Rig {
    let pdev = CrashDevice::from_image(pool_img);
    let pool = Pool::open(dyns(std::slice::from_ref(&pdev))).expect("the pool opens");
    let cdevs: Vec<_> = cache_imgs
        .into_iter()
        .map(CrashDevice::from_image)
        .collect();
    pool.attach_cache(dyns(&cdevs), mode, CUNIT, false, true)
        .expect("the cache reopens");
    Rig { pool, pdev, cdevs }
}

/// What a process killed now leaves on a device: everything it wrote.
fn current(d: &CrashDevice) -> Vec<u8> {
    let mut b = vec![0u8; d.size() as usize];
    d.read_at(0, &mut b).unwrap();
    b
}

fn status(p: &Pool) -> CacheInfo {
    p.cache_status().expect("a cache")
}

/// Random whole-block writes (mostly), unaligned writes, discards and reads over
/// `model`, checked as they go.
fn churn(io: &mut CoreIo, h: &mut VolumeHandle, model: &mut [u8], rng: &mut Rng, ops: usize) {
    let size = model.len() as u64;
    for i in 0..ops {
        let (off, len) = match rng.below(8) {
            0 => (rng.below(size / 512 - 16) * 512, 512 * (1 + rng.below(16))),
            1 => (rng.below(size / BLK - 64) * BLK, BLK * (1 + rng.below(64))),
            _ => (rng.below(size / BLK - 4) * BLK, BLK * (1 + rng.below(4))),
        };
        let (o, l) = (off as usize, len as usize);
        match rng.below(10) {
            0..=4 => {
                let data = pattern(rng.next() | 1, l);
                assert_eq!(write(io, h, off, &data), 0, "write {i}");
                model[o..o + l].copy_from_slice(&data);
            }
            5 if off % BLK == 0 && len % BLK == 0 => {
                let op = IoOp::WriteZeroes {
                    offset: off,
                    len,
                    may_unmap: false,
                };
                assert_eq!(run(io, h, op), 0, "write-zeroes {i}");
                model[o..o + l].fill(0);
            }
            _ => {
                let got = read(io, h, off, l).unwrap();
                if got != model[o..o + l] {
                    let bad: Vec<(usize, bool)> = (0..l / 512)
                        .filter(|&s| {
                            got[s * 512..(s + 1) * 512] != model[o + s * 512..o + (s + 1) * 512]
                        })
                        .map(|s| (s, got[s * 512..(s + 1) * 512].iter().all(|&x| x == 0)))
                        .collect();
                    panic!("op {i}: read of {len} at {off} differs from the model: sectors (index, zero) {bad:?}");
                }
            }
        }
    }
}

fn check_all(io: &mut CoreIo, h: &mut VolumeHandle, model: &[u8], what: &str) {
    for (k, chunk) in model.chunks(256 << 10).enumerate() {
        let off = (k as u64) * (256 << 10);
        let got = read(io, h, off, chunk.len()).unwrap();
        if got != chunk {
            let bad: Vec<usize> = (0..chunk.len() / 4096)
                .filter(|&b| got[b * 4096..(b + 1) * 4096] != chunk[b * 4096..(b + 1) * 4096])
                .collect();
            let b = bad[0];
            let zero = got[b * 4096..(b + 1) * 4096].iter().all(|&x| x == 0);
            panic!(
                "{what}: bytes at {off} differ from the model: blocks {bad:?} (first zero: {zero})"
            );
        }
    }
}

#[test]
fn write_back_reads_back_every_write_and_drains_to_the_pool() {
    let r = rig(64, 8);
    let vol = r.pool.create_volume("v", 24 * MIB).unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    let mut model = vec![0u8; vol.size() as usize];
    let mut rng = Rng(7);
    churn(&mut io, &mut h, &mut model, &mut rng, 3000);
    let s = status(&r.pool);
    assert!(
        s.dirty_bytes > 0 || s.cleaned_bytes > 0,
        "nothing went to the cache: {s:?}"
    );
    check_all(&mut io, &mut h, &model, "write-back");
    // Out of write-back: everything drains, then the pool alone has every byte.
    r.pool
        .set_cache_mode(CacheMode::WriteThrough, false)
        .unwrap();
    churn(&mut io, &mut h, &mut model, &mut rng, 500);
    wait_for_every("the drain", 60, FAST, || {
        let s = status(&r.pool);
        s.dirty_bytes == 0 && s.state == "ok"
    });
    assert!(status(&r.pool).cleaned_bytes > 0);
    r.pool.detach_cache().expect("a drained cache comes off");
    check_all(&mut io, &mut h, &model, "the pool alone after the drain");
}

#[test]
fn a_write_back_cache_is_not_removed_with_dirty_data_nor_on_one_device_unforced() {
    let r = rig(32, 4);
    let vol = r.pool.create_volume("v", 8 * MIB).unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    assert_eq!(write(&mut io, &mut h, 0, &pattern(1, 64 << 10)), 0);
    let err = r.pool.detach_cache().err().expect("refused").to_string();
    assert!(err.contains("write-through first"), "{err}");
    // One device: only forced.
    let (pool2, _) = plain_pool();
    let one = CrashDevice::new(8 * MIB);
    let err = pool2
        .attach_cache(
            dyns(std::slice::from_ref(&one)),
            CacheMode::WriteBack,
            CUNIT,
            false,
            false,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("one cache device"), "{err}");
    pool2
        .attach_cache(dyns(&[one]), CacheMode::WriteBack, CUNIT, true, false)
        .expect("forced");
}

fn plain_pool() -> (Pool, Arc<CrashDevice>) {
    let pdev = CrashDevice::new(32 * MIB);
    let pool = Pool::create(
        "q",
        dyns(std::slice::from_ref(&pdev)),
        PoolOptions::default(),
    )
    .unwrap();
    (pool, pdev)
}

/// Kill -9: the devices keep every write the process made, flushed or not; every
/// acknowledged write is read back after the restart, from the cache first, then from
/// the pool's devices once drained.
#[test]
fn kill_9_in_write_back_loses_no_acknowledged_write() {
    for seed in 1..=4u64 {
        let r = rig(64, 4);
        let vol = r.pool.create_volume("v", 16 * MIB).unwrap();
        let mut model = vec![0u8; vol.size() as usize];
        {
            let mut h = vol.open_handle();
            let mut io = core();
            let mut rng = Rng(seed);
            // Every unit allocated and its mapping durable (a kill -9 before a commit
            // loses a new unit's mapping in any pool, cache or not: docs/format.md §3),
            // then nothing flushed.
            for (k, chunk) in model.chunks_mut(MIB as usize).enumerate() {
                let d = pattern(seed * 1000 + k as u64, MIB as usize);
                assert_eq!(write(&mut io, &mut h, k as u64 * MIB, &d), 0);
                chunk.copy_from_slice(&d);
            }
            assert_eq!(flush(&mut io, &mut h), 0);
            churn(&mut io, &mut h, &mut model, &mut rng, 1600);
        }
        assert!(
            status(&r.pool).dirty_bytes > 0,
            "seed {seed}: nothing dirty"
        );
        // The kill: nothing runs after it (the tier's cleaner would otherwise go on
        // between the images of one device and the next).
        r.pool.core.cache_tier().unwrap().stop_threads();
        let pimg = current(&r.pdev);
        let cimgs: Vec<_> = r.cdevs.iter().map(|d| current(d)).collect();
        drop(vol);
        drop(r);
        let r2 = reopen(pimg, cimgs, CacheMode::WriteBack);
        let vol = r2.pool.volume("v").unwrap();
        let mut h = vol.open_handle();
        let mut io = core();
        check_all(
            &mut io,
            &mut h,
            &model,
            &format!("seed {seed}: after kill -9"),
        );
        r2.pool
            .set_cache_mode(CacheMode::WriteThrough, false)
            .unwrap();
        wait_for_every("the drain", 60, FAST, || status(&r2.pool).dirty_bytes == 0);
        r2.pool.detach_cache().unwrap();
        check_all(&mut io, &mut h, &model, &format!("seed {seed}: drained"));
    }
}

/// Power loss: each device keeps what it had at its last sync plus a random part of
/// what came after (one write maybe torn). Every block written before the last FLUSH
/// and not after reads back as flushed; each sector of a block written after reads back
/// as it was at that FLUSH or as one of the values it had since.
#[test]
fn power_loss_in_write_back_keeps_every_flushed_write() {
    for seed in 1..=8u64 {
        let power = PowerSwitch::new();
        let r = rig_on(64, 4, &power);
        let vol = r.pool.create_volume("v", 16 * MIB).unwrap();
        let blocks = vol.size() / BLK;
        // Per block: the value at the last FLUSH, and those it took since.
        let mut flushed: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut since: HashMap<u64, Vec<Vec<u8>>> = HashMap::new();
        let mut all: HashMap<u64, Vec<Vec<u8>>> = HashMap::new();
        let mut rng = Rng(seed * 31 + 1);
        // Half the runs keep the dirty data in the cache (only writes that wait for a
        // unit get it cleaned).
        let paused = seed % 2 == 1;
        r.pool.core.cache_tier().unwrap().pause_cleaner(paused);
        {
            let mut h = vol.open_handle();
            let mut io = core();
            for step in 0..1500 {
                if rng.below(60) == 0 || step == 1499 {
                    assert_eq!(flush(&mut io, &mut h), 0);
                    for (b, vals) in since.drain() {
                        flushed.insert(b, vals.last().unwrap().clone());
                    }
                    if step == 1499 {
                        break;
                    }
                    continue;
                }
                // Hot blocks rewritten often (the cleaner must move them first), and
                // scattered ones.
                let b = if rng.below(2) == 0 {
                    rng.below(64)
                } else {
                    rng.below(blocks - 4)
                };
                let n = 1 + rng.below(4);
                let data = pattern(rng.next() | 1, (n * BLK) as usize);
                assert_eq!(write(&mut io, &mut h, b * BLK, &data), 0);
                for i in 0..n {
                    let s = (i * BLK) as usize;
                    since
                        .entry(b + i)
                        .or_default()
                        .push(data[s..s + BLK as usize].to_vec());
                    all.entry(b + i)
                        .or_default()
                        .push(data[s..s + BLK as usize].to_vec());
                }
            }
            // Writes after the last flush, lost or kept at random by the power loss.
            for _ in 0..300 {
                let b = rng.below(blocks - 1);
                let data = pattern(rng.next() | 1, BLK as usize);
                assert_eq!(write(&mut io, &mut h, b * BLK, &data), 0);
                since.entry(b).or_default().push(data);
            }
        }
        if paused {
            assert!(
                status(&r.pool).dirty_bytes > 0,
                "seed {seed}: nothing dirty"
            );
        }
        // One instant for every device (the cleaner may be running).
        power.cut_after(0);
        let pimg = r.pdev.crash_image(rng.next());
        let cimgs: Vec<_> = r.cdevs.iter().map(|d| d.crash_image(rng.next())).collect();
        drop(vol);
        drop(r);
        let r2 = reopen(pimg, cimgs, CacheMode::WriteBack);
        let vol = r2.pool.volume("v").unwrap();
        let mut h = vol.open_handle();
        let mut io = core();
        for b in 0..blocks {
            let got = read(&mut io, &mut h, b * BLK, BLK as usize).unwrap();
            let zero = vec![0u8; BLK as usize];
            let before = flushed.get(&b).unwrap_or(&zero);
            // Sector by sector: a write cut by the power loss may have landed in part.
            let later = since.get(&b).map_or(&[][..], |v| &v[..]);
            let ok = (0..BLK as usize / 512).all(|s| {
                let r = s * 512..(s + 1) * 512;
                got[r.clone()] == before[r.clone()]
                    || later.iter().any(|v| v[r.clone()] == got[r.clone()])
            });
            let hist = all.get(&b).map(|h| h.iter().position(|v| v == &got));
            assert!(
                ok,
                "seed {seed}: block {b} reads neither its flushed value nor a later one \
                 (zero: {}, place in its history: {hist:?} of {})",
                got.iter().all(|&x| x == 0),
                all.get(&b).map_or(0, |h| h.len())
            );
        }
    }
}

/// A unit freed with dirty data on the cache and given to another volume shows that
/// volume nothing of the old owner's, also after a restart.
#[test]
fn a_freed_units_dirty_data_never_reaches_its_next_owner() {
    // The pool holds one such volume and a little more: the next one takes most of the
    // first one's units.
    let r = rig(14, 4);
    let room = r.pool.status().capacity;
    assert!((6 * MIB..9 * MIB).contains(&room), "capacity {room}");
    let a = r.pool.create_volume("a", 6 * MIB).unwrap();
    let mut io = core();
    r.pool.core.cache_tier().unwrap().pause_cleaner(true);
    {
        let mut h = a.open_handle();
        for k in 0..(a.size() / (64 << 10)) {
            let d = pattern(k + 100, 64 << 10);
            assert_eq!(write(&mut io, &mut h, k * (64 << 10), &d), 0);
        }
    }
    assert!(status(&r.pool).dirty_bytes > 0);
    r.pool.delete_volume(&a).unwrap();
    r.pool.commit().unwrap();
    // The new volume takes the freed units (the pool is small).
    let b = r.pool.create_volume("b", 6 * MIB).unwrap();
    let mut h = b.open_handle();
    let got = read(&mut io, &mut h, 0, b.size() as usize).unwrap();
    assert!(got.iter().all(|&x| x == 0), "b sees a's bytes");
    // Half-block writes into b's new units: their blocks' other halves are zero.
    for k in 0..(b.size() / (64 << 10)) {
        assert_eq!(write(&mut io, &mut h, k * (64 << 10), &[7u8; 512]), 0);
    }
    assert_eq!(flush(&mut io, &mut h), 0);
    let got = read(&mut io, &mut h, 0, b.size() as usize).unwrap();
    for k in 0..(b.size() / (64 << 10)) as usize {
        let at = k * (64 << 10);
        assert!(got[at..at + 512].iter().all(|&x| x == 7));
        assert!(
            got[at + 512..at + (64 << 10)].iter().all(|&x| x == 0),
            "unit {k} of b shows a's bytes"
        );
    }
    let pimg = current(&r.pdev);
    let cimgs: Vec<_> = r.cdevs.iter().map(|d| current(d)).collect();
    drop((h, b));
    drop(r);
    let r2 = reopen(pimg, cimgs, CacheMode::WriteBack);
    let b = r2.pool.volume("b").unwrap();
    let mut h = b.open_handle();
    let got = read(&mut io, &mut h, 0, b.size() as usize).unwrap();
    for k in 0..(b.size() / (64 << 10)) as usize {
        let at = k * (64 << 10);
        assert!(
            got[at + 512..at + (64 << 10)].iter().all(|&x| x == 0),
            "after a restart, unit {k} of b shows a's bytes"
        );
    }
}

/// A snapshot taken while the volume's data is dirty in the cache keeps that data, and
/// writes after it (first writes into shared units, merged through the cache) do not
/// change it.
#[test]
fn a_snapshot_of_dirty_data_keeps_it() {
    let r = rig(64, 8);
    let vol = r.pool.create_volume("v", 8 * MIB).unwrap();
    let mut io = core();
    let mut model = vec![0u8; vol.size() as usize];
    let mut rng = Rng(3);
    r.pool.core.cache_tier().unwrap().pause_cleaner(true);
    {
        let mut h = vol.open_handle();
        churn(&mut io, &mut h, &mut model, &mut rng, 600);
    }
    assert!(status(&r.pool).dirty_bytes > 0);
    r.pool.core.cache_tier().unwrap().pause_cleaner(false);
    let snap = r.pool.create_snapshot(&vol, "s").unwrap();
    let frozen = model.clone();
    {
        let mut h = vol.open_handle();
        churn(&mut io, &mut h, &mut model, &mut rng, 600);
        check_all(&mut io, &mut h, &model, "the volume after the snapshot");
    }
    let mut sh = snap.open_handle();
    check_all(&mut io, &mut sh, &frozen, "the snapshot");
}

/// A write-back cache that fails with dirty data: reads of the lost blocks fail (never
/// older bytes), other reads go on from the pool's devices, and a write of a whole lost
/// block makes it readable again.
#[test]
fn a_failed_write_back_cache_fails_only_reads_of_what_it_lost() {
    let pdev = CrashDevice::new(64 * MIB);
    let pool = Pool::create(
        "p",
        dyns(std::slice::from_ref(&pdev)),
        PoolOptions::default(),
    )
    .unwrap();
    let inner = CrashDevice::new(6 * MIB);
    let cfg = Arc::new(FaultConfig::default());
    let faulty: Arc<dyn BlockDevice> = FaultDevice::new(inner as Arc<dyn BlockDevice>, cfg.clone());
    pool.attach_cache(vec![faulty], CacheMode::WriteBack, CUNIT, true, false)
        .unwrap();
    let vol = pool.create_volume("v", 16 * MIB).unwrap();
    let mut h = vol.open_handle();
    let mut io = core();
    // Clean data first (on the pool's devices), then dirty data at 1 MiB.
    pool.set_cache_mode(CacheMode::WriteAround, false).unwrap();
    assert_eq!(write(&mut io, &mut h, 0, &pattern(5, 64 << 10)), 0);
    wait_for_every("write-around", 10, FAST, || status(&pool).state == "ok");
    pool.set_cache_mode(CacheMode::WriteBack, true).unwrap();
    assert_eq!(write(&mut io, &mut h, MIB, &pattern(6, 8192)), 0);
    assert!(status(&pool).dirty_bytes >= 8192);
    inject(&cfg, Fault::FailReads);
    inject(&cfg, Fault::FailWrites);
    // The first read of the cache fails it.
    assert!(read(&mut io, &mut h, MIB, 4096).is_err());
    assert!(status(&pool).state.contains("lost"), "{:?}", status(&pool));
    assert!(
        read(&mut io, &mut h, MIB, 4096).is_err(),
        "lost data reads fail"
    );
    assert_eq!(
        read(&mut io, &mut h, 0, 64 << 10).unwrap(),
        pattern(5, 64 << 10)
    );
    // A whole-block write heals the block; a partial one of a lost block fails.
    assert!(write(&mut io, &mut h, MIB + 4096, &[1u8; 512]) < 0);
    assert_eq!(write(&mut io, &mut h, MIB, &[9u8; 4096]), 0);
    assert_eq!(read(&mut io, &mut h, MIB, 4096).unwrap(), vec![9u8; 4096]);
    assert!(read(&mut io, &mut h, MIB + 4096, 4096).is_err());
}
