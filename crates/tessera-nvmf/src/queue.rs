//! One NVMe/TCP queue (admin or I/O), served on one reactor core, built like
//! `tessera_nbd::conn::NbdConn`: one receive kept posted into a large buffer, every
//! complete PDU in it handled at once, commands dispatched to the volumes concurrently and
//! answered in completion order, and everything ready to leave gathered into one
//! `sendmsg` (C2HData header, data buffer, data digest and response capsule as iovecs
//! of the slot: no copy of read data). Slots are preallocated; data buffers come from the
//! core's pool; nothing is allocated per command on the I/O path.
//!
//! The connection's life: ICReq → ICResp, then Fabrics Connect (admin queue: creates the
//! controller; I/O queue: joins it), then commands. A malformed PDU gets the C2HTermReq
//! the transport binding prescribes and the connection closes; a command error gets its
//! NVMe status and the queue continues.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types};
use tessera_io::{AlignedBuf, CoreIo, IoHandle, IoOp, Reactor, Task};
use tessera_nbd::conn::{Gate, LatencyDetector};
use tessera_pool::{IoClass, IoStats, VolumeHandle};

use crate::nvme::{self, *};
use crate::pdu::{self, Fatal, Fes, Framing, Limits, Role};
use crate::target::{self, Controller, Target};

const RBUF_CAP: usize = 1 << 20;
const MAX_IOV: usize = 1024;
const SLOT_RECV: u32 = u32::MAX;
const SLOT_SEND: u32 = u32::MAX - 1;
/// Namespace `i`'s gate uses slots `SLOT_GATE - 2i` (limits timer) and
/// `SLOT_GATE - 2i - 1` (share round); request slots are u16, far below.
const SLOT_GATE: u32 = u32::MAX - 16;
const SLOT_GATE_END: u32 = SLOT_GATE - 2 * 65536;
const SLOT_TICK: u32 = u32::MAX - 3;
/// The admin queue checks keep-alive and pending asynchronous events this often.
const TICK: Duration = Duration::from_millis(100);
/// A connection that has not completed Connect in this time is closed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Slots before Connect says how deep the queue is (the admin queue's Connect needs one).
const INITIAL_SLOTS: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Free,
    /// R2T sent (or queued): receiving H2CData into the slot buffer.
    AwaitData,
    /// Waiting for QoS admission.
    Throttled,
    Io,
    /// Write done; the FUA flush is in flight.
    FuaFlush,
    /// Compare: the stored data is being read.
    CompareRead,
    /// An Asynchronous Event Request held until an event.
    Aer,
    Reply,
}

struct Slot {
    phase: Phase,
    sqe: Sqe,
    /// Index into the queue's namespaces (I/O commands).
    ns: usize,
    buf: Option<AlignedBuf>,
    /// Second buffer (Compare: the stored data).
    buf2: Option<AlignedBuf>,
    /// Host-to-controller transfer length and how much has arrived.
    h2c_len: u32,
    h2c_got: u32,
    /// Controller-to-host data to send with the reply.
    c2h_len: u32,
    status: Status,
    dw0: u32,
    start: Instant,
    /// C2HData header (with digest and padding).
    hdr: [u8; 160],
    hdr_len: u8,
    ddg: [u8; 4],
    resp: [u8; 28],
    resp_len: u8,
    r2t: [u8; 28],
    r2t_len: u8,
    skip_resp: bool,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            phase: Phase::Free,
            sqe: Sqe::default(),
            ns: 0,
            buf: None,
            buf2: None,
            h2c_len: 0,
            h2c_got: 0,
            c2h_len: 0,
            status: 0,
            dw0: 0,
            start: Instant::now(),
            hdr: [0; 160],
            hdr_len: 0,
            ddg: [0; 4],
            resp: [0; 28],
            resp_len: 0,
            r2t: [0; 28],
            r2t_len: 0,
            skip_resp: false,
        }
    }
}

enum Out {
    Reply(u16),
    R2t(u16),
    Bytes(Vec<u8>),
}

/// A namespace as one I/O queue sees it: this core's volume handle, QoS limiter and
/// stats block (the same pieces an NBD connection uses).
struct Ns {
    nsid: u32,
    vol: VolumeHandle,
    /// QoS admission for this namespace's volume (limits, group, shares).
    gate: Gate,
    stats: Arc<IoStats>,
    blocks: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for ICReq.
    Init,
    /// ICResp sent; waiting for Connect.
    Ready,
    Connected,
}

pub struct NvmfQueue {
    fd: OwnedFd,
    id: u32,
    target: Arc<Target>,
    state: State,
    ctrl: Option<Arc<Controller>>,
    qid: u16,
    /// Queue entries (1-based) agreed at Connect.
    entries: usize,
    sq_flow_disabled: bool,
    sqhd: u16,
    ns: Vec<Ns>,
    ns_gen: u64,
    send_framing: Framing,
    limits: Limits,
    rbuf: AlignedBuf,
    rstart: usize,
    rend: usize,
    recv_posted: bool,
    slots: Vec<Slot>,
    free: Vec<u16>,
    /// Commands received and not yet answered (what the host counts as outstanding).
    active: usize,
    aers: Vec<u16>,
    outq: Vec<Out>,
    sending: Vec<Out>,
    iov: Vec<libc::iovec>,
    iov_at: usize,
    msg: Box<libc::msghdr>,
    send_posted: bool,
    in_io: usize,
    released: Vec<tessera_qos::gate::Released>,
    /// Completed I/O commands of this batch (namespace index, class, bytes, receipt,
    /// success), accounted when the batch is flushed.
    unrecorded: Vec<(usize, IoClass, u64, std::time::Instant, bool)>,
    tick_armed: bool,
    started: Instant,
    latency: LatencyDetector,
    req_seq: u64,
    reply_seq: u64,
    draining: bool,
    dead: bool,
    shut: bool,
    registered: bool,
}

impl NvmfQueue {
    pub fn new(_io: &mut CoreIo, fd: OwnedFd, target: Arc<Target>) -> NvmfQueue {
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let msg: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
        NvmfQueue {
            fd,
            id: 0,
            target,
            state: State::Init,
            ctrl: None,
            qid: 0,
            entries: INITIAL_SLOTS,
            sq_flow_disabled: false,
            sqhd: 0,
            ns: Vec::new(),
            ns_gen: 0,
            send_framing: Framing::default(),
            limits: Limits {
                hdgst: false,
                ddgst: false,
                max_data: target::MAXH2CDATA.max(target::IN_CAPSULE as u32),
            },
            rbuf: AlignedBuf::zeroed(RBUF_CAP),
            rstart: 0,
            rend: 0,
            recv_posted: false,
            slots: (0..INITIAL_SLOTS).map(|_| Slot::new()).collect(),
            free: (0..INITIAL_SLOTS as u16).rev().collect(),
            active: 0,
            aers: Vec::new(),
            outq: Vec::new(),
            sending: Vec::new(),
            iov: Vec::with_capacity(MAX_IOV),
            iov_at: 0,
            msg,
            send_posted: false,
            in_io: 0,
            released: Vec::new(),
            unrecorded: Vec::new(),
            tick_armed: false,
            started: Instant::now(),
            latency: LatencyDetector::default(),
            req_seq: 0,
            reply_seq: 0,
            draining: false,
            dead: false,
            shut: false,
            registered: false,
        }
    }

