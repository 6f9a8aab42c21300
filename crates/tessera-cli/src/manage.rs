//! Management subcommands: thin clients of the node's HTTP/JSON API. Requests and replies
//! are the types of `tessera_api`; `--json` prints a reply as the node sent it (one object
//! for one resource, an array for a list), tables print binary units.
//!
//! Every resource takes the same verbs: `create`, `delete`, `list`, `show` (`status` for
//! pools), and `add` / `remove` for members (group volumes, pool spares, subsystem hosts
//! and namespaces). The spellings of earlier releases stay as hidden aliases.

use std::collections::BTreeMap;
use tessera_io::cast::u64_of_f64;

use clap::{Args, Subcommand};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tessera_api::{
    AddReplica, BackgroundLimits, BackgroundList, CreateExport, CreateVolume, Deleted, ErrorReply,
    ExportInfo, GroupInfo, NodeStatus, PoolEntry, PutGroup, QosLimits, RemovedReplica,
    ResizeVolume, StepBurst, TlsPolicy, VolumeInfo, VolumeStats,
};
use tessera_http::{request, Endpoint};

use crate::error::{CliError, Result};
use crate::format::{bytes, opt, rate, table};

pub fn endpoint(arg: Option<&str>) -> Endpoint {
    let s = arg
        .map(str::to_string)
        .unwrap_or_else(crate::paths::default_api);
    Endpoint::parse(&s)
}

/// How an endpoint is written on the command line (for messages).
fn endpoint_text(ep: &Endpoint) -> String {
    match ep {
        Endpoint::Unix(p) => format!("unix:{}", p.display()),
        Endpoint::Tcp(a) => a.clone(),
        Endpoint::Https(h) => format!("https://{}", h.addr),
    }
}

/// The node's API cannot be reached: say where the CLI looked and how to point it
/// elsewhere.
fn unreachable(ep: &Endpoint, e: &std::io::Error) -> CliError {
    CliError::Unavailable(format!(
        "cannot reach the node's API at {}: {e} (is a node running? start one with \
         `tessera up`, or pass --api unix:PATH or set TESSERA_API)",
        endpoint_text(ep)
    ))
}

