//! The queue's transport: PDUs in (receive, parse, ICReq, command capsules with their
//! in-capsule data, H2CData into the command's buffer, termination) and out (C2HData,
//! R2T, response capsules gathered into one send).

use tracing::{info, warn};

use tessera_export::conn::SendDone;
use tessera_export::{ExportTarget, IoClass};
use tessera_io::CoreIo;

use super::*;
use crate::nvme::*;
use crate::pdu::{self, Fatal, Fes, Framing, Role};

impl<T: ExportTarget> NvmfQueue<T> {
    pub(super) fn post_recv(&mut self, io: &mut CoreIo) {
        if !self.sock.may_recv() || self.rbuf.is_full() {
            return;
        }
        let tag = self.tag(SLOT_RECV);
        let (ptr, len) = self.rbuf.room(usize::MAX);
        // SAFETY: the buffer belongs to this task, which outlives the operation
        // (finished() waits for it), and is not compacted while a receive is posted.
        unsafe { self.sock.post_recv(io, ptr, len, tag) };
    }

    pub(super) fn on_recv(&mut self, io: &mut CoreIo, res: i32) {
        let Some(n) = self.sock.recv_done(res) else {
            return;
        };
        self.rbuf.filled(n);
        self.parse(io);
        self.post_recv(io);
    }

    /// End the connection with a C2HTermReq quoting the offending header.
    pub(super) fn fatal(&mut self, f: Fatal, at: usize) {
        // Quote the offending header: HLEN bytes when that is plausible, else what we have
        // of the common header.
        let have = (self.rbuf.end() - at).min(128);
        let hlen = self.rbuf.received().get(at + 2).copied().unwrap_or(0) as usize;
        let n = if (pdu::CH_LEN..=have).contains(&hlen) {
            hlen
        } else {
            have.min(pdu::CH_LEN)
        };
        let quoted = &self.rbuf.received()[at..at + n];
        if BAD_CONN_LOG.admit() {
            warn!(
                client = %self.client,
                qid = self.qid,
                cntlid = self.ctrl.as_ref().map_or(0, |c| c.cntlid),
                error = %f,
                "nvmf: terminating the connection"
            );
        }
        let t = pdu::encode_term(pdu::C2H_TERM, f, quoted);
        self.outq.push(Out::Bytes(t));
        self.sock.draining = true;
    }

