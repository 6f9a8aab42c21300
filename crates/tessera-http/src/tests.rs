//! End-to-end tests over real Unix and TCP sockets.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::server::{serve, tcp_incoming, Limits};
use crate::{percent_decode, request, Endpoint, Handler, Request, Response, MAX_BODY_BYTES};

/// A uniquely named directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "tessera-http-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Echoes the request as JSON under `/echo...`, panics on `/panic`, and
/// returns 404 for anything else.
fn test_handler() -> Handler {
    Arc::new(|req: &Request| {
        if req.path == "/panic" {
            panic!("deliberate test panic");
        }
        if req.path.starts_with("/echo") {
            let query: Vec<Value> = req.query.iter().map(|(k, v)| json!([k, v])).collect();
            return Response::json(
                200,
                &json!({
                    "method": req.method,
                    "path": req.path,
                    "query": query,
                    "body": String::from_utf8_lossy(&req.body),
                    "body_len": req.body.len(),
                }),
            );
        }
        Response::error(404, &format!("no route for {} {}", req.method, req.path))
    })
}

struct Server {
    ep: Endpoint,
    _dir: Option<TempDir>,
}

fn unix_server(limits: Limits) -> Server {
    let dir = TempDir::new();
    let path = dir.0.join("node.sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || serve(listener.incoming(), test_handler(), limits));
    Server {
        ep: Endpoint::Unix(path),
        _dir: Some(dir),
    }
}

fn tcp_server(limits: Limits) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || serve(tcp_incoming(&listener), test_handler(), limits));
    Server {
        ep: Endpoint::Tcp(addr.to_string()),
        _dir: None,
    }
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
        Endpoint::Tcp(addr) => {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            Box::new(s)
        }
    }
}

