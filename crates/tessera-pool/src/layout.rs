//! Layouts: how a pool's logical address space maps onto its devices.
//!
//! The mapping is pure arithmetic (power-of-two stripes use shifts and masks), so the
//! datapath pays a few instructions per request and keeps no per-request state: a request
//! that spans several devices is split, and the pieces share one join on the core.

// Not yet audited for the workspace lint (23 casts, mostly u64 lengths and offsets to
// usize on this 64-bit-only code): remove this line and fix or justify each one.
#![allow(clippy::cast_possible_truncation)]

use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Weak};

use tessera_device::BlockDevice;
use tessera_io::{Continuation, CoreIo, IoHandle, IoOp, Tag};

use crate::format::DEV_DATA_START;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    Concat,
    /// Striping with a power-of-two stripe size in bytes.
    Raid0 {
        stripe: u64,
    },
    /// Every device holds a full copy (`copies` = number of devices).
    Raid1 {
        copies: u32,
    },
    /// Devices form mirror sets of `copies` consecutive devices; stripes rotate over sets.
    Raid10 {
        copies: u32,
        stripe: u64,
    },
    /// Rotating single parity (XOR) over all devices: n-1 data chunks per row.
    Raid5 {
        stripe: u64,
    },
    /// Rotating P+Q parity (Linux md's RAID6 code): n-2 data chunks per row.
    Raid6 {
        stripe: u64,
    },
    /// Reed-Solomon erasure coding: k data and m parity chunks per row (k+m devices).
    Ec {
        k: u32,
        m: u32,
        stripe: u64,
    },
}

impl LayoutKind {
    pub fn name(&self) -> &'static str {
        match self {
            LayoutKind::Concat => "concat",
            LayoutKind::Raid0 { .. } => "raid0",
            LayoutKind::Raid1 { .. } => "raid1",
            LayoutKind::Raid10 { .. } => "raid10",
            LayoutKind::Raid5 { .. } => "raid5",
            LayoutKind::Raid6 { .. } => "raid6",
            LayoutKind::Ec { .. } => "ec",
        }
    }

    /// Copies of each block (1 for concat and raid0).
    pub fn copies(&self) -> u32 {
        match *self {
            LayoutKind::Raid1 { copies } | LayoutKind::Raid10 { copies, .. } => copies,
            _ => 1,
        }
    }

    pub fn stripe(&self) -> u64 {
        match *self {
            LayoutKind::Raid0 { stripe }
            | LayoutKind::Raid10 { stripe, .. }
            | LayoutKind::Raid5 { stripe }
            | LayoutKind::Raid6 { stripe }
            | LayoutKind::Ec { stripe, .. } => stripe,
            _ => 0,
        }
    }

    /// Parity chunks per row (0 for the layouts without parity).
    pub fn parity(&self) -> u32 {
        match *self {
            LayoutKind::Raid5 { .. } => 1,
            LayoutKind::Raid6 { .. } => 2,
            LayoutKind::Ec { m, .. } => m,
            _ => 0,
        }
    }

    pub fn is_parity(&self) -> bool {
        self.parity() > 0
    }

    /// Survives the loss of at least one device.
    pub fn is_redundant(&self) -> bool {
        self.is_mirror() || self.is_parity()
    }

    pub fn is_mirror(&self) -> bool {
        self.copies() > 1
    }

    /// A layout as users write it: `concat`, `raid0`, `raid1[:COPIES]` (default: one copy
    /// per device), `raid10[:COPIES]` (default 2), `raid5`, `raid6`, `ec:K+M` (or `ec:M`,
    /// K being the other devices); `stripe` is the stripe (parity: chunk) size.
    pub fn parse(spec: &str, stripe: u64, ndev: usize) -> Result<LayoutKind, String> {
        let (name, arg) = match spec.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (spec, None),
        };
        let num = |a: &str| {
            a.parse::<u32>()
                .map_err(|_| format!("bad number '{a}' in layout '{spec}'"))
        };
        match (name, arg) {
            ("concat", None) => Ok(LayoutKind::Concat),
            ("raid0", None) => Ok(LayoutKind::Raid0 { stripe }),
            ("raid1", c) => Ok(LayoutKind::Raid1 {
                copies: c.map(num).transpose()?.unwrap_or(ndev as u32),
            }),
            ("raid10", c) => Ok(LayoutKind::Raid10 {
                copies: c.map(num).transpose()?.unwrap_or(2),
                stripe,
            }),
            ("raid5", None) => Ok(LayoutKind::Raid5 { stripe }),
            ("raid6", None) => Ok(LayoutKind::Raid6 { stripe }),
            ("ec", Some(a)) => {
                let (k, m) = match a.split_once('+') {
                    Some((k, m)) => (num(k)?, num(m)?),
                    None => {
                        let m = num(a)?;
                        ((ndev as u32).saturating_sub(m), m)
                    }
                };
                if k == 0 || m == 0 || (k + m) as usize != ndev {
                    return Err(format!(
                        "layout '{spec}' needs k+m devices with k, m at least 1 (got {ndev} devices)"
                    ));
                }
                Ok(LayoutKind::Ec { k, m, stripe })
            }
            ("ec", None) => Err("ec needs its shape: ec:K+M (e.g. ec:4+2)".into()),
            (_, _) => Err(format!(
                "unknown layout '{spec}' (concat, raid0, raid1[:COPIES], raid10[:COPIES], raid5, raid6, ec:K+M)"
            )),
        }
    }

    /// The inverse of [`LayoutKind::parse`] (without the stripe size).
    pub fn spec(&self) -> String {
        match *self {
            LayoutKind::Raid1 { copies } | LayoutKind::Raid10 { copies, .. } => {
                format!("{}:{copies}", self.name())
            }
            LayoutKind::Ec { k, m, .. } => format!("ec:{k}+{m}"),
            _ => self.name().to_string(),
        }
    }
}

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

