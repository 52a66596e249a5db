//! `tcpstore-bench`: rsrun's TCPStore server against torch's libuv TCPStore server.
//!
//! 1. Throughput: `--clients` connections (one tokio task and one TCP connection each) do the
//!    VALIDATE + PING handshake, then alternate SET and GET of a small value on their own key for
//!    `--secs` seconds, against (a) `rsrun-rendezvous tcpstore` started as a child process (or the
//!    server in-process when that binary is not found) and (b) torch's libuv server in a Python
//!    child process. Same client, same run. SET and GET count one operation each.
//! 2. Scale: `--connections` concurrent connections to our server, each doing the handshake
//!    (VALIDATE + PING) and one more PING, all held open until the last one is through.
//!
//! Ends with `summary: tcpstore_ops_per_s=… torch_libuv_ops_per_s=… ratio=…` and
//! `summary: connections=… connect_s=…`. Build in release:
//! `cargo build --release -p rsrun-rendezvous -p rsrun-examples --bin rsrun-rendezvous --bin tcpstore-bench`.
#![allow(clippy::print_stdout)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rsrun_rendezvous::tcpstore::{TcpStoreClient, TcpStoreLimits, TcpStoreServer};

#[derive(Debug, Parser)]
struct Args {
    /// Client connections in the throughput measurement.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds of measured load per server (after one second of warm-up).
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// Value size in bytes.
    #[arg(long, default_value_t = 32)]
    value_bytes: usize,
    /// Concurrent connections in the scale measurement (0 skips it).
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// At most this many handshakes in flight while opening them (the rest wait their turn, so the
    /// listen backlog never overflows into SYN retries).
    #[arg(long, default_value_t = 1024)]
    connect_concurrency: usize,
    /// Python with torch (default: $RSRUN_TEST_PYTHON, else ~/.cache/rsrun-torch-venv/bin/python).
    #[arg(long)]
    python: Option<PathBuf>,
    /// The `rsrun-rendezvous` binary (default: next to this one; in-process server if absent).
    #[arg(long)]
    server_bin: Option<PathBuf>,
}

