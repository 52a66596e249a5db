//! The thin tokio layer: a listener, one task per connection, and the one keyspace they share.
//!
//! A connection task reads whatever bytes arrived, feeds them to its [`RequestParser`], applies
//! the completed requests to the shared [`StoreState`] under one short lock, and writes the replies
//! its [`ReplyQueue`] lets out. A request that completes another connection's wait sends that
//! connection the wait's id over its channel while the lock is held, so a wake-up is always queued
//! before anything that connection applies afterwards (which is what keeps `00 01` in that order).

use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::RdzvError;
use crate::tcpstore::TcpStoreLimits;
use crate::tcpstore::proto::{Request, RequestParser};
use crate::tcpstore::replies::ReplyQueue;
use crate::tcpstore::state::{ConnId, StoreState, WaitId};

/// The listen backlog asked for; the kernel caps it at `net.core.somaxconn`. Thousands of ranks
/// connect at once when a job starts, and a full backlog costs each late one a SYN retry.
const LISTEN_BACKLOG: u32 = 65_535;
/// A connection stops reading while this many reply bytes are held behind one of its pending
/// waits (only a client that pipelines behind a WAIT gets there; torch's client never does).
const MAX_HELD_BYTES: usize = 16 << 20;
/// A connection stops reading while it has this many pending waits (torch's client has one).
const MAX_PENDING_WAITS: usize = 1024;
/// Bytes read per `read` call. The buffer is per worker thread, not per connection, so 10,000 idle
/// connections hold no read buffers.
const READ_CHUNK: usize = 64 << 10;
/// A write buffer larger than this is freed after use rather than kept for the next reply.
const KEEP_WRITE_BUFFER: usize = 64 << 10;
/// Pause after a failed `accept` (out of file descriptors, typically) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);
/// TCP keepalive: a peer that vanished without a FIN (host died) is found after about
/// `KEEPALIVE_IDLE + 3 * KEEPALIVE_INTERVAL`, and its waits are dropped.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

thread_local! {
    static READ_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0; READ_CHUNK]);
}

/// Counts for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpStoreStats {
    /// Open client connections.
    pub n_connections: usize,
    /// Keys in the key-value namespace.
    pub n_keys: usize,
    /// Non-empty queues.
    pub n_queues: usize,
    /// Bytes of keys and values held.
    pub n_bytes: usize,
    /// Pending WAITs and BARRIERs.
    pub n_waits: usize,
}

/// A running TCPStore server: one listener, one keyspace. Dropping it (or [`shutdown`]) closes the
/// listener and every connection; the next server starts empty.
///
/// [`shutdown`]: TcpStoreServer::shutdown
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// A child of the token given to `start`: cancelling either stops this server.
    cancel: CancellationToken,
    tracker: TaskTracker,
}

#[derive(Debug)]
struct Shared {
    limits: TcpStoreLimits,
    inner: Mutex<Inner>,
    n_connections: AtomicUsize,
    next_conn: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    state: StoreState,
    /// Where to send the ids of a connection's completed waits.
    wakers: HashMap<ConnId, mpsc::UnboundedSender<WaitId>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The critical sections only call the pure core, which does not panic on any input; if it
        // ever did, the connection that hit it is gone and the keyspace is still the best we have.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Applies `reqs` (drained) for `conn`, queueing its replies and sending other connections'
    /// wake-ups. Stops at the first request that must close the connection.
    fn apply(&self, conn: ConnId, reqs: &mut Vec<Request>, queue: &mut ReplyQueue) -> Result<(), RdzvError> {
        let mut guard = self.lock();
        let Inner { state, wakers } = &mut *guard;
        for req in reqs.drain(..) {
            let applied = state.apply(conn, req)?;
            queue.cancelled(&applied.cancelled);
            queue.push(applied.reply);
            for id in applied.woken {
                if id.conn() == conn {
                    queue.woken(id);
                } else if let Some(tx) = wakers.get(&id.conn()) {
                    // A closed channel means that connection is ending; its waits go with it.
                    let _ = tx.send(id);
                }
            }
        }
        Ok(())
    }
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves an empty keyspace until `shutdown` is
    /// cancelled, [`TcpStoreServer::shutdown`] is called, or the server is dropped.
    ///
    /// The protocol has no authentication: bind to loopback or to the job's own network, never to
    /// every interface by default.
    ///
    /// Synchronous (binding is one system call), so the rendezvous executor can start a round's
    /// store while it applies the command that formed the round. Must be called inside a tokio
    /// runtime (the listener registers with its reactor).
    ///
    /// # Errors
    /// A limit of zero, or an address that cannot be bound ([`RdzvError::InvalidArgument`]).
    pub fn start(addr: SocketAddr, limits: TcpStoreLimits, shutdown: CancellationToken) -> Result<TcpStoreServer, RdzvError> {
        limits.validate()?;
        let listener = bind(addr).map_err(|e| RdzvError::invalid("listen", format!("cannot bind {addr}: {e}")))?;
        let local_addr = listener.local_addr().map_err(|e| RdzvError::invalid("listen", format!("listener address of {addr}: {e}")))?;
        let shared = Arc::new(Shared {
            limits,
            inner: Mutex::new(Inner { state: StoreState::new(limits.max_total_bytes), wakers: HashMap::new() }),
            n_connections: AtomicUsize::new(0),
            next_conn: AtomicU64::new(0),
        });
        let cancel = shutdown.child_token();
        let tracker = TaskTracker::new();
        tracker.spawn(accept_loop(listener, shared.clone(), tracker.clone(), cancel.clone()));
        tracing::info!(%local_addr, "tcpstore listening");
        Ok(TcpStoreServer { local_addr, shared, cancel, tracker })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Counts for metrics.
    pub fn stats(&self) -> TcpStoreStats {
        let s = self.shared.lock().state.stats();
        TcpStoreStats {
            n_connections: self.shared.n_connections.load(Ordering::Relaxed),
            n_keys: s.n_keys,
            n_queues: s.n_queues,
            n_bytes: s.n_bytes,
            n_waits: s.n_waits,
        }
    }

    /// Stops listening, closes every connection and waits until all of its tasks have ended.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        tracing::debug!(local_addr = %self.local_addr, "tcpstore stopped");
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        // The tasks see the cancellation and close their sockets; `shutdown` also waits for that.
        self.cancel.cancel();
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, tracker: TaskTracker, cancel: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                if let Err(e) = configure(&stream) {
                    tracing::debug!(%peer, error = %e, "tcpstore: cannot set socket options");
                }
                let conn = ConnId(shared.next_conn.fetch_add(1, Ordering::Relaxed));
                shared.n_connections.fetch_add(1, Ordering::Relaxed);
                tracker.spawn(serve_conn(shared.clone(), stream, peer, conn, cancel.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "tcpstore: accept failed (out of file descriptors? raise RLIMIT_NOFILE)");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(ACCEPT_RETRY) => {}
                }
            }
        }
    }
}

