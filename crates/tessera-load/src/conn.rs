//! What the pipelined load generators (`nbd-perf`, `nvmf perf`) share: the send queue,
//! non-blocking socket calls, the queue-depth window of one connection ([`Core`]), the
//! loop that drives it ([`drive`]) and the run over several connections with its
//! progress line and totals ([`run`]). A protocol adds only its wire format
//! ([`Protocol`]).
//!
//! The loop never blocks in a send: requests leave through non-blocking `sendmsg`, and
//! while some are still queued the thread `poll`s for both directions, taking in replies
//! as they come. A target that stops reading until its replies have been taken (as an
//! NVMe/TCP target asking for write data with R2T, or any server whose send buffer is
//! full, may) therefore cannot deadlock the tool.

use crate::error::LoadError;
use std::collections::VecDeque;
use std::io::{self, Write as _};
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use tessera_io::cast::{usize_of, DurationU64};

use clap::Args;
use tessera_device::{format_size, parse_size};
use tessera_io::hist::Histogram;

use crate::report;
use crate::workload::{mixed_is_write, Pattern, Rng};

/// A connection with requests outstanding and nothing received for this long is given up.
pub const STALL: Duration = Duration::from_secs(10);

/// iovecs per `sendmsg` (Linux's IOV_MAX).
const MAX_IOV: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seg {
    /// The next `n` bytes of the queue's own byte buffer.
    Bytes(usize),
    /// A range of the payload passed to [`SendQueue::send`].
    Payload { at: usize, len: usize },
}

/// Bytes waiting to be sent, in order: small pieces (headers) copied in, large data
/// referred to as ranges of one payload buffer and sent from there with `sendmsg`
/// (so a 1 MiB write costs no copy however many are queued).
#[derive(Default)]
pub struct SendQueue {
    bytes: Vec<u8>,
    /// Start of the unsent part of `bytes`.
    bytes_pos: usize,
    segs: VecDeque<Seg>,
    /// Bytes of `segs[0]` already sent.
    front_sent: usize,
    pending: usize,
    iov: Vec<libc::iovec>,
}

// SAFETY: `iov` is scratch space filled and used within one `send` call; its pointers are
// never dereferenced outside it, so moving the queue to another thread is sound.
unsafe impl Send for SendQueue {}

impl SendQueue {
    pub fn with_capacity(n: usize) -> SendQueue {
        SendQueue {
            bytes: Vec::with_capacity(n),
            ..SendQueue::default()
        }
    }

    /// Bytes not yet handed to the kernel.
    pub fn len(&self) -> usize {
        self.pending
    }

    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Queue a copy of `b`.
    pub fn push_bytes(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        self.bytes.extend_from_slice(b);
        self.pending += b.len();
        match self.segs.back_mut() {
            Some(Seg::Bytes(n)) => *n += b.len(),
            _ => self.segs.push_back(Seg::Bytes(b.len())),
        }
    }

    /// Queue `r` of the payload (given again to every `send`).
    pub fn push_payload(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        self.pending += r.len();
        self.segs.push_back(Seg::Payload {
            at: r.start,
            len: r.len(),
        });
    }

