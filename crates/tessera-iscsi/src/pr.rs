//! SCSI persistent reservations (SPC-4 §5.13, PERSISTENT RESERVE IN §6.15 and OUT
//! §6.16) of one logical unit: the registrations (one reservation key per I_T nexus),
//! the reservation, the PRgeneration counter, and which commands a reservation lets an
//! I_T nexus run.
//!
//! The state lives in the unit's [`LuShared`](crate::lu::LuShared), shared by every
//! connection serving the volume; this module is the state machine alone (no locking),
//! and the serialized form APTPL ("activate persist through power loss") saves.
//!
//! APTPL is accepted only where the owner installed a persister (`LuShared::set_persist`):
//! elsewhere REPORT CAPABILITIES says PTPL_C 0 and APTPL set is an invalid field.
//!
//! Unit attentions: what a PERSISTENT RESERVE OUT does to other I_T nexuses' standing
//! ([`PrState::attentions`]: REGISTRATIONS PREEMPTED, RESERVATIONS PREEMPTED,
//! RESERVATIONS RELEASED) is queued in the unit's `LuShared` and reported once, to the
//! next command of each such nexus.
//!
//! REGISTER AND MOVE takes an iSCSI TransportID of format 01b (name and ISID: an
//! initiator port) and relative target port 1 (the one this target has).
//!
//! What is not supported: SPEC_I_PT and ALL_TG_PT (REPORT CAPABILITIES says so; a
//! REGISTER that sets either is an invalid field in the parameter list), and the
//! aborting half of PREEMPT AND ABORT (it preempts, the tasks of the preempted nexuses
//! run to completion).

use tessera_io::cast::{u16_of, u32_of};

use crate::pdu::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::scsi::{Command, Sense};

/// SCSI status RESERVATION CONFLICT.
pub const RESERVATION_CONFLICT: u8 = 0x18;

/// Reservation types (the TYPE field).
pub const WRITE_EXCLUSIVE: u8 = 1;
pub const EXCLUSIVE_ACCESS: u8 = 3;
pub const WRITE_EXCLUSIVE_RO: u8 = 5;
pub const EXCLUSIVE_ACCESS_RO: u8 = 6;
pub const WRITE_EXCLUSIVE_AR: u8 = 7;
pub const EXCLUSIVE_ACCESS_AR: u8 = 8;

/// PERSISTENT RESERVE IN service actions.
pub const READ_KEYS: u8 = 0;
pub const READ_RESERVATION: u8 = 1;
pub const REPORT_CAPABILITIES: u8 = 2;
pub const READ_FULL_STATUS: u8 = 3;

/// PERSISTENT RESERVE OUT service actions.
pub const REGISTER: u8 = 0;
pub const RESERVE: u8 = 1;
pub const RELEASE: u8 = 2;
pub const CLEAR: u8 = 3;
pub const PREEMPT: u8 = 4;
pub const PREEMPT_AND_ABORT: u8 = 5;
pub const REGISTER_AND_IGNORE: u8 = 6;
pub const REGISTER_AND_MOVE: u8 = 7;

// `scsi::decode` accepts exactly the service actions named here.
const _: () = assert!(
    crate::scsi::PRIN_SERVICE_ACTIONS == READ_FULL_STATUS + 1
        && crate::scsi::PROUT_SERVICE_ACTIONS == REGISTER_AND_MOVE + 1
);

/// The basic PERSISTENT RESERVE OUT parameter list is 24 bytes.
pub const PROUT_PARAM_LEN: u32 = 24;

/// Sense key UNIT ATTENTION.
pub const UNIT_ATTENTION: u8 = 0x06;

const fn attention(ascq: u8) -> Sense {
    Sense {
        key: UNIT_ATTENTION,
        asc: 0x2a,
        ascq,
        info: None,
        field: None,
    }
}

/// RESERVATIONS PREEMPTED (2A/03): a CLEAR, to every other registrant.
pub const RESERVATIONS_PREEMPTED: Sense = attention(0x03);
/// RESERVATIONS RELEASED (2A/04): a Registrants Only or All Registrants reservation
/// released, to every other registrant.
pub const RESERVATIONS_RELEASED: Sense = attention(0x04);
/// REGISTRATIONS PREEMPTED (2A/05): a PREEMPT (AND ABORT) removed the nexus's
/// registration.
pub const REGISTRATIONS_PREEMPTED: Sense = attention(0x05);

/// INVALID RELEASE OF PERSISTENT RESERVATION.
/// Registrations one unit keeps at most: they outlive the sessions that made them, so an
/// initiator logging in under ever new ISIDs could otherwise grow them without bound.
pub const MAX_REGISTRATIONS: usize = 1024;
/// A REGISTER past [`MAX_REGISTRATIONS`] (SPC-4: INSUFFICIENT REGISTRATION RESOURCES).
pub const INSUFFICIENT_REGISTRATION_RESOURCES: Sense = Sense {
    key: crate::scsi::ILLEGAL_REQUEST,
    asc: 0x55,
    ascq: 0x04,
    info: None,
    field: None,
};

pub const INVALID_RELEASE: Sense = Sense {
    key: crate::scsi::ILLEGAL_REQUEST,
    asc: 0x26,
    ascq: 0x04,
    info: None,
    field: None,
};

fn valid_type(t: u8) -> bool {
    matches!(t, 1 | 3 | 5 | 6 | 7 | 8)
}

fn all_registrants(t: u8) -> bool {
    matches!(t, WRITE_EXCLUSIVE_AR | EXCLUSIVE_ACCESS_AR)
}

/// An I_T nexus: the initiator port (iSCSI name with its ISID, `iqn...,i,0x<isid>`, as
/// the iSCSI TransportID names it) and the target port (target name with its portal
/// group, `iqn...,t,0x0001`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Nexus {
    pub initiator: String,
    pub target: String,
}

impl Nexus {
    /// The nexus of a session of `initiator` with ISID `isid` on `target` (portal group
    /// 1, the one this target has).
    pub fn new(initiator: &str, isid: [u8; 6], target: &str) -> Nexus {
        let mut i = format!("{initiator},i,0x");
        for b in isid {
            i.push_str(&format!("{b:02x}"));
        }
        Nexus {
            initiator: i,
            target: format!("{target},t,0x0001"),
        }
    }
}

/// What a command does to the medium, for the conflict table (SPC-4 §5.13.1, SBC-3
/// §4.17): commands that never conflict, reads (conflict under the Exclusive Access
/// types) and writes (conflict under every type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Free,
    Read,
    Write,
}