/// Attempts at copying (or comparing) a mirror range that a client write overlapped,
/// before new writes to the range are held back for the next attempt.
const HOLD_AFTER: u32 = 4;

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
    /// Bit d set: device d is failed and is neither read nor written. Read per request,
    /// set with `fetch_or` on an error; persisted by the pool's commit thread.
    pub failed: AtomicU64,
    /// Failure bits already recorded durably in the labels.
    pub failed_durable: AtomicU64,
    /// Per device: why it failed (`FAIL_*`).
    pub fail_reason: Vec<AtomicU8>,
    /// Bit d set: device d is being rebuilt — a write-only member: writes go to it,
    /// reads never do (docs/architecture.md "Rebuild").
    pub rebuilding: AtomicU64,
    /// Rebuild: the pool range `[start, end)` being copied (`u64::MAX` start: none).
    pub(crate) copy_start: AtomicU64,
    pub(crate) copy_end: AtomicU64,
    /// Set by a write that overlaps the range being copied: the copy is redone.
    pub(crate) copy_dirty: AtomicBool,
    /// Set after a range was found dirty `HOLD_AFTER` times: new writes to it wait until
    /// the copy is done (see `quiet_range`), so a block rewritten without pause cannot
    /// starve a rebuild or scrub.
    pub(crate) copy_hold: AtomicBool,
    /// Writes in flight while a rebuild runs, by epoch parity (see `begin_write`).
    pub(crate) epoch: AtomicU64,
    pub(crate) inflight: [AtomicU64; 2],
    /// Scrub repair running (a count): writes are tracked as during a rebuild (scrub.rs).
    pub(crate) tracking: AtomicU64,
    /// Parity layouts: geometry, code, row locks and journal (crate::parity).
    pub(crate) parity: Option<crate::parity::Parity>,
    /// Bit d set: device d keeps data across a power loss (not RAM): parity journal
    /// records written to it are flushed before the row is written in place.
    nonvolatile: u64,
    /// Redundant layouts: marks a device whose I/O hangs failed (set before handles are
    /// opened; see `watch_devices`).
    watchdog: std::sync::Mutex<Option<Arc<tessera_device::Watchdog>>>,
    /// `PoolTuning::journal_flush` (set once at open; read by parity writes).
    journal_flush: AtomicBool,
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

