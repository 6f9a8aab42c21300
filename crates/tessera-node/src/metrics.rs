//! The node's metrics in the Prometheus text exposition format (version 0.0.4), and its
//! readiness. Names, labels and units: docs/metrics.md.
//!
//! Everything here is read when a scrape asks for it: the datapath only keeps its
//! per-connection, per-handle and per-core counters (plain stores by their own core),
//! which [`render`] sums. Nothing secret is exposed: names of pools, volumes, devices
//! (their specs as configured) and groups, and figures.

use std::fmt::Write as _;

use tessera_api::{PoolEntry, PoolInfo};
use tessera_io::hist::Histogram;
use tessera_io::sync::MutexExt;
use tessera_io::CoreTime;
use tessera_pool::pattern::{Direction, Pattern, PatternCounts};
use tessera_pool::{DeviceTotals, StatsSnapshot};

use crate::Node;

/// Latency histogram bounds: powers of two nanoseconds from 2^10 (1.024 µs) to 2^34
/// (~17.2 s), then +Inf.
const LATENCY_POW2: std::ops::RangeInclusive<u32> = 10..=34;

/// Numeric codes of the state gauges (docs/metrics.md).
pub fn pool_state_code(state: &str) -> u8 {
    match state {
        "online" => 0,
        "degraded" => 1,
        "rebuilding" => 2,
        "failed" => 3,
        _ => 4, // offline: listed in the registry, not open
    }
}

pub fn device_state_code(state: &str) -> u8 {
    match state {
        "online" => 0,
        "rebuilding" => 1,
        _ => 2, // failed
    }
}

pub fn job_state_code(state: &str) -> u8 {
    match state {
        "done" => 0,
        "running" => 1,
        "stopped" => 2,
        _ => 3, // failed
    }
}

/// A Prometheus text document being written: each family's HELP and TYPE once, then its
/// samples, which must follow their family without another family in between.
pub struct TextWriter {
    out: String,
}

/// Label names and values of one sample.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

impl Default for TextWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl TextWriter {
    pub fn new() -> TextWriter {
        TextWriter {
            out: String::with_capacity(64 * 1024),
        }
    }

    /// Start a family: `kind` is "counter", "gauge" or "histogram".
    pub fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = write!(self.out, "# HELP {name} ");
        escape_into(&mut self.out, help, false);
        let _ = writeln!(self.out, "\n# TYPE {name} {kind}");
    }

    /// One sample of the current family.
    pub fn sample(&mut self, name: &str, labels: Labels, value: impl std::fmt::Display) {
        self.out.push_str(name);
        write_labels(&mut self.out, labels, None);
        let _ = writeln!(self.out, " {value}");
    }

    /// The series of a latency histogram in seconds (`h` holds nanoseconds).
    pub fn histogram_seconds(&mut self, name: &str, labels: Labels, h: &Histogram) {
        for k in LATENCY_POW2 {
            let le = format!("{}", (1u64 << k) as f64 / 1e9);
            let _ = write!(self.out, "{name}_bucket");
            write_labels(&mut self.out, labels, Some(&le));
            let _ = writeln!(self.out, " {}", h.count_below_pow2(k));
        }
        let _ = write!(self.out, "{name}_bucket");
        write_labels(&mut self.out, labels, Some("+Inf"));
        let _ = writeln!(self.out, " {}", h.count());
        self.sample(&format!("{name}_sum"), labels, seconds(h.sum() as f64));
        self.sample(&format!("{name}_count"), labels, h.count());
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn write_labels(out: &mut String, labels: Labels, le: Option<&str>) {
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (k, v) in labels.iter().copied().chain(le.map(|le| ("le", le))) {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(k);
        out.push_str("=\"");
        escape_into(out, v, true);
        out.push('"');
    }
    out.push('}');
}

/// The format's escapes: backslash and line feed everywhere, double quote in label
/// values.
fn escape_into(out: &mut String, s: &str, quote: bool) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

fn seconds(ns: f64) -> f64 {
    ns / 1e9
}

/// A sample's value as the text format prints it: counts and codes as integers, seconds
/// and other measures as floats, a latency histogram as its series.
enum Value<'a> {
    Count(u64),
    Float(f64),
    Histogram(&'a Histogram),
}

fn count(n: u64) -> Value<'static> {
    Value::Count(n)
}

/// A duration in nanoseconds, in seconds.
fn secs_of(ns: u64) -> Value<'static> {
    Value::Float(seconds(ns as f64))
}

/// One sample of a row: the label that tells a row's samples of one family apart
/// (`op`, `state`), if the family has one, and the value.
type Sample<'a> = (Option<(&'static str, &'a str)>, Value<'a>);

/// One metric family over rows of `R` (volumes, pools, devices...): each row gives its
/// samples, labelled with the row's labels and the sample's own.
struct Family<R> {
    name: &'static str,
    /// "counter", "gauge" or "histogram".
    kind: &'static str,
    help: &'static str,
    samples: for<'a> fn(&'a R) -> Vec<Sample<'a>>,
}

