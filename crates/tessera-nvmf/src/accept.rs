//! The NVMe/TCP listener: hands each accepted connection to a reactor core, where it
//! becomes a queue (`crate::queue`) of a target (`crate::target`).

use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use tessera_export::ExportTarget;
use tessera_io::Mailbox;

use crate::target::Target;

/// Accept NVMe/TCP connections forever; each becomes a queue task on the core `next`
/// picks. Everything after accept (ICReq, Connect) runs on that core.
pub fn accept_loop<T: ExportTarget>(
    l: TcpListener,
    target: Arc<Target<T>>,
    next: impl Fn() -> Arc<Mailbox> + Send + 'static,
) {
    for s in l.incoming() {
        let Ok(s) = s else { continue };
        let _ = s.set_nodelay(true);
        let fd: OwnedFd = s.into();
        let t = target.clone();
        next().spawn(Box::new(move |io| {
            Box::new(crate::queue::NvmfQueue::new(io, fd, t))
        }));
    }
}
