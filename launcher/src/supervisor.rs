//! Supervision of this node's worker group for one round.
//!
//! [`run_group`] starts the workers of a round, watches them, and stops them; it returns a
//! [`GroupOutcome`]. What happens next (restart, re-join, exit) is decided by [`crate::agent`].
//!
//! # Worker group states
//!
//! The group moves as one unit ([`WorkerGroupState`], torchelastic's `WorkerState` without UNKNOWN:
//! rsrun owns its children, so their set cannot be unknown):
//!
//! ```text
//!   INIT ──all workers started──▶ HEALTHY ──every worker exited 0──▶ SUCCEEDED
//!    │                              │  │
//!    │ a worker could not start     │  └─no progress for --hang-timeout──▶ UNHEALTHY ─┐
//!    ▼                              ▼                                                  │
//!  FAILED ◀──group stopped── a worker exited ≠ 0 or by a signal                       │
//!    ▲                                                                                 │
//!    └────────────────────────────────group stopped───────────────────────────────────┘
//!
//!   HEALTHY ──round ended elsewhere / stop signal / shutdown──▶ STOPPED
//!   STOPPED, FAILED ──(agent: restart or re-join)──▶ INIT of the next round
//! ```
//!
//! Stopping the group always means: the stop signal (SIGTERM, or the signal rsrun received) to every
//! worker's process group, up to `--shutdown-timeout` for them to exit, SIGKILL to every group
//! (grandchildren included), then a bounded wait for the exits.

use std::future::Future;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::env::{RoundAssignment, worker_env};
use crate::logs::{ConsoleModes, ConsoleSink, ConsoleTx, DuplicateSink, LogFile, SharedTail, StreamKind, StreamSink, Tail, pump};
use crate::plan::{LaunchPlan, expand_prefix};
use crate::rdzv::RoundEndCause;
use crate::report::{ErrorFileInfo, ExitKind, WorkerFailure, read_error_file};
use crate::signals::{SignalAction, Signals};
use crate::worker::{Guardian, SpawnSpec, WorkerProcess, spawn};

/// The state of the local worker group (see the module docs for the transitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerGroupState {
    /// Workers of the round are being started.
    Init,
    /// All workers started and none has failed.
    Healthy,
    /// Workers that report progress stopped reporting (hang).
    Unhealthy,
    /// Stopped by rsrun: the round ended elsewhere, a stop signal, or shutdown.
    Stopped,
    /// Every worker exited 0.
    Succeeded,
    /// A worker failed; the group was stopped.
    Failed,
}

/// How a round ended on this node.
#[derive(Debug)]
pub enum GroupOutcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker failed or hung; the group is stopped. `root` is the first failure seen.
    Failed {
        /// The first failure.
        root: Box<WorkerFailure>,
        /// The other workers that failed or were stopped.
        others: Vec<WorkerFailure>,
        /// The group was UNHEALTHY (a hang) rather than FAILED.
        hang: bool,
    },
    /// A `stop` signal arrived; the group is stopped.
    Signalled(Signal),
    /// The round ended elsewhere or shutdown was requested; the group is stopped.
    Stopped(String),
}

/// What a round needs from the agent.
#[derive(Debug)]
pub struct GroupContext<'a> {
    /// The plan.
    pub plan: &'a LaunchPlan,
    /// The round.
    pub assignment: &'a RoundAssignment,
    /// Where console lines go.
    pub console: &'a ConsoleTx,
    /// What rsrun's stdout and stderr are: progress lines are drawn in place on a terminal.
    pub console_modes: ConsoleModes,
    /// The guardian, told about every worker group.
    pub guardian: Option<&'a Guardian>,
    /// Gets the first worker failure the moment it is seen, before the group is stopped (the
    /// agent reports it at once: see [`crate::agent`]). Its error file and the last stderr lines
    /// are not read yet; the outcome carries the full report.
    pub first_failure: Option<&'a mpsc::UnboundedSender<WorkerFailure>>,
}

/// Number of stderr lines kept per worker for the failure report.
const TAIL_LINES: usize = 20;
/// After SIGKILL, how long to wait for the kernel to reap before giving up on a worker.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often the thread following an abandoned worker's group checks whether it is gone.
const ABANDONED_POLL: Duration = Duration::from_secs(1);

/// How often a stop's grace checks whether what exited workers started is still running.
const GROUP_POLL: Duration = Duration::from_millis(100);
/// After the group ended, how long the log pumps get to drain the pipes.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// How long the failure report waits for the workers' error files to be read.
const ERROR_FILE_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct Progress {
    last: Mutex<Option<(Instant, u64)>>,
}

#[derive(Debug)]
struct Slot {
    local_rank: u32,
    rank: u32,
    process: WorkerProcess,
    exited: Option<(ExitKind, SystemTime)>,
    tail: SharedTail,
    progress: Arc<Progress>,
    error_file: Option<PathBuf>,
}

struct Group<'a> {
    ctx: &'a GroupContext<'a>,
    slots: Vec<Slot>,
    exits: mpsc::UnboundedReceiver<(usize, std::io::Result<std::process::ExitStatus>, SystemTime)>,
    alive: usize,
    /// Wait tasks and progress readers; aborted when the group is dropped.
    tasks: JoinSet<()>,
    /// Log pumps; drained after the group ends.
    pumps: JoinSet<()>,
    /// Cancelled when the pumps stop sending to the console (pipes still open after the drain).
    quiet: CancellationToken,
    state: WorkerGroupState,
    /// The stop signal rsrun received, once one arrived: the round then ends as
    /// [`GroupOutcome::Signalled`], whatever else ended it.
    signalled: Option<Signal>,
    /// When stalled workers were seen (each one's idle time in the report is measured to it).
    stall_seen_at: Option<Instant>,
}

/// How [`Group::monitor`] ended.
enum Ended {
    /// The round's outcome.
    Done(GroupOutcome),
    /// Workers failed (`causes`: the first failure seen) or hung (`causes`: the stalled workers,
    /// `hang_idle` set); the group is stopped. The report is built once the pipes are drained.
    Failed { causes: Vec<usize>, hang_idle: Option<Duration> },
}

/// Runs one round of this node's workers until they succeed, fail, or `stop` / a signal /
/// `cancel` ends the round.
pub async fn run_group(
    ctx: &GroupContext<'_>,
    signals: &mut Signals,
    stop: impl Future<Output = RoundEndCause>,
    cancel: &CancellationToken,
) -> GroupOutcome {
    let a = ctx.assignment;
    let span = info_span!("group", job = %ctx.plan.job_id, round = a.round, node = %a.node_id);
    async move {
        let mut group = match Group::start(ctx) {
            Ok(g) => g,
            Err(failed) => {
                let (mut group, failure) = *failed;
                group.stop(Signal::SIGKILL, Duration::ZERO, signals).await;
                let others = group.finish().await;
                if let Some(sig) = group.signalled {
                    info!(signal = %sig, "stop signal while stopping a group that failed to start");
                    return GroupOutcome::Signalled(sig);
                }
                return GroupOutcome::Failed { root: Box::new(failure), others, hang: false };
            }
        };
        let ended = group.monitor(signals, stop, cancel).await;
        // The last lines (a traceback) may still be in the pipes: the report's stderr tails are taken
        // after the drain.
        group.drain().await;
        match ended {
            Ended::Done(outcome) => outcome,
            Ended::Failed { causes, hang_idle } => {
                let (root, others) = group.failures(&causes, hang_idle).await;
                GroupOutcome::Failed { root: Box::new(root), others, hang: hang_idle.is_some() }
            }
        }
    }
    .instrument(span)
    .await
}

