//! Hostile and broken NBD clients against a node's NBD listener: malformed handshakes,
//! malformed transmission-phase requests, clients that vanish mid-request, idle and slow
//! clients. The node must answer by the spec (error replies or a closed connection), never
//! hang, never stop serving other clients, and never die (every reactor core still runs:
//! [`TestNode::assert_alive`]). The node is `tessera up`'s (vol0, 4 GiB), in process.
//! (Moved from `crates/tessera-cli/tests/cli/malformed_input.rs`.)

// Test code: the values cast here are the test's own small sizes, offsets and counts.
#![allow(clippy::cast_possible_truncation)]

use crate::common;
use common::*;

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_nbd::proto;

const TIMEOUT: Duration = Duration::from_secs(5);
const VOL0_SIZE: u64 = 4 << 30;
/// Where writes refused for unknown flags were aimed (nothing else writes there).
const REFUSED_AT: u64 = 100 << 20;
/// Where the pipelined write and read go.
const PIPELINED_AT: u64 = 50 << 20;

/// A raw TCP connection to the node's NBD port with 5 s timeouts.
fn raw(n: &TestNode) -> TcpStream {
    let s = TcpStream::connect(n.addr()).expect("connect to the NBD port");
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.set_write_timeout(Some(TIMEOUT)).unwrap();
    s
}

/// Read the 18-byte server greeting and check it.
fn greeting(s: &mut TcpStream) -> u16 {
    let mut g = [0u8; 18];
    s.read_exact(&mut g).expect("server greeting");
    assert_eq!(
        u64::from_be_bytes(g[0..8].try_into().unwrap()),
        proto::NBDMAGIC
    );
    assert_eq!(
        u64::from_be_bytes(g[8..16].try_into().unwrap()),
        proto::IHAVEOPT
    );
    let flags = u16::from_be_bytes([g[16], g[17]]);
    assert!(
        flags & proto::FLAG_FIXED_NEWSTYLE != 0,
        "server flags {flags:#x}"
    );
    flags
}

/// Greeting plus client flags (fixed newstyle, no zeroes).
fn raw_handshake_start(n: &TestNode) -> TcpStream {
    let mut s = raw(n);
    let f = greeting(&mut s);
    let mut cf = proto::CLIENT_FLAG_FIXED_NEWSTYLE;
    if f & proto::FLAG_NO_ZEROES != 0 {
        cf |= proto::CLIENT_FLAG_NO_ZEROES;
    }
    s.write_all(&cf.to_be_bytes()).unwrap();
    s
}

fn option_bytes(magic: u64, opt: u32, len: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + data.len());
    b.extend_from_slice(&magic.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// One option reply: (option echoed, reply type, payload).
fn option_reply(s: &mut TcpStream) -> io::Result<(u32, u32, Vec<u8>)> {
    let mut h = [0u8; 20];
    s.read_exact(&mut h)?;
    assert_eq!(
        u64::from_be_bytes(h[0..8].try_into().unwrap()),
        proto::OPTION_REPLY_MAGIC,
        "option reply magic"
    );
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let ty = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    assert!(len <= 1 << 20, "option reply of {len} bytes");
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d)?;
    Ok((opt, ty, d))
}

/// What the server did with a connection after we sent something bad.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// EOF or reset, after `n` bytes of whatever the server sent first.
    Closed(Vec<u8>),
    /// Nothing arrived and the connection stayed open for the whole timeout.
    Hung(Vec<u8>),
}

