//! Devices only tests need, and fault wrapping for RAM devices.

use std::sync::Arc;
use tessera_io::cast::usize_of;

use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
pub use tessera_device::{CrashDevice, PowerSwitch};
use tessera_io::{CoreIo, IoHandle, IoOp};

use crate::data::Rng;

/// Put each RAM device behind a fault-injecting device with its own knobs.
pub fn wrap(inner: &[Arc<RamDevice>]) -> (Vec<Arc<dyn BlockDevice>>, Vec<Arc<FaultConfig>>) {
    let cfgs: Vec<Arc<FaultConfig>> = inner.iter().map(|_| Arc::default()).collect();
    let devs = inner
        .iter()
        .zip(&cfgs)
        .map(|(r, c)| FaultDevice::new(r.clone(), c.clone()) as Arc<dyn BlockDevice>)
        .collect();
    (devs, cfgs)
}

/// Bytes of a logged write: as they are, or a run of zeros (a write-zeroes, or what it
/// replaced when that was zeros already), which costs no buffer. The pools zero whole
/// areas (a parity journal at every open and close, rebuilt free rows): logged as
/// buffers, they doubled the model checker's memory.
enum Bytes {
    Data(Vec<u8>),
    Zeros(usize),
}

impl Bytes {
    fn len(&self) -> usize {
        match self {
            Bytes::Data(d) => d.len(),
            Bytes::Zeros(n) => *n,
        }
    }

    /// Write `self[at..at + len]` to `dev` at `offset + at`.
    fn write_part(&self, dev: &RamDevice, offset: u64, at: usize, len: usize) {
        let to = offset + at as u64;
        match self {
            Bytes::Data(d) => dev.write_at(to, &d[at..at + len]).unwrap(),
            Bytes::Zeros(_) => dev.write_zeroes_at(to, len as u64).unwrap(),
        }
    }
}

/// A write not yet flushed: (offset, the bytes it replaced, its bytes).
type Unflushed = (u64, Bytes, Bytes);

/// A device with a volatile write cache, for power-loss tests. Every write since the last
/// flush is logged with the bytes it replaced; [`CacheDevice::power_loss`] keeps a random
/// subset of them (applied in order, as a cache that wrote some of them back would) and
/// drops the rest. A shared I/O budget models the moment of the crash: once it is spent,
/// every I/O fails with ENODEV. Not volatile in the `BlockDevice` sense: its media keep
/// what was flushed.
pub struct CacheDevice {
    inner: Arc<RamDevice>,
    log: std::sync::Mutex<Vec<Unflushed>>,
    budget: Arc<std::sync::atomic::AtomicI64>,
}

impl CacheDevice {
    pub fn new(inner: Arc<RamDevice>, budget: Arc<std::sync::atomic::AtomicI64>) -> Arc<Self> {
        Arc::new(CacheDevice {
            inner,
            log: Default::default(),
            budget,
        })
    }

