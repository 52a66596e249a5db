//! PyTorch compatibility: an unmodified `init_process_group("gloo")` with the default env:// init runs
//! across two nodes. Runs when `python3 -c 'import torch'` works (or RSRUN_TEST_PYTHON points at such
//! an interpreter; `scripts/torch-venv.sh` makes one); skipped with a message otherwise.

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, code, python_with_torch, rsrun, text};

const SCRIPT: &str = include_str!("../../python/allreduce.py");

#[test]
fn gloo_all_reduce_across_two_nodes() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/torch-venv.sh to make a venv with torch)");
        return;
    };
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("allreduce.py"), SCRIPT).unwrap();
    let spawn = || {
        let mut cmd = rsrun(dir.path());
        cmd.env("PYTHON_EXEC", &python)
            .args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint"])
            .arg(&daemon.addr)
            .args(["--rdzv-id", "torch-gloo", "allreduce.py"]);
        KillOnDrop::spawn(&mut cmd)
    };
    let (a, b) = (spawn(), spawn());
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE * 3));
    let ob = b.output_within(RUN_DEADLINE * 3);
    let oa = ta.join().unwrap();
    let all = String::from_utf8_lossy(&oa.stdout).into_owned() + &String::from_utf8_lossy(&ob.stdout);
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    for r in 0..4 {
        assert!(all.contains(&format!("allreduce ok rank={r} world=4 sum=10.0")), "{all}");
    }
}

/// A gloo DDP step, then rank 0 leaves first; rank 1 keeps using the job's store afterwards. Under
/// torchrun without the agent store this fails with "Connection reset by peer" (the store lived in
/// rank 0); rsrun serves PyTorch's store itself for the whole job.
const RANK0_EXITS_FIRST: &str = r#"
import os, time, datetime, torch, torch.distributed as dist
assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
store = dist.distributed_c10d._get_default_store()
if rank == 0:
    store.set("from_rank0", "bye")
    print("rank 0 exits first", flush=True)
    os._exit(0)
time.sleep(1.5)
assert store.get("from_rank0") == b"bye"
store.set("late", "1")
store.barrier("after_rank0", 1, datetime.timedelta(seconds=10))
assert store.get("late") == b"1"
print("rank 1 used the store after rank 0 exited", flush=True)
"#;

#[test]
fn store_outlives_rank_0() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/torch-venv.sh to make a venv with torch)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rank0_first.py"), RANK0_EXITS_FIRST).unwrap();
    let mut cmd = rsrun(dir.path());
    cmd.env("PYTHON_EXEC", &python).args(["--standalone", "--nproc-per-node", "2", "rank0_first.py"]);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE * 3);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("rank 1 used the store after rank 0 exited"), "{}", text(&out));
}

/// Attempt 0 writes a key and fails; attempt 1 must start from an empty store.
const FRESH_KEYSPACE: &str = r#"
import os, sys, torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
store = dist.distributed_c10d._get_default_store()
seen = [k for k in store.list_keys() if k.startswith("attempt")]
print(f"rank {dist.get_rank()} attempt {attempt} sees {seen}", flush=True)
dist.barrier()
store.set(f"attempt{attempt}_rank{dist.get_rank()}", "x")
dist.barrier()
if attempt == 0:
    sys.exit(3)
assert not any(k.startswith("attempt0") for k in store.list_keys()), store.list_keys()
"#;

#[test]
fn every_attempt_gets_a_fresh_store() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/torch-venv.sh to make a venv with torch)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("fresh.py"), FRESH_KEYSPACE).unwrap();
    let mut cmd = rsrun(dir.path());
    cmd.env("PYTHON_EXEC", &python).args(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "fresh.py"]);
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE * 3);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..2 {
        assert!(stdout.contains(&format!("rank {r} attempt 0 sees []")), "{}", text(&out));
        assert!(stdout.contains(&format!("rank {r} attempt 1 sees []")), "{}", text(&out));
    }
}

/// torch's own TCPStore client against our server, side by side with torch's libuv server
/// (`tests/python/test_tcpstore_conformance.py`: an expectation that fails on torch's server is wrong).
#[test]
fn torch_client_conformance_against_our_tcpstore() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/torch-venv.sh to make a venv with torch)");
        return;
    };
    let have_pytest = std::process::Command::new(&python).args(["-c", "import pytest"]).status().is_ok_and(|s| s.success());
    if !have_pytest {
        assert!(std::env::var_os("RSRUN_TEST_PYTHON").is_none(), "{} has torch but no pytest: scripts/torch-venv.sh installs both", python.display());
        eprintln!("skipped: pytest is not importable from {}", python.display());
        return;
    }
    let suite = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/test_tcpstore_conformance.py");
    let mut cmd = std::process::Command::new(&python);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&suite)
        .env("RSRUN_RENDEZVOUS", rsrun_tests::bin("rsrun-rendezvous"));
    let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE * 5);
    let report = text(&out);
    assert_eq!(code(&out.status), 0, "{report}");
    // Both servers ran every case (the one torch's server fails by design is skipped there).
    assert!(String::from_utf8_lossy(&out.stdout).contains(" passed"), "{report}");
}

/// PyTorch's own store tests (`tests/python/torch_store_tests/`, unmodified files of PyTorch v2.6.0)
/// through `tests/python/run_torch_store_tests.py`: the 41 tests that exercise a TCPStore server,
/// first on torch's own servers (the reference for this torch version; a test that fails there is
/// retried once, alone, for torch's non-libuv server loses a wake-up under load), then on rsrun's,
/// one fresh store per store the tests ask for.
#[test]
fn torch_own_store_tests_pass_against_our_tcpstore() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/torch-venv.sh to make a venv with torch)");
        return;
    };
    let runner = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/run_torch_store_tests.py");
    for server in ["torch", "rsrun"] {
        let mut cmd = std::process::Command::new(&python);
        cmd.arg(&runner).args(["--server", server]).env("RSRUN_RENDEZVOUS", rsrun_tests::bin("rsrun-rendezvous"));
        let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE * 5);
        let report = text(&out);
        assert_eq!(code(&out.status), 0, "{server}: {report}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.lines().any(|l| l == "41 passed, 0 failed"), "{server}: {report}");
    }
}
