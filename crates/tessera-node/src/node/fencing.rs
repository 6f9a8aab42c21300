//! Fencing of replicas (issue 13): a node holding another node's replica persists the
//! highest ownership epoch it has seen for it (`DATA_DIR/fences.json`, docs/format.md
//! §13) and takes writes only from that epoch's owner.
//!
//! A claim (`POST /v1/replicas/{volume}/claim`, by a new owner after a failover, or by the
//! owner confirming its epoch) at epoch E by owner O:
//! 1. is refused if E is below the recorded epoch, or equal to it with another owner;
//! 2. records (O, E) durably before anything else changes (a crash after the claim was
//!    answered cannot forget it);
//! 3. restricts the replica's NVMe/TCP subsystem to O's host NQN, so no other host can
//!    connect (Connect answers "invalid host");
//! 4. ends the controllers of every other host (their queues stop taking I/O commands at
//!    once) and waits until their queues are gone, i.e. until none of their writes is in
//!    flight; only then is the claim answered.
//!
//! So after a claim at E returns, nothing an owner of an older epoch sends reaches the
//! replica. A node that owns a volume again later (E3 after losing it at E2) closes its
//! stale replicated volume before it claims: one process never holds two epochs of a
//! volume, so the host NQN (one per node) is enough to tell owners apart.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_api::ReplicaFence;
use tracing::{info, warn};

use super::{Error, Node, Result};

/// The host NQN a node connects to replicas with.
pub fn host_nqn(node: &str) -> String {
    format!("nqn.2026-11.io.tessera:node:{node}")
}

/// How long a claim waits for the evicted controllers' I/O to end.
const EVICT_WAIT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
struct FenceFile {
    /// By replica volume name.
    replicas: BTreeMap<String, Fence>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Fence {
    owner: String,
    epoch: u64,
}

impl Node {
    fn fences_path(&self) -> PathBuf {
        self.cfg.data_dir.join("fences.json")
    }

    fn load_fences(&self) -> Result<FenceFile> {
        match std::fs::read_to_string(self.fences_path()) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| Error::Corrupt(format!("{}: {e}", self.fences_path().display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FenceFile::default()),
            Err(e) => Err(Error::io(&self.fences_path().display().to_string(), e)),
        }
    }

    /// The recorded owner and epoch of replica `volume`, if it was ever claimed.
    pub fn replica_fence(&self, volume: &str) -> Result<Option<(String, u64)>> {
        Ok(self
            .load_fences()?
            .replicas
            .get(volume)
            .map(|f| (f.owner.clone(), f.epoch)))
    }

    /// Peer side of `POST /v1/replicas/{volume}/claim`.
    pub fn claim_replica(&self, volume: &str, owner: &str, epoch: u64) -> Result<ReplicaFence> {
        let _g = self.admin();
        self.claim_replica_locked(volume, owner, epoch)
    }

    /// [`Node::claim_replica`] under the caller's admin lock.
    pub(super) fn claim_replica_locked(
        &self,
        volume: &str,
        owner: &str,
        epoch: u64,
    ) -> Result<ReplicaFence> {
        if epoch == 0 {
            return Err(Error::invalid("epochs start at 1"));
        }
        let nqn = self
            .nvmf_list()
            .into_iter()
            .find(|s| {
                s.nqn.starts_with("nqn.2026-11.io.tessera:replica:")
                    && s.namespaces.iter().any(|n| n.volume == volume)
            })
            .map(|s| s.nqn)
            .ok_or_else(|| {
                Error::not_found(format!("this node holds no replica volume '{volume}'"))
            })?;
        let mut file = self.load_fences()?;
        if let Some(f) = file.replicas.get(volume) {
            if epoch < f.epoch || (epoch == f.epoch && f.owner != owner) {
                warn!(volume = %volume, owner = %owner, epoch, fence_owner = %f.owner,
                      fence_epoch = f.epoch, "replica claim refused: fenced");
                return Err(Error::busy(format!(
                    "replica '{volume}' is fenced at epoch {} (owner '{}'): a claim by '{owner}' \
                     at epoch {epoch} is refused",
                    f.epoch, f.owner
                )));
            }
        }
        // 2. Durable first.
        file.replicas.insert(
            volume.to_string(),
            Fence {
                owner: owner.to_string(),
                epoch,
            },
        );
        let text = serde_json::to_string_pretty(&file).expect("fences serialise");
        crate::registry::write_atomic(&self.fences_path(), text.as_bytes())?;
        // 3. Only the owner's host may connect from now on.
        let host = host_nqn(owner);
        self.nvmf.update(|f| {
            if let Some(s) = f.subsystems.iter_mut().find(|s| s.nqn == nqn) {
                s.allow_any_host = false;
                s.hosts = vec![host.clone()];
            }
            Ok(())
        })?;
        // 4. End the others' controllers and wait for their I/O.
        let evicted = match self.nvmf.target() {
            Some(t) => t.evict(
                &nqn,
                |h| h == host,
                &format!("fenced: '{owner}' owns the volume at epoch {epoch}"),
            ),
            None => Vec::new(),
        };
        let deadline = Instant::now() + EVICT_WAIT;
        while evicted.iter().any(|c| c.live_queues() > 0) {
            if Instant::now() >= deadline {
                return Err(Error::busy(format!(
                    "replica '{volume}': the fenced-off controllers still have I/O in flight \
                     after {EVICT_WAIT:?}; claim again"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        info!(volume = %volume, owner = %owner, epoch, evicted = evicted.len(),
              "replica claimed: older owners fenced off");
        Ok(ReplicaFence {
            volume: volume.to_string(),
            owner: owner.to_string(),
            epoch,
            evicted: evicted.len(),
            spec: Some(format!("nvme-tcp://{}/{nqn}?nsid=1", self.cfg.nvmf.listen)),
        })
    }
}
