//! The node agent: rendezvous → run the round → decide (finish, restart, re-join, fail) → repeat.
//!
//! ```text
//! loop {
//!     round = rendezvous.next_round()            // static: computed locally; daemon: Join RPC
//!     match supervisor::run_group(round) {
//!         SUCCEEDED          => finish + exit barrier (a stop signal cuts it short), exit 0
//!         FAILED / UNHEALTHY => report the failure; RESTART → next round, FAILED → report, exit code
//!         STOPPED            => the round ended elsewhere: re-join (or the job failed: report, exit)
//!         stop signal        => leave, exit 128 + signal
//!     }
//! }
//! ```
//!
//! Restarts after failures consume the job's one restart budget (kept by the daemon; by this node for
//! the static backend). Membership changes (a node left or arrived) start a new round without
//! consuming it.

use std::sync::Arc;

use nix::sys::signal::Signal;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::logs::{ConsoleEvent, ConsoleModes, ConsoleTx};
use crate::env::RoundAssignment;
use crate::plan::LaunchPlan;
use crate::rdzv::{Decision, Rendezvous, RoundEnd};
use crate::report::{ExitKind, FailureReport, WorkerFailure};
use crate::signals::{SignalAction, Signals};
use crate::supervisor::{GroupContext, GroupOutcome, run_group};
use crate::worker::Guardian;

/// How the launcher ended.
#[derive(Debug)]
pub struct Outcome {
    /// rsrun's exit code: 0, the root-cause worker's code, or 128 + signal.
    pub exit_code: i32,
    /// The failure summary, when the job failed.
    pub report: Option<FailureReport>,
}

impl Outcome {
    fn success() -> Self {
        Outcome { exit_code: 0, report: None }
    }

    fn signalled(sig: Signal) -> Self {
        Outcome { exit_code: 128 + sig as i32, report: None }
    }
}

/// What [`run`] needs besides the plan.
#[derive(Debug)]
pub struct RunContext {
    /// Console events (worker lines, notes, rendezvous status).
    pub console: ConsoleTx,
    /// What rsrun's stdout and stderr are (terminal or not), decided by the binary.
    pub console_modes: ConsoleModes,
    /// Cancel to stop everything (workers get SIGTERM and the shutdown grace).
    pub shutdown: CancellationToken,
    /// Signals rsrun handles (see [`Signals::install`]).
    pub signals: Signals,
    /// The guardian process, when one was started.
    pub guardian: Option<Arc<Guardian>>,
    /// Cancelled when the rendezvous service is known to be gone (it lived in the head that started
    /// this agent, and the head is gone): leaving the job there is skipped, so the agent exits as
    /// soon as its workers are stopped.
    pub service_gone: Option<CancellationToken>,
}

/// Runs the job on this node until it ends.
///
/// # Errors
/// Infrastructure failures (the rendezvous is unreachable past its deadlines, the log directory
/// cannot be created, ...). Worker failures are not errors: they are in the [`Outcome`].
pub async fn run(plan: LaunchPlan, mut cx: RunContext) -> anyhow::Result<Outcome> {
    let console = cx.console.clone();
    let note = |s: String| {
        let console = console.clone();
        async move {
            let _ = console.send(ConsoleEvent::Note(s)).await;
        }
    };
    // Finding node rank 0's service may wait for its name or port: a stop signal ends the wait.
    let mut rdzv = match interruptible(&cx.shutdown, &mut cx.signals, Rendezvous::connect(&plan, &cx.console)).await {
        Ok(r) => r?,
        Err(Stop::Shutdown) => return Ok(Outcome { exit_code: 1, report: None }),
        Err(Stop::Signal(sig)) => {
            info!(job = %plan.job_id, signal = %sig, "stop signal while looking for the rendezvous");
            return Ok(Outcome::signalled(sig));
        }
    };
    if let Some(gone) = &cx.service_gone {
        rdzv.service_gone_on(gone.clone());
    }
    let result = agent_loop(&plan, &mut cx, &mut rdzv, &note).await;
    rdzv.close().await;
    if let (Ok(Outcome { report: Some(report), .. }), Some(path)) = (&result, &plan.parent_error_file) {
        write_parent_error_file(path, report).await;
    }
    result
}

