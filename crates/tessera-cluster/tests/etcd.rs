//! The etcd client and membership against a real etcd (started by the test).

use std::time::{Duration, Instant};

use tessera_cluster::{node_key, Etcd, Membership, MembershipConfig, NodeRecord, PoolRecord};
use tessera_testkit::etcd::EtcdCluster;
use tessera_testkit::node::require_tool;

fn client(c: &EtcdCluster) -> Etcd {
    Etcd::new(&c.endpoints(), Duration::from_secs(2)).unwrap()
}

#[test]
fn keys_compare_and_swap_and_leases() {
    if !require_tool("etcd") {
        return;
    }
    let c = EtcdCluster::start("kv", 1);
    let e = client(&c);
    assert_eq!(e.get("/t/a").unwrap(), None);
    assert!(e.create("/t/a", b"one", 0).unwrap());
    assert!(!e.create("/t/a", b"two", 0).unwrap(), "create-only");
    let kv = e.get("/t/a").unwrap().unwrap();
    assert_eq!(kv.value, b"one");
    assert!(e.swap("/t/a", kv.mod_revision, b"two", 0).unwrap());
    assert!(
        !e.swap("/t/a", kv.mod_revision, b"three", 0).unwrap(),
        "a stale revision loses"
    );
    assert_eq!(e.get("/t/a").unwrap().unwrap().value, b"two");
    e.put("/t/b", b"x", 0).unwrap();
    e.put("/u/c", b"y", 0).unwrap();
    let keys: Vec<String> = e.list("/t/").unwrap().into_iter().map(|k| k.key).collect();
    assert_eq!(keys, ["/t/a", "/t/b"]);
    assert!(e.delete("/t/b").unwrap());
    assert!(!e.delete("/t/b").unwrap());
    // A key under a lease goes when the lease is not renewed.
    let l = e.grant(2).unwrap();
    e.put("/t/leased", b"z", l).unwrap();
    assert_eq!(e.get("/t/leased").unwrap().unwrap().lease, l);
    assert!(e.keepalive(l).unwrap() > 0);
    let gone = Instant::now() + Duration::from_secs(10);
    while e.get("/t/leased").unwrap().is_some() {
        assert!(Instant::now() < gone, "the leased key outlived its lease");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        e.keepalive(l).unwrap(),
        0,
        "an expired lease renews to TTL 0"
    );
    // Writing under a lease that is gone is refused with a clear error.
    let err = e.put("/t/late", b"z", l).unwrap_err().to_string();
    assert!(err.contains("lease"), "{err}");
}

#[test]
fn unreachable_endpoints_give_clear_errors() {
    let port = tessera_testkit::node::free_port();
    let e = Etcd::new(
        &[format!("http://127.0.0.1:{port}")],
        Duration::from_millis(500),
    )
    .unwrap();
    let err = e.get("/x").unwrap_err().to_string();
    assert!(
        err.contains("no etcd member answered") && err.contains(&port.to_string()),
        "{err}"
    );
}

fn record(name: &str, free: u64) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        api: format!("unix:/tmp/{name}.sock"),
        pools: vec![PoolRecord {
            name: "p".into(),
            size: 1 << 30,
            free,
        }],
        ..NodeRecord::default()
    }
}

#[test]
fn membership_survives_a_member_kill_and_vanishes_with_its_lease() {
    if !require_tool("etcd") {
        return;
    }
    let mut c = EtcdCluster::start("members", 3);
    let cfg = MembershipConfig {
        ttl: Duration::from_secs(2),
        publish_every: Duration::from_millis(300),
    };
    let free = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(100));
    let f = free.clone();
    let a = Membership::join(
        client(&c),
        cfg.clone(),
        Box::new(move || record("a", f.load(std::sync::atomic::Ordering::Relaxed))),
    )
    .unwrap();
    let b = Membership::join(client(&c), cfg, Box::new(|| record("b", 7))).unwrap();
    let names = |m: &Membership| -> Vec<String> {
        m.nodes().unwrap().into_iter().map(|n| n.name).collect()
    };
    assert_eq!(names(&a), ["a", "b"]);
    assert!(a.lease_valid_until().is_some());
    // The record follows the node's state.
    free.store(55, std::sync::atomic::Ordering::Relaxed);
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let n = b.nodes().unwrap();
        if n.iter().any(|r| r.name == "a" && r.pools[0].free == 55) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the record was not republished: {n:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // One of three etcd members dies: renewals and reads go on through the others, for
    // longer than the lease TTL.
    c.members[0].kill9();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        names(&b),
        ["a", "b"],
        "leases kept alive with one member down"
    );
    // b leaves cleanly: its record goes at once.
    b.leave();
    assert_eq!(names(&a), ["a"]);
    assert!(b.lease_valid_until().is_none());
    // A stopped renewal (a frozen or killed node): the record goes after the TTL.
    let e = client(&c);
    let l = e.grant(2).unwrap();
    e.put(
        &node_key("ghost"),
        &serde_json::to_vec(&record("ghost", 1)).unwrap(),
        l,
    )
    .unwrap();
    assert_eq!(names(&a), ["a", "ghost"]);
    let until = Instant::now() + Duration::from_secs(10);
    while names(&a).contains(&"ghost".to_string()) {
        assert!(Instant::now() < until, "an unrenewed node stayed listed");
        std::thread::sleep(Duration::from_millis(200));
    }
    a.leave();
}
