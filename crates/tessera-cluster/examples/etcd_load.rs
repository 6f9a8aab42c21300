//! Steady-state etcd traffic of a simulated Tessera cluster, measured by etcd itself.
//!
//! ```text
//! cargo run --release -p tessera-cluster --example etcd_load -- \
//!     [--volumes 100000] [--nodes 1000] [--secs 60] [--per-conn 50] \
//!     [--poll-nodes 10] [--poll-secs 20] [--changes-per-sec 0] [--etcd http://HOST:PORT]
//! ```
//!
//! Starts its own etcd (Debian's etcd-server, one member on a free loopback port) unless
//! `--etcd` names one, puts `--volumes` volume specs of a realistic size, then simulates
//! `--nodes` nodes as the node does today: each with a lease kept alive every TTL/3
//! (TTL 5 s, the default `lease_ttl_ms`), its record under the lease, and the two
//! watches a node holds (volume specs and node records, started from the current
//! revision: the one listing at join is not steady state). `--per-conn` simulated nodes
//! share one gRPC connection. After a settling second it reads etcd's own counters
//! (`etcd_network_client_grpc_received_bytes_total` and `..._sent_bytes_total` from
//! `/metrics`) before and after `--secs` seconds and prints the traffic in MiB/s.
//!
//! Then, for comparison, `--poll-nodes` nodes run the old design on top for
//! `--poll-secs`: a full listing of the volume and node prefixes every TTL/4 (1.25 s);
//! the extra traffic per polling node, times `--nodes`, is what the old design cost.
//! `--changes-per-sec` rewrites that many specs a second during the watch phase (each
//! change reaches every node's watch). Bounded: every phase has a deadline, and the
//! program exits when done.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions, PutOptions, WatchOptions};
use tessera_cluster::{node_key, volume_key, NodeRecord, PoolRecord, VolumeSpec, PREFIX};

const TTL: i64 = 5;

struct Args {
    volumes: usize,
    nodes: usize,
    secs: u64,
    per_conn: usize,
    poll_nodes: usize,
    poll_secs: u64,
    changes_per_sec: u64,
    etcd: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        volumes: 100_000,
        nodes: 1000,
        secs: 60,
        per_conn: 50,
        poll_nodes: 10,
        poll_secs: 20,
        changes_per_sec: 0,
        etcd: None,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        let n = || val.parse::<u64>().expect("a number");
        let u = || val.parse::<usize>().expect("a number");
        match v[i].as_str() {
            "--volumes" => a.volumes = u(),
            "--nodes" => a.nodes = u(),
            "--secs" => a.secs = n().min(600),
            "--per-conn" => a.per_conn = u().max(1),
            "--poll-nodes" => a.poll_nodes = u(),
            "--poll-secs" => a.poll_secs = n().min(600),
            "--changes-per-sec" => a.changes_per_sec = n(),
            "--etcd" => a.etcd = Some(val.clone()),
            other => panic!("unknown argument {other} (see the example's doc comment)"),
        }
        i += 2;
    }
    a
}

fn node_name(k: usize) -> String {
    format!("node-{k:04}")
}

fn spec(i: usize, nodes: usize) -> Vec<u8> {
    let n = nodes.max(3);
    let replicas: Vec<String> = (0..3)
        .map(|r| format!("{}:pool-nvme", node_name((i + r * 7) % n)))
        .collect();
    let s = VolumeSpec {
        name: format!("pvc-{i:08x}-4e1b-9d2c-volume"),
        size: 64 << 30,
        owner: replicas[0].split(':').next().unwrap().to_string(),
        replicas,
        epoch: 3,
        copies: 3,
        out_of_sync: Vec::new(),
        lost: Vec::new(),
        snapshot_intent: None,
        iscsi_pr: None,
    };
    serde_json::to_vec(&s).unwrap()
}

