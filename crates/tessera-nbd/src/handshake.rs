//! Server side of the NBD fixed-newstyle handshake ("option haggling").
//!
//! [`negotiate`] runs on a blocking control-plane thread: it greets the client, answers
//! options until the client picks an export (`NBD_OPT_GO` / `NBD_OPT_EXPORT_NAME`) or
//! aborts, and returns what was agreed so the connection can be handed to a reactor core
//! for the transmission phase.
//!
//! Everything the client sends is untrusted: every length field is bounds-checked against
//! the data actually received, option payloads are capped before anything is allocated,
//! and the number of options per connection is limited, so a hostile client can neither
//! crash the thread nor make it allocate without bound. Read timeouts are the caller's
//! business (set them on the socket before calling).
//!
//! Deliberate choices (all permitted by `doc/proto.md`):
//! - TLS (see `crate::tls`): without a server certificate the server runs in NOTLS mode
//!   (`NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`). With one, in SELECTIVETLS mode:
//!   STARTTLS is acknowledged, the TLS handshake runs on the socket and option haggling
//!   continues inside TLS, with every earlier option's state forgotten, as the spec
//!   requires. Before TLS, a TLS-only export ([`ExportInfo::tls_required`]) is left out
//!   of `NBD_OPT_LIST`, treated as unknown by the metadata-context options, refused with
//!   `NBD_REP_ERR_TLS_REQD` (and no `NBD_REP_INFO`) by INFO/GO and by a hang-up on
//!   EXPORT_NAME; while any export is TLS-only, unknown names get `NBD_REP_ERR_TLS_REQD`
//!   too, so a client without TLS cannot tell which TLS-only names exist. When every
//!   export is TLS-only the server runs in FORCEDTLS mode: before TLS every option but
//!   STARTTLS and ABORT gets `NBD_REP_ERR_TLS_REQD`, so nothing about the exports is
//!   revealed. A TLS-only export on a server without a certificate cannot be reached:
//!   `NBD_REP_ERR_POLICY`.
//! - An empty export name selects the *default export*, which is the first name returned
//!   by [`ExportCatalog::list`]; with an empty catalogue there is no default export.
//! - `NBD_INFO_BLOCK_SIZE` is always sent, requested or not (512 is what is efficient);
//!   [`Negotiated::block_size_negotiated`] records whether the client asked for it and
//!   therefore promised to honour it: only then are unaligned requests refused, others
//!   are served by read-modify-write (`conn.rs`).
//! - `NBD_FLAG_SEND_DF` is only advertised once structured replies were negotiated, as
//!   the spec requires.
//! - Metadata contexts: `base:allocation`, and qemu's `qemu:dirty-bitmap:NAME` (its
//!   `docs/interop/nbd.rst`) for every snapshot NAME the export descends from
//!   ([`ExportCatalog::dirty_bitmaps`]): bit 0 set marks the blocks changed since that
//!   snapshot. LIST takes `base:`, `qemu:` and `qemu:dirty-bitmap:` as wildcards (and no
//!   query as all of them); SET takes exact names only and ignores the rest, an unknown
//!   bitmap with a log line. Ids: 1 for `base:allocation`, 2, 3, ... for the bitmaps in
//!   the order the client asked for them.

use std::fmt;
use std::io::{self, Read, Write};

use tessera_export::log_limit::LogLimiter;
use tessera_io::cast::u32_of;
use tracing::info;

use crate::proto;

/// Largest option payload we are willing to buffer. Real clients send a few hundred bytes
/// at most (an export name is at most 4096 bytes by the spec's string rule).
const MAX_OPTION_LEN: u32 = 64 * 1024;

/// Largest oversized option payload we still read and throw away so that we can answer
/// `NBD_REP_ERR_TOO_BIG` and stay in sync. Anything beyond this is treated as an attack
/// and the connection is dropped rather than spending bandwidth on it.
const MAX_DISCARD_LEN: u32 = 16 << 20;

/// Options accepted on one connection before we give up on the client. Real clients need
/// fewer than ten; the spec allows a hard disconnect on denial-of-service behaviour.
const MAX_OPTIONS: usize = 1024;

/// The spec's upper bound for any string (export names, messages, descriptions).
const MAX_STRING: usize = 4096;

/// Metadata context id handed out for `base:allocation` by `NBD_OPT_SET_META_CONTEXT`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Id of the first `qemu:dirty-bitmap:` context a SET selects; the next get the next ids.
pub const FIRST_DIRTY_BITMAP_ID: u32 = 2;

/// Dirty-bitmap contexts one SET may select (each costs a chunk per block status reply);
/// more get `NBD_REP_ERR_TOO_BIG`. Backup tools use one.
pub const MAX_DIRTY_BITMAPS: usize = 16;

/// SETs naming a bitmap the export does not have: at most 10 lines per 10 s.
static UNKNOWN_BITMAP_LOG: LogLimiter = LogLimiter::new("nbd-unknown-bitmap", 10, 10);

/// What the catalogue tells the handshake about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub read_only: bool,
    pub description: String,
    /// Only a client that started TLS may see or use this export.
    pub tls_required: bool,
}

/// The set of exports a listener serves.
pub trait ExportCatalog: Send + Sync {
    /// Export names for `NBD_OPT_LIST`. The first entry is also the default export.
    fn list(&self) -> Vec<String>;
    fn lookup(&self, name: &str) -> Option<ExportInfo>;
    /// The dirty bitmaps export `name` offers as `qemu:dirty-bitmap:NAME` contexts: the
    /// snapshots it can report its changes since. None by default.
    fn dirty_bitmaps(&self, _name: &str) -> Vec<String> {
        Vec::new()
    }
    /// A client is about to use export `name` (`NBD_OPT_INFO`, `NBD_OPT_GO`,
    /// `NBD_OPT_EXPORT_NAME`), which [`ExportCatalog::lookup`] described as `info` and TLS
    /// allows. A catalogue whose exports need work before they can be served (one served
    /// by another node, connected on demand) does it here and returns the final
    /// description, or says why the export cannot be served now: the client gets
    /// `NBD_REP_ERR_UNKNOWN` with that message. Listing never calls this. By default the
    /// description stands.
    fn prepare(&self, _name: &str, info: ExportInfo) -> Result<ExportInfo, PrepareError> {
        Ok(info)
    }
}

/// Why [`ExportCatalog::prepare`] cannot serve an export now. The client reads its message
/// (`NBD_REP_ERR_UNKNOWN`); the catalogue's own error stays its cause.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The catalogue knows no export of that name (any more).
    #[error("no export named \"{0}\"")]
    NoSuchExport(String),
    /// The export exists but cannot be served now (its owner is unreachable, ...).
    #[error(transparent)]
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
}

/// The outcome of a successful negotiation: everything the transmission phase needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Canonical export name (the default export's real name if the client sent "").
    pub export_name: String,
    pub size: u64,
    pub read_only: bool,
    pub structured_replies: bool,
    /// Some(id) when base:allocation was selected with NBD_OPT_SET_META_CONTEXT for this export (use id 1).
    pub base_allocation: Option<u32>,
    /// The `qemu:dirty-bitmap:NAME` contexts selected for this export, as (context id,
    /// NAME), in id order.
    pub dirty_bitmaps: Vec<(u32, String)>,
    /// The client requested NBD_INFO_BLOCK_SIZE in NBD_OPT_GO (so it promised to honour constraints).
    pub block_size_negotiated: bool,
    /// The client set NBD_FLAG_C_NO_ZEROES.
    pub no_zeroes: bool,
    /// The session runs over TLS.
    pub tls: bool,
}

impl Negotiated {
    /// The transmission flags that were sent to the client for this export.
    pub fn transmission_flags(&self) -> u16 {
        export_flags(self.read_only, self.structured_replies)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeOutcome {
    /// Option haggling finished; the stream is now in the transmission phase.
    Transmission(Negotiated),
    /// The client sent `NBD_OPT_ABORT`; just close the connection.
    Closed,
}

/// Why negotiation failed. In every case the caller should simply close the connection:
/// anything that could be reported to the client has already been reported.
#[derive(Debug)]
pub enum HandshakeError {
    /// The socket failed or the client hung up (EOF shows up as `UnexpectedEof`).
    Io(io::Error),
    /// The client broke a rule that leaves no way to answer it (bad magic, unknown
    /// client flags, an unknown export with `NBD_OPT_EXPORT_NAME`, ...).
    Protocol(String),
    /// The TLS handshake after `NBD_OPT_STARTTLS` failed (bad or missing client
    /// certificate, garbage instead of a ClientHello, the client hung up).
    Tls(io::Error),
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::Io(e) => write!(f, "NBD handshake I/O error: {e}"),
            HandshakeError::Protocol(m) => write!(f, "NBD handshake protocol violation: {m}"),
            HandshakeError::Tls(e) => write!(f, "NBD TLS handshake failed: {e}"),
        }
    }
}

impl std::error::Error for HandshakeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HandshakeError::Io(e) | HandshakeError::Tls(e) => Some(e),
            HandshakeError::Protocol(_) => None,
        }
    }
}

impl From<io::Error> for HandshakeError {
    fn from(e: io::Error) -> Self {
        HandshakeError::Io(e)
    }
}

fn protocol<T>(msg: impl Into<String>) -> Result<T, HandshakeError> {
    Err(HandshakeError::Protocol(msg.into()))
}

/// Transmission flags for an export. `NBD_FLAG_SEND_DF` MUST be clear unless structured
/// replies were negotiated (DF only means something for structured READ replies).
fn export_flags(read_only: bool, structured_replies: bool) -> u16 {
    let f = proto::transmission_flags(read_only);
    if structured_replies {
        f
    } else {
        f & !proto::TFLAG_SEND_DF
    }
}

