//! A small blocking NBD client for tests and tools.
//!
//! It speaks fixed-newstyle negotiation (`NBD_OPT_STRUCTURED_REPLY`,
//! `NBD_OPT_SET_META_CONTEXT` for `base:allocation`, then `NBD_OPT_GO` requesting
//! `NBD_INFO_BLOCK_SIZE`, falling back to `NBD_OPT_EXPORT_NAME` for servers without GO)
//! and the transmission phase with simple or structured replies.
//!
//! Because its main job is testing Tessera's server, it is strict: any reply that breaks a
//! MUST of the spec (overlapping or missing read chunks, a simple reply to a READ after
//! structured replies were negotiated, malformed block status, ...) is reported as an
//! `InvalidData` error rather than papered over. After such an error the connection is
//! out of sync and the client should be dropped.
//!
//! Two levels of API:
//! - convenience calls ([`NbdClient::read`], [`NbdClient::write`], ...) that send one
//!   request and wait for its reply, mapping NBD errors to `io::Error`s carrying the
//!   matching errno (`err.raw_os_error() == Some(libc::EPERM)`, ...);
//! - [`NbdClient::send_request`] / [`NbdClient::recv_reply`] for pipelining and for
//!   deliberately malformed requests; [`NbdClient::stream_mut`] gives raw access.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;

use tessera_io::cast::{u32_of, usize_of};

use crate::proto;

/// Anything the client can run over (`TcpStream`, `UnixStream`, in-memory test streams).
pub trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send + ?Sized> ReadWrite for T {}

/// What to negotiate beyond the bare minimum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientOptions {
    /// Ask for structured replies (`NBD_OPT_STRUCTURED_REPLY`).
    pub structured_replies: bool,
    /// Select `base:allocation` (only possible with structured replies).
    pub base_allocation: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            structured_replies: true,
            base_allocation: true,
        }
    }
}

/// One complete reply: a simple reply, or all chunks of a structured reply up to the one
/// flagged `NBD_REPLY_FLAG_DONE`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    pub cookie: u64,
    /// NBD error number (0 on success). For structured replies, the first error chunk's.
    pub error: u32,
    /// READ payload, reassembled at the request's offsets with holes zero-filled.
    /// Empty for other commands, and for failed reads that sent no content.
    pub data: Vec<u8>,
    /// Human-readable message from the first error chunk, if the server sent one.
    pub message: Option<String>,
    /// `(length, flags)` descriptors from an `NBD_REPLY_TYPE_BLOCK_STATUS` chunk.
    pub extents: Vec<(u32, u32)>,
    /// Whether the reply came as structured chunks.
    pub structured: bool,
}

/// Largest option reply payload accepted during the handshake (replies are a few hundred
/// bytes; strings are capped at 4096 by the spec).
const MAX_OPTION_REPLY: u32 = 1 << 20;
/// Largest non-data structured chunk: block status with twice the 2^20 extents the spec
/// says a server SHOULD NOT exceed.
const MAX_META_CHUNK: u32 = 4 + 8 * (2 << 20);
/// Largest error chunk: 4096-byte message plus the fixed fields, with slack.
const MAX_ERROR_CHUNK: u32 = 64 * 1024;
/// Cookies from here up are used by the convenience calls; pick others for `send_request`.
pub const AUTO_COOKIE_BASE: u64 = 1 << 63;

/// A request we sent and have not yet seen the final reply for.
#[derive(Debug, Clone, Copy)]
struct Inflight {
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
}

/// A structured reply being assembled.
#[derive(Debug, Default)]
struct Partial {
    reply: Reply,
    /// Offset of byte 0 of `reply.data` in the export, and the request length.
    base: u64,
    len: u32,
    /// Whether content chunks are legal (a READ, or an unknown cookie with a length hint).
    is_read: bool,
    /// Covered `[start, end)` ranges relative to `base`, to detect overlaps and gaps.
    covered: Vec<(u64, u64)>,
    block_status_chunks: u32,
}

pub struct NbdClient {
    stream: Box<dyn ReadWrite>,
    size: u64,
    flags: u16,
    block_size: Option<(u32, u32, u32)>,
    structured: bool,
    meta_context: Option<u32>,
    next_cookie: u64,
    inflight: HashMap<u64, Inflight>,
    partial: HashMap<u64, Partial>,
    /// Replies received while a convenience call waited for a different cookie.
    ready: VecDeque<Reply>,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient")
            .field("size", &self.size)
            .field("flags", &format_args!("{:#06x}", self.flags))
            .field("block_size", &self.block_size)
            .field("structured", &self.structured)
            .field("meta_context", &self.meta_context)
            .field("inflight", &self.inflight.len())
            .finish()
    }
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Map an NBD error number to an `io::Error` with the matching host errno. Unknown values
/// are treated as `EINVAL`, as the spec tells clients to.
pub fn nbd_error_to_io(code: u32) -> io::Error {
    let errno = match code {
        proto::EPERM => libc::EPERM,
        proto::EIO => libc::EIO,
        proto::ENOMEM => libc::ENOMEM,
        proto::EINVAL => libc::EINVAL,
        proto::ENOSPC => libc::ENOSPC,
        proto::EOVERFLOW => libc::EOVERFLOW,
        proto::ENOTSUP => libc::EOPNOTSUPP,
        proto::ESHUTDOWN => libc::ESHUTDOWN,
        _ => libc::EINVAL,
    };
    io::Error::from_raw_os_error(errno)
}

fn read_array<const N: usize>(s: &mut dyn ReadWrite) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn read_vec(s: &mut dyn ReadWrite, len: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0u8; len];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// One option reply from the server.
struct OptReply {
    ty: u32,
    data: Vec<u8>,
}

fn send_option(s: &mut dyn ReadWrite, opt: u32, data: &[u8]) -> io::Result<()> {
    let len = u32::try_from(data.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "option data too long"))?;
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b)?;
    s.flush()
}

fn recv_option_reply(s: &mut dyn ReadWrite, opt: u32) -> io::Result<OptReply> {
    let h: [u8; 20] = read_array(s)?;
    let magic = proto::be_u64(&h[0..8]);
    if magic != proto::OPTION_REPLY_MAGIC {
        return Err(invalid(format!("bad option reply magic {magic:#018x}")));
    }
    let echoed = proto::be_u32(&h[8..12]);
    if echoed != opt {
        return Err(invalid(format!(
            "option reply for option {echoed}, expected {opt}"
        )));
    }
    let ty = proto::be_u32(&h[12..16]);
    let len = proto::be_u32(&h[16..20]);
    if len > MAX_OPTION_REPLY {
        return Err(invalid(format!("option reply of {len} bytes is too large")));
    }
    Ok(OptReply {
        ty,
        data: read_vec(s, len as usize)?,
    })
}

