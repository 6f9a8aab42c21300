//! Parity layouts (raid5, raid6, ec k+m) over fault-injecting devices, against an
//! in-memory model: random writes of every shape (partial chunks, whole rows, across
//! rows) with several in flight; one device (raid5) or two (raid6, ec m=2) failing at
//! random moments (vanish, read errors, write errors); reopen; rebuild onto a blank
//! device; a further failure after the rebuild. And the write hole: writes frozen at a
//! random moment mid-flight (a crash), recovery, then every single-device failure must
//! read back exactly what the healthy pool reads.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::sync::Arc;
use tessera_api::{DeviceHealth, PoolState};

use common::*;
use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};
use tessera_pool::{Layout, LayoutKind, Pool, PoolOptions};

const DEV_SIZE: u64 = 40 << 20;
const VOL_SIZE: usize = 12 << 20;

/// A batch of concurrent, non-overlapping random writes (sizes from 512 bytes to several
/// rows), applied to the model; every one must succeed.
fn write_batch(io: &mut CoreIo, h: &mut dyn IoHandle, model: &mut [u8], rng: &mut Rng, row: usize) {
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    let batch = 1 + rng.below(8) as usize;
    let mut tags = 0;
    for _ in 0..batch {
        let len = match rng.below(4) {
            0 => 512 * (1 + rng.below(16) as usize),
            1 => 4096 * (1 + rng.below(8) as usize),
            2 => row * (1 + rng.below(2) as usize),
            _ => 4096 * (1 + rng.below(64) as usize),
        };
        let off = if rng.below(3) == 0 {
            row * rng.below(((model.len() - len) / row) as u64) as usize
        } else {
            512 * rng.below(((model.len() - len) / 512) as u64) as usize
        };
        if ranges.iter().any(|&(o, l)| off < o + l && o < off + len) {
            continue;
        }
        ranges.push((off, len));
        let b = if rng.below(8) == 0 {
            None
        } else {
            Some(pattern(rng.next(), len))
        };
        match &b {
            Some(b) => model[off..off + len].copy_from_slice(b),
            None => model[off..off + len].fill(0),
        }
        let op = match &b {
            Some(b) => IoOp::Write {
                offset: off as u64,
                len: len as u32,
                buf: b.as_ptr(),
            },
            None => IoOp::WriteZeroes {
                offset: off as u64,
                len: len as u64,
                may_unmap: false,
            },
        };
        if let Some(b) = b {
            bufs.push(b);
        }
        // SAFETY: `bufs` keeps every write's data, and outlives the drain below.
        unsafe { h.submit(io, op, Tag::task(0, tags)) };
        tags += 1;
    }
    let mut done = 0;
    io.run_until_idle(|_, _, r| {
        assert!(r >= 0, "write failed with {r} while redundancy sufficed");
        done += 1;
    });
    assert_eq!(done, tags);
}

