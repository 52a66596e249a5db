//! Checkpoint round trips through the engine: resharding across world sizes and strategies
//! continues bit for bit, and damaged checkpoints fail clearly on every rank.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};

use super::*;
use crate::checkpoint::Progress;
use crate::layout::ShardState;
use crate::comm::{CommOptions, LocalStore};
use crate::model::{Gpt, GptConfig, global_batch, rank_rows};
use crate::optim::AdamW;

pub(super) fn one_thread() {
    static ONCE: Once = Once::new();
    // SAFETY: set once, before any test thread starts candle work that reads it.
    ONCE.call_once(|| unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") });
}

/// d_model 30: block units are not multiples of 4, so world 4 pads and resharding re-pads.
pub(super) fn tiny() -> GptConfig {
    GptConfig {
        vocab: 256,
        d_model: 30,
        layers: 2,
        heads: 2,
        seq: 16,
    }
}

pub(super) const GLOBAL_B: usize = 8;

pub(super) fn cfg(strategy: Strategy) -> EngineConfig {
    let mut c = EngineConfig::new(
        strategy,
        OptimizerConfig::AdamW(AdamW {
            lr: 1e-2,
            ..AdamW::default()
        }),
    );
    c.seed = 7;
    c.clip_grad_norm = Some(1.0);
    c.first_bucket_bytes = 16 << 10;
    c.bucket_cap_bytes = 64 << 10;
    c
}

/// What one threaded run does.
pub(super) struct Run<'a> {
    pub world: usize,
    pub cfg: EngineConfig,
    /// Global steps to train (the data of step `s` is fixed by `s`).
    pub steps: Range<u64>,
    /// Micro-batches per rank per step.
    pub micro: usize,
    pub load: Option<&'a Path>,
    pub save: Option<&'a Path>,
}

/// Per rank: full parameters, memory stats, step outputs, and the load/save results.
pub(super) struct RankResult {
    pub params: Vec<Vec<f32>>,
    pub memory: MemoryStats,
    pub outputs: Vec<StepOutput>,
    pub loaded: Option<EngineResult<(PathBuf, Progress)>>,
    pub state: ShardState,
}

