//! Requests in flight against snapshots and releases of units (issue 20, findings 3 and
//! 4), and what snapshot listings name as parents (finding 13).
//!
//! The stalls are deterministic: a gate device holds back the writes it is told to until
//! the test releases them, and the test waits on conditions (a thread finished, or is
//! waiting for requests in flight), never on a time.

// Test code builds data patterns and sizes from its own constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use tessera_device::{BlockDevice, RamDevice};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};
use tessera_pool::{Pool, PoolOptions, Volume};

const UNIT: u64 = 1 << 20;

/// A write held back by a [`GateDevice`], with the tag it completes.
struct Held(IoOp, Tag);

// SAFETY: the op's buffer pointer is only used on the core that submitted it (`release`
// is called there); the gate's mutex just carries it between calls on that thread.
unsafe impl Send for Held {}

/// A RAM device that holds back its next `hold` datapath writes (they are neither
/// performed nor completed) until the test releases them: a stall that ends when the
/// test says so, not after a time.
struct GateDevice {
    inner: Arc<RamDevice>,
    hold: AtomicU32,
    held: Mutex<Vec<Held>>,
}

impl GateDevice {
    fn new(size: u64) -> Arc<GateDevice> {
        Arc::new(GateDevice {
            inner: RamDevice::new(size).unwrap(),
            hold: AtomicU32::new(0),
            held: Mutex::default(),
        })
    }

    fn hold_next(&self, writes: u32) {
        self.hold.store(writes, SeqCst);
    }

    fn held(&self) -> usize {
        self.held.lock().unwrap().len()
    }

    /// Perform the held writes now, on `io` (the core that submitted them).
    fn release(&self, io: &mut CoreIo) {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        let mut h = self.inner.clone().open_handle();
        for Held(op, tag) in held {
            // SAFETY: the submitter keeps the buffer alive until `tag` completes.
            unsafe { h.submit(io, op, tag) };
        }
    }
}

impl BlockDevice for GateDevice {
    fn describe(&self) -> String {
        "gate:ram".into()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_volatile(&self) -> bool {
        true
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        self.inner.write_at(offset, buf)
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.write_zeroes_at(offset, len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.inner.sync()
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        let inner = self.inner.clone().open_handle();
        Box::new(GateHandle { dev: self, inner })
    }
}

struct GateHandle {
    dev: Arc<GateDevice>,
    inner: Box<dyn IoHandle>,
}

impl IoHandle for GateHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        if matches!(op, IoOp::Write { .. })
            && self
                .dev
                .hold
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return self.dev.held.lock().unwrap().push(Held(op, tag));
        }
        // SAFETY: forwarded to the caller.
        unsafe { self.inner.submit(io, op, tag) }
    }
    fn size(&self) -> u64 {
        self.dev.size()
    }
}

/// Wait (bounded) until `cond` holds.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn gate_pool(size: u64) -> (Arc<GateDevice>, Arc<Pool>) {
    let gate = GateDevice::new(size);
    let dev: Arc<dyn BlockDevice> = gate.clone();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    (gate, Arc::new(pool))
}

/// Submit a write of `data` at `offset` with `tag` (completion collected by the caller's
/// `run_until_idle`).
fn submit_write(io: &mut CoreIo, h: &mut dyn IoHandle, offset: u64, data: &[u8], tag: Tag) {
    // SAFETY: every caller keeps `data` alive until the write has completed.
    unsafe {
        h.submit(
            io,
            IoOp::Write {
                offset,
                len: data.len() as u32,
                buf: data.as_ptr(),
            },
            tag,
        )
    };
}

/// Finding 3: a write in flight when a snapshot is taken, and a 512-byte first write
/// into the same 4 KiB block after it. Unfixed, the snapshot took the map at once, the
/// second write copied the block from the snapshot's unit before the first one landed
/// there, and the volume lost the first write (it was only in the snapshot). Now the
/// snapshot waits for the first write, and the second waits for the snapshot.
#[test]
fn snapshot_waits_for_writes_in_flight() {
    let (gate, pool) = gate_pool(64 << 20);
    let vol = pool.create_volume("v", 4 * UNIT).unwrap();
    let mut io = core();
    let mut h = vol.open_handle();
    let old = pattern(1, UNIT as usize);
    assert_eq!(write(&mut io, &mut h, 0, &old), 0);

    // W1: 512 bytes at 0, held at the device.
    gate.hold_next(1);
    let w1 = vec![0xA1u8; 512];
    let mut done = BTreeMap::new();
    submit_write(&mut io, &mut h, 0, &w1, Tag::task(0, 1));
    io.run_until_idle(|_, t, r| assert!(done.insert(t, r).is_none()));
    assert_eq!((gate.held(), done.len()), (1, 0), "W1 is in flight");

    let snap = std::thread::spawn({
        let (pool, vol) = (pool.clone(), vol.clone());
        move || pool.create_snapshot(&vol, "s").map(|_| ())
    });
    wait_until("the snapshot to be taken, or to wait for W1", || {
        snap.is_finished() || pool.core.io_drains_waiting() > 0
    });

    // W2: 512 bytes at 512, in W1's block, after the snapshot began. Only then does W1
    // reach the device.
    let w2 = vec![0xA2u8; 512];
    submit_write(&mut io, &mut h, 512, &w2, Tag::task(0, 2));
    gate.release(&mut io);
    io.run_until_idle(|_, t, r| assert!(done.insert(t, r).is_none()));
    assert_eq!(done.len(), 2, "{done:?}");
    assert!(done.values().all(|&r| r >= 0), "{done:?}");
    snap.join().unwrap().unwrap();

    let mut want = old[..4096].to_vec();
    want[..512].copy_from_slice(&w1);
    want[512..1024].copy_from_slice(&w2);
    let got = read(&mut io, &mut h, 0, 4096).unwrap();
    assert!(got[..512] == w1[..], "the volume lost W1 (acknowledged)");
    assert_eq!(got, want, "the volume");
    // W1 began before the snapshot: it is in it; W2 is not.
    let s = pool.volume("s").unwrap();
    let mut hs = s.open_handle();
    let mut in_snap = old[..4096].to_vec();
    in_snap[..512].copy_from_slice(&w1);
    assert_eq!(
        read(&mut io, &mut hs, 0, 4096).unwrap(),
        in_snap,
        "the snapshot"
    );
    assert_eq!(pool.verify_chains(), Vec::<String>::new());
}

