//! The executor around the pure state machine, and the gRPC handlers over it.
//!
//! [`Core`] owns the [`State`] behind one mutex. A mutating call becomes a [`Command`]: stamped with
//! the time, applied, appended to the log buffer (in apply order, under the same lock), and then
//! the caller waits until the log's flusher thread reports that sequence durable (group commit:
//! one write covers every record buffered meanwhile). Reads wait for the durability of the state they
//! observed, so nobody ever sees a change that a crash could take back.
//!
//! Where the log goes is a [`LogStore`]: the file journal (`--data-dir`), or, for highly available
//! daemons, etcd ([`crate::ha`]). There a daemon is a leader or a standby ([`Role`]); only the
//! leader applies commands, runs timers and answers, and its reads also wait for a leadership
//! confirmation (a guarded etcd write) that began after they arrived, so a deposed leader that has
//! not noticed yet answers nothing from its stale state. A leader also answers only before the
//! local deadline of its election lease ([`LeaderLease`]): every gRPC answer (and pushed view) is
//! checked against it when it is sent ([`standing`]), and past it the daemon refuses and steps
//! down at once. The round TCPStores it hosts are not checked per answer: their event loops
//! answer on their own until the step-down (or the timer's lease check, within a second) closes
//! them.
//!
//! Waiting (join, blocking get, barrier, unique id, exit barrier) subscribes to a per-job view channel
//! (changes only when a round forms or ends, or the job ends) and, for store waits, to a per-topic
//! channel (one per key, barrier or unique id), so a change wakes only the callers it concerns.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use rsrun_proto::v1 as pb;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::RdzvError;
use crate::auth::{JobQuota, Principal};
use crate::journal::{self, Entry, Journal};
use crate::logstore::LogStore;
use crate::metrics::Metrics;
use crate::round_stores::RoundStores;
use crate::state::{self, Command, Failure, JobSpec, JoinCmd, Ms, Outcome, Phase, Scope, State};
use crate::tcpstore::TcpStoreLimits;
use crate::validate::{self, Limits};

/// Longest wait for a write to become durable before the call fails as unavailable (retryable):
/// well within a client's attempt (10 s past its wait by default, with several daemons; 30 s
/// with one), so the client hears it and tries again instead of timing out unanswered.
const DURABILITY_TIMEOUT: Duration = Duration::from_secs(8);
/// A blocking call's answer waits for durability at most this long past its deadline (the
/// client gives it `BLOCKING_SLACK`, 5 s).
const ANSWER_SLACK: Duration = Duration::from_secs(3);
/// Response metadata key of the [`pb::LeaderStamp`] (HA).
pub const LEADER_STAMP_KEY: &str = "rsrun-leader-bin";

/// Wall-clock milliseconds that advance with tokio's clock (so paused-time tests control them),
/// and never run behind the state's time once told it ([`Clock::catch_up`]).
#[derive(Debug)]
pub struct Clock {
    base_wall: Ms,
    base: Instant,
    /// Milliseconds added since the start: the state's time was ahead of the wall clock (a clock
    /// stepped back before a restart, a new leader whose clock lags).
    ahead: std::sync::atomic::AtomicU64,
}

impl Clock {
    /// Starts at the current wall-clock time.
    pub fn system() -> Self {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as Ms)
            .unwrap_or(0);
        Clock { base_wall: wall, base: Instant::now(), ahead: std::sync::atomic::AtomicU64::new(0) }
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> Ms {
        self.base_wall + self.ahead.load(std::sync::atomic::Ordering::Relaxed) + self.base.elapsed().as_millis() as Ms
    }

    /// Moves the clock forward to `at` if it is behind it, to run at the real rate from there:
    /// time stamped no earlier than the last applied entry must still pass (leases expire, last
    /// calls end), instead of standing still at `at` until the wall clock gets there.
    pub fn catch_up(&self, at: Ms) {
        let now = self.now_ms();
        if now < at {
            self.ahead.fetch_add(at - now, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The tokio instant of a wall-clock time.
    pub fn instant_at(&self, at: Ms) -> Instant {
        let start = self.base_wall + self.ahead.load(std::sync::atomic::Ordering::Relaxed);
        self.base + Duration::from_millis(at.saturating_sub(start))
    }
}

/// What the executor does with calls.
///
/// Transitions: `Single` never changes. With HA (`--etcd-endpoints`) a daemon starts as `Standby`
/// (its state is a warm replica of the etcd log, applied by [`Core::replica_apply`]); it becomes
/// `Leader` when it wins the election and caught up ([`Core::promote`]), and goes back to `Standby`
/// when its lease may have lapsed, its log write was refused, or it stops ([`Core::demote`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The only daemon (in memory or `--data-dir`).
    Single,
    /// The HA leader of this epoch (its election key's creation revision).
    Leader {
        /// The fencing token.
        epoch: u64,
    },
    /// An HA standby: refuses calls, naming the leader when it knows it.
    Standby {
        /// The leader's advertised address (empty: unknown).
        leader: String,
        /// Its epoch (0: unknown).
        epoch: u64,
    },
}

/// The local deadline of an HA leader's election lease, as the HA node keeps it (`crate::ha`).
///
/// `answer_until` is a moment of this process's monotonic clock strictly before the earliest
/// moment etcd may expire the lease: the send time of the last acknowledged grant or keep-alive,
/// plus its TTL, less a margin for clock drift. A leader answers nothing at or after it.
pub trait LeaderLease: Send + Sync + std::fmt::Debug {
    /// The moment from which this daemon must not answer as leader (`None`: no live lease).
    fn answer_until(&self) -> Option<Instant>;
}

/// Whether a daemon may send an answer now ([`standing`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Answer: the only daemon, or the HA leader before its lease's local deadline.
    Serve,
    /// An HA leader at or past its lease's local deadline, or without a live lease: it answers
    /// [`RdzvError::NotLeader`] without a hint and steps down.
    Lapsed,
    /// An HA standby: it refuses, naming the leader it knows.
    Standby {
        /// The leader's advertised address (empty: unknown).
        leader: String,
        /// Its epoch (0: unknown).
        epoch: u64,
    },
}

/// Decides whether a daemon in `role` may answer at `now`, when its leadership lease lets it
/// answer until `answer_until` ([`LeaderLease::answer_until`]; only a leader's counts). Pure: the
/// executor passes the time of the answer.
pub fn standing(role: &Role, answer_until: Option<Instant>, now: Instant) -> Standing {
    match role {
        Role::Single => Standing::Serve,
        Role::Standby { leader, epoch } => Standing::Standby { leader: leader.clone(), epoch: *epoch },
        Role::Leader { .. } => match answer_until {
            Some(until) if now < until => Standing::Serve,
            _ => Standing::Lapsed,
        },
    }
}

/// Durability progress published by the flusher of the current term.
#[derive(Debug, Clone, Default)]
struct Flushed {
    /// The term it belongs to (a term starts at start-up, at every takeover and every step-down).
    term: u64,
    seq: u64,
    /// Highest confirmation ticket proven by a write that began after the ticket was taken.
    confirmed: u64,
    error: Option<String>,
    /// The log refused this writer for good (deposed): every waiter of the term gets this.
    fatal: Option<RdzvError>,
}

enum Work {
    /// `tried`: a write of these bytes was attempted and may have landed (an uncertain outcome),
    /// so a retry must write exactly them: later records go into an item of their own.
    Records { bytes: Vec<u8>, last_seq: u64, tried: bool },
    Compact { state: Box<State>, seq: u64 },
}

/// Most bytes of records that may wait for the log (see `Core::apply_locked`).
const MAX_UNWRITTEN_LOG_BYTES: u64 = 256 << 20;

#[derive(Default)]
struct Queue {
    items: Vec<Work>,
    /// The flusher drains what is queued and stops.
    closed: bool,
    /// The flusher stops at once, dropping what is queued (a leader stepping down).
    abandoned: bool,
    /// Confirmation tickets handed out (reads waiting for a leadership confirmation).
    tickets: u64,
}

/// The log side of the executor for one term: a queue the flusher thread drains.
struct Durability {
    queue: Mutex<Queue>,
    ready: Condvar,
    confirm_reads: bool,
    compact_every: u64,
    /// The log thread, joined at the service's end: it owns the log store (a journal holds its
    /// directory's lock until it is dropped).
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Queue {
    /// Bytes of records queued and not written yet.
    fn unwritten_bytes(&self) -> u64 {
        self.items.iter().map(|w| if let Work::Records { bytes, .. } = w { bytes.len() as u64 } else { 0 }).sum()
    }
}

impl Durability {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ticket that the next write beginning from now on will prove (0: no proof needed).
    fn ticket(&self) -> u64 {
        if !self.confirm_reads {
            return 0;
        }
        let mut q = self.lock();
        q.tickets += 1;
        let t = q.tickets;
        drop(q);
        self.ready.notify_one();
        t
    }

