//! Text keys and their negotiation (RFC 7143 §6 and §13): NUL-separated `key=value`
//! pairs, and the target's answer to each operational key an initiator offers, from the
//! key's result function (numerical minimum or maximum, boolean AND or OR, a list the
//! target picks from, or a declaration).
//!
//! The target's own offers are the constants below; the answer to an offer is the
//! function applied to the initiator's value and ours, so the result both ends hold is
//! the answer.

use thiserror::Error;

/// What this target receives in one data segment (declared at login).
pub const TARGET_MAX_RECV_DATA_SEGMENT: u32 = 256 << 10;
/// The longest burst (Data-Out sequence or Data-In sequence) this target accepts.
pub const TARGET_MAX_BURST: u32 = 1 << 20;
/// The most unsolicited data (immediate data) this target takes with a command.
pub const TARGET_FIRST_BURST: u32 = 64 << 10;
/// Seconds an initiator waits before reconnecting after a logout or drop.
pub const TARGET_TIME2WAIT: u32 = 2;
/// Text data accepted across the PDUs of one login or text exchange (with C bits).
pub const MAX_TEXT: usize = 64 << 10;

/// Why a text segment cannot be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TextError {
    /// A pair with no `=`.
    #[error("text pair {0:?} has no '='")]
    NoEquals(String),
    /// A key or value that is not UTF-8.
    #[error("text pair is not UTF-8")]
    NotUtf8,
    /// The same key twice in one exchange.
    #[error("key {0} offered twice")]
    Repeated(String),
}

/// The `key=value` pairs of a text data segment (NUL separated; a trailing NUL and
/// padding are tolerated).
pub fn parse(data: &[u8]) -> Result<Vec<(String, String)>, TextError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for part in data.split(|&b| b == 0) {
        if part.is_empty() {
            continue;
        }
        let s = std::str::from_utf8(part).map_err(|_| TextError::NotUtf8)?;
        let (k, v) = s
            .split_once('=')
            .ok_or_else(|| TextError::NoEquals(s.chars().take(64).collect()))?;
        if out.iter().any(|(x, _)| x == k) {
            return Err(TextError::Repeated(k.to_string()));
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

/// Pairs as a text data segment (each ends with a NUL).
pub fn encode(pairs: &[(String, String)]) -> Vec<u8> {
    let mut v = Vec::new();
    for (k, val) in pairs {
        v.extend_from_slice(k.as_bytes());
        v.push(b'=');
        v.extend_from_slice(val.as_bytes());
        v.push(0);
    }
    v
}

/// The session and connection parameters in force (RFC 7143 §13 defaults until
/// negotiated).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    pub header_digest: bool,
    pub data_digest: bool,
    pub max_connections: u32,
    pub initial_r2t: bool,
    pub immediate_data: bool,
    /// What the initiator receives in one data segment: the most this target sends per
    /// Data-In or text PDU.
    pub initiator_max_recv: u32,
    pub max_burst: u32,
    pub first_burst: u32,
    pub time2wait: u32,
    pub time2retain: u32,
    pub max_outstanding_r2t: u32,
    pub data_pdu_in_order: bool,
    pub data_sequence_in_order: bool,
    pub error_recovery_level: u32,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            header_digest: false,
            data_digest: false,
            max_connections: 1,
            initial_r2t: true,
            immediate_data: true,
            initiator_max_recv: 8192,
            max_burst: 262_144,
            first_burst: 65_536,
            time2wait: 2,
            time2retain: 20,
            max_outstanding_r2t: 1,
            data_pdu_in_order: true,
            data_sequence_in_order: true,
            error_recovery_level: 0,
        }
    }
}

fn yes_no(b: bool) -> String {
    if b { "Yes" } else { "No" }.to_string()
}

fn boolean(v: &str) -> Option<bool> {
    match v {
        "Yes" => Some(true),
        "No" => Some(false),
        _ => None,
    }
}

/// A numerical value within `[lo, hi]` (decimal, or hex with 0x as RFC 7143 §6.1
/// allows).
fn number(v: &str, lo: u32, hi: u32) -> Option<u32> {
    let n = if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        u32::from_str_radix(h, 16).ok()?
    } else {
        v.parse::<u32>().ok()?
    };
    (lo..=hi).contains(&n).then_some(n)
}

/// The digest a list offer leads to: the first of the initiator's choices the target
/// supports (CRC32C and None both).
fn digest(v: &str) -> Option<bool> {
    v.split(',').find_map(|c| match c {
        "CRC32C" => Some(true),
        "None" => Some(false),
        _ => None,
    })
}

