//! A parity pool takes its free units as zero on every device: a unit handed out is not
//! zeroed again, a partial write into it leaves the rest as the devices hold it, and a
//! read-modify-write computes the row's parity from what the row holds. A rebuilt device
//! must therefore hold zeros in the rows of free units too, whatever it held before: a
//! replacement full of old data, or the same device coming back after units were freed
//! (and zeroed on the other devices) while it was away. These tests rebuild such a
//! device, give every free unit to a new volume with small writes, and check that the
//! volume reads zeros around its writes, that parity is consistent, and that the data
//! survives the failure of other devices (reconstructed through the rebuilt one).

// Test code builds data patterns and sizes from its own constants: its truncating casts
// are bounded by them.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;

use common::*;
use tessera_device::BlockDevice;
use tessera_io::CoreIo;
use tessera_pool::{LayoutKind, Volume};

const DEV_SIZE: u64 = 32 << 20;
const UNIT: u64 = 64 << 10;

/// Parity of every row is consistent with its data.
fn assert_scrub_clean(r: &Rig, what: &str) {
    let l = &r.pool.core.layout;
    let f = l.scrub_range(0, l.size, false).unwrap();
    assert_eq!(
        f.mismatched, 0,
        "{what}: parity inconsistent in rows {:?}",
        f.ranges
    );
}

/// A new volume takes every free unit with one small write each (512 B to 4 KiB, not
/// covering the unit); returns it and its model. Each unit must read back as written
/// with zeros around.
fn take_every_free_unit(
    r: &Rig,
    io: &mut CoreIo,
    rng: &mut Rng,
    what: &str,
) -> (Arc<Volume>, Vec<u8>) {
    let units = r.pool.status().free / UNIT;
    assert!(units >= 16, "{what}: {units} free units");
    let b = r.pool.create_volume("b", units * UNIT).unwrap();
    let mut h = b.open_handle();
    let mut model = vec![0u8; (units * UNIT) as usize];
    for u in 0..units {
        let len = 512 * (1 + rng.below(8));
        let off = u * UNIT + 512 * rng.below((UNIT - len) / 512);
        let data = pattern(rng.next() | 1, len as usize);
        assert_eq!(write(io, &mut h, off, &data), 0, "{what}");
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
    }
    assert_eq!(r.pool.status().free, 0, "{what}: 'b' took every free unit");
    for u in 0..units {
        let got = read(io, &mut h, u * UNIT, UNIT as usize).unwrap();
        let want = &model[(u * UNIT) as usize..((u + 1) * UNIT) as usize];
        if got != want {
            let at = (0..got.len()).find(|&i| got[i] != want[i]).unwrap();
            panic!(
                "{what}: unit {u} of 'b' reads {:#x} at {at} where it holds {:#x} \
                 (bytes it never wrote)",
                got[at], want[at]
            );
        }
    }
    (b, model)
}

fn ndev(kind: LayoutKind) -> usize {
    match kind {
        // 8 KiB chunks on 4 devices: 24 KiB rows, so units share their edge rows.
        LayoutKind::Raid5 { stripe } if stripe == 8 << 10 => 4,
        LayoutKind::Raid5 { .. } => 3,
        LayoutKind::Raid6 { .. } => 4,
        _ => unreachable!("parity layouts only"),
    }
}

/// The devices that fail after the rebuild: as many as the code tolerates, none of them
/// the rebuilt one, so the rebuilt device's chunks take part in every reconstruction.
fn second_failures(kind: LayoutKind, rebuilt: usize) -> Vec<usize> {
    let m = if matches!(kind, LayoutKind::Raid6 { .. }) {
        2
    } else {
        1
    };
    (0..ndev(kind)).filter(|&d| d != rebuilt).take(m).collect()
}

/// After the rebuild of `victim`: every free unit goes to a new volume; then other
/// devices fail and every byte of 'a' and 'b' must still read as written.
fn check_after_rebuild(
    r: &Rig,
    kind: LayoutKind,
    victim: usize,
    a: &Arc<Volume>,
    model_a: &mut [u8],
    seed: u64,
    what: &str,
) {
    let mut io = core();
    let mut rng = Rng(seed | 1);
    assert_scrub_clean(r, what);
    let (b, model_b) = take_every_free_unit(r, &mut io, &mut rng, what);
    assert_scrub_clean(r, what);
    for d in second_failures(kind, victim) {
        fail_by_write(r, &mut io, a, model_a, d);
    }
    let mut ha = a.open_handle();
    verify_all(&mut io, &mut ha, model_a, &format!("{what}: 'a' degraded"));
    let mut hb = b.open_handle();
    verify_all(&mut io, &mut hb, &model_b, &format!("{what}: 'b' degraded"));
}

