//! `tessera nvmf perf`: a pipelined NVMe/TCP load generator, built like `nbd-perf` and
//! sharing its connection loop (`perf_io`).
//!
//! The controller and its I/O queues are set up with the blocking initiator; then each
//! queue is driven by one thread that keeps `qd` commands outstanding (the command ID is
//! the slot index): every command that can be (re)issued is queued and leaves in one
//! non-blocking `sendmsg` (write data is sent from one payload buffer, not copied), and
//! PDUs are received into a large buffer and parsed in bulk, read data skipped in place.
//! Reads complete on the C2HData carrying the SUCCESS flag (the target skips the response
//! capsule when SQ flow control is off and no data digest is used) or on the response
//! capsule. Writes of up to 8 KiB travel in the capsule; larger ones wait for the target's
//! R2T and send H2CData PDUs of at most MAXH2CDATA bytes. The thread never blocks in a
//! send: while commands or data are still queued it polls for both directions and keeps
//! taking in completions and R2Ts. With `--busy-poll` the receive spins instead of
//! sleeping.

use std::io::{self, Write as _};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::Args;
use tessera_device::{format_size, parse_size};
use tessera_io::hist::Histogram;
use tessera_nvmf::initiator::Controller;
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu;

use crate::nbd_perf::Pattern;
use crate::perf_io::{self, Buffers};

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

#[derive(Clone, Copy, Default)]
struct Slot {
    start: u64,
    write: bool,
    busy: bool,
    /// Write data asked for by R2T so far (bytes).
    r2t_asked: u32,
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
    /// Largest H2CData PDU the target accepts.
    maxh2cdata: usize,
    /// Writes of at most this many bytes travel in the capsule; larger ones by R2T.
    in_capsule: usize,
    slots: Vec<Slot>,
    inflight: usize,
    issuing: bool,
    /// Commands and write data to send, PDUs received.
    b: Buffers,
    payload_crc: [u8; 4],
    /// Data digests of the H2CData pieces sent so far: (offset, length, CRC32C).
    piece_crc: Vec<(u32, u32, [u8; 4])>,
    hist: Histogram,
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Engine {
    fn new(
        a: &NvmfPerfArgs,
        bs: u64,
        lba: u32,
        blocks: u64,
        framing: pdu::Framing,
        maxh2cdata: u32,
        seed: u64,
    ) -> Engine {
        let payload: Vec<u8> = (0..bs).map(|i| (i * 131 % 251) as u8).collect();
        Engine {
            pattern: a.pattern,
            rwmix: a.rwmix_read as u64,
            bs,
            lba_shift: lba.trailing_zeros(),
            blocks,
            nsid: a.nsid,
            rng: seed | 1,
            framing,
            limits: pdu::Limits {
                hdgst: framing.hdgst,
                ddgst: framing.ddgst,
                max_data: 2 << 20,
            },
            maxh2cdata: (maxh2cdata as usize).max(4096),
            in_capsule: tessera_nvmf::target::IN_CAPSULE,
            slots: vec![Slot::default(); a.qd],
            inflight: 0,
            issuing: true,
            payload_crc: pdu::crc(&payload).to_le_bytes(),
            piece_crc: Vec::new(),
            // Room for a whole C2HData PDU of the largest transfer.
            b: Buffers::new(payload, RECV_BUF, 2 << 20, a.qd * 100),
            hist: Histogram::default(),
            ios: 0,
            bytes: 0,
            errors: 0,
            first_error: None,
        }
    }

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
        let in_capsule = write && self.bs as usize <= self.in_capsule;
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
            if in_capsule {
                nvme::SGL_DATA_BLOCK_OFFSET
            } else {
                nvme::SGL_TRANSPORT_DATA_BLOCK
            },
            self.bs as u32,
        );
        let mut h = [0u8; 160];
        let data = if in_capsule { self.bs as usize } else { 0 };
        let n = self.framing.capsule_cmd(&mut h, &sqe.encode(), data);
        self.b.out.push_bytes(&h[..n]);
        if in_capsule {
            self.b.out.push_payload(0..data);
            if self.framing.ddgst {
                self.b.out.push_bytes(&self.payload_crc);
            }
        }
        self.slots[slot] = Slot {
            start: now,
            write,
            busy: true,
            r2t_asked: 0,
        };
        self.inflight += 1;
    }

    /// The target asks for `len` bytes of the write in `slot` at `offset`: queue them as
    /// H2CData PDUs of at most MAXH2CDATA bytes.
    fn on_r2t(&mut self, slot: usize, ttag: u16, offset: u32, len: u32) -> Result<(), String> {
        let s = self.slots[slot];
        let end = offset as u64 + len as u64;
        if !s.write || (self.bs as usize) <= self.in_capsule {
            return Err(format!("R2T for command {slot}, which has no data to send"));
        }
        if offset != s.r2t_asked || len == 0 || end > self.bs {
            return Err(format!(
                "R2T for {len} bytes at {offset} of command {slot} ({} of {} asked before)",
                s.r2t_asked, self.bs
            ));
        }
        self.slots[slot].r2t_asked = end as u32;
        let mut at = offset;
        while at < end as u32 {
            let n = (end as u32 - at).min(self.maxh2cdata as u32);
            let last = at + n == end as u32;
            let mut h = [0u8; 160];
            let flags = if last { pdu::F_DATA_LAST } else { 0 };
            let hl = self
                .framing
                .data_pdu(&mut h, pdu::H2C_DATA, flags, slot as u16, ttag, at, n);
            self.b.out.push_bytes(&h[..hl]);
            self.b.out.push_payload(at as usize..(at + n) as usize);
            if self.framing.ddgst {
                let d = self.piece_digest(at, n);
                self.b.out.push_bytes(&d);
            }
            at += n;
        }
        Ok(())
    }

    fn piece_digest(&mut self, at: u32, n: u32) -> [u8; 4] {
        if let Some(&(_, _, d)) = self.piece_crc.iter().find(|p| p.0 == at && p.1 == n) {
            return d;
        }
        let d = pdu::crc(&self.b.payload[at as usize..(at + n) as usize]).to_le_bytes();
        if self.piece_crc.len() < 64 {
            self.piece_crc.push((at, n, d));
        }
        d
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
}

