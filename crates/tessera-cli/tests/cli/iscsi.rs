//! iSCSI on a node, end to end with libiscsi's tools: a target made through the CLI is
//! found by SendTargets discovery, reports its volume's size, passes a small
//! `iscsi-test-cu` subset, serves what NBD wrote, refuses the management operations that
//! would pull its volume away (the CLI's exit codes and messages), and is served again
//! after a kill -9 and a restart; and access control (CHAP one-way and mutual, initiator
//! allowlist) set through the CLI as an operator would (secret files, standard input),
//! met by libiscsi's initiator, with no secret in any output or log. The same bytes over
//! iSCSI, NBD and NVMe/TCP are checked on an in-process node:
//! `crates/tessera-node/tests/node/iscsi.rs`.

use crate::common;
use common::*;

use std::io::Write as _;
use std::process::{Command, Stdio};

const IQN: &str = "iqn.2026-11.io.tessera:itest";
/// Exit codes of `tessera --help`: no such object / conflict or busy / invalid.
const NOT_FOUND: i32 = 3;
const CONFLICT: i32 = 4;
const INVALID: i32 = 5;

fn code(n: &TestNode, args: &[&str]) -> Option<i32> {
    n.cli(args).status.code()
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
        let (ok, out) = run_tool("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
        assert!(ok, "{what}: iscsi-ls: {out}");
        assert!(out.contains(&format!("Target:{IQN}")), "{what}: {out}");
        let (ok, out) = run_tool(
            "iscsi-readcapacity16",
            &[&format!("iscsi://{portal}/{IQN}/0")],
        );
        assert!(ok, "{what}: iscsi-readcapacity16: {out}");
        assert!(
            out.contains(&format!("Total size:{}", 64u64 << 20)),
            "{what}: {out}"
        );
        let (ok, out) = run_tool(
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
        let (_, out) = run_tool(
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
    let (_, out) = run_tool("iscsi-ls", &["-s", &format!("iscsi://{portal}")]);
    assert!(!out.contains(IQN), "{out}");
    // The sessions the tools opened hold the LUN until the target sees their sockets
    // close (about a second after the tool exits).
    wait_for("the deleted target's volume to be deletable", 20, || {
        node.cli(&["volume", "delete", "scratch"]).status.success()
    });
}

const CHAP_IQN: &str = "iqn.2026-11.io.tessera:chap";
const LIST_IQN: &str = "iqn.2026-11.io.tessera:listed";
const HOST1: &str = "iqn.2026-11.io.example:host1";
const HOST2: &str = "iqn.2026-11.io.example:host2";
const SECRET: &str = "initiator-secret-1";
const MUTUAL_SECRET: &str = "target-secret-222";

/// `tessera --api ... ARGS` with `stdin` on its standard input.
fn cli_stdin(n: &TestNode, args: &[&str], stdin: &str) -> std::process::Output {
    let mut c = Command::new(BIN)
        .arg("--api")
        .arg(n.api())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
}

#[test]
fn iscsi_chap_and_initiator_allowlist_on_a_node() {
    if !require_tool("iscsi-inq") || !require_tool("iscsi-ls") {
        return;
    }
    let port = free_port();
    let portal = format!("127.0.0.1:{port}");
    let mut node =
        TestNode::start_with_config("iscsi-auth", &format!("[iscsi]\nlisten = \"{portal}\"\n"));
    let img = format!("{}:256M", node.dir.join("p.img").display());
    node.cli_ok(&["pool", "create", "p", &img]);
    node.cli_ok(&["volume", "create", "a", "--pool", "p", "--size", "16M"]);
    node.cli_ok(&["volume", "create", "b", "--pool", "p", "--size", "16M"]);
    let file = |name: &str, text: &str| {
        let p = node.dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    // With a trailing newline, as an editor leaves it: ignored.
    let secret_file = file("chap.secret", &format!("{SECRET}\n"));
    let short_file = file("short.secret", "elevenbytes");
    let same_file = file("same.secret", SECRET);

    // Refused at configuration: a short secret, a mutual secret equal to the initiator's,
    // an allowed initiator that is not an iSCSI name, `auth` with nothing to set.
    let o = node.cli(&[
        "iscsi",
        "target",
        "create",
        CHAP_IQN,
        "--volume",
        "a",
        "--chap-user",
        "alice",
        "--chap-secret-file",
        &short_file,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(INVALID), "{err}");
    assert!(err.contains("at least 12 bytes"), "{err}");
    let o = node.cli(&[
        "iscsi",
        "target",
        "create",
        CHAP_IQN,
        "--volume",
        "a",
        "--chap-user",
        "alice",
        "--chap-secret-file",
        &secret_file,
        "--mutual-chap-user",
        "tessera",
        "--mutual-chap-secret-file",
        &same_file,
    ]);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(INVALID), "{err}");
    assert!(err.contains("must differ"), "{err}");
    assert_eq!(
        code(
            &node,
            &[
                "iscsi",
                "target",
                "create",
                LIST_IQN,
                "--volume",
                "b",
                "--allow-initiator",
                "host1"
            ]
        ),
        Some(INVALID)
    );
    // Nothing of the refused creations was kept.
    assert_eq!(
        code(&node, &["iscsi", "target", "show", CHAP_IQN]),
        Some(NOT_FOUND)
    );

    // One-way CHAP on one target, an allowlist on the other.
    let out = node.cli_ok(&[
        "iscsi",
        "target",
        "create",
        CHAP_IQN,
        "--volume",
        "a",
        "--chap-user",
        "alice",
        "--chap-secret-file",
        &secret_file,
    ]);
    assert!(out.contains("chap: one-way (user alice)"), "{out}");
    let out = node.cli_ok(&[
        "iscsi",
        "target",
        "create",
        LIST_IQN,
        "--volume",
        "b",
        "--allow-initiator",
        HOST1,
    ]);
    assert!(out.contains(&format!("initiators: {HOST1}")), "{out}");
    assert_eq!(
        code(&node, &["iscsi", "target", "auth", LIST_IQN]),
        Some(INVALID),
        "auth without flags must not open the target"
    );

    let url = |creds: &str, iqn: &str, args: &str| format!("iscsi://{creds}{portal}/{iqn}/0{args}");
    let right = format!("alice%{SECRET}@");
    let check_chap = |what: &str| {
        let (ok, out) = run_tool("iscsi-inq", &[&url(&right, CHAP_IQN, "")]);
        assert!(
            ok && out.contains("TESSERA"),
            "{what}: the right secret: {out}"
        );
        for (case, creds) in [
            ("a wrong secret", "alice%wrong-secret-123@".to_string()),
            ("a wrong user", format!("mallory%{SECRET}@")),
            ("no secret", String::new()),
        ] {
            let (ok, out) = run_tool("iscsi-inq", &[&url(&creds, CHAP_IQN, "")]);
            assert!(!ok, "{what}: {case} was let in: {out}");
            assert!(
                out.contains("Authentication failure"),
                "{what}: {case}: {out}"
            );
        }
    };
    check_chap("one-way");

    // The allowlist: host1 in, host2 refused (authorization failure) and not told the
    // target exists; the CHAP target is listed to both (its secret is checked at login).
    let (ok, out) = run_tool("iscsi-inq", &["-i", HOST1, &url("", LIST_IQN, "")]);
    assert!(ok, "a listed initiator was refused: {out}");
    let (ok, out) = run_tool("iscsi-inq", &["-i", HOST2, &url("", LIST_IQN, "")]);
    assert!(!ok && out.contains("Authorization failure"), "{out}");
    let (_, out) = run_tool("iscsi-ls", &["-i", HOST2, &format!("iscsi://{portal}")]);
    assert!(!out.contains(LIST_IQN) && out.contains(CHAP_IQN), "{out}");
    let (_, out) = run_tool("iscsi-ls", &["-i", HOST1, &format!("iscsi://{portal}")]);
    assert!(out.contains(LIST_IQN) && out.contains(CHAP_IQN), "{out}");

    // Mutual CHAP, set on the existing target, its secret read from standard input.
    let o = cli_stdin(
        &node,
        &[
            "iscsi",
            "target",
            "auth",
            CHAP_IQN,
            "--chap-user",
            "alice",
            "--chap-secret-file",
            &secret_file,
            "--mutual-chap-user",
            "tessera",
            "--mutual-chap-secret-file",
            "-",
        ],
        MUTUAL_SECRET,
    );
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("chap: mutual (user alice, target user tessera)"),
        "{out}"
    );
    let mutual = |pw: &str| format!("?target_user=tessera&target_password={pw}");
    let (ok, out) = run_tool(
        "iscsi-inq",
        &[&url(&right, CHAP_IQN, &mutual(MUTUAL_SECRET))],
    );
    assert!(ok, "mutual CHAP with the right secrets: {out}");
    let (ok, out) = run_tool(
        "iscsi-inq",
        &[&url(&right, CHAP_IQN, &mutual("not-the-target-one"))],
    );
    assert!(
        !ok,
        "the initiator accepted the target with the wrong secret: {out}"
    );
    assert!(
        out.contains("Invalid CHAP_R response from the target"),
        "{out}"
    );

    // Secrets: not in list/show, plain or --json; in iscsi.json, which is owner only.
    let outputs = [
        node.cli_ok(&["iscsi", "target", "list"]),
        node.cli_ok(&["iscsi", "target", "show", CHAP_IQN]),
        node.cli_ok(&["--json", "iscsi", "target", "list"]),
        node.cli_ok(&["--json", "iscsi", "target", "show", CHAP_IQN]),
    ];
    for out in &outputs {
        assert!(
            !out.contains(SECRET) && !out.contains(MUTUAL_SECRET),
            "secret shown: {out}"
        );
    }
    let shown: serde_json::Value = serde_json::from_str(&outputs[3]).unwrap();
    assert_eq!(shown["chap"]["user"], "alice");
    assert_eq!(shown["chap"]["mutual_user"], "tessera");
    let listed: serde_json::Value = serde_json::from_str(&outputs[2]).unwrap();
    let list_target = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["iqn"] == LIST_IQN)
        .unwrap();
    assert_eq!(list_target["allowed_initiators"][0], HOST1);
    assert!(list_target.get("chap").is_none(), "{list_target}");
    let json_path = node.data_dir.join("iscsi.json");
    let saved = std::fs::read_to_string(&json_path).unwrap();
    assert!(
        saved.contains(SECRET) && saved.contains(MUTUAL_SECRET),
        "{saved}"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&json_path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "iscsi.json is mode {mode:o}");

    // After kill -9 and a restart, CHAP is enforced as before (from iscsi.json).
    node.kill9();
    node.restart();
    check_chap("after the restart");
    let (ok, out) = run_tool(
        "iscsi-inq",
        &[&url(&right, CHAP_IQN, &mutual(MUTUAL_SECRET))],
    );
    assert!(ok, "mutual CHAP after the restart: {out}");

    // Opened again: any initiator, no CHAP.
    let out = node.cli_ok(&["iscsi", "target", "auth", CHAP_IQN, "--open"]);
    assert!(out.contains("initiators: any  chap: none"), "{out}");
    let (ok, out) = run_tool("iscsi-inq", &[&url("", CHAP_IQN, "")]);
    assert!(ok, "the opened target refused a login: {out}");

    // The node's log saw refused logins and configuration changes, never a secret.
    let log = node.log_text();
    assert!(log.contains("login refused"), "no refusal logged");
    assert!(log.contains("access control set"), "no change logged");
    assert!(
        !log.contains(SECRET) && !log.contains(MUTUAL_SECRET),
        "a secret in the log"
    );
}
