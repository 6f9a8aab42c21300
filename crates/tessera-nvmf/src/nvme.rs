//! NVMe structures carried in NVMe/TCP capsules (NVMe base 1.4, NVMe-oF 1.1; field
//! offsets as in Linux's `include/linux/nvme.h`): submission and completion queue
//! entries, status codes, SGL descriptors, Fabrics commands, Identify data, log pages and
//! features. Pure codecs: no I/O, no target state.

use tessera_io::cast::{u32_of, u8_of, usize_of};

use crate::pdu::{le16, le32, le64, put16, put32, put64};

/// Bits 7:0 of a command dword (a byte-wide field: CNS, log page id, feature id).
#[inline]
pub fn low8(dw: u32) -> u8 {
    dw.to_le_bytes()[0]
}

/// Bits 15:0 of a command dword (the first of two 16-bit fields packed in it).
#[inline]
pub fn low16(dw: u32) -> u16 {
    let [a, b, _, _] = dw.to_le_bytes();
    u16::from_le_bytes([a, b])
}

/// Bits 31:16 of a command dword.
#[inline]
pub fn high16(dw: u32) -> u16 {
    let [_, _, c, d] = dw.to_le_bytes();
    u16::from_le_bytes([c, d])
}

/// The low and high dwords of a 64-bit value (a property: DW0 and DW1 of a completion).
#[inline]
pub fn split64(v: u64) -> (u32, u32) {
    let [a, b, c, d, e, f, g, h] = v.to_le_bytes();
    (
        u32::from_le_bytes([a, b, c, d]),
        u32::from_le_bytes([e, f, g, h]),
    )
}

pub const SQE_LEN: usize = 64;
pub const CQE_LEN: usize = 16;

// Admin opcodes.
pub const ADM_GET_LOG_PAGE: u8 = 0x02;
pub const ADM_IDENTIFY: u8 = 0x06;
pub const ADM_ABORT: u8 = 0x08;
pub const ADM_SET_FEATURES: u8 = 0x09;
pub const ADM_GET_FEATURES: u8 = 0x0A;
pub const ADM_ASYNC_EVENT: u8 = 0x0C;
pub const ADM_KEEP_ALIVE: u8 = 0x18;
/// Fabrics commands (admin or I/O queue), told apart by FCTYPE.
pub const FABRICS: u8 = 0x7F;

// NVM I/O opcodes.
pub const IO_FLUSH: u8 = 0x00;
pub const IO_WRITE: u8 = 0x01;
pub const IO_READ: u8 = 0x02;
pub const IO_COMPARE: u8 = 0x05;
pub const IO_WRITE_ZEROES: u8 = 0x08;
pub const IO_DSM: u8 = 0x09;

// Fabrics command types.
pub const FCTYPE_PROPERTY_SET: u8 = 0x00;
pub const FCTYPE_CONNECT: u8 = 0x01;
pub const FCTYPE_PROPERTY_GET: u8 = 0x04;
pub const FCTYPE_AUTH_SEND: u8 = 0x05;
pub const FCTYPE_AUTH_RECV: u8 = 0x06;
pub const FCTYPE_DISCONNECT: u8 = 0x08;

/// Status field value: SCT in bits 10:8, SC in bits 7:0 (the CQE shifts it left by one,
/// past the phase bit). DNR is bit 14 of this value.
pub type Status = u16;
pub const SC_SUCCESS: Status = 0x0000;
pub const SC_INVALID_OPCODE: Status = 0x0001;
pub const SC_INVALID_FIELD: Status = 0x0002;
pub const SC_DATA_XFER_ERROR: Status = 0x0004;
pub const SC_INTERNAL: Status = 0x0006;
pub const SC_ABORT_REQ: Status = 0x0007;
pub const SC_ABORT_SQ_DELETION: Status = 0x0008;
pub const SC_INVALID_NS: Status = 0x000B;
pub const SC_CMD_SEQ_ERROR: Status = 0x000C;
pub const SC_SGL_INVALID_DATA: Status = 0x000F;
pub const SC_SGL_INVALID_TYPE: Status = 0x0011;
pub const SC_SGL_INVALID_OFFSET: Status = 0x0016;
pub const SC_NS_WRITE_PROTECTED: Status = 0x0020;
pub const SC_TRANSIENT_TRANSPORT: Status = 0x0022;
pub const SC_LBA_RANGE: Status = 0x0080;
pub const SC_CAP_EXCEEDED: Status = 0x0081;
/// Command specific (SCT 1).
pub const SC_ASYNC_LIMIT: Status = 0x0105;
pub const SC_INVALID_LOG_PAGE: Status = 0x0109;
pub const SC_FEATURE_NOT_SAVEABLE: Status = 0x010D;
pub const SC_CONNECT_INVALID_PARAM: Status = 0x0182;
pub const SC_CONNECT_INVALID_HOST: Status = 0x0184;
/// The queue must complete in-band authentication first.
pub const SC_AUTH_REQUIRED: Status = 0x0191;
/// Media errors (SCT 2).
pub const SC_WRITE_FAULT: Status = 0x0280;
pub const SC_READ_ERROR: Status = 0x0281;
pub const SC_COMPARE_FAILED: Status = 0x0285;
/// Path related (SCT 3): the namespace is not reachable through this controller now
/// (Asymmetric Namespace Access). Retryable on another path (DNR clear).
pub const SC_ANA_PERSISTENT_LOSS: Status = 0x0301;
pub const SC_ANA_INACCESSIBLE: Status = 0x0302;
pub const SC_ANA_TRANSITION: Status = 0x0303;
/// Status code type 3h: path related.
pub const SCT_PATH: Status = 0x0300;
/// Do Not Retry.
pub const DNR: Status = 0x4000;

