//! Asymmetric logical unit access (SPC-4 §5.16, implicit ALUA) for a target served by
//! several nodes: the same target name and LUN 0 on each node that holds a replica of a
//! cluster volume, each node's port its own target port group. The owner's group is
//! active/optimized and its LUN is backed by the volume; the others are standby, hold no
//! data and refuse media access (NOT READY, LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN
//! STANDBY STATE). A host reads REPORT TARGET PORT GROUPS to learn every group's state
//! and follows a change when it is told of one (ASYMMETRIC ACCESS STATE CHANGED).
//!
//! One [`Alua`] per cluster target on a node, shared by every connection serving it:
//! each command loads two counters (one atomic load each) to see whether the states or
//! the backing changed since the connection last looked.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, RwLock};

use tessera_export::Export;
use tessera_io::sync::RwLockExt;

use crate::lu::LuShared;
use crate::pdu::{put_u16, put_u32};
use crate::scsi::Sense;

/// ASYMMETRIC ACCESS STATE values (SPC-4 table 307) this target reports.
pub const ACTIVE_OPTIMIZED: u8 = 0x0;
pub const STANDBY: u8 = 0x2;

/// The supported-states bits of every group: AO_SUP and S_SUP.
const SUPPORTED_STATES: u8 = 0x01 | 0x04;

/// Seconds a host should allow for an implicit transition (the extended header's
/// IMPLICIT TRANSITION TIME): a takeover waits out the old owner's lease.
pub const IMPLICIT_TRANSITION_TIME_S: u8 = 30;

/// NOT READY, LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY STATE (04h/0Bh).
pub const STANDBY_SENSE: Sense = Sense {
    key: crate::scsi::NOT_READY,
    asc: 0x04,
    ascq: 0x0b,
    info: None,
    field: None,
};

/// NOT READY, LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION
/// (04h/0Ah): the port is becoming active and still has commands of its standby
/// backing to finish; the host retries.
pub const TRANSITION_SENSE: Sense = Sense {
    key: crate::scsi::NOT_READY,
    asc: 0x04,
    ascq: 0x0a,
    info: None,
    field: None,
};

/// UNIT ATTENTION, ASYMMETRIC ACCESS STATE CHANGED (2Ah/06h).
pub const STATE_CHANGED: Sense = Sense {
    key: crate::scsi::UNIT_ATTENTION,
    asc: 0x2a,
    ascq: 0x06,
    info: None,
    field: None,
};

/// One target port group as REPORT TARGET PORT GROUPS lists it: one port each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortGroup {
    pub id: u16,
    /// The RELATIVE TARGET PORT IDENTIFIER of the group's one port.
    pub rel_port: u16,
    pub state: u8,
}

struct Inner<T> {
    /// The volume, while this port's group is active/optimized.
    export: Option<Export<T>>,
    /// The other nodes' groups.
    others: Vec<PortGroup>,
}

/// A cluster target's ALUA state on this node (see the module documentation).
pub struct Alua<T> {
    /// This node's port: its group and relative target port identifier.
    pub group: u16,
    pub rel_port: u16,
    /// The volume's size in bytes, the same on every path.
    pub size: u64,
    /// Reservations and COMPARE AND WRITE ranges of the LUN on this node: kept across
    /// changes of the backing.
    pub shared: Arc<LuShared>,
    inner: RwLock<Inner<T>>,
    /// This group's state.
    state: AtomicU8,
    /// Bumped whenever a state any group reports changes (unit attentions).
    states_gen: AtomicU64,
    /// Bumped whenever the backing changes (connections re-open their handle).
    backing_gen: AtomicU64,
}

impl<T> Alua<T> {
    /// A standby port of group `group` (relative port `rel_port`) for a LUN of `size`
    /// bytes.
    pub fn new(group: u16, rel_port: u16, size: u64) -> Arc<Alua<T>> {
        Arc::new(Alua {
            group,
            rel_port,
            size,
            shared: Arc::new(LuShared::default()),
            inner: RwLock::new(Inner {
                export: None,
                others: Vec::new(),
            }),
            state: AtomicU8::new(STANDBY),
            states_gen: AtomicU64::new(1),
            backing_gen: AtomicU64::new(1),
        })
    }

