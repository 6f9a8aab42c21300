//! Snapshots, clones and rollbacks of dedup volumes (issue 25, docs/format.md §17 and
//! §3.4): a snapshot copies nothing and keeps what the volume had; the volume's and a
//! clone's writes go to their own layers; blocks written again through a clone are
//! shared; deleting snapshots, clones and volumes gives a block back exactly when its
//! last reference goes. The power-loss side is the model checker's (`model_check_dedup`).

#![allow(clippy::cast_possible_truncation)]

use crate::common;
use crate::dedup::{assert_metadata_clean, ram_pool, reopen, trim};

use common::*;
use tessera_io::IoOp;
use tessera_pool::LayoutKind;

const BLK: u64 = 4096;
const MIB: u64 = 1 << 20;

fn physical(pool: &tessera_pool::Pool) -> u64 {
    pool.dedup_stats().unwrap().physical_bytes
}

#[test]
fn a_snapshot_keeps_what_the_volume_had_and_a_clone_shares_it() {
    let (pool, ram) = ram_pool(LayoutKind::Concat, 1);
    let a = pattern(31, 2 * MIB as usize);
    let new = pattern(32, BLK as usize);
    let mut io = core();
    let v = pool.create_volume("v", 8 * MIB).unwrap();
    let mut hv = v.open_handle();
    assert_eq!(write(&mut io, &mut hv, 0, &a), 0);
    let s = pool.create_snapshot(&v, "s").unwrap();
    assert!(s.block_mapped() && v.block_mapped());
    assert_eq!(physical(&pool), 2 * MIB, "a snapshot copies nothing");
    // After the snapshot: a whole block, part of a block (merged with the snapshot's
    // bytes), a TRIM and a write of zeros over the snapshot's blocks.
    assert_eq!(write(&mut io, &mut hv, 0, &new), 0);
    assert_eq!(write(&mut io, &mut hv, 5 * BLK + 512, &new[..512]), 0);
    trim(&mut io, &mut hv, 10 * BLK, BLK);
    assert_eq!(
        write(&mut io, &mut hv, 11 * BLK, &vec![0u8; BLK as usize]),
        0
    );
    let mut want_v = a.clone();
    want_v[..BLK as usize].copy_from_slice(&new);
    want_v[5 * BLK as usize + 512..5 * BLK as usize + 1024].copy_from_slice(&new[..512]);
    want_v[10 * BLK as usize..12 * BLK as usize].fill(0);
    let check = |pool: &tessera_pool::Pool, io: &mut tessera_io::CoreIo| {
        let v = pool.volume("v").unwrap();
        let s = pool.volume("s").unwrap();
        let (mut hv, mut hs) = (v.open_handle(), s.open_handle());
        assert!(read(io, &mut hv, 0, a.len()).unwrap() == want_v);
        assert!(
            read(io, &mut hs, 0, a.len()).unwrap() == a,
            "the snapshot changed"
        );
        assert_eq!(
            v.allocation_runs(9 * BLK, 4 * BLK, 8),
            vec![(BLK, true), (2 * BLK, false), (BLK, true)]
        );
        assert_eq!(
            s.allocation_runs(9 * BLK, 4 * BLK, 8),
            vec![(4 * BLK, true)]
        );
    };
    check(&pool, &mut io);
    assert_eq!(physical(&pool), 2 * MIB + 2 * BLK, "two new blocks");
    // A snapshot is read-only.
    let mut hs = s.open_handle();
    assert_eq!(write(&mut io, &mut hs, 0, &new), -libc::EROFS);
    // What changed since the snapshot: exactly the four blocks.
    assert_eq!(
        pool.changed_extents(&s, &v).unwrap(),
        vec![(0, BLK), (5 * BLK, BLK), (10 * BLK, 2 * BLK)]
    );
    // A clone reads the snapshot; the same bytes written through it are shared, and
    // its own writes change neither the snapshot nor the volume.
    let c = pool.clone_snapshot(&s, "c", false).unwrap();
    assert!(c.block_mapped());
    let mut hc = c.open_handle();
    assert!(read(&mut io, &mut hc, 0, a.len()).unwrap() == a);
    let hits = pool.dedup_stats().unwrap().hits;
    assert_eq!(write(&mut io, &mut hc, MIB, &new), 0);
    assert_eq!(write(&mut io, &mut hc, 3 * MIB, &a[..MIB as usize]), 0);
    assert_eq!(pool.dedup_stats().unwrap().hits, hits + 1 + 256);
    assert_eq!(
        physical(&pool),
        2 * MIB + 2 * BLK,
        "written again, stored once"
    );
    let own = pattern(33, BLK as usize);
    assert_eq!(write(&mut io, &mut hc, 2 * BLK, &own), 0);
    assert_eq!(read(&mut io, &mut hc, 2 * BLK, BLK as usize).unwrap(), own);
    check(&pool, &mut io);
    assert_metadata_clean(&pool);
    // All of it survives a reopen: the chains, the entries and the counts.
    drop((hv, hs, hc));
    pool.shutdown().unwrap();
    drop(pool);
    let pool = reopen(&ram);
    check(&pool, &mut io);
    let c = pool.volume("c").unwrap();
    let mut hc = c.open_handle();
    assert_eq!(read(&mut io, &mut hc, 2 * BLK, BLK as usize).unwrap(), own);
    assert!(read(&mut io, &mut hc, 3 * MIB, MIB as usize).unwrap() == a[..MIB as usize]);
    assert_metadata_clean(&pool);
}

