//! A small blocking client for etcd's v3 API through its JSON gateway (`POST /v3/...`,
//! keys and values base64-encoded), served by every etcd 3.4+ member on its client URL.
//!
//! Why not a gRPC client: the cluster layer makes a handful of calls per second at most
//! (lease keepalives, spec reads and compare-and-swaps), all off the datapath, and the
//! gateway is etcd's documented JSON mapping of the same RPCs. A gRPC stack (tonic, prost,
//! h2) would add minutes to every fresh build on the 2-core CI machine for no gain here.
//!
//! Every call has a deadline; a call that fails on one endpoint (connection refused, time
//! out, a 5xx from a member without quorum) is tried on the next one, so a cluster of
//! three members keeps answering while one is down.

use std::fmt;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};

/// An etcd error, with the endpoint and what was asked.
#[derive(Debug)]
pub struct EtcdError(pub String);

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EtcdError {}

impl From<EtcdError> for io::Error {
    fn from(e: EtcdError) -> io::Error {
        io::Error::other(e.0)
    }
}

pub type Result<T> = std::result::Result<T, EtcdError>;

/// One key as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision of the last change of the key (compare-and-swap token).
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

/// A client for a set of etcd members (`http://HOST:PORT` client URLs).
#[derive(Clone, Debug)]
pub struct Etcd {
    endpoints: Vec<String>,
    timeout: Duration,
    /// The endpoint that answered last: tried first, so a dead or partitioned member
    /// costs one timeout, not one per call.
    preferred: Arc<AtomicUsize>,
}

