//! Scrub that verifies and repairs mirror copies: one copy's file is changed behind the
//! node's back (while it is stopped), and the scrub finds the difference and makes the
//! copies equal again. (Moved from `crates/tessera-cli/tests/cli/scrub_resync.rs`, which keeps
//! the resync after a kill -9: that needs a node process to kill.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;
use tessera_testkit::mirror::{corrupt_every_mib, corruption_gone, ranges_equal};

const MIB: u64 = 1 << 20;

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
    // crates/tessera-cli/tests/cli/scrub_resync.rs: the same line shows a resync.)
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
