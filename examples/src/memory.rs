//! What a training run needs in memory per rank, checked before anything is allocated: a model
//! that cannot fit is refused with the figures, instead of aborting on a failed allocation or
//! being killed by the kernel partway through its first step (DeepSpeed's
//! `estimate_zero*_model_states_mem_needs`, done for the user).
//!
//! [`need`] is pure: the engine's memory table (`engine.rs`, engine.md §6.1) for the strategy,
//! precision and offload, plus a lower bound on the activations the step keeps for its
//! backward. [`available`] reads what the host (and the process's cgroup) can still give.

use rsrun_training_engine::engine::{Offload, Precision, ReduceDtype};
use rsrun_training_engine::layout::{FlatLayout, Strategy};
use rsrun_training_engine::model::{Gpt, GptConfig, UnitModel};

/// Bytes one rank needs, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// Parameters in the compute dtype: full replicas, or the shard under ZeRO-3.
    pub params: u64,
    /// Gradient buffers: full, or the shard under ZeRO-2/3.
    pub grads: u64,
    /// The fp32 master copy (mixed precision, and any CPU offload) and the optimizer's two AdamW
    /// slots over the rank's own range; in host memory with CPU offload too (rounded up there to
    /// whole tiles, which this leaves out), on disk with NVMe offload.
    pub optimizer: u64,
    /// A lower bound on one micro-batch's activations: each block's output and the logits.
    pub activations: u64,
    /// The data order: the sampler's shuffled window indices (4 bytes a window, one table per
    /// rank).
    pub data_order: u64,
    /// Parameters in the model.
    pub parameters: u64,
}

impl Need {
    /// Everything.
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.data_order
    }

    /// Model state: what `Engine::memory().model_state()` reports, plus the offloaded host
    /// state for CPU offload.
    pub fn model_state(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// The run's shape as the memory table needs it.
#[derive(Debug, Clone)]
pub struct Plan {
    pub gpt: GptConfig,
    pub strategy: Strategy,
    /// Ranks that share a shard of the state: the world for ZeRO/FSDP, the ranks of one host for
    /// hybrid, 1 for DDP.
    pub shard_world: usize,
    pub precision: Precision,
    pub reduce_dtype: ReduceDtype,
    pub offload: Offload,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Windows of the data one epoch shuffles.
    pub windows: u64,
}

/// What one rank of `plan` needs.
///
/// # Errors
/// A layout the engine would refuse too (a zero shard world).
pub fn need(plan: &Plan) -> Result<Need, rsrun_training_engine::EngineError> {
    let specs = Gpt::new(plan.gpt).specs();
    let psi = FlatLayout::new(1, &specs)?.total_numel() as u64;
    let stage = plan.strategy.zero_stage();
    let shard_world = if stage == 0 { 1 } else { plan.shard_world.max(1) };
    let s = FlatLayout::new(shard_world, &specs)?.total_shard_len() as u64;
    let mixed = plan.precision != Precision::Fp32;
    let compute = plan.precision.bytes() as u64;
    // Gradient buffers: the compute dtype, or fp32 when asked to reduce in fp32 (mixed).
    let grad_bytes = if mixed && plan.reduce_dtype == ReduceDtype::Fp32 { 4 } else { compute };
    let params = compute * if plan.strategy.shards_params() { s } else { psi };
    let grads = grad_bytes * if stage >= 2 { s } else { psi };
    // The rank's own range: everything under DDP, its shard otherwise.
    let owned = if stage == 0 { psi } else { s };
    // AdamW's m and v, and the separate fp32 master in mixed precision (fp32 updates the
    // parameters themselves); NVMe offload keeps them on disk, CPU offload in host memory.
    let optimizer = match plan.offload {
        Offload::Nvme(_) => 0,
        // The tier keeps its own fp32 master beside the compute parameters, in any precision.
        Offload::Cpu => owned * 12,
        Offload::None => owned * if mixed { 12 } else { 8 },
    };
    let g = plan.gpt;
    let tokens = (plan.batch * g.seq) as u64;
    let activations = 4 * tokens * (g.layers as u64 * g.d_model as u64 + g.vocab as u64);
    Ok(Need {
        params,
        grads,
        optimizer,
        activations,
        data_order: 4 * plan.windows,
        parameters: psi,
    })
}

/// Bytes this process can still get: the host's `MemAvailable` plus free swap, or less where
/// its cgroup's `memory.max` leaves less. `None` where neither can be read.
pub fn available() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let kib = |key: &str| -> Option<u64> {
            m.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        };
        Some((kib("MemAvailable:")? + kib("SwapFree:").unwrap_or(0)) * 1024)
    });
    let cgroup = cgroup_left();
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// What the process's cgroup (v2) leaves before its `memory.max` (see [`cgroup_left_from`]);
/// `None` without a limit.
fn cgroup_left() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap_or_default();
    cgroup_left_from(&read("memory.max"), &read("memory.current"), &read("memory.stat"))
}

