//! QoS beyond per-volume limits, through a real node: share weights splitting a
//! saturated core, group (tenant) limits with a stepped burst, one-time bursts served then
//! repaid, and persistence of all of it.

use crate::common;

use std::time::Duration;

use common::*;

const TWO_VOLUMES: &str = r#"
[[pool]]
name = "p"
devices = ["ram:1G"]

[[volume]]
name = "a"
pool = "p"
size = "256M"

[[volume]]
name = "b"
pool = "p"
size = "256M"

[[export]]
name = "a"
volume = "a"

[[export]]
name = "b"
volume = "b"
"#;

/// Two loads at once, one per export; returns their results.
fn both(n: &TestNode, pattern: &str, qd: u32, secs: u64) -> (PerfResult, PerfResult) {
    both_with(n, pattern, qd, secs, &[])
}

fn both_with(
    n: &TestNode,
    pattern: &str,
    qd: u32,
    secs: u64,
    extra: &[&str],
) -> (PerfResult, PerfResult) {
    let (ua, ub) = (n.uri("a"), n.uri("b"));
    let p = pattern.to_string();
    let e: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let t = std::thread::spawn(move || {
        let e: Vec<&str> = e.iter().map(String::as_str).collect();
        nbd_perf(&ua, &p, qd, secs, &e)
    });
    let rb = nbd_perf(&ub, pattern, qd, secs, extra);
    (t.join().unwrap(), rb)
}

