//! The HTTP transport of Tessera's JSON management API.
//!
//! * **Server** ([`spawn`]): an axum router served by hyper (HTTP/1.1: keep-alive,
//!   `Content-Length` and chunked bodies, HEAD) on a current-thread tokio runtime of its own
//!   thread, on a Unix socket (who may connect is the socket file's permissions) and, only
//!   with TLS and bearer tokens, on TCP. Every request is bounded (head and body size, read
//!   time, connections at once), every error reply is `{"error": message}`, and every
//!   mutating call writes one audit line (target `tessera::audit`).
//! * **Client** ([`request`]): one blocking request per connection over a Unix socket or
//!   HTTPS (rustls, a bearer token), returning the status and the body, with error
//!   messages meant to be shown to an operator as-is.

mod auth;
mod client;
mod server;
mod tls;

#[cfg(test)]
mod tests;

pub use auth::{first_token, AuthFailure, TokenSet, MIN_TOKEN_LEN};
pub use client::{request, Endpoint, HttpsEndpoint};
pub use server::{
    blocking, require_json_bodies, spawn, ApiListener, Peer, TokenIdentity, MAX_BODY_BYTES,
    MAX_CONNECTIONS, MAX_HEADER_BYTES, READ_TIMEOUT,
};
pub use tls::{client_config, load_certs, server_config};

/// A reply of the API: a status and a JSON body.
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

impl axum::response::IntoResponse for Response {
    fn into_response(self) -> axum::response::Response {
        let status = axum::http::StatusCode::from_u16(self.status)
            .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            self.body,
        )
            .into_response()
    }
}

/// `true` for characters allowed in an HTTP token (method, header name).
pub(crate) fn is_token(s: &[u8]) -> bool {
    !s.is_empty()
        && s.iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
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
