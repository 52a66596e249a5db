//! `tcpstore-bench`: rsrun's TCPStore server against torch's libuv TCPStore server.
//!
//! 1. Throughput: `--clients` connections do the VALIDATE + PING handshake, then send SET and GET
//!    of a small value on their own key and wait for the GET's reply, over and over, for `--secs`
//!    seconds, against (a) `rsrun-rendezvous tcpstore` started as a child process (or the server
//!    in-process when that binary is not found) and (b) torch's libuv server in a Python child
//!    process. Same client, same run, `--rounds` times in turn (ours, torch, ours, torch, ...);
//!    the summary takes each server's median. SET and GET count one operation each. The client is
//!    one thread with one epoll loop (see [`load`]), so the CPU it takes from the servers is as
//!    small as a client's can be. The summary is about one request with a reply in flight per
//!    connection, as torch's client sends them; a second line repeats the measurement with
//!    `--pipeline N` SET+GET pairs per write (torch's client never does that; it shows what each
//!    server does with several requests in one read: ours answers them with one write).
//!    With one request in flight, every request and every reply is a TCP segment of its own, and
//!    the kernel's loopback TCP path (the same for any server) takes most of both servers' CPU;
//!    `perf record -g -p <server pid>` during a run shows the split.
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
    /// SET+GET pairs per write in the second, pipelined measurement (0 skips it; the summary is
    /// always about one pair per write, one request with a reply in flight, as torch's client).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=4096))]
    pipeline: u64,
    /// Pin the client to CPU 0 and each server process to CPU 1 (with at least 2 CPUs), so that
    /// both servers run under the same placement and neither moves onto the client's core. Off by
    /// default: on a machine others use, a pinned process cannot move away from their load.
    #[arg(long)]
    pin: bool,
    /// Measurements per server, taken in turn; the summary reports the medians.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
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

