//! A server for PyTorch's TCPStore protocol, so that unmodified torch workers (started with
//! `TORCHELASTIC_USE_AGENT_STORE=True` and `MASTER_ADDR`/`MASTER_PORT` naming it) use a store that
//! rsrun serves instead of rank 0.
//!
//! A pure core plus thin I/O:
//!
//! - [`proto`]: the wire format (torch ≥ 2.2, commands 0 – 18 as numbered in 2.12 – 2.15), an
//!   incremental request parser and the request/reply encoders;
//! - [`state`]: the keyspace, queues, waits and barriers; applying a request returns its reply and
//!   the other connections' waits it completed, and does no I/O;
//! - [`replies`]: per-connection reply ordering around pending waits;
//! - `shed`: which connections to close when the server holds too much for all of them (not
//!   one whose bytes move at a reasonable rate, its peer taking its replies or sending the
//!   request it is in the middle of, until the server holds twice its budget: then the slowest);
//! - [`server`]: [`TcpStoreServer`], one event-loop thread (mio/epoll) per server that owns the
//!   listener, the connections and the keyspace;
//! - [`client`]: [`TcpStoreClient`], a small raw-protocol client for tests and probes.
//!
//! The protocol has no authentication and torch pickles state through it: bind a server to
//! loopback or to the job's own interface, never to every interface by default. One server is one
//! keyspace; a job attempt gets a fresh server (so no attempt reads its predecessor's keys).
//!
//! ```no_run
//! # async fn demo() -> Result<(), rsrun_rendezvous::RdzvError> {
//! use rsrun_rendezvous::tcpstore::{TcpStoreClient, TcpStoreLimits, TcpStoreServer};
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! let server = TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), TcpStoreLimits::default(), shutdown)?;
//! let mut client = TcpStoreClient::connect(server.local_addr()).await?;
//! client.set(b"/k", b"v").await?;
//! assert_eq!(client.get(b"/k").await?, b"v");
//! server.shutdown().await;
//! # Ok(()) }
//! ```

pub mod client;
pub mod proto;
pub mod replies;
pub mod server;
mod shed;
pub mod state;

pub use client::TcpStoreClient;
pub use server::{TcpStoreServer, TcpStoreStats};

use crate::RdzvError;
use proto::ParseLimits;

/// Caps on what one connection may send and what the keyspace may hold. A connection that goes
/// over one is closed and the server logs a line naming the peer and the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpStoreLimits {
    /// Largest key or queue name, bytes. torch's libuv server allows 8 KiB.
    pub max_key_bytes: usize,
    /// Largest value, bytes. torch's libuv server allows 8 MiB.
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET. torch's libuv server allows 128 Ki.
    pub max_keys_per_request: usize,
    /// Largest single request on the wire, bytes (a MULTI_SET of many values, a WAIT of many keys).
    pub max_request_bytes: usize,
    /// Most bytes of keys and values the keyspace holds (queues included).
    pub max_total_bytes: usize,
    /// Most client connections open at once; one more is closed at once, with a log line.
    pub max_connections: usize,
    /// Most bytes the server holds for all connections together in requests not yet applied
    /// (partly read, or parsed and held back) and replies not yet taken by their peers. Past it,
    /// connections that hold bytes nobody moves (replies their peer does not take, requests it
    /// does not finish) are closed, with a log line, until it holds less: those whose peer ended
    /// its stream first, then the largest. A connection whose bytes move at a reasonable rate
    /// (64 KiB/s) either way, its peer taking its replies or sending the rest of the request it
    /// is in the middle of, is spared, however much it holds: a rank downloading or uploading a
    /// large value is not closed for it. Twice this is a hard ceiling: past it, moving connections
    /// are closed too, the slowest first, until the server holds at most twice this. So a peer
    /// cannot make the daemon grow by opening many connections that never finish a request or
    /// never read, nor past twice this by trickling into many (each one alone is held to about
    /// `max_request_bytes` and 16 MiB of replies).
    pub max_buffered_bytes: usize,
    /// A connection that has not sent its handshake, or that stopped in the middle of a request,
    /// is closed after this long without a byte (idle time between requests is never limited:
    /// torch's clients hold their connection for the whole job). A peer that ended its stream
    /// (shutdown of its write side) still gets its replies, and is closed after this long
    /// without taking a byte of them.
    pub stall_timeout: std::time::Duration,
}

impl Default for TcpStoreLimits {
    /// torch's libuv caps (8 KiB keys, 8 MiB values, 128 Ki keys per request), 64 MiB per request,
    /// 1 GiB per keyspace, 50,000 connections, 1 GiB buffered over all connections, 60 s to
    /// finish a handshake or a started request.
    fn default() -> Self {
        TcpStoreLimits {
            max_key_bytes: 8 << 10,
            max_value_bytes: 8 << 20,
            max_keys_per_request: 128 << 10,
            max_request_bytes: 64 << 20,
            max_total_bytes: 1 << 30,
            max_connections: 50_000,
            max_buffered_bytes: 1 << 30,
            stall_timeout: std::time::Duration::from_secs(60),
        }
    }
}

impl TcpStoreLimits {
    /// The parser's share of the caps.
    pub fn parse_limits(&self) -> ParseLimits {
        ParseLimits {
            max_key_bytes: self.max_key_bytes,
            max_value_bytes: self.max_value_bytes,
            max_keys_per_request: self.max_keys_per_request,
            max_request_bytes: self.max_request_bytes,
        }
    }

    /// # Errors
    /// [`RdzvError::InvalidArgument`] naming a limit that is zero or above its ceiling (1 GiB
    /// for sizes on the wire, 16 Mi keys per request, 1 TiB held), so the parser's arithmetic
    /// on them cannot overflow.
    pub fn validate(&self) -> Result<(), RdzvError> {
        for (name, v, max) in [
            ("max_key_bytes", self.max_key_bytes, 1 << 30),
            ("max_value_bytes", self.max_value_bytes, 1 << 30),
            ("max_keys_per_request", self.max_keys_per_request, 1 << 24),
            ("max_request_bytes", self.max_request_bytes, 1 << 30),
            ("max_total_bytes", self.max_total_bytes, 1 << 40),
            ("max_connections", self.max_connections, 1 << 24),
            ("max_buffered_bytes", self.max_buffered_bytes, 1 << 40),
        ] {
            if v == 0 {
                return Err(RdzvError::invalid(name, "0: must be at least 1"));
            }
            if v > max {
                return Err(RdzvError::invalid(name, format!("{v}: must be at most {max}")));
            }
        }
        // The largest key with the largest value must make a request the parser accepts (a SET
        // of both is 1 + 8 + key + 8 + value bytes): else the value cap is one no SET can reach.
        let largest_set = self.max_key_bytes + self.max_value_bytes + 17;
        if largest_set > self.max_request_bytes {
            return Err(RdzvError::invalid(
                "max_request_bytes",
                format!(
                    "{}: a SET of the largest key ({} bytes) and value ({} bytes) takes {largest_set}; raise it or lower those",
                    self.max_request_bytes, self.max_key_bytes, self.max_value_bytes
                ),
            ));
        }
        if self.stall_timeout.is_zero() {
            return Err(RdzvError::invalid("stall_timeout", "0: must be longer than zero"));
        }
        Ok(())
    }
}
