//! `tessera nvmf perf`: a pipelined NVMe/TCP load generator, built like `nbd-perf`.
//!
//! The controller and its I/O queues are set up with the blocking initiator; then each
//! queue is driven by one thread that keeps `qd` commands outstanding (the command ID is
//! the slot index): every command that can be (re)issued is encoded into one buffer and
//! leaves in one `send`, and PDUs are received into a large buffer and parsed in bulk,
//! read data skipped in place. Reads complete on the C2HData carrying the SUCCESS flag
//! (the target skips the response capsule when SQ flow control is off and no data digest
//! is used) or on the response capsule; writes of up to 8 KiB travel in the capsule.
//! `qd` never exceeds the queue size, so the target always keeps reading and a blocking
//! send cannot deadlock. With `--busy-poll` the receive spins instead of sleeping.

use std::io::{self, Write as _};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Args;
use tessera_device::{format_size, parse_size};
use tessera_io::hist::Histogram;
use tessera_nvmf::initiator::{Controller, Queue};
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu;

use crate::nbd_perf::Pattern;

#[derive(Args, Clone, Debug)]
pub struct NvmfPerfArgs {
    #[command(flatten)]
    host: crate::nvmf_cmd::HostArgs,
    /// Subsystem NQN.
    #[arg(long)]
    nqn: String,
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    #[arg(long, value_enum, default_value = "randread")]
    pattern: Pattern,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 70)]
    rwmix_read: u32,
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Commands outstanding per queue.
    #[arg(long, default_value_t = 128)]
    qd: usize,
    /// I/O queues, each driven by its own thread.
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    time: u64,
    /// Bytes of the namespace to use, from offset 0 (default: all of it).
    #[arg(long)]
    size: Option<String>,
    /// Spin on non-blocking receives instead of sleeping in them.
    #[arg(long)]
    busy_poll: bool,
}

const RECV_BUF: usize = 4 << 20;
const STALL: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Default)]
struct Slot {
    start: u64,
    write: bool,
    busy: bool,
}

