//! The requests and replies of the Tessera management API (docs/api.md), as Rust types.
//!
//! The node serialises its replies from these types and deserialises request bodies into
//! them; the `tessera` CLI does the reverse. JSON field names and values are the wire
//! format: a field added here is added to the API.

/// A state sent as a lowercase string: the enum, its serde names (`rename_all`), its
/// `as_str` and `Display` (the same strings), for a status field of the API.
macro_rules! wire_state {
    ($(#[$m:meta])* pub enum $name:ident { $($(#[$vm:meta])* $v:ident => $s:tt,)+ }) => {
        $(#[$m])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash,
            serde::Serialize, serde::Deserialize, utoipa::ToSchema,
        )]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $v,)+
        }

        impl $name {
            /// The state as the API writes it.
            pub fn as_str(&self) -> &'static str {
                match self {
                    $($name::$v => $s,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub mod cluster;
pub mod exports;
pub mod groups;
pub mod invalid;
pub mod iscsi;
pub mod jobs;
pub mod layout;
pub mod nvmf;
pub mod pools;
pub mod qos;
pub mod snapshots;
pub mod status;
pub mod volumes;

use serde::{Deserialize, Serialize};

pub use cluster::*;
pub use exports::*;
pub use groups::*;
pub use invalid::Invalid;
pub use iscsi::*;
pub use jobs::*;
pub use layout::LayoutSpec;
pub use nvmf::*;
pub use pools::*;
pub use snapshots::*;
pub use status::*;
pub use volumes::*;

pub use qos::{BackgroundLimits, QosLimits, StepBurst};

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
            state: DeviceHealth::Online,
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
            state: JOB_DONE,
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

    #[test]
    fn states_are_the_same_strings_on_the_wire() {
        fn json<T: Serialize>(v: &T) -> String {
            serde_json::to_string(v).unwrap()
        }
        assert_eq!(json(&PoolState::Degraded), r#""degraded""#);
        assert_eq!(json(&PoolState::Offline), r#""offline""#);
        assert_eq!(json(&DeviceHealth::Rebuilding), r#""rebuilding""#);
        assert_eq!(json(&JobState::Stopped), r#""stopped""#);
        assert_eq!(json(&ReplicaState::InSync), r#""in_sync""#);
        assert_eq!(ReplicaState::InSync.to_string(), "in_sync");
        let r: ReplicaState = serde_json::from_str(r#""resyncing""#).unwrap();
        assert_eq!(r, ReplicaState::Resyncing);
        assert!(serde_json::from_str::<PoolState>(r#""Online""#).is_err());
    }

    #[test]
    fn the_openapi_enums_are_the_wire_strings() {
        fn listed<T: utoipa::PartialSchema>() -> serde_json::Value {
            serde_json::to_value(T::schema()).unwrap()["enum"].clone()
        }
        let strings = |v: &[&str]| serde_json::json!(v);
        assert_eq!(
            listed::<PoolState>(),
            strings(&["online", "degraded", "rebuilding", "failed", "offline"])
        );
        assert_eq!(
            listed::<DeviceHealth>(),
            strings(&["online", "failed", "rebuilding"])
        );
        assert_eq!(
            listed::<JobState>(),
            strings(&["running", "done", "stopped", "failed"])
        );
        assert_eq!(
            listed::<ReplicaState>(),
            strings(&["in_sync", "degraded", "resyncing", "failed"])
        );
    }

    #[test]
    fn a_replacement_state_is_its_sentence() {
        for s in [
            ReplaceState::Rebuilding,
            ReplaceState::Recorded {
                why: "no slot (x)".into(),
            },
            ReplaceState::RebuildNotStarted {
                error: "busy".into(),
            },
        ] {
            let text = serde_json::to_string(&s).unwrap();
            assert_eq!(text, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<ReplaceState>(&text).unwrap(), s);
        }
        assert_eq!(
            ReplaceState::Recorded { why: "w".into() }.to_string(),
            "recorded (w): restart the node; the rebuild onto the new device then starts by itself"
        );
    }
}
