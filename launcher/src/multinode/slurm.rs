//! Slurm: mode detection and the plan mapping (multinode.md §3.2).
//!
//! ```text
//! SLURM_JOB_ID unset                  not Slurm
//! SLURM_STEP_NUM_TASKS set (srun)     hosts = SLURM_STEP_NODELIST, node = SLURM_NODEID
//!     one task on every node          Mode A: one rsrun agent per node, rendezvous hosted by node 0
//!     otherwise (any node > 1 task)   Mode B: srun started every rank; RANK = SLURM_PROCID, ...
//!                                     (one mode for the whole step, even where a node has 1 task)
//! batch script / salloc shell
//!     --hostfile or -H                the ssh launcher (a note)
//!     SLURM_JOB_NUM_NODES == 1        a local run
//!     otherwise                       Mode C: re-run under `srun --ntasks-per-node=1` (Mode A)
//! ```
//!
//! The node list is expanded by our own parser ([`super::hostlist`]), never by `scontrol`.
//! `SLURM_LAUNCH_NODE_IPADDR` (where srun ran) is never used. Options typed on the command line win
//! over the Slurm values they replace (`--rdzv-endpoint`, `--rdzv-id`, `--rdzv-backend static`,
//! `--master-addr`, `--master-port`); options that contradict the step (`--nnodes`, `--node-rank`)
//! are errors.

use std::collections::HashMap;

use super::{Cluster, LaunchMode, Source, Sourced, TaskRanks, hostlist, option_source};
use crate::cli::{LaunchArgs, Origin};
use crate::plan::{DEFAULT_RDZV_PORT, Endpoint, HostInfo, HostMode, MAX_NPROC_PER_NODE, NodeRange, PlanError, RdzvPlan};

/// First port of the derived rendezvous port range (above Linux's ephemeral range 32768-60999).
pub const PORT_BASE: u16 = 61000;
/// Size of the derived port range: 61000..=65535.
pub const PORT_SPAN: u64 = 4536;
/// When the Slurm port is taken (another step derived the same one), node 0 tries this many next
/// ports, and the other nodes search them for the service of their job.
pub const PORT_PROBE: u16 = 7;

fn err(msg: String) -> PlanError {
    PlanError::Hosts(msg)
}

/// The environment, with typed accessors whose errors name the variable.
struct Env<'a>(&'a HashMap<String, String>);

impl Env<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(|s| s.trim()).filter(|s| !s.is_empty())
    }

    fn num(&self, name: &str) -> Result<Option<u32>, PlanError> {
        self.get(name)
            .map(|v| v.parse::<u32>().map_err(|_| err(format!("{name}={v}: expected a number"))))
            .transpose()
    }

    fn need(&self, name: &str) -> Result<u32, PlanError> {
        self.num(name)?.ok_or_else(|| err(format!("{name} is not set, but srun sets it for every task")))
    }

    /// The first of `names` that is set, with its name.
    fn first<'n>(&self, names: &[&'n str]) -> Option<(&'n str, &str)> {
        names.iter().find_map(|n| self.get(n).map(|v| (*n, v)))
    }
}

