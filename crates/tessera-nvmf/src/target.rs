//! The NVMe/TCP target: subsystems (from a [`Catalog`] the node implements), controllers
//! shared by their queues, and the TCP accept loop that hands each connection (one queue)
//! to a reactor core, round robin, where a [`crate::queue::NvmfQueue`] serves it.
//!
//! A controller is created by the Fabrics Connect of its admin queue (dynamic controller
//! model: the host asks for CNTLID 0xFFFF) and ends when its admin queue closes, when its
//! keep-alive timeout expires, or when the host clears CC.EN: then every one of its
//! queues is shut down, wherever it runs. Queues of one controller live on different
//! cores; what they share (CC/CSTS, keep-alive, features, error log, pending
//! asynchronous events, the namespace list) sits behind one mutex here that the I/O path
//! never takes: an I/O queue reads three atomics per command (ready, namespace
//! generation, and the namespace's ANA state, a relaxed load).
//!
//! Asymmetric Namespace Access: every namespace is its own ANA group, whose state the
//! target keeps per subsystem ([`Target::set_ana_state`]); the ANA log, the change
//! notices and the path statuses of I/O to an unreachable namespace follow from it. A
//! namespace may have no data behind it at all (a path to a volume another node owns),
//! and other nodes' paths to a subsystem can be listed in the discovery log
//! ([`Target::set_other_paths`]).

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Instant;
use tessera_io::sync::{MutexExt, RwLockExt};

use tessera_export::{Export, ExportTarget};
use tracing::warn;

use crate::auth::HostKeys;

/// Why a target setting was refused; each variant names the value and its bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("controller ID range {first}..={last} is not within 1..=0xFFEF")]
    CntlidRange { first: u16, last: u16 },
    #[error("{0} is not a namespace ID")]
    Nsid(u32),
    /// An accessible ANA state for a namespace whose data is on another node.
    #[error("namespace {nsid} of {nqn} holds no data on this node; it cannot be {state}")]
    NoData {
        nqn: String,
        nsid: u32,
        state: &'static str,
    },
}
use crate::nvme::{self, AnaGroupDesc, AnaState, DiscoveryEntry, ErrorEntry};

/// The well-known NQN of the discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Largest H2CData payload we accept (advertised in ICResp).
pub const MAXH2CDATA: u32 = 128 << 10;
/// In-capsule data accepted on every queue: 8 KiB, so 4 KiB writes need no R2T round trip
/// (and Connect's 1 KiB of data fits on the admin queue, whose capsule size is fixed).
pub const IN_CAPSULE: usize = 8192;
/// Queue entries (0's based): 512 commands per queue.
pub const MQES: u16 = 511;
/// I/O queues per controller.
pub const MAX_IO_QUEUES: u16 = 64;
/// Namespaces use 512-byte LBAs, the alignment the volumes enforce (as NBD's minimum
/// block size says).
pub const LBA_SHIFT: u8 = 9;
/// Maximum data transfer: 2^8 pages of 4 KiB = 1 MiB per command.
pub const MDTS: u8 = 8;
pub const MAX_TRANSFER: usize = 4096 << MDTS;
/// Asynchronous event requests held per controller, 0's based.
pub const AERL: u8 = 3;
/// Error log entries kept per controller.
pub const ERROR_LOG: usize = 64;

/// One namespace of a subsystem: an export target (with its QoS state) and the IDs the
/// host sees.
pub struct NamespaceEntry<T> {
    pub nsid: u32,
    /// The data behind the namespace. `None` for a path that holds no data here (a
    /// cluster volume's namespace on a node that does not own it): its ANA state is then
    /// never accessible and I/O to it fails with an ANA status without touching anything.
    pub export: Option<Export<T>>,
    /// Size in bytes reported when there is no `export` (the namespace's declared size,
    /// the same on every path).
    pub declared_size: u64,
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    pub eui64: [u8; 8],
}

impl<T> Clone for NamespaceEntry<T> {
    fn clone(&self) -> Self {
        NamespaceEntry {
            nsid: self.nsid,
            export: self.export.clone(),
            declared_size: self.declared_size,
            nguid: self.nguid,
            uuid: self.uuid,
            eui64: self.eui64,
        }
    }
}

