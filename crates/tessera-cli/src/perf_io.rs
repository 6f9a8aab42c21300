//! What the pipelined load generators (`nbd-perf`, `nvmf perf`) share: the send queue,
//! non-blocking socket calls, and the loop that drives one connection.
//!
//! The loop never blocks in a send: requests leave through non-blocking `sendmsg`, and
//! while some are still queued the thread `poll`s for both directions, taking in replies
//! as they come. A target that stops reading until its replies have been taken (as an
//! NVMe/TCP target asking for write data with R2T, or any server whose send buffer is
//! full, may) therefore cannot deadlock the tool.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// A connection with requests outstanding and nothing received for this long is given up.
pub const STALL: Duration = Duration::from_secs(10);

/// iovecs per `sendmsg` (Linux's IOV_MAX).
const MAX_IOV: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seg {
    /// The next `n` bytes of the queue's own byte buffer.
    Bytes(usize),
    /// A range of the payload passed to [`SendQueue::send`].
    Payload { at: usize, len: usize },
}

/// Bytes waiting to be sent, in order: small pieces (headers) copied in, large data
/// referred to as ranges of one payload buffer and sent from there with `sendmsg`
/// (so a 1 MiB write costs no copy however many are queued).
#[derive(Default)]
pub struct SendQueue {
    bytes: Vec<u8>,
    /// Start of the unsent part of `bytes`.
    bytes_pos: usize,
    segs: VecDeque<Seg>,
    /// Bytes of `segs[0]` already sent.
    front_sent: usize,
    pending: usize,
    iov: Vec<libc::iovec>,
}

// SAFETY: `iov` is scratch space filled and used within one `send` call; its pointers are
// never dereferenced outside it, so moving the queue to another thread is sound.
unsafe impl Send for SendQueue {}

impl SendQueue {
    pub fn with_capacity(n: usize) -> SendQueue {
        SendQueue {
            bytes: Vec::with_capacity(n),
            ..SendQueue::default()
        }
    }

    /// Bytes not yet handed to the kernel.
    pub fn len(&self) -> usize {
        self.pending
    }

    pub fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// Queue a copy of `b`.
    pub fn push_bytes(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        self.bytes.extend_from_slice(b);
        self.pending += b.len();
        match self.segs.back_mut() {
            Some(Seg::Bytes(n)) => *n += b.len(),
            _ => self.segs.push_back(Seg::Bytes(b.len())),
        }
    }

    /// Queue `r` of the payload (given again to every `send`).
    pub fn push_payload(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        self.pending += r.len();
        self.segs.push_back(Seg::Payload {
            at: r.start,
            len: r.len(),
        });
    }

    /// Everything queued, as one buffer (for tests).
    #[cfg(test)]
    pub fn to_vec(&self, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.pending);
        let mut pos = self.bytes_pos;
        for (i, s) in self.segs.iter().enumerate() {
            let skip = if i == 0 { self.front_sent } else { 0 };
            match *s {
                Seg::Bytes(n) => {
                    v.extend_from_slice(&self.bytes[pos + skip..pos + n]);
                    pos += n;
                }
                Seg::Payload { at, len } => v.extend_from_slice(&payload[at + skip..at + len]),
            }
        }
        v
    }

    /// One non-blocking `sendmsg` of as much as the kernel takes; `Ok(0)` when the socket
    /// buffer is full.
    pub fn send(&mut self, fd: RawFd, payload: &[u8]) -> io::Result<usize> {
        if self.is_empty() {
            return Ok(0);
        }
        self.iov.clear();
        let mut pos = self.bytes_pos;
        for (i, s) in self.segs.iter().enumerate() {
            if self.iov.len() == MAX_IOV {
                break;
            }
            let skip = if i == 0 { self.front_sent } else { 0 };
            let (p, n): (*const u8, usize) = match *s {
                Seg::Bytes(n) => {
                    let p = self.bytes[pos + skip..pos + n].as_ptr();
                    pos += n;
                    (p, n - skip)
                }
                Seg::Payload { at, len } => (payload[at + skip..at + len].as_ptr(), len - skip),
            };
            self.iov.push(libc::iovec {
                iov_base: p as *mut libc::c_void,
                iov_len: n,
            });
        }
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = self.iov.as_mut_ptr();
        msg.msg_iovlen = self.iov.len() as _;
        let n = loop {
            // SAFETY: the iovecs point into `self.bytes` and `payload`, both alive and
            // unchanged for the duration of the call.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(0),
                _ => return Err(e),
            }
        };
        self.consume(n);
        Ok(n)
    }

    fn consume(&mut self, mut n: usize) {
        self.pending -= n;
        while n > 0 {
            let s = self.segs[0];
            let len = match s {
                Seg::Bytes(len) | Seg::Payload { len, .. } => len,
            };
            let left = len - self.front_sent;
            if n < left {
                self.front_sent += n;
                return;
            }
            n -= left;
            self.front_sent = 0;
            self.segs.pop_front();
            if let Seg::Bytes(len) = s {
                self.bytes_pos += len;
            }
        }
        if self.bytes_pos == self.bytes.len() {
            self.bytes.clear();
            self.bytes_pos = 0;
        } else if self.bytes_pos >= 1 << 20 && self.bytes_pos * 2 >= self.bytes.len() {
            self.bytes.drain(..self.bytes_pos);
            self.bytes_pos = 0;
        }
    }
}

