//! The iSCSI target: the named targets it serves (each a list of LUNs, LUN `i` being
//! the `i`th export), the portals it reports to SendTargets, and session handles. The
//! listener is [`crate::accept`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tessera_export::{Export, ExportTarget};
use tessera_io::sync::RwLockExt;
use thiserror::Error;

use crate::alua::Alua;
use crate::auth::{Access, AccessError};
use crate::login::PORTAL_GROUP_TAG;
use crate::lu::LuShared;
use crate::text::valid_name;

/// LUNs per target (single-level LUN addressing as this target encodes it).
pub const MAX_LUNS: usize = 256;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum Error {
    /// Not an iSCSI name (RFC 7143 §4.2.7: `iqn.`, `eui.` or `naa.`, at most 223 bytes).
    #[error("{0:?} is not an iSCSI name (iqn., eui. or naa., at most 223 bytes, no spaces)")]
    InvalidName(String),
    #[error("target {0} already exists")]
    Exists(String),
    #[error("target {0} has no LUN")]
    NoLuns(String),
    #[error("target {name} has {count} LUNs; at most {MAX_LUNS}")]
    TooManyLuns { name: String, count: usize },
    #[error("target {name}: {source}")]
    Access { name: String, source: AccessError },
    #[error("no target named {0}")]
    NotFound(String),
}

/// One named target: its LUNs in order, and who may log in to it.
pub struct TargetEntry<T> {
    pub name: String,
    pub luns: Vec<Export<T>>,
    /// What the connections serving each LUN share ([`LuShared::of`] its volume), held
    /// for as long as the target exists: persistent reservations outlive the sessions
    /// that made them. The owner may install a persister here
    /// ([`LuShared::set_persist`]) and restore a saved state.
    pub shared: Vec<Arc<LuShared>>,
    /// A cluster target served with ALUA ([`crate::alua`]): its one LUN is the
    /// [`Alua`]'s (backed or not as its state says) and `luns` is empty.
    pub alua: Option<Arc<Alua<T>>>,
    /// Replaced whole by [`Target::set_access`]; a login takes the one current when
    /// it names the target and keeps it to its end.
    access: RwLock<Arc<Access>>,
    /// Normal sessions logged in to the target now (for metrics).
    sessions: Arc<AtomicU64>,
    /// Normal-session logins that completed, since the target was added.
    logins: AtomicU64,
}

impl<T> TargetEntry<T> {
    pub fn access(&self) -> Arc<Access> {
        self.access.read_locked().clone()
    }

    /// Sessions logged in now.
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Relaxed)
    }

    /// Logins that reached full feature phase, since the target was added.
    pub fn logins(&self) -> u64 {
        self.logins.load(Relaxed)
    }

    /// A login to this target reached full feature phase: counted until the returned
    /// guard (kept by the connection) is dropped.
    pub(crate) fn session_opened(&self) -> SessionCount {
        self.logins.fetch_add(1, Relaxed);
        self.sessions.fetch_add(1, Relaxed);
        SessionCount(self.sessions.clone())
    }
}

/// One logged-in session in its target's count, for as long as the connection lives.
pub(crate) struct SessionCount(Arc<AtomicU64>);

impl Drop for SessionCount {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// Why logins were refused, by the class of their Login Response status.
#[derive(Default)]
pub struct LoginRefusals {
    /// Authentication failed: CHAP missing, wrong user or secret (status 2/1).
    pub authentication: AtomicU64,
    /// The initiator is not on the target's allowlist (status 2/2).
    pub authorization: AtomicU64,
    /// The target named does not exist here (status 2/3).
    pub not_found: AtomicU64,
    /// Any other refusal (a malformed or out-of-order login).
    pub other: AtomicU64,
}

impl LoginRefusals {
    pub(crate) fn count(&self, (class, detail): (u8, u8)) {
        let c = match (class, detail) {
            (2, 1) => &self.authentication,
            (2, 2) => &self.authorization,
            (2, 3) => &self.not_found,
            _ => &self.other,
        };
        c.fetch_add(1, Relaxed);
    }

    /// (reason, count) for each class, in a fixed order.
    pub fn figures(&self) -> [(&'static str, u64); 4] {
        [
            ("authentication", self.authentication.load(Relaxed)),
            ("authorization", self.authorization.load(Relaxed)),
            ("not_found", self.not_found.load(Relaxed)),
            ("other", self.other.load(Relaxed)),
        ]
    }
}

/// Everything the connections of one listener share.
pub struct Target<T> {
    targets: RwLock<BTreeMap<String, Arc<TargetEntry<T>>>>,
    /// `host:port` of every portal, as SendTargets reports them.
    portals: RwLock<Vec<String>>,
    next_tsih: AtomicU16,
    /// Logins refused, by reason (for metrics).
    pub refusals: LoginRefusals,
    /// A connection that has not completed its login in this many milliseconds is
    /// closed ([`Target::set_login_timeout`]).
    login_timeout_ms: AtomicU64,
}

/// How long a connection may take to log in before it is closed, unless
/// [`Target::set_login_timeout`] says otherwise: the slot a half-open login holds in the
/// listener's cap is given back after this.
pub const DEFAULT_LOGIN_TIMEOUT: Duration = Duration::from_secs(15);

impl<T: ExportTarget> Target<T> {
    pub fn new() -> Arc<Target<T>> {
        Arc::new(Target {
            targets: RwLock::new(BTreeMap::new()),
            portals: RwLock::new(Vec::new()),
            next_tsih: AtomicU16::new(1),
            refusals: LoginRefusals::default(),
            login_timeout_ms: AtomicU64::new(millis(DEFAULT_LOGIN_TIMEOUT)),
        })
    }

