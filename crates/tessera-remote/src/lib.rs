//! A remote NVMe/TCP namespace as a Tessera block device.
//!
//! [`RemoteDevice`] implements [`BlockDevice`] for a namespace exported by another node
//! (or any NVMe/TCP target), named `nvme-tcp://HOST:PORT/SUBNQN?nsid=N` (see
//! [`RemoteSpec::parse`]). The datapath is Tessera's own initiator running inside the
//! reactors: every per-core [`IoHandle`] owns one NVMe/TCP I/O queue to the peer, driven
//! by io_uring socket operations on that core's ring ([`link`]). Setup work that blocks
//! (the admin queue, Identify, and each queue's TCP connect + ICReq + Fabrics Connect)
//! runs off the reactors, in the opening thread or a short-lived connect thread.
//!
//! Multipath: `nvme-tcp://H1:P1,H2:P2/SUBNQN?nsid=N` names several paths to one
//! subsystem (a cluster volume exported by every node). The device uses the path where the
//! namespace's ANA state is Optimized (read from each path's ANA log at open and whenever
//! the admin controller is set up again), and a command answered with a path related
//! status (ANA inaccessible, persistent loss, transition) is not failed: its queue drops the
//! connection and resubmits everything outstanding once a path serves the namespace again,
//! under the same reconnect backoff and timeout as a broken connection.
//!
//! Delivery semantics (what the mirror layer above relies on):
//! - A broken connection is re-established with bounded backoff and every command in
//!   flight on it is sent again on the new connection. NVMe command ids are the only
//!   sequencing: there is no second sequence or flow-control layer on top of TCP.
//! - A resubmitted write may be applied twice (once before the break, once after). A block
//!   write at a fixed LBA is idempotent, and with a single writer per namespace (the
//!   volume's owner) no other write to the same blocks can be ordered between the two
//!   applications: anything overlapping that the owner issues later is only submitted
//!   after this one completed, so it lands after the second application too.
//! - When the peer stays unreachable longer than [`RemoteConfig::timeout`], every I/O in
//!   flight or waiting completes with `-ENOTCONN`, and new I/Os fail at once (`-ENOTCONN`)
//!   until a reconnect, attempted again on new I/O at most once per backoff period,
//!   succeeds, or until the owner of the device calls [`RemoteDevice::revive`] after
//!   seeing the peer answer (the queues then hold new I/O for a fresh connection). The
//!   layer above marks the replica out of sync.
//! - A write the peer acknowledged is durable only once a later flush completed: a peer
//!   that restarts (killed, crashed) forgets what it had not made durable, and the
//!   connection breaking is all the initiator sees of it. Every connection lost (on any
//!   queue) is counted ([`RemoteDevice::breaks`]), so the layer above can treat what it
//!   wrote since the last completed flush as possibly lost, even when the reconnect and
//!   the resubmission hid the outage from every I/O.
//!
//! Flow control (seed 001): each queue keeps at most a congestion window of commands
//! outstanding, adapted to the round-trip times it measures ([`congestion`]); the rest
//! wait in the queue, in order, and leave as completions open the window. A slow or
//! distant peer thus holds a few commands instead of the whole queue depth, and a fast
//! one gets the whole depth. This bounds commands, not bytes: TCP still paces the bytes.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tessera_io::sync::MutexExt;

use tessera_device::{BlockDevice, IoHandle};
use tessera_nvmf::initiator::{Controller, Error as NvmfError, Options, Queue};
use tessera_nvmf::nvme::{self, AnaState, Sqe};
use tessera_nvmf::pdu;
use tracing::{info, warn};

pub mod congestion;
mod error;
pub mod link;

pub use congestion::CongestionConfig;
pub use error::{CongestionError, ConnectError, LinkError, RemoteError};
pub use link::{LinkStats, RemoteHandle};

/// The URL scheme of a remote namespace.
pub const SCHEME: &str = "nvme-tcp://";

