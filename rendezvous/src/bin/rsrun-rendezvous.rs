//! `rsrun-rendezvous`: the rendezvous daemon (`serve`), its operator view (`status`), and a
//! standalone PyTorch TCPStore server (`tcpstore`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
use rsrun_rendezvous::ha::HaConfig;
use rsrun_rendezvous::ha::etcd::EtcdConfig;
use rsrun_rendezvous::service::DaemonIdentity;
use rsrun_rendezvous::server::{self, ServerConfig};
use rsrun_rendezvous::tcpstore::{TcpStoreLimits, TcpStoreServer};
use rsrun_rendezvous::validate::Limits;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(name = "rsrun-rendezvous", version, about = "rsrun's rendezvous service: membership, store and unique-id exchange for many jobs")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the service.
    Serve(Box<ServeArgs>),
    /// Show jobs, rounds, nodes, ranks and heartbeats.
    Status(StatusArgs),
    /// Serve one PyTorch TCPStore (an empty keyspace per start) until SIGINT or SIGTERM.
    #[command(long_about = "Serve one PyTorch TCPStore (torch >= 2.2 clients) with an empty keyspace until SIGINT or \
SIGTERM. The first line on stdout is the bound address (or, with --print-port, the port alone).\n\n\
Point unmodified workers at it with TORCHELASTIC_USE_AGENT_STORE=True and MASTER_ADDR/MASTER_PORT.\n\n\
SECURITY: the TCPStore protocol has no authentication and torch stores pickled state in it, so anyone who \
can reach the port can read and write every key (and run code on the processes that unpickle it). \
Only loopback addresses are accepted unless --insecure is given; then bind the job's own network, never 0.0.0.0.")]
    Tcpstore(TcpStoreArgs),
}

#[derive(Parser, Debug)]
struct TcpStoreArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Print only the bound port as the first stdout line (default: the address).
    #[arg(long)]
    print_port: bool,
    /// Allow a non-loopback listen address (the protocol has no authentication).
    #[arg(long)]
    insecure: bool,
    /// Largest key in bytes (torch's libuv server: 8 KiB).
    #[arg(long, default_value_t = 8 << 10, value_parser = clap::value_parser!(u64).range(1..=(1 << 30)))]
    max_key_bytes: u64,
    /// Largest value in bytes (torch's libuv server: 8 MiB).
    #[arg(long, default_value_t = 8 << 20, value_parser = clap::value_parser!(u64).range(1..=(1 << 32)))]
    max_value_bytes: u64,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    #[arg(long, default_value_t = 128 << 10, value_parser = clap::value_parser!(u64).range(1..=(1 << 24)))]
    max_keys_per_request: u64,
    /// Largest single request in bytes.
    #[arg(long, default_value_t = 64 << 20, value_parser = clap::value_parser!(u64).range(1..=(1 << 34)))]
    max_request_bytes: u64,
    /// Most bytes of keys and values the store holds (and, apart, the most its pending WAITs'
    /// and BARRIERs' bookkeeping may take over all connections).
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    max_total_bytes: u64,
    /// Most bytes held for all connections together in unfinished requests and unread replies;
    /// past it the connections holding the most that nobody moves are closed (not one whose
    /// peer reads its replies, or sends the request it is in the middle of, at 64 KiB/s or
    /// more); past twice it those are closed too, the slowest first.
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    max_buffered_bytes: u64,
}