impl<'a> Group<'a> {
    fn start(ctx: &'a GroupContext<'a>) -> Result<Self, Box<(Self, WorkerFailure)>> {
        let plan = ctx.plan;
        let a = ctx.assignment;
        let (tx, exits) = mpsc::unbounded_channel();
        let mut group = Group {
            ctx,
            slots: Vec::with_capacity(a.local_world_size as usize),
            exits,
            alive: 0,
            tasks: JoinSet::new(),
            pumps: JoinSet::new(),
            quiet: CancellationToken::new(),
            state: WorkerGroupState::Init,
            signalled: None,
            stall_seen_at: None,
        };
        let dup_files = open_dup_files(plan, a);
        for local_rank in 0..a.local_world_size {
            let rank = a.rank(local_rank);
            match group.start_worker(local_rank, rank, &tx, &dup_files) {
                Ok(()) => {}
                Err(err) => {
                    let failure = WorkerFailure {
                        rank: Some(rank),
                        local_rank: Some(local_rank),
                        node_id: a.node_id.clone(),
                        hostname: plan.hostname.clone(),
                        pid: 0,
                        exit: ExitKind::SpawnError(format!("{}: {err}", plan.program.exe.display())),
                        time: SystemTime::now(),
                        error_file: None,
                        error: None,
                        stderr_tail: Vec::new(),
                        message: None,
                        stopped_by_rsrun: false,
                    };
                    group.state = WorkerGroupState::Failed;
                    return Err(Box::new((group, failure)));
                }
            }
        }
        group.state = WorkerGroupState::Healthy;
        info!(workers = a.local_world_size, world_size = a.world_size, "worker group HEALTHY");
        Ok(group)
    }

