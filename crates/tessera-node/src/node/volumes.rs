//! Thin volumes: create, resize, delete, list, QoS limits and I/O statistics.

use std::sync::Arc;
use tessera_io::cast::DurationU64;

use tessera_api::{IoTotals, LatencyWindow, VolumeInfo, VolumeStats};
use tessera_pool::{Pool, Volume, VolumeOptions};
use tessera_qos::QosLimits;

use super::{Error, Node, Result};
use crate::target::NodeTarget;

impl Node {
    /// `force`: beyond the pool's overcommit ratio.
    pub fn create_volume(
        &self,
        name: &str,
        pool: &str,
        size: u64,
        force: bool,
    ) -> Result<VolumeInfo> {
        let opts = VolumeOptions {
            force,
            ..VolumeOptions::default()
        };
        self.create_volume_opts(name, pool, size, opts)
    }

    /// [`Node::create_volume`] with every option (`dedup`: whether a volume of a dedup
    /// pool deduplicates).
    pub fn create_volume_opts(
        &self,
        name: &str,
        pool: &str,
        size: u64,
        opts: VolumeOptions,
    ) -> Result<VolumeInfo> {
        let _g = self.admin();
        if self.pools().find_volume(name).is_ok() {
            return Err(Error::already_exists(format!(
                "volume '{name}' already exists"
            )));
        }
        let p = if pool.is_empty() {
            self.only_pool()?
        } else {
            self.pools().get(pool)?
        };
        let v = p.create_volume_opts(name, size, opts)?;
        Ok(self.volume_info(&p, &v))
    }

