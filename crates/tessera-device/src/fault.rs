//! A fault-injecting wrapper: errors at chosen offsets or at a random rate, added latency,
//! a device that vanishes (every later I/O fails) at a chosen time or I/O count, and a
//! device that stalls (hangs, for a bounded time).
//!
//! The knobs are atomics in a shared [`FaultConfig`], so a test can change them while I/O
//! runs. Reading them costs uncontended loads; this device is for tests, not production.
//!
//! Spec keys (`fault:INNER;key=value;...`, see [`FaultConfig::set`]):
//! - `latency_us=N`: every datapath completion is N µs late;
//! - `sync_latency_us=N`: every call of the synchronous face (metadata, background copies
//!   such as a cache tier's cleaner, rebuilds) sleeps N µs first, so that a device made
//!   slow on purpose is slow for its background work too;
//! - `error_ppm=N`: random EIO on the datapath at N parts per million;
//! - `fail_read=A-B`, `fail_write=A-B`: EIO for I/O touching the byte range [A, B);
//! - `fail_flush=1`: every flush fails with EIO (and its cache is not written back), while
//!   reads and writes still succeed — a write cache that lost what it held;
//! - `vanish_after_ios=N`, `vanish_after_ms=T`: the device disappears (ENODEV) after N I/Os
//!   or T ms after it was opened;
//! - `stall_ms=N`: the device hangs — every datapath I/O submitted while the knob is set
//!   completes N ms late (errors included), and the synchronous face sleeps N ms before
//!   each call. Bounded on purpose, so a test cannot hang forever; clearing the knob
//!   ([`FaultConfig::unstall`]) does not hurry I/O already held;
//! - `stall_after_ms=T`: the stall begins T ms after the device was opened (like
//!   `vanish_after_ms`); it lasts `stall_ms`, or [`DEFAULT_STALL_MS`] if that is unset.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{BlockDevice, CoreIo, IoHandle, IoOp, Tag};

#[derive(Default)]
pub struct FaultConfig {
    /// Reads touching [fail_read_start, fail_read_end) fail with EIO.
    pub fail_read_start: AtomicU64,
    pub fail_read_end: AtomicU64,
    /// Writes touching [fail_write_start, fail_write_end) fail with EIO.
    pub fail_write_start: AtomicU64,
    pub fail_write_end: AtomicU64,
    /// Flushes fail with EIO (the inner device is not flushed).
    pub fail_flush: AtomicBool,
    /// Probability of a random EIO, in parts per million of I/Os.
    pub error_ppm: AtomicU64,
    /// Latency added to every completion, in microseconds.
    pub latency_us: AtomicU64,
    /// Latency added to every call of the synchronous face, in microseconds.
    pub sync_latency_us: AtomicU64,
    /// The device is gone: everything fails with ENODEV.
    pub vanished: AtomicBool,
    /// Vanish once this many I/Os have been submitted (0 = never).
    pub vanish_after_ios: AtomicU64,
    /// Vanish this many milliseconds after the device was opened (0 = never).
    pub vanish_after_ms: AtomicU64,
    /// Stall: every I/O submitted while this is set completes this many ms late (0 = no
    /// stall, unless `stall_after_ms` started one).
    pub stall_ms: AtomicU64,
    /// Stall this many milliseconds after the device was opened (0 = never), for
    /// `stall_ms` ms per I/O or [`DEFAULT_STALL_MS`] if that is 0.
    pub stall_after_ms: AtomicU64,
    ios: AtomicU64,
}

/// How late an I/O completes under `stall_after_ms` when `stall_ms` is not set.
pub const DEFAULT_STALL_MS: u64 = 30_000;

