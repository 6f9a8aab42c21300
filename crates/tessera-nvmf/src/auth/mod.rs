//! In-band authentication: DH-HMAC-CHAP (NVMe Base 2.0 §8.13, TP 8006), the pure part
//! (no sockets): secrets in their `DHHC-1:` representation and the key transformation,
//! the hash and Diffie-Hellman primitives, the message codecs, and the two ends of a
//! transaction — [`ControllerAuth`] (the target's side, fed by Authentication Send and
//! drained by Authentication Receive) and [`HostAuth`] (the initiator's).
//!
//! A transaction: the host sends AUTH_Negotiate (the hashes and DH groups it offers);
//! the controller answers DH-HMAC-CHAP_Challenge (hash, group, sequence number S1,
//! challenge C1, its DH public value); the host sends DH-HMAC-CHAP_Reply (its response R1
//! over C1, its DH public value and, to authenticate the controller too, a challenge C2
//! with S2); the controller answers Success1 (with its response R2 when asked) or
//! Failure1; when the host asked for R2 it ends with Success2 or Failure2. With a DH group
//! the challenges are "augmented" with the hashed DH shared secret, so a passive observer
//! of one transaction cannot replay or brute-force it offline without solving DH.

mod ffdhe;

use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use hmac::{Mac, SimpleHmac};
use num_bigint::BigUint;
use sha2::{Digest, Sha256, Sha384, Sha512};

use tessera_io::cast::{u16_of, u8_of};

use crate::nvme::{Status, DNR, SC_CMD_SEQ_ERROR, SC_INVALID_FIELD};
use crate::pdu::{le16, le32};

/// Security Protocol of Authentication Send/Receive: DH-HMAC-CHAP (SECP), with SPSP0 and
/// SPSP1 both 1.
pub const SECP_DHCHAP: u8 = 0xE9;
/// Connect response DW0: AUTHREQ.ATR, the host must authenticate before anything else.
pub const CONNECT_AUTHREQ_ATR: u32 = 1 << 17;
/// Largest authentication message either side accepts (a Reply with SHA-512 and
/// ffdhe8192 is 16 + 2 * 64 + 1024 bytes).
pub const MAX_MESSAGE: usize = 4096;

const AUTH_COMMON: u8 = 0x00;
const AUTH_DHCHAP: u8 = 0x01;
const MSG_NEGOTIATE: u8 = 0x00;
const MSG_CHALLENGE: u8 = 0x01;
const MSG_REPLY: u8 = 0x02;
const MSG_SUCCESS1: u8 = 0x03;
const MSG_SUCCESS2: u8 = 0x04;
const MSG_FAILURE2: u8 = 0xF0;
const MSG_FAILURE1: u8 = 0xF1;
/// AUTHID of the DH-HMAC-CHAP protocol descriptor in a Negotiate.
const AUTHID_DHCHAP: u8 = 0x01;
const DESCRIPTOR_LEN: usize = 64;
/// Failure reason code: authentication failed (the explanation says why).
const REASON_FAILED: u8 = 0x01;

/// Why a transaction failed (Failure1/Failure2 "reason code explanation").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Reason {
    Failed = 0x01,
    NotUsable = 0x02,
    ConcatMismatch = 0x03,
    HashUnusable = 0x04,
    DhGroupUnusable = 0x05,
    IncorrectPayload = 0x06,
    IncorrectMessage = 0x07,
}

impl Reason {
    fn from_u8(v: u8) -> Reason {
        match v {
            0x02 => Reason::NotUsable,
            0x03 => Reason::ConcatMismatch,
            0x04 => Reason::HashUnusable,
            0x05 => Reason::DhGroupUnusable,
            0x06 => Reason::IncorrectPayload,
            0x07 => Reason::IncorrectMessage,
            _ => Reason::Failed,
        }
    }

    pub fn text(self) -> &'static str {
        match self {
            Reason::Failed => "authentication failed (wrong secret?)",
            Reason::NotUsable => "authentication protocol not usable",
            Reason::ConcatMismatch => "secure channel concatenation mismatch",
            Reason::HashUnusable => "no usable hash function",
            Reason::DhGroupUnusable => "no usable Diffie-Hellman group",
            Reason::IncorrectPayload => "incorrect payload",
            Reason::IncorrectMessage => "incorrect protocol message",
        }
    }
}

// ---- hashes ----

/// The hash functions of DH-HMAC-CHAP, by their identifier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hash {
    Sha256 = 1,
    Sha384 = 2,
    Sha512 = 3,
}

impl Hash {
    pub const ALL: [Hash; 3] = [Hash::Sha256, Hash::Sha384, Hash::Sha512];

