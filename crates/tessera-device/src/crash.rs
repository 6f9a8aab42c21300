//! A crash-simulating test backend.
//!
//! It keeps two images: what a real disk would have made durable (everything up to the
//! last flush) and the writes since then. [`CrashDevice::crash_image`] produces what the
//! disk could hold after power loss: the durable image plus an arbitrary subset of the
//! unflushed writes, one of which may be torn (only some of its 512-byte sectors land).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tessera_io::cast::usize_of;
use tessera_io::sync::MutexExt;

use crate::{check_range, out_of_range, BlockDevice, CoreIo, IoHandle, IoOp, Tag};

struct State {
    current: Vec<u8>,
    durable: Vec<u8>,
    unflushed: Vec<(u64, Vec<u8>)>,
}

pub struct CrashDevice {
    size: u64,
    state: Mutex<State>,
    /// The machine's power, shared with the other devices of the same test "machine".
    power: Option<Arc<PowerSwitch>>,
}

/// The power of one simulated machine, shared by its [`CrashDevice`]s, so that a power
/// loss can hit at any device operation of the code under test, not only between calls:
/// it counts the writes and flushes of every device on it, and once cut (after a given
/// count), no device makes anything durable or records anything any more. Writes still
/// reach the running image, so the code under test goes on unaware, and each device's
/// [`CrashDevice::crash_image`] is then its disk at the instant of the cut.
#[derive(Default)]
pub struct PowerSwitch {
    ops: AtomicU64,
    cut_at: AtomicU64,
}

impl PowerSwitch {
    pub fn new() -> Arc<PowerSwitch> {
        Arc::new(PowerSwitch {
            ops: AtomicU64::new(0),
            cut_at: AtomicU64::new(u64::MAX),
        })
    }

    /// Device writes and flushes so far, on all devices of this machine.
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    /// Cut the power once `more` further device operations have happened (0: now).
    pub fn cut_after(&self, more: u64) {
        self.cut_at.store(self.ops() + more, Ordering::SeqCst);
    }

    /// Count one operation; false once the power is off (the operation is not recorded).
    fn operation(&self) -> bool {
        let cut_at = self.cut_at.load(Ordering::SeqCst);
        self.ops.fetch_add(1, Ordering::SeqCst) < cut_at
    }
}

impl CrashDevice {
    pub fn new(size: u64) -> Arc<CrashDevice> {
        Self::from_image(vec![0u8; usize_of(size)])
    }

    pub fn from_image(image: Vec<u8>) -> Arc<CrashDevice> {
        Self::build(image, None)
    }

    /// A zeroed device of `size` bytes on the machine whose power is `power`.
    pub fn on_power(size: u64, power: &Arc<PowerSwitch>) -> Arc<CrashDevice> {
        Self::build(vec![0u8; usize_of(size)], Some(power.clone()))
    }

    fn build(image: Vec<u8>, power: Option<Arc<PowerSwitch>>) -> Arc<CrashDevice> {
        Arc::new(CrashDevice {
            size: image.len() as u64,
            state: Mutex::new(State {
                current: image.clone(),
                durable: image,
                unflushed: Vec::new(),
            }),
            power,
        })
    }

    /// Count an operation on the machine's power switch: false once the power is cut.
    fn powered(&self) -> bool {
        self.power.as_ref().is_none_or(|p| p.operation())
    }

    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    fn record_write(&self, offset: u64, data: &[u8]) {
        let powered = self.powered();
        let mut s = self.st();
        s.current[usize_of(offset)..usize_of(offset) + data.len()].copy_from_slice(data);
        if powered {
            s.unflushed.push((offset, data.to_vec()));
        }
    }

    fn flush(&self) {
        if !self.powered() {
            return;
        }
        let mut s = self.st();
        let writes = std::mem::take(&mut s.unflushed);
        for (off, d) in writes {
            s.durable[usize_of(off)..usize_of(off) + d.len()].copy_from_slice(&d);
        }
    }

    /// Number of writes not yet covered by a flush.
    pub fn unflushed_writes(&self) -> usize {
        self.st().unflushed.len()
    }

    /// What the disk holds after a simulated power loss. `seed` picks which unflushed
    /// writes land (in order, each with probability 1/2) and whether the last one that
    /// lands is torn at a sector boundary.
    pub fn crash_image(&self, seed: u64) -> Vec<u8> {
        let s = self.st();
        let mut img = s.durable.clone();
        let mut r = seed | 1;
        let mut next = || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            r
        };
        let n = s.unflushed.len();
        for (i, (off, d)) in s.unflushed.iter().enumerate() {
            if next() % 2 == 0 {
                continue;
            }
            let mut len = d.len();
            if i + 1 == n || next() % 8 == 0 {
                // Tear: keep only a prefix of whole sectors (possibly none).
                let sectors = d.len().div_ceil(512);
                len = ((usize_of(next()) % (sectors + 1)) * 512).min(d.len());
            }
            img[usize_of(*off)..usize_of(*off) + len].copy_from_slice(&d[..len]);
        }
        img
    }
}

struct CrashHandle(Arc<CrashDevice>);

impl IoHandle for CrashHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let d = &self.0;
        let r = match op {
            IoOp::Read { offset, len, buf } => check_range(d.size, offset, len as u64).map(|_| {
                let s = d.st();
                // SAFETY: the submitter guarantees buf holds len bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.current.as_ptr().add(usize_of(offset)),
                        buf,
                        len as usize,
                    )
                };
                len as i32
            }),
            IoOp::Write { offset, len, buf } => check_range(d.size, offset, len as u64).map(|_| {
                // SAFETY: as above.
                let data = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                d.record_write(offset, data);
                len as i32
            }),
            IoOp::Flush => {
                d.flush();
                Ok(0)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => {
                check_range(d.size, offset, len).map(|_| {
                    d.record_write(offset, &vec![0u8; usize_of(len)]);
                    0
                })
            }
        };
        io.complete(tag, r.unwrap_or_else(|e| e));
    }
    fn size(&self) -> u64 {
        self.0.size
    }
}

impl BlockDevice for CrashDevice {
    fn describe(&self) -> String {
        format!("crash:{}", crate::format_size(self.size))
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range("crash", offset, buf.len() as u64, self.size))?;
        let s = self.st();
        buf.copy_from_slice(&s.current[usize_of(offset)..usize_of(offset) + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        check_range(self.size, offset, buf.len() as u64)
            .map_err(|_| out_of_range("crash", offset, buf.len() as u64, self.size))?;
        self.record_write(offset, buf);
        Ok(())
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        check_range(self.size, offset, len)
            .map_err(|_| out_of_range("crash", offset, len, self.size))?;
        self.record_write(offset, &vec![0u8; usize_of(len)]);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.flush();
        Ok(())
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        Box::new(CrashHandle(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flushed_data_survives_and_unflushed_may_not() {
        let d = CrashDevice::new(8192);
        d.write_at(0, &[1u8; 512]).unwrap();
        d.sync().unwrap();
        d.write_at(512, &[2u8; 1024]).unwrap();
        let mut saw_lost = false;
        for seed in 1..50 {
            let img = d.crash_image(seed);
            assert!(img[..512].iter().all(|&b| b == 1));
            if img[512] == 0 {
                saw_lost = true;
            }
        }
        assert!(saw_lost);
    }
}
