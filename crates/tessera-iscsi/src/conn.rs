//! One iSCSI connection (one session: error recovery level 0, one connection per
//! session), a reactor [`Task`] on one core, on the export layer's connection machinery
//! (`tessera_export::conn`): one receive kept posted into a large buffer, every complete
//! PDU in it handled at once, SCSI commands dispatched to the LUNs' per-core
//! [`ExportHandle`]s concurrently and answered in completion order, and everything ready
//! to leave gathered into one `sendmsg` (Data-In headers with the read buffer itself as
//! an iovec: read data is not copied).
//!
//! The connection's life: Login requests until the full feature phase (see
//! [`crate::login`]), then commands, text requests (SendTargets), NOP-Outs, task
//! management and Logout. A malformed PDU gets a Reject and the connection closes (error
//! recovery level 0 has no other recovery); a failing command gets CHECK CONDITION and
//! the session goes on.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_export::budget::ConnBudget;
use tessera_export::conn::add_throttled;
use tessera_export::conn::{io_slot, FreeList, RecvBuf, SendDone, Socket, StatsBatch, MAX_IOV};
use tessera_export::{Charge, ExportHandle, ExportTarget, Gate, IoClass, IoStats, Released};
use tessera_io::cast::{u16_of, u32_of, usize_of};
use tessera_io::{AlignedBuf, CoreIo, IoOp, Tag, Task};
use tracing::{debug, info, warn};

use crate::alua::{self, Alua};
use crate::login::Login;
use crate::lu::LuShared;
use crate::pdu::{self, *};
use crate::pr::{self, Nexus, PrError, ProutRequest};
use crate::scsi::{self, Command, Sense, Unit, BLOCK_SHIFT};
use crate::target::Target;
use crate::text::{self, Params, TARGET_MAX_RECV_DATA_SEGMENT};

/// Receive buffer: several PDUs of the largest data segment this target accepts.
const RBUF_CAP: usize = 1 << 20;
/// The data segment of a Login Request: at most the default MaxRecvDataSegmentLength,
/// which is what holds during the login phase (RFC 7143 §6.1, §13.12).
const LOGIN_MAX_DATA_SEGMENT: usize = 8192;
/// Receive buffer of a connection still logging in: one login PDU (header, the largest
/// AHS, data) with room to spare. The full buffer is taken only once the login is
/// complete, so a connection that never logs in holds a few KiB, not [`RBUF_CAP`].
const LOGIN_RBUF_CAP: usize = 16 << 10;
/// Commands in flight per session (the CmdSN window) and slots kept for immediate
/// commands, which the window does not count.
const WINDOW: usize = 128;
const RESERVED_SLOTS: usize = 16;
const SLOTS: usize = WINDOW + RESERVED_SLOTS;
const SLOT_RECV: u32 = u32::MAX;
const SLOT_SEND: u32 = u32::MAX - 1;
const SLOT_LOGIN_TIMER: u32 = u32::MAX - 2;
/// LUN `i`'s QoS gate uses slots `SLOT_GATE - 2i` (limits timer) and
/// `SLOT_GATE - 2i - 1` (share round); request slots are u16, far below.
const SLOT_GATE: u32 = u32::MAX - 16;
const GATES: u32 = 256;
const SLOT_GATE_END: u32 = SLOT_GATE - 2 * GATES;
const _: () = assert!(
    crate::target::MAX_LUNS <= GATES as usize,
    "every LUN has its two gate slots"
);
/// How often the login deadline is checked: a connection that closes during its login
/// finishes within one tick (a timer cannot be cancelled, and the task lives until its
/// timer fired, holding its listener slot).
const LOGIN_TICK: Duration = Duration::from_secs(1);
/// SCSI status BUSY: the connection's buffer budget is spent for now.
const BUSY: u8 = 0x08;

/// Connections that break the protocol (garbage, port scans): at most 10 lines per 10 s.
static BAD_CONN_LOG: tessera_export::log_limit::LogLimiter =
    tessera_export::log_limit::LogLimiter::new("iscsi-bad-connection", 10, 10);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Free,
    /// Receiving Data-Out (an R2T is out).
    AwaitData,
    Io,
    /// Held at the LUN's QoS gate.
    Throttled,
    /// Write done; the FUA flush is in flight.
    FuaFlush,
    /// COMPARE AND WRITE matched: its write is in flight.
    CawWrite,
    /// The answer is queued; the slot is released once it has been sent.
    Reply,
}

struct Cmd {
    phase: Phase,
    itt: u32,
    lun: usize,
    cmd: Command,
    /// Expected Data Transfer Length from the initiator.
    edtl: u32,
    /// Data to send (read data) or received (write data, parameter list).
    buf: Option<AlignedBuf>,
    /// Bytes of Data-Out expected for this command and how many arrived.
    want: u32,
    got: u32,
    /// End of the burst the last R2T asked for.
    burst_end: u32,
    r2tsn: u32,
    /// DataSN the next Data-Out of the current burst must carry.
    data_sn: u32,
    /// What the final response says of a transfer length that differs from the CDB's
    /// (flag bits and residual count).
    residual: (u8, u32),
    /// ABORT TASK of this command waits for its I/O: the ITT of that request, answered
    /// instead of the command once the I/O is done.
    abort_itt: Option<u32>,
    start: Instant,
    /// Bytes of the connection's buffer budget the command holds.
    charged: u64,
    /// A COMPARE AND WRITE holds its range in the LUN's [`LuShared`] (let go when the
    /// slot is freed, however the command ends).
    caw_held: bool,
}

impl Cmd {
    fn new() -> Cmd {
        Cmd {
            phase: Phase::Free,
            itt: 0,
            lun: 0,
            cmd: Command::TestUnitReady,
            edtl: 0,
            buf: None,
            want: 0,
            got: 0,
            burst_end: 0,
            r2tsn: 0,
            data_sn: 0,
            residual: (0, 0),
            abort_itt: None,
            start: Instant::now(),
            charged: 0,
            caw_held: false,
        }
    }
}

/// A PDU ready to leave: header (and its digest), then optionally data from a slot's
/// buffer with its padding/digest; `release` frees the slot once it has been sent.
struct Out {
    head: Vec<u8>,
    data: Option<(u16, usize, usize)>,
    tail: Vec<u8>,
    release: Option<u16>,
    /// The connection closes once this PDU has left (logout, failed login, reject).
    last: bool,
}

/// A LUN as this connection sees it: its backing (none on an ALUA standby port), the
/// unit's description and what the connections serving it share.
struct Lu<T: ExportTarget> {
    back: Option<Back<T>>,
    unit: Unit,
    caw: Arc<LuShared>,
}

/// The volume behind a LUN: this core's handle, QoS admission and the connection's
/// stats block.
struct Back<T: ExportTarget> {
    target: Arc<T>,
    vol: T::Handle,
    /// QoS admission for the LUN's volume (limits, group, shares).
    gate: Gate,
    stats: Arc<IoStats>,
}

impl<T: ExportTarget> Lu<T> {
    fn back(&self) -> &Back<T> {
        self.back
            .as_ref()
            .expect("media access reaches only a backed LUN")
    }

    fn gate_idle(&self) -> bool {
        self.back.as_ref().is_none_or(|b| b.gate.is_idle())
    }
}

enum State {
    Login(Box<Login>),
    Full,
}

pub struct IscsiConn<T: ExportTarget> {
    sock: Socket,
    id: u32,
    target: Arc<Target<T>>,
    client: String,
    state: State,
    discovery: bool,
    initiator: String,
    /// The I_T nexus persistent reservations know this session by.
    nexus: Nexus,
    /// This session in its target's count of sessions (normal sessions only).
    session: Option<crate::target::SessionCount>,
    target_name: String,
    params: Params,
    rx_digests: Digests,
    tx_digests: Digests,
    luns: Vec<Lu<T>>,
    /// A cluster target served with ALUA: its state, and the generations of its
    /// states and backing this connection last saw (a change of the former is reported
    /// once as a unit attention; one of the latter re-opens LUN 0's backing).
    alua: Option<Arc<Alua<T>>>,
    alua_states_seen: u64,
    alua_backing_seen: u64,
    /// Taken out while its PDUs are handled (the handlers read their data from it).
    rbuf: Option<RecvBuf>,
    /// The first Login Request set the sequence numbers.
    seq_set: bool,
    slots: Vec<Cmd>,
    free: FreeList,
    statsn: u32,
    exp_cmdsn: u32,
    /// MaxCmdSN as last sent.
    advertised_max: u32,
    outq: VecDeque<Out>,
    sending: Vec<Out>,
    in_io: usize,
    unrecorded: StatsBatch,
    timer_armed: bool,
    started: Instant,
    /// A connection that has not completed its login in this time is closed
    /// ([`Target::login_timeout`]).
    login_timeout: Duration,
    budget: ConnBudget,
    /// This connection's place among its listener's connections still logging in
    /// (`crate::login_gate::LoginGate`), given up once the login completes.
    login_ticket: Option<crate::login_gate::LoginTicket>,
}

