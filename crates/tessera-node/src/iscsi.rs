//! iSCSI on a node: the target configuration (persisted in `DATA_DIR/iscsi.json`) and the
//! live target of `tessera_iscsi` it is served through. The management operations the API
//! calls and the listener are the node's (`node/iscsi.rs`).
//!
//! Targets live in the data directory rather than in a pool's catalog because a target
//! may hold LUNs from several pools (as NVMe subsystems do, `crate::nvmf`). A LUN names
//! its volume by pool UUID and volume ID, stable for the volume's life.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tessera_io::sync::MutexExt;
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
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct IscsiFile {
    pub version: u32,
    pub targets: Vec<TargetRecord>,
}

pub struct IscsiState {
    path: PathBuf,
    file: Mutex<IscsiFile>,
    /// The live target: made here, with no LUN, so that management works whether or not
    /// the node listens for iSCSI; `node::iscsi::start` fills it from `file`.
    pub(crate) target: Arc<Target<NodeTarget>>,
    /// The portals (`HOST:PORT`) the listener serves.
    pub(crate) portals: Mutex<Vec<String>>,
}

impl IscsiState {
    pub fn load(data_dir: &Path) -> Result<IscsiState, String> {
        let path = data_dir.join("iscsi.json");
        let file = match std::fs::read_to_string(&path) {
            Ok(t) => {
                let f: IscsiFile =
                    serde_json::from_str(&t).map_err(|e| format!("{}: {e}", path.display()))?;
                if f.version != 1 {
                    return Err(format!(
                        "{}: version {} is not supported (this node reads version 1)",
                        path.display(),
                        f.version
                    ));
                }
                f
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => IscsiFile {
                version: 1,
                ..IscsiFile::default()
            },
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        Ok(IscsiState {
            path,
            file: Mutex::new(file),
            target: Target::new(),
            portals: Mutex::new(Vec::new()),
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
        // Owner only, as nvmf.json: CHAP secrets will be kept here.
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