/// Whether `s` is a path related status: the command may succeed through another path
/// (or this one after a transition), so a multipath host moves instead of failing it.
pub fn is_path_error(s: Status) -> bool {
    s & 0x0700 == SCT_PATH
}

/// The status an I/O error from the volume (negative errno) maps to.
pub fn status_from_errno(errno: i32, write: bool) -> Status {
    match errno {
        libc::ENOSPC => SC_CAP_EXCEEDED | DNR,
        libc::EINVAL => SC_INVALID_FIELD | DNR,
        libc::EROFS | libc::EPERM => SC_NS_WRITE_PROTECTED | DNR,
        _ if write => SC_WRITE_FAULT,
        _ => SC_READ_ERROR,
    }
}

/// SGL descriptor types (byte 15: type in the high nibble, subtype in the low one).
pub const SGL_DATA_BLOCK_OFFSET: u8 = 0x01;
pub const SGL_TRANSPORT_DATA_BLOCK: u8 = 0x5A;

/// A submission queue entry, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sqe {
    pub opc: u8,
    pub flags: u8,
    pub cid: u16,
    pub nsid: u32,
    /// SGL descriptor 1 (DPTR).
    pub sgl: Sgl,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
}

/// An SGL descriptor as NVMe/TCP uses it: in-capsule data (offset) or a transport data
/// block (data sent with R2T/H2CData or C2HData).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sgl {
    pub addr: u64,
    pub len: u32,
    pub kind: u8,
}

impl Sqe {
    pub fn parse(b: &[u8]) -> Sqe {
        Sqe {
            opc: b[0],
            flags: b[1],
            cid: le16(b, 2),
            nsid: le32(b, 4),
            sgl: Sgl {
                addr: le64(b, 24),
                len: le32(b, 32),
                kind: b[39],
            },
            cdw10: le32(b, 40),
            cdw11: le32(b, 44),
            cdw12: le32(b, 48),
            cdw13: le32(b, 52),
            cdw14: le32(b, 56),
            cdw15: le32(b, 60),
        }
    }

    pub fn encode(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opc;
        b[1] = self.flags;
        put16(&mut b, 2, self.cid);
        put32(&mut b, 4, self.nsid);
        put64(&mut b, 24, self.sgl.addr);
        put32(&mut b, 32, self.sgl.len);
        b[39] = self.sgl.kind;
        put32(&mut b, 40, self.cdw10);
        put32(&mut b, 44, self.cdw11);
        put32(&mut b, 48, self.cdw12);
        put32(&mut b, 52, self.cdw13);
        put32(&mut b, 56, self.cdw14);
        put32(&mut b, 60, self.cdw15);
        b
    }

    /// Fabrics command type (byte 4, where other commands have NSID).
    pub fn fctype(&self) -> u8 {
        low8(self.nsid)
    }

    /// Starting LBA of a Read/Write/Compare/Write Zeroes.
    pub fn slba(&self) -> u64 {
        self.cdw10 as u64 | (self.cdw11 as u64) << 32
    }

    /// Number of logical blocks (1-based) of a Read/Write/Compare/Write Zeroes.
    pub fn nlb(&self) -> u32 {
        (self.cdw12 & 0xFFFF) + 1
    }

    /// Force Unit Access.
    pub fn fua(&self) -> bool {
        self.cdw12 & (1 << 30) != 0
    }

