//! A raid6 pool on file devices served over NBD by a node in this process: fio writes and
//! verifies (crc32c) while one device vanishes mid-run: no error, the pool is degraded,
//! and a second, verify-only pass agrees. (Moved from
//! `crates/tessera-cli/tests/cli/raid_parity.rs`, which keeps the tests built on a kill -9
//! of the node: a parity rebuild resumed after one, and the write hole.)

use crate::common;
use common::*;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_testkit::node::{require_tool, run_bounded};

/// fio over NBD: 4 KiB random writes with crc32c verify headers over 32 MiB, paced at
/// `FIO_IOPS` so that the write phase lasts ~5.5 s whatever the machine, then the in-job
/// read-back verify.
const FIO_IOPS: u32 = 1500;
/// Device 2 vanishes this long after the pool opened it (~2.5 s into fio's write phase).
const VANISH_MS: u64 = 3000;

/// `tessera pool list --json`'s entry of pool `name`.
fn pool(n: &TestNode, name: &str) -> Value {
    let v = n.pools_json();
    v.as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("pool {name} not listed: {v}"))
}

/// Poll the pool list until `pred` holds for pool `name`, for at most `secs`.
fn wait_pool(n: &TestNode, name: &str, secs: u64, what: &str, pred: impl Fn(&Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let p = pool(n, name);
        if pred(&p) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not reached within {secs} s: {p}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn fio_cmd(n: &TestNode, uri: &str) -> Command {
    let mut c = Command::new("fio");
    c.current_dir(&n.dir) // verify state files land here
        .arg("--name=raid6")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg("--rw=randwrite")
        .arg("--bs=4k")
        .arg("--size=32M")
        .arg("--iodepth=16")
        .arg("--verify=crc32c")
        .arg("--verify_fatal=1")
        .arg("--randrepeat=1")
        .arg("--group_reporting")
        .arg("--timeout=40");
    c
}

/// Run fio for at most 45 s; a fio that does not finish means the node stopped answering
/// its NBD requests, which the failure says (with the pool's state).
fn fio_bounded(n: &TestNode, cmd: &mut Command, what: &str) -> Output {
    run_bounded(cmd, &n.dir, 45).unwrap_or_else(|e| {
        panic!(
            "{what}: {e}\nthe node stopped answering NBD requests; pools: {}\nnode log:\n{}",
            n.pools_json(),
            log_text()
        )
    })
}

#[test]
fn fio_verify_over_nbd_on_raid6_with_a_device_failing_mid_run() {
    if !require_tool("fio") {
        return;
    }
    let n = TestNode::with_nbd("raid6-fio", 2);
    let d = path_str(&n.dir);
    let mut devs: Vec<String> = (0..5).map(|i| format!("{d}/d{i}.img:64M")).collect();
    devs[2] = format!("fault:{d}/d2.img:64M;vanish_after_ms={VANISH_MS}");
    let opened = Instant::now();
    // `tessera pool create p6 --layout raid6 --stripe-size 64K DEVS`.
    n.node()
        .create_pool(
            "p6",
            &devs,
            "raid6".parse().expect("layout"),
            Some(64 << 10),
            None,
            false,
        )
        .expect("create the raid6 pool");
    n.exported_volume("v", "p6", 64 << 20);
    let p = pool(&n, "p6");
    assert_eq!(p["layout"], "raid6", "{p}");
    assert_eq!(p["parity"], 2, "{p}");
    assert_eq!(p["state"], "online", "{p}");

    let uri = n.uri("v");
    let started = opened.elapsed();
    assert!(
        started < Duration::from_millis(VANISH_MS - 500),
        "setup took {started:?}: fio would start after the device vanished"
    );
    let o = fio_bounded(
        &n,
        fio_cmd(&n, &uri)
            .arg(format!("--rate_iops={FIO_IOPS}"))
            .arg("--do_verify=1"),
        "write+verify pass",
    );
    let ended = opened.elapsed();
    assert_fio_clean("write+verify pass", &o);
    assert!(
        ended > Duration::from_millis(VANISH_MS + 1000),
        "fio ended {ended:?} after the pool opened: the device vanished after it, not during it"
    );
    eprintln!(
        "fio ran from {started:?} to {ended:?} after the pool opened; device 2 vanished at {VANISH_MS} ms"
    );

    // The failure was seen by the datapath (or at the latest by the commit thread's sync).
    wait_pool(&n, "p6", 15, "device 2 failed", |p| {
        p["state"] == "degraded"
    });
    let p = pool(&n, "p6");
    assert_eq!(p["device_states"][2]["state"], "failed", "{p}");
    for i in [0, 1, 3, 4] {
        assert_eq!(p["device_states"][i]["state"], "online", "{p}");
    }

    // A separate verify-only pass over the same layout, on a fresh connection, degraded.
    let o = fio_bounded(
        &n,
        fio_cmd(&n, &uri).arg("--verify_only"),
        "verify-only pass",
    );
    assert_fio_clean("verify-only pass", &o);
    assert!(
        combined(&o).contains("READ:"),
        "verify-only pass did not read:\n{}",
        combined(&o)
    );
    assert_eq!(pool(&n, "p6")["state"], "degraded");
}
