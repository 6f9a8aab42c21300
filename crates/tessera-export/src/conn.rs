//! The connection machinery every protocol connection on a reactor core shares: the
//! socket with one receive and one gathered send in flight and its teardown
//! ([`Socket`]), the receive buffer requests are parsed from ([`RecvBuf`]), the free
//! list of request slots ([`FreeList`]) and the per-batch stats accounting
//! ([`StatsBatch`]). The protocol keeps its wire codec, its slots and its commands.
//!
//! Nothing here allocates after construction.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Instant;

use io_uring::{opcode, types};
use tessera_io::{AlignedBuf, CoreIo, IoOp, Tag};

use crate::stats::{IoClass, IoStats};

/// iovecs per `sendmsg` (the kernel's IOV_MAX is 1024).
pub const MAX_IOV: usize = 1024;

/// A buffer one receive at a time is posted into, parsed from the front.
///
/// Bytes `[start, end)` have arrived and are not parsed yet. Offsets handed out by
/// [`RecvBuf::start`] stay valid until the next [`RecvBuf::compact`].
pub struct RecvBuf {
    buf: AlignedBuf,
    start: usize,
    end: usize,
}

impl RecvBuf {
    pub fn new(cap: usize) -> RecvBuf {
        RecvBuf {
            buf: AlignedBuf::zeroed(cap),
            start: 0,
            end: 0,
        }
    }

    #[inline]
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Offset of the first unparsed byte.
    #[inline]
    pub fn start(&self) -> usize {
        self.start
    }

    /// Offset just past the last byte received.
    #[inline]
    pub fn end(&self) -> usize {
        self.end
    }

    /// No room for another receive until the buffer is compacted.
    #[inline]
    pub fn is_full(&self) -> bool {
        self.end == self.capacity()
    }

    /// The bytes received and not yet parsed.
    #[inline]
    pub fn unparsed(&self) -> &[u8] {
        &self.buf.as_slice()[self.start..self.end]
    }

    /// Everything received up to [`RecvBuf::end`], addressed by absolute offset.
    #[inline]
    pub fn received(&self) -> &[u8] {
        &self.buf.as_slice()[..self.end]
    }

    /// `n` bytes at the front were parsed.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(self.start + n <= self.end);
        self.start += n;
    }

    /// A receive posted at [`RecvBuf::room`] brought `n` bytes.
    #[inline]
    pub fn filled(&mut self, n: usize) {
        debug_assert!(self.end + n <= self.capacity());
        self.end += n;
    }

    /// Where the next receive goes: a pointer to the free tail and its length (at most
    /// `max`).
    #[inline]
    pub fn room(&mut self, max: usize) -> (*mut u8, usize) {
        let len = (self.capacity() - self.end).min(max);
        // SAFETY: end <= capacity, so the pointer stays within (or one past) the buffer.
        (unsafe { self.buf.as_mut_ptr().add(self.end) }, len)
    }

    /// Keep the unparsed tail at the front so the buffer never fills with parsed bytes:
    /// an empty buffer restarts at 0; a tail is moved down once half the buffer is
    /// parsed or no room is left. Never call it while a receive is posted into the
    /// buffer (the receive writes where it was told).
    pub fn compact(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && (self.start >= self.capacity() / 2 || self.is_full()) {
            let n = self.end - self.start;
            self.buf.as_mut_slice().copy_within(self.start..self.end, 0);
            self.start = 0;
            self.end = n;
        }
    }
}

/// Free request slots of a connection, taken lowest index first.
pub struct FreeList {
    free: Vec<u16>,
}

/// Slot `i` as the `u16` a free list holds. Connections size their slots from their
/// negotiated queue depth, bounded far below this.
fn slot_number(i: usize) -> u16 {
    u16::try_from(i).expect("a connection has at most 65536 slots")
}

