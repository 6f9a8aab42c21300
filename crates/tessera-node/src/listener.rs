//! Listeners: the management API and NBD (TCP and Unix). NBD handshakes run on a thread per
//! connection (bounded, with a timeout), then the socket moves to a reactor core for the
//! transmission phase.

use std::io;
use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tessera_nbd::conn::{ConnOptions, NbdConn};
use tessera_nbd::handshake::{negotiate, HandshakeOutcome};

use crate::node::Node;

/// Handshakes in progress at once; more connections are refused until some finish.
const MAX_HANDSHAKES: usize = 256;
/// A client that does not finish its handshake in this time is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);

fn bind_unix(path: &Path) -> io::Result<UnixListener> {
    if path.exists() {
        // A socket left by a previous run: remove it only if nobody answers on it.
        unix_socket_free(path)?;
        std::fs::remove_file(path)?;
    }
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
/// busy one only turns NVMe/TCP off there, as `nvmf::start` says.)
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

pub fn start_api(node: &Arc<Node>) -> io::Result<()> {
    let n = node.clone();
    let handler: tessera_http::Handler = Arc::new(move |req| crate::api::handle(&n, req));
    let l = bind_unix(&node.cfg.api_socket())?;
    let h = handler.clone();
    std::thread::Builder::new()
        .name("tessera-api".into())
        .spawn(move || tessera_http::serve_unix(l, h))?;
    if let Some(addr) = &node.cfg.api.tcp {
        let l = TcpListener::bind(addr)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        std::thread::Builder::new()
            .name("tessera-api-tcp".into())
            .spawn(move || tessera_http::serve_tcp(l, handler))?;
    }
    Ok(())
}

/// Run the handshake on `stream`; on success hand the socket to a reactor core.
fn serve_client<S>(node: Arc<Node>, mut stream: S, into_fd: impl FnOnce(S) -> OwnedFd)
where
    S: io::Read + io::Write,
{
    let outcome = negotiate(&mut stream, &*node);
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
        Err(e) => {
            eprintln!("tessera: nbd: handshake failed: {e}");
            return;
        }
    };
    let Some((vol, read_only)) = node.resolve_export(&n.export_name) else {
        eprintln!(
            "tessera: nbd: export '{}' vanished during the handshake",
            n.export_name
        );
        return;
    };
    let export = node.export_of(&vol);
    let opts = ConnOptions {
        structured_replies: n.structured_replies,
        base_allocation: n.base_allocation,
        read_only: read_only || n.read_only,
    };
    let fd = into_fd(stream);
    node.next_reactor().spawn(Box::new(move |io| {
        Box::new(NbdConn::new(io, fd, &export, opts))
    }));
}

/// A socket the NBD listeners accept: TCP or Unix.
trait NbdSocket: io::Read + io::Write + Into<OwnedFd> + Send + 'static {
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

/// Accept connections forever: each gets a handshake thread (bounded by MAX_HANDSHAKES,
/// timed out by HANDSHAKE_TIMEOUT), then moves to a reactor core.
fn accept_loop<S: NbdSocket>(node: Arc<Node>, incoming: impl Iterator<Item = io::Result<S>>) {
    for s in incoming {
        let Ok(s) = s else { continue };
        if HANDSHAKES.fetch_add(1, Relaxed) >= MAX_HANDSHAKES {
            HANDSHAKES.fetch_sub(1, Relaxed);
            continue; // dropping the stream closes it
        }
        s.set_timeouts(Some(HANDSHAKE_TIMEOUT));
        let node = node.clone();
        let r = std::thread::Builder::new()
            .name("tessera-nbd-hs".into())
            .spawn(move || {
                serve_client(node, s, |s| {
                    s.set_timeouts(None);
                    s.into()
                });
                HANDSHAKES.fetch_sub(1, Relaxed);
            });
        if r.is_err() {
            HANDSHAKES.fetch_sub(1, Relaxed);
        }
    }
}

pub fn start_nbd_tcp(node: &Arc<Node>, addr: &str) -> io::Result<String> {
    let l = TcpListener::bind(addr)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot listen for NBD on {addr}: {e}")))?;
    let local = l.local_addr()?.to_string();
    let node = node.clone();
    std::thread::Builder::new()
        .name("tessera-nbd-accept".into())
        .spawn(move || {
            accept_loop(
                node,
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
    let node = node.clone();
    std::thread::Builder::new()
        .name("tessera-nbd-accept-unix".into())
        .spawn(move || accept_loop(node, l.incoming()))?;
    Ok(())
}
