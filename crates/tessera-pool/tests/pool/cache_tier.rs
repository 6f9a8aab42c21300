//! The cache tier (issue 24) against a model: whatever the mode, the mode switches, the
//! unaligned requests, the units changing owner and a failed cache device, every read
//! returns the last bytes written; and reads of cached data come from the cache.

// Test sizes are small constants: their casts to usize do not truncate.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;

use common::*;
use tessera_device::{BlockDevice, FaultConfig, RamDevice};
use tessera_io::CoreIo;
use tessera_pool::cache_tier::{CacheInfo, CacheMode, CACHE_UNIT};
use tessera_pool::{Pool, PoolOptions, VolumeHandle};

const MIB: u64 = 1 << 20;

/// A pool on a RAM device with a cache of `cache_mib` MiB of slots on a RAM device
/// behind a fault device (to fail it).
fn cached_pool(cache_mib: u64, mode: CacheMode) -> (Arc<Pool>, Arc<FaultConfig>, Arc<RamDevice>) {
    cached_pool_on(256, cache_mib, mode, CACHE_UNIT)
}

fn cached_pool_on(
    pool_mib: u64,
    cache_mib: u64,
    mode: CacheMode,
    unit: u64,
) -> (Arc<Pool>, Arc<FaultConfig>, Arc<RamDevice>) {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(pool_mib * MIB).unwrap();
    let pool = Arc::new(Pool::create("p", vec![dev], PoolOptions::default()).unwrap());
    // The label's MiB and the slot records' MiB, then the slots.
    let ram = RamDevice::new((cache_mib + 2) * MIB).unwrap();
    let (devs, cfgs) = wrap(std::slice::from_ref(&ram));
    pool.attach_cache(devs, mode, unit, false, false).unwrap();
    (pool, cfgs[0].clone(), ram)
}

fn status(p: &Pool) -> CacheInfo {
    p.cache_status().expect("a cache")
}

/// Random reads and writes (whole blocks, unaligned sectors, across unit edges) over
/// `model`, checked as they go.
fn churn(
    io: &mut CoreIo,
    h: &mut VolumeHandle,
    model: &mut [u8],
    rng: &mut Rng,
    ops: usize,
    what: &str,
) {
    let size = model.len() as u64;
    for i in 0..ops {
        let len = match rng.below(4) {
            0 => 512 * (1 + rng.below(8)),
            1 => 4096,
            2 => 4096 * (1 + rng.below(32)),
            _ => 256 << 10,
        };
        let align = if rng.below(3) == 0 { 512 } else { 4096 };
        let off = rng.below((size - len) / align) * align;
        let (o, l) = (off as usize, len as usize);
        if rng.below(3) == 0 {
            let data = pattern(rng.next() | 1, l);
            assert_eq!(write(io, h, off, &data), 0, "{what}: write {i}");
            model[o..o + l].copy_from_slice(&data);
        } else {
            let got = read(io, h, off, l).unwrap();
            assert!(
                got == model[o..o + l],
                "{what}: op {i}: read of {len} at {off} differs from the model"
            );
        }
    }
}

#[test]
fn every_mode_reads_back_the_last_write_and_hits_come_from_the_cache() {
    let modes = [
        CacheMode::WriteThrough,
        CacheMode::WriteAround,
        CacheMode::PassThrough,
    ];
    // The default unit, and the smallest (more units than blocks a request touches).
    let small = [
        (CacheMode::WriteThrough, 16 << 10),
        (CacheMode::WriteAround, 16 << 10),
    ];
    for (mode, unit) in modes.into_iter().map(|m| (m, CACHE_UNIT)).chain(small) {
        let what = &format!("{} with {} KiB units", mode.name(), unit >> 10);
        let (pool, _, _) = cached_pool_on(256, 16, mode, unit);
        let size = 32 * MIB;
        let v = pool.create_volume("v", size).unwrap();
        let mut io = core();
        let mut h = v.open_handle();
        let mut model = pattern(7, size as usize);
        assert_eq!(write(&mut io, &mut h, 0, &model), 0);
        let mut rng = Rng(0x5eed ^ mode as u64);
        churn(&mut io, &mut h, &mut model, &mut rng, 3000, what);
        // A small hot set read again and again: hits, except in pass-through.
        for _ in 0..20 {
            for u in [3u64, 9, 17] {
                let off = u * MIB + 8192;
                let got = read(&mut io, &mut h, off, 64 << 10).unwrap();
                assert!(
                    got == model[off as usize..off as usize + (64 << 10)],
                    "{what}: hot read"
                );
            }
        }
        verify_all(&mut io, &mut h, &model, what);
        let s = status(&pool);
        if mode == CacheMode::PassThrough {
            assert_eq!(s.read_hits, 0, "{what}: {s:?}");
            assert_eq!(s.promotions, 0, "{what}: {s:?}");
        } else {
            assert!(s.read_hits > 50, "{what}: {s:?}");
            assert!(s.fill_bytes > 0, "{what}: {s:?}");
        }
        assert_eq!(s.state, "ok");
        assert_eq!(s.dirty_bytes, 0);
    }
}

