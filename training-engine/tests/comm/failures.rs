//! Timeouts, mismatched calls and argument errors (threads); peer death is in `multiprocess`.

use std::time::{Duration, Instant};

use rsrun_training_engine::comm::{BackendKind, CommError, ReduceOp};

use crate::support::{opts_for, run_threads, unique_prefix};

const KINDS: [BackendKind; 3] = [
    BackendKind::Shm,
    BackendKind::Tcp,
    BackendKind::Hierarchical,
];

/// A rank that never shows up is named in a timeout on every other rank, within the timeout;
/// when it finally calls, it fails too instead of hanging.
#[test]
fn absent_peer_times_out_everywhere() {
    for kind in KINDS {
        let res = run_threads(
            3,
            |r| {
                let mut o = opts_for(kind, r);
                o.timeout = Duration::from_millis(2000);
                o
            },
            |pg| {
                let mut v = vec![1.0f32; 100];
                pg.barrier()?;
                // Long after the others' timeout, so that a loaded machine's late timer does
                // not let rank 2 in before they gave up.
                if pg.rank() == 2 {
                    std::thread::sleep(Duration::from_millis(5000));
                }
                let t0 = Instant::now();
                let e = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
                let took = t0.elapsed();
                // Future calls report the same failure.
                let again = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
                Ok((pg.rank(), e, again, took))
            },
        );
        for r in res {
            let (rank, e, again, took) = r.unwrap();
            assert_eq!(e, again);
            assert!(
                took < Duration::from_millis(8000),
                "{kind:?} rank {rank} took {took:?}"
            );
            if rank != 2 {
                assert_eq!(e.peer(), Some(2), "{kind:?} rank {rank}: {e}");
            }
        }
    }
}

/// Different sizes, dtypes or ops are reported as a mismatch on every rank (small and large).
#[test]
fn mismatched_calls_are_reported_on_every_rank() {
    for kind in KINDS {
        for (small, large) in [(10usize, 11usize), (100_000, 100_001)] {
            let res = run_threads(
                3,
                |r| opts_for(kind, r),
                move |pg| {
                    let n = if pg.rank() == 1 { large } else { small };
                    let mut v = vec![1.0f32; n];
                    Ok(pg.all_reduce(&mut v, ReduceOp::Sum))
                },
            );
            for (rank, r) in res.into_iter().enumerate() {
                match r.unwrap() {
                    Err(CommError::Mismatch { .. }) if kind == BackendKind::Hierarchical => {}
                    // A stage's peer that aborted passes on its whole error, not only its kind.
                    Err(CommError::Aborted { detail, .. }) if kind == BackendKind::Hierarchical => {
                        assert!(detail.contains("count="), "{kind:?} rank {rank}: {detail}")
                    }
                    Err(CommError::Mismatch { ours, theirs, .. }) => assert_ne!(ours, theirs),
                    other => panic!(
                        "{kind:?} rank {rank} sizes {small}/{large}: expected mismatch, got {other:?}"
                    ),
                }
            }
        }
        // Different op kinds.
        let res = run_threads(
            2,
            |r| opts_for(kind, r),
            |pg| {
                let mut v = vec![1.0f64; 64];
                Ok(if pg.rank() == 0 {
                    pg.all_reduce(&mut v, ReduceOp::Sum)
                } else {
                    pg.broadcast(&mut v, 0)
                })
            },
        );
        for r in res {
            assert!(
                matches!(
                    r.unwrap(),
                    Err(CommError::Mismatch { .. }) | Err(CommError::Aborted { .. })
                ),
                "{kind:?} op mismatch"
            );
        }
        // Different dtypes, same byte size.
        let res = run_threads(
            2,
            |r| opts_for(kind, r),
            |pg| {
                Ok(if pg.rank() == 0 {
                    pg.all_reduce(&mut [1i32; 16], ReduceOp::Sum)
                } else {
                    pg.all_reduce(&mut [1.0f32; 16], ReduceOp::Sum)
                })
            },
        );
        for r in res {
            assert!(
                matches!(r.unwrap(), Err(CommError::Mismatch { .. })),
                "{kind:?} dtype mismatch"
            );
        }
    }
}