fn parity_pool(ram: &[Arc<RamDevice>], kind: LayoutKind) -> (Pool, Vec<Arc<FaultConfig>>) {
    let (devs, cfgs) = wrap(ram);
    let pool = Pool::create(
        "p",
        devs,
        PoolOptions {
            layout: kind,
            unit_size: 64 << 10,
            force: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    (pool, cfgs)
}

fn row_bytes(kind: LayoutKind, ndev: usize) -> usize {
    (ndev - kind.parity() as usize) * kind.stripe() as usize
}

/// Fail `victims` one after the other at random moments of a random-write load; verify;
/// reopen; replace the first victim by a blank device and rebuild it; fail one more.
fn scenario(kind: LayoutKind, ndev: usize, victims: &[(usize, Fault)], seed: u64) {
    let what = format!("{kind:?} victims {victims:?}");
    let ram: Vec<Arc<RamDevice>> = (0..ndev)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap())
        .collect();
    let (pool, cfgs) = parity_pool(&ram, kind);
    let row = row_bytes(kind, ndev);
    let vol = pool.create_volume("v", VOL_SIZE as u64).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let mut model = vec![0u8; VOL_SIZE];
    let mut rng = Rng(seed | 1);
    let batches = 120u64;
    let at: Vec<u64> = victims
        .iter()
        .map(|_| 10 + rng.below(batches - 20))
        .collect();
    for b in 0..batches {
        for (i, &(v, f)) in victims.iter().enumerate() {
            if at[i] == b {
                inject(&cfgs[v], f);
            }
        }
        write_batch(&mut io, &mut h, &mut model, &mut rng, row);
        if rng.below(4) == 0 {
            let len = 512 * (1 + rng.below(300) as usize);
            let off = 512 * rng.below(((VOL_SIZE - len) / 512) as u64) as usize;
            let got = read(&mut io, &mut h, off as u64, len).expect("read");
            assert!(
                got == model[off..off + len],
                "{what}: read differs at {off}+{len}"
            );
        }
    }
    assert_eq!(flush(&mut io, &mut h), 0);
    verify_all(&mut io, &mut h, &model, &what);
    // A read error is only seen when the device is read; make sure every victim was.
    let st = pool.status();
    for &(v, _) in victims {
        assert_eq!(
            st.device_states[v].state,
            DeviceHealth::Failed,
            "{what}: device {v}"
        );
    }
    assert_eq!(st.state, PoolState::Degraded);
    drop(h);
    pool.shutdown().unwrap();
    drop(vol);
    drop(pool);

    // Restart with every device answering again: the victims stay failed.
    let (devs, _cfgs) = wrap(&ram);
    let pool = Pool::open(devs).unwrap();
    for &(v, _) in victims {
        assert_eq!(pool.status().device_states[v].state, DeviceHealth::Failed);
    }
    let vol = pool.volume("v").unwrap();
    let mut h = vol.open_handle();
    verify_all(&mut io, &mut h, &model, &format!("{what} after reopen"));
    drop(h);
    pool.shutdown().unwrap();
    drop(vol);
    drop(pool);

    // The first victim replaced by a blank device and rebuilt while writes continue.
    let victim = victims[0].0;
    let mut ram2 = ram.clone();
    ram2[victim] = RamDevice::new(DEV_SIZE).unwrap();
    let (devs, cfgs) = wrap(&ram2);
    let pool = Pool::open(devs).unwrap();
    let vol = pool.volume("v").unwrap();
    let layout = pool.core.layout.clone();
    layout.start_rebuild(victim).unwrap();
    let mut h = vol.open_handle();
    let step = 1u64 << 20;
    let mut off = 0;
    let mut scratch = vec![0u8; step as usize];
    while off < layout.size {
        let n = step.min(layout.size - off);
        layout
            .rebuild_range(victim, off, &mut scratch[..n as usize])
            .unwrap();
        write_batch(&mut io, &mut h, &mut model, &mut rng, row);
        off += n;
    }
    layout.finish_rebuild(victim);
    verify_all(&mut io, &mut h, &model, &format!("{what} after rebuild"));
    // Another device fails: the rebuilt one must now carry its share.
    let other = (0..ndev)
        .find(|d| *d != victim && !victims.iter().any(|v| v.0 == *d))
        .unwrap();
    cfgs[other].vanish();
    write_batch(&mut io, &mut h, &mut model, &mut rng, row);
    verify_all(
        &mut io,
        &mut h,
        &model,
        &format!("{what} rebuilt, then device {other} gone"),
    );
}

#[test]
fn raid5_survives_any_one_device_failing() {
    let mut seed = 3;
    for victim in 0..4 {
        for fault in [Fault::Vanish, Fault::FailReads, Fault::FailWrites] {
            seed += 11;
            scenario(
                LayoutKind::Raid5 { stripe: 16 << 10 },
                4,
                &[(victim, fault)],
                seed,
            );
        }
    }
}

#[test]
fn raid6_survives_any_two_devices_failing() {
    let mut seed = 7;
    let faults = [Fault::Vanish, Fault::FailReads, Fault::FailWrites];
    for a in 0..5 {
        for b in 0..5 {
            if a == b {
                continue;
            }
            seed += 13;
            let fa = faults[(seed % 3) as usize];
            let fb = faults[((seed / 3) % 3) as usize];
            scenario(
                LayoutKind::Raid6 { stripe: 8 << 10 },
                5,
                &[(a, fa), (b, fb)],
                seed,
            );
        }
    }
}

#[test]
fn ec_4_2_survives_any_two_devices_failing() {
    let mut seed = 19;
    let faults = [Fault::Vanish, Fault::FailReads, Fault::FailWrites];
    for (a, b) in [(0, 1), (2, 5), (4, 3), (1, 5), (5, 0)] {
        seed += 17;
        let fa = faults[(seed % 3) as usize];
        let fb = faults[((seed / 3) % 3) as usize];
        scenario(
            LayoutKind::Ec {
                k: 4,
                m: 2,
                stripe: 16 << 10,
            },
            6,
            &[(a, fa), (b, fb)],
            seed,
        );
    }
}

#[test]
fn ec_3_3_survives_three_devices_failing() {
    scenario(
        LayoutKind::Ec {
            k: 3,
            m: 3,
            stripe: 4 << 10,
        },
        6,
        &[
            (0, Fault::Vanish),
            (4, Fault::FailWrites),
            (2, Fault::FailReads),
        ],
        99,
    );
}

#[test]
fn too_many_failures_give_eio_not_wrong_data() {
    let ram: Vec<Arc<RamDevice>> = (0..4).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let (pool, cfgs) = parity_pool(&ram, LayoutKind::Raid5 { stripe: 16 << 10 });
    let layout = pool.core.layout.clone();
    let base = pool.status().metadata;
    let mut io = core();
    let mut h = layout.open_handle();
    let data = pattern(1, 256 << 10);
    assert_eq!(write(&mut io, &mut h, base, &data), 0);
    cfgs[1].vanish();
    assert!(read(&mut io, &mut h, base, data.len()).unwrap() == data);
    cfgs[2].vanish();
    assert_eq!(
        read(&mut io, &mut h, base, data.len()).unwrap_err(),
        -libc::EIO
    );
    assert!(write(&mut io, &mut h, base, &data) < 0);
    assert_eq!(pool.status().state, PoolState::Failed);
}

#[test]
fn parity_layouts_reject_bad_geometry() {
    let rams = |n: usize| -> Vec<Arc<dyn BlockDevice>> {
        (0..n)
            .map(|_| RamDevice::new(DEV_SIZE).unwrap() as Arc<dyn BlockDevice>)
            .collect()
    };
    assert!(Layout::new(LayoutKind::Raid5 { stripe: 65536 }, rams(2)).is_err());
    assert!(Layout::new(LayoutKind::Raid6 { stripe: 65536 }, rams(3)).is_err());
    assert!(Layout::new(LayoutKind::Raid5 { stripe: 3000 }, rams(3)).is_err());
    assert!(Layout::new(LayoutKind::Raid5 { stripe: 1 << 20 }, rams(3)).is_err());
    assert!(Layout::new(
        LayoutKind::Ec {
            k: 4,
            m: 2,
            stripe: 65536
        },
        rams(5)
    )
    .is_err());
    let l = Layout::new(LayoutKind::Raid6 { stripe: 65536 }, rams(6)).unwrap();
    assert_eq!(l.size, 4 * ((DEV_SIZE - (17 << 20)) / 65536) * 65536);
}

/// Read the whole layout in 64 KiB reads, several in flight; None where a read failed.
fn read_layout(io: &mut CoreIo, h: &mut dyn IoHandle, size: u64) -> Vec<u8> {
    let chunk = 64usize << 10;
    let mut out = vec![0u8; size as usize];
    for (i, c) in out.chunks_mut(chunk).enumerate() {
        // SAFETY: each read goes to its own chunk of `out`, which outlives the drain below.
        unsafe {
            h.submit(
                io,
                IoOp::Read {
                    offset: (i * chunk) as u64,
                    len: c.len() as u32,
                    buf: c.as_mut_ptr(),
                },
                Tag::task(0, i as u32),
            )
        };
        if i % 16 == 15 {
            io.run_until_idle(|_, _, r| assert!(r >= 0, "read failed with {r}"));
        }
    }
    io.run_until_idle(|_, _, r| assert!(r >= 0, "read failed with {r}"));
    out
}

/// A batch of 4-15 non-overlapping writes over a layout of `size` bytes with rows of
/// `row` bytes: small, whole-row and multi-chunk writes, row-aligned or not.
fn random_batch(rng: &mut Rng, size: usize, row: usize) -> Vec<(usize, Vec<u8>)> {
    let mut batch: Vec<(usize, Vec<u8>)> = Vec::new();
    for _ in 0..(4 + rng.below(12)) {
        let len = match rng.below(3) {
            0 => 512 * (1 + rng.below(16) as usize),
            1 => row,
            _ => 4096 * (1 + rng.below(24) as usize),
        };
        let off = if rng.below(2) == 0 {
            row * rng.below(((size - len) / row) as u64) as usize
        } else {
            512 * rng.below(((size - len) / 512) as u64) as usize
        };
        if batch
            .iter()
            .any(|(o, b)| off < o + b.len() && *o < off + len)
        {
            continue;
        }
        batch.push((off, pattern(rng.next(), len)));
    }
    batch
}

/// Issue every write of `batch` at once and drive them to completion; false if any failed.
fn run_batch(io: &mut CoreIo, h: &mut dyn IoHandle, batch: &[(usize, Vec<u8>)]) -> bool {
    for (i, (off, b)) in batch.iter().enumerate() {
        // SAFETY: `batch` keeps every write's data, and outlives the drain below.
        unsafe {
            h.submit(
                io,
                IoOp::Write {
                    offset: *off as u64,
                    len: b.len() as u32,
                    buf: b.as_ptr(),
                },
                Tag::task(0, i as u32),
            )
        };
    }
    let mut ok = true;
    io.run_until_idle(|_, _, r| ok &= r >= 0);
    ok
}

/// With each set of devices failed in turn, the whole layout reads back as `healthy`:
/// no row reconstructs wrongly.
fn assert_degraded_reads_match(
    layout: &Arc<Layout>,
    io: &mut CoreIo,
    healthy: &[u8],
    sets: &[u64],
    row: usize,
    what: &str,
) {
    for &set in sets {
        layout
            .health
            .failed
            .store(set, std::sync::atomic::Ordering::SeqCst);
        let mut h = layout.open_handle();
        let degraded = read_layout(io, &mut h, layout.size);
        if degraded != healthy {
            let at = (0..healthy.len())
                .find(|&i| degraded[i] != healthy[i])
                .unwrap();
            panic!(
                "{what}: with devices {set:#b} failed, byte {at} reconstructs wrongly (row {})",
                at / row
            );
        }
    }
}

/// Every set of up to `m` failed devices among `ndev` that contains `base`.
fn failure_sets(ndev: usize, m: usize, base: u64) -> Vec<u64> {
    (1u64..1 << ndev)
        .filter(|s| s & base == base && *s != base && s.count_ones() as usize <= m)
        .collect()
}

/// The write hole: every device stops taking writes at a random moment while rows are
/// half written (a crash); the layout is reopened over the same devices and recovers
/// its journal. Then (1) every 512-byte sector holds its last acknowledged contents or
/// those of a write that was in flight, and (2) with any one device (and, for m = 2,
/// any two) failed, degraded reads return exactly what the healthy layout returns — no
/// row reconstructs wrongly. With `pre_failed`, that device is failed from the start
/// (every write degraded, the crash hits a degraded pool) and stays failed after the
/// restart; the other sets then add to it.
fn crash_scenario(kind: LayoutKind, ndev: usize, seed: u64, pre_failed: Option<usize>) {
    let pre: u64 = pre_failed.map_or(0, |d| 1 << d);
    let size_per_dev = 24u64 << 20;
    let ram: Vec<Arc<RamDevice>> = (0..ndev)
        .map(|_| RamDevice::new(size_per_dev).unwrap())
        .collect();
    // One fault config shared by every device: the crash stops them all at once, after
    // a few more I/Os in total — possibly in the middle of a row's in-place writes, but
    // never letting a later phase through (a kill -9: what was issued lands, nothing
    // after it).
    let cfg: Arc<FaultConfig> = Arc::default();
    let devs: Vec<Arc<dyn BlockDevice>> = ram
        .iter()
        .map(|r| FaultDevice::new(r.clone(), cfg.clone()) as Arc<dyn BlockDevice>)
        .collect();
    let uuid = [seed as u8; 16];
    let layout = Arc::new(Layout::new(kind, devs).unwrap());
    layout.set_pool_uuid(uuid);
    layout.format_parity().unwrap();
    layout
        .health
        .failed
        .store(pre, std::sync::atomic::Ordering::SeqCst);
    let size = layout.size as usize;
    let row = row_bytes(kind, ndev);
    let mut committed = vec![0u8; size];
    let mut rng = Rng(seed | 1);
    cfg.latency_us
        .store(30 + rng.below(40), std::sync::atomic::Ordering::Relaxed);
    let freeze_after = std::time::Duration::from_micros(2_000 + rng.below(40_000));
    let more = 1 + rng.below(6);
    let freezer = {
        let cfg = cfg.clone();
        std::thread::spawn(move || {
            std::thread::sleep(freeze_after);
            cfg.vanish_after_more(more);
        })
    };
    let mut io = core();
    let mut h = layout.open_handle();
    // (offset, bytes) of the writes of the batch the crash hit.
    let mut maybe: Vec<(usize, Vec<u8>)> = Vec::new();
    for _ in 0..2000 {
        let batch = random_batch(&mut rng, size, row);
        if !run_batch(&mut io, &mut h, &batch) {
            maybe = batch;
            break;
        }
        for (off, b) in &batch {
            committed[*off..*off + b.len()].copy_from_slice(b);
        }
    }
    freezer.join().unwrap();
    assert!(!maybe.is_empty(), "the crash never hit a batch");
    drop(h);
    drop(layout);

    // "Restart": the same devices, all healthy, the journal recovered.
    let devs: Vec<Arc<dyn BlockDevice>> = ram
        .iter()
        .map(|r| r.clone() as Arc<dyn BlockDevice>)
        .collect();
    let layout = Arc::new(Layout::new(kind, devs).unwrap());
    layout.set_pool_uuid(uuid);
    layout
        .health
        .failed
        .store(pre, std::sync::atomic::Ordering::SeqCst);
    layout.recover_journal().unwrap();
    let mut h = layout.open_handle();
    let healthy = read_layout(&mut io, &mut h, layout.size);
    let mut allowed_new = vec![None::<usize>; size / 512];
    for (w, (off, b)) in maybe.iter().enumerate() {
        for a in &mut allowed_new[off / 512..(off + b.len()) / 512] {
            *a = Some(w);
        }
    }
    for s in 0..size / 512 {
        let got = &healthy[s * 512..(s + 1) * 512];
        if got == &committed[s * 512..(s + 1) * 512] {
            continue;
        }
        let ok = allowed_new[s].is_some_and(|w| {
            let (off, b) = &maybe[w];
            got == &b[s * 512 - off..s * 512 - off + 512]
        });
        assert!(
            ok,
            "{kind:?} seed {seed}: sector {s} holds neither its old nor its new contents"
        );
    }
    let sets = failure_sets(ndev, kind.parity() as usize, pre);
    let what = format!("{kind:?} seed {seed}");
    assert_degraded_reads_match(&layout, &mut io, &healthy, &sets, row, &what);
}

#[test]
fn write_hole_is_closed_raid5() {
    for seed in 1..=12 {
        crash_scenario(LayoutKind::Raid5 { stripe: 8 << 10 }, 4, seed, None);
    }
}

#[test]
fn write_hole_is_closed_raid6() {
    for seed in 21..=30 {
        crash_scenario(LayoutKind::Raid6 { stripe: 8 << 10 }, 5, seed, None);
    }
}

#[test]
fn write_hole_is_closed_ec_4_2() {
    for seed in 41..=48 {
        crash_scenario(
            LayoutKind::Ec {
                k: 4,
                m: 2,
                stripe: 4 << 10,
            },
            6,
            seed,
            None,
        );
    }
}

/// The write hole on a degraded pool: every write (full rows included) leaves a chunk
/// out, so a torn row cannot be repaired by recomputing parity from the data — its
/// journal record must carry the data.
#[test]
fn write_hole_is_closed_on_a_degraded_pool() {
    for seed in 61..=84 {
        crash_scenario(
            LayoutKind::Raid5 { stripe: 8 << 10 },
            4,
            seed,
            Some(seed as usize % 4),
        );
        crash_scenario(
            LayoutKind::Raid6 { stripe: 8 << 10 },
            5,
            seed,
            Some(seed as usize % 5),
        );
    }
}

#[test]
fn row_operations_release_their_joins() {
    let ram: Vec<Arc<RamDevice>> = (0..4).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let (pool, _cfgs) = parity_pool(&ram, LayoutKind::Raid5 { stripe: 16 << 10 });
    let layout = pool.core.layout.clone();
    let mut io = core();
    let mut h = layout.open_handle();
    let mut model = vec![0u8; 4 << 20];
    let mut rng = Rng(5);
    for _ in 0..50 {
        write_batch(&mut io, &mut h, &mut model, &mut rng, 3 * (16 << 10));
    }
    let (all, free) = io.join_slots();
    // One entry may stay: the device watchdog's check timer (it disarms a tick later).
    assert!(
        all - free <= 1,
        "join entries leaked: {} in use",
        all - free
    );
    assert!(
        all < 512,
        "{all} join entries for at most 8 requests in flight"
    );
}

/// A device that stops answering (every I/O held for seconds) is marked failed after the
/// timeout, and I/O goes on without it: for a mirror and for a parity layout.
#[test]
fn a_hung_device_is_marked_failed_and_io_continues() {
    for kind in [
        LayoutKind::Raid1 { copies: 2 },
        LayoutKind::Raid5 { stripe: 16 << 10 },
    ] {
        let n = if kind.is_mirror() { 2 } else { 4 };
        let ram: Vec<Arc<RamDevice>> = (0..n).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
        let (pool, cfgs) = parity_pool(&ram, kind);
        let layout = pool.core.layout.clone();
        layout.watch_devices(std::time::Duration::from_millis(100));
        let base = pool.status().metadata;
        let mut io = core();
        let mut h = layout.open_handle();
        let mut model = vec![0u8; 1 << 20];
        let mut rng = Rng(17);
        for (i, c) in model.chunks_mut(64 << 10).enumerate() {
            c.copy_from_slice(&pattern(i as u64, c.len()));
            assert_eq!(write(&mut io, &mut h, base + (i as u64) * (64 << 10), c), 0);
        }
        cfgs[1].stall(std::time::Duration::from_millis(1500));
        let start = std::time::Instant::now();
        let mut marked = None;
        while start.elapsed() < std::time::Duration::from_secs(5) {
            let off = 4096 * rng.below((model.len() / 4096 - 4) as u64) as usize;
            let data = pattern(rng.next(), 8192);
            assert_eq!(
                write(&mut io, &mut h, base + off as u64, &data),
                0,
                "{kind:?}"
            );
            model[off..off + 8192].copy_from_slice(&data);
            let got = read(&mut io, &mut h, base + off as u64, 8192).expect("read");
            assert!(got == data, "{kind:?}: read back differs");
            if marked.is_none() && layout.is_failed(1) {
                marked = Some(start.elapsed());
            }
            if marked.is_some_and(|m| start.elapsed() > m + std::time::Duration::from_millis(300)) {
                break;
            }
        }
        let m =
            marked.unwrap_or_else(|| panic!("{kind:?}: the hung device was never marked failed"));
        assert!(
            m < std::time::Duration::from_millis(2500),
            "{kind:?}: marked after {m:?}"
        );
        let st = pool.status();
        assert_eq!(st.device_states[1].state, DeviceHealth::Failed);
        assert!(
            st.device_states[1]
                .reason
                .as_deref()
                .unwrap_or("")
                .contains("timed out"),
            "{:?}",
            st.device_states[1]
        );
        cfgs[1].unstall();
        for (i, c) in model.chunks(64 << 10).enumerate() {
            let got = read(&mut io, &mut h, base + (i as u64) * (64 << 10), c.len()).unwrap();
            assert!(got == c, "{kind:?}: chunk {i} differs after the hang");
        }
    }
}

/// First writes to a fresh volume while other writes are in flight on the same core: a
/// unit's allocation must not wait for a row lock that the core's own in-flight I/O
/// holds (rows of 3 × 64 KiB straddle 1 MiB units; the node-level fio test over raid6 on
/// 5 devices deadlocked that way). And units freed and reused read back as zeros where
/// they were not written (free units of parity pools are zeroed before release).
#[test]
fn allocating_units_never_waits_on_the_cores_own_row_locks() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let ram: Vec<Arc<RamDevice>> = (0..4).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
        let (devs, cfgs) = wrap(&ram);
        let pool = Pool::create(
            "p",
            devs,
            PoolOptions {
                layout: LayoutKind::Raid5 { stripe: 64 << 10 },
                unit_size: 1 << 20,
                force: false,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        for c in &cfgs {
            c.latency_us
                .store(200, std::sync::atomic::Ordering::Relaxed);
        }
        let vol = pool.create_volume("v", 16 << 20).unwrap();
        let mut io = core();
        let mut h = vol.open_handle();
        let mut model = vec![0u8; 16 << 20];
        let mut rng = Rng(3);
        for _ in 0..20 {
            let mut bufs: Vec<(usize, Vec<u8>)> = Vec::new();
            for _ in 0..16 {
                let off = 4096 * rng.below((model.len() / 4096) as u64) as usize;
                if bufs.iter().any(|(o, _)| *o == off) {
                    continue;
                }
                bufs.push((off, pattern(rng.next(), 4096)));
            }
            for (i, (off, b)) in bufs.iter().enumerate() {
                // SAFETY: `bufs` keeps every write's data, and outlives the drain below.
                unsafe {
                    h.submit(
                        &mut io,
                        IoOp::Write {
                            offset: *off as u64,
                            len: 4096,
                            buf: b.as_ptr(),
                        },
                        Tag::task(0, i as u32),
                    )
                };
            }
            io.run_until_idle(|_, _, r| assert!(r >= 0, "write failed: {r}"));
            for (off, b) in &bufs {
                model[*off..off + 4096].copy_from_slice(b);
            }
        }
        verify_all(&mut io, &mut h, &model, "fresh raid5 volume");
        // Free everything, commit (zeroes the units), write again: reads of the
        // unwritten parts of a reused unit must be zeros.
        drop(h);
        pool.delete_volume(&vol).unwrap();
        drop(vol);
        pool.core.commit().unwrap();
        let vol = pool.create_volume("w", 16 << 20).unwrap();
        let mut h = vol.open_handle();
        let mut model = vec![0u8; 16 << 20];
        for i in 0..64usize {
            let off = i * (256 << 10);
            let b = pattern(i as u64, 4096);
            assert_eq!(write(&mut io, &mut h, off as u64, &b), 0);
            model[off..off + 4096].copy_from_slice(&b);
        }
        verify_all(&mut io, &mut h, &model, "reused units");
        tx.send(()).unwrap();
    });
    rx.recv_timeout(std::time::Duration::from_secs(120))
        .expect("allocation deadlocked (or took over 2 minutes)");
}

