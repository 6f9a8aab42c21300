//! Who may log in to a target: an allowlist of initiator names and CHAP (RFC 7143
//! §12.1.3 over RFC 1994), one-way (the target authenticates the initiator) or mutual
//! (the initiator authenticates the target as well). The exchange itself is driven by
//! the login phase (`login.rs`); this module holds the configuration, its checks, and the CHAP
//! arithmetic.
//!
//! Secrets never reach a log: [`Credentials`]' `Debug` prints the user name only.

use md5::{Digest, Md5};
use thiserror::Error;

/// RFC 7143 §12.1.3 recommends at least 12 bytes (96 bits) of secret: an MD5 CHAP
/// exchange seen on the wire lets anyone try guesses offline, so shorter secrets fall
/// to a dictionary search.
pub const MIN_SECRET: usize = 12;
/// Longer secrets add nothing over MD5's 128 bits and only make the file bigger.
pub const MAX_SECRET: usize = 256;
/// User names are sent as text (CHAP_N); bounded so a login text stays small.
pub const MAX_USER: usize = 255;
/// CHAP_A value of MD5, the one algorithm iSCSI requires (RFC 7143 §12.1.3).
pub const CHAP_MD5: &str = "5";
/// Bytes of the target's challenge. 16 bytes from the OS CSPRNG never repeat in
/// practice, which is what protects against replayed responses.
pub const CHALLENGE_LEN: usize = 16;
/// The longest challenge or response accepted from an initiator (RFC 7143 §12.1.3 lets
/// a target bound it; 1024 bytes is far above any initiator's).
pub const MAX_CHAP_VALUE: usize = 1024;

/// A CHAP identity: the name sent as CHAP_N and the secret that proves it.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Whoever logs a target's configuration must not log its secrets.
        f.debug_struct("Credentials")
            .field("user", &self.user)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// CHAP settings of a target: the initiator's credentials, and the target's own for
/// mutual CHAP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chap {
    /// What the initiator must answer with (CHAP_N, and CHAP_R from this secret).
    pub initiator: Credentials,
    /// What the target answers an initiator that challenges it (mutual CHAP).
    pub mutual: Option<Credentials>,
}

/// Who may log in to one target. The default admits every initiator, unauthenticated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// Initiator names allowed to log in (compared without regard to ASCII case, as
    /// iSCSI names are case-folded); empty: every initiator.
    pub allowed_initiators: Vec<String>,
    /// When set, a login must pass CHAP; AuthMethod=None is refused.
    pub chap: Option<Chap>,
}

/// A configuration that cannot be used, said to the operator.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum AccessError {
    #[error(
        "{what} is {len} bytes; CHAP secrets must be at least {MIN_SECRET} bytes \
         (RFC 7143 §12.1.3: shorter ones fall to an offline dictionary search)"
    )]
    SecretTooShort { what: &'static str, len: usize },
    #[error("{what} is {len} bytes; at most {MAX_SECRET}")]
    SecretTooLong { what: &'static str, len: usize },
    #[error(
        "the mutual CHAP secret must differ from the initiator's secret (one secret for \
         both ends lets anyone who learns it impersonate either)"
    )]
    SameSecret,
    #[error("{what} must be 1 to {MAX_USER} printable characters without spaces, got {user:?}")]
    BadUser { what: &'static str, user: String },
    #[error(
        "allowed initiator {0:?} is not an iSCSI name (iqn., eui. or naa., at most 223 \
         bytes, no spaces)"
    )]
    BadInitiator(String),
}

impl Credentials {
    fn check(&self, user_what: &'static str, what: &'static str) -> Result<(), AccessError> {
        let u = &self.user;
        if u.is_empty()
            || u.len() > MAX_USER
            || u.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(AccessError::BadUser {
                what: user_what,
                user: u.clone(),
            });
        }
        let len = self.secret.len();
        if len < MIN_SECRET {
            return Err(AccessError::SecretTooShort { what, len });
        }
        if len > MAX_SECRET {
            return Err(AccessError::SecretTooLong { what, len });
        }
        Ok(())
    }
}

impl Access {
    /// Refuse what cannot be configured: short or equal secrets, bad names.
    pub fn check(&self) -> Result<(), AccessError> {
        for i in &self.allowed_initiators {
            if !crate::text::valid_name(i) {
                return Err(AccessError::BadInitiator(i.clone()));
            }
        }
        if let Some(c) = &self.chap {
            c.initiator.check("the CHAP user", "the CHAP secret")?;
            if let Some(m) = &c.mutual {
                m.check("the mutual CHAP user", "the mutual CHAP secret")?;
                if m.secret == c.initiator.secret {
                    return Err(AccessError::SameSecret);
                }
            }
        }
        Ok(())
    }

    /// Whether initiator `name` is on the allowlist (or the list is empty).
    pub fn admits(&self, name: &str) -> bool {
        self.allowed_initiators.is_empty()
            || self
                .allowed_initiators
                .iter()
                .any(|a| a.eq_ignore_ascii_case(name))
    }
}

/// The CHAP response (RFC 1994 §4.1): MD5 over the identifier, the secret and the
/// challenge.
pub fn response(id: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut h = Md5::new();
    h.update([id]);
    h.update(secret);
    h.update(challenge);
    h.finalize().into()
}

/// Compare without an early exit, so the time taken says nothing about where a forged
/// response first differs.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Bytes from the operating system's CSPRNG.
pub fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    getrandom::getrandom(&mut v).expect("the system's random source works");
    v
}

