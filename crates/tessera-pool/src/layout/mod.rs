//! Layouts: how a pool's logical address space maps onto its devices.
//!
//! The mapping is pure arithmetic (power-of-two stripes use shifts and masks), so the
//! datapath pays a few instructions per request and keeps no per-request state: a request
//! that spans several devices is split, and the pieces share one join on the core.

mod copy_track;
mod geometry;
mod handle;
mod health;
mod journal_recovery;
pub(crate) mod kind;
pub mod parity;
pub(crate) mod parity_io;
mod parity_sync;
mod rebuild;
mod sync_io;

pub use crate::error::LayoutError;
pub(crate) use copy_track::CopyTracker;
pub use handle::LayoutHandle;
pub use health::DeviceHealth;
pub use kind::LayoutKind;

use std::io;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tessera_device::BlockDevice;
use tessera_io::IoOp;

/// Why a device was marked failed. Its byte is stored in the labels' `fail_reason`
/// (docs/format.md): the values are part of the on-disk format; 0 means none.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailReason {
    Read = 1,
    Write = 2,
    Gone = 3,
    Missing = 4,
    Timeout = 5,
}

impl FailReason {
    /// The byte stored in the labels.
    #[inline]
    pub fn byte(self) -> u8 {
        self as u8
    }

    /// A stored byte: `None` for 0 (no reason) or a byte no version writes.
    pub fn from_byte(b: u8) -> Option<FailReason> {
        Some(match b {
            1 => FailReason::Read,
            2 => FailReason::Write,
            3 => FailReason::Gone,
            4 => FailReason::Missing,
            5 => FailReason::Timeout,
            _ => return None,
        })
    }

    pub fn describe(self) -> &'static str {
        match self {
            FailReason::Read => "read error",
            FailReason::Write => "write error",
            FailReason::Gone => "device disappeared",
            FailReason::Missing => "missing at open (or failed before the restart)",
            FailReason::Timeout => "I/O timed out (device hung)",
        }
    }
}

/// The description of a stored reason byte ("" for none).
pub fn fail_reason_name(r: u8) -> &'static str {
    FailReason::from_byte(r).map_or("", FailReason::describe)
}

/// A redundant pool's device whose I/O has not completed for this long is marked failed
/// (the Linux NVMe driver's default I/O timeout).
pub const DEFAULT_DEVICE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Why a device failed, from a datapath operation's error result.
pub(crate) fn reason_of(op: &IoOp, res: i32) -> FailReason {
    if res == -libc::ENODEV {
        FailReason::Gone
    } else if matches!(op, IoOp::Read { .. }) {
        FailReason::Read
    } else {
        FailReason::Write
    }
}

/// Why a device failed, from a synchronous call's error: gone (ENODEV), else `other`.
pub(crate) fn error_reason(e: &io::Error, other: FailReason) -> FailReason {
    if e.raw_os_error() == Some(libc::ENODEV) {
        FailReason::Gone
    } else {
        other
    }
}

/// A pool's layout, in parts a reader can name:
/// - geometry (this file's fields and `geometry.rs`): how logical offsets map to devices;
/// - device health (`health.rs`): which devices are failed or being rebuilt, and why;
/// - copy tracking (`copy_track.rs`): the writes in flight while a rebuild or scrub copies;
/// - parity (`layout::parity`): row geometry, code, row locks and journal of parity layouts.
///
/// Rebuild (`rebuild.rs`), the synchronous face (`sync_io.rs`) and the per-core datapath
/// handle (`handle.rs`) are built on those.
pub struct Layout {
    pub kind: LayoutKind,
    pub devices: Vec<Arc<dyn BlockDevice>>,
    /// Bytes of each device's data area used by the layout.
    pub dev_data_len: Vec<u64>,
    /// Concat: logical start of each device's area (prefix sums).
    starts: Vec<u64>,
    /// Raid0: log2(stripe).
    stripe_shift: u32,
    pub size: u64,
    /// Mirrors: copies per set and number of sets (1 and n otherwise... see `new`).
    copies: u32,
    sets: u64,
    /// Which devices are failed or rebuilding (read per request).
    pub health: DeviceHealth,
    /// Writes in flight while a rebuild or scrub copies a range.
    pub(crate) copy: CopyTracker,
    /// Parity layouts: geometry, code, row locks and journal (crate::layout::parity).
    pub(crate) parity: Option<crate::layout::parity::Parity>,
    /// `PoolTuning::journal_flush` (set once at open; read by parity writes).
    journal_flush: AtomicBool,
    /// Per device slot: what the layout sent it, and its errors (crate::devstats).
    pub device_stats: Vec<Arc<crate::devstats::DeviceStats>>,
}