struct Engine {
    pattern: Pattern,
    rwmix: u64,
    bs: u64,
    lba_shift: u32,
    blocks: u64,
    nsid: u32,
    rng: u64,
    framing: pdu::Framing,
    limits: pdu::Limits,
    slots: Vec<Slot>,
    inflight: usize,
    issuing: bool,
    out: Vec<u8>,
    payload: Vec<u8>,
    payload_crc: [u8; 4],
    inb: Vec<u8>,
    in_start: usize,
    in_end: usize,
    hist: Histogram,
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Engine {
    fn next_rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn issue(&mut self, slot: usize, now: u64) {
        let r = self.next_rand();
        let write = match self.pattern {
            Pattern::Randread => false,
            Pattern::Randwrite => true,
            Pattern::Randrw => (r >> 40) % 100 >= self.rwmix,
        };
        let slba = (r % self.blocks) * (self.bs >> self.lba_shift);
        let nlb = (self.bs >> self.lba_shift) as u32;
        let sqe = Sqe {
            opc: if write { nvme::IO_WRITE } else { nvme::IO_READ },
            cid: slot as u16,
            nsid: self.nsid,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb - 1,
            ..Sqe::default()
        }
        .with_sgl(
            if write {
                nvme::SGL_DATA_BLOCK_OFFSET
            } else {
                nvme::SGL_TRANSPORT_DATA_BLOCK
            },
            self.bs as u32,
        );
        let mut h = [0u8; 160];
        let data = if write { self.bs as usize } else { 0 };
        let n = self.framing.capsule_cmd(&mut h, &sqe.encode(), data);
        self.out.extend_from_slice(&h[..n]);
        if write {
            self.out.extend_from_slice(&self.payload);
            if self.framing.ddgst {
                self.out.extend_from_slice(&self.payload_crc);
            }
        }
        self.slots[slot] = Slot {
            start: now,
            write,
            busy: true,
        };
        self.inflight += 1;
    }

    fn complete(&mut self, slot: usize, status: u16, now: u64) {
        let s = &mut self.slots[slot];
        s.busy = false;
        self.inflight -= 1;
        self.hist.record(now.saturating_sub(s.start));
        if status & 0x7FF != 0 {
            self.errors += 1;
            if self.first_error.is_none() {
                let what = if s.write { "write" } else { "read" };
                self.first_error = Some(format!("{what}: {}", nvme::status_text(status)));
            }
        } else {
            self.ios += 1;
            self.bytes += self.bs;
        }
        if self.issuing {
            self.issue(slot, now);
        }
    }

    fn slot_of(&self, cid: u16) -> Result<usize, String> {
        match self.slots.get(cid as usize) {
            Some(s) if s.busy => Ok(cid as usize),
            _ => Err(format!("PDU for command {cid}, which is not outstanding")),
        }
    }

    fn recv_space(&mut self) -> &mut [u8] {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.inb.len() - self.in_end < (2 << 20) {
            self.inb.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        &mut self.inb[self.in_end..]
    }

    /// Parse every complete PDU; returns how many commands completed.
    fn parse(&mut self, now: u64) -> Result<u64, String> {
        let mut done = 0;
        loop {
            let avail = self.in_end - self.in_start;
            if avail < pdu::CH_LEN {
                return Ok(done);
            }
            let b = &self.inb[self.in_start..self.in_end];
            let f = pdu::check_header(pdu::Role::Host, b, &self.limits)
                .map_err(|e| format!("bad PDU from the target: {e}"))?;
            if avail < f.plen() {
                return Ok(done);
            }
            let (ty, flags) = (f.ch.ty, f.ch.flags);
            let cid = pdu::le16(b, if ty == pdu::CAPSULE_RESP { 20 } else { 8 });
            let status = if ty == pdu::CAPSULE_RESP {
                pdu::le16(b, 22) >> 1
            } else {
                0
            };
            if ty == pdu::C2H_TERM {
                let (fes, fei) = pdu::parse_term(b);
                return Err(format!(
                    "the target terminated the queue (FES {fes:#x}, FEI {fei:#x})"
                ));
            }
            self.in_start += f.plen();
            match ty {
                pdu::CAPSULE_RESP => {
                    let s = self.slot_of(cid)?;
                    self.complete(s, status, now);
                    done += 1;
                }
                pdu::C2H_DATA => {
                    let s = self.slot_of(cid)?;
                    if flags & pdu::F_DATA_SUCCESS != 0 {
                        self.complete(s, 0, now);
                        done += 1;
                    }
                }
                t => return Err(format!("unexpected PDU type {t:#x}")),
            }
        }
    }
}

struct Report {
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
    failure: Option<String>,
    hist: Histogram,
    wall: Duration,
}

fn drive(
    e: &mut Engine,
    q: &Queue,
    epoch: Instant,
    deadline_ns: u64,
    busy: bool,
    progress: &AtomicU64,
) -> Result<(), String> {
    let mut s = &q.stream;
    s.set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|x| x.to_string())?;
    // A target that stops reading must not hang the tool: a stalled send is an error.
    s.set_write_timeout(Some(STALL))
        .map_err(|x| x.to_string())?;
    let fd = q.stream.as_raw_fd();
    let now_ns = || epoch.elapsed().as_nanos() as u64;
    for i in 0..e.slots.len() {
        e.issue(i, now_ns());
    }
    let mut last = Instant::now();
    loop {
        if !e.out.is_empty() {
            s.write_all(&e.out)
                .map_err(|x| format!("sending commands: {x}"))?;
            e.out.clear();
        }
        if e.inflight == 0 {
            return Ok(());
        }
        let flags = if busy { libc::MSG_DONTWAIT } else { 0 };
        let space = e.recv_space();
        // SAFETY: space is a valid writable slice.
        let n = unsafe { libc::recv(fd, space.as_mut_ptr().cast(), space.len(), flags) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if matches!(
                err.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                if last.elapsed() > STALL {
                    return Err(format!(
                        "no answer for {STALL:?} with {} commands outstanding",
                        e.inflight
                    ));
                }
                continue;
            }
            return Err(format!("receiving: {err}"));
        }
        if n == 0 {
            return Err(format!(
                "the target closed the queue with {} commands outstanding",
                e.inflight
            ));
        }
        e.in_end += n as usize;
        let now = now_ns();
        if now >= deadline_ns {
            e.issuing = false;
        }
        let d = e.parse(now)?;
        if d > 0 {
            last = Instant::now();
            progress.fetch_add(d, Relaxed);
        }
    }
}

pub fn run(a: NvmfPerfArgs) -> Result<(), String> {
    let bs = parse_size(&a.bs).map_err(|e| format!("--bs: {e}"))?;
    let writes = a.pattern != Pattern::Randread;
    if bs == 0 || bs > tessera_nvmf::target::MAX_TRANSFER as u64 {
        return Err("--bs must be at most 1 MiB".into());
    }
    if writes && bs > tessera_nvmf::target::IN_CAPSULE as u64 {
        return Err("writes travel in the capsule here: --bs must be at most 8 KiB".into());
    }
    if a.qd == 0 || a.qd > 512 {
        return Err("--qd must be 1..512 (the queue size)".into());
    }
    if a.queues == 0 || a.queues > 64 {
        return Err("--queues must be 1..64".into());
    }
    if a.time == 0 || a.rwmix_read > 100 {
        return Err("--time must be at least 1 and --rwmix-read at most 100".into());
    }
    let mut o = a.host.options();
    o.queue_size = a.qd.max(32) as u16;
    let mut ctrl = Controller::connect(&a.host.addr, &a.nqn, &o, a.queues)
        .map_err(|e| format!("connecting to {} at {}: {e}", a.nqn, a.host.addr))?;
    if ctrl.io.len() < a.queues as usize {
        return Err(format!("the target granted {} I/O queues", ctrl.io.len()));
    }
    let (nblocks, lba) = ctrl.namespace_size(a.nsid).map_err(|e| e.to_string())?;
    if bs % lba as u64 != 0 {
        return Err(format!("--bs must be a multiple of the {lba}-byte LBA"));
    }
    let ns_size = nblocks * lba as u64;
    let size = match &a.size {
        Some(s) => parse_size(s)
            .map_err(|e| format!("--size: {e}"))?
            .min(ns_size),
        None => ns_size,
    };
    let blocks = size / bs;
    if blocks == 0 {
        return Err("the namespace is smaller than one block".into());
    }
    eprintln!(
        "nvmf-perf: {} ns {} on {} ({} used) — {:?} bs={} qd={} queues={} for {}s",
        a.nqn,
        a.nsid,
        a.host.addr,
        format_size(blocks * bs),
        a.pattern,
        format_size(bs),
        a.qd,
        a.queues,
        a.time
    );
    let progress = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(a.queues as usize + 1));
    let duration = Duration::from_secs(a.time);
    let cpu0 = crate::report::cpu_time(libc::RUSAGE_SELF);
    let queues = std::mem::take(&mut ctrl.io);
    let mut threads = Vec::new();
    for (i, q) in queues.into_iter().enumerate() {
        let (progress, barrier) = (progress.clone(), barrier.clone());
        let payload: Vec<u8> = (0..bs).map(|i| (i * 131 % 251) as u8).collect();
        let mut e = Engine {
            pattern: a.pattern,
            rwmix: a.rwmix_read as u64,
            bs,
            lba_shift: lba.trailing_zeros(),
            blocks,
            nsid: a.nsid,
            rng: (0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93)) | 1,
            framing: q.framing,
            limits: pdu::Limits {
                hdgst: q.limits.hdgst,
                ddgst: q.limits.ddgst,
                max_data: 2 << 20,
            },
            slots: vec![Slot::default(); a.qd],
            inflight: 0,
            issuing: true,
            out: Vec::with_capacity(a.qd * (bs as usize + 100)),
            payload_crc: pdu::crc(&payload).to_le_bytes(),
            payload,
            inb: vec![0; RECV_BUF],
            in_start: 0,
            in_end: 0,
            hist: Histogram::default(),
            ios: 0,
            bytes: 0,
            errors: 0,
            first_error: None,
        };
        let busy = a.busy_poll;
        threads.push(
            std::thread::Builder::new()
                .name(format!("nvmf-perf-{i}"))
                .spawn(move || {
                    barrier.wait();
                    let epoch = Instant::now();
                    let r = drive(
                        &mut e,
                        &q,
                        epoch,
                        duration.as_nanos() as u64,
                        busy,
                        &progress,
                    );
                    let _ = q.stream.shutdown(std::net::Shutdown::Both);
                    Report {
                        ios: e.ios,
                        bytes: e.bytes,
                        errors: e.errors,
                        first_error: e.first_error.take(),
                        failure: r.err().map(|f| format!("queue {}: {f}", i + 1)),
                        hist: std::mem::take(&mut e.hist),
                        wall: epoch.elapsed(),
                    }
                })
                .map_err(|e| format!("cannot start a thread: {e}"))?,
        );
    }
    barrier.wait();
    let t0 = Instant::now();
    let mut last = 0;
    while threads.iter().any(|t| !t.is_finished()) {
        std::thread::sleep(Duration::from_secs(1).min(duration + Duration::from_secs(2)));
        let n = progress.load(Relaxed);
        eprint!(
            "\r[{:>3}s/{}s] {:>10.0} IOPS",
            t0.elapsed().as_secs_f64().round(),
            a.time,
            (n - last) as f64
        );
        let _ = io::stderr().flush();
        last = n;
    }
    eprintln!();
    let reports: Vec<Report> = threads.into_iter().filter_map(|t| t.join().ok()).collect();
    let _ = ctrl.keep_alive();
    ctrl.disconnect();
    let cpu1 = crate::report::cpu_time(libc::RUSAGE_SELF);
    let cpu = (cpu1.0 - cpu0.0) + (cpu1.1 - cpu0.1);
    let mut hist = Histogram::default();
    let (mut ios, mut bytes, mut errors, mut wall) = (0u64, 0u64, 0u64, Duration::ZERO);
    let mut first_error = None;
    let mut failures = Vec::new();
    for r in &reports {
        hist.merge(&r.hist);
        ios += r.ios;
        bytes += r.bytes;
        errors += r.errors;
        wall = wall.max(r.wall);
        first_error = first_error.or(r.first_error.clone());
        failures.extend(r.failure.clone());
    }
    let secs = wall.as_secs_f64().max(1e-9);
    let (iops, mibps) = (ios as f64 / secs, bytes as f64 / secs / 1048576.0);
    let cpu_ns = cpu.as_nanos() as f64 / (ios + errors).max(1) as f64;
    println!(
        "workload:   {:?} bs={} qd={} queues={} time={secs:.1}s digests={}{}",
        a.pattern,
        format_size(bs),
        a.qd,
        a.queues,
        if a.host.hdgst { "h" } else { "-" },
        if a.host.ddgst { "d" } else { "-" }
    );
    println!("throughput: {iops:.0} IOPS, {mibps:.1} MiB/s");
    crate::report::print_latency(&hist);
    if errors > 0 {
        println!(
            "errors:     {errors} (first: {})",
            first_error.as_deref().unwrap_or("?")
        );
    }
    for f in &failures {
        println!("failed:     {f}");
    }
    crate::report::print_result(iops, mibps, &hist, cpu_ns, errors);
    if !failures.is_empty() {
        return Err(format!("{} of {} queues failed", failures.len(), a.queues));
    }
    if errors > 0 && ios == 0 {
        return Err("every I/O failed".into());
    }
    Ok(())
}
