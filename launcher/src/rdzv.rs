//! Rendezvous backends as the agent sees them: where rounds come from, who decides about failures.
//!
//! - [`StaticRdzv`]: torchrun's static backend. Node rank, node count, MASTER_ADDR and MASTER_PORT are
//!   given; nothing is exchanged; the restart budget is counted by this node (as torchrun's agent does).
//! - `Daemon` (see [`crate::daemon`]): the rsrun-rendezvous service — an external daemon, one embedded
//!   in this launcher (`--standalone`), or one hosted because nothing listened at a local endpoint.

use std::future::Future;
use std::pin::Pin;

use crate::daemon::DaemonRdzv;
use crate::env::RoundAssignment;
use crate::logs::ConsoleTx;
use crate::plan::{LaunchPlan, RdzvPlan};
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

/// A future that resolves (with a reason) when the current round ends elsewhere.
pub type RoundEndFuture = Pin<Box<dyn Future<Output = String> + Send>>;

/// The rendezvous backend of this node.
#[derive(Debug)]
pub enum Rendezvous {
    /// torchrun's static backend.
    Static(StaticRdzv),
    /// The rsrun-rendezvous service.
    Daemon(Box<DaemonRdzv>),
}

impl Rendezvous {
    /// Sets up the backend the plan names (connects, or hosts an embedded service).
    ///
    /// # Errors
    /// The embedded service cannot bind, or the endpoint cannot be resolved.
    pub async fn connect(plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Self> {
        match &plan.rdzv {
            RdzvPlan::Static { node_rank, master_addr, master_port } => Ok(Rendezvous::Static(StaticRdzv {
                node_rank: *node_rank,
                num_nodes: plan.nodes.max,
                master_addr: master_addr.clone(),
                master_port: Some(*master_port),
                round: 0,
                restarts: 0,
                max_restarts: plan.max_restarts,
                node_id: format!("{}:{}", plan.hostname, std::process::id()),
            })),
            RdzvPlan::Standalone | RdzvPlan::Daemon { .. } => {
                Ok(Rendezvous::Daemon(Box::new(DaemonRdzv::connect(plan, console).await?)))
            }
        }
    }

    /// Waits for the next round and returns this node's assignment, or `None` when the job completed
    /// meanwhile (this node waited as a spare).
    ///
    /// # Errors
    /// The round did not form in time, the rendezvous is unreachable, or the ranks do not fit.
    pub async fn next_round(&mut self, plan: &LaunchPlan, console: &ConsoleTx) -> anyhow::Result<Option<RoundAssignment>> {
        match self {
            Rendezvous::Static(s) => s.next_round(plan).map(Some),
            Rendezvous::Daemon(d) => d.next_round(plan, console).await,
        }
    }

    /// Resolves when the round ends elsewhere (never, for the static backend).
    pub fn round_end(&self, a: &RoundAssignment) -> RoundEndFuture {
        match self {
            Rendezvous::Static(_) => Box::pin(std::future::pending()),
            Rendezvous::Daemon(d) => d.round_end(a),
        }
    }

    /// Reports a local worker failure and returns the decision.
    pub async fn report_failure(&mut self, a: &RoundAssignment, root: &WorkerFailure, hang: bool) -> Decision {
        match self {
            Rendezvous::Static(s) => s.report_failure(),
            Rendezvous::Daemon(d) => d.report_failure(a, root, hang).await,
        }
    }

    /// This node's workers succeeded: tell the rendezvous and wait at the exit barrier for the job to
    /// complete (or fail, or start a new round that this node must join again).
    pub async fn finish(&mut self, plan: &LaunchPlan, a: &RoundAssignment, console: &ConsoleTx) -> RoundEnd {
        match self {
            Rendezvous::Static(_) => RoundEnd::Completed,
            Rendezvous::Daemon(d) => d.finish(plan, a, console).await,
        }
    }

    /// After the round ended elsewhere: re-join, or the job is over.
    ///
    /// # Errors
    /// The rendezvous service stayed unreachable past the keep-alive bound: this node cannot know
    /// what became of the job.
    pub async fn after_round_end(&mut self, a: &RoundAssignment) -> anyhow::Result<RoundEnd> {
        match self {
            Rendezvous::Static(_) => Ok(RoundEnd::Rejoin),
            Rendezvous::Daemon(d) => d.after_round_end(a).await,
        }
    }

    /// Leaves the job (best effort, short deadline).
    pub async fn leave(&mut self, reason: &str) {
        if let Rendezvous::Daemon(d) = self {
            d.leave(reason).await;
        }
    }

    /// Releases resources (stops an embedded service after a grace for the other nodes).
    pub async fn close(self) {
        if let Rendezvous::Daemon(d) = self {
            d.close().await;
        }
    }
}

/// torchrun's static backend.
#[derive(Debug)]
pub struct StaticRdzv {
    node_rank: u32,
    num_nodes: u32,
    master_addr: String,
    /// `None`: pick a free port each round.
    master_port: Option<u16>,
    round: u64,
    restarts: u32,
    max_restarts: u32,
    node_id: String,
}

impl StaticRdzv {
    fn next_round(&mut self, plan: &LaunchPlan) -> anyhow::Result<RoundAssignment> {
        let nproc = plan.nproc_per_node;
        let (rank_offset, world_size) = static_ranks(self.node_rank, self.num_nodes, nproc)?;
        let a = RoundAssignment {
            round: self.round,
            node_rank: self.node_rank,
            num_nodes: self.num_nodes,
            rank_offset,
            local_world_size: nproc,
            world_size,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port.unwrap_or_else(|| free_port().unwrap_or(crate::plan::DEFAULT_MASTER_PORT)),
            restart_count: self.restarts,
            max_restarts: self.max_restarts,
            node_id: self.node_id.clone(),
            rdzv_endpoint: None,
        };
        self.round += 1;
        Ok(a)
    }