#[derive(Parser, Debug)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed on stdout).
    #[arg(long, default_value = "127.0.0.1:29400")]
    listen: SocketAddr,
    /// Journal every change here so a restart (even after kill -9) loses nothing acknowledged.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Tokens callers must present (one per line, optionally followed by a job id or `prefix*`,
    /// and by `jobs=N` to cap the live jobs the token may start).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// TLS certificate (PEM); needs --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM); needs --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Allow a non-loopback listen address without a token or without TLS (by default both are
    /// required there: tokens and store values would otherwise cross the network in clear text).
    #[arg(long, alias = "insecure-no-auth")]
    insecure: bool,
    /// Largest store value in bytes [default: 1048576; with --etcd-endpoints 262144, at most 524288].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=(64 << 20)))]
    max_value_bytes: Option<u64>,
    /// Most keys per job.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    max_keys_per_job: u64,
    /// Most jobs at once.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_jobs: u64,
    /// Keep completed or failed jobs (and jobs without nodes) this many seconds before forgetting them.
    /// At least 1: an ended job is kept while the calls that ended it still read it.
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..))]
    retention_secs: u64,
    /// Do not serve PyTorch's TCPStore for running rounds: rank 0 of each job hosts it, as under
    /// torchrun without the agent store. By default every round gets a store of its own, listening
    /// on the interface the job's nodes reached this service on (the protocol has no
    /// authentication: keep that interface on the cluster's own network).
    #[arg(long)]
    no_tcpstore: bool,
    /// Run as one of a group of highly available daemons (active/standby) that keep their log in
    /// this etcd cluster: comma-separated members, `HOST:PORT` or `https://HOST:PORT`. Exclusive with
    /// --data-dir. Clients list every daemon (`--rdzv-endpoint h1:29400,h2:29400`).
    #[arg(long, value_delimiter = ',', conflicts_with = "data_dir")]
    etcd_endpoints: Vec<String>,
    /// Key prefix of this group of daemons in etcd (daemons with the same prefix form one group)
    /// [default: /rsrun].
    #[arg(long)]
    etcd_prefix: Option<String>,
    /// The address clients reach this daemon at (HOST:PORT); standbys send clients to the leader's.
    /// Default: the bound listen address (required when listening on every interface).
    #[arg(long)]
    advertise: Option<String>,
    /// A name for this daemon in `status` [default: the --advertise address].
    #[arg(long)]
    daemon_id: Option<String>,
    /// Leader election lease in seconds: after a leader crash a standby takes over within about
    /// this long (etcd's minimum is 2 s).
    /// [default: 5]
    #[arg(long, value_parser = clap::value_parser!(u64).range(2..=3600))]
    leader_lease_ttl: Option<u64>,
    /// CA certificate (PEM) that verifies the etcd members (TLS).
    #[arg(long)]
    etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for etcd mTLS; etcd with --client-cert-auth takes its CN as the user.
    #[arg(long, requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// Client key (PEM) for etcd mTLS.
    #[arg(long, requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// etcd user (password auth); the password comes from --etcd-password-file.
    #[arg(long, requires = "etcd_password_file")]
    etcd_user: Option<String>,
    /// File whose first line is the etcd user's password.
    #[arg(long, requires = "etcd_user")]
    etcd_password_file: Option<PathBuf>,
    /// HA: write a snapshot to etcd every this many bytes of log (tests lower it).
    #[arg(long, hide = true, default_value_t = rsrun_rendezvous::ha::log::COMPACT_EVERY, value_parser = clap::value_parser!(u64).range(1024..))]
    ha_snapshot_bytes: u64,
}

