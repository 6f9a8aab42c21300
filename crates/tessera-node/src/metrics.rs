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

/// One volume's figures, with the names that label them.
struct VolumeFigures {
    pool: String,
    volume: String,
    size: u64,
    allocated: u64,
    stats: StatsSnapshot,
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

    let pools = node.pools();
    let volumes: Vec<VolumeFigures> = pools
        .iter()
        .flat_map(|p| {
            p.volumes().into_iter().map(|v| VolumeFigures {
                pool: p.name().to_string(),
                volume: v.name.clone(),
                size: v.size(),
                allocated: v.allocated_bytes(),
                stats: v.stats(),
            })
        })
        .collect();
    render_volumes(&mut w, &volumes);
    render_pools(&mut w, node, &volumes);
    render_devices(&mut w, node);
    render_jobs(&mut w, node);
    render_groups(&mut w, node, &volumes);
    render_reactors(&mut w, node);
    w.finish()
}

fn render_volumes(w: &mut TextWriter, vols: &[VolumeFigures]) {
    let labels = |v: &VolumeFigures| [("pool", v.pool.clone()), ("volume", v.volume.clone())];
    w.family(
        "tessera_volume_ops_total",
        "counter",
        "Client requests answered, by operation (NBD and NVMe/TCP).",
    );
    for v in vols {
        let [p, n] = labels(v);
        for (op, c) in ops_of(&v.stats) {
            w.sample(
                "tessera_volume_ops_total",
                &[(p.0, &p.1), (n.0, &n.1), ("op", op)],
                c,
            );
        }
    }
    w.family(
        "tessera_volume_bytes_total",
        "counter",
        "Bytes clients read and wrote.",
    );
    for v in vols {
        let [p, n] = labels(v);
        for (op, b) in [("read", v.stats.read_bytes), ("write", v.stats.write_bytes)] {
            w.sample(
                "tessera_volume_bytes_total",
                &[(p.0, &p.1), (n.0, &n.1), ("op", op)],
                b,
            );
        }
    }
    w.family(
        "tessera_volume_errors_total",
        "counter",
        "Client requests answered with an error.",
    );
    for v in vols {
        let [p, n] = labels(v);
        w.sample(
            "tessera_volume_errors_total",
            &[(p.0, &p.1), (n.0, &n.1)],
            v.stats.errors,
        );
    }
    w.family(
        "tessera_volume_throttled_seconds_total",
        "counter",
        "Time client requests were held back by QoS limits (the volume's and its group's), summed over requests.",
    );
    for v in vols {
        let [p, n] = labels(v);
        w.sample(
            "tessera_volume_throttled_seconds_total",
            &[(p.0, &p.1), (n.0, &n.1)],
            seconds(v.stats.throttled_ns as f64),
        );
    }
    w.family(
        "tessera_volume_latency_seconds",
        "histogram",
        "Client request latency, from receipt to the reply being queued, by operation.",
    );
    for v in vols {
        let [p, n] = labels(v);
        for (op, h) in [
            ("read", &v.stats.read_latency),
            ("write", &v.stats.write_latency),
        ] {
            w.histogram_seconds(
                "tessera_volume_latency_seconds",
                &[(p.0, &p.1), (n.0, &n.1), ("op", op)],
                h,
            );
        }
    }
    w.family(
        "tessera_volume_size_bytes",
        "gauge",
        "Virtual size of the volume.",
    );
    for v in vols {
        let [p, n] = labels(v);
        w.sample(
            "tessera_volume_size_bytes",
            &[(p.0, &p.1), (n.0, &n.1)],
            v.size,
        );
    }
    w.family(
        "tessera_volume_allocated_bytes",
        "gauge",
        "Pool space the volume holds.",
    );
    for v in vols {
        let [p, n] = labels(v);
        w.sample(
            "tessera_volume_allocated_bytes",
            &[(p.0, &p.1), (n.0, &n.1)],
            v.allocated,
        );
    }
}