    fn report_failure(&mut self) -> Decision {
        if self.restarts < self.max_restarts {
            self.restarts += 1;
            Decision::Restart
        } else {
            Decision::Failed {
                remote_root: None,
                reason: if self.max_restarts == 0 {
                    "no restarts allowed (--max-restarts 0)".into()
                } else {
                    format!("restart budget exhausted ({} restarts)", self.max_restarts)
                },
            }
        }
    }
}

/// The static backend's first global rank of this node and world size, checked: they must fit in a
/// rank (`i32`, what PyTorch and the wire carry).
///
/// # Errors
/// `node_rank × nproc` or `num_nodes × nproc` does not fit.
pub fn static_ranks(node_rank: u32, num_nodes: u32, nproc: u32) -> anyhow::Result<(u32, u32)> {
    let fits = |v: Option<u32>| v.filter(|&v| v <= i32::MAX as u32);
    let world = fits(num_nodes.checked_mul(nproc)).ok_or_else(|| {
        anyhow::anyhow!("world size {num_nodes} nodes x {nproc} workers does not fit in a rank (at most {})", i32::MAX)
    })?;
    let offset = fits(node_rank.checked_mul(nproc)).ok_or_else(|| {
        anyhow::anyhow!("node rank {node_rank} x {nproc} workers per node does not fit in a rank (at most {})", i32::MAX)
    })?;
    Ok((offset, world))
}

/// A port that is free right now on every interface (for PyTorch's store on the rank-0 node).
///
/// # Errors
/// No socket could be bound.
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind(("0.0.0.0", 0))?;
    Ok(l.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_ranks_are_checked() {
        assert_eq!(static_ranks(1, 2, 4).unwrap(), (4, 8));
        let e = static_ranks(0, u32::MAX, 2).unwrap_err().to_string();
        assert!(e.contains("world size") && e.contains("does not fit"), "{e}");
        let e = static_ranks(1 << 20, 1 << 20, 1 << 12).unwrap_err().to_string();
        assert!(e.contains("does not fit"), "{e}");
        assert!(static_ranks(3, 8, 1 << 28).is_err(), "past i32::MAX");
    }
}