pub(super) fn run(r: Run<'_>) -> Vec<RankResult> {
    one_thread();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("c{}", rand::random::<u64>());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..r.world)
            .map(|rank| {
                let store = store.clone();
                let prefix = prefix.clone();
                let r = &r;
                s.spawn(move || {
                    let opts = CommOptions {
                        deterministic: true,
                        ..CommOptions::default()
                    };
                    let pg = ProcessGroup::new(rank, r.world, store, &prefix, opts).unwrap();
                    let mut e = Engine::new(Gpt::new(tiny()), r.cfg.clone(), pg).unwrap();
                    let loaded = r.load.map(|p| e.load_checkpoint(p));
                    if matches!(loaded, Some(Err(_))) {
                        let state = e.shard_state().unwrap();
                        return RankResult {
                            params: Vec::new(),
                            memory: e.memory(),
                            outputs: Vec::new(),
                            loaded,
                            state,
                        };
                    }
                    assert_eq!(e.step_count(), r.steps.start, "rank {rank}: step after load");
                    let mut outputs = Vec::new();
                    for step in r.steps.clone() {
                        let rows = global_batch(3, step, GLOBAL_B, tiny().seq, 256);
                        let mine = rank_rows(&rows, rank, r.world);
                        let batches: Vec<Batch> = (0..r.micro)
                            .map(|m| Batch::from_rows(&rank_rows(&mine, m, r.micro)).unwrap())
                            .collect();
                        outputs.push(e.train_step(&batches).unwrap());
                    }
                    if let Some(root) = r.save {
                        let progress = Progress {
                            data_position: r.steps.end,
                            epoch: 1,
                            rng_state: vec![7, 7],
                        };
                        let dir = e.save_checkpoint(root, &progress, 2).unwrap();
                        assert!(dir.ends_with(crate::checkpoint::step_dir_name(r.steps.end)));
                    }
                    let state = e.shard_state().unwrap();
                    RankResult {
                        params: e.full_params().unwrap(),
                        memory: e.memory(),
                        outputs,
                        loaded,
                        state,
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank 0's parameters; asserts that every replica agrees.
pub(super) fn params_of(results: &[RankResult]) -> Vec<Vec<f32>> {
    for r in &results[1..] {
        assert!(r.params == results[0].params, "replicas diverged");
    }
    results[0].params.clone()
}

/// The uninterrupted reference: one process whose steps `[0, split)` take `w1` micro-batches
/// and steps `[split, end)` `w2` — bitwise what deterministic runs at world `w1` then `w2` do.
fn reference(w1: usize, split: u64, w2: usize, end: u64) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let c = cfg(Strategy::Ddp);
    run(Run { world: 1, cfg: c.clone(), steps: 0..split, micro: w1, load: None, save: Some(dir.path()) });
    params_of(&run(Run { world: 1, cfg: c, steps: split..end, micro: w2, load: Some(dir.path()), save: None }))
}

fn reference_no_ckpt(w1: usize, split: u64, w2: usize, end: u64) -> Vec<Vec<f32>> {
    // The same without a checkpoint in between: one engine, micro-batch count switching.
    one_thread();
    let pg = ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), "ref", CommOptions { deterministic: true, ..CommOptions::default() }).unwrap();
    let mut e = Engine::new(Gpt::new(tiny()), cfg(Strategy::Ddp), pg).unwrap();
    for step in 0..end {
        let n = if step < split { w1 } else { w2 };
        let rows = global_batch(3, step, GLOBAL_B, tiny().seq, 256);
        let batches: Vec<Batch> = (0..n).map(|m| Batch::from_rows(&rank_rows(&rows, m, n)).unwrap()).collect();
        e.train_step(&batches).unwrap();
    }
    e.full_params().unwrap()
}

#[test]
fn checkpoint_reshards_across_worlds_and_strategies_and_continues_bitwise() {
    let (split, end) = (2u64, 4u64);
    let cases: &[(usize, &str, usize, &str)] = &[
        (4, "zero3", 2, "zero3"),
        (2, "zero3", 4, "zero3"),
        (2, "ddp", 4, "zero1"),
        (4, "zero1", 2, "ddp"),
        (2, "zero3", 2, "ddp"),
        (2, "ddp", 2, "zero3"),
        (4, "zero2", 2, "fsdp"),
    ];
    let mut refs = std::collections::HashMap::new();
    for &(w1, s1, w2, s2) in cases {
        let want = refs
            .entry((w1, w2))
            .or_insert_with(|| {
                let a = reference_no_ckpt(w1, split, w2, end);
                // A world-1 save/load in the middle changes nothing either.
                assert!(a == reference(w1, split, w2, end), "world-1 checkpoint round trip");
                a
            })
            .clone();
        let dir = tempfile::tempdir().unwrap();
        let st1: Strategy = s1.parse().unwrap();
        let st2: Strategy = s2.parse().unwrap();
        run(Run { world: w1, cfg: cfg(st1), steps: 0..split, micro: 1, load: None, save: Some(dir.path()) });
        let res = run(Run { world: w2, cfg: cfg(st2), steps: split..end, micro: 1, load: Some(dir.path()), save: None });
        for r in &res {
            let (loaded, progress) = r.loaded.clone().unwrap().unwrap();
            assert_eq!(loaded, dir.path().join("step-000000002"));
            assert_eq!(progress, Progress { data_position: split, epoch: 1, rng_state: vec![7, 7] });
        }
        let got = params_of(&res);
        assert!(got == want, "{s1}@{w1} -> {s2}@{w2} differs from the uninterrupted run");
    }
}

#[test]
fn shard_state_round_trips_exactly() {
    for s in ["ddp", "zero1", "zero2", "zero3"] {
        let st: Strategy = s.parse().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let saved = run(Run { world: 2, cfg: cfg(st), steps: 0..2, micro: 1, load: None, save: Some(dir.path()) });
        let loaded = run(Run { world: 2, cfg: cfg(st), steps: 2..2, micro: 1, load: Some(dir.path()), save: None });
        for (a, b) in saved.iter().zip(&loaded) {
            assert_eq!(a.state.step, 2);
            assert!(a.state == b.state, "{s}: shard state changed through save/load");
            assert!(a.state.state.iter().flatten().flatten().any(|x| *x != 0.0), "{s}: no optimizer state");
        }
        assert!(params_of(&saved) == params_of(&loaded), "{s}");
    }
}

#[test]
fn load_shard_state_rejects_foreign_state() {
    let res = run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 0..1, micro: 1, load: None, save: None });
    let mut s = res[0].state.clone();
    one_thread();
    let pg = ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), "x", CommOptions::default()).unwrap();
    let mut e = Engine::new(Gpt::new(tiny()), cfg(Strategy::Ddp), pg).unwrap();
    s.optimizer = "sgd".into();
    let err = e.load_shard_state(s.clone()).unwrap_err().to_string();
    assert!(err.contains("\"sgd\""), "{err}");
    s.optimizer = "adamw".into();
    s.loss_scale = Some(0.0);
    let err = e.load_shard_state(s.clone()).unwrap_err().to_string();
    assert!(err.contains("loss scale 0: expected a finite number above 0"), "{err}");
    s.loss_scale = None;
    s.master[1].pop();
    let err = e.load_shard_state(s).unwrap_err().to_string();
    assert!(err.contains("master of unit block.0"), "{err}");
    // Refused before anything changed: the engine still trains.
    let b = Batch::from_rows(&global_batch(3, 0, GLOBAL_B, tiny().seq, 256)).unwrap();
    e.train_step(&[b]).unwrap();
}

