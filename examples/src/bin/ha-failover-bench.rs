//! `ha-failover-bench`: how long a highly available rendezvous is unavailable when its leader dies.
//!
//! Starts a 3-member etcd cluster on 127.0.0.1 (Debian's `etcd-server`), then 3
//! `rsrun-rendezvous serve --etcd-endpoints` daemons (next to this binary) with `--leader-lease-ttl`
//! (default 5 s). A client listing all three daemons keeps adding to a counter (a mutating call every
//! 10 ms). Each trial waits a random fraction of the renewal period, `kill -9`s the leader, and
//! measures the time from the kill to the first acknowledged add from a newer leader (the client
//! refuses answers of an older epoch); the killed daemon is then restarted as a standby and the next
//! trial waits until it caught up. A few trials stop the leader with SIGTERM instead (it revokes its
//! lease: the hand-over does not wait for the lease to expire).
//!
//! The anchor, in the same run: one daemon with `--data-dir`, `kill -9`'d and restarted at once by a
//! supervisor on the same address (today's durable single daemon), measured the same way.
//!
//! ```text
//! ha-failover-bench --trials 50
//! ```
//! The last line is `summary: failover_s_median=... failover_s_max=... trials=N`.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use rsrun_rendezvous::client::{ClientConfig, JobSpec, JoinSpec, RdzvClient};
use rsrun_rendezvous::proto::DaemonRole;
use rsrun_tests::KillOnDrop;

/// A line on stdout (what the benchmark reports).
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

#[derive(Parser, Debug)]
#[command(about = "Failover time of a highly available rendezvous group: kill -9 of the leader, SIGTERM, and a restarted --data-dir daemon as the anchor")]
struct Args {
    /// kill -9 trials.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    trials: u32,
    /// SIGTERM trials.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=1000))]
    sigterm_trials: u32,
    /// Anchor trials (the --data-dir daemon restarted at once).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=1000))]
    anchor_trials: u32,
    /// The daemons' --leader-lease-ttl in seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(2..=60))]
    lease_ttl: u64,
}

fn daemon_binary() -> anyhow::Result<std::path::PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the bench binary")?;
    let daemon = exe.with_file_name("rsrun-rendezvous");
    if !daemon.exists() {
        bail!("{} not found; build it first (cargo build --release -p rsrun-rendezvous)", daemon.display());
    }
    Ok(daemon)
}

/// Completion time and the client's epoch after every acknowledged add.
type Acks = Arc<Mutex<Vec<(Instant, u64)>>>;

