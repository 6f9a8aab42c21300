//! Scrub that verifies and repairs mirror copies: one copy's file is changed behind the
//! node's back (while it is stopped), and the scrub finds the difference and makes the
//! copies equal again. (Moved from `crates/tessera-cli/tests/scrub_resync.rs`, which keeps
//! the resync after a kill -9: that needs a node process to kill.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

mod common;
use common::*;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

const MIB: u64 = 1 << 20;
/// Device offset of the pool's data area (docs/format.md §1).
const DEV_DATA_START: u64 = MIB;

/// A raid1 pool `m` of two 64 MiB files with a 32 MiB volume `v` (exported), every MiB of
/// it written by a client.
fn mirrored_pool(n: &TestNode) -> (String, String) {
    let d = path_str(&n.dir);
    let (a, b) = (format!("{d}/a.img"), format!("{d}/b.img"));
    n.create_pool("m", "raid1", &[format!("{a}:64M"), format!("{b}:64M")]);
    n.exported_volume("v", "m", 32 * MIB);
    let mut c = n.nbd("v");
    for i in 0..32 {
        c.write(i * MIB, &pattern(i, MIB as usize), false).unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    (a, b)
}

/// `tessera --json pool scrub POOL [--no-repair] --wait`: start a scrub, and its status
/// once it has ended.
fn scrub_wait(n: &TestNode, pool: &str, repair: bool) -> Value {
    let node = n.node();
    let p = node.pools().get(pool).expect("pool");
    node.jobs()
        .start_scrub(&p, repair)
        .expect("start the scrub");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = json(node.jobs().scrub_status(&p).expect("scrub status"));
        if v["state"] != "running" {
            return v;
        }
        assert!(Instant::now() < deadline, "scrub did not finish: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Flip 4 KiB of `file` at every MiB of its data area (metadata and data units alike);
/// returns where, and what it wrote there.
fn corrupt_every_mib(file: &str) -> Vec<(u64, Vec<u8>)> {
    let mut spots = Vec::new();
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    for k in 0..60u64 {
        let at = DEV_DATA_START + k * MIB + 8192;
        let mut b = vec![0u8; 4096];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        for x in &mut b {
            *x ^= 0x5A;
        }
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&b).unwrap();
        spots.push((at, b));
    }
    f.sync_all().unwrap();
    spots
}

/// A repair went the right way: where the status `v` reports a repaired mismatch, no
/// copy holds the bytes the corruption wrote (a repair from the corrupted copy to the good
/// one would leave them in both, equal). Corrupted spots outside any report are in units
/// no volume owns, which the scrub does not read.
fn corruption_gone(v: &Value, spots: &[(u64, Vec<u8>)], files: &[&str]) {
    let ranges: Vec<(u64, u64)> = v["mismatched_ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let o = DEV_DATA_START + r["offset"].as_u64().unwrap();
            (o, o + r["len"].as_u64().unwrap())
        })
        .collect();
    let repaired: Vec<&(u64, Vec<u8>)> = spots
        .iter()
        .filter(|(at, _)| ranges.iter().any(|&(a, b)| a <= *at && *at < b))
        .collect();
    assert!(!repaired.is_empty(), "no corrupted spot was reported: {v}");
    for file in files {
        for (at, bad) in &repaired {
            assert!(
                read_file(file, *at, bad.len() as u64) != *bad,
                "{file} holds the corrupted bytes at {at}: repaired from the wrong copy"
            );
        }
    }
}

/// The volume's whole content, as a client reads it.
fn volume_bytes(n: &TestNode) -> Vec<u8> {
    let mut c = n.nbd("v");
    let mut out = vec![0u8; 32 * MIB as usize];
    for (i, chunk) in out.chunks_mut(MIB as usize).enumerate() {
        c.read(i as u64 * MIB, chunk).unwrap();
    }
    c.disconnect().unwrap();
    out
}

fn read_file(file: &str, at: u64, len: u64) -> Vec<u8> {
    let mut f = std::fs::File::open(Path::new(file)).unwrap();
    let mut b = vec![0u8; len as usize];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut b).unwrap();
    b
}

/// Every mismatched range a status reports is equal in both files now.
fn ranges_equal(v: &Value, a: &str, b: &str) {
    let ranges = v["mismatched_ranges"].as_array().unwrap();
    assert!(!ranges.is_empty(), "{v}");
    for r in ranges {
        let (o, l) = (r["offset"].as_u64().unwrap(), r["len"].as_u64().unwrap());
        assert_eq!(
            read_file(a, DEV_DATA_START + o, l),
            read_file(b, DEV_DATA_START + o, l),
            "range {r} still differs"
        );
    }
}

#[test]
fn scrub_finds_and_repairs_a_copy_changed_on_disk() {
    let mut n = TestNode::with_nbd("scrub-repair", 2);
    let (a, b) = mirrored_pool(&n);
    let written = volume_bytes(&n);
    n.stop();
    let spots = corrupt_every_mib(&b);
    n.restart();
    // A clean shutdown: no resync.
    let p = n.pool_json("m");
    assert!(p.get("resync").is_none(), "{p}");

    // Report only.
    let v = scrub_wait(&n, "m", false);
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["repair"], false, "{v}");
    let found = v["mismatched_bytes"].as_u64().unwrap();
    assert!(found >= 4096 && found.is_multiple_of(4096), "{v}");
    assert_eq!(v["repaired_bytes"], 0, "{v}");
    assert_eq!(v["unreadable_bytes"], 0, "{v}");

    // Repair (the default): the same bytes, now rewritten. (The CLI's line for these
    // figures, "N bytes mismatched, N repaired", is checked by the resync test in
    // crates/tessera-cli/tests/scrub_resync.rs: the same line shows a resync.)
    let v = scrub_wait(&n, "m", true);
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["mismatched_bytes"].as_u64().unwrap(), found, "{v}");
    assert_eq!(v["repaired_bytes"].as_u64().unwrap(), found, "{v}");
    let p = n.node().pools().get("m").unwrap();
    let status = json(n.node().jobs().scrub_status(&p).unwrap());
    drop(p);
    assert_eq!(status["mismatched_bytes"].as_u64(), Some(found), "{status}");
    assert_eq!(status["repaired_bytes"].as_u64(), Some(found), "{status}");
    // Copies are on disk equal where they differed (after a sync: stop the node), and hold
    // the good copy's bytes, not the corruption.
    n.stop();
    ranges_equal(&v, &a, &b);
    corruption_gone(&v, &spots, &[&a, &b]);
    n.restart();
    assert!(
        volume_bytes(&n) == written,
        "the volume does not read what was written"
    );
    let v = scrub_wait(&n, "m", true);
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    assert_eq!(v["repaired_bytes"], 0, "{v}");
    // The pool stayed healthy throughout.
    let p = n.pool_json("m");
    assert_eq!(p["state"], "online", "{p}");
}
