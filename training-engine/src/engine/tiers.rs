//! Mixed precision and optimizer-state offload in the engine.
//!
//! # Where the fp32 master lives
//! | precision | offload | stage 0–2 (DDP, ZeRO-1/2) | stage 3 (ZeRO-3, FSDP, hybrid) |
//! |---|---|---|---|
//! | fp32 | none | the `Var`s are the master (updated in place) | `master` shard (gathered) |
//! | bf16/f16 | none | `Var`s are 16-bit copies; `master` holds the fp32 shard | `master` fp32 shard, gathered and cast to 16 bits |
//! | any | cpu/nvme | `Var`s are compute copies; master + state in the tier | `master` is the compute copy of the shard; master + state in the tier |
//!
//! With offload the optimizer step streams each unit through
//! [`OptimStateStore::update_unit`] tile by tile: the tile's fp32 master and state are updated
//! by the engine's [`TileOptimizer`] with the matching gradient slice, and the new master
//! values are copied (cast) into the compute copies. The update is elementwise, so the result
//! is bitwise the in-memory one.
//!
//! # Gradient dtype ([`ReduceDtype`], FSDP's `reduce_dtype`)
//! With [`ReduceDtype::Compute`] (the default) the gradients of the 16-bit compute copies are
//! accumulated (micro-batches, in place, rounded after every addition), stored and reduced
//! (all-reduce, reduce-scatter, hybrid all-reduce; the transport folds 16-bit values in f32
//! and rounds once) in bf16/f16. They are upcast to fp32 only at the optimizer step, unit by
//! unit: the upcast shard is divided by the micro-batch count and (f16) multiplied by the
//! inverse loss scale in fp32, then updates the fp32 master (ZeRO-1 upcasts its reduced
//! shard right after the reduce-scatter). With [`ReduceDtype::Fp32`] the gradient buffers are
//! fp32: gradients are upcast as they are accumulated and reduced in fp32 (FSDP
//! `reduce_dtype=float32`, DeepSpeed's fp32 gradient partition). fp32 training ignores it.
//!
//! Under ZeRO-3 without offload the engine keeps a 16-bit copy of the fp32 master shard (cast
//! after every update and load); that copy is what is all-gathered (half the traffic), and
//! the gathered unit is bitwise the cast of the gathered fp32 master.
//!
//! # Memory accounting ([`MemoryStats`](super::MemoryStats), per rank, AdamW, `S` = Σ shard lengths)
//! `params` counts compute copies (2 bytes per element in bf16/f16; the 16-bit shard under
//! ZeRO-3), `grads` the gradient buffers (2 bytes per element with `ReduceDtype::Compute` in
//! bf16/f16, 4 otherwise), `optimizer` the in-memory fp32 master (when separate from the
//! compute copies) and the state slots; `offloaded_host`/`offloaded_nvme` what the offload
//! tier holds (host buffers rounded up to 4 KiB pages, NVMe file bytes with both slots of every
//! tile, see `offload`).
//!
//! | strategy | fp32 | bf16/f16, reduce = compute (engine.md §6.1, K = 12) | bf16/f16, reduce = fp32 |
//! |---|---|---|---|
//! | DDP | 16Ψ | 2Ψ + 2Ψ + 12Ψ = 16Ψ | 2Ψ + 4Ψ + 12Ψ = 18Ψ |
//! | ZeRO-1 | 8Ψ + 8S | 2Ψ + 2Ψ + 12S = 4Ψ + 12S | 2Ψ + 4Ψ + 12S = 6Ψ + 12S |
//! | ZeRO-2 | 4Ψ + 12S | 2Ψ + 2S + 12S = 2Ψ + 14S | 2Ψ + 4S + 12S = 2Ψ + 16S |
//! | ZeRO-3 | 16S | 2S + 2S + 12S = 16S | 2S + 4S + 12S = 18S |
//!
//! (params + grads + fp32 master and m, v.) Padding: `S·N = Ψ_pad ≥ Ψ` as in the fp32 table
//! (see `layout`). With offload the master and state leave `optimizer` for the tier, and under
//! ZeRO-3 the in-memory shard is the fp32 master itself (counted in `params`, 4S).
//!
//! # f16 dynamic loss scaling
//! The loss is multiplied by the scale (2^16 initially) before backward; the reduced gradients
//! are multiplied by its inverse (exact for powers of two) before clipping and the update. If
//! any gradient is inf/NaN on any rank, the step is skipped (no update, the step count does not
//! advance) and the scale is halved; after 2000 consecutive good steps it is doubled.