#[derive(Parser, Debug)]
struct StatusArgs {
    /// The service, host:port; for a highly available group, every daemon, comma-separated (the
    /// leader answers; each daemon reports its role and replica).
    #[arg(long, default_value = "127.0.0.1:29400")]
    endpoint: String,
    /// Only this job.
    #[arg(long)]
    job: Option<String>,
    /// Token file (the first token is used).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// CA certificate to verify a TLS service.
    #[arg(long)]
    tls_ca: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let log = match rsrun_rendezvous::logging::from_env("info") {
        Ok(log) => log,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(log.filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Some(note) = log.note {
        tracing::warn!("{note}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Serve(args) => serve(*args).await,
            Cmd::Status(args) => status(args).await,
            Cmd::Tcpstore(args) => tcpstore(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // Bad input (flags, files, endpoints) exits 2; a failure while serving exits 1.
            let bad_input = e.chain().any(|c| {
                matches!(
                    c.downcast_ref::<rsrun_rendezvous::RdzvError>(),
                    Some(rsrun_rendezvous::RdzvError::InvalidArgument { .. } | rsrun_rendezvous::RdzvError::Connect { .. })
                )
            });
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// The HA part of `serve`'s flags, validated (`None`: a single daemon).
fn ha_config(args: &ServeArgs) -> anyhow::Result<Option<HaConfig>> {
    let ha_only = [
        ("--advertise", args.advertise.is_some()),
        ("--daemon-id", args.daemon_id.is_some()),
        ("--etcd-ca", args.etcd_ca.is_some()),
        ("--etcd-cert", args.etcd_cert.is_some()),
        ("--etcd-user", args.etcd_user.is_some()),
        ("--etcd-prefix", args.etcd_prefix.is_some()),
        ("--leader-lease-ttl", args.leader_lease_ttl.is_some()),
    ];
    if args.etcd_endpoints.is_empty() {
        if let Some((flag, _)) = ha_only.iter().find(|(_, given)| *given) {
            return Err(RdzvError::invalid("etcd_endpoints", format!("missing: {flag} only applies to highly available daemons (--etcd-endpoints)")).into());
        }
        return Ok(None);
    }
    let endpoints: Vec<String> = args.etcd_endpoints.iter().map(|e| e.trim().to_owned()).filter(|e| !e.is_empty()).collect();
    if endpoints.is_empty() {
        return Err(RdzvError::invalid("etcd_endpoints", "empty; expected HOST:PORT[,HOST:PORT...]").into());
    }
    let prefix = args.etcd_prefix.as_deref().unwrap_or("/rsrun").trim();
    if !prefix.starts_with('/') || prefix.len() < 2 || prefix.contains(char::is_whitespace) {
        return Err(RdzvError::invalid("etcd_prefix", format!("{prefix:?}; expected a key prefix such as /rsrun or /rsrun/cluster-a")).into());
    }
    if let Some(a) = &args.advertise {
        let ok = a.rsplit_once(':').is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !ok {
            return Err(RdzvError::invalid("advertise", format!("{a:?}; expected HOST:PORT, the address clients reach this daemon at")).into());
        }
    }
    let user = match (&args.etcd_user, &args.etcd_password_file) {
        (Some(u), Some(f)) => {
            let text = rsrun_rendezvous::files::read_bounded_string(f).with_context(|| format!("cannot read --etcd-password-file {}", f.display()))?;
            let pw = text.lines().next().unwrap_or_default().trim_end().to_owned();
            if pw.is_empty() {
                return Err(RdzvError::invalid("etcd_password_file", format!("{}: the first line is empty; expected the password of {u:?}", f.display())).into());
            }
            Some((u.clone(), pw))
        }
        _ => None,
    };
    Ok(Some(HaConfig {
        etcd: EtcdConfig {
            endpoints,
            ca: args.etcd_ca.clone(),
            cert_key: args.etcd_cert.clone().zip(args.etcd_key.clone()),
            user,
            request_timeout: Duration::from_secs(2),
        },
        prefix: prefix.trim_end_matches('/').to_owned(),
        identity: DaemonIdentity { daemon_id: args.daemon_id.clone().unwrap_or_default(), advertise: args.advertise.clone().unwrap_or_default() },
        lease_ttl: Duration::from_secs(args.leader_lease_ttl.unwrap_or(5)),
        snapshot_bytes: args.ha_snapshot_bytes,
    }))
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let ha = ha_config(&args)?;
    let defaults = Limits::default();
    let (value_default, store_per_job) = if ha.is_some() {
        (server::HA_DEFAULT_VALUE_BYTES, server::HA_DEFAULT_STORE_BYTES_PER_JOB)
    } else {
        (defaults.max_value_bytes, defaults.max_store_bytes_per_job)
    };
    let config = ServerConfig {
        listen: args.listen,
        data_dir: args.data_dir,
        token_file: args.token_file,
        tls: args.tls_cert.zip(args.tls_key),
        metrics_listen: args.metrics_listen,
        insecure: args.insecure,
        limits: Limits {
            max_value_bytes: args.max_value_bytes.map_or(value_default, |v| v as usize),
            max_store_bytes_per_job: store_per_job,
            max_keys_per_job: args.max_keys_per_job as usize,
            max_jobs: args.max_jobs as usize,
            retention_ms: args.retention_secs.saturating_mul(1000),
            ..Limits::default()
        },
        tcpstore: (!args.no_tcpstore).then(TcpStoreLimits::default),
        only_job: None,
        ha,
    };
    // Every node's calls, and every rank of every job on the per-round PyTorch stores.
    rsrun_rendezvous::rlimit::raise_nofile_limit();
    let shutdown = cancel_on_signals();
    server::serve(config, shutdown, |bound| {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "listening on {}", bound.addr);
        if let Some(m) = bound.metrics_addr {
            let _ = writeln!(out, "metrics on http://{m}/metrics");
        }
        let _ = out.flush();
    })
    .await
    .context("rendezvous service failed")
}

/// A token cancelled by the first SIGINT or SIGTERM. The handlers are installed before it returns,
/// so a signal sent once the caller printed its address is never missed.
fn cancel_on_signals() -> CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let shutdown = CancellationToken::new();
    let (int, term) = match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(i), Ok(t)) => (i, t),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "cannot install signal handlers");
            return shutdown;
        }
    };
    let s = shutdown.clone();
    tokio::spawn(async move {
        let (mut int, mut term) = (int, term);
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        s.cancel();
    });
    shutdown
}