/// Keys that mean nothing to a discovery session (RFC 7143 §13: "Irrelevant" there).
const NOT_FOR_DISCOVERY: [&str; 8] = [
    "MaxConnections",
    "InitialR2T",
    "ImmediateData",
    "MaxBurstLength",
    "FirstBurstLength",
    "MaxOutstandingR2T",
    "DataPDUInOrder",
    "DataSequenceInOrder",
];

/// What the target answers to one operational key the initiator offered, updating
/// `p` with the result. `None`: the key is not an operational key (the login or text
/// layer handles it, or answers NotUnderstood).
pub fn negotiate(p: &mut Params, key: &str, value: &str, discovery: bool) -> Option<String> {
    if discovery && NOT_FOR_DISCOVERY.contains(&key) {
        return Some("Irrelevant".into());
    }
    let reject = || Some("Reject".to_string());
    let answer = match key {
        "HeaderDigest" | "DataDigest" => {
            let Some(on) = digest(value) else {
                return reject();
            };
            if key == "HeaderDigest" {
                p.header_digest = on;
            } else {
                p.data_digest = on;
            }
            if on { "CRC32C" } else { "None" }.to_string()
        }
        "MaxConnections" => {
            let Some(n) = number(value, 1, 65535) else {
                return reject();
            };
            // One connection per session in this slice: min(offer, 1).
            p.max_connections = n.min(1);
            p.max_connections.to_string()
        }
        "InitialR2T" => {
            if boolean(value).is_none() {
                return reject();
            }
            // OR with the target's Yes: an R2T before any non-immediate data, whatever
            // the initiator offered.
            p.initial_r2t = true;
            yes_no(p.initial_r2t)
        }
        "ImmediateData" => {
            let Some(b) = boolean(value) else {
                return reject();
            };
            p.immediate_data = b;
            yes_no(b)
        }
        "MaxRecvDataSegmentLength" => {
            // Declarative: what the initiator receives. The target's own goes out
            // separately (`declarations`).
            let Some(n) = number(value, 512, (1 << 24) - 1) else {
                return reject();
            };
            p.initiator_max_recv = n;
            return Some(String::new());
        }
        "MaxBurstLength" => {
            let Some(n) = number(value, 512, (1 << 24) - 1) else {
                return reject();
            };
            p.max_burst = n.min(TARGET_MAX_BURST);
            p.first_burst = p.first_burst.min(p.max_burst);
            p.max_burst.to_string()
        }
        "FirstBurstLength" => {
            let Some(n) = number(value, 512, (1 << 24) - 1) else {
                return reject();
            };
            p.first_burst = n.min(TARGET_FIRST_BURST).min(p.max_burst);
            p.first_burst.to_string()
        }
        "DefaultTime2Wait" => {
            let Some(n) = number(value, 0, 3600) else {
                return reject();
            };
            p.time2wait = n.max(TARGET_TIME2WAIT);
            p.time2wait.to_string()
        }
        "DefaultTime2Retain" => {
            if number(value, 0, 3600).is_none() {
                return reject();
            }
            // min(offer, 0): error recovery level 0 keeps nothing for a reconnecting
            // initiator.
            p.time2retain = 0;
            p.time2retain.to_string()
        }
        "MaxOutstandingR2T" => {
            let Some(n) = number(value, 1, 65535) else {
                return reject();
            };
            p.max_outstanding_r2t = n.min(1);
            p.max_outstanding_r2t.to_string()
        }
        "DataPDUInOrder" | "DataSequenceInOrder" => {
            if boolean(value).is_none() {
                return reject();
            }
            // OR with the target's Yes: data arrives in order.
            let v = true;
            if key == "DataPDUInOrder" {
                p.data_pdu_in_order = v;
            } else {
                p.data_sequence_in_order = v;
            }
            yes_no(v)
        }
        "ErrorRecoveryLevel" => {
            if number(value, 0, 2).is_none() {
                return reject();
            }
            // min(offer, 0): this target does error recovery level 0 only.
            p.error_recovery_level = 0;
            p.error_recovery_level.to_string()
        }
        // Obsolete RFC 3720 keys (markers): always off.
        "IFMarker" | "OFMarker" => "No".to_string(),
        "IFMarkInt" | "OFMarkInt" => "Irrelevant".to_string(),
        _ => return None,
    };
    Some(answer)
}

/// Fix up the parameters once operational negotiation ends: FirstBurstLength may not
/// exceed MaxBurstLength whichever order the keys came in.
pub fn settle(p: &mut Params) {
    p.first_burst = p.first_burst.min(p.max_burst);
}