    pub fn from_id(id: u8) -> Option<Hash> {
        Hash::ALL.into_iter().find(|h| *h as u8 == id)
    }

    pub fn from_name(s: &str) -> Option<Hash> {
        Hash::ALL
            .into_iter()
            .find(|h| h.name().eq_ignore_ascii_case(s.trim()))
    }

    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    /// Digest length in bytes (also the challenge and response length).
    pub fn digest_len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            Hash::Sha256 => Sha256::digest(data).to_vec(),
            Hash::Sha384 => Sha384::digest(data).to_vec(),
            Hash::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    /// HMAC over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest + hmac::digest::core_api::BlockSizeUser>(
            key: &[u8],
            parts: &[&[u8]],
        ) -> Vec<u8> {
            let mut m = <SimpleHmac<D> as Mac>::new_from_slice(key).expect("HMAC takes any key");
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().to_vec()
        }
        match self {
            Hash::Sha256 => run::<Sha256>(key, parts),
            Hash::Sha384 => run::<Sha384>(key, parts),
            Hash::Sha512 => run::<Sha512>(key, parts),
        }
    }
}

/// Compare without an early exit, so the time taken says nothing about where a forged
/// response first differs.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    getrandom::getrandom(&mut v).expect("the system's random source works");
    v
}

fn random_nonzero_u32() -> u32 {
    loop {
        let b = random_bytes(4);
        let v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if v != 0 {
            return v;
        }
    }
}

// ---- secrets ----

/// A DH-HMAC-CHAP secret as `nvme gen-dhchap-key` writes it:
/// `DHHC-1:<hh>:<base64 of key || CRC-32(key), little endian>:`, where `hh` names the hash
/// the key is transformed with before use (00 none, 01 SHA-256, 02 SHA-384, 03 SHA-512).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    transform: Option<Hash>,
    key: Vec<u8>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material, whatever logs a structure holding one.
        f.write_str("Secret(<redacted>)")
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        for b in &mut self.key {
            // SAFETY: `b` is a valid, aligned, exclusive reference into the key; a volatile
            // write keeps the compiler from dropping the wipe of memory about to be freed.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

/// Why a text is not a DH-HMAC-CHAP secret: `why` names the part that is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a DH-HMAC-CHAP secret ({why}); expected DHHC-1:0X:<base64>: as `nvme gen-dhchap-key` prints")]
pub struct SecretError {
    pub why: &'static str,
}

impl Secret {
    pub fn parse(s: &str) -> Result<Secret, SecretError> {
        let s = s.trim();
        let bad = |why: &'static str| SecretError { why };
        let rest = s
            .strip_prefix("DHHC-1:")
            .ok_or_else(|| bad("no DHHC-1: prefix"))?;
        let (hh, rest) = rest.split_once(':').ok_or_else(|| bad("no hash field"))?;
        if hh.len() != 2 {
            return Err(bad("the hash field is not two hex digits"));
        }
        let id = u8::from_str_radix(hh, 16).map_err(|_| bad("the hash field is not hex"))?;
        let transform = match id {
            0 => None,
            x => Some(Hash::from_id(x).ok_or_else(|| bad("unknown hash in the hash field"))?),
        };
        let b64 = rest
            .strip_suffix(':')
            .ok_or_else(|| bad("no closing ':'"))?;
        let raw = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|_| bad("the key is not base64"))?;
        let key_len = raw.len().saturating_sub(4);
        if ![32, 48, 64].contains(&key_len) {
            return Err(bad("the key is not 32, 48 or 64 bytes"));
        }
        if let Some(h) = transform {
            if h.digest_len() != key_len {
                return Err(bad("the key length does not match its hash"));
            }
        }
        let (key, crc) = raw.split_at(key_len);
        if crc32fast::hash(key).to_le_bytes() != crc {
            return Err(bad("its CRC does not match (mistyped?)"));
        }
        Ok(Secret {
            transform,
            key: key.to_vec(),
        })
    }

    /// A new random secret of `len` bytes (32, 48 or 64), transformed with `transform`.
    pub fn generate(transform: Option<Hash>, len: usize) -> Secret {
        Secret {
            transform,
            key: random_bytes(len),
        }
    }

    pub fn encode(&self) -> String {
        let mut raw = self.key.clone();
        raw.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        format!(
            "DHHC-1:{:02x}:{}:",
            self.transform.map_or(0, |h| h as u8),
            base64::engine::general_purpose::STANDARD.encode(raw)
        )
    }

    /// The key the responses are computed with: the secret itself, or
    /// HMAC(hash, secret, NQN || "NVMe-over-Fabrics") with the hash the secret names. The
    /// NQN is the host's for the host secret, the subsystem's for the controller secret.
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => h.hmac(&self.key, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

// ---- Diffie-Hellman ----

/// The DH groups of DH-HMAC-CHAP, by their identifier. NULL: no DH exchange (the
/// challenge is used as is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DhGroup {
    Null = 0,
    Ffdhe2048 = 1,
    Ffdhe3072 = 2,
    Ffdhe4096 = 3,
    Ffdhe6144 = 4,
    Ffdhe8192 = 5,
}

impl DhGroup {
    pub const ALL: [DhGroup; 6] = [
        DhGroup::Null,
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ];

    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| *g as u8 == id)
    }

    pub fn from_name(s: &str) -> Option<DhGroup> {
        DhGroup::ALL
            .into_iter()
            .find(|g| g.name().eq_ignore_ascii_case(s.trim()))
    }

    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Length of a public value (the prime's length), 0 for NULL.
    pub fn value_len(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    fn prime(self) -> Option<&'static BigUint> {
        static PRIMES: [OnceLock<BigUint>; 5] = [
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
            OnceLock::new(),
        ];
        let hex = match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => ffdhe::FFDHE2048,
            DhGroup::Ffdhe3072 => ffdhe::FFDHE3072,
            DhGroup::Ffdhe4096 => ffdhe::FFDHE4096,
            DhGroup::Ffdhe6144 => ffdhe::FFDHE6144,
            DhGroup::Ffdhe8192 => ffdhe::FFDHE8192,
        };
        Some(
            PRIMES[self as usize - 1]
                .get_or_init(|| BigUint::parse_bytes(hex.as_bytes(), 16).expect("RFC 7919 prime")),
        )
    }
}