/// A contiguous piece of a logical range on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub dev: usize,
    pub dev_offset: u64,
    pub len: u64,
    /// Offset of this piece within the original range.
    pub range_offset: u64,
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data patterns wrap on purpose
mod tests {
    use super::*;
    use crate::format::DEV_DATA_START;
    use std::sync::atomic::Ordering::SeqCst;
    use tessera_device::RamDevice;

    fn rams(n: usize, size: u64) -> Vec<Arc<dyn BlockDevice>> {
        (0..n)
            .map(|_| RamDevice::new(size).unwrap() as Arc<dyn BlockDevice>)
            .collect()
    }

    #[test]
    fn fail_reason_bytes_are_the_label_format() {
        // docs/format.md: the label's fail_reason bytes.
        let all = [
            (FailReason::Read, 1),
            (FailReason::Write, 2),
            (FailReason::Gone, 3),
            (FailReason::Missing, 4),
            (FailReason::Timeout, 5),
        ];
        for (r, b) in all {
            assert_eq!(r.byte(), b);
            assert_eq!(FailReason::from_byte(b), Some(r));
        }
        assert_eq!(FailReason::from_byte(0), None);
        assert_eq!(fail_reason_name(0), "");
    }

    #[test]
    fn raid0_pieces_cover_range_and_rotate_devices() {
        let l = Layout::new(LayoutKind::Raid0 { stripe: 65536 }, rams(4, 5 << 20)).unwrap();
        assert_eq!(l.size, 4 * (4 << 20));
        let ps: Vec<_> = l.pieces(65536 - 512, 3 * 65536).collect();
        assert_eq!(ps.len(), 4);
        assert_eq!(ps.iter().map(|p| p.len).sum::<u64>(), 3 * 65536);
        assert_eq!(ps[0].dev, 0);
        assert_eq!(ps[1].dev, 1);
        assert_eq!(ps[1].dev_offset, DEV_DATA_START);
        assert_eq!(l.piece_count(65536 - 512, 3 * 65536), 4);
    }

    /// A writer hammers a small range while it is rebuilt over and over: after every
    /// pass the rebuilt copy equals the healthy one (no write lost to a stale copy).
    #[test]
    fn rebuild_copy_never_goes_stale_under_concurrent_writes() {
        let l = Arc::new(Layout::new(LayoutKind::Raid1 { copies: 2 }, rams(2, 2 << 20)).unwrap());
        let span = 32 << 10;
        for pass in 0..200u64 {
            l.mark_failed(1, FailReason::Write);
            l.start_rebuild(1).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let w = {
                let (l, stop) = (l.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while !stop.load(SeqCst) {
                        let b = vec![(pass * 31 + i) as u8; 4096];
                        l.write_at((i % 8) * 4096, &b).unwrap();
                        i += 1;
                    }
                })
            };
            let mut buf = vec![0u8; span as usize];
            for _ in 0..4 {
                l.rebuild_range(1, 0, &mut buf).unwrap();
            }
            stop.store(true, SeqCst);
            w.join().unwrap();
            l.finish_rebuild(1);
            let (mut a, mut b) = (vec![0u8; span as usize], vec![0u8; span as usize]);
            l.devices[0].read_at(DEV_DATA_START, &mut a).unwrap();
            l.devices[1].read_at(DEV_DATA_START, &mut b).unwrap();
            assert!(a == b, "pass {pass}: the rebuilt copy is stale");
        }
    }

    #[test]
    fn sync_round_trip_across_devices() {
        for kind in [LayoutKind::Concat, LayoutKind::Raid0 { stripe: 4096 }] {
            let l = Layout::new(kind, rams(3, 2 << 20)).unwrap();
            let data: Vec<u8> = (0..l.size as usize).map(|i| (i * 7 % 251) as u8).collect();
            l.write_at(0, &data).unwrap();
            let mut back = vec![0u8; data.len()];
            l.read_at(0, &mut back).unwrap();
            assert_eq!(back, data);
        }
    }
}