/// Where a remote namespace lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteSpec {
    /// `HOST:PORT` of the NVMe/TCP I/O listener (the first path).
    pub addr: String,
    /// Further paths to the same subsystem (`HOST:PORT` of other nodes' listeners). With
    /// any, the device is multipath: it uses the path where the namespace's ANA state is
    /// Optimized and moves when that changes.
    pub alternates: Vec<String>,
    pub subnqn: String,
    pub nsid: u32,
}

impl RemoteSpec {
    /// A spec for one path.
    pub fn single(addr: &str, subnqn: &str, nsid: u32) -> RemoteSpec {
        RemoteSpec {
            addr: addr.to_string(),
            alternates: Vec::new(),
            subnqn: subnqn.to_string(),
            nsid,
        }
    }

    /// Every path, the first one first.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.addr.as_str()).chain(self.alternates.iter().map(String::as_str))
    }

    pub fn path_count(&self) -> usize {
        1 + self.alternates.len()
    }

    /// Path `i` (0: `addr`); out of range reads as the first.
    pub fn path(&self, i: usize) -> &str {
        i.checked_sub(1)
            .and_then(|k| self.alternates.get(k))
            .map_or(self.addr.as_str(), String::as_str)
    }

    /// Several paths: ANA decides which one carries I/O.
    pub fn multipath(&self) -> bool {
        !self.alternates.is_empty()
    }

    /// Parse `nvme-tcp://HOST:PORT[,HOST:PORT...]/SUBNQN[?nsid=N]` (nsid defaults to 1;
    /// several addresses are paths to the same subsystem).
    pub fn parse(s: &str) -> io::Result<RemoteSpec> {
        let bad = |why: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "bad remote device '{s}': {why} (expected \
                     {SCHEME}HOST:PORT[,HOST:PORT...]/SUBNQN?nsid=N)"
                ),
            )
        };
        let rest = s
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad("no nvme-tcp:// prefix"))?;
        let (addrs, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no subsystem NQN"))?;
        let mut paths = Vec::new();
        for addr in addrs.split(',') {
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("no port"))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("each address must be HOST:PORT"));
            }
            if paths.iter().any(|p| p == addr) {
                return Err(bad(&format!("address {addr} is given twice")));
            }
            paths.push(addr.to_string());
        }
        let addr = paths.remove(0);
        let (subnqn, query) = match path.split_once('?') {
            Some((n, q)) => (n, Some(q)),
            None => (path, None),
        };
        if subnqn.is_empty() || subnqn.len() > 223 {
            return Err(bad("the subsystem NQN must be 1 to 223 bytes"));
        }
        let mut nsid = 1;
        if let Some(q) = query {
            for kv in q.split('&') {
                match kv.split_once('=') {
                    Some(("nsid", v)) => {
                        nsid = v
                            .parse::<u32>()
                            .ok()
                            .filter(|&n| n != 0 && n != u32::MAX)
                            .ok_or_else(|| bad("nsid must be a namespace ID from 1"))?;
                    }
                    _ => return Err(bad(&format!("unknown parameter '{kv}'"))),
                }
            }
        }
        Ok(RemoteSpec {
            addr,
            alternates: paths,
            subnqn: subnqn.to_string(),
            nsid,
        })
    }
}

impl std::fmt::Display for RemoteSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SCHEME}{}", self.addr)?;
        for a in &self.alternates {
            write!(f, ",{a}")?;
        }
        write!(f, "/{}?nsid={}", self.subnqn, self.nsid)
    }
}

/// How a remote device behaves when its peer goes away.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// How long a queue keeps trying to reconnect before failing its I/Os.
    pub timeout: Duration,
    /// Commands a per-core queue keeps outstanding at most (more wait in the handle);
    /// the congestion window moves below it.
    pub queue_depth: u16,
    /// The host NQN presented at Connect.
    pub hostnqn: String,
    /// How each queue adapts the commands it keeps outstanding to the RTT it measures
    /// (at most `queue_depth`).
    pub congestion: CongestionConfig,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            timeout: Duration::from_secs(5),
            queue_depth: 128,
            hostnqn: tessera_nvmf::initiator::default_hostnqn(),
            congestion: CongestionConfig::default(),
        }
    }
}