/// Turn an option error reply into an `io::Error` that says what the server said.
fn option_error(what: &str, r: &OptReply) -> io::Error {
    let (kind, name) = match r.ty {
        proto::REP_ERR_UNSUP => (io::ErrorKind::Unsupported, "unsupported"),
        proto::REP_ERR_POLICY => (io::ErrorKind::PermissionDenied, "forbidden by policy"),
        proto::REP_ERR_INVALID => (io::ErrorKind::InvalidInput, "invalid"),
        proto::REP_ERR_PLATFORM => (io::ErrorKind::Unsupported, "unsupported on this platform"),
        proto::REP_ERR_TLS_REQD => (io::ErrorKind::PermissionDenied, "TLS required"),
        proto::REP_ERR_UNKNOWN => (io::ErrorKind::NotFound, "unknown export"),
        proto::REP_ERR_SHUTDOWN => (io::ErrorKind::ConnectionAborted, "server shutting down"),
        proto::REP_ERR_BLOCK_SIZE_REQD => (
            io::ErrorKind::InvalidInput,
            "block size negotiation required",
        ),
        proto::REP_ERR_TOO_BIG => (io::ErrorKind::InvalidInput, "too big"),
        _ if r.ty & proto::REP_FLAG_ERROR != 0 => (io::ErrorKind::Other, "error"),
        _ => {
            return invalid(format!(
                "{what}: unexpected option reply type {:#010x}",
                r.ty
            ))
        }
    };
    let msg = String::from_utf8_lossy(&r.data);
    if msg.is_empty() {
        io::Error::new(kind, format!("{what}: {name} ({:#010x})", r.ty))
    } else {
        io::Error::new(kind, format!("{what}: {name} ({:#010x}): {msg}", r.ty))
    }
}

/// Read the server greeting and send our client flags. Returns whether the server
/// offered `NBD_FLAG_NO_ZEROES` (which we then always accept).
fn greet(s: &mut dyn ReadWrite) -> io::Result<bool> {
    let g: [u8; 18] = read_array(s)?;
    if proto::be_u64(&g[0..8]) != proto::NBDMAGIC {
        return Err(invalid("not an NBD server (bad NBDMAGIC)"));
    }
    if proto::be_u64(&g[8..16]) != proto::IHAVEOPT {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "server uses oldstyle negotiation, which is not supported",
        ));
    }
    let hflags = u16::from_be_bytes([g[16], g[17]]);
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "server does not support fixed newstyle negotiation",
        ));
    }
    let no_zeroes = hflags & proto::FLAG_NO_ZEROES != 0;
    let mut cflags = proto::CLIENT_FLAG_FIXED_NEWSTYLE;
    if no_zeroes {
        cflags |= proto::CLIENT_FLAG_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes())?;
    s.flush()?;
    Ok(no_zeroes)
}

/// Result of the client handshake.
struct Handshaked {
    size: u64,
    flags: u16,
    block_size: Option<(u32, u32, u32)>,
    structured: bool,
    meta_context: Option<u32>,
}

fn handshake(s: &mut dyn ReadWrite, export: &str, opts: ClientOptions) -> io::Result<Handshaked> {
    let no_zeroes = greet(s)?;

    let mut structured = false;
    if opts.structured_replies {
        send_option(s, proto::OPT_STRUCTURED_REPLY, &[])?;
        let r = recv_option_reply(s, proto::OPT_STRUCTURED_REPLY)?;
        match r.ty {
            proto::REP_ACK => structured = true,
            // Any error just means "no structured replies"; carry on with simple ones.
            t if t & proto::REP_FLAG_ERROR != 0 => {}
            t => {
                return Err(invalid(format!(
                    "unexpected reply {t:#x} to NBD_OPT_STRUCTURED_REPLY"
                )))
            }
        }
    }

    let name_len = u32::try_from(export.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "export name too long"))?;

    let mut meta_context = None;
    if opts.base_allocation && structured {
        let mut d = Vec::new();
        d.extend_from_slice(&name_len.to_be_bytes());
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&u32_of(proto::BASE_ALLOCATION.len()).to_be_bytes());
        d.extend_from_slice(proto::BASE_ALLOCATION.as_bytes());
        send_option(s, proto::OPT_SET_META_CONTEXT, &d)?;
        loop {
            let r = recv_option_reply(s, proto::OPT_SET_META_CONTEXT)?;
            match r.ty {
                proto::REP_META_CONTEXT => {
                    if r.data.len() < 4 {
                        return Err(invalid("NBD_REP_META_CONTEXT shorter than its id"));
                    }
                    if &r.data[4..] != proto::BASE_ALLOCATION.as_bytes() {
                        return Err(invalid(format!(
                            "server selected context {:?} that was not asked for",
                            String::from_utf8_lossy(&r.data[4..])
                        )));
                    }
                    meta_context = Some(proto::be_u32(&r.data[0..4]));
                }
                proto::REP_ACK => break,
                // Per spec a failed SET selects nothing; block status is then unavailable.
                t if t & proto::REP_FLAG_ERROR != 0 => {
                    meta_context = None;
                    break;
                }
                t => {
                    return Err(invalid(format!(
                        "unexpected reply {t:#x} to NBD_OPT_SET_META_CONTEXT"
                    )))
                }
            }
        }
    }

    let mut d = Vec::new();
    d.extend_from_slice(&name_len.to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&1u16.to_be_bytes());
    d.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, proto::OPT_GO, &d)?;
    let mut export_info = None;
    let mut block_size = None;
    loop {
        let r = recv_option_reply(s, proto::OPT_GO)?;
        match r.ty {
            proto::REP_INFO => {
                if r.data.len() < 2 {
                    return Err(invalid("NBD_REP_INFO shorter than its type"));
                }
                match u16::from_be_bytes([r.data[0], r.data[1]]) {
                    proto::INFO_EXPORT => {
                        if r.data.len() != 12 {
                            return Err(invalid(format!(
                                "NBD_INFO_EXPORT of length {}, expected 12",
                                r.data.len()
                            )));
                        }
                        export_info = Some((
                            proto::be_u64(&r.data[2..10]),
                            u16::from_be_bytes([r.data[10], r.data[11]]),
                        ));
                    }
                    proto::INFO_BLOCK_SIZE => {
                        if r.data.len() != 14 {
                            return Err(invalid(format!(
                                "NBD_INFO_BLOCK_SIZE of length {}, expected 14",
                                r.data.len()
                            )));
                        }
                        block_size = Some((
                            proto::be_u32(&r.data[2..6]),
                            proto::be_u32(&r.data[6..10]),
                            proto::be_u32(&r.data[10..14]),
                        ));
                    }
                    _ => {} // Clients MUST ignore information types they do not understand.
                }
            }
            proto::REP_ACK => {
                let (size, flags) = export_info
                    .ok_or_else(|| invalid("NBD_OPT_GO succeeded without NBD_INFO_EXPORT"))?;
                return Ok(Handshaked {
                    size,
                    flags,
                    block_size,
                    structured,
                    meta_context,
                });
            }
            proto::REP_ERR_UNSUP => break, // an old server: fall back to EXPORT_NAME below
            _ => {
                return Err(option_error(
                    &format!("NBD_OPT_GO for export {export:?}"),
                    &r,
                ))
            }
        }
    }

    send_option(s, proto::OPT_EXPORT_NAME, export.as_bytes())?;
    let b: [u8; 10] = read_array(s)?;
    if !no_zeroes {
        let _: [u8; 124] = read_array(s)?;
    }
    Ok(Handshaked {
        size: proto::be_u64(&b[0..8]),
        flags: u16::from_be_bytes([b[8], b[9]]),
        block_size: None,
        structured,
        meta_context,
    })
}

