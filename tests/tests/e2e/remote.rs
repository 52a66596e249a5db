//! One command for the whole job: `rsrun -H h1:2,h2:2,h3:2 --rsh tests/fake-rsh ...`. The fake rsh
//! (multinode.md §5.5) drops ssh's options and runs the agent command locally "as" each host, so three
//! "hosts" are three agents on this machine (`--allow-same-host`). It logs every call's argv and pid,
//! which is how the tests find the agents they started (never by name).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use rsrun_tests::{KillOnDrop, alive, bin, code, read_pids, rsrun, text, wait_until};

fn fake_rsh() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-rsh")
}

/// `rsrun -H HOSTS --rsh fake-rsh --allow-same-host --rdzv-endpoint 127.0.0.1:0 --shutdown-timeout 1`.
fn head(dir: &Path, hosts: &str) -> Command {
    let mut cmd = fake_rsh_head(dir);
    cmd.args(["-H", hosts, "--allow-same-host"]);
    cmd
}

/// `rsrun --rsh fake-rsh --rdzv-endpoint 127.0.0.1:0 --shutdown-timeout 1` (no hosts yet).
fn fake_rsh_head(dir: &Path) -> Command {
    let mut cmd = rsrun(dir);
    cmd.arg("--rsh")
        .arg(fake_rsh())
        .args(["--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "1"])
        .env("FAKE_RSH_LOG", dir.join("rsh.log"))
        .env_remove("FAKE_RSH_FAIL")
        .env_remove("FAKE_RSH_HIDE")
        .env_remove("FAKE_RSH_DELAY")
        .env_remove("FAKE_RSH_STAMPS")
        .env_remove("FAKE_RSH_BANNER");
    cmd
}

/// The fake rsh's stamps: (host, start, end of its delay) per call, in start order.
fn rsh_stamps(dir: &Path) -> Vec<(String, f64, f64)> {
    let mut v: Vec<(String, f64, f64)> = std::fs::read_to_string(dir.join("stamps"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[0].to_owned(), f[1].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    v
}

/// The fake rsh's log: (pid, argv after the rsh program) per call.
fn rsh_calls(dir: &Path) -> Vec<(i32, Vec<String>)> {
    std::fs::read_to_string(dir.join("rsh.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut f = l.split('\t');
            let pid = f.next().unwrap().parse().unwrap();
            (pid, f.map(str::to_owned).collect())
        })
        .collect()
}

fn agent_pids(dir: &Path) -> Vec<i32> {
    rsh_calls(dir).into_iter().map(|(p, _)| p).collect()
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Every pid dead within `deadline`; the survivors are killed and named otherwise.
fn all_gone(pids: &[i32], deadline: Duration) -> Result<(), Vec<i32>> {
    if wait_until(deadline, || pids.iter().all(|&p| !alive(p))) {
        return Ok(());
    }
    let survivors: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &survivors {
        kill(p, libc::SIGKILL);
    }
    Err(survivors)
}

/// Workers that record their pid and then sleep (exec: the pid is the sleeping process).
const SLEEPER: &str = "echo $$ >> pids; exec sleep 60";

#[test]
fn three_hosts_two_slots_get_contiguous_ranks_and_exact_argv() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"$FAKE_RSH_HOST $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $WORLD_SIZE $MASTER_ADDR\" > rank.$RANK; echo hi from $RANK";
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2,h3:2").args(["sh", "-c", script]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..6u32 {
        let line = std::fs::read_to_string(dir.path().join(format!("rank.{rank}"))).unwrap_or_else(|_| panic!("rank {rank} never ran\n{}", text(&out)));
        let expected = format!("h{} {rank} {} 2 {} 6 127.0.0.1\n", rank / 2 + 1, rank % 2, rank / 2);
        assert_eq!(line, expected, "rank {rank}");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..6u32 {
        assert!(stdout.contains(&format!("h{} [rank {rank}] hi from {rank}\n", rank / 2 + 1)), "console lines carry the host:\n{stdout}");
    }
    // The exact argv each "host" was started with.
    let rsrun_path = std::fs::canonicalize(bin("rsrun")).unwrap();
    let mut calls: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (_, argv) in rsh_calls(dir.path()) {
        calls.insert(argv[argv.len() - 2].clone(), argv);
    }
    assert_eq!(calls.len(), 3, "{calls:?}");
    for (host, argv) in calls {
        let expected: Vec<String> = [
            "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15", "-o",
            "ServerAliveCountMax=4", "--", &host, &format!("exec '{}' agent --stdin", rsrun_path.display()),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(argv, expected, "argv of {host}");
    }
}

#[test]
fn env_values_and_cwd_arrive_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let quoted = "a \"b\" $(id) `id` 'c' \\n ${HOME}";
    let newline = "line one\nline two\n";
    // Two 100 KB values: a 200 KB plan that no single command line (ssh joins its arguments into one
    // string) could carry. Each stays below Linux's 128 KiB limit for one environment string.
    let chunk = "q'\"$(x)`y`\\ ";
    let big1: String = chunk.repeat(100_000 / chunk.len());
    let big2: String = big1.chars().rev().collect();
    std::fs::write(dir.path().join("big.env"), format!("# two big values\nBIG1={big1}\n\nBIG2={big2}\n")).unwrap();
    std::fs::write(dir.path().join(".rsrun_env"), "FROM_DOT=dot file value\n").unwrap();
    let script = "printf %s \"$Q\" > q.$RANK; printf %s \"$NL\" > nl.$RANK; printf %s \"$BIG1\" > big1.$RANK; printf %s \"$BIG2\" > big2.$RANK; printf %s \"$FROM_DOT\" > dot.$RANK; pwd > cwd.$RANK";
    let out = rsrun_tests::run(
        head(dir.path(), "h1:1,h2:1,h3:1")
            .env("NL", newline)
            .args(["-x", &format!("Q={quoted}"), "-x", "NL", "--env-file", "big.env", "sh", "-c", script]),
    );
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let read = |name: &str, rank: u32| std::fs::read_to_string(dir.path().join(format!("{name}.{rank}"))).unwrap();
    let cwd = std::fs::canonicalize(dir.path()).unwrap();
    for rank in 0..3 {
        assert_eq!(read("q", rank), quoted, "rank {rank}");
        assert_eq!(read("nl", rank), newline, "rank {rank}");
        assert!(read("big1", rank) == big1, "rank {rank}: BIG1 differs");
        assert!(read("big2", rank) == big2, "rank {rank}: BIG2 differs");
        assert_eq!(read("dot", rank), "dot file value", "rank {rank}");
        assert_eq!(read("cwd", rank).trim_end(), cwd.to_str().unwrap(), "rank {rank}");
    }
}

#[test]
fn one_env_value_over_the_exec_limit_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("huge.env"), format!("HUGE={}\n", "x".repeat(200_000))).unwrap();
    let out = rsrun_tests::run(head(dir.path(), "h1:1").args(["--env-file", "huge.env", "true"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HUGE (") && stderr.contains("MAX_ARG_STRLEN"), "{stderr}");
    assert!(rsh_calls(dir.path()).is_empty(), "nothing was started");
}

#[test]
fn worker_exit_3_on_host_2_is_the_exit_code_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo $$ >> pids; if [ \"$RANK\" = 2 ]; then while [ $(wc -l < pids) -lt 6 ]; do sleep 0.05; done; echo boom >&2; exit 3; fi; exec sleep 60";
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2,h3:2").args(["sh", "-c", script]));
    assert_eq!(code(&out.status), 3, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("root cause rank 2 (local_rank 0) on h2: exit code 3 -> rsrun exits 3"), "{}", text(&out));
    assert!(stderr.contains("h2 [rank 2] boom"), "{}", text(&out));
    let mut pids = read_pids(&dir.path().join("pids"));
    assert_eq!(pids.len(), 6);
    pids.extend(agent_pids(dir.path()));
    assert_eq!(all_gone(&pids, Duration::from_secs(5)), Ok(()), "processes of the job left");
}

/// A head of 3 fake hosts with 2 [`SLEEPER`] workers each, once all 6 have started; and the file
/// of their pids.
fn three_hosts_of_sleepers(dir: &Path) -> (KillOnDrop, PathBuf) {
    let child = KillOnDrop::spawn(head(dir, "h1:2,h2:2,h3:2").args(["sh", "-c", SLEEPER]));
    let pids_file = dir.join("pids");
    assert!(wait_until(Duration::from_secs(30), || read_pids(&pids_file).len() == 6), "workers did not start");
    (child, pids_file)
}

#[test]
fn sigint_stops_every_host_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let (child, pids_file) = three_hosts_of_sleepers(dir.path());
    kill(child.pid(), libc::SIGINT);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 130, "{}", text(&out));
    let mut pids = read_pids(&pids_file);
    pids.extend(agent_pids(dir.path()));
    assert_eq!(all_gone(&pids, Duration::from_secs(3)), Ok(()), "processes of the job left after SIGINT");
}

/// SIGUSR1 at the head (Slurm's `--signal=B:USR1@120` on the batch step, a `kill -USR1` asking
/// for a checkpoint) reaches every host's workers, which go on running: the head passes it on
/// to the agents instead of dropping it.
#[test]
fn sigusr1_at_the_head_reaches_every_hosts_workers() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo usr1 >> usr1.$RANK' USR1; echo $$ >> pids; i=0; while [ ! -f usr1.$RANK ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; sleep 0.2; exit 0";
    let child = KillOnDrop::spawn(head(dir.path(), "h1:1,h2:1").args(["sh", "-c", script]));
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(30), || read_pids(&pids_file).len() == 2), "workers did not start");
    kill(child.pid(), libc::SIGUSR1);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..2 {
        assert!(dir.path().join(format!("usr1.{rank}")).exists(), "rank {rank} got no SIGUSR1\n{}", text(&out));
    }
}

#[test]
fn kill_9_of_the_head_leaves_no_worker() {
    for attempt in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let (mut child, pids_file) = three_hosts_of_sleepers(dir.path());
        let workers = read_pids(&pids_file);
        let agents = agent_pids(dir.path());
        kill(child.pid(), libc::SIGKILL);
        let _ = child.0.wait();
        // --shutdown-timeout 1 + 2 s: the agents see EOF on stdin and stop their workers.
        assert_eq!(all_gone(&workers, Duration::from_secs(3)), Ok(()), "attempt {attempt}: workers left after kill -9 of the head");
        assert_eq!(all_gone(&agents, Duration::from_secs(10)), Ok(()), "attempt {attempt}: agents left");
    }
}