/// Under the hierarchical backend, stages that rewrite the op (Avg sums in every stage) or the
/// root (a host's local broadcast is from its local rank 0) still see what each caller asked
/// for: ranks 0,2 on one host and 1,3 on the other, one rank asking for another reduce op or
/// root is named on every rank instead of leaving the ranks with different results.
#[test]
fn hierarchical_stages_check_the_callers_op_and_root() {
    let res = run_threads(
        4,
        |r| opts_for(BackendKind::Hierarchical, r),
        |pg| {
            let mut v = vec![1.0f32; 64];
            let op = if pg.rank() == 0 { ReduceOp::Avg } else { ReduceOp::Sum };
            Ok(pg.all_reduce(&mut v, op))
        },
    );
    for (rank, r) in res.into_iter().enumerate() {
        let r = r.unwrap();
        assert!(matches!(r, Err(CommError::Mismatch { .. }) | Err(CommError::Aborted { .. })), "rank {rank} avg/sum: {r:?}");
    }
    // Rank 3 asks for root 2, the others for root 0: ranks 1 and 3 (host B) fail in the op; ranks
    // 0 and 2 hold root 0's data, as asked, and learn of the failure at their next call.
    let res = run_threads(
        4,
        |r| opts_for(BackendKind::Hierarchical, r),
        |pg| {
            let mut v = vec![pg.rank() as f32; 64];
            let root = if pg.rank() == 3 { 2 } else { 0 };
            let first = pg.broadcast(&mut v, root).map(|()| v[0]);
            Ok((first, pg.barrier()))
        },
    );
    for (rank, r) in res.into_iter().enumerate() {
        let (first, next) = r.unwrap();
        match rank {
            1 | 3 => assert!(first.is_err(), "rank {rank} roots: {first:?}"),
            _ => assert!(matches!(first, Ok(0.0) | Err(_)), "rank {rank} roots: {first:?}"),
        }
        assert!(next.is_err(), "rank {rank}: the call after a mismatch succeeded");
    }
}

/// Ranks pick their algorithm by their own options: ranks created with different ones fail at
/// creation, naming both, instead of pairing a one-sync path with a chunked one.
#[test]
fn ranks_with_different_options_fail_at_creation() {
    for kind in KINDS {
        let res = run_threads(
            2,
            |r| {
                let mut o = opts_for(kind, r);
                if r == 1 {
                    o.shm_small_bytes *= 2;
                    o.tcp_small_bytes *= 2;
                }
                o
            },
            |_pg| Ok(()),
        );
        for (rank, r) in res.into_iter().enumerate() {
            let e = r.unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, CommError::Bootstrap { .. }) && msg.contains("shm_small_bytes=8192") && msg.contains("shm_small_bytes=4096"), "{kind:?} rank {rank}: {msg}");
        }
    }
}

#[test]
fn argument_errors_do_not_poison_the_group() {
    let res = run_threads(
        2,
        |r| opts_for(BackendKind::Shm, r),
        |pg| {
            let mut out = vec![0f32; 3];
            let e = pg.all_gather(&[1.0f32; 2], &mut out).unwrap_err();
            assert!(
                matches!(
                    e,
                    CommError::Length {
                        expected: 4,
                        actual: 3,
                        ..
                    }
                ),
                "{e}"
            );
            let e = pg
                .reduce_scatter(&[1.0f32; 5], &mut out[..2], ReduceOp::Sum)
                .unwrap_err();
            assert!(matches!(e, CommError::Length { .. }), "{e}");
            assert!(matches!(
                pg.broadcast(&mut out, 7),
                Err(CommError::InvalidRank { rank: 7, .. })
            ));
            assert!(matches!(
                pg.send(&out, pg.rank()),
                Err(CommError::InvalidRank { .. })
            ));
            let mut v = vec![2u8; 3];
            pg.all_reduce(&mut v, ReduceOp::Sum)?;
            assert_eq!(v, vec![4; 3]);
            Ok(())
        },
    );
    for r in res {
        r.unwrap();
    }
}

