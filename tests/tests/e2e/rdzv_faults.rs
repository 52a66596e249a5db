//! The launcher against a rendezvous daemon that goes away, refuses, or speaks TLS: stop signals
//! during the exit barrier and during a failure report are honoured at once; a daemon gone for good
//! ends the node with an error naming it; `--rdzv-tls-ca` reaches a TLS daemon; a launcher-hosted
//! service refuses another job (exit 2).

use std::path::Path;
use std::time::{Duration, Instant};

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, alive, code, read_pids, rsrun, text, tls_files, wait_until};

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid, sig);
    }
}

/// A single-worker node of job `job` at `daemon` running `sh -c script`.
fn node(dir: &Path, endpoint: &str, job: &str, nnodes: &str, conf: &str, extra: &[&str], script: &str) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", job])
        .args(["--rdzv-conf", &format!("last_call_timeout=0.3,keep_alive_interval=0.2,keep_alive_max_attempt=5,join_timeout=30{conf}")])
        .args(extra)
        .args(["sh", "-c", script]);
    KillOnDrop::spawn(&mut cmd)
}

#[test]
fn sigterm_during_the_exit_barrier_exits_143_at_once() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    // Rank 0 succeeds at once and its node waits at the exit barrier; rank 1 keeps running.
    let script = "if [ \"$RANK\" = 0 ]; then echo $PPID > done.pid; exit 0; fi; sleep 60";
    let extra = ["--exit-barrier-timeout", "120"];
    let a = node(dir.path(), &daemon.addr, "barrier", "2", "", &extra, script);
    let b = node(dir.path(), &daemon.addr, "barrier", "2", "", &extra, script);
    let pid_file = dir.path().join("done.pid");
    assert!(wait_until(Duration::from_secs(30), || read_pids(&pid_file).len() == 1), "rank 0 never ran");
    let waiting = read_pids(&pid_file)[0];
    let (waiting, _other) = if waiting == a.pid() { (a, b) } else { (b, a) };
    assert_eq!(waiting.pid(), read_pids(&pid_file)[0], "done.pid names neither launcher");
    // Let it reach the barrier (its worker exited, Finish answered).
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    kill(waiting.pid(), libc::SIGTERM);
    let out = waiting.output_within(Duration::from_secs(20));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exit barrier"), "{}", text(&out));
}

#[test]
fn sigterm_while_reporting_a_failure_to_a_dead_daemon_exits_143_at_once() {
    let daemon = Daemon::start();
    let addr = daemon.addr.clone();
    let dir = tempfile::tempdir().unwrap();
    // read_timeout=30: the failure report retries the unreachable daemon for 30 s.
    let script = "echo $$ >> pids; while [ ! -f fail ]; do sleep 0.05; done; exit 3";
    let child = node(dir.path(), &addr, "report", "1", ",read_timeout=30", &[], script);
    assert!(wait_until(Duration::from_secs(30), || read_pids(&dir.path().join("pids")).len() == 1), "worker never ran");
    daemon.kill9();
    std::fs::write(dir.path().join("fail"), "").unwrap();
    // The worker exits 3 and the report starts retrying.
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    kill(child.pid(), libc::SIGTERM);
    let out = child.output_within(Duration::from_secs(40));
    assert_eq!(code(&out.status), 143, "{}", text(&out));
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
}

#[test]
fn a_daemon_gone_for_good_stops_the_workers_and_names_the_endpoint() {
    let daemon = Daemon::start();
    let addr = daemon.addr.clone();
    let dir = tempfile::tempdir().unwrap();
    let script = "echo $$ >> pids; exec sleep 120";
    let child = node(dir.path(), &addr, "gone", "1", ",read_timeout=1,keep_alive_timeout=2", &[], script);
    let pids_file = dir.path().join("pids");
    assert!(wait_until(Duration::from_secs(30), || read_pids(&pids_file).len() == 1), "worker never ran");
    let worker = read_pids(&pids_file)[0];
    daemon.kill9();
    let out = child.output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 1, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("lost contact with the rendezvous service at {addr}")), "{}", text(&out));
    assert!(!alive(worker), "worker {worker} survived");
    assert_eq!(read_pids(&pids_file).len(), 1, "workers were restarted against a dead daemon:\n{}", text(&out));
}

/// A join that never reaches the service ends when its `join_timeout` does: the node does not
/// then wait out another call to leave a service that did not answer (it used to add 3 s).
#[test]
fn a_join_that_never_reached_the_service_ends_with_its_timeout() {
    // A loopback port nothing listens on (bound, then closed), never hosted here (is_host=false).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    // The process's first rsrun() may build the workspace binaries: before the clock starts.
    drop(rsrun(dir.path()));
    let start = Instant::now();
    let out = node(dir.path(), &format!("127.0.0.1:{port}"), "nobody", "2", ",join_timeout=1,is_host=false", &[], "true").output_within(RUN_DEADLINE);
    let took = start.elapsed();
    assert_eq!(code(&out.status), 1, "{}", text(&out));
    assert!(text(&out).contains(&format!("rendezvous service at 127.0.0.1:{port} unreachable")), "{}", text(&out));
    // 1 s of join, plus start-up; a leave would add its 3 s.
    assert!(took < Duration::from_millis(3500), "took {took:?}: {}", text(&out));
}

