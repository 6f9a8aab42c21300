//! iSCSI targets a user gets without the API: the one `tessera up` serves for `vol0`,
//! and `[[iscsi.target]]` declarations in a config file (with CHAP secrets read from
//! files), checked with libiscsi's tools.

use crate::common;
use common::*;

#[test]
fn tessera_up_serves_vol0_as_an_iscsi_target() {
    if !require_tool("iscsi-readcapacity16") {
        return;
    }
    let n = TestNode::start_default("iscsi-up");
    let url = format!(
        "iscsi://127.0.0.1:{}/{}/0",
        n.iscsi_port,
        tessera_node::config::default_iqn("vol0")
    );
    let (ok, out) = run_tool("iscsi-readcapacity16", &[&url]);
    assert!(ok, "tessera up's vol0 target did not answer:\n{out}");
    // vol0 is 4 GiB of 512-byte blocks: the last LBA is 8388607.
    assert!(
        out.contains("8388607") && out.contains("512"),
        "not vol0's capacity:\n{out}"
    );
}

#[test]
fn a_declared_target_is_created_once_with_chap_from_a_secret_file() {
    if !require_tool("iscsi-inq") {
        return;
    }
    const IQN: &str = "iqn.2026-11.io.tessera:declared";
    const SECRET: &str = "declared-secret-0123";
    let file = std::env::temp_dir().join(format!("tessera-chap-{}", std::process::id()));
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    // A file pool: a RAM pool comes back empty, with new volume IDs its target's LUN
    // records no longer name.
    let img = std::env::temp_dir().join(format!("tessera-decl-{}.img", std::process::id()));
    let port = free_port();
    let mut n = TestNode::start_with_config(
        "iscsi-decl",
        &format!(
            "[iscsi]\nlisten = \"127.0.0.1:{port}\"\n\
             [[iscsi.target]]\niqn = \"{IQN}\"\nvolumes = [\"v\"]\n\
             chap_user = \"host\"\nchap_secret_file = \"{}\"\n\
             [[pool]]\nname = \"p\"\ndevices = [\"{}:128M\"]\n\
             [[volume]]\nname = \"v\"\npool = \"p\"\nsize = \"32M\"\n",
            file.display(),
            img.display()
        ),
    );
    let url = |creds: &str| format!("iscsi://{creds}127.0.0.1:{port}/{IQN}/0");
    let (ok, out) = run_tool("iscsi-inq", &[&url(&format!("host%{SECRET}@"))]);
    assert!(ok, "the declared secret was refused:\n{out}");
    let (ok, out) = run_tool("iscsi-inq", &[&url("")]);
    assert!(!ok, "a login without CHAP was let in:\n{out}");
    let list = n.cli_ok(&["--json", "iscsi", "target", "list"]);
    assert!(list.contains(IQN) && list.contains("\"host\""), "{list}");
    assert!(!list.contains(SECRET), "the secret is listed: {list}");
    // Created once: after a restart the declaration finds it and leaves it alone (a
    // second create would fail and be logged).
    n.stop();
    n.restart();
    let (ok, out) = run_tool("iscsi-inq", &[&url(&format!("host%{SECRET}@"))]);
    assert!(ok, "the declared target is gone after a restart:\n{out}");
    let log = std::fs::read_to_string(&n.log).unwrap_or_default();
    assert!(
        !log.contains("cannot create the target from the config"),
        "the declaration was applied twice:\n{log}"
    );
    assert!(!log.contains(SECRET), "the secret is in the log");
    drop(n);
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&img);
}
