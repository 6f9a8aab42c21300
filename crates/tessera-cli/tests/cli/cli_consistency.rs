//! The CLI behaves the same way across resources (issue 11, finding 4): one verb set with
//! the old spellings kept, one JSON object for one resource, binary units in tables,
//! distinct exit codes, global flags honoured or refused, an absolute default API
//! socket, no progress bar in a pipe, and `tessera up` saying how to reach and stop it
//! (and telling systemd when it is ready).

use crate::common;

use std::os::unix::net::UnixDatagram;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// Exit codes of `tessera --help`.
const USAGE: i32 = 2;
const NOT_FOUND: i32 = 3;
const CONFLICT: i32 = 4;
const INVALID: i32 = 5;
const UNAVAILABLE: i32 = 6;

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Insist that `o` failed with `code` and one `tessera: error:` line; returns that line.
fn failed_with(args: &[&str], o: &Output, code: i32) -> String {
    let (out, err) = text(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "tessera {args:?}: want exit code {code}; stdout: {out} stderr: {err}"
    );
    assert!(err.starts_with("tessera: error:"), "{args:?}: {err}");
    err
}

fn refused(n: &TestNode, args: &[&str], code: i32) -> String {
    failed_with(args, &n.cli(args), code)
}

/// `tessera ARGS` without a node (and without `$TESSERA_API`), in `cwd`.
fn bare(args: &[&str], cwd: &std::path::Path, home: &std::path::Path) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .env_remove("TESSERA_API")
        .env_remove("XDG_DATA_HOME")
        .env("HOME", home)
        .stdin(Stdio::null())
        .output()
        .expect("run tessera")
}

#[test]
fn one_verb_set_json_objects_and_human_units() {
    let mut n = TestNode::start_default("cli-verbs");

    // create / show answer one object with --json, exact bytes.
    let v = n.json(&["volume", "create", "v1", "--pool", "pool0", "--size", "64M"]);
    assert!(v.is_object(), "volume create --json: {v}");
    assert_eq!(v["name"], "v1");
    assert_eq!(v["size"], 64u64 << 20);
    let v = n.json(&["volume", "show", "v1"]);
    assert!(v.is_object() && v["size"] == 64u64 << 20, "{v}");

    // Tables use binary unit names.
    let table = n.cli_ok(&["volume", "list"]);
    assert!(table.contains("64.0 MiB"), "{table}");
    assert!(table.contains("4.0 GiB"), "{table}");
    let st = n.cli_ok(&["status"]);
    assert!(st.contains("GiB") && !st.contains("4.0G "), "{st}");
    let pool = n.cli_ok(&["pool", "show", "pool0"]);
    assert!(
        pool.contains(" GiB") && pool.contains("allocated"),
        "{pool}"
    );
    let capacity = n.json(&["pool", "show", "pool0"])["capacity"]
        .as_u64()
        .unwrap();
    assert!(!pool.contains(&capacity.to_string()), "raw bytes in {pool}");
    // `status` stays as the old spelling of `show`.
    assert_eq!(n.cli_ok(&["pool", "status", "pool0"]), pool);

    // QoS bandwidth in binary units per second.
    let q = n.cli_ok(&[
        "volume",
        "qos",
        "v1",
        "--write-bw",
        "100M",
        "--iops",
        "5000",
    ]);
    assert!(
        q.contains("write_bw=100 MiB/s") && q.contains("iops=5000"),
        "{q}"
    );

    // Exports: create / show / delete, and the old add / remove.
    let e = n.json(&["export", "create", "e1", "--volume", "v1"]);
    assert!(e.is_object() && e["name"] == "e1", "{e}");
    let e = n.json(&["export", "show", "e1"]);
    assert!(e.is_object() && e["volume"] == "v1", "{e}");
    n.cli_ok(&["export", "delete", "e1"]);
    n.cli_ok(&["export", "add", "e2", "--volume", "v1"]);
    n.cli_ok(&["export", "remove", "e2"]);
    let exports = n.json(&["export", "list"]);
    assert_eq!(exports.as_array().map(|a| a.len()), Some(1), "{exports}");

    // Groups: create (old: set) / show / add / remove / delete.
    let g = n.json(&["group", "create", "g", "--iops", "1000"]);
    assert!(g.is_object() && g["name"] == "g", "{g}");
    let g = n.json(&["group", "add", "g", "v1"]);
    assert!(g.is_object() && g["members"][0] == "v1", "{g}");
    n.cli_ok(&["group", "set", "g", "--iops", "2000"]);
    assert_eq!(n.json(&["group", "show", "g"])["limits"]["iops"], 2000);
    n.cli_ok(&["group", "remove", "g", "v1"]);
    n.cli_ok(&["group", "delete", "g"]);

    // Pools: delete, and the old destroy.
    let d = n.dir.clone();
    let spec = |f: &str| format!("{}:64M", d.join(f).display());
    let p = n.json(&["pool", "create", "pa", &spec("a.img")]);
    assert!(
        p.is_object() && p["name"] == "pa",
        "pool create --json: {p}"
    );
    n.cli_ok(&["pool", "create", "pb", &spec("b.img")]);
    n.cli_ok(&["pool", "delete", "pa"]);
    n.cli_ok(&["pool", "destroy", "pb"]);

    // --stripe-size where nothing stripes is refused, not ignored.
    let err = refused(
        &n,
        &[
            "pool",
            "create",
            "m",
            &spec("m0.img"),
            &spec("m1.img"),
            "--layout",
            "raid1",
            "--stripe-size",
            "64K",
        ],
        INVALID,
    );
    assert!(
        err.contains("--stripe-size") && err.contains("raid1"),
        "{err}"
    );
    assert!(!n.json(&["pool", "list"]).to_string().contains("\"m\""));

    // `pool replace` takes --with, as the API does; the node answers (concat pool0 has
    // nothing to replace), it is not a usage error.
    let args = [
        "pool",
        "replace",
        "pool0",
        "--device",
        "0",
        "--with",
        &spec("r.img"),
    ];
    let o = n.cli(&args);
    let (_, err) = text(&o);
    assert!(
        !o.status.success() && o.status.code() != Some(USAGE),
        "{args:?}: {err}"
    );
    assert!(
        err.starts_with("tessera: error:") && !err.contains("unexpected"),
        "{err}"
    );
    assert!(n.is_running());
}

