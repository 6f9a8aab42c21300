//! `/v1/iscsi`: iSCSI targets and their LUNs.

use serde::{Deserialize, Serialize};

/// A LUN of a target: LUN `lun` serves volume `volume`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IscsiLunInfo {
    pub lun: u32,
    pub volume: String,
}

/// A target (`GET /v1/iscsi/targets[/IQN]` and the reply of its creation).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IscsiTargetInfo {
    pub iqn: String,
    pub luns: Vec<IscsiLunInfo>,
    /// Whether the node's iSCSI listener offers it now (false when a LUN's volume is
    /// not online, e.g. its pool is offline, or when the node has no iSCSI listener).
    pub served: bool,
    /// The portals (`HOST:PORT`) it is reached at.
    pub portals: Vec<String>,
}

/// `POST /v1/iscsi/targets`: a target whose LUNs 0, 1, ... are `volumes` in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateIscsiTarget {
    pub iqn: String,
    pub volumes: Vec<String>,
}
