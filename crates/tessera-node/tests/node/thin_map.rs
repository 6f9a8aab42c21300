//! A pool's overcommit ratio: thin volumes may provision up to 20x the pool's capacity by
//! default, or the ratio the pool was given; beyond it creating or growing a volume is
//! refused (saying the figures and how to go on) unless forced; the ratio changes live and
//! persists across a restart, like what was provisioned. (Moved from
//! `crates/tessera-cli/tests/cli/thin_map.rs`, which keeps what a petabyte volume costs in
//! the node process's memory, its data, and `pool create --overcommit`'s checks.)

use crate::common;
use common::*;

use tessera_api::{LayoutSpec, UpdatePool};

const PIB: u64 = 1 << 50;
const TIB: u64 = 1 << 40;

/// `tessera pool create NAME DEV [--overcommit R]`: the pool created, then its ratio set,
/// as the API does.
fn create_pool(n: &TestNode, name: &str, dev: &str, overcommit: Option<f64>) {
    let node = n.node();
    node.create_pool(
        name,
        &[dev.to_string()],
        LayoutSpec::default(),
        None,
        None,
        false,
    )
    .unwrap_or_else(|e| panic!("create pool {name}: {e}"));
    if overcommit.is_some() {
        let u = UpdatePool {
            overcommit,
            ..UpdatePool::default()
        };
        node.update_pool(name, &u)
            .unwrap_or_else(|e| panic!("set the ratio of {name}: {e}"));
    }
}

#[test]
fn overcommit_ratio_bounds_provisioning_and_persists() {
    let mut n = TestNode::start("thin-map", 2);
    create_pool(&n, "p", &n.file_dev("p.img", "2G"), None);
    assert_eq!(n.pool_json("p")["overcommit"].as_f64(), Some(20.0));
    // A ratio chosen at creation.
    create_pool(&n, "q", &n.file_dev("q.img", "256M"), Some(2.5));
    assert_eq!(n.pool_json("q")["overcommit"].as_f64(), Some(2.5));

    // Beyond 20x the capacity: refused, saying the figures and how to go on.
    let node = n.node().clone();
    let err = node
        .create_volume("big", "p", PIB, false)
        .expect_err("1 PiB on a 2 GiB pool was accepted")
        .to_string();
    assert!(
        err.contains("20x") && err.contains("--force") && err.contains("1.0 PiB"),
        "{err}"
    );
    assert!(n.volumes_json().as_array().unwrap().is_empty());

    node.create_volume("big", "p", PIB, true)
        .expect("1 PiB, forced");
    assert_eq!(n.pool_json("p")["provisioned"].as_u64(), Some(PIB));
    // Growth beyond the ratio is refused too, and allowed with a higher ratio.
    assert!(node.resize_volume("big", 1025 * TIB, false).is_err());

    // The ratio is the node's setting per pool: it survives a restart.
    node.update_pool(
        "p",
        &UpdatePool {
            overcommit: Some(600000.0),
            ..UpdatePool::default()
        },
    )
    .expect("raise the ratio");
    node.resize_volume("big", 1025 * TIB, false)
        .expect("grow under the new ratio");
    drop(node);
    n.restart();
    assert_eq!(n.pool_json("p")["overcommit"].as_f64(), Some(600000.0));
    assert_eq!(n.pool_json("q")["overcommit"].as_f64(), Some(2.5));
    assert_eq!(n.pool_json("p")["provisioned"].as_u64(), Some(1025 * TIB));
    // Over the new ratio (1025 TiB is 512,500x of 2 GiB; 600,000x allows ~1.14 PiB).
    assert!(n
        .node()
        .create_volume("more", "p", 200 * TIB, false)
        .is_err());
}