    fn tag(&self, slot: u32) -> u64 {
        Reactor::tag(self.id, slot)
    }

    fn arm_tick(&mut self, io: &mut CoreIo) {
        if !self.tick_armed {
            self.tick_armed = true;
            let d = if self.state == State::Connected {
                TICK
            } else {
                Duration::from_secs(1)
            };
            io.complete_after(d, self.tag(SLOT_TICK), 0);
        }
    }

    // ---- receive ----

    fn post_recv(&mut self, io: &mut CoreIo) {
        if self.recv_posted || self.draining || self.rend == RBUF_CAP {
            return;
        }
        // SAFETY: rend < RBUF_CAP.
        let ptr = unsafe { self.rbuf.as_mut_ptr().add(self.rend) };
        let e = opcode::Recv::new(
            types::Fd(self.fd.as_raw_fd()),
            ptr,
            (RBUF_CAP - self.rend) as u32,
        )
        .build()
        .user_data(self.tag(SLOT_RECV));
        // SAFETY: the buffer belongs to this task, which outlives the operation
        // (finished() waits for it).
        unsafe { io.push_sqe(e) };
        self.recv_posted = true;
    }

    fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        self.recv_posted = false;
        if res <= 0 {
            self.draining = true;
            if res < 0 {
                self.dead = true;
            }
            return;
        }
        self.rend += res as usize;
        self.parse(io);
        self.post_recv(io);
    }

    /// End the connection with a C2HTermReq quoting the offending header.
    fn fatal(&mut self, f: Fatal, at: usize) {
        // Quote the offending header: HLEN bytes when that is plausible, else what we have
        // of the common header.
        let have = (self.rend - at).min(128);
        let hlen = self.rbuf.as_slice().get(at + 2).copied().unwrap_or(0) as usize;
        let n = if (pdu::CH_LEN..=have).contains(&hlen) {
            hlen
        } else {
            have.min(pdu::CH_LEN)
        };
        let quoted = &self.rbuf.as_slice()[at..at + n];
        eprintln!(
            "tessera: nvmf: queue {} of controller {}: {f}; terminating the connection",
            self.qid,
            self.ctrl.as_ref().map_or(0, |c| c.cntlid)
        );
        let t = pdu::encode_term(pdu::C2H_TERM, f, quoted);
        self.outq.push(Out::Bytes(t));
        self.draining = true;
    }

    fn parse(&mut self, io: &mut CoreIo) {
        while !self.draining {
            let avail = self.rend - self.rstart;
            if self.state == State::Init {
                if avail < pdu::CH_LEN {
                    break;
                }
                // Refuse a wrong first PDU before waiting for 128 bytes of it.
                let ch = pdu::Ch::parse(&self.rbuf.as_slice()[self.rstart..]);
                if ch.ty != pdu::ICREQ || ch.plen as usize != pdu::IC_LEN {
                    let f = if ch.ty != pdu::ICREQ {
                        Fatal::new(Fes::PduSequenceError, 0)
                    } else {
                        Fatal::new(Fes::InvalidHeaderField, 4)
                    };
                    self.fatal(f, self.rstart);
                    break;
                }
                if avail < pdu::IC_LEN {
                    break;
                }
                let b = &self.rbuf.as_slice()[self.rstart..self.rstart + pdu::IC_LEN];
                match pdu::parse_icreq(b) {
                    Ok(r) => {
                        let hd = r.digest & pdu::DIGEST_HDR != 0;
                        let dd = r.digest & pdu::DIGEST_DATA != 0;
                        self.limits.hdgst = hd;
                        self.limits.ddgst = dd;
                        self.send_framing = Framing {
                            hdgst: hd,
                            ddgst: dd,
                            align: 4 * (r.hpda as usize + 1),
                        };
                        let resp = pdu::encode_icresp(&pdu::IcResp {
                            pfv: 0,
                            cpda: 0,
                            digest: r.digest & (pdu::DIGEST_HDR | pdu::DIGEST_DATA),
                            maxh2cdata: target::MAXH2CDATA,
                        });
                        self.outq.push(Out::Bytes(resp.to_vec()));
                        self.rstart += pdu::IC_LEN;
                        self.state = State::Ready;
                    }
                    Err(f) => {
                        self.fatal(f, self.rstart);
                        break;
                    }
                }
                continue;
            }
            if avail < pdu::CH_LEN {
                break;
            }
            let at = self.rstart;
            let frame = match pdu::check_header(
                Role::Controller,
                &self.rbuf.as_slice()[at..self.rend],
                &self.limits,
            ) {
                Ok(f) => f,
                Err(f) => {
                    self.fatal(f, at);
                    break;
                }
            };
            if frame.ch.ty == pdu::CAPSULE_CMD && frame.data_len > target::IN_CAPSULE {
                self.fatal(Fatal::new(Fes::DataLimitExceeded, 4), at);
                break;
            }
            if avail < frame.plen() {
                break;
            }
            if let Err(f) = pdu::check_hdgst(&frame, &self.rbuf.as_slice()[at..]) {
                self.fatal(f, at);
                break;
            }
            match frame.ch.ty {
                pdu::H2C_TERM => {
                    let (fes, fei) = pdu::parse_term(&self.rbuf.as_slice()[at..]);
                    eprintln!("tessera: nvmf: host terminated the connection (FES {fes:#x}, FEI {fei:#x})");
                    self.draining = true;
                    self.dead = true;
                    break;
                }
                pdu::CAPSULE_CMD => {
                    let Some(s) = self.free.pop() else { break };
                    self.rstart += frame.plen();
                    self.on_capsule(io, s, &frame, at);
                }
                _ => {
                    // H2C_DATA (check_header admits nothing else for a controller).
                    self.rstart += frame.plen();
                    if let Err(f) = self.on_h2c(io, &frame, at) {
                        self.fatal(f, at);
                        break;
                    }
                }
            }
        }
        // The buffer may move only while no receive is posted into it: a posted receive
        // writes at the offset it was given, so resetting or compacting under it (parse
        // also runs from on_send, to resume after slots were freed) would drop what it
        // brings and parse stale commands in its place. on_recv compacts instead.
        if self.recv_posted {
            return;
        }
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

    /// Data direction of a command: 1 host to controller, 2 controller to host.
    fn direction(sqe: &Sqe) -> u8 {
        if sqe.opc == FABRICS {
            if sqe.fctype() == FCTYPE_CONNECT {
                1
            } else {
                0
            }
        } else {
            sqe.opc & 3
        }
    }

    fn on_capsule(&mut self, io: &mut CoreIo, s: u16, f: &pdu::Frame, at: usize) {
        let pdu_bytes = &self.rbuf.as_slice()[at..at + f.plen()];
        let sqe = Sqe::parse(&pdu_bytes[8..72]);
        let ddgst_ok = pdu::ddgst_ok(f, pdu_bytes);
        self.req_seq += 1;
        self.latency.on_request(self.req_seq, io.now());
        self.active += 1;
        if !self.sq_flow_disabled {
            self.sqhd = if self.sqhd as usize + 1 >= self.entries {
                0
            } else {
                self.sqhd + 1
            };
        }
        {
            let sl = &mut self.slots[s as usize];
            sl.sqe = sqe;
            sl.start = io.now();
            sl.status = 0;
            sl.dw0 = 0;
            sl.c2h_len = 0;
            sl.h2c_len = 0;
            sl.h2c_got = 0;
            sl.phase = Phase::Io;
        }
        if self.state == State::Connected && self.active > self.entries {
            // More commands than the queue size agreed at Connect.
            return self.finish(io, s, SC_CMD_SEQ_ERROR | DNR);
        }
        if !ddgst_ok {
            return self.finish(io, s, SC_TRANSIENT_TRANSPORT);
        }
        let dir = Self::direction(&sqe);
        let len = sqe.sgl.len as usize;
        if f.data_len > 0 && !(dir == 1 && sqe.sgl.kind == SGL_DATA_BLOCK_OFFSET) {
            return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
        }
        if len == 0 || dir == 0 {
            return self.execute(io, s);
        }
        if len > target::MAX_TRANSFER {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        match (sqe.sgl.kind, dir) {
            (SGL_DATA_BLOCK_OFFSET, 1) => {
                if sqe.sgl.addr != 0 {
                    return self.finish(io, s, SC_SGL_INVALID_OFFSET | DNR);
                }
                if len != f.data_len {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let mut buf = io.bufs.get(len);
                buf.as_mut_slice()[..len]
                    .copy_from_slice(&self.rbuf.as_slice()[at + f.data_off..at + f.data_off + len]);
                let sl = &mut self.slots[s as usize];
                sl.buf = Some(buf);
                sl.h2c_len = len as u32;
                sl.h2c_got = len as u32;
                self.execute(io, s)
            }
            (SGL_TRANSPORT_DATA_BLOCK, 1) => {
                if self.state != State::Connected && sqe.opc != FABRICS {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                }
                // Ask for all of it with one R2T; the host splits it into H2CData PDUs of
                // at most MAXH2CDATA bytes.
                let buf = io.bufs.get(len);
                let fr = self.send_framing;
                let sl = &mut self.slots[s as usize];
                sl.buf = Some(buf);
                sl.h2c_len = len as u32;
                sl.phase = Phase::AwaitData;
                sl.r2t_len = fr.r2t(&mut sl.r2t, sqe.cid, s, 0, len as u32) as u8;
                self.outq.push(Out::R2t(s));
            }
            (SGL_TRANSPORT_DATA_BLOCK, 2) => self.execute(io, s),
            (SGL_DATA_BLOCK_OFFSET, _) => self.finish(io, s, SC_SGL_INVALID_DATA | DNR),
            _ => self.finish(io, s, SC_SGL_INVALID_TYPE | DNR),
        }
    }

    fn on_h2c(&mut self, io: &mut CoreIo, f: &pdu::Frame, at: usize) -> Result<(), Fatal> {
        let b = &self.rbuf.as_slice()[at..at + f.plen()];
        let cid = pdu::le16(b, 8);
        let ttag = pdu::le16(b, 10);
        let datao = pdu::le32(b, 12);
        let datal = pdu::le32(b, 16);
        let ok = self
            .slots
            .get(ttag as usize)
            .is_some_and(|sl| sl.phase == Phase::AwaitData && sl.sqe.cid == cid);
        if !ok {
            return Err(Fatal::new(Fes::InvalidHeaderField, 10));
        }
        if datal as usize != f.data_len {
            return Err(Fatal::new(Fes::InvalidHeaderField, 16));
        }
        let sl = &mut self.slots[ttag as usize];
        if datao != sl.h2c_got || datao as u64 + datal as u64 > sl.h2c_len as u64 {
            return Err(Fatal::new(Fes::DataOutOfRange, 12));
        }
        let last = sl.h2c_got + datal == sl.h2c_len;
        if last != (f.ch.flags & pdu::F_DATA_LAST != 0) {
            return Err(Fatal::new(Fes::PduSequenceError, 1));
        }
        let buf = sl.buf.as_mut().expect("h2c buffer");
        buf.as_mut_slice()[datao as usize..(datao + datal) as usize]
            .copy_from_slice(&b[f.data_off..f.data_off + datal as usize]);
        if !pdu::ddgst_ok(f, b) {
            sl.status = SC_TRANSIENT_TRANSPORT;
        }
        sl.h2c_got += datal;
        if last {
            sl.phase = Phase::Io;
            let st = sl.status;
            if st != 0 {
                self.finish(io, ttag, st);
            } else {
                self.execute(io, ttag);
            }
        }
        Ok(())
    }

    // ---- execution ----

    fn execute(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        if sqe.opc == FABRICS {
            return self.fabrics(io, s);
        }
        let Some(ctrl) = self.ctrl.clone() else {
            // Anything but Connect before Connect.
            return self.finish(io, s, SC_CMD_SEQ_ERROR);
        };
        if self.qid == 0 {
            return self.admin(io, s, &ctrl);
        }
        if !ctrl.ready.load(Acquire) {
            return self.finish(io, s, SC_CMD_SEQ_ERROR);
        }
        self.refresh_ns(io, &ctrl);
        let Some(ns) = self.ns.iter().position(|n| n.nsid == sqe.nsid) else {
            if sqe.opc == IO_FLUSH && sqe.nsid == 0xFFFF_FFFF {
                self.slots[s as usize].ns = usize::MAX;
                return self.admit_or_park(io, s);
            }
            return self.finish(io, s, SC_INVALID_NS | DNR);
        };
        self.slots[s as usize].ns = ns;
        self.admit_or_park(io, s)
    }

    /// Reopen namespace handles after the subsystem's namespaces changed (only when no
    /// I/O is in flight on the old handles).
    fn refresh_ns(&mut self, io: &mut CoreIo, ctrl: &Controller) {
        let g = ctrl.ns_gen.load(Acquire);
        if g == self.ns_gen || self.in_io > 0 || self.ns.iter().any(|n| !n.gate.is_idle()) {
            return;
        }
        self.ns_gen = g;
        self.open_namespaces(io, ctrl);
    }

    fn open_namespaces(&mut self, io: &mut CoreIo, ctrl: &Controller) {
        for n in self.ns.drain(..) {
            n.vol.volume().unregister_stats(&n.stats);
        }
        for e in ctrl.namespaces() {
            let vol = e.volume.open_handle();
            let stats = vol.volume().register_stats();
            let i = self.ns.len() as u32;
            let gate = Gate::new(
                io,
                &vol.volume().qos,
                self.tag(SLOT_GATE - 2 * i),
                self.tag(SLOT_GATE - 2 * i - 1),
            );
            let blocks = vol.size() >> target::LBA_SHIFT;
            self.ns.push(Ns {
                nsid: e.nsid,
                vol,
                gate,
                stats,
                blocks,
            });
        }
    }

    /// Pass the command to its volume if the namespace's gate (QoS limits, shares) lets
    /// it through now; otherwise the gate holds it and hands it back from `on_gate`.
    fn admit_or_park(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &self.slots[s as usize];
        let charge = match sl.sqe.opc {
            IO_READ | IO_COMPARE => Some((false, (sl.sqe.nlb() as u64) << target::LBA_SHIFT)),
            IO_WRITE => Some((true, (sl.sqe.nlb() as u64) << target::LBA_SHIFT)),
            IO_WRITE_ZEROES | IO_DSM => Some((true, 0)),
            _ => None,
        };
        let ns = sl.ns;
        let Some(n) = self.ns.get_mut(ns) else {
            // Flush of every namespace: no limit applies.
            return self.dispatch_io(io, s);
        };
        if n.gate.offer(io, s, charge) {
            return self.dispatch_io(io, s);
        }
        self.slots[s as usize].phase = Phase::Throttled;
    }

    /// Namespace `i`'s gate timer or round came: serve what it lets through now.
    fn on_gate(&mut self, io: &mut CoreIo, slot: u32) {
        let i = ((SLOT_GATE - slot) / 2) as usize;
        if i >= self.ns.len() {
            return; // a wake-up for namespaces reopened since
        }
        if self.dead {
            let mut slots = Vec::new();
            self.ns[i].gate.drain(&mut slots);
            for s in slots {
                self.active -= 1;
                self.release(io, s);
            }
        }
        let mut out = std::mem::take(&mut self.released);
        let tag = self.tag(slot);
        self.ns[i].gate.wake(io, tag, &mut out);
        for r in out.drain(..) {
            if r.throttled {
                let held = io
                    .now()
                    .saturating_duration_since(self.slots[r.slot as usize].start);
                self.ns[i].stats.add_throttled(held.as_nanos() as u64);
            }
            self.dispatch_io(io, r.slot);
        }
        self.released = out;
    }

    fn submit(&mut self, io: &mut CoreIo, ns: usize, op: IoOp, tag: u64) {
        self.in_io += 1;
        // SAFETY: the buffer of every Read/Write submitted here is held by the command's
        // slot (`buf` or `buf2`), which keeps it until the completion for `tag`
        // arrives; the queue is not dropped while I/O is in flight (it waits for
        // `in_io` to reach 0).
        unsafe { self.ns[ns].vol.submit(io, op, tag) };
    }

    /// The byte range of an LBA-addressed command, if it lies inside the namespace.
    fn range(&self, ns: usize, slba: u64, nlb: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(nlb)?;
        if end > self.ns[ns].blocks {
            return None;
        }
        Some((slba << target::LBA_SHIFT, nlb << target::LBA_SHIFT))
    }

    fn dispatch_io(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let sqe = self.slots[idx].sqe;
        let ns = self.slots[idx].ns;
        self.slots[idx].phase = Phase::Io;
        if ns == usize::MAX {
            // Flush of every namespace.
            if self.ns.is_empty() {
                return self.finish(io, s, 0);
            }
            let child = io.join(tag, self.ns.len() as u32);
            self.in_io += 1;
            for n in &mut self.ns {
                // SAFETY: a flush carries no buffer.
                unsafe { n.vol.submit(io, IoOp::Flush, child) };
            }
            return;
        }
        match sqe.opc {
            IO_READ | IO_WRITE | IO_COMPARE => {
                let Some((offset, len)) = self.range(ns, sqe.slba(), sqe.nlb() as u64) else {
                    return self.finish(io, s, SC_LBA_RANGE | DNR);
                };
                let expected = if sqe.opc == IO_READ {
                    sqe.sgl.len
                } else {
                    self.slots[idx].h2c_len
                };
                if len != expected as u64 {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let len = len as u32;
                match sqe.opc {
                    IO_READ => {
                        let mut buf = io.bufs.get(len as usize);
                        let op = IoOp::Read {
                            offset,
                            len,
                            buf: buf.as_mut_ptr(),
                        };
                        self.slots[idx].buf = Some(buf);
                        self.slots[idx].c2h_len = len;
                        self.submit(io, ns, op, tag);
                    }
                    IO_WRITE => {
                        let buf = self.slots[idx].buf.as_ref().expect("write data").as_ptr();
                        self.submit(io, ns, IoOp::Write { offset, len, buf }, tag);
                    }
                    _ => {
                        let mut buf = io.bufs.get(len as usize);
                        let op = IoOp::Read {
                            offset,
                            len,
                            buf: buf.as_mut_ptr(),
                        };
                        self.slots[idx].buf2 = Some(buf);
                        self.slots[idx].phase = Phase::CompareRead;
                        self.submit(io, ns, op, tag);
                    }
                }
            }
            IO_FLUSH => self.submit(io, ns, IoOp::Flush, tag),
            IO_WRITE_ZEROES => {
                let Some((offset, len)) = self.range(ns, sqe.slba(), sqe.nlb() as u64) else {
                    return self.finish(io, s, SC_LBA_RANGE | DNR);
                };
                // DEAC: the host allows deallocating (a thin unmap when whole units).
                let may_unmap = sqe.cdw12 & (1 << 25) != 0;
                self.submit(
                    io,
                    ns,
                    IoOp::WriteZeroes {
                        offset,
                        len,
                        may_unmap,
                    },
                    tag,
                );
            }
            IO_DSM => {
                let nr = (sqe.cdw10 & 0xFF) as usize + 1;
                if sqe.cdw11 & (1 << 2) == 0 {
                    // Only attributes (hints): nothing to do.
                    return self.finish(io, s, 0);
                }
                let data_ok = self.slots[idx]
                    .buf
                    .as_ref()
                    .is_some_and(|_| self.slots[idx].h2c_len as usize >= 16 * nr);
                if !data_ok {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let ranges = {
                    let b = self.slots[idx].buf.as_ref().expect("dsm data").as_slice();
                    nvme::dsm_ranges(b, nr)
                };
                let mut ops = Vec::with_capacity(nr);
                for (slba, nlb) in ranges {
                    if nlb == 0 {
                        continue;
                    }
                    let Some((offset, len)) = self.range(ns, slba, nlb as u64) else {
                        return self.finish(io, s, SC_LBA_RANGE | DNR);
                    };
                    ops.push(IoOp::Discard { offset, len });
                }
                if ops.is_empty() {
                    return self.finish(io, s, 0);
                }
                let child = io.join(tag, ops.len() as u32);
                self.in_io += 1;
                for op in ops {
                    // SAFETY: a discard carries no buffer.
                    unsafe { self.ns[ns].vol.submit(io, op, child) };
                }
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    fn on_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        self.in_io -= 1;
        let idx = s as usize;
        let sqe = self.slots[idx].sqe;
        if res < 0 {
            let write = matches!(sqe.opc, IO_WRITE | IO_WRITE_ZEROES | IO_DSM);
            return self.finish(io, s, nvme::status_from_errno(-res, write));
        }
        match self.slots[idx].phase {
            Phase::CompareRead => {
                let same = {
                    let sl = &self.slots[idx];
                    let n = sl.h2c_len as usize;
                    let a = &sl.buf.as_ref().expect("compare data").as_slice()[..n];
                    let b = &sl.buf2.as_ref().expect("stored data").as_slice()[..n];
                    a == b
                };
                self.finish(io, s, if same { 0 } else { SC_COMPARE_FAILED | DNR })
            }
            Phase::Io if sqe.opc == IO_WRITE && sqe.fua() => {
                self.slots[idx].phase = Phase::FuaFlush;
                let tag = self.tag(s as u32);
                let ns = self.slots[idx].ns;
                self.submit(io, ns, IoOp::Flush, tag);
            }
            _ => self.finish(io, s, 0),
        }
    }

    // ---- Fabrics ----

    fn fabrics(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        match sqe.fctype() {
            FCTYPE_CONNECT => self.connect(io, s),
            FCTYPE_PROPERTY_GET | FCTYPE_PROPERTY_SET => {
                let Some(ctrl) = self.ctrl.clone() else {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                };
                if self.qid != 0 {
                    return self.finish(io, s, SC_INVALID_OPCODE | DNR);
                }
                self.property(io, s, &ctrl)
            }
            FCTYPE_DISCONNECT => {
                if self.ctrl.is_none() {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                }
                self.finish(io, s, 0);
                // Answer, then close once everything in flight is done.
                self.draining = true;
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    fn connect(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        if self.state == State::Connected {
            return self.finish(io, s, SC_CMD_SEQ_ERROR | DNR);
        }
        let c = ConnectCmd::parse(&sqe);
        let have = self.slots[s as usize].h2c_got as usize;
        if have < CONNECT_DATA_LEN {
            return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
        }
        let d = ConnectData::parse(
            self.slots[s as usize]
                .buf
                .as_ref()
                .expect("connect data")
                .as_slice(),
        );
        let invalid = |in_data, off| {
            (
                SC_CONNECT_INVALID_PARAM | DNR,
                connect_invalid_param(in_data, off),
            )
        };
        let r: Result<(Arc<Controller>, u32), (Status, u32)> = (|| {
            if c.recfmt != 0 {
                return Err((0x0180 | DNR, 0)); // incompatible format
            }
            if c.sqsize == 0 || c.sqsize > target::MQES {
                return Err(invalid(false, 44));
            }
            if c.qid == 0 {
                if d.cntlid != 0xFFFF {
                    return Err(invalid(true, 16));
                }
                let sub = if d.subnqn == target::DISCOVERY_NQN {
                    None
                } else {
                    match self.target.catalog.subsystem(&d.subnqn) {
                        Some(x) => Some(x),
                        None => return Err(invalid(true, 256)),
                    }
                };
                if let Some(x) = &sub {
                    if !x.allows(&d.hostnqn) {
                        return Err((
                            SC_CONNECT_INVALID_HOST | DNR,
                            connect_invalid_param(true, 512),
                        ));
                    }
                }
                let ctrl = self
                    .target
                    .create_controller(&d.subnqn, sub, &d.hostnqn, d.hostid, c.kato)
                    .ok_or((SC_INTERNAL, 0))?;
                Ok((ctrl, 0))
            } else {
                let Some(ctrl) = self.target.controller(d.cntlid) else {
                    return Err(invalid(true, 16));
                };
                if ctrl.subnqn != d.subnqn {
                    return Err(invalid(true, 256));
                }
                if ctrl.hostnqn != d.hostnqn || ctrl.discovery {
                    return Err(invalid(true, 512));
                }
                if c.qid > ctrl.state().io_queues {
                    return Err(invalid(false, 42));
                }
                Ok((ctrl, 0))
            }
        })();
        let (ctrl, _) = match r {
            Ok(x) => x,
            Err((st, dw0)) => {
                self.slots[s as usize].dw0 = dw0;
                return self.finish(io, s, st);
            }
        };
        if !ctrl.register_queue(c.qid, self.fd.as_raw_fd()) {
            if c.qid == 0 {
                self.target.remove_controller(&ctrl, "");
            }
            self.slots[s as usize].dw0 = connect_invalid_param(false, 42);
            return self.finish(io, s, SC_CONNECT_INVALID_PARAM | DNR);
        }
        self.registered = true;
        self.qid = c.qid;
        self.entries = c.sqsize as usize + 1;
        self.sq_flow_disabled = c.cattr & CATTR_DISABLE_SQ_FLOW != 0;
        self.state = State::Connected;
        // Room for a full queue of commands plus as many answered ones still being sent.
        let want = 2 * self.entries + 4;
        while self.slots.len() < want {
            self.free.insert(0, self.slots.len() as u16);
            self.slots.push(Slot::new());
        }
        if c.qid != 0 {
            self.ns_gen = ctrl.ns_gen.load(Acquire);
            self.open_namespaces(io, &ctrl);
        }
        self.slots[s as usize].dw0 = ctrl.cntlid as u32;
        self.ctrl = Some(ctrl);
        self.finish(io, s, 0);
        if self.qid == 0 {
            self.arm_tick(io);
        }
    }

    fn property(&mut self, io: &mut CoreIo, s: u16, ctrl: &Controller) {
        let sqe = self.slots[s as usize].sqe;
        let eight = sqe.cdw10 & 7 == 1;
        let offset = sqe.cdw11;
        if sqe.fctype() == FCTYPE_PROPERTY_GET {
            let st = ctrl.state();
            let v: u64 = match (offset, eight) {
                (PROP_CAP, true) => nvme::cap(target::MQES),
                (PROP_VS, false) => VERSION as u64,
                (PROP_CC, false) => st.cc as u64,
                (PROP_CSTS, false) => st.csts as u64,
                _ => {
                    drop(st);
                    return self.finish(io, s, SC_INVALID_FIELD | DNR);
                }
            };
            drop(st);
            self.slots[s as usize].dw0 = v as u32;
            // DW1 carries the high half of an 8-byte property.
            return self.finish_dw1(io, s, (v >> 32) as u32);
        }
        let value = sqe.cdw12 as u64 | (sqe.cdw13 as u64) << 32;
        if offset != PROP_CC || eight {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        let v = value as u32;
        let mut st = ctrl.state();
        let old = st.cc;
        st.cc = v;
        if v & CC_EN != 0 && old & CC_EN == 0 {
            st.csts |= CSTS_RDY;
            ctrl.ready.store(true, Release);
        } else if v & CC_EN == 0 && old & CC_EN != 0 {
            // Controller reset: its I/O queues go away.
            st.csts &= !CSTS_RDY;
            ctrl.ready.store(false, Release);
            ctrl.reset_io_queues(&st);
        }
        if v & CC_SHN_MASK != 0 {
            // Shutdown: every completed write is already with the volume, and the pools
            // commit on their own; report the shutdown complete.
            st.csts = (st.csts & !(3 << 2)) | CSTS_SHST_COMPLETE;
        } else {
            st.csts &= !(3 << 2);
        }
        drop(st);
        self.finish(io, s, 0)
    }

    // ---- admin ----

    fn reply_data(&mut self, io: &mut CoreIo, s: u16, data: &[u8]) {
        let want = self.slots[s as usize].sqe.sgl.len as usize;
        let n = want.min(data.len());
        let mut buf = io.bufs.get(want.max(1));
        buf.as_mut_slice()[..n].copy_from_slice(&data[..n]);
        for x in &mut buf.as_mut_slice()[n..want] {
            *x = 0;
        }
        let sl = &mut self.slots[s as usize];
        sl.buf = Some(buf);
        sl.c2h_len = want as u32;
        self.finish(io, s, 0)
    }

    fn admin(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller>) {
        let sqe = self.slots[s as usize].sqe;
        let needs_ready = !matches!(sqe.opc, ADM_KEEP_ALIVE);
        if needs_ready && !ctrl.ready.load(Acquire) && !ctrl.discovery {
            return self.finish(io, s, SC_CMD_SEQ_ERROR);
        }
        let data_in = sqe.opc & 3 == 2;
        if data_in && sqe.sgl.kind != SGL_TRANSPORT_DATA_BLOCK && sqe.sgl.len > 0 {
            return self.finish(io, s, SC_SGL_INVALID_TYPE | DNR);
        }
        match sqe.opc {
            ADM_IDENTIFY => self.identify(io, s, ctrl),
            ADM_GET_LOG_PAGE => self.get_log_page(io, s, ctrl),
            ADM_KEEP_ALIVE => {
                ctrl.last_ka.store(self.target.now_ms(), Release);
                self.finish(io, s, 0)
            }
            ADM_SET_FEATURES | ADM_GET_FEATURES => self.features(io, s, ctrl),
            ADM_ASYNC_EVENT => {
                if self.aers.len() > target::AERL as usize {
                    return self.finish(io, s, SC_ASYNC_LIMIT);
                }
                self.slots[s as usize].phase = Phase::Aer;
                self.aers.push(s);
                self.deliver_aen(io, ctrl);
            }
            ADM_ABORT => {
                let sqid = sqe.cdw10 as u16;
                let cid = (sqe.cdw10 >> 16) as u16;
                // Held AERs can be aborted; commands already running on a volume cannot
                // (DW0 bit 0 = not aborted), which the spec allows.
                let hit = (sqid == 0)
                    .then(|| {
                        self.aers
                            .iter()
                            .position(|&a| self.slots[a as usize].sqe.cid == cid)
                    })
                    .flatten();
                match hit {
                    Some(i) => {
                        let a = self.aers.remove(i);
                        self.finish(io, a, SC_ABORT_REQ);
                        self.finish(io, s, 0);
                    }
                    None => {
                        self.slots[s as usize].dw0 = 1;
                        self.finish(io, s, 0)
                    }
                }
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    fn identify(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller>) {
        let sqe = self.slots[s as usize].sqe;
        let cns = sqe.cdw10 as u8;
        let namespaces = ctrl.namespaces();
        let ns_info = |nsid: u32| {
            namespaces
                .iter()
                .find(|n| n.nsid == nsid)
                .map(|n| NamespaceInfo {
                    blocks: n.volume.size() >> target::LBA_SHIFT,
                    allocated_blocks: n.volume.allocated_bytes() >> target::LBA_SHIFT,
                    lba_shift: target::LBA_SHIFT,
                    nguid: n.nguid,
                    eui64: n.eui64,
                    uuid: n.uuid,
                })
        };
        let data = match cns {
            CNS_CONTROLLER => identify_controller(&ControllerInfo {
                serial: ctrl.serial(),
                model: "Tessera".into(),
                firmware: env!("CARGO_PKG_VERSION").into(),
                cntlid: ctrl.cntlid,
                mdts: target::MDTS,
                nn: namespaces.iter().map(|n| n.nsid).max().unwrap_or(0),
                subnqn: ctrl.subnqn.clone(),
                discovery: ctrl.discovery,
                ioccsz: ((SQE_LEN + target::IN_CAPSULE) / 16) as u32,
                maxcmd: target::MQES + 1,
                kas: 1,
                aerl: target::AERL,
                elpe: (target::ERROR_LOG - 1) as u8,
            }),
            CNS_NAMESPACE if !ctrl.discovery => match ns_info(sqe.nsid) {
                Some(n) => identify_namespace(&n),
                // An inactive but valid NSID reads as zeros; others are invalid.
                None if sqe.nsid != 0 && sqe.nsid != 0xFFFF_FFFF => vec![0; IDENTIFY_LEN],
                None => return self.finish(io, s, SC_INVALID_NS | DNR),
            },
            CNS_ACTIVE_NS_LIST if !ctrl.discovery => {
                if sqe.nsid >= 0xFFFF_FFFE {
                    return self.finish(io, s, SC_INVALID_NS | DNR);
                }
                let ids: Vec<u32> = namespaces.iter().map(|n| n.nsid).collect();
                active_ns_list(&ids, sqe.nsid)
            }
            CNS_NS_DESC_LIST if !ctrl.discovery => match ns_info(sqe.nsid) {
                Some(n) => identify_ns_descriptors(&n),
                None => return self.finish(io, s, SC_INVALID_NS | DNR),
            },
            _ => return self.finish(io, s, SC_INVALID_FIELD | DNR),
        };
        self.reply_data(io, s, &data)
    }

    fn get_log_page(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller>) {
        let sqe = self.slots[s as usize].sqe;
        let (lid, len, offset, _rae) = log_page_args(&sqe);
        if len != sqe.sgl.len as usize || offset % 4 != 0 {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        let page = match lid {
            LID_DISCOVERY if ctrl.discovery => {
                let e = self.target.discovery_entries(&ctrl.hostnqn);
                discovery_log(self.target.catalog.generation(), &e)
            }
            LID_ERROR => {
                let st = ctrl.state();
                let e: Vec<ErrorEntry> = st.errors.iter().copied().collect();
                error_log(&e)
            }
            LID_SMART if !ctrl.discovery => {
                let mut sm = Smart::default();
                for n in ctrl.namespaces() {
                    if sqe.nsid != 0xFFFF_FFFF && sqe.nsid != 0 && sqe.nsid != n.nsid {
                        continue;
                    }
                    let st = n.volume.stats();
                    sm.read_bytes += st.read_bytes;
                    sm.write_bytes += st.write_bytes;
                    sm.reads += st.reads;
                    sm.writes += st.writes;
                    sm.errors += st.errors;
                }
                sm.power_on_hours = self.target.started.elapsed().as_secs() / 3600;
                smart_log(&sm)
            }
            LID_FW_SLOT if !ctrl.discovery => {
                let mut b = vec![0u8; 512];
                b[0] = 1;
                let fw = env!("CARGO_PKG_VERSION").as_bytes();
                for (i, x) in b[8..16].iter_mut().enumerate() {
                    *x = *fw.get(i).unwrap_or(&b' ');
                }
                b
            }
            LID_CHANGED_NS if !ctrl.discovery => {
                let ids = std::mem::take(&mut ctrl.state().changed);
                changed_ns_log(&ids)
            }
            _ => return self.finish(io, s, SC_INVALID_LOG_PAGE | DNR),
        };
        let from = (offset as usize).min(page.len());
        self.reply_data(io, s, &page[from..])
    }

    fn features(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller>) {
        let sqe = self.slots[s as usize].sqe;
        let fid = sqe.cdw10 as u8;
        let set = sqe.opc == ADM_SET_FEATURES;
        if set && sqe.cdw10 & (1 << 31) != 0 {
            return self.finish(io, s, SC_FEATURE_NOT_SAVEABLE | DNR);
        }
        let mut st = ctrl.state();
        let r: Result<u32, Status> = match (fid, set) {
            (FEAT_NUM_QUEUES, true) if !ctrl.discovery => {
                let nsqr = sqe.cdw11 & 0xFFFF;
                let ncqr = sqe.cdw11 >> 16;
                if nsqr == 0xFFFF || ncqr == 0xFFFF {
                    Err(SC_INVALID_FIELD | DNR)
                } else {
                    let n = (nsqr.max(ncqr) + 1).min(target::MAX_IO_QUEUES as u32);
                    st.io_queues = n as u16;
                    Ok((n - 1) | (n - 1) << 16)
                }
            }
            (FEAT_NUM_QUEUES, false) if !ctrl.discovery => {
                let n = st.io_queues as u32 - 1;
                Ok(n | n << 16)
            }
            (FEAT_KATO, true) => {
                st.kato_ms = sqe.cdw11;
                ctrl.last_ka.store(self.target.now_ms(), Release);
                Ok(0)
            }
            (FEAT_KATO, false) => Ok(st.kato_ms),
            (FEAT_ASYNC_EVENT, true) => {
                st.aec = sqe.cdw11;
                Ok(0)
            }
            (FEAT_ASYNC_EVENT, false) => Ok(st.aec),
            // The volatile write cache is always on (writes are durable after Flush).
            (FEAT_VOLATILE_WC, true) if !ctrl.discovery => Ok(0),
            (FEAT_VOLATILE_WC, false) if !ctrl.discovery => Ok(1),
            (FEAT_ARBITRATION | FEAT_POWER_MGMT | FEAT_TEMP_THRESH | FEAT_ERR_RECOVERY, false)
                if !ctrl.discovery =>
            {
                Ok(0)
            }
            _ => Err(SC_INVALID_FIELD | DNR),
        };
        drop(st);
        match r {
            Ok(dw0) => {
                self.slots[s as usize].dw0 = dw0;
                self.finish(io, s, 0)
            }
            Err(e) => self.finish(io, s, e),
        }
    }

    fn deliver_aen(&mut self, io: &mut CoreIo, ctrl: &Controller) {
        while !self.aers.is_empty() {
            let Some(ev) = ctrl.state().aen.pop_front() else {
                return;
            };
            let a = self.aers.remove(0);
            self.slots[a as usize].dw0 = ev;
            self.finish(io, a, 0);
        }
    }

    /// Admin queue: keep-alive check and event delivery. Before Connect: the timeout.
    fn on_tick(&mut self, io: &mut CoreIo) {
        self.tick_armed = false;
        if self.draining {
            return;
        }
        match (&self.ctrl, self.state) {
            (Some(ctrl), State::Connected) => {
                let ctrl = ctrl.clone();
                if ctrl.dead.load(Acquire) {
                    self.draining = true;
                    return;
                }
                let kato = ctrl.state().kato_ms as u64;
                let idle = self
                    .target
                    .now_ms()
                    .saturating_sub(ctrl.last_ka.load(Acquire));
                if kato > 0 && idle > kato {
                    self.target.remove_controller(
                        &ctrl,
                        &format!("keep-alive timeout ({kato} ms) expired; tearing down its queues"),
                    );
                    self.draining = true;
                    return;
                }
                self.deliver_aen(io, &ctrl);
            }
            _ => {
                if self.started.elapsed() >= CONNECT_TIMEOUT {
                    eprintln!("tessera: nvmf: closing a connection that did not connect within {CONNECT_TIMEOUT:?}");
                    self.draining = true;
                    return;
                }
            }
        }
        self.arm_tick(io);
    }

    // ---- completion and sending ----

    fn finish_dw1(&mut self, io: &mut CoreIo, s: u16, dw1: u32) {
        self.finish_with(io, s, 0, dw1)
    }

    fn finish(&mut self, io: &mut CoreIo, s: u16, status: Status) {
        self.finish_with(io, s, status, 0)
    }

    fn finish_with(&mut self, _io: &mut CoreIo, s: u16, status: Status, dw1: u32) {
        self.active -= 1;
        let idx = s as usize;
        let qid = self.qid;
        let sqe = self.slots[idx].sqe;
        // Per-volume statistics, as an NBD connection keeps them.
        if self.qid != 0 && sqe.opc != FABRICS && self.slots[idx].ns < self.ns.len() {
            let sl = &self.slots[idx];
            let bytes = (sqe.nlb() as u64) << target::LBA_SHIFT;
            let (class, bytes) = match sqe.opc {
                IO_READ => (IoClass::Read, bytes),
                IO_WRITE => (IoClass::Write, bytes),
                _ => (IoClass::Other, 0),
            };
            // Timed when the batch is flushed (see `flush`).
            self.unrecorded
                .push((sl.ns, class, bytes, sl.start, status == 0));
        }
        if status != 0 {
            if let Some(c) = &self.ctrl {
                c.record_error(ErrorEntry {
                    count: 0,
                    sqid: qid,
                    cid: sqe.cid,
                    status,
                    lba: sqe.slba(),
                    nsid: sqe.nsid,
                });
            }
        }
        let fr = self.send_framing;
        let skip_ok = self.sq_flow_disabled && !fr.ddgst;
        let sqhd = self.sqhd;
        let sl = &mut self.slots[idx];
        sl.status = status;
        sl.buf2 = None;
        if status != 0 {
            sl.c2h_len = 0;
        }
        sl.skip_resp = false;
        if sl.c2h_len > 0 {
            let len = sl.c2h_len;
            sl.skip_resp = skip_ok;
            let flags = pdu::F_DATA_LAST | if skip_ok { pdu::F_DATA_SUCCESS } else { 0 };
            sl.hdr_len = fr.data_pdu(&mut sl.hdr, pdu::C2H_DATA, flags, sqe.cid, 0, 0, len) as u8;
            if fr.ddgst {
                let d = pdu::crc(&sl.buf.as_ref().expect("reply data").as_slice()[..len as usize]);
                sl.ddg = d.to_le_bytes();
            }
        }
        if !sl.skip_resp {
            let cqe = Cqe {
                dw0: sl.dw0,
                dw1,
                sqhd,
                sqid: qid,
                cid: sqe.cid,
                status,
            };
            sl.resp_len = fr.capsule_resp(&mut sl.resp, &cqe.encode()) as u8;
        }
        sl.phase = Phase::Reply;
        self.outq.push(Out::Reply(s));
    }

    fn release(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &mut self.slots[s as usize];
        if let Some(b) = sl.buf.take() {
            io.bufs.put(b);
        }
        if let Some(b) = sl.buf2.take() {
            io.bufs.put(b);
        }
        sl.phase = Phase::Free;
        self.free.push(s);
    }

    fn send(&mut self, io: &mut CoreIo) {
        if self.send_posted || self.outq.is_empty() {
            return;
        }
        if self.dead {
            for o in std::mem::take(&mut self.outq) {
                if let Out::Reply(s) = o {
                    self.release(io, s);
                }
            }
            return;
        }
        self.iov.clear();
        self.sending.clear();
        let mut taken = 0;
        let ddgst = self.send_framing.ddgst;
        for o in &mut self.outq {
            if self.iov.len() + 4 > MAX_IOV {
                break;
            }
            let mut push = |p: *const u8, n: usize| {
                self.iov.push(libc::iovec {
                    iov_base: p as *mut libc::c_void,
                    iov_len: n,
                })
            };
            match o {
                Out::Bytes(v) => push(v.as_ptr(), v.len()),
                Out::R2t(s) => {
                    let sl = &self.slots[*s as usize];
                    push(sl.r2t.as_ptr(), sl.r2t_len as usize);
                }
                Out::Reply(s) => {
                    let sl = &self.slots[*s as usize];
                    if sl.c2h_len > 0 {
                        push(sl.hdr.as_ptr(), sl.hdr_len as usize);
                        let b = sl.buf.as_ref().expect("reply data");
                        push(b.as_ptr(), sl.c2h_len as usize);
                        if ddgst {
                            push(sl.ddg.as_ptr(), 4);
                        }
                    }
                    if !sl.skip_resp {
                        push(sl.resp.as_ptr(), sl.resp_len as usize);
                    }
                    self.reply_seq += 1;
                }
            }
            taken += 1;
        }
        self.sending.extend(self.outq.drain(..taken));
        self.latency.on_reply(self.reply_seq);
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
        // SAFETY: msg, iov and the buffers they point to belong to this task and are not
        // touched until the send completes.
        unsafe { io.push_sqe(e) };
        self.send_posted = true;
    }

    fn on_send(&mut self, io: &mut CoreIo, res: i32) {
        self.send_posted = false;
        if res < 0 {
            self.dead = true;
            self.draining = true;
        } else {
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
        for o in std::mem::take(&mut self.sending) {
            if let Out::Reply(s) = o {
                self.release(io, s);
            }
        }
        self.parse(io);
        self.post_recv(io);
    }
}

impl Drop for NvmfQueue {
    fn drop(&mut self) {
        for n in self.ns.drain(..) {
            n.vol.volume().unregister_stats(&n.stats);
        }
        if let Some(c) = self.ctrl.take() {
            if self.registered {
                c.unregister_queue(self.qid);
            }
            if self.qid == 0 {
                self.target.remove_controller(&c, "");
            }
        }
    }
}

impl Task for NvmfQueue {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.arm_tick(io);
        self.post_recv(io);
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        match slot {
            SLOT_RECV => self.on_recv(io, res),
            SLOT_SEND => self.on_send(io, res),
            s if s <= SLOT_GATE && s > SLOT_GATE_END => self.on_gate(io, s),
            SLOT_TICK => self.on_tick(io),
            s => self.on_io(io, s as u16, res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let now = io.now();
        for (n, class, bytes, start, ok) in self.unrecorded.drain(..) {
            if let Some(ns) = self.ns.get(n) {
                let t = now.saturating_duration_since(start).as_nanos() as u64;
                ns.stats.record(class, bytes, t, ok);
            }
        }
        self.send(io);
        if self.draining
            && !self.shut
            && self.in_io == 0
            && !self.send_posted
            && self.outq.is_empty()
        {
            self.shut = true;
            // The queue is gone for the controller before its socket closes.
            if let Some(c) = &self.ctrl {
                if self.registered {
                    c.unregister_queue(self.qid);
                    self.registered = false;
                }
                if self.qid == 0 {
                    self.target.remove_controller(c, "");
                }
            }
            // SAFETY: shutting down our own socket.
            unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }

    fn finished(&self) -> bool {
        self.shut
            && !self.recv_posted
            && !self.send_posted
            && self.in_io == 0
            && !self.tick_armed
            && self.ns.iter().all(|n| n.gate.is_idle())
    }
}
