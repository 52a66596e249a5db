//! Bad command lines exit 2 with a message naming the bad value; `--dry-run` prints the plan.

use rsrun_tests::{code, rsrun, run, text};

fn expect_usage_error(args: &[&str], needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(args));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(code(&out.status), 2, "{args:?}\n{}", text(&out));
    assert!(stderr.contains(needle), "{args:?}: expected {needle:?} in\n{}", text(&out));
    assert!(!dir.path().join(".rsrun").exists(), "nothing may start on a usage error");
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    expect_usage_error(&["--nnodes", "0", "true"], "invalid value '0' for --nnodes");
    expect_usage_error(&["--nnodes", "3:2", "true"], "invalid value '3:2' for --nnodes");
    expect_usage_error(&["--nnodes", "abc", "true"], "invalid value 'abc' for --nnodes");
    expect_usage_error(&["--nproc-per-node", "0", "true"], "invalid value '0' for --nproc-per-node");
    expect_usage_error(
        &["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:notaport", "true"],
        "invalid value 'host:notaport' for --rdzv-endpoint",
    );
    expect_usage_error(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1", "true"], "--rdzv-endpoint");
    expect_usage_error(&["--nproc-per-node", "2"], "<PROGRAM [ARGS]>");
    expect_usage_error(&["no-such-program-xyz"], "program 'no-such-program-xyz' not found");
    expect_usage_error(&["missing.py"], "program 'missing.py' not found");
    expect_usage_error(&["--max-restarts", "-1", "true"], "--max-restarts");
    expect_usage_error(&["--bogus-flag", "true"], "unexpected argument '--bogus-flag'");
}

