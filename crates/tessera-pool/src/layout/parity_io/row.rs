//! A row operation's state machine (`step`), its plan (mode, buffers, reads) and its
//! arithmetic (`compute`).

use tessera_io::buf::AlignedBuf;
use tessera_io::{CoreIo, IoOp, Tag};

use super::{DevOp, Engine, Mode, Phase, RowOp, State, MAX_TRIES};
use crate::layout::parity::Parity;
use crate::layout::parity::ParityEvent;
use crate::layout::Layout;
use tessera_io::cast::{u32_of, usize_of};

impl Engine {
    /// Advance row operation `id` as far as it goes without waiting.
    pub(super) fn step(&self, io: &mut CoreIo, l: &Layout, st: &mut State, id: u32) {
        let p = l.parity_geo();
        let hook = self.hook.get();
        loop {
            let phase = st.ops[id as usize].phase;
            match phase {
                Phase::Lock => {
                    let op = &mut st.ops[id as usize];
                    match p.try_lock(op.row) {
                        Some(v) => {
                            op.version = v;
                            op.phase = Phase::Plan;
                        }
                        None => {
                            // Held by another request: try again next round.
                            self.counters.count(ParityEvent::LockWait);
                            io.defer_hook(hook, id as u64);
                            return;
                        }
                    }
                }
                Phase::Plan => {
                    let op = &mut st.ops[id as usize];
                    op.tries += 1;
                    if op.tries > MAX_TRIES {
                        op.result = -libc::EIO;
                        op.phase = Phase::Done;
                        continue;
                    }
                    let reads = self.plan(io, l, p, st, id, hook);
                    let op = &mut st.ops[id as usize];
                    if op.phase == Phase::Done {
                        continue;
                    }
                    op.phase = Phase::Compute;
                    if reads > 0 {
                        return;
                    }
                }
                Phase::Compute => {
                    let op = &mut st.ops[id as usize];
                    if op.read_set & l.failed_bits() != 0 {
                        // A device failed under our reads: plan again, degraded.
                        op.phase = Phase::Plan;
                        continue;
                    }
                    compute(p, op);
                    if !op.write {
                        op.phase = Phase::Done;
                        continue;
                    }
                    op.phase = Phase::Journal;
                }
                Phase::Journal => {
                    if self.held_for_failure_record(io, l, st, id) {
                        // Nothing goes in place while a failed device is not recorded
                        // failed in the labels (`Layout::failure_unrecorded`): the
                        // record of a degraded write leaves out the failed device's
                        // chunks, so if a power loss brought that device back as a
                        // healthy member, recovery could not rewrite them and the row
                        // would decode garbage once a second device is lost (soak
                        // finding 8). Only writes get here.
                        io.defer_hook(hook, id as u64);
                        return;
                    }
                    match self.journal(io, l, p, st, id, hook) {
                        None => {
                            // The journal slice is full of unfinished writes: next round.
                            self.counters.count(ParityEvent::JournalWait);
                            io.defer_hook(hook, id as u64);
                            return;
                        }
                        Some(n) => {
                            st.ops[id as usize].phase = Phase::Flush;
                            if n > 0 {
                                return;
                            }
                        }
                    }
                }
                Phase::Flush => {
                    // The records must be durable before any chunk is overwritten: a
                    // device with a volatile cache may otherwise keep an in-place write
                    // and lose the record across a power loss.
                    let op = &mut st.ops[id as usize];
                    op.phase = Phase::InPlace;
                    let devs = op.holders & l.journal_flush_devs();
                    if devs != 0 {
                        return self.join_group_flush(io, l, st, id, devs);
                    }
                }
                Phase::InPlace => {
                    let n = self.in_place(io, l, p, st, id, hook);
                    st.ops[id as usize].phase = Phase::Settle;
                    if n > 0 {
                        return;
                    }
                }
                Phase::Settle => {
                    // Released records are never replayed, so a record outlives its row
                    // write only until the chunks it describes are durable.
                    let op = &mut st.ops[id as usize];
                    op.phase = Phase::Done;
                    let devs = if op.ring_id.is_some() {
                        op.writes.iter().fold(0u64, |a, w| a | 1 << w.dev) & l.journal_flush_devs()
                    } else {
                        0
                    };
                    if devs != 0 {
                        return self.join_group_flush(io, l, st, id, devs);
                    }
                }
                Phase::Done => {
                    if st.ops[id as usize].write && self.held_for_failure_record(io, l, st, id) {
                        // Written without a device whose failure the labels do not
                        // record yet (`Layout::failure_unrecorded`): keep the record
                        // and the row until the commit thread has written them.
                        io.defer_hook(hook, id as u64);
                        return;
                    }
                    return self.finish(io, l, p, st, id);
                }
            }
        }
    }

