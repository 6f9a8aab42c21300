//! The per-core datapath handle of a layout: splits requests into device pieces, fans
//! mirror writes out to every healthy copy, fails reads over, and hands parity layouts to
//! their row engine (`crate::layout::parity_io`).

use std::rc::Rc;
use std::sync::atomic::{Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Weak};

use tessera_io::{Continuation, CoreIo, IoHandle, IoOp, Tag};

use crate::devstats::DeviceHandle;

use super::{error_reason, reason_of, FailReason, Layout, Piece};
use tessera_io::cast::{u32_of, usize_of};

impl Layout {
    /// Datapath handle for the calling core.
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

/// A per-core handle to a layout: one device handle per device.
pub struct LayoutHandle {
    layout: Arc<Layout>,
    handles: Vec<DeviceHandle>,
    /// Mirrors: this core's error hook for the layout (registered on first use).
    hook: u32,
    mirror: Option<Rc<MirrorHook>>,
    /// Mirrors: spreads reads over the copies.
    rr: u32,
    /// Parity layouts: this core's row engine (crate::layout::parity_io).
    engine: Option<Rc<crate::layout::parity_io::Engine>>,
}

impl Drop for LayoutHandle {
    fn drop(&mut self) {
        if let Some(e) = self.engine.take() {
            e.release_user();
        }
    }
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
    handles: std::cell::RefCell<Vec<DeviceHandle>>,
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
                all.into_iter().partition(|&(_, o, n, _)| l.copy.held(o, n));
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
        let dev = usize_of(ctx);
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
            l.copy.end_write(token);
        }
        io.complete(parent, res)
    }
}

/// # Safety
/// As [`IoHandle::submit`] for `op`'s buffer.
#[inline]
unsafe fn submit_piece(
    handles: &mut [DeviceHandle],
    io: &mut CoreIo,
    op: &IoOp,
    p: Piece,
    tag: Tag,
) {
    // SAFETY: a piece's buffer is a sub-range of `op`'s, whose contract our caller upholds.
    unsafe { handles[p.dev].submit(io, piece_op(op, p), tag) };
}

#[inline]
fn piece_op(op: &IoOp, p: Piece) -> IoOp {
    match *op {
        IoOp::Read { buf, .. } => IoOp::Read {
            offset: p.dev_offset,
            len: u32_of(p.len),
            // SAFETY: a piece lies inside its request: range_offset < the request's len,
            // so the pointer stays inside the caller's buffer.
            buf: unsafe { buf.add(usize_of(p.range_offset)) },
        },
        IoOp::Write { buf, .. } => IoOp::Write {
            offset: p.dev_offset,
            len: u32_of(p.len),
            // SAFETY: as for reads above.
            buf: unsafe { buf.add(usize_of(p.range_offset)) },
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
        let failed = layout.health.failed.load(Relaxed);
        let rebuilding = layout.health.rebuilding.load(Relaxed);
        let c = layout.copies as usize;
        let n = layout.piece_count(offset, len);
        if let IoOp::Read { .. } = op {
            let failed = failed | rebuilding;
            *rr = rr.wrapping_add(1);
            let t = if n == 1 { tag } else { io.join(tag, u32_of(n)) };
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
                // SAFETY: `sub`'s buffer is a sub-range of `op`'s, whose contract our
                // caller upholds.
                unsafe { handles[d].submit(io, sub, h) };
            }
            return;
        }
        // Writes, discards, zeroes: held back while a rebuild or scrub holds their range.
        if (rebuilding != 0 || layout.copy.tracking.load(SeqCst) != 0)
            && layout.copy.held(offset, len)
        {
            let h = self.mirror.as_ref().expect("registered by hook_id");
            return h.hold(io, op, offset, len, tag);
        }
        // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
        unsafe { mirror_write(layout, handles, io, op, offset, len, tag, hook) };
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
    handles: &mut [DeviceHandle],
    io: &mut CoreIo,
    op: IoOp,
    offset: u64,
    len: u64,
    tag: Tag,
    hook: u32,
) {
    let failed = layout.health.failed.load(Relaxed);
    let rebuilding = layout.health.rebuilding.load(Relaxed);
    let mut parts = 0u32;
    for p in layout.pieces(offset, len) {
        let alive = layout
            .set_of(p.dev)
            .filter(|&d| failed & (1 << d) == 0)
            .count();
        parts += u32_of(alive.max(1));
    }
    let t = if rebuilding == 0 && layout.copy.tracking.load(SeqCst) == 0 {
        io.join(tag, parts)
    } else {
        let token = layout.copy.begin_write(offset, len);
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
            // SAFETY: `sub`'s buffer is a sub-range of `op`'s, whose contract our caller
            // upholds.
            unsafe { handles[d].submit(io, sub, h) };
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
            let e = engine.get_or_insert_with(|| crate::layout::parity_io::engine_for(io, layout));
            // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
            return unsafe { e.submit(io, layout, op, tag) };
        }
        let (offset, len) = match op {
            IoOp::Read { offset, len, .. } | IoOp::Write { offset, len, .. } => {
                (offset, len as u64)
            }
            IoOp::Discard { offset, len } | IoOp::WriteZeroes { offset, len, .. } => (offset, len),
            IoOp::Flush => {
                let failed = self.layout.health.failed.load(Relaxed);
                let n = self.handles.len() - failed.count_ones() as usize;
                if n == 0 {
                    return io.complete(tag, -libc::EIO);
                }
                let mirror = self.layout.copies > 1;
                let hook = if mirror { self.hook_id(io) } else { 0 };
                let t = if n == 1 { tag } else { io.join(tag, u32_of(n)) };
                for (i, h) in self.handles.iter_mut().enumerate() {
                    if failed & (1 << i) == 0 {
                        // Mirrors: a copy that cannot flush is failed, like one that
                        // cannot write.
                        let ti = if mirror {
                            io.hooked(t, hook, IoOp::Flush, i as u64)
                        } else {
                            t
                        };
                        // SAFETY: a flush carries no buffer.
                        unsafe { h.submit(io, IoOp::Flush, ti) };
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
            // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
            return unsafe { self.submit_mirror(io, op, offset, len, tag) };
        }
        // Split borrows instead of cloning the Arc: a clone would be an atomic write to
        // a cache line every core shares.
        let LayoutHandle {
            layout, handles, ..
        } = self;
        let n = layout.piece_count(offset, len);
        if n == 1 {
            let p = layout.piece(offset, len);
            // SAFETY: our caller upholds `IoHandle::submit`'s contract for `op`'s buffer.
            return unsafe { submit_piece(handles, io, &op, p, tag) };
        }
        let t = io.join(tag, u32_of(n));
        for p in layout.pieces(offset, len) {
            // SAFETY: as above, for each piece of `op`.
            unsafe { submit_piece(handles, io, &op, p, t) };
        }
    }

    fn size(&self) -> u64 {
        self.layout.size
    }
}
