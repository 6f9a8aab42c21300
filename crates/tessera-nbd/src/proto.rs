//! NBD wire constants and the fixed-size codecs of the transmission phase.
//!
//! Numbers come from `doc/proto.md` of the NBD project. Everything on the wire is
//! big-endian ("network byte order"), unlike Tessera's on-disk format.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_FLAG_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;

// Info types for NBD_OPT_INFO / NBD_OPT_GO.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// Transmission-phase magics.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Every command flag this server understands; anything else is EINVAL.
pub const CMD_FLAGS_KNOWN: u16 =
    CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_DF | CMD_FLAG_REQ_ONE | CMD_FLAG_FAST_ZERO;

// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// Metadata context state bits for base:allocation.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
pub const BASE_ALLOCATION: &str = "base:allocation";
/// qemu's namespace (registered in the NBD spec; qemu's docs/interop/nbd.rst).
pub const QEMU_NAMESPACE: &str = "qemu:";
/// Prefix of qemu's dirty-bitmap contexts, `qemu:dirty-bitmap:NAME`; alone, the LIST
/// wildcard for all of them.
pub const QEMU_DIRTY_BITMAP: &str = "qemu:dirty-bitmap:";
/// The one state bit of a `qemu:dirty-bitmap:` context: the extent is dirty.
pub const STATE_DIRTY: u32 = 1 << 0;

// Error values (not the host's errno: NBD fixes its own numbers).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Size constraints the server advertises with NBD_INFO_BLOCK_SIZE and enforces.
pub const MIN_BLOCK: u32 = 512;
pub const PREFERRED_BLOCK: u32 = 4096;
/// Largest READ/WRITE payload accepted (the spec's recommended 32 MiB).
pub const MAX_PAYLOAD: u32 = 32 << 20;

pub const REQUEST_HEADER_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_REPLY_LEN: usize = 20;

/// One transmission-phase request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub cmd: u16,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// The request header did not start with the request magic; the stream cannot be
/// resynchronised, so the spec's answer is to close the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadRequestMagic(pub u32);

impl std::fmt::Display for BadRequestMagic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bad NBD request magic {:#010x}", self.0)
    }
}

impl std::error::Error for BadRequestMagic {}

/// The big-endian `u16` at the front of `b` (which must hold 2 bytes). The one byte
/// reader of the NBD wire, for the server, the client and the load generator.
#[inline]
pub fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// The big-endian `u32` at the front of `b` (which must hold 4 bytes).
#[inline]
pub fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// The big-endian `u64` at the front of `b` (which must hold 8 bytes).
#[inline]
pub fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// One reply header from the server: a simple reply, or the header of one structured
/// reply chunk (its payload, `length` bytes, follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple {
        error: u32,
        cookie: u64,
    },
    Chunk {
        flags: u16,
        ty: u16,
        cookie: u64,
        length: u32,
    },
}

impl ReplyHeader {
    /// Bytes the header takes on the wire.
    pub fn wire_len(&self) -> usize {
        match self {
            ReplyHeader::Simple { .. } => SIMPLE_REPLY_LEN,
            ReplyHeader::Chunk { .. } => STRUCTURED_REPLY_LEN,
        }
    }
}

/// A reply did not start with a reply magic: the stream is out of sync and cannot be
/// resynchronised; the client must close the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadReplyMagic(pub u32);

impl std::fmt::Display for BadReplyMagic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "bad NBD reply magic {:#010x}: the stream is out of sync",
            self.0
        )
    }
}

impl std::error::Error for BadReplyMagic {}

/// Length of the reply header that starts with `magic`, or the error for a bad magic.
/// A client reading from a stream reads the magic first, then this many bytes in all.
pub fn reply_header_len(magic: u32) -> Result<usize, BadReplyMagic> {
    match magic {
        SIMPLE_REPLY_MAGIC => Ok(SIMPLE_REPLY_LEN),
        STRUCTURED_REPLY_MAGIC => Ok(STRUCTURED_REPLY_LEN),
        m => Err(BadReplyMagic(m)),
    }
}

/// Parse one reply header from the front of `buf`. `Ok(None)` means more bytes are
/// needed; an error means the connection must be closed.
#[inline]
pub fn parse_reply(buf: &[u8]) -> Result<Option<ReplyHeader>, BadReplyMagic> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = reply_header_len(be_u32(buf))?;
    if buf.len() < len {
        return Ok(None);
    }
    Ok(Some(if len == SIMPLE_REPLY_LEN {
        ReplyHeader::Simple {
            error: be_u32(&buf[4..]),
            cookie: be_u64(&buf[8..]),
        }
    } else {
        ReplyHeader::Chunk {
            flags: be_u16(&buf[4..]),
            ty: be_u16(&buf[6..]),
            cookie: be_u64(&buf[8..]),
            length: be_u32(&buf[16..]),
        }
    }))
}

