//! `tessera-cli`'s end-to-end tests: each module starts real nodes from the release
//! binary (`CARGO_BIN_EXE_tessera`) and drives them as a user does, through the CLI, the
//! API and real clients (fio, qemu-io, nbdinfo, libiscsi's tools, the kernel's
//! initiators). The tests that measure rates are in `tests/measured`, one at a time.
//!
//! One binary for all of them, one module per subject: every test binary costs CI a
//! link with thin LTO (about 20 s on 2 cores), which 38 binaries made 13 minutes.
//! `cargo test --release -p tessera-cli --test cli crash_kill9` runs one module.

mod api_security;
mod cache_tier;
mod cli_consistency;
mod cluster;
mod common;
mod crash_kill9;
mod dedup;
mod etcd_tls;
mod exclusive_ownership;
mod failover;
mod fencing;
mod hot_spare;
mod interop_clients;
mod iscsi;
mod iscsi_alua;
mod iscsi_config;
mod log_limits;
mod metrics_prometheus;
mod nbd_tls;
mod nvmf_ana;
mod nvmf_auth;
mod proxy;
mod raid_parity;
mod raid_rebuild;
mod remote_device;
mod replication;
mod resource_limits;
mod restart_after_crash;
mod restart_persistence;
mod scrub_resync;
mod smoke;
mod snapshot_backup;
mod snapshot_kill9;
mod snapshots;
mod thin_map;