/// A client adding to a counter every 10 ms until dropped; records every acknowledgement.
fn traffic(client: RdzvClient, job: String, round: u64, acks: Acks) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let store = client.store(&job, round);
        loop {
            if store.add("ctr", 1).await.is_ok() {
                acks.lock().unwrap_or_else(|p| p.into_inner()).push((Instant::now(), client.epoch()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
}

/// The first acknowledgement after `t0` by a leader of epoch `min_epoch` or later.
async fn restored(acks: &Acks, t0: Instant, min_epoch: u64, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        if let Some((at, _)) = acks.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(at, e)| *at > t0 && *e >= min_epoch) {
            return Ok(*at - t0);
        }
        if start.elapsed() > within {
            bail!("no acknowledged call within {within:?} after the fault");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn client_of(endpoints: &str) -> anyhow::Result<RdzvClient> {
    let mut cfg = ClientConfig::new(endpoints.to_owned());
    cfg.rpc_timeout = Duration::from_secs(60);
    cfg.connect_timeout = Duration::from_millis(500);
    Ok(RdzvClient::connect(cfg)?)
}

/// Creates the job whose store the traffic writes (one node, a lease longer than the run).
async fn store_job(client: &RdzvClient, job: &str) -> anyhow::Result<u64> {
    let spec = JobSpec { min_nodes: 1, max_nodes: 1, last_call: Duration::ZERO, lease: Duration::from_secs(3600), max_restarts: 0, fixed_ranks: false };
    let r = client
        .join(JoinSpec {
            job_id: job.into(),
            node_id: "bench".into(),
            addrs: vec!["127.0.0.1".into()],
            local_world_size: 1,
            rank_hint: None,
            config: spec,
            timeout: Duration::from_secs(30),
            master_port: 1,
            hostname: "bench".into(),
        })
        .await?;
    Ok(r.round.map(|r| r.round).unwrap_or(1))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) on a child we own.
    unsafe {
        libc::kill(pid, sig);
    }
}

struct Group {
    daemons: Vec<(String, Option<KillOnDrop>)>,
    args: Vec<String>,
    binary: std::path::PathBuf,
}

impl Group {
    fn spawn(&mut self, i: usize) -> anyhow::Result<()> {
        let (listen, _) = &self.daemons[i];
        let (child, _) = rsrun_tests::serve(&self.binary, listen, &self.args, "warn", Stdio::inherit()).map_err(anyhow::Error::msg)?;
        self.daemons[i].1 = Some(child);
        Ok(())
    }

    fn endpoints(&self) -> String {
        self.daemons.iter().map(|(a, _)| a.clone()).collect::<Vec<_>>().join(",")
    }

    /// The leader and its epoch; waits until exactly one daemon leads and every standby caught up.
    async fn settled(&self, probe: &RdzvClient) -> anyhow::Result<(usize, u64)> {
        let start = Instant::now();
        loop {
            let mut infos = Vec::new();
            for (addr, child) in &self.daemons {
                if child.is_some() {
                    infos.push(probe.daemon_info_at(addr).await.ok());
                } else {
                    infos.push(None);
                }
            }
            let leaders: Vec<usize> = (0..infos.len()).filter(|&i| infos[i].as_ref().is_some_and(|d| d.role == DaemonRole::Leader as i32)).collect();
            if let [l] = leaders[..] {
                let seq = infos[l].as_ref().map(|d| d.applied_seq).unwrap_or(0);
                let caught_up = infos.iter().flatten().all(|d| d.applied_seq + 200 >= seq && (d.role != DaemonRole::Standby as i32 || d.epoch > 0));
                if caught_up && infos.iter().all(Option::is_some) {
                    return Ok((l, infos[l].as_ref().map(|d| d.epoch).unwrap_or(0)));
                }
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("the group did not settle within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let binary = daemon_binary()?;
    let Some(etcd) = rsrun_tests::etcd::EtcdCluster::start("ha-failover-bench", 3) else {
        bail!("etcd is not installed (apt-get install etcd-server etcd-client)");
    };

    // The anchor: one durable daemon, kill -9 and an immediate restart on the same address.
    let mut anchor = Vec::new();
    if args.anchor_trials > 0 {
        let dir = tempfile::tempdir().context("data directory")?;
        let listen = format!("127.0.0.1:{}", rsrun_tests::free_port());
        let extra = vec!["--data-dir".to_string(), dir.path().display().to_string()];
        let (mut child, addr) = rsrun_tests::serve(&binary, &listen, &extra, "warn", Stdio::null()).map_err(anyhow::Error::msg)?;
        let client = client_of(&addr)?;
        let round = store_job(&client, "anchor").await?;
        let acks: Acks = Arc::default();
        let task = traffic(client, "anchor".into(), round, acks.clone());
        for _ in 0..args.anchor_trials {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let t0 = Instant::now();
            drop(child);
            child = rsrun_tests::serve(&binary, &listen, &extra, "warn", Stdio::null()).map_err(anyhow::Error::msg)?.0;
            anchor.push(restored(&acks, t0, 0, Duration::from_secs(60)).await?.as_secs_f64());
        }
        task.abort();
        drop(child);
    }

    // The group.
    let mut group = Group {
        daemons: (0..3).map(|_| (format!("127.0.0.1:{}", rsrun_tests::free_port()), None)).collect(),
        args: vec![
            "--etcd-endpoints".into(),
            etcd.endpoints_csv(),
            "--etcd-prefix".into(),
            "/rsrun-failover-bench".into(),
            "--leader-lease-ttl".into(),
            args.lease_ttl.to_string(),
        ],
        binary,
    };
    for i in 0..3 {
        group.spawn(i)?;
    }
    let probe = client_of(&group.endpoints())?;
    let client = client_of(&group.endpoints())?;
    let round = store_job(&client, "failover").await?;
    let acks: Acks = Arc::default();
    let task = traffic(client, "failover".into(), round, acks.clone());
    let renewal = Duration::from_millis(args.lease_ttl * 1000 / 3);
    let (mut kills, mut terms) = (Vec::new(), Vec::new());
    let total = args.trials + args.sigterm_trials;
    for trial in 0..total {
        let (leader, epoch) = group.settled(&probe).await?;
        // Crash at a random point of the renewal period.
        let jitter = Duration::from_millis(rand_below(renewal.as_millis() as u64));
        tokio::time::sleep(Duration::from_millis(300) + jitter).await;
        let graceful = trial >= args.trials;
        let t0 = Instant::now();
        match group.daemons[leader].1.take() {
            Some(mut c) if graceful => {
                signal(c.pid(), libc::SIGTERM);
                // Reaped once it exits (killed if it never does).
                std::thread::spawn(move || {
                    let _ = c.0.wait();
                });
            }
            Some(c) => drop(c),
            None => bail!("the leader is not running"),
        }
        let took = restored(&acks, t0, epoch + 1, Duration::from_secs(60)).await?.as_secs_f64();
        if graceful {
            terms.push(took);
        } else {
            kills.push(took);
        }
        out!("trial {:>3}: {} of leader {} (epoch {epoch}): a newer leader acknowledged after {took:.3} s", trial + 1, if graceful { "SIGTERM" } else { "kill -9" }, group.daemons[leader].0);
        if graceful {
            // Let the stopping daemon release its address.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        group.spawn(leader)?;
    }
    task.abort();
    let acked = acks.lock().unwrap_or_else(|p| p.into_inner()).len();
    let kmax = kills.iter().copied().fold(0.0, f64::max);
    let kmed = median(&mut kills);
    let tmax = terms.iter().copied().fold(0.0, f64::max);
    let tmed = median(&mut terms);
    let amax = anchor.iter().copied().fold(0.0, f64::max);
    let amed = median(&mut anchor);
    out!("lease ttl {} s; {acked} adds acknowledged during the run", args.lease_ttl);
    out!("anchor: --data-dir daemon, kill -9 and immediate restart: restored median {amed:.3} s, max {amax:.3} s over {} trials", anchor.len());
    out!("SIGTERM of the leader: restored median {tmed:.3} s, max {tmax:.3} s over {} trials", terms.len());
    out!("kill -9 of the leader: restored median {kmed:.3} s, max {kmax:.3} s over {} trials", kills.len());
    out!("summary: failover_s_median={kmed:.3} failover_s_max={kmax:.3} trials={}", kills.len());
    Ok(())
}

/// A number below `n` (time-seeded; enough to spread crash points over the renewal period).
fn rand_below(n: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    if n == 0 { 0 } else { u64::from(nanos).wrapping_mul(2_654_435_761) % n }
}
