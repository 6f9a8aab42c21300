//! Listeners: the management API and NBD (TCP and Unix). NBD handshakes run on a thread per
//! connection (bounded, with a timeout), then the socket moves to a reactor core for the
//! transmission phase.

use std::ffi::CString;
use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tessera_io::cast::{u16_of, u32_of};

use tessera_nbd::conn::{ConnOptions, NbdConn};
use tessera_nbd::handshake::{negotiate_io, HandshakeOutcome};
use tessera_nbd::tls::{HandshakeStream, TlsLink};

use tessera_export::accept::{accept_each, Peer};
use tessera_export::budget::{ListenerCap, ListenerSlot};
use tessera_export::log_limit::LogLimiter;
use tessera_export::ExportTarget;
use tracing::{info, warn};

use tessera_http::{ApiListener, TokenSet};

use crate::config::NodeConfig;
use crate::error::StartError;
use crate::node::proxy::ExportSession;
use crate::node::Node;

/// Handshakes in progress at once; more connections are refused until some finish.
const MAX_HANDSHAKES: usize = 256;
/// A client that does not finish its handshake in this time is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);

fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    remove_stale_socket(path)?;
    UnixListener::bind(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot listen on {}: {e}", path.display()),
        )
    })
}

/// Refuse a Unix socket path some running process answers on (a socket left by a
/// previous run, which nobody answers, is free).
fn unix_socket_free(path: &Path) -> io::Result<()> {
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!("{} is in use by a running process", path.display()),
        ));
    }
    Ok(())
}

/// Check, before the node opens any pool, that the addresses it must listen on are free:
/// the API socket (and TCP address) and the NBD addresses. A node that would fail on a
/// busy address fails here, having opened nothing. (NVMe/TCP ports are not checked: a
/// busy one only turns NVMe/TCP off there, as `node::nvmf::start` says.)
pub fn check_addresses(cfg: &crate::NodeConfig) -> io::Result<()> {
    let busy = |what: &str, addr: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("cannot listen for {what} on {addr}: {e}"))
    };
    let api = cfg.api_socket();
    if api.exists() {
        unix_socket_free(&api)?;
    }
    if let Some(addr) = &cfg.api.tcp {
        TcpListener::bind(addr).map_err(|e| busy("the management API", addr, e))?;
    }
    for addr in &cfg.nbd.listen {
        TcpListener::bind(addr).map_err(|e| busy("NBD", addr, e))?;
    }
    if let Some(p) = cfg.nbd.unix.as_deref().filter(|p| p.exists()) {
        unix_socket_free(p)?;
    }
    Ok(())
}

/// Removes a socket left by a previous run: only if nobody answers on it.
fn remove_stale_socket(path: &Path) -> io::Result<()> {
    if path.exists() {
        unix_socket_free(path)?;
        std::fs::remove_file(path)?;
    }
    Ok(())
}

/// The group ID of `group` (a name or a number).
fn group_id(group: &str) -> io::Result<libc::gid_t> {
    if let Ok(gid) = group.parse::<libc::gid_t>() {
        return Ok(gid);
    }
    let name =
        CString::new(group).map_err(|_| invalid_input(format!("bad group name {group:?}")))?;
    let mut entry: libc::group = zeroed_group();
    let mut found: *mut libc::group = std::ptr::null_mut();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: every pointer is valid for the call: `name` is NUL-terminated, `entry` and
    // `found` are ours, `buf` is writable for `buf.len()` bytes.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut entry,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return Err(invalid_input(format!(
            "api.socket_group: no group named {group:?}"
        )));
    }
    Ok(entry.gr_gid)
}

fn zeroed_group() -> libc::group {
    // SAFETY: `libc::group` is plain data (integers and pointers) for which all-zero bytes
    // are a valid value; getgrnam_r fills it in.
    unsafe { std::mem::zeroed() }
}