#[test]
fn mode_switches_under_load_keep_reads_right() {
    let (pool, _, _) = cached_pool(8, CacheMode::WriteThrough);
    let size = 24 * MIB;
    let v = pool.create_volume("v", size).unwrap();
    let mut io = core();
    let mut h = v.open_handle();
    let mut model = pattern(3, size as usize);
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    let mut rng = Rng(99);
    let modes = [
        CacheMode::WriteAround,
        CacheMode::PassThrough,
        CacheMode::WriteThrough,
        CacheMode::PassThrough,
        CacheMode::WriteAround,
        CacheMode::WriteThrough,
    ];
    for (i, m) in modes.into_iter().enumerate() {
        churn(
            &mut io,
            &mut h,
            &mut model,
            &mut rng,
            800,
            &format!("before switch {i}"),
        );
        pool.set_cache_mode(m, false).unwrap();
    }
    churn(
        &mut io,
        &mut h,
        &mut model,
        &mut rng,
        800,
        "after the switches",
    );
    verify_all(&mut io, &mut h, &model, "after the switches");
    assert!(status(&pool).read_hits > 0);
}

/// A unit the cache holds for one volume is freed and given to another: the new owner
/// reads its own bytes (zeros where it wrote nothing), never the old owner's.
#[test]
fn a_unit_given_to_another_volume_never_shows_the_old_owners_cached_data() {
    // A small pool, so that 'b' below must take every unit 'a' had, and a cache larger
    // than it, so that nothing of 'a' is evicted before.
    let (pool, _, _) = cached_pool_on(48, 64, CacheMode::WriteThrough, CACHE_UNIT);
    let mut io = core();
    let a = pool.create_volume("a", 8 * MIB).unwrap();
    let secret = pattern(0xa, (8 * MIB) as usize);
    {
        let mut h = a.open_handle();
        // Written out of order (a stream would bypass the cache) and read twice.
        for u in [5u64, 1, 7, 3, 0, 6, 2, 4] {
            let o = (u * MIB) as usize;
            assert_eq!(
                write(&mut io, &mut h, u * MIB, &secret[o..o + MIB as usize]),
                0
            );
        }
        for _ in 0..2 {
            verify_all(&mut io, &mut h, &secret, "a");
        }
    }
    assert!(status(&pool).valid_bytes >= 4 * MIB, "{:?}", status(&pool));
    let a_units = pool.allocated_units();
    pool.delete_volume(&a).unwrap();
    drop(a);
    pool.commit().unwrap();
    // 'b' takes every unit of the pool, 'a's among them, with partial first writes.
    let units = pool.status().free / MIB;
    let b = pool.create_volume("b", units * MIB).unwrap();
    let mut h = b.open_handle();
    let mut model = vec![0u8; (units * MIB) as usize];
    for u in (0..units).rev() {
        let d = pattern(u + 1000, 4096);
        let off = u * MIB + 64 * 1024;
        assert_eq!(write(&mut io, &mut h, off, &d), 0);
        model[off as usize..off as usize + 4096].copy_from_slice(&d);
    }
    let b_units = pool.allocated_units();
    assert!(
        a_units.iter().all(|u| b_units.contains(u)),
        "a: {a_units:?}, b: {b_units:?}"
    );
    for _ in 0..2 {
        verify_all(&mut io, &mut h, &model, "b after a's units were reused");
    }
}

