//! Engines that live on one reactor core, one per pool or layout: the parity engine
//! (`layout::parity_io`), the first-write engine (`volume::first_write`) and the dedup
//! write engine (`volume::dedup_io`). Each is kept in the core's `locals` under its
//! owner's address and a tag of its kind, beside a weak pointer to the owner that tells
//! a live owner from a new one at a reused address, and is registered as the core's
//! completion hook for its I/O.

use std::rc::Rc;
use std::sync::{Arc, Weak};

use tessera_io::{Continuation, CoreIo};

/// One kind of per-core engine.
pub(crate) trait CoreEngine: Continuation + Sized + 'static {
    /// What one engine serves (a pool, a layout).
    type Owner: 'static;
    /// Tells the kinds of engines of one owner apart in `locals`.
    const TAG: usize;
    /// A new engine for `owner` (its hook id is set right after).
    fn create(owner: &Arc<Self::Owner>) -> Self;
    /// Its completion hook's id on this core.
    fn set_hook(&self, id: u32);
    /// Found again for a new user.
    fn reused(&self, _owner: &Arc<Self::Owner>) {}
    /// Its owner is gone: give back what it holds (device handles, which lock the
    /// devices). Returns its hook's id when no completion can reach the hook any more
    /// (the hook is released then); otherwise the core's hook table keeps the engine's
    /// empty shell.
    fn retire(&self) -> Option<u32>;
}

type Entry<E> = (Rc<E>, Weak<<E as CoreEngine>::Owner>);

/// The engine of kind `E` of `owner` on this core, created on first use. Creating one
/// retires the engines of that kind whose owners are gone.
pub(crate) fn core_engine<E: CoreEngine>(io: &mut CoreIo, owner: &Arc<E::Owner>) -> Rc<E> {
    let key = Arc::as_ptr(owner) as *const () as usize ^ E::TAG;
    if let Some((e, w)) = io
        .locals
        .get(&key)
        .and_then(|b| b.downcast_ref::<Entry<E>>())
    {
        if std::ptr::eq(w.as_ptr(), Arc::as_ptr(owner)) && w.strong_count() > 0 {
            e.reused(owner);
            return e.clone();
        }
    }
    let mut released = Vec::new();
    io.locals.retain(|_, b| match b.downcast_ref::<Entry<E>>() {
        Some((e, w)) if w.strong_count() == 0 => {
            released.extend(e.retire());
            false
        }
        _ => true,
    });
    for id in released {
        io.release_hook(id);
    }
    let e = Rc::new(E::create(owner));
    let id = io.register_hook(e.clone());
    e.set_hook(id);
    let entry: Entry<E> = (e.clone(), Arc::downgrade(owner));
    io.locals.insert(key, Box::new(entry));
    e
}
