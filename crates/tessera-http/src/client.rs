//! One-shot HTTP/1.1 client for the control API: over a Unix socket, or HTTPS with a
//! bearer token.

use std::fmt;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::{find_head_end, head_lines, is_token};

/// Time allowed to establish each TCP connection attempt.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed for any single read or write once connected. Generous,
/// because some control operations take a while to complete.
const IO_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest response head the client accepts.
const MAX_RESPONSE_HEAD: usize = 64 * 1024;
/// Largest response body the client accepts.
const MAX_RESPONSE_BODY: u64 = 64 * 1024 * 1024;

/// Where a Tessera node's control API listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// Unix-domain socket at this path.
    Unix(PathBuf),
    /// TCP `HOST:PORT` (IPv6 hosts in brackets: `[::1]:7070`), plain text: a node serves
    /// its API on TCP only with TLS, so this reaches only other servers.
    Tcp(String),
    /// `https://HOST:PORT`: TLS, with the credentials to present.
    Https(HttpsEndpoint),
}

/// An HTTPS endpoint: the address, the CA to trust, the bearer token to send.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct HttpsEndpoint {
    /// `HOST:PORT`; HOST is also the name the server's certificate must carry.
    pub addr: String,
    /// PEM file of the CA(s) to trust (default: the system's bundle).
    pub ca_cert: Option<PathBuf>,
    /// Bearer token.
    pub token: Option<String>,
}

impl fmt::Debug for HttpsEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpsEndpoint")
            .field("addr", &self.addr)
            .field("ca_cert", &self.ca_cert)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl HttpsEndpoint {
    /// The host part of `addr` (without brackets and port).
    pub(crate) fn host(&self) -> &str {
        let host = match self.addr.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => self.addr.as_str(),
        };
        host.trim_start_matches('[').trim_end_matches(']')
    }

    /// `addr` with the default HTTPS port when it names none.
    pub(crate) fn socket_addr(&self) -> String {
        let has_port = match self.addr.rsplit_once(':') {
            Some((host, port)) => {
                port.bytes().all(|b| b.is_ascii_digit())
                    && (!host.contains(':') || host.ends_with(']'))
            }
            None => false,
        };
        if has_port {
            self.addr.clone()
        } else {
            format!("{}:443", self.addr)
        }
    }
}

impl Endpoint {
    /// Parses an endpoint specification:
    ///
    /// * `unix:PATH` → [`Endpoint::Unix`]
    /// * `https://HOST:PORT` → [`Endpoint::Https`] (no credentials yet: see
    ///   [`Endpoint::with_credentials`])
    /// * `tcp:HOST:PORT` → [`Endpoint::Tcp`]
    /// * anything containing `/` → [`Endpoint::Unix`]
    /// * `HOST:PORT` → [`Endpoint::Tcp`]
    /// * anything else (no `/`, no `:`, e.g. `node.sock`) is taken as a
    ///   relative Unix socket path, since it cannot be a TCP address.
    pub fn parse(s: &str) -> Endpoint {
        if let Some(rest) = s.strip_prefix("https://") {
            Endpoint::Https(HttpsEndpoint {
                addr: rest.trim_end_matches('/').to_string(),
                ca_cert: None,
                token: None,
            })
        } else if let Some(path) = s.strip_prefix("unix:") {
            Endpoint::Unix(PathBuf::from(path))
        } else if let Some(addr) = s.strip_prefix("tcp:") {
            Endpoint::Tcp(addr.to_string())
        } else if s.contains('/') || !s.contains(':') {
            Endpoint::Unix(PathBuf::from(s))
        } else {
            Endpoint::Tcp(s.to_string())
        }
    }
}

impl Endpoint {
    /// The endpoint with a bearer token and a CA to trust; they apply to HTTPS only (a
    /// Unix socket's client is known by its user).
    pub fn with_credentials(self, token: Option<String>, ca_cert: Option<PathBuf>) -> Endpoint {
        match self {
            Endpoint::Https(https) => Endpoint::Https(HttpsEndpoint {
                token: token.or(https.token),
                ca_cert: ca_cert.or(https.ca_cert),
                ..https
            }),
            other => other,
        }
    }
}

impl FromStr for Endpoint {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Endpoint::parse(s))
    }
}

impl fmt::Display for Endpoint {
    /// Formats as `unix:PATH` or `tcp:HOST:PORT` (round-trips through
    /// [`Endpoint::parse`]).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
            Endpoint::Tcp(addr) => write!(f, "tcp:{addr}"),
            Endpoint::Https(https) => write!(f, "https://{}", https.addr),
        }
    }
}

