//! The catalog (pools, volumes, exports), flushed data, a volume's delete and a pool's
//! destroy survive a SIGKILL of the node process. The same over a clean stop, and the
//! refusals of deletes and destroys that would lose data, are tested in process, in
//! `crates/tessera-node/tests/node/restart_persistence.rs`.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};

const MIB: u64 = 1 << 20;

/// Project a list from the API onto the fields that must survive a restart, keyed by name.
fn project(list: &Value, fields: &[&str]) -> Vec<Value> {
    let mut v: Vec<Value> = list
        .as_array()
        .expect("a JSON list")
        .iter()
        .map(|x| {
            let mut m = serde_json::Map::new();
            for f in fields {
                m.insert(f.to_string(), x.get(*f).cloned().unwrap_or(Value::Null));
            }
            Value::Object(m)
        })
        .collect();
    v.sort_by_key(|x| x["name"].as_str().unwrap_or("").to_string());
    v
}

const POOL_FIELDS: &[&str] = &[
    "name",
    "state",
    "uuid",
    "layout",
    "stripe_size",
    "devices",
    "unit_size",
    "capacity",
    "allocated",
    "metadata",
    "volumes",
];
const VOLUME_FIELDS: &[&str] = &[
    "name",
    "pool",
    "id",
    "size",
    "allocated",
    "exports",
    "created",
];
const EXPORT_FIELDS: &[&str] = &["name", "volume", "read_only", "size"];

#[derive(Debug, PartialEq)]
struct Catalog {
    pools: Vec<Value>,
    volumes: Vec<Value>,
    exports: Vec<Value>,
}

fn catalog(n: &TestNode) -> Catalog {
    Catalog {
        pools: project(&n.json(&["pool", "list"]), POOL_FIELDS),
        volumes: project(&n.json(&["volume", "list"]), VOLUME_FIELDS),
        exports: project(&n.json(&["export", "list"]), EXPORT_FIELDS),
    }
}

fn assert_same_catalog(before: &Catalog, after: &Catalog, when: &str) {
    assert_eq!(before.pools, after.pools, "{when}: pool list differs");
    assert_eq!(before.volumes, after.volumes, "{when}: volume list differs");
    assert_eq!(before.exports, after.exports, "{when}: export list differs");
}

fn connect(n: &TestNode, export: &str) -> NbdClient {
    NbdClient::connect_tcp(&n.addr(), export, ClientOptions::default())
        .unwrap_or_else(|e| panic!("connect to export {export}: {e}"))
}

/// What was written where: (export, offset, length, seed).
type Written = Vec<(&'static str, u64, usize, u64)>;

fn write_all(n: &TestNode, w: &Written) {
    let mut by_export: std::collections::BTreeMap<&str, Vec<(u64, usize, u64)>> =
        Default::default();
    for &(e, off, len, seed) in w {
        by_export.entry(e).or_default().push((off, len, seed));
    }
    for (e, items) in by_export {
        let mut c = connect(n, e);
        for (off, len, seed) in items {
            c.write(off, &pattern(seed, len), false)
                .unwrap_or_else(|err| panic!("write {len} at {off} to {e}: {err}"));
        }
        c.flush().unwrap_or_else(|err| panic!("flush {e}: {err}"));
        c.disconnect().unwrap();
    }
}

fn verify_all(n: &TestNode, w: &Written, when: &str) {
    for &(e, off, len, seed) in w {
        let mut c = connect(n, e);
        let mut b = vec![0u8; len];
        c.read(off, &mut b)
            .unwrap_or_else(|err| panic!("{when}: read {len} at {off} from {e}: {err}"));
        assert!(
            b == pattern(seed, len),
            "{when}: export {e} offset {off}: data differs from what was written and flushed"
        );
    }
}

fn export_size(n: &TestNode, export: &str) -> u64 {
    connect(n, export).size()
}

fn pool_allocated(n: &TestNode, pool: &str) -> u64 {
    let v = n.json(&["pool", "list"]);
    v.as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == pool)
        .unwrap_or_else(|| panic!("pool {pool} not listed: {v}"))["allocated"]
        .as_u64()
        .unwrap()
}

