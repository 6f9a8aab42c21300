//! Management subcommands: thin clients of the node's HTTP/JSON API. Requests and replies
//! are the types of `tessera_api`; `--json` prints a reply as the node sent it.

use std::collections::BTreeMap;

use clap::Subcommand;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tessera_api::{
    BackgroundLimits, BackgroundList, CreateExport, CreatePool, CreateVolume, Deleted, ErrorReply,
    ExportInfo, GroupInfo, JobProgress, NodeStatus, PoolEntry, PoolInfo, PutGroup, QosLimits,
    RebuildRequest, RebuildStatus, ReplaceReply, ReplaceRequest, ResizeVolume, ScrubRequest,
    ScrubStatus, SizeArg, SpareList, SpareRequest, StepBurst, UpdatePool, VolumeInfo, VolumeStats,
    JOB_DONE, JOB_RUNNING,
};
use tessera_http::{request, Endpoint};

use crate::error::{CliError, Result};

pub fn endpoint(arg: Option<&str>) -> Endpoint {
    let s = arg
        .map(str::to_string)
        .or_else(|| std::env::var("TESSERA_API").ok())
        .unwrap_or_else(|| "tessera-data/api.sock".into());
    Endpoint::parse(&s)
}

/// One request to the node; a 2xx reply is read as `T`, any other as the node's error.
fn exchange<T: DeserializeOwned>(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<T> {
    let (status, text) = request(ep, method, path, body.as_ref())
        .map_err(|e| CliError::Unavailable(e.to_string()))?;
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

/// A reply as JSON, for `--json`.
pub(crate) fn print_json<T: Serialize + ?Sized>(v: &T) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// `--json`: the reply as JSON; otherwise the human form `f` prints.
fn show<T: Serialize + ?Sized>(v: &T, raw: bool, f: impl FnOnce(&T)) {
    if raw {
        print_json(v)
    } else {
        f(v)
    }
}

/// Human sizes with one decimal (4.0G, 512.0M); exact values are in --json.
fn human(n: u64) -> String {
    let units = ["B", "K", "M", "G", "T", "P"];
    let mut f = n as f64;
    let mut i = 0;
    while f >= 1024.0 && i + 1 < units.len() {
        f /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n}B")
    } else {
        format!("{f:.1}{}", units[i])
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |x| x.to_string())
}

fn table(rows: Vec<Vec<String>>) {
    let cols = rows.first().map_or(0, |r| r.len());
    let w: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = w[i]))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
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
            human(v.capacity),
            human(v.allocated),
            human(v.free)
        );
        println!("NBD: {}", v.nbd.join(", "));
        println!();
        print_pools(&v.pools);
        println!();
        print_exports(&v.exports);
    });
    Ok(())
}

fn print_pools(pools: &[PoolEntry]) {
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
                    p.state.clone(),
                    p.layout.clone(),
                    human(p.capacity),
                    human(p.allocated),
                    human(p.free),
                    p.volumes.to_string(),
                    devs,
                ]
            }
            PoolEntry::Offline(p) => {
                let mut row = vec![p.name.clone(), p.state.clone()];
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
            human(x.size),
            human(x.allocated),
            if ex.is_empty() { "-".into() } else { ex },
            x.connections.to_string(),
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
            if x.read_only { "ro" } else { "rw" }.into(),
            x.size.map_or_else(|| "-".into(), human),
            opt(x.connections),
            opt(x.uris.first()),
        ]);
    }
    table(rows);
}

