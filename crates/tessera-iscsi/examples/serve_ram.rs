//! Serve a RAM-backed pool volume as LUN 0 of `iqn.2026-11.io.tessera:ram` on
//! 127.0.0.1:PORT (default 3260), for trying initiators by hand:
//! `cargo run -p tessera-iscsi --example serve_ram -- 3261`, then
//! `iscsi-test-cu --dataloss --test=SCSI.Read10 iscsi://127.0.0.1:3261/iqn.2026-11.io.tessera:ram/0`.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Instant;

use tessera_device::{BlockDevice, RamDevice};
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::Export;
use tessera_iscsi::accept::accept_loop;
use tessera_iscsi::target::Target;
use tessera_pool::{Pool, PoolOptions};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_testkit::reactor::ReactorThread;

fn main() {
    let port = std::env::args().nth(1).unwrap_or_else(|| "3260".into());
    let dev: Arc<dyn BlockDevice> = RamDevice::new(128 << 20).expect("RAM device");
    let pool = Pool::create("p", vec![dev], PoolOptions::default()).expect("pool");
    let vol = pool.create_volume("v", 64 << 20).expect("volume");
    let target = Target::new();
    target
        .add_target(
            "iqn.2026-11.io.tessera:ram",
            vec![Export {
                target: vol,
                qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
            }],
        )
        .expect("target");
    let addr = format!("127.0.0.1:{port}");
    let l = TcpListener::bind(&addr).expect("bind");
    target.add_portal(addr.clone());
    let core = ReactorThread::start();
    let mailbox = core.mailbox.clone();
    println!("serving iscsi://{addr}/iqn.2026-11.io.tessera:ram/0");
    accept_loop(
        l,
        target,
        ListenerCap::new("iscsi", addr, 64),
        BufferBudget::unlimited(),
        move || mailbox.clone(),
    );
}