    /// A command's data pointer for a transfer of SGL type `kind`.
    pub fn with_sgl(mut self, kind: u8, len: u32) -> Sqe {
        self.flags = 0x40; // PSDT 01b: SGLs, as every Fabrics command must use
        self.sgl = Sgl { addr: 0, len, kind };
        self
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

impl Cqe {
    pub fn encode(&self) -> [u8; CQE_LEN] {
        let mut b = [0u8; CQE_LEN];
        put32(&mut b, 0, self.dw0);
        put32(&mut b, 4, self.dw1);
        put16(&mut b, 8, self.sqhd);
        put16(&mut b, 10, self.sqid);
        put16(&mut b, 12, self.cid);
        put16(&mut b, 14, self.status << 1);
        b
    }

    pub fn parse(b: &[u8]) -> Cqe {
        Cqe {
            dw0: le32(b, 0),
            dw1: le32(b, 4),
            sqhd: le16(b, 8),
            sqid: le16(b, 10),
            cid: le16(b, 12),
            status: le16(b, 14) >> 1,
        }
    }
}

/// Human text for a status (for error messages).
pub fn status_text(s: Status) -> String {
    let name = match s & 0x7FF {
        SC_SUCCESS => "success",
        SC_INVALID_OPCODE => "invalid opcode",
        SC_INVALID_FIELD => "invalid field in command",
        SC_DATA_XFER_ERROR => "data transfer error",
        SC_INTERNAL => "internal error",
        SC_ABORT_REQ => "command abort requested",
        SC_ABORT_SQ_DELETION => "aborted: SQ deletion",
        SC_INVALID_NS => "invalid namespace or format",
        SC_CMD_SEQ_ERROR => "command sequence error",
        SC_SGL_INVALID_DATA => "data SGL length invalid",
        SC_SGL_INVALID_TYPE => "SGL descriptor type invalid",
        SC_SGL_INVALID_OFFSET => "SGL offset invalid",
        SC_NS_WRITE_PROTECTED => "namespace is write protected",
        SC_TRANSIENT_TRANSPORT => "transient transport error",
        SC_LBA_RANGE => "LBA out of range",
        SC_CAP_EXCEEDED => "capacity exceeded",
        SC_ASYNC_LIMIT => "asynchronous event request limit exceeded",
        SC_INVALID_LOG_PAGE => "invalid log page",
        SC_FEATURE_NOT_SAVEABLE => "feature identifier not saveable",
        SC_CONNECT_INVALID_PARAM => "connect: invalid parameters",
        SC_CONNECT_INVALID_HOST => "connect: host not allowed",
        SC_AUTH_REQUIRED => "authentication required",
        SC_WRITE_FAULT => "write fault",
        SC_READ_ERROR => "unrecovered read error",
        SC_COMPARE_FAILED => "compare failure",
        SC_ANA_PERSISTENT_LOSS => "asymmetric access persistent loss",
        SC_ANA_INACCESSIBLE => "asymmetric access inaccessible",
        SC_ANA_TRANSITION => "asymmetric access transition",
        _ => "status",
    };
    format!(
        "{name} (SCT {:#x} SC {:#04x}{})",
        (s >> 8) & 7,
        s & 0xFF,
        if s & DNR != 0 { ", DNR" } else { "" }
    )
}

// ---- Fabrics ----

/// The fields of a Connect command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectCmd {
    pub recfmt: u16,
    pub qid: u16,
    /// Submission queue size, 0's based.
    pub sqsize: u16,
    /// Bit 2: the host disables SQ flow control (no SQHD needed).
    pub cattr: u8,
    /// Keep-alive timeout in milliseconds (admin queue only; 0 = none).
    pub kato: u32,
}

pub const CONNECT_DATA_LEN: usize = 1024;
pub const CATTR_DISABLE_SQ_FLOW: u8 = 1 << 2;

impl ConnectCmd {
    pub fn parse(s: &Sqe) -> ConnectCmd {
        ConnectCmd {
            recfmt: low16(s.cdw10),
            qid: high16(s.cdw10),
            sqsize: low16(s.cdw11),
            cattr: low8(s.cdw11 >> 16),
            kato: s.cdw12,
        }
    }