impl Layout {
    /// Compose `devices` (whose first MiB is reserved for the label) into a layout.
    pub fn new(kind: LayoutKind, devices: Vec<Arc<dyn BlockDevice>>) -> Result<Layout, String> {
        if devices.is_empty() {
            return Err("a pool needs at least one device".into());
        }
        let usable: Vec<u64> = devices
            .iter()
            .map(|d| d.size().saturating_sub(DEV_DATA_START) & !4095)
            .collect();
        if devices.len() > 64 {
            return Err("a pool has at most 64 devices".into());
        }
        if let Some(i) = usable.iter().position(|&u| u == 0) {
            return Err(format!(
                "device {} is too small (a device needs more than 1 MiB)",
                devices[i].describe()
            ));
        }
        let min = usable.iter().min().copied().unwrap_or(0);
        let (dev_data_len, starts, stripe_shift, size) = match kind {
            LayoutKind::Concat => {
                let mut starts = Vec::new();
                let mut at = 0;
                for &u in &usable {
                    starts.push(at);
                    at += u;
                }
                (usable, starts, 0, at)
            }
            LayoutKind::Raid0 { stripe } => {
                if !stripe.is_power_of_two() || !(4096..=(16 << 20)).contains(&stripe) {
                    return Err(format!(
                        "stripe size {stripe} must be a power of two between 4K and 16M"
                    ));
                }
                let per = usable.iter().min().copied().unwrap_or(0) & !(stripe - 1);
                if per == 0 {
                    return Err("devices are smaller than one stripe".into());
                }
                (
                    vec![per; devices.len()],
                    Vec::new(),
                    stripe.trailing_zeros(),
                    per * devices.len() as u64,
                )
            }
            LayoutKind::Raid1 { copies } => {
                if copies < 2 || copies as usize != devices.len() {
                    return Err(format!(
                        "raid1 keeps one copy per device: copies ({copies}) must equal the number of devices ({}), at least 2",
                        devices.len()
                    ));
                }
                let per = usable.iter().min().copied().unwrap_or(0);
                (vec![per; devices.len()], Vec::new(), 63, per)
            }
            LayoutKind::Raid10 { copies, stripe } => {
                if !stripe.is_power_of_two() || !(4096..=(16 << 20)).contains(&stripe) {
                    return Err(format!(
                        "stripe size {stripe} must be a power of two between 4K and 16M"
                    ));
                }
                let n = devices.len();
                if copies < 2 || !n.is_multiple_of(copies as usize) || n < 2 * copies as usize {
                    return Err(format!(
                        "raid10 with {copies} copies needs a multiple of {copies} devices, at least {} (got {n})",
                        2 * copies.max(2)
                    ));
                }
                let per = usable.iter().min().copied().unwrap_or(0) & !(stripe - 1);
                if per == 0 {
                    return Err("devices are smaller than one stripe".into());
                }
                let sets = (n / copies as usize) as u64;
                (
                    vec![per; n],
                    Vec::new(),
                    stripe.trailing_zeros(),
                    per * sets,
                )
            }
            // Sized below, with the parity geometry.
            LayoutKind::Raid5 { .. } | LayoutKind::Raid6 { .. } | LayoutKind::Ec { .. } => {
                (Vec::new(), Vec::new(), 0, 0)
            }
        };
        let mut parity = None;
        let (dev_data_len, stripe_shift, size) = if kind.is_parity() {
            let p = crate::parity::Parity::new(
                kind,
                devices.len(),
                min,
                devices
                    .iter()
                    .map(|d| d.alignment() as u64)
                    .max()
                    .unwrap_or(1),
            )?;
            let r = (
                vec![p.rows * p.chunk; devices.len()],
                kind.stripe().trailing_zeros(),
                p.rows * p.row_bytes,
            );
            parity = Some(p);
            r
        } else {
            (dev_data_len, stripe_shift, size)
        };
        let (copies, sets) = match kind {
            LayoutKind::Raid1 { copies } => (copies, 1),
            LayoutKind::Raid10 { copies, .. } => (copies, (devices.len() / copies as usize) as u64),
            _ => (1, devices.len() as u64),
        };
        let fail_reason = (0..devices.len()).map(|_| AtomicU8::new(0)).collect();
        let nonvolatile = (0..devices.len())
            .filter(|&d| !devices[d].is_volatile())
            .fold(0u64, |a, d| a | 1 << d);
        Ok(Layout {
            kind,
            devices,
            dev_data_len,
            starts,
            stripe_shift,
            size,
            copies,
            sets,
            failed: AtomicU64::new(0),
            failed_durable: AtomicU64::new(0),
            fail_reason,
            rebuilding: AtomicU64::new(0),
            copy_start: AtomicU64::new(u64::MAX),
            copy_end: AtomicU64::new(0),
            copy_dirty: AtomicBool::new(false),
            copy_hold: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            tracking: AtomicU64::new(0),
            parity,
            nonvolatile,
            watchdog: std::sync::Mutex::new(None),
            journal_flush: AtomicBool::new(true),
        })
    }

    /// Bytes of one full stripe: the write size (and alignment) that touches every data
    /// device once — a parity row (`k` chunks), a raid0/raid10 stripe across the devices;
    /// 4 KiB for layouts without one (concat, raid1).
    pub fn full_stripe(&self) -> u64 {
        match (&self.parity, self.kind) {
            (Some(p), _) => p.row_bytes,
            (None, LayoutKind::Raid0 { stripe }) => stripe * self.devices.len() as u64,
            (None, LayoutKind::Raid10 { stripe, copies }) => {
                stripe * (self.devices.len() as u64 / copies as u64)
            }
            _ => 4096,
        }
    }

    /// Number of device pieces `[offset, offset+len)` splits into (len > 0).
    #[inline]
    pub fn piece_count(&self, offset: u64, len: u64) -> u64 {
        match self.kind {
            LayoutKind::Raid0 { .. } | LayoutKind::Raid10 { .. } => {
                ((offset + len - 1) >> self.stripe_shift) - (offset >> self.stripe_shift) + 1
            }
            LayoutKind::Raid1 { .. } => 1,
            LayoutKind::Raid5 { stripe }
            | LayoutKind::Raid6 { stripe }
            | LayoutKind::Ec { stripe, .. } => (offset + len - 1) / stripe - offset / stripe + 1,
            LayoutKind::Concat => {
                let first = self.concat_dev(offset);
                let last = self.concat_dev(offset + len - 1);
                (last - first + 1) as u64
            }
        }
    }

    #[inline]
    fn concat_dev(&self, offset: u64) -> usize {
        // Few devices: a reverse linear scan beats a binary search.
        self.starts.iter().rposition(|&s| s <= offset).unwrap_or(0)
    }

