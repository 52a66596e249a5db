//! The node agent: rendezvous → run the round → decide (finish, restart, re-join, fail) → repeat.
//!
//! ```text
//! loop {
//!     round = rendezvous.next_round()            // static: computed locally; daemon: Join RPC
//!     match supervisor::run_group(round) {
//!         SUCCEEDED          => finish + exit barrier, exit 0
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

use crate::logs::{ConsoleEvent, ConsoleTx};
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
    /// Cancel to stop everything (workers get SIGTERM and the shutdown grace).
    pub shutdown: CancellationToken,
    /// Signals rsrun handles (see [`Signals::install`]).
    pub signals: Signals,
    /// The guardian process, when one was started.
    pub guardian: Option<Arc<Guardian>>,
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
    let mut rdzv = Rendezvous::connect(&plan, &cx.console).await?;
    let result = agent_loop(&plan, &mut cx, &mut rdzv, &note).await;
    rdzv.close().await;
    result
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
        let assignment = tokio::select! {
            biased;
            _ = cx.shutdown.cancelled() => {
                rdzv.leave("shutdown requested").await;
                return Ok(Outcome { exit_code: 1, report: None });
            }
            sig = next_stop_signal(&mut cx.signals) => {
                rdzv.leave(&format!("rsrun received {sig}")).await;
                return Ok(Outcome::signalled(sig));
            }
            a = rdzv.next_round(plan, &cx.console) => a?,
        };
        info!(
            job = %plan.job_id,
            round = assignment.round,
            node_rank = assignment.node_rank,
            world_size = assignment.world_size,
            restart_count = assignment.restart_count,
            "round formed"
        );
        let ctx = GroupContext {
            plan,
            assignment: &assignment,
            console: &cx.console,
            guardian: cx.guardian.as_deref(),
        };
        let round_end = rdzv.round_end(&assignment);
        let outcome = run_group(&ctx, &mut cx.signals, round_end, &cx.shutdown).await;
        match outcome {
            GroupOutcome::Succeeded => match rdzv.finish(plan, &assignment, &cx.console).await {
                RoundEnd::Completed => return Ok(Outcome::success()),
                RoundEnd::Rejoin => {
                    note(format!("rsrun: round {} ended after this node finished; re-joining", assignment.round)).await;
                    continue;
                }
                RoundEnd::Failed { root, reason } => return Ok(job_failed(plan, &assignment, root, reason)),
            },
            GroupOutcome::Failed { root, others, hang } => {
                match rdzv.report_failure(&assignment, &root, hang).await {
                    Decision::Restart => {
                        note(format!(
                            "rsrun: {}; restarting the job (restart {} of {})",
                            root.headline(),
                            assignment.restart_count + 1,
                            assignment.max_restarts
                        ))
                        .await;
                        continue;
                    }
                    Decision::Failed { remote_root, reason } => {
                        let report = FailureReport {
                            job_id: plan.job_id.clone(),
                            program: plan.program.name.clone(),
                            round: assignment.round,
                            restart_count: assignment.restart_count,
                            max_restarts: assignment.max_restarts,
                            root: remote_root.map(|r| *r).unwrap_or(*root),
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
                match rdzv.after_round_end(&assignment).await {
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

/// Waits for a signal whose action is `stop`; forwards nothing (no workers run) and drops others.
async fn next_stop_signal(signals: &mut Signals) -> Signal {
    loop {
        let (sig, action) = signals.recv().await;
        if action == SignalAction::Stop {
            return sig;
        }
    }
}
