use std::sync::{Arc, Once};

use super::*;
use crate::comm::{BackendKind, CommOptions, LocalStore};
use crate::layout::Strategy;
use crate::model::{Gpt, GptConfig, global_batch, rank_rows};
use crate::optim::{AdamW, Sgd};

thread_local! {
    /// Force the TCP backend (ring traffic formulas) for `run` calls of this test thread.
    static TCP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn one_thread() {
    static ONCE: Once = Once::new();
    // SAFETY: set once, before any test thread starts candle work that reads it.
    ONCE.call_once(|| unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") });
}

fn tiny() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 32,
        layers: 2,
        heads: 2,
        seq: 16,
    }
}

const GLOBAL_B: usize = 8;

fn cfg(strategy: Strategy) -> EngineConfig {
    let mut c = EngineConfig::new(
        strategy,
        OptimizerConfig::AdamW(AdamW {
            lr: 1e-2,
            ..AdamW::default()
        }),
    );
    c.seed = 7;
    c.first_bucket_bytes = 16 << 10;
    c.bucket_cap_bytes = 64 << 10;
    c
}

fn sgd_cfg(strategy: Strategy) -> EngineConfig {
    let mut c = cfg(strategy);
    c.optimizer = OptimizerConfig::Sgd(Sgd { lr: 0.1, momentum: 0.9, weight_decay: 1e-4 });
    c
}

/// Runs `steps` steps on `world` threads; every rank takes its rows of the fixed global batch
/// as `micro` micro-batches. Returns rank 0's full parameters and every rank's engine stats.
fn run(
    world: usize,
    strategy: Strategy,
    deterministic: bool,
    steps: u64,
    micro: usize,
    hosts: usize,
    c: EngineConfig,
) -> (Vec<Vec<f32>>, Vec<(MemoryStats, u64)>) {
    one_thread();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("t{}", rand::random::<u64>());
    let tcp = TCP.with(|t| t.get());
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = store.clone();
            let prefix = prefix.clone();
            let mut c = c.clone();
            c.strategy = strategy;
            std::thread::spawn(move || {
                let opts = CommOptions {
                    deterministic,
                    host_identity: (hosts > 1).then(|| format!("host{}", rank * hosts / world)),
                    backend: if hosts > 1 || tcp {
                        BackendKind::Tcp
                    } else {
                        BackendKind::Shm
                    },
                    // Ring algorithms at every size, so traffic follows the ring formulas.
                    tcp_small_bytes: 0,
                    ..CommOptions::default()
                };
                let pg = ProcessGroup::new(rank, world, store, &prefix, opts).unwrap();
                let registered = strategy.zero_stage() == 0
                    && world > 1
                    && pg.backend() == "shm"
                    && c.grad_dtype() == flat::FlatDtype::F32;
                let mut e = Engine::new(Gpt::new(tiny()), c, pg).unwrap();
                // DDP on one host keeps its gradients in registered (zero-copy) buffers.
                assert_eq!(
                    e.units.iter().all(|u| matches!(&u.grad, flat::FlatBuf::SharedF32(b) if b.is_registered())),
                    registered,
                    "{strategy} world {world}: gradient buffers registered"
                );
                e.reset_traffic();
                for step in 0..steps {
                    let rows = global_batch(3, step, GLOBAL_B, tiny().seq, 256);
                    let mine = rank_rows(&rows, rank, world);
                    let batches: Vec<Batch> = (0..micro)
                        .map(|m| Batch::from_rows(&rank_rows(&mine, m, micro)).unwrap())
                        .collect();
                    e.train_step(&batches).unwrap();
                }
                if registered {
                    // Still registered after steps (the optimizer reads them in place).
                    assert!(e.units.iter().all(|u| matches!(&u.grad, flat::FlatBuf::SharedF32(_))));
                }
                let stats = (e.memory(), e.bytes_sent());
                if std::env::var("ENGINE_TEST_DEBUG").is_ok() {
                    eprintln!("{strategy} rank {rank}: {:?}", e.pg.stats());
                }
                (e.full_params().unwrap(), stats)
            })
        })
        .collect();
    let mut out = Vec::new();
    let mut stats = Vec::new();
    for h in handles {
        let (p, s) = h.join().unwrap();
        out.push(p);
        stats.push(s);
    }
    for p in &out[1..] {
        assert_eq!(p, &out[0], "replicas diverged");
    }
    (out.swap_remove(0), stats)
}