#[test]
fn pet_environment_fallbacks() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .env("PET_NPROC_PER_NODE", "3")
        .env("PET_NO_PYTHON", "1")
        .args(["--dry-run", "sh", "-c", "true"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("worker rank 2 (local_rank 2"), "{stdout}");
    let out = run(rsrun(dir.path()).env("PET_NNODES", "0").args(["true"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
}

#[test]
fn dry_run_prints_the_plan_and_starts_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let out = run(rsrun(dir.path()).args([
        "--dry-run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29555",
        "--nproc_per_node",
        "2",
        "--rdzv-id",
        "job9",
        "touch",
        marker.to_str().unwrap(),
        "lr=${local_rank}",
    ]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(!marker.exists(), "--dry-run must not start workers");
    let s = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "job          : job9",
        "static: node rank 0 hosts the rendezvous at 10.0.0.1:29555; fixed node ranks, verified",
        "worker rank 2 (local_rank 0, node_rank 1)",
        "worker rank 3 (local_rank 1, node_rank 1)",
        "lr=1",
        "    RANK=3",
        "    WORLD_SIZE=4",
        "    GROUP_RANK=1",
        "    LOCAL_WORLD_SIZE=2",
        "    MASTER_ADDR=10.0.0.1",
        "    MASTER_PORT=<port of the TCPStore the rendezvous serves for the round>",
        "    RSRUN_RDZV_ENDPOINT=10.0.0.1:29555",
        "    TORCHELASTIC_RUN_ID=job9",
        "    OMP_NUM_THREADS=1",
    ] {
        assert!(s.contains(needle), "missing {needle:?} in\n{s}");
    }
}

#[test]
fn compat_flags_warn_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--start-method", "fork", "--logs-specs", "x", "true"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.lines().any(|l| l.starts_with("rsrun: --start-method fork has no effect")), "{stderr}");
    assert!(stderr.lines().any(|l| l.starts_with("rsrun: --logs-specs x has no effect")), "{stderr}");
}

/// The benchmarks refuse counts that mean nothing, naming the flag and the value, before any
/// work (`--steps 0` used to panic after start-up; `collectives-bench --spawn 0` printed nothing
/// and exited 0).
#[test]
fn benchmarks_refuse_bad_counts() {
    let cases: [(&str, &[&str], &str); 10] = [
        ("train", &["--clip=-1"], "expected a finite norm >= 0"),
        ("train", &["--clip", "nan"], "expected a finite norm >= 0"),
        ("engine-bench", &["--steps", "0"], "invalid value '0' for '--steps"),
        ("engine-bench", &["--batch", "0"], "invalid value '0' for '--batch"),
        ("engine-bench", &["--threads", "0"], "invalid value '0' for '--threads"),
        ("collectives-bench", &["--spawn", "0"], "--spawn \"0\": expected a whole number, 1 or more"),
        ("collectives-bench", &["--sizes", "1024,abc"], "--sizes \"abc\": expected a whole number, 4 or more"),
        ("collectives-bench", &["--sizes", "6"], "--sizes \"6\": expected a whole number of f32 elements"),
        ("collectives-bench", &["--ops", "bogus"], "--ops \"bogus\": expected one of all_reduce"),
        ("collectives-bench", &["--backends", "bogus"], "unknown backend \"bogus\""),
    ];
    for (name, args, needle) in cases {
        let out = run(std::process::Command::new(rsrun_tests::bin(name)).args(args).env("RUST_BACKTRACE", "0"));
        let all = text(&out);
        assert!(!out.status.success() && code(&out.status) != 101, "{name} {args:?}\n{all}");
        assert!(all.contains(needle), "{name} {args:?}: expected {needle:?} in\n{all}");
    }
}

/// Environment variables of ours that hold no usable value are errors naming them, exit 2 (a
/// bad RSRUN_LOG was silently replaced by the default; RSRUN_ISA=avx3 was only a note).
#[test]
fn bad_environment_values_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).env("RSRUN_LOG", "garbage===").args(["--standalone", "true"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("RSRUN_LOG=\"garbage===\" is not a log filter"), "{}", text(&out));
    let out = run(std::process::Command::new(rsrun_tests::bin("rsrun-rendezvous")).env("RSRUN_LOG", "x===").args(["serve", "--listen", "127.0.0.1:0"]));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("RSRUN_LOG=\"x===\""), "{}", text(&out));
    let out = run(rsrun(dir.path()).env("PET_NNODES", "abc").arg("true"));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("PET_NNODES=abc: invalid value 'abc' for --nnodes"), "{}", text(&out));
    // Values clap itself refuses are traced to their variable too.
    let out = run(rsrun(dir.path()).env("PET_MAX_RESTARTS", "abc").arg("true"));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("PET_MAX_RESTARTS=abc in the environment sets that option"), "{}", text(&out));
    let bench = rsrun_tests::bin("engine-bench");
    let out = run(std::process::Command::new(bench).env("RSRUN_ISA", "avx3").env("RUST_BACKTRACE", "0").args(["--steps", "1"]));
    assert!(!out.status.success() && code(&out.status) != 101, "{}", text(&out));
    assert!(text(&out).contains("RSRUN_ISA=\"avx3\" is not a SIMD level"), "{}", text(&out));
}

/// A token no rendezvous service accepts fails the launch at once, naming the file and the
/// reason (the embedded service used to refuse it silently and the launcher waited for it until
/// the join timeout).
#[test]
fn a_token_no_service_accepts_fails_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("short.tok");
    std::fs::write(&tok, "secret\n").unwrap();
    let endpoint = format!("127.0.0.1:{}", rsrun_tests::free_port());
    // The command is made first: the first `rsrun(..)` of the process may build the binaries.
    let mut cmd = rsrun(dir.path());
    cmd.args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "tok", "--rdzv-conf", "join_timeout=120", "--rdzv-token-file"])
        .arg(&tok)
        .arg("true");
    let start = std::time::Instant::now();
    let out = run(&mut cmd);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("short.tok line 1: token of 6 characters; use at least 16"), "{all}");
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "took {:?}: {all}", start.elapsed());
}

/// A `--log-dir` that cannot be a directory is named as such, not as the program failing.
#[test]
fn a_log_dir_that_is_a_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("afile"), "").unwrap();
    // Found before anything starts (exit 2), not as a start failure of every worker that
    // restarted the job until its budget ran out.
    let out = run(rsrun(dir.path()).args(["--standalone", "--max-restarts", "3", "--log-dir", "afile", "true"]));
    let all = text(&out);
    assert_eq!(code(&out.status), 2, "{all}");
    assert!(all.contains("for --log-dir") && all.contains("afile is not a directory") && !all.contains("restart"), "{all}");
}
