//! `tessera nbd-perf`: a pipelined NBD load generator that measures the server, not the
//! client.
//!
//! Each connection is driven by one thread that keeps `qd` requests outstanding (the cookie
//! is the slot index). The handshake goes through [`NbdClient`]; the transmission phase is
//! done here on the raw socket by the shared connection loop ([`crate::conn`]): every
//! request that can be (re)issued is encoded into one buffer and leaves in a single
//! `send`, and replies are received into a 1 MiB buffer and parsed in bulk, READ payloads
//! being skipped in place rather than copied out. A slot is reissued the moment its reply
//! has been parsed, so in steady state a connection costs two system calls per batch of
//! replies (one `recv`, one `send`), whatever the queue depth.
//!
//! Sends are non-blocking and a partly sent batch makes the thread `poll` for both
//! directions, so a connection never deadlocks with a server that stops reading requests
//! while its replies are waiting for us. With `--busy-poll` the thread never sleeps (it
//! spins on non-blocking receives), which keeps the client's own wake-up latency out of
//! queue-depth-1 measurements; on a VM that wake-up can cost more than the server's
//! whole round trip.

use crate::error::LoadError;
use std::io::Write as _;
use std::net::TcpStream;
use tessera_io::cast::{u32_of, usize_of};

use clap::Args;
use tessera_device::format_size;
use tessera_nbd::client::{nbd_error_to_io, ClientOptions, NbdClient};
use tessera_nbd::proto;

use crate::conn::{self, Buffers, Conn, Core, LoadArgs, Protocol, Words, Workload};
use crate::workload::{payload, Pattern, Rng};

#[derive(Args, Clone, Debug)]
pub struct NbdPerfArgs {
    /// Server and export: nbd://HOST[:PORT]/[EXPORT] (port 10809 if omitted; an empty
    /// export name selects the server's default export).
    #[arg(long, conflicts_with_all = ["addr", "export"], required_unless_present = "addr")]
    uri: Option<String>,
    /// Server address HOST:PORT, instead of --uri.
    #[arg(long)]
    addr: Option<String>,
    /// Export name with --addr (default: "", the server's default export).
    #[arg(long, requires = "addr")]
    export: Option<String>,
    #[command(flatten)]
    load: LoadArgs,
    /// Connections, each driven by its own thread with its own queue depth.
    #[arg(long, default_value_t = 1)]
    conns: usize,
}

/// Receive buffer per connection.
const RECV_BUF: usize = 1 << 20;
/// Largest structured error chunk accepted (a 4096-byte message plus slack, as the spec
/// caps messages at 4096 bytes).
const MAX_ERROR_CHUNK: usize = 64 * 1024;
const DEFAULT_PORT: u16 = 10809;

/// Split `nbd://HOST[:PORT]/[EXPORT]` into `("HOST:PORT", "EXPORT")`.
fn parse_uri(uri: &str) -> Result<(String, String), LoadError> {
    let rest = uri.strip_prefix("nbd://").ok_or_else(|| {
        LoadError::Invalid(format!(
            "{uri:?}: only nbd://HOST[:PORT]/EXPORT URIs are supported (TCP, no TLS)"
        ))
    })?;
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let (auth, path) = rest.split_once('/').unwrap_or((rest, ""));
    if auth.is_empty() {
        return Err(LoadError::invalid(format!("{uri:?}: no host")));
    }
    let has_port = match auth.rfind(']') {
        Some(i) => auth[i + 1..].starts_with(':'),
        None => auth.contains(':'),
    };
    let addr = if has_port {
        auth.to_string()
    } else {
        format!("{auth}:{DEFAULT_PORT}")
    };
    Ok((
        addr,
        percent_decode(path).map_err(|e| e.within(format_args!("{uri:?}")))?,
    ))
}

fn percent_decode(s: &str) -> Result<String, LoadError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| LoadError::invalid("bad percent escape in the export name"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| LoadError::invalid("export name is not UTF-8"))
}

/// Describe an NBD error number for humans.
fn nbd_error_text(code: u32, msg: Option<&str>) -> String {
    let e = nbd_error_to_io(code);
    match msg {
        Some(m) if !m.is_empty() => format!("{e} (NBD error {code}): {m}"),
        _ => format!("{e} (NBD error {code})"),
    }
}