impl NbdClient {
    /// Connect over TCP (with `TCP_NODELAY`, as the spec recommends) and negotiate.
    pub fn connect_tcp(addr: &str, export: &str, opts: ClientOptions) -> io::Result<NbdClient> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Self::from_stream(s, export, opts)
    }

    /// Connect over a Unix socket and negotiate.
    pub fn connect_unix(path: &Path, export: &str, opts: ClientOptions) -> io::Result<NbdClient> {
        Self::from_stream(UnixStream::connect(path)?, export, opts)
    }

    /// Negotiate over an already-connected stream.
    pub fn from_stream<S: ReadWrite + 'static>(
        stream: S,
        export: &str,
        opts: ClientOptions,
    ) -> io::Result<NbdClient> {
        let mut stream: Box<dyn ReadWrite> = Box::new(stream);
        let h = handshake(&mut *stream, export, opts)?;
        Ok(NbdClient {
            stream,
            size: h.size,
            flags: h.flags,
            block_size: h.block_size,
            structured: h.structured,
            meta_context: h.meta_context,
            next_cookie: AUTO_COOKIE_BASE,
            inflight: HashMap::new(),
            partial: HashMap::new(),
            ready: VecDeque::new(),
        })
    }

    /// `NBD_OPT_LIST` over TCP, then `NBD_OPT_ABORT`.
    pub fn list_exports_tcp(addr: &str) -> io::Result<Vec<String>> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Self::list_exports_over(s)
    }

    /// `NBD_OPT_LIST` over any stream, then a soft disconnect with `NBD_OPT_ABORT`.
    pub fn list_exports_over<S: ReadWrite>(mut stream: S) -> io::Result<Vec<String>> {
        let s: &mut dyn ReadWrite = &mut stream;
        greet(s)?;
        send_option(s, proto::OPT_LIST, &[])?;
        let mut names = Vec::new();
        loop {
            let r = recv_option_reply(s, proto::OPT_LIST)?;
            match r.ty {
                proto::REP_SERVER => {
                    if r.data.len() < 4 {
                        return Err(invalid("NBD_REP_SERVER shorter than its name length"));
                    }
                    let n = proto::be_u32(&r.data[0..4]) as usize;
                    let name = r.data[4..]
                        .get(..n)
                        .ok_or_else(|| invalid("NBD_REP_SERVER name length exceeds the reply"))?;
                    let name = String::from_utf8(name.to_vec())
                        .map_err(|_| invalid("export name is not UTF-8"))?;
                    names.push(name);
                }
                proto::REP_ACK => break,
                _ => return Err(option_error("NBD_OPT_LIST", &r)),
            }
        }
        send_option(s, proto::OPT_ABORT, &[])?;
        // The server may ACK or just close; either ends the session cleanly.
        let _ = recv_option_reply(s, proto::OPT_ABORT);
        Ok(names)
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn transmission_flags(&self) -> u16 {
        self.flags
    }

    /// `(minimum, preferred, maximum payload)` from `NBD_INFO_BLOCK_SIZE`, if sent.
    pub fn block_size(&self) -> Option<(u32, u32, u32)> {
        self.block_size
    }

    /// Whether structured replies were negotiated.
    pub fn structured_replies(&self) -> bool {
        self.structured
    }

    /// The id the server gave `base:allocation`, if it was selected.
    pub fn meta_context_id(&self) -> Option<u32> {
        self.meta_context
    }

    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let len = req_len(buf.len())?;
        let r = self.call(proto::CMD_READ, 0, offset, len, &[])?;
        if r.data.len() != buf.len() {
            return Err(invalid(format!(
                "READ returned {} bytes, expected {}",
                r.data.len(),
                buf.len()
            )));
        }
        buf.copy_from_slice(&r.data);
        Ok(())
    }

    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let len = req_len(data.len())?;
        let flags = if fua { proto::CMD_FLAG_FUA } else { 0 };
        self.call(proto::CMD_WRITE, flags, offset, len, data)
            .map(drop)
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.call(proto::CMD_FLUSH, 0, 0, 0, &[]).map(drop)
    }

    pub fn trim(&mut self, offset: u64, len: u32) -> io::Result<()> {
        self.call(proto::CMD_TRIM, 0, offset, len, &[]).map(drop)
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u32, flags: u16) -> io::Result<()> {
        self.call(proto::CMD_WRITE_ZEROES, flags, offset, len, &[])
            .map(drop)
    }

    pub fn cache(&mut self, offset: u64, len: u32) -> io::Result<()> {
        self.call(proto::CMD_CACHE, 0, offset, len, &[]).map(drop)
    }

    /// `NBD_CMD_BLOCK_STATUS` for `base:allocation`; returns `(length, flags)` extents.
    pub fn block_status(
        &mut self,
        offset: u64,
        len: u32,
        req_one: bool,
    ) -> io::Result<Vec<(u32, u32)>> {
        let flags = if req_one { proto::CMD_FLAG_REQ_ONE } else { 0 };
        Ok(self
            .call(proto::CMD_BLOCK_STATUS, flags, offset, len, &[])?
            .extents)
    }

    /// Soft disconnect: send `NBD_CMD_DISC` and drop the connection.
    pub fn disconnect(mut self) -> io::Result<()> {
        let cookie = self.alloc_cookie();
        self.send_request(proto::CMD_DISC, 0, cookie, 0, 0, &[])
    }

    /// Send one request without waiting. `payload` is sent verbatim after the header (it
    /// need not match `len`, so tests can send malformed requests). Cookies at or above
    /// [`AUTO_COOKIE_BASE`] are used by the convenience calls; avoid them here.
    pub fn send_request(
        &mut self,
        cmd: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        let h = proto::encode_request(&proto::RequestHeader {
            flags,
            cmd,
            cookie,
            offset,
            length: len,
        });
        // One write for small requests so a header never travels alone.
        if payload.len() <= 64 * 1024 {
            let mut b = Vec::with_capacity(h.len() + payload.len());
            b.extend_from_slice(&h);
            b.extend_from_slice(payload);
            self.stream.write_all(&b)?;
        } else {
            self.stream.write_all(&h)?;
            self.stream.write_all(payload)?;
        }
        self.stream.flush()?;
        if cmd != proto::CMD_DISC {
            self.inflight.insert(
                cookie,
                Inflight {
                    cmd,
                    flags,
                    offset,
                    len,
                },
            );
        }
        Ok(())
    }

    /// Receive the next complete reply, whichever request it answers. `read_len_for`
    /// gives the payload length of a successful *simple* reply for a cookie (the READ
    /// length, 0 for anything else), since simple replies do not carry it; for structured
    /// READ replies to a cookie this client did not send, it gives the buffer length.
    pub fn recv_reply(&mut self, read_len_for: impl Fn(u64) -> u32) -> io::Result<Reply> {
        if let Some(r) = self.ready.pop_front() {
            return Ok(r);
        }
        self.recv_from_wire(Some(&read_len_for))
    }

    /// Raw access to the connection, e.g. to send malformed bytes.
    pub fn stream_mut(&mut self) -> &mut dyn ReadWrite {
        &mut *self.stream
    }

    fn alloc_cookie(&mut self) -> u64 {
        loop {
            let c = self.next_cookie;
            self.next_cookie = self.next_cookie.wrapping_add(1).max(AUTO_COOKIE_BASE);
            if !self.inflight.contains_key(&c) {
                return c;
            }
        }
    }

    /// Send one request and wait for its reply; an NBD error becomes an `io::Error`.
    fn call(
        &mut self,
        cmd: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> io::Result<Reply> {
        let cookie = self.alloc_cookie();
        self.send_request(cmd, flags, cookie, offset, len, payload)?;
        let r = match self
            .ready
            .iter()
            .position(|r| r.cookie == cookie)
            .and_then(|i| self.ready.remove(i))
        {
            Some(r) => r,
            None => loop {
                let r = self.recv_from_wire(None)?;
                if r.cookie == cookie {
                    break r;
                }
                // Reply to a request pipelined with send_request: keep it for recv_reply.
                self.ready.push_back(r);
            },
        };
        if r.error != 0 {
            return Err(nbd_error_to_io(r.error));
        }
        Ok(r)
    }

    /// The READ length we asked for on `cookie`, or 0 if it is not a READ we sent.
    fn own_read_len(&self, cookie: u64) -> u32 {
        match self.inflight.get(&cookie) {
            Some(i) if i.cmd == proto::CMD_READ => i.len,
            _ => 0,
        }
    }

    fn recv_from_wire(&mut self, len_for: Option<&dyn Fn(u64) -> u32>) -> io::Result<Reply> {
        loop {
            let mut b = [0u8; proto::STRUCTURED_REPLY_LEN];
            self.stream.read_exact(&mut b[..4])?;
            let len =
                proto::reply_header_len(proto::be_u32(&b)).map_err(|e| invalid(e.to_string()))?;
            self.stream.read_exact(&mut b[4..len])?;
            let header = proto::parse_reply(&b[..len])
                .map_err(|e| invalid(e.to_string()))?
                .expect("a whole header was read");
            match header {
                proto::ReplyHeader::Simple { error, cookie } => {
                    if self.partial.contains_key(&cookie) {
                        return Err(invalid(format!("simple reply for cookie {cookie:#x} in the middle of a structured reply")));
                    }
                    if self.structured
                        && self
                            .inflight
                            .get(&cookie)
                            .is_some_and(|i| i.cmd == proto::CMD_READ)
                    {
                        return Err(invalid("simple reply to NBD_CMD_READ although structured replies were negotiated"));
                    }
                    let n = if error != 0 {
                        0
                    } else {
                        match len_for {
                            Some(f) => f(cookie),
                            None => self.own_read_len(cookie),
                        }
                    };
                    self.inflight.remove(&cookie);
                    let data = read_vec(&mut *self.stream, n as usize)?;
                    return Ok(Reply {
                        cookie,
                        error,
                        data,
                        ..Reply::default()
                    });
                }
                proto::ReplyHeader::Chunk {
                    flags,
                    ty,
                    cookie,
                    length,
                } => {
                    if !self.structured {
                        return Err(invalid("structured reply chunk although structured replies were not negotiated"));
                    }
                    if let Some(r) = self.chunk(flags, ty, cookie, length, len_for)? {
                        return Ok(r);
                    }
                }
            }
        }
    }

    /// Absorb one structured chunk; returns the finished reply when it carried DONE.
    fn chunk(
        &mut self,
        flags: u16,
        ty: u16,
        cookie: u64,
        length: u32,
        len_for: Option<&dyn Fn(u64) -> u32>,
    ) -> io::Result<Option<Reply>> {
        let inf = self.inflight.get(&cookie).copied();
        let meta_context = self.meta_context;
        let p = self
            .partial
            .entry(cookie)
            .or_insert_with(|| Partial::new(cookie, inf, len_for));
        let s = &mut *self.stream;
        match ty {
            proto::REPLY_TYPE_NONE => {
                if length != 0 {
                    return Err(invalid(format!("NBD_REPLY_TYPE_NONE with length {length}")));
                }
                if flags & proto::REPLY_FLAG_DONE == 0 {
                    return Err(invalid("NBD_REPLY_TYPE_NONE without NBD_REPLY_FLAG_DONE"));
                }
            }
            proto::REPLY_TYPE_OFFSET_DATA | proto::REPLY_TYPE_OFFSET_HOLE => {
                p.content(s, ty, cookie, length)?
            }
            proto::REPLY_TYPE_BLOCK_STATUS => p.block_status(s, length, inf, meta_context)?,
            t if t & 0x8000 != 0 => p.error(s, t, length)?,
            t => return Err(invalid(format!("unknown structured reply type {t}"))),
        }
        if flags & proto::REPLY_FLAG_DONE == 0 {
            return Ok(None);
        }
        let Some(p) = self.partial.remove(&cookie) else {
            return Ok(None);
        };
        self.inflight.remove(&cookie);
        p.finish(cookie, inf, meta_context).map(Some)
    }
}

