//! Closed-loop random I/O through a RemoteDevice on one reactor core: the latency and
//! IOPS of the in-reactor NVMe/TCP initiator.
//!
//! Usage: remote_bench URL PATTERN QD SECONDS [BS] [SIZE]
//!   URL      nvme-tcp://HOST:PORT/SUBNQN?nsid=N
//!   PATTERN  randread | randwrite
//! At QD1 the reactor busy-polls (like `nvmf perf --busy-poll`).
//! Prints a RESULT line like `tessera nvmf perf` (iops, mean/p50/p99 latency in us), and
//! a CC line: the queue's congestion window and RTTs at the end, and the commands
//! outstanding at the target and waiting in the queue, averaged over completions.
//!
//! Environment:
//!   REMOTE_BENCH_CC=off         congestion control off (the window is the queue depth)
//!   REMOTE_BENCH_DELAY_US=N     relay through a shaping proxy (tessera-testkit) in this
//!                               process that adds N us to each direction
//!   REMOTE_BENCH_RATE_MIBPS=N   ... and/or limits each direction to N MiB/s

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_device::BlockDevice;
use tessera_io::hist::Histogram;
use tessera_io::{AlignedBuf, CoreIo, IoHandle, IoOp, Tag, Task};
use tessera_remote::{CongestionConfig, LinkStats, RemoteConfig, RemoteDevice, RemoteHandle};
use tessera_testkit::proxy::ShapingProxy;
use tessera_testkit::reactor::ReactorThread;

/// Sample the queue's state every this many completions.
const SAMPLE_EVERY: u64 = 16;

/// Commands outstanding and waiting, summed over samples.
#[derive(Default)]
struct Occupancy {
    samples: u64,
    inflight: u64,
    waiting: u64,
}

struct Load {
    dev: Arc<RemoteDevice>,
    handle: Option<RemoteHandle>,
    write: bool,
    bs: u32,
    blocks: u64,
    bufs: Vec<AlignedBuf>,
    started: Vec<Instant>,
    rng: u64,
    id: u32,
    until: Instant,
    inflight: usize,
    hist: Histogram,
    errors: u64,
    occupancy: Occupancy,
    tx: Sender<(Histogram, u64, Duration, LinkStats, Occupancy)>,
    t0: Instant,
    done: bool,
}

impl Load {
    fn issue(&mut self, io: &mut CoreIo, slot: usize) {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let offset = (self.rng % self.blocks) * u64::from(self.bs);
        let op = if self.write {
            IoOp::Write {
                offset,
                len: self.bs,
                buf: self.bufs[slot].as_ptr(),
            }
        } else {
            IoOp::Read {
                offset,
                len: self.bs,
                buf: self.bufs[slot].as_mut_ptr(),
            }
        };
        self.started[slot] = Instant::now();
        self.inflight += 1;
        let h = self.handle.as_mut().expect("opened at start");
        // SAFETY: bufs[slot] is reused only after this slot's completion.
        unsafe {
            h.submit(
                io,
                op,
                Tag::task(self.id, tessera_io::cast::u32_of(slot as u64)),
            )
        };
    }
}

impl Task for Load {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.handle = Some(RemoteHandle::open(&self.dev));
        self.t0 = Instant::now();
        for s in 0..self.bufs.len() {
            self.issue(io, s);
        }
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        let s = slot as usize;
        self.inflight -= 1;
        let ns = u64::try_from(self.started[s].elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.hist.record(ns);
        if res < 0 {
            self.errors += 1;
        }
        if self.hist.count().is_multiple_of(SAMPLE_EVERY) {
            if let Some(h) = &self.handle {
                let st = h.stats();
                self.occupancy.samples += 1;
                self.occupancy.inflight += u64::from(st.inflight);
                self.occupancy.waiting += u64::from(st.waiting);
            }
        }
        if Instant::now() < self.until {
            self.issue(io, s);
        } else if self.inflight == 0 && !self.done {
            self.done = true;
            let stats = self.handle.as_ref().map(|h| h.stats()).unwrap_or_default();
            let _ = self.tx.send((
                std::mem::take(&mut self.hist),
                self.errors,
                self.t0.elapsed(),
                stats,
                std::mem::take(&mut self.occupancy),
            ));
        }
    }