fn invalid_input(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

/// The API's Unix socket: the only access control on it is the file's permissions, so it
/// is created with mode 0600 (0660 and `group` when given) *before* it listens — nobody
/// can connect in between — in a directory other users cannot write (where they could
/// replace it).
fn bind_api_socket(path: &Path, group: Option<&str>) -> io::Result<UnixListener> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::env::current_dir()?,
    };
    let mode = std::fs::metadata(&dir)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("API socket directory {}: {e}", dir.display()),
            )
        })?
        .permissions()
        .mode();
    if mode & 0o002 != 0 {
        return Err(invalid_input(format!(
            "the API socket's directory {} is writable by every user (mode {:o}); put the \
             socket (api.socket) in a directory only its owner can write",
            dir.display(),
            mode & 0o7777
        )));
    }
    let gid = group.map(group_id).transpose()?;
    remove_stale_socket(path)?;
    let cannot = |what: &str, e: io::Error| {
        io::Error::new(e.kind(), format!("cannot {what} {}: {e}", path.display()))
    };
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| invalid_input(format!("{} holds a NUL byte", path.display())))?;
    // SAFETY: `sockaddr_un` is plain data; zero bytes are a valid (empty) address.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = u16_of(libc::AF_UNIX);
    let bytes = c_path.as_bytes_with_nul();
    if bytes.len() > addr.sun_path.len() {
        return Err(invalid_input(format!(
            "the API socket path {} is longer than {} bytes",
            path.display(),
            addr.sun_path.len() - 1
        )));
    }
    for (dst, &src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    // SAFETY: a plain socket(2) call; the descriptor is owned at once below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(cannot("create a socket for", io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `addr` is a valid sockaddr_un of the size passed.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            u32_of(std::mem::size_of::<libc::sockaddr_un>()),
        )
    };
    if rc != 0 {
        return Err(cannot("listen on", io::Error::last_os_error()));
    }
    let restrict = || -> io::Result<()> {
        if let Some(gid) = gid {
            // SAFETY: `c_path` is NUL-terminated; -1 keeps the owner.
            if unsafe { libc::chown(c_path.as_ptr(), u32::MAX, gid) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let mode = if gid.is_some() { 0o660 } else { 0o600 };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    };
    if let Err(e) = restrict() {
        let _ = std::fs::remove_file(path);
        return Err(cannot("restrict the permissions of", e));
    }
    // SAFETY: listen(2) on the bound socket we own.
    if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
        let e = io::Error::last_os_error();
        let _ = std::fs::remove_file(path);
        return Err(cannot("listen on", e));
    }
    Ok(UnixListener::from(fd))
}

/// The TCP API as configured: its address, TLS configuration and tokens.
struct TcpApi {
    addr: String,
    tls: Arc<rustls::ServerConfig>,
    tokens: Arc<TokenSet>,
}

/// The TCP listener of the API with its TLS configuration and tokens, refused unless all
/// three are configured. Checked before the node opens anything
/// ([`check_api_config`]), and again when the API starts.
fn tcp_api(cfg: &NodeConfig) -> Result<Option<TcpApi>, StartError> {
    let api = &cfg.api;
    let Some(addr) = &api.tcp else {
        return Ok(None);
    };
    let (Some(cert), Some(key), Some(tokens)) = (&api.tls_cert, &api.tls_key, &api.token_file)
    else {
        return Err(StartError::Config(format!(
            "the management API on TCP ({addr}) needs TLS and authentication: set api.tls_cert, \
             api.tls_key and api.token_file (see docs/api.md), or use the Unix socket only"
        )));
    };
    let tls =
        tessera_http::server_config(cert, key).map_err(|e| StartError::Config(e.to_string()))?;
    let tokens = TokenSet::load(tokens).map_err(|e| StartError::Config(e.to_string()))?;
    Ok(Some(TcpApi {
        addr: addr.clone(),
        tls,
        tokens: Arc::new(tokens),
    }))
}

/// Refuses an API configuration that cannot be served (TCP without TLS and tokens, an
/// unreadable certificate or token file) before anything is opened.
pub fn check_api_config(cfg: &NodeConfig) -> Result<(), StartError> {
    tcp_api(cfg).map(|_| ())
}

/// Starts the management API on its own control thread: the Unix socket, and TCP with
/// TLS and tokens when configured. Returns the TCP address it listens on, if any.
pub fn start_api(node: &Arc<Node>) -> io::Result<Option<String>> {
    let mut listeners = vec![ApiListener::Unix(bind_api_socket(
        &node.cfg.api_socket(),
        node.cfg.api.socket_group.as_deref(),
    )?)];
    let mut tcp_addr = None;
    if let Some(TcpApi { addr, tls, tokens }) =
        tcp_api(&node.cfg).map_err(|e| invalid_input(e.to_string()))?
    {
        let listener = TcpListener::bind(&addr)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        tcp_addr = Some(listener.local_addr()?.to_string());
        listeners.push(ApiListener::Tls {
            listener,
            tls,
            tokens,
        });
    }
    tessera_http::spawn(crate::api::router(node.clone()), listeners)?;
    Ok(tcp_addr)
}

