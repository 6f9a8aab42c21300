//! Load generators for Tessera, behind the `tessera` binary's `bench`, `nbd-perf` and
//! `nvmf perf` subcommands.
//!
//! - [`nbd_perf`] and [`nvmf_perf`] are pipelined network clients that measure a server,
//!   not themselves. Both run on the same connection loop ([`conn`]: queue-depth window,
//!   request generation, non-blocking batched sends, bulk parsing, latency histogram,
//!   time bound, totals); each adds only its wire format as a [`conn::Protocol`].
//! - [`bench`] drives a device, pool or volume in-process from reactor cores.
//! - [`error`]: [`LoadError`], what every run returns when it fails.

pub mod bench;
pub mod conn;
pub mod error;
pub mod nbd_perf;
pub mod nvmf_perf;
mod report;
pub mod workload;
pub use error::LoadError;
