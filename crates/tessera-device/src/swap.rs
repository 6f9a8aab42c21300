//! A device slot whose device can be replaced while the pool above runs: a redundant
//! pool's layout keeps one [`SwappableDevice`] per slot, so a failed device can be
//! swapped for a spare or a replacement without reopening the pool (the per-core handles
//! every reactor holds keep working).
//!
//! - The synchronous face delegates to the current device (a read lock and an `Arc`
//!   clone per call: the control plane's path, not the datapath).
//! - [`BlockDevice::size`] stays the original device's: the layout was computed from it.
//!   A new device must be at least [`SwappableDevice::required_size`] bytes (the
//!   original's size unless the owner lowered it to what the layout really uses, e.g. a
//!   stand-in for a missing device that claims to be huge).
//! - A per-core handle remembers the generation its device handle was opened at. Each
//!   `submit` loads the generation once (an acquire load: on x86 the same plain `mov` as a
//!   relaxed one); after a swap it opens a handle of the new device first. The old handle
//!   is kept (its I/O still in flight completes on it, and a handle must outlive its
//!   in-flight I/O: a file handle's fd stays open through it). Retired handles are kept
//!   for the handle's life: one per swap per core, and swaps are rare (a replaced device).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use tessera_io::sync::RwLockExt;

use crate::{BlockDevice, CoreIo, IoHandle, IoOp, Tag};

/// Why a device cannot take a slot's place: it names the device and the slot's bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SwapError {
    #[error("device {device} is too small: {size} bytes, this slot needs {needs}")]
    TooSmall {
        device: String,
        size: u64,
        needs: u64,
    },
    #[error("device {device} needs {needs}-byte alignment, this slot's I/O is aligned to {slot}")]
    Alignment {
        device: String,
        needs: u32,
        slot: u32,
    },
}

/// A [`BlockDevice`] whose inner device can be replaced live (see the module docs).
pub struct SwappableDevice {
    inner: RwLock<Arc<dyn BlockDevice>>,
    /// Bumped by every swap, after the new device is in place.
    generation: AtomicU64,
    /// The original device's size and alignment (what the layout was computed from).
    size: u64,
    alignment: u32,
    /// A new device must have at least this many bytes.
    required: AtomicU64,
}

impl SwappableDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> Arc<SwappableDevice> {
        let size = inner.size();
        Arc::new(SwappableDevice {
            size,
            alignment: inner.alignment(),
            required: AtomicU64::new(size),
            inner: RwLock::new(inner),
            generation: AtomicU64::new(0),
        })
    }

    /// The device I/O goes to now.
    pub fn current(&self) -> Arc<dyn BlockDevice> {
        self.inner.read_locked().clone()
    }

    /// How many swaps happened.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The least size a device swapped in must have.
    pub fn required_size(&self) -> u64 {
        self.required.load(Ordering::Relaxed)
    }

    /// Lower (never raise above the original size) what a device swapped in must hold:
    /// the owner knows how many bytes its layout uses.
    pub fn set_required_size(&self, bytes: u64) {
        self.required.store(bytes.min(self.size), Ordering::Relaxed);
    }

    /// Put `new` in place of the current device. From the next `submit` on each core,
    /// datapath I/O goes to `new`; I/O in flight on the old device completes there. The
    /// reported size stays the original's. Refused when `new` is smaller than
    /// [`Self::required_size`] or needs a coarser alignment than the original.
    pub fn swap(&self, new: Arc<dyn BlockDevice>) -> Result<(), SwapError> {
        if new.size() < self.required_size() {
            return Err(SwapError::TooSmall {
                device: new.describe(),
                size: new.size(),
                needs: self.required_size(),
            });
        }
        if new.alignment() > self.alignment {
            return Err(SwapError::Alignment {
                device: new.describe(),
                needs: new.alignment(),
                slot: self.alignment,
            });
        }
        let mut cur = self.inner.write_locked();
        *cur = new;
        // Under the lock: a handle that sees the new generation reads the new device.
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }
}