/// The cache device fails (reads and writes) under load: requests go on with the right
/// data from the pool's devices and the tier says it failed.
#[test]
fn a_failed_cache_device_loses_nothing() {
    for mode in [CacheMode::WriteThrough, CacheMode::WriteAround] {
        let what = mode.name();
        let (pool, cfg, _) = cached_pool(16, mode);
        let size = 24 * MIB;
        let v = pool.create_volume("v", size).unwrap();
        let mut io = core();
        let mut h = v.open_handle();
        let mut model = pattern(11, size as usize);
        assert_eq!(write(&mut io, &mut h, 0, &model), 0);
        let mut rng = Rng(1234);
        churn(&mut io, &mut h, &mut model, &mut rng, 1500, what);
        assert!(status(&pool).read_hits > 0);
        inject(&cfg, Fault::FailReads);
        inject(&cfg, Fault::FailWrites);
        churn(
            &mut io,
            &mut h,
            &mut model,
            &mut rng,
            1500,
            &format!("{what}, cache failed"),
        );
        verify_all(&mut io, &mut h, &model, what);
        let s = status(&pool);
        assert_eq!(s.state, "failed", "{what}: {s:?}");
        assert!(s.errors > 0);
    }
}

#[test]
fn attach_refuses_pool_devices_and_other_pools_caches_and_detach_frees_the_device() {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(64 * MIB).unwrap();
    let pool = Pool::create("p", vec![dev.clone()], PoolOptions::default()).unwrap();
    let other: Arc<dyn BlockDevice> = RamDevice::new(64 * MIB).unwrap();
    let pool2 = Pool::create("q", vec![other], PoolOptions::default()).unwrap();
    // A device with a pool label is refused (unless forced; the node also refuses its
    // own pools' devices by path, forced or not).
    let e = pool
        .attach_cache(
            vec![dev.clone()],
            CacheMode::WriteThrough,
            CACHE_UNIT,
            false,
            false,
        )
        .unwrap_err();
    assert!(e.to_string().contains("pool's device label"), "{e}");
    let c: Arc<dyn BlockDevice> = RamDevice::new(32 * MIB).unwrap();
    pool2
        .attach_cache(
            vec![c.clone()],
            CacheMode::WriteThrough,
            CACHE_UNIT,
            false,
            false,
        )
        .unwrap();
    assert!(pool2
        .attach_cache(
            vec![c.clone()],
            CacheMode::WriteThrough,
            CACHE_UNIT,
            false,
            false
        )
        .is_err());
    let e = pool
        .attach_cache(
            vec![c.clone()],
            CacheMode::WriteThrough,
            CACHE_UNIT,
            false,
            false,
        )
        .unwrap_err();
    assert!(e.to_string().contains("another pool's cache"), "{e}");
    // Too small, too many, write-back.
    let tiny: Arc<dyn BlockDevice> = RamDevice::new(4 * MIB).unwrap();
    assert!(pool
        .attach_cache(
            vec![tiny],
            CacheMode::WriteThrough,
            CACHE_UNIT,
            false,
            false
        )
        .is_err());
    // Write-back keeps the only copy of writes: never on a device that forgets them.
    let err = pool2
        .set_cache_mode(CacheMode::WriteBack, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("keep their data across a restart"), "{err}");
    let devs = pool2.detach_cache().unwrap();
    assert_eq!(devs.len(), 1);
    assert!(pool2.cache_status().is_none());
    pool.attach_cache(vec![c], CacheMode::WriteAround, CACHE_UNIT, false, false)
        .unwrap();
    assert_eq!(status(&pool).mode, "write-around");
}

/// Two cache devices mirror each other: one failing leaves the tier working.
#[test]
fn a_mirrored_cache_survives_one_device() {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(128 * MIB).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let ram = ram_devices(2, 17 * MIB);
    let (devs, cfgs) = wrap(&ram);
    pool.attach_cache(devs, CacheMode::WriteThrough, CACHE_UNIT, false, false)
        .unwrap();
    let size = 24 * MIB;
    let v = pool.create_volume("v", size).unwrap();
    let mut io = core();
    let mut h = v.open_handle();
    let mut model = pattern(5, size as usize);
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    let mut rng = Rng(77);
    churn(&mut io, &mut h, &mut model, &mut rng, 1000, "both");
    inject(&cfgs[1], Fault::Vanish);
    churn(
        &mut io,
        &mut h,
        &mut model,
        &mut rng,
        2000,
        "one cache device gone",
    );
    verify_all(&mut io, &mut h, &model, "mirrored");
    let s = pool.cache_status().unwrap();
    assert_eq!(s.state, "degraded", "{s:?}");
    assert!(s.read_hits > 0);
}

