//! The login phase of one connection (RFC 7143 §6.3 and §11.12/§11.13): the security
//! stage (AuthMethod `None`, or CHAP when the target requires it: [`Login::security`];
//! the initiator allowlist is checked as soon as both names are known), the operational
//! stage (the keys of [`crate::text`]), the stage transitions the
//! initiator asks for with T/CSG/NSG, text spread over several PDUs with the C bit,
//! discovery and normal sessions, the target name and the session's ISID/TSIH.
//!
//! This module decides; the connection sends. Sequence numbers (StatSN, ExpCmdSN,
//! MaxCmdSN) are filled in by the connection, which owns them.

use std::sync::Arc;

use thiserror::Error;

use crate::auth::{self, Access};
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
pub const STATUS_AUTHORIZATION_FAILED: (u8, u8) = (2, 2);
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
    /// CHAP failed or was refused; the text says why, for the log only (the initiator
    /// gets the bare status, so a prober learns nothing about which part was wrong).
    #[error("CHAP: {0}")]
    Chap(String),
    #[error("initiator {initiator:?} is not allowed to log in to target {target:?}")]
    NotAllowed { initiator: String, target: String },
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
            LoginError::Auth(_) | LoginError::Chap(_) => STATUS_AUTH_FAILED,
            LoginError::NotAllowed { .. } => STATUS_AUTHORIZATION_FAILED,
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

/// Where a CHAP exchange stands (RFC 7143 §12.1.3).
#[derive(Debug, Default, PartialEq, Eq)]
enum ChapStep {
    /// No AuthMethod chosen yet.
    #[default]
    Idle,
    /// AuthMethod=CHAP answered; CHAP_A expected.
    Chosen,
    /// CHAP_A, CHAP_I, CHAP_C sent; CHAP_N and CHAP_R expected.
    Challenged { id: u8, challenge: Vec<u8> },
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
    /// Who may log in to the target named, taken when the login first names it.
    access: Option<Arc<Access>>,
    chap: ChapStep,
}

/// The security keys of one request, gathered to be answered once the names are known.
const SECURITY_KEYS: [&str; 6] = [
    "AuthMethod",
    "CHAP_A",
    "CHAP_I",
    "CHAP_C",
    "CHAP_N",
    "CHAP_R",
];

impl Login {
    pub fn new() -> Login {
        Login::default()
    }

    fn chap_required(&self) -> bool {
        self.access.as_ref().is_some_and(|a| a.chap.is_some())
    }

    /// Authentication without a method: what leaving the security stage (or starting in
    /// the operational one) without CHAP means. Refused when the target requires CHAP.
    fn accept_none(&mut self) -> Result<(), LoginError> {
        if self.chap_required() {
            return Err(LoginError::Chap(
                "the target requires CHAP and the initiator did not authenticate".into(),
            ));
        }
        self.authenticated = true;
        Ok(())
    }

