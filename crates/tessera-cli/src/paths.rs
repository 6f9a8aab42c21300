//! Where a node keeps its data and its API socket by default: one absolute place per user,
//! so `tessera up` and every later `tessera ...` agree from any working directory.

use std::path::{Path, PathBuf};

/// The default data directory of `tessera up`: `/var/lib/tessera` for root (where the
/// systemd unit's configuration puts it too), else `$XDG_DATA_HOME/tessera`
/// (`~/.local/share/tessera`).
pub fn default_data_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/tessera");
    }
    let absolute_var = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(d) = absolute_var("XDG_DATA_HOME") {
        return d.join("tessera");
    }
    if let Some(h) = absolute_var("HOME") {
        return h.join(".local/share/tessera");
    }
    // SAFETY: as above.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("tessera-{uid}"))
}

/// The API socket of a node started on `data_dir` without `[api] socket`.
pub fn api_socket_in(data_dir: &Path) -> PathBuf {
    data_dir.join("api.sock")
}

/// The management API the CLI talks to without `--api`: `$TESSERA_API` if set, else the
/// socket in the default data directory.
pub fn default_api() -> String {
    std::env::var("TESSERA_API")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("unix:{}", api_socket_in(&default_data_dir()).display()))
}

/// `p` made absolute against the working directory (not resolving links), so what the
/// node prints can be pasted from anywhere.
pub fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_places_are_absolute() {
        assert!(default_data_dir().is_absolute());
        let api = default_api();
        if std::env::var_os("TESSERA_API").is_none() {
            let path = api.strip_prefix("unix:").expect("a unix socket");
            assert!(Path::new(path).is_absolute(), "{api}");
            assert!(path.ends_with("/api.sock"), "{api}");
        }
    }
}