/// Read until the server closes the connection or the timeout expires.
fn drain(s: &mut TcpStream) -> Outcome {
    let mut got = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    let mut b = [0u8; 4096];
    loop {
        if Instant::now() > deadline {
            return Outcome::Hung(got);
        }
        match s.read(&mut b) {
            Ok(0) => return Outcome::Closed(got),
            Ok(k) => got.extend_from_slice(&b[..k]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Outcome::Hung(got)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Outcome::Closed(got),
        }
    }
}

fn assert_closed(s: &mut TcpStream, what: &str) -> Vec<u8> {
    match drain(s) {
        Outcome::Closed(b) => b,
        Outcome::Hung(b) => panic!("{what}: the server neither closed the connection nor finished within {TIMEOUT:?} (got {} bytes: {:02x?})", b.len(), &b[..b.len().min(64)]),
    }
}

/// An NbdClient on a TCP stream with 5 s timeouts, so that nothing can hang a test.
fn client(n: &TestNode, opts: ClientOptions) -> NbdClient {
    NbdClient::from_stream(raw(n), "vol0", opts).expect("NBD handshake for vol0")
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A write and a read-back through `c`: the connection works.
fn io_works(c: &mut NbdClient, offset: u64, seed: u8) {
    let data = pattern(seed, 64 * 1024);
    c.write(offset, &data, false)
        .expect("write on a healthy connection");
    let mut back = vec![0u8; data.len()];
    c.read(offset, &mut back)
        .expect("read on a healthy connection");
    assert!(back == data, "read back different data at {offset}");
}

/// A fresh connection can still do I/O.
fn fresh_client_works(n: &TestNode, offset: u64, seed: u8) {
    let mut c = client(n, ClientOptions::default());
    io_works(&mut c, offset, seed);
    c.flush().expect("flush");
}

#[test]
fn garbage_client_flags_close_the_connection() {
    let n = TestNode::up("mal-flags");
    // Garbage where the 4-byte client flags belong (unknown flag bits set).
    let mut s = raw(&n);
    greeting(&mut s);
    s.write_all(b"GARBAGE GARBAGE GARBAGE GARBAGE\r\n").unwrap();
    assert_closed(&mut s, "garbage client flags");
    // All-ones flags.
    let mut s = raw(&n);
    greeting(&mut s);
    s.write_all(&[0xff; 4]).unwrap();
    assert_closed(&mut s, "client flags 0xffffffff");
    // An HTTP request instead of NBD.
    let mut s = raw(&n);
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let got = assert_closed(&mut s, "HTTP request");
    assert!(
        got.len() <= 18,
        "the server said more than its greeting to an HTTP client: {got:02x?}"
    );
    fresh_client_works(&n, 0, 1);
    n.assert_alive("node died");
}

#[test]
fn bad_option_magic_closes_the_connection() {
    let n = TestNode::up("mal-optmagic");
    let mut s = raw_handshake_start(&n);
    s.write_all(&option_bytes(0x1122_3344_5566_7788, proto::OPT_GO, 0, &[]))
        .unwrap();
    let got = assert_closed(&mut s, "option with bad magic");
    assert!(
        got.is_empty(),
        "the server replied to an option with a bad magic: {got:02x?}"
    );
    // The same after a valid option has been answered.
    let mut s = raw_handshake_start(&n);
    s.write_all(&option_bytes(
        proto::IHAVEOPT,
        proto::OPT_STRUCTURED_REPLY,
        0,
        &[],
    ))
    .unwrap();
    let (opt, ty, _) = option_reply(&mut s).expect("reply to NBD_OPT_STRUCTURED_REPLY");
    assert_eq!((opt, ty), (proto::OPT_STRUCTURED_REPLY, proto::REP_ACK));
    s.write_all(&option_bytes(
        u64::from_be_bytes(*b"IHAVEOPS"),
        proto::OPT_GO,
        4,
        &[0, 0, 0, 0],
    ))
    .unwrap();
    assert_closed(&mut s, "second option with bad magic");
    fresh_client_works(&n, 0, 2);
    n.assert_alive("node died");
}

#[test]
fn huge_option_length_does_not_hang() {
    let n = TestNode::up("mal-optlen");
    for opt in [
        proto::OPT_GO,
        proto::OPT_EXPORT_NAME,
        proto::OPT_LIST,
        0x1234,
    ] {
        let mut s = raw_handshake_start(&n);
        // Claims 4 GiB of option data and sends only a few bytes of it.
        s.write_all(&option_bytes(proto::IHAVEOPT, opt, 0xFFFF_FFFF, b"vol0"))
            .unwrap();
        let t = Instant::now();
        match drain(&mut s) {
            Outcome::Closed(_) => {}
            Outcome::Hung(b) => {
                // Acceptable only if the server already answered with an error reply.
                assert!(b.len() >= 20, "option {opt:#x} with length 0xffffffff: no reply and no close within {TIMEOUT:?}");
                assert_eq!(
                    u64::from_be_bytes(b[0..8].try_into().unwrap()),
                    proto::OPTION_REPLY_MAGIC
                );
                let ty = u32::from_be_bytes(b[12..16].try_into().unwrap());
                assert!(
                    ty & proto::REP_FLAG_ERROR != 0,
                    "option {opt:#x} with length 0xffffffff got reply type {ty:#x}"
                );
            }
        }
        assert!(
            t.elapsed() < TIMEOUT,
            "option {opt:#x}: took {:?}",
            t.elapsed()
        );
    }
    fresh_client_works(&n, 0, 3);
    n.assert_alive("node died");
}

#[test]
fn unknown_option_is_unsupported_and_go_still_works() {
    let n = TestNode::up("mal-unknown-opt");
    let mut s = raw_handshake_start(&n);
    s.write_all(&option_bytes(proto::IHAVEOPT, 0x1234, 5, b"hello"))
        .unwrap();
    let (opt, ty, _msg) = option_reply(&mut s).expect("reply to unknown option 0x1234");
    assert_eq!(opt, 0x1234, "option echoed");
    assert_eq!(
        ty,
        proto::REP_ERR_UNSUP,
        "reply type {ty:#x}, expected NBD_REP_ERR_UNSUP"
    );
    // And one without data.
    s.write_all(&option_bytes(proto::IHAVEOPT, 0x1234, 0, &[]))
        .unwrap();
    let (opt, ty, _) = option_reply(&mut s).expect("reply to second unknown option");
    assert_eq!((opt, ty), (0x1234, proto::REP_ERR_UNSUP));

    // NBD_OPT_GO on vol0, no information requests, no structured replies.
    let mut d = Vec::new();
    d.extend_from_slice(&4u32.to_be_bytes());
    d.extend_from_slice(b"vol0");
    d.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&option_bytes(
        proto::IHAVEOPT,
        proto::OPT_GO,
        d.len() as u32,
        &d,
    ))
    .unwrap();
    let mut export = None;
    loop {
        let (opt, ty, data) = option_reply(&mut s).expect("reply to NBD_OPT_GO");
        assert_eq!(opt, proto::OPT_GO);
        match ty {
            proto::REP_INFO => {
                if u16::from_be_bytes([data[0], data[1]]) == proto::INFO_EXPORT {
                    assert_eq!(data.len(), 12);
                    export = Some((
                        u64::from_be_bytes(data[2..10].try_into().unwrap()),
                        u16::from_be_bytes([data[10], data[11]]),
                    ));
                }
            }
            proto::REP_ACK => break,
            other => panic!(
                "NBD_OPT_GO after an unknown option failed: reply type {other:#x} {:?}",
                String::from_utf8_lossy(&data)
            ),
        }
    }
    let (size, _flags) = export.expect("NBD_INFO_EXPORT");
    assert_eq!(size, VOL0_SIZE);

    // Transmission with simple replies: write 4 KiB and read it back by hand.
    let data = pattern(7, 4096);
    let w = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_WRITE,
        cookie: 11,
        offset: 8192,
        length: 4096,
    });
    s.write_all(&w).unwrap();
    s.write_all(&data).unwrap();
    let mut r = [0u8; 16];
    s.read_exact(&mut r).expect("write reply");
    assert_eq!(
        u32::from_be_bytes(r[0..4].try_into().unwrap()),
        proto::SIMPLE_REPLY_MAGIC
    );
    assert_eq!(
        u32::from_be_bytes(r[4..8].try_into().unwrap()),
        0,
        "write error"
    );
    assert_eq!(u64::from_be_bytes(r[8..16].try_into().unwrap()), 11);
    let rd = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_READ,
        cookie: 12,
        offset: 8192,
        length: 4096,
    });
    s.write_all(&rd).unwrap();
    s.read_exact(&mut r).expect("read reply");
    assert_eq!(
        u32::from_be_bytes(r[0..4].try_into().unwrap()),
        proto::SIMPLE_REPLY_MAGIC
    );
    assert_eq!(
        u32::from_be_bytes(r[4..8].try_into().unwrap()),
        0,
        "read error"
    );
    assert_eq!(u64::from_be_bytes(r[8..16].try_into().unwrap()), 12);
    let mut back = vec![0u8; 4096];
    s.read_exact(&mut back).expect("read payload");
    assert!(back == data, "read back different data");
    n.assert_alive("node died");
}

