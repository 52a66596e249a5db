//! Slurm without a cluster (multinode.md §5.6): real `rsrun` processes on loopback, each started with
//! only the environment srun gives a task (`SLURM_*`), and no rsrun flags but the program. The node
//! list holds 127.0.0.x entries, so names resolve with no help, and `SLURM_STEP_RESV_PORTS` names a
//! free port, so no test depends on the derived port being free.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, code, free_port, rsrun, text};

/// Variables a task could inherit from the test's own environment and that would change the plan.
const SCRUB: &[&str] = &["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "JOB_COMPLETION_INDEX"];

/// `rsrun` in `dir` with no inherited Slurm or rank variables.
pub(crate) fn clean_rsrun(dir: &Path) -> Command {
    let mut cmd = rsrun(dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("SLURM") || SCRUB.contains(&k.as_str()) {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The worker program: writes its environment (NUL-separated) to `env.$RANK` in its cwd.
pub(crate) const DUMP_ENV: [&str; 3] = ["sh", "-c", "cat /proc/self/environ > env.$RANK"];

/// The environments the workers wrote in `dir`, by file name (`env.3`).
pub(crate) fn dumped_envs(dir: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("env.") {
            continue;
        }
        let raw = std::fs::read(e.path()).unwrap();
        let vars = raw
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .filter_map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned()))
            })
            .collect();
        out.insert(name, vars);
    }
    out
}

