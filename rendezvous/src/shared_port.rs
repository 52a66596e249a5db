//! One port for the rendezvous and PyTorch's store: a service of one job (embedded in its
//! launcher: `--standalone`, torchrun's static backend at `--master-addr:--master-port`, a
//! launcher hosting its own c10d endpoint, a pod hosting `PET_MASTER_PORT`) serves the running
//! round's TCPStore on its own port too, so workers get that port as `MASTER_PORT`, as torchrun's
//! workers get `--master-port`, and a firewall or a Kubernetes Service that opens only that port
//! is enough.
//!
//! Each connection's first byte tells the protocols apart ([`classify`], the pure core): gRPC over
//! HTTP/2 opens with the client preface `PRI * HTTP/2.0` and TLS with a handshake record (0x16),
//! while torch's store client opens with VALIDATE (0x00, since torch 2.2; 0x03 before, which the
//! store refuses by name). The accept loop here (the I/O) peeks that byte without taking it, with
//! a deadline, and hands the connection to tonic or to the running round's store
//! ([`crate::tcpstore::TcpStoreServer::adopt`]), which reads the byte as its own listener's
//! connections do. A store connection while no round runs is closed (workers start only once their
//! round runs; torch 2.5 and later retry a closed connect, VALIDATE and PING until their timeout).
//!
//! The port carries no round: a worker of an ended round that connects again lands in the next
//! round's store, as under torchrun's one agent store (where the attempt's key prefix keeps them
//! apart; rsrun stops a round's workers before its node joins the next one). A daemon of many jobs
//! keeps a port per round, which such a straggler cannot reach.
//!
//! Every service accepts through [`serve`], shared port or not: it waits between failed accepts
//! where tonic's own loop over a listener would retry at once.

use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::service::Core;
use crate::tcpstore::server::{ACCEPT_RETRY, accept_error_is_transient};

/// What a connection speaks, from its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// gRPC: HTTP/2's client preface (`P`), or a TLS handshake record.
    Grpc,
    /// Anything else: PyTorch's TCPStore (VALIDATE is 0x00); the store refuses what is not.
    TcpStore,
}

/// The protocol a connection that opened with `first` speaks.
pub fn classify(first: u8) -> Protocol {
    match first {
        b'P' | 0x16 => Protocol::Grpc,
        _ => Protocol::TcpStore,
    }
}

/// How long a new connection may take to send its first byte (both clients send theirs at once).
const FIRST_BYTE_WAIT: Duration = Duration::from_secs(10);

/// Accepts on `listener` until `cancel`: gRPC connections come out of the returned channel (for
/// tonic's `serve_with_incoming`); with a `shared_job`, store connections go to that job's running
/// round's store, and without one every connection is gRPC's. A failed `accept` (out of file
/// descriptors, typically) is retried after [`ACCEPT_RETRY`] rather than at once: tonic's own
/// loop over a listener stream retries at once, a busy loop for as long as descriptors are short.
pub(crate) fn serve(
    listener: TcpListener,
    core: std::sync::Arc<Core>,
    shared_job: Option<String>,
    cancel: CancellationToken,
    tracker: &TaskTracker,
) -> mpsc::Receiver<std::io::Result<TcpStream>> {
    let (tx, rx) = mpsc::channel(64);
    let sniffers = tracker.clone();
    tracker.spawn(async move {
        // Failed accepts in a row: the first of a streak is logged, then one in 100 (5 s).
        let mut failing = 0u64;
        loop {
            let accepted = tokio::select! {
                () = cancel.cancelled() => return,
                a = listener.accept() => a,
            };
            let stream = match accepted {
                Ok((stream, _)) => {
                    if failing > 0 {
                        tracing::info!(failed = failing, "accepting connections again");
                        failing = 0;
                    }
                    stream
                }
                // A connection that failed before it was taken: the next one may be fine.
                Err(err) if accept_error_is_transient(&err) => continue,
                Err(err) => {
                    if failing.is_multiple_of(100) {
                        tracing::warn!(%err, failed = failing + 1, "accept failed (out of file descriptors? raise RLIMIT_NOFILE)");
                    }
                    failing += 1;
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(ACCEPT_RETRY) => continue,
                    }
                }
            };
            let Some(job) = &shared_job else {
                let _ = stream.set_nodelay(true);
                // The server is gone when the channel is closed: the accept loop ends.
                if tx.send(Ok(stream)).await.is_err() {
                    return;
                }
                continue;
            };
            let (tx, core, job, cancel) = (tx.clone(), core.clone(), job.clone(), cancel.clone());
            sniffers.spawn(async move {
                let mut first = [0u8; 1];
                let peeked = tokio::select! {
                    () = cancel.cancelled() => return,
                    p = tokio::time::timeout(FIRST_BYTE_WAIT, stream.peek(&mut first)) => p,
                };
                let peer = stream.peer_addr().ok();
                match peeked {
                    Ok(Ok(1..)) => {}
                    Ok(Ok(0)) => return,
                    Ok(Err(err)) => {
                        tracing::debug!(?peer, %err, "a connection failed before its first byte");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(?peer, "no first byte within {FIRST_BYTE_WAIT:?}: connection closed");
                        return;
                    }
                }
                match classify(first[0]) {
                    Protocol::Grpc => {
                        let _ = stream.set_nodelay(true);
                        // The server is gone when the channel is closed: the connection closes.
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Protocol::TcpStore => match stream.into_std() {
                        Ok(s) => {
                            if !core.adopt_store_connection(&job, s) {
                                tracing::debug!(?peer, job, "a store connection no running round's store took: closed");
                            }
                        }
                        Err(err) => tracing::debug!(?peer, %err, "cannot hand a store connection over: closed"),
                    },
                }
            });
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_byte_names_the_protocol() {
        assert_eq!(classify(b"PRI * HTTP/2.0"[0]), Protocol::Grpc);
        assert_eq!(classify(0x16), Protocol::Grpc, "a TLS handshake");
        assert_eq!(classify(0x00), Protocol::TcpStore, "VALIDATE");
        assert_eq!(classify(0x03), Protocol::TcpStore, "torch before 2.2: the store refuses it");
        assert_eq!(classify(b'G'), Protocol::TcpStore, "HTTP/1 is neither: the store refuses it");
    }
}
