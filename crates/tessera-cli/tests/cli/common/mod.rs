//! Test harness: the shared one of `tessera-testkit`, bound to this crate's `tessera`
//! binary.

#![allow(dead_code, unused_imports)]

pub use tessera_testkit::data::*;
pub use tessera_testkit::node::{
    await_ready, cli_stdout, cunit_counts, free_port, http_get, libiscsi_tool, metric_sample,
    nbdinfo_map, path_str, poll_until, require_tool, result_fields, run_ok, run_tool, temp_dir,
    vm_rss, wait_for, within, Binary, PerfResult,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// The `tessera` binary cargo built for these tests.
pub struct Tessera;

impl Binary for Tessera {
    const PATH: &'static str = BIN;
}

pub type TestNode = tessera_testkit::node::TestNode<Tessera>;

/// Run `tessera nbd-perf` against `uri` (4 KiB requests over the first 64 MiB unless
/// `extra` says otherwise) and parse its RESULT line; `extra` adds arguments. Fails the
/// test on any I/O error.
pub fn nbd_perf(uri: &str, pattern: &str, qd: u32, secs: u64, extra: &[&str]) -> PerfResult {
    tessera_testkit::node::nbd_perf::<Tessera>(uri, pattern, qd, secs, extra)
}

/// An NBD client of export `export` on node `n` (20 s read timeout).
pub fn nbd_connect(n: &TestNode, export: &str) -> tessera_nbd::client::NbdClient {
    let s = std::net::TcpStream::connect(n.addr()).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    tessera_nbd::client::NbdClient::from_stream(
        s,
        export,
        tessera_nbd::client::ClientOptions::default(),
    )
    .expect("NBD handshake")
}

/// Write blocks `which` (of `bs` bytes) at generation `gen` (`block`), note it in
/// `model`, then flush.
pub fn write_generations(
    c: &mut tessera_nbd::client::NbdClient,
    model: &mut [u64],
    which: impl Iterator<Item = usize>,
    gen: u64,
    bs: usize,
) {
    for i in which {
        c.write((i * bs) as u64, &block(i, gen, bs), false).unwrap();
        model[i] = gen;
    }
    c.flush().unwrap();
}

/// Read every block of `model` back from export `export` and compare it with the
/// generation the model holds.
pub fn verify_generations(n: &TestNode, export: &str, model: &[u64], bs: usize) {
    let mut c = nbd_connect(n, export);
    let mut buf = vec![0u8; bs];
    for (i, &g) in model.iter().enumerate() {
        c.read((i * bs) as u64, &mut buf).unwrap();
        assert!(
            buf == block(i, g, bs),
            "block {i} differs (expected generation {g})"
        );
    }
}

/// Every byte of export `export`, read in 4 MiB requests.
pub fn read_all(n: &TestNode, export: &str) -> Vec<u8> {
    let mut c = nbd_connect(n, export);
    let size = usize::try_from(c.size()).unwrap();
    let mut buf = vec![0u8; size];
    for (i, chunk) in buf.chunks_mut(4 << 20).enumerate() {
        c.read(i as u64 * (4 << 20), chunk).unwrap();
    }
    c.disconnect().unwrap();
    buf
}

/// Write `data` at `off` of export `export` and flush; the same bytes go into `model`.
pub fn write_at(n: &TestNode, export: &str, model: &mut [u8], off: u64, data: &[u8]) {
    let mut c = nbd_connect(n, export);
    c.write(off, data, false).unwrap();
    c.flush().unwrap();
    c.disconnect().unwrap();
    let at = usize::try_from(off).unwrap();
    model[at..at + data.len()].copy_from_slice(data);
}

/// `tessera snapshot create VOL --name NAME`, its JSON answer.
pub fn snapshot(n: &TestNode, vol: &str, name: &str) -> serde_json::Value {
    n.json(&["snapshot", "create", vol, "--name", name])
}

/// The extents of `volume changes NAME --since SNAP`.
pub fn changes(n: &TestNode, name: &str, since: &str) -> Vec<(u64, u64)> {
    let c = n.json(&["volume", "changes", name, "--since", since]);
    c["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["offset"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect()
}

/// A member of a cluster on `etcd`: node `name` with failure-domain label `zone`, a
/// 1-core reactor, NVMe/TCP on a free port, a file pool `p` of `pool_mib` MiB, replication
/// with 1 MiB regions and a 3 s timeout, a 2 s lease; `cluster_extra` adds `[cluster]` keys.
pub fn cluster_member(
    tag: &str,
    name: &str,
    zone: &str,
    etcd: &tessera_testkit::etcd::EtcdCluster,
    pool_mib: u64,
    cluster_extra: &str,
) -> TestNode {
    cluster_member_at(
        tag,
        name,
        zone,
        etcd,
        pool_mib,
        cluster_extra,
        "127.0.0.1",
        None,
    )
}

/// [`cluster_member`] serving NVMe/TCP on `ip`, in network namespace `netns` if given.
#[allow(clippy::too_many_arguments)]
pub fn cluster_member_at(
    tag: &str,
    name: &str,
    zone: &str,
    etcd: &tessera_testkit::etcd::EtcdCluster,
    pool_mib: u64,
    cluster_extra: &str,
    ip: &str,
    netns: Option<&str>,
) -> TestNode {
    let nvmf = free_port();
    let n = TestNode::start_in_netns(
        tag,
        netns,
        1,
        &format!("name = \"{name}\""),
        &format!(
            "[nvmf]\nlisten = \"{ip}:{nvmf}\"\ndiscovery = \"\"\n\
             [replication]\ntimeout_ms = 3000\nregion_size = \"1M\"\n\
             [cluster]\netcd = {}\nlease_ttl_ms = 2000\nlabels = {{ zone = \"{zone}\" }}\n{cluster_extra}\n",
            etcd.toml_endpoints()
        ),
    );
    n.cli_ok(&[
        "pool",
        "create",
        "p",
        &format!("{}:{pool_mib}M", n.dir.join("p.img").display()),
    ]);
    n
}

/// `PUT /v1/nvmf/cluster-paths/VOLUME`; returns the HTTP status and the reply.
pub fn put_path(n: &TestNode, volume: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let (code, text) = tessera_http::request(
        &tessera_http::Endpoint::parse(&n.api()),
        "PUT",
        &format!("/v1/nvmf/cluster-paths/{volume}"),
        Some(&body),
    )
    .expect("API request");
    (
        code,
        serde_json::from_str(&text).unwrap_or(serde_json::json!(text)),
    )
}

/// fio with the nbd engine, 4 KiB random writes on export URI `uri`, started in the
/// background from `dir` (its verify state files land there); `extra` are further fio
/// options. Its output is piped for `wait_with_output`.
pub fn spawn_fio_randwrite(
    dir: &std::path::Path,
    name: &str,
    uri: &str,
    extra: &[&str],
) -> std::process::Child {
    std::process::Command::new("fio")
        .current_dir(dir)
        .args([
            format!("--name={name}"),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            "--rw=randwrite".into(),
            "--bs=4k".into(),
            "--group_reporting".into(),
        ])
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start fio")
}
