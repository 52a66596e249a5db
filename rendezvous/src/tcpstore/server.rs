//! The thin I/O layer: one event-loop thread per server (mio, i.e. epoll on Linux) owns the
//! listener, every connection and the keyspace.
//!
//! One turn of the loop: wait for readiness; accept what is pending; for each readable connection
//! read what arrived, feed it to its [`RequestParser`] and apply every completed request to the
//! [`StoreState`] in order, queueing the replies in its [`ReplyQueue`]; a request that completes
//! another connection's wait marks that wait done in the other queue right away; then every
//! connection that got replies this turn writes them in one `write` call. So a burst of pipelined
//! requests costs one read and one write, and nothing is allocated, woken or locked per request
//! beyond the core's own work.
//!
//! Ordering needs no channel: the loop applies requests and wake-ups one at a time, so a wake-up
//! is in its connection's queue before anything that connection sends afterwards is applied (which
//! is what keeps `00 01` in that order), and each queue hands out its replies in request order.
//!
//! A peer that ends its side of the stream (a `shutdown(SHUT_WR)` after its last request, or a
//! close) is not closed at once: every request it sent is applied and answered, and the
//! connection closes once its last reply is written (or after `stall_timeout` without the peer
//! taking a byte of them). Its pending WAITs and BARRIERs are dropped when its stream ends, as
//! torch's servers do when a client goes: it can no longer cancel them and the server has no
//! deadline for them; the replies to its requests after the first such wait go with it (alone,
//! they would read as that wait's answer).
//!
//! Why a thread and not a tokio task per connection: a store is a single keyspace whose requests
//! are a few hundred nanoseconds of work each, so per-request task wake-ups, cross-thread channels
//! and the keyspace lock cost more than the work (and, on a machine the workers share, the CPU the
//! workers need). The thread sleeps in `epoll_wait` when no client sends anything.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use tokio_util::sync::CancellationToken;

use crate::RdzvError;
use crate::tcpstore::TcpStoreLimits;
use crate::tcpstore::proto::{Request, RequestParser};
use crate::tcpstore::replies::ReplyQueue;
use crate::tcpstore::shed::{self, Drain, Holder};
use crate::tcpstore::state::{ConnId, Reply, StoreState, WaitId};

/// The listen backlog asked for; the kernel caps it at `net.core.somaxconn`. Thousands of ranks
/// connect at once when a job starts, and a full backlog costs each late one a SYN retry.
const LISTEN_BACKLOG: i32 = 65_535;
/// A connection stops reading while this many reply bytes are held behind one of its pending
/// waits, or are waiting for the peer to read them (only a client that pipelines behind a WAIT, or
/// never reads, gets there; torch's client does neither).
const MAX_HELD_BYTES: usize = 16 << 20;
/// A connection stops reading while it has this many pending waits (torch's client has one).
const MAX_PENDING_WAITS: usize = 1024;
/// Bytes read per `read` call. The buffer belongs to the loop, not to a connection, so 10,000 idle
/// connections hold no read buffers.
const READ_CHUNK: usize = 64 << 10;
/// Full reads of one connection per turn before the others get their turn (the rest is read on
/// the next turn).
const READS_PER_TURN: usize = 4;
/// Connections accepted per turn before the open ones get their turn.
const ACCEPTS_PER_TURN: usize = 1024;
/// A write buffer larger than this is freed after use rather than kept for the next reply.
const KEEP_WRITE_BUFFER: usize = 64 << 10;
/// While only connections that drain hold the server past `max_buffered_bytes` (and under twice
/// it), shedding looks again this much later, not every turn (each look walks every connection).
const SHED_RECHECK: Duration = Duration::from_millis(100);
/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 1024;
/// Pause after a failed `accept` (out of file descriptors, typically) before trying again; the
/// rendezvous service's accept loop (`crate::shared_port`) pauses as long.
pub(crate) const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// An `accept` error that concerns one connection only (it was aborted before it was taken, or
/// the call was interrupted): the next `accept` may succeed at once, with no pause.
pub(crate) fn accept_error_is_transient(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted)
}
/// TCP keepalive: a peer that vanished without a FIN (host died) is found after about
/// `KEEPALIVE_IDLE + 3 * KEEPALIVE_INTERVAL`, and its waits are dropped.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);

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
    /// The most reply bytes one connection has held at once (built, not yet taken by its peer):
    /// about 16 MiB plus one reply at most, however a peer pipelines.
    pub peak_held_bytes: usize,
    /// Bytes held now for all connections together: requests not yet applied and replies not
    /// yet taken (see [`super::TcpStoreLimits::max_buffered_bytes`]).
    pub buffered_bytes: usize,
    /// Connections closed because the server held more than `max_buffered_bytes`.
    pub shed_connections: u64,
}

/// A running TCPStore server: one listener, one keyspace, one event-loop thread. Dropping it (or
/// [`shutdown`]) closes the listener and every connection; the next server starts empty.
///
/// [`shutdown`]: TcpStoreServer::shutdown
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// A child of the token given to `start`: cancelling either stops this server.
    cancel: CancellationToken,
    waker: Arc<Waker>,
    /// Fires when the loop thread has closed everything and is about to end.
    stopped: Option<tokio::sync::oneshot::Receiver<()>>,
}

