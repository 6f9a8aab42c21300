//! QoS settings as the API carries them: a volume's limits, a group's stepped burst, a
//! background class's limits. The mechanism that enforces them is `tessera-qos`, which
//! takes these types from here.

mod background;
mod limits;
mod step;

pub use background::{BackgroundLimits, DEFAULT_TARGET_US};
pub use limits::{
    QosLimits, DEFAULT_BURST_MS, DEFAULT_ONE_TIME_BURST_MS, DEFAULT_WEIGHT, MAX_BURST_MS,
    MAX_ONE_TIME_BURST_MS, MAX_WEIGHT,
};
pub use step::StepBurst;
