//! Offload (CPU, NVMe) and mixed precision in the engine.

use super::tests_ckpt::{GLOBAL_B, Run, cfg, one_thread, params_of, run, tiny};
use super::*;
use crate::comm::{CommOptions, LocalStore};
use crate::model::{Gpt, global_batch};
use crate::offload::NvmeConfig;

fn nvme(dir: &std::path::Path) -> Offload {
    let mut c = NvmeConfig::new(dir, "engine-test");
    // Small tiles: several per unit, so the pipelined path is exercised.
    c.sub_group_elems = 3000;
    Offload::Nvme(c)
}

#[test]
fn offloaded_step_is_bitwise_the_in_memory_step() {
    let tmp = tempfile::tempdir().unwrap();
    for s in ["ddp", "zero1", "zero2", "zero3"] {
        let st: Strategy = s.parse().unwrap();
        let want = run(Run { world: 2, cfg: cfg(st), steps: 0..3, micro: 1, load: None, save: None });
        let psi = want[0].memory.optimizer;
        for off in [Offload::Cpu, nvme(tmp.path())] {
            let mut c = cfg(st);
            c.offload = off.clone();
            let got = run(Run { world: 2, cfg: c, steps: 0..3, micro: 1, load: None, save: None });
            assert!(params_of(&got) == params_of(&want), "{s} with {} offload differs", off.name());
            for (g, w) in got.iter().zip(&want) {
                assert!(g.state == w.state, "{s}/{}: optimizer state differs", off.name());
                assert_eq!(g.memory.optimizer, 0, "{s}/{}: {:?}", off.name(), g.memory);
                assert_eq!(g.memory.grads, w.memory.grads);
                // Master (4S) + m, v (8S) leave the engine: 1.5 × the in-memory optimizer bytes.
                match off {
                    Offload::Cpu => assert!(g.memory.offloaded_host >= psi * 3 / 2, "{:?}", g.memory),
                    _ => {
                        assert!(g.memory.offloaded_nvme >= psi * 3 / 2, "{:?}", g.memory);
                        assert!(g.memory.offloaded_host > 0 && g.memory.offloaded_host < psi, "{:?}", g.memory);
                    }
                }
            }
        }
    }
    // Every swap file is gone with its engine.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn offloaded_checkpoint_reshards_into_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tempfile::tempdir().unwrap();
    let mut c = cfg(Strategy::Zero3);
    c.offload = nvme(tmp.path());
    run(Run { world: 2, cfg: c, steps: 0..2, micro: 1, load: None, save: Some(ck.path()) });
    let got = run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 2..3, micro: 2, load: Some(ck.path()), save: None });
    let want = run(Run { world: 2, cfg: cfg(Strategy::Zero1), steps: 0..3, micro: 1, load: None, save: None });
    assert!(params_of(&got) == params_of(&want));
}

fn mixed(st: Strategy, p: Precision) -> EngineConfig {
    let mut c = cfg(st);
    c.precision = p;
    c
}

fn mixed_reduce(st: Strategy, p: Precision, r: ReduceDtype) -> EngineConfig {
    let mut c = mixed(st, p);
    c.reduce_dtype = r;
    c
}

