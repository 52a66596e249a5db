//! The training engine: one implementation of DDP, ZeRO-1/2/3 and FSDP (incl. hybrid) over
//! flat per-unit parameter buffers, with unit-by-unit backward.
//!
//! # Step
//! [`Engine::train_step`] takes the micro-batches of one optimizer step on this rank:
//! 1. **Forward** unit by unit. The graph is cut at unit boundaries: unit `u`'s input is a
//!    fresh candle `Var` holding the detached output of unit `u−1` (engine.md §5a). Under
//!    ZeRO-3 a unit is all-gathered just before its forward (the next one is prefetched
//!    asynchronously, at most `max_live_units` gathered or in flight) and freed right after:
//!    its parameter `Var`s keep their place in the graph but their storage is released
//!    (FSDP's `storage.resize_(0)`), and refilled by the gather before the unit's backward.
//!    The last unit (the loss head) runs its backward right after its forward and is not
//!    freed in between (FSDP's root unit), so ZeRO-3 traffic is 1.5× DDP minus one
//!    all-gather of the head.
//! 2. **Backward** unit by unit in reverse: the last unit back-propagates the loss, unit `u`
//!    back-propagates the surrogate `Σ out_u ⊙ ∂L/∂out_u` (bit-identical to whole-graph
//!    backward). As soon as a unit's gradients are final they are reduced: DDP/NO_SHARD
//!    accumulate into full gradient buffers and all-reduce (average) a bucket asynchronously
//!    when its last unit is done (buckets in reverse unit order, the first one small, only on
//!    the last micro-batch: `no_sync` for the others); ZeRO-2/3 reduce-scatter (average) every
//!    unit's gradient into the gradient shard; ZeRO-1 accumulates full gradients locally and
//!    reduce-scatters them once at the end of the step. Hybrid reduce-scatters inside the
//!    host and all-reduces the shard across hosts.
//! 3. Gradients are divided by the number of micro-batches, optionally clipped by the global
//!    norm (computed over shards, summed across the sharding group), and the optimizer updates
//!    the rank's own range (everything for DDP). ZeRO-1/2 then all-gather the parameters.
//!
//! # Memory (fp32, per rank; Ψ = parameters, S = Σ per-unit shard lengths, see `layout`)
//! | strategy | params | grads | optimizer (AdamW m, v) | total model state |
//! |---|---|---|---|---|
//! | DDP / NO_SHARD | 4Ψ | 4Ψ | 8Ψ | 16Ψ |
//! | ZeRO-1 | 4Ψ | 4Ψ | 8S | 8Ψ + 8S |
//! | ZeRO-2 / SHARD_GRAD_OP | 4Ψ | 4S | 8S | 4Ψ + 12S |
//! | ZeRO-3 / FULL_SHARD / HYBRID | 4S | 4S | 8S | 16S (+ gathered units) |
//!
//! With padding, `S·N = Ψ_pad ≥ Ψ`; full buffers are unpadded. Transient buffers are reported
//! separately as peaks: gathered units (ZeRO-3, ≤ `max_live_units` units) and communication
//! buffers (buckets, reduce-scatter inputs, all-gather outputs). SGD has one slot (4 bytes)
//! per element instead of two.
//!
//! Mixed precision ([`Precision`]: 16-bit compute copies, fp32 master; with the default
//! [`ReduceDtype::Compute`] 16-bit gradient buffers reduced in 16 bits and upcast only at the
//! optimizer step, so DDP 16Ψ, ZeRO-1 4Ψ + 12S, ZeRO-2 2Ψ + 14S, ZeRO-3 16S exactly as
//! engine.md §6.1; [`ReduceDtype::Fp32`] keeps fp32 gradient buffers, +2 bytes per gradient
//! element) and offload ([`Offload`]: master + optimizer state in a CPU or NVMe tier, streamed
//! tile by tile through the step) change this table: see `engine/tiers.rs`. Checkpoints go through
//! [`Engine::save_checkpoint`] / [`Engine::load_checkpoint`] (`engine/ckpt.rs`).
//!
//! # Determinism
//! With a process group in deterministic mode every reduction folds ranks in order, so a
//! single process that computes the N per-rank gradients as N micro-batches (accumulating
//! `((g0 + g1) + …)` then dividing by N) reproduces DDP/ZeRO-1/2/3 bit for bit
//! ([`Engine::train_step`] with N micro-batches at world 1 is exactly that reference).

use std::collections::VecDeque;
use std::sync::Mutex;

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor, Var};
use tracing::{debug_span, info_span};

use crate::comm::{OpStats, ProcessGroup, ReduceOp};
use crate::error::{EngineError, EngineResult};
use crate::layout::{FlatLayout, StepParams, Strategy, TileOptimizer};
use crate::model::{Batch, UnitModel};
use crate::optim::{OptimizerConfig, Schedule, clip_coef, sum_sq};

/// Engine configuration (no `Default`: strategy and optimizer are explicit).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Data-parallel strategy.
    pub strategy: Strategy,
    /// Optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule (constant lr when `None`).
    pub schedule: Option<Schedule>,
    /// Clip gradients to this global L2 norm (PyTorch `clip_grad_norm_`).
    pub clip_grad_norm: Option<f64>,
    /// DDP bucket size in bytes (PyTorch default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Size of the first DDP bucket (the last units), so the first all-reduce starts early
    /// (PyTorch default 1 MiB).
    pub first_bucket_bytes: usize,
    /// ZeRO-3: gathered or in-flight units at most (FSDP `limit_all_gathers`: 2 = the current
    /// unit and one prefetched).
    pub max_live_units: usize,
    /// Seed of the parameter initialisation.
    pub seed: u64,
    /// Compute precision of the parameters (fp32 master weights either way); see
    /// [`Precision`].
    pub precision: Precision,
    /// Where the fp32 master shard and the optimizer state live; see [`Offload`].
    pub offload: Offload,
    /// Dtype of the gradient buffers and of their reduction in mixed precision (FSDP's
    /// `reduce_dtype`); see [`ReduceDtype`]. Ignored in fp32.
    pub reduce_dtype: ReduceDtype,
}

impl EngineConfig {
    /// A configuration with PyTorch-like defaults for everything else.
    pub fn new(strategy: Strategy, optimizer: OptimizerConfig) -> Self {
        EngineConfig {
            strategy,
            optimizer,
            schedule: None,
            clip_grad_norm: None,
            bucket_cap_bytes: 25 << 20,
            first_bucket_bytes: 1 << 20,
            max_live_units: 2,
            seed: 0,
            precision: Precision::Fp32,
            offload: Offload::None,
            reduce_dtype: ReduceDtype::Compute,
        }
    }

