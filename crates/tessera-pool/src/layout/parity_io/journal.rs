//! The write hole's defence on the datapath: the row's journal record, the flush that
//! orders it before the in-place writes (shared by the rows waiting on a core), and the
//! in-place writes themselves (docs/format.md §2.1).

use tessera_io::{CoreIo, IoOp, Tag};

use super::{DevOp, DevWrite, Engine, Event, Mode, State, GROUP_FLUSH};
use crate::layout::parity::{encode_header, Parity, RecordHead, KIND_CHUNK, KIND_FULL};
use crate::layout::Layout;
use tessera_io::cast::{u32_of, u8_of, usize_of};

impl Engine {
    /// Write the row's journal record to its holders (docs/format.md §2.1); returns how
    /// many writes were issued, or None while the journal slice is full.
    pub(super) fn journal(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> Option<u32> {
        let failed = l.failed_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        let row = op.row;
        let span = op.hi - op.lo;
        let base = op.buf.as_ref().expect("planned").as_ptr() as usize;
        // Where the new parity is: the record's parity entries (read-modify-write) or the
        // row buffer's parity slots.
        let parity_at = |s: usize| match op.rmw {
            Some((pe, el, _)) => {
                op.jbuf.as_ref().expect("planned").as_ptr() as usize + pe + (s - p.k) * el
            }
            None if op.mode == Mode::Full => base + (s - p.k) * usize_of(span),
            None => base + s * usize_of(span),
        };
        if op.writes.is_empty() {
            for g in &op.segs {
                op.writes.push(DevWrite {
                    shard: g.shard,
                    dev: p.shard_dev(row, g.shard),
                    chunk_off: g.off,
                    len: g.len,
                    ptr: g.ptr,
                });
            }
            for s in p.k..p.n {
                op.writes.push(DevWrite {
                    shard: s,
                    dev: p.shard_dev(row, s),
                    chunk_off: op.lo,
                    len: span,
                    ptr: parity_at(s),
                });
            }
        }
        // A full-row write on a healthy row journals a marker only: recovery recomputes
        // the parity of a torn row from its data. With a chunk of the row missing that
        // cannot be done, so a degraded full-row write journals its bytes like any other.
        let row_devs = (0..p.n).fold(0u64, |a, s| a | 1 << p.shard_dev(row, s));
        let full = op.mode == Mode::Full && failed & row_devs == 0;
        let holders = p.record_holders(row, failed);
        op.holders = holders;
        if holders == 0 {
            // No parity left to protect: the chunks go straight in place.
            return Some(0);
        }
        let live = |w: &&DevWrite| failed & (1 << w.dev) == 0;
        let hl = p.header_len();
        let payload: u64 = if full {
            0
        } else if let Some((pe, el, _)) = op.rmw {
            // Every entry, laid out at planning (writes to failed devices included:
            // recovery skips failed devices).
            (pe + p.m * el) as u64 - hl
        } else {
            op.writes
                .iter()
                .filter(live)
                .map(|w| p.entry_len(w.len))
                .sum()
        };
        let rec_len = hl + payload;
        let (at, rid, watermark) = p.ring_counted(row, &self.counters).alloc(rec_len)?;
        op.ring_id = Some(rid);
        if op.rmw.is_none()
            && op
                .jbuf
                .as_ref()
                .is_none_or(|b| b.capacity() < usize_of(rec_len))
        {
            if let Some(b) = op.jbuf.take() {
                io.bufs.put(b);
            }
            op.jbuf = Some(io.bufs.get(usize_of(rec_len)));
        }
        let jb = op.jbuf.as_mut().expect("allocated above").as_mut_slice();
        let mut entries = [(0u8, 0u32, 0u32); 64];
        let mut ne = 0;
        let mut at_p = usize_of(hl);
        if !full {
            // Entries in write order. Read-modify-write laid the record out at planning
            // (every write has an entry, its parity is already in place); otherwise the
            // writes to live devices are copied in.
            let rmw = op.rmw.is_some();
            for w in op.writes.iter().filter(|w| rmw || live(w)) {
                if !(rmw && w.shard >= p.k) {
                    // SAFETY: w.ptr points at w.len bytes: the client's buffer (alive
                    // until the request completes), the engine's zero chunk or this op's
                    // buffer.
                    let src =
                        unsafe { std::slice::from_raw_parts(w.ptr as *const u8, usize_of(w.len)) };
                    jb[at_p..at_p + usize_of(w.len)].copy_from_slice(src);
                }
                at_p += usize_of(p.entry_len(w.len));
                entries[ne] = (u8_of(w.shard), u32_of(w.chunk_off), u32_of(w.len));
                ne += 1;
            }
        }
        // Records that are flushed for power-loss safety carry a payload checksum: one
        // torn by a power loss before its flush must not be replayed.
        let payload_crc = (!full && holders & l.journal_flush_devs() != 0)
            .then(|| crc32c::crc32c(&jb[usize_of(hl)..usize_of(rec_len)]));
        let hdr = &mut jb[..usize_of(hl)];
        encode_header(
            &p.uuid(),
            RecordHead {
                seq: rid,
                watermark,
                row,
                version: op.version,
                kind: if full { KIND_FULL } else { KIND_CHUNK },
                payload: u32_of(payload),
                holders,
                payload_crc,
            },
            &entries[..ne],
            hdr,
        );
        let n = holders.count_ones();
        let t = io.tracked(Tag::NO_PARENT, n, hook, id as u64);
        for d in (0..p.n).filter(|d| holders & (1 << d) != 0) {
            let sub = IoOp::Write {
                offset: at,
                len: u32_of(rec_len),
                buf: jb.as_ptr(),
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(d).ctx());
            // SAFETY: `jb` is this row op's journal buffer (`op.jbuf`), kept until
            // `finish`, after every write of the record has completed.
            unsafe { handles[d].submit(io, sub, h) };
        }
        Some(n)
    }

    pub(super) fn in_place(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> u32 {
        let failed = l.failed_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        let n = u32_of(
            op.writes
                .iter()
                .filter(|w| failed & (1 << w.dev) == 0)
                .count(),
        );
        if n == 0 {
            return 0;
        }
        let t = io.tracked(Tag::NO_PARENT, n, hook, id as u64);
        for w in op.writes.iter().filter(|w| failed & (1 << w.dev) == 0) {
            let sub = IoOp::Write {
                offset: p.row_offset(op.row) + w.chunk_off,
                len: u32_of(w.len),
                buf: w.ptr as *const u8,
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(w.dev).ctx());
            // SAFETY: `w.ptr` points at `w.len` bytes that stay valid until the op
            // finishes, after these writes: the client's buffer (its request
            // completes only then), the engine's zero chunk or this op's buffer.
            unsafe { handles[w.dev].submit(io, sub, h) };
        }
        n
    }

    /// Row operation `id` continues (in its next phase) once `devs` are flushed.
    pub(super) fn join_group_flush(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        st: &mut State,
        id: u32,
        devs: u64,
    ) {
        st.flush_next.push(id);
        st.flush_next_devs |= devs;
        if !st.flushing_busy {
            self.start_group_flush(io, l, st);
        }
    }

    /// Flush the devices of the operations waiting for one; they go in place when it
    /// completes (`group_flushed`). One flush covers every record completed before it.
    pub(super) fn start_group_flush(&self, io: &mut CoreIo, l: &Layout, st: &mut State) {
        let devs = st.flush_next_devs & !l.failed_bits();
        st.flush_next_devs = 0;
        std::mem::swap(&mut st.flushing, &mut st.flush_next);
        st.flushing_busy = true;
        let hook = self.hook.get();
        let n = devs.count_ones();
        let t = io.tracked(Tag::NO_PARENT, n.max(1), hook, GROUP_FLUSH as u64);
        if n == 0 {
            return io.complete(t, 0);
        }
        for d in (0..st.handles.len()).filter(|d| devs & (1 << d) != 0) {
            // A failed flush marks the device failed (its records no longer count).
            let h = io.hooked(t, hook, IoOp::Flush, DevOp::RowOp(d).ctx());
            // SAFETY: a flush carries no buffer.
            unsafe { st.handles[d].submit(io, IoOp::Flush, h) };
        }
    }

    pub(super) fn group_flushed(&self, io: &mut CoreIo, l: &Layout, st: &mut State) {
        st.flushing_busy = false;
        for id in std::mem::take(&mut st.flushing) {
            self.pending.borrow_mut().push_back(Event::Step(id));
        }
        if !st.flush_next.is_empty() {
            self.start_group_flush(io, l, st);
        }
    }
}