/// The I/O queue the synchronous face uses; the per-core handles use the others.
const SYNC_QID: u16 = 1;
/// I/O queues asked for at setup.
const WANT_IO_QUEUES: u16 = 64;

/// The admin side of the connection, shared by the per-core queues' (re)connects.
struct Admin {
    ctrl: Option<Controller>,
    /// I/O queues the controller granted.
    granted: u16,
    /// The path (index into the spec's paths) `ctrl` is on: I/O queues connect there.
    path: usize,
}

/// A namespace of a remote NVMe/TCP subsystem.
pub struct RemoteDevice {
    spec: RemoteSpec,
    cfg: RemoteConfig,
    opts: Options,
    size: u64,
    lba: u32,
    /// Largest data one command carries (MDTS).
    max_transfer: u32,
    /// Largest write data sent inside the command capsule (IOCCSZ); larger writes wait
    /// for the target's R2T.
    in_capsule: u32,
    admin: Mutex<Admin>,
    /// I/O queue ids not used by a handle.
    free_qids: Mutex<Vec<u16>>,
    /// Bumped by [`RemoteDevice::revive`]: queues failing fast see it on their next I/O
    /// and reconnect, holding that I/O, instead of failing it at once.
    revivals: AtomicU64,
    /// Connections lost so far, on any queue ([`RemoteDevice::breaks`]).
    breaks: AtomicU64,
}

impl RemoteDevice {
    /// Connect to `spec` (a `nvme-tcp://` URL) with default settings.
    pub fn open(spec: &str) -> io::Result<Arc<RemoteDevice>> {
        Self::open_with(RemoteSpec::parse(spec)?, RemoteConfig::default())
    }