/// Send one raw request and return its reply's NBD error (0 = success).
fn request_error(
    c: &mut NbdClient,
    cmd: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    len: u32,
    payload: &[u8],
) -> u32 {
    c.send_request(cmd, flags, cookie, offset, len, payload)
        .expect("send request");
    // A simple reply does not carry its length: tell the client how long a READ's data is,
    // in case the server (wrongly) accepts the request.
    let read_len = if cmd == proto::CMD_READ { len } else { 0 };
    let r = c
        .recv_reply(move |ck| if ck == cookie { read_len } else { 0 })
        .unwrap_or_else(|e| {
            panic!("reply to cmd {cmd} flags {flags:#x} offset {offset} len {len}: {e}")
        });
    assert_eq!(r.cookie, cookie, "reply cookie");
    r.error
}

fn transmission_errors(n: &TestNode, opts: ClientOptions) {
    let mut c = client(n, opts);
    let size = c.size();
    assert_eq!(size, VOL0_SIZE);
    io_works(&mut c, 0, 10);

    // Unknown command type.
    let e = request_error(&mut c, 99, 0, 1, 0, 0, &[]);
    assert_eq!(e, proto::EINVAL, "unknown command 99: error {e}");
    io_works(&mut c, 1 << 20, 11);

    // Unknown command with a non-zero length (no payload: only WRITE carries one).
    let e = request_error(&mut c, 99, 0, 2, 0, 4096, &[]);
    assert_eq!(
        e,
        proto::EINVAL,
        "unknown command 99 with length: error {e}"
    );
    io_works(&mut c, 2 << 20, 12);

    // Reads beyond the end.
    for (off, len) in [
        (size - 2048, 4096u32),
        (size, 512),
        (size + (1 << 20), 4096),
        (u64::MAX - 511, 4096),
    ] {
        let e = request_error(&mut c, proto::CMD_READ, 0, 3, off, len, &[]);
        assert_eq!(
            e,
            proto::EINVAL,
            "read of {len} at {off} (size {size}): error {e}"
        );
        let mut b = vec![0u8; len as usize];
        let err = c
            .read(off, &mut b)
            .expect_err("read beyond the end succeeded");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL), "{err}");
    }
    io_works(&mut c, 3 << 20, 13);

    // Writes beyond the end: the payload must still be consumed so the stream stays in sync.
    for (off, len) in [(size - 2048, 4096u32), (size, 4096), (u64::MAX - 511, 512)] {
        let e = request_error(
            &mut c,
            proto::CMD_WRITE,
            0,
            4,
            off,
            len,
            &pattern(5, len as usize),
        );
        assert!(
            e == proto::ENOSPC || e == proto::EINVAL,
            "write of {len} at {off} (size {size}): error {e}, expected ENOSPC or EINVAL"
        );
        io_works(&mut c, 4 << 20, 14);
    }
    // The tail that does fit was not written by the refused request.
    let mut tail = vec![0u8; 2048];
    c.read(size - 2048, &mut tail).unwrap();
    assert!(
        tail.iter().all(|&b| b == 0),
        "a refused write beyond the end changed the last 2 KiB"
    );

    // A read over the 32 MiB maximum payload.
    let e = request_error(&mut c, proto::CMD_READ, 0, 5, 0, 64 << 20, &[]);
    assert!(
        e == proto::EOVERFLOW || e == proto::EINVAL,
        "64 MiB read: error {e}, expected EOVERFLOW or EINVAL"
    );
    io_works(&mut c, 5 << 20, 15);

    // Unknown command flag bits, on a read, a flush and a write (whose payload must be skipped).
    for bit in [1u16 << 5, 1 << 9, 1 << 15] {
        let e = request_error(&mut c, proto::CMD_READ, bit, 6, 0, 4096, &[]);
        assert_eq!(e, proto::EINVAL, "read with flag {bit:#x}: error {e}");
        let e = request_error(&mut c, proto::CMD_FLUSH, bit, 7, 0, 0, &[]);
        assert_eq!(e, proto::EINVAL, "flush with flag {bit:#x}: error {e}");
        let e = request_error(
            &mut c,
            proto::CMD_WRITE,
            bit,
            8,
            REFUSED_AT,
            4096,
            &pattern(9, 4096),
        );
        assert_eq!(e, proto::EINVAL, "write with flag {bit:#x}: error {e}");
        io_works(&mut c, 6 << 20, 16);
    }
    // The refused flagged writes did not write.
    let mut b = vec![0u8; 4096];
    c.read(REFUSED_AT, &mut b).unwrap();
    assert!(
        b.iter().all(|&x| x == 0),
        "a write refused for unknown flags changed the data"
    );

    // Pipelined: bad requests in between good ones, replies matched by cookie.
    c.send_request(
        proto::CMD_WRITE,
        0,
        20,
        PIPELINED_AT,
        4096,
        &pattern(20, 4096),
    )
    .unwrap();
    c.send_request(99, 0, 21, 0, 0, &[]).unwrap();
    c.send_request(proto::CMD_READ, 0, 22, size, 4096, &[])
        .unwrap();
    c.send_request(proto::CMD_READ, 0, 23, PIPELINED_AT, 4096, &[])
        .unwrap();
    let mut errs = std::collections::HashMap::new();
    for _ in 0..4 {
        let r = c
            .recv_reply(|ck| if ck == 22 || ck == 23 { 4096 } else { 0 })
            .expect("pipelined reply");
        if r.cookie == 23 && r.error == 0 {
            // The read may run before or after the write: both contents are legal.
            assert!(
                r.data == pattern(20, 4096) || r.data.iter().all(|&x| x == 0),
                "pipelined read returned unrelated data"
            );
        }
        errs.insert(r.cookie, r.error);
    }
    assert_eq!(errs.get(&20), Some(&0));
    assert_eq!(errs.get(&21), Some(&proto::EINVAL));
    assert_eq!(errs.get(&22), Some(&proto::EINVAL));
    assert_eq!(errs.get(&23), Some(&0));
    io_works(&mut c, 7 << 20, 17);
    c.flush().unwrap();

    // Finally a request with a bad magic: the server must close the connection.
    let mut h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_READ,
        cookie: 30,
        offset: 0,
        length: 4096,
    });
    h[0..4].copy_from_slice(&0xdead_beefu32.to_be_bytes());
    let s = c.stream_mut();
    s.write_all(&h).unwrap();
    s.flush().unwrap();
    let t = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {} // a reply to something else would be odd but is not the point here
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                panic!(
                    "request with bad magic: connection still open after {:?}",
                    t.elapsed()
                )
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
}