    /// Dtype of the gradient buffers: the compute dtype with [`ReduceDtype::Compute`], fp32
    /// otherwise (and always in fp32 training).
    fn grad_dtype(&self) -> flat::FlatDtype {
        match (self.precision, self.reduce_dtype) {
            (Precision::Bf16, ReduceDtype::Compute) => flat::FlatDtype::Bf16,
            (Precision::F16, ReduceDtype::Compute) => flat::FlatDtype::F16,
            _ => flat::FlatDtype::F32,
        }
    }
}

/// Bytes per rank by category (see the module docs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Persistent parameters (full replicas, or the shard under ZeRO-3).
    pub params: u64,
    /// Persistent gradient buffers (full, or the shard under ZeRO-2/3).
    pub grads: u64,
    /// Optimizer state (AdamW m and v) over the owned range.
    pub optimizer: u64,
    /// Peak bytes of gathered units alive at once (ZeRO-3), since the last reset.
    pub gathered_peak: u64,
    /// Peak bytes of communication buffers alive at once, since the last reset.
    pub comm_peak: u64,
    /// Offloaded master + optimizer state held in host memory by the offload tier (CPU
    /// offload: the state itself; NVMe: the staging buffers). Not part of `optimizer`.
    pub offloaded_host: u64,
    /// Offloaded master + optimizer state kept in NVMe swap files (file bytes).
    pub offloaded_nvme: u64,
}

impl MemoryStats {
    /// params + grads + optimizer.
    pub fn model_state(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// Result of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutput {
    /// Mean of this rank's micro-batch losses.
    pub loss: f32,
    /// Global gradient norm before clipping (only when clipping is on).
    pub grad_norm: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// The step was skipped because the (f16 loss-scaled) gradients overflowed; the step count
    /// did not advance and the loss scale was halved.
    pub skipped: bool,
    /// Wall time this step's calling thread spent in collectives: blocking ops, and waits for
    /// its asynchronous ones (DDP's bucket all-reduces, ZeRO's reduce-scatters and prefetched
    /// gathers). The communication the step did not hide behind its compute, including the
    /// wait for a slower rank; zero at world 1.
    pub comm_wait: std::time::Duration,
}

struct UnitState {
    /// Compute parameters (full shapes). Under ZeRO-3 their storage is empty unless gathered.
    vars: Vec<Var>,
    /// ZeRO-3: this rank's fp32 parameter shard (the master). Empty otherwise (the `Var`s are
    /// the master).
    master: Vec<f32>,
    /// ZeRO-3 in mixed precision without offload: the 16-bit compute copy of `master` (what
    /// is all-gathered). Empty otherwise.
    shard16: flat::FlatBuf,
    /// Gradient accumulation buffer in the gradient dtype (fp32, or the 16-bit compute dtype
    /// with [`ReduceDtype::Compute`]): full (`numel`) for DDP/ZeRO-1, the shard (`shard_len`)
    /// for ZeRO-2/3.
    grad: flat::FlatBuf,
    /// Optimizer state slots over the owned range (`shard_len` each).
    state: Vec<Vec<f32>>,
    /// ZeRO-3 on the native path: the unit's gathered parameters, flat (`numel`), while it is
    /// live (the candle path puts them into the `Var`s instead). Empty otherwise.
    gathered: Vec<f32>,
}

/// Transient-memory tracker (current and peak bytes).
#[derive(Debug, Default)]
struct Tracker {
    cur: u64,
    peak: u64,
}

impl Tracker {
    fn add(&mut self, b: usize) {
        self.cur += b as u64;
        self.peak = self.peak.max(self.cur);
    }
    fn sub(&mut self, b: usize) {
        self.cur = self.cur.saturating_sub(b as u64);
    }
}

/// The training engine for one rank.
pub struct Engine<M: UnitModel> {
    model: M,
    cfg: EngineConfig,
    rank: usize,
    world: usize,
    /// All ranks.
    pg: ProcessGroup,
    /// The sharding group (the world, or the host for hybrid); `None` for DDP.
    shard_pg: Option<ProcessGroup>,
    /// Hybrid: the replicas of this rank's shard on other hosts.
    rep_pg: Option<ProcessGroup>,
    layout: FlatLayout,
    shard_rank: usize,
    units: Vec<UnitState>,
    /// DDP buckets as unit ranges, in issue order (last units first).
    buckets: Vec<std::ops::Range<usize>>,
    step: u64,
    gathered: Tracker,
    comm: Tracker,
    /// Nanoseconds the calling thread spent in collectives during the current step (see
    /// [`StepOutput::comm_wait`]); atomic so `&self` helpers can add to it.
    comm_wait_ns: std::sync::atomic::AtomicU64,
    /// ZeRO-3 gathers in flight, in issue order.
    inflight: VecDeque<(usize, flat::FlatWork2)>,
    /// ZeRO-3 units currently gathered (storage filled).
    live: Vec<bool>,
    traffic_base: u64,
    /// Offload tier holding the fp32 master shard and optimizer state (see `engine/tiers.rs`).
    tier: Option<Mutex<tiers::OffloadTier>>,
    /// f16 dynamic loss scaler.
    scaler: Option<tiers::LossScaler>,
    /// Buffers of the native fp32 path (`engine/native.rs`).
    native: native::NativeState,
    /// Why the engine is unusable: a step that failed part-way (see [`EngineError::Unusable`]).
    broken: Option<String>,
    /// Tests: the optimizer update of this unit fails (as an offload tier's I/O error would).
    #[cfg(test)]
    pub(crate) fail_update_of: Option<usize>,
    /// Tests: the first gradient element turns NaN after the reduction (as an overflow in the
    /// backward would make it).
    #[cfg(test)]
    pub(crate) poison_grads: bool,
}

fn tensor_err(e: candle_core::Error) -> EngineError {
    EngineError::Tensor(e.to_string())
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        tensor_err(e)
    }
}

/// Replaces a tensor's CPU storage (used to free and refill ZeRO-3 parameters in place).
struct SetStorage(Mutex<Option<Vec<f32>>>);

impl InplaceOp1 for SetStorage {
    fn name(&self) -> &'static str {
        "set-storage"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _l: &Layout) -> candle_core::Result<()> {
        let v = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        // Keep the tensor's dtype: mixed-precision compute copies are bf16/f16.
        *s = tiers::storage_like(s, v);
        Ok(())
    }
}

fn set_storage(t: &Tensor, v: Vec<f32>) -> EngineResult<()> {
    t.inplace_op1(&SetStorage(Mutex::new(Some(v))))?;
    Ok(())
}

/// Runs `f` on a tensor's contiguous f32 data, mutably, in place.
struct MutSlice<'a>(Mutex<&'a mut dyn FnMut(&mut [f32])>);

