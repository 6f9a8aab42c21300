//! Rate limits for log lines that remote clients cause (garbage connections, malformed
//! packets, failed handshakes): a hostile or broken client must not be able to fill the
//! node's disk through its log.
//!
//! Each kind of line has a [`LogLimiter`] (a `static`): the first `burst` lines of a
//! window of `window_s` seconds are logged, the rest are counted, and the first line of
//! the next window is preceded by one summary, "suppressed K similar messages in the last
//! S s". These lines are rare by nature (never per I/O), so a mutex is fine here.

use std::sync::Mutex;
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

pub struct LogLimiter {
    kind: &'static str,
    burst: u32,
    window: Duration,
    state: Mutex<Window>,
}

struct Window {
    start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl LogLimiter {
    pub const fn new(kind: &'static str, burst: u32, window_s: u64) -> LogLimiter {
        LogLimiter {
            kind,
            burst,
            window: Duration::from_secs(window_s),
            state: Mutex::new(Window {
                start: None,
                logged: 0,
                suppressed: 0,
            }),
        }
    }

    /// May one more line of this kind be logged now? Logs the summary of the previous
    /// window first when it suppressed anything.
    pub fn admit(&self) -> bool {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> bool {
        let mut w = self.state.locked();
        let expired = w.start.is_none_or(|s| now.duration_since(s) >= self.window);
        if expired {
            if w.suppressed > 0 {
                let secs = w.start.map_or(0, |s| now.duration_since(s).as_secs());
                tracing::warn!(
                    kind = self.kind,
                    suppressed = w.suppressed,
                    seconds = secs,
                    "suppressed {} similar messages in the last {} s",
                    w.suppressed,
                    secs
                );
            }
            *w = Window {
                start: Some(now),
                logged: 0,
                suppressed: 0,
            };
        }
        if w.logged < self.burst {
            w.logged += 1;
            true
        } else {
            w.suppressed += 1;
            false
        }
    }
}

/// The peer address of a connected socket, for log lines ("unix" for a Unix socket,
/// "?" when the peer is already gone).
pub fn peer_name(fd: std::os::fd::RawFd) -> String {
    use std::os::fd::FromRawFd;
    // SAFETY: the stream only borrows `fd` for one getpeername call: ManuallyDrop keeps it
    // from closing the descriptor, which stays owned by the caller.
    let s = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
    match s.peer_addr() {
        Ok(a) => a.to_string(),
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => "?".into(),
        Err(_) => "unix".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_a_burst_per_window_then_counts() {
        let l = LogLimiter::new("test", 3, 10);
        let t0 = Instant::now();
        let admitted = (0..100).filter(|_| l.admit_at(t0)).count();
        assert_eq!(admitted, 3);
        assert_eq!(l.state.lock().unwrap().suppressed, 97);
        // A new window: the count starts again (and the summary was logged).
        assert!(l.admit_at(t0 + Duration::from_secs(11)));
        let w = l.state.lock().unwrap();
        assert_eq!((w.logged, w.suppressed), (1, 0));
    }
}
