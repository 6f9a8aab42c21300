//! `GET /v1/status`: the node at a glance.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::exports::ExportInfo;
use crate::pools::PoolEntry;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeStatus {
    pub version: String,
    pub uptime_seconds: u64,
    /// Reactor cores.
    pub cores: usize,
    #[schema(value_type = String)]
    pub data_dir: PathBuf,
    #[schema(value_type = String)]
    pub api_socket: PathBuf,
    /// NBD TCP listeners (`nbd://HOST:PORT`).
    pub nbd: Vec<String>,
    /// Sums over the open pools.
    pub capacity: u64,
    pub allocated: u64,
    pub free: u64,
    pub pools: Vec<PoolEntry>,
    /// Number of volumes.
    pub volumes: usize,
    pub exports: Vec<ExportInfo>,
}
