//! Thin volumes: a map from volume units to pool units, filled on first write.
//!
//! The map is an array of atomics read without a lock on every I/O. It changes only on
//! allocation, release and resize, which take the pool lock; readers on other cores see
//! a new mapping after it was published (Release/Acquire), and a unit is zeroed before it
//! is published, so no reader ever sees another volume's old data.

// Not yet audited for the workspace lint (9 casts, mostly u64 lengths and offsets to
// usize on this 64-bit-only code): remove this line and fix or justify each one.
#![allow(clippy::cast_possible_truncation)]

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};

use tessera_export::{ExportHandle, ExportTarget, StatsRegistry};
pub use tessera_export::{IoClass, IoStats, StatsSnapshot};
use tessera_io::{CoreIo, IoHandle, IoOp, Tag};

use crate::layout::LayoutHandle;
use crate::pool::PoolCore;

/// Map entry of a unit that has no space yet: it reads as zeros.
pub const HOLE: u32 = u32::MAX;

pub struct UnitMap {
    entries: Box<[AtomicU32]>,
}

impl UnitMap {
    pub fn new(units: u64) -> Arc<UnitMap> {
        Arc::new(UnitMap {
            entries: (0..units).map(|_| AtomicU32::new(HOLE)).collect(),
        })
    }
    #[inline]
    pub fn get(&self, unit: u64) -> u32 {
        self.entries
            .get(unit as usize)
            .map_or(HOLE, |e| e.load(Acquire))
    }
    pub(crate) fn set(&self, unit: u64, p: u32) {
        self.entries[unit as usize].store(p, Release);
    }
    pub fn len(&self) -> u64 {
        self.entries.len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

pub struct Volume {
    pub id: u32,
    pub name: String,
    pub created: u64,
    size: AtomicU64,
    map: RwLock<Arc<UnitMap>>,
    /// Bumped whenever `map` is replaced (resize), so handles know to reload it.
    map_gen: AtomicU64,
    pub(crate) allocated: AtomicU64,
    open_handles: AtomicUsize,
    deleted: AtomicBool,
    stats: StatsRegistry,
    /// QoS limits found in pool metadata written before QoS moved to the node's catalog
    /// (docs/format.md §3.2, legacy). Written back by every checkpoint until the node has
    /// taken them into its catalog ([`Volume::clear_legacy_qos`]), so a crash in between
    /// loses nothing. New volumes have none.
    legacy_qos: Mutex<Option<tessera_qos::QosLimits>>,
    pub(crate) pool: Arc<PoolCore>,
}

impl Volume {
    pub(crate) fn new(
        pool: Arc<PoolCore>,
        id: u32,
        name: String,
        size: u64,
        created: u64,
        map: Arc<UnitMap>,
        legacy_qos: tessera_qos::QosLimits,
    ) -> Arc<Volume> {
        Arc::new(Volume {
            id,
            name,
            created,
            size: AtomicU64::new(size),
            map: RwLock::new(map),
            map_gen: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            open_handles: AtomicUsize::new(0),
            deleted: AtomicBool::new(false),
            stats: StatsRegistry::default(),
            legacy_qos: Mutex::new(
                (legacy_qos != tessera_qos::QosLimits::default()).then_some(legacy_qos),
            ),
            pool,
        })
    }

    pub fn size(&self) -> u64 {
        self.size.load(Acquire)
    }

    /// QoS limits this volume's pool metadata still carries from before QoS moved to the
    /// node's catalog, if any (read once by the node, which migrates them).
    pub fn legacy_qos(&self) -> Option<tessera_qos::QosLimits> {
        self.legacy_qos
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The node's catalog holds the legacy limits now: the next checkpoint drops them.
    pub fn clear_legacy_qos(&self) {
        *self.legacy_qos.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Bytes of pool space this volume holds.
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Relaxed) << self.pool.unit_shift
    }

    pub fn pool_name(&self) -> &str {
        &self.pool.name
    }

    pub fn open_handles(&self) -> usize {
        self.open_handles.load(Relaxed)
    }

    pub(crate) fn is_deleted(&self) -> bool {
        self.deleted.load(Acquire)
    }

    pub(crate) fn mark_deleted(&self) {
        self.deleted.store(true, Release);
    }

    pub(crate) fn current_map(&self) -> Arc<UnitMap> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Called under the pool lock, so no allocation races the copy.
    pub(crate) fn grow(&self, new_size: u64, units: u64) {
        let old = self.current_map();
        let new = UnitMap::new(units);
        for u in 0..old.len() {
            new.entries[u as usize].store(old.get(u), Relaxed);
        }
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = new;
        self.map_gen.fetch_add(1, Release);
        self.size.store(new_size, Release);
    }

    /// Whether `[offset, offset+len)` is allocated, as runs of (length, allocated).
    /// Lengths are clipped to the range; adjacent runs with the same state are merged.
    pub fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        let map = self.current_map();
        let shift = self.pool.unit_shift;
        let end = offset.saturating_add(len).min(self.size());
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut at = offset;
        while at < end {
            let u = at >> shift;
            let seg_end = ((u + 1) << shift).min(end);
            let alloc = map.get(u) != HOLE;
            match runs.last_mut() {
                Some((l, a)) if *a == alloc => *l += seg_end - at,
                _ => {
                    if runs.len() == max_runs {
                        break;
                    }
                    runs.push((seg_end - at, alloc));
                }
            }
            at = seg_end;
        }
        runs
    }

    /// A stats block for one connection; hand it back with [`Volume::unregister_stats`].
    pub fn register_stats(&self) -> Arc<IoStats> {
        self.stats.register()
    }

    /// Fold a closed connection's figures into the volume's totals.
    pub fn unregister_stats(&self, s: &Arc<IoStats>) {
        self.stats.unregister(s)
    }

    /// Cumulative figures of every connection, open or closed.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// A datapath handle for the calling core.
    pub fn open_handle(self: &Arc<Self>) -> VolumeHandle {
        self.open_handles.fetch_add(1, Relaxed);
        let map = self.current_map();
        VolumeHandle {
            gen: self.map_gen.load(Acquire),
            map,
            layout: self.pool.layout.open_handle(),
            shift: self.pool.unit_shift,
            vol: self.clone(),
        }
    }
}

/// One core's handle to a volume.
pub struct VolumeHandle {
    vol: Arc<Volume>,
    map: Arc<UnitMap>,
    gen: u64,
    layout: LayoutHandle,
    shift: u32,
}

impl Drop for VolumeHandle {
    fn drop(&mut self) {
        self.vol.open_handles.fetch_sub(1, Relaxed);
    }
}

impl VolumeHandle {
    pub fn volume(&self) -> &Arc<Volume> {
        &self.vol
    }

