//! Registered buffers (`ProcessGroup::alloc_shared`): the zero-copy shm paths give the staged
//! paths' results bit for bit, fall back when ranks' buffers do not line up, and other backends
//! hand out heap buffers.

use half::bf16;
use rsrun_training_engine::comm::{BackendKind, OpKind, ProcessGroup, ReduceOp, Result};

use crate::support::{TestElem, check_all_dtypes, opts_for, run_threads};

/// Irregular values (not exactly summable), so that a different fold order would show.
fn rnd<T: TestElem>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| {
            let h = (i as u64 * 2_654_435_761 + rank as u64 * 40_503) % 100_003;
            T::from_f64(h as f64 / 97.3 - 500.0)
        })
        .collect()
}

fn bits<T: TestElem>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn zero_copy(pg: &ProcessGroup, kind: OpKind) -> u64 {
    pg.stats().op(kind).zero_copy
}

/// all_reduce, all_gather and reduce_scatter on registered buffers against the same ops on
/// plain vectors, bitwise; all_reduce above the small-message size, all_gather and
/// reduce_scatter ran zero-copy.
fn check_registered<T: TestElem>(pg: &ProcessGroup, lens: &[usize]) -> Result<()> {
    let (r, n) = (pg.rank(), pg.world_size());
    let bytes = |len: usize| len * std::mem::size_of::<T>();
    for &len in lens {
        let what = |op: &str| format!("{op} {} len={len} world={n} rank={r}", std::any::type_name::<T>());
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let mut plain = rnd::<T>(r, len);
            pg.all_reduce(&mut plain, op)?;
            let mut shared = pg.alloc_shared::<T>(len)?;
            assert!(shared.is_registered(), "{}", what("alloc"));
            assert!(shared.iter().all(|x| bits(std::slice::from_ref(x)).iter().all(|b| *b == 0)));
            shared.copy_from_slice(&rnd::<T>(r, len));
            let before = zero_copy(pg, OpKind::AllReduce);
            pg.all_reduce(&mut shared, op)?;
            assert_eq!(bits(&shared), bits(&plain), "{}", what(&format!("all_reduce {op:?}")));
            // Messages up to shm_small_bytes (4 KiB in these options) keep the one-sync path.
            let expect = u64::from(bytes(len) > 4 << 10);
            assert_eq!(zero_copy(pg, OpKind::AllReduce) - before, expect, "{}", what("zero-copy count"));
        }

        let inp = rnd::<T>(r, len);
        let mut plain = vec![T::from_f64(0.0); len * n];
        pg.all_gather(&inp, &mut plain)?;
        let mut shared = pg.alloc_shared::<T>(len * n)?;
        let before = zero_copy(pg, OpKind::AllGather);
        pg.all_gather(&inp, &mut shared)?;
        assert_eq!(bits(&shared), bits(&plain), "{}", what("all_gather"));
        assert_eq!(zero_copy(pg, OpKind::AllGather) - before, 1, "{}", what("all_gather zero-copy"));

        let mut input = pg.alloc_shared::<T>(len * n)?;
        input.copy_from_slice(&rnd::<T>(r, len * n));
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let mut plain = vec![T::from_f64(0.0); len];
            pg.reduce_scatter(&rnd::<T>(r, len * n), &mut plain, op)?;
            let mut out = vec![T::from_f64(1.0); len];
            let before = zero_copy(pg, OpKind::ReduceScatter);
            pg.reduce_scatter(&input, &mut out, op)?;
            assert_eq!(bits(&out), bits(&plain), "{}", what(&format!("reduce_scatter {op:?}")));
            assert_eq!(zero_copy(pg, OpKind::ReduceScatter) - before, 1, "{}", what("reduce_scatter zero-copy"));
            // The input is left as it was.
            assert_eq!(bits(&input), bits(&rnd::<T>(r, len * n)), "{}", what("reduce_scatter input"));
        }
    }
    Ok(())
}

