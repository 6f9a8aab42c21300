//! Pools on RAM devices, and a node started in process, for the services' unit tests.

use std::sync::Arc;

use tessera_device::{BlockDevice, RamDevice};
use tessera_pool::{LayoutKind, Pool, PoolOptions};

/// Bytes of each RAM device.
pub const DEV_SIZE: u64 = 16 << 20;
/// The pools' unit size.
pub const UNIT: u64 = 64 << 10;

/// Pool `name` of `layout` on `devices` RAM devices, with the devices (to write under
/// the pool).
pub fn ram_pool(
    name: &str,
    layout: LayoutKind,
    devices: usize,
) -> (Arc<Pool>, Vec<Arc<RamDevice>>) {
    let ram: Vec<Arc<RamDevice>> = (0..devices)
        .map(|_| RamDevice::new(DEV_SIZE).unwrap())
        .collect();
    let devs = ram
        .iter()
        .map(|r| r.clone() as Arc<dyn BlockDevice>)
        .collect();
    let opts = PoolOptions {
        layout,
        unit_size: UNIT,
        ..PoolOptions::default()
    };
    (Arc::new(Pool::create(name, devs, opts).unwrap()), ram)
}

/// A node started in process on data directory `dir`, with one reactor core, no pool and
/// nothing listening (the listeners are started by `tessera run`, not by the node): for
/// the operations that go through `Node` and its services together.
pub fn test_node(dir: &std::path::Path) -> Arc<crate::Node> {
    start_node(test_config(dir, 1))
}

/// The configuration of a test node on data directory `dir` with `cores` reactor cores
/// (not pinned: tests share the machine's cores), named `test-node`.
pub fn test_config(dir: &std::path::Path, cores: usize) -> crate::config::NodeConfig {
    crate::config::NodeConfig {
        data_dir: dir.to_path_buf(),
        cores,
        pin_cores: false,
        name: Some("test-node".into()),
        ..crate::config::NodeConfig::default()
    }
}

/// A node started in process with `cfg`, its data directory locked first as `tessera
/// run` does.
pub fn start_node(cfg: crate::config::NodeConfig) -> Arc<crate::Node> {
    let dir = cfg.data_dir.display().to_string();
    let lock = crate::datadir::DataDirLock::acquire(&cfg)
        .unwrap_or_else(|e| panic!("cannot lock the test node's data directory {dir}: {e}"));
    crate::Node::start(cfg, lock)
        .unwrap_or_else(|e| panic!("the test node on {dir} did not start: {e}"))
}
