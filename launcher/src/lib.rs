//! rsrun: a torchrun-compatible launcher and supervisor.
//!
//! # Brief overview
//!
//! The binary (`src/main.rs`) parses [`cli::LaunchArgs`], resolves them into a validated
//! [`plan::LaunchPlan`] (every user error is found there, before anything starts), and calls
//! [`agent::run`]. The agent joins a round through the rendezvous ([`rdzv`], [`daemon`]), starts and
//! supervises the node's workers ([`supervisor`], [`worker`]), streams their output ([`logs`]), and
//! on failure restarts the job or builds the failure report ([`report`]).
//!
//! With `--hosts`/`--hostfile` the binary is a head instead ([`remote`]): it hosts the rendezvous and
//! starts `rsrun agent --stdin` on every host over ssh; each agent runs [`agent::run`] as a node.
//!
//! Invariants:
//! - No worker outlives rsrun: each runs in its own session and process group with `PR_SET_PDEATHSIG`, is owned
//!   by a value that kills its group on drop, and a guardian process kills every group if rsrun dies
//!   by `kill -9` ([`worker`]).
//! - The library never prints: worker lines, notes and the rendezvous status go to the binary as
//!   [`logs::ConsoleEvent`]s, which [`console::Console`] renders onto the writers the binary gives it.
//! - One shutdown pattern: a `CancellationToken`; every wait has a deadline.

pub mod agent;
pub mod cli;
pub mod console;
pub mod daemon;
pub mod dry_run;
pub mod env;
pub mod localaddr;
pub mod logs;
pub mod multinode;
pub mod plan;
pub mod progress;
pub mod reach;
pub mod rdzv;
pub mod remote;
pub mod report;
pub mod requeue;
pub mod signals;
pub mod supervisor;
pub mod terminal;
pub mod topology;
pub mod worker;

pub use agent::{Outcome, RunContext, run};
pub use plan::{HostInfo, LaunchPlan, PlanError};