fn record(k: usize) -> Vec<u8> {
    let mut labels = std::collections::BTreeMap::new();
    labels.insert("zone".to_string(), format!("z{}", k % 3));
    labels.insert("rack".to_string(), format!("r{:03}", k % 50));
    let r = NodeRecord {
        name: node_name(k),
        api: format!(
            "https://10.{}.{}.{}:9443",
            k / 65536,
            (k / 256) % 256,
            k % 256
        ),
        nvmf: Some(format!(
            "10.{}.{}.{}:4420",
            k / 65536,
            (k / 256) % 256,
            k % 256
        )),
        nbd: vec![format!(
            "10.{}.{}.{}:10809",
            k / 65536,
            (k / 256) % 256,
            k % 256
        )],
        labels,
        pools: vec![
            PoolRecord {
                name: "pool-nvme".into(),
                size: 30 << 40,
                free: 12 << 40,
            },
            PoolRecord {
                name: "pool-hdd".into(),
                size: 200 << 40,
                free: 150 << 40,
            },
        ],
        started: 1_790_000_000,
    };
    serde_json::to_vec(&r).unwrap()
}

/// etcd's gRPC byte counters (received, sent) from its /metrics.
fn counters(endpoint: &str) -> (f64, f64) {
    let addr = endpoint.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("etcd metrics");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let sum = |name: &str| -> f64 {
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        sum("etcd_network_client_grpc_received_bytes_total"),
        sum("etcd_network_client_grpc_sent_bytes_total"),
    )
}

fn mib(b: f64) -> f64 {
    b / (1024.0 * 1024.0)
}

async fn connect(ep: &str) -> Client {
    Client::connect([ep], None).await.expect("connect to etcd")
}