/// Failed NBD handshakes (garbage, port scans, wrong protocol, failed TLS): at most 10
/// lines per 10 s.
static HANDSHAKE_LOG: LogLimiter = LogLimiter::new("nbd-handshake", 10, 10);

/// Run the handshake on `stream`; on success hand the socket (and its TLS session, if
/// the client started TLS) to a reactor core.
fn serve_client<S>(
    node: Arc<Node>,
    stream: S,
    client: String,
    slot: ListenerSlot,
    into_fd: impl FnOnce(S) -> OwnedFd,
) where
    S: io::Read + io::Write,
{
    let mut stream = HandshakeStream::new(stream, node.exports().tls());
    let session = ExportSession::new(&node);
    let outcome = negotiate_io(&mut stream, &session);
    let n = match outcome {
        Ok(HandshakeOutcome::Transmission(n)) => n,
        Ok(HandshakeOutcome::Closed) => return,
        // A client that hangs up during the handshake (e.g. after an unknown-export
        // reply) is normal; anything else is worth a line in the log.
        Err(tessera_nbd::handshake::HandshakeError::Io(e))
            if e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            return
        }
        Err(e @ tessera_nbd::handshake::HandshakeError::Tls(_)) => {
            if HANDSHAKE_LOG.admit() {
                warn!(protocol = "nbd", client = %client, error = %e, "nbd: TLS handshake failed, connection closed");
            }
            return;
        }
        Err(e) => {
            if HANDSHAKE_LOG.admit() {
                warn!(protocol = "nbd", client = %client, error = %e, "nbd: handshake failed");
            }
            return;
        }
    };
    // What serves the export: a local volume, or (proxy) the owner of a cluster volume.
    // (`pool` is empty for a proxy, `proxy` names the owner's export.)
    let (export, read_only, pool, volume, proxy) = match node.resolve_export(&n.export_name) {
        Some((vol, read_only)) => (
            node.export_of(&vol),
            read_only,
            vol.pool_name().to_string(),
            vol.name.clone(),
            None,
        ),
        None => match session.take_proxy(&n.export_name) {
            Some(p) => {
                let via = format!("{} at {}", p.owner, p.path());
                let volume = p.name.clone();
                (
                    node.proxy_export(p),
                    false,
                    String::new(),
                    volume,
                    Some(via),
                )
            }
            None => {
                warn!(
                    protocol = "nbd",
                    client = %client,
                    export = %n.export_name,
                    "nbd: export vanished during the handshake"
                );
                return;
            }
        },
    };
    drop(session);
    // The bitmaps the handshake selected, bound to their snapshots now: a name given to
    // another snapshot later does not change what this connection reports.
    let mut dirty_bitmaps = Vec::with_capacity(n.dirty_bitmaps.len());
    for (ctx, snapshot) in &n.dirty_bitmaps {
        match export.target.change_base(snapshot) {
            Some(base) => dirty_bitmaps.push((*ctx, base)),
            None => {
                warn!(
                    protocol = "nbd",
                    client = %client,
                    export = %n.export_name,
                    snapshot = %snapshot,
                    "nbd: the snapshot of a selected dirty bitmap was deleted during the \
                     handshake; connection closed"
                );
                return;
            }
        }
    }
    info!(
        protocol = "nbd",
        client = %client,
        export = %n.export_name,
        pool = %pool,
        volume = %volume,
        proxy = proxy.as_deref(),
        read_only = read_only || n.read_only,
        structured_replies = n.structured_replies,
        block_size_negotiated = n.block_size_negotiated,
        dirty_bitmaps = ?n.dirty_bitmaps.iter().map(|(_, s)| s).collect::<Vec<_>>(),
        "nbd: client connected"
    );
    let opts = ConnOptions {
        structured_replies: n.structured_replies,
        base_allocation: n.base_allocation,
        dirty_bitmaps,
        read_only: read_only || n.read_only,
        strict_block_size: n.block_size_negotiated,
        client: client.clone(),
        export: n.export_name,
    };
    let Some((stream, tls)) = stream.into_parts() else {
        return;
    };
    let tls = tls.map(|session| TlsLink::new(session, client));
    let fd = into_fd(stream);
    let budget = node.exports().buffers().conn(Some(slot));
    node.next_reactor().spawn(Box::new(move |io| {
        let conn = NbdConn::new(io, fd, &export, opts, budget);
        Box::new(match tls {
            Some(t) => conn.with_tls(t),
            None => conn,
        })
    }));
}