use std::sync::{Mutex, MutexGuard};

use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Tensor, Var};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::flat::{FlatBuf, FlatDtype};
use super::{Engine, StepOutput, with_ref};
use crate::comm::ReduceOp;
use crate::error::{EngineError, EngineResult};
use crate::layout::{OptimStateStore, StepParams, TileOptimizer, UnitLayout};
use crate::model::UnitModel;
use crate::offload::{CpuStore, NvmeConfig, NvmeStore, OffloadStats};

/// Compute precision of the parameters; the master weights and the optimizer state are fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything fp32.
    #[default]
    Fp32,
    /// bf16 compute copies (no loss scaling needed).
    Bf16,
    /// f16 compute copies with dynamic loss scaling.
    F16,
}

impl Precision {
    /// Bytes per compute-copy element.
    pub fn bytes(self) -> usize {
        match self {
            Precision::Fp32 => 4,
            Precision::Bf16 | Precision::F16 => 2,
        }
    }

    /// The candle dtype of the compute copies.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// `fp32 | bf16 | f16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = EngineError;

    fn from_str(s: &str) -> EngineResult<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Precision::Fp32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "f16" | "fp16" | "float16" => Ok(Precision::F16),
            _ => Err(EngineError::Config(format!(
                "unknown precision {s:?} (fp32|bf16|f16)"
            ))),
        }
    }
}

/// Dtype of the gradient buffers and their reduction in mixed precision (FSDP
/// `MixedPrecision.reduce_dtype`). In fp32 training both are fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReduceDtype {
    /// fp32 gradient buffers: 16-bit gradients are upcast as they are accumulated and reduced
    /// in fp32 (FSDP `reduce_dtype=torch.float32`, DeepSpeed's fp32 gradient partition).
    Fp32,
    /// The compute dtype: gradients are accumulated, stored and reduced in bf16/f16 and upcast
    /// to fp32 only at the optimizer step (FSDP `MixedPrecision(param_dtype=bf16)` without a
    /// `reduce_dtype`, the ZeRO paper's accounting).
    #[default]
    Compute,
}

impl ReduceDtype {
    /// `fp32 | compute`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceDtype::Fp32 => "fp32",
            ReduceDtype::Compute => "compute",
        }
    }
}

impl std::fmt::Display for ReduceDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ReduceDtype {
    type Err = EngineError;

    fn from_str(s: &str) -> EngineResult<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(ReduceDtype::Fp32),
            "compute" => Ok(ReduceDtype::Compute),
            _ => Err(EngineError::Config(format!(
                "unknown reduce dtype {s:?} (fp32|compute)"
            ))),
        }
    }
}

/// The 16-bit flat dtype of a mixed precision (`None` for fp32).
fn half_dtype(p: Precision) -> Option<FlatDtype> {
    match p {
        Precision::Fp32 => None,
        Precision::Bf16 => Some(FlatDtype::Bf16),
        Precision::F16 => Some(FlatDtype::F16),
    }
}

/// Where the fp32 master shard and the optimizer state live.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Offload {
    /// In the engine's memory.
    #[default]
    None,
    /// In a host tier ([`CpuStore`]), tiles of [`CPU_TILE_ELEMS`] elements.
    Cpu,
    /// In one `O_DIRECT` swap file per rank ([`NvmeStore`]). The engine appends
    /// `.<pid>.r<rank>` to [`NvmeConfig::file_name`] so ranks never share a file.
    Nvme(NvmeConfig),
}

impl Offload {
    /// `none | cpu | nvme`.
    pub fn name(&self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Cpu => "cpu",
            Offload::Nvme(_) => "nvme",
        }
    }
}

/// Tile size of the CPU tier (elements).
pub const CPU_TILE_ELEMS: usize = 1 << 20;

/// The engine's offload tier.
#[derive(Debug)]
pub(super) enum OffloadTier {
    Cpu(CpuStore),
    Nvme(Box<NvmeStore>),
}

impl OffloadTier {
    fn store(&mut self) -> &mut dyn OptimStateStore {
        match self {
            OffloadTier::Cpu(c) => c,
            OffloadTier::Nvme(n) => n.as_mut(),
        }
    }

