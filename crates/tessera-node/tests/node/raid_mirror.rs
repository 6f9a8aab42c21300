//! Mirrored pools: create raid1/raid10, a device that vanishes is shown failed (pool
//! degraded), and stays failed after a node restart even though the device answers again
//! for a while. (Moved from `crates/tessera-cli/tests/cli/raid_mirror.rs`; the CLI's pool table
//! for a failed device is checked by `replace_is_live` in
//! `crates/tessera-cli/tests/cli/hot_spare.rs`.)

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use serde_json::Value;

/// Pool `name` as `tessera --json pool list` lists it.
fn pool(n: &TestNode, name: &str) -> Value {
    n.pools_json()
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("pool {name} not listed"))
}

#[test]
fn mirror_failure_is_shown_and_survives_restart() {
    let mut n = TestNode::start("raid-mirror", 2);
    let d = path_str(&n.dir);
    // Device a of the raid1 pool vanishes 3 s after it is opened (also after a restart).
    let a = format!("fault:{d}/a.img:64M;vanish_after_ms=3000");
    let b = format!("{d}/b.img:64M");
    n.create_pool("m1", "raid1", &[a, b]);
    let p = pool(&n, "m1");
    assert_eq!(p["layout"], "raid1");
    assert_eq!(p["copies"], 2);
    assert_eq!(p["state"], "online");

    // `--layout raid10 --copies 2 --stripe-size 64K`.
    let devs: Vec<String> = (0..4).map(|i| format!("{d}/r{i}.img:64M")).collect();
    let layout = "raid10"
        .parse::<tessera_api::LayoutSpec>()
        .unwrap()
        .with_copies(2)
        .unwrap();
    n.node()
        .create_pool("m10", &devs, layout, Some(64 << 10), None, false)
        .unwrap();
    let p = pool(&n, "m10");
    assert_eq!(p["layout"], "raid10");
    assert_eq!(p["stripe_size"], 65536);
    assert_eq!(p["state"], "online");
    n.node().create_volume("v1", "m1", 16 << 20, false).unwrap();

    // The commit thread syncs the devices at least every 5 s: that finds the vanished one.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = pool(&n, "m1");
        if p["state"] == "degraded" {
            assert_eq!(p["device_states"][0]["state"], "failed");
            assert_eq!(p["device_states"][1]["state"], "online");
            break;
        }
        assert!(Instant::now() < deadline, "device never marked failed: {p}");
        std::thread::sleep(Duration::from_millis(250));
    }
    // Let the commit thread record it, then restart: device a answers again for 3 s,
    // but its label is older than b's, so it stays failed.
    std::thread::sleep(Duration::from_millis(500));
    n.restart();
    let p = pool(&n, "m1");
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][0]["state"], "failed");
    assert_eq!(pool(&n, "m10")["state"], "online");
    let v = n.volumes_json().to_string();
    assert!(v.contains("v1"), "{v}");

    // A raid10 device that is gone at start: the pool comes up degraded without it.
    n.stop();
    std::fs::remove_file(n.dir.join("r1.img")).unwrap();
    n.restart();
    let p = pool(&n, "m10");
    assert_eq!(p["state"], "degraded", "{p}");
    assert_eq!(p["device_states"][1]["state"], "failed");
    assert_eq!(p["device_states"][0]["state"], "online");
}
