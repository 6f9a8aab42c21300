//! Failover of a cluster volume (issue 13) on a real etcd (started here) and three real
//! nodes on loopback.
//!
//! - A history checker in the spirit of Jepsen: four clients write unique stamps to a
//!   small set of blocks through the volume's owner, following it through two kill -9
//!   failovers (each client asks the cluster who owns the volume and reconnects there).
//!   For every block, the final data is a write that no acknowledged write started after
//!   the end of (so the last acknowledged write or a later one, and never a write that
//!   failed before a newer acknowledged one), and a block no acknowledged write reached
//!   may hold zeros. The time from the kill to the first write the new owner
//!   acknowledges is printed. The first old owner comes back, gives the volume up, and
//!   the new owner adds it back as a replica; every replica then compares equal, read
//!   directly on its node.
//! - etcd with three members: one killed, failover still works; all stopped: the volume
//!   keeps serving I/O, and a killed owner is only replaced once etcd is back.
//! - The owner cut off by nftables (its own network namespace): it acknowledges no
//!   write the new owner lacks, its reads stop within its read lease, and after the new
//!   owner acknowledged a write a read through the old owner fails or returns that write.
//! - A snapshot taken before the owner's kill is on the new owner (a clone of it reads
//!   the point's data), which snapshots and deletes on the replicas left.
//! - A snapshot create cut off by the owner's kill (a `test-hooks` hook SIGKILLs it after
//!   one replica's copy) is on every surviving replica or on none after the failover,
//!   its name can be taken again, and the old owner, back, keeps no orphan copy; a copy
//!   given up after a failover goes with its snapshots.

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_cluster::{volume_key, Etcd, NodeRecord, VolumeSpec};
use tessera_testkit::etcd::EtcdCluster;

const BLOCKS: u64 = 96;
const NAMES: [&str; 3] = ["node-a", "node-b", "node-c"];

fn members(tag: &str, etcd: &EtcdCluster) -> Vec<TestNode> {
    NAMES
        .iter()
        .zip(["z1", "z2", "z3"])
        .map(|(n, z)| cluster_member(&format!("{tag}-{n}"), n, z, etcd, 256, ""))
        .collect()
}

/// Every member is registered with its pool published.
fn wait_members(e: &Etcd) {
    wait_for("every member listed with its pool", 30, || {
        NAMES.iter().all(|n| {
            e.get(&tessera_cluster::node_key(n))
                .ok()
                .flatten()
                .and_then(|kv| serde_json::from_slice::<NodeRecord>(&kv.value).ok())
                .is_some_and(|r| !r.pools.is_empty())
        })
    });
}

fn etcd_client(etcd: &EtcdCluster) -> Etcd {
    let eps: Vec<String> = etcd.endpoints();
    Etcd::new(&eps, Duration::from_secs(1)).expect("etcd client")
}

/// Three nodes (node-a, node-b, node-c in zones z1..z3) on an etcd of `etcd_members`
/// members, every member listed, and volume `db` (64 MiB, three replicas) created and
/// exported by node-a. Bind in this order (`let (etcd, mut nodes, e) = ...`) so that
/// the nodes stop before etcd does.
fn three_nodes_with_db(tag: &str, etcd_members: usize) -> (EtcdCluster, Vec<TestNode>, Etcd) {
    let etcd = EtcdCluster::start(tag, etcd_members);
    let nodes = members(tag, &etcd);
    let e = etcd_client(&etcd);
    wait_members(&e);
    nodes[0].cli_ok(&["volume", "create", "db", "--size", "64M", "--replicas", "3"]);
    nodes[0].cli_ok(&["export", "add", "db", "--volume", "db"]);
    (etcd, nodes, e)
}

fn spec_of(e: &Etcd, volume: &str) -> Option<VolumeSpec> {
    e.get(&volume_key(volume))
        .ok()
        .flatten()
        .and_then(|kv| serde_json::from_slice(&kv.value).ok())
}

/// Every wanted replica listed and none out of sync or lost.
fn fully_redundant(e: &Etcd, volume: &str, copies: usize) -> bool {
    spec_of(e, volume).is_some_and(|s| {
        s.replicas.len() == copies && s.out_of_sync.is_empty() && s.lost.is_empty()
    })
}

/// Where the owner of `volume` serves NBD, as the cluster publishes it.
fn owner_nbd(e: &Etcd, volume: &str) -> Option<(String, String)> {
    let spec = spec_of(e, volume)?;
    let kv = e.get(&tessera_cluster::node_key(&spec.owner)).ok()??;
    let rec: NodeRecord = serde_json::from_slice(&kv.value).ok()?;
    let addr = rec.nbd.first()?.strip_prefix("nbd://")?.to_string();
    Some((spec.owner, addr))
}

/// An NBD client that follows the volume: after an error it asks the cluster who owns
/// the volume and reconnects there (within `patience`).
struct Follower {
    etcd: Etcd,
    volume: String,
    conn: Option<tessera_nbd::client::NbdClient>,
    patience: Duration,
}