    fn stats(&self) -> OffloadStats {
        match self {
            OffloadTier::Cpu(c) => c.stats(),
            OffloadTier::Nvme(n) => n.stats(),
        }
    }

    /// (host bytes, file bytes).
    fn bytes(&self) -> (u64, u64) {
        match self {
            OffloadTier::Cpu(c) => (c.memory().host as u64, c.memory().file),
            OffloadTier::Nvme(n) => (n.memory().host as u64, n.memory().file),
        }
    }
}

/// Dynamic loss scaler for f16 (PyTorch `GradScaler` defaults: 2^16, ×0.5 on overflow, ×2
/// every 2000 good steps), never below `min_scale` (DeepSpeed's `min_loss_scale`, 1): a step
/// that overflows at the minimum fails instead of being skipped, since the overflow is no
/// longer the scale's (an f16 forward that overflows, a loss that is NaN at any scale). Without
/// the floor such a run would skip every step, halve the scale to 0 and go on forever.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaler {
    /// Current scale.
    pub scale: f32,
    /// Good steps between doublings.
    pub growth_interval: u32,
    /// Good steps since the last change.
    pub good_steps: u32,
    /// The smallest scale.
    pub min_scale: f32,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: 65536.0,
            growth_interval: 2000,
            good_steps: 0,
            min_scale: 1.0,
        }
    }
}

impl LossScaler {
    /// Records one step: halves on overflow (not below `min_scale`), doubles after
    /// `growth_interval` good steps.
    pub fn update(&mut self, finite: bool) {
        if finite {
            self.good_steps = self.good_steps.saturating_add(1);
            if self.good_steps >= self.growth_interval {
                // As PyTorch's GradScaler: a scale that would overflow stays (an infinite one
                // would make every step overflow, and halving inf never gets it back).
                if (self.scale * 2.0).is_finite() {
                    self.scale *= 2.0;
                }
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale * 0.5).max(self.min_scale);
            self.good_steps = 0;
        }
    }

    /// Whether an overflow now cannot be helped by a smaller scale.
    pub fn at_minimum(&self) -> bool {
        self.scale <= self.min_scale
    }
}

fn to_half<T: Default + Clone>(v: &[f32], conv: impl Fn(&mut [T], &[f32])) -> Vec<T> {
    let mut out = vec![T::default(); v.len()];
    conv(&mut out, v);
    out
}

/// New storage holding `v`, in the dtype of `like` (f32 for anything but bf16/f16).
pub(super) fn storage_like(like: &CpuStorage, v: Vec<f32>) -> CpuStorage {
    match like {
        CpuStorage::BF16(_) => CpuStorage::BF16(to_half(&v, |o: &mut [bf16], s| {
            o.convert_from_f32_slice(s)
        })),
        CpuStorage::F16(_) => CpuStorage::F16(to_half(&v, |o: &mut [f16], s| {
            o.convert_from_f32_slice(s)
        })),
        _ => CpuStorage::F32(v),
    }
}

/// Writes f32 values (cast to the tensor's dtype) into `range` of a contiguous tensor.
struct WriteF32<'a> {
    range: std::ops::Range<usize>,
    values: &'a [f32],
}

impl InplaceOp1 for WriteF32<'_> {
    fn name(&self) -> &'static str {
        "write-f32"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("parameter not contiguous".into()))?;
        let r = a + self.range.start..a + self.range.end;
        if r.end > b || self.values.len() != r.len() {
            return Err(candle_core::Error::Msg(format!(
                "write of {} values at {:?} into a parameter of {} elements",
                self.values.len(),
                self.range,
                b - a
            )));
        }
        match s {
            CpuStorage::F32(v) => v[r].copy_from_slice(self.values),
            CpuStorage::BF16(v) => v[r].convert_from_f32_slice(self.values),
            CpuStorage::F16(v) => v[r].convert_from_f32_slice(self.values),
            _ => return Err(candle_core::Error::Msg("parameter is not f32/bf16/f16".into())),
        }
        Ok(())
    }
}

/// Copies the master shard `master` (shard coordinates) into the compute copies of a unit.
fn write_master(vars: &[Var], ul: &UnitLayout, shard_rank: usize, master: &[f32]) -> EngineResult<()> {
    for piece in ul.pieces(shard_rank) {
        vars[piece.param].as_tensor().inplace_op1(&WriteF32 {
            range: piece.in_param.clone(),
            values: &master[piece.in_shard.clone()],
        })?;
    }
    Ok(())
}

