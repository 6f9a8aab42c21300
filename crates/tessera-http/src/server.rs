//! HTTP/1.1 server: thread-per-connection, keep-alive, Content-Length bodies.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{find_head_end, head_lines, is_token, percent_decode, reason_phrase};
use crate::{Handler, Request, Response};

/// Largest accepted request head (request line plus headers), in bytes.
/// Larger heads are answered with 431.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Largest accepted request body, in bytes. Larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Time allowed to receive one complete request (head and body), counted
/// from when the server starts waiting for it. This also bounds how long an
/// idle keep-alive connection is held open.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Maximum number of connections served at once; further connections are
/// answered with 503 and closed.
pub const MAX_CONNECTIONS: usize = 64;

/// How long a single response write may block on a client that is not
/// reading.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Upper bound on time spent discarding unread request bytes before closing
/// a connection we rejected (so the client sees our response instead of a
/// connection reset).
const LINGER_TIME: Duration = Duration::from_secs(2);
/// Upper bound on bytes discarded while lingering.
const LINGER_BYTES: u64 = 16 * 1024 * 1024;
/// Size of the read chunk used for sockets.
const READ_CHUNK: usize = 16 * 1024;

/// Server limits; [`Default`] gives the documented production values. Tests
/// construct smaller ones.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub max_header_bytes: usize,
    pub max_body_bytes: usize,
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_header_bytes: MAX_HEADER_BYTES,
            max_body_bytes: MAX_BODY_BYTES,
            read_timeout: READ_TIMEOUT,
            write_timeout: WRITE_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
        }
    }
}

/// The socket operations the server needs beyond `Read + Write`.
pub(crate) trait Conn: Read + Write + Send + 'static {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()>;
    fn shutdown_write(&self) -> io::Result<()>;
}

macro_rules! impl_conn {
    ($ty:ty) => {
        impl Conn for $ty {
            fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$ty>::set_read_timeout(self, timeout)
            }
            fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
                <$ty>::set_write_timeout(self, timeout)
            }
            fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
                <$ty>::set_nonblocking(self, nonblocking)
            }
            fn shutdown_write(&self) -> io::Result<()> {
                <$ty>::shutdown(self, Shutdown::Write)
            }
        }
    };
}

impl_conn!(UnixStream);
impl_conn!(TcpStream);

/// Serves `handler` forever on a Unix-domain listener.
///
/// One thread per connection; keep-alive is supported; request bodies must
/// be framed with `Content-Length`. See the crate constants for limits.
pub fn serve_unix(listener: UnixListener, handler: Handler) {
    serve(listener.incoming(), handler, Limits::default());
}

/// Serves `handler` forever on a TCP listener. Same behaviour as
/// [`serve_unix`].
pub fn serve_tcp(listener: TcpListener, handler: Handler) {
    serve(tcp_incoming(&listener), handler, Limits::default());
}

/// Accepted TCP connections with Nagle disabled (responses are written in a
/// single call, so there is nothing to coalesce).
pub(crate) fn tcp_incoming(
    listener: &TcpListener,
) -> impl Iterator<Item = io::Result<TcpStream>> + '_ {
    listener.incoming().map(|conn| {
        conn.inspect(|stream| {
            let _ = stream.set_nodelay(true);
        })
    })
}