impl Follower {
    fn new(etcd: Etcd, volume: &str) -> Follower {
        Follower {
            etcd,
            volume: volume.into(),
            conn: None,
            patience: Duration::from_secs(60),
        }
    }

    fn connect(&mut self) {
        let end = Instant::now() + self.patience;
        while Instant::now() < end {
            if let Some((_, addr)) = owner_nbd(&self.etcd, &self.volume) {
                if let Ok(s) = std::net::TcpStream::connect(&addr) {
                    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                    if let Ok(c) = tessera_nbd::client::NbdClient::from_stream(
                        s,
                        &self.volume,
                        tessera_nbd::client::ClientOptions::default(),
                    ) {
                        self.conn = Some(c);
                        return;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "no owner of '{}' served it within {:?}",
            self.volume, self.patience
        );
    }

    /// One write; Err when its outcome is unknown (the connection broke).
    fn write(&mut self, off: u64, data: &[u8]) -> Result<(), ()> {
        if self.conn.is_none() {
            self.connect();
        }
        let r = self.conn.as_mut().unwrap().write(off, data, false);
        r.map_err(|_| self.conn = None)
    }

    fn read(&mut self, off: u64, buf: &mut [u8]) {
        for _ in 0..3 {
            if self.conn.is_none() {
                self.connect();
            }
            if self.conn.as_mut().unwrap().read(off, buf).is_ok() {
                return;
            }
            self.conn = None;
        }
        panic!("reads keep failing");
    }
}

#[derive(Clone, Copy, Debug)]
struct Op {
    block: u64,
    stamp: u64,
    start: Duration,
    end: Duration,
    acked: bool,
}

/// A block whose final content the history does not allow.
#[derive(Debug, thiserror::Error)]
enum HistoryViolation {
    #[error("block {block} reads zeros but write {acked:?} was acknowledged")]
    LostWrite { block: u64, acked: Op },
    #[error("block {block} holds stamp {stamp:#x}, which no client wrote there")]
    NeverWritten { block: u64, stamp: u64 },
    #[error(
        "block {block} holds {holds:?}, but {newer:?} started after it ended and was acknowledged"
    )]
    Stale { block: u64, holds: Op, newer: Op },
}

/// Check the final content against the history (see the module documentation).
fn check_history(history: &[Op], final_stamps: &[u64]) -> Result<(), HistoryViolation> {
    for (b, &f) in final_stamps.iter().enumerate() {
        let b = b as u64;
        let acked: Vec<&Op> = history.iter().filter(|o| o.block == b && o.acked).collect();
        if f == 0 {
            if let Some(o) = acked.first() {
                return Err(HistoryViolation::LostWrite {
                    block: b,
                    acked: **o,
                });
            }
            continue;
        }
        let Some(w) = history.iter().find(|o| o.block == b && o.stamp == f) else {
            return Err(HistoryViolation::NeverWritten { block: b, stamp: f });
        };
        if let Some(newer) = acked.iter().find(|o| o.start > w.end) {
            return Err(HistoryViolation::Stale {
                block: b,
                holds: *w,
                newer: **newer,
            });
        }
    }
    Ok(())
}

fn read_stamps(f: &mut Follower) -> Vec<u64> {
    let mut buf = vec![0u8; 4096];
    (0..BLOCKS)
        .map(|b| {
            f.read(b * 4096, &mut buf);
            decode_stamped(b, &buf).unwrap_or_else(|e| panic!("block {b}: {e}"))
        })
        .collect()
}

/// The replica of `volume` on `n`, every byte of it (exported read-only there).
fn replica_image(n: &TestNode, volume: &str, export: &str) -> Vec<u8> {
    n.cli_ok(&["export", "add", export, "--volume", volume, "--read-only"]);
    // Through the node's Unix socket: it answers in a network namespace too.
    let mut c = unix_client(n, export);
    let mut img = vec![0u8; usize::try_from(c.size()).unwrap()];
    for (i, chunk) in img.chunks_mut(4 << 20).enumerate() {
        c.read(i as u64 * (4 << 20), chunk).unwrap();
    }
    drop(c);
    n.cli_ok(&["export", "remove", export]);
    img
}

/// Wait for the volume to be fully redundant; on a timeout, show the spec and what the
/// nodes logged about the volume.
fn wait_redundant(e: &Etcd, nodes: &[TestNode], what: &str) {
    let end = Instant::now() + Duration::from_secs(90);
    while Instant::now() < end {
        if fully_redundant(e, "db", 3) {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for (i, n) in nodes.iter().enumerate() {
        let log = n.log_text();
        let _ = std::fs::write(
            std::env::temp_dir().join(format!("failover-{}.log", NAMES[i])),
            &log,
        );
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("replica"))
            .collect();
        eprintln!(
            "--- {} ---\n{}",
            NAMES[i],
            lines[lines.len().saturating_sub(40)..].join("\n")
        );
    }
    panic!("timed out waiting for {what}: spec {:?}", spec_of(e, "db"));
}

fn index_of(name: &str) -> usize {
    NAMES.iter().position(|n| *n == name).expect("a member")
}

/// Wait until the owner is not `old`; returns the new owner.
fn wait_new_owner(e: &Etcd, volume: &str, old: &str, secs: u64) -> String {
    let mut owner = String::new();
    wait_for(
        &format!("a new owner of {volume} (was {old})"),
        secs,
        || {
            owner = spec_of(e, volume).map(|s| s.owner).unwrap_or_default();
            !owner.is_empty() && owner != old
        },
    );
    owner
}

#[test]
fn history_holds_through_two_owner_kills_and_the_old_owner_rejoins() {
    if !require_tool("etcd") {
        return;
    }
    let (etcd, mut nodes, e) = three_nodes_with_db("fo", 1);
    assert_eq!(spec_of(&e, "db").unwrap().owner, "node-a");

    let t0 = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let history = Arc::new(Mutex::new(Vec::<Op>::new()));
    let last_ack = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..4u64)
        .map(|id| {
            let (stop, history, last_ack) = (stop.clone(), history.clone(), last_ack.clone());
            let mut f = Follower::new(etcd_client(&etcd), "db");
            std::thread::spawn(move || {
                let mut rng = Rng(id * 7919 + 17);
                let mut seq = 0u64;
                while !stop.load(Acquire) {
                    seq += 1;
                    let block = rng.below(BLOCKS);
                    let stamp = (id + 1) << 40 | seq;
                    let start = t0.elapsed();
                    let ok = f.write(block * 4096, &stamped(block, stamp)).is_ok();
                    let end = t0.elapsed();
                    if ok {
                        last_ack.store(end.as_millis() as u64, Release);
                    }
                    history.lock().unwrap().push(Op {
                        block,
                        stamp,
                        start,
                        end,
                        acked: ok,
                    });
                }
            })
        })
        .collect();
    let acks_after = |t: Duration| {
        wait_for("a write acknowledged by the new owner", 60, || {
            last_ack.load(Acquire) > t.as_millis() as u64
        });
        Duration::from_millis(last_ack.load(Acquire)) - t
    };

    // 1. Kill the owner under load.
    std::thread::sleep(Duration::from_millis(1500));
    let killed_at = t0.elapsed();
    nodes[0].kill9();
    let owner1 = wait_new_owner(&e, "db", "node-a", 30);
    let took = acks_after(killed_at);
    println!(
        "FAILOVER 1: node-a killed, {owner1} acknowledged a write {} ms later",
        took.as_millis()
    );
    assert_eq!(spec_of(&e, "db").unwrap().epoch, 2);

    // 2. The old owner comes back: it gives the volume up and is added back as a
    // replica, copied from the new owner; the volume is fully redundant again.
    nodes[0].restart();
    wait_redundant(&e, &nodes, "three replicas in sync again");
    let log = nodes[0].log_text();
    assert!(
        log.contains("giving it up"),
        "node-a did not give the volume up:\n{log}"
    );

    // 3. Kill the new owner.
    std::thread::sleep(Duration::from_millis(1000));
    let killed_at = t0.elapsed();
    nodes[index_of(&owner1)].kill9();
    let owner2 = wait_new_owner(&e, "db", &owner1, 30);
    let took = acks_after(killed_at);
    println!(
        "FAILOVER 2: {owner1} killed, {owner2} acknowledged a write {} ms later",
        took.as_millis()
    );
    assert_eq!(spec_of(&e, "db").unwrap().epoch, 3);
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Release);
    for c in clients {
        c.join().unwrap();
    }

