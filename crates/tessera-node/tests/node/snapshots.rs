//! Snapshots, clones and incremental backup on a node in this process (issue 14): a file
//! pool, real NBD clients (qemu-io, qemu-img, nbdinfo, nbdcopy) and the project's client
//! on the node's NBD listener, every volume and snapshot checked against what was
//! written, the scrub's chain checks clean; and first writes into shared units of a raid5
//! pool from two connections at once. (Moved from
//! `crates/tessera-cli/tests/cli/snapshots.rs`, which keeps the restart and the kill -9
//! after each of these two scenarios, and the snapshot served as an NVMe/TCP namespace.)
//! Rollback and group snapshots are in `snapshot_rollback.rs`.

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::process::Command;

use serde_json::Value;
use tessera_testkit::node::{require_tool, run_ok};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;

/// A node serving NBD with pool `p` on a 512 MiB file and the 32 MiB volume `v`,
/// exported as `v`.
fn setup(tag: &str) -> TestNode {
    let n = TestNode::with_nbd(tag, 2);
    n.create_pool("p", "concat", &[n.file_dev("p.img", "512M")]);
    n.exported_volume("v", "p", SIZE);
    n
}

/// `tessera export add EXPORT --volume VOL`.
fn export(n: &TestNode, export: &str, vol: &str) {
    n.node()
        .add_export(export, vol, false, None)
        .unwrap_or_else(|e| panic!("export {vol} as {export}: {e}"));
}

/// `tessera volume clone SNAP --name NAME`.
fn clone(n: &TestNode, snap: &str, name: &str) {
    n.node()
        .clone_volume(snap, name, false)
        .unwrap_or_else(|e| panic!("clone {snap} as {name}: {e}"));
}

/// `tessera --json snapshot list`.
fn snapshot_list(n: &TestNode) -> Value {
    json(n.node().list_snapshots())
}

fn snapshot_named<'a>(list: &'a Value, name: &str) -> &'a Value {
    snapshot_named_opt(list, name).unwrap_or_else(|| panic!("snapshot {name} not listed: {list}"))
}

fn snapshot_named_opt<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
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

#[test]
fn snapshots_clones_and_incremental_backup_over_nbd() {
    if !require_tool("qemu-io") || !require_tool("nbdcopy") || !require_tool("nbdinfo") {
        return;
    }
    let n = setup("snapshots");
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
    export(&n, "s1e", "s1");
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
    export(&n, "s2e", "s2");
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
        let mut c = n.nbd(export);
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
    clone(&n, "s1", "c1");
    export(&n, "c1", "c1");
    let mut c1 = s1_model.clone();
    assert!(read_all(&n, "c1") == c1);
    write_at(&n, "c1", &mut c1, 0, &pattern(7, 4096));
    snapshot(&n, "c1", "c1s");
    clone(&n, "c1s", "c2");
    export(&n, "c2", "c2");
    let mut c2 = c1.clone();
    write_at(&n, "c2", &mut c2, 7 * MIB, &pattern(8, 4096));
    assert!(read_all(&n, "c2") == c2);
    assert!(read_all(&n, "c1") == c1);
    assert!(read_all(&n, "s1e") == s1_model);
    qemu_img_compare(&n, "c1", "c2", false);

    let list = snapshot_list(&n);
    let s1l = snapshot_named(&list, "s1");
    assert_eq!(s1l["shared"].as_u64(), Some(8 * MIB), "{list}");
    assert!(s1l["created"].as_u64().unwrap() > 0);

    // Delete: refused while exported; then s1 goes from the list while s2 and c1 still
    // read through it.
    assert!(n.node().delete_snapshot("s1").is_err());
    n.node().remove_export("s1e").unwrap();
    n.node().delete_snapshot("s1").unwrap();
    assert!(snapshot_named_opt(&snapshot_list(&n), "s1").is_none());
    assert!(read_all(&n, "v") == v);
    assert!(read_all(&n, "c1") == c1);

    // (A restart, and a kill -9 right after a write following a snapshot and a delete,
    // are the CLI's test: a node dropped in process after first writes into a
    // snapshot's units leaves the pool's devices open on its reactor cores, so it
    // could not start again on them here.)
    // The scrub checks the chains too (owners, partial units, parents).
    let scrub = scrub_wait(&n, "p", true);
    assert_eq!(
        scrub["metadata_findings"].as_array().unwrap().len(),
        0,
        "{scrub}"
    );
}

/// Snapshots and clones on a raid5 pool (the first write into a shared unit goes through
/// the asynchronous datapath, so parity layouts take it): two NBD connections (on two
/// reactor cores) write into the same blocks right after a snapshot, sub-block writes
/// meeting in each block; then a clone, a trim of the volume's own units, and every
/// volume, snapshot and clone read back against its model, the scrub clean.
#[test]
fn snapshots_on_a_raid5_pool_with_concurrent_first_writes() {
    let n = TestNode::with_nbd("snapshots-raid5", 2);
    let imgs: Vec<String> = (0..3)
        .map(|i| n.file_dev(&format!("p{i}.img"), "128M"))
        .collect();
    n.create_pool("p", "raid5", &imgs);
    n.exported_volume("v", "p", SIZE);
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
    export(&n, "se", "s");
    assert!(read_all(&n, "se") == s_model, "snapshot after first writes");

    // A clone diverges; the snapshot stays.
    clone(&n, "s", "c");
    export(&n, "c", "c");
    let mut c = s_model.clone();
    write_at(&n, "c", &mut c, 3 * MIB + 512, &pattern(24, 8192));
    assert!(read_all(&n, "c") == c);

    // A trim over units only the volume has gives them back and they read as zeros;
    // over shared units it leaves the snapshot (and what the volume reads) alone.
    write_at(&n, "v", &mut v, 16 * MIB, &pattern(25, 2 * MIB as usize));
    let before = n.volumes_json();
    let alloc = |l: &Value| {
        l.as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "v")
            .unwrap()["allocated"]
            .as_u64()
            .unwrap()
    };
    let mut cl = n.nbd("v");
    cl.trim(0, 32 * MIB as u32).unwrap();
    cl.flush().unwrap();
    cl.disconnect().unwrap();
    v[16 * MIB as usize..18 * MIB as usize].fill(0);
    let after = n.volumes_json();
    assert_eq!(alloc(&before) - alloc(&after), 2 * MIB, "{before} {after}");
    assert!(read_all(&n, "v") == v, "volume after trim");
    assert!(read_all(&n, "se") == s_model, "snapshot after trim");

    // (The kill -9 is the CLI's test; see above.)
    assert!(read_all(&n, "c") == c, "clone");
    let scrub = scrub_wait(&n, "p", true);
    assert_eq!(
        scrub["metadata_findings"].as_array().unwrap().len(),
        0,
        "{scrub}"
    );
}