/// Sends one request on a fresh connection (`Connection: close`) and returns
/// `(status, body)`.
///
/// `path` may include a query string; it should already be percent-encoded
/// where needed (characters that cannot appear in a request target at all,
/// such as spaces, are encoded automatically). A `body`, if given, is sent
/// as JSON.
///
/// Errors carry operator-readable messages naming the endpoint, e.g.
/// `cannot connect to the Tessera node at unix:/run/tessera.sock: No such
/// file or directory — is the node running?`.
pub fn request(
    ep: &Endpoint,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> io::Result<(u16, String)> {
    if !is_token(method.as_bytes()) {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("invalid HTTP method {method:?}"),
        ));
    }
    if !path.starts_with('/') {
        return Err(io::Error::new(
            ErrorKind::InvalidInput,
            format!("request path {path:?} must start with '/'"),
        ));
    }
    let payload = match body {
        Some(value) => serde_json::to_vec(value).map_err(|e| {
            io::Error::new(
                ErrorKind::InvalidInput,
                format!("cannot encode request body: {e}"),
            )
        })?,
        None => Vec::new(),
    };
    let host = match ep {
        Endpoint::Unix(_) => "localhost",
        Endpoint::Tcp(addr) => addr.as_str(),
        Endpoint::Https(https) => https.addr.as_str(),
    };
    let mut message = format!(
        "{method} {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tessera-http\r\n\
         Accept: application/json\r\nConnection: close\r\n",
        target = encode_target(path),
    );
    if body.is_some() {
        message.push_str("Content-Type: application/json\r\n");
    }
    if let Endpoint::Https(HttpsEndpoint {
        token: Some(token), ..
    }) = ep
    {
        message.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    message.push_str(&format!("Content-Length: {}\r\n\r\n", payload.len()));
    let mut message = message.into_bytes();
    message.extend_from_slice(&payload);

    match ep {
        Endpoint::Unix(path) => {
            let stream = UnixStream::connect(path).map_err(|e| connect_error(ep, &e))?;
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            stream.set_write_timeout(Some(IO_TIMEOUT))?;
            exchange(stream, &message, ep)
        }
        Endpoint::Tcp(addr) => {
            let stream = connect_tcp(ep, addr)?;
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            stream.set_write_timeout(Some(IO_TIMEOUT))?;
            let _ = stream.set_nodelay(true);
            exchange(stream, &message, ep)
        }
        Endpoint::Https(https) => {
            let config = crate::tls::client_config(https.ca_cert.as_deref())?;
            let name = ServerName::try_from(https.host().to_string()).map_err(|e| {
                io::Error::new(
                    ErrorKind::InvalidInput,
                    format!("{ep}: {:?} is not a host name: {e}", https.host()),
                )
            })?;
            let tls = rustls::ClientConnection::new(config, name).map_err(io::Error::other)?;
            let stream = connect_tcp(ep, &https.socket_addr())?;
            stream.set_read_timeout(Some(IO_TIMEOUT))?;
            stream.set_write_timeout(Some(IO_TIMEOUT))?;
            let _ = stream.set_nodelay(true);
            exchange(rustls::StreamOwned::new(tls, stream), &message, ep)
        }
    }
}

/// Percent-encodes bytes that may not appear in a request target, leaving
/// everything else (including existing `%XX` escapes) untouched.
fn encode_target(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for &b in path.as_bytes() {
        if b.is_ascii_graphic() && !b"\"<>\\^`{|}#".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An OS error's text without the trailing ` (os error N)`.
fn plain_message(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_string(),
        _ => text,
    }
}

fn connect_error(ep: &Endpoint, err: &io::Error) -> io::Error {
    let hint = match err.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused | ErrorKind::TimedOut => {
            " — is the node running?"
        }
        _ => "",
    };
    io::Error::new(
        err.kind(),
        format!(
            "cannot connect to the Tessera node at {ep}: {}{hint}",
            plain_message(err)
        ),
    )
}

fn connect_tcp(ep: &Endpoint, addr: &str) -> io::Result<TcpStream> {
    let addrs = addr.to_socket_addrs().map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "cannot resolve the address of the Tessera node at {ep}: {} \
                 (expected HOST:PORT)",
                plain_message(&e)
            ),
        )
    })?;
    let mut last_err = None;
    for sockaddr in addrs {
        match TcpStream::connect_timeout(&sockaddr, CONNECT_TIMEOUT) {
            Ok(stream) => return Ok(stream),
            Err(e) => last_err = Some(e),
        }
    }
    let err = last_err
        .unwrap_or_else(|| io::Error::new(ErrorKind::NotFound, "the address resolved to nothing"));
    Err(connect_error(ep, &err))
}