    /// Connect the admin queue, enable the controller and identify the namespace; this
    /// blocks, so it runs off the reactors. The I/O queues connect later, each on its core.
    pub fn open_with(spec: RemoteSpec, cfg: RemoteConfig) -> io::Result<Arc<RemoteDevice>> {
        if cfg.queue_depth < 2 || cfg.queue_depth > 1024 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "remote device queue depth must be between 2 and 1024",
            ));
        }
        if let Err(source) = cfg.congestion.ceiling(cfg.queue_depth) {
            return Err(RemoteError::Congestion {
                spec: spec.to_string(),
                source,
            }
            .into_io());
        }
        let opts = Options {
            hostnqn: cfg.hostnqn.clone(),
            queue_size: cfg.queue_depth,
            timeout: cfg.timeout.max(Duration::from_millis(100)),
            ..Options::default()
        };
        let (mut ctrl, granted, path) = open_path(&spec, &opts, 0)?;
        let ident = ctrl
            .identify(nvme::CNS_CONTROLLER, 0)
            .map_err(|e| nvmf_err(&spec, e))?;
        let (blocks, lba) = ctrl
            .namespace_size(spec.nsid)
            .map_err(|e| nvmf_err(&spec, e))?;
        if blocks == 0 || !lba.is_power_of_two() || lba < 512 {
            return Err(io::Error::other(format!(
                "{spec}: namespace {} is not usable (size {blocks} blocks of {lba} bytes)",
                spec.nsid
            )));
        }
        // MDTS is a power of two of the minimum page size (4 KiB for every target we
        // know); 0 means no limit, which we still cap so one command stays bounded.
        let mdts = ident[77];
        let max_transfer = if mdts == 0 || mdts > 8 {
            1 << 20
        } else {
            4096u32 << mdts
        };
        let ioccsz = pdu::le32(&ident, 1792) as usize * 16;
        let in_capsule = u32::try_from(ioccsz.saturating_sub(nvme::SQE_LEN))
            .unwrap_or(0)
            .min(max_transfer);
        let granted = granted.min(WANT_IO_QUEUES);
        if granted < 2 {
            return Err(io::Error::other(format!(
                "{spec}: the controller grants {granted} I/O queues; a remote device needs at least 2"
            )));
        }
        info!(device = %spec, path = spec.path(path), size = blocks * u64::from(lba), lba,
              max_transfer, in_capsule, io_queues = granted, "remote device connected");
        Ok(Arc::new(RemoteDevice {
            free_qids: Mutex::new((SYNC_QID + 1..=granted).rev().collect()),
            revivals: AtomicU64::new(0),
            breaks: AtomicU64::new(0),
            spec,
            cfg,
            opts,
            size: blocks * u64::from(lba),
            lba,
            max_transfer,
            in_capsule,
            admin: Mutex::new(Admin {
                ctrl: Some(ctrl),
                granted,
                path,
            }),
        }))
    }

    pub fn spec(&self) -> &RemoteSpec {
        &self.spec
    }

    pub fn config(&self) -> &RemoteConfig {
        &self.cfg
    }

    /// Open I/O queue `qid` on the current controller, setting a new controller up first
    /// when there is none or the current one refuses (the target restarted). Blocking:
    /// called from connect threads, never on a reactor.
    pub(crate) fn connect_io_queue(&self, qid: u16) -> Result<Queue, ConnectError> {
        let mut admin = self.admin.locked();
        let mut last = ConnectError::NoResult;
        for fresh in [false, true] {
            if fresh || admin.ctrl.is_none() || !self.path_usable(&mut admin) {
                admin.ctrl = None;
                self.reopen_admin(&mut admin)
                    .map_err(|source| ConnectError::Admin { source })?;
            }
            if qid > admin.granted {
                return Err(ConnectError::QueuesGranted {
                    granted: admin.granted,
                });
            }
            let cntlid = admin.ctrl.as_ref().map_or(0, |c| c.cntlid);
            let r = Queue::open(self.spec.path(admin.path), &self.opts).and_then(|mut q| {
                q.connect(
                    qid,
                    &self.spec.subnqn,
                    cntlid,
                    &self.opts,
                    self.cfg.queue_depth,
                )?;
                Ok(q)
            });
            match r {
                Ok(q) => return Ok(q),
                Err(source) => last = ConnectError::IoQueue { qid, source },
            }
        }
        Err(last)
    }

    /// Multipath: whether the admin controller's path still serves the namespace (its
    /// ANA state is Optimized or Non-Optimized, or it does not report ANA). Asked before
    /// I/O queues connect there, so a queue that broke because the namespace became
    /// inaccessible does not come back to the same path. Single path: always.
    fn path_usable(&self, admin: &mut Admin) -> bool {
        if !self.spec.multipath() {
            return true;
        }
        let Some(c) = admin.ctrl.as_mut() else {
            return false;
        };
        match c.ana_state(self.spec.nsid) {
            Ok(None) => true,
            Ok(Some(s)) => s.accessible(),
            Err(_) => false,
        }
    }

    /// Connect a new admin controller on the path to use (see [`open_path`]), starting
    /// with the current one.
    fn reopen_admin(&self, admin: &mut Admin) -> io::Result<()> {
        admin.ctrl = None;
        let (c, granted, path) = open_path(&self.spec, &self.opts, admin.path)?;
        if path != admin.path {
            info!(device = %self.spec, from = self.spec.path(admin.path),
                  to = self.spec.path(path), "remote device: moving to the optimized path");
        }
        admin.ctrl = Some(c);
        admin.granted = granted;
        admin.path = path;
        Ok(())
    }

    /// Run `f` on the synchronous face's I/O queue, reconnecting once when it fails for a
    /// transport reason. Multipath: a transport failure or a path related status (ANA)
    /// moves to the path that serves the namespace now, retrying with backoff within the
    /// timeout.
    fn with_sync_queue<T>(
        &self,
        mut f: impl FnMut(&mut Controller, usize) -> tessera_nvmf::initiator::Result<T>,
    ) -> io::Result<T> {
        let mut admin = self.admin.locked();
        let multipath = self.spec.multipath();
        let deadline = std::time::Instant::now() + self.cfg.timeout;
        let mut backoff = Duration::from_millis(20);
        let mut last = None;
        for attempt in 0.. {
            if attempt >= 2 {
                if !multipath || std::time::Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            if admin.ctrl.is_none() {
                if let Err(e) = self.reopen_admin(&mut admin) {
                    if !multipath {
                        return Err(e);
                    }
                    last = Some(NvmfError::Io(e));
                    continue;
                }
            }
            let ctrl = admin.ctrl.as_mut().expect("connected above");
            if ctrl.io.is_empty() {
                if let Err(e) = ctrl.add_io_queue(SYNC_QID) {
                    self.note_break();
                    admin.ctrl = None;
                    last = Some(e);
                    continue;
                }
            }
            match f(ctrl, 0) {
                Ok(v) => return Ok(v),
                Err(NvmfError::Status(s, c)) if multipath && nvme::is_path_error(s) => {
                    warn!(device = %self.spec, path = self.spec.path(admin.path),
                          status = %nvme::status_text(s),
                          "remote device: the path no longer serves the namespace");
                    self.note_break();
                    admin.ctrl = None;
                    last = Some(NvmfError::Status(s, c));
                }
                Err(NvmfError::Status(s, c)) => {
                    return Err(errno_error(status_to_errno(s), NvmfError::Status(s, c)))
                }
                Err(e) => {
                    warn!(device = %self.spec, error = %e, "remote device: synchronous I/O failed, reconnecting");
                    self.note_break();
                    admin.ctrl = None;
                    last = Some(e);
                }
            }
        }
        Err(nvmf_err(
            &self.spec,
            last.unwrap_or_else(|| NvmfError::Protocol("no connection".into())),
        ))
    }

    /// The aligned block range covering `[offset, offset+len)`.
    fn aligned(&self, offset: u64, len: u64) -> (u64, u64) {
        let lba = u64::from(self.lba);
        let start = offset / lba * lba;
        let end = (offset + len).div_ceil(lba) * lba;
        (start, end)
    }

    fn check(&self, what: &str, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{what}: range {offset}+{len} is beyond the device size {}",
                    self.size
                ),
            )),
        }
    }

    /// Read whole blocks `[start, end)` into `out`, in commands of at most MDTS.
    fn read_blocks(&self, start: u64, out: &mut [u8]) -> io::Result<()> {
        let lba = u64::from(self.lba);
        let mut done = 0usize;
        while done < out.len() {
            let n = (out.len() - done).min(self.max_transfer as usize);
            let slba = (start + done as u64) / lba;
            let nlb = u32::try_from(n as u64 / lba).expect("bounded by MDTS");
            let data =
                self.with_sync_queue(|c, q| c.read(q, self.spec.nsid, slba, nlb, self.lba))?;
            out[done..done + n].copy_from_slice(&data[..n]);
            done += n;
        }
        Ok(())
    }

    fn write_blocks(&self, start: u64, data: &[u8]) -> io::Result<()> {
        let lba = u64::from(self.lba);
        let mut done = 0usize;
        while done < data.len() {
            let n = (data.len() - done).min(self.max_transfer as usize);
            let slba = (start + done as u64) / lba;
            let chunk = &data[done..done + n];
            self.with_sync_queue(|c, q| c.write(q, self.spec.nsid, slba, chunk, self.lba))?;
            done += n;
        }
        Ok(())
    }
}

