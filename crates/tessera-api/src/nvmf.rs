//! `/v1/nvmf`: NVMe/TCP subsystems, namespaces, hosts and controllers.

use serde::{Deserialize, Serialize};

/// A namespace of a subsystem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub volume: String,
}

/// A subsystem (`GET /v1/nvmf/subsystems[/NQN]` and the replies of its changes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SubsystemInfo {
    pub nqn: String,
    pub serial: String,
    pub allow_any_host: bool,
    pub hosts: Vec<String>,
    pub namespaces: Vec<NamespaceInfo>,
    /// Connected controllers.
    pub controllers: usize,
    /// The target's listen addresses.
    pub addresses: Vec<String>,
}

/// A connected controller (`GET /v1/nvmf/controllers`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ControllerInfo {
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
    pub queues: usize,
    pub kato_ms: u32,
}

/// `POST /v1/nvmf/subsystems`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateSubsystem {
    pub nqn: String,
    #[serde(default)]
    pub allow_any_host: bool,
    #[serde(default)]
    pub hosts: Option<Vec<String>>,
}

/// `PATCH /v1/nvmf/subsystems/NQN`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PatchSubsystem {
    pub allow_any_host: bool,
}

/// `POST /v1/nvmf/subsystems/NQN/namespaces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AddNamespace {
    pub volume: String,
    /// 0 or absent: the lowest free ID.
    #[serde(default)]
    pub nsid: u64,
}

/// `POST /v1/nvmf/subsystems/NQN/hosts`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AddHost {
    pub nqn: String,
}
