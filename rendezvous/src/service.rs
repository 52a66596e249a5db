//! The executor around the pure state machine, and the gRPC handlers over it.
//!
//! [`Core`] owns the [`State`] behind one mutex. A mutating call becomes a [`Command`]: stamped with
//! the time, applied, appended to the journal buffer (in apply order, under the same lock), and then
//! the caller waits until the journal's flusher thread reports that sequence durable (group commit:
//! one fsync covers every record buffered meanwhile). Reads wait for the durability of the state they
//! observed, so nobody ever sees a change that a crash could take back.
//!
//! Waiting (join, blocking get, barrier, unique id, exit barrier) subscribes to a per-job view channel
//! (changes only when a round forms or ends, or the job ends) and, for store waits, to a per-topic
//! channel (one per key, barrier or unique id), so a change wakes only the callers it concerns.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rsrun_proto::v1 as pb;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::RdzvError;
use crate::auth::Principal;
use crate::journal::{self, Entry, Journal};
use crate::metrics::Metrics;
use crate::round_stores::RoundStores;
use crate::tcpstore::TcpStoreLimits;
use crate::state::{self, Command, Failure, JobSpec, JoinCmd, Ms, Outcome, Phase, Scope, State};
use crate::validate::{self, Limits};

/// Compact the journal into a snapshot once its log holds this many bytes.
const COMPACT_BYTES: u64 = 64 << 20;
/// Longest wait for a write to become durable before the call fails as unavailable.
const DURABILITY_TIMEOUT: Duration = Duration::from_secs(30);

/// Wall-clock milliseconds that advance with tokio's clock (so paused-time tests control them).
#[derive(Debug, Clone)]
pub struct Clock {
    base_wall: Ms,
    base: Instant,
}

impl Clock {
    /// Starts at the current wall-clock time.
    pub fn system() -> Self {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as Ms)
            .unwrap_or(0);
        Clock { base_wall: wall, base: Instant::now() }
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> Ms {
        self.base_wall + self.base.elapsed().as_millis() as Ms
    }

    /// The tokio instant of a wall-clock time.
    pub fn instant_at(&self, at: Ms) -> Instant {
        self.base + Duration::from_millis(at.saturating_sub(self.base_wall))
    }
}

/// Durability progress published by the flusher.
#[derive(Debug, Clone, Default)]
struct Flushed {
    seq: u64,
    error: Option<String>,
}

enum Work {
    Records { bytes: Vec<u8>, last_seq: u64 },
    Compact { state: Box<State>, seq: u64 },
}

#[derive(Default)]
struct Queue {
    items: Vec<Work>,
    closed: bool,
}

/// The journal side of the executor: a queue the flusher thread drains.
struct Durability {
    queue: Mutex<Queue>,
    ready: Condvar,
}

struct Inner {
    state: State,
    /// Last assigned sequence number.
    seq: u64,
    /// Bytes queued to the current log since the last compaction.
    log_bytes: u64,
    /// Per job: its view and the sequence number that view is as of (pushed only once durable).
    views: HashMap<String, watch::Sender<(pb::JobView, u64)>>,
    topics: HashMap<(String, String), watch::Sender<u64>>,
    /// PyTorch's store of every running round (`None`: not hosted).
    stores: Option<RoundStores>,
}

/// Configuration of the executor.
#[derive(Debug, Clone, Default)]
pub struct CoreConfig {
    /// Durable state directory; `None` keeps state in memory.
    pub data_dir: Option<std::path::PathBuf>,
    /// Limits.
    pub limits: Limits,
    /// Serve PyTorch's TCPStore for every running round with these limits (`None`: workers host it).
    pub tcpstore: Option<TcpStoreLimits>,
    /// The service's listen address: where round stores listen when no join told the job's
    /// interface (ignored when it names every interface).
    pub listen: Option<IpAddr>,
}