#[derive(Debug)]
struct Shared {
    /// Locked by the loop once per turn, and by [`TcpStoreServer::stats`].
    state: Mutex<StoreState>,
    n_connections: AtomicUsize,
    /// The most reply bytes one connection has held at once (see [`TcpStoreStats`]).
    peak_held_bytes: AtomicUsize,
    /// Bytes buffered over all connections at the end of the last turn (see [`TcpStoreStats`]).
    buffered_bytes: AtomicUsize,
    /// Connections closed for the store-wide budget.
    shed_connections: AtomicU64,
    /// Connections accepted elsewhere and handed over ([`TcpStoreServer::adopt`]), for the loop
    /// to take on its next turn.
    adopted: Mutex<Vec<(std::net::TcpStream, SocketAddr)>>,
    /// The loop has ended (stopped, or its `epoll_wait` failed): nothing is adopted any more.
    stopped: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, StoreState> {
        // The loop only calls the pure core under the lock, which does not panic on any input; if
        // it ever did, the loop is gone and the keyspace is still the best answer for `stats`.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves an empty keyspace until `shutdown` is
    /// cancelled, [`TcpStoreServer::shutdown`] is called, or the server is dropped.
    ///
    /// The protocol has no authentication: bind to loopback or to the job's own network, never to
    /// every interface by default.
    ///
    /// Synchronous (binding is a few system calls), so the rendezvous executor can start a round's
    /// store while it applies the command that formed the round. Must be called inside a tokio
    /// runtime (a task there turns the cancellation of `shutdown` into a wake-up of the loop).
    /// The loop logs into the span and subscriber current at the call.
    ///
    /// # Errors
    /// A limit of zero, or an address that cannot be bound ([`RdzvError::InvalidArgument`]).
    pub fn start(addr: SocketAddr, limits: TcpStoreLimits, shutdown: CancellationToken) -> Result<TcpStoreServer, RdzvError> {
        limits.validate()?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| RdzvError::invalid("tcpstore", "TcpStoreServer::start must be called inside a tokio runtime"))?;
        let bind_err = |e: std::io::Error| RdzvError::invalid("listen", format!("cannot bind {addr}: {e}"));
        let listener = bind(addr).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(|e| RdzvError::invalid("listen", format!("listener address of {addr}: {e}")))?;
        let poll = Poll::new().map_err(bind_err)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).map_err(bind_err)?);
        let shared = Arc::new(Shared { state: Mutex::new(StoreState::with_limits(&limits)), n_connections: AtomicUsize::new(0),
            peak_held_bytes: AtomicUsize::new(0),
            buffered_bytes: AtomicUsize::new(0),
            shed_connections: AtomicU64::new(0),
            adopted: Mutex::new(Vec::new()),
            stopped: std::sync::atomic::AtomicBool::new(false),
        });
        let cancel = shutdown.child_token();
        let (stopped_tx, stopped) = tokio::sync::oneshot::channel();
        let mut event_loop = EventLoop::new(poll, listener, shared.clone(), limits, cancel.clone()).map_err(bind_err)?;
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let span = tracing::info_span!("tcpstore", addr = %local_addr);
        // The loop thread holds the waker as long as it runs: closing an eventfd drops its pending
        // event from the epoll set, so a wake-up followed at once by the server's drop (the last
        // other holder) could otherwise vanish before `epoll_wait` saw it, and the loop would
        // sleep with its sockets open.
        let loop_waker = waker.clone();
        std::thread::Builder::new()
            .name(format!("tcpstore-{}", local_addr.port()))
            .spawn(move || {
                let _waker = loop_waker;
                tracing::dispatcher::with_default(&dispatch, || {
                    let _entered = span.enter();
                    if let Err(e) = event_loop.run() {
                        tracing::error!(error = %e, "tcpstore: the event loop failed; the store is closed");
                    }
                    // Refuse what is handed over from now on, and close what was handed over and
                    // not taken (under the lock `adopt` pushes under: nothing slips in between).
                    let shared = event_loop.shared.clone();
                    {
                        let mut adopted = shared.adopted.lock().unwrap_or_else(|p| p.into_inner());
                        shared.stopped.store(true, Ordering::Relaxed);
                        adopted.clear();
                    }
                    drop(event_loop);
                    tracing::debug!("tcpstore stopped");
                });
                let _ = stopped_tx.send(());
            })
            .map_err(|e| RdzvError::invalid("tcpstore", format!("cannot start the event-loop thread: {e}")))?;
        // Turns the token's cancellation (ours or the parent's) into a wake-up of the loop.
        let (token, w) = (cancel.clone(), waker.clone());
        runtime.spawn(async move {
            token.cancelled().await;
            let _ = w.wake();
        });
        tracing::info!(%local_addr, "tcpstore listening");
        Ok(TcpStoreServer { local_addr, shared, cancel, waker, stopped: Some(stopped) })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves a connection accepted elsewhere (a port shared with another protocol, see
    /// `crate::shared_port`) as if this server's listener had accepted it. Bytes the peer sent
    /// that are still in the socket (a peeked handshake) are read as usual.
    ///
    /// # Errors
    /// The socket cannot be made non-blocking or has no peer address, or the server has stopped
    /// (the connection is dropped, closed).
    pub fn adopt(&self, stream: std::net::TcpStream) -> std::io::Result<()> {
        stream.set_nonblocking(true)?;
        let peer = stream.peer_addr()?;
        {
            let mut adopted = self.shared.adopted.lock().unwrap_or_else(|p| p.into_inner());
            if self.shared.stopped.load(Ordering::Relaxed) {
                return Err(std::io::Error::new(ErrorKind::NotConnected, "the store has stopped"));
            }
            adopted.push((stream, peer));
        }
        // The connection is queued: a failed wake-up only delays it to the loop's next turn.
        let _ = self.waker.wake();
        Ok(())
    }

    /// Counts for metrics.
    pub fn stats(&self) -> TcpStoreStats {
        let s = self.shared.lock().stats();
        TcpStoreStats {
            n_connections: self.shared.n_connections.load(Ordering::Relaxed),
            n_keys: s.n_keys,
            n_queues: s.n_queues,
            n_bytes: s.n_bytes,
            n_waits: s.n_waits,
            peak_held_bytes: self.shared.peak_held_bytes.load(Ordering::Relaxed),
            buffered_bytes: self.shared.buffered_bytes.load(Ordering::Relaxed),
            shed_connections: self.shared.shed_connections.load(Ordering::Relaxed),
        }
    }

    /// Stops listening, closes every connection and waits until the loop thread has done so.
    pub async fn shutdown(mut self) {
        self.stop();
        if let Some(stopped) = self.stopped.take() {
            // An error means the thread is gone already (it sends just before it ends).
            let _ = stopped.await;
        }
    }

    fn stop(&self) {
        self.cancel.cancel();
        // The watcher task wakes the loop too; waking here does not depend on the runtime.
        let _ = self.waker.wake();
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        // The loop sees the cancellation and closes its sockets; `shutdown` also waits for that.
        self.stop();
    }
}

fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    Ok(TcpListener::from_std(listen_socket(addr)?))
}

/// A non-blocking listening socket on `addr` with the deep backlog a store needs (thousands of
/// ranks connect at once when a job starts; a full backlog costs each late one a SYN retry). The
/// rendezvous service listens through it too: a service of one job takes the store's connections
/// on its own port (`crate::shared_port`).
pub(crate) fn listen_socket(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

fn configure(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive)
}

/// One client connection.
struct Conn {
    id: ConnId,
    stream: TcpStream,
    peer: SocketAddr,
    parser: RequestParser,
    queue: ReplyQueue,
    /// Reply bytes taken from the queue and not yet written (from `out_at` on).
    out: Vec<u8>,
    out_at: usize,
    /// The last write stopped short: wait for writability before writing again.
    write_blocked: bool,
    /// In the loop's `dirty` list (has replies to write this turn).
    dirty: bool,
    /// Bytes may be waiting in the socket that were not read (a paused or budget-limited read).
    unread: bool,
    /// In the loop's `backlog` list (to be read next turn without waiting for readiness).
    in_backlog: bool,
    /// Listed to be closed at the end of the turn: nothing more is read.
    closing: bool,
    /// An event said the peer closed or reset the connection.
    hung_up: bool,
    /// The peer ended its stream (a read returned 0): nothing more is read; what it sent is
    /// applied and answered, then the connection closes (see the module docs).
    eof: bool,
    /// After the end of the stream, a wait was dropped with the replies queued behind it: the
    /// replies to later requests are dropped too, and no longer hold back applying them.
    cut: bool,
    /// When the peer last took reply bytes, or its stream ended: after its end of stream, a peer
    /// that takes none for `stall_timeout` is closed.
    last_taken: Instant,
    /// Whether what the connection holds moves at a reasonable rate, either way: the peer takes
    /// its replies, or sends the rest of the request it is in the middle of (what shedding
    /// spares, up to its hard ceiling).
    drain: Drain,
    /// Requests parsed but not applied yet: applying stops, request by request, once the
    /// connection holds too much (so one read of small requests with large replies, or of many
    /// WAITs, cannot make it hold more than about one reply past the budget).
    pending: VecDeque<Request>,
    /// Key and value bytes of the `pending` requests.
    pending_bytes: usize,
    /// What this connection counts for in the loop's `buffered` total (as of its last update).
    accounted: usize,
    /// When the peer's last bytes arrived (or the connection was accepted).
    last_read: Instant,
}

impl Conn {
    /// Reply bytes built for this peer and not yet written.
    fn held_bytes(&self) -> usize {
        self.queue.n_bytes() + (self.out.len() - self.out_at)
    }

    /// Everything held for this peer: the request being read, requests held back, and replies
    /// not yet taken.
    fn buffered(&self) -> usize {
        self.parser.held_bytes() + self.pending_bytes + self.held_bytes()
    }

