//! `LaunchArgs` with `--hosts`/`--hostfile` → a validated [`RemotePlan`]: the hosts with their node
//! ranks and exact start command, the rendezvous the agents meet at, the forwarded environment and
//! the per-node options. Every user error is found here, before anything starts (exit 2).

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cli::LaunchArgs;
use crate::plan::{Endpoint, HostInfo, LaunchPlan, PlanError, parse_duration};
use crate::signals::SignalPolicy;
use super::Slots;

use super::command::{SshConfig, is_local_host, local_argv, option_key, option_value, ssh_argv};
use super::env::{EnvSources, ForwardedEnv, forwarded_env};
use super::RemoteHost;

/// One host of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteNode {
    /// The host as listed.
    pub host: RemoteHost,
    /// Its node rank (its position in the list).
    pub node_rank: u32,
    /// Global rank of its local rank 0 (ranks are contiguous per host); `None` after a host of
    /// `auto` slots (known once its agent starts).
    pub rank_offset: Option<u32>,
    /// Started directly, without ssh (a local host without `--ssh-local`).
    pub local: bool,
    /// The exact command that starts its agent.
    pub argv: Vec<OsString>,
}

/// Where the agents meet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteRdzv {
    /// A rendezvous service inside this rsrun, bound at `bind` (port 0: any free port) and reached by
    /// the agents at `advertise:PORT`.
    Embedded {
        /// The listening address.
        bind: SocketAddr,
        /// The host part of the endpoint the agents are given.
        advertise: String,
    },
    /// An `rsrun-rendezvous` daemon (`--rdzv-backend c10d --rdzv-endpoint`).
    External {
        /// Its endpoint.
        endpoint: Endpoint,
    },
}

/// The CA that verifies an external daemon's TLS certificate (`--rdzv-tls-ca`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsCa {
    /// The file on this machine (the head's own client reads it).
    pub path: PathBuf,
    /// Its PEM certificates, which every agent gets in its `NodeLaunch`.
    pub pem: Vec<u8>,
}

/// Everything the head needs, validated.
#[derive(Debug, Clone)]
pub struct RemotePlan {
    /// Job id (`--rdzv-id`, or `ssh-HOST-PID-TIME`).
    pub job_id: String,
    /// The hosts in node-rank order.
    pub nodes: Vec<RemoteNode>,
    /// The rendezvous.
    pub rdzv: RemoteRdzv,
    /// The token the agents present (generated per job for the embedded service). Travels only inside
    /// `NodeLaunch`.
    pub token: Option<String>,
    /// The CA of the daemon's TLS certificate (external daemon only).
    pub tls_ca: Option<TlsCa>,
    /// Forwarded variables.
    pub env: ForwardedEnv,
    /// Working directory on every host.
    pub cwd: PathBuf,
    /// PROGRAM and its arguments.
    pub program: Vec<String>,
    /// Per-node rsrun options (`--flag=value`), validated here, parsed again by each agent.
    pub options: Vec<String>,
    /// The rsrun path started on remote hosts.
    pub remote_rsrun: PathBuf,
    /// ssh settings.
    pub ssh: SshConfig,
    /// Workers' grace between the stop signal and SIGKILL (agents get the same value).
    pub shutdown: Duration,
    /// How long an agent may take to say it started.
    pub start_timeout: Duration,
    /// Signals the head handles.
    pub signals: SignalPolicy,
    /// One-line notes for the console.
    pub notes: Vec<String>,
    /// Print the plan and exit.
    pub dry_run: bool,
    /// At most this many hosts connecting (not yet started) at once (`--ssh-fanout`).
    pub fanout: usize,
    /// Preflight only (`--check`): every agent checks its host and stops; no worker starts.
    pub check: bool,
    /// Several entries may be one machine (`--allow-same-host`).
    pub allow_same_host: bool,
}

/// Beyond ssh's ConnectTimeout, how long an agent may take to read its plan and say it started.
const START_SLACK: Duration = Duration::from_secs(20);

fn conflict(s: impl Into<String>) -> PlanError {
    PlanError::Conflict(s.into())
}

