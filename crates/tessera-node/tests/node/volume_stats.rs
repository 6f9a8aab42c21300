//! Per-volume client I/O figures: exact totals after the clients are done, live rates and
//! latency percentiles while they run. (Moved from `crates/tessera-cli/tests/cli/volume_stats.rs`,
//! which ran them through the `tessera` binary.)

use crate::common;

use std::time::Duration;

use common::*;
use tessera_nbd::client::{ClientOptions, NbdClient};

/// What `tessera --json volume stats NAME --interval SECS` shows: the node's figures over
/// that window, as the API serves them.
fn stats(n: &TestNode, interval: &str) -> serde_json::Value {
    let secs: f64 = interval.parse().unwrap();
    json(
        n.node()
            .volume_stats("vol0", Duration::from_secs_f64(secs))
            .expect("volume stats"),
    )
}

#[test]
fn totals_are_exact_and_rates_are_live() {
    let n = TestNode::up("stats");
    let addr = n.addr();
    // A background writer keeps the volume busy while we sample rates.
    let writer = std::thread::spawn(move || {
        let mut c = NbdClient::connect_tcp(&addr, "vol0", ClientOptions::default()).unwrap();
        let block = vec![7u8; 4096];
        let t = std::time::Instant::now();
        let mut writes = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(1500) {
            c.write((writes % 4096) * 4096, &block, false).unwrap();
            writes += 1;
        }
        c.disconnect().unwrap();
        writes
    });
    // Live figures appear while the writer runs (sampled until they do, within its run:
    // a busy machine may start the writer late).
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(1400);
    let live = loop {
        let live = stats(&n, "0.2");
        if live["write_iops"].as_f64().unwrap() > 100.0
            || std::time::Instant::now() > deadline
            || writer.is_finished()
        {
            break live;
        }
    };
    assert!(live["write_iops"].as_f64().unwrap() > 100.0, "{live}");
    assert!(
        live["latency_us"]["requests"].as_u64().unwrap() > 0,
        "{live}"
    );
    assert!(live["latency_us"]["p99"].as_f64().unwrap() > 0.0, "{live}");
    let writes = writer.join().unwrap();

    // Reads on a second connection, then exact totals (connections closed and folded in).
    let mut c = NbdClient::connect_tcp(&n.addr(), "vol0", ClientOptions::default()).unwrap();
    let mut buf = vec![0u8; 8192];
    for i in 0..100u64 {
        c.read(i * 8192, &mut buf).unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
    // A closed connection's figures are folded in when its core sees the close: wait
    // (bounded) for the reads to be counted, then every total must be exact.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let totals = loop {
        let v = stats(&n, "0.01");
        let t = v["totals"].clone();
        if t["reads"].as_u64() == Some(100) && t["others"].as_u64() == Some(1)
            || std::time::Instant::now() > deadline
        {
            break t;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let t = &totals;
    assert_eq!(t["writes"].as_u64().unwrap(), writes, "{t}");
    assert_eq!(t["write_bytes"].as_u64().unwrap(), writes * 4096, "{t}");
    assert_eq!(t["reads"].as_u64().unwrap(), 100, "{t}");
    assert_eq!(t["read_bytes"].as_u64().unwrap(), 100 * 8192, "{t}");
    assert_eq!(t["others"].as_u64().unwrap(), 1, "the flush: {t}");
    assert_eq!(t["errors"].as_u64().unwrap(), 0, "{t}");
    // An unknown volume is a clear error (the text the CLI prints).
    let e = n
        .node()
        .volume_stats("nope", Duration::from_millis(10))
        .expect_err("stats of an unknown volume");
    assert!(e.to_string().contains("not found"), "{e}");
}
