//! Several launchers (nodes) on loopback through a real `rsrun-rendezvous` daemon.

use std::process::Output;
use std::time::{Duration, Instant};

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, alive, bin, code, free_port, read_pids, rsrun, text, wait_until};

const CONF: &str = "last_call_timeout=0.5,keep_alive_interval=0.2,keep_alive_max_attempt=3,join_timeout=60";

fn node(dir: &std::path::Path, daemon: &Daemon, job: &str, nnodes: &str, extra: &[&str], hello: &[&str]) -> KillOnDrop {
    node_at(dir, &daemon.addr, CONF, job, nnodes, extra, hello)
}

/// A two-worker `hello` node of `job` at `endpoint` with `--rdzv-conf conf`.
fn node_at(dir: &std::path::Path, endpoint: &str, conf: &str, job: &str, nnodes: &str, extra: &[&str], hello: &[&str]) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint])
        .args(["--rdzv-id", job, "--rdzv-conf", conf])
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

/// The node where the failure began is every node's root cause, even when it is the last to stop
/// its workers: a peer whose workers fail in the cascade (a broken collective) and that stops
/// faster must not become the job's root cause by reporting first.
#[test]
fn the_first_failure_is_the_root_cause_even_when_its_node_stops_last() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    // Node rank 1 runs ranks 2 and 3: rank 3 fails first; rank 2 ignores SIGTERM, so that node's
    // teardown lasts the whole --shutdown-timeout. Node rank 0's ranks fail 1.5 s after rank 3.
    let script = "case $RANK in 3) sleep 1; echo 'rank 3 breaks' >&2; exit 7;; 2) trap '' TERM; sleep 30;; *) sleep 2.5; exit 9;; esac";
    let start = || {
        let mut cmd = rsrun(dir.path());
        cmd.args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", &daemon.addr])
            .args(["--rdzv-id", "cascade", "--rdzv-conf", CONF, "--shutdown-timeout", "6", "--no-python", "sh", "-c", script]);
        KillOnDrop::spawn(&mut cmd)
    };
    let (oa, ob) = both(start(), start());
    for o in [&oa, &ob] {
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(code(&o.status), 7, "{}", text(o));
        assert!(stderr.contains("rank       : 3"), "{stderr}");
    }
    // The root cause's node sent its full report after the teardown: the other node shows its
    // stderr too (it read the job's root cause after that report, or before: then without it).
    let all = String::from_utf8_lossy(&oa.stderr).into_owned() + &String::from_utf8_lossy(&ob.stderr);
    assert!(all.contains("rank 3 breaks"), "{all}");
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
    // A lease (0.2 s x 25) longer than the outage: within it a node keeps its workers.
    let conf = "last_call_timeout=0.5,keep_alive_interval=0.2,keep_alive_max_attempt=25,join_timeout=60";
    let a = node_at(dir.path(), &addr, conf, "survive", "2", &[], &hello);
    let b = node_at(dir.path(), &addr, conf, "survive", "2", &[], &hello);
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
    for o in [&oa, &ob] {
        assert!(!String::from_utf8_lossy(&o.stderr).contains("lease lapsed"), "an outage within the lease fenced a node:\n{}", text(o));
    }
}

/// Workers of `hello` that record their pids in `pids` (in the launcher's directory).
fn recorded_node(dir: &std::path::Path, endpoint: &str, conf: &str, job: &str, hello: &str) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint])
        .args(["--rdzv-id", job, "--rdzv-conf", conf])
        .args(["sh", "-c", &format!("echo $$ >> pids; exec \"$0\" {hello}")])
        .arg(bin("hello"));
    KillOnDrop::spawn(&mut cmd)
}