/// Copies the root cause into rsrun's own `TORCHELASTIC_ERROR_FILE` ([`crate::report::write_parent_error_file`]),
/// off the runtime (it reads the worker's error file). A failure to write is logged: the job's
/// outcome stands.
async fn write_parent_error_file(path: &std::path::Path, report: &FailureReport) {
    // A file system that hangs (NFS) must not keep rsrun from exiting: the write gets a deadline,
    // and the runtime's shutdown does not wait for a blocking thread past its own.
    const WRITE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);
    let (path, report) = (path.to_owned(), report.clone());
    let shown = path.display().to_string();
    let write = tokio::task::spawn_blocking(move || crate::report::write_parent_error_file(&path, &report));
    match tokio::time::timeout(WRITE_DEADLINE, write).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(err))) => tracing::warn!(%err, "cannot copy the root cause to TORCHELASTIC_ERROR_FILE"),
        Ok(Err(err)) => tracing::warn!(%err, "cannot copy the root cause to TORCHELASTIC_ERROR_FILE"),
        Err(_) => tracing::warn!(path = %shown, "copying the root cause to TORCHELASTIC_ERROR_FILE took over {WRITE_DEADLINE:?}; exiting without it"),
    }
}

async fn agent_loop<F, Fut>(
    plan: &LaunchPlan,
    cx: &mut RunContext,
    rdzv: &mut Rendezvous,
    note: &F,
) -> anyhow::Result<Outcome>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    loop {
        // Join the next round; a stop signal or shutdown aborts the wait.
        let joined = match interruptible(&cx.shutdown, &mut cx.signals, rdzv.next_round(plan, &cx.console)).await {
            Ok(a) => a?,
            Err(stop) => return Ok(leave_on(rdzv, stop).await),
        };
        let Some(assignment) = joined else {
            note(format!("rsrun: job '{}' completed while this node waited as a spare", plan.job_id)).await;
            return Ok(Outcome::success());
        };
        info!(
            job = %plan.job_id,
            round = assignment.round,
            node_rank = assignment.node_rank,
            world_size = assignment.world_size,
            restart_count = assignment.restart_count,
            "round formed"
        );
        let (first_tx, mut first_rx) = tokio::sync::mpsc::unbounded_channel();
        let ctx = GroupContext {
            plan,
            assignment: &assignment,
            console: &cx.console,
            console_modes: cx.console_modes,
            guardian: cx.guardian.as_deref(),
            first_failure: Some(&first_tx),
        };
        let round_end = rdzv.round_end(&assignment);
        // The first failure is reported the moment it is seen, while the group is stopped: the
        // node where the job's failure began must not lose the race to a peer whose workers fail
        // in the cascade (a collective's broken connection) and that stops its group faster, or
        // every node would name the peer's failure as the job's root cause. It carries the
        // worker's error file (written before it exited) and the stderr read so far. Its decision
        // stands; when this node's failure failed the job, the full report below refines the
        // root cause (the service takes it as this node's refinement). An early report still on
        // its way when the group ends is waited for (a stop signal cuts that wait short): the
        // full report never overtakes it.
        let mut early = Box::pin(async {
            let mut first = first_rx.recv().await?;
            if first.error.is_none()
                && let Some(path) = first.error_file.clone()
            {
                // The worker controls the file and it may be on a network file system: read on
                // a blocking thread, for a second at most.
                let read = tokio::task::spawn_blocking(move || crate::report::read_error_file(&path));
                first.error = tokio::time::timeout(EARLY_ERROR_FILE_WAIT, read).await.ok().and_then(Result::ok).flatten();
            }
            Some(rdzv.report_failure(&assignment, &first, false).await)
        });
        let mut early_decision: Option<Decision> = None;
        let mut early_done = false;
        let outcome = {
            let group = run_group(&ctx, &mut cx.signals, round_end, &cx.shutdown);
            tokio::pin!(group);
            loop {
                tokio::select! {
                    outcome = &mut group => break outcome,
                    decision = &mut early, if !early_done => {
                        early_done = true;
                        early_decision = decision;
                    }
                }
            }
        };
        // No failure comes any more: a report that never started ends at once.
        drop(first_tx);
        if early_done || matches!(outcome, GroupOutcome::Signalled(_)) {
            // A stop signal ended the round: rsrun leaves at once, not after the report.
            drop(early);
        } else {
            match interruptible(&cx.shutdown, &mut cx.signals, early).await {
                Err(stop) => return Ok(leave_on(rdzv, stop).await),
                Ok(decision) => early_decision = decision,
            }
        }
        match outcome {
            // The exit barrier may last --exit-barrier-timeout: a stop signal or shutdown ends it.
            GroupOutcome::Succeeded => match interruptible(&cx.shutdown, &mut cx.signals, rdzv.finish(plan, &assignment, &cx.console)).await {
                Err(stop) => return Ok(leave_on(rdzv, stop).await),
                Ok(RoundEnd::Completed) => return Ok(Outcome::success()),
                Ok(RoundEnd::Rejoin) => {
                    note(format!("rsrun: round {} ended after this node finished; re-joining", assignment.round)).await;
                    continue;
                }
                Ok(RoundEnd::Failed { root, reason }) => return Ok(job_failed(plan, &assignment, root, reason)),
            },
            GroupOutcome::Failed { root, others, hang } => {
                // Retries while the service is unreachable (up to the RPC deadline): interruptible too.
                let decision = match early_decision {
                    // Decided by the early report: a restart (the round is over: a full report
                    // would only hear "stale round").
                    Some(Decision::Restart) => Ok(Decision::Restart),
                    // The job failed (or the early report could not be sent): the full report
                    // refines this node's root cause, or reads the job's as it is now (the root
                    // node's refinement may have come meanwhile), or decides; what the early
                    // report got stands if the service cannot be told.
                    Some(early @ Decision::Failed { .. }) => {
                        interruptible(&cx.shutdown, &mut cx.signals, rdzv.refine_failure(&assignment, &root, hang))
                            .await
                            .map(|answered| answered.unwrap_or(early))
                    }
                    None => interruptible(&cx.shutdown, &mut cx.signals, rdzv.report_failure(&assignment, &root, hang)).await,
                };
                match decision {
                    Err(stop) => return Ok(leave_on(rdzv, stop).await),
                    Ok(Decision::Restart) => {
                        note(format!(
                            "rsrun: {}; restarting the job (restart {} of {})",
                            root.headline(),
                            assignment.restart_count + 1,
                            assignment.max_restarts
                        ))
                        .await;
                        continue;
                    }
                    Ok(Decision::Failed { remote_root, reason }) => {
                        // Another node's failure is the job's root cause: this node's own first
                        // failure is still reported, first among the others.
                        let mut others = others;
                        let root = match remote_root {
                            Some(remote) => {
                                others.insert(0, *root);
                                *remote
                            }
                            None => *root,
                        };
                        let report = FailureReport {
                            job_id: plan.job_id.clone(),
                            program: plan.program.name.clone(),
                            round: assignment.round,
                            restart_count: assignment.restart_count,
                            max_restarts: assignment.max_restarts,
                            root,
                            others,
                            reason,
                        };
                        return Ok(Outcome { exit_code: report.exit_code(), report: Some(report) });
                    }
                }
            }
            GroupOutcome::Signalled(sig) => {
                rdzv.leave(&format!("rsrun received {sig}")).await;
                return Ok(Outcome::signalled(sig));
            }
            GroupOutcome::Stopped(reason) => {
                if cx.shutdown.is_cancelled() {
                    rdzv.leave("shutdown requested").await;
                    return Ok(Outcome { exit_code: 1, report: None });
                }
                // A fenced node waits here for the service's answer, up to keep_alive_timeout.
                let fenced = rdzv.fenced();
                if fenced {
                    note(format!(
                        "rsrun: round {} ended ({reason}); waiting for the rendezvous service to answer (this node gives up {:?} after its last answer: keep_alive_timeout)",
                        assignment.round, plan.timeouts.keep_alive_give_up
                    ))
                    .await;
                }
                let after = match interruptible(&cx.shutdown, &mut cx.signals, rdzv.after_round_end(&assignment)).await {
                    Err(stop) => return Ok(leave_on(rdzv, stop).await),
                    Ok(after) => after?,
                };
                match after {
                    RoundEnd::Rejoin if fenced => note("rsrun: the rendezvous service answered; re-joining".to_owned()).await,
                    RoundEnd::Rejoin => {
                        note(format!("rsrun: round {} ended ({reason}); re-joining", assignment.round)).await;
                    }
                    RoundEnd::Completed => return Ok(Outcome::success()),
                    RoundEnd::Failed { root, reason } => return Ok(job_failed(plan, &assignment, root, reason)),
                }
            }
        }
    }
}

