//! The NBD transmission phase, served on one reactor core.
//!
//! A connection keeps one receive posted into its buffer, parses every complete request in
//! what arrives, and dispatches each to the volume at once: requests run concurrently and
//! their replies go out in completion order, not request order (seed 000: the block layer
//! already orders what must be ordered). Replies that complete while a send is in flight
//! are gathered and leave together in the next `sendmsg` (temporal merge, seed 003).
//!
//! Per request there is no heap allocation: slots are preallocated, data buffers come from
//! the core's pool, and reply headers live in the slot.

use std::os::fd::{AsRawFd, OwnedFd};

use io_uring::{opcode, types};
use tessera_io::{AlignedBuf, CoreIo, IoHandle, IoOp, Reactor, Task};
use tessera_pool::{IoClass, IoStats, VolumeHandle};

use crate::proto::*;

/// Requests a connection may have in flight; more wait in the socket buffer.
pub const MAX_IN_FLIGHT: usize = 512;
const RBUF_CAP: usize = 1 << 20;
/// Receive size while the core is contended: about one share round of 4 KiB writes
/// (tessera_qos::shares::ROUND_BUDGET requests with their headers).
const RECV_CONTENDED: usize = 68 << 10;
/// iovecs per sendmsg (the kernel's IOV_MAX is 1024).
const MAX_IOV: usize = 1024;
const SLOT_RECV: u32 = u32::MAX;
const SLOT_SEND: u32 = u32::MAX - 1;
const SLOT_QOS: u32 = u32::MAX - 2;
const SLOT_ROUND: u32 = u32::MAX - 3;
/// Re-exported for other protocols' connections (NVMe/TCP queues), which share the same
/// per-core limiters and scheduler.
pub use tessera_qos::gate::{core_limiter, Gate};

/// Decides whether a client waits on each reply (queue depth 1), in which case its core
/// polls for the next request: on this kind of machine a wakeup costs more than serving
/// a request, while a deep-queue client is served best by sleeping (requests pile up
/// meanwhile and one send answers many) and needs the CPU that polling would burn.
///
/// The client's queue depth is estimated from cookies while the core sleeps: clients such
/// as libnbd number requests sequentially, and requests pile up while we sleep, so a new
/// request's cookie minus the cookie of the last reply we sent is about the depth.
/// Clients with other cookie schemes look deep and get the safe default: sleeping.
/// While polling, the server outruns any client, so everything a client has outstanding
/// waits on its side and even a deep queue looks shallow: latency mode therefore ends
/// every LATENCY_PROBE to measure again while sleeping.
/// Public so NVMe/TCP queues use the same policy (fed with their own request sequence).
#[derive(Default)]
pub struct LatencyDetector {
    last_reply_cookie: u64,
    shallow_streak: u32,
    since: Option<std::time::Instant>,
}

impl LatencyDetector {
    pub fn on_reply(&mut self, cookie: u64) {
        self.last_reply_cookie = cookie;
    }

    pub fn on_request(&mut self, cookie: u64, now: std::time::Instant) {
        if let Some(since) = self.since {
            if now.duration_since(since) >= LATENCY_PROBE {
                self.since = None;
                self.shallow_streak = 0;
            }
            return;
        }
        if cookie.wrapping_sub(self.last_reply_cookie) <= 2 {
            self.shallow_streak += 1;
            if self.shallow_streak >= LATENCY_STREAK {
                self.since = Some(now);
            }
        } else {
            self.shallow_streak = 0;
        }
    }

    pub fn active(&self) -> bool {
        self.since.is_some()
    }
}

/// Consecutive requests (seen while sleeping) from a client with at most two outstanding
/// that make the core poll for this connection's next request instead of sleeping.
const LATENCY_STREAK: u32 = 64;
/// How long latency mode lasts before the connection is looked at again while sleeping.
const LATENCY_PROBE: std::time::Duration = std::time::Duration::from_millis(100);
/// Extents per BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 8192;

/// What the handshake agreed on.
#[derive(Clone, Debug, Default)]
pub struct ConnOptions {
    pub structured_replies: bool,
    pub base_allocation: Option<u32>,
    pub read_only: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    /// Receiving a large WRITE payload straight into the slot buffer.
    Payload,
    Io,
    /// Data written; the FUA flush is in flight.
    FuaFlush,
    Reply,
}

