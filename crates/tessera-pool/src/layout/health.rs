//! Device health: which devices of a layout are failed or being rebuilt, why, and the
//! watchdog that fails a device whose I/O hangs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use tessera_io::sync::MutexExt;

use crate::devstats::DeviceHandle;

use super::{FailReason, Layout};

/// Failure and rebuild state of a layout's devices. The bit masks are read per request
/// and changed lock free; the commit thread persists `failed` into the labels.
pub struct DeviceHealth {
    /// Bit d set: device d is failed and is neither read nor written. Set with
    /// `fetch_or` on an error.
    pub failed: AtomicU64,
    /// Failure bits already recorded durably in the labels.
    pub failed_durable: AtomicU64,
    /// True while a pool's commit thread records failures into the labels: a parity
    /// row write then waits for the record of every failed device before it goes in
    /// place and before it completes (`Layout::failure_unrecorded`). False for a layout
    /// with no pool around it (tests, tools) and once the thread stopped or could not
    /// write any label.
    pub recorder: AtomicBool,
    /// Per device: why it failed (`FailReason::byte`, 0 for none).
    pub fail_reason: Vec<AtomicU8>,
    /// Bit d set: device d is being rebuilt — a write-only member: writes go to it,
    /// reads never do (docs/architecture.md "Rebuild").
    pub rebuilding: AtomicU64,
    /// Bit d set: device d keeps data across a power loss (not RAM): parity journal
    /// records written to it are flushed before the row is written in place.
    pub(crate) nonvolatile: u64,
    /// Redundant layouts: marks a device whose I/O hangs failed (set before handles are
    /// opened; see `Layout::watch_devices`).
    watchdog: std::sync::Mutex<Option<Arc<tessera_device::Watchdog>>>,
}

impl DeviceHealth {
    /// All devices healthy; `nonvolatile` as for the field.
    pub(crate) fn new(devices: usize, nonvolatile: u64) -> DeviceHealth {
        DeviceHealth {
            failed: AtomicU64::new(0),
            failed_durable: AtomicU64::new(0),
            recorder: AtomicBool::new(false),
            fail_reason: (0..devices).map(|_| AtomicU8::new(0)).collect(),
            rebuilding: AtomicU64::new(0),
            nonvolatile,
            watchdog: std::sync::Mutex::new(None),
        }
    }
}

impl Layout {
    /// Mark device `d` failed for `reason` (first reason wins) after an error from it,
    /// which is counted. Lock free.
    pub fn mark_failed(&self, d: usize, reason: FailReason) {
        self.device_stats[d].count_error();
        self.restore_failed(d, reason);
    }

    /// Mark device `d` failed for `reason` (first reason wins) without an error of this
    /// run: its label recorded it failed, or it is missing at open.
    pub fn restore_failed(&self, d: usize, reason: FailReason) {
        let bit = 1u64 << d;
        self.health.rebuilding.fetch_and(!bit, SeqCst);
        if self.health.failed.fetch_or(bit, Relaxed) & bit == 0 {
            self.health.fail_reason[d].store(reason.byte(), Relaxed);
            tracing::error!(
                device = %self.devices[d].describe(),
                slot = d,
                reason = %reason.describe(),
                "device marked failed"
            );
        }
    }

    #[inline]
    pub fn is_failed(&self, d: usize) -> bool {
        self.health.failed.load(Relaxed) & (1 << d) != 0
    }

    /// Devices that must not be read: failed ones and ones being rebuilt.
    #[inline]
    pub(crate) fn unreadable(&self) -> u64 {
        self.health.failed.load(Relaxed) | self.health.rebuilding.load(Relaxed)
    }

    #[inline]
    pub(crate) fn is_readable(&self, d: usize) -> bool {
        self.unreadable() & (1 << d) == 0
    }

    /// A device is failed in memory and its labels do not say so yet, while a commit
    /// thread is there to record it. A parity row write neither goes in place nor
    /// completes (nor releases its journal record) before the record is durable: a
    /// power loss would otherwise bring the device back as a healthy member holding the
    /// row's old chunk under the new parity, and a later reconstruction of any chunk of
    /// that row would decode garbage (md holds writes on a pending superblock change for
    /// the same reason).
    #[inline]
    pub(crate) fn failure_unrecorded(&self) -> bool {
        let h = &self.health;
        h.failed.load(Relaxed) & !h.failed_durable.load(Relaxed) != 0 && h.recorder.load(Relaxed)
    }

    #[inline]
    pub(crate) fn failed_bits(&self) -> u64 {
        self.health.failed.load(Relaxed)
    }

    #[inline]
    pub(crate) fn rebuilding_bits(&self) -> u64 {
        self.health.rebuilding.load(Relaxed)
    }

    /// True when some mirror set (or, without mirrors, some device) has no healthy copy.
    pub fn has_lost_data(&self) -> bool {
        let f = self.unreadable();
        if let Some(p) = &self.parity {
            return f.count_ones() as usize > p.m;
        }
        (0..self.devices.len())
            .step_by(self.copies as usize)
            .any(|s| self.set_of(s).all(|d| f & (1 << d) != 0))
    }

    /// Devices whose journal records must be flushed before in-place writes (none when
    /// the pool's `PoolTuning::journal_flush` is off).
    #[inline]
    pub(crate) fn journal_flush_devs(&self) -> u64 {
        if self.journal_flush.load(Relaxed) {
            self.health.nonvolatile
        } else {
            0
        }
    }

    pub fn is_volatile(&self) -> bool {
        self.devices.iter().any(|d| d.is_volatile())
    }

    /// Apply the pool's tuning (`PoolTuning`'s fields): journal flushes, and the device
    /// watchdog of redundant layouts. Once, right after `Layout::new`.
    pub(crate) fn apply_tuning(
        self: &Arc<Self>,
        journal_flush: bool,
        device_timeout: std::time::Duration,
    ) {
        self.journal_flush.store(journal_flush, Relaxed);
        self.watch_devices(device_timeout);
    }

    pub fn watch_devices(self: &Arc<Self>, timeout: std::time::Duration) {
        if !self.kind.is_redundant() {
            return;
        }
        let weak = Arc::downgrade(self);
        let dog = tessera_device::Watchdog::new(
            timeout,
            Arc::new(move |d| {
                if let Some(l) = weak.upgrade() {
                    l.mark_failed(d, FailReason::Timeout);
                }
            }),
        );
        *self.health.watchdog.locked() = Some(dog);
    }

    /// Per-core handles of every device (behind the watchdog when one is set).
    pub(crate) fn device_handles(&self) -> Vec<DeviceHandle> {
        let dog = self.health.watchdog.locked().clone();
        self.devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let h = d.clone().open_handle();
                let h = match &dog {
                    Some(w) => w.wrap(i, h),
                    None => h,
                };
                DeviceHandle::new(h, &self.device_stats[i])
            })
            .collect()
    }
}