/// ‖a − b‖₂ / ‖b‖₂ over all parameters.
fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        d += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n).sqrt()
}

/// A GPT the kernels cannot run is refused when the engine is built, naming the value: heads 0
/// divided by zero, heads 3 of d_model 10 left a column of attention output unwritten on the
/// native path, and sizes past memory wrapped the parameter counts.
#[test]
fn impossible_models_are_refused_by_name() {
    let cases = [
        (GptConfig { heads: 0, ..tiny() }, "heads 0"),
        (GptConfig { d_model: 10, heads: 3, ..tiny() }, "d_model 10 is not a multiple of heads 3"),
        (GptConfig { vocab: 0, ..tiny() }, "vocab 0"),
        (GptConfig { d_model: 1 << 32, heads: 1, ..tiny() }, "more parameters than memory can address"),
    ];
    for (bad, want) in cases {
        let pg = ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), "bad-model", CommOptions::default()).unwrap();
        let e = Engine::new(Gpt::new(bad), cfg(Strategy::Ddp), pg).err().expect("built an impossible model").to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
    let l = crate::layout::UnitLayout::new("u", &[("w".into(), vec![usize::MAX, 2])], 1).unwrap_err();
    assert!(l.to_string().contains("more elements than memory can address"), "{l}");
}

#[test]
fn single_process_loss_decreases() {
    one_thread();
    let store = Arc::new(LocalStore::new());
    let pg = ProcessGroup::new(0, 1, store, "single", CommOptions::default()).unwrap();
    let mut e = Engine::new(Gpt::new(tiny()), cfg(Strategy::Ddp), pg).unwrap();
    let rows = global_batch(3, 0, GLOBAL_B, tiny().seq, 256);
    let b = Batch::from_rows(&rows).unwrap();
    let first = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
    // ln(256) ≈ 5.55 at init.
    assert!((first - 5.55).abs() < 0.5, "{first}");
    let mut last = first;
    for _ in 0..10 {
        last = e.train_step(std::slice::from_ref(&b)).unwrap().loss;
    }
    assert!(last < first - 1.0, "{first} -> {last}");
}

#[test]
fn fused_kernels_match_composed_ops() {
    one_thread();
    let m = Gpt::new(tiny());
    let c = Gpt::new(tiny()).with_fused(false);
    let rows = global_batch(3, 0, 2, tiny().seq, 256);
    let b = Batch::from_rows(&rows).unwrap();
    let params: Vec<Tensor> = {
        let spec = &m.specs()[1];
        let flat = m.init_unit(1, 1);
        let mut off = 0;
        spec.params
            .iter()
            .map(|(_, s)| {
                let n: usize = s.iter().product();
                let t = Var::from_slice(&flat[off..off + n], s.as_slice(), &Device::Cpu).unwrap();
                off += n;
                t.as_tensor().clone()
            })
            .collect()
    };
    let x = Tensor::randn(0f32, 1.0, (2, tiny().seq, 32), &Device::Cpu).unwrap();
    let ya = m.forward_unit(1, &params, Some(&x), &b).unwrap();
    let yb = c.forward_unit(1, &params, Some(&x), &b).unwrap();
    let d = (&ya - &yb).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(d < 1e-5, "forward {d}");
    let ga = ya.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let gb = yb.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    for p in &params {
        let a = ga.get(p).unwrap();
        let bb = gb.get(p).unwrap();
        let d = (a - bb).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        let s = a.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d <= 1e-4 * s.max(1.0), "grad {d} vs scale {s}");
    }
}

