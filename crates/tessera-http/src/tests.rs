//! End-to-end tests of the server over real Unix sockets and loopback TCP with TLS.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query};
use axum::http::{Method, Uri};
use axum::routing::{any, get};
use axum::Router;
use serde_json::{json, Value};

use crate::{
    blocking, request, spawn, ApiListener, Endpoint, HttpsEndpoint, Response, TokenSet,
    MAX_BODY_BYTES,
};

const TOKEN: &str = "0123456789abcdef0123456789abcdef0123456789abcdef";

/// Echoes the request as JSON under `/echo...`, panics on `/panic`, serves GET only on
/// `/only-get`, and returns 404 for anything else.
fn test_router() -> Router {
    async fn echo(
        method: Method,
        uri: Uri,
        rest: Option<Path<String>>,
        Query(query): Query<Vec<(String, String)>>,
        body: Bytes,
    ) -> Response {
        // The path as the router decoded it.
        let path = match rest {
            Some(Path(rest)) => format!("/echo/{rest}"),
            None => uri.path().to_string(),
        };
        let query: Vec<Value> = query.iter().map(|(k, v)| json!([k, v])).collect();
        Response::json(
            200,
            &json!({
                "method": method.as_str(),
                "path": path,
                "query": query,
                "body": String::from_utf8_lossy(&body),
                "body_len": body.len(),
            }),
        )
    }
    async fn panic_handler() -> Response {
        blocking(|| panic!("deliberate test panic")).await
    }
    async fn fallback(method: Method, uri: Uri) -> Response {
        Response::error(404, &format!("no route for {method} {}", uri.path()))
    }
    Router::new()
        .route("/echo", any(echo))
        .route("/echo/{*rest}", any(echo))
        .route("/panic", any(panic_handler))
        .route(
            "/json",
            any(echo).layer(axum::middleware::from_fn(crate::require_json_bodies)),
        )
        .route(
            "/only-get",
            get(|| async { Response::json(200, &json!({"ok": true})) }),
        )
        .fallback(fallback)
}

struct Server {
    ep: Endpoint,
    _dir: tempfile::TempDir,
}

fn unix_server() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("node.sock");
    let listener = UnixListener::bind(&path).unwrap();
    spawn(test_router(), vec![ApiListener::Unix(listener)]).unwrap();
    Server {
        ep: Endpoint::Unix(path),
        _dir: dir,
    }
}

/// A CA, and a server certificate for 127.0.0.1 and localhost signed by it, as PEM files.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "tessera test CA");
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.path().join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

struct TlsServer {
    addr: String,
    pki: Pki,
}

impl TlsServer {
    fn endpoint(&self, token: Option<&str>) -> Endpoint {
        Endpoint::Https(HttpsEndpoint {
            addr: self.addr.clone(),
            ca_cert: Some(self.pki.path("ca.pem")),
            token: token.map(str::to_string),
        })
    }
}

