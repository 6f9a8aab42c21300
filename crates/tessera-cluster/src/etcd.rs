//! A blocking facade over the `etcd-client` crate (etcd's v3 gRPC API through tonic),
//! with TLS (a private CA, client certificates) and user/password authentication.
//!
//! The rest of Tessera calls plain blocking methods ([`Etcd::get`], [`Etcd::swap`], ...)
//! from its control-plane threads; the gRPC client runs on a small tokio runtime that
//! the [`Etcd`] value owns (one worker thread, `tessera-etcd`), apart from the datapath
//! reactors, which never call etcd. Each call is sent to the runtime and its answer
//! waited for on a channel, so a call works from any thread, even one inside another
//! runtime (the API server's blocking pool).
//!
//! Every call has a deadline (`timeout`, per member); a call that fails on one member
//! (connection refused, TLS handshake, time out, a member without a leader) is tried on
//! the next one, and the member that answered last is tried first next time, so a
//! cluster of three members keeps answering while one is down and a dead member costs
//! one timeout, not one per call.
//!
//! [`Etcd::watch_prefix`] follows a prefix (put and delete events, in revision order),
//! reconnecting to any member and resuming after the last revision it delivered; when
//! etcd compacted that revision away meanwhile, it sends one full listing instead
//! ([`WatchEvent::Reset`]). [`PrefixCache`] keeps a prefix's keys in memory that way: one
//! listing at start, then the watch.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::*};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;
use tessera_io::sync::{MutexExt, RwLockExt};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity,
    PutOptions, TlsOptions, Txn, TxnOp, WatchOptions,
};
use tracing::{debug, info, warn};

/// The source of a failed attempt on one member.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The client library's error: a gRPC status from etcd, or a transport error
    /// (connection refused, TLS handshake, HTTP/2).
    #[error("{}", chain(.0))]
    Client(#[source] etcd_client::Error),
    /// No answer within the per-call deadline.
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// One member's failure in an [`EtcdError::Unavailable`].
#[derive(Debug)]
pub struct Attempt {
    pub endpoint: String,
    pub failure: Failure,
    /// What the failure likely means, when the library's words do not say it.
    pub hint: Option<&'static str>,
}

/// An etcd error: what was asked, of whom, and why it failed (its source kept).
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// The client settings are wrong (endpoint URLs, certificate or password files).
    #[error("etcd client settings: {0}")]
    Config(String),
    /// A certificate, key or password file could not be read.
    #[error("etcd client settings: cannot read {path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// etcd refused the user name or password.
    #[error("etcd at {endpoint}: authentication failed for user '{user}': {}", chain(.source))]
    AuthFailed {
        endpoint: String,
        user: String,
        #[source]
        source: etcd_client::Error,
    },
    /// etcd answered the request with an error another member would repeat (a missing
    /// lease, a permission the user lacks, a bad request).
    #[error("etcd at {endpoint}: {op} refused: {}", chain(.source))]
    Refused {
        endpoint: String,
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },
    /// No member answered; each one's failure (the source is the last one's).
    #[error("no etcd member answered {op}: {attempts}")]
    Unavailable {
        op: &'static str,
        #[source]
        attempts: Attempts,
    },
    /// A record read from etcd, or to be written, is not what it should be.
    #[error("{what}: {source}")]
    Record {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// The client's runtime or a thread could not be started.
    #[error("etcd client: {what}: {source}")]
    Runtime {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    /// The client was shut down while a call was in flight.
    #[error("etcd client: {0} abandoned (the client is shutting down)")]
    Abandoned(&'static str),
}

impl EtcdError {
    /// Whether etcd refused the credentials.
    pub fn is_auth_failure(&self) -> bool {
        matches!(self, EtcdError::AuthFailed { .. })
    }
}

impl From<EtcdError> for io::Error {
    fn from(e: EtcdError) -> io::Error {
        io::Error::other(e)
    }
}

/// Each member's failure, in the order tried; its source is the last one's.
#[derive(Debug)]
pub struct Attempts(pub Vec<Attempt>);

impl fmt::Display for Attempts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, a) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{}: {}", a.endpoint, a.failure)?;
            if let Some(h) = a.hint {
                write!(f, " ({h})")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Attempts {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.last().map(|a| &a.failure as _)
    }
}

/// An error and its sources, `a: b: c`, without repeats (tonic's transport errors say
/// little at the top and the cause — refused, unknown CA — further down).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = Some(e);
    while let Some(c) = cur {
        let s = c.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = c.source();
    }
    parts.join(": ")
}

pub type Result<T> = std::result::Result<T, EtcdError>;

/// One key as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision of the last change of the key (compare-and-swap token).
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: i64,
}