/// A simulated node: lease, record, keepalives; with `watch`, the node's two watches.
async fn node(c: Client, k: usize, watch: bool, events: Arc<AtomicU64>, until: Instant) {
    let mut c = c;
    let lease = c.lease_grant(TTL, None).await.expect("grant").id();
    c.put(
        node_key(&node_name(k)),
        record(k),
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .expect("record");
    let rev = c
        .get("/", Some(GetOptions::new().with_count_only()))
        .await
        .expect("rev");
    let rev = rev.header().map_or(0, |h| h.revision());
    if watch {
        for p in ["volumes/", "nodes/"] {
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(rev + 1);
            let mut w = c
                .watch(format!("{PREFIX}{p}"), Some(opts))
                .await
                .expect("watch");
            let ev = events.clone();
            tokio::spawn(async move {
                while let Ok(Some(r)) = w.message().await {
                    ev.fetch_add(r.events().len() as u64, Relaxed);
                }
            });
        }
    }
    let (mut keeper, mut stream) = c.lease_keep_alive(lease).await.expect("keepalive");
    // Spread the renewals over the period, as independent nodes would be.
    let period = Duration::from_millis(TTL as u64 * 1000 / 3);
    tokio::time::sleep(period.mul_f64((k % 97) as f64 / 97.0)).await;
    while Instant::now() < until {
        if keeper.keep_alive().await.is_err() || stream.message().await.is_err() {
            eprintln!("node {k}: keepalive failed");
            return;
        }
        tokio::time::sleep(period).await;
    }
}

/// The old design's polling: every TTL/4, list the volume and node prefixes.
async fn poller(c: Client, until: Instant) {
    let mut kv = c.kv_client().max_decoding_message_size(512 << 20);
    while Instant::now() < until {
        for p in ["volumes/", "nodes/"] {
            let _ = kv
                .get(
                    format!("{PREFIX}{p}"),
                    Some(GetOptions::new().with_prefix()),
                )
                .await;
        }
        tokio::time::sleep(Duration::from_millis(1250)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let started = Instant::now();
    let own;
    let ep = match &a.etcd {
        Some(e) => e.clone(),
        None => {
            own = tessera_testkit::etcd::EtcdCluster::start("etcd-load", 1);
            own.endpoints()[0].clone()
        }
    };
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    println!(
        "etcd {ep}; CPU {cpu} ({} cores)",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // The volume specs.
    let t = Instant::now();
    let writers = 32;
    let mut tasks = Vec::new();
    let spec_bytes = Arc::new(AtomicU64::new(0));
    for w in 0..writers {
        let mut c = connect(&ep).await;
        let (nv, nn, sb) = (a.volumes, a.nodes, spec_bytes.clone());
        tasks.push(tokio::spawn(async move {
            for i in (w..nv).step_by(writers) {
                let v = spec(i, nn);
                sb.fetch_add(v.len() as u64, Relaxed);
                let name = format!("pvc-{i:08x}-4e1b-9d2c-volume");
                c.put(volume_key(&name), v, None).await.expect("put spec");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "put {} volume specs ({:.1} MiB, {} B each on average) in {:.1} s",
        a.volumes,
        mib(spec_bytes.load(Relaxed) as f64),
        spec_bytes.load(Relaxed) / a.volumes.max(1) as u64,
        t.elapsed().as_secs_f64()
    );

    // The simulated nodes, sharing connections.
    let events = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(a.secs + a.poll_secs + 30);
    let mut conns = Vec::new();
    for _ in 0..a.nodes.div_ceil(a.per_conn) {
        conns.push(connect(&ep).await);
    }
    let mut sims = Vec::new();
    for k in 0..a.nodes {
        sims.push(tokio::spawn(node(
            conns[k / a.per_conn].clone(),
            k,
            true,
            events.clone(),
            until,
        )));
    }
    println!(
        "{} nodes on {} connections: leases, records, {} watches",
        a.nodes,
        conns.len(),
        2 * a.nodes
    );
    tokio::time::sleep(Duration::from_secs(3)).await;

    let churn = {
        let (mut c, cps, nv, nn) = (conns[0].clone(), a.changes_per_sec, a.volumes, a.nodes);
        let stop = Instant::now() + Duration::from_secs(a.secs);
        tokio::spawn(async move {
            if cps == 0 {
                return;
            }
            let mut i = 0;
            while Instant::now() < stop {
                let k = i % nv.max(1);
                let name = format!("pvc-{k:08x}-4e1b-9d2c-volume");
                let _ = c.put(volume_key(&name), spec(k, nn), None).await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(1000 / cps)).await;
            }
        })
    };
    let (r0, s0) = counters(&ep);
    let e0 = events.load(Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.secs)).await;
    let (r1, s1) = counters(&ep);
    let dt = t0.elapsed().as_secs_f64();
    let _ = churn.await;
    let watch_rate = (r1 - r0 + s1 - s0) / dt;
    println!(
        "WATCH design, {} nodes, {} volumes, {} spec changes/s, {:.0} s: etcd received {:.4} MiB/s, sent {:.4} MiB/s, total {:.4} MiB/s ({} watch events delivered)",
        a.nodes,
        a.volumes,
        a.changes_per_sec,
        dt,
        mib(r1 - r0) / dt,
        mib(s1 - s0) / dt,
        mib(watch_rate),
        events.load(Relaxed) - e0
    );

    if a.poll_nodes > 0 && a.poll_secs > 0 {
        let poll_until = Instant::now() + Duration::from_secs(a.poll_secs + 2);
        let mut polls = Vec::new();
        for _ in 0..a.poll_nodes {
            polls.push(tokio::spawn(poller(connect(&ep).await, poll_until)));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (r0, s0) = counters(&ep);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(a.poll_secs)).await;
        let (r1, s1) = counters(&ep);
        let dt = t0.elapsed().as_secs_f64();
        let per_node = ((r1 - r0 + s1 - s0) / dt - watch_rate).max(0.0) / a.poll_nodes as f64;
        println!(
            "POLLING design (measured with {} polling nodes for {:.0} s on top): {:.2} MiB/s per polling node; x {} nodes = {:.0} MiB/s",
            a.poll_nodes,
            dt,
            mib(per_node),
            a.nodes,
            mib(per_node * a.nodes as f64)
        );
        for p in polls {
            p.abort();
        }
    }
    for s in sims {
        s.abort();
    }
    println!("done in {:.0} s", started.elapsed().as_secs_f64());
}