/// Connect and enable a controller at `addr`; returns it and the number of I/O queues
/// granted.
fn connect_admin(
    addr: &str,
    spec: &RemoteSpec,
    o: &Options,
) -> tessera_nvmf::initiator::Result<(Controller, u16)> {
    let mut c = Controller::connect(addr, &spec.subnqn, o, 0)?;
    let n = u32::from(WANT_IO_QUEUES - 1);
    let (cqe, _) = c.admin_cmd(
        Sqe {
            opc: nvme::ADM_SET_FEATURES,
            cdw10: u32::from(nvme::FEAT_NUM_QUEUES),
            cdw11: n | n << 16,
            ..Sqe::default()
        },
        0,
    )?;
    let granted = u16::try_from((cqe.dw0 & 0xFFFF) + 1).unwrap_or(u16::MAX);
    Ok((c, granted))
}

/// Connect the admin queue of the path to use, with the I/O queues granted and the
/// path's index. One path: that one. Several: each is asked for the namespace's ANA state
/// (starting with path `first`); the first where it is Optimized wins (or that does not
/// report ANA), else the first Non-Optimized one; none is an error naming every path's
/// state, which the callers retry with backoff within the timeout (a new owner may be
/// taking over).
fn open_path(spec: &RemoteSpec, o: &Options, first: usize) -> io::Result<(Controller, u16, usize)> {
    if !spec.multipath() {
        let (c, granted) = connect_admin(&spec.addr, spec, o).map_err(|e| nvmf_err(spec, e))?;
        return Ok((c, granted, 0));
    }
    let n = spec.path_count();
    let mut fallback = None;
    let mut seen = Vec::with_capacity(n);
    for k in 0..n {
        let i = (first + k) % n;
        let addr = spec.path(i);
        let r = connect_admin(addr, spec, o).and_then(|(mut c, granted)| {
            let state = c.ana_state(spec.nsid)?;
            Ok((c, granted, state))
        });
        match r {
            Ok((c, granted, None | Some(AnaState::Optimized))) => return Ok((c, granted, i)),
            Ok((c, granted, Some(AnaState::NonOptimized))) => {
                seen.push(format!("{addr}: non-optimized"));
                if fallback.is_none() {
                    fallback = Some((c, granted, i));
                }
            }
            Ok((_, _, Some(state))) => seen.push(format!("{addr}: {}", state.name())),
            Err(e) => seen.push(format!("{addr}: {e}")),
        }
    }
    fallback.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotConnected,
            format!(
                "{spec}: no path serves namespace {} now ({})",
                spec.nsid,
                seen.join("; ")
            ),
        )
    })
}