impl Kv {
    fn from_pb(kv: &etcd_client::KeyValue) -> Kv {
        Kv {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        }
    }
}

/// A password, never shown by `Debug` or `Display`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The password itself (only for handing it to etcd).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// How to reach and authenticate to etcd.
#[derive(Clone, Debug)]
pub struct EtcdOptions {
    /// Time allowed for one call on one member.
    pub timeout: Duration,
    /// The CA that signed the members' certificates (PEM); needed for `https://`.
    pub ca: Option<PathBuf>,
    /// This client's certificate and key (PEM), for members started with
    /// `--client-cert-auth`.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// User name and password (etcd's auth).
    pub user: Option<String>,
    pub password: Option<Secret>,
}

impl EtcdOptions {
    pub fn new(timeout: Duration) -> EtcdOptions {
        EtcdOptions {
            timeout,
            ca: None,
            cert: None,
            key: None,
            user: None,
            password: None,
        }
    }
}

/// Read a password file: its first line, refused when the file is readable by its group
/// or by others (so a leaked config dump or a careless `chmod` does not leak it).
pub fn read_password_file(path: &Path) -> Result<Secret> {
    use std::os::unix::fs::PermissionsExt as _;
    let file = |source| EtcdError::File {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(file)?;
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(EtcdError::Config(format!(
            "password file {} is accessible by group or others (mode {:o}): chmod 600 it",
            path.display(),
            mode & 0o777
        )));
    }
    let text = std::fs::read_to_string(path).map_err(file)?;
    let pw = text.lines().next().unwrap_or("").trim_end_matches('\r');
    if pw.is_empty() {
        return Err(EtcdError::Config(format!(
            "password file {} is empty",
            path.display()
        )));
    }
    Ok(Secret::new(pw))
}

/// Largest message accepted from etcd (a listing of every volume of a big cluster).
const MAX_MESSAGE: usize = 512 << 20;

struct Inner {
    endpoints: Vec<String>,
    timeout: Duration,
    connect: ConnectOptions,
    user: Option<String>,
    /// One client per member, connected on first use and dropped after a failure.
    clients: Vec<Mutex<Option<Client>>>,
    /// The endpoint that answered last: tried first.
    preferred: AtomicUsize,
    /// TLS without a client certificate (a member that demands one closes the
    /// connection after the handshake, which the library reports as a broken pipe).
    tls_without_identity: bool,
    /// The prefixes [`PrefixCache`]s follow, each with the revision of this client's
    /// last write under it.
    followed: Mutex<Vec<(String, Arc<AtomicI64>)>>,
    /// Open keepalive streams, by lease and member.
    keepers: Mutex<HashMap<(i64, usize), Keeper>>,
}

type Keeper =
    Arc<tokio::sync::Mutex<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>>;

/// A client for a set of etcd members (`http://HOST:PORT` or `https://HOST:PORT`).
#[derive(Clone)]
pub struct Etcd {
    inner: Arc<Inner>,
    rt: Arc<Runtime>,
}

impl fmt::Debug for Etcd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoints", &self.inner.endpoints)
            .field("timeout", &self.inner.timeout)
            .field("user", &self.inner.user)
            .finish_non_exhaustive()
    }
}

/// The runtime, shut down without waiting when the last clone of the client goes.
struct Runtime(Option<tokio::runtime::Runtime>);