/// The NBD side of one connection: how replies are framed.
pub struct Nbd {
    structured: bool,
    /// Payload bytes of the current reply still to be skipped, and the slot that
    /// completes when they have been.
    skip: usize,
    skip_then: Option<usize>,
}

/// A reply header (and any payload it needs whole) that was parsed: its length, and how
/// many requests it completed.
type Parsed = Option<(usize, u64)>;

impl Nbd {
    /// A connection of `qd` requests of `w.bs` bytes over `blocks` blocks.
    fn conn(w: &Workload, blocks: u64, qd: usize, structured: bool, rng: Rng) -> Conn<Nbd> {
        let b = Buffers::new(
            payload(usize_of(w.bs)),
            RECV_BUF.max(4 * MAX_ERROR_CHUNK),
            MAX_ERROR_CHUNK + proto::STRUCTURED_REPLY_LEN,
            qd * proto::REQUEST_HEADER_LEN,
        );
        Conn {
            core: Core::new(w, blocks, qd, rng, b),
            proto: Nbd {
                structured,
                skip: 0,
                skip_then: None,
            },
        }
    }

    fn fail(c: &mut Core, slot: usize, code: u32, msg: Option<&str>) {
        c.fail(slot, |write| {
            let what = if write { "WRITE" } else { "READ" };
            format!("{what}: {}", nbd_error_text(code, msg))
        });
    }

    fn slot_of(c: &Core, cookie: u64) -> Result<usize, LoadError> {
        c.slot_of(cookie, || {
            format!("reply for cookie {cookie:#x}, which is not an outstanding request")
        })
    }

    /// A simple reply (parsed by `proto::parse_reply`); the data of a READ is skipped
    /// after it.
    #[inline]
    fn simple_reply(
        &mut self,
        c: &mut Core,
        error: u32,
        cookie: u64,
        now: u64,
    ) -> Result<Parsed, LoadError> {
        let slot = Self::slot_of(c, cookie)?;
        if error != 0 {
            Self::fail(c, slot, error, None);
        } else if !c.slots[slot].write {
            if self.structured {
                return Err(LoadError::protocol(format!(
                    "simple reply to READ cookie {slot:#x} after structured replies \
                     were negotiated (the spec forbids this)"
                )));
            }
            // The READ data follows the header.
            self.skip = usize_of(c.bs);
            self.skip_then = Some(slot);
            return Ok(Some((proto::SIMPLE_REPLY_LEN, 0)));
        }
        self.complete(c, slot, now);
        Ok(Some((proto::SIMPLE_REPLY_LEN, 1)))
    }

    /// A structured reply chunk at `p` (its header parsed by `proto::parse_reply`), and
    /// the payload of an error chunk; the payload of any other chunk is skipped after it.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn structured_chunk(
        &mut self,
        c: &mut Core,
        p: usize,
        flags: u16,
        ty: u16,
        cookie: u64,
        length: u32,
        now: u64,
    ) -> Result<Parsed, LoadError> {
        if !self.structured {
            return Err(LoadError::protocol(
                "structured reply chunk, but structured replies were not negotiated",
            ));
        }
        let len = usize_of(u64::from(length));
        let slot = Self::slot_of(c, cookie)?;
        let last = flags & proto::REPLY_FLAG_DONE != 0;
        if ty & 0x8000 != 0 {
            return self.error_chunk(c, p, slot, len, last, now);
        }
        check_data_chunk(c, slot, ty, len, last, cookie)?;
        let mut done = 0;
        if len == 0 {
            if last {
                self.complete(c, slot, now);
                done = 1;
            }
        } else {
            self.skip = len;
            self.skip_then = last.then_some(slot);
        }
        Ok(Some((proto::STRUCTURED_REPLY_LEN, done)))
    }

    /// An error chunk at `p`: 4-byte error, 2-byte message length, message (and an offset
    /// for ERROR_OFFSET). Needs the whole payload.
    fn error_chunk(
        &mut self,
        c: &mut Core,
        p: usize,
        slot: usize,
        len: usize,
        last: bool,
        now: u64,
    ) -> Result<Parsed, LoadError> {
        if !(6..=MAX_ERROR_CHUNK).contains(&len) {
            return Err(LoadError::protocol(format!(
                "error chunk of {len} bytes for cookie {slot:#x}"
            )));
        }
        let b = &c.b.inb[p..c.b.in_end];
        if b.len() < proto::STRUCTURED_REPLY_LEN + len {
            return Ok(None);
        }
        let pl = &b[proto::STRUCTURED_REPLY_LEN..][..len];
        let code = proto::be_u32(pl);
        let mlen = proto::be_u16(&pl[4..]) as usize;
        let msg = pl
            .get(6..6 + mlen)
            .map(|m| String::from_utf8_lossy(m).into_owned());
        let code = if code == 0 { proto::EIO } else { code };
        Self::fail(c, slot, code, msg.as_deref());
        let mut done = 0;
        if last {
            self.complete(c, slot, now);
            done = 1;
        }
        Ok(Some((proto::STRUCTURED_REPLY_LEN + len, done)))
    }
}

