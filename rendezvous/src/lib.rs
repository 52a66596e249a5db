//! rsrun's rendezvous service and its client.
//!
//! - [`state`]: the pure state machine (membership, rounds, store, barriers, unique ids).
//! - [`journal`]: durable state (fsync'd append log + snapshot compaction).
//! - [`logstore`]: the seam between the executor and its log (the file journal, or etcd).
//! - [`ha`]: highly available daemons: active/standby over a fenced log in etcd.
//! - [`service`]: the executor that stamps commands with time, applies, journals and wakes waiters,
//!   and the gRPC handlers over it.
//! - [`server`]: serving (listen, auth, TLS, metrics, shutdown) and the embedded in-memory mode.
//! - [`client`]: the typed async client used by the launcher and the worker runtime.
//! - [`files`]: reading configuration files (tokens, certificates) with a deadline.
//! - [`logging`]: the binaries' log filter from `RSRUN_LOG`/`RUST_LOG`.
//! - [`rlimit`]: raising the open-file limit of a process that serves many connections.
//! - [`tcpstore`]: a server (and a small client) for PyTorch's TCPStore protocol, so unmodified torch
//!   workers can use a store that rsrun serves.
#![warn(missing_docs)]

pub mod auth;
pub mod client;
mod error;
pub mod files;
pub mod ha;
pub mod journal;
pub mod logging;
pub mod logstore;
pub mod metrics;
pub mod rlimit;
mod round_stores;
pub mod server;
pub mod shared_port;
pub mod service;
pub mod state;
pub mod tcpstore;
pub mod validate;

pub use error::RdzvError;
/// The generated wire types (`rsrun.v1`).
pub use rsrun_proto::v1 as proto;
