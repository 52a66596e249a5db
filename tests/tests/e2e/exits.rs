//! rsrun exits with the root-cause worker's code, or 128 + its signal.

use rsrun_tests::{code, rsrun, run, text};

#[test]
fn success_is_zero() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2", "true"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
}

#[test]
fn exit_code_of_the_failing_worker() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "3", "sh", "-c", "[ $RANK = 2 ] && exit 7; sleep 30"]));
    assert_eq!(code(&out.status), 7, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Root cause"), "{stderr}");
    assert!(stderr.contains("rank       : 2 (local_rank 2)"), "{stderr}");
    assert!(stderr.contains("exit code 7 -> rsrun exits 7"), "{stderr}");
    assert!(stderr.contains("Other ranks affected"), "{stderr}");
}

#[test]
fn sigsegv_is_139() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path()).args(["sh", "-c", "kill -SEGV $$"]));
    assert_eq!(code(&out.status), 139, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("killed by SIGSEGV (signal 11)"), "{}", text(&out));
}

#[test]
fn panic_writes_the_error_file_and_the_report_shows_it() {
    let dir = tempfile::tempdir().unwrap();
    let hello = rsrun_tests::bin("hello");
    let out = run(rsrun(dir.path()).args(["--nproc-per-node", "2"]).arg(&hello).args(["--panic-rank", "1", "--steps", "50"]));
    assert_eq!(code(&out.status), 101, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error      : panic: rank 1 failed on purpose at step 1"), "{stderr}");
    assert!(stderr.contains("error_file : ") && stderr.contains("/1/error.json"), "{stderr}");
    assert!(stderr.contains("traceback  :"), "{stderr}");
}

/// A worker that ends with an error (not a panic) writes it to its error file too, and the report
/// shows it (the example trainers do this in `main`).
#[test]
fn an_error_return_reaches_the_report_through_the_error_file() {
    let dir = tempfile::tempdir().unwrap();
    let hello = rsrun_tests::bin("hello");
    let out = run(rsrun(dir.path()).arg(&hello).args(["--exit-rank", "garbage"]));
    assert_eq!(code(&out.status), 1, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("error      : --exit-rank expects RANK:CODE"), "{stderr}");
}

/// rsrun's own TORCHELASTIC_ERROR_FILE gets the root cause's error file with `message.errorCode`
/// (torchrun's `@record` on the launcher; TorchX reads it); the workers keep their own files.
#[test]
fn root_cause_is_copied_to_the_launchers_error_file() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("parent_error.json");
    let script = r#"if [ $RANK = 1 ]; then printf '{"message": {"message": "ValueError: bad shard", "extraInfo": {"py_callstack": "Traceback: x", "timestamp": "%s"}}}' "$(date +%s)" > "$TORCHELASTIC_ERROR_FILE"; exit 3; fi; sleep 30"#;
    let out = run(rsrun(dir.path()).env("TORCHELASTIC_ERROR_FILE", &parent).args(["--nproc-per-node", "2", "sh", "-c", script]));
    assert_eq!(code(&out.status), 3, "{}", text(&out));
    let raw = std::fs::read(&parent).unwrap_or_else(|e| panic!("{}: {e}\n{}", parent.display(), text(&out)));
    let v: serde_json::Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(v["message"]["message"], "ValueError: bad shard", "{v}");
    assert_eq!(v["message"]["extraInfo"]["py_callstack"], "Traceback: x", "{v}");
    assert_eq!(v["message"]["errorCode"], 3, "{v}");
}