#[test]
fn deleting_snapshots_clones_and_volumes_gives_blocks_back_with_their_last_reference() {
    let (pool, _ram) = ram_pool(LayoutKind::Raid1 { copies: 2 }, 2);
    let a = pattern(41, MIB as usize);
    let b = pattern(42, MIB as usize / 2);
    let mut io = core();
    let v = pool.create_volume("v", 4 * MIB).unwrap();
    {
        let mut hv = v.open_handle();
        assert_eq!(write(&mut io, &mut hv, 0, &a), 0);
        let s = pool.create_snapshot(&v, "s").unwrap();
        // v rewrites the first half: the snapshot alone holds those 128 blocks now.
        assert_eq!(write(&mut io, &mut hv, 0, &b), 0);
        assert_eq!(physical(&pool), MIB + MIB / 2);
        let info = pool.snapshots();
        let si = info.iter().find(|i| i.name == "s").unwrap();
        assert_eq!((si.exclusive, si.shared), (MIB / 2, MIB / 2));
        // Deleted while v reads through it: hidden; what v covers goes.
        pool.delete_volume(&s).unwrap();
        assert!(pool.snapshots().is_empty());
        pool.commit().unwrap();
        assert_eq!(
            physical(&pool),
            MIB,
            "the covered half of the snapshot is freed"
        );
        let mut want = a.clone();
        want[..b.len()].copy_from_slice(&b);
        assert!(read(&mut io, &mut hv, 0, a.len()).unwrap() == want);
        assert_metadata_clean(&pool);
    }
    // v's snapshot and a clone of it: the volume goes first, the clone still reads.
    let t = pool.create_snapshot(&v, "t").unwrap();
    let c = pool.clone_snapshot(&t, "c", false).unwrap();
    pool.delete_volume(&t).unwrap();
    pool.delete_volume(&v).unwrap();
    pool.commit().unwrap();
    let mut hc = c.open_handle();
    let mut want = a.clone();
    want[..b.len()].copy_from_slice(&b);
    assert!(read(&mut io, &mut hc, 0, a.len()).unwrap() == want);
    assert_eq!(physical(&pool), MIB);
    assert_metadata_clean(&pool);
    drop(hc);
    // The last reader goes: the hidden snapshots with it, and every block.
    pool.delete_volume(&c).unwrap();
    pool.commit().unwrap();
    let st = pool.dedup_stats().unwrap();
    assert_eq!((st.physical_bytes, st.logical_bytes), (0, 0));
    assert!(pool.volumes().is_empty(), "volumes left");
    assert_metadata_clean(&pool);
}

#[test]
fn a_rollback_gives_the_snapshot_back_and_frees_what_was_written_since() {
    let (pool, _ram) = ram_pool(LayoutKind::Concat, 1);
    let a = pattern(51, MIB as usize);
    let mut io = core();
    let v = pool.create_volume("v", 4 * MIB).unwrap();
    let s = {
        let mut hv = v.open_handle();
        assert_eq!(write(&mut io, &mut hv, 0, &a), 0);
        let s = pool.create_snapshot(&v, "s").unwrap();
        assert_eq!(
            write(&mut io, &mut hv, 0, &pattern(52, 2 * MIB as usize)),
            0
        );
        assert_eq!(
            run(
                &mut io,
                &mut hv,
                IoOp::Discard {
                    offset: 0,
                    len: BLK
                }
            ),
            0
        );
        s
    };
    assert_eq!(physical(&pool), 3 * MIB - BLK);
    pool.rollback_volume(&v, &s).unwrap();
    pool.commit().unwrap();
    assert_eq!(physical(&pool), MIB);
    let mut hv = v.open_handle();
    assert!(read(&mut io, &mut hv, 0, 2 * MIB as usize).unwrap()[..MIB as usize] == a);
    assert!(is_zero(&read(&mut io, &mut hv, MIB, MIB as usize).unwrap()));
    // It writes on from there, into its own layer again.
    assert_eq!(write(&mut io, &mut hv, 0, &pattern(53, BLK as usize)), 0);
    let mut hs = s.open_handle();
    assert!(read(&mut io, &mut hs, 0, a.len()).unwrap() == a);
    assert_metadata_clean(&pool);
}

