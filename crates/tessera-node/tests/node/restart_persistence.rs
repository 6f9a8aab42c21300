//! The catalog (pools, volumes, exports) and flushed data survive a clean stop and a
//! start of a node in this process on the same data directory; management operations
//! refuse what would lose data (with the errors the API answers 409 and 404 for, the
//! CLI's exit codes 4 and 3) and give space back. (Moved from
//! `crates/tessera-cli/tests/cli/restart_persistence.rs`, which keeps the same catalog,
//! deletes and destroys surviving a SIGKILL of the node process.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_node::api::status_of;

const MIB: u64 = 1 << 20;

/// The HTTP statuses the API answers a refusal with: the CLI exits with 3 for 404 and 4
/// for 409 (`tessera --help`).
const NOT_FOUND: u16 = 404;
const CONFLICT: u16 = 409;

/// `r` failed with the API status `code`; returns the error's message.
fn refused<T: std::fmt::Debug>(r: tessera_node::error::Result<T>, code: u16, what: &str) -> String {
    let e = r.expect_err(what);
    assert_eq!(status_of(&e), code, "{what}: {e}");
    e.to_string()
}

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

/// What `GET /v1/exports` answers (`tessera --json export list`).
fn exports_json(n: &TestNode) -> Value {
    let node = n.node();
    json(node.exports().list(&node.pools().list()))
}

fn catalog(n: &TestNode) -> Catalog {
    Catalog {
        pools: project(&n.pools_json(), POOL_FIELDS),
        volumes: project(&n.volumes_json(), VOLUME_FIELDS),
        exports: project(&exports_json(n), EXPORT_FIELDS),
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

/// Wait until no connection holds `volume` open (disconnects are processed asynchronously).
fn wait_no_connections(n: &TestNode, volume: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let v = n.volumes_json();
        let c = v
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == volume)
            .map(|x| x["connections"].as_u64().unwrap_or(0));
        if c == Some(0) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "volume {volume} still has {c:?} connections 5 s after every client disconnected"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn pool_allocated(n: &TestNode, pool: &str) -> u64 {
    let v = n.pools_json();
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

/// `tessera volume create NAME --pool POOL --size SIZE`.
fn volume(n: &TestNode, name: &str, pool: &str, size: u64) {
    n.node()
        .create_volume(name, pool, size, false)
        .unwrap_or_else(|e| panic!("create volume {name}: {e}"));
}

/// `tessera export add NAME --volume VOL [--read-only]`.
fn export(n: &TestNode, name: &str, vol: &str, read_only: bool) {
    n.node()
        .add_export(name, vol, read_only, None)
        .unwrap_or_else(|e| panic!("export {vol} as {name}: {e}"));
}

#[test]
fn catalog_and_data_survive_a_clean_restart() {
    let mut n = TestNode::up("persist");
    n.create_pool("p1", "concat", &[n.file_dev("p1.img", "256M")]);
    // `pool create p2 A B --layout raid0 --stripe-size 64K`.
    n.node()
        .create_pool(
            "p2",
            &[n.file_dev("p2a.img", "128M"), n.file_dev("p2b.img", "128M")],
            "raid0".parse().expect("layout"),
            Some(64 * 1024),
            None,
            false,
        )
        .expect("create p2");
    let pools = n.pools_json();
    let p2 = pools
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "p2")
        .expect("p2 listed");
    assert_eq!(p2["layout"], "raid0");
    assert_eq!(p2["stripe_size"], 64 * 1024);
    assert_eq!(p2["devices"].as_array().map(|d| d.len()), Some(2));

    volume(&n, "va", "pool0", 64 * MIB);
    volume(&n, "vb", "p1", 100 * MIB);
    volume(&n, "vc", "p2", 128 * MIB);
    export(&n, "ea", "va", false);
    export(&n, "eb-rw", "vb", false);
    export(&n, "ec", "vc", false);

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
    n.node().remove_export("eb-rw").unwrap();
    export(&n, "eb", "vb", true);
    for x in w.iter_mut() {
        if x.0 == "eb-rw" {
            x.0 = "eb";
        }
    }
    let mut ro = connect(&n, "eb");
    let err = ro
        .write(0, &[1u8; 4096], false)
        .expect_err("write to a read-only export succeeded");
    assert_eq!(
        err.raw_os_error(),
        Some(libc::EPERM),
        "write to a read-only export: {err}"
    );
    drop(ro);

    // Grow vc and write in the new space.
    n.node()
        .resize_volume("vc", 192 * MIB, false)
        .expect("resize vc");
    assert_eq!(export_size(&n, "ec"), 192 * MIB);
    w.push(("ec", 160 * MIB, 128 * 1024, 8));
    write_all(&n, &w[w.len() - 1..].to_vec());
    verify_all(&n, &w, "before restart");

    // Clean stop (what `tessera run` does on SIGTERM) and start again.
    let before = catalog(&n);
    assert_eq!(before.pools.len(), 3, "{:?}", before.pools);
    assert_eq!(before.volumes.len(), 4, "{:?}", before.volumes);
    assert_eq!(before.exports.len(), 4, "{:?}", before.exports);
    n.restart();
    assert_same_catalog(&before, &catalog(&n), "after a clean stop + restart");
    verify_all(&n, &w, "after a clean stop + restart");
    assert_eq!(export_size(&n, "ec"), 192 * MIB);
    let exports = exports_json(&n);
    let eb = exports
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "eb")
        .unwrap();
    assert_eq!(eb["read_only"], true);
    let mut ro = connect(&n, "eb");
    assert_eq!(
        ro.write(0, &[1u8; 4096], false)
            .expect_err("read-only export writable after restart")
            .raw_os_error(),
        Some(libc::EPERM)
    );
    drop(ro);
}

#[test]
fn deleting_an_exported_volume_fails_and_delete_gives_space_back() {
    let n = TestNode::up("persist-del");
    volume(&n, "vx", "pool0", 256 * MIB);
    export(&n, "ex", "vx", false);
    let base = pool_allocated(&n, "pool0");

    // 8 units' worth of data (plus a partial unit).
    let mut c = connect(&n, "ex");
    for i in 0..8u64 {
        c.write(i * 16 * MIB, &pattern(i, MIB as usize), false)
            .unwrap();
    }
    c.write(200 * MIB + 4096, &pattern(99, 4096), false)
        .unwrap();
    c.flush().unwrap();
    let used = pool_allocated(&n, "pool0");
    assert_eq!(
        used - base,
        9 * MIB,
        "pool0 allocated went from {base} to {used} after writing 9 units"
    );
    let vols = n.volumes_json();
    let vx = vols
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "vx")
        .unwrap();
    assert_eq!(vx["allocated"], 9 * MIB);

    // Exported (and connected): refused, with a message that says why.
    let node = n.node().clone();
    let err = refused(node.delete_volume("vx"), CONFLICT, "delete vx (connected)");
    assert!(
        err.contains("vx")
            && (err.contains("export") || err.contains("busy") || err.contains("connection")),
        "unclear error: {err}"
    );
    c.disconnect().unwrap();
    wait_no_connections(&n, "vx");
    // Exported, no connection: still refused, and the message names the export.
    let err = refused(node.delete_volume("vx"), CONFLICT, "delete vx (exported)");
    assert!(
        err.contains("vx") && err.contains("export"),
        "unclear error: {err}"
    );
    assert!(
        names(&n.volumes_json()).contains(&"vx".to_string()),
        "vx vanished after a refused delete"
    );
    assert_eq!(
        pool_allocated(&n, "pool0"),
        used,
        "a refused delete changed the allocation"
    );

    node.remove_export("ex").unwrap();
    assert!(!names(&exports_json(&n)).contains(&"ex".to_string()));
    node.delete_volume("vx").unwrap();
    assert!(!names(&n.volumes_json()).contains(&"vx".to_string()));
    assert_eq!(
        pool_allocated(&n, "pool0"),
        base,
        "space not given back after volume delete"
    );
    let st = json(node.status());
    assert_eq!(st["allocated"].as_u64(), Some(base));

    // Deleting again: not found, clear error.
    let err = refused(node.delete_volume("vx"), NOT_FOUND, "delete vx again");
    assert!(err.contains("vx"), "{err}");

    // The freed space is reusable: a new volume reads zeros, not the deleted one's data.
    volume(&n, "vy", "pool0", 64 * MIB);
    export(&n, "ey", "vy", false);
    let mut c = connect(&n, "ey");
    let mut b = vec![0u8; MIB as usize];
    c.read(0, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == 0),
        "a new volume shows data of a deleted one"
    );
}

