//! The login phase of one connection (RFC 7143 §6.3 and §11.12/§11.13): the security
//! stage (AuthMethod; `None` only in this slice, CHAP goes in [`Login::authenticate`]),
//! the operational stage (the keys of [`crate::text`]), the stage transitions the
//! initiator asks for with T/CSG/NSG, text spread over several PDUs with the C bit,
//! discovery and normal sessions, the target name and the session's ISID/TSIH.
//!
//! This module decides; the connection sends. Sequence numbers (StatSN, ExpCmdSN,
//! MaxCmdSN) are filled in by the connection, which owns them.

use thiserror::Error;

use crate::pdu::{self, Bhs};
use crate::text::{self, Params, MAX_TEXT, TARGET_MAX_RECV_DATA_SEGMENT};

/// Login stages (CSG/NSG values).
pub const STAGE_SECURITY: u8 = 0;
pub const STAGE_OPERATIONAL: u8 = 1;
pub const STAGE_FULL_FEATURE: u8 = 3;

/// Login response status (class, detail), RFC 7143 §11.13.5.
pub const STATUS_SUCCESS: (u8, u8) = (0, 0);
pub const STATUS_INITIATOR_ERROR: (u8, u8) = (2, 0);
pub const STATUS_AUTH_FAILED: (u8, u8) = (2, 1);
pub const STATUS_NOT_FOUND: (u8, u8) = (2, 3);
pub const STATUS_UNSUPPORTED_VERSION: (u8, u8) = (2, 5);
pub const STATUS_MISSING_PARAMETER: (u8, u8) = (2, 7);
pub const STATUS_SESSION_DOES_NOT_EXIST: (u8, u8) = (2, 0x0a);

/// The portal group every portal of this target belongs to.
pub const PORTAL_GROUP_TAG: u16 = 1;