/// Single-process reference for world N: the N per-rank batches as N micro-batches, folded in
/// rank order and divided by N — bitwise what a deterministic reduction computes.
fn reference(world: usize, steps: u64) -> Vec<Vec<f32>> {
    run(1, Strategy::Ddp, true, steps, world, 1, cfg(Strategy::Ddp)).0
}

#[test]
fn strategies_equal_single_process_bitwise_in_deterministic_mode() {
    let steps = 3;
    for world in [2, 4] {
        let want = reference(world, steps);
        for s in ["ddp", "zero1", "zero2", "zero3", "fsdp-shard-grad-op", "fsdp"] {
            let st: Strategy = s.parse().unwrap();
            let (got, _) = run(world, st, true, steps, 1, 1, cfg(st));
            assert!(got == want, "{s} at world {world}: max rel diff {}", max_rel(&got, &want));
        }
    }
    // Hybrid over 2 simulated hosts of 1 rank: shard group of 1, replicas across hosts.
    let want = reference(2, steps);
    let st: Strategy = "hybrid".parse().unwrap();
    let (got, _) = run(2, st, true, steps, 1, 2, cfg(st));
    assert!(got == want, "hybrid world 2: {}", max_rel(&got, &want));
}

#[test]
fn strategies_match_within_tolerance_with_ring_reductions() {
    // SGD: AdamW's m/√v turns rounding-level gradient differences of near-zero gradients into
    // O(lr) parameter differences, which says nothing about the engine.
    let steps = 3;
    let c = sgd_cfg(Strategy::Ddp);
    let want = run(1, Strategy::Ddp, true, steps, 4, 1, c.clone()).0;
    for (s, hosts) in [("ddp", 1), ("zero2", 1), ("zero3", 1), ("hybrid", 2)] {
        let st: Strategy = s.parse().unwrap();
        let (got, _) = run(4, st, false, steps, 1, hosts, c.clone());
        let d = max_rel(&got, &want);
        assert!(d < 1e-6, "{s}: rel diff {d}");
    }
}

#[test]
fn gradient_accumulation_equals_large_batch() {
    // World 2, 2 micro-batches of 2 rows each vs world 2 with one batch of 4 rows.
    let c = sgd_cfg(Strategy::Ddp);
    let (acc, _) = run(2, Strategy::Ddp, true, 2, 2, 1, c.clone());
    let (big, _) = run(2, Strategy::Ddp, true, 2, 1, 1, c);
    let d = max_rel(&acc, &big);
    assert!(d < 1e-6, "{d}");
}

