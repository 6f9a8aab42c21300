//! A blocking NVMe/TCP host for tools and tests: discovery, controller setup (admin queue
//! plus I/O queues), Identify, and one-command-at-a-time I/O. The pipelined load
//! generator (`tessera nvmf perf`) takes the connected sockets of [`Queue`] and drives
//! them itself.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use tessera_io::cast::{u32_of, usize_of};

use crate::auth::{self, HostAuth, HostAuthError, Secret};
use crate::nvme::{self, *};
use crate::pdu::{self, Fatal, Framing, Limits, Role};

#[derive(Debug)]
pub enum Error {
    Io(io::Error),
    /// The command completed with this NVMe status.
    Status(Status, Cqe),
    /// The controller sent a termination request.
    Terminated {
        fes: u16,
        fei: u32,
    },
    /// The controller broke the protocol.
    Protocol(String),
    /// In-band authentication failed (or was required and no secret was given).
    Auth(String),
    /// The controller's ANA log does not parse (a protocol error, keeping why).
    AnaLog(crate::nvme::AnaLogError),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "{e}"),
            Error::Status(s, _) => write!(f, "command failed: {}", status_text(*s)),
            Error::Terminated { fes, fei } => write!(
                f,
                "the controller terminated the connection (FES {fes:#x}, FEI {fei:#x})"
            ),
            Error::Protocol(m) => write!(f, "protocol error: {m}"),
            Error::Auth(m) => write!(f, "{m}"),
            Error::AnaLog(e) => write!(f, "protocol error: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(e) => Some(e),
            Error::AnaLog(e) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Error {
        Error::Io(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Connection options.
#[derive(Clone, Debug)]
pub struct Options {
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub hdgst: bool,
    pub ddgst: bool,
    /// Keep-alive timeout asked for at Connect (0 = none).
    pub kato_ms: u32,
    /// Entries per I/O queue.
    pub queue_size: u16,
    /// Ask the controller to skip SQ head reporting (allows C2HData SUCCESS).
    pub disable_sq_flow: bool,
    pub timeout: Duration,
    /// DH-HMAC-CHAP secret of this host, used when a Connect asks for authentication.
    pub dhchap_secret: Option<Secret>,
    /// The controller's secret: when set, the host also authenticates the controller
    /// (bidirectional) and refuses one that cannot prove it holds this secret.
    pub dhchap_ctrl_secret: Option<Secret>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            hostnqn: default_hostnqn(),
            hostid: [0x54; 16],
            hdgst: false,
            ddgst: false,
            kato_ms: 0,
            queue_size: 128,
            disable_sq_flow: true,
            timeout: Duration::from_secs(30),
            dhchap_secret: None,
            dhchap_ctrl_secret: None,
        }
    }
}

/// The host NQN tools use when none is given: stable per machine when
/// /etc/nvme/hostnqn exists, else a fixed Tessera one.
pub fn default_hostnqn() -> String {
    std::fs::read_to_string("/etc/nvme/hostnqn")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "nqn.2024-01.io.tessera:host:default".into())
}

/// One queue connection (after ICReq/ICResp).
pub struct Queue {
    pub stream: TcpStream,
    pub framing: Framing,
    pub limits: Limits,
    pub maxh2cdata: u32,
    pub qid: u16,
    next_cid: u16,
}