/// The request slot an I/O completion's tag names. A connection tags each I/O with the
/// `u16` number of its slot (from its [`FreeList`]); the slot values above `u16::MAX`
/// it uses for its own events (receive, send, timers, gates) must be matched before.
#[inline]
pub fn io_slot(tag_slot: u32) -> u16 {
    debug_assert!(
        tag_slot <= u32::from(u16::MAX),
        "slot {tag_slot} is an event marker"
    );
    #[allow(
        clippy::cast_possible_truncation,
        reason = "I/O tags carry a u16 slot number; event markers are matched by the caller"
    )]
    let slot = tag_slot as u16;
    slot
}

impl FreeList {
    /// Slots `0..n`, all free.
    pub fn new(n: usize) -> FreeList {
        FreeList {
            free: (0..n).rev().map(slot_number).collect(),
        }
    }

    #[inline]
    pub fn pop(&mut self) -> Option<u16> {
        self.free.pop()
    }

    #[inline]
    pub fn push(&mut self, slot: u16) {
        self.free.push(slot);
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }

    pub fn len(&self) -> usize {
        self.free.len()
    }

    /// New slots `from..to` became free; they are handed out after every slot already
    /// free (rare: a queue growing at connect time).
    pub fn add_range(&mut self, from: usize, to: usize) {
        self.free.splice(0..0, (from..to).rev().map(slot_number));
    }
}

/// How a posted send ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendDone {
    /// Every byte left: the buffers may be reused.
    All,
    /// Part left; the rest is posted again.
    Partial,
    /// The peer is gone: nothing more can be sent.
    Failed,
}

/// A gathered send: iovecs over slot headers and data buffers, sent with one
/// `sendmsg`, resumed where a partial send stopped.
pub struct SendBatch {
    iov: Vec<libc::iovec>,
    /// First iovec not completely sent.
    at: usize,
    msg: Box<libc::msghdr>,
}

impl Default for SendBatch {
    fn default() -> Self {
        SendBatch::new()
    }
}

impl SendBatch {
    pub fn new() -> SendBatch {
        SendBatch {
            iov: Vec::with_capacity(MAX_IOV),
            at: 0,
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            msg: Box::new(unsafe { std::mem::zeroed() }),
        }
    }

    /// Start gathering a new batch.
    pub fn clear(&mut self) {
        self.iov.clear();
        self.at = 0;
    }

    /// Room for `n` more iovecs in this batch.
    #[inline]
    pub fn has_room(&self, n: usize) -> bool {
        self.iov.len() + n <= MAX_IOV
    }

    #[inline]
    pub fn push(&mut self, ptr: *const u8, len: usize) {
        debug_assert!(self.iov.len() < MAX_IOV);
        self.iov.push(libc::iovec {
            iov_base: ptr as *mut libc::c_void,
            iov_len: len,
        });
    }

    /// Nothing is left to send.
    #[inline]
    pub fn is_done(&self) -> bool {
        self.at == self.iov.len()
    }

    /// `n` bytes left: step over the iovecs they covered and shorten the one they ended
    /// in. Returns true when everything is sent.
    pub fn advance(&mut self, mut n: usize) -> bool {
        while n > 0 && self.at < self.iov.len() {
            let v = &mut self.iov[self.at];
            if n >= v.iov_len {
                n -= v.iov_len;
                self.at += 1;
            } else {
                // SAFETY: n < iov_len, so the new start stays inside the same buffer.
                v.iov_base = unsafe { (v.iov_base as *mut u8).add(n) } as *mut libc::c_void;
                v.iov_len -= n;
                n = 0;
            }
        }
        self.is_done()
    }

    /// The iovecs still to send (tests and diagnostics).
    pub fn remaining(&self) -> &[libc::iovec] {
        &self.iov[self.at..]
    }
}

/// A connection's socket on a reactor core: at most one receive and one send in flight,
/// and the connection's end of life.
pub struct Socket {
    fd: OwnedFd,
    send: SendBatch,
    recv_posted: bool,
    send_posted: bool,
    /// No more requests will be read (the client disconnected, closed, misbehaved).
    pub draining: bool,
    /// The peer is gone or misbehaved: nothing more is sent.
    pub dead: bool,
    shut: bool,
}