fn names(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn catalog_and_data_survive_kill9() {
    let mut n = TestNode::start_default("persist");
    let dir = n.dir.clone();
    let p1 = format!("{}:256M", dir.join("p1.img").display());
    let p2a = format!("{}:128M", dir.join("p2a.img").display());
    let p2b = format!("{}:128M", dir.join("p2b.img").display());
    n.cli_ok(&["pool", "create", "p1", &p1]);
    n.cli_ok(&[
        "pool",
        "create",
        "p2",
        &p2a,
        &p2b,
        "--layout",
        "raid0",
        "--stripe-size",
        "64K",
    ]);
    n.cli_ok(&["volume", "create", "va", "--pool", "pool0", "--size", "64M"]);
    n.cli_ok(&["volume", "create", "vb", "--pool", "p1", "--size", "100M"]);
    n.cli_ok(&["volume", "create", "vc", "--pool", "p2", "--size", "128M"]);
    n.cli_ok(&["export", "add", "ea", "--volume", "va"]);
    n.cli_ok(&["export", "add", "eb-rw", "--volume", "vb"]);
    n.cli_ok(&["export", "add", "ec", "--volume", "vc"]);

    // Data on every pool, across raid0 stripes and unit boundaries.
    let mut w: Written = vec![
        ("vol0", 0, 4096, 1),
        ("vol0", 3 * MIB - 8192, 64 * 1024, 2),
        ("ea", 0, 1024 * 1024, 3),
        ("ea", 63 * MIB, 512 * 1024, 4),
        ("eb-rw", 5 * MIB + 512, 70 * 1024, 5),
        ("ec", 0, 256 * 1024, 6),
        ("ec", 100 * MIB - 4096, 3 * 64 * 1024, 7),
    ];
    write_all(&n, &w);

    // vb becomes read-only: remove its writable export, add a read-only one.
    n.cli_ok(&["export", "remove", "eb-rw"]);
    n.cli_ok(&["export", "add", "eb", "--volume", "vb", "--read-only"]);
    for x in w.iter_mut() {
        if x.0 == "eb-rw" {
            x.0 = "eb";
        }
    }
    // Grow vc and write in the new space.
    n.cli_ok(&["volume", "resize", "vc", "--size", "192M"]);
    assert_eq!(export_size(&n, "ec"), 192 * MIB);
    w.push(("ec", 160 * MIB, 128 * 1024, 8));
    write_all(&n, &w[w.len() - 1..].to_vec());
    verify_all(&n, &w, "before the kills");

    // More changes, then SIGKILL: catalog changes are durable once the CLI returns, data
    // once flushed.
    n.cli_ok(&["volume", "create", "vd", "--pool", "p1", "--size", "32M"]);
    n.cli_ok(&["export", "add", "ed", "--volume", "vd", "--read-only"]);
    n.cli_ok(&["volume", "resize", "va", "--size", "96M"]);
    n.cli_ok(&["export", "remove", "ec"]);
    n.cli_ok(&["export", "add", "ec2", "--volume", "vc"]);
    for x in w.iter_mut() {
        if x.0 == "ec" {
            x.0 = "ec2";
        }
    }
    let more: Written = vec![
        ("ea", 90 * MIB, 64 * 1024, 9),
        ("ec2", 10 * MIB, 4096, 10),
        ("vol0", 2 * MIB, 8192, 11),
    ];
    write_all(&n, &more);
    w.extend(more);
    let before = catalog(&n);
    assert_eq!(before.volumes.len(), 5);
    assert_eq!(names(&n.json(&["export", "list"])).len(), 5);
    n.kill9();
    n.restart();
    let after = catalog(&n);
    assert_same_catalog(&before, &after, "after SIGKILL + restart");
    verify_all(&n, &w, "after SIGKILL + restart");
    assert_eq!(export_size(&n, "ea"), 96 * MIB);
    assert!(
        NbdClient::connect_tcp(&n.addr(), "ec", ClientOptions::default()).is_err(),
        "removed export ec is back after restart"
    );

    // A catalog change right before SIGKILL, with no commit in between.
    n.cli_ok(&["volume", "create", "ve", "--pool", "p2", "--size", "16M"]);
    n.cli_ok(&["export", "add", "ee", "--volume", "ve"]);
    let before = catalog(&n);
    n.kill9();
    n.restart();
    assert_same_catalog(&before, &catalog(&n), "after create + SIGKILL + restart");
    verify_all(&n, &w, "after second SIGKILL + restart");
    assert!(n.is_running());
}

#[test]
fn a_volume_delete_survives_kill9() {
    let mut n = TestNode::start_default("persist-del");
    n.cli_ok(&[
        "volume", "create", "vx", "--pool", "pool0", "--size", "256M",
    ]);
    n.cli_ok(&["export", "add", "ex", "--volume", "vx"]);
    let base = pool_allocated(&n, "pool0");
    let mut c = connect(&n, "ex");
    for i in 0..8u64 {
        c.write(i * 16 * MIB, &pattern(i, MIB as usize), false)
            .unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    n.cli_ok(&["export", "remove", "ex"]);
    n.cli_ok(&["volume", "delete", "vx"]);

    // The freed space is reused, and the deletion survives a SIGKILL.
    n.cli_ok(&["volume", "create", "vy", "--pool", "pool0", "--size", "64M"]);
    n.cli_ok(&["export", "add", "ey", "--volume", "vy"]);
    let mut c = connect(&n, "ey");
    c.write(0, &pattern(7, 4096), false).unwrap();
    c.flush().unwrap();
    drop(c);
    n.kill9();
    n.restart();
    let vols = names(&n.json(&["volume", "list"]));
    assert!(
        !vols.contains(&"vx".to_string()) && vols.contains(&"vy".to_string()),
        "{vols:?}"
    );
    assert_eq!(pool_allocated(&n, "pool0"), base + MIB);
    assert!(n.is_running());
}

#[test]
fn a_pool_destroy_survives_kill9() {
    let mut n = TestNode::start_default("persist-destroy");
    let pk = format!("{}:64M", n.dir.join("pk.img").display());
    n.cli_ok(&["pool", "create", "pk", &pk, "--layout", "concat"]);
    n.cli_ok(&["volume", "create", "vk", "--pool", "pk", "--size", "32M"]);
    n.cli_ok(&["volume", "delete", "vk"]);
    n.cli_ok(&["pool", "destroy", "pk"]);
    n.kill9();
    n.restart();
    let pools = n.json(&["pool", "list"]);
    assert_eq!(
        names(&pools),
        vec!["pool0".to_string()],
        "after destroy + SIGKILL + restart: {pools}"
    );
    let st = n.json(&["status"]);
    assert_eq!(st["pools"].as_array().map(|p| p.len()), Some(1), "{st}");
    assert!(n.is_running());
}
