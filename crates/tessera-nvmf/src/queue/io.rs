//! I/O commands: the namespaces an I/O queue opened (target handle, QoS gate, stats),
//! admission at the gate, and Read, Write, Compare, Flush, Write Zeroes and Dataset
//! Management on the targets.

use tessera_export::conn::{add_throttled, read_into_new_buf};
use tessera_export::{Charge, ExportHandle, ExportTarget};
use tessera_io::cast::u32_of;
use tessera_io::{CoreIo, IoOp};

use super::*;
use crate::nvme::{self, *};

impl<T: ExportTarget> NvmfQueue<T> {
    /// Reopen namespace handles after the subsystem's namespaces changed (only when no
    /// I/O is in flight on the old handles).
    pub(super) fn refresh_ns(&mut self, io: &mut CoreIo, ctrl: &Controller<T>) {
        let g = ctrl.ns_gen.load(Acquire);
        if g == self.ns_gen || self.in_io > 0 || self.ns.iter().any(|n| !n.gate.is_idle()) {
            return;
        }
        self.ns_gen = g;
        self.open_namespaces(io, ctrl);
    }

    pub(super) fn open_namespaces(&mut self, io: &mut CoreIo, ctrl: &Controller<T>) {
        for n in self.ns.drain(..) {
            n.close();
        }
        for e in ctrl.namespaces() {
            let i = u32_of(self.ns.len());
            let ana = self.target.ana_group(&ctrl.subnqn, e.nsid);
            let blocks = e.size() >> target::LBA_SHIFT;
            let (backing, qos, stats, read_only) = match e.export {
                Some(x) => {
                    let stats = x.target.register_stats();
                    let read_only = x.target.read_only();
                    let backing = Backing {
                        vol: x.target.open(),
                        target: x.target,
                    };
                    (Some(backing), x.qos, stats, read_only)
                }
                // No data here: nothing is admitted to anything, so an unlimited gate.
                None => (
                    None,
                    Arc::new(tessera_export::VolumeQos::new(
                        Default::default(),
                        Instant::now(),
                    )),
                    Arc::new(IoStats::default()),
                    false,
                ),
            };
            let gate = Gate::new(
                io,
                &qos,
                self.tag(SLOT_GATE - 2 * i),
                self.tag(SLOT_GATE - 2 * i - 1),
            );
            self.ns.push(Ns {
                nsid: e.nsid,
                backing,
                ana,
                read_only,
                blocks,
                gate,
                stats,
            });
        }
    }

    /// Pass the command to its volume if the namespace's gate (QoS limits, shares) lets
    /// it through now; otherwise the gate holds it and hands it back from `on_gate`.
    pub(super) fn admit_or_park(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &self.slots[s as usize];
        let charge = match sl.sqe.opc {
            IO_READ | IO_COMPARE => Charge::Read((sl.sqe.nlb() as u64) << target::LBA_SHIFT),
            IO_WRITE => Charge::Write((sl.sqe.nlb() as u64) << target::LBA_SHIFT),
            IO_WRITE_ZEROES | IO_DSM => Charge::Write(0),
            _ => Charge::Free,
        };
        let ns = sl.ns;
        let slba = sl.sqe.slba();
        let Some(n) = self.ns.get_mut(ns) else {
            // Flush of every namespace: no limit applies.
            return self.dispatch_io(io, s);
        };
        // While writes wait for a share round, a random read goes before them.
        let charge = match (charge, &n.backing) {
            (Charge::Read(b), Some(back))
                if n.gate.has_deferred() && back.vol.reads_first_at(slba << target::LBA_SHIFT) =>
            {
                Charge::ReadFirst(b)
            }
            (c, _) => c,
        };
        if n.gate.offer(io, s, charge) {
            return self.dispatch_io(io, s);
        }
        self.slots[s as usize].phase = Phase::Throttled;
    }

