//! The reactor's choice between polling its ring and sleeping in the kernel.
//!
//! Hybrid polling (poll for a window after each batch of work, then sleep) saves a wakeup
//! when the next completion arrives within the window, which on a VM is worth more than
//! serving a small request. It costs the CPU for the window, and that is what breaks it
//! when the answer depends on another thread that needs this very CPU: on a 2-CPU machine
//! a replicated QD1 write keeps three threads going (the client, the owner's reactor, the
//! replica node's reactor), and a reactor spinning for its window makes the thread that
//! must answer next wait for the window to end (141-171 µs per write instead of ~70, see
//! docs/benchmarks.md, "Issue 12: QD1 replicated write latency with polling on"). Two
//! rules keep the poll where it pays:
//!
//! - **Waiting on a peer on this host: sleep.** While the core has commands outstanding
//!   to a peer node on the same host ([`crate::CoreIo::peer_waits`], kept by the remote
//!   initiator), the answer takes a full round trip through that peer's reactor, which
//!   shares our CPUs: polling for it only delays it.
//! - **Polls that keep finding nothing: stop polling.** After [`MISSES_TO_SUSPEND`]
//!   windows in a row ran out without a completion, the reactor sleeps at once, except
//!   for one probe (a full window) every few sleeps; the interval doubles after each
//!   probe that finds nothing (up to [`MAX_PROBE_INTERVAL`]) and a poll that finds work
//!   restores polling. This is the replica node's side: after answering the owner, its
//!   window always runs out, because the owner's next command cannot come before the
//!   owner gets the CPU. A client on another CPU that answers within the window (QD1 NBD
//!   or NVMe/TCP) makes every poll find work and keeps polling on.
//!
//! Completions found by the first look at the ring (a send that completed as it was
//! submitted) say nothing about whether waiting pays and count neither way. A window
//! shortened by a timer does not count as a miss either.

use std::time::Duration;

/// Windows in a row without a completion after which polling is suspended.
pub const MISSES_TO_SUSPEND: u32 = 4;
/// Sleeps between probes right after polling was suspended.
pub const FIRST_PROBE_INTERVAL: u32 = 4;
/// The longest interval between probes, in sleeps.
pub const MAX_PROBE_INTERVAL: u32 = 64;

/// What one poll of the ring found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollOutcome {
    /// Completions were there at the first look: produced by the reactor's own
    /// submissions, not by waiting.
    Ready,
    /// A completion arrived while polling: the poll saved a sleep and a wakeup.
    Arrived,
    /// The window ran out with nothing.
    Nothing,
}

/// Per-reactor state of the poll-or-sleep decision. Plain fields: only the reactor thread
/// touches it, once per poll window (never per I/O).
#[derive(Clone, Debug)]
pub struct PollPolicy {
    /// The configured window (`poll_us`); zero never polls.
    window: Duration,
    /// Full windows in a row that found nothing.
    misses: u32,
    /// While suspended: sleeps left before the next probe.
    sleeps_to_probe: u32,
    /// While suspended: the current interval between probes.
    probe_interval: u32,
}

impl PollPolicy {
    pub fn new(window: Duration) -> PollPolicy {
        PollPolicy {
            window,
            misses: 0,
            sleeps_to_probe: 0,
            probe_interval: FIRST_PROBE_INTERVAL,
        }
    }

    /// True while polls keep finding nothing and the reactor sleeps at once.
    pub fn suspended(&self) -> bool {
        self.misses >= MISSES_TO_SUSPEND
    }

    /// How long to poll before sleeping (zero: sleep at once). Called once each time the
    /// reactor runs out of work; `next_timer` is the time to the earliest pending timer
    /// and `awaiting_peer` whether the core waits for a peer on this host.
    pub fn window(&mut self, next_timer: Option<Duration>, awaiting_peer: bool) -> Duration {
        if self.window.is_zero() || awaiting_peer {
            return Duration::ZERO;
        }
        if self.suspended() {
            if self.sleeps_to_probe > 0 {
                self.sleeps_to_probe -= 1;
                return Duration::ZERO;
            }
            // Probe with a full window: a timer due sooner would make it say nothing.
            if next_timer.is_some_and(|d| d < self.window) {
                return Duration::ZERO;
            }
            return self.window;
        }
        next_timer.map_or(self.window, |d| d.min(self.window))
    }

