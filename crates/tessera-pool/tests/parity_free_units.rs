//! Parity pools take a unit they hand out as zeroed (a partial first write into it does
//! not zero the rest). A unit allocated and written after the last metadata commit is
//! free again after a power loss, still holding what was written: these tests cut power
//! right there, reopen, give every free unit to another volume with a small write each,
//! and expect zeros around the writes (no other volume's data) and consistent parity.

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::sync::Arc;

use common::*;
use tessera_device::BlockDevice;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

const UNIT: u64 = 1 << 20;
const DEV_SIZE: u64 = 48 << 20;

fn as_block(devs: &[Arc<CrashDevice>]) -> Vec<Arc<dyn BlockDevice>> {
    devs.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

fn ndev(kind: LayoutKind) -> usize {
    match kind {
        LayoutKind::Raid5 { .. } => 3,
        LayoutKind::Raid6 { .. } => 4,
        LayoutKind::Ec { k, m, .. } => (k + m) as usize,
        _ => unreachable!("parity layouts only"),
    }
}

/// Write into every free unit of a fresh volume, lose power before any commit, reopen
/// and hand the same units to another volume.
fn uncommitted_units_come_back_zeroed(kind: LayoutKind, seed: u64) {
    let what = format!("{kind:?} seed {seed}");
    let devs: Vec<Arc<CrashDevice>> = (0..ndev(kind))
        .map(|_| CrashDevice::new(DEV_SIZE))
        .collect();
    let pool = Pool::create(
        "p",
        as_block(&devs),
        PoolOptions {
            layout: kind,
            unit_size: UNIT,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let free_units = pool.status().free / UNIT;
    assert!(free_units >= 8, "{what}: pool too small ({free_units} units)");
    let a = pool.create_volume("a", free_units * UNIT).unwrap();
    pool.create_volume("b", free_units * UNIT).unwrap();
    // The catalog change above wrote a checkpoint: from here on nothing is committed.
    let mut io = core();
    let mut h = a.open_handle();
    let mut rng = Rng(seed | 1);
    for u in 0..free_units {
        // Whole units and partial ones: both may be handed out again.
        let (off, len) = if u % 2 == 0 {
            (0, UNIT)
        } else {
            (4096 * rng.below(UNIT / 4096 - 16), 4096 * (1 + rng.below(16)))
        };
        let data = pattern(rng.next() | 1, len as usize);
        assert!(write(&mut io, &mut h, u * UNIT + off, &data) >= 0, "{what}");
    }
    drop(h);
    // The data reaches the media; the allocations were never committed.
    pool.core.layout.sync().unwrap();
    let images: Vec<Vec<u8>> = devs.iter().map(|d| d.crash_image(rng.next())).collect();
    drop(a);
    drop(pool);

    let devs: Vec<Arc<CrashDevice>> = images.into_iter().map(CrashDevice::from_image).collect();
    let pool = Pool::open(as_block(&devs)).unwrap();
    assert!(!pool.opened_clean(), "{what}: the power loss looked clean");
    assert_eq!(
        pool.status().free / UNIT,
        free_units,
        "{what}: the uncommitted allocations are free again"
    );
    let a = pool.volume("a").unwrap();
    let b = pool.volume("b").unwrap();
    let mut ha = a.open_handle();
    let zeros = vec![0u8; (free_units * UNIT) as usize];
    verify_all(&mut io, &mut ha, &zeros, &format!("{what}: 'a' after the power loss"));
    // Every free unit goes to 'b', each with one small write (not covering the unit).
    let mut hb = b.open_handle();
    let mut model = zeros.clone();
    for u in 0..free_units {
        let off = u * UNIT + 512 * rng.below(UNIT / 512 - 8);
        let data = pattern(rng.next() | 1, 512 * (1 + rng.below(8)) as usize);
        assert!(write(&mut io, &mut hb, off, &data) >= 0, "{what}");
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    for u in 0..free_units {
        let got = read(&mut io, &mut hb, u * UNIT, UNIT as usize).unwrap();
        let want = &model[(u * UNIT) as usize..((u + 1) * UNIT) as usize];
        assert!(
            got == want,
            "{what}: unit {u} of 'b' shows bytes it never wrote (another volume's data)"
        );
    }
    assert!(flush(&mut io, &mut hb) >= 0);
    let l = &pool.core.layout;
    let f = l.scrub_range(0, l.size, false).unwrap();
    assert_eq!(f.mismatched, 0, "{what}: parity inconsistent: {:?}", f.ranges);
    assert_eq!(f.unreadable, 0, "{what}");
    drop(hb);
    drop(ha);
    pool.shutdown().unwrap();
}

#[test]
fn raid5_units_allocated_after_the_last_commit_are_zero_when_reused() {
    for seed in 1..=2 {
        uncommitted_units_come_back_zeroed(LayoutKind::Raid5 { stripe: 16 << 10 }, seed);
    }
}

#[test]
fn ec_units_allocated_after_the_last_commit_are_zero_when_reused() {
    uncommitted_units_come_back_zeroed(
        LayoutKind::Ec {
            k: 2,
            m: 2,
            stripe: 16 << 10,
        },
        3,
    );
}
