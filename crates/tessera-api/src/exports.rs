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
    /// `nbd://HOST:PORT/NAME` for every NBD TCP listener.
    pub uris: Vec<String>,
}

/// `POST /v1/exports`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreateExport {
    pub name: String,
    pub volume: String,
    #[serde(default)]
    pub read_only: bool,
}
