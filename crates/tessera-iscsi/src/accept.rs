//! The iSCSI listener: hands each accepted connection to a reactor core, where it
//! becomes a [`crate::conn::IscsiConn`] of a [`crate::target::Target`].
//!
//! Connections still logging in are bounded apart from the listener's cap
//! ([`LoginGate`], `login_gate.rs`).

use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Weak};

use tessera_export::accept::accept_each;
use tessera_export::budget::{BufferBudget, ListenerCap};
use tessera_export::log_limit::LogLimiter;
use tessera_export::ExportTarget;
use tessera_io::Mailbox;

pub use crate::login_gate::{LoginGate, LoginTicket};
use crate::target::Target;

/// Connections refused at the listener's cap: at most 10 lines per 10 s.
static CAP_LOG: LogLimiter = LogLimiter::new("iscsi-connection-cap", 10, 10);

/// Accept iSCSI connections forever; each becomes a connection task on the core `next`
/// picks, with its share of the node's buffer `budget`. Past `cap` open connections a
/// new one is closed at once; past [`LoginGate::bound_for`] connections still logging
/// in, the oldest of them is closed. Everything after accept (login included) runs on
/// that core.
pub fn accept_loop<T: ExportTarget>(
    l: TcpListener,
    target: Arc<Target<T>>,
    cap: Arc<ListenerCap>,
    budget: Arc<BufferBudget>,
    next: impl Fn() -> Arc<Mailbox> + Send + 'static,
) {
    let gate = LoginGate::new(LoginGate::bound_for(cap.max()));
    accept_gated(l, target, cap, &gate, budget, next)
}

/// [`accept_loop`] holding the target weakly: a target dropped by its owner (a node in
/// process stopped and started again, whose target holds its volumes) is not kept alive
/// by a listener blocked in accept. A connection that arrives once it is gone is closed.
pub fn accept_loop_weak<T: ExportTarget>(
    l: TcpListener,
    target: Weak<Target<T>>,
    cap: Arc<ListenerCap>,
    budget: Arc<BufferBudget>,
    next: impl Fn() -> Arc<Mailbox> + Send + 'static,
) {
    let gate = LoginGate::new(LoginGate::bound_for(cap.max()));
    accept_with(l, || target.upgrade(), cap, &gate, budget, next)
}

/// [`accept_loop`] with the listener's [`LoginGate`] given (a test looks at it).
pub fn accept_gated<T: ExportTarget>(
    l: TcpListener,
    target: Arc<Target<T>>,
    cap: Arc<ListenerCap>,
    gate: &Arc<LoginGate>,
    budget: Arc<BufferBudget>,
    next: impl Fn() -> Arc<Mailbox> + Send + 'static,
) {
    accept_with(l, || Some(target.clone()), cap, gate, budget, next)
}

/// The accept loop, taking the target from `target` for each connection (None: the
/// connection is closed).
fn accept_with<T: ExportTarget>(
    l: TcpListener,
    target: impl Fn() -> Option<Arc<Target<T>>>,
    cap: Arc<ListenerCap>,
    gate: &Arc<LoginGate>,
    budget: Arc<BufferBudget>,
    next: impl Fn() -> Arc<Mailbox> + Send + 'static,
) {
    accept_each(l.incoming(), &cap, "iscsi", &CAP_LOG, |s, slot| {
        let Some(t) = target() else {
            return; // dropping the stream closes it
        };
        let _ = s.set_nodelay(true);
        let ticket = gate.admit(&s);
        let fd: OwnedFd = s.into();
        let b = budget.conn(Some(slot));
        next().spawn(Box::new(move |io| {
            Box::new(crate::conn::IscsiConn::new(io, fd, t, b, ticket))
        }));
    });
}
