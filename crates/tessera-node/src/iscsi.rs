//! iSCSI on a node: the target configuration (persisted in `DATA_DIR/iscsi.json`) and the
//! live target of `tessera_iscsi` it is served through. The management operations the API
//! calls and the listener are the node's (`node/iscsi.rs`).
//!
//! Targets live in the data directory rather than in a pool's catalog because a target
//! may hold LUNs from several pools (as NVMe subsystems do, `crate::nvmf`). A LUN names
//! its volume by pool UUID and volume ID, stable for the volume's life.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tessera_api::IscsiChap;
use tessera_io::sync::MutexExt;
use tessera_iscsi::alua::Alua;
use tessera_iscsi::auth::{Access, Chap, Credentials};
use tessera_iscsi::target::Target;

use crate::error::Error;
use crate::target::NodeTarget;

pub use crate::config::IscsiConfig;

/// LUN `lun` of a target.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct LunRecord {
    pub lun: u32,
    /// Volume name at the time it was added (for people; lookups use the IDs).
    pub volume: String,
    pub pool_uuid: String,
    pub volume_id: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TargetRecord {
    pub iqn: String,
    /// In LUN order (LUN `i` is `luns[i]`).
    pub luns: Vec<LunRecord>,
    /// Initiator names allowed to log in; empty: any initiator.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_initiators: Vec<String>,
    /// CHAP the initiators must pass; absent: none. Kept as the API gives it (the one
    /// definition of a target's CHAP settings, whose `Debug` redacts the secrets); the
    /// file is mode 0600, as nvmf.json with its DH-HMAC-CHAP secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap: Option<IscsiChap>,
}

impl TargetRecord {
    /// Who may log in, as the target crate checks it.
    pub fn access(&self) -> Access {
        Access {
            allowed_initiators: self.allowed_initiators.clone(),
            chap: self.chap.as_ref().map(|c| Chap {
                initiator: Credentials {
                    user: c.user.clone(),
                    secret: c.secret.as_bytes().to_vec(),
                },
                mutual: c
                    .mutual_user
                    .as_ref()
                    .zip(c.mutual_secret.as_ref())
                    .map(|(u, s)| Credentials {
                        user: u.clone(),
                        secret: s.as_bytes().to_vec(),
                    }),
            }),
        }
    }
}

/// The version of iscsi.json this node reads and writes.
pub const ISCSI_VERSION: u32 = 1;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IscsiFile {
    pub version: u32,
    pub targets: Vec<TargetRecord>,
}

/// The file of a node that has none yet: empty, of the current version.
impl Default for IscsiFile {
    fn default() -> IscsiFile {
        IscsiFile {
            version: ISCSI_VERSION,
            targets: Vec::new(),
        }
    }
}

pub struct IscsiState {
    path: PathBuf,
    file: Mutex<IscsiFile>,
    /// The live target: made here, with no LUN, so that management works whether or not
    /// the node listens for iSCSI; `node::iscsi::start` fills it from `file`.
    pub(crate) target: Arc<Target<NodeTarget>>,
    /// The portals (`HOST:PORT`) the listener serves.
    pub(crate) portals: Mutex<Vec<String>>,
    /// `DATA_DIR/iscsi-pr`: each LUN's persistent reservation state, saved while its
    /// last REGISTER set APTPL (`POOL_UUID-VOLUME_ID.tpr`, the crate's versioned form).
    pub(crate) pr_dir: PathBuf,
    /// The ALUA state of each cluster volume's target on this node, by volume name
    /// (`node::iscsi`, "cluster paths"): in memory only, the cluster declares them again
    /// after a restart.
    pub(crate) cluster: Mutex<BTreeMap<String, Arc<Alua<NodeTarget>>>>,
}

/// The prefix of the targets the cluster serves (one per cluster volume, on every node
/// that holds a replica); a user's target cannot take a name under it.
pub const CLUSTER_IQN_PREFIX: &str = "iqn.2026-11.io.tessera:cluster:";

/// The target of cluster volume `volume`, the same on every node (as its NVMe/TCP
/// subsystem, `nqn.2026-11.io.tessera:cluster:VOLUME`).
pub fn cluster_iqn(volume: &str) -> String {
    format!("{CLUSTER_IQN_PREFIX}{volume}")
}

