//! Live device replacement, on file devices, as a user sees it: a device of a raid1
//! pool vanishes while clients write; the pool table shows the pool degraded and the
//! device FAILED, and `pool replace` says the rebuild runs. Every wait is bounded by a
//! deadline; the node listens on 127.0.0.1 only. The hot-spare takeovers (raid1 and
//! raid5) and the rest of a live replacement are tested in process, in
//! `crates/tessera-node/tests/node/hot_spare.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::NbdClient;

const VOL: u64 = 16 << 20;
const BLOCK: usize = 64 << 10;
/// The faulty device disappears this long after the node opened it.
const VANISH_MS: u64 = 4000;

fn connect(n: &TestNode) -> NbdClient {
    nbd_connect(n, "v")
}

fn write_blocks(
    c: &mut NbdClient,
    model: &mut [u64],
    which: impl Iterator<Item = usize>,
    gen: u64,
) {
    write_generations(c, model, which, gen, BLOCK);
}

/// `tessera --json pool status m`: the pool with its spares and rebuild.
fn status(n: &TestNode) -> Value {
    serde_json::from_str(&n.cli_ok(&["--json", "pool", "status", "m"])).unwrap()
}

/// A pool `m` (`layout`) of `ndev` 64 MiB files, device `bad` of which vanishes
/// `VANISH_MS` after the node opened it; volume and export `v`; the pattern written.
fn setup(tag: &str, layout: &str, ndev: usize, bad: usize) -> (TestNode, Vec<u64>) {
    let n = TestNode::start_with_config(tag, "");
    let d = path_str(&n.dir);
    let devs: Vec<String> = (0..ndev)
        .map(|i| {
            let f = format!("{d}/d{i}.img:64M");
            if i == bad {
                format!("fault:{f};vanish_after_ms={VANISH_MS}")
            } else {
                f
            }
        })
        .collect();
    let mut args = vec!["pool", "create", "m", "--layout", layout];
    args.extend(devs.iter().map(String::as_str));
    n.cli_ok(&args);
    n.cli_ok(&["volume", "create", "v", "--pool", "m", "--size", "16M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    // A slow enough rebuild that its progress is visible.
    n.cli_ok(&["background", "set", "rebuild", "--bw", "16M"]);
    let blocks = (VOL as usize) / BLOCK;
    let mut model = vec![0u64; blocks];
    write_blocks(&mut connect(&n), &mut model, 0..blocks, 1);
    (n, model)
}

/// Keep writing (so the pool notices the vanished device) until `done` holds; returns
/// the status that satisfied it.
fn write_until(
    n: &TestNode,
    model: &mut [u64],
    what: &str,
    limit: Duration,
    mut done: impl FnMut(&Value) -> bool,
) -> Value {
    let end = Instant::now() + limit;
    let mut c = connect(n);
    let mut gen = 2;
    loop {
        let v = status(n);
        if done(&v) {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {v}\nlog:\n{}",
            n.log_text()
        );
        let blocks = model.len();
        write_blocks(&mut c, model, (gen as usize % 7..blocks).step_by(17), gen);
        gen += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn dev_is(v: &Value, i: usize, name: &str) -> bool {
    v["devices"][i].as_str().is_some_and(|d| d.contains(name))
}

/// What a user sees of a failed device and types to replace it: the pool table shows
/// the pool degraded and the device FAILED, and `pool replace` says the rebuild runs,
/// which `pool status` shows. (The replacement's refusals, the rebuild to its end, and
/// the new device serving alone after a restart are tested in process, in
/// `crates/tessera-node/tests/node/hot_spare.rs`, `replace_is_live`.)
#[test]
fn replace_is_live() {
    let t0 = Instant::now();
    let (n, mut model) = setup("replace-live", "raid1", 2, 1);
    let d = path_str(&n.dir);
    write_until(
        &n,
        &mut model,
        "device 1 to fail",
        Duration::from_secs(30),
        |v| v["device_states"][1]["state"] == "failed",
    );
    // The pool table shows it: the pool degraded, the device FAILED. (The rest of what
    // a failed mirror device does is tested in process, in
    // crates/tessera-node/tests/node/raid_mirror.rs.)
    let table = n.cli_ok(&["pool", "list"]);
    assert!(
        table.contains("degraded") && table.contains("FAILED"),
        "{table}"
    );
    let out = n.cli_ok(&[
        "pool",
        "replace",
        "m",
        "--device",
        "1",
        &format!("{d}/c.img:64M"),
    ]);
    assert!(out.contains("rebuilding"), "{out}");
    let v = status(&n);
    assert!(dev_is(&v, 1, "c.img"), "{v}");
    assert_eq!(v["rebuild"]["device"], 1, "{v}");
    eprintln!("replace-live: {:.1} s", t0.elapsed().as_secs_f64());
}