impl<T: ExportTarget> IscsiConn<T> {
    pub fn new(
        _io: &mut CoreIo,
        fd: OwnedFd,
        target: Arc<Target<T>>,
        budget: ConnBudget,
        login_ticket: Option<crate::login_gate::LoginTicket>,
    ) -> Self {
        let client = tessera_export::log_limit::peer_name(fd.as_raw_fd());
        let login_timeout = target.login_timeout();
        IscsiConn {
            sock: Socket::new(fd),
            id: 0,
            target,
            client,
            state: State::Login(Box::new(Login::new())),
            discovery: false,
            initiator: String::new(),
            nexus: Nexus::default(),
            session: None,
            target_name: String::new(),
            params: Params::default(),
            rx_digests: Digests::default(),
            tx_digests: Digests::default(),
            luns: Vec::new(),
            alua: None,
            alua_states_seen: 0,
            alua_backing_seen: 0,
            rbuf: Some(RecvBuf::new(LOGIN_RBUF_CAP)),
            seq_set: false,
            slots: (0..SLOTS).map(|_| Cmd::new()).collect(),
            free: FreeList::new(SLOTS),
            statsn: 0,
            exp_cmdsn: 0,
            advertised_max: 0,
            outq: VecDeque::new(),
            sending: Vec::new(),
            in_io: 0,
            unrecorded: StatsBatch::with_capacity(SLOTS),
            timer_armed: false,
            started: Instant::now(),
            login_timeout,
            budget,
            login_ticket,
        }
    }

    /// How long until the login deadline is looked at again.
    fn login_tick(&self) -> Duration {
        LOGIN_TICK.min(self.login_timeout / 4)
    }

    fn tag(&self, slot: u32) -> Tag {
        Tag::task(self.id, slot)
    }

    /// MaxCmdSN: the window stays within the free slots, so every command the
    /// initiator may send finds one.
    fn max_cmdsn(&self) -> u32 {
        let window = self.free.len().saturating_sub(RESERVED_SLOTS);
        self.exp_cmdsn.wrapping_add(u32_of(window)).wrapping_sub(1)
    }

    /// Fill StatSN, ExpCmdSN and MaxCmdSN (bytes 24..36, the same place in every
    /// target PDU that carries them), remembering the window advertised.
    fn stamp(&mut self, h: &mut [u8; BHS_LEN], statsn: u32) {
        let max = self.max_cmdsn();
        put_u32(h, 24, statsn);
        put_u32(h, 28, self.exp_cmdsn);
        put_u32(h, 32, max);
        self.advertised_max = max;
    }

    /// The window last advertised is less than half open and slots have been freed
    /// since: tell the initiator with a NOP-In that asks for nothing (RFC 7143
    /// §11.19: ITT and TTT reserved), or an initiator that filled the window waits for
    /// an answer that never comes.
    fn update_window(&mut self) {
        if !matches!(self.state, State::Full) || self.sock.draining {
            return;
        }
        let open = self
            .advertised_max
            .wrapping_add(1)
            .wrapping_sub(self.exp_cmdsn);
        let now = self
            .max_cmdsn()
            .wrapping_add(1)
            .wrapping_sub(self.exp_cmdsn);
        let narrow = open > u32_of(WINDOW) || open < u32_of(WINDOW / 2);
        if narrow && now != open && now <= u32_of(WINDOW) {
            let mut h = pdu::header(OP_NOP_IN, FLAG_FINAL, 0);
            put_u32(&mut h, 16, RESERVED_TAG);
            put_u32(&mut h, 20, RESERVED_TAG);
            let st = self.statsn;
            self.stamp(&mut h, st);
            self.queue(h, &[], false);
        }
    }

    /// The next StatSN for a response (taken).
    fn next_statsn(&mut self) -> u32 {
        let s = self.statsn;
        self.statsn = s.wrapping_add(1);
        s
    }

    fn queue(&mut self, h: [u8; BHS_LEN], data: &[u8], last: bool) {
        self.outq.push_back(Out {
            head: pdu::encode(&h, data, self.tx_digests),
            data: None,
            tail: Vec::new(),
            release: None,
            last,
        });
    }

    /// Refuse a PDU: Reject with `reason` carrying its header; with `fatal` the
    /// connection closes after it.
    fn reject(&mut self, bhs: &Bhs, reason: u8, fatal: bool) {
        let mut h = pdu::header(OP_REJECT, FLAG_FINAL, BHS_LEN);
        h[2] = reason;
        put_u32(&mut h, 16, RESERVED_TAG);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        self.queue(h, &bhs.0, fatal);
        if fatal {
            self.sock.draining = true;
        }
    }

    fn post_recv(&mut self, io: &mut CoreIo) {
        if !self.sock.may_recv() {
            return;
        }
        let Some(rbuf) = self.rbuf.as_mut() else {
            return;
        };
        rbuf.compact();
        let (p, n) = rbuf.room(usize::MAX);
        if n == 0 {
            // Cannot happen: a PDU is far smaller than the buffer, which is compacted
            // once full. Fail safe.
            self.sock.draining = true;
            return;
        }
        let tag = self.tag(SLOT_RECV);
        // SAFETY: the buffer belongs to this connection, which does not touch its free
        // tail and does not finish while a receive is posted.
        unsafe { self.sock.post_recv(io, p, n, tag) };
    }

    fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        let Some(n) = self.sock.recv_done(res) else {
            return;
        };
        let Some(mut rbuf) = self.rbuf.take() else {
            return;
        };
        rbuf.filled(n);
        while !self.sock.draining {
            let max_data = match self.state {
                State::Login(_) => LOGIN_MAX_DATA_SEGMENT,
                State::Full => usize_of(u64::from(TARGET_MAX_RECV_DATA_SEGMENT)),
            };
            let framed = match pdu::frame(rbuf.unparsed(), self.rx_digests, max_data) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    if BAD_CONN_LOG.admit() {
                        warn!(protocol = "iscsi", client = %self.client, "iscsi: bad PDU, closing: {e}");
                    }
                    let mut h = [0u8; BHS_LEN];
                    h.copy_from_slice(&rbuf.unparsed()[..BHS_LEN]);
                    let reason = match e {
                        PduError::DataDigest { .. } | PduError::HeaderDigest { .. } => {
                            REJECT_DIGEST_ERROR
                        }
                        PduError::UnknownOpcode(_) => REJECT_COMMAND_NOT_SUPPORTED,
                        PduError::DataTooLong { .. } => REJECT_PROTOCOL_ERROR,
                    };
                    if matches!(self.state, State::Full) {
                        self.reject(&Bhs(h), reason, true);
                    } else {
                        self.sock.draining = true;
                    }
                    break;
                }
            };
            let at = rbuf.start() + framed.data_at;
            let data = &rbuf.received()[at..at + framed.data_len];
            self.on_pdu(io, &framed.bhs, data);
            rbuf.consume(framed.total);
            if matches!(self.state, State::Full) && rbuf.capacity() < RBUF_CAP {
                rbuf = grown(&rbuf, RBUF_CAP);
            }
        }
        self.rbuf = Some(rbuf);
        self.post_recv(io);
    }

    fn on_pdu(&mut self, io: &mut CoreIo, bhs: &Bhs, data: &[u8]) {
        if let State::Login(_) = self.state {
            if bhs.opcode() != OP_LOGIN_REQ {
                if BAD_CONN_LOG.admit() {
                    warn!(protocol = "iscsi", client = %self.client, opcode = bhs.opcode(), "iscsi: PDU before login, closing");
                }
                self.sock.draining = true;
                return;
            }
            return self.on_login(io, bhs, data);
        }
        match bhs.opcode() {
            OP_SCSI_CMD => self.on_command(io, bhs, data),
            OP_DATA_OUT => self.on_data_out(io, bhs, data),
            OP_NOP_OUT => self.on_nop_out(bhs, data),
            OP_TEXT_REQ => self.on_text(bhs, data),
            OP_TASK_MGMT_REQ => self.on_task_mgmt(io, bhs),
            OP_LOGOUT_REQ => self.on_logout(bhs),
            // SNACK needs error recovery level 1; a Login in the full feature phase is
            // a protocol error.
            OP_SNACK => self.reject(bhs, REJECT_COMMAND_NOT_SUPPORTED, false),
            _ => self.reject(bhs, REJECT_PROTOCOL_ERROR, true),
        }
    }

    /// Take a command's CmdSN: an immediate command does not advance it; one outside
    /// the window is dropped (RFC 7143 §3.2.2.1). Returns whether to serve it.
    fn take_cmdsn(&mut self, bhs: &Bhs) -> bool {
        if bhs.immediate() {
            return true;
        }
        let sn = bhs.cmdsn();
        let ahead = sn.wrapping_sub(self.exp_cmdsn);
        // The window the initiator was told, not the one the free slots allow now.
        let window = self.advertised_max.wrapping_sub(self.exp_cmdsn);
        if ahead > window {
            debug!(client = %self.client, cmdsn = sn, exp = self.exp_cmdsn, "iscsi: CmdSN outside the window, dropped");
            return false;
        }
        self.exp_cmdsn = sn.wrapping_add(1);
        true
    }

    fn on_login(&mut self, io: &mut CoreIo, bhs: &Bhs, data: &[u8]) {
        let State::Login(login) = &mut self.state else {
            return;
        };
        if !self.seq_set {
            self.seq_set = true;
            self.statsn = bhs.exp_statsn();
            self.exp_cmdsn = bhs.cmdsn();
        }
        let target = self.target.clone();
        let result = login.on_request(
            bhs,
            data,
            |n| target.target(n).map(|t| t.access()),
            || target.new_tsih(),
        );
        let isid = login.isid;
        let mut h = pdu::header(OP_LOGIN_RESP, 0, 0);
        h[8..14].copy_from_slice(&isid);
        put_u32(&mut h, 16, bhs.itt());
        let (reply_text, full) = match result {
            Ok(r) => {
                h[1] = r.flags;
                put_u16(&mut h, 14, r.tsih);
                (r.text, r.full_feature)
            }
            Err(e) => {
                if BAD_CONN_LOG.admit() {
                    warn!(protocol = "iscsi", client = %self.client, "iscsi: login refused: {e}");
                }
                let (class, detail) = e.status();
                self.target.refusals.count((class, detail));
                h[36] = class;
                h[37] = detail;
                let s = self.next_statsn();
                self.stamp(&mut h, s);
                self.queue(h, &[], true);
                self.sock.draining = true;
                return;
            }
        };
        let len = u32_of(reply_text.len()).to_be_bytes();
        h[5..8].copy_from_slice(&len[1..]);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        self.queue(h, &reply_text, false);
        if full {
            let State::Login(login) = std::mem::replace(&mut self.state, State::Full) else {
                return;
            };
            self.login_ticket = None;
            self.enter_full_feature(io, *login);
        }
    }

    fn enter_full_feature(&mut self, io: &mut CoreIo, login: Login) {
        self.params = login.params;
        self.discovery = login.discovery;
        self.initiator = login.initiator_name.unwrap_or_default();
        self.target_name = login.target_name.unwrap_or_default();
        self.nexus = Nexus::new(&self.initiator, login.isid, &self.target_name);
        // Digests start with the first PDU after the final login response, both ways.
        let d = Digests {
            header: self.params.header_digest,
            data: self.params.data_digest,
        };
        self.rx_digests = d;
        self.tx_digests = d;
        if !self.discovery {
            if let Some(t) = self.target.target(&self.target_name) {
                self.session = Some(t.session_opened());
                if let Some(a) = &t.alua {
                    // One LUN, the same unit on every node's port.
                    self.alua_states_seen = a.states_generation();
                    self.alua_backing_seen = a.backing_generation();
                    let back = a.export().map(|e| self.open_back(io, &e, 0));
                    self.luns.push(Lu {
                        back,
                        unit: Unit {
                            blocks: a.size >> BLOCK_SHIFT,
                            read_only: false,
                            serial: format!("{:016x}", unit_id(&t.name, 0)),
                            id: unit_id(&t.name, 0),
                            port: Some((a.rel_port, a.group)),
                        },
                        caw: a.shared.clone(),
                    });
                    self.alua = Some(a.clone());
                }
                for ((i, e), shared) in t.luns.iter().enumerate().zip(&t.shared) {
                    let unit = Unit {
                        blocks: e.target.size() >> BLOCK_SHIFT,
                        read_only: e.target.read_only(),
                        serial: format!("{:016x}", unit_id(&t.name, i)),
                        id: unit_id(&t.name, i),
                        port: None,
                    };
                    let back = self.open_back(io, e, self.luns.len());
                    self.luns.push(Lu {
                        back: Some(back),
                        caw: shared.clone(),
                        unit,
                    });
                }
            }
        }
        info!(
            protocol = "iscsi",
            client = %self.client,
            initiator = %self.initiator,
            target = %self.target_name,
            discovery = self.discovery,
            header_digest = self.params.header_digest,
            data_digest = self.params.data_digest,
            "iscsi: login complete"
        );
    }

    /// This core's way into export `e`, serving LUN index `i`.
    fn open_back(&mut self, io: &mut CoreIo, e: &tessera_export::Export<T>, i: usize) -> Back<T> {
        let i = u32_of(i);
        let gate = Gate::new(
            io,
            &e.qos,
            self.tag(SLOT_GATE - 2 * i),
            self.tag(SLOT_GATE - 2 * i - 1),
        );
        Back {
            gate,
            stats: e.target.register_stats(),
            vol: e.target.open(),
            target: e.target.clone(),
        }
    }

    /// ALUA: what LUN 0 of a cluster target answers instead of running `cmd`, if
    /// anything. A change of the groups' states is reported first, once (unless the
    /// command is one that never reports unit attentions); a port in standby refuses
    /// what it may not serve. A backing that changed is re-opened once nothing of this
    /// connection is in flight; until then media access is told the port is in
    /// transition (the host retries).
    fn alua_refusal(&mut self, io: &mut CoreIo, cmd: &Command, exempt: bool) -> Option<Sense> {
        let a = self.alua.clone()?;
        if !exempt {
            let g = a.states_generation();
            if g != self.alua_states_seen {
                self.alua_states_seen = g;
                return Some(alua::STATE_CHANGED);
            }
        }
        let b = a.backing_generation();
        if b != self.alua_backing_seen && self.quiet() {
            self.alua_backing_seen = b;
            let now = io.now();
            let luns = &self.luns;
            self.unrecorded.flush(now, |n| {
                luns.get(n).and_then(|l| l.back.as_ref()).map(|b| &*b.stats)
            });
            if let Some(old) = self.luns[0].back.take() {
                old.target.unregister_stats(&old.stats);
            }
            let back = a.export().map(|e| self.open_back(io, &e, 0));
            self.luns[0].back = back;
        }
        if cmd.allowed_in_standby() {
            return None;
        }
        if a.state() != alua::ACTIVE_OPTIMIZED {
            return Some(alua::STANDBY_SENSE);
        }
        if b != self.alua_backing_seen || self.luns[0].back.is_none() {
            return Some(alua::TRANSITION_SENSE);
        }
        None
    }

    /// Nothing of this connection is in flight or waiting: no command holds a slot.
    fn quiet(&self) -> bool {
        self.in_io == 0
            && self.slots.iter().all(|c| matches!(c.phase, Phase::Free))
            && self.luns.iter().all(|l| l.gate_idle())
    }

    fn on_nop_out(&mut self, bhs: &Bhs, data: &[u8]) {
        if !self.take_cmdsn(bhs) {
            return;
        }
        if bhs.itt() == RESERVED_TAG {
            // A ping that wants no answer, or the answer to a NOP-In this target never
            // sends.
            return;
        }
        let echo = &data[..data
            .len()
            .min(usize_of(u64::from(self.params.initiator_max_recv)))];
        let mut h = pdu::header(OP_NOP_IN, FLAG_FINAL, echo.len());
        put_u64(&mut h, 8, bhs.lun_raw());
        put_u32(&mut h, 16, bhs.itt());
        put_u32(&mut h, 20, RESERVED_TAG);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        let echo = echo.to_vec();
        self.queue(h, &echo, false);
    }

    fn on_text(&mut self, bhs: &Bhs, data: &[u8]) {
        if !self.take_cmdsn(bhs) {
            return;
        }
        let mut answers: Vec<(String, String)> = Vec::new();
        match text::parse(data) {
            Ok(pairs) => {
                for (k, v) in pairs {
                    if k == "SendTargets" {
                        let only = match v.as_str() {
                            "All" if self.discovery => None,
                            "All" => Some(self.target_name.clone()),
                            "" => Some(self.target_name.clone()),
                            name => Some(name.to_string()),
                        };
                        answers.extend(self.target.send_targets(only.as_deref(), &self.initiator));
                    } else {
                        match text::negotiate(&mut self.params, &k, &v, self.discovery) {
                            Some(a) if a.is_empty() => {}
                            Some(a) => answers.push((k, a)),
                            None => answers.push((k, "NotUnderstood".into())),
                        }
                    }
                }
            }
            Err(e) => {
                debug!(client = %self.client, "iscsi: text request: {e}");
                return self.reject(bhs, REJECT_PROTOCOL_ERROR, false);
            }
        }
        let body = text::encode(&answers);
        let mut h = pdu::header(OP_TEXT_RESP, FLAG_FINAL, body.len());
        put_u64(&mut h, 8, bhs.lun_raw());
        put_u32(&mut h, 16, bhs.itt());
        put_u32(&mut h, 20, RESERVED_TAG);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        self.queue(h, &body, false);
    }

    fn on_task_mgmt(&mut self, io: &mut CoreIo, bhs: &Bhs) {
        if !self.take_cmdsn(bhs) {
            return;
        }
        let function = bhs.flags() & 0x7f;
        let response = match function {
            // ABORT TASK: a command waiting for its data ends now; one whose I/O is in
            // flight ends when the I/O does (nothing cancels it), and the answer to
            // this request takes the place of its status then; one already answered
            // or unknown "does not exist".
            1 => {
                let rtt = bhs.word20();
                let found = (0..SLOTS).find(|&i| {
                    let c = &self.slots[i];
                    c.itt == rtt
                        && matches!(
                            c.phase,
                            Phase::AwaitData
                                | Phase::Io
                                | Phase::Throttled
                                | Phase::FuaFlush
                                | Phase::CawWrite
                        )
                });
                match found {
                    Some(i) if self.slots[i].phase == Phase::AwaitData => {
                        self.free_slot(io, u16_of(i));
                        0
                    }
                    Some(i) => {
                        self.slots[i].abort_itt = Some(bhs.itt());
                        return;
                    }
                    None => 1,
                }
            }
            // ABORT TASK SET, CLEAR TASK SET: commands run to completion here (no I/O
            // is cancelled) and nothing else is held.
            2 | 3 => 0,
            // LUN RESET, TARGET WARM RESET: as above, and the SPC-2 reservation of the
            // unit (of every unit of the target) ends, whoever held it (SPC-2 §5.5.1;
            // persistent reservations survive resets).
            5 | 6 => {
                let lun = pdu::lun_of(bhs.lun_raw()).map(usize::from);
                for (i, l) in self.luns.iter().enumerate() {
                    if function == 6 || lun == Some(i) {
                        l.caw.drop_legacy(None);
                    }
                }
                0
            }
            // CLEAR ACA, TARGET COLD RESET, TASK REASSIGN: not supported.
            _ => 5,
        };
        self.tmf_response(bhs.itt(), response);
    }

    fn tmf_response(&mut self, itt: u32, response: u8) {
        let mut h = pdu::header(OP_TASK_MGMT_RESP, FLAG_FINAL, 0);
        h[2] = response;
        put_u32(&mut h, 16, itt);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        self.queue(h, &[], false);
    }

    fn on_logout(&mut self, bhs: &Bhs) {
        let _ = self.take_cmdsn(bhs);
        let mut h = pdu::header(OP_LOGOUT_RESP, FLAG_FINAL, 0);
        // Reason 0 (close the session) and 1 (close this connection) end the one
        // connection of the session; 2 (recovery) needs ERL 2.
        h[2] = if bhs.flags() & 0x7f <= 1 { 0 } else { 2 };
        put_u32(&mut h, 16, bhs.itt());
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        self.queue(h, &[], true);
        self.sock.draining = true;
    }

    /// The SCSI Response for slot-less failures and for commands that end here.
    fn respond(&mut self, itt: u32, status: u8, sense: Option<Sense>, residual: (u8, u32)) {
        let data: Vec<u8> = match sense {
            Some(s) => {
                let f = s.fixed();
                let mut d = vec![0u8, u8::try_from(f.len()).unwrap_or(18)];
                d.extend_from_slice(&f);
                d
            }
            None => Vec::new(),
        };
        let mut h = pdu::header(OP_SCSI_RESP, FLAG_FINAL | residual.0, data.len());
        h[2] = 0; // command completed at target
        h[3] = status;
        put_u32(&mut h, 16, itt);
        let s = self.next_statsn();
        self.stamp(&mut h, s);
        put_u32(&mut h, 44, residual.1);
        self.queue(h, &data, false);
    }

    fn on_command(&mut self, io: &mut CoreIo, bhs: &Bhs, data: &[u8]) {
        if !self.take_cmdsn(bhs) {
            return;
        }
        if self.discovery {
            return self.reject(bhs, REJECT_PROTOCOL_ERROR, false);
        }
        let itt = bhs.itt();
        let edtl = bhs.word20();
        let cmd = match scsi::decode(bhs.cdb()) {
            Ok(c) => c,
            Err(sense) => {
                return self.respond(itt, scsi::CHECK_CONDITION, Some(sense), NO_RESIDUAL)
            }
        };
        let lun = pdu::lun_of(bhs.lun_raw()).map(usize::from);
        let lun = match lun {
            Some(l) if l < self.luns.len() => l,
            _ => {
                // REPORT LUNS and INQUIRY answer on any LUN (the latter with
                // "no unit here"); anything else is refused.
                return match cmd {
                    Command::ReportLuns { alloc } => {
                        let d = scsi::report_luns(&self.lun_numbers());
                        self.answer_data(io, None, itt, edtl, d, alloc)
                    }
                    Command::Inquiry {
                        evpd: false, alloc, ..
                    } => {
                        let mut d = scsi::inquiry(&dummy_unit(), false, 0).unwrap_or_default();
                        if let Some(b) = d.first_mut() {
                            *b = 0x7f;
                        }
                        self.answer_data(io, None, itt, edtl, d, alloc)
                    }
                    _ => self.respond(
                        itt,
                        scsi::CHECK_CONDITION,
                        Some(Sense::LUN_NOT_SUPPORTED),
                        NO_RESIDUAL,
                    ),
                };
            }
        };
        // A unit attention for this I_T nexus (a PERSISTENT RESERVE OUT of another
        // nexus preempted or released it): reported once, instead of the command.
        // INQUIRY, REPORT LUNS and REQUEST SENSE neither report nor clear it (SAM-5
        // §5.14; REQUEST SENSE does not return it here).
        let exempt = matches!(
            cmd,
            Command::Inquiry { .. } | Command::ReportLuns { .. } | Command::RequestSense { .. }
        );
        if !exempt {
            if let Some(ua) = self.luns[lun].caw.take_unit_attention(&self.nexus) {
                return self.respond(itt, scsi::CHECK_CONDITION, Some(ua), NO_RESIDUAL);
            }
        }
        if let Some(sense) = self.alua_refusal(io, &cmd, exempt) {
            return self.respond(itt, scsi::CHECK_CONDITION, Some(sense), NO_RESIDUAL);
        }
        // A reservation that forbids the command to this I_T nexus: refused before
        // its data is asked for.
        let caw = &self.luns[lun].caw;
        if caw.legacy_conflict(&self.nexus, &cmd)
            || caw.pr_conflict(&self.nexus, pr::access_of(&cmd))
        {
            return self.respond(itt, pr::RESERVATION_CONFLICT, None, NO_RESIDUAL);
        }
        let Some(s) = self.free.pop() else {
            return self.respond(itt, BUSY, None, NO_RESIDUAL);
        };
        let idx = usize::from(s);
        {
            let c = &mut self.slots[idx];
            c.phase = Phase::Io;
            c.itt = itt;
            c.lun = lun;
            c.cmd = cmd;
            c.edtl = edtl;
            c.want = 0;
            c.got = 0;
            c.burst_end = 0;
            c.r2tsn = 0;
            c.data_sn = 0;
            c.residual = (0, 0);
            c.abort_itt = None;
            c.start = io.now();
            c.charged = 0;
        }
        if !data.is_empty() && !self.params.immediate_data {
            // Immediate data after the initiator agreed to send none.
            self.free_slot(io, s);
            return self.reject(bhs, REJECT_PROTOCOL_ERROR, true);
        }
        if data.len() > usize_of(u64::from(self.params.first_burst)) {
            self.free_slot(io, s);
            return self.reject(bhs, REJECT_PROTOCOL_ERROR, true);
        }
        // WRITE SAME with UNMAP may come without its block (libiscsi's unaligned unmap
        // sends none): the range is unmapped, which reads back as zeros.
        let unmap_only = matches!(cmd, Command::WriteSame16 { unmap: true, .. }) && edtl == 0;
        let needs = if unmap_only { 0 } else { cmd.data_out_len() };
        // VERIFY, COMPARE AND WRITE and WRITE SAME use their Data-Out block for block
        // (compared, or replicated): a transfer length other than the CDB's is an
        // invalid CDB (SBC-3 5.3, 5.42), not a residual. (A COMPARE AND WRITE of 256
        // blocks has 0 in its one-byte count and 256 blocks of data.)
        let exact = matches!(
            cmd,
            Command::Verify { .. }
                | Command::CompareAndWrite { .. }
                | Command::OrWrite { .. }
                | Command::WriteSame16 { .. }
        );
        if exact && u64::from(edtl) != needs {
            self.free_slot(io, s);
            return self.respond(
                itt,
                scsi::CHECK_CONDITION,
                Some(Sense::INVALID_FIELD_IN_CDB),
                NO_RESIDUAL,
            );
        }
        if needs == 0 {
            // Immediate data with a command that takes none (a READ flagged as a write)
            // is ignored: the command is served as its CDB says.
            return self.execute(io, s);
        }
        let writes = !matches!(
            cmd,
            Command::Verify { .. }
                | Command::ModeSelect { .. }
                | Command::PersistentReserveOut { .. }
        );
        if writes && self.luns[lun].unit.read_only {
            self.free_slot(io, s);
            return self.respond(
                itt,
                scsi::CHECK_CONDITION,
                Some(Sense::WRITE_PROTECTED),
                NO_RESIDUAL,
            );
        }
        // The transfer is what both the CDB and the Expected Data Transfer Length cover
        // (RFC 7143 §11.4.5.1, as libiscsi's residual tests expect): the target asks only
        // for that much (with InitialR2T=Yes nothing else comes unasked, and immediate
        // data past it is dropped), and the response reports the difference.
        let needs = u32::try_from(needs).unwrap_or(u32::MAX);
        let want = needs.min(edtl);
        let residual = if edtl < needs {
            (RESIDUAL_OVERFLOW, needs - edtl)
        } else if edtl > needs {
            (RESIDUAL_UNDERFLOW, edtl - needs)
        } else {
            NO_RESIDUAL
        };
        let cmd = match cmd {
            // Whole blocks only: a partial last block is not written.
            Command::Write { lba, fua, .. } => Command::Write {
                lba,
                blocks: want >> BLOCK_SHIFT,
                fua,
            },
            Command::WriteSame16 { .. } if want < scsi::BLOCK_SIZE => {
                self.free_slot(io, s);
                return self.respond(
                    itt,
                    scsi::CHECK_CONDITION,
                    Some(Sense::INVALID_FIELD_IN_CDB),
                    residual,
                );
            }
            c => c,
        };
        {
            let c = &mut self.slots[idx];
            c.cmd = cmd;
            c.residual = residual;
        }
        if want == 0 {
            return self.execute(io, s);
        }
        if !self.budget.try_take(u64::from(want)) {
            self.free_slot(io, s);
            return self.respond(itt, BUSY, None, NO_RESIDUAL);
        }
        let imm = data.len().min(usize_of(u64::from(want)));
        // Comparing commands read the medium into the same buffer, after the data.
        let read_back = cmd.read_back_len();
        let size = if read_back > 0 {
            read_back_at(want) + usize_of(read_back)
        } else {
            usize_of(u64::from(want))
        };
        let mut buf = io.bufs.get(size);
        buf.as_mut_slice()[..imm].copy_from_slice(&data[..imm]);
        let c = &mut self.slots[idx];
        c.charged = u64::from(want);
        c.buf = Some(buf);
        c.want = want;
        c.got = u32_of(imm);
        c.burst_end = c.got;
        if c.got == c.want {
            return self.execute(io, s);
        }
        c.phase = Phase::AwaitData;
        self.send_r2t(s);
    }

    fn send_r2t(&mut self, s: u16) {
        let max_burst = self.params.max_burst;
        let lun = pdu::lun_field(u16_of(self.slots[usize::from(s)].lun));
        let c = &mut self.slots[usize::from(s)];
        let len = (c.want - c.got).min(max_burst);
        let offset = c.got;
        c.burst_end = c.got + len;
        let r2tsn = c.r2tsn;
        c.r2tsn += 1;
        c.data_sn = 0;
        let itt = c.itt;
        let mut h = pdu::header(OP_R2T, FLAG_FINAL, 0);
        put_u64(&mut h, 8, lun);
        put_u32(&mut h, 16, itt);
        put_u32(&mut h, 20, u32::from(s));
        // R2T carries the next StatSN without taking it.
        let st = self.statsn;
        self.stamp(&mut h, st);
        put_u32(&mut h, 36, r2tsn);
        put_u32(&mut h, 40, offset);
        put_u32(&mut h, 44, len);
        self.queue(h, &[], false);
    }

    fn on_data_out(&mut self, io: &mut CoreIo, bhs: &Bhs, data: &[u8]) {
        let ttt = bhs.word20();
        let ok_slot = usize::try_from(ttt)
            .ok()
            .filter(|&i| i < SLOTS)
            .filter(|&i| self.slots[i].phase == Phase::AwaitData && self.slots[i].itt == bhs.itt());
        let Some(idx) = ok_slot else {
            // Unsolicited data (InitialR2T=Yes forbids it) or a stale transfer tag.
            return self.reject(bhs, REJECT_INVALID_PDU_FIELD, true);
        };
        let off = bhs.buffer_offset();
        let end = u64::from(off) + u64::from(u32_of(data.len()));
        // In order (DataPDUInOrder=Yes) and within the burst the R2T asked for.
        let c = &self.slots[idx];
        if off != c.got
            || end > u64::from(c.burst_end)
            || c.buf.is_none()
            || bhs.data_sn() != c.data_sn
        {
            return self.reject(bhs, REJECT_PROTOCOL_ERROR, true);
        }
        let c = &mut self.slots[idx];
        c.data_sn = c.data_sn.wrapping_add(1);
        let at = usize_of(u64::from(off));
        if let Some(buf) = c.buf.as_mut() {
            buf.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        }
        c.got += u32_of(data.len());
        if c.got < c.burst_end {
            return;
        }
        let s = u16_of(idx);
        if c.got == c.want {
            c.phase = Phase::Io;
            self.execute(io, s);
        } else {
            self.send_r2t(s);
        }
    }

    fn lun_numbers(&self) -> Vec<u16> {
        (0..self.luns.len()).map(u16_of).collect()
    }

    /// Answer a command with data from `d` (cut to `alloc` bytes): Data-In with the
    /// status, or nothing but the status when there is no data.
    fn answer_data(
        &mut self,
        io: &mut CoreIo,
        slot: Option<u16>,
        itt: u32,
        edtl: u32,
        mut d: Vec<u8>,
        alloc: u32,
    ) {
        d.truncate(usize_of(u64::from(alloc)));
        let s = match slot {
            Some(s) => s,
            None => match self.free.pop() {
                Some(s) => {
                    let c = &mut self.slots[usize::from(s)];
                    c.phase = Phase::Io;
                    c.itt = itt;
                    c.lun = 0;
                    c.edtl = edtl;
                    c.charged = 0;
                    s
                }
                None => return self.respond(itt, BUSY, None, NO_RESIDUAL),
            },
        };
        let mut buf = io.bufs.get(d.len().max(1));
        buf.as_mut_slice()[..d.len()].copy_from_slice(&d);
        self.slots[usize::from(s)].buf = Some(buf);
        self.send_data_in(s, d.len());
    }

    /// Data-In PDUs for `len` bytes of the slot's buffer (cut to the Expected Data
    /// Transfer Length), the status in the last one (S bit), then the slot is freed.
    fn send_data_in(&mut self, s: u16, len: usize) {
        let idx = usize::from(s);
        let edtl = usize_of(u64::from(self.slots[idx].edtl));
        let send = len.min(edtl);
        let (flag, residual) = if len > edtl {
            (0x04u8, len - edtl)
        } else if len < edtl {
            (0x02u8, edtl - len)
        } else {
            (0, 0)
        };
        if send == 0 {
            let itt = self.slots[idx].itt;
            self.slots[idx].phase = Phase::Reply;
            self.respond(itt, scsi::GOOD, None, (flag, u32_of(residual)));
            return self.release_after_send(s);
        }
        let seg = usize_of(u64::from(self.params.initiator_max_recv)).max(512);
        let burst = usize_of(u64::from(self.params.max_burst)).max(seg);
        let itt = self.slots[idx].itt;
        let lun = pdu::lun_field(u16_of(self.slots[idx].lun));
        let mut off = 0usize;
        let mut data_sn = 0u32;
        while off < send {
            // A PDU never crosses a burst boundary: F ends each MaxBurstLength sequence.
            let burst_left = burst - off % burst;
            let n = (send - off).min(seg).min(burst_left);
            let last = off + n == send;
            let mut flags = 0u8;
            if last || n == burst_left {
                flags |= FLAG_FINAL;
            }
            if last {
                flags |= 0x01 | flag; // S: the status is in this PDU
            }
            let mut h = pdu::header(OP_DATA_IN, flags, n);
            put_u64(&mut h, 8, lun);
            put_u32(&mut h, 16, itt);
            put_u32(&mut h, 20, RESERVED_TAG);
            let statsn = if last { self.next_statsn() } else { 0 };
            self.stamp(&mut h, statsn);
            put_u32(&mut h, 36, data_sn);
            put_u32(&mut h, 40, u32_of(off));
            if last {
                put_u32(&mut h, 44, u32_of(residual));
            }
            let mut head = h.to_vec();
            if let Some(d) = pdu::header_digest(&h, self.tx_digests) {
                head.extend_from_slice(&d);
            }
            let (t, tn) = {
                let b = self.slots[idx].buf.as_ref().expect("data-in buffer");
                pdu::data_trailer(&b.as_slice()[off..off + n], self.tx_digests)
            };
            self.outq.push_back(Out {
                head,
                data: Some((s, off, n)),
                tail: t[..tn].to_vec(),
                release: last.then_some(s),
                last: false,
            });
            data_sn += 1;
            off += n;
        }
        self.slots[idx].phase = Phase::Reply;
    }

    /// The slot's answer is queued (no data of it): free it once that has been sent.
    fn release_after_send(&mut self, s: u16) {
        if let Some(o) = self.outq.back_mut() {
            o.release = Some(s);
        }
    }

    fn free_slot(&mut self, io: &mut CoreIo, s: u16) {
        let c = &mut self.slots[usize::from(s)];
        if let Some(b) = c.buf.take() {
            io.bufs.put(b);
        }
        if c.charged > 0 {
            self.budget.release(c.charged);
            c.charged = 0;
        }
        if c.caw_held {
            c.caw_held = false;
            if let Command::CompareAndWrite { lba, blocks, .. }
            | Command::OrWrite { lba, blocks, .. } = c.cmd
            {
                self.luns[c.lun].caw.release(lba, u64::from(blocks));
            }
        }
        c.phase = Phase::Free;
        self.free.push(s);
    }

    /// End a command with a status (and sense), no data.
    fn finish(&mut self, io: &mut CoreIo, s: u16, sense: Option<Sense>) {
        let idx = usize::from(s);
        let c = &self.slots[idx];
        let (itt, lun, residual) = (c.itt, c.lun, c.residual);
        let class = class_of(&c.cmd);
        self.unrecorded
            .push(lun, class, c.cmd.data_out_len(), c.start, sense.is_none());
        let status = if sense.is_some() {
            scsi::CHECK_CONDITION
        } else {
            scsi::GOOD
        };
        // Freed first, so the response's MaxCmdSN already counts the slot.
        self.free_slot(io, s);
        self.respond(itt, status, sense, residual);
    }

    /// This core's handle to LUN `lun`'s volume: I/O reaches only LUNs with data here
    /// (a standby ALUA port answers before it asks).
    fn backed_handle(&mut self, lun: usize) -> &mut T::Handle {
        &mut self.luns[lun].back.as_mut().expect("a backed LUN").vol
    }

    fn submit(&mut self, io: &mut CoreIo, s: u16, op: IoOp) {
        let lun = self.slots[usize::from(s)].lun;
        let tag = self.tag(u32::from(s));
        self.in_io += 1;
        // SAFETY: a Read or Write buffer is the slot's `buf`, which stays with the slot
        // (not released, not reused) until the slot's I/O completes in on_io.
        unsafe { self.backed_handle(lun).submit(io, op, tag) };
    }

    /// A decoded command whose data (if any) has arrived: I/O commands pass the LUN's
    /// QoS gate first (held there, they come back through `on_gate`).
    fn execute(&mut self, io: &mut CoreIo, s: u16) {
        let idx = usize::from(s);
        let charge = match self.slots[idx].cmd {
            Command::Read { blocks, .. } => Charge::Read(u64::from(blocks) << BLOCK_SHIFT),
            Command::Write { blocks, .. } => Charge::Write(u64::from(blocks) << BLOCK_SHIFT),
            Command::WriteSame16 { .. } | Command::Unmap { .. } => Charge::Write(0),
            Command::SynchronizeCache { .. } => Charge::Free,
            Command::Verify { .. } => Charge::Read(self.slots[idx].cmd.read_back_len()),
            Command::CompareAndWrite { blocks, .. } | Command::OrWrite { blocks, .. } => {
                Charge::Write(u64::from(blocks) << BLOCK_SHIFT)
            }
            // Answered from data, without I/O: nothing to admit.
            _ => return self.dispatch(io, s),
        };
        let lun = self.slots[idx].lun;
        // ALUA: the port may have turned standby (or changed its backing) while the
        // command's data came.
        if let Some(a) = &self.alua {
            if a.state() != alua::ACTIVE_OPTIMIZED {
                return self.finish(io, s, Some(alua::STANDBY_SENSE));
            }
            if a.backing_generation() != self.alua_backing_seen || self.luns[lun].back.is_none() {
                return self.finish(io, s, Some(alua::TRANSITION_SENSE));
            }
        }
        let Some(back) = self.luns[lun].back.as_mut() else {
            return self.finish(io, s, Some(alua::STANDBY_SENSE));
        };
        // While writes wait for a share round, a random read goes before them.
        let charge = match (charge, &self.slots[idx].cmd) {
            (Charge::Read(b), Command::Read { lba, .. })
                if back.gate.has_deferred() && back.vol.reads_first_at(lba << BLOCK_SHIFT) =>
            {
                Charge::ReadFirst(b)
            }
            (c, _) => c,
        };
        if back.gate.offer(io, s, charge) {
            return self.dispatch(io, s);
        }
        self.slots[idx].phase = Phase::Throttled;
    }

    /// LUN `i`'s gate timer or share round came: serve what it lets through now.
    fn on_gate(&mut self, io: &mut CoreIo, slot: u32) {
        let i = usize_of(u64::from((SLOT_GATE - slot) / 2));
        if i >= self.luns.len() {
            return;
        }
        if self.luns[i].back.is_none() {
            return;
        }
        if self.sock.dead {
            // Nobody to answer: what the gate holds is dropped.
            let mut held = Vec::new();
            self.luns[i]
                .back
                .as_mut()
                .expect("backed")
                .gate
                .drain(&mut held);
            for s in held {
                self.free_slot(io, s);
            }
        }
        let mut out: Vec<Released> = Vec::new();
        let tag = self.tag(slot);
        self.luns[i]
            .back
            .as_mut()
            .expect("backed")
            .gate
            .wake(io, tag, &mut out);
        for r in out {
            let idx = usize::from(r.slot);
            if r.throttled {
                add_throttled(&self.luns[i].back().stats, self.slots[idx].start, io.now());
            }
            if let Some(tmf) = self.slots[idx].abort_itt.take() {
                // Aborted while held: it never reaches the volume.
                self.free_slot(io, r.slot);
                self.tmf_response(tmf, 0);
                continue;
            }
            self.slots[idx].phase = Phase::Io;
            self.dispatch(io, r.slot);
        }
    }

    /// Serve a command the gate admitted (or one that needs no admission).
    fn dispatch(&mut self, io: &mut CoreIo, s: u16) {
        let idx = usize::from(s);
        let (cmd, lun, itt, edtl) = {
            let c = &self.slots[idx];
            (c.cmd, c.lun, c.itt, c.edtl)
        };
        let unit = self.luns[lun].unit.clone();
        let capacity = self.luns[lun]
            .back
            .as_ref()
            .map_or(unit.blocks, |b| b.target.size() >> BLOCK_SHIFT);
        match cmd {
            Command::TestUnitReady => self.finish(io, s, None),
            Command::Reserve6 | Command::Release6 => {
                let caw = &self.luns[lun].caw;
                let r = if cmd == Command::Reserve6 {
                    caw.reserve6(&self.nexus)
                } else {
                    caw.release6(&self.nexus)
                };
                match r {
                    Ok(()) => self.finish(io, s, None),
                    Err(PrError::Check(e)) => self.finish(io, s, Some(e)),
                    Err(PrError::Conflict) => {
                        self.free_slot(io, s);
                        self.respond(itt, pr::RESERVATION_CONFLICT, None, NO_RESIDUAL);
                    }
                }
            }
            Command::Inquiry { evpd, page, alloc } => match scsi::inquiry(&unit, evpd, page) {
                Ok(d) => self.answer_data(io, Some(s), itt, edtl, d, alloc),
                Err(e) => self.finish(io, s, Some(e)),
            },
            Command::ReadCapacity10 => {
                let u = Unit {
                    blocks: capacity,
                    ..unit
                };
                self.answer_data(io, Some(s), itt, edtl, scsi::read_capacity10(&u), 8)
            }
            Command::ReadCapacity16 { alloc } => {
                let u = Unit {
                    blocks: capacity,
                    ..unit
                };
                self.answer_data(io, Some(s), itt, edtl, scsi::read_capacity16(&u), alloc)
            }
            Command::ReportLuns { alloc } => {
                let d = scsi::report_luns(&self.lun_numbers());
                self.answer_data(io, Some(s), itt, edtl, d, alloc)
            }
            Command::RequestSense { desc, alloc } => {
                self.answer_data(io, Some(s), itt, edtl, scsi::request_sense(desc), alloc)
            }
            Command::ModeSense(m) => match scsi::mode_sense(&unit, &m) {
                Ok(d) => self.answer_data(io, Some(s), itt, edtl, d, m.alloc),
                Err(e) => self.finish(io, s, Some(e)),
            },
            Command::NoOp => self.finish(io, s, None),
            Command::Prefetch { lba, blocks } => {
                // Nothing to load ahead (the volume has no cache of its own); the range
                // is checked as a read's would be.
                let ok = scsi::in_range(lba, u64::from(blocks), capacity);
                self.finish(io, s, (!ok).then_some(Sense::LBA_OUT_OF_RANGE))
            }
            Command::ModeSelect { ten, .. } => {
                let want = usize_of(u64::from(self.slots[idx].want));
                let r = match self.slots[idx].buf.as_ref() {
                    Some(b) => scsi::mode_select(ten, &b.as_slice()[..want]),
                    None => Ok(()),
                };
                self.finish(io, s, r.err())
            }
            Command::PersistentReserveIn { sa, alloc } => match self.luns[lun].caw.pr_in(sa) {
                Ok(d) => self.answer_data(io, Some(s), itt, edtl, d, alloc),
                Err(e) => self.finish(io, s, Some(e)),
            },
            Command::PersistentReserveOut {
                sa,
                scope,
                ptype,
                param_len,
            } => {
                let want = usize_of(u64::from(self.slots[idx].want));
                let params = match self.slots[idx].buf.as_ref() {
                    Some(b) if u64::from(param_len) == u64::from(self.slots[idx].want) => {
                        &b.as_slice()[..want]
                    }
                    _ => &[][..],
                };
                let r = ProutRequest::parse(sa, scope, ptype, params)
                    .map_err(PrError::Check)
                    .and_then(|req| self.luns[lun].caw.pr_out(&self.nexus, &req));
                match r {
                    Ok(()) => self.finish(io, s, None),
                    Err(PrError::Check(e)) => self.finish(io, s, Some(e)),
                    Err(PrError::Conflict) => {
                        self.free_slot(io, s);
                        self.respond(itt, pr::RESERVATION_CONFLICT, None, NO_RESIDUAL);
                    }
                }
            }
            Command::ReportTargetPortGroups { extended, alloc } => match &self.alua {
                Some(a) => {
                    let d = alua::report_target_port_groups(&a.groups(), extended);
                    self.answer_data(io, Some(s), itt, edtl, d, alloc)
                }
                None => self.finish(io, s, Some(Sense::INVALID_OPCODE)),
            },
            Command::ReportOpcodes(q) => match scsi::report_opcodes(&q, self.alua.is_some()) {
                Ok(d) => self.answer_data(io, Some(s), itt, edtl, d, q.alloc),
                Err(e) => self.finish(io, s, Some(e)),
            },
            Command::ReadDefectData {
                twelve,
                format,
                alloc,
            } => {
                let d = scsi::read_defect_data(twelve, format);
                self.answer_data(io, Some(s), itt, edtl, d, alloc)
            }
            Command::GetLbaStatus { lba, alloc } => {
                if lba >= capacity {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                // The export's own allocation map (what NBD's block status reports),
                // as many runs as the allocation length has room for.
                let room = usize_of(u64::from(alloc.saturating_sub(8) / 16)).clamp(1, 64);
                let runs = self.luns[lun].back().target.allocation_runs(
                    lba << BLOCK_SHIFT,
                    (capacity - lba) << BLOCK_SHIFT,
                    room,
                );
                let d = scsi::lba_status(lba, &runs, alloc);
                self.answer_data(io, Some(s), itt, edtl, d, alloc)
            }
            Command::Verify {
                lba,
                blocks,
                bytchk,
            } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                if blocks == 0 || bytchk == 0 {
                    // BYTCHK 0: a medium check, which a volume that reads has passed.
                    return self.finish(io, s, None);
                }
                self.read_back(io, s, lba, blocks);
            }
            Command::CompareAndWrite { lba, blocks, .. } | Command::OrWrite { lba, blocks, .. } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                if blocks == 0 {
                    return self.finish(io, s, None);
                }
                if !self.luns[lun].caw.try_take(lba, u64::from(blocks)) {
                    return self.busy(io, s);
                }
                self.slots[idx].caw_held = true;
                self.read_back(io, s, lba, blocks);
            }
            Command::Read { lba, blocks, .. } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                if blocks == 0 {
                    return self.finish(io, s, None);
                }
                let len = blocks << BLOCK_SHIFT;
                if !self.budget.try_take(u64::from(len)) {
                    self.respond(itt, BUSY, None, NO_RESIDUAL);
                    return self.free_slot(io, s);
                }
                self.slots[idx].charged = u64::from(len);
                let mut buf = io.bufs.get(usize_of(u64::from(len)));
                let op = IoOp::Read {
                    offset: lba << BLOCK_SHIFT,
                    len,
                    buf: buf.as_mut_ptr(),
                };
                self.slots[idx].buf = Some(buf);
                self.submit(io, s, op);
            }
            Command::Write { lba, blocks, .. } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                if blocks == 0 {
                    return self.finish(io, s, None);
                }
                if self.luns[lun].caw.busy(lba, u64::from(blocks)) {
                    return self.busy(io, s);
                }
                let len = blocks << BLOCK_SHIFT;
                let buf = self.slots[idx].buf.as_ref().expect("write data").as_ptr();
                self.submit(
                    io,
                    s,
                    IoOp::Write {
                        offset: lba << BLOCK_SHIFT,
                        len,
                        buf,
                    },
                );
            }
            Command::SynchronizeCache { lba, blocks } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                self.submit(io, s, IoOp::Flush);
            }
            Command::Unmap { .. } => {
                if unit.read_only {
                    return self.finish(io, s, Some(Sense::WRITE_PROTECTED));
                }
                let list = self.slots[idx]
                    .buf
                    .as_ref()
                    .map(|b| b.as_slice()[..usize_of(u64::from(self.slots[idx].want))].to_vec())
                    .unwrap_or_default();
                let ranges = match scsi::unmap_descriptors(&list, capacity) {
                    Ok(r) => r,
                    Err(e) => return self.finish(io, s, Some(e)),
                };
                if ranges.is_empty() {
                    return self.finish(io, s, None);
                }
                let tag = self.tag(u32::from(s));
                let child = io.join(tag, u32_of(ranges.len()));
                self.in_io += 1;
                for (lba, blocks) in ranges {
                    // Unmapped blocks read zeros (LBPRZ): write zeroes that may give
                    // the space back, not a discard that leaves them undefined.
                    let op = IoOp::WriteZeroes {
                        offset: lba << BLOCK_SHIFT,
                        len: u64::from(blocks) << BLOCK_SHIFT,
                        may_unmap: true,
                    };
                    // SAFETY: a write-zeroes carries no buffer.
                    unsafe { self.backed_handle(lun).submit(io, op, child) };
                }
            }
            Command::WriteSame16 {
                lba, blocks, unmap, ..
            } => {
                if !scsi::in_range(lba, u64::from(blocks), capacity) {
                    return self.finish(io, s, Some(Sense::LBA_OUT_OF_RANGE));
                }
                if self.luns[lun].caw.busy(lba, u64::from(blocks)) {
                    return self.busy(io, s);
                }
                let zero = self.slots[idx]
                    .buf
                    .as_ref()
                    .is_none_or(|b| b.as_slice()[..512].iter().all(|&x| x == 0));
                if zero {
                    return self.submit(
                        io,
                        s,
                        IoOp::WriteZeroes {
                            offset: lba << BLOCK_SHIFT,
                            len: u64::from(blocks) << BLOCK_SHIFT,
                            may_unmap: unmap,
                        },
                    );
                }
                // The block replicated over one buffer of at most a chunk, written
                // at each chunk of the range (the writes only read the buffer).
                let chunk = blocks.min(scsi::WRITE_SAME_CHUNK_BLOCKS);
                let chunk_len = chunk << BLOCK_SHIFT;
                let mut big = io.bufs.get(usize_of(u64::from(chunk_len)));
                {
                    let block = &self.slots[idx]
                        .buf
                        .as_ref()
                        .expect("write same data")
                        .as_slice()[..512];
                    for b in big.as_mut_slice()[..usize_of(u64::from(chunk_len))].chunks_mut(512) {
                        b.copy_from_slice(block);
                    }
                }
                let ptr = big.as_ptr();
                if let Some(old) = self.slots[idx].buf.replace(big) {
                    io.bufs.put(old);
                }
                let parts = blocks.div_ceil(chunk);
                let tag = self.tag(u32::from(s));
                let child = io.join(tag, parts);
                self.in_io += 1;
                let mut at = 0u32;
                while at < blocks {
                    let n = (blocks - at).min(chunk);
                    let op = IoOp::Write {
                        offset: (lba + u64::from(at)) << BLOCK_SHIFT,
                        len: n << BLOCK_SHIFT,
                        buf: ptr,
                    };
                    // SAFETY: every part reads from the slot's buffer, which stays
                    // with the slot until the joined completion arrives in on_io.
                    unsafe { self.backed_handle(lun).submit(io, op, child) };
                    at += n;
                }
            }
        }
    }

    /// BUSY for a command that cannot run now (a COMPARE AND WRITE holds its range).
    fn busy(&mut self, io: &mut CoreIo, s: u16) {
        let itt = self.slots[usize::from(s)].itt;
        self.free_slot(io, s);
        self.respond(itt, BUSY, None, NO_RESIDUAL);
    }

    /// Read `blocks` from `lba` into the slot's read-back area (after its Data-Out).
    fn read_back(&mut self, io: &mut CoreIo, s: u16, lba: u64, blocks: u32) {
        let idx = usize::from(s);
        let at = read_back_at(self.slots[idx].want);
        let Some(b) = self.slots[idx].buf.as_mut() else {
            return self.finish(io, s, Some(Sense::INTERNAL_TARGET_FAILURE));
        };
        // SAFETY: the buffer has `at + blocks` blocks (sized in on_command).
        let ptr = unsafe { b.as_mut_ptr().add(at) };
        self.submit(
            io,
            s,
            IoOp::Read {
                offset: lba << BLOCK_SHIFT,
                len: blocks << BLOCK_SHIFT,
                buf: ptr,
            },
        );
    }

    /// Compare the slot's Data-Out (its first `blocks`, or its one block against each
    /// block when `one_block`) with what was read back: the miscompare, if any.
    fn compare(&self, idx: usize, blocks: u32, one_block: bool) -> Option<Sense> {
        let c = &self.slots[idx];
        let b = c.buf.as_ref()?.as_slice();
        let len = usize_of(u64::from(blocks) << BLOCK_SHIFT);
        let at = read_back_at(c.want);
        let medium = &b[at..at + len];
        let first = if one_block {
            let block = &b[..usize_of(u64::from(scsi::BLOCK_SIZE))];
            medium.chunks(block.len()).enumerate().find_map(|(i, m)| {
                scsi::first_difference(block, m).map(|o| u32_of(i * block.len()) + o)
            })
        } else {
            scsi::first_difference(&b[..len], medium)
        };
        first.map(Sense::miscompare)
    }

    fn on_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        self.in_io -= 1;
        let idx = usize::from(s);
        if let Some(tmf) = self.slots[idx].abort_itt.take() {
            // Aborted while its I/O ran: no status for it, the ABORT TASK is answered.
            self.free_slot(io, s);
            return self.tmf_response(tmf, 0);
        }
        let cmd = self.slots[idx].cmd;
        let write = !matches!(
            cmd,
            Command::Read { .. } | Command::SynchronizeCache { .. } | Command::Verify { .. }
        );
        if res < 0 {
            return self.finish(io, s, Some(Sense::from_errno(-res, write)));
        }
        match (cmd, self.slots[idx].phase) {
            (Command::Read { blocks, .. }, _) => {
                let c = &self.slots[idx];
                self.unrecorded.push(
                    c.lun,
                    IoClass::Read,
                    u64::from(blocks) << BLOCK_SHIFT,
                    c.start,
                    true,
                );
                self.send_data_in(s, usize_of(u64::from(blocks) << BLOCK_SHIFT));
            }
            // FUA: the data is durable before the status, so a flush follows.
            (Command::Write { fua: true, .. }, Phase::Io)
            | (Command::CompareAndWrite { fua: true, .. }, Phase::CawWrite)
            | (Command::OrWrite { fua: true, .. }, Phase::CawWrite) => {
                self.slots[idx].phase = Phase::FuaFlush;
                self.submit(io, s, IoOp::Flush);
            }
            (Command::Verify { blocks, bytchk, .. }, _) => {
                let sense = self.compare(idx, blocks, bytchk == 3);
                self.finish(io, s, sense)
            }
            (Command::CompareAndWrite { lba, blocks, .. }, Phase::Io)
            | (Command::OrWrite { lba, blocks, .. }, Phase::Io) => {
                let or = matches!(cmd, Command::OrWrite { .. });
                if !or {
                    if let Some(sense) = self.compare(idx, blocks, false) {
                        return self.finish(io, s, Some(sense));
                    }
                }
                // COMPARE AND WRITE matched: the second half of its Data-Out buffer is
                // written; ORWRITE: what was read OR its Data-Out. Both from the
                // (aligned) read-back area, while the range is still held.
                let len = usize_of(u64::from(blocks) << BLOCK_SHIFT);
                let at = read_back_at(self.slots[idx].want);
                let ptr = {
                    let b = self.slots[idx]
                        .buf
                        .as_mut()
                        .expect("compare and write data");
                    let m = b.as_mut_slice();
                    if or {
                        let (data, rest) = m.split_at_mut(at);
                        for (x, d) in rest[..len].iter_mut().zip(&data[..len]) {
                            *x |= *d;
                        }
                    } else {
                        m.copy_within(len..2 * len, at);
                    }
                    // SAFETY: `at + len` is within the buffer (sized in on_command).
                    unsafe { b.as_mut_ptr().add(at) }
                };
                self.slots[idx].phase = Phase::CawWrite;
                self.submit(
                    io,
                    s,
                    IoOp::Write {
                        offset: lba << BLOCK_SHIFT,
                        len: blocks << BLOCK_SHIFT,
                        buf: ptr,
                    },
                );
            }
            _ => self.finish(io, s, None),
        }
    }

    fn send(&mut self, io: &mut CoreIo) {
        if self.sock.dead && !self.sock.send_posted() {
            // The peer is gone: what waits to go out never will. Drop it (and free the
            // slots it held) so the connection can go idle, close and finish.
            while let Some(o) = self.outq.pop_front() {
                if let Some(s) = o.release {
                    self.free_slot(io, s);
                }
            }
            return;
        }
        if self.sock.send_posted() || self.outq.is_empty() {
            return;
        }
        let batch = self.sock.batch();
        batch.clear();
        // Take whole PDUs while their iovecs fit in one sendmsg; the rest goes next time.
        let mut iovs = 0;
        while let Some(o) = self.outq.front() {
            let n = 1 + usize::from(o.data.is_some()) + usize::from(!o.tail.is_empty());
            if iovs + n > MAX_IOV {
                break;
            }
            iovs += n;
            let o = self.outq.pop_front().expect("front");
            self.sending.push(o);
        }
        for o in &self.sending {
            batch.push(o.head.as_ptr(), o.head.len());
            if let Some((s, off, n)) = o.data {
                let b = self.slots[usize::from(s)]
                    .buf
                    .as_ref()
                    .expect("data-in buffer");
                batch.push(b.as_slice()[off..].as_ptr(), n);
            }
            if !o.tail.is_empty() {
                batch.push(o.tail.as_ptr(), o.tail.len());
            }
        }
        let tag = self.tag(SLOT_SEND);
        // SAFETY: the heads and tails are owned by `sending`, which is left untouched
        // until the send ends; a data iovec points into a slot buffer that is released
        // only from on_send, after the send ended.
        unsafe { self.sock.post_send(io, tag) };
    }

    fn on_send(&mut self, io: &mut CoreIo, res: i32) {
        let tag = self.tag(SLOT_SEND);
        match self.sock.send_done(io, res, tag) {
            SendDone::Partial => {}
            SendDone::All | SendDone::Failed => {
                let sent = std::mem::take(&mut self.sending);
                for o in sent {
                    if let Some(s) = o.release {
                        self.free_slot(io, s);
                    }
                    if o.last {
                        self.sock.draining = true;
                    }
                }
            }
        }
    }
}