/// `e` as the `io::Error` a device operation on `spec` fails with, keeping `e` (and so
/// the transport's own `io::Error`, or the NVMe status) as its cause.
fn nvmf_err(spec: &RemoteSpec, e: NvmfError) -> io::Error {
    RemoteError::Nvmf {
        spec: spec.to_string(),
        source: e,
    }
    .into_io()
}

/// A command's NVMe status as the `io::Error` of `errno`, keeping the status as its cause.
fn errno_error(errno: i32, e: NvmfError) -> io::Error {
    RemoteError::Status { errno, source: e }.into_io()
}

/// The negative errno an I/O completes with for NVMe status `s` (without the phase bit).
pub fn status_to_errno(s: nvme::Status) -> i32 {
    match s & 0x7FF {
        nvme::SC_SUCCESS => 0,
        nvme::SC_INVALID_FIELD | nvme::SC_LBA_RANGE | nvme::SC_INVALID_NS => libc::EINVAL,
        nvme::SC_INVALID_OPCODE => libc::EOPNOTSUPP,
        nvme::SC_NS_WRITE_PROTECTED => libc::EROFS,
        nvme::SC_CAP_EXCEEDED => libc::ENOSPC,
        nvme::SC_ABORT_REQ | nvme::SC_ABORT_SQ_DELETION => libc::ECANCELED,
        _ => libc::EIO,
    }
}

