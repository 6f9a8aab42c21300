//! Snapshots end to end where a node process is needed (issue 14): chains of snapshots
//! and clones survive a restart and a kill -9 of the node right after a write following
//! a snapshot and a delete, on a file pool, and a kill -9 on a raid5 pool after a trim;
//! and a snapshot served as an NVMe/TCP namespace is write protected. (A node dropped in
//! process after first writes into a snapshot's units leaves the pool's devices open on
//! its reactor cores, so it cannot start again on them in process.) The scenarios before
//! (external NBD clients, incremental backup, concurrent first writes) are tested in
//! process, in `crates/tessera-node/tests/node/snapshots.rs`; rollback and
//! group snapshots in `crates/tessera-node/tests/node/snapshot_rollback.rs`. (The
//! NVMe/TCP test stays here: the node's NVMe/TCP accept thread holds the node, so an
//! in-process node serving it could not be stopped.)

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

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

/// The chain of the in-process test `snapshots_clones_and_incremental_backup_over_nbd`
/// (snapshots s1 and s2 of v, a clone c1 of s1, a clone c2 of a snapshot of c1, s1
/// deleted while they read through it), then a snapshot, a write and the snapshot's
/// delete, and a kill -9 right after: every volume and snapshot reads what was written,
/// and the scrub's chain checks find nothing.
#[test]
fn snapshot_chains_survive_a_kill9_after_a_snapshot_and_a_delete() {
    let mut n = setup("snapshots-kill9");
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(1, 8 * MIB as usize));
    snapshot(&n, "v", "s1");
    let s1_model = v.clone();
    write_at(&n, "v", &mut v, MIB, &pattern(2, 4096));
    write_at(&n, "v", &mut v, 3 * MIB + 1536, &pattern(3, 512));
    write_at(&n, "v", &mut v, 5 * MIB - 2048, &pattern(4, 8192));
    snapshot(&n, "v", "s2");
    n.cli_ok(&["export", "add", "s2e", "--volume", "s2"]);
    let s2_model = v.clone();
    write_at(&n, "v", &mut v, 2 * MIB, &pattern(5, 64 << 10));
    write_at(&n, "v", &mut v, 20 * MIB, &pattern(6, 3 * MIB as usize));
    n.cli_ok(&["volume", "clone", "s1", "--name", "c1"]);
    n.cli_ok(&["export", "add", "c1", "--volume", "c1"]);
    let mut c1 = s1_model;
    write_at(&n, "c1", &mut c1, 0, &pattern(7, 4096));
    snapshot(&n, "c1", "c1s");
    n.cli_ok(&["volume", "clone", "c1s", "--name", "c2"]);
    n.cli_ok(&["export", "add", "c2", "--volume", "c2"]);
    let mut c2 = c1.clone();
    write_at(&n, "c2", &mut c2, 7 * MIB, &pattern(8, 4096));
    n.cli_ok(&["snapshot", "delete", "s1"]);

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

/// The raid5 chain of the in-process test `snapshots_on_a_raid5_pool_with_concurrent_first_writes`
/// (its first writes made here one after the other: their concurrency is the in-process
/// test's subject), a clone written, a trim of the volume's own units, then a kill -9:
/// every volume, snapshot and clone reads back against its model, the scrub clean.
#[test]
fn raid5_snapshot_chain_survives_a_kill9_after_a_trim() {
    let mut n = TestNode::start_with_cores("snapshots-raid5-kill9", 2, "");
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
    // Sub-block first writes into the shared units: a piece of every block of 2 MiB.
    let span = 2 * MIB;
    let mut cl = nbd_connect(&n, "v");
    for (at, len, seed) in [(0u64, 1024usize, 22u64), (2048, 512, 23)] {
        let data = pattern(seed, span as usize);
        for b in 0..span / 4096 {
            let off = b * 4096 + at;
            let piece = &data[off as usize..off as usize + len];
            cl.write(off, piece, false).unwrap();
            v[off as usize..off as usize + len].copy_from_slice(piece);
        }
    }
    cl.flush().unwrap();
    cl.disconnect().unwrap();
    n.cli_ok(&["export", "add", "se", "--volume", "s"]);
    n.cli_ok(&["volume", "clone", "s", "--name", "c"]);
    n.cli_ok(&["export", "add", "c", "--volume", "c"]);
    let mut c = s_model.clone();
    write_at(&n, "c", &mut c, 3 * MIB + 512, &pattern(24, 8192));
    write_at(&n, "v", &mut v, 16 * MIB, &pattern(25, 2 * MIB as usize));
    let mut cl = nbd_connect(&n, "v");
    cl.trim(0, 32 * MIB as u32).unwrap();
    cl.flush().unwrap();
    cl.disconnect().unwrap();
    v[16 * MIB as usize..18 * MIB as usize].fill(0);

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
