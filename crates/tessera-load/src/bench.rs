//! `tessera bench`: drive a device, pool or volume in-process from reactor cores, like
//! SPDK's bdevperf, and report IOPS, bandwidth, latency percentiles and CPU per I/O.

use crate::error::LoadError;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_io::cast::{u32_of, usize_of, DurationU64};

use clap::{Args, ValueEnum};
use tessera_device::{open_device, parse_size, BlockDevice, DeviceSpec};
use tessera_io::hist::Histogram;
use tessera_io::{spawn_reactors, AlignedBuf, CoreIo, IoHandle, IoOp, ReactorConfig, Tag, Task};
use tessera_pool::{LayoutKind, Pool, PoolOptions, Volume};

use crate::report;
use crate::workload::{fill_payload, mixed_is_write, Rng};

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Pattern {
    Randread,
    Randwrite,
    Read,
    Write,
    Randrw,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Target {
    Device,
    Pool,
    Volume,
}

#[derive(Args, Clone)]
pub struct BenchArgs {
    /// Device spec (repeat for a pool): ram:1G, null:1G, /path[:SIZE], fault:...
    #[arg(long = "device", required = true)]
    devices: Vec<String>,
    /// What to drive: the device itself, a pool over the devices, or a thin volume on it.
    #[arg(long, value_enum, default_value = "device")]
    target: Target,
    /// Pool layout: concat, raid0, raid1[:COPIES], raid10[:COPIES], raid5, raid6, ec:K+M.
    #[arg(long, default_value = "concat")]
    layout: String,
    /// Mirrors: copies (raid1: the number of devices; raid10: default 2).
    #[arg(long)]
    copies: Option<u32>,
    /// Mirrors: mark this device (index) failed after the prefill, to measure degraded I/O.
    #[arg(long)]
    fail_device: Option<usize>,
    /// Stripe size (raid0/raid10) or chunk size (raid5/raid6/ec) of the pool.
    #[arg(long, default_value = "64K")]
    stripe_size: String,
    /// Thin allocation unit of the pool.
    #[arg(long, default_value = "1M")]
    unit_size: String,
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pattern: Pattern,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 70)]
    rwmix_read: u32,
    /// Block size of each I/O, e.g. 4K.
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Queue depth per core.
    #[arg(long, default_value_t = 128)]
    qd: usize,
    /// Reactor cores driving the target.
    #[arg(long, default_value_t = 1)]
    cores: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    time: u64,
    /// Skip writing the whole target before measuring (reads then hit unwritten space:
    /// zero pages on RAM, holes on volumes).
    #[arg(long)]
    no_prefill: bool,
    /// Busy-poll the rings instead of sleeping.
    #[arg(long)]
    busy_poll: bool,
    /// Parity pools: do not flush stripe-journal records and rows (the node's
    /// `parity_journal_flush = false`), to measure what power-loss safety costs.
    #[arg(long)]
    no_journal_flush: bool,
    /// Volumes of a pool without a cache: no readahead for sequential readers (the
    /// node's `readahead = false`), to measure what it gives.
    #[arg(long)]
    no_readahead: bool,
    /// Make the pool a dedup pool (docs/format.md §17): the volume target's blocks are
    /// fingerprinted and shared. Use with --dedupe-percentage, or every write carries
    /// the same bytes.
    #[arg(long)]
    dedup: bool,
    /// Stamp each 4 KiB block written with a unique number, except this percentage,
    /// which repeat one of 64 blocks (as fio's `dedupe_percentage`); the prefill is then
    /// all unique. Without it every write carries the same bytes.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100))]
    dedupe_percentage: Option<u32>,
}

/// Stamps for `--dedupe-percentage`: unique ones count up from a per-core base; the 64
/// repeated contents have the top bit set.
const REPEATED: u64 = 1 << 63;

/// Stamp each 4 KiB block of `b` with `next()`.
fn stamp_blocks(b: &mut [u8], mut next: impl FnMut() -> u64) {
    for blk in b.chunks_mut(4096) {
        if blk.len() >= 8 {
            blk[..8].copy_from_slice(&next().to_le_bytes());
        }
    }
}

struct Report {
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: i32,
    hist: Histogram,
    cpu: Duration,
    wall: Duration,
}

fn thread_cpu() -> Duration {
    let (user, sys) = report::cpu_time(libc::RUSAGE_THREAD);
    user + sys
}

