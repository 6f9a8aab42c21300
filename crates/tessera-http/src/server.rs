//! The API server: an axum [`Router`] served by hyper (HTTP/1.1) on a current-thread tokio
//! runtime of its own thread, never on a reactor core. Handlers that call into the node
//! run on the runtime's blocking pool ([`blocking`]), so a slow call (a pool creation, a
//! statistics interval) holds no other client.
//!
//! Every request passes [`gate`]: bearer authentication on TCP, the body read in full
//! under a size and time limit (chunked or not), error replies
//! turned into `{"error": ...}`, and one audit line per mutating call.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, RawPathParams, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::Router;
use http_body_util::{BodyExt, Limited};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tracing::{debug, info, warn};

use crate::auth::TokenSet;
use crate::Response;

/// Largest accepted request head (request line plus headers), in bytes; larger heads get
/// 431.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Largest accepted request body, in bytes, however it is framed (Content-Length or
/// chunked); larger bodies get 413.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
/// Time allowed to receive a request's head, and then its body.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; a connection beyond gets 503 and is closed.
pub const MAX_CONNECTIONS: usize = 64;
/// Time allowed for a TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is calling: what the audit log names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Peer {
    /// A Unix-socket client, by its kernel-reported credentials.
    Unix { uid: Option<u32>, pid: Option<i32> },
    /// A TCP client, by its address.
    Tcp(SocketAddr),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Unix { uid, pid } => {
                write!(f, "unix")?;
                if let Some(uid) = uid {
                    write!(f, " uid={uid}")?;
                }
                if let Some(pid) = pid {
                    write!(f, " pid={pid}")?;
                }
                Ok(())
            }
            Peer::Tcp(addr) => write!(f, "tcp {addr}"),
        }
    }
}

/// The identity of the bearer token a request was let in with (never the token itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenIdentity(pub String);

/// A listener of the API.
pub enum ApiListener {
    /// A Unix socket: who may connect is decided by the socket file's permissions.
    Unix(std::os::unix::net::UnixListener),
    /// TCP, always with TLS and bearer tokens: the API has no plain-text TCP mode.
    Tls {
        listener: std::net::TcpListener,
        tls: Arc<rustls::ServerConfig>,
        tokens: Arc<TokenSet>,
    },
}

/// What every request of one connection carries into the router.
#[derive(Clone)]
struct ConnContext {
    peer: Peer,
    tokens: Option<Arc<TokenSet>>,
}

/// Serves `router` on `listeners` from a new thread `tessera-api` with a current-thread
/// runtime. Returns once the listeners are registered; the thread runs for the life of
/// the process.
pub fn spawn(router: Router, listeners: Vec<ApiListener>) -> io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(MAX_CONNECTIONS)
        .thread_name("tessera-api-call")
        .build()?;
    let router = harden(router);
    let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    {
        let _entered = runtime.enter();
        for l in listeners {
            match l {
                ApiListener::Unix(l) => {
                    l.set_nonblocking(true)?;
                    let l = tokio::net::UnixListener::from_std(l)?;
                    tokio::spawn(accept_unix(l, router.clone(), limit.clone()));
                }
                ApiListener::Tls {
                    listener,
                    tls,
                    tokens,
                } => {
                    listener.set_nonblocking(true)?;
                    let l = tokio::net::TcpListener::from_std(listener)?;
                    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
                    tokio::spawn(accept_tls(
                        l,
                        acceptor,
                        tokens,
                        router.clone(),
                        limit.clone(),
                    ));
                }
            }
        }
    }
    std::thread::Builder::new()
        .name("tessera-api".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    Ok(())
}

/// The layers every API router gets: the gate around every route and fallback.
fn harden(router: Router) -> Router {
    router.layer(axum::middleware::from_fn(gate))
}

/// Avoids a hot loop when `accept` keeps failing (e.g. out of descriptors).
async fn accept_backoff(err: &io::Error) {
    warn!(error = %err, "management API: accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn accept_unix(listener: tokio::net::UnixListener, router: Router, limit: Arc<Semaphore>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                accept_backoff(&e).await;
                continue;
            }
        };
        let cred = stream.peer_cred().ok();
        let peer = Peer::Unix {
            uid: cred.map(|c| c.uid()),
            pid: cred.and_then(|c| c.pid()),
        };
        let ctx = ConnContext { peer, tokens: None };
        match limit.clone().try_acquire_owned() {
            Ok(permit) => {
                let router = router.clone();
                tokio::spawn(async move {
                    serve_connection(stream, router, ctx).await;
                    drop(permit);
                });
            }
            Err(_) => {
                tokio::spawn(reject_busy(stream));
            }
        }
    }
}

