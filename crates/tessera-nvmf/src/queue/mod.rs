//! One NVMe/TCP queue (admin or I/O), served on one reactor core, on the export layer's
//! connection machinery (`tessera_export::conn`, shared with NBD connections): one
//! receive kept posted into a large buffer, every
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
//!
//! By concern: [`transport`] (PDUs in and out: receive, parse, data transfers, replies,
//! send), [`admin`] (Fabrics, admin commands, keep-alive), [`io`] (namespaces, QoS
//! admission, I/O commands). This file holds the queue's state and its task face.

mod admin;
mod auth;
mod io;
mod transport;

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_export::budget::ConnBudget;
use tessera_export::conn::{io_slot, FreeList, RecvBuf, Socket, StatsBatch};
use tessera_export::{ExportTarget, Gate, IoStats, Released};
use tessera_io::cast::u32_of;
use tessera_io::{AlignedBuf, CoreIo, Tag, Task};

use crate::auth::ControllerAuth;
use crate::nvme::{
    Sqe, Status, DNR, FABRICS, IO_FLUSH, SC_AUTH_REQUIRED, SC_CMD_SEQ_ERROR, SC_INVALID_NS,
};
use crate::pdu::{Framing, Limits};
use crate::target::{self, Controller, Target};

const RBUF_CAP: usize = 1 << 20;
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
    /// Waiting in `budget_wait` for its data buffers to fit the buffer budget.
    Budget,
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
    hdr_len: usize,
    ddg: [u8; 4],
    resp: [u8; 28],
    resp_len: usize,
    r2t: [u8; 28],
    r2t_len: usize,
    skip_resp: bool,
    /// Bytes of the queue's buffer budget the command holds (`buffer_charge`).
    charged: u64,
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
            charged: 0,
        }
    }
}

enum Out {
    Reply(u16),
    R2t(u16),
    Bytes(Vec<u8>),
}

/// A namespace as one I/O queue sees it: this core's target handle, QoS gate and stats
/// block (the same pieces an NBD connection uses).
struct Ns<T: ExportTarget> {
    nsid: u32,
    /// None: the namespace holds no data on this path (every I/O gets an ANA status).
    backing: Option<Backing<T>>,
    /// The namespace's ANA group on this target: read once per I/O command.
    ana: Arc<target::AnaGroup>,
    /// Writes are refused (a read-only target).
    read_only: bool,
    /// QoS admission for this namespace's volume (limits, group, shares).
    gate: Gate,
    stats: Arc<IoStats>,
    blocks: u64,
}

/// The target behind a namespace and this core's handle to it.
struct Backing<T: ExportTarget> {
    target: Arc<T>,
    vol: T::Handle,
}