pub(crate) fn all(nodes: Vec<KillOnDrop>) -> Vec<Output> {
    let handles: Vec<_> = nodes.into_iter().map(|n| std::thread::spawn(move || n.output_within(RUN_DEADLINE))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// What srun sets for task `procid` of a step over `nodes` 127.0.0.x hosts with `tasks_per_node` tasks
/// each.
fn srun_env(job: u32, port: u16, nodes: u32, tasks_per_node: u32, procid: u32) -> Vec<(String, String)> {
    let node = procid / tasks_per_node;
    let v = [
        ("SLURM_JOB_ID", job.to_string()),
        ("SLURM_STEP_ID", "0".to_owned()),
        ("SLURM_JOB_NUM_NODES", nodes.to_string()),
        ("SLURM_JOB_NODELIST", format!("127.0.0.[1-{nodes}]")),
        ("SLURM_STEP_NODELIST", format!("127.0.0.[1-{nodes}]")),
        ("SLURM_STEP_NUM_NODES", nodes.to_string()),
        ("SLURM_STEP_NUM_TASKS", (nodes * tasks_per_node).to_string()),
        ("SLURM_STEP_TASKS_PER_NODE", format!("{tasks_per_node}(x{nodes})")),
        ("SLURM_NNODES", nodes.to_string()),
        ("SLURM_NTASKS", (nodes * tasks_per_node).to_string()),
        ("SLURM_NODEID", node.to_string()),
        ("SLURM_PROCID", procid.to_string()),
        ("SLURM_LOCALID", (procid % tasks_per_node).to_string()),
        ("SLURMD_NODENAME", format!("127.0.0.{}", node + 1)),
        ("SLURM_STEP_RESV_PORTS", format!("{port}-{}", port + 3)),
        // Under srun a task sees its node's GPUs; none here, so mode A runs SLURM_GPUS_ON_NODE workers.
        ("SLURM_GPUS_ON_NODE", "2".to_owned()),
    ];
    v.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

fn task(dir: &Path, env: &[(String, String)], args: &[&str]) -> KillOnDrop {
    let mut cmd = clean_rsrun(dir);
    cmd.envs(env.iter().map(|(k, v)| (k, v)))
        // Garbage a task may inherit: never used for planning, overwritten for the workers.
        .env("RANK", "7")
        .env("WORLD_SIZE", "99")
        .env("MASTER_ADDR", "192.0.2.1")
        .env("MASTER_PORT", "1")
        .args(args);
    KillOnDrop::spawn(&mut cmd)
}

fn get<'a>(env: &'a BTreeMap<String, String>, k: &str) -> &'a str {
    env.get(k).map(String::as_str).unwrap_or("")
}

/// Mode A: `srun --ntasks-per-node=1 rsrun PROGRAM` on 2 nodes, 2 workers each (SLURM_GPUS_ON_NODE):
/// one job `slurm-4242.0.r0`, RANK 0-3 contiguous per node, GROUP_RANK = SLURM_NODEID.
#[test]
fn mode_a_two_nodes_form_one_job_with_no_flags() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let nodes: Vec<KillOnDrop> = (0..2)
        .map(|n| {
            let d = dir.path().join(format!("node{n}"));
            std::fs::create_dir(&d).unwrap();
            task(&d, &srun_env(4242, port, 2, 1, n), &DUMP_ENV)
        })
        .collect();
    let outs = all(nodes);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    let mut ranks = Vec::new();
    for n in 0..2u32 {
        let envs = dumped_envs(&dir.path().join(format!("node{n}")));
        assert_eq!(envs.len(), 2, "node {n} runs 2 workers: {:?}", envs.keys());
        for env in envs.values() {
            let rank: u32 = get(env, "RANK").parse().unwrap();
            ranks.push(rank);
            assert_eq!(rank / 2, n, "node {n} runs ranks {} and {}", 2 * n, 2 * n + 1);
            assert_eq!(get(env, "GROUP_RANK"), n.to_string());
            assert_eq!(get(env, "LOCAL_RANK"), (rank % 2).to_string());
            assert_eq!(get(env, "WORLD_SIZE"), "4");
            assert_eq!(get(env, "LOCAL_WORLD_SIZE"), "2");
            assert_eq!(get(env, "GROUP_WORLD_SIZE"), "2");
            assert_eq!(get(env, "TORCHELASTIC_RUN_ID"), "slurm-4242.0.r0");
            assert_eq!(get(env, "MASTER_ADDR"), "127.0.0.1", "node 0's address");
            assert_ne!(get(env, "MASTER_PORT"), "1");
            assert_eq!(get(env, "RSRUN_RDZV_ENDPOINT"), format!("127.0.0.1:{port}"), "SLURM_STEP_RESV_PORTS's first port");
        }
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
}

/// Mode B: `srun --ntasks-per-node=2 rsrun PROGRAM` on 2 nodes: each task runs exactly one worker,
/// with RANK = SLURM_PROCID, LOCAL_RANK = SLURM_LOCALID, GROUP_RANK = SLURM_NODEID.
#[test]
fn mode_b_each_task_is_one_worker_with_slurms_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let tasks: Vec<KillOnDrop> = (0..4)
        .map(|p| {
            let d = dir.path().join(format!("task{p}"));
            std::fs::create_dir(&d).unwrap();
            task(&d, &srun_env(4343, port, 2, 2, p), &DUMP_ENV)
        })
        .collect();
    let outs = all(tasks);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    for p in 0..4u32 {
        let envs = dumped_envs(&dir.path().join(format!("task{p}")));
        assert_eq!(envs.keys().collect::<Vec<_>>(), vec![&format!("env.{p}")], "task {p} runs exactly its own rank");
        let env = &envs[&format!("env.{p}")];
        assert_eq!(get(env, "RANK"), p.to_string());
        assert_eq!(get(env, "LOCAL_RANK"), (p % 2).to_string());
        assert_eq!(get(env, "GROUP_RANK"), (p / 2).to_string());
        assert_eq!(get(env, "WORLD_SIZE"), "4");
        assert_eq!(get(env, "LOCAL_WORLD_SIZE"), "2");
        assert_eq!(get(env, "GROUP_WORLD_SIZE"), "2");
        assert_eq!(get(env, "TORCHELASTIC_RUN_ID"), "slurm-4343.0.r0");
        assert_eq!(get(env, "MASTER_ADDR"), "127.0.0.1");
        assert_ne!(get(env, "MASTER_PORT"), "1");
    }
}