/// An ephemeral DH key pair of one transaction.
struct DhKey {
    group: DhGroup,
    private: BigUint,
    public: Vec<u8>,
}

/// Big-endian, left-padded to `len` bytes (DH values always have the prime's length).
fn to_fixed(v: &BigUint, len: usize) -> Vec<u8> {
    let b = v.to_bytes_be();
    let mut out = vec![0u8; len.saturating_sub(b.len())];
    out.extend_from_slice(&b);
    out
}

impl DhKey {
    fn generate(group: DhGroup) -> Option<DhKey> {
        let p = group.prime()?;
        // A 512-bit exponent: above twice the strength of the largest group (RFC 7919
        // §5.2 asks for at least 2x the security level, 400 bits for ffdhe8192).
        let private = BigUint::from_bytes_be(&random_bytes(64)) | BigUint::from(1u8) << 511u32;
        let public = to_fixed(&BigUint::from(2u8).modpow(&private, p), group.value_len());
        Some(DhKey {
            group,
            private,
            public,
        })
    }

    /// The shared secret with the peer's public value, refused when that value is not in
    /// 2..p-2 (which would force a known secret).
    fn shared(&self, peer: &[u8]) -> Result<Vec<u8>, Reason> {
        let p = self.group.prime().ok_or(Reason::DhGroupUnusable)?;
        if peer.len() != self.group.value_len() {
            return Err(Reason::IncorrectPayload);
        }
        let y = BigUint::from_bytes_be(peer);
        let one = BigUint::from(1u8);
        if y <= one || y >= p - &one {
            return Err(Reason::IncorrectPayload);
        }
        Ok(to_fixed(
            &y.modpow(&self.private, p),
            self.group.value_len(),
        ))
    }
}

/// The challenge as the response covers it: with a DH group,
/// HMAC(hash, key = H(shared secret), challenge); without, the challenge itself.
pub fn augmented_challenge(hash: Hash, session_key: Option<&[u8]>, challenge: &[u8]) -> Vec<u8> {
    match session_key {
        None => challenge.to_vec(),
        Some(k) => hash.hmac(&hash.digest(k), &[challenge]),
    }
}

/// R1: the host's response to the controller's challenge.
pub fn host_response(
    hash: Hash,
    key: &[u8],
    challenge: &[u8],
    seq: u32,
    tid: u16,
    hostnqn: &str,
    subnqn: &str,
) -> Vec<u8> {
    hash.hmac(
        key,
        &[
            challenge,
            &seq.to_le_bytes(),
            &tid.to_le_bytes(),
            &[0],
            b"HostHost",
            hostnqn.as_bytes(),
            &[0],
            subnqn.as_bytes(),
        ],
    )
}

