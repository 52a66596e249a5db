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

/// Running the same job id again in the same place (torchrun's default id, "none", every time)
/// starts its rounds at 1 again: the earlier run's files are kept as `NAME.1`, not truncated.
#[test]
fn a_rerun_keeps_the_earlier_runs_files() {
    let dir = tempfile::tempdir().unwrap();
    for n in 1..=2 {
        // The static backend: node rank 0 hosts the rendezvous; the job id is "none".
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
        let out = run(rsrun(dir.path())
            .env("RUN", n.to_string())
            .args(["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", &port])
            .args(["sh", "-c", "echo run-$RUN; echo err-$RUN >&2"]));
        assert_eq!(code(&out.status), 0, "{}", text(&out));
    }
    let attempts = attempt_dirs(&dir.path().join(".rsrun/logs"));
    assert_eq!(attempts.len(), 1, "{attempts:?}");
    let d = attempts[0].join("0");
    assert_eq!(std::fs::read_to_string(d.join("stdout.log")).unwrap(), "run-2\n");
    assert_eq!(std::fs::read_to_string(d.join("stdout.log.1")).unwrap(), "run-1\n");
    assert_eq!(std::fs::read_to_string(d.join("stderr.log.1")).unwrap(), "err-1\n");
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

/// A worker that draws a bar on stderr (tqdm's way: "\r" then the state, "\n" at the end), then
/// ends a line Windows-style.
const BAR: &str = r#"i=0; while [ $i -le 25 ]; do printf '\r%s %3d%%' "bar-$RANK" $((i * 4)) >&2; i=$((i + 1)); sleep 0.1; done; printf '\n' >&2; printf 'a\rb\rc\n'; printf 'win\r\n'"#;

/// The raw bytes the worker writes to stderr.
fn bar_bytes(rank: u32) -> String {
    let mut s: String = (0..=25).map(|i| format!("\rbar-{rank} {:3}%", i * 4)).collect();
    s.push('\n');
    s
}

#[test]
fn carriage_return_progress_is_throttled_on_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2", "--ranks-filter", "0", "sh", "-c", BAR]));
    let wall = started.elapsed();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Ordinary lines: a fast "\r" line prints its final state only; "\r\n" is a plain newline.
    assert_eq!(stdout, "[rank 0] c\n[rank 0] win\n", "{}", text(&out));
    assert!(!stderr.contains('\r'), "{stderr:?}");
    let bar: Vec<&str> = stderr.lines().filter(|l| l.contains("bar-")).collect();
    assert!(bar.iter().all(|l| l.starts_with("[rank 0] bar-0 ")), "only rank 0 is shown: {bar:?}");
    assert_eq!(bar.last(), Some(&"[rank 0] bar-0 100%"), "the final state is printed: {bar:?}");
    // One update a second at most, plus the final state (the bar takes 2.5 s or more).
    let at_most = wall.as_secs() as usize + 2;
    assert!(bar.len() >= 2 && bar.len() <= at_most, "{} lines in {wall:?}: {bar:?}", bar.len());
    let states: std::collections::HashSet<&&str> = bar.iter().collect();
    assert_eq!(states.len(), bar.len(), "no state is printed twice: {bar:?}");
    // The rank's log files keep the raw bytes, filtered or not.
    let attempt = attempt_dirs(&dir.path().join(".rsrun/logs")).pop().unwrap();
    for rank in 0..2 {
        let d = attempt.join(rank.to_string());
        assert_eq!(std::fs::read_to_string(d.join("stderr.log")).unwrap(), bar_bytes(rank));
        assert_eq!(std::fs::read_to_string(d.join("stdout.log")).unwrap(), "a\rb\rc\nwin\r\n");
    }
}

#[test]
fn unfinished_progress_line_is_printed_at_exit() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "1", "sh", "-c", r"printf 'step 1\rstep 2\r'; exit 3"]));
    assert_eq!(code(&out.status), 3, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.ends_with("[rank 0] step 2\n"), "{}", text(&out));
}

/// The terminal path through a real pseudo-terminal (`script`), where the tool exists.
#[test]
fn carriage_return_progress_renders_in_place_on_a_terminal() {
    if std::process::Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` command to run rsrun on a pseudo-terminal");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let transcript = dir.path().join("typescript");
    let rsrun = rsrun_tests::bin("rsrun");
    let inner = format!(
        "{} --nproc-per-node 1 sh -c \"printf 'x\\\\n\\\\r1/2'; sleep 0.3; printf '\\\\r2/2\\\\n'\"",
        rsrun.display()
    );
    let out = run(std::process::Command::new("script")
        .current_dir(dir.path())
        .env("TERM", "xterm")
        .args(["-qec", &inner])
        .arg(&transcript));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let raw = std::fs::read(&transcript).unwrap();
    let raw = String::from_utf8_lossy(&raw);
    // The update is drawn with wrapping off, then erased and replaced by the final line.
    assert!(raw.contains("\x1b[?7l[rank 0] 1/2\x1b[?7h"), "{raw:?}");
    assert!(raw.contains("\r\x1b[J[rank 0] 2/2\r\n"), "{raw:?}");
    assert!(raw.contains("[rank 0] x\r\n"), "{raw:?}");
}
