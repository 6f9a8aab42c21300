//! Rollback of a volume to a snapshot (refused while the volume is exported), group
//! snapshots, and a clone of something that is not a snapshot. (Moved from
//! `crates/tessera-cli/tests/cli/snapshots.rs`, which keeps the kill -9 tests; the rest
//! of that file is in `snapshots.rs`.)

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;

#[test]
fn rollback_is_refused_while_exported_and_restores_the_snapshot() {
    let n = TestNode::with_nbd("rollback", 2);
    n.create_pool("p", "concat", &[n.file_dev("p.img", "512M")]);
    n.exported_volume("v", "p", SIZE);
    let node = n.node();
    let mut v = vec![0u8; SIZE as usize];
    write_at(&n, "v", &mut v, 0, &pattern(1, 2 * MIB as usize));
    node.create_snapshot("v", "before").unwrap();
    let before = v.clone();
    write_at(&n, "v", &mut v, 4096, &pattern(2, MIB as usize));
    let err = node
        .rollback_volume("v", "before")
        .expect_err("a rollback of an exported volume")
        .to_string();
    assert!(err.contains("export"), "{err}");
    node.remove_export("v").unwrap();
    node.rollback_volume("v", "before").unwrap();
    node.add_export("v", "v", false, None).unwrap();
    assert!(read_all(&n, "v") == before);
    // Group snapshot of two volumes at one point; a group over two pools is refused.
    node.create_volume("w", "p", 8 * MIB, false).unwrap();
    let pairs = |p: &[(&str, &str)]| -> Vec<(String, String)> {
        p.iter()
            .map(|(v, s)| (v.to_string(), s.to_string()))
            .collect()
    };
    let g = json(
        node.create_snapshot_group(&pairs(&[("v", "gv"), ("w", "gw")]))
            .unwrap(),
    );
    assert_eq!(g.as_array().unwrap().len(), 2, "{g}");
    assert!(node
        .create_snapshot_group(&pairs(&[("v", "gv"), ("w", "gx")]))
        .is_err());
    // Not a snapshot: refused clearly.
    let err = node
        .clone_volume("w", "x", false)
        .expect_err("a clone of a volume")
        .to_string();
    assert!(err.contains("not a snapshot"), "{err}");
}
