//! Kubernetes: PyTorchJob (training-operator v1, static and elastic) and TrainJob (Trainer v2) pods
//! run rsrun with no flags (multinode.md §4.2).
//!
//! The operators write `PET_*` variables, which clap already reads as the options' fallbacks; this
//! module decides what they mean:
//!
//! 1. `PET_RDZV_ENDPOINT` set: PyTorchJob v1 elastic, the rendezvous service at that endpoint (the
//!    backend defaults to c10d).
//! 2. Else `PET_MASTER_ADDR` + `PET_MASTER_PORT` with `PET_NNODES` > 1: the rsrun rendezvous hosted
//!    by node rank 0 at `PET_MASTER_ADDR:PET_MASTER_PORT` (`is_host` forced by rank), replacing
//!    torchrun's static TCPStore on the same, already-declared port. `--rdzv-backend static` (typed,
//!    or `PET_RDZV_BACKEND=static`) keeps torchrun's static backend. The node rank is
//!    `PET_NODE_RANK`, else `JOB_COMPLETION_INDEX`, never `RANK`; the run id is `PET_RDZV_ID`, else
//!    `k8s-<PET_MASTER_ADDR>`. PyTorchJob v1 also sets `MASTER_ADDR` and `RANK`; a TrainJob sets only
//!    `PET_*`.
//!
//! Options typed on the command line win over the operator's variables (multinode/mod.rs):
//! `--standalone` runs this pod as a single node, and `--rdzv-endpoint` names the rendezvous service
//! in place of `PET_MASTER_ADDR:PET_MASTER_PORT` (or `PET_RDZV_ENDPOINT`, which clap already replaces).
//!
//! Inherited worker-level names (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`)
//! are ignored for planning (PyTorchJob's `RANK` is the node index) and overwritten for every worker.
//! Workers get `PET_MASTER_PORT` as `MASTER_PORT`, as under torchrun: node rank 0's service serves
//! the running round's PyTorch store on its own port too (`rsrun_rendezvous::shared_port`).

use super::{Cluster, LaunchMode, Source, Sourced, option_source};
use crate::cli::{LaunchArgs, Origin};
use crate::plan::{DEFAULT_RDZV_PORT, Endpoint, HostInfo, HostMode, NodeRange, PlanError, RdzvPlan};

/// Worker-level names an operator may leave in the pod's environment.
pub const IGNORED: &[&str] = &["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"];

fn var<'a>(host: &'a HostInfo, name: &str) -> Option<&'a str> {
    host.env.get(name).map(|s| s.trim()).filter(|s| !s.is_empty())
}

