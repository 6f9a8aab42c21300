//! A pool's cache tier (issue 24), end to end: a pool made slow on purpose (the fault
//! device's latency, 2 ms per I/O) under a RAM cache, driven by fio over NBD.
//!
//! - in every mode, fio's crc32c verify passes and a second read pass is served by the
//!   cache (write-through and write-around);
//! - the cache device vanishes under a verified write load: nothing is lost, the tier
//!   says it failed, the pool goes on uncached;
//! - modes switch under a verified load;
//! - a snapshot taken and a volume deleted while their data is in the cache: the
//!   snapshot reads its own bytes, a new volume on the freed units reads zeros;
//! - the CLI and API: add, show, mode, remove, create with --cache, the registry across
//!   a restart, refusals.

use crate::common;
use common::*;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Latency of every I/O of the pool's device.
const SLOW: &str = "latency_us=2000";

fn combined(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

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

fn assert_fio_clean(what: &str, o: &Output, n: &TestNode) {
    let text = combined(o);
    assert!(
        o.status.success() && text.contains("err= 0"),
        "{what}: fio failed ({}):\n{text}\nnode log:\n{}",
        o.status,
        n.log_text()
    );
    assert!(
        !text.contains("verify:") && !text.contains("bad magic"),
        "{what}: fio reported verify failures:\n{text}"
    );
}

fn cache(n: &TestNode, pool: &str) -> Value {
    n.json(&["pool", "cache", "show", pool])
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

/// A node with pool `p` on one slow file and a cache of `cache_spec` (`{d}` stands for
/// the node's directory), volume `v` of 64 MiB exported as `v`.
fn setup(tag: &str, cache_spec: &str, mode: &str) -> TestNode {
    let n = TestNode::start_with_config(tag, "");
    let d = path_str(&n.dir);
    let cache_spec = &cache_spec.replace("{d}", &d);
    let dev = format!("fault:{d}/slow.img:160M;{SLOW}");
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &dev,
        "--cache",
        cache_spec,
        "--cache-mode",
        mode,
    ]);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "64M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
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
        assert_fio_clean(&format!("{mode}: write and verify"), &o, &n);
        let before = cache(&n, "p");
        let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
        assert_fio_clean(&format!("{mode}: second read pass"), &o, &n);
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
        assert_fio_clean(&format!("{mode}: cache failing mid-run"), &o, &n);
        assert!(
            t.elapsed() > Duration::from_secs(2),
            "fio ended before the cache failed"
        );
        // Whatever fio wrote reads back right from the pool's devices alone.
        let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
        assert_fio_clean(&format!("{mode}: read back after the failure"), &o, &n);
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
    let api = n.api();
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
            let o = Command::new(BIN)
                .args(["--api", &api, "pool", "cache", "mode", "p", m])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            assert!(o.status.success(), "mode {m}: {}", combined(&o));
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
    assert_fio_clean("switching modes", &o, &n);
    let o = fio(&n, &uri, "w", "randwrite", "24M", &["--verify_only"]);
    assert_fio_clean("after the switches", &o, &n);
    assert_eq!(cache(&n, "p")["mode"], "write-through");
}

/// Reads of export `e` over NBD: `len` bytes at `off`.
fn nbd_read(n: &TestNode, e: &str, off: u64, len: usize) -> Vec<u8> {
    let mut c = nbd_connect(n, e);
    let mut buf = vec![0u8; len];
    for (i, chunk) in buf.chunks_mut(1 << 20).enumerate() {
        c.read(off + ((i as u64) << 20), chunk).unwrap();
    }
    buf
}

