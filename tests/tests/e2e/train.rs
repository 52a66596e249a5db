//! The `train` job end to end: through the daemon with two nodes of two workers each, every strategy
//! trains (the loss falls), deterministic reductions make every strategy and a single process with
//! the same global batch agree bit for bit, the JSON log parses, and bad flags exit 2.

use std::path::Path;
use std::process::{Command, Output};

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, bin, code, rsrun, text};

/// A tiny model so each run takes about a second.
const MODEL: &[&str] = &["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch", "2", "--steps", "8", "--lr", "3e-3", "--warmup", "2"];

fn node(dir: &Path, daemon: &Daemon, job: &str, launcher: &[&str], extra: &[&str]) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"])
        .arg(&daemon.addr)
        .args(["--rdzv-id", job, "--rdzv-conf", "last_call_timeout=0.5,join_timeout=60"])
        .args(launcher)
        .arg(bin("train"))
        .args(MODEL)
        .args(extra);
    KillOnDrop::spawn(&mut cmd)
}

/// Runs one job on two nodes (with extra launcher flags, then extra train flags) and returns both
/// nodes' output.
fn two_nodes(dir: &Path, daemon: &Daemon, job: &str, launcher: &[&str], extra: &[&str]) -> String {
    let a = node(dir, daemon, job, launcher, extra);
    let b = node(dir, daemon, job, launcher, extra);
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE));
    let ob = b.output_within(RUN_DEADLINE);
    let oa = ta.join().unwrap();
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    String::from_utf8_lossy(&oa.stdout).into_owned() + &String::from_utf8_lossy(&ob.stdout)
}

fn summary_field(out: &str, key: &str) -> String {
    let line = out.lines().find(|l| l.contains("summary: ")).unwrap_or_else(|| panic!("no summary line in:\n{out}"));
    rsrun_tests::field(line, key).unwrap_or_else(|| panic!("no {key} in {line}")).to_string()
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
        let out = two_nodes(dir.path(), &daemon, &format!("train-{strategy}"), &[], &["--strategy", strategy, "--deterministic", "--log-format", "json"]);
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

/// The huge-page allocator's switch takes its usual spellings and refuses anything else before
/// `train` starts.
#[test]
fn bad_huge_page_switch_exits_2_naming_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let out: Output = Command::new(bin("train")).current_dir(dir.path()).env("RSRUN_HUGE_PAGES", "banana").args(MODEL).output().unwrap();
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("RSRUN_HUGE_PAGES=banana is not a huge-page switch (expected 0, off"), "{}", text(&out));
    for value in ["0", "on"] {
        let out: Output = Command::new(bin("train")).current_dir(dir.path()).env("RSRUN_HUGE_PAGES", value).args(MODEL).output().unwrap();
        assert_eq!(code(&out.status), 0, "RSRUN_HUGE_PAGES={value}: {}", text(&out));
    }
}

