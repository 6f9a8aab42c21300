//! Errors of pool and volume management. Each variant is what went wrong (the node maps
//! it to an HTTP status, the CLI to an exit code); its message is what the user reads;
//! an I/O error keeps the `std::io::Error` that caused it as its `source`, so a caller
//! can still ask for its kind and errno instead of parsing text.

/// The variant of an [`Error`] without its payload: what callers branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    AlreadyExists,
    InvalidInput,
    NoSpace,
    Busy,
    Corrupt,
    Io,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A pool, volume, snapshot or export of that name or id does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The name is taken already.
    #[error("{0}")]
    AlreadyExists(String),
    /// A bad name, size, layout or argument.
    #[error("{0}")]
    InvalidInput(String),
    /// No free unit, or the overcommit ratio would be exceeded.
    #[error("{0}")]
    NoSpace(String),
    /// In use: clones read through it, a rebuild or a copy holds it.
    #[error("{0}")]
    Busy(String),
    /// Metadata that does not decode or does not add up.
    #[error("{0}")]
    Corrupt(String),
    /// Devices that do not compose into the layout asked for, or a device that cannot be
    /// rebuilt now: invalid input, keeping the layout's own error.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A device or metadata I/O failed: what was being done, and the error.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An error of `kind` with `message`. An `Io` error made this way has no cause of its
    /// own: its source is an `io::Error` of kind `Other` carrying the message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        let m = message.into();
        match kind {
            ErrorKind::NotFound => Error::NotFound(m),
            ErrorKind::AlreadyExists => Error::AlreadyExists(m),
            ErrorKind::InvalidInput => Error::InvalidInput(m),
            ErrorKind::NoSpace => Error::NoSpace(m),
            ErrorKind::Busy => Error::Busy(m),
            ErrorKind::Corrupt => Error::Corrupt(m),
            ErrorKind::Io => Error::Io {
                context: m,
                source: std::io::Error::other("failed"),
            },
        }
    }
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::InvalidInput(message.into())
    }
    pub fn corrupt(message: impl Into<String>) -> Error {
        Error::Corrupt(message.into())
    }
    /// `context: e`, keeping `e` as the source.
    pub fn io(context: &str, e: std::io::Error) -> Error {
        Error::Io {
            context: context.to_string(),
            source: e,
        }
    }

    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::AlreadyExists(_) => ErrorKind::AlreadyExists,
            Error::InvalidInput(_) | Error::Layout(_) => ErrorKind::InvalidInput,
            Error::NoSpace(_) => ErrorKind::NoSpace,
            Error::Busy(_) => ErrorKind::Busy,
            Error::Corrupt(_) => ErrorKind::Corrupt,
            Error::Io { .. } => ErrorKind::Io,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Why devices cannot be composed into a layout, or a device cannot be rebuilt. Each
/// variant names the numbers that broke the rule; its message is what the user reads. It
/// becomes [`Error::Layout`] (invalid input) at the pool's API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The layout as the user wrote it does not parse.
    #[error(transparent)]
    Spec(#[from] tessera_api::Invalid),
    #[error("a pool needs at least one device")]
    NoDevices,
    #[error("a pool has at most 64 devices")]
    TooManyDevices,
    #[error("device {0} is too small (a device needs more than 1 MiB)")]
    DeviceTooSmall(String),
    #[error("raid1 keeps one copy per device: copies ({copies}) must equal the number of devices ({devices}), at least 2")]
    Raid1Copies { copies: u32, devices: usize },
    #[error("raid10 with {copies} copies needs a multiple of {copies} devices, at least {least} (got {devices})")]
    Raid10Devices {
        copies: u32,
        least: u32,
        devices: usize,
    },
    #[error("stripe size {0} must be a power of two between 4K and 16M")]
    Stripe(u64),
    #[error("devices are smaller than one stripe")]
    SmallerThanStripe,
    #[error("layout '{spec}' needs k+m devices with k, m at least 1 (got {devices} devices)")]
    EcShape {
        spec: tessera_api::LayoutSpec,
        devices: usize,
    },
    #[error("ec {k}+{m} needs {need} devices, got {devices}")]
    EcDevices {
        k: u32,
        m: u32,
        need: u32,
        devices: usize,
    },
    #[error(
        "chunk (stripe) size {0} must be a power of two between 4K and 256K for parity layouts"
    )]
    Chunk(u64),
    #[error("{devices} devices cannot hold {parity} parity chunk(s) per row: at least {need} devices are needed")]
    ParityDevices {
        devices: usize,
        parity: usize,
        need: usize,
    },
    #[error("devices are too small for a parity layout (each needs more than {0} MiB)")]
    ParityTooSmall(u64),
    #[error("a {devices}-device parity layout supports chunks up to {max_kib} KiB (the stripe journal holds a whole row per record)")]
    ChunkForJournal { devices: usize, max_kib: u64 },
    /// The erasure code refuses the shape.
    #[error(transparent)]
    Code(#[from] tessera_parity::ParityError),
    #[error("only mirrored and parity layouts can be rebuilt")]
    NotRedundant,
    #[error("no device {0}")]
    NoDevice(usize),
    #[error("device {0} is already being rebuilt")]
    AlreadyRebuilding(usize),
    #[error("device {0} cannot be rebuilt: too many other devices are failed or rebuilding")]
    TooManyUnreadable(usize),
    #[error("device {0} has no healthy copy to rebuild from")]
    NoHealthyCopy(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_keeps_its_cause() {
        let e = Error::io(
            "reading the label of /dev/x",
            std::io::Error::from_raw_os_error(libc::EIO),
        );
        assert_eq!(e.kind(), ErrorKind::Io);
        let src = std::error::Error::source(&e).expect("a source");
        let io = src.downcast_ref::<std::io::Error>().expect("an io::Error");
        assert_eq!(io.raw_os_error(), Some(libc::EIO));
        assert!(
            e.to_string().starts_with("reading the label of /dev/x: "),
            "{e}"
        );
    }
}