/// Mode B with `--gpu-bind local-rank`: the worker of task k sees the k-th device of its node, not
/// device 0.
#[test]
fn mode_b_gpu_bind_uses_slurm_localid() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let tasks: Vec<KillOnDrop> = (0..2)
        .map(|p| {
            let d = dir.path().join(format!("task{p}"));
            std::fs::create_dir(&d).unwrap();
            let mut cmd = clean_rsrun(&d);
            cmd.envs(srun_env(4344, port, 1, 2, p)).env("CUDA_VISIBLE_DEVICES", "4,5");
            cmd.arg("--gpu-bind").arg("local-rank").args(DUMP_ENV);
            KillOnDrop::spawn(&mut cmd)
        })
        .collect();
    let outs = all(tasks);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    for (p, dev) in [(0, "4"), (1, "5")] {
        let envs = dumped_envs(&dir.path().join(format!("task{p}")));
        assert_eq!(get(&envs[&format!("env.{p}")], "CUDA_VISIBLE_DEVICES"), dev, "task {p}");
    }
}

/// Mode B with `--nproc-per-node 8`: every task would start 8 workers (the double launch); refused
/// before anything starts.
#[test]
fn mode_b_refuses_a_double_launch() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = clean_rsrun(dir.path());
    cmd.envs(srun_env(4345, free_port(), 2, 4, 0)).args(["--nproc-per-node", "8"]).args(DUMP_ENV);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("srun started 4 tasks on this node (SLURM_STEP_TASKS_PER_NODE=4(x2)), and each task is already one worker")
            && stderr.contains("--nproc-per-node 8 would start 64 workers instead of 8"),
        "{}",
        text(&out)
    );
    assert!(dumped_envs(dir.path()).is_empty(), "no worker starts");
}