/// R2: the controller's response to the host's challenge (bidirectional).
pub fn controller_response(
    hash: Hash,
    key: &[u8],
    challenge: &[u8],
    seq: u32,
    tid: u16,
    subnqn: &str,
    hostnqn: &str,
) -> Vec<u8> {
    hash.hmac(
        key,
        &[
            challenge,
            &seq.to_le_bytes(),
            &tid.to_le_bytes(),
            &[0],
            b"Controller",
            subnqn.as_bytes(),
            &[0],
            hostnqn.as_bytes(),
        ],
    )
}

// ---- messages ----

/// An authentication message, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Negotiate {
        tid: u16,
        sc_c: u8,
        hashes: Vec<u8>,
        groups: Vec<u8>,
    },
    Challenge {
        tid: u16,
        hash: u8,
        group: u8,
        seq: u32,
        challenge: Vec<u8>,
        dh: Vec<u8>,
    },
    Reply {
        tid: u16,
        response: Vec<u8>,
        /// The host's challenge to the controller (bidirectional), with its sequence number.
        ctrl_challenge: Option<(Vec<u8>, u32)>,
        dh: Vec<u8>,
    },
    Success1 {
        tid: u16,
        hl: u8,
        response: Option<Vec<u8>>,
    },
    Success2 {
        tid: u16,
    },
    Failure1 {
        tid: u16,
        reason: Reason,
    },
    Failure2 {
        tid: u16,
        reason: Reason,
    },
}

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        let head = |b: &mut Vec<u8>, ty: u8, id: u8, tid: u16| {
            b.extend_from_slice(&[ty, id, 0, 0]);
            b.extend_from_slice(&tid.to_le_bytes());
        };
        let mut b = Vec::with_capacity(64);
        match self {
            Message::Negotiate {
                tid,
                sc_c,
                hashes,
                groups,
            } => {
                head(&mut b, AUTH_COMMON, MSG_NEGOTIATE, *tid);
                b.extend_from_slice(&[*sc_c, 1]);
                let mut d = [0u8; DESCRIPTOR_LEN];
                d[0] = AUTHID_DHCHAP;
                d[2] = u8_of(hashes.len().min(30));
                d[3] = u8_of(groups.len().min(30));
                for (i, h) in hashes.iter().take(30).enumerate() {
                    d[4 + i] = *h;
                }
                for (i, g) in groups.iter().take(30).enumerate() {
                    d[34 + i] = *g;
                }
                b.extend_from_slice(&d);
            }
            Message::Challenge {
                tid,
                hash,
                group,
                seq,
                challenge,
                dh,
            } => {
                head(&mut b, AUTH_DHCHAP, MSG_CHALLENGE, *tid);
                b.extend_from_slice(&[u8_of(challenge.len()), 0, *hash, *group]);
                b.extend_from_slice(&u16_of(dh.len()).to_le_bytes());
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(challenge);
                b.extend_from_slice(dh);
            }
            Message::Reply {
                tid,
                response,
                ctrl_challenge,
                dh,
            } => {
                head(&mut b, AUTH_DHCHAP, MSG_REPLY, *tid);
                let cvalid = ctrl_challenge.is_some() as u8;
                b.extend_from_slice(&[u8_of(response.len()), 0, cvalid, 0]);
                b.extend_from_slice(&u16_of(dh.len()).to_le_bytes());
                let seq = ctrl_challenge.as_ref().map_or(0, |c| c.1);
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(response);
                match ctrl_challenge {
                    Some((c, _)) => b.extend_from_slice(c),
                    None => b.resize(b.len() + response.len(), 0),
                }
                b.extend_from_slice(dh);
            }
            Message::Success1 { tid, hl, response } => {
                head(&mut b, AUTH_DHCHAP, MSG_SUCCESS1, *tid);
                b.extend_from_slice(&[*hl, 0, response.is_some() as u8, 0, 0, 0, 0, 0, 0, 0]);
                if let Some(r) = response {
                    b.extend_from_slice(r);
                }
            }
            Message::Success2 { tid } => {
                head(&mut b, AUTH_DHCHAP, MSG_SUCCESS2, *tid);
                b.resize(16, 0);
            }
            Message::Failure1 { tid, reason } | Message::Failure2 { tid, reason } => {
                let id = if matches!(self, Message::Failure1 { .. }) {
                    MSG_FAILURE1
                } else {
                    MSG_FAILURE2
                };
                head(&mut b, AUTH_COMMON, id, *tid);
                b.extend_from_slice(&[REASON_FAILED, *reason as u8]);
                b.resize(16, 0);
            }
        }
        b
    }

    /// Decode one message; anything short, inconsistent or unknown is an error (the
    /// reason a Failure message would give).
    pub fn parse(b: &[u8]) -> Result<Message, Reason> {
        if b.len() < 8 {
            return Err(Reason::IncorrectPayload);
        }
        let tid = le16(b, 4);
        let need = |n: usize| {
            if b.len() >= n {
                Ok(())
            } else {
                Err(Reason::IncorrectPayload)
            }
        };
        match (b[0], b[1]) {
            (AUTH_COMMON, MSG_NEGOTIATE) => {
                need(8)?;
                let napd = b[7] as usize;
                if napd == 0 || napd > 32 {
                    return Err(Reason::IncorrectPayload);
                }
                need(8 + napd * DESCRIPTOR_LEN)?;
                let d = (0..napd)
                    .map(|i| &b[8 + i * DESCRIPTOR_LEN..8 + (i + 1) * DESCRIPTOR_LEN])
                    .find(|d| d[0] == AUTHID_DHCHAP)
                    .ok_or(Reason::NotUsable)?;
                let (halen, dhlen) = (d[2] as usize, d[3] as usize);
                if halen > 30 || dhlen > 30 {
                    return Err(Reason::IncorrectPayload);
                }
                Ok(Message::Negotiate {
                    tid,
                    sc_c: b[6],
                    hashes: d[4..4 + halen].to_vec(),
                    groups: d[34..34 + dhlen].to_vec(),
                })
            }
            (AUTH_DHCHAP, MSG_CHALLENGE) => {
                need(16)?;
                let hl = b[6] as usize;
                let dhvlen = le16(b, 10) as usize;
                need(16 + hl + dhvlen)?;
                Ok(Message::Challenge {
                    tid,
                    hash: b[8],
                    group: b[9],
                    seq: le32(b, 12),
                    challenge: b[16..16 + hl].to_vec(),
                    dh: b[16 + hl..16 + hl + dhvlen].to_vec(),
                })
            }
            (AUTH_DHCHAP, MSG_REPLY) => {
                need(16)?;
                let hl = b[6] as usize;
                let cvalid = b[8] & 1 != 0;
                let dhvlen = le16(b, 10) as usize;
                need(16 + 2 * hl + dhvlen)?;
                Ok(Message::Reply {
                    tid,
                    response: b[16..16 + hl].to_vec(),
                    ctrl_challenge: cvalid.then(|| (b[16 + hl..16 + 2 * hl].to_vec(), le32(b, 12))),
                    dh: b[16 + 2 * hl..16 + 2 * hl + dhvlen].to_vec(),
                })
            }
            (AUTH_DHCHAP, MSG_SUCCESS1) => {
                need(16)?;
                let hl = b[6];
                let rvalid = b[8] & 1 != 0;
                if rvalid {
                    need(16 + hl as usize)?;
                }
                Ok(Message::Success1 {
                    tid,
                    hl,
                    response: rvalid.then(|| b[16..16 + hl as usize].to_vec()),
                })
            }
            (AUTH_DHCHAP, MSG_SUCCESS2) => Ok(Message::Success2 { tid }),
            (AUTH_COMMON, MSG_FAILURE1) | (AUTH_COMMON, MSG_FAILURE2) => {
                need(8)?;
                let reason = Reason::from_u8(b.get(7).copied().unwrap_or(0));
                Ok(if b[1] == MSG_FAILURE1 {
                    Message::Failure1 { tid, reason }
                } else {
                    Message::Failure2 { tid, reason }
                })
            }
            _ => Err(Reason::IncorrectMessage),
        }
    }
}