struct BenchTask {
    handle: Box<dyn IoHandle>,
    id: u32,
    pattern: Pattern,
    rwmix: u64,
    bs: u64,
    base: u64,
    blocks: u64,
    seq_next: u64,
    rng: Rng,
    bufs: Vec<AlignedBuf>,
    started: Vec<Instant>,
    inflight: usize,
    deadline: Instant,
    begin: Instant,
    cpu0: Duration,
    stop: Arc<AtomicBool>,
    progress: Arc<AtomicU64>,
    r: Option<Report>,
    tx: Sender<Report>,
    unreported: u64,
    /// `--dedupe-percentage`, and this core's next unique stamp.
    dedupe: Option<u64>,
    stamp: u64,
}

impl BenchTask {
    fn next_op(&mut self, slot: usize) -> IoOp {
        let r = self.rng.next_u64();
        let (random, write) = match self.pattern {
            Pattern::Randread => (true, false),
            Pattern::Randwrite => (true, true),
            Pattern::Read => (false, false),
            Pattern::Write => (false, true),
            Pattern::Randrw => (true, mixed_is_write(r, self.rwmix)),
        };
        let block = if random {
            r % self.blocks
        } else {
            let b = self.seq_next;
            self.seq_next = (b + 1) % self.blocks;
            b
        };
        let offset = self.base + block * self.bs;
        if let (true, Some(pct)) = (write, self.dedupe) {
            let (rng, stamp) = (&mut self.rng, &mut self.stamp);
            stamp_blocks(self.bufs[slot].as_mut_slice(), || {
                let r = rng.next_u64();
                if r % 100 < pct {
                    REPEATED | ((r >> 32) % 64)
                } else {
                    *stamp += 1;
                    *stamp
                }
            });
        }
        let buf = self.bufs[slot].as_mut_ptr();
        if write {
            IoOp::Write {
                offset,
                len: u32_of(self.bs),
                buf,
            }
        } else {
            IoOp::Read {
                offset,
                len: u32_of(self.bs),
                buf,
            }
        }
    }

    fn issue(&mut self, io: &mut CoreIo, slot: usize, now: Instant) {
        let op = self.next_op(slot);
        self.started[slot] = now;
        self.inflight += 1;
        // SAFETY: slot `slot`'s buffer (`bufs[slot]`) belongs to this driver, which issues
        // the slot again only after its completion and is not dropped while I/O is
        // in flight.
        unsafe { self.handle.submit(io, op, Tag::task(self.id, u32_of(slot))) };
    }
}

impl Task for BenchTask {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.cpu0 = thread_cpu();
        self.begin = Instant::now();
        let now = self.begin;
        for s in 0..self.bufs.len() {
            self.issue(io, s, now);
        }
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        let now = Instant::now();
        self.inflight -= 1;
        let r = self.r.as_mut().expect("report");
        let s = slot as usize;
        r.hist
            .record(now.duration_since(self.started[s]).nanos_u64());
        if res < 0 {
            if r.errors == 0 {
                r.first_error = -res;
            }
            r.errors += 1;
        } else {
            r.ios += 1;
            r.bytes += self.bs;
        }
        self.unreported += 1;
        if self.unreported == 4096 {
            self.progress.fetch_add(4096, Relaxed);
            self.unreported = 0;
        }
        if now < self.deadline && !self.stop.load(Relaxed) {
            self.issue(io, s, now);
        }
    }

    fn finished(&self) -> bool {
        self.inflight == 0
    }
}

impl Drop for BenchTask {
    fn drop(&mut self) {
        if let Some(mut r) = self.r.take() {
            r.cpu = thread_cpu().saturating_sub(self.cpu0);
            r.wall = self.begin.elapsed();
            let _ = self.tx.send(r);
        }
    }
}

/// What the benchmark drives: a handle factory plus the byte range to use.
struct Subject {
    open: Arc<dyn Fn() -> Box<dyn IoHandle> + Send + Sync>,
    base: u64,
    len: u64,
    describe: String,
    _keep: Vec<Arc<dyn std::any::Any + Send + Sync>>,
    pool: Option<Arc<Pool>>,
}