/// Workers per node from `--nproc-per-node`, else `SLURM_GPUS_ON_NODE`, with its source; false when
/// neither decided (the caller's default applies).
fn nproc_per_node(args: &LaunchArgs, env: &Env<'_>, c: &mut Cluster) -> Result<bool, PlanError> {
    if args.given("nproc_per_node") {
        c.sources.push(Sourced::new(
            "nproc per node",
            args.nproc_per_node.trim(),
            option_source(args, "nproc_per_node", "--nproc-per-node"),
        ));
    } else if let Some(g) = env.num("SLURM_GPUS_ON_NODE")?.filter(|g| *g > 0) {
        if g > MAX_NPROC_PER_NODE {
            return Err(err(format!(
                "SLURM_GPUS_ON_NODE={g}: expected at most {MAX_NPROC_PER_NODE} (workers per node); pass --nproc-per-node"
            )));
        }
        c.nproc_per_node = Some(g);
        c.sources.push(Sourced::new("nproc per node", g, Source::Env("SLURM_GPUS_ON_NODE".into())));
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// The rendezvous port: `SLURM_STEP_RESV_PORTS`'s first port, else
/// `61000 + (SLURM_JOB_ID * 37 + SLURM_STEP_ID) mod 4536`.
///
/// # Errors
/// A malformed `SLURM_STEP_RESV_PORTS`.
pub fn select_port(env: &HashMap<String, String>) -> Result<(u16, Source), PlanError> {
    let env = Env(env);
    if let Some(ports) = env.get("SLURM_STEP_RESV_PORTS") {
        let first = ports.split([',', '-']).next().unwrap_or("");
        let port = first
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| err(format!("SLURM_STEP_RESV_PORTS={ports}: expected ports like 12000-12003")))?;
        return Ok((port, Source::Env("SLURM_STEP_RESV_PORTS".into())));
    }
    let job: u64 = env.get("SLURM_JOB_ID").and_then(|j| j.parse().ok()).unwrap_or(0);
    // "batch" and "extern" steps have no number; srun tasks do.
    let step: u64 = env.get("SLURM_STEP_ID").and_then(|s| s.parse().ok()).unwrap_or(0);
    // 37 is prime to 4536 (= 2^3 · 3^4 · 7): every job starts on a port of its own within the
    // span (with 32, a multiple of 8, jobs shared 567 starting ports, one in every 567 jobs).
    let port = u64::from(PORT_BASE) + (job.wrapping_mul(37).wrapping_add(step)) % PORT_SPAN;
    // PORT_BASE + PORT_SPAN - 1 == 65535.
    let port = u16::try_from(port).unwrap_or(u16::MAX);
    Ok((port, Source::Derived("61000 + (SLURM_JOB_ID*37 + SLURM_STEP_ID) mod 4536".into())))
}

/// How many ports past the first a taken port may be probed within `SLURM_STEP_RESV_PORTS`: the
/// rest of its range (at most [`PORT_PROBE`]), none for a list or a single port. `None` without a
/// reservation. The ports past a reservation are another step's.
fn reserved_probe(env: &HashMap<String, String>) -> Option<u16> {
    let ports = env.get("SLURM_STEP_RESV_PORTS").map(|s| s.trim()).filter(|s| !s.is_empty())?;
    let span = match ports.split_once('-') {
        Some((a, b)) if !ports.contains(',') => match (a.trim().parse::<u16>(), b.trim().parse::<u16>()) {
            (Ok(a), Ok(b)) => b.saturating_sub(a),
            _ => 0,
        },
        _ => 0,
    };
    Some(span.min(PORT_PROBE))
}

/// The run id: `slurm-<JOB_ID>.<STEP_ID>.r<SLURM_RESTART_COUNT>` (`<ARRAY_JOB_ID>_<ARRAY_TASK_ID>`
/// for array jobs).
pub fn run_id(env: &HashMap<String, String>) -> String {
    let env = Env(env);
    let job = match (env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")) {
        (Some(a), Some(t)) => format!("{a}_{t}"),
        _ => env.get("SLURM_JOB_ID").unwrap_or("0").to_owned(),
    };
    let step = env.get("SLURM_STEP_ID").unwrap_or("batch");
    let restarts = env.get("SLURM_RESTART_COUNT").unwrap_or("0");
    format!("slurm-{job}.{step}.r{restarts}")
}

/// `--requeue-on-preempt` (multinode.md §3.5): the job to requeue and whether this process is the
/// one that runs `scontrol requeue` (node rank 0: `SLURM_NODEID=0` in mode A, the task with
/// `SLURM_PROCID=0` in mode B, the only node of a one-node allocation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requeue {
    /// `SLURM_JOB_ID`, or `<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>` for an array task.
    pub job: String,
    /// This process runs it (the others only forward the signal).
    pub runner: bool,
}

