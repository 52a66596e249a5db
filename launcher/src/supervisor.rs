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
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::env::{RoundAssignment, worker_env};
use crate::logs::{ConsoleModes, ConsoleSink, ConsoleTx, DuplicateSink, SharedTail, StreamKind, StreamSink, Tail, pump};
use crate::plan::{LaunchPlan, expand_prefix};
use crate::report::{ExitKind, WorkerFailure, read_error_file};
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
}

/// Number of stderr lines kept per worker for the failure report.
const TAIL_LINES: usize = 20;
/// After SIGKILL, how long to wait for the kernel to reap before giving up on a worker.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// After the group ended, how long the log pumps get to drain the pipes.
const DRAIN_WAIT: Duration = Duration::from_secs(2);

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
    state: WorkerGroupState,
}

/// Runs one round of this node's workers until they succeed, fail, or `stop` / a signal /
/// `cancel` ends the round.
pub async fn run_group(
    ctx: &GroupContext<'_>,
    signals: &mut Signals,
    stop: impl Future<Output = String>,
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
                return GroupOutcome::Failed { root: Box::new(failure), others, hang: false };
            }
        };
        let outcome = group.monitor(signals, stop, cancel).await;
        group.drain().await;
        outcome
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
            state: WorkerGroupState::Init,
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
                std::fs::create_dir_all(dir).map_err(log_err)?;
                let error_file = dir.join("error.json");
                // A stale error file from an earlier run must not be taken for this worker's.
                let _ = std::fs::remove_file(&error_file);
                (
                    Some(std::fs::File::create(dir.join("stdout.log")).map_err(log_err)?),
                    Some(std::fs::File::create(dir.join("stderr.log")).map_err(log_err)?),
                    Some(error_file),
                )
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
            })
        };
        let out_sink =
            StreamSink { file: out_file, console: console(1, StreamKind::Stdout), tail: None, duplicate: dup.stdout.clone() };
        let err_sink = StreamSink {
            file: err_file,
            console: console(2, StreamKind::Stderr),
            tail: Some(tail.clone()),
            duplicate: dup.stderr.clone(),
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
        stop: impl Future<Output = String>,
        cancel: &CancellationToken,
    ) -> GroupOutcome {
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
                    return GroupOutcome::Stopped("shutdown requested".into());
                }
                (sig, action) = signals.recv() => match action {
                    SignalAction::Stop => {
                        info!(signal = %sig, "stop signal: stopping workers");
                        self.stop(sig, grace, signals).await;
                        return GroupOutcome::Signalled(sig);
                    }
                    SignalAction::Forward => {
                        info!(signal = %sig, "forwarding signal to workers");
                        for s in self.slots.iter().filter(|s| s.exited.is_none()) {
                            s.process.signal_group(sig);
                        }
                    }
                    SignalAction::Ignore => info!(signal = %sig, "signal ignored (--signal-policy)"),
                },
                reason = &mut stop => {
                    info!(%reason, "round ended elsewhere: stopping workers");
                    self.stop(Signal::SIGTERM, grace, signals).await;
                    return GroupOutcome::Stopped(reason);
                }
                Some((idx, status, at)) = self.exits.recv() => {
                    let kind = self.record_exit(idx, status, at);
                    if let Some(kind) = kind {
                        let root_idx = idx;
                        info!(rank = self.slots[idx].rank, exit = ?kind, "worker failed: stopping the group");
                        self.state = WorkerGroupState::Failed;
                        self.stop(Signal::SIGTERM, grace, signals).await;
                        let (root, others) = self.failures(&[root_idx], None);
                        return GroupOutcome::Failed { root: Box::new(root), others, hang: false };
                    }
                    if self.alive == 0 {
                        self.state = WorkerGroupState::Succeeded;
                        info!("worker group SUCCEEDED");
                        self.kill_leftovers();
                        // Every leader is reaped: its group id may be reused from now on.
                        self.release_exited();
                        return GroupOutcome::Succeeded;
                    }
                }
                _ = tick.tick(), if plan.timeouts.hang.is_some() => {
                    if let Some((stalled, idle)) = self.stalled() {
                        self.state = WorkerGroupState::Unhealthy;
                        let ranks: Vec<u32> = stalled.iter().map(|&i| self.slots[i].rank).collect();
                        info!(?ranks, "no progress: worker group UNHEALTHY");
                        self.stop(Signal::SIGTERM, grace, signals).await;
                        let (root, others) = self.failures(&stalled, Some(idle));
                        return GroupOutcome::Failed { root: Box::new(root), others, hang: true };
                    }
                }
            }
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
            if let Some((last, _)) = *s.progress.last.lock().unwrap_or_else(|e| e.into_inner()) {
                let idle = now.saturating_duration_since(last);
                if idle >= hang {
                    stalled.push(i);
                    max_idle = max_idle.max(idle);
                }
            }
        }
        (!stalled.is_empty()).then_some((stalled, max_idle))
    }

    /// Stops every worker: `sig` to each group, `grace` for them to exit, then SIGKILL.
    async fn stop(&mut self, sig: Signal, grace: Duration, signals: &mut Signals) {
        let was = self.state;
        if !matches!(was, WorkerGroupState::Failed | WorkerGroupState::Unhealthy) {
            self.state = WorkerGroupState::Stopped;
        }
        for s in &self.slots {
            s.process.signal_group(sig);
        }
        let deadline = tokio::time::Instant::now() + grace;
        while self.alive > 0 {
            tokio::select! {
                Some((idx, status, at)) = self.exits.recv() => {
                    self.record_exit(idx, status, at);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    warn!(remaining = self.alive, grace = ?grace, "workers did not exit in time: SIGKILL");
                    break;
                }
                (s, action) = signals.recv() => {
                    if action == SignalAction::Stop {
                        warn!(signal = %s, "second stop signal: SIGKILL now");
                        break;
                    }
                }
            }
        }
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
        for s in &mut self.slots {
            s.process.signal_group(Signal::SIGKILL);
        }
    }

    /// The failure list: `root_idxs[0]` first, then the other failed or stopped workers.
    fn failures(&self, root_idxs: &[usize], hang_idle: Option<Duration>) -> (WorkerFailure, Vec<WorkerFailure>) {
        let build = |i: usize, is_cause: bool| -> WorkerFailure {
            let s = &self.slots[i];
            let (mut exit, time) = s.exited.clone().unwrap_or((ExitKind::Other, SystemTime::now()));
            if is_cause && let Some(idle) = hang_idle {
                let step = s.progress.last.lock().unwrap_or_else(|e| e.into_inner()).map(|(_, st)| st).unwrap_or(0);
                exit = ExitKind::Hang { idle, last_step: step };
            }
            WorkerFailure {
                rank: Some(s.rank),
                local_rank: Some(s.local_rank),
                node_id: self.ctx.assignment.node_id.clone(),
                hostname: self.ctx.plan.hostname.clone(),
                pid: s.process.pid(),
                exit,
                time,
                error: s.error_file.as_deref().and_then(read_error_file),
                error_file: s.error_file.clone(),
                stderr_tail: s.tail.lock().unwrap_or_else(|e| e.into_inner()).lines(),
                message: None,
                // A worker that ended by SIGTERM/SIGKILL after the root cause was stopped by rsrun; one that
                // exited on its own meanwhile (a peer noticing the failure) is listed with its own code.
                stopped_by_rsrun: !is_cause
                    && matches!(exit_kind_of(s), Some(ExitKind::Signal(sig)) if sig == libc::SIGTERM || sig == libc::SIGKILL),
            }
        };
        let root = build(root_idxs[0], true);
        let mut others: Vec<WorkerFailure> = root_idxs[1..].iter().map(|&i| build(i, true)).collect();
        for (i, s) in self.slots.iter().enumerate() {
            if root_idxs.contains(&i) {
                continue;
            }
            match &s.exited {
                Some((ExitKind::Code(0), _)) => {}
                _ => others.push(build(i, false)),
            }
        }
        (root, others)
    }

    /// Lets the log pumps reach EOF (bounded), so the last lines are out before any report.
    async fn drain(&mut self) {
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        while !self.pumps.is_empty() {
            tokio::select! {
                _ = self.pumps.join_next() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    debug!("log pipes still open after the group ended; dropping them");
                    break;
                }
            }
        }
        self.pumps.abort_all();
    }

    /// For a group that failed to start: drain and list what was started.
    async fn finish(&mut self) -> Vec<WorkerFailure> {
        self.drain().await;
        if self.slots.is_empty() {
            return Vec::new();
        }
        let idxs: Vec<usize> = (0..self.slots.len()).collect();
        let (first, mut rest) = self.failures(&idxs[..1], None);
        let mut all = vec![WorkerFailure { stopped_by_rsrun: true, ..first }];
        all.append(&mut rest);
        all
    }
}