#[test]
fn bf16_trains_and_memory_matches_the_mixed_precision_formulas() {
    one_thread();
    let pg = ProcessGroup::new(0, 1, std::sync::Arc::new(LocalStore::new()), "bf16", CommOptions::default()).unwrap();
    let mut e = Engine::new(Gpt::new(tiny()), mixed(Strategy::Ddp, Precision::Bf16), pg).unwrap();
    let b = Batch::from_rows(&global_batch(3, 0, GLOBAL_B, tiny().seq, 256)).unwrap();
    let first = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
    let mut last = first;
    for _ in 0..12 {
        last = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
    }
    assert!(last < first - 1.0, "bf16 loss {first} -> {last}");
    // The compute copies and the gradient buffers are bf16, the master stays fp32.
    assert_eq!(e.config().reduce_dtype, ReduceDtype::Compute);
    assert_eq!(e.units[1].vars[0].as_tensor().dtype(), DType::BF16);
    assert!(matches!(e.units[1].grad, flat::FlatBuf::Bf16(_)));
    assert_eq!(e.full_params().unwrap()[0].len(), e.layout().units[0].numel);

    let world = 2u64;
    let specs = Gpt::new(tiny()).specs();
    let psi = FlatLayout::new(1, &specs).unwrap().total_numel() as u64;
    let s = FlatLayout::new(world as usize, &specs).unwrap().total_shard_len() as u64;
    assert!(s * world >= psi);
    // engine.md §6.1 (K = 12): 16-bit params + 16-bit grads + fp32 master + fp32 m, v;
    // with ReduceDtype::Fp32 the gradient buffers cost 4 bytes instead of 2.
    for (name, params, grads, opt, total, grads32, total32) in [
        ("ddp", 2 * psi, 2 * psi, 12 * psi, 16 * psi, 4 * psi, 18 * psi),
        ("zero1", 2 * psi, 2 * psi, 12 * s, 4 * psi + 12 * s, 4 * psi, 6 * psi + 12 * s),
        ("zero2", 2 * psi, 2 * s, 12 * s, 2 * psi + 14 * s, 4 * s, 2 * psi + 16 * s),
        ("zero3", 2 * s, 2 * s, 12 * s, 16 * s, 4 * s, 18 * s),
    ] {
        let st: Strategy = name.parse().unwrap();
        for (rd, grads, total) in [(ReduceDtype::Compute, grads, total), (ReduceDtype::Fp32, grads32, total32)] {
            let c = mixed_reduce(st, Precision::Bf16, rd);
            let res = run(Run { world: 2, cfg: c, steps: 0..2, micro: 1, load: None, save: None });
            for r in &res {
                let m = r.memory;
                assert_eq!((m.params, m.grads, m.optimizer), (params, grads, opt), "{name}/{rd}: {m:?}");
                assert_eq!(m.model_state(), total, "{name}/{rd}: {m:?}");
                assert!(r.outputs[1].loss < r.outputs[0].loss + 0.5);
            }
        }
    }
}

#[test]
fn bf16_compute_reduce_trains_at_world_2() {
    // 12 steps on one fixed global batch, split over 2 ranks: the loss falls.
    one_thread();
    for st in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let store = std::sync::Arc::new(LocalStore::new());
        let prefix = format!("bf16c{}", rand::random::<u64>());
        let losses: Vec<(f32, f32)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    let (store, prefix) = (store.clone(), prefix.clone());
                    sc.spawn(move || {
                        let pg = ProcessGroup::new(rank, 2, store, &prefix, CommOptions::default()).unwrap();
                        let c = mixed_reduce(st, Precision::Bf16, ReduceDtype::Compute);
                        let mut e = Engine::new(Gpt::new(tiny()), c, pg).unwrap();
                        let rows = global_batch(3, 0, GLOBAL_B, tiny().seq, 256);
                        let b = Batch::from_rows(&crate::model::rank_rows(&rows, rank, 2)).unwrap();
                        let first = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
                        let mut last = first;
                        for _ in 0..12 {
                            last = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
                        }
                        (first, last)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (first, last) in losses {
            assert!(last < first - 1.0, "{st}: bf16 compute-reduce loss {first} -> {last}");
        }
    }
}

#[test]
fn bf16_reduce_dtypes_differ_and_fp32_reduce_is_the_old_path() {
    // Both reduce dtypes reproduce their world-1 references bitwise, and they differ.
    let want32 = params_of(&run(Run { world: 1, cfg: mixed_reduce(Strategy::Ddp, Precision::Bf16, ReduceDtype::Fp32), steps: 0..3, micro: 2, load: None, save: None }));
    for st in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero3] {
        let got = params_of(&run(Run { world: 2, cfg: mixed_reduce(st, Precision::Bf16, ReduceDtype::Fp32), steps: 0..3, micro: 1, load: None, save: None }));
        assert!(got == want32, "bf16/fp32-reduce {st} at world 2 differs from the world-1 reference");
    }
    let want16 = params_of(&run(Run { world: 1, cfg: mixed(Strategy::Ddp, Precision::Bf16), steps: 0..3, micro: 2, load: None, save: None }));
    assert!(want16 != want32);
}