/// Sends raw bytes on a new connection and reads until the server closes.
fn raw_exchange(ep: &Endpoint, bytes: &[u8]) -> String {
    let mut conn = connect_raw(ep);
    conn.write_all(bytes).unwrap();
    let mut out = Vec::new();
    conn.read_to_end(&mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// A response read off a raw connection by the test's own parser.
struct RawResponse {
    status: u16,
    head: String,
    body: String,
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
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
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
    let server = unix_server(Limits::default());
    round_trips(&server.ep);
}

#[test]
fn tcp_round_trips() {
    let server = tcp_server(Limits::default());
    round_trips(&server.ep);
}

#[test]
fn large_body_within_limit_is_accepted() {
    let server = unix_server(Limits::default());
    // JSON string of ~900 KiB: the body (with quotes) stays under 1 MiB.
    let big = "x".repeat(900 * 1024);
    let (status, body) = request(&server.ep, "POST", "/echo", Some(&json!(big))).unwrap();
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["body_len"], big.len() + 2);
}

#[test]
fn oversize_body_is_rejected_with_413() {
    for server in [
        unix_server(Limits::default()),
        tcp_server(Limits::default()),
    ] {
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
        let reply = raw_exchange(
            &server.ep,
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n",
        );
        assert!(
            reply.starts_with("HTTP/1.1 413 Payload Too Large\r\n"),
            "{reply}"
        );
        assert!(reply.contains("Connection: close\r\n"));

        // The server is still fine afterwards.
        assert_eq!(request(&server.ep, "GET", "/echo", None).unwrap().0, 200);
    }
}

#[test]
fn oversize_head_is_rejected_with_431() {
    let server = unix_server(Limits::default());
    let mut req = b"GET /echo HTTP/1.1\r\nX-Big: ".to_vec();
    req.extend(std::iter::repeat_n(b'a', 20 * 1024));
    req.extend_from_slice(b"\r\n\r\n");
    let reply = raw_exchange(&server.ep, &req);
    assert!(
        reply.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{reply}"
    );
    let body = reply.split("\r\n\r\n").nth(1).unwrap();
    assert!(json_of(body)["error"].is_string());
}

#[test]
fn malformed_requests_get_400() {
    let server = tcp_server(Limits::default());
    for garbage in [
        &b"this is not http\r\n\r\n"[..],
        b"GET\r\n\r\n",
        b"GET /echo\r\n\r\n",
        b"GET echo HTTP/1.1\r\n\r\n",
        b"GET /echo HTTP/1.1 extra\r\n\r\n",
        b"GET /echo FTP/1.0\r\n\r\n",
        b"G(T /echo HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        b"GET /echo/%zz HTTP/1.1\r\n\r\n",
        b"GET /echo HTTP/1.1\r\nno colon here\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    ] {
        let reply = raw_exchange(&server.ep, garbage);
        assert!(
            reply.starts_with("HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"),
            "{:?} -> {reply}",
            String::from_utf8_lossy(garbage)
        );
        let body = reply.split("\r\n\r\n").nth(1).unwrap();
        assert!(json_of(body)["error"].is_string());
    }
    // Still serving.
    assert_eq!(request(&server.ep, "GET", "/echo", None).unwrap().0, 200);
}

#[test]
fn unsupported_framing_and_versions() {
    let server = unix_server(Limits::default());
    let reply = raw_exchange(
        &server.ep,
        b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 501 "), "{reply}");
    let reply = raw_exchange(&server.ep, b"GET /echo HTTP/2.0\r\n\r\n");
    assert!(reply.starts_with("HTTP/1.1 505 "), "{reply}");
}

#[test]
fn handler_panic_becomes_500_and_server_survives() {
    let server = unix_server(Limits::default());
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
    for server in [
        unix_server(Limits::default()),
        tcp_server(Limits::default()),
    ] {
        let mut conn = connect_raw(&server.ep);
        let mut pending = Vec::new();

        conn.write_all(b"POST /echo/one HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n{\"a\":1}")
            .unwrap();
        let r = read_one(&mut *conn, &mut pending);
        assert_eq!(r.status, 200);
        assert!(r.head.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(r.head.contains("Content-Type: application/json"));
        assert!(!r.head.contains("Connection: close"));
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
        assert!(r.head.contains("Connection: close"));
        let mut rest = Vec::new();
        conn.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty() && pending.is_empty());
    }
}

#[test]
fn http10_closes_by_default_and_head_has_no_body() {
    let server = unix_server(Limits::default());
    let reply = raw_exchange(&server.ep, b"GET /echo HTTP/1.0\r\n\r\n");
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(reply.contains("Connection: close\r\n"));

    let reply = raw_exchange(
        &server.ep,
        b"HEAD /echo HTTP/1.1\r\nConnection: close\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 200 OK\r\n"), "{reply}");
    assert!(reply.ends_with("\r\n\r\n"), "{reply}");
}

#[test]
fn expect_continue_gets_interim_response() {
    let server = unix_server(Limits::default());
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
fn stalled_clients_are_timed_out() {
    let limits = Limits {
        read_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let server = unix_server(limits);

    // Partial request, then silence: 408 and close.
    let start = Instant::now();
    let reply = raw_exchange(&server.ep, b"GET /echo HTTP/1.1\r\nHost: x\r\n");
    assert!(
        reply.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{reply}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));

    // Trickling bytes does not extend the deadline.
    let mut conn = connect_raw(&server.ep);
    let start = Instant::now();
    for b in b"GET /echo HTTP/1.1\r\n" {
        if conn.write_all(&[*b]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut out = Vec::new();
    let _ = conn.read_to_end(&mut out);
    assert!(String::from_utf8_lossy(&out).starts_with("HTTP/1.1 408 "));
    assert!(start.elapsed() < Duration::from_secs(5));

    // Idle connection: closed silently.
    let start = Instant::now();
    let reply = raw_exchange(&server.ep, b"");
    assert_eq!(reply, "");
    assert!(start.elapsed() < Duration::from_secs(5));

    // Partial body: 408.
    let reply = raw_exchange(
        &server.ep,
        b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc",
    );
    assert!(reply.starts_with("HTTP/1.1 408 "), "{reply}");
}

#[test]
fn connections_beyond_the_cap_get_503() {
    let limits = Limits {
        max_connections: 1,
        ..Limits::default()
    };
    let server = unix_server(limits);

    // Occupy the only slot with a live keep-alive connection.
    let mut first = connect_raw(&server.ep);
    let mut pending = Vec::new();
    first.write_all(b"GET /echo HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_one(&mut *first, &mut pending).status, 200);

    let reply = raw_exchange(&server.ep, b"");
    assert!(
        reply.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{reply}"
    );
    let (status, body) = request(&server.ep, "GET", "/echo", None).unwrap();
    assert_eq!(status, 503);
    assert!(json_of(&body)["error"].as_str().unwrap().contains("busy"));

    // Freeing the slot lets new connections in again.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _) = request(&server.ep, "GET", "/echo", None).unwrap();
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "slot was never released");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn client_errors_are_descriptive() {
    let dir = TempDir::new();
    let ep = Endpoint::Unix(dir.0.join("absent.sock"));
    let err = request(&ep, "GET", "/status", None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    assert_eq!(
        err.to_string(),
        format!(
            "cannot connect to the Tessera node at unix:{}: No such file or directory \
             — is the node running?",
            dir.0.join("absent.sock").display()
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
    let server = tcp_server(Limits::default());
    let (status, body) = request(&server.ep, "GET", "/echo/a b?q=x y&z=%26", None).unwrap();
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
}

#[test]
fn percent_decoding() {
    assert_eq!(percent_decode("/a%20b/c", false).unwrap(), "/a b/c");
    assert_eq!(percent_decode("a+b", false).unwrap(), "a+b");
    assert_eq!(percent_decode("a+b%2B", true).unwrap(), "a b+");
    assert_eq!(percent_decode("%C3%A9", false).unwrap(), "é");
    assert!(percent_decode("%", false).is_none());
    assert!(percent_decode("%4", false).is_none());
    assert!(percent_decode("%zz", false).is_none());
    assert!(percent_decode("%FF", false).is_none());
}

#[test]
fn response_constructors() {
    let r = Response::error(409, "volume \"v\" exists");
    assert_eq!(r.status, 409);
    assert_eq!(json_of(&r.body), json!({"error": "volume \"v\" exists"}));
    let r = Response::json(200, &json!({"ok": true}));
    assert_eq!(r.body, r#"{"ok":true}"#);

    let req = Request {
        method: "GET".into(),
        path: "/".into(),
        query: vec![("a".into(), "1".into()), ("a".into(), "2".into())],
        body: Vec::new(),
    };
    assert_eq!(req.query_param("a"), Some("1"));
    assert_eq!(req.query_param("b"), None);
    assert_eq!(req.json_body().unwrap(), Value::Null);
}