impl Queue {
    /// Connect TCP and exchange ICReq/ICResp.
    pub fn open(addr: &str, o: &Options) -> Result<Queue> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(o.timeout))?;
        stream.set_write_timeout(Some(o.timeout))?;
        let digest = (if o.hdgst { pdu::DIGEST_HDR } else { 0 })
            | (if o.ddgst { pdu::DIGEST_DATA } else { 0 });
        (&stream).write_all(&pdu::encode_icreq(&pdu::IcReq {
            pfv: 0,
            hpda: 0,
            digest,
            maxr2t: 0,
        }))?;
        let mut b = [0u8; pdu::IC_LEN];
        (&stream).read_exact(&mut b[..pdu::CH_LEN])?;
        if b[0] == pdu::C2H_TERM {
            let mut rest = [0u8; pdu::TERM_HLEN - pdu::CH_LEN];
            (&stream).read_exact(&mut rest)?;
            b[8..24].copy_from_slice(&rest);
            let (fes, fei) = pdu::parse_term(&b);
            return Err(Error::Terminated { fes, fei });
        }
        (&stream).read_exact(&mut b[pdu::CH_LEN..])?;
        let r = pdu::parse_icresp(&b).map_err(|f| Error::Protocol(format!("ICResp: {f}")))?;
        let hd = r.digest & pdu::DIGEST_HDR != 0;
        let dd = r.digest & pdu::DIGEST_DATA != 0;
        Ok(Queue {
            stream,
            framing: Framing {
                hdgst: hd,
                ddgst: dd,
                align: 4 * (r.cpda as usize + 1),
            },
            limits: Limits {
                hdgst: hd,
                ddgst: dd,
                max_data: 16 << 20,
            },
            maxh2cdata: r.maxh2cdata,
            qid: 0,
            next_cid: 0,
        })
    }

    pub fn next_cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Send a command capsule with optional in-capsule data.
    pub fn send_capsule(&mut self, sqe: &Sqe, data: &[u8]) -> Result<()> {
        let mut h = [0u8; 256];
        let n = self.framing.capsule_cmd(&mut h, &sqe.encode(), data.len());
        let mut out = Vec::with_capacity(n + data.len() + 4);
        out.extend_from_slice(&h[..n]);
        out.extend_from_slice(data);
        if self.framing.ddgst && !data.is_empty() {
            out.extend_from_slice(&pdu::crc(data).to_le_bytes());
        }
        self.stream.write_all(&out)?;
        Ok(())
    }

    /// Read one whole PDU; a termination request becomes an error.
    pub fn recv_pdu(&mut self) -> Result<(pdu::Frame, Vec<u8>)> {
        let mut ch = [0u8; pdu::CH_LEN];
        self.stream.read_exact(&mut ch)?;
        let f = pdu::check_header(Role::Host, &ch, &self.limits)
            .map_err(|e: Fatal| Error::Protocol(format!("bad PDU from the controller: {e}")))?;
        let mut b = vec![0u8; f.plen()];
        b[..pdu::CH_LEN].copy_from_slice(&ch);
        self.stream.read_exact(&mut b[pdu::CH_LEN..])?;
        if f.ch.ty == pdu::C2H_TERM {
            let (fes, fei) = pdu::parse_term(&b);
            return Err(Error::Terminated { fes, fei });
        }
        pdu::check_hdgst(&f, &b).map_err(|e| Error::Protocol(format!("{e}")))?;
        if !pdu::ddgst_ok(&f, &b) {
            return Err(Error::Protocol("data digest mismatch".into()));
        }
        Ok((f, b))
    }

    /// Run one command to completion: send it with `data_out` (in capsule when it fits,
    /// else through R2T/H2CData), collect up to `data_in` bytes of C2HData.
    pub fn exec(
        &mut self,
        mut sqe: Sqe,
        data_out: &[u8],
        data_in: usize,
    ) -> Result<(Cqe, Vec<u8>)> {
        sqe.cid = self.next_cid();
        let in_capsule = !data_out.is_empty() && data_out.len() <= crate::target::IN_CAPSULE;
        if !data_out.is_empty() {
            let kind = if in_capsule {
                SGL_DATA_BLOCK_OFFSET
            } else {
                SGL_TRANSPORT_DATA_BLOCK
            };
            sqe = sqe.with_sgl(kind, u32_of(data_out.len()));
        } else if data_in > 0 {
            sqe = sqe.with_sgl(SGL_TRANSPORT_DATA_BLOCK, u32_of(data_in));
        } else {
            sqe = sqe.with_sgl(SGL_TRANSPORT_DATA_BLOCK, 0);
        }
        self.send_capsule(&sqe, if in_capsule { data_out } else { &[] })?;
        let mut got = vec![0u8; data_in];
        // Bytes of `got` the C2HData PDUs filled: in order, each once. A read must get
        // all of them before it succeeds (else part of its data would be our zeros, not
        // the target's); an admin command may answer with less than the room it was
        // given (an authentication message).
        let mut filled = 0usize;
        let whole = self.qid != 0 && sqe.opc == IO_READ;
        let short = |filled: usize| {
            Error::Protocol(format!(
                "the read succeeded with {filled} of its {data_in} bytes of data"
            ))
        };
        loop {
            let (f, b) = self.recv_pdu()?;
            match f.ch.ty {
                pdu::CAPSULE_RESP => {
                    let cqe = Cqe::parse(&b[8..24]);
                    if cqe.cid != sqe.cid {
                        return Err(Error::Protocol(format!(
                            "response for command {} while waiting for {}",
                            cqe.cid, sqe.cid
                        )));
                    }
                    if cqe.status & 0x7FF != 0 {
                        return Err(Error::Status(cqe.status, cqe));
                    }
                    if whole && filled != data_in {
                        return Err(short(filled));
                    }
                    return Ok((cqe, got));
                }
                pdu::C2H_DATA => {
                    let off = pdu::le32(&b, 12) as usize;
                    let len = pdu::le32(&b, 16) as usize;
                    let end = off.checked_add(len).filter(|&e| e <= got.len());
                    let Some(end) = end.filter(|_| off == filled && len == f.data_len) else {
                        return Err(Error::Protocol(format!(
                            "C2HData {off}+{len} for {data_in} bytes, {filled} received"
                        )));
                    };
                    got[off..end].copy_from_slice(&b[f.data_off..f.data_off + len]);
                    filled = end;
                    if f.ch.flags & pdu::F_DATA_SUCCESS != 0 {
                        if whole && filled != data_in {
                            return Err(short(filled));
                        }
                        let cqe = Cqe {
                            cid: sqe.cid,
                            sqid: self.qid,
                            ..Cqe::default()
                        };
                        return Ok((cqe, got));
                    }
                }
                pdu::R2T => {
                    let ttag = pdu::le16(&b, 10);
                    let off = pdu::le32(&b, 12) as usize;
                    let len = pdu::le32(&b, 16) as usize;
                    if off + len > data_out.len() {
                        return Err(Error::Protocol("R2T beyond the data".into()));
                    }
                    let mut at = off;
                    while at < off + len {
                        let n = (off + len - at).min(self.maxh2cdata as usize);
                        let last = at + n == off + len;
                        self.send_h2c(sqe.cid, ttag, u32_of(at), &data_out[at..at + n], last)?;
                        at += n;
                    }
                }
                t => return Err(Error::Protocol(format!("unexpected PDU type {t:#x}"))),
            }
        }
    }

    pub fn send_h2c(
        &mut self,
        cid: u16,
        ttag: u16,
        offset: u32,
        data: &[u8],
        last: bool,
    ) -> Result<()> {
        let mut h = [0u8; 256];
        let flags = if last { pdu::F_DATA_LAST } else { 0 };
        let n = self.framing.data_pdu(
            &mut h,
            pdu::H2C_DATA,
            flags,
            cid,
            ttag,
            offset,
            u32_of(data.len()),
        );
        let mut out = Vec::with_capacity(n + data.len() + 4);
        out.extend_from_slice(&h[..n]);
        out.extend_from_slice(data);
        if self.framing.ddgst {
            out.extend_from_slice(&pdu::crc(data).to_le_bytes());
        }
        self.stream.write_all(&out)?;
        Ok(())
    }

    /// Fabrics Connect; returns the controller ID.
    pub fn connect(
        &mut self,
        qid: u16,
        subnqn: &str,
        cntlid: u16,
        o: &Options,
        sqsize: u16,
    ) -> Result<u16> {
        let c = ConnectCmd {
            recfmt: 0,
            qid,
            sqsize: sqsize - 1,
            cattr: if o.disable_sq_flow {
                CATTR_DISABLE_SQ_FLOW
            } else {
                0
            },
            kato: if qid == 0 { o.kato_ms } else { 0 },
        };
        let data = ConnectData {
            hostid: o.hostid,
            cntlid,
            subnqn: subnqn.to_string(),
            hostnqn: o.hostnqn.clone(),
        }
        .encode();
        let (cqe, _) = self.exec(c.sqe(0), &data, 0)?;
        self.qid = qid;
        if cqe.dw0 & auth::CONNECT_AUTHREQ_ATR != 0 {
            self.authenticate(subnqn, o)?;
        }
        Ok(low16(cqe.dw0))
    }

    /// Run a DH-HMAC-CHAP transaction on this queue (after Connect asked for one).
    pub fn authenticate(&mut self, subnqn: &str, o: &Options) -> Result<()> {
        let Some(secret) = o.dhchap_secret.clone() else {
            return Err(Error::Auth(format!(
                "subsystem {subnqn} requires this host to authenticate (DH-HMAC-CHAP) and no \
                 host secret was given (--dhchap-secret)"
            )));
        };
        let mut h = HostAuth::new(secret, o.dhchap_ctrl_secret.clone(), &o.hostnqn, subnqn);
        let tid = self.next_cid();
        self.auth_send(&h.negotiate(tid))?;
        let challenge = self.auth_receive()?;
        let reply = match h.reply(&challenge) {
            Ok(r) => r,
            Err(e) => return self.auth_failed(e),
        };
        self.auth_send(&reply)?;
        let success1 = self.auth_receive()?;
        match h.success1(&success1) {
            Ok(Some(success2)) => self.auth_send(&success2),
            Ok(None) => Ok(()),
            Err(e) => self.auth_failed(e),
        }
    }

    fn auth_failed(&mut self, e: HostAuthError) -> Result<()> {
        if let HostAuthError::Rejected {
            failure2: Some(f), ..
        } = &e
        {
            // Tell the controller why we end the transaction; the error that matters is ours.
            let _ = self.auth_send(f);
        }
        Err(Error::Auth(e.to_string()))
    }

    /// Authentication Send of one DH-HMAC-CHAP message.
    pub fn auth_send(&mut self, msg: &[u8]) -> Result<()> {
        let sqe = Sqe {
            opc: FABRICS,
            nsid: FCTYPE_AUTH_SEND as u32,
            cdw10: auth::auth_cdw10(),
            cdw11: u32_of(msg.len()),
            ..Sqe::default()
        };
        self.exec(sqe, msg, 0).map(|_| ())
    }

    /// Authentication Receive: the controller's next DH-HMAC-CHAP message.
    pub fn auth_receive(&mut self) -> Result<Vec<u8>> {
        let sqe = Sqe {
            opc: FABRICS,
            nsid: FCTYPE_AUTH_RECV as u32,
            cdw10: auth::auth_cdw10(),
            cdw11: u32_of(auth::MAX_MESSAGE),
            ..Sqe::default()
        };
        self.exec(sqe, &[], auth::MAX_MESSAGE).map(|(_, d)| d)
    }
}

