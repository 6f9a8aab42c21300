//! Replicated volumes across three real nodes on loopback: each node its own process,
//! data directory, file-backed pool, NBD and NVMe/TCP ports. The owner (node-a) exports
//! the volume; node-b and node-c hold replicas it reaches over NVMe/TCP.
//!
//! - A replica node killed (-9) under writes: writes go on without a client error once
//!   the replica is dropped after the timeout; the owner reports it degraded with the
//!   bytes it lacks; restarted, it is resynced by copying only the dirty regions, and
//!   all three replicas compare equal byte for byte (read directly on each node).
//! - A replica node killed (-9) right after unflushed writes, with nothing in flight:
//!   the owner notices the broken connection, and the resync brings back what the
//!   replica had acknowledged but not made durable.
//! - The owner killed (-9) with writes in flight (a replica frozen holds them): restarted,
//!   every write acknowledged before an acknowledged flush reads back, only the activity
//!   log's regions are reconciled (a small log: far from a full copy), and the replicas
//!   compare equal.
//! - The owner killed (-9) after one unflushed first write in every region, four times
//!   the activity log's capacity: regions leave the log only once durable on every leg,
//!   so the replicas compare equal after the restart.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;
use tessera_testkit::netns::NetNs;

use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const BS: usize = 4096;
const VOL: u64 = 64 * MIB;

struct Cluster {
    /// The owner's `/metrics` address.
    metrics: String,
    a: TestNode,
    b: TestNode,
    c: TestNode,
}

fn holder(tag: &str, name: &str) -> TestNode {
    holder_on(tag, name, "")
}

/// A replica holder whose pool device gets `fault` settings (empty: a plain file).
fn holder_on(tag: &str, name: &str, fault: &str) -> TestNode {
    let nvmf = free_port();
    let n = TestNode::start_with_top(
        tag,
        2,
        &format!("name = \"{name}\""),
        &format!("[nvmf]\nlisten = \"127.0.0.1:{nvmf}\"\ndiscovery = \"\"\n"),
    );
    let img = if fault.is_empty() {
        format!("{}:256M", n.dir.join("p.img").display())
    } else {
        format!("fault:{}:256M{fault}", n.dir.join("p.img").display())
    };
    n.cli_ok(&["pool", "create", "p", &img]);
    n
}

fn cluster(tag: &str) -> Cluster {
    cluster_on(tag, "")
}

/// A cluster whose owner's pool device spec is wrapped as `PREFIX{file}:256M{suffix}`
/// (`owner_fault`: e.g. `;vanish_after_ms=6000` makes it a fault device).
fn cluster_on(tag: &str, owner_fault: &str) -> Cluster {
    cluster_with(tag, owner_fault, "", "")
}