async fn tcpstore(args: TcpStoreArgs) -> anyhow::Result<()> {
    if !args.listen.ip().is_loopback() && !args.insecure {
        return Err(rsrun_rendezvous::RdzvError::invalid(
            "listen",
            format!(
                "{} is not a loopback address: the TCPStore protocol has no authentication, so anyone who can reach \
                 it could read and write the job's keys. Give --insecure to accept the risk (and bind the job's own \
                 network, not 0.0.0.0)",
                args.listen
            ),
        )
        .into());
    }
    let to_usize = |name: &'static str, v: u64| {
        usize::try_from(v).map_err(|_| rsrun_rendezvous::RdzvError::invalid(name, format!("{v} does not fit this platform")))
    };
    let limits = TcpStoreLimits {
        max_key_bytes: to_usize("max_key_bytes", args.max_key_bytes)?,
        max_value_bytes: to_usize("max_value_bytes", args.max_value_bytes)?,
        max_keys_per_request: to_usize("max_keys_per_request", args.max_keys_per_request)?,
        max_request_bytes: to_usize("max_request_bytes", args.max_request_bytes)?,
        max_total_bytes: to_usize("max_total_bytes", args.max_total_bytes)?,
        max_buffered_bytes: to_usize("max_buffered_bytes", args.max_buffered_bytes)?,
        ..TcpStoreLimits::default()
    };
    rsrun_rendezvous::rlimit::raise_nofile_limit();
    let shutdown = cancel_on_signals();
    let server = TcpStoreServer::start(args.listen, limits, shutdown.clone()).context("cannot start the tcpstore server")?;
    {
        use std::io::Write;
        let addr = server.local_addr();
        let line = if args.print_port { addr.port().to_string() } else { addr.to_string() };
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").and_then(|()| out.flush()).context("cannot write the address to stdout")?;
    }
    shutdown.cancelled().await;
    server.shutdown().await;
    Ok(())
}