/// The access class of a decoded command.
pub fn access_of(c: &Command) -> Access {
    match c {
        Command::TestUnitReady
        | Command::Inquiry { .. }
        | Command::ReadCapacity10
        | Command::ReadCapacity16 { .. }
        | Command::ReportLuns { .. }
        | Command::RequestSense { .. }
        | Command::ReportOpcodes(_)
        | Command::ReportTargetPortGroups { .. }
        | Command::PersistentReserveIn { .. }
        | Command::PersistentReserveOut { .. }
        | Command::Reserve6
        | Command::Release6 => Access::Free,
        Command::Read { .. }
        | Command::Verify { .. }
        | Command::Prefetch { .. }
        | Command::GetLbaStatus { .. }
        | Command::ReadDefectData { .. }
        | Command::ModeSense(_) => Access::Read,
        Command::Write { .. }
        | Command::WriteSame16 { .. }
        | Command::Unmap { .. }
        | Command::CompareAndWrite { .. }
        | Command::OrWrite { .. }
        | Command::SynchronizeCache { .. }
        | Command::ModeSelect { .. }
        | Command::NoOp => Access::Write,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Registration {
    nexus: Nexus,
    key: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Reservation {
    ptype: u8,
    /// The holder; `None` for the All Registrants types, held by every registrant.
    holder: Option<Nexus>,
}

/// How a PERSISTENT RESERVE OUT fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrError {
    /// RESERVATION CONFLICT status.
    Conflict,
    /// CHECK CONDITION with this sense.
    Check(Sense),
}

/// The persistent reservation state of one logical unit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrState {
    generation: u32,
    regs: Vec<Registration>,
    resv: Option<Reservation>,
    /// The last successful REGISTER asked for persistence through power loss.
    aptpl: bool,
}

/// A PERSISTENT RESERVE OUT, as decoded from its CDB and parameter list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProutRequest {
    pub sa: u8,
    pub scope: u8,
    pub ptype: u8,
    pub key: u64,
    pub sa_key: u64,
    pub aptpl: bool,
    /// REGISTER AND MOVE: the initiator port its TransportID names (the destination
    /// I_T nexus is that port on the issuing nexus's target port), and UNREG.
    pub move_to: Option<String>,
    pub unreg: bool,
}

/// The initiator port an iSCSI TransportID of format 01b names, as [`Nexus`] spells it
/// (`name,i,0x<isid>`, the ISID in lower case); `None` for anything else.
pub fn transport_id_port(t: &[u8]) -> Option<String> {
    if t.len() < 4 || t[0] != 0x45 {
        return None;
    }
    let len = usize::from(get_u16(t, 2));
    let body = t.get(4..4 + len)?;
    let end = body.iter().position(|&b| b == 0)?;
    let s = std::str::from_utf8(&body[..end]).ok()?;
    let at = s.to_ascii_lowercase().find(",i,0x")?;
    let (name, isid) = (&s[..at], &s[at + 5..]);
    if name.is_empty() || isid.len() != 12 || !isid.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(format!("{name},i,0x{}", isid.to_ascii_lowercase()))
}

impl ProutRequest {
    /// A request of service action `sa` with the basic parameter list's fields (scope
    /// LU, no REGISTER AND MOVE parts): what a caller that does not come from a CDB
    /// (the node restoring state, tests) builds.
    pub fn basic(sa: u8, ptype: u8, key: u64, sa_key: u64, aptpl: bool) -> ProutRequest {
        ProutRequest {
            sa,
            ptype,
            key,
            sa_key,
            aptpl,
            ..ProutRequest::default()
        }
    }