    pub fn sqe(&self, cid: u16) -> Sqe {
        Sqe {
            opc: FABRICS,
            cid,
            nsid: FCTYPE_CONNECT as u32,
            cdw10: self.recfmt as u32 | (self.qid as u32) << 16,
            cdw11: self.sqsize as u32 | (self.cattr as u32) << 16,
            cdw12: self.kato,
            ..Sqe::default()
        }
        .with_sgl(SGL_DATA_BLOCK_OFFSET, u32_of(CONNECT_DATA_LEN))
    }
}

/// The 1024-byte Connect data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

/// An NQN field: NUL-terminated UTF-8 in 256 bytes.
fn nqn_field(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl ConnectData {
    pub fn parse(b: &[u8]) -> ConnectData {
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&b[0..16]);
        ConnectData {
            hostid,
            cntlid: le16(b, 16),
            subnqn: nqn_field(&b[256..512]),
            hostnqn: nqn_field(&b[512..768]),
        }
    }

    pub fn encode(&self) -> [u8; CONNECT_DATA_LEN] {
        let mut b = [0u8; CONNECT_DATA_LEN];
        b[0..16].copy_from_slice(&self.hostid);
        put16(&mut b, 16, self.cntlid);
        let s = self.subnqn.as_bytes();
        b[256..256 + s.len().min(255)].copy_from_slice(&s[..s.len().min(255)]);
        let h = self.hostnqn.as_bytes();
        b[512..512 + h.len().min(255)].copy_from_slice(&h[..h.len().min(255)]);
        b
    }
}

/// Connect Invalid Parameters: DW0 names the offending field (IATTR bit 16: 1 = in the
/// data; IPO bits 15:0: its byte offset).
pub fn connect_invalid_param(in_data: bool, offset: u16) -> u32 {
    offset as u32 | if in_data { 1 << 16 } else { 0 }
}

// Controller properties (registers).
pub const PROP_CAP: u32 = 0x00;
pub const PROP_VS: u32 = 0x08;
pub const PROP_CC: u32 = 0x14;
pub const PROP_CSTS: u32 = 0x1C;
pub const PROP_NSSR: u32 = 0x20;

pub const CC_EN: u32 = 1;
pub const CC_SHN_MASK: u32 = 3 << 14;
pub const CSTS_RDY: u32 = 1;
pub const CSTS_CFS: u32 = 1 << 1;
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;
/// NVMe 1.3.
pub const VERSION: u32 = 0x0001_0300;

/// CAP for a controller with `mqes` (0's based) entries per queue: contiguous queues
/// required, a 2 s ready timeout, NVM command set, 4 KiB pages.
pub fn cap(mqes: u16) -> u64 {
    mqes as u64 | 1 << 16 | 4u64 << 24 | 1u64 << 37
}

// ---- Identify ----

pub const CNS_NAMESPACE: u8 = 0x00;
pub const CNS_CONTROLLER: u8 = 0x01;
pub const CNS_ACTIVE_NS_LIST: u8 = 0x02;
pub const CNS_NS_DESC_LIST: u8 = 0x03;
pub const IDENTIFY_LEN: usize = 4096;

/// What Identify Controller reports.
#[derive(Clone, Debug, Default)]
pub struct ControllerInfo {
    pub serial: String,
    pub model: String,
    pub firmware: String,
    pub cntlid: u16,
    /// Maximum data transfer size as a power of two of 4 KiB pages.
    pub mdts: u8,
    /// Number of namespaces (highest NSID).
    pub nn: u32,
    pub subnqn: String,
    pub discovery: bool,
    /// I/O command capsule size in 16-byte units (SQE plus in-capsule data).
    pub ioccsz: u32,
    /// Entries per queue (1-based), for MAXCMD.
    pub maxcmd: u16,
    /// Keep-alive granularity in 100 ms units (0 = keep alive not supported).
    pub kas: u16,
    /// Asynchronous event requests the controller holds, 0's based.
    pub aerl: u8,
    /// Error log entries, 0's based.
    pub elpe: u8,
    /// Asymmetric Namespace Access reporting: one ANA group per namespace (group ID =
    /// NSID), so ANAGRPMAX = NANAGRPID = `nn`.
    pub ana: bool,
}

/// ANA transition time reported (ANATT, seconds): how long a namespace may stay in the
/// Change state before a host gives up on the path.
pub const ANATT_SECS: u8 = 10;
/// ANACAP: the states reported (Optimized, Non-Optimized, Inaccessible, Persistent Loss,
/// Change: bits 0-4) and a namespace's group never changes while attached (bit 6).
pub const ANACAP: u8 = 0x1F | 1 << 6;

fn ascii(b: &mut [u8], s: &str) {
    // Space padded, not NUL terminated.
    for (i, x) in b.iter_mut().enumerate() {
        *x = *s.as_bytes().get(i).unwrap_or(&b' ');
    }
}

pub fn identify_controller(c: &ControllerInfo) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    put16(&mut b, 0, 0x1b36); // PCI vendor: none; the value qemu and nvmet use for software
    put16(&mut b, 2, 0x1b36);
    ascii(&mut b[4..24], &c.serial);
    ascii(&mut b[24..64], &c.model);
    ascii(&mut b[64..72], &c.firmware);
    b[72] = 6; // recommended arbitration burst
               // CMIC: may be reached through several controllers (bit 1); ANA reporting (bit 3).
    b[76] = if c.ana { 1 << 1 | 1 << 3 } else { 1 << 1 };
    b[77] = c.mdts;
    put16(&mut b, 78, c.cntlid);
    put32(&mut b, 80, VERSION);
    if !c.discovery {
        // OAES: namespace attribute notices; ANA change notices when reporting ANA.
        put32(&mut b, 92, if c.ana { 1 << 8 | 1 << 11 } else { 1 << 8 });
    }
    put32(&mut b, 96, 1); // CTRATT: 128-bit host identifier
    b[111] = if c.discovery { 2 } else { 1 }; // CNTRLTYPE
    b[258] = 3; // ACL: 4 concurrent aborts
    b[259] = c.aerl;
    b[260] = 1 << 1 | 1; // FRMW: one slot, read only
    b[261] = 1 << 2; // LPA: extended data for Get Log Page
    b[262] = c.elpe;
    put16(&mut b, 320, c.kas);
    if c.ana {
        b[342] = ANATT_SECS;
        b[343] = ANACAP;
        put32(&mut b, 344, c.nn); // ANAGRPMAX
        put32(&mut b, 348, c.nn); // NANAGRPID
    }
    if !c.discovery {
        b[512] = 0x66; // SQES: 64 bytes
        b[513] = 0x44; // CQES: 16 bytes
    }
    put16(&mut b, 514, c.maxcmd);
    put32(&mut b, 516, c.nn);
    if c.ana {
        // MNAN: hosts size the ANA log buffer from it (every NSID in some group).
        put32(&mut b, 540, c.nn);
    }
    if !c.discovery {
        // ONCS: Compare, Dataset Management, Write Zeroes.
        put16(&mut b, 520, 1 | 1 << 2 | 1 << 3);
        b[525] = 1; // VWC: a volatile write cache (writes are durable after Flush)
    }
    // SGLS: SGLs supported (no alignment), in-capsule data with an offset.
    put32(&mut b, 536, 1 | 1 << 20);
    let n = c.subnqn.len().min(255);
    b[768..768 + n].copy_from_slice(&c.subnqn.as_bytes()[..n]);
    // Fabrics: IOCCSZ, IORCSZ (16 bytes: a CQE), ICDOFF 0, MSDBD 1.
    put32(&mut b, 1792, c.ioccsz);
    put32(&mut b, 1796, 1);
    b[1803] = 1;
    b
}

/// What Identify Namespace reports.
#[derive(Clone, Debug, Default)]
pub struct NamespaceInfo {
    pub blocks: u64,
    pub allocated_blocks: u64,
    /// log2 of the LBA size.
    pub lba_shift: u8,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    pub uuid: [u8; 16],
    /// ANA group ID (0: the controller does not report ANA).
    pub anagrpid: u32,
}

pub fn identify_namespace(n: &NamespaceInfo) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    put64(&mut b, 0, n.blocks); // NSZE
    put64(&mut b, 8, n.blocks); // NCAP: thin, the whole size may be allocated
    put64(&mut b, 16, n.allocated_blocks); // NUSE
    b[24] = 1 | 1 << 3; // NSFEAT: thin provisioning; NGUID/EUI64 never reused
    b[25] = 0; // NLBAF: one format
    b[26] = 0; // FLBAS: format 0, no metadata
    b[30] = 1; // NMIC: may be attached to several controllers
               // DLFEAT: deallocated blocks read as zeros; Write Zeroes may deallocate.
    b[33] = 1 | 1 << 3;
    put32(&mut b, 92, n.anagrpid); // ANAGRPID
    b[104..120].copy_from_slice(&n.nguid);
    b[120..128].copy_from_slice(&n.eui64);
    b[128 + 2] = n.lba_shift; // LBAF0: LBADS
    b
}

