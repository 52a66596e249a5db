//! Every op × dtype × world size 1–4 × lengths, per forced backend, with ranks as threads.

use half::bf16;
use rsrun_training_engine::comm::{BackendKind, ReduceOp};

use crate::support::{check_all_dtypes, expected_reduce, input, opts_for, run_threads};

/// 0, 1, odd, not divisible by 2/3/4, and multi-chunk/multi-segment sizes (see `opts_for`).
const LENS: &[usize] = &[0, 1, 7, 13, 1001, 20_003];

fn matrix(kind: BackendKind) {
    for world in 1..=4 {
        for r in run_threads(
            world,
            |r| opts_for(kind, r),
            |pg| check_all_dtypes(&pg, LENS),
        ) {
            r.unwrap_or_else(|e| panic!("{kind:?} world {world}: {e}"));
        }
    }
}

#[test]
fn matrix_shm() {
    matrix(BackendKind::Shm);
}

#[test]
fn matrix_tcp() {
    matrix(BackendKind::Tcp);
}

/// Two-rank TCP all_reduce streams the reduce-scatter and the all-gather as one pipelined
/// exchange: segments far smaller than the blocks (and not a multiple of every element size)
/// give many segments per block, blocks whose segment counts differ, and all-gather segments
/// interleaved with reduce-scatter ones.
#[test]
fn tcp_pair_all_reduce_many_segments() {
    for seg in [1, 100, 1000] {
        for r in run_threads(
            2,
            |r| {
                let mut o = opts_for(BackendKind::Tcp, r);
                o.tcp_small_bytes = 0;
                o.tcp_segment_bytes = seg;
                o
            },
            |pg| check_all_dtypes(&pg, &[2, 3, 51, 257, 5003, 20_003]),
        ) {
            r.unwrap_or_else(|e| panic!("segment {seg}: {e}"));
        }
    }
}

