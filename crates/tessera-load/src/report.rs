//! What `bench` and `nbd-perf` share: CPU accounting and the result lines they print.

use std::time::Duration;
use tessera_io::cast::u32_of;

use tessera_io::hist::Histogram;

/// CPU time (user, system) of the calling thread (`libc::RUSAGE_THREAD`) or process
/// (`libc::RUSAGE_SELF`).
pub fn cpu_time(who: libc::c_int) -> (Duration, Duration) {
    // SAFETY: getrusage fills a plain struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage for the call.
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, u32_of(t.tv_usec) * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

/// The human latency line.
pub fn print_latency(hist: &Histogram) {
    println!(
        "latency:    mean {:.2} us, p50 {:.2} us, p99 {:.2} us, p99.9 {:.2} us, max {:.2} us",
        hist.mean() / 1000.0,
        us(hist.quantile(0.5)),
        us(hist.quantile(0.99)),
        us(hist.quantile(0.999)),
        us(hist.max())
    );
}

/// The machine-readable last line scripts parse.
pub fn print_result(iops: f64, mibps: f64, hist: &Histogram, cpu_ns_per_io: f64, errors: u64) {
    println!(
        "RESULT iops={iops:.0} mibps={mibps:.1} mean_us={:.2} p50_us={:.2} p99_us={:.2} p999_us={:.2} cpu_ns_per_io={cpu_ns_per_io:.1} errors={errors}",
        hist.mean() / 1000.0,
        us(hist.quantile(0.5)),
        us(hist.quantile(0.99)),
        us(hist.quantile(0.999))
    );
}