    /// Everything queued, as one buffer (for tests).
    #[cfg(test)]
    pub fn to_vec(&self, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.pending);
        let mut pos = self.bytes_pos;
        for (i, s) in self.segs.iter().enumerate() {
            let skip = if i == 0 { self.front_sent } else { 0 };
            match *s {
                Seg::Bytes(n) => {
                    v.extend_from_slice(&self.bytes[pos + skip..pos + n]);
                    pos += n;
                }
                Seg::Payload { at, len } => v.extend_from_slice(&payload[at + skip..at + len]),
            }
        }
        v
    }

    /// One non-blocking `sendmsg` of as much as the kernel takes; `Ok(0)` when the socket
    /// buffer is full.
    pub fn send(&mut self, fd: RawFd, payload: &[u8]) -> io::Result<usize> {
        if self.is_empty() {
            return Ok(0);
        }
        self.iov.clear();
        let mut pos = self.bytes_pos;
        for (i, s) in self.segs.iter().enumerate() {
            if self.iov.len() == MAX_IOV {
                break;
            }
            let skip = if i == 0 { self.front_sent } else { 0 };
            let (p, n): (*const u8, usize) = match *s {
                Seg::Bytes(n) => {
                    let p = self.bytes[pos + skip..pos + n].as_ptr();
                    pos += n;
                    (p, n - skip)
                }
                Seg::Payload { at, len } => (payload[at + skip..at + len].as_ptr(), len - skip),
            };
            self.iov.push(libc::iovec {
                iov_base: p as *mut libc::c_void,
                iov_len: n,
            });
        }
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = self.iov.as_mut_ptr();
        msg.msg_iovlen = self.iov.len() as _;
        let n = loop {
            // SAFETY: the iovecs point into `self.bytes` and `payload`, both alive and
            // unchanged for the duration of the call.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(e),
            }
        };
        self.consume(n);
        Ok(n)
    }

    fn consume(&mut self, mut n: usize) {
        self.pending -= n;
        while n > 0 {
            let s = self.segs[0];
            let len = match s {
                Seg::Bytes(len) | Seg::Payload { len, .. } => len,
            };
            let left = len - self.front_sent;
            if n < left {
                self.front_sent += n;
                return;
            }
            n -= left;
            self.front_sent = 0;
            self.segs.pop_front();
            if let Seg::Bytes(len) = s {
                self.bytes_pos += len;
            }
        }
        if self.bytes_pos == self.bytes.len() {
            self.bytes.clear();
            self.bytes_pos = 0;
        } else if self.bytes_pos >= 1 << 20 && self.bytes_pos * 2 >= self.bytes.len() {
            self.bytes.drain(..self.bytes_pos);
            self.bytes_pos = 0;
        }
    }
}

/// `recv`; `Ok(None)` when nothing arrived (non-blocking, or the receive timeout hit).
pub fn recv_some(fd: RawFd, b: &mut [u8], dontwait: bool) -> io::Result<Option<usize>> {
    let flags = if dontwait { libc::MSG_DONTWAIT } else { 0 };
    loop {
        // SAFETY: b is a valid writable slice for its length.
        let n = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), b.len(), flags) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Wait until the socket is readable or writable; returns `(readable, writable)`.