    /// The first piece of `[offset, offset+len)`. For mirrors, `dev` is the first device
    /// of the mirror set; every copy lives at the same `dev_offset` on its device.
    #[inline]
    pub fn piece(&self, offset: u64, len: u64) -> Piece {
        match self.kind {
            LayoutKind::Raid10 { .. } => {
                let shift = self.stripe_shift;
                let stripe = 1u64 << shift;
                let s = offset >> shift;
                let within = offset & (stripe - 1);
                Piece {
                    dev: ((s % self.sets) * self.copies as u64) as usize,
                    dev_offset: DEV_DATA_START + ((s / self.sets) << shift) + within,
                    len: len.min(stripe - within),
                    range_offset: 0,
                }
            }
            // The data chunk holding `offset` (parity chunks are not part of the space).
            LayoutKind::Raid5 { .. } | LayoutKind::Raid6 { .. } | LayoutKind::Ec { .. } => {
                let p = self.parity_geo();
                let (r, i, off) = p.locate(offset);
                Piece {
                    dev: p.shard_dev(r, i),
                    dev_offset: p.row_offset(r) + off,
                    len: len.min(p.chunk - off),
                    range_offset: 0,
                }
            }
            LayoutKind::Raid1 { .. } => Piece {
                dev: 0,
                dev_offset: DEV_DATA_START + offset,
                len,
                range_offset: 0,
            },
            LayoutKind::Raid0 { .. } => {
                let shift = self.stripe_shift;
                let stripe = 1u64 << shift;
                let s = offset >> shift;
                let n = self.devices.len() as u64;
                let within = offset & (stripe - 1);
                Piece {
                    dev: (s % n) as usize,
                    dev_offset: DEV_DATA_START + ((s / n) << shift) + within,
                    len: len.min(stripe - within),
                    range_offset: 0,
                }
            }
            LayoutKind::Concat => {
                let d = self.concat_dev(offset);
                let within = offset - self.starts[d];
                Piece {
                    dev: d,
                    dev_offset: DEV_DATA_START + within,
                    len: len.min(self.dev_data_len[d] - within),
                    range_offset: 0,
                }
            }
        }
    }

