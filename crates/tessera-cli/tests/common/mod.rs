//! Test harness: the shared one of `tessera-testkit`, bound to this crate's `tessera`
//! binary.

#![allow(dead_code, unused_imports)]

pub use tessera_testkit::data::*;
pub use tessera_testkit::node::{
    cli_stdout, free_port, path_str, require_tool, result_fields, run_ok, temp_dir, Binary,
    PerfResult,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// The `tessera` binary cargo built for these tests.
pub struct Tessera;

impl Binary for Tessera {
    const PATH: &'static str = BIN;
}

pub type TestNode = tessera_testkit::node::TestNode<Tessera>;

/// Run `tessera nbd-perf` against `uri` (4 KiB requests over the first 64 MiB unless
/// `extra` says otherwise) and parse its RESULT line; `extra` adds arguments. Fails the
/// test on any I/O error.
pub fn nbd_perf(uri: &str, pattern: &str, qd: u32, secs: u64, extra: &[&str]) -> PerfResult {
    tessera_testkit::node::nbd_perf::<Tessera>(uri, pattern, qd, secs, extra)
}
