//! Limits one client cannot push the node past: bytes of request data buffers in flight
//! (per connection and for the whole node) and connections per listener.
//!
//! A data buffer (a READ's reply data, a WRITE's payload) is held from the moment the
//! request is taken off the socket until its reply has left: the kernel took the last
//! byte of it, so replies a client does not read keep counting. Without a budget, a
//! client that sends large READs and never reads its socket pins its whole window (NBD:
//! 512 requests of 32 MiB) in memory, and a few such clients end the node.
//!
//! The budget is back-pressure, never an error: a connection whose next request does not
//! fit stops parsing and stops reading its socket ([`ConnBudget::try_take`] refuses and
//! marks it stalled) until its own replies have left and released their buffers; then it
//! goes on where it stopped. The client sees a slower server, not a failed request.
//!
//! - Per connection: the bytes its requests hold may not pass [`BufferBudget::conn_limit`],
//!   except that a connection holding nothing is always admitted one request, however
//!   large: a request bigger than the whole per-connection budget still makes progress
//!   (alone), and every connection keeps at least one request in flight.
//! - Per node: the bytes all connections hold may not pass
//!   [`BufferBudget::node_limit`] by more than that first request of each connection.
//!   The first request is admitted past it on purpose: clients that pin the node's
//!   budget with replies they never read must not starve a well-behaved client, which
//!   then still gets one request at a time. So the node holds at most
//!   `node_limit + connections x largest request`, and the connection cap per listener
//!   ([`ListenerCap`]) bounds the second term.
//!
//! The node-wide figure is one atomic shared by every reactor core, updated once per
//! request with a buffer (not per byte, not per request without data).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

/// The node's budget for request data buffers in flight, shared by every connection of
/// every protocol on every core.
pub struct BufferBudget {
    conn_limit: u64,
    node_limit: u64,
    /// Bytes held by every connection's requests now.
    held: AtomicU64,
    /// Times a connection stopped reading because its next request did not fit.
    stalls: AtomicU64,
}

impl BufferBudget {
    /// A budget of `conn_limit` bytes per connection and `node_limit` for the node.
    pub fn new(conn_limit: u64, node_limit: u64) -> Arc<BufferBudget> {
        Arc::new(BufferBudget {
            conn_limit,
            node_limit,
            held: AtomicU64::new(0),
            stalls: AtomicU64::new(0),
        })
    }

    /// No limit (tests and tools that serve one trusted client).
    pub fn unlimited() -> Arc<BufferBudget> {
        BufferBudget::new(u64::MAX, u64::MAX)
    }

    /// A connection's share, holding `slot` (its place under its listener's cap) for as
    /// long as the connection lives.
    pub fn conn(self: &Arc<Self>, slot: Option<ListenerSlot>) -> ConnBudget {
        ConnBudget {
            node: self.clone(),
            held: 0,
            stalled: false,
            _slot: slot,
        }
    }

    pub fn conn_limit(&self) -> u64 {
        self.conn_limit
    }

    pub fn node_limit(&self) -> u64 {
        self.node_limit
    }

    /// Bytes of request data buffers in flight on the node now.
    pub fn held(&self) -> u64 {
        self.held.load(Relaxed)
    }

    /// Times a connection stopped reading its socket for want of budget.
    pub fn stalls(&self) -> u64 {
        self.stalls.load(Relaxed)
    }

    /// Take `bytes` off the node's budget unless that passes its limit.
    fn take(&self, bytes: u64) -> bool {
        self.held
            .fetch_update(Relaxed, Relaxed, |h| {
                h.checked_add(bytes).filter(|&n| n <= self.node_limit)
            })
            .is_ok()
    }
}

/// What one connection holds of the node's [`BufferBudget`] (and its [`ListenerSlot`]).
/// Owned by the connection's task on its core; dropping it gives everything back.
pub struct ConnBudget {
    node: Arc<BufferBudget>,
    held: u64,
    stalled: bool,
    _slot: Option<ListenerSlot>,
}

impl ConnBudget {
    /// Take `bytes` for the buffers of the request about to be taken off the socket.
    /// False: it does not fit now; leave it where it is, stop reading the socket
    /// ([`ConnBudget::stalled`]) and try again once this connection released buffers
    /// (its replies left). A connection holding nothing is always admitted.
    pub fn try_take(&mut self, bytes: u64) -> bool {
        if bytes == 0 {
            return true;
        }
        let fits = if self.held == 0 {
            self.node.held.fetch_add(bytes, Relaxed);
            true
        } else {
            self.held.saturating_add(bytes) <= self.node.conn_limit && self.node.take(bytes)
        };
        if fits {
            self.held += bytes;
            self.stalled = false;
        } else if !self.stalled {
            self.stalled = true;
            self.node.stalls.fetch_add(1, Relaxed);
        }
        fits
    }

    /// A request's buffers (`bytes`, as taken) are free: its reply left, or it ended
    /// without one.
    pub fn release(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.held, "releasing {bytes} of {}", self.held);
        let bytes = bytes.min(self.held);
        self.held -= bytes;
        self.node.held.fetch_sub(bytes, Relaxed);
    }

    /// The last request offered did not fit: the socket is not read until buffers are
    /// released and it is admitted.
    #[inline]
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Bytes this connection's requests hold.
    pub fn held(&self) -> u64 {
        self.held
    }
}

