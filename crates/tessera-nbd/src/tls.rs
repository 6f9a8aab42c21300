//! TLS for NBD (`NBD_OPT_STARTTLS`, X.509 with rustls).
//!
//! Three pieces:
//! - [`server_config`]: the server's identity (certificate chain and key, PEM) and, when
//!   a CA is given, mandatory client certificates signed by it.
//! - [`HandshakeStream`]: the blocking stream option haggling runs on; after the server
//!   acknowledged `NBD_OPT_STARTTLS` it runs the TLS handshake on the same socket and
//!   every later option is read and answered inside TLS.
//! - [`TlsLink`]: the transmission phase on a reactor core. The socket still moves
//!   through the export layer's `Socket` (one receive, one gathered send): a receive
//!   lands in the link's ciphertext buffer and is decrypted into the buffer the
//!   connection asked for (its receive buffer or a WRITE payload), and a gathered batch of
//!   replies is encrypted into one buffer that is sent in place of the batch. No thread
//!   and no extra system call per request; a connection without TLS never touches this.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, StreamOwned};
use tessera_export::conn::{SendBatch, Socket};
use tessera_io::{CoreIo, Tag};
use tracing::warn;

use crate::handshake::HandshakeIo;

pub use rustls::{ServerConfig, ServerConnection};

/// Ciphertext received per `recv`: room for several full TLS records (16 KiB + header
/// and tag each), so a deep queue of small requests is taken in one receive.
const CIPHER_BUF: usize = 256 << 10;

/// Why an NBD listener's TLS configuration cannot be built: each names the file (and
/// what it should hold) and keeps the error that reading or using it gave.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read NBD TLS {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The PEM does not parse.
    #[error("NBD TLS {what} {}: {source}", path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("NBD TLS {what} {} holds no PEM certificate", path.display())]
    NoCertificate { what: &'static str, path: PathBuf },
    #[error("NBD TLS key {} holds no PEM private key", path.display())]
    NoKey { path: PathBuf },
    /// rustls refuses a file's contents (a certificate, a CA, the key for the chain).
    #[error("NBD TLS {what} {}: {source}", path.display())]
    Refused {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("NBD TLS client CA {}: {source}", path.display())]
    Verifier {
        path: PathBuf,
        #[source]
        source: rustls::server::VerifierBuilderError,
    },
    #[error("NBD TLS: {0}")]
    Provider(#[source] rustls::Error),
}

fn read_pem(path: &Path, what: &'static str) -> Result<Vec<u8>, TlsConfigError> {
    std::fs::read(path).map_err(|source| TlsConfigError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn certs_of(
    path: &Path,
    what: &'static str,
) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem = read_pem(path, what)?;
    let certs = rustls_pemfile::certs(&mut &pem[..])
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsConfigError::Pem {
            what,
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The TLS configuration of an NBD listener: `cert` (PEM, the server's certificate
/// chain), `key` (PEM, its private key) and, with `client_ca`, client certificates are
/// required and must be signed by that CA (PEM, one or more certificates).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsConfigError> {
    let chain = certs_of(cert, "certificate")?;
    let key_pem = read_pem(key, "key")?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|source| TlsConfigError::Pem {
            what: "key",
            path: key.to_path_buf(),
            source,
        })?
        .ok_or_else(|| TlsConfigError::NoKey {
            path: key.to_path_buf(),
        })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Provider)?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in certs_of(ca, "client CA")? {
                roots.add(c).map_err(|source| TlsConfigError::Refused {
                    what: "client CA",
                    path: ca.to_path_buf(),
                    source,
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|source| TlsConfigError::Verifier {
                    path: ca.to_path_buf(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let cfg = builder
        .with_single_cert(chain, key)
        .map_err(|source| TlsConfigError::Refused {
            what: "certificate",
            path: cert.to_path_buf(),
            source,
        })?;
    Ok(Arc::new(cfg))
}

enum Stream<S: Read + Write> {
    Plain(S),
    Tls(Box<StreamOwned<ServerConnection, S>>),
    /// A TLS handshake failed half-way; the connection is being closed.
    Broken,
}

/// The socket option haggling runs on: plain until `NBD_OPT_STARTTLS` was acknowledged,
/// TLS after. `config` is `None` when the listener offers no TLS.
pub struct HandshakeStream<S: Read + Write> {
    stream: Stream<S>,
    config: Option<Arc<ServerConfig>>,
}

impl<S: Read + Write> HandshakeStream<S> {
    pub fn new(s: S, config: Option<Arc<ServerConfig>>) -> Self {
        HandshakeStream {
            stream: Stream::Plain(s),
            config,
        }
    }

    /// The socket and, if TLS was started, its session (which may already hold received
    /// bytes: it goes with the socket to the transmission phase).
    pub fn into_parts(self) -> Option<(S, Option<ServerConnection>)> {
        match self.stream {
            Stream::Plain(s) => Some((s, None)),
            Stream::Tls(t) => {
                let t = *t;
                Some((t.sock, Some(t.conn)))
            }
            Stream::Broken => None,
        }
    }
}

fn broken() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "TLS handshake failed earlier")
}

impl<S: Read + Write> Read for HandshakeStream<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &mut self.stream {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
            Stream::Broken => Err(broken()),
        }
    }
}

impl<S: Read + Write> Write for HandshakeStream<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.stream {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
            Stream::Broken => Err(broken()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match &mut self.stream {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(t) => t.flush(),
            Stream::Broken => Err(broken()),
        }
    }
}

impl<S: Read + Write> HandshakeIo for HandshakeStream<S> {
    fn tls_offered(&self) -> bool {
        self.config.is_some()
    }

    fn tls_active(&self) -> bool {
        matches!(self.stream, Stream::Tls(_))
    }

    fn start_tls(&mut self) -> io::Result<()> {
        let Some(cfg) = self.config.clone() else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "TLS is not offered",
            ));
        };
        let Stream::Plain(mut sock) = std::mem::replace(&mut self.stream, Stream::Broken) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "TLS is already running",
            ));
        };
        let mut conn = ServerConnection::new(cfg).map_err(io::Error::other)?;
        // Replies are encrypted in batches of whatever the reactor gathered; rustls must
        // take them whole (its default limit would make writes partial).
        conn.set_buffer_limit(None);
        while conn.is_handshaking() {
            // On a bad certificate or garbage, rustls queues an alert: try to tell the
            // client why before closing.
            if let Err(e) = conn.complete_io(&mut sock) {
                let _ = conn.write_tls(&mut sock);
                return Err(e);
            }
        }
        // Session tickets and the like go out before the first option reply.
        while conn.wants_write() {
            conn.write_tls(&mut sock)?;
        }
        self.stream = Stream::Tls(Box::new(StreamOwned::new(conn, sock)));
        Ok(())
    }
}