    fn start_worker(
        &mut self,
        local_rank: u32,
        rank: u32,
        exit_tx: &mpsc::UnboundedSender<(usize, std::io::Result<std::process::ExitStatus>, SystemTime)>,
        dup: &DupFiles,
    ) -> anyhow::Result<()> {
        let plan = self.ctx.plan;
        let a = self.ctx.assignment;
        let dir = plan.logs.worker_dir(&plan.job_id, a.round, rank);
        let (out_file, err_file, error_file) = match &dir {
            Some(dir) => {
                // Named as the log directory's failure, not the program's (`--log-dir` naming a
                // file read as if the program could not be found).
                let log_err = |e: std::io::Error| anyhow::anyhow!("log directory {} (--log-dir): {e}", dir.display());
                create_private_dirs(dir).map_err(log_err)?;
                let error_file = dir.join("error.json");
                // A round's rank starts once per run: files here are an earlier run's of the same
                // job id (whose rounds counted from 1 again). Kept, not truncated; and its error
                // file is not taken for this worker's.
                set_aside_earlier_run(dir).map_err(log_err)?;
                let create = |name: &str| {
                    let path = dir.join(name);
                    std::fs::File::create(&path).map(|f| LogFile::new(f, path)).map_err(log_err)
                };
                (Some(create("stdout.log")?), Some(create("stderr.log")?), Some(error_file))
            }
            None => (None, None, None),
        };
        let env = worker_env(plan, a, local_rank, error_file.as_deref());
        let spawned = spawn(SpawnSpec {
            exe: &plan.program.exe,
            argv: plan.program.argv(local_rank),
            env,
            cpus: plan.cpu_sets.as_ref().map(|s| s[local_rank as usize].as_slice()),
            progress: true,
            stdin: plan.worker_stdin,
        })?;
        let pid = spawned.process.pid();
        if let Some(g) = self.ctx.guardian {
            g.watch(pid);
        }
        debug!(local_rank, rank, pid, "worker started");

        let lr = local_rank.to_string();
        let r = rank.to_string();
        let nr = a.node_rank.to_string();
        let round = a.round.to_string();
        let prefix = expand_prefix(
            &plan.logs.prefix,
            &[
                ("rank", &r),
                ("local_rank", &lr),
                ("node_rank", &nr),
                ("role_name", &plan.role),
                ("hostname", &plan.hostname),
                ("round", &round),
            ],
        )
        .into_bytes();
        let tail: SharedTail = Arc::new(Mutex::new(Tail::new(TAIL_LINES)));
        let console = |stream: u8, kind: StreamKind| {
            plan.logs.on_console(local_rank, rank, stream).then(|| ConsoleSink {
                tx: self.ctx.console.clone(),
                prefix: prefix.clone(),
                mode: self.ctx.console_modes.of(kind),
                prompts: self.ctx.console_modes.prompts && plan.worker_stdin == crate::worker::WorkerStdin::Inherit,
            })
        };
        let out_sink = StreamSink {
            file: out_file,
            console: console(1, StreamKind::Stdout),
            tail: None,
            duplicate: dup.stdout.clone(),
            quiet: Some(self.quiet.clone()),
        };
        let err_sink = StreamSink {
            file: err_file,
            console: console(2, StreamKind::Stderr),
            tail: Some(tail.clone()),
            duplicate: dup.stderr.clone(),
            quiet: Some(self.quiet.clone()),
        };
        self.pumps.spawn(pump(spawned.stdout, StreamKind::Stdout, out_sink));
        self.pumps.spawn(pump(spawned.stderr, StreamKind::Stderr, err_sink));

        let idx = self.slots.len();
        let mut child = spawned.child;
        let tx = exit_tx.clone();
        self.tasks.spawn(async move {
            let status = child.wait().await;
            let _ = tx.send((idx, status, SystemTime::now()));
        });
        let progress = Arc::new(Progress::default());
        if let Some(sock) = spawned.progress {
            let p = progress.clone();
            self.tasks.spawn(async move {
                let mut buf = [0u8; 64];
                while let Ok(n) = sock.recv(&mut buf).await {
                    let step = if n >= 8 {
                        u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8]))
                    } else {
                        0
                    };
                    *p.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), step));
                }
            });
        }
        self.slots.push(Slot { local_rank, rank, process: spawned.process, exited: None, tail, progress, error_file });
        self.alive += 1;
        Ok(())
    }

    async fn monitor(
        &mut self,
        signals: &mut Signals,
        stop: impl Future<Output = RoundEndCause>,
        cancel: &CancellationToken,
    ) -> Ended {
        let plan = self.ctx.plan;
        let grace = plan.timeouts.shutdown;
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(plan.timeouts.monitor_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {
                    self.stop(Signal::SIGTERM, grace, signals).await;
                    return self.after_stop(Ended::Done(GroupOutcome::Stopped("shutdown requested".into())));
                }
                (sig, action) = signals.recv() => match action {
                    SignalAction::Stop => {
                        info!(signal = %sig, "stop signal: stopping workers");
                        self.signalled = Some(sig);
                        self.stop(sig, grace, signals).await;
                        return Ended::Done(GroupOutcome::Signalled(sig));
                    }
                    SignalAction::Forward => {
                        info!(signal = %sig, "forwarding signal to workers");
                        self.signal_live(sig);
                    }
                    SignalAction::Ignore => info!(signal = %sig, "signal ignored (--signal-policy)"),
                },
                cause = &mut stop => {
                    let RoundEndCause { reason, grace: limit } = cause;
                    // A worker that failed on its own in the same moment is not this round's
                    // report (the round ends for everyone anyway), but it is not hidden either.
                    while let Ok((idx, status, at)) = self.exits.try_recv() {
                        if let Some(kind) = self.record_exit(idx, status, at) {
                            warn!(rank = self.slots[idx].rank, exit = ?kind, %reason, "a worker failed while the round was ending elsewhere; the next round shows whether it fails again");
                        }
                    }
                    info!(%reason, "round ended elsewhere: stopping workers");
                    self.stop(Signal::SIGTERM, limit.map_or(grace, |l| l.min(grace)), signals).await;
                    return self.after_stop(Ended::Done(GroupOutcome::Stopped(reason)));
                }
                Some((idx, status, at)) = self.exits.recv() => {
                    let kind = self.record_exit(idx, status, at);
                    if let Some(kind) = kind {
                        info!(rank = self.slots[idx].rank, exit = ?kind, "worker failed: stopping the group");
                        self.state = WorkerGroupState::Failed;
                        if let Some(tx) = self.ctx.first_failure {
                            let _ = tx.send(self.build_failures(&[idx], &[idx], None, &[]).0);
                        }
                        self.stop(Signal::SIGTERM, grace, signals).await;
                        return self.after_stop(Ended::Failed { causes: vec![idx], hang_idle: None });
                    }
                    if self.alive == 0 {
                        self.state = WorkerGroupState::Succeeded;
                        info!("worker group SUCCEEDED");
                        if self.groups_running() {
                            // What they left running gets SIGTERM and the grace, not SIGKILL.
                            info!("the workers left processes running: SIGTERM, SIGKILL after the grace");
                            for s in &self.slots {
                                s.process.signal_group(Signal::SIGTERM);
                            }
                            self.wait_out(Signal::SIGTERM, grace, signals).await;
                        }
                        self.kill_leftovers();
                        // Every leader is reaped: its group id may be reused from now on.
                        self.release_exited();
                        return Ended::Done(GroupOutcome::Succeeded);
                    }
                }
                _ = tick.tick() => {
                    // An exited worker's group that emptied is forgotten soon, not only at the
                    // next stop: its id (the leader's reaped pid) may go to an unrelated group,
                    // which a later stop or the guardian must never signal.
                    self.release_gone();
                    if plan.timeouts.hang.is_some()
                        && let Some((stalled, idle)) = self.stalled()
                    {
                        self.stall_seen_at = Some(Instant::now());
                        self.state = WorkerGroupState::Unhealthy;
                        let ranks: Vec<u32> = stalled.iter().map(|&i| self.slots[i].rank).collect();
                        info!(?ranks, "no progress: worker group UNHEALTHY");
                        // A hang too is reported at once: the peers' collectives break as soon as
                        // these workers are stopped, and their failures must not come first.
                        if let (Some(tx), Some(&first)) = (self.ctx.first_failure, stalled.first()) {
                            let _ = tx.send(self.build_failures(&[first], &stalled, Some(idle), &[]).0);
                        }
                        self.stop(Signal::SIGTERM, grace, signals).await;
                        return self.after_stop(Ended::Failed { causes: stalled, hang_idle: Some(idle) });
                    }
                }
            }
        }
    }

    /// How a round that rsrun stopped ends: a stop signal that arrived while the workers were being
    /// stopped means shutdown (torchrun.md §4.5), so the round ends as [`GroupOutcome::Signalled`]
    /// (the agent neither restarts nor re-joins, and rsrun exits 128 + the signal) instead of `ended`.
    fn after_stop(&self, ended: Ended) -> Ended {
        match self.signalled {
            Some(sig) => {
                info!(signal = %sig, "workers stopped: ending on the stop signal received meanwhile");
                Ended::Done(GroupOutcome::Signalled(sig))
            }
            None => ended,
        }
    }

    /// Sends `sig` to the groups of the workers still running.
    fn signal_live(&self, sig: Signal) {
        for s in self.slots.iter().filter(|s| s.exited.is_none()) {
            s.process.signal_group(sig);
        }
    }

    /// Records an exit; returns the failure kind when it is one.
    fn record_exit(
        &mut self,
        idx: usize,
        status: std::io::Result<std::process::ExitStatus>,
        at: SystemTime,
    ) -> Option<ExitKind> {
        let kind = match status {
            Ok(st) => match (st.code(), st.signal()) {
                (Some(c), _) => ExitKind::Code(c),
                (None, Some(s)) => ExitKind::Signal(s),
                (None, None) => ExitKind::Code(1),
            },
            Err(e) => ExitKind::SpawnError(format!("wait failed: {e}")),
        };
        let slot = &mut self.slots[idx];
        if slot.exited.is_some() {
            return None;
        }
        self.alive -= 1;
        debug!(rank = slot.rank, exit = ?kind, "worker exited");
        let failed = kind != ExitKind::Code(0);
        slot.exited = Some((kind.clone(), at));
        self.release_if_gone(idx);
        failed.then_some(kind)
    }

    /// Workers that reported progress before and none for the hang timeout.
    fn stalled(&self) -> Option<(Vec<usize>, Duration)> {
        let hang = self.ctx.plan.timeouts.hang?;
        let now = Instant::now();
        let mut stalled = Vec::new();
        let mut max_idle = Duration::ZERO;
        for (i, s) in self.slots.iter().enumerate() {
            if s.exited.is_some() {
                continue;
            }
            if let Some((last, step)) = *s.progress.last.lock().unwrap_or_else(|e| e.into_inner()) {
                let idle = now.saturating_duration_since(last);
                if idle >= hang {
                    stalled.push((last, step, i));
                    max_idle = max_idle.max(idle);
                }
            }
        }
        // The first to stop first: the oldest heartbeat, then the lowest step (stalls of a
        // synchronous job often fall in one tick; the lowest index was named before).
        stalled.sort();
        (!stalled.is_empty()).then(|| (stalled.into_iter().map(|(_, _, i)| i).collect(), max_idle))
    }

    /// Stops every worker: `sig` to each group, `grace` for them to exit, then SIGKILL.
    async fn stop(&mut self, sig: Signal, grace: Duration, signals: &mut Signals) {
        let was = self.state;
        if !matches!(was, WorkerGroupState::Failed | WorkerGroupState::Unhealthy) {
            self.state = WorkerGroupState::Stopped;
        }
        // Exits already reaped but not yet recorded first: their groups may be empty, and an
        // empty group's id free for an unrelated group to take.
        while let Ok((idx, status, at)) = self.exits.try_recv() {
            self.record_exit(idx, status, at);
        }
        // Exited workers' groups are signalled too (what they started), unless already empty.
        self.release_gone();
        for s in &self.slots {
            s.process.signal_group(sig);
        }
        self.wait_out(sig, grace, signals).await;
        self.kill_leftovers();
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        while self.alive > 0 {
            tokio::select! {
                Some((idx, status, at)) = self.exits.recv() => {
                    self.record_exit(idx, status, at);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::error!(remaining = self.alive, "workers survive SIGKILL (uninterruptible sleep?): abandoning them");
                    break;
                }
            }
        }
        self.release_exited();
        self.watch_abandoned();
    }

    /// Workers that survived SIGKILL (uninterruptible sleep: a GPU driver, NFS) stay armed and
    /// watched by the guardian; once such a group is gone at last (its leader reaped by the
    /// runtime's orphan reaper), a thread of its own tells the guardian to forget it: its id may
    /// then go to an unrelated group, which the guardian would SIGKILL when rsrun exits.
    fn watch_abandoned(&self) {
        let Some(guardian) = self.ctx.guardian else { return };
        for s in self.slots.iter().filter(|s| s.exited.is_none() && s.process.is_armed()) {
            let pgid = s.process.pid();
            let Ok(g) = guardian.try_clone() else {
                warn!(pgid, "cannot follow an abandoned worker's group: the guardian keeps it until rsrun exits");
                continue;
            };
            let spawned = std::thread::Builder::new().name("rsrun-abandoned".into()).spawn(move || {
                while crate::worker::group_exists(pgid) {
                    std::thread::sleep(ABANDONED_POLL);
                }
                g.unwatch(pgid);
            });
            if let Err(err) = spawned {
                warn!(pgid, %err, "cannot follow an abandoned worker's group: the guardian keeps it until rsrun exits");
            }
        }
    }

    /// Whether a reaped worker's group still runs a process (what the worker started: a shell
    /// script's `python` without `exec`, an uploader it left behind).
    fn groups_running(&self) -> bool {
        let left: Vec<i32> = self
            .slots
            .iter()
            .filter(|s| s.exited.is_some() && s.process.is_armed() && s.process.group_exists())
            .map(|s| s.process.pid())
            .collect();
        // One scan of /proc for all of them (only once a group with a member is left).
        !left.is_empty() && crate::worker::any_group_running(&left)
    }

    /// The grace after `sig` went to the groups: until every worker and every process its group
    /// still runs exited (torchrun's grace is the leader's; here a worker's children get it too,
    /// instead of a SIGKILL the moment their shell exits), or `grace` ran out.
    async fn wait_out(&mut self, sig: Signal, grace: Duration, signals: &mut Signals) {
        let deadline = tokio::time::Instant::now() + grace;
        let mut poll = tokio::time::interval(GROUP_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.alive == 0 && !self.groups_running() {
                break;
            }
            tokio::select! {
                Some((idx, status, at)) = self.exits.recv() => {
                    self.record_exit(idx, status, at);
                }
                // Only what the workers started is left: its exit is seen by polling.
                _ = poll.tick(), if self.alive == 0 => {}
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(remaining = self.alive, grace = ?grace, "workers (or what they started) did not exit in time: SIGKILL");
                    break;
                }
                (s, action) = signals.recv() => match action {
                    // A stop signal is shutdown even while a failed (or ended) round is torn down: it
                    // is remembered (the round ends as `Signalled`, see `after_stop`) and reaches the
                    // workers, within the grace already running.
                    // After success only leftovers are waited for: a stop signal ends that at once.
                    SignalAction::Stop if self.state == WorkerGroupState::Succeeded => {
                        warn!(signal = %s, "stop signal while the workers' leftovers exit: SIGKILL now");
                        break;
                    }
                    SignalAction::Stop if self.signalled.is_none() => {
                        info!(signal = %s, "stop signal while stopping the workers: rsrun exits once they are stopped");
                        self.signalled = Some(s);
                        if s != sig {
                            self.signal_live(s);
                        }
                    }
                    SignalAction::Stop => {
                        warn!(signal = %s, "second stop signal: SIGKILL now");
                        break;
                    }
                    SignalAction::Forward => self.signal_live(s),
                    SignalAction::Ignore => info!(signal = %s, "signal ignored (--signal-policy)"),
                },
            }
        }
    }

    /// Releases the group of reaped worker `idx` when no process is left in it: from then on its id
    /// may be taken by an unrelated process group, which must never be signalled (by rsrun, by the
    /// drop, or by the guardian). A group that still has members (what the worker started) keeps its
    /// id, so it stays armed until the final SIGKILL.
    fn release_if_gone(&mut self, idx: usize) {
        let s = &mut self.slots[idx];
        if s.exited.is_some() && s.process.is_armed() && !s.process.group_exists() {
            if let Some(g) = self.ctx.guardian {
                g.unwatch(s.process.pid());
            }
            s.process.disarm();
        }
    }

    /// [`Group::release_if_gone`] for every worker (just before signalling the groups).
    fn release_gone(&mut self) {
        for i in 0..self.slots.len() {
            self.release_if_gone(i);
        }
    }

    /// Forgets the groups of exited (reaped) workers: the guardian stops watching them and dropping
    /// the group no longer signals them. A reaped leader's pid — its group id — may be reused by an
    /// unrelated process group, which must never be signalled. Call after the final SIGKILL.
    fn release_exited(&mut self) {
        for s in &mut self.slots {
            if s.exited.is_some() && s.process.is_armed() {
                if let Some(g) = self.ctx.guardian {
                    g.unwatch(s.process.pid());
                }
                s.process.disarm();
            }
        }
    }

    /// SIGKILL to every group: what is left of exited workers (their children) and anything alive.
    fn kill_leftovers(&mut self) {
        self.release_gone();
        for s in &mut self.slots {
            s.process.signal_group(Signal::SIGKILL);
        }
        // What the workers started outside their groups (`setsid`, a daemon's double fork) and
        // left behind: rsrun adopted it (its subreaper), and it goes too.
        let workers: Vec<i32> = self.slots.iter().filter(|s| s.exited.is_none()).map(|s| s.process.pid()).collect();
        let killed = crate::worker::kill_adopted(self.ctx.guardian.map_or(0, Guardian::pid), &workers);
        if !killed.is_empty() {
            warn!(pids = ?killed, "the workers left processes outside their process groups (setsid, a daemon): killed");
        }
    }

    /// The failure list: the root cause first, then the other failed or stopped workers. `causes` is
    /// the first failure seen, or the stalled workers of a hang (`hang_idle`). The error files are
    /// read first ([`Group::read_error_files`]); a failure's root cause is chosen by their timestamps
    /// ([`Group::root_cause`]).
    async fn failures(&self, causes: &[usize], hang_idle: Option<Duration>) -> (WorkerFailure, Vec<WorkerFailure>) {
        let errors = self.read_error_files().await;
        let mut roots = causes.to_vec();
        if hang_idle.is_none()
            && let Some(&first) = causes.first()
        {
            let root = self.root_cause(first, &errors);
            if root != first {
                info!(rank = self.slots[root].rank, first = self.slots[first].rank, "root cause: the earliest error file, not the first exit");
                roots = vec![root];
            }
        }
        self.build_failures(&roots, causes, hang_idle, &errors)
    }

    /// torchrun's root cause: the smallest error-file timestamp (torchrun.md §4.4), among the first
    /// failure seen and the other workers that failed, counting only files written no later than
    /// that first exit (a later one is a consequence of it: its whole-second timestamp can still
    /// equal the exit's second, so the file's own modification time decides). A worker that rsrun
    /// stopped counts too when its file came first: it raised and wrote it, then hung in its
    /// teardown (an NCCL destructor) until the stop, while another rank's exit was seen first.
    /// Without any, the first failure seen. Ties go to the earlier exit.
    fn root_cause(&self, first: usize, errors: &[Option<ErrorFileInfo>]) -> usize {
        let Some((_, first_at)) = self.slots[first].exited else { return first };
        self.slots
            .iter()
            .enumerate()
            .filter(|(i, s)| *i == first || s.exited.as_ref().is_some_and(|(k, _)| !matches!(k, ExitKind::Code(0))))
            .filter_map(|(i, s)| {
                let info = errors.get(i)?.as_ref()?;
                let ts = info.timestamp?;
                let at = s.exited.as_ref().map(|(_, at)| *at);
                let before = i == first || (ts <= first_at && info.written.is_none_or(|w| w <= first_at));
                before.then_some((ts, at, i))
            })
            .min()
            .map_or(first, |(_, _, i)| i)
    }

    /// Every failed worker's error file (`None` for the others), read on a thread of its own: the
    /// worker controls the file and the log directory may be on a network file system, so the read
    /// must not stall the runtime, which also serves rsrun's signals and the other pipes. Waited for
    /// up to [`ERROR_FILE_WAIT`]; the report goes without the files after that.
    async fn read_error_files(&self) -> Vec<Option<ErrorFileInfo>> {
        let n = self.slots.len();
        let paths: Vec<Option<PathBuf>> = self
            .slots
            .iter()
            .map(|s| s.error_file.clone().filter(|_| !matches!(s.exited, Some((ExitKind::Code(0), _)))))
            .collect();
        if paths.iter().all(Option::is_none) {
            return vec![None; n];
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let read = move || {
            let errors: Vec<Option<ErrorFileInfo>> = paths.iter().map(|p| p.as_deref().and_then(read_error_file)).collect();
            let _ = tx.send(errors);
        };
        if let Err(err) = std::thread::Builder::new().name("error-files".into()).spawn(read) {
            warn!(%err, "no thread to read the workers' error files: the report goes without them");
            return vec![None; n];
        }
        match tokio::time::timeout(ERROR_FILE_WAIT, rx).await {
            Ok(Ok(errors)) => errors,
            _ => {
                warn!(wait = ?ERROR_FILE_WAIT, "the workers' error files were not read in time: the report goes without them");
                vec![None; n]
            }
        }
    }

    /// The failure list: `roots[0]` first (then the other `roots`), then the other failed or stopped
    /// workers. `causes` failed on their own; the others that ended by SIGTERM or SIGKILL were
    /// stopped by rsrun.
    fn build_failures(
        &self,
        roots: &[usize],
        causes: &[usize],
        hang_idle: Option<Duration>,
        errors: &[Option<ErrorFileInfo>],
    ) -> (WorkerFailure, Vec<WorkerFailure>) {
        let build = |i: usize, is_root: bool| -> WorkerFailure {
            let s = &self.slots[i];
            let (mut exit, time) = s.exited.clone().unwrap_or((ExitKind::Other, SystemTime::now()));
            if is_root && let Some(idle) = hang_idle {
                let last = *s.progress.last.lock().unwrap_or_else(|e| e.into_inner());
                // Each stalled worker's own idle time (up to when the stall was seen).
                let own = last.zip(self.stall_seen_at).map(|((at, _), seen)| seen.saturating_duration_since(at));
                exit = ExitKind::Hang { idle: own.unwrap_or(idle), last_step: last.map_or(0, |(_, st)| st) };
            }
            WorkerFailure {
                rank: Some(s.rank),
                local_rank: Some(s.local_rank),
                node_id: self.ctx.assignment.node_id.clone(),
                hostname: self.ctx.plan.hostname.clone(),
                pid: s.process.pid(),
                exit,
                time,
                error: errors.get(i).cloned().flatten(),
                error_file: s.error_file.clone(),
                stderr_tail: s.tail.lock().unwrap_or_else(|e| e.into_inner()).lines(),
                message: None,
                // A worker that ended by SIGTERM/SIGKILL after the root cause was stopped by rsrun; one that
                // exited on its own meanwhile (a peer noticing the failure) is listed with its own code.
                stopped_by_rsrun: !is_root && !causes.contains(&i) && s.exited.as_ref().is_some_and(|(k, _)| ended_by_a_stop(k)),
            }
        };
        let root = build(roots[0], true);
        let mut others: Vec<WorkerFailure> = roots[1..].iter().map(|&i| build(i, true)).collect();
        for (i, s) in self.slots.iter().enumerate() {
            if roots.contains(&i) {
                continue;
            }
            match &s.exited {
                Some((ExitKind::Code(0), _)) => {}
                _ => others.push(build(i, false)),
            }
        }
        (root, others)
    }

    /// Lets the log pumps reach EOF (bounded), so the last lines are out before any report. A pipe
    /// still open after [`DRAIN_WAIT`] (a process that left the worker's group holds it) keeps being
    /// copied to its log file by its pump, detached; only the console stops getting its lines.
    async fn drain(&mut self) {
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        while !self.pumps.is_empty() {
            tokio::select! {
                _ = self.pumps.join_next() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    debug!(pipes = self.pumps.len(), "log pipes still open after the group ended: to the log files only from now on");
                    self.quiet.cancel();
                    self.pumps.detach_all();
                    return;
                }
            }
        }
    }

    /// For a group that failed to start: drain and list what was started.
    async fn finish(&mut self) -> Vec<WorkerFailure> {
        self.drain().await;
        if self.slots.is_empty() {
            return Vec::new();
        }
        let errors = self.read_error_files().await;
        let (first, mut rest) = self.build_failures(&[0], &[], None, &errors);
        let mut all = vec![WorkerFailure { stopped_by_rsrun: true, ..first }];
        all.append(&mut rest);
        all
    }
}

