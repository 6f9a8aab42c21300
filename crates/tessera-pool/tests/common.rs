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
