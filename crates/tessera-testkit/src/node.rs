//! Run a real `tessera` node process on loopback in a temporary data directory, talk to
//! it with the CLI, restart it, kill it; run the perf tools against it and read their
//! RESULT lines.

use std::io::{BufRead, BufReader};
use std::marker::PhantomData;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tempfile::TempDir;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// Poll `f` every 100 ms until it holds; fail the test naming `what` after `secs` seconds.
pub fn wait_for(what: &str, secs: u64, f: impl FnMut() -> bool) {
    wait_for_every(what, secs, Duration::from_millis(100), f);
}

/// [`wait_for`], polling every `every` (for conditions that change within milliseconds).
pub fn wait_for_every(what: &str, secs: u64, every: Duration, mut f: impl FnMut() -> bool) {
    if poll_until(Duration::from_secs(secs), every, &mut f, |&held| held).is_err() {
        panic!("timed out waiting for {what}");
    }
}

/// Take `probe()` every `every` until `done` holds for the value: `Ok` with that value,
/// or `Err` with the last one taken once `limit` has passed (the caller says what was
/// awaited, and whether a timeout fails the test or is what it then checks). The probe is
/// taken at least once, and once more at the limit.
pub fn poll_until<T>(
    limit: Duration,
    every: Duration,
    mut probe: impl FnMut() -> T,
    mut done: impl FnMut(&T) -> bool,
) -> Result<T, T> {
    let end = Instant::now() + limit;
    loop {
        let past = Instant::now() >= end;
        let v = probe();
        if done(&v) {
            return Ok(v);
        }
        if past {
            return Err(v);
        }
        std::thread::sleep(every.min(end.saturating_duration_since(Instant::now())));
    }
}

/// Read a starting node's stdout up to its `tessera: ready` line: the banner, that line
/// included, or `None` when `limit` passes first. A thread goes on draining the rest of
/// the output, so the node never blocks on a full pipe.
pub fn await_ready(out: std::process::ChildStdout, limit: Duration) -> Option<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut banner = String::new();
        let mut tx = Some(tx);
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(t) = &tx {
                banner.push_str(&line);
                banner.push('\n');
                if line.starts_with("tessera: ready") {
                    let _ = t.send(std::mem::take(&mut banner));
                    tx = None;
                }
            }
        }
    });
    rx.recv_timeout(limit).ok()
}

/// A fresh, empty directory for one test, under `$TESSERA_TEST_DIR` if set (else the
/// system's temporary directory); removed when dropped.
pub fn temp_dir(tag: &str) -> TempDir {
    let base = std::env::var_os("TESSERA_TEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    tempfile::Builder::new()
        .prefix(&format!("tessera-test-{tag}-"))
        .tempdir_in(base)
        .expect("create a temporary directory")
}

/// A TCP port on 127.0.0.1 that was free a moment ago and that no other test (in this
/// process or another) gets from here while this process lives.
pub fn free_port() -> u16 {
    let (low, high) = ports_outside_the_ephemeral_range();
    let span = u32::from(high - low) + 1;
    let start = std::process::id().wrapping_mul(7919) ^ SEQ.fetch_add(1, Ordering::Relaxed);
    for i in 0..span {
        let port = low + u16::try_from((start.wrapping_add(i)) % span).expect("below span");
        if let Some(lock) = reserve_port(port) {
            RESERVED_PORTS
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(lock);
            return port;
        }
    }
    panic!("no free port in {low}..={high} for a test node");
}

/// Ports handed out by [`free_port`]: each one's lock file stays locked (and so reserved
/// from other tests) until this test process exits.
static RESERVED_PORTS: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// The ports tests pick from: below the kernel's ephemeral range, so that no outgoing
/// connection (a client of another test, etcd's peers) takes a port between the moment
/// a test picks it and the moment its node binds it. That race made a node start with
/// its NVMe/TCP listener off ("Address already in use") and its test talk to another
/// test's node. It starts above the well-known ports our defaults use (NBD's 10809,
/// iSCSI's 3260, NVMe/TCP's 4420, etcd's 2379), which tests that run defaults bind.
fn ports_outside_the_ephemeral_range() -> (u16, u16) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    if ephemeral_low > 13_000 {
        (11_000, ephemeral_low - 1)
    } else {
        // The ephemeral range starts low (a tuned machine): take ports above it.
        (61_000, 65_000)
    }
}