impl<T: ExportTarget> NamespaceEntry<T> {
    /// Size in bytes (the target's, which may grow; else the declared one).
    pub fn size(&self) -> u64 {
        self.export
            .as_ref()
            .map_or(self.declared_size, |e| e.target.size())
    }
}

/// The ANA group of one namespace of one subsystem (group ID = NSID): its state, shared
/// by every controller and queue of the subsystem on this target, and how often it
/// changed. I/O queues read `state` once per command (a relaxed load).
#[derive(Debug)]
pub struct AnaGroup {
    state: AtomicU8,
    changes: AtomicU64,
}

impl AnaGroup {
    fn new() -> AnaGroup {
        AnaGroup {
            state: AtomicU8::new(AnaState::Optimized as u8),
            changes: AtomicU64::new(0),
        }
    }

    /// The state as set; a namespace without data is never accessible, whatever was set.
    pub fn state(&self, backed: bool) -> AnaState {
        let s = AnaState::from_u8(self.state.load(Relaxed)).unwrap_or(AnaState::Change);
        if !backed && s.accessible() {
            AnaState::Inaccessible
        } else {
            s
        }
    }

    pub fn changes(&self) -> u64 {
        self.changes.load(Relaxed)
    }
}

/// An NVM subsystem as the catalog describes it.
pub struct SubsystemInfo<T> {
    pub nqn: String,
    pub serial: String,
    pub allow_any_host: bool,
    pub hosts: Vec<String>,
    /// Hosts that must authenticate (DH-HMAC-CHAP), with their keys.
    pub auth: BTreeMap<String, Arc<HostKeys>>,
    pub namespaces: Vec<NamespaceEntry<T>>,
}

impl<T> Clone for SubsystemInfo<T> {
    fn clone(&self) -> Self {
        SubsystemInfo {
            nqn: self.nqn.clone(),
            serial: self.serial.clone(),
            allow_any_host: self.allow_any_host,
            hosts: self.hosts.clone(),
            auth: self.auth.clone(),
            namespaces: self.namespaces.clone(),
        }
    }
}

impl<T> SubsystemInfo<T> {
    pub fn allows(&self, hostnqn: &str) -> bool {
        self.allow_any_host || self.hosts.iter().any(|h| h == hostnqn)
    }
}

/// Where subsystems come from (the node's persistent configuration). `T` is the type of
/// the export targets its namespaces are.
pub trait Catalog<T>: Send + Sync + 'static {
    fn subsystem(&self, nqn: &str) -> Option<SubsystemInfo<T>>;
    fn subsystem_nqns(&self) -> Vec<String>;
    /// Changes whenever the set of subsystems or their hosts change (discovery GENCTR).
    fn generation(&self) -> u64;
}

/// A TCP port the target listens on (reported in the discovery log).
#[derive(Clone, Debug)]
pub struct Port {
    pub traddr: String,
    pub trsvcid: String,
    pub portid: u16,
    /// Serves NVM subsystems (not only discovery).
    pub io: bool,
}

pub struct Target<T> {
    pub catalog: Arc<dyn Catalog<T>>,
    ports: RwLock<Vec<Port>>,
    ctrls: Mutex<BTreeMap<u16, Arc<Controller<T>>>>,
    /// The next CNTLID to try and the range they come from (see
    /// [`Target::set_cntlid_range`]).
    next_cntlid: Mutex<(u16, u16, u16)>,
    pub started: Instant,
    /// ANA groups by (subsystem NQN, NSID); created at first use, Optimized.
    ana: Mutex<BTreeMap<(String, u32), Arc<AnaGroup>>>,
    /// Bumped on every ANA state change here (the ANA log's change count).
    ana_changes: AtomicU64,
    /// Paths to subsystems through other nodes, listed in the discovery log after this
    /// target's own ports, by subsystem NQN.
    other_paths: RwLock<BTreeMap<String, Vec<(String, String)>>>,
    /// Bumped when `other_paths` changes (added to the catalog's discovery generation).
    other_paths_gen: AtomicU64,
}