impl BlockDevice for SwappableDevice {
    fn describe(&self) -> String {
        self.current().describe()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn alignment(&self) -> u32 {
        self.current().alignment()
    }
    fn is_volatile(&self) -> bool {
        self.current().is_volatile()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.current().read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.current().write_at(offset, buf)
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.current().write_zeroes_at(offset, len)
    }
    fn fill_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.current().fill_zeroes_at(offset, len)
    }
    fn sync(&self) -> io::Result<()> {
        self.current().sync()
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        // Generation first: a swap between the two reads makes the handle reopen at its
        // first submit, never keep a stale device.
        let generation = self.generation.load(Ordering::Acquire);
        let cur = self.current().open_handle();
        Box::new(SwapHandle {
            dev: self,
            generation,
            cur,
            retired: Vec::new(),
        })
    }
}

/// A core's handle to a [`SwappableDevice`].
struct SwapHandle {
    dev: Arc<SwappableDevice>,
    /// The generation `cur` was opened at.
    generation: u64,
    cur: Box<dyn IoHandle>,
    /// Handles of swapped-out devices: I/O may still be in flight on them.
    retired: Vec<Box<dyn IoHandle>>,
}

impl SwapHandle {
    #[cold]
    #[inline(never)]
    fn reopen(&mut self, generation: u64) {
        let new = self.dev.current().open_handle();
        self.retired.push(std::mem::replace(&mut self.cur, new));
        self.generation = generation;
    }
}