pub fn poll_rw(fd: RawFd, timeout: Duration) -> io::Result<(bool, bool)> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe {
            libc::poll(
                &mut p,
                1,
                libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX),
            )
        };
        if n >= 0 {
            let err = p.revents & (libc::POLLERR | libc::POLLHUP) != 0;
            return Ok((
                p.revents & libc::POLLIN != 0 || err,
                p.revents & libc::POLLOUT != 0,
            ));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The byte streams of one connection: requests queued to send (with the payload they
/// refer to) and replies received, not yet parsed: `inb[in_start..in_end]`.
pub struct Buffers {
    pub out: SendQueue,
    /// Data sent with every write (from here, never copied).
    pub payload: Vec<u8>,
    pub inb: Vec<u8>,
    pub in_start: usize,
    pub in_end: usize,
    /// Room kept after `in_end` for the largest reply that must be whole to be parsed.
    room: usize,
}

impl Buffers {
    pub fn new(payload: Vec<u8>, recv_buf: usize, room: usize, out: usize) -> Buffers {
        assert!(room <= recv_buf / 2);
        Buffers {
            out: SendQueue::with_capacity(out),
            payload,
            inb: vec![0; recv_buf],
            in_start: 0,
            in_end: 0,
            room,
        }
    }

    /// Room to receive into, after moving any partial reply to the front when the tail
    /// is short.
    pub fn recv_space(&mut self) -> &mut [u8] {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.inb.len() - self.in_end < self.room {
            self.inb.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        &mut self.inb[self.in_end..]
    }

    /// Send what the kernel takes now, without blocking.
    pub fn send(&mut self, fd: RawFd) -> io::Result<usize> {
        self.out.send(fd, &self.payload)
    }
}

/// One outstanding request of a connection.
#[derive(Clone, Copy, Default)]
pub struct Slot {
    /// Submit time, ns since the run's epoch.
    pub start: u64,
    pub write: bool,
    pub busy: bool,
    pub failed: bool,
}

/// What one connection has measured.
#[derive(Default)]
pub struct Stats {
    pub hist: Histogram,
    pub ios: u64,
    pub bytes: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

/// The protocol-independent part of one connection: the workload, the queue-depth window
/// of slots (a request's slot index is its cookie or command ID), the byte streams and
/// the statistics.
pub struct Core {
    pattern: Pattern,
    rwmix_read: u64,
    pub bs: u64,
    blocks: u64,
    rng: Rng,
    pub slots: Vec<Slot>,
    pub inflight: usize,
    /// New requests are issued as slots complete (false once the time is up).
    pub issuing: bool,
    pub b: Buffers,
    pub stats: Stats,
}

impl Core {
    /// `qd` slots over `blocks` blocks of `bs` bytes from offset 0.
    pub fn new(w: &Workload, blocks: u64, qd: usize, rng: Rng, b: Buffers) -> Core {
        Core {
            pattern: w.pattern,
            rwmix_read: w.rwmix_read as u64,
            bs: w.bs,
            blocks,
            rng: rng.odd(),
            slots: vec![Slot::default(); qd],
            inflight: 0,
            issuing: true,
            b,
            stats: Stats::default(),
        }
    }

    /// Draw the next request and mark `slot` busy with it; returns (write, byte offset).
    #[inline]
    fn begin(&mut self, slot: usize, now: u64) -> (bool, u64) {
        let r = self.rng.next_u64();
        let write = match self.pattern {
            Pattern::Randread => false,
            Pattern::Randwrite => true,
            Pattern::Randrw => mixed_is_write(r, self.rwmix_read),
        };
        self.slots[slot] = Slot {
            start: now,
            write,
            busy: true,
            failed: false,
        };
        self.inflight += 1;
        (write, (r % self.blocks) * self.bs)
    }

    /// Account for the answer to `slot`; returns whether to issue a new request in it.
    #[inline]
    fn finish(&mut self, slot: usize, now: u64) -> bool {
        let s = &mut self.slots[slot];
        s.busy = false;
        self.inflight -= 1;
        self.stats.hist.record(now.saturating_sub(s.start));
        if s.failed {
            self.stats.errors += 1;
        } else {
            self.stats.ios += 1;
            self.stats.bytes += self.bs;
        }
        self.issuing
    }

    /// Mark `slot` failed; `describe(write)` gives the error text if it is the first one.
    pub fn fail(&mut self, slot: usize, describe: impl FnOnce(bool) -> String) {
        let s = &mut self.slots[slot];
        s.failed = true;
        if self.stats.first_error.is_none() {
            self.stats.first_error = Some(describe(s.write));
        }
    }

    /// The slot an answer's ID refers to; anything but an outstanding request means the
    /// peer (or our parsing) is broken and the stream cannot be trusted.
    pub fn slot_of(&self, id: u64, what: impl FnOnce() -> String) -> Result<usize, LoadError> {
        match self.slots.get(usize_of(id)) {
            Some(s) if s.busy => Ok(usize_of(id)),
            _ => Err(LoadError::Protocol(what())),
        }
    }
}

/// The wire format of one protocol: how a request is encoded and how answers are parsed.
/// The loop around it ([`drive`], [`run`]) is the same for every protocol.
pub trait Protocol: Sized + Send + 'static {
    /// Name of the tool, for thread names and messages ("nbd-perf").
    const TOOL: &'static str;
    /// Words for the error messages.
    const WORDS: Words;
    /// Queue the request just drawn for `slot` into `c.b.out`.
    fn encode(&mut self, c: &mut Core, slot: usize, write: bool, offset: u64);
    /// Parse every complete answer in `c.b`, calling [`Protocol::complete`] for each
    /// request answered; returns how many were.
    fn parse(&mut self, c: &mut Core, now: u64) -> Result<u64, LoadError>;
    /// The name of connection `index` in messages ("connection 0", "queue 1").
    fn conn_name(index: usize) -> String;
    /// Close the connection after the run (`clean`: it ended without a failure).
    fn close(stream: &TcpStream, clean: bool);

    /// Issue a new request in `slot`.
    #[inline]
    fn issue(&mut self, c: &mut Core, slot: usize, now: u64) {
        let (write, offset) = c.begin(slot, now);
        self.encode(c, slot, write, offset);
    }

    /// The request in `slot` is answered: account for it and reissue the slot.
    #[inline]
    fn complete(&mut self, c: &mut Core, slot: usize, now: u64) {
        if c.finish(slot, now) {
            self.issue(c, slot, now);
        }
    }
}

/// One connection: the shared core and the protocol's own state.
pub struct Conn<P> {
    pub core: Core,
    pub proto: P,
}

impl<P: Protocol> Conn<P> {
    /// Issue a request in every slot.
    pub fn fill(&mut self, now: u64) {
        for s in 0..self.core.slots.len() {
            self.proto.issue(&mut self.core, s, now);
        }
    }

    /// Parse every complete answer received; returns how many requests completed.
    pub fn parse(&mut self, now: u64) -> Result<u64, LoadError> {
        self.proto.parse(&mut self.core, now)
    }
}

/// Words for the error messages of one protocol.
pub struct Words {
    /// "requests", "commands".
    pub requests: &'static str,
    /// "server", "target".
    pub peer: &'static str,
    /// "connection", "queue".
    pub conn: &'static str,
}

/// Run one connection until `deadline_ns` (ns since `epoch`), then drain it.
pub fn drive<P: Protocol>(
    c: &mut Conn<P>,
    stream: &TcpStream,
    epoch: Instant,
    deadline_ns: u64,
    busy_poll: bool,
    progress: &AtomicU64,
) -> Result<(), LoadError> {
    let w = &P::WORDS;
    let fd = stream.as_raw_fd();
    // A blocking recv wakes up at least once a second to notice a stalled peer.
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|err| LoadError::io("setting the receive timeout", err))?;
    let now_ns = || epoch.elapsed().nanos_u64();
    c.fill(now_ns());
    let mut last_progress = Instant::now();
    loop {
        let b = &mut c.core.b;
        if !b.out.is_empty() {
            let n = b
                .send(fd)
                .map_err(|err| LoadError::io(format!("sending {}", w.requests), err))?;
            if n > 0 {
                last_progress = Instant::now();
            }
        }
        let queued = b.out.len();
        if c.core.inflight == 0 && queued == 0 {
            return Ok(());
        }
        let got = if busy_poll {
            recv_some(fd, b.recv_space(), true)
        } else if queued == 0 {
            recv_some(fd, b.recv_space(), false)
        } else {
            // Part of the batch is still queued: wait for either direction, so a peer
            // that stops reading until we take its replies cannot deadlock us.
            match poll_rw(fd, Duration::from_secs(1)) {
                Ok((true, _)) => recv_some(fd, b.recv_space(), true),
                Ok((false, true)) => continue,
                Ok((false, false)) => Ok(None),
                Err(err) => Err(err),
            }
        }
        .map_err(|err| LoadError::io("receiving replies", err))?;
        match got {
            None => {
                if last_progress.elapsed() >= STALL {
                    return Err(LoadError::Failed(format!(
                        "no progress for {} s with {} {} outstanding ({queued} bytes \
                         unsent); giving up on this {}",
                        STALL.as_secs(),
                        c.core.inflight,
                        w.requests,
                        w.conn
                    )));
                }
            }
            Some(0) => {
                return Err(LoadError::Protocol(format!(
                    "the {} closed the {} with {} {} outstanding",
                    w.peer, w.conn, c.core.inflight, w.requests
                )))
            }
            Some(n) => {
                c.core.b.in_end += n;
                let now = now_ns();
                if now >= deadline_ns {
                    c.core.issuing = false;
                }
                let done = c.parse(now)?;
                if done > 0 {
                    last_progress = Instant::now();
                    progress.fetch_add(done, Relaxed);
                }
            }
        }
    }
}

/// The workload options `nbd-perf` and `nvmf perf` share.
#[derive(Args, Clone, Debug)]
pub struct LoadArgs {
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub pattern: Pattern,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 70)]
    pub rwmix_read: u32,
    /// Block size of each request, e.g. 4K.
    #[arg(long, default_value = "4K")]
    pub bs: String,
    /// Requests kept outstanding per connection (NVMe/TCP: commands per queue).
    #[arg(long, default_value_t = 128)]
    pub qd: usize,
    /// Seconds to run.
    #[arg(long, default_value_t = 10)]
    pub time: u64,
    /// Bytes of the export or namespace to use, from offset 0 (default: all of it).
    #[arg(long)]
    pub size: Option<String>,
    /// Spin on non-blocking receives instead of sleeping in them: takes the client's
    /// wake-up latency out of low-queue-depth latencies, at the price of a busy core per
    /// connection.
    #[arg(long)]
    pub busy_poll: bool,
}