/// Runs of `(length, allocated)` over `[from, to)` for the 4 KiB blocks at `blocks`
/// (sorted byte offsets), as `allocation_runs` answers them.
fn expected_runs(blocks: &[u64], from: u64, to: u64) -> Vec<(u64, bool)> {
    let mut runs: Vec<(u64, bool)> = Vec::new();
    let mut push = |len: u64, v: bool| match runs.last_mut() {
        Some((l, m)) if *m == v => *l += len,
        _ if len > 0 => runs.push((len, v)),
        _ => {}
    };
    let mut at = from;
    for &b in blocks.iter().filter(|&&b| b + BLK > from && b < to) {
        push(b.max(at) - at, false);
        let e = (b + BLK).min(to);
        push(e - b.max(at), true);
        at = e;
    }
    push(to - at, false);
    runs
}

/// Block status and changed extents of a huge, sparse dedup volume: the scan jumps over
/// volume units with no map page (it visited every 4 KiB block under the pool's dedup
/// lock before: 2.7 s for 1 TiB, during which every dedup write of the pool waited),
/// and gives the same runs, cut to `max_runs`, from any starting point.
#[test]
fn block_status_of_a_huge_sparse_dedup_volume_jumps_over_unwritten_units() {
    const TIB: u64 = 1 << 40;
    const GIB: u64 = 1 << 30;
    let (pool, _ram) = ram_pool(LayoutKind::Concat, 1);
    let mut io = core();
    let v = pool
        .create_volume_opts(
            "v",
            64 * TIB,
            tessera_pool::VolumeOptions {
                force: true,
                ..Default::default()
            },
        )
        .unwrap();
    let mut hv = v.open_handle();
    let mut blocks = vec![
        0,
        MIB - BLK,
        MIB + 2 * BLK,
        5 * GIB + 3 * BLK,
        40 * TIB,
        64 * TIB - BLK,
    ];
    for (i, &b) in blocks.iter().enumerate() {
        assert_eq!(
            write(&mut io, &mut hv, b, &pattern(40 + i as u64, BLK as usize)),
            0
        );
    }
    let s = pool.create_snapshot(&v, "s").unwrap();
    // After the snapshot: a new block, a block written again, a TRIM over the
    // snapshot's block 0 (a zero entry: not allocated, but changed).
    assert_eq!(
        write(&mut io, &mut hv, 7 * GIB, &pattern(50, BLK as usize)),
        0
    );
    assert_eq!(
        write(&mut io, &mut hv, MIB + 2 * BLK, &pattern(51, BLK as usize)),
        0
    );
    trim(&mut io, &mut hv, 0, BLK);
    let snap_blocks = blocks.clone();
    blocks.retain(|&b| b != 0);
    blocks.push(7 * GIB);
    blocks.sort_unstable();
    for (vol, want) in [(&v, &blocks), (&s, &snap_blocks)] {
        assert_eq!(
            vol.allocation_runs(0, 64 * TIB, 64),
            expected_runs(want, 0, 64 * TIB)
        );
        // From the middle of units, cut short, and over a range with no page at all.
        for (from, to) in [
            (MIB - 2 * BLK, 6 * GIB),
            (BLK, MIB + 3 * BLK),
            (41 * TIB, 64 * TIB),
            (2 * TIB, 3 * TIB),
        ] {
            assert_eq!(
                vol.allocation_runs(from, to - from, 64),
                expected_runs(want, from, to),
                "{from}..{to}"
            );
        }
        let all = expected_runs(want, 0, 64 * TIB);
        assert_eq!(vol.allocation_runs(0, 64 * TIB, 3), all[..3].to_vec());
    }
    assert_eq!(
        pool.changed_extents(&s, &v).unwrap(),
        vec![(0, BLK), (MIB + 2 * BLK, BLK), (7 * GIB, BLK)]
    );
    // The snapshot figures and its deletion scan its pages, a chunk per lock hold.
    pool.delete_volume(&s).unwrap();
    assert_metadata_clean(&pool);
}
