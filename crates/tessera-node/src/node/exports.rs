//! The exports and protocols service, and the node's NBD export operations.
//!
//! [`Exports`] owns what the protocols share and what an export looks like to a
//! client: the NBD listeners' TLS (`[nbd.tls]`, loaded before anything is opened) and
//! the policy of exports that set none, the NBD addresses the node listens on (an
//! export's URIs), the connection cap of every listener started (NBD and NVMe/TCP),
//! and the client buffer budget (`[client_buffers]`) every connection draws from. Its
//! state changes only as listeners start; each part has its own lock, and none is held
//! while another is taken. The NVMe/TCP subsystems stay in crate::nvmf (node/nvmf.rs).
//!
//! The export records themselves live in their pool's metadata. Adding and removing
//! one stays a `Node` operation (below): it takes the node's admin lock, because the
//! name is unique across the pools and other operations (a rollback, a replica added)
//! check that a volume is not exported before they change it.

use std::sync::{Arc, Mutex, RwLock};
use tessera_io::sync::{MutexExt, RwLockExt};

use tessera_api::{ExportInfo, TlsPolicy};
use tessera_device::parse_size;
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_nbd::tls::ServerConfig;
use tessera_pool::{ExportRecord, Pool, Volume};

use super::{Error, Node, Result};
use crate::config::NodeConfig;
use crate::error::StartError;

pub struct Exports {
    /// TLS of the NBD listeners; `None`: no TLS configured.
    tls: Option<Arc<ServerConfig>>,
    /// Whether an export that sets no policy requires TLS (`[nbd.tls] default`).
    tls_by_default: bool,
    /// Where NBD clients reach this node (`nbd://HOST:PORT`), set once the listeners
    /// are up: the start of an export's URIs.
    addresses: RwLock<Vec<String>>,
    /// Bytes of client request buffers in flight, NBD and NVMe/TCP.
    buffers: Arc<BufferBudget>,
    /// The connection cap of every listener started, for metrics.
    caps: Mutex<Vec<Arc<ListenerCap>>>,
}

impl Exports {
    /// The service as `cfg` sets it up. A certificate or key that cannot be loaded, or
    /// a `[client_buffers]` size that does not parse, stops the start.
    pub fn load(cfg: &NodeConfig) -> std::result::Result<Exports, StartError> {
        let tls = match &cfg.nbd.tls {
            Some(t) => Some(
                tessera_nbd::tls::server_config(&t.cert, &t.key, t.client_ca.as_deref())
                    .map_err(StartError::NbdTls)?,
            ),
            None => None,
        };
        let b = &cfg.client_buffers;
        let size = |what: &str, v: &str| {
            parse_size(v).map_err(|e| StartError::Config(format!("[client_buffers] {what}: {e}")))
        };
        let buffers = BufferBudget::new(
            size("per_connection", &b.per_connection)?,
            size("per_node", &b.per_node)?,
        );
        let tls_by_default = cfg
            .nbd
            .tls
            .as_ref()
            .is_some_and(|t| t.default.is_required());
        Ok(Exports::new(tls, tls_by_default, buffers))
    }

    fn new(
        tls: Option<Arc<ServerConfig>>,
        tls_by_default: bool,
        buffers: Arc<BufferBudget>,
    ) -> Exports {
        Exports {
            tls,
            tls_by_default,
            addresses: RwLock::new(Vec::new()),
            buffers,
            caps: Mutex::new(Vec::new()),
        }
    }

    /// The NBD listeners' TLS, for a connection's handshake.
    pub fn tls(&self) -> Option<Arc<ServerConfig>> {
        self.tls.clone()
    }

    /// Whether clients must start TLS to use export `e`: its own policy, else the
    /// node's default (`[nbd.tls] default`; no TLS configured: not required).
    pub fn tls_required(&self, e: &ExportRecord) -> bool {
        e.tls_required.unwrap_or(self.tls_by_default)
    }

    /// Can export `name` have TLS policy `tls`? Not "required" on a node without a
    /// certificate: no client could use it.
    pub fn check_policy(&self, name: &str, tls: Option<TlsPolicy>) -> Result<()> {
        if tls == Some(TlsPolicy::Required) && self.tls.is_none() {
            return Err(Error::invalid(format!(
                "export '{name}': TLS is required but this node has no NBD TLS certificate \
                 ([nbd.tls] in the config, or --nbd-tls-cert/--nbd-tls-key)"
            )));
        }
        Ok(())
    }

    /// The NBD addresses (`nbd://HOST:PORT`) clients reach this node at.
    pub fn nbd_addresses(&self) -> Vec<String> {
        self.addresses.read_locked().clone()
    }

