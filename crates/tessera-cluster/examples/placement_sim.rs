//! Placement and recovery at scale, in simulation (issue 13 "Scale"): the real placement
//! function ([`tessera_cluster::place`]) on a synthetic cluster.
//!
//! `cargo run --release -p tessera-cluster --example placement_sim [NODES VOLUMES RATE_MIB]`
//!
//! The cluster: NODES nodes in 10 zones of 10 racks, 64 TiB each; VOLUMES volumes of 3
//! replicas, sizes log-uniform 16 GiB-1 TiB, 10-90% of each allocated (thin), each
//! created on a random node (the owner holds a replica). It prints the balance of used
//! capacity after placement (max/mean), then the data moved and the time to full
//! redundancy after the loss of one node and of a whole zone, with every node
//! rebuilding at RATE_MIB MiB/s in and out (default 200), rebuilds in parallel.
//! `STALE=N` (default 64): how many creations share one view of free space.

use std::collections::BTreeMap;

use tessera_cluster::placement::DEFAULT_LEVELS;
use tessera_cluster::{place, NodeRecord, PoolRecord};

const GIB: u64 = 1 << 30;
const TIB: u64 = 1 << 40;
const NODE_CAPACITY: u64 = 64 * TIB;

/// xorshift64*: reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A drawn size in whole bytes.
#[expect(
    clippy::cast_possible_truncation,
    reason = "sizes drawn here are positive and below 2^41: the cast only drops the fraction"
)]
fn whole_bytes(x: f64) -> u64 {
    x as u64
}

struct Vol {
    alloc: u64,
    replicas: Vec<usize>,
}

fn records(used: &[u64], alive: &[bool]) -> Vec<NodeRecord> {
    (0..used.len())
        .filter(|&i| alive[i])
        .map(|i| {
            let mut labels = BTreeMap::new();
            labels.insert("zone".to_string(), format!("z{}", i % 10));
            labels.insert("rack".to_string(), format!("r{}", (i / 10) % 100));
            NodeRecord {
                name: i.to_string(),
                labels,
                pools: vec![PoolRecord {
                    name: "p".into(),
                    size: NODE_CAPACITY,
                    free: NODE_CAPACITY.saturating_sub(used[i]),
                }],
                ..NodeRecord::default()
            }
        })
        .collect()
}

fn balance(used: &[u64], alive: &[bool]) -> String {
    let live: Vec<u64> = (0..used.len())
        .filter(|&i| alive[i])
        .map(|i| used[i])
        .collect();
    let mean = live.iter().sum::<u64>() as f64 / live.len() as f64;
    let max = *live.iter().max().unwrap_or(&0) as f64;
    let min = *live.iter().min().unwrap_or(&0) as f64;
    format!(
        "mean {:.1} TiB used ({:.0}% full), max/mean {:.3}, min/mean {:.3}",
        mean / TIB as f64,
        100.0 * mean / NODE_CAPACITY as f64,
        max / mean,
        min / mean
    )
}