/// Writes the request and reads the response.
fn exchange<S: Read + Write>(
    mut stream: S,
    message: &[u8],
    ep: &Endpoint,
) -> io::Result<(u16, String)> {
    if let Err(write_err) = stream.write_all(message).and_then(|()| stream.flush()) {
        // The server may have rejected the request early (e.g. 413) and
        // stopped reading; its response may still be waiting for us.
        return read_response(&mut stream, ep).map_err(|_| {
            io::Error::new(
                write_err.kind(),
                format!(
                    "failed to send the request to the Tessera node at {ep}: {}",
                    plain_message(&write_err)
                ),
            )
        });
    }
    read_response(&mut stream, ep)
}

/// Reads more bytes into `buf`; 0 means end of stream.
fn fill<R: Read>(stream: &mut R, buf: &mut Vec<u8>, ep: &Endpoint) -> io::Result<usize> {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        match stream.read(&mut chunk) {
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(n);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(io::Error::new(
                    ErrorKind::TimedOut,
                    format!("timed out waiting for a response from the Tessera node at {ep}"),
                ));
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "error reading the response from the Tessera node at {ep}: {}",
                        plain_message(&e)
                    ),
                ))
            }
        }
    }
}

fn malformed(ep: &Endpoint, what: &str) -> io::Error {
    io::Error::new(
        ErrorKind::InvalidData,
        format!("malformed response from the Tessera node at {ep}: {what}"),
    )
}

fn read_response<R: Read>(stream: &mut R, ep: &Endpoint) -> io::Result<(u16, String)> {
    let mut buf = Vec::new();
    loop {
        // Read one response head.
        let (head_len, consumed) = loop {
            if let Some(found) = find_head_end(&buf) {
                break found;
            }
            if buf.len() > MAX_RESPONSE_HEAD {
                return Err(malformed(ep, "response head too large"));
            }
            if fill(stream, &mut buf, ep)? == 0 {
                return Err(if buf.is_empty() {
                    io::Error::new(
                        ErrorKind::UnexpectedEof,
                        format!(
                            "the Tessera node at {ep} closed the connection without responding"
                        ),
                    )
                } else {
                    malformed(ep, "connection closed in the middle of the response head")
                });
            }
        };
        let (status, content_length) = parse_response_head(&buf[..head_len], ep)?;
        buf.drain(..consumed);
        if (100..200).contains(&status) {
            // Interim response (e.g. 100 Continue): the real one follows.
            continue;
        }

        // Read the body: exactly Content-Length bytes, or until EOF.
        match content_length {
            Some(length) => {
                if length > MAX_RESPONSE_BODY {
                    return Err(malformed(ep, "response body too large"));
                }
                // At most MAX_RESPONSE_BODY (checked above), so it fits.
                let length = usize::try_from(length).unwrap_or(usize::MAX);
                while buf.len() < length {
                    if fill(stream, &mut buf, ep)? == 0 {
                        return Err(malformed(
                            ep,
                            "connection closed before the body was complete",
                        ));
                    }
                }
                buf.truncate(length);
            }
            None => {
                while fill(stream, &mut buf, ep)? > 0 {
                    if buf.len() as u64 > MAX_RESPONSE_BODY {
                        return Err(malformed(ep, "response body too large"));
                    }
                }
            }
        }
        return Ok((status, String::from_utf8_lossy(&buf).into_owned()));
    }
}

/// Returns the status code and Content-Length (if any) of a response head.
fn parse_response_head(head: &[u8], ep: &Endpoint) -> io::Result<(u16, Option<u64>)> {
    let mut lines = head_lines(head);
    let status_line = String::from_utf8_lossy(lines.next().unwrap_or_default()).into_owned();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.")
        || code.len() != 3
        || !code.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(malformed(ep, &format!("bad status line {status_line:?}")));
    }
    let status: u16 = code.parse().map_err(|_| malformed(ep, "bad status code"))?;

    let mut content_length = None;
    for line in lines {
        let line = String::from_utf8_lossy(line);
        let Some((name, value)) = line.split_once(':') else {
            return Err(malformed(ep, "bad header line"));
        };
        let name = name.trim();
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let length = value
                .parse::<u64>()
                .map_err(|_| malformed(ep, "bad Content-Length"))?;
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding")
            && !value.eq_ignore_ascii_case("identity")
        {
            return Err(malformed(
                ep,
                &format!("unsupported Transfer-Encoding {value:?}"),
            ));
        }
    }
    Ok((status, content_length))
}