impl BlockDevice for RemoteDevice {
    fn describe(&self) -> String {
        self.spec.to_string()
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn alignment(&self) -> u32 {
        self.lba
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check("read", offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = self.aligned(offset, buf.len() as u64);
        if start == offset && end - start == buf.len() as u64 {
            return self.read_blocks(start, buf);
        }
        let mut bounce = vec![0u8; usize::try_from(end - start).expect("in memory")];
        self.read_blocks(start, &mut bounce)?;
        let at = usize::try_from(offset - start).expect("below one block");
        buf.copy_from_slice(&bounce[at..at + buf.len()]);
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.check("write", offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, end) = self.aligned(offset, buf.len() as u64);
        if start == offset && end - start == buf.len() as u64 {
            return self.write_blocks(start, buf);
        }
        // Read-modify-write of the partial blocks at either end.
        let mut bounce = vec![0u8; usize::try_from(end - start).expect("in memory")];
        self.read_blocks(start, &mut bounce)?;
        let at = usize::try_from(offset - start).expect("below one block");
        bounce[at..at + buf.len()].copy_from_slice(buf);
        self.write_blocks(start, &bounce)
    }

    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check("write zeroes", offset, len)?;
        let lba = u64::from(self.lba);
        let (start, end) = self.aligned(offset, len);
        if start != offset || end != offset + len {
            // Unaligned edges: write real zeroes there, whole blocks below.
            let zero = vec![0u8; usize::try_from(len.min(1 << 20)).expect("bounded")];
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(zero.len() as u64);
                self.write_at(at, &zero[..usize::try_from(n).expect("bounded")])?;
                at += n;
            }
            return Ok(());
        }
        let mut at = start;
        while at < end {
            let nlb = ((end - at) / lba).min(1 << 16);
            let nlb32 = u32::try_from(nlb).expect("at most 2^16");
            self.with_sync_queue(|c, q| c.write_zeroes(q, self.spec.nsid, at / lba, nlb32, false))?;
            at += nlb * lba;
        }
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.with_sync_queue(|c, q| c.flush(q, self.spec.nsid))
    }

    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        Box::new(link::RemoteHandle::open(&self))
    }
}

impl RemoteDevice {
    /// Size of one logical block of the namespace.
    pub fn block_size(&self) -> u32 {
        self.lba
    }

    /// The caller saw the peer answer again (e.g. a probe through the synchronous queue
    /// worked): every per-core queue that gave up on it (failing I/O fast after the
    /// timeout) reconnects on its next I/O and holds that I/O until it is connected or the
    /// timeout runs out, instead of failing it while its own retry backoff runs. Without
    /// this, the first writes after a peer's return would fail on the cores whose queues
    /// had not yet retried, and the replica would be dropped again.
    pub fn revive(&self) {
        self.revivals.fetch_add(1, Ordering::AcqRel);
    }

    /// Close the admin and synchronous queues now (the target then forgets the
    /// controller once the per-core queues, closed by dropping their handles, are gone),
    /// rather than when the last reference goes: the reactors' hooks of closed queues
    /// keep one. For a device its owner stops using (a replica removed or deleted); a
    /// later synchronous I/O would connect again.
    pub fn disconnect(&self) {
        self.admin.locked().ctrl = None;
    }

    /// How many connections to the peer were lost so far (on the per-core queues and the
    /// synchronous one; not those closed on purpose). A change means the peer may have
    /// restarted and lost the writes it acknowledged since its last completed flush,
    /// although the reconnect and the resubmission may have hidden that from every I/O.
    pub fn breaks(&self) -> u64 {
        self.breaks.load(Ordering::Acquire)
    }

