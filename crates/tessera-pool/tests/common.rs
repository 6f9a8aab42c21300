//! Helpers shared by the pool integration tests: run block operations synchronously on a
//! private core context.

// Not yet audited for the workspace lint (5 casts, mostly u64 lengths and offsets to
// usize on this 64-bit-only code): remove this line and fix or justify each one.
#![allow(clippy::cast_possible_truncation)]
#![allow(dead_code)]

use std::sync::Arc;

use tessera_device::{BlockDevice, FaultConfig, FaultDevice, RamDevice};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};
use tessera_pool::format::DEV_DATA_START;

pub fn core() -> CoreIo {
    CoreIo::new(0, 64, None).expect("io_uring")
}

/// Submit one operation and drive the context until its completion; returns the result.
pub fn run(io: &mut CoreIo, h: &mut dyn IoHandle, op: IoOp) -> i32 {
    let mut res = None;
    // SAFETY: every caller's buffer outlives this call, which drains the completion before
    // it returns.
    unsafe { h.submit(io, op, Tag::task(0, 7)) };
    io.run_until_idle(|_, tag, r| {
        assert_eq!(tag, Tag::task(0, 7));
        assert!(res.replace(r).is_none(), "two completions for one submit");
    });
    res.expect("no completion")
}

pub fn write(io: &mut CoreIo, h: &mut dyn IoHandle, offset: u64, data: &[u8]) -> i32 {
    run(
        io,
        h,
        IoOp::Write {
            offset,
            len: data.len() as u32,
            buf: data.as_ptr(),
        },
    )
}

pub fn read(
    io: &mut CoreIo,
    h: &mut dyn IoHandle,
    offset: u64,
    len: usize,
) -> Result<Vec<u8>, i32> {
    let mut v = vec![0xEEu8; len];
    let r = run(
        io,
        h,
        IoOp::Read {
            offset,
            len: len as u32,
            buf: v.as_mut_ptr(),
        },
    );
    if r < 0 {
        Err(r)
    } else {
        Ok(v)
    }
}

pub fn flush(io: &mut CoreIo, h: &mut dyn IoHandle) -> i32 {
    run(io, h, IoOp::Flush)
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// xorshift64: reproducible randomness for the model tests.
pub struct Rng(pub u64);
impl Rng {
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

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

/// How a device fails in the model tests.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    Vanish,
    FailReads,
    FailWrites,
}

/// Make the device behind `c` fail as `f` (its data area; the label stays readable).
pub fn inject(c: &FaultConfig, f: Fault) {
    match f {
        Fault::Vanish => c.vanish(),
        Fault::FailReads => c.fail_reads(DEV_DATA_START, u64::MAX),
        Fault::FailWrites => c.fail_writes(DEV_DATA_START, u64::MAX),
    }
}

/// Read the whole of `model.len()` back (96 KiB reads, 8 in flight) and compare; `what`
/// names the situation in a failure.
pub fn verify_all(io: &mut CoreIo, h: &mut dyn IoHandle, model: &[u8], what: &str) {
    let chunk = 96 << 10;
    let batch = 8;
    let mut bufs = vec![vec![0u8; chunk]; batch];
    for start in (0..model.len()).step_by(chunk * batch) {
        let mut n = 0;
        for (i, b) in bufs.iter_mut().enumerate() {
            let off = start + i * chunk;
            if off >= model.len() {
                break;
            }
            let len = chunk.min(model.len() - off);
            // SAFETY: each read has its own buffer in `bufs`, which outlives the drain
            // below.
            unsafe {
                h.submit(
                    io,
                    IoOp::Read {
                        offset: off as u64,
                        len: len as u32,
                        buf: b.as_mut_ptr(),
                    },
                    Tag::task(0, i as u32),
                )
            };
            n += 1;
        }
        let mut done = 0;
        io.run_until_idle(|_, _, r| {
            assert!(r >= 0, "{what}: read failed with {r}");
            done += 1;
        });
        assert_eq!(done, n);
        for (i, b) in bufs.iter().enumerate().take(n) {
            let off = start + i * chunk;
            let len = chunk.min(model.len() - off);
            if b[..len] != model[off..off + len] {
                let at = (0..len).find(|&j| b[j] != model[off + j]).unwrap();
                panic!("{what}: data differs at {}", off + at);
            }
        }
    }
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
        self.logged_write(offset, &vec![0u8; len as usize])
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
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
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