/// The CDW10 of Authentication Send/Receive for DH-HMAC-CHAP (SECP, SPSP1, SPSP0).
pub fn auth_cdw10() -> u32 {
    (SECP_DHCHAP as u32) << 24 | 1 << 16 | 1 << 8
}

/// Whether an Authentication Send/Receive names DH-HMAC-CHAP.
pub fn is_dhchap_cdw10(cdw10: u32) -> bool {
    cdw10 & 0xFFFF_FF00 == auth_cdw10()
}

// ---- the controller's side ----

/// What a subsystem requires of one host: its secret, the controller's secret (which
/// lets the host authenticate the controller), and the hash and DH group the controller
/// asks for.
#[derive(Clone, Debug)]
pub struct HostKeys {
    pub host: Secret,
    pub ctrl: Option<Secret>,
    /// Preferred hash (another one the host offers is used when it does not offer this).
    pub hash: Hash,
    /// Required DH group: a host that does not offer it is refused.
    pub group: DhGroup,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CtrlStep {
    /// Waiting for a Negotiate.
    Negotiate,
    /// A message for the host waits to be fetched by Authentication Receive.
    Pending,
    /// Challenge fetched: waiting for the Reply.
    Reply,
    /// Success1 with R2 fetched: waiting for Success2 or Failure2.
    Success2,
}

/// One queue's DH-HMAC-CHAP state on the controller.
pub struct ControllerAuth {
    keys: Arc<HostKeys>,
    hostnqn: String,
    subnqn: String,
    step: CtrlStep,
    /// The step after the pending message is fetched.
    after: CtrlStep,
    pending: Vec<u8>,
    authenticated: bool,
    /// Set when the pending message, once fetched, authenticates the queue.
    authenticates: bool,
    tid: u16,
    hash: Hash,
    group: DhGroup,
    seq: u32,
    challenge: Vec<u8>,
    dh: Option<DhKey>,
}

impl ControllerAuth {
    pub fn new(keys: Arc<HostKeys>, hostnqn: &str, subnqn: &str) -> ControllerAuth {
        ControllerAuth {
            keys,
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            step: CtrlStep::Negotiate,
            after: CtrlStep::Negotiate,
            pending: Vec::new(),
            authenticated: false,
            authenticates: false,
            tid: 0,
            hash: Hash::Sha256,
            group: DhGroup::Null,
            seq: 0,
            challenge: Vec::new(),
            dh: None,
        }
    }

    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// The transaction failed: the host learns why from the pending Failure1, and the
    /// queue is not (or no longer) authenticated.
    fn fail(&mut self, tid: u16, reason: Reason) {
        self.authenticated = false;
        self.authenticates = false;
        self.dh = None;
        self.pending = Message::Failure1 { tid, reason }.encode();
        self.step = CtrlStep::Pending;
        self.after = CtrlStep::Negotiate;
    }

