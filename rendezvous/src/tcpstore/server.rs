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
use crate::tcpstore::state::{ConnId, StoreState, WaitId};

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
/// Readiness events taken per `epoll_wait`.
const EVENTS: usize = 1024;
/// Pause after a failed `accept` (out of file descriptors, typically) before trying again.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);
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
    let socket = socket2::Socket::new(socket2::Domain::for_address(addr), socket2::Type::STREAM, Some(socket2::Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(TcpListener::from_std(socket.into()))
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

    /// Reading is paused while the connection is over its budget, except for a peer that hung
    /// up: that one is read to its end (what it sent is bounded then), which closes it.
    fn paused(&self) -> bool {
        self.over_budget() && !self.hung_up
    }

    /// Applies the held-back requests in order until the connection goes over its budget; wakes
    /// of other connections' waits go to `woken`.
    ///
    /// # Errors
    /// A request that must close the connection (the state is unchanged by it).
    fn apply_pending(&mut self, state: &mut StoreState, woken: &mut Vec<WaitId>) -> Result<(), RdzvError> {
        while !self.over_budget() {
            let Some(req) = self.pending.pop_front() else { break };
            self.pending_bytes = self.pending_bytes.saturating_sub(pending_cost(&req));
            let a = state.apply(self.id, req)?;
            self.queue.cancelled(&a.cancelled);
            self.queue.push(a.reply);
            for id in a.woken {
                if id.conn() == self.id { self.queue.woken(id) } else { woken.push(id) }
            }
        }
        // A burst of tiny requests (64 Ki CANCEL_WAITs in one read) must not leave its queue's
        // capacity held for the connection's life.
        if self.pending.is_empty() && self.pending.capacity() > 64 {
            self.pending = VecDeque::new();
        }
        Ok(())
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
    /// and not a byte for `stall_timeout` (a connection this server stopped reading is not one).
    fn sweep(&mut self) {
        let stall = self.limits.stall_timeout;
        let now = Instant::now();
        self.next_sweep = now + stall.min(Duration::from_secs(1)) / 2;
        for (slot, c) in self.conns.iter_mut().enumerate() {
            let Some(c) = c.as_mut() else { continue };
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
            let (mut stream, peer) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::ConnectionAborted) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "tcpstore: accept failed (out of file descriptors? raise RLIMIT_NOFILE)");
                    self.accept_retry = Some(Instant::now() + ACCEPT_RETRY);
                    return;
                }
            };
            if self.shared.n_connections.load(Ordering::Relaxed) >= self.limits.max_connections {
                tracing::warn!(%peer, max_connections = self.limits.max_connections, "tcpstore: too many connections; closing the new one");
                drop(stream);
                continue;
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
                continue;
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
                pending: VecDeque::new(),
                pending_bytes: 0,
                accounted: 0,
                last_read: Instant::now(),
            });
            self.shared.n_connections.fetch_add(1, Ordering::Relaxed);
        }
        self.accept_more = true;
    }

    /// Brings connection `c`'s share of the `buffered` total up to date.
    fn account(buffered: &mut usize, c: &mut Conn) {
        let now = c.buffered();
        *buffered = buffered.saturating_sub(c.accounted) + now;
        c.accounted = now;
    }

    /// Over [`TcpStoreLimits::max_buffered_bytes`]: closes the connections holding the most until
    /// the rest hold less. Only a peer that sends requests it does not finish, or asks for
    /// replies it does not read, on many connections at once gets here.
    fn shed(&mut self) {
        let max = self.limits.max_buffered_bytes;
        if self.buffered <= max {
            return;
        }
        let mut holders: Vec<(usize, usize)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| c.as_ref().filter(|c| !c.closing && c.accounted > 0).map(|c| (c.accounted, slot)))
            .collect();
        holders.sort_unstable_by(|a, b| b.cmp(a));
        let total = self.buffered;
        // What connections already closing hold goes with them (counted off when they close):
        // not a reason to close another one.
        let going: usize = self.conns.iter().flatten().filter(|c| c.closing).map(|c| c.accounted).sum();
        let mut left = total.saturating_sub(going);
        for (bytes, slot) in holders {
            if left <= max {
                break;
            }
            let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else { continue };
            let e = RdzvError::TcpStoreProtocol(format!(
                "it holds {bytes} of the {total} bytes the server holds for all connections (unfinished requests and unread replies), past max_buffered_bytes {max}"
            ));
            c.closing = true;
            self.closing.push((slot, Close::Violation(e)));
            self.shared.shed_connections.fetch_add(1, Ordering::Relaxed);
            left -= bytes;
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
        let Some(c) = self.conns.get_mut(slot).and_then(Option::as_mut) else { return };
        if c.closing {
            return;
        }
        // The hang-up is reported once (edge-triggered): a peer that is gone is not paused any
        // more, so what it sent before its close is still served and the end of the stream
        // closes the connection, instead of its socket and waits staying until the pause ended.
        c.hung_up |= hung_up;
        let mut close = None;
        // Requests held back by the budget go first; nothing more is read until they are applied.
        if !c.pending.is_empty() {
            if let Err(e) = c.apply_pending(state, &mut self.woken) {
                close = Some(Close::Violation(e));
            }
            self.shared.peak_held_bytes.fetch_max(c.held_bytes(), Ordering::Relaxed);
            Self::mark_dirty(&mut self.dirty, slot, c);
        }
        // A peer that hung up is read on to its end, which closes the connection: what it
        // sent is bounded, and requests it can no longer be answered for are dropped with it.
        if close.is_none() && !c.hung_up && (c.paused() || !c.pending.is_empty()) {
            c.unread = true;
            Self::account(&mut self.buffered, c);
            self.deliver_wakes();
            return;
        }
        if close.is_none() {
            c.unread = false;
        }
        for n_read in 1..=READS_PER_TURN {
            if close.is_some() {
                break;
            }
            let n = match c.stream.read(&mut self.read_buf) {
                Ok(0) => {
                    close = Some(Close::Peer);
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
            let parsed = c.parser.feed(&self.read_buf[..n], &mut self.reqs);
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
        if c.unread && !c.paused() && !c.in_backlog {
            c.in_backlog = true;
            self.backlog.push(slot);
        }
        if let Some(close) = close {
            c.closing = true;
            self.closing.push((slot, close));
        }
        Self::account(&mut self.buffered, c);
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
            Self::account(&mut self.buffered, c);
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
            while !c.write_blocked && c.out_at < c.out.len() {
                match c.stream.write(&c.out[c.out_at..]) {
                    Ok(0) => {
                        c.closing = true;
                        self.closing.push((slot, Close::Peer));
                        break;
                    }
                    Ok(n) => c.out_at += n,
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
            // What was written is no longer held: a client that read its reply must not count
            // toward max_buffered_bytes (shed() would close it for bytes it already has).
            Self::account(&mut self.buffered, c);
            if c.unread && !c.paused() && !c.in_backlog {
                c.in_backlog = true;
                self.backlog.push(slot);
            }
        }
    }

    fn close_pending(&mut self, state: &mut StoreState) {
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
