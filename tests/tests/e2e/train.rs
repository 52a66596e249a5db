//! The `train` job end to end: through the daemon with two nodes of two workers each, every strategy
//! trains (the loss falls), deterministic reductions make every strategy and a single process with
//! the same global batch agree bit for bit, the JSON log parses, and bad flags exit 2.

use std::path::Path;
use std::process::{Command, Output};

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, bin, code, rsrun, text};

/// A tiny model so each run takes about a second.
const MODEL: &[&str] = &["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch", "2", "--steps", "8", "--lr", "3e-3", "--warmup", "2"];

fn node(dir: &Path, daemon: &Daemon, job: &str, extra: &[&str]) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"])
        .arg(&daemon.addr)
        .args(["--rdzv-id", job, "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60"])
        .arg(bin("train"))
        .args(MODEL)
        .args(extra);
    KillOnDrop::spawn(&mut cmd)
}

/// Runs one job on two nodes and returns rank 0's node output.
fn two_nodes(dir: &Path, daemon: &Daemon, job: &str, extra: &[&str]) -> String {
    let a = node(dir, daemon, job, extra);
    let b = node(dir, daemon, job, extra);
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE));
    let ob = b.output_within(RUN_DEADLINE);
    let oa = ta.join().unwrap();
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    String::from_utf8_lossy(&oa.stdout).into_owned() + &String::from_utf8_lossy(&ob.stdout)
}

fn summary_field(out: &str, key: &str) -> String {
    let line = out.lines().find(|l| l.contains("summary: ")).unwrap_or_else(|| panic!("no summary line in:\n{out}"));
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        .to_string()
}

fn json_losses(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| l.find('{').map(|i| &l[i..]))
        .filter_map(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .filter(|v| v["event"] == "step")
        .map(|v| v["loss"].as_f64().expect("numeric loss"))
        .collect()
}

#[test]
fn every_strategy_trains_and_deterministic_runs_agree_with_one_process() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    // One process with the same global batch: batch 2 × grad-accum 4 × world 1 = 2 × 1 × 4.
    let single = Command::new(bin("train")).current_dir(dir.path()).args(MODEL).args(["--grad-accum", "4", "--deterministic"]).output().unwrap();
    assert_eq!(code(&single.status), 0, "{}", text(&single));
    let reference = summary_field(&String::from_utf8_lossy(&single.stdout), "params_sha256");
    for strategy in ["ddp", "zero1", "zero2", "zero3", "fsdp", "hybrid"] {
        let out = two_nodes(dir.path(), &daemon, &format!("train-{strategy}"), &["--strategy", strategy, "--deterministic", "--log-format", "json"]);
        let losses = json_losses(&out);
        assert_eq!(losses.len(), 8, "{strategy}: one JSON line per step:\n{out}");
        assert!(losses[7] < losses[0], "{strategy}: loss did not fall: {losses:?}");
        assert_eq!(summary_field(&out, "world"), "4");
        assert_eq!(summary_field(&out, "params_sha256"), reference, "{strategy} differs from the single-process reference");
    }
}

#[test]
fn json_log_lines_all_parse() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(bin("train")).current_dir(dir.path()).args(MODEL).args(["--log-format", "json"]).output().unwrap();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in stdout.lines().filter(|l| !l.starts_with("summary: ")) {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("not JSON: {line:?}: {e}"));
    }
    let metrics = std::fs::read_to_string(dir.path().join(".rsrun/runs/local/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 8);
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["loss"].is_number() && v["step_ms"].is_number());
    }
    let svg = std::fs::read_to_string(dir.path().join(".rsrun/runs/local/loss.svg")).unwrap();
    assert!(svg.contains("<polyline"));
}

#[test]
fn bad_flags_exit_2_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--strategy", "zero9"], "unknown --strategy \"zero9\""),
        (&["--steps", "0"], "--steps"),
        (&["--d-model", "30", "--heads", "4"], "--heads 4 does not divide --d-model 30"),
        (&["--data", "/no/such/file"], "neither `synthetic` nor a readable file"),
    ];
    for (args, expected) in cases {
        let out: Output = Command::new(bin("train")).current_dir(dir.path()).args(*args).output().unwrap();
        assert_eq!(code(&out.status), 2, "{args:?}: {}", text(&out));
        assert!(text(&out).contains(expected), "{args:?}: expected {expected:?} in:\n{}", text(&out));
    }
}