    /// Authentication Send: one message from the host. The command's own status is an
    /// error only for a command that cannot be taken at all; a message that fails the
    /// protocol completes fine and the host fetches the Failure1 that says why.
    pub fn send(&mut self, data: &[u8]) -> Result<(), Status> {
        let msg = match Message::parse(data) {
            Ok(m) => m,
            Err(r) => {
                let tid = if data.len() >= 6 { le16(data, 4) } else { 0 };
                self.fail(tid, r);
                return Ok(());
            }
        };
        match (self.step, msg) {
            // A Negotiate starts a transaction at any point (re-authentication included).
            (
                _,
                Message::Negotiate {
                    tid,
                    sc_c,
                    hashes,
                    groups,
                },
            ) => {
                self.negotiate(tid, sc_c, &hashes, &groups);
                Ok(())
            }
            (
                CtrlStep::Reply,
                Message::Reply {
                    tid,
                    response,
                    ctrl_challenge,
                    dh,
                },
            ) => {
                self.reply(tid, &response, ctrl_challenge, &dh);
                Ok(())
            }
            (CtrlStep::Success2, Message::Success2 { tid }) if tid == self.tid => {
                self.authenticated = true;
                self.step = CtrlStep::Negotiate;
                Ok(())
            }
            (CtrlStep::Success2, Message::Failure2 { .. }) => {
                // The host did not accept the controller's response.
                self.authenticated = false;
                self.step = CtrlStep::Negotiate;
                Ok(())
            }
            (_, Message::Failure2 { .. }) => {
                self.authenticated = false;
                self.step = CtrlStep::Negotiate;
                Ok(())
            }
            (_, m) => {
                let tid = match m {
                    Message::Reply { tid, .. } | Message::Success2 { tid } => tid,
                    _ => self.tid,
                };
                self.fail(tid, Reason::IncorrectMessage);
                Ok(())
            }
        }
    }

    fn negotiate(&mut self, tid: u16, sc_c: u8, hashes: &[u8], groups: &[u8]) {
        self.tid = tid;
        if sc_c != 0 {
            // Secure channel concatenation (TLS) is not offered here.
            return self.fail(tid, Reason::ConcatMismatch);
        }
        let offered = |h: Hash| hashes.contains(&(h as u8));
        let hash = if offered(self.keys.hash) {
            Some(self.keys.hash)
        } else {
            Hash::ALL.into_iter().rev().find(|h| offered(*h))
        };
        let Some(hash) = hash else {
            return self.fail(tid, Reason::HashUnusable);
        };
        let group = self.keys.group;
        if !groups.contains(&(group as u8)) {
            return self.fail(tid, Reason::DhGroupUnusable);
        }
        self.hash = hash;
        self.group = group;
        self.seq = random_nonzero_u32();
        self.challenge = random_bytes(hash.digest_len());
        self.dh = DhKey::generate(group);
        let dh = self
            .dh
            .as_ref()
            .map(|k| k.public.clone())
            .unwrap_or_default();
        self.pending = Message::Challenge {
            tid,
            hash: hash as u8,
            group: group as u8,
            seq: self.seq,
            challenge: self.challenge.clone(),
            dh,
        }
        .encode();
        self.authenticates = false;
        self.step = CtrlStep::Pending;
        self.after = CtrlStep::Reply;
    }