#[test]
fn memory_matches_formulas_and_traffic_ratio() {
    let world = 2;
    let psi: u64 = {
        let l = FlatLayout::new(1, &Gpt::new(tiny()).specs()).unwrap();
        l.total_numel() as u64
    };
    let s: u64 = {
        let l = FlatLayout::new(world, &Gpt::new(tiny()).specs()).unwrap();
        l.total_shard_len() as u64
    };
    let max_unit = FlatLayout::new(1, &Gpt::new(tiny()).specs())
        .unwrap()
        .units
        .iter()
        .map(|u| u.numel as u64)
        .max()
        .unwrap();
    TCP.with(|t| t.set(true));
    let mut sent = std::collections::HashMap::new();
    for (name, want) in [
        ("ddp", 16 * psi),
        ("zero1", 8 * psi + 8 * s),
        ("zero2", 4 * psi + 12 * s),
        ("zero3", 16 * s),
    ] {
        let st: Strategy = name.parse().unwrap();
        let (_, stats) = run(world, st, false, 1, 1, 1, cfg(st));
        for (m, bytes) in &stats {
            assert_eq!(m.model_state(), want, "{name}: {m:?}");
            if name == "zero3" {
                assert!(m.gathered_peak > 0 && m.gathered_peak <= 2 * 4 * max_unit, "{m:?}");
            }
            sent.insert(name, *bytes);
        }
    }
    // Each step's agreements: the micro-batch count [k, -k] and the loss's finiteness first, and
    // after the update whether it went through on every rank, four f32 all-reduced (a two-rank
    // ring sends each element's 4 bytes once).
    let control = 4 * 4;
    for v in sent.values_mut() {
        *v -= control;
    }
    // The tiny model's units are multiples of 2, so no padding: DDP sends 2·(N−1)/N·4Ψ.
    assert_eq!(s * 2, psi);
    assert_eq!(sent["ddp"], 4 * psi);
    assert_eq!(sent["zero1"], 4 * psi);
    assert_eq!(sent["zero2"], 4 * psi);
    // ZeRO-3 = 1.5 × DDP, except that the last unit (the loss head) stays gathered between its
    // forward and backward (FSDP's root unit), saving one all-gather of (N−1)/N of it.
    let head = FlatLayout::new(world, &Gpt::new(tiny()).specs()).unwrap().units.last().unwrap().padded_numel as u64;
    assert_eq!((sent["zero3"] + 4 * head / 2) * 2, sent["ddp"] * 3);

    let sgd = OptimizerConfig::Sgd(Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 });
    let mut c = cfg(Strategy::Zero3);
    c.optimizer = sgd;
    let (_, stats) = run(world, Strategy::Zero3, false, 1, 1, 1, c);
    assert_eq!(stats[0].0.model_state(), 12 * s);
}

/// `StepOutput::comm_wait` counts the time a rank waits for its collectives: a rank whose peer
/// starts its step a second late waits about that second (DDP's bucket all-reduces, ZeRO-3's
/// gathers and reduce-scatters alike), the late rank hardly at all, and a single process never.
#[test]
fn comm_wait_is_the_time_spent_waiting_for_the_peers() {
    one_thread();
    let late = std::time::Duration::from_secs(1);
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let store = Arc::new(LocalStore::new());
        let prefix = format!("wait-{strategy}");
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                let prefix = prefix.clone();
                std::thread::spawn(move || {
                    let pg = ProcessGroup::new(rank, 2, store, &prefix, CommOptions::default()).unwrap();
                    let mut e = Engine::new(Gpt::new(tiny()), cfg(strategy), pg).unwrap();
                    let rows = global_batch(3, 0, GLOBAL_B, tiny().seq, 256);
                    let b = Batch::from_rows(&rank_rows(&rows, rank, 2)).unwrap();
                    // A first step for both, so the timed one starts from the same state.
                    e.train_step(std::slice::from_ref(&b)).unwrap();
                    // The step ends at a collective on both ranks, so they leave it together.
                    if rank == 1 {
                        std::thread::sleep(late);
                    }
                    let start = std::time::Instant::now();
                    let out = e.train_step(std::slice::from_ref(&b)).unwrap();
                    (out.comm_wait, start.elapsed())
                })
            })
            .collect();
        let res: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let (w0, t0) = res[0];
        let (w1, t1) = res[1];
        assert!(w0 <= t0 && w1 <= t1, "{strategy}: waits {w0:?} {w1:?} within steps {t0:?} {t1:?}");
        // Rank 0 cannot finish before rank 1 has started, a second later: all but its own
        // compute (milliseconds for this model) is waiting.
        assert!(w0 >= late / 2, "{strategy}: the early rank waited {w0:?} of {t0:?}");
        assert!(w1 < w0, "{strategy}: the late rank waited {w1:?}, the early one {w0:?}");
    }
    for strategy in [Strategy::Ddp, Strategy::Zero3] {
        let store = Arc::new(LocalStore::new());
        let pg = ProcessGroup::new(0, 1, store, &format!("wait-single-{strategy}"), CommOptions::default()).unwrap();
        let mut e = Engine::new(Gpt::new(tiny()), cfg(strategy), pg).unwrap();
        let b = Batch::from_rows(&global_batch(3, 0, GLOBAL_B, tiny().seq, 256)).unwrap();
        let out = e.train_step(std::slice::from_ref(&b)).unwrap();
        assert_eq!(out.comm_wait, std::time::Duration::ZERO, "{strategy}");
    }
}

