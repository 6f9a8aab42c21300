//! The harness of `tessera-node`'s integration tests: a [`Node`] started in this process on
//! a temporary data directory (through `node::test_pools`, the unit tests' own helpers,
//! which the `harness` feature makes public), NBD served on 127.0.0.1 at a port the kernel
//! picks, and the node stopped and started again on the same directory. The tests call
//! the node's services directly, as the API routers do; what a user types stays tested
//! end to end in `crates/tessera-cli/tests`. What the nodes of a test binary log (info
//! and up, as `tessera run` logs by default) is kept: [`log_text`].

#![allow(dead_code, unused_imports)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;
use tessera_nbd::client::{ClientOptions, NbdClient};
use tessera_node::{listener, Node, NodeConfig};

pub use tessera_node::node::test_pools::{ram_pool, start_node, test_config, DEV_SIZE, UNIT};
pub use tessera_testkit::data::*;
pub use tessera_testkit::node::{path_str, poll_until, temp_dir, wait_for};

/// A node running in this process, in a directory of its own (removed when dropped,
/// unless the test panicked: then it is kept for a look at the files).
pub struct TestNode {
    node: Option<Arc<Node>>,
    tmp: Option<TempDir>,
    /// The test's directory: device files go here, the data directory is `data/` in it.
    pub dir: PathBuf,
    pub data_dir: PathBuf,
    cores: usize,
    setup: Setup,
    /// Serve NBD (on each start, at a new port: the old listener is not closed).
    serve_nbd: bool,
    nbd: Option<String>,
}

/// What a test node's configuration starts from.
enum Setup {
    /// Nothing but the data directory and the cores ([`test_config`]).
    Bare,
    /// `tessera up`'s embedded default: pool0 on a 4 GiB file, vol0 exported as vol0.
    Up,
    /// A config file in the test's directory (read again on each start).
    File(PathBuf),
}

impl TestNode {
    /// A node with `cores` reactor cores and no listener.
    pub fn start(tag: &str, cores: usize) -> Self {
        Self::start_opts(tag, cores, |_| Setup::Bare, false)
    }

    /// A node with `cores` reactor cores serving NBD on 127.0.0.1 ([`addr`](Self::addr)).
    pub fn with_nbd(tag: &str, cores: usize) -> Self {
        Self::start_opts(tag, cores, |_| Setup::Bare, true)
    }

    /// What `tessera up` starts (pool0 on a 4 GiB sparse file, vol0 exported as vol0, two
    /// cores), serving NBD.
    pub fn up(tag: &str) -> Self {
        Self::start_opts(tag, 2, |_| Setup::Up, true)
    }

    /// A node serving NBD whose config file is `toml(DIR)` (DIR: the test's directory,
    /// for device files) after the data directory and the cores.
    pub fn with_config(tag: &str, cores: usize, toml: impl FnOnce(&Path) -> String) -> Self {
        Self::start_opts(
            tag,
            cores,
            |dir| {
                let path = dir.join("tessera.toml");
                let text = format!(
                    "data_dir = \"{}\"\ncores = {cores}\npin_cores = false\n{}\n",
                    dir.join("data").display(),
                    toml(dir)
                );
                std::fs::write(&path, text).unwrap();
                Setup::File(path)
            },
            true,
        )
    }

    fn start_opts(
        tag: &str,
        cores: usize,
        setup: impl FnOnce(&Path) -> Setup,
        serve_nbd: bool,
    ) -> Self {
        capture_log();
        let tmp = temp_dir(tag);
        let dir = tmp.path().to_path_buf();
        let mut n = TestNode {
            node: None,
            tmp: Some(tmp),
            data_dir: dir.join("data"),
            setup: setup(&dir),
            dir,
            cores,
            serve_nbd,
            nbd: None,
        };
        n.boot();
        n
    }

    fn boot(&mut self) {
        let cfg = match &self.setup {
            Setup::Bare => test_config(&self.data_dir, self.cores),
            Setup::Up => NodeConfig {
                cores: self.cores,
                pin_cores: false,
                ..NodeConfig::embedded_default(&self.data_dir)
            },
            Setup::File(p) => NodeConfig::load(p).unwrap_or_else(|e| panic!("{e}")),
        };
        let node = start_node(cfg);
        if self.serve_nbd {
            // As `tessera run` does: listen, then tell the exports where.
            let a = listener::start_nbd_tcp(&node, "127.0.0.1:0").expect("listen for NBD");
            node.exports().set_nbd_addresses(vec![format!("nbd://{a}")]);
            self.nbd = Some(a);
        }
        self.node = Some(node);
    }