/// Checkpoint/restart: rank 1 aborts before step 8 in the first attempt only (the hidden
/// `--fail-at-step` test hook); rsrun restarts the job, which resumes from the checkpoint of step 6
/// (saved every 3 steps) and ends with the same parameters as an uninterrupted run.
#[test]
fn killed_worker_restarts_from_the_last_checkpoint_with_identical_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let model = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32", "--batch", "2", "--steps", "12", "--lr", "3e-3", "--warmup", "2", "--deterministic"];
    let train = |extra: &[&str]| {
        let out = rsrun_tests::run(rsrun(dir.path()).args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]).arg(bin("train")).args(model).args(["--strategy", "zero2"]).args(extra));
        assert_eq!(code(&out.status), 0, "{extra:?}: {}", text(&out));
        out
    };
    let plain = train(&["--run-dir", "plain"]);
    let want = summary_field(&String::from_utf8_lossy(&plain.stdout), "params_sha256");

    let ckpt = dir.path().join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap();
    let out = train(&["--run-dir", "restarted", "--checkpoint-dir", ckpt_arg, "--checkpoint-every", "3", "--fail-at-step", "8"]);
    let all = text(&out);
    assert!(all.contains("--fail-at-step 8: rank 1 aborts"), "{all}");
    assert!(all.contains("restarting the job (restart 1 of 1)"), "{all}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("at step 6 (restart 1)"), "resumed from step 6:\n{stdout}");
    assert_eq!(summary_field(&stdout, "resumed_from_step"), "6");
    assert_eq!(summary_field(&stdout, "params_sha256"), want, "the restarted run differs from the uninterrupted one");
    // metrics.jsonl holds every step exactly once, in order, across the two attempts.
    let metrics = std::fs::read_to_string(dir.path().join("restarted/metrics.jsonl")).unwrap();
    let steps: Vec<u64> = metrics.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=12).collect::<Vec<_>>(), "{metrics}");
    // The newest checkpoints (keep 2): steps 9 and 12.
    let latest = std::fs::read_to_string(ckpt.join("latest")).unwrap();
    assert_eq!(latest.trim(), "step-000000012");
    assert!(ckpt.join("step-000000009").is_dir() && !ckpt.join("step-000000006").exists());

    // Resuming the finished run does no step and keeps the parameters; another strategy and world
    // size load the same checkpoint (resharding) and agree too.
    let single = Command::new(bin("train")).current_dir(dir.path()).args(model).args(["--strategy", "zero3", "--grad-accum", "2", "--resume", ckpt_arg, "--run-dir", "single"]).output().unwrap();
    assert_eq!(code(&single.status), 0, "{}", text(&single));
    assert_eq!(summary_field(&String::from_utf8_lossy(&single.stdout), "params_sha256"), want);
}

/// `train` of [`MODEL`] in `dir`, checkpointing every 4 steps into `dir/ck` (and resuming from
/// the latest there).
fn checkpointed_run(dir: &Path) -> Output {
    Command::new(bin("train")).current_dir(dir).args(MODEL).args(["--checkpoint-dir", "ck", "--checkpoint-every", "4"]).output().unwrap()
}

/// A run resumed at its last step trains nothing and says so (`na`, not NaN); a `latest` that
/// names a checkpoint without its metadata fails the resume naming the file, instead of training
/// again from an older checkpoint or from step 0.
#[test]
fn resume_at_the_end_and_a_damaged_latest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run = || checkpointed_run(dir.path());
    let out = run();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let out = run();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(summary_field(&stdout, "resumed_from_step"), "8", "{stdout}");
    assert_eq!(summary_field(&stdout, "tok_per_s_total"), "na", "{stdout}");
    std::fs::remove_file(dir.path().join("ck/step-000000008/metadata.json")).unwrap();
    let out = run();
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    assert!(text(&out).contains("step-000000008/metadata.json") && text(&out).contains("damaged"), "{}", text(&out));
}

/// A checkpoint resumes only the data order it was saved with: another --seed or other data is
/// refused with exit 2, each difference named; the same global batch over other shapes (batch 1 ×
/// grad-accum 2) resumes, and so does another global batch (another world size: the data goes on
/// from the samples the checkpoint's run consumed, with a note).
#[test]
fn a_resume_with_another_data_order_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = checkpointed_run(dir.path());
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    std::fs::write(dir.path().join("other.txt"), vec![b'x'; 10_000]).unwrap();
    let cases: [(&[&str], &str); 2] = [(&["--seed", "9"], "--seed 9 (the checkpoint's is"), (&["--data", "other.txt"], "other data (fingerprint")];
    // MODEL with `extra`'s flags in place of its own.
    let resume = |extra: &[&str]| {
        let mut args = model_with_steps("12");
        for pair in extra.chunks(2) {
            match args.iter().position(|a| *a == pair[0]) {
                Some(at) => args[at + 1] = pair[1],
                None => args.extend_from_slice(pair),
            }
        }
        Command::new(bin("train")).current_dir(dir.path()).args(args).args(["--resume", "ck"]).output().unwrap()
    };
    for (extra, want) in cases {
        let out = resume(extra);
        assert_eq!(code(&out.status), 2, "{extra:?}: {}", text(&out));
        assert!(text(&out).contains("cannot resume from") && text(&out).contains(want), "{extra:?}: {}", text(&out));
    }
    let out = resume(&["--batch", "1", "--grad-accum", "2"]);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert_eq!(summary_field(&String::from_utf8_lossy(&out.stdout), "resumed_from_step"), "8");
    assert!(!text(&out).contains("the checkpoint's run had"), "{}", text(&out));
    // The checkpoint of step 8 records the 16 samples its run consumed: a run at a global batch
    // of 4 resumes from there.
    let out = resume(&["--batch", "4"]);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert_eq!(summary_field(&String::from_utf8_lossy(&out.stdout), "resumed_from_step"), "8");
    assert!(
        text(&out).contains("a global batch of 4 samples (the checkpoint's run had 2): the data goes on from the samples it consumed"),
        "{}",
        text(&out)
    );
}