/// Optimizer, clipping and schedule settings that would train to NaN, or the wrong way, are
/// refused when the engine is built, each named with its value.
#[test]
fn bad_training_settings_are_refused_by_name() {
    let adam = |f: fn(&mut AdamW)| {
        let mut a = AdamW { lr: 1e-2, ..AdamW::default() };
        f(&mut a);
        let mut c = cfg(Strategy::Ddp);
        c.optimizer = OptimizerConfig::AdamW(a);
        c
    };
    let mut clip = cfg(Strategy::Ddp);
    clip.clip_grad_norm = Some(-1.0);
    let mut clip_nan = cfg(Strategy::Ddp);
    clip_nan.clip_grad_norm = Some(f64::NAN);
    let mut sgd = sgd_cfg(Strategy::Ddp);
    sgd.optimizer = OptimizerConfig::Sgd(Sgd { lr: -0.1, momentum: 0.9, weight_decay: 0.0 });
    let mut bucket = cfg(Strategy::Ddp);
    bucket.bucket_cap_bytes = 0;
    let cases = [
        (bucket, "bucket_cap_bytes 0 and first_bucket_bytes 16384: expected sizes of at least 1 byte"),
        (adam(|a| a.beta1 = 1.0), "AdamW beta1 1: expected a value in [0, 1)"),
        (adam(|a| a.beta2 = -0.5), "AdamW beta2 -0.5"),
        (adam(|a| a.lr = f64::INFINITY), "AdamW lr inf"),
        (adam(|a| a.eps = -1e-8), "AdamW eps -0.00000001"),
        (clip, "clip_grad_norm -1: expected a finite norm > 0"),
        (clip_nan, "clip_grad_norm NaN"),
        (sgd, "SGD lr -0.1"),
    ];
    for (bad, want) in cases {
        let pg = ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), "bad-cfg", CommOptions::default()).unwrap();
        let e = Engine::new(Gpt::new(tiny()), bad, pg).err().expect("built with a bad setting").to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}