/// A replacement device full of old data: the rebuild reconstructs the allocated units
/// and must zero the free ones, or 'b' reads the old data around its writes and a read-
/// modify-write leaves parity that reconstructs garbage once another device fails.
fn garbage_replacement(kind: LayoutKind, victim: usize, seed: u64) {
    let what = format!("{kind:?}, garbage replacement for device {victim}");
    let r = rig(kind, ndev(kind), DEV_SIZE, UNIT);
    let mut io = core();
    // 'a' fills about a third of the pool.
    let size = r.pool.status().free / UNIT / 3 * UNIT;
    let a = r.pool.create_volume("a", size).unwrap();
    let mut model_a = pattern(seed, size as usize);
    let mut h = a.open_handle();
    assert_eq!(write(&mut io, &mut h, 0, &model_a), 0);
    drop(h);
    r.pool.commit().unwrap();
    fail_by_write(&r, &mut io, &a, &mut model_a, victim);
    // The replacement in the slot holds somebody else's data everywhere.
    let junk = pattern(seed ^ 0x6a75_6e6b, DEV_SIZE as usize);
    r.ram[victim].write_at(0, &junk).unwrap();
    rebuild(&r, victim);
    check_after_rebuild(&r, kind, victim, &a, &mut model_a, seed, &what);
}

/// The failed device itself comes back, after a volume was deleted while it was away:
/// freeing zeroed the deleted volume's units on the other devices only, so the device
/// still holds its data in them.
fn device_back_after_free(kind: LayoutKind, victim: usize, seed: u64) {
    let what = format!("{kind:?}, device {victim} back after a delete");
    let r = rig(kind, ndev(kind), DEV_SIZE, UNIT);
    let mut io = core();
    let units = r.pool.status().free / UNIT;
    let size = units / 3 * UNIT;
    let a = r.pool.create_volume("a", size).unwrap();
    let mut model_a = pattern(seed, size as usize);
    let mut h = a.open_handle();
    assert_eq!(write(&mut io, &mut h, 0, &model_a), 0);
    drop(h);
    // 'gone' fills the rest of the pool, then is deleted while the victim is away.
    let gone_size = r.pool.status().free / UNIT * UNIT;
    let gone = r.pool.create_volume("gone", gone_size).unwrap();
    let mut hg = gone.open_handle();
    let secret = pattern(seed ^ 0x5ec7e7, gone_size as usize);
    assert_eq!(write(&mut io, &mut hg, 0, &secret), 0);
    drop(hg);
    r.pool.commit().unwrap();
    fail_by_write(&r, &mut io, &a, &mut model_a, victim);
    r.pool.delete_volume(&gone).unwrap();
    drop(gone);
    // The deleted units are zeroed (on the readable devices) and free once committed.
    r.pool.commit().unwrap();
    assert!(
        r.pool.status().free >= gone_size,
        "{what}: the delete freed the units"
    );
    rebuild(&r, victim);
    check_after_rebuild(&r, kind, victim, &a, &mut model_a, seed, &what);
}

#[test]
fn raid5_rebuild_zeroes_free_units_of_a_garbage_replacement() {
    garbage_replacement(LayoutKind::Raid5 { stripe: 16 << 10 }, 1, 0x51);
    // Rows shared between units: the free units' edge rows are reconstructed.
    garbage_replacement(LayoutKind::Raid5 { stripe: 8 << 10 }, 2, 0x52);
}

#[test]
fn raid6_rebuild_zeroes_free_units_of_a_garbage_replacement() {
    garbage_replacement(LayoutKind::Raid6 { stripe: 16 << 10 }, 0, 0x61);
}

#[test]
fn raid5_device_back_after_units_were_freed_while_away() {
    device_back_after_free(LayoutKind::Raid5 { stripe: 16 << 10 }, 2, 0x53);
    device_back_after_free(LayoutKind::Raid5 { stripe: 8 << 10 }, 1, 0x54);
}

#[test]
fn raid6_device_back_after_units_were_freed_while_away() {
    device_back_after_free(LayoutKind::Raid6 { stripe: 16 << 10 }, 3, 0x62);
}