impl Partial {
    /// The reply to `cookie`, whose request is `inf` if we sent it.
    fn new(cookie: u64, inf: Option<Inflight>, len_for: Option<&dyn Fn(u64) -> u32>) -> Partial {
        let (base, len, is_read) = match inf {
            Some(i) => (i.offset, i.len, i.cmd == proto::CMD_READ),
            // Not sent by us (raw bytes via stream_mut): assume a read at offset 0 of
            // the hinted length, if any.
            None => {
                let n = len_for.map_or(0, |f| f(cookie));
                (0, n, n > 0)
            }
        };
        Partial {
            reply: Reply {
                cookie,
                structured: true,
                ..Reply::default()
            },
            base,
            len,
            is_read,
            ..Partial::default()
        }
    }

    /// An OFFSET_DATA or OFFSET_HOLE chunk: its data lands at its place in the reply.
    fn content(
        &mut self,
        s: &mut dyn ReadWrite,
        ty: u16,
        cookie: u64,
        length: u32,
    ) -> io::Result<()> {
        if !self.is_read {
            return Err(invalid(format!(
                "content chunk for cookie {cookie:#x}, which is not a READ"
            )));
        }
        let hole = ty == proto::REPLY_TYPE_OFFSET_HOLE;
        if (hole && length != 12) || (!hole && length < 9) {
            return Err(invalid(format!(
                "content chunk type {ty} with bad length {length}"
            )));
        }
        let offset = u64::from_be_bytes(read_array(s)?);
        let n = if hole {
            u64::from(u32::from_be_bytes(read_array(s)?))
        } else {
            u64::from(length - 8)
        };
        if n == 0 {
            return Err(invalid("empty hole chunk"));
        }
        let start = offset.checked_sub(self.base);
        let end = start.and_then(|st| st.checked_add(n));
        let (start, end) = match (start, end) {
            (Some(st), Some(e)) if e <= u64::from(self.len) => (st, e),
            _ => {
                return Err(invalid(format!(
                    "content chunk [{offset}, +{n}) outside the request [{}, +{})",
                    self.base, self.len
                )))
            }
        };
        // Allocated on first content so that error-only replies cost nothing.
        if self.reply.data.len() != self.len as usize {
            self.reply.data = vec![0u8; self.len as usize];
        }
        let dst = &mut self.reply.data[usize_of(start)..usize_of(end)];
        if hole {
            dst.fill(0);
        } else {
            s.read_exact(dst)?;
        }
        self.covered.push((start, end));
        Ok(())
    }