    // 4. The history holds.
    let history = history.lock().unwrap().clone();
    let acked = history.iter().filter(|o| o.acked).count();
    let failed = history.len() - acked;
    println!(
        "HISTORY: {} writes, {acked} acknowledged, {failed} with unknown outcome",
        history.len()
    );
    assert!(acked > 100, "too few writes to mean anything: {acked}");
    let mut reader = Follower::new(etcd_client(&etcd), "db");
    let stamps = read_stamps(&mut reader);
    if let Err(why) = check_history(&history, &stamps) {
        panic!("history violated: {why}");
    }

    // 5. The surviving replicas compare equal once in sync, read on each node.
    let killed = index_of(&owner1);
    nodes[killed].restart();
    wait_redundant(
        &e,
        &nodes,
        "three replicas in sync after the second failover",
    );
    let owner_img = replica_image(&nodes[index_of(&owner2)], "db", "check");
    for (i, n) in nodes.iter().enumerate() {
        if i != index_of(&owner2) {
            let img = replica_image(n, "db", "check");
            assert!(
                img == owner_img,
                "{}'s replica differs from the owner's",
                NAMES[i]
            );
        }
    }
    assert_eq!(spec_of(&e, "db").unwrap().epoch, 3);
}

/// Write blocks `0..BLOCKS` at generation `gen` through `f` (each acknowledged).
fn write_all_blocks(f: &mut Follower, gen: u64) {
    for b in 0..BLOCKS {
        f.write(b * 4096, &stamped(b, gen))
            .unwrap_or_else(|_| panic!("write of block {b} at generation {gen} failed"));
    }
}

