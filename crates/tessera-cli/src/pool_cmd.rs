//! `tessera pool`: pools, their hot spares, and their background jobs (scrub, rebuild,
//! resync) as `start` / `status` / `stop` subcommands.

use clap::{Args, Subcommand};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tessera_api::{
    CacheInfo, CacheModeRequest, CacheRequest, CreatePool, Deleted, JobProgress, JobState,
    LayoutSpec, PoolEntry, PoolInfo, RebuildRequest, RebuildStatus, ReplaceReply, ReplaceRequest,
    ScrubRequest, ScrubStatus, SizeArg, SpareList, SpareRequest, UpdatePool, JOB_DONE, JOB_RUNNING,
};
use tessera_http::Endpoint;
use tessera_io::cast::{u64_of_f64, usize_of};

use crate::error::{CliError, Result};
use crate::format::{bytes, rate};
use crate::manage::{delete, deleted, get, print_pools, send, show};
use crate::progress::Bar;

/// The pool a command acts on.
#[derive(Args, Debug)]
pub struct PoolName {
    /// Name of the pool.
    pub name: String,
}

#[derive(Args, Debug)]
pub struct PoolCreateArgs {
    /// Name of the new pool (unique on the node).
    name: String,
    /// Devices: /path (existing file or block device), /path:SIZE (file created if
    /// missing), ram:SIZE, null:SIZE, or fault:INNER;key=value...
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
    /// raid5/raid6/ec (power of two, 4K..256K). Default 64K. Refused for concat and
    /// raid1, which do not stripe.
    #[arg(long)]
    stripe_size: Option<String>,
    /// Thin allocation unit (power of two, 64K..1G; default 1M).
    #[arg(long)]
    unit_size: Option<String>,
    /// Overwrite devices that carry another pool's label.
    #[arg(long)]
    force: bool,
    /// Overcommit ratio: the volumes' virtual sizes may add up to this many times the
    /// pool's capacity (default 20; `volume create --force` goes beyond).
    #[arg(long)]
    overcommit: Option<f64>,
    /// A cache tier on faster devices: one device, or two (comma separated) that
    /// mirror each other.
    #[arg(long, value_delimiter = ',')]
    cache: Vec<String>,
    /// The cache's mode: write-through (default), write-around, pass-through or write-back.
    #[arg(long)]
    cache_mode: Option<String>,
    /// The cache unit: a power of two from 16K to 1M (default 1M). Smaller units keep
    /// scattered hot blocks in less cache, at more RAM per GiB of cache.
    #[arg(long)]
    cache_unit: Option<String>,
    /// Misses a unit needs before a full cache admits it (default 1: the first); 2 or
    /// 3 keep units read once out of a full cache.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..))]
    cache_admit_hits: Option<u8>,
    /// Deduplicate: identical 4 KiB blocks of the pool's volumes are stored once
    /// (concat, raid0, raid1, raid10; 1M units; no cache tier). The pool is the dedup
    /// domain: a tenant can learn by timing whether a block exists in another tenant's
    /// volume of the same pool, so give tenants who must not learn that their own pool.
    #[arg(long)]
    dedup: bool,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("change").required(true).multiple(true)
    .args(["overcommit", "dedup"])))]
pub struct PoolUpdateArgs {
    /// Name of the pool.
    name: String,
    /// Overcommit ratio: the volumes' virtual sizes may add up to this many times the
    /// pool's capacity (above 0; volumes already beyond it stay).
    #[arg(long)]
    overcommit: Option<f64>,
    /// Deduplication: `on` looks new writes up and makes new volumes dedup volumes (the
    /// first time it takes the fingerprint index's space, 0.6% of the capacity); `off`
    /// stores new writes without a lookup and makes new volumes plain, and keeps what
    /// is shared shared.
    #[arg(long, value_parser = ["on", "off"])]
    dedup: Option<String>,
}