async fn accept_tls(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    tokens: Arc<TokenSet>,
    router: Router,
    limit: Arc<Semaphore>,
) {
    loop {
        let (stream, addr) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                accept_backoff(&e).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = limit.clone().try_acquire_owned() else {
            // Over the cap: no TLS handshake is spent on it; closing is the answer.
            continue;
        };
        let acceptor = acceptor.clone();
        let ctx = ConnContext {
            peer: Peer::Tcp(addr),
            tokens: Some(tokens.clone()),
        };
        let router = router.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => serve_connection(tls, router, ctx).await,
                // A scanner or a plain-HTTP client: not worth more than a debug line each.
                Ok(Err(e)) => {
                    debug!(client = %addr, error = %e, "management API: TLS handshake failed")
                }
                Err(_) => debug!(client = %addr, "management API: TLS handshake timed out"),
            }
            drop(permit);
        });
    }
}

/// Answers a connection beyond the cap with 503 and closes it.
async fn reject_busy<S: AsyncWrite + Unpin>(mut stream: S) {
    let body =
        serde_json::json!({"error": "server busy: too many concurrent connections"}).to_string();
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = stream.write_all(reply.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

async fn serve_connection<S>(stream: S, router: Router, ctx: ConnContext)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ctx.peer.clone());
            if let Some(tokens) = &ctx.tokens {
                req.extensions_mut().insert(tokens.clone());
            }
            router.clone().oneshot(req.map(Body::new))
        });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(READ_TIMEOUT)
        .max_buf_size(MAX_HEADER_BYTES.max(8192))
        .serve_connection(TokioIo::new(stream), service);
    if let Err(e) = connection.await {
        debug!(error = %e, "management API: connection ended with an error");
    }
}

/// Runs a call into the node on the blocking pool; a panic becomes a 500 naming it, and
/// the server goes on serving everyone else.
pub async fn blocking<F>(call: F) -> Response
where
    F: FnOnce() -> Response + Send + 'static,
{
    match tokio::task::spawn_blocking(call).await {
        Ok(response) => response,
        Err(e) => {
            let message = match e.try_into_panic() {
                Ok(payload) => {
                    let detail = payload
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| payload.downcast_ref::<String>().cloned());
                    match detail {
                        Some(d) => format!("internal error: request handler panicked: {d}"),
                        None => "internal error: request handler panicked".to_string(),
                    }
                }
                Err(_) => "internal error: the request was cancelled".to_string(),
            };
            Response::error(500, &message)
        }
    }
}

fn is_mutating(method: &Method) -> bool {
    matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// Body fields that name what a call acts on, for the audit line.
const NAMING_FIELDS: [&str; 6] = ["name", "pool", "volume", "nqn", "device", "with"];

/// `key=value` pairs naming the resources of a call: its path parameters, then the naming
/// fields of its JSON body.
fn resource_names(params: Option<&RawPathParams>, body: &[u8]) -> String {
    let mut names: Vec<String> = params
        .map(|p| p.iter().map(|(k, v)| format!("{k}={v}")).collect())
        .unwrap_or_default();
    if let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice(body) {
        for key in NAMING_FIELDS {
            match fields.get(key) {
                Some(serde_json::Value::String(v)) => names.push(format!("{key}={v}")),
                Some(v @ serde_json::Value::Number(_)) => names.push(format!("{key}={v}")),
                _ => {}
            }
        }
    }
    names.join(" ")
}

/// What goes around every request; see the module documentation.
async fn gate(request: Request, next: Next) -> axum::response::Response {
    let started = Instant::now();
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let peer = request.extensions().get::<Peer>().cloned();
    let tokens = request.extensions().get::<Arc<TokenSet>>().cloned();
    let (mut parts, body) = request.into_parts();
    let params: Option<RawPathParams> =
        <RawPathParams as axum::extract::FromRequestParts<()>>::from_request_parts(&mut parts, &())
            .await
            .ok();
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string());
    let mut identity: Option<String> = None;
    // Path parameters name the resource even of a call refused before its body is read.
    let mut resources = resource_names(params.as_ref(), &[]);
    let response = async {
        if let Some(tokens) = &tokens {
            match tokens.identify(&parts.headers) {
                Ok(id) => identity = Some(id.to_string()),
                Err(failure) => return unauthorized(failure.message()),
            }
        }
        let bytes = match read_body(&parts.headers, body).await {
            Ok(bytes) => bytes,
            Err(response) => return response,
        };
        if is_mutating(&method) {
            resources = resource_names(params.as_ref(), &bytes);
        }
        let mut parts = parts;
        if let Some(id) = &identity {
            parts.extensions.insert(TokenIdentity(id.clone()));
        }
        next.run(Request::from_parts(parts, Body::from(bytes)))
            .await
    }
    .await;
    let response = json_errors(response, &method, &path).await;
    if is_mutating(&method) {
        // Strings go in as `&str`, which both the text (quoted) and JSON log formats keep
        // as one value.
        let client = peer
            .as_ref()
            .map_or_else(|| "-".to_string(), Peer::to_string);
        info!(
            target: "tessera::audit",
            method = method.as_str(),
            path = path.as_str(),
            route = route.as_deref().unwrap_or("-"),
            resources = resources.as_str(),
            client = client.as_str(),
            token = identity.as_deref().unwrap_or("-"),
            status = response.status().as_u16(),
            duration_ms = (started.elapsed().as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
            "api call"
        );
    }
    response
}

fn unauthorized(message: &str) -> axum::response::Response {
    let mut response = Response::error(401, message).into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"tessera\""),
    );
    response
}