/// What a TLS receive brought.
enum Decrypted {
    /// Plaintext bytes written to the destination (0: a record is not complete yet).
    Bytes(usize),
    /// The client closed the TLS session (close_notify) or the socket.
    Closed,
}

/// The TLS session of a connection in the transmission phase, on its reactor core.
pub struct TlsLink {
    conn: ServerConnection,
    /// Ciphertext received and not yet handed to rustls: `[start, end)`.
    cipher: Vec<u8>,
    start: usize,
    end: usize,
    /// Where the connection wants the next plaintext: set when it posts a receive.
    dest: *mut u8,
    dest_len: usize,
    /// The posted receive was completed from plaintext already decrypted.
    inline: bool,
    /// Encrypted replies being sent.
    out: Vec<u8>,
    close_sent: bool,
    /// Who to name in the log.
    peer: String,
}

// SAFETY: `dest` points into buffers of the connection that owns this link and is only
// used on the core that runs it; the link moves between threads only before the
// connection starts (from the handshake thread to the reactor), when no receive is posted.
unsafe impl Send for TlsLink {}

impl TlsLink {
    pub fn new(conn: ServerConnection, peer: String) -> Box<TlsLink> {
        Box::new(TlsLink {
            conn,
            cipher: vec![0; CIPHER_BUF],
            start: 0,
            end: 0,
            dest: std::ptr::null_mut(),
            dest_len: 0,
            inline: false,
            out: Vec::new(),
            close_sent: false,
            peer,
        })
    }

