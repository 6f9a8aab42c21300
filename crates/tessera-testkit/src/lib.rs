//! Helpers shared by Tessera's tests. A dev-dependency only: nothing here is in a
//! production build.
//!
//! - [`data`]: reproducible randomness and test data.
//! - [`blockio`]: one block operation at a time on a private core context, and a bulk
//!   read-back check.
//! - [`model_check`]: a seeded model checker: operation generator, stamped data, the
//!   model of what every volume may read back (after power loss too), the checker and
//!   the shrinker that prints a minimal replayable failing sequence.
//! - [`devices`]: devices that only tests need (a volatile write cache that loses writes
//!   at power loss; the crash device of `tessera-device`, built here with its
//!   `test-devices` feature), and fault wrapping of RAM devices.
//! - [`node`]: run a real `tessera` node process on loopback, talk to it with the CLI,
//!   restart it, kill it.
//! - [`etcd`]: a real etcd, one member or three, for cluster tests.
//! - [`mirror`]: one copy of a mirror damaged behind the node's back, and the checks that
//!   a scrub's or a resync's repair undid it.
//! - [`proxy`]: a TCP relay that adds delay and/or a bandwidth limit to one path.
//! - [`reactor`]: one reactor core in a thread, stopped on drop.

pub mod blockio;
pub mod data;
pub mod devices;
pub mod etcd;
pub mod mirror;
pub mod model_check;
pub mod netns;
pub mod node;
pub mod proxy;
pub mod reactor;