#[test]
fn server_errors_have_distinct_exit_codes() {
    let n = TestNode::start_default("cli-codes");
    let err = refused(&n, &["volume", "show", "nope"], NOT_FOUND);
    assert!(err.contains("nope"), "{err}");
    refused(&n, &["pool", "delete", "nope"], NOT_FOUND);
    refused(&n, &["export", "show", "nope"], NOT_FOUND);
    refused(
        &n,
        &[
            "volume", "create", "vol0", "--pool", "pool0", "--size", "1M",
        ],
        CONFLICT,
    );
    refused(&n, &["pool", "delete", "pool0"], CONFLICT);
    let err = refused(
        &n,
        &["volume", "create", "x", "--pool", "pool0", "--size", "1Q"],
        INVALID,
    );
    assert!(err.contains("P") && err.contains("PiB"), "{err}");
    let err = refused(&n, &["volume", "qos", "vol0", "--bw", "1Q"], INVALID);
    assert!(err.contains("--bw") && err.contains("PiB"), "{err}");

    let gone = n.dir.join("no-node.sock");
    let api = format!("unix:{}", gone.display());
    let args = ["--api", api.as_str(), "status"];
    let o = Command::new(BIN).args(args).output().unwrap();
    let err = failed_with(&args, &o, UNAVAILABLE);
    assert!(err.contains(&api) && err.contains("--api"), "{err}");
}

#[test]
fn scrub_and_rebuild_are_subcommands_and_draw_no_bar_in_a_pipe() {
    let n = TestNode::start_default("cli-jobs");
    n.cli_ok(&["volume", "create", "s", "--pool", "pool0", "--size", "16M"]);

    for args in [
        &["pool", "scrub", "start", "pool0", "--wait"][..],
        &["pool", "scrub", "status", "pool0", "--wait"],
        // The old flag form, kept.
        &["pool", "scrub", "pool0", "--wait"],
        &["pool", "scrub", "pool0", "--status"],
    ] {
        let o = n.cli(args);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{args:?}: {out}{err}");
        assert!(out.contains("scrub pool0 done"), "{args:?}: {out}");
        assert!(
            !out.contains('\r') && !err.contains('\r'),
            "a progress bar in a pipe: {args:?}: {out:?} {err:?}"
        );
    }
    let v = n.json(&["pool", "scrub", "status", "pool0"]);
    assert!(v.is_object() && v["state"] == "done", "{v}");
    // Nothing to stop once it is done: the node says so (not found).
    let err = refused(&n, &["pool", "scrub", "stop", "pool0"], NOT_FOUND);
    assert!(err.contains("no scrub"), "{err}");

    // A concat pool has nothing to rebuild: the node says so (not a usage error).
    let o = n.cli(&["pool", "rebuild", "start", "pool0"]);
    assert!(
        !o.status.success() && o.status.code() != Some(USAGE),
        "{:?}",
        text(&o)
    );
    refused(&n, &["pool", "scrub", "status", "nope"], NOT_FOUND);
}

