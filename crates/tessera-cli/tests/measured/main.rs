//! `tessera-cli`'s end-to-end tests that measure rates or latencies (QoS limits and
//! shares, congestion control, the NBD and NVMe/TCP data paths, `tessera bench`, what a
//! client keeps during a scrub, a full pool's neighbour's throughput). Each
//! takes [`alone`] first, so they run one at a time and no other test shares the
//! machine's cores with them; the other end-to-end tests are in `tests/cli`, whose
//! harness they share.

use std::sync::{Mutex, MutexGuard};

use tessera_io::sync::MutexExt;

#[path = "../cli/common/mod.rs"]
mod common;

static ALONE: Mutex<()> = Mutex::new(());

/// Held for the whole of a measuring test: the next one starts when it ends.
fn alone() -> MutexGuard<'static, ()> {
    ALONE.locked()
}

mod bench_cli;
mod enospc_isolation;
mod nbd_perf;
mod nvmf_perf;
mod qos_limits;
mod qos_shares_groups;
mod remote_congestion;
mod scrub_background;
