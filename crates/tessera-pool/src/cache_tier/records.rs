//! Write-back's slot records on the cache devices (docs/format.md §16): where the record
//! area and the slots lie, how a record is encoded, and the record writer, which writes
//! records one block at a time, each built from the slots' state in RAM at that moment,
//! so a later write of a record block always carries every earlier change to it.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tessera_io::buf::AlignedBuf;
use tessera_io::sync::MutexExt;
use tessera_io::{CoreIo, IoHandle, IoOp, RemoteCompleter, Tag};

use super::CacheTier;
use crate::format::{crc, BLOCK};
use crate::layout::Layout;

const MIB: u64 = 1 << 20;
/// Magic of a slot record.
pub(crate) const RECORD_MAGIC: &[u8; 4] = b"TSWB";
/// A record is one sector: a torn write of a record block leaves each record whole,
/// old or new.
pub(crate) const SECTOR: usize = 512;
/// Sectors per 4 KiB record block.
const PER_BLOCK: u64 = (BLOCK / SECTOR) as u64;
/// Blocks of a slot one record covers (one 64-bit word of its bitmaps).
pub(crate) const GROUP: usize = 64;

/// Where a tier's records and slots lie on its layout (which starts at device offset
/// 1 MiB, after the label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    /// 4 KiB blocks per cache unit (`B`).
    pub blocks: usize,
    /// Records per slot (`G`): one per 64 blocks.
    pub groups: u64,
    /// Bytes of the record area (`M`), where the slots start.
    pub meta_len: u64,
    /// Slots (`S`).
    pub slots: u64,
}

impl Geometry {
    /// The geometry of a tier with `size` bytes of layout and units of `1 << unit_shift`.
    pub fn new(size: u64, unit_shift: u32) -> Geometry {
        let unit = 1u64 << unit_shift;
        let blocks = usize::try_from(unit >> 12).expect("at most 256");
        let groups = blocks.div_ceil(GROUP) as u64;
        let meta = |slots: u64| (slots * groups * SECTOR as u64).next_multiple_of(MIB);
        let meta_len = meta(size / unit);
        let slots = size.saturating_sub(meta_len) / unit;
        Geometry {
            blocks,
            groups,
            meta_len,
            slots,
        }
    }

    /// The record blocks that hold slot `s`'s records.
    pub fn blocks_of(&self, s: u64) -> std::ops::RangeInclusive<u64> {
        let first = s * self.groups;
        first / PER_BLOCK..=(first + self.groups - 1) / PER_BLOCK
    }

    /// Record blocks in use.
    pub fn record_blocks(&self) -> u64 {
        (self.slots * self.groups).div_ceil(PER_BLOCK)
    }
}

/// One record as RAM knows it: the unit its slot holds and, for the dirty blocks of its
/// group, the CRC32C of their bytes.
pub(crate) struct Record<'a> {
    pub key: u64,
    pub group: u32,
    pub dirty: u64,
    pub crcs: Option<&'a [u32]>,
}

/// Encode `r` into `out` (one sector).
pub(crate) fn encode(epoch: u64, r: &Record<'_>, out: &mut [u8]) {
    out.fill(0);
    out[..4].copy_from_slice(RECORD_MAGIC);
    out[8..16].copy_from_slice(&epoch.to_le_bytes());
    out[16..24].copy_from_slice(&r.key.to_le_bytes());
    out[24..28].copy_from_slice(&r.group.to_le_bytes());
    out[32..40].copy_from_slice(&r.dirty.to_le_bytes());
    if let Some(crcs) = r.crcs {
        for (b, c) in crcs.iter().enumerate().take(GROUP) {
            out[40 + 4 * b..44 + 4 * b].copy_from_slice(&c.to_le_bytes());
        }
    }
    let c = crc(out);
    out[4..8].copy_from_slice(&c.to_le_bytes());
}