/// `recv`; `Ok(None)` when nothing arrived (non-blocking, or the receive timeout hit).
pub fn recv_some(fd: RawFd, b: &mut [u8], dontwait: bool) -> io::Result<Option<usize>> {
    let flags = if dontwait { libc::MSG_DONTWAIT } else { 0 };
    loop {
        // SAFETY: b is a valid writable slice for its length.
        let n = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), b.len(), flags) };
        if n >= 0 {
            return Ok(Some(n as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Wait until the socket is readable or writable; returns `(readable, writable)`.
pub fn poll_rw(fd: RawFd, timeout: Duration) -> io::Result<(bool, bool)> {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as libc::c_int) };
        if n >= 0 {
            let err = p.revents & (libc::POLLERR | libc::POLLHUP) != 0;
            return Ok((
                p.revents & libc::POLLIN != 0 || err,
                p.revents & libc::POLLOUT != 0,
            ));
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The byte streams of one connection: requests queued to send (with the payload they
/// refer to) and replies received, not yet parsed: `inb[in_start..in_end]`.
pub struct Buffers {
    pub out: SendQueue,
    /// Data sent with every write (from here, never copied).
    pub payload: Vec<u8>,
    pub inb: Vec<u8>,
    pub in_start: usize,
    pub in_end: usize,
    /// Room kept after `in_end` for the largest reply that must be whole to be parsed.
    room: usize,
}

impl Buffers {
    pub fn new(payload: Vec<u8>, recv_buf: usize, room: usize, out: usize) -> Buffers {
        assert!(room <= recv_buf / 2);
        Buffers {
            out: SendQueue::with_capacity(out),
            payload,
            inb: vec![0; recv_buf],
            in_start: 0,
            in_end: 0,
            room,
        }
    }

    /// Room to receive into, after moving any partial reply to the front when the tail
    /// is short.
    pub fn recv_space(&mut self) -> &mut [u8] {
        if self.in_start == self.in_end {
            self.in_start = 0;
            self.in_end = 0;
        } else if self.inb.len() - self.in_end < self.room {
            self.inb.copy_within(self.in_start..self.in_end, 0);
            self.in_end -= self.in_start;
            self.in_start = 0;
        }
        &mut self.inb[self.in_end..]
    }

    /// Send what the kernel takes now, without blocking.
    pub fn send(&mut self, fd: RawFd) -> io::Result<usize> {
        self.out.send(fd, &self.payload)
    }
}

/// A request generator and reply parser for one connection, independent of the socket.
pub trait Engine {
    /// Issue a request in every slot.
    fn fill(&mut self, now: u64);
    /// Requests sent (or queued) and not yet answered.
    fn inflight(&self) -> usize;
    /// Issue no new requests as slots complete.
    fn stop_issuing(&mut self);
    fn bufs(&mut self) -> &mut Buffers;
    /// Parse every complete reply received; returns how many requests completed.
    fn parse(&mut self, now: u64) -> Result<u64, String>;
}

/// Words for the error messages of one protocol.
pub struct Words {
    /// "requests", "commands".
    pub requests: &'static str,
    /// "server", "target".
    pub peer: &'static str,
    /// "connection", "queue".
    pub conn: &'static str,
}

/// Run one connection until `deadline_ns` (ns since `epoch`), then drain it.
pub fn drive(
    e: &mut impl Engine,
    stream: &TcpStream,
    epoch: Instant,
    deadline_ns: u64,
    busy_poll: bool,
    progress: &AtomicU64,
    w: &Words,
) -> Result<(), String> {
    let fd = stream.as_raw_fd();
    // A blocking recv wakes up at least once a second to notice a stalled peer.
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|err| format!("setting the receive timeout: {err}"))?;
    let now_ns = || epoch.elapsed().as_nanos() as u64;
    e.fill(now_ns());
    let mut last_progress = Instant::now();
    loop {
        if !e.bufs().out.is_empty() {
            let n = e
                .bufs()
                .send(fd)
                .map_err(|err| format!("sending {}: {err}", w.requests))?;
            if n > 0 {
                last_progress = Instant::now();
            }
        }
        let queued = e.bufs().out.len();
        if e.inflight() == 0 && queued == 0 {
            return Ok(());
        }
        let got = if busy_poll {
            recv_some(fd, e.bufs().recv_space(), true)
        } else if queued == 0 {
            recv_some(fd, e.bufs().recv_space(), false)
        } else {
            // Part of the batch is still queued: wait for either direction, so a peer
            // that stops reading until we take its replies cannot deadlock us.
            match poll_rw(fd, Duration::from_secs(1)) {
                Ok((true, _)) => recv_some(fd, e.bufs().recv_space(), true),
                Ok((false, true)) => continue,
                Ok((false, false)) => Ok(None),
                Err(err) => Err(err),
            }
        }
        .map_err(|err| format!("receiving replies: {err}"))?;
        match got {
            None => {
                if last_progress.elapsed() >= STALL {
                    return Err(format!(
                        "no progress for {} s with {} {} outstanding ({queued} bytes \
                         unsent); giving up on this {}",
                        STALL.as_secs(),
                        e.inflight(),
                        w.requests,
                        w.conn
                    ));
                }
            }
            Some(0) => {
                return Err(format!(
                    "the {} closed the {} with {} {} outstanding",
                    w.peer,
                    w.conn,
                    e.inflight(),
                    w.requests
                ))
            }
            Some(n) => {
                e.bufs().in_end += n;
                let now = now_ns();
                if now >= deadline_ns {
                    e.stop_issuing();
                }
                let done = e.parse(now)?;
                if done > 0 {
                    last_progress = Instant::now();
                    progress.fetch_add(done, Relaxed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_queue_keeps_order_across_partial_sends() {
        let payload: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
        let mut q = SendQueue::default();
        let mut want = Vec::new();
        for i in 0..50usize {
            let h = vec![i as u8; 1 + i % 7];
            q.push_bytes(&h);
            want.extend_from_slice(&h);
            let r = (i * 997) % 90_000..(i * 997) % 90_000 + 1 + i * 113;
            q.push_payload(r.clone());
            want.extend_from_slice(&payload[r]);
        }
        assert_eq!(q.len(), want.len());
        assert_eq!(q.to_vec(&payload), want);
        // Through a socket pair with a small buffer: many partial sends.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 3000];
            loop {
                let n = recv_some(b.as_raw_fd(), &mut buf, false).unwrap().unwrap();
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&buf[..n]);
            }
        });
        let mut sent = 0;
        while !q.is_empty() {
            let n = q.send(a.as_raw_fd(), &payload).unwrap();
            sent += n;
            if n == 0 {
                poll_rw(a.as_raw_fd(), Duration::from_millis(100)).unwrap();
            }
            assert_eq!(q.len(), want.len() - sent);
        }
        drop(a);
        assert_eq!(reader.join().unwrap(), want);
        // Emptied: the byte buffer starts over.
        assert_eq!((q.bytes.len(), q.bytes_pos, q.segs.len()), (0, 0, 0));
    }
}