    pub(crate) fn note_break(&self) {
        self.breaks.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn revivals(&self) -> u64 {
        self.revivals.load(Ordering::Acquire)
    }

    /// A handle gave its queue id back.
    pub(crate) fn release_qid(&self, qid: u16) {
        self.free_qids.locked().push(qid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print() {
        let s =
            RemoteSpec::parse("nvme-tcp://127.0.0.1:4420/nqn.2024-01.io.tessera:v?nsid=2").unwrap();
        assert_eq!(s.addr, "127.0.0.1:4420");
        assert_eq!(s.subnqn, "nqn.2024-01.io.tessera:v");
        assert_eq!(s.nsid, 2);
        assert_eq!(RemoteSpec::parse(&s.to_string()).unwrap(), s);
        let d = RemoteSpec::parse("nvme-tcp://host:1/nqn.x").unwrap();
        assert_eq!(d.nsid, 1);
        assert!(!d.multipath());
        let m = RemoteSpec::parse("nvme-tcp://10.0.0.1:4420,10.0.0.2:4421/nqn.c:v?nsid=1").unwrap();
        assert!(m.multipath());
        assert_eq!(
            m.paths().collect::<Vec<_>>(),
            vec!["10.0.0.1:4420", "10.0.0.2:4421"]
        );
        assert_eq!(
            (m.path(0), m.path(1), m.path_count()),
            ("10.0.0.1:4420", "10.0.0.2:4421", 2)
        );
        assert_eq!(RemoteSpec::parse(&m.to_string()).unwrap(), m);
        assert_eq!(
            RemoteSpec::single("h:1", "nqn.x", 1),
            RemoteSpec::parse("nvme-tcp://h:1/nqn.x").unwrap()
        );
        for bad in [
            "nvme-tcp://h:1,/n",
            "nvme-tcp://h:1,h:1/n",
            "nvme-tcp://h:1,h2/n",
            "tcp://h:1/n",
            "nvme-tcp://h/n",
            "nvme-tcp://h:x/n",
            "nvme-tcp://h:1/",
            "nvme-tcp://h:1/n?nsid=0",
            "nvme-tcp://h:1/n?foo=1",
            "nvme-tcp://:1/n",
        ] {
            assert!(RemoteSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_connect_failure_keeps_the_transport_error_as_its_cause() {
        let spec = RemoteSpec::parse("nvme-tcp://127.0.0.1:4420/nqn.x").unwrap();
        let refused = io::Error::from_raw_os_error(libc::ECONNREFUSED);
        let e = nvmf_err(&spec, NvmfError::Io(refused));
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused);
        assert!(e.to_string().starts_with(&format!("{spec}: ")), "{e}");
        let inner = e.get_ref().and_then(|r| r.downcast_ref::<RemoteError>());
        let Some(RemoteError::Nvmf {
            source: NvmfError::Io(io),
            ..
        }) = inner
        else {
            panic!("not a RemoteError::Nvmf over an io::Error: {e:?}");
        };
        assert_eq!(io.raw_os_error(), Some(libc::ECONNREFUSED));

        let q = ConnectError::Admin { source: e };
        let src = std::error::Error::source(&q).expect("a source");
        assert!(src.downcast_ref::<io::Error>().is_some(), "{src:?}");
    }

    #[test]
    fn nvme_statuses_map_to_errnos() {
        assert_eq!(status_to_errno(nvme::SC_SUCCESS), 0);
        assert_eq!(
            status_to_errno(nvme::SC_LBA_RANGE | nvme::DNR),
            libc::EINVAL
        );
        assert_eq!(
            status_to_errno(nvme::SC_CAP_EXCEEDED | nvme::DNR),
            libc::ENOSPC
        );
        assert_eq!(status_to_errno(nvme::SC_NS_WRITE_PROTECTED), libc::EROFS);
        assert_eq!(status_to_errno(nvme::SC_WRITE_FAULT), libc::EIO);
        assert_eq!(status_to_errno(nvme::SC_INVALID_OPCODE), libc::EOPNOTSUPP);
        // Every errno the target produces maps back to the same class.
        for e in [libc::ENOSPC, libc::EINVAL, libc::EROFS] {
            assert_eq!(status_to_errno(nvme::status_from_errno(e, true)), e);
        }
    }
}