impl Requeue {
    /// The command node rank 0 runs.
    pub fn argv(&self) -> [String; 3] {
        ["scontrol".to_owned(), "requeue".to_owned(), self.job.clone()]
    }
}

/// What `--requeue-on-preempt` means in launch mode `mode`.
///
/// # Errors
/// Not under Slurm (no job to requeue), or the ssh launcher (start the job under srun instead).
pub fn requeue(mode: &LaunchMode, env: &HashMap<String, String>) -> Result<Requeue, PlanError> {
    let e = Env(env);
    let job = match (e.get("SLURM_ARRAY_JOB_ID"), e.get("SLURM_ARRAY_TASK_ID")) {
        (Some(a), Some(t)) => format!("{a}_{t}"),
        _ => match e.get("SLURM_JOB_ID") {
            Some(j) => j.to_owned(),
            None => {
                return Err(PlanError::Conflict(
                    "--requeue-on-preempt needs a Slurm job (SLURM_JOB_ID is not set): it runs `scontrol requeue <job id>`".into(),
                ));
            }
        },
    };
    let runner = match mode {
        LaunchMode::SlurmA => e.num("SLURM_NODEID")? == Some(0),
        LaunchMode::SlurmB => e.num("SLURM_PROCID")? == Some(0),
        LaunchMode::SlurmLocal | LaunchMode::SlurmC { .. } => true,
        other => {
            return Err(PlanError::Conflict(format!(
                "--requeue-on-preempt works under Slurm (srun, or a batch script), not in launch mode \"{other}\""
            )));
        }
    };
    Ok(Requeue { job, runner })
}

/// Options whose presence means "the user configured this node by hand".
const MANUAL: &[&str] =
    &["rdzv_endpoint", "rdzv_backend", "master_addr", "master_port", "node_rank", "nnodes", "standalone"];