    /// Every piece of `[offset, offset+len)` in order.
    pub fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + '_ {
        let mut done = 0;
        std::iter::from_fn(move || {
            if done >= len {
                return None;
            }
            let mut p = self.piece(offset + done, len - done);
            p.range_offset = done;
            done += p.len;
            Some(p)
        })
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(e) if e <= self.size => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("range {offset}+{len} beyond pool size {}", self.size),
            )),
        }
    }

    /// Mark device `d` failed for `reason` (first reason wins). Lock free.
    pub fn mark_failed(&self, d: usize, reason: FailReason) {
        let bit = 1u64 << d;
        self.rebuilding.fetch_and(!bit, SeqCst);
        if self.failed.fetch_or(bit, Relaxed) & bit == 0 {
            self.fail_reason[d].store(reason.byte(), Relaxed);
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
        self.failed.load(Relaxed) & (1 << d) != 0
    }

    /// Devices that must not be read: failed ones and ones being rebuilt.
    #[inline]
    fn unreadable(&self) -> u64 {
        self.failed.load(Relaxed) | self.rebuilding.load(Relaxed)
    }

    #[inline]
    pub(crate) fn is_readable(&self, d: usize) -> bool {
        self.unreadable() & (1 << d) == 0
    }

    #[inline]
    pub(crate) fn failed_bits(&self) -> u64 {
        self.failed.load(Relaxed)
    }

    #[inline]
    pub(crate) fn rebuilding_bits(&self) -> u64 {
        self.rebuilding.load(Relaxed)
    }

    /// Parity layouts: the pool's UUID, stamped into stripe-journal records.
    pub fn set_pool_uuid(&self, uuid: [u8; 16]) {
        if let Some(p) = &self.parity {
            let _ = p.uuid.set(uuid);
        }
    }

    /// Parity layouts: zero the journal and data areas of a new pool.
    pub fn format_parity(&self) -> io::Result<()> {
        if self.parity.is_some() {
            self.parity_format()?;
        }
        Ok(())
    }

    /// A write to pool range `[offset, offset+len)` starts while a rebuild may run: it
    /// is counted in flight under the current epoch, and marks the range being copied
    /// dirty when it overlaps it. Returns the token for `end_write`. (The epoch is
    /// re-checked after the increment so a rebuild that flips it always sees us.)
    #[inline]
    pub(crate) fn begin_write(&self, offset: u64, len: u64) -> u64 {
        let e = loop {
            let e = self.epoch.load(SeqCst);
            self.inflight[(e & 1) as usize].fetch_add(1, SeqCst);
            if self.epoch.load(SeqCst) == e {
                break e;
            }
            self.inflight[(e & 1) as usize].fetch_sub(1, SeqCst);
        };
        let s = self.copy_start.load(SeqCst);
        if s != u64::MAX && offset < self.copy_end.load(SeqCst) && offset + len > s {
            self.copy_dirty.store(true, SeqCst);
        }
        e & 1
    }

    #[inline]
    pub(crate) fn end_write(&self, token: u64) {
        self.inflight[token as usize].fetch_sub(1, SeqCst);
    }

    /// True while writes to `[offset, offset+len)` must wait: a rebuild or scrub holds
    /// the range it is copying (`quiet_range`).
    #[inline]
    pub(crate) fn held(&self, offset: u64, len: u64) -> bool {
        self.copy_hold.load(SeqCst)
            && offset < self.copy_end.load(SeqCst)
            && offset + len > self.copy_start.load(SeqCst)
    }

    /// Run `f` (a copy or comparison of mirror range `[at, at+len)`) until it ran with no
    /// client write to the range in flight or started meanwhile: the range is published,
    /// the writes that started before are waited for, and `f` is run again when a write
    /// overlapped it. After `HOLD_AFTER` such attempts, new writes to the range wait
    /// while `f` runs (mirror handles defer them, the synchronous face yields), so the
    /// loop ends even under a client that rewrites the range without pause.
    pub(crate) fn quiet_range<T>(
        &self,
        at: u64,
        len: u64,
        mut f: impl FnMut() -> io::Result<T>,
    ) -> io::Result<T> {
        let mut attempt = 0u32;
        let r = loop {
            self.copy_dirty.store(false, SeqCst);
            self.copy_end.store(at + len, SeqCst);
            self.copy_start.store(at, SeqCst);
            if attempt >= HOLD_AFTER {
                self.copy_hold.store(true, SeqCst);
            }
            // Wait for the writes that started before the range was published.
            let old = self.epoch.fetch_add(1, SeqCst);
            while self.inflight[(old & 1) as usize].load(SeqCst) != 0 {
                std::thread::yield_now();
            }
            match f() {
                Ok(v) if !self.copy_dirty.load(SeqCst) => break Ok(v),
                Ok(_) => attempt += 1,
                Err(e) => break Err(e),
            }
        };
        self.copy_hold.store(false, SeqCst);
        self.copy_start.store(u64::MAX, SeqCst);
        r
    }

    /// Start rebuilding device `d` (failed, or a replacement): it becomes a write-only
    /// member. Its failed bit is cleared in memory only; the labels keep it failed until
    /// `finish_rebuild`, so a restart never reads it.
    pub fn start_rebuild(&self, d: usize) -> Result<(), String> {
        if !self.kind.is_redundant() {
            return Err("only mirrored and parity layouts can be rebuilt".into());
        }
        if d >= self.devices.len() {
            return Err(format!("no device {d}"));
        }
        let bit = 1u64 << d;
        if self.rebuilding.load(SeqCst) & bit != 0 {
            return Err(format!("device {d} is already being rebuilt"));
        }
        if let Some(p) = &self.parity {
            if (self.unreadable() | bit).count_ones() as usize > p.m {
                return Err(format!(
                    "device {d} cannot be rebuilt: too many other devices are failed or rebuilding"
                ));
            }
        } else {
            let first = d - d % self.copies as usize;
            if !self.set_of(first).any(|o| o != d && self.is_readable(o)) {
                return Err(format!("device {d} has no healthy copy to rebuild from"));
            }
        }
        // Writes from now on reach the device; then it stops being failed.
        self.rebuilding.fetch_or(bit, SeqCst);
        self.failed.fetch_and(!bit, SeqCst);
        self.fail_reason[d].store(0, Relaxed);
        Ok(())
    }

    /// The device is complete: it becomes readable. The caller persists the labels.
    pub fn finish_rebuild(&self, d: usize) {
        self.rebuilding.fetch_and(!(1u64 << d), SeqCst);
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
        self.quiet_range(offset, len, || {
            let mut copied = 0;
            for p in self.pieces(offset, len) {
                if p.dev != first {
                    continue;
                }
                if self.rebuilding.load(SeqCst) & (1 << d) == 0 {
                    return Err(io::Error::other(format!(
                        "device {d} failed during the rebuild"
                    )));
                }
                let r = p.range_offset as usize..(p.range_offset + p.len) as usize;
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

    /// Devices of the mirror set starting at `first` (all devices: one set per device
    /// for concat/raid0).
    #[inline]
    pub(crate) fn set_of(&self, first: usize) -> std::ops::Range<usize> {
        first..first + self.copies as usize
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
            let r = p.range_offset as usize..(p.range_offset + p.len) as usize;
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
            let r = p.range_offset as usize..(p.range_offset + p.len) as usize;
            self.each_copy(&p, FailReason::Write, |d| {
                d.write_at(p.dev_offset, &buf[r.clone()])
            })?;
        }
        Ok(())
    }

    pub fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
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
        if self.rebuilding.load(SeqCst) == 0 && self.tracking.load(SeqCst) == 0 {
            return None;
        }
        while self.held(offset, len) {
            std::thread::yield_now();
        }
        Some(WriteGuard {
            layout: self,
            token: self.begin_write(offset, len),
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

    /// Devices whose journal records must be flushed before in-place writes (none when
    /// the pool's `PoolTuning::journal_flush` is off).
    #[inline]
    pub(crate) fn journal_flush_devs(&self) -> u64 {
        if self.journal_flush.load(Relaxed) {
            self.nonvolatile
        } else {
            0
        }
    }

    pub fn is_volatile(&self) -> bool {
        self.devices.iter().any(|d| d.is_volatile())
    }

    /// Datapath handle for the calling core.
    /// Mark a device failed when an I/O to it has not completed for `timeout` (redundant
    /// layouts only: elsewhere there is nothing to fail over to). Applies to handles opened
    /// from now on. The operation itself still waits for the device (its buffer may be in
    /// the kernel's hands); every later one avoids the device.
    /// Apply the pool's tuning: journal flushes, and the device watchdog of redundant
    /// layouts. Once, right after `Layout::new`.
    pub(crate) fn apply_tuning(self: &Arc<Self>, t: &crate::pool::PoolTuning) {
        self.journal_flush.store(t.journal_flush, Relaxed);
        self.watch_devices(t.device_timeout);
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
        *self.watchdog.lock().unwrap_or_else(|e| e.into_inner()) = Some(dog);
    }

    /// Per-core handles of every device (behind the watchdog when one is set).
    pub(crate) fn device_handles(&self) -> Vec<Box<dyn IoHandle>> {
        let dog = self
            .watchdog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let h = d.clone().open_handle();
                match &dog {
                    Some(w) => w.wrap(i, h),
                    None => h,
                }
            })
            .collect()
    }

    pub fn open_handle(self: &Arc<Self>) -> LayoutHandle {
        LayoutHandle {
            layout: self.clone(),
            handles: self.device_handles(),
            hook: u32::MAX,
            mirror: None,
            rr: 0,
            engine: None,
        }
    }
}

struct WriteGuard<'a> {
    layout: &'a Layout,
    token: u64,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.layout.end_write(self.token);
    }
}

/// A per-core handle to a layout: one device handle per device.
pub struct LayoutHandle {
    layout: Arc<Layout>,
    handles: Vec<Box<dyn IoHandle>>,
    /// Mirrors: this core's error hook for the layout (registered on first use).
    hook: u32,
    mirror: Option<Rc<MirrorHook>>,
    /// Mirrors: spreads reads over the copies.
    rr: u32,
    /// Parity layouts: this core's row engine (crate::parity_io).
    engine: Option<Rc<crate::parity_io::Engine>>,
}

/// Mirror error handling on a core: mark the device failed, then fail a read over to
/// another healthy copy (read synchronously: this is the rare path, taken once per
/// in-flight read when a device fails; later reads skip the device), or let a write
/// succeed when another healthy copy took it.
struct MirrorHook {
    layout: Weak<Layout>,
    /// This hook's id on its core.
    id: std::cell::Cell<u32>,
    /// Writes waiting for a rebuild's or scrub's hold on their range to lift
    /// (`Layout::quiet_range`): (op, offset, len, tag), retried every round.
    waiting: std::cell::RefCell<std::collections::VecDeque<(IoOp, u64, u64, Tag)>>,
    /// Device handles the waiting writes are submitted through (opened on first need).
    handles: std::cell::RefCell<Vec<Box<dyn IoHandle>>>,
}

/// What a mirror's continuation (`MirrorHook::on_done`) is to do, carried in its `ctx`.
/// (Its `on_error` gets the failed device's index instead.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MirrorStep {
    /// A write tracked during a rebuild or scrub ended: its `begin_write` token.
    EndWrite(u64),
    /// Retry the held writes (`MirrorHook::hold`).
    RetryHeld,
}