impl InplaceOp1 for MutSlice<'_> {
    fn name(&self) -> &'static str {
        "mut-slice"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("parameter not contiguous".into()))?;
        match s {
            CpuStorage::F32(v) => {
                (self.0.lock().unwrap_or_else(|p| p.into_inner()))(&mut v[a..b]);
                Ok(())
            }
            _ => Err(candle_core::Error::Msg("parameter is not f32".into())),
        }
    }
}

fn with_mut(t: &Tensor, f: &mut dyn FnMut(&mut [f32])) -> EngineResult<()> {
    t.inplace_op1(&MutSlice(Mutex::new(f)))?;
    Ok(())
}

/// Runs `f` on a tensor's f32 data (converted when not contiguous f32).
fn with_ref<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> EngineResult<R> {
    {
        let (s, l) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) = (&*s, l.contiguous_offsets()) {
            return Ok(f(&v[a..b]));
        }
    }
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// What every rank's engine must be built with alike: everything in `cfg` that shapes the
/// numerics or the sequence of collectives (not the seed, whose rank 0 value is broadcast, nor
/// the offload tier, a rank's own memory matter), and the model's units.
fn config_fingerprint(cfg: &EngineConfig, specs: &[crate::layout::UnitSpec]) -> String {
    let units: Vec<String> = specs.iter().map(|u| format!("{}{:?}", u.name, u.params)).collect();
    format!(
        "strategy={} optimizer={:?} schedule={:?} clip_grad_norm={:?} buckets={}/{} max_live_units={} precision={:?} \
         reduce_dtype={:?} model=[{}]",
        cfg.strategy,
        cfg.optimizer,
        cfg.schedule,
        cfg.clip_grad_norm,
        cfg.bucket_cap_bytes,
        cfg.first_bucket_bytes,
        cfg.max_live_units,
        cfg.precision,
        cfg.reduce_dtype,
        units.join(", ")
    )
}

/// The first collective of [`Engine::new`]: every rank learns whether any rank refused its
/// configuration (else the others waited out the op timeout in the first broadcast, told
/// nothing), and whether the ranks' configurations differ (a different learning rate on one
/// DDP rank trained replicas that drift apart without an error).
fn agree_on_config(
    pg: &ProcessGroup,
    cfg: &EngineConfig,
    specs: &[crate::layout::UnitSpec],
    checked: EngineResult<()>,
) -> EngineResult<()> {
    if pg.world_size() == 1 {
        return checked;
    }
    let desc = config_fingerprint(cfg, specs);
    let h = i64::from(crc32fast::hash(desc.as_bytes()));
    // One all-reduce: any refusal, and both extremes of the fingerprint (max of h and of -h).
    let mut v = [i64::from(checked.is_err()), h, -h];
    pg.all_reduce(&mut v, ReduceOp::Max)?;
    checked?;
    if v[0] != 0 {
        return Err(EngineError::Config("the engine's configuration was refused on another rank (its error names the cause)".into()));
    }
    if v[1] != -v[2] {
        return Err(EngineError::Config(format!(
            "the ranks' engine configurations differ: every rank must build its engine with the same configuration and \
             model; rank {}'s is {desc}",
            pg.rank()
        )));
    }
    Ok(())
}

