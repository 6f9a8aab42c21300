//! A real etcd (Debian `etcd-server`) for cluster tests: one member or three, on free
//! loopback ports, data in a temporary directory, killed when dropped. With
//! [`EtcdCluster::start_tls`] the members serve clients over TLS only and demand a client
//! certificate their CA signed (`--client-cert-auth`).

use std::path::{Path, PathBuf};
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
    /// Server TLS for clients: the CA's certificate, the server's certificate and key
    /// (`scripts/nbd-tls-certs.sh` names), and a client certificate for health checks.
    tls: Option<PathBuf>,
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
        Self::start_inner(tag, n, ip, None)
    }

    /// [`start`](Self::start) with client TLS: `certs` holds `ca-cert.pem`,
    /// `server-cert.pem`, `server-key.pem` and `client-cert.pem`, `client-key.pem` (as
    /// `scripts/nbd-tls-certs.sh` writes them); clients must present a certificate the CA
    /// signed. Client URLs are `https://127.0.0.1:PORT`.
    pub fn start_tls(tag: &str, n: usize, certs: &Path) -> EtcdCluster {
        Self::start_inner(tag, n, "127.0.0.1", Some(certs.to_path_buf()))
    }

    fn start_inner(tag: &str, n: usize, ip: &str, tls: Option<PathBuf>) -> EtcdCluster {
        let tmp = temp_dir(&format!("etcd-{tag}"));
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut members: Vec<EtcdMember> = (0..n)
            .map(|i| EtcdMember {
                name: format!("e{i}"),
                client_url: format!("{scheme}://{ip}:{}", free_port()),
                peer_url: format!("http://{ip}:{}", free_port()),
                dir: tmp.path().join(format!("e{i}")),
                initial_cluster: String::new(),
                tls: tls.clone(),
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
        let mut cmd = Command::new("etcd");
        if let Some(c) = &self.tls {
            let f = |n: &str| c.join(n).display().to_string();
            cmd.args([
                "--client-cert-auth",
                "--trusted-ca-file",
                &f("ca-cert.pem"),
                "--cert-file",
                &f("server-cert.pem"),
                "--key-file",
                &f("server-key.pem"),
            ]);
        }
        let child = cmd
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
        if let Some(c) = &self.tls {
            let f = |n: &str| c.join(n).display().to_string();
            let out = Command::new("curl")
                .args(["-s", "--max-time", "2", "--cacert", &f("ca-cert.pem")])
                .args([
                    "--cert",
                    &f("client-cert.pem"),
                    "--key",
                    &f("client-key.pem"),
                ])
                .arg(format!("{}/health", self.client_url))
                .stdin(Stdio::null())
                .output();
            return out
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("\"health\":\"true\""));
        }
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
