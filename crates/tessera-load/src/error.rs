//! Why a load run could not start, broke off, or failed. The CLI maps each variant to an
//! exit code (`tessera-cli/src/error.rs`); an I/O error keeps its `io::Error`.

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The arguments do not describe a run: a bad URI, size, block size or depth.
    #[error("{0}")]
    Invalid(String),
    /// The server broke the protocol (a reply for no request, a bad magic, a short
    /// read): the run stops, since the stream cannot be trusted any more.
    #[error("{0}")]
    Protocol(String),
    /// A socket or a device failed: what was being done, and the error.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The NVMe/TCP initiator failed: connecting, authenticating, or a command the
    /// target refused.
    #[error("{context}: {source}")]
    Nvme {
        context: String,
        #[source]
        source: tessera_nvmf::initiator::Error,
    },
    /// The in-process subject (device, pool, volume) could not be set up.
    #[error("{context}: {source}")]
    Setup {
        context: String,
        #[source]
        source: tessera_pool::Error,
    },
    /// The run completed, but what it measured is a failure (I/O errors, a failed
    /// verification).
    #[error("{0}")]
    Failed(String),
}

impl LoadError {
    /// `context: e`, keeping `e`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> LoadError {
        LoadError::Io {
            context: context.into(),
            source,
        }
    }

    pub fn invalid(message: impl Into<String>) -> LoadError {
        LoadError::Invalid(message.into())
    }

    pub fn protocol(message: impl Into<String>) -> LoadError {
        LoadError::Protocol(message.into())
    }

    /// The same error, its message prefixed with `what: ` (which connection, which URI).
    pub fn within(self, what: impl std::fmt::Display) -> LoadError {
        match self {
            LoadError::Invalid(m) => LoadError::Invalid(format!("{what}: {m}")),
            LoadError::Protocol(m) => LoadError::Protocol(format!("{what}: {m}")),
            LoadError::Failed(m) => LoadError::Failed(format!("{what}: {m}")),
            LoadError::Io { context, source } => LoadError::Io {
                context: format!("{what}: {context}"),
                source,
            },
            LoadError::Nvme { context, source } => LoadError::Nvme {
                context: format!("{what}: {context}"),
                source,
            },
            LoadError::Setup { context, source } => LoadError::Setup {
                context: format!("{what}: {context}"),
                source,
            },
        }
    }
}