impl Socket {
    pub fn new(fd: OwnedFd) -> Socket {
        Socket {
            fd,
            send: SendBatch::new(),
            recv_posted: false,
            send_posted: false,
            draining: false,
            dead: false,
            shut: false,
        }
    }

    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }

    #[inline]
    pub fn recv_posted(&self) -> bool {
        self.recv_posted
    }

    #[inline]
    pub fn send_posted(&self) -> bool {
        self.send_posted
    }

    /// Whether a receive may be posted now (none in flight, still reading).
    #[inline]
    pub fn may_recv(&self) -> bool {
        !self.recv_posted && !self.draining
    }

    /// Post a receive of up to `len` bytes at `ptr`, completing for `tag`.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must stay valid and untouched until the completion for `tag`
    /// (the connection keeps the buffer and does not finish while a receive is posted).
    pub unsafe fn post_recv(&mut self, io: &mut CoreIo, ptr: *mut u8, len: usize, tag: Tag) {
        debug_assert!(!self.recv_posted);
        let e = opcode::Recv::new(
            types::Fd(self.fd.as_raw_fd()),
            ptr,
            u32::try_from(len).unwrap_or(u32::MAX),
        )
        .build();
        // SAFETY: the caller keeps the buffer alive until the completion.
        unsafe { io.push_sqe(e, tag) };
        self.recv_posted = true;
    }

    /// Complete a receive at once with `res` (bytes, 0 for EOF, or a negative errno),
    /// through the core's ready queue, as if the socket had delivered it: for bytes a
    /// layer above the socket (TLS) already holds. Counts as posted until it is
    /// delivered, so the connection neither posts another nor finishes meanwhile.
    pub fn complete_recv_now(&mut self, io: &mut CoreIo, res: i32, tag: Tag) {
        debug_assert!(!self.recv_posted);
        io.complete(tag, res);
        self.recv_posted = true;
    }

    /// The receive completed with `res`. Returns the bytes it brought; `None` when the
    /// client went away (EOF or error): the connection drains, and on an error nothing
    /// more is sent.
    #[inline]
    pub fn recv_done(&mut self, res: i32) -> Option<usize> {
        self.recv_posted = false;
        if res <= 0 {
            self.draining = true;
            if res < 0 {
                self.dead = true;
            }
            return None;
        }
        Some(res as usize)
    }

    /// The batch to gather the next send into (only while no send is posted).
    #[inline]
    pub fn batch(&mut self) -> &mut SendBatch {
        debug_assert!(!self.send_posted);
        &mut self.send
    }

    /// Send what is left of the gathered batch, completing for `tag`.
    ///
    /// # Safety
    /// Every buffer an iovec of the batch points at must stay valid and untouched until
    /// the send completes with [`SendDone::All`] or [`SendDone::Failed`].
    pub unsafe fn post_send(&mut self, io: &mut CoreIo, tag: Tag) {
        debug_assert!(!self.send_posted && !self.send.is_done());
        let b = &mut self.send;
        b.msg.msg_iov = b.iov[b.at..].as_mut_ptr();
        b.msg.msg_iovlen = b.iov.len() - b.at;
        let e = opcode::SendMsg::new(types::Fd(self.fd.as_raw_fd()), &*b.msg as *const _)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build();
        // SAFETY: msg and iov belong to this socket and are not changed while the send is
        // posted; the caller keeps the buffers they point at alive.
        unsafe { io.push_sqe(e, tag) };
        self.send_posted = true;
    }

    /// The send completed with `res`. On [`SendDone::Partial`] the rest was posted again
    /// for `tag`.
    pub fn send_done(&mut self, io: &mut CoreIo, res: i32, tag: Tag) -> SendDone {
        self.send_posted = false;
        if res < 0 {
            self.dead = true;
            self.draining = true;
            return SendDone::Failed;
        }
        if self.send.advance(res as usize) {
            return SendDone::All;
        }
        // SAFETY: the batch is the one post_send's caller vouched for; its buffers are
        // released only once the send reports All or Failed.
        unsafe { self.post_send(io, tag) };
        SendDone::Partial
    }

    /// A draining connection with nothing in flight (`idle`) and nothing being sent:
    /// shut the socket down, which ends the posted receive, so the connection can
    /// finish. Returns true the one time it does so.
    pub fn shut_down_when_idle(&mut self, idle: bool) -> bool {
        if !self.draining || self.shut || !idle || self.send_posted {
            return false;
        }
        self.shut = true;
        // SAFETY: shutting down a socket this connection owns; the fd stays open.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
        true
    }

    /// Shut down, and no receive or send still in flight: the socket's buffers are free.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.shut && !self.recv_posted && !self.send_posted
    }
}