/// Check a chunk that is not an error against the request it answers.
fn check_data_chunk(
    c: &Core,
    slot: usize,
    ty: u16,
    len: usize,
    last: bool,
    cookie: u64,
) -> Result<(), LoadError> {
    let write = c.slots[slot].write;
    match ty {
        proto::REPLY_TYPE_OFFSET_DATA => {
            if write || len < 8 || len - 8 > usize_of(c.bs) {
                return Err(LoadError::protocol(format!(
                    "OFFSET_DATA chunk of {len} bytes for a {} of {} bytes \
                     (cookie {cookie:#x})",
                    if write { "WRITE" } else { "READ" },
                    c.bs
                )));
            }
        }
        proto::REPLY_TYPE_OFFSET_HOLE => {
            if write || len != 12 {
                return Err(LoadError::protocol(format!(
                    "OFFSET_HOLE chunk of {len} bytes (cookie {cookie:#x})"
                )));
            }
        }
        proto::REPLY_TYPE_NONE => {
            if len != 0 || !last {
                return Err(LoadError::protocol(format!(
                    "NONE chunk with {len} bytes of payload or without \
                     the DONE flag (cookie {cookie:#x})"
                )));
            }
        }
        _ => {
            if len > RECV_BUF {
                return Err(LoadError::protocol(format!(
                    "chunk of type {ty} with {len} bytes for cookie {cookie:#x}"
                )));
            }
        }
    }
    Ok(())
}

impl Protocol for Nbd {
    const TOOL: &'static str = "nbd-perf";
    const WORDS: Words = Words {
        requests: "requests",
        peer: "server",
        conn: "connection",
    };

    /// Encode a request for `slot` into the send buffer.
    #[inline]
    fn encode(&mut self, c: &mut Core, slot: usize, write: bool, offset: u64) {
        let h = proto::encode_request(&proto::RequestHeader {
            flags: 0,
            cmd: if write {
                proto::CMD_WRITE
            } else {
                proto::CMD_READ
            },
            cookie: slot as u64,
            offset,
            length: u32_of(c.bs),
        });
        c.b.out.push_bytes(&h);
        if write {
            c.b.out.push_payload(0..c.b.payload.len());
        }
    }

