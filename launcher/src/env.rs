//! The environment of each worker: exactly torchrun's variables (reference §2) plus rsrun's own.
//!
//! Workers inherit rsrun's whole environment; [`worker_env`] lists the variables rsrun sets on top of
//! it, in a stable order (the dry run prints them).
//!
//! Two deliberate differences from torchrun:
//! - `TORCHELASTIC_RESTART_COUNT` is the **job-global** count of failure restarts. rsrun keeps one
//!   restart budget for the whole job in the rendezvous service (`--max-restarts` is that budget), so
//!   every worker of a round sees the same count; torchrun counts per agent, so after a failure on
//!   another node its workers may see different counts. Membership changes (a node left or arrived)
//!   start a new round without incrementing it. With the static backend each node counts its own.
//! - Per-worker log and error-file directories are keyed by **global rank**:
//!   `<log-dir>/<job>/attempt_<round>/<RANK>/{stdout.log,stderr.log,error.json}` (torchrun keys them by
//!   local rank per node). Ranks are unique in a round, so nodes sharing a log directory (a network
//!   file system) never write into each other's files.

use std::ffi::OsString;
use std::path::Path;

use crate::plan::{GpuBind, LaunchPlan};

/// One round of the job as seen by this node: what the rendezvous decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundAssignment {
    /// Round number (attempt directory `attempt_<round>`, RSRUN_ROUND).
    pub round: u64,
    /// This node's rank (GROUP_RANK).
    pub node_rank: u32,
    /// Nodes in the round (GROUP_WORLD_SIZE).
    pub num_nodes: u32,
    /// Global rank of this node's local rank 0.
    pub rank_offset: u32,
    /// Workers on this node (LOCAL_WORLD_SIZE).
    pub local_world_size: u32,
    /// Workers in the round (WORLD_SIZE).
    pub world_size: u32,
    /// MASTER_ADDR: an address of the group-rank-0 node that the other nodes reach.
    pub master_addr: String,
    /// MASTER_PORT: the port of the TCPStore the rendezvous hosts for the round, or (`agent_store`
    /// false) a free port reserved by the group-rank-0 node, where rank 0 hosts PyTorch's store.
    pub master_port: u16,
    /// MASTER_ADDR:MASTER_PORT is a TCPStore served by rsrun (TORCHELASTIC_USE_AGENT_STORE=True).
    pub agent_store: bool,
    /// Failure restarts the whole job consumed so far (TORCHELASTIC_RESTART_COUNT): job-global, the
    /// same on every node (see the module docs).
    pub restart_count: u32,
    /// The job's restart budget (TORCHELASTIC_MAX_RESTARTS).
    pub max_restarts: u32,
    /// This node's id at the rendezvous (RSRUN_NODE_ID).
    pub node_id: String,
    /// The daemon workers reach for the store (RSRUN_RDZV_ENDPOINT); `None` for the static backend.
    pub rdzv_endpoint: Option<String>,
}

impl RoundAssignment {
    /// Global rank of `local_rank`.
    pub fn rank(&self, local_rank: u32) -> u32 {
        self.rank_offset + local_rank
    }
}

/// Variable carrying the path of the token file (never the token itself).
pub const TOKEN_FILE_VAR: &str = "RSRUN_TOKEN_FILE";
/// Variable carrying the number of the inherited progress socket.
pub const PROGRESS_FD_VAR: &str = "RSRUN_PROGRESS_FD";
/// Variable carrying the pid of the process that made the progress socket (rsrun): the worker
/// adopts the descriptor only if its peer is that process.
pub const PROGRESS_PEER_VAR: &str = "RSRUN_PROGRESS_PEER";
/// Variable carrying the launch marks of the rsruns a worker runs under, `:`-separated, outermost
/// first: each rsrun appends its own (a random 128-bit hex, [`crate::worker::Guardian`]) to the
/// value it inherited. Whatever a worker starts inherits it, wherever it goes (`setsid`, a
/// daemon's double fork), so the guardian finds those processes by it whenever rsrun exits (in
/// their initial environment block: one exec'd with a fresh environment carries none).
pub const LAUNCH_MARKS_VAR: &str = "RSRUN_LAUNCH_MARKS";
/// Variable carrying the path of the CA certificate of the daemon's TLS certificate (`--rdzv-tls-ca`).
pub const TLS_CA_VAR: &str = "RSRUN_TLS_CA";