    fn reply(
        &mut self,
        tid: u16,
        response: &[u8],
        ctrl_challenge: Option<(Vec<u8>, u32)>,
        dh: &[u8],
    ) {
        if tid != self.tid {
            return self.fail(tid, Reason::IncorrectMessage);
        }
        if response.len() != self.hash.digest_len() {
            return self.fail(tid, Reason::IncorrectPayload);
        }
        let session = match &self.dh {
            None if dh.is_empty() => None,
            None => return self.fail(tid, Reason::IncorrectPayload),
            Some(k) => match k.shared(dh) {
                Ok(s) => Some(s),
                Err(r) => return self.fail(tid, r),
            },
        };
        self.dh = None;
        let c1 = augmented_challenge(self.hash, session.as_deref(), &self.challenge);
        let key = self.keys.host.transformed(&self.hostnqn);
        let expect = host_response(
            self.hash,
            &key,
            &c1,
            self.seq,
            tid,
            &self.hostnqn,
            &self.subnqn,
        );
        if !same(&expect, response) {
            return self.fail(tid, Reason::Failed);
        }
        let r2 = match ctrl_challenge {
            None => None,
            Some((c2, seq2)) => {
                let Some(ctrl) = &self.keys.ctrl else {
                    // The host wants the controller authenticated and it has no secret.
                    return self.fail(tid, Reason::NotUsable);
                };
                if seq2 == 0 || c2.len() != self.hash.digest_len() {
                    return self.fail(tid, Reason::IncorrectPayload);
                }
                let c2 = augmented_challenge(self.hash, session.as_deref(), &c2);
                let key = ctrl.transformed(&self.subnqn);
                Some(controller_response(
                    self.hash,
                    &key,
                    &c2,
                    seq2,
                    tid,
                    &self.subnqn,
                    &self.hostnqn,
                ))
            }
        };
        let bidirectional = r2.is_some();
        self.pending = Message::Success1 {
            tid,
            hl: u8_of(self.hash.digest_len()),
            response: r2,
        }
        .encode();
        self.step = CtrlStep::Pending;
        if bidirectional {
            self.authenticates = false;
            self.after = CtrlStep::Success2;
        } else {
            self.authenticates = true;
            self.after = CtrlStep::Negotiate;
        }
    }

    /// Authentication Receive with an allocation length of `al` bytes: the message that
    /// waits for the host.
    pub fn receive(&mut self, al: usize) -> Result<Vec<u8>, Status> {
        if self.step != CtrlStep::Pending {
            return Err(SC_CMD_SEQ_ERROR);
        }
        if al < self.pending.len() {
            return Err(SC_INVALID_FIELD | DNR);
        }
        self.step = self.after;
        if self.authenticates {
            self.authenticated = true;
            self.authenticates = false;
        }
        Ok(std::mem::take(&mut self.pending))
    }

    /// The hash and DH group of the last transaction (for the log).
    pub fn chosen(&self) -> (Hash, DhGroup) {
        (self.hash, self.group)
    }
}

// ---- the host's side ----

/// Why a host could not authenticate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostAuthError {
    /// The controller refused us (Failure1).
    Refused(Reason),
    /// The controller's answer was wrong or malformed; the host sends `failure2` (when
    /// present) to end the transaction.
    Rejected {
        reason: Reason,
        what: String,
        failure2: Option<Vec<u8>>,
    },
}

impl std::fmt::Display for HostAuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostAuthError::Refused(r) => {
                write!(f, "the controller refused authentication: {}", r.text())
            }
            HostAuthError::Rejected { what, .. } => write!(f, "authentication failed: {what}"),
        }
    }
}

/// One queue's DH-HMAC-CHAP transaction on the host.
pub struct HostAuth {
    secret: Secret,
    ctrl: Option<Secret>,
    hostnqn: String,
    subnqn: String,
    tid: u16,
    hash: Hash,
    ctrl_challenge: Vec<u8>,
    ctrl_seq: u32,
    session: Option<Vec<u8>>,
}

impl HostAuth {
    pub fn new(secret: Secret, ctrl: Option<Secret>, hostnqn: &str, subnqn: &str) -> HostAuth {
        HostAuth {
            secret,
            ctrl,
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            tid: 0,
            hash: Hash::Sha256,
            ctrl_challenge: Vec::new(),
            ctrl_seq: 0,
            session: None,
        }
    }