struct Slot {
    phase: Phase,
    cookie: u64,
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
    buf: Option<AlignedBuf>,
    /// When the request was received (for latency figures).
    start: std::time::Instant,
    hdr: [u8; 32],
    hdr_len: u8,
    data_len: u32,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            phase: Phase::Free,
            cookie: 0,
            cmd: 0,
            flags: 0,
            offset: 0,
            len: 0,
            buf: None,
            start: std::time::Instant::now(),
            hdr: [0; 32],
            hdr_len: 0,
            data_len: 0,
        }
    }
}

pub struct NbdConn {
    fd: OwnedFd,
    id: u32,
    vol: VolumeHandle,
    opts: ConnOptions,
    rbuf: AlignedBuf,
    rstart: usize,
    rend: usize,
    recv_posted: bool,
    /// Slot receiving a large payload, and how many bytes of it have arrived.
    payload: Option<(u16, usize)>,
    slots: Vec<Slot>,
    free: Vec<u16>,
    outq: Vec<u16>,
    sending: Vec<u16>,
    iov: Vec<libc::iovec>,
    iov_at: usize,
    msg: Box<libc::msghdr>,
    send_posted: bool,
    in_io: usize,
    /// No more requests will be read (DISC, EOF, protocol error).
    draining: bool,
    /// Latency mode: the client waits on each reply, so the core polls for its next
    /// request instead of sleeping (see `on_recv`). Entered after LATENCY_STREAK receives
    /// of a single request while sleeping; left every LATENCY_PROBE to look again.
    latency: LatencyDetector,
    /// QoS admission: the volume's and its group's limits, then the core's shares.
    gate: Gate,
    released: Vec<tessera_qos::gate::Released>,
    /// Replies queued in this batch, to account when it is flushed.
    unrecorded: Vec<(IoClass, u64, std::time::Instant, bool)>,
    stats: std::sync::Arc<IoStats>,
    /// The peer is gone or misbehaved: nothing more is sent.
    dead: bool,
    shut: bool,
}

impl NbdConn {
    /// Build a connection on the core that will serve it (`io` is that core's context).
    pub fn new(io: &mut CoreIo, fd: OwnedFd, vol: VolumeHandle, opts: ConnOptions) -> NbdConn {
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let msg: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        let stats = vol.volume().register_stats();
        // The tags are set in `start`, once the task id is known.
        let gate = Gate::new(io, &vol.volume().qos, 0, 0);
        NbdConn {
            fd,
            id: 0,
            vol,
            opts,
            rbuf: AlignedBuf::zeroed(RBUF_CAP),
            rstart: 0,
            rend: 0,
            recv_posted: false,
            payload: None,
            slots: (0..MAX_IN_FLIGHT).map(|_| Slot::new()).collect(),
            free: (0..MAX_IN_FLIGHT as u16).rev().collect(),
            outq: Vec::with_capacity(MAX_IN_FLIGHT),
            sending: Vec::with_capacity(MAX_IN_FLIGHT),
            iov: Vec::with_capacity(MAX_IOV),
            iov_at: 0,
            msg,
            send_posted: false,
            in_io: 0,
            draining: false,
            latency: LatencyDetector::default(),
            gate,
            released: Vec::new(),
            unrecorded: Vec::with_capacity(MAX_IN_FLIGHT),
            stats,
            dead: false,
            shut: false,
        }
    }

    fn tag(&self, slot: u32) -> u64 {
        Reactor::tag(self.id, slot)
    }