fn exit_kind_of(s: &Slot) -> Option<ExitKind> {
    s.exited.as_ref().map(|(k, _)| k.clone())
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
        std::fs::create_dir_all(&dir).ok()?;
        let f = std::fs::File::create(dir.join(name)).ok()?;
        Some((Arc::new(needles.clone()), Arc::new(Mutex::new(f))))
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
    async fn round(script: &str) -> (GroupOutcome, bool, String) {
        let args = parse(&["--nproc-per-node", "3", "--log-dir", "/dev/null", "--shutdown-timeout", "1", "--no-python", "sh", "-c", script]);
        let plan = LaunchPlan::resolve(&args, &host()).unwrap();
        let a = assignment(3);
        let (console, mut rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let record = tempfile::NamedTempFile::new().unwrap();
        let guardian = Guardian::recording(record.reopen().unwrap());
        let ctx = GroupContext {
            plan: &plan,
            assignment: &a,
            console: &console,
            console_modes: ConsoleModes::PLAIN,
            guardian: Some(&guardian),
        };
        let Ok(mut group) = Group::start(&ctx) else { panic!("workers did not start") };
        let mut signals = Signals::none();
        let outcome = group.monitor(&mut signals, std::future::pending::<String>(), &CancellationToken::new()).await;
        let armed = group.slots.iter().any(|s| s.process.is_armed());
        drop(group);
        (outcome, armed, std::fs::read_to_string(record.path()).unwrap())
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
        let (outcome, armed, told) = round("exit 0").await;
        assert!(matches!(outcome, GroupOutcome::Succeeded), "{outcome:?}");
        assert!(!armed, "a reaped worker's group id would be SIGKILLed on drop");
        balanced(&told);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn failure_releases_every_reaped_group() {
        let (outcome, armed, told) = round("if [ $LOCAL_RANK = 1 ]; then exit 3; fi; sleep 30").await;
        assert!(matches!(outcome, GroupOutcome::Failed { .. }), "{outcome:?}");
        assert!(!armed);
        balanced(&told);
    }
}
