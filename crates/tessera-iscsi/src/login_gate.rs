//! The connections of an iSCSI listener still logging in, bounded apart from the
//! listener's cap: past the bound, the oldest one is closed to make room. A flood of
//! connections that never finish their login therefore holds a few slots at most, and
//! a client that logs in promptly gets in while it lasts, instead of waiting for the
//! flood's logins to time out. The listener (`accept.rs`) admits each connection; the
//! connection (`conn.rs`) gives its ticket up once its login completes.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use tessera_export::log_limit::LogLimiter;
use tessera_io::sync::MutexExt;
use tracing::warn;

/// Logins closed to make room for newer ones: at most 10 lines per 10 s.
static EVICT_LOG: LogLimiter = LogLimiter::new("iscsi-login-evicted", 10, 10);

/// The connections of one listener that have not finished their login, oldest first,
/// at most `max`: admitting one more closes the oldest (its socket is shut down, so
/// its connection task sees the peer gone and ends, giving back its listener slot).
pub struct LoginGate {
    max: usize,
    /// (ticket id, a handle on the connection's socket), oldest first.
    pending: Mutex<VecDeque<(u64, TcpStream)>>,
    next_id: AtomicU64,
    evicted: AtomicU64,
}

/// A connection's place in its listener's [`LoginGate`], held until its login
/// completes or the connection ends (dropped either way).
pub struct LoginTicket {
    gate: Arc<LoginGate>,
    id: u64,
}

impl LoginGate {
    /// At most `max` connections logging in at once (at least 1).
    pub fn new(max: usize) -> Arc<LoginGate> {
        Arc::new(LoginGate {
            max: max.max(1),
            pending: Mutex::new(VecDeque::new()),
            next_id: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
        })
    }

    /// The bound a listener of `listener_max` connections uses: a quarter of them,
    /// between 4 and 64. Honest initiators log in within milliseconds, so a few places
    /// serve many; a flood only ever holds these.
    pub fn bound_for(listener_max: usize) -> usize {
        (listener_max / 4).clamp(4, 64)
    }

    /// Admit connection `s` to its login phase; past the bound, the oldest connection
    /// still logging in is shut down. `None` if `s` cannot be watched (its socket
    /// cannot be duplicated): it then logs in under its timeout alone.
    pub fn admit(self: &Arc<Self>, s: &TcpStream) -> Option<LoginTicket> {
        let handle = s.try_clone().ok()?;
        let id = self.next_id.fetch_add(1, Relaxed);
        let mut p = self.pending.locked();
        p.push_back((id, handle));
        while p.len() > self.max {
            let Some((_, oldest)) = p.pop_front() else {
                break;
            };
            self.evicted.fetch_add(1, Relaxed);
            if EVICT_LOG.admit() {
                warn!(
                    protocol = "iscsi",
                    client = %oldest.peer_addr().map(|a| a.to_string()).unwrap_or_default(),
                    max_logging_in = self.max,
                    "iscsi: too many connections still logging in; closing the oldest"
                );
            }
            let _ = oldest.shutdown(Shutdown::Both);
        }
        Some(LoginTicket {
            gate: self.clone(),
            id,
        })
    }

    /// Connections logging in now.
    pub fn logging_in(&self) -> usize {
        self.pending.locked().len()
    }

    /// Connections closed so far to make room for newer logins.
    pub fn evicted(&self) -> u64 {
        self.evicted.load(Relaxed)
    }
}

impl Drop for LoginTicket {
    fn drop(&mut self) {
        let mut p = self.gate.pending.locked();
        if let Some(i) = p.iter().position(|(id, _)| *id == self.id) {
            p.remove(i);
        }
    }
}
