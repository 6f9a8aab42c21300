//! A node restarted the moment it was killed (as a supervisor restarts it) comes back
//! with its pools, and a pool that cannot be opened does not keep the node from serving
//! the others.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde_json::Value;

const MIB: u64 = 1 << 20;
const WRITERS: u64 = 4;
/// Writes of this size keep many device I/Os in flight when the node is killed.
const WRITE: usize = 256 << 10;
const RESTARTS: usize = 10;

/// The entry of pool `name` in `pool list`.
fn pool_entry(n: &TestNode, name: &str) -> Value {
    let pools = n.json(&["pool", "list"]);
    pools
        .as_array()
        .expect("pool list is a list")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("pool {name} not listed: {pools}"))
        .clone()
}

fn volume_names(n: &TestNode) -> Vec<String> {
    let vols = n.json(&["volume", "list"]);
    vols.as_array()
        .expect("volume list is a list")
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect()
}

/// Write to vol0 from `WRITERS` connections until the node goes away; `done` counts the
/// acknowledged writes.
fn start_writers(n: &TestNode, done: &Arc<AtomicU64>) -> Vec<std::thread::JoinHandle<()>> {
    (0..WRITERS)
        .map(|t| {
            let mut c = nbd_connect(n, "vol0");
            let done = done.clone();
            std::thread::spawn(move || {
                let data = pattern(t + 1, WRITE);
                let mut rng = Rng(t * 7919 + 1);
                let region = 64 * MIB;
                loop {
                    let off = t * region + rng.below(region / WRITE as u64) * WRITE as u64;
                    if c.write(off, &data, false).is_err() {
                        return;
                    }
                    done.fetch_add(1, Relaxed);
                }
            })
        })
        .collect()
}

#[test]
fn restart_right_after_kill9_under_write_load_opens_the_pool() {
    let mut n = TestNode::start_default("restart-now");
    for i in 0..RESTARTS {
        let done = Arc::new(AtomicU64::new(0));
        let writers = start_writers(&n, &done);
        wait_for("writes under way", 60, || done.load(Relaxed) >= 64);
        n.kill9();
        // No pause: the dead node's io_uring may still hold its device file.
        n.restart();
        for w in writers {
            w.join().expect("writer thread panicked");
        }
        let p = pool_entry(&n, "pool0");
        assert_ne!(
            p["state"],
            "offline",
            "restart {i}: pool0 did not open: {p}\nnode log:\n{}",
            n.log_text()
        );
        assert!(
            volume_names(&n).contains(&"vol0".to_string()),
            "restart {i}: vol0 missing\nnode log:\n{}",
            n.log_text()
        );
    }
}

#[test]
fn a_pool_that_cannot_open_leaves_the_others_served() {
    let scratch = temp_dir("one-bad-pool-devs");
    let good = scratch.path().join("good.img");
    let bad = scratch.path().join("bad.img");
    let extra = format!(
        r#"
[nvmf]
enabled = false

[[pool]]
name = "good"
devices = ["{}:64M"]

[[pool]]
name = "bad"
devices = ["{}:64M"]

[[volume]]
name = "gv"
pool = "good"
size = "32M"

[[volume]]
name = "bv"
pool = "bad"
size = "32M"

[[export]]
name = "gv"
volume = "gv"

[[export]]
name = "bv"
volume = "bv"
"#,
        good.display(),
        bad.display()
    );
    let mut n = TestNode::start_with_config("one-bad-pool", &extra);
    let mut model = vec![0u8; 32 << 20];
    write_at(&n, "gv", &mut model, 3 * MIB, &pattern(42, MIB as usize));
    n.stop();

    // The bad pool's device loses its label (both slots, docs/format.md §1): that pool
    // can no longer be opened.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&bad).unwrap();
        f.write_all_at(&[0u8; 8192], 0).unwrap();
        f.sync_all().unwrap();
    }
    n.restart();
    let p = pool_entry(&n, "bad");
    assert_eq!(p["state"], "offline", "{p}");
    assert!(
        p["error"].as_str().is_some_and(|e| !e.is_empty()),
        "an offline pool says why: {p}"
    );
    assert_ne!(pool_entry(&n, "good")["state"], "offline");
    let vols = volume_names(&n);
    assert!(vols.contains(&"gv".to_string()), "{vols:?}");
    assert!(!vols.contains(&"bv".to_string()), "{vols:?}");
    assert!(
        read_all(&n, "gv") == model,
        "the good pool's volume lost data"
    );
    let mut model2 = model.clone();
    write_at(&n, "gv", &mut model2, 0, &pattern(43, MIB as usize));
    assert!(read_all(&n, "gv") == model2);
    let log = n.log_text();
    assert!(
        log.contains("volume from the config skipped") && log.contains("bv"),
        "the skipped volume is logged:\n{log}"
    );
}