/// A core's parity engine gives its device handles back as soon as the last layout
/// handle on the core using it is gone (before: only when the next engine created on the
/// core swept, so a deleted pool's devices stayed open until then), and the core goes on
/// serving other parity layouts.
#[test]
fn a_gone_pools_engine_releases_its_devices() {
    let mut io = core();
    let ram: Vec<Arc<RamDevice>> = (0..3).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    {
        let devs: Vec<Arc<dyn BlockDevice>> = ram
            .iter()
            .map(|r| r.clone() as Arc<dyn BlockDevice>)
            .collect();
        let l = Arc::new(Layout::new(LayoutKind::Raid5 { stripe: 16 << 10 }, devs).unwrap());
        l.set_pool_uuid([1; 16]);
        let mut h = l.open_handle();
        assert_eq!(write(&mut io, &mut h, 0, &[7u8; 4096]), 0);
    }
    for r in &ram {
        assert_eq!(
            Arc::strong_count(r),
            1,
            "the engine let go of the devices with its last handle"
        );
    }
    let other: Vec<Arc<dyn BlockDevice>> = (0..3)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap() as Arc<dyn BlockDevice>)
        .collect();
    let l2 = Arc::new(Layout::new(LayoutKind::Raid5 { stripe: 16 << 10 }, other).unwrap());
    l2.set_pool_uuid([2; 16]);
    let mut h2 = l2.open_handle();
    assert_eq!(write(&mut io, &mut h2, 0, &[8u8; 4096]), 0);
    for r in &ram {
        assert_eq!(
            Arc::strong_count(r),
            1,
            "a gone layout's device is still held"
        );
    }
}

