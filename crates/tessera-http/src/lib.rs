//! Minimal HTTP/1.1 transport for Tessera's JSON control API.
//!
//! This crate deliberately depends on nothing but `std`, `serde` and `serde_json`. It
//! implements exactly the subset of HTTP/1.1 the control plane needs:
//!
//! * **Server** ([`serve_unix`], [`serve_tcp`]): one thread per connection,
//!   keep-alive, `Content-Length` request bodies only (no chunked encoding),
//!   bounded header/body sizes, a per-request read deadline, a cap on
//!   concurrent connections, and isolation from panicking handlers.
//! * **Client** ([`request`]): one request per connection
//!   (`Connection: close`), returning the status code and body text, with
//!   error messages meant to be shown to an operator as-is.
//!
//! All responses carry `Content-Type: application/json`.

mod client;
mod server;

#[cfg(test)]
mod tests;

pub use client::{request, Endpoint};
pub use server::{
    serve_tcp, serve_unix, MAX_BODY_BYTES, MAX_CONNECTIONS, MAX_HEADER_BYTES, READ_TIMEOUT,
};

/// A parsed HTTP request as handed to a [`Handler`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Request method exactly as sent (e.g. `GET`, `POST`, `DELETE`).
    pub method: String,
    /// Percent-decoded path, without the query string.
    pub path: String,
    /// Percent-decoded query parameters in order of appearance (`+` decodes
    /// to a space). A parameter without `=` has an empty value.
    pub query: Vec<(String, String)>,
    /// Raw request body (empty when the request had none).
    pub body: Vec<u8>,
}

impl Request {
    /// Value of the first query parameter called `name`, if any.
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Parses the body as JSON. An empty (or all-whitespace) body yields
    /// `Value::Null`.
    pub fn json_body(&self) -> serde_json::Result<serde_json::Value> {
        if self.body.iter().all(u8::is_ascii_whitespace) {
            return Ok(serde_json::Value::Null);
        }
        serde_json::from_slice(&self.body)
    }

    /// Parses the body as JSON into `T`. An empty (or all-whitespace) body is read as
    /// JSON `null` (so a body type whose fields all have defaults may be left out).
    pub fn body_as<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        if self.body.iter().all(u8::is_ascii_whitespace) {
            return serde_json::from_str("null").or_else(|_| serde_json::from_str("{}"));
        }
        serde_json::from_slice(&self.body)
    }
}

/// A response produced by a [`Handler`]. The body is JSON text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    /// A response whose body is `value` serialized as JSON.
    pub fn json<T: serde::Serialize + ?Sized>(status: u16, value: &T) -> Response {
        match serde_json::to_string(value) {
            Ok(body) => Response { status, body },
            Err(e) => Response::error(500, &format!("the reply does not serialise: {e}")),
        }
    }

    /// An error response with body `{"error": message}`.
    pub fn error(status: u16, message: &str) -> Response {
        Response::json(status, &serde_json::json!({ "error": message }))
    }
}

/// Request handler shared by all connection threads.
pub type Handler = std::sync::Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Standard reason phrase for `status` ("Unknown" for codes we do not name).
pub(crate) fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        410 => "Gone",
        411 => "Length Required",
        412 => "Precondition Failed",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        423 => "Locked",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        505 => "HTTP Version Not Supported",
        507 => "Insufficient Storage",
        _ => "Unknown",
    }
}

/// Locates the blank line that ends an HTTP message head.
///
/// Returns `(head_len, consumed)`: `head_len` is the length of the head
/// without the terminating blank line, `consumed` includes it. Both `\r\n`
/// and bare `\n` line endings are accepted.
pub(crate) fn find_head_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i] == b'\n' {
            match buf.get(i + 1) {
                Some(b'\n') => return Some((i + 1, i + 2)),
                Some(b'\r') if buf.get(i + 2) == Some(&b'\n') => return Some((i + 1, i + 3)),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Splits a message head into lines, dropping the `\r` of `\r\n` endings.
pub(crate) fn head_lines(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    head.split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .filter(|line| !line.is_empty())
}

/// `true` for characters allowed in an HTTP token (method, header name).
pub(crate) fn is_token(s: &[u8]) -> bool {
    !s.is_empty()
        && s.iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Decodes `%XX` escapes (and `+` as space when `plus_as_space`). Returns
/// `None` for a truncated or non-hex escape, or if the result is not UTF-8.
pub(crate) fn percent_decode(s: &str, plus_as_space: bool) -> Option<String> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hi = hex(*bytes.get(i + 1)?)?;
                let lo = hex(*bytes.get(i + 2)?)?;
                out.push(hi << 4 | lo);
                i += 3;
            }
            b'+' if plus_as_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}
