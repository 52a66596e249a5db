//! Traffic counters, deterministic mode, async work, subgroups, layout helpers.

use std::time::Duration;

use half::bf16;
use rand::{Rng, SeedableRng};
use rsrun_training_engine::comm::{BackendKind, OpKind, ReduceOp, padded_len, shard_range};

use crate::support::{expected_reduce, input, opts_for, run_threads};

/// Ring all_reduce sends 2(N−1)/N·B per rank; reduce_scatter and all_gather (N−1)/N·B.
#[test]
fn traffic_counters_match_formulas() {
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        for world in 2..=4 {
            let res = run_threads(
                world,
                |r| opts_for(kind, r),
                move |pg| {
                    let n = pg.world_size();
                    let len = 12 * 4096; // divisible by 2, 3, 4 and by the shm chunk split
                    let b = (len * 4) as u64;
                    let nn = n as u64;
                    pg.reset_stats();
                    let mut buf = vec![1.0f32; len];
                    pg.all_reduce(&mut buf, ReduceOp::Sum)?;
                    let s = pg.stats().op(OpKind::AllReduce);
                    assert_eq!(
                        (s.calls, s.bytes_sent, s.bytes_recv),
                        (1, 2 * (nn - 1) * b / nn, 2 * (nn - 1) * b / nn),
                        "{kind:?} all_reduce world {n}"
                    );
                    let mut out = vec![0f32; len / n];
                    pg.reduce_scatter(&buf, &mut out, ReduceOp::Sum)?;
                    let s = pg.stats().op(OpKind::ReduceScatter);
                    assert_eq!(
                        (s.bytes_sent, s.bytes_recv),
                        ((nn - 1) * b / nn, (nn - 1) * b / nn),
                        "{kind:?} reduce_scatter world {n}"
                    );
                    let mut full = vec![0f32; len];
                    pg.all_gather(&out, &mut full)?;
                    let s = pg.stats().op(OpKind::AllGather);
                    assert_eq!(
                        (s.bytes_sent, s.bytes_recv),
                        ((nn - 1) * b / nn, (nn - 1) * b / nn),
                        "{kind:?} all_gather world {n}"
                    );
                    assert_eq!(pg.stats().total().calls, 3);
                    Ok(())
                },
            );
            for r in res {
                r.unwrap();
            }
        }
    }
}

fn random_input(rank: usize, len: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(rank as u64 + 17);
    (0..len)
        .map(|_| rng.random_range(-1.0f32..1.0) * 1e3f32.powi(rng.random_range(-3..3)))
        .collect()
}

/// Deterministic mode: bit-identical to a left fold in rank order, for every backend and world 3/4.
#[test]
fn deterministic_matches_rank_order_fold() {
    let len = 50_001;
    for kind in [
        BackendKind::Shm,
        BackendKind::Tcp,
        BackendKind::Hierarchical,
    ] {
        for world in [3, 4] {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| random_input(r, len)).collect();
            let reference: Vec<f32> = (0..len)
                .map(|i| (1..world).fold(inputs[0][i], |acc, r| acc + inputs[r][i]))
                .collect();
            let bf_inputs: Vec<Vec<bf16>> = inputs
                .iter()
                .map(|v| v.iter().map(|x| bf16::from_f32(*x)).collect())
                .collect();
            let bf_ref: Vec<bf16> = (0..len)
                .map(|i| {
                    bf16::from_f32((1..world).fold(bf_inputs[0][i].to_f32(), |acc, r| {
                        acc + bf_inputs[r][i].to_f32()
                    }))
                })
                .collect();
            let res = run_threads(
                world,
                |r| {
                    let mut o = opts_for(kind, r);
                    o.deterministic = true;
                    o
                },
                move |pg| {
                    let mut buf = random_input(pg.rank(), len);
                    pg.all_reduce(&mut buf, ReduceOp::Sum)?;
                    let mut bf: Vec<bf16> = random_input(pg.rank(), len)
                        .iter()
                        .map(|x| bf16::from_f32(*x))
                        .collect();
                    pg.all_reduce(&mut bf, ReduceOp::Sum)?;
                    Ok((buf, bf))
                },
            );
            for r in res {
                let (buf, bf) = r.unwrap();
                assert!(
                    buf.iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kind:?} world {world} f32 not bitwise"
                );
                assert!(
                    bf.iter()
                        .zip(&bf_ref)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kind:?} world {world} bf16 not bitwise"
                );
            }
        }
    }
}