/// A binary value as RFC 7143 §6.1 writes it: `0x` and hex digits.
pub fn encode_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * b.len());
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// A binary value of a CHAP key (RFC 7143 §6.1: `0x` hex, `0b` base64), at most
/// [`MAX_CHAP_VALUE`] bytes; None when it is neither or empty.
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let (prefix, body) = (v.get(..2)?, v.get(2..)?);
    let out = match prefix {
        "0x" | "0X" => {
            // An odd count of digits: the first stands for one byte alone.
            let padded;
            let digits = if body.len() % 2 == 1 {
                padded = format!("0{body}");
                padded.as_str()
            } else {
                body
            };
            let mut out = Vec::with_capacity(digits.len() / 2);
            for pair in digits.as_bytes().chunks(2) {
                let s = std::str::from_utf8(pair).ok()?;
                out.push(u8::from_str_radix(s, 16).ok()?);
            }
            out
        }
        "0b" | "0B" => base64::engine::general_purpose::STANDARD
            .decode(body)
            .ok()?,
        _ => return None,
    };
    (!out.is_empty() && out.len() <= MAX_CHAP_VALUE).then_some(out)
}

/// CHAP_I: a number 0..=255, decimal or `0x` hex (RFC 7143 §6.1 numerical values).
pub fn decode_id(v: &str) -> Option<u8> {
    match v.get(..2) {
        Some("0x" | "0X") => u8::from_str_radix(&v[2..], 16).ok(),
        _ => v.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(user: &str, secret: &str) -> Credentials {
        Credentials {
            user: user.into(),
            secret: secret.as_bytes().to_vec(),
        }
    }

    #[test]
    fn the_response_is_rfc_1994_md5() {
        // MD5(0x01 || "secretsecret" || 0x00..0x0f), computed independently with
        // Python's hashlib.
        let challenge: Vec<u8> = (0u8..16).collect();
        let r = response(1, b"secretsecret", &challenge);
        assert_eq!(encode_hex(&r), "0x226dc576c33f04ff9c3a200ffe35f442");
    }

    #[test]
    fn binary_values_decode() {
        assert_eq!(decode_binary("0x0a0B"), Some(vec![10, 11]));
        assert_eq!(decode_binary("0xabc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(decode_binary("0bAQID"), Some(vec![1, 2, 3]));
        for bad in ["", "0x", "12", "0xzz", "0b!!", "abcd"] {
            assert_eq!(decode_binary(bad), None, "{bad}");
        }
        let long = format!("0x{}", "00".repeat(MAX_CHAP_VALUE + 1));
        assert_eq!(decode_binary(&long), None);
        assert_eq!(decode_id("7"), Some(7));
        assert_eq!(decode_id("0xff"), Some(255));
        assert_eq!(decode_id("256"), None);
    }

    #[test]
    fn configurations_are_checked() {
        let good = Access {
            allowed_initiators: vec!["iqn.2026-11.io.example:host1".into()],
            chap: Some(Chap {
                initiator: creds("alice", "twelve-bytes"),
                mutual: Some(creds("target", "other-secret")),
            }),
        };
        assert_eq!(good.check(), Ok(()));
        let mut short = good.clone();
        short.chap.as_mut().unwrap().initiator.secret = b"elevenbytes".to_vec();
        assert!(matches!(
            short.check(),
            Err(AccessError::SecretTooShort { len: 11, .. })
        ));
        assert!(short
            .check()
            .unwrap_err()
            .to_string()
            .contains("at least 12"));
        let mut same_secret = good.clone();
        same_secret.chap.as_mut().unwrap().mutual = Some(creds("target", "twelve-bytes"));
        assert_eq!(same_secret.check(), Err(AccessError::SameSecret));
        let mut short_mutual = good.clone();
        short_mutual.chap.as_mut().unwrap().mutual = Some(creds("target", "short"));
        assert!(matches!(
            short_mutual.check(),
            Err(AccessError::SecretTooShort { .. })
        ));
        let mut bad_user = good.clone();
        bad_user.chap.as_mut().unwrap().initiator.user = "a b".into();
        assert!(matches!(bad_user.check(), Err(AccessError::BadUser { .. })));
        let mut bad_name = good.clone();
        bad_name.allowed_initiators.push("host2".into());
        assert_eq!(
            bad_name.check(),
            Err(AccessError::BadInitiator("host2".into()))
        );
    }

    #[test]
    fn the_allowlist_admits_its_names_only() {
        let open = Access::default();
        assert!(open.admits("iqn.anything"));
        let a = Access {
            allowed_initiators: vec!["iqn.2026-11.io.example:host1".into()],
            chap: None,
        };
        assert!(a.admits("iqn.2026-11.io.example:host1"));
        assert!(a.admits("IQN.2026-11.io.example:HOST1"));
        assert!(!a.admits("iqn.2026-11.io.example:host2"));
        assert!(!a.admits(""));
    }

    #[test]
    fn debug_redacts_secrets() {
        let c = Chap {
            initiator: creds("alice", "sekrit-sekrit"),
            mutual: Some(creds("target", "other-other-secret")),
        };
        let s = format!("{c:?}");
        assert!(s.contains("alice") && s.contains("<redacted>"), "{s}");
        assert!(!s.contains("sekrit") && !s.contains("other-other"), "{s}");
    }
}
