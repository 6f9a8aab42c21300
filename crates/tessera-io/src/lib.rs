//! The per-core runtime every Tessera datapath runs on.
//!
//! One [`Reactor`] per core owns one io_uring that carries both the core's sockets and its
//! device I/O, so a request is received, served and answered on one core. Work on a core is
//! organised as [`Task`]s (an NBD connection, a benchmark driver) that submit operations
//! through the core's [`CoreIo`] and receive completions addressed by a [`Tag`].
//!
//! The block interface shared by every layer (device, pool, volume) is [`IoHandle`]: a
//! per-core handle that accepts an [`IoOp`] and delivers exactly one completion for it.

pub mod buf;
pub mod cast;
pub mod core_io;
pub mod counters;
pub mod hist;
pub mod poll;
pub mod reactor;
pub mod sync;
mod tag;
pub mod units;

pub use buf::{AlignedBuf, BufPool};
pub use core_io::{live_hooks, Continuation, CoreIo, IoHandle, IoOp, REMOTE_COMPLETER_NONE};
pub use reactor::{
    spawn_reactors, CoreLoad, CoreTime, Mailbox, Reactor, ReactorConfig, RemoteCompleter, Task,
};
pub use tag::Tag;

#[cfg(test)]
mod tests;