impl Runtime {
    fn handle(&self) -> &tokio::runtime::Handle {
        self.0
            .as_ref()
            .expect("runtime present until drop")
            .handle()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

impl Etcd {
    /// A client for `endpoints` (`http://HOST:PORT`), each call waiting at most `timeout`
    /// per member.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Etcd> {
        Self::with_options(endpoints, EtcdOptions::new(timeout))
    }

    /// A client with TLS and/or authentication.
    pub fn with_options(endpoints: &[String], o: EtcdOptions) -> Result<Etcd> {
        if endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoint given".into()));
        }
        let mut tls = false;
        let mut eps = Vec::new();
        for e in endpoints {
            let e = e.trim_end_matches('/');
            let rest = if let Some(r) = e.strip_prefix("https://") {
                tls = true;
                r
            } else if let Some(r) = e.strip_prefix("http://") {
                r
            } else {
                return Err(EtcdError::Config(format!(
                    "etcd endpoint '{e}': expected http://HOST:PORT or https://HOST:PORT"
                )));
            };
            if !rest.contains(':') || rest.contains('/') {
                return Err(EtcdError::Config(format!(
                    "etcd endpoint '{e}': expected http(s)://HOST:PORT"
                )));
            }
            eps.push(e.to_string());
        }
        if tls && eps.iter().any(|e| e.starts_with("http://")) {
            return Err(EtcdError::Config(
                "etcd endpoints mix http:// and https://".into(),
            ));
        }
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(o.timeout)
            // A member that lost its quorum says so at once instead of hanging.
            .with_require_leader(true)
            // A silent peer (partition) is noticed on an open stream too.
            .with_keep_alive(o.timeout.max(Duration::from_secs(1)), o.timeout)
            .with_keep_alive_while_idle(true)
            .with_auto_token_refresh(true);
        let any_tls_file = o.ca.is_some() || o.cert.is_some() || o.key.is_some();
        if tls {
            let ca = o.ca.as_ref().ok_or_else(|| {
                EtcdError::Config(
                    "https:// etcd endpoints need etcd_ca (the CA's certificate)".into(),
                )
            })?;
            let mut t = TlsOptions::new().ca_certificate(Certificate::from_pem(read(ca)?));
            match (&o.cert, &o.key) {
                (Some(c), Some(k)) => t = t.identity(Identity::from_pem(read(c)?, read(k)?)),
                (None, None) => {}
                _ => {
                    return Err(EtcdError::Config(
                        "etcd_cert and etcd_key go together".into(),
                    ))
                }
            }
            connect = connect.with_tls(t);
        } else if any_tls_file {
            return Err(EtcdError::Config(
                "etcd_ca/etcd_cert/etcd_key need https:// etcd endpoints".into(),
            ));
        }
        match (&o.user, &o.password) {
            (Some(u), Some(p)) => connect = connect.with_user(u.clone(), p.expose().to_string()),
            (None, None) => {}
            (Some(_), None) => {
                return Err(EtcdError::Config(
                    "etcd_user needs a password (etcd_password_file)".into(),
                ))
            }
            (None, Some(_)) => return Err(EtcdError::Config("a password needs etcd_user".into())),
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-etcd")
            .enable_all()
            .build()
            .map_err(|source| EtcdError::Runtime {
                what: "cannot start its runtime",
                source,
            })?;
        Ok(Etcd {
            inner: Arc::new(Inner {
                clients: eps.iter().map(|_| Mutex::new(None)).collect(),
                endpoints: eps,
                timeout: o.timeout,
                connect,
                user: o.user,
                preferred: AtomicUsize::new(0),
                keepers: Mutex::new(HashMap::new()),
                followed: Mutex::new(Vec::new()),
                tls_without_identity: tls && o.cert.is_none(),
            }),
            rt: Arc::new(Runtime(Some(rt))),
        })
    }

    /// The endpoints, as given.
    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// Run `f` on the first member that answers it, from a blocking thread.
    fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: Fn(usize, Client) -> Fut + Send + 'static,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>> + Send,
    {
        let inner = self.inner.clone();
        let (tx, rx) = mpsc::sync_channel(1);
        self.rt.handle().spawn(async move {
            let _ = tx.send(inner.call(op, f).await);
        });
        rx.recv().map_err(|_| EtcdError::Abandoned(op))?
    }

    /// Grant a lease of `ttl` seconds; its id.
    pub fn grant(&self, ttl: i64) -> Result<i64> {
        self.call("lease grant", move |_, mut c| async move {
            c.lease_grant(ttl, None).await.map(|r| r.id())
        })
    }

    /// Renew a lease; the TTL it has now (0: the lease is gone).
    pub fn keepalive(&self, lease: i64) -> Result<i64> {
        let inner = self.inner.clone();
        self.call("lease keepalive", move |i, c| {
            let inner = inner.clone();
            async move {
                // One keepalive stream per lease and member, kept open (etcd's way).
                let keeper = inner.keepers.locked().get(&(lease, i)).cloned();
                let keeper = match keeper {
                    Some(k) => k,
                    None => {
                        let mut c = c;
                        match c.lease_keep_alive(lease).await {
                            Ok(k) => {
                                let k = Arc::new(tokio::sync::Mutex::new(k));
                                let mut all = inner.keepers.locked();
                                all.retain(|(l, _), _| *l != lease);
                                all.insert((lease, i), k.clone());
                                k
                            }
                            // The crate reads the first answer itself and calls a TTL of 0
                            // this: the lease is gone.
                            Err(etcd_client::Error::LeaseKeepAliveError(_)) => return Ok(0),
                            Err(e) => return Err(e),
                        }
                    }
                };
                let mut k = keeper.lock().await;
                let (keeper, stream) = &mut *k;
                let r = async {
                    keeper.keep_alive().await?;
                    stream.message().await
                }
                .await;
                let ttl = match r {
                    Ok(Some(r)) => Ok(r.ttl().max(0)),
                    Ok(None) => Err(etcd_client::Error::LeaseKeepAliveError(
                        "keepalive stream ended".into(),
                    )),
                    Err(e) => Err(e),
                };
                if !matches!(ttl, Ok(t) if t > 0) {
                    drop(k);
                    inner.keepers.locked().remove(&(lease, i));
                }
                match ttl {
                    // A stream that ended (a member restarted) is retried on a new one.
                    Err(etcd_client::Error::LeaseKeepAliveError(m)) => {
                        Err(etcd_client::Error::IoError(io::Error::other(m)))
                    }
                    t => t,
                }
            }
        })
    }

    /// Give a lease up: its keys disappear at once.
    pub fn revoke(&self, lease: i64) -> Result<()> {
        self.inner.keepers.locked().retain(|(l, _), _| *l != lease);
        self.call("lease revoke", move |_, mut c| async move {
            c.lease_revoke(lease).await.map(|_| ())
        })
    }

    /// Write `key` (attached to `lease` unless 0).
    pub fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<()> {
        let (k, value) = (key.to_string(), value.to_vec());
        self.call("put", move |_, mut c| {
            let (key, value) = (k.clone(), value.clone());
            async move {
                let opts = (lease != 0).then(|| PutOptions::new().with_lease(lease));
                c.put(key, value, opts)
                    .await
                    .map(|r| revision_of(r.header()))
            }
        })
        .map(|rev| self.inner.note_write(key, rev))
    }

    /// Read one key.
    pub fn get(&self, key: &str) -> Result<Option<Kv>> {
        let key = key.to_string();
        self.call("get", move |_, c| {
            let key = key.clone();
            async move {
                let mut kv = c.kv_client().max_decoding_message_size(MAX_MESSAGE);
                let r = kv.get(key, None).await?;
                Ok(r.kvs().first().map(Kv::from_pb))
            }
        })
    }

    /// Every key under `prefix`, in key order.
    pub fn list(&self, prefix: &str) -> Result<Vec<Kv>> {
        self.list_at(prefix).map(|(kvs, _)| kvs)
    }

    /// Every key under `prefix`, in key order, and the revision the listing is of (a
    /// watch from the next revision misses nothing).
    pub fn list_at(&self, prefix: &str) -> Result<(Vec<Kv>, i64)> {
        let prefix = prefix.to_string();
        self.call("list", move |_, c| list_async(c, prefix.clone()))
    }

    /// Delete one key; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        let k = key.to_string();
        let (deleted, rev) = self.call("delete", move |_, mut c| {
            let key = k.clone();
            async move {
                c.delete(key, None)
                    .await
                    .map(|r| (r.deleted() > 0, revision_of(r.header())))
            }
        })?;
        if deleted {
            self.inner.note_write(key, rev);
        }
        Ok(deleted)
    }

