//! Fault hooks for the CLI's integration tests. Compiled only with the `test-hooks`
//! feature, which only `tessera-cli`'s dev-dependency turns on (a `cargo build` of the
//! binary has none of this); a hook is armed by a file under `DATA_DIR/test-hooks/`, so a
//! test arms it at the moment it wants, on the node it wants.

use super::Node;

impl Node {
    /// `DATA_DIR/test-hooks/snapshot-kill-after-copies` holds `k`: a snapshot create of a
    /// replicated volume takes its copies one at a time (this node's first, then the
    /// replicas in the set's order) and the node kills itself (SIGKILL) as soon as `k`
    /// replicas answered with their copy, before the others are asked and before the
    /// create is recorded complete.
    pub(super) fn hook_snapshot_kill_after(&self) -> Option<usize> {
        let p = self
            .cfg
            .data_dir
            .join("test-hooks/snapshot-kill-after-copies");
        std::fs::read_to_string(p).ok()?.trim().parse().ok()
    }
}

/// SIGKILL this process: nothing after this point runs, nothing is cleaned up.
pub(super) fn kill_self(why: &str) -> ! {
    tracing::error!(hook = why, "test hook: this node kills itself (SIGKILL)");
    // SAFETY: signalling this process; getpid cannot fail.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    loop {
        std::thread::park();
    }
}
