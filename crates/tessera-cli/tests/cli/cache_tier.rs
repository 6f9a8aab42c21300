//! A pool's cache tier (issue 24) managed through the CLI and the API: add, show, mode,
//! remove, `pool create --cache` (the API's create adds the cache and does not leave a
//! pool refused its cache behind), `--cache-unit` and `--cache-admit-hits`, what `pool
//! cache show` prints, the registry across a restart, refusals. The tier's datapath
//! under fio (every mode, a cache device vanishing, modes switched under load, snapshots
//! and deleted volumes) is tested in process, in
//! `crates/tessera-node/tests/node/cache_tier.rs`.

use crate::common;
use common::*;

use std::process::Output;

use serde_json::Value;

fn combined(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn cache(n: &TestNode, pool: &str) -> Value {
    n.json(&["pool", "cache", "show", pool])
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn cli_and_api_manage_the_cache_and_a_restart_keeps_it() {
    let n = TestNode::start_with_config("cache-cli", "");
    let d = path_str(&n.dir);
    n.cli_ok(&["pool", "create", "p", &format!("{d}/p.img:128M")]);
    n.cli_ok(&["pool", "create", "q", &format!("{d}/q.img:128M")]);
    // No cache yet.
    let o = n.cli(&["pool", "cache", "show", "p"]);
    assert!(!o.status.success(), "{}", combined(&o));
    // Refusals: a pool's device, write-back, three devices.
    let o = n.cli(&["pool", "cache", "add", "p", &format!("{d}/q.img")]);
    assert!(
        !o.status.success() && combined(&o).contains("device of pool 'q'"),
        "{}",
        combined(&o)
    );
    let o = n.cli(&[
        "pool",
        "cache",
        "add",
        "p",
        &format!("{d}/c.img:40M"),
        "--mode",
        "write-back",
    ]);
    assert!(
        !o.status.success() && combined(&o).contains("one cache device"),
        "{}",
        combined(&o)
    );
    // Add, show, mode, and the metrics.
    n.cli_ok(&[
        "pool",
        "cache",
        "add",
        "p",
        &format!("{d}/c.img:40M"),
        "--mode",
        "write-around",
    ]);
    let c = cache(&n, "p");
    assert_eq!(c["mode"], "write-around");
    // 40 MiB less the label's MiB and the slot records' MiB.
    assert_eq!(u(&c, "capacity"), 38 << 20, "{c}");
    let text = n.cli_ok(&["pool", "cache", "show", "p"]);
    assert!(text.contains("write-around (ok)"), "{text}");
    let o = n.cli(&["pool", "cache", "add", "q", &format!("{d}/c.img")]);
    assert!(
        !o.status.success() && combined(&o).contains("cache of pool 'p'"),
        "{}",
        combined(&o)
    );
    n.cli_ok(&["pool", "cache", "mode", "p", "write-through"]);
    // A pool created with a cache of 16 KiB units; a unit out of range is refused.
    let o = n.cli(&[
        "pool",
        "create",
        "r",
        &format!("{d}/r.img:64M"),
        "--cache",
        &format!("{d}/rc.img:24M"),
        "--cache-unit",
        "8K",
    ]);
    assert!(
        !o.status.success() && combined(&o).contains("16K to 1M"),
        "{}",
        combined(&o)
    );
    assert!(
        !n.cli(&["pool", "show", "r"]).status.success(),
        "a pool refused its cache was left behind"
    );
    n.cli_ok(&[
        "pool",
        "create",
        "r",
        &format!("{d}/r.img:64M"),
        "--cache",
        &format!("{d}/rc.img:24M"),
        "--cache-unit",
        "16K",
    ]);
    let c = cache(&n, "r");
    assert_eq!(u(&c, "unit_size"), 16 << 10, "{c}");
    // 24 MiB less the label's MiB and the slot records' MiB (one 512-byte record per
    // 16 KiB slot).
    assert_eq!(u(&c, "capacity"), 22 << 20, "{c}");
    // A restart brings the tier back from the registry, cold.
    let mut n = n;
    n.stop();
    n.restart();
    assert_eq!(u(&cache(&n, "r"), "unit_size"), 16 << 10);
    let c = cache(&n, "p");
    assert_eq!(c["mode"], "write-through", "{c}");
    assert_eq!(c["state"], "ok", "{c}");
    assert_eq!(u(&c, "cached_units"), 0);
    // Removing it: the pool goes on; the device is free for another pool's cache.
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    assert!(!n.cli(&["pool", "cache", "show", "p"]).status.success());
    n.cli_ok(&["pool", "cache", "add", "q", &format!("{d}/c.img")]);
    n.stop();
    n.restart();
    assert_eq!(cache(&n, "q")["state"], "ok");
    assert!(!n.cli(&["pool", "cache", "show", "p"]).status.success());
}

#[test]
fn admit_hits_is_set_at_create_and_add_shown_and_kept_across_a_restart() {
    let mut n = TestNode::start_with_config("cache-admit-hits", "");
    let d = path_str(&n.dir);
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{d}/p.img:160M"),
        "--cache",
        &format!("{d}/c0.img:48M"),
        "--cache-admit-hits",
        "3",
    ]);
    assert_eq!(cache(&n, "p")["admit_hits"], 3);
    let text = n.cli_ok(&["pool", "cache", "show", "p"]);
    assert!(text.contains("at its miss number 3"), "{text}");
    n.stop();
    n.restart();
    assert_eq!(cache(&n, "p")["admit_hits"], 3, "kept across a restart");
    // 0 is refused before anything changes; the default is 1.
    let o = n.cli(&["pool", "cache", "add", "q", "ram:48M", "--admit-hits", "0"]);
    assert!(!o.status.success(), "{}", combined(&o));
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    n.cli_ok(&["pool", "cache", "add", "p", &format!("{d}/c1.img:48M")]);
    assert_eq!(cache(&n, "p")["admit_hits"], 1);
    n.cli_ok(&["pool", "cache", "remove", "p"]);
    let c2 = format!("{d}/c2.img:48M");
    n.cli_ok(&["pool", "cache", "add", "p", &c2, "--admit-hits", "2"]);
    assert_eq!(cache(&n, "p")["admit_hits"], 2);
}
