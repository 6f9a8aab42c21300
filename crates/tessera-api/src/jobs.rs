//! Background jobs' status: scrub, resync (a scrub in the resync class) and rebuild.

use serde::{Deserialize, Serialize};

wire_state! {
    /// A background job's state (a job starts running).
    #[derive(Default)]
    pub enum JobState {
        #[default]
        Running => "running",
        Done => "done",
        /// Stopped by a request (or the node's shutdown) before the end.
        Stopped => "stopped",
        Failed => "failed",
    }
}

/// The background class controller's view of a job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClassFigures {
    /// "scrub", "resync" or "rebuild".
    pub class: String,
    /// The rate the class's feedback allows now (bytes per second).
    pub rate_limit_bps: u64,
    pub latency_target_us: f64,
    /// Clients' p99 over the last feedback tick (absent when they were idle).
    pub client_p99_us: Option<f64>,
    /// Times the feedback lowered the rate.
    pub backoffs: u64,
}

/// Progress fields every job status has.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JobProgress {
    pub elapsed_s: f64,
    pub percent: f64,
    pub units_total: u64,
    pub units_done: u64,
    pub bytes_done: u64,
    pub rate_mibps: f64,
    /// Seconds left (absent when unknown or not running).
    pub eta_s: Option<f64>,
    pub background: ClassFigures,
}

/// A mismatched pool range a scrub found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Range {
    pub offset: u64,
    pub len: u64,
}

/// `GET /v1/pools/NAME/scrub` (and `.../resync`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ScrubStatus {
    pub pool: String,
    /// "running", "done", "stopped" or "failed".
    pub state: JobState,
    /// Unix time the job started.
    pub started: u64,
    pub repair: bool,
    pub read_errors: u64,
    pub mismatched_bytes: u64,
    pub repaired_bytes: u64,
    pub unreadable_bytes: u64,
    pub mismatched_ranges: Vec<Range>,
    pub errors: Vec<String>,
    pub metadata_findings: Vec<String>,
    /// A dedup pool's metadata check, run after the data (absent on other pools, and
    /// while the data is being scrubbed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<DedupScrubInfo>,
    #[serde(flatten)]
    pub progress: JobProgress,
}

/// What a scrub found in a dedup pool's metadata (docs/format.md §17, "Scrub").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DedupScrubInfo {
    /// Store blocks whose reference count differed from the references to them (each
    /// is also a metadata finding), and how many of those the scrub set right.
    pub count_errors: u64,
    pub counts_repaired: u64,
    /// Fingerprint index buckets and entries read back.
    pub index_buckets_checked: u64,
    pub index_entries_checked: u64,
    /// Entries naming a block that is free or holds other bytes now (an overwrite in
    /// place leaves its block's old entry behind). Harmless: every candidate is compared
    /// before it is shared; a repairing scrub removes them.
    pub stale_index_entries: u64,
    pub index_entries_removed: u64,
}

/// `GET /v1/pools/NAME/rebuild`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RebuildStatus {
    pub pool: String,
    pub device: usize,
    /// "running", "done", "stopped" or "failed".
    pub state: JobState,
    pub started: u64,
    /// Units already rebuilt when this run resumed.
    pub resumed_at_unit_count: u64,
    pub error: Option<String>,
    #[serde(flatten)]
    pub progress: JobProgress,
}

/// A job's states, by their former names.
pub const JOB_RUNNING: JobState = JobState::Running;
pub const JOB_DONE: JobState = JobState::Done;
