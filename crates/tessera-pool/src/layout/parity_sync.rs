//! The synchronous face of parity layouts (raid5, raid6, ec): whole-row reads and
//! writes under the row lock with their stripe-journal records, zeroing, rebuild, scrub
//! and format. Used off the reactors; the per-core datapath is `crate::layout::parity_io`.

use std::io;
use tessera_io::cast::{u32_of, u8_of, usize_of};

use super::{error_reason, FailReason, Layout};
use crate::format::DEV_DATA_START;
use crate::layout::parity::{
    encode_header, Parity, RecordHead, RowScrub, JOURNAL_LEN, KIND_CHUNK, KIND_FULL,
};

/// What a synchronous row write changes: data shard, offset in the chunk, bytes.
struct Seg<'a> {
    shard: usize,
    off: u64,
    data: &'a [u8],
}

impl Layout {
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

    pub(crate) fn parity_geo(&self) -> &Parity {
        self.parity.as_ref().expect("a parity layout")
    }

    /// The parity datapath's figures (row writes, and the rounds they waited for a row
    /// lock or journal space), every core's summed; None for other layouts.
    pub fn parity_totals(&self) -> Option<crate::layout::parity::ParityTotals> {
        self.parity.as_ref().map(|p| p.counters.snapshot())
    }

    /// Read `[lo, hi)` of every shard of row `r` into `buf` (n × (hi−lo) bytes), the
    /// unreadable ones rebuilt from the others. Caller holds the row lock.
    fn read_row_sync(&self, r: u64, lo: u64, hi: u64, buf: &mut [u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let span = usize_of(hi - lo);
        loop {
            let mut erased = Vec::new();
            let mut retry = false;
            for s in 0..p.n {
                let d = p.shard_dev(r, s);
                if !self.is_readable(d) {
                    erased.push(s);
                    continue;
                }
                let b = &mut buf[s * span..(s + 1) * span];
                if let Err(e) = self.devices[d].read_at(p.row_offset(r) + lo, b) {
                    self.mark_failed(d, error_reason(&e, FailReason::Read));
                    retry = true;
                    break;
                }
            }
            if retry {
                continue;
            }
            if erased.len() > p.m {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            let mut shards: Vec<&mut [u8]> = buf[..p.n * span].chunks_mut(span).collect();
            p.reconstruct(&mut shards, &erased);
            return Ok(());
        }
    }

    /// Synchronous read of pool range `[offset, offset+len)`.
    pub(crate) fn parity_read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let mut done = 0usize;
        while done < buf.len() {
            let (r, i, off) = p.locate(offset + done as u64);
            let n = usize_of(p.chunk - off).min(buf.len() - done);
            let d = p.shard_dev(r, i);
            let dst = &mut buf[done..done + n];
            let direct = self.is_readable(d)
                && match self.devices[d].read_at(p.row_offset(r) + off, dst) {
                    Ok(()) => true,
                    Err(e) => {
                        self.mark_failed(d, error_reason(&e, FailReason::Read));
                        false
                    }
                };
            if !direct {
                let _g = p.lock_sync(r);
                let mut row = vec![0u8; p.n * n];
                self.read_row_sync(r, off, off + n as u64, &mut row)?;
                dst.copy_from_slice(&row[i * n..(i + 1) * n]);
            }
            done += n;
        }
        Ok(())
    }

    /// Synchronous write (metadata, tests): row by row, with the journal.
    pub(crate) fn parity_write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let p = self.parity_geo();
        let mut done = 0usize;
        while done < data.len() {
            let (r, _, _) = p.locate(offset + done as u64);
            let row_end = usize_of((r + 1) * p.row_bytes - offset);
            let end = row_end.min(data.len());
            let mut segs = Vec::new();
            let mut at = done;
            while at < end {
                let (_, i, off) = p.locate(offset + at as u64);
                let n = usize_of(p.chunk - off).min(end - at);
                segs.push(Seg {
                    shard: i,
                    off,
                    data: &data[at..at + n],
                });
                at += n;
            }
            self.write_row_sync(r, &segs)?;
            done = end;
        }
        Ok(())
    }

