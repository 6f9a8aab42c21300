//! The metrics listener against a real Prometheus server: the test starts `prometheus`
//! scraping the node every second, writes a known amount through NBD, and asks
//! Prometheus (its HTTP API) for the volume's series, which must match the I/O done.
//! Then `/readyz` must turn 503 when every device of a mirrored pool fails.

use crate::common;
use common::*;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_nbd::client::{ClientOptions, NbdClient};

/// Percent-encode a PromQL expression for a query string.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server on a free port with its own storage, killed (by PID) on drop.
struct Prometheus {
    child: Child,
    addr: String,
}

impl Prometheus {
    fn start(dir: &Path, target: &str) -> Prometheus {
        let cfg = dir.join("prometheus.yml");
        std::fs::write(
            &cfg,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: tessera\n    scrape_interval: 1s\n    \
                 scrape_timeout: 900ms\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("prom-data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !matches!(http_get(&p.addr, "/-/ready"), Ok((200, _))) {
            assert!(
                Instant::now() < deadline,
                "prometheus did not become ready: {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// The value of an instant query's single sample (None while it has no sample).
    fn query(&self, q: &str) -> Option<f64> {
        let (status, body) = http_get(&self.addr, &format!("/api/v1/query?query={}", encode(q)))
            .unwrap_or_else(|e| panic!("query {q}: {e}"));
        assert_eq!(status, 200, "query {q}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
        assert_eq!(v["status"], "success", "{body}");
        let r = v["data"]["result"].as_array().unwrap();
        assert!(r.len() <= 1, "{q} matched several series: {body}");
        r.first()
            .map(|s| s["value"][1].as_str().unwrap().parse().unwrap())
    }

    /// Wait (bounded) until `q` evaluates to `want`; returns the last value seen.
    fn wait_for(&self, q: &str, want: f64) -> Option<f64> {
        let (Ok(v) | Err(v)) = poll_until(
            Duration::from_secs(20),
            Duration::from_millis(250),
            || self.query(q),
            |v| *v == Some(want),
        );
        v
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of one sample line of the node's own /metrics text.
fn sample(text: &str, series: &str) -> Option<f64> {
    metric_sample(text, series)
}

#[test]
fn prometheus_scrapes_what_clients_did_and_readyz_follows_the_pools() {
    if !require_tool("prometheus") {
        return;
    }
    let mport = free_port();
    let maddr = format!("127.0.0.1:{mport}");
    let n = TestNode::start_with_config(
        "metrics",
        &format!(
            "[metrics]\nlisten = \"{maddr}\"\n\
             [[pool]]\nname = \"p0\"\ndevices = [\"ram:256M\"]\n\
             [[volume]]\nname = \"v0\"\npool = \"p0\"\nsize = \"64M\"\n\
             [[export]]\nname = \"v0\"\nvolume = \"v0\"\n"
        ),
    );
    assert_eq!(http_get(&maddr, "/healthz").unwrap(), (200, "ok\n".into()));
    let (status, body) = http_get(&maddr, "/readyz").unwrap();
    assert_eq!(status, 200, "{body}");
    let ready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(ready["ready"], true, "{body}");

    let prom = Prometheus::start(&n.dir, &maddr);
    let up = prom.wait_for("up{job=\"tessera\"}", 1.0);
    assert_eq!(up, Some(1.0), "prometheus never scraped the node");

    // A known amount of I/O: N 4 KiB writes, 7 reads of 8 KiB, one flush.
    const N: u64 = 300;
    let mut c = NbdClient::connect_tcp(&n.addr(), "v0", ClientOptions::default()).unwrap();
    let block = vec![0x5au8; 4096];
    for i in 0..N {
        c.write(i * 4096, &block, false).unwrap();
    }
    let mut buf = vec![0u8; 8192];
    for i in 0..7 {
        c.read(i * 8192, &mut buf).unwrap();
    }
    c.flush().unwrap();
    // Still connected: the figures of a live connection are what is scraped.

    let vol = "pool=\"p0\",volume=\"v0\"";
    let q = |what: &str, op: &str| format!("{what}{{{vol},op=\"{op}\"}}");
    let writes = prom.wait_for(&q("tessera_volume_ops_total", "write"), N as f64);
    assert_eq!(writes, Some(N as f64));
    assert_eq!(
        prom.query(&q("tessera_volume_bytes_total", "write")),
        Some((N * 4096) as f64)
    );
    // The same scrape has the reads, the flush and the histograms.
    assert_eq!(
        prom.query(&q("tessera_volume_ops_total", "read")),
        Some(7.0)
    );
    assert_eq!(
        prom.query(&q("tessera_volume_bytes_total", "read")),
        Some(7.0 * 8192.0)
    );
    assert_eq!(
        prom.query(&q("tessera_volume_ops_total", "flush")),
        Some(1.0)
    );
    assert_eq!(
        prom.query(&q("tessera_volume_latency_seconds_count", "write")),
        Some(N as f64)
    );
    assert_eq!(
        prom.query(
            &q("tessera_volume_latency_seconds_bucket", "write").replace("}", ",le=\"+Inf\"}")
        ),
        Some(N as f64)
    );
    assert_eq!(
        prom.query(&q("tessera_volume_latency_seconds_count", "read")),
        Some(7.0)
    );
    // Prometheus computes quantiles from the buckets: a write took more than 0 and
    // less than a second here.
    let p99 = prom
        .query(&format!(
            "histogram_quantile(0.99, tessera_volume_latency_seconds_bucket{{{vol},op=\"write\"}})"
        ))
        .unwrap();
    assert!(p99 > 0.0 && p99 < 1.0, "p99 write latency {p99}");
    assert_eq!(
        prom.query("tessera_pool_ops_total{pool=\"p0\",op=\"write\"}"),
        Some(N as f64)
    );
    assert_eq!(
        prom.query("tessera_volume_errors_total{volume=\"v0\"}"),
        Some(0.0)
    );
    // The RAM device got at least the clients' writes (allocation may add zeroing).
    let dev_writes = prom
        .query("tessera_device_ops_total{pool=\"p0\",slot=\"0\",op=\"write\"}")
        .unwrap();
    assert!(dev_writes >= N as f64, "device writes {dev_writes}");
    assert_eq!(prom.query("tessera_pool_state{pool=\"p0\"}"), Some(0.0));
    // Every reactor core reports where its time went.
    let cores = prom
        .query("count(tessera_reactor_seconds_total{state=\"busy\"})")
        .unwrap();
    assert_eq!(cores, 2.0);
    c.disconnect().unwrap();

    // A mirrored pool whose two devices vanish a few seconds after they are opened:
    // ready while it is healthy, 503 with the reason once no copy is left.
    let d = path_str(&n.dir);
    let a = format!("fault:{d}/a.img:64M;vanish_after_ms=4000");
    let b = format!("fault:{d}/b.img:64M;vanish_after_ms=4000");
    n.cli_ok(&["pool", "create", "m", "--layout", "raid1", &a, &b]);
    let (status, body) = http_get(&maddr, "/readyz").unwrap();
    assert_eq!(status, 200, "healthy mirror: {body}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (status, body) = http_get(&maddr, "/readyz").unwrap();
        if status == 503 {
            break body;
        }
        assert_eq!(status, 200, "{body}");
        assert!(
            Instant::now() < deadline,
            "readyz never turned 503: {body}\n{}",
            n.log_text()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["ready"], false, "{body}");
    assert!(
        v["reasons"][0].as_str().unwrap().contains("pool 'm'"),
        "{body}"
    );
    // /healthz still says the process is alive; /metrics shows the failed pool and devices.
    assert_eq!(http_get(&maddr, "/healthz").unwrap().0, 200);
    let (status, text) = http_get(&maddr, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        sample(&text, "tessera_pool_state{pool=\"m\",state=\"failed\"}"),
        Some(3.0),
        "{text}"
    );
    let failed = text
        .lines()
        .filter(|l| l.starts_with("tessera_device_state{pool=\"m\"") && l.ends_with(" 2"))
        .count();
    assert_eq!(failed, 2, "{text}");
    let errors: f64 = text
        .lines()
        .filter(|l| l.starts_with("tessera_device_errors_total{pool=\"m\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert!(errors >= 2.0, "device errors {errors}: {text}");
    // And Prometheus sees it too.
    assert_eq!(
        prom.wait_for("tessera_pool_state{pool=\"m\"}", 3.0),
        Some(3.0)
    );
}

/// The access-pattern figures: a stream read in one 1 GiB region, random reads in a
/// second, and writes walked forward with gaps in a third, each from its own
/// connection, come out labelled sequential, random and monotonic.
#[test]
fn access_patterns_are_counted_by_region() {
    const N: u64 = 300;
    const G: u64 = 1 << 30;
    let mport = free_port();
    let maddr = format!("127.0.0.1:{mport}");
    let n = TestNode::start_with_config(
        "metrics-patterns",
        &format!(
            "[metrics]\nlisten = \"{maddr}\"\n\
             [[pool]]\nname = \"p0\"\ndevices = [\"ram:256M\"]\n\
             [[volume]]\nname = \"v0\"\npool = \"p0\"\nsize = \"4G\"\n\
             [[export]]\nname = \"v0\"\nvolume = \"v0\"\n"
        ),
    );
    let connect = || NbdClient::connect_tcp(&n.addr(), "v0", ClientOptions::default()).unwrap();
    let mut buf = vec![0u8; 4096];
    let mut c = connect();
    for i in 0..N {
        c.read(i * 4096, &mut buf).unwrap();
    }
    c.disconnect().unwrap();
    let mut c = connect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..N {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.read(G + (x % (G / 4096)) * 4096, &mut buf).unwrap();
    }
    c.disconnect().unwrap();
    // 60 writes 2 MiB apart (60 units of space at most: the pool has 256 MiB).
    let mut c = connect();
    for i in 0..60 {
        c.write(2 * G + i * (2 << 20), &buf, false).unwrap();
    }
    c.disconnect().unwrap();

    let series = |what: &str, pattern: &str| {
        format!("tessera_volume_{what}{{pool=\"p0\",volume=\"v0\",pattern=\"{pattern}\"}}")
    };
    // A closing connection's handle adds its counts: wait until every request shows.
    let mut text = String::new();
    wait_for("every request to be counted by pattern", 20, || {
        text = http_get(&maddr, "/metrics").unwrap().1;
        let sum = |what: &str| -> f64 {
            ["unknown", "sequential", "monotonic", "random"]
                .iter()
                .map(|p| sample(&text, &series(what, p)).unwrap_or(0.0))
                .sum()
        };
        sum("read_pattern_requests_total") == 2.0 * N as f64
            && sum("write_pattern_requests_total") == 60.0
    });
    let get = |what: &str, p: &str| sample(&text, &series(what, p)).unwrap();
    // Each region's first 7 requests have too little history to be labelled.
    assert_eq!(
        get("read_pattern_requests_total", "unknown"),
        14.0,
        "{text}"
    );
    assert_eq!(
        get("write_pattern_requests_total", "unknown"),
        7.0,
        "{text}"
    );
    // The stream: every other read.
    assert_eq!(
        get("read_pattern_requests_total", "sequential"),
        (N - 7) as f64
    );
    assert_eq!(
        get("read_pattern_bytes_total", "sequential"),
        ((N - 7) * 4096) as f64
    );
    // The random reads: random, but for windows that happen to go forward 12 times in 16.
    let random = get("read_pattern_requests_total", "random");
    assert!(
        random >= 0.8 * (N - 7) as f64,
        "random reads {random}\n{text}"
    );
    assert_eq!(
        random + get("read_pattern_requests_total", "monotonic"),
        (N - 7) as f64
    );
    // The forward walk: monotonic.
    assert_eq!(get("write_pattern_requests_total", "monotonic"), 53.0);
    assert_eq!(get("write_pattern_bytes_total", "monotonic"), 53.0 * 4096.0);
    // The stream was read from RAM, which answers at once: nothing was read ahead.
    for what in ["reads", "bytes"] {
        let name = format!("tessera_volume_readahead_{what}_total{{pool=\"p0\",volume=\"v0\"}}");
        assert_eq!(sample(&text, &name), Some(0.0), "{text}");
    }
}
