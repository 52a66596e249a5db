//! Kubernetes without a cluster (multinode.md §5.6): two real `rsrun` processes on loopback, each with
//! only what the operator writes into a pod (`PET_*`, and for PyTorchJob v1 also `MASTER_*`, `RANK`,
//! `WORLD_SIZE`), and no rsrun flags but the program. Node rank 1's pod starts first: it waits for
//! node rank 0, saying so, and the two form one job.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rsrun_tests::{KillOnDrop, code, free_port, text};

use crate::slurm::{DUMP_ENV, all, clean_rsrun, dumped_envs};

/// Operator flavours.
#[derive(Clone, Copy)]
enum Operator {
    /// training-operator v1 PyTorchJob: `PET_*` plus `MASTER_ADDR`/`MASTER_PORT`, and the node-level
    /// `RANK` and `WORLD_SIZE` (KF#1790).
    PyTorchJobV1,
    /// Trainer v2 TrainJob: `PET_*` only (plus whatever the image leaves behind).
    TrainJobV2,
}

fn pod(dir: &Path, op: Operator, port: u16, node_rank: u32) -> KillOnDrop {
    let mut cmd = clean_rsrun(dir);
    cmd.env("PET_NNODES", "2")
        .env("PET_NPROC_PER_NODE", "2")
        .env("PET_NODE_RANK", node_rank.to_string())
        .env("PET_MASTER_ADDR", "127.0.0.1")
        .env("PET_MASTER_PORT", port.to_string());
    match op {
        Operator::PyTorchJobV1 => {
            cmd.env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RANK", node_rank.to_string())
                .env("WORLD_SIZE", "4")
                .env("PYTHONUNBUFFERED", "1");
        }
        Operator::TrainJobV2 => {
            // Garbage the image may carry: ignored for planning, overwritten for the workers.
            cmd.env("RANK", "1").env("WORLD_SIZE", "4").env("LOCAL_RANK", "3").env("MASTER_PORT", "1");
        }
    }
    cmd.args(DUMP_ENV);
    KillOnDrop::spawn(&mut cmd)
}

fn run_pair(op: Operator) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let sub = |name: &str| -> PathBuf {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        d
    };
    let (d0, d1) = (sub("pod0"), sub("pod1"));
    // Node rank 1's pod first; node rank 0's pod a few seconds later.
    let p1 = pod(&d1, op, port, 1);
    std::thread::sleep(Duration::from_secs(3));
    let p0 = pod(&d0, op, port, 0);
    let outs = all(vec![p0, p1]);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    let stderr1 = String::from_utf8_lossy(&outs[1].stderr);
    assert!(
        stderr1.contains(&format!("waiting for 127.0.0.1:{port} (connection refused)")),
        "node rank 1 says what it waits for:\n{}",
        text(&outs[1])
    );
    let stderr0 = String::from_utf8_lossy(&outs[0].stderr);
    assert!(stderr0.contains("ignored RANK="), "{}", text(&outs[0]));
    let mut ranks = Vec::new();
    for (n, d) in [(0u32, &d0), (1, &d1)] {
        let envs = dumped_envs(d);
        assert_eq!(envs.len(), 2, "pod {n} runs 2 workers: {:?}", envs.keys());
        for env in envs.values() {
            let get = |k: &str| env.get(k).map(String::as_str).unwrap_or("");
            let rank: u32 = get("RANK").parse().unwrap();
            ranks.push(rank);
            assert_eq!(rank / 2, n, "pod {n} runs ranks {} and {}", 2 * n, 2 * n + 1);
            assert_eq!(get("LOCAL_RANK"), (rank % 2).to_string());
            assert_eq!(get("GROUP_RANK"), n.to_string());
            assert_eq!(get("WORLD_SIZE"), "4");
            assert_eq!(get("LOCAL_WORLD_SIZE"), "2");
            assert_eq!(get("MASTER_ADDR"), "127.0.0.1");
            assert_eq!(get("TORCHELASTIC_RUN_ID"), "k8s-127.0.0.1");
            let master_port = get("MASTER_PORT");
            assert!(!master_port.is_empty() && master_port != "1", "{master_port}");
            assert_eq!(master_port, port.to_string(), "the store is served at PET_MASTER_PORT, beside the rendezvous");
        }
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
}

#[test]
fn pytorchjob_v1_static_pair_forms_one_job_whichever_pod_starts_first() {
    run_pair(Operator::PyTorchJobV1);
}

#[test]
fn trainjob_v2_pair_with_pet_variables_only_forms_one_job() {
    run_pair(Operator::TrainJobV2);
}
