//! `--requeue-on-preempt` under Slurm (multinode.md §3.5): node rank 0 asks Slurm to requeue the job
//! once it was preempted.
//!
//! ```text
//! a preemption signal (SIGTERM, SIGUSR1, SIGUSR2, unless the policy ignores it) reaches rsrun
//!   └─ the signal policy passes it to the workers as usual (TERM: stop with the grace; USR1/2:
//!      forward, supervision goes on); the first one is remembered here
//! the run ended (the workers exited) ── or ── the shutdown grace passed since that signal
//!   └─ node rank 0 only, once: `scontrol requeue <job>`
//!      scontrol missing → a note with the command to run; scontrol failed → a note with its words
//! rsrun exits with the workers' status, as without the flag
//! ```
//!
//! The decision ([`due`]) is a pure function of the signal's time, whether the run ended and the
//! clock; [`Requeuer`] is the thin I/O around it (its own signal streams, the `scontrol` process).
//! Other nodes never run anything: the plan says whether this process is the runner.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::logs::{ConsoleEvent, ConsoleTx};
use crate::multinode::slurm::Requeue;
use crate::signals::{SignalAction, SignalPolicy};

/// The signals that announce a preemption or the time limit under Slurm.
pub const PREEMPT_SIGNALS: [Signal; 3] = [Signal::SIGTERM, Signal::SIGUSR1, Signal::SIGUSR2];
/// Deadline of the `scontrol requeue` call.
pub const SCONTROL_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether to requeue now: after a preemption signal, once the run ended or `grace` passed since the
/// signal.
pub fn due(preempted_at: Option<Instant>, run_ended: bool, now: Instant, grace: Duration) -> bool {
    match preempted_at {
        None => false,
        Some(at) => run_ended || now >= at + grace,
    }
}

/// The preemption signals `policy` passes on (stop or forward); an ignored signal preempts nothing.
pub fn watched(policy: &SignalPolicy) -> Vec<Signal> {
    PREEMPT_SIGNALS
        .into_iter()
        .filter(|s| matches!(policy.action(*s), Some(SignalAction::Stop | SignalAction::Forward)))
        .collect()
}

/// Node rank 0's requeue task for one run.
#[derive(Debug)]
pub struct Requeuer {
    task: JoinHandle<()>,
    run_ended: CancellationToken,
}