/// The SIGTERM or SIGKILL of a stop.
fn ended_by_a_stop(kind: &ExitKind) -> bool {
    matches!(kind, ExitKind::Signal(s) if *s == libc::SIGTERM || *s == libc::SIGKILL)
}

/// Creates `dir` and its missing parents as this user's only (0700, as torchrun's mkdtemp log
/// directory): the workers' output and error files (tracebacks, values of variables) are not
/// for other users of the machine. Directories that exist keep their mode.
fn create_private_dirs(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// The files of one worker's log directory.
const WORKER_FILES: [&str; 3] = ["stdout.log", "stderr.log", "error.json"];

/// How many earlier runs' files a worker's log directory keeps: a job id re-run in a loop (a sweep
/// script) must not fill the disk.
const KEPT_EARLIER_RUNS: u32 = 16;

/// Renames the files an earlier run left in a worker's log directory to `NAME.N`, N one more than
/// the highest an earlier run is kept under (1 for the first), so that this run's files start
/// empty and every earlier run's stay together; then removes the runs older than the latest
/// [`KEPT_EARLIER_RUNS`]. Returns that N, or `None` when there was nothing to keep.
fn set_aside_earlier_run(dir: &std::path::Path) -> std::io::Result<Option<u32>> {
    let present: Vec<&str> = WORKER_FILES.into_iter().filter(|f| dir.join(f).symlink_metadata().is_ok()).collect();
    if present.is_empty() {
        return Ok(None);
    }
    // The numbers earlier runs are kept under, from one read of the directory.
    let mut kept = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let number = WORKER_FILES.iter().find_map(|f| name.strip_prefix(f)?.strip_prefix('.')?.parse::<u32>().ok());
        kept.extend(number);
    }
    let Some(n) = kept.last().map_or(Some(1), |m| m.checked_add(1)) else {
        return Err(std::io::Error::other("no free NAME.N to keep an earlier run's logs under"));
    };
    for f in present {
        std::fs::rename(dir.join(f), dir.join(format!("{f}.{n}")))?;
    }
    for old in kept.range(..=n.saturating_sub(KEPT_EARLIER_RUNS)) {
        for f in WORKER_FILES {
            match std::fs::remove_file(dir.join(format!("{f}.{old}"))) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
    }
    Ok(Some(n))
}

#[derive(Debug, Default)]
struct DupFiles {
    stdout: Option<DuplicateSink>,
    stderr: Option<DuplicateSink>,
}

fn open_dup_files(plan: &LaunchPlan, a: &RoundAssignment) -> DupFiles {
    let Some(dir) = plan.logs.attempt_dir(&plan.job_id, a.round) else { return DupFiles::default() };
    let open = |needles: &Vec<String>, name: &str| {
        if needles.is_empty() {
            return None;
        }
        create_private_dirs(&dir).ok()?;
        // Agents of one node (one job, one round) share this file: it is appended to, never
        // truncated, and each line goes in one write (`logs::keep_line`), so their lines never mix.
        let path = dir.join(name);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .inspect_err(|err| tracing::warn!(path = %path.display(), %err, "cannot open the filtered log file {}: {err}; continuing without it", path.display()))
            .ok()?;
        Some((Arc::new(needles.clone()), Arc::new(tokio::sync::Mutex::new(LogFile::new(f, path)))))
    };
    DupFiles {
        stdout: open(&plan.logs.dup_stdout, "filtered_stdout.log"),
        stderr: open(&plan.logs.dup_stderr, "filtered_stderr.log"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::{host, parse};
    use crate::worker::Guardian;

    fn assignment(nproc: u32) -> RoundAssignment {
        RoundAssignment {
            round: 0,
            node_rank: 0,
            num_nodes: 1,
            rank_offset: 0,
            local_world_size: nproc,
            world_size: nproc,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            agent_store: false,
            restart_count: 0,
            max_restarts: 0,
            node_id: "n0".into(),
            rdzv_endpoint: None,
        }
    }

    /// Runs one round of `sh -c script` with 3 workers; returns the outcome, whether any group is
    /// still armed, and what the guardian was told.
    async fn round(script: &str) -> (GroupOutcome, bool, String, Option<WorkerFailure>) {
        let args = parse(&["--nproc-per-node", "3", "--log-dir", "/dev/null", "--shutdown-timeout", "1", "--no-python", "sh", "-c", script]);
        let plan = LaunchPlan::resolve(&args, &host()).unwrap();
        let a = assignment(3);
        let (console, mut rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let record = tempfile::NamedTempFile::new().unwrap();
        let guardian = Guardian::recording(record.reopen().unwrap());
        let (early_tx, mut early_rx) = mpsc::unbounded_channel();
        let ctx = GroupContext {
            plan: &plan,
            assignment: &a,
            console: &console,
            console_modes: ConsoleModes::PLAIN,
            guardian: Some(&guardian),
            first_failure: Some(&early_tx),
        };
        let Ok(mut group) = Group::start(&ctx) else { panic!("workers did not start") };
        let mut signals = Signals::none();
        let outcome = match group.monitor(&mut signals, std::future::pending::<RoundEndCause>(), &CancellationToken::new()).await {
            Ended::Done(outcome) => outcome,
            Ended::Failed { causes, hang_idle } => {
                let (root, others) = group.failures(&causes, hang_idle).await;
                GroupOutcome::Failed { root: Box::new(root), others, hang: hang_idle.is_some() }
            }
        };
        let armed = group.slots.iter().any(|s| s.process.is_armed());
        drop(group);
        (outcome, armed, std::fs::read_to_string(record.path()).unwrap(), early_rx.try_recv().ok())
    }

    fn balanced(told: &str) {
        let added: Vec<&str> = told.lines().filter_map(|l| l.strip_prefix('+')).collect();
        let removed: Vec<&str> = told.lines().filter_map(|l| l.strip_prefix('-')).collect();
        assert_eq!(added.len(), 3, "{told}");
        for pid in added {
            assert!(removed.contains(&pid), "group {pid} is still watched by the guardian:\n{told}");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn success_releases_every_reaped_group() {
        let (outcome, armed, told, early) = round("exit 0").await;
        assert!(matches!(outcome, GroupOutcome::Succeeded), "{outcome:?}");
        assert!(early.is_none(), "{early:?}");
        assert!(!armed, "a reaped worker's group id would be SIGKILLed on drop");
        balanced(&told);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn failure_releases_every_reaped_group() {
        let (outcome, armed, told, early) = round("if [ $LOCAL_RANK = 1 ]; then exit 3; fi; sleep 30").await;
        let GroupOutcome::Failed { root, .. } = &outcome else { panic!("{outcome:?}") };
        // The first failure went out before the group was stopped, as the same failure.
        let early = early.expect("the first failure, sent before the teardown");
        assert_eq!((early.local_rank, &early.exit, early.time), (Some(1), &ExitKind::Code(3), root.time));
        assert!(!armed);
        balanced(&told);
    }

    /// The plan of `sh -c script` with `nproc` workers and `extra` options.
    fn plan_of(nproc: u32, extra: &[&str], script: &str) -> LaunchPlan {
        let n = nproc.to_string();
        let mut argv = vec!["--nproc-per-node", n.as_str()];
        argv.extend_from_slice(extra);
        argv.extend(["--no-python", "sh", "-c", script]);
        LaunchPlan::resolve(&parse(&argv), &host()).unwrap()
    }

    /// Runs a whole round of `plan` (`run_group`) with `signals` and `stop`.
    async fn run_round(plan: &LaunchPlan, signals: &mut Signals, stop: impl Future<Output = RoundEndCause>) -> GroupOutcome {
        let a = assignment(plan.nproc_per_node);
        let (console, mut rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let ctx = GroupContext { plan, assignment: &a, console: &console, console_modes: ConsoleModes::PLAIN, guardian: None, first_failure: None };
        run_group(&ctx, signals, stop, &CancellationToken::new()).await
    }

    /// Waits until every path exists.
    async fn exist(paths: &[PathBuf]) {
        while !paths.iter().all(|p| p.exists()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Injects SIGTERM (`stop`) into `signals` once `paths` exist, `after` later.
    fn sigterm_once(signals: &Signals, paths: Vec<PathBuf>, after: Duration) {
        let injector = signals.injector();
        tokio::spawn(async move {
            exist(&paths).await;
            tokio::time::sleep(after).await;
            injector.inject(Signal::SIGTERM, SignalAction::Stop);
        });
    }

    /// A stop signal while the group is torn down after a failure is shutdown, not a failure to
    /// restart from (torchrun.md §4.5).
    #[tokio::test(flavor = "current_thread")]
    async fn stop_signal_during_failure_teardown_ends_as_signalled() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        // Rank 0 ignores SIGTERM, so the teardown after rank 1's failure waits out the grace.
        let script = format!(
            "if [ $LOCAL_RANK = 1 ]; then while [ ! -f {d}/ready ]; do sleep 0.02; done; touch {d}/failing; exit 3; fi; \
             trap '' TERM; touch {d}/ready; while true; do sleep 0.05; done"
        );
        let plan = plan_of(2, &["--log-dir", "/dev/null", "--shutdown-timeout", "2"], &script);
        let mut signals = Signals::none();
        sigterm_once(&signals, vec![dir.path().join("failing")], Duration::from_millis(400));
        let outcome = run_round(&plan, &mut signals, std::future::pending::<RoundEndCause>()).await;
        assert!(matches!(outcome, GroupOutcome::Signalled(Signal::SIGTERM)), "{outcome:?}");
    }

    /// What a worker started gets the stop's grace too, not a SIGKILL the moment the worker
    /// itself exits: a shell script that runs `python train.py` without `exec` dies at once on
    /// SIGTERM, while its python checkpoints. On success, what workers left running gets
    /// SIGTERM and the grace as well.
    #[tokio::test(flavor = "current_thread")]
    async fn what_a_worker_started_gets_the_grace_too() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!(
            "if [ $LOCAL_RANK = 1 ]; then while [ ! -f {d}/ready ]; do sleep 0.02; done; exit 3; fi; \
             sh -c 'trap \"sleep 0.3; touch {d}/child_done; exit 0\" TERM; touch {d}/ready; while true; do sleep 0.05; done' & wait"
        );
        let plan = plan_of(2, &["--log-dir", "/dev/null", "--shutdown-timeout", "10"], &script);
        let t0 = std::time::Instant::now();
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        assert!(matches!(outcome, GroupOutcome::Failed { .. }), "{outcome:?}");
        assert!(dir.path().join("child_done").exists(), "the worker's child was killed before its SIGTERM handler ran");
        assert!(t0.elapsed() < Duration::from_secs(8), "the grace ran out instead of ending with the child: {:?}", t0.elapsed());

        let script = format!("sh -c 'trap \"touch {d}/bg_done_$LOCAL_RANK; exit 0\" TERM; while true; do sleep 0.05; done' & sleep 0.2; exit 0");
        let plan = plan_of(2, &["--log-dir", "/dev/null", "--shutdown-timeout", "10"], &script);
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        assert!(matches!(outcome, GroupOutcome::Succeeded), "{outcome:?}");
        for r in 0..2 {
            assert!(dir.path().join(format!("bg_done_{r}")).exists(), "rank {r}'s leftover got SIGKILL without a SIGTERM");
        }
    }

    /// The same while the group is stopped because the round ended elsewhere.
    #[tokio::test(flavor = "current_thread")]
    async fn stop_signal_while_an_ended_round_is_stopped_ends_as_signalled() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let script = format!("trap '' TERM; touch {d}/ready.$LOCAL_RANK; while true; do sleep 0.05; done");
        let plan = plan_of(2, &["--log-dir", "/dev/null", "--shutdown-timeout", "2"], &script);
        let ready = vec![dir.path().join("ready.0"), dir.path().join("ready.1")];
        let mut signals = Signals::none();
        sigterm_once(&signals, ready.clone(), Duration::from_millis(400));
        let ended = async move {
            exist(&ready).await;
            RoundEndCause::from("round 0 ended elsewhere".to_owned())
        };
        let outcome = run_round(&plan, &mut signals, ended).await;
        assert!(matches!(outcome, GroupOutcome::Signalled(Signal::SIGTERM)), "{outcome:?}");
    }

    /// The report's stderr tail is taken once the pipe is drained: the last line of a worker that
    /// wrote a lot just before it failed is in it.
    #[tokio::test(flavor = "current_thread")]
    async fn failure_tail_is_taken_after_the_pipes_are_drained() {
        let script = "yes 'a line of a long traceback, written just before the failure' | head -n 8000 >&2; echo LAST-LINE >&2; exit 1";
        let plan = plan_of(1, &["--log-dir", "/dev/null", "--shutdown-timeout", "1"], script);
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        let GroupOutcome::Failed { root, .. } = outcome else { panic!("{outcome:?}") };
        assert_eq!(root.exit, ExitKind::Code(1));
        assert_eq!(root.stderr_tail.last().map(String::as_str), Some("LAST-LINE"), "{:?}", root.stderr_tail);
    }

    /// torchrun's root cause is the smallest error-file timestamp: a worker that wrote its error
    /// file before a peer's bare exit is the cause, though it exits later.
    #[tokio::test(flavor = "current_thread")]
    async fn root_cause_is_the_earliest_error_file() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().display().to_string();
        let script = r#"if [ $RANK = 0 ]; then trap '' TERM; printf '{"message": {"message": "RuntimeError: first", "extraInfo": {"py_callstack": "tb", "timestamp": "%s"}}}' "$(date +%s)" > "$TORCHELASTIC_ERROR_FILE.tmp"; mv "$TORCHELASTIC_ERROR_FILE.tmp" "$TORCHELASTIC_ERROR_FILE"; sleep 1; exit 1; fi; while [ ! -f "${TORCHELASTIC_ERROR_FILE%/1/error.json}/0/error.json" ]; do sleep 0.01; done; exit 1"#;
        let plan = plan_of(2, &["--log-dir", &logs, "--shutdown-timeout", "10"], script);
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        let GroupOutcome::Failed { root, others, hang } = outcome else { panic!("{outcome:?}") };
        assert!(!hang);
        assert_eq!(root.rank, Some(0), "{root:?}");
        assert_eq!(root.exit, ExitKind::Code(1));
        assert_eq!(root.error.as_ref().map(|e| e.message.as_str()), Some("RuntimeError: first"));
        assert_eq!(others.len(), 1, "{others:?}");
        assert_eq!((others[0].rank, &others[0].exit, others[0].stopped_by_rsrun), (Some(1), &ExitKind::Code(1), false));
    }

    /// A worker that wrote its error file, then hung in its teardown (an NCCL destructor) until
    /// rsrun's SIGTERM, is the root cause when its file came before a peer's exit: its exception
    /// is in the report, not only the peer's bare abort.
    #[tokio::test(flavor = "current_thread")]
    async fn a_worker_stopped_after_writing_its_error_file_first_is_the_root_cause() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().display().to_string();
        // Rank 0 raises (its file at once) and hangs; rank 1 aborts 2.5 s later without a file.
        let script = r#"if [ $RANK = 0 ]; then printf '{"message": {"message": "ValueError: the real bug", "extraInfo": {"py_callstack": "tb", "timestamp": "%s"}}}' "$(date +%s)" > "$TORCHELASTIC_ERROR_FILE.tmp"; mv "$TORCHELASTIC_ERROR_FILE.tmp" "$TORCHELASTIC_ERROR_FILE"; exec sleep 30; fi; sleep 2.5; kill -ABRT $$"#;
        let plan = plan_of(2, &["--log-dir", &logs, "--shutdown-timeout", "2"], script);
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        let GroupOutcome::Failed { root, others, .. } = outcome else { panic!("{outcome:?}") };
        assert_eq!(root.rank, Some(0), "{root:?}");
        assert_eq!(root.exit, ExitKind::Signal(libc::SIGTERM));
        assert!(!root.stopped_by_rsrun, "{root:?}");
        assert_eq!(root.error.as_ref().map(|e| e.message.as_str()), Some("ValueError: the real bug"));
        assert_eq!((others.len(), others[0].rank, &others[0].exit), (1, Some(1), &ExitKind::Signal(libc::SIGABRT)), "{others:?}");
    }

    /// An error file written after the first failure's exit is its consequence, though its
    /// whole-second timestamp may equal that exit's second: the bare exit stays the root cause.
    #[tokio::test(flavor = "current_thread")]
    async fn an_error_file_written_after_the_first_exit_is_not_the_root_cause() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().display().to_string();
        let marker = dir.path().join("rank1-exiting");
        // Rank 1 dies at once without an error file (as a segfault would). Rank 0, blocked in a
        // "collective", sees it go, then writes its error file (its @record) and exits 1.
        let script = format!(
            r#"if [ $RANK = 1 ]; then touch {m}; exit 3; fi; trap '' TERM; while [ ! -f {m} ]; do sleep 0.01; done; sleep 0.2; printf '{{"message": {{"message": "RuntimeError: connection reset by peer", "extraInfo": {{"py_callstack": "tb", "timestamp": "%s"}}}}}}' "$(date +%s)" > "$TORCHELASTIC_ERROR_FILE"; exit 1"#,
            m = marker.display()
        );
        let plan = plan_of(2, &["--log-dir", &logs, "--shutdown-timeout", "10"], &script);
        let outcome = run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()).await;
        let GroupOutcome::Failed { root, others, .. } = outcome else { panic!("{outcome:?}") };
        assert_eq!((root.rank, &root.exit), (Some(1), &ExitKind::Code(3)), "{root:?}");
        assert_eq!(others.len(), 1, "{others:?}");
        assert_eq!(others[0].rank, Some(0), "{others:?}");
    }

    /// A worker that makes its error file a FIFO gets a clear report, not a launcher stuck in
    /// open(2) (the round runs on a thread of its own so that the test fails instead of hanging).
    #[test]
    fn error_file_fifo_does_not_block_the_report() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().display().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let plan = plan_of(1, &["--log-dir", &logs, "--shutdown-timeout", "1"], r#"mkfifo "$TORCHELASTIC_ERROR_FILE"; exit 1"#);
            let outcome = rt.block_on(run_round(&plan, &mut Signals::none(), std::future::pending::<RoundEndCause>()));
            let _ = tx.send(outcome);
        });
        let outcome = rx.recv_timeout(Duration::from_secs(20)).expect("the round did not end: blocked on the error file");
        let GroupOutcome::Failed { root, .. } = outcome else { panic!("{outcome:?}") };
        let msg = root.error.as_ref().map(|e| e.message.clone()).unwrap_or_default();
        assert!(msg.contains("not read") && msg.contains("FIFO"), "{msg}");
    }

    /// A reaped worker whose group is empty is released at once: its id may be reused by an unrelated
    /// group while the others are still being stopped.
    #[tokio::test(flavor = "current_thread")]
    async fn an_empty_group_is_released_when_its_exit_is_recorded() {
        let args = parse(&["--nproc-per-node", "3", "--log-dir", "/dev/null", "--no-python", "sh", "-c", "if [ $LOCAL_RANK = 1 ]; then exit 3; fi; sleep 30"]);
        let plan = LaunchPlan::resolve(&args, &host()).unwrap();
        let a = assignment(3);
        let (console, mut rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let record = tempfile::NamedTempFile::new().unwrap();
        let guardian = Guardian::recording(record.reopen().unwrap());
        let ctx = GroupContext { plan: &plan, assignment: &a, console: &console, console_modes: ConsoleModes::PLAIN, guardian: Some(&guardian), first_failure: None };
        let Ok(mut group) = Group::start(&ctx) else { panic!("workers did not start") };
        let (idx, status, at) = group.exits.recv().await.unwrap();
        assert_eq!(group.slots[idx].local_rank, 1);
        let pid = group.slots[idx].process.pid();
        assert_eq!(group.record_exit(idx, status, at), Some(ExitKind::Code(3)));
        assert!(!group.slots[idx].process.is_armed(), "an empty group's id would still be signalled");
        assert!(std::fs::read_to_string(record.path()).unwrap().lines().any(|l| l == format!("-{pid}")));
        assert!(group.slots.iter().filter(|s| s.exited.is_none()).all(|s| s.process.is_armed()));
        drop(group);
    }

    /// Agents of one node share the attempt's filtered files: a second open keeps the first's lines.
    #[tokio::test(flavor = "current_thread")]
    async fn filtered_files_are_appended_not_truncated() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().display().to_string();
        let plan = plan_of(1, &["--log-dir", &logs, "--duplicate-stdout-filters", "loss"], "true");
        let a = assignment(1);
        let first = open_dup_files(&plan, &a);
        let (_, file) = first.stdout.expect("the filtered file of the first agent");
        let mut f = file.lock().await;
        f.write(b"agent 0: loss=1\n").await;
        f.flush().await;
        drop(f);
        let second = open_dup_files(&plan, &a);
        let (_, file2) = second.stdout.expect("the filtered file of the second agent");
        let mut f = file2.lock().await;
        f.write(b"agent 1: loss=2\n").await;
        f.flush().await;
        drop(f);
        let path = plan.logs.attempt_dir(&plan.job_id, 0).unwrap().join("filtered_stdout.log");
        assert_eq!(std::fs::read_to_string(path).unwrap(), "agent 0: loss=1\nagent 1: loss=2\n");
    }

    /// A re-run of a job id whose rounds count from 1 again keeps the earlier run's files.
    #[test]
    fn an_earlier_runs_worker_files_are_kept_under_a_number() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        assert_eq!(set_aside_earlier_run(dir).unwrap(), None);
        std::fs::write(dir.join("stdout.log"), "run 1").unwrap();
        std::fs::write(dir.join("error.json"), "{}").unwrap();
        assert_eq!(set_aside_earlier_run(dir).unwrap(), Some(1));
        assert!(!dir.join("stdout.log").exists() && !dir.join("error.json").exists());
        std::fs::write(dir.join("stdout.log"), "run 2").unwrap();
        std::fs::write(dir.join("stderr.log"), "run 2 err").unwrap();
        // stderr.log.1 is free, but N names a whole earlier run: run 2 is 2.
        assert_eq!(set_aside_earlier_run(dir).unwrap(), Some(2));
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log.1")).unwrap(), "run 1");
        assert_eq!(std::fs::read_to_string(dir.join("error.json.1")).unwrap(), "{}");
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log.2")).unwrap(), "run 2");
        assert_eq!(std::fs::read_to_string(dir.join("stderr.log.2")).unwrap(), "run 2 err");
        assert!(!dir.join("stderr.log.1").exists());
        // Only the latest 16 earlier runs stay: run 18's files push out runs 1 and 2.
        for run in 3..=18 {
            std::fs::write(dir.join("stdout.log"), format!("run {run}")).unwrap();
            assert_eq!(set_aside_earlier_run(dir).unwrap(), Some(run));
        }
        for gone in ["stdout.log.1", "error.json.1", "stdout.log.2", "stderr.log.2"] {
            assert!(!dir.join(gone).exists(), "{gone}");
        }
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log.3")).unwrap(), "run 3");
        assert_eq!(std::fs::read_to_string(dir.join("stdout.log.18")).unwrap(), "run 18");
        // A number after a gap follows the highest, not the first free one.
        std::fs::write(dir.join("stdout.log"), "run 19").unwrap();
        assert_eq!(set_aside_earlier_run(dir).unwrap(), Some(19));
    }
}