impl IscsiState {
    pub fn load(data_dir: &Path) -> Result<IscsiState, Error> {
        let path = data_dir.join("iscsi.json");
        let file: IscsiFile = crate::registry::load_versioned(&path, ISCSI_VERSION)?;
        Ok(IscsiState {
            path,
            file: Mutex::new(file),
            target: Target::new(),
            portals: Mutex::new(Vec::new()),
            pr_dir: data_dir.join("iscsi-pr"),
            cluster: Mutex::new(BTreeMap::new()),
        })
    }

    pub(crate) fn file(&self) -> std::sync::MutexGuard<'_, IscsiFile> {
        self.file.locked()
    }

    /// Apply `change` to a copy, persist it atomically, then make it live.
    pub(crate) fn update<T>(
        &self,
        change: impl FnOnce(&mut IscsiFile) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut f = self.file();
        let mut next = f.clone();
        let r = change(&mut next)?;
        let text = serde_json::to_string_pretty(&next).expect("iscsi config serialises");
        // Owner only, as nvmf.json: the targets' CHAP secrets are kept here.
        crate::registry::write_atomic_mode(&self.path, text.as_bytes(), 0o600)?;
        *f = next;
        Ok(r)
    }

    /// The target that serves volume `pool_uuid`/`id` as a LUN, if any.
    pub fn target_using(&self, pool_uuid: &str, id: u32) -> Option<String> {
        self.file()
            .targets
            .iter()
            .find(|t| {
                t.luns
                    .iter()
                    .any(|l| l.pool_uuid == pool_uuid && l.volume_id == id)
            })
            .map(|t| t.iqn.clone())
    }

    pub fn target(&self) -> &Arc<Target<NodeTarget>> {
        &self.target
    }

    pub fn portals(&self) -> Vec<String> {
        self.portals.locked().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> TargetRecord {
        TargetRecord {
            iqn: "iqn.2026-11.io.tessera:db".into(),
            luns: Vec::new(),
            allowed_initiators: vec!["iqn.2026-11.io.example:host1".into()],
            chap: Some(IscsiChap {
                user: "alice".into(),
                secret: "initiator-secret-1".into(),
                mutual_user: Some("tessera".into()),
                mutual_secret: Some("target-secret-22".into()),
            }),
        }
    }

    #[test]
    fn records_debug_without_secrets() {
        let s = format!("{:?}", record());
        assert!(s.contains("alice") && s.contains("tessera"), "{s}");
        assert!(
            !s.contains("initiator-secret") && !s.contains("target-secret"),
            "{s}"
        );
    }

    #[test]
    fn chap_is_written_to_iscsi_json_with_the_same_keys_as_before() {
        // The record's CHAP is the API's `IscsiChap` now; the file keeps the names and
        // the skipped absent fields of the node's former record type.
        let mut r = record();
        r.allowed_initiators.clear();
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"iqn":"iqn.2026-11.io.tessera:db","luns":[],"chap":{"user":"alice","secret":"initiator-secret-1","mutual_user":"tessera","mutual_secret":"target-secret-22"}}"#
        );
        let one_way = r#"{"iqn":"iqn.2026-11.io.tessera:db","luns":[],"chap":{"user":"alice","secret":"initiator-secret-1"}}"#;
        let back: TargetRecord = serde_json::from_str(one_way).unwrap();
        assert_eq!(back.chap.as_ref().unwrap().mutual_user, None);
        assert_eq!(serde_json::to_string(&back).unwrap(), one_way);
    }

    #[test]
    fn access_carries_both_secrets_to_the_target() {
        let a = record().access();
        assert_eq!(a.check(), Ok(()));
        let c = a.chap.unwrap();
        assert_eq!(c.initiator.secret, b"initiator-secret-1");
        assert_eq!(c.mutual.unwrap().secret, b"target-secret-22");
        assert!(a
            .allowed_initiators
            .contains(&"iqn.2026-11.io.example:host1".into()));
    }

    #[test]
    fn the_file_is_owner_only_and_reloads() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let s = IscsiState::load(dir.path()).unwrap();
        assert_eq!(s.file().version, ISCSI_VERSION);
        s.update(|f| {
            f.targets.push(record());
            Ok(())
        })
        .unwrap();
        let path = dir.path().join("iscsi.json");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = IscsiState::load(dir.path()).unwrap();
        assert_eq!(again.file().targets, vec![record()]);
        std::fs::write(&path, r#"{"version": 2, "targets": []}"#).unwrap();
        let e = IscsiState::load(dir.path()).err().unwrap().to_string();
        assert!(e.contains("iscsi.json: version 2 is not supported"), "{e}");
    }
}