/// Reserve `port` across test processes (an exclusive `flock` on a file named after
/// it; released by the kernel when the process ends, however it ends) if nothing
/// listens on it now.
fn reserve_port(port: u16) -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    let dir = std::env::temp_dir().join("tessera-test-ports");
    std::fs::create_dir_all(&dir).ok()?;
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(port.to_string()))
        .ok()?;
    // SAFETY: flock on a file descriptor we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return None;
    }
    TcpListener::bind(("127.0.0.1", port)).ok()?;
    Some(f)
}

/// The `tessera` binary a test runs: `CARGO_BIN_EXE_tessera` in `tessera-cli`'s tests.
pub trait Binary {
    const PATH: &'static str;
}

/// A node process in a directory of its own (removed when the node is dropped, unless the
/// test panicked or [`TestNode::keep`] was called).
pub struct TestNode<B: Binary> {
    pub child: Option<Child>,
    pub dir: PathBuf,
    tmp: Option<TempDir>,
    pub data_dir: PathBuf,
    pub port: u16,
    /// The iSCSI portal's port of a node started with `tessera up` (a free one: `up`
    /// would otherwise listen on 3260, which parallel test nodes would fight over);
    /// config nodes listen for iSCSI only where their config says so.
    pub iscsi_port: u16,
    /// Config file, when started with one (restart reuses it).
    pub config: Option<PathBuf>,
    pub log: PathBuf,
    /// Network namespace the node runs in (`ip netns exec`), if not the test's own.
    pub netns: Option<String>,
    keep: bool,
    bin: PhantomData<B>,
}

impl<B: Binary> TestNode<B> {
    /// `tessera up`: the embedded default (pool0 on a 4 GiB file, vol0 exported as vol0).
    pub fn start_default(tag: &str) -> Self {
        let tmp = temp_dir(tag);
        let dir = tmp.path().to_path_buf();
        let mut n = TestNode {
            child: None,
            data_dir: dir.join("data"),
            dir,
            tmp: Some(tmp),
            port: free_port(),
            iscsi_port: free_port(),
            config: None,
            log: PathBuf::new(),
            netns: None,
            keep: false,
            bin: PhantomData,
        };
        n.spawn();
        n
    }

    /// `tessera node --config`, with `extra` TOML appended to a config that sets the data
    /// directory, the NBD port, 2 cores and the NBD Unix socket DIR/nbd.sock.
    pub fn start_with_config(tag: &str, extra: &str) -> Self {
        Self::start_with_cores(tag, 2, extra)
    }

    /// [`start_with_config`](Self::start_with_config) with `cores` reactor cores.
    pub fn start_with_cores(tag: &str, cores: usize, extra: &str) -> Self {
        Self::start_with_top(tag, cores, "", extra)
    }

    /// [`start_with_cores`](Self::start_with_cores) with `top` TOML put first, where
    /// top-level keys (`name`, `[[peer]]` tables before any other table) may go.
    pub fn start_with_top(tag: &str, cores: usize, top: &str, extra: &str) -> Self {
        Self::start_in_netns(tag, None, cores, top, extra)
    }