/// Ranks that read different data (a node's copy of --data differs; here each local rank its
/// own file) fail at once, naming both ranks and the fingerprints, instead of training on
/// samples the others never see.
#[test]
fn ranks_reading_different_data_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data_0.txt"), vec![b'a'; 20_000]).unwrap();
    std::fs::write(dir.path().join("data_1.txt"), vec![b'b'; 20_000]).unwrap();
    let mut cmd = rsrun(dir.path());
    cmd.args(["--standalone", "--nproc-per-node", "2"]).arg(bin("train")).args(MODEL).args(["--data", "data_${local_rank}.txt"]);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    let t = text(&out);
    assert!(t.contains("reads the data otherwise than rank") && t.contains("other data (fingerprint"), "{t}");
    // The same file on every rank trains.
    let mut cmd = rsrun(dir.path());
    cmd.args(["--standalone", "--nproc-per-node", "2"]).arg(bin("train")).args(MODEL).args(["--data", "data_0.txt"]);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    // Ranks with another --steps (which decides which collectives each step runs) are named too,
    // before the first step.
    let mut cmd = rsrun(dir.path());
    cmd.args(["--standalone", "--nproc-per-node", "2"]).arg(bin("train")).args(model_with_steps("1${local_rank}"));
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    assert!(text(&out).contains("runs another loop than rank") && text(&out).contains("--steps 1"), "{}", text(&out));
}

/// A checkpoint's data position is where the sampler resumes: one behind the checkpoint's own
/// optimizer step is damage, and one beyond `--steps` is named as the position it is, next to
/// the step, instead of being reported as the step.
#[test]
fn a_damaged_data_position_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = || checkpointed_run(dir.path());
    let out = run();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let meta = dir.path().join("ck/step-000000008/metadata.json");
    let good = std::fs::read_to_string(&meta).unwrap();
    // `checksum: false` drops metadata.json's checksum (as a checkpoint of an older rsrun has
    // none), so that what train itself checks is reached.
    let set = |position: u64, checksum: bool| {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        assert_eq!(v["data_position"], 8, "{good}");
        v["data_position"] = position.into();
        if !checksum {
            v.as_object_mut().unwrap().remove("checksum");
        }
        std::fs::write(&meta, v.to_string()).unwrap();
    };
    // With its checksum, the edit is damage to the file.
    set(3, true);
    let out = run();
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    assert!(text(&out).contains("metadata.json") && text(&out).contains("checksum mismatch"), "{}", text(&out));
    set(3, false);
    let out = run();
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(text(&out).contains("data_position 3 is behind its optimizer step 8"), "{}", text(&out));
    set(u64::MAX, false);
    let out = run();
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    assert!(
        text(&out).contains(&format!("was saved after step {} (its data_position; optimizer step 8), beyond --steps 8", u64::MAX)),
        "{}",
        text(&out)
    );
}

