//! A pool's cache tier (issue 24) on a node in this process: a pool made slow on purpose
//! (the fault device's latency, 2 ms per I/O) under a cache, driven by fio over NBD.
//!
//! - in every mode, fio's crc32c verify passes and a second read pass is served by the
//!   cache (write-through and write-around);
//! - the cache device vanishes under a verified write load: nothing is lost, the tier
//!   says it failed, the pool goes on uncached;
//! - modes switch under a verified load;
//! - a snapshot taken and a volume deleted while their data is in the cache: the
//!   snapshot reads its own bytes, a new volume on the freed units reads zeros.
//!
//! (Moved from `crates/tessera-cli/tests/cli/cache_tier.rs`, which keeps the CLI's and
//! API's management of the tier: `pool create --cache ...` (the API's create adds the
//! cache, and removes a pool refused its cache), `pool cache add/show/mode/remove`, what
//! `cache show` prints, the registry across a restart, refusals.)

use crate::common;
use common::*;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_api::CacheRequest;
use tessera_testkit::node::require_tool;

/// Latency of every I/O of the pool's device.
const SLOW: &str = "latency_us=2000";

/// fio over NBD on `uri`: `rw` of 4 KiB blocks over the first `size`, crc32c verify,
/// at most 60 s (the node not answering is a failure, not a hang).
fn fio(n: &TestNode, uri: &str, name: &str, rw: &str, size: &str, extra: &[&str]) -> Output {
    let mut c = Command::new("timeout");
    c.current_dir(&n.dir)
        .arg("60")
        .arg("fio")
        .arg(format!("--name={name}"))
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .arg(format!("--rw={rw}"))
        .arg("--bs=4k")
        .arg(format!("--size={size}"))
        .arg("--iodepth=16")
        .arg("--verify=crc32c")
        .arg("--verify_fatal=1")
        .arg("--randrepeat=1")
        .arg("--group_reporting")
        .args(extra)
        .stdin(Stdio::null());
    c.output().expect("run fio")
}

