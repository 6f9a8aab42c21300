//! NVMe over Fabrics, TCP transport, for Tessera volumes.
//!
//! - [`pdu`]: the NVMe/TCP PDU codec (common header, ICReq/ICResp, capsules, data PDUs,
//!   R2T, termination requests), digests, and the strict header validation that yields the
//!   fatal error status (FES) a termination request must carry.
//! - [`nvme`]: NVMe structures: submission and completion queue entries, status codes,
//!   SGL descriptors, Fabrics commands, Identify data, log pages and features.
//! - [`target`]: subsystems (from a catalog the node implements), controllers shared by
//!   their queues, the accept loop.
//! - [`queue`]: one queue connection (admin or I/O), a reactor [`tessera_io::Task`].
//! - [`auth`]: in-band authentication (DH-HMAC-CHAP): secrets, the primitives, the
//!   messages, and the controller's and the host's ends of a transaction.
//! - [`initiator`]: a blocking host for tools and tests, and the pipelined queue the perf
//!   load generator drives.

pub mod auth;
pub mod initiator;
pub mod nvme;
pub mod pdu;
pub mod queue;
pub mod target;