    /// Parse every complete reply in the receive buffer, completing (and reissuing) their
    /// slots. Returns how many requests completed.
    fn parse(&mut self, c: &mut Core, now: u64) -> Result<u64, LoadError> {
        let mut p = c.b.in_start;
        let mut done = 0u64;
        let r = loop {
            if self.skip > 0 {
                let k = self.skip.min(c.b.in_end - p);
                p += k;
                self.skip -= k;
                if self.skip > 0 {
                    break Ok(());
                }
                if let Some(slot) = self.skip_then.take() {
                    self.complete(c, slot, now);
                    done += 1;
                }
                continue;
            }
            let step = match proto::parse_reply(&c.b.inb[p..c.b.in_end]) {
                Ok(None) => break Ok(()),
                Ok(Some(proto::ReplyHeader::Simple { error, cookie })) => {
                    self.simple_reply(c, error, cookie, now)
                }
                Ok(Some(proto::ReplyHeader::Chunk {
                    flags,
                    ty,
                    cookie,
                    length,
                })) => self.structured_chunk(c, p, flags, ty, cookie, length, now),
                Err(e) => Err(LoadError::protocol(e.to_string())),
            };
            match step {
                Ok(Some((len, d))) => {
                    p += len;
                    done += d;
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        c.b.in_start = p;
        r.map(|()| done)
    }

    fn conn_name(index: usize) -> String {
        format!("connection {index}")
    }

    fn close(stream: &TcpStream, clean: bool) {
        if clean {
            disconnect(stream);
        }
    }
}

/// A connected, negotiated socket.
struct Negotiated {
    stream: TcpStream,
    size: u64,
    flags: u16,
    structured: bool,
    block_size: Option<(u32, u32, u32)>,
}

fn connect(addr: &str, export: &str) -> Result<Negotiated, LoadError> {
    let stream =
        TcpStream::connect(addr).map_err(|e| LoadError::io(format!("connecting to {addr}"), e))?;
    stream
        .set_nodelay(true)
        .map_err(|e| LoadError::io(format!("{addr}: TCP_NODELAY"), e))?;
    let hs = stream
        .try_clone()
        .map_err(|e| LoadError::io(format!("{addr}: cloning the socket"), e))?;
    // The handshake reads exactly what it needs (no buffering), so after it the raw socket
    // is positioned at the start of the transmission phase.
    let c = NbdClient::from_stream(
        hs,
        export,
        ClientOptions {
            structured_replies: true,
            base_allocation: false,
        },
    )
    .map_err(|e| LoadError::io(format!("{addr}: handshake for export {export:?}"), e))?;
    Ok(Negotiated {
        stream,
        size: c.size(),
        flags: c.transmission_flags(),
        structured: c.structured_replies(),
        block_size: c.block_size(),
    })
}

/// Polite goodbye: NBD_CMD_DISC, then close.
fn disconnect(mut s: &TcpStream) {
    let h = proto::encode_request(&proto::RequestHeader {
        flags: 0,
        cmd: proto::CMD_DISC,
        cookie: u64::MAX,
        offset: 0,
        length: 0,
    });
    let _ = s.write_all(&h);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

/// Check the workload against what the server negotiated; returns the number of blocks
/// in the range to use.
fn blocks_to_use(
    a: &NbdPerfArgs,
    c0: &Negotiated,
    export: &str,
    bs: u64,
) -> Result<u64, LoadError> {
    let (export_size, flags) = (c0.size, c0.flags);
    let writes = a.load.pattern != Pattern::Randread;
    if writes && flags & proto::TFLAG_READ_ONLY != 0 {
        return Err(LoadError::invalid(format!(
            "export {export:?} is read-only; use --pattern randread"
        )));
    }
    if let Some((min, _, max)) = c0.block_size {
        if !bs.is_multiple_of(min as u64) || bs > max as u64 {
            return Err(LoadError::invalid(format!(
                "--bs {} does not suit the export: the server wants multiples of {min} \
                 bytes up to {}",
                format_size(bs),
                format_size(max as u64)
            )));
        }
    }
    let size = a.load.size_or(export_size)?;
    if size > export_size {
        return Err(LoadError::invalid(format!(
            "--size {} is larger than the export ({})",
            format_size(size),
            format_size(export_size)
        )));
    }
    let blocks = size / bs;
    if blocks == 0 {
        return Err(LoadError::invalid(format!(
            "the range used ({} bytes) is smaller than one block",
            size
        )));
    }
    Ok(blocks)
}

/// Where to connect and what to check, from the arguments.
struct Plan {
    addr: String,
    export: String,
    w: Workload,
}

fn plan(a: &NbdPerfArgs) -> Result<Plan, LoadError> {
    let (addr, export) = match (&a.uri, &a.addr) {
        (Some(u), _) => parse_uri(u)?,
        (None, Some(addr)) => (addr.clone(), a.export.clone().unwrap_or_default()),
        (None, None) => {
            return Err(LoadError::invalid(
                "give --uri nbd://HOST:PORT/EXPORT or --addr",
            ))
        }
    };
    let w = a.load.workload(proto::MAX_PAYLOAD as u64)?;
    if a.load.qd == 0 || a.load.qd > 4096 {
        return Err(LoadError::invalid("--qd must be 1..4096"));
    }
    if a.conns == 0 || a.conns > 256 {
        return Err(LoadError::invalid("--conns must be 1..256"));
    }
    Ok(Plan { addr, export, w })
}

pub fn run(a: NbdPerfArgs) -> Result<(), LoadError> {
    let Plan { addr, export, w } = plan(&a)?;
    let bs = w.bs;
    let mut sockets = Vec::with_capacity(a.conns);
    for i in 0..a.conns {
        let c = connect(&addr, &export).map_err(|e| e.within(format_args!("connection {i}")))?;
        sockets.push(c);
    }
    let c0 = &sockets[0];
    let (export_size, structured) = (c0.size, c0.structured);
    let blocks = match blocks_to_use(&a, c0, &export, bs) {
        Ok(b) => b,
        Err(e) => {
            for c in &sockets {
                disconnect(&c.stream);
            }
            return Err(e);
        }
    };
    let target = format!(
        "nbd://{addr}/{export} ({} export, {} used, {} replies)",
        format_size(export_size),
        format_size(blocks * bs),
        if structured { "structured" } else { "simple" }
    );
    eprintln!(
        "nbd-perf: {target} — {:?} bs={} qd={} conns={} for {}s",
        a.load.pattern,
        format_size(bs),
        a.load.qd,
        a.conns,
        a.load.time
    );
    let conns = sockets
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let c = Nbd::conn(&w, blocks, a.load.qd, s.structured, Rng::for_index(i));
            (s.stream, c)
        })
        .collect();
    let t = conn::run(&w, conns)?;
    println!("target:     {target}");
    println!(
        "workload:   {:?} bs={} qd={} conns={} time={:.1}s",
        a.load.pattern,
        format_size(bs),
        a.load.qd,
        a.conns,
        t.secs()
    );
    t.print_figures();
    println!(
        "client cpu: {:.0} ns per I/O (user {:.0}, sys {:.0}); {:.2} cores busy",
        t.cpu_ns_per_io(),
        t.per_io(t.cpu.0),
        t.per_io(t.cpu.1),
        (t.cpu.0 + t.cpu.1).as_secs_f64() / t.secs()
    );
    t.print_outcome()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            parse_uri("nbd://127.0.0.1:10899/vol0").unwrap(),
            ("127.0.0.1:10899".into(), "vol0".into())
        );
        assert_eq!(
            parse_uri("nbd://localhost/").unwrap(),
            ("localhost:10809".into(), "".into())
        );
        assert_eq!(
            parse_uri("nbd://[::1]:9/a%20b").unwrap(),
            ("[::1]:9".into(), "a b".into())
        );
        assert_eq!(
            parse_uri("nbd://[::1]").unwrap(),
            ("[::1]:10809".into(), "".into())
        );
        assert!(parse_uri("nbd+unix:///x?socket=/s").is_err());
        assert!(parse_uri("nbd:///x").is_err());
        assert!(parse_uri("nbd://h/%zz").is_err());
    }