/// The residual flags of a SCSI Response / final Data-In (byte 1).
const RESIDUAL_OVERFLOW: u8 = 0x04;
const RESIDUAL_UNDERFLOW: u8 = 0x02;
const NO_RESIDUAL: (u8, u32) = (0, 0);

fn class_of(c: &Command) -> IoClass {
    match c {
        Command::Read { .. } => IoClass::Read,
        Command::Write { .. } => IoClass::Write,
        Command::SynchronizeCache { .. } => IoClass::Flush,
        Command::Unmap { .. } => IoClass::Discard,
        Command::WriteSame16 { .. } => IoClass::WriteZeroes,
        Command::Verify { .. } => IoClass::Read,
        Command::CompareAndWrite { .. } | Command::OrWrite { .. } => IoClass::Write,
        _ => IoClass::Other,
    }
}

/// A stable 64-bit id for LUN `lun` of target `name` (FNV-1a): the same on every
/// connection and node, so multipath sees one unit.
fn unit_id(name: &str, lun: usize) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain(lun.to_le_bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where a comparing command's read-back area starts in its buffer: after `want` bytes
/// of Data-Out, at a 4 KiB boundary (the alignment direct I/O may need).
fn read_back_at(want: u32) -> usize {
    usize_of(u64::from(want).next_multiple_of(4096))
}

/// A receive buffer of `cap` bytes holding what `old` has received and not parsed yet.
fn grown(old: &RecvBuf, cap: usize) -> RecvBuf {
    let mut b = RecvBuf::new(cap);
    let rest = old.unparsed();
    let (p, room) = b.room(usize::MAX);
    assert!(
        rest.len() <= room,
        "a larger buffer holds what a smaller one did"
    );
    // SAFETY: `p` points at `room` writable bytes of the new buffer, which `rest` (in
    // another buffer) does not overlap, and `rest.len() <= room`.
    unsafe { std::ptr::copy_nonoverlapping(rest.as_ptr(), p, rest.len()) };
    b.filled(rest.len());
    b
}

fn dummy_unit() -> Unit {
    Unit {
        blocks: 0,
        read_only: true,
        serial: String::new(),
        id: 0,
        port: None,
    }
}

impl<T: ExportTarget> IscsiConn<T> {
    /// The session is over (its one connection shut down): its I_T nexus is lost, and
    /// with it the SPC-2 reservation it held (persistent ones stay). As soon as the
    /// socket shuts, not when the task is dropped, which waits for its timer.
    fn end_nexus(&self) {
        if matches!(self.state, State::Full) {
            for l in &self.luns {
                l.caw.drop_legacy(Some(&self.nexus));
            }
        }
    }
}

impl<T: ExportTarget> Drop for IscsiConn<T> {
    fn drop(&mut self) {
        if matches!(self.state, State::Full) {
            info!(
                protocol = "iscsi",
                client = %self.client,
                initiator = %self.initiator,
                target = %self.target_name,
                duration_s = self.started.elapsed().as_secs_f64(),
                "iscsi: session closed"
            );
        }
        self.end_nexus();
        for b in self.luns.drain(..).filter_map(|l| l.back) {
            b.target.unregister_stats(&b.stats);
        }
    }
}

impl<T: ExportTarget> Task for IscsiConn<T> {
    fn start(&mut self, io: &mut CoreIo, id: u32) {
        self.id = id;
        self.timer_armed = true;
        io.complete_after(self.login_tick(), self.tag(SLOT_LOGIN_TIMER), 0);
        self.post_recv(io);
    }

    fn on_complete(&mut self, io: &mut CoreIo, slot: u32, res: i32) {
        match slot {
            SLOT_RECV => self.on_recv(io, res),
            SLOT_SEND => self.on_send(io, res),
            s if s <= SLOT_GATE && s > SLOT_GATE_END => self.on_gate(io, s),
            SLOT_LOGIN_TIMER => {
                self.timer_armed = false;
                if !matches!(self.state, State::Login(_)) || self.sock.draining {
                    return;
                }
                if self.started.elapsed() >= self.login_timeout {
                    if BAD_CONN_LOG.admit() {
                        warn!(protocol = "iscsi", client = %self.client, "iscsi: no login within {:?}, closing", self.login_timeout);
                    }
                    self.sock.draining = true;
                    return;
                }
                self.timer_armed = true;
                io.complete_after(self.login_tick(), self.tag(SLOT_LOGIN_TIMER), 0);
            }
            s => self.on_io(io, io_slot(s), res),
        }
    }

    fn flush(&mut self, io: &mut CoreIo) {
        let luns = &self.luns;
        self.unrecorded.flush(io.now(), |n| {
            luns.get(n).and_then(|l| l.back.as_ref()).map(|b| &*b.stats)
        });
        if self.outq.is_empty() && self.sending.is_empty() {
            self.update_window();
        }
        self.send(io);
        let idle = self.in_io == 0 && self.outq.is_empty() && self.sending.is_empty();
        if self.sock.shut_down_when_idle(idle) {
            self.end_nexus();
        }
    }

    fn finished(&self) -> bool {
        self.sock.is_closed()
            && self.in_io == 0
            && !self.timer_armed
            && self.luns.iter().all(|l| l.gate_idle())
    }
}
