//! Helpers shared by the pool integration tests: the test kit's synchronous block I/O,
//! data and devices, and how the model tests make a pool's device fail.

// Test and benchmark code builds data patterns and sizes from its own constants: its
// truncating casts are bounded by them or wrap on purpose.
#![allow(clippy::cast_possible_truncation)]
#![allow(dead_code, unused_imports)]

pub use tessera_testkit::blockio::*;
pub use tessera_testkit::data::*;
pub use tessera_testkit::devices::*;

use tessera_device::FaultConfig;
use tessera_pool::format::DEV_DATA_START;

/// How a device fails in the model tests.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    Vanish,
    FailReads,
    FailWrites,
}

/// Make the device behind `c` fail as `f` (its data area; the label stays readable).
pub fn inject(c: &FaultConfig, f: Fault) {
    match f {
        Fault::Vanish => c.vanish(),
        Fault::FailReads => c.fail_reads(DEV_DATA_START, u64::MAX),
        Fault::FailWrites => c.fail_writes(DEV_DATA_START, u64::MAX),
    }
}

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tessera_device::RamDevice;
use tessera_io::CoreIo;
use tessera_pool::{LayoutKind, Pool, PoolOptions, Volume};

/// `n` RAM devices of `size` bytes.
pub fn ram_devices(n: usize, size: u64) -> Vec<Arc<RamDevice>> {
    (0..n).map(|_| RamDevice::new(size).unwrap()).collect()
}

/// A pool on RAM devices behind fault devices: the RAM to look at or overwrite under
/// the pool, the fault configs to fail a device with.
pub struct Rig {
    pub ram: Vec<Arc<RamDevice>>,
    pub cfgs: Vec<Arc<FaultConfig>>,
    pub pool: Arc<Pool>,
}

/// A new pool "p" of `kind` on `ndev` RAM devices of `dev_size` bytes, units of `unit`.
pub fn rig(kind: LayoutKind, ndev: usize, dev_size: u64, unit: u64) -> Rig {
    let ram = ram_devices(ndev, dev_size);
    let (devs, cfgs) = wrap(&ram);
    let pool = Pool::create(
        "p",
        devs,
        PoolOptions {
            layout: kind,
            unit_size: unit,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    Rig {
        ram,
        cfgs,
        pool: Arc::new(pool),
    }
}

/// Device `d` vanishes and a write of 256 KiB at the start of `v` (a whole row of every
/// device, whatever the rotation, so it reaches `d`) finds it gone: the pool marks it
/// failed. `model` gets the write.
pub fn fail_by_write(r: &Rig, io: &mut CoreIo, v: &Arc<Volume>, model: &mut [u8], d: usize) {
    r.cfgs[d].vanish();
    let mut h = v.open_handle();
    let data = pattern(0xfa11 + d as u64, 256 << 10);
    assert_eq!(write(io, &mut h, 0, &data), 0);
    model[..data.len()].copy_from_slice(&data);
    assert_eq!(flush(io, &mut h), 0);
    assert!(r.pool.core.layout.is_failed(d), "device {d} did not fail");
}

/// Rebuild device `d` of `pool` as the node's rebuild job does (`tessera-node`
/// rebuild.rs): every unit `rebuild_units` names is reconstructed or copied, every unit
/// `rebuild_free_units` names is handed to `rebuild_free_unit`, then the device is back.
pub fn rebuild_as_the_node_does(pool: &Pool, d: usize) -> tessera_pool::Result<()> {
    pool.start_rebuild(d)?;
    let mut buf = vec![0u8; 256 << 10];
    for u in pool.rebuild_units() {
        pool.rebuild_unit(d, u, &mut buf)?;
    }
    for u in pool.rebuild_free_units() {
        pool.rebuild_free_unit(d, u, &mut buf)?;
    }
    pool.finish_rebuild(d)
}

/// Device `d` of the rig comes back (the same device, or whatever its RAM now holds)
/// and is rebuilt as the node does; the pool is online after it.
pub fn rebuild(r: &Rig, d: usize) {
    r.cfgs[d].vanished.store(false, Relaxed);
    rebuild_as_the_node_does(&r.pool, d).unwrap();
    assert_eq!(r.pool.status().state, tessera_api::PoolState::Online);
}