#[derive(Subcommand)]
pub enum PoolCmd {
    /// Create a pool. DEVICE: /path (existing file or block device), /path:SIZE (file
    /// created if missing), ram:SIZE, null:SIZE, or fault:INNER;key=value...
    Create {
        name: String,
        #[arg(required = true)]
        devices: Vec<String>,
        /// concat, raid0, raid1 (n-way mirror), raid10 (striped mirror sets), raid5 (XOR
        /// parity), raid6 (P+Q parity) or ec:K+M (Reed-Solomon, e.g. ec:4+2).
        #[arg(long, default_value = "concat")]
        layout: String,
        /// Mirrors: copies of each block (raid1: the number of devices; raid10: default 2).
        #[arg(long)]
        copies: Option<u32>,
        /// Stripe size for raid0/raid10 (power of two, 4K..16M); chunk size for
        /// raid5/raid6/ec (power of two, 4K..256K). Default 64K.
        #[arg(long)]
        stripe_size: Option<String>,
        /// Thin allocation unit (power of two, 64K..1G; default 1M).
        #[arg(long)]
        unit_size: Option<String>,
        /// Overwrite devices that carry another pool's label.
        #[arg(long)]
        force: bool,
        /// Overcommit ratio: the volumes' virtual sizes may add up to this many times
        /// the pool's capacity (default 20; `volume create --force` goes beyond).
        #[arg(long)]
        overcommit: Option<f64>,
    },
    /// Change a pool's settings (live and persistent).
    Update {
        name: String,
        /// Overcommit ratio: the volumes' virtual sizes may add up to this many times
        /// the pool's capacity (above 0; volumes already beyond it stay).
        #[arg(long, required = true)]
        overcommit: Option<f64>,
    },
    /// List the pools (with those the node could not open).
    List,
    /// A pool's state, and its rebuild and resync (after an unclean shutdown) if any.
    Status {
        name: String,
        /// Exit with code 7 when the pool is degraded or failed (for scripts and health
        /// checks).
        #[arg(long)]
        check: bool,
    },
    /// Destroy an empty pool and wipe its device labels.
    Destroy { name: String },
    /// Scrub a pool: re-read every allocated unit and the metadata in the background
    /// (scrub class limits, backing off when client latency rises); on a mirror, compare
    /// the copies and rewrite those that differ from the first readable copy (unless
    /// --no-repair). Starts one unless --status or --stop; --wait follows it with a
    /// progress bar until it ends.
    Scrub {
        name: String,
        /// Only report mismatched copies, do not rewrite them.
        #[arg(long, conflicts_with_all = ["stop", "status"])]
        no_repair: bool,
        #[arg(long, conflicts_with = "stop")]
        status: bool,
        #[arg(long)]
        stop: bool,
        #[arg(long, conflicts_with = "stop")]
        wait: bool,
    },
    /// Put a new device (same size or larger, not ram/null) in place of failed device
    /// --device of a redundant pool, live: the rebuild onto it starts at once (follow it
    /// with `pool rebuild NAME --status --wait`). Recorded in pools.json, so a restart
    /// keeps it (and resumes an unfinished rebuild).
    Replace {
        name: String,
        #[arg(long)]
        device: usize,
        new_device: String,
        /// Take a device that carries another pool's label (its label is wiped).
        #[arg(long)]
        force: bool,
    },
    /// Hot spares of a redundant pool: when a device fails, the node puts the first
    /// spare in its place and rebuilds onto it by itself.
    #[command(subcommand)]
    Spare(SpareCmd),
    /// Rebuild a failed device of a redundant pool in place (a device that came back, or
    /// a blank one at the same path): every allocated unit is copied from a mirror or
    /// reconstructed from the other devices of a parity pool, in the background (rebuild
    /// class limits). Starts one unless --status or --stop; --wait
    /// follows it with a progress bar until it ends.
    Rebuild {
        name: String,
        /// Device index (default: the only failed device).
        #[arg(long)]
        device: Option<usize>,
        /// Rebuild --device even if it is healthy (a full resync of that copy).
        #[arg(long, requires = "device")]
        force: bool,
        #[arg(long, conflicts_with = "stop")]
        status: bool,
        #[arg(long)]
        stop: bool,
        #[arg(long, conflicts_with = "stop")]
        wait: bool,
    },
}

#[derive(Subcommand)]
pub enum SpareCmd {
    /// Add a hot spare (a device spec like `pool create` takes; at least as large as the
    /// pool's devices, not ram/null). It is not written until it replaces a device.
    Add {
        name: String,
        device: String,
        /// Take a device that carries another pool's label, and wipe that label now.
        #[arg(long)]
        force: bool,
    },
    /// Remove a hot spare.
    Remove { name: String, device: String },
    /// List a pool's hot spares (in the order they are used).
    List { name: String },
}