fn configure(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let keepalive = socket2::TcpKeepalive::new().with_time(KEEPALIVE_IDLE).with_interval(KEEPALIVE_INTERVAL);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

async fn serve_conn(shared: Arc<Shared>, mut stream: TcpStream, peer: SocketAddr, conn: ConnId, cancel: CancellationToken) {
    let (tx, rx) = mpsc::unbounded_channel();
    shared.lock().wakers.insert(conn, tx);
    // Logged while the socket is still open, so the line is out before the peer sees the close.
    match conn_loop(&shared, &mut stream, peer, conn, rx, &cancel).await {
        Ok(()) => tracing::trace!(%peer, "tcpstore: connection closed"),
        Err(e) => tracing::warn!(%peer, error = %e, "tcpstore: closing the connection"),
    }
    {
        let mut inner = shared.lock();
        inner.wakers.remove(&conn);
        inner.state.disconnect(conn);
    }
    shared.n_connections.fetch_sub(1, Ordering::Relaxed);
    drop(stream);
}

/// What one read produced.
enum Read {
    /// Bytes were parsed (maybe into requests; maybe ending in a violation).
    Parsed(Result<(), RdzvError>),
    /// Spurious readiness.
    WouldBlock,
    /// End of stream or a socket error: the peer is gone.
    Closed,
}

/// Serves one connection until the peer closes it, it breaks the protocol or a limit (the error),
/// or the server shuts down.
async fn conn_loop(
    shared: &Shared,
    stream: &mut TcpStream,
    peer: SocketAddr,
    conn: ConnId,
    mut wakes: mpsc::UnboundedReceiver<WaitId>,
    cancel: &CancellationToken,
) -> Result<(), RdzvError> {
    let mut parser = RequestParser::new(shared.limits.parse_limits());
    let mut queue = ReplyQueue::new();
    let mut reqs = Vec::new();
    let mut out = Vec::new();
    loop {
        let may_read = queue.n_bytes() <= MAX_HELD_BYTES && queue.n_pending() < MAX_PENDING_WAITS;
        let mut violation = Ok(());
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            Some(id) = wakes.recv() => queue.woken(id),
            r = stream.readable(), if may_read => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "tcpstore: read failed");
                    return Ok(());
                }
                let read = READ_BUF.with_borrow_mut(|buf| match stream.try_read(buf) {
                    Ok(0) => Read::Closed,
                    Ok(n) => Read::Parsed(parser.feed(&buf[..n], &mut reqs)),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Read::WouldBlock,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "tcpstore: read failed");
                        Read::Closed
                    }
                });
                match read {
                    Read::Closed => return Ok(()),
                    Read::WouldBlock => continue,
                    Read::Parsed(r) => violation = r,
                }
                if !reqs.is_empty() {
                    // Requests parsed before a violation are still served, as they would be by torch.
                    let applied = shared.apply(conn, &mut reqs, &mut queue);
                    if violation.is_ok() {
                        violation = applied;
                    }
                }
            }
        }
        while let Ok(id) = wakes.try_recv() {
            queue.woken(id);
        }
        queue.take_ready(&mut out);
        if !out.is_empty() {
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                r = stream.write_all(&out) => if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "tcpstore: write failed");
                    return Ok(());
                },
            }
            out.clear();
            if out.capacity() > KEEP_WRITE_BUFFER {
                out = Vec::new();
            }
        }
        violation?;
    }
}
