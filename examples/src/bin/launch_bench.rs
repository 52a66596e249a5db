//! `launch-bench`: what rsrun costs to launch.
//!
//! 1. Wall time and peak RSS of `rsrun --standalone --nproc-per-node 8 true`, against starting the 8
//!    `true` processes directly (median of `--runs`).
//! 2. 8 launchers × 1 worker each, all started at once, through an `rsrun-rendezvous` daemon on
//!    loopback: time until every launcher exited (median of `--node-runs`).
//!
//! 3. The anchor, in the same run, when a Python with torch is found (`--python`, else
//!    `$RSRUN_TEST_PYTHON`, else `scripts/torch-venv.sh`'s): torchrun from that Python's `bin/`
//!    doing the same two things (`torchrun --standalone --nproc-per-node 8 --no-python true`, and
//!    8 agents × 1 worker through c10d on loopback), interleaved run by run with rsrun's.
//!
//! Run it on release builds (`scripts/launch-bench.sh` does). It ends with:
//! `summary: workers=8 launch_ms=<median wall> overhead_ms=<minus direct> peak_rss_mib=<max>
//! torchrun_launch_ms=<median> torchrun_peak_rss_mib=<max> torchrun_over_rsrun=<ratio>` and
//! `summary: nodes=8 all_done_ms=<median> torchrun_all_done_ms=<median> torchrun_over_rsrun=<ratio>`
//! (the torchrun fields `na` without torch).
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
    /// Python with torch whose `torchrun` is the anchor (default: $RSRUN_TEST_PYTHON, else
    /// ~/.cache/rsrun-torch-venv/bin/python).
    #[arg(long)]
    python: Option<PathBuf>,
}