    fn stop(&self, abandon: bool) {
        let mut q = self.lock();
        q.closed = true;
        if abandon {
            q.abandoned = true;
            q.items.clear();
        }
        drop(q);
        self.ready.notify_one();
    }
}

/// What a caller waits for before it answers: its sequence durable and, for HA leaders, a
/// leadership confirmation begun after it looked at the state.
#[derive(Debug, Clone, Copy)]
struct Settle {
    term: u64,
    seq: u64,
    ticket: u64,
    logged: bool,
}

struct Inner {
    state: State,
    /// Last assigned sequence number.
    seq: u64,
    /// Time of the last applied entry: stamps never go below it (a new leader's clock may be behind).
    last_at: Ms,
    /// Bytes queued to the current log since the last compaction.
    log_bytes: u64,
    /// Per job: its view and the sequence number that view is as of (pushed only once durable).
    views: HashMap<String, watch::Sender<(pb::JobView, u64)>>,
    topics: HashMap<(String, String), watch::Sender<u64>>,
    /// PyTorch's store of every running round (`None`: not hosted).
    stores: Option<RoundStores>,
    /// The log of the current term (`None`: in memory, or a standby).
    log: Option<Arc<Durability>>,
    role: Role,
    /// The leader's election lease (`None` unless it leads).
    lease: Option<Arc<dyn LeaderLease>>,
    term: u64,
    /// Takeovers this daemon made.
    takeovers: u64,
}

/// Who this daemon is, for HA status and stamps.
#[derive(Debug, Clone, Default)]
pub struct DaemonIdentity {
    /// A name unique among the daemons.
    pub daemon_id: String,
    /// The address clients reach it at.
    pub advertise: String,
}

/// Configuration of the executor.
#[derive(Debug, Clone, Default)]
pub struct CoreConfig {
    /// Durable state directory; `None` keeps state in memory (or, with `ha`, in etcd).
    pub data_dir: Option<std::path::PathBuf>,
    /// Limits.
    pub limits: Limits,
    /// Serve PyTorch's TCPStore for every running round with these limits (`None`: workers host it).
    pub tcpstore: Option<TcpStoreLimits>,
    /// The service's listen address: where round stores listen when no join told the job's
    /// interface (ignored when it names every interface).
    pub listen: Option<IpAddr>,
    /// HA: start as a standby with this identity; [`crate::ha`] drives the role.
    pub ha: Option<DaemonIdentity>,
    /// HA: refuse store writes once all jobs' store bytes reach this (`RESOURCE_EXHAUSTED`).
    pub max_total_store_bytes: Option<usize>,
    /// The service's own port, when it also serves the running round's store there (a service of
    /// one job, see `crate::shared_port`): rounds' stores are announced at this port.
    pub shared_store_port: Option<u16>,
}

/// The peers an HA daemon knows of (answered by the HA node, which reads etcd).
pub trait PeerSource: Send + Sync + std::fmt::Debug {
    /// The campaigning daemons, leader first.
    fn peers(&self) -> futures::future::BoxFuture<'_, Vec<pb::DaemonPeer>>;
}

/// The executor: state, log, notifications, timers.
pub struct Core {
    inner: Mutex<Inner>,
    limits: Limits,
    clock: Clock,
    flushed_tx: Arc<watch::Sender<Flushed>>,
    flushed: watch::Receiver<Flushed>,
    tick: Notify,
    /// Metrics of the service.
    pub metrics: Arc<Metrics>,
    cancel: CancellationToken,
    identity: Option<DaemonIdentity>,
    max_total_store_bytes: Option<usize>,
    peers: OnceLock<Arc<dyn PeerSource>>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core").field("role", &self.lock().role).finish()
    }
}

fn significant(a: &pb::JobView, b: &pb::JobView) -> bool {
    a.state != b.state
        || a.round != b.round
        || a.nodes_waiting != b.nodes_waiting
        || a.reason != b.reason
        || a.restart_count != b.restart_count
}

fn grows_store(cmd: &Command) -> bool {
    matches!(cmd, Command::StoreSet { .. } | Command::StoreMultiSet { .. } | Command::StoreCas { .. } | Command::StoreAdd { .. })
}

/// The service-wide store cap (`cap`, HA's `max_total_store_bytes`): once all jobs hold `cap`
/// store bytes, a command that may grow the store is refused. Pure; the executor skips it for a
/// call the state remembers ([`State::remembered`]), which grows nothing.
fn store_cap_check(state: &State, cmd: &Command, cap: Option<usize>) -> Result<(), RdzvError> {
    match cap {
        Some(cap) if state.totals.store_bytes >= cap && grows_store(cmd) => Err(RdzvError::ResourceExhausted(format!(
            "the service holds {} store bytes over all jobs, its limit of {cap} bytes: delete keys or end jobs",
            state.totals.store_bytes
        ))),
        _ => Ok(()),
    }
}

impl Core {
    /// Recovers state (when durable) and starts the flusher thread and the timer task.
    ///
    /// # Errors
    /// The data directory cannot be opened or recovered.
    pub fn start(config: CoreConfig, cancel: CancellationToken, tracker: &tokio_util::task::TaskTracker) -> Result<Arc<Core>, RdzvError> {
        let clock = Clock::system();
        let metrics = Arc::new(Metrics::default());
        let (flushed_tx, flushed) = watch::channel(Flushed::default());
        let flushed_tx = Arc::new(flushed_tx);
        let (state, seq, log, role, last_at) = match (&config.data_dir, &config.ha) {
            (Some(dir), _) => {
                let (journal, recovered) = Journal::open(dir)?;
                tracing::info!(
                    data_dir = %dir.display(),
                    jobs = recovered.state.jobs.len(),
                    seq = recovered.seq,
                    replayed = recovered.replayed,
                    "recovered durable state"
                );
                let mut state = recovered.state;
                clock.catch_up(recovered.last_at);
                // Leases could not be renewed while the service was down: give every node a full one.
                state.renew_all_leases(clock.now_ms().max(recovered.last_at));
                let log = spawn_flusher(Box::new(journal), 0, recovered.seq, flushed_tx.clone(), metrics.clone())?;
                (state, recovered.seq, Some(log), Role::Single, recovered.last_at)
            }
            (None, Some(_)) => (State::default(), 0, None, Role::Standby { leader: String::new(), epoch: 0 }, 0),
            (None, None) => (State::default(), 0, None, Role::Single, 0),
        };
        let core = Arc::new(Core {
            inner: Mutex::new(Inner {
                state,
                seq,
                last_at,
                log_bytes: 0,
                views: HashMap::new(),
                topics: HashMap::new(),
                stores: config.tcpstore.map(|limits| RoundStores::new(limits, config.listen, config.shared_store_port, cancel.child_token())),
                log,
                role,
                lease: None,
                term: 0,
                takeovers: 0,
            }),
            limits: config.limits,
            clock,
            flushed_tx,
            flushed,
            tick: Notify::new(),
            metrics,
            cancel: cancel.clone(),
            identity: config.ha,
            max_total_store_bytes: config.max_total_store_bytes,
            peers: OnceLock::new(),
        });
        let c = core.clone();
        tracker.spawn(async move { c.timer_loop().await });
        Ok(core)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock would be a bug in the pure state machine; the state is still
        // structurally valid (every mutation completes or returns an error first), so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The current time of the service.
    pub fn now_ms(&self) -> Ms {
        self.clock.now_ms()
    }

    /// The cancellation token the service stops on.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// `Err(NotLeader)` unless this daemon may answer now (single, or the HA leader before its
    /// lease's local deadline). A leader past it steps down here, at once ([`Core::lapse`]).
    fn serving(&self, g: &mut Inner) -> Result<(), RdzvError> {
        let now = Instant::now();
        match Self::standing_of(g, now) {
            Standing::Serve => Ok(()),
            Standing::Standby { leader, epoch } => Err(RdzvError::NotLeader { leader, epoch }),
            Standing::Lapsed => Err(self.lapse(g, now)),
        }
    }

    /// [`standing`] of this daemon at `now`.
    fn standing_of(g: &Inner, now: Instant) -> Standing {
        standing(&g.role, g.lease.as_ref().and_then(|l| l.answer_until()), now)
    }

    /// A leader whose lease reached its local deadline (or is gone) stops answering: it steps down
    /// under the same lock that found it (the HA node sees the ended term through
    /// [`Core::deposed`] and campaigns again). Returns the refusal: no hint, since whoever leads
    /// now is not known here.
    fn lapse(&self, g: &mut Inner, now: Instant) -> RdzvError {
        let epoch = match g.role {
            Role::Leader { epoch } => epoch,
            _ => 0,
        };
        let until = g.lease.as_ref().and_then(|l| l.answer_until());
        self.demote_locked(g, "", 0);
        let span = tracing::warn_span!("lease_deadline", epoch);
        let _entered = span.enter();
        match until {
            Some(u) => tracing::warn!(
                late_ms = now.saturating_duration_since(u).as_millis() as u64,
                "the election lease reached its local deadline: answering nothing more as leader, stepping down"
            ),
            None => tracing::warn!("no live election lease: answering nothing more as leader, stepping down"),
        }
        RdzvError::NotLeader { leader: String::new(), epoch: 0 }
    }

    /// The answer-time check: every handler's answer passes here when it is ready to go out (in
    /// `rpc`, and for each pushed view), whatever the checks it passed while it ran. An HA leader
    /// at or past its lease's local deadline answers [`RdzvError::NotLeader`] without a hint and
    /// steps down, even when the answer was proven by a write acknowledged before the deadline
    /// (it may have stalled since); a daemon that stepped down while the call ran does not send a
    /// success it computed as leader. Returns the leader stamp to attach, read under the same lock.
    fn answer<T>(&self, r: Result<T, RdzvError>) -> Result<(T, Option<pb::LeaderStamp>), RdzvError> {
        // A daemon without HA is `Role::Single` for good: it always serves and stamps nothing,
        // so its answers do not take the executor's lock (as in `settle_by`).
        if self.identity.is_none() {
            return r.map(|v| (v, None));
        }
        let mut g = self.lock();
        // Read once the lock is held: waiting for it must not count as time before the deadline.
        let now = Instant::now();
        match Self::standing_of(&g, now) {
            Standing::Serve => {
                let stamp = self.stamp_of(&g.role);
                r.map(|v| (v, stamp))
            }
            Standing::Lapsed => Err(self.lapse(&mut g, now)),
            // Its own refusals (and errors found before the state was read) stand.
            Standing::Standby { leader, epoch } => match r {
                Ok(_) => Err(RdzvError::NotLeader { leader, epoch }),
                Err(e) => Err(e),
            },
        }
    }

    /// What to wait for before answering from the state as it is now: `seq` durable and, when
    /// `confirm`, a leadership confirmation begun from now on (HA leaders; free elsewhere).
    fn settle_point(g: &Inner, seq: u64, confirm: bool) -> Settle {
        let ticket = if confirm { g.log.as_ref().map(|d| d.ticket()).unwrap_or(0) } else { 0 };
        Settle { term: g.term, seq, ticket, logged: g.log.is_some() }
    }

    /// Applies a command and, when it changed durable state, queues it for the log. Returns the
    /// outcome and the sequence number the caller must wait for.
    fn apply_locked(&self, g: &mut Inner, cmd: &Command) -> Result<(Outcome, u64), RdzvError> {
        self.serving(g)?;
        let now = self.clock.now_ms().max(g.last_at);
        let job_id = cmd.job().to_string();
        // A retry of a call the state machine remembers (its first attempt applied, its answer
        // lost) is answered from memory and changes nothing: the admission caps below are for
        // changes, and refusing it would report a failure for a write that was applied.
        let repeat = g.state.remembered(cmd).is_some();
        if !repeat {
            store_cap_check(&g.state, cmd, self.max_total_store_bytes)?;
        }
        // A log that stopped taking writes (a full disk, an unreachable etcd) holds every change
        // made since in memory: past a bound, changes are refused until it catches up.
        if cmd.is_durable()
            && !repeat
            && let Some(d) = &g.log
        {
            let unwritten = d.lock().unwritten_bytes();
            if unwritten > MAX_UNWRITTEN_LOG_BYTES {
                let why = self.flushed.borrow().error.clone().unwrap_or_else(|| "it is slow".into());
                return Err(RdzvError::Unavailable(format!(
                    "{unwritten} bytes of changes wait for the log ({why}): changes are refused until it catches up"
                )));
            }
        }
        // Encoded before the state changes: a record that cannot be encoded changes nothing.
        let record = match &g.log {
            Some(_) if cmd.is_durable() => Some(journal::encode(&Entry { seq: g.seq + 1, at: now, cmd: cmd.clone() })?),
            _ => None,
        };
        let was_running = g.state.jobs.get(&job_id).map(|j| (j.round, matches!(j.phase, Phase::Running { .. })));
        let (outcome, effects) = g.state.apply(cmd, now, &self.limits)?;
        if effects.changed && cmd.is_durable() {
            g.seq += 1;
            g.last_at = now;
            if let (Some(d), Some(bytes)) = (g.log.clone(), record) {
                g.log_bytes += bytes.len() as u64;
                let mut q = d.lock();
                match q.items.last_mut() {
                    Some(Work::Records { bytes: buf, last_seq, tried: false }) => {
                        buf.extend_from_slice(&bytes);
                        *last_seq = g.seq;
                    }
                    _ => q.items.push(Work::Records { bytes, last_seq: g.seq, tried: false }),
                }
                // Proportional to the state as well: a snapshot rewrites the whole state (mostly
                // its stores), which must not cost many times the log it replaces.
                if g.log_bytes >= d.compact_every.max(g.state.totals.store_bytes as u64) {
                    g.log_bytes = 0;
                    // One snapshot waiting at a time: the newest covers what an older one would.
                    q.items.retain(|w| !matches!(w, Work::Compact { .. }));
                    q.items.push(Work::Compact { state: Box::new(g.state.clone()), seq: g.seq });
                }
                drop(q);
                d.ready.notify_one();
            }
        }
        // Wake whoever this concerns.
        for topic in effects.topics {
            let key = (job_id.clone(), topic);
            if let Some(tx) = g.topics.get(&key) {
                if tx.receiver_count() == 0 {
                    g.topics.remove(&key);
                } else {
                    tx.send_modify(|v| *v += 1);
                }
            }
        }
        if let Some(stores) = g.stores.as_mut() {
            stores.sync(&job_id, &g.state);
        }
        match g.state.jobs.get(&job_id) {
            Some(job) => {
                let view = job.view();
                let now_running = (job.round, matches!(job.phase, Phase::Running { .. }));
                if now_running.1 && was_running != Some(now_running) {
                    self.metrics.rounds_formed.inc();
                    tracing::info!(job = %job_id, round = job.round, nodes = view.max_nodes.min(job.nodes.len() as u32), "round formed");
                }
                let seq = g.seq;
                let tx = g.views.entry(job_id.clone()).or_insert_with(|| watch::channel((view.clone(), seq)).0);
                tx.send_if_modified(|old| {
                    if significant(&old.0, &view) {
                        *old = (view, seq);
                        true
                    } else {
                        false
                    }
                });
            }
            None => {
                // Dropping the sender wakes every waiter of the removed job.
                g.views.remove(&job_id);
                g.topics.retain(|(j, _), _| *j != job_id);
            }
        }
        if effects.changed {
            self.tick.notify_one();
        }
        Ok((outcome, g.seq))
    }

    /// How many jobs have an interface noted (tests: it must not grow with refused joins).
    pub fn noted_interfaces(&self) -> usize {
        self.lock().stores.as_ref().map_or(0, |s| s.n_interfaces())
    }

    /// The PyTorch store serving `round` of `job`, if the service hosts one.
    pub fn round_store(&self, job: &str, round: u64) -> Option<std::net::SocketAddr> {
        self.lock().stores.as_ref().and_then(|s| s.endpoint(job, round))
    }

    /// Hands a PyTorch store connection that reached the service's own port to `job`'s running
    /// round's store; `false` (and the connection closed) when there is none.
    pub fn adopt_store_connection(&self, job: &str, stream: std::net::TcpStream) -> bool {
        self.lock().stores.as_ref().is_some_and(|s| s.adopt(job, stream))
    }

    /// Executes a command and waits until it is durable.
    pub async fn execute(&self, cmd: Command) -> Result<Outcome, RdzvError> {
        self.execute_admitted(cmd, |_| Ok(())).await
    }

    /// [`Core::execute`] after `admit` accepted the state the command would apply to, under the
    /// same lock (no other command comes between): an admission rule of the caller's, such as a
    /// token's job quota, that is not the state machine's (replay does not check it again).
    pub async fn execute_admitted(&self, cmd: Command, admit: impl FnOnce(&State) -> Result<(), RdzvError>) -> Result<Outcome, RdzvError> {
        self.execute_noting(cmd, admit, None).await
    }

    /// [`Core::execute_admitted`] of a Join that reached the service on local address
    /// `interface`: noted for the job's round stores (they listen there) in the same locked step
    /// as the Join, and forgotten there if the Join was refused before the job existed. Noted and
    /// forgotten apart, a refused first Join could forget the address another Join of the same
    /// new job had just relied on, or (its call cancelled in between) never forget it.
    pub async fn execute_noting(
        &self,
        cmd: Command,
        admit: impl FnOnce(&State) -> Result<(), RdzvError>,
        interface: Option<IpAddr>,
    ) -> Result<Outcome, RdzvError> {
        let (outcome, settle) = {
            let mut g = self.lock();
            self.serving(&mut g)?;
            let before = g.seq;
            if let (Some(ip), Some(stores)) = (interface, g.stores.as_mut()) {
                stores.note_interface(cmd.job(), ip);
            }
            let applied = admit(&g.state).and_then(|()| self.apply_locked(&mut g, &cmd));
            if applied.is_err() && interface.is_some() {
                let Inner { stores, state, .. } = &mut *g;
                if let Some(stores) = stores.as_mut() {
                    stores.forget_if_unknown(cmd.job(), state);
                }
            }
            match applied {
                // A logged command is proven by its own guarded append, which begins after it
                // was applied; one that logged nothing needs a confirmation.
                Ok((outcome, seq)) => (Ok(outcome), Self::settle_point(&g, seq, seq == before)),
                // A refusal is read from the state like any answer: an HA leader that may have
                // been deposed while it was paused must confirm before it says so.
                Err(e) => (Err(e), Self::settle_point(&g, g.seq, true)),
            }
        };
        self.settle(settle).await?;
        outcome
    }

    /// Waits until `settle.seq` is durable (and, for HA leaders, leadership was confirmed after the
    /// caller looked). A term that ended meanwhile (step-down) fails the wait: nothing derived from
    /// a dropped state is ever answered.
    async fn settle(&self, settle: Settle) -> Result<(), RdzvError> {
        self.settle_by(settle, Instant::now() + DURABILITY_TIMEOUT).await
    }

    /// [`Core::settle`] that gives up at `deadline` (a blocking call's answer is due within the
    /// client's slack past its wait: see [`ANSWER_SLACK`]).
    async fn settle_by(&self, settle: Settle, deadline: Instant) -> Result<(), RdzvError> {
        if !settle.logged {
            return Ok(());
        }
        let mut rx = self.flushed.clone();
        loop {
            // A copy, not the borrow: the borrow is a read lock that `demote` waits for while it
            // holds the executor's lock, which `not_leader` takes (lock order: the executor's, then
            // the channel's; holding them the other way round deadlocked a daemon at a step-down).
            let f = rx.borrow_and_update().clone();
            if f.term != settle.term {
                return Err(self.not_leader());
            }
            if let Some(e) = f.fatal {
                return Err(e);
            }
            if f.seq >= settle.seq && f.confirmed >= settle.ticket {
                // Proven, and still answered only before the lease's local deadline: the write
                // or confirmation may have been acknowledged late, or the daemon stalled since.
                if self.identity.is_none() {
                    return Ok(());
                }
                let mut g = self.lock();
                return self.serving(&mut g);
            }
            if let Some(e) = &f.error {
                return Err(RdzvError::Unavailable(format!("the change is not durable yet: {e}")));
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(RdzvError::ShuttingDown) },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(RdzvError::Unavailable("the log did not become durable in time".into()));
                }
                _ = self.cancel.cancelled() => return Err(RdzvError::ShuttingDown),
            }
        }
    }