#[test]
fn global_flags_are_honoured_or_refused() {
    let dir = temp_dir("cli-flags");
    let cfg = dir.path().join("absent.toml");
    let cfg = cfg.to_str().unwrap();
    for args in [
        &["--json", "node", "--config", cfg][..],
        &["--api", "unix:/x.sock", "node", "--config", cfg],
        &[
            "--api",
            "unix:/x.sock",
            "bench",
            "--device",
            "ram:16M",
            "--time",
            "1",
        ],
        &["--json", "nbd-perf", "--addr", "127.0.0.1:1"],
        &["--api", "unix:/x.sock", "nvmf", "discover"],
        &["--json", "nvmf", "read", "--nqn", "nqn.x"],
    ] {
        let o = Command::new(BIN).args(args).output().unwrap();
        let err = failed_with(args, &o, USAGE);
        assert!(err.contains("does not apply"), "{args:?}: {err}");
    }

    // bench --json: one JSON object with the figures, nothing else on stdout, and no
    // progress line in a pipe.
    let args = [
        "bench", "--json", "--device", "ram:64M", "--time", "2", "--qd", "16",
    ];
    let o = Command::new(BIN).args(args).output().unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert!(v["iops"].as_f64().unwrap() > 1000.0, "{v}");
    assert_eq!(v["bs"], 4096);
    assert_eq!(v["errors"], 0);
    assert!(v["latency_us"]["p99"].as_f64().unwrap() > 0.0, "{v}");
    assert!(!err.contains('\r'), "progress in a pipe: {err:?}");
}

#[test]
fn the_default_api_socket_is_absolute_from_any_directory() {
    let home = temp_dir("cli-home");
    let a = temp_dir("cli-cwd-a");
    let b = temp_dir("cli-cwd-b");
    let errs: Vec<String> = [a.path(), b.path()]
        .iter()
        .map(|cwd| {
            let o = bare(&["volume", "list"], cwd, home.path());
            failed_with(&["volume", "list"], &o, UNAVAILABLE)
        })
        .collect();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let want = if root {
        "/var/lib/tessera/api.sock".to_string()
    } else {
        format!("{}/.local/share/tessera/api.sock", home.path().display())
    };
    for e in &errs {
        assert!(e.contains(&format!("unix:{want}")), "want {want} in: {e}");
    }
    assert_eq!(errs[0], errs[1]);
}

#[test]
fn nvmf_identify_says_which_address_it_tried() {
    // Whatever listens on the default port (another test's node, or nothing), the
    // error names the address and how to pass another.
    let args = [
        "nvmf",
        "identify",
        "--nqn",
        "nqn.2024-01.io.tessera:no-such",
    ];
    let o = Command::new(BIN).args(args).output().unwrap();
    let err = failed_with(&args, &o, UNAVAILABLE);
    assert!(
        err.contains("127.0.0.1:4420") && err.contains("--addr"),
        "{err}"
    );
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let args = ["nvmf", "identify", "--addr", &addr, "--nqn", "nqn.x"];
    let o = Command::new(BIN).args(args).output().unwrap();
    let err = failed_with(&args, &o, UNAVAILABLE);
    assert!(err.contains(&addr), "{err}");
}

/// A node started by this test with its own `NOTIFY_SOCKET`; killed when dropped.
struct Notified {
    child: Child,
}

