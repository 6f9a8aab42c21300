//! iSCSI (RFC 7143) for Tessera volumes: a target that serves SCSI block commands over
//! the export layer, a sibling of NBD and NVMe/TCP that depends on neither.
//!
//! - [`pdu`]: the PDU codec (Basic Header Segment, AHS skipping, padding, CRC32C
//!   digests), strict and bounded.
//! - [`text`]: `key=value` text and the negotiation of the operational keys.
//! - [`auth`]: who may log in to a target: initiator allowlist, CHAP (one-way and
//!   mutual).
//! - [`login`]: the login phase of a connection (security and operational stages,
//!   discovery and normal sessions).
//! - [`scsi`]: CDB decoding, the data of INQUIRY/READ CAPACITY/MODE SENSE/REPORT LUNS,
//!   sense data.
//! - [`lu`]: what the connections serving one volume share: the ranges COMPARE AND
//!   WRITE and ORWRITE hold, and the persistent reservations.
//! - [`pr`]: persistent reservations (PERSISTENT RESERVE IN/OUT): the state machine,
//!   the conflict table, the form APTPL saves.
//! - [`alua`]: asymmetric access (implicit ALUA) for a target several nodes serve:
//!   target port groups, their states, REPORT TARGET PORT GROUPS.
//! - [`target`]: the named targets and their LUNs, SendTargets, session handles.
//! - [`accept`]: the listener, handing each connection to a reactor core.
//! - [`conn`]: one connection (one session) on a reactor core: a [`tessera_io::Task`]
//!   that does its I/O through the LUNs' per-core export handles.

pub mod accept;
pub mod alua;
pub mod auth;
pub mod conn;
pub mod login;
pub mod login_gate;
pub mod lu;
pub mod pdu;
pub mod pr;
pub mod scsi;
pub mod target;
pub mod text;
