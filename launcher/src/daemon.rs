//! The rsrun-rendezvous backend: this node as a member of a job kept by the rendezvous service.
//!
//! The service is, by plan:
//! - `--standalone`: an in-memory service embedded in this launcher on `127.0.0.1:0`;
//! - the static backend (`--node-rank`, `--master-addr:--master-port`): an embedded service hosted by
//!   node rank 0 at the master address, which every other node joins. Node ranks are fixed (each node's
//!   `--node-rank`) and verified: two nodes with the same node rank fail the job naming both hosts, and
//!   a join timeout names the node ranks that never came. Nothing is computed locally on trust.
//! - `--rdzv-endpoint HOST:PORT`: the `rsrun-rendezvous` daemon there. torchrun's convenience is kept:
//!   when HOST is this machine and nothing listens at the port, this launcher hosts an embedded service
//!   there for everyone (`is_host` in `--rdzv-conf` forces either way). That service lives and dies
//!   with this launcher, so the other nodes lose the job when it exits: a separately started daemon is
//!   the robust choice.
//!
//! Membership, as the agent drives it: `Join` (blocks until the round forms; while waiting the console
//! shows who joined — names from `Status` for jobs of up to 64 nodes, counts from the job's constant-size
//! view beyond), start the workers, keep-alive every lease/3 in the background, watch the job —
//! when the view's round moves past ours or the job fails, the round ended here too. A local failure is
//! reported (`ReportFailure`: restart or failed); success is `Finish` and then the exit barrier (the
//! watch, up to `--exit-barrier-timeout`); every exit path calls `Leave`.
//!
//! A keep-alive that reports this node out (lease expired, expelled) ends the round and is replaced at
//! the next join. One that gives up on a service unreachable for `keep_alive_timeout` (a head node
//! gone for good) ends the round, and the node exits with an error naming the endpoint. A job that
//! completed while this node waited (a spare) ends it with exit 0; a job that failed before this
//! node's `Finish` ends it with the job's root cause.

use std::net::SocketAddr;
use std::time::{Duration, Instant, UNIX_EPOCH};

use anyhow::{Context, bail};
use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, KeepAliveHandle, KeepAlivePolicy, RdzvClient, proto};
use rsrun_rendezvous::server::{EmbeddedServer, ServerConfig, spawn_with};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::env::RoundAssignment;
use crate::localaddr::is_own_address;
use crate::logs::{ConsoleEvent, ConsoleTx};
use crate::plan::{Endpoint, HostMode, LaunchPlan, RdzvPlan, StartError};
use crate::reach;
use crate::rdzv::{Decision, RoundEnd, RoundEndCause, RoundEndFuture, free_port};
use crate::report::{ExitKind, WorkerFailure};

/// Deadline of the best-effort calls made on the way out (leave, failure report).
const EXIT_CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Waits shorter than this show no rendezvous status (no flicker on fast joins).
const STATUS_AFTER: Duration = Duration::from_millis(700);
/// Period of the rendezvous status while waiting (small jobs; see [`status_period`]).
const STATUS_EVERY: Duration = Duration::from_secs(1);
/// Jobs of up to this many nodes name the joined nodes while waiting (a `Status` call, whose answer
/// grows with the job); larger jobs show counts from the job's view, whose size is constant.
const NAMES_UP_TO: u32 = 64;

/// This node's membership in a job kept by the rendezvous service.
#[derive(Debug)]
pub struct DaemonRdzv {
    client: RdzvClient,
    /// The service's resolved address (`None`: `--standalone`), probed for the waiting line while
    /// the service does not answer.
    target: Option<SocketAddr>,
    /// The service embedded in this launcher, if any (stops when dropped).
    embedded: Option<EmbeddedServer>,
    /// True when the embedded service also serves other nodes (not `--standalone`).
    hosting_for_others: bool,
    /// `host:port` workers use for the store.
    endpoint: String,
    job: String,
    node: String,
    addrs: Vec<String>,
    watch: Option<watch::Receiver<Option<proto::JobView>>>,
    keep_alive: Option<KeepAliveHandle>,
    left: bool,
    /// Cancelled when the service is known to be gone (it lived in a head that died).
    gone: Option<tokio_util::sync::CancellationToken>,
    /// How long before its lease's end this node fences itself: min(`--shutdown-timeout`, a third
    /// of the lease), the longest its workers get between SIGTERM and SIGKILL then.
    fence_margin: Duration,
}

