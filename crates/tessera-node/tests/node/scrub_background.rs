//! Scrub in the "scrub" background class: it reads every allocated unit and the
//! metadata, and reports unreadable ranges. (Moved from
//! `crates/tessera-cli/tests/measured/scrub_background.rs`, which keeps the class limits' persistence
//! across a kill -9 and the scrub's back-off for clients.)

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// `tessera --json pool scrub POOL --status`.
fn scrub_json(n: &TestNode, pool: &str) -> Value {
    let p = n.node().pools().get(pool).expect("pool");
    json(n.node().jobs().scrub_status(&p).expect("scrub status"))
}

fn wait_done(n: &TestNode, pool: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let v = scrub_json(n, pool);
        if v["state"] != "running" {
            return v;
        }
        assert!(t0.elapsed().as_secs() < 120, "scrub did not finish: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tessera --json pool scrub POOL` (with repair, the default): the API's answer.
fn start_scrub(n: &TestNode, pool: &str) -> tessera_node::node::Result<Value> {
    let node = n.node();
    node.pools()
        .get(pool)
        .and_then(|p| node.jobs().start_scrub(&p, true))
        .map(json)
}

#[test]
fn scrub_reads_allocated_units_and_reports_unreadable_ones() {
    let n = TestNode::with_nbd("scrub", 2);
    // Reads of 4 KiB at device offset 24 MiB fail (units are allocated from the bottom of
    // the pool down); writes there still work.
    let dev = format!(
        "fault:{}:256M;fail_read=25165824-25169920",
        n.dir.join("d.img").display()
    );
    n.create_pool("fp", "concat", &[dev]);
    n.exported_volume("fv", "fp", 128 << 20);
    // Fill 64 MiB: 64 units, across the failing range.
    let mut c = n.nbd("fv");
    for i in 0..64u64 {
        c.write(i << 20, &pattern(i, 1 << 20), false).unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    let v = start_scrub(&n, "fp").expect("start the scrub");
    assert_eq!(v["state"], "running", "{v}");
    // A second start while one runs is refused with a reason, and starts nothing; if the
    // first one has finished already (a fast machine), the second is a new scrub.
    match start_scrub(&n, "fp") {
        Ok(a) => assert_eq!(a["state"], "running", "{a}"),
        Err(e) => assert!(
            e.to_string().contains("already running"),
            "second scrub refused without the reason: {e}"
        ),
    }
    let v = wait_done(&n, "fp");
    assert_eq!(v["state"], "done", "{v}");
    assert_eq!(v["units_total"], v["units_done"], "{v}");
    assert!(v["units_total"].as_u64().unwrap() >= 60, "{v}");
    assert_eq!(
        v["bytes_done"].as_u64().unwrap(),
        v["units_total"].as_u64().unwrap() << 20
    );
    assert!(v["read_errors"].as_u64().unwrap() >= 1, "{v}");
    assert!(v["errors"][0].as_str().unwrap().contains("unit"), "{v}");
    assert_eq!(v["metadata_findings"].as_array().unwrap().len(), 0, "{v}");
    // (The human form, the bar and the findings' line, is checked by the back-off test in
    // crates/tessera-cli/tests/measured/scrub_background.rs.)
    // Unknown pool: a clear error.
    let e = start_scrub(&n, "nope").expect_err("a scrub of an unknown pool");
    assert!(e.to_string().contains("not found"), "{e}");
}