/// The HA group as the leader and each daemon see it: leader, epoch, standbys and their lag.
async fn ha_lines(client: &RdzvClient, leader: &rsrun_rendezvous::proto::DaemonInfoResponse) -> String {
    use rsrun_rendezvous::proto::DaemonRole;
    let mut out = format!(
        "leader {} (id {})  epoch {}  seq {}  takeovers {}\n",
        leader.advertise, leader.daemon_id, leader.epoch, leader.applied_seq, leader.takeovers
    );
    out.push_str(&format!("  {:<28} {:<24} {:<8} {:>10} {:>12} {:>9}\n", "DAEMON", "ADDRESS", "ROLE", "SEQ", "LAG_ENTRIES", "LAG_MS"));
    for peer in &leader.daemons {
        let info = if peer.advertise == leader.advertise { Ok(leader.clone()) } else { client.daemon_info_at(&peer.advertise).await };
        match info {
            Ok(d) => {
                let role = DaemonRole::try_from(d.role).map(|r| r.as_str_name().trim_start_matches("DAEMON_ROLE_").to_lowercase()).unwrap_or_default();
                let lag = leader.applied_seq.saturating_sub(d.applied_seq);
                let lag_ms = if lag == 0 { 0 } else { leader.applied_at_unix_ms.saturating_sub(d.applied_at_unix_ms) };
                out.push_str(&format!("  {:<28} {:<24} {:<8} {:>10} {:>12} {:>9}\n", d.daemon_id, d.advertise, role, d.applied_seq, lag, lag_ms));
            }
            Err(e) => out.push_str(&format!("  {:<28} {:<24} {:<8} {e}\n", peer.daemon_id, peer.advertise, "?")),
        }
    }
    out
}

fn age(now: u64, then: u64) -> String {
    if then == 0 {
        return "-".into();
    }
    let ms = now.saturating_sub(then);
    if ms < 10_000 { format!("{:.1}s ago", ms as f64 / 1000.0) } else { format!("{}s ago", ms / 1000) }
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    use rsrun_rendezvous::proto::{DaemonRole, JobState, NodeState};
    let mut cfg = ClientConfig::new(args.endpoint.clone());
    cfg.rpc_timeout = Duration::from_secs(10);
    cfg.tls_ca = args.tls_ca;
    if let Some(f) = &args.token_file {
        cfg.token = Some(rsrun_rendezvous::auth::read_client_token(f)?);
    }
    let client = RdzvClient::connect(cfg)?;
    let resp = client.status(args.job.as_deref()).await.with_context(|| format!("cannot get status from {}", args.endpoint))?;
    let now = resp.server_time_unix_ms;
    let mut out = String::new();
    if let Some(d) = &resp.daemon
        && d.role == DaemonRole::Leader as i32
    {
        out.push_str(&ha_lines(&client, d).await);
    }
    if resp.jobs.is_empty() {
        out.push_str("no jobs\n");
    }
    for job in &resp.jobs {
        let Some(v) = &job.view else { continue };
        let state = JobState::try_from(v.state).map(|s| s.as_str_name().trim_start_matches("JOB_STATE_").to_lowercase()).unwrap_or_default();
        out.push_str(&format!(
            "job {}  state {}  round {}  nodes {}:{}  world {}  restarts {}/{}  waiting {}  keys {} ({} B)\n",
            v.job_id, state, v.round, v.min_nodes, v.max_nodes, job.world_size, v.restart_count, v.max_restarts, v.nodes_waiting, job.num_keys, job.store_bytes
        ));
        if !v.reason.is_empty() {
            out.push_str(&format!("  reason: {}\n", v.reason));
        }
        out.push_str(&format!("  {:<28} {:<10} {:>5} {:>7} {:>6}  {:<22} {}\n", "NODE", "STATE", "RANK", "WORKERS", "RANKS", "ADDRESS", "HEARTBEAT"));
        for n in &job.nodes {
            let st = NodeState::try_from(n.state).map(|s| s.as_str_name().trim_start_matches("NODE_STATE_").to_lowercase()).unwrap_or_default();
            let rank = if n.node_rank < 0 { "-".to_string() } else { n.node_rank.to_string() };
            let ranks = if n.rank_offset < 0 {
                "-".to_string()
            } else {
                format!("{}-{}", n.rank_offset, n.rank_offset + n.local_world_size as i32 - 1)
            };
            out.push_str(&format!(
                "  {:<28} {:<10} {:>5} {:>7} {:>6}  {:<22} {}\n",
                n.node_id,
                st,
                rank,
                n.local_world_size,
                ranks,
                n.addrs.first().cloned().unwrap_or_default(),
                age(now, n.last_heartbeat_unix_ms)
            ));
        }
    }
    use std::io::Write;
    std::io::stdout().lock().write_all(out.as_bytes()).context("cannot write to stdout")?;
    Ok(())
}