fn assert_generation(f: &mut Follower, gen: u64, what: &str) {
    let stamps = read_stamps(f);
    assert!(
        stamps.iter().all(|&s| s == gen),
        "{what}: expected generation {gen} everywhere, read {stamps:?}"
    );
}

#[test]
fn one_etcd_member_lost_failover_works_all_lost_io_goes_on_and_failover_waits() {
    if !require_tool("etcd") {
        return;
    }
    let (mut etcd, mut nodes, e) = three_nodes_with_db("foe", 3);
    let mut f = Follower::new(etcd_client(&etcd), "db");
    write_all_blocks(&mut f, 1);

    // One of three etcd members killed: the cluster keeps working, failover included.
    etcd.members[2].kill9();
    nodes[0].kill9();
    let owner1 = wait_new_owner(&e, "db", "node-a", 30);
    assert_generation(&mut f, 1, "after a failover with one etcd member down");
    write_all_blocks(&mut f, 2);
    wait_for("the other replica copied and recorded in sync", 30, || {
        spec_of(&e, "db").is_some_and(|s| s.replicas.len() == 2 && s.out_of_sync.is_empty())
    });

    // etcd stopped entirely: the owner keeps serving reads and writes, past the lease.
    etcd.members[0].kill9();
    etcd.members[1].kill9();
    let until = Instant::now() + Duration::from_secs(5);
    let mut gen = 2;
    while Instant::now() < until {
        gen += 1;
        write_all_blocks(&mut f, gen);
        assert_generation(&mut f, gen, "with etcd down");
    }

    // The owner killed while etcd is down: nobody can take over until etcd is back.
    let survivor = if owner1 == "node-b" {
        "node-c"
    } else {
        "node-b"
    };
    nodes[index_of(&owner1)].kill9();
    std::thread::sleep(Duration::from_secs(5));
    let exports = nodes[index_of(survivor)].json(&["export", "list"]);
    assert!(
        exports.as_array().unwrap().is_empty(),
        "{survivor} serves the volume without etcd: {exports}"
    );
    etcd.members[0].restart();
    etcd.members[1].restart();
    let owner2 = wait_new_owner(&e, "db", &owner1, 60);
    assert_eq!(owner2, survivor);
    assert_generation(&mut f, gen, "after the failover that waited for etcd");
    write_all_blocks(&mut f, gen + 1);
    assert_generation(&mut f, gen + 1, "on the last owner");
}

/// An NBD client of `export` on node `n` through its Unix socket (reachable whatever the
/// network says: a node in a cut-off namespace).
fn unix_client(n: &TestNode, export: &str) -> tessera_nbd::client::NbdClient {
    let s = std::os::unix::net::UnixStream::connect(n.dir.join("nbd.sock")).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    tessera_nbd::client::NbdClient::from_stream(
        s,
        export,
        tessera_nbd::client::ClientOptions::default(),
    )
    .expect("NBD handshake")
}

/// [`unix_client`], or None when node `n` no longer takes the connection or the handshake.
fn try_unix_client(n: &TestNode, export: &str) -> Option<tessera_nbd::client::NbdClient> {
    client_with_timeout(n, export, Duration::from_secs(30))
}

/// [`try_unix_client`] whose requests time out after `timeout` (a read the node holds
/// back counts as not served; the client is then dropped).
fn client_with_timeout(
    n: &TestNode,
    export: &str,
    timeout: Duration,
) -> Option<tessera_nbd::client::NbdClient> {
    let s = std::os::unix::net::UnixStream::connect(n.dir.join("nbd.sock")).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    tessera_nbd::client::NbdClient::from_stream(
        s,
        export,
        tessera_nbd::client::ClientOptions::default(),
    )
    .ok()
}

/// The stamps of the first `BLOCKS` blocks of a whole-volume image.
fn stamps_of(img: &[u8]) -> Vec<u64> {
    (0..BLOCKS)
        .map(|b| {
            let at = (b * 4096) as usize;
            decode_stamped(b, &img[at..at + 4096]).unwrap_or_else(|e| panic!("block {b}: {e}"))
        })
        .collect()
}