pub fn identify_ns_descriptors(n: &NamespaceInfo) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut at = 0;
    for (ty, id) in [(1u8, &n.eui64[..]), (2, &n.nguid[..]), (3, &n.uuid[..])] {
        b[at] = ty;
        b[at + 1] = u8_of(id.len());
        b[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    }
    b
}

/// Active namespace IDs greater than `after`, ascending, at most 1024.
pub fn active_ns_list(nsids: &[u32], after: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_LEN];
    let mut ids: Vec<u32> = nsids.iter().copied().filter(|&n| n > after).collect();
    ids.sort_unstable();
    for (i, id) in ids.iter().take(1024).enumerate() {
        put32(&mut b, 4 * i, *id);
    }
    b
}

// ---- Log pages ----

pub const LID_ERROR: u8 = 0x01;
pub const LID_SMART: u8 = 0x02;
pub const LID_FW_SLOT: u8 = 0x03;
pub const LID_CHANGED_NS: u8 = 0x04;
pub const LID_ANA: u8 = 0x0C;
pub const LID_DISCOVERY: u8 = 0x70;

/// Log Specific Field (Get Log Page CDW10 bits 11:8).
pub fn log_specific(s: &Sqe) -> u8 {
    low8(s.cdw10 >> 8) & 0xF
}

/// ANA log LSP bit 0: Return Groups Only (no NSID lists).
pub const ANA_LSP_RGO: u8 = 1;

/// Get Log Page fields: log id, bytes wanted, offset, retain asynchronous event.
pub fn log_page_args(s: &Sqe) -> (u8, usize, u64, bool) {
    let lid = low8(s.cdw10);
    let numdl = s.cdw10 >> 16;
    let numdu = s.cdw11 & 0xFFFF;
    let dwords = (numdu << 16 | numdl) as usize + 1;
    let offset = s.cdw12 as u64 | (s.cdw13 as u64) << 32;
    (lid, dwords * 4, offset, s.cdw10 & (1 << 15) != 0)
}

/// An error information log entry.
#[derive(Clone, Copy, Debug, Default)]
pub struct ErrorEntry {
    pub count: u64,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
    pub lba: u64,
    pub nsid: u32,
}

pub fn error_log(entries: &[ErrorEntry]) -> Vec<u8> {
    let mut b = vec![0u8; 64 * entries.len().max(1)];
    for (i, e) in entries.iter().enumerate() {
        let x = &mut b[64 * i..64 * (i + 1)];
        put64(x, 0, e.count);
        put16(x, 8, e.sqid);
        put16(x, 10, e.cid);
        put16(x, 12, e.status << 1);
        put16(x, 14, 0xFFFF); // parameter error location: not applicable
        put64(x, 16, e.lba);
        put32(x, 24, e.nsid);
    }
    b
}

/// SMART / health figures.
#[derive(Clone, Copy, Debug, Default)]
pub struct Smart {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub reads: u64,
    pub writes: u64,
    pub errors: u64,
    pub power_on_hours: u64,
}

pub fn smart_log(s: &Smart) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    put16(&mut b, 1, 273 + 25); // composite temperature, Kelvin: nothing overheats
    b[3] = 100; // available spare
    b[4] = 10; // spare threshold
               // Data units are thousands of 512-byte units, rounded up.
    let units = |bytes: u64| (bytes / 512).div_ceil(1000);
    put64(&mut b, 32, units(s.read_bytes));
    put64(&mut b, 48, units(s.write_bytes));
    put64(&mut b, 64, s.reads);
    put64(&mut b, 80, s.writes);
    put64(&mut b, 112, 1); // power cycles
    put64(&mut b, 128, s.power_on_hours);
    put64(&mut b, 160, s.errors); // media and data integrity errors
    put64(&mut b, 176, s.errors); // error log entries
    b
}

/// Changed namespace list: up to 1024 IDs; more than that reads as 0xFFFFFFFF.
pub fn changed_ns_log(ids: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    if ids.len() > 1024 {
        put32(&mut b, 0, 0xFFFF_FFFF);
    } else {
        for (i, id) in ids.iter().enumerate() {
            put32(&mut b, 4 * i, *id);
        }
    }
    b
}

// ---- Asymmetric Namespace Access ----

/// The access state of a namespace through one controller (ANA group state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum AnaState {
    Optimized = 0x01,
    NonOptimized = 0x02,
    Inaccessible = 0x03,
    PersistentLoss = 0x04,
    Change = 0x0F,
}

impl AnaState {
    pub fn from_u8(v: u8) -> Option<AnaState> {
        Some(match v & 0xF {
            0x01 => AnaState::Optimized,
            0x02 => AnaState::NonOptimized,
            0x03 => AnaState::Inaccessible,
            0x04 => AnaState::PersistentLoss,
            0x0F => AnaState::Change,
            _ => return None,
        })
    }

    /// I/O is served in this state.
    pub fn accessible(self) -> bool {
        matches!(self, AnaState::Optimized | AnaState::NonOptimized)
    }