impl FaultConfig {
    pub fn fail_reads(&self, start: u64, end: u64) {
        self.fail_read_start.store(start, Relaxed);
        self.fail_read_end.store(end, Relaxed);
    }
    pub fn fail_writes(&self, start: u64, end: u64) {
        self.fail_write_start.store(start, Relaxed);
        self.fail_write_end.store(end, Relaxed);
    }
    /// Make every flush fail (`true`) or work again (`false`).
    pub fn fail_flushes(&self, on: bool) {
        self.fail_flush.store(on, Relaxed);
    }
    pub fn vanish(&self) {
        self.vanished.store(true, Relaxed);
    }
    /// Vanish after `n` more I/Os (a crash test stops each device at its own point).
    pub fn vanish_after_more(&self, n: u64) {
        self.vanish_after_ios
            .store(self.ios.load(Relaxed) + n.max(1), Relaxed);
    }
    /// Stall from now on: every I/O completes `delay` late (rounded down to ms; at least 1 ms).
    pub fn stall(&self, delay: Duration) {
        self.stall_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX).max(1),
            Relaxed,
        );
    }
    /// End the stall (`stall_ms` and `stall_after_ms`); I/O already held still waits.
    pub fn unstall(&self) {
        self.stall_after_ms.store(0, Relaxed);
        self.stall_ms.store(0, Relaxed);
    }
    /// Apply one `key=value` setting (as used in device specs).
    pub fn set(&self, key: &str, value: &str) -> io::Result<()> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fault device: bad setting {key}={value}"),
            )
        };
        let num = || crate::parse_size(value).map_err(|_| bad());
        match key {
            "latency_us" => self.latency_us.store(num()?, Relaxed),
            "sync_latency_us" => self.sync_latency_us.store(num()?, Relaxed),
            "error_ppm" => self.error_ppm.store(num()?, Relaxed),
            "fail_read" | "fail_write" => {
                let (a, b) = value.split_once('-').ok_or_else(bad)?;
                let (a, b) = (crate::parse_size(a).map_err(|_| bad())?, crate::parse_size(b).map_err(|_| bad())?);
                if key == "fail_read" {
                    self.fail_reads(a, b)
                } else {
                    self.fail_writes(a, b)
                }
            }
            "fail_flush" => self.fail_flushes(num()? != 0),
            "vanish_after_ios" => self.vanish_after_ios.store(num()?, Relaxed),
            "vanish_after_ms" => self.vanish_after_ms.store(num()?, Relaxed),
            "stall_ms" => self.stall_ms.store(num()?, Relaxed),
            "stall_after_ms" => self.stall_after_ms.store(num()?, Relaxed),
            _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("fault device: unknown setting '{key}' (latency_us, sync_latency_us, error_ppm, fail_read=A-B, fail_write=A-B, fail_flush, vanish_after_ios, vanish_after_ms, stall_ms, stall_after_ms)"))),
        }
        Ok(())
    }
}

pub struct FaultDevice {
    inner: Arc<dyn BlockDevice>,
    pub config: Arc<FaultConfig>,
    opened: Instant,
}

impl FaultDevice {
    pub fn new(inner: Arc<dyn BlockDevice>, config: Arc<FaultConfig>) -> Arc<FaultDevice> {
        Arc::new(FaultDevice {
            inner,
            config,
            opened: Instant::now(),
        })
    }

    /// How long an I/O submitted now is held by the stall knobs (zero when not stalled).
    fn stall_delay(&self) -> Duration {
        let c = &self.config;
        let ms = c.stall_ms.load(Relaxed);
        let after = c.stall_after_ms.load(Relaxed);
        if after == 0 {
            return Duration::from_millis(ms);
        }
        if self.opened.elapsed() < Duration::from_millis(after) {
            return Duration::ZERO;
        }
        Duration::from_millis(if ms == 0 { DEFAULT_STALL_MS } else { ms })
    }

    /// The synchronous face of a stall: the calling thread waits as long as an I/O would.
    fn sync_stall(&self) {
        let d =
            self.stall_delay() + Duration::from_micros(self.config.sync_latency_us.load(Relaxed));
        if !d.is_zero() {
            std::thread::sleep(d);
        }
    }