#[test]
fn malformed_requests_get_errors_and_the_connection_survives() {
    let n = TestNode::up("mal-tx");
    transmission_errors(&n, ClientOptions::default());
    transmission_errors(
        &n,
        ClientOptions {
            structured_replies: false,
            base_allocation: false,
        },
    );
    fresh_client_works(&n, 1 << 20, 18);
    n.assert_alive("node died");
}

#[test]
fn client_vanishing_mid_write_payload_does_not_disturb_others() {
    let n = TestNode::up("mal-vanish");
    // A client connected before the bad ones, which must keep working throughout.
    let mut bystander = client(&n, ClientOptions::default());
    io_works(&mut bystander, 64 << 20, 1);

    // 1 MiB WRITE header, half the payload, then gone.
    let mut bad = client(&n, ClientOptions::default());
    let h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_WRITE,
        cookie: 1,
        offset: 0,
        length: 1 << 20,
    });
    let s = bad.stream_mut();
    s.write_all(&h).unwrap();
    s.write_all(&pattern(3, 512 << 10)).unwrap();
    s.flush().unwrap();
    drop(bad);

    // Same, but the client stays connected and silent (holding the half-received request).
    let mut stalled = client(&n, ClientOptions::default());
    let h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_WRITE,
        cookie: 1,
        offset: 2 << 20,
        length: 1 << 20,
    });
    let s = stalled.stream_mut();
    s.write_all(&h).unwrap();
    s.write_all(&pattern(4, 512 << 10)).unwrap();
    s.flush().unwrap();

    // And one that dies right after a header with no payload at all, with a reset.
    let mut abrupt = raw(&n);
    let mut c2 = NbdClient::from_stream(
        abrupt.try_clone().unwrap(),
        "vol0",
        ClientOptions::default(),
    )
    .unwrap();
    let h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_WRITE,
        cookie: 1,
        offset: 4 << 20,
        length: 32 << 20,
    });
    c2.stream_mut().write_all(&h).unwrap();
    abrupt.flush().unwrap();
    let _ = abrupt.shutdown(Shutdown::Both);
    drop(c2);

    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    io_works(&mut bystander, 65 << 20, 2);
    fresh_client_works(&n, 66 << 20, 3);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "I/O for healthy clients took {:?}",
        t.elapsed()
    );

    // A WRITE whose payload never fully arrived must not have been executed, not even
    // in part: those ranges still read as zeros.
    let mut c = client(&n, ClientOptions::default());
    let mut b = vec![0u8; 1 << 20];
    for (off, who) in [(0u64, "vanished"), (2 << 20, "stalled"), (4 << 20, "reset")] {
        c.read(off, &mut b)
            .unwrap_or_else(|e| panic!("read the range of the {who} write: {e}"));
        assert!(
            b.iter().all(|&x| x == 0),
            "the {who} client's incomplete 1 MiB WRITE at {off} changed data"
        );
    }
    drop(stalled);
    n.assert_alive("node died");
}