/// After refusing an oversize body, this much more of it is read and dropped (within
/// [`DRAIN_TIME`]) so that closing the connection does not reset it before the client has
/// read the 413.
const DRAIN_BYTES: usize = 16 * 1024 * 1024;
const DRAIN_TIME: Duration = Duration::from_secs(2);

fn too_large() -> axum::response::Response {
    Response::error(
        413,
        &format!("request body exceeds the limit of {MAX_BODY_BYTES} bytes"),
    )
    .into_response()
}

/// The whole request body, at most [`MAX_BODY_BYTES`] and within [`READ_TIMEOUT`],
/// however it is framed.
async fn read_body(
    headers: &axum::http::HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, axum::response::Response> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        // Refused before a byte of it is read: the client need not send it.
        return Err(too_large());
    }
    let mut body = body;
    let mut buf = Vec::new();
    let collect = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                Response::error(400, &format!("cannot read the request body: {e}")).into_response()
            })?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > MAX_BODY_BYTES {
                    let mut drained = 0usize;
                    let _ = tokio::time::timeout(DRAIN_TIME, async {
                        while drained < DRAIN_BYTES {
                            match body.frame().await {
                                Some(Ok(f)) => drained += f.data_ref().map_or(0, |d| d.len()),
                                _ => break,
                            }
                        }
                    })
                    .await;
                    return Err(too_large());
                }
                buf.extend_from_slice(&data);
            }
        }
        Ok(())
    };
    match tokio::time::timeout(READ_TIMEOUT, collect).await {
        Ok(Ok(())) => Ok(buf.into()),
        Ok(Err(response)) => Err(response),
        Err(_) => {
            Err(Response::error(408, "timed out waiting for the request body").into_response())
        }
    }
}

/// For routes whose POST, PUT and PATCH bodies are JSON: a body that is not (and not
/// empty) gets 400 with `{"error": ...}` before the handler runs. The gate has already
/// read the body into memory, so reading it again here costs a copy at most.
pub async fn require_json_bodies(request: Request, next: Next) -> axum::response::Response {
    if !matches!(
        *request.method(),
        Method::POST | Method::PUT | Method::PATCH
    ) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match read_body(&parts.headers, body).await {
        Ok(bytes) => bytes,
        Err(response) => return response,
    };
    if !bytes.iter().all(u8::is_ascii_whitespace) {
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes) {
            return Response::error(400, &format!("request body is not valid JSON: {e}"))
                .into_response();
        }
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// An error reply that is not JSON yet (axum's own 404, 405, 415, ...) becomes
/// `{"error": text}`, with its headers (`Allow`, ...) kept.
async fn json_errors(
    response: axum::response::Response,
    method: &Method,
    path: &str,
) -> axum::response::Response {
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if response.status().as_u16() < 400 || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = match Limited::new(body, 64 * 1024).collect().await {
        Ok(c) => String::from_utf8_lossy(&c.to_bytes()).trim().to_string(),
        Err(_) => String::new(),
    };
    let message = match (parts.status, text.is_empty()) {
        (StatusCode::METHOD_NOT_ALLOWED, _) => format!("method {method} is not allowed on {path}"),
        (status, true) => format!(
            "{} {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or("error")
        ),
        (_, false) => text,
    };
    let body = serde_json::json!({ "error": message }).to_string();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    parts.headers.remove(header::CONTENT_LENGTH);
    axum::response::Response::from_parts(parts, Body::from(body))
}
