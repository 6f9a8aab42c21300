//! The kinds of layout a pool can have, their names and their parameters.

use tessera_api::LayoutSpec;
use tessera_io::cast::u32_of;

use super::LayoutError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    Concat,
    /// Striping with a power-of-two stripe size in bytes.
    Raid0 {
        stripe: u64,
    },
    /// Every device holds a full copy (`copies` = number of devices).
    Raid1 {
        copies: u32,
    },
    /// Devices form mirror sets of `copies` consecutive devices; stripes rotate over sets.
    Raid10 {
        copies: u32,
        stripe: u64,
    },
    /// Rotating single parity (XOR) over all devices: n-1 data chunks per row.
    Raid5 {
        stripe: u64,
    },
    /// Rotating P+Q parity (Linux md's RAID6 code): n-2 data chunks per row.
    Raid6 {
        stripe: u64,
    },
    /// Reed-Solomon erasure coding: k data and m parity chunks per row (k+m devices).
    Ec {
        k: u32,
        m: u32,
        stripe: u64,
    },
}

impl LayoutKind {
    pub fn name(&self) -> &'static str {
        match self {
            LayoutKind::Concat => "concat",
            LayoutKind::Raid0 { .. } => "raid0",
            LayoutKind::Raid1 { .. } => "raid1",
            LayoutKind::Raid10 { .. } => "raid10",
            LayoutKind::Raid5 { .. } => "raid5",
            LayoutKind::Raid6 { .. } => "raid6",
            LayoutKind::Ec { .. } => "ec",
        }
    }

    /// Copies of each block (1 for concat and raid0).
    pub fn copies(&self) -> u32 {
        match *self {
            LayoutKind::Raid1 { copies } | LayoutKind::Raid10 { copies, .. } => copies,
            _ => 1,
        }
    }

    pub fn stripe(&self) -> u64 {
        match *self {
            LayoutKind::Raid0 { stripe }
            | LayoutKind::Raid10 { stripe, .. }
            | LayoutKind::Raid5 { stripe }
            | LayoutKind::Raid6 { stripe }
            | LayoutKind::Ec { stripe, .. } => stripe,
            _ => 0,
        }
    }

    /// Parity chunks per row (0 for the layouts without parity).
    pub fn parity(&self) -> u32 {
        match *self {
            LayoutKind::Raid5 { .. } => 1,
            LayoutKind::Raid6 { .. } => 2,
            LayoutKind::Ec { m, .. } => m,
            _ => 0,
        }
    }

    pub fn is_parity(&self) -> bool {
        self.parity() > 0
    }

    /// Survives the loss of at least one device.
    pub fn is_redundant(&self) -> bool {
        self.is_mirror() || self.is_parity()
    }

    pub fn is_mirror(&self) -> bool {
        self.copies() > 1
    }

    /// A layout as users write it: `concat`, `raid0`, `raid1[:COPIES]` (default: one copy
    /// per device), `raid10[:COPIES]` (default 2), `raid5`, `raid6`, `ec:K+M` (or `ec:M`,
    /// K being the other devices); `stripe` is the stripe (parity: chunk) size.
    pub fn parse(spec: &str, stripe: u64, ndev: usize) -> Result<LayoutKind, LayoutError> {
        LayoutKind::from_spec(spec.parse()?, stripe, ndev)
    }

    /// The layout `spec` names, on `ndev` devices (the parameters it leaves out are
    /// defaulted from them); `stripe` is the stripe (parity: chunk) size.
    pub fn from_spec(
        spec: LayoutSpec,
        stripe: u64,
        ndev: usize,
    ) -> Result<LayoutKind, LayoutError> {
        Ok(match spec {
            LayoutSpec::Concat => LayoutKind::Concat,
            LayoutSpec::Raid0 => LayoutKind::Raid0 { stripe },
            LayoutSpec::Raid1 { copies } => LayoutKind::Raid1 {
                copies: copies.unwrap_or(u32_of(ndev)),
            },
            LayoutSpec::Raid10 { copies } => LayoutKind::Raid10 {
                copies: copies.unwrap_or(2),
                stripe,
            },
            LayoutSpec::Raid5 => LayoutKind::Raid5 { stripe },
            LayoutSpec::Raid6 => LayoutKind::Raid6 { stripe },
            LayoutSpec::Ec { k, m } => {
                let k = k.unwrap_or(u32_of(ndev).saturating_sub(m));
                if k == 0 || m == 0 || (k + m) as usize != ndev {
                    return Err(LayoutError::EcShape {
                        spec,
                        devices: ndev,
                    });
                }
                LayoutKind::Ec { k, m, stripe }
            }
        })
    }

    /// The inverse of [`LayoutKind::from_spec`] (without the stripe size), every
    /// parameter given.
    pub fn spec(&self) -> LayoutSpec {
        match *self {
            LayoutKind::Concat => LayoutSpec::Concat,
            LayoutKind::Raid0 { .. } => LayoutSpec::Raid0,
            LayoutKind::Raid1 { copies } => LayoutSpec::Raid1 {
                copies: Some(copies),
            },
            LayoutKind::Raid10 { copies, .. } => LayoutSpec::Raid10 {
                copies: Some(copies),
            },
            LayoutKind::Raid5 { .. } => LayoutSpec::Raid5,
            LayoutKind::Raid6 { .. } => LayoutSpec::Raid6,
            LayoutKind::Ec { k, m, .. } => LayoutSpec::Ec { k: Some(k), m },
        }
    }
}