#[test]
fn async_ops_overlap_and_keep_order() {
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        let res = run_threads(
            2,
            |r| opts_for(kind, r),
            |pg| {
                let (r, n) = (pg.rank(), pg.world_size());
                let works: Vec<_> = (0..8)
                    .map(|k| pg.all_reduce_async(input::<f32>(r, 1000 + k), ReduceOp::Sum))
                    .collect();
                let ag = pg.all_gather_async(input::<i64>(r, 33), vec![0i64; 66]);
                let rs =
                    pg.reduce_scatter_async(input::<f64>(r, 40), vec![0f64; 20], ReduceOp::Max);
                // A sync op issued now runs after every queued async op.
                let mut tail = input::<u8>(r, 5);
                pg.broadcast(&mut tail, 1)?;
                assert!(works.iter().all(|w| w.is_completed()));
                for (k, w) in works.into_iter().enumerate() {
                    assert_eq!(
                        w.wait()?,
                        expected_reduce::<f32>(n, 1000 + k, ReduceOp::Sum, |i| i)
                    );
                }
                let (_, all) = ag.wait()?;
                assert_eq!(
                    all,
                    (0..n).flat_map(|j| input::<i64>(j, 33)).collect::<Vec<_>>()
                );
                let (_, out) = rs.wait()?;
                assert_eq!(
                    out,
                    expected_reduce::<f64>(n, 20, ReduceOp::Max, |i| r * 20 + i)
                );
                assert_eq!(tail, input::<u8>(1, 5));
                pg.barrier_async().wait()?;
                Ok(())
            },
        );
        for r in res {
            r.unwrap();
        }
    }
}

#[test]
fn subgroups_and_host_split() {
    let res = run_threads(
        4,
        |r| opts_for(BackendKind::Hierarchical, r),
        |pg| {
            let r = pg.rank();
            // new_group: members get a group, others None; ranks are positions in the list.
            let g = pg.new_group(&[3, 1])?;
            match &g {
                Some(g) => {
                    assert_eq!(g.world_size(), 2);
                    assert_eq!(g.global_ranks(), &[3, 1]);
                    let mut v = vec![r as i32; 3];
                    g.all_reduce(&mut v, ReduceOp::Sum)?;
                    assert_eq!(v, vec![4; 3]);
                }
                None => assert!(r == 0 || r == 2),
            }
            // Hosts are rank parity: intra = same parity (shm), inter = same local index (tcp).
            let (intra, inter) = pg.split_by_host()?;
            assert_eq!(intra.backend(), "shm");
            assert_eq!(inter.backend(), "tcp");
            assert_eq!(
                intra.global_ranks(),
                if r % 2 == 0 { &[0, 2] } else { &[1, 3] }
            );
            assert_eq!(inter.global_ranks(), if r < 2 { &[0, 1] } else { &[2, 3] });
            // HSDP-style gradient reduction: reduce-scatter in the host, all-reduce across hosts.
            let grads: Vec<f32> = (0..8).map(|i| (r * 8 + i) as f32).collect();
            let mut shard = vec![0f32; 4];
            intra.reduce_scatter(&grads, &mut shard, ReduceOp::Sum)?;
            inter.all_reduce(&mut shard, ReduceOp::Sum)?;
            let want: Vec<f32> = (0..4)
                .map(|i| (0..4).map(|q| (q * 8 + intra.rank() * 4 + i) as f32).sum())
                .collect();
            assert_eq!(shard, want);
            Ok(())
        },
    );
    for r in res {
        r.unwrap();
    }
}

#[test]
fn layout_helpers() {
    assert_eq!(padded_len(10, 4), 12);
    assert_eq!(padded_len(0, 4), 0);
    assert_eq!(shard_range(10, 4, 0), 0..3);
    assert_eq!(shard_range(10, 4, 3), 9..10);
    assert_eq!(shard_range(2, 4, 3), 2..2);
    let _ = Duration::ZERO;
}
