//! Fabrics commands (Connect, Property Get/Set, Disconnect), admin commands (Identify,
//! Get Log Page, features, asynchronous events, Abort, Keep Alive) and the admin
//! queue's keep-alive tick.

use tracing::info;

use tessera_export::ExportTarget;
use tessera_io::cast::{u32_of, u8_of, usize_of};
use tessera_io::CoreIo;

use super::*;
use crate::nvme::{self, *};

impl<T: ExportTarget> NvmfQueue<T> {
    pub(super) fn fabrics(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        match sqe.fctype() {
            FCTYPE_CONNECT => self.connect(io, s),
            FCTYPE_AUTH_SEND | FCTYPE_AUTH_RECV => self.auth_cmd(io, s),
            FCTYPE_PROPERTY_GET | FCTYPE_PROPERTY_SET => {
                let Some(ctrl) = self.ctrl.clone() else {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                };
                if self.qid != 0 {
                    return self.finish(io, s, SC_INVALID_OPCODE | DNR);
                }
                self.property(io, s, &ctrl)
            }
            FCTYPE_DISCONNECT => {
                if self.ctrl.is_none() {
                    return self.finish(io, s, SC_CMD_SEQ_ERROR);
                }
                self.finish(io, s, 0);
                // Answer, then close once everything in flight is done.
                self.sock.draining = true;
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    pub(super) fn connect(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        if self.state == State::Connected {
            return self.finish(io, s, SC_CMD_SEQ_ERROR | DNR);
        }
        let c = ConnectCmd::parse(&sqe);
        let have = self.slots[s as usize].h2c_got as usize;
        if have < CONNECT_DATA_LEN {
            return self.finish(io, s, SC_SGL_INVALID_DATA | DNR);
        }
        let d = ConnectData::parse(
            self.slots[s as usize]
                .buf
                .as_ref()
                .expect("connect data")
                .as_slice(),
        );
        let invalid = |in_data, off| {
            (
                SC_CONNECT_INVALID_PARAM | DNR,
                connect_invalid_param(in_data, off),
            )
        };
        let r: Result<Arc<Controller<T>>, (Status, u32)> = (|| {
            if c.recfmt != 0 {
                return Err((0x0180 | DNR, 0)); // incompatible format
            }
            if c.sqsize == 0 || c.sqsize > target::MQES {
                return Err(invalid(false, 44));
            }
            if c.qid == 0 {
                if d.cntlid != 0xFFFF {
                    return Err(invalid(true, 16));
                }
                let sub = if d.subnqn == target::DISCOVERY_NQN {
                    None
                } else {
                    match self.target.catalog.subsystem(&d.subnqn) {
                        Some(x) => Some(x),
                        None => return Err(invalid(true, 256)),
                    }
                };
                if let Some(x) = &sub {
                    if !x.allows(&d.hostnqn) {
                        return Err((
                            SC_CONNECT_INVALID_HOST | DNR,
                            connect_invalid_param(true, 512),
                        ));
                    }
                }
                let ctrl = self
                    .target
                    .create_controller(&d.subnqn, sub, &d.hostnqn, d.hostid, c.kato)
                    .ok_or((SC_INTERNAL, 0))?;
                Ok(ctrl)
            } else {
                let Some(ctrl) = self.target.controller(d.cntlid) else {
                    return Err(invalid(true, 16));
                };
                if ctrl.subnqn != d.subnqn {
                    return Err(invalid(true, 256));
                }
                if ctrl.hostnqn != d.hostnqn || ctrl.discovery {
                    return Err(invalid(true, 512));
                }
                if c.qid > ctrl.state().io_queues {
                    return Err(invalid(false, 42));
                }
                Ok(ctrl)
            }
        })();
        let ctrl = match r {
            Ok(x) => x,
            Err((st, dw0)) => {
                self.slots[s as usize].dw0 = dw0;
                return self.finish(io, s, st);
            }
        };
        if !ctrl.register_queue(c.qid, self.sock.raw_fd()) {
            if c.qid == 0 {
                self.target.remove_controller(&ctrl, "");
            }
            self.slots[s as usize].dw0 = connect_invalid_param(false, 42);
            return self.finish(io, s, SC_CONNECT_INVALID_PARAM | DNR);
        }
        self.registered = true;
        self.qid = c.qid;
        self.entries = c.sqsize as usize + 1;
        self.sq_flow_disabled = c.cattr & CATTR_DISABLE_SQ_FLOW != 0;
        self.state = State::Connected;
        // Room for a full queue of commands plus as many answered ones still being sent.
        let want = 2 * self.entries + 4;
        if self.slots.len() < want {
            self.free.add_range(self.slots.len(), want);
            self.slots.resize_with(want, Slot::new);
        }
        if c.qid != 0 {
            self.ns_gen = ctrl.ns_gen.load(Acquire);
            self.open_namespaces(io, &ctrl);
        }
        self.slots[s as usize].dw0 = ctrl.cntlid as u32;
        let nsids: Vec<u32> = ctrl.namespaces().iter().map(|n| n.nsid).collect();
        info!(
            protocol = "nvme-tcp",
            client = %self.client,
            subnqn = %ctrl.subnqn,
            hostnqn = %ctrl.hostnqn,
            cntlid = ctrl.cntlid,
            qid = c.qid,
            namespaces = ?nsids,
            "nvmf: host connected"
        );
        if let Some(keys) = ctrl.auth.clone() {
            self.auth = Some(Box::new(ControllerAuth::new(
                keys,
                &ctrl.hostnqn,
                &ctrl.subnqn,
            )));
            self.authenticated = false;
            self.slots[s as usize].dw0 |= crate::auth::CONNECT_AUTHREQ_ATR;
        }
        self.ctrl = Some(ctrl);
        self.finish(io, s, 0);
        if self.qid == 0 {
            self.arm_tick(io);
        }
    }

    pub(super) fn property(&mut self, io: &mut CoreIo, s: u16, ctrl: &Controller<T>) {
        let sqe = self.slots[s as usize].sqe;
        let eight = sqe.cdw10 & 7 == 1;
        let offset = sqe.cdw11;
        if sqe.fctype() == FCTYPE_PROPERTY_GET {
            let st = ctrl.state();
            let v: u64 = match (offset, eight) {
                (PROP_CAP, true) => nvme::cap(target::MQES),
                (PROP_VS, false) => VERSION as u64,
                (PROP_CC, false) => st.cc as u64,
                (PROP_CSTS, false) => st.csts as u64,
                _ => {
                    drop(st);
                    return self.finish(io, s, SC_INVALID_FIELD | DNR);
                }
            };
            drop(st);
            // DW1 carries the high half of an 8-byte property.
            let (low, high) = split64(v);
            self.slots[s as usize].dw0 = low;
            return self.finish_dw1(io, s, high);
        }
        if offset != PROP_CC || eight {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        // CC is a 4-byte property: its value is the low dword of the 8-byte field.
        let v = sqe.cdw12;
        let mut st = ctrl.state();
        let old = st.cc;
        st.cc = v;
        if v & CC_EN != 0 && old & CC_EN == 0 {
            st.csts |= CSTS_RDY;
            ctrl.ready.store(true, Release);
        } else if v & CC_EN == 0 && old & CC_EN != 0 {
            // Controller reset: its I/O queues go away.
            st.csts &= !CSTS_RDY;
            ctrl.ready.store(false, Release);
            ctrl.reset_io_queues(&st);
        }
        if v & CC_SHN_MASK != 0 {
            // Shutdown: every completed write is already with the volume, and the pools
            // commit on their own; report the shutdown complete.
            st.csts = (st.csts & !(3 << 2)) | CSTS_SHST_COMPLETE;
        } else {
            st.csts &= !(3 << 2);
        }
        drop(st);
        self.finish(io, s, 0)
    }

    // ---- admin ----

    pub(super) fn reply_data(&mut self, io: &mut CoreIo, s: u16, data: &[u8]) {
        let want_len = self.slots[s as usize].sqe.sgl.len;
        let want = want_len as usize;
        let n = want.min(data.len());
        let mut buf = io.bufs.get(want.max(1));
        buf.as_mut_slice()[..n].copy_from_slice(&data[..n]);
        for x in &mut buf.as_mut_slice()[n..want] {
            *x = 0;
        }
        let sl = &mut self.slots[s as usize];
        sl.buf = Some(buf);
        sl.c2h_len = want_len;
        self.finish(io, s, 0)
    }

    pub(super) fn admin(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller<T>>) {
        let sqe = self.slots[s as usize].sqe;
        let needs_ready = !matches!(sqe.opc, ADM_KEEP_ALIVE);
        if needs_ready && !ctrl.ready.load(Acquire) && !ctrl.discovery {
            return self.finish(io, s, SC_CMD_SEQ_ERROR);
        }
        let data_in = sqe.opc & 3 == 2;
        if data_in && sqe.sgl.kind != SGL_TRANSPORT_DATA_BLOCK && sqe.sgl.len > 0 {
            return self.finish(io, s, SC_SGL_INVALID_TYPE | DNR);
        }
        match sqe.opc {
            ADM_IDENTIFY => self.identify(io, s, ctrl),
            ADM_GET_LOG_PAGE => self.get_log_page(io, s, ctrl),
            ADM_KEEP_ALIVE => {
                ctrl.last_ka.store(self.target.now_ms(), Release);
                self.finish(io, s, 0)
            }
            ADM_SET_FEATURES | ADM_GET_FEATURES => self.features(io, s, ctrl),
            ADM_ASYNC_EVENT => {
                if self.aers.len() > target::AERL as usize {
                    return self.finish(io, s, SC_ASYNC_LIMIT);
                }
                self.slots[s as usize].phase = Phase::Aer;
                self.aers.push(s);
                self.deliver_aen(io, ctrl);
            }
            ADM_ABORT => {
                let sqid = low16(sqe.cdw10);
                let cid = high16(sqe.cdw10);
                // Held AERs can be aborted; commands already running on a volume cannot
                // (DW0 bit 0 = not aborted), which the spec allows.
                let hit = (sqid == 0)
                    .then(|| {
                        self.aers
                            .iter()
                            .position(|&a| self.slots[a as usize].sqe.cid == cid)
                    })
                    .flatten();
                match hit {
                    Some(i) => {
                        let a = self.aers.remove(i);
                        self.finish(io, a, SC_ABORT_REQ);
                        self.finish(io, s, 0);
                    }
                    None => {
                        self.slots[s as usize].dw0 = 1;
                        self.finish(io, s, 0)
                    }
                }
            }
            _ => self.finish(io, s, SC_INVALID_OPCODE | DNR),
        }
    }

    pub(super) fn identify(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller<T>>) {
        let sqe = self.slots[s as usize].sqe;
        let cns = low8(sqe.cdw10);
        let namespaces = ctrl.namespaces();
        let ns_info = |nsid: u32| {
            namespaces
                .iter()
                .find(|n| n.nsid == nsid)
                .map(|n| NamespaceInfo {
                    blocks: n.size() >> target::LBA_SHIFT,
                    allocated_blocks: n
                        .export
                        .as_ref()
                        .map_or(0, |e| e.target.allocated_bytes() >> target::LBA_SHIFT),
                    lba_shift: target::LBA_SHIFT,
                    nguid: n.nguid,
                    eui64: n.eui64,
                    uuid: n.uuid,
                    // One ANA group per namespace.
                    anagrpid: n.nsid,
                })
        };
        let data = match cns {
            CNS_CONTROLLER => identify_controller(&ControllerInfo {
                serial: ctrl.serial(),
                model: "Tessera".into(),
                firmware: env!("CARGO_PKG_VERSION").into(),
                cntlid: ctrl.cntlid,
                mdts: target::MDTS,
                nn: namespaces.iter().map(|n| n.nsid).max().unwrap_or(0),
                subnqn: ctrl.subnqn.clone(),
                discovery: ctrl.discovery,
                ioccsz: u32_of((SQE_LEN + target::IN_CAPSULE) / 16),
                maxcmd: target::MQES + 1,
                kas: 1,
                aerl: target::AERL,
                elpe: u8_of(target::ERROR_LOG - 1),
                ana: !ctrl.discovery,
            }),
            CNS_NAMESPACE if !ctrl.discovery => match ns_info(sqe.nsid) {
                Some(n) => identify_namespace(&n),
                // An inactive but valid NSID reads as zeros; others are invalid.
                None if sqe.nsid != 0 && sqe.nsid != 0xFFFF_FFFF => vec![0; IDENTIFY_LEN],
                None => return self.finish(io, s, SC_INVALID_NS | DNR),
            },
            CNS_ACTIVE_NS_LIST if !ctrl.discovery => {
                if sqe.nsid >= 0xFFFF_FFFE {
                    return self.finish(io, s, SC_INVALID_NS | DNR);
                }
                let ids: Vec<u32> = namespaces.iter().map(|n| n.nsid).collect();
                active_ns_list(&ids, sqe.nsid)
            }
            CNS_NS_DESC_LIST if !ctrl.discovery => match ns_info(sqe.nsid) {
                Some(n) => identify_ns_descriptors(&n),
                None => return self.finish(io, s, SC_INVALID_NS | DNR),
            },
            _ => return self.finish(io, s, SC_INVALID_FIELD | DNR),
        };
        self.reply_data(io, s, &data)
    }

    pub(super) fn get_log_page(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller<T>>) {
        let sqe = self.slots[s as usize].sqe;
        let (lid, len, offset, _rae) = log_page_args(&sqe);
        if len != sqe.sgl.len as usize || offset % 4 != 0 {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        let page = match lid {
            LID_DISCOVERY if ctrl.discovery => {
                let e = self.target.discovery_entries(&ctrl.hostnqn);
                discovery_log(self.target.discovery_generation(), &e)
            }
            LID_ERROR => {
                let st = ctrl.state();
                let e: Vec<ErrorEntry> = st.errors.iter().copied().collect();
                error_log(&e)
            }
            LID_SMART if !ctrl.discovery => {
                let mut sm = Smart::default();
                for n in ctrl.namespaces() {
                    if sqe.nsid != 0xFFFF_FFFF && sqe.nsid != 0 && sqe.nsid != n.nsid {
                        continue;
                    }
                    let Some(export) = &n.export else {
                        continue;
                    };
                    let st = export.target.stats();
                    sm.read_bytes += st.read_bytes;
                    sm.write_bytes += st.write_bytes;
                    sm.reads += st.reads;
                    sm.writes += st.writes;
                    sm.errors += st.errors;
                }
                sm.power_on_hours = self.target.started.elapsed().as_secs() / 3600;
                smart_log(&sm)
            }
            LID_FW_SLOT if !ctrl.discovery => {
                let mut b = vec![0u8; 512];
                b[0] = 1;
                let fw = env!("CARGO_PKG_VERSION").as_bytes();
                for (i, x) in b[8..16].iter_mut().enumerate() {
                    *x = *fw.get(i).unwrap_or(&b' ');
                }
                b
            }
            LID_ANA if !ctrl.discovery => {
                let groups_only = log_specific(&sqe) & ANA_LSP_RGO != 0;
                self.target.ana_log(ctrl, groups_only)
            }
            LID_CHANGED_NS if !ctrl.discovery => {
                let ids = std::mem::take(&mut ctrl.state().changed);
                changed_ns_log(&ids)
            }
            _ => return self.finish(io, s, SC_INVALID_LOG_PAGE | DNR),
        };
        let from = usize_of(offset).min(page.len());
        self.reply_data(io, s, &page[from..])
    }

    pub(super) fn features(&mut self, io: &mut CoreIo, s: u16, ctrl: &Arc<Controller<T>>) {
        let sqe = self.slots[s as usize].sqe;
        let fid = low8(sqe.cdw10);
        let set = sqe.opc == ADM_SET_FEATURES;
        if set && sqe.cdw10 & (1 << 31) != 0 {
            return self.finish(io, s, SC_FEATURE_NOT_SAVEABLE | DNR);
        }
        let mut st = ctrl.state();
        let r: Result<u32, Status> = match (fid, set) {
            (FEAT_NUM_QUEUES, true) if !ctrl.discovery => {
                let nsqr = sqe.cdw11 & 0xFFFF;
                let ncqr = sqe.cdw11 >> 16;
                if nsqr == 0xFFFF || ncqr == 0xFFFF {
                    Err(SC_INVALID_FIELD | DNR)
                } else {
                    let n = (nsqr.max(ncqr) + 1).min(u32::from(target::MAX_IO_QUEUES));
                    st.io_queues = u16::try_from(n).unwrap_or(target::MAX_IO_QUEUES);
                    Ok((n - 1) | (n - 1) << 16)
                }
            }
            (FEAT_NUM_QUEUES, false) if !ctrl.discovery => {
                let n = st.io_queues as u32 - 1;
                Ok(n | n << 16)
            }
            (FEAT_KATO, true) => {
                st.kato_ms = sqe.cdw11;
                ctrl.last_ka.store(self.target.now_ms(), Release);
                Ok(0)
            }
            (FEAT_KATO, false) => Ok(st.kato_ms),
            (FEAT_ASYNC_EVENT, true) => {
                st.aec = sqe.cdw11;
                Ok(0)
            }
            (FEAT_ASYNC_EVENT, false) => Ok(st.aec),
            // The volatile write cache is always on (writes are durable after Flush).
            (FEAT_VOLATILE_WC, true) if !ctrl.discovery => Ok(0),
            (FEAT_VOLATILE_WC, false) if !ctrl.discovery => Ok(1),
            (FEAT_ARBITRATION | FEAT_POWER_MGMT | FEAT_TEMP_THRESH | FEAT_ERR_RECOVERY, false)
                if !ctrl.discovery =>
            {
                Ok(0)
            }
            _ => Err(SC_INVALID_FIELD | DNR),
        };
        drop(st);
        match r {
            Ok(dw0) => {
                self.slots[s as usize].dw0 = dw0;
                self.finish(io, s, 0)
            }
            Err(e) => self.finish(io, s, e),
        }
    }

    pub(super) fn deliver_aen(&mut self, io: &mut CoreIo, ctrl: &Controller<T>) {
        while !self.aers.is_empty() {
            let Some(ev) = ctrl.state().aen.pop_front() else {
                return;
            };
            let a = self.aers.remove(0);
            self.slots[a as usize].dw0 = ev;
            self.finish(io, a, 0);
        }
    }

    /// Admin queue: keep-alive check and event delivery. Before Connect: the timeout.
    pub(super) fn on_tick(&mut self, io: &mut CoreIo) {
        self.tick_armed = false;
        if self.sock.draining {
            return;
        }
        match (&self.ctrl, self.state) {
            (Some(ctrl), State::Connected) => {
                let ctrl = ctrl.clone();
                if ctrl.dead.load(Acquire) {
                    self.sock.draining = true;
                    return;
                }
                if !self.authenticated && self.started.elapsed() >= CONNECT_TIMEOUT {
                    info!(
                        cntlid = ctrl.cntlid,
                        qid = self.qid,
                        hostnqn = %ctrl.hostnqn,
                        timeout = ?CONNECT_TIMEOUT,
                        "nvmf: closing a queue that did not authenticate in time"
                    );
                    self.sock.draining = true;
                    return;
                }
                let kato = ctrl.state().kato_ms as u64;
                let idle = self
                    .target
                    .now_ms()
                    .saturating_sub(ctrl.last_ka.load(Acquire));
                if kato > 0 && idle > kato {
                    self.target.remove_controller(
                        &ctrl,
                        &format!("keep-alive timeout ({kato} ms) expired; tearing down its queues"),
                    );
                    self.sock.draining = true;
                    return;
                }
                self.deliver_aen(io, &ctrl);
            }
            _ => {
                if self.started.elapsed() >= CONNECT_TIMEOUT {
                    if BAD_CONN_LOG.admit() {
                        info!(
                            client = %self.client,
                            timeout = ?CONNECT_TIMEOUT,
                            "nvmf: closing a connection that did not connect in time"
                        );
                    }
                    self.sock.draining = true;
                    return;
                }
            }
        }
        self.arm_tick(io);
    }
}