impl<M: UnitModel> Engine<M> {
    /// Builds the engine: lays the model out, initialises every unit from the seed, broadcasts
    /// it from rank 0 (so replicas agree whatever their seed), keeps this rank's part, and
    /// creates the hybrid subgroups. Every rank calls it with the same configuration.
    ///
    /// # Errors
    /// Invalid configuration, collective or tensor failures.
    pub fn new(model: M, cfg: EngineConfig, pg: ProcessGroup) -> EngineResult<Self> {
        let rank = pg.rank();
        let world = pg.world_size();
        let _span = info_span!("engine_new", rank, strategy = %cfg.strategy).entered();
        crate::kernels::tune_allocator();
        let checked = (|| {
            if let Some(e) = crate::native::isa::Isa::env_error() {
                return Err(EngineError::Config(e));
            }
            if cfg.max_live_units == 0 {
                return Err(EngineError::Config("max_live_units must be at least 1".into()));
            }
            model.check().map_err(|e| EngineError::Config(format!("model: {e}")))?;
            check_training_config(&cfg).map_err(EngineError::Config)
        })();
        agree_on_config(&pg, &cfg, &model.specs(), checked)?;
        let strategy = cfg.strategy;
        if strategy.is_hybrid() {
            // Shards live within a host and replicas across hosts: every host needs the same
            // number of ranks (else shard buffers differ in length between replicas).
            let counts: Vec<usize> = (0..pg.num_hosts()).map(|h| (0..world).filter(|r| pg.host_of(*r) == h).count()).collect();
            if counts.iter().any(|c| *c != counts[0]) {
                let each: Vec<String> = counts.iter().enumerate().map(|(h, c)| format!("host {h}: {c}")).collect();
                return Err(EngineError::Config(format!(
                    "hybrid sharding needs the same number of ranks on every host, got {}",
                    each.join(", ")
                )));
            }
        }
        let (shard_pg, rep_pg) = if strategy.is_hybrid() {
            let (intra, inter) = pg.split_by_host()?;
            let rep = (inter.world_size() > 1).then_some(inter);
            (Some(intra), rep)
        } else if strategy.shards_optimizer() {
            (Some(pg.clone()), None)
        } else {
            (None, None)
        };
        let shard_world = shard_pg.as_ref().map_or(1, |g| g.world_size());
        let shard_rank = shard_pg.as_ref().map_or(0, |g| g.rank());
        let layout = FlatLayout::new(shard_world, &model.specs())?;
        let slots = cfg.optimizer.as_tile().state_slots();
        // DDP's fp32 gradients are all-reduced whole over `pg`: on one host, register them.
        let ddp_shared = strategy.zero_stage() == 0
            && world > 1
            && pg.backend() == "shm"
            && cfg.grad_dtype() == flat::FlatDtype::F32;
        let mut units = Vec::with_capacity(layout.units.len());
        for (ui, ul) in layout.units.iter().enumerate() {
            let mut full = model.init_unit(ui, cfg.seed);
            if full.len() != ul.numel {
                return Err(EngineError::Length {
                    what: format!("initial values of unit {}", ul.name),
                    expected: ul.numel,
                    actual: full.len(),
                });
            }
            pg.broadcast(&mut full, 0)?;
            let mut vars = Vec::with_capacity(ul.params.len());
            for p in &ul.params {
                vars.push(Var::from_slice(&full[p.range()], p.shape.as_slice(), &Device::Cpu)?);
            }
            let sr = ul.shard_range(shard_rank);
            let owned = ul.shard_len;
            let master = if strategy.shards_params() {
                let mut m = vec![0f32; owned];
                let valid = ul.valid_shard_range(shard_rank);
                m[..valid.len()].copy_from_slice(&full[valid]);
                for v in &vars {
                    set_storage(v.as_tensor(), Vec::new())?;
                }
                m
            } else {
                Vec::new()
            };
            debug_assert_eq!(sr.len(), owned);
            let grad_len = if strategy.shards_grads() { owned } else { ul.numel };
            units.push(UnitState {
                vars,
                master,
                shard16: flat::FlatBuf::default(),
                grad: if ddp_shared {
                    // DDP on one host: gradients live in buffers registered with the group, so
                    // their all-reduce runs zero-copy (collective: every rank builds the same
                    // units in the same order).
                    flat::FlatBuf::SharedF32(pg.alloc_shared::<f32>(grad_len)?)
                } else {
                    flat::FlatBuf::zeros(cfg.grad_dtype(), grad_len)
                },
                state: (0..slots).map(|_| vec![0f32; owned]).collect(),
                gathered: Vec::new(),
            });
        }
        let buckets = make_buckets(&layout, cfg.first_bucket_bytes, cfg.bucket_cap_bytes);
        let n_units = units.len();
        let mut e = Engine {
            model,
            cfg,
            rank,
            world,
            pg,
            shard_pg,
            rep_pg,
            layout,
            shard_rank,
            units,
            buckets,
            step: 0,
            broken: None,
            #[cfg(test)]
            fail_update_of: None,
            #[cfg(test)]
            poison_grads: false,
            gathered: Tracker::default(),
            comm: Tracker::default(),
            comm_wait_ns: Default::default(),
            inflight: VecDeque::new(),
            live: vec![false; n_units],
            traffic_base: 0,
            tier: None,
            scaler: None,
            native: native::NativeState::default(),
        };
        e.traffic_base = e.bytes_sent_total();
        // An offload tier can fail on one node alone (its disk full, its --nvme-path missing,
        // io_uring unavailable there): every rank is told, not left to time out in its first
        // collective without the cause.
        let tiers = e.setup_tiers();
        if e.on_any_rank(tiers.is_err())? {
            tiers?;
            return Err(EngineError::Offload("setting up the offload tier failed on another rank (its error names the cause)".into()));
        }
        Ok(e)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The layout (its `world` is the sharding group size).
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Completed optimizer steps.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// Model-state bytes by category, with the transient peaks since the last
    /// [`Engine::reset_peaks`].
    pub fn memory(&self) -> MemoryStats {
        let f = 4u64;
        let mut m = MemoryStats {
            gathered_peak: self.gathered.peak,
            comm_peak: self.comm.peak,
            ..MemoryStats::default()
        };
        // Compute-copy bytes per element (2 for bf16/f16); see `engine/tiers.rs` for the
        // mixed-precision and offload accounting.
        let cb = self.cfg.precision.bytes() as u64;
        let mixed = self.cfg.precision != Precision::Fp32;
        for (u, ul) in self.units.iter().zip(&self.layout.units) {
            let master = u.master.len() as u64 * f;
            if self.cfg.strategy.shards_params() {
                if mixed {
                    // The 16-bit shard that is all-gathered, and the fp32 master shard (none in
                    // memory with offload: the tier holds it).
                    m.optimizer += master;
                    m.params += u.shard16.bytes() as u64;
                } else {
                    m.params += master;
                }
            } else {
                m.params += ul.numel as u64 * cb;
                // A separate in-memory fp32 master shard (mixed precision without offload).
                m.optimizer += master;
            }
            m.grads += u.grad.bytes() as u64;
            m.optimizer += u.state.iter().map(|s| s.len() as u64 * f).sum::<u64>();
        }
        let (host, nvme) = self.offloaded_bytes();
        m.offloaded_host = host;
        m.offloaded_nvme = nvme;
        m
    }

    /// Resets the transient peaks.
    pub fn reset_peaks(&mut self) {
        self.gathered.peak = self.gathered.cur;
        self.comm.peak = self.comm.cur;
    }

    /// Payload bytes this rank sent over all its groups since the engine was built (or the
    /// last [`Engine::reset_traffic`]): the init broadcast is excluded.
    pub fn bytes_sent(&self) -> u64 {
        // (Saturating: a clone of the process group may have reset the shared counters.)
        self.bytes_sent_total().saturating_sub(self.traffic_base)
    }

    /// Restarts [`Engine::bytes_sent`] at zero.
    pub fn reset_traffic(&mut self) {
        self.traffic_base = self.bytes_sent_total();
    }

    fn bytes_sent_total(&self) -> u64 {
        let t = |g: &ProcessGroup| -> OpStats { g.stats().total() };
        let mut b = t(&self.pg).bytes_sent;
        if self.cfg.strategy.is_hybrid() {
            b += self.shard_pg.as_ref().map_or(0, |g| t(g).bytes_sent);
            b += self.rep_pg.as_ref().map_or(0, |g| t(g).bytes_sent);
        }
        b
    }

    /// The full, unpadded parameters of every unit (gathers under ZeRO-3), in layout order.
    ///
    /// # Errors
    /// Collective or tensor failures. Every rank must call it.
    pub fn full_params(&mut self) -> EngineResult<Vec<Vec<f32>>> {
        if self.master_separate() && !self.cfg.strategy.shards_params() {
            return self.full_master_params();
        }
        let mut out = Vec::with_capacity(self.units.len());
        for ui in 0..self.units.len() {
            let ul = &self.layout.units[ui];
            if self.cfg.strategy.shards_params() {
                let mut full = vec![0f32; ul.padded_numel];
                self.gather_into(ui, &mut full)?;
                full.truncate(ul.numel);
                out.push(full);
            } else {
                let mut full = vec![0f32; ul.numel];
                for (p, v) in ul.params.iter().zip(&self.units[ui].vars) {
                    with_ref(v.as_tensor(), |s| full[p.range()].copy_from_slice(s))?;
                }
                out.push(full);
            }
        }
        Ok(out)
    }

    fn gather_into(&self, ui: usize, out: &mut [f32]) -> EngineResult<()> {
        let g = self.shard_pg.as_ref().ok_or_else(|| {
            EngineError::Config("gather without a sharding group".into())
        })?;
        // With offload in 16 bits the fp32 master shard is only in the tier.
        let tiered;
        let master = if self.units[ui].master.is_empty() && self.tier.is_some() {
            tiered = self.master_and_state(ui)?.0;
            &tiered
        } else {
            &self.units[ui].master
        };
        self.in_comm(|| g.all_gather(master, out))?;
        Ok(())
    }

    /// Runs a collective call (or a wait for one) and counts its wall time into the step's
    /// [`StepOutput::comm_wait`].
    fn in_comm<R>(&self, f: impl FnOnce() -> R) -> R {
        // A single process has no peers to wait for (its sharding group of one gathers and
        // scatters locally).
        if self.world <= 1 {
            return f();
        }
        let start = std::time::Instant::now();
        let r = f();
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.comm_wait_ns.fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
        r
    }

    /// The step's time in collectives so far, and a fresh count for the next step.
    pub(super) fn take_comm_wait(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.comm_wait_ns.swap(0, std::sync::atomic::Ordering::Relaxed))
    }