impl IoHandle for SwapHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let g = self.dev.generation.load(Ordering::Acquire);
        if g != self.generation {
            self.reopen(g);
        }
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { self.cur.submit(io, op, tag) }
    }
    fn size(&self) -> u64 {
        self.dev.size
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data patterns wrap on purpose
mod tests {
    use super::*;
    use crate::{FaultConfig, FaultDevice, RamDevice};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::Barrier;
    use std::time::{Duration, Instant};

    const BLK: usize = 4096;

    fn write_op(buf: &[u8], block: u64) -> IoOp {
        IoOp::Write {
            offset: block * BLK as u64,
            len: buf.len() as u32,
            buf: buf.as_ptr() as *mut u8,
        }
    }

    fn block_of(dev: &dyn BlockDevice, block: u64) -> Vec<u8> {
        let mut b = vec![0u8; BLK];
        dev.read_at(block * BLK as u64, &mut b).unwrap();
        b
    }

    #[test]
    fn sync_face_follows_the_swap_and_size_is_checked() {
        let a = RamDevice::named(1 << 20, "a".into()).unwrap();
        let b = RamDevice::named(2 << 20, "b".into()).unwrap();
        let small = RamDevice::named(512 << 10, "small".into()).unwrap();
        let s = SwappableDevice::new(a.clone());
        assert_eq!(s.describe(), "a");
        s.write_at(0, b"before").unwrap();
        assert!(s.swap(small.clone()).is_err());
        assert_eq!(s.generation(), 0);
        s.swap(b.clone()).unwrap();
        assert_eq!(s.generation(), 1);
        assert_eq!(s.describe(), "b");
        assert_eq!(s.size(), 1 << 20, "the size stays the original's");
        s.write_at(0, b"after!").unwrap();
        let mut x = [0u8; 6];
        a.read_at(0, &mut x).unwrap();
        assert_eq!(&x, b"before");
        b.read_at(0, &mut x).unwrap();
        assert_eq!(&x, b"after!");
        // A lowered requirement admits a smaller device (never below what is asked).
        s.set_required_size(512 << 10);
        s.swap(small).unwrap();
        assert_eq!(s.describe(), "small");
        assert_eq!(s.generation(), 2);
    }

    #[test]
    fn in_flight_io_completes_on_the_old_device() {
        let mut io = CoreIo::new(0, 64, None).unwrap();
        let cfg = Arc::new(FaultConfig::default());
        cfg.latency_us.store(50_000, SeqCst);
        let old_ram = RamDevice::named(1 << 20, "old".into()).unwrap();
        let old = FaultDevice::new(old_ram.clone(), cfg);
        let new = RamDevice::named(1 << 20, "new".into()).unwrap();
        let s = SwappableDevice::new(old);
        let mut h = s.clone().open_handle();
        let a = vec![0xAAu8; BLK];
        let b = vec![0xBBu8; BLK];
        // 8 slow writes in flight on the old device, then the swap, then 8 more.
        for i in 0..8 {
            // SAFETY: `a` and `b` outlive the drain below and are only read meanwhile.
            unsafe { h.submit(&mut io, write_op(&a, i), Tag::task(0, i as u32)) };
        }
        s.swap(new.clone()).unwrap();
        for i in 0..8 {
            // SAFETY: `a` and `b` outlive the drain below and are only read meanwhile.
            unsafe { h.submit(&mut io, write_op(&b, 8 + i), Tag::task(0, 8 + i as u32)) };
        }
        let mut done = vec![None; 16];
        let t = Instant::now();
        io.run_until_idle(|_, tag, res| done[tag.slot() as usize] = Some(res));
        // (A delayed completion reports 0, an inline one the length: both are success.)
        assert!(done.iter().all(|r| r.is_some_and(|r| r >= 0)), "{done:?}");
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "old I/O was not slow"
        );
        for i in 0..8 {
            assert_eq!(
                block_of(&*old_ram, i),
                a,
                "old write {i} did not land on the old device"
            );
            assert_eq!(block_of(&*new, i), vec![0u8; BLK]);
            assert_eq!(
                block_of(&*new, 8 + i),
                b,
                "new write {i} did not reach the new device"
            );
            assert_eq!(block_of(&*old_ram, 8 + i), vec![0u8; BLK]);
        }
    }

    /// A reactor-like thread keeps writes in flight on its own CoreIo while another
    /// thread swaps the device: every write completes successfully, and every write the
    /// thread submits after it saw the swap reaches the new device only.
    #[test]
    fn swap_while_another_core_runs_io() {
        let cfg = Arc::new(FaultConfig::default());
        cfg.latency_us.store(200, SeqCst);
        let old_ram = RamDevice::named(4 << 20, "old".into()).unwrap();
        let new = RamDevice::named(4 << 20, "new".into()).unwrap();
        let s = SwappableDevice::new(FaultDevice::new(old_ram.clone(), cfg));
        let swapped = Arc::new(AtomicBool::new(false));
        let submitted = Arc::new(AtomicUsize::new(0));
        let ready = Arc::new(Barrier::new(2));
        let (s2, sw, sub, rd) = (s.clone(), swapped.clone(), submitted.clone(), ready.clone());
        let worker = std::thread::spawn(move || {
            let mut io = CoreIo::new(1, 64, None).unwrap();
            let mut h = s2.clone().open_handle();
            rd.wait();
            let end = Instant::now() + Duration::from_secs(10);
            let (mut ok, mut errors) = (0usize, 0usize);
            let mut after = Vec::new(); // blocks written after the swap was seen
            let mut round = 0u64;
            let mut seen_at = None;
            while Instant::now() < end {
                let saw = sw.load(SeqCst);
                if saw && seen_at.is_none() {
                    seen_at = Some(round);
                }
                // 16 writes in flight per round; before the swap was seen a block holds
                // its round number (1..=251), after it 255.
                let v = if saw { 255 } else { (round % 251) as u8 + 1 };
                let bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![v; BLK]).collect();
                for (i, b) in bufs.iter().enumerate() {
                    let block = (round % 32) * 16 + i as u64;
                    // SAFETY: `bufs` lives until after the drain that ends this round, and
                    // is only read meanwhile.
                    unsafe { h.submit(&mut io, write_op(b, block), Tag::task(0, i as u32)) };
                    sub.fetch_add(1, SeqCst);
                    if saw {
                        after.push((block, b[0]));
                    }
                }
                io.run_until_idle(|_, _, res| if res >= 0 { ok += 1 } else { errors += 1 });
                round += 1;
                if seen_at.is_some_and(|r| round > r + 40) {
                    break;
                }
            }
            (ok, errors, after, round)
        });
        ready.wait();
        let t = Instant::now();
        while submitted.load(SeqCst) < 2000 && t.elapsed() < Duration::from_secs(5) {
            std::thread::yield_now();
        }
        s.swap(new.clone()).unwrap();
        swapped.store(true, SeqCst);
        let (ok, errors, after, rounds) = worker.join().unwrap();
        assert_eq!(errors, 0);
        assert_eq!(ok as u64, rounds * 16, "some write never completed");
        assert!(
            after.len() >= 16 * 40,
            "the worker did not run after the swap"
        );
        // Every block written after the swap was seen is on the new device, and none
        // of those writes reached the old one.
        for (block, v) in after {
            assert_eq!(block_of(&*new, block), vec![v; BLK], "block {block}");
        }
        for block in 0..512 {
            assert_ne!(
                block_of(&*old_ram, block)[0],
                255,
                "block {block} on the old device"
            );
        }
        assert!(submitted.load(SeqCst) >= 2000);
    }
}