/// `pool show` (`pool status`).
#[derive(Args, Debug)]
pub struct PoolShowArgs {
    /// Name of the pool.
    name: String,
    /// Exit with code 7 when the pool is degraded or failed. Without it a degraded pool
    /// still exits 0: `pool show` answered the question it was asked, and monitoring
    /// that collects `--json` should not treat a readable status as a failed command.
    #[arg(long)]
    check: bool,
}

#[derive(Args, Debug)]
pub struct ReplaceArgs {
    /// Name of the pool.
    name: String,
    /// Index of the failed device to replace (as `pool show` lists them, from 0).
    #[arg(long)]
    device: usize,
    /// The new device's spec (same size or larger; not ram/null), as the API's `with`.
    #[arg(
        long = "with",
        value_name = "DEVICE",
        required_unless_present = "new_device"
    )]
    with: Option<String>,
    /// Old spelling: the new device as a positional argument.
    #[arg(hide = true, conflicts_with = "with")]
    new_device: Option<String>,
    /// Take a device that carries another pool's label (its label is wiped).
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// Create a pool on devices.
    Create(PoolCreateArgs),
    /// List the pools (with those the node could not open).
    List,
    /// A pool's state, its devices, and its rebuild and resync (after an unclean
    /// shutdown) if any.
    #[command(visible_alias = "status")]
    Show(PoolShowArgs),
    /// Change a pool's settings (live and persistent).
    Update(PoolUpdateArgs),
    /// Delete an empty pool and wipe its device labels.
    #[command(alias = "destroy")]
    Delete(PoolName),
    /// Put a new device in place of failed device --device of a redundant pool, live:
    /// the rebuild onto it starts at once (follow it with `pool rebuild status NAME
    /// --wait`). Recorded in pools.json, so a restart keeps it (and resumes an
    /// unfinished rebuild).
    Replace(ReplaceArgs),
    /// Hot spares of a redundant pool: when a device fails, the node puts the first
    /// spare in its place and rebuilds onto it by itself.
    #[command(subcommand)]
    Spare(SpareCmd),
    /// A pool's cache tier on faster devices: reads (and, in write-through, writes) of
    /// data that is not streamed are kept there in 1 MiB units.
    #[command(subcommand)]
    Cache(CacheCmd),
    /// Scrub a pool: re-read every allocated unit and the metadata in the background
    /// (scrub class limits, backing off when client latency rises); on a mirror, compare
    /// the copies and rewrite those that differ from the first readable copy.
    Scrub(ScrubCmd),
    /// Rebuild a failed device of a redundant pool in place (a device that came back, or
    /// a blank one at the same path): every allocated unit is copied from a mirror or
    /// reconstructed from the other devices of a parity pool, in the background (rebuild
    /// class limits).
    Rebuild(RebuildCmd),
    /// The resync a redundant pool runs by itself after an unclean shutdown.
    #[command(subcommand)]
    Resync(ResyncCmd),
}

/// A hot spare joining or leaving a pool.
#[derive(Args, Debug)]
pub struct SpareMember {
    /// Name of the pool.
    name: String,
    /// The spare's device spec, as `pool create` takes it.
    device: String,
}

/// A hot spare joining a pool.
#[derive(Args, Debug)]
pub struct SpareAddArgs {
    #[command(flatten)]
    member: SpareMember,
    /// Take a device that carries another pool's label, and wipe that label now.
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand, Debug)]
pub enum SpareCmd {
    /// Add a hot spare (at least as large as the pool's devices, not ram/null). It is
    /// not written until it replaces a device.
    Add(SpareAddArgs),
    /// Remove a hot spare.
    Remove(SpareMember),
    /// List a pool's hot spares (in the order they are used).
    List(PoolName),
}

#[derive(Args, Debug)]
pub struct CacheAddArgs {
    /// Name of the pool.
    name: String,
    /// One device, or two that mirror each other.
    #[arg(required = true, num_args = 1..=2)]
    devices: Vec<String>,
    /// write-through (default), write-around, pass-through or write-back.
    #[arg(long)]
    mode: Option<String>,
    /// Take devices that carry another pool's cache label; allow write-back on one
    /// device.
    #[arg(long)]
    force: bool,
    /// The cache unit: a power of two from 16K to 1M (default 1M). Smaller units keep
    /// scattered hot blocks in less cache, at more RAM per GiB of cache.
    #[arg(long)]
    unit: Option<String>,
    /// Misses a unit needs before a full cache admits it (default 1: the first); 2 or
    /// 3 keep units read once out of a full cache.
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..))]
    admit_hits: Option<u8>,
}

