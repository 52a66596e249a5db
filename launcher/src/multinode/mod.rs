//! The cluster path: host tables (hostfiles, `-H`, `--include`/`--exclude`), Slurm and Kubernetes.
//!
//! Everything here is pure parsing and planning over what it is handed: the arguments, the
//! environment snapshot of [`HostInfo`] and the hostfile named on the command line. Nothing is
//! started and nothing is resolved on the network. [`resolve`] is what [`crate::plan::LaunchPlan::resolve`]
//! calls; it returns a [`Cluster`]: the launch mode, the host table for the ssh launcher, the plan
//! values it decided, and where each came from.
//!
//! Precedence, per value: an option typed on the command line, then Slurm (`SLURM_*`, when the job
//! runs under Slurm), then Kubernetes / `PET_*` (the operators' environment, which clap already folds
//! into the options), then the default. A value given twice in disagreeing ways (`--nnodes 3` in a
//! 2-node Slurm step) is an error, never a silent choice.
//!
//! - [`hostlist`]: Slurm hostlist expressions (`gpu[01-04,07]`), `compress`, count lists.
//! - [`hostfile`]: the host grammar of hostfiles and `-H`, the node table.
//! - [`filter`]: `--include` / `--exclude`.
//! - [`slurm`]: Slurm mode detection (A, B, C) and the plan mapping.
//! - [`k8s`]: PyTorchJob v1 (static, elastic) and TrainJob v2.

pub mod filter;
pub mod hostfile;
pub mod hostlist;
pub mod k8s;
pub mod slurm;

use std::fmt;

use crate::cli::{LaunchArgs, Origin};
use crate::plan::{HostInfo, NodeRange, PlanError, RdzvPlan};

pub use hostfile::{HostEntry, HostTable, Slots};

/// Where a resolved value came from (shown by `--dry-run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An option typed on the command line, e.g. `--nnodes`.
    Flag(String),
    /// An environment variable: `PET_NNODES`, `SLURM_NODEID`, `RSRUN_HOSTFILE`.
    Env(String),
    /// A hostfile line.
    Line {
        /// The path as the user gave it.
        file: String,
        /// 1-based line number.
        line: usize,
    },
    /// The `-H/--hosts` list.
    HostsArg,
    /// Computed from other values; the text says how.
    Derived(String),
    /// rsrun's default.
    Default,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(s) | Source::Env(s) | Source::Derived(s) => f.write_str(s),
            Source::Line { file, line } => write!(f, "{file}:{line}"),
            Source::HostsArg => f.write_str("-H"),
            Source::Default => f.write_str("default"),
        }
    }
}

/// One resolved value and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced {
    /// What it is: `nnodes`, `node rank`, `nproc per node`, `rendezvous`, `run id`, ...
    pub name: &'static str,
    /// The value as text.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

impl Sourced {
    fn new(name: &'static str, value: impl ToString, source: Source) -> Self {
        Sourced { name, value: value.to_string(), source }
    }
}

/// How the job is launched (shown by `--dry-run`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchMode {
    /// One node, in-memory rendezvous.
    SingleNode,
    /// The rsrun-rendezvous service (torchrun's c10d), each node started by the user.
    Rendezvous,
    /// torchrun's static backend, each node started by the user.
    Static,
    /// One command for the whole job: a host table, started over ssh by the remote launcher.
    Hosts,
    /// Under `srun --ntasks-per-node=1`: one rsrun agent per node.
    SlurmA,
    /// Under `srun --ntasks-per-node=G`: srun started every rank; one worker per task, ranks from
    /// `SLURM_PROCID` / `SLURM_LOCALID`.
    SlurmB,
    /// In a multi-node batch script or salloc shell: re-run under `srun` (Mode A in each task).
    SlurmC {
        /// The srun command line; the absolute path of rsrun and the same arguments follow it.
        srun: Vec<String>,
    },
    /// In a one-node Slurm batch script or salloc shell: a local run.
    SlurmLocal,
    /// A PyTorchJob (Kubeflow training-operator v1) with a master: `PET_MASTER_*`, `PET_NODE_RANK`.
    K8sV1Static,
    /// A PyTorchJob v1 with elastic policy: `PET_RDZV_ENDPOINT`.
    K8sV1Elastic,
    /// A TrainJob (Kubeflow Trainer v2): `PET_*` only.
    K8sV2,
}

impl LaunchMode {
    /// Whether the rendezvous endpoint's name may not resolve yet when this launcher starts: in
    /// a Kubernetes pod, another pod's name (`<job>-worker-0`) gets its DNS record only once
    /// that pod is up. (Slurm's node names resolve from the start.)
    pub fn endpoint_may_resolve_late(&self) -> bool {
        matches!(self, LaunchMode::K8sV1Static | LaunchMode::K8sV1Elastic | LaunchMode::K8sV2)
    }
}

impl fmt::Display for LaunchMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchMode::SingleNode => "single node",
            LaunchMode::Rendezvous => "c10d: rsrun rendezvous, one rsrun per node",
            LaunchMode::Static => "static: one rsrun per node, fixed node ranks",
            LaunchMode::Hosts => "hostfile/ssh: one command starts every node",
            LaunchMode::SlurmA => "Slurm mode A: srun started one rsrun per node",
            LaunchMode::SlurmB => "Slurm mode B: srun started every rank, one worker per task",
            LaunchMode::SlurmC { .. } => "Slurm mode C: batch script, rsrun re-runs itself under srun",
            LaunchMode::SlurmLocal => "Slurm, one node: local run",
            LaunchMode::K8sV1Static => "Kubernetes PyTorchJob v1 (static): rendezvous hosted by node rank 0",
            LaunchMode::K8sV1Elastic => "Kubernetes PyTorchJob v1 (elastic): rendezvous at PET_RDZV_ENDPOINT",
            LaunchMode::K8sV2 => "Kubernetes TrainJob v2: rendezvous hosted by node rank 0",
        })
    }
}

