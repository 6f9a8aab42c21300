//! rustls configurations: the API server's (PEM certificate chain and key) and the CLI's
//! (a CA to trust). Both use the ring provider explicitly, so that another crate enabling
//! a second provider cannot make the process default ambiguous.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(what: &str, path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what} {}: {why}", path.display()),
    )
}

fn read(what: &str, path: &Path) -> io::Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", path.display())))
}

/// The certificates of a PEM file (a chain: leaf first).
pub fn load_certs(what: &str, path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem = read(what, path)?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(what, path, e))?;
    if certs.is_empty() {
        return Err(invalid(what, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    let what = "TLS key";
    let pem = read(what, path)?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| invalid(what, path, e))?
        .ok_or_else(|| invalid(what, path, "no PEM private key in it"))
}

/// The server side of the API's TLS: HTTP/1.1 only, TLS 1.2 and 1.3.
pub fn server_config(cert: &Path, key: &Path) -> io::Result<Arc<rustls::ServerConfig>> {
    let chain = load_certs("TLS certificate", cert)?;
    let key = load_key(key)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            invalid(
                "TLS certificate",
                cert,
                format!("does not go with the key: {e}"),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The CLI's side: trust the CA certificates of `ca` (PEM), or the system's bundle.
pub fn client_config(ca: Option<&Path>) -> io::Result<Arc<rustls::ClientConfig>> {
    const SYSTEM_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
    let path = ca.unwrap_or(Path::new(SYSTEM_BUNDLE));
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs("CA certificate", path)? {
        roots
            .add(cert)
            .map_err(|e| invalid("CA certificate", path, e))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
