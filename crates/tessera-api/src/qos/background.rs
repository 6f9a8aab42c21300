//! A background class's settings (scrub, rebuild, resync): its rate limit and latency
//! target. The feedback controller that applies them is `tessera_qos::background`.

use serde::{Deserialize, Serialize};

use crate::Invalid;

/// A background class's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BackgroundLimits {
    /// Maximum bandwidth, bytes per second.
    pub bps: u64,
    /// Client p99 latency above which the class backs off, in microseconds.
    /// `None`: 1.5x the clients' p99 measured just before the job started
    /// (or [`DEFAULT_TARGET_US`] if clients were idle then).
    #[serde(default)]
    pub latency_target_us: Option<u64>,
    /// Floor of the backed-off rate, percent of `bps` (default 1).
    #[serde(default = "default_min_pct")]
    pub min_pct: u32,
}

fn default_min_pct() -> u32 {
    1
}

/// Target when neither configured nor measurable at the start.
pub const DEFAULT_TARGET_US: u64 = 2000;

impl BackgroundLimits {
    pub fn new(bps: u64) -> Self {
        BackgroundLimits {
            bps,
            latency_target_us: None,
            min_pct: default_min_pct(),
        }
    }

    pub fn validate(&self) -> Result<(), Invalid> {
        if self.bps < 4096 {
            return Err(Invalid::BandwidthBelow {
                field: "bps",
                value: self.bps,
                min: 4096,
            });
        }
        if self.min_pct == 0 || self.min_pct > 100 {
            return Err(Invalid::OutsideRange {
                field: "min_pct",
                value: u64::from(self.min_pct),
                min: 1,
                max: 100,
            });
        }
        if self.latency_target_us == Some(0) {
            return Err(Invalid::Zero {
                field: "latency_target_us",
            });
        }
        Ok(())
    }

    /// The latency target given the clients' p99 before the job started.
    pub fn target_us(&self, baseline_p99_us: Option<f64>) -> f64 {
        match (self.latency_target_us, baseline_p99_us) {
            (Some(t), _) => t as f64,
            (None, Some(b)) if b > 0.0 => b * 1.5,
            _ => DEFAULT_TARGET_US as f64,
        }
    }
}