    /// [`start_with_top`](Self::start_with_top) in network namespace `netns` (which the
    /// test made; its NBD port is then reachable only inside it, or through the NBD Unix
    /// socket DIR/nbd.sock; the API socket is a file, reachable as usual).
    pub fn start_in_netns(
        tag: &str,
        netns: Option<&str>,
        cores: usize,
        top: &str,
        extra: &str,
    ) -> Self {
        let tmp = temp_dir(tag);
        let dir = tmp.path().to_path_buf();
        let port = free_port();
        let data_dir = dir.join("data");
        let cfg = dir.join("tessera.toml");
        let text = format!(
            "{top}\ndata_dir = \"{}\"\ncores = {cores}\n[nbd]\nlisten = [\"127.0.0.1:{port}\"]\nunix = \"{}\"\n{extra}\n",
            data_dir.display(),
            dir.join("nbd.sock").display()
        );
        std::fs::write(&cfg, text).unwrap();
        let mut n = TestNode {
            child: None,
            dir,
            tmp: Some(tmp),
            data_dir,
            port,
            iscsi_port: 0,
            config: Some(cfg),
            log: PathBuf::new(),
            netns: netns.map(str::to_string),
            keep: false,
            bin: PhantomData,
        };
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        // `ip netns exec` execs the binary: the child's pid is the node's.
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, B::PATH]);
                c
            }
            None => Command::new(B::PATH),
        };
        match &self.config {
            Some(c) => {
                cmd.arg("node").arg("--config").arg(c);
            }
            None => {
                cmd.arg("up")
                    .arg("--data-dir")
                    .arg(&self.data_dir)
                    .arg("--nbd")
                    .arg(format!("127.0.0.1:{}", self.port))
                    .arg("--iscsi")
                    .arg(format!("127.0.0.1:{}", self.iscsi_port))
                    .arg("--cores")
                    .arg("2");
            }
        }
        self.log = self
            .dir
            .join(format!("node-{}.log", SEQ.fetch_add(1, Ordering::Relaxed)));
        let err = std::fs::File::create(&self.log).unwrap();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(err)
            .stdin(Stdio::null())
            .spawn()
            .expect("start tessera");
        let out = child.stdout.take().unwrap();
        if await_ready(out, Duration::from_secs(30)).is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "node did not become ready; log:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
        self.child = Some(child);
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn api(&self) -> String {
        format!("unix:{}", self.data_dir.join("api.sock").display())
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd://127.0.0.1:{}/{export}", self.port)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Run `tessera --api ... ARGS`.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(B::PATH)
            .arg("--api")
            .arg(self.api())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run tessera cli")
    }

    /// Run the CLI and insist on success; returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        cli_stdout(args, &self.cli(args))
    }

    /// Run the CLI and insist that it fails; returns stderr (the error text).
    pub fn cli_fails(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(
            !o.status.success(),
            "tessera {args:?} should have been refused; stdout: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    /// Run the CLI with `--json` and parse its answer.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.cli_ok(&a);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("tessera {args:?} --json: invalid JSON ({e}):\n{out}"))
    }

    /// SIGKILL: no chance to commit anything.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signalling our own child process.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    panic!("node did not stop on SIGTERM");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Start again on the same data directory (after stop or kill9).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill the node first");
        self.spawn();
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A test failed with this node up: say whether the node was still running and show
    /// the end of its log, so that a failure in CI (whose directories are gone) can be
    /// understood from its output alone.
    fn report_on_panic(&mut self) {
        const TAIL_LINES: usize = 40;
        let state = match self.child.as_mut().map(|c| c.try_wait()) {
            None => "not running (stopped by the test)".to_string(),
            Some(Ok(None)) => "still running".to_string(),
            Some(Ok(Some(status))) => format!("exited on its own: {status}"),
            Some(Err(e)) => format!("state unknown: {e}"),
        };
        let log = self.log_text();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(TAIL_LINES)..];
        eprintln!(
            "--- node {} ({state}); last {} lines of {}:\n{}\n---",
            self.dir.display(),
            tail.len(),
            self.log.display(),
            tail.join("\n")
        );
    }

    /// Keep the directory after the test (for debugging).
    pub fn keep(&mut self) {
        self.keep = true;
    }
}

