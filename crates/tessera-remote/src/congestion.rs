//! The delay-based congestion window of one NVMe/TCP queue (seed 001: RTT-based
//! congestion control on the path to a remote replica).
//!
//! TCP already keeps the byte stream from overrunning the network; what it cannot see is
//! how many *commands* wait at the peer. A slow or distant replica (a bandwidth-limited
//! path, an overloaded target) would otherwise hold a whole queue depth of commands,
//! each waiting behind all the others. The window bounds the commands a queue keeps
//! outstanding by the round-trip time it measures:
//!
//! - Every command's RTT (capsule encoded → response parsed) is taken from the reactor's
//!   per-round clock, so measuring costs no system call. A smoothed RTT (gain 1/8) is kept
//!   for display; the control uses the smallest RTT of each round trip ("epoch"), which
//!   a standing queue raises and a passing hiccup (one descheduled thread) does not.
//! - The path's minimum RTT is remembered in two halves of [`CongestionConfig::min_rtt_window`];
//!   the older half is dropped every half window, so after a path change to a longer one
//!   the minimum rises within one window. Queueing delay = epoch minimum − path minimum.
//! - Once per epoch (the epoch ends when a command sent after it began completes): above
//!   the target delay for a second epoch in a row (a standing queue persists, a stall of
//!   a descheduled thread does not) the window shrinks by a factor between 1/2 and 1,
//!   the further above the target the more (`1 − (q − target) / 2q`); at or below it, and only if the window
//!   was full during the epoch (the load wanted more), it grows by one command, or by the
//!   epoch's completions while in the initial slow start (doubling per round trip, left
//!   at the first decrease). Floor and ceiling are configured; the ceiling is at most the
//!   queue depth.
//! - A window the delay holds back could keep a standing queue of its own forever, and
//!   the minimum would drift up to include it. So when the older half of the minimum is
//!   dropped and the window shrank since the last time, one epoch runs at the floor
//!   window: the peer's queue drains and the next command measures the empty path. That
//!   costs one round trip per half window, and nothing on a path that never made the
//!   window shrink (a fast peer).
//!
//! All integers, a few operations per completion; no allocation, lock or atomic.

use std::time::{Duration, Instant};

use crate::CongestionError;

/// Fixed-point scale of the window: 1/1024 of a command.
const SCALE: u64 = 1024;
/// The initial window (commands), before slow start opens it.
const INITIAL_WINDOW: u64 = 8;

/// How a queue adapts the number of commands it keeps outstanding
/// ([`crate::RemoteConfig::congestion`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CongestionConfig {
    /// Adapt the window to the measured RTT. Off, the window is the ceiling at all times
    /// (RTTs are still measured and shown).
    pub enabled: bool,
    /// Queueing delay (RTT above the path's minimum) the window aims at.
    pub target_delay: Duration,
    /// The smallest window (commands).
    pub min_window: u16,
    /// The largest window (commands); 0: the queue depth.
    pub max_window: u16,
    /// How long the minimum RTT is remembered: after the path becomes slower for good,
    /// the window opens again within this time.
    pub min_rtt_window: Duration,
}

impl Default for CongestionConfig {
    fn default() -> Self {
        CongestionConfig {
            enabled: true,
            // Above what a saturated loopback peer shows at queue depth 128 (~0.4 ms, see
            // docs/benchmarks.md), so a fast peer is never held back, and small against
            // the tens of milliseconds a bandwidth-limited path queues without control.
            target_delay: Duration::from_millis(2),
            min_window: 2,
            max_window: 0,
            min_rtt_window: Duration::from_secs(10),
        }
    }
}

impl CongestionConfig {
    /// The ceiling for a queue of `depth` commands, or why the settings are unusable.
    pub fn ceiling(&self, depth: u16) -> Result<u16, CongestionError> {
        let max = if self.max_window == 0 {
            depth
        } else {
            self.max_window
        };
        if max > depth {
            return Err(CongestionError::MaxAboveDepth { max, depth });
        }
        if self.min_window == 0 || self.min_window > max {
            return Err(CongestionError::MinWindow {
                min: self.min_window,
                max,
            });
        }
        if self.target_delay.is_zero() || self.target_delay > Duration::from_secs(10) {
            return Err(CongestionError::TargetDelay);
        }
        if self.min_rtt_window < Duration::from_millis(10) {
            return Err(CongestionError::MinRttWindow);
        }
        Ok(max)
    }
}