/// How long the early failure report waits for the worker's error file.
const EARLY_ERROR_FILE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Why a wait was cut short.
enum Stop {
    Shutdown,
    Signal(Signal),
}

/// Runs `fut` unless shutdown is requested or a `stop` signal arrives first. `fut` is dropped before
/// this returns, so the caller may use what it borrowed (to leave the job).
async fn interruptible<T>(
    shutdown: &CancellationToken,
    signals: &mut Signals,
    fut: impl std::future::Future<Output = T>,
) -> Result<T, Stop> {
    tokio::select! {
        biased;
        _ = shutdown.cancelled() => Err(Stop::Shutdown),
        sig = next_stop_signal(signals) => Err(Stop::Signal(sig)),
        v = fut => Ok(v),
    }
}

/// Leaves the job after an interrupted wait: exit 1 on shutdown, 128 + signal on a signal.
async fn leave_on(rdzv: &mut Rendezvous, stop: Stop) -> Outcome {
    match stop {
        Stop::Shutdown => {
            rdzv.leave("shutdown requested").await;
            Outcome { exit_code: 1, report: None }
        }
        Stop::Signal(sig) => {
            info!(signal = %sig, "stop signal while waiting at the rendezvous: leaving");
            rdzv.leave(&format!("rsrun received {sig}")).await;
            Outcome::signalled(sig)
        }
    }
}

