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
//!
//! The socket, receive buffer, slot free list, gathered send and stats batching are the
//! export layer's (`tessera_export::conn`), shared with NVMe/TCP queues; this file keeps
//! the NBD requests and replies.
//!
//! Requests not aligned to 512 bytes (served only to clients that did not agree to a
//! block size in the handshake, as the spec asks) take a slower path: a read reads the
//! aligned superset and moves the asked bytes to the front of its buffer; a write or
//! write-zeroes reads the partial head and tail blocks, merges, and writes whole blocks
//! back (read-modify-write); a trim shrinks to the whole blocks inside it. A
//! read-modify-write must not write back stale bytes that another write changed between
//! its read and its write, so while one is in flight:
//! - on this connection, writes overlapping its blocks wait for it, and it waits for
//!   writes already in flight on its blocks (`blocked`, retried as writes complete);
//! - across the export's connections (other cores), it holds its partial edge blocks in
//!   the export-wide [`EdgeLocks`] table, so two read-modify-writes of one block never
//!   interleave; a conflicting one retries on a 20 µs timer.
//!
//! Aligned requests of other connections do not look at that table (it would cost every
//! aligned write a shared lookup). The one case left open is an aligned write on one
//! connection and an unaligned write on another, in flight at the same time, to the same
//! 512-byte block: the client sent overlapping writes on two connections without
//! ordering them, and the bytes of that block outside the unaligned write may end as
//! before the aligned write. Writes that completed before the unaligned write arrived
//! are never lost.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tessera_io::sync::MutexExt;

use tessera_export::budget::ConnBudget;
use tessera_export::conn::{
    add_throttled, io_slot, read_into_new_buf, FreeList, RecvBuf, SendDone, Socket, StatsBatch,
};
use tessera_export::log_limit::LogLimiter;
use tessera_export::{
    Charge, Export, ExportHandle, ExportTarget, Gate, IoClass, IoStats, Released,
};
use tessera_io::cast::{u32_of, u8_of, usize_of};
use tessera_io::{AlignedBuf, BufPool, CoreIo, IoOp, Tag, Task};
use tracing::{info, warn};

use crate::proto::*;
use crate::tls::TlsLink;

/// Requests a connection may have in flight; more wait in the socket buffer.
pub const MAX_IN_FLIGHT: usize = 512;
const RBUF_CAP: usize = 1 << 20;
/// Receive size while the core is contended: about one share round of 4 KiB writes
/// (tessera_qos::shares::ROUND_BUDGET requests with their headers).
const RECV_CONTENDED: usize = 68 << 10;
const SLOT_RECV: u32 = u32::MAX;
const SLOT_SEND: u32 = u32::MAX - 1;
const SLOT_QOS: u32 = u32::MAX - 2;
const SLOT_ROUND: u32 = u32::MAX - 3;
/// Extents per BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 8192;
/// The device alignment every request that reaches the volume keeps.
const ALIGN: u64 = MIN_BLOCK as u64;
/// `ALIGN` as a buffer length.
const ALIGN_BYTES: usize = MIN_BLOCK as usize;
/// How long an unaligned write whose edge block another connection holds waits before
/// trying again.
const EDGE_RETRY: Duration = Duration::from_micros(20);

/// What the handshake agreed on.
#[derive(Clone, Debug, Default)]
pub struct ConnOptions {
    pub structured_replies: bool,
    pub base_allocation: Option<u32>,
    /// Selected `qemu:dirty-bitmap:` contexts: (context id, the target's change base
    /// token, [`ExportTarget::change_base`]).
    pub dirty_bitmaps: Vec<(u32, u64)>,
    pub read_only: bool,
    /// The client asked for NBD_INFO_BLOCK_SIZE and so promised to keep 512-byte
    /// alignment: unaligned requests get EINVAL. Otherwise they are served (the spec's
    /// default minimum block size is 1).
    pub strict_block_size: bool,
    /// For log lines: the client's address and the export's name.
    pub client: String,
    pub export: String,
}

/// Malformed requests that end a connection: logged at most 10 times per 10 s.
static BAD_REQUEST_LOG: LogLimiter = LogLimiter::new("nbd-bad-request", 10, 10);

/// Dirty-bitmap block status whose snapshot left the target's chain: at most 10 lines
/// per 10 s.
static LOST_BASE_LOG: LogLimiter = LogLimiter::new("nbd-lost-bitmap-base", 10, 10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Free,
    /// Receiving a large WRITE payload straight into the slot buffer.
    Payload,
    Io,
    /// Data written; the FUA flush is in flight.
    FuaFlush,
    Reply,
    /// An unaligned READ of the aligned superset is in flight.
    ReadSuperset,
    /// A write waiting in `blocked` for a conflicting write on this connection.
    Blocked,
    /// A read-modify-write waiting for its edge blocks in the export's `EdgeLocks`.
    RmwLock,
    /// A read-modify-write reading its partial edge blocks (`rmw_pending` of them).
    RmwRead,
    /// A read-modify-write writing back (`rmw_pending` operations).
    RmwWrite,
}