#[test]
fn bad_checkpoint_and_offload_flags_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let under_file = file.join("ckpt");
    let nvme_dir = dir.path().join("nvme");
    let cases: Vec<(Vec<&str>, String)> = vec![
        (vec!["--offload", "nvme"], "--offload nvme needs --nvme-path DIR".into()),
        (vec!["--offload", "disk"], "unknown --offload \"disk\"".into()),
        (vec!["--precision", "fp8"], "unknown --precision \"fp8\"".into()),
        (vec!["--checkpoint-every", "3"], "--checkpoint-every 3 needs --checkpoint-dir".into()),
        (vec!["--checkpoint-dir", under_file.to_str().unwrap()], format!("--checkpoint-dir {}: cannot create directory", under_file.display())),
        (vec!["--resume", "/no/such/ckpt"], "--resume \"/no/such/ckpt\": no such checkpoint".into()),
        (
            vec!["--offload", "nvme", "--nvme-path", nvme_dir.to_str().unwrap(), "--nvme-io-timeout", "0"],
            "--nvme-io-timeout 0: offload: io_timeout 0ns: expected from 1ms to 86400s".into(),
        ),
        (vec!["--nvme-io-timeout", "30"], "--nvme-io-timeout is only used with --offload nvme (got --offload none)".into()),
    ];
    for (args, expected) in &cases {
        let out: Output = Command::new(bin("train")).current_dir(dir.path()).args(MODEL).args(args).output().unwrap();
        assert_eq!(code(&out.status), 2, "{args:?}: {}", text(&out));
        assert!(text(&out).contains(expected.as_str()), "{args:?}: expected {expected:?} in:\n{}", text(&out));
    }
}

#[test]
fn bf16_and_offloaded_training_runs_and_offload_is_bitwise_identical() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    let hash = |extra: &[&str]| {
        let out = Command::new(bin("train")).current_dir(dir.path()).args(MODEL).args(["--deterministic", "--strategy", "zero3"]).args(extra).output().unwrap();
        assert_eq!(code(&out.status), 0, "{extra:?}: {}", text(&out));
        summary_field(&String::from_utf8_lossy(&out.stdout), "params_sha256")
    };
    let base = hash(&[]);
    assert_eq!(hash(&["--offload", "cpu"]), base);
    assert_eq!(hash(&["--offload", "nvme", "--nvme-path", nvme.to_str().unwrap()]), base);
    let bf16 = hash(&["--precision", "bf16"]);
    assert_ne!(bf16, base);
    assert_eq!(hash(&["--precision", "bf16", "--offload", "cpu"]), bf16);
}

/// The same restart-and-resume through the daemon with two nodes of two workers each: rank 1 (on the
/// first node) aborts before step 8 in the first round; both nodes restart from the checkpoint of
/// step 6 and end with the parameters of an uninterrupted run.
#[test]
fn killed_worker_on_one_of_two_nodes_restarts_both_from_the_checkpoint() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ckpt_arg = ckpt.to_str().unwrap().to_string();
    let plain = two_nodes(dir.path(), &daemon, "resume-plain", &[], &["--strategy", "zero3", "--deterministic", "--run-dir", "plain"]);
    let want = summary_field(&plain, "params_sha256");
    let restarted = two_nodes(
        dir.path(),
        &daemon,
        "resume-killed",
        &["--max-restarts", "1"],
        &["--strategy", "zero3", "--deterministic", "--run-dir", "restarted", "--checkpoint-dir", &ckpt_arg, "--checkpoint-every", "3", "--fail-at-step", "6"],
    );
    assert_eq!(summary_field(&restarted, "resumed_from_step"), "3", "{restarted}");
    assert_eq!(summary_field(&restarted, "world"), "4");
    assert_eq!(summary_field(&restarted, "params_sha256"), want, "the restarted two-node run differs from the uninterrupted one");
}