impl MirrorStep {
    /// Beyond any token (tokens are epoch parities, 0 or 1).
    const RETRY_HELD: u64 = 1 << 62;

    #[inline]
    fn ctx(self) -> u64 {
        match self {
            MirrorStep::EndWrite(token) => token,
            MirrorStep::RetryHeld => Self::RETRY_HELD,
        }
    }

    #[inline]
    fn of(ctx: u64) -> MirrorStep {
        if ctx == Self::RETRY_HELD {
            MirrorStep::RetryHeld
        } else {
            MirrorStep::EndWrite(ctx)
        }
    }
}

impl MirrorHook {
    /// Hold write `op` until its range is released; the first one waiting schedules the
    /// retry.
    fn hold(&self, io: &mut CoreIo, op: IoOp, offset: u64, len: u64, tag: Tag) {
        let mut w = self.waiting.borrow_mut();
        if w.is_empty() {
            io.defer_hook(self.id.get(), MirrorStep::RetryHeld.ctx());
        }
        w.push_back((op, offset, len, tag));
    }

    /// Submit the waiting writes whose range is no longer held; the others wait on.
    fn retry(&self, io: &mut CoreIo) {
        let Some(l) = self.layout.upgrade() else {
            for (_, _, _, tag) in self.waiting.take() {
                io.complete(tag, -libc::ENODEV);
            }
            return;
        };
        let ready: Vec<_> = {
            let mut w = self.waiting.borrow_mut();
            let all = std::mem::take(&mut *w);
            let (held, ready): (Vec<_>, Vec<_>) =
                all.into_iter().partition(|&(_, o, n, _)| l.held(o, n));
            w.extend(held);
            if !w.is_empty() {
                io.defer_hook(self.id.get(), MirrorStep::RetryHeld.ctx());
            }
            ready
        };
        let mut handles = self.handles.borrow_mut();
        if handles.is_empty() {
            *handles = l.device_handles();
        }
        for (op, offset, len, tag) in ready {
            // SAFETY: a held write's buffer is still its submitter's to keep valid: its
            // completion has not been delivered (`hold` only queued it).
            unsafe { mirror_write(&l, &mut handles, io, op, offset, len, tag, self.id.get()) };
        }
    }
}

