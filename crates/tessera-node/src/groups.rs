//! The node's QoS catalog: each volume's limits and QoS groups.
//!
//! Volume limits are stored in `DATA_DIR/volume_qos.json` (docs/format.md §7.1), by volume
//! name, and each volume has one runtime [`VolumeQos`] here that every connection to it
//! is admitted by (the export layer's `Export`). The pools know nothing of QoS; limits
//! that older pool metadata still carries are taken over the first time the volume's
//! QoS is looked up ([`Groups::volume_qos`]).
//!
//! QoS groups (tenants): several volumes share one set of limits, optionally with a
//! stepped burst. Stored in `DATA_DIR/groups.json` (docs/format.md §7), because a group
//! may hold volumes of several pools.
//!
//! Enforcement is the volumes' own machinery: a group is one more [`VolumeQos`] that every
//! member's requests must also pass (see `tessera_qos::gate`), sharded per core and
//! rebalanced like a volume's. The stepped burst is a control loop on a node thread
//! ([`Groups::run_ladder`]) that raises and lowers the group's limits every tick.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

use serde::{Deserialize, Serialize};
use tessera_api::GroupInfo;
use tessera_pool::Volume;

use crate::error::Error;
use tessera_qos::{QosLimits, StepBurst, StepState, VolumeQos};
use tracing::{info, warn};

/// How often the ladder looks at the groups.
pub const LADDER_TICK: Duration = Duration::from_millis(100);

/// A group as stored.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GroupConfig {
    /// The base limits every member's requests share.
    pub limits: QosLimits,
    /// Stepped burst above the base, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepBurst>,
    /// Member volumes, by name.
    #[serde(default)]
    pub members: Vec<String>,
}

struct Group {
    cfg: GroupConfig,
    qos: Arc<VolumeQos>,
    ladder: Option<StepState>,
    /// Member operation totals at the last tick, for the used fraction.
    last_ops: u64,
    last_bytes: u64,
}

pub struct Groups {
    path: PathBuf,
    groups: Mutex<BTreeMap<String, Group>>,
    volumes_path: PathBuf,
    /// Never locked together with `groups`.
    volumes: Mutex<VolumeTable>,
}

/// Per-volume QoS, by volume name.
#[derive(Default)]
struct VolumeTable {
    /// Limits as stored (volumes whose limits were never set are absent).
    stored: BTreeMap<String, QosLimits>,
    /// The runtime state of every volume looked up since the node started.
    live: BTreeMap<String, Arc<VolumeQos>>,
}

fn invalid(msg: String) -> Error {
    Error::invalid(msg)
}

impl Groups {
    pub fn load(data_dir: &Path) -> Result<Groups, Error> {
        let path = data_dir.join("groups.json");
        let stored: BTreeMap<String, GroupConfig> = crate::registry::load_json(&path)?;
        let now = Instant::now();
        let groups = stored
            .into_iter()
            .map(|(name, cfg)| {
                let g = Group {
                    qos: Arc::new(VolumeQos::new(cfg.limits.clone(), now)),
                    ladder: cfg.step.as_ref().map(StepState::new),
                    cfg,
                    last_ops: 0,
                    last_bytes: 0,
                };
                (name, g)
            })
            .collect();
        let volumes_path = data_dir.join("volume_qos.json");
        let stored: BTreeMap<String, QosLimits> = crate::registry::load_json(&volumes_path)?;
        Ok(Groups {
            path,
            groups: Mutex::new(groups),
            volumes_path,
            volumes: Mutex::new(VolumeTable {
                stored,
                live: BTreeMap::new(),
            }),
        })
    }