    /// The security stage's keys of one request: AuthMethod, then the CHAP exchange
    /// (RFC 7143 §12.1.3). A target with CHAP settings answers `CHAP` and refuses
    /// `None`; one without answers `None`.
    fn security(
        &mut self,
        keys: &[(String, String)],
        answers: &mut Vec<(String, String)>,
    ) -> Result<(), LoginError> {
        let get = |k: &str| keys.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str());
        let chap_fail = |m: &str| Err(LoginError::Chap(m.to_string()));
        if let Some(offer) = get("AuthMethod") {
            if self.chap != ChapStep::Idle || self.authenticated {
                return chap_fail("AuthMethod negotiated twice");
            }
            let offered = |m: &str| offer.split(',').any(|o| o == m);
            if self.chap_required() {
                if !offered("CHAP") {
                    return chap_fail(&format!(
                        "the target requires CHAP; the initiator offered AuthMethod={offer} \
                         (no CHAP credentials configured on the initiator?)"
                    ));
                }
                self.chap = ChapStep::Chosen;
                answers.push(("AuthMethod".into(), "CHAP".into()));
            } else if offered("None") {
                self.authenticated = true;
                answers.push(("AuthMethod".into(), "None".into()));
            } else {
                return Err(LoginError::Auth(offer.to_string()));
            }
        }
        if self.chap == ChapStep::Chosen && get("AuthMethod").is_none() && get("CHAP_A").is_none() {
            return chap_fail("the initiator chose CHAP and did not send CHAP_A");
        }
        if let Some(algorithms) = get("CHAP_A") {
            if self.chap != ChapStep::Chosen {
                return chap_fail("CHAP_A before AuthMethod=CHAP was agreed");
            }
            if !algorithms.split(',').any(|a| a == auth::CHAP_MD5) {
                return chap_fail(&format!(
                    "CHAP_A={algorithms} offers no MD5 (5), the one algorithm this target \
                     speaks"
                ));
            }
            let id = auth::random_bytes(1)[0];
            let challenge = auth::random_bytes(auth::CHALLENGE_LEN);
            answers.push(("CHAP_A".into(), auth::CHAP_MD5.into()));
            answers.push(("CHAP_I".into(), id.to_string()));
            answers.push(("CHAP_C".into(), auth::encode_hex(&challenge)));
            self.chap = ChapStep::Challenged { id, challenge };
        }
        let (n, r) = (get("CHAP_N"), get("CHAP_R"));
        let ChapStep::Challenged { id, challenge } = &self.chap else {
            if n.is_some() || r.is_some() || get("CHAP_I").is_some() || get("CHAP_C").is_some() {
                return chap_fail("CHAP_N/CHAP_R/CHAP_I/CHAP_C before the target's challenge");
            }
            return Ok(());
        };
        if get("CHAP_A").is_some() {
            // The challenge was sent with this answer: the response comes next.
            return Ok(());
        }
        let (Some(n), Some(r)) = (n, r) else {
            return chap_fail("the initiator did not answer the challenge with CHAP_N and CHAP_R");
        };
        let Some(chap) = self.access.as_ref().and_then(|a| a.chap.as_ref()) else {
            return chap_fail("no CHAP settings");
        };
        // Both checks run before either verdict, so that a wrong user name and a wrong
        // response take the same time and are not told apart on the wire.
        let expected = auth::response(*id, &chap.initiator.secret, challenge);
        let got = auth::decode_binary(r).unwrap_or_default();
        let user_ok = auth::same(n.as_bytes(), chap.initiator.user.as_bytes());
        let response_ok = auth::same(&got, &expected);
        if !user_ok {
            return chap_fail(&format!("unknown CHAP user {n:?}"));
        }
        if !response_ok {
            return chap_fail(&format!(
                "wrong response for CHAP user {n:?} (the initiator's secret differs)"
            ));
        }
        match (get("CHAP_I"), get("CHAP_C")) {
            (None, None) => {}
            (Some(i), Some(c)) => {
                // Mutual CHAP: the initiator challenges the target.
                let Some(mutual) = &chap.mutual else {
                    return chap_fail(
                        "the initiator asks for mutual CHAP and the target has no mutual \
                         CHAP credentials",
                    );
                };
                let (Some(i), Some(c)) = (auth::decode_id(i), auth::decode_binary(c)) else {
                    return chap_fail("the initiator's CHAP_I or CHAP_C does not decode");
                };
                // RFC 7143 §12.1.3: a target that answered its own challenge would hand
                // an attacker the response to replay to it.
                if auth::same(&c, challenge) {
                    return chap_fail(
                        "the initiator sent back the target's own challenge (reflection); \
                         refused",
                    );
                }
                let answer = auth::response(i, &mutual.secret, &c);
                answers.push(("CHAP_N".into(), mutual.user.clone()));
                answers.push(("CHAP_R".into(), auth::encode_hex(&answer)));
            }
            _ => return chap_fail("CHAP_I and CHAP_C come together (mutual CHAP)"),
        }
        self.chap = ChapStep::Idle;
        self.authenticated = true;
        Ok(())
    }

    /// Answer one Login Request. `lookup(name)` gives who may log in to the target of
    /// that name, None when no such target is served; `new_tsih()` gives the session its identifying handle when the login
    /// completes. An error ends the login (the connection sends its status and closes).
    pub fn on_request(
        &mut self,
        bhs: &Bhs,
        data: &[u8],
        lookup: impl Fn(&str) -> Option<Arc<Access>>,
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
        let mut security: Vec<(String, String)> = Vec::new();
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
                // Answered below, once the target (and its CHAP settings) are known,
                // whatever order the keys came in.
                k if SECURITY_KEYS.contains(&k) => security.push((k.to_string(), v.clone())),
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
            if self.access.is_none() {
                let Some(a) = lookup(t) else {
                    return Err(LoginError::UnknownTarget(t.clone()));
                };
                let initiator = self.initiator_name.as_deref().unwrap_or_default();
                if !a.admits(initiator) {
                    return Err(LoginError::NotAllowed {
                        initiator: initiator.to_string(),
                        target: t.clone(),
                    });
                }
                self.access = Some(a);
            }
            if !self.tpgt_sent {
                self.tpgt_sent = true;
                answers.push(("TargetPortalGroupTag".into(), PORTAL_GROUP_TAG.to_string()));
            }
        }
        // Mid-CHAP every request must carry the exchange's next step.
        if !security.is_empty() || (csg == STAGE_SECURITY && self.chap != ChapStep::Idle) {
            if csg != STAGE_SECURITY {
                return Err(LoginError::Chap(
                    "security keys outside the security stage".into(),
                ));
            }
            self.security(&security, &mut answers)?;
        }
        if csg == STAGE_OPERATIONAL && !self.authenticated {
            // A login that starts in the operational stage skipped authentication.
            self.accept_none()?;
        }
        // Mid-CHAP, the target cannot leave the security stage yet: it answers T=0 and
        // the initiator goes on with the exchange (RFC 7143 §11.12.2 lets it).
        let transit = transit && !(csg == STAGE_SECURITY && self.chap != ChapStep::Idle);
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
                // Leaving the security stage without an AuthMethod offer: AuthMethod=None,
                // which a target that requires CHAP refuses.
                self.accept_none()?;
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
        let exists = |n: &str| (n == TARGET).then(Arc::default);
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
            .on_request(
                &req(0x40, 0),
                b"InitiatorName=iq",
                |_| Some(Arc::default()),
                || 1,
            )
            .unwrap();
        assert!(r.text.is_empty());
        let r = l
            .on_request(
                &req(T | STAGE_FULL_FEATURE, 0),
                b"n.i\0SessionType=Discovery\0AuthMethod=None\0",
                |_| Some(Arc::default()),
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
                .on_request(
                    &req(flags, 0),
                    data,
                    |n| (n == "t").then(Arc::default),
                    || 1,
                )
                .unwrap_err();
            assert_eq!(e.status(), want, "{e}");
        }
        // A later PDU that claims a stage the login is not in.
        let mut l = Login::new();
        l.on_request(
            &req(0, 0),
            b"InitiatorName=i\0SessionType=Discovery\0",
            |_| Some(Arc::default()),
            || 1,
        )
        .unwrap();
        let e = l
            .on_request(
                &req(T | (1 << 2) | 3, 0),
                b"",
                |_| Some(Arc::default()),
                || 1,
            )
            .unwrap_err();
        assert!(matches!(e, LoginError::Stage { .. }));
        // Joining an existing session, and an unsupported version.
        let e = Login::new()
            .on_request(&req(0, 5), b"", |_| Some(Arc::default()), || 1)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_SESSION_DOES_NOT_EXIST);
        let mut h = req(0, 0);
        h.0[3] = 1;
        h.0[2] = 1;
        let e = Login::new()
            .on_request(&h, b"", |_| Some(Arc::default()), || 1)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_UNSUPPORTED_VERSION);
    }

    #[test]
    fn text_beyond_the_bound_is_refused() {
        let mut l = Login::new();
        let chunk = vec![b'a'; 16 << 10];
        let mut err = None;
        for _ in 0..8 {
            match l.on_request(&req(0x40, 0), &chunk, |_| Some(Arc::default()), || 1) {
                Ok(_) => {}
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert_eq!(err, Some(LoginError::TextTooLong));
    }

    const USER: &str = "alice";
    const SECRET: &[u8] = b"initiator-secret-1";
    const MUTUAL_USER: &str = "tessera";
    const MUTUAL_SECRET: &[u8] = b"target-secret-22";

    fn chap_access(mutual: bool, allowed: &[&str]) -> Arc<Access> {
        Arc::new(Access {
            allowed_initiators: allowed.iter().map(|s| s.to_string()).collect(),
            chap: Some(auth::Chap {
                initiator: auth::Credentials {
                    user: USER.into(),
                    secret: SECRET.to_vec(),
                },
                mutual: mutual.then(|| auth::Credentials {
                    user: MUTUAL_USER.into(),
                    secret: MUTUAL_SECRET.to_vec(),
                }),
            }),
        })
    }

    /// A login to TARGET (served with `access`) up to the target's challenge: returns
    /// the login, CHAP_I and CHAP_C.
    fn challenged(access: &Arc<Access>) -> (Login, u8, Vec<u8>) {
        let lookup = |n: &str| (n == TARGET).then(|| access.clone());
        let mut l = Login::new();
        let r = l
            .on_request(
                &req(T | STAGE_OPERATIONAL, 0),
                format!("InitiatorName=iqn.i\0SessionType=Normal\0TargetName={TARGET}\0AuthMethod=CHAP,None\0").as_bytes(),
                lookup,
                || 9,
            )
            .unwrap();
        // Mid-CHAP the target stays in the security stage, whatever the initiator asked.
        assert_eq!(r.flags, 0, "T=0, CSG=NSG=security");
        assert_eq!(get(&answers(&r), "AuthMethod"), Some("CHAP"));
        let r = l
            .on_request(&req(0, 0), b"CHAP_A=7,5\0", lookup, || 9)
            .unwrap();
        let a = answers(&r);
        assert_eq!(get(&a, "CHAP_A"), Some("5"));
        let id: u8 = get(&a, "CHAP_I").unwrap().parse().unwrap();
        let c = auth::decode_binary(get(&a, "CHAP_C").unwrap()).unwrap();
        assert_eq!(c.len(), auth::CHALLENGE_LEN);
        (l, id, c)
    }

    /// Send CHAP_N/CHAP_R (and `extra` keys) asking to leave the security stage.
    fn respond(
        l: &mut Login,
        access: &Arc<Access>,
        user: &str,
        r: &[u8],
        extra: &str,
    ) -> Result<Reply, LoginError> {
        let text = format!("CHAP_N={user}\0CHAP_R={}\0{extra}", auth::encode_hex(r));
        l.on_request(
            &req(T | STAGE_OPERATIONAL, 0),
            text.as_bytes(),
            |n: &str| (n == TARGET).then(|| access.clone()),
            || 9,
        )
    }

    #[test]
    fn one_way_chap_admits_the_right_secret_only() {
        let access = chap_access(false, &[]);
        let (mut l, id, c) = challenged(&access);
        let r = respond(&mut l, &access, USER, &auth::response(id, SECRET, &c), "").unwrap();
        assert_eq!(r.flags, T | STAGE_OPERATIONAL, "leaves the security stage");
        // Nothing of the target's own in a one-way exchange.
        assert_eq!(get(&answers(&r), "CHAP_R"), None);
        let r = l
            .on_request(
                &req(T | (STAGE_OPERATIONAL << 2) | STAGE_FULL_FEATURE, 0),
                b"",
                |_| None,
                || 9,
            )
            .unwrap();
        assert!(r.full_feature);

        let (mut l, id, c) = challenged(&access);
        let e = respond(
            &mut l,
            &access,
            USER,
            &auth::response(id, b"wrong-secret-123", &c),
            "",
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");

        let (mut l, id, c) = challenged(&access);
        let e = respond(
            &mut l,
            &access,
            "mallory",
            &auth::response(id, SECRET, &c),
            "",
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
        assert!(e.to_string().contains("unknown CHAP user"), "{e}");

        // A response to another challenge (a replay) does not pass.
        let (mut l, id, c) = challenged(&access);
        let mut other = c.clone();
        other[0] ^= 1;
        let e = respond(
            &mut l,
            &access,
            USER,
            &auth::response(id, SECRET, &other),
            "",
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");

        // Leaving the security stage without answering the challenge.
        let (mut l, _, _) = challenged(&access);
        let e = l
            .on_request(&req(T | STAGE_OPERATIONAL, 0), b"", |_| None, || 9)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
    }

    #[test]
    fn a_target_with_chap_refuses_logins_without_it() {
        let access = chap_access(false, &[]);
        let lookup = |n: &str| (n == TARGET).then(|| access.clone());
        let first = |auth: &str| {
            format!("InitiatorName=iqn.i\0SessionType=Normal\0TargetName={TARGET}\0{auth}")
        };
        // AuthMethod=None offered; no AuthMethod at all; straight to the operational stage.
        for (flags, text) in [
            (T | STAGE_OPERATIONAL, first("AuthMethod=None\0")),
            (T | STAGE_OPERATIONAL, first("")),
            (
                T | (STAGE_OPERATIONAL << 2) | STAGE_FULL_FEATURE,
                first("HeaderDigest=None\0"),
            ),
        ] {
            let e = Login::new()
                .on_request(&req(flags, 0), text.as_bytes(), lookup, || 9)
                .unwrap_err();
            assert_eq!(e.status(), STATUS_AUTH_FAILED, "{text:?}: {e}");
        }
        // CHAP keys before the challenge, and an algorithm other than MD5.
        let mut l = Login::new();
        let e = l
            .on_request(
                &req(0, 0),
                first("AuthMethod=CHAP\0CHAP_N=alice\0CHAP_R=0x00\0").as_bytes(),
                lookup,
                || 9,
            )
            .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
        let mut l = Login::new();
        l.on_request(
            &req(0, 0),
            first("AuthMethod=CHAP\0").as_bytes(),
            lookup,
            || 9,
        )
        .unwrap();
        let e = l
            .on_request(&req(0, 0), b"CHAP_A=7\0", lookup, || 9)
            .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
    }

    #[test]
    fn mutual_chap_answers_with_the_target_secret() {
        let access = chap_access(true, &[]);
        let (mut l, id, c) = challenged(&access);
        let mine = [0x5au8; 16];
        let r = respond(
            &mut l,
            &access,
            USER,
            &auth::response(id, SECRET, &c),
            &format!("CHAP_I=77\0CHAP_C={}\0", auth::encode_hex(&mine)),
        )
        .unwrap();
        assert_eq!(r.flags, T | STAGE_OPERATIONAL);
        let a = answers(&r);
        assert_eq!(get(&a, "CHAP_N"), Some(MUTUAL_USER));
        let want = auth::response(77, MUTUAL_SECRET, &mine);
        assert_eq!(get(&a, "CHAP_R"), Some(&*auth::encode_hex(&want)));
        // Not the initiator's secret: an initiator checking against the wrong one fails.
        assert_ne!(want, auth::response(77, SECRET, &mine));

        // The initiator reflects the target's own challenge: refused, no CHAP_R given.
        let (mut l, id, c) = challenged(&access);
        let e = respond(
            &mut l,
            &access,
            USER,
            &auth::response(id, SECRET, &c),
            &format!("CHAP_I={id}\0CHAP_C={}\0", auth::encode_hex(&c)),
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
        assert!(e.to_string().contains("reflection"), "{e}");

        // CHAP_I without CHAP_C.
        let (mut l, id, c) = challenged(&access);
        let e = respond(
            &mut l,
            &access,
            USER,
            &auth::response(id, SECRET, &c),
            "CHAP_I=1\0",
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");

        // Mutual CHAP asked of a target that has no mutual credentials.
        let one_way = chap_access(false, &[]);
        let (mut l, id, c) = challenged(&one_way);
        let e = respond(
            &mut l,
            &one_way,
            USER,
            &auth::response(id, SECRET, &c),
            &format!("CHAP_I=3\0CHAP_C={}\0", auth::encode_hex(&mine)),
        )
        .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTH_FAILED, "{e}");
    }

    #[test]
    fn the_allowlist_refuses_other_initiators_with_authorization_failure() {
        let access = Arc::new(Access {
            allowed_initiators: vec!["iqn.2026-11.io.example:host1".into()],
            chap: None,
        });
        let lookup = |n: &str| (n == TARGET).then(|| access.clone());
        let login = |initiator: &str| {
            Login::new().on_request(
                &req(T | STAGE_OPERATIONAL, 0),
                format!("InitiatorName={initiator}\0SessionType=Normal\0TargetName={TARGET}\0AuthMethod=None\0").as_bytes(),
                lookup,
                || 9,
            )
        };
        let e = login("iqn.2026-11.io.example:host2").unwrap_err();
        assert_eq!(e.status(), STATUS_AUTHORIZATION_FAILED);
        assert_eq!(STATUS_AUTHORIZATION_FAILED, (2, 2));
        assert!(login("iqn.2026-11.io.example:host1").is_ok());
        // CHAP does not let an initiator off the list in.
        let both = chap_access(false, &["iqn.2026-11.io.example:host1"]);
        let e = Login::new()
            .on_request(
                &req(0, 0),
                format!("InitiatorName=iqn.other\0SessionType=Normal\0TargetName={TARGET}\0AuthMethod=CHAP\0").as_bytes(),
                |_| Some(both.clone()),
                || 9,
            )
            .unwrap_err();
        assert_eq!(e.status(), STATUS_AUTHORIZATION_FAILED);
    }
}
