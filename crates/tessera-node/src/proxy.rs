//! A cluster volume another node owns, served here through Tessera's NVMe/TCP initiator
//! (docs/architecture.md "Clients follow the volume"): an NBD client may connect to any
//! node and ask for the volume; a node that does not own it serves the connection
//! through a [`ProxyVolume`], a remote device on the owner's export under the volume's
//! cluster NQN.
//!
//! One `ProxyVolume` per proxied volume per node, shared by every NBD connection to it
//! (node/proxy.rs opens and reuses them); it closes when the last connection goes. On
//! each core the connections share one NVMe/TCP I/O queue ([`ProxyCore`], kept in the
//! core's locals like a replicated volume's legs), so a core holds one queue per proxied
//! volume however many clients it serves.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Arc, Weak};
use std::time::Instant;

use tessera_device::IoHandle;
use tessera_export::{IoStats, StatsRegistry, StatsSnapshot};
use tessera_io::{CoreIo, IoOp, Tag};
use tessera_qos::{QosLimits, VolumeQos};
use tessera_remote::{RemoteDevice, RemoteHandle};
use tracing::{info, warn};

/// A volume served by another node, reached over NVMe/TCP.
pub struct ProxyVolume {
    /// The cluster volume's name (also the NBD export name).
    pub name: String,
    /// The node that owned the volume when the proxy was opened.
    pub owner: String,
    dev: Arc<RemoteDevice>,
    /// Client I/O through this node's proxies of the volume, kept by the node across
    /// openings (cumulative since the node started).
    stats: Arc<StatsRegistry>,
    /// No limits of its own (the owner applies the volume's); shared by the proxy's
    /// connections like a local volume's.
    qos: Arc<VolumeQos>,
}

impl ProxyVolume {
    pub fn new(
        name: String,
        owner: String,
        dev: Arc<RemoteDevice>,
        stats: Arc<StatsRegistry>,
    ) -> ProxyVolume {
        ProxyVolume {
            name,
            owner,
            dev,
            stats,
            qos: Arc::new(VolumeQos::new(QosLimits::default(), Instant::now())),
        }
    }

    pub(crate) fn qos(&self) -> &Arc<VolumeQos> {
        &self.qos
    }

    pub fn size(&self) -> u64 {
        tessera_device::BlockDevice::size(&*self.dev)
    }

    /// Where the proxy sends I/O (`nvme-tcp://...`).
    pub fn path(&self) -> String {
        self.dev.spec().to_string()
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    pub(crate) fn register_stats(&self) -> Arc<IoStats> {
        self.stats.register()
    }

    pub(crate) fn unregister_stats(&self, stats: &Arc<IoStats>) {
        self.stats.unregister(stats)
    }

    /// Every connection's handle opens lazily on its core (see [`ProxyHandle`]).
    pub(crate) fn open_handle(self: &Arc<Self>) -> ProxyHandle {
        ProxyHandle {
            vol: self.clone(),
            core: None,
        }
    }

    /// Where a core keeps its [`ProxyCore`] of this proxy (`CoreIo::locals`).
    fn core_key(&self) -> usize {
        self as *const ProxyVolume as usize ^ 0x7072_6f78
    }
}

impl Drop for ProxyVolume {
    // The last connection went (each core's queue closed with its last handle): the
    // admin queue closes now, not when the reactors' hooks of the closed queues, which
    // keep a reference to the device, let it go. The last connection usually ends on a
    // reactor, and closing waits for the device's admin lock, which a queue's reconnect
    // to an unreachable owner holds for up to its timeout: so it closes in a thread.
    fn drop(&mut self) {
        let dev = self.dev.clone();
        let closing = std::thread::Builder::new()
            .name("tessera-proxy-close".into())
            .spawn(move || dev.disconnect());
        if closing.is_err() {
            warn!(volume = %self.name, "cannot start a thread to close the nbd proxy's admin queue; \
                  it closes when the device is dropped");
        }
        info!(volume = %self.name, owner = %self.owner, path = %self.dev.spec(),
              "nbd proxy closed: no connection left");
    }
}

/// One core's queue to the owner, shared by the connections this core serves.
struct ProxyCore {
    /// `None` while no connection of this core uses the proxy.
    link: RefCell<Option<RemoteHandle>>,
    /// Connections of this core that submitted I/O through `link` and are still open.
    users: Cell<usize>,
}

type CoreEntry = (Rc<ProxyCore>, Weak<ProxyVolume>);

impl ProxyCore {
    /// This core's instance for `vol`, with its queue open, counted as used once more.
    fn attach(io: &mut CoreIo, vol: &Arc<ProxyVolume>) -> Rc<ProxyCore> {
        let key = vol.core_key();
        // A proxy at a reused address is another one: its entry is replaced.
        let known = io
            .locals
            .get(&key)
            .and_then(|b| b.downcast_ref::<CoreEntry>())
            .filter(|(_, w)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(vol)) && w.strong_count() > 0)
            .map(|(c, _)| c.clone());
        let c = known.unwrap_or_else(|| {
            // Entries of proxies that have closed since go now: a core sees no other
            // moment to drop them, and every proxy opened would leave one.
            io.locals.retain(|_, b| {
                b.downcast_ref::<CoreEntry>()
                    .is_none_or(|(_, w)| w.strong_count() > 0)
            });
            let c = Rc::new(ProxyCore {
                link: RefCell::new(None),
                users: Cell::new(0),
            });
            let entry: CoreEntry = (c.clone(), Arc::downgrade(vol));
            io.locals.insert(key, Box::new(entry));
            c
        });
        c.users.set(c.users.get() + 1);
        let mut link = c.link.borrow_mut();
        if link.is_none() {
            *link = Some(RemoteHandle::open(&vol.dev));
        }
        drop(link);
        c
    }

    fn detach(&self) {
        let left = self.users.get().saturating_sub(1);
        self.users.set(left);
        if left == 0 {
            // Dropping the handle shuts its connection down and gives its queue id back.
            if let Ok(mut link) = self.link.try_borrow_mut() {
                *link = None;
            }
        }
    }
}

/// One connection's handle to a proxy, on the core serving the connection: it joins
/// the core's shared queue at its first I/O.
pub struct ProxyHandle {
    vol: Arc<ProxyVolume>,
    core: Option<Rc<ProxyCore>>,
}

impl ProxyHandle {
    /// # Safety
    /// As [`tessera_export::ExportHandle::submit`].
    #[inline]
    pub(crate) unsafe fn submit(&mut self, io: &mut CoreIo, op: IoOp, tag: Tag) {
        let core = self
            .core
            .get_or_insert_with(|| ProxyCore::attach(io, &self.vol));
        // Completions are queued on the core, never delivered inside this call, so the
        // borrow cannot be taken twice.
        match &mut *core.link.borrow_mut() {
            // SAFETY: forwarded under the caller's contract.
            Some(h) => unsafe { IoHandle::submit(h, io, op, tag) },
            None => io.complete(tag, -libc::ENOTCONN),
        }
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        if let Some(c) = self.core.take() {
            c.detach();
        }
    }
}
