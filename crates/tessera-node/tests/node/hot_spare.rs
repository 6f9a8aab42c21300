//! Live device replacement and hot spares, on file devices: a device of a raid1 or
//! raid5 pool vanishes while clients write; the node puts the pool's hot spare in its
//! place by itself and rebuilds onto it, without a restart; every byte reads back, and
//! after a restart (a new node in this process, on the same directory) the spare is a
//! member. The spares are added, listed and removed through the node's service, as the
//! API does. A replacement (`pool replace`) is live too. Every wait is bounded by a
//! deadline; NBD listens on 127.0.0.1 only. (Moved from
//! `crates/tessera-cli/tests/cli/hot_spare.rs`, which keeps the pool table and `pool
//! replace` output a user sees. The raid5 takeover moved last: its restart needed the
//! parity engines to give their device handles back when a node is dropped, db1a35b.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_api::BackgroundLimits;
use tessera_nbd::client::NbdClient;

const VOL: u64 = 16 << 20;
const BLOCK: usize = 64 << 10;
/// The faulty device disappears this long after the node opened it.
const VANISH_MS: u64 = 4000;

/// Write blocks `which` at generation `gen`, note it in `model`, then flush.
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

/// `tessera --json pool status m`: the pool with its spares and rebuild.
fn status(n: &TestNode) -> Value {
    match n.node().pool_detail("m") {
        Ok(p) => json(p),
        Err(e) => panic!(
            "pool m: {e}; pools: {}\nlog:\n{}",
            n.pools_json(),
            log_text()
        ),
    }
}

/// `tessera --json pool spare list m`.
fn spares(n: &TestNode) -> Vec<String> {
    n.node().list_spares("m").expect("spare list").spares
}

/// Poll the pool's status until `f` holds or `limit` passes (then panic with the status
/// and the log).
fn wait_status(n: &TestNode, what: &str, limit: Duration, f: impl FnMut(&Value) -> bool) -> Value {
    poll_until(limit, Duration::from_millis(100), || status(n), f)
        .unwrap_or_else(|v| panic!("timed out waiting for {what}: {v}\nlog:\n{}", log_text()))
}

