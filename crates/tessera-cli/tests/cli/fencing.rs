//! Fencing of replicas by ownership epoch, on three real nodes: node-a owns `db` with
//! replicas on node-b and node-c. A claim on node-c by another owner at a newer epoch
//! (what a new owner does after a failover) ends node-a's connections there and admits
//! only the new owner: nothing node-a writes afterwards reaches node-c's replica (read
//! directly), node-a cannot reconnect, older or conflicting claims are refused, and all
//! of it survives node-c's kill -9 and restart.

use crate::common;
use common::*;

use std::time::Duration;

use tessera_http::{request, Endpoint};

const BS: usize = 4096;

fn holder(tag: &str, name: &str) -> TestNode {
    let nvmf = free_port();
    let n = TestNode::start_with_top(
        tag,
        1,
        &format!("name = \"{name}\""),
        &format!("[nvmf]\nlisten = \"127.0.0.1:{nvmf}\"\ndiscovery = \"\"\n"),
    );
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:128M", n.dir.join("p.img").display()),
    ]);
    n
}

fn claim(n: &TestNode, volume: &str, owner: &str, epoch: u64) -> (u16, serde_json::Value) {
    let (status, text) = request(
        &Endpoint::parse(&n.api()),
        "POST",
        &format!("/v1/replicas/{volume}/claim"),
        Some(&serde_json::json!({ "owner": owner, "epoch": epoch })),
    )
    .expect("API reachable");
    (status, serde_json::from_str(&text).unwrap_or_default())
}

fn state_of(a: &TestNode, place: &str) -> serde_json::Value {
    a.json(&["volume", "show", "db"])["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["place"] == place)
        .cloned()
        .unwrap()
}

#[test]
fn a_claim_at_a_newer_epoch_fences_the_old_owner_off_a_replica() {
    let b = holder("fence-b", "node-b");
    let mut c = holder("fence-c", "node-c");
    let nvmf = free_port();
    let a = TestNode::start_with_top(
        "fence-a",
        2,
        "name = \"node-a\"",
        &format!(
            "[[peer]]\nname = \"node-b\"\napi = \"{}\"\n[[peer]]\nname = \"node-c\"\napi = \"{}\"\n\
             [replication]\ntimeout_ms = 2000\nregion_size = \"1M\"\n\
             [nvmf]\nlisten = \"127.0.0.1:{nvmf}\"\ndiscovery = \"\"\n",
            b.api(),
            c.api()
        ),
    );
    a.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:128M", a.dir.join("p.img").display()),
    ]);
    a.cli_ok(&[
        "volume",
        "create",
        "db",
        "--size",
        "16M",
        "--replicas",
        "node-a:p,node-b:p,node-c:p",
    ]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    let blocks = 256;
    let mut model = vec![0u64; blocks];
    let mut cl = nbd_connect(&a, "db");
    write_generations(&mut cl, &mut model, 0..blocks, 1, BS);
    c.cli_ok(&[
        "export",
        "add",
        "replica",
        "--volume",
        "db.node-a",
        "--read-only",
    ]);
    verify_generations(&c, "replica", &model, BS);
    let before = model.clone();

    // Bad claims change nothing.
    assert_eq!(claim(&c, "nope", "node-b", 2).0, 404);
    let (s, v) = claim(&c, "db.node-a", "node-b", 0);
    assert_eq!(s, 400, "{v}");

    // node-b claims node-c's replica at epoch 2: node-a's controller there is ended.
    let (s, v) = claim(&c, "db.node-a", "node-b", 2);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["epoch"], 2);
    assert!(
        v["evicted"].as_u64().unwrap() >= 1,
        "node-a was connected: {v}"
    );

    // node-a, not knowing, goes on writing: its client sees no error (node-b and its own
    // replica take the writes), node-c is dropped, and none of it reaches node-c.
    write_generations(&mut cl, &mut model, 0..blocks, 2, BS);
    wait_for("node-c dropped by the old owner", 20, || {
        state_of(&a, "node-c:p")["state"] != "in_sync"
    });
    verify_generations(&a, "db", &model, BS);
    verify_generations(&c, "replica", &before, BS);

    // Older or conflicting claims are refused; the same claim again is idempotent.
    let (s, v) = claim(&c, "db.node-a", "node-a", 1);
    assert_eq!(s, 409, "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("fenced at epoch 2"),
        "{v}"
    );
    assert_eq!(claim(&c, "db.node-a", "node-x", 2).0, 409);
    let (s, v) = claim(&c, "db.node-a", "node-b", 2);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["evicted"], 0);

    // node-a cannot get back in: its resync never brings node-c in sync.
    std::thread::sleep(Duration::from_secs(4));
    assert_ne!(state_of(&a, "node-c:p")["state"], "in_sync");
    verify_generations(&c, "replica", &before, BS);

    // The fence survives node-c's crash and restart.
    c.kill9();
    c.restart();
    let (s, v) = claim(&c, "db.node-a", "node-a", 1);
    assert_eq!(s, 409, "after a restart: {v}");
    write_generations(&mut cl, &mut model, 0..blocks, 3, BS);
    std::thread::sleep(Duration::from_secs(4));
    assert_ne!(state_of(&a, "node-c:p")["state"], "in_sync");
    verify_generations(&c, "replica", &before, BS);
    verify_generations(&a, "db", &model, BS);
    b.cli_ok(&[
        "export",
        "add",
        "replica",
        "--volume",
        "db.node-a",
        "--read-only",
    ]);
    verify_generations(&b, "replica", &model, BS);
}