    /// The status I/O gets in this state (success when accessible).
    pub fn io_status(self) -> Status {
        match self {
            AnaState::Optimized | AnaState::NonOptimized => SC_SUCCESS,
            AnaState::Inaccessible => SC_ANA_INACCESSIBLE,
            AnaState::PersistentLoss => SC_ANA_PERSISTENT_LOSS,
            AnaState::Change => SC_ANA_TRANSITION,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }

    pub fn from_name(s: &str) -> Option<AnaState> {
        [
            AnaState::Optimized,
            AnaState::NonOptimized,
            AnaState::Inaccessible,
            AnaState::PersistentLoss,
            AnaState::Change,
        ]
        .into_iter()
        .find(|a| a.name() == s)
    }
}

/// One ANA group descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroupDesc {
    pub grpid: u32,
    pub change_count: u64,
    pub state: AnaState,
    /// Empty when the log was read with Return Groups Only.
    pub nsids: Vec<u32>,
}

/// The ANA log page: a 16-byte header (change count, number of descriptors), then per
/// group a 32-byte descriptor (group ID, NSID count, change count, state) followed by
/// its NSIDs (none with RGO; the count then reads 0).
pub fn ana_log(change_count: u64, groups: &[AnaGroupDesc], groups_only: bool) -> Vec<u8> {
    let ids = if groups_only {
        0
    } else {
        groups.iter().map(|g| g.nsids.len()).sum::<usize>()
    };
    let mut b = vec![0u8; 16 + 32 * groups.len() + 4 * ids];
    put64(&mut b, 0, change_count);
    put16(&mut b, 8, u16::try_from(groups.len()).unwrap_or(u16::MAX));
    let mut at = 16;
    for g in groups {
        let n = if groups_only { 0 } else { g.nsids.len() };
        put32(&mut b, at, g.grpid);
        put32(&mut b, at + 4, u32_of(n));
        put64(&mut b, at + 8, g.change_count);
        b[at + 16] = g.state as u8;
        at += 32;
        for &id in &g.nsids[..n] {
            put32(&mut b, at, id);
            at += 4;
        }
    }
    b
}

/// Why an ANA log page does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnaLogError {
    #[error("ANA log of {0} bytes (header is 16)")]
    Short(usize),
    #[error("ANA log: descriptor {index} runs past {len} bytes")]
    DescriptorPastEnd { index: usize, len: usize },
    #[error("ANA log: group {grpid} has state {state:#x}")]
    State { grpid: u32, state: u8 },
    #[error("ANA log: group {grpid} lists {count} NSIDs past the end")]
    NsidsPastEnd { grpid: u32, count: usize },
}

/// Parse an ANA log page: (change count, groups). A descriptor with an unknown state or
/// running past the buffer is an error.
pub fn parse_ana_log(b: &[u8]) -> Result<(u64, Vec<AnaGroupDesc>), AnaLogError> {
    if b.len() < 16 {
        return Err(AnaLogError::Short(b.len()));
    }
    let change = le64(b, 0);
    let n = usize::from(le16(b, 8));
    let mut at = 16;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if at + 32 > b.len() {
            return Err(AnaLogError::DescriptorPastEnd {
                index: i,
                len: b.len(),
            });
        }
        let grpid = le32(b, at);
        let count = usize_of(u64::from(le32(b, at + 4)));
        let change_count = le64(b, at + 8);
        let state = AnaState::from_u8(b[at + 16]).ok_or(AnaLogError::State {
            grpid,
            state: b[at + 16],
        })?;
        at += 32;
        if at + 4 * count > b.len() {
            return Err(AnaLogError::NsidsPastEnd { grpid, count });
        }
        let nsids = (0..count).map(|k| le32(b, at + 4 * k)).collect();
        at += 4 * count;
        out.push(AnaGroupDesc {
            grpid,
            change_count,
            state,
            nsids,
        });
    }
    Ok((change, out))
}

/// One discovery log entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryEntry {
    /// 1 = a discovery subsystem, 2 = an NVM subsystem.
    pub subtype: u8,
    pub portid: u16,
    pub trsvcid: String,
    pub traddr: String,
    pub subnqn: String,
    /// IPv4 (1) or IPv6 (2).
    pub adrfam: u8,
}

pub const DISC_ENTRY_LEN: usize = 1024;

pub fn discovery_log(genctr: u64, entries: &[DiscoveryEntry]) -> Vec<u8> {
    let mut b = vec![0u8; 1024 + DISC_ENTRY_LEN * entries.len()];
    put64(&mut b, 0, genctr);
    put64(&mut b, 8, entries.len() as u64);
    for (i, e) in entries.iter().enumerate() {
        let x = &mut b[1024 * (i + 1)..1024 * (i + 2)];
        x[0] = 3; // TRTYPE: TCP
        x[1] = e.adrfam;
        x[2] = e.subtype;
        // TREQ: secure channel not required; SQ flow control disable supported.
        x[3] = 2 | 1 << 2;
        put16(x, 4, e.portid);
        put16(x, 6, 0xFFFF); // dynamic controller model
        put16(x, 8, 32); // admin max SQ size
        ascii(&mut x[32..64], &e.trsvcid);
        ascii(&mut x[256..512], &e.traddr);
        let n = e.subnqn.len().min(255);
        x[512..512 + n].copy_from_slice(&e.subnqn.as_bytes()[..n]);
        // TSAS for TCP: SECTYPE 0 (none).
    }
    b
}