impl LoadArgs {
    /// The workload, with the block size checked against `max_bs`.
    pub fn workload(&self, max_bs: u64) -> Result<Workload, LoadError> {
        let bs = parse_size(&self.bs).map_err(|e| LoadError::invalid(format!("--bs: {e}")))?;
        if bs == 0 || bs > max_bs {
            return Err(LoadError::invalid(format!(
                "--bs must be between 1 byte and {}",
                format_size(max_bs)
            )));
        }
        if self.rwmix_read > 100 {
            return Err(LoadError::invalid("--rwmix-read is a percentage (0..100)"));
        }
        if self.time == 0 {
            return Err(LoadError::invalid("--time must be at least 1 second"));
        }
        Ok(Workload {
            pattern: self.pattern,
            rwmix_read: self.rwmix_read,
            bs,
            time: self.time,
            busy_poll: self.busy_poll,
        })
    }

    /// `--size` in bytes, or `all` when not given.
    pub fn size_or(&self, all: u64) -> Result<u64, LoadError> {
        match &self.size {
            Some(s) => parse_size(s).map_err(|e| LoadError::invalid(format!("--size: {e}"))),
            None => Ok(all),
        }
    }
}

/// The workload every connection of a run shares.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub pattern: Pattern,
    /// Read percentage of `Randrw`.
    pub rwmix_read: u32,
    /// Bytes per request.
    pub bs: u64,
    /// Seconds to run.
    pub time: u64,
    pub busy_poll: bool,
}