    /// Post a receive of up to `len` plaintext bytes at `ptr`, completing for `tag` with
    /// the number of plaintext bytes, as a plain socket receive would. Plaintext already
    /// decrypted is delivered at once (through the core's ready queue); otherwise the
    /// socket receives ciphertext into the link's buffer.
    ///
    /// # Safety
    /// As [`Socket::post_recv`]: `[ptr, ptr+len)` stays valid and untouched until the
    /// completion for `tag`.
    pub unsafe fn post_recv(
        &mut self,
        sock: &mut Socket,
        io: &mut CoreIo,
        ptr: *mut u8,
        len: usize,
        tag: Tag,
    ) {
        self.dest = ptr;
        // A completion reports the bytes received as an i32.
        self.dest_len = len.min(i32::MAX as usize);
        match self.decrypt() {
            Ok(Decrypted::Bytes(0)) => {}
            Ok(Decrypted::Bytes(n)) => {
                self.inline = true;
                // n <= dest_len <= i32::MAX: exact.
                sock.complete_recv_now(io, i32::try_from(n).unwrap_or(i32::MAX), tag);
                return;
            }
            Ok(Decrypted::Closed) => {
                self.inline = true;
                sock.complete_recv_now(io, 0, tag);
                return;
            }
            Err(()) => {
                self.inline = true;
                sock.complete_recv_now(io, -libc::EPROTO, tag);
                return;
            }
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.cipher.len() {
            self.cipher.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = self.cipher.len() - self.end;
        // SAFETY: the ciphertext buffer belongs to this link, which the connection keeps
        // until the receive completes; it is not touched while the receive is posted
        // (decrypt runs only here, before posting, and in recv_done).
        unsafe {
            let p = self.cipher.as_mut_ptr().add(self.end);
            sock.post_recv(io, p, room, tag)
        };
    }

    /// The receive posted by [`TlsLink::post_recv`] completed with `res`: the number of
    /// plaintext bytes now at the destination, or `None` when the connection ends (EOF,
    /// socket error or a TLS error, which is logged).
    pub fn recv_done(&mut self, sock: &mut Socket, res: i32) -> Option<usize> {
        let n = sock.recv_done(res)?;
        if std::mem::take(&mut self.inline) {
            return Some(n);
        }
        self.end += n;
        match self.decrypt() {
            Ok(Decrypted::Bytes(n)) => Some(n),
            Ok(Decrypted::Closed) => {
                sock.draining = true;
                None
            }
            Err(()) => {
                sock.draining = true;
                sock.dead = true;
                None
            }
        }
    }

    /// Hand buffered ciphertext to rustls and copy plaintext to the destination until it
    /// is full or nothing more can be decrypted.
    fn decrypt(&mut self) -> Result<Decrypted, ()> {
        let mut got = 0;
        loop {
            if got < self.dest_len {
                // SAFETY: the destination was handed to post_recv, whose caller keeps it
                // valid and unused until the receive completes; got < dest_len.
                let dest = unsafe {
                    std::slice::from_raw_parts_mut(self.dest.add(got), self.dest_len - got)
                };
                match self.conn.reader().read(dest) {
                    Ok(0) => {
                        // close_notify: nothing more will come.
                        return Ok(if got > 0 {
                            Decrypted::Bytes(got)
                        } else {
                            Decrypted::Closed
                        });
                    }
                    Ok(k) => got += k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => {
                        warn!(client = %self.peer, error = %e, "nbd: TLS receive failed, closing the connection");
                        return Err(());
                    }
                }
            }
            if got == self.dest_len || self.start == self.end {
                return Ok(Decrypted::Bytes(got));
            }
            let mut rd = &self.cipher[self.start..self.end];
            match self.conn.read_tls(&mut rd) {
                // close_notify was received: the rest is ignored.
                Ok(0) => self.start = self.end,
                Ok(k) => self.start += k,
                // Plaintext is drained into the destination before each call, so this is
                // not "plaintext buffer full" but a record rustls cannot take.
                Err(e) => {
                    warn!(client = %self.peer, error = %e, "nbd: bad TLS data from the client, closing the connection");
                    return Err(());
                }
            }
            if let Err(e) = self.conn.process_new_packets() {
                // The alert rustls queued is not sent (the ring owns the socket, and the
                // connection is closing): the client sees the connection close.
                warn!(client = %self.peer, error = %e, "nbd: bad TLS data from the client, closing the connection");
                return Err(());
            }
        }
    }

    /// Encrypt the gathered replies in `batch` and replace them with the ciphertext.
    /// The plaintext is copied, so the slots could be reused at once; the connection
    /// still releases them when the send completes, as without TLS.
    pub fn seal(&mut self, batch: &mut SendBatch) -> io::Result<()> {
        for v in batch.remaining() {
            // SAFETY: the iovecs point at reply headers and buffers the connection holds
            // until the send completes.
            let b = unsafe { std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len) };
            self.conn.writer().write_all(b)?;
        }
        self.flush_into(batch)
    }

    fn flush_into(&mut self, batch: &mut SendBatch) -> io::Result<()> {
        self.out.clear();
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.out)?;
        }
        batch.clear();
        if !self.out.is_empty() {
            batch.push(self.out.as_ptr(), self.out.len());
        }
        Ok(())
    }

    /// Queue the TLS close_notify into `batch` (once). Returns whether there is anything
    /// to send.
    pub fn close(&mut self, batch: &mut SendBatch) -> bool {
        if self.close_sent {
            return false;
        }
        self.close_sent = true;
        self.conn.send_close_notify();
        self.flush_into(batch).is_ok() && !batch.is_done()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_certificate_files_are_clear_errors() {
        let dir = std::env::temp_dir().join(format!("tessera-nbd-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let e = server_config(&missing, &missing, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot read NBD TLS certificate") && e.contains("missing.pem"),
            "{e}"
        );
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not a certificate\n").unwrap();
        let e = server_config(&junk, &junk, None).unwrap_err().to_string();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