impl DaemonRdzv {
    /// Starts or finds the service, and prepares the client.
    ///
    /// # Errors
    /// The embedded service cannot bind; the endpoint cannot be resolved.
    pub async fn connect(plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Self> {
        let node = crate::plan::node_id(&plan.hostname, std::process::id());
        // Read and checked as a daemon checks it when the plan was made (`read_client_token`).
        let token = plan.token.clone();
        let (endpoint, target, embedded, hosting_for_others, addrs) = match &plan.rdzv {
            RdzvPlan::Standalone => {
                let mut cfg = ServerConfig::in_memory(SocketAddr::from(([127, 0, 0, 1], 0)));
                cfg.only_job = Some(plan.job_id.clone());
                let server = spawn_with(cfg).await.context("cannot start the embedded rendezvous service")?;
                (server.addr.to_string(), None, Some(server), false, vec!["127.0.0.1".to_owned()])
            }
            RdzvPlan::Daemon { endpoint, host: HostMode::Auto } => {
                let target = if plan.mode.endpoint_may_resolve_late() {
                    // PET_RDZV_ENDPOINT of an elastic PyTorchJob names `<job>-worker-0`, whose DNS
                    // record appears once that pod is up (and worker 0 itself must resolve it to
                    // see that it hosts): wait for it until the join timeout.
                    reach::resolve(&endpoint.host, endpoint.port, plan.timeouts.join, console).await?
                } else {
                    // A typed endpoint: a name that does not resolve is an error at once.
                    resolve(&endpoint.host, endpoint.port).await.with_context(|| format!("cannot resolve the rendezvous endpoint {endpoint}"))?
                };
                let addrs = advertised_addrs(plan, target);
                // A launcher hosts a plain service: never when the daemon is expected to speak TLS.
                let host_here = plan.tls_ca.is_none() && is_own_address(target.ip()) && !listening(target).await;
                let mut embedded = None;
                if host_here {
                    let mut cfg = ServerConfig::in_memory(target);
                    cfg.token_file = plan.token_file.clone();
                    cfg.insecure = true;
                    cfg.only_job = Some(plan.job_id.clone());
                    match spawn_with(cfg).await {
                        Ok(server) => {
                            hosting_note(plan, console, target, target).await;
                            embedded = Some(server);
                        }
                        // Another launcher on this host won the race: use its service (it serves one
                        // job, and refuses this one naming both if it is another job's).
                        Err(err) => debug!(%err, "not hosting the rendezvous service"),
                    }
                }
                let hosting = embedded.is_some();
                (endpoint.to_string(), Some(target), embedded, hosting, addrs)
            }
            RdzvPlan::Daemon { endpoint, host } => {
                // The address comes from the cluster (Slurm, Kubernetes): node rank 0's name may not
                // resolve yet (its pod is not up); wait for it until the join timeout.
                let target = reach::resolve(&endpoint.host, endpoint.port, plan.timeouts.join, console).await?;
                reach::refuse_loopback(&endpoint.host, target, &plan.node_list).await?;
                let addrs = advertised_addrs(plan, target);
                if *host == HostMode::Always {
                    let (addr, server) = host_for_job(plan, token.as_deref(), target).await?;
                    if server.is_some() {
                        hosting_note(plan, console, target, addr).await;
                    }
                    let hosting = server.is_some();
                    let ep = Endpoint { host: endpoint.host.clone(), port: addr.port() };
                    (ep.to_string(), Some(addr), server, hosting, addrs)
                } else {
                    let addr = find_for_job(plan, token.as_deref(), &endpoint.host, target, console).await?;
                    let ep = Endpoint { host: endpoint.host.clone(), port: addr.port() };
                    (ep.to_string(), Some(addr), None, false, addrs)
                }
            }
            RdzvPlan::Group { endpoints } => {
                // A highly available group: the client follows the leader. Addresses are advertised
                // for the interface that reaches the first daemon that resolves.
                let mut found = None;
                for ep in endpoints {
                    if let Ok(t) = resolve(&ep.host, ep.port).await {
                        found = Some(t);
                        break;
                    }
                }
                let target = found.with_context(|| {
                    format!("cannot resolve any rendezvous endpoint of {}", crate::plan::endpoint_list(endpoints))
                })?;
                let addrs = advertised_addrs(plan, target);
                (crate::plan::endpoint_list(endpoints), Some(target), None, false, addrs)
            }
            RdzvPlan::Static { node_rank, master_addr, master_port } => {
                let target = reach::resolve(master_addr, *master_port, plan.timeouts.join, console).await?;
                reach::refuse_loopback(master_addr, target, &plan.node_list).await?;
                let addrs = advertised_addrs(plan, target);
                let (addr, embedded) = if *node_rank == 0 {
                    if !is_own_address(target.ip()) {
                        bail!(
                            "node rank 0 hosts the static rendezvous at --master-addr {master_addr}, but {} is not an address of this host ({}): start node rank 0 on that host, or pass this host's address as --master-addr",
                            target.ip(),
                            plan.hostname
                        );
                    }
                    // A port where this job's service already listens is joined: another launcher
                    // believes it is node rank 0 (the verification after the join names both).
                    host_for_job(plan, token.as_deref(), target).await.context(
                        "node rank 0 hosts the static rendezvous at --master-addr:--master-port",
                    )?
                } else {
                    (find_for_job(plan, token.as_deref(), master_addr, target, console).await?, None)
                };
                let hosting = embedded.is_some() && plan.nodes.max > 1;
                (addr.to_string(), Some(addr), embedded, hosting, addrs)
            }
        };
        let mut cfg = ClientConfig::new(endpoint.clone());
        cfg.token = token;
        // The embedded services speak plain gRPC; TLS is for a daemon started with --tls-cert.
        if embedded.is_none() {
            cfg.tls_ca = plan.tls_ca.clone();
        }
        cfg.rpc_timeout = plan.timeouts.rpc.min(Duration::from_secs(30)).max(Duration::from_secs(1));
        let client = RdzvClient::connect(cfg)?;
        Ok(DaemonRdzv {
            client,
            target,
            embedded,
            hosting_for_others,
            endpoint,
            job: plan.job_id.clone(),
            node,
            addrs,
            watch: None,
            keep_alive: None,
            left: false,
            gone: None,
            // The time a fenced node's workers get to stop before its lease ends.
            fence_margin: plan.timeouts.shutdown.min(plan.timeouts.lease / 3),
        })
    }

    /// Joins the next round (showing who joined while waiting) and returns this node's assignment, or
    /// `None` when the job completed while this node waited (a spare).
    pub(crate) async fn next_round(&mut self, plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Option<RoundAssignment>> {
        // A node that fenced itself (in a round that then ended some other way: a restart, the
        // exit barrier) joins once its keep-alive has left or learned it was dropped; a join
        // before that could come back with the round it fenced itself from, or be undone by the
        // leave.
        self.settle_fence().await;
        // The previous round's keep-alive stops here: the waiting join renews the lease itself,
        // and a keep-alive left running could fence during the wait and leave the round being
        // joined. A fresh one starts with the assignment.
        self.keep_alive = None;
        let master_port = free_port().context("cannot reserve a port for MASTER_PORT")?;
        let spec = JoinSpec {
            job_id: self.job.clone(),
            node_id: self.node.clone(),
            addrs: self.addrs.clone(),
            local_world_size: plan.nproc_per_node,
            rank_hint: fixed_rank(plan).or(plan.rank_hint),
            config: JobSpec {
                min_nodes: plan.nodes.min,
                max_nodes: plan.nodes.max,
                last_call: plan.timeouts.last_call,
                lease: plan.timeouts.lease,
                max_restarts: plan.max_restarts,
                fixed_ranks: fixed_rank(plan).is_some(),
            },
            timeout: plan.timeouts.join,
            master_port,
            hostname: plan.hostname.clone(),
        };
        let started = Instant::now();
        let client = self.client.clone();
        let join = client.join(spec);
        tokio::pin!(join);
        let mut shown = false;
        let mut last_status: Option<String> = None;
        let period = status_period(plan.nodes.max);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + STATUS_AFTER, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let result = loop {
            tokio::select! {
                r = &mut join => break r,
                _ = tick.tick() => {
                    // Bounded: an unreachable service must not hold up the join (which has its own
                    // deadline).
                    if let Ok(Some(text)) = tokio::time::timeout(period, self.waiting_line(plan, started.elapsed(), period)).await {
                        let _ = console.send(ConsoleEvent::Status(text.clone())).await;
                        last_status = Some(text);
                        shown = true;
                    }
                }
            }
        };
        if shown {
            let _ = console.send(ConsoleEvent::StatusDone).await;
        }
        let resp = match result {
            Ok(r) => r,
            Err(RdzvError::Timeout(msg)) if fixed_rank(plan).is_some() => {
                let who = match tokio::time::timeout(EXIT_CALL_TIMEOUT, self.client.status(Some(&self.job))).await {
                    Ok(Ok(st)) => static_timeout_text(&st, plan.nodes.max),
                    other => {
                        self.unreachable_if(&other);
                        format!("the static rendezvous at {} did not answer", self.endpoint)
                    }
                };
                bail!("rendezvous timed out after {:?} (join_timeout): {who} ({msg})", plan.timeouts.join);
            }
            Err(RdzvError::Timeout(msg)) => {
                let who = match tokio::time::timeout(EXIT_CALL_TIMEOUT, self.timeout_detail(plan)).await {
                    Ok(Ok(who)) => who,
                    other => {
                        self.unreachable_if(&other);
                        last_status.unwrap_or_default()
                    }
                };
                bail!("rendezvous timed out after {:?} (join_timeout): {who} ({msg})", plan.timeouts.join);
            }
            // The job completed while this node waited for a round (a spare): nothing left to do.
            Err(ref err) if job_ended(err, &self.job) == Some(Ended::Completed) => {
                info!(job = %self.job, node = %self.node, %err, "the job completed while this node waited");
                return Ok(None);
            }
            // Refused (the service serves another job; the token is not accepted; TLS with it
            // fails): this node cannot start as configured (exit 2).
            Err(err @ RdzvError::Tls { .. }) => {
                return Err(anyhow::Error::new(StartError(format!(
                    "cannot talk to the rendezvous at {} (job '{}', --rdzv-tls-ca {}): {err}",
                    self.endpoint,
                    self.job,
                    plan.tls_ca.as_deref().map_or_else(|| "not given".to_owned(), |p| p.display().to_string())
                ))));
            }
            Err(err @ (RdzvError::PermissionDenied(_) | RdzvError::Unauthenticated(_))) => {
                return Err(anyhow::Error::new(StartError(format!(
                    "the rendezvous at {} refuses job '{}': {err}",
                    self.endpoint, self.job
                ))));
            }
            Err(err) => {
                if err.is_retryable() {
                    self.unreachable();
                }
                return Err(err).context(format!("joining job '{}' at {}", self.job, self.endpoint));
            }
        };
        let round = resp.round.context("join answer without a round")?;
        let me = resp.node.context("join answer without this node's assignment")?;
        if let Some(want) = fixed_rank(plan)
            && me.node_rank != want
        {
            // Invariant of the service: with fixed ranks a duplicate fails the job at its join.
            bail!("the rendezvous at {} gave node rank {} to this node started with --node-rank {want}", self.endpoint, me.node_rank);
        }
        let assignment = RoundAssignment {
            round: round.round,
            node_rank: me.node_rank,
            num_nodes: round.num_nodes,
            rank_offset: me.rank_offset,
            local_world_size: me.local_world_size,
            world_size: round.world_size,
            // PyTorch's store: the one the service hosts for this round when it hosts one (alive for
            // the whole round whichever rank exits first, fresh every round), else rank 0's own.
            master_addr: if round.store_port != 0 { round.store_addr.clone() } else { round.master_addr.clone() },
            master_port: {
                let (what, port) =
                    if round.store_port != 0 { ("store_port", round.store_port) } else { ("master_port", round.master_port) };
                u16::try_from(port).with_context(|| format!("the round's {what} {port}: expected a TCP port, 1 to 65535"))?
            },
            agent_store: round.store_port != 0,
            restart_count: round.restart_count,
            max_restarts: round.max_restarts,
            node_id: self.node.clone(),
            rdzv_endpoint: Some(self.endpoint.clone()),
        };
        info!(
            job = %self.job, round = round.round, node = %self.node, node_rank = me.node_rank,
            world_size = round.world_size,
            "node '{}' joined round {} of job '{}' as node rank {} in a world of {} workers",
            self.node, round.round, self.job, me.node_rank, round.world_size
        );
        self.ensure_background(plan);
        Ok(Some(assignment))
    }

    /// Starts this round's keep-alive (`next_round` dropped the previous one before joining, so
    /// one that reported this node out or fenced it never carries over), and the watch, or the
    /// watch again when its task ended (it would otherwise end the fresh round at once).
    fn ensure_background(&mut self, plan: &LaunchPlan) {
        let policy = KeepAlivePolicy {
            // Three renewals before the fence (lease - margin), as torchrun's three attempts per
            // lease: an outage of one or two of them is a pause.
            interval: (plan.timeouts.lease.saturating_sub(self.fence_margin) / 3).max(Duration::from_millis(30)),
            // A service in this process cannot be cut off from this node: no fencing.
            lease: self.embedded.is_none().then_some(plan.timeouts.lease),
            margin: self.fence_margin,
            give_up: plan.timeouts.keep_alive_give_up,
        };
        self.keep_alive = Some(self.client.spawn_keep_alive_with(&self.job, &self.node, policy));
        if self.watch.as_ref().is_none_or(|w| w.has_changed().is_err()) {
            self.watch = Some(self.client.watch(&self.job, &self.node));
        }
    }

    /// The status line while waiting: names for small jobs, counts from the job's view otherwise.
    /// While the service does not answer (node rank 0 not up yet), the line says what this node
    /// waits for: `waiting for HOST:PORT (connection refused)`.
    async fn waiting_line(&self, plan: &LaunchPlan, waited: Duration, period: Duration) -> Option<String> {
        let answer = if plan.nodes.max <= NAMES_UP_TO {
            tokio::time::timeout(period / 3, self.client.status(Some(&self.job)))
                .await
                .map(|r| r.map(|st| waiting_text(&st, plan, waited)))
        } else {
            tokio::time::timeout(period / 3, self.client.await_job_end(&self.job, Duration::ZERO))
                .await
                .map(|r| r.map(|(view, _)| waiting_count_text(&view, plan, waited)))
        };
        match answer {
            Ok(Ok(text)) => Some(text),
            Ok(Err(err)) if !err.is_retryable() => None,
            // Unreachable or slow: say why, from a plain connect.
            _ => {
                let why = match self.target {
                    Some(t) => reach::tcp_reason(t).await.unwrap_or_else(|| "not answering yet".to_owned()),
                    None => "not answering yet".to_owned(),
                };
                Some(format!(
                    "rsrun: waiting for {} ({why}), the rendezvous of job '{}' ({:.0}s)",
                    self.endpoint,
                    self.job,
                    waited.as_secs_f64()
                ))
            }
        }
    }

    /// Who joined, for the join-timeout message (names only for small jobs).
    async fn timeout_detail(&self, plan: &LaunchPlan) -> Result<String, RdzvError> {
        if plan.nodes.max <= NAMES_UP_TO {
            let st = self.client.status(Some(&self.job)).await?;
            return Ok(timeout_text(&st, plan));
        }
        let (view, _) = self.client.await_job_end(&self.job, Duration::ZERO).await?;
        Ok(format!(
            "{} of at least {} nodes joined (`rsrun-rendezvous status --job {}` lists them)",
            view.joined_count, plan.nodes.min, self.job
        ))
    }

    /// Resolves when the round ends elsewhere: the job's round moved on, the job failed, this node
    /// lost its membership, or its lease lapsed at this end (self-fencing: no answer from the
    /// service for a whole lease, after which the service may run a round without this node).
    pub(crate) fn round_end(&self, a: &RoundAssignment) -> RoundEndFuture {
        let round = a.round;
        let watch = self.watch.clone();
        let lost = self.keep_alive.as_ref().map(|k| k.lost.clone());
        let lapsed = self.keep_alive.as_ref().map(|k| k.lapsed.clone());
        let margin = self.fence_margin;
        Box::pin(async move {
            let Some(mut watch) = watch else { return std::future::pending().await };
            let mut lost = lost;
            let mut lapsed = lapsed;
            loop {
                if let Some(v) = watch.borrow_and_update().as_ref() {
                    if v.state() == proto::JobState::Failed {
                        return format!("the job failed: {}", v.reason).into();
                    }
                    if v.round > round {
                        return if v.reason.is_empty() { "a new round started".to_owned() } else { v.reason.clone() }.into();
                    }
                }
                tokio::select! {
                    changed = watch.changed() => {
                        if changed.is_err() {
                            return "lost contact with the job at the rendezvous".to_owned().into();
                        }
                    }
                    Some(reason) = async {
                        match lost.as_mut() {
                            Some(l) => {
                                if l.changed().await.is_err() {
                                    return std::future::pending().await;
                                }
                                l.borrow().as_ref().map(|e| format!("this node lost its membership: {e}"))
                            }
                            None => std::future::pending().await,
                        }
                    } => return reason.into(),
                    Some(why) = async {
                        match lapsed.as_mut() {
                            Some(l) => {
                                let why = l.wait_for(Option::is_some).await.ok().and_then(|why| why.clone());
                                match why {
                                    Some(why) => Some(why),
                                    None => std::future::pending().await,
                                }
                            }
                            None => std::future::pending().await,
                        }
                    } => return RoundEndCause {
                        reason: format!("this node's lease lapsed: {why}; its workers are stopped before the service can start a round without them"),
                        grace: Some(margin),
                    },
                }
            }
        })
    }

    /// Reports a local failure; RESTART or FAILED comes back (FAILED, saying so, when the service
    /// cannot be told).
    pub(crate) async fn report_failure(&mut self, a: &RoundAssignment, root: &WorkerFailure, hang: bool) -> Decision {
        match self.try_report_failure(a, root, hang).await {
            Ok(d) => d,
            Err(err) => Decision::Failed { remote_root: None, reason: format!("cannot report the failure to the rendezvous: {err}") },
        }
    }

    /// [`DaemonRdzv::report_failure`], with the error when the service did not answer.
    pub(crate) async fn try_report_failure(&mut self, a: &RoundAssignment, root: &WorkerFailure, hang: bool) -> Result<Decision, RdzvError> {
        let (exit_code, signal) = match &root.exit {
            ExitKind::Code(c) => (*c, 0),
            ExitKind::Signal(s) => (128 + s, *s),
            other => (other.exit_code(), 0),
        };
        let mut message = root.remote_message();
        // What the exit code cannot say (a hang, a worker that never started) travels as the
        // message's first line, so the other nodes and the head report it too
        // ([`failure_from_proto`] reads it back).
        if hang || matches!(root.exit, ExitKind::Hang { .. } | ExitKind::SpawnError(_)) {
            let head = match &root.exit {
                ExitKind::Hang { .. } | ExitKind::SpawnError(_) => root.exit.describe(),
                _ => "hung: no progress (hang timeout)".to_owned(),
            };
            message = if message.is_empty() { head } else { format!("{head}\n{message}") };
        }
        let info = proto::FailureInfo {
            node_id: self.node.clone(),
            round: a.round,
            rank: root.rank.map(|r| r as i32).unwrap_or(-1),
            local_rank: root.local_rank.map(|r| r as i32).unwrap_or(-1),
            exit_code,
            signal,
            message,
            time_unix_ms: root.time.duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0),
            hostname: root.hostname.clone(),
        };
        match self.client.report_failure(&self.job, a.round, &self.node, info, true).await {
            Ok(resp) => Ok(match resp.decision() {
                proto::FailureDecision::Restart => Decision::Restart,
                _ => {
                    let view = resp.view.unwrap_or_default();
                    let remote_root = view
                        .root_cause
                        .as_ref()
                        .filter(|rc| rc.node_id != self.node || rc.round != a.round || rc.rank != root.rank.map(|r| r as i32).unwrap_or(-1))
                        .map(|rc| Box::new(failure_from_proto(rc)));
                    Decision::Failed { remote_root, reason: nonempty(view.reason, "the job failed") }
                }
            }),
            // The round ended before our report (a peer's failure or a membership change): re-join.
            Err(RdzvError::FailedPrecondition(msg)) if msg.contains("stale round") => Ok(Decision::Restart),
            // Another node's failure failed the job first (the usual cascade: its peers' collectives
            // fail too): the job's recorded root cause is every node's, as `finish` reports it.
            Err(err) if job_ended(&err, &self.job) == Some(Ended::Failed) => Ok(match self.failed_view().await {
                Some(v) => Decision::Failed {
                    remote_root: v.root_cause.as_ref().map(|rc| Box::new(failure_from_proto(rc))),
                    reason: nonempty(v.reason, "the job failed"),
                },
                None => Decision::Failed { remote_root: None, reason: err.to_string() },
            }),
            Err(err) => Err(err),
        }
    }

    /// The job's view when the service says it failed (one call, bounded by
    /// `EXIT_CALL_TIMEOUT`); `None` when it cannot be read in time or the job did not fail.
    async fn failed_view(&self) -> Option<proto::JobView> {
        match tokio::time::timeout(EXIT_CALL_TIMEOUT, self.client.await_job_end(&self.job, Duration::ZERO)).await {
            Ok(Ok((v, _))) if v.state() == proto::JobState::Failed => Some(v),
            _ => None,
        }
    }

    /// This node's workers succeeded: `Finish`, then wait (up to the exit barrier) until the job
    /// completes, fails, or starts a new round.
    pub(crate) async fn finish(&mut self, plan: &LaunchPlan, a: &RoundAssignment, console: &ConsoleTx) -> RoundEnd {
        let view = match self.client.finish(&self.job, a.round, &self.node).await {
            Ok(v) => v,
            Err(RdzvError::FailedPrecondition(msg)) if msg.contains("stale round") => return RoundEnd::Rejoin,
            Err(err) => match job_ended(&err, &self.job) {
                Some(Ended::Completed) => return RoundEnd::Completed,
                // The job failed elsewhere before this node finished: not a success.
                Some(Ended::Failed) => {
                    return match self.failed_view().await {
                        Some(v) => job_failed(&v),
                        None => RoundEnd::Failed { root: None, reason: err.to_string() },
                    };
                }
                None => {
                    warn!(%err, "cannot tell the rendezvous that this node finished");
                    return RoundEnd::Completed;
                }
            },
        };
        if view.state() == proto::JobState::Completed {
            return RoundEnd::Completed;
        }
        let _ = console
            .send(ConsoleEvent::Note(format!(
                "rsrun: workers on this node succeeded; waiting up to {:?} for the other nodes (exit barrier)",
                plan.timeouts.exit_barrier
            )))
            .await;
        let Some(mut watch) = self.watch.clone() else { return RoundEnd::Completed };
        let deadline = tokio::time::Instant::now() + plan.timeouts.exit_barrier;
        loop {
            if let Some(v) = watch.borrow_and_update().as_ref() {
                match v.state() {
                    proto::JobState::Completed => return RoundEnd::Completed,
                    proto::JobState::Failed => return job_failed(v),
                    _ if v.round > a.round => return RoundEnd::Rejoin,
                    _ => {}
                }
            }
            tokio::select! {
                changed = watch.changed() => {
                    if changed.is_err() {
                        // The watch ends after a terminal view; ask once more.
                        return match self.client.await_job_end(&self.job, Duration::ZERO).await {
                            Ok((v, _)) if v.state() == proto::JobState::Failed => job_failed(&v),
                            _ => RoundEnd::Completed,
                        };
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let _ = console
                        .send(ConsoleEvent::Note(format!(
                            "rsrun: exit barrier timed out after {:?}; exiting with this node's success",
                            plan.timeouts.exit_barrier
                        )))
                        .await;
                    return RoundEnd::Completed;
                }
            }
        }
    }

    /// Whether this node's lease lapsed at this end during its last round.
    pub(crate) fn fenced(&self) -> bool {
        self.keep_alive.as_ref().is_some_and(|k| k.lapsed.borrow().is_some())
    }

    /// When fenced: waits for the keep-alive's end (it left, was dropped, or gave up: bounded by
    /// `keep_alive_timeout`).
    async fn settle_fence(&mut self) {
        if self.fenced()
            && let Some(k) = self.keep_alive.as_mut()
        {
            let _ = k.lost.wait_for(Option::is_some).await;
        }
    }

    /// After the round ended elsewhere: re-join unless the job is over.
    ///
    /// # Errors
    /// The keep-alive gave up: the service stayed unreachable past `keep_alive_timeout`. Re-joining
    /// would wait out the join timeout against a service that is gone; this node stops instead.
    ///
    /// A node that fenced itself waits here until the service answers again (it had dropped this
    /// node, or the keep-alive left for it) or the keep-alive gives up: up to `keep_alive_timeout`.
    pub(crate) async fn after_round_end(&mut self, _a: &RoundAssignment) -> anyhow::Result<RoundEnd> {
        self.settle_fence().await;
        let view = self.watch.as_ref().and_then(|w| w.borrow().clone());
        Ok(match view {
            Some(v) if v.state() == proto::JobState::Failed => job_failed(&v),
            Some(v) if v.state() == proto::JobState::Completed => RoundEnd::Completed,
            _ => {
                let lost = self.keep_alive.as_ref().and_then(|k| k.lost.borrow().clone());
                if let Some(err) = lost {
                    if err.is_retryable() || matches!(err, RdzvError::Timeout(_)) {
                        bail!(
                            "lost contact with the rendezvous service at {} (job '{}'): {err}; this node's workers were stopped",
                            self.endpoint,
                            self.job
                        );
                    }
                    // Out of the job (lease expired): a new keep-alive starts with the next join.
                    warn!(%err, "membership lost; re-joining");
                    self.keep_alive = None;
                }
                RoundEnd::Rejoin
            }
        })
    }

    /// See [`crate::rdzv::Rendezvous::service_gone_on`].
    pub(crate) fn service_gone_on(&mut self, gone: tokio_util::sync::CancellationToken) {
        self.gone = Some(gone);
    }

    /// [`Self::unreachable`] when a call bounded by [`EXIT_CALL_TIMEOUT`] ran out of it or found
    /// the service unavailable; a service that answered with another error still gets the leave.
    fn unreachable_if<T>(&mut self, call: &Result<Result<T, RdzvError>, tokio::time::error::Elapsed>) {
        if call.is_err() || matches!(call, Ok(Err(e)) if e.is_retryable()) {
            self.unreachable();
        }
    }

    /// The service did not answer this node's last call: leaving there would only wait out
    /// [`EXIT_CALL_TIMEOUT`] too, so this node exits without it (its lease ends the membership).
    fn unreachable(&mut self) {
        debug!(job = %self.job, endpoint = %self.endpoint, "the rendezvous did not answer: not leaving there");
        self.left = true;
    }

    /// Leaves the job (best effort).
    pub(crate) async fn leave(&mut self, reason: &str) {
        if self.left {
            return;
        }
        self.left = true;
        self.keep_alive = None;
        if self.gone.as_ref().is_some_and(tokio_util::sync::CancellationToken::is_cancelled) {
            debug!(job = %self.job, "the rendezvous service is gone with the head: not leaving there");
            return;
        }
        match tokio::time::timeout(EXIT_CALL_TIMEOUT, self.client.leave(&self.job, &self.node, reason)).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => debug!(%err, "leave failed"),
            Err(_) => debug!("leave timed out"),
        }
    }

    /// Leaves (if not yet) and stops an embedded service. A service hosted for other nodes gets a
    /// moment so that they see the job's end.
    pub(crate) async fn close(mut self) {
        self.leave("launcher exiting").await;
        // Close our own streams first: a graceful server shutdown waits for open calls.
        self.watch = None;
        self.keep_alive = None;
        if let Some(server) = self.embedded.take() {
            if self.hosting_for_others {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = tokio::time::timeout(EXIT_CALL_TIMEOUT, server.shutdown()).await;
            } else {
                // --standalone: nobody else uses it; dropping it cancels it without a graceful drain.
                drop(server);
            }
        }
    }
}

/// Node rank 0 hosts the single-job service at `target`, or (Slurm) at one of the next ports when it
/// is taken. An address that is not this host's (a Kubernetes Service in front of the pod) is served
/// on every interface at that port.
async fn host_for_job(plan: &LaunchPlan, token: Option<&str>, target: SocketAddr) -> anyhow::Result<(SocketAddr, Option<EmbeddedServer>)> {
    let bind = if is_own_address(target.ip()) {
        target
    } else if target.is_ipv4() {
        SocketAddr::from(([0, 0, 0, 0], target.port()))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, target.port()))
    };
    let cfg = reach::HostConfig {
        job: &plan.job_id,
        token_file: plan.token_file.clone(),
        token,
        port_probe: plan.port_probe,
    };
    let (addr, server) = reach::host(bind, &cfg).await?;
    // Connect to the address peers use (the wildcard is for binding only).
    Ok((SocketAddr::new(target.ip(), addr.port()), server))
}