#[test]
fn corrupted_or_missing_checkpoint_fails_clearly_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    run(Run { world: 2, cfg: cfg(Strategy::Zero2), steps: 0..1, micro: 1, load: None, save: Some(dir.path()) });
    let ckpt = dir.path().join("step-000000001");
    // Flip one byte near the end of shard 1 (in a data section only rank 1 reads at world 2).
    let shard = ckpt.join("shard-00001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 9] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let res = run(Run { world: 2, cfg: cfg(Strategy::Zero2), steps: 1..1, micro: 1, load: Some(dir.path()), save: None });
    let e1 = res[1].loaded.clone().unwrap().unwrap_err().to_string();
    assert!(e1.contains("shard-00001.bin") && e1.contains("checksum mismatch"), "{e1}");
    let e0 = res[0].loaded.clone().unwrap().unwrap_err().to_string();
    assert!(e0.contains("failed on another rank") || e0.contains("shard-00001.bin"), "{e0}");
    // Truncated metadata.
    std::fs::write(ckpt.join("metadata.json"), b"{\"format_version\": 1").unwrap();
    let res = run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 1..1, micro: 1, load: Some(&ckpt), save: None });
    let e = res[0].loaded.clone().unwrap().unwrap_err().to_string();
    assert!(e.contains("metadata.json"), "{e}");
    // Nothing committed.
    let empty = tempfile::tempdir().unwrap();
    let res = run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 0..0, micro: 1, load: Some(empty.path()), save: None });
    let e = res[0].loaded.clone().unwrap().unwrap_err().to_string();
    assert!(e.contains("no committed checkpoint"), "{e}");
}

