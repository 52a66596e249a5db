//! Command-line arguments: torchrun's flags (with their `_` aliases and `PET_*` environment fallbacks)
//! plus rsrun's own additions.
//!
//! This is the first, pure phase of configuration: [`LaunchArgs`] holds what the user typed, mostly as
//! strings. [`crate::plan::LaunchPlan::resolve`] validates it and turns it into a plan; that is where
//! every semantic error (bad `--nnodes`, unknown program, ...) is reported.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};

/// `rsrun [OPTIONS] PROGRAM [ARGS...]`: a torchrun-compatible launcher.
///
/// Every option also reads `PET_<NAME>` from the environment when it is not given (for example
/// `PET_NPROC_PER_NODE=4`), and every `--long-option` has an underscore alias (`--nproc_per_node`).
/// Everything after PROGRAM is passed to it as torchrun passes it: `${local_rank}` and
/// `$local_rank` in ARGS become each worker's local rank; any other `$` stays (`$$` too, which
/// torchrun would make `$`).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "rsrun",
    version,
    about = "Launch and supervise distributed training workers (torchrun-compatible)",
    infer_long_args = true,
    // `--max-restarts -1` is a value to refuse by name, not an unknown option `-1`.
    allow_negative_numbers = true,
    max_term_width = 100
)]
pub struct LaunchArgs {
    // ------------------------------------------------------------------------------------------------
    // torchrun: topology
    /// Number of nodes: `N` or an elastic range `MIN:MAX`.
    #[arg(long, env = "PET_NNODES", default_value = "1:1", value_name = "N|MIN:MAX",
          help_heading = "Topology")]
    pub nnodes: String,

    /// Workers per node: a number, `cpu` (usable cores), `gpu` (visible GPUs), `auto` (GPUs if any,
    /// else cores) or `gpu-or-1` (GPUs if any, else one; what a bare hostfile host gets).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", env = "PET_NPROC_PER_NODE",
          default_value = "1", value_name = "N|auto|cpu|gpu", help_heading = "Topology")]
    pub nproc_per_node: String,

    /// This node's rank. Static backend: required for multi-node; elastic backends: a preference the
    /// rendezvous honours when that rank is free.
    #[arg(long = "node-rank", alias = "node_rank", env = "PET_NODE_RANK", value_name = "RANK",
          help_heading = "Topology")]
    pub node_rank: Option<u32>,

    /// Worker role name (ROLE_NAME).
    #[arg(long, env = "PET_ROLE", default_value = "default", help_heading = "Topology")]
    pub role: String,

    // ------------------------------------------------------------------------------------------------
    // torchrun: rendezvous
    /// Rendezvous backend: `c10d` (the rsrun-rendezvous daemon at --rdzv-endpoint; `rsrun` is an
    /// alias) or `static` (fixed --node-rank, node rank 0 hosts the rendezvous at
    /// --master-addr:--master-port, no elasticity). Default: `c10d` when --rdzv-endpoint is given
    /// without --node-rank (torchrun would pick static), else `static`.
    #[arg(long = "rdzv-backend", alias = "rdzv_backend", env = "PET_RDZV_BACKEND",
          default_value = "", hide_default_value = true, value_name = "BACKEND", help_heading = "Rendezvous")]
    pub rdzv_backend: String,

    /// Rendezvous endpoint `HOST[:PORT]` (IPv6 as `[ADDR]:PORT`; default port 29400).
    #[arg(long = "rdzv-endpoint", alias = "rdzv_endpoint", env = "PET_RDZV_ENDPOINT",
          default_value = "", value_name = "HOST[:PORT]", help_heading = "Rendezvous")]
    pub rdzv_endpoint: String,

    /// Job id shared by all nodes of one job (TORCHELASTIC_RUN_ID).
    #[arg(long = "rdzv-id", alias = "rdzv_id", env = "PET_RDZV_ID", value_name = "ID",
          help_heading = "Rendezvous")]
    pub rdzv_id: Option<String>,

    /// Rendezvous settings `k=v,...`: join_timeout, last_call_timeout, keep_alive_interval,
    /// keep_alive_max_attempt, lease_timeout (a node that cannot reach the daemon this long stops
    /// its workers), read_timeout, keep_alive_timeout (how long the daemon may stay unreachable
    /// before this node gives up, default 120), is_host (seconds unless noted).
    #[arg(long = "rdzv-conf", alias = "rdzv_conf", env = "PET_RDZV_CONF", default_value = "",
          value_name = "K=V,...", help_heading = "Rendezvous")]
    pub rdzv_conf: String,

    /// Single-node job: an in-memory rendezvous inside rsrun on a loopback port, random job id.
    #[arg(long, env = "PET_STANDALONE", value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Rendezvous")]
    pub standalone: bool,

    /// Static backend: address of node rank 0, which hosts the rendezvous there (workers get
    /// MASTER_ADDR:MASTER_PORT of the store it serves for each round). A --rdzv-endpoint wins.
    #[arg(long = "master-addr", alias = "master_addr", env = "PET_MASTER_ADDR", value_name = "ADDR",
          value_parser = unbracketed_host, help_heading = "Rendezvous")]
    pub master_addr: Option<String>,

    /// Static backend: the rendezvous port on node rank 0, which serves the round's PyTorch store
    /// there too (the workers' MASTER_PORT). A --rdzv-endpoint wins.
    #[arg(long = "master-port", alias = "master_port", env = "PET_MASTER_PORT", value_name = "PORT",
          help_heading = "Rendezvous")]
    pub master_port: Option<u16>,

    /// This node's address as other nodes reach it (default: the local address that routes to the
    /// rendezvous endpoint).
    #[arg(long = "local-addr", alias = "local_addr", env = "PET_LOCAL_ADDR", value_name = "ADDR",
          value_parser = unbracketed_host, help_heading = "Rendezvous")]
    pub local_addr: Option<String>,

    /// File holding the token that authenticates this node (and its workers) to the rendezvous daemon.
    #[arg(long = "rdzv-token-file", alias = "rdzv_token_file", env = "PET_RDZV_TOKEN_FILE",
          value_name = "PATH", help_heading = "Rendezvous")]
    pub rdzv_token_file: Option<PathBuf>,

    /// CA certificate (PEM) that signed the rendezvous daemon's TLS certificate: connect with TLS.
    /// Workers get its path as RSRUN_TLS_CA.
    #[arg(long = "rdzv-tls-ca", alias = "rdzv_tls_ca", env = "PET_RDZV_TLS_CA", value_name = "FILE",
          help_heading = "Rendezvous")]
    pub rdzv_tls_ca: Option<PathBuf>,

    // ------------------------------------------------------------------------------------------------
    // torchrun: supervision
    /// Restarts of the whole job after worker failures (one global budget; membership changes are
    /// free).
    #[arg(long = "max-restarts", alias = "max_restarts", env = "PET_MAX_RESTARTS", default_value_t = 0,
          value_name = "N", help_heading = "Supervision")]
    pub max_restarts: u32,

    /// Period of the hang detector's check. Worker exits are seen at once, without polling.
    #[arg(long = "monitor-interval", alias = "monitor_interval", env = "PET_MONITOR_INTERVAL",
          default_value = "0.1", value_name = "SECONDS", help_heading = "Supervision")]
    pub monitor_interval: String,

    /// Grace between the stop signal and SIGKILL when stopping workers (falls back to
    /// TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then 30 s).
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", env = "PET_SHUTDOWN_TIMEOUT",
          value_name = "SECONDS", help_heading = "Supervision")]
    pub shutdown_timeout: Option<String>,

    /// torchrun's list of signals that stop the job (same as `--signal-policy SIG=stop,...`).
    #[arg(long = "signals-to-handle", alias = "signals_to_handle", env = "PET_SIGNALS_TO_HANDLE",
          value_name = "SIG,...", help_heading = "Supervision")]
    pub signals_to_handle: Option<String>,

    /// What a signal received by rsrun does: `SIG=stop` (forward, grace, kill, exit 128+sig),
    /// `SIG=forward` (forward to all workers and keep supervising) or `SIG=ignore`.
    /// Default: INT,TERM,HUP,QUIT=stop and USR1,USR2=forward.
    #[arg(long = "signal-policy", alias = "signal_policy", env = "PET_SIGNAL_POLICY",
          value_name = "SIG=ACTION,...", help_heading = "Supervision")]
    pub signal_policy: Option<String>,

    /// Restart (or fail) when workers that report progress through the worker runtime report none for
    /// this long.
    #[arg(long = "hang-timeout", alias = "hang_timeout", env = "PET_HANG_TIMEOUT",
          value_name = "DURATION", help_heading = "Supervision")]
    pub hang_timeout: Option<String>,

    /// How long a node whose workers succeeded waits for the other nodes to finish.
    #[arg(long = "exit-barrier-timeout", alias = "exit_barrier_timeout",
          env = "PET_EXIT_BARRIER_TIMEOUT", default_value = "300", value_name = "DURATION",
          help_heading = "Supervision")]
    pub exit_barrier_timeout: String,

    // ------------------------------------------------------------------------------------------------
    // torchrun: program
    /// Run PROGRAM as a Python module (`python -u -m PROGRAM`).
    #[arg(short = 'm', long, env = "PET_MODULE", value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Program")]
    pub module: bool,

    /// Run PROGRAM directly, without a Python interpreter.
    #[arg(long = "no-python", alias = "no_python", env = "PET_NO_PYTHON",
          value_parser = BoolishValueParser::new(), action = clap::ArgAction::SetTrue,
          help_heading = "Program")]
    pub no_python: bool,

    /// Run PROGRAM as a Python script (torchrun's runpy entrypoint; rsrun runs `python -u PROGRAM`).
    #[arg(long = "run-path", alias = "run_path", env = "PET_RUN_PATH",
          value_parser = BoolishValueParser::new(), action = clap::ArgAction::SetTrue,
          help_heading = "Program")]
    pub run_path: bool,

    /// Each worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own device.
    #[arg(long = "virtual-local-rank", alias = "virtual_local_rank", env = "PET_VIRTUAL_LOCAL_RANK",
          value_parser = BoolishValueParser::new(), action = clap::ArgAction::SetTrue,
          help_heading = "Program")]
    pub virtual_local_rank: bool,

    /// CUDA_VISIBLE_DEVICES per worker: `none` (inherited) or `local-rank` (the local rank's entry of
    /// the inherited list, or the local rank).
    #[arg(long = "gpu-bind", alias = "gpu_bind", env = "PET_GPU_BIND", default_value = "none",
          value_name = "none|local-rank", help_heading = "Program")]
    pub gpu_bind: String,

    /// CPU affinity per worker: `none`, `cores` (an equal share of whole physical cores, SMT
    /// siblings together, taken from the NUMA node of the worker's GPU first) or `numa` (all CPUs of
    /// one NUMA node: the worker's GPU's when known, else the nodes in turn). A worker's GPU is its
    /// CUDA_VISIBLE_DEVICES entry (or its local rank), located by its PCI numa_node.
    #[arg(long = "cpu-bind", alias = "cpu_bind", env = "PET_CPU_BIND", default_value = "none",
          value_name = "none|cores|numa", help_heading = "Program")]
    pub cpu_bind: String,

    /// torchrun's CPU binding near each local rank's GPU: `node` (all CPUs of the GPU's NUMA node),
    /// `socket` (all CPUs of its package), `exclusive` (disjoint whole cores of the GPU's node,
    /// shared among the ranks there) or `core-complex` (an L3 cache domain of the GPU's node, one
    /// per rank while there are enough). Without a known GPU node, ranks take the nodes (packages)
    /// in turn. Not with a different --cpu-bind.
    #[arg(long = "numa-binding", alias = "numa_binding", env = "PET_NUMA_BINDING", value_name = "MODE",
          value_parser = ["node", "socket", "exclusive", "core-complex"],
          help_heading = "Program")]
    pub numa_binding: Option<String>,

    // ------------------------------------------------------------------------------------------------
    // torchrun: logs
    /// Base log directory; files go to `<dir>/<job>/attempt_<round>/<rank>/{stdout,stderr}.log`
    /// (default `.rsrun/logs` under the current directory). A re-run of the same job id keeps the
    /// earlier runs' files there as `NAME.1`, `NAME.2`, ... (the latest 16 of them).
    #[arg(long = "log-dir", alias = "log_dir", env = "PET_LOG_DIR", value_name = "DIR",
          help_heading = "Logs")]
    pub log_dir: Option<PathBuf>,

    /// Keep streams off the console (files only): `0` none, `1` stdout, `2` stderr, `3` both, or per
    /// local rank `0:1,1:2`.
    #[arg(short = 'r', long, env = "PET_REDIRECTS", value_name = "N|LR:N,...", help_heading = "Logs")]
    pub redirects: Option<String>,

    /// Streams shown on the console as well as written to files (rsrun's default is all of them).
    #[arg(short = 't', long, env = "PET_TEE", value_name = "N|LR:N,...", help_heading = "Logs")]
    pub tee: Option<String>,

    /// Console line prefix template; macros `${rank}`, `${local_rank}`, `${node_rank}`,
    /// `${role_name}`, `${hostname}`, `${round}`. Default `[rank ${rank}] `.
    #[arg(long = "log-prefix", alias = "log_prefix", env = "PET_LOG_PREFIX", value_name = "TEMPLATE",
          help_heading = "Logs")]
    pub log_prefix: Option<String>,

    /// torchrun's spelling of --log-prefix (also read from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE).
    #[arg(long = "log-line-prefix-template", alias = "log_line_prefix_template",
          env = "PET_LOG_LINE_PREFIX_TEMPLATE", value_name = "TEMPLATE", help_heading = "Logs")]
    pub log_line_prefix_template: Option<String>,

    /// Console output only for these local ranks, e.g. `0` or `0,2-3`.
    #[arg(long = "local-ranks-filter", alias = "local_ranks_filter", env = "PET_LOCAL_RANKS_FILTER",
          value_name = "RANKS", help_heading = "Logs")]
    pub local_ranks_filter: Option<String>,

    /// Console output only for these global ranks, e.g. `0` or `0,8-15`.
    #[arg(long = "ranks-filter", alias = "ranks_filter", env = "PET_RANKS_FILTER",
          value_name = "RANKS", help_heading = "Logs")]
    pub ranks_filter: Option<String>,

    /// Stdout lines containing any of these comma-separated substrings (`,,` escapes a comma) are also
    /// written to `attempt_<n>/filtered_stdout.log`.
    #[arg(long = "duplicate-stdout-filters", alias = "duplicate_stdout_filters",
          env = "PET_DUPLICATE_STDOUT_FILTERS", value_name = "S,...", help_heading = "Logs")]
    pub duplicate_stdout_filters: Option<String>,

    /// Same as --duplicate-stdout-filters for stderr (`filtered_stderr.log`).
    #[arg(long = "duplicate-stderr-filters", alias = "duplicate_stderr_filters",
          env = "PET_DUPLICATE_STDERR_FILTERS", value_name = "S,...", help_heading = "Logs")]
    pub duplicate_stderr_filters: Option<String>,

    // ------------------------------------------------------------------------------------------------
    // Accepted for torchrun compatibility; each prints a one-line warning saying what rsrun does.
    /// torchrun: multiprocessing start method for function entrypoints (no effect: rsrun runs
    /// programs).
    #[arg(long = "start-method", alias = "start_method", env = "PET_START_METHOD",
          value_name = "METHOD", value_parser = ["spawn", "fork", "forkserver"],
          help_heading = "Accepted for compatibility")]
    pub start_method: Option<String>,

    /// torchrun: events handler (no effect: rsrun logs its events through RSRUN_LOG).
    #[arg(long = "event-log-handler", alias = "event_log_handler", env = "PET_EVENT_LOG_HANDLER",
          value_name = "HANDLER", help_heading = "Accepted for compatibility")]
    pub event_log_handler: Option<String>,

    /// torchrun: LogsSpecs plugin (no effect: rsrun has one log layout).
    #[arg(long = "logs-specs", alias = "logs_specs", value_name = "NAME",
          help_heading = "Accepted for compatibility")]
    pub logs_specs: Option<String>,

    /// torchrun: shell completion script (not provided by rsrun).
    #[arg(long = "print-completion", alias = "print_completion", value_name = "SHELL",
          help_heading = "Accepted for compatibility")]
    pub print_completion: Option<String>,

    // ------------------------------------------------------------------------------------------------
    // rsrun: the cluster path
    /// Hostfile: one host per line, `host slots=N`, `host:N`, a bare `host` (slots from
    /// --nproc-per-node, else one per GPU there, else one), Slurm hostlists `node[01-04] slots=8`, `#`
    /// comments. File order is node order. The job is started on every host over ssh.
    #[arg(long, env = "RSRUN_HOSTFILE", value_name = "FILE", help_heading = "Cluster")]
    pub hostfile: Option<PathBuf>,

    /// Host list `h1:2,h2:4` (hostlists `n[1-4]:8` and `[ipv6]:N` allowed); like --hostfile.
    #[arg(short = 'H', long, env = "RSRUN_HOSTS", value_name = "HOST[:N],...", help_heading = "Cluster")]
    pub hosts: Option<String>,

    /// Use only these hosts and slots of the host table: `w1`, `w0@w1:0,2`, `w[0-3]:0-1`.
    #[arg(short = 'i', long, env = "RSRUN_INCLUDE", value_name = "HOST[:SLOTS]@...",
          help_heading = "Cluster")]
    pub include: Option<String>,

    /// Leave out these hosts or slots of the host table: `w1`, `w1:0`, `w[0-1]`.
    #[arg(short = 'e', long, env = "RSRUN_EXCLUDE", value_name = "HOST[:SLOTS]@...",
          help_heading = "Cluster")]
    pub exclude: Option<String>,

    /// Slurm: after a preemption notice (SIGTERM, SIGUSR1 or SIGUSR2) was passed to the workers and
    /// they exited (or the shutdown grace passed), node rank 0 runs `scontrol requeue <job id>` once.
    #[arg(long = "requeue-on-preempt", alias = "requeue_on_preempt", env = "RSRUN_REQUEUE_ON_PREEMPT",
          value_parser = BoolishValueParser::new(), action = clap::ArgAction::SetTrue, help_heading = "Cluster")]
    pub requeue_on_preempt: bool,

    // rsrun: one command for the whole job (ssh)
    /// Command used instead of `ssh`, called like ssh: `CMD [OPTIONS] -- HOST COMMAND` with stdin
    /// connected (a `kubectl exec -i` or `docker exec -i` wrapper, a test shim). Split on spaces.
    #[arg(long, env = "RSRUN_RSH", value_name = "CMD", help_heading = "Multi-node (ssh)")]
    pub rsh: Option<String>,

    /// ssh port of every host (`ssh -p`).
    #[arg(long = "ssh-port", alias = "ssh_port", env = "RSRUN_SSH_PORT", value_name = "PORT",
          value_parser = clap::value_parser!(u16).range(1..), help_heading = "Multi-node (ssh)")]
    pub ssh_port: Option<u16>,

    /// ssh identity file (`ssh -i`).
    #[arg(long = "ssh-identity", alias = "ssh_identity", env = "RSRUN_SSH_IDENTITY", value_name = "FILE",
          help_heading = "Multi-node (ssh)")]
    pub ssh_identity: Option<PathBuf>,

    /// ssh user (`ssh -l`).
    #[arg(long = "ssh-user", alias = "ssh_user", env = "RSRUN_SSH_USER", value_name = "USER",
          help_heading = "Multi-node (ssh)")]
    pub ssh_user: Option<String>,

    /// ssh configuration file (`ssh -F`).
    #[arg(long = "ssh-config", alias = "ssh_config", env = "RSRUN_SSH_CONFIG", value_name = "FILE",
          help_heading = "Multi-node (ssh)")]
    pub ssh_config: Option<PathBuf>,

    /// ssh ConnectTimeout, in seconds.
    #[arg(long = "ssh-connect-timeout", alias = "ssh_connect_timeout", env = "RSRUN_SSH_CONNECT_TIMEOUT",
          default_value_t = 10, value_name = "SECONDS", help_heading = "Multi-node (ssh)")]
    pub ssh_connect_timeout: u32,

    /// Extra ssh option `KEY=VALUE` (`ssh -o`), repeatable, e.g. `StrictHostKeyChecking=accept-new`.
    #[arg(long = "ssh-option", alias = "ssh_option", value_name = "KEY=VALUE", help_heading = "Multi-node (ssh)")]
    pub ssh_option: Vec<String>,

    /// Reach local hosts (localhost, 127.x, this host's name) through ssh too, instead of starting
    /// their agent directly.
    #[arg(long = "ssh-local", alias = "ssh_local", env = "RSRUN_SSH_LOCAL", value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Multi-node (ssh)")]
    pub ssh_local: bool,

    /// Allow several entries of the host list to be one machine (tests, or several nodes per
    /// machine). Without it, two entries whose agents report the same boot id and network namespace
    /// are refused before any worker starts.
    #[arg(long = "allow-same-host", alias = "allow_same_host", env = "RSRUN_ALLOW_SAME_HOST",
          value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Multi-node (ssh)")]
    pub allow_same_host: bool,

    /// At most N hosts connecting at once (a sliding window, like pdsh -f): the next host's ssh
    /// starts when one of them has started its agent or failed.
    #[arg(long = "ssh-fanout", alias = "ssh_fanout", env = "RSRUN_SSH_FANOUT", default_value_t = 128,
          value_parser = clap::value_parser!(u32).range(1..=65535), value_name = "N",
          help_heading = "Multi-node (ssh)")]
    pub ssh_fanout: u32,

    /// Preflight only: start an agent on every host (ssh, rsrun's version, the cwd, the program, the
    /// same-machine check), print one line per host, stop them, and exit (0: every host is ready;
    /// 2: one line per host that is not). No worker starts.
    #[arg(long, env = "RSRUN_CHECK", value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Multi-node (ssh)")]
    pub check: bool,

    /// Path of rsrun on the hosts (default: this rsrun's absolute path).
    #[arg(long = "remote-rsrun", alias = "remote_rsrun", env = "RSRUN_REMOTE_RSRUN", value_name = "PATH",
          help_heading = "Multi-node (ssh)")]
    pub remote_rsrun: Option<PathBuf>,

    /// Working directory of the agents and workers on every host (an absolute path; default: this
    /// directory, which every host must have, e.g. on a shared file system).
    #[arg(long, env = "RSRUN_CHDIR", value_name = "DIR", help_heading = "Multi-node (ssh)")]
    pub chdir: Option<PathBuf>,

    /// Forward a variable to every host: `NAME` (its value here) or `NAME=VALUE`. Repeatable.
    #[arg(short = 'x', long = "export", value_name = "NAME[=VALUE]", help_heading = "Multi-node (ssh)")]
    pub export: Vec<String>,

    /// Forward the `KEY=VALUE` lines of FILE (`#` comments, blank lines, no expansion). Repeatable.
    #[arg(long = "env-file", alias = "env_file", value_name = "FILE", help_heading = "Multi-node (ssh)")]
    pub env_file: Vec<PathBuf>,

    /// Forward this whole environment (except HOSTNAME, PWD, SSH_*, DISPLAY, TERM, SLURM_*, ...).
    #[arg(long = "export-all", alias = "export_all", value_parser = BoolishValueParser::new(),
          action = clap::ArgAction::SetTrue, help_heading = "Multi-node (ssh)")]
    pub export_all: bool,

    // ------------------------------------------------------------------------------------------------
    // rsrun
    /// Print the resolved plan (nodes, ranks, environment and command line per worker) and exit.
    #[arg(long = "dry-run", alias = "dry_run", env = "PET_DRY_RUN",
          value_parser = BoolishValueParser::new(), action = clap::ArgAction::SetTrue)]
    pub dry_run: bool,

    /// PROGRAM and its arguments. PROGRAM is a `.py` script or a module (run under `python -u`), or an
    /// executable path or a name on PATH (run directly). The arguments are passed as torchrun
    /// passes them (`${local_rank}` and `$local_rank` substituted); rsrun options after PROGRAM
    /// belong to PROGRAM.
    // (No `allow_hyphen_values`: with it, clap took a short option with its value attached,
    // `-t3` or `-r0:1` as torchrun's argparse reads them, for PROGRAM; `trailing_var_arg` alone
    // keeps everything after PROGRAM as it is, `--help` and `--` included.)
    #[arg(value_name = "PROGRAM [ARGS]", required = true, num_args = 1.., trailing_var_arg = true)]
    pub command: Vec<String>,

    /// Where each option's value came from (filled by [`LaunchArgs::parse_with_origins`]).
    #[arg(skip)]
    pub origins: ArgOrigins,
}

