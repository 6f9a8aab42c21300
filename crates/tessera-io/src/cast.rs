//! Integer conversions the datapath makes everywhere, in one audited place.
//!
//! Byte offsets and lengths are `u64` (device and pool addresses) and index memory as
//! `usize`. Tessera builds only for 64-bit targets (asserted below), where that
//! conversion is exact; `usize_of` says so once instead of at each of hundreds of casts.

const _: () = assert!(
    usize::BITS >= u64::BITS,
    "Tessera needs a 64-bit target: u64 offsets index memory as usize"
);

/// `x` as a `usize`: exact on the 64-bit targets Tessera builds for.
#[inline(always)]
#[must_use]
pub const fn usize_of(x: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // usize is at least 64 bits (asserted above)
    let v = x as usize;
    v
}

/// `x` as a `u32`, for values bounded by construction (an I/O length, which `IoOp`
/// carries as `u32`; a count of devices, rows or pieces of one request). A value that
/// does not fit is a bug upstream: it panics, naming the caller, instead of silently
/// wrapping into a wrong length.
#[inline]
#[track_caller]
#[must_use]
pub fn u32_of<T>(x: T) -> u32
where
    T: TryInto<u32> + Copy + std::fmt::Display,
{
    match x.try_into() {
        Ok(v) => v,
        Err(_) => panic!("{x} does not fit in a u32"),
    }
}

/// `x` as a `u16`, for values bounded by construction (a slot number, a length field of
/// a message this side builds). Panics, naming the caller, on a value that does not fit.
#[inline]
#[track_caller]
#[must_use]
pub fn u16_of<T>(x: T) -> u16
where
    T: TryInto<u16> + Copy + std::fmt::Display,
{
    match x.try_into() {
        Ok(v) => v,
        Err(_) => panic!("{x} does not fit in a u16"),
    }
}

/// `x` as a `u8`, for values bounded by construction (a shard or device index: a pool
/// has at most 64 devices). Panics, naming the caller, on a value that does not fit.
#[inline]
#[track_caller]
#[must_use]
pub fn u8_of<T>(x: T) -> u8
where
    T: TryInto<u8> + Copy + std::fmt::Display,
{
    match x.try_into() {
        Ok(v) => v,
        Err(_) => panic!("{x} does not fit in a u8"),
    }
}

/// `x` as a `u64`, saturating: a NaN or negative value is 0, one above `u64::MAX` is
/// `u64::MAX` (what Rust's `as` does for floats, written down once). For rates, sizes
/// and durations computed in floating point, where a fraction is dropped on purpose.
#[inline]
#[must_use]
pub fn u64_of_f64(x: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // saturating, above
    let v = x as u64;
    v
}

/// Whole milliseconds and nanoseconds of a `Duration` as a `u64`, saturating (a `u64` of
/// nanoseconds spans 584 years, of milliseconds far more: saturation never shows in
/// practice, and a timeout or a latency must never wrap to a small value).
pub trait DurationU64 {
    /// [`Duration::as_millis`], saturated to `u64`.
    fn millis_u64(&self) -> u64;
    /// [`Duration::as_nanos`], saturated to `u64`.
    fn nanos_u64(&self) -> u64;
}

impl DurationU64 for std::time::Duration {
    #[inline]
    fn millis_u64(&self) -> u64 {
        u64::try_from(self.as_millis()).unwrap_or(u64::MAX)
    }

    #[inline]
    fn nanos_u64(&self) -> u64 {
        u64::try_from(self.as_nanos()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_are_exact_or_panic() {
        assert_eq!(usize_of(u64::MAX), usize::MAX);
        assert_eq!(u32_of(7u64), 7);
        assert_eq!(u16_of(65535usize), 65535);
        assert!(std::panic::catch_unwind(|| u16_of(1usize << 16)).is_err());
        assert_eq!(u8_of(63usize), 63);
        assert!(std::panic::catch_unwind(|| u32_of(1u64 << 32)).is_err());
        assert!(std::panic::catch_unwind(|| u8_of(256usize)).is_err());
        assert_eq!(u64_of_f64(-1.0), 0);
        assert_eq!(u64_of_f64(f64::NAN), 0);
        assert_eq!(u64_of_f64(2.9), 2);
        assert_eq!(u64_of_f64(1e30), u64::MAX);
        let d = std::time::Duration::from_millis(1500);
        assert_eq!((d.millis_u64(), d.nanos_u64()), (1500, 1_500_000_000));
        assert_eq!(std::time::Duration::MAX.nanos_u64(), u64::MAX);
    }
}