    /// True when no byte of `[offset, offset+len)` has space, so it reads as zeros without
    /// device I/O. Uses this core's cached map: no lock, no shared write, no allocation.
    pub fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        self.refresh();
        let last = (offset + len.max(1) - 1) >> self.shift;
        ((offset >> self.shift)..=last).all(|u| self.map.get(u) == HOLE)
    }

    #[inline]
    fn refresh(&mut self) {
        let g = self.vol.map_gen.load(Acquire);
        if g != self.gen {
            self.map = self.vol.current_map();
            self.gen = g;
        }
    }

    #[inline]
    fn pool_offset(&self, p: u32, at: u64) -> u64 {
        ((p as u64) << self.shift) | (at & ((1u64 << self.shift) - 1))
    }

    /// Split `[offset, offset+len)` at unit boundaries; call `f(unit, at, seg_len, range_off, tag)`.
    #[inline]
    fn for_units(
        &mut self,
        io: &mut CoreIo,
        offset: u64,
        len: u64,
        tag: Tag,
        mut f: impl FnMut(&mut Self, &mut CoreIo, u64, u64, u64, u64, Tag),
    ) {
        let first = offset >> self.shift;
        let last = (offset + len - 1) >> self.shift;
        if first == last {
            return f(self, io, first, offset, len, 0, tag);
        }
        let t = io.join(tag, (last - first + 1) as u32);
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let u = at >> self.shift;
            let seg = (((u + 1) << self.shift).min(end)) - at;
            f(self, io, u, at, seg, at - offset, t);
            at += seg;
        }
    }
}

impl IoHandle for VolumeHandle {
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        self.refresh();
        let size = self.vol.size();
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, len as u64)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => {
                match io.remote_completer() {
                    Some(rc) => self.vol.pool.request_flush(rc, tag),
                    None => {
                        let r = self.vol.pool.commit().map_or(-libc::EIO, |_| 0);
                        io.complete(tag, r);
                    }
                }
                return;
            }
        };
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return io.complete(tag, -libc::EINVAL);
        }
        if len == 0 {
            return io.complete(tag, 0);
        }
        match op {
            IoOp::Read { buf, .. } => {
                self.for_units(io, offset, len, tag, |h, io, u, at, seg, roff, t| {
                    let p = h.map.get(u);
                    // SAFETY: roff + seg <= len, within the submitter's buffer.
                    let b = unsafe { buf.add(roff as usize) };
                    if p == HOLE {
                        // SAFETY: as above.
                        unsafe { std::ptr::write_bytes(b, 0, seg as usize) };
                        io.complete(t, 0);
                    } else {
                        let off = h.pool_offset(p, at);
                        h.layout.submit(
                            io,
                            IoOp::Read {
                                offset: off,
                                len: seg as u32,
                                buf: b,
                            },
                            t,
                        );
                    }
                })
            }
            IoOp::Write { buf, .. } => {
                self.for_units(io, offset, len, tag, |h, io, u, at, seg, roff, t| {
                    let mut p = h.map.get(u);
                    if p == HOLE {
                        match h.vol.pool.allocate(&h.vol, u, seg == 1u64 << h.shift) {
                            Ok(n) => p = n,
                            Err(e) => return io.complete(t, e),
                        }
                    }
                    let off = h.pool_offset(p, at);
                    // SAFETY: roff + seg <= len, within the submitter's buffer.
                    let b = unsafe { buf.add(roff as usize) };
                    h.layout.submit(
                        io,
                        IoOp::Write {
                            offset: off,
                            len: seg as u32,
                            buf: b,
                        },
                        t,
                    );
                })
            }
            IoOp::Discard { .. } => {
                self.release_whole_units(offset, len);
                io.complete(tag, 0);
            }
            IoOp::WriteZeroes { may_unmap, .. } => {
                self.write_zeroes(io, offset, len, may_unmap, tag)
            }
            IoOp::Flush => unreachable!("handled above"),
        }
    }

    fn size(&self) -> u64 {
        self.vol.size()
    }
}

