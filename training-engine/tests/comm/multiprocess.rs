//! Real multi-process runs: the test binary re-executes itself as each rank
//! (`RSRUN_COMM_CHILD=scenario:backend:rank:world:store_dir`), with a [`FileStore`].

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rsrun_training_engine::comm::{
    BackendKind, CommError, FileStore, OpKind, ProcessGroup, ReduceOp,
};

use crate::support::{check_all_dtypes, opts_for};

const CHILD_ENV: &str = "RSRUN_COMM_CHILD";

/// Entry point of child processes; a no-op in the normal test run.
#[test]
fn child_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(':').collect();
    let [scenario, backend, rank, world, dir] = parts[..] else {
        panic!("bad child spec {spec}")
    };
    let kind: BackendKind = backend.parse().unwrap();
    let (rank, world): (usize, usize) = (rank.parse().unwrap(), world.parse().unwrap());
    let store = Arc::new(FileStore::new(dir).unwrap());
    let mut opts = opts_for(kind, rank);
    if scenario.starts_with("death") {
        opts.timeout = Duration::from_secs(10);
    }
    let pg = ProcessGroup::new(rank, world, store, "mp", opts).unwrap();
    assert_eq!(pg.backend(), backend);
    match scenario {
        "matrix" => {
            check_all_dtypes(&pg, &[0, 1, 13, 5003]).unwrap();
            // Traffic of a ring all_reduce: 2(N-1)/N·B.
            let len = 12 * 1024;
            let mut v = vec![1.0f32; len];
            pg.reset_stats();
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v[0], world as f32);
            let n = world as u64;
            if kind != BackendKind::Hierarchical {
                assert_eq!(
                    pg.stats().op(OpKind::AllReduce).bytes_sent,
                    2 * (n - 1) * (len as u64 * 4) / n
                );
            }
        }
        "death" | "death_shared" => {
            // `death_shared`: the same on a registered buffer (the zero-copy path).
            let mut plain = vec![1.0f32; 100_000];
            let mut shared = (scenario == "death_shared").then(|| pg.alloc_shared::<f32>(100_000).unwrap());
            let v: &mut [f32] = match &mut shared {
                Some(s) => s,
                None => &mut plain,
            };
            v.fill(1.0);
            pg.all_reduce(v, ReduceOp::Sum).unwrap();
            if rank == world - 1 {
                // Die abruptly in the middle of the job (no cleanup, no goodbye).
                std::process::abort();
            }
            let t0 = Instant::now();
            let e = pg.all_reduce(v, ReduceOp::Sum).unwrap_err();
            let took = t0.elapsed();
            assert_eq!(e.peer(), Some(world - 1), "rank {rank}: {e}");
            assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
            assert_eq!(pg.barrier().unwrap_err(), e);
            eprintln!("rank {rank}: failed after {took:?}: {e}");
        }
        "death_before_shared" => {
            // The last rank dies before a registered buffer is made: the others' setup fails
            // naming it within moments, not at the group's timeout (10 s here).
            let mut v = vec![1.0f32; 1000];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            if rank == world - 1 {
                std::process::abort();
            }
            let t0 = Instant::now();
            let e = match pg.alloc_shared::<f32>(100_000) {
                Err(e) => e,
                // A rank that attached before the death finds it in its next collective.
                Ok(mut w) => pg.all_reduce(&mut w, ReduceOp::Sum).unwrap_err(),
            };
            let took = t0.elapsed();
            assert_eq!(e.peer(), Some(world - 1), "rank {rank}: {e}");
            assert!(took < Duration::from_secs(5), "rank {rank} took {took:?}: {e}");
            eprintln!("rank {rank}: failed after {took:?}: {e}");
        }
        "mismatch" => {
            let mut v = vec![1.0f32; if rank == 0 { 64 } else { 65 }];
            let e = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            assert!(matches!(e, CommError::Mismatch { .. }), "rank {rank}: {e}");
        }
        "shared" => {
            // Registered buffers across real processes: the zero-copy paths, against the
            // reference, and the checked fallback for plain buffers next to them.
            let (r, n, len) = (rank, world, 300_001);
            let mut v = pg.alloc_shared::<f32>(len).unwrap();
            assert!(v.is_registered());
            for (i, x) in v.iter_mut().enumerate() {
                *x = crate::support::val(r, i) as f32;
            }
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            let want = crate::support::expected_reduce::<f32>(n, len, ReduceOp::Sum, |i| i);
            assert!(*v == want[..], "rank {rank}: zero-copy all_reduce differs");
            let mut out = pg.alloc_shared::<f32>(len * n).unwrap();
            let inp = crate::support::input::<f32>(r, len);
            pg.all_gather(&inp, &mut out).unwrap();
            let gathered: Vec<f32> = (0..n).flat_map(|j| crate::support::input::<f32>(j, len)).collect();
            assert!(*out == gathered[..], "rank {rank}: zero-copy all_gather differs");
            let mut shard = vec![0f32; len / n];
            // Every rank's input is the same gathered buffer: the max is its block r.
            pg.reduce_scatter(&out[..len / n * n], &mut shard, ReduceOp::Max).unwrap();
            assert!(shard[..] == gathered[r * (len / n)..(r + 1) * (len / n)], "rank {rank}: zero-copy reduce_scatter differs");
            assert_eq!(pg.stats().total().zero_copy, 3, "rank {rank}");
            check_all_dtypes(&pg, &[0, 13, 5003]).unwrap();
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// Spawns `world` ranks of `scenario`; returns each rank's (exit success, stderr).
fn spawn(scenario: &str, backend: &str, world: usize) -> Vec<(bool, String)> {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "multiprocess::child_entry",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(
                    CHILD_ENV,
                    format!(
                        "{scenario}:{backend}:{rank}:{world}:{}",
                        dir.path().display()
                    ),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        })
        .collect()
}

fn assert_all_ok(scenario: &str, backend: &str, world: usize) {
    for (rank, (ok, err)) in spawn(scenario, backend, world).into_iter().enumerate() {
        assert!(
            ok,
            "{scenario} {backend} world {world} rank {rank} failed:\n{err}"
        );
    }
}

#[test]
fn multiprocess_matrix_each_backend() {
    assert_all_ok("matrix", "shm", 3);
    assert_all_ok("matrix", "tcp", 3);
    assert_all_ok("matrix", "hierarchical", 4);
    assert_all_ok("matrix", "shm", 2);
}

#[test]
fn multiprocess_peer_death_fails_survivors() {
    // World 2 on TCP takes the two-rank all_reduce exchange; world 3 the ring.
    for (scenario, backend, world) in [
        ("death", "shm", 3),
        ("death", "tcp", 3),
        ("death", "tcp", 2),
        ("death", "hierarchical", 3),
        ("death_shared", "shm", 3),
        ("death_before_shared", "shm", 3),
    ] {
        let res = spawn(scenario, backend, world);
        let (dead_ok, _) = &res[world - 1];
        assert!(!dead_ok, "the dying rank should have aborted");
        for (rank, (ok, err)) in res.iter().enumerate().take(world - 1) {
            assert!(
                ok,
                "{scenario} {backend} survivor rank {rank} did not report the dead peer:\n{err}"
            );
            eprintln!("{scenario} {backend}: {}", err.trim());
        }
    }
}

#[test]
fn multiprocess_mismatch() {
    assert_all_ok("mismatch", "shm", 2);
    assert_all_ok("mismatch", "tcp", 2);
}

#[test]
fn multiprocess_registered_buffers() {
    assert_all_ok("shared", "shm", 2);
    assert_all_ok("shared", "shm", 3);
}
