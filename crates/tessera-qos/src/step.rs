//! Stepped burst for group limits (a "ladder"): while a group keeps hitting
//! its limit, the limit climbs one step at a time above its base, paid for by
//! credits the group earned while it ran below the base; when the pressure
//! goes, it steps back down.
//!
//! Why steps rather than one big bucket: a tenant that bursts gets more room
//! gradually (each step lasts `step_ms`), so a short spike is absorbed by the
//! ordinary refilling bucket, and only sustained pressure climbs the ladder;
//! the other tenants of the node see the group's rate rise in bounded steps,
//! not all at once. The credits bound how long a group can stay above base.

use std::time::Duration;

pub use tessera_api::qos::StepBurst;

/// Where a group is on its ladder.
#[derive(Clone, Debug, PartialEq)]
pub struct StepState {
    level: u32,
    credits_ms: f64,
    on_step: Duration,
}

impl StepState {
    /// A new group starts at base with full credits.
    pub fn new(cfg: &StepBurst) -> Self {
        StepState {
            level: 0,
            credits_ms: cfg.credit_ms as f64,
            on_step: Duration::ZERO,
        }
    }

    pub fn level(&self) -> u32 {
        self.level
    }

    pub fn credits_ms(&self) -> f64 {
        self.credits_ms
    }

    /// Account `elapsed` during which the group used `used` times its base
    /// rate (1.0 = exactly the base) and was (`throttled`) or was not held at
    /// its current limit. Returns the new level when it changed.
    pub fn observe(
        &mut self,
        cfg: &StepBurst,
        elapsed: Duration,
        used: f64,
        throttled: bool,
    ) -> Option<u32> {
        let ms = elapsed.as_secs_f64() * 1000.0;
        // Below base earns credit, above base spends it.
        self.credits_ms = (self.credits_ms + (1.0 - used) * ms).clamp(0.0, cfg.credit_ms as f64);
        let before = self.level;
        if self.credits_ms <= 0.0 {
            // Out of credit: straight back to base.
            self.level = 0;
            self.on_step = Duration::ZERO;
        } else {
            self.on_step += elapsed;
            if self.on_step >= Duration::from_millis(cfg.step_ms) {
                self.on_step = Duration::ZERO;
                if throttled && self.level < cfg.max_steps {
                    self.level += 1;
                } else if !throttled && self.level > 0 {
                    self.level -= 1;
                }
            }
        }
        (self.level != before).then_some(self.level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::qos::QosLimits;

    fn cfg() -> StepBurst {
        StepBurst {
            step_pct: 50,
            max_steps: 2,
            step_ms: 100,
            credit_ms: 1000,
        }
    }

    #[test]
    fn climbs_under_pressure_and_descends_without() {
        let c = cfg();
        let mut s = StepState::new(&c);
        let tick = Duration::from_millis(50);
        let mut levels = Vec::new();
        for _ in 0..8 {
            // Saturated at the current limit: using 1 + 0.5 * level of base.
            let used = 1.0 + 0.5 * f64::from(s.level());
            s.observe(&c, tick, used, true);
            levels.push(s.level());
        }
        assert_eq!(levels, [0, 1, 1, 2, 2, 2, 2, 2]);
        for _ in 0..4 {
            s.observe(&c, tick, 0.5, false);
        }
        assert_eq!(s.level(), 0);
    }

    #[test]
    fn credits_bound_the_time_above_base() {
        let c = cfg();
        let mut s = StepState::new(&c);
        let tick = Duration::from_millis(10);
        let mut above_ms = 0.0;
        for _ in 0..1000 {
            let used = 1.0 + 0.5 * f64::from(s.level());
            above_ms += (used - 1.0) * 10.0;
            s.observe(&c, tick, used, true);
        }
        // 1000 ms of credit, spent at up to 1x base above base: the extra
        // work stays within the credit (plus one tick of overshoot).
        assert!(above_ms <= 1000.0 + 10.0, "{above_ms}");
        assert!(above_ms >= 900.0, "the credit is used: {above_ms}");
        // Idle time earns it back.
        for _ in 0..200 {
            s.observe(&c, tick, 0.0, false);
        }
        assert_eq!(s.credits_ms(), 1000.0);
    }

    #[test]
    fn scaled_limits() {
        let base = QosLimits {
            iops: Some(1000),
            write_bps: Some(1 << 20),
            burst_ms: Some(7),
            ..Default::default()
        };
        let l = cfg().scaled(&base, 2);
        assert_eq!(l.iops, Some(2000));
        assert_eq!(l.write_bps, Some(2 << 20));
        assert_eq!(l.burst_ms, Some(7));
        assert_eq!(l.read_iops, None);
        assert!(cfg().validate().is_ok());
        assert!(StepBurst {
            step_pct: 0,
            ..cfg()
        }
        .validate()
        .is_err());
    }
}
