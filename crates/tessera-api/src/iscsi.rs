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
    /// Initiator names allowed to log in; empty: any initiator.
    #[serde(default)]
    pub allowed_initiators: Vec<String>,
    /// CHAP required to log in (user names only; secrets are never shown); absent:
    /// no CHAP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap: Option<IscsiChapInfo>,
}

/// `POST /v1/iscsi/targets`: a target whose LUNs 0, 1, ... are `volumes` in order, and
/// who may log in to it (absent: any initiator, no CHAP).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
// A misspelled key ("chapp") must be an error, not a target without CHAP.
#[serde(deny_unknown_fields)]
pub struct CreateIscsiTarget {
    pub iqn: String,
    pub volumes: Vec<String>,
    /// Initiator names (IQNs) allowed to log in; empty or absent: any initiator.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_initiators: Vec<String>,
    /// When set, initiators must authenticate with CHAP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap: Option<IscsiChap>,
}

/// CHAP settings of a target (RFC 7143 §12.1.3, MD5). Secrets are at least 12 bytes;
/// they are kept in the node's iscsi.json (mode 0600) and never returned by the API.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
// A misspelled key ("chapp") must be an error, not a target without CHAP.
#[serde(deny_unknown_fields)]
pub struct IscsiChap {
    /// The CHAP name the initiator must log in with (CHAP_N).
    pub user: String,
    /// The initiator's secret (12 to 256 bytes).
    pub secret: String,
    /// For mutual CHAP: the name the target answers with when the initiator challenges
    /// it (needs `mutual_secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_user: Option<String>,
    /// For mutual CHAP: the target's secret (12 to 256 bytes, not the initiator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_secret: Option<String>,
}

impl std::fmt::Debug for IscsiChap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Whoever logs a request must not log its secrets.
        let redact = |s: &Option<String>| s.as_ref().map(|_| "<redacted>");
        f.debug_struct("IscsiChap")
            .field("user", &self.user)
            .field("secret", &"<redacted>")
            .field("mutual_user", &self.mutual_user)
            .field("mutual_secret", &redact(&self.mutual_secret))
            .finish()
    }
}

/// `PUT /v1/iscsi/targets/IQN/auth`: who may log in to a target, replacing what was
/// set (a field left out is cleared: no `chap` means no CHAP).
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize, utoipa::ToSchema)]
// A misspelled key ("chapp") must be an error, not a target without CHAP.
#[serde(deny_unknown_fields)]
pub struct IscsiAuth {
    /// Initiator names (IQNs) allowed to log in; empty or absent: any initiator.
    #[serde(default)]
    pub allowed_initiators: Vec<String>,
    /// When set, initiators must authenticate with CHAP.
    #[serde(default)]
    pub chap: Option<IscsiChap>,
}

/// What a target's CHAP is set to, without its secrets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IscsiChapInfo {
    /// The CHAP name initiators log in with.
    pub user: String,
    /// The name the target answers mutual CHAP with; absent: one-way CHAP only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_user: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_misspelled_access_key_is_refused_not_ignored() {
        let ok = r#"{"iqn":"iqn.2026-11.io.x:t","volumes":["v"],"chap":{"user":"u","secret":"s"}}"#;
        assert!(serde_json::from_str::<CreateIscsiTarget>(ok).is_ok());
        for bad in [
            r#"{"iqn":"iqn.2026-11.io.x:t","volumes":["v"],"chapp":{"user":"u","secret":"s"}}"#,
            r#"{"iqn":"iqn.2026-11.io.x:t","volumes":["v"],"allowed_initiator":["iqn.x"]}"#,
            r#"{"iqn":"iqn.2026-11.io.x:t","volumes":["v"],"chap":{"user":"u","secret":"s","mutual_secrt":"m"}}"#,
        ] {
            assert!(
                serde_json::from_str::<CreateIscsiTarget>(bad).is_err(),
                "accepted: {bad}"
            );
        }
        assert!(serde_json::from_str::<IscsiAuth>(r#"{"chap_user":"u"}"#).is_err());
    }
}