    /// Create `key` only if it does not exist; whether it was created.
    pub fn create(&self, key: &str, value: &[u8], lease: i64) -> Result<bool> {
        let cmp = Compare::create_revision(key, CompareOp::Equal, 0);
        self.txn_put("create", key, value, lease, cmp)
    }

    /// Replace `key` only if it was last changed at `mod_revision` (what [`Etcd::get`]
    /// returned); whether it was replaced. The compare-and-swap every ownership change
    /// goes through.
    pub fn swap(&self, key: &str, mod_revision: i64, value: &[u8], lease: i64) -> Result<bool> {
        let cmp = Compare::mod_revision(key, CompareOp::Equal, mod_revision);
        self.txn_put("swap", key, value, lease, cmp)
    }

    fn txn_put(
        &self,
        op: &'static str,
        key: &str,
        value: &[u8],
        lease: i64,
        cmp: Compare,
    ) -> Result<bool> {
        let (key, value) = (key.to_string(), value.to_vec());
        self.call(op, move |_, mut c| {
            let opts = (lease != 0).then(|| PutOptions::new().with_lease(lease));
            let txn = Txn::new().when([cmp.clone()]).and_then([TxnOp::put(
                key.clone(),
                value.clone(),
                opts,
            )]);
            async move { c.txn(txn).await.map(|r| r.succeeded()) }
        })
    }

