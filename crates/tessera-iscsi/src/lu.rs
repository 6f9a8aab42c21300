//! What every iSCSI connection (on every core) serving one volume shares.
//!
//! - COMPARE AND WRITE's and ORWRITE's atomicity: the block range such a command holds
//!   from the start of its read to the end of its write. While a range is held,
//!   another COMPARE AND WRITE, ORWRITE, WRITE or WRITE SAME from iSCSI that overlaps it
//!   is answered BUSY (the initiator retries), so no iSCSI write lands between the read
//!   and the write. Writes already in flight when the range is taken, and writes from
//!   NBD or NVMe/TCP, are not ordered by it.
//! - Persistent reservations ([`crate::pr`]): registrations and the reservation of the
//!   unit, for every I_T nexus. Commands look at them only while a reservation exists:
//!   a unit without one pays one atomic load per command.
//! - The SPC-2 reservation (RESERVE(6) / RELEASE(6)): the one I_T nexus that holds the
//!   whole unit, until it releases it, its session ends, or a LUN or target reset.
//!   Also one atomic load per command while there is none.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use crate::scsi::Sense;
use std::sync::{Arc, Mutex, Weak};

use tessera_io::sync::MutexExt;

use crate::pr::{Access, Nexus, PrError, PrState, ProutRequest};
use crate::scsi::Command;

/// Saves the serialized reservation state ([`PrState::to_bytes`]) where it survives a
/// restart, for the units whose last REGISTER set APTPL; an error says why it could not
/// (the caller's own error type, kept as it is: the target only logs it).
pub type Persist = Box<dyn Fn(&[u8]) -> Result<(), PersistError> + Send + Sync>;

/// Why a [`Persist`] could not save the state.
pub type PersistError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Default)]
pub struct LuShared {
    /// How many ranges are held: writes look at the table only when it is non-zero, so
    /// a volume without COMPARE AND WRITE pays one atomic load per write.
    count: AtomicUsize,
    /// Held ranges: (first block, blocks).
    held: Mutex<Vec<(u64, u64)>>,
    /// The reservation's type, 0 while there is none: commands look at `pr` only when
    /// it is non-zero (changed under `pr`'s lock).
    reserved: AtomicU8,
    pr: Mutex<PrState>,
    persist: Mutex<Option<Persist>>,
    /// Unit attentions not yet reported, oldest first, at most one per I_T nexus and
    /// sense ([`LuShared::take_unit_attention`]); commands look at the list only while
    /// `attentions` is non-zero.
    attentions: AtomicUsize,
    pending: Mutex<Vec<(Nexus, Sense)>>,
    /// Whether `legacy` holds a nexus (changed under its lock).
    legacy_held: AtomicBool,
    /// The state is carried (`set_carried`): saved at every change, APTPL or not.
    carried: AtomicBool,
    /// The holder of the SPC-2 reservation.
    legacy: Mutex<Option<Nexus>>,
}

/// What an SPC-2 reservation lets other I_T nexuses do: only what tells them about the
/// unit (SPC-2 §5.5.1), and RELEASE(6), which does nothing for them. Everything else,
/// persistent reservation commands included (SPC-3 §5.6.3), meets RESERVATION CONFLICT.
fn allowed_under_legacy(c: &Command) -> bool {
    matches!(
        c,
        Command::Inquiry { .. }
            | Command::ReportLuns { .. }
            | Command::RequestSense { .. }
            | Command::ReportOpcodes(_)
            | Command::ReportTargetPortGroups { .. }
            | Command::Release6
    )
}

/// Unit attentions kept at most (the oldest go first past it): a bound on what
/// nexuses that never come back can leave behind.
const MAX_ATTENTIONS: usize = 4096;

fn overlap(a: (u64, u64), lba: u64, blocks: u64) -> bool {
    a.0 < lba.saturating_add(blocks) && lba < a.0.saturating_add(a.1)
}