/// Completed requests of one reactor batch, accounted to their stats block when the
/// batch ends (with the clock the reactor reads once per batch, not one read each).
pub struct StatsBatch {
    pending: Vec<Pending>,
}

struct Pending {
    /// Which stats block (a namespace index; 0 for single-target connections).
    key: usize,
    class: IoClass,
    bytes: u64,
    start: Instant,
    ok: bool,
}

impl StatsBatch {
    pub fn with_capacity(n: usize) -> StatsBatch {
        StatsBatch {
            pending: Vec::with_capacity(n),
        }
    }

    /// A request received at `start` is answered.
    #[inline]
    pub fn push(&mut self, key: usize, class: IoClass, bytes: u64, start: Instant, ok: bool) {
        self.pending.push(Pending {
            key,
            class,
            bytes,
            start,
            ok,
        });
    }

    /// Record every pending request with its latency up to `now`; `stats_of(key)` says
    /// where (`None`: the block is gone, the figure is dropped).
    pub fn flush<'a>(&mut self, now: Instant, stats_of: impl Fn(usize) -> Option<&'a IoStats>) {
        for p in self.pending.drain(..) {
            if let Some(s) = stats_of(p.key) {
                let ns = nanos_between(p.start, now);
                s.record(p.class, p.bytes, ns, p.ok);
            }
        }
    }
}

/// A buffer from the core's pool and the read of `len` bytes at `offset` into it. The
/// buffer must stay with the request until the read completes.
#[inline]
pub fn read_into_new_buf(io: &mut CoreIo, offset: u64, len: u32) -> (AlignedBuf, IoOp) {
    let mut buf = io.bufs.get(len as usize);
    let op = IoOp::Read {
        offset,
        len,
        buf: buf.as_mut_ptr(),
    };
    (buf, op)
}

/// Time a request spent held at the QoS gate, counted as throttled.
#[inline]
pub fn add_throttled(stats: &IoStats, received: Instant, now: Instant) {
    stats.add_throttled(nanos_between(received, now));
}

