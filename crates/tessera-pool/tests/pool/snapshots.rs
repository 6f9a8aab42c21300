//! Snapshots and clones against a model: random writes (aligned and not, smaller and
//! larger than a presence block, across units), write-zeroes, snapshots, clones of
//! clones, deletes anywhere in a chain and rollbacks; every volume and snapshot is read
//! back whole against its model after every step, space adds up, and the scrub's chain
//! checks find nothing. Then power is lost (unflushed device writes dropped, one torn)
//! and the reopened pool must hold every snapshot exactly and every volume's flushed
//! blocks, with the chain checks clean, twice in a row.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use common::*;
use tessera_device::BlockDevice;
use tessera_io::IoOp;
use tessera_pool::{LayoutKind, Pool, PoolOptions, Volume};

const BLK: u64 = 4096;
const SIZE: u64 = 2 << 20;

#[derive(Clone)]
struct Model {
    /// Contents now.
    now: Vec<u8>,
    /// Contents at the last durable point (flush or catalog change).
    durable: Vec<u8>,
    /// 4 KiB blocks written since then (unknown after a power loss).
    dirty: BTreeSet<u64>,
    snapshot: bool,
}

fn crash_devs(images: Option<Vec<Vec<u8>>>, size: u64, n: usize) -> Vec<Arc<CrashDevice>> {
    match images {
        None => (0..n).map(|_| CrashDevice::new(size)).collect(),
        Some(imgs) => imgs.into_iter().map(CrashDevice::from_image).collect(),
    }
}

