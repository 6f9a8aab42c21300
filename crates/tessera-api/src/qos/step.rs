//! The shape of a group's stepped burst (a "ladder"); `tessera_qos::StepState` climbs it.

use serde::{Deserialize, Serialize};

use crate::Invalid;

use super::QosLimits;

/// The ladder's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StepBurst {
    /// Each step adds this percentage of the base rates.
    pub step_pct: u32,
    /// Highest step.
    pub max_steps: u32,
    /// Time spent on a step before climbing (or descending) one more.
    pub step_ms: u64,
    /// Credit cap, in milliseconds of the base rate: a group idle long enough
    /// may run `credit_ms` worth of base-rate work above its base.
    pub credit_ms: u64,
}

impl StepBurst {
    pub fn validate(&self) -> Result<(), Invalid> {
        let range = |field, value: u64, min, max| {
            if (min..=max).contains(&value) {
                Ok(())
            } else {
                Err(Invalid::OutsideRange {
                    field,
                    value,
                    min,
                    max,
                })
            }
        };
        range("step_pct", u64::from(self.step_pct), 1, 1000)?;
        range("max_steps", u64::from(self.max_steps), 1, 100)?;
        range("step_ms", self.step_ms, 10, 3_600_000)?;
        if self.credit_ms > 86_400_000 {
            return Err(Invalid::CreditAboveDay(self.credit_ms));
        }
        Ok(())
    }

    /// The limits at `level`: every rate of `base` raised by
    /// `level * step_pct` percent (burst settings unchanged).
    pub fn scaled(&self, base: &QosLimits, level: u32) -> QosLimits {
        let pct = 100 + u64::from(level) * u64::from(self.step_pct);
        let up = |r: Option<u64>| {
            r.map(|r| u64::try_from(u128::from(r) * u128::from(pct) / 100).unwrap_or(u64::MAX))
        };
        QosLimits {
            iops: up(base.iops),
            read_iops: up(base.read_iops),
            write_iops: up(base.write_iops),
            bps: up(base.bps),
            read_bps: up(base.read_bps),
            write_bps: up(base.write_bps),
            ..base.clone()
        }
    }
}