impl<B: Binary> Drop for TestNode<B> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.report_on_panic();
        }
        self.kill9();
        if let Some(tmp) = self.tmp.take() {
            if self.keep || std::thread::panicking() {
                let _ = tmp.keep();
            }
        }
    }
}

/// Insist that `tessera ARGS` succeeded (`o` is what it did); returns its stdout.
pub fn cli_stdout(args: &[&str], o: &Output) -> String {
    assert!(
        o.status.success(),
        "tessera {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A C tool of the workspace's `tools/` (`tools/NAME.c`) compiled against libiscsi into
/// `scratch`, or None (the test skips) where it cannot be built and missing tools are
/// allowed (TESSERA_ALLOW_MISSING_TOOLS); otherwise a build failure fails the test.
pub fn libiscsi_tool(name: &str, scratch: &Path) -> Option<PathBuf> {
    if !require_tool("cc") {
        return None;
    }
    let out = scratch.join(format!("{name}-{}", std::process::id()));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tools/{name}.c"));
    let o = Command::new("cc")
        .args(["-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .arg("-liscsi")
        .output()
        .expect("run cc");
    if !o.status.success() {
        let why = String::from_utf8_lossy(&o.stderr).into_owned();
        if std::env::var_os("TESSERA_ALLOW_MISSING_TOOLS").is_some() {
            eprintln!("skipping: tools/{name}.c does not build (libiscsi-dev?): {why}");
            return None;
        }
        panic!("tools/{name}.c does not build: run scripts/install-deps.sh (libiscsi-dev)\n{why}");
    }
    Some(out)
}

/// Is an external tool installed? Tests that need one fail loudly when it is missing
/// (scripts/install-deps.sh installs them), unless TESSERA_ALLOW_MISSING_TOOLS is set.
pub fn require_tool(name: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        if std::env::var_os("TESSERA_ALLOW_MISSING_TOOLS").is_some() {
            eprintln!("skipping: {name} is not installed");
            return false;
        }
        panic!("{name} is not installed: run scripts/install-deps.sh");
    }
    true
}

/// Run tool `name` with `args` (no stdin) and return whether it succeeded, with its
/// stdout and stderr together (libiscsi's tools print their errors on either).
pub fn run_tool(name: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new(name)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let mut out = String::from_utf8_lossy(&o.stdout).into_owned();
    out.push_str(&String::from_utf8_lossy(&o.stderr));
    (o.status.success(), out)
}

/// (passed, failed) from the CUnit run summary line "tests N N passed failed ..." that
/// `iscsi-test-cu` prints (libiscsi's skips count as passed there).
pub fn cunit_counts(out: &str) -> Option<(u32, u32)> {
    let line = out.lines().find(|l| l.trim_start().starts_with("tests"))?;
    let nums: Vec<u32> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // Run Summary: Type Total Ran Passed Failed Inactive
    (nums.len() >= 4).then(|| (nums[2], nums[3]))
}

/// Run a command, insist on success, return stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let o = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `nbdinfo --map URI` as `(offset, length, type)`, adjacent runs of one type merged.
pub fn nbdinfo_map(uri: &str) -> Vec<(u64, u64, u32)> {
    let text = run_ok(Command::new("nbdinfo").arg("--map").arg(uri));
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert!(
            f.len() >= 3,
            "unparsable nbdinfo --map line {line:?} in:\n{text}"
        );
        let parse = |s: &str| {
            s.parse::<u64>()
                .unwrap_or_else(|_| panic!("bad number {s:?} in {line:?}"))
        };
        let (off, len, ty) = (
            parse(f[0]),
            parse(f[1]),
            u32::try_from(parse(f[2])).expect("a block status type fits u32"),
        );
        match out.last_mut() {
            Some(last) if last.2 == ty && last.0 + last.1 == off => last.1 += len,
            Some(last) => {
                assert_eq!(
                    last.0 + last.1,
                    off,
                    "gap or overlap in nbdinfo --map output:\n{text}"
                );
                out.push((off, len, ty));
            }
            None => {
                assert_eq!(off, 0, "nbdinfo --map does not start at 0:\n{text}");
                out.push((off, len, ty));
            }
        }
    }
    out
}

/// A command [`run_bounded`] killed at its time limit, and what it printed.
#[derive(Debug, thiserror::Error)]
#[error("{cmd} did not finish within {secs} s (killed); it printed:\n{printed}")]
pub struct TimedOut {
    pub cmd: String,
    pub secs: u64,
    pub printed: String,
}

/// Run `cmd` with stdout/stderr captured in files under `dir`, for at most `secs`: on
/// timeout it is killed and the error carries what it printed (a hung node fails the
/// test instead of hanging it).
pub fn run_bounded(cmd: &mut Command, dir: &Path, secs: u64) -> Result<Output, TimedOut> {
    static N: AtomicU64 = AtomicU64::new(0);
    let k = N.fetch_add(1, Ordering::Relaxed);
    let (out, err) = (
        dir.join(format!("cmd-{k}.out")),
        dir.join(format!("cmd-{k}.err")),
    );
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read(&out).unwrap_or_default();
    let stderr = std::fs::read(&err).unwrap_or_default();
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&err);
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(TimedOut {
            cmd: format!("{cmd:?}"),
            secs,
            printed: format!(
                "{}{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            ),
        }),
    }
}

/// Resident memory (VmRSS) of process `pid`, in bytes: a node's, or this process's
/// (`std::process::id()`).
pub fn vm_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status");
    kib << 10
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}

