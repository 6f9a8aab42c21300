//! [`Invalid`]: why a value of the API was refused (a QoS setting out of its range, a
//! layout that does not parse, a catalog encoding that does not decode). Each variant
//! names the field and the bound it broke; its message is what the user reads. The node
//! maps it to HTTP 400 and the CLI to its invalid-input exit code, each in its one place.

use crate::LayoutSpec;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    /// `field` is outside `min..=max`.
    #[error("{field}: {value} is outside {min}..={max}")]
    OutsideRange {
        field: &'static str,
        value: u64,
        min: u64,
        max: u64,
    },
    /// A bandwidth `field` below its smallest value.
    #[error("{field}: {value} is below {min} bytes per second")]
    BandwidthBelow {
        field: &'static str,
        value: u64,
        min: u64,
    },
    /// `field` exceeds its largest value.
    #[error("{field}: {value} exceeds the maximum of {max}")]
    AboveMax {
        field: &'static str,
        value: u64,
        max: u64,
    },
    /// An IOPS limit of 0.
    #[error("{field}: an IOPS limit must be at least 1")]
    ZeroIops { field: &'static str },
    /// A bandwidth limit of 0.
    #[error("{field}: a bandwidth limit must be at least 1 byte per second")]
    ZeroBandwidth { field: &'static str },
    /// A latency target of 0.
    #[error("{field} must be at least 1")]
    Zero { field: &'static str },
    /// A stepped burst's credit longer than a day.
    #[error("credit_ms: {0} exceeds one day")]
    CreditAboveDay(u64),
    /// A catalog encoding of `what` ("QoS limits", "QoS scheduling") with no bytes.
    #[error("{what}: empty input")]
    Empty { what: &'static str },
    /// The QoS scheduling mask sets bits this version does not define.
    #[error("QoS scheduling: reserved bits set in mask {0:#04x}")]
    ReservedBits(u8),
    /// The QoS scheduling extension ends inside its weight.
    #[error("QoS scheduling: truncated weight")]
    TruncatedWeight,
    /// The QoS limits end inside field `field`.
    #[error("QoS limits: truncated (field {field} needs 8 bytes at offset {offset}, {left} left)")]
    TruncatedLimits {
        field: usize,
        offset: usize,
        left: usize,
    },
    /// Not a TLS policy.
    #[error("TLS policy '{0}': expected 'required' or 'optional'")]
    TlsPolicy(String),
    /// Not a replacement state.
    #[error("unknown replacement state '{0}'")]
    ReplaceState(String),
    /// A layout's parameter that is not a number.
    #[error("bad number '{number}' in layout '{layout}'")]
    LayoutNumber { number: String, layout: String },
    /// `ec` without its shape.
    #[error("ec needs its shape: ec:K+M (e.g. ec:4+2)")]
    EcShape,
    /// Not a layout name.
    #[error(
        "unknown layout '{0}' (concat, raid0, raid1[:COPIES], raid10[:COPIES], raid5, raid6, ec:K+M)"
    )]
    UnknownLayout(String),
    /// Copies given twice: in the layout and separately.
    #[error("layout '{layout}' already gives its copies; copies {copies} is one too many")]
    CopiesGiven { layout: LayoutSpec, copies: u32 },
    /// Copies for a layout that does not mirror.
    #[error("copies apply to raid1 and raid10 only, not to layout '{0}'")]
    CopiesNotApplicable(LayoutSpec),
}
