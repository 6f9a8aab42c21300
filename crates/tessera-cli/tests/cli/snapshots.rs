//! Snapshots, clones, rollback and incremental backup end to end (issue 14): a node on a
//! file pool, real NBD clients (qemu-io, qemu-img, nbdinfo, nbdcopy) and the project's
//! client; a restart and a kill -9 in between, every volume and snapshot checked against
//! what was written. Rollback and group snapshots are tested in process, in
//! `crates/tessera-node/tests/node/snapshot_rollback.rs`.

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::process::Command;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;

fn setup(tag: &str) -> TestNode {
    let n = TestNode::start_with_config(tag, "");
    let img = format!("{}:512M", path_str(&n.dir.join("p.img")));
    n.cli_ok(&["pool", "create", "p", &img]);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "32M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    n
}

fn snapshot_named<'a>(list: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    list.as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("snapshot {name} not listed: {list}"))
}

#[test]
fn snapshots_clones_and_incremental_backup_over_nbd() {
    if !require_tool("qemu-io") || !require_tool("nbdcopy") || !require_tool("nbdinfo") {
        return;
    }
    let mut n = setup("snapshots");
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(1, 8 * MIB as usize));

    let s1 = snapshot(&n, "v", "s1");
    assert_eq!(s1["size"].as_u64(), Some(SIZE), "{s1}");
    assert_eq!(s1["children"][0], "v", "{s1}");
    let s1_model = v.clone();
    // The volume reads through the snapshot: block status reports data, not a hole,
    // where the volume has no space of its own yet.
    let map = run_ok(Command::new("nbdinfo").arg("--map").arg(n.uri("v")));
    assert!(
        map.lines().next().unwrap().contains("data"),
        "nbdinfo --map after the snapshot:\n{map}"
    );

    // First writes after the snapshot: 4 KiB aligned, 512 bytes inside a block, and
    // across a unit boundary.
    write_at(&n, "v", &mut v, MIB, &pattern(2, 4096));
    write_at(&n, "v", &mut v, 3 * MIB + 1536, &pattern(3, 512));
    write_at(&n, "v", &mut v, 5 * MIB - 2048, &pattern(4, 8192));
    assert!(read_all(&n, "v") == v, "volume after first writes");

    // The snapshot, exported: read-only over NBD, and unchanged.
    n.cli_ok(&["export", "add", "s1e", "--volume", "s1"]);
    assert!(read_all(&n, "s1e") == s1_model, "snapshot s1");
    let o = Command::new("qemu-io")
        .args(["-f", "raw", &n.uri("s1e"), "-c", "write -P 0x55 0 4k"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        !o.status.success() || text.contains("failed"),
        "a write to a snapshot export succeeded:\n{text}"
    );
    let info = run_ok(Command::new("nbdinfo").arg("--json").arg(n.uri("s1e")));
    assert!(info.contains("\"is_read_only\": true"), "{info}");
    assert!(
        read_all(&n, "s1e") == s1_model,
        "snapshot s1 after a refused write"
    );

    // A second snapshot, more writes, then the incremental backup: a full copy of s1
    // (nbdcopy), plus s1→s2 and s2→v increments read over NBD, rebuilds v exactly.
    snapshot(&n, "v", "s2");
    n.cli_ok(&["export", "add", "s2e", "--volume", "s2"]);
    let s2_model = v.clone();
    write_at(&n, "v", &mut v, 2 * MIB, &pattern(5, 64 << 10));
    write_at(&n, "v", &mut v, 20 * MIB, &pattern(6, 3 * MIB as usize));
    let inc1 = changes(&n, "s2", "s1");
    let inc2 = changes(&n, "v", "s2");
    assert_eq!(
        inc1,
        vec![(MIB, 4096), (3 * MIB, 4096), (5 * MIB - 4096, 12288)]
    );
    assert_eq!(inc2, vec![(2 * MIB, 64 << 10), (20 * MIB, 3 * MIB)]);
    let backup = n.dir.join("backup.img");
    run_ok(
        Command::new("nbdcopy")
            .arg(n.uri("s1e"))
            .arg(path_str(&backup)),
    );
    let mut restored = std::fs::read(&backup).unwrap();
    assert!(restored == s1_model, "full copy of s1");
    for (export, extents) in [("s2e", &inc1), ("v", &inc2)] {
        let mut c = nbd_connect(&n, export);
        for &(off, len) in extents.iter() {
            c.read(off, &mut restored[off as usize..(off + len) as usize])
                .unwrap();
        }
        c.disconnect().unwrap();
    }
    assert!(
        restored == v,
        "full copy + 2 increments differ from the volume"
    );
    assert!(read_all(&n, "s2e") == s2_model);

    // Clones, and a clone of a clone, share the snapshot's data and diverge on write.
    n.cli_ok(&["volume", "clone", "s1", "--name", "c1"]);
    n.cli_ok(&["export", "add", "c1", "--volume", "c1"]);
    let mut c1 = s1_model.clone();
    assert!(read_all(&n, "c1") == c1);
    write_at(&n, "c1", &mut c1, 0, &pattern(7, 4096));
    snapshot(&n, "c1", "c1s");
    n.cli_ok(&["volume", "clone", "c1s", "--name", "c2"]);
    n.cli_ok(&["export", "add", "c2", "--volume", "c2"]);
    let mut c2 = c1.clone();
    write_at(&n, "c2", &mut c2, 7 * MIB, &pattern(8, 4096));
    assert!(read_all(&n, "c2") == c2);
    assert!(read_all(&n, "c1") == c1);
    assert!(read_all(&n, "s1e") == s1_model);
    qemu_img_compare(&n, "c1", "c2", false);

    let list = n.json(&["snapshot", "list"]);
    let s1l = snapshot_named(&list, "s1");
    assert_eq!(s1l["shared"].as_u64(), Some(8 * MIB), "{list}");
    assert!(s1l["created"].as_u64().unwrap() > 0);

    // Delete: refused while exported; then s1 goes from the list while s2 and c1 still
    // read through it.
    assert!(!n.cli(&["snapshot", "delete", "s1"]).status.success());
    n.cli_ok(&["export", "remove", "s1e"]);
    n.cli_ok(&["snapshot", "delete", "s1"]);
    assert!(snapshot_named_opt(&n.json(&["snapshot", "list"]), "s1").is_none());
    assert!(read_all(&n, "v") == v);
    assert!(read_all(&n, "c1") == c1);

    // Everything survives a restart, and a kill -9 right after a write following a
    // snapshot and a delete.
    n.stop();
    n.restart();
    assert!(read_all(&n, "v") == v);
    assert!(read_all(&n, "s2e") == s2_model);
    assert!(read_all(&n, "c2") == c2);
    snapshot(&n, "v", "s3");
    write_at(&n, "v", &mut v, 9 * MIB + 4096, &pattern(9, 4096));
    n.cli_ok(&["snapshot", "delete", "s3"]);
    n.kill9();
    n.restart();
    assert!(read_all(&n, "v") == v, "volume after kill -9");
    assert!(read_all(&n, "s2e") == s2_model, "snapshot after kill -9");
    assert!(read_all(&n, "c1") == c1, "clone after kill -9");
    assert!(read_all(&n, "c2") == c2, "clone of a clone after kill -9");
    let scrub = n.json(&["pool", "scrub", "p", "--wait"]);
    // The scrub checks the chains too (owners, partial units, parents).
    assert_eq!(
        scrub["metadata_findings"].as_array().unwrap().len(),
        0,
        "{scrub}"
    );
}

