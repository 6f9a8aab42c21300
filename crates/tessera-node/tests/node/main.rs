//! `tessera-node`'s integration tests: nodes started in this process, their services
//! called as the API routers call them, NBD on 127.0.0.1 (see `common`). What a user
//! types stays tested end to end in `crates/tessera-cli/tests`.
//!
//! One binary, one module per subject: every test binary costs CI a link with thin LTO.
//! `cargo test --release -p tessera-node --test node hot_spare` runs one module.

mod cache_tier;
mod common;
mod dedup;
mod hot_spare;
mod interop_clients;
mod iscsi;
mod iscsi_config;
mod iscsi_reservations;
mod malformed_input;
mod nbd_unaligned;
mod nvmf_auth;
mod nvmf_interop;
mod raid_mirror;
mod raid_parity;
mod raid_rebuild;
mod restart_persistence;
mod scrub_background;
mod scrub_mirror_repair;
mod snapshot_rollback;
mod snapshots;
mod thin_map;
mod volume_stats;