/// The stream option haggling runs on, and its TLS upgrade.
pub trait HandshakeIo: Read + Write {
    /// The server has a certificate: `NBD_OPT_STARTTLS` is acknowledged.
    fn tls_offered(&self) -> bool;
    /// TLS was started on this stream.
    fn tls_active(&self) -> bool;
    /// Run the TLS handshake (the ACK to STARTTLS was sent); afterwards reads and writes
    /// go through TLS. An error ends the connection.
    fn start_tls(&mut self) -> io::Result<()>;
}

/// A stream without TLS (NOTLS mode).
struct NoTls<'a, S>(&'a mut S);

impl<S: Read> Read for NoTls<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<S: Write> Write for NoTls<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

impl<S: Read + Write> HandshakeIo for NoTls<'_, S> {
    fn tls_offered(&self) -> bool {
        false
    }
    fn tls_active(&self) -> bool {
        false
    }
    fn start_tls(&mut self) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Run the server side of the fixed-newstyle handshake on `s`, without TLS.
///
/// Returns [`HandshakeOutcome::Transmission`] once an export was selected (the next bytes
/// on `s` are transmission-phase requests), [`HandshakeOutcome::Closed`] after
/// `NBD_OPT_ABORT`, or an error after which the connection must be closed.
pub fn negotiate<S: Read + Write>(
    s: &mut S,
    catalog: &dyn ExportCatalog,
) -> Result<HandshakeOutcome, HandshakeError> {
    negotiate_io(&mut NoTls(s), catalog)
}

/// [`negotiate`] on a stream that may be upgraded to TLS (`crate::tls::HandshakeStream`).
pub fn negotiate_io<S: HandshakeIo>(
    s: &mut S,
    catalog: &dyn ExportCatalog,
) -> Result<HandshakeOutcome, HandshakeError> {
    let mut greeting = [0u8; 18];
    greeting[0..8].copy_from_slice(&proto::NBDMAGIC.to_be_bytes());
    greeting[8..16].copy_from_slice(&proto::IHAVEOPT.to_be_bytes());
    greeting[16..18]
        .copy_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting)?;
    s.flush()?;

    let client_flags = read_u32(s)?;
    let known = proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES;
    if client_flags & !known != 0 {
        // The spec says the server MUST drop the connection on unknown client flags.
        return protocol(format!("unknown client flags {client_flags:#010x}"));
    }
    if client_flags & proto::CLIENT_FLAG_FIXED_NEWSTYLE == 0 {
        // Plain newstyle clients cannot parse option replies; we only speak fixed newstyle.
        return protocol("client does not support fixed newstyle negotiation");
    }

    // The TLS mode is decided once per connection, as the spec requires.
    let (mut any_tls_only, mut all_tls_only, mut count) = (false, true, 0);
    if s.tls_offered() {
        for name in catalog.list() {
            if let Some(info) = catalog.lookup(&name) {
                any_tls_only |= info.tls_required;
                all_tls_only &= info.tls_required;
                count += 1;
            }
        }
    }
    let mut st = State {
        catalog,
        no_zeroes: client_flags & proto::CLIENT_FLAG_NO_ZEROES != 0,
        structured_replies: false,
        meta: None,
        out: Vec::new(),
        tls_offered: s.tls_offered(),
        tls_active: false,
        hide_unknown: any_tls_only,
        forced_tls: any_tls_only && all_tls_only && count > 0,
    };

    for _ in 0..MAX_OPTIONS {
        let mut hdr = [0u8; 16];
        s.read_exact(&mut hdr)?;
        let magic = u64::from_be_bytes(arr(&hdr[0..8]));
        let opt = u32::from_be_bytes(arr(&hdr[8..12]));
        let len = u32::from_be_bytes(arr(&hdr[12..16]));
        if magic != proto::IHAVEOPT {
            // Without the magic we cannot trust the length either, so no resync is possible.
            return protocol(format!("bad option magic {magic:#018x}"));
        }

        if len > MAX_OPTION_LEN {
            if opt == proto::OPT_EXPORT_NAME {
                // EXPORT_NAME has no error reply; the only way to refuse is to hang up.
                return protocol(format!("NBD_OPT_EXPORT_NAME with {len}-byte name"));
            }
            if len > MAX_DISCARD_LEN {
                return protocol(format!("option {opt} with oversized {len}-byte payload"));
            }
            discard(s, u64::from(len))?;
            if opt == proto::OPT_ABORT {
                // The spec says data sent with ABORT is to be ignored, not rejected.
                return Ok(abort(s));
            }
            st.error(
                opt,
                proto::REP_ERR_TOO_BIG,
                &format!("option payload of {len} bytes exceeds {MAX_OPTION_LEN}"),
            );
            st.send(s)?;
            continue;
        }

        // Always consume the whole payload before answering so the stream stays in sync.
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;

        if st.forced_tls && !st.tls_active && opt != proto::OPT_STARTTLS && opt != proto::OPT_ABORT
        {
            if opt == proto::OPT_EXPORT_NAME {
                // It cannot be answered with an error; the spec says to hang up.
                return protocol("NBD_OPT_EXPORT_NAME before TLS on a server that requires TLS");
            }
            st.error(
                opt,
                proto::REP_ERR_TLS_REQD,
                "this server requires TLS: send NBD_OPT_STARTTLS first",
            );
            st.send(s)?;
            continue;
        }

        match opt {
            proto::OPT_STARTTLS if st.tls_offered => {
                if !data.is_empty() {
                    st.error(
                        opt,
                        proto::REP_ERR_INVALID,
                        "NBD_OPT_STARTTLS takes no data",
                    );
                } else if st.tls_active {
                    st.error(opt, proto::REP_ERR_INVALID, "TLS is already running");
                } else {
                    st.ack(opt);
                    st.send(s)?;
                    s.start_tls().map_err(HandshakeError::Tls)?;
                    st.tls_active = true;
                    // The spec: nothing negotiated before STARTTLS survives it.
                    st.structured_replies = false;
                    st.meta = None;
                    continue;
                }
            }
            proto::OPT_EXPORT_NAME => {
                let n = st.export_name(s, &data)?;
                return Ok(HandshakeOutcome::Transmission(n));
            }
            proto::OPT_ABORT => return Ok(abort(s)),
            proto::OPT_LIST => st.list(&data),
            proto::OPT_STRUCTURED_REPLY => {
                if data.is_empty() {
                    st.structured_replies = true;
                    st.ack(opt);
                } else {
                    st.error(
                        opt,
                        proto::REP_ERR_INVALID,
                        "NBD_OPT_STRUCTURED_REPLY takes no data",
                    );
                }
            }
            proto::OPT_INFO | proto::OPT_GO => {
                if let Some(n) = st.info_or_go(opt, &data) {
                    st.send(s)?;
                    return Ok(HandshakeOutcome::Transmission(n));
                }
            }
            proto::OPT_LIST_META_CONTEXT | proto::OPT_SET_META_CONTEXT => {
                st.meta_context(opt, &data)
            }
            // STARTTLS: we run in NOTLS mode. EXTENDED_HEADERS: not implemented (64-bit
            // headers would change every transmission-phase codec).
            _ => st.error(
                opt,
                proto::REP_ERR_UNSUP,
                &format!("option {opt} is not supported by this server"),
            ),
        }
        st.send(s)?;
    }
    protocol(format!("client sent more than {MAX_OPTIONS} options"))
}

/// Reply to `NBD_OPT_ABORT`. The client may already have hung up (the spec tells servers
/// to cope with that), so write errors are irrelevant: the session is over either way.
fn abort<S: Write>(s: &mut S) -> HandshakeOutcome {
    let mut out = Vec::with_capacity(20);
    push_reply(&mut out, proto::OPT_ABORT, proto::REP_ACK, &[]);
    let _ = s.write_all(&out).and_then(|()| s.flush());
    HandshakeOutcome::Closed
}

/// Negotiation state carried between options.
struct State<'a> {
    catalog: &'a dyn ExportCatalog,
    no_zeroes: bool,
    structured_replies: bool,
    /// What the last `NBD_OPT_SET_META_CONTEXT` selected, if it selected anything.
    meta: Option<MetaSelection>,
    /// Replies for the current option, written in one go to avoid small packets.
    out: Vec<u8>,
    tls_offered: bool,
    tls_active: bool,
    /// Before TLS, unknown names get `NBD_REP_ERR_TLS_REQD` like TLS-only ones, so that
    /// TLS-only names cannot be probed.
    hide_unknown: bool,
    /// FORCEDTLS: every export is TLS-only; before TLS only STARTTLS and ABORT are served.
    forced_tls: bool,
}

/// The metadata contexts a SET selected, and the export (canonical name) they are for.
struct MetaSelection {
    export: String,
    base_allocation: bool,
    /// Snapshot names of the `qemu:dirty-bitmap:` contexts, in id order.
    dirty_bitmaps: Vec<String>,
}

/// A failure to handle an option that is reported to the client as an error reply.
struct OptError {
    rep: u32,
    msg: String,
}

impl OptError {
    fn invalid(msg: impl Into<String>) -> Self {
        OptError {
            rep: proto::REP_ERR_INVALID,
            msg: msg.into(),
        }
    }
}

