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

/// A write not yet flushed: (offset, the bytes it replaced, its bytes).
type Unflushed = (u64, Vec<u8>, Vec<u8>);

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

    fn logged_write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.alive()?;
        let mut old = vec![0u8; data.len()];
        self.inner.read_at(offset, &mut old)?;
        self.inner.write_at(offset, data)?;
        self.log.lock().unwrap().push((offset, old, data.to_vec()));
        Ok(())
    }

    /// Power is lost: each write since the last flush survives or not (coin flips from
    /// `rng`), and one in four that survives is torn: only some of its 512-byte sectors
    /// reached the media (a device guarantees no more than sector atomicity).
    pub fn power_loss(&self, rng: &mut Rng) {
        let log = std::mem::take(&mut *self.log.lock().unwrap());
        for (off, old, _) in log.iter().rev() {
            self.inner.write_at(*off, old).unwrap();
        }
        for (off, _, new) in &log {
            match rng.below(8) {
                0..=2 => self.inner.write_at(*off, new).unwrap(),
                3 => {
                    for (i, sec) in new.chunks(512).enumerate() {
                        if rng.below(2) == 0 {
                            self.inner.write_at(off + 512 * i as u64, sec).unwrap();
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
        self.logged_write(offset, &vec![0u8; usize_of(len)])
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