    fn post_recv(&mut self, io: &mut CoreIo) {
        if self.recv_posted || self.draining {
            return;
        }
        let (ptr, len) = match self.payload {
            Some((s, got)) => {
                let slot = &mut self.slots[s as usize];
                let buf = slot.buf.as_mut().expect("payload buffer");
                // SAFETY: got < len <= capacity.
                (
                    unsafe { buf.as_mut_ptr().add(got) },
                    slot.len as usize - got,
                )
            }
            None => {
                if self.free.is_empty() {
                    return; // resume when a slot frees up
                }
                if self.rend == RBUF_CAP {
                    return; // parse() compacts first; a full buffer means a slot is awaited
                }
                // While volumes compete for this core, take about one share round of
                // requests per receive (see Gate::contended).
                let room = RBUF_CAP - self.rend;
                let len = if self.gate.contended() {
                    room.min(RECV_CONTENDED)
                } else {
                    room
                };
                // SAFETY: rend < RBUF_CAP.
                (unsafe { self.rbuf.as_mut_ptr().add(self.rend) }, len)
            }
        };
        let e = opcode::Recv::new(
            types::Fd(self.fd.as_raw_fd()),
            ptr,
            len.min(u32::MAX as usize) as u32,
        )
        .build()
        .user_data(self.tag(SLOT_RECV));
        // SAFETY: the buffer is owned by this connection, which outlives the operation
        // (finished() waits for it).
        unsafe { io.push_sqe(e) };
        self.recv_posted = true;
    }

    fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        self.recv_posted = false;
        if res <= 0 {
            // EOF or error: the client went away (or half-closed). Finish what is in
            // flight, send what can still be sent, then close.
            self.draining = true;
            if res < 0 {
                self.dead = true;
            }
            return;
        }
        let n = res as usize;
        match self.payload {
            Some((s, got)) => {
                let got = got + n;
                if got == self.slots[s as usize].len as usize {
                    self.payload = None;
                    self.admit_or_park(io, s);
                    self.parse(io);
                } else {
                    self.payload = Some((s, got));
                }
            }
            None => {
                self.rend += n;
                self.parse(io);
            }
        }
        self.post_recv(io);
    }

    /// Parse and dispatch every complete request in the receive buffer.
    fn parse(&mut self, io: &mut CoreIo) {
        while !self.draining && self.payload.is_none() {
            let avail = &self.rbuf.as_slice()[self.rstart..self.rend];
            let h = match parse_request(avail) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    eprintln!("tessera: nbd: closing connection: {e}");
                    self.draining = true;
                    self.dead = true;
                    break;
                }
            };
            let payload = if h.cmd == CMD_WRITE {
                h.length as usize
            } else {
                0
            };
            if h.cmd == CMD_WRITE && h.length > MAX_PAYLOAD {
                // We cannot skip 4 GiB of payload safely; the spec allows a disconnect.
                eprintln!("tessera: nbd: closing connection: write of {} bytes exceeds the {MAX_PAYLOAD}-byte limit", h.length);
                self.draining = true;
                self.dead = true;
                break;
            }
            let have = avail.len() - REQUEST_HEADER_LEN;
            let small = REQUEST_HEADER_LEN + payload <= RBUF_CAP / 2;
            if small && have < payload {
                break; // wait for the rest of the payload in the buffer
            }
            let Some(s) = self.free.pop() else { break };
            self.rstart += REQUEST_HEADER_LEN;
            // The batch timestamp, not a clock read per request.
            self.latency.on_request(h.cookie, io.now());
            let slot = &mut self.slots[s as usize];
            slot.cookie = h.cookie;
            slot.cmd = h.cmd;
            slot.flags = h.flags;
            slot.offset = h.offset;
            slot.len = h.length;
            slot.data_len = 0;
            slot.start = io.now();
            if payload > 0 {
                let mut buf = io.bufs.get(payload);
                let take = payload.min(have);
                buf.as_mut_slice()[..take]
                    .copy_from_slice(&self.rbuf.as_slice()[self.rstart..self.rstart + take]);
                self.rstart += take;
                slot.buf = Some(buf);
                if take < payload {
                    slot.phase = Phase::Payload;
                    self.payload = Some((s, take));
                    break;
                }
            }
            self.admit_or_park(io, s);
        }
        // Keep the unparsed tail at the front so the buffer never fills with consumed bytes.
        if self.rstart == self.rend {
            self.rstart = 0;
            self.rend = 0;
        } else if self.rstart > 0 && (self.rstart >= RBUF_CAP / 2 || self.rend == RBUF_CAP) {
            let n = self.rend - self.rstart;
            self.rbuf
                .as_mut_slice()
                .copy_within(self.rstart..self.rend, 0);
            self.rstart = 0;
            self.rend = n;
        }
    }

    fn in_bounds(&self, s: &Slot) -> bool {
        s.offset
            .checked_add(s.len as u64)
            .is_some_and(|e| e <= self.vol.size())
    }

    /// Start serving the request in slot `s`.
    fn dispatch(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let (cmd, flags, offset, len) = {
            let sl = &self.slots[idx];
            (sl.cmd, sl.flags, sl.offset, sl.len)
        };
        let writes = matches!(cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
        // DF only means something with structured replies; the handshake did not offer it.
        let known = if self.opts.structured_replies {
            CMD_FLAGS_KNOWN
        } else {
            CMD_FLAGS_KNOWN & !CMD_FLAG_DF
        };
        let err = if flags & !known != 0 {
            Some(EINVAL)
        } else if writes && self.opts.read_only {
            Some(EPERM)
        } else {
            None
        };
        if let Some(e) = err {
            return self.finish(io, s, e);
        }
        self.slots[idx].phase = Phase::Io;
        match cmd {
            CMD_READ => {
                if !self.in_bounds(&self.slots[idx]) {
                    return self.finish(io, s, EINVAL);
                }
                if len > MAX_PAYLOAD {
                    return self.finish(io, s, EOVERFLOW);
                }
                if len == 0 {
                    return self.finish(io, s, 0);
                }
                if self.opts.structured_replies && self.vol.is_hole(offset, len as u64) {
                    return self.finish_hole(io, s);
                }
                let mut buf = io.bufs.get(len as usize);
                let op = IoOp::Read {
                    offset,
                    len,
                    buf: buf.as_mut_ptr(),
                };
                self.slots[idx].buf = Some(buf);
                self.submit(io, op, tag);
            }
            CMD_WRITE => {
                if !self.in_bounds(&self.slots[idx]) {
                    return self.finish(io, s, ENOSPC);
                }
                let buf = self.slots[idx]
                    .buf
                    .as_ref()
                    .map_or(std::ptr::null(), |b| b.as_ptr());
                self.submit(io, IoOp::Write { offset, len, buf }, tag);
            }
            CMD_FLUSH => self.submit(io, IoOp::Flush, tag),
            CMD_TRIM => {
                if !self.in_bounds(&self.slots[idx]) {
                    return self.finish(io, s, EINVAL);
                }
                self.submit(
                    io,
                    IoOp::Discard {
                        offset,
                        len: len as u64,
                    },
                    tag,
                );
            }
            CMD_WRITE_ZEROES => {
                if !self.in_bounds(&self.slots[idx]) {
                    return self.finish(io, s, ENOSPC);
                }
                // Zeroing with NO_HOLE means writing real zeros: not fast.
                if flags & CMD_FLAG_FAST_ZERO != 0 && flags & CMD_FLAG_NO_HOLE != 0 {
                    return self.finish(io, s, ENOTSUP);
                }
                let may_unmap = flags & CMD_FLAG_NO_HOLE == 0;
                self.submit(
                    io,
                    IoOp::WriteZeroes {
                        offset,
                        len: len as u64,
                        may_unmap,
                    },
                    tag,
                );
            }
            CMD_CACHE => {
                // Data already lives on the devices; there is no cache tier to warm yet.
                let ok = self.in_bounds(&self.slots[idx]);
                self.finish(io, s, if ok { 0 } else { EINVAL });
            }
            CMD_BLOCK_STATUS => self.block_status(io, s),
            CMD_DISC => {
                // No reply; finish everything in flight, then close.
                self.release(io, s);
                self.draining = true;
            }
            _ => self.finish(io, s, EINVAL),
        }
    }

    fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: u64) {
        self.in_io += 1;
        // SAFETY: the buffer of every Read/Write submitted here is held by the request's
        // slot (`buf`), which keeps it until the completion for `tag` arrives; the
        // connection is not dropped while I/O is in flight (`finished` waits for
        // `in_io` to reach 0).
        unsafe { self.vol.submit(io, op, tag) };
    }

    fn block_status(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let Some(ctx) = self.opts.base_allocation else {
            return self.finish(io, s, EINVAL);
        };
        if self.slots[idx].len == 0 || !self.in_bounds(&self.slots[idx]) {
            return self.finish(io, s, EINVAL);
        }
        let (offset, len, flags) = (
            self.slots[idx].offset,
            self.slots[idx].len,
            self.slots[idx].flags,
        );
        let max = if flags & CMD_FLAG_REQ_ONE != 0 {
            1
        } else {
            MAX_EXTENTS
        };
        let runs = self.vol.volume().allocation_runs(offset, len as u64, max);
        let mut buf = io.bufs.get(4 + 8 * runs.len());
        let b = buf.as_mut_slice();
        b[0..4].copy_from_slice(&ctx.to_be_bytes());
        for (i, (l, alloc)) in runs.iter().enumerate() {
            let st = if *alloc { 0 } else { STATE_HOLE | STATE_ZERO };
            b[4 + 8 * i..8 + 8 * i].copy_from_slice(&(*l as u32).to_be_bytes());
            b[8 + 8 * i..12 + 8 * i].copy_from_slice(&st.to_be_bytes());
        }
        let plen = (4 + 8 * runs.len()) as u32;
        let sl = &mut self.slots[idx];
        encode_structured_reply(
            &mut sl.hdr,
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS,
            sl.cookie,
            plen,
        );
        sl.hdr_len = STRUCTURED_REPLY_LEN as u8;
        sl.buf = Some(buf);
        sl.data_len = plen;
        sl.phase = Phase::Reply;
        self.outq.push(s);
    }

    /// Pass the request in slot `s` to the volume if the gate (QoS limits, shares) lets
    /// it through now; otherwise the gate holds it and hands it back from `on_gate`.
    fn admit_or_park(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &self.slots[s as usize];
        let charge = match sl.cmd {
            CMD_READ => Some((false, sl.len as u64)),
            CMD_WRITE => Some((true, sl.len as u64)),
            CMD_TRIM | CMD_WRITE_ZEROES => Some((true, 0)),
            // Flushes and metadata queries are not limited.
            _ => None,
        };
        if self.gate.offer(io, s, charge) {
            self.dispatch(io, s);
        }
    }

    /// The gate's timer or round came: serve the requests it lets through now.
    fn on_gate(&mut self, io: &mut CoreIo, slot: u32) {
        let mut out = std::mem::take(&mut self.released);
        if self.dead {
            // The client is gone: nobody waits for held requests.
            let mut slots = Vec::new();
            self.gate.drain(&mut slots);
            for s in slots {
                self.release(io, s);
            }
        }
        self.gate.wake(io, self.tag(slot), &mut out);
        for r in out.drain(..) {
            if r.throttled {
                let held = io
                    .now()
                    .saturating_duration_since(self.slots[r.slot as usize].start);
                self.stats.add_throttled(held.as_nanos() as u64);
            }
            self.dispatch(io, r.slot);
        }
        self.released = out;
    }

    /// Account a request whose reply is now queued; its latency is taken when the batch
    /// of replies is flushed (`flush`), with the clock the reactor reads once per batch.
    fn record(&mut self, _io: &CoreIo, s: u16, ok: bool) {
        let sl = &self.slots[s as usize];
        let (class, bytes) = match sl.cmd {
            CMD_READ => (IoClass::Read, sl.len as u64),
            CMD_WRITE => (IoClass::Write, sl.len as u64),
            _ => (IoClass::Other, 0),
        };
        self.unrecorded.push((class, bytes, sl.start, ok));
    }

    fn finish_hole(&mut self, io: &CoreIo, s: u16) {
        self.record(io, s, true);
        let sl = &mut self.slots[s as usize];
        encode_structured_reply(
            &mut sl.hdr,
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_HOLE,
            sl.cookie,
            12,
        );
        sl.hdr[20..28].copy_from_slice(&sl.offset.to_be_bytes());
        sl.hdr[28..32].copy_from_slice(&sl.len.to_be_bytes());
        sl.hdr_len = 32;
        sl.data_len = 0;
        sl.phase = Phase::Reply;
        self.outq.push(s);
    }

    /// Build the reply for slot `s` with NBD error `err` (0 = success) and queue it.
    fn finish(&mut self, io: &CoreIo, s: u16, err: u32) {
        self.record(io, s, err == 0);
        let structured = self.opts.structured_replies;
        let sl = &mut self.slots[s as usize];
        let is_read = sl.cmd == CMD_READ;
        sl.data_len = 0;
        if err != 0 {
            if structured {
                encode_structured_reply(
                    &mut sl.hdr,
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_ERROR,
                    sl.cookie,
                    6,
                );
                sl.hdr[20..24].copy_from_slice(&err.to_be_bytes());
                sl.hdr[24..26].copy_from_slice(&0u16.to_be_bytes());
                sl.hdr_len = 26;
            } else {
                encode_simple_reply(&mut sl.hdr, err, sl.cookie);
                sl.hdr_len = SIMPLE_REPLY_LEN as u8;
            }
        } else if is_read && sl.len > 0 {
            if structured {
                encode_structured_reply(
                    &mut sl.hdr,
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    sl.cookie,
                    8 + sl.len,
                );
                sl.hdr[20..28].copy_from_slice(&sl.offset.to_be_bytes());
                sl.hdr_len = 28;
            } else {
                encode_simple_reply(&mut sl.hdr, 0, sl.cookie);
                sl.hdr_len = SIMPLE_REPLY_LEN as u8;
            }
            sl.data_len = sl.len;
        } else {
            // Success without payload: a simple reply even when structured replies were
            // negotiated (the spec allows it for everything but READ and BLOCK_STATUS).
            // It is 4 bytes shorter, and clients such as libnbd read it with one receive
            // instead of two, which is CPU the client saves on every write.
            encode_simple_reply(&mut sl.hdr, 0, sl.cookie);
            sl.hdr_len = SIMPLE_REPLY_LEN as u8;
        }
        sl.phase = Phase::Reply;
        self.outq.push(s);
    }

    fn on_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        self.in_io -= 1;
        let sl = &mut self.slots[s as usize];
        if res < 0 {
            return self.finish(io, s, errno_to_nbd(-res));
        }
        if sl.phase == Phase::Io
            && sl.flags & CMD_FLAG_FUA != 0
            && matches!(sl.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
        {
            // Forced unit access: the data is written; now make it (and its mapping) durable.
            sl.phase = Phase::FuaFlush;
            let tag = self.tag(s as u32);
            return self.submit(io, IoOp::Flush, tag);
        }
        self.finish(io, s, 0);
    }

    fn release(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &mut self.slots[s as usize];
        if let Some(b) = sl.buf.take() {
            io.bufs.put(b);
        }
        sl.phase = Phase::Free;
        self.free.push(s);
    }

    /// Send every queued reply in one sendmsg.
    fn send(&mut self, io: &mut CoreIo) {
        if self.send_posted || self.outq.is_empty() {
            return;
        }
        if self.dead {
            let q = std::mem::take(&mut self.outq);
            for &s in &q {
                self.release(io, s);
            }
            self.outq = q;
            self.outq.clear();
            return;
        }
        self.iov.clear();
        self.sending.clear();
        let mut taken = 0;
        for &s in &self.outq {
            if self.iov.len() + 2 > MAX_IOV {
                break;
            }
            let sl = &mut self.slots[s as usize];
            self.iov.push(libc::iovec {
                iov_base: sl.hdr.as_mut_ptr() as *mut libc::c_void,
                iov_len: sl.hdr_len as usize,
            });
            if sl.data_len > 0 {
                let b = sl.buf.as_mut().expect("reply data buffer");
                self.iov.push(libc::iovec {
                    iov_base: b.as_mut_ptr() as *mut libc::c_void,
                    iov_len: sl.data_len as usize,
                });
            }
            self.sending.push(s);
            self.latency.on_reply(sl.cookie);
            taken += 1;
        }
        self.outq.drain(..taken);
        self.iov_at = 0;
        self.post_send(io);
    }

    fn post_send(&mut self, io: &mut CoreIo) {
        self.msg.msg_iov = self.iov[self.iov_at..].as_mut_ptr();
        self.msg.msg_iovlen = self.iov.len() - self.iov_at;
        let e = opcode::SendMsg::new(
            types::Fd(self.fd.as_raw_fd()),
            &*self.msg as *const libc::msghdr,
        )
        .flags(libc::MSG_NOSIGNAL as u32)
        .build()
        .user_data(self.tag(SLOT_SEND));
        // SAFETY: msg, iov and the buffers they point to belong to this connection and are
        // not touched until the send completes.
        unsafe { io.push_sqe(e) };
        self.send_posted = true;
    }

    fn on_send(&mut self, io: &mut CoreIo, res: i32) {
        self.send_posted = false;
        if res < 0 {
            self.dead = true;
            self.draining = true;
        } else {
            // Partial send: advance through the iovecs and send the rest.
            let mut n = res as usize;
            while n > 0 && self.iov_at < self.iov.len() {
                let v = &mut self.iov[self.iov_at];
                if n >= v.iov_len {
                    n -= v.iov_len;
                    self.iov_at += 1;
                } else {
                    // SAFETY: advancing within the same buffer.
                    v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                    v.iov_len -= n;
                    n = 0;
                }
            }
            if self.iov_at < self.iov.len() {
                return self.post_send(io);
            }
        }
        let sent = std::mem::take(&mut self.sending);
        for &s in &sent {
            self.release(io, s);
        }
        self.sending = sent;
        self.sending.clear();
        // Slots freed: requests waiting in the buffer can proceed.
        if self.payload.is_none() {
            self.parse(io);
        }
        self.post_recv(io);
    }
}

