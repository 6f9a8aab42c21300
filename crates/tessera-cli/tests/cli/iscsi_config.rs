//! The iSCSI target a user gets without the API from `tessera up`: `vol0`'s, on the
//! portal `--iscsi` names, checked with libiscsi's tools. `[[iscsi.target]]`
//! declarations in a config file are tested on an in-process node:
//! `crates/tessera-node/tests/node/iscsi_config.rs`.

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