/// Two Slurm steps whose ports collide: job B's node 1 finds job A's service at the port and keeps
/// looking (the waiting line names job A); job B's node 0 hosts on the next port, where its node 1
/// finds it. Each job forms on its own.
#[test]
fn steps_that_chose_the_same_port_never_join_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let sub = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        d
    };
    let (a0, b1, b0, a1) = (sub("a0"), sub("b1"), sub("b0"), sub("a1"));
    // Job A's node 0 holds the port and waits for its node 1.
    let job_a0 = task(&a0, &srun_env(5001, port, 2, 1, 0), &DUMP_ENV);
    assert!(
        rsrun_tests::wait_until(std::time::Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
        "job A's node 0 never listened"
    );
    // Job B (same port): node 1 first, then node 0.
    let job_b1 = task(&b1, &srun_env(5002, port, 2, 1, 1), &DUMP_ENV);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let job_b0 = task(&b0, &srun_env(5002, port, 2, 1, 0), &DUMP_ENV);
    let outs_b = all(vec![job_b0, job_b1]);
    for o in &outs_b {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    let stderr_b1 = String::from_utf8_lossy(&outs_b[1].stderr);
    assert!(
        stderr_b1.contains("waiting for node rank 0's rendezvous for job \"slurm-5002.0.r0\"")
            && stderr_b1.contains("serves job \"slurm-5001.0.r0\""),
        "{}",
        text(&outs_b[1])
    );
    assert!(String::from_utf8_lossy(&outs_b[0].stderr).contains(&format!("port {port} was taken")), "{}", text(&outs_b[0]));
    let job_a1 = task(&a1, &srun_env(5001, port, 2, 1, 1), &DUMP_ENV);
    let outs_a = all(vec![job_a0, job_a1]);
    for o in &outs_a {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    for (d, job) in [(&a0, "slurm-5001.0.r0"), (&a1, "slurm-5001.0.r0"), (&b0, "slurm-5002.0.r0"), (&b1, "slurm-5002.0.r0")] {
        let envs = dumped_envs(d);
        assert_eq!(envs.len(), 2, "{}", d.display());
        for env in envs.values() {
            assert_eq!(get(env, "TORCHELASTIC_RUN_ID"), job);
            assert_eq!(get(env, "WORLD_SIZE"), "4");
        }
    }
}

/// Mode A on 2 nodes × 1 worker running `script`, each node in its own directory.
fn two_nodes_running(dir: &Path, job: u32, script: &str) -> (Vec<std::path::PathBuf>, Vec<KillOnDrop>) {
    two_nodes_running_with(dir, job, script, &[])
}

/// [`two_nodes_running`] with more variables for both tasks (srun gives every task the same).
fn two_nodes_running_with(dir: &Path, job: u32, script: &str, extra: &[(String, String)]) -> (Vec<std::path::PathBuf>, Vec<KillOnDrop>) {
    let port = free_port();
    let mut dirs = Vec::new();
    let mut nodes = Vec::new();
    for n in 0..2 {
        let d = dir.join(format!("node{n}"));
        std::fs::create_dir(&d).unwrap();
        let mut env = srun_env(job, port, 2, 1, n);
        env.retain(|(k, _)| k != "SLURM_GPUS_ON_NODE");
        env.extend(extra.iter().cloned());
        nodes.push(task(&d, &env, &["sh", "-c", script]));
        dirs.push(d);
    }
    let ready = rsrun_tests::wait_until(std::time::Duration::from_secs(30), || {
        dirs.iter().enumerate().all(|(n, d)| d.join(format!("ready.{n}")).exists())
    });
    assert!(ready, "the workers never started");
    (dirs, nodes)
}

fn signal(node: &KillOnDrop, sig: i32) {
    // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(node.pid(), sig);
    }
}

/// §3.5: `#SBATCH --signal=USR1@120` signals every step: rsrun passes SIGUSR1 to its workers and keeps
/// supervising them (no restart, no stop).
#[test]
fn sigusr1_reaches_every_worker_and_supervision_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo usr1 > usr1.$RANK' USR1; touch ready.$RANK; i=0; \
                  while [ ! -f usr1.$RANK ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; \
                  [ -f usr1.$RANK ] && echo checkpointed $RANK";
    let (dirs, nodes) = two_nodes_running(dir.path(), 4250, script);
    for n in &nodes {
        signal(n, libc::SIGUSR1);
    }
    let outs = all(nodes);
    for (n, o) in outs.iter().enumerate() {
        assert_eq!(code(&o.status), 0, "{}", text(o));
        assert!(dirs[n].join(format!("usr1.{n}")).exists(), "worker {n} got no SIGUSR1\n{}", text(o));
        assert!(String::from_utf8_lossy(&o.stdout).contains(&format!("checkpointed {n}")), "{}", text(o));
        assert!(!String::from_utf8_lossy(&o.stderr).contains("restarting"), "{}", text(o));
    }
}

/// §3.5: SIGTERM (time limit, preemption, scancel) reaches the workers, which may save and exit, and
/// rsrun exits 143.
#[test]
fn sigterm_stops_the_workers_and_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo term > term.$RANK; exit 0' TERM; touch ready.$RANK; \
                  i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    let (dirs, nodes) = two_nodes_running(dir.path(), 4251, script);
    for n in &nodes {
        signal(n, libc::SIGTERM);
    }
    let outs = all(nodes);
    for (n, o) in outs.iter().enumerate() {
        assert_eq!(code(&o.status), 143, "{}", text(o));
        assert!(dirs[n].join(format!("term.{n}")).exists(), "worker {n} got no SIGTERM\n{}", text(o));
    }
}

/// A fake `scontrol` first on PATH that logs `SLURM_NODEID ARGS` per call (multinode.md §5.6), and the
/// variables that give both tasks `--requeue-on-preempt` (as srun would, with
/// `RSRUN_REQUEUE_ON_PREEMPT=1` exported).
fn fake_scontrol(dir: &Path) -> (std::path::PathBuf, Vec<(String, String)>) {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).unwrap();
    let log = dir.join("scontrol.log");
    let script = bin.join("scontrol");
    std::fs::write(&script, format!("#!/bin/sh\nprintf '%s %s\\n' \"$SLURM_NODEID\" \"$*\" >> '{}'\n", log.display())).unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    (log, vec![("PATH".to_owned(), path), ("RSRUN_REQUEUE_ON_PREEMPT".to_owned(), "1".to_owned())])
}

