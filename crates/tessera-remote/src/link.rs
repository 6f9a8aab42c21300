//! One NVMe/TCP I/O queue on one reactor core: the datapath of a [`RemoteDevice`].
//!
//! The queue's socket is driven by the core's io_uring: one receive is always armed, and
//! at most one send is in flight. Commands submitted while a send is in flight are
//! encoded into the next batch, which leaves in one send when the current one completes:
//! under load, several capsules share a system call; at queue depth 1 a command leaves
//! at once. Ring completions reach the queue through a hook ([`CoreIo::watched`]), so the
//! handle needs no task of its own.
//!
//! Connecting (TCP connect, ICReq/ICResp, Fabrics Connect, and a new controller when the
//! target restarted) blocks, so it runs in a short-lived thread that hands the connected
//! socket back through the core's mailbox. Nothing blocks on the reactor.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

use io_uring::{opcode, types};
use tessera_device::{CoreIo, IoHandle, IoOp, Tag};
use tessera_io::Continuation;
use tessera_nvmf::initiator::Queue;
use tessera_nvmf::nvme::{self, Sqe};
use tessera_nvmf::pdu::{self, Framing, Limits, Role};
use tracing::{debug, info, warn};

use crate::congestion::Window;
use crate::{status_to_errno, ConnectError, LinkError, RemoteDevice};

/// Receive buffer per queue: C2HData payloads stream through it into the caller's
/// buffers, so it only has to hold whole headers.
const RECV_BUF: usize = 64 << 10;
/// Room a receive needs at the buffer's tail; less, and the partial PDU moves to the front.
const RECV_ROOM: usize = 4096;
/// First reconnect delay; doubled per failed attempt up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
/// The longest reconnect delay, and the least time between attempts once I/O fails fast.
const MAX_BACKOFF: Duration = Duration::from_millis(500);
/// Largest data one C2HData/R2T may announce (bounded again by the command's length).
const MAX_PDU_DATA: u32 = 16 << 20;

/// What a ring completion or timer addressed to the queue is about (low byte of the
/// hook context; the connection generation is in the bits above).
const EV_RECV: u64 = 1;
const EV_SEND: u64 = 2;
const EV_CONNECTED: u64 = 3;
const EV_RETRY: u64 = 4;
const EV_DEADLINE: u64 = 5;
const EV_WATCHDOG: u64 = 6;
/// The handle was dropped (sent through the core's mailbox by `Drop`, which has no
/// `CoreIo`): release the hook.
const EV_CLOSE: u64 = 7;

#[derive(Clone, Copy)]
struct Cmd {
    op: IoOp,
    tag: Tag,
    busy: bool,
    /// When the capsule was encoded (the reactor's round clock) and its sequence number
    /// for the congestion window's epochs.
    sent: Instant,
    seq: u64,
    /// Of a read: the bytes its C2HData PDUs delivered so far (they must arrive in order,
    /// each byte once, and all of them before the read may complete successfully).
    got: u32,
}

/// A C2HData payload being received into a read's buffer.
struct DataIn {
    cid: u16,
    at: *mut u8,
    left: usize,
    success: bool,
}

/// Counters and congestion state of one queue (for tests, the bench and the node).
#[derive(Clone, Copy, Debug, Default)]
pub struct LinkStats {
    /// Command capsules sent (resubmissions included).
    pub capsules: u64,
    /// Send system calls (io_uring sends) issued.
    pub sends: u64,
    /// Connections established.
    pub connects: u64,
    /// Commands sent again after a connection broke.
    pub resubmitted: u64,
    /// Commands the congestion window lets the queue keep outstanding now.
    pub window: u32,
    /// Times the window shrank because the queueing delay exceeded the target.
    pub window_decreases: u64,
    /// The path's minimum round-trip time (windowed); zero before the first completion.
    pub min_rtt: Duration,
    /// Smoothed round-trip time (capsule sent to response, gain 1/8).
    pub srtt: Duration,
    /// Commands sent and not answered.
    pub inflight: u32,
    /// Commands waiting in the queue for the window or a connection.
    pub waiting: u32,
}

type ConnectSlot = Arc<Mutex<Option<Result<Queue, ConnectError>>>>;