/// Ranks that ask for different TCP segments (each host picks its default from its own L2
/// size) still run the two-rank pipelined exchange, whose stream order both sides derive from
/// the segment: the op's header exchange settles on the smallest.
#[test]
fn tcp_pair_all_reduce_with_different_segments_per_rank() {
    for r in run_threads(
        2,
        |r| {
            let mut o = opts_for(BackendKind::Tcp, r);
            o.tcp_small_bytes = 0;
            o.tcp_segment_bytes = if r == 0 { 100 } else { 1000 };
            o.timeout = std::time::Duration::from_secs(10);
            o
        },
        |pg| check_all_dtypes(&pg, &[2, 51, 5003, 20_003]),
    ) {
        r.unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn matrix_hierarchical() {
    matrix(BackendKind::Hierarchical);
}

#[test]
fn matrix_auto_picks_backend_by_host() {
    let names = run_threads(2, |_| opts_for(BackendKind::Auto, 0), |pg| Ok(pg.backend()));
    assert!(names.into_iter().all(|n| n.unwrap() == "shm"));
    let names = run_threads(
        2,
        |r| {
            let mut o = opts_for(BackendKind::Auto, r);
            o.host_identity = Some(format!("h{r}"));
            o
        },
        |pg| Ok(pg.backend()),
    );
    assert!(names.into_iter().all(|n| n.unwrap() == "tcp"));
    let names = run_threads(
        4,
        |r| opts_for(BackendKind::Hierarchical, r),
        |pg| Ok((pg.backend(), pg.num_hosts())),
    );
    assert!(names.into_iter().all(|n| n.unwrap() == ("hierarchical", 2)));
    let one = run_threads(1, |r| opts_for(BackendKind::Auto, r), |pg| Ok(pg.backend()));
    assert_eq!(one[0].as_ref().unwrap(), &"local");
}

/// 64 MiB: all_reduce f32 and reduce_scatter / all_gather bf16 on every backend, 2 ranks.
#[test]
fn large_64mib() {
    const BYTES: usize = 64 << 20;
    for kind in [
        BackendKind::Shm,
        BackendKind::Tcp,
        BackendKind::Hierarchical,
    ] {
        let res = run_threads(
            2,
            |r| {
                let mut o = opts_for(kind, r);
                o.shm_chunk_bytes = 1 << 20;
                o.tcp_segment_bytes = 256 << 10;
                o
            },
            move |pg| {
                let (r, n) = (pg.rank(), pg.world_size());
                let len = BYTES / 4;
                let mut buf = input::<f32>(r, len);
                pg.all_reduce(&mut buf, ReduceOp::Sum)?;
                assert!(
                    buf == expected_reduce::<f32>(n, len, ReduceOp::Sum, |i| i),
                    "{kind:?} all_reduce 64 MiB"
                );
                let len = BYTES / 2;
                let inp = input::<bf16>(r, len);
                let mut out = vec![bf16::ZERO; len / n];
                pg.reduce_scatter(&inp, &mut out, ReduceOp::Sum)?;
                assert!(
                    out == expected_reduce::<bf16>(n, len / n, ReduceOp::Sum, |i| r * (len / n)
                        + i),
                    "{kind:?} reduce_scatter 64 MiB"
                );
                let mine = input::<bf16>(r, len / n);
                let mut all = vec![bf16::ZERO; len];
                pg.all_gather(&mine, &mut all)?;
                assert!(
                    all == (0..n)
                        .flat_map(|j| input::<bf16>(j, len / n))
                        .collect::<Vec<_>>(),
                    "{kind:?} all_gather 64 MiB"
                );
                Ok(())
            },
        );
        for r in res {
            r.unwrap();
        }
    }
}

/// Outputs past the streaming-store threshold (8 MiB) at offsets that are not 16-byte aligned:
/// all_gather of an odd bf16 shard on 3 ranks, broadcast of an odd u8 buffer, and
/// reduce_scatter of an odd f32 shard (folded straight into the output), over shm.
#[test]
fn large_unaligned_streaming_outputs() {
    let res = run_threads(
        3,
        |r| opts_for(BackendKind::Shm, r),
        |pg| {
            let (r, n) = (pg.rank(), pg.world_size());
            let per = (3 << 20) + 3;
            let mine = input::<bf16>(r, per);
            let mut all = vec![bf16::ZERO; per * n];
            pg.all_gather(&mine, &mut all)?;
            assert!(
                all == (0..n).flat_map(|j| input::<bf16>(j, per)).collect::<Vec<_>>(),
                "all_gather {per} bf16 per rank"
            );
            let len = (9 << 20) + 5;
            let mut buf = if r == 1 { input::<u8>(1, len) } else { vec![0u8; len] };
            pg.broadcast(&mut buf[1..], 1)?;
            let mut want = input::<u8>(1, len);
            want[0] = if r == 1 { want[0] } else { 0 };
            want[1..].copy_from_slice(&input::<u8>(1, len)[1..]);
            assert!(buf == want, "broadcast {len} bytes at offset 1");
            let per = (2 << 20) + 3;
            let full = input::<f32>(r, per * n);
            let mut out = vec![0f32; per + 1];
            pg.reduce_scatter(&full, &mut out[1..], ReduceOp::Sum)?;
            assert!(std::mem::size_of_val(&out[1..]) >= 8 << 20);
            assert_eq!(out[0], 0.0);
            assert!(
                out[1..] == expected_reduce::<f32>(n, per, ReduceOp::Sum, |i| r * per + i),
                "reduce_scatter {per} f32 per rank at offset 1"
            );
            Ok(())
        },
    );
    for r in res {
        r.unwrap();
    }
}

/// An f16 average whose sum passes f16's largest value (65504) is still the mean on every
/// backend: the TCP pair folds `(a + b) / 2` in f32, and the staged ones (the TCP ring, the
/// hierarchical stages) scale each input by 1/n first, as NCCL's PreMulSum does. Summing
/// first gave `inf` where the shared-memory backend gave the mean.
#[test]
fn f16_average_past_the_largest_sum_is_the_mean() {
    use half::f16;
    for kind in [BackendKind::Shm, BackendKind::Tcp, BackendKind::Hierarchical] {
        for world in 2..=4 {
            for len in [5, 20_003] {
                for (r, got) in run_threads(
                    world,
                    |r| opts_for(kind, r),
                    move |pg| {
                        let mut buf = vec![f16::from_f32(30000.0 + 1000.0 * pg.rank() as f32); len];
                        pg.all_reduce(&mut buf, ReduceOp::Avg)?;
                        let mut out = vec![f16::ZERO; len];
                        pg.reduce_scatter(&vec![f16::from_f32(40000.0); len * pg.world_size()], &mut out, ReduceOp::Avg)?;
                        Ok((buf, out))
                    },
                )
                .into_iter()
                .enumerate()
                {
                    let (buf, out) = got.unwrap_or_else(|e| panic!("{kind:?} world {world}: {e}"));
                    let mean = 30000.0 + 1000.0 * (world - 1) as f32 / 2.0;
                    for x in &buf {
                        assert!((x.to_f32() - mean).abs() <= 32.0 * world as f32, "{kind:?} world {world} len {len} rank {r}: all_reduce {x} for {mean}");
                    }
                    for x in &out {
                        assert!((x.to_f32() - 40000.0).abs() <= 32.0 * world as f32, "{kind:?} world {world} len {len} rank {r}: reduce_scatter {x}");
                    }
                }
            }
        }
    }
}

/// Two ranks average in one fold, rounded once, in every mode: f16's smallest subnormal
/// averaged with itself is itself (halving each input first would round both to 0), on the
/// TCP reduce-scatter and all_reduce, deterministic or not, as on shared memory.
#[test]
fn two_rank_f16_average_rounds_once() {
    use half::f16;
    let tiny = f16::from_bits(1);
    for kind in [BackendKind::Shm, BackendKind::Tcp] {
        for deterministic in [false, true] {
            for (r, got) in run_threads(
                2,
                |r| {
                    let mut o = opts_for(kind, r);
                    o.deterministic = deterministic;
                    o
                },
                move |pg| {
                    let mut buf = vec![tiny; 20_003];
                    pg.all_reduce(&mut buf, ReduceOp::Avg)?;
                    let mut out = vec![f16::ZERO; 20_003];
                    pg.reduce_scatter(&vec![tiny; 2 * 20_003], &mut out, ReduceOp::Avg)?;
                    Ok((buf, out))
                },
            )
            .into_iter()
            .enumerate()
            {
                let (buf, out) = got.unwrap();
                assert!(buf.iter().chain(&out).all(|x| *x == tiny), "{kind:?} deterministic={deterministic} rank {r}");
            }
        }
    }
}
