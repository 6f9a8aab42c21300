//! `/v1/nvmf`: NVMe/TCP subsystems, namespaces, hosts and controllers.

use std::collections::BTreeMap;

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
    /// Hosts that must authenticate in-band, and how: "dh-hmac-chap", or
    /// "dh-hmac-chap (bidirectional)" when the controller has a secret too. Secrets are
    /// never returned.
    #[serde(default)]
    pub host_auth: BTreeMap<String, String>,
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
// A misspelled key ("dhchap_secrett") must be an error, not a host without
// authentication.
#[serde(deny_unknown_fields)]
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

/// `POST /v1/nvmf/subsystems/NQN/hosts`. With `dhchap_secret` the host must
/// authenticate (DH-HMAC-CHAP) on every queue; adding a host again replaces its secrets.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
// A misspelled key ("dhchap_secrett") must be an error, not a host without
// authentication.
#[serde(deny_unknown_fields)]
pub struct AddHost {
    pub nqn: String,
    /// The host's secret, `DHHC-1:0X:<base64>:` (as `nvme gen-dhchap-key` prints it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_secret: Option<String>,
    /// The controller's secret, for bidirectional authentication (needs `dhchap_secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_secret: Option<String>,
    /// Preferred hash: sha256 (default), sha384, sha512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_hash: Option<String>,
    /// Required DH group: null, ffdhe2048 (default), ffdhe3072, ffdhe4096, ffdhe6144,
    /// ffdhe8192.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_dhgroup: Option<String>,
}

impl std::fmt::Debug for AddHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Whoever logs a request must not log its secrets.
        let redact = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("AddHost")
            .field("nqn", &self.nqn)
            .field("dhchap_secret", &redact(&self.dhchap_secret))
            .field("dhchap_ctrl_secret", &redact(&self.dhchap_ctrl_secret))
            .field("dhchap_hash", &self.dhchap_hash)
            .field("dhchap_dhgroup", &self.dhchap_dhgroup)
            .finish()
    }
}

/// `PUT /v1/nvmf/cluster-paths/VOLUME`: this node's path to a cluster volume.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PutClusterPath {
    /// This node owns the volume (the namespace is the local volume, ANA optimized);
    /// otherwise the namespace holds no data here (ANA inaccessible).
    pub owner: bool,
    /// The volume's size in bytes; required when not the owner.
    #[serde(default)]
    pub size: Option<u64>,
    /// Other nodes' NVMe/TCP I/O listeners (`HOST:PORT`) serving the volume, listed by
    /// this node's discovery service; left as they are when absent.
    #[serde(default)]
    pub other_paths: Option<Vec<String>>,
}

/// A cluster volume path of this node (`GET`/`PUT /v1/nvmf/cluster-paths`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterPathInfo {
    pub volume: String,
    pub nqn: String,
    pub owner: bool,
    pub size: u64,
    /// ANA state of namespace 1 through this node.
    pub ana_state: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelled_host_or_subsystem_key_is_refused_not_ignored() {
        let ok = r#"{"nqn":"nqn.2014-08.org.x:h","dhchap_secret":"DHHC-1:00:x:"}"#;
        assert!(serde_json::from_str::<AddHost>(ok).is_ok());
        let bad = r#"{"nqn":"nqn.2014-08.org.x:h","dhchap_secrett":"DHHC-1:00:x:"}"#;
        assert!(serde_json::from_str::<AddHost>(bad).is_err());
        let bad = r#"{"nqn":"nqn.2014-08.org.x:s","allow_any_hosts":true}"#;
        assert!(serde_json::from_str::<CreateSubsystem>(bad).is_err());
    }
}
