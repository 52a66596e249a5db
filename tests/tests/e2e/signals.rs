//! Signals: SIGTERM is forwarded and rsrun exits 128+15; `kill -9` of rsrun leaves no process alive;
//! `--signal-policy SIGUSR1=forward` keeps supervising.

use std::time::Duration;

use rsrun_tests::{KillOnDrop, alive, code, read_pids, rsrun, text, wait_until};

#[test]
fn sigterm_is_forwarded_then_rsrun_exits_143() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo got-term > term.$RANK; exit 0' TERM; echo $$ >> pids; while true; do sleep 0.05; done";
    let child = KillOnDrop::spawn(rsrun(dir.path()).args(["--nproc-per-node", "2", "sh", "-c", script]));
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(20), || read_pids(&pids_file).len() == 2), "workers did not start");
    nix_kill(child.pid(), libc::SIGTERM);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    for rank in 0..2 {
        let f = dir.path().join(format!("term.{rank}"));
        assert_eq!(std::fs::read_to_string(&f).unwrap_or_default(), "got-term\n", "rank {rank} got no SIGTERM");
    }
    for pid in read_pids(&pids_file) {
        assert!(!alive(pid), "worker {pid} survived");
    }
}

/// A process a worker started outside its process group (`setsid`, Python's
/// `start_new_session=True`, a daemon) is not left running when the job ends, whether it succeeds
/// or fails: rsrun, its subreaper, adopted it when its parent exited.
#[test]
fn what_workers_start_in_a_session_of_their_own_does_not_outlive_the_job() {
    for (exit, want) in [("0", 0), ("3", 3)] {
        let dir = tempfile::tempdir().unwrap();
        let script = format!("setsid sleep 37 & echo $! >> pids; exit {exit}");
        let out = rsrun_tests::run(rsrun(dir.path()).args(["--nproc-per-node", "2", "--shutdown-timeout", "1", "sh", "-c", &script]));
        assert_eq!(code(&out.status), want, "{}", text(&out));
        let escaped = read_pids(&dir.path().join("pids"));
        // (A failing rank may get the other stopped before it started its own.)
        assert!(!escaped.is_empty() && escaped.len() <= 2, "{escaped:?}: {}", text(&out));
        let gone = wait_until(Duration::from_secs(3), || escaped.iter().all(|&p| !alive(p)));
        for &p in &escaped {
            if alive(p) {
                nix_kill(p, libc::SIGKILL);
            }
        }
        assert!(gone, "exit {exit}: processes in sessions of their own outlived the job: {escaped:?}\n{}", text(&out));
    }
}

/// `nohup rsrun ...`: a SIGHUP that rsrun started with ignored stays ignored (a logout's SIGHUP
/// tore the run down); SIGTERM still stops it. Named in --signal-policy, it is handled again.
#[test]
fn a_signal_ignored_at_start_stays_ignored_unless_named() {
    use std::os::unix::process::CommandExt;
    for (policy, hup_stops) in [(None, false), (Some("SIGHUP=stop"), true)] {
        let dir = tempfile::tempdir().unwrap();
        let script = "echo $$ >> pids; i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done";
        let mut cmd = rsrun(dir.path());
        if let Some(p) = policy {
            cmd.args(["--signal-policy", p]);
        }
        cmd.args(["--nproc-per-node", "1", "sh", "-c", script]);
        // SAFETY: signal(2) between fork and exec, as nohup does.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
                Ok(())
            });
        }
        let child = KillOnDrop::spawn(&mut cmd);
        assert!(wait_until(Duration::from_secs(20), || read_pids(&dir.path().join("pids")).len() == 1), "the worker did not start");
        nix_kill(child.pid(), libc::SIGHUP);
        std::thread::sleep(Duration::from_millis(500));
        if !hup_stops {
            assert!(alive(child.pid()), "SIGHUP stopped a run that started with it ignored");
            nix_kill(child.pid(), libc::SIGTERM);
        }
        let out = child.output_within(Duration::from_secs(30));
        assert_eq!(code(&out.status), if hup_stops { 129 } else { 143 }, "{policy:?}: {}", text(&out));
    }
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap '' TERM; echo $$ >> pids; while true; do sleep 0.05; done";
    let child = KillOnDrop::spawn(rsrun(dir.path()).args(["--shutdown-timeout", "0.5", "sh", "-c", script]));
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(20), || read_pids(&pids_file).len() == 1));
    nix_kill(child.pid(), libc::SIGTERM);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    assert!(!alive(read_pids(&pids_file)[0]));
}

#[test]
fn kill_9_of_rsrun_leaves_no_survivors() {
    let dir = tempfile::tempdir().unwrap();
    // Each worker also starts a grandchild in its process group.
    let script = "sleep 300 & echo $! >> pids; echo $$ >> pids; wait";
    let mut child = KillOnDrop::spawn(rsrun(dir.path()).args(["--nproc-per-node", "3", "sh", "-c", script]));
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(20), || read_pids(&pids_file).len() == 6), "workers did not start");
    let survivors = survivors_of_kill_9(&mut child, &read_pids(&pids_file), Duration::from_secs(1));
    assert!(survivors.is_empty(), "processes alive 1 s after kill -9 of rsrun: {survivors:?}");
}