    /// One optimizer step over this rank's micro-batches (gradient accumulation without
    /// communication for all but the last micro-batch under DDP/ZeRO-1).
    ///
    /// # Errors
    /// Empty `micro`, tensor, collective or non-finite-loss failures.
    pub fn train_step(&mut self, micro: &[Batch]) -> EngineResult<StepOutput> {
        self.check_usable()?;
        let step = self.step + 1;
        let _span = info_span!("train_step", rank = self.rank, step).entered();
        // Collectives before this step (loading a checkpoint, a failed step) are not its own.
        self.take_comm_wait();
        // The input is checked before anything changes: a refusal leaves the engine as it was.
        self.check_micro_batches(micro)?;
        let r = self.run_step(micro);
        // So does a loss that is not finite (found before the update, on every rank alike). Any
        // other failure left the step part-way: units updated or not, buffers lent to collectives.
        if let Err(e) = &r
            && !matches!(e, EngineError::NonFinite { .. })
        {
            self.broken = Some(format!("step {step} failed ({e})"));
        }
        r
    }

    /// Every rank must run as many micro-batches: their collectives pair up, and each averages by
    /// its own count. Agreed first (an empty list included), so a mismatch is an error on every
    /// rank, not a hang or replicas that drift apart.
    fn check_micro_batches(&self, micro: &[Batch]) -> EngineResult<()> {
        if self.world > 1 {
            let k = micro.len() as f32;
            let mut counts = [k, -k];
            self.in_comm(|| self.pg.all_reduce(&mut counts, ReduceOp::Max))?;
            let (most, fewest) = (counts[0], -counts[1]);
            if most != fewest {
                return Err(EngineError::Config(format!(
                    "the ranks passed different numbers of micro-batches to train_step (from {fewest} to {most}; this rank {})",
                    micro.len()
                )));
            }
        }
        if micro.is_empty() {
            return Err(EngineError::Config("train_step needs at least one micro-batch".into()));
        }
        Ok(())
    }

    /// Whether `local` holds on any rank: one all-reduce of a flag (a collective; every rank
    /// calls it), or this rank's own value alone.
    pub(crate) fn on_any_rank(&self, local: bool) -> EngineResult<bool> {
        let mut flag = [if local { 1f32 } else { 0.0 }];
        if self.world > 1 {
            self.in_comm(|| self.pg.all_reduce(&mut flag, ReduceOp::Max))?;
        }
        Ok(flag[0] != 0.0)
    }

    /// [`EngineError::Unusable`] once a step failed part-way.
    pub(crate) fn check_usable(&self) -> EngineResult<()> {
        match &self.broken {
            Some(why) => Err(EngineError::Unusable(why.clone())),
            None => Ok(()),
        }
    }

    /// The step after its input was checked (see [`Engine::train_step`]).
    fn run_step(&mut self, micro: &[Batch]) -> EngineResult<StepOutput> {
        let native = self.native_enabled();
        // The native backward overwrites a unit's full gradient on the first micro-batch, and
        // under ZeRO-2/3 that micro-batch's reduce-scatter writes the gradient shard itself
        // (`Engine::reduce_unit`); the candle path adds.
        if !native {
            for u in &mut self.units {
                u.grad.fill_zero();
            }
        }
        let mut loss_sum = 0f32;
        for (k, b) in micro.iter().enumerate() {
            let sync = k + 1 == micro.len();
            loss_sum += if native {
                self.forward_backward_native(b, sync, k == 0)?
            } else {
                self.forward_backward(b, sync)?
            };
        }
        let loss = loss_sum / micro.len() as f32;
        // A loss that is not finite on any rank concerns them all (its gradients reached every
        // replica through the reductions): with f16 the step is skipped everywhere (an overflow,
        // in `unscale_or_skip`), otherwise every rank fails here, together.
        if self.scaler.is_none() && self.on_any_rank(!loss.is_finite())? {
            return Err(EngineError::NonFinite {
                what: if loss.is_finite() { "loss of another rank" } else { "loss" },
                step: self.step + 1,
            });
        }
        // ZeRO-1: reduce-scatter the accumulated full gradients into transient shards.
        let mut z1_shards: Vec<Vec<f32>> = Vec::new();
        if self.cfg.strategy.zero_stage() == 1 {
            for ui in 0..self.units.len() {
                let ul = &self.layout.units[ui];
                let mut input = std::mem::take(&mut self.units[ui].grad);
                input.resize(ul.padded_numel);
                let mut out = flat::FlatBuf::zeros(input.dtype(), ul.shard_len);
                self.comm.add(input.bytes() + out.bytes());
                let r = self.reduce_grad_shard(&input, &mut out);
                self.comm.sub(input.bytes() + out.bytes());
                input.truncate(ul.numel);
                self.units[ui].grad = input;
                r?;
                // The reduced shard is upcast to fp32 for the step.
                z1_shards.push(out.into_f32());
            }
        }
        let k = micro.len();
        let z1 = self.cfg.strategy.zero_stage() == 1;
        // 16-bit gradient buffers (ReduceDtype::Compute; not ZeRO-1, whose reduced shards are
        // already fp32) are upcast unit by unit at the optimizer step, then averaged and
        // unscaled in fp32 (`step_grad`); fp32 buffers are averaged and unscaled in place.
        let half = !z1 && self.cfg.grad_dtype() != flat::FlatDtype::F32;
        // Average over micro-batches exactly as a reduction's average would (x / k).
        if k > 1 && !half {
            let bufs: Vec<&mut [f32]> = if z1 {
                z1_shards.iter_mut().map(|v| v.as_mut_slice()).collect()
            } else {
                self.units.iter_mut().filter_map(|u| u.grad.as_f32_mut()).collect()
            };
            for b in bufs {
                for x in b.iter_mut() {
                    *x /= k as f32;
                }
            }
        }
        let inv = self.scaler.map(|s| 1.0 / s.scale);
        // f16: unscale the gradients; skip the step on overflow (see `engine/tiers.rs`).
        if let Some(out) = self.unscale_or_skip(&mut z1_shards, half.then_some(k), loss)? {
            return Ok(out);
        }
        // Global gradient norm over owned shards (DDP: everything, locally).
        let mut grad_scale = 1.0f32;
        let mut grad_norm = None;
        if let Some(max_norm) = self.cfg.clip_grad_norm {
            #[cfg(test)]
            if self.poison_grads
                && let Some(g) = self.units[0].grad.as_f32_mut()
            {
                g[0] = f32::NAN;
            }
            let mut sq = [0f64];
            for ui in 0..self.units.len() {
                sq[0] += if z1 {
                    sum_sq(&z1_shards[ui])
                } else if half {
                    sum_sq(&self.step_grad(ui, k, inv))
                } else {
                    sum_sq(self.units[ui].grad.as_f32().unwrap_or(&[]))
                };
            }
            if let Some(g) = &self.shard_pg {
                self.in_comm(|| g.all_reduce(&mut sq, ReduceOp::Sum))?;
            }
            let norm = sq[0].sqrt();
            if !norm.is_finite() {
                // Clipping by it would scale by 1 (NaN comparisons are false) and write NaN into
                // the weights and the optimizer's moments for good. The norm is the same on
                // every rank (reduced, or over reduced gradients): all fail, nothing applied.
                return Err(EngineError::NonFinite { what: "gradient norm", step: self.step + 1 });
            }
            grad_norm = Some(norm);
            grad_scale = clip_coef(norm, max_norm);
        }
        self.step += 1;
        let lr = match &self.cfg.schedule {
            Some(s) => s.lr(self.cfg.optimizer.lr(), self.step),
            None => self.cfg.optimizer.lr(),
        };
        let sp = StepParams {
            step: self.step,
            lr,
            grad_scale,
        };
        let opt = self.cfg.optimizer;
        let mut updated: EngineResult<()> = Ok(());
        for ui in 0..self.units.len() {
            let r = if !z1 && !half {
                // fp32 gradients are read in place (a registered buffer stays registered).
                let g = std::mem::take(&mut self.units[ui].grad);
                let r = match g.as_f32() {
                    Some(s) => self.update_unit(ui, opt.as_tile(), &sp, s),
                    None => Err(EngineError::Config("fp32 gradient buffer expected".into())),
                };
                self.units[ui].grad = g;
                r
            } else {
                let g = if z1 {
                    std::mem::take(&mut z1_shards[ui])
                } else {
                    // The upcast to fp32 (the master update's gradient).
                    self.step_grad(ui, k, inv)
                };
                self.update_unit(ui, opt.as_tile(), &sp, &g)
            };
            #[cfg(test)]
            let r = if self.fail_update_of == Some(ui) { Err(EngineError::Offload(format!("injected failure of unit {ui}"))) } else { r };
            if r.is_err() {
                updated = r;
                break;
            }
        }
        // An update that failed on one rank (an offload tier's I/O error) fails the step on every
        // rank: the others must not train on, or wait in the next collective, beside it.
        if self.on_any_rank(updated.is_err())? {
            updated?;
            return Err(EngineError::Offload(format!("the optimizer step {} failed on another rank", self.step)));
        }
        if matches!(self.cfg.strategy.zero_stage(), 1 | 2) {
            for ui in 0..self.units.len() {
                self.all_gather_params(ui)?;
            }
        }
        Ok(StepOutput {
            loss,
            grad_norm,
            lr,
            skipped: false,
            comm_wait: self.take_comm_wait(),
        })
    }

