//! `/v1/groups` (QoS groups) and `/v1/background` (background classes).

use std::collections::BTreeMap;

use crate::qos::{BackgroundLimits, QosLimits, StepBurst};
use serde::{Deserialize, Serialize};

/// A QoS group (`GET /v1/groups/NAME`, entries of `GET /v1/groups`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupInfo {
    pub name: String,
    /// The base limits the members share.
    pub limits: QosLimits,
    pub step: Option<StepBurst>,
    pub members: Vec<String>,
    /// Current step of the stepped burst.
    pub level: Option<u32>,
    pub credits_ms: Option<f64>,
    /// The limits in force now (base scaled by the level).
    pub effective: QosLimits,
}

/// `PUT /v1/groups/NAME`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutGroup {
    #[serde(default)]
    pub limits: QosLimits,
    #[serde(default)]
    pub step: Option<StepBurst>,
}

/// `GET /v1/background`: every class's limits, by class name.
pub type BackgroundList = BTreeMap<String, BackgroundLimits>;