impl Requeuer {
    /// Starts watching for preemption signals, when `requeue` says this process is the runner. Must
    /// run inside the runtime, before the run starts (its signal streams are the first to listen).
    ///
    /// # Errors
    /// The OS refused a signal handler.
    pub fn start(requeue: &Requeue, policy: &SignalPolicy, grace: Duration, console: ConsoleTx) -> std::io::Result<Option<Requeuer>> {
        if !requeue.runner {
            return Ok(None);
        }
        let (tx, mut rx) = mpsc::unbounded_channel::<Signal>();
        for sig in watched(policy) {
            let mut stream = signal(SignalKind::from_raw(sig as i32))?;
            let tx = tx.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        let run_ended = CancellationToken::new();
        let ended = run_ended.clone();
        let requeue = requeue.clone();
        let policy = policy.clone();
        let task = tokio::spawn(async move {
            // The notice and when it came; the grace counts only from a stop signal: a forwarded
            // one (`--signal=USR1@300`, the workers checkpoint and go on) requeues when the run
            // ends, not `grace` after the warning, minutes before the time limit it was for.
            let mut preempted: Option<(Signal, Instant)> = None;
            let mut stop_at: Option<Instant> = None;
            loop {
                let ran_out = stop_at.is_some_and(|t| due(Some(t), false, Instant::now(), grace));
                if preempted.is_some() && (ended.is_cancelled() || ran_out) {
                    let (sig, _) = preempted.unwrap_or((Signal::SIGTERM, Instant::now()));
                    run_scontrol(&requeue, sig, &console).await;
                    return;
                }
                if ended.is_cancelled() {
                    return; // The run ended and nothing preempted it.
                }
                tokio::select! {
                    s = rx.recv() => match s {
                        Some(sig) => {
                            if preempted.is_none() {
                                info!(signal = %sig, job = %requeue.job, "preemption notice: the job is requeued once the workers exit");
                                preempted = Some((sig, Instant::now()));
                            }
                            if stop_at.is_none() && policy.action(sig) == Some(SignalAction::Stop) {
                                stop_at = Some(Instant::now());
                            }
                        }
                        None => {
                            // No signal stream is left: wait for the end of the run.
                            ended.cancelled().await;
                        }
                    },
                    _ = ended.cancelled() => {}
                    _ = tokio::time::sleep_until(stop_at.map_or_else(|| Instant::now() + Duration::from_secs(86_400), |t| t + grace)), if stop_at.is_some() => {}
                }
            }
        });
        Ok(Some(Requeuer { task, run_ended }))
    }

    /// The run ended: requeue now if it was preempted (and not done yet), and wait for it.
    pub async fn finish(self) {
        self.run_ended.cancel();
        if tokio::time::timeout(SCONTROL_TIMEOUT + Duration::from_secs(1), self.task).await.is_err() {
            warn!("the requeue did not finish in time");
        }
    }
}

/// Runs `scontrol requeue <job>` once and says what happened.
async fn run_scontrol(requeue: &Requeue, sig: Signal, console: &ConsoleTx) {
    let argv = requeue.argv();
    let shown = argv.join(" ");
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..]).stdin(std::process::Stdio::null()).kill_on_drop(true);
    let note = match tokio::time::timeout(SCONTROL_TIMEOUT, cmd.output()).await {
        Ok(Ok(out)) if out.status.success() => format!("rsrun: preempted ({sig}): requeued Slurm job {} (`{shown}`)", requeue.job),
        Ok(Ok(out)) => format!(
            "rsrun: preempted ({sig}): `{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Ok(Err(err)) if err.kind() == std::io::ErrorKind::NotFound => {
            format!("rsrun: preempted ({sig}): scontrol is not on PATH; to requeue the job, run `{shown}`")
        }
        Ok(Err(err)) => format!("rsrun: preempted ({sig}): cannot run `{shown}`: {err}; run it by hand"),
        Err(_) => format!("rsrun: preempted ({sig}): `{shown}` did not answer within {SCONTROL_TIMEOUT:?}"),
    };
    info!(job = %requeue.job, "{note}");
    let _ = console.send(ConsoleEvent::Note(note)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requeue_after_the_run_or_the_grace() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(25);
        assert!(!due(None, true, t0, grace), "no preemption, no requeue");
        assert!(!due(Some(t0), false, t0 + Duration::from_secs(24), grace), "workers still saving");
        assert!(due(Some(t0), true, t0 + Duration::from_secs(1), grace), "workers exited");
        assert!(due(Some(t0), false, t0 + grace, grace), "grace passed");
    }

    #[test]
    fn ignored_signals_preempt_nothing() {
        let p = SignalPolicy::default_policy();
        assert_eq!(watched(&p), PREEMPT_SIGNALS.to_vec());
        let p = p.with_overrides("USR2=ignore").unwrap();
        assert_eq!(watched(&p), vec![Signal::SIGTERM, Signal::SIGUSR1]);
    }

    #[tokio::test]
    async fn a_run_without_preemption_requeues_nothing() {
        let (tx, mut rx) = mpsc::channel(4);
        let r = Requeue { job: "4242".into(), runner: true };
        let q = Requeuer::start(&r, &SignalPolicy::default_policy(), Duration::from_secs(1), tx).unwrap().unwrap();
        q.finish().await;
        assert!(rx.try_recv().is_err(), "no note");
        let other = Requeue { job: "4242".into(), runner: false };
        assert!(Requeuer::start(&other, &SignalPolicy::default_policy(), Duration::from_secs(1), mpsc::channel(1).0).unwrap().is_none());
    }
}