impl LuShared {
    /// The table of the volume whose export target has identity `key`.
    pub fn of(key: usize) -> Arc<LuShared> {
        static TABLES: Mutex<Vec<(usize, Weak<LuShared>)>> = Mutex::new(Vec::new());
        let mut t = TABLES.locked();
        t.retain(|(_, w)| w.strong_count() > 0);
        if let Some(l) = t
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return l;
        }
        let l = Arc::new(LuShared::default());
        t.push((key, Arc::downgrade(&l)));
        l
    }

    /// Hold `[lba, lba+blocks)`, unless an overlapping range is held.
    pub fn try_take(&self, lba: u64, blocks: u64) -> bool {
        let mut h = self.held.locked();
        if h.iter().any(|&r| overlap(r, lba, blocks)) {
            return false;
        }
        h.push((lba, blocks));
        self.count.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Let go of a range [`try_take`](Self::try_take) took.
    pub fn release(&self, lba: u64, blocks: u64) {
        let mut h = self.held.locked();
        if let Some(i) = h.iter().position(|&r| r == (lba, blocks)) {
            h.swap_remove(i);
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A write to `[lba, lba+blocks)` would land inside a held range.
    pub fn busy(&self, lba: u64, blocks: u64) -> bool {
        if self.count.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.held.locked().iter().any(|&r| overlap(r, lba, blocks))
    }

    /// Whether a command of class `access` from nexus `n` meets a RESERVATION
    /// CONFLICT.
    pub fn pr_conflict(&self, n: &Nexus, access: Access) -> bool {
        let t = self.reserved.load(Ordering::Acquire);
        if t == 0 || access == Access::Free {
            return false;
        }
        // Write Exclusive types let everyone read.
        if access == Access::Read && matches!(t, 1 | 5 | 7) {
            return false;
        }
        self.pr.locked().conflicts(n, access)
    }

    /// Whether command `c` from nexus `n` meets the SPC-2 reservation of another nexus;
    /// and, while one is held, every persistent reservation command, from the holder
    /// too (SPC-3 §5.6.3).
    pub fn legacy_conflict(&self, n: &Nexus, c: &Command) -> bool {
        if !self.legacy_held.load(Ordering::Acquire) {
            return false;
        }
        let holder = self.legacy.locked();
        match holder.as_ref() {
            None => false,
            Some(_)
                if matches!(
                    c,
                    Command::PersistentReserveIn { .. } | Command::PersistentReserveOut { .. }
                ) =>
            {
                true
            }
            Some(h) => h != n && !allowed_under_legacy(c),
        }
    }

    /// RESERVE(6) from nexus `n`: the unit becomes `n`'s (again, if it was). Refused
    /// (RESERVATION CONFLICT) while another nexus holds it, and while any nexus is
    /// registered for persistent reservations (SPC-3 §5.6.3: the two kinds exclude each
    /// other).
    pub fn reserve6(&self, n: &Nexus) -> Result<(), PrError> {
        let pr = self.pr.locked();
        if pr.has_registrations() {
            return Err(PrError::Conflict);
        }
        let mut holder = self.legacy.locked();
        match holder.as_ref() {
            Some(h) if h != n => Err(PrError::Conflict),
            _ => {
                *holder = Some(n.clone());
                self.legacy_held.store(true, Ordering::Release);
                Ok(())
            }
        }
    }

    /// RELEASE(6) from nexus `n`: ends `n`'s reservation; from any other nexus, or with
    /// none held, it does nothing (and succeeds). Refused while nexuses are registered
    /// for persistent reservations.
    pub fn release6(&self, n: &Nexus) -> Result<(), PrError> {
        if self.pr.locked().has_registrations() {
            return Err(PrError::Conflict);
        }
        self.drop_legacy(Some(n));
        Ok(())
    }

    /// End the SPC-2 reservation: `n`'s only (its session ended), or whoever holds it
    /// (`None`: a LUN or target reset).
    pub fn drop_legacy(&self, n: Option<&Nexus>) {
        if !self.legacy_held.load(Ordering::Acquire) {
            return;
        }
        let mut holder = self.legacy.locked();
        if n.is_none() || holder.as_ref() == n {
            *holder = None;
            self.legacy_held.store(false, Ordering::Release);
        }
    }

    /// PERSISTENT RESERVE IN: the whole data of service action `sa`. REPORT
    /// CAPABILITIES says APTPL is supported (PTPL_C) only while a [`Persist`] is
    /// installed.
    pub fn pr_in(&self, sa: u8) -> Result<Vec<u8>, crate::scsi::Sense> {
        let mut d = self.pr.locked().prin(sa)?;
        if sa == crate::pr::REPORT_CAPABILITIES && self.persist.locked().is_none() {
            d[2] &= !0x01;
        }
        Ok(d)
    }

    /// PERSISTENT RESERVE OUT from nexus `n`. A change is saved through the installed
    /// [`Persist`] when APTPL is (or was) set, before it takes effect and the command
    /// completes; a failed save fails the command (INTERNAL TARGET FAILURE).
    /// Without one installed, APTPL set is an invalid field in the parameter list
    /// (SPC-4 §6.16.4: PTPL_C is 0).
    pub fn pr_out(&self, n: &Nexus, req: &ProutRequest) -> Result<(), PrError> {
        if req.aptpl && self.persist.locked().is_none() {
            return Err(PrError::Check(
                crate::scsi::Sense::INVALID_FIELD_IN_PARAMETER_LIST,
            ));
        }
        let mut pr = self.pr.locked();
        // The change is made on a copy and takes effect only once saved (when APTPL
        // asks for it): a save that fails refuses the command and changes nothing, so
        // what the initiator was told survives a restart.
        let mut next = pr.clone();
        let changed = next.prout(n, req)?;
        if changed && (self.carried.load(Ordering::Acquire) || pr.aptpl() || next.aptpl()) {
            if let Some(p) = self.persist.locked().as_ref() {
                if let Err(e) = p(&next.to_bytes()) {
                    tracing::error!(error = %e, "iscsi: reservation state not saved; PERSISTENT RESERVE OUT refused");
                    return Err(PrError::Check(crate::scsi::Sense::INTERNAL_TARGET_FAILURE));
                }
            }
        }
        let before = std::mem::replace(&mut *pr, next);
        self.reserved
            .store(pr.reservation_type(), Ordering::Release);
        let ua = pr.attentions(&before, n, req);
        if !ua.is_empty() {
            let mut p = self.pending.locked();
            for a in ua {
                if !p.contains(&a) {
                    p.push(a);
                }
            }
            let over = p.len().saturating_sub(MAX_ATTENTIONS);
            p.drain(..over);
            self.attentions.store(p.len(), Ordering::Release);
        }
        Ok(())
    }

    /// The oldest unit attention waiting for nexus `n`, taken: the next command of
    /// that nexus reports it (CHECK CONDITION, UNIT ATTENTION) instead of running.
    pub fn take_unit_attention(&self, n: &Nexus) -> Option<Sense> {
        if self.attentions.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut p = self.pending.locked();
        let i = p.iter().position(|(x, _)| x == n)?;
        let (_, sense) = p.remove(i);
        self.attentions.store(p.len(), Ordering::Release);
        Some(sense)
    }

    /// Install what saves the reservation state when APTPL is set.
    pub fn set_persist(&self, p: Persist) {
        *self.persist.locked() = Some(p);
    }

    /// Install what saves the reservation state at every change, APTPL set or not: a
    /// state that must follow its unit to another target (a cluster volume's, to its
    /// next owner), where a failover is not a power loss and registrations survive it.
    pub fn set_carried(&self, p: Persist) {
        *self.persist.locked() = Some(p);
        self.carried.store(true, Ordering::Release);
    }

    /// Replace the reservation state with `bytes` ([`PrState::to_bytes`]; empty: no
    /// registration, no reservation), whatever its APTPL: a carried state taken over.
    /// Unit attentions pending for the old state's nexuses are dropped.
    pub fn restore(&self, bytes: &[u8]) -> Result<(), &'static str> {
        let s = if bytes.is_empty() {
            PrState::default()
        } else {
            PrState::from_bytes(bytes)?
        };
        let mut pr = self.pr.locked();
        self.reserved.store(s.reservation_type(), Ordering::Release);
        *pr = s;
        self.pending.locked().clear();
        self.attentions.store(0, Ordering::Release);
        Ok(())
    }

    /// Restore a state [`Persist`] saved (at start, before connections serve the
    /// unit). A state saved without APTPL (the last REGISTER cleared it) restores
    /// nothing: the unit keeps the state it has.
    pub fn load_persisted(&self, bytes: &[u8]) -> Result<(), &'static str> {
        let s = PrState::from_bytes(bytes)?;
        if !s.aptpl() {
            return Ok(());
        }
        let mut pr = self.pr.locked();
        self.reserved.store(s.reservation_type(), Ordering::Release);
        *pr = s;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PERSISTENT RESERVE OUT request of service action `sa` (scope 0).
    #[test]
    fn an_spc2_reservation_excludes_other_nexuses_until_it_ends() {
        let u = LuShared::default();
        let (a, b) = (Nexus::new("a", [0; 6], "t"), Nexus::new("b", [0; 6], "t"));
        let read = Command::Read {
            lba: 0,
            blocks: 1,
            fua: false,
        };
        let mode = Command::ModeSense(crate::scsi::ModeSense {
            ten: false,
            dbd: false,
            pc: 0,
            page: 0x3f,
            subpage: 0,
            alloc: 255,
        });
        let prin = Command::PersistentReserveIn { sa: 0, alloc: 8 };
        // Nothing held: nothing conflicts.
        assert!(!u.legacy_conflict(&b, &read));
        u.reserve6(&a).unwrap();
        u.reserve6(&a).unwrap(); // the holder may reserve again
        assert_eq!(u.reserve6(&b), Err(PrError::Conflict));
        // The holder does anything; the others only learn about the unit.
        assert!(!u.legacy_conflict(&a, &read) && !u.legacy_conflict(&a, &mode));
        assert!(u.legacy_conflict(&b, &read) && u.legacy_conflict(&b, &mode));
        assert!(!u.legacy_conflict(&b, &Command::Release6));
        // Persistent reservation commands conflict for everyone meanwhile.
        assert!(u.legacy_conflict(&a, &prin) && u.legacy_conflict(&b, &prin));
        // Another nexus's RELEASE does nothing; the holder's ends it.
        u.release6(&b).unwrap();
        assert!(u.legacy_conflict(&b, &read));
        u.release6(&a).unwrap();
        assert!(!u.legacy_conflict(&b, &read));
        // A session that ends takes its reservation with it; another's does not.
        u.reserve6(&b).unwrap();
        u.drop_legacy(Some(&a));
        assert!(u.legacy_conflict(&a, &read));
        u.drop_legacy(Some(&b));
        assert!(!u.legacy_conflict(&a, &read));
        // A reset ends it whoever holds it.
        u.reserve6(&a).unwrap();
        u.drop_legacy(None);
        u.reserve6(&b).unwrap();
    }

    #[test]
    fn a_carried_state_is_saved_at_every_change_and_restored_whole() {
        use std::sync::Arc as StdArc;
        let u = LuShared::default();
        let saved: StdArc<Mutex<Vec<Vec<u8>>>> = StdArc::default();
        let s2 = saved.clone();
        u.set_carried(Box::new(move |b| {
            s2.locked().push(b.to_vec());
            Ok(())
        }));
        let a = Nexus::new("a", [0; 6], "t");
        // No APTPL: saved all the same.
        u.pr_out(
            &a,
            &ProutRequest::basic(crate::pr::REGISTER, 0, 0, 7, false),
        )
        .unwrap();
        u.pr_out(&a, &ProutRequest::basic(crate::pr::RESERVE, 3, 7, 0, false))
            .unwrap();
        assert_eq!(saved.locked().len(), 2);
        // Another unit takes the last state over whole, APTPL clear or not.
        let other = LuShared::default();
        other.restore(saved.locked().last().unwrap()).unwrap();
        assert_eq!(
            other.pr_in(crate::pr::READ_KEYS).unwrap(),
            u.pr_in(crate::pr::READ_KEYS).unwrap()
        );
        assert!(other.pr_conflict(&Nexus::new("b", [0; 6], "t"), Access::Write));
        // An empty state clears it.
        other.restore(&[]).unwrap();
        assert!(!other.pr_conflict(&Nexus::new("b", [0; 6], "t"), Access::Write));
        assert!(other.restore(b"garbage").is_err());
    }

    #[test]
    fn spc2_and_persistent_reservations_exclude_each_other() {
        let u = LuShared::default();
        let (a, b) = (Nexus::new("a", [0; 6], "t"), Nexus::new("b", [0; 6], "t"));
        u.pr_out(
            &a,
            &ProutRequest::basic(crate::pr::REGISTER, 0, 0, 7, false),
        )
        .unwrap();
        // A registration anywhere: RESERVE(6) and RELEASE(6) conflict for everyone.
        assert_eq!(u.reserve6(&b), Err(PrError::Conflict));
        assert_eq!(u.release6(&a), Err(PrError::Conflict));
        u.pr_out(
            &a,
            &ProutRequest::basic(crate::pr::REGISTER, 0, 7, 0, false),
        )
        .unwrap();
        u.reserve6(&b).unwrap();
    }

    #[test]
    fn overlapping_ranges_are_refused_until_released() {
        let l = LuShared::of(0x1234_5678);
        assert!(Arc::ptr_eq(&l, &LuShared::of(0x1234_5678)));
        assert!(!l.busy(0, 1000));
        assert!(l.try_take(10, 5));
        assert!(!l.try_take(14, 1));
        assert!(l.try_take(15, 1));
        assert!(l.busy(12, 1) && l.busy(0, 11) && !l.busy(0, 10) && !l.busy(16, 4));
        l.release(10, 5);
        assert!(l.try_take(14, 1));
        l.release(14, 1);
        l.release(15, 1);
        assert!(!l.busy(0, u64::MAX));
    }

    #[test]
    fn reservations_are_shared_and_persisted_with_aptpl() {
        use crate::pr::{REGISTER, RESERVE};
        let l = LuShared::of(0x7777_0001);
        let (a, b) = (Nexus::new("a", [0; 6], "t"), Nexus::new("b", [0; 6], "t"));
        // No persister: APTPL is refused, and REPORT CAPABILITIES says so (PTPL_C 0).
        assert_eq!(l.pr_in(crate::pr::REPORT_CAPABILITIES).unwrap()[2] & 1, 0);
        assert_eq!(
            l.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 0, 1, true)),
            Err(PrError::Check(
                crate::scsi::Sense::INVALID_FIELD_IN_PARAMETER_LIST
            ))
        );
        let saved = Arc::new(Mutex::new(Vec::<Vec<u8>>::new()));
        let s2 = saved.clone();
        l.set_persist(Box::new(move |b| {
            s2.locked().push(b.to_vec());
            Ok(())
        }));
        assert_eq!(l.pr_in(crate::pr::REPORT_CAPABILITIES).unwrap()[2] & 1, 1);
        // Without APTPL nothing is saved.
        l.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 0, 1, false))
            .unwrap();
        assert!(saved.locked().is_empty());
        assert!(!l.pr_conflict(&b, Access::Write));
        l.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 1, 1, true))
            .unwrap();
        l.pr_out(&a, &ProutRequest::basic(RESERVE, 3, 1, 0, false))
            .unwrap();
        assert_eq!(saved.locked().len(), 2);
        // Every connection of the volume sees the reservation.
        let other = LuShared::of(0x7777_0001);
        assert!(other.pr_conflict(&b, Access::Read) && !other.pr_conflict(&a, Access::Read));
        assert!(!other.pr_conflict(&b, Access::Free));
        // What was saved restores the reservation in a fresh unit.
        let last = saved.locked().last().cloned().unwrap();
        let fresh = LuShared::default();
        fresh.load_persisted(&last).unwrap();
        assert!(fresh.pr_conflict(&b, Access::Write));
        assert_eq!(fresh.pr_in(1).unwrap(), l.pr_in(1).unwrap());
        // APTPL cleared by a REGISTER: saved once more, and restores nothing.
        l.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 1, 1, false))
            .unwrap();
        let last = saved.locked().last().cloned().unwrap();
        assert_eq!(saved.locked().len(), 3);
        let fresh = LuShared::default();
        fresh.load_persisted(&last).unwrap();
        assert!(!fresh.pr_conflict(&b, Access::Write));
        assert!(fresh.load_persisted(b"junk").is_err());
    }

    #[test]
    fn unit_attentions_are_reported_once_to_each_affected_nexus() {
        use crate::pr::{
            CLEAR, PREEMPT, REGISTER, REGISTRATIONS_PREEMPTED, RESERVATIONS_PREEMPTED, RESERVE,
        };
        let l = LuShared::default();
        let (a, b, c) = (
            Nexus::new("a", [0; 6], "t"),
            Nexus::new("b", [0; 6], "t"),
            Nexus::new("c", [0; 6], "t"),
        );
        for (n, k) in [(&a, 1), (&b, 2), (&c, 3)] {
            l.pr_out(n, &ProutRequest::basic(REGISTER, 0, 0, k, false))
                .unwrap();
        }
        assert_eq!(l.take_unit_attention(&b), None);
        l.pr_out(&a, &ProutRequest::basic(RESERVE, 3, 1, 0, false))
            .unwrap();
        l.pr_out(&a, &ProutRequest::basic(PREEMPT, 3, 1, 2, false))
            .unwrap();
        l.pr_out(&a, &ProutRequest::basic(CLEAR, 0, 1, 0, false))
            .unwrap();
        // b: preempted, then cleared (it was no longer registered at the CLEAR).
        assert_eq!(l.take_unit_attention(&b), Some(REGISTRATIONS_PREEMPTED));
        assert_eq!(l.take_unit_attention(&b), None);
        assert_eq!(l.take_unit_attention(&c), Some(RESERVATIONS_PREEMPTED));
        assert_eq!(l.take_unit_attention(&c), None);
        assert_eq!(
            l.take_unit_attention(&a),
            None,
            "not to the nexus that acted"
        );
        // A refused PERSISTENT RESERVE OUT establishes nothing.
        l.pr_out(&b, &ProutRequest::basic(REGISTER, 0, 0, 2, false))
            .unwrap();
        assert!(l
            .pr_out(&a, &ProutRequest::basic(CLEAR, 0, 9, 0, false))
            .is_err());
        assert_eq!(l.take_unit_attention(&b), None);
    }

    #[test]
    fn registrations_are_bounded() {
        use crate::pr::{INSUFFICIENT_REGISTRATION_RESOURCES, MAX_REGISTRATIONS, REGISTER};
        let l = LuShared::default();
        let nexus = |i: usize| Nexus::new(&format!("i{i}"), [0; 6], "t");
        for i in 0..MAX_REGISTRATIONS {
            l.pr_out(&nexus(i), &ProutRequest::basic(REGISTER, 0, 0, 1, false))
                .unwrap();
        }
        let over = nexus(MAX_REGISTRATIONS);
        assert_eq!(
            l.pr_out(&over, &ProutRequest::basic(REGISTER, 0, 0, 1, false)),
            Err(PrError::Check(INSUFFICIENT_REGISTRATION_RESOURCES))
        );
        // One that leaves makes room again.
        l.pr_out(&nexus(0), &ProutRequest::basic(REGISTER, 0, 1, 0, false))
            .unwrap();
        l.pr_out(&over, &ProutRequest::basic(REGISTER, 0, 0, 1, false))
            .unwrap();
    }

    #[test]
    fn a_reservation_that_cannot_be_saved_is_refused_and_changes_nothing() {
        use crate::pr::{REGISTER, RESERVE};
        let l = LuShared::default();
        let (a, b) = (Nexus::new("a", [0; 6], "t"), Nexus::new("b", [0; 6], "t"));
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f2 = fail.clone();
        l.set_persist(Box::new(move |_| match f2.load(Ordering::SeqCst) {
            true => Err("disk full".into()),
            false => Ok(()),
        }));
        l.pr_out(&a, &ProutRequest::basic(REGISTER, 0, 0, 1, true))
            .unwrap();
        fail.store(true, Ordering::SeqCst);
        let keys = l.pr_in(crate::pr::READ_KEYS).unwrap();
        assert_eq!(
            l.pr_out(&a, &ProutRequest::basic(RESERVE, 3, 1, 0, false)),
            Err(PrError::Check(crate::scsi::Sense::INTERNAL_TARGET_FAILURE))
        );
        assert!(!l.pr_conflict(&b, Access::Write), "no reservation was made");
        assert_eq!(
            l.pr_out(&b, &ProutRequest::basic(REGISTER, 0, 0, 2, true)),
            Err(PrError::Check(crate::scsi::Sense::INTERNAL_TARGET_FAILURE))
        );
        assert_eq!(
            l.pr_in(crate::pr::READ_KEYS).unwrap(),
            keys,
            "no key was added"
        );
    }
}
