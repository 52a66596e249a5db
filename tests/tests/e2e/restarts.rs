//! Restarts after a worker crash, the restart budget, and hang detection.

use rsrun_tests::{bin, code, rsrun, run, text};

#[test]
fn restart_after_a_crash_then_success() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 fails in the first attempt only, once rank 0 has recorded its attempt (else the group
    // may be stopped before rank 0's shell ran at all).
    let script = "echo $TORCHELASTIC_RESTART_COUNT >> attempts.$RANK; if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then while [ ! -s attempts.0 ]; do sleep 0.01; done; exit 3; fi; exit 0";
    let out = run(rsrun(dir.path()).args(["--max-restarts", "2", "--nproc-per-node", "2", "sh", "-c", script]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..2 {
        let attempts = std::fs::read_to_string(dir.path().join(format!("attempts.{rank}"))).unwrap();
        assert_eq!(attempts, "0\n1\n", "rank {rank}: every worker restarts with TORCHELASTIC_RESTART_COUNT+1");
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("restarting the job (restart 1 of 2)"), "{stderr}");
}

#[test]
fn budget_exhausted_fails_with_the_root_cause() {
    let dir = tempfile::tempdir().unwrap();
    let script = "[ $RANK = 0 ] && echo attempt >> attempts; [ $RANK = 0 ] && { echo 'fatal: bad batch' >&2; exit 5; }; sleep 30";
    let out = run(rsrun(dir.path()).args(["--max-restarts", "1", "--nproc-per-node", "2", "sh", "-c", script]));
    assert_eq!(code(&out.status), 5, "{}", text(&out));
    let attempts = std::fs::read_to_string(dir.path().join("attempts")).unwrap();
    assert_eq!(attempts.lines().count(), 2, "the first attempt and one restart");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("FAILED"), "{stderr}");
    assert!(stderr.contains("restarts 1/1"), "{stderr}");
    assert!(stderr.contains("rank       : 0 (local_rank 0)"), "{stderr}");
    assert!(stderr.contains("| fatal: bad batch"), "{stderr}");
    assert!(stderr.contains("rank 1 (local_rank 1)") && stderr.contains("stopped by rsrun"), "{stderr}");
}

#[test]
fn hang_detection_names_the_stalled_rank() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .args(["--nproc-per-node", "2", "--hang-timeout", "1s", "--monitor-interval", "0.1"])
        .arg(bin("hello"))
        .args(["--hang-rank", "1", "--steps", "400", "--step-ms", "20"]));
    assert_eq!(code(&out.status), 124, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rank       : 1 (local_rank 1)"), "{stderr}");
    assert!(stderr.contains("hung: no progress for"), "{stderr}");
}

#[test]
fn hang_then_restart_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .args(["--nproc-per-node", "2", "--hang-timeout", "1s", "--max-restarts", "1"])
        .arg(bin("hello"))
        .args(["--hang-rank", "0", "--only-first-attempt", "--steps", "20", "--step-ms", "10"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("restart 1"), "{}", text(&out));
}
