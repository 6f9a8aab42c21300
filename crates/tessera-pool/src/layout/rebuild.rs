//! Rebuild: a failed or replacement device becomes a write-only member, is filled from
//! the healthy copies (or parity), then becomes readable.

use std::io;
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};
use tessera_io::cast::usize_of;

use super::{error_reason, FailReason, Layout, LayoutError};

impl Layout {
    /// Start rebuilding device `d` (failed, or a replacement): it becomes a write-only
    /// member. Its failed bit is cleared in memory only; the labels keep it failed until
    /// `finish_rebuild`, so a restart never reads it.
    pub fn start_rebuild(&self, d: usize) -> Result<(), LayoutError> {
        if !self.kind.is_redundant() {
            return Err(LayoutError::NotRedundant);
        }
        if d >= self.devices.len() {
            return Err(LayoutError::NoDevice(d));
        }
        let bit = 1u64 << d;
        if self.health.rebuilding.load(SeqCst) & bit != 0 {
            return Err(LayoutError::AlreadyRebuilding(d));
        }
        if let Some(p) = &self.parity {
            if (self.unreadable() | bit).count_ones() as usize > p.m {
                return Err(LayoutError::TooManyUnreadable(d));
            }
        } else {
            let first = d - d % self.copies as usize;
            if !self.set_of(first).any(|o| o != d && self.is_readable(o)) {
                return Err(LayoutError::NoHealthyCopy(d));
            }
        }
        // Writes from now on reach the device; then it stops being failed.
        self.health.rebuilding.fetch_or(bit, SeqCst);
        self.health.failed.fetch_and(!bit, SeqCst);
        self.health.fail_reason[d].store(0, Relaxed);
        Ok(())
    }

    /// The device is complete: it becomes readable. The caller persists the labels.
    pub fn finish_rebuild(&self, d: usize) {
        self.health.rebuilding.fetch_and(!(1u64 << d), SeqCst);
    }

    /// Rebuild the part of the rebuilding device `d` that lies in pool range
    /// `[offset, offset+len)`, a range of free space. Parity layouts take free space as
    /// zero (a unit handed out is not zeroed again, and a read-modify-write computes
    /// parity from what the row holds), so `d`'s part of it is zero-filled
    /// (`parity_rebuild_zero`); the caller keeps the range free meanwhile. Mirrors:
    /// nothing, since they zero a unit when they hand it out. Returns bytes written.
    pub fn rebuild_free_range(&self, d: usize, offset: u64, len: u64) -> io::Result<u64> {
        self.check(offset, len)?;
        if self.parity.is_none() || len == 0 {
            return Ok(0);
        }
        self.parity_rebuild_zero(d, offset, len)
    }

    /// Copy pool range `[offset, offset+len)` onto the rebuilding device `d` from a
    /// readable copy of its mirror set, so that no concurrent client write is lost:
    /// writes already in flight are waited for, and the copy is redone when a write to
    /// the range started meanwhile. `buf` must hold `len` bytes. Ranges of other mirror
    /// sets (raid10) are skipped. Returns the bytes written to `d`.
    pub fn rebuild_range(&self, d: usize, offset: u64, buf: &mut [u8]) -> io::Result<u64> {
        let len = buf.len() as u64;
        self.check(offset, len)?;
        if self.parity.is_some() {
            // Rows are locked while rebuilt: no epoch protocol needed.
            return if len == 0 {
                Ok(0)
            } else {
                self.parity_rebuild_range(d, offset, len)
            };
        }
        let first = d - d % self.copies as usize;
        self.copy.quiet_range(offset, len, || {
            let mut copied = 0;
            for p in self.pieces(offset, len) {
                if p.dev != first {
                    continue;
                }
                if self.health.rebuilding.load(SeqCst) & (1 << d) == 0 {
                    return Err(io::Error::other(format!(
                        "device {d} failed during the rebuild"
                    )));
                }
                let r = usize_of(p.range_offset)..usize_of(p.range_offset + p.len);
                let b = &mut buf[r];
                let mut done = false;
                for s in self.set_of(first) {
                    if s == d || !self.is_readable(s) {
                        continue;
                    }
                    match self.devices[s].read_at(p.dev_offset, b) {
                        Ok(()) => {
                            done = true;
                            break;
                        }
                        Err(e) => self.mark_failed(s, error_reason(&e, FailReason::Read)),
                    }
                }
                if !done {
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                if let Err(e) = self.devices[d].write_at(p.dev_offset, b) {
                    self.mark_failed(d, FailReason::Write);
                    return Err(e);
                }
                copied += p.len;
            }
            Ok(copied)
        })
    }
}