#[test]
fn registered_buffers_give_the_staged_results_bitwise() {
    for world in 2..=4 {
        let res = run_threads(
            world,
            |r| opts_for(BackendKind::Shm, r),
            |pg| {
                let lens = [1, 7, 1001, 20_003, 300_001];
                check_registered::<f32>(&pg, &lens)?;
                check_registered::<bf16>(&pg, &lens)?;
                check_registered::<i64>(&pg, &lens[..4])?;
                // With windows around, plain buffers take the checked fallback: the whole
                // op × dtype matrix still holds.
                check_all_dtypes(&pg, &[0, 1, 13, 5003])?;
                Ok(())
            },
        );
        for r in res {
            r.unwrap_or_else(|e| panic!("world {world}: {e}"));
        }
    }
}

#[test]
fn buffers_that_do_not_line_up_fall_back_with_the_same_result() {
    let len = 50_000;
    let res = run_threads(
        2,
        |r| opts_for(BackendKind::Shm, r),
        move |pg| {
            let r = pg.rank();
            let mut plain = rnd::<f32>(r, len);
            pg.all_reduce(&mut plain, ReduceOp::Sum)?;
            let mut shared = pg.alloc_shared::<f32>(len + 16)?;
            let check = |got: &[f32], what: &str| assert_eq!(bits(got), bits(&plain), "{what} rank {r}");

            // One rank registered, the other not.
            let mut v = rnd::<f32>(r, len);
            if r == 0 {
                shared[..len].copy_from_slice(&v);
                pg.all_reduce(&mut shared[..len], ReduceOp::Sum)?;
                check(&shared[..len], "registered + plain");
            } else {
                pg.all_reduce(&mut v, ReduceOp::Sum)?;
                check(&v, "registered + plain");
            }
            // Both registered, at different offsets.
            let at = if r == 0 { 0 } else { 3 };
            shared[at..at + len].copy_from_slice(&rnd::<f32>(r, len));
            pg.all_reduce(&mut shared[at..at + len], ReduceOp::Sum)?;
            check(&shared[at..at + len], "different offsets");
            assert_eq!(zero_copy(&pg, OpKind::AllReduce), 0);

            // The same offset on every rank: zero-copy.
            shared[8..8 + len].copy_from_slice(&rnd::<f32>(r, len));
            pg.all_reduce(&mut shared[8..8 + len], ReduceOp::Sum)?;
            check(&shared[8..8 + len], "same offset");
            assert_eq!(zero_copy(&pg, OpKind::AllReduce), 1);

            // reduce_scatter with one rank's input registered, the other's not: staged, the
            // same result as both plain.
            let half = len / 2;
            let mut want = vec![0f32; half];
            pg.reduce_scatter(&rnd::<f32>(r, len), &mut want, ReduceOp::Sum)?;
            let mut got = vec![0f32; half];
            if r == 0 {
                shared[..len].copy_from_slice(&rnd::<f32>(r, len));
                pg.reduce_scatter(&shared[..len], &mut got, ReduceOp::Sum)?;
            } else {
                pg.reduce_scatter(&rnd::<f32>(r, len), &mut got, ReduceOp::Sum)?;
            }
            assert_eq!(bits(&got), bits(&want), "reduce_scatter registered + plain, rank {r}");
            assert_eq!(zero_copy(&pg, OpKind::ReduceScatter), 0);

            // Different allocations of the same size.
            let mut other = pg.alloc_shared::<f32>(len + 16)?;
            let mine = if r == 0 { &mut shared } else { &mut other };
            mine[..len].copy_from_slice(&rnd::<f32>(r, len));
            pg.all_reduce(&mut mine[..len], ReduceOp::Sum)?;
            check(&mine[..len], "different windows");
            assert_eq!(zero_copy(&pg, OpKind::AllReduce), 1);
            Ok(())
        },
    );
    for r in res {
        r.unwrap();
    }
}