/// A sequential reader gets the units ahead of it read into the cache (readahead), and
/// a write into a unit ahead of it is what it reads there.
#[test]
fn sequential_readers_are_read_ahead_and_see_writes_ahead_of_them() {
    let (pool, _, _) = cached_pool(32, CacheMode::WriteAround);
    let size = 24 * MIB;
    let v = pool.create_volume("v", size).unwrap();
    let mut io = core();
    let mut h = v.open_handle();
    // Written around the cache: nothing of it is cached.
    let mut model = pattern(21, size as usize);
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    pool.set_cache_mode(CacheMode::WriteThrough, false).unwrap();
    assert_eq!(status(&pool).valid_bytes, 0);
    let chunk: u64 = 128 << 10;
    let mut k = 0;
    for off in (0..size).step_by(chunk as usize) {
        if off % (2 * MIB) == 0 && off + 3 * MIB < size {
            // Into the unit two ahead, which readahead may hold already.
            let at = off + 2 * MIB + 4096 * (k % 7);
            let d = pattern(1000 + k, 8192);
            assert_eq!(write(&mut io, &mut h, at, &d), 0);
            model[at as usize..at as usize + 8192].copy_from_slice(&d);
            k += 1;
        }
        let got = read(&mut io, &mut h, off, chunk as usize).unwrap();
        assert!(
            got == model[off as usize..(off + chunk) as usize],
            "read at {off}"
        );
    }
    let s = status(&pool);
    assert!(s.prefetch_bytes >= 16 * MIB, "{s:?}");
    assert!(s.read_hits > 3 * s.read_misses, "{s:?}");
    verify_all(&mut io, &mut h, &model, "after the stream");
}

#[test]
fn a_full_cache_with_admit_hits_admits_a_unit_at_its_nth_miss() {
    let (pool, _, _) = cached_pool(16, CacheMode::WriteThrough);
    assert_eq!(
        status(&pool).admit_hits,
        1,
        "the default admits at the first miss"
    );
    assert!(pool.set_cache_admit_hits(0).is_err(), "0 misses is refused");
    let size = 64 * MIB;
    let v = pool.create_volume("v", size).unwrap();
    let mut io = core();
    let mut h = v.open_handle();
    let model = pattern(11, size as usize);
    // Writing 64 units through a cache of fewer fills it (write-through admits them).
    assert_eq!(write(&mut io, &mut h, 0, &model), 0);
    let full = status(&pool);
    assert_eq!(
        full.cached_units,
        full.capacity / full.unit_size,
        "{full:?}"
    );
    // One 4 KiB read of `unit`, checked; whether it hit the cache.
    let read_unit = |io: &mut CoreIo, h: &mut VolumeHandle, unit: u64| {
        let hits = status(&pool).read_hits;
        let off = unit * MIB + 4096 * (unit % 7);
        let got = read(io, h, off, 4096).unwrap();
        assert!(
            got == model[off as usize..off as usize + 4096],
            "unit {unit}"
        );
        status(&pool).read_hits > hits
    };
    // The first unit (from the top) the cache does not hold: its first miss.
    let first_miss = |io: &mut CoreIo, h: &mut VolumeHandle, from: u64| {
        (from..64)
            .find(|&u| !read_unit(io, h, u))
            .expect("a unit the cache does not hold")
    };
    pool.set_cache_admit_hits(3).unwrap();
    assert_eq!(status(&pool).admit_hits, 3);
    let before = status(&pool).promotions;
    let new = first_miss(&mut io, &mut h, 0);
    assert_eq!(
        status(&pool).promotions,
        before,
        "miss 1 of unit {new}: counted only"
    );
    assert!(!read_unit(&mut io, &mut h, new), "miss 2");
    assert_eq!(
        status(&pool).promotions,
        before,
        "miss 2 of unit {new}: counted only"
    );
    assert!(!read_unit(&mut io, &mut h, new), "miss 3");
    assert_eq!(
        status(&pool).promotions,
        before + 1,
        "miss 3 of unit {new}: admitted"
    );
    assert!(read_unit(&mut io, &mut h, new), "admitted: a hit now");
    // Back to the default: a unit is admitted at its first miss again.
    pool.set_cache_admit_hits(1).unwrap();
    let next = first_miss(&mut io, &mut h, new + 1);
    assert_eq!(
        status(&pool).promotions,
        before + 2,
        "unit {next}: admitted at once"
    );
    assert!(read_unit(&mut io, &mut h, next), "unit {next}: a hit now");
}