    fn chunk(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, payload: &[u8]) {
        let mut b = [0u8; proto::STRUCTURED_REPLY_LEN];
        proto::encode_structured_reply(&mut b, flags, ty, cookie, u32_of(payload.len()));
        out.extend_from_slice(&b);
        out.extend_from_slice(payload);
    }

    /// A connection of `qd` requests of `bs` bytes over `blocks` blocks.
    fn engine(
        pattern: Pattern,
        rwmix_read: u32,
        bs: u64,
        blocks: u64,
        qd: usize,
        structured: bool,
        seed: usize,
    ) -> Conn<Nbd> {
        let w = Workload {
            pattern,
            rwmix_read,
            bs,
            time: 1,
            busy_poll: false,
        };
        Nbd::conn(&w, blocks, qd, structured, Rng::for_index(seed))
    }

    /// Feed `bytes` to the engine in pieces of `step` bytes; returns completions.
    fn feed(e: &mut Conn<Nbd>, bytes: &[u8], step: usize) -> Result<u64, LoadError> {
        let mut done = 0;
        for piece in bytes.chunks(step) {
            let space = e.core.b.recv_space();
            space[..piece.len()].copy_from_slice(piece);
            e.core.b.in_end += piece.len();
            done += e.parse(1000)?;
        }
        Ok(done)
    }