/// A queue's window and RTT estimates.
pub(crate) struct Window {
    enabled: bool,
    floor: u64,
    ceiling: u64,
    target_ns: u64,
    half: Duration,
    /// In 1/[`SCALE`] commands.
    cwnd: u64,
    slow_start: bool,
    /// A drain probe runs: the window to return to when its epoch ends.
    probe_return: Option<u64>,
    /// Smoothed RTT; 0 before the first sample.
    srtt_ns: u64,
    /// Minimum RTT of the current and of the previous half window (u64::MAX: none).
    min_now_ns: u64,
    min_before_ns: u64,
    rotate_at: Option<Instant>,
    /// Sequence number the next command sent gets.
    next_seq: u64,
    /// The epoch ends when a command with at least this sequence number completes.
    epoch_end: u64,
    epoch_min_ns: u64,
    epoch_acks: u64,
    /// The window was full (commands left for it) during the epoch.
    epoch_full: bool,
    decreases: u64,
    /// `decreases` at the last rotation of the minimum.
    decreases_at_rotation: u64,
    /// Epochs in a row whose queueing delay exceeded the target.
    over_epochs: u32,
}

impl Window {
    /// `cfg` must have passed [`CongestionConfig::ceiling`] for `depth`.
    pub(crate) fn new(cfg: &CongestionConfig, depth: u16) -> Window {
        let ceiling = u64::from(cfg.ceiling(depth).unwrap_or(depth));
        let floor = u64::from(cfg.min_window).clamp(1, ceiling);
        let target_ns = u64::try_from(cfg.target_delay.as_nanos()).unwrap_or(u64::MAX);
        Window {
            enabled: cfg.enabled,
            floor,
            ceiling,
            target_ns,
            half: cfg.min_rtt_window / 2,
            cwnd: if cfg.enabled {
                INITIAL_WINDOW.clamp(floor, ceiling) * SCALE
            } else {
                ceiling * SCALE
            },
            slow_start: true,
            probe_return: None,
            srtt_ns: 0,
            min_now_ns: u64::MAX,
            min_before_ns: u64::MAX,
            rotate_at: None,
            next_seq: 0,
            epoch_end: 0,
            epoch_min_ns: u64::MAX,
            epoch_acks: 0,
            epoch_full: false,
            decreases: 0,
            decreases_at_rotation: 0,
            over_epochs: 0,
        }
    }

    /// Commands the queue may have outstanding now.
    #[inline]
    pub(crate) fn allowed(&self) -> usize {
        if self.probe_return.is_some() {
            return tessera_io::cast::usize_of(self.floor);
        }
        tessera_io::cast::usize_of(self.cwnd / SCALE)
    }

