//! The requests and replies of the Tessera management API (docs/api.md), as Rust types.
//!
//! The node serialises its replies from these types and deserialises request bodies into
//! them; the `tessera` CLI does the reverse. JSON field names and values are the wire
//! format: a field added here is added to the API.

pub mod cluster;
pub mod exports;
pub mod groups;
pub mod jobs;
pub mod nvmf;
pub mod pools;
pub mod snapshots;
pub mod status;
pub mod volumes;

use serde::{Deserialize, Serialize};

pub use cluster::*;
pub use exports::*;
pub use groups::*;
pub use jobs::*;
pub use nvmf::*;
pub use pools::*;
pub use snapshots::*;
pub use status::*;
pub use volumes::*;

pub use tessera_qos::{BackgroundLimits, QosLimits, StepBurst};

/// The body of every reply whose HTTP status is not 2xx.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorReply {
    pub error: String,
}

/// The reply to a DELETE that removed a named object (`T`: its name, or a namespace ID).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Deleted<T = String> {
    pub deleted: T,
}

/// A size as requests may give it: a number of bytes, or a string such as `"4G"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum SizeArg {
    Bytes(u64),
    Text(String),
}

impl SizeArg {
    /// The size as text (`"4096"` for a number): what the size parser takes.
    pub fn as_text(&self) -> String {
        match self {
            SizeArg::Bytes(n) => n.to_string(),
            SizeArg::Text(s) => s.clone(),
        }
    }
}

impl From<&str> for SizeArg {
    fn from(s: &str) -> SizeArg {
        SizeArg::Text(s.to_string())
    }
}

impl From<String> for SizeArg {
    fn from(s: String) -> SizeArg {
        SizeArg::Text(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offline_pool_reads_back_as_offline() {
        let e: PoolEntry =
            serde_json::from_str(r#"{"name": "p", "state": "offline", "error": "gone"}"#).unwrap();
        assert_eq!(e.name(), "p");
        assert!(matches!(e, PoolEntry::Offline(ref o) if o.error == "gone"));
    }

    #[test]
    fn a_healthy_device_has_no_reason_on_the_wire() {
        let d = DeviceState {
            device: "/a".into(),
            state: "online".into(),
            reason: None,
        };
        assert_eq!(
            serde_json::to_string(&d).unwrap(),
            r#"{"device":"/a","state":"online"}"#
        );
    }

    #[test]
    fn sizes_are_numbers_or_strings() {
        let v: CreateVolume =
            serde_json::from_str(r#"{"name": "v", "pool": "p", "size": 4096}"#).unwrap();
        assert_eq!(v.size, SizeArg::Bytes(4096));
        let v: CreateVolume =
            serde_json::from_str(r#"{"name": "v", "pool": "p", "size": "4G"}"#).unwrap();
        assert_eq!(v.size.as_text(), "4G");
    }

    #[test]
    fn optional_request_fields_may_be_null_or_absent() {
        let p: CreatePool = serde_json::from_str(
            r#"{"name": "p", "devices": ["ram:1G"], "copies": null, "stripe_size": null}"#,
        )
        .unwrap();
        assert_eq!(p.layout, None);
        assert!(!p.force);
        let s: ScrubRequest = serde_json::from_str("{}").unwrap();
        assert!(s.repair);
    }

    #[test]
    fn a_job_status_is_flat_on_the_wire() {
        let r = RebuildStatus {
            pool: "m".into(),
            device: 1,
            state: JOB_DONE.into(),
            started: 1,
            resumed_at_unit_count: 0,
            error: None,
            progress: JobProgress {
                elapsed_s: 1.0,
                percent: 100.0,
                units_total: 4,
                units_done: 4,
                bytes_done: 4 << 20,
                rate_mibps: 4.0,
                eta_s: None,
                background: ClassFigures {
                    class: "rebuild".into(),
                    rate_limit_bps: 1,
                    latency_target_us: 2000.0,
                    client_p99_us: None,
                    backoffs: 0,
                },
            },
        };
        let text = serde_json::to_string(&r).unwrap();
        assert!(text.contains(r#""percent":100.0"#), "{text}");
        assert!(text.contains(r#""error":null"#), "{text}");
        let back: RebuildStatus = serde_json::from_str(&text).unwrap();
        assert_eq!(back, r);
    }
}
