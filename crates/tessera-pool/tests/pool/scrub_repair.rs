//! Scrub with repair on mirrored pools (`Layout::scrub_range`): copies made to differ
//! behind the pool's back are found at exactly the changed range and made equal (the
//! first copy wins); bad sectors on one copy are rewritten from a good copy; and the
//! clean-shutdown flag tells a reopened pool whether its previous run ended cleanly.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::io;
use std::sync::Arc;

use common::*;
use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::IoHandle;
use tessera_pool::format::DEV_DATA_START;
use tessera_pool::{LayoutKind, Pool, PoolOptions, ScrubFindings};

const DEV_SIZE: u64 = 24 << 20;
const UNIT: u64 = 1 << 20;

/// A fault device whose bad read range heals when it is written over (as a disk remaps
/// a bad sector on write).
struct Remapping {
    inner: Arc<FaultDevice>,
}

impl BlockDevice for Remapping {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.inner.write_at(offset, buf)?;
        let c = &self.inner.config;
        let (s, e) = (
            c.fail_read_start.load(std::sync::atomic::Ordering::Relaxed),
            c.fail_read_end.load(std::sync::atomic::Ordering::Relaxed),
        );
        if offset <= s && offset + buf.len() as u64 >= e {
            c.fail_reads(0, 0);
        }
        Ok(())
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes_at(offset, len)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        self.inner.clone().open_handle()
    }
}

struct Setup {
    rams: Vec<Arc<RamDevice>>,
    cfgs: Vec<Arc<FaultConfig>>,
    pool: Pool,
}