    /// The Negotiate: every hash and DH group this side implements.
    pub fn negotiate(&mut self, tid: u16) -> Vec<u8> {
        self.tid = tid;
        Message::Negotiate {
            tid,
            sc_c: 0,
            hashes: Hash::ALL.iter().map(|h| *h as u8).collect(),
            groups: DhGroup::ALL.iter().map(|g| *g as u8).collect(),
        }
        .encode()
    }

    fn reject(&self, reason: Reason, what: String) -> HostAuthError {
        HostAuthError::Rejected {
            reason,
            what,
            failure2: Some(
                Message::Failure2 {
                    tid: self.tid,
                    reason,
                }
                .encode(),
            ),
        }
    }

    /// The controller's Challenge in, our Reply out.
    pub fn reply(&mut self, challenge: &[u8]) -> Result<Vec<u8>, HostAuthError> {
        let m = Message::parse(challenge)
            .map_err(|r| self.reject(r, format!("malformed challenge ({})", r.text())))?;
        let (hash, group, seq, c1, dh) = match m {
            Message::Failure1 { reason, .. } => return Err(HostAuthError::Refused(reason)),
            Message::Challenge {
                tid,
                hash,
                group,
                seq,
                challenge,
                dh,
            } if tid == self.tid => (hash, group, seq, challenge, dh),
            _ => {
                return Err(self.reject(
                    Reason::IncorrectMessage,
                    "the controller did not answer with a challenge".into(),
                ))
            }
        };
        let hash = Hash::from_id(hash)
            .ok_or_else(|| self.reject(Reason::HashUnusable, "unknown hash".into()))?;
        let group = DhGroup::from_id(group)
            .ok_or_else(|| self.reject(Reason::DhGroupUnusable, "unknown DH group".into()))?;
        if c1.len() != hash.digest_len() {
            return Err(self.reject(Reason::IncorrectPayload, "bad challenge length".into()));
        }
        self.hash = hash;
        let (ours, session) = match DhKey::generate(group) {
            None if dh.is_empty() => (Vec::new(), None),
            None => {
                return Err(self.reject(Reason::IncorrectPayload, "DH value with NULL group".into()))
            }
            Some(k) => {
                let s = k
                    .shared(&dh)
                    .map_err(|r| self.reject(r, "the controller's DH value is invalid".into()))?;
                (k.public.clone(), Some(s))
            }
        };
        self.session = session;
        let key = self.secret.transformed(&self.hostnqn);
        let c1 = augmented_challenge(hash, self.session.as_deref(), &c1);
        let response = host_response(hash, &key, &c1, seq, self.tid, &self.hostnqn, &self.subnqn);
        let ctrl_challenge = self.ctrl.as_ref().map(|_| {
            self.ctrl_challenge = random_bytes(hash.digest_len());
            self.ctrl_seq = random_nonzero_u32();
            (self.ctrl_challenge.clone(), self.ctrl_seq)
        });
        Ok(Message::Reply {
            tid: self.tid,
            response,
            ctrl_challenge,
            dh: ours,
        }
        .encode())
    }

    /// The controller's Success1 in; the Success2 to send when we authenticated the
    /// controller too.
    pub fn success1(&mut self, msg: &[u8]) -> Result<Option<Vec<u8>>, HostAuthError> {
        let m = Message::parse(msg)
            .map_err(|r| self.reject(r, format!("malformed success message ({})", r.text())))?;
        let r2 = match m {
            Message::Failure1 { reason, .. } => return Err(HostAuthError::Refused(reason)),
            Message::Success1 { tid, response, hl } if tid == self.tid => {
                if hl as usize != self.hash.digest_len() {
                    return Err(self.reject(Reason::HashUnusable, "bad hash length".into()));
                }
                response
            }
            _ => {
                return Err(self.reject(
                    Reason::IncorrectMessage,
                    "the controller did not answer with Success1".into(),
                ))
            }
        };
        let Some(ctrl) = &self.ctrl else {
            return Ok(None);
        };
        let Some(r2) = r2 else {
            return Err(self.reject(
                Reason::Failed,
                "the controller did not authenticate itself".into(),
            ));
        };
        let key = ctrl.transformed(&self.subnqn);
        let c2 = augmented_challenge(self.hash, self.session.as_deref(), &self.ctrl_challenge);
        let expect = controller_response(
            self.hash,
            &key,
            &c2,
            self.ctrl_seq,
            self.tid,
            &self.subnqn,
            &self.hostnqn,
        );
        if !same(&expect, &r2) {
            return Err(self.reject(
                Reason::Failed,
                "the controller's response is wrong (wrong controller secret?)".into(),
            ));
        }
        Ok(Some(Message::Success2 { tid: self.tid }.encode()))
    }
}

#[cfg(test)]
mod tests;