/// A node other than rank 0: under Slurm, search node 0's service among the probed ports; else the
/// address itself (the join retries while nothing listens, and the waiting line says so).
async fn find_for_job(plan: &LaunchPlan, token: Option<&str>, host: &str, target: SocketAddr, console: &ConsoleTx) -> anyhow::Result<SocketAddr> {
    if plan.port_probe == 0 {
        return Ok(target);
    }
    reach::find(host, target, plan.port_probe, &plan.job_id, token, plan.timeouts.join, console).await
}

async fn hosting_note(plan: &LaunchPlan, console: &ConsoleTx, wanted: SocketAddr, addr: SocketAddr) {
    let moved = if wanted.port() == addr.port() {
        String::new()
    } else {
        format!(" (port {} was taken; the other nodes try the same ports)", wanted.port())
    };
    let _ = console
        .send(ConsoleEvent::Note(format!(
            "rsrun: hosting the rendezvous service at {addr} for job '{}'{moved} (it ends with this launcher; `rsrun-rendezvous serve` is the robust choice){}",
            plan.job_id,
            if plan.token_file.is_none() && !addr.ip().is_loopback() {
                "; no --rdzv-token-file: anyone who reaches it can join"
            } else {
                ""
            }
        )))
        .await;
}

fn nonempty(s: String, default: &str) -> String {
    if s.is_empty() { default.to_owned() } else { s }
}