impl<T: ExportTarget> Ns<T> {
    /// Hand the connection's figures back to the target (the queue closes or reopens).
    fn close(self) {
        if let Some(b) = &self.backing {
            b.target.unregister_stats(&self.stats);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for ICReq.
    Init,
    /// ICResp sent; waiting for Connect.
    Ready,
    Connected,
}

pub struct NvmfQueue<T: ExportTarget> {
    sock: Socket,
    id: u32,
    target: Arc<Target<T>>,
    state: State,
    ctrl: Option<Arc<Controller<T>>>,
    qid: u16,
    /// DH-HMAC-CHAP state when the host must authenticate this queue.
    auth: Option<Box<ControllerAuth>>,
    /// Commands other than Connect, Disconnect and the authentication ones are refused
    /// (Authentication Required) while clear; set unless the Connect asked for
    /// authentication, so the I/O path tests one plain bool.
    authenticated: bool,
    /// Queue entries (1-based) agreed at Connect.
    entries: usize,
    sq_flow_disabled: bool,
    sqhd: u16,
    ns: Vec<Ns<T>>,
    ns_gen: u64,
    send_framing: Framing,
    limits: Limits,
    rbuf: RecvBuf,
    slots: Vec<Slot>,
    free: FreeList,
    /// Commands received and not yet answered (what the host counts as outstanding).
    active: usize,
    aers: Vec<u16>,
    /// Commands waiting for buffer budget, oldest first (`transfer_within_budget`).
    budget_wait: VecDeque<u16>,
    outq: Vec<Out>,
    sending: Vec<Out>,
    in_io: usize,
    released: Vec<Released>,
    /// Completed I/O commands of this batch (keyed by namespace index), accounted when
    /// the batch is flushed.
    unrecorded: StatsBatch,
    tick_armed: bool,
    started: Instant,
    registered: bool,
    /// The host's address, for log lines.
    client: String,
    /// Bytes of data buffers this queue may hold (back-pressure: see
    /// `tessera_export::budget`).
    budget: ConnBudget,
}

/// Connections that break the protocol or never connect (garbage, port scans): at most
/// 10 lines per 10 s.
pub(crate) static BAD_CONN_LOG: tessera_export::log_limit::LogLimiter =
    tessera_export::log_limit::LogLimiter::new("nvmf-bad-connection", 10, 10);

impl<T: ExportTarget> NvmfQueue<T> {
    pub fn new(_io: &mut CoreIo, fd: OwnedFd, target: Arc<Target<T>>, budget: ConnBudget) -> Self {
        use std::os::fd::AsRawFd;
        let client = tessera_export::log_limit::peer_name(fd.as_raw_fd());
        NvmfQueue {
            client,
            sock: Socket::new(fd),
            id: 0,
            target,
            state: State::Init,
            ctrl: None,
            qid: 0,
            auth: None,
            authenticated: true,
            entries: INITIAL_SLOTS,
            sq_flow_disabled: false,
            sqhd: 0,
            ns: Vec::new(),
            ns_gen: 0,
            send_framing: Framing::default(),
            limits: Limits {
                hdgst: false,
                ddgst: false,
                max_data: target::MAXH2CDATA.max(u32_of(target::IN_CAPSULE)),
            },
            rbuf: RecvBuf::new(RBUF_CAP),
            slots: (0..INITIAL_SLOTS).map(|_| Slot::new()).collect(),
            free: FreeList::new(INITIAL_SLOTS),
            active: 0,
            aers: Vec::new(),
            budget_wait: VecDeque::new(),
            outq: Vec::new(),
            sending: Vec::new(),
            in_io: 0,
            released: Vec::new(),
            unrecorded: StatsBatch::with_capacity(INITIAL_SLOTS),
            tick_armed: false,
            started: Instant::now(),
            registered: false,
            budget,
        }
    }

    fn tag(&self, slot: u32) -> Tag {
        Tag::task(self.id, slot)
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

    fn execute(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        if !self.authenticated && !auth::allowed_before_auth(&sqe) {
            return self.finish(io, s, SC_AUTH_REQUIRED | DNR);
        }
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
}

impl<T: ExportTarget> Drop for NvmfQueue<T> {
    fn drop(&mut self) {
        if self.state == State::Connected {
            let sum = |f: fn(&IoStats) -> u64| self.ns.iter().map(|n| f(&n.stats)).sum::<u64>();
            let ctrl = self.ctrl.as_ref();
            tracing::info!(
                protocol = "nvme-tcp",
                client = %self.client,
                subnqn = ctrl.map_or("", |c| c.subnqn.as_str()),
                hostnqn = ctrl.map_or("", |c| c.hostnqn.as_str()),
                cntlid = ctrl.map_or(0, |c| c.cntlid),
                qid = self.qid,
                duration_s = self.started.elapsed().as_secs_f64(),
                read_bytes = sum(|s| s.read_bytes.load(Relaxed)),
                write_bytes = sum(|s| s.write_bytes.load(Relaxed)),
                errors = sum(|s| s.errors.load(Relaxed)),
                "nvmf: host disconnected"
            );
        }
        for n in self.ns.drain(..) {
            n.close();
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

impl<T: ExportTarget> Task for NvmfQueue<T> {
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
            s => self.on_io(io, io_slot(s), res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let ns = &self.ns;
        self.unrecorded
            .flush(io.now(), |n| ns.get(n).map(|n| &*n.stats));
        // Replies that left this batch released budget: start what waited for it.
        if !self.budget_wait.is_empty() {
            self.retry_budget(io);
        }
        self.send(io);
        let idle = self.in_io == 0 && self.outq.is_empty() && self.budget_wait.is_empty();
        if self.sock.shut_down_when_idle(idle) {
            // The queue is gone for the controller (which shuts down registered sockets
            // from any thread) before its socket closes.
            if let Some(c) = &self.ctrl {
                if self.registered {
                    c.unregister_queue(self.qid);
                    self.registered = false;
                }
                if self.qid == 0 {
                    self.target.remove_controller(c, "");
                }
            }
        }
    }

    fn finished(&self) -> bool {
        self.sock.is_closed()
            && self.in_io == 0
            && !self.tick_armed
            && self.ns.iter().all(|n| n.gate.is_idle())
    }
}