fn nbd_write(n: &TestNode, e: &str, off: u64, data: &[u8]) {
    let mut c = nbd_connect(n, e);
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
    n.cli_ok(&["export", "add", "s1", "--volume", "s1"]);
    for _ in 0..2 {
        assert!(
            nbd_read(&n, "v", 0, 8 << 20) == new,
            "the volume after the snapshot"
        );
        assert!(nbd_read(&n, "s1", 0, 8 << 20) == old, "the snapshot");
    }
    // Delete everything; a new volume on the freed units reads zeros.
    n.cli_ok(&["export", "remove", "s1"]);
    n.cli_ok(&["export", "remove", "v"]);
    n.cli_ok(&["snapshot", "delete", "s1"]);
    n.cli_ok(&["volume", "delete", "v"]);
    n.cli_ok(&["volume", "create", "w", "--pool", "p", "--size", "150M"]);
    n.cli_ok(&["export", "add", "w", "--volume", "w"]);
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

#[test]
fn cli_and_api_manage_the_cache_and_a_restart_keeps_it() {
    let n = TestNode::start_with_config("cache-cli", "");
    let d = path_str(&n.dir);
    n.cli_ok(&["pool", "create", "p", &format!("{d}/p.img:128M")]);
    n.cli_ok(&["pool", "create", "q", &format!("{d}/q.img:128M")]);
    // No cache yet.
    let o = n.cli(&["pool", "cache", "show", "p"]);
    assert!(!o.status.success(), "{}", combined(&o));
    // Refusals: a pool's device, write-back, three devices.
    let o = n.cli(&["pool", "cache", "add", "p", &format!("{d}/q.img")]);
    assert!(
        !o.status.success() && combined(&o).contains("device of pool 'q'"),
        "{}",
        combined(&o)
    );
    let o = n.cli(&[
        "pool",
        "cache",
        "add",
        "p",
        &format!("{d}/c.img:40M"),
        "--mode",
        "write-back",
    ]);
    assert!(
        !o.status.success() && combined(&o).contains("one cache device"),
        "{}",
        combined(&o)
    );
    // Add, show, mode, and the metrics.
    n.cli_ok(&[
        "pool",
        "cache",
        "add",
        "p",
        &format!("{d}/c.img:40M"),
        "--mode",
        "write-around",
    ]);
    let c = cache(&n, "p");
    assert_eq!(c["mode"], "write-around");
    // 40 MiB less the label's MiB and the slot records' MiB.
    assert_eq!(u(&c, "capacity"), 38 << 20, "{c}");
    let text = n.cli_ok(&["pool", "cache", "show", "p"]);
    assert!(text.contains("write-around (ok)"), "{text}");
    let o = n.cli(&["pool", "cache", "add", "q", &format!("{d}/c.img")]);
    assert!(
        !o.status.success() && combined(&o).contains("cache of pool 'p'"),
        "{}",
        combined(&o)
    );
    n.cli_ok(&["pool", "cache", "mode", "p", "write-through"]);
    // A pool created with a cache of 16 KiB units; a unit out of range is refused.
    let o = n.cli(&[
        "pool",
        "create",
        "r",
        &format!("{d}/r.img:64M"),
        "--cache",
        &format!("{d}/rc.img:24M"),
        "--cache-unit",
        "8K",
    ]);
    assert!(
        !o.status.success() && combined(&o).contains("16K to 1M"),
        "{}",
        combined(&o)
    );
    assert!(
        !n.cli(&["pool", "show", "r"]).status.success(),
        "a pool refused its cache was left behind"
    );
    n.cli_ok(&[
        "pool",
        "create",
        "r",
        &format!("{d}/r.img:64M"),
        "--cache",
        &format!("{d}/rc.img:24M"),
        "--cache-unit",
        "16K",
    ]);
    let c = cache(&n, "r");
    assert_eq!(u(&c, "unit_size"), 16 << 10, "{c}");
    // 24 MiB less the label's MiB and the slot records' MiB (one 512-byte record per
    // 16 KiB slot).
    assert_eq!(u(&c, "capacity"), 22 << 20, "{c}");
    // A restart brings the tier back from the registry, cold.
    let mut n = n;
    n.stop();
    n.restart();
    assert_eq!(u(&cache(&n, "r"), "unit_size"), 16 << 10);
    let c = cache(&n, "p");
    assert_eq!(c["mode"], "write-through", "{c}");
    assert_eq!(c["state"], "ok", "{c}");
    assert_eq!(u(&c, "cached_units"), 0);
    // Removing it: the pool goes on; the device is free for another pool's cache.
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    assert!(!n.cli(&["pool", "cache", "show", "p"]).status.success());
    n.cli_ok(&["pool", "cache", "add", "q", &format!("{d}/c.img")]);
    n.stop();
    n.restart();
    assert_eq!(cache(&n, "q")["state"], "ok");
    assert!(!n.cli(&["pool", "cache", "show", "p"]).status.success());
}

#[test]
fn admit_hits_is_set_at_create_and_add_shown_and_kept_across_a_restart() {
    let mut n = TestNode::start_with_config("cache-admit-hits", "");
    let d = path_str(&n.dir);
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{d}/p.img:160M"),
        "--cache",
        &format!("{d}/c0.img:48M"),
        "--cache-admit-hits",
        "3",
    ]);
    assert_eq!(cache(&n, "p")["admit_hits"], 3);
    let text = n.cli_ok(&["pool", "cache", "show", "p"]);
    assert!(text.contains("at its miss number 3"), "{text}");
    n.stop();
    n.restart();
    assert_eq!(cache(&n, "p")["admit_hits"], 3, "kept across a restart");
    // 0 is refused before anything changes; the default is 1.
    let o = n.cli(&["pool", "cache", "add", "q", "ram:48M", "--admit-hits", "0"]);
    assert!(!o.status.success(), "{}", combined(&o));
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    n.cli_ok(&["pool", "cache", "add", "p", &format!("{d}/c1.img:48M")]);
    assert_eq!(cache(&n, "p")["admit_hits"], 1);
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    let c2 = format!("{d}/c2.img:48M");
    n.cli_ok(&["pool", "cache", "add", "p", &c2, "--admit-hits", "2"]);
    assert_eq!(cache(&n, "p")["admit_hits"], 2);
}