    /// Set once the NBD listeners are up.
    pub fn set_nbd_addresses(&self, addresses: Vec<String>) {
        *self.addresses.write_locked() = addresses;
    }

    /// The client buffer budget every NBD and NVMe/TCP connection draws from.
    pub fn buffers(&self) -> &Arc<BufferBudget> {
        &self.buffers
    }

    /// A connection cap for a new listener of `protocol` on `address`, listed in the
    /// node's metrics.
    pub fn listener_cap(
        &self,
        protocol: &'static str,
        address: String,
        max: usize,
    ) -> Arc<ListenerCap> {
        let cap = ListenerCap::new(protocol, address, max);
        self.caps.locked().push(cap.clone());
        cap
    }

    /// Every listener's connection cap, in the order they started.
    pub fn listener_caps(&self) -> Vec<Arc<ListenerCap>> {
        self.caps.locked().clone()
    }

    /// Export `e` of pool `p` as clients see it: its volume, connections, URIs (`nbds`
    /// where TLS is required) and TLS policy.
    pub fn info(&self, p: &Pool, e: &ExportRecord) -> ExportInfo {
        let vol = p.volume_by_id(e.volume_id);
        let addrs = self.nbd_addresses();
        let tls_required = self.tls_required(e);
        let uri = |a: &String| match a.strip_prefix("nbd://") {
            Some(host) if tls_required => format!("nbds://{host}/{}", e.name),
            _ => format!("{a}/{}", e.name),
        };
        ExportInfo {
            name: e.name.clone(),
            volume: vol.as_ref().map(|v| v.name.clone()),
            read_only: e.read_only,
            size: vol.as_ref().map(|v| v.size()),
            connections: vol.as_ref().map(|v| v.open_handles()),
            uris: addrs.iter().map(uri).collect(),
            tls: e.tls_required.map(|r| {
                if r {
                    TlsPolicy::Required
                } else {
                    TlsPolicy::Optional
                }
            }),
            tls_required,
        }
    }

    /// Every export of `pools`, pool by pool.
    pub fn list(&self, pools: &[Arc<Pool>]) -> Vec<ExportInfo> {
        pools
            .iter()
            .flat_map(|p| p.exports().into_iter().map(|e| self.info(p, &e)))
            .collect()
    }
}

impl Node {
    pub fn find_export(&self, name: &str) -> Option<(Arc<Pool>, ExportRecord)> {
        self.pools().list().into_iter().find_map(|p| {
            p.exports()
                .into_iter()
                .find(|e| e.name == name)
                .map(|e| (p.clone(), e))
        })
    }

    /// The volume behind an export, for a connection that negotiated it.
    pub fn resolve_export(&self, name: &str) -> Option<(Arc<Volume>, bool)> {
        let (p, e) = self.find_export(name)?;
        let v = p.volume_by_id(e.volume_id)?;
        if let Some(why) = self.replicas.blocked(&v) {
            tracing::warn!(export = %name, volume = %v.name, reason = %why,
                "export refused: its replicated volume is not open");
            return None;
        }
        Some((v, e.read_only))
    }

    pub fn add_export(
        &self,
        name: &str,
        volume: &str,
        read_only: bool,
        tls: Option<TlsPolicy>,
    ) -> Result<ExportInfo> {
        let _g = self.admin();
        if let Some((p, e)) = self.find_export(name) {
            // The same export again is not an error (a cluster volume's owner exports
            // it under its name by itself; scripts may still ask for it): creation is
            // idempotent for an identical export, a conflict for any other.
            let same = self
                .pools()
                .find_volume(volume)
                .is_ok_and(|(vp, v)| Arc::ptr_eq(&vp, &p) && v.id == e.volume_id)
                && e.read_only == read_only
                && e.tls_required == tls.map(TlsPolicy::is_required);
            if same {
                return Ok(self.exports.info(&p, &e));
            }
            return Err(Error::already_exists(format!(
                "export '{name}' already exists"
            )));
        }
        self.exports.check_policy(name, tls)?;
        let (p, v) = self.pools().find_volume(volume)?;
        let record = ExportRecord {
            name: name.to_string(),
            volume_id: v.id,
            read_only,
            tls_required: tls.map(TlsPolicy::is_required),
        };
        p.add_export(record.clone())?;
        Ok(self.exports.info(&p, &record))
    }