fn print_spares(v: &SpareList) {
    if v.spares.is_empty() {
        println!("pool {}: no hot spares", v.pool);
    }
    for s in &v.spares {
        println!("{s}");
    }
}

/// The part of a background job's status line that scrub and rebuild share: a progress
/// bar, units, rate, ETA and the class controller's limit.
fn job_progress(v: &JobProgress) -> String {
    let pct = v.percent;
    let filled = ((pct / 5.0).round() as usize).min(20);
    let bar = format!("[{}{}]", "#".repeat(filled), ".".repeat(20 - filled));
    let eta = v.eta_s.map(|e| format!(" eta {e:.0}s")).unwrap_or_default();
    format!(
        "{bar} {pct:.1}% {}/{} units, {:.1} MiB/s{eta}, limit {} MiB/s ({} backoffs)",
        v.units_done,
        v.units_total,
        v.rate_mibps,
        v.background.rate_limit_bps >> 20,
        v.background.backoffs,
    )
}

/// One line for a rebuild status.
fn rebuild_line(v: &RebuildStatus) -> String {
    let err = v
        .error
        .as_ref()
        .map(|e| format!(": {e}"))
        .unwrap_or_default();
    format!(
        "rebuild {} device {} {}{err}: {}",
        v.pool,
        v.device,
        v.state,
        job_progress(&v.progress),
    )
}

/// One line for a scrub status, with its findings' counts.
fn scrub_line(v: &ScrubStatus) -> String {
    format!(
        "{} {} {}: {}, {} read errors, {} bytes mismatched, {} repaired{}, {} metadata findings",
        v.progress.background.class,
        v.pool,
        v.state,
        job_progress(&v.progress),
        v.read_errors,
        v.mismatched_bytes,
        v.repaired_bytes,
        if v.repair { "" } else { " (no repair)" },
        v.metadata_findings.len(),
    )
}

/// A job's state, whatever the job.
trait JobState {
    fn state(&self) -> &str;
}

impl JobState for ScrubStatus {
    fn state(&self) -> &str {
        &self.state
    }
}

impl JobState for RebuildStatus {
    fn state(&self) -> &str {
        &self.state
    }
}

/// A background job's `--stop` (DELETE), `--status` (GET) or start (POST `start`), then
/// with `--wait` its progress line until it ends; returns its last status.
fn job_call<T: DeserializeOwned + JobState, B: Serialize>(
    ep: &Endpoint,
    path: &str,
    (stop, status, wait): (bool, bool, bool),
    start: &B,
    raw: bool,
    line: fn(&T) -> String,
) -> Result<T> {
    let mut v: T = if stop {
        delete(ep, path)?
    } else if status {
        get(ep, path)?
    } else {
        send(ep, "POST", path, start)?
    };
    if wait {
        use std::io::Write as _;
        while v.state() == JOB_RUNNING {
            if !raw {
                print!("\r{}", line(&v));
                let _ = std::io::stdout().flush();
            }
            std::thread::sleep(std::time::Duration::from_millis(500));
            v = get(ep, path)?;
        }
    }
    Ok(v)
}

fn print_pool_status(v: &PoolInfo) {
    println!(
        "pool {}: {} {}, {} of {} allocated",
        v.name, v.state, v.layout, v.allocated, v.capacity,
    );
    println!(
        "  volumes provision {} ({:.1}x capacity; overcommit limit {}x)",
        v.provisioned,
        v.provisioned as f64 / v.capacity.max(1) as f64,
        v.overcommit,
    );
    for d in &v.device_states {
        println!(
            "  {} {}{}",
            d.device,
            d.state,
            d.reason
                .as_ref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        );
    }
    if !v.spares.is_empty() {
        println!("  hot spares: {}", v.spares.join(", "));
    }
    if let Some(r) = &v.rebuild {
        println!("  {}", rebuild_line(r));
    }
    if let Some(r) = &v.resync {
        println!("  {}", scrub_line(r));
    }
}