/// What a cgroup (v2) leaves before its limit, from its `memory.max`, `memory.current` and
/// `memory.stat`: the limit less the working set, which is the usage less the inactive file
/// cache (the kernel reclaims that before it fails an allocation; kubelet counts the same).
/// `None` when the limit is `max` or unreadable.
pub fn cgroup_left_from(max: &str, current: &str, stat: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    let current: u64 = current.trim().parse().unwrap_or(0);
    let inactive_file: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("inactive_file "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    Some(max.saturating_sub(current.saturating_sub(inactive_file)))
}

/// `bytes` in GiB for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// Why `ranks` ranks of `need` do not fit in `available` bytes, or `None` when they do.
pub fn refusal(need: &Need, ranks: u64, available: u64) -> Option<String> {
    let total = need.total().saturating_mul(ranks);
    if total <= available {
        return None;
    }
    Some(format!(
        "the model needs at least {} per rank ({} parameters: parameters {}, gradients {}, master and optimizer state {}, activations {}, data order {}), {ranks} rank(s) on this host need {}, and it has {} available (MemAvailable + SwapFree, or the cgroup's memory.max); use a smaller --d-model, --layers, --seq-len or --batch, shard the state over more ranks (--strategy zero3), or --offload nvme (a big --data file's order takes 4 bytes a window: a longer --seq-len has fewer)",
        gib(need.total()),
        need.parameters,
        gib(need.params),
        gib(need.grads),
        gib(need.optimizer),
        gib(need.activations),
        gib(need.data_order),
        gib(total),
        gib(available),
    ))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rsrun_training_engine::comm::{CommOptions, LocalStore, ProcessGroup};
    use rsrun_training_engine::engine::{Engine, EngineConfig};
    use rsrun_training_engine::optim::{AdamW, OptimizerConfig};

    use super::*;

    fn tiny() -> GptConfig {
        GptConfig {
            vocab: 256,
            d_model: 32,
            layers: 2,
            heads: 2,
            seq: 16,
        }
    }

    /// The model state of the table is what the engine allocates, for every precision,
    /// reduction dtype and offload (one process; sharded below).
    #[test]
    fn the_model_state_is_what_the_engine_allocates() {
        for strategy in ["ddp", "zero1", "zero2", "zero3"] {
            for precision in [Precision::Fp32, Precision::Bf16, Precision::F16] {
                for reduce_dtype in [ReduceDtype::Compute, ReduceDtype::Fp32] {
                    for offload in [Offload::None, Offload::Cpu] {
                        let strategy: Strategy = strategy.parse().unwrap();
                        let plan = Plan {
                            gpt: tiny(),
                            strategy,
                            shard_world: 1,
                            precision,
                            reduce_dtype,
                            offload: offload.clone(),
                            batch: 2,
                            windows: 0,
                        };
                        let mut cfg = EngineConfig::new(strategy, OptimizerConfig::AdamW(AdamW::default()));
                        cfg.precision = precision;
                        cfg.reduce_dtype = reduce_dtype;
                        cfg.offload = offload.clone();
                        let pg = ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), "mem", CommOptions::default()).unwrap();
                        let e = Engine::new(Gpt::new(tiny()), cfg, pg).unwrap();
                        let m = e.memory();
                        let n = need(&plan).unwrap();
                        let what = format!("{strategy} {precision:?} {reduce_dtype:?} {offload:?}");
                        let engine = m.model_state() + m.offloaded_host;
                        if offload == Offload::None {
                            assert_eq!(n.model_state(), engine, "{what}: {n:?} {m:?}");
                        } else {
                            // The tier rounds its state up to whole tiles: a lower bound here.
                            assert!(n.model_state() <= engine && n.model_state() * 2 > engine, "{what}: {n:?} {m:?}");
                        }
                        assert_eq!(n.parameters, e.layout().total_numel() as u64, "{what}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_model_that_cannot_fit_is_refused_with_its_figures() {
        let huge = Plan {
            gpt: GptConfig {
                vocab: 256,
                d_model: 8192,
                layers: 256,
                heads: 64,
                seq: 128,
            },
            strategy: Strategy::Ddp,
            shard_world: 1,
            precision: Precision::Fp32,
            reduce_dtype: ReduceDtype::Compute,
            offload: Offload::None,
            batch: 8,
            // A 100 GB --data at --seq-len 128: 781 million windows, 3 GiB of data order per rank.
            windows: 781_250_000,
        };
        let n = need(&huge).unwrap();
        assert_eq!(n.data_order, 3_125_000_000);
        // 12·D² per block: about 206 billion parameters, 16 bytes each under DDP in fp32.
        assert!(n.parameters > 200_000_000_000, "{n:?}");
        assert_eq!(n.model_state(), 16 * n.parameters);
        let why = refusal(&n, 2, 24 << 30).unwrap();
        assert!(why.contains("2 rank(s) on this host") && why.contains("24.0 GiB available"), "{why}");
        assert!(why.contains(&format!("{} parameters", n.parameters)), "{why}");
        assert!(why.contains("data order 2.9 GiB"), "{why}");
        // Sharded over 64 ranks the state per rank is a 64th (ZeRO-3 keeps no full replica).
        let z3 = need(&Plan { strategy: Strategy::Zero3, shard_world: 64, ..huge.clone() }).unwrap();
        assert!(z3.model_state() * 63 < n.model_state() && z3.model_state() * 65 > n.model_state(), "{z3:?}");
        // NVMe offload leaves the master and optimizer state on disk.
        let nvme = need(&Plan {
            offload: Offload::Nvme(rsrun_training_engine::offload::NvmeConfig::new(std::path::Path::new("/x"), "t")),
            ..huge.clone()
        })
        .unwrap();
        assert_eq!(nvme.optimizer, 0);
        // The reference model fits in a gigabyte.
        let small = need(&Plan {
            gpt: GptConfig::reference(),
            offload: Offload::None,
            windows: 1 << 20,
            ..huge
        })
        .unwrap();
        assert_eq!(refusal(&small, 2, 1 << 30), None, "{small:?}");
    }

    /// Sharded over two ranks (threads), what each rank allocates is the table's figure, for
    /// every strategy, hybrid included, in fp32 and bf16.
    #[test]
    fn the_sharded_model_state_is_what_two_ranks_allocate() {
        for strategy in ["ddp", "zero1", "zero2", "zero3", "hybrid"] {
            for precision in [Precision::Fp32, Precision::Bf16] {
                let strategy: Strategy = strategy.parse().unwrap();
                let store = Arc::new(LocalStore::new());
                let prefix = format!("mem2-{strategy}-{precision:?}");
                let ranks: Vec<_> = (0..2)
                    .map(|rank| {
                        let (store, prefix) = (store.clone(), prefix.clone());
                        std::thread::spawn(move || {
                            let mut cfg = EngineConfig::new(strategy, OptimizerConfig::AdamW(AdamW::default()));
                            cfg.precision = precision;
                            let pg = ProcessGroup::new(rank, 2, store, &prefix, CommOptions::default()).unwrap();
                            Engine::new(Gpt::new(tiny()), cfg, pg).unwrap().memory().model_state()
                        })
                    })
                    .collect();
                let n = need(&Plan {
                    gpt: tiny(),
                    strategy,
                    shard_world: 2,
                    precision,
                    reduce_dtype: ReduceDtype::Compute,
                    offload: Offload::None,
                    batch: 2,
                    windows: 0,
                })
                .unwrap();
                for r in ranks {
                    assert_eq!(r.join().unwrap(), n.model_state(), "{strategy} {precision:?}: {n:?}");
                }
            }
        }
    }

    /// A cgroup's room is its limit less the working set; page cache it can drop does not count.
    #[test]
    fn a_cgroup_leaves_its_limit_less_the_working_set() {
        assert_eq!(cgroup_left_from("max\n", "100\n", ""), None);
        assert_eq!(cgroup_left_from("", "", ""), None);
        let stat = "anon 500\nfile 400\nactive_file 100\ninactive_file 300\n";
        assert_eq!(cgroup_left_from("1000\n", "900\n", stat), Some(400));
        assert_eq!(cgroup_left_from("1000", "2000", ""), Some(0));
        assert_eq!(cgroup_left_from("1000", "", ""), Some(1000));
    }
}