/// Detects Slurm and maps it to the plan. `None` when not under Slurm, or when the options take over
/// (a note says so).
///
/// # Errors
/// Inconsistent Slurm variables, a failed self-check, options that contradict the step, and the
/// double launch of Mode B.
pub fn detect(args: &LaunchArgs, host: &HostInfo, table_given: bool, notes: &mut Vec<String>) -> Result<Option<Cluster>, PlanError> {
    let env = Env(&host.env);
    let Some(job) = env.get("SLURM_JOB_ID") else { return Ok(None) };
    if args.origin("standalone") == Origin::CommandLine {
        notes.push(format!("SLURM_JOB_ID={job} but --standalone: a single-node run, Slurm not used"));
        return Ok(None);
    }
    if env.get("SLURM_STEP_NUM_TASKS").is_none() {
        return batch(args, host, table_given, notes);
    }
    // A step of one task (`srun --pty bash`, salloc with LaunchParameters=use_interactive_step,
    // `srun -n1 rsrun ...`) runs rsrun once, as a batch script does: a host table or options for
    // this node by hand take over there, as they do in a batch script.
    let one_task = env.num("SLURM_STEP_NUM_TASKS")? == Some(1);
    if one_task && (table_given || MANUAL.iter().any(|id| args.origin(id) == Origin::CommandLine)) {
        notes.push(format!(
            "SLURM_JOB_ID={job} in a step of one task (an interactive shell?): rsrun runs once here, {}",
            if table_given { "and starts the hosts of --hostfile/-H over ssh" } else { "with this node configured by its options" }
        ));
        return Ok(None);
    }
    if table_given {
        return Err(err(format!(
            "--hostfile/-H inside an srun step of several tasks (SLURM_JOB_ID={job}): every task would start the whole job; run rsrun once, from the batch script (or a step of one task)"
        )));
    }

    // The step's shape.
    let (list_var, list) = env
        .first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"])
        .ok_or_else(|| err("SLURM_STEP_NODELIST is not set, but srun sets it for every task".into()))?;
    let hosts = hostlist::expand(list)
        .map_err(|e| PlanError::At { place: format!("{list_var}={list}"), error: Box::new(e) })?;
    let (n_var, n) = match env.num("SLURM_STEP_NUM_NODES")? {
        Some(n) => ("SLURM_STEP_NUM_NODES", n),
        None => ("SLURM_NNODES", env.need("SLURM_NNODES")?),
    };
    let node = env.need("SLURM_NODEID")?;
    if hosts.len() != n as usize {
        return Err(err(format!(
            "{list_var}={list} has {} hosts but {n_var} is {n}",
            hosts.len()
        )));
    }
    if node >= n {
        return Err(err(format!("SLURM_NODEID={node} but the step has {n} nodes ({n_var})")));
    }
    let me = &hosts[node as usize];
    if let Some(name) = env.get("SLURMD_NODENAME")
        && name != me
    {
        return Err(err(format!(
            "SLURMD_NODENAME={name} but node SLURM_NODEID={node} of {list_var} is {me}: the node list and this node disagree (SLURM_HOSTFILE or a modified environment?)"
        )));
    }
    let ntasks = env.need("SLURM_STEP_NUM_TASKS")?;
    let (tpn_var, tpn_list) = env
        .first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
        .ok_or_else(|| err("SLURM_STEP_TASKS_PER_NODE is not set, but srun sets it for every task".into()))?;
    let tpn = hostlist::expand_counts(tpn_list)
        .map_err(|e| PlanError::At { place: tpn_var.to_owned(), error: Box::new(e) })?;
    if tpn.len() != n as usize || tpn.iter().map(|t| u64::from(*t)).sum::<u64>() != u64::from(ntasks) {
        return Err(err(format!(
            "{tpn_var}={tpn_list} does not match {n} nodes and SLURM_STEP_NUM_TASKS={ntasks}"
        )));
    }
    let here = tpn[node as usize];
    // An interactive shell that is itself a step (`srun --pty bash`, or salloc with
    // LaunchParameters=use_interactive_step) has the shape of that shell, not of the allocation.
    if env.get("SLURM_PTY_PORT").is_some()
        && let Some(job_nodes) = env.num("SLURM_JOB_NUM_NODES")?
        && job_nodes > n
    {
        notes.push(format!(
            "SLURM_PTY_PORT is set: rsrun runs in an interactive step of {n} node(s) ({n_var}) of an allocation of {job_nodes} (SLURM_JOB_NUM_NODES); to use them all, run `srun --nodes={job_nodes} --ntasks-per-node=1 --overlap rsrun ...` from this shell"
        ));
    }
    // One mode for the whole step (a node with one task in `srun -N2 -n3` runs Mode B too).
    let mode_b = ntasks != n || tpn.iter().any(|t| *t > 1);

    // Options typed on the command line that contradict the step (PET_* values lose to Slurm).
    if args.origin("nnodes") == Origin::CommandLine {
        let r = NodeRange::parse(&args.nnodes)?;
        if r.min != n || r.max != n {
            return Err(err(format!("--nnodes {} but the Slurm step has {n} nodes ({n_var})", args.nnodes.trim())));
        }
    }
    if let Some(r) = args.node_rank
        && r != node
        && args.origin("node_rank") == Origin::CommandLine
    {
        return Err(err(format!("--node-rank {r} but this is node {node} of the Slurm step (SLURM_NODEID)")));
    }

    let mut c = Cluster::plain(LaunchMode::SlurmA);
    c.sources.push(Sourced::new("nnodes", n, Source::Env(n_var.into())));
    c.sources.push(Sourced::new("node rank", node, Source::Env("SLURM_NODEID".into())));
    c.sources.push(Sourced::new("node list", hostlist::compress(&hosts), Source::Env(list_var.into())));
    c.node_list = hosts.clone();
    c.nodes = Some(NodeRange { min: n, max: n });

    let typed = |id: &str| args.origin(id) == Origin::CommandLine;
    // A typed --master-addr names node rank 0: it replaces the first host of the node list.
    let master_addr = match args.master_addr.as_deref().map(str::trim) {
        Some(a) if typed("master_addr") => {
            if !crate::plan::plausible_host(a) {
                return Err(PlanError::Invalid {
                    flag: "--master-addr",
                    value: a.to_owned(),
                    expected: "the host name or IP address of node rank 0".into(),
                });
            }
            Some(a.to_owned())
        }
        _ => None,
    };
    let (endpoint, endpoint_source, flag_endpoint) = if typed("rdzv_endpoint") && !args.rdzv_endpoint.trim().is_empty() {
        (
            Endpoint::parse(&args.rdzv_endpoint, "--rdzv-endpoint", DEFAULT_RDZV_PORT)?,
            option_source(args, "rdzv_endpoint", "--rdzv-endpoint"),
            true,
        )
    } else {
        let (port, port_source) = select_port(&host.env)?;
        c.sources.push(Sourced::new("rendezvous port", port, port_source));
        c.port_probe = reserved_probe(&host.env).unwrap_or(PORT_PROBE);
        match &master_addr {
            Some(a) => (Endpoint { host: a.clone(), port }, Source::Flag("--master-addr".into()), false),
            None => (
                Endpoint { host: hosts[0].clone(), port },
                Source::Derived(format!("first host of {list_var}")),
                false,
            ),
        }
    };
    // Where the static backend's node rank 0 is: --master-addr over the endpoint's host.
    let (master_host, master_source) = match &master_addr {
        Some(a) => (a.clone(), Source::Flag("--master-addr".into())),
        None => (endpoint.host.clone(), endpoint_source.clone()),
    };
    let (job_id, id_source) = match &args.rdzv_id {
        Some(id) if typed("rdzv_id") => (id.clone(), option_source(args, "rdzv_id", "--rdzv-id")),
        _ => (
            run_id(&host.env),
            Source::Derived("SLURM_JOB_ID, SLURM_STEP_ID, SLURM_RESTART_COUNT".into()),
        ),
    };

    if mode_b {
        // Mode B: srun started every rank.
        c.mode = LaunchMode::SlurmB;
        if args.given("nproc_per_node") && args.nproc_per_node.trim() != "1" {
            let total = u64::from(ntasks).saturating_mul(args.nproc_per_node.trim().parse::<u64>().unwrap_or(u64::from(here)));
            return Err(err(format!(
                "srun started {here} task{} on this node ({tpn_var}={tpn_list}), and each task is already one worker: --nproc-per-node {} would start {total} workers instead of {ntasks}; use `srun --ntasks-per-node=1 rsrun --nproc-per-node {}` or drop --nproc-per-node",
                if here == 1 { "" } else { "s" },
                args.nproc_per_node.trim(),
                args.nproc_per_node.trim(),
            )));
        }
        let rank = env.need("SLURM_PROCID")?;
        let local_rank = env.need("SLURM_LOCALID")?;
        if rank >= ntasks {
            return Err(err(format!("SLURM_PROCID={rank} but SLURM_STEP_NUM_TASKS={ntasks}")));
        }
        // Rank 0 hosts the static rendezvous, which the others look for on node 0 of the list; a
        // custom layout may put it elsewhere (the others would wait for nothing).
        if rank == 0 && node != 0 && master_addr.is_none() && !flag_endpoint {
            return Err(err(format!(
                "SLURM_PROCID=0 runs on node SLURM_NODEID={node} ({me}), but the other tasks look for its rendezvous on node 0 of {list_var} ({}): a custom task layout (SLURM_HOSTFILE, srun --distribution=arbitrary) is not supported; put task 0 on the first node, or pass --master-addr {me}",
                hosts[0]
            )));
        }
        if local_rank >= here {
            return Err(err(format!("SLURM_LOCALID={local_rank} but this node runs {here} tasks ({tpn_var})")));
        }
        // torchrun's ranks are contiguous per node (RANK = the tasks of the nodes before + LOCAL_RANK):
        // node-local groups (tensor parallelism, new_subgroups) rely on it. A cyclic or plane
        // distribution deals the ranks round the nodes instead.
        // (A typed --master-addr says the layout is the user's own: it is taken as given.)
        let block = tpn[..node as usize].iter().map(|t| u64::from(*t)).sum::<u64>() + u64::from(local_rank);
        if u64::from(rank) != block && master_addr.is_none() {
            return Err(err(format!(
                "SLURM_PROCID={rank} on node SLURM_NODEID={node} as its task SLURM_LOCALID={local_rank}: the ranks are not in blocks per node (expected {block}; SLURM_DISTRIBUTION={}); use srun --distribution=block",
                env.get("SLURM_DISTRIBUTION").unwrap_or("unset")
            )));
        }
        if let Some(cvd) = env.get("CUDA_VISIBLE_DEVICES")
            && local_rank > 0
            && cvd.split(',').filter(|d| !d.trim().is_empty()).count() == 1
        {
            notes.push(format!(
                "LOCAL_RANK={local_rank} but this task sees 1 GPU; use --virtual-local-rank or srun --gpu-bind=none"
            ));
        }
        let port = match &args.master_port {
            // A typed port is used as given: no probing.
            Some(p) if typed("master_port") => {
                c.port_probe = 0;
                *p
            }
            _ => endpoint.port,
        };
        c.sources.push(Sourced::new("rank", rank, Source::Env("SLURM_PROCID".into())));
        c.sources.push(Sourced::new("local rank", local_rank, Source::Env("SLURM_LOCALID".into())));
        c.sources.push(Sourced::new("world size", ntasks, Source::Env("SLURM_STEP_NUM_TASKS".into())));
        c.sources.push(Sourced::new("local world size", here, Source::Env(tpn_var.into())));
        c.sources.push(Sourced::new("nproc per node", 1, Source::Derived("one worker per srun task".into())));
        c.sources.push(Sourced::new("MASTER_ADDR", &master_host, master_source));
        c.sources.push(Sourced::new("run id", &job_id, id_source));
        c.nodes = Some(NodeRange { min: ntasks, max: ntasks });
        c.nproc_per_node = Some(1);
        c.rdzv = Some((RdzvPlan::Static { node_rank: rank, master_addr: master_host, master_port: port }, job_id, None));
        c.task_ranks = Some(TaskRanks { rank, local_rank, world_size: ntasks, local_world_size: here, node_rank: node, num_nodes: n });
        return Ok(Some(c));
    }

    // Mode A: one agent per node.
    if !nproc_per_node(args, &env, &mut c)? {
        c.sources.push(Sourced::new("nproc per node", 1, Source::Default));
    }
    let backend = args.rdzv_backend.trim().to_ascii_lowercase();
    if typed("rdzv_backend") && backend == "static" {
        let port = match &args.master_port {
            // A typed port is used as given: no probing.
            Some(p) if typed("master_port") => {
                c.port_probe = 0;
                *p
            }
            _ => endpoint.port,
        };
        c.sources.push(Sourced::new("backend", "static", option_source(args, "rdzv_backend", "--rdzv-backend")));
        c.sources.push(Sourced::new("MASTER_ADDR", &master_host, master_source));
        c.sources.push(Sourced::new("run id", &job_id, id_source));
        c.rdzv = Some((RdzvPlan::Static { node_rank: node, master_addr: master_host, master_port: port }, job_id, None));
    } else {
        if master_addr.is_some() && flag_endpoint {
            notes.push("--master-addr is not used with --rdzv-endpoint under Slurm mode A: the rendezvous service is at --rdzv-endpoint, and node rank 0 picks the workers' MASTER_ADDR".into());
        }
        // Node 0 hosts the embedded service: is_host forced by node rank, never guessed from
        // addresses (a user-given endpoint keeps the usual rule; --master-addr names node 0).
        let host_mode = if flag_endpoint {
            HostMode::Auto
        } else if node == 0 {
            HostMode::Always
        } else {
            HostMode::Never
        };
        c.sources.push(Sourced::new("rendezvous", &endpoint, endpoint_source));
        c.sources.push(Sourced::new("run id", &job_id, id_source));
        c.rdzv = Some((RdzvPlan::Daemon { endpoint, host: host_mode }, job_id, Some(node)));
    }
    Ok(Some(c))
}

