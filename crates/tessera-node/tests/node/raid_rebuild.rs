//! A lost raid1 device replaced live by another file (`pool replace`) on a node in this
//! process: a smaller device is refused, the rebuild onto the new one starts at once and
//! completes, and then the original device can go: the new one serves every byte.
//! (Moved from `crates/tessera-cli/tests/cli/raid_rebuild.rs`, which keeps the rebuild
//! killed with SIGKILL mid-way and resumed from its persisted cursor, and the text `pool
//! rebuild --status --wait` prints.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::NbdClient;

const VOL: u64 = 32 << 20;
const BLOCK: usize = 64 << 10;

/// `tessera pool list --json`'s entry of pool `m`.
fn pool(n: &TestNode) -> Value {
    n.pools_json()
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "m")
        .cloned()
        .expect("pool m")
}

/// Write blocks `which` with generation `gen` into the model, then flush.
fn write_blocks(
    c: &mut NbdClient,
    model: &mut [u64],
    which: impl Iterator<Item = usize>,
    gen: u64,
) {
    for i in which {
        c.write((i * BLOCK) as u64, &block(i, gen, BLOCK), false)
            .unwrap();
        model[i] = gen;
    }
    c.flush().unwrap();
}

/// Every block of `v` reads back at the generation `model` holds.
fn verify(n: &TestNode, model: &[u64]) {
    let mut c = n.nbd("v");
    let mut buf = vec![0u8; BLOCK];
    for (i, &g) in model.iter().enumerate() {
        c.read((i * BLOCK) as u64, &mut buf).unwrap();
        assert!(
            buf == block(i, g, BLOCK),
            "block {i} differs (expected generation {g})"
        );
    }
    c.disconnect().unwrap();
}

/// `tessera pool rebuild m --status --wait`: the rebuild's status once it has ended.
fn rebuild_wait(n: &TestNode) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let p = n.node().pools().get("m").expect("pool m");
        let v = json(n.node().jobs().rebuild_status(&p).expect("rebuild status"));
        if v["state"] != "running" {
            return v;
        }
        assert!(Instant::now() < deadline, "rebuild did not finish: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn raid1_lost_device_replaced_live_then_the_new_one_serves_alone() {
    let mut n = TestNode::with_nbd("raid-replace", 2);
    let d = path_str(&n.dir);
    n.create_pool(
        "m",
        "raid1",
        &[format!("{d}/a.img:64M"), format!("{d}/b.img:64M")],
    );
    n.exported_volume("v", "m", VOL);
    let blocks = (VOL as usize) / BLOCK;
    let mut model = vec![0u64; blocks];
    write_blocks(&mut n.nbd("v"), &mut model, 0..blocks, 1);

    // Device b is lost: the pool comes up without it.
    n.stop();
    std::fs::remove_file(n.dir.join("b.img")).unwrap();
    n.restart();
    let p = pool(&n);
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][0]["state"], "online", "{p}");
    assert_eq!(p["device_states"][1]["state"], "failed", "{p}");
    write_blocks(&mut n.nbd("v"), &mut model, (0..blocks).step_by(7), 2);
    verify(&n, &model);

    // Replace the lost device by a new one (another file): live, the rebuild onto it
    // starts at once (a restart meanwhile would resume it).
    let node = n.node().clone();
    assert!(
        node.replace_device("m", 1, &format!("{d}/s.img:16M"), false)
            .is_err(),
        "a smaller device was accepted"
    );
    let r = json(
        node.replace_device("m", 1, &format!("{d}/c.img:64M"), false)
            .expect("replace device 1"),
    );
    assert_eq!(r["state"], "rebuilding", "{r}");
    drop(node);
    let v = rebuild_wait(&n);
    assert_eq!(v["state"], "done", "{v}");
    let p = pool(&n);
    assert_eq!(p["state"], "online", "{p}");
    assert!(p["devices"][1].as_str().unwrap().contains("c.img"), "{p}");
    // And the original device can go now: c serves every byte.
    n.stop();
    std::fs::remove_file(n.dir.join("a.img")).unwrap();
    n.restart();
    let p = pool(&n);
    assert_eq!(p["device_states"][0]["state"], "failed", "{p}");
    assert_eq!(p["device_states"][1]["state"], "online", "{p}");
    verify(&n, &model);
}