/// Nanoseconds from `start` to `now` (0 if `now` is earlier; saturating past 584 years).
#[inline]
fn nanos_between(start: Instant, now: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(start).as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    fn batch_of(lens: &[usize], bufs: &mut [Vec<u8>]) -> SendBatch {
        let mut b = SendBatch::new();
        for (buf, &n) in bufs.iter_mut().zip(lens) {
            b.push(buf.as_ptr(), n);
        }
        b
    }

    #[test]
    fn partial_send_advances_within_and_across_iovecs() {
        let mut bufs = vec![vec![0u8; 16], vec![0u8; 100], vec![0u8; 4]];
        let base: Vec<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
        let mut b = batch_of(&[16, 100, 4], &mut bufs);
        // Inside the first iovec.
        assert!(!b.advance(10));
        let r = b.remaining();
        assert_eq!(r.len(), 3);
        assert_eq!((r[0].iov_base as usize, r[0].iov_len), (base[0] + 10, 6));
        // The rest of the first and part of the second.
        assert!(!b.advance(6 + 30));
        let r = b.remaining();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].iov_base as usize, r[0].iov_len), (base[1] + 30, 70));
        assert_eq!((r[1].iov_base as usize, r[1].iov_len), (base[2], 4));
        // Exactly to an iovec boundary.
        assert!(!b.advance(70));
        assert_eq!(b.remaining().len(), 1);
        assert!(b.advance(4));
        assert!(b.is_done());
        // A zero-byte completion of nothing left stays done.
        assert!(b.advance(0));
    }

    #[test]
    fn send_batch_starts_over_after_clear() {
        let mut bufs = vec![vec![0u8; 8]];
        let mut b = batch_of(&[8], &mut bufs);
        assert!(b.advance(8));
        b.clear();
        assert!(b.is_done());
        assert!(b.has_room(MAX_IOV));
        assert!(!b.has_room(MAX_IOV + 1));
        b.push(bufs[0].as_ptr(), 8);
        assert!(!b.is_done());
        assert!(!b.has_room(MAX_IOV));
    }

    #[test]
    fn free_list_hands_out_lowest_first_and_grows_behind() {
        let mut f = FreeList::new(3);
        assert_eq!(f.pop(), Some(0));
        assert_eq!(f.pop(), Some(1));
        f.push(0);
        f.add_range(3, 5);
        assert_eq!(f.len(), 4);
        assert_eq!(f.pop(), Some(0));
        assert_eq!(f.pop(), Some(2));
        assert_eq!(f.pop(), Some(3));
        assert_eq!(f.pop(), Some(4));
        assert_eq!(f.pop(), None);
        assert!(f.is_empty());
    }

    /// A multiple of the buffer alignment, so the capacity is exactly this.
    const CAP: usize = 4096;

    fn fill(r: &mut RecvBuf, data: &[u8]) {
        let (p, n) = r.room(usize::MAX);
        assert!(data.len() <= n);
        // SAFETY: `room` returned n writable bytes at p; data.len() <= n.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        r.filled(data.len());
    }

    #[test]
    fn compaction_resets_an_empty_buffer() {
        let mut r = RecvBuf::new(CAP);
        fill(&mut r, &[1; 10]);
        r.consume(10);
        r.compact();
        assert_eq!((r.start(), r.end()), (0, 0));
    }

    #[test]
    fn compaction_moves_the_tail_once_half_is_parsed() {
        let mut r = RecvBuf::new(CAP);
        let data: Vec<u8> = (0..2560u32).map(|i| i.to_le_bytes()[0]).collect();
        fill(&mut r, &data);
        r.consume(1000);
        r.compact();
        // Less than half parsed, room left: nothing moves.
        assert_eq!((r.start(), r.end()), (1000, 2560));
        r.consume(1048);
        r.compact();
        assert_eq!((r.start(), r.end()), (0, 512));
        assert_eq!(r.unparsed(), &data[2048..]);
    }

    #[test]
    fn compaction_moves_the_tail_of_a_full_buffer() {
        let mut r = RecvBuf::new(CAP);
        let data: Vec<u8> = (0..CAP).map(|i| i.to_le_bytes()[0]).collect();
        fill(&mut r, &data);
        assert!(r.is_full());
        assert_eq!(r.room(usize::MAX).1, 0);
        r.consume(4);
        r.compact();
        assert_eq!((r.start(), r.end()), (0, CAP - 4));
        assert_eq!(r.unparsed(), &data[4..]);
        assert_eq!(r.room(16).1, 4);
    }

    #[test]
    fn stats_batch_records_latency_at_flush() {
        let s = IoStats::default();
        let mut b = StatsBatch::with_capacity(4);
        let t = Instant::now();
        b.push(0, IoClass::Read, 4096, t, true);
        b.push(1, IoClass::Write, 512, t, true);
        b.flush(t + Duration::from_micros(5), |k| (k == 0).then_some(&s));
        assert_eq!(s.reads.load(Relaxed), 1);
        assert_eq!(s.read_bytes.load(Relaxed), 4096);
        assert_eq!(s.writes.load(Relaxed), 0);
        b.flush(t, |_| Some(&s));
        assert_eq!(s.reads.load(Relaxed), 1);
    }
}