/// Replace every replica on a dead node; report bytes moved and the time at `rate`.
fn recover(what: &str, vols: &mut [Vol], used: &mut [u64], alive: &[bool], rate: u64) {
    let t = std::time::Instant::now();
    let n = used.len();
    let (mut moved, mut replaced, mut lost_two, mut lost_all) = (0u64, 0usize, 0usize, 0usize);
    let mut recv = vec![0u64; n];
    let mut send = vec![0u64; n];
    // One coordinator re-places a dead node's replicas: it counts its own decisions in
    // its view at once (else every replica would land on the same few emptiest nodes).
    let mut recs = records(used, alive);
    let index: BTreeMap<usize, usize> = recs
        .iter()
        .enumerate()
        .map(|(k, r)| (r.name.parse().unwrap(), k))
        .collect();
    for v in vols.iter_mut() {
        let survivors: Vec<usize> = v.replicas.iter().copied().filter(|&r| alive[r]).collect();
        let missing = v.replicas.len() - survivors.len();
        if missing == 0 {
            continue;
        }
        if missing >= 2 {
            lost_two += 1;
        }
        if survivors.is_empty() {
            lost_all += 1;
            continue;
        }
        let fixed: Vec<String> = survivors.iter().map(|s| s.to_string()).collect();
        let fixed: Vec<&str> = fixed.iter().map(String::as_str).collect();
        let placed = place(&recs, v.replicas.len(), &fixed, DEFAULT_LEVELS).expect("placement");
        let mut next = survivors.clone();
        for p in &placed[survivors.len()..] {
            let to: usize = p.node.parse().unwrap();
            // The least-loaded survivor sends.
            let from = *survivors.iter().min_by_key(|&&s| send[s]).unwrap();
            send[from] += v.alloc;
            recv[to] += v.alloc;
            used[to] += v.alloc;
            recs[index[&to]].pools[0].free -= v.alloc;
            moved += v.alloc;
            replaced += 1;
            next.push(to);
        }
        v.replicas = next;
    }
    let busiest = recv.iter().chain(send.iter()).max().copied().unwrap_or(0);
    let rate_b = rate * (1 << 20);
    let helpers = recv.iter().filter(|&&b| b > 0).count();
    println!(
        "{what}: {replaced} replicas re-placed, {:.1} TiB moved; {} receiving nodes; busiest node \
         moves {:.0} GiB -> full redundancy in {:.0} s ({:.1} min) at {rate} MiB/s per node; \
         volumes that lost 2+ replicas: {lost_two}, all: {lost_all} (placed in {:.1} s)",
        moved as f64 / TIB as f64,
        helpers,
        busiest as f64 / GIB as f64,
        busiest as f64 / rate_b as f64,
        busiest as f64 / rate_b as f64 / 60.0,
        t.elapsed().as_secs_f64()
    );
    println!("  balance after: {}", balance(used, alive));
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let nodes = usize::try_from(*args.first().unwrap_or(&1000)).unwrap_or(1000);
    let volumes = usize::try_from(*args.get(1).unwrap_or(&100_000)).unwrap_or(100_000);
    let rate = *args.get(2).unwrap_or(&200);
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut used = vec![0u64; nodes];
    let alive = vec![true; nodes];
    let mut vols = Vec::with_capacity(volumes);
    let t = std::time::Instant::now();
    // Placement reads the node records as published (every couple of seconds in a real
    // cluster, while volumes are created on many nodes at once): the view used here is
    // refreshed every STALE creations; between refreshes each placer only knows its own
    // decisions (modelled: none). STALE=1 is a perfectly fresh view.
    let stale: usize = std::env::var("STALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
        .max(1);
    let mut recs = records(&used, &alive);
    for i in 0..volumes {
        let size = whole_bytes(16.0 * GIB as f64 * 64f64.powf(rng.unit()));
        let alloc = whole_bytes(size as f64 * (0.1 + 0.8 * rng.unit()));
        let owner = (rng.next() % nodes as u64).to_string();
        let placed = place(&recs, 3, &[owner.as_str()], DEFAULT_LEVELS).expect("placement");
        let replicas: Vec<usize> = placed.iter().map(|p| p.node.parse().unwrap()).collect();
        for &r in &replicas {
            used[r] += alloc;
        }
        vols.push(Vol { alloc, replicas });
        if i % stale == stale - 1 {
            recs = records(&used, &alive);
        }
    }
    let zones_ok = vols.iter().all(|v| {
        let mut z: Vec<usize> = v.replicas.iter().map(|r| r % 10).collect();
        z.sort_unstable();
        z.dedup();
        z.len() == v.replicas.len()
    });
    println!(
        "{nodes} nodes (10 zones x 10 racks), {volumes} volumes x 3 replicas placed in {:.1} s \
         (view refreshed every {stale} creations); every volume's replicas in distinct zones: \
         {zones_ok}",
        t.elapsed().as_secs_f64()
    );
    println!("  balance: {}", balance(&used, &alive));

    let mut alive_node = alive.clone();
    alive_node[0] = false;
    let mut v1: Vec<Vol> = vols
        .iter()
        .map(|v| Vol {
            alloc: v.alloc,
            replicas: v.replicas.clone(),
        })
        .collect();
    let mut u1 = used.clone();
    u1[0] = 0;
    recover("one node lost", &mut v1, &mut u1, &alive_node, rate);

    let mut alive_zone = alive.clone();
    for (i, a) in alive_zone.iter_mut().enumerate() {
        if i % 10 == 0 {
            *a = false;
        }
    }
    let mut u2 = used.clone();
    for (i, u) in u2.iter_mut().enumerate() {
        if i % 10 == 0 {
            *u = 0;
        }
    }
    recover(
        "zone z0 lost (100 nodes)",
        &mut vols,
        &mut u2,
        &alive_zone,
        rate,
    );
}
