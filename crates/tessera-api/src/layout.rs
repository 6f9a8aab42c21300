//! A pool's layout as users write it (`pool create --layout`, `"layout"` of
//! `POST /v1/pools`, `"layout_spec"` of a pool): parsed once, at the edge, into a
//! [`LayoutSpec`]; the pool turns it into its geometry once it knows the devices.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Invalid;

/// A layout and the parameters the user gave it. Parameters left out (`None`) depend on
/// the number of devices, which the pool fills in: raid1's copies (one per device),
/// raid10's copies (2), ec's k (the devices that are not parity).
///
/// On the wire it is the text [`LayoutSpec::from_str`] reads and `Display` writes:
/// `concat`, `raid0`, `raid1[:COPIES]`, `raid10[:COPIES]`, `raid5`, `raid6`, `ec:K+M`
/// or `ec:M`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum LayoutSpec {
    /// Devices one after the other.
    #[default]
    Concat,
    /// Striping.
    Raid0,
    /// Every device holds a full copy.
    Raid1 { copies: Option<u32> },
    /// Mirror sets of `copies` devices, striped over.
    Raid10 { copies: Option<u32> },
    /// Rotating XOR parity.
    Raid5,
    /// Rotating P+Q parity.
    Raid6,
    /// Reed-Solomon: `k` data and `m` parity chunks per row.
    Ec { k: Option<u32>, m: u32 },
}

impl LayoutSpec {
    /// The layout's name (`raid1`, `ec`, ...), without parameters.
    pub fn name(&self) -> &'static str {
        match self {
            LayoutSpec::Concat => "concat",
            LayoutSpec::Raid0 => "raid0",
            LayoutSpec::Raid1 { .. } => "raid1",
            LayoutSpec::Raid10 { .. } => "raid10",
            LayoutSpec::Raid5 => "raid5",
            LayoutSpec::Raid6 => "raid6",
            LayoutSpec::Ec { .. } => "ec",
        }
    }

    /// Does the layout stripe (raid0, raid10 stripes; raid5, raid6, ec chunks)?
    /// concat and raid1 do not.
    pub fn stripes(&self) -> bool {
        !matches!(self, LayoutSpec::Concat | LayoutSpec::Raid1 { .. })
    }

    /// The layout with its mirrors' copies set (`copies` of `POST /v1/pools`, the CLI's
    /// `--copies`): only for raid1 and raid10, and only when the layout does not give
    /// them already.
    pub fn with_copies(self, copies: u32) -> Result<LayoutSpec, Invalid> {
        match self {
            LayoutSpec::Raid1 { copies: None } => Ok(LayoutSpec::Raid1 {
                copies: Some(copies),
            }),
            LayoutSpec::Raid10 { copies: None } => Ok(LayoutSpec::Raid10 {
                copies: Some(copies),
            }),
            LayoutSpec::Raid1 { .. } | LayoutSpec::Raid10 { .. } => Err(Invalid::CopiesGiven {
                layout: self,
                copies,
            }),
            _ => Err(Invalid::CopiesNotApplicable(self)),
        }
    }
}

impl fmt::Display for LayoutSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match *self {
            LayoutSpec::Raid1 { copies: Some(c) } | LayoutSpec::Raid10 { copies: Some(c) } => {
                write!(f, "{name}:{c}")
            }
            LayoutSpec::Ec { k: Some(k), m } => write!(f, "ec:{k}+{m}"),
            LayoutSpec::Ec { k: None, m } => write!(f, "ec:{m}"),
            _ => f.write_str(name),
        }
    }
}

impl FromStr for LayoutSpec {
    type Err = Invalid;

    /// `concat`, `raid0`, `raid1[:COPIES]`, `raid10[:COPIES]`, `raid5`, `raid6`, `ec:K+M`
    /// or `ec:M`.
    fn from_str(spec: &str) -> Result<LayoutSpec, Invalid> {
        let (name, arg) = match spec.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (spec, None),
        };
        let num = |a: &str| {
            a.parse::<u32>().map_err(|_| Invalid::LayoutNumber {
                number: a.to_string(),
                layout: spec.to_string(),
            })
        };
        match (name, arg) {
            ("concat", None) => Ok(LayoutSpec::Concat),
            ("raid0", None) => Ok(LayoutSpec::Raid0),
            ("raid1", c) => Ok(LayoutSpec::Raid1 {
                copies: c.map(num).transpose()?,
            }),
            ("raid10", c) => Ok(LayoutSpec::Raid10 {
                copies: c.map(num).transpose()?,
            }),
            ("raid5", None) => Ok(LayoutSpec::Raid5),
            ("raid6", None) => Ok(LayoutSpec::Raid6),
            ("ec", Some(a)) => Ok(match a.split_once('+') {
                Some((k, m)) => LayoutSpec::Ec {
                    k: Some(num(k)?),
                    m: num(m)?,
                },
                None => LayoutSpec::Ec {
                    k: None,
                    m: num(a)?,
                },
            }),
            ("ec", None) => Err(Invalid::EcShape),
            (_, _) => Err(Invalid::UnknownLayout(spec.to_string())),
        }
    }
}

impl TryFrom<String> for LayoutSpec {
    type Error = Invalid;

    fn try_from(s: String) -> Result<LayoutSpec, Invalid> {
        s.parse()
    }
}

impl From<LayoutSpec> for String {
    fn from(l: LayoutSpec) -> String {
        l.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_reads_back_as_written() {
        for s in [
            "concat", "raid0", "raid1", "raid1:3", "raid10", "raid10:2", "raid5", "raid6",
            "ec:4+2", "ec:2",
        ] {
            let l: LayoutSpec = s.parse().unwrap();
            assert_eq!(l.to_string(), s);
            assert_eq!(serde_json::to_string(&l).unwrap(), format!("\"{s}\""));
            assert_eq!(
                serde_json::from_str::<LayoutSpec>(&format!("\"{s}\"")).unwrap(),
                l
            );
        }
        assert_eq!(
            "ec:4+2".parse::<LayoutSpec>().unwrap(),
            LayoutSpec::Ec { k: Some(4), m: 2 }
        );
    }

    #[test]
    fn bad_layouts_are_refused() {
        for s in [
            "raid9", "raid0:2", "concat:1", "ec", "raid1:x", "ec:4+", "raid5:1", "",
        ] {
            assert!(s.parse::<LayoutSpec>().is_err(), "{s}");
        }
        assert!(serde_json::from_str::<LayoutSpec>("\"raid9\"").is_err());
    }

    #[test]
    fn copies_go_to_mirrors_that_do_not_give_them() {
        let r1 = LayoutSpec::Raid1 { copies: None };
        assert_eq!(r1.with_copies(3), Ok(LayoutSpec::Raid1 { copies: Some(3) }));
        assert!(LayoutSpec::Raid1 { copies: Some(2) }
            .with_copies(3)
            .is_err());
        assert!(LayoutSpec::Raid5.with_copies(2).is_err());
    }
}
