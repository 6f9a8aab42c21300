//! iSCSI ALUA across nodes (issue 23): every node holding a replica of a cluster volume
//! serves target `iqn.2026-11.io.tessera:cluster:VOLUME`, LUN 0, its port in a target
//! port group of its own; the owner's group is active/optimized, the others standby
//! (docs/iscsi.md "ALUA"). On a real etcd and three real nodes, seen by libiscsi
//! (`tools/iscsi-alua.c`, compiled here):
//!
//! - each path: INQUIRY's TPGS (implicit), the port and group designators, REPORT TARGET
//!   PORT GROUPS (both header formats, every group with its state), REPORT SUPPORTED
//!   OPERATION CODES listing it; on a standby path TEST UNIT READY and READ get NOT
//!   READY 04h/0Bh while READ CAPACITY answers;
//! - a host writing through every path as multipath would (starting on a standby one,
//!   led by the standby sense and RTPG to the owner's), while the owner is killed -9:
//!   the group of the node that takes over flips to active/optimized (a unit attention
//!   tells the sessions), writes go on through it, and the volume read back through it
//!   holds every acknowledged write byte for byte.

// Test code: the values cast here are the test's own small sizes and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_cluster::{volume_key, Etcd, NodeRecord, VolumeSpec};
use tessera_testkit::etcd::EtcdCluster;

const NAMES: [&str; 3] = ["node-a", "node-b", "node-c"];
const IQN: &str = "iqn.2026-11.io.tessera:cluster:db";
const VOL_BLOCKS: u64 = (64 << 20) / 512;
/// The writer's 4 KiB blocks (the first 2 MiB of the volume).
const BLOCKS: usize = 512;
const BS: usize = 4096;

/// A C tool of `tools/`, built for this test (None: the test skips).
fn tool(name: &str) -> Option<PathBuf> {
    libiscsi_tool(name, Path::new(env!("CARGO_TARGET_TMPDIR")))
}

fn etcd_client(etcd: &EtcdCluster) -> Etcd {
    Etcd::new(&etcd.endpoints(), Duration::from_secs(1)).expect("etcd client")
}

fn spec_of(e: &Etcd, volume: &str) -> Option<VolumeSpec> {
    e.get(&volume_key(volume))
        .ok()
        .flatten()
        .and_then(|kv| serde_json::from_slice(&kv.value).ok())
}

/// One group of REPORT TARGET PORT GROUPS as the tool prints it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Group {
    id: i64,
    state: i64,
    supported: i64,
    rel_port: i64,
}

/// What `iscsi-alua probe` saw on one path.
#[derive(Debug, Default)]
struct Probe {
    lines: BTreeMap<String, Vec<i64>>,
    rtpg: Vec<Group>,
    rtpg_short: Vec<Group>,
    text: String,
}

impl Probe {
    fn get(&self, key: &str) -> &[i64] {
        self.lines
            .get(key)
            .map(Vec::as_slice)
            .unwrap_or_else(|| panic!("probe printed no '{key}':\n{}", self.text))
    }

    fn one(&self, key: &str) -> i64 {
        self.get(key)[0]
    }

    /// (status, sense key, ASC/ASCQ) of a command's line.
    fn result(&self, key: &str) -> (i64, i64, i64) {
        let v = self.get(key);
        (v[0], v[1], v[2])
    }

    /// The state of group `id`, if listed.
    fn state_of(&self, id: i64) -> Option<i64> {
        self.rtpg.iter().find(|g| g.id == id).map(|g| g.state)
    }
}

fn number(w: &str) -> Option<i64> {
    match w.strip_prefix("0x") {
        Some(h) => i64::from_str_radix(h, 16).ok(),
        None => w.parse().ok(),
    }
}

fn groups(words: &[&str]) -> Vec<Group> {
    words
        .iter()
        .filter_map(|w| {
            let v: Vec<i64> = w.split(':').filter_map(number).collect();
            (v.len() == 4).then(|| Group {
                id: v[0],
                state: v[1],
                supported: v[2],
                rel_port: v[3],
            })
        })
        .collect()
}