    /// Decode the parameter list `params` (the whole list the CDB announced: a shorter
    /// or longer one is a parameter list length error): the basic 24 bytes, or for
    /// REGISTER AND MOVE its 24-byte header and the TransportID.
    pub fn parse(sa: u8, scope: u8, ptype: u8, params: &[u8]) -> Result<ProutRequest, Sense> {
        if sa == REGISTER_AND_MOVE {
            return Self::parse_move(scope, ptype, params);
        }
        if sa > REGISTER_AND_MOVE {
            return Err(Sense::INVALID_FIELD_IN_CDB);
        }
        if params.len() != usize::try_from(PROUT_PARAM_LEN).unwrap_or(24) {
            return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        // SPEC_I_PT (bit 3) and ALL_TG_PT (bit 2) are not supported.
        if params[20] & 0x0c != 0 {
            return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        Ok(ProutRequest {
            sa,
            scope,
            ptype,
            key: get_u64(params, 0),
            sa_key: get_u64(params, 8),
            aptpl: params[20] & 0x01 != 0,
            ..ProutRequest::default()
        })
    }

    /// REGISTER AND MOVE's parameter list (SPC-4 §6.16.4): keys, UNREG and APTPL in
    /// byte 17, the relative target port in 18..20, the TransportID's length in 20..24
    /// and the TransportID.
    fn parse_move(scope: u8, ptype: u8, params: &[u8]) -> Result<ProutRequest, Sense> {
        if params.len() < 24 {
            return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        let tid_len = usize::try_from(get_u32(params, 20)).unwrap_or(usize::MAX);
        if params.len() - 24 != tid_len {
            return Err(Sense::PARAMETER_LIST_LENGTH_ERROR);
        }
        // The one target port of this target is relative port 1.
        if get_u16(params, 18) != 1 {
            return Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST);
        }
        let port =
            transport_id_port(&params[24..]).ok_or(Sense::INVALID_FIELD_IN_PARAMETER_LIST)?;
        Ok(ProutRequest {
            sa: REGISTER_AND_MOVE,
            scope,
            ptype,
            key: get_u64(params, 0),
            sa_key: get_u64(params, 8),
            aptpl: params[17] & 0x01 != 0,
            move_to: Some(port),
            unreg: params[17] & 0x02 != 0,
        })
    }
}

impl PrState {
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// The reservation's type, 0 when there is none.
    pub fn reservation_type(&self) -> u8 {
        self.resv.as_ref().map_or(0, |r| r.ptype)
    }

    pub fn aptpl(&self) -> bool {
        self.aptpl
    }

    /// Whether any I_T nexus is registered.
    pub fn has_registrations(&self) -> bool {
        !self.regs.is_empty()
    }

    fn key_of(&self, n: &Nexus) -> Option<u64> {
        self.regs.iter().find(|r| r.nexus == *n).map(|r| r.key)
    }

    fn holds(&self, n: &Nexus) -> bool {
        match &self.resv {
            Some(Reservation {
                holder: Some(h), ..
            }) => h == n,
            Some(Reservation { holder: None, .. }) => self.key_of(n).is_some(),
            None => false,
        }
    }

    /// Whether a command of class `access` from `n` meets a RESERVATION CONFLICT.
    pub fn conflicts(&self, n: &Nexus, access: Access) -> bool {
        let Some(r) = &self.resv else {
            return false;
        };
        if access == Access::Free || self.holds(n) {
            return false;
        }
        let registered = self.key_of(n).is_some();
        match r.ptype {
            WRITE_EXCLUSIVE => access == Access::Write,
            EXCLUSIVE_ACCESS => true,
            WRITE_EXCLUSIVE_RO | WRITE_EXCLUSIVE_AR => !registered && access == Access::Write,
            _ => !registered,
        }
    }

    /// Drop `n`'s registration; a reservation it held goes with it (for the All
    /// Registrants types, with the last registrant).
    fn unregister(&mut self, n: &Nexus) {
        self.regs.retain(|r| r.nexus != *n);
        let gone = match &self.resv {
            Some(Reservation {
                holder: Some(h), ..
            }) => h == n,
            Some(Reservation { holder: None, .. }) => self.regs.is_empty(),
            None => false,
        };
        if gone {
            self.resv = None;
        }
    }

    /// Serve a PERSISTENT RESERVE OUT from `n`. Returns whether the state changed
    /// (what APTPL would have to save).
    pub fn prout(&mut self, n: &Nexus, req: &ProutRequest) -> Result<bool, PrError> {
        let mine = self.key_of(n);
        match req.sa {
            REGISTER | REGISTER_AND_IGNORE => {
                match mine {
                    None if req.sa == REGISTER && req.key != 0 => return Err(PrError::Conflict),
                    // Unregistering a nexus that is not registered: nothing to do.
                    None if req.sa_key == 0 => return Ok(false),
                    None if self.regs.len() >= MAX_REGISTRATIONS => {
                        return Err(PrError::Check(INSUFFICIENT_REGISTRATION_RESOURCES))
                    }
                    None => self.regs.push(Registration {
                        nexus: n.clone(),
                        key: req.sa_key,
                    }),
                    Some(k) if req.sa == REGISTER && k != req.key => return Err(PrError::Conflict),
                    Some(_) if req.sa_key == 0 => self.unregister(n),
                    Some(_) => {
                        if let Some(r) = self.regs.iter_mut().find(|r| r.nexus == *n) {
                            r.key = req.sa_key;
                        }
                    }
                }
                self.aptpl = req.aptpl;
                self.generation = self.generation.wrapping_add(1);
                return Ok(true);
            }
            RESERVE | RELEASE | CLEAR | PREEMPT | PREEMPT_AND_ABORT | REGISTER_AND_MOVE => {}
            _ => return Err(PrError::Check(Sense::INVALID_FIELD_IN_CDB)),
        }
        // Everything else needs the nexus registered, with its key.
        if mine != Some(req.key) {
            return Err(PrError::Conflict);
        }
        let scope_type_ok = req.scope == 0 && valid_type(req.ptype);
        match req.sa {
            RESERVE => {
                if !scope_type_ok {
                    return Err(PrError::Check(Sense::INVALID_FIELD_IN_CDB));
                }
                match &self.resv {
                    Some(r) if self.holds(n) && r.ptype == req.ptype => Ok(false),
                    Some(_) => Err(PrError::Conflict),
                    None => {
                        self.resv = Some(Reservation {
                            ptype: req.ptype,
                            holder: (!all_registrants(req.ptype)).then(|| n.clone()),
                        });
                        Ok(true)
                    }
                }
            }
            RELEASE => match &self.resv {
                Some(r) if self.holds(n) => {
                    if req.scope != 0 || r.ptype != req.ptype {
                        return Err(PrError::Check(INVALID_RELEASE));
                    }
                    self.resv = None;
                    Ok(true)
                }
                // No reservation, or one this nexus does not hold: nothing to do.
                _ => Ok(false),
            },
            CLEAR => {
                self.regs.clear();
                self.resv = None;
                self.generation = self.generation.wrapping_add(1);
                Ok(true)
            }
            REGISTER_AND_MOVE => self.register_and_move(n, req),
            // PREEMPT AND ABORT preempts as PREEMPT does; the preempted nexuses' tasks
            // are not aborted (they run to completion).
            _ => self.preempt(n, req, scope_type_ok),
        }
    }

    /// REGISTER AND MOVE (SPC-4 §5.13.8): the reservation holder (`n`, with its key)
    /// registers the I_T nexus of the TransportID with the service action key (one
    /// registered already keeps its key), makes it the holder of the reservation, same
    /// type and scope, and with UNREG drops its own registration.
    fn register_and_move(&mut self, n: &Nexus, req: &ProutRequest) -> Result<bool, PrError> {
        let Some(port) = &req.move_to else {
            return Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
        };
        // Only the holder of a reservation of one holder moves it.
        match &self.resv {
            Some(Reservation {
                holder: Some(h), ..
            }) if h == n => {}
            _ => return Err(PrError::Conflict),
        }
        if req.sa_key == 0 {
            return Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
        }
        let dest = Nexus {
            initiator: port.clone(),
            target: n.target.clone(),
        };
        if dest == *n {
            return Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
        }
        if self.key_of(&dest).is_none() {
            if self.regs.len() >= MAX_REGISTRATIONS {
                return Err(PrError::Check(INSUFFICIENT_REGISTRATION_RESOURCES));
            }
            self.regs.push(Registration {
                nexus: dest.clone(),
                key: req.sa_key,
            });
        }
        if let Some(r) = &mut self.resv {
            r.holder = Some(dest);
        }
        if req.unreg {
            self.regs.retain(|r| r.nexus != *n);
        }
        self.aptpl = req.aptpl;
        self.generation = self.generation.wrapping_add(1);
        Ok(true)
    }

    /// The unit attentions a PERSISTENT RESERVE OUT `req` from `n` that turned `before`
    /// into `self` establishes for other I_T nexuses (SPC-4 §5.13.11): CLEAR, RESERVATIONS
    /// PREEMPTED to every other nexus that was registered; PREEMPT and PREEMPT AND ABORT,
    /// REGISTRATIONS PREEMPTED to every nexus whose registration it removed; RELEASE of a
    /// Registrants Only or All Registrants reservation, RESERVATIONS RELEASED to every
    /// other registrant; the holder of a Registrants Only reservation unregistering
    /// (which releases it), RESERVATIONS RELEASED to every remaining registrant.
    pub fn attentions(
        &self,
        before: &PrState,
        n: &Nexus,
        req: &ProutRequest,
    ) -> Vec<(Nexus, Sense)> {
        let others = |s: &PrState| -> Vec<Nexus> {
            s.regs
                .iter()
                .filter(|r| r.nexus != *n)
                .map(|r| r.nexus.clone())
                .collect()
        };
        let mut out: Vec<(Nexus, Sense)> = Vec::new();
        match req.sa {
            CLEAR => {
                for x in others(before) {
                    out.push((x, RESERVATIONS_PREEMPTED));
                }
            }
            PREEMPT | PREEMPT_AND_ABORT => {
                for x in others(before) {
                    if self.key_of(&x).is_none() {
                        out.push((x, REGISTRATIONS_PREEMPTED));
                    }
                }
            }
            // The holder unregistering out of a Registrants Only reservation ends it
            // (an All Registrants one stays while a registrant remains).
            REGISTER | REGISTER_AND_IGNORE => {
                let released =
                    before.resv.as_ref().is_some_and(|r| {
                        matches!(r.ptype, WRITE_EXCLUSIVE_RO | EXCLUSIVE_ACCESS_RO)
                    }) && self.resv.is_none();
                if released {
                    for x in others(self) {
                        out.push((x, RESERVATIONS_RELEASED));
                    }
                }
            }
            RELEASE => {
                let released = before
                    .resv
                    .as_ref()
                    .is_some_and(|r| matches!(r.ptype, 5..=8))
                    && self.resv.is_none();
                if released {
                    for x in others(self) {
                        out.push((x, RESERVATIONS_RELEASED));
                    }
                }
            }
            _ => {}
        }
        out.dedup_by(|a, b| a.0 == b.0);
        out
    }

    fn preempt(
        &mut self,
        n: &Nexus,
        req: &ProutRequest,
        scope_type_ok: bool,
    ) -> Result<bool, PrError> {
        let victims = |s: &PrState, key: u64| {
            s.regs
                .iter()
                .filter(|r| r.key == key && r.nexus != *n)
                .count()
        };
        let remove = |s: &mut PrState, key: u64| s.regs.retain(|r| r.key != key || r.nexus == *n);
        let holder_key = match &self.resv {
            None => None,
            Some(Reservation {
                holder: Some(h), ..
            }) => Some(self.key_of(h).unwrap_or(0)),
            Some(Reservation { holder: None, .. }) => Some(0),
        };
        match holder_key {
            // No reservation: remove the registrations with the key.
            None => {
                if req.sa_key == 0 {
                    return Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
                }
                if victims(self, req.sa_key) == 0 && self.key_of(n) != Some(req.sa_key) {
                    return Err(PrError::Conflict);
                }
                remove(self, req.sa_key);
            }
            // The reservation's key (0 for All Registrants: every other registration):
            // those registrations go, and the preempting nexus takes the reservation
            // with the new scope and type.
            Some(hk) if hk == req.sa_key => {
                if !scope_type_ok {
                    return Err(PrError::Check(Sense::INVALID_FIELD_IN_CDB));
                }
                if hk == 0 {
                    self.regs.retain(|r| r.nexus == *n);
                } else {
                    remove(self, hk);
                }
                self.resv = Some(Reservation {
                    ptype: req.ptype,
                    holder: (!all_registrants(req.ptype)).then(|| n.clone()),
                });
            }
            // Another key: its registrations go, the reservation stays (All
            // Registrants: unless its last registrant went).
            Some(_) => {
                if req.sa_key == 0 {
                    return Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
                }
                if victims(self, req.sa_key) == 0 {
                    return Err(PrError::Conflict);
                }
                remove(self, req.sa_key);
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(true)
    }

    /// The data of PERSISTENT RESERVE IN with service action `sa` (whole: the caller
    /// cuts it to the allocation length).
    pub fn prin(&self, sa: u8) -> Result<Vec<u8>, Sense> {
        let mut d = vec![0u8; 8];
        match sa {
            READ_KEYS => {
                put_u32(&mut d, 0, self.generation);
                put_u32(&mut d, 4, u32_of(self.regs.len() * 8));
                for r in &self.regs {
                    d.extend_from_slice(&r.key.to_be_bytes());
                }
            }
            READ_RESERVATION => {
                put_u32(&mut d, 0, self.generation);
                if let Some(r) = &self.resv {
                    put_u32(&mut d, 4, 16);
                    let key = r.holder.as_ref().and_then(|h| self.key_of(h)).unwrap_or(0);
                    let mut b = [0u8; 16];
                    put_u64(&mut b, 0, key);
                    b[13] = r.ptype; // scope 0 (LU)
                    d.extend_from_slice(&b);
                }
            }
            REPORT_CAPABILITIES => {
                put_u16(&mut d, 0, 8);
                // CRH, SIP_C, ATP_C 0; PTPL_C (cleared by LuShared::pr_in when no
                // persister is installed).
                d[2] = 0x01;
                // TMV: the type mask is valid; ALLOW COMMANDS 0; PTPL_A.
                d[3] = 0x80 | u8::from(self.aptpl);
                // WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX; EX_AC_AR.
                d[4] = 0x80 | 0x40 | 0x20 | 0x08 | 0x02;
                d[5] = 0x01;
            }
            READ_FULL_STATUS => {
                put_u32(&mut d, 0, self.generation);
                for r in &self.regs {
                    let mut t = r.nexus.initiator.as_bytes().to_vec();
                    t.push(0);
                    t.resize(t.len().next_multiple_of(4).max(20), 0);
                    let mut desc = vec![0u8; 24];
                    put_u64(&mut desc, 0, r.key);
                    if self.holds(&r.nexus) {
                        desc[12] = 0x01; // R_HOLDER
                        desc[13] = self.reservation_type();
                    }
                    put_u16(&mut desc, 18, 1); // relative target port 1
                    put_u32(&mut desc, 20, u32_of(t.len() + 4));
                    // iSCSI TransportID, format 01b (name and ISID), protocol 5.
                    desc.extend_from_slice(&[0x45, 0]);
                    desc.extend_from_slice(&u16_of(t.len()).to_be_bytes());
                    desc.extend_from_slice(&t);
                    d.extend_from_slice(&desc);
                }
                let len = u32_of(d.len() - 8);
                put_u32(&mut d, 4, len);
            }
            _ => return Err(Sense::INVALID_FIELD_IN_CDB),
        }
        Ok(d)
    }

    /// The serialized form (what APTPL saves): version 1 of a small binary layout,
    /// big-endian:
    ///
    /// ```text
    /// "TPR1"  u8 aptpl  u32 generation  u8 type (0: no reservation)
    /// u32 holder (index into the registrations; u32::MAX: none / All Registrants)
    /// u32 registrations, each: u64 key, u16 len + initiator port, u16 len + target port
    /// ```
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = b"TPR1".to_vec();
        b.push(u8::from(self.aptpl));
        b.extend_from_slice(&self.generation.to_be_bytes());
        b.push(self.reservation_type());
        let holder = self
            .resv
            .as_ref()
            .and_then(|r| r.holder.as_ref())
            .and_then(|h| self.regs.iter().position(|r| r.nexus == *h))
            .map_or(u32::MAX, u32_of);
        b.extend_from_slice(&holder.to_be_bytes());
        b.extend_from_slice(&u32_of(self.regs.len()).to_be_bytes());
        for r in &self.regs {
            b.extend_from_slice(&r.key.to_be_bytes());
            for s in [&r.nexus.initiator, &r.nexus.target] {
                b.extend_from_slice(&u16_of(s.len()).to_be_bytes());
                b.extend_from_slice(s.as_bytes());
            }
        }
        b
    }

    /// Read what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(b: &[u8]) -> Result<PrState, &'static str> {
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], &'static str> {
            let s = b.get(at..at + n).ok_or("truncated")?;
            at += n;
            Ok(s)
        };
        if take(4)? != b"TPR1" {
            return Err("not a version 1 reservation state");
        }
        let aptpl = take(1)?[0] != 0;
        let generation = get_u32(take(4)?, 0);
        let ptype = take(1)?[0];
        let holder = get_u32(take(4)?, 0);
        let count = get_u32(take(4)?, 0);
        let mut regs = Vec::new();
        for _ in 0..count {
            let key = get_u64(take(8)?, 0);
            let mut names = [String::new(), String::new()];
            for s in &mut names {
                let n = usize::from(get_u16(take(2)?, 0));
                *s = String::from_utf8(take(n)?.to_vec()).map_err(|_| "name not UTF-8")?;
            }
            let [initiator, target] = names;
            regs.push(Registration {
                nexus: Nexus { initiator, target },
                key,
            });
        }
        if at != b.len() {
            return Err("trailing bytes");
        }
        let resv = match ptype {
            0 => None,
            t if !valid_type(t) => return Err("bad reservation type"),
            t if all_registrants(t) => Some(Reservation {
                ptype: t,
                holder: None,
            }),
            t => {
                let h = usize::try_from(holder)
                    .ok()
                    .and_then(|i| regs.get(i))
                    .ok_or("reservation without its holder")?;
                Some(Reservation {
                    ptype: t,
                    holder: Some(h.nexus.clone()),
                })
            }
        };
        Ok(PrState {
            generation,
            regs,
            resv,
            aptpl,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nx(i: &str) -> Nexus {
        Nexus::new(i, [0, 2, 0x3d, 0, 0, 1], "iqn.t")
    }

    fn req(sa: u8, ptype: u8, key: u64, sa_key: u64) -> ProutRequest {
        ProutRequest::basic(sa, ptype, key, sa_key, false)
    }

    fn keys(s: &PrState) -> Vec<u64> {
        let d = s.prin(READ_KEYS).unwrap();
        d[8..].chunks(8).map(|c| get_u64(c, 0)).collect()
    }

    #[test]
    fn registration_and_generation() {
        let (a, b) = (nx("a"), nx("b"));
        let mut s = PrState::default();
        assert_eq!(a.initiator, "a,i,0x00023d000001");
        // Unregistered: REGISTER with a key other than 0 conflicts; with sark 0 it is a
        // no-op that leaves the generation alone.
        assert_eq!(s.prout(&a, &req(REGISTER, 0, 5, 7)), Err(PrError::Conflict));
        assert_eq!(s.prout(&a, &req(REGISTER, 0, 0, 0)), Ok(false));
        assert_eq!(s.generation(), 0);
        assert_eq!(s.prout(&a, &req(REGISTER, 0, 0, 7)), Ok(true));
        assert_eq!(s.prout(&b, &req(REGISTER_AND_IGNORE, 0, 99, 8)), Ok(true));
        assert_eq!(s.generation(), 2);
        assert_eq!(keys(&s), vec![7, 8]);
        // Re-registering with the wrong key conflicts; IGNORE EXISTING replaces it.
        assert_eq!(s.prout(&a, &req(REGISTER, 0, 6, 9)), Err(PrError::Conflict));
        assert_eq!(s.prout(&a, &req(REGISTER, 0, 7, 9)), Ok(true));
        assert_eq!(s.prout(&a, &req(REGISTER_AND_IGNORE, 0, 0, 10)), Ok(true));
        assert_eq!(keys(&s), vec![10, 8]);
        // Unregister.
        assert_eq!(s.prout(&b, &req(REGISTER, 0, 8, 0)), Ok(true));
        assert_eq!(keys(&s), vec![10]);
        assert_eq!(s.generation(), 5);
        // READ KEYS keeps its additional length whatever the allocation length.
        let d = s.prin(READ_KEYS).unwrap();
        assert_eq!((get_u32(&d, 0), get_u32(&d, 4)), (5, 8));
    }

    #[test]
    fn reserve_release_and_conflicts() {
        let (a, b) = (nx("a"), nx("b"));
        let mut s = PrState::default();
        s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        s.prout(&b, &req(REGISTER, 0, 0, 2)).unwrap();
        let g = s.generation();
        // RESERVE needs the nexus's own key, and a valid type and scope.
        assert_eq!(s.prout(&a, &req(RESERVE, 1, 2, 0)), Err(PrError::Conflict));
        assert_eq!(
            s.prout(&a, &req(RESERVE, 2, 1, 0)),
            Err(PrError::Check(Sense::INVALID_FIELD_IN_CDB))
        );
        assert_eq!(s.prout(&a, &req(RESERVE, 1, 1, 0)), Ok(true));
        // Again, same type: fine; another type, or another nexus: conflict.
        assert_eq!(s.prout(&a, &req(RESERVE, 1, 1, 0)), Ok(false));
        assert_eq!(s.prout(&a, &req(RESERVE, 3, 1, 0)), Err(PrError::Conflict));
        assert_eq!(s.prout(&b, &req(RESERVE, 1, 2, 0)), Err(PrError::Conflict));
        let d = s.prin(READ_RESERVATION).unwrap();
        assert_eq!((get_u32(&d, 4), get_u64(&d, 8), d[21]), (16, 1, 1));
        // RELEASE by a non-holder does nothing; a wrong type is an invalid release.
        assert_eq!(s.prout(&b, &req(RELEASE, 1, 2, 0)), Ok(false));
        assert_eq!(s.reservation_type(), 1);
        assert_eq!(
            s.prout(&a, &req(RELEASE, 3, 1, 0)),
            Err(PrError::Check(INVALID_RELEASE))
        );
        assert_eq!(s.prout(&a, &req(RELEASE, 1, 1, 0)), Ok(true));
        assert_eq!(s.reservation_type(), 0);
        assert_eq!(get_u32(&s.prin(READ_RESERVATION).unwrap(), 4), 0);
        // RESERVE and RELEASE leave the generation alone.
        assert_eq!(s.generation(), g);
        // The holder unregistering releases the reservation.
        s.prout(&a, &req(RESERVE, 3, 1, 0)).unwrap();
        s.prout(&a, &req(REGISTER, 0, 1, 0)).unwrap();
        assert_eq!(s.reservation_type(), 0);
    }

    #[test]
    fn conflict_table_per_type() {
        let (h, r, u) = (nx("holder"), nx("registered"), nx("unregistered"));
        use Access::*;
        // (type, registered non-holder read/write, unregistered read/write), as
        // libiscsi's ProutReserve.Access* tests expect.
        for (t, rr, rw, ur, uw) in [
            (WRITE_EXCLUSIVE, true, false, true, false),
            (EXCLUSIVE_ACCESS, false, false, false, false),
            (WRITE_EXCLUSIVE_RO, true, true, true, false),
            (EXCLUSIVE_ACCESS_RO, true, true, false, false),
            (WRITE_EXCLUSIVE_AR, true, true, true, false),
            (EXCLUSIVE_ACCESS_AR, true, true, false, false),
        ] {
            let mut s = PrState::default();
            s.prout(&h, &req(REGISTER, 0, 0, 1)).unwrap();
            s.prout(&r, &req(REGISTER, 0, 0, 2)).unwrap();
            for n in [&h, &r, &u] {
                assert!(!s.conflicts(n, Write) && !s.conflicts(n, Read));
            }
            s.prout(&h, &req(RESERVE, t, 1, 0)).unwrap();
            assert!(!s.conflicts(&h, Read) && !s.conflicts(&h, Write), "{t}");
            assert_eq!(s.conflicts(&r, Read), !rr, "type {t}");
            assert_eq!(s.conflicts(&r, Write), !rw, "type {t}");
            assert_eq!(s.conflicts(&u, Read), !ur, "type {t}");
            assert_eq!(s.conflicts(&u, Write), !uw, "type {t}");
            assert!(!s.conflicts(&u, Free));
            // Reported key: the holder's, 0 for All Registrants.
            let d = s.prin(READ_RESERVATION).unwrap();
            let want = if all_registrants(t) { 0 } else { 1 };
            assert_eq!((get_u64(&d, 8), d[21]), (want, t));
            // Ownership: the holder unregistering ends the reservation, except for
            // All Registrants, which stays while a registrant remains.
            s.prout(&h, &req(REGISTER, 0, 1, 0)).unwrap();
            assert_eq!(s.reservation_type() != 0, all_registrants(t), "type {t}");
            s.prout(&r, &req(REGISTER, 0, 2, 0)).unwrap();
            assert_eq!(s.reservation_type(), 0);
        }
    }

    #[test]
    fn clear_and_preempt() {
        let (a, b, c) = (nx("a"), nx("b"), nx("c"));
        let mut s = PrState::default();
        s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        s.prout(&b, &req(REGISTER, 0, 0, 2)).unwrap();
        s.prout(&c, &req(REGISTER, 0, 0, 2)).unwrap();
        // Preempt without a reservation: the key's registrations go.
        let g = s.generation();
        assert_eq!(s.prout(&a, &req(PREEMPT, 3, 1, 2)), Ok(true));
        assert_eq!(keys(&s), vec![1]);
        assert_eq!(s.generation(), g + 1);
        assert_eq!(s.prout(&a, &req(PREEMPT, 3, 1, 2)), Err(PrError::Conflict));
        assert_eq!(
            s.prout(&a, &req(PREEMPT, 3, 1, 0)),
            Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST))
        );
        // An unregistered nexus may not preempt.
        assert_eq!(s.prout(&b, &req(PREEMPT, 3, 2, 1)), Err(PrError::Conflict));
        // Preempting the holder moves the reservation, with the new type.
        s.prout(&b, &req(REGISTER, 0, 0, 2)).unwrap();
        s.prout(&a, &req(RESERVE, WRITE_EXCLUSIVE, 1, 0)).unwrap();
        assert_eq!(s.prout(&b, &req(PREEMPT_AND_ABORT, 3, 2, 1)), Ok(true));
        assert_eq!(keys(&s), vec![2]);
        let d = s.prin(READ_RESERVATION).unwrap();
        assert_eq!((get_u64(&d, 8), d[21]), (2, 3));
        assert!(s.conflicts(&a, Access::Read));
        // All Registrants preempted with key 0: every other registration goes.
        s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        s.prout(&b, &req(RELEASE, 3, 2, 0)).unwrap();
        s.prout(&b, &req(RESERVE, EXCLUSIVE_ACCESS_AR, 2, 0))
            .unwrap();
        assert_eq!(s.prout(&a, &req(PREEMPT, WRITE_EXCLUSIVE, 1, 0)), Ok(true));
        assert_eq!(keys(&s), vec![1]);
        assert_eq!(s.reservation_type(), WRITE_EXCLUSIVE);
        // CLEAR: everything goes, the generation moves once.
        let g = s.generation();
        assert_eq!(s.prout(&b, &req(CLEAR, 0, 2, 0)), Err(PrError::Conflict));
        assert_eq!(s.prout(&a, &req(CLEAR, 0, 1, 0)), Ok(true));
        assert_eq!((keys(&s), s.reservation_type()), (vec![], 0));
        assert_eq!(s.generation(), g + 1);
    }

    #[test]
    fn parameter_list_and_capabilities() {
        let mut p = [0u8; 24];
        put_u64(&mut p, 0, 3);
        put_u64(&mut p, 8, 4);
        p[20] = 1;
        let r = ProutRequest::parse(REGISTER, 0, 0, &p).unwrap();
        assert_eq!((r.key, r.sa_key, r.aptpl), (3, 4, true));
        assert_eq!(
            ProutRequest::parse(REGISTER, 0, 0, &p[..20]),
            Err(Sense::PARAMETER_LIST_LENGTH_ERROR)
        );
        p[20] = 0x08;
        assert_eq!(
            ProutRequest::parse(REGISTER, 0, 0, &p),
            Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
        );
        assert_eq!(
            ProutRequest::parse(REGISTER_AND_MOVE, 0, 0, &p),
            Err(Sense::PARAMETER_LIST_LENGTH_ERROR)
        );
        let s = PrState::default();
        let c = s.prin(REPORT_CAPABILITIES).unwrap();
        assert_eq!((get_u16(&c, 0), get_u16(&c, 4)), (8, 0xea01));
        for sa in 4..0x20 {
            assert_eq!(s.prin(sa), Err(Sense::INVALID_FIELD_IN_CDB));
        }
    }

    #[test]
    fn unit_attentions_go_to_the_nexuses_an_action_affected() {
        let (a, b, c, d) = (nx("a"), nx("b"), nx("c"), nx("d"));
        let setup = |ptype: u8| {
            let mut s = PrState::default();
            s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
            s.prout(&b, &req(REGISTER, 0, 0, 2)).unwrap();
            s.prout(&c, &req(REGISTER, 0, 0, 2)).unwrap();
            s.prout(&d, &req(REGISTER, 0, 0, 4)).unwrap();
            if ptype != 0 {
                s.prout(&a, &req(RESERVE, ptype, 1, 0)).unwrap();
            }
            s
        };
        let run = |s: &mut PrState, n: &Nexus, r: ProutRequest| {
            let before = s.clone();
            s.prout(n, &r).unwrap();
            s.attentions(&before, n, &r)
        };
        // CLEAR: every other registrant, reservation or not.
        for t in [0, EXCLUSIVE_ACCESS] {
            let mut s = setup(t);
            assert_eq!(
                run(&mut s, &a, req(CLEAR, 0, 1, 0)),
                vec![
                    (b.clone(), RESERVATIONS_PREEMPTED),
                    (c.clone(), RESERVATIONS_PREEMPTED),
                    (d.clone(), RESERVATIONS_PREEMPTED)
                ]
            );
        }
        // PREEMPT (AND ABORT) of key 2: the two nexuses registered with it, not d; with
        // or without a reservation, and taking the reservation over.
        for (sa, t, holder) in [
            (PREEMPT, 0, &a),
            (PREEMPT_AND_ABORT, EXCLUSIVE_ACCESS, &a),
            (PREEMPT, WRITE_EXCLUSIVE, &d),
        ] {
            let mut s = setup(0);
            if t != 0 {
                let k = if *holder == a { 1 } else { 4 };
                s.prout(holder, &req(RESERVE, t, k, 0)).unwrap();
            }
            let by = if *holder == a { &d } else { &a };
            let k = if *by == a { 1 } else { 4 };
            assert_eq!(
                run(&mut s, by, req(sa, EXCLUSIVE_ACCESS, k, 2)),
                vec![
                    (b.clone(), REGISTRATIONS_PREEMPTED),
                    (c.clone(), REGISTRATIONS_PREEMPTED)
                ],
                "sa {sa} type {t}"
            );
        }
        // Preempting the holder's key: the holder loses its registration.
        let mut s = setup(EXCLUSIVE_ACCESS);
        assert_eq!(
            run(&mut s, &d, req(PREEMPT, WRITE_EXCLUSIVE, 4, 1)),
            vec![(a.clone(), REGISTRATIONS_PREEMPTED)]
        );
        // RELEASE: only of the Registrants Only and All Registrants types, to every
        // other registrant.
        for t in [1, 3, 5, 6, 7, 8] {
            let mut s = setup(t);
            let got = run(&mut s, &a, req(RELEASE, t, 1, 0));
            if matches!(t, 5..=8) {
                let want: Vec<_> = [&b, &c, &d]
                    .into_iter()
                    .map(|x| (x.clone(), RESERVATIONS_RELEASED))
                    .collect();
                assert_eq!(got, want, "type {t}");
            } else {
                assert!(got.is_empty(), "type {t}");
            }
        }
        // A RELEASE that releases nothing (not the holder): none.
        let mut s = setup(WRITE_EXCLUSIVE_RO);
        assert!(run(&mut s, &b, req(RELEASE, WRITE_EXCLUSIVE_RO, 2, 0)).is_empty());
        // The holder of a Registrants Only reservation unregistering releases it.
        for t in [1, 3, 5, 6, 7, 8] {
            let mut s = setup(t);
            let got = run(&mut s, &a, req(REGISTER, 0, 1, 0));
            assert_eq!(
                got.len(),
                if matches!(t, 5 | 6) { 3 } else { 0 },
                "type {t}"
            );
        }
        // REGISTER, RESERVE: none.
        let mut s = setup(0);
        assert!(run(&mut s, &a, req(RESERVE, EXCLUSIVE_ACCESS, 1, 0)).is_empty());
        assert!(run(&mut s, &b, req(REGISTER, 0, 2, 7)).is_empty());
    }

    /// REGISTER AND MOVE's parameter list: keys, UNREG/APTPL, relative target port 1,
    /// an iSCSI TransportID (format 01b) naming `port`.
    fn move_params(key: u64, sa_key: u64, unreg: bool, rel_port: u16, port: &str) -> Vec<u8> {
        let mut t = port.as_bytes().to_vec();
        t.push(0);
        t.resize(t.len().next_multiple_of(4).max(20), 0);
        let mut p = vec![0u8; 24];
        put_u64(&mut p, 0, key);
        put_u64(&mut p, 8, sa_key);
        p[17] = if unreg { 0x02 } else { 0 };
        put_u16(&mut p, 18, rel_port);
        put_u32(&mut p, 20, u32_of(t.len() + 4));
        p.extend_from_slice(&[0x45, 0]);
        p.extend_from_slice(&u16_of(t.len()).to_be_bytes());
        p.extend_from_slice(&t);
        p
    }

    #[test]
    fn register_and_move_hands_the_reservation_to_the_transport_id() {
        let (a, b, c) = (nx("iqn.a"), nx("iqn.b"), nx("iqn.c"));
        let parse = |p: &[u8]| ProutRequest::parse(REGISTER_AND_MOVE, 0, EXCLUSIVE_ACCESS, p);
        // The ISID may come in upper case.
        let b_port = b
            .initiator
            .to_uppercase()
            .replace("IQN.B,I,0X", "iqn.b,i,0x");
        let r = parse(&move_params(1, 9, false, 1, &b_port)).unwrap();
        assert_eq!(r.move_to.as_deref(), Some(b.initiator.as_str()));
        let mut s = PrState::default();
        s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        s.prout(&c, &req(REGISTER, 0, 0, 3)).unwrap();
        // No reservation to move: conflict.
        assert_eq!(s.prout(&a, &r), Err(PrError::Conflict));
        s.prout(&a, &req(RESERVE, EXCLUSIVE_ACCESS, 1, 0)).unwrap();
        // Not the holder, or the wrong key: conflict.
        let from_c = parse(&move_params(3, 9, false, 1, &b.initiator)).unwrap();
        assert_eq!(s.prout(&c, &from_c), Err(PrError::Conflict));
        let wrong_key = parse(&move_params(2, 9, false, 1, &b.initiator)).unwrap();
        assert_eq!(s.prout(&a, &wrong_key), Err(PrError::Conflict));
        // Key 0, or the holder itself: invalid.
        for bad in [
            move_params(1, 0, false, 1, &b.initiator),
            move_params(1, 9, false, 1, &a.initiator),
        ] {
            assert_eq!(
                s.prout(&a, &parse(&bad).unwrap()),
                Err(PrError::Check(Sense::INVALID_FIELD_IN_PARAMETER_LIST))
            );
        }
        let g = s.generation();
        assert_eq!(s.prout(&a, &r), Ok(true));
        assert_eq!(s.generation(), g + 1);
        assert_eq!(keys(&s), vec![1, 3, 9]);
        let d = s.prin(READ_RESERVATION).unwrap();
        assert_eq!((get_u64(&d, 8), d[21]), (9, EXCLUSIVE_ACCESS));
        assert!(!s.conflicts(&b, Access::Write));
        assert!(s.conflicts(&a, Access::Read), "a holds nothing now");
        // Moved on to c (registered already: it keeps its key), a unregistering.
        let to_c = parse(&move_params(9, 5, true, 1, &c.initiator)).unwrap();
        assert_eq!(s.prout(&a, &to_c), Err(PrError::Conflict));
        let mut s2 = s.clone();
        let back_to_a = parse(&move_params(9, 5, true, 1, &a.initiator)).unwrap();
        assert_eq!(s2.prout(&b, &back_to_a), Ok(true));
        assert_eq!(keys(&s2), vec![1, 3], "b unregistered, a kept key 1");
        assert!(!s2.conflicts(&a, Access::Write));
        // An All Registrants reservation has no holder to move.
        let mut t = PrState::default();
        t.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        t.prout(&a, &req(RESERVE, EXCLUSIVE_ACCESS_AR, 1, 0))
            .unwrap();
        assert_eq!(t.prout(&a, &r), Err(PrError::Conflict));
        // The parameter list: its length, the relative port, the TransportID.
        let ok = move_params(1, 9, false, 1, &b.initiator);
        assert_eq!(parse(&ok[..30]), Err(Sense::PARAMETER_LIST_LENGTH_ERROR));
        assert_eq!(parse(&ok[..20]), Err(Sense::PARAMETER_LIST_LENGTH_ERROR));
        assert_eq!(
            parse(&move_params(1, 9, false, 2, &b.initiator)),
            Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST)
        );
        for port in [
            "iqn.b",
            "iqn.b,i,0x12",
            ",i,0x00023d000001",
            "iqn.b,t,0x0001",
        ] {
            assert_eq!(
                parse(&move_params(1, 9, false, 1, port)),
                Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST),
                "{port}"
            );
        }
        let mut format0 = ok.clone();
        format0[24] = 0x05;
        assert_eq!(parse(&format0), Err(Sense::INVALID_FIELD_IN_PARAMETER_LIST));
    }

    #[test]
    fn full_status_names_each_registrant() {
        let (a, b) = (nx("iqn.a"), nx("iqn.b"));
        let mut s = PrState::default();
        s.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        s.prout(&b, &req(REGISTER, 0, 0, 2)).unwrap();
        s.prout(&b, &req(RESERVE, EXCLUSIVE_ACCESS, 2, 0)).unwrap();
        let d = s.prin(READ_FULL_STATUS).unwrap();
        assert_eq!(usize::try_from(get_u32(&d, 4)).unwrap(), d.len() - 8);
        let mut at = 8;
        let mut seen = Vec::new();
        while at < d.len() {
            let key = get_u64(&d, at);
            let holder = d[at + 12] & 1 != 0;
            let tlen = usize::try_from(get_u32(&d, at + 20)).unwrap();
            let t = &d[at + 24..at + 24 + tlen];
            assert_eq!(t[0], 0x45);
            let name = std::str::from_utf8(&t[4..]).unwrap().trim_end_matches('\0');
            seen.push((key, holder, name.to_string()));
            at += 24 + tlen;
        }
        assert_eq!(
            seen,
            vec![
                (1, false, a.initiator.clone()),
                (2, true, b.initiator.clone())
            ]
        );
    }

    #[test]
    fn serialized_form_round_trips() {
        let (a, b) = (nx("a"), nx("b"));
        let mut s = PrState::default();
        assert_eq!(PrState::from_bytes(&s.to_bytes()), Ok(s.clone()));
        s.prout(
            &a,
            &ProutRequest {
                aptpl: true,
                ..req(REGISTER, 0, 0, 11)
            },
        )
        .unwrap();
        s.prout(&b, &req(REGISTER_AND_IGNORE, 0, 0, 12)).unwrap();
        s.prout(&b, &req(RESERVE, EXCLUSIVE_ACCESS_RO, 12, 0))
            .unwrap();
        let bytes = s.to_bytes();
        let back = PrState::from_bytes(&bytes).unwrap();
        assert_eq!(back, s);
        assert!(back.conflicts(&nx("c"), Access::Read));
        // All Registrants: no holder index.
        let mut t = PrState::default();
        t.prout(&a, &req(REGISTER, 0, 0, 1)).unwrap();
        t.prout(&a, &req(RESERVE, WRITE_EXCLUSIVE_AR, 1, 0))
            .unwrap();
        assert_eq!(PrState::from_bytes(&t.to_bytes()), Ok(t));
        // Damaged forms are refused.
        assert!(PrState::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        assert!(PrState::from_bytes(b"TPR2").is_err());
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(PrState::from_bytes(&extra).is_err());
    }
}
