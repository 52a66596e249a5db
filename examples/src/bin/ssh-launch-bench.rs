//! `ssh-launch-bench`: what one command for the whole job costs to start.
//!
//! `rsrun -H h1:1,...,hN:1 --rsh tests/fake-rsh ... sh -c ': > ready.$RANK; exec sleep 60'`: the time
//! from spawning the head to the last worker's marker file (its mtime), median of `--runs`. The fake
//! rsh runs each "host"'s agent on this machine, so this is rsrun's own cost: plan, rendezvous,
//! agents, join, workers. With `--ssh-config FILE` (hosts `h1`..`h3` reachable through a real sshd, as
//! in multinode.md §5.3) it also measures real ssh.
//!
//! Prints `summary: hosts=8 launch_ms=<median>` and, with `--ssh-config`,
//! `summary: ssh_hosts=3 launch_ms=<median>`.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use clap::Parser;

#[derive(Debug, Parser)]
struct Args {
    /// Directory holding `rsrun` (default: next to this binary).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// The fake rsh (default: the workspace's tests/fake-rsh).
    #[arg(long)]
    rsh: Option<PathBuf>,
    /// Hosts (1 worker each) through the fake rsh.
    #[arg(long, default_value_t = 8)]
    hosts: u32,
    /// Repetitions.
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// An ssh config naming hosts h1..h3 reachable over real ssh: measure those too.
    #[arg(long)]
    ssh_config: Option<PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One launch: milliseconds from spawning the head to the last worker's marker.
fn launch_once(rsrun: &Path, extra: &[String], hosts: &[String], work: &Path) -> anyhow::Result<f64> {
    let _ = std::fs::remove_dir_all(work);
    std::fs::create_dir_all(work)?;
    let list: Vec<String> = hosts.iter().map(|h| format!("{h}:1")).collect();
    let t0 = SystemTime::now();
    let mut head = Command::new(rsrun)
        .current_dir(work)
        .args(["-H", &list.join(","), "--allow-same-host", "--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "1"])
        .args(extra)
        .args(["sh", "-c", ": > ready.$RANK; exec sleep 60"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start rsrun")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let markers: Vec<PathBuf> = (0..hosts.len()).map(|r| work.join(format!("ready.{r}"))).collect();
    let result = loop {
        let times: Vec<SystemTime> = markers.iter().filter_map(|m| std::fs::metadata(m).and_then(|md| md.modified()).ok()).collect();
        if times.len() == markers.len() {
            let last = times.into_iter().max().unwrap_or(t0);
            break Ok(last.duration_since(t0).unwrap_or_default().as_secs_f64() * 1e3);
        }
        if let Some(st) = head.try_wait()? {
            break Err(anyhow::anyhow!("rsrun exited early ({st}) in {}", work.display()));
        }
        if Instant::now() > deadline {
            break Err(anyhow::anyhow!("workers did not start within 60 s in {}", work.display()));
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(head.id() as i32, libc::SIGTERM);
    }
    let _ = head.wait();
    result
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let dir = match args.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?.parent().context("binary directory")?.to_owned(),
    };
    let rsrun = dir.join("rsrun");
    if !rsrun.is_file() {
        bail!("{} not found: cargo build --release -p rsrun-launcher", rsrun.display());
    }
    let rsh = args.rsh.unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-rsh"));
    if !rsh.is_file() {
        bail!("fake rsh {} not found (--rsh PATH)", rsh.display());
    }
    let work = std::env::temp_dir().join(format!("rsrun-ssh-launch-bench-{}", std::process::id()));

    let hosts: Vec<String> = (1..=args.hosts).map(|i| format!("h{i}")).collect();
    let extra = vec!["--rsh".to_owned(), rsh.display().to_string()];
    let mut times = Vec::new();
    for run in 0..args.runs {
        let t = launch_once(&rsrun, &extra, &hosts, &work)?;
        println!("fake rsh run {run}: {} hosts, every worker running after {t:.1} ms", hosts.len());
        times.push(t);
    }
    println!("summary: hosts={} launch_ms={:.1}", hosts.len(), median(times));

    if let Some(cfg) = &args.ssh_config {
        let hosts: Vec<String> = (1..=3).map(|i| format!("h{i}")).collect();
        let extra = vec!["--ssh-config".to_owned(), cfg.display().to_string(), "--ssh-local".to_owned()];
        let mut times = Vec::new();
        for run in 0..args.runs {
            let t = launch_once(&rsrun, &extra, &hosts, &work)?;
            println!("ssh run {run}: {} hosts, every worker running after {t:.1} ms", hosts.len());
            times.push(t);
        }
        println!("summary: ssh_hosts={} launch_ms={:.1}", hosts.len(), median(times));
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}
