//! Parity pools take a unit they hand out as zeroed (a partial first write into it does
//! not zero the rest). A unit allocated and written after the last metadata commit is
//! free again after a power loss, still holding what was written: these tests cut power
//! right there, reopen, give every free unit to another volume with a small write each,
//! and expect zeros around the writes (no other volume's data) and consistent parity.

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;

use common::*;
use tessera_device::BlockDevice;
use tessera_pool::{LayoutKind, Pool, PoolOptions};

fn as_block(devs: &[Arc<CrashDevice>]) -> Vec<Arc<dyn BlockDevice>> {
    devs.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

fn ndev(kind: LayoutKind) -> usize {
    match kind {
        // 4 devices with 8 KiB chunks: 24 KiB rows, so units share their edge rows.
        LayoutKind::Raid5 { stripe } if stripe == 8 << 10 => 4,
        LayoutKind::Raid5 { .. } => 3,
        LayoutKind::Raid6 { .. } => 4,
        LayoutKind::Ec { k, m, .. } => (k + m) as usize,
        _ => unreachable!("parity layouts only"),
    }
}

/// Write into every free unit of a fresh volume, lose power before any commit (except
/// those the pool makes itself when more units than its allocation reserve holds are
/// allocated), reopen and hand the same units to another volume.
fn uncommitted_units_come_back_zeroed(kind: LayoutKind, unit: u64, dev_size: u64, seed: u64) {
    let what = format!("{kind:?} unit {unit} seed {seed}");
    let devs: Vec<Arc<CrashDevice>> = (0..ndev(kind))
        .map(|_| CrashDevice::new(dev_size))
        .collect();
    let pool = Pool::create(
        "p",
        as_block(&devs),
        PoolOptions {
            layout: kind,
            unit_size: unit,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let free_units = pool.status().free / unit;
    assert!(
        free_units >= 8,
        "{what}: pool too small ({free_units} units)"
    );
    let a = pool.create_volume("a", free_units * unit).unwrap();
    pool.create_volume("b", free_units * unit).unwrap();
    // The catalog change above wrote a checkpoint: from here on only the commits that
    // top up the allocation reserve (with 64 KiB units it holds 1024 of the ~1500).
    let mut io = core();
    let mut h = a.open_handle();
    let mut rng = Rng(seed | 1);
    let mut written = vec![0u8; (free_units * unit) as usize];
    for u in 0..free_units {
        // Whole units and partial ones: both may be handed out again.
        let (off, len) = if u % 2 == 0 {
            (0, unit)
        } else {
            let blocks = unit / 4096;
            let n = 1 + rng.below(16.min(blocks / 2));
            (4096 * rng.below(blocks - n), 4096 * n)
        };
        let data = pattern(rng.next() | 1, len as usize);
        let at = (u * unit + off) as usize;
        written[at..at + data.len()].copy_from_slice(&data);
        assert!(write(&mut io, &mut h, u * unit + off, &data) >= 0, "{what}");
    }
    drop(h);
    // The data reaches the media; the allocations were not committed (but by the
    // reserve's top-ups).
    pool.core.layout.sync().unwrap();
    let images: Vec<Vec<u8>> = devs.iter().map(|d| d.crash_image(rng.next())).collect();
    drop(a);
    drop(pool);

    let devs: Vec<Arc<CrashDevice>> = images.into_iter().map(CrashDevice::from_image).collect();
    let pool = Pool::open(as_block(&devs)).unwrap();
    assert!(!pool.opened_clean(), "{what}: the power loss looked clean");
    let st = pool.status();
    assert_eq!(st.allocated + st.free, st.capacity, "{what}: space leaked");
    let a = pool.volume("a").unwrap();
    let b = pool.volume("b").unwrap();
    // 'a' has each unit as written (its allocation was committed) or none of it.
    let mut ha = a.open_handle();
    let zero_unit = vec![0u8; unit as usize];
    for u in 0..free_units {
        let got = read(&mut io, &mut ha, u * unit, unit as usize).unwrap();
        let want = &written[(u * unit) as usize..((u + 1) * unit) as usize];
        assert!(
            got == zero_unit || got == want,
            "{what}: unit {u} of 'a' is neither as written nor unallocated"
        );
    }
    // Every free unit goes to 'b', each with one small write (not covering the unit).
    let free_now = st.free / unit;
    assert!(free_now > 0, "{what}: nothing came back");
    let mut hb = b.open_handle();
    let mut model = vec![0u8; (free_now * unit) as usize];
    for u in 0..free_now {
        let off = u * unit + 512 * rng.below(unit / 512 - 8);
        let data = pattern(rng.next() | 1, 512 * (1 + rng.below(8)) as usize);
        assert!(write(&mut io, &mut hb, off, &data) >= 0, "{what}");
        model[off as usize..off as usize + data.len()].copy_from_slice(&data);
    }
    assert_eq!(pool.status().free, 0, "{what}: 'b' took every free unit");
    for u in 0..free_now {
        let got = read(&mut io, &mut hb, u * unit, unit as usize).unwrap();
        let want = &model[(u * unit) as usize..((u + 1) * unit) as usize];
        assert!(
            got == want,
            "{what}: unit {u} of 'b' shows bytes it never wrote (another volume's data)"
        );
    }
    assert!(flush(&mut io, &mut hb) >= 0);
    let l = &pool.core.layout;
    let f = l.scrub_range(0, l.size, false).unwrap();
    assert_eq!(
        f.mismatched, 0,
        "{what}: parity inconsistent: {:?}",
        f.ranges
    );
    assert_eq!(f.unreadable, 0, "{what}");
    drop(hb);
    drop(ha);
    pool.shutdown().unwrap();
}

#[test]
fn raid5_units_allocated_after_the_last_commit_are_zero_when_reused() {
    for seed in 1..=2 {
        uncommitted_units_come_back_zeroed(
            LayoutKind::Raid5 { stripe: 16 << 10 },
            1 << 20,
            48 << 20,
            seed,
        );
    }
}

/// More units than the reserve holds are allocated at once: the reserve is topped up
/// while the writes wait (off the reactor), and the units reserved then are as safe.
/// Rows of 24 KiB: a reserved unit shares its edge rows with its neighbours, some of
/// them allocated and committed, whose data the zeroing at open must keep.
#[test]
fn raid5_burst_beyond_the_allocation_reserve() {
    uncommitted_units_come_back_zeroed(
        LayoutKind::Raid5 { stripe: 8 << 10 },
        64 << 10,
        64 << 20,
        4,
    );
}

#[test]
fn ec_units_allocated_after_the_last_commit_are_zero_when_reused() {
    uncommitted_units_come_back_zeroed(
        LayoutKind::Ec {
            k: 2,
            m: 2,
            stripe: 16 << 10,
        },
        1 << 20,
        48 << 20,
        3,
    );
}