#[test]
fn deterministic_bf16_ddp_equals_the_single_process_reference() {
    // ReduceDtype::Compute (the default): bf16 gradients, reduced in bf16 (folded in f32 and
    // rounded once); the world-1 reference accumulates its 2 micro-batches in bf16.
    for st in [Strategy::Ddp, Strategy::Zero1, Strategy::Zero2, Strategy::Zero3] {
        let want = params_of(&run(Run { world: 1, cfg: mixed(Strategy::Ddp, Precision::Bf16), steps: 0..3, micro: 2, load: None, save: None }));
        let got = params_of(&run(Run { world: 2, cfg: mixed(st, Precision::Bf16), steps: 0..3, micro: 1, load: None, save: None }));
        assert!(got == want, "bf16 {st} at world 2 differs from the world-1 reference");
        // And bf16 really differs from fp32.
        let fp32 = params_of(&run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 0..3, micro: 2, load: None, save: None }));
        assert!(fp32 != want);
    }
}

#[test]
fn bf16_with_offload_and_checkpoint_is_bitwise_the_in_memory_run() {
    let tmp = tempfile::tempdir().unwrap();
    let want = params_of(&run(Run { world: 2, cfg: mixed(Strategy::Zero2, Precision::Bf16), steps: 0..3, micro: 1, load: None, save: None }));
    let ck = tempfile::tempdir().unwrap();
    let mut c = mixed(Strategy::Zero2, Precision::Bf16);
    c.offload = Offload::Cpu;
    run(Run { world: 2, cfg: c, steps: 0..2, micro: 1, load: None, save: Some(ck.path()) });
    let mut c = mixed(Strategy::Zero3, Precision::Bf16);
    c.offload = nvme(tmp.path());
    let got = params_of(&run(Run { world: 2, cfg: c, steps: 2..3, micro: 1, load: Some(ck.path()), save: None }));
    assert!(got == want);
}

#[test]
fn zero3_16_bit_offload_keeps_and_gathers_16_bit_shards() {
    // With offload the fp32 master lives in the tier; what stays resident and is all-gathered
    // is the 16-bit shard, as without offload (not the fp32 master: twice the bytes).
    let tmp = tempfile::tempdir().unwrap();
    for p in [Precision::Bf16, Precision::F16] {
        let want = run(Run { world: 2, cfg: mixed(Strategy::Zero3, p), steps: 0..3, micro: 1, load: None, save: None });
        for off in [Offload::Cpu, nvme(tmp.path())] {
            let mut c = mixed(Strategy::Zero3, p);
            c.offload = off.clone();
            let got = run(Run { world: 2, cfg: c, steps: 0..3, micro: 1, load: None, save: None });
            assert!(params_of(&got) == params_of(&want), "{p:?} zero3 with {} offload differs", off.name());
            for (g, w) in got.iter().zip(&want) {
                assert!(g.state == w.state, "{p:?}/{}: optimizer state differs", off.name());
                let (gm, wm) = (g.memory, w.memory);
                assert_eq!(gm.params, wm.params, "{p:?}/{}: resident shard {gm:?} vs {wm:?}", off.name());
                assert_eq!(gm.optimizer, 0, "{p:?}/{}: {gm:?}", off.name());
                assert_eq!(gm.comm_peak, wm.comm_peak, "{p:?}/{}: gather bytes {gm:?} vs {wm:?}", off.name());
            }
        }
    }
}

