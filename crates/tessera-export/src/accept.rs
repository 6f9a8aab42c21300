//! The accept loop every protocol's listener shares: a failed accept waits instead of
//! spinning ([`ListenerCap::accept_failed`]), a connection past the listener's cap is
//! closed at once with a rate-limited log line, and every other one is handed to the
//! protocol with its slot in the cap.

use std::io;
use std::sync::Arc;

use tracing::warn;

use crate::budget::{ListenerCap, ListenerSlot};
use crate::log_limit::LogLimiter;

/// A stream a listener accepts, which can name its client for the logs.
pub trait Peer {
    fn peer(&self) -> String;
}

impl Peer for std::net::TcpStream {
    fn peer(&self) -> String {
        self.peer_addr()
            .map_or_else(|_| "?".into(), |a| a.to_string())
    }
}

impl Peer for std::os::unix::net::UnixStream {
    fn peer(&self) -> String {
        "unix".into()
    }
}

/// Accept connections from `incoming` for as long as it yields them. Past `cap` open
/// connections a new one is closed at once (logged through `refused_log`, as
/// `protocol`); every other one goes to `serve` with the slot it holds in `cap` until
/// it ends.
pub fn accept_each<S: Peer>(
    incoming: impl Iterator<Item = io::Result<S>>,
    cap: &Arc<ListenerCap>,
    protocol: &'static str,
    refused_log: &LogLimiter,
    mut serve: impl FnMut(S, ListenerSlot),
) {
    for s in incoming {
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                cap.accept_failed(&e);
                continue;
            }
        };
        let Some(slot) = cap.try_open() else {
            if refused_log.admit() {
                warn!(
                    protocol,
                    listener = %cap.address,
                    client = %s.peer(),
                    max_connections = cap.max(),
                    "{protocol}: connection refused: the listener serves its maximum of connections"
                );
            }
            continue; // dropping the stream closes it
        };
        serve(s, slot);
    }
}