/// Restricts the calling thread (`pid` 0) or process `pid`, and what it starts later, to `cpu`.
fn pin_to(pid: libc::pid_t, cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it for cpu < CPU_SETSIZE
    // (checked), and sched_setaffinity only reads it.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::other(format!("cpu {cpu} is out of range")));
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes `cmd`'s process (and every thread it starts) run on `cpu` only.
fn pin_command(cmd: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and only makes one system call.
    unsafe {
        cmd.pre_exec(move || pin_to(0, cpu));
    }
}

/// Starts `cmd` (stdout piped) and reads its first stdout line: a port, then maybe more words.
fn spawn_with_port(mut cmd: Command, what: &str) -> anyhow::Result<(Owned, u16, String)> {
    let mut child = Owned(cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("cannot start {what}"))?);
    let stdout = child.0.stdout.take().context("child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).with_context(|| format!("reading {what}'s port"))?;
    let (port, rest) = line.trim().split_once(' ').unwrap_or((line.trim(), ""));
    let port = port.parse().with_context(|| format!("{what} printed {line:?}, not a port"))?;
    Ok((child, port, rest.to_string()))
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

/// One load connection: its request bytes (SET + GET of its own key, `pipeline` times) and how
/// many reply bytes one batch brings back.
struct LoadConn {
    stream: mio::net::TcpStream,
    batch: Vec<u8>,
    /// Reply bytes of the batch still to come.
    due: usize,
    /// The expected reply (`pipeline` GET replies) and how much of it was checked.
    reply: Vec<u8>,
}

/// `clients` connections, each sending SET then GET of its own key (`pipeline` pairs per write,
/// 1 = one request with a reply in flight, as torch's client) for `secs` seconds after one second
/// of warm-up; returns operations (SETs plus GETs) per second.
///
/// The client is one thread with one epoll loop (mio): one `write` and one `read` per batch per
/// connection and nothing allocated per operation, so on a small machine it costs the server as
/// little CPU as a client can, and the server's own cost is what the figure measures. Every reply
/// is checked byte for byte.
fn load(addr: SocketAddr, clients: usize, secs: u64, value_bytes: usize, pipeline: usize) -> anyhow::Result<f64> {
    use mio::{Events, Interest, Poll, Token};
    use std::io::{Read, Write};
    use rsrun_rendezvous::tcpstore::proto::{Request, VALIDATE_MAGIC, put_bytes};

    let mut poll = Poll::new()?;
    let mut conns = Vec::with_capacity(clients);
    let value = vec![b'v'; value_bytes];
    for i in 0..clients {
        let mut s = std::net::TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        s.set_nodelay(true)?;
        let mut hs = Vec::new();
        Request::Validate { magic: VALIDATE_MAGIC }.encode(&mut hs);
        Request::Ping { nonce: i as u32 }.encode(&mut hs);
        s.write_all(&hs)?;
        let mut echo = [0u8; 4];
        s.read_exact(&mut echo).context("reading the PING echo")?;
        if u32::from_le_bytes(echo) != i as u32 {
            bail!("PING echoed {:#x}, sent {i:#x}", u32::from_le_bytes(echo));
        }
        s.set_nonblocking(true)?;
        let mut stream = mio::net::TcpStream::from_std(s);
        poll.registry().register(&mut stream, Token(i), Interest::READABLE)?;
        let key = format!("/bench/{i}").into_bytes();
        let (mut batch, mut reply) = (Vec::new(), Vec::new());
        for _ in 0..pipeline {
            Request::Set { key: key.clone(), value: value.clone() }.encode(&mut batch);
            Request::Get { key: key.clone() }.encode(&mut batch);
            put_bytes(&mut reply, &value);
        }
        conns.push(LoadConn { stream, batch, due: 0, reply });
    }
    for c in &mut conns {
        c.stream.write_all(&c.batch)?;
        c.due = c.reply.len();
    }
    let mut events = Events::with_capacity(clients.max(1));
    let mut buf = vec![0u8; 64 << 10];
    let started = Instant::now();
    let (warm, end) = (started + Duration::from_secs(1), started + Duration::from_secs(1 + secs));
    let mut batches = 0u64;
    let mut at_warm: Option<(Instant, u64)> = None;
    loop {
        let now = Instant::now();
        if at_warm.is_none() && now >= warm {
            at_warm = Some((now, batches));
        }
        if now >= end {
            break;
        }
        poll.poll(&mut events, Some(Duration::from_millis(100)))?;
        for ev in events.iter() {
            let c = &mut conns[ev.token().0];
            loop {
                let n = match c.stream.read(&mut buf) {
                    Ok(0) => bail!("the server closed connection {}", ev.token().0),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e).context("reading replies"),
                };
                let mut got = &buf[..n];
                while !got.is_empty() {
                    if c.due == 0 {
                        bail!("{} reply bytes nobody asked for", got.len());
                    }
                    let at = c.reply.len() - c.due;
                    let take = got.len().min(c.due);
                    if got[..take] != c.reply[at..at + take] {
                        bail!("a GET reply differs from the value just SET");
                    }
                    got = &got[take..];
                    c.due -= take;
                    if c.due == 0 {
                        batches += 1;
                        c.stream.write_all(&c.batch).context("writing requests")?;
                        c.due = c.reply.len();
                    }
                }
                // A short read emptied the socket: the next reply brings a new event.
                if n < buf.len() {
                    break;
                }
            }
        }
    }
    let (t0, b0) = at_warm.context("the measurement ended before the warm-up did")?;
    let ops = (batches - b0) * 2 * pipeline as u64;
    Ok(ops as f64 / t0.elapsed().as_secs_f64())
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
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let pin = args.pin && cpus >= 2;
    println!(
        "tcpstore-bench: {} clients, {} s per server per round, {} rounds, {}-byte values; RLIMIT_NOFILE {nofile}",
        args.clients, args.secs, args.rounds, args.value_bytes
    );
    println!("{cpus} CPUs; {}", if pin { "client on CPU 0, each server on CPU 1" } else { "no pinning" });

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
            if pin {
                pin_command(&mut cmd, 1);
            }
            let (child, port, _) = spawn_with_port(cmd, &bin.display().to_string())?;
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

    // (b) torch's libuv server.
    let python = args
        .python
        .clone()
        .or_else(|| std::env::var_os("RSRUN_TEST_PYTHON").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rsrun-torch-venv/bin/python")))
        .context("no --python, RSRUN_TEST_PYTHON or HOME")?;
    let script = "import sys, torch, torch.distributed as d\n\
                  s = d.TCPStore('127.0.0.1', 0, 1, True, use_libuv=True, wait_for_workers=False)\n\
                  print(s.port, torch.__version__, flush=True)\n\
                  sys.stdin.read()\n";
    let mut cmd = Command::new(&python);
    // stderr: libuv logs every connection the client closes at the end.
    cmd.args(["-c", script]).stdin(Stdio::piped()).stderr(Stdio::null());
    if pin {
        pin_command(&mut cmd, 1);
    }
    let torch = match spawn_with_port(cmd, &format!("{} (torch TCPStore)", python.display())) {
        Ok((child, port, version)) => {
            println!("torch: libuv TCPStore of torch {version} ({}) on port {port}", python.display());
            Some((child, SocketAddr::from(([127, 0, 0, 1], port))))
        }
        Err(e) => {
            println!("torch: unavailable, not measured: {e:#}");
            None
        }
    };

    let (clients, secs, value_bytes) = (args.clients, args.secs, args.value_bytes);
    let measure = move |addr, pipeline| {
        tokio::task::spawn_blocking(move || {
            if pin {
                pin_to(0, 0).context("pinning the client to CPU 0")?;
            }
            load(addr, clients, secs, value_bytes, pipeline)
        })
    };
    let depths: Vec<usize> = if args.pipeline > 1 { vec![1, args.pipeline as usize] } else { vec![1] };
    // Per depth: ours, torch.
    let mut all: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); depths.len()];
    for round in 1..=args.rounds {
        for (d, &depth) in depths.iter().enumerate() {
            let o = measure(ours, depth).await??;
            all[d].0.push(o);
            let t = match &torch {
                Some((_, addr)) => Some(measure(*addr, depth).await??),
                None => None,
            };
            let shown = t.map_or_else(String::new, |t| format!(", torch {t:.0} ops/s (ratio {:.2})", o / t));
            println!("round {round}, {depth} SET+GET per write: ours {o:.0} ops/s{shown}");
            all[d].1.extend(t);
        }
    }
    drop(torch);
    let fmt = |v: Option<f64>, digits: usize| v.map_or_else(|| "NA".to_string(), |v| format!("{v:.digits$}"));
    let spread = |v: &[f64]| if v.is_empty() { "NA".to_string() } else { format!("{:.0}..{:.0}", v[0], v[v.len() - 1]) };
    let mut lines = Vec::new();
    for (d, &depth) in depths.iter().enumerate() {
        let (o, t) = &mut all[d];
        let ours_ops = median(o);
        let torch_ops = (!t.is_empty()).then(|| median(t));
        println!("{depth} SET+GET per write, spread over {} rounds: ours {} ops/s, torch {} ops/s", args.rounds, spread(o), spread(t));
        let figures = format!(
            "tcpstore_ops_per_s={ours_ops:.0} torch_libuv_ops_per_s={} ratio={}",
            fmt(torch_ops, 0),
            fmt(torch_ops.map(|t| ours_ops / t), 2)
        );
        lines.push(if depth == 1 { format!("summary: {figures}") } else { format!("pipelined ({depth} SET+GET per write): {figures}") });
    }
    for l in lines {
        println!("{l}");
    }

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

/// Sorts `v` and returns its median.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(run(args))
}