/// `iscsi-alua probe` failed (no such target yet, say): what it printed.
#[derive(Debug, thiserror::Error)]
#[error("iscsi-alua probe {url}:\n{output}")]
struct ProbeFailed {
    url: String,
    output: String,
}

/// What `iscsi-alua probe` saw on `url`.
fn probe(alua: &Path, url: &str) -> Result<Probe, ProbeFailed> {
    let o = Command::new(alua)
        .args(["probe", url])
        .stdin(Stdio::null())
        .output()
        .expect("run iscsi-alua probe");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if !o.status.success() {
        return Err(ProbeFailed {
            url: url.to_string(),
            output: text,
        });
    }
    let mut p = Probe {
        text: text.clone(),
        ..Probe::default()
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&key, rest)) = words.split_first() else {
            continue;
        };
        match key {
            "rtpg" if rest.first() != Some(&"status") => p.rtpg = groups(rest),
            "rtpg-short" if rest.first() != Some(&"status") => p.rtpg_short = groups(rest),
            _ => {
                // "key N" or "key status S key K ascq A" / "readcap status S blocks N".
                let nums: Vec<i64> = rest.iter().filter_map(|w| number(w)).collect();
                p.lines.insert(key.to_string(), nums);
            }
        }
    }
    Ok(p)
}

fn url(port: u16) -> String {
    format!("iscsi://127.0.0.1:{port}/{IQN}/0")
}