    /// Whether row write `id` must wait (another round) for a device failure to be
    /// recorded in the labels (`Layout::failure_unrecorded`), at most
    /// `FAILURE_RECORD_WAIT` in all.
    fn held_for_failure_record(&self, io: &CoreIo, l: &Layout, st: &mut State, id: u32) -> bool {
        let op = &mut st.ops[id as usize];
        if !l.failure_unrecorded() {
            op.held_since = None;
            return false;
        }
        let since = *op.held_since.get_or_insert(io.now());
        if io.now().saturating_duration_since(since) < super::FAILURE_RECORD_WAIT {
            return true;
        }
        tracing::warn!(
            row = op.row,
            "a parity row write waited {} s for a device failure to be recorded: going on",
            super::FAILURE_RECORD_WAIT.as_secs()
        );
        op.held_since = None;
        false
    }

    /// Choose how to do the row operation and issue its reads; returns how many.
    pub(super) fn plan(
        &self,
        io: &mut CoreIo,
        l: &Layout,
        p: &Parity,
        st: &mut State,
        id: u32,
        hook: u32,
    ) -> u32 {
        let unreadable = l.failed_bits() | l.rebuilding_bits();
        let State { handles, ops, .. } = st;
        let op = &mut ops[id as usize];
        op.lo = op.segs.iter().map(|s| s.off).min().unwrap_or(0);
        op.hi = op.segs.iter().map(|s| s.off + s.len).max().unwrap_or(0);
        op.mode = choose_mode(p, op, unreadable, l.rebuilding_bits());
        size_buffers(io, p, op);
        let mut reads = [ShardRead::default(); 64];
        let Some(nreads) = collect_reads(p, op, unreadable, &mut reads) else {
            op.result = -libc::EIO;
            op.phase = Phase::Done;
            return 0;
        };
        op.read_set = reads[..nreads]
            .iter()
            .fold(0, |a, r| a | 1 << p.shard_dev(op.row, r.shard));
        if nreads == 0 {
            return 0;
        }
        let t = io.tracked(Tag::NO_PARENT, u32_of(nreads), hook, id as u64);
        for r in &reads[..nreads] {
            let d = p.shard_dev(op.row, r.shard);
            let sub = IoOp::Read {
                offset: p.row_offset(op.row) + r.off,
                len: u32_of(r.len),
                buf: r.at as *mut u8,
            };
            let h = io.hooked(t, hook, sub, DevOp::RowOp(d).ctx());
            // SAFETY: `r.at` points into this row op's buffers, which the op keeps until
            // `finish`, after every read of the op has completed.
            unsafe { handles[d].submit(io, sub, h) };
        }
        u32_of(nreads)
    }
}

/// One read a row operation issues: shard, offset in its chunk, length, buffer address.
#[derive(Clone, Copy, Default)]
struct ShardRead {
    shard: usize,
    off: u64,
    len: u64,
    at: usize,
}