/// Where an option's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Typed on the command line.
    CommandLine,
    /// Read from this environment variable (`PET_NNODES`, `RSRUN_HOSTFILE`).
    Env(String),
    /// The default (or not given at all).
    Default,
}

/// The origin of every option that was given, by clap id (the field name). Options not listed have
/// their default. Plain `Parser::parse` leaves this empty: use [`LaunchArgs::parse_with_origins`]
/// wherever cluster detection matters (explicit options take precedence over Slurm and Kubernetes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ArgOrigins(BTreeMap<String, Origin>);

impl ArgOrigins {
    /// Records that option `id` came from `origin`.
    pub fn set(&mut self, id: &str, origin: Origin) {
        self.0.insert(id.to_owned(), origin);
    }
}

/// The environment variable (`PET_MAX_RESTARTS=abc`) behind a value clap refused, when the
/// option was not on the command line `argv` but its variable is set (`var` reads one).
pub fn env_source_of(err: &clap::Error, var: impl Fn(&str) -> Option<OsString>, argv: &[OsString]) -> Option<String> {
    let clap::error::ContextValue::String(arg) = err.get(clap::error::ContextKind::InvalidArg)? else { return None };
    let long = arg.split_whitespace().next()?.trim_start_matches('-').split('=').next()?.to_owned();
    let cmd = LaunchArgs::command();
    let a = cmd.get_arguments().find(|a| a.get_long() == Some(long.as_str()) || a.get_all_aliases().is_some_and(|al| al.contains(&long.as_str())))?;
    let env = a.get_env()?.to_string_lossy().into_owned();
    let on_line = argv.iter().any(|w| {
        let w = w.to_string_lossy();
        w == format!("--{long}") || w.starts_with(&format!("--{long}="))
    });
    let value = var(&env)?;
    (!on_line).then(|| format!("{env}={}", value.to_string_lossy()))
}

