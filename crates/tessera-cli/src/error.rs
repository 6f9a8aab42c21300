//! The CLI's errors and the one place they become an exit code ([`CliError::exit_code`]).
//! The codes are documented in `tessera --help` (main.rs) and the README.

/// Exit codes of the `tessera` command.
pub mod exit {
    /// The command did what it was asked.
    pub const OK: i32 = 0;
    /// A job ended badly, or another failure not listed below.
    pub const FAILURE: i32 = 1;
    /// The command line is wrong (unknown command or flag, missing argument).
    pub const USAGE: i32 = 2;
    /// The node has no such pool, volume, export, group, subsystem... (HTTP 404).
    pub const NOT_FOUND: i32 = 3;
    /// The operation conflicts with the node's state: the object already exists, or it
    /// is busy (exported, connected, holding volumes) (HTTP 409).
    pub const CONFLICT: i32 = 4;
    /// An argument's value is invalid (a size, a layout, a limit), as the CLI or the node
    /// (HTTP 400) found.
    pub const INVALID: i32 = 5;
    /// The node or a device is unavailable: the API cannot be reached, an I/O error, the
    /// node failed internally (HTTP 5xx) or its pool is full.
    pub const UNAVAILABLE: i32 = 6;
    /// `pool status --check` (or `pool show --check`): the pool is degraded or failed.
    pub const DEGRADED: i32 = 7;
}

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The node answered the request with an error (HTTP `status`, its message).
    #[error("{message}")]
    Api { status: u16, message: String },
    /// The node cannot be reached, or a local file, device or target failed.
    #[error("{0}")]
    Unavailable(String),
    /// An argument the CLI checks itself is wrong.
    #[error("{0}")]
    Invalid(String),
    /// An argument a library refused (a layout, a secret, a secret file), keeping that
    /// library's typed error: an invalid argument, with the same message.
    #[error(transparent)]
    Rejected(Box<dyn std::error::Error + Send + Sync>),
    /// The command line asks for something the command does not do (a global flag it
    /// does not honour).
    #[error("{0}")]
    Usage(String),
    /// `pool status --check` found the pool degraded or failed.
    #[error("{0}")]
    Degraded(String),
    /// Anything else: a job that ended badly, a load generator's error.
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Api { status, .. } => match status {
                400 | 422 => exit::INVALID,
                404 => exit::NOT_FOUND,
                409 => exit::CONFLICT,
                500..=599 => exit::UNAVAILABLE,
                _ => exit::FAILURE,
            },
            CliError::Unavailable(_) => exit::UNAVAILABLE,
            CliError::Invalid(_) | CliError::Rejected(_) => exit::INVALID,
            CliError::Usage(_) => exit::USAGE,
            CliError::Degraded(_) => exit::DEGRADED,
            CliError::Failed(_) => exit::FAILURE,
        }
    }
}

/// A load run's error, by what went wrong: bad arguments are invalid, a socket, device or
/// target that failed is unavailable, a broken protocol or a failed run is a failure.
impl From<tessera_load::LoadError> for CliError {
    fn from(e: tessera_load::LoadError) -> CliError {
        use tessera_load::LoadError as L;
        match e {
            L::Invalid(m) => CliError::Invalid(m),
            e @ (L::Io { .. } | L::Nvme { .. } | L::Setup { .. }) => {
                CliError::Unavailable(e.to_string())
            }
            e @ (L::Protocol(_) | L::Failed(_)) => CliError::Failed(e.to_string()),
        }
    }
}

impl From<tessera_api::Invalid> for CliError {
    fn from(e: tessera_api::Invalid) -> CliError {
        CliError::Rejected(Box::new(e))
    }
}

impl From<HostArgError> for CliError {
    fn from(e: HostArgError) -> CliError {
        CliError::Rejected(Box::new(e))
    }
}

/// The node runner still reports errors as text.
impl From<String> for CliError {
    fn from(e: String) -> CliError {
        CliError::Failed(e)
    }
}

/// A node that cannot start: a wrong configuration is an invalid argument, anything else
/// (devices, data directory, ports, io_uring) leaves the node unavailable.
impl From<tessera_node::error::StartError> for CliError {
    fn from(e: tessera_node::error::StartError) -> CliError {
        use tessera_node::error::{Error, StartError};
        match &e {
            StartError::Config(_)
            | StartError::NbdTls(_)
            | StartError::Declaration {
                source: Error::Invalid(_) | Error::Rejected(_),
                ..
            } => CliError::Invalid(e.to_string()),
            _ => CliError::Unavailable(e.to_string()),
        }
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> CliError {
        CliError::Unavailable(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, CliError>;

/// Why the initiator's host arguments are unusable: each names the flag, and keeps what
/// went wrong (the file's `io::Error`, the secret's parse error) as its source.
#[derive(Debug, thiserror::Error)]
pub enum HostArgError {
    #[error("--{flag}-file {}: {source}", path.display())]
    SecretFile {
        flag: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--{flag}: {source}")]
    Secret {
        flag: &'static str,
        #[source]
        source: tessera_nvmf::auth::SecretError,
    },
    #[error("--dhchap-ctrl-secret needs --dhchap-secret")]
    CtrlSecretAlone,
}