struct Link {
    dev: Arc<RemoteDevice>,
    qid: Option<u16>,
    hook: Option<u32>,
    /// Where `Drop` sends the [`EV_CLOSE`] event, and its tag (made when the hook was
    /// registered, so it keeps the hook until it arrives). None without a reactor.
    close: Option<(tessera_io::RemoteCompleter, Tag)>,
    sock: Option<TcpStream>,
    fd: RawFd,
    /// Bumped when a connection ends; events of older connections are ignored.
    gen: u32,
    framing: Framing,
    limits: Limits,
    maxh2cdata: u32,
    connecting: bool,
    /// The socket is shut down; waiting for its ring operations to come back.
    draining: bool,
    recv_armed: bool,
    send_armed: bool,
    /// The peer stayed away past the timeout: I/O fails at once until a reconnect works.
    fail_fast: bool,
    /// The device's revival count when this queue last looked ([`RemoteDevice::revive`]).
    revivals_seen: u64,
    /// Since when the queue has been without a connection.
    down_since: Option<Instant>,
    backoff: Duration,
    last_attempt: Option<Instant>,
    /// The handle was dropped: close once the ring gives the buffers back.
    closed: bool,
    /// When the peer last sent anything (or commands started after an idle spell).
    last_heard: Instant,
    /// A watchdog check of the current connection is pending.
    watchdog_armed: bool,
    inb: Box<[u8]>,
    in_start: usize,
    in_end: usize,
    data_in: Option<DataIn>,
    /// The next batch, encoded while `sending` is in flight.
    out: Vec<u8>,
    sending: Vec<u8>,
    sent: usize,
    cmds: Vec<Cmd>,
    free: Vec<u16>,
    waiting: VecDeque<(IoOp, Tag)>,
    /// Completions gathered while the link is borrowed, delivered after.
    done: Vec<(Tag, i32)>,
    connect_slot: ConnectSlot,
    stats: LinkStats,
    /// How many commands may be outstanding, adapted to the measured RTT.
    cc: Window,
    /// The round clock of the receive being parsed: completion time of its commands.
    rx_now: Instant,
    /// A command got a path related status (ANA) in the receive being parsed.
    path_error: Option<nvme::Status>,
    /// The connected peer runs on this host (loopback, or our own address): its reactor
    /// shares our CPUs, so our core should sleep rather than poll while it waits for it.
    peer_on_this_host: bool,
    /// How many of our commands the core counts as waiting for a peer on this host
    /// ([`CoreIo::note_peer_waits`]); kept equal to `busy()` while `peer_on_this_host`.
    noted_peer_waits: usize,
}

struct LinkCell(RefCell<Link>);

/// A per-core handle to a [`RemoteDevice`]: one NVMe/TCP I/O queue, connected on first use.
pub struct RemoteHandle {
    link: Rc<LinkCell>,
    dev: Arc<RemoteDevice>,
}

impl RemoteHandle {
    /// A handle using I/O queue `qid` (None: the controller's queues are all taken, and
    /// every I/O fails with -EBUSY).
    pub(crate) fn new(dev: Arc<RemoteDevice>, qid: Option<u16>) -> RemoteHandle {
        let depth = dev.cfg.queue_depth;
        let link = Link {
            dev: dev.clone(),
            qid,
            hook: None,
            close: None,
            sock: None,
            fd: -1,
            gen: 0,
            framing: Framing::default(),
            limits: Limits {
                hdgst: false,
                ddgst: false,
                max_data: MAX_PDU_DATA,
            },
            maxh2cdata: 4096,
            connecting: false,
            draining: false,
            recv_armed: false,
            send_armed: false,
            fail_fast: false,
            revivals_seen: 0,
            down_since: None,
            backoff: FIRST_BACKOFF,
            last_attempt: None,
            closed: false,
            last_heard: Instant::now(),
            watchdog_armed: false,
            inb: vec![0u8; RECV_BUF].into_boxed_slice(),
            in_start: 0,
            in_end: 0,
            data_in: None,
            out: Vec::with_capacity(64 << 10),
            sending: Vec::with_capacity(64 << 10),
            sent: 0,
            cmds: vec![
                Cmd {
                    op: IoOp::Flush,
                    tag: Tag::NO_PARENT,
                    busy: false,
                    sent: Instant::now(),
                    seq: 0,
                    got: 0,
                };
                usize::from(depth)
            ],
            free: (0..depth).rev().collect(),
            waiting: VecDeque::with_capacity(usize::from(depth)),
            done: Vec::with_capacity(usize::from(depth)),
            connect_slot: Arc::new(Mutex::new(None)),
            stats: LinkStats::default(),
            cc: Window::new(&dev.cfg.congestion, depth),
            rx_now: Instant::now(),
            path_error: None,
            peer_on_this_host: false,
            noted_peer_waits: 0,
        };
        RemoteHandle {
            link: Rc::new(LinkCell(RefCell::new(link))),
            dev,
        }
    }

    /// A concrete handle for the calling core (the trait's `open_handle` boxes this).
    pub fn open(dev: &Arc<RemoteDevice>) -> RemoteHandle {
        let qid = dev.free_qids.locked().pop();
        RemoteHandle::new(dev.clone(), qid)
    }

    /// This queue's counters and congestion state.
    pub fn stats(&self) -> LinkStats {
        let l = self.link.0.borrow();
        LinkStats {
            window: l.cc.window(),
            window_decreases: l.cc.decreases(),
            min_rtt: l.cc.min_rtt(),
            srtt: l.cc.srtt(),
            inflight: tessera_io::cast::u32_of(l.busy()),
            waiting: tessera_io::cast::u32_of(l.waiting.len()),
            ..l.stats
        }
    }

    /// The device's count of lost connections ([`RemoteDevice::breaks`]). A completion
    /// this queue delivers after the count moved may come from a peer that restarted.
    pub fn device_breaks(&self) -> u64 {
        self.dev.breaks()
    }

    /// True while the queue fails I/O at once (the peer stayed away past the timeout).
    pub fn is_failing_fast(&self) -> bool {
        self.link.0.borrow().fail_fast
    }

    /// Commands in flight on the connection plus those waiting for a slot or a connection.
    pub fn pending(&self) -> usize {
        let l = self.link.0.borrow();
        l.cmds.iter().filter(|c| c.busy).count() + l.waiting.len()
    }

