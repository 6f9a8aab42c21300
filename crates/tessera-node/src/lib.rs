//! A Tessera node: reactors on every core, pools from the registry, the management API
//! and the NBD and NVMe/TCP listeners, assembled from one configuration.

pub mod api;
pub mod background;
pub mod config;
pub mod datadir;
pub mod error;
pub mod groups;
pub mod iscsi;
mod job;
pub mod listener;
pub mod metrics;
pub mod metrics_http;
pub mod node;
pub mod nvmf;
pub mod proxy;
pub mod rebuild;
pub mod registry;
pub mod scrub;
pub mod target;

pub use config::NodeConfig;
pub use datadir::DataDirLock;
pub use node::Node;
