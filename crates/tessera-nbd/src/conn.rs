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

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tessera_export::conn::{
    add_throttled, read_into_new_buf, FreeList, RecvBuf, SendDone, Socket, StatsBatch,
};
use tessera_export::{
    Charge, Export, ExportHandle, ExportTarget, Gate, IoClass, IoStats, Released,
};
use tessera_io::{AlignedBuf, CoreIo, IoOp, Tag, Task};
use tracing::warn;

use crate::proto::*;

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
}

impl<T: ExportTarget> NbdConn<T> {
    /// Build a connection on the core that will serve it (`io` is that core's context).
    /// A read-only target is served read-only whatever the handshake said.
    pub fn new(io: &mut CoreIo, fd: OwnedFd, export: &Export<T>, mut opts: ConnOptions) -> Self {
        let target = export.target.clone();
        opts.read_only |= target.read_only();
        let stats = target.register_stats();
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
        }
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
                if self.free.is_empty() {
                    return; // resume when a slot frees up
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
        unsafe { self.sock.post_recv(io, ptr, len, tag) };
    }

    fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        // EOF or error: the client went away (or half-closed). Finish what is in flight,
        // send what can still be sent, then close.
        let Some(n) = self.sock.recv_done(res) else {
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
                    warn!(error = %e, "nbd: closing connection");
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
                warn!(
                    bytes = h.length,
                    limit = MAX_PAYLOAD,
                    "nbd: closing connection: write payload exceeds the limit"
                );
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
            self.rbuf.consume(REQUEST_HEADER_LEN);
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
                let (buf, op) = read_into_new_buf(io, offset, len);
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
                self.sock.draining = true;
            }
            _ => self.finish(io, s, EINVAL),
        }
    }

    /// Hand `op` to the target; its buffer (if any) is the buffer of the slot `tag` names.
    fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
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
        let runs = self.target.allocation_runs(offset, len as u64, max);
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
            batch.push(sl.hdr.as_ptr(), sl.hdr_len as usize);
            if sl.data_len > 0 {
                let b = sl.buf.as_ref().expect("reply data buffer");
                batch.push(b.as_ptr(), sl.data_len as usize);
            }
            self.sending.push(s);
            taken += 1;
        }
        self.outq.drain(..taken);
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

impl<T: ExportTarget> Drop for NbdConn<T> {
    fn drop(&mut self) {
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
            s => self.on_io(io, s as u16, res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let stats = &self.stats;
        self.unrecorded.flush(io.now(), |_| Some(stats));
        self.send(io);
        // Once drained (nothing in flight, nothing to send), wake our receive with a
        // shutdown so the connection can finish.
        let idle = self.in_io == 0 && self.outq.is_empty();
        self.sock.shut_down_when_idle(idle);
    }

    fn finished(&self) -> bool {
        self.sock.is_closed() && self.in_io == 0 && self.gate.is_idle()
    }
}