/// A family with one sample per row.
fn single(value: Value<'_>) -> Vec<Sample<'_>> {
    vec![(None, value)]
}

/// A family with a sample per operation, labelled `op`.
fn per_op<const N: usize>(ops: [(&'static str, u64); N]) -> Vec<Sample<'static>> {
    ops.into_iter()
        .map(|(op, n)| (Some(("op", op)), count(n)))
        .collect()
}

/// Every family of `families`, each with the samples of every row in `rows`, labelled by
/// `labels` (the row's labels) and the sample's own label.
fn write_families<R>(
    w: &mut TextWriter,
    families: &[Family<R>],
    rows: &[R],
    labels: impl for<'a> Fn(&'a R) -> Vec<(&'static str, &'a str)>,
) {
    for f in families {
        w.family(f.name, f.kind, f.help);
        for row in rows {
            let mut l = labels(row);
            let base = l.len();
            for (own, value) in (f.samples)(row) {
                l.truncate(base);
                l.extend(own);
                match value {
                    Value::Count(n) => w.sample(f.name, &l, n),
                    Value::Float(x) => w.sample(f.name, &l, x),
                    Value::Histogram(h) => w.histogram_seconds(f.name, &l, h),
                }
            }
        }
    }
}

/// One volume's figures, with the names that label them.
struct VolumeFigures {
    pool: String,
    volume: String,
    size: u64,
    allocated: u64,
    stats: StatsSnapshot,
    patterns: PatternCounts,
    /// Reads served from readahead buffers (pools without a cache tier), and their bytes.
    readahead: (u64, u64),
}

/// One sample per access pattern (`tessera_pool::pattern`), labelled `pattern`.
fn per_pattern(counts: &PatternCounts, d: Direction, bytes: bool) -> Vec<Sample<'static>> {
    Pattern::ALL
        .into_iter()
        .map(|p| {
            let n = if bytes {
                counts.bytes_of(d, p)
            } else {
                counts.requests_of(d, p)
            };
            (Some(("pattern", p.name())), count(n))
        })
        .collect()
}

/// The client operation counts by their `op` label.
fn ops_of(s: &StatsSnapshot) -> [(&'static str, u64); 6] {
    [
        ("read", s.reads),
        ("write", s.writes),
        ("flush", s.flushes),
        ("discard", s.discards),
        ("write_zeroes", s.write_zeroes),
        (
            "other",
            s.others
                .saturating_sub(s.flushes + s.discards + s.write_zeroes),
        ),
    ]
}

fn device_ops_of(t: &DeviceTotals) -> [(&'static str, u64); 5] {
    [
        ("read", t.reads),
        ("write", t.writes),
        ("flush", t.flushes),
        ("discard", t.discards),
        ("write_zeroes", t.write_zeroes),
    ]
}

/// Every metric of the node, as the text `/metrics` answers.
pub fn render(node: &Node) -> String {
    let mut w = TextWriter::new();
    w.family(
        "tessera_build_info",
        "gauge",
        "The running version (always 1).",
    );
    w.sample(
        "tessera_build_info",
        &[("version", env!("CARGO_PKG_VERSION"))],
        1,
    );
    w.family(
        "tessera_uptime_seconds",
        "gauge",
        "Seconds since the node started.",
    );
    w.sample(
        "tessera_uptime_seconds",
        &[],
        node.started.elapsed().as_secs_f64(),
    );

    let pools = node.pools().list();
    let volumes: Vec<VolumeFigures> = pools
        .iter()
        .flat_map(|p| {
            p.volumes().into_iter().map(|v| VolumeFigures {
                pool: p.name().to_string(),
                volume: v.name.clone(),
                size: v.size(),
                allocated: v.allocated_bytes(),
                stats: v.stats(),
                patterns: v.pattern_counts(),
                readahead: v.readahead_served(),
            })
        })
        .collect();
    render_volumes(&mut w, &volumes);
    render_pools(&mut w, node, &volumes);
    render_devices(&mut w, node);
    render_jobs(&mut w, node);
    render_groups(&mut w, node, &volumes);
    render_replicas(&mut w, node);
    render_proxies(&mut w, node);
    render_reactors(&mut w, node);
    render_client_limits(&mut w, node);
    render_iscsi(&mut w, node);
    w.finish()
}

/// iSCSI targets: their LUNs (to join `tessera_volume_*` by volume), sessions and
/// logins, and the logins refused by reason.
fn render_iscsi(w: &mut TextWriter, node: &Node) {
    let live = node.iscsi.target();
    let records = node.iscsi.file().targets.clone();
    w.family(
        "tessera_iscsi_lun",
        "gauge",
        "An iSCSI target's LUN and the volume it serves (always 1).",
    );
    for t in &records {
        for l in &t.luns {
            let lun = l.lun.to_string();
            w.sample(
                "tessera_iscsi_lun",
                &[
                    ("target", t.iqn.as_str()),
                    ("lun", lun.as_str()),
                    ("volume", l.volume.as_str()),
                ],
                1,
            );
        }
    }
    // The cluster volumes' targets (ALUA, in memory; their LUN 0 is the volume).
    let cluster: Vec<(String, String, u8)> = node
        .iscsi
        .cluster
        .locked()
        .iter()
        .map(|(v, a)| (crate::iscsi::cluster_iqn(v), v.clone(), a.state()))
        .collect();
    for (iqn, volume, _) in &cluster {
        w.sample(
            "tessera_iscsi_lun",
            &[
                ("target", iqn.as_str()),
                ("lun", "0"),
                ("volume", volume.as_str()),
            ],
            1,
        );
    }
    let served: Vec<_> = records
        .iter()
        .map(|t| t.iqn.as_str())
        .chain(cluster.iter().map(|(iqn, ..)| iqn.as_str()))
        .filter_map(|iqn| live.target(iqn))
        .collect();
    w.family(
        "tessera_iscsi_sessions",
        "gauge",
        "Normal iSCSI sessions logged in to the target now.",
    );
    for t in &served {
        w.sample(
            "tessera_iscsi_sessions",
            &[("target", t.name.as_str())],
            t.sessions(),
        );
    }
    w.family(
        "tessera_iscsi_logins_total",
        "counter",
        "iSCSI logins to the target that reached full feature phase.",
    );
    for t in &served {
        w.sample(
            "tessera_iscsi_logins_total",
            &[("target", t.name.as_str())],
            t.logins(),
        );
    }
    w.family(
        "tessera_iscsi_alua_state",
        "gauge",
        "A cluster volume's iSCSI target port group on this node: its asymmetric access state (0 active/optimized, 2 standby).",
    );
    for (iqn, _, state) in &cluster {
        w.sample(
            "tessera_iscsi_alua_state",
            &[("target", iqn.as_str())],
            u64::from(*state),
        );
    }
    w.family(
        "tessera_iscsi_login_refusals_total",
        "counter",
        "iSCSI logins refused: authentication (CHAP), authorization (allowlist), not_found (no such target), other (malformed or out of order).",
    );
    for (reason, n) in live.refusals.figures() {
        w.sample(
            "tessera_iscsi_login_refusals_total",
            &[("reason", reason)],
            n,
        );
    }
}

/// The client buffer budget (`[client_buffers]`) and each listener's connection cap.
fn render_client_limits(w: &mut TextWriter, node: &Node) {
    let b = node.exports().buffers();
    w.family(
        "tessera_client_buffer_bytes",
        "gauge",
        "Bytes of client request data buffers (READ replies, WRITE payloads) held now, NBD and NVMe/TCP together, from request to the reply's last byte leaving.",
    );
    w.sample("tessera_client_buffer_bytes", &[], b.held());
    w.family(
        "tessera_client_buffer_limit_bytes",
        "gauge",
        "The client buffer budget ([client_buffers]): per connection, and for the node (which each connection may pass by one request).",
    );
    w.sample(
        "tessera_client_buffer_limit_bytes",
        &[("scope", "connection")],
        b.conn_limit(),
    );
    w.sample(
        "tessera_client_buffer_limit_bytes",
        &[("scope", "node")],
        b.node_limit(),
    );
    w.family(
        "tessera_client_buffer_stalls_total",
        "counter",
        "Times a connection's next request did not fit the client buffer budget: it waited (NBD: its socket was not read) until its replies left.",
    );
    w.sample("tessera_client_buffer_stalls_total", &[], b.stalls());
    let caps = node.exports().listener_caps();
    fn labels(c: &tessera_export::budget::ListenerCap) -> [(&'static str, &str); 2] {
        [("protocol", c.protocol), ("listener", c.address.as_str())]
    }
    w.family(
        "tessera_listener_connections",
        "gauge",
        "Connections a listener serves now (NBD handshakes included; an NVMe/TCP queue is one connection).",
    );
    for c in &caps {
        w.sample("tessera_listener_connections", &labels(c), c.open());
    }
    w.family(
        "tessera_listener_max_connections",
        "gauge",
        "The listener's connection cap ([nbd]/[nvmf] max_connections).",
    );
    for c in &caps {
        w.sample("tessera_listener_max_connections", &labels(c), c.max());
    }
    w.family(
        "tessera_listener_refused_connections_total",
        "counter",
        "Connections closed right after accept because the listener served its maximum.",
    );
    for c in &caps {
        w.sample(
            "tessera_listener_refused_connections_total",
            &labels(c),
            c.refused(),
        );
    }
}

/// Client I/O this node proxied to other nodes' volumes (NBD clients that asked this
/// node for a cluster volume it does not own), by volume, since the node started.
const PROXY_FAMILIES: &[Family<crate::node::proxy::ProxyFigures>] = &[
    Family {
        name: "tessera_proxy_open",
        kind: "gauge",
        help: "1 while this node has a proxy to the volume's owner open (an NBD client uses it), else 0.",
        samples: |p| single(count(u64::from(p.owner.is_some()))),
    },
    Family {
        name: "tessera_proxy_ops_total",
        kind: "counter",
        help: "Client requests this node answered through its proxy to the volume's owner, by operation.",
        samples: |p| per_op(ops_of(&p.stats)),
    },
    Family {
        name: "tessera_proxy_bytes_total",
        kind: "counter",
        help: "Bytes clients read and wrote through this node's proxy to the volume's owner.",
        samples: |p| per_op([("read", p.stats.read_bytes), ("write", p.stats.write_bytes)]),
    },
    Family {
        name: "tessera_proxy_errors_total",
        kind: "counter",
        help: "Client requests through the proxy answered with an error (owner unreachable past the timeout, refused I/O).",
        samples: |p| single(count(p.stats.errors)),
    },
    Family {
        name: "tessera_proxy_latency_seconds",
        kind: "histogram",
        help: "Client request latency through the proxy (both hops), from receipt to the reply being queued, by operation.",
        samples: |p| {
            vec![
                (Some(("op", "read")), Value::Histogram(&p.stats.read_latency)),
                (Some(("op", "write")), Value::Histogram(&p.stats.write_latency)),
            ]
        },
    },
];

fn render_proxies(w: &mut TextWriter, node: &Node) {
    let rows = node.proxy_figures();
    write_families(w, PROXY_FAMILIES, &rows, |p| {
        vec![("volume", p.volume.as_str())]
    });
}

/// One replica of a replicated volume this node owns.
struct ReplicaRow {
    volume: String,
    place: String,
    state: &'static str,
    dirty: u64,
    copied: u64,
    recopied: u64,
}

/// 0 in sync, 1 degraded, 2 resyncing, 3 failed.
fn replica_state_code(state: &str) -> u64 {
    match state {
        "in_sync" => 0,
        "degraded" => 1,
        "resyncing" => 2,
        _ => 3,
    }
}

const REPLICA_FAMILIES: &[Family<ReplicaRow>] = &[
    Family {
        name: "tessera_replica_state",
        kind: "gauge",
        help: "Each replica of a replicated volume this node owns: 0 in sync, 1 degraded (lacks writes), 2 resyncing, 3 failed (degraded and unreachable); the state label names it.",
        samples: |r| {
            vec![(
                Some(("state", r.state)),
                count(replica_state_code(r.state)),
            )]
        },
    },
    Family {
        name: "tessera_replica_dirty_bytes",
        kind: "gauge",
        help: "Bytes the replica lacks (whole dirty regions); 0 when in sync.",
        samples: |r| single(count(r.dirty)),
    },
    Family {
        name: "tessera_replica_resync_copied_bytes_total",
        kind: "counter",
        help: "Bytes of regions resyncs brought in sync on this replica since the node started.",
        samples: |r| single(count(r.copied)),
    },
    Family {
        name: "tessera_replica_resync_recopied_bytes_total",
        kind: "counter",
        help: "Bytes resyncs copied again because clients wrote the region during its copy.",
        samples: |r| single(count(r.recopied)),
    },
];

fn render_replicas(w: &mut TextWriter, node: &Node) {
    let rows: Vec<ReplicaRow> = node
        .replicas()
        .statuses()
        .into_iter()
        .flat_map(|(volume, legs)| {
            legs.into_iter().map(move |l| ReplicaRow {
                volume: volume.clone(),
                place: l.place,
                state: l.state.as_str(),
                dirty: l.dirty_bytes,
                copied: l.resync_copied_bytes_total,
                recopied: l.resync_recopied_bytes_total,
            })
        })
        .collect();
    write_families(w, REPLICA_FAMILIES, &rows, |r| {
        vec![("volume", r.volume.as_str()), ("replica", r.place.as_str())]
    });
}

const VOLUME_FAMILIES: &[Family<VolumeFigures>] = &[
    Family {
        name: "tessera_volume_ops_total",
        kind: "counter",
        help: "Client requests answered, by operation (NBD and NVMe/TCP).",
        samples: |v| per_op(ops_of(&v.stats)),
    },
    Family {
        name: "tessera_volume_bytes_total",
        kind: "counter",
        help: "Bytes clients read and wrote.",
        samples: |v| per_op([("read", v.stats.read_bytes), ("write", v.stats.write_bytes)]),
    },
    Family {
        name: "tessera_volume_errors_total",
        kind: "counter",
        help: "Client requests answered with an error.",
        samples: |v| single(count(v.stats.errors)),
    },
    Family {
        name: "tessera_volume_throttled_seconds_total",
        kind: "counter",
        help: "Time client requests were held back by QoS limits (the volume's and its group's), summed over requests.",
        samples: |v| single(secs_of(v.stats.throttled_ns)),
    },
    Family {
        name: "tessera_volume_latency_seconds",
        kind: "histogram",
        help: "Client request latency, from receipt to the reply being queued, by operation.",
        samples: |v| {
            vec![
                (Some(("op", "read")), Value::Histogram(&v.stats.read_latency)),
                (Some(("op", "write")), Value::Histogram(&v.stats.write_latency)),
            ]
        },
    },
    Family {
        name: "tessera_volume_read_pattern_requests_total",
        kind: "counter",
        help: "Reads by the access pattern of their 1 GiB region as the core that served them saw it then (sequential, monotonic, random; unknown while a region has too little history).",
        samples: |v| per_pattern(&v.patterns, Direction::Read, false),
    },
    Family {
        name: "tessera_volume_read_pattern_bytes_total",
        kind: "counter",
        help: "Bytes read, by the access pattern of their region.",
        samples: |v| per_pattern(&v.patterns, Direction::Read, true),
    },
    Family {
        name: "tessera_volume_write_pattern_requests_total",
        kind: "counter",
        help: "Writes by the access pattern of their 1 GiB region (sequential, monotonic, random, unknown).",
        samples: |v| per_pattern(&v.patterns, Direction::Write, false),
    },
    Family {
        name: "tessera_volume_write_pattern_bytes_total",
        kind: "counter",
        help: "Bytes written, by the access pattern of their region.",
        samples: |v| per_pattern(&v.patterns, Direction::Write, true),
    },
    Family {
        name: "tessera_volume_readahead_reads_total",
        kind: "counter",
        help: "Reads served whole from readahead buffers (a sequential reader of a pool without a cache tier; node config `readahead`).",
        samples: |v| single(count(v.readahead.0)),
    },
    Family {
        name: "tessera_volume_readahead_bytes_total",
        kind: "counter",
        help: "Bytes of reads served from readahead buffers.",
        samples: |v| single(count(v.readahead.1)),
    },
    Family {
        name: "tessera_volume_size_bytes",
        kind: "gauge",
        help: "Virtual size of the volume.",
        samples: |v| single(count(v.size)),
    },
    Family {
        name: "tessera_volume_allocated_bytes",
        kind: "gauge",
        help: "Pool space the volume holds.",
        samples: |v| single(count(v.allocated)),
    },
];

fn render_volumes(w: &mut TextWriter, vols: &[VolumeFigures]) {
    write_families(w, VOLUME_FAMILIES, vols, |v| {
        vec![("pool", v.pool.as_str()), ("volume", v.volume.as_str())]
    });
}

/// A pool of the registry, with its volumes' client figures summed (open pools only).
struct PoolRow {
    entry: PoolEntry,
    totals: StatsSnapshot,
    /// Its cache tier, if it has one.
    cache: Option<tessera_api::CacheInfo>,
}

/// Samples of a pool's cache tier, labelled `kind`; none without a cache.
fn cache_kinds<const N: usize>(
    p: &PoolRow,
    f: fn(&tessera_api::CacheInfo) -> [(&'static str, u64); N],
) -> Vec<Sample<'static>> {
    p.cache.as_ref().map_or(vec![], |c| {
        f(c).into_iter()
            .map(|(k, n)| (Some(("kind", k)), count(n)))
            .collect()
    })
}

impl PoolRow {
    /// The figures of an open pool; `None` for one that could not be opened, which has
    /// only a state.
    fn online(&self) -> Option<(&PoolInfo, &StatsSnapshot)> {
        match &self.entry {
            PoolEntry::Online(p) => Some((&**p, &self.totals)),
            PoolEntry::Offline(_) => None,
        }
    }
}

const POOL_FAMILIES: &[Family<PoolRow>] = &[
    Family {
        name: "tessera_pool_state",
        kind: "gauge",
        help: "Pool state: 0 online, 1 degraded, 2 rebuilding, 3 failed (data lost), 4 offline (not open); the state label names it.",
        samples: |p| {
            let state = p.entry.state().as_str();
            vec![(Some(("state", state)), count(pool_state_code(state).into()))]
        },
    },
    Family {
        name: "tessera_pool_ops_total",
        kind: "counter",
        help: "Client requests answered by the pool's volumes, by operation (volumes deleted since the node started are not counted).",
        samples: |p| p.online().map_or(vec![], |(_, t)| per_op(ops_of(t))),
    },
    Family {
        name: "tessera_pool_bytes_total",
        kind: "counter",
        help: "Bytes clients read from and wrote to the pool's volumes.",
        samples: |p| {
            p.online().map_or(vec![], |(_, t)| {
                per_op([("read", t.read_bytes), ("write", t.write_bytes)])
            })
        },
    },
    Family {
        name: "tessera_pool_errors_total",
        kind: "counter",
        help: "Client requests to the pool's volumes answered with an error.",
        samples: |p| p.online().map_or(vec![], |(_, t)| single(count(t.errors))),
    },
    Family {
        name: "tessera_pool_capacity_bytes",
        kind: "gauge",
        help: "Bytes available to volumes (metadata excluded).",
        samples: |p| p.online().map_or(vec![], |(i, _)| single(count(i.capacity))),
    },
    Family {
        name: "tessera_pool_allocated_bytes",
        kind: "gauge",
        help: "Bytes of the pool held by volumes.",
        samples: |p| p.online().map_or(vec![], |(i, _)| single(count(i.allocated))),
    },
    Family {
        name: "tessera_pool_cache_requests_total",
        kind: "counter",
        help: "Request pieces (one per 1 MiB cache unit touched) the pool's cache tier saw: read_hit, read_miss, write_hit (to a cached unit), write_miss.",
        samples: |p| {
            cache_kinds(p, |c| {
                [
                    ("read_hit", c.read_hits),
                    ("read_miss", c.read_misses),
                    ("write_hit", c.write_hits),
                    ("write_miss", c.write_misses),
                ]
            })
        },
    },
    Family {
        name: "tessera_pool_cache_bytes_total",
        kind: "counter",
        help: "Bytes through the cache tier: read_hit (served by the cache), read_miss (by the pool's devices), fill (written into the cache after a miss), bypassed (sequential I/O kept out of it), prefetch (read ahead of sequential readers into it), cleaned (write-back data copied to the pool's devices).",
        samples: |p| {
            cache_kinds(p, |c| {
                [
                    ("read_hit", c.read_hit_bytes),
                    ("read_miss", c.read_miss_bytes),
                    ("fill", c.fill_bytes),
                    ("bypassed", c.bypassed_bytes),
                    ("prefetch", c.prefetch_bytes),
                    ("cleaned", c.cleaned_bytes),
                ]
            })
        },
    },
    Family {
        name: "tessera_pool_cache_units_total",
        kind: "counter",
        help: "Cache units that got a slot (promotion) and that lost it to another (eviction).",
        samples: |p| cache_kinds(p, |c| [("promotion", c.promotions), ("eviction", c.evictions)]),
    },
    Family {
        name: "tessera_pool_cache_bytes",
        kind: "gauge",
        help: "The cache tier's capacity, bytes holding valid data, and dirty bytes (write-back data not yet on the pool's devices).",
        samples: |p| {
            cache_kinds(p, |c| {
                [
                    ("capacity", c.capacity),
                    ("valid", c.valid_bytes),
                    ("dirty", c.dirty_bytes),
                ]
            })
        },
    },
    Family {
        name: "tessera_pool_cache_errors_total",
        kind: "counter",
        help: "I/O errors of the cache devices that the tier could not hide (the first one makes it go uncached).",
        samples: |p| p.cache.as_ref().map_or(vec![], |c| single(count(c.errors))),
    },
];

fn render_pools(w: &mut TextWriter, node: &Node, vols: &[VolumeFigures]) {
    let entries = node.list_pools();
    let totals = |pool: &str| {
        let mut t = StatsSnapshot::default();
        for v in vols.iter().filter(|v| v.pool == pool) {
            let s = &v.stats;
            t.reads += s.reads;
            t.writes += s.writes;
            t.others += s.others;
            t.flushes += s.flushes;
            t.discards += s.discards;
            t.write_zeroes += s.write_zeroes;
            t.read_bytes += s.read_bytes;
            t.write_bytes += s.write_bytes;
            t.errors += s.errors;
        }
        t
    };
    let rows: Vec<PoolRow> = entries
        .into_iter()
        .map(|entry| PoolRow {
            totals: match &entry {
                PoolEntry::Online(p) => totals(&p.name),
                PoolEntry::Offline(_) => StatsSnapshot::default(),
            },
            cache: match &entry {
                PoolEntry::Online(p) => node.pool_cache(&p.name).ok(),
                PoolEntry::Offline(_) => None,
            },
            entry,
        })
        .collect();
    write_families(w, POOL_FAMILIES, &rows, |p| vec![("pool", p.entry.name())]);
}

/// A device slot of a pool.
struct DeviceRow {
    pool: String,
    slot: String,
    device: String,
    state: &'static str,
    totals: DeviceTotals,
}

const DEVICE_FAMILIES: &[Family<DeviceRow>] = &[
    Family {
        name: "tessera_device_state",
        kind: "gauge",
        help: "Device state: 0 online, 1 rebuilding, 2 failed; the state label names it.",
        samples: |d| {
            vec![(
                Some(("state", d.state)),
                count(device_state_code(d.state).into()),
            )]
        },
    },
    Family {
        name: "tessera_device_ops_total",
        kind: "counter",
        help: "Operations the pool's datapath submitted to the device (metadata commits and other control-plane I/O not included).",
        samples: |d| per_op(device_ops_of(&d.totals)),
    },
    Family {
        name: "tessera_device_bytes_total",
        kind: "counter",
        help: "Bytes the pool's datapath read from and wrote to the device.",
        samples: |d| per_op([("read", d.totals.read_bytes), ("write", d.totals.write_bytes)]),
    },
    Family {
        name: "tessera_device_errors_total",
        kind: "counter",
        help: "I/O errors the pool saw from the device (redundant layouts; concat and raid0 pass errors to the volume).",
        samples: |d| single(count(d.totals.errors)),
    },
];

fn render_devices(w: &mut TextWriter, node: &Node) {
    let mut devs = Vec::new();
    for p in node.pools().list() {
        let info = node.pool_info(&p);
        let stats = &p.core.layout.device_stats;
        for (i, st) in info.device_states.iter().enumerate() {
            devs.push(DeviceRow {
                pool: info.name.clone(),
                slot: i.to_string(),
                device: st.device.clone(),
                state: st.state.as_str(),
                totals: stats.get(i).map(|s| s.totals()).unwrap_or_default(),
            });
        }
    }
    write_families(w, DEVICE_FAMILIES, &devs, |d| {
        vec![
            ("pool", d.pool.as_str()),
            ("slot", d.slot.as_str()),
            ("device", d.device.as_str()),
        ]
    });
}

/// The running or last job of one kind of a pool.
struct JobRow {
    pool: String,
    job: &'static str,
    state: &'static str,
    done: u64,
    total: u64,
}

const JOB_FAMILIES: &[Family<JobRow>] = &[
    Family {
        name: "tessera_job_state",
        kind: "gauge",
        help: "The running or last scrub, resync or rebuild of a pool since the node started: 0 done, 1 running, 2 stopped, 3 failed; the state label names it.",
        samples: |j| {
            vec![(
                Some(("state", j.state)),
                count(job_state_code(j.state).into()),
            )]
        },
    },
    Family {
        name: "tessera_job_done_bytes",
        kind: "gauge",
        help: "Bytes the job has processed.",
        samples: |j| single(count(j.done)),
    },
    Family {
        name: "tessera_job_total_bytes",
        kind: "gauge",
        help: "Bytes the job has to process (its units times the pool's unit size).",
        samples: |j| single(count(j.total)),
    },
];

fn render_jobs(w: &mut TextWriter, node: &Node) {
    let mut jobs = Vec::new();
    for p in node.pools().list() {
        let name = p.name().to_string();
        let unit = p.core.unit_size();
        let mut push = |job, state: tessera_api::JobState, pr: &tessera_api::JobProgress| {
            jobs.push(JobRow {
                pool: name.clone(),
                job,
                state: state.as_str(),
                done: pr.bytes_done,
                total: pr.units_total.saturating_mul(unit),
            })
        };
        if let Ok(s) = node.jobs().scrub_status(&p) {
            push("scrub", s.state, &s.progress);
        }
        if let Ok(s) = node.jobs().resync_status(&p) {
            push("resync", s.state, &s.progress);
        }
        if let Ok(s) = node.jobs().rebuild_status(&p) {
            push("rebuild", s.state, &s.progress);
        }
    }
    write_families(w, JOB_FAMILIES, &jobs, |j| {
        vec![("pool", j.pool.as_str()), ("job", j.job)]
    });
}

/// A QoS group and the time its members' requests were held back.
struct GroupRow {
    name: String,
    throttled_ns: u64,
}

const GROUP_FAMILIES: &[Family<GroupRow>] = &[Family {
    name: "tessera_group_throttled_seconds_total",
    kind: "counter",
    help: "Time requests to the group's member volumes were held back by QoS limits, summed over requests.",
    samples: |g| single(secs_of(g.throttled_ns)),
}];

fn render_groups(w: &mut TextWriter, node: &Node, vols: &[VolumeFigures]) {
    let groups: Vec<GroupRow> = node
        .groups
        .list()
        .into_iter()
        .map(|g| GroupRow {
            throttled_ns: vols
                .iter()
                .filter(|v| g.members.contains(&v.volume))
                .map(|v| v.stats.throttled_ns)
                .sum(),
            name: g.name,
        })
        .collect();
    write_families(w, GROUP_FAMILIES, &groups, |g| {
        vec![("group", g.name.as_str())]
    });
}

/// A reactor core's time by state.
struct ReactorRow {
    core: String,
    load: CoreTime,
}

const REACTOR_FAMILIES: &[Family<ReactorRow>] = &[Family {
    name: "tessera_reactor_seconds_total",
    kind: "counter",
    help: "Time of each reactor core since it started: busy (running requests and the loop), poll (spinning on the ring for completions before sleeping), sleep (waiting in the kernel).",
    samples: |r| {
        [
            ("busy", r.load.busy_ns()),
            ("poll", r.load.poll_ns),
            ("sleep", r.load.sleep_ns),
        ]
        .into_iter()
        .map(|(state, ns)| (Some(("state", state)), secs_of(ns)))
        .collect()
    },
}];

fn render_reactors(w: &mut TextWriter, node: &Node) {
    let cores: Vec<ReactorRow> = node
        .reactors
        .iter()
        .map(|m| ReactorRow {
            core: m.core.to_string(),
            load: m.load.read(),
        })
        .collect();
    write_families(w, REACTOR_FAMILIES, &cores, |r| {
        vec![("core", r.core.as_str())]
    });
    w.family(
        "tessera_reactor_hooks",
        "gauge",
        "Continuation hooks registered on the reactor cores (connections' and handles' per-core state); flat while connections come and go.",
    );
    w.sample("tessera_reactor_hooks", &[], tessera_io::live_hooks());
}

/// Whether the node should get traffic: its pools open and none lost, its exports
/// listening. `serving`: the listeners are up (the node has finished starting and is not
/// stopping). The reply is `(ready, JSON body)`.
pub fn readiness(node: Option<&Node>, serving: bool) -> (bool, serde_json::Value) {
    let Some(node) = node.filter(|_| serving) else {
        let reason = if node.is_some() {
            "the node is starting or stopping: its exports are not listening"
        } else {
            "the node is starting: its pools are not open yet"
        };
        return (
            false,
            serde_json::json!({"ready": false, "reasons": [reason]}),
        );
    };
    let mut reasons = Vec::new();
    let mut degraded = Vec::new();
    for e in node.list_pools() {
        match e {
            PoolEntry::Offline(p) => {
                reasons.push(format!("pool '{}' is offline: {}", p.name, p.error))
            }
            PoolEntry::Online(p) if p.state == tessera_api::PoolState::Failed => {
                reasons.push(format!(
                    "pool '{}' has failed: every copy of some of its data is on failed devices",
                    p.name
                ))
            }
            PoolEntry::Online(p) if p.is_degraded() => degraded.push(p.name.clone()),
            PoolEntry::Online(_) => {}
        }
    }
    let ready = reasons.is_empty();
    (
        ready,
        serde_json::json!({"ready": ready, "reasons": reasons, "degraded_pools": degraded}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_format_has_help_type_and_escaped_labels() {
        let mut w = TextWriter::new();
        w.family("t_ops_total", "counter", "Ops with a \\ and a\nnewline.");
        w.sample(
            "t_ops_total",
            &[("volume", "a\"b\\c\nd"), ("op", "read")],
            7,
        );
        w.sample("t_ops_total", &[], 1.5);
        let mut h = Histogram::default();
        h.record(1000); // below 2^10 ns
        h.record(3000); // below 2^12 ns
        w.family("t_latency_seconds", "histogram", "Latency.");
        w.histogram_seconds("t_latency_seconds", &[("op", "write")], &h);
        let text = w.finish();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "# HELP t_ops_total Ops with a \\\\ and a\\nnewline."
        );
        assert_eq!(lines[1], "# TYPE t_ops_total counter");
        assert_eq!(
            lines[2],
            "t_ops_total{volume=\"a\\\"b\\\\c\\nd\",op=\"read\"} 7"
        );
        assert_eq!(lines[3], "t_ops_total 1.5");
        assert_eq!(lines[4], "# HELP t_latency_seconds Latency.");
        assert_eq!(lines[5], "# TYPE t_latency_seconds histogram");
        assert_eq!(
            lines[6],
            "t_latency_seconds_bucket{op=\"write\",le=\"0.000001024\"} 1"
        );
        assert_eq!(
            lines[7],
            "t_latency_seconds_bucket{op=\"write\",le=\"0.000002048\"} 1"
        );
        assert_eq!(
            lines[8],
            "t_latency_seconds_bucket{op=\"write\",le=\"0.000004096\"} 2"
        );
        let n = LATENCY_POW2.count();
        assert_eq!(
            lines[6 + n],
            "t_latency_seconds_bucket{op=\"write\",le=\"+Inf\"} 2"
        );
        assert_eq!(lines[7 + n], "t_latency_seconds_sum{op=\"write\"} 0.000004");
        assert_eq!(lines[8 + n], "t_latency_seconds_count{op=\"write\"} 2");
        assert_eq!(lines.len(), 9 + n);
        // Every bucket line is cumulative (non-decreasing).
        let counts: Vec<u64> = lines[6..7 + n]
            .iter()
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    }

    #[test]
    fn not_ready_while_starting() {
        let (ready, body) = readiness(None, false);
        assert!(!ready);
        assert_eq!(body["ready"], false);
        assert!(body["reasons"][0].as_str().unwrap().contains("starting"));
    }

    #[test]
    fn state_codes_are_distinct() {
        let pools: Vec<u8> = ["online", "degraded", "rebuilding", "failed", "offline"]
            .iter()
            .map(|s| pool_state_code(s))
            .collect();
        assert_eq!(pools, [0, 1, 2, 3, 4]);
        assert_eq!(device_state_code("failed"), 2);
        assert_eq!(job_state_code("running"), 1);
    }
}
