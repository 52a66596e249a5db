//! Rendezvous backends as the agent sees them: where rounds come from, who decides about failures.
//!
//! Every backend is the rsrun-rendezvous service (see [`crate::daemon`]): an external daemon, one
//! embedded in this launcher (`--standalone`), one hosted by node rank 0 for torchrun's static backend
//! (fixed node ranks, verified), or one hosted because nothing listened at a local endpoint. No
//! backend computes ranks locally on trust.

use std::future::Future;
use std::pin::Pin;

use crate::daemon::DaemonRdzv;
use crate::env::RoundAssignment;
use crate::logs::ConsoleTx;
use crate::plan::LaunchPlan;
use crate::report::WorkerFailure;

/// What happens after a local failure.
#[derive(Debug)]
pub enum Decision {
    /// Start the next round.
    Restart,
    /// The job failed. `remote_root` is set when the root cause was on another node.
    Failed {
        /// The job's root cause when it is not this node's failure.
        remote_root: Option<Box<WorkerFailure>>,
        /// Why (budget exhausted, hang policy, ...).
        reason: String,
    },
}

/// What happens after the round ended elsewhere.
#[derive(Debug)]
pub enum RoundEnd {
    /// Join the next round.
    Rejoin,
    /// The job completed.
    Completed,
    /// The job failed elsewhere.
    Failed {
        /// The job's root cause, when known.
        root: Option<Box<WorkerFailure>>,
        /// Why.
        reason: String,
    },
}

/// A future that resolves when the current round ends elsewhere.
pub type RoundEndFuture = Pin<Box<dyn Future<Output = RoundEndCause> + Send>>;

/// Why the current round ended elsewhere, and how its workers are stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundEndCause {
    /// Why, for the console and the logs.
    pub reason: String,
    /// At most this long between SIGTERM and SIGKILL (`None`: `--shutdown-timeout`). A node that
    /// fenced itself must have no worker left when its lease ends.
    pub grace: Option<std::time::Duration>,
}

impl From<String> for RoundEndCause {
    fn from(reason: String) -> Self {
        RoundEndCause { reason, grace: None }
    }
}

/// The rendezvous backend of this node: a member of a job kept by the rendezvous service, which is
/// embedded (`--standalone`; node rank 0 of the static backend; a launcher hosting at its own
/// endpoint) or a daemon.
#[derive(Debug)]
pub struct Rendezvous(Box<DaemonRdzv>);

impl Rendezvous {
    /// Sets up the backend the plan names (connects, or hosts an embedded service).
    ///
    /// # Errors
    /// The embedded service cannot bind, or the endpoint cannot be resolved.
    pub async fn connect(plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Self> {
        Ok(Rendezvous(Box::new(DaemonRdzv::connect(plan, console).await?)))
    }

    /// Waits for the next round and returns this node's assignment, or `None` when the job completed
    /// meanwhile (this node waited as a spare).
    ///
    /// # Errors
    /// The round did not form in time, the rendezvous is unreachable, the ranks do not fit, or (static
    /// backend) another node holds this node's `--node-rank`.
    pub async fn next_round(&mut self, plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Option<RoundAssignment>> {
        self.0.next_round(plan, console).await
    }

    /// Resolves when the round ends elsewhere.
    pub fn round_end(&self, a: &RoundAssignment) -> RoundEndFuture {
        self.0.round_end(a)
    }

    /// Reports a local worker failure and returns the decision.
    pub async fn report_failure(&mut self, a: &RoundAssignment, root: &WorkerFailure, hang: bool) -> Decision {
        self.0.report_failure(a, root, hang).await
    }

    /// Reports a local worker failure again, in full, after an early report of it failed the job
    /// (the service takes it as a refinement of the job's root cause). `None` when the service
    /// did not answer.
    pub async fn refine_failure(&mut self, a: &RoundAssignment, root: &WorkerFailure, hang: bool) -> Option<Decision> {
        self.0.try_report_failure(a, root, hang).await.ok()
    }

    /// This node's workers succeeded: tell the rendezvous and wait at the exit barrier for the job to
    /// complete (or fail, or start a new round that this node must join again).
    pub async fn finish(&mut self, plan: &LaunchPlan, a: &RoundAssignment, console: &ConsoleTx) -> RoundEnd {
        self.0.finish(plan, a, console).await
    }

    /// Whether this node fenced itself in its last round: its lease lapsed at this end (see
    /// [`crate::daemon::DaemonRdzv::round_end`]).
    pub fn fenced(&self) -> bool {
        self.0.fenced()
    }

    /// After the round ended elsewhere: re-join, or the job is over.
    ///
    /// # Errors
    /// The rendezvous service stayed unreachable past the keep-alive bound: this node cannot know
    /// what became of the job.
    pub async fn after_round_end(&mut self, a: &RoundAssignment) -> anyhow::Result<RoundEnd> {
        self.0.after_round_end(a).await
    }

    /// Once `gone` is cancelled the service is known to be gone: [`Rendezvous::leave`] does not try.
    pub fn service_gone_on(&mut self, gone: tokio_util::sync::CancellationToken) {
        self.0.service_gone_on(gone);
    }

    /// Leaves the job (best effort, short deadline).
    pub async fn leave(&mut self, reason: &str) {
        self.0.leave(reason).await;
    }

    /// Releases resources (stops an embedded service after a grace for the other nodes).
    pub async fn close(self) {
        self.0.close().await;
    }
}

/// A port that is free right now on every interface (for PyTorch's store on the rank-0 node).
///
/// # Errors
/// No socket could be bound.
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("0.0.0.0", 0))?;
    Ok(l.local_addr()?.port())
}
