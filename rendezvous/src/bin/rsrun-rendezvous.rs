//! `rsrun-rendezvous`: the rendezvous daemon (`serve`), its operator view (`status`), and a
//! standalone PyTorch TCPStore server (`tcpstore`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
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
    Serve(ServeArgs),
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
    /// Most bytes of keys and values the store holds.
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    max_total_bytes: u64,
}

#[derive(Parser, Debug)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the bound address is printed on stdout).
    #[arg(long, default_value = "127.0.0.1:29400")]
    listen: SocketAddr,
    /// Journal every change here so a restart (even after kill -9) loses nothing acknowledged.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Tokens callers must present (one per line, optionally followed by a job id or `prefix*`).
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
    /// Allow a non-loopback listen address without a token.
    #[arg(long)]
    insecure: bool,
    /// Largest store value in bytes.
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..=(64 << 20)))]
    max_value_bytes: u64,
    /// Most keys per job.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    max_keys_per_job: u64,
    /// Most jobs at once.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_jobs: u64,
    /// Keep completed or failed jobs (and jobs without nodes) this many seconds before forgetting them.
    #[arg(long, default_value_t = 3600)]
    retention_secs: u64,
    /// Do not serve PyTorch's TCPStore for running rounds: rank 0 of each job hosts it, as under
    /// torchrun without the agent store. By default every round gets a store of its own, listening
    /// on the interface the job's nodes reached this service on (the protocol has no
    /// authentication: keep that interface on the cluster's own network).
    #[arg(long)]
    no_tcpstore: bool,
}

#[derive(Parser, Debug)]
struct StatusArgs {
    /// The service, host:port.
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RSRUN_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Cmd::Serve(args) => serve(args).await,
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

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = ServerConfig {
        listen: args.listen,
        data_dir: args.data_dir,
        token_file: args.token_file,
        tls: args.tls_cert.zip(args.tls_key),
        metrics_listen: args.metrics_listen,
        insecure: args.insecure,
        limits: Limits {
            max_value_bytes: args.max_value_bytes as usize,
            max_keys_per_job: args.max_keys_per_job as usize,
            max_jobs: args.max_jobs as usize,
            retention_ms: args.retention_secs.saturating_mul(1000),
            ..Limits::default()
        },
        tcpstore: (!args.no_tcpstore).then(TcpStoreLimits::default),
        only_job: None,
    };
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

/// Raises the soft open-file limit to the hard one: every rank holds a connection.
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
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
    };
    raise_nofile_limit();
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

fn age(now: u64, then: u64) -> String {
    if then == 0 {
        return "-".into();
    }
    let ms = now.saturating_sub(then);
    if ms < 10_000 { format!("{:.1}s ago", ms as f64 / 1000.0) } else { format!("{}s ago", ms / 1000) }
}

async fn status(args: StatusArgs) -> anyhow::Result<()> {
    use rsrun_rendezvous::proto::{JobState, NodeState};
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