/// One request to the node; a 2xx reply is read as `T`, any other as the node's error.
fn exchange<T: DeserializeOwned>(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<T> {
    let (status, text) =
        request(ep, method, path, body.as_ref()).map_err(|e| unreachable(ep, &e))?;
    if (200..300).contains(&status) {
        serde_json::from_str(&text).map_err(|e| {
            CliError::Failed(format!(
                "the node's reply to {method} {path} is not understood: {e}"
            ))
        })
    } else {
        let message = serde_json::from_str::<ErrorReply>(&text)
            .map(|r| r.error)
            .unwrap_or_else(|_| format!("the node answered HTTP {status}"));
        Err(CliError::Api { status, message })
    }
}

pub(crate) fn get<T: DeserializeOwned>(ep: &Endpoint, path: &str) -> Result<T> {
    exchange(ep, "GET", path, None)
}

pub(crate) fn delete<T: DeserializeOwned>(ep: &Endpoint, path: &str) -> Result<T> {
    exchange(ep, "DELETE", path, None)
}

/// `method` with `body` as JSON.
pub(crate) fn send<B: Serialize, T: DeserializeOwned>(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: &B,
) -> Result<T> {
    let v = serde_json::to_value(body)
        .map_err(|e| CliError::Failed(format!("cannot encode the request: {e}")))?;
    exchange(ep, method, path, Some(v))
}

/// `PUT` without a body (group membership).
pub(crate) fn put_empty<T: DeserializeOwned>(ep: &Endpoint, path: &str) -> Result<T> {
    exchange(ep, "PUT", path, None)
}

/// A reply as JSON, for `--json`.
pub(crate) fn print_json<T: Serialize + ?Sized>(v: &T) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// `--json`: the reply as JSON; otherwise the human form `f` prints.
pub(crate) fn show<T: Serialize + ?Sized>(v: &T, raw: bool, f: impl FnOnce(&T)) {
    if raw {
        print_json(v)
    } else {
        f(v)
    }
}

/// The one-line confirmation of a deletion, or the node's reply with `--json`.
pub(crate) fn deleted<T: Serialize>(v: &Deleted<T>, raw: bool, what: &str) {
    show(v, raw, |_| println!("{what} deleted"));
}

/// The entry named `name` of a list the node gave, or a not-found error (exit code 3) as
/// the node words it for the resources it can look up by name.
pub(crate) fn one_of<T>(
    list: Vec<T>,
    kind: &str,
    name: &str,
    key: impl Fn(&T) -> &str,
) -> Result<T> {
    list.into_iter()
        .find(|x| key(x) == name)
        .ok_or_else(|| CliError::Api {
            status: 404,
            message: format!("{kind} '{name}' not found"),
        })
}

/// A size flag, in the units `tessera_device::parse_size` takes; a bad one is an invalid
/// argument (exit code 5) naming the flag.
pub(crate) fn size_flag(flag: &str, v: &str) -> Result<u64> {
    tessera_device::parse_size(v).map_err(|e| CliError::Invalid(format!("{flag}: {e}")))
}

pub fn status(ep: &Endpoint, raw: bool) -> Result<()> {
    let v: NodeStatus = get(ep, "/v1/status")?;
    show(&v, raw, |v| {
        println!(
            "Tessera {} — up {}s on {} core(s)",
            v.version, v.uptime_seconds, v.cores
        );
        println!(
            "capacity {}  allocated {}  free {}",
            bytes(v.capacity),
            bytes(v.allocated),
            bytes(v.free)
        );
        println!("NBD: {}", v.nbd.join(", "));
        println!();
        print_pools(&v.pools);
        println!();
        print_exports(&v.exports);
    });
    Ok(())
}

pub(crate) fn print_pools(pools: &[PoolEntry]) {
    let mut rows = vec![vec![
        "POOL".into(),
        "STATE".into(),
        "LAYOUT".into(),
        "CAPACITY".into(),
        "ALLOCATED".into(),
        "FREE".into(),
        "VOLUMES".into(),
        "DEVICES".into(),
    ]];
    for e in pools {
        rows.push(match e {
            PoolEntry::Online(p) => {
                let devs = p
                    .device_states
                    .iter()
                    .map(|d| match (&d.reason, d.is_failed()) {
                        (r, true) => format!("{}(FAILED: {})", d.device, opt(r.as_deref())),
                        _ => d.device.clone(),
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                vec![
                    p.name.clone(),
                    p.state.to_string(),
                    p.layout.clone(),
                    bytes(p.capacity),
                    bytes(p.allocated),
                    bytes(p.free),
                    p.volumes.to_string(),
                    devs,
                ]
            }
            PoolEntry::Offline(p) => {
                let mut row = vec![p.name.clone(), p.state.to_string()];
                row.extend(std::iter::repeat_n("-".to_string(), 5));
                row.push(p.error.clone());
                row
            }
        });
    }
    table(rows);
}

fn print_volumes(vols: &[VolumeInfo]) {
    let mut rows = vec![vec![
        "VOLUME".into(),
        "POOL".into(),
        "SIZE".into(),
        "ALLOCATED".into(),
        "EXPORTS".into(),
        "CONNECTIONS".into(),
    ]];
    for x in vols {
        let ex = x.exports.join(",");
        rows.push(vec![
            x.name.clone(),
            x.pool.clone(),
            bytes(x.size),
            bytes(x.allocated),
            if ex.is_empty() { "-".into() } else { ex },
            x.connections.to_string(),
        ]);
    }
    table(rows);
}

/// One volume, and its replicas when it is replicated.
fn print_volume(v: &VolumeInfo) {
    print_volumes(std::slice::from_ref(v));
    if v.dedup {
        println!(
            "dedup volume: identical blocks share storage across pool {}",
            v.pool
        );
    }
    let Some(reps) = &v.replicas else { return };
    println!();
    let mut rows = vec![vec![
        "REPLICA".into(),
        "VOLUME".into(),
        "STATE".into(),
        "LACKS".into(),
        "RESYNC".into(),
        "ERROR".into(),
    ]];
    for r in reps {
        let resync = match (
            r.resync_percent,
            r.resync_rate_bytes_per_sec,
            r.resync_eta_secs,
        ) {
            (Some(p), Some(rate), Some(eta)) => {
                format!("{p:.1}% at {}/s, {eta:.0} s left", bytes(u64_of_f64(rate)))
            }
            (Some(p), _, _) => format!("{p:.1}%"),
            _ => "-".into(),
        };
        rows.push(vec![
            r.place.clone(),
            r.volume.clone(),
            r.state.to_string(),
            bytes(r.dirty_bytes),
            resync,
            r.last_error.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    table(rows);
}

fn print_exports(exports: &[ExportInfo]) {
    let mut rows = vec![vec![
        "EXPORT".into(),
        "VOLUME".into(),
        "MODE".into(),
        "SIZE".into(),
        "CONNECTIONS".into(),
        "URI".into(),
    ]];
    for x in exports {
        rows.push(vec![
            x.name.clone(),
            opt(x.volume.as_deref()),
            match (x.read_only, x.tls_required) {
                (false, false) => "rw",
                (true, false) => "ro",
                (false, true) => "rw,tls",
                (true, true) => "ro,tls",
            }
            .into(),
            x.size.map_or_else(|| "-".into(), bytes),
            opt(x.connections),
            opt(x.uris.first()),
        ]);
    }
    table(rows);
}

/// The volume a command acts on.
#[derive(Args, Debug)]
pub struct VolumeName {
    /// Name of the volume.
    pub name: String,
}

#[derive(Args, Debug)]
pub struct VolumeCreateArgs {
    /// Name of the new volume (unique on the node).
    pub name: String,
    /// Pool that holds the volume's data (not with --replicas); may be left out on a
    /// node with one pool.
    #[arg(long, conflicts_with = "replicas")]
    pub pool: Option<String>,
    /// Virtual size, a multiple of 512 bytes: bytes or K, M, G, T, P (or KiB ... PiB).
    #[arg(long)]
    pub size: String,
    /// Replicate the volume synchronously on several nodes: NODE:POOL per replica,
    /// comma-separated, this node's own name included (it owns and exports the volume;
    /// the others are `[[peer]]`s in its config or cluster members). In a cluster, a
    /// number (`--replicas 3`) lets placement choose the nodes and pools.
    #[arg(long, value_delimiter = ',')]
    pub replicas: Vec<String>,
    /// Go beyond the pool's overcommit ratio (`pool update --overcommit` changes it).
    #[arg(long)]
    pub force: bool,
    /// In a pool with dedup on, make a plain volume whose writes are never looked up
    /// (for data that does not repeat: databases, encrypted or compressed files).
    #[arg(long, conflicts_with = "replicas")]
    pub no_dedup: bool,
}

#[derive(Subcommand, Debug)]
pub enum VolumeCmd {
    /// Create a thin volume (no space is taken until it is written).
    Create(VolumeCreateArgs),
    /// List the volumes of every pool.
    List,
    /// Show one volume: pool, size, allocation, exports, connections.
    #[command(visible_alias = "status")]
    Show(VolumeName),
    /// Grow a volume (shrinking is refused).
    Resize {
        /// Name of the volume.
        name: String,
        /// New virtual size (at least the current one), e.g. 20G.
        #[arg(long)]
        size: String,
        /// Go beyond the pool's overcommit ratio.
        #[arg(long)]
        force: bool,
    },
    /// Delete a volume and free its space (refused while exported or connected).
    Delete(VolumeName),
    /// Show or set a volume's QoS limits, share weight and reads-first (live,
    /// persistent). Setting replaces every control; `--clear` removes them all.
    Qos {
        /// Name of the volume.
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
        /// Share weight when volumes compete for a saturated core (1-10000, default 100).
        #[arg(long)]
        weight: Option<u32>,
        /// Serve this volume's reads before its writes when its core is saturated.
        #[arg(long)]
        reads_first: bool,
        /// Remove every QoS control of the volume.
        #[arg(long)]
        clear: bool,
    },
    /// A writable clone of a snapshot, sharing its data.
    Clone {
        /// The snapshot to clone.
        snapshot: String,
        /// Name of the new volume.
        #[arg(long)]
        name: String,
        /// Go beyond the pool's overcommit ratio.
        #[arg(long)]
        force: bool,
    },
    /// Give a volume the contents of one of its snapshots back (refused while exported).
    Rollback {
        /// Name of the volume.
        name: String,
        /// The snapshot to go back to.
        #[arg(long)]
        to: String,
    },
    /// The byte ranges of a volume (or snapshot) that may differ from an older snapshot
    /// (incremental backup): `OFFSET LENGTH` lines.
    Changes {
        /// Name of the volume or snapshot.
        name: String,
        /// The older snapshot.
        #[arg(long)]
        since: String,
    },
    /// Client I/O of a volume: IOPS, bandwidth and latency over an interval.
    Stats {
        /// Name of the volume.
        name: String,
        /// Sampling interval in seconds.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Add or remove a replica of a volume on another node.
    #[command(subcommand)]
    Replica(ReplicaCmd),
}

#[derive(Subcommand, Debug)]
pub enum ReplicaCmd {
    /// Give a volume one more replica on a peer node. It starts empty and gets a copy of
    /// the volume's allocated space in the background, while clients keep writing
    /// (`volume status` shows its progress). A volume that is not replicated yet becomes
    /// so; it must not be exported or connected meanwhile.
    Add {
        /// Name of the volume (owned by this node).
        name: String,
        /// NODE:POOL: a `[[peer]]` of this node and one of its pools.
        replica: String,
    },
    /// Remove a replica of a volume; its node deletes the replica's volume (if it cannot
    /// be reached, the volume stays there and the reply says so). The owner's own
    /// replica and the last replica in sync cannot be removed.
    Remove {
        /// Name of the volume.
        name: String,
        /// NODE:POOL, as `volume status` lists it.
        replica: String,
    },
}

fn print_stats(v: &VolumeStats) {
    let l = &v.latency_us;
    println!("volume {} over {} ms:", v.volume, v.interval_ms);
    println!(
        "  read   {:>10.0} IOPS {:>9.1} MiB/s",
        v.read_iops, v.read_mibps
    );
    println!(
        "  write  {:>10.0} IOPS {:>9.1} MiB/s",
        v.write_iops, v.write_mibps
    );
    println!("  other  {:>10.0} IOPS", v.other_iops);
    println!(
        "  latency mean {:.1} us, p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us",
        l.mean, l.p50, l.p99, l.p999
    );
    println!("  errors {}", v.errors);
}

pub fn volume(ep: &Endpoint, c: VolumeCmd, raw: bool) -> Result<()> {
    match c {
        VolumeCmd::Create(a) => {
            // `--replicas 3`: a count, placed by the cluster.
            let count = match a.replicas.as_slice() {
                [one] if one.bytes().all(|b| b.is_ascii_digit()) => Some(
                    one.parse::<u32>()
                        .map_err(|_| CliError::Usage(format!("--replicas {one}: too large")))?,
                ),
                _ => None,
            };
            let chosen = a.pool.is_none() && a.replicas.is_empty();
            let body = CreateVolume {
                name: a.name,
                pool: a.pool.unwrap_or_default(),
                size: a.size.into(),
                replicas: if count.is_some() {
                    Vec::new()
                } else {
                    a.replicas
                },
                replica_count: count,
                force: a.force,
                dedup: a.no_dedup.then_some(false),
            };
            let v: VolumeInfo = send(ep, "POST", "/v1/volumes", &body)?;
            if chosen && !raw {
                // On stderr: the table (or JSON) on stdout stays what scripts parse.
                eprintln!(
                    "no --pool given: using pool '{}', the node's only pool",
                    v.pool
                );
            }
            show(&v, raw, print_volume);
        }
        VolumeCmd::List => {
            let v: Vec<VolumeInfo> = get(ep, "/v1/volumes")?;
            show(&v[..], raw, print_volumes);
        }
        VolumeCmd::Show(VolumeName { name }) => {
            let v: VolumeInfo = get(ep, &format!("/v1/volumes/{name}"))?;
            show(&v, raw, print_volume);
        }
        VolumeCmd::Resize { name, size, force } => {
            let body = ResizeVolume {
                size: size.into(),
                force,
            };
            let v: VolumeInfo = send(ep, "PATCH", &format!("/v1/volumes/{name}"), &body)?;
            show(&v, raw, |v| print_volumes(std::slice::from_ref(v)));
        }
        VolumeCmd::Delete(VolumeName { name }) => {
            let v: Deleted = delete(ep, &format!("/v1/volumes/{name}"))?;
            deleted(&v, raw, &format!("volume {name}"));
        }
        VolumeCmd::Qos {
            name,
            limits,
            weight,
            reads_first,
            clear,
        } => {
            let path = format!("/v1/volumes/{name}/qos");
            let v: QosLimits = if clear {
                delete(ep, &path)?
            } else if limits.any() || weight.is_some() || reads_first {
                let body = QosLimits {
                    weight,
                    reads_first,
                    ..limits.to_limits()?
                };
                send(ep, "PUT", &path, &body)?
            } else {
                get(ep, &path)?
            };
            show(&v, raw, |v| {
                println!("volume {name} qos: {}", limits_line(v))
            });
        }
        // Snapshot-related volume verbs live in snapshot_cmd.rs; main.rs routes them there.
        VolumeCmd::Clone { .. } | VolumeCmd::Rollback { .. } | VolumeCmd::Changes { .. } => {
            unreachable!("routed to snapshot_cmd by main")
        }
        VolumeCmd::Stats { name, interval } => {
            let ms = u64_of_f64((interval * 1000.0).round().clamp(1.0, 60_000.0));
            let v: VolumeStats = get(ep, &format!("/v1/volumes/{name}/stats?interval_ms={ms}"))?;
            show(&v, raw, print_stats);
        }
        VolumeCmd::Replica(ReplicaCmd::Add { name, replica }) => {
            let body = AddReplica { replica };
            let v: VolumeInfo = send(ep, "POST", &format!("/v1/volumes/{name}/replicas"), &body)?;
            show(&v, raw, print_volume);
        }
        VolumeCmd::Replica(ReplicaCmd::Remove { name, replica }) => {
            let v: RemovedReplica = delete(ep, &format!("/v1/volumes/{name}/replicas/{replica}"))?;
            show(&v, raw, |v| {
                println!("replica {} of volume {} removed", v.replica, v.volume);
                match &v.note {
                    None => println!(
                        "{} deleted its volume {}",
                        replica_node(&v.replica),
                        v.replica_volume
                    ),
                    Some(n) => println!("note: {n}"),
                }
            });
        }
    }
    Ok(())
}

/// The node of a `NODE:POOL` replica place.
fn replica_node(place: &str) -> &str {
    place.split_once(':').map_or(place, |(n, _)| n)
}

/// `export create` (and its old spelling `export add`). Options of an export (e.g. TLS)
/// go here, so both spellings take them.
#[derive(Args, Debug)]
pub struct ExportCreateArgs {
    /// Export name: what NBD clients ask for (nbd://HOST:PORT/NAME).
    pub name: String,
    /// Volume to export.
    #[arg(long)]
    pub volume: String,
    /// Refuse writes from clients of this export.
    #[arg(long)]
    pub read_only: bool,
    /// NBD TLS: required (clients must start TLS) or optional; default: the node's.
    #[arg(long)]
    pub tls: Option<TlsPolicy>,
}

/// The export a command acts on.
#[derive(Args, Debug)]
pub struct ExportName {
    /// Name of the export.
    pub name: String,
}

#[derive(Subcommand, Debug)]
pub enum ExportCmd {
    /// Export a volume over NBD under NAME.
    Create(ExportCreateArgs),
    /// Old spelling of `export create`.
    #[command(hide = true)]
    Add(ExportCreateArgs),
    /// List the exports and their URIs.
    List,
    /// Show one export: volume, mode, size, connections, URIs.
    #[command(visible_alias = "status")]
    Show(ExportName),
    /// Stop exporting (open connections keep their volume until they disconnect).
    #[command(alias = "remove")]
    Delete(ExportName),
}

pub fn export(ep: &Endpoint, c: ExportCmd, raw: bool) -> Result<()> {
    match c {
        ExportCmd::Create(a) | ExportCmd::Add(a) => {
            let body = CreateExport {
                name: a.name,
                volume: a.volume,
                read_only: a.read_only,
                tls: a.tls,
            };
            let v: ExportInfo = send(ep, "POST", "/v1/exports", &body)?;
            show(&v, raw, |v| print_exports(std::slice::from_ref(v)));
        }
        ExportCmd::List => {
            let v: Vec<ExportInfo> = get(ep, "/v1/exports")?;
            show(&v[..], raw, print_exports);
        }
        ExportCmd::Show(ExportName { name }) => {
            let all: Vec<ExportInfo> = get(ep, "/v1/exports")?;
            let v = one_of(all, "export", &name, |x| &x.name)?;
            show(&v, raw, |v| {
                print_exports(std::slice::from_ref(v));
                for u in v.uris.iter().skip(1) {
                    println!("also: {u}");
                }
            });
        }
        ExportCmd::Delete(ExportName { name }) => {
            let v: Deleted = delete(ep, &format!("/v1/exports/{name}"))?;
            deleted(&v, raw, &format!("export {name}"));
        }
    }
    Ok(())
}

/// The rate and burst flags shared by volume and group QoS commands.
#[derive(Args, Debug, Default)]
pub struct LimitArgs {
    /// I/O operations per second, reads and writes together.
    #[arg(long)]
    iops: Option<u64>,
    /// Read operations per second.
    #[arg(long)]
    read_iops: Option<u64>,
    /// Write operations per second.
    #[arg(long)]
    write_iops: Option<u64>,
    /// Bandwidth, reads and writes together, per second: e.g. 100M (bytes or K, M, G, T).
    #[arg(long)]
    bw: Option<String>,
    /// Read bandwidth per second, e.g. 100M.
    #[arg(long)]
    read_bw: Option<String>,
    /// Write bandwidth per second, e.g. 100M.
    #[arg(long)]
    write_bw: Option<String>,
    /// Refilling burst, in milliseconds of the rate (default 100).
    #[arg(long)]
    burst_ms: Option<u64>,
    /// One-time burst, in milliseconds of the rate (default 0).
    #[arg(long)]
    one_time_burst_ms: Option<u64>,
}

impl LimitArgs {
    fn any(&self) -> bool {
        self.iops.is_some()
            || self.read_iops.is_some()
            || self.write_iops.is_some()
            || self.bw.is_some()
            || self.read_bw.is_some()
            || self.write_bw.is_some()
            || self.burst_ms.is_some()
            || self.one_time_burst_ms.is_some()
    }

    /// The API's QoS limits (no weight, not reads-first).
    fn to_limits(&self) -> Result<QosLimits> {
        let size = |flag: &str, v: &Option<String>| -> Result<Option<u64>> {
            v.as_deref().map(|x| size_flag(flag, x)).transpose()
        };
        Ok(QosLimits {
            iops: self.iops,
            read_iops: self.read_iops,
            write_iops: self.write_iops,
            bps: size("--bw", &self.bw)?,
            read_bps: size("--read-bw", &self.read_bw)?,
            write_bps: size("--write-bw", &self.write_bw)?,
            burst_ms: self.burst_ms,
            one_time_burst_ms: self.one_time_burst_ms,
            weight: None,
            reads_first: false,
        })
    }
}

/// Every control set in QoS limits, named as the flags that set them (`iops=5000,
/// write_bw=100 MiB/s`), or "unlimited".
fn limits_line(l: &QosLimits) -> String {
    let count = |k: &str, v: Option<u64>| v.map(|v| format!("{k}={v}"));
    let bw = |k: &str, v: Option<u64>| v.map(|v| format!("{k}={}", rate(v)));
    let mut set: Vec<String> = [
        count("iops", l.iops),
        count("read_iops", l.read_iops),
        count("write_iops", l.write_iops),
        bw("bw", l.bps),
        bw("read_bw", l.read_bps),
        bw("write_bw", l.write_bps),
        count("burst_ms", l.burst_ms),
        count("one_time_burst_ms", l.one_time_burst_ms),
        count("weight", l.weight.map(u64::from)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if l.reads_first {
        set.push("reads_first=true".into());
    }
    if set.is_empty() {
        "unlimited".to_string()
    } else {
        set.join(", ")
    }
}

/// `group create` (and its old spelling `group set`).
#[derive(Args, Debug)]
pub struct GroupCreateArgs {
    /// Name of the group.
    name: String,
    #[command(flatten)]
    limits: LimitArgs,
    /// Stepped burst: each step adds this percentage of the base limits.
    #[arg(long, requires = "max_steps")]
    step_pct: Option<u32>,
    /// Stepped burst: the highest step.
    #[arg(long, requires = "step_pct")]
    max_steps: Option<u32>,
    /// Stepped burst: time on a step before the next (ms).
    #[arg(long, default_value_t = 1000)]
    step_ms: u64,
    /// Stepped burst: credit cap, in ms of the base rate, earned below base.
    #[arg(long, default_value_t = 10_000)]
    credit_ms: u64,
}

/// The group a command acts on.
#[derive(Args, Debug)]
pub struct GroupName {
    /// Name of the group.
    name: String,
}

/// A volume joining or leaving a group.
#[derive(Args, Debug)]
pub struct GroupMember {
    /// Name of the group.
    name: String,
    /// Name of the volume.
    volume: String,
}

#[derive(Subcommand, Debug)]
pub enum GroupCmd {
    /// Create a QoS group (tenant), or replace an existing group's limits: its member
    /// volumes share them.
    #[command(alias = "set")]
    Create(GroupCreateArgs),
    /// List the groups.
    List,
    /// Show one group: limits, members, stepped-burst level.
    #[command(visible_alias = "status")]
    Show(GroupName),
    /// Delete a group; its volumes keep only their own limits.
    Delete(GroupName),
    /// Put a volume in a group (it leaves any other).
    Add(GroupMember),
    /// Take a volume out of a group.
    Remove(GroupMember),
}

fn print_groups(groups: &[GroupInfo]) {
    for g in groups {
        let mut line = format!(
            "group {}: {} members [{}]",
            g.name,
            limits_line(&g.limits),
            g.members.join(", ")
        );
        if let Some(st) = &g.step {
            line += &format!(
                " step +{}% x{} every {} ms, level {}, credits {} ms, now {}",
                st.step_pct,
                st.max_steps,
                st.step_ms,
                opt(g.level),
                opt(g.credits_ms),
                limits_line(&g.effective)
            );
        }
        println!("{line}");
    }
}

pub fn group(ep: &Endpoint, c: GroupCmd, raw: bool) -> Result<()> {
    let v: GroupInfo = match c {
        GroupCmd::Create(a) => {
            let step = a
                .step_pct
                .zip(a.max_steps)
                .map(|(step_pct, max_steps)| StepBurst {
                    step_pct,
                    max_steps,
                    step_ms: a.step_ms,
                    credit_ms: a.credit_ms,
                });
            let body = PutGroup {
                limits: a.limits.to_limits()?,
                step,
            };
            send(ep, "PUT", &format!("/v1/groups/{}", a.name), &body)?
        }
        GroupCmd::List => {
            let v: Vec<GroupInfo> = get(ep, "/v1/groups")?;
            show(&v[..], raw, print_groups);
            return Ok(());
        }
        GroupCmd::Show(GroupName { name }) => get(ep, &format!("/v1/groups/{name}"))?,
        GroupCmd::Delete(GroupName { name }) => {
            let v: Deleted = delete(ep, &format!("/v1/groups/{name}"))?;
            deleted(&v, raw, &format!("group {name}"));
            return Ok(());
        }
        GroupCmd::Add(GroupMember { name, volume }) => {
            put_empty(ep, &format!("/v1/groups/{name}/members/{volume}"))?
        }
        GroupCmd::Remove(GroupMember { name, volume }) => {
            delete(ep, &format!("/v1/groups/{name}/members/{volume}"))?
        }
    };
    show(&v, raw, |v| print_groups(std::slice::from_ref(v)));
    Ok(())
}

#[derive(Subcommand, Debug)]
pub enum BackgroundCmd {
    /// Show every background class's limits.
    #[command(visible_alias = "list")]
    Show,
    /// Set a class's limits (scrub, rebuild, resync); persistent.
    Set {
        /// Background class: scrub, rebuild or resync.
        class: String,
        /// Maximum bandwidth per second, e.g. 200M (bytes or K, M, G, T).
        #[arg(long)]
        bw: String,
        /// Client p99 latency (µs) above which the class backs off
        /// (default: 1.5x the clients' p99 when the job starts).
        #[arg(long)]
        latency_target_us: Option<u64>,
        /// Floor of the backed-off rate, percent of --bw.
        #[arg(long, default_value_t = 1)]
        min_pct: u32,
    },
    /// Back to the class's defaults.
    Reset {
        /// Background class: scrub, rebuild or resync.
        class: String,
    },
}

pub fn background(ep: &Endpoint, c: BackgroundCmd, raw: bool) -> Result<()> {
    let v: BackgroundList = match c {
        BackgroundCmd::Show => get(ep, "/v1/background")?,
        BackgroundCmd::Set {
            class,
            bw,
            latency_target_us,
            min_pct,
        } => {
            let body = BackgroundLimits {
                bps: size_flag("--bw", &bw)?,
                latency_target_us,
                min_pct,
            };
            let v: BackgroundLimits = send(ep, "PUT", &format!("/v1/background/{class}"), &body)?;
            BTreeMap::from([(class, v)])
        }
        BackgroundCmd::Reset { class } => {
            let v: BackgroundLimits = delete(ep, &format!("/v1/background/{class}"))?;
            BTreeMap::from([(class, v)])
        }
    };
    show(&v, raw, |v| {
        for (class, l) in v {
            let target = l
                .latency_target_us
                .map_or("1.5x clients' p99 at start".to_string(), |t| {
                    format!("{t} µs")
                });
            println!(
                "background {class}: {} max, backs off above {target}, floor {}%",
                rate(l.bps),
                l.min_pct
            );
        }
    });
    Ok(())
}