    /// The running node.
    pub fn node(&self) -> &Arc<Node> {
        self.node.as_ref().expect("the test node is stopped")
    }

    /// The NBD listener's address, HOST:PORT.
    pub fn addr(&self) -> String {
        self.nbd.clone().expect("this test node serves no NBD")
    }

    /// `nbd://HOST:PORT/EXPORT` of this node's NBD listener.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.addr())
    }

    /// Shut the node down as `tessera run` does on SIGTERM (every pool committed), and
    /// wait until nothing holds it any more: its data directory and device files are
    /// unlocked when it is gone. A node still held after 10 s fails the test (a thread
    /// keeps it, so a restart in process could not lock the directory again).
    pub fn stop(&mut self) {
        let Some(node) = self.node.take() else {
            return;
        };
        node.shutdown();
        let gone: Weak<Node> = Arc::downgrade(&node);
        drop(node);
        wait_for("the stopped node to be dropped", 10, || {
            gone.strong_count() == 0
        });
        self.nbd = None;
    }

    /// [`stop`](Self::stop), then start a node again on the same data directory.
    pub fn restart(&mut self) {
        // Once its device files are unlocked: a connection that was open on a core (NBD,
        // NVMe/TCP and iSCSI connections live on the reactors, which outlive the node)
        // holds its volume's devices, and so their locks, until the core sees it close.
        let files = self.node.as_deref().map(device_files).unwrap_or_default();
        self.stop();
        wait_for("the stopped node's device files to be unlocked", 10, || {
            files.iter().all(|f| unlocked(f))
        });
        self.boot();
    }

    /// Keep the directory after the test.
    pub fn keep(&mut self) {
        if let Some(t) = self.tmp.take() {
            let _ = t.keep();
        }
    }

    /// An NBD client of export `export` (20 s read timeout).
    pub fn nbd(&self, export: &str) -> NbdClient {
        let s = std::net::TcpStream::connect(self.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        NbdClient::from_stream(s, export, ClientOptions::default()).expect("NBD handshake")
    }

    /// A file device spec `DIR/NAME:SIZE` in the test's directory.
    pub fn file_dev(&self, name: &str, size: &str) -> String {
        format!("{}:{size}", path_str(&self.dir.join(name)))
    }

    /// Pool `name` of `layout` (`concat`, `raid1`...) on `devices`, with the node's default
    /// stripe and unit sizes, as `tessera pool create` asks for it.
    pub fn create_pool(&self, name: &str, layout: &str, devices: &[String]) {
        let layout = layout.parse().expect("layout");
        self.node()
            .create_pool(name, devices, layout, None, None, false)
            .unwrap_or_else(|e| panic!("create pool {name}: {e}"));
    }

    /// Volume `name` of `size` bytes in `pool`, exported under its own name.
    pub fn exported_volume(&self, name: &str, pool: &str, size: u64) {
        let n = self.node();
        n.create_volume(name, pool, size, false)
            .unwrap_or_else(|e| panic!("create volume {name}: {e}"));
        n.add_export(name, name, false, None)
            .unwrap_or_else(|e| panic!("export {name}: {e}"));
    }

    /// What `GET /v1/pools/NAME` answers (`tessera --json pool status NAME`).
    pub fn pool_json(&self, name: &str) -> Value {
        json(self.node().pool_detail(name).expect("pool detail"))
    }

    /// What `GET /v1/pools` answers (`tessera --json pool list`).
    pub fn pools_json(&self) -> Value {
        json(self.node().list_pools())
    }

    /// What `GET /v1/volumes` answers (`tessera --json volume list`).
    pub fn volumes_json(&self) -> Value {
        json(self.node().list_volumes())
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep the files; a node that cannot be shut down must not hide the failure.
            self.keep();
            if let Some(n) = self.node.take() {
                n.shutdown();
            }
        } else {
            self.stop();
        }
    }
}

/// `v` as the JSON the management API would answer with.
pub fn json(v: impl serde::Serialize) -> Value {
    serde_json::to_value(v).expect("serializable")
}

