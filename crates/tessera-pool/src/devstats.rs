//! Per-device I/O figures of a layout: what the pool sent to each device slot.
//!
//! Each per-core device handle counts into a block of its own ([`DeviceCounters`]),
//! written only by that core with plain loads and stores (no atomic read-modify-write on
//! the datapath); the slot's [`DeviceStats`] sums the blocks of live handles and keeps the
//! figures of dropped ones. Errors are counted where the layout learns of them
//! (`Layout::mark_failed`), which is the error path only.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tessera_io::counters::{CounterRegistry, Counters};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

/// One per-core handle's counts of the operations submitted to a device. Aligned to a
/// cache line so that handles of different cores never write the same line.
#[derive(Default)]
#[repr(align(64))]
pub struct DeviceCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    discards: AtomicU64,
    write_zeroes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
}

/// Cumulative figures of one device slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceTotals {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// I/O errors the layout saw from the device (redundant layouts; concat and raid0
    /// pass a device's errors to the volume without looking at them).
    pub errors: u64,
}

impl DeviceCounters {
    #[inline]
    fn count(&self, op: &IoOp) {
        let bump = |a: &AtomicU64, by: u64| a.store(a.load(Relaxed).wrapping_add(by), Relaxed);
        match *op {
            IoOp::Read { len, .. } => {
                bump(&self.reads, 1);
                bump(&self.read_bytes, u64::from(len));
            }
            IoOp::Write { len, .. } => {
                bump(&self.writes, 1);
                bump(&self.write_bytes, u64::from(len));
            }
            IoOp::Flush => bump(&self.flushes, 1),
            IoOp::Discard { .. } => bump(&self.discards, 1),
            IoOp::WriteZeroes { .. } => bump(&self.write_zeroes, 1),
        }
    }
}

impl Counters for DeviceCounters {
    type Totals = DeviceTotals;

    fn add_to(&self, t: &mut DeviceTotals) {
        t.reads += self.reads.load(Relaxed);
        t.writes += self.writes.load(Relaxed);
        t.flushes += self.flushes.load(Relaxed);
        t.discards += self.discards.load(Relaxed);
        t.write_zeroes += self.write_zeroes.load(Relaxed);
        t.read_bytes += self.read_bytes.load(Relaxed);
        t.write_bytes += self.write_bytes.load(Relaxed);
    }
}

/// The counters of one device slot's per-core handles.
#[derive(Default)]
pub struct DeviceStats {
    handles: CounterRegistry<DeviceCounters>,
    errors: AtomicU64,
}

impl DeviceStats {
    /// An error from the device (error path only).
    pub(crate) fn count_error(&self) {
        self.errors.fetch_add(1, Relaxed);
    }

    pub fn totals(&self) -> DeviceTotals {
        let mut t = self.handles.snapshot();
        t.errors = self.errors.load(Relaxed);
        t
    }
}

/// A per-core device handle that counts what it submits; the layout's face of a device.
pub struct DeviceHandle {
    inner: Box<dyn IoHandle>,
    counters: Arc<DeviceCounters>,
    stats: Arc<DeviceStats>,
}

impl DeviceHandle {
    pub(crate) fn new(inner: Box<dyn IoHandle>, stats: &Arc<DeviceStats>) -> DeviceHandle {
        DeviceHandle {
            inner,
            counters: stats.handles.register(),
            stats: stats.clone(),
        }
    }

    /// Count `op`, then [`IoHandle::submit`] it to the device.
    ///
    /// # Safety
    /// As [`IoHandle::submit`].
    #[inline]
    pub unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        self.counters.count(&op);
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { self.inner.submit(io, op, tag) }
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        self.stats.handles.unregister(&self.counters);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_device::{BlockDevice, NullDevice};

    #[test]
    fn dropped_handles_keep_counting() {
        let stats = Arc::new(DeviceStats::default());
        let dev: Arc<dyn BlockDevice> = NullDevice::new(1 << 20);
        let mut io = CoreIo::new(0, 8, None).unwrap();
        let mut buf = vec![0u8; 4096];
        let mut a = DeviceHandle::new(dev.clone().open_handle(), &stats);
        let mut b = DeviceHandle::new(dev.open_handle(), &stats);
        let read = IoOp::Read {
            offset: 0,
            len: 4096,
            buf: buf.as_mut_ptr(),
        };
        // SAFETY: the buffer outlives the operations (a null device completes inline).
        unsafe {
            a.submit(&mut io, read, Tag::task(0, 0));
            b.submit(&mut io, IoOp::Flush, Tag::task(0, 1));
        }
        drop(a);
        stats.count_error();
        let t = stats.totals();
        assert_eq!(
            (t.reads, t.read_bytes, t.flushes, t.writes),
            (1, 4096, 1, 0)
        );
        assert_eq!(t.errors, 1);
    }
}