    fn not_leader(&self) -> RdzvError {
        match &self.lock().role {
            Role::Standby { leader, epoch } => RdzvError::NotLeader { leader: leader.clone(), epoch: *epoch },
            _ => RdzvError::NotLeader { leader: String::new(), epoch: 0 },
        }
    }

    /// Reads the state and waits until what it saw is durable (errors derived from the state too).
    pub async fn read<T>(&self, f: impl FnOnce(&State) -> Result<T, RdzvError>) -> Result<T, RdzvError> {
        let (value, settle) = {
            let mut g = self.lock();
            self.serving(&mut g)?;
            (f(&g.state), Self::settle_point(&g, g.seq, true))
        };
        self.settle(settle).await?;
        value
    }

    /// Waits until `check` yields a value, the deadline passes (then `on_timeout` describes what was
    /// missing), or the service shuts down. `topic` names the store topic to wake on besides the view.
    pub async fn wait_for<T>(
        &self,
        job: &str,
        topic: Option<String>,
        deadline: Instant,
        mut check: impl FnMut(&State) -> Result<Option<T>, RdzvError>,
        on_timeout: impl FnOnce(&State) -> String,
    ) -> Result<T, RdzvError> {
        loop {
            let (found, settle, mut view_rx, mut topic_rx) = {
                let mut g = self.lock();
                self.serving(&mut g)?;
                // Nothing more comes to a job that ended (failed or completed): its waiters are
                // told at once, not at their deadline (a key, a barrier, a unique id, a round).
                let found = match check(&g.state) {
                    Ok(None) => g.state.jobs.get(job).and_then(|j| j.ended_error()).map_or(Ok(None), Err),
                    other => other,
                };
                let seq = g.seq;
                let settle = match &found {
                    Ok(None) => None,
                    _ => Some(Self::settle_point(&g, seq, true)),
                };
                // Channels only for a call that goes on waiting (an answer now needs none, and
                // would leave entries for the sweep).
                let waits = matches!(found, Ok(None));
                let view = g.state.jobs.get(job).filter(|_| waits).map(|j| j.view());
                let view_rx = view.map(|v| g.views.entry(job.to_string()).or_insert_with(|| watch::channel((v, seq)).0).subscribe());
                let topic_rx = topic.as_ref().filter(|_| waits).map(|t| {
                    g.topics.entry((job.to_string(), t.clone())).or_insert_with(|| watch::channel(0).0).subscribe()
                });
                (found, settle, view_rx, topic_rx)
            };
            let answer_by = (Instant::now() + DURABILITY_TIMEOUT).min(deadline.max(Instant::now()) + ANSWER_SLACK);
            // An answer derived from the state (a value or an error) must not show what a crash
            // could undo.
            match found {
                Ok(Some(v)) => {
                    self.settle_by(settle.unwrap_or(Settle { term: 0, seq: 0, ticket: 0, logged: false }), answer_by).await?;
                    return Ok(v);
                }
                Err(e) => {
                    self.settle_by(settle.unwrap_or(Settle { term: 0, seq: 0, ticket: 0, logged: false }), answer_by).await?;
                    return Err(e);
                }
                Ok(None) => {}
            }
            let view_changed = async {
                match view_rx.as_mut() {
                    Some(rx) => {
                        let _ = rx.changed().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let topic_changed = async {
                match topic_rx.as_mut() {
                    Some(rx) => {
                        let _ = rx.changed().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = view_changed => {}
                _ = topic_changed => {}
                _ = tokio::time::sleep_until(deadline) => {
                    // The explanation is read from the state like any answer: confirmed first (an
                    // HA leader paused past its lease must not describe a state it lost).
                    let (why, settle) = {
                        let mut g = self.lock();
                        self.serving(&mut g)?;
                        (on_timeout(&g.state), Self::settle_point(&g, g.seq, true))
                    };
                    self.settle_by(settle, Instant::now() + ANSWER_SLACK).await?;
                    return Err(RdzvError::Timeout(why));
                }
                _ = self.cancel.cancelled() => return Err(RdzvError::ShuttingDown),
            }
        }
    }

    /// A receiver of the job's view and the sequence number it is as of (current value first), and
    /// the term it belongs to (pushes stop when the term ends).
    pub fn subscribe_view(&self, job: &str) -> Result<(watch::Receiver<(pb::JobView, u64)>, u64), RdzvError> {
        let mut g = self.lock();
        self.serving(&mut g)?;
        let view = g.state.job(job)?.view();
        let seq = g.seq;
        let term = g.term;
        Ok((g.views.entry(job.to_string()).or_insert_with(|| watch::channel((view, seq)).0).subscribe(), term))
    }

    /// Waits until `seq` of `term` is durable. A view pushed because it changed is proven by the
    /// guarded append of the command that changed it; the first view of a watch is a read of
    /// state that may be old, so `confirm` asks for a leadership confirmation begun after it.
    pub async fn durable(&self, term: u64, seq: u64, confirm: bool) -> Result<(), RdzvError> {
        let settle = {
            let g = self.lock();
            if g.term != term {
                drop(g);
                return Err(self.not_leader());
            }
            Self::settle_point(&g, seq, confirm)
        };
        self.settle(settle).await
    }

    /// Applies what time made due, then sleeps until the next deadline or a change.
    async fn timer_loop(self: Arc<Self>) {
        let mut last_gauges = Instant::now() - Duration::from_secs(10);
        loop {
            let next = {
                let mut g = self.lock();
                // Standbys run no timers: what time makes due is the leader's to decide and log.
                // A leader past its lease's local deadline steps down here too, within a second
                // of it, calls or not.
                let next = if self.serving(&mut g).is_ok() {
                    let now = self.clock.now_ms().max(g.last_at);
                    for cmd in g.state.due(now, &self.limits) {
                        if let Err(e) = self.apply_locked(&mut g, &cmd) {
                            tracing::debug!(error = %e, ?cmd, "timed command not applied");
                        } else {
                            log_timed(&cmd);
                        }
                    }
                    g.state.next_deadline(&self.limits)
                } else {
                    None
                };
                if last_gauges.elapsed() >= Duration::from_secs(1) {
                    last_gauges = Instant::now();
                    self.update_gauges(&mut g);
                }
                next
            };
            let wake = next.map(|t| self.clock.instant_at(t)).unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            let wake = wake.min(Instant::now() + Duration::from_secs(1));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.tick.notified() => {}
                _ = self.cancel.cancelled() => break,
            }
        }
        let log = self.lock().log.clone();
        if let Some(d) = log {
            d.stop(false);
            // Wait until the log thread has written what was queued (each write is bounded, and
            // a failing one ends it once stopped) and dropped its store: a service started
            // right after on the same data directory then finds its lock free, and a process
            // that exits after the service's end loses no queued record.
            let thread = d.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(thread) = thread {
                match tokio::task::spawn_blocking(move || thread.join()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => tracing::error!("the log thread panicked"),
                    Err(e) => tracing::error!(error = %e, "the log thread could not be joined"),
                }
            }
        }
    }

    fn update_gauges(&self, g: &mut Inner) {
        let m = &self.metrics;
        m.jobs.set(g.state.jobs.len() as i64);
        m.nodes.set(g.state.jobs.values().map(|j| j.nodes.len() as i64).sum());
        m.store_keys.set(g.state.jobs.values().map(|j| (j.store.len() + j.round_store.len()) as i64).sum());
        m.store_bytes.set(g.state.jobs.values().map(|j| j.store_bytes as i64).sum());
        g.topics.retain(|_, tx| tx.receiver_count() > 0);
    }

    // --- HA: driven by `crate::ha` -------------------------------------------------------------

    /// The role now.
    pub fn role(&self) -> Role {
        self.lock().role.clone()
    }

    /// The last sequence number and entry time of the state (a standby's replica position).
    pub fn position(&self) -> (u64, Ms) {
        let g = self.lock();
        (g.seq, g.last_at)
    }

    /// Standby: the leader to name in refusals.
    pub fn set_leader_hint(&self, leader: &str, epoch: u64) {
        let mut g = self.lock();
        if let Role::Standby { leader: l, epoch: e } = &mut g.role
            && epoch >= *e
        {
            *l = leader.to_owned();
            *e = epoch;
        }
    }

    /// Standby: replaces the replica with a state rebuilt from the log.
    ///
    /// # Errors
    /// The daemon leads (its state is the log's source, never replaced).
    pub fn replica_reset(&self, state: State, seq: u64, last_at: Ms) -> Result<(), RdzvError> {
        let mut g = self.lock();
        if !matches!(g.role, Role::Standby { .. }) {
            return Err(RdzvError::FailedPrecondition("only a standby's replica can be reset".into()));
        }
        g.state = state;
        g.state.recount();
        g.seq = seq;
        g.last_at = last_at;
        Ok(())
    }

    /// Standby: applies logged entries to the replica, in order; entries it already holds are
    /// skipped. Returns the replica's sequence number.
    ///
    /// # Errors
    /// A gap (an entry after the next one expected): the replica must be rebuilt.
    pub fn replica_apply(&self, entries: &[Entry]) -> Result<u64, RdzvError> {
        let mut g = self.lock();
        if !matches!(g.role, Role::Standby { .. }) {
            return Err(RdzvError::FailedPrecondition("only a standby applies replicated entries".into()));
        }
        for e in entries {
            if e.seq <= g.seq {
                continue;
            }
            if e.seq != g.seq + 1 {
                return Err(RdzvError::Storage {
                    path: "etcd log".into(),
                    message: format!("gap in the replicated log: expected sequence {}, got {}", g.seq + 1, e.seq),
                });
            }
            if let Err(err) = g.state.apply(&e.cmd, e.at, &Limits::unbounded()) {
                // A command that succeeded when it was logged must succeed again; say so loudly.
                tracing::error!(seq = e.seq, error = %err, "replica diverged from the log");
            }
            g.seq = e.seq;
            g.last_at = g.last_at.max(e.at);
        }
        Ok(g.seq)
    }

    /// Standby → leader of `epoch`: the replica (caught up to the barrier revision) becomes the
    /// state, every node gets a full lease, the log goes to `store`, and calls are answered until
    /// `lease`'s local deadline ([`LeaderLease`]), when the daemon steps down by itself.
    ///
    /// # Errors
    /// The flusher thread cannot start.
    pub fn promote(&self, epoch: u64, store: Box<dyn LogStore>, lease: Arc<dyn LeaderLease>) -> Result<(), RdzvError> {
        let mut g = self.lock();
        self.clock.catch_up(g.last_at);
        let now = self.clock.now_ms().max(g.last_at);
        g.term += 1;
        let term = g.term;
        g.state.renew_all_leases(now);
        g.state.recount();
        let backlog = store.snapshot_seq().is_some_and(|s| g.seq > s);
        let log = spawn_flusher(store, term, g.seq, self.flushed_tx.clone(), self.metrics.clone())?;
        if backlog {
            // The log since the last snapshot is the predecessors': snapshot it now (see
            // `LogStore::snapshot_seq`).
            log.lock().items.push(Work::Compact { state: Box::new(g.state.clone()), seq: g.seq });
            log.ready.notify_one();
        }
        g.log = Some(log);
        g.log_bytes = 0;
        g.role = Role::Leader { epoch };
        g.lease = Some(lease);
        g.takeovers += 1;
        let inner = &mut *g;
        if let Some(stores) = inner.stores.as_mut() {
            let jobs: Vec<String> = inner.state.jobs.keys().cloned().collect();
            for job in jobs {
                stores.sync(&job, &inner.state);
            }
        }
        drop(g);
        self.metrics.ha_leader.set(1);
        self.metrics.ha_epoch.set(epoch as i64);
        self.metrics.ha_failovers.inc();
        self.tick.notify_one();
        Ok(())
    }

    /// Leader → standby: stops answering at once, fails every waiter of the term with a
    /// [`RdzvError::NotLeader`], drops the log and the round stores. The state it held may contain
    /// speculative, never-committed commands: the HA node rebuilds the replica from etcd before
    /// anything else.
    pub fn demote(&self, leader: &str, epoch: u64) {
        let mut g = self.lock();
        let was_leading = self.demote_locked(&mut g, leader, epoch);
        drop(g);
        if was_leading {
            tracing::warn!(leader, epoch, "no longer the leader: calls are refused until this daemon leads again");
        }
    }

    /// [`Core::demote`] under the executor's lock; returns whether the daemon was leading.
    fn demote_locked(&self, g: &mut Inner, leader: &str, epoch: u64) -> bool {
        let was_leading = matches!(g.role, Role::Leader { .. });
        g.term += 1;
        let term = g.term;
        g.role = Role::Standby { leader: leader.to_owned(), epoch };
        g.lease = None;
        if let Some(d) = g.log.take() {
            d.stop(true);
        }
        let err = RdzvError::NotLeader { leader: leader.to_owned(), epoch };
        self.flushed_tx.send_replace(Flushed { term, seq: g.seq, confirmed: 0, error: None, fatal: Some(err) });
        // Dropping the senders wakes every waiter and ends every pushed stream.
        g.views.clear();
        g.topics.clear();
        if let Some(stores) = g.stores.as_mut() {
            stores.clear();
        }
        self.metrics.ha_leader.set(0);
        was_leading
    }

    /// Resolves when the term current at the call ends: the flusher of the term reported the log
    /// refused this writer (deposed), or the executor stepped down by itself (an answer or the
    /// timer found the lease's local deadline passed), or anyone demoted it.
    pub async fn deposed(&self) -> RdzvError {
        let mut rx = self.flushed.clone();
        let term = self.lock().term;
        loop {
            // A copy: the channel's read lock is never held while the executor's is taken (see
            // `settle_by`).
            let f = rx.borrow_and_update().clone();
            if f.term != term {
                return self.not_leader();
            }
            if let Some(e) = f.fatal {
                return e;
            }
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Installs where `DaemonInfo` finds the campaigning daemons.
    pub fn set_peer_source(&self, peers: Arc<dyn PeerSource>) {
        let _ = self.peers.set(peers);
    }

    /// This daemon's role and progress.
    pub async fn daemon_info(&self) -> pb::DaemonInfoResponse {
        let mut info = {
            let mut g = self.lock();
            let now = Instant::now();
            // A leader past its lease's local deadline says so by no longer saying it leads.
            if Self::standing_of(&g, now) == Standing::Lapsed {
                let _ = self.lapse(&mut g, now);
            }
            let (role, epoch, leader) = match &g.role {
                Role::Single => (pb::DaemonRole::Single, 0, String::new()),
                Role::Leader { epoch } => {
                    (pb::DaemonRole::Leader, *epoch, self.identity.as_ref().map(|i| i.advertise.clone()).unwrap_or_default())
                }
                Role::Standby { leader, epoch } => (pb::DaemonRole::Standby, *epoch, leader.clone()),
            };
            pb::DaemonInfoResponse {
                daemon_id: self.identity.as_ref().map(|i| i.daemon_id.clone()).unwrap_or_default(),
                advertise: self.identity.as_ref().map(|i| i.advertise.clone()).unwrap_or_default(),
                role: role as i32,
                epoch,
                leader_endpoint: leader,
                applied_seq: g.seq,
                applied_at_unix_ms: g.last_at,
                daemons: Vec::new(),
                takeovers: g.takeovers,
            }
        };
        if let Some(p) = self.peers.get() {
            info.daemons = p.peers().await;
        }
        info
    }

    /// The stamp every response of the HA leader carries.
    fn stamp(&self) -> Option<pb::LeaderStamp> {
        self.stamp_of(&self.lock().role)
    }

    /// The stamp of a daemon in `role` (`None` unless it leads).
    fn stamp_of(&self, role: &Role) -> Option<pb::LeaderStamp> {
        match role {
            Role::Leader { epoch } => Some(pb::LeaderStamp {
                epoch: *epoch,
                leader_endpoint: self.identity.as_ref().map(|i| i.advertise.clone()).unwrap_or_default(),
            }),
            _ => None,
        }
    }
}

fn log_timed(cmd: &Command) {
    match cmd {
        Command::ExpireNode { job, node } => tracing::warn!(%job, %node, "node lease expired"),
        Command::CloseRound { job } => tracing::debug!(%job, "last call over"),
        Command::RemoveJob { job } => tracing::info!(%job, "job forgotten after its retention time"),
        _ => {}
    }
}

/// Starts the flusher thread of one term over `store`, whose log holds everything up to `durable`.
fn spawn_flusher(
    store: Box<dyn LogStore>,
    term: u64,
    durable: u64,
    flushed: Arc<watch::Sender<Flushed>>,
    metrics: Arc<Metrics>,
) -> Result<Arc<Durability>, RdzvError> {
    let d = Arc::new(Durability {
        queue: Mutex::new(Queue::default()),
        ready: Condvar::new(),
        confirm_reads: store.reads_need_confirmation(),
        compact_every: store.compact_every(),
        thread: Mutex::new(None),
    });
    flushed.send_replace(Flushed { term, seq: durable, confirmed: 0, error: None, fatal: None });
    let q = d.clone();
    let thread = std::thread::Builder::new()
        .name("rsrun-log".into())
        .spawn(move || flusher(store, term, durable, q, flushed, metrics))
        .map_err(|e| RdzvError::Unavailable(format!("cannot start the log thread: {e}")))?;
    *d.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
    Ok(d)
}

/// The log thread of one term: drains the queue in order, appending records (group commit: one
/// write covers everything queued meanwhile), writing snapshots, and proving leadership for waiting
/// reads. On a write error it keeps the work, reports the error to waiters, and retries; when the
/// log refuses this writer for good (deposed) it reports that and ends.
fn flusher(mut store: Box<dyn LogStore>, term: u64, mut durable: u64, d: Arc<Durability>, flushed: Arc<watch::Sender<Flushed>>, metrics: Arc<Metrics>) {
    let mut confirmed = 0u64;
    let publish = |f: Flushed| {
        flushed.send_if_modified(|cur| {
            // A newer term owns the channel: this thread's news is stale.
            if cur.term != term {
                return false;
            }
            *cur = f;
            true
        });
    };
    loop {
        let (work, ticket) = {
            let mut q = d.lock();
            while q.items.is_empty() && !q.closed && q.tickets == confirmed {
                q = d.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.abandoned || (q.closed && q.items.is_empty()) {
                return;
            }
            let ticket = q.tickets;
            let work = if q.items.is_empty() { None } else { Some(q.items.remove(0)) };
            (work, ticket)
        };
        let result = match &work {
            Some(Work::Records { bytes, last_seq, .. }) => store.append(bytes, durable + 1, *last_seq).map(|()| {
                metrics.journal_syncs.inc();
                metrics.journal_bytes.inc_by(bytes.len() as u64);
                (*last_seq, ticket)
            }),
            Some(Work::Compact { state, seq }) => store.compact(state, *seq).map(|()| (durable, confirmed)),
            None => store.confirm().map(|()| (durable, ticket)),
        };
        match result {
            Ok((seq, proven)) => {
                durable = seq;
                confirmed = confirmed.max(proven);
                publish(Flushed { term, seq, confirmed, error: None, fatal: None });
            }
            Err(e @ RdzvError::NotLeader { .. }) => {
                tracing::warn!(error = %e, "the log refused this leader's write: stepping down");
                publish(Flushed { term, seq: durable, confirmed, error: None, fatal: Some(e) });
                return;
            }
            // A snapshot that failed is dropped: the log still holds everything it covered, the
            // next one is taken later, and a snapshot retried in front would hold back records
            // that can land. Nothing waits on it: no error to publish.
            Err(e) if matches!(work, Some(Work::Compact { .. })) => {
                tracing::warn!(error = %e, "snapshot failed; the log keeps every change, and the next snapshot is taken later");
            }
            Err(e) => {
                let first = flushed.borrow().error.is_none();
                if first {
                    tracing::error!(error = %e, "log write failed; mutations are refused until it succeeds");
                }
                publish(Flushed { term, seq: durable, confirmed, error: Some(e.to_string()), fatal: None });
                // Put the records back in front and retry after a pause.
                let mut q = d.lock();
                if let Some(Work::Records { bytes, last_seq, .. }) = work {
                    q.items.insert(0, Work::Records { bytes, last_seq, tried: true });
                }
                let stop = q.closed;
                drop(q);
                if stop {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------------
// gRPC handlers

/// The gRPC service over a [`Core`].
#[derive(Debug, Clone)]
pub struct Service {
    core: Arc<Core>,
}

impl Service {
    /// Wraps the executor.
    pub fn new(core: Arc<Core>) -> Self {
        Service { core }
    }

    /// Waits until every key of `keys` exists in `scope`, up to `deadline` (`timeout_ms` from the
    /// call, for the message). One read finds the keys missing now; only those are waited for, one
    /// by one (each wait wakes on its own key): a wait per key, present or not, settled each on its
    /// own (an etcd round trip on an HA leader), and 10,000 keys outlived any deadline.
    async fn wait_for_keys(&self, scope: &Scope, keys: &[String], deadline: Instant, timeout_ms: u64) -> Result<(), RdzvError> {
        let job = &scope.job;
        let missing = self
            .core
            .read(|s| {
                let j = s.job(job)?;
                let mut seen = std::collections::HashSet::new();
                let mut missing: Vec<String> = Vec::new();
                for k in keys {
                    if j.get(scope, k)?.is_none() && seen.insert(k.as_str()) {
                        missing.push(k.clone());
                    }
                }
                Ok(missing)
            })
            .await?;
        for key in &missing {
            self.core
                .wait_for(job, Some(scope.key_topic(key)), deadline, |s| Ok(s.job(job)?.get(scope, key)?.map(|_| ())), |s| {
                    let missing: Vec<&String> = keys
                        .iter()
                        .filter(|k| s.job(job).ok().and_then(|j| j.get(scope, k).ok().flatten()).is_none())
                        .take(16)
                        .collect();
                    format!("keys {missing:?} did not appear in job {job:?} within {timeout_ms} ms")
                })
                .await?;
        }
        Ok(())
    }

    fn deadline(&self, timeout_ms: u64) -> Result<Instant, RdzvError> {
        let ms = validate::timeout(self.core.limits(), timeout_ms)?;
        Ok(Instant::now() + Duration::from_millis(ms))
    }
}

fn principal<T>(req: &Request<T>) -> Principal {
    // Requests that bypassed the interceptor (in-process tests) act as the unrestricted principal.
    req.extensions().get::<Principal>().cloned().unwrap_or(Principal::Any)
}

/// Runs a handler body, records its latency and converts errors (the one place errors become statuses).
/// The answer is checked when it is ready to go out ([`Core::answer`]): an HA leader past its
/// lease's local deadline sends none.
async fn rpc<T>(core: &Core, method: &'static str, body: impl Future<Output = Result<T, RdzvError>>) -> Result<Response<T>, Status> {
    let start = std::time::Instant::now();
    let result = core.answer(body.await);
    let code = result.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(RdzvError::code);
    core.metrics.observe(method, code, start.elapsed().as_secs_f64());
    if let Err(e) = &result {
        tracing::debug!(method, error = %e, "rpc failed");
    }
    result.map(|(body, stamp)| with_stamp(Response::new(body), stamp)).map_err(Status::from)
}

/// Adds the HA leader's [`pb::LeaderStamp`] to a response (nothing outside HA).
fn stamped<T>(core: &Core, resp: Response<T>) -> Response<T> {
    with_stamp(resp, core.stamp())
}

/// Adds `stamp`, when there is one, to a response.
fn with_stamp<T>(mut resp: Response<T>, stamp: Option<pb::LeaderStamp>) -> Response<T> {
    if let Some(stamp) = stamp {
        use prost::Message;
        resp.metadata_mut().insert_bin(LEADER_STAMP_KEY, tonic::metadata::MetadataValue::from_bytes(&stamp.encode_to_vec()));
    }
    resp
}

fn job_spec(config: Option<&pb::JobConfig>) -> Result<JobSpec, RdzvError> {
    let c = config.ok_or_else(|| RdzvError::invalid("config", "missing; min_nodes and max_nodes are required"))?;
    Ok(JobSpec {
        min_nodes: c.min_nodes,
        max_nodes: c.max_nodes,
        last_call_ms: c.last_call_ms,
        lease_ms: c.lease_ms,
        max_restarts: c.max_restarts,
        fixed_ranks: c.fixed_ranks,
    })
}

fn scope_of(p: &Principal, scope: Option<&pb::StoreScope>) -> Result<Scope, RdzvError> {
    let s = Scope::from_pb(scope)?;
    p.check(&s.job)?;
    Ok(s)
}

fn forming_summary(state: &State, job: &str) -> String {
    match state.job(job) {
        Err(e) => e.to_string(),
        Ok(j) => match &j.phase {
            Phase::Forming { joined, rejoining, .. } => {
                let names: Vec<String> = joined
                    .iter()
                    .take(16)
                    .map(|id| {
                        let addr = j.nodes.get(id).and_then(|n| n.addrs.first().cloned()).unwrap_or_default();
                        format!("{id} ({addr})")
                    })
                    .collect();
                let more = if joined.len() > 16 { format!(" and {} more", joined.len() - 16) } else { String::new() };
                let missing: Vec<&String> = rejoining.iter().take(16).collect();
                let missing = if missing.is_empty() { String::new() } else { format!("; previous members not back: {missing:?}") };
                format!(
                    "round {} of job {job:?} did not form: {} of min {} nodes joined [{}{more}]{missing}",
                    j.round,
                    joined.len(),
                    j.spec.min_nodes,
                    names.join(", ")
                )
            }
            _ => format!("job {job:?} is {:?} in round {}", pb::JobState::try_from(j.view().state).unwrap_or_default(), j.round),
        },
    }
}

#[tonic::async_trait]
impl pb::rendezvous_server::Rendezvous for Service {
    async fn join(&self, req: Request<pb::JoinRequest>) -> Result<Response<pb::JoinResponse>, Status> {
        let p = principal(&req);
        let quota = req.extensions().get::<JobQuota>().copied();
        let local = req.local_addr();
        let r = req.into_inner();
        rpc(&self.core, "Join", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            validate::addrs(&r.addrs)?;
            validate::hostname(&r.hostname)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let cmd = Command::Join(JoinCmd {
                job: r.job_id.clone(),
                node: r.node_id.clone(),
                addrs: r.addrs.clone(),
                hostname: r.hostname.clone(),
                local_world_size: r.local_world_size,
                rank_hint: r.rank_hint,
                master_port: r.master_port,
                spec: job_spec(r.config.as_ref())?,
            });
            let admit = |st: &State| quota.map_or(Ok(()), |q| q.admit(&p, st, &r.job_id));
            self.core.execute_noting(cmd.clone(), &admit, local.map(|l| l.ip())).await?;
            let (job, node) = (r.job_id.as_str(), r.node_id.as_str());
            // Instrumented, never entered across an await: an entered span would leak into whatever
            // else runs on this thread meanwhile, and spans would nest into each other.
            let span = tracing::info_span!("join", job, node);
            async move {
            // A pending join holds the node's lease: it is renewed every third of the lease while the
            // call waits, and lapses when the caller goes away (the call is cancelled).
            let lease = self.core.read(|s| Ok(s.job(job)?.spec.lease_ms)).await?;
            let renew_every = Duration::from_millis((lease / 3).max(10));
            loop {
                let step = deadline.min(Instant::now() + renew_every);
                let waited = self
                    .core
                    .wait_for(
                        job,
                        None,
                        step,
                        |s| {
                            let j = s.job(job)?;
                            // A job that completed or failed while this node waited (a spare) ends the wait.
                            if let Some(e) = j.ended_error() {
                                return Err(e);
                            }
                            if !j.nodes.contains_key(node) {
                                return Err(RdzvError::NotMember {
                                    job: job.into(),
                                    node: node.into(),
                                    reason: "it left or its lease expired while waiting".into(),
                                });
                            }
                            if j.awaits_rejoin(node) {
                                return Ok(Some(None));
                            }
                            Ok(j.assignment(node).map(Some))
                        },
                        |s| forming_summary(s, job),
                    )
                    .await;
                match waited {
                    Err(RdzvError::Timeout(_)) if Instant::now() < deadline => {
                        // Renewal failure shows up as NotMember on the next check.
                        let _ = self.core.execute(Command::KeepAlive { job: job.into(), node: node.into() }).await;
                    }
                    // The round this node joined formed and ended before it looked: it joins the
                    // next one, as its launcher would have (the same request again).
                    Ok(None) => {
                        self.core.execute_admitted(cmd.clone(), &admit).await?;
                    }
                    Ok(Some(mut resp)) => {
                        if let Some(round) = resp.round.as_mut()
                            && let Some(ep) = self.core.round_store(job, round.round)
                        {
                            round.store_addr = ep.ip().to_string();
                            round.store_port = u32::from(ep.port());
                        }
                        return Ok(resp);
                    }
                    Err(e) => return Err(e),
                }
            }
            }
            .instrument(span)
            .await
        })
        .await
    }

    async fn keep_alive(&self, req: Request<pb::KeepAliveRequest>) -> Result<Response<pb::KeepAliveResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "KeepAlive", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            self.core.execute(Command::KeepAlive { job: r.job_id.clone(), node: r.node_id.clone() }).await?;
            let view = self.core.read(|s| Ok(s.job(&r.job_id)?.view())).await?;
            Ok(pb::KeepAliveResponse { view: Some(view) })
        })
        .await
    }

    async fn leave(&self, req: Request<pb::LeaveRequest>) -> Result<Response<pb::LeaveResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "Leave", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            let reason = validate::text(&r.reason);
            self.core
                .execute(Command::Leave { job: r.job_id.clone(), node: r.node_id.clone(), reason: reason.clone() })
                .await?;
            // Logged once it is a member's leave, with the reason as the service keeps it.
            tracing::info!(job = %r.job_id, node = %r.node_id, %reason, "node left");
            Ok(pb::LeaveResponse {})
        })
        .await
    }

    type WatchStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        let (rx, term) = rpc(&self.core, "Watch", async {
            validate::id("job_id", &r.job_id)?;
            p.check(&r.job_id)?;
            self.core.subscribe_view(&r.job_id)
        })
        .await?
        .into_inner();
        let cancel = self.core.cancel.clone();
        let core = self.core.clone();
        let stream = futures::stream::unfold((rx, true, cancel, core), move |(mut rx, first, cancel, core)| async move {
            if !first {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return None },
                    _ = cancel.cancelled() => return None,
                }
            }
            let (view, seq) = rx.borrow_and_update().clone();
            // Push only what a crash cannot take back, and only before the lease's local deadline.
            if let Err(e) = core.answer(core.durable(term, seq, first).await) {
                return Some((Err(Status::from(e)), (rx, false, cancel, core)));
            }
            Some((Ok(pb::JobEvent { view: Some(view) }), (rx, false, cancel, core)))
        });
        Ok(stamped(&self.core, Response::new(Box::pin(stream))))
    }

    async fn report_failure(&self, req: Request<pb::ReportFailureRequest>) -> Result<Response<pb::ReportFailureResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "ReportFailure", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            let failure = Failure::from_pb(r.failure.as_ref().ok_or_else(|| RdzvError::invalid("failure", "missing"))?);
            let (rank, exit_code) = (failure.rank, failure.exit_code);
            let outcome = self
                .core
                .execute(Command::ReportFailure {
                    job: r.job_id.clone(),
                    round: r.round,
                    node: r.node_id.clone(),
                    failure,
                    restartable: r.restartable,
                })
                .await?;
            let Outcome::Decision(decision) = outcome else {
                return Err(RdzvError::FailedPrecondition("unexpected outcome of a failure report".into()));
            };
            tracing::warn!(job = %r.job_id, round = r.round, node = %r.node_id, rank, exit_code, ?decision, "worker failure reported");
            let view = self.core.read(|s| Ok(s.job(&r.job_id)?.view())).await?;
            Ok(pb::ReportFailureResponse { decision: decision as i32, view: Some(view) })
        })
        .await
    }

    async fn fail_job(&self, req: Request<pb::FailJobRequest>) -> Result<Response<pb::FailJobResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "FailJob", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            let reason = validate::text(&r.reason);
            // Checked under the lock that applies it: a check in a read of its own could be
            // stale by the time the command applies.
            let (job, node) = (r.job_id.clone(), r.node_id.clone());
            self.core
                .execute_admitted(Command::FailJob { job: r.job_id.clone(), node: r.node_id.clone(), reason: reason.clone() }, |s| {
                    s.job(&job)?.check_may_fail(&node)
                })
                .await?;
            tracing::warn!(job = %r.job_id, node = %r.node_id, %reason, "job failed by a node");
            Ok(pb::FailJobResponse {})
        })
        .await
    }

    async fn finish(&self, req: Request<pb::FinishRequest>) -> Result<Response<pb::FinishResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "Finish", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            self.core.execute(Command::Finish { job: r.job_id.clone(), round: r.round, node: r.node_id }).await?;
            let view = self.core.read(|s| Ok(s.job(&r.job_id)?.view())).await?;
            Ok(pb::FinishResponse { view: Some(view) })
        })
        .await
    }

    async fn await_job_end(&self, req: Request<pb::AwaitJobEndRequest>) -> Result<Response<pb::AwaitJobEndResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "AwaitJobEnd", async {
            validate::id("job_id", &r.job_id)?;
            p.check(&r.job_id)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let job = r.job_id.as_str();
            let ended = self
                .core
                .wait_for(job, None, deadline, |s| {
                    let j = s.job(job)?;
                    Ok(j.is_terminal().then(|| j.view()))
                }, |_| String::new())
                .await;
            match ended {
                Ok(view) => Ok(pb::AwaitJobEndResponse { view: Some(view), ended: true }),
                Err(RdzvError::Timeout(_)) => {
                    let view = self.core.read(|s| Ok(s.job(job)?.view())).await?;
                    Ok(pb::AwaitJobEndResponse { view: Some(view), ended: false })
                }
                Err(e) => Err(e),
            }
        })
        .await
    }

    async fn store_set(&self, req: Request<pb::StoreSetRequest>) -> Result<Response<pb::StoreSetResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreSet", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::key(&r.key)?;
            validate::value(self.core.limits(), &r.value)?;
            validate::optional_id("request_id", &r.request_id)?;
            self.core.execute(Command::StoreSet { scope, key: r.key, value: r.value, request_id: r.request_id }).await?;
            Ok(pb::StoreSetResponse {})
        })
        .await
    }

    async fn store_get(&self, req: Request<pb::StoreGetRequest>) -> Result<Response<pb::StoreGetResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreGet", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::key(&r.key)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let (job, key) = (scope.job.clone(), r.key.clone());
            if r.timeout_ms == 0 {
                let v = self.core.read(|s| Ok(s.job(&job)?.get(&scope, &key)?.cloned())).await?;
                return v.map(|value| pb::StoreGetResponse { value }).ok_or(RdzvError::KeyNotFound { job, key });
            }
            let value = self
                .core
                .wait_for(&job, Some(scope.key_topic(&key)), deadline, |s| Ok(s.job(&job)?.get(&scope, &key)?.cloned()), |_| {
                    format!("key {key:?} did not appear in job {job:?} within {} ms", r.timeout_ms)
                })
                .await?;
            Ok(pb::StoreGetResponse { value })
        })
        .await
    }

    async fn store_add(&self, req: Request<pb::StoreAddRequest>) -> Result<Response<pb::StoreAddResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreAdd", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::key(&r.key)?;
            validate::optional_id("request_id", &r.request_id)?;
            match self.core.execute(Command::StoreAdd { scope, key: r.key, delta: r.delta, request_id: r.request_id }).await? {
                Outcome::Added(value) => Ok(pb::StoreAddResponse { value }),
                _ => Err(RdzvError::FailedPrecondition("unexpected outcome of add".into())),
            }
        })
        .await
    }

    async fn store_compare_set(&self, req: Request<pb::StoreCompareSetRequest>) -> Result<Response<pb::StoreCompareSetResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreCompareSet", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::key(&r.key)?;
            validate::value(self.core.limits(), &r.desired)?;
            validate::optional_id("request_id", &r.request_id)?;
            let cmd = Command::StoreCas { scope, key: r.key, expected: r.expected, desired: r.desired, request_id: r.request_id };
            match self.core.execute(cmd).await? {
                Outcome::Cas { swapped, current } => Ok(pb::StoreCompareSetResponse { swapped, current }),
                _ => Err(RdzvError::FailedPrecondition("unexpected outcome of compare-set".into())),
            }
        })
        .await
    }

    async fn store_wait(&self, req: Request<pb::StoreWaitRequest>) -> Result<Response<pb::StoreWaitResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreWait", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::keys(&r.keys)?;
            let deadline = self.deadline(r.timeout_ms)?;
            self.wait_for_keys(&scope, &r.keys, deadline, r.timeout_ms).await?;
            Ok(pb::StoreWaitResponse {})
        })
        .await
    }

    async fn store_delete(&self, req: Request<pb::StoreDeleteRequest>) -> Result<Response<pb::StoreDeleteResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreDelete", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::key(&r.key)?;
            validate::optional_id("request_id", &r.request_id)?;
            match self.core.execute(Command::StoreDelete { scope, key: r.key, request_id: r.request_id }).await? {
                Outcome::Deleted(deleted) => Ok(pb::StoreDeleteResponse { deleted }),
                _ => Err(RdzvError::FailedPrecondition("unexpected outcome of delete".into())),
            }
        })
        .await
    }

    async fn store_multi_get(&self, req: Request<pb::StoreMultiGetRequest>) -> Result<Response<pb::StoreMultiGetResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreMultiGet", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::keys(&r.keys)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let job = scope.job.clone();
            // The keys are waited for, then one read answers them all, from one state.
            if r.timeout_ms > 0 {
                self.wait_for_keys(&scope, &r.keys, deadline, r.timeout_ms).await?;
            }
            let max = self.core.limits().max_store_bytes_per_job;
            let values = self
                .core
                .read(|s| {
                    let j = s.job(&job)?;
                    let mut values = Vec::with_capacity(r.keys.len());
                    let mut total = 0usize;
                    for key in &r.keys {
                        let v = j.get(&scope, key)?.ok_or_else(|| RdzvError::KeyNotFound { job: job.clone(), key: key.clone() })?;
                        // A key may be asked for more than once, but the answer holds no more than
                        // the job's store may: 10,000 copies of a 1 MiB value would be 10 GiB.
                        total = total.saturating_add(v.len());
                        if total > max {
                            return Err(RdzvError::ResourceExhausted(format!(
                                "the values of {} keys take more than {max} bytes, the job's store limit: ask for fewer keys at a time",
                                r.keys.len()
                            )));
                        }
                        values.push(v.clone());
                    }
                    Ok(values)
                })
                .await?;
            Ok(pb::StoreMultiGetResponse { values })
        })
        .await
    }

    async fn store_multi_set(&self, req: Request<pb::StoreMultiSetRequest>) -> Result<Response<pb::StoreMultiSetResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreMultiSet", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            if r.entries.is_empty() || r.entries.len() > validate::MAX_BATCH {
                return Err(RdzvError::invalid("entries", format!("{} entries; expected 1 to {}", r.entries.len(), validate::MAX_BATCH)));
            }
            for e in &r.entries {
                validate::key(&e.key)?;
                validate::value(self.core.limits(), &e.value)?;
            }
            validate::optional_id("request_id", &r.request_id)?;
            let entries = r.entries.into_iter().map(|e| (e.key, e.value)).collect();
            self.core.execute(Command::StoreMultiSet { scope, entries, request_id: r.request_id }).await?;
            Ok(pb::StoreMultiSetResponse {})
        })
        .await
    }

    async fn store_num_keys(&self, req: Request<pb::StoreNumKeysRequest>) -> Result<Response<pb::StoreNumKeysResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "StoreNumKeys", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            let n = self.core.read(|s| s.job(&scope.job)?.scope_len(&scope)).await?;
            Ok(pb::StoreNumKeysResponse { num_keys: n as u64 })
        })
        .await
    }

    async fn barrier(&self, req: Request<pb::BarrierRequest>) -> Result<Response<pb::BarrierResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "Barrier", async {
            let scope = scope_of(&p, r.scope.as_ref())?;
            validate::id("name", &r.name)?;
            validate::id("member", &r.member)?;
            validate::optional_id("request_id", &r.request_id)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let cmd = Command::BarrierArrive {
                scope: scope.clone(),
                name: r.name.clone(),
                member: r.member.clone(),
                participants: r.participants,
                request_id: r.request_id.clone(),
            };
            let Outcome::Arrived(generation) = self.core.execute(cmd).await? else {
                return Err(RdzvError::FailedPrecondition("unexpected outcome of a barrier arrival".into()));
            };
            let job = scope.job.clone();
            let name = r.name.clone();
            self.core
                .wait_for(
                    &job,
                    Some(scope.barrier_topic(&name)),
                    deadline,
                    |s| Ok((s.job(&job)?.barrier_generation(&scope, &name)? > generation).then_some(())),
                    |s| {
                        let arrived = s
                            .job(&job)
                            .ok()
                            .and_then(|j| j.barriers.get(&(scope.round_scoped, name.clone())))
                            .map(|b| b.arrived.len())
                            .unwrap_or(0);
                        format!(
                            "barrier {name:?} of job {job:?}: {arrived} of {} participants arrived within {} ms",
                            r.participants, r.timeout_ms
                        )
                    },
                )
                .await?;
            Ok(pb::BarrierResponse { generation: generation + 1 })
        })
        .await
    }

    async fn publish_unique_id(&self, req: Request<pb::PublishUniqueIdRequest>) -> Result<Response<pb::PublishUniqueIdResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "PublishUniqueId", async {
            validate::id("job_id", &r.job_id)?;
            validate::optional_id("name", &r.name)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            // Only the node that runs global rank 0 publishes (T9): the running round's members
            // say which one that is. (Members do not change within a round, and the command
            // checks the round again.)
            // Checked under the lock that applies it (a read of its own could be stale).
            let (job, round, node) = (r.job_id.clone(), r.round, r.node_id.clone());
            let cmd = Command::PublishUniqueId { job: r.job_id, round: r.round, rank: r.rank, name: r.name, id: r.unique_id };
            self.core.execute_admitted(cmd, |s| s.job(&job)?.check_rank0_node(round, &node)).await?;
            Ok(pb::PublishUniqueIdResponse {})
        })
        .await
    }

    async fn get_unique_id(&self, req: Request<pb::GetUniqueIdRequest>) -> Result<Response<pb::GetUniqueIdResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "GetUniqueId", async {
            validate::id("job_id", &r.job_id)?;
            validate::optional_id("name", &r.name)?;
            p.check(&r.job_id)?;
            let deadline = self.deadline(r.timeout_ms)?;
            let (job, name, round) = (r.job_id.as_str(), r.name.as_str(), r.round);
            let unique_id = self
                .core
                .wait_for(
                    job,
                    Some(state::unique_id_topic(round, name)),
                    deadline,
                    |s| {
                        let j = s.job(job)?;
                        if j.round != round {
                            return Err(RdzvError::StaleRound { job: job.into(), given: round, current: j.round });
                        }
                        Ok(j.unique_ids.get(name).cloned())
                    },
                    |_| format!("rank 0 did not publish unique id {name:?} of round {round} of job {job:?} within {} ms", r.timeout_ms),
                )
                .await?;
            Ok(pb::GetUniqueIdResponse { unique_id })
        })
        .await
    }

    async fn status(&self, req: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "Status", async {
            validate::optional_id("job_id", &r.job_id)?;
            if !r.job_id.is_empty() {
                p.check(&r.job_id)?;
            }
            let jobs = self
                .core
                .read(|s| {
                    if r.job_id.is_empty() {
                        Ok(s.jobs.values().filter(|j| p.allows(&j.id)).map(|j| s.job_status(j)).collect())
                    } else {
                        Ok(vec![s.job_status(s.job(&r.job_id)?)])
                    }
                })
                .await?;
            let daemon = Some(self.core.daemon_info().await);
            Ok(pb::StatusResponse { jobs, server_time_unix_ms: self.core.now_ms(), daemon })
        })
        .await
    }

    async fn daemon_info(&self, _req: Request<pb::DaemonInfoRequest>) -> Result<Response<pb::DaemonInfoResponse>, Status> {
        // Answered by every daemon, whatever its role: `status` asks each one for its replica.
        let start = std::time::Instant::now();
        let info = self.core.daemon_info().await;
        self.core.metrics.observe("DaemonInfo", tonic::Code::Ok, start.elapsed().as_secs_f64());
        Ok(Response::new(info))
    }
}