/// The log lines of this test binary's nodes, kept since the first node started.
static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();

/// Where the log goes: a shared buffer.
#[derive(Clone)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Log the process's tracing events at info and up into [`LOG`] (once per process).
fn capture_log() {
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let w = LogBuffer(buf.clone());
        // Another subscriber set first (none here) would only leave the buffer empty.
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || w.clone())
            .try_init();
        buf
    });
}

/// Everything this test binary's nodes have logged so far: the lines of every test that
/// ran in it, so a test looks for lines that name its own devices or directory.
pub fn log_text() -> String {
    let Some(buf) = LOG.get() else {
        return String::new();
    };
    String::from_utf8_lossy(&buf.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

impl TestNode {
    /// Fail the test (saying `what`) unless every reactor core of the node still runs the
    /// tasks sent to it: in process, a node that "died" is a core whose thread panicked
    /// (a crash of the whole node takes the test binary with it). Checked by running a
    /// no-op task on each core, 10 s at most.
    pub fn assert_alive(&self, what: &str) {
        for (core, mb) in self.node().reactors.iter().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel();
            mb.spawn(Box::new(move |_io| {
                let _ = tx.send(());
                Box::new(NoTask) as Box<dyn tessera_io::reactor::Task>
            }));
            assert!(
                rx.recv_timeout(Duration::from_secs(10)).is_ok(),
                "{what}: reactor core {core} runs no task"
            );
        }
    }
}

/// A task that is done as soon as it is installed ([`TestNode::assert_alive`]).
struct NoTask;

impl tessera_io::reactor::Task for NoTask {
    fn start(&mut self, _io: &mut tessera_io::CoreIo, _id: u32) {}
    fn on_complete(&mut self, _io: &mut tessera_io::CoreIo, _slot: u32, _res: i32) {}
    fn finished(&self) -> bool {
        true
    }
}

impl TestNode {
    /// Start NVMe/TCP as `tessera run` does (`node::nvmf::start`: the config's declared
    /// subsystems, then a listener on each of `[nvmf]`'s ports; a port that cannot be
    /// bound is logged and skipped); the I/O port's address, HOST:PORT. Again after each
    /// restart: a stopped node's listeners stay bound (their threads block in accept), so
    /// the node's config should listen on port 0 and the test take the new address.
    pub fn serve_nvmf(&self) -> String {
        let addrs = tessera_node::node::nvmf::start(self.node());
        addrs
            .iter()
            .find(|a| !a.ends_with("(discovery)"))
            .and_then(|a| a.strip_prefix("nvme+tcp://"))
            .unwrap_or_else(|| panic!("no NVMe/TCP I/O port among {addrs:?}"))
            .to_string()
    }

    /// Start iSCSI as `tessera run` does (`node::iscsi::start`: the persisted targets, the
    /// config's declared ones, then the portal `[iscsi] listen` names); the portal's
    /// address, HOST:PORT. Again after each restart, as for [`serve_nvmf`](Self::serve_nvmf).
    pub fn serve_iscsi(&self) -> String {
        let addrs = tessera_node::node::iscsi::start(self.node());
        addrs
            .iter()
            .find_map(|a| a.strip_prefix("iscsi://"))
            .unwrap_or_else(|| panic!("no iSCSI portal among {addrs:?}"))
            .to_string()
    }
}

/// The regular files among the devices of `node`'s pools (specs `PATH` or `PATH:SIZE`).
fn device_files(node: &Node) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for p in node.list_pools() {
        // An offline pool holds no device.
        let tessera_api::PoolEntry::Online(info) = p else {
            continue;
        };
        for spec in info.devices {
            let path = match spec.rsplit_once(':') {
                Some((path, _size)) if !Path::new(&spec).exists() => PathBuf::from(path),
                _ => PathBuf::from(&spec),
            };
            if path.is_file() {
                files.push(path);
            }
        }
    }
    files
}

/// Whether no one holds `file`'s `flock` (a pool's device lock): taken and let go at once.
fn unlocked(file: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::File::open(file) else {
        return true;
    };
    // SAFETY: flock on a descriptor this function owns; closing it lets the lock go.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

mod volume_io;
pub use volume_io::*;
mod fio;
pub use fio::*;
