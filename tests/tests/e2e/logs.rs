//! Per-rank log files always; the console stream is prefixed and filtered.

use rsrun_tests::{code, rsrun, run, text};

const SCRIPT: &str = "echo out-$RANK; echo err-$RANK >&2";

fn attempt_dirs(base: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    for job in std::fs::read_dir(base).unwrap() {
        for attempt in std::fs::read_dir(job.unwrap().path()).unwrap() {
            found.push(attempt.unwrap().path());
        }
    }
    found
}

#[test]
fn per_rank_files_and_prefixed_console() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2", "sh", "-c", SCRIPT]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("[rank 0] out-0\n") && stdout.contains("[rank 1] out-1\n"), "{stdout}");
    assert!(stderr.contains("[rank 0] err-0\n") && stderr.contains("[rank 1] err-1\n"), "{stderr}");
    let attempts = attempt_dirs(&dir.path().join(".rsrun/logs"));
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    assert!(attempts[0].file_name().unwrap().to_str().unwrap().starts_with("attempt_"));
    for rank in 0..2 {
        let d = attempts[0].join(rank.to_string());
        assert_eq!(std::fs::read_to_string(d.join("stdout.log")).unwrap(), format!("out-{rank}\n"));
        assert_eq!(std::fs::read_to_string(d.join("stderr.log")).unwrap(), format!("err-{rank}\n"));
    }
}

#[test]
fn filters_redirects_and_prefix_template() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("mylogs");
    let out = run(rsrun(dir.path())
        .args(["--nproc-per-node", "3", "--ranks-filter", "0,2", "--redirects", "2:1"])
        .args(["--log-prefix", "<${role_name}:${rank}/${local_rank}> ", "--log-dir"])
        .arg(&logs)
        .args(["--rdzv-id", "logjob", "sh", "-c", SCRIPT]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("<default:0/0> out-0"), "{stdout}");
    assert!(!stdout.contains("out-1"), "rank 1 is filtered out: {stdout}");
    assert!(!stdout.contains("out-2"), "rank 2's stdout is redirected: {stdout}");
    assert!(stderr.contains("<default:2/2> err-2"), "{stderr}");
    // Files are not affected by console filters.
    let attempt = attempt_dirs(&logs).pop().unwrap();
    assert!(attempt.starts_with(logs.join("logjob")));
    assert_eq!(std::fs::read_to_string(attempt.join("1/stdout.log")).unwrap(), "out-1\n");
    assert_eq!(std::fs::read_to_string(attempt.join("2/stdout.log")).unwrap(), "out-2\n");

    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2", "--local-ranks-filter", "1", "sh", "-c", SCRIPT]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("out-1") && !stdout.contains("out-0"), "{stdout}");
}

#[test]
fn partial_last_line_and_substitution() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2", "sh", "-c", "printf 'lr=%s no newline' \"$1\"", "sh", "${local_rank}"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("[rank 1] lr=1 no newline\n"), "{stdout}");
}