#[test]
fn a_partitioned_owner_acknowledges_nothing_the_new_owner_lacks_and_rejoins_after_healing() {
    let Some(ns) = tessera_testkit::netns::NetNs::create() else {
        return;
    };
    if !require_tool("etcd") {
        return;
    }
    // etcd and node-b/node-c on the test's end of the veth pair; node-a (the owner) in the
    // namespace, whose nftables table cuts it off from all of them.
    let etcd = EtcdCluster::start_on("fop", 1, &ns.host_addr);
    let extra = "fence_wait_ms = 4000";
    let nodes: Vec<TestNode> = [("node-a", "z1"), ("node-b", "z2"), ("node-c", "z3")]
        .iter()
        .map(|(name, zone)| {
            let (ip, netns) = if *name == "node-a" {
                (ns.addr.as_str(), Some(ns.name.as_str()))
            } else {
                (ns.host_addr.as_str(), None)
            };
            cluster_member_at(
                &format!("fop-{name}"),
                name,
                zone,
                &etcd,
                256,
                extra,
                ip,
                netns,
            )
        })
        .collect();
    let e = etcd_client(&etcd);
    wait_members(&e);
    nodes[0].cli_ok(&["volume", "create", "db", "--size", "64M", "--replicas", "3"]);
    nodes[0].cli_ok(&["export", "add", "db", "--volume", "db"]);

    let t0 = Instant::now();
    let mut history = Vec::new();
    let mut cl = unix_client(&nodes[0], "db");
    let mut seq = 0u64;
    let mut write = |cl: &mut tessera_nbd::client::NbdClient, history: &mut Vec<Op>| {
        seq += 1;
        let block = seq % BLOCKS;
        let start = t0.elapsed();
        let acked = cl.write(block * 4096, &stamped(block, seq), false).is_ok();
        history.push(Op {
            block,
            stamp: seq,
            start,
            end: t0.elapsed(),
            acked,
        });
        acked
    };
    for _ in 0..2 * BLOCKS {
        assert!(write(&mut cl, &mut history), "write before the partition");
    }

    // Cut node-a off. Its reads stop within its read lease (half the 2 s ownership
    // lease), before a new owner can exist: a read through it is served (the data it
    // had) until then, and from then on waits for the lease (bounded, then fails). A
    // probe whose reads time out after 300 ms sees when reads stop being served.
    ns.cut();
    let cut_at = Instant::now();
    let mut buf = vec![0u8; 4096];
    let mut refused_after = None;
    let probe_timeout = Duration::from_millis(300);
    let mut probe = client_with_timeout(&nodes[0], "db", probe_timeout);
    while refused_after.is_none() && cut_at.elapsed() < Duration::from_secs(5) {
        let asked = cut_at.elapsed();
        if probe.as_mut().is_none_or(|p| p.read(0, &mut buf).is_err()) {
            refused_after = Some(asked);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(probe);
    let epoch_when_refused = spec_of(&e, "db").map_or(0, |s| s.epoch);
    println!(
        "PARTITION: the old owner refused reads {refused_after:?} after the cut (spec at epoch {epoch_when_refused} then)"
    );
    if let Some(c) = try_unix_client(&nodes[0], "db") {
        cl = c;
    }
    // A client still attached to it keeps writing.
    let mut new_epoch_at = None;
    let mut after_new_epoch = 0;
    let until = Instant::now() + Duration::from_secs(60);
    while after_new_epoch < 3 && Instant::now() < until {
        let acked = write(&mut cl, &mut history);
        let last = *history.last().unwrap();
        if let Some(t) = new_epoch_at {
            if last.start > t {
                after_new_epoch += 1;
                assert!(
                    !acked,
                    "the cut-off old owner acknowledged {last:?} after the new epoch"
                );
            }
        } else if spec_of(&e, "db").is_some_and(|s| s.epoch == 2) {
            new_epoch_at = Some(t0.elapsed());
        }
        if !acked {
            // The connection may be gone after an error: attach again, still to node-a.
            if let Some(c) = try_unix_client(&nodes[0], "db") {
                cl = c;
            }
        }
    }
    let new_epoch_at = new_epoch_at.expect("a new owner took over while node-a was cut off");
    let spec = spec_of(&e, "db").unwrap();
    assert_ne!(spec.owner, "node-a");
    println!(
        "PARTITION: new owner {} at epoch {}, seen {} ms after the cut; {} writes to the old owner, {} acknowledged",
        spec.owner,
        spec.epoch,
        new_epoch_at.as_millis(),
        history.len(),
        history.iter().filter(|o| o.acked).count()
    );

    // The new owner's data holds every write the old owner acknowledged.
    let mut f = Follower::new(etcd_client(&etcd), "db");
    let stamps = read_stamps(&mut f);
    if let Err(why) = check_history(&history, &stamps) {
        panic!("history violated across the partition: {why}");
    }
    // Nothing the old owner sent after the new epoch reached a replica (read directly).
    for n in &nodes[1..] {
        let img = replica_image(n, "db", "check");
        for (b, s) in stamps_of(&img).iter().enumerate() {
            if let Some(w) = history.iter().find(|o| o.stamp == *s && o.stamp != 0) {
                assert!(
                    w.start < new_epoch_at,
                    "block {b} of a replica holds {w:?}, sent by the old owner after the new epoch"
                );
            }
        }
    }

    // The new owner acknowledges a new generation of every block; a read through the
    // old owner (still cut off, still exporting its copy) fails or returns it, never the
    // data the old owner had (issue 20 item 8: stale reads from a partitioned owner).
    const NEW_GEN: u64 = 0x5eed_0000_0000;
    for b in 0..BLOCKS {
        f.write(b * 4096, &stamped(b, NEW_GEN + b))
            .unwrap_or_else(|_| panic!("write of block {b} through the new owner failed"));
    }
    // Every block in one read (a read held back for the lease costs the probe's timeout
    // once), then a few blocks one by one.
    let (mut refused, mut served) = (0, 0);
    let mut check = |first: u64, count: u64| {
        let mut img = vec![0u8; usize::try_from(count * 4096).unwrap()];
        let ok = client_with_timeout(&nodes[0], "db", Duration::from_secs(1))
            .is_some_and(|mut c| c.read(first * 4096, &mut img).is_ok());
        if !ok {
            refused += count;
            return;
        }
        for b in first..first + count {
            let at = usize::try_from((b - first) * 4096).unwrap();
            let got =
                decode_stamped(b, &img[at..at + 4096]).unwrap_or_else(|e| panic!("block {b}: {e}"));
            assert_eq!(
                got,
                NEW_GEN + b,
                "a read of block {b} through the cut-off old owner returned stamp {got:#x}, \
                 older than the write the new owner acknowledged"
            );
            served += 1;
        }
    };
    check(0, BLOCKS);
    for b in [0, BLOCKS / 2, BLOCKS - 1] {
        check(b, 1);
    }
    println!("PARTITION: reads through the old owner after the new owner's writes: {refused} refused, {served} served the new data");
    // The lease (1 s) from the last ping before the cut, plus the ping period and
    // scheduling slack on a loaded machine: within the 2 s ownership lease + 1 s.
    let refused_after =
        refused_after.expect("the cut-off owner still served reads 5 s after the cut");
    assert!(
        refused_after < Duration::from_secs(3),
        "reads on the cut-off owner stopped only {refused_after:?} after the cut"
    );

    // Heal: node-a gives its stale copy up (deleted once the client attached to it,
    // which only saw errors since the new epoch, goes) and comes back as a replica.
    ns.heal();
    std::thread::sleep(Duration::from_secs(3));
    drop(cl);
    wait_redundant(&e, &nodes, "node-a back as a replica after healing");
    let owner = &nodes[index_of(&spec_of(&e, "db").unwrap().owner)];
    let owner_img = replica_image(owner, "db", "check");
    for n in &nodes {
        if !std::ptr::eq(n, owner) {
            assert!(
                replica_image(n, "db", "check") == owner_img,
                "a replica differs"
            );
        }
    }
}

#[test]
fn fio_verify_through_a_non_owner_rides_out_the_owners_kill() {
    if !require_tool("etcd") || !require_tool("fio") {
        return;
    }
    let (_etcd, mut nodes, e) = three_nodes_with_db("fof", 1);
    // Every replica holder serves a (standby) NVMe/TCP path of the volume.
    for n in &nodes[1..] {
        wait_for("a standby cluster path", 20, || {
            n.json(&["nvmf", "subsystem", "list"])
                .to_string()
                .contains(":cluster:db")
                || tessera_http::request(
                    &tessera_http::Endpoint::parse(&n.api()),
                    "GET",
                    "/v1/nvmf/cluster-paths",
                    None,
                )
                .is_ok_and(|(_, t)| t.contains("\"db\""))
        });
    }
    // fio (crc32c verify) through node-c, which does not own the volume: its NBD proxy
    // reaches the owner over NVMe/TCP and follows the optimized path.
    let uri = nodes[2].uri("db");
    let fio = spawn_fio_randwrite(
        &nodes[2].dir,
        "fo",
        &uri,
        &[
            "--iodepth=8",
            "--size=16M",
            "--rate_iops=1500",
            "--loops=3",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--do_verify=1",
        ],
    );
    std::thread::sleep(Duration::from_secs(3));
    let killed = Instant::now();
    nodes[0].kill9();
    let owner = wait_new_owner(&e, "db", "node-a", 30);
    println!(
        "FIO FAILOVER: {owner} owns db {} ms after the kill",
        killed.elapsed().as_millis()
    );
    let out = fio.wait_with_output().expect("fio");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "fio failed ({}):\n{text}", out.status);
    assert!(
        !text.contains("verify:") && !text.contains("bad magic") && text.contains("err= 0"),
        "fio reported errors:\n{text}"
    );
    for l in text.lines().filter(|l| {
        l.contains("clat") && l.contains("max=") || l.trim_start().starts_with("write:")
    }) {
        println!("FIO through the failover: {}", l.trim());
    }
}

#[test]
fn a_replica_lost_past_the_grace_period_is_replaced_on_another_node() {
    if !require_tool("etcd") {
        return;
    }
    let etcd = EtcdCluster::start("fog", 1);
    let mut nodes: Vec<TestNode> = ["node-a", "node-b", "node-c", "node-d"]
        .iter()
        .zip(["z1", "z2", "z3", "z4"])
        .map(|(n, z)| cluster_member(&format!("fog-{n}"), n, z, &etcd, 256, "grace_ms = 3000"))
        .collect();
    let e = etcd_client(&etcd);
    wait_for("four members listed with their pools", 30, || {
        ["node-a", "node-b", "node-c", "node-d"].iter().all(|n| {
            e.get(&tessera_cluster::node_key(n))
                .ok()
                .flatten()
                .and_then(|kv| serde_json::from_slice::<NodeRecord>(&kv.value).ok())
                .is_some_and(|r| !r.pools.is_empty())
        })
    });
    nodes[0].cli_ok(&["volume", "create", "db", "--size", "64M", "--replicas", "3"]);
    nodes[0].cli_ok(&["export", "add", "db", "--volume", "db"]);
    let spec = spec_of(&e, "db").unwrap();
    let victim = spec.replicas[2].split(':').next().unwrap().to_string();
    let spare = ["node-b", "node-c", "node-d"]
        .into_iter()
        .find(|n| {
            !spec
                .replicas
                .iter()
                .any(|p| p.starts_with(&format!("{n}:")))
        })
        .unwrap();
    let mut f = Follower::new(etcd_client(&etcd), "db");
    write_all_blocks(&mut f, 1);

    // The victim dies and stays away: after the grace period its replica is removed,
    // recorded lost, and a new one is placed on the spare node and copied.
    let vi = ["node-a", "node-b", "node-c", "node-d"]
        .iter()
        .position(|n| *n == victim)
        .unwrap();
    nodes[vi].kill9();
    let t = Instant::now();
    wait_for("the lost replica replaced and copied", 60, || {
        spec_of(&e, "db").is_some_and(|s| {
            s.replicas.len() == 3
                && s.replicas
                    .iter()
                    .any(|p| p.starts_with(&format!("{spare}:")))
                && s.out_of_sync.is_empty()
                && s.lost.is_empty()
        })
    });
    println!(
        "REPLACED: {victim}'s replica on {spare}, fully redundant {} ms after the kill (grace 3 s)",
        t.elapsed().as_millis()
    );
    // The copy holds the data; the rebuild slot was given back.
    write_all_blocks(&mut f, 2);
    let si = ["node-a", "node-b", "node-c", "node-d"]
        .iter()
        .position(|n| *n == spare)
        .unwrap();
    wait_for("the spare in sync after the last writes", 20, || {
        spec_of(&e, "db").is_some_and(|s| s.out_of_sync.is_empty())
    });
    let img = replica_image(&nodes[si], "db", "check");
    assert!(
        stamps_of(&img).iter().all(|&s| s == 2),
        "the new replica lacks writes"
    );
    wait_for("no rebuild running", 20, || {
        e.list(&format!("{}rebuilds/", tessera_cluster::PREFIX))
            .is_ok_and(|l| l.is_empty())
    });
}

/// A snapshot taken before a failover is on the new owner, as its own replica's copy: a
/// clone of it there reads the data of the point. The new owner snapshots the volume on
/// the replicas in sync with it, and deletes a snapshot on all of them.
#[test]
fn a_snapshot_taken_before_a_failover_is_on_the_new_owner() {
    if !require_tool("etcd") {
        return;
    }
    let (etcd, mut nodes, e) = three_nodes_with_db("fos", 1);
    let mut f = Follower::new(etcd_client(&etcd), "db");
    write_all_blocks(&mut f, 1);
    let r = nodes[0].json(&["snapshot", "create", "db", "--name", "s1"]);
    assert_eq!(r["replicas"].as_array().map(Vec::len), Some(3), "{r}");
    write_all_blocks(&mut f, 2);
    nodes[0].kill9();
    let owner = wait_new_owner(&e, "db", "node-a", 30);
    assert_generation(&mut f, 2, "after the failover");
    let n = &nodes[index_of(&owner)];
    n.cli_ok(&["volume", "clone", "s1", "--name", "c1"]);
    let img = replica_image(n, "c1", "c1-read");
    assert!(
        stamps_of(&img).iter().all(|&s| s == 1),
        "the clone of s1 on the new owner {owner} is not generation 1"
    );
    write_all_blocks(&mut f, 3);
    // The volume is on the new owner and the third node now (node-a is down), once the
    // third node's copy from the new owner is done.
    let third = NAMES
        .iter()
        .find(|m| **m != "node-a" && **m != owner)
        .unwrap();
    wait_for("the third node's replica in sync", 60, || {
        n.json(&["volume", "show", "db"])["replicas"]
            .as_array()
            .is_some_and(|rs| {
                rs.iter().any(|r| {
                    r["place"].as_str().is_some_and(|p| p.starts_with(third))
                        && r["state"] == "in_sync"
                })
            })
    });
    let r = n.json(&["snapshot", "create", "db", "--name", "s2"]);
    let held: Vec<&str> = r["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str())
        .collect();
    assert_eq!(held.len(), 2, "{r}");
    assert!(!held.iter().any(|p| p.starts_with("node-a")), "{r}");
    let s2 = replica_image(&nodes[index_of(third)], "s2", "s2-read");
    assert!(
        stamps_of(&s2).iter().all(|&s| s == 3),
        "{third}'s copy of s2 is not generation 3"
    );
    let d = n.json(&["snapshot", "delete", "s2"]);
    assert!(d.get("not_deleted").is_none(), "{d}");
    let left = nodes[index_of(third)].json(&["snapshot", "list"]);
    assert!(
        !left.as_array().unwrap().iter().any(|s| s["name"] == "s2"),
        "s2 stays on {third}: {left}"
    );
}

/// The names of the snapshots node `n` lists.
fn snapshot_names(n: &TestNode) -> Vec<String> {
    n.json(&["snapshot", "list"])
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["name"].as_str().map(str::to_string))
        .collect()
}

/// A snapshot create cut off by the owner's death (SIGKILL through the `test-hooks`
/// hook, once one of the two other replicas took its copy, before the third is asked) is
/// on every surviving replica or on none after the failover, a retry of the same name
/// on the new owner takes it on every replica in sync, and the old owner, back, holds no
/// orphan copy.
#[test]
fn a_snapshot_cut_off_by_the_owners_kill_is_on_every_replica_or_none() {
    if !require_tool("etcd") {
        return;
    }
    let (etcd, mut nodes, e) = three_nodes_with_db("fsk", 1);
    let mut f = Follower::new(etcd_client(&etcd), "db");
    write_all_blocks(&mut f, 1);
    wait_redundant(&e, &nodes, "three replicas in sync");
    let hook = nodes[0]
        .data_dir
        .join("test-hooks/snapshot-kill-after-copies");
    std::fs::create_dir_all(hook.parent().unwrap()).unwrap();
    std::fs::write(&hook, "1").unwrap();
    let out = nodes[0].cli(&["snapshot", "create", "db", "--name", "s1"]);
    assert!(
        !out.status.success(),
        "the create answered although the hook killed its node midway: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_for("node-a killed by the hook", 10, || !nodes[0].is_running());
    nodes[0].kill9();
    std::fs::remove_file(&hook).unwrap();
    // Midway: one of the two other replicas has its copy (the lease, 2 s, has not
    // expired yet, so nobody took the volume over).
    let copies = [1, 2]
        .iter()
        .filter(|&&i| snapshot_names(&nodes[i]).iter().any(|s| s == "s1"))
        .count();
    assert_eq!(copies, 1, "the hook did not stop the create after one copy");

    let owner = wait_new_owner(&e, "db", "node-a", 30);
    wait_for("the other survivor copied from the new owner", 60, || {
        spec_of(&e, "db").is_some_and(|s| s.replicas.len() == 2 && s.out_of_sync.is_empty())
    });
    let held: Vec<&str> = ["node-b", "node-c"]
        .into_iter()
        .filter(|m| {
            snapshot_names(&nodes[index_of(m)])
                .iter()
                .any(|s| s == "s1")
        })
        .collect();
    assert!(
        held.is_empty() || held.len() == 2,
        "after the failover s1 is on {held:?} only, not on every surviving replica nor on none"
    );
    // A retry of the name on the new owner works: every replica in sync takes it.
    let n = &nodes[index_of(&owner)];
    let out = n.cli(&["snapshot", "create", "db", "--name", "s1", "--json"]);
    assert!(
        out.status.success(),
        "a retry of s1 on the new owner {owner} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["replicas"].as_array().map(Vec::len), Some(2), "{r}");
    assert!(r["missing"].as_array().is_none_or(|m| m.is_empty()), "{r}");
    for m in ["node-b", "node-c"] {
        assert!(
            snapshot_names(&nodes[index_of(m)])
                .iter()
                .any(|s| s == "s1"),
            "{m} has no copy of the retried s1"
        );
    }
    // The old owner comes back, gives its copy up (with its copy of the cut-off s1) and
    // is added back as a fresh replica: no orphan snapshot stays there.
    nodes[0].restart();
    wait_redundant(&e, &nodes, "node-a back as a replica");
    let left = snapshot_names(&nodes[0]);
    assert!(left.is_empty(), "node-a keeps orphan snapshots {left:?}");
}

/// A stale copy given up after a failover goes with its snapshots (the new owner's
/// replicas have them); a snapshot a clone reads through stays with the clone, which is a
/// user's volume.
#[test]
fn a_given_up_copy_takes_its_snapshots_with_it() {
    if !require_tool("etcd") {
        return;
    }
    let (etcd, mut nodes, e) = three_nodes_with_db("fsg", 1);
    let mut f = Follower::new(etcd_client(&etcd), "db");
    write_all_blocks(&mut f, 1);
    wait_redundant(&e, &nodes, "three replicas in sync");
    for s in ["s0", "s1"] {
        let r = nodes[0].json(&["snapshot", "create", "db", "--name", s]);
        assert_eq!(r["replicas"].as_array().map(Vec::len), Some(3), "{r}");
    }
    nodes[0].cli_ok(&["volume", "clone", "s0", "--name", "c0"]);
    nodes[0].kill9();
    let owner = wait_new_owner(&e, "db", "node-a", 30);
    nodes[0].restart();
    wait_redundant(&e, &nodes, "node-a back as a replica");
    let left = snapshot_names(&nodes[0]);
    assert!(
        !left.iter().any(|s| s == "s1"),
        "the given-up copy's snapshot s1 stays on node-a: {left:?}"
    );
    assert_eq!(
        left,
        ["s0"],
        "only s0, which clone c0 reads, stays on node-a"
    );
    nodes[0].cli_ok(&["volume", "show", "c0"]);
    let kept = snapshot_names(&nodes[index_of(&owner)]);
    assert!(
        ["s0", "s1"].iter().all(|s| kept.iter().any(|k| k == s)),
        "the new owner {owner} lost a snapshot: {kept:?}"
    );
}