    #[test]
    fn structured_replies_parse_in_any_split() {
        for step in [1, 3, 7, 20, 64, 4096, 1 << 20] {
            let mut e = engine(Pattern::Randread, 70, 512, 100, 4, true, 1);
            e.fill(0);
            assert_eq!(e.core.b.out.len(), 4 * proto::REQUEST_HEADER_LEN);
            e.core.issuing = false;
            let mut r = Vec::new();
            // Slot 2: two data chunks then DONE. Slot 0: hole + data. Slot 1: error.
            let data = |off: u64, n: usize| {
                let mut p = off.to_be_bytes().to_vec();
                p.extend(std::iter::repeat_n(0xab, n));
                p
            };
            chunk(&mut r, 0, proto::REPLY_TYPE_OFFSET_DATA, 2, &data(0, 256));
            let mut hole = 0u64.to_be_bytes().to_vec();
            hole.extend_from_slice(&256u32.to_be_bytes());
            chunk(&mut r, 0, proto::REPLY_TYPE_OFFSET_HOLE, 0, &hole);
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                2,
                &data(256, 256),
            );
            let mut err = proto::EIO.to_be_bytes().to_vec();
            err.extend_from_slice(&3u16.to_be_bytes());
            err.extend_from_slice(b"bad");
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_ERROR,
                1,
                &err,
            );
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                0,
                &data(256, 256),
            );
            chunk(
                &mut r,
                proto::REPLY_FLAG_DONE,
                proto::REPLY_TYPE_OFFSET_DATA,
                3,
                &data(0, 512),
            );
            assert_eq!(
                feed(&mut e, &r, step).map_err(|e| e.to_string()),
                Ok(4),
                "step {step}"
            );
            assert_eq!(
                (e.core.stats.ios, e.core.stats.errors, e.core.inflight),
                (3, 1, 0)
            );
            assert!(e.core.stats.first_error.as_deref().unwrap().contains("bad"));
            assert_eq!(e.core.stats.hist.count(), 4);
        }
    }

    #[test]
    fn simple_replies_and_reissue() {
        let mut e = engine(Pattern::Randrw, 50, 4096, 1000, 8, false, 7);
        e.fill(0);
        let first = e.core.b.out.len();
        let mut r = Vec::new();
        for slot in 0..8u64 {
            let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
            proto::encode_simple_reply(&mut h, 0, slot);
            r.extend_from_slice(&h);
            if !e.core.slots[usize_of(slot)].write {
                r.extend(std::iter::repeat_n(0u8, 4096));
            }
        }
        assert_eq!(feed(&mut e, &r, 1000).map_err(|e| e.to_string()), Ok(8));
        // Every completion was reissued.
        assert_eq!(e.core.inflight, 8);
        assert!(e.core.b.out.len() > first);
        // A reply to a slot that is not outstanding is fatal.
        let mut e = engine(Pattern::Randread, 70, 4096, 1000, 2, false, 7);
        let mut h = [0u8; proto::SIMPLE_REPLY_LEN];
        proto::encode_simple_reply(&mut h, 0, 5);
        assert!(matches!(feed(&mut e, &h, 16), Err(LoadError::Protocol(_))));
    }

    #[test]
    fn requests_are_aligned_and_in_range() {
        let mut e = engine(Pattern::Randwrite, 70, 4096, 10, 64, true, 3);
        e.fill(0);
        let stride = proto::REQUEST_HEADER_LEN + 4096;
        assert_eq!(e.core.b.out.len(), 64 * stride);
        let out = e.core.b.out.to_vec(&e.core.b.payload);
        for i in 0..64 {
            assert_eq!(
                &out[i * stride + proto::REQUEST_HEADER_LEN..][..4096],
                &e.core.b.payload[..]
            );
            let h = proto::parse_request(&out[i * stride..]).unwrap().unwrap();
            assert_eq!(
                (h.cmd, h.cookie, h.length),
                (proto::CMD_WRITE, i as u64, 4096)
            );
            assert!(h.offset.is_multiple_of(4096) && h.offset < 10 * 4096);
        }
    }
}
