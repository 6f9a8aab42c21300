//! Rebuild of a raid1 pool through the CLI and API, on file devices: a device lost and
//! replaced by a blank file is rebuilt (client writes go on meanwhile), the node is
//! killed with SIGKILL mid-rebuild and resumes from the persisted cursor, and once done
//! the OTHER device can go: every byte reads back from the rebuilt one. A lost device
//! replaced live (`pool replace`) is tested in process, in
//! `crates/tessera-node/tests/node/raid_rebuild.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::NbdClient;

const VOL: u64 = 32 << 20;
const BLOCK: usize = 64 << 10;

fn connect(n: &TestNode) -> NbdClient {
    nbd_connect(n, "v")
}

fn pool(n: &TestNode) -> Value {
    let out = n.cli_ok(&["pool", "list", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "m")
        .cloned()
        .expect("pool m")
}

fn rebuild_json(n: &TestNode) -> Value {
    serde_json::from_str(&n.cli_ok(&["--json", "pool", "rebuild", "m", "--status"])).unwrap()
}

/// Write blocks `which` with generation `gen` into the model, then flush.
fn write_blocks(
    c: &mut NbdClient,
    model: &mut [u64],
    which: impl Iterator<Item = usize>,
    gen: u64,
) {
    write_generations(c, model, which, gen, BLOCK);
}

fn verify(n: &TestNode, model: &[u64]) {
    verify_generations(n, "v", model, BLOCK);
}

#[test]
fn raid1_rebuild_resumes_after_kill9_and_serves_alone() {
    let mut n = TestNode::start_with_config("raid-rebuild", "");
    let d = path_str(&n.dir);
    let (a, b) = (format!("{d}/a.img:64M"), format!("{d}/b.img:64M"));
    n.cli_ok(&["pool", "create", "m", "--layout", "raid1", &a, &b]);
    n.cli_ok(&["volume", "create", "v", "--pool", "m", "--size", "32M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    let blocks = (VOL as usize) / BLOCK;
    let mut model = vec![0u64; blocks];
    write_blocks(&mut connect(&n), &mut model, 0..blocks, 1);

    // Device a is lost (the pool comes up without it), then a blank file takes its place.
    n.stop();
    std::fs::remove_file(n.dir.join("a.img")).unwrap();
    n.restart();
    let p = pool(&n);
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][0]["state"], "failed", "{p}");
    write_blocks(&mut connect(&n), &mut model, (0..blocks).step_by(7), 2);
    n.stop();
    std::fs::File::create(n.dir.join("a.img"))
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    n.restart();
    assert_eq!(pool(&n)["device_states"][0]["state"], "failed");

    // A slow rebuild (8 MiB/s for ~33 MiB), with client writes while it runs.
    n.cli_ok(&["background", "set", "rebuild", "--bw", "8M"]);
    let v: Value = serde_json::from_str(&n.cli_ok(&["--json", "pool", "rebuild", "m"])).unwrap();
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(v["device"], 0, "{v}");
    assert_eq!(pool(&n)["state"], "rebuilding");
    // Client writes until the rebuild is past its first persisted cursor (every 16
    // units; a fixed 2.5 s was not always enough on a loaded machine), well before its
    // end (39 units).
    let mut c = connect(&n);
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut gen = 3;
    let before = loop {
        write_blocks(
            &mut c,
            &mut model,
            (gen as usize % 5..blocks).step_by(13),
            gen,
        );
        gen += 1;
        let v = rebuild_json(&n);
        assert_eq!(v["state"], "running", "rebuild ended before the kill: {v}");
        if v["units_done"].as_u64().unwrap() >= 20 {
            break v;
        }
        assert!(Instant::now() < deadline, "rebuild made no progress: {v}");
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(c);
    let done_before = before["units_done"].as_u64().unwrap();
    n.kill9();
    n.restart();

    // It resumes from its cursor, not from 0 (the resumed job may be reported a moment
    // after the node says it is ready: wait for it, bounded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let v = loop {
        let v = rebuild_json(&n);
        if v["resumed_at_unit_count"].is_u64() || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let resumed = v["resumed_at_unit_count"].as_u64().unwrap();
    assert!(resumed > 0, "did not resume: {v} (was {before})");
    assert!(resumed <= done_before, "{v} vs {before}");
    write_blocks(&mut connect(&n), &mut model, (1..blocks).step_by(11), 100);
    let out = n.cli_ok(&["pool", "rebuild", "m", "--status", "--wait"]);
    assert!(out.contains("done") && out.contains("100.0%"), "{out}");
    let p = pool(&n);
    assert_eq!(p["state"], "online", "{p}");
    assert_eq!(p["rebuild"]["state"], Value::Null, "{p}"); // not in the list form
    verify(&n, &model);

    // Now the OTHER device goes: the rebuilt one serves every byte, also after restart.
    n.stop();
    std::fs::remove_file(n.dir.join("b.img")).unwrap();
    n.restart();
    let p = pool(&n);
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][0]["state"], "online", "{p}");
    assert_eq!(p["device_states"][1]["state"], "failed", "{p}");
    verify(&n, &model);
}