    /// Namespace `i`'s gate timer or round came: serve what it lets through now.
    pub(super) fn on_gate(&mut self, io: &mut CoreIo, slot: u32) {
        let i = ((SLOT_GATE - slot) / 2) as usize;
        if i >= self.ns.len() {
            return; // a wake-up for namespaces reopened since
        }
        if self.sock.dead {
            let mut slots = Vec::new();
            self.ns[i].gate.drain(&mut slots);
            for s in slots {
                self.active -= 1;
                self.release(io, s);
            }
        }
        let mut out = std::mem::take(&mut self.released);
        let tag = self.tag(slot);
        self.ns[i].gate.wake(io, tag, &mut out);
        for r in out.drain(..) {
            if r.throttled {
                add_throttled(
                    &self.ns[i].stats,
                    self.slots[r.slot as usize].start,
                    io.now(),
                );
            }
            self.dispatch_io(io, r.slot);
        }
        self.released = out;
    }

    /// Hand `op` to namespace `ns`; its buffer (if any) is one of the slot's buffers.
    pub(super) fn submit(&mut self, io: &mut CoreIo, ns: usize, op: IoOp, tag: Tag) {
        self.in_io += 1;
        match &mut self.ns[ns].backing {
            // SAFETY: a Read or Write buffer is the slot's `buf` or `buf2`, which stay
            // with the slot (not released, not reused) until the slot's I/O completes in
            // on_io.
            Some(b) => unsafe { b.vol.submit(io, op, tag) },
            // dispatch_io refused the command already; namespaces are only reopened with
            // no I/O in flight, so this is never reached, and fails safe if it were.
            None => io.complete(tag, -libc::EIO),
        }
    }

    /// The byte range of an LBA-addressed command, if it lies inside the namespace.
    pub(super) fn range(&self, ns: usize, slba: u64, nlb: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(nlb)?;
        if end > self.ns[ns].blocks {
            return None;
        }
        Some((slba << target::LBA_SHIFT, nlb << target::LBA_SHIFT))
    }