    /// Too much is held back for this peer: reply bytes not yet written, or pending waits.
    fn over_budget(&self) -> bool {
        self.held_bytes() > MAX_HELD_BYTES || self.queue.n_pending() >= MAX_PENDING_WAITS
    }

    /// Reading (or, after the end of the stream, applying held-back requests) is paused while
    /// the connection is over its budget, except for a peer that hung up and whose stream has
    /// not been read to its end yet: that one is read on (what it sent is bounded then).
    fn paused(&self) -> bool {
        self.over_budget() && (self.eof || !self.hung_up)
    }

    /// Applies the held-back requests in order until the connection goes over its budget; wakes
    /// of other connections' waits go to `woken`. After the end of the stream, a wait a request
    /// registers is dropped at once (see [`Conn::end_waits`]).
    ///
    /// # Errors
    /// A request that must close the connection (the state is unchanged by it).
    fn apply_pending(&mut self, state: &mut StoreState, woken: &mut Vec<WaitId>) -> Result<(), RdzvError> {
        // Once cut, replies are dropped: nothing is held for them, so the budget holds nothing back.
        while self.cut || !self.over_budget() {
            let Some(req) = self.pending.pop_front() else { break };
            self.pending_bytes = self.pending_bytes.saturating_sub(pending_cost(&req));
            let a = state.apply(self.id, req)?;
            self.queue.cancelled(&a.cancelled);
            let waits = matches!(a.reply, Reply::Pending(_));
            if !self.cut {
                self.queue.push(a.reply);
            }
            for id in a.woken {
                if id.conn() == self.id { self.queue.woken(id) } else { woken.push(id) }
            }
            if self.eof && waits {
                self.end_waits(state);
            }
        }
        // A burst of tiny requests (64 Ki CANCEL_WAITs in one read) must not leave its queue's
        // capacity held for the connection's life.
        if self.pending.is_empty() && self.pending.capacity() > 64 {
            self.pending = VecDeque::new();
        }
        Ok(())
    }

    /// The peer ended its stream (a read returned 0). Its pending waits are dropped, its
    /// held-back requests applied as far as its budget allows (the rest as it takes its replies);
    /// once none is left, what it was woken for in queues goes to other waiters (it will never pop).
    ///
    /// # Errors
    /// A held-back request that must close the connection.
    fn end_of_stream(&mut self, state: &mut StoreState, woken: &mut Vec<WaitId>, now: Instant) -> Result<(), RdzvError> {
        self.eof = true;
        self.last_taken = now;
        if self.parser.is_mid_request() {
            tracing::debug!(peer = %self.peer, "tcpstore: the peer ended its stream in the middle of a request; that request is dropped");
        }
        self.end_waits(state);
        self.apply_pending(state, woken)?;
        self.settle(state, woken);
        Ok(())
    }

    /// After the end of the stream, once every request the peer sent is applied: it will never
    /// pop a queue item it was woken for, so the wake-up goes to another waiter. Harmless to
    /// repeat (the core forgets the connection's wake-ups the first time).
    fn settle(&mut self, state: &mut StoreState, woken: &mut Vec<WaitId>) {
        if self.eof && self.pending.is_empty() {
            woken.extend(state.disconnect(self.id));
        }
    }

    /// After the end of the stream: drops the connection's pending waits (the peer can no longer
    /// cancel them; torch's servers drop them when the stream ends) and, from the first of them
    /// on, the replies queued (sent without the wait's, they would read as its answer).
    fn end_waits(&mut self, state: &mut StoreState) {
        state.cancel_waits(self.id);
        if self.queue.cut_at_first_pending() {
            self.cut = true;
        }
    }

    /// Everything the peer sent is applied and every reply written: the connection can close.
    fn finished(&self) -> bool {
        self.eof && self.pending.is_empty() && self.queue.is_empty() && self.out_at == self.out.len()
    }
}

/// What a held-back request costs the budgets: its payload and the request itself (a request
/// without payload, such as CANCEL_WAIT, is not free to hold).
fn pending_cost(req: &Request) -> usize {
    req.payload_bytes() + std::mem::size_of::<Request>()
}

/// Why a connection is closed.
enum Close {
    /// The peer closed it, reset it, or a read or write failed: an ordinary end.
    Peer,
    /// The peer broke the protocol or a limit: logged as a warning with the peer's address.
    Violation(RdzvError),
}