pub fn pool(ep: &Endpoint, c: PoolCmd, raw: bool) -> Result<()> {
    match c {
        PoolCmd::Create {
            name,
            devices,
            layout,
            copies,
            stripe_size,
            unit_size,
            force,
            overcommit,
        } => {
            let body = CreatePool {
                name,
                devices,
                layout: Some(layout),
                copies,
                stripe_size: stripe_size.map(SizeArg::from),
                unit_size: unit_size.map(SizeArg::from),
                force,
                overcommit,
            };
            let v: PoolInfo = send(ep, "POST", "/v1/pools", &body)?;
            let one = [PoolEntry::Online(Box::new(v))];
            show(&one[..], raw, print_pools);
        }
        PoolCmd::Update { name, overcommit } => {
            let body = UpdatePool { overcommit };
            let v: PoolInfo = send(ep, "PATCH", &format!("/v1/pools/{name}"), &body)?;
            show(&v, raw, print_pool_status);
        }
        PoolCmd::List => {
            let v: Vec<PoolEntry> = get(ep, "/v1/pools")?;
            show(&v[..], raw, print_pools);
        }
        PoolCmd::Status { name, check } => {
            let v: PoolInfo = get(ep, &format!("/v1/pools/{name}"))?;
            show(&v, raw, print_pool_status);
            if check && v.is_degraded() {
                return Err(CliError::Degraded(format!("pool {name} is {}", v.state)));
            }
        }
        PoolCmd::Destroy { name } => {
            let _: Deleted = delete(ep, &format!("/v1/pools/{name}"))?;
            println!("pool {name} destroyed");
        }
        PoolCmd::Replace {
            name,
            device,
            new_device,
            force,
        } => {
            let body = ReplaceRequest {
                device,
                with: new_device,
                force,
            };
            let v: ReplaceReply = send(ep, "POST", &format!("/v1/pools/{name}/replace"), &body)?;
            show(&v, raw, |v| {
                println!(
                    "pool {name}: device {device} ({}) replaced by {}: {}",
                    v.replaced, v.with, v.state
                )
            });
        }
        PoolCmd::Spare(c) => {
            let v: SpareList = match c {
                SpareCmd::Add {
                    name,
                    device,
                    force,
                } => send(
                    ep,
                    "POST",
                    &format!("/v1/pools/{name}/spares"),
                    &SpareRequest { device, force },
                )?,
                SpareCmd::Remove { name, device } => send(
                    ep,
                    "DELETE",
                    &format!("/v1/pools/{name}/spares"),
                    &SpareRequest {
                        device,
                        force: false,
                    },
                )?,
                SpareCmd::List { name } => get(ep, &format!("/v1/pools/{name}/spares"))?,
            };
            show(&v, raw, print_spares);
        }
        PoolCmd::Rebuild {
            name,
            device,
            force,
            status,
            stop,
            wait,
        } => {
            let path = format!("/v1/pools/{name}/rebuild");
            let start = RebuildRequest { device, force };
            let v = job_call(ep, &path, (stop, status, wait), &start, raw, rebuild_line)?;
            show(&v, raw, |v| println!("\r{}", rebuild_line(v)));
            if wait && v.state != JOB_DONE {
                return Err(CliError::Failed(format!(
                    "rebuild of pool {name} ended {}",
                    v.state
                )));
            }
        }
        PoolCmd::Scrub {
            name,
            no_repair,
            status,
            stop,
            wait,
        } => {
            let path = format!("/v1/pools/{name}/scrub");
            let start = ScrubRequest { repair: !no_repair };
            let v = job_call(ep, &path, (stop, status, wait), &start, raw, scrub_line)?;
            show(&v, raw, |v| {
                println!("\r{}", scrub_line(v));
                for e in v.metadata_findings.iter().chain(&v.errors) {
                    println!("  {e}");
                }
            });
        }
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum VolumeCmd {
    /// Create a thin volume (no space is taken until it is written).
    Create {
        name: String,
        #[arg(long)]
        pool: String,
        /// Size, e.g. 10G (a multiple of 512 bytes).
        #[arg(long)]
        size: String,
        /// Create it even if the pool's volumes then exceed its overcommit ratio.
        #[arg(long)]
        force: bool,
    },
    /// List the volumes of every pool.
    List,
    /// Grow a volume (shrinking is refused).
    Resize {
        name: String,
        #[arg(long)]
        size: String,
        /// Grow it even if the pool's volumes then exceed its overcommit ratio.
        #[arg(long)]
        force: bool,
    },
    /// Delete a volume and free its space (refused while exported or connected).
    Delete { name: String },
    /// Show or set a volume's QoS limits, share weight and reads-first (live,
    /// persistent). Setting replaces every control; `--clear` removes them all.
    Qos {
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
        /// Share weight when volumes compete for a saturated core (1-10000, default 100).
        #[arg(long)]
        weight: Option<u32>,
        /// Serve this volume's reads before its writes when its core is saturated.
        #[arg(long)]
        reads_first: bool,
        #[arg(long)]
        clear: bool,
    },
    /// Client I/O of a volume: IOPS, bandwidth and latency over an interval.
    Stats {
        name: String,
        /// Sampling interval in seconds.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
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
        VolumeCmd::Create {
            name,
            pool,
            size,
            force,
        } => {
            let body = CreateVolume {
                name,
                pool,
                size: size.into(),
                force,
            };
            let v: VolumeInfo = send(ep, "POST", "/v1/volumes", &body)?;
            show(&[v][..], raw, print_volumes);
        }
        VolumeCmd::List => {
            let v: Vec<VolumeInfo> = get(ep, "/v1/volumes")?;
            show(&v[..], raw, print_volumes);
        }
        VolumeCmd::Resize { name, size, force } => {
            let body = ResizeVolume {
                size: size.into(),
                force,
            };
            let v: VolumeInfo = send(ep, "PATCH", &format!("/v1/volumes/{name}"), &body)?;
            show(&[v][..], raw, print_volumes);
        }
        VolumeCmd::Delete { name } => {
            let _: Deleted = delete(ep, &format!("/v1/volumes/{name}"))?;
            println!("volume {name} deleted");
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
        VolumeCmd::Stats { name, interval } => {
            let ms = (interval * 1000.0).round().clamp(1.0, 60_000.0) as u64;
            let v: VolumeStats = get(ep, &format!("/v1/volumes/{name}/stats?interval_ms={ms}"))?;
            show(&v, raw, print_stats);
        }
    }
    Ok(())
}

#[derive(Subcommand)]
pub enum ExportCmd {
    /// Export a volume over NBD under NAME.
    Add {
        name: String,
        #[arg(long)]
        volume: String,
        #[arg(long)]
        read_only: bool,
    },
    /// List the exports and their URIs.
    List,
    /// Stop exporting (open connections keep their volume until they disconnect).
    Remove { name: String },
}

pub fn export(ep: &Endpoint, c: ExportCmd, raw: bool) -> Result<()> {
    match c {
        ExportCmd::Add {
            name,
            volume,
            read_only,
        } => {
            let body = CreateExport {
                name,
                volume,
                read_only,
            };
            let v: ExportInfo = send(ep, "POST", "/v1/exports", &body)?;
            show(&[v][..], raw, print_exports);
        }
        ExportCmd::List => {
            let v: Vec<ExportInfo> = get(ep, "/v1/exports")?;
            show(&v[..], raw, print_exports);
        }
        ExportCmd::Remove { name } => {
            let _: Deleted = delete(ep, &format!("/v1/exports/{name}"))?;
            println!("export {name} removed");
        }
    }
    Ok(())
}

/// The rate and burst flags shared by volume and group QoS commands.
#[derive(clap::Args, Debug, Default)]
pub struct LimitArgs {
    #[arg(long)]
    iops: Option<u64>,
    #[arg(long)]
    read_iops: Option<u64>,
    #[arg(long)]
    write_iops: Option<u64>,
    /// Bandwidth limit, e.g. 100M (bytes per second).
    #[arg(long)]
    bw: Option<String>,
    #[arg(long)]
    read_bw: Option<String>,
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
        let size = |v: &Option<String>| -> Result<Option<u64>> {
            v.as_deref()
                .map(|x| {
                    tessera_device::parse_size(x).map_err(|e| CliError::Invalid(e.to_string()))
                })
                .transpose()
        };
        Ok(QosLimits {
            iops: self.iops,
            read_iops: self.read_iops,
            write_iops: self.write_iops,
            bps: size(&self.bw)?,
            read_bps: size(&self.read_bw)?,
            write_bps: size(&self.write_bw)?,
            burst_ms: self.burst_ms,
            one_time_burst_ms: self.one_time_burst_ms,
            weight: None,
            reads_first: false,
        })
    }
}

/// `k=v` for every control set in QoS limits, or "unlimited".
fn limits_line(l: &QosLimits) -> String {
    let mut set: Vec<String> = [
        ("iops", l.iops),
        ("read_iops", l.read_iops),
        ("write_iops", l.write_iops),
        ("bps", l.bps),
        ("read_bps", l.read_bps),
        ("write_bps", l.write_bps),
        ("burst_ms", l.burst_ms),
        ("one_time_burst_ms", l.one_time_burst_ms),
        ("weight", l.weight.map(u64::from)),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
    .collect();
    if l.reads_first {
        set.push("reads_first=true".into());
    }
    if set.is_empty() {
        "unlimited".to_string()
    } else {
        set.join(" ")
    }
}

#[derive(Subcommand, Debug)]
pub enum GroupCmd {
    /// Create a QoS group (tenant) or replace its limits: its member volumes share them.
    Set {
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
    },
    /// List the groups.
    List,
    /// Show one group: limits, members, stepped-burst level.
    Show { name: String },
    /// Delete a group; its volumes keep only their own limits.
    Delete { name: String },
    /// Put a volume in a group (it leaves any other).
    Add { name: String, volume: String },
    /// Take a volume out of a group.
    Remove { name: String, volume: String },
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
        GroupCmd::Set {
            name,
            limits,
            step_pct,
            max_steps,
            step_ms,
            credit_ms,
        } => {
            let step = step_pct
                .zip(max_steps)
                .map(|(step_pct, max_steps)| StepBurst {
                    step_pct,
                    max_steps,
                    step_ms,
                    credit_ms,
                });
            let body = PutGroup {
                limits: limits.to_limits()?,
                step,
            };
            send(ep, "PUT", &format!("/v1/groups/{name}"), &body)?
        }
        GroupCmd::List => {
            let v: Vec<GroupInfo> = get(ep, "/v1/groups")?;
            show(&v[..], raw, print_groups);
            return Ok(());
        }
        GroupCmd::Show { name } => get(ep, &format!("/v1/groups/{name}"))?,
        GroupCmd::Delete { name } => {
            let _: Deleted = delete(ep, &format!("/v1/groups/{name}"))?;
            println!("group {name} deleted");
            return Ok(());
        }
        GroupCmd::Add { name, volume } => exchange(
            ep,
            "PUT",
            &format!("/v1/groups/{name}/members/{volume}"),
            None,
        )?,
        GroupCmd::Remove { name, volume } => {
            delete(ep, &format!("/v1/groups/{name}/members/{volume}"))?
        }
    };
    show(&[v][..], raw, print_groups);
    Ok(())
}

#[derive(Subcommand, Debug)]
pub enum BackgroundCmd {
    /// Show every background class's limits.
    Show,
    /// Set a class's limits (scrub, rebuild, resync); persistent.
    Set {
        class: String,
        /// Maximum bandwidth, e.g. 200M (bytes per second).
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
    Reset { class: String },
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
            let bps = tessera_device::parse_size(&bw)
                .map_err(|e| CliError::Invalid(format!("--bw: {e}")))?;
            let body = BackgroundLimits {
                bps,
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
                "background {class}: {} MiB/s max, backs off above {target}, floor {}%",
                l.bps >> 20,
                l.min_pct
            );
        }
    });
    Ok(())
}
