//! What admission costs a request when no limit is set: the per-connection `Gate` (volume
//! limiter generation check, group check, share scheduler) on one core.
//!
//!     cargo run --release -p tessera-qos --example admission_cost

use std::sync::Arc;
use std::time::Instant;

use tessera_io::{CoreIo, Tag};
use tessera_qos::gate::{Charge, Gate};
use tessera_qos::{QosLimits, VolumeQos};

fn main() {
    let mut io = CoreIo::new(0, 64, None).expect("io_uring");
    let n = 20_000_000u64;
    // One volume: with several, the share scheduler needs the reactor's rounds to
    // advance, which this loop does not model (see the shares unit tests instead).
    for volumes in [1usize] {
        let qos: Vec<_> = (0..volumes)
            .map(|_| Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())))
            .collect();
        let mut gates: Vec<_> = qos
            .iter()
            .map(|q| Gate::new(&mut io, q, Tag::task(0, 1), Tag::task(0, 2)))
            .collect();
        let t = Instant::now();
        let mut passed = 0u64;
        for i in 0..n {
            let g = &mut gates[tessera_io::cast::usize_of(i) % volumes];
            if g.offer(
                &mut io,
                0,
                if i & 1 == 0 {
                    Charge::Write(4096)
                } else {
                    Charge::Read(4096)
                },
            ) {
                passed += 1;
            }
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "{volumes} volume(s), no limits: {ns:.1} ns per admission ({passed} of {n} passed at once)"
        );
    }
}