#[test]
fn async_ops_take_and_give_back_registered_buffers() {
    let len = 100_000;
    let res = run_threads(
        2,
        |r| opts_for(BackendKind::Shm, r),
        move |pg| {
            let r = pg.rank();
            let mut a = pg.alloc_shared::<f32>(len)?;
            a.copy_from_slice(&rnd::<f32>(r, len));
            let mut b = pg.alloc_shared::<f32>(2 * len)?;
            let wa = pg.all_reduce_async(a, ReduceOp::Avg);
            let wb = pg.all_gather_async(rnd::<f32>(r, len), b);
            let a = wa.wait()?;
            let (_, got) = wb.wait()?;
            b = got;
            let mut want = rnd::<f32>(r, len);
            pg.all_reduce(&mut want, ReduceOp::Avg)?;
            assert!(a.is_registered() && b.is_registered());
            assert_eq!(bits(&a), bits(&want));
            let gathered: Vec<f32> = (0..2).flat_map(|j| rnd::<f32>(j, len)).collect();
            assert_eq!(bits(&b), bits(&gathered));
            assert_eq!(zero_copy(&pg, OpKind::AllReduce), 1);
            assert_eq!(zero_copy(&pg, OpKind::AllGather), 1);
            Ok(())
        },
    );
    for r in res {
        r.unwrap();
    }
}

#[test]
fn other_backends_hand_out_heap_buffers() {
    for (kind, world) in [
        (BackendKind::Tcp, 2),
        (BackendKind::Hierarchical, 4),
        (BackendKind::Auto, 1),
    ] {
        let res = run_threads(
            world,
            move |r| opts_for(kind, r),
            move |pg| {
                let mut v = pg.alloc_shared::<f32>(5000)?;
                assert!(!v.is_registered(), "{kind:?}");
                assert!(v.iter().all(|x| *x == 0.0));
                v.fill(pg.rank() as f32 + 1.0);
                pg.all_reduce(&mut v, ReduceOp::Sum)?;
                let n = pg.world_size();
                assert!(v.iter().all(|x| *x == (n * (n + 1) / 2) as f32), "{kind:?}");
                Ok(())
            },
        );
        for r in res {
            r.unwrap();
        }
    }
}

#[test]
fn registered_all_gather_past_the_streaming_size_matches_the_staged_one() {
    // Outputs of 8 MiB and more take streaming stores on both paths; an odd bf16 count puts
    // every block but the first at an unaligned address (head and tail copied plainly).
    let len = 4_200_007;
    for world in [2, 3] {
        let res = run_threads(
            world,
            |r| opts_for(BackendKind::Shm, r),
            move |pg| {
                let (r, n) = (pg.rank(), pg.world_size());
                let inp = rnd::<bf16>(r, len);
                let mut plain = vec![bf16::from_f32(0.0); len * n];
                pg.all_gather(&inp, &mut plain)?;
                let mut shared = pg.alloc_shared::<bf16>(len * n)?;
                pg.all_gather(&inp, &mut shared)?;
                assert!(std::mem::size_of_val(&shared[..]) >= 8 << 20);
                let want: Vec<bf16> = (0..n).flat_map(|j| rnd::<bf16>(j, len)).collect();
                assert_eq!(bits(&plain), bits(&want), "staged, world {n} rank {r}");
                assert_eq!(bits(&shared), bits(&want), "registered, world {n} rank {r}");
                assert_eq!(zero_copy(&pg, OpKind::AllGather), 1);
                // The registered input back: a reduce_scatter whose output (an odd bf16 count at
                // an unaligned offset) is streamed on both paths.
                let mut staged = vec![bf16::from_f32(0.0); len + 1];
                pg.reduce_scatter(&plain, &mut staged[1..], ReduceOp::Sum)?;
                let mut direct = vec![bf16::from_f32(0.0); len + 1];
                pg.reduce_scatter(&shared, &mut direct[1..], ReduceOp::Sum)?;
                assert!(std::mem::size_of_val(&direct[1..]) >= 8 << 20);
                assert_eq!(bits(&staged), bits(&direct), "reduce_scatter, world {n} rank {r}");
                assert_eq!(zero_copy(&pg, OpKind::ReduceScatter), 1);
                Ok(())
            },
        );
        for r in res {
            r.unwrap_or_else(|e| panic!("world {world}: {e}"));
        }
    }
}