    /// Turn on etcd's authentication for Tessera, as an operator does once: a `root`
    /// user (etcd demands one before auth goes on), a role `user` with read and write on
    /// every key under `prefix`, the user `user` with that role, then auth on. Calls
    /// after this one need a user and password.
    pub fn enable_auth(
        &self,
        root_password: &str,
        user: &str,
        password: &str,
        prefix: &str,
    ) -> Result<()> {
        let (root_password, user, password, prefix) = (
            root_password.to_string(),
            user.to_string(),
            password.to_string(),
            prefix.to_string(),
        );
        self.call("enable auth", move |_, mut c| {
            let (root_password, user, password, prefix) = (
                root_password.clone(),
                user.clone(),
                password.clone(),
                prefix.clone(),
            );
            async move {
                c.user_add("root", root_password, None).await?;
                c.user_grant_role("root", "root").await?;
                c.role_add(user.as_str()).await?;
                let access = etcd_client::Permission::read_write(prefix).with_prefix();
                c.role_grant_permission(user.as_str(), access).await?;
                c.user_add(user.as_str(), password, None).await?;
                c.user_grant_role(user.as_str(), user.as_str()).await?;
                c.auth_enable().await.map(drop)
            }
        })
    }

    /// A client for one-off administration (tests, benchmarks): the async client of the
    /// first member that connects, and the runtime to drive it on.
    pub fn raw(&self) -> Result<(Client, tokio::runtime::Handle)> {
        let c = self.call("connect", |_, c| async move { Ok(c) })?;
        Ok((c, self.rt.handle().clone()))
    }

    /// Follow every key under `prefix` from `start_revision` (0: from now): put and
    /// delete events in revision order, on any member that answers, resumed after the
    /// last delivered revision when a connection breaks. Ends when the returned
    /// [`Watch`] is dropped.
    pub fn watch_prefix(&self, prefix: &str, start_revision: i64) -> Watch {
        let (tx, rx) = mpsc::channel();
        let handle = self.watch_prefix_with(prefix, start_revision, move |ev| tx.send(ev).is_ok());
        Watch {
            rx,
            _handle: handle,
        }
    }

    /// [`watch_prefix`](Self::watch_prefix) handing each event to `on_event` (on the
    /// client's runtime thread: it must not block); the watch ends when `on_event`
    /// returns false or the handle is dropped.
    pub fn watch_prefix_with(
        &self,
        prefix: &str,
        start_revision: i64,
        on_event: impl FnMut(WatchEvent) -> bool + Send + 'static,
    ) -> WatchHandle {
        let task = self.rt.handle().spawn(watch_loop(
            self.inner.clone(),
            prefix.to_string(),
            start_revision,
            on_event,
        ));
        WatchHandle(task.abort_handle())
    }
}

fn revision_of(h: Option<&etcd_client::ResponseHeader>) -> i64 {
    h.map_or(0, |h| h.revision())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| EtcdError::File {
        path: path.to_path_buf(),
        source,
    })
}

async fn list_async(
    c: Client,
    prefix: String,
) -> std::result::Result<(Vec<Kv>, i64), etcd_client::Error> {
    let mut kv = c.kv_client().max_decoding_message_size(MAX_MESSAGE);
    let r = kv
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let rev = r.header().map_or(0, |h| h.revision());
    Ok((r.kvs().iter().map(Kv::from_pb).collect(), rev))
}

/// Whether a failure on one member may not happen on another one.
fn retryable(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::TransportError(_) | E::IoError(_) | E::EndpointError(_) => true,
        E::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
        ),
        _ => false,
    }
}

/// The hint for a member that dropped a TLS connection of a client with no certificate.
///
/// A server demanding client certificates refuses one only after the client has finished
/// its side of a TLS 1.3 handshake, so the client sees no alert naming the certificate: it
/// sees its first request fail, as a broken pipe, a reset, or "connection closed",
/// whichever the timing gives.
fn closed_tls_hint(tls_without_identity: bool, failure: &str) -> Option<&'static str> {
    let dropped = ["broken pipe", "connection closed", "connection reset"]
        .iter()
        .any(|words| failure.contains(words));
    (tls_without_identity && dropped).then_some(
        "the member closed the TLS connection: does it demand a client certificate? set etcd_cert and etcd_key",
    )
}

/// Whether etcd refused the credentials.
fn auth_failure(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::Unauthenticated
                || s.message().contains("authentication failed")
        }
        _ => false,
    }
}