/// An agent that dies after the job started (OOM killer, `kill -9`, a dropped connection) is a
/// lost host: the head names it, stops the other hosts, and exits non-zero.
#[test]
fn an_agent_killed_after_the_start_stops_the_others_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (child, pids_file) = three_hosts_of_sleepers(dir.path());
    let h2 = rsh_calls(dir.path())
        .into_iter()
        .find(|(_, argv)| argv.iter().any(|a| a == "h2"))
        .map(|(pid, _)| pid)
        .expect("the agent of h2");
    kill(h2, libc::SIGKILL);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 1, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("h2: lost the agent: ssh was killed by signal 9"), "{}", text(&out));
    assert!(stderr.contains("the head lost the agent on h2 (above) and stopped the other hosts"), "{}", text(&out));
    let mut pids = read_pids(&pids_file);
    pids.extend(agent_pids(dir.path()));
    assert_eq!(all_gone(&pids, Duration::from_secs(5)), Ok(()), "processes of the job left");
}

#[test]
fn a_second_job_on_the_same_hosts_is_untouched() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let job_a = KillOnDrop::spawn(head(a.path(), "h1:1,h2:1").args(["sh", "-c", SLEEPER]));
    let job_b = KillOnDrop::spawn(head(b.path(), "h1:1,h2:1").args(["sh", "-c", SLEEPER]));
    let (pa, pb) = (a.path().join("pids"), b.path().join("pids"));
    assert!(wait_until(Duration::from_secs(30), || read_pids(&pa).len() == 2 && read_pids(&pb).len() == 2));
    kill(job_a.pid(), libc::SIGINT);
    let out = job_a.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 130, "{}", text(&out));
    assert_eq!(all_gone(&read_pids(&pa), Duration::from_secs(3)), Ok(()));
    std::thread::sleep(Duration::from_millis(300));
    let b_workers = read_pids(&pb);
    assert!(b_workers.iter().all(|&p| alive(p)), "job B lost workers when job A stopped");
    kill(job_b.pid(), libc::SIGTERM);
    let out = job_b.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    assert_eq!(all_gone(&b_workers, Duration::from_secs(3)), Ok(()));
}