/// How a job ended, as a refusal says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Completed,
    Failed,
}

/// Recognizes the service's refusal of a call to an ended job (`job "ID" has completed: ...`, which
/// travels as FAILED_PRECONDITION).
fn job_ended(err: &RdzvError, job: &str) -> Option<Ended> {
    match err {
        RdzvError::JobEnded { state: "completed", .. } => Some(Ended::Completed),
        RdzvError::JobEnded { state: "failed", .. } => Some(Ended::Failed),
        RdzvError::FailedPrecondition(msg) => {
            let rest = msg.strip_prefix(&format!("job {job:?} has "))?;
            if rest.starts_with("completed") {
                Some(Ended::Completed)
            } else if rest.starts_with("failed") {
                Some(Ended::Failed)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Status period while waiting: 1 s up to a thousand nodes, then 1 ms per node, so that the job's
/// nodes together ask about a thousand times a second at most.
fn status_period(max_nodes: u32) -> Duration {
    STATUS_EVERY.max(Duration::from_millis(u64::from(max_nodes)))
}

fn job_failed(v: &proto::JobView) -> RoundEnd {
    RoundEnd::Failed {
        root: v.root_cause.as_ref().map(|rc| Box::new(failure_from_proto(rc))),
        reason: nonempty(v.reason.clone(), "the job failed"),
    }
}

/// A failure recorded by the daemon (possibly another node's) as a report entry.
pub fn failure_from_proto(f: &proto::FailureInfo) -> WorkerFailure {
    // `report_failure` sends a hang's or a failed start's description as the first line.
    let (first, rest) = f.message.split_once('\n').unwrap_or((f.message.as_str(), ""));
    let mut message = f.message.as_str();
    let exit = if f.signal != 0 {
        ExitKind::Signal(f.signal)
    } else if f.rank < 0 {
        ExitKind::Other
    } else if f.exit_code == 124 && first.starts_with("hung: ") {
        message = rest;
        let (idle, last_step) = parse_hang(first).unwrap_or((Duration::ZERO, 0));
        ExitKind::Hang { idle, last_step }
    } else if f.exit_code == 127 && first.starts_with("could not start: ") {
        message = rest;
        ExitKind::SpawnError(first["could not start: ".len()..].to_owned())
    } else {
        ExitKind::Code(f.exit_code)
    };
    WorkerFailure {
        rank: u32::try_from(f.rank).ok(),
        local_rank: u32::try_from(f.local_rank).ok(),
        node_id: f.node_id.clone(),
        hostname: f.hostname.clone(),
        pid: 0,
        exit,
        time: UNIX_EPOCH + Duration::from_millis(f.time_unix_ms),
        error_file: None,
        error: None,
        stderr_tail: Vec::new(),
        message: (!message.is_empty()).then(|| message.to_owned()),
        stopped_by_rsrun: false,
    }
}

/// `hung: no progress for 12.5s (last step 40)` ([`ExitKind::Hang`]'s description) read back.
fn parse_hang(line: &str) -> Option<(Duration, u64)> {
    let rest = line.strip_prefix("hung: no progress for ")?;
    let (secs, rest) = rest.split_once("s (last step ")?;
    let step = rest.strip_suffix(')')?.parse().ok()?;
    let secs: f64 = secs.parse().ok()?;
    Some((Duration::try_from_secs_f64(secs).ok()?, step))
}

fn node_label(n: &proto::NodeStatus) -> String {
    let name = if n.hostname.is_empty() { &n.node_id } else { &n.hostname };
    match n.addrs.first() {
        Some(a) if a != name => format!("{name} ({a})"),
        _ => name.clone(),
    }
}

fn waiting_text(st: &proto::StatusResponse, plan: &LaunchPlan, waited: Duration) -> String {
    let Some(job) = st.jobs.first() else {
        return format!("rsrun: waiting at the rendezvous ({:.0}s)", waited.as_secs_f64());
    };
    let joined: Vec<String> = job
        .nodes
        .iter()
        .filter(|n| n.state() == proto::NodeState::Joined)
        .map(node_label)
        .collect();
    let (min, max) = (plan.nodes.min as usize, plan.nodes.max as usize);
    let missing = min.saturating_sub(joined.len());
    let round = job.view.as_ref().map(|v| v.round).unwrap_or(0);
    let need = if missing > 0 {
        format!("waiting for {missing} more")
    } else if joined.len() < max {
        "min reached, last call for more".to_owned()
    } else {
        "complete".to_owned()
    };
    format!(
        "rsrun: rendezvous round {round}: {}/{} nodes joined{}{} — {need} ({:.0}s)",
        joined.len(),
        if min == max { max.to_string() } else { format!("{min}..{max}") },
        if joined.is_empty() { "" } else { ": " },
        joined.join(", "),
        waited.as_secs_f64()
    )
}

/// The waiting line from the job's view alone (constant size, whatever the number of nodes).
fn waiting_count_text(v: &proto::JobView, plan: &LaunchPlan, waited: Duration) -> String {
    let secs = waited.as_secs_f64();
    if v.state() == proto::JobState::Running {
        return format!(
            "rsrun: round {} of the job is running; this node waits for the next round with {} other node(s) ({secs:.0}s)",
            v.round,
            v.nodes_waiting.saturating_sub(1)
        );
    }
    let (min, max) = (plan.nodes.min, plan.nodes.max);
    let joined = v.joined_count;
    let need = if joined < min {
        format!("waiting for {} more", min - joined)
    } else if joined < max {
        "min reached, last call for more".to_owned()
    } else {
        "complete".to_owned()
    };
    format!(
        "rsrun: rendezvous round {}: {joined}/{} nodes joined — {need} ({secs:.0}s)",
        v.round,
        if min == max { max.to_string() } else { format!("{min}..{max}") },
    )
}

fn timeout_text(st: &proto::StatusResponse, plan: &LaunchPlan) -> String {
    let Some(job) = st.jobs.first() else { return "no node joined".to_owned() };
    let joined: Vec<String> =
        job.nodes.iter().filter(|n| n.state() == proto::NodeState::Joined).map(node_label).collect();
    let absent: Vec<String> =
        job.nodes.iter().filter(|n| n.state() == proto::NodeState::Rejoining).map(node_label).collect();
    let missing = (plan.nodes.min as usize).saturating_sub(joined.len());
    let mut s = format!(
        "{} of at least {} nodes joined ({})",
        joined.len(),
        plan.nodes.min,
        if joined.is_empty() { "none".to_owned() } else { joined.join(", ") }
    );
    if !absent.is_empty() {
        s.push_str(&format!("; never came back: {}", absent.join(", ")));
    }
    if missing > absent.len() {
        s.push_str(&format!("; {} more node(s) never came", missing - absent.len()));
    }
    s
}

/// The node rank this node must have: the static backend's `--node-rank`.
fn fixed_rank(plan: &LaunchPlan) -> Option<u32> {
    match plan.rdzv {
        RdzvPlan::Static { node_rank, .. } => Some(node_rank),
        _ => None,
    }
}

/// Which fixed node ranks joined (and from where) and which never came, for the static backend's
/// join timeout.
fn static_timeout_text(st: &proto::StatusResponse, num_nodes: u32) -> String {
    let joined: Vec<(u32, String)> = st
        .jobs
        .first()
        .map(|j| {
            j.nodes
                .iter()
                .filter_map(|n| n.rank_hint.map(|r| (r, node_label(n))))
                .collect()
        })
        .unwrap_or_default();
    let missing: Vec<String> =
        (0..num_nodes).filter(|r| !joined.iter().any(|(j, _)| j == r)).map(|r| r.to_string()).collect();
    let mut present: Vec<String> = joined.iter().map(|(r, who)| format!("{r} = {who}")).collect();
    present.sort();
    format!(
        "node rank(s) {} of {num_nodes} never joined (joined: {}); start them with --node-rank and the same --master-addr/--master-port",
        missing.join(", "),
        if present.is_empty() { "none".to_owned() } else { present.join(", ") }
    )
}

async fn resolve(host: &str, port: u16) -> std::io::Result<SocketAddr> {
    // On the blocking pool and with a deadline: a resolver that does not answer (getaddrinfo
    // retries for up to ~30 s) must not hold the runtime's thread, where signals are handled.
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port))).await {
        Ok(found) => found?
            .next()
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("no address for {host}"))),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("resolving {host} took longer than {} s", RESOLVE_TIMEOUT.as_secs()),
        )),
    }
}