fn lock(m: &Mutex<OffloadTier>) -> MutexGuard<'_, OffloadTier> {
    // A poisoned lock only means a panic elsewhere while holding it; the tier itself keeps
    // per-unit atomicity (see `offload`).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<M: UnitModel> Engine<M> {
    /// Called at the end of [`Engine::new`]: casts the compute copies, separates the fp32 master
    /// and moves master + optimizer state into the offload tier, as configured.
    pub(super) fn setup_tiers(&mut self) -> EngineResult<()> {
        let precision = self.cfg.precision;
        if precision == Precision::F16 {
            self.scaler = Some(LossScaler::default());
        }
        let offload = self.cfg.offload.clone();
        if precision == Precision::Fp32 && offload == Offload::None {
            return Ok(());
        }
        let z3 = self.cfg.strategy.shards_params();
        let mut masters = Vec::with_capacity(self.units.len());
        for ui in 0..self.units.len() {
            masters.push(if z3 {
                self.units[ui].master.clone()
            } else {
                self.shard_from_vars(ui)?
            });
        }
        if precision != Precision::Fp32 {
            let dtype = precision.dtype();
            for (u, ul) in self.units.iter_mut().zip(&self.layout.units) {
                for (v, p) in u.vars.iter_mut().zip(&ul.params) {
                    *v = if z3 {
                        let nv = Var::zeros(p.shape.as_slice(), dtype, &Device::Cpu)?;
                        super::set_storage(nv.as_tensor(), Vec::new())?;
                        nv
                    } else {
                        Var::from_tensor(&v.as_tensor().to_dtype(dtype)?)?
                    };
                }
            }
        }
        if offload == Offload::None {
            if !z3 {
                for (u, m) in self.units.iter_mut().zip(masters) {
                    u.master = m;
                }
            } else if let Some(dt) = half_dtype(precision) {
                // ZeRO-3: the 16-bit parameter shard that is all-gathered.
                for u in &mut self.units {
                    u.shard16 = FlatBuf::from_f32(dt, &u.master);
                }
            }
            return Ok(());
        }
        let lens: Vec<usize> = self.layout.units.iter().map(|u| u.shard_len).collect();
        let slots = self.cfg.optimizer.as_tile().state_slots();
        let mut tier = match offload {
            Offload::Cpu => OffloadTier::Cpu(CpuStore::new(&lens, slots, CPU_TILE_ELEMS)?),
            Offload::Nvme(c) => {
                let mut c = c.clone();
                c.file_name = format!("{}.{}.r{:05}", c.file_name, std::process::id(), self.rank);
                OffloadTier::Nvme(Box::new(NvmeStore::new(&lens, slots, &c)?))
            }
            Offload::None => return Ok(()),
        };
        let half = half_dtype(precision);
        for (ui, m) in masters.into_iter().enumerate() {
            tier.store().init_unit(ui, &m, slots)?;
            let u = &mut self.units[ui];
            u.state = Vec::new();
            match (z3, half) {
                // ZeRO-3 in 16 bits: the tier holds the fp32 master; what stays resident, and is
                // all-gathered, is the 16-bit shard (the same bytes as without offload).
                (true, Some(dt)) => {
                    u.shard16 = FlatBuf::from_f32(dt, &m);
                    u.master = Vec::new();
                }
                // ZeRO-3 in fp32: the resident shard is the fp32 parameter shard.
                (true, None) => {}
                (false, _) => u.master = Vec::new(),
            }
        }
        self.tier = Some(Mutex::new(tier));
        Ok(())
    }

    /// Whether the fp32 master is not the compute parameters themselves.
    pub(super) fn master_separate(&self) -> bool {
        self.tier.is_some() || self.cfg.precision != Precision::Fp32
    }

    /// Whether the step goes through [`Engine::update_unit_tiered`].
    pub(super) fn tiered_update(&self) -> bool {
        self.tier.is_some()
            || (self.cfg.precision != Precision::Fp32 && !self.cfg.strategy.shards_params())
    }

    /// (host, nvme) bytes of the offload tier.
    pub(super) fn offloaded_bytes(&self) -> (u64, u64) {
        self.tier.as_ref().map_or((0, 0), |t| lock(t).bytes())
    }

    /// This rank's shard of unit `ui` read from the compute parameters (zero padding).
    pub(super) fn shard_from_vars(&self, ui: usize) -> EngineResult<Vec<f32>> {
        let ul = &self.layout.units[ui];
        let mut shard = vec![0f32; ul.shard_len];
        for piece in ul.pieces(self.shard_rank) {
            with_ref(self.units[ui].vars[piece.param].as_tensor(), |p| {
                shard[piece.in_shard.clone()].copy_from_slice(&p[piece.in_param.clone()])
            })?;
        }
        Ok(shard)
    }

    /// This rank's fp32 master shard and optimizer state of unit `ui`.
    pub(super) fn master_and_state(&self, ui: usize) -> EngineResult<(Vec<f32>, Vec<Vec<f32>>)> {
        if let Some(t) = &self.tier {
            return lock(t).store().read_unit(ui);
        }
        let u = &self.units[ui];
        let master = if self.cfg.strategy.shards_params() || !u.master.is_empty() {
            u.master.clone()
        } else {
            self.shard_from_vars(ui)?
        };
        Ok((master, u.state.clone()))
    }

    /// Replaces unit `ui`'s master shard and state and re-derives the compute copies of this
    /// rank's range (ZeRO-1/2 callers all-gather afterwards).
    pub(super) fn set_master_and_state(
        &mut self,
        ui: usize,
        master: Vec<f32>,
        state: Vec<Vec<f32>>,
    ) -> EngineResult<()> {
        let z3 = self.cfg.strategy.shards_params();
        let ul = &self.layout.units[ui];
        let u = &mut self.units[ui];
        if let Some(t) = &self.tier {
            lock(t).store().write_unit(ui, &master, &state)?;
            if z3 && !u.shard16.is_empty() {
                u.shard16 = FlatBuf::from_f32(u.shard16.dtype(), &master);
            } else if z3 {
                u.master = master;
            } else {
                write_master(&u.vars, ul, self.shard_rank, &master)?;
            }
            return Ok(());
        }
        u.state = state;
        if z3 {
            if !u.shard16.is_empty() {
                u.shard16 = FlatBuf::from_f32(u.shard16.dtype(), &master);
            }
            u.master = master;
        } else {
            write_master(&u.vars, ul, self.shard_rank, &master)?;
            if self.cfg.precision != Precision::Fp32 {
                u.master = master;
            }
        }
        Ok(())
    }

    /// The optimizer update of unit `ui` when the master is separate from the compute copies
    /// (offload, or 16-bit compute copies under stage 0–2).
    pub(super) fn update_unit_tiered(
        &mut self,
        ui: usize,
        opt: &dyn TileOptimizer,
        sp: &StepParams,
        g: &[f32],
    ) -> EngineResult<()> {
        let z3 = self.cfg.strategy.shards_params();
        let ul = &self.layout.units[ui];
        let u = &mut self.units[ui];
        let Some(tier) = &self.tier else {
            // 16-bit compute copies, fp32 master in memory (stage 0–2).
            let mut st: Vec<&mut [f32]> = u.state.iter_mut().map(|s| s.as_mut_slice()).collect();
            opt.step_tile(sp, &mut u.master, g, &mut st);
            return write_master(&u.vars, ul, self.shard_rank, &u.master);
        };
        if g.len() != ul.shard_len {
            return Err(EngineError::Length {
                what: format!("gradient shard of unit {}", ul.name),
                expected: ul.shard_len,
                actual: g.len(),
            });
        }
        let mut new_master = if z3 { Vec::new() } else { vec![0f32; ul.shard_len] };
        {
            // Where each updated tile goes: ZeRO-3's resident shard (16-bit, rounded tile by
            // tile, or fp32), or stage 0–2's new master that is written into the compute copies.
            let half = z3 && !u.shard16.is_empty();
            let dst: &mut Vec<f32> = if z3 { &mut u.master } else { &mut new_master };
            let shard16 = &mut u.shard16;
            lock(tier).store().update_unit(ui, &mut |t| {
                let r = t.offset..t.offset + t.master.len();
                opt.step_tile(sp, t.master, &g[r.clone()], t.state);
                if half {
                    shard16.set_from_f32(r.start, t.master);
                } else {
                    dst[r].copy_from_slice(t.master);
                }
                Ok(())
            })?;
        }
        if !z3 {
            write_master(&u.vars, ul, self.shard_rank, &new_master)?;
        }
        Ok(())
    }

    /// The full fp32 master parameters (stage 0–2 with a separate master): this rank's master
    /// shards all-gathered over the sharding group. Every rank must call it.
    pub(super) fn full_master_params(&mut self) -> EngineResult<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(self.units.len());
        for ui in 0..self.units.len() {
            let (shard, _) = self.master_and_state(ui)?;
            let ul = &self.layout.units[ui];
            let mut full = match &self.shard_pg {
                Some(g) if self.layout.world > 1 => {
                    let mut full = vec![0f32; ul.padded_numel];
                    g.all_gather(&shard, &mut full)?;
                    full
                }
                _ => shard,
            };
            full.truncate(ul.numel);
            out.push(full);
        }
        Ok(out)
    }

    /// I/O counters of the offload tier (`None` without offload).
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.tier.as_ref().map(|t| lock(t).stats())
    }

    /// A description of the offload tier (`cpu`, or the NVMe file, engine and knobs).
    pub fn offload_describe(&self) -> Option<String> {
        self.tier.as_ref().map(|t| match &*lock(t) {
            OffloadTier::Cpu(_) => format!("cpu tiles of {CPU_TILE_ELEMS} elements"),
            OffloadTier::Nvme(n) => n.describe(),
        })
    }

    /// The current f16 loss scale, if any.
    pub fn loss_scale(&self) -> Option<f32> {
        self.scaler.map(|s| s.scale)
    }

    /// Multiplies the loss by the f16 loss scale before backward.
    pub(super) fn scale_loss(&self, loss: Tensor) -> EngineResult<Tensor> {
        match self.scaler {
            Some(s) if s.scale != 1.0 => Ok((loss * f64::from(s.scale))?),
            _ => Ok(loss),
        }
    }

    /// f16: unscales the reduced gradients (`z1_shards` under ZeRO-1, the fp32 unit buffers
    /// otherwise) and, if any is inf/NaN on any rank, halves the scale and returns the output
    /// of a skipped step. `half_k = Some(k)`: the unit buffers are 16-bit and unscaled at the
    /// step (see [`Engine::step_grad`]); they are only checked here, as the step will see them.
    pub(super) fn unscale_or_skip(
        &mut self,
        z1_shards: &mut [Vec<f32>],
        half_k: Option<usize>,
        loss: f32,
    ) -> EngineResult<Option<StepOutput>> {
        let Some(scaler) = self.scaler else {
            return Ok(None);
        };
        let inv = 1.0 / scaler.scale;
        let mut finite = true;
        if let Some(k) = half_k {
            for ui in 0..self.units.len() {
                finite &= self.step_grad(ui, k, Some(inv)).iter().all(|x| x.is_finite());
            }
        } else {
            let bufs: Vec<&mut [f32]> = if self.cfg.strategy.zero_stage() == 1 {
                z1_shards.iter_mut().map(|v| v.as_mut_slice()).collect()
            } else {
                self.units.iter_mut().filter_map(|u| u.grad.as_f32_mut()).collect()
            };
            for b in bufs {
                for x in b.iter_mut() {
                    *x *= inv;
                    finite &= x.is_finite();
                }
            }
        }
        // A loss that overflowed on any rank skips the step too (GradScaler's and DeepSpeed's rule).
        finite &= loss.is_finite();
        let mut flag = [if finite { 0f32 } else { 1.0 }];
        if self.world > 1 {
            self.in_comm(|| self.pg.all_reduce(&mut flag, ReduceOp::Max))?;
        }
        let finite = flag[0] == 0.0;
        if !finite && scaler.at_minimum() {
            // The flag is agreed: every rank fails here, at the same step.
            return Err(EngineError::NonFinite {
                what: "loss or gradients at the minimum loss scale (the f16 forward overflows, or the loss is NaN at any scale)",
                step: self.step + 1,
            });
        }
        if let Some(s) = self.scaler.as_mut() {
            s.update(finite);
        }
        if finite {
            return Ok(None);
        }
        let lr = match &self.cfg.schedule {
            Some(s) => s.lr(self.cfg.optimizer.lr(), self.step + 1),
            None => self.cfg.optimizer.lr(),
        };
        Ok(Some(StepOutput {
            loss,
            grad_norm: None,
            lr,
            skipped: true,
            comm_wait: self.take_comm_wait(),
        }))
    }
}