    pub(super) fn parse(&mut self, io: &mut CoreIo) {
        while !self.sock.draining {
            let avail = self.rbuf.end() - self.rbuf.start();
            if self.state == State::Init {
                if avail < pdu::CH_LEN {
                    break;
                }
                // Refuse a wrong first PDU before waiting for 128 bytes of it.
                let ch = pdu::Ch::parse(self.rbuf.unparsed());
                if ch.ty != pdu::ICREQ || ch.plen as usize != pdu::IC_LEN {
                    let f = if ch.ty != pdu::ICREQ {
                        Fatal::new(Fes::PduSequenceError, 0)
                    } else {
                        Fatal::new(Fes::InvalidHeaderField, 4)
                    };
                    self.fatal(f, self.rbuf.start());
                    break;
                }
                if avail < pdu::IC_LEN {
                    break;
                }
                let b = &self.rbuf.unparsed()[..pdu::IC_LEN];
                match pdu::parse_icreq(b) {
                    Ok(r) => {
                        let hd = r.digest & pdu::DIGEST_HDR != 0;
                        let dd = r.digest & pdu::DIGEST_DATA != 0;
                        self.limits.hdgst = hd;
                        self.limits.ddgst = dd;
                        self.send_framing = Framing {
                            hdgst: hd,
                            ddgst: dd,
                            align: 4 * (r.hpda as usize + 1),
                        };
                        let resp = pdu::encode_icresp(&pdu::IcResp {
                            pfv: 0,
                            cpda: 0,
                            digest: r.digest & (pdu::DIGEST_HDR | pdu::DIGEST_DATA),
                            maxh2cdata: target::MAXH2CDATA,
                        });
                        self.outq.push(Out::Bytes(resp.to_vec()));
                        self.rbuf.consume(pdu::IC_LEN);
                        self.state = State::Ready;
                    }
                    Err(f) => {
                        self.fatal(f, self.rbuf.start());
                        break;
                    }
                }
                continue;
            }
            if avail < pdu::CH_LEN {
                break;
            }
            let at = self.rbuf.start();
            let frame =
                match pdu::check_header(Role::Controller, self.rbuf.unparsed(), &self.limits) {
                    Ok(f) => f,
                    Err(f) => {
                        self.fatal(f, at);
                        break;
                    }
                };
            if frame.ch.ty == pdu::CAPSULE_CMD && frame.data_len > target::IN_CAPSULE {
                self.fatal(Fatal::new(Fes::DataLimitExceeded, 4), at);
                break;
            }
            if avail < frame.plen() {
                break;
            }
            if let Err(f) = pdu::check_hdgst(&frame, self.rbuf.unparsed()) {
                self.fatal(f, at);
                break;
            }
            match frame.ch.ty {
                pdu::H2C_TERM => {
                    let (fes, fei) = pdu::parse_term(self.rbuf.unparsed());
                    if BAD_CONN_LOG.admit() {
                        info!(client = %self.client, fes, fei, "nvmf: host terminated the connection");
                    }
                    self.sock.draining = true;
                    self.sock.dead = true;
                    break;
                }
                pdu::CAPSULE_CMD => {
                    let Some(s) = self.free.pop() else { break };
                    self.rbuf.consume(frame.plen());
                    self.on_capsule(io, s, &frame, at);
                }
                _ => {
                    // H2C_DATA (check_header admits nothing else for a controller).
                    self.rbuf.consume(frame.plen());
                    if let Err(f) = self.on_h2c(io, &frame, at) {
                        self.fatal(f, at);
                        break;
                    }
                }
            }
        }
        // The buffer may move only while no receive is posted into it: a posted receive
        // writes at the offset it was given, so resetting or compacting under it (parse
        // also runs from on_send, to resume after slots were freed) would drop what it
        // brings and parse stale commands in its place. on_recv compacts instead.
        if !self.sock.recv_posted() {
            self.rbuf.compact();
        }
    }

    /// Data direction of a command: 1 host to controller, 2 controller to host.
    pub(super) fn direction(sqe: &Sqe) -> u8 {
        if sqe.opc == FABRICS {
            match sqe.fctype() {
                FCTYPE_CONNECT | FCTYPE_AUTH_SEND => 1,
                FCTYPE_AUTH_RECV => 2,
                _ => 0,
            }
        } else {
            sqe.opc & 3
        }
    }