impl<T: ExportTarget> Target<T> {
    pub fn new(catalog: Arc<dyn Catalog<T>>) -> Arc<Target<T>> {
        Arc::new(Target {
            catalog,
            ports: RwLock::new(Vec::new()),
            ctrls: Mutex::new(BTreeMap::new()),
            next_cntlid: Mutex::new((1, 1, 0xFFEF)),
            started: Instant::now(),
            ana: Mutex::new(BTreeMap::new()),
            ana_changes: AtomicU64::new(0),
            other_paths: RwLock::new(BTreeMap::new()),
            other_paths_gen: AtomicU64::new(0),
        })
    }

    pub fn add_port(&self, p: Port) {
        self.ports.write_locked().push(p);
    }

    pub fn ports(&self) -> Vec<Port> {
        self.ports.read_locked().clone()
    }

    fn ctrls(&self) -> MutexGuard<'_, BTreeMap<u16, Arc<Controller<T>>>> {
        self.ctrls.locked()
    }

    /// Milliseconds since the target started (the keep-alive clock).
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Allocate CNTLIDs from `first..=last` from now on (within 1..=0xFFEF). A host
    /// reaching one subsystem through several targets (Linux native multipath across
    /// nodes) needs its controller IDs unique across them, so each node of a cluster gets
    /// a range of its own.
    pub fn set_cntlid_range(&self, first: u16, last: u16) -> Result<(), TargetError> {
        if first == 0 || first > last || last > 0xFFEF {
            return Err(TargetError::CntlidRange { first, last });
        }
        *self.next_cntlid.locked() = (first, first, last);
        Ok(())
    }

    /// A new controller for an admin queue's Connect.
    pub(crate) fn create_controller(
        &self,
        subnqn: &str,
        sub: Option<SubsystemInfo<T>>,
        hostnqn: &str,
        hostid: [u8; 16],
        kato_ms: u32,
    ) -> Option<Arc<Controller<T>>> {
        let auth = sub.as_ref().and_then(|s| s.auth.get(hostnqn).cloned());
        let mut ctrls = self.ctrls();
        // CNTLIDs from the range (1..=0xFFEF by default); skip ones in use (a
        // long-lived node wraps around).
        let cntlid = {
            let mut g = self.next_cntlid.locked();
            let (next, first, last) = &mut *g;
            let step = |n: u16| {
                if n >= *last || n < *first {
                    *first
                } else {
                    n + 1
                }
            };
            let mut tries = 0u32;
            while ctrls.contains_key(&*next) || *next < *first || *next > *last {
                *next = step(*next);
                tries += 1;
                if tries > u32::from(*last - *first) + 1 {
                    return None;
                }
            }
            let id = *next;
            *next = step(*next);
            id
        };
        let c = Arc::new(Controller {
            cntlid,
            subnqn: subnqn.to_string(),
            hostnqn: hostnqn.to_string(),
            hostid,
            discovery: sub.is_none(),
            auth,
            sub: RwLock::new(sub.map(Arc::new)),
            ns_gen: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            last_ka: AtomicU64::new(self.now_ms()),
            st: Mutex::new(CtrlState {
                kato_ms,
                aec: 0,
                cc: 0,
                csts: 0,
                io_queues: MAX_IO_QUEUES,
                queues: BTreeMap::new(),
                errors: VecDeque::new(),
                error_count: 0,
                changed: Vec::new(),
                aen: VecDeque::new(),
            }),
        });
        ctrls.insert(cntlid, c.clone());
        Some(c)
    }

    pub(crate) fn controller(&self, cntlid: u16) -> Option<Arc<Controller<T>>> {
        self.ctrls().get(&cntlid).cloned()
    }

    /// The admin queue closed: the controller ends and its I/O queues with it.
    pub(crate) fn remove_controller(&self, c: &Controller<T>, why: &str) {
        self.ctrls().remove(&c.cntlid);
        c.fail(why);
    }

    /// The namespaces of subsystem `nqn` changed: reload them in its controllers, which
    /// report the change with an asynchronous event (namespace attribute changed).
    pub fn subsystem_changed(&self, nqn: &str) {
        let ctrls: Vec<Arc<Controller<T>>> = self
            .ctrls()
            .values()
            .filter(|c| c.subnqn == nqn)
            .cloned()
            .collect();
        let fresh = self.catalog.subsystem(nqn);
        for c in ctrls {
            let old: Vec<u32> = c.namespaces().iter().map(|n| n.nsid).collect();
            let new: Vec<u32> = fresh
                .as_ref()
                .map(|s| s.namespaces.iter().map(|n| n.nsid).collect())
                .unwrap_or_default();
            let mut changed: Vec<u32> = old
                .iter()
                .filter(|x| !new.contains(x))
                .chain(new.iter().filter(|x| !old.contains(x)))
                .copied()
                .collect();
            changed.sort_unstable();
            *c.sub.write_locked() = fresh.clone().map(Arc::new);
            c.ns_gen.fetch_add(1, Release);
            if !changed.is_empty() {
                let mut st = c.state();
                for id in changed {
                    if !st.changed.contains(&id) {
                        st.changed.push(id);
                    }
                }
                if st.aec & nvme::AEC_NS_ATTR != 0 && !st.aen.contains(&nvme::AEN_NS_CHANGED) {
                    st.aen.push_back(nvme::AEN_NS_CHANGED);
                }
            }
        }
    }

    /// End every controller of subsystem `nqn` whose host `keep` refuses (a fenced-off
    /// owner of a replica): its queues stop taking I/O commands at once (CSTS.RDY clear)
    /// and their sockets shut down. The controllers are returned so that the caller can
    /// wait for [`Controller::live_queues`] to reach 0: from then on none of their I/O is
    /// in flight.
    pub fn evict(
        &self,
        nqn: &str,
        keep: impl Fn(&str) -> bool,
        why: &str,
    ) -> Vec<Arc<Controller<T>>> {
        let gone: Vec<Arc<Controller<T>>> = self
            .ctrls()
            .values()
            .filter(|c| c.subnqn == nqn && !keep(&c.hostnqn))
            .cloned()
            .collect();
        for c in &gone {
            self.remove_controller(c, why);
        }
        gone
    }

    /// The ANA group of namespace `nsid` of subsystem `nqn` (created Optimized).
    pub fn ana_group(&self, nqn: &str, nsid: u32) -> Arc<AnaGroup> {
        self.ana
            .locked()
            .entry((nqn.to_string(), nsid))
            .or_insert_with(|| Arc::new(AnaGroup::new()))
            .clone()
    }

    /// Set the ANA state of namespace `nsid` of subsystem `nqn` on this target. A change
    /// bumps the group's and the log's change counts and queues an ANA change notice on
    /// every controller of the subsystem that enabled them (held AERs complete at the
    /// admin queue's next tick). I/O commands see the new state from their next command.
    /// A namespace without data cannot be made accessible. The state of a subsystem or
    /// namespace not (yet) in the catalog may be set: it applies once it appears.
    pub fn set_ana_state(&self, nqn: &str, nsid: u32, state: AnaState) -> Result<(), TargetError> {
        if nsid == 0 || nsid == u32::MAX {
            return Err(TargetError::Nsid(nsid));
        }
        let backed = self
            .catalog
            .subsystem(nqn)
            .and_then(|s| s.namespaces.into_iter().find(|n| n.nsid == nsid))
            .map(|n| n.export.is_some());
        if backed == Some(false) && state.accessible() {
            return Err(TargetError::NoData {
                nqn: nqn.to_string(),
                nsid,
                state: state.name(),
            });
        }
        let g = self.ana_group(nqn, nsid);
        if g.state.swap(state as u8, AcqRel) == state as u8 {
            return Ok(());
        }
        g.changes.fetch_add(1, AcqRel);
        self.ana_changes.fetch_add(1, AcqRel);
        tracing::info!(
            subnqn = nqn,
            nsid,
            state = state.name(),
            "nvmf: ANA state changed"
        );
        let ctrls: Vec<Arc<Controller<T>>> = self
            .ctrls()
            .values()
            .filter(|c| c.subnqn == nqn)
            .cloned()
            .collect();
        for c in ctrls {
            let mut st = c.state();
            if st.aec & nvme::AEC_ANA_CHANGE != 0 && !st.aen.contains(&nvme::AEN_ANA_CHANGE) {
                st.aen.push_back(nvme::AEN_ANA_CHANGE);
            }
        }
        Ok(())
    }

    /// The ANA log of controller `c`: one group per namespace of its subsystem.
    pub(crate) fn ana_log(&self, c: &Controller<T>, groups_only: bool) -> Vec<u8> {
        let groups: Vec<AnaGroupDesc> = c
            .namespaces()
            .iter()
            .map(|n| {
                let g = self.ana_group(&c.subnqn, n.nsid);
                AnaGroupDesc {
                    grpid: n.nsid,
                    change_count: g.changes(),
                    state: g.state(n.export.is_some()),
                    nsids: vec![n.nsid],
                }
            })
            .collect();
        nvme::ana_log(self.ana_changes.load(Acquire), &groups, groups_only)
    }

    /// The paths to subsystem `nqn` through other nodes (`(traddr, trsvcid)` of their
    /// NVMe/TCP I/O listeners): a host reading this target's discovery log learns them
    /// with this target's own. Replaces what was set before; an empty list removes them.
    pub fn set_other_paths(&self, nqn: &str, paths: Vec<(String, String)>) {
        let mut m = self.other_paths.write_locked();
        let changed = if paths.is_empty() {
            m.remove(nqn).is_some()
        } else {
            m.insert(nqn.to_string(), paths.clone()).as_ref() != Some(&paths)
        };
        if changed {
            self.other_paths_gen.fetch_add(1, AcqRel);
        }
    }

    /// The discovery log's generation counter: changes with the catalog or the other
    /// paths.
    pub fn discovery_generation(&self) -> u64 {
        self.catalog
            .generation()
            .wrapping_add(self.other_paths_gen.load(Acquire))
    }

    /// Controllers connected to subsystem `nqn` (the node refuses some changes meanwhile).
    pub fn connected(&self, nqn: &str) -> usize {
        self.ctrls().values().filter(|c| c.subnqn == nqn).count()
    }

    /// A summary of every controller, for the management API.
    pub fn controllers(&self) -> Vec<ControllerSummary> {
        self.ctrls()
            .values()
            .map(|c| {
                let st = c.state();
                ControllerSummary {
                    cntlid: c.cntlid,
                    subnqn: c.subnqn.clone(),
                    hostnqn: c.hostnqn.clone(),
                    queues: st.queues.len(),
                    kato_ms: st.kato_ms,
                }
            })
            .collect()
    }

    /// The discovery log for `hostnqn`: every NVM subsystem it may connect to, on every
    /// I/O port, then the paths to subsystems through other nodes (see
    /// [`Target::set_other_paths`]) unless this target's own subsystem of that name
    /// refuses the host.
    pub fn discovery_entries(&self, hostnqn: &str) -> Vec<DiscoveryEntry> {
        let ports = self.ports();
        let adrfam = |traddr: &str| if traddr.contains(':') { 2 } else { 1 };
        let mut out = Vec::new();
        for nqn in self.catalog.subsystem_nqns() {
            let Some(s) = self.catalog.subsystem(&nqn) else {
                continue;
            };
            if !s.allows(hostnqn) {
                continue;
            }
            for p in ports.iter().filter(|p| p.io) {
                out.push(DiscoveryEntry {
                    subtype: 2,
                    portid: p.portid,
                    trsvcid: p.trsvcid.clone(),
                    traddr: p.traddr.clone(),
                    subnqn: nqn.clone(),
                    adrfam: adrfam(&p.traddr),
                });
            }
        }
        let other = self.other_paths.read_locked();
        for (nqn, paths) in other.iter() {
            if self
                .catalog
                .subsystem(nqn)
                .is_some_and(|s| !s.allows(hostnqn))
            {
                continue;
            }
            for (i, (traddr, trsvcid)) in paths.iter().enumerate() {
                let ours = ports
                    .iter()
                    .any(|p| p.io && p.traddr == *traddr && p.trsvcid == *trsvcid);
                if ours {
                    continue;
                }
                out.push(DiscoveryEntry {
                    subtype: 2,
                    // Port IDs of other nodes' ports: past this target's own.
                    portid: u16::try_from(0x100 + i).unwrap_or(u16::MAX),
                    trsvcid: trsvcid.clone(),
                    traddr: traddr.clone(),
                    subnqn: nqn.clone(),
                    adrfam: adrfam(traddr),
                });
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
pub struct ControllerSummary {
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
    pub queues: usize,
    pub kato_ms: u32,
}

pub struct Controller<T> {
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub discovery: bool,
    /// The host's keys when it must authenticate: every queue of this controller runs a
    /// DH-HMAC-CHAP transaction after its Connect.
    pub auth: Option<Arc<HostKeys>>,
    sub: RwLock<Option<Arc<SubsystemInfo<T>>>>,
    /// Bumped when the namespace list changes; I/O queues reopen their handles.
    pub ns_gen: AtomicU64,
    /// CSTS.RDY: I/O commands are refused (Command Sequence Error) while clear.
    pub ready: AtomicBool,
    /// The controller has ended; its queues are being shut down.
    pub dead: AtomicBool,
    /// Last Keep Alive (target clock, ms).
    pub last_ka: AtomicU64,
    st: Mutex<CtrlState>,
}

pub(crate) struct CtrlState {
    pub kato_ms: u32,
    pub aec: u32,
    pub cc: u32,
    pub csts: u32,
    /// I/O queues granted by Set Features (Number of Queues).
    pub io_queues: u16,
    /// Live queues: qid → socket, so that teardown can shut them down from any thread.
    pub queues: BTreeMap<u16, RawFd>,
    pub errors: VecDeque<ErrorEntry>,
    pub error_count: u64,
    pub changed: Vec<u32>,
    pub aen: VecDeque<u32>,
}

impl<T> Controller<T> {
    pub(crate) fn state(&self) -> MutexGuard<'_, CtrlState> {
        self.st.locked()
    }

    pub fn namespaces(&self) -> Vec<NamespaceEntry<T>> {
        self.sub
            .read_locked()
            .as_ref()
            .map(|s| s.namespaces.clone())
            .unwrap_or_default()
    }

    pub fn serial(&self) -> String {
        self.sub
            .read_locked()
            .as_ref()
            .map(|s| s.serial.clone())
            .unwrap_or_else(|| "tessera-discovery".into())
    }

    /// End the controller: mark it dead and shut down every queue's socket (their tasks
    /// then drain and close on their own cores). The sockets are registered under the
    /// lock and unregistered before they are closed, so no fd here is ever stale.
    pub(crate) fn fail(&self, why: &str) {
        if !self.dead.swap(true, AcqRel) && !why.is_empty() {
            warn!(
                cntlid = self.cntlid,
                subnqn = %self.subnqn,
                hostnqn = %self.hostnqn,
                "nvmf: controller ends: {why}"
            );
        }
        self.ready.store(false, Release);
        let st = self.state();
        for &fd in st.queues.values() {
            // SAFETY: fd is a live socket owned by a queue task, which unregisters it
            // (under this lock) before closing it.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }

    /// Shut down the I/O queues only (controller reset by CC.EN 1 → 0).
    pub(crate) fn reset_io_queues(&self, st: &CtrlState) {
        for (&qid, &fd) in &st.queues {
            if qid != 0 {
                // SAFETY: as in `fail`.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
            }
        }
    }

    /// Queues of this controller still running (a queue leaves when its I/O is done).
    pub fn live_queues(&self) -> usize {
        self.state().queues.len()
    }

    pub(crate) fn register_queue(&self, qid: u16, fd: RawFd) -> bool {
        let mut st = self.state();
        if self.dead.load(Acquire) || st.queues.contains_key(&qid) {
            return false;
        }
        st.queues.insert(qid, fd);
        true
    }

    pub(crate) fn unregister_queue(&self, qid: u16) {
        self.state().queues.remove(&qid);
    }

    pub(crate) fn record_error(&self, e: ErrorEntry) {
        let mut st = self.state();
        st.error_count += 1;
        let count = st.error_count;
        st.errors.push_front(ErrorEntry { count, ..e });
        st.errors.truncate(ERROR_LOG);
    }
}