/// torchrun next to the Python that has torch, if there is one.
fn find_torchrun(python: Option<PathBuf>) -> Option<PathBuf> {
    let python = python
        .or_else(|| std::env::var_os("RSRUN_TEST_PYTHON").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rsrun-torch-venv/bin/python")))?;
    let torchrun = python.parent()?.join("torchrun");
    torchrun.is_file().then_some(torchrun)
}

/// A loopback port free when asked (the c10d agents need one given on their command line).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `a / b` as a summary field, `na` without `a`.
fn ratio(a: Option<f64>, b: f64) -> String {
    a.map_or_else(|| "na".into(), |a| format!("{:.1}", a / b))
}

fn field(v: Option<f64>) -> String {
    v.map_or_else(|| "na".into(), |v| format!("{v:.1}"))
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

    let torchrun = find_torchrun(args.python.clone());
    match &torchrun {
        Some(t) => println!("anchor: {}", t.display()),
        None => println!("anchor: no torchrun found (--python, $RSRUN_TEST_PYTHON or scripts/torch-venv.sh): not measured"),
    }
    let workers = args.workers.to_string();
    // One standalone launch of `launcher ARGS true`: wall time and the launcher's peak RSS.
    let once = |launcher: &Path, lead: &[&str], what: &str| -> anyhow::Result<(f64, u64)> {
        let t = Instant::now();
        let mut child = Command::new(launcher)
            .current_dir(&work)
            .args(lead)
            .arg("true")
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", launcher.display()))?;
        let (status, rss) = wait_rss(&mut child)?;
        let wall = ms(t.elapsed());
        if status != 0 {
            bail!("{what} failed (wait status {status})");
        }
        Ok((wall, rss))
    };
    let logs = work.join("logs").display().to_string();
    let rsrun_lead = ["--standalone", "--nproc-per-node", &workers, "--log-dir", &logs];
    let torchrun_lead = ["--standalone", "--nproc-per-node", &workers, "--no-python"];
    // rsrun --standalone, and torchrun the same way, run by run in turn.
    let (mut walls, mut peak_kib) = (Vec::new(), 0);
    let (mut t_walls, mut t_peak_kib) = (Vec::new(), 0);
    for _ in 0..args.runs {
        let (wall, rss) = once(&rsrun, &rsrun_lead, "rsrun")?;
        walls.push(wall);
        peak_kib = peak_kib.max(rss);
        if let Some(t) = &torchrun {
            let (wall, rss) = once(t, &torchrun_lead, "torchrun")?;
            t_walls.push(wall);
            t_peak_kib = t_peak_kib.max(rss);
        }
    }
    let launch = median(walls);
    let direct_ms = median(direct);
    let t_launch = (!t_walls.is_empty()).then(|| median(t_walls));
    println!("rsrun --standalone --nproc-per-node {} true: median {launch:.1} ms over {} runs; direct {direct_ms:.1} ms", args.workers, args.runs);
    if let Some(t) = t_launch {
        println!("torchrun --standalone --nproc-per-node {} --no-python true: median {t:.1} ms", args.workers);
    }

    // N launchers through the daemon (and N torchrun agents through c10d).
    let node_ms = nodes_bench(&daemon_bin, &rsrun, &work, args.nodes, args.node_runs)?;
    let t_node_ms = match &torchrun {
        Some(t) => Some(torchrun_nodes(t, &work, args.nodes, args.node_runs)?),
        None => None,
    };
    let _ = std::fs::remove_dir_all(&work);
    println!(
        "summary: workers={} launch_ms={launch:.1} overhead_ms={:.1} peak_rss_mib={:.1} torchrun_launch_ms={} torchrun_peak_rss_mib={} torchrun_over_rsrun={}",
        args.workers,
        launch - direct_ms,
        peak_kib as f64 / 1024.0,
        field(t_launch),
        field(t_launch.map(|_| t_peak_kib as f64 / 1024.0)),
        ratio(t_launch, launch)
    );
    println!(
        "summary: nodes={} all_done_ms={node_ms:.1} torchrun_all_done_ms={} torchrun_over_rsrun={}",
        args.nodes,
        field(t_node_ms),
        ratio(t_node_ms, node_ms)
    );
    Ok(())
}

/// `nodes` torchrun agents × 1 worker through its c10d rendezvous on loopback (the first one
/// hosts the store), all started at once: the median time until every agent exited.
fn torchrun_nodes(torchrun: &Path, work: &Path, nodes: u32, runs: usize) -> anyhow::Result<f64> {
    let mut endpoint = String::new();
    all_done_ms(nodes, runs, "a torchrun agent", |run, i| {
        if i == 0 {
            endpoint = format!("127.0.0.1:{}", free_port()?);
        }
        let mut cmd = Command::new(torchrun);
        cmd.current_dir(work)
            .args(["--nnodes", &nodes.to_string(), "--nproc-per-node", "1", "--rdzv-backend", "c10d"])
            .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", &format!("bench-{}-{run}", std::process::id()), "--no-python"])
            .arg(format!("--rdzv-conf=is_host={}", i == 0));
        Ok(cmd)
    })
}

/// `runs` times: starts `node(run, i)` for every node `i` at once (with `true` as the program),
/// waits for all of them; the median time until every one exited successfully.
fn all_done_ms(nodes: u32, runs: usize, what: &str, mut node: impl FnMut(usize, u32) -> anyhow::Result<Command>) -> anyhow::Result<f64> {
    let mut times = Vec::new();
    for run in 0..runs {
        let cmds = (0..nodes).map(|i| node(run, i)).collect::<anyhow::Result<Vec<_>>>()?;
        let t = Instant::now();
        let mut kids = Vec::new();
        for mut cmd in cmds {
            kids.push(cmd.arg("true").stdout(Stdio::null()).stderr(Stdio::null()).spawn()?);
        }
        for k in &mut kids {
            let st = k.wait()?;
            if !st.success() {
                bail!("{what} failed: {st}");
            }
        }
        times.push(ms(t.elapsed()));
    }
    Ok(median(times))
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
        all_done_ms(nodes, runs, "a launcher", |run, _| {
            let mut cmd = Command::new(rsrun);
            cmd.current_dir(work)
                .args(["--nnodes", &nodes.to_string(), "--rdzv-backend", "c10d", "--rdzv-endpoint", &addr])
                .args(["--rdzv-id", &format!("bench-{}-{run}", std::process::id()), "--log-dir"])
                .arg(work.join("logs"));
            Ok(cmd)
        })
    })();
    let _ = daemon.kill();
    let _ = daemon.wait();
    result
}