/// Decrements the active-connection count when the connection ends
/// (including when its thread could not be spawned or panicked).
struct ActiveGuard(Arc<AtomicUsize>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Accept loop shared by the Unix and TCP front ends.
pub(crate) fn serve<C: Conn>(
    incoming: impl Iterator<Item = io::Result<C>>,
    handler: Handler,
    limits: Limits,
) {
    let limits = Arc::new(limits);
    let active = Arc::new(AtomicUsize::new(0));
    for conn in incoming {
        let conn = match conn {
            Ok(conn) => conn,
            Err(err) => {
                accept_backoff(&err);
                continue;
            }
        };
        if active.fetch_add(1, Ordering::SeqCst) >= limits.max_connections {
            active.fetch_sub(1, Ordering::SeqCst);
            reject_busy(conn);
            continue;
        }
        let guard = ActiveGuard(Arc::clone(&active));
        let handler = Arc::clone(&handler);
        let limits = Arc::clone(&limits);
        // If the spawn fails the closure (and with it the connection and the
        // guard) is dropped: the client sees the connection close.
        let _ = std::thread::Builder::new()
            .name("tessera-http-conn".into())
            .spawn(move || {
                let _guard = guard;
                handle_connection(conn, &handler, &limits);
            });
    }
}

/// Avoids a hot loop when `accept` keeps failing (e.g. out of descriptors).
fn accept_backoff(err: &io::Error) {
    match err.kind() {
        ErrorKind::Interrupted | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset => {}
        _ => std::thread::sleep(Duration::from_millis(50)),
    }
}

/// Answers a connection beyond the concurrency cap with 503 and closes it,
/// without ever blocking the accept loop.
fn reject_busy<C: Conn>(mut conn: C) {
    if conn.set_nonblocking(true).is_err() {
        return;
    }
    let response = Response::error(503, "server busy: too many concurrent connections");
    let _ = conn.write_all(&encode_response(&response, false, ConnHeader::Close));
    let _ = conn.shutdown_write();
    // Discard whatever the client already sent, so closing does not turn
    // into a reset that destroys the 503 before the client reads it.
    let mut scratch = [0u8; 4096];
    for _ in 0..16 {
        match conn.read(&mut scratch) {
            Ok(n) if n > 0 => continue,
            _ => break,
        }
    }
}

/// What the `Connection` response header should say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnHeader {
    /// No header: HTTP/1.1 default (persistent).
    Omit,
    /// `Connection: close` — the server closes after this response.
    Close,
    /// `Connection: keep-alive` — persistent HTTP/1.0 connection.
    KeepAlive,
}

fn encode_response(response: &Response, head_only: bool, connection: ConnHeader) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        response.status,
        reason_phrase(response.status),
        response.body.len()
    );
    match connection {
        ConnHeader::Omit => {}
        ConnHeader::Close => out.push_str("Connection: close\r\n"),
        ConnHeader::KeepAlive => out.push_str("Connection: keep-alive\r\n"),
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    if !head_only {
        bytes.extend_from_slice(response.body.as_bytes());
    }
    bytes
}

/// A request ready for the handler plus connection-management facts.
struct Incoming {
    request: Request,
    /// The client wants (and may have) a persistent connection.
    keep_alive: bool,
    /// The request was HTTP/1.0 (needs an explicit keep-alive header).
    http10: bool,
    /// HEAD request: send headers only.
    head_only: bool,
}

/// Why a request could not be read.
#[derive(Debug)]
enum Reject {
    /// Drop the connection without a response (client went away, I/O error).
    Close,
    /// Send an error response, then close the connection. `unread` is how
    /// many more request bytes the client is expected to send (to discard
    /// while lingering).
    Respond {
        status: u16,
        message: String,
        unread: u64,
    },
}

impl Reject {
    fn respond(status: u16, message: impl Into<String>) -> Reject {
        Reject::Respond {
            status,
            message: message.into(),
            unread: 0,
        }
    }
}

fn handle_connection<C: Conn>(mut conn: C, handler: &Handler, limits: &Limits) {
    let _ = conn.set_write_timeout(Some(limits.write_timeout));
    // Bytes received but not yet consumed (may hold pipelined requests).
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let incoming = match read_request(&mut conn, &mut buf, limits) {
            Ok(Some(incoming)) => incoming,
            Ok(None) | Err(Reject::Close) => return,
            Err(Reject::Respond {
                status,
                message,
                unread,
            }) => {
                let response = Response::error(status, &message);
                let bytes = encode_response(&response, false, ConnHeader::Close);
                if conn.write_all(&bytes).and_then(|()| conn.flush()).is_ok() {
                    linger(&mut conn, unread);
                }
                return;
            }
        };
        let response = run_handler(handler, &incoming.request);
        let connection = match (incoming.keep_alive, incoming.http10) {
            (false, _) => ConnHeader::Close,
            (true, true) => ConnHeader::KeepAlive,
            (true, false) => ConnHeader::Omit,
        };
        let bytes = encode_response(&response, incoming.head_only, connection);
        if conn.write_all(&bytes).and_then(|()| conn.flush()).is_err() || !incoming.keep_alive {
            return;
        }
    }
}

