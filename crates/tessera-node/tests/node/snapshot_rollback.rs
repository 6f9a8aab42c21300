//! Rollback of a volume to a snapshot (refused while the volume is exported), group
//! snapshots, and a clone of something that is not a snapshot. (Moved from
//! `crates/tessera-cli/tests/cli/snapshots.rs`, which keeps the tests with external NBD
//! clients and a kill -9.)

// Test code sizes buffers from its own small constants.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 32 * MIB;

/// Write `data` at `off` of export `export` and flush; the same bytes go into `model`.
fn write_at(n: &TestNode, export: &str, model: &mut [u8], off: u64, data: &[u8]) {
    let mut c = n.nbd(export);
    c.write(off, data, false).unwrap();
    c.flush().unwrap();
    c.disconnect().unwrap();
    let at = usize::try_from(off).unwrap();
    model[at..at + data.len()].copy_from_slice(data);
}

/// Every byte of export `export`, read in 4 MiB requests.
fn read_all(n: &TestNode, export: &str) -> Vec<u8> {
    let mut c = n.nbd(export);
    let size = usize::try_from(c.size()).unwrap();
    let mut buf = vec![0u8; size];
    for (i, chunk) in buf.chunks_mut(4 << 20).enumerate() {
        c.read(i as u64 * (4 << 20), chunk).unwrap();
    }
    c.disconnect().unwrap();
    buf
}

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