/// Probe the path on `port` until `ok` holds for what it reports (within `secs`).
fn probe_until(
    alua: &Path,
    port: u16,
    secs: u64,
    what: &str,
    ok: impl Fn(&Probe) -> bool,
) -> Probe {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        let last = match probe(alua, &url(port)) {
            Ok(p) if ok(&p) => return p,
            Ok(p) => p.text,
            Err(e) => e.to_string(),
        };
        assert!(
            Instant::now() < end,
            "timed out waiting for {what} on port {port}; last probe:\n{last}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The 4 KiB the writer writes to `block` in `round`.
fn pattern(block: usize, round: u64) -> Vec<u8> {
    let mut d = vec![0u8; BS];
    for (k, w) in d.chunks_mut(8).enumerate() {
        w.copy_from_slice(&(round << 40 | (block as u64) << 12 | k as u64).to_le_bytes());
    }
    d
}

const STANDBY_SENSE: (i64, i64, i64) = (2, 2, 0x040b);

#[test]
fn alua_groups_flip_when_the_owner_is_killed_and_writes_follow() {
    if !require_tool("etcd") {
        return;
    }
    let Some(alua) = tool("iscsi-alua") else {
        return;
    };
    let Some(blockio) = tool("iscsi-blockio") else {
        return;
    };
    let etcd = EtcdCluster::start("alua", 1);
    let ports: Vec<u16> = NAMES.iter().map(|_| free_port()).collect();
    let metrics: Vec<String> = NAMES
        .iter()
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let mut nodes: Vec<TestNode> = NAMES
        .iter()
        .zip(["z1", "z2", "z3"])
        .zip(ports.iter().zip(&metrics))
        .map(|((n, z), (p, m))| {
            cluster_member(
                &format!("alua-{n}"),
                n,
                z,
                &etcd,
                256,
                &format!("[iscsi]\nlisten = \"127.0.0.1:{p}\"\n[metrics]\nlisten = \"{m}\"\n"),
            )
        })
        .collect();
    let e = etcd_client(&etcd);
    wait_for("every member listed with its pool", 30, || {
        NAMES.iter().all(|n| {
            e.get(&tessera_cluster::node_key(n))
                .ok()
                .flatten()
                .and_then(|kv| serde_json::from_slice::<NodeRecord>(&kv.value).ok())
                .is_some_and(|r| !r.pools.is_empty())
        })
    });
    nodes[0].cli_ok(&["volume", "create", "db", "--size", "64M", "--replicas", "3"]);
    wait_for("volume db with three replicas in sync", 60, || {
        spec_of(&e, "db").is_some_and(|s| s.replicas.len() == 3 && s.out_of_sync.is_empty())
    });
    // A user's target cannot take a cluster name.
    assert!(!nodes[1]
        .cli(&[
            "iscsi",
            "target",
            "create",
            "iqn.2026-11.io.tessera:cluster:x",
            "--volume",
            "db"
        ])
        .status
        .success());

    // Every path, once each node lists the three groups.
    let owner_group = probe_until(&alua, ports[0], 30, "the owner's path", |p| {
        p.rtpg.len() == 3 && p.state_of(p.one("group")) == Some(0)
    })
    .one("group");
    let mut group_of = Vec::new();
    for (i, &port) in ports.iter().enumerate() {
        let p = probe_until(&alua, port, 30, "three groups, node-a's optimized", |p| {
            p.rtpg.len() == 3 && p.state_of(owner_group) == Some(0)
        });
        let group = p.one("group");
        assert_eq!(p.one("tpgs"), 1, "implicit ALUA:\n{}", p.text);
        assert_eq!(p.one("relport"), group, "one port per group:\n{}", p.text);
        assert_eq!(
            p.get("rtpg-format"),
            [0x10, 30],
            "extended header:\n{}",
            p.text
        );
        assert_eq!(p.rtpg, p.rtpg_short, "both formats list the same groups");
        for g in &p.rtpg {
            assert_eq!(g.supported, 0x05, "AO_SUP and S_SUP: {g:?}");
            assert_eq!(g.rel_port, g.id, "{g:?}");
            let want = if g.id == owner_group { 0 } else { 2 };
            assert_eq!(
                g.state, want,
                "group {} seen from {}:\n{}",
                g.id, NAMES[i], p.text
            );
        }
        assert_eq!(p.one("rsoc-rtpg"), 3, "REPORT TARGET PORT GROUPS is listed");
        assert_eq!(p.result("readcap"), (0, 0, VOL_BLOCKS as i64), "{}", p.text);
        if i == 0 {
            assert_eq!(group, owner_group);
            assert_eq!(p.result("tur"), (0, 0, 0), "{}", p.text);
            assert_eq!(p.result("read"), (0, 0, 0), "{}", p.text);
        } else {
            assert_eq!(p.state_of(group), Some(2), "{} is standby", NAMES[i]);
            assert_eq!(p.result("tur"), STANDBY_SENSE, "{}", p.text);
            assert_eq!(p.result("read"), STANDBY_SENSE, "{}", p.text);
        }
        group_of.push(group);
    }
    let mut distinct = group_of.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "a group per node: {group_of:?}");

    // Persistent reservations are served by the owner's path, and saved with the
    // volume's spec so that they follow it; a standby path refuses them. (A key is
    // registered, not reserved: a reservation would refuse the writer's sessions.)
    let pr = |args: &[&str]| -> String {
        let (ok, out) = run_tool(alua.to_str().unwrap(), args);
        assert!(ok, "iscsi-alua {args:?}: {out}");
        out
    };
    let out = pr(&["pr", &url(ports[0]), "ab12"]);
    assert!(out.contains("register status 0 "), "{out}");
    assert!(pr(&["prshow", &url(ports[0])]).contains("keys 1 ab12"));
    let standby = pr(&["prshow", &url(ports[1])]);
    assert!(
        standby.contains("prin status 2 key 2 ascq 0x040b"),
        "a standby path refuses PERSISTENT RESERVE IN: {standby}"
    );
    assert!(
        spec_of(&e, "db").is_some_and(|s| s.iscsi_pr.is_some()),
        "the registration is in the volume's spec"
    );

    // The host writes through every path, node-b's (standby) first.
    let dir = temp_dir("alua-writer");
    let stop = dir.path().join("stop");
    let order = [1usize, 2, 0];
    let mut child = Command::new(&alua)
        .arg("write")
        .arg(BLOCKS.to_string())
        .arg(&stop)
        .args(order.iter().map(|&i| url(ports[i])))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start iscsi-alua write");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = {
        let lines = lines.clone();
        let out = child.stdout.take().expect("piped");
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                lines.lock().unwrap().push(l);
            }
        })
    };
    let acks = |from: usize| {
        lines.lock().unwrap()[from..]
            .iter()
            .filter(|l| l.starts_with("ack "))
            .count()
    };
    let dump = |what: &str| -> String {
        let l = lines.lock().unwrap();
        let tail: Vec<&String> = l.iter().filter(|l| !l.starts_with("ack ")).collect();
        format!(
            "{what}; writer said (acks left out):\n{}",
            tail.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        )
    };
    let wait_acks = |from: usize, n: usize, secs: u64, what: &str| {
        let end = Instant::now() + Duration::from_secs(secs);
        while acks(from) < n {
            assert!(
                Instant::now() < end,
                "{}",
                dump(&format!("timed out waiting for {what}"))
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_acks(0, 300, 60, "300 writes through the owner");
    {
        let l = lines.lock().unwrap();
        assert!(
            l.iter().any(|l| l == "refused 0 ascq 0x040b"),
            "{}",
            "node-b's path refused the first write as standby"
        );
        assert!(
            l.iter()
                .filter(|l| l.starts_with("ack "))
                .all(|l| l.ends_with(" 2")),
            "every write so far went through node-a's path (index 2)"
        );
    }

    // kill -9 the owner while the writes run: the writer sees node-a's path fail.
    nodes[0].kill9();
    let killed = Instant::now();
    let failed_at = || {
        lines
            .lock()
            .unwrap()
            .iter()
            .position(|l| l.starts_with("path-failed 2 "))
    };
    let end = Instant::now() + Duration::from_secs(30);
    let at_kill = loop {
        if let Some(i) = failed_at() {
            break i;
        }
        assert!(
            Instant::now() < end,
            "{}",
            dump("node-a's path never failed")
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut new_owner = String::new();
    wait_for("a new owner of db", 60, || {
        new_owner = spec_of(&e, "db").map(|s| s.owner).unwrap_or_default();
        !new_owner.is_empty() && new_owner != NAMES[0]
    });
    let owner_i = NAMES
        .iter()
        .position(|n| *n == new_owner)
        .expect("a member");
    let other_i = 3 - owner_i;
    // Writes go on through the new owner's path.
    wait_acks(at_kill, 500, 90, "500 writes after the kill");
    eprintln!(
        "failover: new owner {new_owner}, 500 writes through it {:?} after the kill",
        killed.elapsed()
    );
    std::fs::write(&stop, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait the writer") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{}", dump("the writer did not stop"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().unwrap();
    let lines = lines.lock().unwrap().clone();
    assert!(status.success(), "{}", {
        let tail: Vec<&String> = lines.iter().filter(|l| !l.starts_with("ack ")).collect();
        format!("writer failed: {tail:?}")
    });
    assert_eq!(lines.last().map(String::as_str), Some("done"));
    let new_path = order.iter().position(|&i| i == owner_i).expect("a path");
    let after: Vec<&String> = lines[at_kill..].iter().collect();
    assert!(
        after
            .iter()
            .any(|l| l.starts_with("ua ") && l.ends_with("0x2a06")),
        "a session was told the access states changed: {after:?}"
    );
    assert!(
        after
            .iter()
            .filter(|l| l.starts_with("ack "))
            .all(|l| l.ends_with(&format!(" {new_path}"))),
        "after the kill, writes went through {new_owner}'s path only"
    );

    // The groups as the survivors report them: the new owner's optimized.
    let new_group = group_of[owner_i];
    for i in [owner_i, other_i] {
        let p = probe_until(
            &alua,
            ports[i],
            30,
            "the new owner's group optimized",
            |p| {
                p.state_of(new_group) == Some(0)
                    && p.state_of(group_of[other_i]) == Some(2)
                    && p.state_of(owner_group).is_none()
            },
        );
        assert_eq!(
            p.rtpg.len(),
            2,
            "the killed owner left the set:\n{}",
            p.text
        );
        if i == owner_i {
            assert_eq!(p.result("tur"), (0, 0, 0), "{}", p.text);
        } else {
            assert_eq!(p.result("read"), STANDBY_SENSE, "{}", p.text);
        }
    }

    // Each survivor's /metrics names the cluster target's LUN and its group's state.
    for (i, state) in [(owner_i, 0), (other_i, 2)] {
        let (code, text) = http_get(&metrics[i], "/metrics").expect("metrics");
        assert_eq!(code, 200);
        let target = format!("target=\"{IQN}\"");
        // The value of `family`'s sample for the cluster target.
        let value = |family: &str| -> Option<u64> {
            text.lines()
                .find(|l| l.starts_with(&format!("{family}{{")) && l.contains(&target))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
        };
        let iscsi_lines = || {
            text.lines()
                .filter(|l| l.contains("iscsi"))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            value("tessera_iscsi_alua_state"),
            Some(state),
            "{}: {}",
            NAMES[i],
            iscsi_lines()
        );
        assert_eq!(value("tessera_iscsi_lun"), Some(1), "{}", iscsi_lines());
        // Both survivors were probed, and the new owner also served the writer.
        assert!(
            value("tessera_iscsi_logins_total").is_some_and(|n| n >= 1),
            "{}",
            iscsi_lines()
        );
    }

    // The registration made on node-a's path followed the volume to its new owner; a
    // reservation taken there is saved with the volume as well.
    let carried = pr(&["prshow", &url(ports[owner_i])]);
    assert!(carried.contains("keys 1 ab12"), "{carried}");
    assert!(carried.contains("reservation 0 "), "{carried}");
    let before = spec_of(&e, "db").and_then(|s| s.iscsi_pr);
    let out = pr(&["pr", &url(ports[owner_i]), "cd34", "1"]);
    assert!(
        out.contains("register status 0 ") && out.contains("reserve status 0 "),
        "{out}"
    );
    let shown = pr(&["prshow", &url(ports[owner_i])]);
    assert!(shown.contains("keys 2 ab12 cd34"), "{shown}");
    assert!(shown.contains("reservation 1 cd34 1"), "{shown}");
    let after = spec_of(&e, "db").and_then(|s| s.iscsi_pr);
    assert!(
        after.is_some() && after != before,
        "the spec holds the new state"
    );

    // Every acknowledged write reads back over the new owner: each block holds the
    // round of its last acknowledged write (the writer goes block by block).
    let mut last: Vec<Option<u64>> = vec![None; BLOCKS];
    for l in lines.iter().filter_map(|l| l.strip_prefix("ack ")) {
        let v: Vec<u64> = l
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        last[v[0] as usize] = Some(v[1]);
    }
    assert!(last.iter().all(Option::is_some), "every block was written");
    let file = dir.path().join("read-back");
    let (ok, out) = run_tool(
        blockio.to_str().unwrap(),
        &[
            "read",
            &url(ports[owner_i]),
            "0",
            &(BLOCKS * BS).to_string(),
            file.to_str().unwrap(),
        ],
    );
    assert!(ok, "read back over {new_owner}: {out}");
    let data = std::fs::read(&file).unwrap();
    for (b, round) in last.iter().enumerate() {
        let want = pattern(b, round.unwrap());
        let got = &data[b * BS..(b + 1) * BS];
        if got != want.as_slice() {
            let at = got.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
            panic!("block {b} (last acknowledged round {round:?}) differs at byte {at}");
        }
    }
    drop(nodes);
    drop(etcd);
}