    fn alive(&self) -> std::io::Result<()> {
        if self
            .budget
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
            > 0
        {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(libc::ENODEV))
        }
    }

    /// What `[offset, offset + len)` holds now, to log as the bytes a write replaces.
    fn old_bytes(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        let mut old = vec![0u8; len];
        self.inner.read_at(offset, &mut old)?;
        Ok(if crate::data::is_zero(&old) {
            Bytes::Zeros(len)
        } else {
            Bytes::Data(old)
        })
    }

    fn logged_write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.alive()?;
        let old = self.old_bytes(offset, data.len())?;
        self.inner.write_at(offset, data)?;
        self.log
            .lock()
            .unwrap()
            .push((offset, old, Bytes::Data(data.to_vec())));
        Ok(())
    }

    fn logged_zeroes(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.alive()?;
        let old = self.old_bytes(offset, usize_of(len))?;
        self.inner.write_zeroes_at(offset, len)?;
        self.log
            .lock()
            .unwrap()
            .push((offset, old, Bytes::Zeros(usize_of(len))));
        Ok(())
    }

    /// Power is lost: each write since the last flush survives or not (coin flips from
    /// `rng`), and one in four that survives is torn: only some of its 512-byte sectors
    /// reached the media (a device guarantees no more than sector atomicity).
    pub fn power_loss(&self, rng: &mut Rng) {
        let log = std::mem::take(&mut *self.log.lock().unwrap());
        for (off, old, _) in log.iter().rev() {
            old.write_part(&self.inner, *off, 0, old.len());
        }
        for (off, _, new) in &log {
            match rng.below(8) {
                0..=2 => new.write_part(&self.inner, *off, 0, new.len()),
                3 => {
                    // One coin per 512-byte sector (the last may be shorter).
                    for at in (0..new.len()).step_by(512) {
                        if rng.below(2) == 0 {
                            new.write_part(&self.inner, *off, at, 512.min(new.len() - at));
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

impl BlockDevice for CacheDevice {
    fn describe(&self) -> String {
        "cache:ram".into()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn is_volatile(&self) -> bool {
        false
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.alive()?;
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        self.logged_write(offset, buf)
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.logged_zeroes(offset, len)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.alive()?;
        self.log.lock().unwrap().clear();
        Ok(())
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        Box::new(CacheHandle(self))
    }
}

struct CacheHandle(Arc<CacheDevice>);

impl IoHandle for CacheHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: tessera_io::Tag) {
        let d = &self.0;
        let r = match op {
            IoOp::Read { offset, len, buf } => {
                // SAFETY: the submitter's buffer holds len bytes until completion.
                let b = unsafe { std::slice::from_raw_parts_mut(buf, len as usize) };
                d.read_at(offset, b).map(|()| len as i32)
            }
            IoOp::Write { offset, len, buf } => {
                // SAFETY: as above.
                let b = unsafe { std::slice::from_raw_parts(buf, len as usize) };
                d.logged_write(offset, b).map(|()| len as i32)
            }
            IoOp::WriteZeroes { offset, len, .. } | IoOp::Discard { offset, len } => {
                d.write_zeroes_at(offset, len).map(|()| 0)
            }
            IoOp::Flush => d.sync().map(|()| 0),
        };
        io.complete(
            tag,
            r.unwrap_or_else(|e| -e.raw_os_error().unwrap_or(libc::EIO)),
        );
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unflushed write-zeroes over data is, after a power loss, old data or zeros in
    /// each 512-byte sector; over many seeds every outcome shows up (all kept, all lost,
    /// torn); a flushed one is never undone.
    #[test]
    fn a_power_loss_keeps_loses_or_tears_a_write_zeroes() {
        let (mut kept, mut lost, mut torn) = (0, 0, 0);
        for seed in 1..200u64 {
            let ram = RamDevice::new(64 << 10).unwrap();
            let dev = CacheDevice::new(ram.clone(), Arc::new(i64::MAX.into()));
            let data = vec![0xa5u8; 8192];
            dev.write_at(4096, &data).unwrap();
            dev.sync().unwrap();
            dev.write_zeroes_at(4096, 8192).unwrap();
            dev.power_loss(&mut Rng(seed));
            let mut got = vec![0u8; 8192];
            ram.read_at(4096, &mut got).unwrap();
            let zero_sectors = got
                .chunks(512)
                .filter(|s| {
                    assert!(
                        s.iter().all(|&b| b == 0) || s.iter().all(|&b| b == 0xa5),
                        "a sector mixes old and new bytes"
                    );
                    s[0] == 0
                })
                .count();
            match zero_sectors {
                16 => kept += 1,
                0 => lost += 1,
                _ => torn += 1,
            }
            // Flushed, it stays whatever the coins say.
            dev.write_zeroes_at(4096, 8192).unwrap();
            dev.sync().unwrap();
            dev.power_loss(&mut Rng(seed));
            ram.read_at(4096, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == 0));
        }
        assert!(kept > 0 && lost > 0 && torn > 0, "{kept} {lost} {torn}");
    }
}