/// A raid1 pool of `copies` devices with one volume whose first 4 MiB are written with a
/// pattern. Device 1 heals its bad sectors on write when `remap`.
fn setup(copies: u32, remap: bool) -> Setup {
    let rams: Vec<Arc<RamDevice>> = (0..copies)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap())
        .collect();
    let cfgs: Vec<Arc<FaultConfig>> = rams.iter().map(|_| Arc::default()).collect();
    let devs: Vec<Arc<dyn BlockDevice>> = rams
        .iter()
        .zip(&cfgs)
        .enumerate()
        .map(|(i, (r, c))| {
            let f = FaultDevice::new(r.clone(), c.clone());
            if remap && i == 1 {
                Arc::new(Remapping { inner: f }) as Arc<dyn BlockDevice>
            } else {
                f as Arc<dyn BlockDevice>
            }
        })
        .collect();
    let pool = Pool::create(
        "p",
        devs,
        PoolOptions {
            layout: LayoutKind::Raid1 { copies },
            unit_size: UNIT,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let vol = pool.create_volume("v", 8 << 20).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let data: Vec<u8> = (0..4 << 20).map(|i: usize| (i * 13 % 251) as u8).collect();
    assert!(write(&mut io, &mut h, 0, &data) >= 0);
    assert_eq!(flush(&mut io, &mut h), 0);
    Setup { rams, cfgs, pool }
}

/// Scrub everything a scrub job covers: metadata units and allocated units.
fn scrub_all(pool: &Pool, repair: bool) -> ScrubFindings {
    let mut f = ScrubFindings::default();
    // Track client writes once for the whole pass (as the node's scrub job does).
    let _t = pool.core.layout.track_writes();
    for u in pool.rebuild_units() {
        let r = pool
            .core
            .layout
            .scrub_range(u * UNIT, UNIT, repair)
            .unwrap();
        f.add(&r);
    }
    f
}

fn copies_equal(s: &Setup, at: u64, len: usize) -> bool {
    let mut a = vec![0u8; len];
    s.rams[0].read_at(DEV_DATA_START + at, &mut a).unwrap();
    s.rams[1..].iter().all(|r| {
        let mut b = vec![0u8; len];
        r.read_at(DEV_DATA_START + at, &mut b).unwrap();
        a == b
    })
}

#[test]
fn scrub_finds_exactly_the_changed_range_and_repair_makes_copies_equal() {
    let s = setup(2, false);
    let l = &s.pool.core.layout;
    let units = s.pool.allocated_units();
    assert_eq!(units.len(), 4);
    let at = units[1] * UNIT + 12288;
    // Copy 1 differs from copy 0 on 8 KiB, written behind the pool's back.
    l.devices[1]
        .write_at(DEV_DATA_START + at, &[0xAB; 8192])
        .unwrap();
    let mut want = vec![0u8; 8192];
    l.devices[0]
        .read_at(DEV_DATA_START + at, &mut want)
        .unwrap();

    // Without repair: found, reported, nothing changed.
    let f = scrub_all(&s.pool, false);
    assert_eq!(f.ranges, vec![(at, 8192)]);
    assert_eq!((f.mismatched, f.repaired, f.unreadable), (8192, 0, 0));
    assert!(!copies_equal(&s, at, 8192));

    let f = scrub_all(&s.pool, true);
    assert_eq!(f.ranges, vec![(at, 8192)]);
    assert_eq!((f.mismatched, f.repaired, f.unreadable), (8192, 8192, 0));
    assert!(f.bytes_checked >= 4 * UNIT);
    assert!(copies_equal(&s, at, 8192));
    // The first copy won.
    let mut got = vec![0u8; 8192];
    s.rams[1].read_at(DEV_DATA_START + at, &mut got).unwrap();
    assert_eq!(got, want);

    let f = scrub_all(&s.pool, true);
    assert_eq!((f.mismatched, f.repaired), (0, 0));
    assert!(f.ranges.is_empty());
    assert_eq!(
        l.health.failed.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn metadata_copies_are_compared_too() {
    let s = setup(3, false);
    // The superblock's copy on device 2.
    s.rams[2]
        .write_at(DEV_DATA_START + 100, &[1, 2, 3])
        .unwrap();
    let f = scrub_all(&s.pool, true);
    assert_eq!(f.ranges, vec![(0, 4096)]);
    assert_eq!((f.mismatched, f.repaired), (4096, 4096));
    assert!(copies_equal(&s, 0, 4096));
    assert!(s.pool.verify_metadata().is_empty());
}

#[test]
fn bad_sector_that_heals_on_write_is_repaired_without_failing_the_device() {
    let s = setup(2, true);
    let l = &s.pool.core.layout;
    let at = s.pool.allocated_units()[2] * UNIT + 65536;
    s.cfgs[1].fail_reads(DEV_DATA_START + at + 4096, DEV_DATA_START + at + 8192);
    let f = scrub_all(&s.pool, true);
    // The piece holding the bad sector (a 1 MiB scrub range is one raid1 piece) is
    // rewritten whole on the bad copy.
    assert_eq!(f.unreadable, 0);
    assert_eq!(f.mismatched, UNIT);
    assert_eq!(f.repaired, UNIT);
    assert_eq!(f.ranges, vec![(at - 65536, UNIT)]);
    assert!(
        !l.is_failed(1),
        "a repaired bad sector must not fail the device"
    );
    assert!(copies_equal(&s, at - 65536, UNIT as usize));
    let f = scrub_all(&s.pool, true);
    assert_eq!((f.mismatched, f.repaired), (0, 0));
}

#[test]
fn bad_sector_that_stays_bad_fails_that_copy_and_keeps_the_data() {
    let s = setup(2, false);
    let l = &s.pool.core.layout;
    let at = s.pool.allocated_units()[2] * UNIT;
    s.cfgs[1].fail_reads(DEV_DATA_START + at + 4096, DEV_DATA_START + at + 8192);
    let f = scrub_all(&s.pool, true);
    assert_eq!((f.mismatched, f.repaired, f.unreadable), (UNIT, 0, 0));
    assert!(l.is_failed(1));
    assert!(!l.is_failed(0));
    let mut b = vec![0u8; 8192];
    l.read_at(at, &mut b).unwrap();
    let mut want = vec![0u8; 8192];
    s.rams[0].read_at(DEV_DATA_START + at, &mut want).unwrap();
    assert!(want.iter().any(|&x| x != 0));
    assert_eq!(b, want);
}

#[test]
fn no_repair_fails_a_copy_with_a_bad_sector_like_a_read_would() {
    let s = setup(2, true);
    let at = s.pool.allocated_units()[0] * UNIT;
    s.cfgs[1].fail_reads(DEV_DATA_START + at, DEV_DATA_START + at + 4096);
    let f = scrub_all(&s.pool, false);
    assert_eq!((f.mismatched, f.repaired), (UNIT, 0));
    assert!(s.pool.core.layout.is_failed(1));
}

#[test]
fn unreadable_on_every_copy_is_counted_and_fails_nothing() {
    let s = setup(2, false);
    let at = s.pool.allocated_units()[0] * UNIT;
    for c in &s.cfgs {
        c.fail_reads(DEV_DATA_START + at, DEV_DATA_START + at + 4096);
    }
    let f = scrub_all(&s.pool, true);
    assert_eq!((f.unreadable, f.mismatched), (UNIT, 0));
    assert_eq!(
        s.pool
            .core
            .layout
            .health
            .failed
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn concat_scrub_counts_unreadable_bytes() {
    let ram = RamDevice::new(DEV_SIZE).unwrap();
    let cfg: Arc<FaultConfig> = Arc::default();
    let dev = FaultDevice::new(ram, cfg.clone()) as Arc<dyn BlockDevice>;
    let pool = Pool::create("c", vec![dev], PoolOptions::default()).unwrap();
    let l = &pool.core.layout;
    assert_eq!(l.scrub_range(0, 2 * UNIT, true).unwrap().unreadable, 0);
    cfg.fail_reads(DEV_DATA_START + UNIT, DEV_DATA_START + UNIT + 512);
    let f = l.scrub_range(0, 2 * UNIT, true).unwrap();
    // Read in 64 KiB requests: the failing one is counted.
    assert_eq!(
        (f.unreadable, f.bytes_checked, f.mismatched),
        (65536, 2 * UNIT, 0)
    );
}

#[test]
fn clean_shutdown_flag_survives_only_a_clean_close() {
    let s = setup(2, false);
    let devs = s.pool.core.layout.devices.clone();
    assert!(s.pool.opened_clean(), "a new pool counts as clean");
    s.pool.shutdown().unwrap();
    drop(s.pool);
    let p = Pool::open(devs.clone()).unwrap();
    assert!(p.opened_clean());
    // Opening cleared the flag: a crash now (no shutdown) is seen at the next open.
    drop(p);
    let p = Pool::open(devs.clone()).unwrap();
    assert!(!p.opened_clean());
    p.shutdown().unwrap();
    drop(p);
    assert!(Pool::open(devs).unwrap().opened_clean());
}
