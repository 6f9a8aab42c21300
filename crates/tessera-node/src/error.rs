//! The node's errors: what a management operation can answer ([`Error`], mapped to an
//! HTTP status in one place, `api::status_of`), and why a node cannot start
//! ([`StartError`]).

use std::path::PathBuf;

/// Why a management operation was refused or failed. The message is meant for the
/// operator as it is; an I/O failure keeps the error that caused it as its `source`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A named object (pool, volume, export, group, subsystem, job...) does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The name or the device is taken already.
    #[error("{0}")]
    AlreadyExists(String),
    /// The object is in use: volumes left in a pool, a job running, clients connected.
    #[error("{0}")]
    Busy(String),
    /// The request itself is wrong: a bad name, size, layout or field.
    #[error("{0}")]
    Invalid(String),
    /// The pool has no room left.
    #[error("{0}")]
    NoSpace(String),
    /// Metadata that does not decode.
    #[error("{0}")]
    Corrupt(String),
    /// What the operation needs is not there now and may come back: a cluster volume's
    /// owner that is not a live member, or has no NVMe/TCP listener.
    #[error("{0}")]
    Unavailable(String),
    /// A request a lower layer refused as invalid (a QoS setting, a layout), keeping
    /// that layer's typed error (`tessera_api::Invalid`, `tessera_pool::LayoutError`):
    /// answered like [`Error::Invalid`], with the same message.
    #[error(transparent)]
    Rejected(Box<dyn std::error::Error + Send + Sync>),
    /// A device, a file of the data directory, a peer or etcd failed: what was being
    /// done, and the error.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::NotFound(message.into())
    }
    pub fn already_exists(message: impl Into<String>) -> Error {
        Error::AlreadyExists(message.into())
    }
    pub fn busy(message: impl Into<String>) -> Error {
        Error::Busy(message.into())
    }
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::Invalid(message.into())
    }
    pub fn unavailable(message: impl Into<String>) -> Error {
        Error::Unavailable(message.into())
    }
    /// `context: e`, for an I/O error; `e` stays the source.
    pub fn io(context: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
        Error::Io {
            context: context.to_string(),
            source: e.into(),
        }
    }

    /// `"{what} '{name}' not found"`.
    pub fn missing(what: &str, name: &str) -> Error {
        Error::NotFound(format!("{what} '{name}' not found"))
    }
}

/// A request's field that a lower layer refused: the field's name, and that layer's error
/// as the cause (kept inside [`Error::Rejected`]).
#[derive(Debug, thiserror::Error)]
#[error("{field}: {source}")]
pub struct FieldError {
    pub field: &'static str,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl Error {
    /// Field `field` refused for `source`: invalid input, keeping `source`.
    pub fn field(
        field: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Error {
        Error::Rejected(Box::new(FieldError {
            field,
            source: source.into(),
        }))
    }
}

impl From<tessera_nvmf::target::TargetError> for Error {
    fn from(e: tessera_nvmf::target::TargetError) -> Error {
        Error::Rejected(Box::new(e))
    }
}

impl From<tessera_api::Invalid> for Error {
    fn from(e: tessera_api::Invalid) -> Error {
        Error::Rejected(Box::new(e))
    }
}

impl From<tessera_pool::layout::LayoutError> for Error {
    fn from(e: tessera_pool::layout::LayoutError) -> Error {
        Error::Rejected(Box::new(e))
    }
}

/// The pool's error, variant for variant; an I/O error keeps its `io::Error` source.
impl From<tessera_pool::Error> for Error {
    fn from(e: tessera_pool::Error) -> Error {
        use tessera_pool::Error as P;
        match e {
            P::NotFound(m) => Error::NotFound(m),
            P::AlreadyExists(m) => Error::AlreadyExists(m),
            P::Busy(m) => Error::Busy(m),
            P::InvalidInput(m) => Error::Invalid(m),
            P::Layout(e) => Error::Rejected(Box::new(e)),
            P::NoSpace(m) => Error::NoSpace(m),
            P::Corrupt(m) => Error::Corrupt(m),
            P::Io { context, source } => Error::Io {
                context,
                source: Box::new(source),
            },
        }
    }
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration file cannot be read or parsed.
    #[error("{0}")]
    Config(String),
    #[error("cannot create data directory {}: {source}", path.display())]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Another node holds the data directory's lock (crate::datadir).
    #[error("data directory {} is in use by another tessera node ({holder}); stop that node first, or give this one its own data directory", dir.display())]
    Locked { dir: PathBuf, holder: String },
    #[error("cannot start reactors (is io_uring available?): {0}")]
    Reactors(std::io::Error),
    /// A catalog file of the data directory (pools.json, groups.json, nvmf.json,
    /// iscsi.json, background.json) cannot be read or does not decode.
    #[error(transparent)]
    Catalog(Error),
    /// A pool, volume or export the configuration declares cannot be created.
    #[error("creating {what} '{name}' from the config: {source}")]
    Declaration {
        what: &'static str,
        name: String,
        source: Error,
    },
    /// A listener (API, NBD) cannot be started.
    #[error("{0}")]
    Listen(std::io::Error),
    /// The NBD listener's certificate, key or client CA cannot be used: a configuration
    /// error, keeping what reading or parsing the file gave.
    #[error(transparent)]
    NbdTls(tessera_nbd::tls::TlsConfigError),
}

/// A catalog file could not be saved (`registry::write_atomic`).
#[derive(Debug, thiserror::Error)]
#[error("saving {}: {source}", path.display())]
pub struct SaveError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

impl From<SaveError> for String {
    fn from(e: SaveError) -> String {
        e.to_string()
    }
}

impl From<SaveError> for Error {
    fn from(e: SaveError) -> Error {
        Error::Io {
            context: format!("saving {}", e.path.display()),
            source: Box::new(e.source),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_io_error_keeps_its_errno_through_the_node() {
        let p = tessera_pool::Error::io(
            "writing a checkpoint",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        let e = Error::from(p);
        let src = std::error::Error::source(&e).expect("a source");
        let io = src.downcast_ref::<std::io::Error>().expect("an io::Error");
        assert_eq!(io.raw_os_error(), Some(libc::ENOSPC));
        assert!(e.to_string().starts_with("writing a checkpoint: "), "{e}");
    }
}
