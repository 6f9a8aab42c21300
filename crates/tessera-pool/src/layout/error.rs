//! [`LayoutError`]: why devices cannot be composed into a layout, or a device cannot be
//! rebuilt. Each variant names the numbers that broke the rule; its message is what the
//! user reads. It becomes a [`crate::Error`] (invalid input) at the pool's API.

use tessera_api::{Invalid, LayoutSpec};
use tessera_parity::ParityError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The layout as the user wrote it does not parse.
    #[error(transparent)]
    Spec(#[from] Invalid),
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
    EcShape { spec: LayoutSpec, devices: usize },
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
    Code(#[from] ParityError),
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
