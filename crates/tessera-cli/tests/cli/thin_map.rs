//! A thin volume's map costs memory in proportion to the space written, not to the
//! virtual size: a 1 PiB volume on a 2 GiB file pool (accepted only with --force beyond
//! the default overcommit ratio), 1 GiB written, and the node process's RSS stays small,
//! before and after a restart. `pool create --overcommit` and `pool update --overcommit`
//! as a user types them are checked here too; what the ratio allows and refuses, and its
//! persistence, are tested in process, in `crates/tessera-node/tests/node/thin_map.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nbd::proto;

const MIB: u64 = 1 << 20;
const PIB: u64 = 1 << 50;
/// Scattered 1 MiB writes: each in a map leaf of its own.
const SCATTERED: u64 = 512;

/// What the test writes: 512 MiB from offset 0, and 512 single units spread over the
/// whole petabyte (so 513 map leaves).
fn writes() -> Vec<(u64, usize, u64)> {
    let mut w: Vec<(u64, usize, u64)> = (0..128)
        .map(|i| (i * 4 * MIB, 4 * MIB as usize, i))
        .collect();
    for k in 1..=SCATTERED {
        w.push((
            k * (PIB / (SCATTERED + 1)) / MIB * MIB,
            MIB as usize,
            1000 + k,
        ));
    }
    w
}

fn connect(n: &TestNode) -> NbdClient {
    NbdClient::connect_tcp(&n.addr(), "big", ClientOptions::default()).unwrap()
}

fn verify(n: &TestNode, when: &str) {
    let mut c = connect(n);
    let mut buf = vec![0u8; 4 * MIB as usize];
    for (off, len, seed) in writes() {
        c.read(off, &mut buf[..len]).unwrap();
        assert!(
            buf[..len] == pattern(seed, len)[..],
            "{when}: data at {off} differs from what was written"
        );
    }
    // Never written: zeros, and block status calls it a hole, far out in the volume.
    // A block-aligned offset (the test client negotiates 512-byte blocks).
    let far = (PIB / 3 + 5 * MIB) & !4095;
    c.read(far, &mut buf[..65536]).unwrap();
    assert!(
        buf[..65536].iter().all(|&b| b == 0),
        "{when}: hole at {far}"
    );
    let ext = c.block_status(512 * MIB, u32::MAX - 511, false).unwrap();
    assert_ne!(ext[0].1 & proto::STATE_HOLE, 0, "{when}: {ext:?}");
    let (off, _, _) = writes()[128];
    let ext = c.block_status(off, MIB as u32, false).unwrap();
    assert_eq!(ext[0], (MIB as u32, 0), "{when}: block status at {off}");
    c.disconnect().unwrap();
}

fn pool_status(n: &TestNode) -> Value {
    n.json(&["pool", "status", "p"])
}

#[test]
fn petabyte_volume_costs_memory_by_allocation() {
    let mut n = TestNode::start_with_config("thin-map", "");
    let img = format!("{}:2G", path_str(&n.dir.join("p.img")));
    n.cli_ok(&["pool", "create", "p", &img]);
    let cap = pool_status(&n)["capacity"].as_u64().unwrap();
    // A ratio chosen at creation; a bad one creates nothing.
    let q = format!("{}:256M", path_str(&n.dir.join("q.img")));
    n.cli_ok(&["pool", "create", "q", &q, "--overcommit", "2.5"]);
    assert_eq!(
        n.json(&["pool", "status", "q"])["overcommit"].as_f64(),
        Some(2.5)
    );
    let bad = format!("{}:256M", path_str(&n.dir.join("bad.img")));
    let o = n.cli(&["pool", "create", "bad", &bad, "--overcommit", "0"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("overcommit ratio"));
    assert!(!n.cli(&["pool", "status", "bad"]).status.success());
    let base = vm_rss(n.pid());

    // Beyond 20x the capacity: refused, saying the figures and how to go on.
    let o = n.cli(&["volume", "create", "big", "--pool", "p", "--size", "1P"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "1 PiB on a 2 GiB pool was accepted");
    assert!(
        err.contains("20x") && err.contains("--force") && err.contains("1.0 PiB"),
        "{err}"
    );
    assert!(n.json(&["volume", "list"]).as_array().unwrap().is_empty());

    n.cli_ok(&[
        "volume", "create", "big", "--pool", "p", "--size", "1P", "--force",
    ]);
    n.cli_ok(&["export", "add", "big", "--volume", "big"]);
    let after_create = vm_rss(n.pid());

    let mut c = connect(&n);
    assert_eq!(c.size(), PIB);
    for (off, len, seed) in writes() {
        c.write(off, &pattern(seed, len), false).unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    let written: u64 = writes().iter().map(|w| w.1 as u64).sum();
    assert_eq!(written, 1 << 30);
    let vol = n.json(&["volume", "list"])[0].clone();
    assert_eq!(vol["allocated"].as_u64(), Some(written), "{vol}");
    assert!(cap >= written);
    verify(&n, "after writing");

    let grown = vm_rss(n.pid());
    eprintln!(
        "RSS: empty pool {} KiB, 1 PiB volume created {} KiB, 1 GiB written {} KiB",
        base >> 10,
        after_create >> 10,
        grown >> 10
    );
    // A flat map would be 4 GiB at creation. What is left: 2 MiB of top-level array,
    // 513 leaves of 16 KiB, and the I/O buffers of the connection.
    assert!(
        after_create - base.min(after_create) < 16 * MIB,
        "a 1 PiB volume grew the RSS from {base} to {after_create}"
    );
    assert!(
        grown - base.min(grown) < 64 * MIB,
        "1 GiB written to a 1 PiB volume grew the RSS from {base} to {grown}"
    );

    // `pool update --overcommit`, and a resize it allows; the data survives a restart.
    n.cli_ok(&["pool", "update", "p", "--overcommit", "600000"]);
    n.cli_ok(&["volume", "resize", "big", "--size", "1025T"]);
    n.stop();
    n.restart();
    assert_eq!(pool_status(&n)["overcommit"].as_f64(), Some(600000.0));
    verify(&n, "after a restart");
    let restarted = vm_rss(n.pid());
    eprintln!("RSS after the restart: {} KiB", restarted >> 10);
    assert!(
        restarted < base + 64 * MIB,
        "after a restart the node holds {restarted} bytes (empty pool: {base})"
    );
}
