//! systemd's readiness protocol (`sd_notify(3)`): one datagram of `KEY=VALUE` lines to the
//! Unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace).
//! Without the variable (not started by systemd with `Type=notify`) it does nothing.

use std::io;
use std::os::unix::net::UnixDatagram;

/// Send `state` (e.g. `"READY=1"`) to the service manager, if there is one. A manager
/// that is gone is not the node's problem: the error is returned for a log line only.
pub fn notify(state: &str) -> io::Result<()> {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let target = target
        .into_string()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NOTIFY_SOCKET is not UTF-8"))?;
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = target.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else if target.starts_with('/') {
        sock.send_to(state.as_bytes(), &target)?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET {target:?} is neither an absolute path nor @abstract"),
        ));
    }
    Ok(())
}