#[test]
fn auth_failure_exits_2_naming_the_host_within_2_s() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2,h3:2").env("FAKE_RSH_FAIL", "h2").args(["sh", "-c", SLEEPER]));
    let took = start.elapsed();
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rsrun: error: h2: ssh authentication failed (Permission denied (publickey))\n"), "{stderr}");
    assert!(!stderr.contains("rsrun: error: h1") && !stderr.contains("rsrun: error: h3"), "only h2 failed:\n{stderr}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert!(read_pids(&dir.path().join("pids")).is_empty(), "no worker started");
    assert_eq!(all_gone(&agent_pids(dir.path()), Duration::from_secs(3)), Ok(()));
}

/// `--chdir DIR`: agents and workers run in DIR on every host, not in the head's directory.
#[test]
fn chdir_is_every_hosts_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let there = std::fs::canonicalize(elsewhere.path()).unwrap();
    let out = rsrun_tests::run(head(dir.path(), "h1:1,h2:1").arg("--chdir").arg(&there).args(["sh", "-c", "pwd > cwd.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for r in 0..2 {
        assert_eq!(std::fs::read_to_string(there.join(format!("cwd.{r}"))).unwrap().trim_end(), there.to_str().unwrap());
    }
    assert!(!dir.path().join("cwd.0").exists());
}

#[test]
fn a_missing_cwd_on_one_host_exits_2_naming_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).unwrap();
    let probe = Command::new("unshare").args(["-m", "true"]).status();
    if !probe.is_ok_and(|s| s.success()) {
        eprintln!("skipped: `unshare -m` is not permitted here (the fake rsh hides the cwd in a mount namespace)");
        return;
    }
    let hide = format!("h2:{}", dir.path().display());
    let out = rsrun_tests::run(head(&work, "h1:1,h2:1,h3:1").env("FAKE_RSH_LOG", dir.path().join("rsh.log")).env("FAKE_RSH_HIDE", hide).args(["sh", "-c", SLEEPER]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let cwd = std::fs::canonicalize(&work).unwrap();
    assert!(stderr.contains(&format!("rsrun: error: h2: cwd {} does not exist on h2", cwd.display())), "{stderr}");
    assert!(!work.join("pids").exists(), "no worker started");
}

#[test]
fn dry_run_prints_each_hosts_argv() {
    let dir = tempfile::tempdir().unwrap();
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2").args(["-x", "SECRET=hunter2", "--dry-run", "sh", "-c", "true"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rsrun_path = std::fs::canonicalize(bin("rsrun")).unwrap();
    let line = format!(
        "  h2: {} -T -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4 -- h2 'exec '\\''{}'\\'' agent --stdin'\n",
        fake_rsh().display(),
        rsrun_path.display()
    );
    assert!(stdout.contains(&line), "expected {line:?} in\n{stdout}");
    assert!(stdout.contains("node 1   h2                   slots 2   ranks 2-3 (ssh)"), "{stdout}");
    assert!(stdout.contains("SECRET") && !stdout.contains("hunter2"), "{stdout}");
    assert!(rsh_calls(dir.path()).is_empty(), "a dry run starts nothing");
}

/// multinode.md §7, acceptance 3: `-i h1:1@h3` keeps slot 1 of h1 and all of h3: 3 workers, the one
/// on h1 with `CUDA_VISIBLE_DEVICES=1`, ranks contiguous in host order.
#[test]
fn include_picks_slots_and_devices() {
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"$FAKE_RSH_HOST $LOCAL_RANK $LOCAL_WORLD_SIZE ${CUDA_VISIBLE_DEVICES-unset}\" > rank.$RANK";
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2,h3:2").env_remove("CUDA_VISIBLE_DEVICES").args(["-i", "h1:1@h3", "sh", "-c", script]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let read = |r: u32| std::fs::read_to_string(dir.path().join(format!("rank.{r}"))).unwrap_or_else(|_| panic!("rank {r} never ran\n{}", text(&out)));
    assert_eq!(read(0), "h1 0 1 1\n");
    assert!(read(1).starts_with("h3 0 2 ") && read(2).starts_with("h3 1 2 "), "{} {}", read(1), read(2));
    assert!(!dir.path().join("rank.3").exists(), "3 workers only");
}

/// `scripts/kubectl-rsh` as `--rsh` (each host a pod, `kubectl exec -i POD -- sh -c COMMAND`), with a
/// stand-in `kubectl` that logs its argv and runs the command here: the argv it gets is exact, and
/// the job runs.
#[test]
fn kubectl_exec_wrapper_as_rsh() {
    let dir = tempfile::tempdir().unwrap();
    let kubectl = dir.path().join("kubectl");
    let log = dir.path().join("kubectl.log");
    std::fs::write(
        &kubectl,
        // One write per call (the two pods' calls run at once: separate writes interleave).
        format!("#!/bin/sh\nline=$(printf '%s|' \"$@\")\nprintf '%s\\n' \"$line\" >> '{}'\nwhile [ \"$1\" != -- ]; do shift; done; shift\nexec \"$@\"\n", log.display()),
    )
    .unwrap();
    std::fs::set_permissions(&kubectl, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let wrapper = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("scripts/kubectl-rsh");
    let mut cmd = rsrun(dir.path());
    cmd.args(["-H", "pod-0:1,pod-1:1", "--rsh"])
        .arg(&wrapper)
        .args(["--allow-same-host", "--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "1"])
        .env("RSRUN_KUBECTL", &kubectl)
        .env("RSRUN_KUBE_NAMESPACE", "train")
        .env_remove("RSRUN_KUBE_CONTAINER")
        .args(["sh", "-c", "echo $RANK > rank.$RANK"]);
    let out = rsrun_tests::run(&mut cmd);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(dir.path().join("rank.0").exists() && dir.path().join("rank.1").exists(), "{}", text(&out));
    let rsrun_path = std::fs::canonicalize(bin("rsrun")).unwrap();
    let mut calls: Vec<String> = std::fs::read_to_string(&log).unwrap().lines().map(str::to_owned).collect();
    calls.sort();
    let expected: Vec<String> = ["pod-0", "pod-1"]
        .iter()
        .map(|p| format!("exec|-i|-n|train|{p}|--|sh|-c|exec '{}' agent --stdin|", rsrun_path.display()))
        .collect();
    assert_eq!(calls, expected);
}

/// `--check`: every host's agent checks its plan and reports; nothing runs; exit 0.
#[test]
fn check_reports_every_host_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // RSRUN_CHECK=1 is --check; like every RSRUN_* variable it is also forwarded to the hosts, where
    // it must not turn the agents into checkers of their own.
    let out = rsrun_tests::run(head(dir.path(), "h1:2,h2:2,h3:1").env("RSRUN_CHECK", "1").args(["sh", "-c", SLEEPER]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for (h, workers) in [("h1", "2 workers"), ("h2", "2 workers"), ("h3", "1 worker,")] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{h}: ready (ssh): hostname {}, rsrun ", hostname.trim())))
            .unwrap_or_else(|| panic!("no line for {h}:\n{stdout}"));
        assert!(line.contains(workers) && line.contains(" GPU") && line.ends_with("/sh"), "{line}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("rsrun: --check: all 3 hosts are ready; no worker was started"), "{}", text(&out));
    assert!(read_pids(&dir.path().join("pids")).is_empty(), "no worker started");
    assert_eq!(all_gone(&agent_pids(dir.path()), Duration::from_secs(3)), Ok(()), "the agents stopped");
}

/// `--check` with one host failing: exit 2, one line for it, the others reported ready.
#[test]
fn check_names_the_host_that_is_not_ready() {
    let dir = tempfile::tempdir().unwrap();
    let out = rsrun_tests::run(head(dir.path(), "h1:1,h2:1,h3:1").env("FAKE_RSH_FAIL", "h2").args(["--check", "true"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rsrun: error: h2: ssh authentication failed (Permission denied (publickey))\n"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("h2: ready"), "{stdout}");
    assert_eq!(all_gone(&agent_pids(dir.path()), Duration::from_secs(3)), Ok(()));
}

/// A wrapper that prints on stdout, where the agent's messages go, fails that host at once with
/// what it printed, instead of waiting out the start timeout.
#[test]
fn check_quotes_what_a_wrapper_printed_on_stdout() {
    // A long line, and short ones: "ok" and "X" are read as frame lengths of 111 and 88 bytes,
    // which the agent's own first message may not fill.
    for banner in ["Welcome to h2, have a nice day", "ok", "X"] {
        let dir = tempfile::tempdir().unwrap();
        let start = Instant::now();
        let out = rsrun_tests::run(head(dir.path(), "h1:1,h2:1").env("FAKE_RSH_BANNER", format!("h2:{banner}")).args(["--check", "true"]));
        assert_eq!(code(&out.status), 2, "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!("h2: the agent's stdout is not rsrun's agent protocol; it began with \"{banner}\\n\": ")),
            "{stderr}"
        );
        assert!(!String::from_utf8_lossy(&out.stdout).contains("h2: ready"), "{}", text(&out));
        assert!(start.elapsed() < Duration::from_secs(20), "{banner}: it took {:?}", start.elapsed());
        assert_eq!(all_gone(&agent_pids(dir.path()), Duration::from_secs(3)), Ok(()));
    }
}

/// Without `--allow-same-host`, two names of one machine are refused by the identity their agents
/// report (same boot id and network namespace), before any worker starts.
#[test]
fn two_names_of_one_machine_are_refused_by_identity() {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let out = rsrun_tests::run(fake_rsh_head(dir.path()).args(["-H", "h1:1,h2:1,h3:1", "sh", "-c", SLEEPER]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rsrun: error: hosts \"h1\" and \"h2\" are the same machine (same boot id and network namespace); list it once, or pass --allow-same-host to run several nodes on one machine\n"),
        "{stderr}"
    );
    assert!(read_pids(&dir.path().join("pids")).is_empty(), "no worker started");
    assert_eq!(all_gone(&agent_pids(dir.path()), Duration::from_secs(3)), Ok(()), "the agents stopped");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
}

/// `--ssh-fanout 1`: one host connects at a time (the next one starts once the previous agent is
/// ready); the default window starts all three at once.
#[test]
fn ssh_fanout_is_a_sliding_window() {
    for (fanout, serial) in [(Some("1"), true), (None, false)] {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = head(dir.path(), "h1:1,h2:1,h3:1");
        cmd.env("FAKE_RSH_DELAY", "0.5").env("FAKE_RSH_STAMPS", dir.path().join("stamps"));
        if let Some(f) = fanout {
            cmd.args(["--ssh-fanout", f]);
        }
        let out = rsrun_tests::run(cmd.arg("true"));
        assert_eq!(code(&out.status), 0, "{}", text(&out));
        let stamps = rsh_stamps(dir.path());
        assert_eq!(stamps.len(), 3, "{stamps:?}");
        if serial {
            for w in stamps.windows(2) {
                assert!(w[1].1 >= w[0].2, "--ssh-fanout 1: {} started before {} had connected: {stamps:?}", w[1].0, w[0].0);
            }
        } else {
            assert!(stamps[2].1 < stamps[0].2, "the default window starts every host at once: {stamps:?}");
        }
    }
}

/// `rsrun --hostfile hosts --allow-same-host sh -c SCRIPT` through the fake rsh in `dir`, with
/// `hosts` holding `hostfile`.
fn run_hostfile(dir: &Path, hostfile: &str, script: &str) -> std::process::Output {
    std::fs::write(dir.join("hosts"), hostfile).unwrap();
    rsrun_tests::run(fake_rsh_head(dir).args(["--hostfile", "hosts", "--allow-same-host", "sh", "-c", script]))
}

/// Hostfile `user=`, `port=` and `addr=`: each host's own ssh user, port and address, on its argv.
#[test]
fn hostfile_user_port_and_addr_are_on_the_ssh_argv() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_hostfile(dir.path(), "h1 slots=1\nh2 slots=1 user=alice port=2200 addr=192.0.2.7\n", "echo $FAKE_RSH_HOST > host.$RANK");
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let calls: Vec<Vec<String>> = rsh_calls(dir.path()).into_iter().map(|(_, a)| a).collect();
    let h2 = calls.iter().find(|a| a.contains(&"192.0.2.7".to_owned())).unwrap_or_else(|| panic!("{calls:?}"));
    let tail: Vec<&str> = h2[h2.len() - 7..h2.len() - 1].iter().map(String::as_str).collect();
    assert_eq!(tail, ["-p", "2200", "-l", "alice", "--", "192.0.2.7"]);
    assert_eq!(std::fs::read_to_string(dir.path().join("host.1")).unwrap().trim(), "192.0.2.7", "rank 1 ran on h2's address");
}

/// A bare hostfile host (no `slots=`, no --nproc-per-node): its agent starts one worker per GPU
/// there, else one (this machine has none); the world is known once the agents joined.
#[test]
fn a_bare_hostfile_host_runs_one_worker_per_gpu_else_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = run_hostfile(dir.path(), "h1 slots=2\nh2\n", "echo $WORLD_SIZE $FAKE_RSH_HOST > ws.$RANK");
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("h2: no slot count"), "{}", text(&out));
    for rank in 0..3 {
        let got = std::fs::read_to_string(dir.path().join(format!("ws.{rank}"))).unwrap_or_else(|e| panic!("rank {rank}: {e}\n{}", text(&out)));
        let want_host = if rank < 2 { "h1" } else { "h2" };
        assert_eq!(got.trim(), format!("3 {want_host}"), "rank {rank}");
    }
    assert!(!dir.path().join("ws.3").exists(), "{}", text(&out));
}

#[test]
fn the_agent_refuses_another_version_and_garbage_on_stdin() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(bin("rsrun"))
        .args(["agent", "--stdin"])
        .current_dir(dir.path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"\x03\xff\xff\xff").unwrap();
    let out = KillOnDrop(child).output_within(Duration::from_secs(20));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("does not start with a NodeLaunch message"), "{stderr}");
}

/// A program that exists on the hosts only (in `--chdir DIR`, not in the head's directory): the head,
/// a login node, does not look for it; each agent checks it on its own host, and it runs.
#[test]
fn a_program_only_on_the_hosts_runs_from_a_login_node() {
    let login = tempfile::tempdir().unwrap();
    let shared = tempfile::tempdir().unwrap();
    let there = std::fs::canonicalize(shared.path()).unwrap();
    let script = there.join("run.sh");
    std::fs::write(&script, "#!/bin/sh\necho \"ran $RANK\" > out.$RANK\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = rsrun_tests::run(head(login.path(), "h1:1,h2:1").arg("--chdir").arg(&there).args(["--no-python", "./run.sh"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for r in 0..2 {
        assert_eq!(std::fs::read_to_string(there.join(format!("out.{r}"))).unwrap(), format!("ran {r}\n"));
    }
    // --dry-run with a directory this machine does not have: the plan, saying that the hosts check
    // the program.
    let out = rsrun_tests::run(head(login.path(), "h1:1,h2:1").args(["--chdir", "/nonexistent/rsrun-job", "--dry-run", "--no-python", "./run.sh"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("rsrun: no node plan on this machine (program './run.sh' not found: not an executable file or a name on PATH); each host's agent checks it there\n"),
        "{stdout}"
    );
    assert!(stdout.contains("cwd          : /nonexistent/rsrun-job\n") && stdout.contains("commands     :"), "{stdout}");
    // A program that no host has: every agent says so, exit 2.
    let out = rsrun_tests::run(head(login.path(), "h1:1").arg("--chdir").arg(&there).args(["--no-python", "./nope.sh"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rsrun: error: h1: program './nope.sh' not found"), "{}", text(&out));
}

/// `--rdzv-tls-ca` with `-H`: every agent (and its workers) and the head's own client verify the
/// daemon's TLS certificate with that CA; the CA travels in the launch plan.
#[test]
fn rdzv_tls_ca_reaches_every_agent_and_the_head() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = rsrun_tests::tls_files(certs.path());
    let daemon = rsrun_tests::Daemon::start_with(
        "127.0.0.1:0",
        &["--tls-cert".as_ref(), cert.as_os_str(), "--tls-key".as_ref(), key.as_os_str()],
    );
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 fails once rank 0 wrote its file (else rank 0 may be stopped before it ran at all).
    let script = "head -n 1 \"$RSRUN_TLS_CA\" > ca.$RANK; if [ \"$RANK\" = 1 ]; then i=0; \
                  while [ ! -s ca.0 ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; exit 3; fi";
    let mut cmd = rsrun(dir.path());
    cmd.args(["-H", "h1:1,h2:1", "--allow-same-host", "--rsh"])
        .arg(fake_rsh())
        .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &daemon.addr, "--rdzv-id", "tls-remote", "--shutdown-timeout", "1"])
        .arg("--rdzv-tls-ca")
        .arg(&ca)
        .env_remove("FAKE_RSH_FAIL")
        .env_remove("FAKE_RSH_HIDE")
        .env_remove("FAKE_RSH_DELAY")
        .env_remove("FAKE_RSH_BANNER")
        .args(["sh", "-c", script]);
    let out = rsrun_tests::run(&mut cmd);
    assert_eq!(code(&out.status), 3, "{}", text(&out));
    for r in 0..2 {
        let first = std::fs::read_to_string(dir.path().join(format!("ca.{r}"))).unwrap_or_else(|_| panic!("rank {r}: no CA\n{}", text(&out)));
        assert_eq!(first, "-----BEGIN CERTIFICATE-----\n", "rank {r}");
    }
    // The head's own client read the root cause from the daemon.
    assert!(String::from_utf8_lossy(&out.stderr).contains("root cause rank 1 (local_rank 0) on h2: exit code 3"), "{}", text(&out));
}

/// An environment value that is not UTF-8 (`--env-file` is byte-exact) reaches every worker as it
/// is: neither the agents nor the head crash on it.
#[test]
fn a_non_utf8_env_value_reaches_every_host_byte_exact() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("latin1.env"), b"LABEL=caf\xe9\n").unwrap();
    let out = rsrun_tests::run(head(dir.path(), "h1:1,h2:1").args(["--env-file", "latin1.env", "sh", "-c", "printf %s \"$LABEL\" > label.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for r in 0..2 {
        assert_eq!(std::fs::read(dir.path().join(format!("label.{r}"))).unwrap(), b"caf\xe9", "rank {r}");
    }
    // The head's own environment.
    let out = rsrun_tests::run(
        head(dir.path(), "h1:1").env("LATIN1_HEAD", std::ffi::OsStr::from_bytes(b"caf\xe9")).args(["sh", "-c", "printf %s \"$LATIN1_HEAD\" > head.$RANK"]),
    );
    assert_eq!(code(&out.status), 0, "{}", text(&out));
}

/// ssh's stderr is read as bytes: a line that is not UTF-8 (a login banner in Latin-1) does not hide
/// the diagnostic after it.
#[test]
fn ssh_stderr_that_is_not_utf8_still_names_the_failure() {
    let dir = tempfile::tempdir().unwrap();
    let rsh = dir.path().join("latin1-rsh");
    std::fs::write(&rsh, "#!/bin/sh\nprintf 'Bienvenue \\351t\\351\\n' >&2\nprintf 'h1: Permission denied (publickey).\\n' >&2\nexit 255\n").unwrap();
    std::fs::set_permissions(&rsh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = rsrun_tests::run(rsrun(dir.path()).args(["-H", "h1:1", "--rsh"]).arg(&rsh).args(["--rdzv-endpoint", "127.0.0.1:0", "true"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rsrun: error: h1: ssh authentication failed (Permission denied (publickey))\n"), "{stderr}");
}

/// The same job over a real OpenSSH server on loopback (multinode.md §5.3): one sshd on a free port
/// listening on 127.0.0.1, .2 and .3 ("hosts" h1, h2, h3 in a private ssh config), its own host key,
/// user key, authorized_keys and known_hosts in a temporary directory. Skipped, with the reason, when
/// `/usr/sbin/sshd` is not installed (`apt-get install openssh-server openssh-client`) or cannot run.
mod sshd {
    use std::net::TcpStream;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use rsrun_tests::{KillOnDrop, alive, code, read_pids, rsrun, text, wait_until};

    use super::{SLEEPER, all_gone, kill};

    const SSHD: &str = "/usr/sbin/sshd";

    pub(super) struct Sshd {
        _child: KillOnDrop,
        pub(super) dir: tempfile::TempDir,
    }

    impl Sshd {
        pub(super) fn config(&self) -> PathBuf {
            self.dir.path().join("ssh_config")
        }

        /// Starts sshd on 127.0.0.1-3, or `None` (with a printed reason) when it cannot run here.
        pub(super) fn start() -> Option<Sshd> {
            Self::start_with(3, Some("200:30:400"))
        }

        /// Starts sshd reachable at 127.0.0.1 to 127.0.0.`n`, with `MaxStartups` set (or sshd's
        /// default, `10:30:100`, when `None`). The ssh config names the first three `h1`-`h3` and
        /// knows every `127.0.0.*` address.
        ///
        /// sshd listens on at most 16 addresses (`MAX_LISTEN_SOCKS`): beyond that it listens on the
        /// wildcard address, as multinode.md §7 prescribes (`0.0.0.0`), and accepts logins from
        /// loopback clients only (`AllowUsers USER@127.0.0.0/8`); the port is random, the only
        /// authorized key is this test's, and only 127.0.0.x addresses are ever connected to.
        pub(super) fn start_with(n: u32, max_startups: Option<&str>) -> Option<Sshd> {
            if !Path::new(SSHD).is_file() || Command::new("ssh").arg("-V").stderr(Stdio::null()).status().is_err() {
                // CI installs them (.ci/run) and sets RSRUN_TEST_REQUIRE_TOOLS: a missing one
                // fails there instead of passing these tests vacuously.
                assert!(
                    std::env::var_os("RSRUN_TEST_REQUIRE_TOOLS").is_none(),
                    "{SSHD} or ssh is not installed, and RSRUN_TEST_REQUIRE_TOOLS is set"
                );
                eprintln!("skipped: {SSHD} or ssh is not installed (apt-get install openssh-server openssh-client)");
                return None;
            }
            if std::fs::create_dir_all("/run/sshd").is_err() {
                eprintln!("skipped: cannot create /run/sshd (sshd's privilege-separation directory)");
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            let keygen = |name: &str| {
                Command::new("ssh-keygen")
                    .args(["-q", "-t", "ed25519", "-N", "", "-C", name, "-f"])
                    .arg(d.join(name))
                    .status()
                    .is_ok_and(|s| s.success())
            };
            if !keygen("host_ed25519") || !keygen("id_ed25519") {
                eprintln!("skipped: ssh-keygen failed");
                return None;
            }
            std::fs::copy(d.join("id_ed25519.pub"), d.join("authorized_keys")).unwrap();
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let host_pub = std::fs::read_to_string(d.join("host_ed25519.pub")).unwrap();
            let key: Vec<&str> = host_pub.split_whitespace().take(2).collect();
            let known: String = (1..=n).map(|i| format!("[127.0.0.{i}]:{port} {}\n", key.join(" "))).collect();
            std::fs::write(d.join("known_hosts"), known).unwrap();
            let dp = d.display();
            let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
            let listen: String = if n <= 16 {
                (1..=n).map(|i| format!("ListenAddress 127.0.0.{i}\n")).collect()
            } else {
                format!("ListenAddress 0.0.0.0\nAllowUsers {user}@127.0.0.0/8\n")
            };
            let max_startups = max_startups.map(|m| format!("MaxStartups {m}\n")).unwrap_or_default();
            std::fs::write(
                d.join("sshd_config"),
                format!(
                    "Port {port}\n{listen}\
                     HostKey {dp}/host_ed25519\nPidFile {dp}/sshd.pid\nAuthorizedKeysFile {dp}/authorized_keys\n\
                     PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
                     PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n{max_startups}\
                     MaxSessions 200\nLogLevel VERBOSE\n"
                ),
            )
            .unwrap();
            std::fs::write(
                d.join("ssh_config"),
                format!(
                    "Host h1 h2 h3 127.0.0.*\n  User {user}\n  Port {port}\n  IdentityFile {dp}/id_ed25519\n  IdentitiesOnly yes\n\
                     \x20 UserKnownHostsFile {dp}/known_hosts\n  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n\
                     Host h1\n  HostName 127.0.0.1\nHost h2\n  HostName 127.0.0.2\nHost h3\n  HostName 127.0.0.3\n"
                ),
            )
            .unwrap();
            let log = std::fs::File::create(d.join("sshd.log")).unwrap();
            let child = KillOnDrop(
                Command::new(SSHD)
                    .args(["-D", "-e", "-f"])
                    .arg(d.join("sshd_config"))
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("spawn sshd"),
            );
            // One bare connection per listening socket (the wildcard one serves every address): bare
            // connections count against MaxStartups too.
            let sockets = if n <= 16 { n } else { 1 };
            let up = wait_until(Duration::from_secs(10), || (1..=sockets).all(|i| TcpStream::connect(format!("127.0.0.{i}:{port}")).is_ok()));
            if !up {
                eprintln!("skipped: sshd did not listen: {}", std::fs::read_to_string(d.join("sshd.log")).unwrap_or_default());
                return None;
            }
            let login = || Command::new("ssh").arg("-F").arg(d.join("ssh_config")).args(["h2", "true"]).output().unwrap();
            let mut probe = login();
            for _ in 0..5 {
                // sshd may still be throttling after the readiness connections (default MaxStartups).
                if probe.status.success() || !String::from_utf8_lossy(&probe.stderr).contains("kex_exchange_identification") {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
                probe = login();
            }
            if !probe.status.success() {
                eprintln!("skipped: cannot log in through the test sshd: {}", String::from_utf8_lossy(&probe.stderr));
                return None;
            }
            Some(Sshd { _child: child, dir })
        }
    }

    /// `rsrun -H h1:2,h2:2,h3:2 --ssh-config CFG ...` in `dir`.
    fn head(sshd: &Sshd, dir: &Path) -> Command {
        let mut cmd = rsrun(dir);
        cmd.args(["-H", "h1:2,h2:2,h3:2", "--ssh-config"])
            .arg(sshd.config())
            .args(["--allow-same-host", "--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "1"]);
        cmd
    }

    /// Workers record their pid in `pids` and their agent's in `agents`, then sleep.
    const RECORD: &str = "echo $PPID >> agents; ";

    #[test]
    fn sshd_three_hosts_two_slots_complete_with_contiguous_ranks() {
        let Some(sshd) = Sshd::start() else { return };
        let dir = tempfile::tempdir().unwrap();
        let script = "set -- $SSH_CONNECTION; echo \"$3 $RANK $LOCAL_RANK $GROUP_RANK $MASTER_ADDR\" > rank.$RANK";
        let out = rsrun_tests::run(head(&sshd, dir.path()).args(["sh", "-c", script]));
        assert_eq!(code(&out.status), 0, "{}", text(&out));
        for rank in 0..6u32 {
            let line = std::fs::read_to_string(dir.path().join(format!("rank.{rank}"))).unwrap();
            assert_eq!(line, format!("127.0.0.{} {rank} {} {} 127.0.0.1\n", rank / 2 + 1, rank % 2, rank / 2), "rank {rank}");
        }
    }

    #[test]
    fn sshd_worker_exit_3_on_h2_is_the_exit_code() {
        let Some(sshd) = Sshd::start() else { return };
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "{RECORD}echo $$ >> pids; if [ \"$RANK\" = 2 ]; then while [ $(wc -l < pids) -lt 6 ]; do sleep 0.05; done; exit 3; fi; exec sleep 60"
        );
        let out = rsrun_tests::run(head(&sshd, dir.path()).args(["sh", "-c", &script]));
        assert_eq!(code(&out.status), 3, "{}", text(&out));
        assert!(String::from_utf8_lossy(&out.stderr).contains("root cause rank 2 (local_rank 0) on h2: exit code 3"), "{}", text(&out));
        let mut pids = read_pids(&dir.path().join("pids"));
        pids.extend(read_pids(&dir.path().join("agents")));
        assert_eq!(all_gone(&pids, Duration::from_secs(3)), Ok(()), "processes left on the hosts");
    }

    #[test]
    fn sshd_sigint_leaves_nothing_and_exits_130() {
        let Some(sshd) = Sshd::start() else { return };
        let dir = tempfile::tempdir().unwrap();
        let child = KillOnDrop::spawn(head(&sshd, dir.path()).args(["sh", "-c", &format!("{RECORD}{SLEEPER}")]));
        let pids_file = dir.path().join("pids");
        assert!(wait_until(Duration::from_secs(30), || read_pids(&pids_file).len() == 6), "workers did not start");
        kill(child.pid(), libc::SIGINT);
        let out = child.output_within(Duration::from_secs(30));
        assert_eq!(code(&out.status), 130, "{}", text(&out));
        let mut pids = read_pids(&pids_file);
        pids.extend(read_pids(&dir.path().join("agents")));
        assert_eq!(all_gone(&pids, Duration::from_secs(3)), Ok(()), "processes left after SIGINT");
    }

    /// Runs of the `kill -9` test (multinode.md §7, acceptance 4: 20 of 20).
    const KILL_9_RUNS: usize = 20;

    /// `kill -9` of the head, 20 times: every time, the 6 workers on the 3 "hosts" are gone within
    /// 2 s (the ssh clients die with their stdin, sshd closes the session's stdin, each agent sees EOF
    /// and stops its workers), and the agents follow. Prints the distribution of both times.
    #[test]
    fn sshd_kill_9_of_the_head_leaves_no_worker() {
        let Some(sshd) = Sshd::start() else { return };
        let (mut workers_gone, mut agents_gone) = (Vec::new(), Vec::new());
        for attempt in 0..KILL_9_RUNS {
            let dir = tempfile::tempdir().unwrap();
            let mut child = KillOnDrop::spawn(head(&sshd, dir.path()).args(["sh", "-c", &format!("{RECORD}{SLEEPER}")]));
            let pids_file = dir.path().join("pids");
            assert!(wait_until(Duration::from_secs(30), || read_pids(&pids_file).len() == 6), "attempt {attempt}: workers did not start");
            let workers = read_pids(&pids_file);
            let agents = read_pids(&dir.path().join("agents"));
            assert!(workers.iter().chain(&agents).all(|&p| alive(p)));
            let killed = Instant::now();
            kill(child.pid(), libc::SIGKILL);
            let _ = child.0.wait();
            assert_eq!(all_gone_polled(&workers, Duration::from_secs(2)), Ok(()), "attempt {attempt}: workers left 2 s after kill -9");
            workers_gone.push(killed.elapsed());
            assert_eq!(all_gone_polled(&agents, Duration::from_secs(10)), Ok(()), "attempt {attempt}: agents left");
            agents_gone.push(killed.elapsed());
        }
        eprintln!("kill -9 of the head, {KILL_9_RUNS} runs: workers gone after {}", distribution(&mut workers_gone));
        eprintln!("kill -9 of the head, {KILL_9_RUNS} runs: agents gone after {}", distribution(&mut agents_gone));
    }

    /// Like [`super::all_gone`], polling every 5 ms (the times are reported).
    fn all_gone_polled(pids: &[i32], deadline: Duration) -> Result<(), Vec<i32>> {
        let start = Instant::now();
        while start.elapsed() < deadline {
            if pids.iter().all(|&p| !alive(p)) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        all_gone(pids, Duration::ZERO)
    }

    /// `min / median / p90 / max` in milliseconds.
    fn distribution(times: &mut [Duration]) -> String {
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
        format!(
            "min {:.0} ms, median {:.0} ms, p90 {:.0} ms, max {:.0} ms",
            ms(times[0]),
            ms(at(0.5)),
            ms(at(0.9)),
            ms(times[times.len() - 1])
        )
    }

    /// DS#6807 regression over real ssh: two jobs on the same three hosts; Ctrl-C stops one, and the
    /// other, untouched, runs to completion.
    #[test]
    fn sshd_ctrl_c_of_one_job_leaves_the_other_running_to_completion() {
        let Some(sshd) = Sshd::start() else { return };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let job_a = KillOnDrop::spawn(head(&sshd, a.path()).args(["sh", "-c", &format!("{RECORD}{SLEEPER}")]));
        let waiter = "echo $$ >> pids; i=0; while [ ! -f go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; [ -f go ]";
        let job_b = KillOnDrop::spawn(head(&sshd, b.path()).args(["sh", "-c", waiter]));
        let (pa, pb) = (a.path().join("pids"), b.path().join("pids"));
        assert!(wait_until(Duration::from_secs(30), || read_pids(&pa).len() == 6 && read_pids(&pb).len() == 6), "the jobs did not start");
        kill(job_a.pid(), libc::SIGINT);
        let out = job_a.output_within(Duration::from_secs(30));
        assert_eq!(code(&out.status), 130, "{}", text(&out));
        let mut a_procs = read_pids(&pa);
        a_procs.extend(read_pids(&a.path().join("agents")));
        assert_eq!(all_gone(&a_procs, Duration::from_secs(3)), Ok(()), "job A left processes");
        let b_workers = read_pids(&pb);
        assert!(b_workers.iter().all(|&p| alive(p)), "job B lost workers when job A stopped");
        std::fs::write(b.path().join("go"), "").unwrap();
        let out = job_b.output_within(Duration::from_secs(30));
        assert_eq!(code(&out.status), 0, "job B runs to completion:\n{}", text(&out));
    }

    /// multinode.md §7, acceptance 4: 30 hosts `127.0.0.1`-`127.0.0.30` against an sshd with the
    /// default `MaxStartups 10:30:100`, which drops connections past 10 unauthenticated ones in the
    /// key exchange (7 of 30 in the brief's measurement): every host starts, because rsrun retries a
    /// dropped key exchange. The sshd listens on those 30 loopback addresses (not on 0.0.0.0: only
    /// loopback is ever a target). `--ssh-local` sends even these local addresses through ssh. Prints
    /// how many connections sshd dropped and rsrun retried, and the time to the end of the job.
    #[test]
    fn sshd_thirty_hosts_start_past_default_max_startups() {
        let Some(sshd) = Sshd::start_with(30, None) else { return };
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = rsrun(dir.path());
        cmd.args(["-H", "127.0.0.[1-30]:1", "--ssh-local", "--allow-same-host", "--ssh-config"])
            .arg(sshd.config())
            .args(["--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "1"])
            .env("RSRUN_LOG", "warn,rsrun_launcher::remote::driver=info")
            .args(["sh", "-c", "set -- $SSH_CONNECTION; echo \"$3\" > rank.$RANK"]);
        // Only the job's connections count (the readiness check above opened 30 bare ones).
        let log_before = std::fs::read_to_string(sshd.dir.path().join("sshd.log")).unwrap_or_default().len();
        let start = Instant::now();
        let out = KillOnDrop::spawn(&mut cmd).output_within(Duration::from_secs(180));
        let took = start.elapsed();
        assert_eq!(code(&out.status), 0, "{}", text(&out));
        for rank in 0..30u32 {
            let addr = std::fs::read_to_string(dir.path().join(format!("rank.{rank}"))).unwrap_or_else(|_| panic!("rank {rank} never ran"));
            assert_eq!(addr.trim(), format!("127.0.0.{}", rank + 1), "rank {rank} ran through the sshd on its own address");
        }
        let sshd_log = std::fs::read_to_string(sshd.dir.path().join("sshd.log")).unwrap_or_default();
        let sshd_log = sshd_log.get(log_before..).unwrap_or("");
        let dropped = sshd_log.lines().filter(|l| l.contains("past MaxStartups")).count();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let retries: Vec<&str> = stderr.lines().filter(|l| l.contains("key exchange; retrying")).collect();
        let retried = retries.len();
        let most = retries
            .iter()
            .filter_map(|l| l.split("attempt=").nth(1)?.split_whitespace().next()?.parse::<u32>().ok())
            .max()
            .unwrap_or(0);
        eprintln!(
            "30 hosts, default MaxStartups: sshd dropped {dropped} connections, rsrun retried {retried} starts (at most {most} retries for one host); job done in {took:.2?}"
        );
        let drops: Vec<&str> = sshd_log.lines().filter(|l| l.contains("MaxStartups")).collect();
        assert_eq!(retried, dropped, "every connection sshd dropped was retried\n{drops:#?}\n{}", text(&out));
    }

    #[test]
    fn sshd_unknown_host_key_exits_2_naming_known_hosts() {
        let Some(sshd) = Sshd::start() else { return };
        let dir = tempfile::tempdir().unwrap();
        let empty = sshd.dir.path().join("empty_known_hosts");
        std::fs::write(&empty, "").unwrap();
        let start = Instant::now();
        let out = rsrun_tests::run(
            head(&sshd, dir.path())
                .args(["--ssh-option", &format!("UserKnownHostsFile={}", empty.display()), "--ssh-connect-timeout", "5", "true"]),
        );
        assert_eq!(code(&out.status), 2, "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        for h in ["h1", "h2", "h3"] {
            assert!(stderr.contains(&format!("rsrun: error: {h}: unknown ssh host key")), "{stderr}");
            // The test's ssh config maps the names: the message says how to see to what.
            assert!(stderr.contains(&format!("`ssh-keyscan -H {h} >> ~/.ssh/known_hosts` (if an ssh config maps {h}")), "{stderr}");
            assert!(stderr.contains(&format!("`ssh -G {h}` prints them")), "{stderr}");
        }
        assert!(stderr.contains("known_hosts"), "{stderr}");
        assert!(start.elapsed() < Duration::from_secs(6), "took {:?} (ConnectTimeout 5 s + 1 s)", start.elapsed());
    }
}
