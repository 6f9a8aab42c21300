//! In-band authentication on a queue: Authentication Send and Receive carry the
//! DH-HMAC-CHAP messages to and from the queue's [`ControllerAuth`]; until its
//! transaction succeeds, the queue refuses every other command but Connect and
//! Disconnect with Authentication Required.

use tracing::{info, warn};

use tessera_export::ExportTarget;
use tessera_io::CoreIo;

use super::*;
use crate::auth::{self, Message};
use crate::nvme::*;

/// The commands a queue takes before it authenticated.
pub(super) fn allowed_before_auth(sqe: &Sqe) -> bool {
    sqe.opc == FABRICS
        && matches!(
            sqe.fctype(),
            FCTYPE_CONNECT | FCTYPE_AUTH_SEND | FCTYPE_AUTH_RECV | FCTYPE_DISCONNECT
        )
}

impl<T: ExportTarget> NvmfQueue<T> {
    pub(super) fn auth_cmd(&mut self, io: &mut CoreIo, s: u16) {
        let sqe = self.slots[s as usize].sqe;
        let Some(ctrl) = self.ctrl.clone() else {
            return self.finish(io, s, SC_CMD_SEQ_ERROR);
        };
        if !auth::is_dhchap_cdw10(sqe.cdw10) {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        let Some(a) = self.auth.as_mut() else {
            // This host has no secret here: there is nothing to authenticate.
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        };
        let was = a.authenticated();
        if sqe.fctype() == FCTYPE_AUTH_SEND {
            let tl = sqe.cdw11 as usize;
            let got = self.slots[s as usize].h2c_got as usize;
            if tl == 0 || tl > auth::MAX_MESSAGE || tl != got {
                return self.finish(io, s, SC_INVALID_FIELD | DNR);
            }
            let r = {
                let data = &self.slots[s as usize]
                    .buf
                    .as_ref()
                    .expect("auth data")
                    .as_slice()[..tl];
                a.send(data)
            };
            self.authenticated = a.authenticated();
            self.log_change(&ctrl, was, None);
            return match r {
                Ok(()) => self.finish(io, s, 0),
                Err(st) => self.finish(io, s, st),
            };
        }
        let al = sqe.cdw11 as usize;
        if al == 0 || al > sqe.sgl.len as usize {
            return self.finish(io, s, SC_INVALID_FIELD | DNR);
        }
        match a.receive(al) {
            Ok(msg) => {
                self.authenticated = a.authenticated();
                self.log_change(&ctrl, was, Some(&msg));
                self.reply_data(io, s, &msg)
            }
            Err(st) => self.finish(io, s, st),
        }
    }

    /// One line when a queue authenticates, or when the controller refuses a host.
    fn log_change(&self, ctrl: &Controller<T>, was: bool, sent: Option<&[u8]>) {
        let Some(a) = &self.auth else { return };
        let (hash, group) = a.chosen();
        if a.authenticated() && !was {
            info!(
                cntlid = ctrl.cntlid,
                qid = self.qid,
                subnqn = %ctrl.subnqn,
                hostnqn = %ctrl.hostnqn,
                hash = hash.name(),
                dhgroup = group.name(),
                "nvmf: queue authenticated (DH-HMAC-CHAP)"
            );
        }
        if let Some(Ok(Message::Failure1 { reason, .. })) = sent.map(Message::parse) {
            warn!(
                cntlid = ctrl.cntlid,
                qid = self.qid,
                subnqn = %ctrl.subnqn,
                hostnqn = %ctrl.hostnqn,
                reason = reason.text(),
                "nvmf: host failed authentication"
            );
        }
    }
}
