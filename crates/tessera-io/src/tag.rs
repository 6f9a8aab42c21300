//! The address of a completion, packed into the 64-bit io_uring `user_data`.

/// Addresses a completion.
///
/// A tag travels through io_uring as the 64-bit `user_data` of a submission and comes back
/// unchanged in its completion, so everything the core needs to route that completion must
/// fit in those 64 bits. The top two bits mark tags that never reach a task; every other
/// tag names one operation slot of one task:
///
/// ```text
///  63        62        61 .. 32           31 .. 0
/// [INTERNAL][REACTOR][ task id (30 bits) ][ slot (32 bits) ]   task tag (both top bits 0)
/// [   1    ][   0   ][       0           ][ join index     ]   internal: a join or delay entry
/// [   0    ][   1   ][       0           ][ reactor id     ]   reactor-private ring operation
/// ```
///
/// Internal tags are resolved by the core's join/delay table ([`crate::CoreIo::complete`]);
/// reactor-private tags mark the reactor's own ring operations (its mailbox eventfd read).
/// Neither is handed to a task, which is why a task id must stay below 2^30
/// ([`Tag::MAX_TASK_ID`]): a larger one would collide with those bits.
#[repr(transparent)]
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Tag(u64);

/// Marks tags that name a join or delay entry on this core.
const INTERNAL: u64 = 1 << 63;
/// Marks the reactor's own io_uring operations.
const REACTOR: u64 = 1 << 62;
/// The low half: a task's slot, a join's index or a reactor operation's id.
const LOW: u64 = 0xffff_ffff;

impl Tag {
    /// The largest task id whose tags stay clear of the internal and reactor bits.
    pub const MAX_TASK_ID: u32 = (1 << 30) - 1;

    /// The parent of a tracked join whose hook completes nothing itself (a deferred
    /// continuation, a periodic check): never completed, so its value (task 0's slot 0,
    /// as before tags had a type) only has to be a task tag.
    pub const NO_PARENT: Tag = Tag::task(0, 0);

    /// The tag of operation `slot` of task `task_id`.
    #[inline]
    #[must_use]
    pub const fn task(task_id: u32, slot: u32) -> Tag {
        debug_assert!(task_id <= Tag::MAX_TASK_ID);
        Tag(((task_id as u64) << 32) | slot as u64)
    }

    /// The task a task tag belongs to.
    #[inline]
    #[must_use]
    pub const fn task_id(self) -> u32 {
        #[allow(clippy::cast_possible_truncation)] // bits 32..62 of a task tag
        let id = (self.0 >> 32) as u32;
        id
    }

    /// The slot within its task (a task tag) or the join index (an internal tag).
    #[inline]
    #[must_use]
    pub const fn slot(self) -> u32 {
        #[allow(clippy::cast_possible_truncation)] // the low 32 bits, masked
        let slot = (self.0 & LOW) as u32;
        slot
    }

    /// The tag of join/delay entry `idx` of this core.
    #[inline]
    #[must_use]
    pub(crate) const fn internal(idx: u32) -> Tag {
        Tag(INTERNAL | idx as u64)
    }

    /// Belongs to this core's join/delay table, never to a task.
    #[inline]
    #[must_use]
    pub const fn is_internal(self) -> bool {
        self.0 & INTERNAL != 0
    }

    /// The join/delay index of an internal tag.
    #[inline]
    #[must_use]
    pub(crate) const fn internal_index(self) -> usize {
        self.slot() as usize
    }

    /// The tag of the reactor's own ring operation `id`.
    #[inline]
    #[must_use]
    pub(crate) const fn reactor(id: u32) -> Tag {
        Tag(REACTOR | id as u64)
    }

    /// Marks one of the reactor's own ring operations, never a task's.
    #[inline]
    #[must_use]
    pub(crate) const fn is_reactor(self) -> bool {
        self.0 & REACTOR != 0 && self.0 & INTERNAL == 0
    }

    /// The io_uring `user_data` carrying this tag.
    #[inline]
    #[must_use]
    pub(crate) const fn user_data(self) -> u64 {
        self.0
    }

    /// The tag an io_uring completion's `user_data` carries back.
    #[inline]
    #[must_use]
    pub(crate) const fn from_user_data(user_data: u64) -> Tag {
        Tag(user_data)
    }
}

#[cfg(test)]
mod tests {
    use super::Tag;

    #[test]
    fn task_tags_round_trip_task_id_and_slot() {
        for (id, slot) in [(0, 0), (1, 2), (7, u32::MAX), (Tag::MAX_TASK_ID, 0)] {
            let t = Tag::task(id, slot);
            assert_eq!((t.task_id(), t.slot()), (id, slot));
            assert!(!t.is_internal());
            assert!(!t.is_reactor());
            assert_eq!(Tag::from_user_data(t.user_data()), t);
        }
    }

    #[test]
    fn the_largest_task_id_and_slot_stay_clear_of_the_marker_bits() {
        let t = Tag::task(Tag::MAX_TASK_ID, u32::MAX);
        assert_eq!((t.task_id(), t.slot()), (Tag::MAX_TASK_ID, u32::MAX));
        assert!(!t.is_internal());
        assert!(!t.is_reactor());
        assert_eq!(t.user_data(), (1 << 62) - 1);
    }

    #[test]
    fn the_encoding_matches_the_documented_layout() {
        assert_eq!(Tag::task(3, 5).user_data(), (3 << 32) | 5);
        assert_eq!(Tag::internal(9).user_data(), (1 << 63) | 9);
        assert_eq!(Tag::reactor(1).user_data(), (1 << 62) | 1);
    }

    #[test]
    fn internal_and_reactor_tags_are_distinct_from_task_tags() {
        for idx in [0, 1, u32::MAX] {
            let internal = Tag::internal(idx);
            assert!(internal.is_internal());
            assert!(!internal.is_reactor());
            assert_eq!(internal.internal_index(), idx as usize);

            let reactor = Tag::reactor(idx);
            assert!(reactor.is_reactor());
            assert!(!reactor.is_internal());
            assert_ne!(internal, reactor);

            for task in [Tag::task(0, idx), Tag::task(Tag::MAX_TASK_ID, idx)] {
                assert_ne!(task, internal);
                assert_ne!(task, reactor);
            }
        }
    }

    #[test]
    fn a_tag_is_exactly_its_user_data() {
        assert_eq!(std::mem::size_of::<Tag>(), std::mem::size_of::<u64>());
        assert_eq!(std::mem::align_of::<Tag>(), std::mem::align_of::<u64>());
    }
}