/// A socket the NBD listeners accept: TCP or Unix ([`Peer`] names the client in logs).
trait NbdSocket: Peer + io::Read + io::Write + Into<OwnedFd> + Send + 'static {
    fn set_timeouts(&self, t: Option<Duration>);
}

impl NbdSocket for std::net::TcpStream {
    fn set_timeouts(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
        let _ = self.set_write_timeout(t);
    }
}

impl NbdSocket for std::os::unix::net::UnixStream {
    fn set_timeouts(&self, t: Option<Duration>) {
        let _ = self.set_read_timeout(t);
        let _ = self.set_write_timeout(t);
    }
}

/// Connections refused at a listener's cap: at most 10 lines per 10 s.
static CAP_LOG: LogLimiter = LogLimiter::new("nbd-connection-cap", 10, 10);

/// Accept connections forever: each gets a handshake thread (bounded by MAX_HANDSHAKES,
/// timed out by HANDSHAKE_TIMEOUT), then moves to a reactor core. Past `cap` open
/// connections (handshakes included) a new one is closed at once.
///
/// The loop holds the node weakly: a node dropped in process (an in-process test node that
/// is stopped and started again on its data directory) is not kept alive, with its data
/// directory's lock, by a listener blocked in accept; a connection that arrives after
/// that is closed.
fn accept_loop<S: NbdSocket>(
    node: Weak<Node>,
    cap: Arc<ListenerCap>,
    incoming: impl Iterator<Item = io::Result<S>>,
) {
    accept_each(incoming, &cap, "nbd", &CAP_LOG, |s, slot| {
        let Some(node) = node.upgrade() else {
            return; // dropping the stream closes it
        };
        if HANDSHAKES.fetch_add(1, Relaxed) >= MAX_HANDSHAKES {
            HANDSHAKES.fetch_sub(1, Relaxed);
            return; // dropping the stream closes it
        }
        s.set_timeouts(Some(HANDSHAKE_TIMEOUT));
        let client = s.peer();
        let r = std::thread::Builder::new()
            .name("tessera-nbd-hs".into())
            .spawn(move || {
                serve_client(node, s, client, slot, |s| {
                    s.set_timeouts(None);
                    s.into()
                });
                HANDSHAKES.fetch_sub(1, Relaxed);
            });
        if r.is_err() {
            HANDSHAKES.fetch_sub(1, Relaxed);
        }
    });
}

pub fn start_nbd_tcp(node: &Arc<Node>, addr: &str) -> io::Result<String> {
    let l = TcpListener::bind(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot listen for NBD on {addr}: {e}")))?;
    let local = l.local_addr()?.to_string();
    let cap = node
        .exports()
        .listener_cap("nbd", local.clone(), node.cfg.nbd.max_connections);
    let node = Arc::downgrade(node);
    std::thread::Builder::new()
        .name("tessera-nbd-accept".into())
        .spawn(move || {
            accept_loop(
                node,
                cap,
                l.incoming().map(|s| {
                    let s = s?;
                    let _ = s.set_nodelay(true);
                    Ok(s)
                }),
            )
        })?;
    Ok(local)
}

pub fn start_nbd_unix(node: &Arc<Node>, path: &Path) -> io::Result<()> {
    let l = bind_unix(path)?;
    let address = format!("unix:{}", path.display());
    let cap = node
        .exports()
        .listener_cap("nbd", address, node.cfg.nbd.max_connections);
    let node = Arc::downgrade(node);
    std::thread::Builder::new()
        .name("tessera-nbd-accept-unix".into())
        .spawn(move || accept_loop(node, cap, l.incoming()))?;
    Ok(())
}