    fn volumes(&self) -> std::sync::MutexGuard<'_, VolumeTable> {
        self.volumes.locked()
    }

    fn save_volumes(&self, t: &VolumeTable) -> Result<(), Error> {
        let text = serde_json::to_string_pretty(&t.stored).expect("volume limits serialise");
        crate::registry::write_atomic(&self.volumes_path, text.as_bytes()).map_err(Error::from)
    }

    /// The QoS state every connection to `volume` is admitted by (one per volume, made on
    /// first use, bound to the volume's group if it has one). Limits the volume's pool
    /// metadata still carries from an older version are moved into the catalog here.
    pub fn volume_qos(&self, volume: &Volume) -> Arc<VolumeQos> {
        let qos = {
            let mut t = self.volumes();
            if let Some(q) = t.live.get(&volume.name) {
                return q.clone();
            }
            if !t.stored.contains_key(&volume.name) {
                if let Some(l) = volume.legacy_qos() {
                    t.stored.insert(volume.name.clone(), l);
                    match self.save_volumes(&t) {
                        Ok(()) => {
                            info!(volume = %volume.name, "qos: limits moved from pool metadata to the node's catalog");
                            volume.clear_legacy_qos();
                        }
                        // Served from memory; the pool keeps them, the next start retries.
                        Err(e) => {
                            warn!(volume = %volume.name, error = %e, "qos: cannot save migrated limits")
                        }
                    }
                }
            }
            let limits = t.stored.get(&volume.name).cloned().unwrap_or_default();
            let q = Arc::new(VolumeQos::new(limits, Instant::now()));
            t.live.insert(volume.name.clone(), q.clone());
            q
        };
        let group = self
            .lock()
            .values()
            .find(|g| g.cfg.members.contains(&volume.name))
            .map(|g| g.qos.clone());
        if group.is_some() {
            qos.set_group(group);
        }
        qos
    }

    /// Replace a volume's limits (empty limits clear them): live at once and persistent.
    /// Returns the limits now in force.
    pub fn set_volume_qos(&self, volume: &Volume, limits: QosLimits) -> Result<QosLimits, Error> {
        limits.validate()?;
        let qos = self.volume_qos(volume);
        let mut t = self.volumes();
        // Cleared limits stay as an entry: the catalog, not limits an older version may
        // have left in the pool's metadata (not yet rewritten there), decides.
        let before = t.stored.insert(volume.name.clone(), limits.clone());
        if let Err(e) = self.save_volumes(&t) {
            match before {
                Some(l) => t.stored.insert(volume.name.clone(), l),
                None => t.stored.remove(&volume.name),
            };
            return Err(e);
        }
        qos.set_limits(limits);
        Ok(qos.limits())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Group>> {
        self.groups.locked()
    }

    fn save(&self, groups: &BTreeMap<String, Group>) -> Result<(), Error> {
        let stored: BTreeMap<&String, &GroupConfig> =
            groups.iter().map(|(n, g)| (n, &g.cfg)).collect();
        let text = serde_json::to_string_pretty(&stored).expect("groups serialise");
        crate::registry::write_atomic(&self.path, text.as_bytes()).map_err(Error::from)
    }

    /// The group a volume belongs to, if any.
    pub fn group_of(&self, volume: &str) -> Option<String> {
        self.lock()
            .iter()
            .find(|(_, g)| g.cfg.members.iter().any(|m| m == volume))
            .map(|(n, _)| n.clone())
    }

    /// Bind every existing member volume to its group (at start, and after a volume
    /// with a member's name appears). `find` resolves a volume name.
    pub fn bind_all(&self, find: impl Fn(&str) -> Option<Arc<Volume>>) {
        let members: Vec<(String, Arc<VolumeQos>)> = self
            .lock()
            .values()
            .flat_map(|g| g.cfg.members.iter().map(|m| (m.clone(), g.qos.clone())))
            .collect();
        for (m, group) in members {
            if let Some(v) = find(&m) {
                self.volume_qos(&v).set_group(Some(group));
            }
        }
    }

    /// Create a group or replace its limits and ladder (members are kept).
    pub fn put(
        &self,
        name: &str,
        limits: QosLimits,
        step: Option<StepBurst>,
    ) -> Result<GroupInfo, Error> {
        if name.is_empty() || name.len() > 128 || name.contains('/') {
            return Err(invalid(format!(
                "group name '{name}' must be 1-128 characters without '/'"
            )));
        }
        limits.validate()?;
        if limits.has_scheduling() {
            return Err(invalid(
                "weight and reads_first are per volume, not per group".into(),
            ));
        }
        if let Some(s) = &step {
            s.validate()?;
            if limits.is_unlimited() {
                return Err(invalid(
                    "a stepped burst needs a limit to step above".into(),
                ));
            }
        }
        let mut groups = self.lock();
        let before = groups.get(name).map(|g| g.cfg.clone());
        match groups.get_mut(name) {
            Some(g) => {
                g.cfg.limits = limits.clone();
                g.cfg.step = step;
                g.ladder = step.as_ref().map(StepState::new);
                g.qos.set_limits(limits);
            }
            None => {
                groups.insert(
                    name.to_string(),
                    Group {
                        qos: Arc::new(VolumeQos::new(limits.clone(), Instant::now())),
                        ladder: step.as_ref().map(StepState::new),
                        cfg: GroupConfig {
                            limits,
                            step,
                            members: Vec::new(),
                        },
                        last_ops: 0,
                        last_bytes: 0,
                    },
                );
            }
        }
        if let Err(e) = self.save(&groups) {
            // Keep memory and disk in step: undo.
            match before {
                Some(cfg) => {
                    let g = groups.get_mut(name).expect("just updated");
                    g.qos.set_limits(cfg.limits.clone());
                    g.ladder = cfg.step.as_ref().map(StepState::new);
                    g.cfg = cfg;
                }
                None => {
                    groups.remove(name);
                }
            }
            return Err(e);
        }
        Ok(group_json(name, &groups[name]))
    }

    /// Delete a group; its members go back to their own limits only.
    pub fn delete(
        &self,
        name: &str,
        find: impl Fn(&str) -> Option<Arc<Volume>>,
    ) -> Result<(), Error> {
        let mut groups = self.lock();
        let g = groups
            .remove(name)
            .ok_or_else(|| Error::not_found(format!("group '{name}' not found")))?;
        if let Err(e) = self.save(&groups) {
            groups.insert(name.to_string(), g);
            return Err(e);
        }
        drop(groups);
        for m in &g.cfg.members {
            if let Some(v) = find(m) {
                self.volume_qos(&v).set_group(None);
            }
        }
        Ok(())
    }

    /// Put `volume` in group `name` (leaving any other group).
    pub fn add_member(&self, name: &str, volume: &Arc<Volume>) -> Result<GroupInfo, Error> {
        // Before the group lock: looking up the volume's QoS may take it.
        let qos = self.volume_qos(volume);
        let mut groups = self.lock();
        if !groups.contains_key(name) {
            return Err(Error::not_found(format!("group '{name}' not found")));
        }
        let saved: Vec<(String, Vec<String>)> = groups
            .iter()
            .map(|(n, g)| (n.clone(), g.cfg.members.clone()))
            .collect();
        for g in groups.values_mut() {
            g.cfg.members.retain(|m| *m != volume.name);
        }
        let g = groups.get_mut(name).expect("checked");
        g.cfg.members.push(volume.name.clone());
        g.cfg.members.sort();
        if let Err(e) = self.save(&groups) {
            for (n, members) in saved {
                if let Some(g) = groups.get_mut(&n) {
                    g.cfg.members = members;
                }
            }
            return Err(e);
        }
        qos.set_group(Some(groups[name].qos.clone()));
        Ok(group_json(name, &groups[name]))
    }

    /// Take `volume` out of group `name`.
    pub fn remove_member(
        &self,
        name: &str,
        volume: &str,
        v: Option<Arc<Volume>>,
    ) -> Result<GroupInfo, Error> {
        let qos = v.map(|v| self.volume_qos(&v));
        let mut groups = self.lock();
        let g = groups
            .get_mut(name)
            .ok_or_else(|| Error::not_found(format!("group '{name}' not found")))?;
        let Some(i) = g.cfg.members.iter().position(|m| m == volume) else {
            return Err(Error::not_found(format!(
                "volume '{volume}' is not a member of group '{name}'"
            )));
        };
        g.cfg.members.remove(i);
        if let Err(e) = self.save(&groups) {
            let g = groups.get_mut(name).expect("present");
            g.cfg.members.insert(i, volume.to_string());
            return Err(e);
        }
        if let Some(q) = qos {
            q.set_group(None);
        }
        Ok(group_json(name, &groups[name]))
    }

    /// A volume was deleted: forget its limits and memberships (a later volume of the
    /// same name must not inherit them).
    pub fn forget_volume(&self, volume: &str) {
        {
            let mut t = self.volumes();
            t.live.remove(volume);
            if t.stored.remove(volume).is_some() {
                if let Err(e) = self.save_volumes(&t) {
                    warn!(volume, error = %e, "qos: cannot save the volume limits");
                }
            }
        }
        let mut groups = self.lock();
        let mut changed = false;
        for g in groups.values_mut() {
            let n = g.cfg.members.len();
            g.cfg.members.retain(|m| m != volume);
            changed |= g.cfg.members.len() != n;
        }
        if changed {
            if let Err(e) = self.save(&groups) {
                warn!(error = %e, "qos: cannot save the groups");
            }
        }
    }

    pub fn get(&self, name: &str) -> Result<GroupInfo, Error> {
        let groups = self.lock();
        groups
            .get(name)
            .map(|g| group_json(name, g))
            .ok_or_else(|| Error::not_found(format!("group '{name}' not found")))
    }

    pub fn list(&self) -> Vec<GroupInfo> {
        let groups = self.lock();
        groups.iter().map(|(n, g)| group_json(n, g)).collect()
    }

    /// One ladder tick: for every group with a stepped burst, measure how much of its
    /// base the members used since the last tick and whether the group is being held at
    /// its limit, and step its limits up or down. `find` resolves member names.
    pub fn ladder_tick(&self, elapsed: Duration, find: &dyn Fn(&str) -> Option<Arc<Volume>>) {
        let now = Instant::now();
        let mut groups = self.lock();
        for g in groups.values_mut() {
            let (Some(step), Some(ladder)) = (g.cfg.step, g.ladder.as_mut()) else {
                continue;
            };
            let (mut ops, mut bytes) = (0u64, 0u64);
            for m in &g.cfg.members {
                if let Some(v) = find(m) {
                    let s = v.stats();
                    ops += s.reads + s.writes;
                    bytes += s.read_bytes + s.write_bytes;
                }
            }
            let (d_ops, d_bytes) = (
                ops.saturating_sub(g.last_ops),
                bytes.saturating_sub(g.last_bytes),
            );
            g.last_ops = ops;
            g.last_bytes = bytes;
            let secs = elapsed.as_secs_f64().max(1e-3);
            // Used fraction of the base: the tightest of the combined limits.
            let l = &g.cfg.limits;
            let mut used: f64 = 0.0;
            if let Some(i) = l.iops.or(l.write_iops).or(l.read_iops) {
                used = used.max(d_ops as f64 / secs / i as f64);
            }
            if let Some(b) = l.bps.or(l.write_bps).or(l.read_bps) {
                used = used.max(d_bytes as f64 / secs / b as f64);
            }
            let throttled = g.qos.throttled_now(now);
            if let Some(level) = ladder.observe(&step, elapsed, used, throttled) {
                g.qos.set_limits(step.scaled(&g.cfg.limits, level));
            }
        }
    }
}

fn group_json(name: &str, g: &Group) -> GroupInfo {
    GroupInfo {
        name: name.to_string(),
        limits: g.cfg.limits.clone(),
        step: g.cfg.step,
        members: g.cfg.members.clone(),
        level: g.ladder.as_ref().map(|l| l.level()),
        credits_ms: g.ladder.as_ref().map(|l| l.credits_ms().round()),
        effective: g.qos.limits(),
    }
}
