//! iSCSI on a node, end to end with libiscsi's tools: a target made through the CLI is
//! found by SendTargets discovery, reports its volume's size, passes a small
//! `iscsi-test-cu` subset, serves what NBD wrote, refuses the management operations that
//! would pull its volume away, and is served again after a kill -9 and a restart.

mod common;
use common::*;

use std::process::{Command, Stdio};

const IQN: &str = "iqn.2026-11.io.tessera:itest";
/// Exit codes of `tessera --help`: no such object / conflict or busy / invalid.
const NOT_FOUND: i32 = 3;
const CONFLICT: i32 = 4;
const INVALID: i32 = 5;

fn tool(name: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new(name)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let mut out = String::from_utf8_lossy(&o.stdout).into_owned();
    out.push_str(&String::from_utf8_lossy(&o.stderr));
    (o.status.success(), out)
}

fn code(n: &TestNode, args: &[&str]) -> Option<i32> {
    n.cli(args).status.code()
}

/// "tests N N passed failed ..." of a CUnit run summary: (passed, failed).
fn cunit_counts(out: &str) -> Option<(u32, u32)> {
    let line = out.lines().find(|l| l.trim_start().starts_with("tests"))?;
    let nums: Vec<u32> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums.len() >= 4).then(|| (nums[2], nums[3]))
}

#[test]
fn iscsi_target_served_by_the_node_and_after_a_restart() {
    if !require_tool("iscsi-ls")
        || !require_tool("iscsi-readcapacity16")
        || !require_tool("iscsi-test-cu")
        || !require_tool("iscsi-inq")
    {
        return;
    }
    // A port of its own: config nodes listen for iSCSI only where told to.
    let port = free_port();
    let portal = format!("127.0.0.1:{port}");
    let mut node =
        TestNode::start_with_config("iscsi", &format!("[iscsi]\nlisten = \"{portal}\"\n"));
    // A file-backed pool, so that data and volumes survive the restart.
    let img = format!("{}:256M", node.dir.join("p.img").display());
    node.cli_ok(&["pool", "create", "p", &img]);
    node.cli_ok(&["volume", "create", "v", "--pool", "p", "--size", "64M"]);
    node.cli_ok(&[
        "volume", "create", "scratch", "--pool", "p", "--size", "32M",
    ]);
    node.cli_ok(&["export", "add", "v", "--volume", "v"]);

    // Errors: a bad name, a missing volume; then the target, and a second one by the
    // same name.
    assert_eq!(
        code(&node, &["iscsi", "target", "create", "db", "--volume", "v"]),
        Some(INVALID)
    );
    assert_eq!(
        code(
            &node,
            &["iscsi", "target", "create", IQN, "--volume", "nope"]
        ),
        Some(NOT_FOUND)
    );
    let out = node.cli_ok(&[
        "iscsi", "target", "create", IQN, "--volume", "v", "--volume", "scratch",
    ]);
    assert!(out.contains("0=v,1=scratch"), "{out}");
    assert_eq!(
        code(&node, &["iscsi", "target", "create", IQN, "--volume", "v"]),
        Some(CONFLICT)
    );
    // A volume that is a LUN stays: deleting it is refused, naming the target.
    let o = node.cli(&["volume", "delete", "scratch"]);
    assert_eq!(o.status.code(), Some(CONFLICT));
    assert!(String::from_utf8_lossy(&o.stderr).contains(IQN));
    let listed: serde_json::Value =
        serde_json::from_str(&node.cli_ok(&["--json", "iscsi", "target", "list"])).unwrap();
    assert_eq!(listed[0]["iqn"], IQN);
    assert_eq!(listed[0]["served"], true);
    assert_eq!(listed[0]["portals"][0], portal.as_str());

    // Data written over NBD, before any iSCSI client: the LUN is the same volume.
    let mut c = nbd_connect(&node, "v");
    c.write(0, &block(0, 7, 4096), false).unwrap();
    c.flush().unwrap();
    c.disconnect().unwrap();

    let check_served = |what: &str| {
        let (ok, out) = tool("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
        assert!(ok, "{what}: iscsi-ls: {out}");
        assert!(out.contains(&format!("Target:{IQN}")), "{what}: {out}");
        let (ok, out) = tool(
            "iscsi-readcapacity16",
            &[&format!("iscsi://{portal}/{IQN}/0")],
        );
        assert!(ok, "{what}: iscsi-readcapacity16: {out}");
        assert!(
            out.contains(&format!("Total size:{}", 64u64 << 20)),
            "{what}: {out}"
        );
        let (ok, out) = tool(
            "iscsi-readcapacity16",
            &[&format!("iscsi://{portal}/{IQN}/1")],
        );
        assert!(ok, "{what}: LUN 1: {out}");
        assert!(
            out.contains(&format!("Total size:{}", 32u64 << 20)),
            "{what}: {out}"
        );
    };
    check_served("before the restart");

    // Conformance of the node's wiring (the crate's own tests run the wider subset):
    // reads and writes on the scratch LUN, which libiscsi overwrites.
    for t in ["SCSI.Read10", "SCSI.Write10", "SCSI.ReadCapacity16"] {
        let (_, out) = tool(
            "iscsi-test-cu",
            &[
                "--dataloss",
                "--initiator-name",
                "iqn.2026-11.io.tessera:itest-initiator",
                &format!("--test={t}"),
                &format!("iscsi://{portal}/{IQN}/1"),
            ],
        );
        let (passed, failed) = cunit_counts(&out).unwrap_or_else(|| panic!("{t}: {out}"));
        assert!(passed > 0 && failed == 0, "{t}: {out}");
    }

    // kill -9, restart: the target comes back from the data directory.
    node.kill9();
    node.restart();
    check_served("after the restart");
    // What NBD wrote is still the volume's.
    let mut c = nbd_connect(&node, "v");
    let mut buf = vec![0u8; 4096];
    c.read(0, &mut buf).unwrap();
    assert!(buf == block(0, 7, 4096));
    c.disconnect().unwrap();

    // Deleted, it is no longer discovered, and its volumes can go.
    node.cli_ok(&["iscsi", "target", "delete", IQN]);
    assert_eq!(
        code(&node, &["iscsi", "target", "delete", IQN]),
        Some(NOT_FOUND)
    );
    let (_, out) = tool("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
    assert!(!out.contains(IQN), "{out}");
    // The sessions the tools opened hold the LUN until the target sees their sockets
    // close (about a second after the tool exits).
    wait_for("the deleted target's volume to be deletable", 20, || {
        node.cli(&["volume", "delete", "scratch"]).status.success()
    });
}
