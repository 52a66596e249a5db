//! Several launchers (nodes) on loopback through a real `rsrun-rendezvous` daemon.

use std::process::Output;
use std::time::Duration;

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, bin, code, free_port, rsrun, text, wait_until};

fn node(dir: &std::path::Path, daemon: &Daemon, job: &str, nnodes: &str, extra: &[&str], hello: &[&str]) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"])
        .arg(&daemon.addr)
        .args(["--rdzv-id", job])
        .args(["--rdzv-conf", "last_call_timeout=0.5,keep_alive_interval=0.2,keep_alive_max_attempt=3,join_timeout=60"])
        .args(extra)
        .arg(bin("hello"))
        .args(hello);
    KillOnDrop::spawn(&mut cmd)
}

fn both(a: KillOnDrop, b: KillOnDrop) -> (Output, Output) {
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE));
    let ob = b.output_within(RUN_DEADLINE);
    (ta.join().unwrap(), ob)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn two_nodes_two_workers_each() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), &daemon, "two-by-two", "2", &[], &["--steps", "3"]);
    let b = node(dir.path(), &daemon, "two-by-two", "2", &[], &["--steps", "3"]);
    let (oa, ob) = both(a, b);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert!(all.contains(&format!("hello from rank {rank} of 4")), "rank {rank} missing:\n{all}");
        assert!(all.contains(&format!("rank {rank} got unique id")), "rank {rank}: no unique id:\n{all}");
        assert!(all.contains(&format!("rank {rank} done")), "{all}");
    }
    // Each node ran two consecutive ranks.
    let a_ranks: Vec<bool> = (0..4).map(|r| stdout(&oa).contains(&format!("hello from rank {r} of 4"))).collect();
    assert!(a_ranks == [true, true, false, false] || a_ranks == [false, false, true, true], "{a_ranks:?}");
}

#[test]
fn a_worker_crash_restarts_every_node() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let hello = ["--steps", "5", "--exit-rank", "3:7", "--only-first-attempt"];
    let a = node(dir.path(), &daemon, "restart-all", "2", &["--max-restarts", "1"], &hello);
    let b = node(dir.path(), &daemon, "restart-all", "2", &["--max-restarts", "1"], &hello);
    let (oa, ob) = both(a, b);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert!(all.contains(&format!("hello from rank {rank} of 4 (local rank {} of 2, node {} of 2, restart 1", rank % 2, rank / 2)), "{all}");
    }
}

#[test]
fn budget_exhausted_fails_every_node_with_the_root_cause() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let hello = ["--steps", "400", "--step-ms", "20", "--exit-rank", "3:7"];
    let a = node(dir.path(), &daemon, "fail-all", "2", &[], &hello);
    let b = node(dir.path(), &daemon, "fail-all", "2", &[], &hello);
    let (oa, ob) = both(a, b);
    for o in [&oa, &ob] {
        assert_eq!(code(&o.status), 7, "{}", text(o));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("Root cause"), "{stderr}");
        assert!(stderr.contains("rank       : 3"), "{stderr}");
    }
}

#[test]
fn a_dead_node_shrinks_the_job() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let hello = ["--steps", "150", "--step-ms", "20"];
    let a = node(dir.path(), &daemon, "elastic", "1:2", &[], &hello);
    let mut b = node(dir.path(), &daemon, "elastic", "1:2", &[], &hello);
    // Wait until both nodes run workers of a 4-worker round.
    let logs = dir.path().join(".rsrun/logs/elastic");
    let running = wait_until(Duration::from_secs(30), || {
        std::fs::read_dir(&logs)
            .map(|d| {
                d.filter_map(Result::ok).any(|attempt| {
                    (0..4).all(|r| {
                        std::fs::read_to_string(attempt.path().join(r.to_string()).join("stdout.log"))
                            .map(|s| s.contains("of 4"))
                            .unwrap_or(false)
                    })
                })
            })
            .unwrap_or(false)
    });
    assert!(running, "the 2-node round did not start");
    // SAFETY: plain kill(2) of our own child.
    unsafe {
        libc::kill(b.pid(), libc::SIGKILL);
    }
    let _ = b.0.wait();
    let oa = a.output_within(RUN_DEADLINE);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    let s = stdout(&oa);
    assert!(s.contains("of 4"), "{s}");
    assert!(s.contains("hello from rank 0 of 2") && s.contains("hello from rank 1 of 2"), "survivor restarts alone:\n{s}");
    assert!(s.contains("restart 0"), "a membership change does not consume the restart budget:\n{s}");
}

/// The daemon is `kill -9`'d in the middle of a two-node job and restarted on the same address and
/// data directory: the launchers ride through the outage and the workers are never restarted.
#[test]
fn daemon_kill_9_and_restart_mid_job_is_a_pause() {
    let data = tempfile::tempdir().unwrap();
    // A port from below the ephemeral range (`free_port`): the restart binds it again, and a bind
    // to port 0 of a test running beside this one could take a port the kernel picked meanwhile.
    let daemon = Daemon::start_with(&format!("127.0.0.1:{}", free_port()), &[std::ffi::OsStr::new("--data-dir"), data.path().as_os_str()]);
    let addr = daemon.addr.clone();
    let dir = tempfile::tempdir().unwrap();
    let hello = ["--steps", "25", "--step-ms", "100"];
    let a = node(dir.path(), &daemon, "survive", "2", &[], &hello);
    let b = node(dir.path(), &daemon, "survive", "2", &[], &hello);
    // Let the round form and the workers start, then take the daemon away for a while.
    std::thread::sleep(Duration::from_millis(1200));
    daemon.kill9();
    std::thread::sleep(Duration::from_millis(700));
    let _daemon = Daemon::start_with(&addr, &[std::ffi::OsStr::new("--data-dir"), data.path().as_os_str()]);
    let (oa, ob) = both(a, b);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert_eq!(all.matches(&format!("rank {rank} done")).count(), 1, "rank {rank} ran more or less than once:\n{all}");
    }
    assert!(!all.contains("restart 1"), "workers were restarted:\n{all}");
}