/// Parse one request header from the front of `buf`. `Ok(None)` means more bytes are
/// needed; an error means the connection must be closed.
pub fn parse_request(buf: &[u8]) -> Result<Option<RequestHeader>, BadRequestMagic> {
    if buf.len() < REQUEST_HEADER_LEN {
        return Ok(None);
    }
    let magic = be_u32(&buf[0..4]);
    if magic != REQUEST_MAGIC {
        return Err(BadRequestMagic(magic));
    }
    Ok(Some(RequestHeader {
        flags: be_u16(&buf[4..6]),
        cmd: be_u16(&buf[6..8]),
        cookie: be_u64(&buf[8..16]),
        offset: be_u64(&buf[16..24]),
        length: be_u32(&buf[24..28]),
    }))
}

/// Encode a request header (used by the test client and fuzz seeds).
pub fn encode_request(h: &RequestHeader) -> [u8; REQUEST_HEADER_LEN] {
    let mut b = [0u8; REQUEST_HEADER_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&h.flags.to_be_bytes());
    b[6..8].copy_from_slice(&h.cmd.to_be_bytes());
    b[8..16].copy_from_slice(&h.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&h.offset.to_be_bytes());
    b[24..28].copy_from_slice(&h.length.to_be_bytes());
    b
}

/// Write a simple reply header into `out`.
pub fn encode_simple_reply(out: &mut [u8], error: u32, cookie: u64) {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
}

/// Write a structured reply chunk header into `out`; `length` is the payload length.
pub fn encode_structured_reply(out: &mut [u8], flags: u16, ty: u16, cookie: u64, length: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&ty.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
}

/// Map a host errno (positive) to the NBD error number the spec allows on the wire.
pub fn errno_to_nbd(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => EPERM,
        libc::ENOMEM => ENOMEM,
        libc::EINVAL => EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => ENOSPC,
        libc::EOVERFLOW => EOVERFLOW,
        libc::ENOTSUP => ENOTSUP,
        libc::ESHUTDOWN => ESHUTDOWN,
        _ => EIO,
    }
}

/// Transmission flags for an export.
pub fn transmission_flags(read_only: bool) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_SEND_DF
        | TFLAG_CAN_MULTI_CONN
        | TFLAG_SEND_CACHE
        | TFLAG_SEND_FAST_ZERO;
    if read_only {
        f |= TFLAG_READ_ONLY;
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_headers_parse_what_the_encoders_write() {
        let mut b = [0u8; STRUCTURED_REPLY_LEN];
        encode_simple_reply(&mut b, EIO, 0x1234);
        let simple = ReplyHeader::Simple {
            error: EIO,
            cookie: 0x1234,
        };
        assert_eq!(parse_reply(&b[..SIMPLE_REPLY_LEN]), Ok(Some(simple)));
        assert_eq!(parse_reply(&b[..SIMPLE_REPLY_LEN - 1]), Ok(None));
        encode_structured_reply(&mut b, REPLY_FLAG_DONE, 1, 7, 4096);
        let chunk = ReplyHeader::Chunk {
            flags: REPLY_FLAG_DONE,
            ty: 1,
            cookie: 7,
            length: 4096,
        };
        assert_eq!(parse_reply(&b), Ok(Some(chunk)));
        assert_eq!(chunk.wire_len(), STRUCTURED_REPLY_LEN);
        assert_eq!(parse_reply(&b[..19]), Ok(None));
        assert_eq!(parse_reply(&[0, 0, 0]), Ok(None));
        b[0] = 0xff;
        assert!(matches!(parse_reply(&b), Err(BadReplyMagic(_))));
    }

    #[test]
    fn request_round_trip() {
        let h = RequestHeader {
            flags: 1,
            cmd: CMD_WRITE,
            cookie: 0xdead_beef,
            offset: 4096,
            length: 512,
        };
        let b = encode_request(&h);
        assert_eq!(parse_request(&b).unwrap(), Some(h));
        assert_eq!(parse_request(&b[..27]).unwrap(), None);
    }

    #[test]
    fn bad_magic_is_an_error() {
        let mut b = encode_request(&RequestHeader {
            flags: 0,
            cmd: 0,
            cookie: 0,
            offset: 0,
            length: 0,
        });
        b[0] ^= 0xff;
        assert!(parse_request(&b).is_err());
    }
}