/// Per-task requests of a batch script that srun reads from its environment (`--export=ALL`
/// passes them on): mode C's one agent per node must get the node's whole allocation (a step's
/// default), not one task's share of it (`#SBATCH --gpus-per-task=1` would leave it one GPU).
pub const PER_TASK_REQUESTS: [&str; 4] = ["SLURM_TRES_PER_TASK", "SLURM_GPUS_PER_TASK", "SLURM_NTASKS_PER_GPU", "SRUN_CPUS_PER_TASK"];

/// A batch script or salloc shell (no srun step).
fn batch(args: &LaunchArgs, host: &HostInfo, table_given: bool, notes: &mut Vec<String>) -> Result<Option<Cluster>, PlanError> {
    let env = Env(&host.env);
    let job = env.get("SLURM_JOB_ID").unwrap_or("");
    if table_given {
        notes.push(format!(
            "SLURM_JOB_ID={job}: --hostfile/-H given, so the hosts are started over ssh, not with srun"
        ));
        return Ok(None);
    }
    if let Some(id) = MANUAL.iter().find(|id| args.origin(id) == Origin::CommandLine) {
        notes.push(format!(
            "SLURM_JOB_ID={job} outside an srun step, with --{} given: running this node as configured",
            id.replace('_', "-")
        ));
        return Ok(None);
    }
    let (n_var, n) = match env.num("SLURM_JOB_NUM_NODES")? {
        Some(n) => ("SLURM_JOB_NUM_NODES", n),
        None => ("SLURM_NNODES", env.num("SLURM_NNODES")?.unwrap_or(1)),
    };
    // A batch script runs on the allocation's first node (slurmd sets SLURMD_NODENAME); an
    // salloc shell runs where salloc was typed, usually a login node: a local run there would
    // train on the login node, so it goes through srun too.
    let on_allocated_node = env.get("SLURMD_NODENAME").is_some_and(|s| !s.is_empty());
    if n <= 1 && on_allocated_node {
        let mut c = Cluster::plain(LaunchMode::SlurmLocal);
        nproc_per_node(args, &env, &mut c)?;
        return Ok(Some(c));
    }
    if !on_allocated_node {
        notes.push(format!(
            "SLURM_JOB_ID={job} without SLURMD_NODENAME: an salloc shell, not on the allocated nodes; the job runs on them through srun"
        ));
    }
    let srun: Vec<String> = vec![
        "srun".into(),
        format!("--nodes={n}"),
        // Typed, so a batch script's SLURM_NTASKS (#SBATCH --ntasks=16), which --export=ALL
        // passes on and srun reads as -n, cannot start several agents per node.
        format!("--ntasks={n}"),
        "--ntasks-per-node=1".into(),
        "--kill-on-bad-exit=1".into(),
        "--export=ALL".into(),
    ];
    notes.push(format!(
        "Slurm allocation of {n} nodes outside an srun step: running `{} <rsrun> <same arguments>` (one rsrun per node)",
        srun.join(" ")
    ));
    let dropped: Vec<String> =
        PER_TASK_REQUESTS.iter().filter_map(|v| env.get(v).map(|val| format!("{v}={val}"))).collect();
    if !dropped.is_empty() {
        notes.push(format!(
            "srun runs without the batch script's per-task requests ({}): each node's rsrun gets the node's whole allocation",
            dropped.join(", ")
        ));
    }
    let mut c = Cluster::plain(LaunchMode::SlurmC { srun });
    c.sources.push(Sourced::new("nnodes", n, Source::Env(n_var.into())));
    Ok(Some(c))
}
