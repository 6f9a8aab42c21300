//! Clients follow the volume, NBD side: any node of a cluster answers an NBD client with
//! the owner's export. A real etcd (started by the test) and three real nodes on
//! loopback: node-a owns cluster volume `db` (a local volume exported over NVMe/TCP under
//! the cluster NQN; the test writes its spec to etcd), node-b proxies it, node-c has the
//! proxy turned off.
//!
//! - Through node-b: nbdinfo sees the volume's size and lists it; a pattern nbdcopy
//!   writes reads back through node-a and through node-b; fio (nbd engine, crc32c verify)
//!   writes and verifies through node-b, and a verify-only pass through node-a finds its
//!   data on the owner; two connections share one proxy, which closes when both go;
//!   `/metrics` counts the proxied I/O.
//! - Bad cases: an unknown name through node-b, and through node-c (proxy off), is an
//!   unknown export with a message. Owner killed (-9): a connection through node-b gets
//!   an error within the remote timeout, never data; a new one is refused saying the
//!   owner is gone; once the spec names a new owner (node-c, epoch 2), clients that
//!   reconnect through node-b reach it; node-b serves its own export all along.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_testkit::etcd::EtcdCluster;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
const BS: usize = 4096;

fn member(tag: &str, name: &str, etcd: &EtcdCluster, cluster_extra: &str) -> TestNode {
    let nvmf = free_port();
    let metrics = free_port();
    let n = TestNode::start_with_top(
        tag,
        2,
        &format!("name = \"{name}\""),
        &format!(
            "[nvmf]\nlisten = \"127.0.0.1:{nvmf}\"\ndiscovery = \"\"\n\
             [metrics]\nlisten = \"127.0.0.1:{metrics}\"\n\
             [replication]\ntimeout_ms = 2000\n\
             [cluster]\netcd = {}\nlease_ttl_ms = 2000\n{cluster_extra}\n",
            etcd.toml_endpoints()
        ),
    );
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:256M", n.dir.join("p.img").display()),
    ]);
    n
}

fn metrics_addr(n: &TestNode) -> String {
    let cfg = std::fs::read_to_string(n.config.as_ref().unwrap()).unwrap();
    let at = cfg.find("[metrics]").unwrap();
    let line = cfg[at..].lines().nth(1).unwrap();
    line.split('"').nth(1).unwrap().to_string()
}

fn metrics(n: &TestNode) -> String {
    http_get(&metrics_addr(n), "/metrics")
        .expect("metrics listener")
        .1
}

fn sample(text: &str, series: &str) -> Option<f64> {
    metric_sample(text, series)
}

/// Run `cmd`, killing it after `secs` seconds (every load here stops by itself).
fn run_bounded(cmd: &mut Command, secs: u64) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let end = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "{cmd:?} did not finish in {secs} s:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn combined(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// fio's nbd engine with crc32c verification, over 16 MiB at 32 MiB.
fn fio(n: &TestNode, uri: &str, pass: &str) -> Output {
    let mut c = Command::new("fio");
    c.current_dir(&n.dir)
        .arg("--ioengine=nbd")
        .arg(format!("--uri={uri}"))
        .args([
            "--name=px",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--offset=32M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--randrepeat=1",
        ])
        .arg(pass);
    run_bounded(&mut c, 120)
}

fn assert_fio_clean(what: &str, o: &Output) {
    let text = combined(o);
    assert!(o.status.success(), "{what}: fio failed:\n{text}");
    assert!(
        !text.contains("verify failed") && !text.contains("bad magic"),
        "{what}: fio reported verify failures:\n{text}"
    );
    assert!(text.contains("err= 0"), "{what}: fio errors:\n{text}");
}

fn go_error(n: &TestNode, export: &str) -> String {
    match NbdClient::connect_tcp(&n.addr(), export, ClientOptions::default()) {
        Ok(_) => panic!("export {export:?} was served"),
        Err(e) => e.to_string(),
    }
}

fn count(text: &str, what: &str) -> usize {
    text.matches(what).count()
}