#[test]
fn pool_destroy_refuses_pools_with_volumes_and_stays_destroyed() {
    let mut n = TestNode::up("persist-destroy");
    n.create_pool("pd", "concat", &[n.file_dev("pd.img", "64M")]);
    n.create_pool("pk", "concat", &[n.file_dev("pk.img", "64M")]);
    volume(&n, "vd", "pd", 32 * MIB);
    volume(&n, "vk", "pk", 32 * MIB);

    let node = n.node().clone();
    let err = refused(node.destroy_pool("pd"), CONFLICT, "destroy pd");
    assert!(
        err.contains("pd") && err.contains("volume"),
        "unclear error: {err}"
    );
    assert!(
        names(&n.pools_json()).contains(&"pd".to_string()),
        "pd vanished after a refused destroy"
    );
    assert!(
        names(&n.volumes_json()).contains(&"vd".to_string()),
        "vd vanished after a refused destroy"
    );

    // Destroy pd, then a clean restart.
    node.delete_volume("vd").unwrap();
    node.destroy_pool("pd").unwrap();
    assert!(!names(&n.pools_json()).contains(&"pd".to_string()));
    drop(node);
    n.restart();
    let pools = names(&n.pools_json());
    assert!(
        !pools.contains(&"pd".to_string()),
        "destroyed pool pd is back after restart: {pools:?}"
    );
    assert!(
        pools.contains(&"pk".to_string()) && pools.contains(&"pool0".to_string()),
        "{pools:?}"
    );
    let err = refused(n.node().destroy_pool("pk"), CONFLICT, "destroy pk");
    assert!(err.contains("pk"), "{err}");
    // Destroying a pool that does not exist is an error too.
    let err = refused(n.node().destroy_pool("pd"), NOT_FOUND, "destroy pd again");
    assert!(err.contains("pd"), "{err}");
}
