//! `rendezvous-bench`: N simulated agents join one job (or J jobs), form a round, pass a barrier and
//! exchange an NCCL unique id through an `rsrun-rendezvous` daemon.
//!
//! Agents are tokio tasks in this process. They share `--connections` HTTP/2 connections (default 64):
//! agent `i` uses connection `i % C`, and each of its calls is one HTTP/2 stream, which is how many
//! launchers behind one NAT or one proxy look to the daemon. Without `--endpoint`, the bench starts the
//! daemon binary itself (a separate process, on 127.0.0.1 port 0), so client and server do not share a
//! runtime.
//!
//! With `--compare-ha`, one run measures three services side by side: the daemon in memory, the
//! daemon with `--data-dir` (fsync'd journal), and a highly available group — 3 daemons over a
//! 3-member etcd cluster on 127.0.0.1 (Debian's `etcd-server`), the agents listing all three.
//!
//! ```text
//! rendezvous-bench --agents 1024
//! rendezvous-bench --endpoint 127.0.0.1:29400 --agents 10000 --jobs 4
//! rendezvous-bench --agents 1024 --compare-ha
//! ```

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, RdzvClient};
use rsrun_tests::KillOnDrop;
use tokio::sync::Barrier;

/// A line on stdout (what the benchmark reports).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

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
    /// Measure the in-memory daemon, the `--data-dir` daemon and an HA group of 3 daemons over 3
    /// etcd members in one run (needs `/usr/bin/etcd`).
    #[arg(long, conflicts_with = "endpoint")]
    compare_ha: bool,
}

/// Starts `rsrun-rendezvous serve` (next to this binary) with `extra` arguments and returns it with
/// its address.
fn start_daemon(listen: &str, extra: &[String]) -> anyhow::Result<(KillOnDrop, String)> {
    let exe = std::env::current_exe().context("cannot locate the bench binary")?;
    let daemon = exe.with_file_name("rsrun-rendezvous");
    if !daemon.exists() {
        bail!("{} not found; build it first (cargo build --release -p rsrun-rendezvous) or pass --endpoint", daemon.display());
    }
    let mut all = vec!["--max-jobs".to_string(), "100000".into()];
    all.extend(extra.iter().cloned());
    rsrun_tests::serve(&daemon, listen, &all, "warn", Stdio::inherit()).map_err(anyhow::Error::msg)
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

/// What one run measured.
struct Figures {
    round_s: f64,
    barrier_s: f64,
    p99_rpc_ms: f64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.compare_ha {
        return compare_ha(&args).await;
    }
    let (_daemon, endpoint) = match &args.endpoint {
        Some(e) => (None, e.clone()),
        None => {
            let (d, a) = start_daemon("127.0.0.1:0", &[])?;
            (Some(d), a)
        }
    };
    let f = run(&args, &endpoint).await?;
    out!("summary: agents={} round_s={:.3} barrier_s={:.3} p99_rpc_ms={:.3}", args.agents, f.round_s, f.barrier_s, f.p99_rpc_ms);
    Ok(())
}

/// In memory, `--data-dir`, and an HA group over etcd, one after the other in this run.
async fn compare_ha(args: &Args) -> anyhow::Result<()> {
    let (mem, addr) = start_daemon("127.0.0.1:0", &[])?;
    out!("--- in memory ---");
    let m = run(args, &addr).await?;
    drop(mem);
    let dir = tempfile::tempdir().context("temporary data directory")?;
    let (dd, addr) = start_daemon("127.0.0.1:0", &["--data-dir".into(), dir.path().display().to_string()])?;
    out!("--- --data-dir {} ---", dir.path().display());
    let d = run(args, &addr).await?;
    drop(dd);
    let Some(etcd) = rsrun_tests::etcd::EtcdCluster::start("rendezvous-bench --compare-ha", 3) else {
        bail!("etcd is not installed (apt-get install etcd-server etcd-client)");
    };
    let etcd_eps = etcd.endpoints_csv();
    let mut group = Vec::new();
    for _ in 0..3 {
        let port = rsrun_tests::free_port();
        let listen = format!("127.0.0.1:{port}");
        let extra = vec!["--etcd-endpoints".to_string(), etcd_eps.clone(), "--etcd-prefix".into(), "/rsrun-bench".into()];
        let (daemon, addr) = start_daemon(&listen, &extra)?;
        // The first one started leads: list it first, as an operator would after `status`.
        if group.is_empty() {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        group.push((daemon, addr));
    }
    let eps: Vec<String> = group.iter().map(|(_, a)| a.clone()).collect();
    out!("--- HA: 3 daemons over 3 etcd members ({}) ---", etcd_eps);
    let h = run(args, &eps.join(",")).await?;
    drop(group);
    out!(
        "summary: agents={} ha_round_s={:.3} data_dir_round_s={:.3} memory_round_s={:.3} ha_barrier_s={:.3} ha_p99_rpc_ms={:.3} data_dir_p99_rpc_ms={:.3} memory_p99_rpc_ms={:.3}",
        args.agents, h.round_s, d.round_s, m.round_s, h.barrier_s, h.p99_rpc_ms, d.p99_rpc_ms, m.p99_rpc_ms
    );
    Ok(())
}

/// The agents against one service.
async fn run(args: &Args, endpoint: &str) -> anyhow::Result<Figures> {
    let n = args.agents;
    let jobs = args.jobs.min(n);
    let conns = args.connections.min(n) as usize;
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        let mut cfg = ClientConfig::new(endpoint.to_owned());
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
                store.publish_unique_id("", &node, 0, &[0x5a; 128]).await?;
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
    out!("agents={n} jobs={jobs} connections={conns} endpoint={endpoint}");
    out!(
        "join (blocking until the round forms): p50={:.2} ms p99={:.2} ms",
        percentile(&joins, 0.5),
        percentile(&joins, 0.99)
    );
    out!(
        "keep-alive + store set (non-blocking): p50={:.3} ms p99={:.3} ms over {} calls",
        percentile(&quick, 0.5),
        percentile(&quick, 0.99),
        quick.len()
    );
    out!("all agents hold the unique id after {uid_s:.3} s");
    out!("round formed after {round_s:.3} s, barrier released after {barrier_s:.3} s");
    Ok(Figures { round_s, barrier_s, p99_rpc_ms: percentile(&quick, 0.99) })
}