pub fn parse_discovery_log(b: &[u8]) -> (u64, Vec<DiscoveryEntry>) {
    let trim = |x: &[u8]| {
        String::from_utf8_lossy(x)
            .trim_end_matches(['\0', ' '])
            .to_string()
    };
    let gen = le64(b, 0);
    let n = usize_of(le64(b, 8));
    let mut out = Vec::new();
    for i in 0..n {
        let at = 1024 * (i + 1);
        if at + DISC_ENTRY_LEN > b.len() {
            break;
        }
        let x = &b[at..at + DISC_ENTRY_LEN];
        out.push(DiscoveryEntry {
            subtype: x[2],
            adrfam: x[1],
            portid: le16(x, 4),
            trsvcid: trim(&x[32..64]),
            traddr: trim(&x[256..512]),
            subnqn: nqn_field(&x[512..768]),
        });
    }
    (gen, out)
}

// ---- Features ----

pub const FEAT_ARBITRATION: u8 = 0x01;
pub const FEAT_POWER_MGMT: u8 = 0x02;
pub const FEAT_TEMP_THRESH: u8 = 0x04;
pub const FEAT_ERR_RECOVERY: u8 = 0x05;
pub const FEAT_VOLATILE_WC: u8 = 0x06;
pub const FEAT_NUM_QUEUES: u8 = 0x07;
pub const FEAT_ASYNC_EVENT: u8 = 0x0B;
pub const FEAT_KATO: u8 = 0x0F;

/// AER completion DW0 for "namespace attribute changed" (notice, log page 04h).
pub const AEN_NS_CHANGED: u32 = 0x2 | (LID_CHANGED_NS as u32) << 16;
/// Asynchronous Event Configuration bit enabling namespace attribute notices.
pub const AEC_NS_ATTR: u32 = 1 << 8;
/// AER completion DW0 for "ANA change" (notice, information 03h, log page 0Ch).
pub const AEN_ANA_CHANGE: u32 = 0x2 | 0x03 << 8 | (LID_ANA as u32) << 16;
/// Asynchronous Event Configuration bit enabling ANA change notices.
pub const AEC_ANA_CHANGE: u32 = 1 << 11;

// ---- Dataset Management ----

/// One DSM range: (starting LBA, number of blocks).
pub fn dsm_ranges(b: &[u8], count: usize) -> Vec<(u64, u32)> {
    (0..count)
        .map(|i| (le64(b, 16 * i + 8), le32(b, 16 * i + 4)))
        .collect()
}