/// What one connection reports at the end of a run.
struct Report {
    conn: usize,
    stats: Stats,
    failure: Option<String>,
    wall: Duration,
}

/// The figures of a whole run, over all its connections.
pub struct Totals {
    pub hist: Histogram,
    pub ios: u64,
    pub bytes: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// "connection 1: ..." for every connection that failed.
    pub failures: Vec<String>,
    /// The longest connection's run time.
    pub wall: Duration,
    /// Process CPU time (user, system) during the run.
    pub cpu: (Duration, Duration),
    conns: usize,
    conn_word: &'static str,
}

impl Totals {
    pub fn secs(&self) -> f64 {
        self.wall.as_secs_f64().max(1e-9)
    }

    pub fn iops(&self) -> f64 {
        self.ios as f64 / self.secs()
    }

    pub fn mibps(&self) -> f64 {
        self.bytes as f64 / self.secs() / 1048576.0
    }

    /// CPU time `d` per completed request, in ns.
    pub fn per_io(&self, d: Duration) -> f64 {
        let completed = self.ios + self.errors;
        if completed > 0 {
            d.as_nanos() as f64 / completed as f64
        } else {
            0.0
        }
    }

    pub fn cpu_ns_per_io(&self) -> f64 {
        self.per_io(self.cpu.0 + self.cpu.1)
    }

    /// The throughput and latency lines.
    pub fn print_figures(&self) {
        println!(
            "throughput: {:.0} IOPS, {:.1} MiB/s",
            self.iops(),
            self.mibps()
        );
        report::print_latency(&self.hist);
    }

    /// The error lines and the RESULT line; the run's outcome.
    pub fn print_outcome(&self) -> Result<(), LoadError> {
        if self.errors > 0 {
            println!(
                "errors:     {} (first: {})",
                self.errors,
                self.first_error.as_deref().unwrap_or("?")
            );
        }
        for f in &self.failures {
            println!("failed:     {f}");
        }
        report::print_result(
            self.iops(),
            self.mibps(),
            &self.hist,
            self.cpu_ns_per_io(),
            self.errors,
        );
        if !self.failures.is_empty() {
            return Err(LoadError::Failed(format!(
                "{} of {} {}s failed",
                self.failures.len(),
                self.conns,
                self.conn_word
            )));
        }
        if self.errors > 0 && self.ios == 0 {
            return Err(LoadError::Failed("every I/O failed".into()));
        }
        Ok(())
    }
}