    fn finished(&self) -> bool {
        self.done
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!("usage: remote_bench URL randread|randwrite QD SECONDS [BS] [SIZE]");
        std::process::exit(2);
    }
    let env_u64 = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let delay_us = env_u64("REMOTE_BENCH_DELAY_US").unwrap_or(0);
    let rate_mibps = env_u64("REMOTE_BENCH_RATE_MIBPS").unwrap_or(0);
    let mut spec = tessera_remote::RemoteSpec::parse(&a[1]).unwrap_or_else(|e| {
        eprintln!("remote_bench: {e}");
        std::process::exit(2)
    });
    // Kept alive until the end of main: the path runs through it.
    let _proxy = (delay_us > 0 || rate_mibps > 0).then(|| {
        let p = ShapingProxy::start(&spec.addr);
        p.set_delay(Duration::from_micros(delay_us));
        p.set_rate((rate_mibps > 0).then_some(rate_mibps << 20));
        spec.addr = p.addr();
        p
    });
    let cfg = RemoteConfig {
        congestion: CongestionConfig {
            enabled: std::env::var("REMOTE_BENCH_CC").as_deref() != Ok("off"),
            ..CongestionConfig::default()
        },
        ..RemoteConfig::default()
    };
    let dev = RemoteDevice::open_with(spec, cfg).unwrap_or_else(|e| {
        eprintln!("remote_bench: {e}");
        std::process::exit(1)
    });
    let write = match a[2].as_str() {
        "randread" => false,
        "randwrite" => true,
        p => panic!("unknown pattern {p}"),
    };
    let qd: usize = a[3].parse().expect("QD");
    let secs: u64 = a[4].parse().expect("SECONDS");
    let bs = a
        .get(5)
        .map_or(4096, |s| tessera_device::parse_size(s).expect("BS"));
    let size = a
        .get(6)
        .map_or(dev.size(), |s| tessera_device::parse_size(s).expect("SIZE"));
    let bs32 = u32::try_from(bs).expect("BS fits in 32 bits");
    let core = ReactorThread::start();
    let (tx, rx) = channel();
    let d = dev.clone();
    core.mailbox.spawn(Box::new(move |_io: &mut CoreIo| {
        Box::new(Load {
            dev: d,
            handle: None,
            write,
            bs: bs32,
            blocks: size / bs,
            bufs: (0..qd)
                .map(|i| {
                    let mut b = AlignedBuf::zeroed(tessera_io::cast::usize_of(bs));
                    b.as_mut_slice().fill(u8::try_from(i % 256).unwrap_or(0));
                    b
                })
                .collect(),
            started: vec![Instant::now(); qd],
            rng: 0x9E37_79B9_7F4A_7C15,
            id: 0,
            until: Instant::now() + Duration::from_secs(secs),
            inflight: 0,
            hist: Histogram::default(),
            errors: 0,
            occupancy: Occupancy::default(),
            tx,
            t0: Instant::now(),
            done: false,
        }) as Box<dyn Task>
    }));
    let (hist, errors, wall, stats, occ) = rx
        .recv_timeout(Duration::from_secs(secs + 60))
        .expect("the run ended");
    drop(core);
    let ios = hist.count();
    let iops = ios as f64 / wall.as_secs_f64();
    let us = |v: u64| v as f64 / 1000.0;
    println!(
        "capsules {} in {} sends ({:.2} per send)",
        stats.capsules,
        stats.sends,
        stats.capsules as f64 / stats.sends.max(1) as f64
    );
    let per_sample = |v: u64| v as f64 / occ.samples.max(1) as f64;
    println!(
        "CC window={} decreases={} min_rtt_us={:.1} srtt_us={:.1} mean_inflight={:.1} mean_waiting={:.1}",
        stats.window,
        stats.window_decreases,
        stats.min_rtt.as_secs_f64() * 1e6,
        stats.srtt.as_secs_f64() * 1e6,
        per_sample(occ.inflight),
        per_sample(occ.waiting),
    );
    println!(
        "RESULT iops={iops:.0} mibps={:.1} mean_us={:.2} p50_us={:.2} p99_us={:.2} p999_us={:.2} errors={errors}",
        iops * bs as f64 / 1048576.0,
        hist.mean() / 1000.0,
        us(hist.quantile(0.5)),
        us(hist.quantile(0.99)),
        us(hist.quantile(0.999)),
    );
    if errors > 0 {
        std::process::exit(1);
    }
}