fn build_subject(a: &BenchArgs) -> Result<Subject, LoadError> {
    let devs: Vec<Arc<dyn BlockDevice>> = a
        .devices
        .iter()
        .map(|d| {
            open_device(&DeviceSpec::parse(d).map_err(|e| LoadError::invalid(e.to_string()))?)
                .map_err(|e| LoadError::io(d.as_str(), e))
        })
        .collect::<Result<_, _>>()?;
    if a.target == Target::Device {
        if devs.len() != 1 {
            return Err(LoadError::invalid(
                "--target device takes exactly one --device",
            ));
        }
        let d = devs[0].clone();
        let len = d.size();
        let describe = d.describe();
        return Ok(Subject {
            open: Arc::new(move || d.clone().open_handle()),
            base: 0,
            len,
            describe,
            _keep: vec![],
            pool: None,
        });
    }
    let stripe = parse_size(&a.stripe_size)
        .map_err(|e| LoadError::invalid(format!("--stripe-size: {e}")))?;
    let spec = match a.copies {
        Some(c) => format!("{}:{c}", a.layout),
        None => a.layout.clone(),
    };
    let layout = LayoutKind::parse(&spec, stripe, devs.len())
        .map_err(|e| LoadError::Invalid(e.to_string()))?;
    let unit_size =
        parse_size(&a.unit_size).map_err(|e| LoadError::invalid(format!("--unit-size: {e}")))?;
    let pool = Arc::new(
        Pool::create(
            "bench",
            devs,
            PoolOptions {
                layout,
                unit_size,
                force: true,
                tuning: tessera_pool::PoolTuning {
                    journal_flush: !a.no_journal_flush,
                    readahead: !a.no_readahead,
                    ..Default::default()
                },
                dedup: a.dedup,
            },
        )
        .map_err(|source| LoadError::Setup {
            context: "creating the bench pool".into(),
            source,
        })?,
    );
    let st = pool.status();
    let describe = format!(
        "{} pool over {} device(s) ({})",
        st.layout,
        st.devices.len(),
        st.devices.join(", ")
    );
    if a.target == Target::Pool {
        // Drive the data region only: the metadata region stays intact. It starts on a
        // full stripe, so that writes of a stripe's size are whole-stripe writes (a
        // parity row of 5 x 64K does not divide the 1 MiB metadata region).
        let layout = pool.core.layout.clone();
        let base = st.metadata.next_multiple_of(layout.full_stripe());
        return Ok(Subject {
            open: Arc::new(move || Box::new(layout.open_handle()) as Box<dyn IoHandle>),
            base,
            len: st.capacity - (base - st.metadata),
            describe,
            _keep: vec![],
            pool: Some(pool),
        });
    }
    // A dedup pool's metadata (map, refcount and index units) comes out of the same
    // capacity, and blocks freed by overwrites wait for a commit: leave it a quarter.
    let volume_size = if a.dedup {
        (st.capacity / 4 * 3) & !((1 << 20) - 1)
    } else {
        st.capacity
    };
    let vol: Arc<Volume> =
        pool.create_volume("bench", volume_size)
            .map_err(|source| LoadError::Setup {
                context: "creating the bench volume".into(),
                source,
            })?;
    let v2 = vol.clone();
    Ok(Subject {
        open: Arc::new(move || Box::new(v2.open_handle()) as Box<dyn IoHandle>),
        base: 0,
        len: volume_size,
        describe: format!("thin volume on {describe}"),
        _keep: vec![vol],
        pool: Some(pool),
    })
}