/// As [`cluster_on`], with node-c's pool device wrapped the same way and `replication`
/// added to the owner's `[replication]` section.
fn cluster_with(tag: &str, owner_fault: &str, c_fault: &str, replication: &str) -> Cluster {
    let b = holder(&format!("{tag}-b"), "node-b");
    let c = holder_on(&format!("{tag}-c"), "node-c", c_fault);
    let (a, metrics) = owner_with(tag, owner_fault, replication, &b, &c);
    a.cli_ok(&[
        "volume",
        "create",
        "db",
        "--size",
        "64M",
        "--replicas",
        "node-a:p,node-b:p,node-c:p",
    ]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    // Each holder also exports its replica over NBD, so the test can read it directly.
    for n in [&b, &c] {
        export_replica(n, "db");
    }
    Cluster { metrics, a, b, c }
}

/// Export holder `n`'s replica of volume `volume` read-only as `replica` (test reads).
fn export_replica(n: &TestNode, volume: &str) {
    n.cli_ok(&[
        "export",
        "add",
        "replica",
        "--volume",
        &format!("{volume}.node-a"),
        "--read-only",
    ]);
}

/// The owner node-a (pool `p`, its device wrapped as in [`cluster_on`]) with node-b and
/// node-c as peers; returns it and its `/metrics` address.
fn owner(tag: &str, owner_fault: &str, b: &TestNode, c: &TestNode) -> (TestNode, String) {
    owner_with(tag, owner_fault, "", b, c)
}

/// As [`owner`], with `replication` added to its `[replication]` section.
fn owner_with(
    tag: &str,
    owner_fault: &str,
    replication: &str,
    b: &TestNode,
    c: &TestNode,
) -> (TestNode, String) {
    let nvmf = free_port();
    let metrics = format!("127.0.0.1:{}", free_port());
    let peers = format!(
        "[[peer]]\nname = \"node-b\"\napi = \"{}\"\n[[peer]]\nname = \"node-c\"\napi = \"{}\"\n",
        b.api(),
        c.api()
    );
    let a = TestNode::start_with_top(
        &format!("{tag}-a"),
        2,
        "name = \"node-a\"",
        &format!(
            "{peers}[metrics]\nlisten = \"{metrics}\"\n[replication]\ntimeout_ms = 3000\nregion_size = \"1M\"\n\
             {replication}[nvmf]\nlisten = \"127.0.0.1:{nvmf}\"\ndiscovery = \"\"\n"
        ),
    );
    let img = if owner_fault.is_empty() {
        format!("{}:256M", a.dir.join("p.img").display())
    } else {
        format!("fault:{}:256M{owner_fault}", a.dir.join("p.img").display())
    };
    a.cli_ok(&["pool", "create", "p", &img]);
    (a, metrics)
}

fn replicas(a: &TestNode) -> Vec<serde_json::Value> {
    a.json(&["volume", "show", "db"])["replicas"]
        .as_array()
        .expect("a replicated volume lists its replicas")
        .clone()
}

fn state_of(a: &TestNode, place: &str) -> serde_json::Value {
    replicas(a)
        .into_iter()
        .find(|r| r["place"] == place)
        .unwrap_or_else(|| panic!("no replica {place}"))
}

/// The owner's Prometheus text.
fn scrape(addr: &str) -> String {
    http_get(addr, "/metrics").expect("metrics listener").1
}

/// Write generation 1 over the first 16 MiB (quick on a loaded machine), then wait for
/// the 20 s fault timer started at `t0` (when the faulty device was opened) to fire.
fn first_generation_then_fault(
    cl: &Cluster,
    t0: Instant,
) -> (tessera_nbd::client::NbdClient, Vec<u64>) {
    let blocks = (VOL as usize) / BS / 4;
    let mut model = vec![0u64; blocks];
    let mut c = nbd_connect(&cl.a, "db");
    write_generations(&mut c, &mut model, 0..blocks, 1, BS);
    assert!(
        t0.elapsed() < Duration::from_secs(18),
        "setup too slow for the fault timer"
    );
    std::thread::sleep(
        Duration::from_secs(20).saturating_sub(t0.elapsed()) + Duration::from_millis(500),
    );
    (c, model)
}

fn all_in_sync(a: &TestNode) -> bool {
    replicas(a).iter().all(|r| r["state"] == "in_sync")
}

/// The whole volume as export `export` of node `n` serves it.
fn image(n: &TestNode, export: &str) -> Vec<u8> {
    let mut c = nbd_connect(n, export);
    let mut out = vec![0u8; VOL as usize];
    for (i, chunk) in out.chunks_mut(1 << 20).enumerate() {
        c.read(i as u64 * MIB, chunk).unwrap();
    }
    out
}

fn assert_same(what: &str, x: &[u8], y: &[u8]) {
    if x != y {
        let first = x.iter().zip(y).position(|(a, b)| a != b).unwrap();
        panic!(
            "{what}: images differ, first at byte {first} (block {})",
            first / BS
        );
    }
}

#[test]
fn a_killed_replica_is_dropped_then_resynced_from_its_dirty_regions_only() {
    let mut cl = cluster("repl-kill");
    let blocks = (VOL as usize) / BS;
    let mut model = vec![0u64; blocks];
    let mut c = nbd_connect(&cl.a, "db");
    // Generation 1 everywhere: all three replicas get it.
    write_generations(&mut c, &mut model, 0..blocks, 1, BS);
    assert!(all_in_sync(&cl.a), "{:?}", replicas(&cl.a));

    // node-c dies; writes to 4 MiB (4 regions) go on without it once it is dropped. The
    // whole volume was just written (all of it in the activity log): only the regions
    // written after the failure count as missing.
    cl.c.kill9();
    let t = Instant::now();
    write_generations(&mut c, &mut model, 0..1024, 2, BS);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "writes waited {took:?} for a dead replica"
    );
    let rc = state_of(&cl.a, "node-c:p");
    assert_ne!(rc["state"], "in_sync", "{rc}");
    let dirty = rc["dirty_bytes"].as_u64().unwrap();
    assert!(
        (4 * MIB..=8 * MIB).contains(&dirty),
        "node-c lacks {dirty} bytes; 4 MiB were written without it"
    );
    assert_eq!(state_of(&cl.a, "node-b:p")["state"], "in_sync");
    let m = scrape(&cl.metrics);
    let line = |name: &str, place: &str| {
        m.lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("replica=\"{place}\"")))
            .unwrap_or_else(|| panic!("no {name} for {place} in:\n{m}"))
            .to_string()
    };
    assert!(line("tessera_replica_state{", "node-b:p").ends_with(" 0"));
    let st = line("tessera_replica_state{", "node-c:p");
    assert!(!st.ends_with(" 0") && !st.contains("in_sync"), "{st}");
    assert!(line("tessera_replica_dirty_bytes{", "node-c:p").ends_with(&format!(" {dirty}")));
    // More writes to the same and new regions while it is away.
    write_generations(&mut c, &mut model, (2048..2304).chain(0..256), 3, BS);
    let dirty = state_of(&cl.a, "node-c:p")["dirty_bytes"].as_u64().unwrap();
    assert!((5 * MIB..=10 * MIB).contains(&dirty), "dirty {dirty}");

    cl.c.restart();
    wait_for("node-c back in sync", 60, || all_in_sync(&cl.a));
    let rc = state_of(&cl.a, "node-c:p");
    let copied = rc["resync_copied_bytes_total"].as_u64().unwrap();
    assert!(
        copied >= dirty && copied <= dirty + 4 * MIB,
        "resync copied {copied} bytes for {dirty} dirty bytes (volume {VOL})"
    );
    // Writes after the resync reach node-c again.
    write_generations(&mut c, &mut model, 4096..4352, 4, BS);
    drop(c);
    verify_generations(&cl.a, "db", &model, BS);
    let a_img = image(&cl.a, "db");
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
}