/// `tessera --json pool cache show POOL`.
fn cache(n: &TestNode, pool: &str) -> Value {
    json(
        n.node()
            .pool_cache(pool)
            .unwrap_or_else(|e| panic!("cache of {pool}: {e}")),
    )
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// A node with pool `p` on one slow file and a cache of `cache_spec` (`{d}` stands for
/// the node's directory; two devices comma separated) in `mode`, volume `v` of 64 MiB
/// exported as `v`. (`pool create p DEV --cache SPEC --cache-mode MODE`: the pool, then
/// its cache, as the API's create does.)
fn setup(tag: &str, cache_spec: &str, mode: &str) -> TestNode {
    let n = TestNode::with_nbd(tag, 2);
    let d = path_str(&n.dir);
    let cache_spec = cache_spec.replace("{d}", &d);
    n.create_pool("p", "concat", &[format!("fault:{d}/slow.img:160M;{SLOW}")]);
    n.node()
        .add_pool_cache(
            "p",
            &CacheRequest {
                devices: cache_spec.split(',').map(str::to_string).collect(),
                mode: Some(mode.to_string()),
                force: false,
                unit: None,
                admit_hits: None,
            },
        )
        .unwrap_or_else(|e| panic!("cache {cache_spec} for p: {e}"));
    n.exported_volume("v", "p", 64 << 20);
    n
}

#[test]
fn every_mode_verifies_and_a_second_read_pass_hits_the_cache() {
    if !require_tool("fio") {
        return;
    }
    for mode in [
        "write-through",
        "write-around",
        "pass-through",
        "write-back",
    ] {
        // Write-back keeps writes only on the cache devices: files, mirrored.
        let spec = if mode == "write-back" {
            "{d}/c0.img:48M,{d}/c1.img:48M"
        } else {
            "ram:48M"
        };
        let n = setup(&format!("cache-{mode}"), spec, mode);
        let uri = n.uri("v");
        let o = fio(&n, &uri, "w", "randwrite", "24M", &["--do_verify=1"]);
        assert_fio_clean(&format!("{mode}: write and verify"), &o);
        let before = cache(&n, "p");
        let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
        assert_fio_clean(&format!("{mode}: second read pass"), &o);
        let after = cache(&n, "p");
        assert_eq!(after["mode"], mode, "{after}");
        assert_eq!(after["state"], "ok", "{after}");
        let hits = u(&after, "read_hits") - u(&before, "read_hits");
        let misses = u(&after, "read_misses") - u(&before, "read_misses");
        eprintln!("{mode}: second pass {hits} hits, {misses} misses");
        if mode == "pass-through" {
            assert_eq!(hits, 0, "{after}");
        } else {
            // 24 MiB fits the 48 MiB cache: the second pass is served by it.
            assert!(
                hits > 4 * misses,
                "{mode}: {hits} hits, {misses} misses: {after}"
            );
        }
    }
}

#[test]
fn a_cache_device_vanishing_under_load_loses_nothing() {
    if !require_tool("fio") {
        return;
    }
    for mode in ["write-through", "write-around", "write-back"] {
        // The cache vanishes 2 s after it was added: fio is writing by then. In
        // write-back, one of two mirrored cache devices: the tier goes on with the other.
        let wb = mode == "write-back";
        let spec = if wb {
            "fault:{d}/c0.img:48M;vanish_after_ms=2000,{d}/c1.img:48M"
        } else {
            "fault:ram:48M;vanish_after_ms=2000"
        };
        let n = setup(&format!("cache-fail-{mode}"), spec, mode);
        let uri = n.uri("v");
        let t = Instant::now();
        // 6144 writes at 2000 a second, then their read-back.
        let o = fio(
            &n,
            &uri,
            "w",
            "randwrite",
            "24M",
            &["--do_verify=1", "--rate_iops=2000"],
        );
        assert_fio_clean(&format!("{mode}: cache failing mid-run"), &o);
        assert!(
            t.elapsed() > Duration::from_secs(2),
            "fio ended before the cache failed"
        );
        // Whatever fio wrote reads back right from the pool's devices alone.
        let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
        assert_fio_clean(&format!("{mode}: read back after the failure"), &o);
        let c = cache(&n, "p");
        if wb {
            assert_eq!(c["state"], "degraded", "{mode}: {c}");
        } else {
            assert_eq!(c["state"], "failed", "{mode}: {c}");
            assert!(u(&c, "errors") > 0, "{c}");
        }
    }
}

#[test]
fn modes_switch_under_a_verified_load() {
    if !require_tool("fio") {
        return;
    }
    // Files, mirrored: write-back is one of the modes.
    let n = setup(
        "cache-switch",
        "{d}/c0.img:32M,{d}/c1.img:32M",
        "write-through",
    );
    let uri = n.uri("v");
    let node = n.node().clone();
    let switcher = std::thread::spawn(move || {
        for m in [
            "write-around",
            "write-back",
            "pass-through",
            "write-through",
            "write-back",
            "write-around",
            "write-through",
        ] {
            std::thread::sleep(Duration::from_millis(700));
            // `tessera pool cache mode p M`.
            if let Err(e) = node.set_pool_cache_mode("p", m, false) {
                panic!("mode {m}: {e}");
            }
        }
    });
    // 6144 writes at 1500 a second (4 s), then their read-back, while the modes change.
    let o = fio(
        &n,
        &uri,
        "w",
        "randwrite",
        "24M",
        &["--do_verify=1", "--rate_iops=1500"],
    );
    switcher.join().unwrap();
    assert_fio_clean("switching modes", &o);
    let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
    assert_fio_clean("after the switches", &o);
    assert_eq!(cache(&n, "p")["mode"], "write-through");
}

/// Reads of export `e` over NBD: `len` bytes at `off`.
fn nbd_read(n: &TestNode, e: &str, off: u64, len: usize) -> Vec<u8> {
    let mut c = n.nbd(e);
    let mut buf = vec![0u8; len];
    for (i, chunk) in buf.chunks_mut(1 << 20).enumerate() {
        c.read(off + ((i as u64) << 20), chunk).unwrap();
    }
    buf
}

fn nbd_write(n: &TestNode, e: &str, off: u64, data: &[u8]) {
    let mut c = n.nbd(e);
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        c.write(off + ((i as u64) << 20), chunk, false).unwrap();
    }
    c.flush().unwrap();
}

#[test]
fn snapshots_and_deleted_volumes_never_read_through_stale_cache_data() {
    let n = setup("cache-snap", "ram:64M", "write-through");
    let old = pattern(1, 8 << 20);
    nbd_write(&n, "v", 0, &old);
    // Read twice: cached.
    for _ in 0..2 {
        assert!(nbd_read(&n, "v", 0, 8 << 20) == old);
    }
    assert!(u(&cache(&n, "p"), "valid_bytes") >= 4 << 20);
    snapshot(&n, "v", "s1");
    let new = pattern(2, 8 << 20);
    nbd_write(&n, "v", 0, &new);
    let node = n.node().clone();
    node.add_export("s1", "s1", false, None).unwrap();
    for _ in 0..2 {
        assert!(
            nbd_read(&n, "v", 0, 8 << 20) == new,
            "the volume after the snapshot"
        );
        assert!(nbd_read(&n, "s1", 0, 8 << 20) == old, "the snapshot");
    }
    // Delete everything; a new volume on the freed units reads zeros.
    node.remove_export("s1").unwrap();
    node.remove_export("v").unwrap();
    node.delete_snapshot("s1").unwrap();
    node.delete_volume("v").unwrap();
    n.exported_volume("w", "p", 150 << 20);
    // A partial first write to every unit takes the freed ones among the others.
    for unit in 0..150u64 {
        nbd_write(&n, "w", unit << 20, &[0xabu8; 4096]);
    }
    for unit in 0..150u64 {
        let got = nbd_read(&n, "w", unit << 20, 1 << 20);
        assert!(got[..4096].iter().all(|&b| b == 0xab), "unit {unit}");
        assert!(
            got[4096..].iter().all(|&b| b == 0),
            "unit {unit} of the new volume shows old data"
        );
    }
}
