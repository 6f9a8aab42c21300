//! Device specs as users type them, and human sizes.
//!
//! - `ram:SIZE`, `null:SIZE`
//! - `PATH` (existing file or block device) or `PATH:SIZE` (file created sparse if missing)
//! - `fault:INNER;key=value;...` wraps INNER with fault injection (see [`crate::FaultConfig::set`])

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::{BlockDevice, FaultConfig, FaultDevice, FileDevice, NullDevice, RamDevice};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Ram(u64),
    Null(u64),
    File {
        path: PathBuf,
        create_size: Option<u64>,
    },
    Fault {
        inner: Box<DeviceSpec>,
        settings: Vec<(String, String)>,
    },
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// What [`parse_size`] accepts, for its error messages.
const SIZE_UNITS: &str = "bytes, or K, M, G, T, P (also KiB..PiB, KB..PB; all powers of 1024), e.g. 4096, 64K, 1.5G, 1TiB";

/// Parse `4096`, `64K`, `1M`, `4G`, `1T`, `1P`, `512k`, `1GiB`, `1.5G` (binary units).
pub fn parse_size(s: &str) -> io::Result<u64> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("B"))
        .unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                'P' => 1 << 50,
                _ => {
                    return Err(invalid(format!(
                        "bad size '{s}': unknown unit '{c}' (sizes are {SIZE_UNITS})"
                    )))
                }
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(mult)
            .ok_or_else(|| invalid(format!("bad size '{s}': too large")));
    }
    match num.parse::<f64>() {
        // A fractional size (1.5G): the part below one byte is dropped on purpose, and
        // `as` saturates at u64::MAX.
        #[allow(clippy::cast_possible_truncation)]
        Ok(f) if f >= 0.0 && f.is_finite() => Ok((f * mult as f64) as u64),
        _ => Err(invalid(format!("bad size '{s}' (sizes are {SIZE_UNITS})"))),
    }
}

/// The shortest exact rendering: 1G, 64K, 1536M, 4097.
pub fn format_size(n: u64) -> String {
    for (shift, unit) in [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if n >= 1 << shift && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

impl DeviceSpec {
    pub fn parse(s: &str) -> io::Result<DeviceSpec> {
        if let Some(rest) = s.strip_prefix("fault:") {
            let mut parts = rest.split(';');
            let inner = DeviceSpec::parse(parts.next().unwrap_or(""))?;
            let mut settings = Vec::new();
            for p in parts.filter(|p| !p.is_empty()) {
                let (k, v) = p.split_once('=').ok_or_else(|| {
                    invalid(format!("fault device: expected key=value, got '{p}'"))
                })?;
                settings.push((k.to_string(), v.to_string()));
            }
            return Ok(DeviceSpec::Fault {
                inner: Box::new(inner),
                settings,
            });
        }
        if let Some(sz) = s.strip_prefix("ram:") {
            return Ok(DeviceSpec::Ram(parse_size(sz)?));
        }
        if let Some(sz) = s.strip_prefix("null:") {
            return Ok(DeviceSpec::Null(parse_size(sz)?));
        }
        if s.is_empty() {
            return Err(invalid(
                "empty device spec (use PATH, PATH:SIZE, ram:SIZE or null:SIZE)".into(),
            ));
        }
        if let Some((p, sz)) = s.rsplit_once(':') {
            if let Ok(size) = parse_size(sz) {
                if !p.is_empty() {
                    return Ok(DeviceSpec::File {
                        path: PathBuf::from(p),
                        create_size: Some(size),
                    });
                }
            }
        }
        Ok(DeviceSpec::File {
            path: PathBuf::from(s),
            create_size: None,
        })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Ram(n) => write!(f, "ram:{}", format_size(*n)),
            DeviceSpec::Null(n) => write!(f, "null:{}", format_size(*n)),
            DeviceSpec::File {
                path,
                create_size: None,
            } => write!(f, "{}", path.display()),
            DeviceSpec::File {
                path,
                create_size: Some(n),
            } => write!(f, "{}:{}", path.display(), format_size(*n)),
            DeviceSpec::Fault { inner, settings } => {
                write!(f, "fault:{inner}")?;
                for (k, v) in settings {
                    write!(f, ";{k}={v}")?;
                }
                Ok(())
            }
        }
    }
}

/// Open the device a spec names.
pub fn open_device(spec: &DeviceSpec) -> io::Result<Arc<dyn BlockDevice>> {
    Ok(match spec {
        DeviceSpec::Ram(n) => RamDevice::new(*n)?,
        DeviceSpec::Null(n) => NullDevice::new(*n),
        DeviceSpec::File { path, create_size } => FileDevice::open(path, *create_size)?,
        DeviceSpec::Fault { inner, settings } => {
            let cfg = Arc::new(FaultConfig::default());
            for (k, v) in settings {
                cfg.set(k, v)?;
            }
            FaultDevice::new(open_device(inner)?, cfg)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_binary_unit_up_to_peta_and_the_error_lists_them() {
        for (text, n) in [
            ("1P", 1u64 << 50),
            ("1PiB", 1 << 50),
            ("2TiB", 2 << 40),
            ("3GiB", 3 << 30),
            ("4MiB", 4 << 20),
            ("5KiB", 5 << 10),
            ("6KB", 6 << 10),
        ] {
            assert_eq!(parse_size(text).unwrap(), n, "{text}");
        }
        let e = parse_size("1Q").unwrap_err().to_string();
        assert!(
            e.contains("P") && e.contains("PiB") && e.contains("T"),
            "{e}"
        );
        let e = parse_size("x").unwrap_err().to_string();
        assert!(e.contains("PiB"), "{e}");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert!(parse_size("12Q").is_err());
        assert_eq!(format_size(1 << 30), "1G");
        assert_eq!(format_size(1536 << 20), "1536M");
    }

    #[test]
    fn specs() {
        assert_eq!(
            DeviceSpec::parse("ram:1G").unwrap(),
            DeviceSpec::Ram(1 << 30)
        );
        assert_eq!(
            DeviceSpec::parse("/tmp/a.img:4G").unwrap(),
            DeviceSpec::File {
                path: "/tmp/a.img".into(),
                create_size: Some(4 << 30)
            }
        );
        assert_eq!(
            DeviceSpec::parse("/dev/sdb").unwrap(),
            DeviceSpec::File {
                path: "/dev/sdb".into(),
                create_size: None
            }
        );
        let f = DeviceSpec::parse("fault:ram:1M;latency_us=10").unwrap();
        assert_eq!(f.to_string(), "fault:ram:1M;latency_us=10");
        assert!(open_device(&DeviceSpec::parse("fault:ram:1M;bogus=1").unwrap()).is_err());
    }
}