fn as_block(devs: &[Arc<CrashDevice>]) -> Vec<Arc<dyn BlockDevice>> {
    devs.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

fn vol(pool: &Pool, name: &str) -> Arc<Volume> {
    pool.volume(name)
        .unwrap_or_else(|| panic!("volume {name} missing"))
}

/// Everything so far is durable (a flush, or a catalog change's checkpoint).
fn durable_point(models: &mut BTreeMap<String, Model>) {
    for m in models.values_mut() {
        m.durable = m.now.clone();
        m.dirty.clear();
    }
}

fn verify_exact(pool: &Pool, models: &BTreeMap<String, Model>, what: &str) {
    let mut io = core();
    for (name, m) in models {
        let v = vol(pool, name);
        assert_eq!(v.is_snapshot(), m.snapshot, "{what}: {name} kind");
        let mut h = v.open_handle();
        verify_all(&mut io, &mut h, &m.now, &format!("{what}: {name}"));
    }
    check_space(pool, what);
}

fn check_space(pool: &Pool, what: &str) {
    assert_eq!(pool.verify_chains(), Vec::<String>::new(), "{what}");
    let st = pool.status();
    assert_eq!(st.allocated + st.free, st.capacity, "{what}: space leaked");
}

/// One random step; returns false when the step was a no-op.
fn step(pool: &Pool, models: &mut BTreeMap<String, Model>, rng: &mut Rng, next_name: &mut u32) {
    let names: Vec<String> = models.keys().cloned().collect();
    let volumes: Vec<&String> = names.iter().filter(|n| !models[*n].snapshot).collect();
    let snaps: Vec<&String> = names.iter().filter(|n| models[*n].snapshot).collect();
    let mut io = core();
    match rng.below(20) {
        0..=10 if !volumes.is_empty() => {
            let name = volumes[rng.below(volumes.len() as u64) as usize].clone();
            // Sector-aligned, up to 3 blocks, sometimes across a unit boundary.
            let len = 512 * (1 + rng.below(24));
            let off = 512 * rng.below((SIZE - len) / 512);
            let data = pattern(rng.next(), len as usize);
            let v = vol(pool, &name);
            let mut h = v.open_handle();
            let r = write(&mut io, &mut h, off, &data);
            assert!(r >= 0, "write {name} {off}+{len}: {r}");
            let m = models.get_mut(&name).unwrap();
            m.now[off as usize..(off + len) as usize].copy_from_slice(&data);
            m.dirty.extend(off / BLK..(off + len).div_ceil(BLK));
        }
        11 if !volumes.is_empty() => {
            let name = volumes[rng.below(volumes.len() as u64) as usize].clone();
            let len = 512 * (1 + rng.below(300));
            let off = 512 * rng.below((SIZE - len) / 512);
            let v = vol(pool, &name);
            let mut h = v.open_handle();
            let op = IoOp::WriteZeroes {
                offset: off,
                len,
                may_unmap: rng.below(2) == 0,
            };
            assert!(run(&mut io, &mut h, op) >= 0);
            let m = models.get_mut(&name).unwrap();
            m.now[off as usize..(off + len) as usize].fill(0);
            m.dirty.extend(off / BLK..(off + len).div_ceil(BLK));
        }
        12..=13 if !volumes.is_empty() => {
            let name = volumes[rng.below(volumes.len() as u64) as usize].clone();
            let snap = format!("s{next_name}");
            *next_name += 1;
            pool.create_snapshot(&vol(pool, &name), &snap).unwrap();
            let mut m = models[&name].clone();
            m.snapshot = true;
            models.insert(snap, m);
            durable_point(models);
        }
        14 if !snaps.is_empty() => {
            let snap = snaps[rng.below(snaps.len() as u64) as usize].clone();
            let name = format!("c{next_name}");
            *next_name += 1;
            pool.clone_snapshot(&vol(pool, &snap), &name, true).unwrap();
            let mut m = models[&snap].clone();
            m.snapshot = false;
            models.insert(name, m);
            durable_point(models);
        }
        15 if names.len() > 1 => {
            let name = names[rng.below(names.len() as u64) as usize].clone();
            pool.delete_volume(&vol(pool, &name)).unwrap();
            models.remove(&name);
            durable_point(models);
        }
        16 if !volumes.is_empty() => {
            let name = volumes[rng.below(volumes.len() as u64) as usize].clone();
            let v = vol(pool, &name);
            let ancestors = v.ancestors();
            let visible: Vec<_> = ancestors
                .iter()
                .filter(|a| models.contains_key(&a.name))
                .collect();
            if let Some(s) = visible.get(rng.below(visible.len().max(1) as u64) as usize) {
                pool.rollback_volume(&v, s).unwrap();
                let now = models[&s.name].now.clone();
                models.get_mut(&name).unwrap().now = now;
                durable_point(models);
            }
        }
        _ => {
            let Some(name) = names.first() else { return };
            let v = vol(pool, name);
            let mut h = v.open_handle();
            assert!(flush(&mut io, &mut h) >= 0);
            durable_point(models);
        }
    }
}

/// After a power loss: snapshots exactly; volumes' blocks untouched since the last
/// durable point as they were then. Returns the models as the pool now is (the blocks in
/// doubt read back).
fn verify_after_crash(
    pool: &Pool,
    models: &BTreeMap<String, Model>,
    what: &str,
) -> BTreeMap<String, Model> {
    let mut io = core();
    let mut out = BTreeMap::new();
    for (name, m) in models {
        let v = vol(pool, name);
        let mut h = v.open_handle();
        let got = read(&mut io, &mut h, 0, SIZE as usize).unwrap();
        for b in 0..SIZE / BLK {
            let r = (b * BLK) as usize..((b + 1) * BLK) as usize;
            if !m.dirty.contains(&b) {
                assert!(
                    got[r.clone()] == m.durable[r],
                    "{what}: {name} block {b} lost its durable contents"
                );
            }
        }
        if m.snapshot {
            assert!(got == m.now, "{what}: snapshot {name} changed");
        }
        out.insert(
            name.clone(),
            Model {
                now: got.clone(),
                durable: got,
                dirty: BTreeSet::new(),
                snapshot: m.snapshot,
            },
        );
    }
    check_space(pool, what);
    out
}

fn run_chain_model(seed: u64, unit: u64, layout: LayoutKind) {
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    // Room for every clone to fill its units (1 MiB units: a 2 MiB volume is 2 units);
    // parity layouts keep 17 MiB of each device for their label and stripe journal.
    let dev_size = if unit >= 1 << 20 || layout.is_parity() {
        64 << 20
    } else {
        16 << 20
    };
    let ndev = match layout {
        LayoutKind::Raid5 { .. } => 3,
        LayoutKind::Raid6 { .. } => 4,
        LayoutKind::Ec { k, m, .. } => (k + m) as usize,
        _ => 2,
    };
    let devs = crash_devs(None, dev_size, ndev);
    let pool = Pool::create(
        "p",
        as_block(&devs),
        PoolOptions {
            layout,
            unit_size: unit,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    pool.create_volume("v", SIZE).unwrap();
    let mut models = BTreeMap::new();
    models.insert(
        "v".to_string(),
        Model {
            now: vec![0; SIZE as usize],
            durable: vec![0; SIZE as usize],
            dirty: BTreeSet::new(),
            snapshot: false,
        },
    );
    let mut next_name = 0;
    for i in 0..120 {
        step(&pool, &mut models, &mut rng, &mut next_name);
        if i % 10 == 9 {
            verify_exact(&pool, &models, &format!("seed {seed} step {i}"));
        }
    }
    verify_exact(&pool, &models, &format!("seed {seed} end"));
    let mut devs = devs;
    let mut pool = pool;
    for round in 0..2 {
        // Power is lost between commits, parity pools included: a unit allocated and
        // written since the last commit is free again after the reopen, and a parity
        // pool must not hand it out with that data in it (seed 22 caught it).
        let images: Vec<Vec<u8>> = devs.iter().map(|d| d.crash_image(rng.next())).collect();
        drop(pool);
        devs = crash_devs(Some(images), dev_size, ndev);
        pool = Pool::open(as_block(&devs))
            .unwrap_or_else(|e| panic!("seed {seed} round {round}: reopen failed: {e}"));
        models = verify_after_crash(&pool, &models, &format!("seed {seed} crash {round}"));
        for _ in 0..60 {
            step(&pool, &mut models, &mut rng, &mut next_name);
        }
        verify_exact(&pool, &models, &format!("seed {seed} after crash {round}"));
    }
}

#[test]
fn chains_match_the_model_and_survive_power_loss_64k_units() {
    for seed in 1..=6 {
        run_chain_model(seed, 64 << 10, LayoutKind::Concat);
    }
}

#[test]
fn chains_match_the_model_and_survive_power_loss_1m_units_raid1() {
    for seed in 11..=13 {
        run_chain_model(seed, 1 << 20, LayoutKind::Raid1 { copies: 2 });
    }
}

/// Parity layouts take snapshots and clones too: the first write into a shared unit goes
/// through the asynchronous datapath (no synchronous write that could wait for a row
/// lock its own core holds).
#[test]
fn chains_match_the_model_and_survive_power_loss_raid5() {
    for seed in 21..=23 {
        run_chain_model(seed, 64 << 10, LayoutKind::Raid5 { stripe: 16 << 10 });
    }
}

#[test]
fn chains_match_the_model_and_survive_power_loss_1m_units_ec() {
    for seed in 31..=32 {
        run_chain_model(
            seed,
            1 << 20,
            LayoutKind::Ec {
                k: 2,
                m: 2,
                stripe: 16 << 10,
            },
        );
    }
}

/// A 4 KiB write after a snapshot takes one presence block of a new unit, not a copy of
/// the unit: the new unit is partial, and the snapshot's data still reads through it.
#[test]
fn first_write_after_snapshot_is_partial_and_exact() {
    let dev: Arc<dyn BlockDevice> = tessera_device::RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev.clone()], PoolOptions::default()).unwrap();
    let v = pool.create_volume("v", 8 << 20).unwrap();
    let mut io = core();
    let old = pattern(1, 1 << 20);
    {
        let mut h = v.open_handle();
        assert!(write(&mut io, &mut h, 0, &old) >= 0);
    }
    let s = pool.create_snapshot(&v, "s").unwrap();
    assert!(s.is_snapshot());
    assert_eq!(v.allocated_bytes(), 0);
    assert_eq!(s.allocated_bytes(), 1 << 20);
    let new = pattern(2, 4096);
    {
        let mut h = v.open_handle();
        assert!(write(&mut io, &mut h, 8192, &new) >= 0);
        let got = read(&mut io, &mut h, 0, 1 << 20).unwrap();
        let mut want = old.clone();
        want[8192..12288].copy_from_slice(&new);
        assert!(got == want);
    }
    // The snapshot is unchanged and refuses writes.
    let mut sh = s.open_handle();
    assert!(read(&mut io, &mut sh, 0, 1 << 20).unwrap() == old);
    assert_eq!(write(&mut io, &mut sh, 0, &new), -libc::EROFS);
    drop(sh);
    // The changed extents since the snapshot are that one block.
    assert_eq!(pool.changed_extents(&s, &v).unwrap(), vec![(8192, 4096)]);
    // One partial unit, and it survives a reopen with its bitmap.
    pool.commit().unwrap();
    let snaps = pool.snapshots();
    assert_eq!(snaps.len(), 1);
    assert_eq!((snaps[0].exclusive, snaps[0].shared), (0, 1 << 20));
    drop((v, s, pool));
    let pool = Pool::open(vec![dev]).unwrap();
    let v = pool.volume("v").unwrap();
    let mut h = v.open_handle();
    let got = read(&mut io, &mut h, 0, 1 << 20).unwrap();
    let mut want = old;
    want[8192..12288].copy_from_slice(&new);
    assert!(got == want);
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
}

/// Deleting a snapshot that a volume reads through keeps what it still reads and frees
/// what it does not; deleting the volume then frees the rest.
#[test]
fn space_comes_back_when_nothing_reads_it() {
    let dev: Arc<dyn BlockDevice> = tessera_device::RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let v = pool.create_volume("v", 8 << 20).unwrap();
    let mut io = core();
    {
        let mut h = v.open_handle();
        assert!(write(&mut io, &mut h, 0, &pattern(1, 4 << 20)) >= 0);
    }
    let s = pool.create_snapshot(&v, "s").unwrap();
    {
        // Rewrite units 0 and 1 whole: the snapshot's copies of them are no longer read.
        let mut h = v.open_handle();
        assert!(write(&mut io, &mut h, 0, &pattern(2, 2 << 20)) >= 0);
    }
    let before = pool.status().allocated;
    assert_eq!(before, 6 << 20);
    let info = &pool.snapshots()[0];
    assert_eq!((info.exclusive, info.shared), (2 << 20, 2 << 20));
    pool.delete_volume(&s).unwrap();
    assert!(pool.volume("s").is_none());
    pool.commit().unwrap();
    assert_eq!(pool.status().allocated, 4 << 20);
    let mut h = v.open_handle();
    let got = read(&mut io, &mut h, 0, 4 << 20).unwrap();
    assert!(got[..2 << 20] == pattern(2, 2 << 20)[..]);
    assert!(got[2 << 20..] == pattern(1, 4 << 20)[2 << 20..]);
    drop(h);
    pool.delete_volume(&v).unwrap();
    pool.commit().unwrap();
    assert_eq!(pool.status().allocated, 0);
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
}

/// Two writers and a reader on the same blocks right after a snapshot, each on its own
/// thread and core context: the writers' sub-block writes (one across every block
/// boundary) land in the same not-yet-present blocks at once, so they meet on claimed
/// blocks and wait for each other; the reader must only ever see, byte by byte, the old
/// data or the new (never a block half copied), and afterwards the volume must hold
/// both writers' bytes (no write lost) and the snapshot the old data.
fn concurrent_first_writes(layout: LayoutKind, ndev: usize) {
    use std::sync::Barrier;
    const SPAN: u64 = 2 << 20;
    let devs: Vec<Arc<dyn BlockDevice>> = (0..ndev)
        .map(|_| tessera_device::RamDevice::new(64 << 20).unwrap() as Arc<dyn BlockDevice>)
        .collect();
    let pool = Arc::new(
        Pool::create(
            "p",
            devs.clone(),
            PoolOptions {
                layout,
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let v = pool.create_volume("v", 4 << 20).unwrap();
    let mut model = pattern(100, SPAN as usize);
    {
        let mut io = core();
        let mut h = v.open_handle();
        assert!(write(&mut io, &mut h, 0, &model) >= 0);
    }
    for round in 0..6u64 {
        let snap = pool.create_snapshot(&v, &format!("s{round}")).unwrap();
        let old = model.clone();
        // Writer A: 1 KiB across the end of every block; writer B: 512 bytes inside it.
        let a_data = pattern(200 + round, SPAN as usize);
        let b_data = pattern(300 + round, SPAN as usize);
        let a_ranges: Vec<(u64, u64)> = (0..SPAN / BLK - 1)
            .map(|b| (b * BLK + BLK - 512, 1024))
            .collect();
        let b_ranges: Vec<(u64, u64)> = (0..SPAN / BLK).map(|b| (b * BLK + 1024, 512)).collect();
        let mut new = old.clone();
        for &(off, len) in a_ranges.iter() {
            let r = off as usize..(off + len) as usize;
            new[r.clone()].copy_from_slice(&a_data[r]);
        }
        for &(off, len) in b_ranges.iter() {
            let r = off as usize..(off + len) as usize;
            new[r.clone()].copy_from_slice(&b_data[r]);
        }
        let start = Arc::new(Barrier::new(3));
        let writers_done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let writer = |ranges: Vec<(u64, u64)>, data: Vec<u8>| {
            let (v, start, done) = (v.clone(), start.clone(), writers_done.clone());
            std::thread::spawn(move || {
                let mut io = core();
                let mut h = v.open_handle();
                start.wait();
                for (off, len) in ranges {
                    let r = off as usize..(off + len) as usize;
                    assert!(
                        write(&mut io, &mut h, off, &data[r]) >= 0,
                        "write {off}+{len}"
                    );
                }
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
        };
        let wa = writer(a_ranges, a_data);
        let wb = writer(b_ranges, b_data);
        let reader = {
            let (v, start, done) = (v.clone(), start.clone(), writers_done.clone());
            let (old, new) = (old.clone(), new.clone());
            std::thread::spawn(move || {
                let mut io = core();
                let mut h = v.open_handle();
                let mut rng = Rng(round * 7919 + 1);
                start.wait();
                let mut reads = 0;
                while done.load(std::sync::atomic::Ordering::SeqCst) < 2 || reads < 64 {
                    // One to three blocks, anywhere in the span.
                    let b = rng.below(SPAN / BLK - 2);
                    let len = BLK * (1 + rng.below(3));
                    let got = read(&mut io, &mut h, b * BLK, len as usize).unwrap();
                    for (i, &g) in got.iter().enumerate() {
                        let at = (b * BLK) as usize + i;
                        assert!(
                            g == old[at] || g == new[at],
                            "round {round}: byte {at} reads {g:#x}: neither old {:#x} nor new {:#x}",
                            old[at],
                            new[at]
                        );
                    }
                    reads += 1;
                }
            })
        };
        for t in [wa, wb, reader] {
            t.join().unwrap();
        }
        model = new;
        let mut io = core();
        let mut h = v.open_handle();
        verify_all(&mut io, &mut h, &model, &format!("round {round}: volume"));
        let mut sh = snap.open_handle();
        verify_all(&mut io, &mut sh, &old, &format!("round {round}: snapshot"));
    }
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
    // Every block marked present is durable with its data: reopen and compare.
    pool.commit().unwrap();
    drop(v);
    let pool = Arc::into_inner(pool).expect("no other reference to the pool");
    pool.shutdown().unwrap();
    drop(pool);
    let pool = Pool::open(devs).unwrap();
    let v = pool.volume("v").unwrap();
    let mut io = core();
    let mut h = v.open_handle();
    verify_all(&mut io, &mut h, &model, "after reopen");
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
}

#[test]
fn concurrent_first_writes_on_one_block_lose_nothing() {
    concurrent_first_writes(LayoutKind::Concat, 1);
}

#[test]
fn concurrent_first_writes_on_one_block_lose_nothing_raid5() {
    concurrent_first_writes(LayoutKind::Raid5 { stripe: 16 << 10 }, 3);
}

/// Discard in a chain: units the snapshot shares stay as they are (the snapshot is not
/// touched, the volume keeps reading what it read); units only the volume has are given
/// back and read as zeros, as on a plain volume.
#[test]
fn discard_in_a_chain_gives_back_only_unshared_units() {
    const MIB: u64 = 1 << 20;
    let dev: Arc<dyn BlockDevice> = tessera_device::RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let v = pool.create_volume("v", 8 * MIB).unwrap();
    let mut io = core();
    let old = pattern(1, 2 * MIB as usize);
    let mut h = v.open_handle();
    assert!(write(&mut io, &mut h, 0, &old) >= 0);
    drop(h);
    let s = pool.create_snapshot(&v, "s").unwrap();
    let mut h = v.open_handle();
    // Units 2 and 3 are the volume's alone; unit 0 gets a partial unit.
    assert!(write(&mut io, &mut h, 2 * MIB, &pattern(2, 2 * MIB as usize)) >= 0);
    assert!(write(&mut io, &mut h, 4096, &pattern(3, 4096)) >= 0);
    pool.commit().unwrap();
    assert_eq!(pool.status().allocated, 5 * MIB);
    let discard = IoOp::Discard {
        offset: 0,
        len: 4 * MIB,
    };
    assert_eq!(run(&mut io, &mut h, discard), 0);
    pool.commit().unwrap();
    assert_eq!(pool.status().allocated, 3 * MIB, "units 2 and 3 given back");
    let got = read(&mut io, &mut h, 0, 4 * MIB as usize).unwrap();
    let mut want = old.clone();
    want[4096..8192].copy_from_slice(&pattern(3, 4096));
    assert!(got[..2 * MIB as usize] == want[..], "shared units changed");
    assert!(
        got[2 * MIB as usize..].iter().all(|&b| b == 0),
        "released units do not read as zeros"
    );
    let mut sh = s.open_handle();
    assert!(read(&mut io, &mut sh, 0, 2 * MIB as usize).unwrap() == old);
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
    // Write-zeroes that may unmap gives unshared units back too.
    assert!(write(&mut io, &mut h, 6 * MIB, &pattern(4, MIB as usize)) >= 0);
    let zeroes = IoOp::WriteZeroes {
        offset: 6 * MIB,
        len: MIB,
        may_unmap: true,
    };
    assert_eq!(run(&mut io, &mut h, zeroes), 0);
    pool.commit().unwrap();
    assert_eq!(pool.status().allocated, 3 * MIB);
    assert!(read(&mut io, &mut h, 6 * MIB, MIB as usize)
        .unwrap()
        .iter()
        .all(|&b| b == 0));
}