    /// The largest piece of `op` one command may carry.
    fn max_piece(&self, op: &IoOp) -> u64 {
        let lba = u64::from(self.dev.lba);
        match op {
            IoOp::Read { .. } | IoOp::Write { .. } => u64::from(self.dev.max_transfer),
            // Write Zeroes counts blocks in 16 bits; DSM ranges in 32.
            IoOp::WriteZeroes { .. } => lba << 16,
            IoOp::Discard { .. } => lba << 31,
            IoOp::Flush => u64::MAX,
        }
    }

    fn validate(&self, op: &IoOp) -> Result<(), i32> {
        let (offset, len) = match *op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, u64::from(len))
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => return Ok(()),
        };
        let lba = u64::from(self.dev.lba);
        match offset.checked_add(len) {
            Some(end) if end <= self.dev.size && offset % lba == 0 && len % lba == 0 && len > 0 => {
                Ok(())
            }
            _ => Err(-libc::EINVAL),
        }
    }

    /// Queue one command-sized operation and deliver whatever completed meanwhile.
    fn submit_piece(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let mut done = {
            let mut l = self.link.0.borrow_mut();
            if l.hook.is_none() {
                let hook: Rc<dyn Continuation> = self.link.clone();
                let id = io.register_hook(hook);
                l.hook = Some(id);
                l.close = io
                    .remote_completer()
                    .map(|m| (m, io.tracked(Tag::NO_PARENT, 1, id, ctx(EV_CLOSE, 0))));
            }
            if l.qid.is_none() {
                l.done.push((tag, -libc::EBUSY));
            } else if l.fail_fast && !l.revived(io) {
                l.done.push((tag, -libc::ENOTCONN));
                l.retry_if_due(io);
            } else {
                l.waiting.push_back((op, tag));
                l.pump(io);
            }
            std::mem::take(&mut l.done)
        };
        deliver(&self.link, io, &mut done);
    }
}

/// Complete gathered results outside the link's borrow: a completion may run a layer's
/// hook that submits to this very handle again.
fn deliver(link: &LinkCell, io: &mut CoreIo, done: &mut Vec<(Tag, i32)>) {
    if done.is_empty() {
        return;
    }
    for &(tag, res) in done.iter() {
        io.complete(tag, res);
    }
    done.clear();
    let mut l = link.0.borrow_mut();
    if l.done.is_empty() {
        // Give the vector's capacity back, so the next batch does not allocate.
        std::mem::swap(&mut l.done, done);
    }
}

impl IoHandle for RemoteHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        if let Err(e) = self.validate(&op) {
            io.complete(tag, e);
            return;
        }
        let piece = self.max_piece(&op);
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, u64::from(len))
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => (0, 0),
        };
        if len <= piece {
            return self.submit_piece(io, op, tag);
        }
        let parts = u32::try_from(len.div_ceil(piece)).unwrap_or(u32::MAX);
        let child = io.join(tag, parts);
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(piece);
            let off = tessera_io::cast::usize_of(at);
            let part = match op {
                IoOp::Read { buf, .. } => IoOp::Read {
                    offset: offset + at,
                    len: tessera_io::cast::u32_of(n),
                    // SAFETY: `at` < `len`, inside the caller's buffer.
                    buf: unsafe { buf.add(off) },
                },
                IoOp::Write { buf, .. } => IoOp::Write {
                    offset: offset + at,
                    len: tessera_io::cast::u32_of(n),
                    // SAFETY: as above.
                    buf: unsafe { buf.add(off) },
                },
                IoOp::Discard { .. } => IoOp::Discard {
                    offset: offset + at,
                    len: n,
                },
                IoOp::WriteZeroes { may_unmap, .. } => IoOp::WriteZeroes {
                    offset: offset + at,
                    len: n,
                    may_unmap,
                },
                IoOp::Flush => IoOp::Flush,
            };
            self.submit_piece(io, part, child);
            at += n;
        }
    }

    fn size(&self) -> u64 {
        self.dev.size
    }
}

impl Drop for RemoteHandle {
    fn drop(&mut self) {
        let mut l = self.link.0.borrow_mut();
        l.closed = true;
        if l.sock.is_some() {
            // The receive armed on the ring comes back and ends the connection.
            l.shutdown();
        } else if !l.connecting {
            if let Some(q) = l.qid.take() {
                self.dev.release_qid(q);
            }
        }
        // The core holds the link through its hook: have it let go (on the core, once
        // the socket's ring operations and the link's timers are done).
        if let Some((mailbox, tag)) = l.close.take() {
            mailbox.complete(tag, 0);
        }
    }
}

impl Continuation for LinkCell {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        self.on_done(io, parent, op, ctx, res)
    }

    fn on_done(&self, io: &mut CoreIo, _parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        let mut done = {
            let mut l = self.0.borrow_mut();
            l.event(io, ctx, res);
            std::mem::take(&mut l.done)
        };
        deliver(self, io, &mut done);
    }
}

fn ctx(ev: u64, gen: u32) -> u64 {
    ev | u64::from(gen) << 8
}

