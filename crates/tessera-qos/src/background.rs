//! Background classes (scrub, rebuild, resync): their own rate limits, lowered
//! automatically while client latency is above target (feedback throttling).
//!
//! The controller is additive-increase / multiplicative-decrease on the class's
//! bandwidth, driven once per [`FEEDBACK_TICK`] by the clients' p99 latency over
//! that tick: above the target, the rate halves (down to a floor, so the work
//! still finishes); at or below it, the rate climbs back by an eighth of itself
//! (at least the floor) per tick. Halving reacts within a tick or two to a
//! latency spike; the slow, proportional climb avoids jumping straight back to
//! the rate that hurt (measured: a climb of a tenth of the maximum per tick let
//! a 1 GiB/s scrub take 84% of a QD1 client's IOPS on a shared disk). With no client I/O in a tick there is nobody to protect and the
//! class runs at its maximum.

use std::time::Duration;

pub use tessera_api::qos::{BackgroundLimits, DEFAULT_TARGET_US};

/// How often a background job re-reads client latency and adjusts its rate.
pub const FEEDBACK_TICK: Duration = Duration::from_millis(100);

/// The AIMD controller (see the module docs).
#[derive(Clone, Debug)]
pub struct Feedback {
    max: u64,
    min: u64,
    rate: u64,
    target_us: f64,
    backoffs: u64,
}

impl Feedback {
    pub fn new(limits: &BackgroundLimits, target_us: f64) -> Self {
        // At most `bps` while `min_pct` is at most 100; saturate past that.
        let min = u64::try_from(u128::from(limits.bps) * u128::from(limits.min_pct) / 100)
            .unwrap_or(u64::MAX);
        Feedback {
            max: limits.bps,
            min: min.max(4096),
            rate: limits.bps,
            target_us,
            backoffs: 0,
        }
    }

    /// The rate to run at now, bytes per second.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    pub fn target_us(&self) -> f64 {
        self.target_us
    }

    /// How many times the rate was cut.
    pub fn backoffs(&self) -> u64 {
        self.backoffs
    }

    /// Feed the clients' p99 over the last tick (`None`: no client I/O);
    /// returns the new rate.
    pub fn observe(&mut self, client_p99_us: Option<f64>) -> u64 {
        match client_p99_us {
            None => self.rate = self.max,
            Some(p) if p > self.target_us => {
                self.rate = (self.rate / 2).max(self.min);
                self.backoffs += 1;
            }
            Some(_) => self.rate = (self.rate + (self.rate / 8).max(self.min)).min(self.max),
        }
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_when_clients_suffer_and_recovers() {
        let l = BackgroundLimits::new(100 << 20);
        let mut f = Feedback::new(&l, l.target_us(Some(100.0)));
        assert_eq!(f.target_us(), 150.0);
        assert_eq!(f.rate(), 100 << 20);
        f.observe(Some(400.0));
        assert_eq!(f.rate(), 50 << 20);
        for _ in 0..20 {
            f.observe(Some(400.0));
        }
        // Never below the floor: the work still finishes.
        let floor = (100u64 << 20) / 100;
        assert_eq!(f.rate(), floor);
        assert_eq!(f.backoffs(), 21);
        // Recovery is gradual: an eighth of the rate (at least the floor) per tick.
        f.observe(Some(100.0));
        assert_eq!(f.rate(), 2 * floor);
        f.observe(Some(100.0));
        assert_eq!(f.rate(), 3 * floor);
        for _ in 0..60 {
            f.observe(Some(100.0));
        }
        assert_eq!(f.rate(), 100 << 20);
        // No clients: full rate at once.
        f.observe(Some(1000.0));
        f.observe(None);
        assert_eq!(f.rate(), 100 << 20);
    }

    #[test]
    fn targets_and_validation() {
        let mut l = BackgroundLimits::new(1 << 20);
        assert_eq!(l.target_us(None), DEFAULT_TARGET_US as f64);
        l.latency_target_us = Some(300);
        assert_eq!(l.target_us(Some(10.0)), 300.0);
        assert!(l.validate().is_ok());
        l.min_pct = 0;
        assert!(l.validate().is_err());
        assert!(BackgroundLimits::new(100).validate().is_err());
    }
}