/// Mode B: srun started this process as one rank; the rank variables come from Slurm, not from a
/// rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRanks {
    /// RANK (`SLURM_PROCID`).
    pub rank: u32,
    /// LOCAL_RANK (`SLURM_LOCALID`).
    pub local_rank: u32,
    /// WORLD_SIZE (`SLURM_STEP_NUM_TASKS`).
    pub world_size: u32,
    /// LOCAL_WORLD_SIZE (this node's entry of `SLURM_STEP_TASKS_PER_NODE`).
    pub local_world_size: u32,
    /// GROUP_RANK (`SLURM_NODEID`).
    pub node_rank: u32,
    /// GROUP_WORLD_SIZE (`SLURM_STEP_NUM_NODES`).
    pub num_nodes: u32,
}

/// What the cluster path decided. Fields left `None` are resolved from the options as before.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The launch mode.
    pub mode: LaunchMode,
    /// The node table (`--hostfile` / `-H`), after `--include`/`--exclude`, `--nnodes` and
    /// `--nproc-per-node`.
    pub hosts: Option<HostTable>,
    /// Node count decided here.
    pub nodes: Option<NodeRange>,
    /// Workers on this node decided here.
    pub nproc_per_node: Option<u32>,
    /// Rendezvous, job id and preferred node rank decided here.
    pub rdzv: Option<(RdzvPlan, String, Option<u32>)>,
    /// Mode B's rank variables.
    pub task_ranks: Option<TaskRanks>,
    /// Next ports node rank 0 tries when the rendezvous port is taken (and the others search).
    pub port_probe: u16,
    /// Slurm: the step's hosts in node order (node rank 0's name must not resolve to loopback when
    /// the others do not).
    pub node_list: Vec<String>,
    /// Resolved values and their sources, in display order.
    pub sources: Vec<Sourced>,
    /// Notes for the console.
    pub notes: Vec<String>,
}

impl Cluster {
    /// The mode alone: everything else is left to the options.
    pub(crate) fn plain(mode: LaunchMode) -> Self {
        Cluster {
            mode,
            hosts: None,
            nodes: None,
            nproc_per_node: None,
            rdzv: None,
            task_ranks: None,
            port_probe: 0,
            node_list: Vec::new(),
            sources: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// The source of option `id` (clap's id: the field name), named by its `flag`.
pub fn option_source(args: &LaunchArgs, id: &str, flag: &str) -> Source {
    match args.origin(id) {
        Origin::CommandLine => Source::Flag(flag.to_owned()),
        Origin::Env(name) => Source::Env(name),
        Origin::Default => Source::Default,
    }
}

/// Decides the launch mode and the values the cluster path owns.
///
/// Order: a host table (`--hostfile`/`-H`) → Slurm (`SLURM_JOB_ID`) → Kubernetes (`PET_*`) → the
/// options alone.
///
/// # Errors
/// Every hostfile, filter, Slurm and Kubernetes error, with the place it was found.
pub fn resolve(args: &LaunchArgs, host: &HostInfo) -> Result<Cluster, PlanError> {
    let table = hostfile::resolve_table(args, host)?;
    let mut notes = Vec::new();
    if let Some(mut slurm) = slurm::detect(args, host, table.is_some(), &mut notes)? {
        slurm.notes.splice(0..0, notes);
        return Ok(slurm);
    }
    if let Some(table) = table {
        let n = table.entries.len() as u32;
        let mut c = Cluster::plain(LaunchMode::Hosts);
        for (id, var) in [("nnodes", "PET_NNODES"), ("nproc_per_node", "PET_NPROC_PER_NODE"), ("node_rank", "PET_NODE_RANK")] {
            if args.given(id) && args.origin(id) != crate::cli::Origin::CommandLine {
                notes.push(format!("{var} in the environment is not used: {} decides the nodes, their slots and ranks", table.origin));
            }
        }
        c.sources.push(Sourced::new(
            "nnodes",
            n,
            Source::Derived(format!("{} hosts in {}", n, table.origin)),
        ));
        c.nodes = Some(NodeRange { min: n, max: n });
        if let Some(Slots::Count(first)) = table.entries.first().map(|e| e.slots) {
            c.nproc_per_node = Some(first);
        }
        let external = args.given("rdzv_backend") && matches!(args.rdzv_backend.trim().to_ascii_lowercase().as_str(), "c10d" | "rsrun");
        if !external {
            // The ssh launcher embeds the service in this process and binds it to the address that
            // routes to the hosts, or to --rdzv-endpoint (multinode.md §2.6); only an explicit
            // `--rdzv-backend c10d` names an external daemon.
            c.rdzv = Some((RdzvPlan::Standalone, crate::plan::random_id(), None));
        }
        c.hosts = Some(table);
        c.notes = notes;
        return Ok(c);
    }
    if let Some(mut k) = k8s::detect(args, host)? {
        k.notes.splice(0..0, notes);
        return Ok(k);
    }
    let mut c = Cluster::plain(LaunchMode::SingleNode);
    c.notes = notes;
    Ok(c)
}

#[cfg(test)]
mod tests;