#[cfg(test)]
mod standing_tests {
    use super::*;

    /// Only a leader's lease counts: a single daemon always answers, a standby never (naming the
    /// leader it knows), a leader only strictly before its lease's local deadline.
    #[test]
    fn a_leader_answers_strictly_before_its_lease_deadline_only() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let until = Some(t0 + ms(2_000));
        let leader = Role::Leader { epoch: 4 };
        assert_eq!(standing(&leader, until, t0), Standing::Serve);
        assert_eq!(standing(&leader, until, t0 + ms(1_999)), Standing::Serve);
        assert_eq!(standing(&leader, until, t0 + ms(2_000)), Standing::Lapsed, "at the deadline");
        assert_eq!(standing(&leader, until, t0 + ms(60_000)), Standing::Lapsed, "after it");
        assert_eq!(standing(&leader, None, t0), Standing::Lapsed, "a leader without a live lease");
        assert_eq!(standing(&Role::Single, None, t0 + ms(60_000)), Standing::Serve);
        let standby = Role::Standby { leader: "h2:29400".into(), epoch: 9 };
        assert_eq!(standing(&standby, until, t0), Standing::Standby { leader: "h2:29400".into(), epoch: 9 });
    }
}

#[cfg(test)]
mod clock_tests {
    use super::*;

    /// A clock behind the state's time (stepped back before a restart, a lagging new leader)
    /// catches up to it and runs on at the real rate from there: leases still expire a lease
    /// later, not once the wall clock reaches the old time.
    #[tokio::test(start_paused = true)]
    async fn a_clock_behind_the_state_catches_up_and_keeps_running() {
        let clock = Clock::system();
        let hour_ahead = clock.now_ms() + 3_600_000;
        clock.catch_up(hour_ahead);
        let start = clock.now_ms();
        assert!(start >= hour_ahead, "{start} < {hour_ahead}");
        tokio::time::advance(Duration::from_millis(5_000)).await;
        assert_eq!(clock.now_ms(), start + 5_000, "time stands still after catching up");
        // A deadline a second ahead of the clock is a second ahead of tokio's instant too.
        let at = clock.instant_at(clock.now_ms() + 1_000);
        assert_eq!(at - Instant::now(), Duration::from_millis(1_000));
        // Catching up to a time already passed changes nothing.
        let now = clock.now_ms();
        clock.catch_up(now - 10);
        assert_eq!(clock.now_ms(), now);
    }
}