/// A parity rebuild of a few rows, over and over, while another thread keeps writing
/// them: the row locks keep every rebuilt chunk current. After each pass the rows must be
/// consistent (a scrub finds no parity mismatch): a reconstruction from before a write,
/// written after it, would leave the rebuilt device stale.
#[test]
fn parity_rebuild_races_client_writes_without_losing_any() {
    let ram: Vec<Arc<RamDevice>> = (0..4).map(|_| RamDevice::new(DEV_SIZE).unwrap()).collect();
    let devs: Vec<Arc<dyn BlockDevice>> = ram
        .iter()
        .map(|r| r.clone() as Arc<dyn BlockDevice>)
        .collect();
    let l = Arc::new(Layout::new(LayoutKind::Raid5 { stripe: 4 << 10 }, devs).unwrap());
    l.set_pool_uuid([9; 16]);
    l.format_parity().unwrap();
    let rows = 4u64 * 3 * 4096;
    for pass in 0..150u64 {
        l.mark_failed(1, tessera_pool::layout::FailReason::Write);
        l.start_rebuild(1).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) && i < 100_000 {
                    let b = vec![(pass * 31 + i) as u8; 4096];
                    l.write_at((i % 12) * 4096, &b).unwrap();
                    i += 1;
                }
            })
        };
        let mut buf = vec![0u8; rows as usize];
        for _ in 0..4 {
            l.rebuild_range(1, 0, &mut buf).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        writer.join().unwrap();
        l.finish_rebuild(1);
        let f = l.scrub_range(0, rows, false).unwrap();
        assert_eq!(f.mismatched, 0, "pass {pass}: a rebuilt chunk went stale");
    }
}