    /// Reduce-scatter (average) of a full padded gradient into this rank's shard, in the
    /// gradient dtype; hybrid also averages the shard across hosts.
    fn reduce_grad_shard(&self, input: &flat::FlatBuf, out: &mut flat::FlatBuf) -> EngineResult<()> {
        let g = self
            .shard_pg
            .as_ref()
            .ok_or_else(|| EngineError::Config("reduce-scatter without a sharding group".into()))?;
        self.in_comm(|| {
            input.reduce_scatter(g, out, ReduceOp::Avg)?;
            if let Some(r) = &self.rep_pg {
                out.all_reduce(r, ReduceOp::Avg)?;
            }
            Ok(())
        })
    }

    /// 16-bit gradient buffer of unit `ui` upcast to fp32, divided by the `k` micro-batches and
    /// multiplied by the inverse loss scale `inv`, exactly as the fp32 path does in place.
    pub(super) fn step_grad(&self, ui: usize, k: usize, inv: Option<f32>) -> Vec<f32> {
        let mut g = self.units[ui].grad.to_f32();
        if k > 1 {
            for x in g.iter_mut() {
                *x /= k as f32;
            }
        }
        if let Some(inv) = inv {
            for x in g.iter_mut() {
                *x *= inv;
            }
        }
        g
    }

    /// The optimizer update of unit `ui`'s owned range with gradient shard `g`.
    fn update_unit(
        &mut self,
        ui: usize,
        opt: &dyn TileOptimizer,
        sp: &StepParams,
        g: &[f32],
    ) -> EngineResult<()> {
        if self.tiered_update() {
            return self.update_unit_tiered(ui, opt, sp, g);
        }
        let ul = &self.layout.units[ui];
        let u = &mut self.units[ui];
        if self.cfg.strategy.shards_params() {
            let mut st: Vec<&mut [f32]> = u.state.iter_mut().map(|s| s.as_mut_slice()).collect();
            opt.step_tile(sp, &mut u.master, g, &mut st);
            if !u.shard16.is_empty() {
                u.shard16 = flat::FlatBuf::from_f32(u.shard16.dtype(), &u.master);
            }
            return Ok(());
        }
        for piece in ul.pieces(self.shard_rank) {
            let r = piece.in_shard.clone();
            let mut st: Vec<&mut [f32]> = u.state.iter_mut().map(|s| &mut s[r.clone()]).collect();
            let gs = &g[r.clone()];
            let ip = piece.in_param.clone();
            with_mut(u.vars[piece.param].as_tensor(), &mut |p: &mut [f32]| {
                opt.step_tile(sp, &mut p[ip.clone()], gs, &mut st)
            })?;
        }
        Ok(())
    }

    /// ZeRO-1/2: all-gather the updated parameter shards into every replica.
    fn all_gather_params(&mut self, ui: usize) -> EngineResult<()> {
        let ul = &self.layout.units[ui];
        let mut shard = vec![0f32; ul.shard_len];
        for piece in ul.pieces(self.shard_rank) {
            with_ref(self.units[ui].vars[piece.param].as_tensor(), |p| {
                shard[piece.in_shard.clone()].copy_from_slice(&p[piece.in_param.clone()])
            })?;
        }
        let mut full = vec![0f32; ul.padded_numel];
        self.comm.add((full.len() + shard.len()) * 4);
        let g = self
            .shard_pg
            .as_ref()
            .ok_or_else(|| EngineError::Config("all-gather without a sharding group".into()))?;
        self.in_comm(|| g.all_gather(&shard, &mut full))?;
        for (p, v) in ul.params.iter().zip(&self.units[ui].vars) {
            set_storage(v.as_tensor(), full[p.range()].to_vec())?;
        }
        self.comm.sub((full.len() + shard.len()) * 4);
        Ok(())
    }