/// The per-node options (`--flag=value`) that every agent runs with, from the head's arguments.
/// Multi-node flags, the topology (hosts decide it) and the rendezvous (the head decides it) are not
/// among them.
pub fn agent_options(args: &LaunchArgs, shutdown: Duration) -> Vec<String> {
    let mut o = Vec::new();
    let mut opt = |flag: &str, v: Option<&str>| {
        if let Some(v) = v {
            o.push(format!("--{flag}={v}"));
        }
    };
    opt("role", Some(&args.role));
    opt("max-restarts", Some(&args.max_restarts.to_string()));
    opt("monitor-interval", Some(&args.monitor_interval));
    opt("shutdown-timeout", Some(&format!("{}", shutdown.as_secs_f64())));
    opt("signals-to-handle", args.signals_to_handle.as_deref());
    opt("signal-policy", args.signal_policy.as_deref());
    opt("hang-timeout", args.hang_timeout.as_deref());
    opt("exit-barrier-timeout", Some(&args.exit_barrier_timeout));
    opt("gpu-bind", Some(&args.gpu_bind));
    opt("cpu-bind", Some(&args.cpu_bind));
    opt("numa-binding", args.numa_binding.as_deref());
    opt("log-dir", args.log_dir.as_deref().and_then(Path::to_str));
    opt("redirects", args.redirects.as_deref());
    opt("tee", args.tee.as_deref());
    opt("log-prefix", args.log_prefix.as_deref());
    opt("log-line-prefix-template", args.log_line_prefix_template.as_deref());
    opt("local-ranks-filter", args.local_ranks_filter.as_deref());
    opt("ranks-filter", args.ranks_filter.as_deref());
    opt("duplicate-stdout-filters", args.duplicate_stdout_filters.as_deref());
    opt("duplicate-stderr-filters", args.duplicate_stderr_filters.as_deref());
    let conf = args.rdzv_conf.trim().trim_end_matches(',');
    // The agents never host a service: the head does.
    opt("rdzv-conf", Some(&if conf.is_empty() { "is_host=false".to_owned() } else { format!("{conf},is_host=false") }));
    for (flag, on) in [
        ("module", args.module),
        ("no-python", args.no_python),
        ("run-path", args.run_path),
        ("virtual-local-rank", args.virtual_local_rank),
    ] {
        if on {
            o.push(format!("--{flag}"));
        }
    }
    o
}

/// One node's place in the job, as its agent is told.
#[derive(Debug, Clone, Copy)]
pub struct NodePlace<'a> {
    /// Nodes in the job.
    pub nnodes: u32,
    /// Workers on this node (`--nproc-per-node`).
    pub nproc_per_node: &'a str,
    /// This node's rank (the rendezvous' rank hint).
    pub node_rank: u32,
    /// The rendezvous endpoint.
    pub endpoint: &'a str,
    /// The job id.
    pub job_id: &'a str,
    /// The token file written by the agent, if the service needs a token.
    pub token_file: Option<&'a Path>,
    /// The CA file written by the agent, if the service speaks TLS.
    pub tls_ca_file: Option<&'a Path>,
}

/// The argv (without the program name) an agent resolves its plan from: the options, then the
/// node's place in the job, then `--` and PROGRAM ARGS.
pub fn agent_argv(options: &[String], place: NodePlace<'_>, program: &[String]) -> Vec<String> {
    let mut v: Vec<String> = options.to_vec();
    v.extend([
        format!("--nnodes={}", place.nnodes),
        format!("--nproc-per-node={}", place.nproc_per_node),
        format!("--node-rank={}", place.node_rank),
        "--rdzv-backend=c10d".to_owned(),
        format!("--rdzv-endpoint={}", place.endpoint),
        format!("--rdzv-id={}", place.job_id),
    ]);
    if let Some(t) = place.token_file {
        v.push(format!("--rdzv-token-file={}", t.display()));
    }
    if let Some(ca) = place.tls_ca_file {
        v.push(format!("--rdzv-tls-ca={}", ca.display()));
    }
    v.push("--".to_owned());
    v.extend(program.iter().cloned());
    v
}

/// A job id that passes the rendezvous service's checks: `ssh-HOST-PID-SECONDS`.
fn default_job_id(hostname: &str) -> String {
    let clean: String = hostname
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
        .take(64)
        .collect();
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("ssh-{clean}-{}-{secs}", std::process::id())
}