/// The executor: state, journal, notifications, timers.
pub struct Core {
    inner: Mutex<Inner>,
    limits: Limits,
    clock: Clock,
    durability: Option<Arc<Durability>>,
    flushed: watch::Receiver<Flushed>,
    tick: Notify,
    /// Metrics of the service.
    pub metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core").field("durable", &self.durability.is_some()).finish()
    }
}

fn significant(a: &pb::JobView, b: &pb::JobView) -> bool {
    a.state != b.state
        || a.round != b.round
        || a.nodes_waiting != b.nodes_waiting
        || a.reason != b.reason
        || a.restart_count != b.restart_count
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
        let (state, seq, durability) = match &config.data_dir {
            None => (State::default(), 0, None),
            Some(dir) => {
                let (journal, recovered) = Journal::open(dir)?;
                tracing::info!(
                    data_dir = %dir.display(),
                    jobs = recovered.state.jobs.len(),
                    seq = recovered.seq,
                    replayed = recovered.replayed,
                    "recovered durable state"
                );
                let mut state = recovered.state;
                // Leases could not be renewed while the service was down: give every node a full one.
                state.renew_all_leases(clock.now_ms());
                let _ = flushed_tx.send(Flushed { seq: recovered.seq, error: None });
                let durability = Arc::new(Durability { queue: Mutex::new(Queue::default()), ready: Condvar::new() });
                let d = durability.clone();
                let m = metrics.clone();
                std::thread::Builder::new()
                    .name("rsrun-journal".into())
                    .spawn(move || flusher(journal, d, flushed_tx, m))
                    .map_err(|e| RdzvError::Unavailable(format!("cannot start the journal thread: {e}")))?;
                (state, recovered.seq, Some(durability))
            }
        };
        let core = Arc::new(Core {
            inner: Mutex::new(Inner {
                state,
                seq,
                log_bytes: 0,
                views: HashMap::new(),
                topics: HashMap::new(),
                stores: config.tcpstore.map(|limits| RoundStores::new(limits, config.listen, cancel.child_token())),
            }),
            limits: config.limits,
            clock,
            durability,
            flushed,
            tick: Notify::new(),
            metrics,
            cancel: cancel.clone(),
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

    /// Applies a command and, when it changed durable state, queues it for the journal. Returns the
    /// outcome and the sequence number the caller must wait for.
    fn apply_locked(&self, g: &mut Inner, cmd: &Command) -> Result<(Outcome, u64), RdzvError> {
        let now = self.clock.now_ms();
        let job_id = cmd.job().to_string();
        let was_running = g.state.jobs.get(&job_id).map(|j| (j.round, matches!(j.phase, Phase::Running { .. })));
        let (outcome, effects) = g.state.apply(cmd, now, &self.limits)?;
        if effects.changed && cmd.is_durable() {
            g.seq += 1;
            if let Some(d) = &self.durability {
                let bytes = journal::encode(&Entry { seq: g.seq, at: now, cmd: cmd.clone() })?;
                g.log_bytes += bytes.len() as u64;
                let mut q = d.queue.lock().unwrap_or_else(|p| p.into_inner());
                match q.items.last_mut() {
                    Some(Work::Records { bytes: buf, last_seq }) => {
                        buf.extend_from_slice(&bytes);
                        *last_seq = g.seq;
                    }
                    _ => q.items.push(Work::Records { bytes, last_seq: g.seq }),
                }
                if g.log_bytes >= COMPACT_BYTES {
                    g.log_bytes = 0;
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

    /// Records the local address a node of `job` reached the service on: its round stores listen
    /// there.
    pub fn note_interface(&self, job: &str, ip: IpAddr) {
        if let Some(stores) = self.lock().stores.as_mut() {
            stores.note_interface(job, ip);
        }
    }

    /// The PyTorch store serving `round` of `job`, if the service hosts one.
    pub fn round_store(&self, job: &str, round: u64) -> Option<std::net::SocketAddr> {
        self.lock().stores.as_ref().and_then(|s| s.endpoint(job, round))
    }

    /// Executes a command and waits until it is durable.
    pub async fn execute(&self, cmd: Command) -> Result<Outcome, RdzvError> {
        let (outcome, seq) = {
            let mut g = self.lock();
            self.apply_locked(&mut g, &cmd)?
        };
        self.wait_durable(seq).await?;
        Ok(outcome)
    }

    /// Waits until everything up to `seq` is on disk.
    async fn wait_durable(&self, seq: u64) -> Result<(), RdzvError> {
        if self.durability.is_none() {
            return Ok(());
        }
        let mut rx = self.flushed.clone();
        let deadline = Instant::now() + DURABILITY_TIMEOUT;
        loop {
            {
                let f = rx.borrow_and_update();
                if f.seq >= seq {
                    return Ok(());
                }
                if let Some(e) = &f.error {
                    return Err(RdzvError::Unavailable(format!("the change is not durable yet: {e}")));
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(RdzvError::ShuttingDown) },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(RdzvError::Unavailable(format!("the journal did not sync within {DURABILITY_TIMEOUT:?}")));
                }
                _ = self.cancel.cancelled() => return Err(RdzvError::ShuttingDown),
            }
        }
    }

    /// Reads the state and waits until what it saw is durable (errors derived from the state too).
    pub async fn read<T>(&self, f: impl FnOnce(&State) -> Result<T, RdzvError>) -> Result<T, RdzvError> {
        let (value, seq) = {
            let g = self.lock();
            (f(&g.state), g.seq)
        };
        self.wait_durable(seq).await?;
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
            let (found, seq, mut view_rx, mut topic_rx) = {
                let mut g = self.lock();
                let found = check(&g.state);
                let seq = g.seq;
                let view = g.state.jobs.get(job).map(|j| j.view());
                let view_rx = view.map(|v| g.views.entry(job.to_string()).or_insert_with(|| watch::channel((v, seq)).0).subscribe());
                let topic_rx = topic.as_ref().map(|t| {
                    g.topics.entry((job.to_string(), t.clone())).or_insert_with(|| watch::channel(0).0).subscribe()
                });
                (found, seq, view_rx, topic_rx)
            };
            // An answer derived from the state (a value or an error) must not show what a crash
            // could undo.
            match found {
                Ok(Some(v)) => {
                    self.wait_durable(seq).await?;
                    return Ok(v);
                }
                Err(e) => {
                    self.wait_durable(seq).await?;
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
                    let g = self.lock();
                    return Err(RdzvError::Timeout(on_timeout(&g.state)));
                }
                _ = self.cancel.cancelled() => return Err(RdzvError::ShuttingDown),
            }
        }
    }

    /// A receiver of the job's view and the sequence number it is as of (current value first).
    pub fn subscribe_view(&self, job: &str) -> Result<watch::Receiver<(pb::JobView, u64)>, RdzvError> {
        let mut g = self.lock();
        let view = g.state.job(job)?.view();
        let seq = g.seq;
        Ok(g.views.entry(job.to_string()).or_insert_with(|| watch::channel((view, seq)).0).subscribe())
    }

    /// Waits until `seq` is durable (for pushed views).
    pub async fn durable(&self, seq: u64) -> Result<(), RdzvError> {
        self.wait_durable(seq).await
    }

    /// Applies what time made due, then sleeps until the next deadline or a change.
    async fn timer_loop(self: Arc<Self>) {
        let mut last_gauges = Instant::now() - Duration::from_secs(10);
        loop {
            let next = {
                let mut g = self.lock();
                let now = self.clock.now_ms();
                for cmd in g.state.due(now, &self.limits) {
                    if let Err(e) = self.apply_locked(&mut g, &cmd) {
                        tracing::debug!(error = %e, ?cmd, "timed command not applied");
                    } else {
                        log_timed(&cmd);
                    }
                }
                if last_gauges.elapsed() >= Duration::from_secs(1) {
                    last_gauges = Instant::now();
                    self.update_gauges(&mut g);
                }
                g.state.next_deadline(&self.limits)
            };
            let wake = next.map(|t| self.clock.instant_at(t)).unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            let wake = wake.min(Instant::now() + Duration::from_secs(1));
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = self.tick.notified() => {}
                _ = self.cancel.cancelled() => break,
            }
        }
        if let Some(d) = &self.durability {
            let mut q = d.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.closed = true;
            d.ready.notify_one();
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
}

fn log_timed(cmd: &Command) {
    match cmd {
        Command::ExpireNode { job, node } => tracing::warn!(%job, %node, "node lease expired"),
        Command::CloseRound { job } => tracing::debug!(%job, "last call over"),
        Command::RemoveJob { job } => tracing::info!(%job, "job forgotten after its retention time"),
        _ => {}
    }
}

/// The journal thread: drains the queue in order, appending + fsyncing records (group commit) and
/// writing snapshots. On a write error it keeps the records, reports the error to waiters, and retries.
fn flusher(mut journal: Journal, d: Arc<Durability>, flushed: watch::Sender<Flushed>, metrics: Arc<Metrics>) {
    let mut durable = flushed.borrow().seq;
    loop {
        let work = {
            let mut q = d.queue.lock().unwrap_or_else(|p| p.into_inner());
            while q.items.is_empty() && !q.closed {
                q = d.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            if q.items.is_empty() {
                return;
            }
            q.items.remove(0)
        };
        let result = match &work {
            Work::Records { bytes, last_seq } => journal.append(bytes).map(|_| {
                metrics.journal_syncs.inc();
                metrics.journal_bytes.inc_by(bytes.len() as u64);
                *last_seq
            }),
            Work::Compact { state, seq } => journal.compact(state, *seq).map(|_| durable),
        };
        match result {
            Ok(seq) => {
                durable = seq;
                let _ = flushed.send(Flushed { seq, error: None });
            }
            Err(e) => {
                let first = flushed.borrow().error.is_none();
                if first {
                    tracing::error!(error = %e, "journal write failed; mutations are refused until it succeeds");
                }
                let _ = flushed.send(Flushed { seq: durable, error: Some(e.to_string()) });
                // Put the work back in front and retry after a pause.
                let mut q = d.queue.lock().unwrap_or_else(|p| p.into_inner());
                q.items.insert(0, work);
                let closed = q.closed;
                drop(q);
                if closed {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

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
async fn rpc<T>(core: &Core, method: &'static str, body: impl Future<Output = Result<T, RdzvError>>) -> Result<Response<T>, Status> {
    let start = std::time::Instant::now();
    let result = body.await;
    let code = result.as_ref().map(|_| tonic::Code::Ok).unwrap_or_else(RdzvError::code);
    core.metrics.observe(method, code, start.elapsed().as_secs_f64());
    if let Err(e) = &result {
        tracing::debug!(method, error = %e, "rpc failed");
    }
    result.map(Response::new).map_err(Status::from)
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
        let local = req.local_addr();
        let r = req.into_inner();
        rpc(&self.core, "Join", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            validate::addrs(&r.addrs)?;
            validate::hostname(&r.hostname)?;
            let deadline = self.deadline(r.timeout_ms)?;
            if let Some(local) = local {
                self.core.note_interface(&r.job_id, local.ip());
            }
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
            self.core.execute(cmd).await?;
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
                            Ok(j.assignment(node))
                        },
                        |s| forming_summary(s, job),
                    )
                    .await;
                match waited {
                    Err(RdzvError::Timeout(_)) if Instant::now() < deadline => {
                        // Renewal failure shows up as NotMember on the next check.
                        let _ = self.core.execute(Command::KeepAlive { job: job.into(), node: node.into() }).await;
                    }
                    Ok(mut resp) => {
                        if let Some(round) = resp.round.as_mut()
                            && let Some(ep) = self.core.round_store(job, round.round)
                        {
                            round.store_addr = ep.ip().to_string();
                            round.store_port = u32::from(ep.port());
                        }
                        return Ok(resp);
                    }
                    other => return other,
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
            tracing::info!(job = %r.job_id, node = %r.node_id, reason = %r.reason, "node leaves");
            self.core
                .execute(Command::Leave { job: r.job_id, node: r.node_id, reason: validate::text(&r.reason) })
                .await?;
            Ok(pb::LeaveResponse {})
        })
        .await
    }

    type WatchStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::JobEvent, Status>> + Send>>;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        let rx = rpc(&self.core, "Watch", async {
            validate::id("job_id", &r.job_id)?;
            p.check(&r.job_id)?;
            self.core.subscribe_view(&r.job_id)
        })
        .await?
        .into_inner();
        let cancel = self.core.cancel.clone();
        let core = self.core.clone();
        let stream = futures::stream::unfold((rx, true, cancel, core), |(mut rx, first, cancel, core)| async move {
            if !first {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return None },
                    _ = cancel.cancelled() => return None,
                }
            }
            let (view, seq) = rx.borrow_and_update().clone();
            // Push only what a crash cannot take back.
            if let Err(e) = core.durable(seq).await {
                return Some((Err(Status::from(e)), (rx, false, cancel, core)));
            }
            Some((Ok(pb::JobEvent { view: Some(view) }), (rx, false, cancel, core)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn report_failure(&self, req: Request<pb::ReportFailureRequest>) -> Result<Response<pb::ReportFailureResponse>, Status> {
        let p = principal(&req);
        let r = req.into_inner();
        rpc(&self.core, "ReportFailure", async {
            validate::id("job_id", &r.job_id)?;
            validate::id("node_id", &r.node_id)?;
            p.check(&r.job_id)?;
            let failure = Failure::from_pb(r.failure.as_ref().ok_or_else(|| RdzvError::invalid("failure", "missing"))?);
            tracing::warn!(job = %r.job_id, round = r.round, node = %r.node_id, rank = failure.rank, exit_code = failure.exit_code, "worker failure reported");
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
            tracing::warn!(job = %r.job_id, node = %r.node_id, reason = %r.reason, "job failed by a node");
            self.core.execute(Command::FailJob { job: r.job_id, node: r.node_id, reason: validate::text(&r.reason) }).await?;
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
            self.core.execute(Command::StoreSet { scope, key: r.key, value: r.value }).await?;
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
            // Wait for the keys one by one: each wait wakes only on its own key.
            for key in &r.keys {
                let job = scope.job.clone();
                self.core
                    .wait_for(&job, Some(scope.key_topic(key)), deadline, |s| Ok(s.job(&job)?.get(&scope, key)?.map(|_| ())), |s| {
                        let missing: Vec<&String> = r
                            .keys
                            .iter()
                            .filter(|k| s.job(&job).ok().and_then(|j| j.get(&scope, k).ok().flatten()).is_none())
                            .take(16)
                            .collect();
                        format!("keys {missing:?} did not appear in job {job:?} within {} ms", r.timeout_ms)
                    })
                    .await?;
            }
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
            match self.core.execute(Command::StoreDelete { scope, key: r.key }).await? {
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
            let mut values = Vec::with_capacity(r.keys.len());
            for key in &r.keys {
                let v = if r.timeout_ms == 0 {
                    self.core
                        .read(|s| s.job(&job)?.get(&scope, key)?.cloned().ok_or(RdzvError::KeyNotFound { job: job.clone(), key: key.clone() }))
                        .await?
                } else {
                    self.core
                        .wait_for(&job, Some(scope.key_topic(key)), deadline, |s| Ok(s.job(&job)?.get(&scope, key)?.cloned()), |_| {
                            format!("key {key:?} did not appear in job {job:?} within {} ms", r.timeout_ms)
                        })
                        .await?
                };
                values.push(v);
            }
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
            let entries = r.entries.into_iter().map(|e| (e.key, e.value)).collect();
            self.core.execute(Command::StoreMultiSet { scope, entries }).await?;
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
            p.check(&r.job_id)?;
            let cmd = Command::PublishUniqueId { job: r.job_id, round: r.round, rank: r.rank, name: r.name, id: r.unique_id };
            self.core.execute(cmd).await?;
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
            Ok(pb::StatusResponse { jobs, server_time_unix_ms: self.core.now_ms() })
        })
        .await
    }
}
