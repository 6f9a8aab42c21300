//! `/v1/exports`: NBD exports of volumes.

use serde::{Deserialize, Serialize};

/// An NBD export (`GET /v1/exports` entries, `POST /v1/exports` reply).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ExportInfo {
    pub name: String,
    /// The exported volume (absent if it is gone).
    pub volume: Option<String>,
    pub read_only: bool,
    pub size: Option<u64>,
    pub connections: Option<usize>,
    /// `nbd://HOST:PORT/NAME` for every NBD TCP listener (`nbds://` when TLS is required).
    pub uris: Vec<String>,
    /// The export's own NBD TLS setting (`null`: the node's default, `[nbd.tls] default`).
    #[serde(default)]
    pub tls: Option<TlsPolicy>,
    /// Only clients that start TLS (`NBD_OPT_STARTTLS`) may see and use the export.
    #[serde(default)]
    pub tls_required: bool,
}

/// Whether an NBD export may be used without TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TlsPolicy {
    /// Clients must start TLS first; before that the export is neither listed nor
    /// described.
    Required,
    /// Clients may use TLS or not.
    Optional,
}

impl TlsPolicy {
    pub fn is_required(self) -> bool {
        self == TlsPolicy::Required
    }
}

impl std::str::FromStr for TlsPolicy {
    type Err = crate::Invalid;
    fn from_str(s: &str) -> Result<Self, crate::Invalid> {
        match s {
            "required" => Ok(TlsPolicy::Required),
            "optional" => Ok(TlsPolicy::Optional),
            _ => Err(crate::Invalid::TlsPolicy(s.to_string())),
        }
    }
}

/// `POST /v1/exports`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateExport {
    pub name: String,
    pub volume: String,
    #[serde(default)]
    pub read_only: bool,
    /// NBD TLS policy; absent: the node's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsPolicy>,
}
