//! Dedup pools (issue 25) as a user drives them: `pool create --dedup`, the same data
//! copied with nbdcopy into two volumes is stored once, `pool show` prints it, and a
//! kill -9 loses nothing that was flushed; `pool create --layout raid5 --dedup` is
//! refused and leaves no pool behind (the API's create removes it). `nbdinfo --map`,
//! fio with `dedupe_percentage=50`, a restart and the other refusals are tested in
//! process, in `crates/tessera-node/tests/node/dedup.rs`.

use crate::common;
use common::*;

use std::process::Command;

use serde_json::Value;

fn dedup(n: &TestNode) -> Value {
    let v = n.json(&["pool", "show", "p"]);
    assert!(v["dedup"].is_object(), "no dedup figures in {v}");
    v["dedup"].clone()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn identical_data_in_two_volumes_is_stored_once_and_survives_a_kill() {
    if !require_tool("nbdcopy") {
        return;
    }
    let mut n = TestNode::start_with_config("dedup-e2e", "");
    let d = path_str(&n.dir);
    let out = n.cli_ok(&["pool", "create", "p", &format!("{d}/p.img:256M"), "--dedup"]);
    assert!(out.contains("p"), "{out}");
    for v in ["a", "b"] {
        n.cli_ok(&["volume", "create", v, "--pool", "p", "--size", "64M"]);
        n.cli_ok(&["export", "add", v, "--volume", v]);
    }
    // 8 MiB of data (no zero blocks), copied into a at 0 and into b whole.
    let src = n.dir.join("src.bin");
    std::fs::write(&src, pattern(77, 8 << 20)).unwrap();
    for v in ["a", "b"] {
        run_ok(
            Command::new("nbdcopy")
                .arg("--flush")
                .arg(&src)
                .arg(n.uri(v)),
        );
    }
    let st = dedup(&n);
    assert_eq!(u(&st, "logical_bytes"), 16 << 20, "{st}");
    assert_eq!(u(&st, "physical_bytes"), 8 << 20, "stored once: {st}");
    assert_eq!(u(&st, "hits"), 2048, "{st}");
    let shown = n.cli_ok(&["pool", "show", "p"]);
    assert!(
        shown.contains("dedup: 16.0 MiB logical in 8.0 MiB stored (ratio 2.00); 2048 shared"),
        "{shown}"
    );
    // Per-volume opt-out, and dedup off for the pool: both as the user types them.
    n.cli_ok(&[
        "volume",
        "create",
        "c",
        "--pool",
        "p",
        "--size",
        "16M",
        "--no-dedup",
    ]);
    assert!(!n.cli_ok(&["volume", "show", "c"]).contains("dedup"));
    assert!(n.cli_ok(&["volume", "show", "a"]).contains("dedup volume"));
    let err = n.cli_fails(&["pool", "update", "p"]);
    assert!(
        err.contains("--overcommit") && err.contains("--dedup"),
        "{err}"
    );
    let shown = n.cli_ok(&["pool", "update", "p", "--dedup", "off"]);
    assert!(shown.contains("dedup (off: 0 blocks"), "{shown}");
    // nbdcopy flushes at the end: a kill -9 keeps both copies (and dedup off).
    n.kill9();
    n.restart();
    let shown = n.cli_ok(&["pool", "show", "p"]);
    assert!(shown.contains("dedup (off"), "{shown}");
    for v in ["a", "b"] {
        let back = n.dir.join(format!("{v}.bin"));
        run_ok(Command::new("nbdcopy").arg(n.uri(v)).arg(&back));
        let got = std::fs::read(&back).unwrap();
        assert!(
            got[..8 << 20] == pattern(77, 8 << 20)[..],
            "{v}: data differs after kill -9"
        );
        assert!(got[8 << 20..].iter().all(|&x| x == 0), "{v}: tail not zero");
    }
    let st = dedup(&n);
    assert_eq!(
        (u(&st, "logical_bytes"), u(&st, "physical_bytes")),
        (16 << 20, 8 << 20),
        "{st}"
    );
}

#[test]
fn a_dedup_pool_on_parity_is_refused_and_not_left_behind() {
    let n = TestNode::start_with_config("dedup-refusals", "");
    let d = path_str(&n.dir);
    let o = n.cli(&[
        "pool",
        "create",
        "r5",
        &format!("{d}/0.img:64M"),
        &format!("{d}/1.img:64M"),
        &format!("{d}/2.img:64M"),
        "--layout",
        "raid5",
        "--dedup",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("parity"), "{err}");
    // The refused pool is not left behind, and its devices can be used again.
    let pools = n.json(&["pool", "list"]);
    assert_eq!(pools.as_array().map(Vec::len), Some(0), "{pools}");
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{d}/0.img:64M"),
        "--dedup",
        "--force",
    ]);
}