/// A send that its receiver takes only after the next collective (NCCL would hang on it) fails
/// that collective on every rank, naming the sender, instead of the send's bytes being read as
/// the collective's data (world 4: the header exchange reads no byte from rank 0 on rank 1).
#[test]
fn a_send_received_only_after_a_collective_fails_the_collective() {
    // The hierarchical backend sends over its flat mesh, which its reduce_scatter uses.
    for (kind, flat_op) in [(BackendKind::Tcp, false), (BackendKind::Hierarchical, true)] {
        for len in [8usize, 1 << 16] {
            let res = run_threads(
                4,
                |r| opts_for(kind, r),
                move |pg| {
                    let mut v = vec![1f32; len];
                    if pg.rank() == 0 {
                        pg.send(&[7f32; 4], 1)?;
                    }
                    let r = if flat_op {
                        let input = vec![1f32; len * 4];
                        pg.reduce_scatter(&input, &mut v, ReduceOp::Sum)
                    } else {
                        pg.all_reduce(&mut v, ReduceOp::Sum)
                    };
                    Ok(r.unwrap_err())
                },
            );
            let mut named = 0;
            for (rank, r) in res.into_iter().enumerate() {
                match r.unwrap() {
                    CommError::Mismatch { peer: 0, ours, theirs, .. } => {
                        assert!(ours.contains("point-to-point messages unmatched (1 sent but 0 received"), "{ours}");
                        assert_eq!(theirs, "it after 1 sends and 0 receives");
                        named += 1;
                    }
                    // A rank whose peer reached the verdict first may see that peer's abort.
                    CommError::Aborted { .. } => {}
                    other => panic!("{kind:?}, {len} elements, rank {rank}: {other}"),
                }
            }
            assert!(named > 0, "{kind:?}, {len} elements: no rank named the unmatched send");
        }
    }
}

/// A connection to a rank's collective listener that never says hello (a port scan, a health
/// check) does not hold up the bootstrap until the group's timeout: the real peer queued behind
/// it is accepted once the stray's hello times out (5 s).
#[test]
fn a_silent_stray_connection_does_not_hold_up_the_bootstrap() {
    use rsrun_training_engine::comm::{LocalStore, ProcessGroup, Store};
    use std::sync::Arc;

    /// Rank 1's view of the store: rank 0's address shows once the test lets it.
    struct Gated {
        inner: Arc<LocalStore>,
        gated: String,
        release: String,
    }
    impl Store for Gated {
        fn set(&self, key: &str, value: &[u8]) -> rsrun_training_engine::comm::Result<()> {
            self.inner.set(key, value)
        }
        fn get(&self, key: &str, timeout: Duration) -> rsrun_training_engine::comm::Result<Vec<u8>> {
            if key == self.gated {
                self.inner.get(&self.release, timeout)?;
            }
            self.inner.get(key, timeout)
        }
    }

    let store = Arc::new(LocalStore::new());
    let prefix = unique_prefix("stray");
    let addr_key = format!("{prefix}/tcp/0");
    let release = format!("{prefix}/test-release");
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let view: Arc<dyn Store> = if rank == 0 {
            store.clone()
        } else {
            Arc::new(Gated { inner: store.clone(), gated: addr_key.clone(), release: release.clone() })
        };
        let (prefix, tx) = (prefix.clone(), tx.clone());
        let mut o = opts_for(BackendKind::Tcp, rank);
        o.timeout = Duration::from_secs(300);
        std::thread::spawn(move || {
            let r = ProcessGroup::new(rank, 2, view, &prefix, o).and_then(|pg| pg.barrier());
            let _ = tx.send((rank, r));
        });
    }
    let raw = store.get(&addr_key, Duration::from_secs(60)).unwrap();
    // "ADDR TOKEN": the listener's address and the token a hello must carry.
    let addr: std::net::SocketAddr = String::from_utf8_lossy(&raw).split(' ').next().unwrap().parse().unwrap();
    let stray = std::net::TcpStream::connect(addr).unwrap();
    // Rank 0 takes the stray first (were rank 1 first, the test would pass without the fix).
    std::thread::sleep(Duration::from_millis(300));
    store.set(&release, b"1").unwrap();
    for _ in 0..2 {
        let (rank, r) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the bootstrap waited on the silent connection");
        r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    drop(stray);
}