    /// Close connections that have not completed their login within `t` (at least
    /// 100 ms); applies to connections accepted from now on.
    pub fn set_login_timeout(&self, t: Duration) {
        self.login_timeout_ms.store(millis(t).max(100), Relaxed);
    }

    /// The login timeout new connections get.
    pub fn login_timeout(&self) -> Duration {
        Duration::from_millis(self.login_timeout_ms.load(Relaxed))
    }

    /// Serve `luns` (LUN 0, 1, ...) under the iSCSI name `name`. Names are compared as
    /// given (initiators send them lower-case, as RFC 7143 requires them to be).
    pub fn add_target(&self, name: &str, luns: Vec<Export<T>>) -> Result<(), Error> {
        self.add_target_with_access(name, luns, Access::default())
    }

    /// [`Target::add_target`] with its access control in place from the start (no
    /// window in which the target is open to every initiator).
    pub fn add_target_with_access(
        &self,
        name: &str,
        luns: Vec<Export<T>>,
        access: Access,
    ) -> Result<(), Error> {
        if !valid_name(name) {
            return Err(Error::InvalidName(name.to_string()));
        }
        if luns.is_empty() {
            return Err(Error::NoLuns(name.to_string()));
        }
        if luns.len() > MAX_LUNS {
            return Err(Error::TooManyLuns {
                name: name.to_string(),
                count: luns.len(),
            });
        }
        access.check().map_err(|source| Error::Access {
            name: name.to_string(),
            source,
        })?;
        let shared = luns
            .iter()
            .map(|e| LuShared::of(e.target.identity()))
            .collect();
        self.insert_entry(name, shared, luns, None, access)
    }

    /// Serve `name` with ALUA: LUN 0 is `alua`'s, active/optimized and backed by the
    /// volume or standby without data, as `alua` says from one command to the next.
    /// Open to any initiator (a cluster volume's paths are reached like its NVMe/TCP
    /// ones).
    pub fn add_alua_target(&self, name: &str, alua: Arc<Alua<T>>) -> Result<(), Error> {
        if !valid_name(name) {
            return Err(Error::InvalidName(name.to_string()));
        }
        let shared = vec![alua.shared.clone()];
        self.insert_entry(name, shared, Vec::new(), Some(alua), Access::default())
    }

    /// Add a checked target under `name` unless one has that name.
    fn insert_entry(
        &self,
        name: &str,
        shared: Vec<Arc<LuShared>>,
        luns: Vec<Export<T>>,
        alua: Option<Arc<Alua<T>>>,
        access: Access,
    ) -> Result<(), Error> {
        let mut t = self.targets.write_locked();
        if t.contains_key(name) {
            return Err(Error::Exists(name.to_string()));
        }
        t.insert(
            name.to_string(),
            Arc::new(TargetEntry {
                name: name.to_string(),
                shared,
                luns,
                alua,
                access: RwLock::new(Arc::new(access)),
                sessions: Arc::default(),
                logins: AtomicU64::new(0),
            }),
        );
        Ok(())
    }

    /// Stop offering `name` to new logins (sessions already logged in keep their LUNs).
    pub fn remove_target(&self, name: &str) -> bool {
        self.targets.write_locked().remove(name).is_some()
    }

    /// Replace who may log in to `name`. Sessions logged in already are not affected;
    /// the next login is checked against `access`.
    pub fn set_access(&self, name: &str, access: Access) -> Result<(), Error> {
        access.check().map_err(|source| Error::Access {
            name: name.to_string(),
            source,
        })?;
        let t = self
            .target(name)
            .ok_or_else(|| Error::NotFound(name.to_string()))?;
        *t.access.write_locked() = Arc::new(access);
        Ok(())
    }

    pub fn target(&self, name: &str) -> Option<Arc<TargetEntry<T>>> {
        self.targets.read_locked().get(name).cloned()
    }

    pub fn target_names(&self) -> Vec<String> {
        self.targets.read_locked().keys().cloned().collect()
    }

    pub fn add_portal(&self, addr: String) {
        self.portals.write_locked().push(addr);
    }

    /// The SendTargets answer to `initiator`: every target (or only `only`) whose
    /// allowlist admits it, with every portal. A target that would refuse the initiator's
    /// login is not listed, so discovery does not tell strangers what exists; one that
    /// needs CHAP is listed (discovery sessions carry no CHAP here: the secret is checked
    /// at the normal login).
    pub fn send_targets(&self, only: Option<&str>, initiator: &str) -> Vec<(String, String)> {
        let portals = self.portals.read_locked().clone();
        let entries: Vec<Arc<TargetEntry<T>>> =
            self.targets.read_locked().values().cloned().collect();
        let mut out = Vec::new();
        for e in entries {
            let name = e.name.clone();
            if only.is_some_and(|o| o != name) || !e.access().admits(initiator) {
                continue;
            }
            out.push(("TargetName".to_string(), name));
            for p in &portals {
                out.push((
                    "TargetAddress".to_string(),
                    format!("{p},{PORTAL_GROUP_TAG}"),
                ));
            }
        }
        out
    }

    /// A TSIH for a new session: non-zero, cycling (sessions are one connection each,
    /// so a reused value never names two live sessions unless 65535 are open).
    pub fn new_tsih(&self) -> u16 {
        loop {
            let t = self.next_tsih.fetch_add(1, Relaxed);
            if t != 0 {
                return t;
            }
        }
    }
}

fn millis(t: Duration) -> u64 {
    u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for good in [
            "iqn.2026-11.io.tessera:db",
            "eui.0123456789abcdef",
            "naa.52004567",
        ] {
            assert!(valid_name(good), "{good}");
        }
        for bad in [
            "",
            "iqn.",
            "db",
            "iqn.x y",
            &format!("iqn.{}", "a".repeat(230)),
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