    /// Zero pool range `[offset, offset+len)` (a unit going back to the free list): whole
    /// rows are zeroed on every device — data and parity, so the row stays consistent —
    /// after a full-row marker (docs/format.md §2.1) so that a crash in between gets the
    /// row's parity resynced; rows shared with a neighbouring range get their part
    /// written as zeros through the journaled row write. Synchronous face: never on a
    /// reactor thread (it waits for row locks held by reactor I/O).
    pub(crate) fn parity_zero(&self, offset: u64, len: u64) -> io::Result<()> {
        let p = self.parity_geo();
        let end = offset + len;
        let mut at = offset;
        let zeros = vec![0u8; usize_of(p.row_bytes)];
        while at < end {
            let r = at / p.row_bytes;
            let row_start = r * p.row_bytes;
            let row_end = row_start + p.row_bytes;
            // A degraded row is zeroed through the journaled row write instead: a torn
            // row missing a chunk cannot be resynced from a marker.
            let healthy = (0..p.n).all(|s| !self.is_failed(p.shard_dev(r, s)));
            if at == row_start && row_end <= end && healthy {
                let g = p.lock_sync(r);
                let failed = self.failed_bits();
                let holders = p.record_holders(r, failed);
                let hl = p.header_len();
                let (jat, id, watermark) = loop {
                    if let Some(a) = p.ring(r).alloc(hl) {
                        break a;
                    }
                    std::thread::yield_now();
                };
                let mut jb = vec![0u8; usize_of(hl)];
                encode_header(
                    &p.uuid(),
                    RecordHead {
                        seq: id,
                        watermark,
                        row: r,
                        version: g.version,
                        kind: KIND_FULL,
                        payload: 0,
                        holders,
                        payload_crc: None,
                    },
                    &[],
                    &mut jb,
                );
                for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
                    if self.devices[d].write_at(jat, &jb).is_err() {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                self.flush_durable(holders);
                for d in 0..p.n {
                    if self.is_failed(d) {
                        continue;
                    }
                    if self.devices[d]
                        .write_zeroes_at(p.row_offset(r), p.chunk)
                        .is_err()
                    {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                self.flush_durable(u64::MAX);
                p.ring(r).release(id);
                drop(g);
                at = row_end;
            } else {
                let n = usize_of(row_end.min(end) - at);
                self.parity_write_at(at, &zeros[..n])?;
                at += n as u64;
            }
        }
        if self.failed_bits().count_ones() as usize > p.m {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Make what was just written to devices `devs` durable (the synchronous face of the
    /// datapath's group flush): journal records before the row is written in place, the
    /// in-place writes before their record is released.
    fn flush_durable(&self, devs: u64) {
        let devs = devs & self.journal_flush_devs();
        for d in (0..self.devices.len()).filter(|d| devs & (1 << d) != 0) {
            if !self.is_failed(d) && self.devices[d].sync().is_err() {
                self.mark_failed(d, FailReason::Write);
            }
        }
    }

    /// Reconstruct-write of one row on the synchronous face: read the row's `[lo, hi)`
    /// (rebuilding what is unreadable), apply the segments, recompute parity, journal the
    /// changed chunks, then write them in place.
    fn write_row_sync(&self, r: u64, segs: &[Seg<'_>]) -> io::Result<()> {
        let p = self.parity_geo();
        let lo = segs.iter().map(|s| s.off).min().unwrap_or(0);
        let hi = segs
            .iter()
            .map(|s| s.off + s.data.len() as u64)
            .max()
            .unwrap_or(0);
        let span = usize_of(hi - lo);
        let g = p.lock_sync(r);
        let mut row = vec![0u8; p.n * span];
        self.read_row_sync(r, lo, hi, &mut row)?;
        for s in segs {
            let a = s.shard * span + usize_of(s.off - lo);
            row[a..a + s.data.len()].copy_from_slice(s.data);
        }
        {
            let mut shards: Vec<&mut [u8]> = row.chunks_mut(span).collect();
            p.encode(&mut shards);
        }
        // What goes where: the changed data ranges and every parity chunk's [lo, hi).
        let mut writes: Vec<(usize, u64, &[u8])> = Vec::new();
        for s in segs {
            let a = s.shard * span + usize_of(s.off - lo);
            writes.push((s.shard, s.off, &row[a..a + s.data.len()]));
        }
        for s in p.k..p.n {
            writes.push((s, lo, &row[s * span..(s + 1) * span]));
        }
        let failed = self.failed_bits();
        let holders = p.record_holders(r, failed);
        let payload: u64 = writes.iter().map(|w| p.entry_len(w.2.len() as u64)).sum();
        let hl = usize_of(p.header_len());
        let rec_len = hl as u64 + payload;
        let mut jb = vec![0u8; usize_of(rec_len)];
        let mut at_p = hl;
        for &(_, _, bytes) in &writes {
            jb[at_p..at_p + bytes.len()].copy_from_slice(bytes);
            at_p += usize_of(p.entry_len(bytes.len() as u64));
        }
        let entries: Vec<(u8, u32, u32)> = writes
            .iter()
            .map(|w| (u8_of(w.0), u32_of(w.1), u32_of(w.2.len())))
            .collect();
        let (at, id, watermark) = loop {
            // Full of unfinished writes (reactors finish them on their own): wait.
            if let Some(a) = p.ring(r).alloc(rec_len) {
                break a;
            }
            std::thread::yield_now();
        };
        let payload_crc = (holders & self.journal_flush_devs() != 0)
            .then(|| crc32c::crc32c(&jb[hl..usize_of(rec_len)]));
        encode_header(
            &p.uuid(),
            RecordHead {
                seq: id,
                watermark,
                row: r,
                version: g.version,
                kind: KIND_CHUNK,
                payload: u32_of(payload),
                holders,
                payload_crc,
            },
            &entries,
            &mut jb[..hl],
        );
        for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
            if self.devices[d].write_at(at, &jb).is_err() {
                self.mark_failed(d, FailReason::Write);
            }
        }
        self.flush_durable(holders);
        for &(s, off, bytes) in &writes {
            let d = p.shard_dev(r, s);
            if self.failed_bits() & (1 << d) != 0 {
                continue;
            }
            if self.devices[d]
                .write_at(p.row_offset(r) + off, bytes)
                .is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        self.flush_durable(writes.iter().fold(0, |a, w| a | 1 << p.shard_dev(r, w.0)));
        p.ring(r).release(id);
        drop(g);
        if self.failed_bits().count_ones() as usize > p.m {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Rebuild device `d`'s chunks of the rows that `[offset, offset+len)` touches, from
    /// the other devices. Each row is locked while it is rebuilt, so client writes (which
    /// also reach `d`, a write-only member) cannot interleave. Returns bytes written.
    pub(crate) fn parity_rebuild_range(&self, d: usize, offset: u64, len: u64) -> io::Result<u64> {
        let p = self.parity_geo();
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let span = usize_of(p.chunk);
        let mut row = vec![0u8; p.n * span];
        let mut written = 0;
        for r in first..=last {
            if self.rebuilding_bits() & (1 << d) == 0 {
                return Err(io::Error::other(format!(
                    "device {d} failed during the rebuild"
                )));
            }
            let _g = p.lock_sync(r);
            self.read_row_sync(r, 0, p.chunk, &mut row)?;
            let s = (0..p.n)
                .find(|&s| p.shard_dev(r, s) == d)
                .expect("every device holds a shard");
            if let Err(e) =
                self.devices[d].write_at(p.row_offset(r), &row[s * span..(s + 1) * span])
            {
                self.mark_failed(d, FailReason::Write);
                return Err(e);
            }
            written += p.chunk;
        }
        Ok(written)
    }

    /// Rebuild device `d`'s part of `[offset, offset+len)`, a range that holds no data
    /// and is zero on every other device (a free unit of a parity pool: units are zeroed
    /// before they are freed, and a device that was away then missed only that zeroing).
    /// Zero data has zero parity under every code here, so `d`'s chunk of each row the
    /// range covers whole is zero, whatever `d` held (a replacement's old contents, a
    /// deleted volume's data): one write-zeroes on `d` for all of them, since row `r`'s
    /// chunk sits at the same offset on every device. The rows it shares with a
    /// neighbour are reconstructed (`parity_rebuild_range`). The caller keeps writes
    /// off the range meanwhile (the whole rows are not locked). Returns bytes written.
    pub(crate) fn parity_rebuild_zero(&self, d: usize, offset: u64, len: u64) -> io::Result<u64> {
        let p = self.parity_geo();
        let end = offset + len;
        let (first, last) = (offset.div_ceil(p.row_bytes), end / p.row_bytes);
        if first >= last {
            return self.parity_rebuild_range(d, offset, len);
        }
        let (whole_start, whole_end) = (first * p.row_bytes, last * p.row_bytes);
        let mut written = 0;
        if offset < whole_start {
            written += self.parity_rebuild_range(d, offset, whole_start - offset)?;
        }
        if self.rebuilding_bits() & (1 << d) == 0 {
            return Err(io::Error::other(format!(
                "device {d} failed during the rebuild"
            )));
        }
        let zeros = (last - first) * p.chunk;
        if let Err(e) = self.devices[d].write_zeroes_at(p.row_offset(first), zeros) {
            self.mark_failed(d, error_reason(&e, FailReason::Write));
            return Err(e);
        }
        written += zeros;
        if whole_end < end {
            written += self.parity_rebuild_range(d, whole_end, end - whole_end)?;
        }
        Ok(written)
    }

    /// Parity scrub of the rows `[offset, offset+len)` touches: with every shard readable,
    /// parity recomputed from the data must equal the stored parity; with `repair`, wrong
    /// parity is rewritten (data is what the clients wrote; parity is derived from it).
    pub(crate) fn parity_scrub_rows(
        &self,
        offset: u64,
        len: u64,
        repair: bool,
    ) -> io::Result<RowScrub> {
        let p = self.parity_geo();
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let span = usize_of(p.chunk);
        let mut row = vec![0u8; p.n * span];
        let mut want = vec![0u8; p.m * span];
        let (mut checked, mut bad, mut fixed, mut lost) = (0, 0, 0, 0);
        let mut ranges = Vec::new();
        for r in first..=last {
            let _g = p.lock_sync(r);
            let unreadable = (0..p.n)
                .filter(|&s| !self.is_readable(p.shard_dev(r, s)))
                .count();
            if unreadable > p.m {
                lost += p.row_bytes;
                continue;
            }
            if unreadable > 0 {
                // Degraded: nothing to compare parity with; the data is reconstructible.
                checked += p.row_bytes;
                continue;
            }
            if self.read_row_sync(r, 0, p.chunk, &mut row).is_err() {
                lost += p.row_bytes;
                continue;
            }
            want.copy_from_slice(&row[p.k * span..]);
            {
                let mut shards: Vec<&mut [u8]> = row.chunks_mut(span).collect();
                p.encode(&mut shards);
            }
            checked += p.row_bytes;
            if want != row[p.k * span..] {
                bad += (p.m * span) as u64;
                if ranges.len() < 100 {
                    ranges.push((r * p.row_bytes, p.row_bytes));
                }
                if repair {
                    let mut ok = true;
                    for s in p.k..p.n {
                        let d = p.shard_dev(r, s);
                        if self.devices[d]
                            .write_at(p.row_offset(r), &row[s * span..(s + 1) * span])
                            .is_err()
                        {
                            self.mark_failed(d, FailReason::Write);
                            ok = false;
                        }
                    }
                    if ok {
                        fixed += (p.m * span) as u64;
                    }
                }
            }
        }
        Ok(RowScrub {
            checked,
            mismatched: bad,
            repaired: fixed,
            unreadable: lost,
            ranges,
        })
    }

    /// Zero `[offset, offset+len)` of a parity layout that nothing writes to yet (a pool
    /// being opened) without the stripe journal: the rows the range covers whole are
    /// zeroed, data and parity alike (so they stay consistent), with one write-zeroes per
    /// device, since row `r` sits at the same offset on every device; the rows it shares
    /// at its edges go through the journaled `parity_zero`, and so does everything while
    /// a device is failed. Why no journal: per row it costs two flushes (~1 s for 64 MiB
    /// on this VM's disk, against ~0.1 s). Only for a range whose zeroing is redone when
    /// a crash interrupts it, the allocation reserve (docs/format.md §3.5): a torn
    /// zeroing leaves a row's parity wrong until then.
    pub(crate) fn parity_zero_unjournaled(&self, offset: u64, len: u64) -> io::Result<()> {
        let p = self.parity_geo();
        let end = offset + len;
        let (first, last) = (offset.div_ceil(p.row_bytes), end / p.row_bytes);
        if self.failed_bits() != 0 || first >= last {
            return self.parity_zero(offset, len);
        }
        let (whole_start, whole_end) = (first * p.row_bytes, last * p.row_bytes);
        if offset < whole_start {
            self.parity_zero(offset, whole_start - offset)?;
        }
        for (d, dev) in self.devices.iter().enumerate() {
            if self.is_failed(d) {
                continue;
            }
            if let Err(e) = dev.write_zeroes_at(p.row_offset(first), (last - first) * p.chunk) {
                self.mark_failed(d, error_reason(&e, FailReason::Write));
            }
        }
        if self.failed_bits().count_ones() as usize > p.m {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if whole_end < end {
            self.parity_zero(whole_end, end - whole_end)?;
        }
        Ok(())
    }

    /// Zero every device's journal and data area (a new parity pool: zero data, zero
    /// parity — every row consistent from the start).
    pub(crate) fn parity_format(&self) -> io::Result<()> {
        let p = self.parity_geo();
        for d in &self.devices {
            d.write_zeroes_at(DEV_DATA_START, JOURNAL_LEN + p.rows * p.chunk)?;
        }
        Ok(())
    }
}