/// Finding 4: a unit trimmed while a write to it is in flight. Unfixed, the commit after
/// the trim gave the unit back at once, the next volume's allocation took it, and the
/// stalled write then landed in that volume's data. Now the release waits for the write.
#[test]
fn trim_does_not_reuse_a_unit_with_a_write_in_flight() {
    let (gate, pool) = gate_pool(32 << 20);
    let a = pool.create_volume("a", UNIT).unwrap();
    let b = pool.create_volume("b", UNIT).unwrap();
    let mut io = core();
    let mut ha = a.open_handle();
    assert_eq!(write(&mut io, &mut ha, 0, &pattern(1, UNIT as usize)), 0);
    pool.commit().unwrap();

    // W1: 4 KiB into a's unit, held at the device; then the unit is trimmed.
    gate.hold_next(1);
    let w1 = vec![0xA1u8; 4096];
    let mut done = BTreeMap::new();
    submit_write(&mut io, &mut ha, 0, &w1, Tag::task(0, 1));
    io.run_until_idle(|_, t, r| assert!(done.insert(t, r).is_none()));
    assert_eq!((gate.held(), done.len()), (1, 0), "W1 is in flight");
    assert_eq!(
        run(
            &mut io,
            &mut ha,
            IoOp::Discard {
                offset: 0,
                len: UNIT
            }
        ),
        0
    );
    assert_eq!(a.allocated_bytes(), 0);

    // The commit that releases the unit, from another thread (with the fix it waits).
    let commit = std::thread::spawn({
        let pool = pool.clone();
        move || pool.commit()
    });
    wait_until("the commit to finish, or to wait for W1", || {
        commit.is_finished() || pool.core.io_drains_waiting() > 0
    });

    // b writes a whole unit: the allocator's first pick is the unit released last.
    let mut hb = b.open_handle();
    let bdata = pattern(2, UNIT as usize);
    assert_eq!(write(&mut io, &mut hb, 0, &bdata), 0);
    gate.release(&mut io);
    io.run_until_idle(|_, t, r| assert!(done.insert(t, r).is_none()));
    assert_eq!(done.len(), 1);
    commit.join().unwrap().unwrap();
    let got = read(&mut io, &mut hb, 0, UNIT as usize).unwrap();
    assert!(
        got[..4096] != w1[..],
        "volume b reads volume a's stalled write"
    );
    assert!(got == bdata, "volume b's data changed");

    // Released now: the unit goes to the next volume, zeroed.
    let c = pool.create_volume("c", UNIT).unwrap();
    let mut hc = c.open_handle();
    assert_eq!(write(&mut io, &mut hc, 4096, &[7u8; 512]), 0);
    let got = read(&mut io, &mut hc, 0, 8192).unwrap();
    assert!(
        got[..4096].iter().all(|&x| x == 0),
        "a reused unit is zeroed"
    );
    let st = pool.status();
    assert_eq!(st.allocated, 2 * UNIT);
}

fn listed_parent(pool: &Pool, name: &str) -> Option<String> {
    let v = pool
        .volume(name)
        .unwrap_or_else(|| panic!("{name} missing"));
    v.listed_parent().map(|p| p.name.clone())
}

/// Every parent a listing names exists, and following them ends (no cycle).
fn check_listing(pool: &Pool) {
    let snaps = pool.snapshots();
    let names: Vec<String> = pool.volumes().iter().map(|v| v.name.clone()).collect();
    for v in pool.volumes() {
        let mut seen = vec![v.name.clone()];
        let mut at = listed_parent(pool, &v.name);
        while let Some(p) = at {
            assert!(
                names.contains(&p),
                "'{}' lists '{p}', which is gone",
                v.name
            );
            assert!(
                snaps.iter().any(|s| s.name == p),
                "'{p}' is not a listed snapshot"
            );
            assert!(!seen.contains(&p), "the listing loops: {seen:?} -> {p}");
            seen.push(p.clone());
            at = listed_parent(pool, &p);
        }
    }
    for s in &snaps {
        for c in &s.children {
            assert_eq!(listed_parent(pool, c).as_deref(), Some(s.name.as_str()));
        }
    }
}