/// Names the first argument that is not valid UTF-8 (`argv[0]`, the program, is not counted).
pub fn non_utf8_argument(argv: &[OsString]) -> Option<String> {
    argv.iter().enumerate().skip(1).find(|(_, a)| a.to_str().is_none()).map(|(i, a)| {
        format!(
            "argument {i} ({:?}) is not valid UTF-8: rsrun passes its arguments, and the program's, as UTF-8 text",
            a.to_string_lossy()
        )
    })
}

impl LaunchArgs {
    /// Parses the process's arguments like `Parser::parse` (printing usage errors and exiting 2), and
    /// records where each value came from.
    pub fn parse_with_origins() -> Self {
        Self::try_parse_with_origins_from(std::env::args_os()).unwrap_or_else(|e| {
            let argv: Vec<OsString> = std::env::args_os().collect();
            if let Some(var) = env_source_of(&e, |v| std::env::var_os(v), &argv) {
                // clap names the flag; the user set a variable.
                eprintln!("rsrun: {var} in the environment sets that option:");
            }
            if e.kind() == clap::error::ErrorKind::InvalidUtf8 {
                // clap does not say which one.
                if let Some(which) = non_utf8_argument(&argv) {
                    eprintln!("rsrun: {which}");
                }
            }
            e.exit()
        })
    }