fn tls_server() -> TlsServer {
    let pki = Pki::new();
    let tls = crate::server_config(&pki.path("cert.pem"), &pki.path("key.pem")).unwrap();
    let tokens = Arc::new(TokenSet::parse(&format!("ops:{TOKEN}\n")).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    spawn(
        test_router(),
        vec![ApiListener::Tls {
            listener,
            tls,
            tokens,
        }],
    )
    .unwrap();
    TlsServer { addr, pki }
}

trait Duplex: Read + Write {}
impl<T: Read + Write> Duplex for T {}

fn connect_raw(ep: &Endpoint) -> Box<dyn Duplex> {
    match ep {
        Endpoint::Unix(path) => {
            let s = UnixStream::connect(path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            Box::new(s)
        }
        Endpoint::Tcp(addr) | Endpoint::Https(HttpsEndpoint { addr, .. }) => {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            Box::new(s)
        }
    }
}

/// Sends raw bytes on a new connection and reads until the server closes.
fn raw_exchange(ep: &Endpoint, bytes: &[u8]) -> String {
    let mut conn = connect_raw(ep);
    // The server may answer (413) and stop reading before all is sent.
    let _ = conn.write_all(bytes);
    let mut out = Vec::new();
    let _ = conn.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A response read off a raw connection by the test's own parser.
struct RawResponse {
    status: u16,
    head: String,
    body: String,
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// Reads exactly one Content-Length framed response from `conn`; `pending`
/// keeps bytes that belong to later responses.
fn read_one(conn: &mut dyn Duplex, pending: &mut Vec<u8>) -> RawResponse {
    let head_end = loop {
        if let Some(pos) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos;
        }
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).unwrap();
        assert!(n > 0, "connection closed before a full response head");
        pending.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(pending[..head_end].to_vec()).unwrap();
    pending.drain(..head_end + 4);
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let length: usize = header(&head, "content-length")
        .expect("Content-Length header")
        .parse()
        .unwrap();
    while pending.len() < length {
        let mut chunk = [0u8; 4096];
        let n = conn.read(&mut chunk).unwrap();
        assert!(n > 0, "connection closed before the body was complete");
        pending.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8(pending.drain(..length).collect()).unwrap();
    RawResponse { status, head, body }
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("invalid JSON {body:?}: {e}"))
}

fn round_trips(ep: &Endpoint) {
    let (status, body) = request(ep, "GET", "/echo/status?verbose=1&name=a%20b", None).unwrap();
    assert_eq!(status, 200);
    let v = json_of(&body);
    assert_eq!(v["method"], "GET");
    assert_eq!(v["path"], "/echo/status");
    assert_eq!(v["query"], json!([["verbose", "1"], ["name", "a b"]]));
    assert_eq!(v["body"], "");

    let payload = json!({"name": "vol0", "size": 1u64 << 30, "tags": ["a", "b"]});
    let (status, body) = request(ep, "POST", "/echo/volumes", Some(&payload)).unwrap();
    assert_eq!(status, 200);
    let v = json_of(&body);
    assert_eq!(v["method"], "POST");
    assert_eq!(v["path"], "/echo/volumes");
    assert_eq!(json_of(v["body"].as_str().unwrap()), payload);

    let (status, body) = request(
        ep,
        "DELETE",
        "/echo/volumes/vol0",
        Some(&json!({"force": true})),
    )
    .unwrap();
    assert_eq!(status, 200);
    let v = json_of(&body);
    assert_eq!(v["method"], "DELETE");
    assert_eq!(v["path"], "/echo/volumes/vol0");
    assert_eq!(json_of(v["body"].as_str().unwrap()), json!({"force": true}));

    let (status, body) = request(ep, "GET", "/nope", None).unwrap();
    assert_eq!(status, 404);
    assert_eq!(json_of(&body), json!({"error": "no route for GET /nope"}));
}

#[test]
fn unix_round_trips() {
    let server = unix_server();
    round_trips(&server.ep);
}

#[test]
fn tls_round_trips_with_a_token() {
    let server = tls_server();
    round_trips(&server.endpoint(Some(TOKEN)));
}

#[test]
fn tls_requires_a_valid_bearer_token() {
    let server = tls_server();
    for (token, what) in [
        (None, "no token"),
        (
            Some("0123456789abcdef0123456789abcdef0123456789abcdeX"),
            "wrong token",
        ),
    ] {
        let (status, body) = request(&server.endpoint(token), "GET", "/echo", None).unwrap();
        assert_eq!(status, 401, "{what}: {body}");
        assert!(json_of(&body)["error"].is_string(), "{what}");
    }
    let (status, _) = request(&server.endpoint(Some(TOKEN)), "GET", "/echo", None).unwrap();
    assert_eq!(status, 200);
    // Unknown routes are not told apart from known ones before authentication.
    let (status, _) = request(&server.endpoint(None), "GET", "/nope", None).unwrap();
    assert_eq!(status, 401);
}

#[test]
fn plain_http_to_the_tls_port_gets_no_reply() {
    let server = tls_server();
    let reply = raw_exchange(
        &Endpoint::Tcp(server.addr.clone()),
        b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert!(!reply.contains("HTTP/1.1 200"), "{reply}");
    // And the server still serves TLS clients.
    let (status, _) = request(&server.endpoint(Some(TOKEN)), "GET", "/echo", None).unwrap();
    assert_eq!(status, 200);
}

#[test]
fn tls_client_refuses_a_server_its_ca_did_not_sign() {
    let server = tls_server();
    let other = Pki::new();
    let ep = Endpoint::Https(HttpsEndpoint {
        addr: server.addr.clone(),
        ca_cert: Some(other.path("ca.pem")),
        token: Some(TOKEN.into()),
    });
    let err = request(&ep, "GET", "/echo", None).unwrap_err();
    assert!(err.to_string().contains(&server.addr), "{err}");
}

#[test]
fn chunked_bodies_are_accepted() {
    let server = unix_server();
    let reply = raw_exchange(
        &server.ep,
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    let body = reply.split("\r\n\r\n").nth(1).unwrap();
    assert_eq!(json_of(body)["body"], "{\"a\":1}");
    // A chunked body over the limit is refused like a Content-Length one.
    let chunk = "x".repeat(64 * 1024);
    let mut req = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..(MAX_BODY_BYTES / chunk.len() + 2) {
        req.extend_from_slice(format!("{:x}\r\n{chunk}\r\n", chunk.len()).as_bytes());
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let reply = raw_exchange(&server.ep, &req);
    assert!(
        reply.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
        "{reply}"
    );
}

#[test]
fn head_is_answered_as_get_without_a_body() {
    let server = unix_server();
    let reply = raw_exchange(
        &server.ep,
        b"HEAD /only-get HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(reply.ends_with("\r\n\r\n"), "{reply}");
    assert_eq!(header(&reply, "content-length"), Some("11"), "{reply}");
}

#[test]
fn wrong_method_gets_405_with_a_json_error() {
    let server = unix_server();
    let (status, body) = request(&server.ep, "DELETE", "/only-get", None).unwrap();
    assert_eq!(status, 405);
    assert_eq!(
        json_of(&body),
        json!({"error": "method DELETE is not allowed on /only-get"})
    );
}

#[test]
fn malformed_json_gets_400_with_a_json_error() {
    let server = unix_server();
    for method in ["POST", "PUT", "PATCH"] {
        let reply = raw_exchange(
            &server.ep,
            format!("{method} /json HTTP/1.1\r\nContent-Length: 8\r\nConnection: close\r\n\r\n{{\"a\": 1,").as_bytes(),
        );
        assert!(reply.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{reply}");
        assert_eq!(header(&reply, "content-type"), Some("application/json"));
        let body = reply.split("\r\n\r\n").nth(1).unwrap();
        assert!(json_of(body)["error"]
            .as_str()
            .unwrap()
            .contains("not valid JSON"));
    }
}

#[test]
fn oversize_body_is_rejected_with_413() {
    let server = unix_server();
    // Through the client: the whole oversize body is actually sent.
    let big = "x".repeat(MAX_BODY_BYTES + 10);
    let (status, body) = request(&server.ep, "POST", "/echo", Some(&json!(big))).unwrap();
    assert_eq!(status, 413, "{body}");
    assert!(json_of(&body)["error"]
        .as_str()
        .unwrap()
        .contains("exceeds"));

    // Raw: only the declared length is too big; the server must not wait
    // for the body before answering.
    let started = Instant::now();
    let reply = raw_exchange(
        &server.ep,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n",
    );
    assert!(
        reply.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
        "{reply}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));

    // The server is still fine afterwards.
    assert_eq!(request(&server.ep, "GET", "/echo", None).unwrap().0, 200);
}

#[test]
fn malformed_requests_get_400_and_the_server_survives() {
    let server = unix_server();
    for garbage in [
        &b"this is not http\r\n\r\n"[..],
        b"GET /echo HTTP/1.1 extra\r\n\r\n",
        b"G(T /echo HTTP/1.1\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nno colon here\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ] {
        let reply = raw_exchange(&server.ep, garbage);
        assert!(
            reply.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{:?} -> {reply}",
            String::from_utf8_lossy(garbage)
        );
    }
    let mut big_head = b"GET /echo HTTP/1.1\r\nX-Big: ".to_vec();
    big_head.extend(std::iter::repeat_n(b'a', 20 * 1024));
    big_head.extend_from_slice(b"\r\n\r\n");
    let reply = raw_exchange(&server.ep, &big_head);
    assert!(reply.starts_with("HTTP/1.1 431 "), "{reply}");
    // Still serving.
    assert_eq!(request(&server.ep, "GET", "/echo", None).unwrap().0, 200);
}

#[test]
fn large_body_within_limit_is_accepted() {
    let server = unix_server();
    // JSON string of ~900 KiB: the body (with quotes) stays under 1 MiB.
    let big = "x".repeat(900 * 1024);
    let (status, body) = request(&server.ep, "POST", "/echo", Some(&json!(big))).unwrap();
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["body_len"], big.len() + 2);
}

#[test]
fn handler_panic_becomes_500_and_server_survives() {
    let server = unix_server();
    let (status, body) = request(&server.ep, "POST", "/panic", Some(&json!({}))).unwrap();
    assert_eq!(status, 500);
    assert!(json_of(&body)["error"]
        .as_str()
        .unwrap()
        .contains("deliberate test panic"));
    // Next request on a new connection.
    assert_eq!(request(&server.ep, "GET", "/echo", None).unwrap().0, 200);

    // And on the same keep-alive connection as the panic.
    let mut conn = connect_raw(&server.ep);
    let mut pending = Vec::new();
    conn.write_all(b"GET /panic HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_one(&mut *conn, &mut pending).status, 500);
    conn.write_all(b"GET /echo/after HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let r = read_one(&mut *conn, &mut pending);
    assert_eq!(r.status, 200);
    assert_eq!(json_of(&r.body)["path"], "/echo/after");
}

#[test]
fn keep_alive_serves_several_requests_per_connection() {
    {
        let server = unix_server();
        let mut conn = connect_raw(&server.ep);
        let mut pending = Vec::new();

        conn.write_all(b"POST /echo/one HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n{\"a\":1}")
            .unwrap();
        let r = read_one(&mut *conn, &mut pending);
        assert_eq!(r.status, 200);
        assert!(r.head.starts_with("HTTP/1.1 200 OK\r\n"));
        assert_eq!(header(&r.head, "content-type"), Some("application/json"));
        assert_ne!(header(&r.head, "connection"), Some("close"));
        assert_eq!(json_of(&r.body)["body"], "{\"a\":1}");

        conn.write_all(b"GET /echo/two?x=%2F HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let r = read_one(&mut *conn, &mut pending);
        assert_eq!(r.status, 200);
        assert_eq!(json_of(&r.body)["path"], "/echo/two");
        assert_eq!(json_of(&r.body)["query"], json!([["x", "/"]]));

        // Pipelined: two requests in one write, then an explicit close.
        conn.write_all(
            b"DELETE /echo/three HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi\
              GET /missing HTTP/1.1\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let r = read_one(&mut *conn, &mut pending);
        assert_eq!(json_of(&r.body)["method"], "DELETE");
        assert_eq!(json_of(&r.body)["body"], "hi");
        let r = read_one(&mut *conn, &mut pending);
        assert_eq!(r.status, 404);
        assert_eq!(header(&r.head, "connection"), Some("close"));
        let mut rest = Vec::new();
        conn.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty() && pending.is_empty());
    }
}

#[test]
fn http10_closes_by_default_and_head_has_no_body() {
    let server = unix_server();
    // hyper answers in the request's version; raw_exchange returning at all shows that
    // the server closed the connection.
    let reply = raw_exchange(&server.ep, b"GET /echo HTTP/1.0\r\n\r\n");
    assert!(reply.starts_with("HTTP/1.0 200 OK\r\n"), "{reply}");

    let reply = raw_exchange(
        &server.ep,
        b"HEAD /echo HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(reply.ends_with("\r\n\r\n"), "{reply}");
}

#[test]
fn expect_continue_gets_interim_response() {
    let server = unix_server();
    let mut conn = connect_raw(&server.ep);
    conn.write_all(
        b"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut interim = [0u8; 25];
    conn.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    conn.write_all(b"ok").unwrap();
    let mut pending = Vec::new();
    let r = read_one(&mut *conn, &mut pending);
    assert_eq!(r.status, 200);
    assert_eq!(json_of(&r.body)["body"], "ok");
}

#[test]
fn client_errors_are_descriptive() {
    let dir = tempfile::tempdir().unwrap();
    let ep = Endpoint::Unix(dir.path().join("absent.sock"));
    let err = request(&ep, "GET", "/status", None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert_eq!(
        err.to_string(),
        format!(
            "cannot connect to the Tessera node at unix:{}: No such file or directory \
             — is the node running?",
            dir.path().join("absent.sock").display()
        )
    );

    // A TCP port nobody listens on.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let ep = Endpoint::Tcp(format!("127.0.0.1:{port}"));
    let err = request(&ep, "GET", "/status", None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused);
    let msg = err.to_string();
    assert!(msg.starts_with(&format!(
        "cannot connect to the Tessera node at tcp:127.0.0.1:{port}: "
    )));
    assert!(msg.ends_with("is the node running?"), "{msg}");

    let err = request(&ep, "GET", "status", None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let err = request(&ep, "BAD METHOD", "/status", None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
}

#[test]
fn client_encodes_unsafe_target_characters() {
    let tls = tls_server();
    let ep = tls.endpoint(Some(TOKEN));
    let (status, body) = request(&ep, "GET", "/echo/a b?q=x y&z=%26", None).unwrap();
    assert_eq!(status, 200);
    let v = json_of(&body);
    assert_eq!(v["path"], "/echo/a b");
    assert_eq!(v["query"], json!([["q", "x y"], ["z", "&"]]));
}

#[test]
fn endpoint_parsing() {
    assert_eq!(
        Endpoint::parse("unix:/run/tessera/node.sock"),
        Endpoint::Unix("/run/tessera/node.sock".into())
    );
    assert_eq!(
        Endpoint::parse("/run/tessera/node.sock"),
        Endpoint::Unix("/run/tessera/node.sock".into())
    );
    assert_eq!(
        Endpoint::parse("./node.sock"),
        Endpoint::Unix("./node.sock".into())
    );
    assert_eq!(
        Endpoint::parse("node.sock"),
        Endpoint::Unix("node.sock".into())
    );
    assert_eq!(
        Endpoint::parse("tcp:10.0.0.1:7070"),
        Endpoint::Tcp("10.0.0.1:7070".into())
    );
    assert_eq!(
        Endpoint::parse("localhost:7070"),
        Endpoint::Tcp("localhost:7070".into())
    );
    assert_eq!(
        Endpoint::parse("[::1]:7070"),
        Endpoint::Tcp("[::1]:7070".into())
    );
    for s in ["unix:/a/b.sock", "tcp:host:1"] {
        assert_eq!(Endpoint::parse(s).to_string(), s);
    }
    assert_eq!(
        "tcp:h:2".parse::<Endpoint>().unwrap(),
        Endpoint::Tcp("h:2".into())
    );
    let https = Endpoint::parse("https://node1:7443/").with_credentials(Some(TOKEN.into()), None);
    assert_eq!(https.to_string(), "https://node1:7443");
    let Endpoint::Https(h) = &https else {
        panic!("{https:?}")
    };
    assert_eq!(
        (h.host(), h.socket_addr().as_str()),
        ("node1", "node1:7443")
    );
    assert!(
        !format!("{https:?}").contains(TOKEN),
        "Debug shows no token"
    );
    let Endpoint::Https(h) = Endpoint::parse("https://[::1]") else {
        panic!()
    };
    assert_eq!((h.host(), h.socket_addr().as_str()), ("::1", "[::1]:443"));
}

#[test]
fn response_constructors() {
    let r = Response::error(409, "volume \"v\" exists");
    assert_eq!(r.status, 409);
    assert_eq!(json_of(&r.body), json!({"error": "volume \"v\" exists"}));
    let r = Response::json(200, &json!({"ok": true}));
    assert_eq!(r.body, r#"{"ok":true}"#);
}