#[derive(Args, Debug)]
pub struct CacheModeArgs {
    /// Name of the pool.
    name: String,
    /// write-through, write-around, pass-through or write-back. Out of write-back the
    /// dirty data drains first (`pool cache show` says "draining" and how much is left).
    mode: String,
    /// Write-back on one cache device (if it fails, the writes only it holds are lost).
    #[arg(long)]
    force: bool,
}

#[derive(Args, Debug)]
pub struct CacheRemoveArgs {
    /// Name of the pool.
    name: String,
    /// Give up a write-back cache that cannot be opened (what only it held is lost).
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand, Debug)]
pub enum CacheCmd {
    /// Give a pool a cache tier (it starts empty).
    Add(CacheAddArgs),
    /// Remove a pool's cache tier: the pool goes on uncached, nothing is lost (a
    /// write-back cache must be switched to write-through and drained first).
    Remove(CacheRemoveArgs),
    /// The cache's mode, state, hit ratios and counters.
    Show(PoolName),
    /// Switch the cache's mode online.
    Mode(CacheModeArgs),
}

fn print_cache(c: &CacheInfo) {
    println!(
        "pool {}: cache {} ({}), {} in units of {} on {}",
        c.pool,
        c.mode,
        c.state,
        bytes(c.capacity),
        bytes(c.unit_size),
        c.devices.join(", ")
    );
    println!(
        "  reads:  {:.1}% hits ({} hits, {} misses; {} from the cache)",
        100.0 * c.read_hit_ratio,
        c.read_hits,
        c.read_misses,
        bytes(c.read_hit_bytes)
    );
    println!(
        "  writes: {:.1}% to cached units ({} of {})",
        100.0 * c.write_hit_ratio,
        c.write_hits,
        c.write_hits + c.write_misses
    );
    println!(
        "  {} units cached ({} valid, {} dirty); {} promotions, {} evictions, {} filled",
        c.cached_units,
        bytes(c.valid_bytes),
        bytes(c.dirty_bytes),
        c.promotions,
        c.evictions,
        bytes(c.fill_bytes)
    );
    if c.admit_hits > 1 {
        println!(
            "  a full cache admits a unit at its miss number {}",
            c.admit_hits
        );
    }
    if c.mode == "write-back" || c.dirty_bytes > 0 || c.cleaned_bytes > 0 {
        println!(
            "  write-back: {} dirty, {} cleaned to the pool's devices",
            bytes(c.dirty_bytes),
            bytes(c.cleaned_bytes)
        );
    }
    println!(
        "  {} of sequential I/O bypassed, {} read ahead; {} errors; index {} of RAM",
        bytes(c.bypassed_bytes),
        bytes(c.prefetch_bytes),
        c.errors,
        bytes(c.ram_bytes)
    );
}

/// `--wait` of the job subcommands.
#[derive(Args, Debug)]
pub struct Wait {
    /// Follow the job until it ends (a progress bar when stderr is a terminal); a
    /// rebuild that does not end done exits 1.
    #[arg(long)]
    wait: bool,
}

#[derive(Args, Debug)]
pub struct ScrubStartArgs {
    /// Name of the pool.
    name: String,
    /// Only report mismatched copies, do not rewrite them.
    #[arg(long)]
    no_repair: bool,
    #[command(flatten)]
    wait: Wait,
}

/// A job's status, optionally followed to its end.
#[derive(Args, Debug)]
pub struct JobStatusArgs {
    /// Name of the pool.
    name: String,
    #[command(flatten)]
    wait: Wait,
}

#[derive(Subcommand, Debug)]
pub enum ScrubAction {
    /// Start a scrub.
    Start(ScrubStartArgs),
    /// The running or last scrub: progress, findings.
    Status(JobStatusArgs),
    /// Stop the running scrub.
    Stop(PoolName),
}