/// Write the whole range once so reads hit real data (and volumes have their space).
fn prefill(s: &Subject, unique: bool) -> Result<(), LoadError> {
    let mut io =
        CoreIo::new(0, 256, None).map_err(|e| LoadError::io("setting up an io_uring", e))?;
    let mut h = (s.open)();
    let chunk = 1u64 << 20;
    // One buffer per write in flight: with `unique`, each is stamped before its write.
    let mut bufs: Vec<AlignedBuf> = (0..16)
        .map(|_| {
            let mut b = AlignedBuf::zeroed(usize_of(chunk));
            fill_payload(b.as_mut_slice());
            b
        })
        .collect();
    let mut stamp = 0u64;
    let mut off = 0;
    let mut err = 0;
    let t0 = Instant::now();
    while off < s.len && err == 0 {
        // Keep a few writes in flight for file-backed targets.
        let mut n = 0;
        while n < 16 && off < s.len {
            let len = chunk.min(s.len - off);
            let buf = &mut bufs[usize_of(u64::from(n))];
            if unique {
                stamp_blocks(buf.as_mut_slice(), || {
                    stamp += 1;
                    stamp
                });
            }
            // SAFETY: `buf` is only read by these writes and outlives the drain below.
            unsafe {
                h.submit(
                    &mut io,
                    IoOp::Write {
                        offset: s.base + off,
                        len: u32_of(len),
                        buf: buf.as_ptr(),
                    },
                    Tag::task(0, n),
                )
            };
            off += len;
            n += 1;
        }
        io.run_until_idle(|_, _, r| {
            if r < 0 {
                err = r;
            }
        });
    }
    if err < 0 {
        return Err(LoadError::io(
            "prefill failed",
            std::io::Error::from_raw_os_error(-err),
        ));
    }
    eprintln!(
        "prefill: wrote {} MiB in {:.1}s",
        s.len >> 20,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Check the arguments; returns the block size.
fn block_size(a: &BenchArgs) -> Result<u64, LoadError> {
    let bs = parse_size(&a.bs).map_err(|e| LoadError::invalid(format!("--bs: {e}")))?;
    if bs == 0 || bs > 32 << 20 {
        return Err(LoadError::invalid(
            "block size must be between 1 byte and 32M",
        ));
    }
    if a.qd == 0 || a.qd > 4096 || a.cores == 0 {
        return Err(LoadError::invalid(
            "queue depth must be 1..4096 and cores at least 1",
        ));
    }
    Ok(bs)
}

/// `--fail-device`: mark a device of the redundant pool failed, to measure degraded I/O.
fn fail_device(s: &Subject, d: usize) -> Result<(), LoadError> {
    let l = &s
        .pool
        .as_ref()
        .ok_or_else(|| LoadError::invalid("--fail-device needs --target pool or volume"))?
        .core
        .layout;
    if !l.kind.is_redundant() || d >= l.devices.len() {
        return Err(LoadError::invalid(
            "--fail-device takes a device index of a raid1/raid10/raid5/raid6/ec pool",
        ));
    }
    l.mark_failed(d, tessera_pool::layout::FailReason::Gone);
    Ok(())
}

impl BenchTask {
    /// The task of `core`: `qd` requests of `bs` bytes over its own `blocks` blocks from
    /// `base`, for `duration`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        io: &mut CoreIo,
        handle: Box<dyn IoHandle>,
        a: &BenchArgs,
        core: usize,
        bs: u64,
        base: u64,
        blocks: u64,
        duration: Duration,
        stop: Arc<AtomicBool>,
        progress: Arc<AtomicU64>,
        tx: Sender<Report>,
    ) -> BenchTask {
        BenchTask {
            handle,
            id: 0,
            pattern: a.pattern,
            rwmix: a.rwmix_read as u64,
            bs,
            base,
            blocks,
            seq_next: 0,
            rng: Rng::for_index(core),
            // Writes carry the load generators' data pattern, as a client's would: a
            // buffer nobody wrote reads from the kernel's shared zero page, whose
            // always-cached bytes once made parity writes look 20% cheaper.
            bufs: (0..a.qd)
                .map(|_| {
                    let mut b = io.bufs.get(usize_of(bs));
                    fill_payload(b.as_mut_slice());
                    b
                })
                .collect(),
            started: vec![Instant::now(); a.qd],
            inflight: 0,
            deadline: Instant::now() + duration,
            begin: Instant::now(),
            cpu0: Duration::ZERO,
            stop,
            progress,
            r: Some(Report {
                ios: 0,
                bytes: 0,
                errors: 0,
                first_error: 0,
                hist: Histogram::default(),
                cpu: Duration::ZERO,
                wall: Duration::ZERO,
            }),
            tx,
            unreported: 0,
            dedupe: a.dedupe_percentage.map(u64::from),
            // Above every prefill stamp (which count from 1).
            stamp: (core as u64 + 1) << 48,
        }
    }
}

/// A second of a running bench, for a progress display.
#[derive(Clone, Copy, Debug)]
pub struct Tick {
    pub elapsed_s: u64,
    pub total_s: u64,
    pub iops: f64,
    pub mibps: f64,
}

/// The figures of a finished bench (what the human report and the RESULT line print).
pub struct Summary {
    pub target: String,
    pub pattern: String,
    pub bs: u64,
    pub qd: usize,
    pub cores: usize,
    pub seconds: f64,
    pub ios: u64,
    pub bytes: u64,
    pub iops: f64,
    pub mibps: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub cpu_ns_per_io: f64,
    pub cores_busy: f64,
    pub errors: u64,
    /// The first failed I/O's error, when any failed.
    pub first_error: Option<String>,
    /// Parity pools: what the row writes of the measured run waited for.
    pub parity: Option<tessera_pool::parity::ParityTotals>,
    hist: Histogram,
}

/// The rate once a second, on stderr, only when stderr is a terminal (a log or a pipe
/// gets the final report alone).
pub fn terminal_ticker() -> impl FnMut(&Tick) {
    use std::io::IsTerminal as _;
    let shown = std::io::stderr().is_terminal();
    move |t: &Tick| {
        if shown {
            eprint!(
                "\r[{:>3}s/{}s] {:>10.0} IOPS {:>9.1} MiB/s",
                t.elapsed_s, t.total_s, t.iops, t.mibps
            );
            let _ = std::io::stderr().flush();
        }
    }
}

/// Report the rate once a second to `tick` until every core has reported; returns the
/// reports.
fn show_progress(
    rx: &Receiver<Report>,
    progress: &AtomicU64,
    a: &BenchArgs,
    bs: u64,
    tick: &mut dyn FnMut(&Tick),
) -> Vec<Report> {
    let t0 = Instant::now();
    let mut last = 0;
    let mut reports = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(r) => {
                reports.push(r);
                if reports.len() == a.cores {
                    break;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                let now = progress.load(Relaxed);
                let rate = now - last;
                last = now;
                tick(&Tick {
                    elapsed_s: t0.elapsed().as_secs(),
                    total_s: a.time,
                    iops: rate as f64,
                    mibps: (rate * bs) as f64 / 1048576.0,
                });
            }
            Err(_) => break,
        }
    }
    reports
}