fn render_pools(w: &mut TextWriter, node: &Node, vols: &[VolumeFigures]) {
    let entries = node.list_pools();
    let online: Vec<&PoolInfo> = entries
        .iter()
        .filter_map(|e| match e {
            PoolEntry::Online(p) => Some(&**p),
            PoolEntry::Offline(_) => None,
        })
        .collect();
    w.family(
        "tessera_pool_state",
        "gauge",
        "Pool state: 0 online, 1 degraded, 2 rebuilding, 3 failed (data lost), 4 offline (not open); the state label names it.",
    );
    for e in &entries {
        w.sample(
            "tessera_pool_state",
            &[("pool", e.name()), ("state", e.state())],
            pool_state_code(e.state()),
        );
    }
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
    let pool_totals: Vec<(&str, StatsSnapshot)> = online
        .iter()
        .map(|p| (p.name.as_str(), totals(&p.name)))
        .collect();
    w.family(
        "tessera_pool_ops_total",
        "counter",
        "Client requests answered by the pool's volumes, by operation (volumes deleted since the node started are not counted).",
    );
    for (pool, t) in &pool_totals {
        for (op, c) in ops_of(t) {
            w.sample("tessera_pool_ops_total", &[("pool", pool), ("op", op)], c);
        }
    }
    w.family(
        "tessera_pool_bytes_total",
        "counter",
        "Bytes clients read from and wrote to the pool's volumes.",
    );
    for (pool, t) in &pool_totals {
        for (op, b) in [("read", t.read_bytes), ("write", t.write_bytes)] {
            w.sample("tessera_pool_bytes_total", &[("pool", pool), ("op", op)], b);
        }
    }
    w.family(
        "tessera_pool_errors_total",
        "counter",
        "Client requests to the pool's volumes answered with an error.",
    );
    for (pool, t) in &pool_totals {
        w.sample("tessera_pool_errors_total", &[("pool", pool)], t.errors);
    }
    w.family(
        "tessera_pool_capacity_bytes",
        "gauge",
        "Bytes available to volumes (metadata excluded).",
    );
    for p in &online {
        w.sample(
            "tessera_pool_capacity_bytes",
            &[("pool", &p.name)],
            p.capacity,
        );
    }
    w.family(
        "tessera_pool_allocated_bytes",
        "gauge",
        "Bytes of the pool held by volumes.",
    );
    for p in &online {
        w.sample(
            "tessera_pool_allocated_bytes",
            &[("pool", &p.name)],
            p.allocated,
        );
    }
}

fn render_devices(w: &mut TextWriter, node: &Node) {
    struct Dev {
        pool: String,
        slot: String,
        device: String,
        state: String,
        totals: DeviceTotals,
    }
    let mut devs = Vec::new();
    for p in node.pools() {
        let info = node.pool_info(&p);
        let stats = &p.core.layout.device_stats;
        for (i, st) in info.device_states.iter().enumerate() {
            devs.push(Dev {
                pool: info.name.clone(),
                slot: i.to_string(),
                device: st.device.clone(),
                state: st.state.clone(),
                totals: stats.get(i).map(|s| s.totals()).unwrap_or_default(),
            });
        }
    }
    let labels = |d: &Dev| {
        [
            ("pool", d.pool.clone()),
            ("slot", d.slot.clone()),
            ("device", d.device.clone()),
        ]
    };
    w.family(
        "tessera_device_state",
        "gauge",
        "Device state: 0 online, 1 rebuilding, 2 failed; the state label names it.",
    );
    for d in &devs {
        let [a, b, c] = labels(d);
        w.sample(
            "tessera_device_state",
            &[(a.0, &a.1), (b.0, &b.1), (c.0, &c.1), ("state", &d.state)],
            device_state_code(&d.state),
        );
    }
    w.family(
        "tessera_device_ops_total",
        "counter",
        "Operations the pool's datapath submitted to the device (metadata commits and other control-plane I/O not included).",
    );
    for d in &devs {
        let [a, b, c] = labels(d);
        for (op, n) in device_ops_of(&d.totals) {
            w.sample(
                "tessera_device_ops_total",
                &[(a.0, &a.1), (b.0, &b.1), (c.0, &c.1), ("op", op)],
                n,
            );
        }
    }
    w.family(
        "tessera_device_bytes_total",
        "counter",
        "Bytes the pool's datapath read from and wrote to the device.",
    );
    for d in &devs {
        let [a, b, c] = labels(d);
        for (op, n) in [
            ("read", d.totals.read_bytes),
            ("write", d.totals.write_bytes),
        ] {
            w.sample(
                "tessera_device_bytes_total",
                &[(a.0, &a.1), (b.0, &b.1), (c.0, &c.1), ("op", op)],
                n,
            );
        }
    }
    w.family(
        "tessera_device_errors_total",
        "counter",
        "I/O errors the pool saw from the device (redundant layouts; concat and raid0 pass errors to the volume).",
    );
    for d in &devs {
        let [a, b, c] = labels(d);
        w.sample(
            "tessera_device_errors_total",
            &[(a.0, &a.1), (b.0, &b.1), (c.0, &c.1)],
            d.totals.errors,
        );
    }
}

