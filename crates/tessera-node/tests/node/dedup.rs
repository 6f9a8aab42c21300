//! Dedup pools (issue 25) on a node in this process: the same data copied with nbdcopy
//! into two volumes is stored once and reads back (also after a restart), `nbdinfo
//! --map` shows data only where it was written, fio with `dedupe_percentage=50` dedups,
//! and what the first cut does not do is refused with the reason. (Moved from
//! `crates/tessera-cli/tests/cli/dedup.rs`, which keeps the kill -9, the line `pool show`
//! prints, and `pool create --dedup` refused without leaving the pool behind: the API's
//! create does that.)

use crate::common;
use common::*;

use std::process::Command;

use serde_json::Value;
use tessera_api::CacheRequest;
use tessera_testkit::node::{nbdinfo_map, require_tool, run_ok};

/// `tessera pool create p DEVICE --dedup [--force]`: the pool, then dedup on it, as the
/// API's create does.
fn dedup_pool(n: &TestNode, device: &str, force: bool) {
    let node = n.node();
    node.create_pool(
        "p",
        &[device.to_string()],
        "concat".parse().expect("layout"),
        None,
        None,
        force,
    )
    .expect("create pool p");
    node.enable_pool_dedup("p").expect("dedup on p");
}

/// The dedup figures of `tessera --json pool show p`.
fn dedup(n: &TestNode) -> Value {
    let v = n.pool_json("p");
    assert!(v["dedup"].is_object(), "no dedup figures in {v}");
    v["dedup"].clone()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn identical_data_in_two_volumes_is_stored_once_and_survives_a_restart() {
    if !require_tool("nbdcopy") || !require_tool("nbdinfo") {
        return;
    }
    let mut n = TestNode::with_nbd("dedup-e2e", 2);
    let d = path_str(&n.dir);
    dedup_pool(&n, &format!("{d}/p.img:256M"), false);
    for v in ["a", "b"] {
        n.exported_volume(v, "p", 64 << 20);
    }
    // 8 MiB of data (no zero blocks), copied into a at 0 and into b whole.
    let src = n.dir.join("src.bin");
    std::fs::write(&src, pattern(77, 8 << 20)).unwrap();
    for v in ["a", "b"] {
        run_ok(
            Command::new("nbdcopy")
                .arg("--flush")
                .arg(&src)
                .arg(n.uri(v)),
        );
    }
    let st = dedup(&n);
    assert_eq!(u(&st, "logical_bytes"), 16 << 20, "{st}");
    assert_eq!(u(&st, "physical_bytes"), 8 << 20, "stored once: {st}");
    assert_eq!(u(&st, "hits"), 2048, "{st}");
    // Block status: data where written, a hole after it.
    let map = nbdinfo_map(&n.uri("b"));
    assert_eq!(
        map.first().map(|r| (r.0, r.1, r.2 & 1)),
        Some((0, 8 << 20, 0)),
        "{map:?}"
    );
    assert!(map.iter().skip(1).all(|r| r.2 & 1 == 1), "{map:?}");
    // A restart keeps both copies, stored once. (A kill -9 is the CLI's test.)
    n.restart();
    for v in ["a", "b"] {
        let back = n.dir.join(format!("{v}.bin"));
        run_ok(Command::new("nbdcopy").arg(n.uri(v)).arg(&back));
        let got = std::fs::read(&back).unwrap();
        assert!(
            got[..8 << 20] == pattern(77, 8 << 20)[..],
            "{v}: data differs after a restart"
        );
        assert!(got[8 << 20..].iter().all(|&x| x == 0), "{v}: tail not zero");
    }
    let st = dedup(&n);
    assert_eq!(
        (u(&st, "logical_bytes"), u(&st, "physical_bytes")),
        (16 << 20, 8 << 20),
        "{st}"
    );
}

#[test]
fn fio_with_half_duplicate_blocks_dedups() {
    if !require_tool("fio") {
        return;
    }
    let n = TestNode::with_nbd("dedup-fio", 2);
    let d = path_str(&n.dir);
    dedup_pool(&n, &format!("{d}/p.img:256M"), false);
    n.exported_volume("v", "p", 64 << 20);
    let fio = |args: &[&str]| {
        let o = Command::new("timeout")
            .arg("60")
            .arg("fio")
            .arg("--name=d")
            .arg("--ioengine=nbd")
            .arg(format!("--uri={}", n.uri("v")))
            .arg("--bs=4k")
            .arg("--iodepth=8")
            .args(args)
            .output()
            .expect("run fio");
        let text = combined(&o);
        assert!(
            o.status.success() && text.contains("err= 0"),
            "fio {args:?} failed:\n{text}\n{}",
            log_text()
        );
    };
    // Half of the blocks repeat earlier ones (no verify headers, which would make
    // every block unique).
    fio(&["--rw=write", "--size=32M", "--dedupe_percentage=50"]);
    let st = dedup(&n);
    let ratio = st["ratio"].as_f64().unwrap();
    assert!(
        ratio > 1.5,
        "half duplicates should nearly halve the stored bytes: {st}"
    );
}

#[test]
fn what_dedup_does_not_do_yet_is_refused_with_the_reason() {
    let n = TestNode::start("dedup-refusals", 2);
    let d = path_str(&n.dir);
    let node = n.node().clone();
    // Parity layouts: dedup is refused on a raid5 pool, saying why.
    n.create_pool(
        "r5",
        "raid5",
        &[
            format!("{d}/0.img:64M"),
            format!("{d}/1.img:64M"),
            format!("{d}/2.img:64M"),
        ],
    );
    let err = node
        .enable_pool_dedup("r5")
        .expect_err("dedup on a raid5 pool")
        .to_string();
    assert!(err.contains("parity"), "{err}");
    node.destroy_pool("r5").expect("destroy r5");
    dedup_pool(&n, &format!("{d}/0.img:64M"), true);
    node.create_volume("v", "p", 16 << 20, false).unwrap();
    // Snapshots of a dedup volume, and a cache tier on a dedup pool.
    let err = node
        .create_snapshot("v", "s")
        .expect_err("a snapshot of a dedup volume")
        .to_string();
    assert!(err.contains("dedup"), "{err}");
    let err = node
        .add_pool_cache(
            "p",
            &CacheRequest {
                devices: vec!["ram:16M".to_string()],
                mode: None,
                force: false,
                unit: None,
                admit_hits: None,
            },
        )
        .expect_err("a cache on a dedup pool")
        .to_string();
    assert!(err.contains("dedup"), "{err}");
}