/// The tiny model of [`MODEL`] for `steps` steps.
/// `train` sends rsrun's progress heartbeat every step (rsrun watches only workers that sent one),
/// so a rank that stops making progress mid-run is found by `--hang-timeout` and the job ends
/// with 124 instead of waiting out the collectives' timeout.
#[test]
fn a_train_rank_that_stops_making_progress_is_found_by_the_hang_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let out = rsrun_tests::run(
        rsrun(dir.path())
            .args(["--standalone", "--nproc-per-node", "2", "--hang-timeout", "3s", "--monitor-interval", "0.1"])
            .arg(bin("train"))
            .args(model_with_steps("40"))
            .args(["--hang-at-step", "4"]),
    );
    let all = text(&out);
    assert_eq!(code(&out.status), 124, "{all}");
    assert!(all.contains("--hang-at-step 4: rank 1 stops making progress"), "{all}");
    assert!(all.contains("hung: no progress for"), "{all}");
}

/// SIGUSR1 (Slurm's `--signal` warning, which rsrun passes on) makes every rank of `train` save a
/// checkpoint at the same next step, and training goes on to the end: the default action of the
/// signal used to end the job it warned.
#[test]
fn sigusr1_checkpoints_at_the_next_step_and_training_goes_on() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut child = KillOnDrop::spawn(
        rsrun(dir.path())
            .args(["--standalone", "--nproc-per-node", "2"])
            .arg(bin("train"))
            .args(model_with_steps("600"))
            .args(["--checkpoint-dir", "ck", "--log-format", "json"]),
    );
    let stdout = child.0.stdout.take().unwrap();
    let stderr = child.0.stderr.take().unwrap();
    let err_reader = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let mut lines = std::io::BufReader::new(stdout).lines();
    let mut out = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        out.push_str(&line);
        out.push('\n');
        if line.contains("\"event\":\"step\"") {
            break;
        }
    }
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(child.pid(), libc::SIGUSR1) };
    for line in lines {
        out.push_str(&line.unwrap());
        out.push('\n');
    }
    let status = child.0.wait().unwrap();
    let err = err_reader.join().unwrap();
    assert_eq!(code(&status), 0, "{out}{err}");
    assert!(err.contains("on SIGUSR1/SIGUSR2"), "{err}");
    let steps: Vec<String> = std::fs::read_dir(dir.path().join("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step-") && n != "step-000000600")
        .collect();
    assert!(!steps.is_empty(), "no checkpoint before the end: {err}");
}

fn model_with_steps(steps: &str) -> Vec<&str> {
    let mut args: Vec<&str> = MODEL.to_vec();
    let at = args.iter().position(|a| *a == "--steps").unwrap();
    args[at + 1] = steps;
    args
}

/// A warmup as long as the run never reaches the learning rate asked for: `train` says so (a
/// note, not an error: the run is still valid), and says nothing for an ordinary warmup.
#[test]
fn a_warmup_as_long_as_the_run_is_noted() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = model_with_steps("3");
    let at = args.iter().position(|a| *a == "--warmup").unwrap();
    args[at + 1] = "5";
    let out = Command::new(bin("train")).current_dir(dir.path()).args(&args).output().unwrap();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(text(&out).contains("train: note: --warmup 5 is not below --steps 3"), "{}", text(&out));
    let out = Command::new(bin("train")).current_dir(dir.path()).args(model_with_steps("3")).output().unwrap();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(!text(&out).contains("--warmup"), "{}", text(&out));
}

