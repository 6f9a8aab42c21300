//! Management subcommands: thin clients of the node's HTTP/JSON API.

use clap::Subcommand;
use serde_json::{json, Value};

use tessera_http::{request, Endpoint};

pub fn endpoint(arg: Option<&str>) -> Endpoint {
    let s = arg
        .map(str::to_string)
        .or_else(|| std::env::var("TESSERA_API").ok())
        .unwrap_or_else(|| "tessera-data/api.sock".into());
    Endpoint::parse(&s)
}

pub(crate) fn call(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Result<Value, String> {
    let (status, text) = request(ep, method, path, body.as_ref()).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    if (200..300).contains(&status) {
        Ok(v)
    } else {
        Err(v["error"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("the node answered HTTP {status}")))
    }
}

fn size(v: &Value) -> String {
    v.as_u64().map(human).unwrap_or_else(|| "-".into())
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

fn s(v: &Value) -> String {
    match v {
        Value::String(x) => x.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

pub fn status(ep: &Endpoint, raw: bool) -> Result<(), String> {
    let v = call(ep, "GET", "/v1/status", None)?;
    if raw {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    println!(
        "Tessera {} — up {}s on {} core(s)",
        s(&v["version"]),
        v["uptime_seconds"],
        v["cores"]
    );
    println!(
        "capacity {}  allocated {}  free {}",
        size(&v["capacity"]),
        size(&v["allocated"]),
        size(&v["free"])
    );
    println!(
        "NBD: {}",
        v["nbd"]
            .as_array()
            .map(|a| a.iter().map(s).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    );
    println!();
    print_pools(&v["pools"]);
    println!();
    print_exports(&v["exports"]);
    Ok(())
}

fn print_pools(v: &Value) {
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
    for p in v.as_array().into_iter().flatten() {
        let devs = p["device_states"]
            .as_array()
            .map(|d| {
                d.iter()
                    .map(|x| {
                        if x["state"] == "failed" {
                            format!("{}(FAILED: {})", s(&x["device"]), s(&x["reason"]))
                        } else {
                            s(&x["device"])
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .or_else(|| {
                p["devices"]
                    .as_array()
                    .map(|d| d.iter().map(s).collect::<Vec<_>>().join(","))
            })
            .unwrap_or_else(|| s(&p["error"]));
        rows.push(vec![
            s(&p["name"]),
            s(&p["state"]),
            s(&p["layout"]),
            size(&p["capacity"]),
            size(&p["allocated"]),
            size(&p["free"]),
            s(&p["volumes"]),
            devs,
        ]);
    }
    table(rows);
}

fn print_volumes(v: &Value) {
    let mut rows = vec![vec![
        "VOLUME".into(),
        "POOL".into(),
        "SIZE".into(),
        "ALLOCATED".into(),
        "EXPORTS".into(),
        "CONNECTIONS".into(),
    ]];
    for x in v.as_array().into_iter().flatten() {
        let ex = x["exports"]
            .as_array()
            .map(|d| d.iter().map(s).collect::<Vec<_>>().join(","))
            .unwrap_or_default();
        rows.push(vec![
            s(&x["name"]),
            s(&x["pool"]),
            size(&x["size"]),
            size(&x["allocated"]),
            if ex.is_empty() { "-".into() } else { ex },
            s(&x["connections"]),
        ]);
    }
    table(rows);
}

fn print_exports(v: &Value) {
    let mut rows = vec![vec![
        "EXPORT".into(),
        "VOLUME".into(),
        "MODE".into(),
        "SIZE".into(),
        "CONNECTIONS".into(),
        "URI".into(),
    ]];
    for x in v.as_array().into_iter().flatten() {
        let mode = if x["read_only"].as_bool() == Some(true) {
            "ro"
        } else {
            "rw"
        };
        let uri = x["uris"]
            .as_array()
            .and_then(|a| a.first())
            .map(s)
            .unwrap_or_else(|| "-".into());
        rows.push(vec![
            s(&x["name"]),
            s(&x["volume"]),
            mode.into(),
            size(&x["size"]),
            s(&x["connections"]),
            uri,
        ]);
    }
    table(rows);
}

fn show(v: &Value, raw: bool, f: fn(&Value)) {
    if raw {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        f(v)
    }
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
    },
    List,
    /// A pool's state, and its rebuild and resync (after an unclean shutdown) if any.
    Status {
        name: String,
    },
    /// Destroy an empty pool and wipe its device labels.
    Destroy {
        name: String,
    },
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
    Add { name: String, device: String },
    /// Remove a hot spare.
    Remove { name: String, device: String },
    /// List a pool's hot spares (in the order they are used).
    List { name: String },
}

fn print_spares(v: &Value) {
    let spares = v["spares"].as_array().cloned().unwrap_or_default();
    if spares.is_empty() {
        println!("pool {}: no hot spares", v["pool"].as_str().unwrap_or("?"));
    }
    for s in spares {
        println!("{}", s.as_str().unwrap_or("?"));
    }
}

/// The part of a background job's status line that scrub and rebuild share: a progress
/// bar, units, rate, ETA and the class controller's limit.
fn job_progress(v: &Value) -> String {
    let pct = v["percent"].as_f64().unwrap_or(0.0);
    let filled = ((pct / 5.0).round() as usize).min(20);
    let bar = format!("[{}{}]", "#".repeat(filled), ".".repeat(20 - filled));
    let eta = v["eta_s"]
        .as_f64()
        .map(|e| format!(" eta {e:.0}s"))
        .unwrap_or_default();
    format!(
        "{bar} {pct:.1}% {}/{} units, {} MiB/s{eta}, limit {} MiB/s ({} backoffs)",
        v["units_done"],
        v["units_total"],
        v["rate_mibps"],
        v["background"]["rate_limit_bps"].as_u64().unwrap_or(0) >> 20,
        v["background"]["backoffs"],
    )
}

/// One line for a rebuild status.
fn rebuild_line(v: &Value) -> String {
    let err = v["error"]
        .as_str()
        .map(|e| format!(": {e}"))
        .unwrap_or_default();
    format!(
        "rebuild {} device {} {}{err}: {}",
        v["pool"].as_str().unwrap_or("?"),
        v["device"],
        v["state"].as_str().unwrap_or("?"),
        job_progress(v),
    )
}

/// One line for a scrub status, with its findings' counts.
fn scrub_line(v: &Value) -> String {
    format!(
        "{} {} {}: {}, {} read errors, {} bytes mismatched, {} repaired{}, {} metadata findings",
        v["background"]["class"].as_str().unwrap_or("scrub"),
        v["pool"].as_str().unwrap_or("?"),
        v["state"].as_str().unwrap_or("?"),
        job_progress(v),
        v["read_errors"],
        v["mismatched_bytes"],
        v["repaired_bytes"],
        if v["repair"] == false {
            " (no repair)"
        } else {
            ""
        },
        v["metadata_findings"].as_array().map_or(0, Vec::len),
    )
}

/// Follow a running job at `path` with a progress line until it ends; returns its last
/// status.
/// A background job's `--stop` (DELETE), `--status` (GET) or start (POST `start`), then
/// with `--wait` its progress line until it ends.
fn job_call(
    ep: &Endpoint,
    path: &str,
    (stop, status, wait): (bool, bool, bool),
    start: Value,
    raw: bool,
    line: fn(&Value) -> String,
) -> Result<Value, String> {
    let v = if stop {
        call(ep, "DELETE", path, None)?
    } else if status {
        call(ep, "GET", path, None)?
    } else {
        call(ep, "POST", path, Some(start))?
    };
    if wait {
        follow_job(ep, path, v, raw, line)
    } else {
        Ok(v)
    }
}

fn follow_job(
    ep: &Endpoint,
    path: &str,
    mut v: Value,
    raw: bool,
    line: fn(&Value) -> String,
) -> Result<Value, String> {
    use std::io::Write as _;
    while v["state"] == "running" {
        if !raw {
            print!("\r{}", line(&v));
            let _ = std::io::stdout().flush();
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        v = call(ep, "GET", path, None)?;
    }
    Ok(v)
}

pub fn pool(ep: &Endpoint, c: PoolCmd, raw: bool) -> Result<(), String> {
    match c {
        PoolCmd::Create {
            name,
            devices,
            layout,
            copies,
            stripe_size,
            unit_size,
            force,
        } => {
            let v = call(
                ep,
                "POST",
                "/v1/pools",
                Some(
                    json!({"name": name, "devices": devices, "layout": layout, "copies": copies, "stripe_size": stripe_size, "unit_size": unit_size, "force": force}),
                ),
            )?;
            show(&Value::Array(vec![v]), raw, print_pools);
        }
        PoolCmd::List => show(&call(ep, "GET", "/v1/pools", None)?, raw, print_pools),
        PoolCmd::Status { name } => {
            let v = call(ep, "GET", &format!("/v1/pools/{name}"), None)?;
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!(
                    "pool {name}: {} {}, {} of {} allocated",
                    v["state"].as_str().unwrap_or("?"),
                    v["layout"].as_str().unwrap_or("?"),
                    v["allocated"],
                    v["capacity"],
                );
                for d in v["device_states"].as_array().into_iter().flatten() {
                    println!(
                        "  {} {}{}",
                        d["device"].as_str().unwrap_or("?"),
                        d["state"].as_str().unwrap_or("?"),
                        d["reason"]
                            .as_str()
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default()
                    );
                }
                if let Some(sp) = v["spares"].as_array().filter(|s| !s.is_empty()) {
                    let sp: Vec<&str> = sp.iter().filter_map(Value::as_str).collect();
                    println!("  hot spares: {}", sp.join(", "));
                }
                if v.get("rebuild").is_some() {
                    println!("  {}", rebuild_line(&v["rebuild"]));
                }
                if v.get("resync").is_some() {
                    println!("  {}", scrub_line(&v["resync"]));
                }
            }
        }
        PoolCmd::Destroy { name } => {
            call(ep, "DELETE", &format!("/v1/pools/{name}"), None)?;
            println!("pool {name} destroyed");
        }
        PoolCmd::Replace {
            name,
            device,
            new_device,
        } => {
            let v = call(
                ep,
                "POST",
                &format!("/v1/pools/{name}/replace"),
                Some(json!({"device": device, "with": new_device})),
            )?;
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!(
                    "pool {name}: device {device} ({}) replaced by {}: {}",
                    v["replaced"].as_str().unwrap_or("?"),
                    v["with"].as_str().unwrap_or("?"),
                    v["state"].as_str().unwrap_or("?")
                );
            }
        }
        PoolCmd::Spare(c) => {
            let v = match c {
                SpareCmd::Add { name, device } => call(
                    ep,
                    "POST",
                    &format!("/v1/pools/{name}/spares"),
                    Some(json!({ "device": device })),
                )?,
                SpareCmd::Remove { name, device } => call(
                    ep,
                    "DELETE",
                    &format!("/v1/pools/{name}/spares"),
                    Some(json!({ "device": device })),
                )?,
                SpareCmd::List { name } => {
                    call(ep, "GET", &format!("/v1/pools/{name}/spares"), None)?
                }
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
            let start = json!({ "device": device, "force": force });
            let v = job_call(ep, &path, (stop, status, wait), start, raw, rebuild_line)?;
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("\r{}", rebuild_line(&v));
            }
            if wait && v["state"] != "done" {
                return Err(format!("rebuild of pool {name} ended {}", v["state"]));
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
            let start = json!({ "repair": !no_repair });
            let v = job_call(ep, &path, (stop, status, wait), start, raw, scrub_line)?;
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("\r{}", scrub_line(&v));
                for e in v["metadata_findings"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .chain(v["errors"].as_array().into_iter().flatten())
                {
                    println!("  {}", e.as_str().unwrap_or_default());
                }
            }
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
    },
    List,
    /// Grow a volume (shrinking is refused).
    Resize {
        name: String,
        #[arg(long)]
        size: String,
    },
    /// Delete a volume and free its space (refused while exported or connected).
    Delete {
        name: String,
    },
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

pub fn volume(ep: &Endpoint, c: VolumeCmd, raw: bool) -> Result<(), String> {
    match c {
        VolumeCmd::Create { name, pool, size } => {
            let v = call(
                ep,
                "POST",
                "/v1/volumes",
                Some(json!({"name": name, "pool": pool, "size": size})),
            )?;
            show(&Value::Array(vec![v]), raw, print_volumes);
        }
        VolumeCmd::List => show(&call(ep, "GET", "/v1/volumes", None)?, raw, print_volumes),
        VolumeCmd::Resize { name, size } => {
            let v = call(
                ep,
                "PATCH",
                &format!("/v1/volumes/{name}"),
                Some(json!({"size": size})),
            )?;
            show(&Value::Array(vec![v]), raw, print_volumes);
        }
        VolumeCmd::Delete { name } => {
            call(ep, "DELETE", &format!("/v1/volumes/{name}"), None)?;
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
            let v = if clear {
                call(ep, "DELETE", &path, None)?
            } else if limits.any() || weight.is_some() || reads_first {
                let mut body = limits.to_json()?;
                body["weight"] = json!(weight);
                body["reads_first"] = json!(reads_first);
                call(ep, "PUT", &path, Some(body))?
            } else {
                call(ep, "GET", &path, None)?
            };
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("volume {name} qos: {}", limits_line(&v));
            }
        }
        VolumeCmd::Stats { name, interval } => {
            let ms = (interval * 1000.0).round().clamp(1.0, 60_000.0) as u64;
            let v = call(
                ep,
                "GET",
                &format!("/v1/volumes/{name}/stats?interval_ms={ms}"),
                None,
            )?;
            if raw {
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
                let l = |k: &str| v["latency_us"][k].as_f64().unwrap_or(0.0);
                println!("volume {name} over {ms} ms:");
                println!(
                    "  read   {:>10.0} IOPS {:>9.1} MiB/s",
                    f("read_iops"),
                    f("read_mibps")
                );
                println!(
                    "  write  {:>10.0} IOPS {:>9.1} MiB/s",
                    f("write_iops"),
                    f("write_mibps")
                );
                println!("  other  {:>10.0} IOPS", f("other_iops"));
                println!(
                    "  latency mean {:.1} us, p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us",
                    l("mean"),
                    l("p50"),
                    l("p99"),
                    l("p999")
                );
                println!("  errors {}", v["errors"]);
            }
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
    List,
    /// Stop exporting (open connections keep their volume until they disconnect).
    Remove {
        name: String,
    },
}

pub fn export(ep: &Endpoint, c: ExportCmd, raw: bool) -> Result<(), String> {
    match c {
        ExportCmd::Add {
            name,
            volume,
            read_only,
        } => {
            let v = call(
                ep,
                "POST",
                "/v1/exports",
                Some(json!({"name": name, "volume": volume, "read_only": read_only})),
            )?;
            show(&Value::Array(vec![v]), raw, print_exports);
        }
        ExportCmd::List => show(&call(ep, "GET", "/v1/exports", None)?, raw, print_exports),
        ExportCmd::Remove { name } => {
            call(ep, "DELETE", &format!("/v1/exports/{name}"), None)?;
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

    /// The API's QoS limits object.
    fn to_json(&self) -> Result<Value, String> {
        let size = |v: &Option<String>| -> Result<Option<u64>, String> {
            v.as_deref()
                .map(|x| tessera_device::parse_size(x).map_err(|e| e.to_string()))
                .transpose()
        };
        Ok(json!({
            "iops": self.iops, "read_iops": self.read_iops, "write_iops": self.write_iops,
            "bps": size(&self.bw)?, "read_bps": size(&self.read_bw)?, "write_bps": size(&self.write_bw)?,
            "burst_ms": self.burst_ms, "one_time_burst_ms": self.one_time_burst_ms,
        }))
    }
}

/// `k=v` for every control set in a QoS limits object, or "unlimited".
fn limits_line(v: &Value) -> String {
    let set: Vec<String> = v
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, x)| !x.is_null())
        .map(|(k, x)| format!("{k}={x}"))
        .collect();
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
    List,
    Show {
        name: String,
    },
    /// Delete a group; its volumes keep only their own limits.
    Delete {
        name: String,
    },
    /// Put a volume in a group (it leaves any other).
    Add {
        name: String,
        volume: String,
    },
    /// Take a volume out of a group.
    Remove {
        name: String,
        volume: String,
    },
}

fn print_groups(v: &Value) {
    for g in v.as_array().into_iter().flatten() {
        let members: Vec<&str> = g["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let mut line = format!(
            "group {}: {} members [{}]",
            g["name"].as_str().unwrap_or("?"),
            limits_line(&g["limits"]),
            members.join(", ")
        );
        if let Value::Object(st) = &g["step"] {
            line += &format!(
                " step +{}% x{} every {} ms, level {}, credits {} ms, now {}",
                st["step_pct"],
                st["max_steps"],
                st["step_ms"],
                g["level"],
                g["credits_ms"],
                limits_line(&g["effective"])
            );
        }
        println!("{line}");
    }
}

pub fn group(ep: &Endpoint, c: GroupCmd, raw: bool) -> Result<(), String> {
    let one = |v: Value| Value::Array(vec![v]);
    match c {
        GroupCmd::Set {
            name,
            limits,
            step_pct,
            max_steps,
            step_ms,
            credit_ms,
        } => {
            let step = step_pct.zip(max_steps).map(|(p, m)| {
                json!({"step_pct": p, "max_steps": m, "step_ms": step_ms, "credit_ms": credit_ms})
            });
            let body = json!({"limits": limits.to_json()?, "step": step});
            let v = call(ep, "PUT", &format!("/v1/groups/{name}"), Some(body))?;
            show(&one(v), raw, print_groups);
        }
        GroupCmd::List => show(&call(ep, "GET", "/v1/groups", None)?, raw, print_groups),
        GroupCmd::Show { name } => {
            let v = call(ep, "GET", &format!("/v1/groups/{name}"), None)?;
            show(&one(v), raw, print_groups);
        }
        GroupCmd::Delete { name } => {
            call(ep, "DELETE", &format!("/v1/groups/{name}"), None)?;
            println!("group {name} deleted");
        }
        GroupCmd::Add { name, volume } => {
            let v = call(
                ep,
                "PUT",
                &format!("/v1/groups/{name}/members/{volume}"),
                None,
            )?;
            show(&one(v), raw, print_groups);
        }
        GroupCmd::Remove { name, volume } => {
            let v = call(
                ep,
                "DELETE",
                &format!("/v1/groups/{name}/members/{volume}"),
                None,
            )?;
            show(&one(v), raw, print_groups);
        }
    }
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

pub fn background(ep: &Endpoint, c: BackgroundCmd, raw: bool) -> Result<(), String> {
    let v = match c {
        BackgroundCmd::Show => call(ep, "GET", "/v1/background", None)?,
        BackgroundCmd::Set {
            class,
            bw,
            latency_target_us,
            min_pct,
        } => {
            let bps = tessera_device::parse_size(&bw).map_err(|e| e.to_string())?;
            let body =
                json!({"bps": bps, "latency_target_us": latency_target_us, "min_pct": min_pct});
            let v = call(ep, "PUT", &format!("/v1/background/{class}"), Some(body))?;
            json!({ class: v })
        }
        BackgroundCmd::Reset { class } => {
            let v = call(ep, "DELETE", &format!("/v1/background/{class}"), None)?;
            json!({ class: v })
        }
    };
    if raw {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    for (class, l) in v.as_object().into_iter().flatten() {
        let target = l["latency_target_us"]
            .as_u64()
            .map_or("1.5x clients' p99 at start".to_string(), |t| {
                format!("{t} µs")
            });
        println!(
            "background {class}: {} MiB/s max, backs off above {target}, floor {}%",
            l["bps"].as_u64().unwrap_or(0) >> 20,
            l["min_pct"]
        );
    }
    Ok(())
}