impl Inner {
    async fn client(&self, i: usize) -> std::result::Result<Client, etcd_client::Error> {
        if let Some(c) = self.clients[i].locked().clone() {
            return Ok(c);
        }
        let c = Client::connect([self.endpoints[i].as_str()], Some(self.connect.clone())).await?;
        *self.clients[i].locked() = Some(c.clone());
        Ok(c)
    }

    /// A write of `key` at `rev` succeeded: caches of a prefix of it are behind until
    /// their watch delivers `rev` (so this client reads its own writes from them).
    fn note_write(&self, key: &str, rev: i64) {
        for (prefix, written) in self.followed.locked().iter() {
            if key.starts_with(prefix.as_str()) {
                written.fetch_max(rev, AcqRel);
            }
        }
    }

    /// Drop member `i`'s connection and its keepalive streams after a failure (a stream
    /// whose call timed out could deliver that call's answer to the next one, making a
    /// lease look renewed later than it was).
    fn forget(&self, i: usize) {
        *self.clients[i].locked() = None;
        self.keepers.locked().retain(|(_, m), _| *m != i);
    }

    fn refused(&self, i: usize, op: &'static str, e: etcd_client::Error) -> EtcdError {
        let endpoint = self.endpoints[i].clone();
        if auth_failure(&e) {
            EtcdError::AuthFailed {
                endpoint,
                user: self.user.clone().unwrap_or_default(),
                source: e,
            }
        } else {
            EtcdError::Refused {
                endpoint,
                op,
                source: e,
            }
        }
    }

    async fn call<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: Fn(usize, Client) -> Fut,
        Fut: Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let n = self.endpoints.len();
        let first = self.preferred.load(Relaxed);
        let mut attempts = Vec::new();
        for i in (0..n).map(|k| (first + k) % n) {
            let failure = match tokio::time::timeout(self.timeout, self.client(i)).await {
                Ok(Ok(c)) => match tokio::time::timeout(self.timeout, f(i, c)).await {
                    Ok(Ok(v)) => {
                        self.preferred.store(i, Relaxed);
                        return Ok(v);
                    }
                    Ok(Err(e)) if !retryable(&e) => return Err(self.refused(i, op, e)),
                    Ok(Err(e)) => Failure::Client(e),
                    Err(_) => Failure::TimedOut(self.timeout),
                },
                Ok(Err(e)) if !retryable(&e) => return Err(self.refused(i, op, e)),
                Ok(Err(e)) => Failure::Client(e),
                Err(_) => Failure::TimedOut(self.timeout),
            };
            debug!(endpoint = %self.endpoints[i], op, error = %failure, "etcd member failed");
            self.forget(i);
            let hint = match &failure {
                Failure::Client(e) => closed_tls_hint(self.tls_without_identity, &chain(e)),
                Failure::TimedOut(_) => None,
            };
            attempts.push(Attempt {
                endpoint: self.endpoints[i].clone(),
                failure,
                hint,
            });
        }
        Err(EtcdError::Unavailable {
            op,
            attempts: Attempts(attempts),
        })
    }
}

/// A change under a watched prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was written (its new value and revision).
    Put(Kv),
    /// The key was deleted at `revision`.
    Delete { key: String, revision: i64 },
    /// The revision to resume from was compacted away: here is every key under the
    /// prefix as of `revision` (replace what you had); events follow from there.
    Reset { kvs: Vec<Kv>, revision: i64 },
    /// The watch is established on a member (after a start or a reconnection): every
    /// event up to `revision` (or later) has been or will next be delivered.
    Synced { revision: i64 },
    /// The watch lost its member; it is being re-established elsewhere.
    Disconnected,
}

/// A running watch: an iterator of events (blocking), ended when dropped.
pub struct Watch {
    rx: mpsc::Receiver<WatchEvent>,
    _handle: WatchHandle,
}

impl Watch {
    /// The next event, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<WatchEvent> {
        self.rx.recv_timeout(timeout).ok()
    }
}

impl Iterator for Watch {
    type Item = WatchEvent;
    fn next(&mut self) -> Option<WatchEvent> {
        self.rx.recv().ok()
    }
}

/// Stops its watch when dropped.
pub struct WatchHandle(tokio::task::AbortHandle);

