//! Byte counts for people: the one formatter the pool's messages and the CLI's tables
//! share, so a size reads the same in an error and in `tessera pool list`.

const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// `n` in the largest binary unit it reaches, with one decimal: `4.0 GiB`, `512.0 KiB`;
/// below 1 KiB, exact: `1000 B`.
pub fn human_bytes(n: u64) -> String {
    #[allow(clippy::cast_precision_loss)] // one decimal is shown
    let mut f = n as f64;
    let mut i = 0;
    while f >= 1024.0 && i + 1 < UNITS.len() {
        f /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{f:.1} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::human_bytes;

    #[test]
    fn sizes_read_in_their_largest_unit() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(4 << 30), "4.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
    }
}