impl Phase {
    /// A read-modify-write that owns its blocks on this connection.
    fn in_rmw(self) -> bool {
        matches!(self, Phase::RmwLock | Phase::RmwRead | Phase::RmwWrite)
    }
}

fn is_write(cmd: u16) -> bool {
    matches!(cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
}

fn align_down(x: u64) -> u64 {
    x & !(ALIGN - 1)
}

fn align_up(x: u64) -> u64 {
    align_down(x + ALIGN - 1)
}

/// Bytes of data buffers the request `h` may take from the core's pool, as the pool
/// rounds them (its budget charge, taken before the request leaves the receive buffer):
/// a READ's reply data (the aligned superset when unaligned), a WRITE's payload (and the
/// merge buffer of a read-modify-write), an unaligned WRITE_ZEROES' edge blocks, a
/// BLOCK_STATUS reply at its largest. Requests refused before any buffer is taken are
/// charged all the same until their reply leaves: the charge is a bound, not a count.
fn buffer_charge(h: &RequestHeader, opts: &ConnOptions) -> u64 {
    let pooled = |n: u64| BufPool::capacity_for(usize_of(n)) as u64;
    let len = u64::from(h.length);
    let unaligned = !(h.offset | len).is_multiple_of(ALIGN);
    let edges = if unaligned { 2 * ALIGN } else { 0 };
    match h.cmd {
        CMD_READ if h.length == 0 || h.length > MAX_PAYLOAD => 0,
        CMD_READ => pooled(len + edges),
        CMD_WRITE if unaligned => pooled(len) + pooled(len + edges),
        CMD_WRITE => pooled(len),
        CMD_WRITE_ZEROES if unaligned => pooled(edges),
        CMD_BLOCK_STATUS => {
            let contexts = opts.dirty_bitmaps.len() + usize::from(opts.base_allocation.is_some());
            let per_context = (STRUCTURED_REPLY_LEN + 4 + 8 * MAX_EXTENTS) as u64;
            pooled(contexts as u64 * per_context)
        }
        _ => 0,
    }
}

/// Partial blocks a read-modify-write holds across the connections of one export: the
/// block's offset and the holder (connection id and slot).
#[derive(Default)]
pub struct EdgeLocks {
    held: Mutex<Vec<(u64, u64)>>,
}

impl EdgeLocks {
    /// The table of the export whose target is at `key`, shared by all its connections.
    fn of(key: usize) -> Arc<EdgeLocks> {
        static TABLES: Mutex<Vec<(usize, Weak<EdgeLocks>)>> = Mutex::new(Vec::new());
        let mut t = TABLES.locked();
        t.retain(|(_, w)| w.strong_count() > 0);
        if let Some(l) = t
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return l;
        }
        let l = Arc::new(EdgeLocks::default());
        t.push((key, Arc::downgrade(&l)));
        l
    }

    /// Take `blocks` (one or two block offsets) for `owner`, all or none.
    fn try_take(&self, owner: u64, blocks: &[u64]) -> bool {
        let mut h = self.held.locked();
        if h.iter().any(|&(b, o)| o != owner && blocks.contains(&b)) {
            return false;
        }
        h.extend(blocks.iter().map(|&b| (b, owner)));
        true
    }

    fn release(&self, owner: u64) {
        let mut h = self.held.locked();
        h.retain(|&(_, o)| o != owner);
    }
}

/// Connection ids unique in the process (owners in `EdgeLocks`).
static NEXT_CONN_UID: AtomicU64 = AtomicU64::new(1);

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
    hdr_len: usize,
    data_len: u32,
    /// Read-modify-write: the merge buffer (whole blocks), the I/Os in flight and the
    /// first error among them.
    rmw_buf: Option<AlignedBuf>,
    rmw_pending: u8,
    rmw_err: u32,
    /// Bytes of the connection's buffer budget the request holds (`buffer_charge`).
    charged: u64,
}

impl Slot {
    /// The request's range widened to whole blocks: what it may touch on the volume.
    fn span(&self) -> (u64, u64) {
        (
            align_down(self.offset),
            align_up(self.offset + self.len as u64),
        )
    }

    /// The partial blocks at the ends of an unaligned write, each once.
    fn edge_blocks(&self) -> ([u64; 2], usize) {
        let end = self.offset + self.len as u64;
        let mut e = [0u64; 2];
        let mut n = 0;
        if !self.offset.is_multiple_of(ALIGN) {
            e[0] = align_down(self.offset);
            n = 1;
        }
        if !end.is_multiple_of(ALIGN) && (n == 0 || align_down(end) != e[0]) {
            e[n] = align_down(end);
            n += 1;
        }
        (e, n)
    }
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
            rmw_buf: None,
            rmw_pending: 0,
            rmw_err: 0,
            charged: 0,
        }
    }
}

