//! QoS groups (tenants): the node's side of crate::groups, and the ladder thread that
//! steps the groups' bursts.

use std::sync::Arc;
use std::time::Instant;

use tessera_api::GroupInfo;
use tracing::error;

use super::{Node, Result};

impl Node {
    /// The stepped-burst control loop of the QoS groups, on its own thread; it stops
    /// when the node is dropped.
    pub(super) fn start_ladder(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tessera-qos-ladder".into())
            .spawn(move || {
                let mut last = Instant::now();
                loop {
                    std::thread::sleep(crate::groups::LADDER_TICK);
                    let Some(node) = weak.upgrade() else { return };
                    let now = Instant::now();
                    node.groups
                        .ladder_tick(now - last, &|n| node.pools().volume(n));
                    last = now;
                }
            });
        if let Err(e) = spawned {
            error!(error = %e, "cannot start the QoS ladder thread");
        }
    }

    pub fn put_group(
        &self,
        name: &str,
        limits: tessera_qos::QosLimits,
        step: Option<tessera_qos::StepBurst>,
    ) -> Result<GroupInfo> {
        let _g = self.admin();
        self.groups.put(name, limits, step)
    }

    pub fn delete_group(&self, name: &str) -> Result<()> {
        let _g = self.admin();
        self.groups.delete(name, |n| self.pools().volume(n))
    }

    pub fn add_group_member(&self, name: &str, volume: &str) -> Result<GroupInfo> {
        let _g = self.admin();
        let (_, v) = self.pools().find_volume(volume)?;
        self.groups.add_member(name, &v)
    }

    pub fn remove_group_member(&self, name: &str, volume: &str) -> Result<GroupInfo> {
        let _g = self.admin();
        self.groups
            .remove_member(name, volume, self.pools().volume(volume))
    }
}
