//! `tessera nbd-perf`: a pipelined NBD load generator that measures the server, not the
//! client.
//!
//! Each connection is driven by one thread that keeps `qd` requests outstanding (the cookie
//! is the slot index). The handshake goes through [`NbdClient`]; the transmission phase is
//! done here on the raw socket: every request that can be (re)issued is encoded into one
//! buffer and leaves in a single `send`, and replies are received into a 1 MiB buffer and
//! parsed in bulk, READ payloads being skipped in place rather than copied out. A slot is
//! reissued the moment its reply has been parsed, so in steady state a connection costs two
//! system calls per batch of replies (one `recv`, one `send`), whatever the queue depth.
//!
//! Sends are non-blocking and a partly sent batch makes the thread `poll` for both
//! directions, so a connection never deadlocks with a server that stops reading requests
//! while its replies are waiting for us. With `--busy-poll` the thread never sleeps (it
//! spins on non-blocking receives), which keeps the client's own wake-up latency out of
//! queue-depth-1 measurements; on a VM that wake-up can cost more than the server's
//! whole round trip.

use std::io::{self, Write as _};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use tessera_device::{format_size, parse_size};
use tessera_io::hist::Histogram;
use tessera_nbd::client::{nbd_error_to_io, ClientOptions, NbdClient};
use tessera_nbd::proto;

use crate::perf_io::{self, Buffers};

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum Pattern {
    Randread,
    Randwrite,
    Randrw,
}

#[derive(Args, Clone, Debug)]
pub struct NbdPerfArgs {
    /// Server and export: nbd://HOST[:PORT]/[EXPORT] (port 10809 if omitted; an empty
    /// export name selects the server's default export).
    #[arg(long, conflicts_with_all = ["addr", "export"], required_unless_present = "addr")]
    uri: Option<String>,
    /// Server address HOST:PORT, instead of --uri.
    #[arg(long)]
    addr: Option<String>,
    /// Export name with --addr (default: "", the server's default export).
    #[arg(long, requires = "addr")]
    export: Option<String>,
    #[arg(long, value_enum, default_value = "randread")]
    pattern: Pattern,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 70)]
    rwmix_read: u32,
    #[arg(long, default_value = "4K")]
    bs: String,
    /// Requests kept outstanding per connection.
    #[arg(long, default_value_t = 128)]
    qd: usize,
    /// Connections, each driven by its own thread with its own queue depth.
    #[arg(long, default_value_t = 1)]
    conns: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    time: u64,
    /// Bytes of the export to use, from offset 0 (default: the whole export).
    #[arg(long)]
    size: Option<String>,
    /// Spin on non-blocking receives instead of sleeping in them: takes the client's
    /// wake-up latency out of low-queue-depth latencies, at the price of a busy core per
    /// connection.
    #[arg(long)]
    busy_poll: bool,
}

/// Receive buffer per connection.
const RECV_BUF: usize = 1 << 20;
/// Largest structured error chunk accepted (a 4096-byte message plus slack, as the spec
/// caps messages at 4096 bytes).
const MAX_ERROR_CHUNK: usize = 64 * 1024;
const DEFAULT_PORT: u16 = 10809;

/// Split `nbd://HOST[:PORT]/[EXPORT]` into `("HOST:PORT", "EXPORT")`.
fn parse_uri(uri: &str) -> Result<(String, String), String> {
    let rest = uri.strip_prefix("nbd://").ok_or_else(|| {
        format!("{uri:?}: only nbd://HOST[:PORT]/EXPORT URIs are supported (TCP, no TLS)")
    })?;
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let (auth, path) = rest.split_once('/').unwrap_or((rest, ""));
    if auth.is_empty() {
        return Err(format!("{uri:?}: no host"));
    }
    let has_port = match auth.rfind(']') {
        Some(i) => auth[i + 1..].starts_with(':'),
        None => auth.contains(':'),
    };
    let addr = if has_port {
        auth.to_string()
    } else {
        format!("{auth}:{DEFAULT_PORT}")
    };
    Ok((
        addr,
        percent_decode(path).map_err(|e| format!("{uri:?}: {e}"))?,
    ))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("bad percent escape in the export name")?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "export name is not UTF-8".to_string())
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// Describe an NBD error number for humans.
fn nbd_error_text(code: u32, msg: Option<&str>) -> String {
    let e = nbd_error_to_io(code);
    match msg {
        Some(m) if !m.is_empty() => format!("{e} (NBD error {code}): {m}"),
        _ => format!("{e} (NBD error {code})"),
    }
}