impl Etcd {
    /// A client for `endpoints` (`http://HOST:PORT`; TLS to etcd is not supported yet,
    /// so it belongs on loopback or a trusted network). Each call waits at most `timeout`
    /// per endpoint.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Etcd> {
        if endpoints.is_empty() {
            return Err(EtcdError("no etcd endpoint given".into()));
        }
        let mut eps = Vec::new();
        for e in endpoints {
            let addr = e.strip_prefix("http://").ok_or_else(|| {
                EtcdError(format!(
                    "etcd endpoint '{e}': expected http://HOST:PORT (https is not supported)"
                ))
            })?;
            let addr = addr.trim_end_matches('/');
            if !addr.contains(':') {
                return Err(EtcdError(format!(
                    "etcd endpoint '{e}': expected http://HOST:PORT"
                )));
            }
            eps.push(addr.to_string());
        }
        Ok(Etcd {
            endpoints: eps,
            timeout,
            preferred: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// One RPC on the first endpoint that answers it.
    fn call(&self, path: &str, body: &Value) -> Result<Value> {
        let payload = serde_json::to_vec(body).map_err(|e| EtcdError(e.to_string()))?;
        let mut errors = Vec::new();
        let first = self.preferred.load(Relaxed);
        let n = self.endpoints.len();
        for i in (0..n).map(|k| (first + k) % n) {
            let ep = &self.endpoints[i];
            match post(ep, path, &payload, self.timeout) {
                Ok((200, text)) => {
                    self.preferred.store(i, Relaxed);
                    return serde_json::from_slice(&text).map_err(|e| {
                        EtcdError(format!("etcd at {ep}: {path} answered non-JSON: {e}"))
                    });
                }
                // 4xx: the request itself is wrong (or a lease is gone); another member
                // would say the same.
                Ok((status, text)) if (400..500).contains(&status) => {
                    return Err(EtcdError(format!(
                        "etcd at {ep}: {path} refused (HTTP {status}): {}",
                        gateway_message(&text)
                    )))
                }
                Ok((status, text)) => {
                    errors.push(format!("{ep}: HTTP {status}: {}", gateway_message(&text)))
                }
                Err(e) => errors.push(format!("{ep}: {e}")),
            }
        }
        Err(EtcdError(format!(
            "no etcd member answered {path}: {}",
            errors.join("; ")
        )))
    }

    /// Grant a lease of `ttl` seconds; its id.
    pub fn grant(&self, ttl: i64) -> Result<i64> {
        let v = self.call("/v3/lease/grant", &json!({ "TTL": ttl }))?;
        if let Some(e) = v
            .get("error")
            .and_then(Value::as_str)
            .filter(|e| !e.is_empty())
        {
            return Err(EtcdError(format!("lease grant: {e}")));
        }
        int_field(&v, "ID").ok_or_else(|| EtcdError(format!("lease grant: no ID in {v}")))
    }

    /// Renew a lease; the TTL it has now (0 or an error: the lease is gone).
    pub fn keepalive(&self, lease: i64) -> Result<i64> {
        let v = self.call("/v3/lease/keepalive", &json!({ "ID": lease.to_string() }))?;
        let r = v.get("result").unwrap_or(&v);
        Ok(int_field(r, "TTL").unwrap_or(0))
    }

    /// Give a lease up: its keys disappear at once.
    pub fn revoke(&self, lease: i64) -> Result<()> {
        self.call("/v3/lease/revoke", &json!({ "ID": lease.to_string() }))
            .map(|_| ())
    }

    /// Write `key` (attached to `lease` unless 0).
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<()> {
        let mut body = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if lease != 0 {
            body["lease"] = json!(lease.to_string());
        }
        self.call("/v3/kv/put", &body).map(|_| ())
    }

    /// Read one key.
    pub fn get(&self, key: &str) -> Result<Option<Kv>> {
        let v = self.call("/v3/kv/range", &json!({ "key": B64.encode(key) }))?;
        Ok(kvs(&v)?.into_iter().next())
    }

    /// Every key under `prefix`, in key order.
    pub fn list(&self, prefix: &str) -> Result<Vec<Kv>> {
        let v = self.call(
            "/v3/kv/range",
            &json!({ "key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)) }),
        )?;
        kvs(&v)
    }

    /// Delete one key; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let v = self.call("/v3/kv/deleterange", &json!({ "key": B64.encode(key) }))?;
        Ok(int_field(&v, "deleted").unwrap_or(0) > 0)
    }

    /// Create `key` only if it does not exist; whether it was created.
    pub fn create(&self, key: &str, value: &[u8], lease: i64) -> Result<bool> {
        self.txn_put(key, value, lease, json!({
            "key": B64.encode(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"
        }))
    }

    /// Replace `key` only if it was last changed at `mod_revision` (what [`Etcd::get`]
    /// returned); whether it was replaced. The compare-and-swap every ownership change
    /// goes through.
    pub fn swap(&self, key: &str, mod_revision: i64, value: &[u8], lease: i64) -> Result<bool> {
        self.txn_put(
            key,
            value,
            lease,
            json!({
                "key": B64.encode(key), "target": "MOD", "result": "EQUAL",
                "mod_revision": mod_revision.to_string()
            }),
        )
    }

    fn txn_put(&self, key: &str, value: &[u8], lease: i64, compare: Value) -> Result<bool> {
        let mut put = json!({ "key": B64.encode(key), "value": B64.encode(value) });
        if lease != 0 {
            put["lease"] = json!(lease.to_string());
        }
        let v = self.call(
            "/v3/kv/txn",
            &json!({ "compare": [compare], "success": [{ "request_put": put }] }),
        )?;
        Ok(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
    }
}

/// The gateway's JSON error text, or the body as it came.
fn gateway_message(text: &[u8]) -> String {
    let s = String::from_utf8_lossy(text);
    serde_json::from_str::<Value>(&s)
        .ok()
        .and_then(|v| {
            v.get("message")
                .or_else(|| v.get("error"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_else(|| s.trim().chars().take(200).collect())
}

/// The gateway renders int64 fields as JSON strings.
fn int_field(v: &Value, name: &str) -> Option<i64> {
    match v.get(name)? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

fn kvs(v: &Value) -> Result<Vec<Kv>> {
    let Some(list) = v.get("kvs").and_then(Value::as_array) else {
        return Ok(Vec::new());
    };
    list.iter()
        .map(|kv| {
            let field = |n: &str| -> Result<Vec<u8>> {
                match kv.get(n).and_then(Value::as_str) {
                    Some(s) => B64
                        .decode(s)
                        .map_err(|e| EtcdError(format!("etcd sent bad base64 in {n}: {e}"))),
                    None => Ok(Vec::new()),
                }
            };
            Ok(Kv {
                key: String::from_utf8_lossy(&field("key")?).into_owned(),
                value: field("value")?,
                mod_revision: int_field(kv, "mod_revision").unwrap_or(0),
                lease: int_field(kv, "lease").unwrap_or(0),
            })
        })
        .collect()
}

/// The first key after every key starting with `prefix` (etcd's range end).
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// POST `body` to `http://addr/path`; (status, body). One connection per call
/// (`Connection: close`), bounded by `timeout` for connecting and for each read.
fn post(addr: &str, path: &str, body: &[u8], timeout: Duration) -> io::Result<(u16, Vec<u8>)> {
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(ErrorKind::NotFound, "address resolves to nothing"))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let _ = s.set_nodelay(true);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Connection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.take(MAX_RESPONSE).read_to_end(&mut raw)?;
    parse_response(&raw)
}

/// Largest response accepted (a listing of every node and volume of a big cluster fits).
const MAX_RESPONSE: u64 = 64 << 20;

fn parse_response(raw: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let bad = |w: &str| io::Error::new(ErrorKind::InvalidData, format!("bad HTTP response: {w}"));
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of head"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("head is not text"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let mut chunked = false;
    let mut length = None;
    for l in lines {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if k == "content-length" {
            length = v.parse::<usize>().ok();
        }
    }
    let body = &raw[end + 4..];
    if !chunked {
        let n = length.unwrap_or(body.len());
        if body.len() < n {
            return Err(bad("body shorter than its Content-Length"));
        }
        return Ok((status, body[..n].to_vec()));
    }
    let mut out = Vec::new();
    let mut rest = body;
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| bad("chunk size line"))?;
        let size_text = std::str::from_utf8(&rest[..eol]).map_err(|_| bad("chunk size"))?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| bad("chunk size"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok((status, out));
        }
        if rest.len() < size + 2 {
            return Err(bad("chunk shorter than its size"));
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_with_length_or_chunks_parse() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!(r, (200, b"{}".to_vec()));
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=y\r\n\":1}\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r, (200, b"{\"a\":1}".to_vec()));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}").is_err());
        assert!(parse_response(b"garbage").is_err());
    }

    #[test]
    fn prefix_ends_and_endpoints() {
        assert_eq!(prefix_end("/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
        assert!(Etcd::new(&[], Duration::from_secs(1)).is_err());
        assert!(Etcd::new(&["https://x:1".into()], Duration::from_secs(1)).is_err());
        assert!(Etcd::new(&["http://x".into()], Duration::from_secs(1)).is_err());
        assert!(Etcd::new(&["http://127.0.0.1:2379/".into()], Duration::from_secs(1)).is_ok());
    }
}