fn render_jobs(w: &mut TextWriter, node: &Node) {
    struct Job {
        pool: String,
        job: &'static str,
        state: String,
        done: u64,
        total: u64,
    }
    let mut jobs = Vec::new();
    for p in node.pools() {
        let name = p.name().to_string();
        let unit = p.core.unit_size();
        let mut push = |job, state: String, pr: &tessera_api::JobProgress| {
            jobs.push(Job {
                pool: name.clone(),
                job,
                state,
                done: pr.bytes_done,
                total: pr.units_total.saturating_mul(unit),
            })
        };
        if let Ok(s) = node.scrub_status(&name) {
            push("scrub", s.state, &s.progress);
        }
        if let Ok(s) = node.resync_status(&name) {
            push("resync", s.state, &s.progress);
        }
        if let Ok(s) = node.rebuild_status(&name) {
            push("rebuild", s.state, &s.progress);
        }
    }
    w.family(
        "tessera_job_state",
        "gauge",
        "The running or last scrub, resync or rebuild of a pool since the node started: 0 done, 1 running, 2 stopped, 3 failed; the state label names it.",
    );
    for j in &jobs {
        w.sample(
            "tessera_job_state",
            &[("pool", &j.pool), ("job", j.job), ("state", &j.state)],
            job_state_code(&j.state),
        );
    }
    w.family(
        "tessera_job_done_bytes",
        "gauge",
        "Bytes the job has processed.",
    );
    for j in &jobs {
        w.sample(
            "tessera_job_done_bytes",
            &[("pool", &j.pool), ("job", j.job)],
            j.done,
        );
    }
    w.family(
        "tessera_job_total_bytes",
        "gauge",
        "Bytes the job has to process (its units times the pool's unit size).",
    );
    for j in &jobs {
        w.sample(
            "tessera_job_total_bytes",
            &[("pool", &j.pool), ("job", j.job)],
            j.total,
        );
    }
}

fn render_groups(w: &mut TextWriter, node: &Node, vols: &[VolumeFigures]) {
    w.family(
        "tessera_group_throttled_seconds_total",
        "counter",
        "Time requests to the group's member volumes were held back by QoS limits, summed over requests.",
    );
    for g in node.groups.list() {
        let ns: u64 = vols
            .iter()
            .filter(|v| g.members.contains(&v.volume))
            .map(|v| v.stats.throttled_ns)
            .sum();
        w.sample(
            "tessera_group_throttled_seconds_total",
            &[("group", &g.name)],
            seconds(ns as f64),
        );
    }
}

fn render_reactors(w: &mut TextWriter, node: &Node) {
    w.family(
        "tessera_reactor_seconds_total",
        "counter",
        "Time of each reactor core since it started: busy (running requests and the loop), poll (spinning on the ring for completions before sleeping), sleep (waiting in the kernel).",
    );
    for m in &node.reactors {
        let t = m.load.read();
        let core = m.core.to_string();
        for (state, ns) in [
            ("busy", t.busy_ns()),
            ("poll", t.poll_ns),
            ("sleep", t.sleep_ns),
        ] {
            w.sample(
                "tessera_reactor_seconds_total",
                &[("core", &core), ("state", state)],
                seconds(ns as f64),
            );
        }
    }
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
            PoolEntry::Online(p) if p.state == "failed" => reasons.push(format!(
                "pool '{}' has failed: every copy of some of its data is on failed devices",
                p.name
            )),
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
