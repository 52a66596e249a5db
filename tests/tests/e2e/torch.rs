//! PyTorch compatibility: an unmodified `init_process_group("gloo")` with the default env:// init runs
//! across two nodes. Runs when `python3 -c 'import torch'` works (or RSRUN_TEST_PYTHON points at such
//! an interpreter; `scripts/test-torch.sh` makes one); skipped with a message otherwise.

use rsrun_tests::{Daemon, KillOnDrop, RUN_DEADLINE, code, python_with_torch, rsrun, text};

const SCRIPT: &str = include_str!("../../python/allreduce.py");

#[test]
fn gloo_all_reduce_across_two_nodes() {
    let Some(python) = python_with_torch() else {
        eprintln!("skipped: torch is not importable (run scripts/test-torch.sh to make a venv with torch)");
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
