//! Block devices under Tessera's pools.
//!
//! Every device offers two faces:
//! - the datapath: a per-core [`IoHandle`] that submits through the core's io_uring
//!   (files, block devices) or completes inline (RAM, null);
//! - a synchronous, thread-safe face ([`BlockDevice::read_at`] and friends) used by the
//!   control plane and the metadata committer, which are not on a reactor core.
//!
//! [`Watchdog`] wraps datapath handles to report devices whose I/O hangs.
//! [`SwappableDevice`] lets a pool replace a device while it runs.

use std::io;
use std::sync::Arc;

pub use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

#[cfg(any(test, feature = "test-devices"))]
pub mod crash;
pub mod fault;
pub mod file;
pub mod null;
pub mod ram;
pub mod spec;
pub mod swap;
pub mod watchdog;

#[cfg(any(test, feature = "test-devices"))]
pub use crash::{CrashDevice, PowerSwitch};
pub use fault::{FaultConfig, FaultDevice, DEFAULT_STALL_MS};
pub use file::FileDevice;
pub use null::NullDevice;
pub use ram::RamDevice;
pub use spec::{format_size, open_device, parse_size, DeviceSpec};
pub use swap::SwappableDevice;
pub use watchdog::{HangCallback, Watchdog};

/// A block device shared between cores and the control plane.
pub trait BlockDevice: Send + Sync {
    /// How the device was named, e.g. `ram:1G` or `/var/lib/tessera/d0.img`.
    fn describe(&self) -> String;
    /// Capacity in bytes.
    fn size(&self) -> u64;
    /// Offsets, lengths and buffer addresses of datapath I/O must be multiples of this.
    fn alignment(&self) -> u32 {
        512
    }
    /// Contents do not survive a restart of the node (RAM, null).
    fn is_volatile(&self) -> bool {
        false
    }
    /// Synchronous read (any alignment; bounces internally when the device needs it).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Synchronous write (any alignment).
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Synchronously make `[offset, offset+len)` read as zeros.
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()>;
    /// Like [`BlockDevice::write_zeroes_at`], and later small writes into the range should
    /// be as cheap as rewrites: a file gets its zeroes written rather than a hole punched
    /// (a direct write smaller than the filesystem block into a hole allocates, and the
    /// filesystem serialises such writes). For zeroing ahead of time, off the datapath.
    fn fill_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes_at(offset, len)
    }
    /// Make all completed writes durable.
    fn sync(&self) -> io::Result<()>;
    /// A datapath handle for the calling core.
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle>;
}

/// Check a request against the device bounds; returns -EINVAL for the completion if out of range.
pub(crate) fn check_range(size: u64, offset: u64, len: u64) -> Result<(), i32> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(-libc::EINVAL),
    }
}

pub(crate) fn out_of_range(what: &str, offset: u64, len: u64, size: u64) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}: range {offset}+{len} is beyond the device size {size}"),
    )
}