impl Link {
    fn event(&mut self, io: &mut CoreIo, ctx: u64, res: i32) {
        let ev = ctx & 0xFF;
        let gen = u32::try_from(ctx >> 8).unwrap_or(u32::MAX);
        match ev {
            EV_RECV => {
                self.recv_armed = false;
                if self.draining {
                    return self.finish_drain(io);
                }
                if res <= 0 {
                    let why = if res == 0 {
                        "the target closed the connection".to_string()
                    } else {
                        std::io::Error::from_raw_os_error(-res).to_string()
                    };
                    return self.break_link(io, &why);
                }
                self.in_end += usize::try_from(res).unwrap_or(0);
                self.last_heard = io.now();
                self.rx_now = io.now();
                let parsed = self.parse();
                self.note_peer_waits(io);
                if let Err(why) = parsed {
                    return self.break_link(io, &why.to_string());
                }
                if let Some(status) = self.path_error.take() {
                    let why = format!(
                        "the path no longer serves the namespace ({})",
                        nvme::status_text(status)
                    );
                    return self.break_link(io, &why);
                }
                self.arm_recv(io);
                self.pump(io);
            }
            EV_SEND => {
                self.send_armed = false;
                if self.draining {
                    return self.finish_drain(io);
                }
                if res <= 0 {
                    let why = std::io::Error::from_raw_os_error(-res.min(-1)).to_string();
                    return self.break_link(io, &format!("send: {why}"));
                }
                self.sent += usize::try_from(res).unwrap_or(0);
                if self.sent < self.sending.len() {
                    self.push_send(io);
                } else {
                    self.sending.clear();
                    self.sent = 0;
                    self.kick_send(io);
                }
            }
            EV_CONNECTED => self.on_connected(io),
            EV_CLOSE => {
                if let Some(hook) = self.hook {
                    io.release_hook(hook);
                }
                self.shed_buffers();
            }
            EV_WATCHDOG if gen == self.gen => {
                self.watchdog_armed = false;
                if self.sock.is_none() || self.draining || self.busy() == 0 {
                    return;
                }
                let silent = io.now().saturating_duration_since(self.last_heard);
                if silent >= self.stall_limit() {
                    let why = format!("no answer for {silent:?} with commands outstanding");
                    return self.break_link(io, &why);
                }
                self.arm_watchdog(io);
            }
            EV_RETRY
                if gen == self.gen
                    && !self.closed
                    && self.sock.is_none()
                    && !self.connecting
                    && !self.fail_fast =>
            {
                self.start_connect(io);
            }
            EV_DEADLINE => {
                let expired = self
                    .down_since
                    .is_some_and(|t| t.elapsed() >= self.dev.cfg.timeout);
                // No generation check: the outage may span several short-lived
                // connections; `down_since` says whether it is still the same one.
                if self.sock.is_none() && !self.fail_fast && expired {
                    self.go_down();
                }
            }
            _ => {}
        }
    }

    /// Send what waits for a command slot, connecting first when there is no connection.
    fn pump(&mut self, io: &mut CoreIo) {
        if self.sock.is_none() || self.draining {
            if !self.connecting && !self.draining && !self.closed {
                self.start_connect(io);
            }
            return;
        }
        if !self.waiting.is_empty() && self.busy() == 0 {
            // Silence while nothing was asked is no stall.
            self.last_heard = io.now();
        }
        // Commands beyond the congestion window stay in `waiting`, in order, until
        // completions open it (this function runs again after every receive).
        let allowed = self.cc.allowed();
        let now = io.now();
        while !self.waiting.is_empty() && self.busy() < allowed {
            let Some(cid) = self.free.pop() else { break };
            let (op, tag) = self.waiting.pop_front().expect("not empty");
            self.cmds[usize::from(cid)] = Cmd {
                op,
                tag,
                busy: true,
                sent: now,
                seq: self.cc.on_send(),
                got: 0,
            };
            self.encode(cid, op);
        }
        if self.busy() >= allowed {
            self.cc.note_full();
        }
        self.note_peer_waits(io);
        self.kick_send(io);
        if self.busy() > 0 && !self.watchdog_armed {
            self.arm_watchdog(io);
        }
    }

    /// Commands sent and not answered.
    fn busy(&self) -> usize {
        self.cmds.len() - self.free.len()
    }

    /// Tell the core how many commands now wait for a peer on this host (see
    /// `tessera_io::poll`): two compares per batch of sends or receives, no atomic.
    fn note_peer_waits(&mut self, io: &mut CoreIo) {
        let now = if self.peer_on_this_host {
            self.busy()
        } else {
            0
        };
        if now != self.noted_peer_waits {
            io.note_peer_waits(self.noted_peer_waits, now);
            self.noted_peer_waits = now;
        }
    }

    /// Silence with commands outstanding after which the connection counts as broken:
    /// half the timeout, so that a stalled peer's I/O fails within about 1.5 timeouts
    /// (the rest is spent trying to reconnect).
    fn stall_limit(&self) -> Duration {
        (self.dev.cfg.timeout / 2).max(Duration::from_millis(50))
    }

