//! NBD exports: which volume is served under which name.

use std::sync::Arc;
use tessera_io::sync::RwLockExt;

use tessera_api::{ExportInfo, TlsPolicy};
use tessera_pool::{ExportRecord, Pool, Volume};

use super::{Error, Node, Result};

impl Node {
    pub fn find_export(&self, name: &str) -> Option<(Arc<Pool>, ExportRecord)> {
        self.pools().into_iter().find_map(|p| {
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
        if let Some(why) = self.replica_blocked(&v) {
            tracing::warn!(export = %name, volume = %v.name, reason = %why,
                "export refused: its replicated volume is not open");
            return None;
        }
        Some((v, e.read_only))
    }

    /// Whether clients must start TLS to use the export: its own policy, else the
    /// node's default (`[nbd.tls] default`; no TLS configured: not required).
    pub fn export_tls_required(&self, e: &ExportRecord) -> bool {
        e.tls_required.unwrap_or_else(|| {
            self.cfg
                .nbd
                .tls
                .as_ref()
                .is_some_and(|t| t.default.is_required())
        })
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
                .find_volume(volume)
                .is_ok_and(|(vp, v)| Arc::ptr_eq(&vp, &p) && v.id == e.volume_id)
                && e.read_only == read_only
                && e.tls_required == tls.map(TlsPolicy::is_required);
            if same {
                return Ok(self.export_info(&p, &e));
            }
            return Err(Error::already_exists(format!(
                "export '{name}' already exists"
            )));
        }
        if tls == Some(TlsPolicy::Required) && self.nbd_tls.is_none() {
            return Err(Error::invalid(format!(
                "export '{name}': TLS is required but this node has no NBD TLS certificate \
                 ([nbd.tls] in the config, or --nbd-tls-cert/--nbd-tls-key)"
            )));
        }
        let (p, v) = self.find_volume(volume)?;
        let record = ExportRecord {
            name: name.to_string(),
            volume_id: v.id,
            read_only,
            tls_required: tls.map(TlsPolicy::is_required),
        };
        p.add_export(record.clone())?;
        Ok(self.export_info(&p, &record))
    }

    pub fn remove_export(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        let (p, _) = self
            .find_export(name)
            .ok_or_else(|| Error::missing("export", name))?;
        Ok(p.remove_export(name)?)
    }

    pub fn export_info(&self, p: &Pool, e: &ExportRecord) -> ExportInfo {
        let vol = p.volume_by_id(e.volume_id);
        let addrs = self.nbd_addresses.read_locked().clone();
        let tls_required = self.export_tls_required(e);
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

    pub fn list_exports(&self) -> Vec<ExportInfo> {
        let mut out = Vec::new();
        for p in self.pools() {
            for e in p.exports() {
                out.push(self.export_info(&p, &e));
            }
        }
        out
    }
}