    pub(super) fn dispatch_io(&mut self, io: &mut CoreIo, s: u16) {
        let idx = s as usize;
        let tag = self.tag(s as u32);
        let sqe = self.slots[idx].sqe;
        let ns = self.slots[idx].ns;
        self.slots[idx].phase = Phase::Io;
        if let Some(n) = self.ns.get(ns) {
            // Asymmetric Namespace Access: one relaxed load per command.
            let ana = n.ana.state(n.backing.is_some());
            if !ana.accessible() {
                return self.finish(io, s, ana.io_status());
            }
        }
        let writes = matches!(sqe.opc, IO_WRITE | IO_WRITE_ZEROES | IO_DSM);
        if writes && self.ns.get(ns).is_some_and(|n| n.read_only) {
            return self.finish(io, s, SC_NS_WRITE_PROTECTED | DNR);
        }
        if ns == usize::MAX {
            // Flush of every namespace reachable through this path.
            let reachable = |n: &Ns<T>| n.ana.state(n.backing.is_some()).accessible();
            let count = self.ns.iter().filter(|n| reachable(n)).count();
            if count == 0 {
                return self.finish(io, s, 0);
            }
            let child = io.join(tag, u32_of(count));
            self.in_io += 1;
            for n in self.ns.iter_mut().filter(|n| reachable(n)) {
                if let Some(b) = &mut n.backing {
                    // SAFETY: a flush carries no buffer.
                    unsafe { b.vol.submit(io, IoOp::Flush, child) };
                }
            }
            return;
        }
        match sqe.opc {
            IO_READ | IO_WRITE | IO_COMPARE => {
                let Some((offset, len)) = self.range(ns, sqe.slba(), sqe.nlb() as u64) else {
                    return self.finish(io, s, SC_LBA_RANGE | DNR);
                };
                let expected = if sqe.opc == IO_READ {
                    sqe.sgl.len
                } else {
                    self.slots[idx].h2c_len
                };
                if len != u64::from(expected) {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let len = expected;
                match sqe.opc {
                    IO_READ => {
                        let (buf, op) = read_into_new_buf(io, offset, len);
                        self.slots[idx].buf = Some(buf);
                        self.slots[idx].c2h_len = len;
                        self.submit(io, ns, op, tag);
                    }
                    IO_WRITE => {
                        let buf = self.slots[idx].buf.as_ref().expect("write data").as_ptr();
                        self.submit(io, ns, IoOp::Write { offset, len, buf }, tag);
                    }
                    _ => {
                        let (buf, op) = read_into_new_buf(io, offset, len);
                        self.slots[idx].buf2 = Some(buf);
                        self.slots[idx].phase = Phase::CompareRead;
                        self.submit(io, ns, op, tag);
                    }
                }
            }
            IO_FLUSH => self.submit(io, ns, IoOp::Flush, tag),
            IO_WRITE_ZEROES => {
                let Some((offset, len)) = self.range(ns, sqe.slba(), sqe.nlb() as u64) else {
                    return self.finish(io, s, SC_LBA_RANGE | DNR);
                };
                // DEAC: the host allows deallocating (a thin unmap when whole units).
                let may_unmap = sqe.cdw12 & (1 << 25) != 0;
                self.submit(
                    io,
                    ns,
                    IoOp::WriteZeroes {
                        offset,
                        len,
                        may_unmap,
                    },
                    tag,
                );
            }
            IO_DSM => {
                let nr = (sqe.cdw10 & 0xFF) as usize + 1;
                if sqe.cdw11 & (1 << 2) == 0 {
                    // Only attributes (hints): nothing to do.
                    return self.finish(io, s, 0);
                }
                let data_ok = self.slots[idx]
                    .buf
                    .as_ref()
                    .is_some_and(|_| self.slots[idx].h2c_len as usize >= 16 * nr);
                if !data_ok {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let ranges = {
                    let b = self.slots[idx].buf.as_ref().expect("dsm data").as_slice();
                    nvme::dsm_ranges(b, nr)
                };
                let mut ops = Vec::with_capacity(nr);
                for (slba, nlb) in ranges {
                    if nlb == 0 {
                        continue;
                    }
                    let Some((offset, len)) = self.range(ns, slba, nlb as u64) else {
                        return self.finish(io, s, SC_LBA_RANGE | DNR);
                    };
                    ops.push(IoOp::Discard { offset, len });
                }
                if ops.is_empty() {
                    return self.finish(io, s, 0);
                }
                let child = io.join(tag, u32_of(ops.len()));
                self.in_io += 1;
                for op in ops {
                    match &mut self.ns[ns].backing {
                        // SAFETY: a discard carries no buffer.
                        Some(b) => unsafe { b.vol.submit(io, op, child) },
                        // Checked accessible (hence backed) above.
                        None => io.complete(child, -libc::EIO),
                    }
                }
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    pub(super) fn on_io(&mut self, io: &mut CoreIo, s: u16, res: i32) {
        self.in_io -= 1;
        let idx = s as usize;
        let sqe = self.slots[idx].sqe;
        if res < 0 {
            let write = matches!(sqe.opc, IO_WRITE | IO_WRITE_ZEROES | IO_DSM);
            return self.finish(io, s, nvme::status_from_errno(-res, write));
        }
        match self.slots[idx].phase {
            Phase::CompareRead => {
                let same = {
                    let sl = &self.slots[idx];
                    let n = sl.h2c_len as usize;
                    let a = &sl.buf.as_ref().expect("compare data").as_slice()[..n];
                    let b = &sl.buf2.as_ref().expect("stored data").as_slice()[..n];
                    a == b
                };
                self.finish(io, s, if same { 0 } else { SC_COMPARE_FAILED | DNR })
            }
            // FUA (CDW12 bit 30, the same bit in Write and Write Zeroes): the data must
            // be durable before the completion, so a flush follows.
            Phase::Io if matches!(sqe.opc, IO_WRITE | IO_WRITE_ZEROES) && sqe.fua() => {
                self.slots[idx].phase = Phase::FuaFlush;
                let tag = self.tag(s as u32);
                let ns = self.slots[idx].ns;
                self.submit(io, ns, IoOp::Flush, tag);
            }
            _ => self.finish(io, s, 0),
        }
    }
}