/// The longest a typed endpoint's name may take to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether something accepts connections at `addr` (short deadline).
async fn listening(addr: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// The addresses this node advertises: `--local-addr`, else the local address that routes to the
/// rendezvous service (reachable by whoever reaches the service), then the host name.
fn advertised_addrs(plan: &LaunchPlan, target: SocketAddr) -> Vec<String> {
    if let Some(a) = &plan.local_addr {
        return vec![a.clone()];
    }
    let mut addrs = Vec::new();
    let bind: SocketAddr = if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    if let Ok(sock) = std::net::UdpSocket::bind(bind)
        && sock.connect(target).is_ok()
        && let Ok(local) = sock.local_addr()
    {
        addrs.push(local.ip().to_string());
    }
    if !plan.hostname.is_empty() && !addrs.contains(&plan.hostname) {
        addrs.push(plan.hostname.clone());
    }
    addrs
}


#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a keep-alive still renews the lease: it has not reported this node out, its task
    /// runs, and it has not fenced the node.
    fn keep_alive_live(k: &KeepAliveHandle) -> bool {
        // `has_changed` fails once the task ended (its sender is gone).
        k.lost.borrow().is_none() && k.lost.has_changed().is_ok() && k.lapsed.borrow().is_none()
    }
    use crate::plan::tests::{host, parse};
    use crate::report::WorkerFailure;

    async fn server() -> EmbeddedServer {
        spawn_with(ServerConfig::in_memory(SocketAddr::from(([127, 0, 0, 1], 0)))).await.unwrap()
    }

    fn plan(addr: SocketAddr, nnodes: &str, hostname: &str, conf: &str) -> LaunchPlan {
        let conf = format!("is_host=false,last_call_timeout=0.1,keep_alive_interval=0.1,keep_alive_max_attempt=10,join_timeout=20,{conf}");
        let args = parse(&[
            "--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", &addr.to_string(), "--rdzv-id", "job-1",
            "--rdzv-conf", &conf, "--no-python", "true",
        ]);
        let mut p = LaunchPlan::resolve(&args, &host()).unwrap();
        p.hostname = hostname.to_owned();
        p
    }

    fn console() -> ConsoleTx {
        let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        tx
    }

    fn failure(rank: u32) -> WorkerFailure {
        WorkerFailure {
            rank: Some(rank),
            local_rank: Some(0),
            node_id: String::new(),
            hostname: "a".into(),
            pid: 1,
            exit: ExitKind::Code(3),
            time: std::time::SystemTime::now(),
            error_file: None,
            error: None,
            stderr_tail: Vec::new(),
            message: None,
            stopped_by_rsrun: false,
        }
    }

    #[test]
    fn ended_jobs_are_recognized_as_the_service_words_them() {
        let job = "job-1";
        let ended = |state| RdzvError::JobEnded { job: job.into(), state, reason: "all nodes finished".into() };
        // Over gRPC the service's error arrives as FAILED_PRECONDITION carrying its text (the
        // `finish` and `join` tests below go through the real service).
        let wire = |e: RdzvError| RdzvError::FailedPrecondition(e.to_string());
        assert_eq!(job_ended(&wire(ended("completed")), job), Some(Ended::Completed));
        assert_eq!(job_ended(&wire(ended("failed")), job), Some(Ended::Failed));
        assert_eq!(job_ended(&ended("failed"), job), Some(Ended::Failed));
        assert_eq!(job_ended(&wire(ended("completed")), "other-job"), None);
        let stale = RdzvError::StaleRound { job: job.into(), given: 1, current: 2 };
        assert_eq!(job_ended(&wire(stale), job), None);
        assert_eq!(job_ended(&RdzvError::Unavailable("down".into()), job), None);
    }

    #[test]
    fn waiting_line_from_the_view_alone() {
        let p = plan(SocketAddr::from(([127, 0, 0, 1], 1)), "2:4", "a", "");
        let mut v = proto::JobView { round: 3, joined_count: 1, min_nodes: 2, max_nodes: 4, ..Default::default() };
        v.set_state(proto::JobState::Forming);
        let t = waiting_count_text(&v, &p, Duration::from_secs(5));
        assert_eq!(t, "rsrun: rendezvous round 3: 1/2..4 nodes joined — waiting for 1 more (5s)");
        v.joined_count = 3;
        assert!(waiting_count_text(&v, &p, Duration::ZERO).contains("3/2..4 nodes joined — min reached, last call"));
        v.set_state(proto::JobState::Running);
        v.nodes_waiting = 2;
        assert!(waiting_count_text(&v, &p, Duration::ZERO).contains("round 3 of the job is running; this node waits for the next round with 1 other"));
        assert_eq!(status_period(8), STATUS_EVERY);
        assert_eq!(status_period(10_000), Duration::from_secs(10));
    }

    /// Nodes `a` and `b` of a 2-node job on a service of their own, in their first round.
    async fn two_nodes_in_a_round() -> (EmbeddedServer, ConsoleTx, [(DaemonRdzv, RoundAssignment, LaunchPlan); 2]) {
        let srv = server().await;
        let (pa, pb) = (plan(srv.addr, "2", "a", ""), plan(srv.addr, "2", "b", ""));
        let c = console();
        let mut a = DaemonRdzv::connect(&pa, &c).await.unwrap();
        let mut b = DaemonRdzv::connect(&pb, &c).await.unwrap();
        let (ra, rb) = tokio::join!(a.next_round(&pa, &c), b.next_round(&pb, &c));
        let (ra, rb) = (ra.unwrap().unwrap(), rb.unwrap().unwrap());
        (srv, c, [(a, ra, pa), (b, rb, pb)])
    }

    /// A node whose workers succeeded after the job failed elsewhere reports the job's failure.
    #[tokio::test(flavor = "current_thread")]
    async fn finish_after_the_job_failed_is_a_failure() {
        let (_srv, c, [(mut a, ra, _), (mut b, rb, pb)]) = two_nodes_in_a_round().await;
        let root = failure(ra.rank(0));
        assert!(matches!(a.report_failure(&ra, &root, false).await, Decision::Failed { .. }));
        match b.finish(&pb, &rb, &c).await {
            RoundEnd::Failed { root: Some(r), reason } => {
                assert_eq!(r.rank, Some(ra.rank(0)), "{reason}");
                assert_eq!(r.exit, ExitKind::Code(3));
            }
            other => panic!("expected the job's failure, got {other:?}"),
        }
    }

    /// A second node whose workers failed too, after the first node's report failed the job,
    /// reports the job's root cause (the first report), not a rendezvous error with its own.
    #[tokio::test(flavor = "current_thread")]
    async fn a_failure_reported_after_the_job_failed_names_the_jobs_root_cause() {
        let (_srv, _c, [(mut a, ra, _), (mut b, rb, _)]) = two_nodes_in_a_round().await;
        let mut first = failure(ra.rank(0));
        first.exit = ExitKind::Signal(11);
        assert!(matches!(a.report_failure(&ra, &first, false).await, Decision::Failed { remote_root: None, .. }));
        match b.report_failure(&rb, &failure(rb.rank(0)), false).await {
            Decision::Failed { remote_root: Some(r), reason } => {
                assert_eq!((r.rank, &r.exit), (Some(ra.rank(0)), &ExitKind::Signal(11)), "{reason}");
                assert!(!reason.contains("cannot report"), "{reason}");
            }
            other => panic!("expected the job's root cause, got {other:?}"),
        }
    }

    /// A hang and a worker that never started keep their meaning on the other nodes.
    #[test]
    fn hang_and_spawn_failures_travel_with_their_description() {
        let hang = ExitKind::Hang { idle: Duration::from_millis(12_500), last_step: 40 };
        let info = |exit: &ExitKind, message: String| proto::FailureInfo {
            rank: 3,
            exit_code: exit.exit_code(),
            message,
            ..Default::default()
        };
        let back = failure_from_proto(&info(&hang, format!("{}\nstderr:\nstep 40", hang.describe())));
        assert_eq!(back.exit, hang);
        assert_eq!(back.message.as_deref(), Some("stderr:\nstep 40"));
        let spawn = ExitKind::SpawnError("No such file or directory (os error 2)".into());
        let back = failure_from_proto(&info(&spawn, spawn.describe()));
        assert_eq!(back.exit, spawn);
        assert_eq!(back.message, None);
        // A worker's own exit codes 124 and 127 stay exit codes.
        assert_eq!(failure_from_proto(&info(&ExitKind::Code(127), "could not find data".into())).exit, ExitKind::Code(127));
        assert_eq!(failure_from_proto(&info(&ExitKind::Code(124), "timeout".into())).exit, ExitKind::Code(124));
        assert_eq!(parse_hang("hung: no progress for 1e400s (last step 1)"), None);
    }

    /// A node joining a job that completed (while it waited, or just before) exits cleanly.
    #[tokio::test(flavor = "current_thread")]
    async fn join_to_a_completed_job_is_a_clean_end() {
        let srv = server().await;
        let (pa, pb) = (plan(srv.addr, "1", "a", ""), plan(srv.addr, "1", "b", ""));
        let c = console();
        let mut a = DaemonRdzv::connect(&pa, &c).await.unwrap();
        let ra = a.next_round(&pa, &c).await.unwrap().unwrap();
        assert!(matches!(a.finish(&pa, &ra, &c).await, RoundEnd::Completed));
        let mut b = DaemonRdzv::connect(&pb, &c).await.unwrap();
        assert!(b.next_round(&pb, &c).await.unwrap().is_none(), "the job had completed");
    }

    /// A keep-alive that reported this node out is not reused by the next round.
    #[tokio::test(flavor = "current_thread")]
    async fn a_dead_keep_alive_is_replaced_on_the_next_join() {
        let srv = server().await;
        let p = plan(srv.addr, "1", "a", "");
        let c = console();
        let mut a = DaemonRdzv::connect(&p, &c).await.unwrap();
        a.next_round(&p, &c).await.unwrap().unwrap();
        assert!(a.keep_alive.as_ref().is_some_and(keep_alive_live));
        // As if this node had been expelled: its keep-alive reports it out and stops.
        let mut dead = a.client.spawn_keep_alive(&a.job, "expelled-node", Duration::from_millis(10));
        tokio::time::timeout(Duration::from_secs(10), dead.lost.wait_for(Option::is_some)).await.unwrap().unwrap();
        a.keep_alive = Some(dead);
        a.next_round(&p, &c).await.unwrap().unwrap();
        let k = a.keep_alive.as_ref().unwrap();
        assert!(keep_alive_live(k), "the next round kept a dead keep-alive: {:?}", k.lost.borrow());
    }

    /// The keep-alive giving up on an unreachable service ends this node with an error naming the
    /// endpoint (no re-join against a service that is gone).
    #[tokio::test(flavor = "current_thread")]
    async fn an_unreachable_service_is_an_error_naming_the_endpoint() {
        let srv = server().await;
        let addr = srv.addr;
        // A lease far longer than the give-up: the node gives up before it fences itself.
        let p = plan(addr, "1", "a", "read_timeout=1,keep_alive_timeout=0.2,lease_timeout=60");
        let c = console();
        let mut a = DaemonRdzv::connect(&p, &c).await.unwrap();
        let ra = a.next_round(&p, &c).await.unwrap().unwrap();
        let round_end = a.round_end(&ra);
        srv.shutdown().await.unwrap();
        let cause = tokio::time::timeout(Duration::from_secs(20), round_end).await.expect("the round never ended");
        assert!(cause.reason.contains("lost its membership"), "{cause:?}");
        assert_eq!(cause.grace, None);
        let err = a.after_round_end(&ra).await.unwrap_err().to_string();
        assert!(err.contains(&format!("lost contact with the rendezvous service at {addr}")), "{err}");
    }

    /// A node cut off from the service fences itself when its lease lapses at its end, well before
    /// it gives up on the service (T4: its workers stop by its own lease, not after
    /// keep_alive_timeout); it then waits for the give-up and ends naming the endpoint.
    #[tokio::test(flavor = "current_thread")]
    async fn a_node_cut_off_fences_itself_by_its_lease() {
        let srv = server().await;
        let addr = srv.addr;
        let p = plan(addr, "1", "a", "lease_timeout=0.6,read_timeout=1,keep_alive_timeout=4");
        let c = console();
        let mut a = DaemonRdzv::connect(&p, &c).await.unwrap();
        let ra = a.next_round(&p, &c).await.unwrap().unwrap();
        assert!(!a.fenced());
        let round_end = a.round_end(&ra);
        srv.shutdown().await.unwrap();
        let cause = tokio::time::timeout(Duration::from_secs(20), round_end).await.expect("the round never ended");
        assert!(cause.reason.contains("this node's lease lapsed"), "{cause:?}");
        assert!(cause.reason.contains(&addr.to_string()), "{cause:?}");
        // The workers get at most a third of the lease (less than --shutdown-timeout here) to stop.
        assert_eq!(cause.grace, Some(Duration::from_millis(200)));
        assert!(a.fenced());
        assert!(!a.keep_alive.as_ref().is_some_and(keep_alive_live), "a fenced keep-alive would be kept for the next round");
        // Fencing came first: the keep-alive had not given up yet.
        assert!(a.keep_alive.as_ref().is_some_and(|k| k.lost.borrow().is_none()), "gave up before fencing");
        let err = a.after_round_end(&ra).await.unwrap_err().to_string();
        assert!(err.contains(&format!("lost contact with the rendezvous service at {addr}")), "{err}");
    }
}