/// The parity datapath's figures of the subject's pool, if it is a parity pool.
fn parity_totals(subject: &Subject) -> Option<tessera_pool::parity::ParityTotals> {
    subject.pool.as_ref()?.core.layout.parity_totals()
}

/// Add up the cores' reports.
fn summarize(
    a: &BenchArgs,
    subject: &Subject,
    bs: u64,
    reports: &[Report],
    parity: Option<tessera_pool::parity::ParityTotals>,
) -> Summary {
    let mut hist = Histogram::default();
    let (mut ios, mut bytes, mut errors, mut cpu, mut wall) =
        (0u64, 0u64, 0u64, Duration::ZERO, Duration::ZERO);
    let mut first_error = 0;
    for r in reports {
        hist.merge(&r.hist);
        ios += r.ios;
        bytes += r.bytes;
        errors += r.errors;
        cpu += r.cpu;
        wall = wall.max(r.wall);
        if first_error == 0 {
            first_error = r.first_error;
        }
    }
    let secs = wall.as_secs_f64().max(1e-9);
    let us = |ns: u64| ns as f64 / 1000.0;
    Summary {
        target: subject.describe.clone(),
        pattern: format!("{:?}", a.pattern).to_lowercase(),
        bs,
        qd: a.qd,
        cores: a.cores,
        seconds: secs,
        ios,
        bytes,
        iops: ios as f64 / secs,
        mibps: bytes as f64 / secs / 1048576.0,
        mean_us: hist.mean() / 1000.0,
        p50_us: us(hist.quantile(0.5)),
        p99_us: us(hist.quantile(0.99)),
        p999_us: us(hist.quantile(0.999)),
        max_us: us(hist.max()),
        cpu_ns_per_io: if ios > 0 {
            cpu.as_nanos() as f64 / ios as f64
        } else {
            0.0
        },
        cores_busy: cpu.as_secs_f64() / secs,
        errors,
        first_error: (errors > 0)
            .then(|| std::io::Error::from_raw_os_error(first_error).to_string()),
        parity,
        hist,
    }
}