/// Runs the handler, turning a panic into a 500 so one bad request cannot
/// take down the connection thread's peers or the server.
fn run_handler(handler: &Handler, request: &Request) -> Response {
    match catch_unwind(AssertUnwindSafe(|| handler(request))) {
        Ok(response) if (200..=599).contains(&response.status) => response,
        Ok(response) => Response::error(
            500,
            &format!(
                "internal error: handler returned invalid status {}",
                response.status
            ),
        ),
        Err(payload) => {
            let detail = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned());
            let message = match detail {
                Some(detail) => format!("internal error: request handler panicked: {detail}"),
                None => "internal error: request handler panicked".to_string(),
            };
            Response::error(500, &message)
        }
    }
}

/// Half-closes the connection and discards up to `unread` (bounded) further
/// request bytes for a short while, so the client can read our error
/// response instead of getting a connection reset.
fn linger<C: Conn>(conn: &mut C, unread: u64) {
    let _ = conn.shutdown_write();
    let budget = unread.clamp(64 * 1024, LINGER_BYTES);
    let deadline = Instant::now() + LINGER_TIME;
    let mut discarded = 0u64;
    let mut scratch = Vec::new();
    while discarded < budget {
        scratch.clear();
        match fill(conn, &mut scratch, deadline) {
            Ok(0) | Err(_) => return,
            Ok(n) => discarded += n as u64,
        }
    }
}

/// Reads more bytes into `buf`, waiting at most until `deadline`. Returns
/// the number of bytes read (0 at end of stream). Timeouts are reported as
/// `ErrorKind::TimedOut`.
fn fill<C: Conn>(conn: &mut C, buf: &mut Vec<u8>, deadline: Instant) -> io::Result<usize> {
    let mut chunk = [0u8; READ_CHUNK];
    loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(ErrorKind::TimedOut.into());
        }
        conn.set_read_timeout(Some(deadline - now))?;
        match conn.read(&mut chunk) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ErrorKind::TimedOut.into())
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads one request from the connection. `Ok(None)` means the client
/// closed (or idled out) cleanly between requests.
fn read_request<C: Conn>(
    conn: &mut C,
    buf: &mut Vec<u8>,
    limits: &Limits,
) -> Result<Option<Incoming>, Reject> {
    let deadline = Instant::now() + limits.read_timeout;

    // Phase 1: the head.
    let (head_len, consumed) = loop {
        // Tolerate stray blank lines between requests (RFC 9112 §2.2).
        let blank = buf
            .iter()
            .take_while(|&&b| b == b'\r' || b == b'\n')
            .count();
        buf.drain(..blank);
        if let Some(found) = find_head_end(buf) {
            break found;
        }
        if buf.len() > limits.max_header_bytes {
            return Err(too_large_head(limits));
        }
        match fill(conn, buf, deadline) {
            Ok(0) => {
                return if buf.is_empty() {
                    Ok(None)
                } else {
                    Err(Reject::Close)
                }
            }
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                return if buf.is_empty() {
                    Ok(None)
                } else {
                    Err(Reject::respond(408, "timed out waiting for the request"))
                };
            }
            Err(_) => return Err(Reject::Close),
        }
    };
    if head_len > limits.max_header_bytes {
        return Err(too_large_head(limits));
    }
    let head = parse_head(&buf[..head_len])?;
    buf.drain(..consumed);

    // Phase 2: the body.
    let length = head.content_length;
    if length > limits.max_body_bytes as u64 {
        return Err(Reject::Respond {
            status: 413,
            message: format!(
                "request body of {length} bytes exceeds the limit of {} bytes",
                limits.max_body_bytes
            ),
            unread: length.saturating_sub(buf.len() as u64),
        });
    }
    let length = length as usize; // fits: bounded by max_body_bytes
    if head.expect_continue
        && buf.len() < length
        && conn.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err()
    {
        return Err(Reject::Close);
    }
    while buf.len() < length {
        match fill(conn, buf, deadline) {
            Ok(0) => return Err(Reject::Close),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                return Err(Reject::respond(
                    408,
                    "timed out waiting for the request body",
                ));
            }
            Err(_) => return Err(Reject::Close),
        }
    }
    let rest = buf.split_off(length);
    let body = std::mem::replace(buf, rest);

    Ok(Some(Incoming {
        head_only: head.method == "HEAD",
        keep_alive: head.keep_alive,
        http10: head.http10,
        request: Request {
            method: head.method,
            path: head.path,
            query: head.query,
            body,
        },
    }))
}

fn too_large_head(limits: &Limits) -> Reject {
    Reject::respond(
        431,
        format!(
            "request head exceeds the limit of {} bytes",
            limits.max_header_bytes
        ),
    )
}