/// Runs `f(rank, engine)` on `world` threads over one store and returns each rank's result.
fn on_ranks<T: Send + 'static>(
    world: usize,
    hosts: usize,
    c: EngineConfig,
    f: impl Fn(usize, EngineResult<Engine<Gpt>>) -> T + Send + Sync + 'static,
) -> Vec<T> {
    one_thread();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("t{}", rand::random::<u64>());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, prefix, c, f) = (store.clone(), prefix.clone(), c.clone(), f.clone());
            std::thread::spawn(move || {
                let opts = CommOptions {
                    host_identity: (hosts > 1).then(|| format!("host{}", rank * hosts / world)),
                    backend: if hosts > 1 { BackendKind::Tcp } else { BackendKind::Shm },
                    timeout: std::time::Duration::from_secs(20),
                    ..CommOptions::default()
                };
                let pg = ProcessGroup::new(rank, world, store, &prefix, opts).unwrap();
                f(rank, Engine::new(Gpt::new(tiny()), c, pg))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// One rank's batches for `step`, as `micro` micro-batches.
fn batches(rank: usize, world: usize, step: u64, micro: usize) -> Vec<Batch> {
    let rows = global_batch(3, step, GLOBAL_B, tiny().seq, 256);
    let mine = rank_rows(&rows, rank, world);
    (0..micro).map(|m| Batch::from_rows(&rank_rows(&mine, m, micro)).unwrap()).collect()
}

/// Ranks that pass different numbers of micro-batches fail the step together, naming the counts
/// (ZeRO-2 hung in its reduce-scatters, DDP's replicas drifted apart silently).
#[test]
fn ranks_that_disagree_on_micro_batches_fail_together() {
    for strategy in [Strategy::Ddp, "zero2".parse().unwrap()] {
        let got = on_ranks(2, 1, cfg(strategy), move |rank, e| {
            let mut e = e.unwrap();
            e.train_step(&batches(rank, 2, 0, 2 + rank)).err().map(|e| e.to_string())
        });
        for (rank, e) in got.into_iter().enumerate() {
            let e = e.unwrap_or_else(|| panic!("{strategy} rank {rank} stepped"));
            assert!(e.contains("different numbers of micro-batches to train_step (from 2 to 3"), "{strategy} rank {rank}: {e}");
        }
    }
}

/// A loss that is not finite on one rank fails the step on every rank (its gradients reached the
/// others through the all-reduce; before, they stepped on with NaN parameters).
#[test]
fn a_nonfinite_loss_on_one_rank_fails_every_rank() {
    let got = on_ranks(2, 1, cfg(Strategy::Ddp), |rank, e| {
        let mut e = e.unwrap();
        if rank == 1 {
            let v = &e.units[0].vars[0];
            let nan = (v.as_tensor().ones_like().unwrap() * f64::NAN).unwrap();
            v.set(&nan).unwrap();
        }
        e.train_step(&batches(rank, 2, 0, 1)).err().map(|e| e.to_string())
    });
    assert!(got[1].as_deref().is_some_and(|e| e.contains("loss")), "{got:?}");
    assert!(got[0].as_deref().is_some_and(|e| e.contains("loss of another rank")), "{got:?}");
}

/// Hybrid sharding over hosts with different numbers of ranks is refused when the engine is
/// built, naming each host's count.
#[test]
fn hybrid_sharding_over_uneven_hosts_is_refused() {
    let got = on_ranks(3, 2, cfg("hybrid".parse().unwrap()), |_, e| e.err().map(|e| e.to_string()));
    for e in got {
        let e = e.expect("built over uneven hosts");
        assert!(e.contains("same number of ranks on every host, got host 0: 2, host 1: 1"), "{e}");
    }
}

/// An optimizer update that fails on one rank (an offload tier's I/O error, here injected)
/// fails the step on every rank, and leaves each engine unusable rather than part-updated:
/// later steps and checkpoint saves are refused with the reason, on every rank.
#[test]
fn a_failed_update_on_one_rank_fails_every_rank_and_the_engine_stays_failed() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_owned();
    let got = on_ranks(2, 1, cfg(Strategy::Ddp), move |rank, e| {
        let mut e = e.unwrap();
        e.fail_update_of = (rank == 1).then_some(1);
        let step = e.train_step(&batches(rank, 2, 0, 1)).map(drop).map_err(|e| e.to_string());
        let again = e.train_step(&batches(rank, 2, 1, 1)).map(drop).map_err(|e| e.to_string());
        let progress = crate::checkpoint::Progress { data_position: 1, epoch: 0, rng_state: Vec::new() };
        let save = e.save_checkpoint(&root, &progress, 0).map(drop).map_err(|e| e.to_string());
        (step, again, save)
    });
    let (step0, again0, save0) = &got[0];
    let (step1, again1, save1) = &got[1];
    assert!(step1.as_ref().is_err_and(|e| e.contains("injected failure of unit 1")), "{step1:?}");
    assert!(step0.as_ref().is_err_and(|e| e.contains("the optimizer step 1 failed on another rank")), "{step0:?}");
    for r in [again0, again1, save0, save1] {
        assert!(r.as_ref().is_err_and(|e| e.contains("the engine is unusable since step 1 failed")), "{r:?}");
    }
    assert!(!dir.path().join(crate::checkpoint::step_dir_name(1)).exists());
}

/// An offload tier that cannot be set up on one rank (its directory missing on that node)
/// fails Engine::new on every rank, promptly and naming the cause on the rank that has it.
#[test]
fn an_offload_tier_that_fails_on_one_rank_fails_every_rank() {
    one_thread();
    let tmp = tempfile::tempdir().unwrap();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("t{}", rand::random::<u64>());
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (store, prefix) = (store.clone(), prefix.clone());
            let dir = if rank == 1 { tmp.path().join("missing-on-this-node") } else { tmp.path().to_owned() };
            std::thread::spawn(move || {
                let mut c = cfg(Strategy::Zero2);
                c.offload = Offload::Nvme(crate::offload::NvmeConfig::new(&dir, "tier-test"));
                let opts = CommOptions { timeout: std::time::Duration::from_secs(20), ..CommOptions::default() };
                let pg = ProcessGroup::new(rank, 2, store, &prefix, opts).unwrap();
                let t0 = std::time::Instant::now();
                let e = Engine::new(Gpt::new(tiny()), c, pg).err().map(|e| e.to_string());
                (e, t0.elapsed())
            })
        })
        .collect();
    let got: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (e0, t0) = &got[0];
    let (e1, _) = &got[1];
    assert!(e1.as_ref().is_some_and(|e| e.contains("missing-on-this-node")), "{e1:?}");
    assert!(e0.as_ref().is_some_and(|e| e.contains("failed on another rank")), "{e0:?}");
    assert!(*t0 < std::time::Duration::from_secs(15), "rank 0 waited {t0:?}, as long as a collective's timeout");
}