/// The human report and the RESULT line scripts parse.
pub fn print_summary(s: &Summary) {
    println!("target:     {}", s.target);
    println!(
        "workload:   {} bs={} qd={} cores={} time={:.1}s",
        s.pattern,
        tessera_device::format_size(s.bs),
        s.qd,
        s.cores,
        s.seconds
    );
    println!("throughput: {:.0} IOPS, {:.1} MiB/s", s.iops, s.mibps);
    report::print_latency(&s.hist);
    println!(
        "cpu:        {:.1} ms per million I/Os ({:.2} cores busy)",
        s.cpu_ns_per_io, s.cores_busy
    );
    if let Some(e) = &s.first_error {
        println!("errors:     {} (first: {e})", s.errors);
    }
    report::print_result(s.iops, s.mibps, &s.hist, s.cpu_ns_per_io, s.errors);
    if let Some(p) = &s.parity {
        // Per row write: how often it found its row locked or its journal slice full
        // (each a retry one reactor round later), and how often a journal slice's lock
        // was held by another core.
        let per = |n: u64| n as f64 / p.row_writes.max(1) as f64;
        println!(
            "PARITY row_writes={} lock_waits_per_write={:.3} journal_waits_per_write={:.3} ring_contended_per_write={:.3}",
            p.row_writes,
            per(p.lock_waits),
            per(p.journal_waits),
            per(p.ring_contended)
        );
    }
}

/// The run's outcome from its figures.
pub fn outcome(s: &Summary) -> Result<(), LoadError> {
    if s.errors > 0 && s.ios == 0 {
        return Err(LoadError::Failed("every I/O failed".into()));
    }
    Ok(())
}

/// Run the bench, printing the human report (with the rate on a terminal each second).
pub fn run(a: BenchArgs) -> Result<(), LoadError> {
    let s = run_with(a, &mut terminal_ticker())?;
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!();
    }
    print_summary(&s);
    outcome(&s)
}

/// Run the bench and return its figures; `tick` sees the rate once a second. Only
/// stderr is written to (the prefill's note), so the caller owns stdout.
pub fn run_with(a: BenchArgs, tick: &mut dyn FnMut(&Tick)) -> Result<Summary, LoadError> {
    let bs = block_size(&a)?;
    let subject = build_subject(&a)?;
    let blocks = subject.len / bs;
    if blocks == 0 {
        return Err(LoadError::invalid("target is smaller than one block"));
    }
    if !a.no_prefill {
        prefill(&subject, a.dedupe_percentage.is_some())?;
    }
    if let Some(d) = a.fail_device {
        fail_device(&subject, d)?;
    }
    // The prefill's row writes are not the run's.
    let parity_before = parity_totals(&subject);
    let cfg = ReactorConfig {
        cores: a.cores,
        busy_poll: a.busy_poll,
        exit_when_idle: true,
        ..ReactorConfig::default()
    };
    let (tx, rx) = channel();
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let duration = Duration::from_secs(a.time);
    eprintln!(
        "bench: {} — {:?} bs={} qd={} cores={} for {}s",
        subject.describe,
        a.pattern,
        tessera_device::format_size(bs),
        a.qd,
        a.cores,
        a.time
    );
    let reactors = spawn_reactors(&cfg).map_err(|e| LoadError::io("cannot start reactors", e))?;
    // Each core works on its own slice of the target (no two cores share blocks).
    let per_core = blocks / a.cores as u64;
    for (core, (mb, _)) in reactors.iter().enumerate() {
        let open = subject.open.clone();
        let (tx, stop, progress) = (tx.clone(), stop.clone(), progress.clone());
        let base = subject.base + core as u64 * per_core * bs;
        let a = a.clone();
        mb.spawn(Box::new(move |io: &mut CoreIo| {
            let (h, blocks) = (open(), per_core.max(1));
            Box::new(BenchTask::new(
                io, h, &a, core, bs, base, blocks, duration, stop, progress, tx,
            )) as Box<dyn Task>
        }));
    }
    drop(tx);
    let reports = show_progress(&rx, &progress, &a, bs, tick);
    for (_, h) in reactors {
        let _ = h.join();
    }
    let parity = parity_totals(&subject).map(|after| {
        let before = parity_before.unwrap_or_default();
        tessera_pool::parity::ParityTotals {
            row_writes: after.row_writes - before.row_writes,
            lock_waits: after.lock_waits - before.lock_waits,
            journal_waits: after.journal_waits - before.journal_waits,
            ring_contended: after.ring_contended - before.ring_contended,
        }
    });
    Ok(summarize(&a, &subject, bs, &reports, parity))
}
