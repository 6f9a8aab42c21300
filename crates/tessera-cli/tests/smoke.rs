mod common;
use common::*;

#[test]
fn default_node_starts_and_reports_status() {
    let n = TestNode::start_default("smoke");
    let out = n.cli_ok(&["status"]);
    assert!(out.contains("pool0"), "{out}");
    assert!(out.contains("vol0"), "{out}");
}