/// Detects a Kubernetes pod from its `PET_*` variables. `None` when there are none to act on.
///
/// # Errors
/// A multi-node static job without a node rank, or malformed values.
pub fn detect(args: &LaunchArgs, host: &HostInfo) -> Result<Option<Cluster>, PlanError> {
    let backend = args.rdzv_backend.trim().to_ascii_lowercase();
    let backend_given = args.given("rdzv_backend");
    let typed = |id: &str| args.origin(id) == Origin::CommandLine;
    let pod = var(host, "PET_RDZV_ENDPOINT").is_some() || (var(host, "PET_MASTER_ADDR").is_some() && var(host, "PET_MASTER_PORT").is_some());
    if typed("standalone") {
        if !pod {
            return Ok(None);
        }
        // A single-node run: the operator's node count does not apply (a typed --nnodes still does,
        // and --standalone refuses more than one node).
        let mut c = Cluster::plain(LaunchMode::SingleNode);
        c.notes.push("PET_* variables of a Kubernetes job but --standalone: a single-node run, the job's rendezvous not used".into());
        if !typed("nnodes") {
            c.nodes = Some(NodeRange { min: 1, max: 1 });
            c.sources.push(Sourced::new("nnodes", 1, Source::Flag("--standalone".into())));
        }
        return Ok(Some(c));
    }
    if var(host, "PET_RDZV_ENDPOINT").is_some() {
        let mut c = Cluster::plain(LaunchMode::K8sV1Elastic);
        ignored_env(host, &mut c);
        let endpoint = Endpoint::parse(&args.rdzv_endpoint, "--rdzv-endpoint", DEFAULT_RDZV_PORT)?;
        let nodes = NodeRange::parse(&args.nnodes)?;
        let flag = if args.origin("rdzv_endpoint") == crate::cli::Origin::CommandLine { "--rdzv-endpoint" } else { "PET_RDZV_ENDPOINT" };
        crate::plan::port_zero_only_alone(&endpoint, nodes, flag, &args.rdzv_endpoint)?;
        c.sources.push(Sourced::new("nnodes", nodes, option_source(args, "nnodes", "--nnodes")));
        c.sources.push(Sourced::new("rendezvous", &endpoint, option_source(args, "rdzv_endpoint", "--rdzv-endpoint")));
        if backend_given && !matches!(backend.as_str(), "c10d" | "rsrun") {
            // An explicit other backend: the options path decides (and reports errors).
            return Ok(Some(c));
        }
        let (job_id, id_source) = match &args.rdzv_id {
            Some(id) => (id.clone(), option_source(args, "rdzv_id", "--rdzv-id")),
            None => (format!("k8s-{}", endpoint.host), Source::Derived("k8s-<PET_RDZV_ENDPOINT host>".into())),
        };
        c.sources.push(Sourced::new("run id", &job_id, id_source));
        if let Some(r) = args.node_rank {
            c.sources.push(Sourced::new("node rank", r, option_source(args, "node_rank", "--node-rank")));
        }
        c.nodes = Some(nodes);
        c.rdzv = Some((RdzvPlan::Daemon { endpoint, host: HostMode::Auto }, job_id, args.node_rank));
        return Ok(Some(c));
    }

    let (Some(_), Some(_)) = (var(host, "PET_MASTER_ADDR"), var(host, "PET_MASTER_PORT")) else {
        return Ok(None);
    };
    let nodes = NodeRange::parse(&args.nnodes)?;
    if nodes.max <= 1 {
        return Ok(None);
    }
    let version = if var(host, "MASTER_ADDR").is_some() && var(host, "RANK").is_some() {
        LaunchMode::K8sV1Static
    } else {
        LaunchMode::K8sV2
    };
    let mut c = Cluster::plain(version);
    ignored_env(host, &mut c);
    let (node_rank, rank_source) = match args.node_rank {
        Some(r) => (r, option_source(args, "node_rank", "--node-rank")),
        None => match var(host, "JOB_COMPLETION_INDEX") {
            Some(i) => (
                i.parse::<u32>()
                    .map_err(|_| PlanError::Hosts(format!("JOB_COMPLETION_INDEX={i}: expected a number")))?,
                Source::Env("JOB_COMPLETION_INDEX".into()),
            ),
            None => {
                return Err(PlanError::Hosts(format!(
                    "PET_NNODES={} but neither PET_NODE_RANK nor JOB_COMPLETION_INDEX is set: this pod's node rank is unknown (RANK is not used: PyTorchJob sets it to the node index)",
                    args.nnodes.trim()
                )));
            }
        },
    };
    if node_rank >= nodes.max {
        if rank_source == Source::Env("JOB_COMPLETION_INDEX".into()) {
            return Err(PlanError::Hosts(format!(
                "JOB_COMPLETION_INDEX={node_rank}: expected a node rank below PET_NNODES={} (the Indexed Job has more completions than the job has nodes)",
                args.nnodes.trim()
            )));
        }
        return Err(PlanError::Invalid {
            flag: "--node-rank",
            value: node_rank.to_string(),
            expected: format!("a rank below the number of nodes ({})", nodes.max),
        });
    }
    // Both are set: checked above, and clap read them into the options unless a flag overrode them.
    let addr = args.master_addr.clone().unwrap_or_default();
    let port = args.master_port.unwrap_or(0);
    let endpoint_typed = typed("rdzv_endpoint") && !args.rdzv_endpoint.trim().is_empty();
    if port == 0 && !endpoint_typed {
        return Err(PlanError::Invalid { flag: "--master-port", value: "0".into(), expected: "a port in 1..65535".into() });
    }
    let addr_source = option_source(args, "master_addr", "--master-addr");
    let port_source = option_source(args, "master_port", "--master-port");
    c.sources.push(Sourced::new("nnodes", nodes, option_source(args, "nnodes", "--nnodes")));
    c.sources.push(Sourced::new("node rank", node_rank, rank_source));
    c.nodes = Some(nodes);
    if backend_given && backend == "static" {
        c.sources.push(Sourced::new("backend", "static", option_source(args, "rdzv_backend", "--rdzv-backend")));
        c.sources.push(Sourced::new("MASTER_ADDR", &addr, addr_source));
        c.sources.push(Sourced::new("MASTER_PORT", port, port_source));
        let job_id = args.rdzv_id.clone().unwrap_or_else(|| "none".into());
        c.rdzv = Some((RdzvPlan::Static { node_rank, master_addr: addr, master_port: port }, job_id, None));
        return Ok(Some(c));
    }
    if backend_given && !matches!(backend.as_str(), "c10d" | "rsrun") {
        return Ok(Some(c));
    }
    let (endpoint, host_mode) = if endpoint_typed {
        // The service the user named: hosted as --rdzv-endpoint usually is (this host, if it is
        // the endpoint's and nothing listens there).
        let endpoint = Endpoint::parse(&args.rdzv_endpoint, "--rdzv-endpoint", DEFAULT_RDZV_PORT)?;
        crate::plan::port_zero_only_alone(&endpoint, nodes, "--rdzv-endpoint", &args.rdzv_endpoint)?;
        c.sources.push(Sourced::new("rendezvous", &endpoint, option_source(args, "rdzv_endpoint", "--rdzv-endpoint")));
        (endpoint, HostMode::Auto)
    } else {
        let endpoint = Endpoint { host: addr.clone(), port };
        c.sources.push(Sourced::new(
            "rendezvous",
            &endpoint,
            Source::Derived(format!("{addr_source} and {port_source}, hosted by node rank 0")),
        ));
        let host_mode = if node_rank == 0 { HostMode::Always } else { HostMode::Never };
        (endpoint, host_mode)
    };
    let (job_id, id_source) = match &args.rdzv_id {
        Some(id) => (id.clone(), option_source(args, "rdzv_id", "--rdzv-id")),
        None => (format!("k8s-{addr}"), Source::Derived(format!("k8s-<{addr_source}>"))),
    };
    c.sources.push(Sourced::new("run id", &job_id, id_source));
    c.rdzv = Some((RdzvPlan::Daemon { endpoint, host: host_mode }, job_id, Some(node_rank)));
    Ok(Some(c))
}

/// Notes for inherited worker-level variables: ignored for planning, overwritten for workers.
fn ignored_env(host: &HostInfo, c: &mut Cluster) {
    for name in IGNORED {
        if let Some(v) = host.env.get(*name) {
            let why = match *name {
                "RANK" => "PyTorchJob sets it to the node index",
                "WORLD_SIZE" => "PyTorchJob counts nodes × nproc; rsrun sets it for each worker",
                _ => "rsrun sets it for each worker",
            };
            c.notes.push(format!("ignored {name}={v} from the environment ({why})"));
        }
    }
}
