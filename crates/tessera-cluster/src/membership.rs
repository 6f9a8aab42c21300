//! A node's membership: its record under a lease that a thread keeps alive.
//!
//! The thread renews the lease every third of its TTL and republishes the record when it
//! changes (free capacity moves with every allocation; it is sampled every
//! `publish_every`). When etcd cannot be reached the node keeps running and serving I/O;
//! when the lease turns out to have expired meanwhile, a new one is granted and the record
//! written again. [`Membership::lease_valid_until`] tells how long this node may still
//! assume its lease holds: the send time of the last renewal that etcd answered, plus the
//! TTL it answered with — the lease cannot expire earlier, since etcd starts its TTL
//! clock when it handles the renewal, after it was sent.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_io::sync::MutexExt;

use tracing::{info, warn};

use crate::{node_key, Etcd, Kv, NodeRecord, PrefixCache};

/// How a node takes part in the cluster.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// Lease TTL: how long after its last renewal a silent node disappears.
    pub ttl: Duration,
    /// How often the record is rebuilt and written if it changed.
    pub publish_every: Duration,
}

impl Default for MembershipConfig {
    fn default() -> Self {
        MembershipConfig {
            ttl: Duration::from_secs(5),
            publish_every: Duration::from_secs(2),
        }
    }
}

/// The record source: called on the membership thread.
pub type RecordFn = Box<dyn Fn() -> NodeRecord + Send>;

/// A running membership (stopped, and the lease revoked, by [`Membership::leave`]).
pub struct Membership {
    pub name: String,
    etcd: Etcd,
    lease: AtomicI64,
    valid_until: Mutex<Option<Instant>>,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The volume specs and node records, followed by watches ([`Membership::follow`]).
    caches: std::sync::OnceLock<(PrefixCache, PrefixCache)>,
}

impl Membership {
    /// Register `name` now (a node that cannot reach etcd at start does not start: its
    /// config asks for a cluster) and keep it registered from a thread.
    pub fn join(
        etcd: Etcd,
        cfg: MembershipConfig,
        record: RecordFn,
    ) -> Result<Arc<Membership>, crate::EtcdError> {
        let first = record();
        let name = first.name.clone();
        let ttl = ttl_secs(cfg.ttl);
        let sent = Instant::now();
        let lease = etcd.grant(ttl)?;
        let value = serde_json::to_vec(&first).map_err(|source| crate::EtcdError::Record {
            what: format!("encoding node record {name}"),
            source,
        })?;
        etcd.put(&node_key(&name), &value, lease)?;
        info!(node = %name, lease, ttl_secs = ttl, "joined the cluster");
        let m = Arc::new(Membership {
            name,
            etcd,
            lease: AtomicI64::new(lease),
            valid_until: Mutex::new(Some(sent + Duration::from_secs(ttl.unsigned_abs()))),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            caches: std::sync::OnceLock::new(),
        });
        let me = m.clone();
        let t = std::thread::Builder::new()
            .name("tessera-cluster".into())
            .spawn(move || me.run(cfg, record, value))
            .map_err(|source| crate::EtcdError::Runtime {
                what: "cannot start the membership thread",
                source,
            })?;
        *m.thread.locked() = Some(t);
        Ok(m)
    }

    /// The etcd client the node uses for cluster state.
    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// The current lease id.
    pub fn lease(&self) -> i64 {
        self.lease.load(Acquire)
    }

    /// Until when this node's lease surely holds (None: it may have expired).
    pub fn lease_valid_until(&self) -> Option<Instant> {
        let v = *self.valid_until.locked();
        v.filter(|t| *t > Instant::now())
    }