impl Drop for ConnBudget {
    fn drop(&mut self) {
        // A connection torn down with requests still charged (their buffers are freed
        // with it) gives their bytes back to the node.
        self.node.held.fetch_sub(self.held, Relaxed);
    }
}

/// The cap on connections one listener serves at a time: past it, a new connection is
/// closed right after accept (counted in `refused`).
pub struct ListenerCap {
    /// "nbd" or "nvme-tcp".
    pub protocol: &'static str,
    /// The address the listener serves (a label for metrics and logs).
    pub address: String,
    max: usize,
    open: AtomicUsize,
    refused: AtomicU64,
}

impl ListenerCap {
    pub fn new(protocol: &'static str, address: String, max: usize) -> Arc<ListenerCap> {
        Arc::new(ListenerCap {
            protocol,
            address,
            max,
            open: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// A place for one more connection, held until the [`ListenerSlot`] drops; `None`
    /// (counted as refused) when `max` connections are open.
    pub fn try_open(self: &Arc<Self>) -> Option<ListenerSlot> {
        let r = self
            .open
            .fetch_update(Relaxed, Relaxed, |n| (n < self.max).then_some(n + 1));
        match r {
            Ok(_) => Some(ListenerSlot(self.clone())),
            Err(_) => {
                self.refused.fetch_add(1, Relaxed);
                None
            }
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Connections open now (handshakes included).
    pub fn open(&self) -> usize {
        self.open.load(Relaxed)
    }

    /// Connections closed right after accept because the cap was reached.
    pub fn refused(&self) -> u64 {
        self.refused.load(Relaxed)
    }

    /// `accept` on this listener failed with `e`: log it (rate-limited) and wait
    /// [`ACCEPT_RETRY`] before the caller tries again. Out of descriptors (EMFILE,
    /// ENFILE) or memory, accept fails at once for as long as that lasts and the
    /// pending connection stays queued, so an accept loop that simply went on would spin
    /// a core at 100% while a connection flood holds the node's descriptors.
    pub fn accept_failed(&self, e: &std::io::Error) {
        if ACCEPT_LOG.admit() {
            tracing::warn!(
                protocol = self.protocol,
                listener = %self.address,
                "{}: accept failed: {e}; retrying in {} ms",
                self.protocol,
                ACCEPT_RETRY.as_millis()
            );
        }
        std::thread::sleep(ACCEPT_RETRY);
    }
}

/// How long an accept loop waits after a failed accept (see
/// [`ListenerCap::accept_failed`]): short enough that the listener resumes within a
/// blink once descriptors are free, long enough that a failing accept costs nothing.
pub const ACCEPT_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// Failed accepts, every listener: at most 10 lines per 10 s.
static ACCEPT_LOG: crate::log_limit::LogLimiter =
    crate::log_limit::LogLimiter::new("accept-failed", 10, 10);

/// One connection's place under its listener's cap, given back on drop.
pub struct ListenerSlot(Arc<ListenerCap>);

impl Drop for ListenerSlot {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_stalls_past_its_budget_and_resumes_when_released() {
        let b = BufferBudget::new(100, 1000);
        let mut c = b.conn(None);
        assert!(c.try_take(60));
        assert!(c.try_take(40));
        assert!(!c.try_take(1));
        assert!(c.stalled());
        // Refused again while stalled: one stall counted.
        assert!(!c.try_take(1));
        assert_eq!(b.stalls(), 1);
        c.release(60);
        assert!(c.try_take(50));
        assert!(!c.stalled());
        assert_eq!((c.held(), b.held()), (90, 90));
        // Requests without a buffer never wait.
        assert!(c.try_take(0));
    }

    #[test]
    fn a_request_larger_than_the_budget_is_admitted_alone() {
        let b = BufferBudget::new(100, 150);
        let mut c = b.conn(None);
        assert!(c.try_take(500));
        assert!(!c.try_take(1));
        c.release(500);
        assert!(c.try_take(500));
        assert_eq!(b.held(), 500);
    }

    #[test]
    fn the_node_budget_is_shared_but_every_connection_gets_one_request() {
        let b = BufferBudget::new(100, 150);
        let mut x = b.conn(None);
        let mut y = b.conn(None);
        let mut z = b.conn(None);
        assert!(x.try_take(100));
        assert!(y.try_take(40));
        // y's second request would pass the node's limit.
        assert!(!y.try_take(20));
        // z holds nothing: admitted past the node's limit, one request.
        assert!(z.try_take(100));
        assert!(!z.try_take(1));
        assert_eq!(b.held(), 240);
        x.release(100);
        assert!(!y.try_take(20), "still over the node's limit");
        drop(z);
        assert!(y.try_take(20));
        assert_eq!(b.held(), 60);
        drop(y);
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn a_listener_refuses_past_its_cap_until_a_connection_closes() {
        let cap = ListenerCap::new("nbd", "127.0.0.1:1".into(), 2);
        let a = cap.try_open().expect("first");
        let _b = cap.try_open().expect("second");
        assert!(cap.try_open().is_none());
        assert_eq!((cap.open(), cap.refused()), (2, 1));
        drop(a);
        let _c = cap.try_open().expect("a place was freed");
        assert_eq!((cap.open(), cap.refused()), (2, 1));
    }
}
