//! What several modules do to a test node's volumes and pools: whole-volume reads and
//! writes over NBD, snapshots, changed extents, and a scrub waited for (what `tessera
//! pool scrub --wait` does).

use std::time::{Duration, Instant};

use serde_json::Value;

use super::{json, TestNode};

/// Write `data` at `off` of export `export` and flush; the same bytes go into `model`.
pub fn write_at(n: &TestNode, export: &str, model: &mut [u8], off: u64, data: &[u8]) {
    let mut c = n.nbd(export);
    c.write(off, data, false).unwrap();
    c.flush().unwrap();
    c.disconnect().unwrap();
    let at = usize::try_from(off).unwrap();
    model[at..at + data.len()].copy_from_slice(data);
}

/// Every byte of export `export`, read in 4 MiB requests.
pub fn read_all(n: &TestNode, export: &str) -> Vec<u8> {
    let mut c = n.nbd(export);
    let size = usize::try_from(c.size()).unwrap();
    let mut buf = vec![0u8; size];
    for (i, chunk) in buf.chunks_mut(4 << 20).enumerate() {
        c.read(i as u64 * (4 << 20), chunk).unwrap();
    }
    c.disconnect().unwrap();
    buf
}

/// `tessera --json snapshot create VOL --name NAME`: the snapshot's JSON.
pub fn snapshot(n: &TestNode, vol: &str, name: &str) -> Value {
    json(
        n.node()
            .create_snapshot(vol, name)
            .unwrap_or_else(|e| panic!("snapshot {name} of {vol}: {e}")),
    )
}

/// The extents (offset, length) of `tessera volume changes NAME --since SNAP`.
pub fn changes(n: &TestNode, name: &str, since: &str) -> Vec<(u64, u64)> {
    n.node()
        .changed_extents(name, since)
        .unwrap_or_else(|e| panic!("changes of {name} since {since}: {e}"))
        .extents
        .iter()
        .map(|e| (e.offset, e.length))
        .collect()
}

/// `tessera --json pool scrub POOL [--no-repair] --wait`: start a scrub, and its status
/// once it has ended (within 120 s).
pub fn scrub_wait(n: &TestNode, pool: &str, repair: bool) -> Value {
    let node = n.node();
    let p = node.pools().get(pool).expect("pool");
    node.jobs()
        .start_scrub(&p, repair)
        .expect("start the scrub");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let v = json(node.jobs().scrub_status(&p).expect("scrub status"));
        if v["state"] != "running" {
            return v;
        }
        assert!(Instant::now() < deadline, "scrub did not finish: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