/// A 64-bit digest of a sector (the versions a sector may hold are kept as digests).
fn digest(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// The write hole across a **power loss**: the devices have volatile write caches
/// (`CacheDevice`); the client flushes now and then; at a random moment every device
/// stops, and of the writes since each device's last flush a random subset survives. After
/// recovery every sector holds its contents at the last client flush or a version written
/// since, and with any one device (and, for m = 2, any two) failed, degraded reads return
/// exactly what the healthy layout returns.
fn power_loss_scenario(kind: LayoutKind, ndev: usize, seed: u64) {
    use std::sync::atomic::{AtomicI64, Ordering::SeqCst};
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let caches: Vec<Arc<CacheDevice>> = (0..ndev)
        .map(|_| CacheDevice::new(RamDevice::new(24 << 20).unwrap(), budget.clone()))
        .collect();
    let devs = || -> Vec<Arc<dyn BlockDevice>> {
        caches
            .iter()
            .map(|c| c.clone() as Arc<dyn BlockDevice>)
            .collect()
    };
    let uuid = [seed as u8; 16];
    let layout = Arc::new(Layout::new(kind, devs()).unwrap());
    layout.set_pool_uuid(uuid);
    layout.format_parity().unwrap();
    layout.sync().unwrap();
    let size = layout.size as usize;
    let row = row_bytes(kind, ndev);
    let mut rng = Rng(seed | 1);
    // Contents at the last client flush, and per sector the versions written since.
    let mut durable = vec![0u8; size];
    let mut latest = durable.clone();
    let mut since: Vec<Vec<u64>> = vec![Vec::new(); size / 512];
    budget.store(3_000 + rng.below(60_000) as i64, SeqCst);
    let mut io = core();
    let mut h = layout.open_handle();
    let mut crashed = false;
    for round in 0..4000 {
        let batch = random_batch(&mut rng, size, row);
        for (off, b) in &batch {
            for (i, sec) in b.chunks(512).enumerate() {
                since[off / 512 + i].push(digest(sec));
            }
        }
        let mut failed = !run_batch(&mut io, &mut h, &batch);
        if failed {
            crashed = true;
            break;
        }
        for (off, b) in &batch {
            latest[*off..*off + b.len()].copy_from_slice(b);
        }
        if round % 6 == 5 {
            // SAFETY: a flush carries no buffer.
            unsafe { h.submit(&mut io, IoOp::Flush, Tag::task(0, 0)) };
            io.run_until_idle(|_, _, r| failed |= r < 0);
            if failed {
                crashed = true;
                break;
            }
            durable.copy_from_slice(&latest);
            since.iter_mut().for_each(Vec::clear);
        }
    }
    assert!(crashed, "the crash never came");
    drop(h);
    drop(layout);
    for c in &caches {
        c.power_loss(&mut rng);
    }
    budget.store(i64::MAX, SeqCst);

    let layout = Arc::new(Layout::new(kind, devs()).unwrap());
    layout.set_pool_uuid(uuid);
    layout.recover_journal().unwrap();
    let mut h = layout.open_handle();
    let healthy = read_layout(&mut io, &mut h, layout.size);
    for s in 0..size / 512 {
        let got = &healthy[s * 512..(s + 1) * 512];
        assert!(
            got == &durable[s * 512..(s + 1) * 512] || since[s].contains(&digest(got)),
            "{kind:?} seed {seed}: sector {s} holds a version never written since the last flush"
        );
    }
    let sets = failure_sets(ndev, kind.parity() as usize, 0);
    let what = format!("{kind:?} seed {seed}, after a power loss");
    assert_degraded_reads_match(&layout, &mut io, &healthy, &sets, row, &what);
}

#[test]
fn write_hole_is_closed_across_power_loss() {
    for seed in 101..=106 {
        power_loss_scenario(LayoutKind::Raid5 { stripe: 8 << 10 }, 4, seed);
        power_loss_scenario(LayoutKind::Raid6 { stripe: 8 << 10 }, 5, seed);
        power_loss_scenario(
            LayoutKind::Ec {
                k: 4,
                m: 2,
                stripe: 4 << 10,
            },
            6,
            seed,
        );
    }
}

/// A power loss tears the label write that records a second failed device, on one of the
/// two healthy devices of a raid6 / ec 2+2 pool (found by the model checker: raid6 and ec
/// seed 8000029). The torn label's device holds whole data; the pool must open from the
/// labels it still has (docs/format.md §1: the previous generation stays whole in the
/// other slot) and read back everything. Before the labels had two slots, the torn
/// device counted as missing too, and the open refused the pool: "every copy of some
/// data is on failed or missing devices".
#[test]
fn a_torn_label_write_on_a_healthy_device_leaves_a_degraded_pool_readable() {
    for kind in [
        LayoutKind::Raid6 { stripe: 16 << 10 },
        LayoutKind::Ec {
            k: 2,
            m: 2,
            stripe: 16 << 10,
        },
    ] {
        let r = rig(kind, 4, DEV_SIZE, 64 << 10);
        let mut io = core();
        let v = r.pool.create_volume("v", VOL_SIZE as u64).unwrap();
        let mut model = pattern(0x7041, VOL_SIZE);
        let mut h = v.open_handle();
        assert_eq!(write(&mut io, &mut h, 0, &model), 0);
        assert_eq!(flush(&mut io, &mut h), 0);
        drop(h);
        // Device 0 fails (generation 1 on devices 1-3), then device 3 (generation 2 on
        // devices 1 and 2): each recorded before the FLUSH after it is answered.
        fail_by_write(&r, &mut io, &v, &mut model, 0);
        fail_by_write(&r, &mut io, &v, &mut model, 3);
        // A device's newest whole label and where it lies (written before the labels
        // had two slots, this test reads whatever slots there are).
        let newest = |d: usize| {
            [0u64, 4096]
                .into_iter()
                .filter_map(|at| {
                    let mut b = vec![0u8; 4096];
                    r.ram[d].read_at(at, &mut b).unwrap();
                    let l = tessera_pool::format::Label::decode(&b).ok().flatten()?;
                    Some((l, at))
                })
                .max_by_key(|(l, _)| l.state_gen)
                .unwrap()
        };
        let (l2, _) = newest(2);
        assert_eq!(l2.failed, 0b1001, "{kind:?}: both failures recorded");
        // The power goes while device 1's label of that generation is written: its
        // last sector never reached the media (a device promises sector atomicity only).
        let (l1, slot) = newest(1);
        assert_eq!(l1.state_gen, l2.state_gen, "{kind:?}");
        r.ram[1].write_at(slot + 3584, &[0x5a; 512]).unwrap();
        drop(v);
        drop(r.pool);

        // Restart with what is left: devices 0 and 3 gone, device 1's label torn.
        let (devs, cfgs) = wrap(&r.ram);
        cfgs[0].vanish();
        cfgs[3].vanish();
        let pool = Pool::open(devs).unwrap_or_else(|e| panic!("{kind:?}: reopen: {e}"));
        let st = pool.status();
        assert_eq!(st.state, PoolState::Degraded, "{kind:?}");
        for d in [0, 3] {
            assert_eq!(
                st.device_states[d].state,
                DeviceHealth::Failed,
                "{kind:?} {d}"
            );
        }
        for d in [1, 2] {
            assert_eq!(
                st.device_states[d].state,
                DeviceHealth::Online,
                "{kind:?} {d}"
            );
        }
        let vol = pool.volume("v").unwrap();
        let mut h = vol.open_handle();
        verify_all(
            &mut io,
            &mut h,
            &model,
            &format!("{kind:?} after the torn label"),
        );
        drop(h);
        pool.shutdown().unwrap();
    }
}

/// A parity pool that served writes on a core gives its devices back when it is
/// dropped, although the core keeps its row engine for the rest of its life: a new pool
/// takes the same files at once. (The engine used to keep its device handles, and with
/// them the files' locks, until the core next opened a parity engine: after a pool
/// delete, a node refused the same devices to a new pool as "in use by" itself.)
#[test]
fn a_dropped_parity_pool_gives_its_devices_back() {
    use tessera_device::FileDevice;
    let dir = tessera_testkit::node::temp_dir("parity-release");
    let paths: Vec<_> = (0..4)
        .map(|i| dir.path().join(format!("d{i}.img")))
        .collect();
    let open = || -> std::io::Result<Vec<Arc<dyn BlockDevice>>> {
        paths
            .iter()
            .map(|p| FileDevice::open(p, Some(DEV_SIZE)).map(|d| d as Arc<dyn BlockDevice>))
            .collect()
    };
    let opts = || PoolOptions {
        layout: LayoutKind::Raid5 { stripe: 16 << 10 },
        unit_size: 1 << 20,
        force: true,
        ..PoolOptions::default()
    };
    let mut io = tessera_testkit::blockio::core();
    // O_DIRECT files: the buffers are aligned.
    let mut data = tessera_io::AlignedBuf::zeroed(64 << 10);
    data.as_mut_slice().copy_from_slice(&pattern(7, 64 << 10));
    let write = |io: &mut CoreIo, h: &mut dyn IoHandle| {
        let op = IoOp::Write {
            offset: 0,
            len: 64 << 10,
            buf: data.as_ptr(),
        };
        tessera_testkit::blockio::run(io, h, op)
    };
    let pool = Pool::create("p", open().unwrap(), opts()).unwrap();
    let v = pool.create_volume("v", 4 << 20).unwrap();
    let mut h = v.open_handle();
    assert_eq!(write(&mut io, &mut h), 0);
    drop(h);
    drop(v);
    drop(pool);
    // `io`, the core, lives on with its engine.
    let again = open().expect("the devices are free once the pool is gone");
    let pool = Pool::create("q", again, opts()).unwrap();
    // And the core serves the new pool through a parity engine of its own.
    let v = pool.create_volume("w", 4 << 20).unwrap();
    let mut h = v.open_handle();
    assert_eq!(write(&mut io, &mut h), 0);
    let mut back = tessera_io::AlignedBuf::zeroed(64 << 10);
    let op = IoOp::Read {
        offset: 0,
        len: 64 << 10,
        buf: back.as_mut_ptr(),
    };
    assert_eq!(tessera_testkit::blockio::run(&mut io, &mut h, op), 0);
    assert!(back.as_slice() == data.as_slice());
}