impl Drop for NbdConn {
    fn drop(&mut self) {
        self.vol.volume().unregister_stats(&self.stats);
    }
}

impl Task for NbdConn {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.gate.set_tags(self.tag(SLOT_QOS), self.tag(SLOT_ROUND));
        self.post_recv(io);
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        match slot {
            SLOT_RECV => self.on_recv(io, res),
            SLOT_SEND => self.on_send(io, res),
            SLOT_QOS | SLOT_ROUND => self.on_gate(io, slot),
            s => self.on_io(io, s as u16, res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let now = io.now();
        for (class, bytes, start, ok) in self.unrecorded.drain(..) {
            let ns = now.saturating_duration_since(start).as_nanos() as u64;
            self.stats.record(class, bytes, ns, ok);
        }
        self.send(io);
        // Once drained (nothing in flight, nothing to send), wake our receive with a
        // shutdown so the connection can finish.
        if self.draining
            && !self.shut
            && self.in_io == 0
            && !self.send_posted
            && self.outq.is_empty()
        {
            self.shut = true;
            // SAFETY: shutting down our own socket.
            unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }

    fn finished(&self) -> bool {
        self.shut
            && !self.recv_posted
            && !self.send_posted
            && self.in_io == 0
            && self.gate.is_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A client that waits on each reply: request n, reply n, request n+1...
    fn qd1(d: &mut LatencyDetector, from: u64, n: u64, now: Instant) {
        for c in from..from + n {
            d.on_request(c, now);
            d.on_reply(c);
        }
    }

    #[test]
    fn a_qd1_client_enters_latency_mode() {
        let mut d = LatencyDetector::default();
        let t = Instant::now();
        qd1(&mut d, 1, LATENCY_STREAK as u64 - 1, t);
        assert!(!d.active());
        qd1(&mut d, LATENCY_STREAK as u64, 1, t);
        assert!(d.active());
    }

    #[test]
    fn a_deep_queue_client_does_not() {
        let mut d = LatencyDetector::default();
        let t = Instant::now();
        // 128 requests arrive before the first reply, as while the core sleeps.
        for round in 0..100u64 {
            for c in round * 128..(round + 1) * 128 {
                d.on_request(c + 1, t);
            }
            d.on_reply((round + 1) * 128);
        }
        assert!(!d.active());
    }

    #[test]
    fn latency_mode_ends_to_measure_again() {
        let mut d = LatencyDetector::default();
        let t = Instant::now();
        qd1(&mut d, 1, LATENCY_STREAK as u64, t);
        assert!(d.active());
        // Still within the probe period: stays on whatever the cookies say.
        d.on_request(10_000, t + Duration::from_millis(1));
        assert!(d.active());
        // After it, the connection is measured again from scratch.
        d.on_request(10_001, t + LATENCY_PROBE);
        assert!(!d.active());
        // A deep queue seen while sleeping keeps it off.
        d.on_reply(10_001);
        d.on_request(10_200, t + LATENCY_PROBE);
        assert!(!d.active());
    }

    #[test]
    fn unordered_cookies_look_deep() {
        let mut d = LatencyDetector::default();
        let t = Instant::now();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..1000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            d.on_request(x, t);
            d.on_reply(x);
        }
        assert!(!d.active());
    }
}
