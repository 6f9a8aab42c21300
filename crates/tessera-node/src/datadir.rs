//! One node per data directory: `DATA_DIR/.lock` is held with an exclusive `flock` for the
//! node's whole life, taken before anything else is opened (docs/architecture.md
//! "Exclusive ownership"). The file says who holds it, for the error a second node prints.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::config::NodeConfig;
use crate::error::StartError;

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = ".lock";

/// The data directory's lock, held while this value lives (the kernel drops it when the
/// process ends, however it ends). The file itself is never removed: unlinking a lock file
/// lets a second process lock a fresh inode while the first still holds the old one.
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    pub path: PathBuf,
}

impl DataDirLock {
    /// Create the data directory if needed and lock it, or say which node holds it. A
    /// node that loses the race changes nothing: the file is only written by its holder.
    pub fn acquire(cfg: &NodeConfig) -> Result<DataDirLock, StartError> {
        let dir = &cfg.data_dir;
        std::fs::create_dir_all(dir).map_err(|source| StartError::DataDir {
            path: dir.clone(),
            source,
        })?;
        let path = dir.join(LOCK_FILE);
        let lock_err = |e: io::Error| StartError::DataDir {
            path: path.clone(),
            source: e,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(lock_err)?;
        // SAFETY: flock on the fd of `file`, which lives across the call.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(lock_err(e));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            return Err(StartError::Locked {
                dir: absolute(dir),
                holder: describe_holder(&holder),
            });
        }
        let owner = format!(
            "pid {}\nhost {}\napi {}\n",
            std::process::id(),
            hostname(),
            absolute(&cfg.api_socket()).display()
        );
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(owner.as_bytes()))
            .and_then(|()| file.sync_data())
            .map_err(lock_err)?;
        Ok(DataDirLock { _file: file, path })
    }
}

/// "pid 1234 on host h, API /x/api.sock" from the lock file's `key value` lines.
fn describe_holder(text: &str) -> String {
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(' '))
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    match field("pid") {
        Some(pid) => {
            let mut s = format!("pid {pid}");
            if let Some(h) = field("host") {
                s += &format!(" on host {h}");
            }
            if let Some(a) = field("api") {
                s += &format!(", API unix:{a}");
            }
            s
        }
        // The holder has locked the file and not written it yet.
        None => "a process that is starting".into(),
    }
}

fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf.
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_names_the_holder_and_leaves_the_file_alone() {
        let dir = std::env::temp_dir().join(format!("tessera-datadir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = NodeConfig {
            data_dir: dir.clone(),
            ..NodeConfig::default()
        };
        let held = DataDirLock::acquire(&cfg).unwrap();
        let before = std::fs::read_to_string(&held.path).unwrap();
        assert!(
            before.starts_with(&format!("pid {}\n", std::process::id())),
            "{before}"
        );
        let err = DataDirLock::acquire(&cfg).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        assert!(err.contains(&dir.display().to_string()), "{err}");
        assert_eq!(std::fs::read_to_string(&held.path).unwrap(), before);
        drop(held);
        let again = DataDirLock::acquire(&cfg).unwrap();
        drop(again);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