/// The local address that routes to `host` (UDP connect, no packet sent), if it resolves.
fn route_to(host: &str) -> Option<IpAddr> {
    let target = (host, 22).to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr = if target.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

/// The node plan as this machine would run it, for the head's own checks of the per-node values and
/// for `--dry-run`, resolved in `--chdir DIR` when this machine has that directory. What depends on
/// the host (the program and its interpreter, GPUs, the CPU topology) is each agent's check on its
/// own host: such an error comes back as `Ok(Err(..))` and the head goes on, so that `rsrun -H
/// g1:8,g2:8 --chdir /scratch/job train.py` starts from a login node that has neither the script
/// nor Python.
///
/// # Errors
/// A malformed value (or host list): the head refuses it before anything starts.
pub fn head_node_plan(args: &LaunchArgs, host: &HostInfo) -> Result<Result<LaunchPlan, PlanError>, PlanError> {
    let mut here = host.clone();
    if let Some(d) = args.chdir.as_ref().filter(|d| d.is_absolute() && d.is_dir()) {
        here.cwd.clone_from(d);
    }
    match LaunchPlan::resolve(args, &here) {
        Ok(plan) => Ok(Ok(plan)),
        Err(e) if checked_by_each_host(&e) => Ok(Err(e)),
        Err(e) => Err(e),
    }
}

/// A plan error that the agents find on their hosts (the program, Python, flags that need something
/// of the host), as opposed to a malformed value, which is wrong everywhere.
fn checked_by_each_host(e: &PlanError) -> bool {
    matches!(e, PlanError::Program(_) | PlanError::Conflict(_))
}

impl RemotePlan {
    /// Validates `args` (with `--hosts` or `--hostfile`) against this host; `exe` is this rsrun's
    /// absolute path.
    ///
    /// # Errors
    /// The first user error found.
    pub fn resolve(args: &LaunchArgs, host: &HostInfo, exe: &Path) -> Result<RemotePlan, PlanError> {
        // Hosts: the full grammar, include/exclude, --nnodes and --nproc-per-node (multinode).
        let Some(table) = crate::multinode::hostfile::resolve_table(args, host)? else {
            return Err(conflict("remote launch needs --hosts or --hostfile"));
        };
        let mut list = Vec::with_capacity(table.entries.len());
        for e in table.entries {
            list.push(RemoteHost { host: e.host, slots: e.slots, devices: e.devices, user: e.user, port: e.port, addr: e.addr });
        }
        Self::resolve_hosts(args, host, exe, list)
    }

    /// [`RemotePlan::resolve`] for an already parsed host list (the merge point with
    /// `multinode::hostfile`).
    ///
    /// # Errors
    /// The first user error found.
    pub fn resolve_hosts(
        args: &LaunchArgs,
        host: &HostInfo,
        exe: &Path,
        list: Vec<RemoteHost>,
    ) -> Result<RemotePlan, PlanError> {
        let mut notes = Vec::new();
        let n_hosts = u32::try_from(list.len()).map_err(|_| conflict("too many hosts"))?;
        if args.standalone {
            return Err(conflict("--standalone runs a single node; it cannot be used with --hosts/--hostfile"));
        }
        if args.requeue_on_preempt {
            // No agent gets it (they are not Slurm's tasks): it would be dropped without a word.
            return Err(conflict(
                "--requeue-on-preempt works where Slurm starts rsrun (srun, or a batch script without --hosts/--hostfile); with --hosts/--hostfile, requeue from the batch script (`scontrol requeue $SLURM_JOB_ID` in a trap)",
            ));
        }
        if args.node_rank.is_some() && args.origin("node_rank") == crate::cli::Origin::CommandLine {
            return Err(conflict("--node-rank cannot be used with --hosts/--hostfile: node ranks follow the host order"));
        }
        // --nnodes and --nproc-per-node were applied to the host table (multinode::hostfile).

        // Same machine twice, as far as the names tell (the agents' identities tell the rest, before
        // any worker starts: see `identity`).
        let mut seen: HashMap<String, &str> = HashMap::new();
        for h in &list {
            let local = is_local_host(h.target(), &host.hostname);
            // One address with different ssh ports (containers behind one gateway) is several
            // machines as far as names tell; the agents' identities decide.
            let port = h.port.map(|p| format!(":{p}")).unwrap_or_default();
            let key = if local && h.port.is_none() { "this machine".to_owned() } else { format!("{}{port}", h.target().to_ascii_lowercase()) };
            if let Some(prev) = seen.insert(key, &h.host)
                && !args.allow_same_host
            {
                let why = if local && h.port.is_none() { "both name this machine".to_owned() } else { format!("both reach {}{port}", h.target()) };
                return Err(conflict(super::identity::same_machine_error(prev, &h.host, &why)));
            }
        }
        if args.check && args.dry_run {
            notes.push("--check with --dry-run: the plan is printed and nothing is started".into());
        }

        // ssh.
        let program: Vec<String> = match &args.rsh {
            Some(cmd) => {
                let p: Vec<String> = cmd.split_whitespace().map(str::to_owned).collect();
                if p.is_empty() {
                    return Err(PlanError::Invalid { flag: "--rsh", value: cmd.clone(), expected: "a command".into() });
                }
                p
            }
            None => vec!["ssh".to_owned()],
        };
        if args.ssh_connect_timeout == 0 {
            return Err(PlanError::Invalid { flag: "--ssh-connect-timeout", value: "0".into(), expected: "seconds > 0".into() });
        }
        for o in &args.ssh_option {
            if !o.contains('=') || o.starts_with('=') {
                return Err(PlanError::Invalid { flag: "--ssh-option", value: o.clone(), expected: "KEY=VALUE".into() });
            }
        }
        if let Some(user) = &args.ssh_user
            && (user.is_empty() || user.starts_with('-') || !user.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)))
        {
            return Err(PlanError::Invalid {
                flag: "--ssh-user",
                value: user.clone(),
                expected: "a user name (letters, digits, '-', '_' and '.', not starting with '-')".into(),
            });
        }
        // `--ssh-option ConnectTimeout=N` replaces --ssh-connect-timeout on ssh's command line (see
        // `command`; ssh keeps the first value): the start timeout follows it.
        let user_connect_timeout = args
            .ssh_option
            .iter()
            .filter(|o| option_key(o).eq_ignore_ascii_case("ConnectTimeout"))
            .find_map(|o| option_value(o).parse::<u64>().ok().filter(|s| *s > 0));
        let ssh = SshConfig {
            program,
            connect_timeout: Duration::from_secs(user_connect_timeout.unwrap_or(u64::from(args.ssh_connect_timeout))),
            config: args.ssh_config.as_ref().map(|p| host.cwd.join(p)),
            port: args.ssh_port,
            identity: args.ssh_identity.as_ref().map(|p| host.cwd.join(p)),
            user: args.ssh_user.clone(),
            options: args.ssh_option.clone(),
        };
        let cwd = match &args.chdir {
            Some(d) if d.is_absolute() => d.clone(),
            Some(d) => {
                return Err(PlanError::Invalid { flag: "--chdir", value: d.display().to_string(), expected: "an absolute path (the directory on every host)".into() });
            }
            None => host.cwd.clone(),
        };
        if cwd.to_str().is_none() {
            // It travels to the hosts as text: a lossy copy would name a directory that does not exist.
            return Err(PlanError::Invalid {
                flag: if args.chdir.is_some() { "--chdir" } else { "the working directory" },
                value: cwd.display().to_string(),
                expected: "a UTF-8 path (the agents get it as text); pass --chdir with one".into(),
            });
        }
        let remote_rsrun = match &args.remote_rsrun {
            Some(p) if p.is_absolute() => p.clone(),
            Some(p) => {
                return Err(PlanError::Invalid { flag: "--remote-rsrun", value: p.display().to_string(), expected: "an absolute path".into() });
            }
            None => exe.to_owned(),
        };

        // Nodes: rank order = list order, ranks contiguous per host.
        let mut nodes = Vec::with_capacity(list.len());
        let mut offset: Option<u32> = Some(0);
        for (i, h) in list.into_iter().enumerate() {
            if let (Some(d), Slots::Count(n)) = (&h.devices, h.slots)
                && d.len() as u32 != n
            {
                notes.push(format!("{}: {n} slots but {} devices listed", h.host, d.len()));
            }
            if h.slots == Slots::Auto {
                notes.push(format!(
                    "{}: no slot count: its agent starts one worker per GPU there, else one (give `slots=N` or --nproc-per-node N to choose)",
                    h.host
                ));
            }
            // A port or user of its own means an ssh server of its own (a container's sshd behind
            // this host's port 2222): connected to like any other host, not run here.
            let local = is_local_host(h.target(), &host.hostname) && h.port.is_none() && h.user.is_none() && !args.ssh_local;
            let argv = if local { local_argv(exe) } else { ssh_argv(&ssh, &h, &remote_rsrun) };
            let slots = h.slots;
            nodes.push(RemoteNode { host: h, node_rank: i as u32, rank_offset: offset, local, argv });
            offset = match (offset, slots) {
                (Some(o), Slots::Count(n)) => {
                    Some(o.checked_add(n).filter(|w| *w <= i32::MAX as u32).ok_or_else(|| conflict("the world size does not fit in a rank"))?)
                }
                _ => None,
            };
        }

        // Rendezvous.
        let backend = args.rdzv_backend.trim().to_ascii_lowercase();
        let (rdzv, token) = match (backend.as_str(), args.rdzv_endpoint.trim()) {
            ("c10d" | "rsrun", "") => {
                return Err(conflict(format!("--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (the rsrun-rendezvous daemon)")));
            }
            ("c10d" | "rsrun", ep) => {
                let endpoint = Endpoint::parse(ep, "--rdzv-endpoint", crate::plan::DEFAULT_RDZV_PORT)?;
                if endpoint.port == 0 {
                    return Err(PlanError::Invalid { flag: "--rdzv-endpoint", value: ep.into(), expected: "the daemon's port".into() });
                }
                let token = match &args.rdzv_token_file {
                    Some(p) => Some(rsrun_rendezvous::auth::read_client_token(&host.cwd.join(p)).map_err(|e| PlanError::Invalid {
                        flag: "--rdzv-token-file",
                        value: p.display().to_string(),
                        expected: format!("a readable token file ({e})"),
                    })?),
                    None => None,
                };
                (RemoteRdzv::External { endpoint }, token)
            }
            ("static" | "", ep) => {
                let (bind, advertise) = if ep.is_empty() {
                    let all_local = nodes.iter().all(|n| n.local);
                    if all_local {
                        (SocketAddr::from(([127, 0, 0, 1], 0)), "127.0.0.1".to_owned())
                    } else {
                        let first = nodes.iter().find(|n| !is_local_host(n.host.target(), &host.hostname)).map(|n| n.host.target().to_owned());
                        let routed = first.as_deref().and_then(route_to).or_else(|| route_to("192.0.2.1"));
                        // Over ssh the other hosts cannot reach this machine's loopback: no
                        // route found is an error, not 127.0.0.1 (an --rsh transport may run
                        // every "host" here, as tests/fake-rsh does).
                        if routed.is_none() && args.rsh.is_none() {
                            return Err(conflict(format!(
                                "no address of this host routes to {} (an ssh_config alias, or no default route), and the hosts cannot reach its loopback: pass --rdzv-endpoint ADDR[:PORT], an address of this host they reach",
                                first.unwrap_or_default()
                            )));
                        }
                        let ip = routed.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
                        notes.push(format!(
                            "hosting the rendezvous at {ip} (the address that routes to {}); override with --rdzv-endpoint ADDR[:PORT]",
                            first.unwrap_or_default()
                        ));
                        (SocketAddr::new(ip, 0), ip.to_string())
                    }
                } else {
                    let endpoint = Endpoint::parse(ep, "--rdzv-endpoint", 0)?;
                    let ip = (endpoint.host.as_str(), endpoint.port)
                        .to_socket_addrs()
                        .ok()
                        .and_then(|mut a| a.next())
                        .map(|a| a.ip())
                        .ok_or_else(|| PlanError::Invalid { flag: "--rdzv-endpoint", value: ep.into(), expected: "an address of this host".into() })?;
                    if ip.is_unspecified() {
                        return Err(PlanError::Invalid {
                            flag: "--rdzv-endpoint",
                            value: ep.into(),
                            expected: "an address the hosts can reach (not 0.0.0.0 or ::)".into(),
                        });
                    }
                    (SocketAddr::new(ip, endpoint.port), endpoint.host)
                };
                let token = crate::plan::secret_token()
                    .map_err(|e| PlanError::Conflict(format!("cannot make the job's rendezvous token: /dev/urandom: {e}")))?;
                (RemoteRdzv::Embedded { bind, advertise }, Some(token))
            }
            (other, _) => return Err(PlanError::Invalid { flag: "--rdzv-backend", value: other.into(), expected: "c10d (an external daemon) or static".into() }),
        };
        // TLS to an external daemon: the head reads the CA and sends it to every agent.
        let tls_ca = match (&args.rdzv_tls_ca, &rdzv) {
            (None, _) => None,
            (Some(p), RemoteRdzv::External { .. }) => {
                let (path, pem) = crate::plan::read_tls_ca(p, host)?;
                Some(TlsCa { path, pem })
            }
            (Some(_), RemoteRdzv::Embedded { .. }) => {
                notes.push(
                    "--rdzv-tls-ca is not used: this rsrun hosts a plain (non-TLS) rendezvous for the hosts; a TLS daemon is `--rdzv-backend c10d --rdzv-endpoint HOST:PORT`".into(),
                );
                None
            }
        };
        if args.master_addr.is_some() || args.master_port.is_some() {
            notes.push("--master-addr/--master-port are ignored with --hosts/--hostfile: node rank 0 picks them".into());
        }
        let job_id = args.rdzv_id.clone().unwrap_or_else(|| default_job_id(&host.hostname));

        // Timeouts and signals (what the head itself does on Ctrl-C).
        let shutdown = match &args.shutdown_timeout {
            Some(s) => parse_duration(s, "--shutdown-timeout")?,
            None => match host.env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
                Some(s) => parse_duration(s, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")?,
                None => Duration::from_secs(30),
            },
        };
        let options = agent_options(args, shutdown);
        let program = args.command.clone();

        // The per-node plan as node 0 would resolve it here: bad values are found now, not on every
        // host. What depends on the host (the program, GPUs, CPU topology) is checked by each agent.
        let slots0 = nodes[0].host.slots.agent_value();
        let place = NodePlace { nnodes: n_hosts, nproc_per_node: &slots0, node_rank: 0, endpoint: "127.0.0.1:1", job_id: &job_id, token_file: None, tls_ca_file: None };
        let check = agent_argv(&options, place, &program);
        let check_args = <LaunchArgs as clap::Parser>::try_parse_from(std::iter::once("rsrun".to_owned()).chain(check))
            .map_err(|e| conflict(format!("invalid per-node options: {}", e.to_string().lines().next().unwrap_or(""))))?;
        let plan = match LaunchPlan::resolve_agent(&check_args, host) {
            Ok(p) => Some(p),
            Err(e @ PlanError::Invalid { .. }) => return Err(e),
            Err(_) => None,
        };
        let signals = match &plan {
            Some(p) => p.signals.clone(),
            None => SignalPolicy::default_policy(),
        };

        let home = host.env.get("HOME").map(PathBuf::from);
        let env_files: Vec<PathBuf> = args.env_file.iter().map(|p| host.cwd.join(p)).collect();
        let env = forwarded_env(EnvSources {
            env: &host.env,
            export_all: args.export_all,
            exports: &args.export,
            env_files: &env_files,
            home: home.as_deref(),
            cwd: &host.cwd,
        })?;

        Ok(RemotePlan {
            job_id,
            nodes,
            rdzv,
            token,
            tls_ca,
            env,
            cwd,
            program,
            options,
            remote_rsrun,
            start_timeout: ssh.connect_timeout + START_SLACK,
            ssh,
            shutdown,
            signals,
            notes,
            dry_run: args.dry_run,
            fanout: args.ssh_fanout.max(1) as usize,
            check: args.check,
            allow_same_host: args.allow_same_host,
        })
    }

    /// Total workers; `None` when a host has `auto` slots (known once the agents start).
    pub fn world_size(&self) -> Option<u32> {
        self.nodes.iter().map(|n| match n.host.slots {
            Slots::Count(c) => Some(c),
            Slots::Auto => None,
        }).sum()
    }
}

#[cfg(test)]
mod tests;