/// A ring of four where rank 3 never calls: ranks 1 and 2 wait on a rank that is itself blocked
/// (on 3, or on one blocked on 3), and every timeout names rank 3, the one that really stopped, not the
/// neighbour each rank happened to wait on.
#[test]
fn a_timeout_names_the_rank_that_stopped_not_the_blocked_neighbour() {
    for kind in [BackendKind::Tcp, BackendKind::Shm] {
        let res = run_threads(
            4,
            |r| {
                let mut o = opts_for(kind, r);
                o.timeout = Duration::from_millis(2000);
                o
            },
            |pg| {
                // Large enough for the ring (each rank receives from its predecessor only).
                let mut v = vec![1.0f32; 1 << 20];
                pg.barrier()?;
                if pg.rank() == 3 {
                    std::thread::sleep(Duration::from_millis(7000));
                }
                let e = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
                Ok((pg.rank(), e))
            },
        );
        for r in res {
            let (rank, e) = r.unwrap();
            if rank != 3 {
                assert_eq!(e.peer(), Some(3), "{kind:?} rank {rank}: {e}");
            }
        }
    }
}

/// `with_op_timeout` lengthens the deadline of the operations inside it only (a checkpoint's
/// agreement waits while one rank writes): a late peer is waited for there, and the group's own
/// deadline is back for the next operation.
#[test]
fn a_longer_op_timeout_holds_inside_its_scope_only() {
    for kind in [BackendKind::Tcp, BackendKind::Shm] {
        let res = run_threads(
            2,
            |r| {
                let mut o = opts_for(kind, r);
                o.timeout = Duration::from_millis(1000);
                o
            },
            |pg| {
                let mut v = vec![1.0f32; 1024];
                pg.barrier()?;
                if pg.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(2500));
                }
                pg.with_op_timeout(Duration::from_secs(60), || pg.all_reduce(&mut v, ReduceOp::Sum))?;
                if pg.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(4000));
                }
                Ok((pg.rank(), v[0], pg.all_reduce(&mut v, ReduceOp::Sum).is_err()))
            },
        );
        for r in res {
            let (rank, sum, late_failed) = r.unwrap();
            assert_eq!(sum, 2.0, "{kind:?} rank {rank}");
            if rank == 0 {
                assert!(late_failed, "{kind:?}: the group's own deadline is back after the scope");
            }
        }
    }
}

/// Rank 0 that cannot create the shared-memory segment (a full /dev/shm) tells the others at
/// once, naming itself and the reason, instead of leaving them to wait out the bootstrap for
/// the segment's name.
#[test]
fn a_segment_rank_0_cannot_create_fails_the_others_at_once() {
    let t0 = Instant::now();
    let res = run_threads(
        2,
        |r| {
            let mut o = opts_for(BackendKind::Shm, r);
            // Far past any /dev/shm: the reservation fails (ENOSPC or EFBIG).
            o.shm_chunk_bytes = 1 << 44;
            o
        },
        |_pg| Ok(()),
    );
    let errs: Vec<String> = res.into_iter().map(|r| r.unwrap_err().to_string()).collect();
    assert!(errs[0].contains("sizing"), "{errs:?}");
    assert!(errs[1].contains("rank 0 could not create the shared-memory segment") && errs[1].contains("sizing"), "{errs:?}");
    assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}", t0.elapsed());
}
