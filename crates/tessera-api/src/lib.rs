//! The requests and replies of the Tessera management API (docs/api.md), as Rust types.
//!
//! The node serialises its replies from these types and deserialises request bodies into
//! them; the `tessera` CLI does the reverse. JSON field names and values are the wire
//! format: a field added here is added to the API.

pub mod exports;
pub mod groups;
pub mod jobs;
pub mod nvmf;
pub mod pools;
pub mod status;
pub mod volumes;

use serde::{Deserialize, Serialize};

pub use exports::*;
pub use groups::*;
pub use jobs::*;
pub use nvmf::*;
pub use pools::*;
pub use status::*;
pub use volumes::*;

pub use tessera_qos::{BackgroundLimits, QosLimits, StepBurst};

/// The body of every reply whose HTTP status is not 2xx.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    pub error: String,
}

/// The reply to a DELETE that removed a named object (`T`: its name, or a namespace ID).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deleted<T = String> {
    pub deleted: T,
}

/// A size as requests may give it: a number of bytes, or a string such as `"4G"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
