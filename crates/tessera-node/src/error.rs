//! The node's errors: what a management operation can answer ([`Error`], mapped to an
//! HTTP status in one place, `api::status_of`), and why a node cannot start
//! ([`StartError`]).

use std::path::PathBuf;

use tessera_pool::ErrorKind;

/// Why a management operation was refused or failed. The message is meant for the
/// operator as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// A device or a file of the data directory failed.
    #[error("{0}")]
    Io(String),
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
    /// `context: e`, for an I/O error.
    pub fn io(context: &str, e: impl std::fmt::Display) -> Error {
        Error::Io(format!("{context}: {e}"))
    }

    /// `"{what} '{name}' not found"`.
    pub fn missing(what: &str, name: &str) -> Error {
        Error::NotFound(format!("{what} '{name}' not found"))
    }
}

impl From<tessera_pool::Error> for Error {
    fn from(e: tessera_pool::Error) -> Error {
        let m = e.message;
        match e.kind {
            ErrorKind::NotFound => Error::NotFound(m),
            ErrorKind::AlreadyExists => Error::AlreadyExists(m),
            ErrorKind::Busy => Error::Busy(m),
            ErrorKind::InvalidInput => Error::Invalid(m),
            ErrorKind::NoSpace => Error::NoSpace(m),
            ErrorKind::Corrupt => Error::Corrupt(m),
            ErrorKind::Io => Error::Io(m),
        }
    }
}

/// For the parts of the node that still answer with the pool's error type.
impl From<Error> for tessera_pool::Error {
    fn from(e: Error) -> tessera_pool::Error {
        let kind = match &e {
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::AlreadyExists(_) => ErrorKind::AlreadyExists,
            Error::Busy(_) => ErrorKind::Busy,
            Error::Invalid(_) => ErrorKind::InvalidInput,
            Error::NoSpace(_) => ErrorKind::NoSpace,
            Error::Corrupt(_) => ErrorKind::Corrupt,
            Error::Io(_) => ErrorKind::Io,
        };
        tessera_pool::Error::new(kind, e.to_string())
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
    /// background.json) cannot be read.
    #[error("{0}")]
    Catalog(String),
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
        Error::Io(e.to_string())
    }
}