impl Drop for WatchHandle {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn watch_loop(
    inner: Arc<Inner>,
    prefix: String,
    start_revision: i64,
    mut on_event: impl FnMut(WatchEvent) -> bool,
) {
    // The next revision wanted (0: whatever is current when the watch starts).
    let mut next = start_revision;
    let n = inner.endpoints.len();
    let mut i = inner.preferred.load(Relaxed);
    let mut backoff = Duration::from_millis(50);
    let mut connected = false;
    loop {
        let ep = inner.endpoints[i % n].clone();
        let client = match tokio::time::timeout(inner.timeout, inner.client(i % n)).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => {
                debug!(endpoint = %ep, error = %chain(&e), "watch: cannot connect");
                inner.forget(i % n);
                None
            }
            Err(_) => None,
        };
        if let Some(c) = client {
            let mut opts = WatchOptions::new().with_prefix().with_progress_notify();
            if next > 0 {
                opts = opts.with_start_revision(next);
            }
            let mut w = c.watch_client().max_decoding_message_size(MAX_MESSAGE);
            match tokio::time::timeout(inner.timeout, w.watch(prefix.clone(), Some(opts))).await {
                Ok(Ok(mut stream)) => loop {
                    match stream.message().await {
                        Ok(Some(r)) => {
                            backoff = Duration::from_millis(50);
                            if r.compact_revision() > 0 || (r.canceled() && next > 0) {
                                // Resuming is impossible: list everything instead.
                                info!(prefix = %prefix, compacted = r.compact_revision(),
                                      reason = r.cancel_reason(), "watch: revision gone, listing again");
                                match tokio::time::timeout(
                                    inner.timeout,
                                    list_async(c.clone(), prefix.clone()),
                                )
                                .await
                                {
                                    Ok(Ok((kvs, rev))) => {
                                        next = rev + 1;
                                        if !on_event(WatchEvent::Reset { kvs, revision: rev }) {
                                            return;
                                        }
                                    }
                                    _ => {
                                        // Try again (perhaps elsewhere); `next` stays so
                                        // the next try lands here again.
                                    }
                                }
                                break;
                            }
                            if r.canceled() {
                                warn!(prefix = %prefix, reason = r.cancel_reason(), "watch canceled by etcd");
                                break;
                            }
                            let rev = r.header().map_or(0, |h| h.revision());
                            if r.created() {
                                connected = true;
                                inner.preferred.store(i % n, Relaxed);
                                if next == 0 {
                                    next = rev + 1;
                                }
                                if !on_event(WatchEvent::Synced { revision: rev }) {
                                    return;
                                }
                            }
                            for ev in r.events() {
                                let Some(kv) = ev.kv() else { continue };
                                let e = match ev.event_type() {
                                    EventType::Put => WatchEvent::Put(Kv::from_pb(kv)),
                                    EventType::Delete => WatchEvent::Delete {
                                        key: String::from_utf8_lossy(kv.key()).into_owned(),
                                        revision: kv.mod_revision(),
                                    },
                                };
                                next = next.max(kv.mod_revision() + 1);
                                if !on_event(e) {
                                    return;
                                }
                            }
                            if r.events().is_empty() && !r.created() && rev > 0 {
                                // A progress notification: nothing under the prefix
                                // changed up to `rev`.
                                next = next.max(rev + 1);
                            }
                        }
                        Ok(None) => break,
                        Err(e) => {
                            debug!(endpoint = %ep, error = %chain(&e), "watch stream broke");
                            inner.forget(i % n);
                            break;
                        }
                    }
                },
                Ok(Err(e)) => {
                    debug!(endpoint = %ep, error = %chain(&e), "watch: cannot start");
                    inner.forget(i % n);
                }
                Err(_) => inner.forget(i % n),
            }
        }
        if connected {
            connected = false;
            if !on_event(WatchEvent::Disconnected) {
                return;
            }
        }
        i += 1;
        if i.is_multiple_of(n) {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

/// Every key under a prefix, kept in memory by a watch: one listing at start, then the
/// watch's events ([`Etcd::watch_prefix_with`]). While the watch is re-established
/// after a lost connection the cache says it is not in sync ([`PrefixCache::snapshot`]
/// answers `None`), as a read from etcd would have failed.
pub struct PrefixCache {
    prefix: String,
    state: Arc<RwLock<CacheState>>,
    synced: Arc<AtomicBool>,
    /// The revision of this client's last write under the prefix: a read waits (a
    /// little) until the watch delivered it, so the cache is never older than what
    /// this node itself wrote.
    written: Arc<AtomicI64>,
    wait: Duration,
    _watch: WatchHandle,
}

#[derive(Default)]
struct CacheState {
    kvs: BTreeMap<String, Kv>,
    revision: i64,
}

impl PrefixCache {
    /// List `prefix` now (an error if etcd does not answer) and follow it.
    pub fn start(etcd: &Etcd, prefix: &str) -> Result<PrefixCache> {
        let written = Arc::new(AtomicI64::new(0));
        etcd.inner
            .followed
            .locked()
            .push((prefix.to_string(), written.clone()));
        let (kvs, revision) = etcd.list_at(prefix)?;
        let state = Arc::new(RwLock::new(CacheState {
            kvs: kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect(),
            revision,
        }));
        let synced = Arc::new(AtomicBool::new(true));
        let (st, sy) = (state.clone(), synced.clone());
        let watch = etcd.watch_prefix_with(prefix, revision + 1, move |ev| {
            let mut s = st.write_locked();
            match ev {
                WatchEvent::Put(kv) => {
                    s.revision = s.revision.max(kv.mod_revision);
                    s.kvs.insert(kv.key.clone(), kv);
                }
                WatchEvent::Delete { key, revision } => {
                    s.revision = s.revision.max(revision);
                    s.kvs.remove(&key);
                }
                WatchEvent::Reset { kvs, revision } => {
                    s.kvs = kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect();
                    s.revision = revision;
                }
                WatchEvent::Synced { revision } => {
                    s.revision = s.revision.max(revision);
                    sy.store(true, Release);
                }
                WatchEvent::Disconnected => sy.store(false, Release),
            }
            true
        });
        Ok(PrefixCache {
            prefix: prefix.to_string(),
            state,
            synced,
            written,
            wait: etcd.inner.timeout,
            _watch: watch,
        })
    }

    /// The prefix followed.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether the watch is connected (the cache follows etcd) and has delivered this
    /// client's own writes (waiting for them up to the call timeout).
    pub fn in_sync(&self) -> bool {
        let until = std::time::Instant::now() + self.wait;
        loop {
            if !self.synced.load(Acquire) {
                return false;
            }
            if self.revision() >= self.written.load(Acquire) {
                return true;
            }
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every key, in key order (None while the watch is reconnecting).
    pub fn snapshot(&self) -> Option<Vec<Kv>> {
        if !self.in_sync() {
            return None;
        }
        let s = self.state.read_locked();
        Some(s.kvs.values().cloned().collect())
    }

    /// One key (None inside: absent; outer None: not in sync).
    pub fn get(&self, key: &str) -> Option<Option<Kv>> {
        if !self.in_sync() {
            return None;
        }
        let s = self.state.read_locked();
        Some(s.kvs.get(key).cloned())
    }

    /// The revision the cache is known to be up to date with.
    pub fn revision(&self) -> i64 {
        self.state.read_locked().revision
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dropped_tls_connection_without_a_client_certificate_gets_a_hint() {
        use super::closed_tls_hint;
        // The three ways CI and this machine saw etcd drop such a client.
        for seen in [
            "transport error: broken pipe",
            "grpc request error: code: 'The operation was cancelled', message: \"operation was canceled\", source: tonic::transport::Error(Transport, hyper::Error(Canceled, \"connection closed\"))",
            "transport error: connection reset by peer",
        ] {
            let hint = closed_tls_hint(true, seen).expect(seen);
            assert!(hint.contains("client certificate"), "{hint}");
            // With a certificate configured, the hint would mislead.
            assert_eq!(closed_tls_hint(false, seen), None);
        }
        assert_eq!(closed_tls_hint(true, "connection refused"), None);
    }

    use super::*;

    #[test]
    fn endpoints_and_settings() {
        let t = Duration::from_secs(1);
        assert!(Etcd::new(&[], t).is_err());
        assert!(Etcd::new(&["ftp://x:1".into()], t).is_err());
        assert!(Etcd::new(&["http://x".into()], t).is_err());
        assert!(Etcd::new(&["http://127.0.0.1:2379/".into()], t).is_ok());
        // https needs the CA.
        let e = Etcd::new(&["https://127.0.0.1:2379".into()], t).unwrap_err();
        assert!(e.to_string().contains("etcd_ca"), "{e}");
        let mut o = EtcdOptions::new(t);
        o.user = Some("u".into());
        assert!(Etcd::with_options(&["http://127.0.0.1:1".into()], o).is_err());
    }

    #[test]
    fn password_files_must_be_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("pw");
        std::fs::write(&p, "s3cret\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_password_file(&p).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        let s = read_password_file(&p).unwrap();
        assert_eq!(s.expose(), "s3cret");
        assert!(!format!("{s:?}").contains("s3cret"));
    }
}