/// How to do a row operation (`op.lo..op.hi` set): a read is served degraded (it is only
/// planned when a shard it needs is unreadable); a write covering every data shard over
/// the span is a full-row write; else read-modify-write or reconstruct-write, whichever
/// reads less and is possible with the readable shards.
fn choose_mode(p: &Parity, op: &RowOp, unreadable: u64, rebuilding: u64) -> Mode {
    let (row, lo, span) = (op.row, op.lo, op.hi - op.lo);
    let readable = |s: usize| unreadable & (1 << p.shard_dev(row, s)) == 0;
    let covered = |s: usize| {
        op.segs
            .iter()
            .any(|g| g.shard == s && g.off == lo && g.len == span)
    };
    if !op.write {
        return Mode::Degraded;
    }
    if (0..p.k).all(covered) {
        return Mode::Full;
    }
    let rmw_ok = op.segs.iter().all(|g| readable(g.shard))
        && (p.k..p.n).all(|s| rebuilding & (1 << p.shard_dev(row, s)) == 0);
    let rcw_ok = (0..p.k).all(|s| covered(s) || readable(s));
    let rmw_cost = op.segs.len() + (p.k..p.n).filter(|&s| readable(s)).count();
    let rcw_cost = (0..p.k).filter(|&s| !covered(s)).count();
    if rmw_ok && (!rcw_ok || rmw_cost <= rcw_cost) {
        Mode::Rmw
    } else if rcw_ok {
        Mode::Rcw
    } else {
        Mode::Degraded
    }
}

/// Give the row operation the buffers its mode needs (kept across reuses of the op when
/// big enough): `buf` for the row's shards, and for read-modify-write `jbuf` laid out as
/// its journal record — header, data entries, parity entries — then scratch for the old
/// data (`op.rmw`).
fn size_buffers(io: &mut CoreIo, p: &Parity, op: &mut RowOp) {
    let span = op.hi - op.lo;
    // A full-row write needs room for its parity only (the data stays in the request): a
    // smaller buffer, more of which stays in the caches.
    let need = if op.mode == Mode::Full {
        p.m * usize_of(span)
    } else {
        p.n * usize_of(span)
    };
    ensure_capacity(io, &mut op.buf, need);
    op.rmw = None;
    if op.mode == Mode::Rmw {
        let hl = usize_of(p.header_len());
        let data: usize = op.segs.iter().map(|g| usize_of(p.entry_len(g.len))).sum();
        let el = usize_of(p.entry_len(span));
        let pe = hl + data;
        let od = pe + p.m * el;
        ensure_capacity(io, &mut op.jbuf, od + data);
        op.rmw = Some((pe, el, od));
    }
}

/// Make `slot` hold a pool buffer of at least `need` bytes, returning a smaller one.
fn ensure_capacity(io: &mut CoreIo, slot: &mut Option<AlignedBuf>, need: usize) {
    if slot.as_ref().is_none_or(|b| b.capacity() < need) {
        if let Some(b) = slot.take() {
            io.bufs.put(b);
        }
        *slot = Some(io.bufs.get(need));
    }
}

/// The reads a planned row operation needs, into `reads`; their number, or None when too
/// many shards are unreadable to serve it (more than `m` erased). Sets `op.erased`.
fn collect_reads(
    p: &Parity,
    op: &mut RowOp,
    unreadable: u64,
    reads: &mut [ShardRead; 64],
) -> Option<usize> {
    let (row, lo, span) = (op.row, op.lo, op.hi - op.lo);
    let readable = |s: usize| unreadable & (1 << p.shard_dev(row, s)) == 0;
    let base = op.buf.as_mut().expect("sized by size_buffers").as_mut_ptr() as usize;
    let mut n = 0;
    let mut push = |shard: usize, off: u64, len: u64, at: usize| {
        reads[n] = ShardRead {
            shard,
            off,
            len,
            at,
        };
        n += 1;
    };
    op.erased.clear();
    match op.mode {
        Mode::Full => {}
        Mode::Rmw => {
            let (pe, el, od) = op.rmw.expect("laid out by size_buffers");
            let jb = op
                .jbuf
                .as_mut()
                .expect("sized by size_buffers")
                .as_mut_ptr() as usize;
            let mut at = jb + od;
            for g in &op.segs {
                push(g.shard, g.off, g.len, at);
                at += usize_of(p.entry_len(g.len));
            }
            for s in (p.k..p.n).filter(|&s| readable(s)) {
                push(s, lo, span, jb + pe + (s - p.k) * el);
            }
        }
        Mode::Rcw => {
            let covered = |s: usize| {
                op.segs
                    .iter()
                    .any(|g| g.shard == s && g.off == lo && g.len == span)
            };
            for s in (0..p.k).filter(|&s| !covered(s)) {
                push(s, lo, span, base + s * usize_of(span));
            }
        }
        Mode::Degraded => {
            // Any k chunks determine the row: read k readable ones (data first, so a
            // parity shard is computed only when it must be) and rebuild the rest.
            let mut taken = 0;
            for s in 0..p.n {
                if readable(s) && taken < p.k {
                    push(s, lo, span, base + s * usize_of(span));
                    taken += 1;
                } else {
                    op.erased.push(s);
                }
            }
            if op.erased.len() > p.m {
                return None;
            }
        }
    }
    Some(n)
}