/// `pool scrub start|status|stop`, or the old flag form `pool scrub NAME [--status |
/// --stop] [--no-repair] [--wait]` (hidden).
#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    override_usage = "tessera pool scrub <start|status|stop> NAME [OPTIONS]"
)]
pub struct ScrubCmd {
    #[command(subcommand)]
    action: Option<ScrubAction>,
    /// Old form: the pool to scrub.
    #[arg(hide = true, required = true)]
    name: Option<String>,
    /// Old form of `scrub start --no-repair`.
    #[arg(long, hide = true, conflicts_with_all = ["stop", "status"])]
    no_repair: bool,
    /// Old form of `scrub status`.
    #[arg(long, hide = true, conflicts_with = "stop")]
    status: bool,
    /// Old form of `scrub stop`.
    #[arg(long, hide = true)]
    stop: bool,
    /// Old form of `--wait`.
    #[arg(long, hide = true, conflicts_with = "stop")]
    wait: bool,
}

#[derive(Args, Debug)]
pub struct RebuildStartArgs {
    /// Name of the pool.
    name: String,
    /// Device index (default: the only failed device).
    #[arg(long)]
    device: Option<usize>,
    /// Rebuild --device even if it is healthy (a full resync of that copy).
    #[arg(long, requires = "device")]
    force: bool,
    #[command(flatten)]
    wait: Wait,
}

#[derive(Subcommand, Debug)]
pub enum RebuildAction {
    /// Start rebuilding a failed device.
    Start(RebuildStartArgs),
    /// The running or last rebuild.
    Status(JobStatusArgs),
    /// Stop the running rebuild.
    Stop(PoolName),
}

/// `pool rebuild start|status|stop`, or the old flag form `pool rebuild NAME [--status |
/// --stop] [--device N] [--force] [--wait]` (hidden).
#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true,
    override_usage = "tessera pool rebuild <start|status|stop> NAME [OPTIONS]"
)]
pub struct RebuildCmd {
    #[command(subcommand)]
    action: Option<RebuildAction>,
    /// Old form: the pool to rebuild.
    #[arg(hide = true, required = true)]
    name: Option<String>,
    /// Old form of `rebuild start --device`.
    #[arg(long, hide = true)]
    device: Option<usize>,
    /// Old form of `rebuild start --force`.
    #[arg(long, hide = true, requires = "device")]
    force: bool,
    /// Old form of `rebuild status`.
    #[arg(long, hide = true, conflicts_with = "stop")]
    status: bool,
    /// Old form of `rebuild stop`.
    #[arg(long, hide = true)]
    stop: bool,
    /// Old form of `--wait`.
    #[arg(long, hide = true, conflicts_with = "stop")]
    wait: bool,
}

#[derive(Subcommand, Debug)]
pub enum ResyncCmd {
    /// The running or last resync.
    Status(JobStatusArgs),
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
    let filled = usize_of(u64_of_f64((pct / 5.0).round()).min(20));
    let bar = format!("[{}{}]", "#".repeat(filled), ".".repeat(20 - filled));
    format!(
        "{bar} {pct:.1}% {}/{} units, {}",
        v.units_done,
        v.units_total,
        job_rate(v)
    )
}

