//! `[[iscsi.target]]` declarations in a config file (with CHAP secrets read from files),
//! on a node started in process with its iSCSI target started as `tessera run` starts
//! it, checked with libiscsi's tools: the target is created once, across a restart, and
//! its secret is neither listed nor logged. (Moved from
//! `crates/tessera-cli/tests/cli/iscsi_config.rs`, which keeps the target `tessera up`
//! serves for `vol0`.)

use crate::common;
use common::*;

use tessera_testkit::node::{require_tool, run_tool};

#[test]
fn a_declared_target_is_created_once_with_chap_from_a_secret_file() {
    if !require_tool("iscsi-inq") {
        return;
    }
    const IQN: &str = "iqn.2026-11.io.tessera:declared";
    const SECRET: &str = "declared-secret-0123";
    // The secret file and the pool's image in the test's directory. A file pool: a RAM
    // pool comes back empty, with new volume IDs its target's LUN records no longer name.
    let mut n = TestNode::with_config("iscsi-decl", 2, |dir| {
        let file = dir.join("chap.secret");
        std::fs::write(&file, format!("{SECRET}\n")).unwrap();
        format!(
            "[iscsi]\nlisten = \"127.0.0.1:0\"\n\
             [[iscsi.target]]\niqn = \"{IQN}\"\nvolumes = [\"v\"]\n\
             chap_user = \"host\"\nchap_secret_file = \"{}\"\n\
             [[pool]]\nname = \"p\"\ndevices = [\"{}:128M\"]\n\
             [[volume]]\nname = \"v\"\npool = \"p\"\nsize = \"32M\"\n",
            file.display(),
            dir.join("p.img").display()
        )
    });
    // The portal is on a port the kernel picks, a new one after each restart (the stopped
    // node's listener stays bound).
    let mut portal = n.serve_iscsi();
    let url = |creds: &str, portal: &str| format!("iscsi://{creds}{portal}/{IQN}/0");
    let (ok, out) = run_tool("iscsi-inq", &[&url(&format!("host%{SECRET}@"), &portal)]);
    assert!(ok, "the declared secret was refused:\n{out}");
    let (ok, out) = run_tool("iscsi-inq", &[&url("", &portal)]);
    assert!(!ok, "a login without CHAP was let in:\n{out}");
    // What `GET /v1/iscsi/targets` answers (`tessera --json iscsi target list`).
    let list = json(n.node().iscsi_list()).to_string();
    assert!(list.contains(IQN) && list.contains("\"host\""), "{list}");
    assert!(!list.contains(SECRET), "the secret is listed: {list}");
    // Created once: after a restart the declaration finds it and leaves it alone (a
    // second create would fail and be logged).
    n.restart();
    portal = n.serve_iscsi();
    let (ok, out) = run_tool("iscsi-inq", &[&url(&format!("host%{SECRET}@"), &portal)]);
    assert!(ok, "the declared target is gone after a restart:\n{out}");
    // The log of this test binary's nodes: no other test here declares a target, and the
    // secret is this test's own.
    let log = log_text();
    assert!(
        !log.contains("cannot create the target from the config"),
        "the declaration was applied twice:\n{log}"
    );
    assert!(!log.contains(SECRET), "the secret is in the log");
}