/// T4: a node cut off from the daemon (a user-space proxy holds its traffic) stops its workers by
/// its own lease, while its launcher waits for the daemon; once the link heals it learns that the
/// daemon dropped it, joins again, and the job completes with every rank run to the end once.
#[test]
fn a_partitioned_node_fences_itself_by_its_lease_and_rejoins_after_the_heal() {
    use rsrun_tests::proxy::{Fault, Proxy};
    let daemon = Daemon::start();
    let proxy = Proxy::start(daemon.addr.parse().unwrap());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Lease 1.5 s; the cut-off node waits up to 60 s for the daemon to answer again.
    const LEASE: Duration = Duration::from_millis(1500);
    let conf = "last_call_timeout=0.5,keep_alive_interval=0.5,keep_alive_max_attempt=3,join_timeout=60,keep_alive_timeout=60";
    let hello = "--steps 200 --step-ms 50";
    let a = recorded_node(da.path(), &daemon.addr, conf, "fence", hello);
    let b = recorded_node(db.path(), &proxy.addr().to_string(), conf, "fence", hello);
    let running = wait_until(Duration::from_secs(60), || {
        read_pids(&da.path().join("pids")).len() == 2 && read_pids(&db.path().join("pids")).len() == 2
    });
    assert!(running, "the 2-node round never ran");
    // Let the workers pass their start barrier (through the proxy too).
    std::thread::sleep(Duration::from_millis(1500));
    let b_workers = read_pids(&db.path().join("pids"));
    let cut = Instant::now();
    proxy.set(Fault::Blackhole);
    // Fenced by its own lease: the lease, one keep-alive period, and slack for this loaded machine.
    let fenced = wait_until(LEASE + Duration::from_secs(8), || b_workers.iter().all(|&w| !alive(w)));
    let took = cut.elapsed();
    assert!(fenced, "node b's workers {b_workers:?} still ran {took:?} after the cut (lease {LEASE:?})");
    eprintln!("fence: node b's workers stopped {took:.2?} after the cut (lease {LEASE:?})");
    // Its launcher is still there, waiting for the daemon (keep_alive_timeout 60 s).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(alive(b.pid()), "node b's launcher exited instead of waiting for the daemon");
    proxy.set(Fault::None);
    let (oa, ob) = both(a, b);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let eb = String::from_utf8_lossy(&ob.stderr);
    assert!(eb.contains("this node's lease lapsed"), "{}", text(&ob));
    assert!(eb.contains("the rendezvous service answered; re-joining"), "{}", text(&ob));
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert_eq!(all.matches(&format!("rank {rank} done")).count(), 1, "rank {rank} ran to the end more or less than once:\n{all}");
    }
    assert!(!all.contains("restart 1"), "a partition does not consume the restart budget:\n{all}");
    assert_eq!(read_pids(&db.path().join("pids")).len(), 4, "node b ran two rounds of two workers");
}

/// A daemon down for longer than the nodes' lease: each node fences itself (it cannot tell an
/// outage from a partition); when the daemon is back with its state, each finds itself still a
/// member, leaves so that the round ends for everyone, and joins again: the job goes on in a new
/// round, without using the restart budget.
#[test]
fn a_daemon_down_longer_than_the_lease_fences_the_nodes_and_the_job_goes_on() {
    let data = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with(&format!("127.0.0.1:{}", free_port()), &[std::ffi::OsStr::new("--data-dir"), data.path().as_os_str()]);
    let addr = daemon.addr.clone();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Lease 9 s (the nodes fence 2 s before its end), the outage until both fenced. The restarted
    // daemon gives every node a full lease, which outlasts the client's retry backoff (at most
    // 2 s) with room for a loaded machine (6 s was once too short under the whole suite): each
    // node's leave finds it still a member.
    let conf = "last_call_timeout=0.5,keep_alive_interval=1,keep_alive_max_attempt=9,join_timeout=60,keep_alive_timeout=60";
    let hello = "--steps 200 --step-ms 50";
    let a = recorded_node(da.path(), &addr, conf, "outage", hello);
    let b = recorded_node(db.path(), &addr, conf, "outage", hello);
    let running = wait_until(Duration::from_secs(60), || {
        read_pids(&da.path().join("pids")).len() == 2 && read_pids(&db.path().join("pids")).len() == 2
    });
    assert!(running, "the 2-node round never ran");
    std::thread::sleep(Duration::from_millis(1000));
    let first: Vec<i32> = [da.path(), db.path()].iter().flat_map(|d| read_pids(&d.join("pids"))).collect();
    daemon.kill9();
    let fenced = wait_until(Duration::from_secs(20), || first.iter().all(|&w| !alive(w)));
    assert!(fenced, "workers {first:?} still run with the daemon down past the lease");
    std::thread::sleep(Duration::from_millis(500));
    let _daemon = Daemon::start_with(&addr, &[std::ffi::OsStr::new("--data-dir"), data.path().as_os_str()]);
    let (oa, ob) = both(a, b);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    for o in [&oa, &ob] {
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("this node's lease lapsed") && e.contains("the rendezvous service answered; re-joining"), "{}", text(o));
        // It left (the daemon still counted it in), rather than being dropped for its lease.
        assert!(e.contains("which stopped its workers and left"), "{}", text(o));
    }
    let all = stdout(&oa) + &stdout(&ob);
    for rank in 0..4 {
        assert_eq!(all.matches(&format!("rank {rank} done")).count(), 1, "rank {rank} ran to the end more or less than once:\n{all}");
    }
    assert!(!all.contains("restart 1"), "an outage does not consume the restart budget:\n{all}");
}