    /// Account a poll of `used` (what [`PollPolicy::window`] returned) that found
    /// `outcome`.
    pub fn record(&mut self, outcome: PollOutcome, used: Duration) {
        match outcome {
            PollOutcome::Ready => {}
            PollOutcome::Arrived => {
                self.misses = 0;
                self.probe_interval = FIRST_PROBE_INTERVAL;
                self.sleeps_to_probe = 0;
            }
            PollOutcome::Nothing if used >= self.window => {
                let was_probe = self.suspended();
                self.misses = self.misses.saturating_add(1);
                if was_probe {
                    self.probe_interval = (self.probe_interval * 2).min(MAX_PROBE_INTERVAL);
                }
                if self.suspended() {
                    self.sleeps_to_probe = self.probe_interval;
                }
            }
            PollOutcome::Nothing => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_micros(50);

    /// Polls (as the reactor would) until the policy returns a non-zero window; returns
    /// how many sleeps without a poll came first.
    fn sleeps_before_next_poll(p: &mut PollPolicy) -> u32 {
        let mut n = 0;
        while p.window(None, false).is_zero() {
            n += 1;
            assert!(n < 1000, "the policy never probes again");
        }
        n
    }

    #[test]
    fn polls_the_configured_window_and_a_timer_shortens_it() {
        let mut p = PollPolicy::new(W);
        assert_eq!(p.window(None, false), W);
        assert_eq!(
            p.window(Some(Duration::from_micros(10)), false),
            Duration::from_micros(10)
        );
        assert_eq!(p.window(Some(Duration::from_millis(100)), false), W);
        let mut off = PollPolicy::new(Duration::ZERO);
        assert_eq!(off.window(None, false), Duration::ZERO);
    }

    #[test]
    fn a_core_waiting_on_a_peer_on_this_host_sleeps_and_that_counts_as_no_miss() {
        let mut p = PollPolicy::new(W);
        for _ in 0..100 {
            assert_eq!(p.window(None, true), Duration::ZERO);
        }
        assert!(!p.suspended());
        // Once the peer has answered, the core polls again as before.
        assert_eq!(p.window(None, false), W);
    }

    #[test]
    fn windows_that_keep_finding_nothing_suspend_polling_and_work_found_restores_it() {
        let mut p = PollPolicy::new(W);
        for i in 0..MISSES_TO_SUSPEND {
            assert_eq!(p.window(None, false), W, "miss {i} does not suspend yet");
            p.record(PollOutcome::Nothing, W);
        }
        assert!(p.suspended());
        // Suspended: sleep at once, then probe with a full window.
        assert_eq!(sleeps_before_next_poll(&mut p), FIRST_PROBE_INTERVAL);
        p.record(PollOutcome::Nothing, W);
        // Each empty probe doubles the interval, up to the limit.
        assert_eq!(sleeps_before_next_poll(&mut p), FIRST_PROBE_INTERVAL * 2);
        for _ in 0..10 {
            p.record(PollOutcome::Nothing, W);
            let n = sleeps_before_next_poll(&mut p);
            assert!(n <= MAX_PROBE_INTERVAL);
        }
        assert_eq!(sleeps_before_next_poll(&mut p), 0, "already at a probe");
        p.record(PollOutcome::Nothing, W);
        assert_eq!(sleeps_before_next_poll(&mut p), MAX_PROBE_INTERVAL);
        // A probe that finds work: polling is back, every time.
        p.record(PollOutcome::Arrived, W);
        assert!(!p.suspended());
        for _ in 0..10 {
            assert_eq!(p.window(None, false), W);
        }
        // And a later run of misses starts again from the first interval.
        for _ in 0..MISSES_TO_SUSPEND {
            p.record(PollOutcome::Nothing, W);
        }
        assert_eq!(sleeps_before_next_poll(&mut p), FIRST_PROBE_INTERVAL);
    }

    #[test]
    fn a_hit_between_misses_keeps_polling_on() {
        // A QD1 client on another CPU: now and then its next request comes late.
        let mut p = PollPolicy::new(W);
        for _ in 0..100 {
            for _ in 0..MISSES_TO_SUSPEND - 1 {
                p.record(PollOutcome::Nothing, W);
            }
            p.record(PollOutcome::Arrived, W);
            assert_eq!(p.window(None, false), W);
        }
    }

    #[test]
    fn own_completions_and_timer_shortened_windows_are_no_evidence() {
        let mut p = PollPolicy::new(W);
        for _ in 0..MISSES_TO_SUSPEND - 1 {
            p.record(PollOutcome::Nothing, W);
        }
        // A send that completed as it was submitted is neither a hit nor a miss...
        for _ in 0..10 {
            p.record(PollOutcome::Ready, W);
        }
        assert!(!p.suspended());
        // ... and neither is a window a timer cut short.
        for _ in 0..10 {
            p.record(PollOutcome::Nothing, Duration::from_micros(5));
        }
        assert!(!p.suspended());
        p.record(PollOutcome::Nothing, W);
        assert!(p.suspended());
        // A probe never runs shortened: a timer due within the window postpones it.
        assert_eq!(sleeps_before_next_poll(&mut p), FIRST_PROBE_INTERVAL);
        assert_eq!(
            p.window(Some(Duration::from_micros(5)), false),
            Duration::ZERO
        );
        assert_eq!(p.window(Some(Duration::from_millis(100)), false), W);
    }
}