pub fn encode_dsm_range(slba: u64, nlb: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    put32(&mut b, 4, nlb);
    put64(&mut b, 8, slba);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_and_cqe_roundtrip() {
        let s = Sqe {
            opc: IO_READ,
            cid: 0x1234,
            nsid: 1,
            cdw10: 0x89AB_CDEF,
            cdw11: 1,
            cdw12: 7 | 1 << 30,
            ..Sqe::default()
        }
        .with_sgl(SGL_TRANSPORT_DATA_BLOCK, 4096);
        let b = s.encode();
        assert_eq!(b[39], 0x5A);
        assert_eq!(b[1], 0x40);
        let p = Sqe::parse(&b);
        assert_eq!(p, s);
        assert_eq!(p.slba(), 0x1_89AB_CDEF);
        assert_eq!(p.nlb(), 8);
        assert!(p.fua());
        let c = Cqe {
            dw0: 5,
            dw1: 0,
            sqhd: 3,
            sqid: 2,
            cid: 9,
            status: SC_LBA_RANGE | DNR,
        };
        let e = c.encode();
        assert_eq!(le16(&e, 14), (0x80 | 0x4000) << 1);
        assert_eq!(Cqe::parse(&e), c);
    }

    #[test]
    fn connect_roundtrip() {
        let c = ConnectCmd {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: CATTR_DISABLE_SQ_FLOW,
            kato: 0,
        };
        let s = Sqe::parse(&c.sqe(1).encode());
        assert_eq!(s.fctype(), FCTYPE_CONNECT);
        assert_eq!(ConnectCmd::parse(&s), c);
        let d = ConnectData {
            hostid: [3; 16],
            cntlid: 0xFFFF,
            subnqn: "nqn.2024-01.io.tessera:vol0".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:x".into(),
        };
        assert_eq!(ConnectData::parse(&d.encode()), d);
    }

    #[test]
    fn identify_layouts() {
        let c = ControllerInfo {
            serial: "abc".into(),
            model: "Tessera".into(),
            firmware: "0.1".into(),
            cntlid: 7,
            mdts: 8,
            nn: 2,
            subnqn: "nqn.x".into(),
            ioccsz: 516,
            maxcmd: 128,
            kas: 1,
            ..Default::default()
        };
        let b = identify_controller(&c);
        assert_eq!(&b[4..8], b"abc ");
        assert_eq!(le16(&b, 78), 7);
        assert_eq!(le32(&b, 516), 2);
        assert_eq!(&b[768..773], b"nqn.x");
        assert_eq!(le32(&b, 1792), 516);
        let n = NamespaceInfo {
            blocks: 1000,
            allocated_blocks: 10,
            lba_shift: 9,
            nguid: [9; 16],
            eui64: [8; 8],
            uuid: [7; 16],
            anagrpid: 0,
        };
        let b = identify_namespace(&n);
        assert_eq!(le64(&b, 0), 1000);
        assert_eq!(b[130], 9);
        assert_eq!(&b[104..120], &[9; 16]);
        let d = identify_ns_descriptors(&n);
        assert_eq!((d[0], d[1]), (1, 8));
        assert_eq!((d[12], d[13]), (2, 16));
        assert_eq!((d[32], d[33]), (3, 16));
        let l = active_ns_list(&[3, 1, 2], 1);
        assert_eq!((le32(&l, 0), le32(&l, 4), le32(&l, 8)), (2, 3, 0));
    }

    #[test]
    fn discovery_log_roundtrip() {
        let e = DiscoveryEntry {
            subtype: 2,
            portid: 1,
            trsvcid: "4420".into(),
            traddr: "127.0.0.1".into(),
            subnqn: "nqn.a".into(),
            adrfam: 1,
        };
        let b = discovery_log(5, std::slice::from_ref(&e));
        assert_eq!(parse_discovery_log(&b), (5, vec![e]));
    }

    #[test]
    fn identify_reports_ana() {
        let mut c = ControllerInfo {
            nn: 3,
            ana: true,
            ..Default::default()
        };
        let b = identify_controller(&c);
        assert_eq!(
            b[76] & (1 << 3 | 1 << 1),
            1 << 3 | 1 << 1,
            "CMIC ANA + multi-ctrl"
        );
        assert_ne!(le32(&b, 92) & (1 << 11), 0, "OAES ANA change notices");
        assert_eq!(b[342], ANATT_SECS);
        assert_eq!(b[343], 0x5F);
        assert_eq!(le32(&b, 344), 3, "ANAGRPMAX");
        assert_eq!(le32(&b, 348), 3, "NANAGRPID");
        assert_eq!(le32(&b, 540), 3, "MNAN");
        c.ana = false;
        let b = identify_controller(&c);
        assert_eq!(b[76] & (1 << 3), 0);
        assert_eq!((b[342], b[343], le32(&b, 348)), (0, 0, 0));
        let n = identify_namespace(&NamespaceInfo {
            anagrpid: 7,
            ..Default::default()
        });
        assert_eq!(le32(&n, 92), 7, "ANAGRPID");
    }

    #[test]
    fn ana_log_layout_and_roundtrip() {
        let groups = vec![
            AnaGroupDesc {
                grpid: 1,
                change_count: 4,
                state: AnaState::Optimized,
                nsids: vec![1],
            },
            AnaGroupDesc {
                grpid: 2,
                change_count: 9,
                state: AnaState::Inaccessible,
                nsids: vec![2],
            },
        ];
        let b = ana_log(13, &groups, false);
        assert_eq!(b.len(), 16 + 2 * (32 + 4));
        assert_eq!(le64(&b, 0), 13);
        assert_eq!(le16(&b, 8), 2);
        // Second descriptor: after the first one and its NSID.
        assert_eq!(le32(&b, 16 + 36), 2);
        assert_eq!(le32(&b, 16 + 36 + 4), 1);
        assert_eq!(le64(&b, 16 + 36 + 8), 9);
        assert_eq!(b[16 + 36 + 16], 0x03);
        assert_eq!(le32(&b, 16 + 36 + 32), 2);
        assert_eq!(parse_ana_log(&b).unwrap(), (13, groups.clone()));
        // Return Groups Only: no NSID lists, counts 0.
        let r = ana_log(13, &groups, true);
        assert_eq!(r.len(), 16 + 64);
        let (_, g) = parse_ana_log(&r).unwrap();
        assert!(g.iter().all(|d| d.nsids.is_empty()));
        assert_eq!(g[1].state, AnaState::Inaccessible);
        // Truncated or corrupt pages are errors, not panics.
        assert!(parse_ana_log(&b[..40]).is_err());
        let mut bad = b.clone();
        bad[16 + 16] = 0x09;
        assert!(parse_ana_log(&bad).is_err());
    }

    #[test]
    fn ana_states_and_statuses() {
        assert_eq!(AnaState::Inaccessible.io_status(), 0x0302);
        assert_eq!(AnaState::PersistentLoss.io_status(), 0x0301);
        assert_eq!(AnaState::Change.io_status(), 0x0303);
        assert!(is_path_error(SC_ANA_TRANSITION));
        assert!(!is_path_error(SC_WRITE_FAULT | DNR));
        for s in [
            AnaState::Optimized,
            AnaState::Change,
            AnaState::PersistentLoss,
        ] {
            assert_eq!(AnaState::from_u8(s as u8), Some(s));
            assert_eq!(AnaState::from_name(s.name()), Some(s));
        }
        let s = Sqe {
            cdw10: u32::from(LID_ANA) | u32::from(ANA_LSP_RGO) << 8,
            ..Sqe::default()
        };
        assert_eq!(log_specific(&s), ANA_LSP_RGO);
        assert_eq!(AEN_ANA_CHANGE, 0x000C_0302);
    }

    #[test]
    fn log_page_args_decode() {
        let s = Sqe {
            opc: ADM_GET_LOG_PAGE,
            cdw10: LID_SMART as u32 | 127 << 16 | 1 << 15,
            cdw12: 512,
            ..Sqe::default()
        };
        assert_eq!(log_page_args(&s), (LID_SMART, 512, 512, true));
    }

    #[test]
    fn dsm_ranges_decode() {
        let mut b = Vec::new();
        b.extend_from_slice(&encode_dsm_range(100, 8));
        b.extend_from_slice(&encode_dsm_range(7, 1));
        assert_eq!(dsm_ranges(&b, 2), vec![(100, 8), (7, 1)]);
    }
}