#[test]
fn a_replica_killed_before_a_flush_is_resynced_with_what_it_had_not_made_durable() {
    let mut cl = cluster("repl-crash");
    // 8 MiB through the owner, acknowledged by every replica but never flushed: node-c
    // may hold them only in memory (its thin allocations not yet committed).
    let blocks = (8 * MIB) as usize / BS;
    let mut c = nbd_connect(&cl.a, "db");
    for i in 0..blocks {
        c.write((i * BS) as u64, &block(i, 1, BS), false).unwrap();
    }
    cl.c.kill9();
    // No I/O fails (none is in flight, and the reconnect would hide a short outage):
    // the owner notices the broken connection itself, and counts every region written
    // since node-c's last flush as lacking there.
    wait_for("the owner notices node-c's crash", 15, || {
        state_of(&cl.a, "node-c:p")["state"] != "in_sync"
    });
    let dirty = state_of(&cl.a, "node-c:p")["dirty_bytes"].as_u64().unwrap();
    assert!(
        dirty >= 8 * MIB,
        "node-c lacks {dirty} bytes; 8 MiB were written to it without a flush"
    );
    cl.c.restart();
    wait_for("node-c back in sync", 40, || all_in_sync(&cl.a));
    drop(c);
    let a_img = image(&cl.a, "db");
    for i in 0..blocks {
        assert!(
            a_img[i * BS..(i + 1) * BS] == block(i, 1, BS),
            "block {i}: the owner lost an acknowledged write"
        );
    }
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
}

/// The activity log's capacity in [`the_owner_killed_under_writes_reconciles_its_activity_log_on_restart`]:
/// a quarter of the volume's regions, so that reconciling it is far from a full copy.
const SMALL_AL: u64 = 16;

#[test]
fn the_owner_killed_under_writes_reconciles_its_activity_log_on_restart() {
    let mut cl = cluster_with("repl-owner", "", "", &format!("al_regions = {SMALL_AL}\n"));
    let blocks = (VOL as usize) / BS;
    let per_region = (MIB as usize) / BS;
    let mut model = vec![0u64; blocks];
    let mut c = nbd_connect(&cl.a, "db");
    write_generations(&mut c, &mut model, 0..blocks, 1, BS);
    // Durable generation 2 on a few blocks of every region, then acknowledged but
    // unflushed writes (generation 3) to regions 0-3.
    write_generations(&mut c, &mut model, (0..blocks).step_by(7), 2, BS);
    let gen3 = |i: usize| i < 4 * per_region && i % 5 == 3;
    for i in (0..blocks).filter(|&i| gen3(i)) {
        c.write((i * BS) as u64, &block(i, 3, BS), false).unwrap();
    }
    // Writes in flight at the kill (generation 4, regions 40-43): node-c is frozen, so
    // none of them can complete (before the 3 s timeout) while they are sent, pipelined,
    // and the owner is killed.
    let gen4 = |i: usize| (40 * per_region..44 * per_region).contains(&i) && i % 25 == 1;
    let pid_c = cl.c.pid() as i32;
    // SAFETY: signalling a child process this test started.
    unsafe { libc::kill(pid_c, libc::SIGSTOP) };
    let mut sent = 0;
    for i in (0..blocks).filter(|&i| gen4(i)) {
        let cookie = 1 + i as u64;
        c.send_request(
            tessera_nbd::proto::CMD_WRITE,
            0,
            cookie,
            (i * BS) as u64,
            BS as u32,
            &block(i, 4, BS),
        )
        .unwrap();
        sent += 1;
    }
    cl.a.kill9();
    // SAFETY: as above.
    unsafe { libc::kill(pid_c, libc::SIGCONT) };
    let mut answered = 0;
    while c.recv_reply(|_| 0).is_ok() {
        answered += 1;
    }
    assert!(
        answered < sent,
        "all {sent} writes were answered before the kill: none was in flight"
    );
    drop(c);
    cl.a.restart();
    wait_for("replicas reconciled", 60, || all_in_sync(&cl.a));
    let copied: u64 = replicas(&cl.a)
        .iter()
        .map(|r| r["resync_copied_bytes_total"].as_u64().unwrap())
        .sum();
    assert!(copied > 0, "the activity log's regions were reconciled");
    // Only the activity log's regions are reconciled: at most its capacity plus the
    // regions with writes in flight (4, and one of the sequential writes), on each of
    // the two other replicas; a full copy of one replica would be the whole volume.
    let most = 2 * (SMALL_AL + 5) * MIB;
    assert!(
        copied <= most,
        "copied {copied} bytes, more than the activity log's {most}"
    );
    // Everything acknowledged by a flush is there; the unflushed and the in-flight
    // writes are either version, but the same on every replica.
    let a_img = image(&cl.a, "db");
    for (i, &g) in model.iter().enumerate() {
        let got = &a_img[i * BS..(i + 1) * BS];
        let ok = got == block(i, g, BS).as_slice()
            || (gen3(i) && got == block(i, 3, BS).as_slice())
            || (gen4(i) && got == block(i, 4, BS).as_slice());
        assert!(
            ok,
            "block {i}: neither the flushed generation {g} nor the later write"
        );
    }
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
}