/// A record's unit, group, dirty blocks and their CRCs, if it is one of epoch `epoch`
/// with dirty blocks.
pub(crate) fn decode(epoch: u64, b: &[u8]) -> Option<(u64, u32, u64, [u32; GROUP])> {
    let b = &b[..SECTOR];
    if &b[..4] != RECORD_MAGIC || b[8..16] != epoch.to_le_bytes() {
        return None;
    }
    let mut copy = b.to_vec();
    copy[4..8].fill(0);
    if crc(&copy).to_le_bytes() != b[4..8] {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let dirty = word(32);
    if dirty == 0 {
        return None;
    }
    let group = u32::from_le_bytes(b[24..28].try_into().expect("4 bytes"));
    let mut crcs = [0u32; GROUP];
    for (i, c) in crcs.iter_mut().enumerate() {
        *c = u32::from_le_bytes(b[40 + 4 * i..44 + 4 * i].try_into().expect("4 bytes"));
    }
    Some((word(16), group, dirty, crcs))
}

/// A request to the record writer: the record block of slot `slot` (global index) is to
/// be written; `waiter`, if any, is completed once it was (with the write's result).
pub(crate) struct RecordRequest {
    pub slot: u64,
    pub waiter: Option<(RemoteCompleter, Tag)>,
}

/// Write runs `(first block, index of it in bytes, blocks)` of `bytes` to `layout`,
/// up to `RUNS_IN_FLIGHT` at once, every copy of a mirror at once, through an io_uring
/// of the calling thread (record writes come from the record writer, the cleaners and
/// the control plane, one at a time: `record_io`). Before, a batch spawned threads that
/// wrote the copies one after the other: 1.3 ms for a batch of 8 scattered records on
/// two mirrored files, which held write-back writes to ~5,700 a second.
fn write_runs(
    layout: &Arc<Layout>,
    bytes: &[u8],
    runs: &[(u64, usize, usize)],
) -> std::io::Result<()> {
    /// Runs submitted before waiting for them (the ring's size).
    const RUNS_IN_FLIGHT: u32 = 32;
    thread_local! {
        static RING: RefCell<Option<CoreIo>> = const { RefCell::new(None) };
    }
    RING.with(|ring| {
        let mut ring = ring.borrow_mut();
        if ring.is_none() {
            *ring = Some(CoreIo::new(0, RUNS_IN_FLIGHT * 2, None)?);
        }
        let io = ring.as_mut().expect("set above");
        let mut handle = layout.open_handle();
        let mut failed = 0;
        for wave in runs.chunks(RUNS_IN_FLIGHT as usize) {
            for (k, &(first, at, len)) in wave.iter().enumerate() {
                let op = IoOp::Write {
                    offset: first * BLOCK as u64,
                    len: u32::try_from(len * BLOCK).expect("a batch is far below 4 GiB"),
                    buf: bytes[at * BLOCK..(at + len) * BLOCK].as_ptr(),
                };
                let tag = Tag::task(0, u32::try_from(k).expect("small"));
                // SAFETY: `bytes` outlives the write: the wave is waited for below.
                unsafe { handle.submit(io, op, tag) };
            }
            io.run_until_idle(|_, _, res| {
                if res < 0 && failed == 0 {
                    failed = res;
                }
            });
        }
        if failed < 0 {
            return Err(std::io::Error::from_raw_os_error(-failed));
        }
        Ok(())
    })
}

/// The record writer's loop: each batch of requests writes each record block asked for
/// once, then completes the requests' waiters.
pub(super) fn writer_loop(tier: Weak<CacheTier>, rx: Receiver<RecordRequest>) {
    loop {
        let first = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                if tier.strong_count() == 0 {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut blocks = BTreeSet::new();
        let mut waiters = Vec::new();
        for r in std::iter::once(first).chain(rx.try_iter()) {
            if let Some(w) = r.waiter {
                waiters.push(w);
            }
            blocks.insert(r.slot);
        }
        let res = match tier.upgrade() {
            Some(t) => {
                let geo = t.geo;
                let set: BTreeSet<u64> = blocks.iter().flat_map(|&s| geo.blocks_of(s)).collect();
                match t.write_record_blocks(&set) {
                    Ok(()) => 0,
                    Err(e) => {
                        tracing::error!(error = %e, "writing cache slot records failed");
                        t.fail();
                        -libc::EIO
                    }
                }
            }
            None => -libc::ESHUTDOWN,
        };
        for (rc, tag) in waiters {
            rc.complete(tag, res);
        }
    }
}

impl CacheTier {
    /// Write record blocks `blocks`, each built from RAM as it is now. One writer at a
    /// time (`record_io`), so blocks reach the devices in the order they were built.
    ///
    /// A batch for scattered slots names scattered blocks: runs of adjacent blocks are
    /// written as one write each, all at once (`write_runs`), from a buffer aligned for
    /// O_DIRECT (an unaligned one costs the device a read before each write), so a
    /// batch costs about one device write, not one per block.
    pub(crate) fn write_record_blocks(&self, blocks: &BTreeSet<u64>) -> std::io::Result<()> {
        if blocks.is_empty() {
            return Ok(());
        }
        let _one = self.record_io.locked();
        let list: Vec<u64> = blocks.iter().copied().collect();
        let mut buf = AlignedBuf::zeroed(list.len() * BLOCK);
        for (n, chunk) in buf.as_mut_slice()[..list.len() * BLOCK]
            .chunks_mut(BLOCK)
            .enumerate()
        {
            let j = list[n];
            for i in 0..PER_BLOCK {
                let q = j * PER_BLOCK + i;
                let s = q / self.geo.groups;
                if s >= self.geo.slots {
                    break;
                }
                let at = usize::try_from(i).expect("small") * SECTOR;
                let group = u32::try_from(q % self.geo.groups).expect("small");
                self.encode_record(s, group, &mut chunk[at..at + SECTOR]);
            }
        }
        // Runs: (first block, index of it in `list`, blocks).
        let mut runs: Vec<(u64, usize, usize)> = Vec::new();
        for (n, &j) in list.iter().enumerate() {
            match runs.last_mut() {
                Some((first, _, len)) if *first + *len as u64 == j => *len += 1,
                _ => runs.push((j, n, 1)),
            }
        }
        write_runs(&self.layout, buf.as_slice(), &runs)
    }

    /// Write the record blocks of `slots` (global indices) and, with `sync`, sync the
    /// cache devices.
    pub(crate) fn write_records_of(&self, slots: &[u64], sync: bool) -> std::io::Result<()> {
        let set: BTreeSet<u64> = slots.iter().flat_map(|&s| self.geo.blocks_of(s)).collect();
        if !set.is_empty() {
            self.write_record_blocks(&set)?;
        }
        if sync {
            self.layout.sync()?;
        }
        Ok(())
    }

    /// Ask the record writer for slot `slot`'s record block; `waiter` is completed once
    /// it is written. Without a writer (the tier is going away) the waiter gets an error.
    pub(crate) fn request_record(&self, slot: u64, waiter: Option<(RemoteCompleter, Tag)>) {
        let tx = self.records_tx.locked();
        let req = RecordRequest { slot, waiter };
        if let Some(tx) = tx.as_ref() {
            if let Err(e) = tx.send(req) {
                if let Some((rc, tag)) = e.0.waiter {
                    rc.complete(tag, -libc::ESHUTDOWN);
                }
            }
        } else if let Some((rc, tag)) = req.waiter {
            rc.complete(tag, -libc::ESHUTDOWN);
        }
    }

    /// Start the record writer.
    pub(super) fn start_writer(self: &Arc<Self>) {
        let (tx, rx) = std::sync::mpsc::channel();
        *self.records_tx.locked() = Some(tx);
        let weak = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("cache-records".into())
            .spawn(move || writer_loop(weak, rx))
            .expect("spawning the cache record writer");
        self.threads.locked().push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_the_format() {
        let g = Geometry::new(1 << 30, 20);
        assert_eq!((g.blocks, g.groups), (256, 4));
        // 1,024 slots of 4 records: 2 MiB.
        assert_eq!(g.meta_len, 2 << 20);
        assert_eq!(g.slots, 1022);
        assert_eq!(g.blocks_of(1), 0..=0);
        assert_eq!(g.blocks_of(2), 1..=1);
        let g = Geometry::new(1 << 30, 14);
        assert_eq!((g.blocks, g.groups), (4, 1));
        // 65,536 slots of one record: 32 MiB.
        assert_eq!(g.meta_len, 32 << 20);
        assert_eq!(g.slots, ((1 << 30) - (32 << 20)) >> 14);
        assert_eq!(g.blocks_of(9), 1..=1);
        for shift in 14..=20 {
            let g = Geometry::new(64 << 20, shift);
            assert!(g.record_blocks() * BLOCK as u64 <= g.meta_len);
            assert!(g.meta_len + (g.slots << shift) <= 64 << 20);
        }
    }

    #[test]
    fn records_round_trip_and_reject_damage() {
        let mut crcs = vec![0u32; GROUP];
        crcs[1] = 0xdead_beef;
        let mut b = vec![0u8; SECTOR];
        let r = Record {
            key: 77,
            group: 2,
            dirty: 0b10,
            crcs: Some(&crcs),
        };
        encode(5, &r, &mut b);
        let (k, g, d, c) = decode(5, &b).expect("decodes");
        assert_eq!((k, g, d, c[1]), (77, 2, 0b10, 0xdead_beef));
        assert!(decode(6, &b).is_none(), "another epoch");
        b[SECTOR - 1] ^= 1;
        assert!(decode(5, &b).is_none(), "a damaged record");
    }
}