impl Continuation for MirrorHook {
    fn on_error(&self, io: &mut CoreIo, parent: Tag, op: IoOp, ctx: u64, res: i32) {
        let Some(l) = self.layout.upgrade() else {
            return io.complete(parent, res);
        };
        let dev = ctx as usize;
        l.mark_failed(dev, reason_of(&op, res));
        let first = dev - dev % l.copies as usize;
        match op {
            IoOp::Read { offset, len, buf } => {
                // SAFETY: the buffer belongs to the request, which has not completed.
                let b = unsafe { std::slice::from_raw_parts_mut(buf, len as usize) };
                for d in l.set_of(first) {
                    if !l.is_readable(d) {
                        continue;
                    }
                    match l.devices[d].read_at(offset, b) {
                        Ok(()) => return io.complete(parent, len as i32),
                        Err(e) => l.mark_failed(d, error_reason(&e, FailReason::Read)),
                    }
                }
                io.complete(parent, -libc::EIO)
            }
            _ => {
                let alive = l.set_of(first).any(|d| l.is_readable(d));
                io.complete(parent, if alive { 0 } else { res })
            }
        }
    }

    /// The end of a client write tracked while a rebuild runs (`ctx`: epoch parity), or
    /// the retry of held writes.
    fn on_done(&self, io: &mut CoreIo, parent: Tag, _op: IoOp, ctx: u64, res: i32) {
        let token = match MirrorStep::of(ctx) {
            MirrorStep::RetryHeld => return self.retry(io),
            MirrorStep::EndWrite(token) => token,
        };
        if let Some(l) = self.layout.upgrade() {
            l.end_write(token);
        }
        io.complete(parent, res)
    }
}

/// # Safety
/// As [`IoHandle::submit`] for `op`'s buffer.
#[inline]
unsafe fn submit_piece(
    handles: &mut [Box<dyn IoHandle>],
    io: &mut CoreIo,
    op: &IoOp,
    p: Piece,
    tag: Tag,
) {
    handles[p.dev].submit(io, piece_op(op, p), tag);
}

#[inline]
fn piece_op(op: &IoOp, p: Piece) -> IoOp {
    match *op {
        IoOp::Read { buf, .. } => IoOp::Read {
            offset: p.dev_offset,
            len: p.len as u32,
            // SAFETY: a piece lies inside its request: range_offset < the request's len,
            // so the pointer stays inside the caller's buffer.
            buf: unsafe { buf.add(p.range_offset as usize) },
        },
        IoOp::Write { buf, .. } => IoOp::Write {
            offset: p.dev_offset,
            len: p.len as u32,
            // SAFETY: as for reads above.
            buf: unsafe { buf.add(p.range_offset as usize) },
        },
        IoOp::Discard { .. } => IoOp::Discard {
            offset: p.dev_offset,
            len: p.len,
        },
        IoOp::WriteZeroes { may_unmap, .. } => IoOp::WriteZeroes {
            offset: p.dev_offset,
            len: p.len,
            may_unmap,
        },
        IoOp::Flush => IoOp::Flush,
    }
}