/// Is the measured `got` within `tol` (a fraction: 0.05 is 5%) of `want`?
pub fn within(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= want * tol
}

/// Figures from one `tessera nbd-perf` run.
pub struct PerfResult {
    pub iops: f64,
    pub mibps: f64,
    pub line: String,
}

impl PerfResult {
    /// A `key=value` field of the RESULT line.
    pub fn field(&self, k: &str) -> f64 {
        self.line
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {}", self.line))
            .parse()
            .unwrap()
    }
}

/// Run `tessera nbd-perf` against `uri` (4 KiB requests over the first 64 MiB unless
/// `extra` says otherwise) and parse
/// its RESULT line; `extra` adds arguments. Fails the test on any I/O error.
pub fn nbd_perf<B: Binary>(
    uri: &str,
    pattern: &str,
    qd: u32,
    secs: u64,
    extra: &[&str],
) -> PerfResult {
    let qd = qd.to_string();
    let secs = secs.to_string();
    let mut args = vec![
        "nbd-perf",
        "--uri",
        uri,
        "--pattern",
        pattern,
        "--qd",
        &qd,
        "--time",
        &secs,
    ];
    if !extra.contains(&"--size") {
        args.extend_from_slice(&["--size", "64M"]);
    }
    args.extend_from_slice(extra);
    let out = run_ok(Command::new(B::PATH).args(&args));
    let line = out
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .expect("RESULT line")
        .to_string();
    let mut r = PerfResult {
        iops: 0.0,
        mibps: 0.0,
        line,
    };
    assert_eq!(r.field("errors"), 0.0, "{}", r.line);
    r.iops = r.field("iops");
    r.mibps = r.field("mibps");
    r
}

/// The `key=value` fields of the RESULT line a perf tool (`nbd-perf`, `nvmf perf`)
/// printed on `stdout`; `what` and `stderr` go into the failure message.
pub fn result_fields(
    stdout: &str,
    stderr: &str,
    what: &str,
) -> std::collections::HashMap<String, f64> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("RESULT "))
        .unwrap_or_else(|| panic!("{what}: no RESULT line in:\n{stdout}{stderr}"));
    line["RESULT ".len()..]
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("key=value");
            (k.to_string(), v.parse().expect("number"))
        })
        .collect()
}

/// The value of the sample `series` (metric name and labels exactly as printed) in a
/// Prometheus text exposition.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// `GET path` from the HTTP/1.0 listener at `addr` (a node's `/metrics`): the status
/// and the body.
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}