/// The arithmetic of a row operation once its reads are in.
fn compute(p: &Parity, op: &mut RowOp) {
    let span = usize_of(op.hi - op.lo);
    let lo = op.lo;
    let buf = op.buf.as_mut().expect("planned").as_mut_slice();
    if op.mode == Mode::Full {
        // Every data chunk of the column range is in the request: encode from it (no
        // copy); the in-place data writes come from it too. `buf` holds the parity only.
        let mut data: [&[u8]; 64] = [&[]; 64];
        for g in &op.segs {
            // SAFETY: the request's source, g.len (= span) bytes.
            data[g.shard] =
                unsafe { std::slice::from_raw_parts(g.ptr as *const u8, usize_of(g.len)) };
        }
        let mut parity: Vec<&mut [u8]> = buf[..p.m * span].chunks_mut(span).collect();
        p.encode_from(&data[..p.k], &mut parity);
        return;
    }
    let buf = &mut buf[..p.n * span];
    match op.mode {
        Mode::Rmw => {
            let (pe, el, od) = op.rmw.expect("planned");
            let jb = op.jbuf.as_mut().expect("planned").as_mut_slice();
            let (head, scratch) = jb.split_at_mut(od);
            let parity = &mut head[pe..pe + p.m * el];
            let mut at = 0;
            for g in &op.segs {
                let a = usize_of(g.off - lo);
                let b = a + usize_of(g.len);
                // SAFETY: g.ptr points at g.len bytes of the request's source.
                let new =
                    unsafe { std::slice::from_raw_parts(g.ptr as *const u8, usize_of(g.len)) };
                let old = &mut scratch[at..at + usize_of(g.len)];
                at += usize_of(p.entry_len(g.len));
                let mut ps: Vec<&mut [u8]> = parity.chunks_mut(el).map(|c| &mut c[a..b]).collect();
                p.update(old, new, g.shard, &mut ps);
            }
        }
        Mode::Full | Mode::Rcw | Mode::Degraded => {
            if op.mode == Mode::Degraded {
                let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
                p.reconstruct(&mut shards, &op.erased);
            }
            if !op.write {
                for g in &op.segs {
                    let a = g.shard * span + usize_of(g.off - lo);
                    // SAFETY: g.ptr is the reader's buffer of g.len bytes.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(g.ptr as *mut u8, usize_of(g.len))
                    };
                    dst.copy_from_slice(&buf[a..a + usize_of(g.len)]);
                }
                return;
            }
            for g in &op.segs {
                let a = g.shard * span + usize_of(g.off - lo);
                // SAFETY: as above, the request's source.
                let new =
                    unsafe { std::slice::from_raw_parts(g.ptr as *const u8, usize_of(g.len)) };
                buf[a..a + usize_of(g.len)].copy_from_slice(new);
            }
            let mut shards: Vec<&mut [u8]> = buf.chunks_mut(span).collect();
            p.encode(&mut shards);
        }
    }
}
