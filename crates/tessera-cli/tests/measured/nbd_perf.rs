use crate::common;
use common::*;

use std::collections::HashMap;
use std::process::{Command, Stdio};

/// Run `tessera nbd-perf` against the node and return the RESULT line's fields.
fn nbd_perf(n: &TestNode, pattern: &str) -> HashMap<String, f64> {
    let o = Command::new(BIN)
        .args(["nbd-perf", "--uri", &n.uri("vol0"), "--pattern", pattern])
        .args(["--qd", "16", "--time", "2", "--bs", "4K", "--size", "64M"])
        .stdin(Stdio::null())
        .output()
        .expect("run tessera nbd-perf");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "nbd-perf {pattern} failed: {stdout}{stderr}\nnode log:\n{}",
        n.log_text()
    );
    result_fields(&stdout, &stderr, &format!("nbd-perf {pattern}"))
}

/// Fields every RESULT line carries besides iops and errors.
const FIELDS: &[&str] = &[
    "mibps",
    "mean_us",
    "p50_us",
    "p99_us",
    "p999_us",
    "cpu_ns_per_io",
];

#[test]
fn nbd_perf_drives_a_node() {
    let _alone = crate::alone();
    let n = TestNode::start_default("nbd-perf");
    // Writes first, so that the reads then hit allocated data rather than holes.
    for pattern in ["randwrite", "randread"] {
        let r = nbd_perf(&n, pattern);
        assert_eq!(r["errors"], 0.0, "{pattern}: {r:?}");
        assert!(r["iops"] > 1000.0, "{pattern}: {r:?}");
        for &k in FIELDS {
            assert!(r.contains_key(k), "{pattern}: no {k} in {r:?}");
        }
    }
}