/// A controller: its admin queue and I/O queues.
pub struct Controller {
    pub admin: Queue,
    pub io: Vec<Queue>,
    pub cntlid: u16,
    pub subnqn: String,
    pub addr: String,
    pub opts: Options,
}

impl Controller {
    /// Connect the admin queue, enable the controller, and connect `io_queues` I/O queues.
    pub fn connect(addr: &str, subnqn: &str, o: &Options, io_queues: u16) -> Result<Controller> {
        let mut admin = Queue::open(addr, o)?;
        let cntlid = admin.connect(0, subnqn, 0xFFFF, o, 32)?;
        let mut c = Controller {
            admin,
            io: Vec::new(),
            cntlid,
            subnqn: subnqn.to_string(),
            addr: addr.to_string(),
            opts: o.clone(),
        };
        c.property_set(PROP_CC, CC_EN | 6 << 16 | 4 << 20)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while c.property_get(PROP_CSTS)? & CSTS_RDY as u64 == 0 {
            if std::time::Instant::now() > deadline {
                return Err(Error::Protocol("controller did not become ready".into()));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if io_queues > 0 {
            let n = io_queues as u32 - 1;
            let (cqe, _) = c.admin_cmd(
                Sqe {
                    opc: ADM_SET_FEATURES,
                    cdw10: FEAT_NUM_QUEUES as u32,
                    cdw11: n | n << 16,
                    ..Sqe::default()
                },
                0,
            )?;
            let granted = (cqe.dw0 & 0xFFFF) + 1;
            for qid in 1..=io_queues.min(u16::try_from(granted).unwrap_or(u16::MAX)) {
                c.add_io_queue(qid)?;
            }
        }
        Ok(c)
    }

    pub fn add_io_queue(&mut self, qid: u16) -> Result<()> {
        let mut q = Queue::open(&self.addr, &self.opts)?;
        q.connect(
            qid,
            &self.subnqn,
            self.cntlid,
            &self.opts,
            self.opts.queue_size,
        )?;
        self.io.push(q);
        Ok(())
    }

    pub fn admin_cmd(&mut self, sqe: Sqe, data_in: usize) -> Result<(Cqe, Vec<u8>)> {
        self.admin.exec(sqe, &[], data_in)
    }

    pub fn property_get(&mut self, offset: u32) -> Result<u64> {
        let eight = offset == PROP_CAP;
        let sqe = Sqe {
            opc: FABRICS,
            nsid: FCTYPE_PROPERTY_GET as u32,
            cdw10: eight as u32,
            cdw11: offset,
            ..Sqe::default()
        };
        let (cqe, _) = self.admin_cmd(sqe, 0)?;
        Ok(cqe.dw0 as u64 | (cqe.dw1 as u64) << 32)
    }

    pub fn property_set(&mut self, offset: u32, value: u32) -> Result<()> {
        let sqe = Sqe {
            opc: FABRICS,
            nsid: FCTYPE_PROPERTY_SET as u32,
            cdw11: offset,
            cdw12: value,
            ..Sqe::default()
        };
        self.admin_cmd(sqe, 0).map(|_| ())
    }

    pub fn identify(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>> {
        let sqe = Sqe {
            opc: ADM_IDENTIFY,
            nsid,
            cdw10: cns as u32,
            ..Sqe::default()
        };
        self.admin_cmd(sqe, IDENTIFY_LEN).map(|(_, d)| d)
    }

    pub fn get_log_page(&mut self, lid: u8, nsid: u32, len: usize) -> Result<Vec<u8>> {
        let numd = u32_of(len / 4 - 1);
        let sqe = Sqe {
            opc: ADM_GET_LOG_PAGE,
            nsid,
            cdw10: lid as u32 | (numd & 0xFFFF) << 16,
            cdw11: numd >> 16,
            ..Sqe::default()
        };
        self.admin_cmd(sqe, len).map(|(_, d)| d)
    }

    /// The ANA log page (change count, group descriptors); with `groups_only`, without
    /// the NSID lists (RGO). Read in one command sized for a first 4 KiB look.
    pub fn ana_log(&mut self, groups_only: bool) -> Result<(u64, Vec<AnaGroupDesc>)> {
        let mut len = 4096;
        loop {
            let numd = u32_of(len / 4 - 1);
            let rgo = if groups_only { ANA_LSP_RGO } else { 0 };
            let sqe = Sqe {
                opc: ADM_GET_LOG_PAGE,
                cdw10: u32::from(LID_ANA) | u32::from(rgo) << 8 | (numd & 0xFFFF) << 16,
                cdw11: numd >> 16,
                ..Sqe::default()
            };
            let (_, b) = self.admin_cmd(sqe, len)?;
            // Everything the header announces must fit; a larger log is read again whole.
            let groups = usize::from(pdu::le16(&b, 8));
            let ids = if groups_only { 0 } else { 1024 };
            let worst = 16 + groups * 32 + groups * 4 * ids;
            match parse_ana_log(&b) {
                Ok(r) => return Ok(r),
                Err(_) if len < worst.min(1 << 20) => len = worst.min(1 << 20).next_multiple_of(4),
                Err(e) => return Err(Error::AnaLog(e)),
            }
        }
    }

    /// Whether the controller reports Asymmetric Namespace Access (Identify CMIC bit 3).
    pub fn reports_ana(&mut self) -> Result<bool> {
        Ok(self.identify(CNS_CONTROLLER, 0)?[76] & (1 << 3) != 0)
    }

    /// The ANA state of namespace `nsid` through this controller; None when the
    /// controller does not report ANA (every namespace is then reachable through it).
    pub fn ana_state(&mut self, nsid: u32) -> Result<Option<AnaState>> {
        if !self.reports_ana()? {
            return Ok(None);
        }
        let (_, groups) = self.ana_log(false)?;
        groups
            .iter()
            .find(|g| g.nsids.contains(&nsid))
            .map(|g| Some(g.state))
            .ok_or_else(|| {
                Error::Protocol(format!("namespace {nsid} is in no ANA group of the log"))
            })
    }

    pub fn keep_alive(&mut self) -> Result<()> {
        let sqe = Sqe {
            opc: ADM_KEEP_ALIVE,
            ..Sqe::default()
        };
        self.admin_cmd(sqe, 0).map(|_| ())
    }

    /// Active namespace IDs.
    pub fn namespaces(&mut self) -> Result<Vec<u32>> {
        let b = self.identify(CNS_ACTIVE_NS_LIST, 0)?;
        Ok((0..1024)
            .map(|i| pdu::le32(&b, 4 * i))
            .take_while(|&n| n != 0)
            .collect())
    }

    /// (blocks, LBA size) of a namespace.
    pub fn namespace_size(&mut self, nsid: u32) -> Result<(u64, u32)> {
        let b = self.identify(CNS_NAMESPACE, nsid)?;
        let flbas = (b[26] & 0xF) as usize;
        let lbads = b[128 + 4 * flbas + 2];
        Ok((pdu::le64(&b, 0), 1u32 << lbads))
    }

    fn q(&mut self, queue: usize) -> Result<&mut Queue> {
        let n = self.io.len();
        self.io
            .get_mut(queue)
            .ok_or_else(|| Error::Protocol(format!("no I/O queue {queue} (have {n})")))
    }

    fn rw(opc: u8, nsid: u32, slba: u64, nlb: u32) -> Sqe {
        Sqe {
            opc,
            nsid,
            cdw10: split64(slba).0,
            cdw11: split64(slba).1,
            cdw12: nlb - 1,
            ..Sqe::default()
        }
    }

    pub fn read(
        &mut self,
        queue: usize,
        nsid: u32,
        slba: u64,
        nlb: u32,
        lba: u32,
    ) -> Result<Vec<u8>> {
        let sqe = Self::rw(IO_READ, nsid, slba, nlb);
        self.q(queue)?
            .exec(sqe, &[], (nlb * lba) as usize)
            .map(|(_, d)| d)
    }

    pub fn write(
        &mut self,
        queue: usize,
        nsid: u32,
        slba: u64,
        data: &[u8],
        lba: u32,
    ) -> Result<()> {
        let sqe = Self::rw(IO_WRITE, nsid, slba, u32_of(data.len() / lba as usize));
        self.q(queue)?.exec(sqe, data, 0).map(|_| ())
    }

    pub fn compare(
        &mut self,
        queue: usize,
        nsid: u32,
        slba: u64,
        data: &[u8],
        lba: u32,
    ) -> Result<()> {
        let sqe = Self::rw(IO_COMPARE, nsid, slba, u32_of(data.len() / lba as usize));
        self.q(queue)?.exec(sqe, data, 0).map(|_| ())
    }

    pub fn flush(&mut self, queue: usize, nsid: u32) -> Result<()> {
        let sqe = Sqe {
            opc: IO_FLUSH,
            nsid,
            ..Sqe::default()
        };
        self.q(queue)?.exec(sqe, &[], 0).map(|_| ())
    }

    pub fn write_zeroes(
        &mut self,
        queue: usize,
        nsid: u32,
        slba: u64,
        nlb: u32,
        deallocate: bool,
    ) -> Result<()> {
        let mut sqe = Self::rw(IO_WRITE_ZEROES, nsid, slba, nlb);
        if deallocate {
            sqe.cdw12 |= 1 << 25;
        }
        self.q(queue)?.exec(sqe, &[], 0).map(|_| ())
    }

    pub fn deallocate(&mut self, queue: usize, nsid: u32, ranges: &[(u64, u32)]) -> Result<()> {
        let mut data = Vec::with_capacity(16 * ranges.len());
        for &(slba, nlb) in ranges {
            data.extend_from_slice(&encode_dsm_range(slba, nlb));
        }
        let sqe = Sqe {
            opc: IO_DSM,
            nsid,
            cdw10: u32_of(ranges.len()) - 1,
            cdw11: 1 << 2,
            ..Sqe::default()
        };
        self.q(queue)?.exec(sqe, &data, 0).map(|_| ())
    }

    /// Orderly goodbye: shut the controller down, then close every queue.
    pub fn disconnect(mut self) {
        let _ = self.property_set(PROP_CC, CC_EN | 1 << 14);
        for q in &self.io {
            let _ = q.stream.shutdown(std::net::Shutdown::Both);
        }
        let _ = self.admin.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Ask the discovery controller at `addr` which subsystems this host may reach.
pub fn discover(addr: &str, o: &Options) -> Result<Vec<DiscoveryEntry>> {
    let mut c = Controller::connect(addr, crate::target::DISCOVERY_NQN, o, 0)?;
    let head = c.get_log_page(LID_DISCOVERY, 0, 1024)?;
    let n = usize_of(pdu::le64(&head, 8));
    let full = c.get_log_page(LID_DISCOVERY, 0, 1024 * (n + 1))?;
    c.disconnect();
    Ok(nvme::parse_discovery_log(&full).1)
}