/// A child process killed and reaped on drop.
struct Owned(Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` (stdout piped) and reads its first stdout line as a port.
fn spawn_with_port(mut cmd: Command, what: &str) -> anyhow::Result<(Owned, u16)> {
    let mut child = Owned(cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("cannot start {what}"))?);
    let stdout = child.0.stdout.take().context("child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).with_context(|| format!("reading {what}'s port"))?;
    let port = line.trim().parse().with_context(|| format!("{what} printed {line:?}, not a port"))?;
    Ok((child, port))
}

fn raise_nofile_limit() -> anyhow::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain getrlimit/setrlimit on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            bail!("getrlimit: {}", std::io::Error::last_os_error());
        }
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            bail!("setrlimit: {}", std::io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// `clients` connections alternating SET and GET for `secs`; returns operations per second.
async fn load(addr: SocketAddr, clients: usize, secs: u64, value_bytes: usize) -> anyhow::Result<f64> {
    let ready = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let counting = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for i in 0..clients {
        let (ready, stop, counting, ops) = (ready.clone(), stop.clone(), counting.clone(), ops.clone());
        tasks.push(tokio::spawn(async move {
            let c = TcpStoreClient::connect(addr).await;
            ready.wait().await;
            let mut c = c?;
            let key = format!("/bench/{i}").into_bytes();
            let value = vec![b'v'; value_bytes];
            while !stop.load(Ordering::Relaxed) {
                c.set(&key, &value).await?;
                let got = c.get(&key).await?;
                if got.len() != value_bytes {
                    anyhow::bail!("GET returned {} bytes, expected {value_bytes}", got.len());
                }
                if counting.load(Ordering::Relaxed) {
                    ops.fetch_add(2, Ordering::Relaxed);
                }
            }
            anyhow::Ok(())
        }));
    }
    ready.wait().await;
    tokio::time::sleep(Duration::from_secs(1)).await; // warm-up
    let start = Instant::now();
    let before = ops.load(Ordering::Relaxed);
    counting.store(true, Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let done = ops.load(Ordering::Relaxed) - before;
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await??;
    }
    Ok(done as f64 / elapsed.as_secs_f64())
}

/// Opens `n` connections (handshake + one PING each) and holds them; returns the seconds until the
/// last one was through.
async fn connect_many(addr: SocketAddr, n: usize, concurrency: usize) -> anyhow::Result<f64> {
    let gate = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let all_done = Arc::new(tokio::sync::Barrier::new(n + 1));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let (gate, all_done) = (gate.clone(), all_done.clone());
        tasks.push(tokio::spawn(async move {
            let r = async {
                let _permit = gate.acquire().await?;
                let mut c = TcpStoreClient::connect(addr).await?;
                c.ping(i as u32).await?;
                anyhow::Ok(c)
            }
            .await;
            all_done.wait().await;
            r
        }));
    }
    all_done.wait().await;
    let secs = start.elapsed().as_secs_f64();
    let mut clients = Vec::with_capacity(n);
    for t in tasks {
        clients.push(t.await??);
    }
    drop(clients);
    Ok(secs)
}

async fn run(args: Args) -> anyhow::Result<()> {
    let nofile = raise_nofile_limit()?;
    println!("tcpstore-bench: {} clients, {} s per server, {}-byte values; RLIMIT_NOFILE {nofile}", args.clients, args.secs, args.value_bytes);

    // (a) ours.
    let server_bin = match &args.server_bin {
        Some(p) => Some(p.clone()),
        None => std::env::current_exe()?.parent().map(|d| d.join("rsrun-rendezvous")).filter(|p| p.is_file()),
    };
    let mut in_process = None;
    let (_ours_child, ours) = match &server_bin {
        Some(bin) => {
            let mut cmd = Command::new(bin);
            cmd.args(["tcpstore", "--listen", "127.0.0.1:0", "--print-port"]);
            let (child, port) = spawn_with_port(cmd, &bin.display().to_string())?;
            println!("ours: {} tcpstore (child process) on port {port}", bin.display());
            (Some(child), SocketAddr::from(([127, 0, 0, 1], port)))
        }
        None => {
            let s = TcpStoreServer::start("127.0.0.1:0".parse()?, TcpStoreLimits::default(), tokio_util::sync::CancellationToken::new())?;
            let addr = s.local_addr();
            in_process = Some(s);
            println!("ours: in-process server on {addr} (rsrun-rendezvous not found next to this binary)");
            (None, addr)
        }
    };
    let ours_ops = load(ours, args.clients, args.secs, args.value_bytes).await?;
    println!("ours: {ours_ops:.0} ops/s");

    // (b) torch's libuv server.
    let python = args
        .python
        .clone()
        .or_else(|| std::env::var_os("RSRUN_TEST_PYTHON").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rsrun-torch-venv/bin/python")))
        .context("no --python, RSRUN_TEST_PYTHON or HOME")?;
    let script = "import sys, torch, torch.distributed as d\n\
                  s = d.TCPStore('127.0.0.1', 0, 1, True, use_libuv=True, wait_for_workers=False)\n\
                  print(s.port, flush=True)\n\
                  print('torch', torch.__version__, file=sys.stderr, flush=True)\n\
                  sys.stdin.read()\n";
    let mut cmd = Command::new(&python);
    cmd.args(["-c", script]).stdin(Stdio::piped());
    let torch_ops = match spawn_with_port(cmd, &format!("{} (torch TCPStore)", python.display())) {
        Ok((_child, port)) => {
            println!("torch: libuv TCPStore ({}) on port {port}", python.display());
            let ops = load(SocketAddr::from(([127, 0, 0, 1], port)), args.clients, args.secs, args.value_bytes).await?;
            println!("torch: {ops:.0} ops/s");
            Some(ops)
        }
        Err(e) => {
            println!("torch: unavailable, not measured: {e:#}");
            None
        }
    };
    let fmt = |v: Option<f64>, digits: usize| v.map_or_else(|| "NA".to_string(), |v| format!("{v:.digits$}"));
    println!(
        "summary: tcpstore_ops_per_s={ours_ops:.0} torch_libuv_ops_per_s={} ratio={}",
        fmt(torch_ops, 0),
        fmt(torch_ops.map(|t| ours_ops / t), 2)
    );

    // 2. Scale, against ours.
    if args.connections > 0 {
        let secs = connect_many(ours, args.connections, args.connect_concurrency).await?;
        println!(
            "scale: {} connections held open at once, each VALIDATE + PING + PING, at most {} handshakes in flight",
            args.connections, args.connect_concurrency
        );
        println!("summary: connections={} connect_s={secs:.3}", args.connections);
    }
    if let Some(s) = in_process {
        s.shutdown().await;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(run(args))
}