    /// The error (negative errno) this I/O should fail with, if any.
    fn verdict(&self, op: &IoOp, rng: &mut u64) -> Option<i32> {
        let c = &self.config;
        let n = c.ios.fetch_add(1, Relaxed) + 1;
        let after = c.vanish_after_ios.load(Relaxed);
        let ms = c.vanish_after_ms.load(Relaxed);
        if (after != 0 && n >= after)
            || (ms != 0 && self.opened.elapsed() >= Duration::from_millis(ms))
        {
            c.vanished.store(true, Relaxed);
        }
        if c.vanished.load(Relaxed) {
            return Some(-libc::ENODEV);
        }
        let hits = |s: &AtomicU64, e: &AtomicU64, off: u64, len: u64| {
            let (s, e) = (s.load(Relaxed), e.load(Relaxed));
            s < e && off < e && off + len > s
        };
        match *op {
            IoOp::Read { offset, len, .. }
                if hits(&c.fail_read_start, &c.fail_read_end, offset, len as u64) =>
            {
                return Some(-libc::EIO)
            }
            IoOp::Write { offset, len, .. }
                if hits(&c.fail_write_start, &c.fail_write_end, offset, len as u64) =>
            {
                return Some(-libc::EIO)
            }
            IoOp::Flush if c.fail_flush.load(Relaxed) => return Some(-libc::EIO),
            _ => {}
        }
        let ppm = c.error_ppm.load(Relaxed);
        if ppm > 0 {
            // xorshift64: cheap per-handle randomness.
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            if *rng % 1_000_000 < ppm {
                return Some(-libc::EIO);
            }
        }
        None
    }

    /// The synchronous face (metadata, background passes) sees the same vanishing and
    /// failing ranges as the datapath: a bad region is bad for every reader. Random
    /// errors (`error_ppm`) stay on the datapath only, so a pool under a random-error
    /// test can still open and commit its metadata.
    fn sync_check(&self, range: Option<(&AtomicU64, &AtomicU64, u64, usize)>) -> io::Result<()> {
        let c = &self.config;
        // A device timed to vanish is gone for every reader, not only the datapath.
        let ms = c.vanish_after_ms.load(Relaxed);
        if ms != 0 && self.opened.elapsed() >= Duration::from_millis(ms) {
            c.vanished.store(true, Relaxed);
        }
        if c.vanished.load(Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::ENODEV));
        }
        if let Some((s, e, off, len)) = range {
            let (s, e) = (s.load(Relaxed), e.load(Relaxed));
            if s < e && off < e && off + len as u64 > s {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        Ok(())
    }
}

struct FaultHandle {
    dev: Arc<FaultDevice>,
    inner: Box<dyn IoHandle>,
    rng: u64,
}

impl IoHandle for FaultHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let latency = Duration::from_micros(self.dev.config.latency_us.load(Relaxed))
            + self.dev.stall_delay();
        if let Some(err) = self.dev.verdict(&op, &mut self.rng) {
            return io.complete_after(latency, tag, err);
        }
        let t = if latency.is_zero() {
            tag
        } else {
            io.delayed(tag, latency)
        };
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { self.inner.submit(io, op, t) };
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
}

impl BlockDevice for FaultDevice {
    fn describe(&self) -> String {
        format!("fault:{}", self.inner.describe())
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn alignment(&self) -> u32 {
        self.inner.alignment()
    }
    fn is_volatile(&self) -> bool {
        self.inner.is_volatile()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.sync_stall();
        let c = &self.config;
        self.sync_check(Some((
            &c.fail_read_start,
            &c.fail_read_end,
            offset,
            buf.len(),
        )))?;
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.sync_stall();
        let c = &self.config;
        self.sync_check(Some((
            &c.fail_write_start,
            &c.fail_write_end,
            offset,
            buf.len(),
        )))?;
        self.inner.write_at(offset, buf)
    }
    fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.sync_stall();
        self.sync_check(None)?;
        self.inner.write_zeroes_at(offset, len)
    }
    fn fill_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.sync_stall();
        self.sync_check(None)?;
        self.inner.fill_zeroes_at(offset, len)
    }
    fn sync(&self) -> io::Result<()> {
        self.sync_stall();
        self.sync_check(None)?;
        if self.config.fail_flush.load(Relaxed) {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.sync()
    }
    fn open_handle(self: Arc<Self>) -> Box<dyn IoHandle> {
        let inner = self.inner.clone().open_handle();
        // Any bits of the elapsed time make a seed: keeping the low 64 is the point.
        #[allow(clippy::cast_possible_truncation)]
        let seed = (self.opened.elapsed().as_nanos() as u64) | 1;
        Box::new(FaultHandle {
            dev: self,
            inner,
            rng: seed,
        })
    }
}