/// Rank 0 of `train` under rsrun draws its bar as carriage-return updates on stderr: rsrun prints
/// them on a pipe as plain lines with the rank prefix (at most one a second, the final state
/// always), no `\r` reaches rsrun's output, and the rank's log file keeps every raw update. Alone
/// on a pipe, `train` prints plain lines on stdout and no `\r` at all.
#[test]
fn train_progress_is_carriage_return_updates_under_rsrun_and_plain_lines_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = rsrun(dir.path());
    cmd.args(["--standalone", "--nproc-per-node", "2"]).arg(bin("train")).args(model_with_steps("300"));
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains('\r'), "{stderr:?}");
    let bar: Vec<&str> = stderr.lines().filter(|l| l.contains("] step ")).collect();
    assert!(bar.iter().all(|l| l.starts_with("[rank 0] [")), "only rank 0 draws, prefixed: {bar:?}");
    assert!(bar.last().is_some_and(|l| l.starts_with("[rank 0] [####################] step 300/300 loss ")), "{bar:?}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("] step "), "no plain progress lines under rsrun: {}", text(&out));
    // The log file of rank 0 has the raw updates: "\r" + the line, a newline after the last.
    let logs = dir.path().join(".rsrun/logs");
    let job = std::fs::read_dir(&logs).unwrap().next().unwrap().unwrap().path();
    let attempt = std::fs::read_dir(&job).unwrap().next().unwrap().unwrap().path();
    let raw = std::fs::read_to_string(attempt.join("0/stderr.log")).unwrap();
    let updates: Vec<&str> = raw.split('\r').filter(|s| s.contains("] step ")).collect();
    assert!(updates.len() >= 2, "{raw:?}");
    assert!(updates[0].starts_with("[--------------------] step 1/300 "), "{raw:?}");
    assert!(updates.last().is_some_and(|u| u.contains("] step 300/300 ") && u.ends_with('\n')), "{raw:?}");
    assert!(!std::fs::read_to_string(attempt.join("1/stderr.log")).unwrap().contains('\r'), "rank 1 draws nothing");

    // Alone, on a pipe: lines on stdout every 5 % (20 of them for 300 steps), nothing with "\r".
    let alone = Command::new(bin("train")).current_dir(dir.path()).env_remove("RSRUN_JOB_ID").args(model_with_steps("300")).output().unwrap();
    assert_eq!(code(&alone.status), 0, "{}", text(&alone));
    let stdout = String::from_utf8_lossy(&alone.stdout);
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("] step ")).collect();
    assert_eq!(lines.len(), 20, "{stdout}");
    assert!(lines[19].starts_with("[####################] step 300/300 loss "), "{stdout}");
    assert!(!stdout.contains('\r') && !String::from_utf8_lossy(&alone.stderr).contains('\r'), "{}", text(&alone));
}

/// On a terminal (a pseudo-terminal from `script`, where the tool exists) rsrun draws `train`'s
/// updates in place, then leaves the final state as an ordinary line.
#[test]
fn train_progress_renders_in_place_under_rsrun_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` command to run rsrun on a pseudo-terminal");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let transcript = dir.path().join("typescript");
    let inner = format!(
        "{} --standalone --nproc-per-node 1 {} {}",
        bin("rsrun").display(),
        bin("train").display(),
        model_with_steps("300").join(" ")
    );
    let mut cmd = Command::new("script");
    cmd.current_dir(dir.path()).env("TERM", "xterm").args(["-qec", &inner]).arg(&transcript);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let raw = String::from_utf8_lossy(&std::fs::read(&transcript).unwrap()).into_owned();
    // An update drawn in place (wrapping off), then the final state as a line of its own.
    assert!(raw.contains("\x1b[?7l[rank 0] [--------------------] step 1/300 loss "), "{raw:?}");
    assert!(raw.contains("\r\x1b[J[rank 0] [####################] step 300/300 loss "), "{raw:?}");
}

/// A model the host cannot hold is refused before anything is allocated, with what it needs and
/// what the host has, instead of aborting on a failed allocation.
#[test]
fn a_model_too_big_for_the_host_is_refused_with_figures() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(bin("train"))
        .current_dir(dir.path())
        .args(["--d-model", "8192", "--layers", "256", "--heads", "64", "--steps", "1"])
        .output()
        .unwrap();
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let all = text(&out);
    assert!(all.contains("the model needs at least") && all.contains(" parameters: parameters "), "{all}");
    assert!(all.contains("available (MemAvailable + SwapFree") && all.contains("--offload nvme"), "{all}");
}
