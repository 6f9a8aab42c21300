//! A cluster on a real etcd (started by the test) and three real nodes on loopback.
//!
//! - Nodes register under a lease with their labels and pools; `tessera cluster nodes`
//!   on any node lists them all; a killed node leaves the list when its lease expires.
//! - `volume create --replicas 2` with no node names: placement puts the second replica
//!   in another zone than the owner even when a node of the owner's zone has more room,
//!   writes the spec (owner, epoch 1, replicas) to etcd, and a second node cannot create
//!   the same name. The volume is a working replicated volume (written through NBD, the
//!   placed replica holds the data); adding and removing a replica updates the spec.
//! - etcd stopped entirely: the volume keeps serving I/O; cluster reads fail clearly;
//!   etcd back, the members are listed again.
//! - A node whose `[cluster]` names an unreachable etcd refuses to start, saying why.

use crate::common;
use common::*;

use std::time::Duration;

use tessera_testkit::etcd::EtcdCluster;

const MIB: u64 = 1 << 20;

fn member(tag: &str, name: &str, zone: &str, etcd: &EtcdCluster, pool_mib: u64) -> TestNode {
    cluster_member(tag, name, zone, etcd, pool_mib, "")
}

fn node_names(n: &TestNode) -> Vec<String> {
    n.json(&["cluster", "nodes"])
        .as_array()
        .expect("a list of nodes")
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect()
}

/// Every member lists every member with its pool published.
fn all_listed_with_pools(n: &TestNode, names: &[&str]) -> bool {
    let v = n.json(&["cluster", "nodes"]);
    let list = v.as_array().unwrap();
    names.iter().all(|want| {
        list.iter()
            .any(|r| r["name"] == *want && r["pools"].as_array().is_some_and(|p| !p.is_empty()))
    })
}