/// The outcome for a job that failed elsewhere (the root cause is another node's, when known).
fn job_failed(plan: &LaunchPlan, a: &RoundAssignment, root: Option<Box<WorkerFailure>>, reason: String) -> Outcome {
    let root = root.map(|r| *r).unwrap_or_else(|| WorkerFailure {
        rank: None,
        local_rank: None,
        node_id: String::new(),
        hostname: String::new(),
        pid: 0,
        exit: ExitKind::Other,
        time: std::time::SystemTime::now(),
        error_file: None,
        error: None,
        stderr_tail: Vec::new(),
        message: Some(reason.clone()),
        stopped_by_rsrun: false,
    });
    let report = FailureReport {
        job_id: plan.job_id.clone(),
        program: plan.program.name.clone(),
        round: a.round,
        restart_count: a.restart_count,
        max_restarts: a.max_restarts,
        root,
        others: Vec::new(),
        reason,
    };
    Outcome { exit_code: report.exit_code(), report: Some(report) }
}

/// Waits for a signal whose action is `stop`; forwards nothing (no workers run) and drops others,
/// saying so for one that would have been forwarded (a preemption warning between rounds reaches
/// no worker: a new round's workers could not have a handler for it yet, and most programs die of
/// a SIGUSR1 they do not handle).
async fn next_stop_signal(signals: &mut Signals) -> Signal {
    loop {
        let (sig, action) = signals.recv().await;
        match action {
            SignalAction::Stop => return sig,
            SignalAction::Forward => {
                tracing::warn!(signal = %sig, "{sig} arrived while no workers run (between rounds): not passed on");
            }
            SignalAction::Ignore => tracing::info!(signal = %sig, "signal ignored (--signal-policy)"),
        }
    }
}
