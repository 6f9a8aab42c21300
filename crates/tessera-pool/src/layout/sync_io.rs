//! The synchronous face of a layout (`read_at`, `write_at`, zeroing, `sync`), used off
//! the reactors: by the commit, zeroer, rebuild and scrub threads and by tools.

use std::io;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tessera_io::cast::usize_of;

use tessera_device::BlockDevice;

use super::{error_reason, FailReason, Layout, Piece};

impl Layout {
    /// Run `io` on every healthy copy of a piece: the call succeeds when at least one
    /// copy did; a copy that fails is marked failed.
    fn each_copy(
        &self,
        p: &Piece,
        what: FailReason,
        mut io: impl FnMut(&Arc<dyn BlockDevice>) -> io::Result<()>,
    ) -> io::Result<()> {
        let mut last = None;
        let mut ok = false;
        for d in self.set_of(p.dev) {
            if self.is_failed(d) {
                continue;
            }
            match io(&self.devices[d]) {
                Ok(()) => ok |= self.is_readable(d),
                Err(e) => {
                    if self.copies > 1 {
                        self.mark_failed(d, error_reason(&e, what));
                    }
                    last = Some(e);
                }
            }
        }
        match (ok, last) {
            (true, _) => Ok(()),
            (false, Some(e)) => Err(e),
            (false, None) => Err(io::Error::from_raw_os_error(libc::EIO)),
        }
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        if self.parity.is_some() {
            return self.parity_read_at(offset, buf);
        }
        for p in self.pieces(offset, buf.len() as u64) {
            let r = usize_of(p.range_offset)..usize_of(p.range_offset + p.len);
            let mut done = false;
            let mut last = None;
            for d in self.set_of(p.dev) {
                if !self.is_readable(d) {
                    continue;
                }
                match self.devices[d].read_at(p.dev_offset, &mut buf[r.clone()]) {
                    Ok(()) => {
                        done = true;
                        break;
                    }
                    Err(e) => {
                        if self.copies > 1 {
                            self.mark_failed(d, error_reason(&e, FailReason::Read));
                        }
                        last = Some(e);
                    }
                }
            }
            if !done {
                return Err(last.unwrap_or_else(|| io::Error::from_raw_os_error(libc::EIO)));
            }
        }
        Ok(())
    }

    pub fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        if self.parity.is_some() {
            return self.parity_write_at(offset, buf);
        }
        let _w = self.sync_write(offset, buf.len() as u64);
        for p in self.pieces(offset, buf.len() as u64) {
            let r = usize_of(p.range_offset)..usize_of(p.range_offset + p.len);
            self.each_copy(&p, FailReason::Write, |d| {
                d.write_at(p.dev_offset, &buf[r.clone()])
            })?;
        }
        Ok(())
    }

    pub fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero_range(offset, len, false)
    }

    /// Zero a range that no client writes to yet (a pool being opened) and whose zeroing
    /// is redone if a crash interrupts it: parity layouts skip the stripe journal for the
    /// rows it covers whole (`parity_zero_unjournaled`); other layouts zero as
    /// `write_zeroes_at` does.
    pub fn zero_at_open(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        if self.parity.is_some() {
            return self.parity_zero_unjournaled(offset, len);
        }
        self.zero_range(offset, len, false)
    }

    /// Zero a range ahead of its use, so that small writes into it later cost what
    /// rewrites cost (see `BlockDevice::fill_zeroes_at`). Not for a reactor thread.
    pub fn fill_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.zero_range(offset, len, true)
    }

    fn zero_range(&self, offset: u64, len: u64, fill: bool) -> io::Result<()> {
        self.check(offset, len)?;
        if self.parity.is_some() {
            return self.parity_zero(offset, len);
        }
        let _w = self.sync_write(offset, len);
        for p in self.pieces(offset, len) {
            self.each_copy(&p, FailReason::Write, |d| match fill {
                true => d.fill_zeroes_at(p.dev_offset, p.len),
                false => d.write_zeroes_at(p.dev_offset, p.len),
            })?;
        }
        Ok(())
    }

    /// A synchronous write in flight while a rebuild runs (ends when dropped). It waits
    /// while a rebuild or scrub holds its range (never on a reactor thread).
    fn sync_write(&self, offset: u64, len: u64) -> Option<WriteGuard<'_>> {
        if self.health.rebuilding.load(SeqCst) == 0 && self.copy.tracking.load(SeqCst) == 0 {
            return None;
        }
        while self.copy.held(offset, len) {
            std::thread::yield_now();
        }
        Some(WriteGuard {
            layout: self,
            token: self.copy.begin_write(offset, len),
        })
    }

    pub fn sync(&self) -> io::Result<()> {
        let redundant = self.kind.is_redundant();
        for (i, d) in self.devices.iter().enumerate() {
            if redundant && self.is_failed(i) {
                continue;
            }
            if let Err(e) = d.sync() {
                if redundant {
                    self.mark_failed(i, FailReason::Write);
                    continue;
                }
                return Err(io::Error::new(
                    e.kind(),
                    format!("{}: sync failed: {e}", d.describe()),
                ));
            }
        }
        if redundant && self.has_lost_data() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}

struct WriteGuard<'a> {
    layout: &'a Layout,
    token: u64,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.layout.copy.end_write(self.token);
    }
}