/// The node's share figures of `volume` (units dispatched in split rounds, deferrals).
fn shares(n: &TestNode, volume: &str) -> (u64, u64) {
    let out = n.cli_ok(&["--json", "volume", "stats", volume, "--interval", "0.01"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("stats JSON");
    let t = &v["totals"];
    (
        t["shared_units"].as_u64().unwrap(),
        t["share_deferrals"].as_u64().unwrap(),
    )
}

/// Both volumes read at once; the ratio a:b of the units the node dispatched in rounds
/// both wanted more of, and the clients' figures for the message. The node's own
/// counters, not the clients' IOPS: on a loaded machine the clients may not keep the
/// core saturated the whole run, and then the work is not split (nobody waits), which
/// is right, but shows in the clients' ratio as noise (it read 0.95 with three busy
/// loops beside the test). What the node split, it split by weight.
fn split(n: &TestNode, secs: u64) -> (f64, String) {
    let (a0, b0) = (shares(n, "a"), shares(n, "b"));
    let (ra, rb) = both_with(n, "randread", 128, secs, &["--bs", "64K"]);
    let (a1, b1) = (shares(n, "a"), shares(n, "b"));
    let (ua, ub) = (a1.0 - a0.0, b1.0 - b0.0);
    let seen = format!(
        "shared units a={ua} b={ub}, deferrals a={} b={}; client IOPS a={} b={}",
        a1.1 - a0.1,
        b1.1 - b0.1,
        ra.iops,
        rb.iops
    );
    // The core was split for a good part of the run. Measured on a 2-core machine:
    // 95,000-140,000 units a second idle, 5,000-40,000 with three busy loops beside
    // the test; under 1,000 in the whole run means the core was never really split.
    assert!(
        ua + ub >= 1000 && ub > 0,
        "the core was never split between the volumes: {seen}"
    );
    (ua as f64 / ub as f64, seen)
}

#[test]
fn weights_split_a_saturated_core() {
    let _alone = crate::alone();
    // One reactor core serves both volumes, so they compete for it.
    let mut n = TestNode::start_with_cores("qos-shares", 1, TWO_VOLUMES);
    n.cli_ok(&["volume", "qos", "a", "--weight", "300"]);
    n.cli_ok(&["volume", "qos", "b", "--weight", "100"]);
    // 64 KiB reads of written data: the server's core (two copies per request), not the
    // clients (one), is the bottleneck. Hole reads would cost the server almost nothing
    // and leave nothing to split.
    both_with(&n, "randwrite", 32, 2, &["--bs", "64K"]);
    let (ratio, seen) = split(&n, 4);
    eprintln!("weights 3:1: ratio {ratio:.2} ({seen})");
    assert!(
        (2.3..=3.75).contains(&ratio),
        "weights 3:1, ratio {ratio:.2}: {seen}"
    );

    // Equal weights: an equal split.
    n.cli_ok(&["volume", "qos", "a", "--weight", "100"]);
    let (ratio, seen) = split(&n, 3);
    eprintln!("equal weights: ratio {ratio:.2} ({seen})");
    assert!(
        (0.7..=1.43).contains(&ratio),
        "equal weights, ratio {ratio:.2}: {seen}"
    );

    // Weights persist (catalog version 3) across kill -9, on a file-backed pool (the RAM
    // pool above is recreated empty at restart).
    let dev_dir = temp_dir("qos-shares-dev");
    let dev = format!("{}:256M", dev_dir.path().join("pool.img").display());
    n.cli_ok(&["pool", "create", "pf", &dev]);
    n.cli_ok(&["volume", "create", "c", "--pool", "pf", "--size", "64M"]);
    n.cli_ok(&["volume", "qos", "c", "--weight", "300", "--reads-first"]);
    n.kill9();
    n.restart();
    let shown = n.cli_ok(&["volume", "qos", "c"]);
    assert!(shown.contains("weight=300"), "{shown}");
    assert!(shown.contains("reads_first=true"), "{shown}");
    let bad = n.cli(&["volume", "qos", "c", "--weight", "0"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("weight"));
}

#[test]
fn a_group_shares_one_limit_and_steps_up_under_pressure() {
    let _alone = crate::alone();
    let mut n = TestNode::start_with_config("qos-group", TWO_VOLUMES);
    n.cli_ok(&["group", "set", "tenant", "--iops", "4000"]);
    n.cli_ok(&["group", "add", "tenant", "a"]);
    n.cli_ok(&["group", "add", "tenant", "b"]);
    // Both members together are held to the group's limit, over 10 s within 5%.
    let (a, b) = both(&n, "randread", 32, 10);
    let total = a.iops + b.iops;
    assert!(
        within(total, 4000.0, 0.05),
        "group 4000: a={} b={}",
        a.iops,
        b.iops
    );
    // ...and split it about evenly.
    assert!(
        (0.6..=1.66).contains(&(a.iops / b.iops)),
        "a={} b={}",
        a.iops,
        b.iops
    );

    // A member's own limit still applies inside the group.
    n.cli_ok(&["volume", "qos", "b", "--iops", "500"]);
    let (a, b) = both(&n, "randread", 32, 3);
    assert!(within(b.iops, 500.0, 0.1), "b limited to 500: {}", b.iops);
    assert!(a.iops > 2500.0, "a takes what b leaves: {}", a.iops);
    n.cli_ok(&["volume", "qos", "b", "--clear"]);

    // Stepped burst: +50% per 500 ms step, two steps, under sustained pressure.
    n.cli_ok(&[
        "group",
        "set",
        "tenant",
        "--iops",
        "2000",
        "--step-pct",
        "50",
        "--max-steps",
        "2",
        "--step-ms",
        "500",
        "--credit-ms",
        "60000",
    ]);
    let (a, b) = both(&n, "randread", 32, 5);
    let shown = n.cli_ok(&["group", "show", "tenant"]);
    assert!(shown.contains("level 2"), "{shown}");
    // 5 s: about 0.5 s at 2000, 0.5 s at 3000, then 4000: well above the base.
    let total = a.iops + b.iops;
    assert!(total > 3000.0 && total < 4200.0, "stepped total {total}");
    // With the pressure gone it steps back down.
    std::thread::sleep(Duration::from_millis(1600));
    let shown = n.cli_ok(&["group", "show", "tenant"]);
    assert!(shown.contains("level 0"), "{shown}");

    // Persistent across restart; removal and deletion free the members.
    n.kill9();
    n.restart();
    let shown = n.cli_ok(&["group", "list"]);
    assert!(
        shown.contains("tenant") && shown.contains("a, b"),
        "{shown}"
    );
    n.cli_ok(&["group", "remove", "tenant", "b"]);
    let b = nbd_perf(&n.uri("b"), "randread", 32, 1, &[]);
    assert!(
        b.iops > 10_000.0,
        "b out of the group is unlimited: {}",
        b.iops
    );
    let a = nbd_perf(&n.uri("a"), "randread", 32, 2, &[]);
    assert!(a.iops < 4500.0, "a still in the group: {}", a.iops);
    n.cli_ok(&["group", "delete", "tenant"]);
    let a = nbd_perf(&n.uri("a"), "randread", 32, 1, &[]);
    assert!(a.iops > 10_000.0, "group deleted: {}", a.iops);
    let missing = n.cli(&["group", "add", "nope", "a"]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("not found"));
}

#[test]
fn a_one_time_burst_is_served_then_repaid() {
    let _alone = crate::alone();
    let n = TestNode::start_with_config("qos-burst", TWO_VOLUMES);
    // 1000 IOPS, a 100 ms refilling bucket and a one-time burst of 2 s of the rate.
    n.cli_ok(&[
        "volume",
        "qos",
        "a",
        "--iops",
        "1000",
        "--one-time-burst-ms",
        "2000",
    ]);
    let first = nbd_perf(&n.uri("a"), "randread", 32, 2, &[]);
    // 2 s: 2000 at the rate + 2000 of one-time burst + 100 of bucket.
    assert!(
        within(first.iops * 2.0, 4100.0, 0.06),
        "with burst {}",
        first.iops
    );
    // The burst is spent: back to the rate.
    let then = nbd_perf(&n.uri("a"), "randread", 32, 3, &[]);
    assert!(within(then.iops, 1000.0, 0.06), "after burst {}", then.iops);
}

#[test]
fn a_high_limit_is_held_without_stalling() {
    let _alone = crate::alone();
    // Regression: at high rates a refused request's retry timer is due almost at once;
    // judged by a stale clock it was refused forever and the connection stalled.
    let n = TestNode::start_with_config("qos-high", TWO_VOLUMES);
    n.cli_ok(&["volume", "qos", "a", "--iops", "50000"]);
    let r = nbd_perf(&n.uri("a"), "randread", 32, 3, &[]);
    assert!(
        within(r.iops, 50_000.0, 0.08),
        "limit 50000, got {}",
        r.iops
    );
    let r = nbd_perf(&n.uri("a"), "randread", 1, 1, &[]);
    assert!(r.iops > 1000.0, "QD1 under a high limit: {}", r.iops);
}