impl LayoutHandle {
    fn hook_id(&mut self, io: &mut CoreIo) -> u32 {
        if self.hook == u32::MAX {
            // One hook per (core, layout), shared by every handle on the core. The entry
            // remembers its layout: a new layout at a freed layout's address gets its own.
            let key = Arc::as_ptr(&self.layout) as usize ^ 0x6d69_7272;
            let known = io
                .locals
                .get(&key)
                .and_then(|b| b.downcast_ref::<(Rc<MirrorHook>, Weak<Layout>)>())
                .filter(|(_, w)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.layout)))
                .filter(|(_, w)| w.strong_count() > 0)
                .map(|(h, _)| h.clone());
            let h = match known {
                Some(h) => h,
                None => {
                    let w = Arc::downgrade(&self.layout);
                    let h = Rc::new(MirrorHook {
                        layout: w.clone(),
                        id: std::cell::Cell::new(0),
                        waiting: Default::default(),
                        handles: Default::default(),
                    });
                    h.id.set(io.register_hook(h.clone()));
                    io.locals.insert(key, Box::new((h.clone(), w)));
                    h
                }
            };
            self.hook = h.id.get();
            self.mirror = Some(h);
        }
        self.hook
    }

    /// Mirrors: reads go to one healthy copy (round robin), writes to every healthy copy.
    ///
    /// # Safety
    /// As [`IoHandle::submit`] for `op`'s buffer.
    unsafe fn submit_mirror(&mut self, io: &mut CoreIo, op: IoOp, offset: u64, len: u64, tag: Tag) {
        let hook = self.hook_id(io);
        let LayoutHandle {
            layout,
            handles,
            rr,
            ..
        } = self;
        let failed = layout.failed.load(Relaxed);
        let rebuilding = layout.rebuilding.load(Relaxed);
        let c = layout.copies as usize;
        let n = layout.piece_count(offset, len);
        if let IoOp::Read { .. } = op {
            let failed = failed | rebuilding;
            *rr = rr.wrapping_add(1);
            let t = if n == 1 { tag } else { io.join(tag, n as u32) };
            for p in layout.pieces(offset, len) {
                let pick = (0..c)
                    .map(|k| p.dev + (*rr as usize + k) % c)
                    .find(|&d| failed & (1 << d) == 0);
                let Some(d) = pick else {
                    io.complete(t, -libc::EIO);
                    continue;
                };
                let mut q = p;
                q.dev = d;
                let sub = piece_op(&op, q);
                let h = io.hooked(t, hook, sub, d as u64);
                handles[d].submit(io, sub, h);
            }
            return;
        }
        // Writes, discards, zeroes: held back while a rebuild or scrub holds their range.
        if (rebuilding != 0 || layout.tracking.load(SeqCst) != 0) && layout.held(offset, len) {
            let h = self.mirror.as_ref().expect("registered by hook_id");
            return h.hold(io, op, offset, len, tag);
        }
        mirror_write(layout, handles, io, op, offset, len, tag, hook);
    }
}

/// A mirror write (or discard, zeroes): every healthy copy of every piece, one join; tracked
/// while a rebuild or scrub runs.
///
/// # Safety
/// As [`IoHandle::submit`] for `op`'s buffer.
#[allow(clippy::too_many_arguments)]
unsafe fn mirror_write(
    layout: &Layout,
    handles: &mut [Box<dyn IoHandle>],
    io: &mut CoreIo,
    op: IoOp,
    offset: u64,
    len: u64,
    tag: Tag,
    hook: u32,
) {
    let failed = layout.failed.load(Relaxed);
    let rebuilding = layout.rebuilding.load(Relaxed);
    let mut parts = 0u32;
    for p in layout.pieces(offset, len) {
        let alive = layout
            .set_of(p.dev)
            .filter(|&d| failed & (1 << d) == 0)
            .count();
        parts += alive.max(1) as u32;
    }
    let t = if rebuilding == 0 && layout.tracking.load(SeqCst) == 0 {
        io.join(tag, parts)
    } else {
        let token = layout.begin_write(offset, len);
        io.tracked(tag, parts, hook, MirrorStep::EndWrite(token).ctx())
    };
    for p in layout.pieces(offset, len) {
        let mut any = false;
        for d in layout.set_of(p.dev) {
            if failed & (1 << d) != 0 {
                continue;
            }
            any = true;
            let mut q = p;
            q.dev = d;
            let sub = piece_op(&op, q);
            let h = io.hooked(t, hook, sub, d as u64);
            handles[d].submit(io, sub, h);
        }
        if !any {
            io.complete(t, -libc::EIO);
        }
    }
}

impl IoHandle for LayoutHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        if self.layout.parity.is_some() {
            let LayoutHandle { layout, engine, .. } = self;
            let e = engine.get_or_insert_with(|| crate::parity_io::engine_for(io, layout));
            return e.submit(io, layout, op, tag);
        }
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, len as u64)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => {
                let failed = self.layout.failed.load(Relaxed);
                let n = self.handles.len() - failed.count_ones() as usize;
                if n == 0 {
                    return io.complete(tag, -libc::EIO);
                }
                let mirror = self.layout.copies > 1;
                let hook = if mirror { self.hook_id(io) } else { 0 };
                let t = if n == 1 { tag } else { io.join(tag, n as u32) };
                for (i, h) in self.handles.iter_mut().enumerate() {
                    if failed & (1 << i) == 0 {
                        // Mirrors: a copy that cannot flush is failed, like one that
                        // cannot write.
                        let ti = if mirror {
                            io.hooked(t, hook, IoOp::Flush, i as u64)
                        } else {
                            t
                        };
                        h.submit(io, IoOp::Flush, ti);
                    }
                }
                return;
            }
        };
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|e| e > self.layout.size) {
            return io.complete(tag, if len == 0 { 0 } else { -libc::EINVAL });
        }
        if self.layout.copies > 1 {
            return self.submit_mirror(io, op, offset, len, tag);
        }
        // Split borrows instead of cloning the Arc: a clone would be an atomic write to
        // a cache line every core shares.
        let LayoutHandle {
            layout, handles, ..
        } = self;
        let n = layout.piece_count(offset, len);
        if n == 1 {
            let p = layout.piece(offset, len);
            return submit_piece(handles, io, &op, p, tag);
        }
        let t = io.join(tag, n as u32);
        for p in layout.pieces(offset, len) {
            submit_piece(handles, io, &op, p, t);
        }
    }

    fn size(&self) -> u64 {
        self.layout.size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