    pub(super) fn on_capsule(&mut self, io: &mut CoreIo, s: u16, f: &pdu::Frame, at: usize) {
        let pdu_bytes = &self.rbuf.received()[at..at + f.plen()];
        let sqe = Sqe::parse(&pdu_bytes[8..72]);
        let ddgst_ok = pdu::ddgst_ok(f, pdu_bytes);
        self.active += 1;
        if !self.sq_flow_disabled {
            self.sqhd = if self.sqhd as usize + 1 >= self.entries {
                0
            } else {
                self.sqhd + 1
            };
        }
        {
            let sl = &mut self.slots[s as usize];
            sl.sqe = sqe;
            sl.start = io.now();
            sl.status = 0;
            sl.dw0 = 0;
            sl.c2h_len = 0;
            sl.h2c_len = 0;
            sl.h2c_got = 0;
            sl.phase = Phase::Io;
        }
        if self.state == State::Connected && self.active > self.entries {
            // More commands than the queue size agreed at Connect.
            return self.finish(io, s, SC_CMD_SEQ_ERROR | DNR);
        }
        if !ddgst_ok {
            return self.finish(io, s, SC_TRANSIENT_TRANSPORT);
        }
        let dir = Self::direction(&sqe);
        let len = sqe.sgl.len as usize;
        if f.data_len > 0 && !(dir == 1 && sqe.sgl.kind == SGL_DATA_BLOCK_OFFSET) {
            return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
        }
        if len == 0 || dir == 0 {
            return self.execute(io, s);
        }
        if len > target::MAX_TRANSFER {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        match (sqe.sgl.kind, dir) {
            (SGL_DATA_BLOCK_OFFSET, 1) => {
                if sqe.sgl.addr != 0 {
                    return self.finish(io, s, SC_SGL_INVALID_OFFSET | DNR);
                }
                if len != f.data_len {
                    return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
                }
                let mut buf = io.bufs.get(len);
                buf.as_mut_slice()[..len]
                    .copy_from_slice(&self.rbuf.received()[at + f.data_off..at + f.data_off + len]);
                let sl = &mut self.slots[s as usize];
                sl.buf = Some(buf);
                sl.h2c_len = sqe.sgl.len;
                sl.h2c_got = sqe.sgl.len;
                self.execute(io, s)
            }
            (SGL_TRANSPORT_DATA_BLOCK, 1) => {
                if self.state != State::Connected && sqe.opc != FABRICS {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                }
                // No R2T (and no buffer for the data) before the queue authenticated.
                if !self.authenticated && sqe.opc != FABRICS {
                    return self.finish(io, s, SC_AUTH_REQUIRED | DNR);
                }
                self.transfer_within_budget(io, s)
            }
            (SGL_TRANSPORT_DATA_BLOCK, 2) => self.transfer_within_budget(io, s),
            (SGL_DATA_BLOCK_OFFSET, _) => self.finish(io, s, SC_SGL_INVALID_DATA | DNR),
            _ => self.finish(io, s, SC_SGL_INVALID_TYPE | DNR),
        }
    }

    /// Start command `s`, whose data moves as R2T/H2CData or C2HData, once its buffers
    /// fit the queue's budget; until then it waits in `budget_wait`, in arrival order,
    /// holding its slot but no buffer (`retry_budget` starts it).
    ///
    /// Unlike NBD, a queue over its budget keeps reading its socket: the H2CData of a
    /// write already sent its R2T may sit in the stream behind the command that does
    /// not fit, and the write holds budget until that data arrives. The queue stops
    /// reading when every slot is taken (the queue depth), so what it holds stays the
    /// budget's bytes plus one SQE per waiting command.
    fn transfer_within_budget(&mut self, io: &mut CoreIo, s: u16) {
        if self.budget_wait.is_empty() && self.take_budget(s) {
            return self.start_transfer(io, s);
        }
        self.slots[s as usize].phase = Phase::Budget;
        self.budget_wait.push_back(s);
    }

    fn take_budget(&mut self, s: u16) -> bool {
        let charge = self.buffer_charge(&self.slots[s as usize].sqe);
        if !self.budget.try_take(charge) {
            return false;
        }
        self.slots[s as usize].charged = charge;
        true
    }

    /// Bytes of data buffers command `sqe` takes from the core's pool, as the pool
    /// rounds them: its transfer, twice for a Compare (the stored data is read beside
    /// it). A bound: a command that fails before taking its buffer holds the charge
    /// until its reply left.
    fn buffer_charge(&self, sqe: &Sqe) -> u64 {
        let one = tessera_io::BufPool::capacity_for(sqe.sgl.len as usize) as u64;
        if self.qid != 0 && sqe.opc == IO_COMPARE {
            2 * one
        } else {
            one
        }
    }

    /// Command `s` has its budget: a host-to-controller transfer asks for all its data
    /// with one R2T (the host splits it into H2CData PDUs of at most MAXH2CDATA bytes);
    /// a controller-to-host one runs.
    fn start_transfer(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        if Self::direction(&sqe) != 1 {
            return self.execute(io, s);
        }
        let buf = io.bufs.get(sqe.sgl.len as usize);
        let fr = self.send_framing;
        let sl = &mut self.slots[s as usize];
        sl.buf = Some(buf);
        sl.h2c_len = sqe.sgl.len;
        sl.phase = Phase::AwaitData;
        sl.r2t_len = fr.r2t(&mut sl.r2t, sqe.cid, s, 0, sqe.sgl.len);
        self.outq.push(Out::R2t(s));
    }

    /// Start, in arrival order, the commands waiting for budget that fit now (buffers
    /// were released); on a dead socket, drop them (nobody waits for their replies).
    pub(super) fn retry_budget(&mut self, io: &mut CoreIo) {
        while let Some(&s) = self.budget_wait.front() {
            if !self.sock.dead && !self.take_budget(s) {
                break;
            }
            self.budget_wait.pop_front();
            if self.sock.dead {
                self.active -= 1;
                self.release(io, s);
                continue;
            }
            self.slots[s as usize].phase = Phase::Io;
            self.start_transfer(io, s);
        }
    }

    pub(super) fn on_h2c(
        &mut self,
        io: &mut CoreIo,
        f: &pdu::Frame,
        at: usize,
    ) -> Result<(), Fatal> {
        let b = &self.rbuf.received()[at..at + f.plen()];
        let cid = pdu::le16(b, 8);
        let ttag = pdu::le16(b, 10);
        let datao = pdu::le32(b, 12);
        let datal = pdu::le32(b, 16);
        let ok = self
            .slots
            .get(ttag as usize)
            .is_some_and(|sl| sl.phase == Phase::AwaitData && sl.sqe.cid == cid);
        if !ok {
            return Err(Fatal::new(Fes::InvalidHeaderField, 10));
        }
        if datal as usize != f.data_len {
            return Err(Fatal::new(Fes::InvalidHeaderField, 16));
        }
        let sl = &mut self.slots[ttag as usize];
        if datao != sl.h2c_got || datao as u64 + datal as u64 > sl.h2c_len as u64 {
            return Err(Fatal::new(Fes::DataOutOfRange, 12));
        }
        let last = sl.h2c_got + datal == sl.h2c_len;
        if last != (f.ch.flags & pdu::F_DATA_LAST != 0) {
            return Err(Fatal::new(Fes::PduSequenceError, 1));
        }
        let buf = sl.buf.as_mut().expect("h2c buffer");
        buf.as_mut_slice()[datao as usize..(datao + datal) as usize]
            .copy_from_slice(&b[f.data_off..f.data_off + datal as usize]);
        if !pdu::ddgst_ok(f, b) {
            sl.status = SC_TRANSIENT_TRANSPORT;
        }
        sl.h2c_got += datal;
        if last {
            sl.phase = Phase::Io;
            let st = sl.status;
            if st != 0 {
                self.finish(io, ttag, st);
            } else {
                self.execute(io, ttag);
            }
        }
        Ok(())
    }

    pub(super) fn finish_dw1(&mut self, io: &mut CoreIo, s: u16, dw1: u32) {
        self.finish_with(io, s, 0, dw1)
    }

    pub(super) fn finish(&mut self, io: &mut CoreIo, s: u16, status: Status) {
        self.finish_with(io, s, status, 0)
    }

    pub(super) fn finish_with(&mut self, _io: &mut CoreIo, s: u16, status: Status, dw1: u32) {
        self.active -= 1;
        let idx = s as usize;
        let qid = self.qid;
        let sqe = self.slots[idx].sqe;
        // Per-volume statistics, as an NBD connection keeps them.
        if self.qid != 0 && sqe.opc != FABRICS && self.slots[idx].ns < self.ns.len() {
            let sl = &self.slots[idx];
            let bytes = (sqe.nlb() as u64) << target::LBA_SHIFT;
            let (class, bytes) = match sqe.opc {
                IO_READ => (IoClass::Read, bytes),
                IO_WRITE => (IoClass::Write, bytes),
                IO_FLUSH => (IoClass::Flush, 0),
                IO_DSM => (IoClass::Discard, 0),
                IO_WRITE_ZEROES => (IoClass::WriteZeroes, 0),
                _ => (IoClass::Other, 0),
            };
            // Timed when the batch is flushed (see `flush`).
            self.unrecorded
                .push(sl.ns, class, bytes, sl.start, status == 0);
        }
        if status != 0 {
            if let Some(c) = &self.ctrl {
                c.record_error(ErrorEntry {
                    count: 0,
                    sqid: qid,
                    cid: sqe.cid,
                    status,
                    lba: sqe.slba(),
                    nsid: sqe.nsid,
                });
            }
        }
        let fr = self.send_framing;
        let skip_ok = self.sq_flow_disabled && !fr.ddgst;
        let sqhd = self.sqhd;
        let sl = &mut self.slots[idx];
        sl.status = status;
        sl.buf2 = None;
        if status != 0 {
            sl.c2h_len = 0;
        }
        sl.skip_resp = false;
        if sl.c2h_len > 0 {
            let len = sl.c2h_len;
            sl.skip_resp = skip_ok;
            let flags = pdu::F_DATA_LAST | if skip_ok { pdu::F_DATA_SUCCESS } else { 0 };
            sl.hdr_len = fr.data_pdu(&mut sl.hdr, pdu::C2H_DATA, flags, sqe.cid, 0, 0, len);
            if fr.ddgst {
                let d = pdu::crc(&sl.buf.as_ref().expect("reply data").as_slice()[..len as usize]);
                sl.ddg = d.to_le_bytes();
            }
        }
        if !sl.skip_resp {
            let cqe = Cqe {
                dw0: sl.dw0,
                dw1,
                sqhd,
                sqid: qid,
                cid: sqe.cid,
                status,
            };
            sl.resp_len = fr.capsule_resp(&mut sl.resp, &cqe.encode());
        }
        sl.phase = Phase::Reply;
        self.outq.push(Out::Reply(s));
    }

    pub(super) fn release(&mut self, io: &mut CoreIo, s: u16) {
        let sl = &mut self.slots[s as usize];
        if let Some(b) = sl.buf.take() {
            io.bufs.put(b);
        }
        if let Some(b) = sl.buf2.take() {
            io.bufs.put(b);
        }
        sl.phase = Phase::Free;
        self.budget.release(std::mem::take(&mut sl.charged));
        self.free.push(s);
    }

    pub(super) fn send(&mut self, io: &mut CoreIo) {
        if self.sock.send_posted() || self.outq.is_empty() {
            return;
        }
        if self.sock.dead {
            for o in std::mem::take(&mut self.outq) {
                if let Out::Reply(s) = o {
                    self.release(io, s);
                }
            }
            return;
        }
        let batch = self.sock.batch();
        batch.clear();
        self.sending.clear();
        let mut taken = 0;
        let ddgst = self.send_framing.ddgst;
        for o in &self.outq {
            if !batch.has_room(4) {
                break;
            }
            match o {
                Out::Bytes(v) => batch.push(v.as_ptr(), v.len()),
                Out::R2t(s) => {
                    let sl = &self.slots[*s as usize];
                    batch.push(sl.r2t.as_ptr(), sl.r2t_len);
                }
                Out::Reply(s) => {
                    let sl = &self.slots[*s as usize];
                    if sl.c2h_len > 0 {
                        batch.push(sl.hdr.as_ptr(), sl.hdr_len);
                        let b = sl.buf.as_ref().expect("reply data");
                        batch.push(b.as_ptr(), sl.c2h_len as usize);
                        if ddgst {
                            batch.push(sl.ddg.as_ptr(), 4);
                        }
                    }
                    if !sl.skip_resp {
                        batch.push(sl.resp.as_ptr(), sl.resp_len);
                    }
                }
            }
            taken += 1;
        }
        self.sending.extend(self.outq.drain(..taken));
        let tag = self.tag(SLOT_SEND);
        // SAFETY: the iovecs point at what `sending` holds (byte vectors, slot headers
        // and buffers), which is dropped or released only in on_send, once the send is
        // over.
        unsafe { self.sock.post_send(io, tag) };
    }

    pub(super) fn on_send(&mut self, io: &mut CoreIo, res: i32) {
        let tag = self.tag(SLOT_SEND);
        if self.sock.send_done(io, res, tag) == SendDone::Partial {
            return;
        }
        for o in std::mem::take(&mut self.sending) {
            if let Out::Reply(s) = o {
                self.release(io, s);
            }
        }
        self.parse(io);
        self.post_recv(io);
    }
}