    pub fn remove_export(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        let (p, _) = self
            .find_export(name)
            .ok_or_else(|| Error::missing("export", name))?;
        Ok(p.remove_export(name)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_pool::LayoutKind;

    use crate::node::test_pools::{ram_pool, UNIT};

    /// The service without a certificate; `tls_by_default`: as `[nbd.tls] default =
    /// "required"` sets it.
    fn service(tls_by_default: bool) -> Exports {
        Exports::new(None, tls_by_default, BufferBudget::new(1 << 20, 8 << 20))
    }

    /// Pool `pool` on one RAM device with a volume of 4 units exported as `export`,
    /// TLS policy `tls`.
    fn exported(pool: &str, export: &str, tls: Option<bool>) -> Arc<Pool> {
        let (p, _ram) = ram_pool(pool, LayoutKind::Concat, 1);
        let v = p.create_volume(&format!("{pool}-vol"), 4 * UNIT).unwrap();
        p.add_export(ExportRecord {
            name: export.to_string(),
            volume_id: v.id,
            read_only: false,
            tls_required: tls,
        })
        .unwrap();
        p
    }

    fn record(tls: Option<bool>) -> ExportRecord {
        ExportRecord {
            name: "e".into(),
            volume_id: 1,
            read_only: true,
            tls_required: tls,
        }
    }

    #[test]
    fn an_export_lists_a_uri_per_address_nbds_where_tls_is_required() {
        let x = service(false);
        let pools = [
            exported("a", "plain", None),
            exported("b", "secure", Some(true)),
        ];
        assert!(x.list(&pools).iter().all(|e| e.uris.is_empty()));

        x.set_nbd_addresses(vec![
            "nbd://10.0.0.1:10809".into(),
            "nbd://[::1]:10809".into(),
        ]);
        let list = x.list(&pools);
        let names: Vec<&str> = list.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["plain", "secure"]);
        let (plain, secure) = (&list[0], &list[1]);
        assert_eq!(
            plain.uris,
            ["nbd://10.0.0.1:10809/plain", "nbd://[::1]:10809/plain"]
        );
        assert_eq!((plain.tls, plain.tls_required), (None, false));
        assert_eq!(plain.volume.as_deref(), Some("a-vol"));
        assert_eq!((plain.size, plain.connections), (Some(4 * UNIT), Some(0)));
        assert_eq!(
            secure.uris,
            ["nbds://10.0.0.1:10809/secure", "nbds://[::1]:10809/secure"]
        );
        assert_eq!(
            (secure.tls, secure.tls_required),
            (Some(TlsPolicy::Required), true)
        );
        assert_eq!(secure.volume.as_deref(), Some("b-vol"));
    }

    #[test]
    fn an_export_without_a_policy_follows_the_node_default() {
        let required = service(true);
        assert!(required.tls_required(&record(None)));
        assert!(!required.tls_required(&record(Some(false))));
        let optional = service(false);
        assert!(!optional.tls_required(&record(None)));
        assert!(optional.tls_required(&record(Some(true))));
    }

    #[test]
    fn tls_required_needs_a_certificate() {
        let x = service(false);
        match x.check_policy("e", Some(TlsPolicy::Required)) {
            Err(Error::Invalid(m)) => assert!(m.contains("no NBD TLS certificate"), "{m}"),
            other => panic!("expected invalid, got {other:?}"),
        }
        x.check_policy("e", Some(TlsPolicy::Optional)).unwrap();
        x.check_policy("e", None).unwrap();
    }

    #[test]
    fn listener_caps_are_listed_in_start_order() {
        let x = service(false);
        let nbd = x.listener_cap("nbd", "127.0.0.1:10809".into(), 4);
        let nvme = x.listener_cap("nvme-tcp", "127.0.0.1:4420".into(), 8);
        let caps = x.listener_caps();
        assert_eq!(caps.len(), 2);
        assert!(Arc::ptr_eq(&caps[0], &nbd) && Arc::ptr_eq(&caps[1], &nvme));
        assert_eq!(
            (caps[1].protocol, caps[1].address.as_str()),
            ("nvme-tcp", "127.0.0.1:4420")
        );
    }

    #[test]
    fn load_takes_the_buffer_budget_from_the_config_and_refuses_a_bad_size() {
        let mut cfg = NodeConfig::default();
        cfg.client_buffers.per_connection = "2M".into();
        cfg.client_buffers.per_node = "16M".into();
        let x = Exports::load(&cfg).unwrap();
        assert_eq!(
            (x.buffers().conn_limit(), x.buffers().node_limit()),
            (2 << 20, 16 << 20)
        );
        assert!(x.tls().is_none());

        cfg.client_buffers.per_node = "lots".into();
        match Exports::load(&cfg) {
            Err(StartError::Config(m)) => assert!(m.contains("[client_buffers] per_node"), "{m}"),
            Err(e) => panic!("expected a config error, got {e}"),
            Ok(_) => panic!("a bad size was taken"),
        }
    }
}
