//! The etcd client and membership against a real etcd (started by the test).

use std::time::{Duration, Instant};

use tessera_cluster::{
    node_key, Etcd, EtcdError, EtcdOptions, Membership, MembershipConfig, NodeRecord, PoolRecord,
    PrefixCache, Secret, WatchEvent,
};
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

#[test]
fn watch_follows_a_prefix_resumes_and_relists_after_compaction() {
    if !require_tool("etcd") {
        return;
    }
    let mut c = EtcdCluster::start("watch", 3);
    let e = client(&c);
    e.put("/w/a", b"1", 0).unwrap();
    let (kvs, rev) = e.list_at("/w/").unwrap();
    assert_eq!(kvs.len(), 1);
    let w = e.watch_prefix("/w/", rev + 1);
    let next = |what: &str| -> WatchEvent {
        loop {
            match w.recv_timeout(Duration::from_secs(10)) {
                Some(WatchEvent::Synced { .. } | WatchEvent::Disconnected) => continue,
                Some(ev) => return ev,
                None => panic!("no watch event ({what})"),
            }
        }
    };
    e.put("/w/b", b"2", 0).unwrap();
    e.put("/other", b"x", 0).unwrap();
    assert!(matches!(next("put b"), WatchEvent::Put(kv) if kv.key == "/w/b" && kv.value == b"2"));
    assert!(e.delete("/w/a").unwrap());
    assert!(matches!(next("delete a"), WatchEvent::Delete { key, .. } if key == "/w/a"));
    // The member the watch uses dies (any of three: kill them in turn, one at a time):
    // it resumes on another one, missing nothing.
    for i in 0..3 {
        c.members[i].kill9();
        e.put(&format!("/w/k{i}"), b"v", 0).unwrap();
        match next("after a member kill") {
            WatchEvent::Put(kv) => assert_eq!(kv.key, format!("/w/k{i}")),
            ev => panic!("unexpected {ev:?}"),
        }
        c.members[i].restart();
        c.wait_ready(Duration::from_secs(30));
    }
    drop(w);
    // A watch from a compacted revision gets the whole prefix instead.
    let (_, now) = e.list_at("/w/").unwrap();
    e.put("/w/c", b"3", 0).unwrap();
    let (raw, rt) = e.raw().unwrap();
    let mut raw2 = raw.clone();
    rt.block_on(async move { raw2.compact(now + 1, None).await })
        .unwrap();
    let w = e.watch_prefix("/w/", rev + 1);
    let mut ev = w.recv_timeout(Duration::from_secs(10));
    while matches!(ev, Some(WatchEvent::Synced { .. })) {
        ev = w.recv_timeout(Duration::from_secs(10));
    }
    match ev {
        Some(WatchEvent::Reset { kvs, .. }) => {
            let keys: Vec<&str> = kvs.iter().map(|k| k.key.as_str()).collect();
            assert_eq!(keys, ["/w/b", "/w/c", "/w/k0", "/w/k1", "/w/k2"]);
        }
        ev => panic!("expected a reset, got {ev:?}"),
    }
    // The cache: one listing, then the watch.
    let cache = PrefixCache::start(&e, "/w/").unwrap();
    assert_eq!(cache.snapshot().unwrap().len(), 5);
    e.put("/w/d", b"4", 0).unwrap();
    e.delete("/w/b").unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let keys: Vec<String> = cache
            .snapshot()
            .unwrap_or_default()
            .into_iter()
            .map(|k| k.key)
            .collect();
        if keys == ["/w/c", "/w/d", "/w/k0", "/w/k1", "/w/k2"] {
            break;
        }
        assert!(Instant::now() < until, "the cache did not follow: {keys:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(raw);
}

fn certs(dir: &std::path::Path, ca_name: &str) {
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/nbd-tls-certs.sh");
    let st = std::process::Command::new("bash")
        .arg(script)
        .arg(dir)
        .arg(ca_name)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
}

fn tls_options(dir: &std::path::Path, client_cert: bool) -> EtcdOptions {
    let mut o = EtcdOptions::new(Duration::from_secs(2));
    o.ca = Some(dir.join("ca-cert.pem"));
    if client_cert {
        o.cert = Some(dir.join("client-cert.pem"));
        o.key = Some(dir.join("client-key.pem"));
    }
    o
}

#[test]
fn tls_with_client_certificates_and_password_auth() {
    if !require_tool("etcd") || !require_tool("openssl") || !require_tool("curl") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    certs(&good, "Tessera etcd test CA");
    let other = tmp.path().join("other");
    certs(&other, "Another CA");
    let c = EtcdCluster::start_tls("tls", 1, &good);
    let eps = c.endpoints();
    assert!(eps[0].starts_with("https://"));

    // The CA and a client certificate: works.
    let e = Etcd::with_options(&eps, tls_options(&good, true)).unwrap();
    e.put("/tessera/v1/x", b"1", 0).unwrap();
    assert_eq!(e.get("/tessera/v1/x").unwrap().unwrap().value, b"1");

    // No client certificate: the server refuses the handshake.
    let e2 = Etcd::with_options(&eps, tls_options(&good, false)).unwrap();
    let err = e2.get("/tessera/v1/x").unwrap_err();
    let text = err.to_string();
    eprintln!("no client certificate: {text}");
    assert!(matches!(err, EtcdError::Unavailable { .. }), "{text}");
    assert!(
        text.contains(&eps[0]) && text.to_lowercase().contains("certificate"),
        "{text}"
    );

    // Trusting another CA: the client refuses the server.
    let e3 = Etcd::with_options(&eps, tls_options(&other, true)).unwrap();
    let text = e3.get("/tessera/v1/x").unwrap_err().to_string();
    eprintln!("another CA: {text}");
    let lower = text.to_lowercase();
    assert!(
        text.contains(&eps[0])
            && (lower.contains("unknownissuer")
                || lower.contains("unknown issuer")
                || lower.contains("certificate")),
        "{text}"
    );

    // Auth: root, a tessera user with a role on Tessera's prefix, then auth on.
    e.enable_auth("rootpw", "tessera", "right-password", "/tessera/")
        .unwrap();
    let auth = |pw: &str| {
        let mut o = tls_options(&good, true);
        o.user = Some("tessera".into());
        o.password = Some(Secret::new(pw));
        Etcd::with_options(&eps, o).unwrap()
    };
    let ok = auth("right-password");
    assert_eq!(ok.get("/tessera/v1/x").unwrap().unwrap().value, b"1");
    assert!(ok.create("/tessera/v1/y", b"2", 0).unwrap());
    // Outside its role's prefix: refused, not retried elsewhere.
    let text = ok.put("/elsewhere", b"z", 0).unwrap_err().to_string();
    assert!(text.contains("permission denied"), "{text}");
    // A wrong password: a clear authentication failure, without the password.
    let err = auth("wrong-password").get("/tessera/v1/x").unwrap_err();
    assert!(err.is_auth_failure(), "{err}");
    let text = err.to_string();
    eprintln!("wrong password: {text}");
    assert!(
        text.contains("authentication failed") && text.contains("tessera"),
        "{text}"
    );
    assert!(!text.contains("wrong-password"), "{text}");
    // No credentials at all on an auth-enabled cluster: refused too.
    let anon = Etcd::with_options(&eps, tls_options(&good, true)).unwrap();
    assert!(anon.get("/tessera/v1/x").is_err());
}