/// A pool `m` (`layout`) of `ndev` 64 MiB files, device `bad` of which vanishes
/// `VANISH_MS` after the node opened it; volume and export `v`; the pattern written.
fn setup(tag: &str, layout: &str, ndev: usize, bad: usize) -> (TestNode, Vec<u64>) {
    let n = TestNode::with_nbd(tag, 2);
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
    n.create_pool("m", layout, &devs);
    n.exported_volume("v", "m", VOL);
    // A slow enough rebuild that its progress is visible (`tessera background set
    // rebuild --bw 16M`).
    let node = n.node();
    node.jobs()
        .background()
        .put(
            "rebuild",
            Some(BackgroundLimits {
                bps: 16 << 20,
                latency_target_us: None,
                min_pct: 1,
            }),
        )
        .expect("rebuild class limits");
    node.replicas().refresh_rates(node.jobs().background());
    let blocks = (VOL as usize) / BLOCK;
    let mut model = vec![0u64; blocks];
    write_blocks(&mut n.nbd("v"), &mut model, 0..blocks, 1);
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
    let mut c = n.nbd("v");
    let mut gen = 2;
    loop {
        let v = status(n);
        if done(&v) {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}: {v}\nlog:\n{}",
            log_text()
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

/// The spare takes device `bad`'s place by itself, is rebuilt, serves the data, and is
/// a member after a restart.
fn spare_takes_over(tag: &str, layout: &str, ndev: usize, bad: usize) {
    let t0 = Instant::now();
    let (mut n, mut model) = setup(tag, layout, ndev, bad);
    let d = path_str(&n.dir);
    let node = n.node().clone();
    // Checked at add time: too small, ram, twice.
    assert!(node
        .add_spare("m", &format!("{d}/small.img:16M"), false)
        .is_err());
    assert!(node.add_spare("m", "ram:64M", false).is_err());
    let spare = format!("{d}/spare.img:64M");
    node.add_spare("m", &spare, false).expect("add the spare");
    assert!(node.add_spare("m", &spare, false).is_err());
    let listed = spares(&n);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert!(listed[0].ends_with("spare.img"), "{listed:?}");
    assert_eq!(status(&n)["spares"][0], listed[0].as_str());
    // A second spare, removed again (list and remove round trip).
    node.add_spare("m", &format!("{d}/extra.img:64M"), false)
        .expect("add a second spare");
    assert_eq!(spares(&n).len(), 2);
    node.remove_spare("m", &format!("{d}/extra.img"))
        .expect("remove the second spare");
    assert_eq!(spares(&n), listed);
    drop(node);

    // The device vanishes; clients keep writing. Within a bounded time the spare is in
    // its slot and being rebuilt.
    let v = write_until(
        &n,
        &mut model,
        "the spare to take over",
        Duration::from_secs(30),
        |v| dev_is(v, bad, "spare.img"),
    );
    assert!(
        v["spares"].as_array().unwrap().is_empty(),
        "the spare is still listed: {v}"
    );
    assert_eq!(v["rebuild"]["device"], bad, "{v}");
    let seen_rebuilding = v["state"] == "rebuilding" || v["rebuild"]["state"] == "running";
    // More writes while it rebuilds.
    write_blocks(
        &mut n.nbd("v"),
        &mut model,
        (3..VOL as usize / BLOCK).step_by(5),
        50,
    );
    let v = wait_status(&n, "the rebuild to finish", Duration::from_secs(60), |v| {
        v["rebuild"]["state"] != "running"
    });
    assert_eq!(v["rebuild"]["state"], "done", "{v}");
    assert_eq!(v["state"], "online", "{v}");
    assert_eq!(v["device_states"][bad]["state"], "online", "{v}");
    assert!(dev_is(&v, bad, "spare.img"), "{v}");
    assert!(
        seen_rebuilding || v["rebuild"]["units_done"].as_u64().unwrap() > 0,
        "{v}"
    );
    assert!(spares(&n).is_empty());
    // The node says so in its log: the line that names this test's spare (the log holds
    // every test's lines of this binary).
    let log = log_text();
    let dir = n.dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        log.lines()
            .any(|l| l.contains("hot spare") && l.contains(&dir)),
        "{log}"
    );
    verify(&n, &model);

    // Persistent: after a restart the spare is a member and the pool is online.
    n.stop();
    let reg = std::fs::read_to_string(n.data_dir.join("pools.json")).unwrap();
    assert!(
        reg.contains("spare.img") && !reg.contains("vanish"),
        "{reg}"
    );
    assert!(!reg.contains("\"spares\""), "{reg}");
    n.restart();
    let v = status(&n);
    assert_eq!(v["state"], "online", "{v}");
    assert!(dev_is(&v, bad, "spare.img"), "{v}");
    assert!(v["spares"].as_array().unwrap().is_empty(), "{v}");
    verify(&n, &model);
    eprintln!("{tag}: {:.1} s", t0.elapsed().as_secs_f64());
}

#[test]
fn raid1_hot_spare_replaces_vanished_device() {
    spare_takes_over("hot-spare-raid1", "raid1", 2, 0);
}

#[test]
fn raid5_hot_spare_replaces_vanished_device() {
    spare_takes_over("hot-spare-raid5", "raid5", 4, 1);
}

/// `pool replace` takes effect at once: the rebuild onto the new device runs and
/// completes without a restart, and then the new device alone serves every byte.
#[test]
fn replace_is_live() {
    let t0 = Instant::now();
    let (mut n, mut model) = setup("replace-live", "raid1", 2, 1);
    let d = path_str(&n.dir);
    write_until(
        &n,
        &mut model,
        "device 1 to fail",
        Duration::from_secs(30),
        |v| v["device_states"][1]["state"] == "failed",
    );
    let node = n.node().clone();
    // Refused: a healthy device, a smaller one.
    assert!(node
        .replace_device("m", 0, &format!("{d}/c.img:64M"), false)
        .is_err());
    assert!(node
        .replace_device("m", 1, &format!("{d}/s.img:16M"), false)
        .is_err());
    let r = json(
        node.replace_device("m", 1, &format!("{d}/c.img:64M"), false)
            .expect("replace device 1"),
    );
    assert_eq!(r["state"], "rebuilding", "{r}");
    assert_eq!(r["live"], true, "{r}");
    drop(node);
    let v = status(&n);
    assert!(dev_is(&v, 1, "c.img"), "{v}");
    assert_eq!(v["rebuild"]["device"], 1, "{v}");
    write_blocks(
        &mut n.nbd("v"),
        &mut model,
        (1..VOL as usize / BLOCK).step_by(3),
        60,
    );
    let v = wait_status(&n, "the rebuild to finish", Duration::from_secs(60), |v| {
        v["rebuild"]["state"] != "running"
    });
    assert_eq!(v["rebuild"]["state"], "done", "{v}");
    assert_eq!(v["state"], "online", "{v}");
    verify(&n, &model);
    // The new device alone serves every byte: the old copy (device 0) can go.
    n.stop();
    std::fs::remove_file(n.dir.join("d0.img")).unwrap();
    n.restart();
    let v = status(&n);
    assert_eq!(v["device_states"][0]["state"], "failed", "{v}");
    assert_eq!(v["device_states"][1]["state"], "online", "{v}");
    assert!(dev_is(&v, 1, "c.img"), "{v}");
    verify(&n, &model);
    eprintln!("replace-live: {:.1} s", t0.elapsed().as_secs_f64());
}
