//! Splitting a client request into direct reads and row operations, and flushes.

use tessera_io::{CoreIo, IoOp, Tag};

use super::{DevOp, Engine, Event, Seg, State};
use crate::layout::Layout;
use tessera_io::cast::{u32_of, usize_of};

impl Engine {
    pub(super) fn request(&self, io: &mut CoreIo, l: &Layout, st: &mut State, op: IoOp, tag: Tag) {
        let p = l.parity_geo();
        let (offset, len, ptr) = match op {
            IoOp::Read { offset, len, buf } => (offset, len as u64, buf as usize),
            IoOp::Write { offset, len, buf } => (offset, len as u64, buf as usize),
            IoOp::WriteZeroes { offset, len, .. } => (offset, len, 0),
            // Discarding part of a row would leave its parity describing bytes that are
            // no longer there; the space stays allocated (docs/architecture.md).
            IoOp::Discard { .. } => return io.complete(tag, 0),
            IoOp::Flush => return self.flush(io, l, st, tag),
        };
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > l.size) {
            return io.complete(tag, if len == 0 { 0 } else { -libc::EINVAL });
        }
        let hook = self.hook.get();
        if let IoOp::Read { .. } = op {
            let first = offset / p.chunk;
            let last = (offset + len - 1) / p.chunk;
            let n = last - first + 1;
            let t = if n == 1 { tag } else { io.join(tag, u32_of(n)) };
            let unreadable = l.failed_bits() | l.rebuilding_bits();
            let mut done = 0;
            while done < len {
                let (r, i, off) = p.locate(offset + done);
                let piece = (p.chunk - off).min(len - done);
                let d = p.shard_dev(r, i);
                if unreadable & (1 << d) == 0 {
                    let sub = IoOp::Read {
                        offset: p.row_offset(r) + off,
                        len: u32_of(piece),
                        buf: (ptr + usize_of(done)) as *mut u8,
                    };
                    let h = io.hooked(t, hook, sub, DevOp::FastRead(d).ctx());
                    // SAFETY: `ptr` is the request's buffer, valid until the request
                    // completes (Engine::submit's contract); the request completes
                    // through `t`, after this piece.
                    unsafe { st.handles[d].submit(io, sub, h) };
                } else {
                    let id = self.new_op(st, t, r, false);
                    st.ops[id as usize].segs.push(Seg {
                        shard: i,
                        off,
                        len: piece,
                        ptr: ptr + usize_of(done),
                    });
                    self.pending.borrow_mut().push_back(Event::Step(id));
                }
                done += piece;
            }
            return;
        }
        // Writes and zeroes: one row operation per row.
        let zeros = matches!(op, IoOp::WriteZeroes { .. });
        let first = offset / p.row_bytes;
        let last = (offset + len - 1) / p.row_bytes;
        let rows = last - first + 1;
        let t = if rows == 1 {
            tag
        } else {
            io.join(tag, u32_of(rows))
        };
        let zero_ptr = st.zeros.as_ptr() as usize;
        let mut done = 0;
        for r in first..=last {
            let id = self.new_op(st, t, r, true);
            let row_end = ((r + 1) * p.row_bytes - offset).min(len);
            while done < row_end {
                let (_, i, off) = p.locate(offset + done);
                let piece = (p.chunk - off).min(row_end - done);
                st.ops[id as usize].segs.push(Seg {
                    shard: i,
                    off,
                    len: piece,
                    ptr: if zeros {
                        zero_ptr
                    } else {
                        ptr + usize_of(done)
                    },
                });
                done += piece;
            }
            self.pending.borrow_mut().push_back(Event::Step(id));
        }
    }

    pub(super) fn flush(&self, io: &mut CoreIo, l: &Layout, st: &mut State, tag: Tag) {
        let failed = l.failed_bits();
        let live: Vec<usize> = (0..st.handles.len())
            .filter(|d| failed & (1 << d) == 0)
            .collect();
        if live.is_empty() {
            return io.complete(tag, -libc::EIO);
        }
        let t = if live.len() == 1 {
            tag
        } else {
            io.join(tag, u32_of(live.len()))
        };
        let hook = self.hook.get();
        for d in live {
            let h = io.hooked(t, hook, IoOp::Flush, DevOp::Flush(d).ctx());
            // SAFETY: a flush carries no buffer.
            unsafe { st.handles[d].submit(io, IoOp::Flush, h) };
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_failed(
        &self,
        _io: &mut CoreIo,
        l: &Layout,
        st: &mut State,
        parent: Tag,
        dev: usize,
        offset: u64,
        len: u64,
        buf: usize,
    ) {
        let p = l.parity_geo();
        let rel = offset - crate::layout::parity::PARITY_DATA_START;
        let (r, off) = (rel / p.chunk, rel % p.chunk);
        let shard = (0..p.k)
            .find(|&s| p.shard_dev(r, s) == dev)
            .expect("a direct read goes to a data shard");
        let id = self.new_op(st, parent, r, false);
        st.ops[id as usize].segs.push(Seg {
            shard,
            off,
            len,
            ptr: buf,
        });
        self.pending.borrow_mut().push_back(Event::Step(id));
    }
}