#[test]
fn idle_and_slow_clients_do_not_block_normal_ones() {
    let n = TestNode::up("mal-slow");
    // 50 connections that say nothing at all.
    let idle: Vec<TcpStream> = (0..50).map(|_| raw(&n)).collect();
    // 20 that finish the handshake and then idle in the transmission phase.
    let idle_tx: Vec<NbdClient> = (0..20)
        .map(|_| client(&n, ClientOptions::default()))
        .collect();

    // A slowloris: a valid handshake (then a request), one byte every 100 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let mut slow_bytes = Vec::new();
    slow_bytes.extend_from_slice(
        &(proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES).to_be_bytes(),
    );
    let mut d = Vec::new();
    d.extend_from_slice(&4u32.to_be_bytes());
    d.extend_from_slice(b"vol0");
    d.extend_from_slice(&0u16.to_be_bytes());
    slow_bytes.extend_from_slice(&option_bytes(
        proto::IHAVEOPT,
        proto::OPT_GO,
        d.len() as u32,
        &d,
    ));
    slow_bytes.extend_from_slice(&proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_READ,
        cookie: 1,
        offset: 0,
        length: 4096,
    }));
    let mut slow_conns = Vec::new();
    for _ in 0..2 {
        let mut s = raw(&n);
        let stop = stop.clone();
        let bytes = slow_bytes.clone();
        slow_conns.push(std::thread::spawn(move || {
            let mut g = [0u8; 18];
            let _ = s.read_exact(&mut g);
            for b in bytes {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }
    // A slowloris in the transmission phase: a WRITE trickling in byte by byte.
    {
        let mut c = client(&n, ClientOptions::default());
        let stop = stop.clone();
        slow_conns.push(std::thread::spawn(move || {
            let mut bytes = proto::encode_request(&proto::RequestHeader {
                flags: 0,
                cmd: proto::CMD_WRITE,
                cookie: 1,
                offset: 8 << 20,
                length: 4096,
            })
            .to_vec();
            bytes.extend_from_slice(&[0x5a; 4096]);
            for b in bytes {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let s = c.stream_mut();
                if s.write_all(&[b]).and_then(|_| s.flush()).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }));
    }
    std::thread::sleep(Duration::from_millis(500));

    for round in 0..3 {
        let t = Instant::now();
        let mut c = client(&n, ClientOptions::default());
        io_works(&mut c, (round as u64 + 16) << 20, round as u8);
        c.flush().unwrap();
        let took = t.elapsed();
        assert!(took < Duration::from_secs(2), "round {round}: connect + handshake + I/O took {took:?} with idle and slow clients around");
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, Ordering::Relaxed);
    for t in slow_conns {
        t.join().unwrap();
    }
    drop(idle);
    drop(idle_tx);
    fresh_client_works(&n, 32 << 20, 9);
    n.assert_alive("node died");
}