    // === ZeRO-3 gather / free ===

    fn issue_gather(&mut self, ui: usize) -> EngineResult<()> {
        let ul = &self.layout.units[ui];
        let g = self
            .shard_pg
            .as_ref()
            .ok_or_else(|| EngineError::Config("gather without a sharding group".into()))?;
        // Mixed precision: the 16-bit shard is gathered (casting commutes with the gather).
        let u = &self.units[ui];
        let input = if !u.shard16.is_empty() {
            u.shard16.clone()
        } else {
            flat::FlatBuf::F32(u.master.clone())
        };
        let output = flat::FlatBuf::zeros(input.dtype(), ul.padded_numel);
        self.comm.add(input.bytes() + output.bytes());
        self.inflight.push_back((ui, input.all_gather_async(g, output)));
        Ok(())
    }

    fn n_live(&self) -> usize {
        self.live.iter().filter(|l| **l).count() + self.inflight.len()
    }

    /// Makes unit `ui` gathered (waiting for its prefetch or gathering now).
    fn ensure_gathered(&mut self, ui: usize) -> EngineResult<()> {
        if self.live[ui] {
            return Ok(());
        }
        if !self.inflight.iter().any(|(u, _)| *u == ui) {
            self.issue_gather(ui)?;
        }
        while let Some((u, w)) = self.inflight.pop_front() {
            let (input, full) = self.in_comm(|| w.wait())?;
            self.comm.sub(input.bytes() + full.bytes());
            let mut full = full.into_f32();
            let ul = &self.layout.units[u];
            self.gathered.add(ul.numel * 4);
            if self.native_enabled() {
                // The native path reads the flat buffer itself: no copy into per-parameter storage.
                full.truncate(ul.numel);
                self.units[u].gathered = full;
            } else {
                for (p, v) in ul.params.iter().zip(&self.units[u].vars) {
                    set_storage(v.as_tensor(), full[p.range()].to_vec())?;
                }
            }
            self.live[u] = true;
            if u == ui {
                break;
            }
        }
        Ok(())
    }

    fn prefetch(&mut self, ui: usize) -> EngineResult<()> {
        if self.live[ui]
            || self.inflight.iter().any(|(u, _)| *u == ui)
            || self.n_live() >= self.cfg.max_live_units
        {
            return Ok(());
        }
        self.issue_gather(ui)
    }

    fn free_unit(&mut self, ui: usize) -> EngineResult<()> {
        if !self.live[ui] {
            return Ok(());
        }
        if self.native_enabled() {
            self.units[ui].gathered = Vec::new();
        } else {
            for v in &self.units[ui].vars {
                set_storage(v.as_tensor(), Vec::new())?;
            }
        }
        self.live[ui] = false;
        self.gathered.sub(self.layout.units[ui].numel * 4);
        Ok(())
    }

    /// Forward and unit-by-unit backward of one micro-batch; reduces gradients per strategy.
    fn forward_backward(&mut self, batch: &Batch, sync: bool) -> EngineResult<f32> {
        let n = self.units.len();
        let z3 = self.cfg.strategy.shards_params();
        let mut inputs: Vec<Option<Var>> = Vec::with_capacity(n);
        let mut outs: Vec<Option<Tensor>> = Vec::with_capacity(n);
        {
            let _s = debug_span!("forward", rank = self.rank).entered();
            for ui in 0..n {
                if z3 {
                    self.ensure_gathered(ui)?;
                    if ui + 1 < n {
                        self.prefetch(ui + 1)?;
                    }
                }
                let x = match outs.last() {
                    Some(Some(h)) => Some(Var::from_tensor(&h.detach())?),
                    _ => None,
                };
                let params: Vec<Tensor> =
                    self.units[ui].vars.iter().map(|v| v.as_tensor().clone()).collect();
                let out = self.model.forward_unit(
                    ui,
                    &params,
                    x.as_ref().map(|v| v.as_tensor()),
                    batch,
                )?;
                inputs.push(x);
                outs.push(Some(out));
                if z3 && ui + 1 < n {
                    self.free_unit(ui)?;
                }
            }
        }
        let loss = match outs.last() {
            Some(Some(l)) => l.to_dtype(DType::F32)?.to_scalar::<f32>()?,
            _ => return Err(EngineError::Config("model has no units".into())),
        };
        let _s = debug_span!("backward", rank = self.rank).entered();
        let mut grad_out: Option<Tensor> = None;
        let mut works = Reductions::default();
        let stage = self.cfg.strategy.zero_stage();
        for ui in (0..n).rev() {
            if z3 {
                self.ensure_gathered(ui)?;
                if ui > 0 {
                    self.prefetch(ui - 1)?;
                }
            }
            let out = outs[ui].take().ok_or_else(|| EngineError::Config("missing unit output".into()))?;
            let surrogate = match &grad_out {
                None => self.scale_loss(out)?,
                Some(g) => (out * g)?.sum_all()?,
            };
            let grads = surrogate.backward()?;
            drop(surrogate);
            grad_out = match inputs[ui].take() {
                Some(x) => Some(
                    grads
                        .get(x.as_tensor())
                        .ok_or_else(|| EngineError::Tensor(format!("no gradient for the input of unit {ui}")))?
                        .detach(),
                ),
                None => None,
            };
            let ul = self.layout.units[ui].clone();
            // Flatten this unit's gradients.
            // In the gradient dtype: 16-bit gradients are accumulated in 16 bits with
            // ReduceDtype::Compute, upcast to fp32 otherwise.
            let flat_len = if stage >= 2 { ul.padded_numel } else { 0 };
            let mut flat = flat::FlatBuf::zeros(self.cfg.grad_dtype(), flat_len);
            for (pi, p) in ul.params.iter().enumerate() {
                let v = self.units[ui].vars[pi].as_tensor().clone();
                if let Some(g) = grads.get(&v) {
                    let dst: &mut flat::FlatBuf = if stage >= 2 {
                        &mut flat
                    } else {
                        &mut self.units[ui].grad
                    };
                    with_ref(g, |s| dst.add_f32(p.range().start, &s[..p.range().len()]))?;
                }
            }
            drop(grads);
            if z3 {
                self.free_unit(ui)?;
            }
            self.reduce_unit(ui, flat, sync, false, &mut works)?;
        }
        self.finish_reductions(works)?;
        Ok(loss)
    }

