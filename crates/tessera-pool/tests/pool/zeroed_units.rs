//! A unit handed to a volume reads as zeroes wherever the volume has not written it:
//! also when it held another volume's data before, when it was zeroed ahead of time by
//! the pool's zeroer, after a reopen, and after the device it is read from was rebuilt
//! (a rebuild copies allocated units only, so zeroes written to free units before the
//! rebuild are not on the rebuilt device).

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tessera_device::{BlockDevice, RamDevice};
use tessera_pool::format::DEV_DATA_START;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

const DEV_SIZE: u64 = 16 << 20;
const UNIT: u64 = 64 << 10;
const VOL_SIZE: u64 = 4 << 20;

fn options(layout: LayoutKind) -> PoolOptions {
    PoolOptions {
        layout,
        unit_size: UNIT,
        ..PoolOptions::default()
    }
}

/// Fill every unit of a volume with non-zero bytes, then delete it and make the release
/// durable: the pool's free units now hold old data on every device.
fn leave_old_data(pool: &Pool) {
    let mut io = core();
    let vol = pool.create_volume("old", VOL_SIZE).unwrap();
    let mut h = vol.open_handle();
    assert!(write(&mut io, &mut h, 0, &vec![0xA5; VOL_SIZE as usize]) >= 0);
    assert_eq!(flush(&mut io, &mut h), 0);
    drop(h);
    pool.delete_volume(&vol).unwrap();
    pool.commit().unwrap();
}

fn wait_for_reserve(pool: &Pool) {
    let until = Instant::now() + Duration::from_secs(10);
    while pool.zeroed_units() < 8 {
        assert!(
            Instant::now() < until,
            "the zeroer did not refill its reserve"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Write 512 bytes at the start of every unit of `[first, last)` and return the model.
fn sparse_writes(
    io: &mut tessera_io::CoreIo,
    h: &mut dyn tessera_io::IoHandle,
    model: &mut [u8],
    units: std::ops::Range<u64>,
) {
    for u in units {
        let off = (u * UNIT) as usize;
        let data = pattern(u + 1, 512);
        model[off..off + 512].copy_from_slice(&data);
        assert!(write(io, h, off as u64, &data) >= 0);
    }
}

#[test]
fn partly_written_units_read_zeroes_after_reuse_and_reopen() {
    for layout in [LayoutKind::Concat, LayoutKind::Raid1 { copies: 2 }] {
        let ram: Vec<Arc<RamDevice>> = (0..2).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
        let devs: Vec<Arc<dyn BlockDevice>> = ram
            .iter()
            .map(|r| r.clone() as Arc<dyn BlockDevice>)
            .collect();
        let pool = Pool::create("z", devs.clone(), options(layout)).unwrap();
        leave_old_data(&pool);
        let vol = pool.create_volume("v", VOL_SIZE).unwrap();
        let mut io = core();
        let mut h = vol.open_handle();
        let mut model = vec![0u8; VOL_SIZE as usize];
        let units = VOL_SIZE / UNIT;
        // The first allocation zeroes on the caller and wakes the zeroer; later ones take
        // units it zeroed, or zero themselves when it falls behind.
        sparse_writes(&mut io, &mut h, &mut model, 0..1);
        wait_for_reserve(&pool);
        sparse_writes(&mut io, &mut h, &mut model, 1..units);
        verify_all(&mut io, &mut h, &model, "fresh units");
        assert_eq!(flush(&mut io, &mut h), 0);
        drop(h);
        drop(vol);
        // No shutdown: the reopen sees what a kill would leave (RAM keeps every write).
        drop(pool);
        let pool = Pool::open(devs).unwrap();
        let vol = pool.volume("v").unwrap();
        let mut h = vol.open_handle();
        verify_all(&mut io, &mut h, &model, "after reopen");
    }
}

#[test]
fn units_zeroed_before_a_rebuild_are_not_trusted_after_it() {
    let ram: Vec<Arc<RamDevice>> = (0..2).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let (devs, cfgs) = wrap(&ram);
    let pool = Pool::create("z", devs, options(LayoutKind::Raid1 { copies: 2 })).unwrap();
    leave_old_data(&pool);
    let vol = pool.create_volume("v", VOL_SIZE).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let mut model = vec![0u8; VOL_SIZE as usize];
    sparse_writes(&mut io, &mut h, &mut model, 0..1);

    // Device 1 goes away while the zeroer fills its reserve: those zeroes reach device 0
    // only. It comes back as a replacement holding someone else's bytes.
    inject(&cfgs[1], Fault::Vanish);
    assert!(write(&mut io, &mut h, 0, &model[..512]) >= 0);
    assert!(pool.core.layout.is_failed(1));
    sparse_writes(&mut io, &mut h, &mut model, 1..2);
    wait_for_reserve(&pool);
    let reserved = pool.zeroed_units();
    assert!(reserved > 0);
    ram[1]
        .write_at(
            DEV_DATA_START,
            &vec![0x5A; (DEV_SIZE - DEV_DATA_START) as usize],
        )
        .unwrap();
    cfgs[1]
        .vanished
        .store(false, std::sync::atomic::Ordering::Relaxed);

    pool.start_rebuild(1).unwrap();
    let mut buf = vec![0u8; UNIT as usize];
    for u in pool.rebuild_units() {
        pool.rebuild_unit(1, u, &mut buf).unwrap();
    }
    pool.finish_rebuild(1).unwrap();

    // New units for the volume, partly written; then only device 1 is left to read them.
    let units = VOL_SIZE / UNIT;
    sparse_writes(&mut io, &mut h, &mut model, 2..units);
    inject(&cfgs[0], Fault::Vanish);
    sparse_writes(&mut io, &mut h, &mut model, 0..1);
    assert!(pool.core.layout.is_failed(0));
    verify_all(&mut io, &mut h, &model, "read from the rebuilt device");
}
