//! `DATA_DIR/pools.json`: which devices make which pool (see docs/format.md §5).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{SaveError, StartError};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PoolEntry {
    pub name: String,
    pub uuid: String,
    pub devices: Vec<String>,
    pub layout: String,
    pub stripe_size: u64,
    pub unit_size: u64,
    /// Hot spares of a redundant pool (device specs), absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spares: Vec<String>,
    /// The overcommit ratio set for this pool; absent: the default
    /// (`tessera_pool::DEFAULT_OVERCOMMIT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit: Option<f64>,
}

pub struct Registry {
    path: PathBuf,
}

impl Registry {
    pub fn new(data_dir: &Path) -> Registry {
        Registry {
            path: data_dir.join("pools.json"),
        }
    }

    pub fn load(&self) -> Result<Vec<PoolEntry>, StartError> {
        let bad = |e: &dyn std::fmt::Display| {
            StartError::Catalog(format!("{}: {e}", self.path.display()))
        };
        match std::fs::read_to_string(&self.path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| bad(&e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(bad(&e)),
        }
    }

    /// Replace the registry atomically.
    pub fn save(&self, entries: &[PoolEntry]) -> Result<(), SaveError> {
        let text = serde_json::to_string_pretty(entries).expect("registry serialises");
        write_atomic(&self.path, text.as_bytes())
    }
}

/// Replace the file at `path` atomically: write a temporary file, fsync, rename, fsync
/// the directory. Shared by every JSON file the node keeps in its data directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SaveError> {
    write_atomic_mode(path, bytes, 0o666)
}

/// [`write_atomic`] with the file's permission bits (before the umask): the temporary
/// file has them from its creation, before anything is written to it.
pub fn write_atomic_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), SaveError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension("json.tmp");
    let err = |source: std::io::Error| SaveError {
        path: path.to_path_buf(),
        source,
    };
    // A leftover temporary file keeps its old mode when opened: start from a new one.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(err(e)),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    if mode & 0o077 == 0 {
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(err)?;
    }
    f.write_all(bytes).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}