    /// A command leaves: its sequence number, which its completion hands back.
    #[inline]
    pub(crate) fn on_send(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// The window held commands back (or was exactly used up).
    #[inline]
    pub(crate) fn note_full(&mut self) {
        self.epoch_full = true;
    }

    /// A command sent with sequence number `seq` completed after `rtt`, seen at `now`.
    #[inline]
    pub(crate) fn on_ack(&mut self, rtt: Duration, seq: u64, now: Instant) {
        let rtt_ns = u64::try_from(rtt.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.srtt_ns = if self.srtt_ns == 0 {
            rtt_ns
        } else {
            self.srtt_ns - self.srtt_ns / 8 + rtt_ns / 8
        };
        match self.rotate_at {
            Some(t) if now >= t => {
                self.min_before_ns = self.min_now_ns;
                self.min_now_ns = u64::MAX;
                self.rotate_at = Some(now + self.half);
                // Only a window the delay held back lately may sit on a standing queue
                // of its own: drain it for one epoch so the minimum stays honest.
                let held = self.decreases != self.decreases_at_rotation;
                self.decreases_at_rotation = self.decreases;
                if self.enabled && held && self.probe_return.is_none() {
                    self.probe_return = Some(self.cwnd);
                    self.start_epoch();
                }
            }
            None => self.rotate_at = Some(now + self.half),
            Some(_) => {}
        }
        self.min_now_ns = self.min_now_ns.min(rtt_ns);
        self.epoch_min_ns = self.epoch_min_ns.min(rtt_ns);
        self.epoch_acks += 1;
        if !self.enabled || seq < self.epoch_end {
            return;
        }
        self.end_epoch();
    }

    /// Once per round trip: shrink above the target delay, grow below it when the load
    /// wanted more.
    fn end_epoch(&mut self) {
        if let Some(back) = self.probe_return.take() {
            self.cwnd = back;
            return self.start_epoch();
        }
        let queueing = self.epoch_min_ns.saturating_sub(self.min_rtt_ns());
        if queueing <= self.target_ns {
            self.over_epochs = 0;
            if self.epoch_full {
                let grow = if self.slow_start {
                    self.epoch_acks * SCALE
                } else {
                    SCALE
                };
                self.cwnd = (self.cwnd + grow).min(self.ceiling * SCALE);
            }
            return self.start_epoch();
        }
        // A standing queue stays; a stall (the peer or this reactor descheduled for a few
        // ms on a busy machine) delays one epoch's commands and is gone in the next. So
        // shrink only on the second epoch in a row above the target, holding meanwhile.
        self.over_epochs += 1;
        if self.over_epochs >= 2 {
            let over = queueing - self.target_ns;
            // 1 − over/(2·queueing), in 1/1024: between 1/2 and 1.
            let keep = SCALE - (over.saturating_mul(SCALE / 2) / queueing).min(SCALE / 2);
            self.cwnd = (self.cwnd.saturating_mul(keep) / SCALE).max(self.floor * SCALE);
            self.slow_start = false;
            self.decreases += 1;
        }
        self.start_epoch();
    }

    fn start_epoch(&mut self) {
        self.epoch_end = self.next_seq;
        self.epoch_min_ns = u64::MAX;
        self.epoch_acks = 0;
        self.epoch_full = false;
    }

    /// The path's minimum RTT over the last one to two half windows (0: no sample).
    fn min_rtt_ns(&self) -> u64 {
        match self.min_now_ns.min(self.min_before_ns) {
            u64::MAX => 0,
            m => m,
        }
    }

    pub(crate) fn window(&self) -> u32 {
        tessera_io::cast::u32_of(self.allowed())
    }

    pub(crate) fn min_rtt(&self) -> Duration {
        Duration::from_nanos(self.min_rtt_ns())
    }

    pub(crate) fn srtt(&self) -> Duration {
        Duration::from_nanos(self.srtt_ns)
    }

    pub(crate) fn decreases(&self) -> u64 {
        self.decreases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a window against a model path: a peer that serves one command per
    /// `service` (a bottleneck) behind a base RTT, at a closed-loop load of `qd`.
    struct Path {
        w: Window,
        now: Instant,
        /// Sent, not completed: (sequence number, sent at).
        flight: std::collections::VecDeque<(u64, Instant)>,
        /// When the bottleneck is free again.
        free_at: Instant,
        done_at: std::collections::VecDeque<Instant>,
    }

    impl Path {
        fn new(cfg: &CongestionConfig, depth: u16) -> Path {
            let now = Instant::now();
            Path {
                w: Window::new(cfg, depth),
                now,
                flight: Default::default(),
                free_at: now,
                done_at: Default::default(),
            }
        }

        /// Run `n` completions with `qd` commands wanted; returns the largest number
        /// outstanding seen over the last half of them.
        fn run(&mut self, n: usize, qd: usize, base: Duration, service: Duration) -> usize {
            let mut peak = 0;
            for i in 0..n {
                // Fill the window as the link's pump does.
                let allowed = self.w.allowed();
                while self.flight.len() < qd.min(allowed) {
                    let seq = self.w.on_send();
                    self.flight.push_back((seq, self.now));
                    // FIFO bottleneck: served after whatever is ahead of it.
                    let start = self.free_at.max(self.now + base / 2);
                    self.free_at = start + service;
                    self.done_at.push_back(self.free_at + base / 2);
                }
                if self.flight.len() >= allowed {
                    self.w.note_full();
                }
                if i >= n / 2 {
                    peak = peak.max(self.flight.len());
                }
                let (seq, sent) = self.flight.pop_front().unwrap();
                let done = self.done_at.pop_front().unwrap();
                self.now = self.now.max(done);
                self.w.on_ack(self.now - sent, seq, self.now);
            }
            peak
        }
    }

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn a_fast_peer_opens_the_window_to_the_queue_depth() {
        let mut p = Path::new(&CongestionConfig::default(), 128);
        // 20 us base RTT, 3 us per command: QD128 queues ~0.4 ms at the peer, well
        // below the target.
        let peak = p.run(20_000, 128, 20 * US, 3 * US);
        assert_eq!(p.w.allowed(), 128);
        assert_eq!(peak, 128);
        assert_eq!(p.w.decreases(), 0);
    }

    #[test]
    fn the_window_grows_only_while_the_load_fills_it() {
        let mut p = Path::new(&CongestionConfig::default(), 128);
        p.run(5_000, 16, 20 * US, 3 * US);
        // One slow-start step past the 16 the load uses, at most.
        assert!(p.w.allowed() <= 32, "window {}", p.w.allowed());
    }

    #[test]
    fn a_bottleneck_keeps_few_commands_outstanding_and_recovers_when_gone() {
        let mut p = Path::new(&CongestionConfig::default(), 128);
        // 1 ms per command (4 KiB at 4 MiB/s): 2 ms of queueing is about 2 commands.
        let peak = p.run(3_000, 128, 200 * US, 1000 * US);
        assert!(peak <= 8, "{peak} outstanding behind a bottleneck");
        assert!(p.w.decreases() > 0);
        let slow = p.w.allowed();
        // The bottleneck goes away: the window opens again.
        let peak = p.run(20_000, 128, 20 * US, 3 * US);
        assert!(
            p.w.allowed() >= 120,
            "window {} after recovery",
            p.w.allowed()
        );
        assert!(peak >= 120 && slow <= 8, "peak {peak}, slow {slow}");
    }

    #[test]
    fn without_control_the_queue_fills_to_the_depth() {
        let cfg = CongestionConfig {
            enabled: false,
            ..CongestionConfig::default()
        };
        let mut p = Path::new(&cfg, 128);
        let peak = p.run(3_000, 128, 200 * US, 1000 * US);
        assert_eq!(peak, 128);
        assert_eq!(p.w.allowed(), 128);
        // The RTTs are still measured: a whole queue depth of service time.
        assert!(p.w.srtt() >= Duration::from_millis(100), "{:?}", p.w.srtt());
    }

    #[test]
    fn the_minimum_rtt_rises_after_a_path_change() {
        let cfg = CongestionConfig {
            min_rtt_window: Duration::from_millis(200),
            ..CongestionConfig::default()
        };
        let mut p = Path::new(&cfg, 64);
        p.run(10_000, 64, 20 * US, 3 * US);
        assert_eq!(p.w.allowed(), 64);
        // The path grows 10 ms longer (no bottleneck): at first that looks like queueing
        // and the window shrinks...
        let mut least = usize::MAX;
        for _ in 0..20 {
            p.run(50, 64, 10_020 * US, 3 * US);
            least = least.min(p.w.allowed());
        }
        assert!(least < 16, "window {least}");
        // ...then the old minimum expires and the window opens on the longer path.
        p.run(20_000, 64, 10_020 * US, 3 * US);
        assert!(
            p.w.min_rtt() >= Duration::from_millis(10),
            "{:?}",
            p.w.min_rtt()
        );
        assert_eq!(p.w.allowed(), 64);
    }

    #[test]
    fn settings_are_checked() {
        let d = CongestionConfig::default();
        assert_eq!(d.ceiling(128), Ok(128));
        let c = |f: fn(&mut CongestionConfig)| {
            let mut c = CongestionConfig::default();
            f(&mut c);
            c.ceiling(64)
        };
        assert_eq!(c(|c| c.max_window = 32), Ok(32));
        assert!(c(|c| c.max_window = 65).is_err());
        assert!(c(|c| c.min_window = 0).is_err());
        assert!(c(|c| {
            c.max_window = 4;
            c.min_window = 5
        })
        .is_err());
        assert!(c(|c| c.target_delay = Duration::ZERO).is_err());
        assert!(c(|c| c.min_rtt_window = Duration::from_millis(1)).is_err());
    }
}