#[test]
fn rdzv_tls_ca_reaches_a_tls_daemon() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_files(certs.path());
    let daemon = Daemon::start_with(
        "127.0.0.1:0",
        &["--tls-cert".as_ref(), cert.as_os_str(), "--tls-key".as_ref(), key.as_os_str()],
    );
    let dir = tempfile::tempdir().unwrap();
    let script = "echo \"ca=$RSRUN_TLS_CA\"";
    let out = node(dir.path(), &daemon.addr, "tls", "1", "", &["--rdzv-tls-ca", ca.to_str().unwrap()], script)
        .output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("ca={}", ca.display())), "{}", text(&out));
    // PET_RDZV_TLS_CA works the same.
    let mut cmd = rsrun(dir.path());
    cmd.env("PET_RDZV_TLS_CA", &ca)
        .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", &daemon.addr, "--rdzv-id", "tls-env", "sh", "-c", script]);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    // Without the CA, or with a CA that did not sign its certificate, the launcher cannot talk to
    // it: told at once (not after the 600 s join timeout, as if the daemon were not up yet), naming
    // the daemon and what to check, exit 2 (it cannot start as configured).
    let out = node(dir.path(), &daemon.addr, "plain", "1", ",join_timeout=600", &[], script).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&daemon.addr) && stderr.contains("the daemon answers with TLS"), "{}", text(&out));
    let other = tempfile::tempdir().unwrap();
    let (other_ca, _, _) = tls_files(other.path());
    let out = node(dir.path(), &daemon.addr, "wrong-ca", "1", ",join_timeout=600", &["--rdzv-tls-ca", other_ca.to_str().unwrap()], script)
        .output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("invalid peer certificate") && stderr.contains("not signed by the CA file given"), "{}", text(&out));
    // A file that holds no certificate is refused before anything starts.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let out = node(dir.path(), &daemon.addr, "junk-ca", "1", "", &["--rdzv-tls-ca", junk.to_str().unwrap()], script).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("holds no PEM certificate"), "{}", text(&out));
}

/// A daemon given TLS files it cannot use says which and why before it listens, and exits 2.
#[test]
fn a_daemon_refuses_unusable_tls_files_before_it_listens() {
    let certs = tempfile::tempdir().unwrap();
    let (ca, cert, key) = tls_files(certs.path());
    for (c, k, want) in [(&ca, &cert, "--tls-key"), (&key, &key, "--tls-cert")] {
        let mut cmd = std::process::Command::new(rsrun_tests::bin("rsrun-rendezvous"));
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"]).arg(c).arg("--tls-key").arg(k);
        let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
        assert_eq!(code(&out.status), 2, "{}", text(&out));
        assert!(!String::from_utf8_lossy(&out.stdout).contains("listening on"), "{}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want) && stderr.contains("holds no PEM"), "{want}: {}", text(&out));
    }
}

/// A launcher that hosts the rendezvous at its endpoint serves its own job only: a launcher of
/// another job given the same endpoint is refused at once, naming both jobs, and exits 2 (it could
/// not start as configured), while the first job is untouched.
#[test]
fn another_jobs_embedded_service_refuses_this_job_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("127.0.0.1:{}", rsrun_tests::free_port());
    // Job A: its first node hosts the service and waits for a second node.
    let a = node(dir.path(), &endpoint, "job-a", "2", "", &[], "true");
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();
    assert!(wait_until(Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()), "job A never hosted");
    let start = Instant::now();
    let out = node(dir.path(), &endpoint, "job-b", "2", "", &[], "true").output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("rsrun: error: the rendezvous at {endpoint} refuses job 'job-b'"))
            && stderr.contains("serves only job \"job-a\""),
        "{stderr}"
    );
    assert!(start.elapsed() < Duration::from_secs(10), "refused at once, not at the join timeout: {:?}", start.elapsed());
    // Job A still waits for its second node.
    assert!(alive(a.pid()), "job A's launcher is gone");
    kill(a.pid(), libc::SIGTERM);
    assert_eq!(code(&a.output_within(RUN_DEADLINE).status), 143);
}

/// A daemon of a highly available group that waits for an etcd nobody answers at (up to 30 s)
/// stops at once on SIGTERM, as it does when serving.
#[test]
fn a_daemon_waiting_for_etcd_stops_on_sigterm() {
    let mut cmd = std::process::Command::new(rsrun_tests::bin("rsrun-rendezvous"));
    let etcd = format!("127.0.0.1:{}", rsrun_tests::free_port());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--etcd-endpoints", &etcd]);
    let child = KillOnDrop::spawn(&mut cmd);
    std::thread::sleep(Duration::from_millis(1500));
    kill(child.pid(), libc::SIGTERM);
    let start = Instant::now();
    let out = child.output_within(RUN_DEADLINE);
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?} to stop: {}", start.elapsed(), text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("shutting down"), "{}", text(&out));
}

/// `serve` flags that only a highly available daemon uses are refused without --etcd-endpoints
/// (--etcd-prefix and --leader-lease-ttl were silently ignored), and a --data-dir that is a file
/// is named as such.
#[test]
fn serve_refuses_flags_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("afile");
    std::fs::write(&file, "").unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&["--etcd-prefix", "/foo"], "--etcd-prefix only applies to highly available daemons"),
        (&["--leader-lease-ttl", "10"], "--leader-lease-ttl only applies to highly available daemons"),
        (&["--data-dir", file.to_str().unwrap()], "is not a directory"),
    ];
    for (args, want) in cases {
        let mut cmd = std::process::Command::new(rsrun_tests::bin("rsrun-rendezvous"));
        cmd.args(["serve", "--listen", "127.0.0.1:0"]).args(args);
        let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
        assert_ne!(code(&out.status), 0, "{args:?}: {}", text(&out));
        assert!(text(&out).contains(want), "{args:?}: {}", text(&out));
    }
}
