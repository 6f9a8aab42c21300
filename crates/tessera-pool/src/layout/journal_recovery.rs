//! Recovery of parity layouts after a crash: the stripe journal is scanned, each row's
//! unfinished write is rolled forward from its record, and rows whose record is gone are
//! resynchronised (docs/format.md §2.1).

use std::collections::BTreeMap;
use std::io;
use tessera_io::cast::usize_of;

use super::{error_reason, FailReason, Layout};
use crate::format::DEV_DATA_START;
use crate::layout::parity::{
    Parity, StripeRecord, JOURNAL_LEN, KIND_CHUNK, KIND_FULL, SCAN_STEP, SLICES, SLICE_LEN,
};

impl Layout {
    /// Recover after an unclean stop (docs/format.md §2.1): replay complete journaled
    /// writes, resync the parity of rows whose last write may be torn, then empty the
    /// journals. Returns (writes replayed, rows resynced, degraded rows left as they were).
    /// Empty the stripe journal of every healthy device (a clean shutdown: every row write
    /// has finished, so the next open has nothing to replay).
    pub fn clear_journal(&self) -> io::Result<()> {
        if self.parity.is_none() {
            return Ok(());
        }
        for (d, dev) in self.devices.iter().enumerate() {
            if self.is_failed(d) {
                continue;
            }
            if dev
                .write_zeroes_at(DEV_DATA_START, JOURNAL_LEN)
                .and_then(|()| dev.sync())
                .is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        Ok(())
    }

    /// Finish or undo the row writes a crash interrupted (docs/format.md §2.1): find
    /// every valid record on every readable device, keep each row's newest unfinished
    /// one, roll chunk updates forward, recompute the parity of full-row writes, then
    /// empty the journal. Returns (writes replayed, rows resynced, degraded rows left).
    pub fn recover_journal(&self) -> io::Result<(u64, u64, u64)> {
        let Some(p) = self.parity.as_ref() else {
            return Ok((0, 0, 0));
        };
        let uuid = *p
            .uuid
            .get()
            .ok_or_else(|| io::Error::other("pool UUID not set"))?;
        let found = self.scan_journal(p, &uuid);
        let newest = unfinished_writes(found);
        let (replayed, resync) = self.roll_forward(p, &newest);
        let (synced, degraded) = self.resync_rows(p, &resync);
        for d in 0..p.n {
            if self.is_failed(d) {
                continue;
            }
            // In-place writes first, then the journal goes: a crash in between replays again.
            if self.devices[d].sync().is_err()
                || self.devices[d]
                    .write_zeroes_at(DEV_DATA_START, JOURNAL_LEN)
                    .is_err()
                || self.devices[d].sync().is_err()
            {
                self.mark_failed(d, FailReason::Write);
            }
        }
        if replayed + synced + degraded > 0 {
            tracing::warn!(
                replayed,
                synced,
                degraded,
                "stripe journal: writes replayed, rows' parity resynced, degraded rows left as they were"
            );
        }
        Ok((replayed, synced, degraded))
    }

    /// Every valid record of every readable device's journal: (slice, record, payload).
    fn scan_journal(&self, p: &Parity, uuid: &[u8; 16]) -> Vec<(u64, StripeRecord, Vec<u8>)> {
        // Every valid record found: (slice, record, payload).
        let mut found: Vec<(u64, StripeRecord, Vec<u8>)> = Vec::new();
        let mut area = vec![0u8; usize_of(JOURNAL_LEN)];
        let hl = usize_of(p.header_len());
        for d in 0..p.n {
            if !self.is_readable(d) {
                continue;
            }
            if let Err(e) = self.devices[d].read_at(DEV_DATA_START, &mut area) {
                self.mark_failed(d, error_reason(&e, FailReason::Read));
                continue;
            }
            // Every header position is examined, not only the ends of records found:
            // a slice is shared by rows whose records go to different devices, so this
            // device may still hold an old record's header whose span a newer record
            // (written only where the old one's tail was) has since overwritten in part.
            // Skipping that old span would miss the newer record.
            let mut here: Vec<(usize, usize, StripeRecord)> = Vec::new();
            for at in (0..=area.len() - hl).step_by(SCAN_STEP) {
                let Some(rec) = StripeRecord::decode(uuid, &area[at..at + hl]) else {
                    continue;
                };
                let end = at + hl + rec.head.payload as usize;
                // A record whose payload does not match its checksum was torn by a power
                // loss before its flush completed: its row was not written in place.
                let ok = end <= area.len()
                    && rec.head.row < p.rows
                    && rec.head.holders & (1 << d) != 0
                    && (rec.head.kind == KIND_FULL || rec.head.kind == KIND_CHUNK)
                    && rec
                        .head
                        .payload_crc
                        .is_none_or(|c| crc32c::crc32c(&area[at + hl..end]) == c);
                if ok {
                    here.push((at, end, rec));
                }
            }
            // Of two overlapping records, the one with the lower sequence was overwritten
            // (a record's bytes are reused only after its write finished): dropped.
            let mut live = vec![true; here.len()];
            for i in 0..here.len() {
                for j in i + 1..here.len() {
                    if here[j].0 >= here[i].1 {
                        break;
                    }
                    if here[i].2.head.seq < here[j].2.head.seq {
                        live[i] = false;
                    } else {
                        live[j] = false;
                    }
                }
            }
            for ((at, end, rec), live) in here.into_iter().zip(live) {
                if live {
                    found.push((at as u64 / SLICE_LEN, rec, area[at + hl..end].to_vec()));
                }
            }
        }
        found
    }

    /// Roll the rows' chunk updates forward; returns how many, and the rows of full-row
    /// writes, whose parity must be recomputed.
    fn roll_forward(
        &self,
        p: &Parity,
        newest: &BTreeMap<u64, (StripeRecord, Vec<u8>)>,
    ) -> (u64, Vec<u64>) {
        // Only a row's newest write can be unfinished (the row lock orders a row's
        // writes). A chunk update is
        // rolled forward from any copy of its record; a full-row write (no payload) gets
        // its parity recomputed from the data.
        let mut resync = Vec::new();
        let mut replayed = 0;
        for (&row, (rec, payload)) in newest {
            if rec.head.kind != KIND_CHUNK {
                resync.push(row);
                continue;
            }
            let mut at = 0usize;
            for &(shard, off, len) in &rec.entries {
                let (shard, len) = (shard as usize, len as usize);
                if shard < p.n && off as u64 + len as u64 <= p.chunk && at + len <= payload.len() {
                    let d = p.shard_dev(row, shard);
                    if !self.is_failed(d)
                        && self.devices[d]
                            .write_at(p.row_offset(row) + off as u64, &payload[at..at + len])
                            .is_err()
                    {
                        self.mark_failed(d, FailReason::Write);
                    }
                }
                at += usize_of(p.entry_len(len as u64));
            }
            replayed += 1;
        }
        (replayed, resync)
    }

    /// Recompute the parity of `rows` from their data; returns (rows resynced, rows left
    /// as they were because a data chunk is unreadable).
    fn resync_rows(&self, p: &Parity, rows: &[u64]) -> (u64, u64) {
        let (mut synced, mut degraded) = (0, 0);
        let span = usize_of(p.chunk);
        let mut buf = vec![0u8; p.n * span];
        for &r in rows {
            let all_data = (0..p.k).all(|s| self.is_readable(p.shard_dev(r, s)));
            if !all_data {
                degraded += 1;
                continue;
            }
            let mut ok = true;
            for s in 0..p.k {
                let d = p.shard_dev(r, s);
                if self.devices[d]
                    .read_at(p.row_offset(r), &mut buf[s * span..(s + 1) * span])
                    .is_err()
                {
                    self.mark_failed(d, FailReason::Read);
                    ok = false;
                }
            }
            if !ok {
                degraded += 1;
                continue;
            }
            {
                let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
                p.encode(&mut shards);
            }
            for s in p.k..p.n {
                let d = p.shard_dev(r, s);
                if self.is_failed(d) {
                    continue;
                }
                if self.devices[d]
                    .write_at(p.row_offset(r), &buf[s * span..(s + 1) * span])
                    .is_err()
                {
                    self.mark_failed(d, FailReason::Write);
                }
            }
            synced += 1;
        }
        (synced, degraded)
    }
}

/// Each row's newest record that may belong to an unfinished write.
fn unfinished_writes(
    found: Vec<(u64, StripeRecord, Vec<u8>)>,
) -> BTreeMap<u64, (StripeRecord, Vec<u8>)> {
    // A record older than its slice's newest watermark belongs to a finished write
    // (and may be older than a write whose record is already overwritten): ignored.
    let mut wm = [0u64; usize_of(SLICES)];
    for (slice, rec, _) in &found {
        let w = &mut wm[usize_of(*slice)];
        *w = (*w).max(rec.head.watermark);
    }
    let mut newest: BTreeMap<u64, (StripeRecord, Vec<u8>)> = BTreeMap::new();
    for (slice, rec, payload) in found {
        if rec.head.seq < wm[usize_of(slice)] {
            continue;
        }
        if newest
            .get(&rec.head.row)
            .is_none_or(|n| n.0.head.version < rec.head.version)
        {
            newest.insert(rec.head.row, (rec, payload));
        }
    }
    newest
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data patterns wrap on purpose
mod tests {
    use super::*;
    use crate::layout::parity::{encode_header, RecordHead};
    use crate::layout::LayoutKind;
    use std::sync::Arc;
    use tessera_device::{BlockDevice, RamDevice};

    /// Write a record (header, then each entry's bytes on its own journal block) at
    /// `at` bytes into `dev`'s journal.
    fn put_record(
        l: &Layout,
        dev: usize,
        at: u64,
        head: RecordHead,
        entries: &[(u8, u32, Vec<u8>)],
    ) {
        let p = l.parity_geo();
        let desc: Vec<(u8, u32, u32)> = entries
            .iter()
            .map(|(s, o, b)| (*s, *o, b.len() as u32))
            .collect();
        let hl = p.header_len() as usize;
        let mut rec = vec![0u8; hl + head.payload as usize];
        let mut pos = hl;
        for (_, _, b) in entries {
            rec[pos..pos + b.len()].copy_from_slice(b);
            pos += p.entry_len(b.len() as u64) as usize;
        }
        // A checksum, when asked for, is the payload's.
        let head = RecordHead {
            payload_crc: head.payload_crc.map(|_| crc32c::crc32c(&rec[hl..])),
            ..head
        };
        encode_header(&p.uuid(), head, &desc, &mut rec[..hl]);
        l.devices[dev].write_at(DEV_DATA_START + at, &rec).unwrap();
    }

    /// A slice is shared by rows whose records go to different devices, so a device can
    /// keep an old record's header while a newer record (of another row, also held by
    /// this device) overwrote the old record's tail. Recovery must find the newer record
    /// instead of skipping the old record's whole span.
    #[test]
    fn recovery_finds_a_record_written_over_an_old_records_tail() {
        let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
            .map(|_| RamDevice::new(24 << 20).unwrap() as Arc<dyn BlockDevice>)
            .collect();
        let l = Layout::new(LayoutKind::Raid5 { stripe: 4096 }, devs).unwrap();
        l.set_pool_uuid([7; 16]);
        l.format_parity().unwrap();
        let p = l.parity_geo();
        // Two rows of slice 0 whose parity (and so whose records) is on the same device.
        let newer_row = 8;
        let holder = p.shard_dev(newer_row, 2);
        let old_row = (16..)
            .step_by(SLICES as usize)
            .find(|&r| p.shard_dev(r, 2) == holder)
            .unwrap();
        let hl = p.header_len();
        // The old record: a whole data chunk, its header intact at the slice's start.
        put_record(
            &l,
            holder,
            0,
            RecordHead {
                seq: 3,
                watermark: 3,
                row: old_row,
                version: 1,
                kind: KIND_CHUNK,
                payload: 4096,
                holders: 1 << holder,
                payload_crc: None,
            },
            &[(0, 0, vec![0xAA; 4096])],
        );
        // The newer record starts inside the old one's payload: one sector of data and
        // its parity (the other data chunk is zero, so parity = data).
        let new = vec![0x5C; 512];
        put_record(
            &l,
            holder,
            hl + 2048,
            RecordHead {
                seq: 9,
                watermark: 9,
                row: newer_row,
                version: 1,
                kind: KIND_CHUNK,
                payload: 1024,
                holders: 1 << holder,
                payload_crc: None,
            },
            &[(0, 512, new.clone()), (2, 512, new.clone())],
        );
        let (replayed, _, _) = l.recover_journal().unwrap();
        assert_eq!(replayed, 1, "only the newer record is live");
        let mut got = vec![0u8; 512];
        for s in [0, 2] {
            l.devices[p.shard_dev(newer_row, s)]
                .read_at(p.row_offset(newer_row) + 512, &mut got)
                .unwrap();
            assert_eq!(
                got, new,
                "shard {s} of the newer record's row was not rolled forward"
            );
        }
        // The overwritten old record was not replayed.
        l.devices[p.shard_dev(old_row, 0)]
            .read_at(p.row_offset(old_row), &mut got)
            .unwrap();
        assert_eq!(got, vec![0u8; 512]);
    }

    /// A record written with a payload checksum (journal flushes on) is replayed when
    /// its payload is whole, and ignored when a power loss tore it (a sector of the
    /// payload never reached the media): its row was never written in place.
    #[test]
    fn recovery_ignores_a_torn_record_and_replays_a_whole_one() {
        for torn in [false, true] {
            let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
                .map(|_| RamDevice::new(24 << 20).unwrap() as Arc<dyn BlockDevice>)
                .collect();
            let l = Layout::new(LayoutKind::Raid5 { stripe: 4096 }, devs).unwrap();
            l.set_pool_uuid([9; 16]);
            l.format_parity().unwrap();
            let p = l.parity_geo();
            let row = 5;
            let holder = p.shard_dev(row, 2);
            let new = vec![0x3C; 1024];
            put_record(
                &l,
                holder,
                (row % SLICES) * SLICE_LEN,
                RecordHead {
                    seq: 0,
                    watermark: 0,
                    row,
                    version: 1,
                    kind: KIND_CHUNK,
                    payload: 2048,
                    holders: 1 << holder,
                    payload_crc: Some(0),
                },
                &[(0, 0, new.clone()), (2, 0, new.clone())],
            );
            if torn {
                // The payload's last sector still holds what was there before.
                l.devices[holder]
                    .write_at(
                        DEV_DATA_START + (row % SLICES) * SLICE_LEN + p.header_len() + 1536,
                        &[0u8; 512],
                    )
                    .unwrap();
            }
            let (replayed, _, _) = l.recover_journal().unwrap();
            let mut got = vec![0u8; 1024];
            l.devices[p.shard_dev(row, 0)]
                .read_at(p.row_offset(row), &mut got)
                .unwrap();
            if torn {
                assert_eq!(replayed, 0, "a torn record was replayed");
                assert_eq!(got, vec![0u8; 1024]);
            } else {
                assert_eq!(replayed, 1);
                assert_eq!(got, new);
            }
        }
    }
}
