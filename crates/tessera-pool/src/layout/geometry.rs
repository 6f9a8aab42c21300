//! Layout geometry: building a layout from its devices, and mapping logical ranges to
//! device pieces (pure arithmetic, no state).

use std::io;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use tessera_io::cast::usize_of;

use tessera_device::BlockDevice;

use super::{CopyTracker, DeviceHealth, Layout, LayoutError, LayoutKind, Piece};
use crate::format::DEV_DATA_START;

impl Layout {
    /// Compose `devices` (whose first MiB is reserved for the label) into a layout.
    pub fn new(
        kind: LayoutKind,
        devices: Vec<Arc<dyn BlockDevice>>,
    ) -> Result<Layout, LayoutError> {
        let usable = usable_sizes(&devices)?;
        let mut parity = None;
        let sizing = if kind.is_parity() {
            let align = devices
                .iter()
                .map(|d| d.alignment() as u64)
                .max()
                .unwrap_or(1);
            let min = usable.iter().min().copied().unwrap_or(0);
            let p = crate::layout::parity::Parity::new(kind, devices.len(), min, align)?;
            let s = Sizing {
                dev_data_len: vec![p.rows * p.chunk; devices.len()],
                starts: Vec::new(),
                stripe_shift: kind.stripe().trailing_zeros(),
                size: p.rows * p.row_bytes,
            };
            parity = Some(p);
            s
        } else {
            Sizing::plain(kind, usable)?
        };
        let (copies, sets) = match kind {
            LayoutKind::Raid1 { copies } => (copies, 1),
            LayoutKind::Raid10 { copies, .. } => (copies, (devices.len() / copies as usize) as u64),
            _ => (1, devices.len() as u64),
        };
        let n = devices.len();
        let nonvolatile = (0..devices.len())
            .filter(|&d| !devices[d].is_volatile())
            .fold(0u64, |a, d| a | 1 << d);
        Ok(Layout {
            kind,
            health: DeviceHealth::new(devices.len(), nonvolatile),
            devices,
            dev_data_len: sizing.dev_data_len,
            starts: sizing.starts,
            stripe_shift: sizing.stripe_shift,
            size: sizing.size,
            copies,
            sets,
            copy: CopyTracker::default(),
            parity,
            journal_flush: AtomicBool::new(true),
            device_stats: (0..n).map(|_| Default::default()).collect(),
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
                    dev: usize_of((s % self.sets) * self.copies as u64),
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
                    dev: usize_of(s % n),
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

    /// Devices of the mirror set starting at `first` (all devices: one set per device
    /// for concat/raid0).
    #[inline]
    pub(crate) fn set_of(&self, first: usize) -> std::ops::Range<usize> {
        first..first + self.copies as usize
    }
}

/// Each device's usable data area (after the label, in whole 4 KiB blocks), checking the
/// device count and that every device has some.
fn usable_sizes(devices: &[Arc<dyn BlockDevice>]) -> Result<Vec<u64>, LayoutError> {
    if devices.is_empty() {
        return Err(LayoutError::NoDevices);
    }
    if devices.len() > 64 {
        return Err(LayoutError::TooManyDevices);
    }
    let usable: Vec<u64> = devices
        .iter()
        .map(|d| d.size().saturating_sub(DEV_DATA_START) & !4095)
        .collect();
    if let Some(i) = usable.iter().position(|&u| u == 0) {
        return Err(LayoutError::DeviceTooSmall(devices[i].describe()));
    }
    Ok(usable)
}

/// How much of each device a layout uses and how big the result is.
struct Sizing {
    dev_data_len: Vec<u64>,
    /// Concat: logical start of each device's area.
    starts: Vec<u64>,
    stripe_shift: u32,
    size: u64,
}

impl Sizing {
    /// Concat, raid0, raid1 and raid10 (parity layouts size themselves in `Parity::new`).
    fn plain(kind: LayoutKind, usable: Vec<u64>) -> Result<Sizing, LayoutError> {
        let n = usable.len();
        let min = usable.iter().min().copied().unwrap_or(0);
        Ok(match kind {
            LayoutKind::Concat => {
                let mut starts = Vec::with_capacity(n);
                let mut at = 0;
                for &u in &usable {
                    starts.push(at);
                    at += u;
                }
                Sizing {
                    dev_data_len: usable,
                    starts,
                    stripe_shift: 0,
                    size: at,
                }
            }
            LayoutKind::Raid0 { stripe } => {
                let per = stripes_of(min, stripe)?;
                Sizing::uniform(n, per, stripe.trailing_zeros(), per * n as u64)
            }
            LayoutKind::Raid1 { copies } => {
                if copies < 2 || copies as usize != n {
                    return Err(LayoutError::Raid1Copies { copies, devices: n });
                }
                Sizing::uniform(n, min, 63, min)
            }
            LayoutKind::Raid10 { copies, stripe } => {
                check_stripe(stripe)?;
                if copies < 2 || !n.is_multiple_of(copies as usize) || n < 2 * copies as usize {
                    return Err(LayoutError::Raid10Devices {
                        copies,
                        least: 2 * copies.max(2),
                        devices: n,
                    });
                }
                let per = stripes_of(min, stripe)?;
                let sets = (n / copies as usize) as u64;
                Sizing::uniform(n, per, stripe.trailing_zeros(), per * sets)
            }
            LayoutKind::Raid5 { .. } | LayoutKind::Raid6 { .. } | LayoutKind::Ec { .. } => {
                unreachable!("parity layouts are sized by Parity::new")
            }
        })
    }

    fn uniform(n: usize, per: u64, stripe_shift: u32, size: u64) -> Sizing {
        Sizing {
            dev_data_len: vec![per; n],
            starts: Vec::new(),
            stripe_shift,
            size,
        }
    }
}

fn check_stripe(stripe: u64) -> Result<(), LayoutError> {
    if !stripe.is_power_of_two() || !(4096..=(16 << 20)).contains(&stripe) {
        return Err(LayoutError::Stripe(stripe));
    }
    Ok(())
}

/// `min` bytes rounded down to whole stripes (checked), refusing devices smaller than one.
fn stripes_of(min: u64, stripe: u64) -> Result<u64, LayoutError> {
    check_stripe(stripe)?;
    let per = min & !(stripe - 1);
    if per == 0 {
        return Err(LayoutError::SmallerThanStripe);
    }
    Ok(per)
}