pub struct NbdConn<T: ExportTarget> {
    sock: Socket,
    id: u32,
    target: Arc<T>,
    vol: T::Handle,
    opts: ConnOptions,
    rbuf: RecvBuf,
    /// Slot receiving a large payload, and how many bytes of it have arrived.
    payload: Option<(u16, usize)>,
    slots: Vec<Slot>,
    free: FreeList,
    outq: Vec<u16>,
    sending: Vec<u16>,
    in_io: usize,
    /// QoS admission: the volume's and its group's limits, then the core's shares.
    gate: Gate,
    released: Vec<Released>,
    /// Replies queued in this batch, to account when it is flushed.
    unrecorded: StatsBatch,
    stats: Arc<IoStats>,
    /// Writes waiting for a conflicting write on this connection, oldest first (only
    /// ever non-empty while an unaligned write is in flight), and its spare for retries.
    blocked: Vec<u16>,
    blocked_spare: Vec<u16>,
    /// Slots in a read-modify-write phase; while 0 and nothing is blocked, aligned
    /// writes skip the conflict check.
    rmw_live: usize,
    edge_locks: Arc<EdgeLocks>,
    uid: u64,
    /// When the transmission phase began (for the disconnect line).
    connected: std::time::Instant,
    /// The TLS session, when the client started TLS: bytes pass through it between the
    /// socket and the receive buffer / the gathered replies. `None` costs one branch.
    tls: Option<Box<TlsLink>>,
    /// Bytes of data buffers this connection may hold (back-pressure: see
    /// `tessera_export::budget`).
    budget: ConnBudget,
}

impl<T: ExportTarget> NbdConn<T> {
    /// Build a connection on the core that will serve it (`io` is that core's context).
    /// A read-only target is served read-only whatever the handshake said.
    pub fn new(
        io: &mut CoreIo,
        fd: OwnedFd,
        export: &Export<T>,
        mut opts: ConnOptions,
        budget: ConnBudget,
    ) -> Self {
        let target = export.target.clone();
        opts.read_only |= target.read_only();
        let stats = target.register_stats();
        let edge_locks = EdgeLocks::of(target.identity());
        // The tags are set in `start`, once the task id is known.
        let gate = Gate::new(io, &export.qos, Tag::task(0, 0), Tag::task(0, 0));
        NbdConn {
            sock: Socket::new(fd),
            id: 0,
            vol: target.open(),
            target,
            opts,
            rbuf: RecvBuf::new(RBUF_CAP),
            payload: None,
            slots: (0..MAX_IN_FLIGHT).map(|_| Slot::new()).collect(),
            free: FreeList::new(MAX_IN_FLIGHT),
            outq: Vec::with_capacity(MAX_IN_FLIGHT),
            sending: Vec::with_capacity(MAX_IN_FLIGHT),
            in_io: 0,
            gate,
            released: Vec::new(),
            unrecorded: StatsBatch::with_capacity(MAX_IN_FLIGHT),
            stats,
            blocked: Vec::with_capacity(MAX_IN_FLIGHT),
            blocked_spare: Vec::with_capacity(MAX_IN_FLIGHT),
            rmw_live: 0,
            edge_locks,
            uid: NEXT_CONN_UID.fetch_add(1, Relaxed),
            connected: std::time::Instant::now(),
            tls: None,
            budget,
        }
    }

    /// Serve the connection over the TLS session its handshake started.
    pub fn with_tls(mut self, tls: Box<TlsLink>) -> Self {
        self.tls = Some(tls);
        self
    }

    fn tag(&self, slot: u32) -> Tag {
        Tag::task(self.id, slot)
    }

