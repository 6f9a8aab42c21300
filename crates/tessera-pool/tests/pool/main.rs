//! `tessera-pool`'s integration tests: pools on files, RAM and fault devices, driven
//! in process through the public API: crash consistency under the power-loss model,
//! the model checker, RAID rebuilds and scrub, snapshots, the cache tier. The unit tests
//! are beside the code, in `src/`.
//!
//! One binary, one module per subject: every test binary costs CI a link with thin LTO.
//! `cargo test --release -p tessera-pool --test pool model_check` runs one module.

mod cache_tier;
mod cache_write_back;
mod common;
mod crash_consistency;
mod dedup;
mod dedup_chains;
mod inflight;
mod mirror_rebuild_free;
mod model_check;
mod parity_free_units;
mod parity_rebuild_free;
mod raid_mirror;
mod raid_parity;
mod raid_rebuild;
mod readahead;
mod scrub_repair;
mod snapshots;
mod thin_model;
mod zeroed_units;
