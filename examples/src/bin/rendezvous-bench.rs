//! `rendezvous-bench`: N simulated agents join one job (or J jobs), form a round, pass a barrier and
//! exchange an NCCL unique id through an `rsrun-rendezvous` daemon.
//!
//! Agents are tokio tasks in this process. They share `--connections` HTTP/2 connections (default 64):
//! agent `i` uses connection `i % C`, and each of its calls is one HTTP/2 stream, which is how many
//! launchers behind one NAT or one proxy look to the daemon. Without `--endpoint`, the bench starts the
//! daemon binary itself (a separate process, on 127.0.0.1 port 0), so client and server do not share a
//! runtime.
//!
//! ```text
//! rendezvous-bench --agents 1024
//! rendezvous-bench --endpoint 127.0.0.1:29400 --agents 10000 --jobs 4
//! ```

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, RdzvClient};
use tokio::sync::Barrier;

#[derive(Parser, Debug)]
#[command(about = "Rendezvous service benchmark: join, barrier and unique-id exchange of N agents")]
struct Args {
    /// The daemon (host:port). Without it, the bench starts `rsrun-rendezvous serve` itself.
    #[arg(long)]
    endpoint: Option<String>,
    /// Simulated agents (nodes).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    agents: u32,
    /// Jobs the agents are split across.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    jobs: u32,
    /// HTTP/2 connections shared by the agents.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    connections: u32,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout_secs: u64,
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_daemon() -> anyhow::Result<(Daemon, String)> {
    let exe = std::env::current_exe().context("cannot locate the bench binary")?;
    let daemon = exe.with_file_name("rsrun-rendezvous");
    if !daemon.exists() {
        bail!("{} not found; build it first (cargo build --release -p rsrun-rendezvous) or pass --endpoint", daemon.display());
    }
    let mut child = Command::new(&daemon)
        .args(["serve", "--listen", "127.0.0.1:0", "--max-jobs", "100000"])
        .env("RSRUN_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {}", daemon.display()))?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("daemon stdout")?;
    BufReader::new(stdout).read_line(&mut line).context("reading the daemon's address")?;
    let addr = line.trim().strip_prefix("listening on ").with_context(|| format!("unexpected daemon output {line:?}"))?.to_string();
    Ok((Daemon(child), addr))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

struct AgentTimes {
    round_done: Instant,
    barrier_start: Instant,
    barrier_done: Instant,
    uid_done: Instant,
    rpc_ms: Vec<f64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (_daemon, endpoint) = match &args.endpoint {
        Some(e) => (None, e.clone()),
        None => {
            let (d, a) = start_daemon()?;
            (Some(d), a)
        }
    };
    let n = args.agents;
    let jobs = args.jobs.min(n);
    let conns = args.connections.min(n) as usize;
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        let mut cfg = ClientConfig::new(endpoint.clone());
        cfg.rpc_timeout = Duration::from_secs(args.timeout_secs);
        clients.push(RdzvClient::connect(cfg)?);
    }
    // Warm the connections so connection setup is not counted as rendezvous time.
    for c in &clients {
        c.status(Some("warmup")).await.ok();
    }
    let run = format!("bench-{}", std::process::id());
    let timeout = Duration::from_secs(args.timeout_secs);
    let start_line = Arc::new(Barrier::new(n as usize + 1));
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let client = clients[i as usize % conns].clone();
        let job_idx = i % jobs;
        let job_size = n / jobs + u32::from(job_idx < n % jobs);
        let job = format!("{run}-{job_idx}");
        let start_line = start_line.clone();
        tasks.push(tokio::spawn(async move {
            let spec = JobSpec {
                min_nodes: job_size,
                max_nodes: job_size,
                last_call: Duration::ZERO,
                lease: Duration::from_secs(300),
                max_restarts: 0,
                fixed_ranks: false,
            };
            let node = format!("agent-{i}");
            start_line.wait().await;
            let mut rpc_ms = Vec::with_capacity(6);
            let t = Instant::now();
            let joined = client
                .join(JoinSpec {
                    job_id: job.clone(),
                    node_id: node.clone(),
                    addrs: vec!["127.0.0.1".into()],
                    local_world_size: 8,
                    rank_hint: None,
                    config: spec,
                    timeout,
                    master_port: 29500,
                    hostname: node.clone(),
                })
                .await?;
            let round_done = Instant::now();
            rpc_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let round = joined.round.context("round")?.round;
            let node_rank = joined.node.context("node")?.node_rank;
            let store = client.store(&job, round);
            // Non-blocking calls, for the latency figure: a keep-alive and a store write.
            let t = Instant::now();
            client.keep_alive(&job, &node).await?;
            rpc_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            store.set(&format!("addr/{node_rank}"), b"127.0.0.1:12345").await?;
            rpc_ms.push(t.elapsed().as_secs_f64() * 1e3);
            let barrier_start = Instant::now();
            store.barrier("start", &node_rank.to_string(), job_size, timeout).await?;
            let barrier_done = Instant::now();
            rpc_ms.push(barrier_done.duration_since(barrier_start).as_secs_f64() * 1e3);
            let t = Instant::now();
            if node_rank == 0 {
                store.publish_unique_id("", 0, &[0x5a; 128]).await?;
            } else {
                let id = store.get_unique_id("", timeout).await?;
                anyhow::ensure!(id == [0x5a; 128], "agent {i} got a wrong unique id");
            }
            let uid_done = Instant::now();
            rpc_ms.push(t.elapsed().as_secs_f64() * 1e3);
            anyhow::Ok(AgentTimes { round_done, barrier_start, barrier_done, uid_done, rpc_ms })
        }));
    }
    start_line.wait().await;
    let t0 = Instant::now();
    let mut times = Vec::with_capacity(n as usize);
    for t in tasks {
        times.push(t.await.context("agent task")??);
    }
    let round_s = times.iter().map(|a| a.round_done.duration_since(t0)).max().unwrap_or_default().as_secs_f64();
    let first_barrier = times.iter().map(|a| a.barrier_start).min().unwrap_or(t0);
    let barrier_s = times.iter().map(|a| a.barrier_done.duration_since(first_barrier)).max().unwrap_or_default().as_secs_f64();
    let uid_s = times.iter().map(|a| a.uid_done.duration_since(t0)).max().unwrap_or_default().as_secs_f64();
    let mut quick: Vec<f64> = times.iter().flat_map(|a| a.rpc_ms[1..3].iter().copied()).collect();
    quick.sort_by(f64::total_cmp);
    let mut joins: Vec<f64> = times.iter().map(|a| a.rpc_ms[0]).collect();
    joins.sort_by(f64::total_cmp);
    println!("agents={n} jobs={jobs} connections={conns} endpoint={endpoint}");
    println!(
        "join (blocking until the round forms): p50={:.2} ms p99={:.2} ms",
        percentile(&joins, 0.5),
        percentile(&joins, 0.99)
    );
    println!(
        "keep-alive + store set (non-blocking): p50={:.3} ms p99={:.3} ms over {} calls",
        percentile(&quick, 0.5),
        percentile(&quick, 0.99),
        quick.len()
    );
    println!("all agents hold the unique id after {uid_s:.3} s");
    println!(
        "summary: agents={n} round_s={round_s:.3} barrier_s={barrier_s:.3} p99_rpc_ms={:.3}",
        percentile(&quick, 0.99)
    );
    Ok(())
}
