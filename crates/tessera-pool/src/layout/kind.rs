//! The kinds of layout a pool can have, their names and their parameters.

use tessera_io::cast::u32_of;

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
    pub fn parse(spec: &str, stripe: u64, ndev: usize) -> Result<LayoutKind, String> {
        let (name, arg) = match spec.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (spec, None),
        };
        let num = |a: &str| {
            a.parse::<u32>()
                .map_err(|_| format!("bad number '{a}' in layout '{spec}'"))
        };
        match (name, arg) {
            ("concat", None) => Ok(LayoutKind::Concat),
            ("raid0", None) => Ok(LayoutKind::Raid0 { stripe }),
            ("raid1", c) => Ok(LayoutKind::Raid1 {
                copies: c.map(num).transpose()?.unwrap_or(u32_of(ndev)),
            }),
            ("raid10", c) => Ok(LayoutKind::Raid10 {
                copies: c.map(num).transpose()?.unwrap_or(2),
                stripe,
            }),
            ("raid5", None) => Ok(LayoutKind::Raid5 { stripe }),
            ("raid6", None) => Ok(LayoutKind::Raid6 { stripe }),
            ("ec", Some(a)) => {
                let (k, m) = match a.split_once('+') {
                    Some((k, m)) => (num(k)?, num(m)?),
                    None => {
                        let m = num(a)?;
                        (u32_of(ndev).saturating_sub(m), m)
                    }
                };
                if k == 0 || m == 0 || (k + m) as usize != ndev {
                    return Err(format!(
                        "layout '{spec}' needs k+m devices with k, m at least 1 (got {ndev} devices)"
                    ));
                }
                Ok(LayoutKind::Ec { k, m, stripe })
            }
            ("ec", None) => Err("ec needs its shape: ec:K+M (e.g. ec:4+2)".into()),
            (_, _) => Err(format!(
                "unknown layout '{spec}' (concat, raid0, raid1[:COPIES], raid10[:COPIES], raid5, raid6, ec:K+M)"
            )),
        }
    }

    /// The inverse of [`LayoutKind::parse`] (without the stripe size).
    pub fn spec(&self) -> String {
        match *self {
            LayoutKind::Raid1 { copies } | LayoutKind::Raid10 { copies, .. } => {
                format!("{}:{copies}", self.name())
            }
            LayoutKind::Ec { k, m, .. } => format!("ec:{k}+{m}"),
            _ => self.name().to_string(),
        }
    }
}
