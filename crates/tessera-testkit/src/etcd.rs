//! A real etcd (Debian `etcd-server`) for cluster tests: one member or three, on free
//! loopback ports, data in a temporary directory, killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::node::{free_port, temp_dir};

/// One etcd member process.
pub struct EtcdMember {
    pub name: String,
    pub client_url: String,
    pub peer_url: String,
    dir: PathBuf,
    initial_cluster: String,
    child: Option<Child>,
}

/// A set of etcd members forming one cluster.
pub struct EtcdCluster {
    pub members: Vec<EtcdMember>,
    _tmp: TempDir,
}

impl EtcdCluster {
    /// Start `n` members and wait until the cluster answers (a leader exists).
    pub fn start(tag: &str, n: usize) -> EtcdCluster {
        Self::start_on(tag, n, "127.0.0.1")
    }

    /// [`start`](Self::start) with the members listening on `ip` (e.g. the test's end of
    /// a veth pair, so that nodes in a network namespace reach them).
    pub fn start_on(tag: &str, n: usize, ip: &str) -> EtcdCluster {
        let tmp = temp_dir(&format!("etcd-{tag}"));
        let mut members: Vec<EtcdMember> = (0..n)
            .map(|i| EtcdMember {
                name: format!("e{i}"),
                client_url: format!("http://{ip}:{}", free_port()),
                peer_url: format!("http://{ip}:{}", free_port()),
                dir: tmp.path().join(format!("e{i}")),
                initial_cluster: String::new(),
                child: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url))
            .collect::<Vec<_>>()
            .join(",");
        for m in &mut members {
            m.initial_cluster = initial.clone();
            m.spawn();
        }
        let c = EtcdCluster { members, _tmp: tmp };
        c.wait_ready(Duration::from_secs(30));
        c
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// The endpoints as a TOML array: `["http://...", ...]`.
    pub fn toml_endpoints(&self) -> String {
        let q: Vec<String> = self
            .endpoints()
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect();
        format!("[{}]", q.join(", "))
    }

    /// Wait until a running member reports a healthy cluster.
    pub fn wait_ready(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            for m in self.members.iter().filter(|m| m.child.is_some()) {
                if m.healthy() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "etcd did not become ready");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl EtcdMember {
    fn spawn(&mut self) {
        let log = std::fs::File::create(format!("{}.log", self.dir.display())).expect("etcd log");
        let child = Command::new("etcd")
            .args([
                "--name",
                &self.name,
                "--data-dir",
                &self.dir.display().to_string(),
                "--listen-client-urls",
                &self.client_url,
                "--advertise-client-urls",
                &self.client_url,
                "--listen-peer-urls",
                &self.peer_url,
                "--initial-advertise-peer-urls",
                &self.peer_url,
                "--initial-cluster",
                &self.initial_cluster,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "tessera-test",
                // Fast elections: tests kill members and wait for a new leader.
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .expect("start etcd (install etcd-server: scripts/install-deps.sh)");
        self.child = Some(child);
    }

    /// Whether this member answers `/health` with a healthy cluster.
    pub fn healthy(&self) -> bool {
        let addr = self.client_url.trim_start_matches("http://");
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            return false;
        };
        use std::io::{Read, Write};
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("\"health\":\"true\"")
    }

    /// kill -9 this member.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start it again on its data directory (it rejoins its cluster).
    pub fn restart(&mut self) {
        self.kill9();
        let log = format!("{}.log", self.dir.display());
        let _ = std::fs::rename(&log, format!("{log}.old"));
        self.spawn();
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for EtcdMember {
    fn drop(&mut self) {
        self.kill9();
    }
}