/// The variables rsrun sets for the worker with `local_rank`, in display order.
///
/// `error_file` is the worker's TORCHELASTIC_ERROR_FILE (`None` when log files are disabled: the
/// variable is then empty, as in torchrun).
pub fn worker_env(
    plan: &LaunchPlan,
    a: &RoundAssignment,
    local_rank: u32,
    error_file: Option<&Path>,
) -> Vec<(String, OsString)> {
    let rank = a.rank(local_rank);
    // Slurm mode B: srun started this process as one rank, and Slurm's numbering is the truth for
    // the local and node-level names (the static backend sees one worker per task).
    let (local_rank_shown, local_world, group_rank, group_world) = match &plan.task_ranks {
        Some(t) => (t.local_rank, t.local_world_size, t.node_rank, t.num_nodes),
        None => (local_rank, a.local_world_size, a.node_rank, a.num_nodes),
    };
    let visible_local_rank = if plan.virtual_local_rank { 0 } else { local_rank_shown };
    let mut env: Vec<(String, OsString)> = vec![
        ("LOCAL_RANK".into(), visible_local_rank.to_string().into()),
        ("RANK".into(), rank.to_string().into()),
        ("GROUP_RANK".into(), group_rank.to_string().into()),
        // One role per job: role rank and world are the global ones.
        ("ROLE_RANK".into(), rank.to_string().into()),
        ("ROLE_NAME".into(), plan.role.clone().into()),
        ("LOCAL_WORLD_SIZE".into(), local_world.to_string().into()),
        ("WORLD_SIZE".into(), a.world_size.to_string().into()),
        ("GROUP_WORLD_SIZE".into(), group_world.to_string().into()),
        ("ROLE_WORLD_SIZE".into(), a.world_size.to_string().into()),
        ("MASTER_ADDR".into(), a.master_addr.clone().into()),
        ("MASTER_PORT".into(), a.master_port.to_string().into()),
        ("TORCHELASTIC_RESTART_COUNT".into(), a.restart_count.to_string().into()),
        ("TORCHELASTIC_MAX_RESTARTS".into(), a.max_restarts.to_string().into()),
        ("TORCHELASTIC_RUN_ID".into(), plan.job_id.clone().into()),
        // True: rsrun serves PyTorch's store at MASTER_ADDR:MASTER_PORT (it outlives rank 0, and every
        // attempt gets a fresh one); False: rank 0 hosts it (env:// default).
        ("TORCHELASTIC_USE_AGENT_STORE".into(), if a.agent_store { "True" } else { "False" }.into()),
        // A path, kept as the OS has it (a non-UTF-8 directory stays openable).
        ("TORCHELASTIC_ERROR_FILE".into(), error_file.map(|p| p.as_os_str().to_owned()).unwrap_or_default()),
        // torchrun's workers see the signals its agent handles (torchrun.md §2): here, the ones
        // that stop the job.
        (
            "TORCHELASTIC_SIGNALS_TO_HANDLE".into(),
            plan.signals
                .entries()
                .filter(|(_, action)| *action == crate::signals::SignalAction::Stop)
                .map(|(sig, _)| sig.as_str())
                .collect::<Vec<_>>()
                .join(",")
                .into(),
        ),
    ];
    env.extend(plan.extra_env.iter().map(|(k, v)| (k.clone(), v.into())));
    if let GpuBind::LocalRank(devices) = &plan.gpu_bind
        && let Some(d) = devices.get(local_rank as usize)
    {
        env.push(("CUDA_VISIBLE_DEVICES".into(), d.into()));
    }
    if let Some(ep) = &a.rdzv_endpoint {
        env.push(("RSRUN_RDZV_ENDPOINT".into(), ep.into()));
    }
    env.push(("RSRUN_JOB_ID".into(), (&plan.job_id).into()));
    env.push(("RSRUN_ROUND".into(), a.round.to_string().into()));
    env.push(("RSRUN_NODE_ID".into(), (&a.node_id).into()));
    // Always set, empty when this job has none (the worker runtime reads empty as unset): a
    // worker inherits rsrun's whole environment, and a token file or CA exported there (or
    // set for an outer rsrun's job) would otherwise be used against this job's service.
    let endpoint = a.rdzv_endpoint.is_some();
    for (var, path) in [(TOKEN_FILE_VAR, &plan.token_file), (TLS_CA_VAR, &plan.tls_ca)] {
        let value = path.as_ref().filter(|_| endpoint).map(|p| p.as_os_str().to_owned()).unwrap_or_default();
        env.push((var.into(), value));
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::LaunchArgs;
    use crate::plan::tests::{host, parse};

    fn assignment() -> RoundAssignment {
        RoundAssignment {
            round: 3,
            node_rank: 1,
            num_nodes: 2,
            rank_offset: 4,
            local_world_size: 4,
            world_size: 8,
            master_addr: "10.0.0.1".into(),
            master_port: 41234,
            agent_store: true,
            restart_count: 1,
            max_restarts: 3,
            node_id: "n1".into(),
            rdzv_endpoint: Some("10.0.0.9:29400".into()),
        }
    }

    fn plan(extra: &[&str]) -> LaunchPlan {
        let args: LaunchArgs = parse(&[&["--nproc-per-node", "4"], extra, &["--no-python", "true"]].concat());
        LaunchPlan::resolve(&args, &host()).unwrap()
    }

    #[test]
    fn torchrun_variables() {
        let p = plan(&["--rdzv-id", "job7", "--max-restarts", "3"]);
        let env = worker_env(&p, &assignment(), 2, Some(Path::new("/l/attempt_3/6/error.json")));
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.to_str().expect("UTF-8 in this test"));
        assert_eq!(get("LOCAL_RANK"), Some("2"));
        assert_eq!(get("RANK"), Some("6"));
        assert_eq!(get("GROUP_RANK"), Some("1"));
        assert_eq!(get("ROLE_RANK"), Some("6"));
        assert_eq!(get("ROLE_NAME"), Some("default"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("4"));
        assert_eq!(get("WORLD_SIZE"), Some("8"));
        assert_eq!(get("GROUP_WORLD_SIZE"), Some("2"));
        assert_eq!(get("ROLE_WORLD_SIZE"), Some("8"));
        assert_eq!(get("MASTER_ADDR"), Some("10.0.0.1"));
        assert_eq!(get("MASTER_PORT"), Some("41234"));
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), Some("1"));
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), Some("3"));
        assert_eq!(get("TORCHELASTIC_RUN_ID"), Some("job7"));
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), Some("True"));
        assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some("/l/attempt_3/6/error.json"));
        // The signals that stop the job (the default policy: INT, TERM, HUP, QUIT), as torchrun.
        assert_eq!(get("TORCHELASTIC_SIGNALS_TO_HANDLE"), Some("SIGHUP,SIGINT,SIGQUIT,SIGTERM"));
        assert_eq!(get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), Some("1"));
        assert_eq!(get("OMP_NUM_THREADS"), Some("1"));
        assert_eq!(get("RSRUN_RDZV_ENDPOINT"), Some("10.0.0.9:29400"));
        assert_eq!(get("RSRUN_ROUND"), Some("3"));
        assert_eq!(get("RSRUN_NODE_ID"), Some("n1"));
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), None);
        // Set empty (unset for the worker runtime): an inherited value must not reach workers.
        assert_eq!(get("RSRUN_TLS_CA"), Some(""));
        assert_eq!(get("RSRUN_TOKEN_FILE"), Some(""));
    }

    #[test]
    fn tls_ca_reaches_workers_of_a_tls_daemon() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&ca, rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap().pem()).unwrap();
        let ca_s = ca.display().to_string();
        let p = plan(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.9:29400", "--rdzv-id", "j", "--rdzv-tls-ca", &ca_s]);
        assert_eq!(p.tls_ca.as_deref(), Some(ca.as_path()));
        let env = worker_env(&p, &assignment(), 0, None);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.to_str().expect("UTF-8 in this test"));
        assert_eq!(get("RSRUN_TLS_CA"), Some(ca_s.as_str()));
        // The static backend has no daemon to reach.
        let p = plan(&["--nnodes", "2", "--master-addr", "10.0.0.1", "--rdzv-tls-ca", &ca_s]);
        assert_eq!(p.tls_ca, None);
        assert!(p.notes.iter().any(|n| n.contains("--rdzv-tls-ca")), "{:?}", p.notes);
    }

    /// Paths reach the worker byte for byte: a log directory whose name is not UTF-8 still gives
    /// an error file the worker can write.
    #[test]
    fn paths_are_passed_as_the_os_has_them() {
        use std::os::unix::ffi::OsStrExt;
        let file = Path::new(std::ffi::OsStr::from_bytes(b"/l/r\xfcn/error.json"));
        let env = worker_env(&plan(&[]), &assignment(), 0, Some(file));
        let got = env.iter().find(|(n, _)| n == "TORCHELASTIC_ERROR_FILE").map(|(_, v)| v.as_bytes());
        assert_eq!(got, Some(&b"/l/r\xfcn/error.json"[..]));
    }

    #[test]
    fn virtual_local_rank_binds_gpu() {
        let p = plan(&["--virtual-local-rank"]);
        let env = worker_env(&p, &assignment(), 3, None);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.to_str().expect("UTF-8 in this test"));
        assert_eq!(get("LOCAL_RANK"), Some("0"));
        assert_eq!(get("CUDA_VISIBLE_DEVICES"), Some("3"));
        assert_eq!(get("TORCHELASTIC_ERROR_FILE"), Some(""));
    }
}