/// A region leaves the activity log only once its writes are durable on every replica
/// that received them: after the owner's kill -9, restart reconciles the log's regions
/// only, so one that had left it with a write the owner's pool had not yet committed
/// (a first write: its allocation is in the pool's journal only after a flush) would
/// read differently on the owner and on the replicas, for good.
#[test]
fn regions_leave_the_activity_log_only_once_durable_on_every_replica() {
    let mut cl = cluster_with(
        "repl-al-durable",
        "",
        "",
        &format!("al_regions = {SMALL_AL}\n"),
    );
    let regions = (VOL / MIB) as usize;
    let per_region = (MIB as usize) / BS;
    let mut c = nbd_connect(&cl.a, "db");
    // One acknowledged, unflushed first write in every region: four times the log's
    // capacity, so most regions must leave it before the kill.
    for r in 0..regions {
        let i = r * per_region + 3;
        c.write((i * BS) as u64, &block(i, 1, BS), false).unwrap();
    }
    drop(c);
    cl.a.kill9();
    cl.a.restart();
    wait_for("replicas reconciled", 60, || all_in_sync(&cl.a));
    let a_img = image(&cl.a, "db");
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
}

#[test]
fn bad_replica_requests_get_clear_errors() {
    let cl = cluster("repl-bad");
    let out = cl.a.cli(&[
        "volume",
        "create",
        "x",
        "--size",
        "8M",
        "--replicas",
        "node-b:p,node-c:p",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("node-a:POOL"), "{err}");
    let out = cl.a.cli(&[
        "volume",
        "create",
        "x",
        "--size",
        "8M",
        "--replicas",
        "node-a:p,node-z:p",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no peer named 'node-z'"), "{err}");
    // A failed create leaves nothing behind on the owner or the peers.
    let out = cl.a.cli(&[
        "volume",
        "create",
        "y",
        "--size",
        "8M",
        "--replicas",
        "node-a:p,node-b:nopool",
    ]);
    assert!(!out.status.success());
    assert!(cl.a.cli(&["volume", "show", "y"]).status.code() == Some(3));
    assert!(cl.b.cli(&["volume", "show", "y.node-a"]).status.code() == Some(3));
    // Resizing is refused clearly; deleting removes the replicas on the peers.
    let out = cl.a.cli(&["volume", "resize", "db", "--size", "128M"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("replicated"));
    cl.a.cli_ok(&["export", "remove", "db"]);
    for n in [&cl.b, &cl.c] {
        n.cli_ok(&["export", "remove", "replica"]);
    }
    cl.a.cli_ok(&["volume", "delete", "db"]);
    for n in [&cl.b, &cl.c] {
        assert!(n.cli(&["volume", "show", "db.node-a"]).status.code() == Some(3));
    }
}

fn fio_clean(what: &str, o: &std::process::Output) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.success(),
        "{what}: fio failed ({}):\n{text}",
        o.status
    );
    assert!(
        !text.contains("verify:") && !text.contains("bad magic") && text.contains("err= 0"),
        "{what}: fio reported errors:\n{text}"
    );
}

#[test]
fn fio_verify_holds_while_a_replica_is_killed_and_restarted_twice() {
    if !require_tool("fio") {
        return;
    }
    let mut cl = cluster("repl-fio");
    // 32 MiB of random 4 KiB writes, rate-limited so that each pass takes ~4 s, then a
    // verify pass (crc32c) per loop; 4 loops span both outages.
    let uri = cl.a.uri("db");
    let fio = spawn_fio_randwrite(
        &cl.a.dir,
        "repl",
        &uri,
        &[
            "--iodepth=8",
            "--size=32M",
            "--rate_iops=2000",
            "--loops=4",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
        ],
    );
    let mut dirty_seen = 0u64;
    for round in 0..2 {
        std::thread::sleep(Duration::from_secs(2));
        cl.c.kill9();
        // Dropped after the 3 s timeout; fio keeps writing meanwhile.
        wait_for("node-c dropped", 20, || {
            state_of(&cl.a, "node-c:p")["state"] != "in_sync"
        });
        std::thread::sleep(Duration::from_secs(2));
        let d = state_of(&cl.a, "node-c:p")["dirty_bytes"].as_u64().unwrap();
        assert!(
            d > 0 && d <= 32 * MIB,
            "round {round}: node-c lacks {d} bytes"
        );
        dirty_seen += d;
        cl.c.restart();
        wait_for("node-c in sync", 60, || all_in_sync(&cl.a));
    }
    let out = fio.wait_with_output().expect("fio");
    fio_clean("fio through two replica outages", &out);
    wait_for("all in sync", 30, || all_in_sync(&cl.a));
    let copied = state_of(&cl.a, "node-c:p")["resync_copied_bytes_total"]
        .as_u64()
        .unwrap();
    // fio writes only the first 32 MiB of the 64 MiB volume, so each outage can dirty
    // at most those 32 regions (more of them than seen at the reading, as fio goes on
    // until the resync starts): two outages copy at most 2 x 32 MiB, where a full copy
    // would be 2 x 64 MiB. (Regions fio rewrote during their copy were copied again:
    // reported apart.)
    assert!(
        copied > 0 && copied <= 2 * 32 * MIB && dirty_seen <= 2 * 32 * MIB,
        "resync copied {copied} bytes for {dirty_seen} dirty bytes seen"
    );
    let recopied = state_of(&cl.a, "node-c:p")["resync_recopied_bytes_total"]
        .as_u64()
        .unwrap();
    eprintln!(
        "resync: {copied} bytes brought in sync, {recopied} copied again, {dirty_seen} dirty seen"
    );
    let a_img = image(&cl.a, "db");
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
}

#[test]
fn a_frozen_replica_is_dropped_and_resynced_when_it_thaws() {
    // A partition as the owner sees it: the peer's process is frozen (SIGSTOP), so its
    // sockets stay open and silent — nothing is refused, nothing answers.
    let cl = cluster("repl-freeze");
    let blocks = (VOL as usize) / BS;
    let mut model = vec![0u64; blocks];
    let mut c = nbd_connect(&cl.a, "db");
    write_generations(&mut c, &mut model, 0..blocks, 1, BS);
    let pid = cl.b.pid() as i32;
    // SAFETY: signalling a child process this test started.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let t = Instant::now();
    write_generations(&mut c, &mut model, 512..1536, 2, BS);
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "writes hung on a frozen replica"
    );
    let rb = state_of(&cl.a, "node-b:p");
    assert_ne!(rb["state"], "in_sync", "{rb}");
    let dirty = rb["dirty_bytes"].as_u64().unwrap();
    assert!(
        (4 * MIB..=6 * MIB).contains(&dirty),
        "node-b lacks {dirty} bytes"
    );
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    wait_for("node-b in sync", 60, || all_in_sync(&cl.a));
    let copied = state_of(&cl.a, "node-b:p")["resync_copied_bytes_total"]
        .as_u64()
        .unwrap();
    assert!(
        copied >= dirty && copied <= dirty + 2 * MIB,
        "copied {copied}, dirty {dirty}"
    );
    drop(c);
    verify_generations(&cl.a, "db", &model, BS);
    assert_same(
        "node-b vs owner",
        &image(&cl.b, "replica"),
        &image(&cl.a, "db"),
    );
}

#[test]
fn the_owners_local_replica_failing_under_it_is_a_lost_replica() {
    // The owner's own pool sits on a device that vanishes 20 s after it was opened (room
    // for a slow, shared CI machine to set the cluster up first).
    let cl = cluster_on("repl-fault", ";vanish_after_ms=20000");
    let t0 = Instant::now();
    let (mut c, mut model) = first_generation_then_fault(&cl, t0);
    // Writes go on (node-b and node-c hold them); reads are served by a remote replica.
    write_generations(&mut c, &mut model, 256..768, 2, BS);
    let local = state_of(&cl.a, "local:p");
    assert_ne!(local["state"], "in_sync", "{local}");
    assert_eq!(state_of(&cl.a, "node-b:p")["state"], "in_sync");
    assert_eq!(state_of(&cl.a, "node-c:p")["state"], "in_sync");
    drop(c);
    verify_generations(&cl.a, "db", &model, BS);
    assert_same(
        "node-b vs node-c",
        &image(&cl.b, "replica"),
        &image(&cl.c, "replica"),
    );
}

#[test]
fn a_replica_answering_errors_is_dropped_and_the_volume_goes_on() {
    // node-c's device starts failing every write 20 s after it was opened: it answers
    // each with an NVMe error status, quickly, rather than going silent.
    let cl = cluster_with("repl-errors", "", ";vanish_after_ms=20000", "");
    let t0 = Instant::now();
    let (mut c, mut model) = first_generation_then_fault(&cl, t0);
    let t = Instant::now();
    write_generations(&mut c, &mut model, 1000..1300, 2, BS);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "errors were not handled at once"
    );
    let rc = state_of(&cl.a, "node-c:p");
    assert_ne!(rc["state"], "in_sync", "{rc}");
    assert!(rc["last_error"].is_string(), "{rc}");
    drop(c);
    verify_generations(&cl.a, "db", &model, BS);
    assert_same(
        "node-b vs owner",
        &image(&cl.b, "replica"),
        &image(&cl.a, "db"),
    );
}