    fn post_recv(&mut self, io: &mut CoreIo) {
        if !self.sock.may_recv() {
            return;
        }
        let tag = self.tag(SLOT_RECV);
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
                if self.free.is_empty() || self.budget.stalled() {
                    return; // resume when a slot or budget frees up (on_send)
                }
                if self.rbuf.is_full() {
                    return; // parse() compacts first; a full buffer means a slot is awaited
                }
                // While volumes compete for this core, take about one share round of
                // requests per receive (see Gate::contended).
                let max = if self.gate.contended() {
                    RECV_CONTENDED
                } else {
                    usize::MAX
                };
                self.rbuf.room(max)
            }
        };
        // SAFETY: the receive buffer and the slot's payload buffer are owned by this
        // connection and stay put until the receive completes: the payload slot is not
        // released and the buffer not compacted while a receive is posted, and
        // finished() waits for it.
        unsafe {
            match &mut self.tls {
                None => self.sock.post_recv(io, ptr, len, tag),
                Some(t) => t.post_recv(&mut self.sock, io, ptr, len, tag),
            }
        }
    }

    fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        // EOF or error: the client went away (or half-closed). Finish what is in flight,
        // send what can still be sent, then close.
        let got = match &mut self.tls {
            None => self.sock.recv_done(res),
            Some(t) => t.recv_done(&mut self.sock, res),
        };
        let Some(n) = got else {
            return;
        };
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
                self.rbuf.filled(n);
                self.parse(io);
            }
        }
        self.post_recv(io);
    }

    /// Parse and dispatch every complete request in the receive buffer.
    fn parse(&mut self, io: &mut CoreIo) {
        while !self.sock.draining && self.payload.is_none() {
            let avail = self.rbuf.unparsed();
            let h = match parse_request(avail) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    if BAD_REQUEST_LOG.admit() {
                        warn!(
                            client = %self.opts.client,
                            export = %self.opts.export,
                            error = %e,
                            "nbd: closing connection"
                        );
                    }
                    self.sock.draining = true;
                    self.sock.dead = true;
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
                if BAD_REQUEST_LOG.admit() {
                    warn!(
                        client = %self.opts.client,
                        export = %self.opts.export,
                        bytes = h.length,
                        limit = MAX_PAYLOAD,
                        "nbd: closing connection: write payload exceeds the limit"
                    );
                }
                self.sock.draining = true;
                self.sock.dead = true;
                break;
            }
            let have = avail.len() - REQUEST_HEADER_LEN;
            let small = REQUEST_HEADER_LEN + payload <= RBUF_CAP / 2;
            if small && have < payload {
                break; // wait for the rest of the payload in the buffer
            }
            let Some(s) = self.free.pop() else { break };
            // Back-pressure: a request whose buffers do not fit the budget stays in the
            // receive buffer, and the socket is not read, until replies leave.
            let charge = buffer_charge(&h, &self.opts);
            if !self.budget.try_take(charge) {
                self.free.push(s);
                break;
            }
            self.rbuf.consume(REQUEST_HEADER_LEN);
            let slot = &mut self.slots[s as usize];
            slot.cookie = h.cookie;
            slot.cmd = h.cmd;
            slot.flags = h.flags;
            slot.offset = h.offset;
            slot.len = h.length;
            slot.data_len = 0;
            slot.charged = charge;
            slot.start = io.now();
            if payload > 0 {
                let mut buf = io.bufs.get(payload);
                let take = payload.min(have);
                buf.as_mut_slice()[..take].copy_from_slice(&self.rbuf.unparsed()[..take]);
                self.rbuf.consume(take);
                slot.buf = Some(buf);
                if take < payload {
                    slot.phase = Phase::Payload;
                    self.payload = Some((s, take));
                    break;
                }
            }
            self.admit_or_park(io, s);
        }
        // parse() also runs from on_send (slots were freed), possibly with a receive
        // posted into the buffer: it must not move under it.
        if !self.sock.recv_posted() {
            self.rbuf.compact();
        }
    }

    fn in_bounds(&self, s: &Slot) -> bool {
        s.offset
            .checked_add(s.len as u64)
            .is_some_and(|e| e <= self.target.size())
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
        // The range came off the wire: check it before anything computes its end (the
        // overlap checks below widen it to whole blocks).
        if matches!(cmd, CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
            && !self.in_bounds(&self.slots[idx])
        {
            let e = if matches!(cmd, CMD_WRITE | CMD_WRITE_ZEROES) {
                ENOSPC
            } else {
                EINVAL
            };
            return self.finish(io, s, e);
        }
        if !(offset | len as u64).is_multiple_of(ALIGN)
            && matches!(cmd, CMD_READ | CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES)
        {
            return self.dispatch_unaligned(io, s);
        }
        // Only while an unaligned write is in flight or waiting must an aligned write
        // check it does not overlap one.
        if writes && (self.rmw_live != 0 || !self.blocked.is_empty()) && self.conflicts(s, false) {
            return self.block(s);
        }
        self.slots[idx].phase = Phase::Io;
        match cmd {
            CMD_READ => {
                if len > MAX_PAYLOAD {
                    return self.finish(io, s, EOVERFLOW);
                }
                if len == 0 {
                    return self.finish(io, s, 0);
                }
                if self.opts.structured_replies && self.vol.is_hole(offset, len as u64) {
                    return self.finish_hole(io, s);
                }
                let (buf, op) = read_into_new_buf(io, offset, len);
                self.slots[idx].buf = Some(buf);
                self.submit(io, op, tag);
            }
            CMD_WRITE => {
                let buf = self.slots[idx]
                    .buf
                    .as_ref()
                    .map_or(std::ptr::null(), |b| b.as_ptr());
                self.submit(io, IoOp::Write { offset, len, buf }, tag);
            }
            CMD_FLUSH => self.submit(io, IoOp::Flush, tag),
            CMD_TRIM => {
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
                self.sock.draining = true;
            }
            _ => self.finish(io, s, EINVAL),
        }
    }

    /// Serve a READ, WRITE, TRIM or WRITE_ZEROES whose offset or length is not a multiple
    /// of the block size (see the module comment).
    fn dispatch_unaligned(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let (cmd, flags, offset, len) = {
            let sl = &self.slots[idx];
            (sl.cmd, sl.flags, sl.offset, sl.len)
        };
        if self.opts.strict_block_size {
            return self.finish(io, s, EINVAL);
        }
        // In bounds: checked by `dispatch`.
        if len == 0 {
            return self.finish(io, s, 0);
        }
        let (lo, hi) = self.slots[idx].span();
        if hi > self.target.size() {
            // Only an export whose size is not a whole number of blocks gets here: its
            // last partial block cannot be read or written whole.
            return self.finish(io, s, EINVAL);
        }
        match cmd {
            CMD_READ => {
                if len > MAX_PAYLOAD {
                    return self.finish(io, s, EOVERFLOW);
                }
                if self.opts.structured_replies && self.vol.is_hole(offset, len as u64) {
                    return self.finish_hole(io, s);
                }
                // At most MAX_PAYLOAD plus two partial blocks.
                let (buf, op) = read_into_new_buf(io, lo, u32_of(hi - lo));
                let sl = &mut self.slots[idx];
                sl.buf = Some(buf);
                sl.phase = Phase::ReadSuperset;
                self.submit(io, op, tag);
            }
            CMD_TRIM => {
                if (self.rmw_live != 0 || !self.blocked.is_empty()) && self.conflicts(s, false) {
                    return self.block(s);
                }
                // Only whole blocks can be released; TRIM may leave the partial ends as
                // they are.
                let (a, b) = (align_up(offset), align_down(offset + len as u64));
                if b <= a {
                    return self.finish(io, s, 0);
                }
                self.slots[idx].phase = Phase::Io;
                self.submit(
                    io,
                    IoOp::Discard {
                        offset: a,
                        len: b - a,
                    },
                    tag,
                );
            }
            _ => {
                if cmd == CMD_WRITE_ZEROES && flags & CMD_FLAG_FAST_ZERO != 0 {
                    // Merging partial blocks is not fast.
                    return self.finish(io, s, ENOTSUP);
                }
                if self.conflicts(s, true) {
                    return self.block(s);
                }
                self.slots[idx].phase = Phase::RmwLock;
                self.rmw_live += 1;
                self.rmw_lock(io, s);
            }
        }
    }

    /// Does the write in slot `s` overlap (in whole blocks) a write it must wait for: a
    /// write already waiting, a read-modify-write in flight, and for a read-modify-write
    /// (`rmw`) also any write in flight?
    fn conflicts(&self, s: u16, rmw: bool) -> bool {
        let (lo, hi) = self.slots[s as usize].span();
        let overlaps = |o: &Slot| {
            let (a, b) = o.span();
            a < hi && lo < b
        };
        if self
            .blocked
            .iter()
            .any(|&b| overlaps(&self.slots[b as usize]))
        {
            return true;
        }
        self.slots.iter().enumerate().any(|(i, o)| {
            i != s as usize
                && (o.phase.in_rmw() || (rmw && o.phase == Phase::Io && is_write(o.cmd)))
                && overlaps(o)
        })
    }

    fn block(&mut self, s: u16) {
        self.slots[s as usize].phase = Phase::Blocked;
        self.blocked.push(s);
    }

    /// Dispatch again, oldest first, the writes that waited; those still in conflict
    /// wait again (behind the older ones still waiting).
    fn retry_blocked(&mut self, io: &mut CoreIo) {
        if self.blocked.is_empty() {
            return;
        }
        let mut waiting = std::mem::take(&mut self.blocked_spare);
        std::mem::swap(&mut waiting, &mut self.blocked);
        for &s in &waiting {
            self.dispatch(io, s);
        }
        waiting.clear();
        self.blocked_spare = waiting;
    }

    /// The holder of slot `s`'s edge blocks in the export's `EdgeLocks`.
    fn edge_owner(&self, s: u16) -> u64 {
        (self.uid << 16) | s as u64
    }

    /// Take the edge blocks of the read-modify-write in slot `s` across the export, then
    /// read them; if another connection holds one, try again after `EDGE_RETRY`.
    fn rmw_lock(&mut self, io: &mut CoreIo, s: u16) {
        let (edges, n) = self.slots[s as usize].edge_blocks();
        if !self.edge_locks.try_take(self.edge_owner(s), &edges[..n]) {
            self.in_io += 1;
            io.complete_after(EDGE_RETRY, self.tag(s as u32), 0);
            return;
        }
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let (lo, hi) = self.slots[idx].span();
        // WRITE merges into a buffer of the whole span; WRITE_ZEROES needs only its edge
        // blocks (the volume zeroes the whole blocks between them).
        let zeroes = self.slots[idx].cmd == CMD_WRITE_ZEROES;
        let cap = if zeroes {
            n * ALIGN_BYTES
        } else {
            usize_of(hi - lo)
        };
        let mut buf = io.bufs.get(cap);
        let base = buf.as_mut_ptr();
        let sl = &mut self.slots[idx];
        sl.phase = Phase::RmwRead;
        sl.rmw_pending = u8_of(n);
        sl.rmw_err = 0;
        sl.rmw_buf = Some(buf);
        for (i, &b) in edges[..n].iter().enumerate() {
            let at = if zeroes {
                i * ALIGN_BYTES
            } else {
                usize_of(b - lo)
            };
            // SAFETY: at + ALIGN <= cap: an edge block lies inside the span, and the
            // edge buffer has one block per edge.
            let p = unsafe { base.add(at) };
            let op = IoOp::Read {
                offset: b,
                len: MIN_BLOCK,
                buf: p,
            };
            self.submit(io, op, tag);
        }
    }

    /// The edge blocks are read: merge the request into them and write back.
    fn rmw_write(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let sl = &mut self.slots[idx];
        let (lo, hi) = sl.span();
        let (off, end) = (sl.offset, sl.offset + sl.len as u64);
        sl.phase = Phase::RmwWrite;
        if sl.cmd == CMD_WRITE {
            let mut merged = sl.rmw_buf.take().expect("merge buffer");
            let payload = sl.buf.take().expect("write payload");
            let head = usize_of(off - lo);
            let len = sl.len as usize;
            merged.as_mut_slice()[head..head + len].copy_from_slice(&payload.as_slice()[..len]);
            io.bufs.put(payload);
            let op = IoOp::Write {
                offset: lo,
                // At most MAX_PAYLOAD plus two partial blocks.
                len: u32_of(hi - lo),
                buf: merged.as_ptr(),
            };
            sl.buf = Some(merged);
            sl.rmw_pending = 1;
            return self.submit(io, op, tag);
        }
        // WRITE_ZEROES: zero the asked bytes of the edge blocks and write them back; the
        // volume zeroes the whole blocks between.
        let (edges, n) = sl.edge_blocks();
        let (mid_lo, mid_hi) = (align_up(off), align_down(end));
        let may_unmap = sl.flags & CMD_FLAG_NO_HOLE == 0;
        sl.rmw_pending = u8_of(n) + u8::from(mid_hi > mid_lo);
        let b = sl.rmw_buf.as_mut().expect("edge buffer");
        let block = ALIGN_BYTES;
        for (i, &e) in edges[..n].iter().enumerate() {
            let from = usize_of(off.max(e) - e);
            let to = usize_of(end.min(e + ALIGN) - e);
            b.as_mut_slice()[i * block + from..i * block + to].fill(0);
        }
        let ptr = b.as_ptr();
        for (i, &e) in edges[..n].iter().enumerate() {
            let op = IoOp::Write {
                offset: e,
                len: MIN_BLOCK,
                // SAFETY: block i of the edge buffer, which has n blocks.
                buf: unsafe { ptr.add(i * block) },
            };
            self.submit(io, op, tag);
        }
        if mid_hi > mid_lo {
            let op = IoOp::WriteZeroes {
                offset: mid_lo,
                len: mid_hi - mid_lo,
                may_unmap,
            };
            self.submit(io, op, tag);
        }
    }

    /// A read-modify-write's last I/O completed (or one of its reads failed): give its
    /// blocks back, reply (after a FUA flush if asked), and let waiting writes go.
    fn rmw_done(&mut self, io: &mut CoreIo, s: u16) {
        self.edge_locks.release(self.edge_owner(s));
        self.rmw_live -= 1;
        let tag = self.tag(s as u32);
        let sl = &mut self.slots[s as usize];
        let err = sl.rmw_err;
        if let Some(b) = sl.rmw_buf.take() {
            io.bufs.put(b);
        }
        if err == 0 && sl.flags & CMD_FLAG_FUA != 0 {
            sl.phase = Phase::FuaFlush;
            self.submit(io, IoOp::Flush, tag);
        } else {
            sl.phase = Phase::Io;
            self.finish(io, s, err);
        }
        self.retry_blocked(io);
    }

    /// A completion for a request on the unaligned path.
    fn on_unaligned_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        let idx = s as usize;
        match self.slots[idx].phase {
            Phase::ReadSuperset => {
                if res < 0 {
                    return self.finish(io, s, errno_to_nbd(-res));
                }
                let sl = &mut self.slots[idx];
                let head = usize_of(sl.offset - align_down(sl.offset));
                let len = sl.len as usize;
                let b = sl.buf.as_mut().expect("read buffer");
                b.as_mut_slice().copy_within(head..head + len, 0);
                self.finish(io, s, 0);
            }
            Phase::RmwLock => self.rmw_lock(io, s),
            Phase::RmwRead | Phase::RmwWrite => {
                let sl = &mut self.slots[idx];
                if res < 0 && sl.rmw_err == 0 {
                    sl.rmw_err = errno_to_nbd(-res);
                }
                sl.rmw_pending -= 1;
                if sl.rmw_pending > 0 {
                    return;
                }
                if sl.phase == Phase::RmwRead && sl.rmw_err == 0 {
                    self.rmw_write(io, s);
                } else {
                    self.rmw_done(io, s);
                }
            }
            p => unreachable!("nbd: I/O completion for a request in phase {p:?}"),
        }
    }

    /// Hand `op` to the target; its buffer (if any) is the buffer of the slot `tag` names.
    fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        self.in_io += 1;
        // SAFETY: the buffer of every Read/Write submitted here is held by the request's
        // slot (`buf`, or `rmw_buf` for a read-modify-write), which keeps it until the
        // completion for `tag` arrives; the connection is not dropped while I/O is in
        // flight (`finished` waits for `in_io` to reach 0).
        unsafe { self.vol.submit(io, op, tag) };
    }

    /// One `NBD_REPLY_TYPE_BLOCK_STATUS` chunk per selected context: `base:allocation`
    /// from the target's allocation, each `qemu:dirty-bitmap:` from its changes since
    /// that snapshot. The first chunk's header goes in the slot; the rest of the reply
    /// (its descriptors, then each further chunk, header and descriptors) in the data
    /// buffer, so the reply leaves as usual, two iovecs. Rare and never on the I/O path.
    fn block_status(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        if self.opts.base_allocation.is_none() && self.opts.dirty_bitmaps.is_empty() {
            return self.finish(io, s, EINVAL);
        }
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
        // (context id, descriptors as (length, state flags)).
        let mut chunks: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
        if let Some(ctx) = self.opts.base_allocation {
            let runs = self.target.allocation_runs(offset, len as u64, max);
            let states = runs
                .into_iter()
                .map(|(l, alloc)| (l, if alloc { 0 } else { STATE_HOLE | STATE_ZERO }))
                .collect();
            chunks.push((ctx, states));
        }
        for &(ctx, base) in &self.opts.dirty_bitmaps {
            let Some(runs) = self.target.changed_runs(base, offset, len as u64, max) else {
                if LOST_BASE_LOG.admit() {
                    warn!(
                        client = %self.opts.client,
                        export = %self.opts.export,
                        context = ctx,
                        "nbd: the snapshot of a selected dirty bitmap is no longer an \
                         ancestor of the export; block status fails"
                    );
                }
                return self.finish(io, s, EIO);
            };
            let states = runs
                .into_iter()
                .map(|(l, changed)| (l, if changed { STATE_DIRTY } else { 0 }))
                .collect();
            chunks.push((ctx, states));
        }
        let payload = |c: &(u32, Vec<(u64, u32)>)| 4 + 8 * c.1.len();
        let data_len = payload(&chunks[0])
            + chunks[1..]
                .iter()
                .map(|c| STRUCTURED_REPLY_LEN + payload(c))
                .sum::<usize>();
        let cookie = self.slots[idx].cookie;
        let mut buf = io.bufs.get(data_len);
        let b = buf.as_mut_slice();
        let mut at = 0;
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.iter().enumerate() {
            let plen = u32_of(payload(chunk));
            let done = if i == last { REPLY_FLAG_DONE } else { 0 };
            if i == 0 {
                let sl = &mut self.slots[idx];
                encode_structured_reply(&mut sl.hdr, done, REPLY_TYPE_BLOCK_STATUS, cookie, plen);
            } else {
                let h = &mut b[at..at + STRUCTURED_REPLY_LEN];
                encode_structured_reply(h, done, REPLY_TYPE_BLOCK_STATUS, cookie, plen);
                at += STRUCTURED_REPLY_LEN;
            }
            b[at..at + 4].copy_from_slice(&chunk.0.to_be_bytes());
            at += 4;
            for &(l, state) in &chunk.1 {
                // Runs are clipped to the request's range, whose length is a u32.
                b[at..at + 4].copy_from_slice(&u32_of(l).to_be_bytes());
                b[at + 4..at + 8].copy_from_slice(&state.to_be_bytes());
                at += 8;
            }
        }
        let sl = &mut self.slots[idx];
        sl.hdr_len = STRUCTURED_REPLY_LEN;
        sl.buf = Some(buf);
        sl.data_len = u32_of(data_len);
        sl.phase = Phase::Reply;
        self.outq.push(s);
    }

    /// Pass the request in slot `s` to the volume if the gate (QoS limits, shares) lets
    /// it through now; otherwise the gate holds it and hands it back from `on_gate`.
    fn admit_or_park(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &self.slots[s as usize];
        let charge = match sl.cmd {
            // While writes wait for a share round, a random read goes before them.
            CMD_READ if self.gate.has_deferred() && self.vol.reads_first_at(sl.offset) => {
                Charge::ReadFirst(sl.len as u64)
            }
            CMD_READ => Charge::Read(sl.len as u64),
            CMD_WRITE => Charge::Write(sl.len as u64),
            CMD_TRIM | CMD_WRITE_ZEROES => Charge::Write(0),
            // Flushes and metadata queries are not limited.
            _ => Charge::Free,
        };
        if self.gate.offer(io, s, charge) {
            self.dispatch(io, s);
        }
    }

    /// The gate's timer or round came: serve the requests it lets through now.
    fn on_gate(&mut self, io: &mut CoreIo, slot: u32) {
        let mut out = std::mem::take(&mut self.released);
        if self.sock.dead {
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
                add_throttled(&self.stats, self.slots[r.slot as usize].start, io.now());
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
            CMD_FLUSH => (IoClass::Flush, 0),
            CMD_TRIM => (IoClass::Discard, 0),
            CMD_WRITE_ZEROES => (IoClass::WriteZeroes, 0),
            _ => (IoClass::Other, 0),
        };
        self.unrecorded.push(0, class, bytes, sl.start, ok);
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
                sl.hdr_len = SIMPLE_REPLY_LEN;
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
                sl.hdr_len = SIMPLE_REPLY_LEN;
            }
            sl.data_len = sl.len;
        } else {
            // Success without payload: a simple reply even when structured replies were
            // negotiated (the spec allows it for everything but READ and BLOCK_STATUS).
            // It is 4 bytes shorter, and clients such as libnbd read it with one receive
            // instead of two, which is CPU the client saves on every write.
            encode_simple_reply(&mut sl.hdr, 0, sl.cookie);
            sl.hdr_len = SIMPLE_REPLY_LEN;
        }
        sl.phase = Phase::Reply;
        self.outq.push(s);
    }

    fn on_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        self.in_io -= 1;
        match self.slots[s as usize].phase {
            Phase::Io | Phase::FuaFlush => {}
            _ => return self.on_unaligned_io(io, s, res),
        }
        self.io_done(io, s, res);
        // A completed write may be what a waiting write waited for.
        if !self.blocked.is_empty() {
            self.retry_blocked(io);
        }
    }

    fn io_done(&mut self, io: &mut CoreIo, s: u16, res: i32) {
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
        if let Some(b) = sl.rmw_buf.take() {
            io.bufs.put(b);
        }
        sl.phase = Phase::Free;
        self.budget.release(std::mem::take(&mut sl.charged));
        self.free.push(s);
    }

    /// Send every queued reply in one sendmsg.
    fn send(&mut self, io: &mut CoreIo) {
        if self.sock.send_posted() || self.outq.is_empty() {
            return;
        }
        if self.sock.dead {
            let q = std::mem::take(&mut self.outq);
            for &s in &q {
                self.release(io, s);
            }
            self.outq = q;
            self.outq.clear();
            return;
        }
        let batch = self.sock.batch();
        batch.clear();
        self.sending.clear();
        let mut taken = 0;
        for &s in &self.outq {
            if !batch.has_room(2) {
                break;
            }
            let sl = &self.slots[s as usize];
            batch.push(sl.hdr.as_ptr(), sl.hdr_len);
            if sl.data_len > 0 {
                let b = sl.buf.as_ref().expect("reply data buffer");
                batch.push(b.as_ptr(), sl.data_len as usize);
            }
            self.sending.push(s);
            taken += 1;
        }
        self.outq.drain(..taken);
        if let Some(t) = &mut self.tls {
            if let Err(e) = t.seal(self.sock.batch()) {
                warn!(error = %e, "nbd: TLS encryption failed, closing the connection");
                self.sock.draining = true;
                self.sock.dead = true;
                let q = std::mem::take(&mut self.sending);
                for &s in &q {
                    self.release(io, s);
                }
                self.sending = q;
                self.sending.clear();
                return;
            }
        }
        let tag = self.tag(SLOT_SEND);
        // SAFETY: the iovecs point at the headers and buffers of the slots in `sending`,
        // which are released only in on_send, once the send is over.
        unsafe { self.sock.post_send(io, tag) };
    }

    fn on_send(&mut self, io: &mut CoreIo, res: i32) {
        let tag = self.tag(SLOT_SEND);
        if self.sock.send_done(io, res, tag) == SendDone::Partial {
            return;
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

impl<T: ExportTarget> NbdConn<T> {
    /// A TLS session ends with close_notify before the socket is shut down.
    #[cold]
    fn close_tls_when_idle(&mut self, io: &mut CoreIo, idle: bool) {
        if !idle || !self.sock.draining || self.sock.dead || self.sock.send_posted() {
            return;
        }
        let tag = self.tag(SLOT_SEND);
        let Some(t) = &mut self.tls else { return };
        if t.close(self.sock.batch()) {
            // SAFETY: the batch points at the link's own output buffer, which is not
            // touched until the send completes.
            unsafe { self.sock.post_send(io, tag) };
        }
    }
}

impl<T: ExportTarget> Drop for NbdConn<T> {
    fn drop(&mut self) {
        let st = &self.stats;
        info!(
            protocol = "nbd",
            client = %self.opts.client,
            export = %self.opts.export,
            duration_s = self.connected.elapsed().as_secs_f64(),
            read_bytes = st.read_bytes.load(Relaxed),
            write_bytes = st.write_bytes.load(Relaxed),
            requests = st.reads.load(Relaxed) + st.writes.load(Relaxed) + st.others.load(Relaxed),
            errors = st.errors.load(Relaxed),
            "nbd: client disconnected"
        );
        self.target.unregister_stats(&self.stats);
    }
}

impl<T: ExportTarget> Task for NbdConn<T> {
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
            s => self.on_io(io, io_slot(s), res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let stats = &self.stats;
        self.unrecorded.flush(io.now(), |_| Some(stats));
        self.send(io);
        // Once drained (nothing in flight, nothing to send), wake our receive with a
        // shutdown so the connection can finish.
        let idle = self.in_io == 0 && self.outq.is_empty();
        if self.tls.is_some() {
            self.close_tls_when_idle(io, idle);
        }
        self.sock.shut_down_when_idle(idle);
    }

    fn finished(&self) -> bool {
        self.sock.is_closed() && self.in_io == 0 && self.gate.is_idle()
    }
}
