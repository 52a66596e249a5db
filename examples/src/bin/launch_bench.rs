//! `launch-bench`: what rsrun costs to launch.
//!
//! 1. Wall time and peak RSS of `rsrun --standalone --nproc-per-node 8 true`, against starting the 8
//!    `true` processes directly (median of `--runs`).
//! 2. 8 launchers × 1 worker each, all started at once, through an `rsrun-rendezvous` daemon on
//!    loopback: time until every launcher exited (median of `--node-runs`).
//!
//! Run it on release builds (`scripts/launch-bench.sh` does). It ends with:
//! `summary: workers=8 launch_ms=<median wall> overhead_ms=<minus direct> peak_rss_mib=<max>` and
//! `summary: nodes=8 all_done_ms=<median>`.
#![allow(clippy::print_stdout)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// Directory holding `rsrun` and `rsrun-rendezvous` (default: next to this binary).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Repetitions of the single-node measurement.
    #[arg(long, default_value_t = 21)]
    runs: usize,
    /// Repetitions of the 8-node measurement.
    #[arg(long, default_value_t = 5)]
    node_runs: usize,
    /// Workers per launcher in the single-node measurement.
    #[arg(long, default_value_t = 8)]
    workers: u32,
    /// Launchers in the multi-node measurement.
    #[arg(long, default_value_t = 8)]
    nodes: u32,
}

/// Waits for `child` and returns its peak RSS in KiB (wait4's ru_maxrss).
fn wait_rss(child: &mut Child) -> anyhow::Result<(i32, u64)> {
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 writes it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers; the pid is our own child.
    let rc = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    if rc < 0 {
        bail!("wait4: {}", std::io::Error::last_os_error());
    }
    Ok((status, usage.ru_maxrss as u64))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = match args.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?.parent().context("binary directory")?.to_owned(),
    };
    let rsrun = dir.join("rsrun");
    let daemon_bin = dir.join("rsrun-rendezvous");
    for b in [&rsrun, &daemon_bin] {
        if !b.is_file() {
            bail!("{} not found: cargo build --release -p rsrun-launcher -p rsrun-rendezvous", b.display());
        }
    }
    let work = std::env::temp_dir().join(format!("rsrun-launch-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;

    // Direct: the same 8 processes started and waited for by this process.
    let mut direct = Vec::new();
    for _ in 0..args.runs {
        let t = Instant::now();
        let mut kids: Vec<Child> = (0..args.workers).map(|_| Command::new("true").spawn()).collect::<Result<_, _>>()?;
        for k in &mut kids {
            k.wait()?;
        }
        direct.push(ms(t.elapsed()));
    }

    // rsrun --standalone.
    let mut walls = Vec::new();
    let mut peak_kib = 0;
    for _ in 0..args.runs {
        let t = Instant::now();
        let mut child = Command::new(&rsrun)
            .current_dir(&work)
            .args(["--standalone", "--nproc-per-node", &args.workers.to_string(), "--log-dir"])
            .arg(work.join("logs"))
            .arg("true")
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let (status, rss) = wait_rss(&mut child)?;
        walls.push(ms(t.elapsed()));
        if status != 0 {
            bail!("rsrun failed (wait status {status})");
        }
        peak_kib = peak_kib.max(rss);
    }
    let launch = median(walls);
    let direct_ms = median(direct);
    println!("rsrun --standalone --nproc-per-node {} true: median {launch:.1} ms over {} runs; direct {direct_ms:.1} ms", args.workers, args.runs);

    // N launchers through the daemon.
    let node_ms = nodes_bench(&daemon_bin, &rsrun, &work, args.nodes, args.node_runs)?;
    let _ = std::fs::remove_dir_all(&work);
    println!(
        "summary: workers={} launch_ms={launch:.1} overhead_ms={:.1} peak_rss_mib={:.1}",
        args.workers,
        launch - direct_ms,
        peak_kib as f64 / 1024.0
    );
    println!("summary: nodes={} all_done_ms={node_ms:.1}", args.nodes);
    Ok(())
}

fn nodes_bench(daemon_bin: &Path, rsrun: &Path, work: &Path, nodes: u32, runs: usize) -> anyhow::Result<f64> {
    let mut daemon = Command::new(daemon_bin)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let result = (|| {
        let stdout = daemon.stdout.take().context("daemon stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line.trim().strip_prefix("listening on ").context("daemon address line")?.to_owned();
        let mut times = Vec::new();
        for run in 0..runs {
            let job = format!("bench-{}-{run}", std::process::id());
            let t = Instant::now();
            let mut kids = Vec::new();
            for _ in 0..nodes {
                kids.push(
                    Command::new(rsrun)
                        .current_dir(work)
                        .args(["--nnodes", &nodes.to_string(), "--rdzv-backend", "c10d", "--rdzv-endpoint", &addr])
                        .args(["--rdzv-id", &job, "--log-dir"])
                        .arg(work.join("logs"))
                        .arg("true")
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()?,
                );
            }
            for k in &mut kids {
                let st = k.wait()?;
                if !st.success() {
                    bail!("a launcher failed: {st}");
                }
            }
            times.push(ms(t.elapsed()));
        }
        Ok(median(times))
    })();
    let _ = daemon.kill();
    let _ = daemon.wait();
    result
}