/// Ranks that each take the latest checkpoint of their own directory (node-local disks) and find
/// different steps fail on every rank, naming both, instead of training from different states.
#[test]
fn ranks_that_loaded_different_checkpoints_fail_on_every_rank() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    run(Run { world: 2, cfg: cfg(Strategy::Ddp), steps: 0..1, micro: 1, load: None, save: Some(a.path()) });
    run(Run { world: 2, cfg: cfg(Strategy::Ddp), steps: 0..2, micro: 1, load: None, save: Some(b.path()) });
    one_thread();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("c{}", rand::random::<u64>());
    let roots = [a.path(), b.path()];
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let (store, prefix, root) = (store.clone(), prefix.clone(), roots[rank]);
                s.spawn(move || {
                    let pg = ProcessGroup::new(rank, 2, store, &prefix, CommOptions::default()).unwrap();
                    let mut e = Engine::new(Gpt::new(tiny()), cfg(Strategy::Ddp), pg).unwrap();
                    let before = e.full_params().unwrap();
                    let err = e.load_checkpoint(root).unwrap_err().to_string();
                    // Refused before anything changed: the engine is as it was and trains on
                    // (a script may start fresh).
                    assert_eq!(e.full_params().unwrap(), before, "rank {rank}: a refused load changed the model");
                    let rows = global_batch(3, 0, GLOBAL_B, tiny().seq, 256);
                    e.train_step(&[Batch::from_rows(&rank_rows(&rows, rank, 2)).unwrap()]).unwrap();
                    err
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(e.contains("the ranks loaded different checkpoints") && e.contains("steps range over 1..=2"), "rank {rank}: {e}");
        assert!(e.contains("data positions over 1..=2") && e.contains(&roots[rank].display().to_string()), "rank {rank}: {e}");
    }
}