impl perf_io::Engine for Engine {
    fn fill(&mut self, now: u64) {
        for i in 0..self.slots.len() {
            self.issue(i, now);
        }
    }

    fn inflight(&self) -> usize {
        self.inflight
    }

    fn stop_issuing(&mut self) {
        self.issuing = false;
    }

    fn bufs(&mut self) -> &mut Buffers {
        &mut self.b
    }

    /// Parse every complete PDU; returns how many commands completed.
    fn parse(&mut self, now: u64) -> Result<u64, String> {
        let mut done = 0;
        loop {
            let avail = self.b.in_end - self.b.in_start;
            if avail < pdu::CH_LEN {
                return Ok(done);
            }
            let b = &self.b.inb[self.b.in_start..self.b.in_end];
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
            let (ttag, offset, len) = (pdu::le16(b, 10), pdu::le32(b, 12), pdu::le32(b, 16));
            if ty == pdu::C2H_TERM {
                let (fes, fei) = pdu::parse_term(b);
                return Err(format!(
                    "the target terminated the queue (FES {fes:#x}, FEI {fei:#x})"
                ));
            }
            self.b.in_start += f.plen();
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
                pdu::R2T => {
                    let s = self.slot_of(cid)?;
                    self.on_r2t(s, ttag, offset, len)?;
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

const WORDS: perf_io::Words = perf_io::Words {
    requests: "commands",
    peer: "target",
    conn: "queue",
};

pub fn run(a: NvmfPerfArgs) -> Result<(), String> {
    let bs = parse_size(&a.bs).map_err(|e| format!("--bs: {e}"))?;
    if bs == 0 || bs > tessera_nvmf::target::MAX_TRANSFER as u64 {
        return Err("--bs must be at most 1 MiB".into());
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
        let seed = 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let mut e = Engine::new(&a, bs, lba, blocks, q.framing, q.maxh2cdata, seed);
        let busy = a.busy_poll;
        threads.push(
            std::thread::Builder::new()
                .name(format!("nvmf-perf-{i}"))
                .spawn(move || {
                    barrier.wait();
                    let epoch = Instant::now();
                    let r = perf_io::drive(
                        &mut e,
                        &q.stream,
                        epoch,
                        duration.as_nanos() as u64,
                        busy,
                        &progress,
                        &WORDS,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use perf_io::Engine as _;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: NvmfPerfArgs,
    }

    fn engine(extra: &[&str], bs: u64, ddgst: bool) -> Engine {
        let mut argv = vec!["x", "--nqn", "n", "--qd", "4"];
        argv.extend_from_slice(extra);
        let a = Cli::parse_from(argv).a;
        let fr = pdu::Framing {
            hdgst: false,
            ddgst,
            align: 4,
        };
        Engine::new(&a, bs, 512, 100, fr, 128 << 10, 7)
    }

    /// Feed PDUs to the engine; returns completions.
    fn feed(e: &mut Engine, bytes: &[u8]) -> Result<u64, String> {
        let space = e.b.recv_space();
        space[..bytes.len()].copy_from_slice(bytes);
        e.b.in_end += bytes.len();
        e.parse(1000)
    }

    /// Split queued bytes into PDUs: (type, flags, cid, offset, length, data).
    fn pdus(b: &[u8]) -> Vec<(u8, u8, u16, u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < b.len() {
            let ch = pdu::Ch::parse(&b[at..]);
            let plen = ch.plen as usize;
            let p = &b[at..at + plen];
            let (off, len) = if ch.ty == pdu::H2C_DATA {
                (pdu::le32(p, 12), pdu::le32(p, 16))
            } else {
                (0, 0)
            };
            let data = p[ch.pdo as usize..].to_vec();
            // The command ID: in the SQE of a capsule, else right after the common header.
            let cid = pdu::le16(p, if ch.ty == pdu::CAPSULE_CMD { 10 } else { 8 });
            out.push((ch.ty, ch.flags, cid, off, len, data));
            at += plen;
        }
        out
    }

    #[test]
    fn small_writes_travel_in_the_capsule() {
        let mut e = engine(&["--pattern", "randwrite"], 4096, true);
        e.fill(0);
        let out = e.b.out.to_vec(&e.b.payload);
        let p = pdus(&out);
        assert_eq!(p.len(), 4);
        for (i, x) in p.iter().enumerate() {
            assert_eq!((x.0, x.2 as usize), (pdu::CAPSULE_CMD, i));
            // Data, then its digest.
            assert_eq!(&x.5[..4096], &e.b.payload[..]);
            assert_eq!(x.5[4096..], pdu::crc(&e.b.payload).to_le_bytes());
        }
    }

    #[test]
    fn large_writes_answer_r2t_with_h2cdata_pieces() {
        let bs = 300 << 10;
        let mut e = engine(&["--pattern", "randwrite"], bs, true);
        e.fill(0);
        let sent = e.b.out.len();
        assert_eq!(sent, 4 * 72, "capsules without data");
        e.b.out = perf_io::SendQueue::default();
        // R2T for the whole of command 2.
        let fr = e.framing;
        let mut r = [0u8; 64];
        let n = fr.r2t(&mut r, 2, 77, 0, bs as u32);
        assert_eq!(feed(&mut e, &r[..n]), Ok(0));
        let out = e.b.out.to_vec(&e.b.payload);
        let p = pdus(&out);
        let want = [
            (0u32, 128u32 << 10),
            (128 << 10, 128 << 10),
            (256 << 10, 44 << 10),
        ];
        assert_eq!(p.len(), 3);
        for (x, &(off, len)) in p.iter().zip(&want) {
            assert_eq!((x.0, x.2, x.3, x.4), (pdu::H2C_DATA, 2, off, len));
            let last = off + len == bs as u32;
            assert_eq!(x.1 & pdu::F_DATA_LAST != 0, last);
            let d = &e.b.payload[off as usize..(off + len) as usize];
            assert_eq!(&x.5[..len as usize], d);
            assert_eq!(x.5[len as usize..], pdu::crc(d).to_le_bytes());
        }
        // A second R2T for the same data, or one for a read, breaks the stream.
        assert!(feed(&mut e, &r[..n]).is_err());
        let mut e = engine(&["--pattern", "randread"], bs, false);
        e.fill(0);
        assert!(feed(&mut e, &r[..n]).is_err());
    }
}