/// With clipping on, a gradient that is not finite (a loss that is) fails the step on every rank
/// before anything is applied, instead of clipping by 1 and writing NaN into the weights.
#[test]
fn a_non_finite_gradient_norm_fails_the_step_and_applies_nothing() {
    let mut c = cfg(Strategy::Ddp);
    c.clip_grad_norm = Some(1.0);
    let got = on_ranks(2, 1, c, move |rank, e| {
        let mut e = e.unwrap();
        let before = e.full_params().unwrap();
        e.poison_grads = true;
        let err = e.train_step(&batches(rank, 2, 0, 1)).map(drop).map_err(|e| e.to_string());
        let unchanged = e.full_params().unwrap() == before;
        // The engine goes on once the gradients are sound again.
        e.poison_grads = false;
        let next = e.train_step(&batches(rank, 2, 0, 1)).map(|o| o.grad_norm.is_some_and(f64::is_finite));
        (err, unchanged, next.ok())
    });
    for (rank, (err, unchanged, next)) in got.iter().enumerate() {
        assert!(err.as_ref().is_err_and(|e| e == "non-finite gradient norm at step 1"), "rank {rank}: {err:?}");
        assert!(*unchanged, "rank {rank}: weights changed");
        assert_eq!(*next, Some(true), "rank {rank}");
    }
}

/// DDP buckets run from the last unit back: the first closes at `first_bytes`, the others at
/// `cap_bytes`, a unit is never split, and the first unit closes whatever is left.
#[test]
fn buckets_cover_every_unit_once_from_the_back() {
    let unit = |name: &str, n: usize| crate::layout::UnitSpec {
        name: name.into(),
        params: vec![(format!("{name}.w"), vec![n])],
    };
    // 4-byte elements: 100, 50, 300, 10, 20 elements = 400, 200, 1200, 40, 80 bytes.
    let specs = [unit("a", 100), unit("b", 50), unit("c", 300), unit("d", 10), unit("e", 20)];
    let layout = FlatLayout::new(1, &specs).unwrap();
    // First bucket closes at 100 bytes: e (80) + d (40) = 120. Then 1000: c (1200) alone. Then b + a.
    assert_eq!(make_buckets(&layout, 100, 1000), vec![3..5, 2..3, 0..2]);
    // One bucket for everything when the caps are never reached.
    assert_eq!(make_buckets(&layout, usize::MAX, usize::MAX), vec![0..5]);
    // A bucket per unit when each unit alone reaches the cap.
    assert_eq!(make_buckets(&layout, 1, 1), vec![4..5, 3..4, 2..3, 1..2, 0..1]);
    let huge = FlatLayout::new(1, &[unit("x", 1)]).unwrap();
    assert_eq!(make_buckets(&huge, 0, 0), vec![0..1]);
}