struct EventLoop {
    poll: Poll,
    listener: TcpListener,
    shared: Arc<Shared>,
    limits: TcpStoreLimits,
    cancel: CancellationToken,
    /// Connections by token; `None` slots are listed in `free`.
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Distinguishes the connections that used one slot over time (the high half of a [`ConnId`]).
    generation: u32,
    read_buf: Vec<u8>,
    reqs: Vec<Request>,
    /// Waits completed this turn for other connections.
    woken: Vec<WaitId>,
    /// Connections with replies to write this turn.
    dirty: Vec<usize>,
    /// Connections to read this turn without a readiness event.
    backlog: Vec<usize>,
    /// Connections to close at the end of the turn.
    closing: Vec<(usize, Close)>,
    /// `accept` failed (out of descriptors): try again at this time.
    accept_retry: Option<Instant>,
    /// More connections may be waiting in the backlog than one turn accepted.
    accept_more: bool,
    /// When to look for stalled connections next (see [`TcpStoreLimits::stall_timeout`]).
    next_sweep: Instant,
    /// Bytes held for all connections together: the sum of their `accounted`.
    buffered: usize,
    /// When the current turn began (after `epoll_wait` returned): the clock of the turn's
    /// bookkeeping (drain rates, the end-of-stream deadline).
    now: Instant,
    /// Shedding left the server past its budget (only draining connections hold it): not looked
    /// at again before this.
    next_shed: Instant,
}

impl EventLoop {
    fn new(poll: Poll, mut listener: TcpListener, shared: Arc<Shared>, limits: TcpStoreLimits, cancel: CancellationToken) -> std::io::Result<Self> {
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(EventLoop {
            poll,
            listener,
            shared,
            limits,
            cancel,
            conns: Vec::new(),
            free: Vec::new(),
            generation: 0,
            read_buf: vec![0; READ_CHUNK],
            next_sweep: Instant::now(),
            reqs: Vec::new(),
            woken: Vec::new(),
            dirty: Vec::new(),
            backlog: Vec::new(),
            closing: Vec::new(),
            accept_retry: None,
            accept_more: false,
            buffered: 0,
            now: Instant::now(),
            next_shed: Instant::now(),
        })
    }

