//! One command for the whole job: `rsrun --hosts h1:2,h2:2 PROGRAM` / `rsrun --hostfile FILE PROGRAM`.
//!
//! # Brief overview
//!
//! ```text
//! head (this rsrun)                                       host k
//! ─────────────────                                       ──────
//! RemotePlan::resolve ─ hosts, ssh argv, env, options
//! driver::run_head ─ embedded rendezvous (token per job)
//!   ├─ ssh -T … -- HOST "exec '/abs/rsrun' agent --stdin" ──▶ rsrun agent --stdin (agent.rs)
//!   │    stdin : NodeLaunch, then Control{STOP|FORCE}; EOF      read_launch → prepare (cwd, env,
//!   │           = the head is gone                                token file, LaunchPlan) →
//!   │    stdout: AgentEvent frames (Ready, lines, Exit)          crate::agent::run (daemon rdzv)
//!   │    stderr: ssh's and the agent's diagnostics               → workers
//!   └─ exit code: the root cause the rendezvous recorded
//! ```
//!
//! - [`plan`]: `LaunchArgs` → [`plan::RemotePlan`]: hosts (node rank = list order, ranks contiguous per
//!   host), the exact argv per host ([`command`]), the rendezvous, the forwarded environment
//!   ([`env`]), the per-node options every agent parses again with rsrun's own parser.
//! - [`wire`]: length-delimited `NodeLaunch` / `Control` / `AgentEvent` frames
//!   (`proto/rsrun/v1/launch.proto`) and the version check.
//! - [`driver`]: the head's event loop: start, relay, stop, kill, exit code.
//! - [`agent`]: the host side, run by the binary's `agent --stdin` mode.
//! - [`preflight`]: one line per host that did not start, classified from ssh's stderr.
//! - [`identity`]: the same-machine check over the identities the agents report (boot id, network
//!   namespace), and its error.
//! - [`dry_run`]: the plan as text, with every host's exact argv.
//!
//! Invariants:
//! - The plan (environment values, the token) never travels on a command line: only the constant
//!   `exec '/abs/rsrun' agent --stdin` is parsed by a remote shell.
//! - No process is ever found by name: the head stops what it started (Control messages, EOF, then
//!   SIGKILL of its own ssh clients' process groups); a second job on the same hosts is untouched.
//! - An agent's stdin is its lifeline: EOF stops its workers (stop signal, grace, SIGKILL).

pub mod agent;
pub mod command;
pub mod driver;
pub mod dry_run;
pub mod env;
pub mod identity;
pub mod plan;
pub mod preflight;
pub mod wire;

pub use driver::{HeadContext, HeadOutcome, run_head};
pub use plan::RemotePlan;

pub use crate::multinode::hostfile::Slots;

/// One host of the job, in node-rank order. `multinode::hostfile`'s `HostEntry` converts into it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteHost {
    /// The host name or address, as listed (also the console prefix).
    pub host: String,
    /// Workers on this host: a count, or `auto` (a bare hostfile host without --nproc-per-node:
    /// its agent starts one per GPU, else one).
    pub slots: Slots,
    /// Devices of this host (CUDA_VISIBLE_DEVICES); `None`: inherited.
    pub devices: Option<Vec<u32>>,
    /// ssh user of this host (`user@host`, `user=`): overrides `--ssh-user`.
    pub user: Option<String>,
    /// ssh port of this host (`port=`): overrides `--ssh-port`.
    pub port: Option<u16>,
    /// The address ssh connects to (`addr=`); the name stays the host's label.
    pub addr: Option<String>,
}

impl RemoteHost {
    /// A host reached by its name, with the shared ssh settings.
    pub fn named(host: impl Into<String>, slots: u32) -> Self {
        RemoteHost { host: host.into(), slots: Slots::Count(slots), devices: None, user: None, port: None, addr: None }
    }

    /// What ssh connects to: `addr=`, else the name.
    pub fn target(&self) -> &str {
        self.addr.as_deref().unwrap_or(&self.host)
    }
}