/// Read back every block `model` says was written (generation above 0) from the owner.
fn verify_written(a: &TestNode, model: &[u64]) {
    let mut c = nbd_connect(a, "db");
    let mut buf = vec![0u8; BS];
    for (i, &g) in model.iter().enumerate().filter(|(_, g)| **g > 0) {
        c.read((i * BS) as u64, &mut buf).unwrap();
        assert!(
            buf == block(i, g, BS),
            "block {i} differs (expected generation {g})"
        );
    }
}

fn copied_to(a: &TestNode, place: &str) -> u64 {
    state_of(a, place)["resync_copied_bytes_total"]
        .as_u64()
        .unwrap()
}

#[test]
fn a_new_replica_gets_a_copy_of_the_allocated_space_only_while_fio_writes() {
    if !require_tool("fio") {
        return;
    }
    let b = holder("repl-add-b", "node-b");
    let c = holder("repl-add-c", "node-c");
    let (mut a, _) = owner("repl-add", "", &b, &c);
    a.cli_ok(&[
        "volume",
        "create",
        "db",
        "--size",
        "64M",
        "--replicas",
        "node-a:p,node-b:p",
    ]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    export_replica(&b, "db");
    // 3 MiB of data in a 64 MiB volume: regions 0, 20 and 40.
    let blocks = (VOL as usize) / BS;
    let mut model = vec![0u64; blocks];
    let mut nbd = nbd_connect(&a, "db");
    let per_mib = (MIB as usize) / BS;
    for at in [0, 20, 40] {
        write_generations(
            &mut nbd,
            &mut model,
            at * per_mib..(at + 1) * per_mib,
            1,
            BS,
        );
    }
    drop(nbd);
    // fio keeps writing (and verifying) 2 MiB at 48 MiB across the addition.
    let uri = a.uri("db");
    let fio = spawn_fio_randwrite(
        &a.dir,
        "add",
        &uri,
        &[
            "--iodepth=4",
            "--offset=48M",
            "--size=2M",
            "--rate_iops=250",
            "--loops=4",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
        ],
    );
    std::thread::sleep(Duration::from_secs(1));
    let e = a.cli_fails(&["volume", "replica", "add", "db", "node-a:p"]);
    assert!(e.contains("another node"), "{e}");
    a.cli_ok(&["volume", "replica", "add", "db", "node-c:p"]);
    let e = a.cli_fails(&["volume", "replica", "add", "db", "node-c:p"]);
    assert!(e.contains("already has a replica"), "{e}");
    assert_eq!(replicas(&a).len(), 3);
    wait_for("node-c in sync", 60, || {
        state_of(&a, "node-c:p")["state"] == "in_sync"
    });
    let out = fio.wait_with_output().expect("fio");
    fio_clean("fio across a replica's addition", &out);
    // Thin: the 3 MiB written plus fio's 2 MiB at most, of 64 MiB. (Regions fio
    // rewrote during their copy were copied again: counted apart.)
    let copied = copied_to(&a, "node-c:p");
    let allocated = a.json(&["volume", "show", "db"])["allocated"]
        .as_u64()
        .unwrap();
    eprintln!("new replica: {copied} bytes copied, {allocated} allocated on the owner");
    assert!(
        (3 * MIB..=5 * MIB).contains(&copied) && copied <= allocated.next_multiple_of(MIB),
        "copied {copied} bytes for {allocated} allocated"
    );
    wait_for("all in sync", 30, || all_in_sync(&a));
    export_replica(&c, "db");
    let a_img = image(&a, "db");
    assert_same("node-b vs owner", &image(&b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&c, "replica"), &a_img);
    verify_written(&a, &model);

    // Removing: the owner's own replica stays; node-b's goes, durably, volume and all.
    let e = a.cli_fails(&["volume", "replica", "remove", "db", "local:p"]);
    assert!(e.contains("owner's own"), "{e}");
    b.cli_ok(&["export", "delete", "replica"]);
    let r = a.json(&["volume", "replica", "remove", "db", "node-b:p"]);
    assert_eq!(r["replica_volume_deleted"], true, "{r}");
    let places: Vec<String> = replicas(&a)
        .iter()
        .map(|r| r["place"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(places, ["local:p", "node-c:p"]);
    assert!(!b.cli(&["volume", "show", "db.node-a"]).status.success());
    // Writes after the removal reach node-c; a restarted owner knows the set as it is.
    let mut nbd = nbd_connect(&a, "db");
    write_generations(&mut nbd, &mut model, 0..per_mib, 2, BS);
    drop(nbd);
    a.stop();
    a.restart();
    let places: Vec<String> = replicas(&a)
        .iter()
        .map(|r| r["place"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(places, ["local:p", "node-c:p"]);
    wait_for("all in sync after restart", 30, || all_in_sync(&a));
    assert_same("node-c vs owner", &image(&c, "replica"), &image(&a, "db"));
}

#[test]
fn a_local_volume_becomes_replicated_when_a_replica_is_added() {
    let b = holder("repl-conv-b", "node-b");
    let c = holder("repl-conv-c", "node-c");
    let (a, _) = owner("repl-conv", "", &b, &c);
    a.cli_ok(&["volume", "create", "db", "--pool", "p", "--size", "64M"]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    let blocks = (VOL as usize) / BS;
    let mut model = vec![0u64; blocks];
    let per_mib = (MIB as usize) / BS;
    let mut nbd = nbd_connect(&a, "db");
    write_generations(&mut nbd, &mut model, 8 * per_mib..10 * per_mib, 1, BS);
    drop(nbd);
    // In use: refused, with what to do.
    let e = a.cli_fails(&["volume", "replica", "add", "db", "node-b:p"]);
    assert!(e.contains("in use") && e.contains("exported as db"), "{e}");
    assert!(a.json(&["volume", "show", "db"])["replicas"].is_null());
    a.cli_ok(&["export", "delete", "db"]);
    // The last connection may take a moment to close on the node's side.
    wait_for("the replica added once nothing uses the volume", 10, || {
        a.cli(&["volume", "replica", "add", "db", "node-b:p"])
            .status
            .success()
    });
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    wait_for("node-b in sync", 60, || all_in_sync(&a));
    assert_eq!(
        copied_to(&a, "node-b:p"),
        2 * MIB,
        "only the 2 MiB written are copied"
    );
    // Now writes reach both.
    let mut nbd = nbd_connect(&a, "db");
    write_generations(&mut nbd, &mut model, 30 * per_mib..31 * per_mib, 2, BS);
    drop(nbd);
    verify_written(&a, &model);
    export_replica(&b, "db");
    assert_same("node-b vs owner", &image(&b, "replica"), &image(&a, "db"));
}

/// The whole volume as holder `n` serves export `export` on its NBD Unix socket (a node
/// in another network namespace).
fn image_unix(n: &TestNode, export: &str) -> Vec<u8> {
    let s = std::os::unix::net::UnixStream::connect(n.dir.join("nbd.sock")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = tessera_nbd::client::NbdClient::from_stream(
        s,
        export,
        tessera_nbd::client::ClientOptions::default(),
    )
    .expect("NBD handshake");
    let mut out = vec![0u8; VOL as usize];
    for (i, chunk) in out.chunks_mut(1 << 20).enumerate() {
        c.read(i as u64 * MIB, chunk).unwrap();
    }
    out
}

#[test]
fn a_partitioned_replica_is_dropped_and_resynced_from_what_changed_when_it_heals() {
    let Some(ns) = NetNs::create() else { return };
    let b = holder("repl-part-b", "node-b");
    // node-c in the namespace: its NVMe/TCP listener on the namespace's address.
    let nvmf = free_port();
    let c = TestNode::start_in_netns(
        "repl-part-c",
        Some(&ns.name),
        2,
        "name = \"node-c\"",
        &format!(
            "[nvmf]\nlisten = \"{}:{nvmf}\"\ndiscovery = \"\"\n",
            ns.addr
        ),
    );
    c.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:256M", c.dir.join("p.img").display()),
    ]);
    let (a, _) = owner("repl-part", "", &b, &c);
    a.cli_ok(&[
        "volume",
        "create",
        "db",
        "--size",
        "64M",
        "--replicas",
        "node-a:p,node-b:p,node-c:p",
    ]);
    a.cli_ok(&["export", "add", "db", "--volume", "db"]);
    export_replica(&b, "db");
    export_replica(&c, "db");
    let spec = replicas(&a)
        .into_iter()
        .find(|r| r["place"] == "node-c:p")
        .unwrap();
    assert!(all_in_sync(&a), "{spec}");
    let blocks = (VOL as usize) / BS;
    let mut model = vec![0u64; blocks];
    let mut nbd = nbd_connect(&a, "db");
    write_generations(&mut nbd, &mut model, 0..blocks / 4, 1, BS);

    ns.cut();
    // I/O goes on: the writes wait at most the timeout (3 s) for node-c, then node-c is
    // dropped out of sync and they complete on the owner and node-b.
    let t = Instant::now();
    write_generations(&mut nbd, &mut model, 512..1536, 2, BS);
    write_generations(&mut nbd, &mut model, 4096..4352, 3, BS);
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "writes hung behind a partitioned replica ({:?})",
        t.elapsed()
    );
    let rc = state_of(&a, "node-c:p");
    assert_ne!(rc["state"], "in_sync", "{rc}");
    assert_eq!(state_of(&a, "node-b:p")["state"], "in_sync");
    // Regions 2-5 and 16 were written during the partition (plus, at most, one in
    // flight when node-c was dropped).
    let dirty = rc["dirty_bytes"].as_u64().unwrap();
    assert!(
        (5 * MIB..=6 * MIB).contains(&dirty),
        "node-c lacks {dirty} bytes"
    );

    ns.heal();
    wait_for("node-c in sync after the heal", 45, || all_in_sync(&a));
    let copied = copied_to(&a, "node-c:p");
    assert!(
        copied >= dirty && copied <= dirty + 2 * MIB,
        "copied {copied} bytes for {dirty} dirty"
    );
    drop(nbd);
    verify_written(&a, &model);
    let a_img = image(&a, "db");
    assert_same("node-b vs owner", &image(&b, "replica"), &a_img);
    assert_same("node-c vs owner", &image_unix(&c, "replica"), &a_img);
}

/// The places (`NODE:POOL`) of a snapshot create's `replicas` (or any list of strings).
fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Snapshot `snap` of `n`, exported read-only as `x-SNAP`, every byte.
fn snapshot_image(n: &TestNode, snap: &str) -> Vec<u8> {
    let export = format!("x-{snap}");
    n.cli_ok(&["export", "add", &export, "--volume", snap, "--read-only"]);
    let img = image(n, &export);
    n.cli_ok(&["export", "remove", &export]);
    img
}

fn snapshot_names(n: &TestNode) -> Vec<String> {
    n.json(&["snapshot", "list"])
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

/// A snapshot of a replicated volume is taken on every replica in sync at one point of
/// the write stream, while fio writes at QD32: the three copies compare equal byte for
/// byte, and each holds every write acknowledged before it and none after.
#[test]
fn snapshots_of_a_replicated_volume_are_one_point_on_every_replica() {
    if !require_tool("fio") {
        return;
    }
    let mut cl = cluster("repl-snap");
    let all = ["node-a:p", "node-b:p", "node-c:p"];
    // Our own writes in the second half (generation 1 before the snapshots, 2 after);
    // fio writes the first half, unbounded, through the snapshots.
    let blocks = VOL as usize / BS;
    let mut model = vec![0u64; blocks];
    let mut c = nbd_connect(&cl.a, "db");
    write_generations(&mut c, &mut model, blocks / 2..blocks, 1, BS);
    let uri = cl.a.uri("db");
    let fio = spawn_fio_randwrite(
        &cl.a.dir,
        "snap-load",
        &uri,
        &["--iodepth=32", "--size=32M", "--time_based", "--runtime=8"],
    );
    std::thread::sleep(Duration::from_secs(2));
    let snaps = ["s1", "s2", "s3"];
    for s in snaps {
        let r = snapshot(&cl.a, "db", s);
        assert_eq!(strings(&r["replicas"]), all, "{s}: {r}");
        assert!(strings(&r["missing"]).is_empty(), "{s}: {r}");
        std::thread::sleep(Duration::from_millis(700));
    }
    fio_clean(
        "fio through three snapshots",
        &fio.wait_with_output().unwrap(),
    );
    write_generations(&mut c, &mut model, blocks / 2..blocks, 2, BS);
    drop(c);
    for s in snaps {
        let a_img = snapshot_image(&cl.a, s);
        assert_same(
            &format!("{s}: node-b's copy vs node-a's"),
            &snapshot_image(&cl.b, s),
            &a_img,
        );
        assert_same(
            &format!("{s}: node-c's copy vs node-a's"),
            &snapshot_image(&cl.c, s),
            &a_img,
        );
        for i in blocks / 2..blocks {
            assert!(
                a_img[i * BS..(i + 1) * BS] == block(i, 1, BS),
                "{s}: block {i} is not the generation written before the snapshot"
            );
        }
    }
    // The live volume moved on past the snapshots; it reports what changed since one
    // (the second half, rewritten after the snapshots), over the API and NBD's map.
    verify_written(&cl.a, &model);
    let changed = changes(&cl.a, "db", "s3");
    for half_unit in (VOL / 2..VOL).step_by(MIB as usize) {
        assert!(
            changed
                .iter()
                .any(|&(o, l)| o <= half_unit && half_unit < o + l),
            "changes since s3 miss offset {half_unit}: {changed:?}"
        );
    }
    // A clone of a snapshot is a volume of the owner, with the snapshot's data.
    cl.a.cli_ok(&["volume", "clone", "s1", "--name", "c1"]);
    cl.a.cli_ok(&["export", "add", "c1", "--volume", "c1"]);
    assert_same(
        "clone of s1",
        &image(&cl.a, "c1"),
        &snapshot_image(&cl.a, "s1"),
    );
    // Refused clearly: a rollback of the replicated volume, a snapshot of a replica on
    // its holder.
    let e = cl.a.cli_fails(&["volume", "rollback", "db", "--to", "s1"]);
    assert!(e.contains("clone the snapshot"), "{e}");
    let e =
        cl.b.cli_fails(&["snapshot", "create", "db.node-a", "--name", "x"]);
    assert!(e.contains("held for node 'node-a'"), "{e}");
    // Deleting at the owner deletes every copy.
    let d = cl.a.json(&["snapshot", "delete", "s2"]);
    assert!(strings(&d["not_deleted"]).is_empty(), "{d}");
    for n in [&cl.a, &cl.b, &cl.c] {
        assert_eq!(snapshot_names(n), ["s1", "s3"], "after deleting s2");
    }
    // A replica out of sync at the point gets no copy, and says so.
    cl.c.kill9();
    // The next write finds node-c gone and waits for the timeout, then drops it.
    let mut c = nbd_connect(&cl.a, "db");
    write_generations(&mut c, &mut model, blocks / 2..blocks / 2 + 16, 3, BS);
    wait_for("node-c dropped", 20, || {
        state_of(&cl.a, "node-c:p")["state"] != "in_sync"
    });
    let r = snapshot(&cl.a, "db", "s4");
    assert_eq!(strings(&r["replicas"]), ["node-a:p", "node-b:p"], "{r}");
    let missing = strings(&r["missing"]);
    assert!(
        missing.len() == 1 && missing[0].starts_with("node-c:p"),
        "{r}"
    );
    write_generations(&mut c, &mut model, blocks / 2..blocks / 2 + 256, 4, BS);
    drop(c);
    cl.c.restart();
    wait_for("node-c in sync", 60, || all_in_sync(&cl.a));
    assert_eq!(snapshot_names(&cl.c), ["s1", "s3"]);
    let a_img = image(&cl.a, "db");
    assert_same("node-b vs owner", &image(&cl.b, "replica"), &a_img);
    assert_same("node-c vs owner", &image(&cl.c, "replica"), &a_img);
    let d = cl.a.json(&["snapshot", "delete", "s4"]);
    assert!(strings(&d["not_deleted"]).is_empty(), "{d}");
    assert_eq!(snapshot_names(&cl.b), ["s1", "s3"]);
}