impl Drop for Notified {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn up_prints_absolute_paths_and_how_to_stop_and_notifies_systemd() {
    let dir = temp_dir("cli-up");
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let port = free_port();
    let mut child = Command::new(BIN)
        // A relative data directory: what it prints must still be absolute.
        .args(["up", "--data-dir", "data", "--cores", "1", "--nvmf", ""])
        .args([
            "--nvmf-discovery",
            "",
            "--iscsi",
            "",
            "--nbd",
            &format!("127.0.0.1:{port}"),
        ])
        .current_dir(dir.path())
        .env("NOTIFY_SOCKET", &notify_path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut node = Notified { child };
    let pid = node.child.id();

    let mut buf = [0u8; 4096];
    let n = notify.recv(&mut buf).expect("READY=1 within 30 s");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(msg.contains(&format!("MAINPID={pid}")), "{msg:?}");

    // READY=1 comes after the banner: read it up to its ready line.
    let banner = await_ready(stdout, Duration::from_secs(10)).expect("banner");
    let data = dir.path().canonicalize().unwrap().join("data");
    let api = format!("unix:{}", data.join("api.sock").display());
    assert!(
        banner.contains(&format!("management API: {api}")),
        "{banner}"
    );
    assert!(banner.contains(&format!("--api {api}")), "{banner}");
    assert!(
        banner.contains(&format!("socket={}", data.join("nbd.sock").display())),
        "{banner}"
    );
    assert!(
        banner.contains("Ctrl-C") && banner.contains(&format!("kill {pid}")),
        "{banner}"
    );

    // The printed API works from another directory.
    let elsewhere = temp_dir("cli-elsewhere");
    let o = Command::new(BIN)
        .args(["--api", &api, "volume", "list", "--json"])
        .current_dir(elsewhere.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", text(&o));

    // SIGTERM: STOPPING=1, then a clean exit.
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let n = notify.recv(&mut buf).expect("STOPPING=1 within 30 s");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = node.child.try_wait().unwrap() {
            assert!(st.success(), "{st}");
            break;
        }
        assert!(Instant::now() < deadline, "node did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_systemd_unit_runs_the_example_config_as_a_notify_service() {
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    let unit = std::fs::read_to_string(deploy.join("tessera.service")).unwrap();
    let key = |k: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in tessera.service"))
            .to_string()
    };
    assert_eq!(key("Type"), "notify");
    assert_eq!(
        key("ExecStart"),
        "/usr/local/bin/tessera node --config /etc/tessera/tessera.toml"
    );
    assert_eq!(key("StateDirectory"), "tessera");
    // The example configuration is one the node accepts, with its data where the unit's
    // StateDirectory and root's default API socket are.
    let cfg = tessera_node::NodeConfig::load(&deploy.join("tessera.toml")).unwrap();
    assert_eq!(cfg.data_dir, std::path::Path::new("/var/lib/tessera"));
    assert_eq!(
        cfg.api_socket(),
        std::path::Path::new("/var/lib/tessera/api.sock")
    );
    assert!(!cfg.pools.is_empty() && !cfg.exports.is_empty());
}

/// Issue 21, found as a new user: on a node with one pool `volume create` needs no
/// `--pool` (and says which pool it took); with several it names them; snapshot tables
/// show a date, `--json` the exact seconds.
#[test]
fn a_volume_goes_to_the_only_pool_and_snapshot_tables_show_dates() {
    let n = TestNode::start_default("cli-only-pool");
    let args = ["volume", "create", "db", "--size", "64M"];
    let o = n.cli(&args);
    let (out, err) = text(&o);
    assert!(o.status.success(), "tessera {args:?}: {out} {err}");
    assert!(err.contains("using pool 'pool0'"), "{err}");
    assert_eq!(n.json(&["volume", "show", "db"])["pool"], "pool0");

    // Two pools: refused, naming both, and nothing made.
    let volumes = n.json(&["volume", "list"]).as_array().unwrap().len();
    let spec = format!("{}:64M", n.dir.join("a.img").display());
    n.cli_ok(&["pool", "create", "pa", &spec]);
    let err = refused(&n, &["volume", "create", "w", "--size", "1M"], INVALID);
    assert!(
        err.contains("2 pools (pa, pool0)") && err.contains("--pool"),
        "{err}"
    );
    assert_eq!(
        n.json(&["volume", "list"]).as_array().unwrap().len(),
        volumes
    );

    // Snapshot times: a local date in the table, seconds in JSON.
    n.cli_ok(&["snapshot", "create", "db", "--name", "s1"]);
    let snaps = n.json(&["snapshot", "list"]);
    let created = snaps[0]["created"].as_u64().expect("seconds in --json");
    let table = n.cli_ok(&["snapshot", "list"]);
    assert!(
        !table.contains(&created.to_string()),
        "raw seconds in {table}"
    );
    let year = 1970 + created / 31_556_952;
    assert!(
        table
            .lines()
            .nth(1)
            .is_some_and(|l| l.contains(&format!("{year}-"))),
        "no date in {table}"
    );
}
