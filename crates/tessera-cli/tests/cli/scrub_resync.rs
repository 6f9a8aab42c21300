//! The resync a node starts by itself for a mirrored pool that was not shut down cleanly
//! (kill -9 of the node process): one copy's file is changed behind the node's back, and
//! the resync finds the difference and makes the copies equal again. The scrub's repair of
//! the same damage after a clean stop is tested in process, in
//! `crates/tessera-node/tests/node/scrub_mirror_repair.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;
use tessera_testkit::mirror::{corrupt_every_mib, corruption_gone, ranges_equal};

use std::time::{Duration, Instant};

use serde_json::Value;

const MIB: u64 = 1 << 20;

fn json(n: &TestNode, args: &[&str]) -> Value {
    let out = n.cli_ok(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("invalid JSON ({e}): {out}"))
}

/// A raid1 pool `m` of two 64 MiB files with a 32 MiB volume `v` (exported) filled by
/// 1 MiB random writes.
fn mirrored_pool(n: &TestNode) -> (String, String) {
    let d = path_str(&n.dir);
    let (a, b) = (format!("{d}/a.img"), format!("{d}/b.img"));
    n.cli_ok(&[
        "pool",
        "create",
        "m",
        "--layout",
        "raid1",
        &format!("{a}:64M"),
        &format!("{b}:64M"),
    ]);
    n.cli_ok(&["volume", "create", "v", "--pool", "m", "--size", "32M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    nbd_perf(
        &n.uri("v"),
        "randwrite",
        8,
        2,
        &["--bs", "1M", "--size", "32M"],
    );
    (a, b)
}

/// The volume's whole content, as a client reads it.
fn volume_bytes(n: &TestNode) -> Vec<u8> {
    let mut c = nbd_connect(n, "v");
    let mut out = vec![0u8; 32 * MIB as usize];
    for (i, chunk) in out.chunks_mut(MIB as usize).enumerate() {
        c.read(i as u64 * MIB, chunk).unwrap();
    }
    out
}

#[test]
fn unclean_shutdown_of_a_mirror_starts_a_resync_that_completes() {
    let mut n = TestNode::start_with_config("resync", "");
    let (a, b) = mirrored_pool(&n);
    // Flushed: what the kill may take is the mirror's consistency, not the data.
    nbd_connect(&n, "v").flush().unwrap();
    let written = volume_bytes(&n);
    n.kill9();
    let spots = corrupt_every_mib(&b);
    n.restart();
    let deadline = Instant::now() + Duration::from_secs(120);
    let v = loop {
        let p = json(&n, &["--json", "pool", "status", "m"]);
        let r = &p["resync"];
        assert!(r.is_object(), "no resync after kill -9: {p}");
        if r["state"] != "running" {
            break r.clone();
        }
        assert!(Instant::now() < deadline, "resync did not finish: {p}");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["background"]["class"], "resync", "{v}");
    assert_eq!(v["units_done"], v["units_total"], "{v}");
    let found = v["mismatched_bytes"].as_u64().unwrap();
    assert!(found >= 4096, "{v}");
    assert_eq!(v["repaired_bytes"].as_u64().unwrap(), found, "{v}");
    assert!(n.log_text().contains("not shut down cleanly"));
    let text = n.cli_ok(&["pool", "status", "m"]);
    assert!(text.contains("resync m done"), "{text}");
    // The figures' line, the one `pool scrub --status` prints for a scrub too.
    assert!(
        text.contains(&format!("{found} bytes mismatched, {found} repaired")),
        "{text}"
    );
    // A clean stop after that: the next start does not resync, and the copies agree.
    n.stop();
    ranges_equal(&v, &a, &b);
    corruption_gone(&v, &spots, &[&a, &b]);
    n.restart();
    assert!(
        volume_bytes(&n) == written,
        "the volume does not read what was written"
    );
    let p = json(&n, &["--json", "pool", "status", "m"]);
    assert!(p.get("resync").is_none(), "{p}");
    let v = json(
        &n,
        &["--json", "pool", "scrub", "m", "--no-repair", "--wait"],
    );
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
}