impl VolumeHandle {
    /// Release every unit wholly inside the range; partial units are left alone
    /// (discard is advisory).
    fn release_whole_units(&mut self, offset: u64, len: u64) {
        let unit = 1u64 << self.shift;
        let first = offset.div_ceil(unit);
        let end = offset + len;
        // The volume's last unit may be partial: it counts as whole when the range
        // reaches the end of the volume.
        let last_excl = if end >= self.vol.size() {
            end.div_ceil(unit)
        } else {
            end / unit
        };
        if last_excl > first {
            self.vol.pool.unmap_units(&self.vol, first, last_excl - 1);
        }
    }

    fn write_zeroes(&mut self, io: &mut CoreIo, offset: u64, len: u64, may_unmap: bool, tag: Tag) {
        if may_unmap {
            self.release_whole_units(offset, len);
        }
        // What is left, unit by unit (like reads and writes: one join, no allocation):
        // mapped parts get zeros written; holes already read as zeros, but NO_HOLE asks
        // for space, so they are allocated (allocation zeroes them).
        self.for_units(io, offset, len, tag, |h, io, u, at, seg, _roff, t| {
            let p = h.map.get(u);
            if p != HOLE {
                let offset = h.pool_offset(p, at);
                // SAFETY: WriteZeroes carries no buffer.
                unsafe {
                    h.layout.submit(
                        io,
                        IoOp::WriteZeroes {
                            offset,
                            len: seg,
                            may_unmap: false,
                        },
                        t,
                    )
                };
            } else if may_unmap {
                io.complete(t, 0);
            } else {
                let r = h
                    .vol
                    .pool
                    .allocate(&h.vol, u, false)
                    .map_or_else(|e| e, |_| 0);
                io.complete(t, r);
            }
        });
    }
}

/// The thin volume as an export target: what NBD and NVMe/TCP serve.
impl ExportTarget for Volume {
    type Handle = VolumeHandle;

    fn size(&self) -> u64 {
        Volume::size(self)
    }

    fn allocated_bytes(&self) -> u64 {
        Volume::allocated_bytes(self)
    }

    fn allocation_runs(&self, offset: u64, len: u64, max_runs: usize) -> Vec<(u64, bool)> {
        Volume::allocation_runs(self, offset, len, max_runs)
    }

    fn register_stats(&self) -> Arc<IoStats> {
        Volume::register_stats(self)
    }

    fn unregister_stats(&self, stats: &Arc<IoStats>) {
        Volume::unregister_stats(self, stats)
    }

    fn stats(&self) -> StatsSnapshot {
        Volume::stats(self)
    }

    fn open(self: &Arc<Self>) -> VolumeHandle {
        self.open_handle()
    }
}

impl ExportHandle for VolumeHandle {
    #[inline]
    unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        IoHandle::submit(self, io, op, tag)
    }

    #[inline]
    fn is_hole(&mut self, offset: u64, len: u64) -> bool {
        VolumeHandle::is_hole(self, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tessera_device::{BlockDevice, RamDevice};
    use tessera_qos::QosLimits;

    use crate::{Pool, PoolOptions};

    /// QoS limits in pool metadata (written before QoS moved to the node's catalog) are
    /// read back, and written back by checkpoints, until the node has taken them.
    #[test]
    fn legacy_qos_limits_are_kept_until_cleared() {
        let dev: Arc<dyn BlockDevice> = RamDevice::new(64 << 20).unwrap();
        let pool = Pool::create("p", vec![dev.clone()], PoolOptions::default()).unwrap();
        let vol = pool.create_volume("v", 8 << 20).unwrap();
        assert_eq!(vol.legacy_qos(), None);
        let limits = QosLimits {
            iops: Some(1000),
            ..QosLimits::default()
        };
        // As an older version wrote it.
        *vol.legacy_qos.lock().unwrap() = Some(limits.clone());
        pool.core.checkpoint().unwrap();
        drop((vol, pool));

        let pool = Pool::open(vec![dev.clone()]).unwrap();
        let vol = pool.volume_by_id(1).unwrap();
        assert_eq!(vol.legacy_qos(), Some(limits));
        vol.clear_legacy_qos();
        pool.core.checkpoint().unwrap();
        drop((vol, pool));

        let pool = Pool::open(vec![dev]).unwrap();
        assert_eq!(pool.volume_by_id(1).unwrap().legacy_qos(), None);
    }
}
