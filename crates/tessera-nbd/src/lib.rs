//! NBD export for Tessera volumes.
//!
//! - [`proto`]: wire constants and fixed-size codecs.
//! - [`handshake`]: the blocking fixed-newstyle option negotiation, run per connection on a
//!   control-plane thread before the connection is handed to a reactor core.
//! - [`client`]: a small blocking client used by tests and tools.
//! - [`conn`]: the transmission phase, served on a reactor core.

pub mod client;
pub mod conn;
pub mod handshake;
pub mod proto;
pub mod tls;