    /// This port's group state.
    pub fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }

    pub fn states_generation(&self) -> u64 {
        self.states_gen.load(Ordering::Acquire)
    }

    pub fn backing_generation(&self) -> u64 {
        self.backing_gen.load(Ordering::Acquire)
    }

    /// The volume backing the LUN (None on a standby port).
    pub fn export(&self) -> Option<Export<T>> {
        self.inner.read_locked().export.clone()
    }

    /// Attach the volume, then turn active/optimized: no command is let through before
    /// the data is there. The volume has one owner: any other group still reported
    /// active/optimized (the old owner's, until the cluster's record says otherwise)
    /// is reported standby from now on.
    pub fn set_active(&self, export: Export<T>) {
        {
            let mut i = self.inner.write_locked();
            i.export = Some(export);
            self.backing_gen.fetch_add(1, Ordering::AcqRel);
            let mut demoted = false;
            for g in i.others.iter_mut().filter(|g| g.state != STANDBY) {
                g.state = STANDBY;
                demoted = true;
            }
            if demoted {
                self.states_gen.fetch_add(1, Ordering::AcqRel);
            }
        }
        if self.state.swap(ACTIVE_OPTIMIZED, Ordering::AcqRel) != ACTIVE_OPTIMIZED {
            self.states_gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Turn standby, then let the volume go: every media access from now on is refused
    /// before it reaches the data.
    pub fn set_standby(&self) {
        if self.state.swap(STANDBY, Ordering::AcqRel) != STANDBY {
            self.states_gen.fetch_add(1, Ordering::AcqRel);
        }
        let mut i = self.inner.write_locked();
        if i.export.take().is_some() {
            self.backing_gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Replace the other nodes' groups (this node's own is left out of `others`).
    /// Hosts are told (a unit attention) only when a state they can read changed. While
    /// this group is active/optimized, every other is reported standby.
    pub fn set_other_groups(&self, mut others: Vec<PortGroup>) {
        others.retain(|g| g.id != self.group);
        if self.state() == ACTIVE_OPTIMIZED {
            for g in &mut others {
                g.state = STANDBY;
            }
        }
        others.sort_by_key(|g| g.id);
        let mut i = self.inner.write_locked();
        if i.others == others {
            return;
        }
        let changed = others.len() != i.others.len()
            || others
                .iter()
                .zip(&i.others)
                .any(|(a, b)| a.id != b.id || a.state != b.state);
        i.others = others;
        if changed {
            self.states_gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Every group, in group order, this node's with its current state.
    pub fn groups(&self) -> Vec<PortGroup> {
        let mut g = self.inner.read_locked().others.clone();
        g.push(PortGroup {
            id: self.group,
            rel_port: self.rel_port,
            state: self.state(),
        });
        g.sort_by_key(|g| g.id);
        g
    }
}

/// REPORT TARGET PORT GROUPS parameter data (SPC-4 §6.37): the length-only header, or
/// with `extended` the extended header (format type 1, the implicit transition time);
/// then one descriptor per group, each with its one port.
pub fn report_target_port_groups(groups: &[PortGroup], extended: bool) -> Vec<u8> {
    let head = if extended { 8 } else { 4 };
    let mut d = vec![0u8; head];
    if extended {
        d[4] = 0x10;
        d[5] = IMPLICIT_TRANSITION_TIME_S;
    }
    for g in groups {
        let mut desc = [0u8; 12];
        // PREF 0; the state; AO_SUP and S_SUP.
        desc[0] = g.state & 0x0f;
        desc[1] = SUPPORTED_STATES;
        put_u16(&mut desc, 2, g.id);
        // STATUS CODE: 2 once a state came from the target's own (implicit) change.
        desc[5] = 0x02;
        desc[7] = 1; // TARGET PORT COUNT
        put_u16(&mut desc, 10, g.rel_port);
        d.extend_from_slice(&desc);
    }
    let n = u32::try_from(d.len() - 4).unwrap_or(u32::MAX);
    put_u32(&mut d, 0, n);
    d
}

/// The target port group and relative target port identifier of the node named
/// `node`: derived from the name alone, so every node computes the same for it (the
/// same value for both; 1..=0xFFFF, 0 being reserved for the relative port).
pub fn group_of(node: &str) -> u16 {
    let h = crc32c::crc32c(node.as_bytes());
    let folded = (h >> 16) ^ (h & 0xffff);
    let g = u16::try_from(folded).unwrap_or(1);
    if g == 0 {
        1
    } else {
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    #[test]
    fn states_flip_in_order_and_count_changes() {
        let a: Arc<Alua<Nothing>> = Alua::new(7, 7, 1 << 20);
        assert_eq!(a.state(), STANDBY);
        let (s0, b0) = (a.states_generation(), a.backing_generation());
        a.set_other_groups(vec![PortGroup {
            id: 3,
            rel_port: 3,
            state: ACTIVE_OPTIMIZED,
        }]);
        assert_eq!(a.states_generation(), s0 + 1);
        // The same list again: nothing to tell.
        a.set_other_groups(vec![PortGroup {
            id: 3,
            rel_port: 3,
            state: ACTIVE_OPTIMIZED,
        }]);
        assert_eq!(a.states_generation(), s0 + 1);
        a.set_standby();
        assert_eq!(a.backing_generation(), b0, "no backing to let go");
        // Active here: the other group is reported standby, whatever it was told.
        a.set_active(Export {
            target: Arc::new(Nothing),
            qos: Arc::new(tessera_export::VolumeQos::new(
                tessera_qos::QosLimits::default(),
                std::time::Instant::now(),
            )),
        });
        assert_eq!(a.backing_generation(), b0 + 1);
        assert_eq!(a.state(), ACTIVE_OPTIMIZED);
        assert_eq!(a.groups()[0].state, STANDBY);
        let s1 = a.states_generation();
        assert!(s1 > s0 + 1);
        a.set_other_groups(vec![PortGroup {
            id: 3,
            rel_port: 3,
            state: ACTIVE_OPTIMIZED,
        }]);
        assert_eq!((a.groups()[0].state, a.states_generation()), (STANDBY, s1));
        a.set_standby();
        assert!(a.export().is_none());
        assert_eq!(a.backing_generation(), b0 + 2);
        a.set_other_groups(vec![PortGroup {
            id: 3,
            rel_port: 3,
            state: ACTIVE_OPTIMIZED,
        }]);
        let g = a.groups();
        assert_eq!(g.iter().map(|g| g.id).collect::<Vec<_>>(), vec![3, 7]);
        assert_eq!(g[1].state, STANDBY);
        let d = report_target_port_groups(&g, true);
        assert_eq!(d.len(), 8 + 2 * 12);
        assert_eq!(u32::from_be_bytes([d[0], d[1], d[2], d[3]]), 4 + 24);
        assert_eq!(d[4], 0x10);
        assert_eq!((d[8] & 0x0f, d[9], d[10], d[11]), (0, 0x05, 0, 3));
        assert_eq!((d[20] & 0x0f, d[22], d[23], d[27]), (2, 0, 7, 1));
        assert_eq!((d[30], d[31]), (0, 7));
        let short = report_target_port_groups(&g, false);
        assert_eq!(short.len(), 4 + 24);
        assert_eq!(short[4..], d[8..]);
    }

    #[test]
    fn groups_are_stable_and_non_zero() {
        assert_eq!(group_of("n1"), group_of("n1"));
        assert_ne!(group_of("n1"), group_of("n2"));
        for n in ["", "a", "node-17"] {
            assert_ne!(group_of(n), 0);
        }
    }
}