/// Whether `n` is an iSCSI name of a form this target takes (RFC 7143 §4.2.7: `iqn.`,
/// `eui.` or `naa.`, at most 223 bytes, no white space).
pub(crate) fn valid_name(n: &str) -> bool {
    let prefixed = ["iqn.", "eui.", "naa."].iter().any(|p| n.starts_with(p));
    prefixed && n.len() <= 223 && n.len() > 4 && !n.chars().any(|c| c.is_whitespace())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_parse_and_encode() {
        let p = parse(b"InitiatorName=iqn.x\0SessionType=Normal\0\0\0").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[1], ("SessionType".into(), "Normal".into()));
        assert_eq!(parse(&encode(&p)).unwrap(), p);
        assert_eq!(parse(b"a=b=c\0").unwrap()[0].1, "b=c");
    }

    #[test]
    fn malformed_text_is_an_error() {
        assert!(matches!(parse(b"novalue\0"), Err(TextError::NoEquals(_))));
        assert_eq!(parse(b"a=\xff\0"), Err(TextError::NotUtf8));
        assert_eq!(parse(b"a=1\0a=2\0"), Err(TextError::Repeated("a".into())));
    }

    #[test]
    fn numerical_keys_take_the_minimum_or_maximum() {
        let mut p = Params::default();
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "16776192", false).unwrap(),
            TARGET_MAX_BURST.to_string()
        );
        assert_eq!(
            negotiate(&mut p, "FirstBurstLength", "4096", false).unwrap(),
            "4096"
        );
        assert_eq!(
            negotiate(&mut p, "FirstBurstLength", "262144", false).unwrap(),
            TARGET_FIRST_BURST.to_string()
        );
        assert_eq!(
            negotiate(&mut p, "DefaultTime2Wait", "0", false).unwrap(),
            "2"
        );
        assert_eq!(
            negotiate(&mut p, "DefaultTime2Retain", "20", false).unwrap(),
            "0"
        );
        assert_eq!(
            negotiate(&mut p, "MaxOutstandingR2T", "8", false).unwrap(),
            "1"
        );
        assert_eq!(
            negotiate(&mut p, "ErrorRecoveryLevel", "2", false).unwrap(),
            "0"
        );
        assert_eq!(
            negotiate(&mut p, "MaxConnections", "4", false).unwrap(),
            "1"
        );
        // Out of the key's range or not a number.
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "100", false).unwrap(),
            "Reject"
        );
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "lots", false).unwrap(),
            "Reject"
        );
        assert_eq!(
            negotiate(&mut p, "MaxBurstLength", "0x10000", false).unwrap(),
            "65536"
        );
    }

    #[test]
    fn boolean_keys_apply_and_or() {
        let mut p = Params::default();
        assert_eq!(negotiate(&mut p, "InitialR2T", "No", false).unwrap(), "Yes");
        assert!(p.initial_r2t);
        assert_eq!(
            negotiate(&mut p, "ImmediateData", "No", false).unwrap(),
            "No"
        );
        assert!(!p.immediate_data);
        assert_eq!(
            negotiate(&mut p, "ImmediateData", "Yes", false).unwrap(),
            "Yes"
        );
        assert_eq!(
            negotiate(&mut p, "DataPDUInOrder", "No", false).unwrap(),
            "Yes"
        );
        assert_eq!(
            negotiate(&mut p, "ImmediateData", "Maybe", false).unwrap(),
            "Reject"
        );
    }

    #[test]
    fn list_keys_pick_the_first_supported_choice() {
        let mut p = Params::default();
        assert_eq!(
            negotiate(&mut p, "HeaderDigest", "CRC32C,None", false).unwrap(),
            "CRC32C"
        );
        assert!(p.header_digest);
        assert_eq!(
            negotiate(&mut p, "DataDigest", "FancyHash,None", false).unwrap(),
            "None"
        );
        assert!(!p.data_digest);
        assert_eq!(
            negotiate(&mut p, "DataDigest", "FancyHash", false).unwrap(),
            "Reject"
        );
    }

    #[test]
    fn declarations_discovery_and_unknown_keys() {
        let mut p = Params::default();
        assert_eq!(
            negotiate(&mut p, "MaxRecvDataSegmentLength", "65536", false).unwrap(),
            ""
        );
        assert_eq!(p.initiator_max_recv, 65536);
        assert_eq!(
            negotiate(&mut p, "MaxRecvDataSegmentLength", "16", false).unwrap(),
            "Reject"
        );
        assert_eq!(
            negotiate(&mut p, "ImmediateData", "Yes", true).unwrap(),
            "Irrelevant"
        );
        assert_eq!(negotiate(&mut p, "X-com.example.Thing", "1", false), None);
    }
}
