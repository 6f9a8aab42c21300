//! Errors of the remote device: why it could not be opened, why a queue could not
//! connect, and why a queue dropped its connection. Each keeps what caused it (the
//! transport's `io::Error`, the NVMe status or termination the initiator saw) as its
//! `source`, so the layers above can ask for the kind or errno instead of parsing text.
//! The device's own face stays `io::Result` (a [`BlockDevice`](tessera_device::BlockDevice)
//! fails with an `io::Error`); these errors travel inside it (`io::Error::get_ref`).

use std::io;

use tessera_nvmf::initiator::Error as NvmfError;
use tessera_nvmf::pdu;

/// Why a remote device (or one of its paths) could not be set up or used.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// The initiator failed talking to the target named by `spec`.
    #[error("{spec}: {source}")]
    Nvmf {
        spec: String,
        #[source]
        source: NvmfError,
    },
    /// A command completed with an NVMe status, mapped to the errno the I/O returns.
    #[error("{source} ({})", io::Error::from_raw_os_error(*.errno))]
    Status {
        errno: i32,
        #[source]
        source: NvmfError,
    },
    /// The congestion settings do not fit the queue depth.
    #[error("{spec}: {source}")]
    Congestion {
        spec: String,
        #[source]
        source: CongestionError,
    },
}

impl RemoteError {
    /// The `io::Error` a device operation fails with: the kind of the transport error
    /// (or `errno`'s kind), carrying this error as its inner error.
    pub fn into_io(self) -> io::Error {
        let kind = match &self {
            RemoteError::Nvmf {
                source: NvmfError::Io(e),
                ..
            } => e.kind(),
            RemoteError::Nvmf { .. } => io::ErrorKind::Other,
            RemoteError::Status { errno, .. } => io::Error::from_raw_os_error(*errno).kind(),
            RemoteError::Congestion { .. } => io::ErrorKind::InvalidInput,
        };
        io::Error::new(kind, self)
    }
}

/// Why congestion settings are unusable for a queue depth.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CongestionError {
    #[error("the largest congestion window ({max}) exceeds the queue depth ({depth})")]
    MaxAboveDepth { max: u16, depth: u16 },
    #[error("the smallest congestion window must be between 1 and the largest ({max}), not {min}")]
    MinWindow { min: u16, max: u16 },
    #[error("the target delay must be above 0 and at most 10 s")]
    TargetDelay,
    #[error("the minimum-RTT window must be at least 10 ms")]
    MinRttWindow,
}

/// Why a per-core I/O queue could not (re)connect. Logged by the queue, which retries
/// within the device's timeout.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting the admin queue: {source}")]
    Admin {
        #[source]
        source: io::Error,
    },
    #[error("the controller grants only {granted} I/O queues")]
    QueuesGranted { granted: u16 },
    #[error("connecting I/O queue {qid}: {source}")]
    IoQueue {
        qid: u16,
        #[source]
        source: NvmfError,
    },
    #[error("cannot start a connect thread: {source}")]
    Thread {
        #[source]
        source: io::Error,
    },
    /// The connect thread completed without leaving a result (a bug, not a peer's fault).
    #[error("no connect result")]
    NoResult,
}

/// How the target broke the protocol on an established I/O queue; the queue drops the
/// connection and resubmits what was outstanding on a new one.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("bad PDU from the target: {source}")]
    BadPdu {
        #[source]
        source: pdu::Fatal,
    },
    #[error("{what} for command {cid}, which is not outstanding")]
    NotOutstanding { what: &'static str, cid: u16 },
    #[error("{what} for command {cid}, which is not a {expected}")]
    WrongCommand {
        what: &'static str,
        cid: u16,
        expected: &'static str,
    },
    #[error("C2HData {off}+{len} for read {cid} of {rlen} bytes, {got} received")]
    C2HDataRange {
        off: u32,
        len: u32,
        cid: u16,
        rlen: u32,
        got: u32,
    },
    #[error("R2T {off}+{len} outside write {cid} of {wlen} bytes")]
    R2TRange {
        off: u32,
        len: u32,
        cid: u16,
        wlen: u32,
    },
    #[error("PDU of {0} bytes from the target")]
    PduTooLarge(usize),
    #[error("the target terminated the connection (FES {fes:#x}, FEI {fei:#x})")]
    Terminated { fes: u16, fei: u32 },
    #[error("unexpected PDU type {0:#x} from the target")]
    UnexpectedPdu(u8),
}
