//! NBD requests not aligned to 512 bytes, from clients that negotiated no block size
//! (libnbd's Python binding with `set_request_block_size(False)` and strict mode off):
//! 1-byte and odd-sized reads, writes, write-zeroes and trims at odd offsets checked
//! against a model; a client that did ask for block sizes still gets EINVAL; and
//! overlapping unaligned and aligned writes from several connections, after which no byte
//! outside any write's range may have changed. Against `tessera up`'s node (vol0), in
//! process; the scripts are in `nbd_unaligned/`. (Moved from `crates/tessera-cli/tests/cli`.)

use crate::common;
use common::*;
use std::process::Command;
use tessera_testkit::node::{require_tool, run_ok};

/// The Python that has the `nbd` module (python3-libnbd installs it for the system's).
fn python() -> &'static str {
    if std::path::Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

fn run_script(node: &TestNode, script: &str, name: &str) {
    let path = node.dir.join(name);
    std::fs::write(&path, script).unwrap();
    let out = run_ok(
        Command::new("timeout")
            .arg("60")
            .arg(python())
            .arg(&path)
            .arg(node.uri("vol0")),
    );
    assert!(out.contains(" ok"), "{name}: {out}");
}

#[test]
fn unaligned_requests_match_a_model() {
    if !require_tool("nbdsh") {
        return;
    }
    let node = TestNode::up("nbd-unaligned");
    run_script(
        &node,
        include_str!("nbd_unaligned/unaligned.py"),
        "unaligned.py",
    );
}

#[test]
fn concurrent_unaligned_writes_lose_no_byte() {
    if !require_tool("nbdsh") {
        return;
    }
    let node = TestNode::up("nbd-unaligned-conc");
    run_script(
        &node,
        include_str!("nbd_unaligned/concurrent.py"),
        "concurrent.py",
    );
}