/// §3.5 `--requeue-on-preempt`: SIGTERM (preemption) to both agents; the workers save and exit,
/// both exit 143, and exactly one `scontrol requeue 4253` is logged, by node 0.
#[test]
fn requeue_on_preempt_sigterm_runs_scontrol_once_on_node_0() {
    let dir = tempfile::tempdir().unwrap();
    let (log, env) = fake_scontrol(dir.path());
    let script = "trap 'echo saved > saved.$RANK; exit 0' TERM; touch ready.$RANK; \
                  i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    let (dirs, nodes) = two_nodes_running_with(dir.path(), 4253, script, &env);
    for n in &nodes {
        signal(n, libc::SIGTERM);
    }
    let outs = all(nodes);
    for (n, o) in outs.iter().enumerate() {
        assert_eq!(code(&o.status), 143, "{}", text(o));
        assert!(dirs[n].join(format!("saved.{n}")).exists(), "worker {n} got no SIGTERM\n{}", text(o));
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap_or_default(), "0 requeue 4253\n", "node 0 requeues, once");
    assert!(
        String::from_utf8_lossy(&outs[0].stderr).contains("rsrun: preempted (SIGTERM): requeued Slurm job 4253 (`scontrol requeue 4253`)"),
        "{}",
        text(&outs[0])
    );
    assert!(!String::from_utf8_lossy(&outs[1].stderr).contains("requeue"), "{}", text(&outs[1]));
}

/// The same with SIGUSR1 (`--signal=USR1@120`): forwarded, the workers checkpoint and exit 0, the job
/// completes, node 0 requeues once; two signals still mean one requeue.
#[test]
fn requeue_on_preempt_sigusr1_after_the_workers_exit() {
    let dir = tempfile::tempdir().unwrap();
    let (log, env) = fake_scontrol(dir.path());
    let script = "trap 'echo usr1 > usr1.$RANK' USR1; touch ready.$RANK; i=0; \
                  while [ ! -f usr1.$RANK ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; exit 0";
    let (_dirs, nodes) = two_nodes_running_with(dir.path(), 4254, script, &env);
    for _ in 0..2 {
        for n in &nodes {
            signal(n, libc::SIGUSR1);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let outs = all(nodes);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap_or_default(), "0 requeue 4254\n", "node 0 requeues, once");
}

/// §3.2, the `127.0.1.1` trap: node rank 0's name resolves to a loopback address on node 0 while the
/// other host of the step resolves to a network address. Node 0 would host where nobody can reach
/// it: refused at once, exit 2, naming both and the fix. (`192.0.2.7` is a documentation address; it
/// is only parsed, never contacted.)
#[test]
fn node_rank_0_resolving_to_loopback_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = srun_env(4255, free_port(), 2, 1, 0);
    for (k, v) in env.iter_mut() {
        match k.as_str() {
            "SLURM_JOB_NODELIST" | "SLURM_STEP_NODELIST" => *v = "localhost,192.0.2.7".into(),
            "SLURMD_NODENAME" => *v = "localhost".into(),
            _ => {}
        }
    }
    let started = std::time::Instant::now();
    let out = task(dir.path(), &env, &DUMP_ENV).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rsrun: error: node rank 0's host localhost resolves to 127.0.0.1 here, a loopback address")
            && stderr.contains("while 192.0.2.7 resolves to 192.0.2.7")
            && stderr.contains("or pass --rdzv-endpoint ADDR:PORT"),
        "{}",
        text(&out)
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
    assert!(dumped_envs(dir.path()).is_empty(), "no worker starts");
}