#[test]
fn f16_loss_scaling_skips_overflowing_steps() {
    let mut s = LossScaler::default();
    assert_eq!(s.scale, 65536.0);
    s.update(false);
    assert_eq!(s.scale, 32768.0);
    for _ in 0..1999 {
        s.update(true);
    }
    assert_eq!(s.scale, 32768.0);
    s.update(true);
    assert_eq!(s.scale, 65536.0);
    // Never below the floor, however many overflows in a row.
    for _ in 0..200 {
        s.update(false);
    }
    assert_eq!(s.scale, 1.0);
    assert!(s.at_minimum());

    one_thread();
    let pg = ProcessGroup::new(0, 1, std::sync::Arc::new(LocalStore::new()), "f16", CommOptions::default()).unwrap();
    let mut e = Engine::new(Gpt::new(tiny()), mixed(Strategy::Ddp, Precision::F16), pg).unwrap();
    let b = Batch::from_rows(&global_batch(3, 0, GLOBAL_B, tiny().seq, 256)).unwrap();
    let first = e.train_step(std::slice::from_ref(&b)).unwrap();
    assert!(!first.skipped && e.step_count() == 1 && e.loss_scale() == Some(65536.0));
    // A scale that overflows f16 gradients: the step is skipped and the scale halved.
    let before = e.full_params().unwrap();
    if let Some(sc) = e.scaler.as_mut() {
        sc.scale = 1e30;
    }
    let out = e.train_step(std::slice::from_ref(&b)).unwrap();
    assert!(out.skipped, "{out:?}");
    assert_eq!(e.step_count(), 1);
    assert_eq!(e.loss_scale(), Some(5e29));
    assert!(e.full_params().unwrap() == before);
    if let Some(sc) = e.scaler.as_mut() {
        sc.scale = 1024.0;
    }
    let mut last = first.loss;
    for _ in 0..12 {
        last = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
    }
    assert!(last < first.loss - 1.0, "f16 loss {} -> {last}", first.loss);
    assert_eq!(e.step_count(), 13);
    // An overflow at the floor is an error, not a skip (a skip would come back every step).
    let saved = e.scaler;
    if let Some(sc) = e.scaler.as_mut() {
        sc.min_scale = 1e30;
        sc.scale = 1e30;
    }
    let params = e.full_params().unwrap();
    let err = e.train_step(std::slice::from_ref(&b)).unwrap_err();
    assert!(matches!(err, EngineError::NonFinite { step: 14, .. }), "{err}");
    assert!(err.to_string().contains("minimum loss scale"), "{err}");
    assert!(e.full_params().unwrap() == params, "nothing was applied");
    e.scaler = saved;

    // A checkpoint keeps the scaler's count of good steps, so a resumed run doubles the scale at
    // the same step as an uninterrupted one.
    let good = e.scaler.as_ref().map(|sc| sc.good_steps).unwrap();
    assert!(good > 0, "no good step to keep");
    let dir = tempfile::tempdir().unwrap();
    e.save_checkpoint(dir.path(), &crate::checkpoint::Progress { data_position: 13, epoch: 0, rng_state: Vec::new() }, 0).unwrap();
    let pg = ProcessGroup::new(0, 1, std::sync::Arc::new(LocalStore::new()), "f16-resumed", CommOptions::default()).unwrap();
    let mut r = Engine::new(Gpt::new(tiny()), mixed(Strategy::Ddp, Precision::F16), pg).unwrap();
    r.load_checkpoint(dir.path()).unwrap();
    assert_eq!(r.scaler, e.scaler);
}

/// The scale never grows to infinity (every step would then overflow, and halving inf never
/// gets it back), and a good-step count loaded at its maximum does not overflow.
#[test]
fn loss_scale_growth_stops_short_of_infinity() {
    let mut sc = LossScaler { scale: f32::MAX / 1.5, growth_interval: 1, good_steps: 0, min_scale: 1.0 };
    sc.update(true);
    assert_eq!(sc.scale, f32::MAX / 1.5, "a doubling past f32::MAX is skipped");
    assert_eq!(sc.good_steps, 0);
    let mut sc = LossScaler { good_steps: u32::MAX, ..LossScaler::default() };
    sc.update(true);
    assert_eq!((sc.scale, sc.good_steps), (131072.0, 0));
}