    /// A BLOCK_STATUS chunk: one per context, descriptors of non-zero length.
    fn block_status(
        &mut self,
        s: &mut dyn ReadWrite,
        length: u32,
        inf: Option<Inflight>,
        meta_context: Option<u32>,
    ) -> io::Result<()> {
        if length < 12 || !(length - 4).is_multiple_of(8) || length > MAX_META_CHUNK {
            return Err(invalid(format!(
                "NBD_REPLY_TYPE_BLOCK_STATUS with bad length {length}"
            )));
        }
        if inf.is_some_and(|i| i.cmd != proto::CMD_BLOCK_STATUS) {
            return Err(invalid("block status chunk in reply to another command"));
        }
        let b = read_vec(s, length as usize)?;
        let id = proto::be_u32(&b[0..4]);
        if meta_context.is_some_and(|m| m != id) {
            return Err(invalid(format!(
                "block status for context id {id}, which was not selected"
            )));
        }
        self.block_status_chunks += 1;
        if self.block_status_chunks > 1 {
            return Err(invalid(
                "more than one block status chunk for a single context",
            ));
        }
        for d in b[4..].chunks_exact(8) {
            let (len, st) = (proto::be_u32(&d[0..4]), proto::be_u32(&d[4..8]));
            if len == 0 {
                return Err(invalid("block status descriptor of length 0"));
            }
            self.reply.extents.push((len, st));
        }
        if let Some(i) = inf.filter(|i| i.flags & proto::CMD_FLAG_REQ_ONE != 0) {
            if self.reply.extents.len() != 1 || self.reply.extents[0].0 > i.len {
                return Err(invalid(
                    "block status with REQ_ONE must return one extent within the request",
                ));
            }
        }
        Ok(())
    }

    /// An error chunk: the first error (and its message) is the reply's.
    fn error(&mut self, s: &mut dyn ReadWrite, t: u16, length: u32) -> io::Result<()> {
        // Every error chunk type starts with error + message length + message.
        let with_offset = t == proto::REPLY_TYPE_ERROR_OFFSET;
        let fixed = if with_offset { 14 } else { 6 };
        if length < fixed || length > MAX_ERROR_CHUNK {
            return Err(invalid(format!(
                "error chunk type {t:#x} with bad length {length}"
            )));
        }
        let b = read_vec(s, length as usize)?;
        let code = proto::be_u32(&b[0..4]);
        let mlen = usize::from(u16::from_be_bytes([b[4], b[5]]));
        if mlen > b.len() - fixed as usize {
            return Err(invalid("error chunk message longer than the chunk"));
        }
        if self.reply.error == 0 {
            // An error chunk with error 0 breaks a MUST; still count it as failed.
            self.reply.error = if code == 0 { proto::EINVAL } else { code };
            let msg = String::from_utf8_lossy(&b[6..6 + mlen]).into_owned();
            self.reply.message = (!msg.is_empty()).then_some(msg);
        }
        Ok(())
    }