/// Drive every connection from its own thread for `w.time` seconds, showing the progress
/// on stderr once a second, and add up what they measured.
pub fn run<P: Protocol>(
    w: &Workload,
    conns: Vec<(TcpStream, Conn<P>)>,
) -> Result<Totals, LoadError> {
    let n = conns.len();
    let (tx, rx) = channel();
    let progress = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(Barrier::new(n + 1));
    let deadline_ns = Duration::from_secs(w.time).nanos_u64();
    let cpu0 = report::cpu_time(libc::RUSAGE_SELF);
    let mut threads = Vec::with_capacity(n);
    for (i, (stream, mut c)) in conns.into_iter().enumerate() {
        let (tx, progress, barrier) = (tx.clone(), progress.clone(), barrier.clone());
        let busy_poll = w.busy_poll;
        let t = std::thread::Builder::new()
            .name(format!("{}-{i}", P::TOOL))
            .spawn(move || {
                barrier.wait();
                let epoch = Instant::now();
                let r = drive(&mut c, &stream, epoch, deadline_ns, busy_poll, &progress);
                let wall = epoch.elapsed();
                P::close(&stream, r.is_ok());
                if let Err(err) = &r {
                    eprintln!("\n{}: {}: {err}", P::TOOL, P::conn_name(i));
                }
                let _ = tx.send(Report {
                    conn: i,
                    stats: std::mem::take(&mut c.core.stats),
                    failure: r.err().map(|e| e.to_string()),
                    wall,
                });
            })
            .map_err(|e| LoadError::io("cannot start a thread", e))?;
        threads.push(t);
    }
    drop(tx);
    barrier.wait();
    let mut reports = show_progress(&rx, &progress, w);
    for t in threads {
        let _ = t.join();
    }
    let cpu1 = report::cpu_time(libc::RUSAGE_SELF);
    reports.sort_by_key(|r| r.conn);
    let mut t = Totals {
        hist: Histogram::default(),
        ios: 0,
        bytes: 0,
        errors: 0,
        first_error: None,
        failures: Vec::new(),
        wall: Duration::ZERO,
        cpu: (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1),
        conns: n,
        conn_word: P::WORDS.conn,
    };
    for r in reports {
        t.hist.merge(&r.stats.hist);
        t.ios += r.stats.ios;
        t.bytes += r.stats.bytes;
        t.errors += r.stats.errors;
        t.wall = t.wall.max(r.wall);
        t.first_error = t.first_error.or(r.stats.first_error);
        if let Some(f) = r.failure {
            t.failures.push(format!("{}: {f}", P::conn_name(r.conn)));
        }
    }
    Ok(t)
}

/// Print the rate once a second until every connection has reported; returns the reports.
fn show_progress(rx: &Receiver<Report>, progress: &AtomicU64, w: &Workload) -> Vec<Report> {
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
                    w.time,
                    rate,
                    rate * w.bs as f64 / 1048576.0
                );
                let _ = io::stderr().flush();
            }
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    eprintln!();
    reports
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_io::cast::u8_of;

    #[test]
    fn send_queue_keeps_order_across_partial_sends() {
        let payload: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let mut q = SendQueue::default();
        let mut want = Vec::new();
        for i in 0..50usize {
            let h = vec![u8_of(i); 1 + i % 7];
            q.push_bytes(&h);
            want.extend_from_slice(&h);
            let r = (i * 997) % 90_000..(i * 997) % 90_000 + 1 + i * 113;
            q.push_payload(r.clone());
            want.extend_from_slice(&payload[r]);
        }
        assert_eq!(q.len(), want.len());
        assert_eq!(q.to_vec(&payload), want);
        // Through a socket pair with a small buffer: many partial sends.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 3000];
            loop {
                let n = recv_some(b.as_raw_fd(), &mut buf, false).unwrap().unwrap();
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&buf[..n]);
            }
        });
        let mut sent = 0;
        while !q.is_empty() {
            let n = q.send(a.as_raw_fd(), &payload).unwrap();
            sent += n;
            if n == 0 {
                poll_rw(a.as_raw_fd(), Duration::from_millis(100)).unwrap();
            }
            assert_eq!(q.len(), want.len() - sent);
        }
        drop(a);
        assert_eq!(reader.join().unwrap(), want);
        // Emptied: the byte buffer starts over.
        assert_eq!((q.bytes.len(), q.bytes_pos, q.segs.len()), (0, 0, 0));
    }
}