    /// Parses `argv` (with the program name first) and records where each value came from.
    ///
    /// # Errors
    /// clap's usage errors.
    pub fn try_parse_with_origins_from<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let cmd = Self::command();
        let envs: BTreeMap<String, String> = cmd
            .get_arguments()
            .filter_map(|a| Some((a.get_id().to_string(), a.get_env()?.to_string_lossy().into_owned())))
            .collect();
        let matches = cmd.try_get_matches_from(argv)?;
        let mut args = Self::from_arg_matches(&matches)?;
        for id in matches.ids() {
            let id = id.as_str();
            let origin = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => Origin::CommandLine,
                Some(ValueSource::EnvVariable) => Origin::Env(envs.get(id).cloned().unwrap_or_default()),
                _ => continue,
            };
            args.origins.set(id, origin);
        }
        Ok(args)
    }

    /// Where option `id` (the field name, e.g. `nnodes`) came from.
    pub fn origin(&self, id: &str) -> Origin {
        self.origins.0.get(id).cloned().unwrap_or(Origin::Default)
    }

    /// Whether option `id` was given, on the command line or in the environment.
    pub fn given(&self, id: &str) -> bool {
        self.origin(id) != Origin::Default
    }

    /// The program (first word of the command).
    pub fn program(&self) -> &str {
        self.command.first().map(String::as_str).unwrap_or("")
    }

    /// The program's arguments.
    pub fn program_args(&self) -> &[String] {
        self.command.get(1..).unwrap_or(&[])
    }

    /// Whether this is a whole-job launch over ssh (`--hosts` or `--hostfile`).
    pub fn is_remote(&self) -> bool {
        self.hosts.is_some() || self.hostfile.is_some()
    }
}

/// An address as given, without the brackets of a bracketed IPv6 address (`[::1]`, the form
/// torchrun's help shows): the brackets belong to `HOST:PORT`, not to the address, and a name
/// lookup of `[::1]` waited out the join timeout.
fn unbracketed_host(v: &str) -> Result<String, String> {
    let t = v.trim();
    match t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        Some(inner) if inner.parse::<std::net::Ipv6Addr>().is_ok() => Ok(inner.to_owned()),
        Some(_) => Err(format!("{t:?}: brackets hold an IPv6 address, such as [::1]")),
        None => Ok(v.to_owned()),
    }
}