#[test]
fn any_node_serves_the_owners_volume_over_nbd() {
    for tool in ["etcd", "nbdinfo", "nbdcopy", "fio"] {
        if !require_tool(tool) {
            return;
        }
    }
    let etcd = EtcdCluster::start("px", 1);
    let mut a = member("px-a", "node-a", &etcd, "");
    let b = member("px-b", "node-b", &etcd, "");
    let c = member("px-c", "node-c", &etcd, "nbd_proxy = false");
    wait_for("every member listed", 20, || {
        let v = b.json(&["cluster", "nodes"]);
        let names: Vec<&str> = v
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        ["node-a", "node-b", "node-c"]
            .iter()
            .all(|n| names.contains(n))
    });

    // node-a owns `db`: a local volume, exported over NBD (for direct reads) and over
    // NVMe/TCP under the cluster NQN, with its spec in etcd.
    a.cli_ok(&["volume", "create", "db", "--size", "64M", "--pool", "p"]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    let (code, r) = put_path(&a, "db", serde_json::json!({"owner": true}));
    assert_eq!(code, 200, "{r}");
    let spec = tessera_api::ClusterVolume {
        name: "db".into(),
        size: SIZE,
        replicas: vec!["node-a:p".into()],
        owner: "node-a".into(),
        epoch: 1,
        copies: 0,
        out_of_sync: Vec::new(),
        lost: Vec::new(),
        snapshot_intent: None,
        iscsi_pr: None,
    };
    let kv = tessera_cluster::Etcd::new(&etcd.endpoints(), Duration::from_secs(2)).unwrap();
    kv.put(
        &tessera_cluster::volume_key("db"),
        &serde_json::to_vec(&spec).unwrap(),
        0,
    )
    .unwrap();
    // node-b's own export, which must keep serving whatever happens to node-a.
    b.cli_ok(&["volume", "create", "own", "--size", "16M", "--pool", "p"]);
    b.cli_ok(&["export", "add", "own", "--volume", "own"]);
    let mut own_model = vec![0u64; 64];
    let mut own = nbd_connect(&b, "own");
    write_generations(&mut own, &mut own_model, 0..64, 1, BS);

    // The size through node-b, and the listing.
    let size = run_ok(Command::new("nbdinfo").arg("--size").arg(b.uri("db")));
    assert_eq!(size.trim(), SIZE.to_string());
    let listed = NbdClient::list_exports_tcp(&b.addr()).unwrap();
    assert!(
        listed.contains(&"db".to_string()) && listed.contains(&"own".to_string()),
        "{listed:?}"
    );
    assert!(
        !NbdClient::list_exports_tcp(&c.addr())
            .unwrap()
            .contains(&"db".to_string()),
        "node-c has the proxy off"
    );

    // A pattern written through node-b with nbdcopy is on the owner, and reads back
    // through node-b.
    let pattern = pattern(7, (8 * MIB) as usize);
    let src = b.dir.join("pattern.raw");
    std::fs::write(&src, &pattern).unwrap();
    let o = run_bounded(Command::new("nbdcopy").arg(&src).arg(b.uri("db")), 60);
    assert!(o.status.success(), "nbdcopy into node-b: {}", combined(&o));
    let on_a = read_all(&a, "db");
    assert!(
        on_a[..pattern.len()] == pattern[..],
        "node-a's volume lacks the pattern"
    );
    let via_b = read_all(&b, "db");
    assert!(via_b == on_a, "node-b reads what node-a holds");

    // Two connections share one proxy, which closes when both have gone. (The clients
    // above have hung up; their proxies close as the node notices.)
    wait_for("the earlier clients' proxies closed", 10, || {
        let log = b.log_text();
        count(&log, "nbd proxy opened") == count(&log, "nbd proxy closed")
    });
    let opened_before = count(&b.log_text(), "nbd proxy opened");
    let mut c1 = nbd_connect(&b, "db");
    let mut c2 = nbd_connect(&b, "db");
    let mut model = vec![0u64; 256];
    write_generations(&mut c1, &mut model, 0..128, 2, BS);
    write_generations(&mut c2, &mut model, 128..256, 3, BS);
    assert_eq!(
        count(&b.log_text(), "nbd proxy opened"),
        opened_before + 1,
        "one proxy for two connections"
    );
    let closed_before = count(&b.log_text(), "nbd proxy closed");
    c1.disconnect().unwrap();
    c2.disconnect().unwrap();
    wait_for("the proxy closed after its last connection", 10, || {
        count(&b.log_text(), "nbd proxy closed") > closed_before
    });
    verify_generations(&a, "db", &model, BS);

    // fio through node-b; its data verifies on the owner.
    let o = fio(&b, &b.uri("db"), "--do_verify=1");
    assert_fio_clean("fio write+verify through node-b", &o);
    let o = fio(&a, &a.uri("db"), "--verify_only");
    assert_fio_clean("fio verify-only on node-a", &o);
    assert!(combined(&o).contains("READ:"), "{}", combined(&o));

    let m = metrics(&b);
    let writes = sample(&m, "tessera_proxy_ops_total{volume=\"db\",op=\"write\"}")
        .unwrap_or_else(|| panic!("no proxy write count:\n{m}"));
    assert!(writes >= 4096.0, "fio's writes counted: {writes}");
    let proxied = sample(&m, "tessera_proxy_bytes_total{volume=\"db\",op=\"write\"}").unwrap();
    assert!(proxied >= (16 * MIB) as f64, "{proxied}");
    // The owner counts the same writes under its volume (they reach it over NVMe/TCP).
    let on_owner = a.json(&["volume", "stats", "db", "--interval", "0.01"]);
    let owner_writes = on_owner["totals"]["write_bytes"].as_f64().unwrap();
    assert!(
        owner_writes >= proxied,
        "owner {owner_writes} < proxied {proxied}"
    );

    // Unknown names are unknown exports, with a message; node-c does not proxy.
    let e = go_error(&b, "nope");
    assert!(
        e.contains("unknown export") && e.contains("no export named"),
        "{e}"
    );
    let e = go_error(&c, "db");
    assert!(
        e.contains("unknown export") && e.contains("no export named"),
        "{e}"
    );
    let o = run_bounded(Command::new("nbdinfo").arg(b.uri("nope")), 30);
    assert!(!o.status.success(), "nbdinfo of an unknown export");

    // The owner dies under a connection through node-b: its next read fails within
    // the remote timeout (2 s) and its reconnects; it never returns data.
    let mut held = nbd_connect(&b, "db");
    let mut buf = vec![0u8; BS];
    held.read(0, &mut buf).unwrap();
    a.kill9();
    let t = Instant::now();
    let r = held.read(BS as u64, &mut buf);
    assert!(r.is_err(), "a read through a dead owner returned data");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "the error took {:?}",
        t.elapsed()
    );
    drop(held);
    // Once the owner's lease has expired, new clients are refused, saying why.
    wait_for("node-a's record gone", 20, || {
        !b.json(&["cluster", "nodes"])
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["name"] == "node-a")
    });
    let e = go_error(&b, "db");
    assert!(
        e.contains("unknown export") && e.contains("node-a") && e.contains("not a live member"),
        "{e}"
    );

    // A new owner (what a failover does: node-c takes `db` at epoch 2): clients that
    // reconnect through node-b reach it.
    c.cli_ok(&["volume", "create", "db", "--size", "64M", "--pool", "p"]);
    c.cli_ok(&["export", "add", "db", "--volume", "db"]);
    let (code, r) = put_path(&c, "db", serde_json::json!({"owner": true}));
    assert_eq!(code, 200, "{r}");
    let moved = tessera_api::ClusterVolume {
        owner: "node-c".into(),
        epoch: 2,
        replicas: vec!["node-c:p".into()],
        ..spec
    };
    kv.put(
        &tessera_cluster::volume_key("db"),
        &serde_json::to_vec(&moved).unwrap(),
        0,
    )
    .unwrap();
    let mut on_c = vec![0u64; 64];
    let mut cl = nbd_connect(&b, "db");
    write_generations(&mut cl, &mut on_c, 0..64, 5, BS);
    cl.disconnect().unwrap();
    verify_generations(&c, "db", &on_c, BS);
    assert!(
        b.log_text()
            .lines()
            .any(|l| l.contains("nbd proxy opened") && l.contains("node-c")),
        "node-b's proxy goes to the new owner"
    );

    // node-b served its own export throughout.
    write_generations(&mut own, &mut own_model, 0..64, 4, BS);
    verify_generations(&b, "own", &own_model, BS);
}

