//! Layouts: how a pool's logical address space maps onto its devices.
//!
//! The mapping is pure arithmetic (power-of-two stripes use shifts and masks), so the
//! datapath pays a few instructions per request and keeps no per-request state: a request
//! that spans several devices is split, and the pieces share one join on the core.

use std::io;
use std::sync::Arc;

use tessera_device::BlockDevice;
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

use crate::format::DEV_DATA_START;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    Concat,
    /// Striping with a power-of-two stripe size in bytes.
    Raid0 {
        stripe: u64,
    },
}

impl LayoutKind {
    pub fn name(&self) -> &'static str {
        match self {
            LayoutKind::Concat => "concat",
            LayoutKind::Raid0 { .. } => "raid0",
        }
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
        if let Some(i) = usable.iter().position(|&u| u == 0) {
            return Err(format!(
                "device {} is too small (a device needs more than 1 MiB)",
                devices[i].describe()
            ));
        }
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
        };
        Ok(Layout {
            kind,
            devices,
            dev_data_len,
            starts,
            stripe_shift,
            size,
        })
    }

    /// Number of device pieces `[offset, offset+len)` splits into (len > 0).
    #[inline]
    pub fn piece_count(&self, offset: u64, len: u64) -> u64 {
        match self.kind {
            LayoutKind::Raid0 { .. } => {
                ((offset + len - 1) >> self.stripe_shift) - (offset >> self.stripe_shift) + 1
            }
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

    /// The first piece of `[offset, offset+len)`.
    #[inline]
    pub fn piece(&self, offset: u64, len: u64) -> Piece {
        match self.kind {
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

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(e) if e <= self.size => Ok(()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("range {offset}+{len} beyond pool size {}", self.size),
            )),
        }
    }

    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        for p in self.pieces(offset, buf.len() as u64) {
            let r = p.range_offset as usize..(p.range_offset + p.len) as usize;
            self.devices[p.dev].read_at(p.dev_offset, &mut buf[r])?;
        }
        Ok(())
    }

    pub fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.check(offset, buf.len() as u64)?;
        for p in self.pieces(offset, buf.len() as u64) {
            let r = p.range_offset as usize..(p.range_offset + p.len) as usize;
            self.devices[p.dev].write_at(p.dev_offset, &buf[r])?;
        }
        Ok(())
    }

    pub fn write_zeroes_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        for p in self.pieces(offset, len) {
            self.devices[p.dev].write_zeroes_at(p.dev_offset, p.len)?;
        }
        Ok(())
    }

    pub fn sync(&self) -> io::Result<()> {
        for d in &self.devices {
            d.sync().map_err(|e| {
                io::Error::new(e.kind(), format!("{}: sync failed: {e}", d.describe()))
            })?;
        }
        Ok(())
    }

    pub fn is_volatile(&self) -> bool {
        self.devices.iter().any(|d| d.is_volatile())
    }

    /// Datapath handle for the calling core.
    pub fn open_handle(self: &Arc<Self>) -> LayoutHandle {
        LayoutHandle {
            layout: self.clone(),
            handles: self
                .devices
                .iter()
                .map(|d| d.clone().open_handle())
                .collect(),
        }
    }
}

/// A per-core handle to a layout: one device handle per device.
pub struct LayoutHandle {
    layout: Arc<Layout>,
    handles: Vec<Box<dyn IoHandle>>,
}

#[inline]
fn submit_piece(handles: &mut [Box<dyn IoHandle>], io: &mut CoreIo, op: &IoOp, p: Piece, tag: Tag) {
    let op = match *op {
        // SAFETY (pointer arithmetic): range_offset < len of the caller's buffer.
        IoOp::Read { buf, .. } => IoOp::Read {
            offset: p.dev_offset,
            len: p.len as u32,
            buf: unsafe { buf.add(p.range_offset as usize) },
        },
        IoOp::Write { buf, .. } => IoOp::Write {
            offset: p.dev_offset,
            len: p.len as u32,
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
    };
    handles[p.dev].submit(io, op, tag);
}

impl IoHandle for LayoutHandle {
    #[inline]
    fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, len as u64)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => {
                let n = self.handles.len();
                let t = if n == 1 { tag } else { io.join(tag, n as u32) };
                for h in &mut self.handles {
                    h.submit(io, IoOp::Flush, t);
                }
                return;
            }
        };
        let end = offset.checked_add(len);
        if len == 0 || end.is_none_or(|e| e > self.layout.size) {
            return io.complete(tag, if len == 0 { 0 } else { -libc::EINVAL });
        }
        // Split borrows instead of cloning the Arc: a clone would be an atomic write to
        // a cache line every core shares.
        let LayoutHandle { layout, handles } = self;
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