    /// Check for a silent peer a few times per stall limit (a background timer: one per
    /// connection, never per I/O).
    fn arm_watchdog(&mut self, io: &mut CoreIo) {
        let hook = self.hook.expect("registered at the first submit");
        let t = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_WATCHDOG, self.gen));
        io.complete_after_background(self.stall_limit() / 4, t, 0);
        self.watchdog_armed = true;
    }

    fn encode(&mut self, cid: u16, op: IoOp) {
        let lba = u64::from(self.dev.lba);
        let nsid = self.dev.spec.nsid;
        let rw = |opc: u8, offset: u64, blocks: u64| Sqe {
            opc,
            cid,
            nsid,
            cdw10: tessera_io::cast::u32_of((offset / lba) & 0xFFFF_FFFF),
            cdw11: tessera_io::cast::u32_of((offset / lba) >> 32),
            cdw12: tessera_io::cast::u32_of(blocks - 1),
            ..Sqe::default()
        };
        let mut h = [0u8; 256];
        let dsm: [u8; 16];
        let (sqe, data): (Sqe, &[u8]) = match op {
            IoOp::Read { offset, len, .. } => (
                rw(nvme::IO_READ, offset, u64::from(len) / lba)
                    .with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, len),
                &[],
            ),
            IoOp::Write { offset, len, buf } => {
                let sqe = rw(nvme::IO_WRITE, offset, u64::from(len) / lba);
                if len <= self.dev.in_capsule {
                    // SAFETY: the submitter keeps `buf` valid for `len` bytes until the
                    // completion (IoHandle::submit's contract); we only read it.
                    let d = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                    (sqe.with_sgl(nvme::SGL_DATA_BLOCK_OFFSET, len), d)
                } else {
                    (sqe.with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, len), &[])
                }
            }
            IoOp::Flush => (
                Sqe {
                    opc: nvme::IO_FLUSH,
                    cid,
                    nsid,
                    ..Sqe::default()
                }
                .with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, 0),
                &[],
            ),
            IoOp::WriteZeroes {
                offset,
                len,
                may_unmap,
            } => {
                let mut sqe = rw(nvme::IO_WRITE_ZEROES, offset, len / lba);
                if may_unmap {
                    sqe.cdw12 |= 1 << 25; // DEAC
                }
                (sqe.with_sgl(nvme::SGL_TRANSPORT_DATA_BLOCK, 0), &[])
            }
            IoOp::Discard { offset, len } => {
                dsm = nvme::encode_dsm_range(offset / lba, tessera_io::cast::u32_of(len / lba));
                (
                    Sqe {
                        opc: nvme::IO_DSM,
                        cid,
                        nsid,
                        cdw10: 0,
                        cdw11: 1 << 2, // AD: deallocate
                        ..Sqe::default()
                    }
                    .with_sgl(nvme::SGL_DATA_BLOCK_OFFSET, 16),
                    &dsm[..],
                )
            }
        };
        let n = self.framing.capsule_cmd(&mut h, &sqe.encode(), data.len());
        self.out.extend_from_slice(&h[..n]);
        self.out.extend_from_slice(data);
        self.stats.capsules += 1;
    }

    /// Start a send of the batch when none is in flight.
    fn kick_send(&mut self, io: &mut CoreIo) {
        if self.send_armed || self.out.is_empty() || self.sock.is_none() || self.draining {
            return;
        }
        debug_assert!(self.sending.is_empty());
        std::mem::swap(&mut self.out, &mut self.sending);
        self.sent = 0;
        self.push_send(io);
    }

    fn push_send(&mut self, io: &mut CoreIo) {
        let hook = self.hook.expect("registered at the first submit");
        let rest = &self.sending[self.sent..];
        let e = opcode::Send::new(
            types::Fd(self.fd),
            rest.as_ptr(),
            u32::try_from(rest.len()).unwrap_or(u32::MAX),
        )
        .flags(libc::MSG_NOSIGNAL)
        .build();
        let tag = io.watched(hook, ctx(EV_SEND, self.gen));
        // SAFETY: `sending` is neither touched nor reallocated until this send's
        // completion (send_armed), and the socket stays open until then (drain).
        unsafe { io.push_sqe(e, tag) };
        self.send_armed = true;
        self.stats.sends += 1;
    }

    fn arm_recv(&mut self, io: &mut CoreIo) {
        if self.recv_armed || self.sock.is_none() || self.draining {
            return;
        }
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.inb.len() - self.in_end < RECV_ROOM {
            self.inb.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        let hook = self.hook.expect("registered at the first submit");
        let room = &mut self.inb[self.in_end..];
        let e = opcode::Recv::new(
            types::Fd(self.fd),
            room.as_mut_ptr(),
            u32::try_from(room.len()).unwrap_or(u32::MAX),
        )
        .build();
        let tag = io.watched(hook, ctx(EV_RECV, self.gen));
        // SAFETY: `inb` is a boxed slice owned by the link (kept alive by the hook) and
        // not touched until this receive completes (recv_armed); the socket stays open
        // until then (drain).
        unsafe { io.push_sqe(e, tag) };
        self.recv_armed = true;
    }

    /// Complete command `cid` with NVMe status `status`.
    fn finish(&mut self, cid: u16, status: nvme::Status) {
        let c = &mut self.cmds[usize::from(cid)];
        c.busy = false;
        let short = match c.op {
            IoOp::Read { len, .. } => c.got != len,
            _ => false,
        };
        let res = if status & 0x7FF == 0 && short {
            // The target reported success without sending the whole range: the rest of
            // the buffer holds whatever was there before, never data to hand out.
            warn!(device = %self.dev.spec, qid = self.qid.unwrap_or(0), cid,
                  received = c.got, "remote device: a read completed without all its data");
            -libc::EIO
        } else if status & 0x7FF == 0 {
            match c.op {
                IoOp::Read { len, .. } | IoOp::Write { len, .. } => {
                    i32::try_from(len).unwrap_or(i32::MAX)
                }
                _ => 0,
            }
        } else {
            -status_to_errno(status)
        };
        let (tag, sent, seq) = (c.tag, c.sent, c.seq);
        self.free.push(cid);
        self.done.push((tag, res));
        self.cc.on_ack(
            self.rx_now.saturating_duration_since(sent),
            seq,
            self.rx_now,
        );
        if self.down_since.is_some() {
            // The peer answered: the outage is over. (Not at reconnect: a peer that
            // accepts connections and breaks them before answering anything must still
            // run into the timeout.)
            self.down_since = None;
            self.backoff = FIRST_BACKOFF;
        }
    }

    /// The busy command `cid` names, or a protocol error.
    fn busy_cmd(&self, cid: u16, what: &'static str) -> Result<Cmd, LinkError> {
        match self.cmds.get(usize::from(cid)) {
            Some(c) if c.busy => Ok(*c),
            _ => Err(LinkError::NotOutstanding { what, cid }),
        }
    }

    /// Handle every complete PDU received (C2HData payloads as they arrive).
    fn parse(&mut self) -> Result<(), LinkError> {
        loop {
            let avail = self.in_end - self.in_start;
            if let Some(d) = &mut self.data_in {
                if avail == 0 {
                    return Ok(());
                }
                let n = avail.min(d.left);
                // SAFETY: `d.at` points into the read's buffer with `d.left` bytes left
                // (checked against the command when the C2HData header arrived); the
                // submitter keeps it valid until the completion.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.inb.as_ptr().add(self.in_start), d.at, n);
                    d.at = d.at.add(n);
                }
                d.left -= n;
                self.in_start += n;
                if d.left == 0 {
                    let (cid, success) = (d.cid, d.success);
                    self.data_in = None;
                    if success {
                        self.finish(cid, nvme::SC_SUCCESS);
                    }
                }
                continue;
            }
            if avail < pdu::CH_LEN {
                return Ok(());
            }
            let b = &self.inb[self.in_start..self.in_end];
            let f = pdu::check_header(Role::Host, b, &self.limits)
                .map_err(|source| LinkError::BadPdu { source })?;
            if f.ch.ty == pdu::C2H_DATA {
                if avail < f.data_off.max(f.header_end()) {
                    return Ok(());
                }
                let cid = pdu::le16(b, 8);
                let off = pdu::le32(b, 12);
                let len = pdu::le32(b, 16);
                let c = self.busy_cmd(cid, "C2HData")?;
                let IoOp::Read { len: rlen, buf, .. } = c.op else {
                    return Err(LinkError::WrongCommand {
                        what: "C2HData",
                        cid,
                        expected: "read",
                    });
                };
                // Each byte of the read once, in order: a PDU starts where the previous
                // one ended (a gap, an overlap or a byte past the end is a broken target).
                let end = off.checked_add(len).filter(|&e| e <= rlen);
                if len as usize != f.data_len || off != c.got || end.is_none() {
                    return Err(LinkError::C2HDataRange {
                        off,
                        len,
                        cid,
                        rlen,
                        got: c.got,
                    });
                }
                self.cmds[usize::from(cid)].got = end.unwrap_or(rlen);
                let success = f.ch.flags & pdu::F_DATA_SUCCESS != 0;
                self.in_start += f.data_off.max(f.header_end());
                // SAFETY: off + len <= rlen, inside the read's buffer.
                let at = unsafe { buf.add(off as usize) };
                self.data_in = Some(DataIn {
                    cid,
                    at,
                    left: len as usize,
                    success,
                });
                if len == 0 {
                    self.data_in = None;
                    if success {
                        self.finish(cid, nvme::SC_SUCCESS);
                    }
                }
                continue;
            }
            if avail < f.plen() {
                if f.plen() > self.inb.len() / 2 {
                    return Err(LinkError::PduTooLarge(f.plen()));
                }
                return Ok(());
            }
            match f.ch.ty {
                pdu::CAPSULE_RESP => {
                    let cqe = nvme::Cqe::parse(&b[8..24]);
                    self.busy_cmd(cqe.cid, "a response")?;
                    if nvme::is_path_error(cqe.status) {
                        // The namespace is not served through this path (now): the
                        // command stays outstanding, and once this receive is parsed
                        // the connection is dropped and every outstanding command is
                        // sent again on the path that serves it (see `event`).
                        self.path_error = Some(cqe.status);
                    } else {
                        self.finish(cqe.cid, cqe.status);
                    }
                }
                pdu::R2T => {
                    let cid = pdu::le16(b, 8);
                    let ttag = pdu::le16(b, 10);
                    let off = pdu::le32(b, 12);
                    let len = pdu::le32(b, 16);
                    let c = self.busy_cmd(cid, "R2T")?;
                    let IoOp::Write { len: wlen, buf, .. } = c.op else {
                        return Err(LinkError::WrongCommand {
                            what: "R2T",
                            cid,
                            expected: "write",
                        });
                    };
                    if u64::from(off) + u64::from(len) > u64::from(wlen) || len == 0 {
                        return Err(LinkError::R2TRange {
                            off,
                            len,
                            cid,
                            wlen,
                        });
                    }
                    self.in_start += f.plen();
                    self.queue_h2c(cid, ttag, off, len, buf);
                    continue;
                }
                pdu::C2H_TERM => {
                    let (fes, fei) = pdu::parse_term(b);
                    return Err(LinkError::Terminated { fes, fei });
                }
                t => return Err(LinkError::UnexpectedPdu(t)),
            }
            self.in_start += f.plen();
        }
    }

    /// Queue the H2CData PDUs answering an R2T for `[off, off+len)` of a write.
    fn queue_h2c(&mut self, cid: u16, ttag: u16, off: u32, len: u32, buf: *const u8) {
        let mut at = off;
        let end = off + len;
        while at < end {
            let n = (end - at).min(self.maxh2cdata);
            let last = at + n == end;
            let mut h = [0u8; 256];
            let hl = self.framing.data_pdu(
                &mut h,
                pdu::H2C_DATA,
                if last { pdu::F_DATA_LAST } else { 0 },
                cid,
                ttag,
                at,
                n,
            );
            self.out.extend_from_slice(&h[..hl]);
            // SAFETY: [at, at+n) lies inside the write's buffer (checked against the
            // command), valid until its completion.
            let d = unsafe { std::slice::from_raw_parts(buf.add(at as usize), n as usize) };
            self.out.extend_from_slice(d);
            at += n;
        }
    }

    /// A closed link may wait a while for its last timers before the core drops it (see
    /// [`CoreIo::release_hook`]): give its buffers back now, once the ring is done
    /// with them.
    fn shed_buffers(&mut self) {
        if self.closed && self.sock.is_none() && !self.recv_armed && !self.send_armed {
            self.inb = Box::default();
            self.in_start = 0;
            self.in_end = 0;
            self.out = Vec::new();
            self.sending = Vec::new();
        }
    }

    fn shutdown(&mut self) {
        if self.sock.is_some() {
            // SAFETY: shutting down our own socket; ring operations on it then complete.
            unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        }
        self.draining = true;
    }

    /// The connection failed: shut it down; once the ring has returned its buffers, the
    /// commands in flight are queued again and a reconnect starts.
    fn break_link(&mut self, io: &mut CoreIo, why: &str) {
        if self.draining {
            return;
        }
        // Before anything is resubmitted: the layer above must be able to see the outage
        // whatever the resubmitted I/Os' results.
        self.dev.note_break();
        let inflight = self.cmds.iter().filter(|c| c.busy).count();
        warn!(device = %self.dev.spec, qid = self.qid.unwrap_or(0), core = io.core,
              inflight, reason = why, "remote device: connection lost, reconnecting");
        self.shutdown();
        self.finish_drain(io);
    }

    fn finish_drain(&mut self, io: &mut CoreIo) {
        if !self.draining || self.recv_armed || self.send_armed {
            return;
        }
        self.draining = false;
        self.watchdog_armed = false;
        self.sock = None;
        self.fd = -1;
        self.gen = self.gen.wrapping_add(1);
        self.data_in = None;
        self.path_error = None;
        self.in_start = 0;
        self.in_end = 0;
        self.out.clear();
        self.sending.clear();
        self.sent = 0;
        // Commands in flight go first, in command-id order (NVMe promises no order among
        // outstanding commands, so none is lost by this).
        let mut again = 0u64;
        for cid in (0..self.cmds.len()).rev() {
            let c = &mut self.cmds[cid];
            if c.busy {
                c.busy = false;
                self.waiting.push_front((c.op, c.tag));
                again += 1;
            }
        }
        self.stats.resubmitted += again;
        self.free.clear();
        self.free
            .extend((0..u16::try_from(self.cmds.len()).unwrap_or(u16::MAX)).rev());
        self.note_peer_waits(io);
        if self.closed {
            for (_, tag) in self.waiting.drain(..) {
                self.done.push((tag, -libc::ENOTCONN));
            }
            if let Some(q) = self.qid.take() {
                self.dev.release_qid(q);
            }
            self.shed_buffers();
            return;
        }
        match self.down_since {
            // The connection broke again before the peer answered anything.
            Some(t) if t.elapsed() >= self.dev.cfg.timeout => self.go_down(),
            Some(_) => {
                let hook = self.hook.expect("registered at the first submit");
                let t = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_RETRY, self.gen));
                io.complete_after(self.backoff, t, 0);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
            None => self.start_connect(io),
        }
    }

    /// Connect in a thread (it blocks); the result comes back through the mailbox.
    fn start_connect(&mut self, io: &mut CoreIo) {
        let Some(qid) = self.qid else { return };
        let hook = self.hook.expect("registered at the first submit");
        self.connecting = true;
        self.last_attempt = Some(Instant::now());
        if self.down_since.is_none() && !self.fail_fast {
            self.down_since = Some(Instant::now());
            let t = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_DEADLINE, self.gen));
            io.complete_after(self.dev.cfg.timeout, t, 0);
        }
        let tag = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_CONNECTED, self.gen));
        let slot = self.connect_slot.clone();
        let dev = self.dev.clone();
        let Some(mailbox) = io.remote_completer() else {
            // No reactor (a tool driving a bare CoreIo): connect here, deliver next round.
            *slot.locked() = Some(dev.connect_io_queue(qid));
            io.defer(tag);
            return;
        };
        let spawned = std::thread::Builder::new()
            .name(format!("tessera-remote-connect-q{qid}"))
            .spawn(move || {
                let r = dev.connect_io_queue(qid);
                *slot.locked() = Some(r);
                mailbox.complete(tag, 0);
            });
        if let Err(e) = spawned {
            *self.connect_slot.locked() = Some(Err(ConnectError::Thread { source: e }));
            io.defer(tag);
        }
    }

    fn on_connected(&mut self, io: &mut CoreIo) {
        self.connecting = false;
        let r = self
            .connect_slot
            .locked()
            .take()
            .unwrap_or(Err(ConnectError::NoResult));
        match r {
            Ok(q) => {
                if self.closed {
                    if let Some(qid) = self.qid.take() {
                        self.dev.release_qid(qid);
                    }
                    return;
                }
                // The ring drives the socket from now on: no blocking timeouts apply.
                let _ = q.stream.set_read_timeout(None);
                let _ = q.stream.set_write_timeout(None);
                self.fd = q.stream.as_raw_fd();
                self.peer_on_this_host = peer_on_this_host(&q.stream);
                self.framing = q.framing;
                self.limits.hdgst = q.limits.hdgst;
                self.limits.ddgst = q.limits.ddgst;
                self.maxh2cdata = q.maxh2cdata.max(4096);
                self.sock = Some(q.stream);
                self.stats.connects += 1;
                if self.stats.connects > 1 {
                    info!(device = %self.dev.spec, qid = self.qid.unwrap_or(0), core = io.core,
                          resubmitting = self.waiting.len(), "remote device: reconnected");
                }
                // `down_since` and the backoff stay until the peer answers (`finish`).
                self.fail_fast = false;
                self.gen = self.gen.wrapping_add(1);
                self.arm_recv(io);
                self.pump(io);
            }
            Err(e) => {
                if self.closed {
                    if let Some(qid) = self.qid.take() {
                        self.dev.release_qid(qid);
                    }
                    return;
                }
                if self.fail_fast {
                    debug!(device = %self.dev.spec, error = %e, "remote device: still unreachable");
                    return;
                }
                let away = self.down_since.map_or(Duration::ZERO, |t| t.elapsed());
                if away >= self.dev.cfg.timeout {
                    warn!(device = %self.dev.spec, error = %e, "remote device: reconnect failed");
                    return self.go_down();
                }
                debug!(device = %self.dev.spec, error = %e, backoff = ?self.backoff,
                       "remote device: reconnect failed, retrying");
                let hook = self.hook.expect("registered at the first submit");
                let t = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_RETRY, self.gen));
                io.complete_after(self.backoff, t, 0);
                self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
            }
        }
    }

    /// The peer stayed away past the timeout: fail what waits and what comes.
    fn go_down(&mut self) {
        warn!(device = %self.dev.spec, qid = self.qid.unwrap_or(0),
              timeout = ?self.dev.cfg.timeout, failing = self.waiting.len(),
              "remote device: peer unreachable past the timeout, failing I/O");
        self.fail_fast = true;
        // Only a revival after this moment brings the queue back early.
        self.revivals_seen = self.dev.revivals();
        for (_, tag) in self.waiting.drain(..) {
            self.done.push((tag, -libc::ENOTCONN));
        }
    }

    /// Whether the device was revived since this queue went down; if so, stop failing
    /// fast and hold I/O for a fresh connection under a fresh timeout (`pump` connects,
    /// or the connect already under way answers).
    fn revived(&mut self, io: &mut CoreIo) -> bool {
        let n = self.dev.revivals();
        if n == self.revivals_seen {
            return false;
        }
        self.revivals_seen = n;
        if self.fail_fast {
            self.fail_fast = false;
            self.backoff = FIRST_BACKOFF;
            self.down_since = Some(Instant::now());
            let hook = self.hook.expect("registered at the first submit");
            let t = io.tracked(Tag::NO_PARENT, 1, hook, ctx(EV_DEADLINE, self.gen));
            io.complete_after(self.dev.cfg.timeout, t, 0);
        }
        true
    }

    /// While failing fast, try to reconnect now and then (on new I/O).
    fn retry_if_due(&mut self, io: &mut CoreIo) {
        let due = self.last_attempt.is_none_or(|t| t.elapsed() >= MAX_BACKOFF);
        if self.sock.is_none() && !self.connecting && !self.draining && due {
            self.start_connect(io);
        }
    }
}

/// Whether the other end of `stream` runs on this host: a loopback address, or the very
/// address we connected from (a peer reached through one of our own interfaces).
fn peer_on_this_host(stream: &TcpStream) -> bool {
    match (stream.peer_addr(), stream.local_addr()) {
        (Ok(peer), Ok(local)) => peer.ip().is_loopback() || peer.ip() == local.ip(),
        _ => false,
    }
}