/// Hybrid sharding with ranks placed round-robin over the hosts (Slurm's cyclic distribution:
/// ranks 0 and 2 on host A, 1 and 3 on host B): the first host's ranks write their shards, so the
/// checkpoint commits and loads back as the same model.
#[test]
fn hybrid_checkpoint_with_round_robin_ranks_commits_and_loads() {
    let root = tempfile::tempdir().unwrap();
    one_thread();
    let store = Arc::new(LocalStore::new());
    let prefix = format!("c{}", rand::random::<u64>());
    let hybrid: Strategy = "hybrid".parse().unwrap();
    let saved: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|rank| {
                let (store, prefix, root) = (store.clone(), prefix.clone(), root.path());
                s.spawn(move || {
                    let opts = CommOptions {
                        host_identity: Some(format!("host{}", rank % 2)),
                        backend: crate::comm::BackendKind::Tcp,
                        ..CommOptions::default()
                    };
                    let pg = ProcessGroup::new(rank, 4, store, &prefix, opts).unwrap();
                    let mut e = Engine::new(Gpt::new(tiny()), cfg(hybrid), pg).unwrap();
                    let rows = global_batch(3, 0, GLOBAL_B, tiny().seq, 256);
                    e.train_step(&[Batch::from_rows(&rank_rows(&rows, rank, 4)).unwrap()]).unwrap();
                    let progress = Progress { data_position: 1, epoch: 0, rng_state: Vec::new() };
                    e.save_checkpoint(root, &progress, 0).unwrap();
                    e.full_params().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let dir = root.path().join(crate::checkpoint::step_dir_name(1));
    for f in ["shard-00000.bin", "shard-00001.bin"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    crate::checkpoint::verify(&dir).unwrap();
    let res = run(Run { world: 1, cfg: cfg(Strategy::Ddp), steps: 1..1, micro: 1, load: Some(root.path()), save: None });
    assert!(res[0].params == saved[0], "the loaded model is not the saved one");
}

/// A shard bigger than one load batch (here every unit is a batch of its own) is read through
/// first, so a damaged section is refused before anything changes, then installed batch by
/// batch: the resumed run still continues bitwise, and a refused load leaves the engine usable.
#[test]
fn checkpoint_loads_a_batch_of_units_at_a_time() {
    use std::sync::atomic::Ordering;
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            crate::checkpoint::TEST_LOAD_BATCH_BYTES.store(0, Ordering::Relaxed);
        }
    }
    let _reset = Reset;
    crate::checkpoint::TEST_LOAD_BATCH_BYTES.store(1, Ordering::Relaxed);
    let (split, end) = (2u64, 4u64);
    let want = reference_no_ckpt(2, split, 4, end);
    let dir = tempfile::tempdir().unwrap();
    run(Run { world: 2, cfg: cfg(Strategy::Zero3), steps: 0..split, micro: 1, load: None, save: Some(dir.path()) });
    let res = run(Run { world: 4, cfg: cfg(Strategy::Zero2), steps: split..end, micro: 1, load: Some(dir.path()), save: None });
    assert!(params_of(&res) == want, "zero3@2 -> zero2@4 in batches differs from the uninterrupted run");

    // Damage the last section of shard 0: the read-through finds it before any unit changes.
    let shard = dir.path().join("step-000000002").join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 5] ^= 0x40;
    std::fs::write(&shard, bytes).unwrap();
    let res = run(Run { world: 2, cfg: cfg(Strategy::Zero3), steps: 0..1, micro: 1, load: Some(dir.path()), save: None });
    let e0 = res[0].loaded.clone().unwrap().unwrap_err().to_string();
    assert!(e0.contains("shard-00000.bin") && e0.contains("checksum mismatch"), "{e0}");
    // The refused engines are unchanged and usable (`run` took their shard state).
    for r in &res {
        assert_eq!(r.state.step, 0);
    }
}

/// Shard states of different steps fail `load_shard_state` on every rank instead of installing
/// (DDP replicas from different weights, ZeRO shards with different bias corrections).
#[test]
fn shard_states_of_different_steps_fail_on_every_rank() {
    let saved = run(Run { world: 2, cfg: cfg(Strategy::Zero2), steps: 0..1, micro: 1, load: None, save: None });
    let store = Arc::new(LocalStore::new());
    let errors: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = saved
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let (store, mut state) = (store.clone(), r.state.clone());
                s.spawn(move || {
                    if rank == 1 {
                        state.step = 7;
                    }
                    let pg = ProcessGroup::new(rank, 2, store, "steps", CommOptions::default()).unwrap();
                    let mut e = Engine::new(Gpt::new(tiny()), cfg(Strategy::Zero2), pg).unwrap();
                    let err = e.load_shard_state(state).unwrap_err().to_string();
                    // Refused before anything changed: the engine still trains.
                    let b = Batch::from_rows(&rank_rows(&global_batch(3, 0, GLOBAL_B, tiny().seq, 256), rank, 2)).unwrap();
                    e.train_step(&[b]).unwrap();
                    err
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errors {
        assert!(e.contains("shard states are of different steps") && e.contains("range over 1..=7"), "{e}");
    }
}

/// Ranks built with different configurations fail `Engine::new` on every rank (a different
/// learning rate on one DDP rank trained replicas that drifted apart without an error), and a
/// configuration one rank refuses fails the others at once, instead of leaving them in the
/// first broadcast until the op timeout.
#[test]
fn ranks_with_different_configurations_fail_together() {
    let build = |edit: fn(usize, &mut EngineConfig)| -> Vec<String> {
        let store = Arc::new(LocalStore::new());
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let store = store.clone();
                    s.spawn(move || {
                        let mut c = cfg(Strategy::Ddp);
                        edit(rank, &mut c);
                        let pg = ProcessGroup::new(rank, 2, store, "cfg", CommOptions::default()).unwrap();
                        Engine::new(Gpt::new(tiny()), c, pg).err().map(|e| e.to_string()).unwrap_or_default()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let errs = build(|rank, c| {
        if rank == 1
            && let OptimizerConfig::AdamW(a) = &mut c.optimizer
        {
            a.lr = 1e-3;
        }
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("the ranks' engine configurations differ") && e.contains(&format!("rank {rank}'s is strategy=ddp")), "{e}");
    }
    assert!(errs[1].contains("lr: 0.001") && errs[0].contains("lr: 0.01"), "{errs:?}");
    let errs = build(|rank, c| {
        if rank == 1 {
            c.max_live_units = 0;
        }
    });
    assert!(errs[1].contains("max_live_units must be at least 1"), "{errs:?}");
    assert!(errs[0].contains("refused on another rank"), "{errs:?}");
    // The seed may differ (rank 0's initialisation is broadcast).
    let errs = build(|rank, c| c.seed = rank as u64);
    assert!(errs.iter().all(String::is_empty), "{errs:?}");
}
