//! Network namespaces for partition tests: a namespace joined to the test's by a veth
//! pair, and an nftables table in it that cuts the link (root, `ip` and `nft` needed;
//! without them `NetNs::create` fails the test with the reason, or, where
//! `TESSERA_ALLOW_NO_NETNS` is set, says why and the test skips).

use crate::node::require_tool;

/// A private network namespace joined to the test's by a veth pair (10.231.X.Y/30), and
/// an nftables table in it that can cut the link: removed (namespace, link, table) on
/// drop, panicking or not.
pub struct NetNs {
    pub name: String,
    host_if: String,
    /// The namespace's address (the test's side is `host_addr`).
    pub addr: String,
    pub host_addr: String,
}

fn ip(args: &[&str]) -> std::io::Result<std::process::Output> {
    std::process::Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
}

/// A command that setting a namespace up or cutting it off needs, failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandFailed {
    /// It could not be started.
    #[error("{what}: {source}")]
    Spawn {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// It ran and failed; what it said on stderr.
    #[error("{what}: {stderr}")]
    Status { what: &'static str, stderr: String },
}

fn sh_ok(
    what: &'static str,
    o: std::io::Result<std::process::Output>,
) -> Result<(), CommandFailed> {
    match o {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(CommandFailed::Status {
            what,
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_string(),
        }),
        Err(source) => Err(CommandFailed::Spawn { what, source }),
    }
}

/// A partition test that cannot make its namespace: a failure (a partition test that
/// silently passes tests nothing), unless the environment opts out with
/// `TESSERA_ALLOW_NO_NETNS` (a sandbox that forbids namespaces), where it skips.
fn cannot_partition(why: &str) -> Option<NetNs> {
    if std::env::var_os("TESSERA_ALLOW_NO_NETNS").is_some() {
        eprintln!("SKIP: {why} (TESSERA_ALLOW_NO_NETNS is set)");
        return None;
    }
    panic!("{why}; set TESSERA_ALLOW_NO_NETNS=1 to skip the partition tests where namespaces cannot be made");
}

impl NetNs {
    /// The namespace, or where namespaces cannot be made (not root, no `ip` or `nft`, or a
    /// sandbox that forbids them) a test failure, or None with the reason printed when
    /// `TESSERA_ALLOW_NO_NETNS` is set.
    pub fn create() -> Option<NetNs> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return cannot_partition(
                "the partition test needs root (network namespaces, nftables)",
            );
        }
        if !require_tool("ip") || !require_tool("nft") {
            return None;
        }
        let pid = std::process::id();
        let (x, y) = ((pid >> 6) & 0xFF, (pid & 63) * 4);
        let ns = NetNs {
            name: format!("tsr-part-{pid}"),
            host_if: format!("tsrh{}", pid % 10_000_000),
            addr: format!("10.231.{x}.{}", y + 2),
            host_addr: format!("10.231.{x}.{}", y + 1),
        };
        let peer_if = format!("tsrn{}", pid % 10_000_000);
        let host_cidr = format!("{}/30", ns.host_addr);
        let ns_cidr = format!("{}/30", ns.addr);
        let steps: Vec<(&str, Vec<&str>)> = vec![
            ("ip netns add", vec!["netns", "add", &ns.name]),
            (
                "ip link add veth",
                vec![
                    "link",
                    "add",
                    &ns.host_if,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &peer_if,
                ],
            ),
            (
                "ip link set netns",
                vec!["link", "set", &peer_if, "netns", &ns.name],
            ),
            (
                "ip addr add (host)",
                vec!["addr", "add", &host_cidr, "dev", &ns.host_if],
            ),
            (
                "ip link set up (host)",
                vec!["link", "set", &ns.host_if, "up"],
            ),
            (
                "ip addr add (namespace)",
                vec![
                    "netns", "exec", &ns.name, "ip", "addr", "add", &ns_cidr, "dev", &peer_if,
                ],
            ),
            (
                "ip link set up (namespace)",
                vec![
                    "netns", "exec", &ns.name, "ip", "link", "set", &peer_if, "up",
                ],
            ),
            (
                "ip link set lo up (namespace)",
                vec!["netns", "exec", &ns.name, "ip", "link", "set", "lo", "up"],
            ),
        ];
        for (what, args) in steps {
            if let Err(e) = sh_ok(what, ip(&args)) {
                drop(ns); // what was made is removed
                return cannot_partition(&format!("cannot set a network namespace up here ({e})"));
            }
        }
        Some(ns)
    }

    /// Drop every packet between the namespace and the test's side, both ways.
    pub fn cut(&self) {
        let rules = format!(
            "table inet tsr_partition {{\n\
               chain input {{ type filter hook input priority 0; policy accept; ip saddr {h} drop; }}\n\
               chain output {{ type filter hook output priority 0; policy accept; ip daddr {h} drop; }}\n\
             }}\n",
            h = self.host_addr
        );
        let f = std::env::temp_dir().join(format!("{}.nft", self.name));
        std::fs::write(&f, rules).unwrap();
        let f = f.display().to_string();
        sh_ok(
            "nft -f",
            ip(&["netns", "exec", &self.name, "nft", "-f", &f]),
        )
        .unwrap();
    }

    pub fn heal(&self) {
        sh_ok(
            "nft delete table",
            ip(&[
                "netns",
                "exec",
                &self.name,
                "nft",
                "delete",
                "table",
                "inet",
                "tsr_partition",
            ]),
        )
        .unwrap();
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace takes its end of the veth pair, hence the pair, along.
        let _ = ip(&["netns", "del", &self.name]);
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = std::fs::remove_file(std::env::temp_dir().join(format!("{}.nft", self.name)));
    }
}
