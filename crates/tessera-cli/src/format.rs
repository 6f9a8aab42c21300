//! How the CLI shows figures to people: binary units (`4.0 GiB`, `100 MiB/s`) and aligned
//! tables. `--json` prints the node's exact bytes instead.

const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// `n` in the largest binary unit it reaches, with one decimal: `4.0 GiB`, `512.0 KiB`
/// (the formatter the pool's own messages use).
pub use tessera_io::units::human_bytes as bytes;

/// A rate in bytes per second: exact when it is a whole number of its unit (`100 MiB/s`,
/// as the operator typed `--bw 100M`), else with one decimal (`1.5 GiB/s`).
pub fn rate(bps: u64) -> String {
    let mut i = 0;
    while i + 1 < UNITS.len() && bps >= 1u64 << (10 * (i + 1)) {
        i += 1;
    }
    let unit = 1u64 << (10 * i);
    if bps.is_multiple_of(unit) {
        format!("{} {}/s", bps / unit, UNITS[i])
    } else {
        format!("{:.1} {}/s", bps as f64 / unit as f64, UNITS[i])
    }
}

/// `-` for a missing value.
pub fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |x| x.to_string())
}

/// Rows under a header row, columns padded to their widest cell.
pub fn table(rows: Vec<Vec<String>>) {
    let cols = rows.first().map_or(0, |r| r.len());
    let w: Vec<usize> = (0..cols)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = w[i]))
            .collect();
        println!("{}", line.join("  ").trim_end());
    }
}

/// Seconds since the epoch as the machine's local time, `2026-11-27 12:05:01 UTC` (the
/// zone's abbreviation as the C library names it; `TZ` applies). The raw seconds are
/// printed instead if the C library cannot convert them.
pub fn local_time(epoch_secs: u64) -> String {
    let Ok(t) = libc::time_t::try_from(epoch_secs) else {
        return epoch_secs.to_string();
    };
    // SAFETY: `tm` is plain data that localtime_r fills; zeroed is a valid value of it.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; localtime_r is the thread-safe form.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return epoch_secs.to_string();
    }
    let zone = if tm.tm_zone.is_null() {
        String::new()
    } else {
        // SAFETY: a non-null tm_zone points at a NUL-terminated name the C library keeps.
        let z = unsafe { std::ffi::CStr::from_ptr(tm.tm_zone) };
        format!(" {}", z.to_string_lossy())
    };
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}{zone}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_use_binary_unit_names() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(4 << 30), "4.0 GiB");
        assert_eq!(bytes(4160 << 20), "4.1 GiB");
        assert_eq!(bytes(1536 << 10), "1.5 MiB");
        assert_eq!(bytes(1 << 50), "1.0 PiB");
    }

    #[test]
    fn rates_are_exact_when_whole() {
        assert_eq!(rate(100 << 20), "100 MiB/s");
        assert_eq!(rate(1 << 30), "1 GiB/s");
        assert_eq!(rate(1536 << 20), "1.5 GiB/s");
        assert_eq!(rate(1000), "1000 B/s");
        assert_eq!(rate(0), "0 B/s");
    }

    #[test]
    fn local_time_is_a_readable_date() {
        // Whatever the machine's zone, the date is within a day of the UTC one.
        let s = local_time(1_795_765_301); // 2026-11-27 07:41:41 UTC
        assert!(
            s.starts_with("2026-11-27 ")
                || s.starts_with("2026-11-26 ")
                || s.starts_with("2026-11-28 "),
            "{s}"
        );
        assert_eq!(s.as_bytes()[13], b':', "{s}");
    }
}