fn hooks(n: &TestNode) -> u64 {
    let m = metrics(n);
    sample(&m, "tessera_reactor_hooks").unwrap_or_else(|| panic!("no hook count:\n{m}")) as u64
}

/// Connections through a proxy that come and go leave nothing behind on the proxying
/// node: each one opens the proxy (an NVMe/TCP admin queue and an I/O queue per core
/// that serves it) and closes it when it goes. Each I/O queue registers a hook on its
/// core, which kept the queue (about 200 KiB of buffers) for the life of the node.
/// 500 connect/read/disconnect cycles through node-b: the hook count comes back to
/// where it was, and node-b's resident memory grows by far less than 500 queues.
#[test]
fn proxied_connections_that_come_and_go_leave_nothing_behind() {
    const CYCLES: usize = 500;
    const WARM_UP: usize = 50;
    if !require_tool("etcd") {
        return;
    }
    let started = Instant::now();
    let etcd = EtcdCluster::start("pxl", 1);
    let a = member("pxl-a", "node-a", &etcd, "");
    let b = member("pxl-b", "node-b", &etcd, "");
    wait_for("both members listed", 20, || {
        let v = b.json(&["cluster", "nodes"]);
        let names: Vec<&str> = v
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["name"].as_str())
            .collect();
        names.contains(&"node-a") && names.contains(&"node-b")
    });
    a.cli_ok(&["volume", "create", "db", "--size", "64M", "--pool", "p"]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    let (code, r) = put_path(&a, "db", serde_json::json!({"owner": true}));
    assert_eq!(code, 200, "{r}");
    let spec = tessera_api::ClusterVolume {
        name: "db".into(),
        size: SIZE,
        replicas: vec!["node-a:p".into()],
        owner: "node-a".into(),
        epoch: 1,
        copies: 0,
        out_of_sync: Vec::new(),
        lost: Vec::new(),
        snapshot_intent: None,
        iscsi_pr: None,
    };
    let kv = tessera_cluster::Etcd::new(&etcd.endpoints(), Duration::from_secs(2)).unwrap();
    kv.put(
        &tessera_cluster::volume_key("db"),
        &serde_json::to_vec(&spec).unwrap(),
        0,
    )
    .unwrap();
    let mut on_a = nbd_connect(&a, "db");
    let data = pattern(3, BS);
    on_a.write(0, &data, true).unwrap();
    on_a.flush().unwrap();
    on_a.disconnect().unwrap();

    let base_hooks = hooks(&b);
    let mut buf = vec![0u8; BS];
    let mut cycle = || {
        let mut c = nbd_connect(&b, "db");
        c.read(0, &mut buf).unwrap();
        assert!(buf == data, "the owner's data through node-b");
        c.disconnect().unwrap();
    };
    // Allocator and buffer pools reach their working size first.
    for _ in 0..WARM_UP {
        cycle();
    }
    let rss_warm = vm_rss(b.pid());
    for _ in WARM_UP..CYCLES {
        cycle();
    }
    let cycled = started.elapsed();
    // A closed queue goes once its last timer has fired (at most the remote timeout).
    wait_for("node-b's hook count back to where it was", 30, || {
        hooks(&b) <= base_hooks
    });
    let grown = vm_rss(b.pid()).saturating_sub(rss_warm);
    let per_cycle = grown / (CYCLES - WARM_UP) as u64;
    eprintln!(
        "{CYCLES} cycles in {cycled:?}; node-b RSS grew {} KiB after warm-up ({per_cycle} B per cycle); hooks {}",
        grown >> 10,
        hooks(&b)
    );
    assert!(
        grown < 16 * MIB,
        "node-b's resident memory grew {} KiB over {} cycles",
        grown >> 10,
        CYCLES - WARM_UP
    );
    let log = b.log_text();
    assert_eq!(
        count(&log, "nbd proxy opened"),
        count(&log, "nbd proxy closed"),
        "every proxy closed"
    );
}