#[test]
fn members_placement_specs_and_etcd_outage() {
    if !require_tool("etcd") {
        return;
    }
    let mut etcd = EtcdCluster::start("cl", 1);
    // node-b shares node-a's zone and has the most room: a zone-blind placement would
    // pick it.
    let a = member("cl-a", "node-a", "z1", &etcd, 256);
    let b = member("cl-b", "node-b", "z1", &etcd, 1024);
    let mut c = member("cl-c", "node-c", "z2", &etcd, 512);
    wait_for("every member listed with its pool", 20, || {
        all_listed_with_pools(&b, &["node-a", "node-b", "node-c"])
    });
    let nodes = a.json(&["cluster", "nodes"]);
    let rec_c = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "node-c")
        .unwrap()
        .clone();
    assert_eq!(rec_c["labels"]["zone"], "z2");
    assert!(rec_c["nvmf"].as_str().unwrap().starts_with("127.0.0.1:"));
    assert!(rec_c["api"].as_str().unwrap().starts_with("unix:"));

    // Placement: owner + the emptiest node of another zone.
    let v = a.json(&["volume", "create", "db", "--size", "64M", "--replicas", "2"]);
    let places: Vec<String> = v["replicas"]
        .as_array()
        .expect("replicated")
        .iter()
        .map(|r| r["place"].as_str().unwrap().to_string())
        .collect();
    // (The owner shows its own replica as `local`.)
    assert_eq!(places, ["local:p", "node-c:p"], "placed across zones");
    let vols = b.json(&["cluster", "volumes"]);
    let spec = &vols.as_array().unwrap()[0];
    assert_eq!(spec["name"], "db");
    assert_eq!(spec["owner"], "node-a");
    assert_eq!(spec["epoch"], 1);
    assert_eq!(spec["size"], 64 * MIB);
    assert_eq!(
        spec["replicas"],
        serde_json::json!(["node-a:p", "node-c:p"])
    );
    // The name is taken cluster-wide, and impossible placements are refused clearly;
    // neither leaves anything behind.
    let out = b.cli(&["volume", "create", "db", "--size", "64M", "--replicas", "2"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("already exists in the cluster"),
        "{err}"
    );
    let out = a.cli(&[
        "volume",
        "create",
        "big",
        "--size",
        "64M",
        "--replicas",
        "4",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("4 replicas need 4 live nodes"),
        "{err}"
    );
    assert_eq!(b.json(&["cluster", "volumes"]).as_array().unwrap().len(), 1);
    assert!(b.json(&["volume", "list"]).as_array().unwrap().is_empty());

    // It is a working replicated volume: written through NBD on the owner, which
    // serves it under its name as soon as it is created (issue 21: it answered "no
    // export named 'db'" until `export add`), the placed replica on node-c holds the data.
    let mut cl = nbd_connect(&a, "db");
    let mut model = vec![0u64; 256];
    write_generations(&mut cl, &mut model, 0..256, 1, 4096);
    c.cli_ok(&["export", "add", "replica", "--volume", "db", "--read-only"]);
    verify_generations(&c, "replica", &model, 4096);

    // Adding and removing a replica keeps the spec's list true (owner and epoch kept).
    let spec_replicas = |n: &TestNode| -> serde_json::Value {
        n.json(&["cluster", "volumes"]).as_array().unwrap()[0]["replicas"].clone()
    };
    a.cli_ok(&["volume", "replica", "add", "db", "node-b:p"]);
    assert_eq!(
        spec_replicas(&c),
        serde_json::json!(["node-a:p", "node-c:p", "node-b:p"])
    );
    wait_for("node-b in sync", 30, || {
        a.json(&["volume", "show", "db"])["replicas"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["state"] == "in_sync")
    });
    a.cli_ok(&["volume", "replica", "remove", "db", "node-b:p"]);
    assert_eq!(
        spec_replicas(&b),
        serde_json::json!(["node-a:p", "node-c:p"])
    );
    assert_eq!(
        b.json(&["cluster", "volumes"]).as_array().unwrap()[0]["epoch"],
        1
    );

    // etcd stops entirely: the volume keeps serving I/O; cluster reads fail clearly.
    etcd.members[0].kill9();
    write_generations(&mut cl, &mut model, 0..256, 2, 4096);
    verify_generations(&a, "db", &model, 4096);
    let out = a.cli(&["cluster", "nodes"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no etcd member answered"),
        "{err}"
    );
    // Writes go on past the lease TTL without etcd.
    std::thread::sleep(Duration::from_secs(3));
    write_generations(&mut cl, &mut model, 0..256, 3, 4096);
    verify_generations(&c, "replica", &model, 4096);
    // etcd back: every member is listed again (re-registered if its lease expired).
    etcd.members[0].restart();
    etcd.wait_ready(Duration::from_secs(30));
    wait_for("members back after the etcd outage", 30, || {
        a.cli(&["cluster", "nodes"]).status.success()
            && all_listed_with_pools(&a, &["node-a", "node-b", "node-c"])
    });

    // A killed node leaves the list when its lease expires (2 s TTL).
    c.kill9();
    wait_for("node-c gone from the cluster", 20, || {
        !node_names(&b).contains(&"node-c".to_string())
    });
    assert_eq!(node_names(&b), ["node-a", "node-b"]);
    drop(cl);
}

/// Write `config` to the node's config file, run `tessera node` with it to its exit, and
/// give whether it succeeded and what it printed on stderr.
fn run_node_with(cfg: &std::path::Path, config: &str) -> (bool, String) {
    std::fs::write(cfg, config).unwrap();
    let out = std::process::Command::new(BIN)
        .args(["node", "--config", cfg.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run tessera node");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_node_that_cannot_reach_its_etcd_refuses_to_start() {
    let dir = temp_dir("cl-noetcd");
    let cfg = dir.path().join("tessera.toml");
    let data = dir.path().join("data");
    let dead = free_port();
    let (ok, err) = run_node_with(
        &cfg,
        &format!(
            "name = \"lonely\"\ndata_dir = \"{}\"\ncores = 1\n[nbd]\nlisten = [\"127.0.0.1:{}\"]\n\
             [nvmf]\nenabled = false\n[cluster]\netcd = [\"http://127.0.0.1:{dead}\"]\netcd_timeout_ms = 500\n",
            data.display(),
            free_port()
        ),
    );
    assert!(!ok, "started without its etcd");
    assert!(
        err.contains("cannot join the cluster") && err.contains(&dead.to_string()),
        "{err}"
    );
    // A bad endpoint is a configuration error.
    let with_endpoint = |endpoint: &str| {
        format!(
            "data_dir = \"{}\"\n[nvmf]\nenabled = false\n[cluster]\netcd = [\"{endpoint}\"]\n",
            data.display()
        )
    };
    let (ok, err) = run_node_with(&cfg, &with_endpoint("https://x:1"));
    // (https:// is supported since the gRPC client: without the CA it is refused.)
    assert!(
        !ok && err.contains("https:// etcd endpoints need etcd_ca"),
        "{err}"
    );
    // An endpoint of no known scheme is refused too.
    let (ok, err) = run_node_with(&cfg, &with_endpoint("ftp://x:1"));
    assert!(
        !ok && err.contains("expected http://HOST:PORT or https://HOST:PORT"),
        "{err}"
    );
}