/// Why a login fails: the status the response carries and what the log says.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LoginError {
    #[error("login text: {0}")]
    Text(#[from] text::TextError),
    #[error("login text over {MAX_TEXT} bytes")]
    TextTooLong,
    #[error("the initiator supports no iSCSI version this target speaks (min {0})")]
    Version(u8),
    #[error("invalid stage transition from {csg} to {nsg}")]
    Stage { csg: u8, nsg: u8 },
    #[error("{0} missing from the login")]
    Missing(&'static str),
    #[error("no target named {0:?}")]
    UnknownTarget(String),
    #[error("no authentication method offered that the target supports ({0:?})")]
    Auth(String),
    #[error("SessionType {0:?} is not Discovery or Normal")]
    SessionType(String),
    #[error("adding a connection to session TSIH {0} (one connection per session)")]
    ExistingSession(u16),
}

impl LoginError {
    /// The status class and detail the login response carries.
    pub fn status(&self) -> (u8, u8) {
        match self {
            LoginError::Version(_) => STATUS_UNSUPPORTED_VERSION,
            LoginError::Missing(_) => STATUS_MISSING_PARAMETER,
            LoginError::UnknownTarget(_) => STATUS_NOT_FOUND,
            LoginError::Auth(_) => STATUS_AUTH_FAILED,
            LoginError::ExistingSession(_) => STATUS_SESSION_DOES_NOT_EXIST,
            LoginError::Text(_)
            | LoginError::TextTooLong
            | LoginError::Stage { .. }
            | LoginError::SessionType(_) => STATUS_INITIATOR_ERROR,
        }
    }
}

/// A login response to send: byte 1 (T, C, CSG, NSG), the status, the TSIH (valid in
/// the final response) and the text.
#[derive(Debug, PartialEq, Eq)]
pub struct Reply {
    pub flags: u8,
    pub status: (u8, u8),
    pub tsih: u16,
    pub text: Vec<u8>,
    /// The connection enters the full feature phase once this reply is sent.
    pub full_feature: bool,
}

/// The login of one connection, from its first Login Request to the full feature phase.
#[derive(Debug, Default)]
pub struct Login {
    stage: u8,
    pub initiator_name: Option<String>,
    pub target_name: Option<String>,
    pub discovery: bool,
    pub isid: [u8; 6],
    pub params: Params,
    /// Text of a request continued with the C bit, not yet answered.
    pending: Vec<u8>,
    /// The first PDU was seen (ISID and names fixed).
    started: bool,
    tpgt_sent: bool,
    declared: bool,
    authenticated: bool,
}

impl Login {
    pub fn new() -> Login {
        Login::default()
    }

    /// The security stage's verdict on the AuthMethod offer: `None` is the one method of
    /// this slice. CHAP will answer `CHAP` here and carry its exchange in the following
    /// security-stage PDUs before `authenticated` is set.
    fn authenticate(&mut self, offer: &str) -> Result<String, LoginError> {
        if offer.split(',').any(|m| m == "None") {
            self.authenticated = true;
            Ok("None".into())
        } else {
            Err(LoginError::Auth(offer.to_string()))
        }
    }

    /// Answer one Login Request. `exists(name)` says whether a target of that name is
    /// served; `new_tsih()` gives the session its identifying handle when the login
    /// completes. An error ends the login (the connection sends its status and closes).
    pub fn on_request(
        &mut self,
        bhs: &Bhs,
        data: &[u8],
        exists: impl Fn(&str) -> bool,
        new_tsih: impl FnOnce() -> u16,
    ) -> Result<Reply, LoginError> {
        let b = &bhs.0;
        let (version_max, version_min) = (b[2], b[3]);
        if version_min > 0 || version_max < version_min {
            return Err(LoginError::Version(version_min));
        }
        let flags = bhs.flags();
        let transit = flags & 0x80 != 0;
        let cont = flags & 0x40 != 0;
        let csg = (flags >> 2) & 3;
        let nsg = flags & 3;
        if !self.started {
            self.started = true;
            self.isid.copy_from_slice(&b[8..14]);
            self.stage = csg;
            let tsih = pdu::get_u16(b, 14);
            if tsih != 0 {
                return Err(LoginError::ExistingSession(tsih));
            }
        }
        if csg != self.stage || csg == 2 || csg == STAGE_FULL_FEATURE {
            return Err(LoginError::Stage { csg, nsg });
        }
        if self.pending.len() + data.len() > MAX_TEXT {
            return Err(LoginError::TextTooLong);
        }
        self.pending.extend_from_slice(data);
        if cont {
            // More text follows: an empty response asks for it.
            return Ok(Reply {
                flags: csg << 2,
                status: STATUS_SUCCESS,
                tsih: 0,
                text: Vec::new(),
                full_feature: false,
            });
        }
        let pairs = text::parse(&std::mem::take(&mut self.pending))?;
        let mut answers: Vec<(String, String)> = Vec::new();
        for (k, v) in &pairs {
            match k.as_str() {
                "InitiatorName" => self.initiator_name = Some(v.clone()),
                "InitiatorAlias" => {}
                "SessionType" => {
                    self.discovery = match v.as_str() {
                        "Discovery" => true,
                        "Normal" => false,
                        _ => return Err(LoginError::SessionType(v.clone())),
                    }
                }
                "TargetName" => self.target_name = Some(v.clone()),
                "AuthMethod" => {
                    let a = self.authenticate(v)?;
                    answers.push((k.clone(), a));
                }
                _ => match text::negotiate(&mut self.params, k, v, self.discovery) {
                    // A declaration is not answered.
                    Some(a) if a.is_empty() => {}
                    Some(a) => answers.push((k.clone(), a)),
                    None => answers.push((k.clone(), "NotUnderstood".into())),
                },
            }
        }
        if self.initiator_name.is_none() {
            return Err(LoginError::Missing("InitiatorName"));
        }
        if !self.discovery {
            let Some(t) = &self.target_name else {
                return Err(LoginError::Missing("TargetName"));
            };
            if !exists(t) {
                return Err(LoginError::UnknownTarget(t.clone()));
            }
            if !self.tpgt_sent {
                self.tpgt_sent = true;
                answers.push(("TargetPortalGroupTag".into(), PORTAL_GROUP_TAG.to_string()));
            }
        }
        // The target's own declaration, once, as soon as operational keys are in play.
        let next = if transit { nsg } else { csg };
        if !self.declared && (csg == STAGE_OPERATIONAL || next != STAGE_SECURITY) {
            self.declared = true;
            answers.push((
                "MaxRecvDataSegmentLength".into(),
                TARGET_MAX_RECV_DATA_SEGMENT.to_string(),
            ));
        }
        let mut out_flags = csg << 2;
        let mut full_feature = false;
        let mut tsih = 0;
        if transit {
            let valid = match csg {
                STAGE_SECURITY => nsg == STAGE_OPERATIONAL || nsg == STAGE_FULL_FEATURE,
                _ => nsg == STAGE_FULL_FEATURE,
            };
            if !valid {
                return Err(LoginError::Stage { csg, nsg });
            }
            if csg == STAGE_SECURITY && !self.authenticated {
                // Leaving the security stage without an AuthMethod offer: without secrets
                // configured (none yet: no CHAP) that is AuthMethod=None. With CHAP, a
                // target that requires it refuses here.
                self.authenticate("None")?;
            }
            out_flags |= 0x80 | nsg;
            self.stage = nsg;
            if nsg == STAGE_FULL_FEATURE {
                text::settle(&mut self.params);
                full_feature = true;
                tsih = new_tsih();
            }
        }
        Ok(Reply {
            flags: out_flags,
            status: STATUS_SUCCESS,
            tsih,
            text: text::encode(&answers),
            full_feature,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdu::{header, put_u16, FLAG_IMMEDIATE, OP_LOGIN_REQ};

    fn req(flags: u8, tsih: u16) -> Bhs {
        let mut h = header(OP_LOGIN_REQ | FLAG_IMMEDIATE, flags, 0);
        h[8..14].copy_from_slice(&[0x80, 1, 2, 3, 4, 5]);
        put_u16(&mut h, 14, tsih);
        Bhs(h)
    }

    const T: u8 = 0x80;
    const TARGET: &str = "iqn.2026-11.io.tessera:t";

    fn answers(r: &Reply) -> Vec<(String, String)> {
        text::parse(&r.text).unwrap()
    }

    fn get<'a>(a: &'a [(String, String)], k: &str) -> Option<&'a str> {
        a.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn a_normal_login_goes_through_both_stages() {
        let mut l = Login::new();
        let exists = |n: &str| n == TARGET;
        let r = l
            .on_request(
                &req(T | STAGE_OPERATIONAL, 0),
                format!("InitiatorName=iqn.i\0SessionType=Normal\0TargetName={TARGET}\0AuthMethod=CHAP,None\0").as_bytes(),
                exists,
                || 9,
            )
            .unwrap();
        assert_eq!(r.flags, T | STAGE_OPERATIONAL);
        assert!(!r.full_feature);
        let a = answers(&r);
        assert_eq!(get(&a, "AuthMethod"), Some("None"));
        assert_eq!(get(&a, "TargetPortalGroupTag"), Some("1"));
        // Declared as the login leaves the security stage, once.
        assert_eq!(
            get(&a, "MaxRecvDataSegmentLength"),
            Some(&*TARGET_MAX_RECV_DATA_SEGMENT.to_string())
        );
        let r = l
            .on_request(
                &req(T | (STAGE_OPERATIONAL << 2) | STAGE_FULL_FEATURE, 0),
                b"HeaderDigest=None\0MaxRecvDataSegmentLength=65536\0ImmediateData=Yes\0X-thing=1\0",
                exists,
                || 9,
            )
            .unwrap();
        assert!(r.full_feature);
        assert_eq!(r.tsih, 9);
        assert_eq!(r.flags, T | (STAGE_OPERATIONAL << 2) | STAGE_FULL_FEATURE);
        let a = answers(&r);
        assert_eq!(get(&a, "HeaderDigest"), Some("None"));
        assert_eq!(get(&a, "X-thing"), Some("NotUnderstood"));
        assert_eq!(get(&a, "MaxRecvDataSegmentLength"), None);
        assert_eq!(l.params.initiator_max_recv, 65536);
    }

    #[test]
    fn continued_text_is_gathered_before_it_is_answered() {
        let mut l = Login::new();
        let r = l
            .on_request(&req(0x40, 0), b"InitiatorName=iq", |_| true, || 1)
            .unwrap();
        assert!(r.text.is_empty());
        let r = l
            .on_request(
                &req(T | STAGE_FULL_FEATURE, 0),
                b"n.i\0SessionType=Discovery\0AuthMethod=None\0",
                |_| true,
                || 1,
            )
            .unwrap();
        assert!(r.full_feature && l.discovery);
        assert_eq!(l.initiator_name.as_deref(), Some("iqn.i"));
    }

    #[test]
    fn failures_carry_their_status() {
        let cases: Vec<(&[u8], u8, (u8, u8))> = vec![
            (b"SessionType=Normal\0", T | 1, STATUS_MISSING_PARAMETER),
            (
                b"InitiatorName=i\0SessionType=Normal\0",
                T | 1,
                STATUS_MISSING_PARAMETER,
            ),
            (
                b"InitiatorName=i\0TargetName=nope\0",
                T | 1,
                STATUS_NOT_FOUND,
            ),
            (
                b"InitiatorName=i\0TargetName=t\0AuthMethod=CHAP\0",
                T | 1,
                STATUS_AUTH_FAILED,
            ),
            (
                b"InitiatorName=i\0TargetName=t\0AuthMethod=None\0",
                T | 2,
                STATUS_INITIATOR_ERROR,
            ),
            (b"garbage\0", T | 1, STATUS_INITIATOR_ERROR),
        ];
        for (data, flags, want) in cases {
            let mut l = Login::new();
            let e = l
                .on_request(&req(flags, 0), data, |n| n == "t", || 1)
                .unwrap_err();
            assert_eq!(e.status(), want, "{e}");
        }
        // A later PDU that claims a stage the login is not in.
        let mut l = Login::new();
        l.on_request(
            &req(0, 0),
            b"InitiatorName=i\0SessionType=Discovery\0",
            |_| true,
            || 1,
        )
        .unwrap();
        let e = l
            .on_request(&req(T | (1 << 2) | 3, 0), b"", |_| true, || 1)
            .unwrap_err();
        assert!(matches!(e, LoginError::Stage { .. }));
        // Joining an existing session, and an unsupported version.
        let e = Login::new()
            .on_request(&req(0, 5), b"", |_| true, || 1)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_SESSION_DOES_NOT_EXIST);
        let mut h = req(0, 0);
        h.0[3] = 1;
        h.0[2] = 1;
        let e = Login::new()
            .on_request(&h, b"", |_| true, || 1)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_UNSUPPORTED_VERSION);
    }

    #[test]
    fn text_beyond_the_bound_is_refused() {
        let mut l = Login::new();
        let chunk = vec![b'a'; 16 << 10];
        let mut err = None;
        for _ in 0..8 {
            match l.on_request(&req(0x40, 0), &chunk, |_| true, || 1) {
                Ok(_) => {}
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert_eq!(err, Some(LoginError::TextTooLong));
    }
}