/// Rate, ETA and limit of a job (after the counts of a progress bar).
fn job_rate(v: &JobProgress) -> String {
    let eta = v.eta_s.map(|e| format!(" eta {e:.0}s")).unwrap_or_default();
    format!(
        "{:.1} MiB/s{eta}, limit {} ({} backoffs)",
        v.rate_mibps,
        rate(v.background.rate_limit_bps),
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

/// One line for a scrub (or resync) status, with its findings' counts.
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

fn print_scrub(v: &ScrubStatus) {
    println!("{}", scrub_line(v));
    if let Some(d) = &v.dedup {
        println!(
            "  dedup: {} reference counts wrong ({} repaired); {} index entries in {} buckets checked, {} stale ({} removed)",
            d.count_errors,
            d.counts_repaired,
            d.index_entries_checked,
            d.index_buckets_checked,
            d.stale_index_entries,
            d.index_entries_removed,
        );
    }
    for e in v.metadata_findings.iter().chain(&v.errors) {
        println!("  {e}");
    }
}

/// What scrub, rebuild and resync statuses share.
trait Job {
    fn state(&self) -> JobState;
    fn progress(&self) -> &JobProgress;
}

impl Job for ScrubStatus {
    fn state(&self) -> JobState {
        self.state
    }
    fn progress(&self) -> &JobProgress {
        &self.progress
    }
}

impl Job for RebuildStatus {
    fn state(&self) -> JobState {
        self.state
    }
    fn progress(&self) -> &JobProgress {
        &self.progress
    }
}

/// What to do with a background job.
enum JobVerb<B> {
    /// POST the body: start one.
    Start(B),
    /// GET its status.
    Status,
    /// DELETE: stop it.
    Stop,
}

/// A job call, then with `wait` its status until it ends (a bar on a terminal, nothing
/// in a pipe or a log); returns its last status.
fn job_call<T: DeserializeOwned + Job, B: Serialize>(
    ep: &Endpoint,
    what: &str,
    path: &str,
    verb: JobVerb<B>,
    wait: bool,
) -> Result<T> {
    let mut v: T = match verb {
        JobVerb::Start(body) => send(ep, "POST", path, &body)?,
        JobVerb::Status => get(ep, path)?,
        JobVerb::Stop => delete(ep, path)?,
    };
    if wait {
        let bar = Bar::new(what, v.progress().units_total, "units");
        while v.state() == JOB_RUNNING {
            let p = v.progress();
            bar.set(p.units_done, p.units_total, job_rate(p));
            std::thread::sleep(std::time::Duration::from_millis(500));
            v = get(ep, path)?;
        }
        bar.finish();
    }
    Ok(v)
}

/// `--wait` and a rebuild did not finish: exit 1 with its state (the device is still
/// not redundant). A scrub's findings are in its status, whatever its state.
fn ended<T: Job>(v: &T, wait: bool, what: &str) -> Result<()> {
    if wait && v.state() != JOB_DONE {
        return Err(CliError::Failed(format!("{what} ended {}", v.state())));
    }
    Ok(())
}

fn print_pool_status(v: &PoolInfo) {
    println!(
        "pool {}: {} {}, {} of {} allocated ({} free)",
        v.name,
        v.state,
        v.layout,
        bytes(v.allocated),
        bytes(v.capacity),
        bytes(v.free),
    );
    println!(
        "  volumes provision {} ({:.1}x capacity; overcommit limit {}x)",
        bytes(v.provisioned),
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
    if let Some(d) = &v.dedup {
        // Off: what is shared stays shared, new writes are not looked up.
        let off = if d.enabled {
            String::new()
        } else {
            format!(
                " (off: {} blocks written since without a lookup)",
                d.off_blocks
            )
        };
        println!(
            "  dedup{off}: {} logical in {} stored (ratio {:.2}); {} shared, {} new, {} zero blocks written; {} not looked up ({} regions not gaining)",
            bytes(d.logical_bytes),
            bytes(d.physical_bytes),
            d.ratio,
            d.hits,
            d.new_blocks,
            d.zero_blocks,
            d.skipped_blocks,
            d.skipping_regions,
        );
        println!(
            "  dedup index: {} entries in {} buckets, {} on disk, {} RAM; {} lookups, {} answered from RAM, {} short-fingerprint collisions",
            d.index_entries,
            d.index_buckets,
            bytes(d.index_device_bytes),
            bytes(d.index_ram_bytes),
            d.index_lookups,
            d.index_filtered,
            d.short_collisions,
        );
    }
}

/// The layouts `--stripe-size` means something for; concat and raid1 have no stripes,
/// and a size the node would silently ignore is refused instead.
fn check_stripe_size(layout: LayoutSpec, stripe_size: Option<&str>) -> Result<()> {
    if stripe_size.is_some() && !layout.stripes() {
        return Err(CliError::Invalid(format!(
            "--stripe-size does not apply to layout {} (it does not stripe); it sets \
             the stripe of raid0/raid10 and the chunk of raid5/raid6/ec",
            layout.name()
        )));
    }
    Ok(())
}

pub fn pool(ep: &Endpoint, c: PoolCmd, raw: bool) -> Result<()> {
    match c {
        PoolCmd::Create(a) => {
            // Parsed here, once: a bad layout is refused before anything is sent.
            let layout: LayoutSpec = a.layout.parse()?;
            check_stripe_size(layout, a.stripe_size.as_deref())?;
            let body = CreatePool {
                name: a.name,
                devices: a.devices,
                layout: Some(layout),
                copies: a.copies,
                stripe_size: a.stripe_size.map(SizeArg::from),
                unit_size: a.unit_size.map(SizeArg::from),
                force: a.force,
                overcommit: a.overcommit,
                cache: a.cache,
                cache_mode: a.cache_mode,
                cache_unit: a.cache_unit.map(SizeArg::from),
                cache_admit_hits: a.cache_admit_hits,
                dedup: a.dedup,
            };
            let v: PoolInfo = send(ep, "POST", "/v1/pools", &body)?;
            show(&v, raw, |v| {
                print_pools(&[PoolEntry::Online(Box::new(v.clone()))])
            });
        }
        PoolCmd::List => {
            let v: Vec<PoolEntry> = get(ep, "/v1/pools")?;
            show(&v[..], raw, print_pools);
        }
        PoolCmd::Show(PoolShowArgs { name, check }) => {
            let v: PoolInfo = get(ep, &format!("/v1/pools/{name}"))?;
            show(&v, raw, print_pool_status);
            if check && v.is_degraded() {
                return Err(CliError::Degraded(format!("pool {name} is {}", v.state)));
            }
        }
        PoolCmd::Delete(PoolName { name }) => {
            let v: Deleted = delete(ep, &format!("/v1/pools/{name}"))?;
            deleted(&v, raw, &format!("pool {name}"));
        }
        PoolCmd::Update(PoolUpdateArgs {
            name,
            overcommit,
            dedup,
        }) => {
            let body = UpdatePool {
                overcommit,
                dedup: dedup.map(|d| d == "on"),
            };
            let v: PoolInfo = send(ep, "PATCH", &format!("/v1/pools/{name}"), &body)?;
            show(&v, raw, print_pool_status);
        }
        PoolCmd::Replace(a) => {
            let with = a.with.or(a.new_device).unwrap_or_default();
            let body = ReplaceRequest {
                device: a.device,
                with,
                force: a.force,
            };
            let name = a.name;
            let v: ReplaceReply = send(ep, "POST", &format!("/v1/pools/{name}/replace"), &body)?;
            show(&v, raw, |v| {
                println!(
                    "pool {name}: device {} ({}) replaced by {}: {}",
                    a.device, v.replaced, v.with, v.state
                )
            });
        }
        PoolCmd::Spare(c) => {
            let spares = |name: &str| format!("/v1/pools/{name}/spares");
            let v: SpareList = match c {
                SpareCmd::Add(SpareAddArgs {
                    member: SpareMember { name, device },
                    force,
                }) => send(ep, "POST", &spares(&name), &SpareRequest { device, force })?,
                SpareCmd::Remove(SpareMember { name, device }) => send(
                    ep,
                    "DELETE",
                    &spares(&name),
                    &SpareRequest {
                        device,
                        force: false,
                    },
                )?,
                SpareCmd::List(PoolName { name }) => get(ep, &spares(&name))?,
            };
            show(&v, raw, print_spares);
        }
        PoolCmd::Cache(c) => {
            let path = |name: &str| format!("/v1/pools/{name}/cache");
            let v: CacheInfo = match c {
                CacheCmd::Add(a) => send(
                    ep,
                    "POST",
                    &path(&a.name),
                    &CacheRequest {
                        devices: a.devices,
                        mode: a.mode,
                        force: a.force,
                        unit: a.unit.map(SizeArg::from),
                        admit_hits: a.admit_hits,
                    },
                )?,
                CacheCmd::Remove(CacheRemoveArgs { name, force }) => {
                    let q = if force { "?force=true" } else { "" };
                    delete(ep, &format!("{}{q}", path(&name)))?
                }
                CacheCmd::Show(PoolName { name }) => get(ep, &path(&name))?,
                CacheCmd::Mode(CacheModeArgs { name, mode, force }) => {
                    send(ep, "PATCH", &path(&name), &CacheModeRequest { mode, force })?
                }
            };
            show(&v, raw, print_cache);
        }
        PoolCmd::Scrub(c) => scrub(ep, c, raw)?,
        PoolCmd::Rebuild(c) => rebuild(ep, c, raw)?,
        PoolCmd::Resync(ResyncCmd::Status(a)) => {
            let what = format!("resync of pool {}", a.name);
            let path = format!("/v1/pools/{}/resync", a.name);
            let v: ScrubStatus = job_call(ep, &what, &path, JobVerb::<()>::Status, a.wait.wait)?;
            show(&v, raw, print_scrub);
        }
    }
    Ok(())
}

fn scrub(ep: &Endpoint, c: ScrubCmd, raw: bool) -> Result<()> {
    let (name, verb, wait) = match c.action {
        Some(ScrubAction::Start(a)) => (
            a.name,
            JobVerb::Start(ScrubRequest {
                repair: !a.no_repair,
            }),
            a.wait.wait,
        ),
        Some(ScrubAction::Status(a)) => (a.name, JobVerb::Status, a.wait.wait),
        Some(ScrubAction::Stop(a)) => (a.name, JobVerb::Stop, false),
        None => {
            let verb = if c.stop {
                JobVerb::Stop
            } else if c.status {
                JobVerb::Status
            } else {
                JobVerb::Start(ScrubRequest {
                    repair: !c.no_repair,
                })
            };
            (c.name.unwrap_or_default(), verb, c.wait)
        }
    };
    let what = format!("scrub of pool {name}");
    let path = format!("/v1/pools/{name}/scrub");
    let v: ScrubStatus = job_call(ep, &what, &path, verb, wait)?;
    show(&v, raw, print_scrub);
    Ok(())
}

fn rebuild(ep: &Endpoint, c: RebuildCmd, raw: bool) -> Result<()> {
    let (name, verb, wait) = match c.action {
        Some(RebuildAction::Start(a)) => (
            a.name,
            JobVerb::Start(RebuildRequest {
                device: a.device,
                force: a.force,
            }),
            a.wait.wait,
        ),
        Some(RebuildAction::Status(a)) => (a.name, JobVerb::Status, a.wait.wait),
        Some(RebuildAction::Stop(a)) => (a.name, JobVerb::Stop, false),
        None => {
            let verb = if c.stop {
                JobVerb::Stop
            } else if c.status {
                JobVerb::Status
            } else {
                JobVerb::Start(RebuildRequest {
                    device: c.device,
                    force: c.force,
                })
            };
            (c.name.unwrap_or_default(), verb, c.wait)
        }
    };
    let what = format!("rebuild of pool {name}");
    let path = format!("/v1/pools/{name}/rebuild");
    let v: RebuildStatus = job_call(ep, &what, &path, verb, wait)?;
    show(&v, raw, |v| println!("{}", rebuild_line(v)));
    ended(&v, wait, &what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stripe_size_is_refused_where_nothing_stripes() {
        let spec = |l: &str| l.parse::<LayoutSpec>().unwrap();
        assert!(check_stripe_size(spec("raid1"), Some("64K")).is_err());
        assert!(check_stripe_size(spec("raid1:3"), Some("64K")).is_err());
        assert!(check_stripe_size(spec("concat"), Some("64K")).is_err());
        assert!(check_stripe_size(spec("raid1"), None).is_ok());
        for l in ["raid0", "raid10", "raid5", "raid6", "ec:4+2"] {
            assert!(check_stripe_size(spec(l), Some("64K")).is_ok(), "{l}");
        }
    }
}