/// `kill -9` of rsrun, then which of `pids` (all alive before) are still alive after `within`;
/// those are killed before returning.
fn survivors_of_kill_9(child: &mut KillOnDrop, pids: &[i32], within: Duration) -> Vec<i32> {
    assert!(pids.iter().all(|&p| alive(p)), "{pids:?} were not all alive before the kill");
    nix_kill(child.pid(), libc::SIGKILL);
    let _ = child.0.wait();
    wait_until(within, || pids.iter().all(|&p| !alive(p)));
    let survivors: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &survivors {
        nix_kill(p, libc::SIGKILL);
    }
    survivors
}

/// A process that left its worker's group (`setsid`) and whose worker is still running is in no
/// group the guardian knows, and rsrun is not there to adopt it after a `kill -9`: the guardian
/// finds it by the launch mark it inherited, even two forks and a `setsid` down.
#[test]
fn kill_9_of_rsrun_also_ends_what_left_the_workers_groups() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 starts `sleep` in a session of its own; rank 1 a daemon-like double fork into one.
    let script = "if [ $RANK = 0 ]; then setsid sleep 300 & echo $! >> escaped; else sh -c 'setsid sh -c \"sleep 300 & echo \\$! >> escaped; wait\" &'; fi; echo $$ >> pids; while true; do sleep 0.05; done";
    let mut child = KillOnDrop::spawn(rsrun(dir.path()).args(["--nproc-per-node", "2", "sh", "-c", script]));
    let (pids_file, escaped_file) = (dir.path().join("pids"), dir.path().join("escaped"));
    assert!(
        wait_until(Duration::from_secs(20), || read_pids(&pids_file).len() == 2 && read_pids(&escaped_file).len() == 2),
        "workers did not start: {:?} {:?}",
        read_pids(&pids_file),
        read_pids(&escaped_file)
    );
    let survivors = survivors_of_kill_9(&mut child, &read_pids(&escaped_file), Duration::from_secs(3));
    assert!(survivors.is_empty(), "processes in sessions of their own alive 3 s after kill -9 of rsrun: {survivors:?}");
}

#[test]
fn sigusr1_forward_policy_keeps_supervising() {
    let dir = tempfile::tempdir().unwrap();
    let script = "trap 'echo usr1 >> usr1.$RANK' USR1; echo $$ >> pids; i=0; while [ ! -f usr1.$RANK ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; sleep 0.2; exit 0";
    let child = KillOnDrop::spawn(rsrun(dir.path()).args(["--signal-policy", "SIGUSR1=forward", "--nproc-per-node", "2", "sh", "-c", script]));
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(20), || read_pids(&pids_file).len() == 2));
    nix_kill(child.pid(), libc::SIGUSR1);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..2 {
        assert!(dir.path().join(format!("usr1.{rank}")).exists(), "rank {rank} got no SIGUSR1");
    }
}

fn nix_kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid, sig);
    }
}

/// A stop signal while rsrun tears the group down after a worker failure is shutdown (torchrun.md
/// §4.5): rsrun exits 128 + 15 once the workers are stopped, and starts no second round, whatever
/// restart budget is left.
#[test]
fn sigterm_during_failure_teardown_exits_143_without_restarting() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 ignores SIGTERM, so the teardown after rank 0's failure waits out the grace; rank 0 fails
    // once rank 1 is ready, and leaves its pid for the test to see it gone.
    let script = "echo $TORCHELASTIC_RESTART_COUNT >> attempts; \
                  if [ $RANK = 0 ]; then echo $$ > pid0; while [ ! -f ready ]; do sleep 0.02; done; exit 3; fi; \
                  trap '' TERM; echo $$ >> pids; touch ready; while true; do sleep 0.05; done";
    let child = KillOnDrop::spawn(rsrun(dir.path()).args([
        "--max-restarts",
        "3",
        "--shutdown-timeout",
        "3",
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        script,
    ]));
    let (ready, pid0) = (dir.path().join("ready"), dir.path().join("pid0"));
    let failed = wait_until(Duration::from_secs(20), || ready.exists() && read_pids(&pid0).first().is_some_and(|&p| !alive(p)));
    assert!(failed, "rank 0 did not fail");
    // rsrun reaps rank 0 at once: it is in the 3 s grace for rank 1 now.
    std::thread::sleep(Duration::from_millis(500));
    nix_kill(child.pid(), libc::SIGTERM);
    let out = child.output_within(Duration::from_secs(30));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    let attempts = std::fs::read_to_string(dir.path().join("attempts")).unwrap();
    assert_eq!(attempts, "0\n0\n", "no second round: {}", text(&out));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("restarting the job"), "{}", text(&out));
    for pid in read_pids(&dir.path().join("pids")) {
        assert!(!alive(pid), "worker {pid} survived");
    }
}
