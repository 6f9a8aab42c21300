//! `DATA_DIR/pools.json`: which devices make which pool (see docs/format.md §5).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, SaveError, StartError};

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
    /// The pool's cache tier (device specs), absent when none (docs/format.md §16).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache: Vec<String>,
    /// The cache's mode; absent: write-through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_mode: Option<String>,
    /// The cache unit in bytes; absent: 1 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_unit: Option<u64>,
    /// Misses a unit needs before the full cache admits it; absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_admit_hits: Option<u8>,
    /// The pool deduplicates (its catalog says so too; the registry needs it to recreate
    /// a pool on volatile devices as it was).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dedup: bool,
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
        load_json(&self.path).map_err(StartError::Catalog)
    }

    /// Replace the registry atomically.
    pub fn save(&self, entries: &[PoolEntry]) -> Result<(), SaveError> {
        let text = serde_json::to_string_pretty(entries).expect("registry serialises");
        write_atomic(&self.path, text.as_bytes())
    }
}

/// Read a JSON file of the data directory (pools.json, groups.json, background.json...):
/// a missing file is `T::default()`; the errors name the file (an unreadable file is
/// `Error::Io` with its cause, one that does not decode `Error::Corrupt`).
pub fn load_json<T: DeserializeOwned + Default>(path: &Path) -> Result<T, Error> {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            serde_json::from_str(&t).map_err(|e| Error::Corrupt(format!("{}: {e}", path.display())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(Error::io(&path.display().to_string(), e)),
    }
}

/// Read a versioned JSON file of the data directory (nvmf.json, iscsi.json): a JSON
/// object whose `version` must be `supported`. A missing file is `T::default()`, which
/// must therefore be the empty file of the current version. The errors name the file.
pub fn load_versioned<T: DeserializeOwned + Default>(
    path: &Path,
    supported: u32,
) -> Result<T, Error> {
    let Some(value) = load_json::<Option<serde_json::Value>>(path)? else {
        return Ok(T::default());
    };
    let bad = |e: &dyn std::fmt::Display| Error::Corrupt(format!("{}: {e}", path.display()));
    // The version first: a newer file need not have this version's shape, and its
    // operator needs to hear that it is newer rather than which field is missing.
    if let Some(v) = value.get("version").and_then(serde_json::Value::as_u64) {
        if v != u64::from(supported) {
            return Err(Error::invalid(format!(
                "{}: version {v} is not supported (this node reads version {supported})",
                path.display()
            )));
        }
    }
    serde_json::from_value(value).map_err(|e| bad(&e))
}

/// Make directory `dir` if it is missing, durably: its entry in the parent directory is
/// fsynced, so a file later written into it (and fsynced there) cannot vanish with the
/// directory after a power loss.
pub fn create_dir_durable(dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    if let Some(parent) = dir.parent() {
        std::fs::File::open(parent)?.sync_all()?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_durable_directory_is_made_once_and_a_file_in_the_way_is_an_error() {
        let base = std::env::temp_dir().join(format!("tessera-dir-durable-{}", std::process::id()));
        let dir = base.join("iscsi-pr");
        create_dir_durable(&dir).unwrap();
        assert!(dir.is_dir());
        write_atomic_mode(&dir.join("a.tpr"), b"x", 0o600).unwrap();
        // Again: nothing changes, what is in it stays.
        create_dir_durable(&dir).unwrap();
        assert_eq!(std::fs::read(dir.join("a.tpr")).unwrap(), b"x");
        // A file where the directory should be.
        let blocked = base.join("blocked");
        std::fs::write(&blocked, b"").unwrap();
        assert!(create_dir_durable(&blocked).is_err());
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_json_file_missing_is_empty_garbled_is_corrupt_unreadable_is_io() {
        let dir = std::env::temp_dir().join(format!("tessera-load-json-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("groups.json");
        let m: std::collections::BTreeMap<String, u32> = load_json(&path).unwrap();
        assert!(m.is_empty());
        std::fs::write(&path, "{\"a\": 1").unwrap();
        let e = load_json::<std::collections::BTreeMap<String, u32>>(&path).unwrap_err();
        assert!(matches!(e, Error::Corrupt(_)), "{e:?}");
        assert!(e.to_string().contains("groups.json"), "{e}");
        // A directory where the file should be: read_to_string fails, the cause kept.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = load_json::<std::collections::BTreeMap<String, u32>>(&path).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e:?}");
        assert!(std::error::Error::source(&e).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct File {
        version: u32,
        items: Vec<String>,
    }

    impl Default for File {
        fn default() -> File {
            File {
                version: 3,
                items: Vec::new(),
            }
        }
    }

    #[test]
    fn load_versioned_reads_checks_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.json");
        let f: File = load_versioned(&path, 3).unwrap();
        assert_eq!(f, File::default(), "a missing file is the empty one");
        std::fs::write(&path, r#"{"version": 3, "items": ["a"]}"#).unwrap();
        let f: File = load_versioned(&path, 3).unwrap();
        assert_eq!(f.items, vec!["a".to_string()]);
        std::fs::write(&path, r#"{"version": 4, "other": 1}"#).unwrap();
        let e = load_versioned::<File>(&path, 3).unwrap_err().to_string();
        assert!(
            e.contains("x.json") && e.contains("version 4 is not supported"),
            "{e}"
        );
        assert!(e.contains("this node reads version 3"), "{e}");
        std::fs::write(&path, "{not json").unwrap();
        let e = load_versioned::<File>(&path, 3).unwrap_err().to_string();
        assert!(e.starts_with(&path.display().to_string()), "{e}");
        std::fs::write(&path, r#"{"items": []}"#).unwrap();
        let e = load_versioned::<File>(&path, 3).unwrap_err().to_string();
        assert!(e.contains("version"), "{e}");
    }
}