#[derive(Clone, Copy, Default)]
struct Slot {
    /// Submit time, ns since the run's epoch.
    start: u64,
    write: bool,
    busy: bool,
    failed: bool,
}

/// The request generator and reply parser of one connection, independent of the socket.
struct Engine {
    pattern: Pattern,
    rwmix: u64,
    bs: u64,
    blocks: u64,
    rng: u64,
    structured: bool,
    slots: Vec<Slot>,
    inflight: usize,
    /// New requests are issued as slots complete (false once the time is up).
    issuing: bool,
    /// Requests to send and replies received.
    b: Buffers,
    /// Payload bytes of the current reply still to be skipped, and the slot that
    /// completes when they have been.
    skip: usize,
    skip_then: Option<usize>,
    hist: Histogram,
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Engine {
    fn new(
        pattern: Pattern,
        rwmix: u32,
        bs: u64,
        blocks: u64,
        qd: usize,
        structured: bool,
        seed: u64,
    ) -> Engine {
        let payload = (0..bs).map(|i| (i * 131 % 251) as u8).collect();
        Engine {
            pattern,
            rwmix: rwmix as u64,
            bs,
            blocks,
            rng: seed | 1,
            structured,
            slots: vec![Slot::default(); qd],
            inflight: 0,
            issuing: true,
            b: Buffers::new(
                payload,
                RECV_BUF.max(4 * MAX_ERROR_CHUNK),
                MAX_ERROR_CHUNK + proto::STRUCTURED_REPLY_LEN,
                qd * proto::REQUEST_HEADER_LEN,
            ),
            skip: 0,
            skip_then: None,
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

    /// Encode a new request for `slot` into the send buffer.
    fn issue(&mut self, slot: usize, now: u64) {
        let r = self.next_rand();
        let write = match self.pattern {
            Pattern::Randread => false,
            Pattern::Randwrite => true,
            Pattern::Randrw => (r >> 40) % 100 >= self.rwmix,
        };
        let offset = (r % self.blocks) * self.bs;
        let h = proto::encode_request(&proto::RequestHeader {
            flags: 0,
            cmd: if write {
                proto::CMD_WRITE
            } else {
                proto::CMD_READ
            },
            cookie: slot as u64,
            offset,
            length: self.bs as u32,
        });
        self.b.out.push_bytes(&h);
        if write {
            self.b.out.push_payload(0..self.b.payload.len());
        }
        self.slots[slot] = Slot {
            start: now,
            write,
            busy: true,
            failed: false,
        };
        self.inflight += 1;
    }

    fn fill(&mut self, now: u64) {
        for s in 0..self.slots.len() {
            self.issue(s, now);
        }
    }

    fn complete(&mut self, slot: usize, now: u64) {
        let s = &mut self.slots[slot];
        s.busy = false;
        self.inflight -= 1;
        self.hist.record(now.saturating_sub(s.start));
        if s.failed {
            self.errors += 1;
        } else {
            self.ios += 1;
            self.bytes += self.bs;
        }
        if self.issuing {
            self.issue(slot, now);
        }
    }

    fn fail(&mut self, slot: usize, code: u32, msg: Option<&str>) {
        self.slots[slot].failed = true;
        if self.first_error.is_none() {
            let s = &self.slots[slot];
            let what = if s.write { "WRITE" } else { "READ" };
            self.first_error = Some(format!("{what}: {}", nbd_error_text(code, msg)));
        }
    }

    /// The slot a reply cookie refers to; anything but an outstanding request means the
    /// server (or our parsing) is broken and the stream cannot be trusted.
    fn slot_of(&self, cookie: u64) -> Result<usize, String> {
        match self.slots.get(cookie as usize) {
            Some(s) if s.busy => Ok(cookie as usize),
            _ => Err(format!(
                "reply for cookie {cookie:#x}, which is not an outstanding request"
            )),
        }
    }

    /// Parse every complete reply in the receive buffer, completing (and reissuing) their
    /// slots. Returns how many requests completed.
    fn parse(&mut self, now: u64) -> Result<u64, String> {
        let mut p = self.b.in_start;
        let end = self.b.in_end;
        let mut done = 0u64;
        let r = loop {
            if self.skip > 0 {
                let k = self.skip.min(end - p);
                p += k;
                self.skip -= k;
                if self.skip > 0 {
                    break Ok(());
                }
                if let Some(slot) = self.skip_then.take() {
                    self.complete(slot, now);
                    done += 1;
                }
                continue;
            }
            let avail = end - p;
            if avail < 4 {
                break Ok(());
            }
            let b = &self.b.inb[p..end];
            match be32(b) {
                proto::SIMPLE_REPLY_MAGIC => {
                    if avail < proto::SIMPLE_REPLY_LEN {
                        break Ok(());
                    }
                    let error = be32(&b[4..]);
                    let slot = match self.slot_of(be64(&b[8..])) {
                        Ok(s) => s,
                        Err(e) => break Err(e),
                    };
                    p += proto::SIMPLE_REPLY_LEN;
                    if error != 0 {
                        self.fail(slot, error, None);
                        self.complete(slot, now);
                        done += 1;
                    } else if self.slots[slot].write {
                        self.complete(slot, now);
                        done += 1;
                    } else if self.structured {
                        break Err(format!(
                            "simple reply to READ cookie {slot:#x} after structured replies \
                             were negotiated (the spec forbids this)"
                        ));
                    } else {
                        // The READ data follows the header.
                        self.skip = self.bs as usize;
                        self.skip_then = Some(slot);
                    }
                }
                proto::STRUCTURED_REPLY_MAGIC => {
                    if avail < proto::STRUCTURED_REPLY_LEN {
                        break Ok(());
                    }
                    if !self.structured {
                        break Err("structured reply chunk, but structured replies were \
                                   not negotiated"
                            .to_string());
                    }
                    let flags = be16(&b[4..]);
                    let ty = be16(&b[6..]);
                    let cookie = be64(&b[8..]);
                    let len = be32(&b[16..]) as usize;
                    let slot = match self.slot_of(cookie) {
                        Ok(s) => s,
                        Err(e) => break Err(e),
                    };
                    let last = flags & proto::REPLY_FLAG_DONE != 0;
                    if ty & 0x8000 != 0 {
                        // Error chunk: 4-byte error, 2-byte message length, message
                        // (and an offset for ERROR_OFFSET). Needs the whole payload.
                        if !(6..=MAX_ERROR_CHUNK).contains(&len) {
                            break Err(format!(
                                "error chunk of {len} bytes for cookie {cookie:#x}"
                            ));
                        }
                        if avail < proto::STRUCTURED_REPLY_LEN + len {
                            break Ok(());
                        }
                        let pl = &b[proto::STRUCTURED_REPLY_LEN..][..len];
                        let code = be32(pl);
                        let mlen = be16(&pl[4..]) as usize;
                        let msg = pl
                            .get(6..6 + mlen)
                            .map(|m| String::from_utf8_lossy(m).into_owned());
                        p += proto::STRUCTURED_REPLY_LEN + len;
                        self.fail(
                            slot,
                            if code == 0 { proto::EIO } else { code },
                            msg.as_deref(),
                        );
                        if last {
                            self.complete(slot, now);
                            done += 1;
                        }
                        continue;
                    }
                    match ty {
                        proto::REPLY_TYPE_OFFSET_DATA => {
                            let s = self.slots[slot];
                            if s.write || len < 8 || len - 8 > self.bs as usize {
                                break Err(format!(
                                    "OFFSET_DATA chunk of {len} bytes for a {} of {} bytes \
                                     (cookie {cookie:#x})",
                                    if s.write { "WRITE" } else { "READ" },
                                    self.bs
                                ));
                            }
                        }
                        proto::REPLY_TYPE_OFFSET_HOLE => {
                            if self.slots[slot].write || len != 12 {
                                break Err(format!(
                                    "OFFSET_HOLE chunk of {len} bytes (cookie {cookie:#x})"
                                ));
                            }
                        }
                        proto::REPLY_TYPE_NONE => {
                            if len != 0 || !last {
                                break Err(format!(
                                    "NONE chunk with {len} bytes of payload or without \
                                     the DONE flag (cookie {cookie:#x})"
                                ));
                            }
                        }
                        _ => {
                            if len > RECV_BUF {
                                break Err(format!(
                                    "chunk of type {ty} with {len} bytes for cookie {cookie:#x}"
                                ));
                            }
                        }
                    }
                    p += proto::STRUCTURED_REPLY_LEN;
                    if len == 0 {
                        if last {
                            self.complete(slot, now);
                            done += 1;
                        }
                    } else {
                        self.skip = len;
                        self.skip_then = last.then_some(slot);
                    }
                }
                m => {
                    break Err(format!(
                        "bad reply magic {m:#010x}: the stream is out of sync"
                    ))
                }
            }
        };
        self.b.in_start = p;
        r.map(|()| done)
    }
}

impl perf_io::Engine for Engine {
    fn fill(&mut self, now: u64) {
        Engine::fill(self, now)
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

    fn parse(&mut self, now: u64) -> Result<u64, String> {
        Engine::parse(self, now)
    }
}

const WORDS: perf_io::Words = perf_io::Words {
    requests: "requests",
    peer: "server",
    conn: "connection",
};

/// A connected, negotiated socket.
struct Conn {
    stream: TcpStream,
    size: u64,
    flags: u16,
    structured: bool,
    block_size: Option<(u32, u32, u32)>,
}

fn connect(addr: &str, export: &str) -> Result<Conn, String> {
    let stream = TcpStream::connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream
        .set_nodelay(true)
        .map_err(|e| format!("{addr}: TCP_NODELAY: {e}"))?;
    let hs = stream
        .try_clone()
        .map_err(|e| format!("{addr}: cloning the socket: {e}"))?;
    // The handshake reads exactly what it needs (no buffering), so after it the raw socket
    // is positioned at the start of the transmission phase.
    let c = NbdClient::from_stream(
        hs,
        export,
        ClientOptions {
            structured_replies: true,
            base_allocation: false,
        },
    )
    .map_err(|e| format!("{addr}: handshake for export {export:?}: {e}"))?;
    Ok(Conn {
        stream,
        size: c.size(),
        flags: c.transmission_flags(),
        structured: c.structured_replies(),
        block_size: c.block_size(),
    })
}

/// Polite goodbye: NBD_CMD_DISC, then close.
fn disconnect(mut s: &TcpStream) {
    let h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_DISC,
        cookie: u64::MAX,
        offset: 0,
        length: 0,
    });
    let _ = s.write_all(&h);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

struct Report {
    conn: usize,
    ios: u64,
    bytes: u64,
    errors: u64,
    first_error: Option<String>,
    failure: Option<String>,
    hist: Histogram,
    wall: Duration,
}

/// Process CPU time (user, system).
fn process_cpu() -> (Duration, Duration) {
    crate::report::cpu_time(libc::RUSAGE_SELF)
}

/// Check the workload against what the server negotiated; returns the number of blocks
/// in the range to use.
fn blocks_to_use(a: &NbdPerfArgs, c0: &Conn, export: &str, bs: u64) -> Result<u64, String> {
    let (export_size, flags) = (c0.size, c0.flags);
    let writes = a.pattern != Pattern::Randread;
    if writes && flags & proto::TFLAG_READ_ONLY != 0 {
        return Err(format!(
            "export {export:?} is read-only; use --pattern randread"
        ));
    }
    if let Some((min, _, max)) = c0.block_size {
        if !bs.is_multiple_of(min as u64) || bs > max as u64 {
            return Err(format!(
                "--bs {} does not suit the export: the server wants multiples of {min} \
                 bytes up to {}",
                format_size(bs),
                format_size(max as u64)
            ));
        }
    }
    let size = match &a.size {
        Some(s) => {
            let s = parse_size(s).map_err(|e| format!("--size: {e}"))?;
            if s > export_size {
                return Err(format!(
                    "--size {} is larger than the export ({})",
                    format_size(s),
                    format_size(export_size)
                ));
            }
            s
        }
        None => export_size,
    };
    let blocks = size / bs;
    if blocks == 0 {
        return Err(format!(
            "the range used ({} bytes) is smaller than one block",
            size
        ));
    }
    Ok(blocks)
}

pub fn run(a: NbdPerfArgs) -> Result<(), String> {
    let (addr, export) = match (&a.uri, &a.addr) {
        (Some(u), _) => parse_uri(u)?,
        (None, Some(addr)) => (addr.clone(), a.export.clone().unwrap_or_default()),
        (None, None) => return Err("give --uri nbd://HOST:PORT/EXPORT or --addr".into()),
    };
    let bs = parse_size(&a.bs).map_err(|e| format!("--bs: {e}"))?;
    if bs == 0 || bs > proto::MAX_PAYLOAD as u64 {
        return Err(format!(
            "--bs must be between 1 byte and {}",
            format_size(proto::MAX_PAYLOAD as u64)
        ));
    }
    if a.qd == 0 || a.qd > 4096 {
        return Err("--qd must be 1..4096".into());
    }
    if a.conns == 0 || a.conns > 256 {
        return Err("--conns must be 1..256".into());
    }
    if a.rwmix_read > 100 {
        return Err("--rwmix-read is a percentage (0..100)".into());
    }
    if a.time == 0 {
        return Err("--time must be at least 1 second".into());
    }
    let mut conns = Vec::with_capacity(a.conns);
    for i in 0..a.conns {
        let c = connect(&addr, &export).map_err(|e| format!("connection {i}: {e}"))?;
        conns.push(c);
    }
    let c0 = &conns[0];
    let (export_size, structured) = (c0.size, c0.structured);
    let blocks = match blocks_to_use(&a, c0, &export, bs) {
        Ok(b) => b,
        Err(e) => {
            for c in &conns {
                disconnect(&c.stream);
            }
            return Err(e);
        }
    };
    let target = format!(
        "nbd://{addr}/{export} ({} export, {} used, {} replies)",
        format_size(export_size),
        format_size(blocks * bs),
        if structured { "structured" } else { "simple" }
    );
    eprintln!(
        "nbd-perf: {target} — {:?} bs={} qd={} conns={} for {}s",
        a.pattern,
        format_size(bs),
        a.qd,
        a.conns,
        a.time
    );

    let (tx, rx) = channel();
    let progress = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(a.conns + 1));
    let duration = Duration::from_secs(a.time);
    let cpu0 = process_cpu();
    let mut threads = Vec::new();
    for (i, c) in conns.into_iter().enumerate() {
        let (tx, progress, barrier) = (tx.clone(), progress.clone(), barrier.clone());
        let (pattern, rwmix, qd, busy_poll) = (a.pattern, a.rwmix_read, a.qd, a.busy_poll);
        let seed = 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let t = std::thread::Builder::new()
            .name(format!("nbd-perf-{i}"))
            .spawn(move || {
                let mut e = Engine::new(pattern, rwmix, bs, blocks, qd, c.structured, seed);
                barrier.wait();
                let epoch = Instant::now();
                let r = perf_io::drive(
                    &mut e,
                    &c.stream,
                    epoch,
                    duration.as_nanos() as u64,
                    busy_poll,
                    &progress,
                    &WORDS,
                );
                let wall = epoch.elapsed();
                if r.is_ok() {
                    disconnect(&c.stream);
                }
                if let Err(err) = &r {
                    eprintln!("\nnbd-perf: connection {i}: {err}");
                }
                let _ = tx.send(Report {
                    conn: i,
                    ios: e.ios,
                    bytes: e.bytes,
                    errors: e.errors,
                    first_error: e.first_error.take(),
                    failure: r.err(),
                    hist: std::mem::take(&mut e.hist),
                    wall,
                });
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        threads.push(t);
    }
    drop(tx);
    barrier.wait();

    // Live progress, once a second.
    let t0 = Instant::now();
    let mut tick = t0;
    let mut last = 0;
    let mut reports = Vec::new();
    loop {
        let next = tick + Duration::from_secs(1);
        match rx.recv_timeout(next.saturating_duration_since(Instant::now())) {
            Ok(r) => reports.push(r),
            Err(RecvTimeoutError::Timeout) => {
                let now = Instant::now();
                let n = progress.load(Relaxed);
                let rate = (n - last) as f64 / now.duration_since(tick).as_secs_f64();
                (last, tick) = (n, now);
                eprint!(
                    "\r[{:>3}s/{}s] {:>10.0} IOPS {:>9.1} MiB/s",
                    t0.elapsed().as_secs_f64().round(),
                    a.time,
                    rate,
                    rate * bs as f64 / 1048576.0
                );
                let _ = io::stderr().flush();
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    eprintln!();
    for t in threads {
        let _ = t.join();
    }
    let cpu1 = process_cpu();
    let (user, sys) = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
    let cpu = user + sys;

    reports.sort_by_key(|r| r.conn);
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
        if first_error.is_none() {
            first_error = r.first_error.clone();
        }
        if let Some(f) = &r.failure {
            failures.push(format!("connection {}: {f}", r.conn));
        }
    }
    let secs = wall.as_secs_f64().max(1e-9);
    let iops = ios as f64 / secs;
    let mibps = bytes as f64 / secs / 1048576.0;
    let completed = ios + errors;
    let per_io = |d: Duration| {
        if completed > 0 {
            d.as_nanos() as f64 / completed as f64
        } else {
            0.0
        }
    };
    let cpu_ns_per_io = per_io(cpu);
    println!("target:     {target}");
    println!(
        "workload:   {:?} bs={} qd={} conns={} time={:.1}s",
        a.pattern,
        format_size(bs),
        a.qd,
        a.conns,
        secs
    );
    println!("throughput: {iops:.0} IOPS, {mibps:.1} MiB/s");
    crate::report::print_latency(&hist);
    println!(
        "client cpu: {:.0} ns per I/O (user {:.0}, sys {:.0}); {:.2} cores busy",
        cpu_ns_per_io,
        per_io(user),
        per_io(sys),
        cpu.as_secs_f64() / secs
    );
    if errors > 0 {
        println!(
            "errors:     {errors} (first: {})",
            first_error.as_deref().unwrap_or("?")
        );
    }
    for f in &failures {
        println!("failed:     {f}");
    }
    crate::report::print_result(iops, mibps, &hist, cpu_ns_per_io, errors);
    if !failures.is_empty() {
        return Err(format!(
            "{} of {} connections failed",
            failures.len(),
            a.conns
        ));
    }
    if errors > 0 && ios == 0 {
        return Err("every I/O failed".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            parse_uri("nbd://127.0.0.1:10899/vol0").unwrap(),
            ("127.0.0.1:10899".into(), "vol0".into())
        );
        assert_eq!(
            parse_uri("nbd://localhost/").unwrap(),
            ("localhost:10809".into(), "".into())
        );
        assert_eq!(
            parse_uri("nbd://[::1]:9/a%20b").unwrap(),
            ("[::1]:9".into(), "a b".into())
        );
        assert_eq!(
            parse_uri("nbd://[::1]").unwrap(),
            ("[::1]:10809".into(), "".into())
        );
        assert!(parse_uri("nbd+unix:///x?socket=/s").is_err());
        assert!(parse_uri("nbd:///x").is_err());
        assert!(parse_uri("nbd://h/%zz").is_err());
    }

    fn chunk(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, payload: &[u8]) {
        let mut b = [0u8; proto::STRUCTURED_REPLY_LEN];
        proto::encode_structured_reply(&mut b, flags, ty, cookie, payload.len() as u32);
        out.extend_from_slice(&b);
        out.extend_from_slice(payload);
    }

    /// Feed `bytes` to the engine in pieces of `step` bytes; returns completions.
    fn feed(e: &mut Engine, bytes: &[u8], step: usize) -> Result<u64, String> {
        let mut done = 0;
        for piece in bytes.chunks(step) {
            let space = e.b.recv_space();
            space[..piece.len()].copy_from_slice(piece);
            e.b.in_end += piece.len();
            done += e.parse(1000)?;
        }
        Ok(done)
    }

    #[test]
    fn structured_replies_parse_in_any_split() {
        for step in [1, 3, 7, 20, 64, 4096, 1 << 20] {
            let mut e = Engine::new(Pattern::Randread, 70, 512, 100, 4, true, 1);
            e.fill(0);
            assert_eq!(e.b.out.len(), 4 * proto::REQUEST_HEADER_LEN);
            e.issuing = false;
            let mut r = Vec::new();
            // Slot 2: two data chunks then DONE. Slot 0: hole + data. Slot 1: error.
            let data = |off: u64, n: usize| {
                let mut p = off.to_be_bytes().to_vec();
                p.extend(std::iter::repeat_n(0xab, n));
                p
            };
            chunk(&mut r, 0, proto::REPLY_TYPE_OFFSET_DATA, 2, &data(0, 256));
            let mut hole = 0u64.to_be_bytes().to_vec();
            hole.extend_from_slice(&256u32.to_be_bytes());
            chunk(&mut r, 0, proto::REPLY_TYPE_OFFSET_HOLE, 0, &hole);
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                2,
                &data(256, 256),
            );
            let mut err = proto::EIO.to_be_bytes().to_vec();
            err.extend_from_slice(&3u16.to_be_bytes());
            err.extend_from_slice(b"bad");
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_ERROR,
                1,
                &err,
            );
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                0,
                &data(256, 256),
            );
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                3,
                &data(0, 512),
            );
            assert_eq!(feed(&mut e, &r, step), Ok(4), "step {step}");
            assert_eq!((e.ios, e.errors, e.inflight), (3, 1, 0));
            assert!(e.first_error.as_deref().unwrap().contains("bad"));
            assert_eq!(e.hist.count(), 4);
        }
    }

    #[test]
    fn simple_replies_and_reissue() {
        let mut e = Engine::new(Pattern::Randrw, 50, 4096, 1000, 8, false, 7);
        e.fill(0);
        let first = e.b.out.len();
        let mut r = Vec::new();
        for slot in 0..8u64 {
            let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
            proto::encode_simple_reply(&mut h, 0, slot);
            r.extend_from_slice(&h);
            if !e.slots[slot as usize].write {
                r.extend(std::iter::repeat_n(0u8, 4096));
            }
        }
        assert_eq!(feed(&mut e, &r, 1000), Ok(8));
        // Every completion was reissued.
        assert_eq!(e.inflight, 8);
        assert!(e.b.out.len() > first);
        // A reply to a slot that is not outstanding is fatal.
        let mut e = Engine::new(Pattern::Randread, 70, 4096, 1000, 2, false, 7);
        let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
        proto::encode_simple_reply(&mut h, 0, 5);
        assert!(feed(&mut e, &h, 16).is_err());
    }

    #[test]
    fn requests_are_aligned_and_in_range() {
        let mut e = Engine::new(Pattern::Randwrite, 70, 4096, 10, 64, true, 3);
        e.fill(0);
        let stride = proto::REQUEST_HEADER_LEN + 4096;
        assert_eq!(e.b.out.len(), 64 * stride);
        let out = e.b.out.to_vec(&e.b.payload);
        for i in 0..64 {
            assert_eq!(
                &out[i * stride + proto::REQUEST_HEADER_LEN..][..4096],
                &e.b.payload[..]
            );
            let h = proto::parse_request(&out[i * stride..]).unwrap().unwrap();
            assert_eq!(
                (h.cmd, h.cookie, h.length),
                (proto::CMD_WRITE, i as u64, 4096)
            );
            assert!(h.offset.is_multiple_of(4096) && h.offset < 10 * 4096);
        }
    }
}
