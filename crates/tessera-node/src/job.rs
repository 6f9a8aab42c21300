//! What every background job (scrub, rebuild) reports the same way: progress over pool
//! units, rate, ETA, and the state of its background class's feedback controller.

use std::time::Duration;

use serde_json::{json, Map, Value};

/// Run the calling background-job thread at idle CPU priority (`SCHED_IDLE`): it gets
/// only CPU time that the reactors and the clients leave. The class's bandwidth limit and
/// latency feedback bound its device load; this bounds its CPU load, which the feedback
/// cannot see (a busy CPU delays a client's next request, not the node's service time).
pub(crate) fn background_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread with a valid parameter block.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if r != 0 {
        eprintln!(
            "tessera: background job keeps normal CPU priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// A job's progress and controller figures, as its status shows them.
pub(crate) struct Figures<'a> {
    pub class: &'a str,
    pub running: bool,
    pub elapsed: Duration,
    pub bytes_done: u64,
    pub units_done: u64,
    pub units_total: u64,
    /// Units already done when this run started (a resumed job): the ETA is computed
    /// from the units this run did.
    pub counted_from: u64,
    pub rate_limit_bps: u64,
    pub target_us: f64,
    pub client_p99_us: Option<f64>,
    pub backoffs: u64,
}

impl Figures<'_> {
    /// The common status fields; a job adds its own to the returned object.
    pub fn to_json(&self) -> Map<String, Value> {
        let secs = self.elapsed.as_secs_f64();
        let rate = if secs > 0.0 {
            self.bytes_done as f64 / secs
        } else {
            0.0
        };
        let pct = if self.units_total == 0 {
            100.0
        } else {
            self.units_done as f64 * 100.0 / self.units_total as f64
        };
        let left = self.units_total.saturating_sub(self.units_done);
        let done_here = self.units_done.saturating_sub(self.counted_from);
        let eta = (done_here > 0 && self.running).then(|| secs / done_here as f64 * left as f64);
        let v = json!({
            "elapsed_s": (secs * 10.0).round() / 10.0,
            "percent": (pct * 10.0).round() / 10.0,
            "units_total": self.units_total,
            "units_done": self.units_done,
            "bytes_done": self.bytes_done,
            "rate_mibps": (rate / 1048576.0 * 10.0).round() / 10.0,
            "eta_s": eta.map(|e| e.round()),
            "background": {
                "class": self.class,
                "rate_limit_bps": self.rate_limit_bps,
                "latency_target_us": self.target_us.round(),
                "client_p99_us": self.client_p99_us.map(f64::round),
                "backoffs": self.backoffs,
            },
        });
        match v {
            Value::Object(m) => m,
            _ => unreachable!("a JSON object literal"),
        }
    }
}