    /// The DONE chunk came: check that the chunks add up to a valid reply.
    fn finish(
        mut self,
        cookie: u64,
        inf: Option<Inflight>,
        meta_context: Option<u32>,
    ) -> io::Result<Reply> {
        self.covered.sort_unstable();
        for w in self.covered.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(invalid(format!(
                    "overlapping content chunks in reply to cookie {cookie:#x}"
                )));
            }
        }
        if self.reply.error == 0 {
            if self.is_read {
                let total: u64 = self.covered.iter().map(|(s, e)| e - s).sum();
                if total != u64::from(self.len) {
                    return Err(invalid(format!(
                        "successful READ reply covered {total} of {} bytes",
                        self.len
                    )));
                }
                self.reply.data.resize(self.len as usize, 0);
            }
            if inf.is_some_and(|i| i.cmd == proto::CMD_BLOCK_STATUS)
                && meta_context.is_some()
                && self.block_status_chunks == 0
            {
                return Err(invalid(
                    "successful block status reply without a block status chunk",
                ));
            }
        }
        Ok(self.reply)
    }
}

fn req_len(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "request length does not fit in 32 bits",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::{negotiate, ExportCatalog, ExportInfo, HandshakeOutcome, Negotiated};
    use std::io::Cursor;
    use std::thread;

    struct Catalog;
    impl ExportCatalog for Catalog {
        fn list(&self) -> Vec<String> {
            vec!["disk0".into(), "small".into()]
        }
        fn lookup(&self, name: &str) -> Option<ExportInfo> {
            match name {
                "disk0" => Some(ExportInfo {
                    size: 1 << 20,
                    read_only: false,
                    description: "test disk".into(),
                    tls_required: false,
                }),
                "small" => Some(ExportInfo {
                    size: 8192,
                    read_only: true,
                    description: String::new(),
                    tls_required: false,
                }),
                _ => None,
            }
        }
    }

    /// A deliberately simple transmission-phase server over a Vec, enough to exercise the
    /// client's reply parsing (structured replies split reads into a data and a hole chunk).
    fn serve(mut s: UnixStream, n: Negotiated) {
        let mut disk = vec![0u8; usize_of(n.size)];
        loop {
            let mut h = [0u8; proto::REQUEST_HEADER_LEN];
            if s.read_exact(&mut h).is_err() {
                return;
            }
            let req = proto::parse_request(&h).unwrap().unwrap();
            let (off, len) = (usize_of(req.offset), req.length as usize);
            let in_range = off.checked_add(len).is_some_and(|e| e <= disk.len());
            let mut out = Vec::new();
            let simple = |out: &mut Vec<u8>, err: u32| {
                let mut b = [0u8; proto::SIMPLE_REPLY_LEN];
                proto::encode_simple_reply(&mut b, err, req.cookie);
                out.extend_from_slice(&b);
            };
            let chunk = |out: &mut Vec<u8>, flags: u16, ty: u16, payload: &[u8]| {
                let mut b = [0u8; proto::STRUCTURED_REPLY_LEN];
                proto::encode_structured_reply(
                    &mut b,
                    flags,
                    ty,
                    req.cookie,
                    u32_of(payload.len()),
                );
                out.extend_from_slice(&b);
                out.extend_from_slice(payload);
            };
            match req.cmd {
                proto::CMD_DISC => return,
                proto::CMD_READ if !n.structured_replies => {
                    if in_range {
                        simple(&mut out, 0);
                        out.extend_from_slice(&disk[off..off + len]);
                    } else {
                        simple(&mut out, proto::EINVAL);
                    }
                }
                proto::CMD_READ => {
                    if !in_range {
                        let mut p = proto::EINVAL.to_be_bytes().to_vec();
                        p.extend_from_slice(&(9u16).to_be_bytes());
                        p.extend_from_slice(b"too far!!");
                        chunk(
                            &mut out,
                            proto::REPLY_FLAG_DONE,
                            proto::REPLY_TYPE_ERROR,
                            &p,
                        );
                    } else {
                        // Second half as a hole if it is all zero, then the first half as
                        // data (out of order on purpose), then NONE.
                        let mid = len / 2;
                        if disk[off + mid..off + len].iter().all(|&b| b == 0) && mid < len {
                            let mut p = ((off + mid) as u64).to_be_bytes().to_vec();
                            p.extend_from_slice(&u32_of(len - mid).to_be_bytes());
                            chunk(&mut out, 0, proto::REPLY_TYPE_OFFSET_HOLE, &p);
                        } else if mid < len {
                            let mut p = ((off + mid) as u64).to_be_bytes().to_vec();
                            p.extend_from_slice(&disk[off + mid..off + len]);
                            chunk(&mut out, 0, proto::REPLY_TYPE_OFFSET_DATA, &p);
                        }
                        if mid > 0 {
                            let mut p = (off as u64).to_be_bytes().to_vec();
                            p.extend_from_slice(&disk[off..off + mid]);
                            chunk(&mut out, 0, proto::REPLY_TYPE_OFFSET_DATA, &p);
                        }
                        chunk(
                            &mut out,
                            proto::REPLY_FLAG_DONE,
                            proto::REPLY_TYPE_NONE,
                            &[],
                        );
                    }
                }
                proto::CMD_WRITE => {
                    let mut data = vec![0u8; len];
                    s.read_exact(&mut data).unwrap();
                    if n.read_only {
                        simple(&mut out, proto::EPERM);
                    } else if !in_range {
                        simple(&mut out, proto::ENOSPC);
                    } else {
                        disk[off..off + len].copy_from_slice(&data);
                        simple(&mut out, 0);
                    }
                }
                proto::CMD_WRITE_ZEROES | proto::CMD_TRIM if in_range => {
                    disk[off..off + len].fill(0);
                    simple(&mut out, 0);
                }
                proto::CMD_FLUSH | proto::CMD_CACHE => simple(&mut out, 0),
                proto::CMD_BLOCK_STATUS if n.base_allocation.is_some() && in_range => {
                    let mut p = n.base_allocation.unwrap().to_be_bytes().to_vec();
                    let zero = disk[off..off + len].iter().all(|&b| b == 0);
                    let flags = if zero {
                        proto::STATE_ZERO | proto::STATE_HOLE
                    } else {
                        0
                    };
                    if req.flags & proto::CMD_FLAG_REQ_ONE != 0 || len < 1024 {
                        p.extend_from_slice(&u32_of(len).to_be_bytes());
                        p.extend_from_slice(&flags.to_be_bytes());
                    } else {
                        p.extend_from_slice(&512u32.to_be_bytes());
                        p.extend_from_slice(&flags.to_be_bytes());
                        p.extend_from_slice(&u32_of(len - 512).to_be_bytes());
                        p.extend_from_slice(&flags.to_be_bytes());
                    }
                    chunk(
                        &mut out,
                        proto::REPLY_FLAG_DONE,
                        proto::REPLY_TYPE_BLOCK_STATUS,
                        &p,
                    );
                }
                _ => simple(&mut out, proto::EINVAL),
            }
            if s.write_all(&out).is_err() {
                return;
            }
        }
    }

    fn pair(
        export: &str,
        opts: ClientOptions,
    ) -> (
        io::Result<NbdClient>,
        thread::JoinHandle<Option<Negotiated>>,
    ) {
        let (c, mut s) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || match negotiate(&mut s, &Catalog) {
            Ok(HandshakeOutcome::Transmission(n)) => {
                serve(s, n.clone());
                Some(n)
            }
            _ => None,
        });
        (NbdClient::from_stream(c, export, opts), t)
    }

    #[test]
    fn handshake_and_io_with_structured_replies() {
        let (c, t) = pair("disk0", ClientOptions::default());
        let mut c = c.unwrap();
        assert_eq!(c.size(), 1 << 20);
        assert_eq!(
            c.block_size(),
            Some((proto::MIN_BLOCK, proto::PREFERRED_BLOCK, proto::MAX_PAYLOAD))
        );
        assert_eq!(c.transmission_flags(), proto::transmission_flags(false));
        assert!(c.structured_replies());
        assert_eq!(c.meta_context_id(), Some(1));

        let mut buf = vec![0xffu8; 8192];
        c.read(4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..8192u32).map(|i| i.to_le_bytes()[0]).collect();
        c.write(4096, &data, true).unwrap();
        c.read(4096, &mut buf).unwrap();
        assert_eq!(buf, data);
        c.flush().unwrap();
        c.cache(0, 4096).unwrap();
        assert_eq!(
            c.block_status(4096, 4096, false).unwrap(),
            vec![(512, 0), (3584, 0)]
        );
        assert_eq!(
            c.block_status(0, 4096, true).unwrap(),
            vec![(4096, proto::STATE_HOLE | proto::STATE_ZERO)]
        );
        c.write_zeroes(4096, 4096, 0).unwrap();
        c.trim(8192, 4096).unwrap();
        c.read(4096, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));

        // Errors map to errno values.
        let e = c.read(1 << 20, &mut buf).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        let e = c.write(1 << 20, &data, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));

        // Pipelining: two requests in flight, replies collected by cookie.
        c.send_request(proto::CMD_READ, 0, 7, 0, 512, &[]).unwrap();
        c.send_request(proto::CMD_READ, 0, 8, 1 << 20, 512, &[])
            .unwrap();
        let r1 = c.recv_reply(|_| 512).unwrap();
        let r2 = c.recv_reply(|_| 512).unwrap();
        assert_eq!((r1.cookie, r1.error, r1.data.len()), (7, 0, 512));
        assert_eq!(
            (r2.cookie, r2.error, r2.message.as_deref()),
            (8, proto::EINVAL, Some("too far!!"))
        );
        assert!(r1.structured && r2.structured);

        c.disconnect().unwrap();
        let n = t.join().unwrap().unwrap();
        assert!(n.block_size_negotiated && n.structured_replies && n.no_zeroes);
    }

    #[test]
    fn simple_replies_only() {
        let opts = ClientOptions {
            structured_replies: false,
            base_allocation: true,
        };
        let (c, t) = pair("small", opts);
        let mut c = c.unwrap();
        assert!(!c.structured_replies());
        assert_eq!(c.meta_context_id(), None);
        assert_eq!(c.transmission_flags() & proto::TFLAG_SEND_DF, 0);
        assert_ne!(c.transmission_flags() & proto::TFLAG_READ_ONLY, 0);
        let mut buf = vec![1u8; 4096];
        c.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        let e = c.write(0, &buf, false).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPERM));
        // No context selected: the server refuses block status.
        assert_eq!(
            c.block_status(0, 4096, false).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        c.disconnect().unwrap();
        let n = t.join().unwrap().unwrap();
        assert_eq!(n.export_name, "small");
        assert_eq!(n.base_allocation, None);
    }

    #[test]
    fn unknown_export_is_not_found() {
        let (c, t) = pair("nope", ClientOptions::default());
        let e = c.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("nope"), "{e}");
        drop(e);
        // The client hangs up after the error; the server sees EOF.
        assert!(t.join().unwrap().is_none());
    }

    #[test]
    fn list_exports() {
        let (c, mut s) = UnixStream::pair().unwrap();
        let t = thread::spawn(move || {
            matches!(negotiate(&mut s, &Catalog), Ok(HandshakeOutcome::Closed))
        });
        assert_eq!(
            NbdClient::list_exports_over(c).unwrap(),
            vec!["disk0".to_string(), "small".to_string()]
        );
        assert!(t.join().unwrap());
    }

    #[test]
    fn tcp_round_trip() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = l.accept().unwrap();
                let _ = negotiate(&mut s, &Catalog);
            }
        });
        assert_eq!(NbdClient::list_exports_tcp(&addr).unwrap().len(), 2);
        let c = NbdClient::connect_tcp(&addr, "", ClientOptions::default()).unwrap();
        assert_eq!(c.size(), 1 << 20);
        drop(c);
        t.join().unwrap();
    }

    /// In-memory stream for feeding canned server bytes.
    struct Canned(Cursor<Vec<u8>>);
    impl Read for Canned {
        fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
            self.0.read(b)
        }
    }
    impl Write for Canned {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn opt_reply(out: &mut Vec<u8>, opt: u32, ty: u32, data: &[u8]) {
        out.extend_from_slice(&proto::OPTION_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&opt.to_be_bytes());
        out.extend_from_slice(&ty.to_be_bytes());
        out.extend_from_slice(&u32_of(data.len()).to_be_bytes());
        out.extend_from_slice(data);
    }

    /// What a well-behaved server sends for a default-options client handshake.
    fn server_preamble() -> Vec<u8> {
        let mut o = Vec::new();
        o.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
        o.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        o.extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
        opt_reply(&mut o, proto::OPT_STRUCTURED_REPLY, proto::REP_ACK, &[]);
        let mut m = 1u32.to_be_bytes().to_vec();
        m.extend_from_slice(b"base:allocation");
        opt_reply(
            &mut o,
            proto::OPT_SET_META_CONTEXT,
            proto::REP_META_CONTEXT,
            &m,
        );
        opt_reply(&mut o, proto::OPT_SET_META_CONTEXT, proto::REP_ACK, &[]);
        let mut e = proto::INFO_EXPORT.to_be_bytes().to_vec();
        e.extend_from_slice(&(1u64 << 20).to_be_bytes());
        e.extend_from_slice(&proto::transmission_flags(false).to_be_bytes());
        opt_reply(&mut o, proto::OPT_GO, proto::REP_INFO, &e);
        opt_reply(&mut o, proto::OPT_GO, proto::REP_ACK, &[]);
        o
    }

    fn chunk(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, payload: &[u8]) {
        let mut b = [0u8; proto::STRUCTURED_REPLY_LEN];
        proto::encode_structured_reply(&mut b, flags, ty, cookie, u32_of(payload.len()));
        out.extend_from_slice(&b);
        out.extend_from_slice(payload);
    }

    fn canned_client(replies: &[u8]) -> NbdClient {
        let mut input = server_preamble();
        input.extend_from_slice(replies);
        NbdClient::from_stream(
            Canned(Cursor::new(input)),
            "disk0",
            ClientOptions::default(),
        )
        .unwrap()
    }

    #[test]
    fn interleaved_chunks_are_reassembled_per_cookie() {
        let mut r = Vec::new();
        let data = |off: u64, fill: u8, n: usize| {
            let mut p = off.to_be_bytes().to_vec();
            p.extend(std::iter::repeat_n(fill, n));
            p
        };
        chunk(
            &mut r,
            0,
            proto::REPLY_TYPE_OFFSET_DATA,
            1,
            &data(512, 0xaa, 512),
        );
        chunk(
            &mut r,
            0,
            proto::REPLY_TYPE_OFFSET_DATA,
            2,
            &data(0, 0xbb, 512),
        );
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_DATA,
            2,
            &data(512, 0xcc, 512),
        );
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_DATA,
            1,
            &data(1024, 0xdd, 512),
        );
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 512, 1024, &[])
            .unwrap();
        c.send_request(proto::CMD_READ, 0, 2, 0, 1024, &[]).unwrap();
        let a = c.recv_reply(|_| 0).unwrap();
        let b = c.recv_reply(|_| 0).unwrap();
        assert_eq!(a.cookie, 2);
        assert_eq!(&a.data[..512], &[0xbb; 512][..]);
        assert_eq!(&a.data[512..], &[0xcc; 512][..]);
        assert_eq!(b.cookie, 1);
        assert_eq!(&b.data[..512], &[0xaa; 512][..]);
        assert_eq!(&b.data[512..], &[0xdd; 512][..]);
    }

    #[test]
    fn bad_structured_reads_are_rejected() {
        let hole = |off: u64, n: u32| {
            let mut p = off.to_be_bytes().to_vec();
            p.extend_from_slice(&n.to_be_bytes());
            p
        };
        // Gap: only half covered, yet DONE without error.
        let mut r = Vec::new();
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_HOLE,
            1,
            &hole(0, 512),
        );
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 0, 1024, &[]).unwrap();
        assert_eq!(
            c.recv_reply(|_| 0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        // Overlap.
        let mut r = Vec::new();
        chunk(&mut r, 0, proto::REPLY_TYPE_OFFSET_HOLE, 1, &hole(0, 1024));
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_HOLE,
            1,
            &hole(512, 512),
        );
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 0, 1024, &[]).unwrap();
        assert_eq!(
            c.recv_reply(|_| 0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        // Outside the request.
        let mut r = Vec::new();
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_OFFSET_HOLE,
            1,
            &hole(4096, 512),
        );
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 0, 1024, &[]).unwrap();
        assert_eq!(
            c.recv_reply(|_| 0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        // Simple reply to a READ after structured replies were negotiated.
        let mut r = vec![0u8; proto::SIMPLE_REPLY_LEN];
        proto::encode_simple_reply(&mut r, 0, 1);
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 0, 1024, &[]).unwrap();
        assert_eq!(
            c.recv_reply(|_| 0).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }

    #[test]
    fn error_offset_chunk() {
        let mut p = proto::EIO.to_be_bytes().to_vec();
        p.extend_from_slice(&3u16.to_be_bytes());
        p.extend_from_slice(b"bad");
        p.extend_from_slice(&512u64.to_be_bytes());
        let mut r = Vec::new();
        chunk(
            &mut r,
            proto::REPLY_FLAG_DONE,
            proto::REPLY_TYPE_ERROR_OFFSET,
            1,
            &p,
        );
        let mut c = canned_client(&r);
        c.send_request(proto::CMD_READ, 0, 1, 0, 1024, &[]).unwrap();
        let rep = c.recv_reply(|_| 0).unwrap();
        assert_eq!(
            (rep.error, rep.message.as_deref()),
            (proto::EIO, Some("bad"))
        );
        assert_eq!(nbd_error_to_io(rep.error).raw_os_error(), Some(libc::EIO));
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn handshake_never_panics_on_arbitrary_server_bytes(input in proptest::collection::vec(any::<u8>(), 0..256)) {
                let _ = NbdClient::from_stream(Canned(Cursor::new(input.clone())), "disk0", ClientOptions::default());
                let _ = NbdClient::list_exports_over(Canned(Cursor::new(input)));
            }

            #[test]
            fn replies_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512), cookies in proptest::collection::vec(0u64..4, 1..4)) {
                let mut c = canned_client(&tail);
                for (i, &ck) in cookies.iter().enumerate() {
                    let cmd = [proto::CMD_READ, proto::CMD_BLOCK_STATUS, proto::CMD_WRITE, proto::CMD_FLUSH][i % 4];
                    c.send_request(cmd, 0, ck, 0, 4096, &[]).unwrap();
                }
                // Each successful reply consumes at least one header, so this terminates.
                while c.recv_reply(|ck| if ck == 0 { 4096 } else { 0 }).is_ok() {}
            }

            #[test]
            fn framed_chunks_never_panic(chunks in proptest::collection::vec((any::<u16>(), prop_oneof![0u16..8, Just(0x8001u16), Just(0x8002u16), any::<u16>()], 0u64..3, proptest::collection::vec(any::<u8>(), 0..40)), 0..8)) {
                let mut r = Vec::new();
                for (flags, ty, ck, p) in &chunks {
                    chunk(&mut r, *flags, *ty, *ck, p);
                }
                let mut c = canned_client(&r);
                c.send_request(proto::CMD_READ, 0, 0, 0, 32, &[]).unwrap();
                c.send_request(proto::CMD_BLOCK_STATUS, proto::CMD_FLAG_REQ_ONE, 1, 0, 32, &[]).unwrap();
                while c.recv_reply(|_| 16).is_ok() {}
            }
        }
    }
}