fn data_of(pool: &Pool, name: &str, io: &mut CoreIo) -> Vec<u8> {
    let v: Arc<Volume> = pool.volume(name).unwrap();
    let mut h = v.open_handle();
    read(io, &mut h, 0, 8192).unwrap()
}

/// Finding 13, first sequence: snapshots in the middle of chains deleted while
/// snapshots, clones and volumes still read through them.
#[test]
fn listings_skip_deleted_snapshots() {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let mut io = core();
    let v = pool.create_volume("v", 4 * UNIT).unwrap();
    let mut hv = v.open_handle();
    assert_eq!(write(&mut io, &mut hv, 0, &[1u8; 8192]), 0);
    let s1 = pool.create_snapshot(&v, "s1").unwrap();
    assert_eq!(write(&mut io, &mut hv, 0, &[2u8; 4096]), 0);
    let s2 = pool.create_snapshot(&v, "s2").unwrap();
    let va = pool.clone_snapshot(&s1, "va", false).unwrap();
    let c = pool.clone_snapshot(&s2, "c", false).unwrap();
    let mut hc = c.open_handle();
    assert_eq!(write(&mut io, &mut hc, 4096, &[3u8; 4096]), 0);
    let cs1 = pool.create_snapshot(&c, "cs1").unwrap();
    let cs2 = pool.create_snapshot(&c, "cs2").unwrap();
    drop((hv, hc));
    assert_eq!(listed_parent(&pool, "cs2").as_deref(), Some("cs1"));
    assert_eq!(listed_parent(&pool, "cs1").as_deref(), Some("s2"));
    assert_eq!(listed_parent(&pool, "va").as_deref(), Some("s1"));
    let before: Vec<Vec<u8>> = ["v", "s2", "va", "c", "cs2"]
        .iter()
        .map(|n| data_of(&pool, n, &mut io))
        .collect();

    pool.delete_volume(&cs1).unwrap();
    pool.delete_volume(&s1).unwrap();
    drop((s1, cs1));
    assert_eq!(listed_parent(&pool, "cs2").as_deref(), Some("s2"));
    assert_eq!(listed_parent(&pool, "c").as_deref(), Some("cs2"));
    assert_eq!(listed_parent(&pool, "s2"), None);
    assert_eq!(listed_parent(&pool, "va"), None);
    assert_eq!(listed_parent(&pool, "v").as_deref(), Some("s2"));
    let snaps = pool.snapshots();
    let s2_info = snaps.iter().find(|s| s.name == "s2").unwrap();
    assert_eq!(s2_info.parent, None);
    let mut kids = s2_info.children.clone();
    kids.sort();
    assert_eq!(kids, ["cs2", "v"]);
    check_listing(&pool);
    let after: Vec<Vec<u8>> = ["v", "s2", "va", "c", "cs2"]
        .iter()
        .map(|n| data_of(&pool, n, &mut io))
        .collect();
    assert!(before == after, "the data changed");
    drop((s2, va, cs2));
}

/// Finding 13, second sequence: a snapshot deleted while a newer one reads through it,
/// and a new snapshot taken under its name: no cycle in the listing.
#[test]
fn a_reused_snapshot_name_makes_no_cycle() {
    let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).unwrap();
    let mut io = core();
    let v = pool.create_volume("v", 4 * UNIT).unwrap();
    let mut hv = v.open_handle();
    assert_eq!(write(&mut io, &mut hv, 0, &[1u8; 4096]), 0);
    let a1 = pool.create_snapshot(&v, "a1").unwrap();
    assert_eq!(write(&mut io, &mut hv, 4096, &[2u8; 4096]), 0);
    pool.create_snapshot(&v, "a2").unwrap();
    pool.delete_volume(&a1).unwrap();
    drop(a1);
    pool.create_snapshot(&v, "a1").unwrap();
    drop(hv);
    assert_eq!(listed_parent(&pool, "a2"), None);
    assert_eq!(listed_parent(&pool, "a1").as_deref(), Some("a2"));
    assert_eq!(listed_parent(&pool, "v").as_deref(), Some("a1"));
    let snaps = pool.snapshots();
    let a2 = snaps.iter().find(|s| s.name == "a2").unwrap();
    assert_eq!(
        (a2.parent.as_deref(), a2.children.clone()),
        (None, vec!["a1".to_string()])
    );
    check_listing(&pool);
    let mut want = vec![1u8; 4096];
    want.extend([2u8; 4096]);
    assert_eq!(data_of(&pool, "v", &mut io), want);
    assert_eq!(data_of(&pool, "a1", &mut io), want);
}