    fn run(&self, cfg: MembershipConfig, record: RecordFn, mut published: Vec<u8>) {
        let ttl = ttl_secs(cfg.ttl);
        let renew_every = (cfg.ttl / 3).max(Duration::from_millis(100));
        let mut next_publish = Instant::now() + cfg.publish_every;
        let mut lost_logged = false;
        while !self.stop.load(Acquire) {
            std::thread::sleep(renew_every.min(Duration::from_millis(200)));
            // Sleep in short steps so that leave() is prompt; renew on schedule.
            let due = self.valid_until.locked().is_none_or(|t| {
                t.saturating_duration_since(Instant::now()) <= cfg.ttl.saturating_sub(renew_every)
            });
            if !due && Instant::now() < next_publish {
                continue;
            }
            let sent = Instant::now();
            let lease = self.lease();
            match self.etcd.keepalive(lease) {
                Ok(left) if left > 0 => {
                    *self.valid_until.locked() =
                        Some(sent + Duration::from_secs(left.unsigned_abs()));
                    if lost_logged {
                        info!(node = %self.name, "etcd reachable again");
                        lost_logged = false;
                    }
                }
                Ok(_) => {
                    // The lease expired while etcd was away (or was revoked): a new
                    // lease and the record again.
                    warn!(node = %self.name, lease, "cluster lease expired: joining again");
                    match self.etcd.grant(ttl).and_then(|l| {
                        self.etcd
                            .put(&node_key(&self.name), &published, l)
                            .map(|()| l)
                    }) {
                        Ok(l) => {
                            self.lease.store(l, Release);
                            *self.valid_until.locked() = Some(sent + cfg.ttl);
                        }
                        Err(e) => warn!(node = %self.name, error = %e, "cannot join again"),
                    }
                    continue;
                }
                Err(e) => {
                    if !lost_logged {
                        warn!(node = %self.name, error = %e,
                              "etcd unreachable: volumes keep serving, cluster changes wait");
                        lost_logged = true;
                    }
                    continue;
                }
            }
            if Instant::now() >= next_publish {
                next_publish = Instant::now() + cfg.publish_every;
                let rec = record();
                if let Ok(v) = serde_json::to_vec(&rec) {
                    if v != published {
                        match self.etcd.put(&node_key(&self.name), &v, self.lease()) {
                            Ok(()) => published = v,
                            Err(e) => {
                                warn!(node = %self.name, error = %e, "cannot publish the node record")
                            }
                        }
                    }
                }
            }
        }
    }

    /// Leave the cluster: stop renewing and revoke the lease (the record goes at once).
    pub fn leave(&self) {
        self.stop.store(true, Release);
        if let Some(t) = self.thread.locked().take() {
            let _ = t.join();
        }
        if let Err(e) = self.etcd.revoke(self.lease()) {
            warn!(node = %self.name, error = %e, "cannot revoke the cluster lease (it expires by itself)");
        }
        *self.valid_until.locked() = None;
    }

    /// Follow the volume specs and the node records with watches (one listing of each
    /// now, then only changes), for [`Membership::cached_volumes`] and
    /// [`Membership::cached_nodes`]. Idempotent.
    pub fn follow(&self) -> Result<(), crate::EtcdError> {
        if self.caches.get().is_some() {
            return Ok(());
        }
        let v = PrefixCache::start(&self.etcd, &format!("{}volumes/", crate::PREFIX))?;
        let n = PrefixCache::start(&self.etcd, &format!("{}nodes/", crate::PREFIX))?;
        let _ = self.caches.set((v, n));
        Ok(())
    }

    fn caches(&self) -> Option<&(PrefixCache, PrefixCache)> {
        if self.caches.get().is_none() {
            if let Err(e) = self.follow() {
                warn!(node = %self.name, error = %e, "cannot follow the cluster state yet");
            }
        }
        self.caches.get()
    }

    /// Every volume spec's key, as the watch last delivered it (None: not following
    /// etcd right now, as a failed read).
    pub fn cached_volumes(&self) -> Option<Vec<Kv>> {
        self.caches()?.0.snapshot()
    }

    /// Every live node's record, as the watch last delivered it (None: not following
    /// etcd right now).
    pub fn cached_nodes(&self) -> Option<Result<Vec<NodeRecord>, crate::EtcdError>> {
        let kvs = self.caches()?.1.snapshot()?;
        Some(kvs.into_iter().map(|kv| decode_node(&kv)).collect())
    }

    /// Every live node's record.
    pub fn nodes(&self) -> Result<Vec<NodeRecord>, crate::EtcdError> {
        self.etcd
            .list(&format!("{}nodes/", crate::PREFIX))?
            .iter()
            .map(decode_node)
            .collect()
    }
}

fn decode_node(kv: &Kv) -> Result<NodeRecord, crate::EtcdError> {
    serde_json::from_slice(&kv.value).map_err(|source| crate::EtcdError::Record {
        what: format!("bad node record at {}", kv.key),
        source,
    })
}

/// A TTL in whole seconds, at least 2 (etcd's minimum is its election timeout anyway).
fn ttl_secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX).max(2)
}