fn snapshot_named_opt<'a>(
    list: &'a serde_json::Value,
    name: &str,
) -> Option<&'a serde_json::Value> {
    list.as_array().unwrap().iter().find(|s| s["name"] == name)
}

/// `qemu-img compare` of two exports: identical or not.
fn qemu_img_compare(n: &TestNode, a: &str, b: &str, same: bool) {
    let o = Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw", &n.uri(a), &n.uri(b)])
        .output()
        .unwrap();
    assert_eq!(
        o.status.code() == Some(0),
        same,
        "qemu-img compare {a} {b}: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// A snapshot as an NVMe/TCP namespace: it reads what the volume held when it was taken,
/// and a write gets "namespace is write protected" (the queue keeps serving).
#[test]
fn snapshot_namespace_over_nvmf_is_write_protected() {
    use tessera_nvmf::initiator::{Controller, Error, Options};
    use tessera_nvmf::nvme;
    const NQN: &str = "nqn.2024-01.io.tessera.test:snap";
    let port = free_port();
    let n = TestNode::start_with_config(
        "snapshot-nvmf",
        &format!("[nvmf]\nlisten = \"127.0.0.1:{port}\"\n"),
    );
    let img = format!("{}:256M", path_str(&n.dir.join("p.img")));
    n.cli_ok(&["pool", "create", "p", &img]);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "16M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    let mut v = vec![0u8; 16 * MIB as usize];
    write_at(&n, "v", &mut v, 0, &pattern(11, 2 * MIB as usize));
    snapshot(&n, "v", "s");
    let before = v.clone();
    write_at(&n, "v", &mut v, 4096, &pattern(12, 4096));
    n.cli_ok(&[
        "nvmf",
        "subsystem",
        "add",
        NQN,
        "--volume",
        "s",
        "--allow-any-host",
    ]);
    let addr = format!("127.0.0.1:{port}");
    let mut c = Controller::connect(&addr, NQN, &Options::default(), 1).unwrap();
    assert_eq!(c.read(0, 1, 0, 64, 512).unwrap(), before[..64 * 512]);
    match c.write(0, 1, 8, &pattern(13, 4096), 512) {
        Err(Error::Status(st, _)) => {
            assert_eq!(st & 0x7FF, nvme::SC_NS_WRITE_PROTECTED, "status {st:#x}")
        }
        r => panic!("a write to a snapshot namespace: {r:?}"),
    }
    assert_eq!(c.read(0, 1, 0, 64, 512).unwrap(), before[..64 * 512]);
    c.disconnect();
    assert!(read_all(&n, "v") == v);
}

/// Snapshots and clones on a raid5 pool (the first write into a shared unit goes through
/// the asynchronous datapath, so parity layouts take it): two NBD connections (on two
/// reactor cores) write into the same blocks right after a snapshot, sub-block writes
/// meeting in each block; then a clone, a trim of the volume's own units, a kill -9, and
/// every volume, snapshot and clone read back against its model, the scrub clean.
#[test]
fn snapshots_on_a_raid5_pool_with_concurrent_first_writes() {
    let mut n = TestNode::start_with_cores("snapshots-raid5", 2, "");
    let imgs: Vec<String> = (0..3)
        .map(|i| format!("{}:128M", path_str(&n.dir.join(format!("p{i}.img")))))
        .collect();
    let mut args = vec!["pool", "create", "p"];
    args.extend(imgs.iter().map(|s| s.as_str()));
    args.extend(["--layout", "raid5"]);
    n.cli_ok(&args);
    n.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "32M"]);
    n.cli_ok(&["export", "add", "v", "--volume", "v"]);
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(21, 4 * MIB as usize));
    snapshot(&n, "v", "s");
    let s_model = v.clone();

    // Two connections, each writing a piece of every block of the first 2 MiB.
    let span = 2 * MIB;
    let pieces = [(0u64, 1024usize, 22u64), (2048, 512, 23)];
    let writers: Vec<_> = pieces
        .iter()
        .map(|&(at, len, seed)| {
            let addr = n.addr();
            let data = pattern(seed, span as usize);
            std::thread::spawn(move || {
                let s = std::net::TcpStream::connect(addr).unwrap();
                s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
                    .unwrap();
                let mut c = tessera_nbd::client::NbdClient::from_stream(
                    s,
                    "v",
                    tessera_nbd::client::ClientOptions::default(),
                )
                .unwrap();
                for b in 0..span / 4096 {
                    let off = b * 4096 + at;
                    c.write(off, &data[off as usize..off as usize + len], false)
                        .unwrap();
                }
                c.flush().unwrap();
                c.disconnect().unwrap();
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    for &(at, len, seed) in &pieces {
        let data = pattern(seed, span as usize);
        for b in 0..span / 4096 {
            let off = (b * 4096 + at) as usize;
            v[off..off + len].copy_from_slice(&data[off..off + len]);
        }
    }
    assert!(
        read_all(&n, "v") == v,
        "volume after concurrent first writes"
    );
    n.cli_ok(&["export", "add", "se", "--volume", "s"]);
    assert!(read_all(&n, "se") == s_model, "snapshot after first writes");

    // A clone diverges; the snapshot stays.
    n.cli_ok(&["volume", "clone", "s", "--name", "c"]);
    n.cli_ok(&["export", "add", "c", "--volume", "c"]);
    let mut c = s_model.clone();
    write_at(&n, "c", &mut c, 3 * MIB + 512, &pattern(24, 8192));
    assert!(read_all(&n, "c") == c);

    // A trim over units only the volume has gives them back and they read as zeros;
    // over shared units it leaves the snapshot (and what the volume reads) alone.
    write_at(&n, "v", &mut v, 16 * MIB, &pattern(25, 2 * MIB as usize));
    let before = n.json(&["volume", "list"]);
    let alloc = |l: &serde_json::Value| {
        l.as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "v")
            .unwrap()["allocated"]
            .as_u64()
            .unwrap()
    };
    let mut cl = nbd_connect(&n, "v");
    cl.trim(0, 32 * MIB as u32).unwrap();
    cl.flush().unwrap();
    cl.disconnect().unwrap();
    v[16 * MIB as usize..18 * MIB as usize].fill(0);
    let after = n.json(&["volume", "list"]);
    assert_eq!(alloc(&before) - alloc(&after), 2 * MIB, "{before} {after}");
    assert!(read_all(&n, "v") == v, "volume after trim");
    assert!(read_all(&n, "se") == s_model, "snapshot after trim");

    n.kill9();
    n.restart();
    assert!(read_all(&n, "v") == v, "volume after kill -9");
    assert!(read_all(&n, "se") == s_model, "snapshot after kill -9");
    assert!(read_all(&n, "c") == c, "clone after kill -9");
    let scrub = n.json(&["pool", "scrub", "p", "--wait"]);
    assert_eq!(
        scrub["metadata_findings"].as_array().unwrap().len(),
        0,
        "{scrub}"
    );
}