/// The parts of a request head the server acts on.
#[derive(Debug)]
struct Head {
    method: String,
    path: String,
    query: Vec<(String, String)>,
    content_length: u64,
    keep_alive: bool,
    http10: bool,
    expect_continue: bool,
}

fn parse_head(head: &[u8]) -> Result<Head, Reject> {
    let mut lines = head_lines(head);
    let request_line = lines.next().unwrap_or_default();
    let (method, path, query, http10) = parse_request_line(request_line)?;

    let mut content_length: Option<u64> = None;
    let mut chunked_or_other_te = false;
    let mut conn_close = false;
    let mut conn_keep_alive = false;
    let mut expect_continue = false;
    for line in lines {
        if line[0] == b' ' || line[0] == b'\t' {
            return Err(Reject::respond(
                400,
                "obsolete header line folding is not supported",
            ));
        }
        let colon = line
            .iter()
            .position(|&b| b == b':')
            .ok_or_else(|| Reject::respond(400, "malformed header line (missing ':')"))?;
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        if !is_token(name) {
            return Err(Reject::respond(400, "malformed header name"));
        }
        let value = String::from_utf8_lossy(value);
        let value = value.trim_matches(|c| c == ' ' || c == '\t');
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        match name.as_str() {
            "content-length" => {
                let parsed = (!value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()))
                    .then(|| value.parse::<u64>().ok())
                    .flatten()
                    .ok_or_else(|| Reject::respond(400, "invalid Content-Length header"))?;
                if content_length.is_some_and(|previous| previous != parsed) {
                    return Err(Reject::respond(400, "conflicting Content-Length headers"));
                }
                content_length = Some(parsed);
            }
            "transfer-encoding" => chunked_or_other_te = true,
            "connection" => {
                for option in value.split(',').map(str::trim) {
                    if option.eq_ignore_ascii_case("close") {
                        conn_close = true;
                    } else if option.eq_ignore_ascii_case("keep-alive") {
                        conn_keep_alive = true;
                    }
                }
            }
            "expect" if value.eq_ignore_ascii_case("100-continue") => expect_continue = true,
            _ => {}
        }
    }
    if chunked_or_other_te {
        return Err(Reject::respond(
            501,
            "Transfer-Encoding is not supported; send the body with Content-Length",
        ));
    }
    let keep_alive = !conn_close && (!http10 || conn_keep_alive);
    Ok(Head {
        method,
        path,
        query,
        content_length: content_length.unwrap_or(0),
        keep_alive,
        http10,
        expect_continue,
    })
}

type RequestLine = (String, String, Vec<(String, String)>, bool);

/// Parses `METHOD SP origin-form-target SP HTTP/1.x`. Returns the method,
/// decoded path, decoded query and whether the version is HTTP/1.0.
fn parse_request_line(line: &[u8]) -> Result<RequestLine, Reject> {
    let bad = |what: &str| Reject::respond(400, format!("malformed request line: {what}"));
    let mut parts = line.split(|&b| b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad("expected 'METHOD /path HTTP/1.1'"));
    };
    if !is_token(method) {
        return Err(bad("invalid method"));
    }
    if target.first() != Some(&b'/') || !target.iter().all(|b| b.is_ascii_graphic()) {
        return Err(bad("the target must be an absolute path such as /status"));
    }
    let http10 = match version {
        b"HTTP/1.1" => false,
        b"HTTP/1.0" => true,
        [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
            if major.is_ascii_digit() && minor.is_ascii_digit() =>
        {
            return Err(Reject::respond(
                505,
                "only HTTP/1.0 and HTTP/1.1 are supported",
            ));
        }
        _ => return Err(bad("invalid HTTP version")),
    };
    // Both checked above to be ASCII.
    let method = String::from_utf8_lossy(method).into_owned();
    let target = String::from_utf8_lossy(target);
    let target = target.split('#').next().unwrap_or_default();
    let (raw_path, raw_query) = match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target, None),
    };
    let undecodable = || Reject::respond(400, "malformed percent-encoding in the request target");
    let path = percent_decode(raw_path, false).ok_or_else(undecodable)?;
    let mut query = Vec::new();
    for pair in raw_query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        query.push((
            percent_decode(key, true).ok_or_else(undecodable)?,
            percent_decode(value, true).ok_or_else(undecodable)?,
        ));
    }
    Ok((method, path, query, http10))
}