    /// Unit `ui`'s gradient of this micro-batch is complete (in `flat` for ZeRO-2/3, in the
    /// unit's buffer otherwise): starts its reduction. ZeRO-2/3 reduce-scatter `flat`; DDP
    /// all-reduces a bucket once its last unit is done, on the last micro-batch (`sync`).
    /// `into_grad` (ZeRO-2/3, the step's first micro-batch on the native path, whose shards
    /// were not zeroed): the reduce-scatter writes the unit's gradient shard itself instead of
    /// a fresh buffer added to it, so the shard needs no zeroing and no extra pass.
    fn reduce_unit(
        &mut self,
        ui: usize,
        flat: flat::FlatBuf,
        sync: bool,
        into_grad: bool,
        works: &mut Reductions,
    ) -> EngineResult<()> {
        let stage = self.cfg.strategy.zero_stage();
        if stage >= 2 {
            let g = self.shard_pg.as_ref().ok_or_else(|| {
                EngineError::Config("reduce-scatter without a sharding group".into())
            })?;
            let shard_len = self.layout.units[ui].shard_len;
            let requested = into_grad;
            let into_grad = into_grad && self.units[ui].grad.dtype() == flat.dtype();
            if requested && !into_grad {
                // The shard cannot be the output (another dtype): start it from zero instead.
                self.units[ui].grad.fill_zero();
            }
            let out = if into_grad {
                let mut own = std::mem::take(&mut self.units[ui].grad);
                own.resize(shard_len);
                own
            } else {
                flat::FlatBuf::zeros(flat.dtype(), shard_len)
            };
            self.comm.add(flat.bytes() + out.bytes());
            works
                .shards
                .push((ui, flat.reduce_scatter_async(g, out, ReduceOp::Avg), into_grad));
        } else if stage == 0
            && sync
            && self.world > 1
            && let Some(b) = self.buckets.iter().find(|b| b.start == ui).cloned()
        {
            // The bucket is complete: all-reduce its units' gradient buffers in place, one op
            // per unit queued back to back (no copy into and out of a bucket buffer;
            // reductions are element-wise, so the result is the same).
            for u in b {
                let g = std::mem::take(&mut self.units[u].grad);
                works.buckets.push((u, g.all_reduce_async(&self.pg, ReduceOp::Avg)));
            }
        }
        Ok(())
    }

    /// Waits for the reductions of a micro-batch and folds reduced shards into the gradients.
    fn finish_reductions(&mut self, works: Reductions) -> EngineResult<()> {
        let mut failed = None;
        for (u, w) in works.buckets {
            match self.in_comm(|| w.wait()) {
                Ok(g) => self.units[u].grad = g,
                Err(e) => {
                    // Keep the buffer's shape so the engine stays consistent; report the error.
                    self.units[u].grad =
                        flat::FlatBuf::zeros(self.cfg.grad_dtype(), self.layout.units[u].numel);
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        let mut failed: Option<EngineError> = None;
        for (ui, w, into_grad) in works.shards {
            let res = self.in_comm(|| w.wait()).map_err(EngineError::from).and_then(|(input, mut out)| {
                self.comm.sub(input.bytes() + out.bytes());
                if let Some(r) = &self.rep_pg {
                    self.in_comm(|| out.all_reduce(r, ReduceOp::Avg))?;
                }
                Ok(out)
            });
            match (res, into_grad) {
                (Ok(out), true) => self.units[ui].grad = out,
                (Ok(out), false) => self.units[ui].grad.add(&out),
                (Err(e), _) => {
                    if into_grad {
                        // The shard went into the failed op: keep its shape, report the error.
                        self.units[ui].grad = flat::FlatBuf::zeros(
                            self.cfg.grad_dtype(),
                            self.layout.units[ui].shard_len,
                        );
                    }
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Gradient reductions of one micro-batch in flight.
#[derive(Default)]
struct Reductions {
    /// DDP: per-unit all-reduces of complete buckets.
    buckets: Vec<(usize, flat::FlatWork)>,
    /// ZeRO-2/3: per-unit reduce-scatters, and whether each writes the unit's gradient shard
    /// itself (see [`Engine::reduce_unit`]).
    shards: Vec<(usize, flat::FlatWork2, bool)>,
}

/// DDP buckets over units in reverse order: the first bucket closes once it reaches
/// `first_bytes`, the others at `cap_bytes`; a unit is never split.
fn make_buckets(
    layout: &FlatLayout,
    first_bytes: usize,
    cap_bytes: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut end = layout.units.len();
    let mut bytes = 0usize;
    for ui in (0..layout.units.len()).rev() {
        bytes = bytes.saturating_add(layout.units[ui].numel.saturating_mul(4));
        let cap = if out.is_empty() { first_bytes } else { cap_bytes };
        if bytes >= cap || ui == 0 {
            out.push(ui..end);
            end = ui;
            bytes = 0;
        }
    }
    out
}

mod ckpt;
mod flat;
mod native;
mod tiers;

pub use tiers::{CPU_TILE_ELEMS, LossScaler, Offload, Precision, ReduceDtype};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ckpt;
#[cfg(test)]
mod tests_tiers;

/// The optimizer, clipping and schedule settings, checked as PyTorch checks them: each bad value
/// named.
fn check_training_config(cfg: &EngineConfig) -> Result<(), String> {
    let finite_at_least = |what: &str, v: f64, min: f64| {
        if v.is_finite() && v >= min { Ok(()) } else { Err(format!("{what} {v}: expected a finite value >= {min}")) }
    };
    match &cfg.optimizer {
        crate::optim::OptimizerConfig::AdamW(a) => {
            finite_at_least("AdamW lr", a.lr, 0.0)?;
            finite_at_least("AdamW eps", a.eps, 0.0)?;
            finite_at_least("AdamW weight_decay", a.weight_decay, 0.0)?;
            for (name, b) in [("beta1", a.beta1), ("beta2", a.beta2)] {
                if !(0.0..1.0).contains(&b) {
                    return Err(format!("AdamW {name} {b}: expected a value in [0, 1)"));
                }
            }
        }
        crate::optim::OptimizerConfig::Sgd(g) => {
            finite_at_least("SGD lr", g.lr, 0.0)?;
            finite_at_least("SGD momentum", g.momentum, 0.0)?;
            finite_at_least("SGD weight_decay", g.weight_decay, 0.0)?;
        }
    }
    if cfg.bucket_cap_bytes == 0 || cfg.first_bucket_bytes == 0 {
        return Err(format!(
            "bucket_cap_bytes {} and first_bucket_bytes {}: expected sizes of at least 1 byte",
            cfg.bucket_cap_bytes, cfg.first_bucket_bytes
        ));
    }
    if let Some(n) = cfg.clip_grad_norm
        && !(n.is_finite() && n > 0.0)
    {
        return Err(format!("clip_grad_norm {n}: expected a finite norm > 0 (None disables clipping)"));
    }
    if let Some(s) = &cfg.schedule
        && !(s.min_lr_ratio.is_finite() && (0.0..=1.0).contains(&s.min_lr_ratio))
    {
        return Err(format!("schedule min_lr_ratio {}: expected a value in [0, 1]", s.min_lr_ratio));
    }
    Ok(())
}