impl State<'_> {
    fn send<S: Write>(&mut self, s: &mut S) -> io::Result<()> {
        let r = s.write_all(&self.out).and_then(|()| s.flush());
        self.out.clear();
        r
    }

    fn ack(&mut self, opt: u32) {
        push_reply(&mut self.out, opt, proto::REP_ACK, &[]);
    }

    fn error(&mut self, opt: u32, rep: u32, msg: &str) {
        push_reply(
            &mut self.out,
            opt,
            rep,
            truncate_str(msg, MAX_STRING).as_bytes(),
        );
    }

    /// Resolve a client-supplied name to a catalogue entry. The empty name means the
    /// default export, which is the first name of [`ExportCatalog::list`].
    fn resolve(&self, name: &[u8]) -> Result<(String, ExportInfo), OptError> {
        let name = std::str::from_utf8(name)
            .map_err(|_| OptError::invalid("export name is not valid UTF-8"))?;
        let canonical = if name.is_empty() {
            match self.catalog.list().into_iter().next() {
                Some(n) => n,
                None => {
                    return Err(OptError {
                        rep: proto::REP_ERR_UNKNOWN,
                        msg: "this server has no default export".into(),
                    })
                }
            }
        } else {
            name.to_owned()
        };
        match self.catalog.lookup(&canonical) {
            Some(info) => Ok((canonical, info)),
            None => Err(OptError {
                rep: proto::REP_ERR_UNKNOWN,
                msg: format!(
                    "no export named \"{}\"",
                    truncate_str(&canonical, 256).escape_debug()
                ),
            }),
        }
    }

    /// The export may not be used (or shown) on this session as it is now.
    fn tls_blocked(&self, info: &ExportInfo) -> bool {
        info.tls_required && !self.tls_active
    }

    /// [`State::resolve`] for options that must not reveal TLS-only exports before TLS:
    /// those look unknown.
    fn resolve_visible(&self, name: &[u8]) -> Result<(String, ExportInfo), OptError> {
        let (canonical, info) = self.resolve(name)?;
        if self.tls_blocked(&info) {
            return Err(OptError {
                rep: proto::REP_ERR_UNKNOWN,
                msg: format!(
                    "no export named \"{}\"",
                    truncate_str(&canonical, 256).escape_debug()
                ),
            });
        }
        Ok((canonical, info))
    }

    /// [`State::resolve`] for INFO and GO: a TLS-only export before TLS is refused with
    /// `NBD_REP_ERR_TLS_REQD` (unknown names too while TLS-only names are hidden), or
    /// with `NBD_REP_ERR_POLICY` when this server cannot do TLS at all.
    fn resolve_for_use(&self, name: &[u8]) -> Result<(String, ExportInfo), OptError> {
        let tls_reqd = |what: &str| OptError {
            rep: proto::REP_ERR_TLS_REQD,
            msg: format!("{what}: send NBD_OPT_STARTTLS first"),
        };
        match self.resolve(name) {
            Err(e) if e.rep == proto::REP_ERR_UNKNOWN && self.hide_unknown && !self.tls_active => {
                Err(tls_reqd("exports on this server require TLS"))
            }
            Err(e) => Err(e),
            Ok((canonical, info)) if self.tls_blocked(&info) => {
                if self.tls_offered {
                    Err(tls_reqd("this export requires TLS"))
                } else {
                    Err(OptError {
                        rep: proto::REP_ERR_POLICY,
                        msg: format!(
                            "export \"{}\" requires TLS, which this server is not configured for",
                            truncate_str(&canonical, 256).escape_debug()
                        ),
                    })
                }
            }
            Ok((canonical, info)) => match self.catalog.prepare(&canonical, info) {
                Ok(info) => Ok((canonical, info)),
                Err(e) => Err(OptError {
                    rep: proto::REP_ERR_UNKNOWN,
                    msg: e.to_string(),
                }),
            },
        }
    }

    fn negotiated(&self, name: String, info: &ExportInfo, block_size: bool) -> Negotiated {
        // Block status is only usable if the contexts were selected for the very export
        // that is now being entered (compared after resolving the default export).
        let selected = self.meta.as_ref().filter(|m| m.export == name);
        let base_allocation = selected
            .filter(|m| m.base_allocation)
            .map(|_| BASE_ALLOCATION_ID);
        let dirty_bitmaps = selected.map_or_else(Vec::new, |m| {
            (FIRST_DIRTY_BITMAP_ID..)
                .zip(m.dirty_bitmaps.iter().cloned())
                .collect()
        });
        Negotiated {
            export_name: name,
            size: info.size,
            read_only: info.read_only,
            structured_replies: self.structured_replies,
            base_allocation,
            dirty_bitmaps,
            block_size_negotiated: block_size,
            no_zeroes: self.no_zeroes,
            tls: self.tls_active,
        }
    }

    /// `NBD_OPT_EXPORT_NAME`: the old way to finish; it cannot report errors.
    fn export_name<S: Write>(
        &mut self,
        s: &mut S,
        data: &[u8],
    ) -> Result<Negotiated, HandshakeError> {
        let (name, info) = match self.resolve_for_use(data) {
            Ok(v) => v,
            Err(e) => return protocol(format!("NBD_OPT_EXPORT_NAME: {}", e.msg)),
        };
        let n = self.negotiated(name, &info, false);
        let mut out = Vec::with_capacity(10 + 124);
        out.extend_from_slice(&n.size.to_be_bytes());
        out.extend_from_slice(&n.transmission_flags().to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0u8; 124]);
        }
        s.write_all(&out)?;
        s.flush()?;
        Ok(n)
    }

    fn list(&mut self, data: &[u8]) {
        if !data.is_empty() {
            self.error(
                proto::OPT_LIST,
                proto::REP_ERR_INVALID,
                "NBD_OPT_LIST takes no data",
            );
            return;
        }
        for name in self.catalog.list() {
            let hidden = self
                .catalog
                .lookup(&name)
                .is_some_and(|info| self.tls_blocked(&info));
            if hidden {
                continue;
            }
            let mut p = Vec::with_capacity(4 + name.len());
            p.extend_from_slice(&u32_of(name.len()).to_be_bytes());
            p.extend_from_slice(name.as_bytes());
            push_reply(&mut self.out, proto::OPT_LIST, proto::REP_SERVER, &p);
        }
        self.ack(proto::OPT_LIST);
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO`. Returns `Some` when GO succeeded (replies are queued
    /// in `self.out` and must still be sent).
    fn info_or_go(&mut self, opt: u32, data: &[u8]) -> Option<Negotiated> {
        match self.try_info_or_go(opt, data) {
            Ok(n) => n,
            Err(e) => {
                self.error(opt, e.rep, &e.msg);
                None
            }
        }
    }

    fn try_info_or_go(&mut self, opt: u32, data: &[u8]) -> Result<Option<Negotiated>, OptError> {
        // Layout: u32 name length, name, u16 request count, count x u16.
        let mut r = Reader(data);
        let name_len = r
            .u32()
            .ok_or_else(|| OptError::invalid("option data too short for the name length"))?;
        let name = r
            .take(name_len as usize)
            .ok_or_else(|| OptError::invalid("export name length exceeds the option data"))?;
        let count = r.u16().ok_or_else(|| {
            OptError::invalid("option data too short for the information request count")
        })?;
        if r.0.len() != usize::from(count) * 2 {
            return Err(OptError::invalid(format!(
                "{count} information requests need {} bytes but {} remain",
                usize::from(count) * 2,
                r.0.len()
            )));
        }
        let (mut want_name, mut want_desc, mut want_block) = (false, false, false);
        while let Some(t) = r.u16() {
            match t {
                proto::INFO_NAME => want_name = true,
                proto::INFO_DESCRIPTION => want_desc = true,
                proto::INFO_BLOCK_SIZE => want_block = true,
                _ => {} // INFO_EXPORT is always sent; unknown requests MUST be ignored.
            }
        }

        let (canonical, info) = self.resolve_for_use(name)?;

        let mut p = Vec::with_capacity(14);
        p.extend_from_slice(&proto::INFO_EXPORT.to_be_bytes());
        p.extend_from_slice(&info.size.to_be_bytes());
        p.extend_from_slice(&export_flags(info.read_only, self.structured_replies).to_be_bytes());
        push_reply(&mut self.out, opt, proto::REP_INFO, &p);

        p.clear();
        p.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
        p.extend_from_slice(&proto::MIN_BLOCK.to_be_bytes());
        p.extend_from_slice(&proto::PREFERRED_BLOCK.to_be_bytes());
        p.extend_from_slice(&proto::MAX_PAYLOAD.to_be_bytes());
        push_reply(&mut self.out, opt, proto::REP_INFO, &p);

        if want_name {
            p.clear();
            p.extend_from_slice(&proto::INFO_NAME.to_be_bytes());
            p.extend_from_slice(canonical.as_bytes());
            push_reply(&mut self.out, opt, proto::REP_INFO, &p);
        }
        if want_desc {
            p.clear();
            p.extend_from_slice(&proto::INFO_DESCRIPTION.to_be_bytes());
            p.extend_from_slice(truncate_str(&info.description, MAX_STRING).as_bytes());
            push_reply(&mut self.out, opt, proto::REP_INFO, &p);
        }
        self.ack(opt);

        if opt == proto::OPT_GO {
            Ok(Some(self.negotiated(canonical, &info, want_block)))
        } else {
            Ok(None)
        }
    }

    fn meta_context(&mut self, opt: u32, data: &[u8]) {
        let set = opt == proto::OPT_SET_META_CONTEXT;
        if set {
            // SET replaces the previous selection even when it fails.
            self.meta = None;
        }
        match self.try_meta_context(set, data) {
            Ok(contexts) => {
                for (id, name) in contexts {
                    let mut p = Vec::with_capacity(4 + name.len());
                    p.extend_from_slice(&id.to_be_bytes());
                    p.extend_from_slice(name.as_bytes());
                    push_reply(&mut self.out, opt, proto::REP_META_CONTEXT, &p);
                }
                self.ack(opt);
            }
            // The selection was already cleared above, so a failed SET selects nothing.
            Err(e) => self.error(opt, e.rep, &e.msg),
        }
    }

    /// The contexts the option's queries match, as (id, name) replies: ids are 0 for
    /// LIST (the spec reserves them) and the selection's ids for SET, which records it.
    fn try_meta_context(&mut self, set: bool, data: &[u8]) -> Result<Vec<(u32, String)>, OptError> {
        if !self.structured_replies {
            return Err(OptError::invalid(
                "metadata contexts need NBD_OPT_STRUCTURED_REPLY first",
            ));
        }
        // Layout: u32 name length, name, u32 query count, count x (u32 length, query).
        let mut r = Reader(data);
        let name_len = r
            .u32()
            .ok_or_else(|| OptError::invalid("option data too short for the name length"))?;
        let name = r
            .take(name_len as usize)
            .ok_or_else(|| OptError::invalid("export name length exceeds the option data"))?;
        let count = r
            .u32()
            .ok_or_else(|| OptError::invalid("option data too short for the query count"))?;
        let mut queries = Vec::new();
        // Each query occupies at least 4 bytes, so the loop is bounded by the data we hold.
        for i in 0..count {
            let qlen = r
                .u32()
                .ok_or_else(|| OptError::invalid(format!("query {i} of {count} is missing")))?;
            let q = r.take(qlen as usize).ok_or_else(|| {
                OptError::invalid(format!("query {i} length exceeds the option data"))
            })?;
            queries.push(q);
        }
        if !r.0.is_empty() {
            return Err(OptError::invalid(format!(
                "{} stray bytes after the last query",
                r.0.len()
            )));
        }
        let (canonical, _) = self.resolve_visible(name)?;
        let bitmaps = self.catalog.dirty_bitmaps(&canonical);
        let base_allocation = proto::BASE_ALLOCATION.as_bytes();
        let dirty_prefix = proto::QEMU_DIRTY_BITMAP.as_bytes();
        let mut base = false;
        // Bitmap names matched, each once, in the order they were asked for.
        let mut chosen: Vec<&String> = Vec::new();
        if !set && queries.is_empty() {
            // No queries on LIST means "everything available on this export".
            base = true;
            chosen.extend(bitmaps.iter());
        }
        for q in queries {
            if q == base_allocation || (!set && q == b"base:") {
                // "base:" is a LIST-only wildcard; SET must ignore it.
                base = true;
                continue;
            }
            let wildcard = q == proto::QEMU_NAMESPACE.as_bytes() || q == dirty_prefix;
            let matched: Vec<&String> = match q.strip_prefix(dirty_prefix) {
                // Wildcards select nothing on SET (the spec: an empty leaf SHOULD NOT).
                _ if wildcard && set => Vec::new(),
                _ if wildcard => bitmaps.iter().collect(),
                Some(leaf) => {
                    let found: Vec<&String> =
                        bitmaps.iter().filter(|b| b.as_bytes() == leaf).collect();
                    if found.is_empty() && set && UNKNOWN_BITMAP_LOG.admit() {
                        info!(
                            export = %canonical,
                            bitmap = %String::from_utf8_lossy(leaf),
                            offered = ?bitmaps,
                            "nbd: a client asked for a dirty bitmap of a snapshot the export \
                             does not descend from; that context is not selected"
                        );
                    }
                    found
                }
                // Other namespaces (and other qemu: contexts) are ignored, as the spec
                // requires.
                None => Vec::new(),
            };
            for b in matched {
                if !chosen.contains(&b) {
                    chosen.push(b);
                }
            }
        }
        if set && chosen.len() > MAX_DIRTY_BITMAPS {
            return Err(OptError {
                rep: proto::REP_ERR_TOO_BIG,
                msg: format!(
                    "{} dirty bitmaps asked for; at most {MAX_DIRTY_BITMAPS} per connection",
                    chosen.len()
                ),
            });
        }
        let mut out = Vec::with_capacity(1 + chosen.len());
        if base {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            out.push((id, proto::BASE_ALLOCATION.to_string()));
        }
        for (id, b) in (FIRST_DIRTY_BITMAP_ID..).zip(&chosen) {
            let id = if set { id } else { 0 };
            out.push((id, format!("{}{b}", proto::QEMU_DIRTY_BITMAP)));
        }
        if set && !out.is_empty() {
            self.meta = Some(MetaSelection {
                export: canonical,
                base_allocation: base,
                dirty_bitmaps: chosen.into_iter().cloned().collect(),
            });
        }
        Ok(out)
    }
}

/// Append one option reply: magic, option, reply type, length, payload.
fn push_reply(out: &mut Vec<u8>, opt: u32, rep: u32, payload: &[u8]) {
    out.extend_from_slice(&proto::OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&rep.to_be_bytes());
    // Payloads are built from capped strings, far below u32::MAX.
    out.extend_from_slice(&u32_of(payload.len()).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Longest prefix of `s` that is at most `max` bytes and ends on a character boundary.
fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Read and drop exactly `n` bytes, without buffering them.
fn discard<S: Read>(s: &mut S, n: u64) -> io::Result<()> {
    let got = io::copy(&mut s.take(n), &mut io::sink())?;
    if got < n {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "client hung up inside an option payload",
        ));
    }
    Ok(())
}

fn read_u32<S: Read>(s: &mut S) -> io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(b);
    a
}

/// Bounds-checked big-endian cursor over option data; every accessor returns `None`
/// instead of panicking when the data runs out.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.0.len() {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes(arr(b)))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_be_bytes(arr(b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// In-memory stream: reads come from `input`, writes go to `output`.
    struct Duplex {
        input: Cursor<Vec<u8>>,
        output: Vec<u8>,
    }

    impl Read for Duplex {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }
    impl Write for Duplex {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    struct Catalog;
    impl ExportCatalog for Catalog {
        fn list(&self) -> Vec<String> {
            vec!["disk0".into(), "ro".into()]
        }
        fn lookup(&self, name: &str) -> Option<ExportInfo> {
            match name {
                "disk0" => Some(ExportInfo {
                    size: 1 << 30,
                    read_only: false,
                    description: "first disk".into(),
                    tls_required: false,
                }),
                "ro" => Some(ExportInfo {
                    size: 4096,
                    read_only: true,
                    description: String::new(),
                    tls_required: false,
                }),
                _ => None,
            }
        }
    }

    /// Builds the client side of a conversation.
    struct Script(Vec<u8>);
    impl Script {
        fn new(flags: u32) -> Self {
            Script(flags.to_be_bytes().to_vec())
        }
        fn fixed() -> Self {
            Self::new(proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES)
        }
        fn opt(mut self, opt: u32, data: &[u8]) -> Self {
            self.0.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
            self.0.extend_from_slice(&opt.to_be_bytes());
            self.0.extend_from_slice(&u32_of(data.len()).to_be_bytes());
            self.0.extend_from_slice(data);
            self
        }
        fn go_like(self, opt: u32, name: &str, infos: &[u16]) -> Self {
            let mut d = u32_of(name.len()).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&u16::try_from(infos.len()).unwrap().to_be_bytes());
            for i in infos {
                d.extend_from_slice(&i.to_be_bytes());
            }
            self.opt(opt, &d)
        }
        fn meta(self, opt: u32, name: &str, queries: &[&str]) -> Self {
            let mut d = u32_of(name.len()).to_be_bytes().to_vec();
            d.extend_from_slice(name.as_bytes());
            d.extend_from_slice(&u32_of(queries.len()).to_be_bytes());
            for q in queries {
                d.extend_from_slice(&u32_of(q.len()).to_be_bytes());
                d.extend_from_slice(q.as_bytes());
            }
            self.opt(opt, &d)
        }
        fn run(self) -> (Result<HandshakeOutcome, HandshakeError>, Vec<u8>) {
            self.run_with(&Catalog)
        }
        fn run_with(
            self,
            catalog: &dyn ExportCatalog,
        ) -> (Result<HandshakeOutcome, HandshakeError>, Vec<u8>) {
            let mut d = Duplex {
                input: Cursor::new(self.0),
                output: Vec::new(),
            };
            let r = negotiate(&mut d, catalog);
            (r, d.output)
        }
    }

    #[derive(Debug, PartialEq, Eq)]
    struct Rep {
        opt: u32,
        ty: u32,
        data: Vec<u8>,
    }

    /// Checks the greeting and splits the rest of the server output into option replies.
    /// Returns the replies and whatever trailing bytes did not form one.
    fn parse_output(out: &[u8]) -> (Vec<Rep>, Vec<u8>) {
        assert_eq!(&out[0..8], &proto::NBDMAGIC.to_be_bytes());
        assert_eq!(&out[8..16], &proto::IHAVEOPT.to_be_bytes());
        assert_eq!(
            &out[16..18],
            &(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes()
        );
        let mut rest = &out[18..];
        let mut reps = Vec::new();
        while rest.len() >= 20 && rest[0..8] == proto::OPTION_REPLY_MAGIC.to_be_bytes() {
            let opt = u32::from_be_bytes(arr(&rest[8..12]));
            let ty = u32::from_be_bytes(arr(&rest[12..16]));
            let len = u32::from_be_bytes(arr(&rest[16..20])) as usize;
            reps.push(Rep {
                opt,
                ty,
                data: rest[20..20 + len].to_vec(),
            });
            rest = &rest[20 + len..];
        }
        (reps, rest.to_vec())
    }

    fn transmission(r: Result<HandshakeOutcome, HandshakeError>) -> Negotiated {
        match r {
            Ok(HandshakeOutcome::Transmission(n)) => n,
            Ok(HandshakeOutcome::Closed) => panic!("unexpected Closed"),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    fn info_types(reps: &[Rep]) -> Vec<u16> {
        reps.iter()
            .filter(|r| r.ty == proto::REP_INFO)
            .map(|r| u16::from_be_bytes(arr(&r.data[0..2])))
            .collect()
    }

    #[test]
    fn go_with_structured_replies_and_base_allocation() {
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "disk0", &["base:allocation"])
            .go_like(
                proto::OPT_GO,
                "disk0",
                &[
                    proto::INFO_BLOCK_SIZE,
                    proto::INFO_NAME,
                    proto::INFO_DESCRIPTION,
                ],
            )
            .run();
        let n = transmission(r);
        assert_eq!(
            n,
            Negotiated {
                export_name: "disk0".into(),
                size: 1 << 30,
                read_only: false,
                structured_replies: true,
                base_allocation: Some(1),
                dirty_bitmaps: vec![],
                block_size_negotiated: true,
                no_zeroes: true,
                tls: false,
            }
        );
        let (reps, rest) = parse_output(&out);
        assert!(rest.is_empty(), "nothing may follow the final ACK of GO");
        assert_eq!(
            reps[0],
            Rep {
                opt: proto::OPT_STRUCTURED_REPLY,
                ty: proto::REP_ACK,
                data: vec![]
            }
        );
        let mut ctx = 1u32.to_be_bytes().to_vec();
        ctx.extend_from_slice(b"base:allocation");
        assert_eq!(
            reps[1],
            Rep {
                opt: proto::OPT_SET_META_CONTEXT,
                ty: proto::REP_META_CONTEXT,
                data: ctx
            }
        );
        assert_eq!(
            reps[2],
            Rep {
                opt: proto::OPT_SET_META_CONTEXT,
                ty: proto::REP_ACK,
                data: vec![]
            }
        );
        let go: Vec<_> = reps[3..].iter().collect();
        assert!(go.iter().all(|r| r.opt == proto::OPT_GO));
        assert_eq!(go.last().unwrap().ty, proto::REP_ACK);
        let mut types = info_types(&reps[3..]);
        types.sort();
        assert_eq!(
            types,
            vec![
                proto::INFO_EXPORT,
                proto::INFO_NAME,
                proto::INFO_DESCRIPTION,
                proto::INFO_BLOCK_SIZE
            ]
        );
        let export = reps
            .iter()
            .find(|r| r.ty == proto::REP_INFO && r.data[0..2] == [0, 0])
            .unwrap();
        assert_eq!(export.data.len(), 12);
        assert_eq!(u64::from_be_bytes(arr(&export.data[2..10])), 1 << 30);
        assert_eq!(
            u16::from_be_bytes(arr(&export.data[10..12])),
            proto::transmission_flags(false)
        );
        let bs = reps
            .iter()
            .find(|r| r.ty == proto::REP_INFO && r.data[0..2] == [0, 3])
            .unwrap();
        assert_eq!(bs.data.len(), 14);
        assert_eq!(u32::from_be_bytes(arr(&bs.data[2..6])), proto::MIN_BLOCK);
        assert_eq!(
            u32::from_be_bytes(arr(&bs.data[6..10])),
            proto::PREFERRED_BLOCK
        );
        assert_eq!(
            u32::from_be_bytes(arr(&bs.data[10..14])),
            proto::MAX_PAYLOAD
        );
        let desc = reps
            .iter()
            .find(|r| r.ty == proto::REP_INFO && r.data[0..2] == [0, 2])
            .unwrap();
        assert_eq!(&desc.data[2..], b"first disk");
    }

    #[test]
    fn go_without_block_size_request_still_advertises_it() {
        let (r, out) = Script::fixed().go_like(proto::OPT_GO, "ro", &[]).run();
        let n = transmission(r);
        assert!(!n.block_size_negotiated);
        assert!(!n.structured_replies);
        assert!(n.read_only);
        assert_eq!(n.base_allocation, None);
        let (reps, _) = parse_output(&out);
        let mut types = info_types(&reps);
        types.sort();
        assert_eq!(types, vec![proto::INFO_EXPORT, proto::INFO_BLOCK_SIZE]);
        // Without structured replies DF must not be advertised.
        let export = reps
            .iter()
            .find(|r| r.ty == proto::REP_INFO && r.data[0..2] == [0, 0])
            .unwrap();
        let flags = u16::from_be_bytes(arr(&export.data[10..12]));
        assert_eq!(flags & proto::TFLAG_SEND_DF, 0);
        assert_ne!(flags & proto::TFLAG_READ_ONLY, 0);
    }

    #[test]
    fn empty_name_selects_default_export() {
        let (r, _) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "", &["base:allocation"])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        let n = transmission(r);
        assert_eq!(n.export_name, "disk0");
        // "" and "disk0" name the same export, so the context applies.
        assert_eq!(n.base_allocation, Some(1));
    }

    #[test]
    fn meta_context_for_other_export_is_dropped() {
        let (r, _) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "ro", &["base:allocation"])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        assert_eq!(transmission(r).base_allocation, None);
    }

    #[test]
    fn set_meta_context_replaces_selection() {
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "disk0", &["base:allocation"])
            .meta(
                proto::OPT_SET_META_CONTEXT,
                "disk0",
                &["base:", "qemu:dirty-bitmap:x"],
            )
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        assert_eq!(transmission(r).base_allocation, None);
        let (reps, _) = parse_output(&out);
        // Second SET: nothing selected, just ACK.
        assert_eq!(
            reps[3],
            Rep {
                opt: proto::OPT_SET_META_CONTEXT,
                ty: proto::REP_ACK,
                data: vec![]
            }
        );
    }

    #[test]
    fn list_meta_context() {
        for queries in [
            &[][..],
            &["base:"][..],
            &["base:allocation", "base:"][..],
            &["x-foo:bar", "base:allocation"][..],
        ] {
            let (r, out) = Script::fixed()
                .opt(proto::OPT_STRUCTURED_REPLY, &[])
                .meta(proto::OPT_LIST_META_CONTEXT, "disk0", queries)
                .opt(proto::OPT_ABORT, &[])
                .run();
            assert!(matches!(r, Ok(HandshakeOutcome::Closed)));
            let (reps, _) = parse_output(&out);
            let mut ctx = 0u32.to_be_bytes().to_vec();
            ctx.extend_from_slice(b"base:allocation");
            assert_eq!(
                reps[1],
                Rep {
                    opt: proto::OPT_LIST_META_CONTEXT,
                    ty: proto::REP_META_CONTEXT,
                    data: ctx
                },
                "{queries:?}"
            );
            assert_eq!(reps[2].ty, proto::REP_ACK);
            assert_eq!(
                reps[3],
                Rep {
                    opt: proto::OPT_ABORT,
                    ty: proto::REP_ACK,
                    data: vec![]
                }
            );
        }
        // Unknown namespaces are ignored, not errors.
        let (_, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_LIST_META_CONTEXT, "disk0", &["x-foo:"])
            .run();
        let (reps, _) = parse_output(&out);
        assert_eq!(
            reps[1],
            Rep {
                opt: proto::OPT_LIST_META_CONTEXT,
                ty: proto::REP_ACK,
                data: vec![]
            }
        );
    }

    /// [`Catalog`] whose exports descend from snapshots: "disk0" from s2 then s1, "ro"
    /// from twenty.
    struct SnapCatalog;
    impl ExportCatalog for SnapCatalog {
        fn list(&self) -> Vec<String> {
            Catalog.list()
        }
        fn lookup(&self, name: &str) -> Option<ExportInfo> {
            Catalog.lookup(name)
        }
        fn dirty_bitmaps(&self, name: &str) -> Vec<String> {
            match name {
                "disk0" => vec!["s2".into(), "s1".into()],
                "ro" => (0..20).map(|i| format!("r{i}")).collect(),
                _ => Vec::new(),
            }
        }
    }

    /// The (id, name) of each REP_META_CONTEXT reply to `opt`.
    fn contexts(reps: &[Rep], opt: u32) -> Vec<(u32, String)> {
        reps.iter()
            .filter(|r| r.opt == opt && r.ty == proto::REP_META_CONTEXT)
            .map(|r| {
                (
                    u32::from_be_bytes(arr(&r.data[0..4])),
                    String::from_utf8(r.data[4..].to_vec()).unwrap(),
                )
            })
            .collect()
    }

    fn ctx(id: u32, name: &str) -> (u32, String) {
        (id, name.to_string())
    }

    #[test]
    fn list_dirty_bitmaps() {
        let all = vec![
            ctx(0, "qemu:dirty-bitmap:s2"),
            ctx(0, "qemu:dirty-bitmap:s1"),
        ];
        let mut everything = vec![ctx(0, "base:allocation")];
        everything.extend(all.clone());
        for (queries, want) in [
            (&["qemu:dirty-bitmap:"][..], all.clone()),
            (&["qemu:"][..], all.clone()),
            (
                &["qemu:dirty-bitmap:", "qemu:dirty-bitmap:s1"][..],
                all.clone(),
            ),
            (&[][..], everything),
            (
                &["qemu:dirty-bitmap:s1", "qemu:dirty-bitmap:nosuch"][..],
                vec![ctx(0, "qemu:dirty-bitmap:s1")],
            ),
            // Other qemu: contexts and a bitmap name without its prefix match nothing.
            (
                &["qemu:allocation-depth", "s1", "qemu:dirty-bitmap"][..],
                vec![],
            ),
        ] {
            let (r, out) = Script::fixed()
                .opt(proto::OPT_STRUCTURED_REPLY, &[])
                .meta(proto::OPT_LIST_META_CONTEXT, "disk0", queries)
                .opt(proto::OPT_ABORT, &[])
                .run_with(&SnapCatalog);
            assert!(matches!(r, Ok(HandshakeOutcome::Closed)));
            let (reps, _) = parse_output(&out);
            assert_eq!(
                contexts(&reps, proto::OPT_LIST_META_CONTEXT),
                want,
                "{queries:?}"
            );
            let last = reps
                .iter()
                .rfind(|r| r.opt == proto::OPT_LIST_META_CONTEXT)
                .unwrap();
            assert_eq!(last.ty, proto::REP_ACK, "{queries:?}");
        }
        // An export outside any chain lists none.
        let (_, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(
                proto::OPT_LIST_META_CONTEXT,
                "disk0",
                &["qemu:dirty-bitmap:"],
            )
            .run();
        let (reps, _) = parse_output(&out);
        assert_eq!(contexts(&reps, proto::OPT_LIST_META_CONTEXT), vec![]);
        assert_eq!(reps[1].ty, proto::REP_ACK);
    }

    #[test]
    fn set_dirty_bitmaps() {
        // Known names get ids after base:allocation's, each once; unknown names and
        // wildcards are ignored.
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(
                proto::OPT_SET_META_CONTEXT,
                "disk0",
                &[
                    "qemu:dirty-bitmap:s1",
                    "qemu:dirty-bitmap:nosuch",
                    "qemu:dirty-bitmap:",
                    "qemu:",
                    "base:allocation",
                    "qemu:dirty-bitmap:s1",
                    "qemu:dirty-bitmap:s2",
                ],
            )
            .go_like(proto::OPT_GO, "disk0", &[])
            .run_with(&SnapCatalog);
        let n = transmission(r);
        assert_eq!(n.base_allocation, Some(BASE_ALLOCATION_ID));
        assert_eq!(n.dirty_bitmaps, vec![ctx(2, "s1"), ctx(3, "s2")]);
        let (reps, _) = parse_output(&out);
        assert_eq!(
            contexts(&reps, proto::OPT_SET_META_CONTEXT),
            vec![
                ctx(1, "base:allocation"),
                ctx(2, "qemu:dirty-bitmap:s1"),
                ctx(3, "qemu:dirty-bitmap:s2"),
            ]
        );
        // A bitmap alone; an unknown one alone selects nothing (ACK only).
        let (r, _) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(
                proto::OPT_SET_META_CONTEXT,
                "disk0",
                &["qemu:dirty-bitmap:s2"],
            )
            .go_like(proto::OPT_GO, "disk0", &[])
            .run_with(&SnapCatalog);
        let n = transmission(r);
        assert_eq!(n.base_allocation, None);
        assert_eq!(n.dirty_bitmaps, vec![ctx(2, "s2")]);
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(
                proto::OPT_SET_META_CONTEXT,
                "disk0",
                &["qemu:dirty-bitmap:s9"],
            )
            .go_like(proto::OPT_GO, "disk0", &[])
            .run_with(&SnapCatalog);
        let n = transmission(r);
        assert!(n.base_allocation.is_none() && n.dirty_bitmaps.is_empty());
        let (reps, _) = parse_output(&out);
        assert_eq!(
            (reps[1].opt, reps[1].ty),
            (proto::OPT_SET_META_CONTEXT, proto::REP_ACK)
        );
        // Selected for another export: dropped at GO.
        let (r, _) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "ro", &["qemu:dirty-bitmap:r3"])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run_with(&SnapCatalog);
        assert!(transmission(r).dirty_bitmaps.is_empty());
        // More than MAX_DIRTY_BITMAPS: TOO_BIG, and the earlier selection is gone.
        let many: Vec<String> = (0..20).map(|i| format!("qemu:dirty-bitmap:r{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "ro", &["qemu:dirty-bitmap:r1"])
            .meta(proto::OPT_SET_META_CONTEXT, "ro", &many)
            .go_like(proto::OPT_GO, "ro", &[])
            .run_with(&SnapCatalog);
        assert!(transmission(r).dirty_bitmaps.is_empty());
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[3].ty, proto::REP_ERR_TOO_BIG);
        // A later SET without bitmaps replaces the bitmaps.
        let (r, _) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(
                proto::OPT_SET_META_CONTEXT,
                "disk0",
                &["qemu:dirty-bitmap:s1"],
            )
            .meta(proto::OPT_SET_META_CONTEXT, "disk0", &["base:allocation"])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run_with(&SnapCatalog);
        let n = transmission(r);
        assert_eq!(n.base_allocation, Some(1));
        assert!(n.dirty_bitmaps.is_empty());
    }

    #[test]
    fn meta_context_unknown_export_and_malformed() {
        let mut bad = 5u32.to_be_bytes().to_vec();
        bad.extend_from_slice(b"disk0");
        bad.extend_from_slice(&2u32.to_be_bytes()); // claims 2 queries, has none
        let (_, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_LIST_META_CONTEXT, "nope", &[])
            .opt(proto::OPT_SET_META_CONTEXT, &bad)
            .run();
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[1].ty, proto::REP_ERR_UNKNOWN);
        assert_eq!(reps[2].ty, proto::REP_ERR_INVALID);
        assert!(std::str::from_utf8(&reps[2].data).is_ok());
    }

    #[test]
    fn set_meta_context_before_structured_reply_is_invalid() {
        let (r, out) = Script::fixed()
            .meta(proto::OPT_SET_META_CONTEXT, "disk0", &["base:allocation"])
            .meta(proto::OPT_LIST_META_CONTEXT, "disk0", &[])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        assert_eq!(transmission(r).base_allocation, None);
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[0].opt, proto::OPT_SET_META_CONTEXT);
        assert_eq!(reps[0].ty, proto::REP_ERR_INVALID);
        assert!(!reps[0].data.is_empty(), "error carries a message");
        assert_eq!(reps[1].ty, proto::REP_ERR_INVALID);
    }

    #[test]
    fn export_name_with_and_without_zeroes() {
        for (flags, zeroes) in [
            (proto::CLIENT_FLAG_FIXED_NEWSTYLE, true),
            (
                proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES,
                false,
            ),
        ] {
            let (r, out) = Script::new(flags).opt(proto::OPT_EXPORT_NAME, b"ro").run();
            let n = transmission(r);
            assert_eq!(n.export_name, "ro");
            assert_eq!(n.no_zeroes, !zeroes);
            assert!(!n.block_size_negotiated);
            let tail = &out[18..];
            assert_eq!(tail.len(), 10 + if zeroes { 124 } else { 0 });
            assert_eq!(u64::from_be_bytes(arr(&tail[0..8])), 4096);
            let f = u16::from_be_bytes(arr(&tail[8..10]));
            assert_eq!(f, proto::transmission_flags(true) & !proto::TFLAG_SEND_DF);
            assert!(tail[10..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn export_name_after_structured_reply_keeps_df() {
        let (r, out) = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .opt(proto::OPT_EXPORT_NAME, b"")
            .run();
        let n = transmission(r);
        assert_eq!(n.export_name, "disk0");
        assert!(n.structured_replies);
        let tail = &out[18 + 20..];
        assert_eq!(
            u16::from_be_bytes(arr(&tail[8..10])),
            proto::transmission_flags(false)
        );
    }

    #[test]
    fn export_name_unknown_is_protocol_error() {
        let (r, out) = Script::fixed()
            .opt(proto::OPT_EXPORT_NAME, b"missing")
            .run();
        assert!(matches!(r, Err(HandshakeError::Protocol(_))));
        assert_eq!(out.len(), 18, "nothing is sent before closing");
    }

    /// Exports served from elsewhere: "far" is connected on demand (its size is known
    /// only then), "down" cannot be reached.
    struct OnDemand {
        prepared: std::sync::Mutex<Vec<String>>,
    }
    impl ExportCatalog for OnDemand {
        fn list(&self) -> Vec<String> {
            vec!["far".into(), "down".into()]
        }
        fn lookup(&self, name: &str) -> Option<ExportInfo> {
            matches!(name, "far" | "down").then(|| ExportInfo {
                size: 4096,
                read_only: false,
                description: String::new(),
                tls_required: false,
            })
        }
        fn prepare(&self, name: &str, info: ExportInfo) -> Result<ExportInfo, PrepareError> {
            self.prepared.lock().unwrap().push(name.to_string());
            match name {
                "far" => Ok(ExportInfo {
                    size: 1 << 20,
                    ..info
                }),
                _ => Err(PrepareError::Unavailable(
                    "the owner of \"down\" is not alive".into(),
                )),
            }
        }
    }

    #[test]
    fn prepare_runs_before_use_and_its_refusal_is_an_unknown_export() {
        let cat = OnDemand {
            prepared: std::sync::Mutex::new(Vec::new()),
        };
        let (r, out) = Script::fixed()
            .opt(proto::OPT_LIST, &[])
            .go_like(proto::OPT_GO, "down", &[])
            .go_like(proto::OPT_GO, "far", &[])
            .run_with(&cat);
        let n = transmission(r);
        assert_eq!((n.export_name.as_str(), n.size), ("far", 1 << 20));
        // Listing prepared nothing; each GO prepared its export once.
        assert_eq!(*cat.prepared.lock().unwrap(), ["down", "far"]);
        let (reps, _) = parse_output(&out);
        let refused = reps
            .iter()
            .find(|r| r.opt == proto::OPT_GO && r.ty == proto::REP_ERR_UNKNOWN)
            .expect("GO of an export that cannot be prepared is refused");
        assert_eq!(refused.data, b"the owner of \"down\" is not alive");
        let size = reps
            .iter()
            .find(|r| r.ty == proto::REP_INFO && r.data[0..2] == proto::INFO_EXPORT.to_be_bytes())
            .map(|r| u64::from_be_bytes(arr(&r.data[2..10])))
            .expect("INFO_EXPORT for the prepared export");
        assert_eq!(size, 1 << 20, "the prepared size is announced");
    }

    #[test]
    fn list_exports() {
        let (r, out) = Script::fixed()
            .opt(proto::OPT_LIST, &[])
            .opt(proto::OPT_LIST, b"x")
            .opt(proto::OPT_ABORT, &[])
            .run();
        assert!(matches!(r, Ok(HandshakeOutcome::Closed)));
        let (reps, rest) = parse_output(&out);
        assert!(rest.is_empty());
        let mut d0 = 5u32.to_be_bytes().to_vec();
        d0.extend_from_slice(b"disk0");
        let mut d1 = 2u32.to_be_bytes().to_vec();
        d1.extend_from_slice(b"ro");
        assert_eq!(
            reps,
            vec![
                Rep {
                    opt: proto::OPT_LIST,
                    ty: proto::REP_SERVER,
                    data: d0
                },
                Rep {
                    opt: proto::OPT_LIST,
                    ty: proto::REP_SERVER,
                    data: d1
                },
                Rep {
                    opt: proto::OPT_LIST,
                    ty: proto::REP_ACK,
                    data: vec![]
                },
                Rep {
                    opt: proto::OPT_LIST,
                    ty: proto::REP_ERR_INVALID,
                    data: b"NBD_OPT_LIST takes no data".to_vec()
                },
                Rep {
                    opt: proto::OPT_ABORT,
                    ty: proto::REP_ACK,
                    data: vec![]
                },
            ]
        );
    }

    #[test]
    fn unknown_options_are_unsupported_and_parsing_continues() {
        let (r, out) = Script::fixed()
            .opt(99, b"some payload")
            .opt(proto::OPT_STARTTLS, &[])
            .opt(proto::OPT_EXTENDED_HEADERS, &[])
            .opt(4, &[]) // withdrawn PEEK_EXPORT
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        transmission(r);
        let (reps, _) = parse_output(&out);
        let errs: Vec<_> = reps[0..4].iter().map(|r| (r.opt, r.ty)).collect();
        assert_eq!(
            errs,
            vec![
                (99, proto::REP_ERR_UNSUP),
                (proto::OPT_STARTTLS, proto::REP_ERR_UNSUP),
                (proto::OPT_EXTENDED_HEADERS, proto::REP_ERR_UNSUP),
                (4, proto::REP_ERR_UNSUP),
            ]
        );
    }

    #[test]
    fn go_unknown_export_gets_err_unknown() {
        let (r, out) = Script::fixed()
            .go_like(proto::OPT_GO, "missing", &[])
            .go_like(proto::OPT_INFO, "disk0", &[proto::INFO_NAME])
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        assert_eq!(transmission(r).export_name, "disk0");
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[0].ty, proto::REP_ERR_UNKNOWN);
        let msg = String::from_utf8(reps[0].data.clone()).unwrap();
        assert!(msg.contains("missing"), "{msg}");
        // INFO: export, block size, name, ACK; the session continues.
        assert!(reps[1..5].iter().all(|r| r.opt == proto::OPT_INFO));
        assert_eq!(reps[4].ty, proto::REP_ACK);
        assert_eq!(reps[5].opt, proto::OPT_GO);
    }

    #[test]
    fn malformed_go_is_invalid() {
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![0, 0, 0],
            vec![0, 0, 0, 0, 0],                // no request count
            vec![0xff, 0xff, 0xff, 0xff, 0, 0], // name longer than data
            vec![0, 0, 0, 0, 0, 2, 0, 3],       // two requests claimed, one present
            vec![0, 0, 0, 0, 0, 0, 0],          // stray byte
        ];
        let mut script = Script::fixed();
        for c in &cases {
            script = script.opt(proto::OPT_GO, c);
        }
        let (r, out) = script.run();
        assert!(
            matches!(r, Err(HandshakeError::Io(_))),
            "input ends after the bad options"
        );
        let (reps, _) = parse_output(&out);
        assert_eq!(reps.len(), cases.len());
        assert!(reps.iter().all(|r| r.ty == proto::REP_ERR_INVALID));
    }

    #[test]
    fn oversized_options() {
        let big = vec![0u8; MAX_OPTION_LEN as usize + 1];
        let (r, out) = Script::fixed()
            .opt(proto::OPT_GO, &big)
            .go_like(proto::OPT_GO, "disk0", &[])
            .run();
        transmission(r);
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[0].ty, proto::REP_ERR_TOO_BIG);

        // Beyond the discard limit the connection is dropped without reading the payload.
        let mut s = Script::fixed();
        s.0.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        s.0.extend_from_slice(&proto::OPT_GO.to_be_bytes());
        s.0.extend_from_slice(&(MAX_DISCARD_LEN + 1).to_be_bytes());
        assert!(matches!(s.run().0, Err(HandshakeError::Protocol(_))));

        // An oversized EXPORT_NAME cannot be answered.
        let (r, _) = Script::fixed().opt(proto::OPT_EXPORT_NAME, &big).run();
        assert!(matches!(r, Err(HandshakeError::Protocol(_))));
    }

    #[test]
    fn bad_client_flags() {
        assert!(matches!(
            Script::new(0).run().0,
            Err(HandshakeError::Protocol(_))
        ));
        assert!(matches!(
            Script::new(proto::CLIENT_FLAG_FIXED_NEWSTYLE | 4).run().0,
            Err(HandshakeError::Protocol(_))
        ));
    }

    #[test]
    fn bad_option_magic() {
        let mut s = Script::fixed();
        s.0.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
        s.0.extend_from_slice(&[0u8; 8]);
        let (r, _) = s.run();
        match r {
            Err(HandshakeError::Protocol(m)) => assert!(m.contains("magic"), "{m}"),
            _ => panic!("expected protocol error"),
        }
    }

    #[test]
    fn truncated_input_is_an_error_never_a_panic() {
        let full = Script::fixed()
            .opt(proto::OPT_STRUCTURED_REPLY, &[])
            .meta(proto::OPT_SET_META_CONTEXT, "disk0", &["base:allocation"])
            .go_like(proto::OPT_GO, "disk0", &[proto::INFO_BLOCK_SIZE])
            .0;
        for cut in 0..full.len() {
            let (r, _) = Script(full[..cut].to_vec()).run();
            match r {
                Err(HandshakeError::Io(e)) => assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof),
                other => panic!(
                    "cut at {cut}: expected EOF error, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
        transmission(Script(full).run().0);
    }

    #[test]
    fn abort_ignores_write_errors() {
        struct Broken(Cursor<Vec<u8>>, usize);
        impl Read for Broken {
            fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
                self.0.read(b)
            }
        }
        impl Write for Broken {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                // Accept the greeting, then behave like a closed socket.
                if self.1 >= 18 {
                    return Err(io::ErrorKind::BrokenPipe.into());
                }
                self.1 += b.len();
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let script = Script::fixed().opt(proto::OPT_ABORT, b"ignored").0;
        let mut b = Broken(Cursor::new(script), 0);
        assert!(matches!(
            negotiate(&mut b, &Catalog),
            Ok(HandshakeOutcome::Closed)
        ));
    }

    #[test]
    fn too_many_options() {
        let mut s = Script::fixed();
        for _ in 0..=MAX_OPTIONS {
            s = s.opt(1000, &[]);
        }
        assert!(matches!(s.run().0, Err(HandshakeError::Protocol(_))));
    }

    /// A duplex whose "TLS" is a flag: the option logic around STARTTLS, without crypto
    /// (the real handshake is tested end to end with libnbd and qemu).
    struct FakeTls {
        d: Duplex,
        offered: bool,
        active: bool,
        fail: bool,
    }
    impl Read for FakeTls {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.d.read(buf)
        }
    }
    impl Write for FakeTls {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.d.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    impl HandshakeIo for FakeTls {
        fn tls_offered(&self) -> bool {
            self.offered
        }
        fn tls_active(&self) -> bool {
            self.active
        }
        fn start_tls(&mut self) -> io::Result<()> {
            if self.fail {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "bad certificate",
                ));
            }
            self.active = true;
            Ok(())
        }
    }

    /// "disk0" is open to all, "secret" is TLS-only (`all_tls`: both are).
    struct TlsCatalog {
        all_tls: bool,
    }
    impl ExportCatalog for TlsCatalog {
        fn list(&self) -> Vec<String> {
            vec!["disk0".into(), "secret".into()]
        }
        fn lookup(&self, name: &str) -> Option<ExportInfo> {
            let tls_required = match name {
                "disk0" => self.all_tls,
                "secret" => true,
                _ => return None,
            };
            Some(ExportInfo {
                size: 1 << 20,
                read_only: false,
                description: String::new(),
                tls_required,
            })
        }
    }

    fn run_tls(
        script: Script,
        offered: bool,
        all_tls: bool,
    ) -> (Result<HandshakeOutcome, HandshakeError>, Vec<u8>) {
        let mut s = FakeTls {
            d: Duplex {
                input: Cursor::new(script.0),
                output: Vec::new(),
            },
            offered,
            active: false,
            fail: false,
        };
        let r = negotiate_io(&mut s, &TlsCatalog { all_tls });
        (r, s.d.output)
    }

    #[test]
    fn selective_tls_hides_and_refuses_tls_only_exports_before_starttls() {
        let (r, out) = run_tls(
            Script::fixed()
                .opt(proto::OPT_LIST, &[])
                .go_like(proto::OPT_INFO, "secret", &[proto::INFO_NAME])
                .go_like(proto::OPT_GO, "secret", &[])
                .go_like(proto::OPT_INFO, "nosuch", &[])
                .opt(proto::OPT_STRUCTURED_REPLY, &[])
                .meta(proto::OPT_LIST_META_CONTEXT, "secret", &[])
                .go_like(proto::OPT_GO, "disk0", &[]),
            true,
            false,
        );
        let n = transmission(r);
        assert_eq!(n.export_name, "disk0");
        assert!(!n.tls);
        let (reps, _) = parse_output(&out);
        // LIST shows only the open export.
        let mut d0 = 5u32.to_be_bytes().to_vec();
        d0.extend_from_slice(b"disk0");
        assert_eq!((reps[0].ty, &reps[0].data), (proto::REP_SERVER, &d0));
        assert_eq!(reps[1].ty, proto::REP_ACK);
        // INFO/GO on the TLS-only export: TLS_REQD and no REP_INFO (no size leaked).
        assert_eq!(
            (reps[2].opt, reps[2].ty),
            (proto::OPT_INFO, proto::REP_ERR_TLS_REQD)
        );
        assert_eq!(
            (reps[3].opt, reps[3].ty),
            (proto::OPT_GO, proto::REP_ERR_TLS_REQD)
        );
        // An unknown name looks the same as a TLS-only one.
        assert_eq!(
            (reps[4].opt, reps[4].ty),
            (proto::OPT_INFO, proto::REP_ERR_TLS_REQD)
        );
        assert_eq!(reps[5].ty, proto::REP_ACK);
        // Metadata contexts may not answer TLS_REQD: the TLS-only export looks unknown.
        assert_eq!(reps[6].ty, proto::REP_ERR_UNKNOWN);
        assert_eq!((reps[7].opt, reps[7].ty), (proto::OPT_GO, proto::REP_INFO));
    }

    #[test]
    fn starttls_resets_state_and_opens_tls_only_exports() {
        let (r, out) = run_tls(
            Script::fixed()
                .opt(proto::OPT_STRUCTURED_REPLY, &[])
                .opt(proto::OPT_STARTTLS, b"x")
                .opt(proto::OPT_STARTTLS, &[])
                .opt(proto::OPT_STARTTLS, &[])
                .opt(proto::OPT_LIST, &[])
                .go_like(proto::OPT_GO, "secret", &[]),
            true,
            false,
        );
        let n = transmission(r);
        assert_eq!(n.export_name, "secret");
        assert!(n.tls);
        assert!(
            !n.structured_replies,
            "structured replies negotiated before STARTTLS must not survive it"
        );
        let (reps, _) = parse_output(&out);
        let got: Vec<_> = reps.iter().map(|r| (r.opt, r.ty)).collect();
        assert_eq!(
            got[..6],
            [
                (proto::OPT_STRUCTURED_REPLY, proto::REP_ACK),
                (proto::OPT_STARTTLS, proto::REP_ERR_INVALID),
                (proto::OPT_STARTTLS, proto::REP_ACK),
                (proto::OPT_STARTTLS, proto::REP_ERR_INVALID),
                (proto::OPT_LIST, proto::REP_SERVER),
                (proto::OPT_LIST, proto::REP_SERVER),
            ]
        );
        assert_eq!(got[6], (proto::OPT_LIST, proto::REP_ACK));
        assert_eq!(got[7], (proto::OPT_GO, proto::REP_INFO));
    }

    #[test]
    fn forced_tls_answers_only_starttls_and_abort() {
        let (r, out) = run_tls(
            Script::fixed()
                .opt(proto::OPT_LIST, &[])
                .opt(proto::OPT_STRUCTURED_REPLY, &[])
                .go_like(proto::OPT_GO, "disk0", &[])
                .opt(99, &[])
                .opt(proto::OPT_ABORT, &[]),
            true,
            true,
        );
        assert!(matches!(r, Ok(HandshakeOutcome::Closed)));
        let (reps, _) = parse_output(&out);
        assert!(reps[..4].iter().all(|r| r.ty == proto::REP_ERR_TLS_REQD));
        assert_eq!(reps[4].ty, proto::REP_ACK);
        // EXPORT_NAME cannot be refused: the server hangs up without a byte more.
        let (r, out) = run_tls(
            Script::fixed().opt(proto::OPT_EXPORT_NAME, b"disk0"),
            true,
            true,
        );
        assert!(matches!(r, Err(HandshakeError::Protocol(_))));
        assert_eq!(out.len(), 18);
        // Selective mode: EXPORT_NAME of a TLS-only export hangs up too.
        let (r, out) = run_tls(
            Script::fixed().opt(proto::OPT_EXPORT_NAME, b"secret"),
            true,
            false,
        );
        assert!(matches!(r, Err(HandshakeError::Protocol(_))));
        assert_eq!(out.len(), 18);
    }

    #[test]
    fn tls_only_export_without_tls_support_is_refused_by_policy() {
        let (r, out) = run_tls(
            Script::fixed()
                .opt(proto::OPT_STARTTLS, &[])
                .opt(proto::OPT_LIST, &[])
                .go_like(proto::OPT_GO, "secret", &[])
                .opt(proto::OPT_ABORT, &[]),
            false,
            false,
        );
        assert!(matches!(r, Ok(HandshakeOutcome::Closed)));
        let (reps, _) = parse_output(&out);
        assert_eq!(reps[0].ty, proto::REP_ERR_UNSUP);
        assert_eq!(reps[1].ty, proto::REP_SERVER);
        assert_eq!(reps[2].ty, proto::REP_ACK, "only disk0 is listed");
        assert_eq!(reps[3].ty, proto::REP_ERR_POLICY);
    }

    #[test]
    fn failed_tls_handshake_ends_the_session() {
        let mut s = FakeTls {
            d: Duplex {
                input: Cursor::new(Script::fixed().opt(proto::OPT_STARTTLS, &[]).0),
                output: Vec::new(),
            },
            offered: true,
            active: false,
            fail: true,
        };
        let r = negotiate_io(&mut s, &TlsCatalog { all_tls: false });
        match r {
            Err(e @ HandshakeError::Tls(_)) => assert!(e.to_string().contains("bad certificate")),
            other => panic!("expected a TLS error, got {:?}", other.map(|_| ())),
        }
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn check(input: Vec<u8>) {
            let len = input.len();
            let mut d = Duplex {
                input: Cursor::new(input),
                output: Vec::new(),
            };
            let r = negotiate(&mut d, &SnapCatalog);
            if let Ok(HandshakeOutcome::Transmission(n)) = &r {
                assert!(Catalog.lookup(&n.export_name).is_some());
                if n.base_allocation.is_some() || !n.dirty_bitmaps.is_empty() {
                    assert!(n.structured_replies);
                }
                let offered = SnapCatalog.dirty_bitmaps(&n.export_name);
                assert!(n.dirty_bitmaps.len() <= MAX_DIRTY_BITMAPS);
                assert!(n.dirty_bitmaps.iter().all(|(_, b)| offered.contains(b)));
            }
            // Replies are bounded by what the client sent: no amplification loops.
            assert!(d.output.len() <= 18 + (len / 16 + 1) * (20 + 4096 + 64) * 4);
        }

        /// Arbitrary option numbers and payloads, correctly framed, so the fuzzing gets
        /// past the framing and into the per-option parsers.
        fn framed() -> impl Strategy<Value = Vec<u8>> {
            let opt = prop_oneof![0u32..16, any::<u32>()];
            let payload = prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..64),
                // Plausible GO / META_CONTEXT bodies naming real exports.
                (any::<bool>(), proptest::collection::vec(any::<u16>(), 0..4)).prop_map(
                    |(ro, infos)| {
                        let name: &[u8] = if ro { b"ro" } else { b"disk0" };
                        let mut d = u32_of(name.len()).to_be_bytes().to_vec();
                        d.extend_from_slice(name);
                        d.extend_from_slice(&u16::try_from(infos.len()).unwrap().to_be_bytes());
                        for i in infos {
                            d.extend_from_slice(&(i % 5).to_be_bytes());
                        }
                        d
                    }
                ),
                Just({
                    let mut d = 5u32.to_be_bytes().to_vec();
                    d.extend_from_slice(b"disk0");
                    d.extend_from_slice(&1u32.to_be_bytes());
                    d.extend_from_slice(&15u32.to_be_bytes());
                    d.extend_from_slice(b"base:allocation");
                    d
                }),
                Just({
                    let mut d = 5u32.to_be_bytes().to_vec();
                    d.extend_from_slice(b"disk0");
                    d.extend_from_slice(&2u32.to_be_bytes());
                    d.extend_from_slice(&20u32.to_be_bytes());
                    d.extend_from_slice(b"qemu:dirty-bitmap:s1");
                    d.extend_from_slice(&18u32.to_be_bytes());
                    d.extend_from_slice(b"qemu:dirty-bitmap:");
                    d
                }),
            ];
            // Mostly valid client flags, sometimes garbage.
            let flags = prop_oneof![
                4 => Just(proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES),
                4 => Just(proto::CLIENT_FLAG_FIXED_NEWSTYLE),
                1 => any::<u32>(),
            ];
            (flags, proptest::collection::vec((opt, payload), 0..12)).prop_map(|(flags, opts)| {
                let mut s = Script::new(flags);
                for (o, p) in opts {
                    s = s.opt(o, &p);
                }
                s.0
            })
        }

        proptest! {
            #[test]
            fn arbitrary_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..512)) {
                check(input);
            }

            #[test]
            fn arbitrary_bytes_after_valid_flags_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..512)) {
                let mut input = (proto::CLIENT_FLAG_FIXED_NEWSTYLE | proto::CLIENT_FLAG_NO_ZEROES).to_be_bytes().to_vec();
                input.extend_from_slice(&tail);
                check(input);
            }

            #[test]
            fn framed_options_never_panic(input in framed()) {
                check(input);
            }
        }
    }
}