    /// The pool a volume created without one goes to: the node's only pool. With none,
    /// or several, the error says what to do.
    fn only_pool(&self) -> Result<Arc<Pool>> {
        let pools = self.pools().list();
        match pools.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(Error::invalid(
                "this node has no pool: create one first (tessera pool create NAME DEVICE...)",
            )),
            many => Err(Error::invalid(format!(
                "this node has {} pools ({}): say which one with --pool",
                many.len(),
                many.iter()
                    .map(|p| p.name().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// `force`: beyond the pool's overcommit ratio.
    pub fn resize_volume(&self, name: &str, size: u64, force: bool) -> Result<VolumeInfo> {
        let _g = self.admin();
        let (p, v) = self.pools().find_volume(name)?;
        if self.replicas.of(&v).is_some() || self.replicas.blocked(&v).is_some() {
            return Err(Error::invalid(format!(
                "volume '{name}' is replicated: resizing a replicated volume is not supported yet"
            )));
        }
        p.resize_volume_opts(&v, size, force)?;
        Ok(self.volume_info(&p, &v))
    }

    pub fn delete_volume(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        let (p, v) = self.pools().find_volume(name)?;
        if let Some(nqn) = self.nvmf.subsystem_using(&p.uuid(), v.id) {
            return Err(Error::busy(format!(
                "volume '{name}' is a namespace of NVMe subsystem '{nqn}'; remove it first"
            )));
        }
        if let Some(iqn) = self.iscsi.target_using(&p.uuid(), v.id) {
            return Err(Error::busy(format!(
                "volume '{name}' is a LUN of iSCSI target '{iqn}'; delete the target first"
            )));
        }
        if let Some(rv) = self.replicas.of(&v) {
            self.delete_replicated(&rv)?;
        }
        p.delete_volume(&v)?;
        self.groups.forget_volume(name);
        Ok(())
    }

    /// A volume of the pool it was found in.
    pub fn volume(&self, name: &str) -> Result<VolumeInfo> {
        let (p, v) = self.pools().find_volume(name)?;
        Ok(self.volume_info(&p, &v))
    }

    pub fn volume_info(&self, p: &Pool, v: &Volume) -> VolumeInfo {
        let exports: Vec<String> = p
            .exports()
            .into_iter()
            .filter(|e| e.volume_id == v.id)
            .map(|e| e.name)
            .collect();
        VolumeInfo {
            name: v.name.clone(),
            pool: p.name().to_string(),
            id: v.id,
            size: v.size(),
            allocated: v.allocated_bytes(),
            exports,
            connections: v.open_handles(),
            created: v.created,
            qos: self.groups.volume_qos(v).limits(),
            group: self.groups.group_of(&v.name),
            replicas: self.replicas.infos(v),
            snapshot: v.is_snapshot(),
            parent: v.listed_parent().map(|p| p.name.clone()),
            dedup: v.block_mapped(),
        }
    }

    /// Replace a volume's QoS limits (empty limits clear them). Live and persistent.
    pub fn set_volume_qos(&self, name: &str, limits: QosLimits) -> Result<QosLimits> {
        let _g = self.admin();
        let (_, v) = self.pools().find_volume(name)?;
        self.groups.set_volume_qos(&v, limits)
    }

    /// A volume as the protocols export it: the volume and the QoS state its
    /// connections are admitted by.
    pub fn export_of(&self, vol: &Arc<Volume>) -> tessera_export::Export<NodeTarget> {
        tessera_export::Export {
            target: Arc::new(self.target_of(vol)),
            qos: self.groups.volume_qos(vol),
        }
    }

    /// What serves a volume: the volume, or the replicated volume it is the local leg of.
    pub fn target_of(&self, vol: &Arc<Volume>) -> NodeTarget {
        match self.replicas.of(vol) {
            Some(rv) => NodeTarget::Replicated(rv),
            None => NodeTarget::Local(vol.clone()),
        }
    }

    /// A volume's QoS limits.
    pub fn volume_qos(&self, name: &str) -> Result<QosLimits> {
        let (_, v) = self.pools().find_volume(name)?;
        Ok(self.groups.volume_qos(&v).limits())
    }

    /// Client I/O of a volume over a window of `interval`: rates, latency percentiles,
    /// and the cumulative totals since the node started. Blocks for `interval`.
    pub fn volume_stats(&self, name: &str, interval: std::time::Duration) -> Result<VolumeStats> {
        let (_, v) = self.pools().find_volume(name)?;
        let a = v.stats();
        std::thread::sleep(interval);
        let b = v.stats();
        let shares = self.groups.volume_qos(&v).share_figures();
        let secs = interval.as_secs_f64().max(1e-3);
        let rate = |x: u64, y: u64| (y.saturating_sub(x)) as f64 / secs;
        let mib = |x: u64, y: u64| rate(x, y) / 1048576.0;
        let w = b.latency.since(&a.latency);
        let us = |ns: u64| ns as f64 / 1000.0;
        Ok(VolumeStats {
            volume: name.to_string(),
            interval_ms: interval.millis_u64(),
            read_iops: rate(a.reads, b.reads),
            write_iops: rate(a.writes, b.writes),
            other_iops: rate(a.others, b.others),
            read_mibps: mib(a.read_bytes, b.read_bytes),
            write_mibps: mib(a.write_bytes, b.write_bytes),
            errors: b.errors.saturating_sub(a.errors),
            throttled_ms: b.throttled_ns.saturating_sub(a.throttled_ns) as f64 / 1e6,
            latency_us: LatencyWindow {
                requests: w.count(),
                mean: w.mean() / 1000.0,
                p50: us(w.quantile(0.5)),
                p99: us(w.quantile(0.99)),
                p999: us(w.quantile(0.999)),
            },
            totals: IoTotals {
                reads: b.reads,
                writes: b.writes,
                others: b.others,
                read_bytes: b.read_bytes,
                write_bytes: b.write_bytes,
                errors: b.errors,
                throttled_ms: b.throttled_ns as f64 / 1e6,
                shared_units: shares.shared_units,
                share_deferrals: shares.deferrals,
            },
        })
    }

    pub fn list_volumes(&self) -> Vec<VolumeInfo> {
        let mut out = Vec::new();
        for p in self.pools().list() {
            for v in p.volumes() {
                out.push(self.volume_info(&p, &v));
            }
        }
        out
    }
}