    /// Serves until the token is cancelled. Only a failing `epoll_wait` is an error.
    fn run(&mut self) -> std::io::Result<()> {
        let mut events = Events::with_capacity(EVENTS);
        loop {
            let timeout = if !self.backlog.is_empty() || self.accept_more {
                Some(Duration::ZERO)
            } else {
                let retry = self.accept_retry.map(|at| at.saturating_duration_since(Instant::now()));
                // Open connections: wake up for the next sweep too.
                let sweep = (self.shared.n_connections.load(Ordering::Relaxed) > 0)
                    .then(|| self.next_sweep.saturating_duration_since(Instant::now()));
                retry.into_iter().chain(sweep).min()
            };
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            self.now = Instant::now();
            let shared = self.shared.clone();
            let mut state = shared.lock();
            let mut accept = std::mem::take(&mut self.accept_more) || self.accept_retry.is_some_and(|at| at <= Instant::now());
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => accept = true,
                    WAKER => {}
                    Token(i) => {
                        if ev.is_writable() || ev.is_write_closed() || ev.is_error() {
                            self.writable(i);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(i, &mut state, ev.is_read_closed() || ev.is_error());
                        }
                    }
                }
            }
            for i in std::mem::take(&mut self.backlog) {
                if let Some(c) = self.conns.get_mut(i).and_then(Option::as_mut) {
                    c.in_backlog = false;
                    self.read(i, &mut state, false);
                }
            }
            if accept {
                self.accept();
            }
            self.take_adopted();
            if Instant::now() >= self.next_sweep {
                self.sweep();
            }
            self.flush_dirty();
            self.shed();
            self.close_pending(&mut state);
            self.shared.buffered_bytes.store(self.buffered, Ordering::Relaxed);
        }
    }

    /// Closes the connections that stalled: no handshake, or a request begun and not finished,
    /// and not a byte for `stall_timeout` (a connection this server stopped reading is not one);
    /// or the peer ended its stream and has taken no byte of its replies for `stall_timeout`.
    fn sweep(&mut self) {
        let stall = self.limits.stall_timeout;
        let now = Instant::now();
        self.next_sweep = now + stall.min(Duration::from_secs(1)) / 2;
        for (slot, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c.as_mut() else { continue };
            if c.eof {
                // Its stream ended: only replies are left, and the peer must take them.
                if !c.closing && now.saturating_duration_since(c.last_taken) >= stall {
                    let e = RdzvError::TcpStoreProtocol(format!(
                        "the peer ended its stream and took no byte of its {} remaining reply bytes for {stall:?}",
                        c.held_bytes()
                    ));
                    c.closing = true;
                    self.closing.push((slot, Close::Violation(e)));
                }
                continue;
            }
            let waiting_on_peer = !c.parser.is_validated() || c.parser.is_mid_request();
            if c.closing || c.unread || !c.pending.is_empty() || !waiting_on_peer || now.duration_since(c.last_read) < stall {
                continue;
            }
            let what = if c.parser.is_validated() { "the rest of a request" } else { "the VALIDATE handshake" };
            let e = RdzvError::TcpStoreProtocol(format!("no byte of {what} for {stall:?}"));
            c.closing = true;
            self.closing.push((slot, Close::Violation(e)));
        }
    }

    fn accept(&mut self) {
        self.accept_retry = None;
        for _ in 0..ACCEPTS_PER_TURN {
            let (stream, peer) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if accept_error_is_transient(&e) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "tcpstore: accept failed (out of file descriptors? raise RLIMIT_NOFILE)");
                    self.accept_retry = Some(Instant::now() + ACCEPT_RETRY);
                    return;
                }
            };
            self.admit(stream, peer);
        }
        self.accept_more = true;
    }

    /// Takes the connections handed over by [`TcpStoreServer::adopt`]. Each is read on the next
    /// turn without waiting for readiness: its first bytes may have arrived before it was
    /// registered here.
    fn take_adopted(&mut self) {
        let adopted = std::mem::take(&mut *self.shared.adopted.lock().unwrap_or_else(|p| p.into_inner()));
        for (stream, peer) in adopted {
            if let Some(slot) = self.admit(TcpStream::from_std(stream), peer)
                && let Some(c) = self.conns[slot].as_mut()
            {
                c.in_backlog = true;
                self.backlog.push(slot);
            }
        }
    }

    /// Serves a new connection, in the slot returned (`None`: over `max_connections`, or it
    /// could not be watched, and it is closed).
    fn admit(&mut self, mut stream: TcpStream, peer: SocketAddr) -> Option<usize> {
        if self.shared.n_connections.load(Ordering::Relaxed) >= self.limits.max_connections {
            tracing::warn!(%peer, max_connections = self.limits.max_connections, "tcpstore: too many connections; closing the new one");
            drop(stream);
            return None;
        }
        if let Err(e) = configure(&stream) {
            tracing::debug!(%peer, error = %e, "tcpstore: cannot set socket options");
        }
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        if let Err(e) = self.poll.registry().register(&mut stream, Token(slot), Interest::READABLE | Interest::WRITABLE) {
            tracing::warn!(%peer, error = %e, "tcpstore: cannot watch the connection; closing it");
            self.free.push(slot);
            return None;
        }
        self.generation = self.generation.wrapping_add(1);
        let id = ConnId((u64::from(self.generation) << 32) | slot as u64);
        self.conns[slot] = Some(Conn {
            id,
            stream,
            peer,
            parser: RequestParser::new(self.limits.parse_limits()),
            queue: ReplyQueue::new(),
            out: Vec::new(),
            out_at: 0,
            write_blocked: false,
            dirty: false,
            unread: false,
            in_backlog: false,
            closing: false,
            hung_up: false,
            eof: false,
            cut: false,
            last_taken: self.now,
            drain: Drain::new(self.now),
            pending: VecDeque::new(),
            pending_bytes: 0,
            accounted: 0,
            last_read: Instant::now(),
        });
        self.shared.n_connections.fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    /// Brings connection `c`'s share of the `buffered` total up to date, and its drain meter
    /// (bytes that began to be held, requests or replies, start its window).
    fn account(buffered: &mut usize, c: &mut Conn, now: Instant) {
        let held = c.buffered();
        c.drain.update(now, 0, held);
        *buffered = buffered.saturating_sub(c.accounted) + held;
        c.accounted = held;
    }

    /// Over [`TcpStoreLimits::max_buffered_bytes`]: closes connections that hold bytes nobody
    /// moves (replies their peer does not take, requests it does not finish), those whose peer
    /// ended its stream first, then the largest, until the rest hold less; not one whose bytes
    /// move at a reasonable rate either way (its peer takes its replies, or sends the request it
    /// is in the middle of), unless the server holds more than twice the budget: then those go
    /// too, the slowest first, until it holds at most twice the budget (see [`shed`]). Only a
    /// peer that sends requests it does not finish, or asks for replies it does not read, on many
    /// connections at once gets here.
    fn shed(&mut self) {
        let max = self.limits.max_buffered_bytes;
        let ceiling = max.saturating_mul(2);
        // Past the hard ceiling, at once (a recheck delay must not let it grow meanwhile).
        if self.buffered <= max || (self.now < self.next_shed && self.buffered <= ceiling) {
            return;
        }
        let total = self.buffered;
        // What connections already closing hold goes with them (counted off when they close):
        // not a reason to close another one.
        let going: usize = self.conns.iter().flatten().filter(|c| c.closing).map(|c| c.accounted).sum();
        let left = total.saturating_sub(going);
        if left <= max {
            return;
        }
        let now = self.now;
        let holders: Vec<Holder> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| {
                let c = c.as_ref().filter(|c| !c.closing && c.accounted > 0)?;
                Some(Holder {
                    slot,
                    bytes: c.accounted,
                    half_closed: c.eof,
                    draining: c.drain.draining(now),
                    idle: c.drain.idle(now),
                })
            })
            .collect();
        let mut left = left;
        for slot in shed::pick(holders, left, max) {
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else { continue };
            let why = if c.drain.draining(now) {
                format!(
                    "the server holds more than twice that ({ceiling}): its bytes move, but among the slowest (no 64 KiB moved for {:?})",
                    c.drain.idle(now)
                )
            } else if c.eof {
                "its peer ended its stream and is not taking its replies".to_owned()
            } else if c.held_bytes() > 0 {
                "its peer is not taking its replies".to_owned()
            } else {
                "its peer is not sending the rest of its request".to_owned()
            };
            let e = RdzvError::TcpStoreProtocol(format!(
                "it holds {} of the {total} bytes the server holds for all connections (unfinished requests and unread replies), past max_buffered_bytes {max}, and {why}",
                c.accounted
            ));
            left = left.saturating_sub(c.accounted);
            c.closing = true;
            self.closing.push((slot, Close::Violation(e)));
            self.shared.shed_connections.fetch_add(1, Ordering::Relaxed);
        }
        if left > max {
            tracing::debug!(held = left, max_buffered_bytes = max, "tcpstore: past the budget, but only connections that drain hold it");
            self.next_shed = now + SHED_RECHECK;
        }
    }

    fn mark_dirty(dirty: &mut Vec<usize>, slot: usize, c: &mut Conn) {
        if !c.dirty {
            c.dirty = true;
            dirty.push(slot);
        }
    }

    /// Reads what arrived on connection `slot` and applies it. `hung_up`: the event said the
    /// peer closed or reset the connection.
    fn read(&mut self, slot: usize, state: &mut StoreState, hung_up: bool) {
        let now = self.now;
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else { return };
        if c.closing {
            return;
        }
        // The hang-up is reported once (edge-triggered): a peer that is gone is not paused any
        // more, so what it sent before its close is still read, and the end of the stream is
        // seen, instead of its socket and waits staying until the pause ended.
        c.hung_up |= hung_up;
        let mut close = None;
        // Requests held back by the budget go first; nothing more is read until they are applied.
        let had_pending = !c.pending.is_empty();
        if had_pending {
            if let Err(e) = c.apply_pending(state, &mut self.woken) {
                close = Some(Close::Violation(e));
            }
            self.shared.peak_held_bytes.fetch_max(c.held_bytes(), Ordering::Relaxed);
            Self::mark_dirty(&mut self.dirty, slot, c);
        }
        // The stream ended earlier: nothing is left to read, only held-back requests to apply
        // (above, as far as the budget allows) and replies to write (`flush_dirty` closes the
        // connection after the last one).
        if c.eof {
            match close {
                Some(close) => {
                    c.closing = true;
                    self.closing.push((slot, close));
                }
                None if had_pending => {
                    c.settle(state, &mut self.woken);
                    c.unread = !c.pending.is_empty();
                    if c.unread && !c.paused() && !c.in_backlog {
                        c.in_backlog = true;
                        self.backlog.push(slot);
                    }
                }
                None => {}
            }
            Self::account(&mut self.buffered, c, now);
            self.deliver_wakes();
            return;
        }
        // A peer that hung up is read on to the end of its stream: what it sent is bounded.
        if close.is_none() && !c.hung_up && (c.paused() || !c.pending.is_empty()) {
            c.unread = true;
            Self::account(&mut self.buffered, c, now);
            self.deliver_wakes();
            return;
        }
        if close.is_none() {
            c.unread = false;
        }
        let mut ended = false;
        // Bytes read while a request was in the middle of being read: the peer moving what the
        // connection holds (a large SET arriving), as a peer taking its replies does.
        let mut progressed = 0usize;
        for n_read in 1..=READS_PER_TURN {
            if close.is_some() {
                break;
            }
            let n = match c.stream.read(&mut self.read_buf) {
                // The end of the stream: a close, or a shutdown(SHUT_WR) of a peer that still
                // reads. Either way what it sent is finished first (see `Conn::end_of_stream`).
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => {
                    c.last_read = Instant::now();
                    n
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(peer = %c.peer, error = %e, "tcpstore: read failed");
                    close = Some(Close::Peer);
                    break;
                }
            };
            let mid_request = c.parser.is_mid_request();
            let parsed = c.parser.feed(&self.read_buf[..n], &mut self.reqs);
            if mid_request || c.parser.is_mid_request() {
                progressed = progressed.saturating_add(n);
            }
            // Requests parsed before a violation are still served, as they would be by torch.
            for req in self.reqs.drain(..) {
                c.pending_bytes += pending_cost(&req);
                c.pending.push_back(req);
            }
            let applied = c.apply_pending(state, &mut self.woken);
            self.shared.peak_held_bytes.fetch_max(c.held_bytes(), Ordering::Relaxed);
            Self::mark_dirty(&mut self.dirty, slot, c);
            if let Err(e) = applied.and(parsed) {
                close = Some(Close::Violation(e));
                break;
            }
            if !c.pending.is_empty() && !c.hung_up {
                // Over the budget with requests left: the rest waits for the peer to read.
                c.unread = true;
                break;
            }
            // A short read emptied the socket: the next bytes bring a new readiness event. Not
            // so the end of the stream, when the event that reported it is this one: read on
            // to it.
            if n < self.read_buf.len() && !c.hung_up {
                break;
            }
            if c.paused() || n_read == READS_PER_TURN {
                c.unread = true;
                break;
            }
        }
        if ended && close.is_none() {
            if let Err(e) = c.end_of_stream(state, &mut self.woken, now) {
                close = Some(Close::Violation(e));
            }
            // Held-back requests are applied as the peer takes its replies (from the backlog).
            c.unread = !c.pending.is_empty();
            self.shared.peak_held_bytes.fetch_max(c.held_bytes(), Ordering::Relaxed);
            Self::mark_dirty(&mut self.dirty, slot, c);
        }
        if c.unread && !c.paused() && !c.in_backlog {
            c.in_backlog = true;
            self.backlog.push(slot);
        }
        if let Some(close) = close {
            c.closing = true;
            self.closing.push((slot, close));
        }
        if progressed > 0 {
            let held = c.buffered();
            c.drain.update(now, progressed, held);
        }
        Self::account(&mut self.buffered, c, now);
        self.deliver_wakes();
    }

    /// Puts this turn's wake-ups into their connections' queues.
    fn deliver_wakes(&mut self) {
        for id in self.woken.drain(..) {
            // The slot is the low half of a ConnId; the generation check skips a closed connection.
            let slot = (id.conn().0 & u64::from(u32::MAX)) as usize;
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut).filter(|c| c.id == id.conn()) else { continue };
            c.queue.woken(id);
            Self::mark_dirty(&mut self.dirty, slot, c);
            // A pause on pending waits may be over.
            Self::account(&mut self.buffered, c, self.now);
            if c.unread && !c.paused() && !c.in_backlog {
                c.in_backlog = true;
                self.backlog.push(slot);
            }
        }
    }

    fn writable(&mut self, slot: usize) {
        if let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) {
            c.write_blocked = false;
            Self::mark_dirty(&mut self.dirty, slot, c);
        }
    }

    /// Writes every dirty connection's ready replies, one `write` each (more only if the socket
    /// takes less).
    fn flush_dirty(&mut self) {
        for slot in std::mem::take(&mut self.dirty) {
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else { continue };
            c.dirty = false;
            // Drop what was written before appending, so a peer that keeps reading a little
            // behind does not grow the buffer with everything it was ever sent; but move the
            // unsent rest only once the written part is at least as long (amortized), not on
            // every writable event of a slow reader (each moved up to a whole large reply).
            if c.out_at == c.out.len() {
                c.out.clear();
                c.out_at = 0;
            } else if c.out_at > 0 && c.out_at >= c.out.len() - c.out_at {
                c.out.drain(..c.out_at);
                c.out_at = 0;
            }
            c.queue.take_ready(&mut c.out);
            let mut wrote = 0;
            while !c.write_blocked && c.out_at < c.out.len() {
                match c.stream.write(&c.out[c.out_at..]) {
                    Ok(0) => {
                        c.closing = true;
                        self.closing.push((slot, Close::Peer));
                        break;
                    }
                    Ok(n) => {
                        c.out_at += n;
                        wrote += n;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => c.write_blocked = true,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::debug!(peer = %c.peer, error = %e, "tcpstore: write failed");
                        c.closing = true;
                        self.closing.push((slot, Close::Peer));
                        break;
                    }
                }
            }
            if c.out_at == c.out.len() {
                c.out.clear();
                c.out_at = 0;
                if c.out.capacity() > KEEP_WRITE_BUFFER {
                    c.out = Vec::new();
                }
            }
            if wrote > 0 {
                let left = c.buffered();
                c.last_taken = self.now;
                c.drain.update(self.now, wrote, left);
            }
            // What was written is no longer held: a client that read its reply must not count
            // toward max_buffered_bytes (shed() would close it for bytes it already has).
            Self::account(&mut self.buffered, c, self.now);
            if c.unread && !c.paused() && !c.in_backlog {
                c.in_backlog = true;
                self.backlog.push(slot);
            }
            // The peer ended its stream and has every reply: an ordinary close.
            if c.finished() && !c.closing {
                c.closing = true;
                self.closing.push((slot, Close::Peer));
            }
        }
    }

    fn close_pending(&mut self, state: &mut StoreState) {
        // Until none is left: the flush of hand-on wake-ups may finish a connection whose peer
        // ended its stream (or fail a write), listing it anew. A round lists more only after it
        // closed one, so this ends.
        while !self.closing.is_empty() {
            self.close_listed(state);
        }
    }

    fn close_listed(&mut self, state: &mut StoreState) {
        for (slot, why) in std::mem::take(&mut self.closing) {
            let Some(mut c) = self.conns.get_mut(slot).and_then(Option::take) else { continue };
            match why {
                // Logged while the socket is still open, so the line is out before the peer sees
                // the close.
                Close::Violation(e) => tracing::warn!(peer = %c.peer, error = %e, "tcpstore: closing the connection"),
                Close::Peer => tracing::trace!(peer = %c.peer, "tcpstore: connection closed"),
            }
            let handed_on = state.disconnect(c.id);
            self.woken.extend(handed_on);
            self.buffered = self.buffered.saturating_sub(c.accounted);
            let _ = self.poll.registry().deregister(&mut c.stream);
            drop(c);
            self.free.push(slot);
            self.shared.n_connections.fetch_sub(1, Ordering::Relaxed);
        }
        // Queue items a closed connection was woken for and never popped went to other waiters.
        if !self.woken.is_empty() {
            self.deliver_wakes();
            self.flush_dirty();
        }
    }
}
