//! Flat-parameter layout: how named parameters are packed into per-unit flat buffers and how
//! those buffers are sharded over ranks. Shared by the engine, checkpoints and offload.
//!
//! # Units and flat buffers
//! The model's parameters are grouped in *units* (one per transformer block, plus the
//! embeddings and the head). Each unit's parameters are concatenated, in declaration order, into
//! one flat buffer: parameter `p` occupies `[p.offset, p.offset + p.numel)`.
//!
//! # Padding rule
//! A unit of `numel` elements is padded **at its end** with zeros to
//! `padded_numel = ceil(numel / world) · world` (the [`crate::comm::padded_len`] convention),
//! where `world` is the number of shards ([`FlatLayout::world`]: the size of the sharding group,
//! 1 for DDP). Rank `r` owns `[r·S, (r+1)·S)` of the padded buffer with
//! `S = shard_len = padded_numel / world`; the padding therefore lies in the last rank(s)'
//! shards. Padding elements are zero in parameters, gradients and optimizer state, and stay zero
//! through AdamW/SGD (zero gradient and zero value give a zero update). Memory and traffic
//! formulas count padded sizes: with `Ψ_pad = Σ padded_numel = world · Σ shard_len`.
//! Consolidation strips the padding (use [`ParamInfo::offset`]/[`ParamInfo::numel`]).
//!
//! # The optimizer hook for offload
//! [`TileOptimizer`] is the contract between the engine's optimizers (AdamW, SGD) and an
//! offload store: the update is elementwise, so a shard may be split into tiles anywhere and
//! updated tile by tile with results bitwise identical to one call over the whole shard.
//! [`OptimStateStore`] is what an offload store implements so the engine can run the step over
//! state that lives outside the engine (CPU buffers, NVMe files).
//!
//! # Checkpoint view
//! [`ShardState`] is what one rank exposes for checkpoints: its flat fp32 master shard and
//! optimizer state per unit, the layout, strategy and step.

use std::ops::Range;
use std::str::FromStr;

use crate::error::{EngineError, EngineResult};

/// One named parameter inside a unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamInfo {
    /// Hierarchical name, e.g. `blocks.0.attn.qkv.weight`.
    pub name: String,
    /// Tensor shape (row-major).
    pub shape: Vec<usize>,
    /// Offset of the first element within the unit's (unpadded) flat buffer.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub numel: usize,
}

impl ParamInfo {
    /// The range of this parameter in the unit's flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The overlap of one parameter with one rank's shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamPiece {
    /// Index of the parameter in [`UnitLayout::params`].
    pub param: usize,
    /// Elements of the (flattened) parameter covered by the shard.
    pub in_param: Range<usize>,
    /// Where they are in the shard buffer (`0..shard_len` coordinates).
    pub in_shard: Range<usize>,
}

/// One unit: a flat buffer of parameters, padded to a multiple of the shard count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    /// Unit name, e.g. `embed`, `block.0`, `head`.
    pub name: String,
    /// Parameters in flat order.
    pub params: Vec<ParamInfo>,
    /// Unpadded elements (sum of the parameters' numel).
    pub numel: usize,
    /// `ceil(numel / world) · world` (see the module docs).
    pub padded_numel: usize,
    /// Elements per shard: `padded_numel / world`.
    pub shard_len: usize,
}

impl UnitLayout {
    /// Lays out `params` (name, shape) for `world` shards.
    ///
    /// # Errors
    /// `world == 0` or duplicate parameter names.
    pub fn new(
        name: impl Into<String>,
        params: &[(String, Vec<usize>)],
        world: usize,
    ) -> EngineResult<Self> {
        if world == 0 {
            return Err(EngineError::Config("layout world size must be positive".into()));
        }
        let mut infos = Vec::with_capacity(params.len());
        let mut offset = 0;
        // A set, not a scan of the ones before: a checkpoint's table can list millions.
        let mut seen = std::collections::HashSet::with_capacity(params.len());
        for (pname, shape) in params {
            if !seen.insert(pname.as_str()) {
                return Err(EngineError::Layout(format!("parameter {pname:?} listed twice")));
            }
            let numel = shape
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(d))
                .ok_or_else(|| EngineError::Layout(format!("parameter {pname:?} of shape {shape:?} has more elements than memory can address")))?;
            infos.push(ParamInfo {
                name: pname.clone(),
                shape: shape.clone(),
                offset,
                numel,
            });
            offset = offset
                .checked_add(numel)
                .ok_or_else(|| EngineError::Layout(format!("unit parameters past {pname:?} have more elements than memory can address")))?;
        }
        let shard_len = offset.div_ceil(world);
        let name = name.into();
        let padded_numel = shard_len.checked_mul(world).ok_or_else(|| {
            EngineError::Layout(format!("unit {name:?} padded to {world} shards has more elements than memory can address"))
        })?;
        Ok(UnitLayout {
            name,
            params: infos,
            numel: offset,
            padded_numel,
            shard_len,
        })
    }

    /// Zero elements appended at the end of the buffer.
    pub fn padding(&self) -> usize {
        self.padded_numel - self.numel
    }

    /// Rank `rank`'s shard in padded coordinates: `[rank·S, (rank+1)·S)`.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The part of rank `rank`'s shard that holds real (non-padding) elements, in unit
    /// coordinates (may be empty).
    pub fn valid_shard_range(&self, rank: usize) -> Range<usize> {
        let r = self.shard_range(rank);
        r.start.min(self.numel)..r.end.min(self.numel)
    }

    /// A parameter by name.
    pub fn param(&self, name: &str) -> Option<&ParamInfo> {
        self.params.iter().find(|p| p.name == name)
    }

    /// How the parameters overlap rank `rank`'s shard, in flat order.
    pub fn pieces(&self, rank: usize) -> Vec<ParamPiece> {
        let shard = self.shard_range(rank);
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let start = p.offset.max(shard.start);
                let end = (p.offset + p.numel).min(shard.end);
                (start < end).then(|| ParamPiece {
                    param: i,
                    in_param: start - p.offset..end - p.offset,
                    in_shard: start - shard.start..end - shard.start,
                })
            })
            .collect()
    }
}

/// The description of a unit before layout: name and (parameter name, shape) list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    /// Unit name.
    pub name: String,
    /// Parameters in flat order.
    pub params: Vec<(String, Vec<usize>)>,
}

/// All units of a model, sharded over `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    /// Number of shards (the sharding group size; 1 when nothing is sharded, as in DDP).
    pub world: usize,
    /// Units in forward order.
    pub units: Vec<UnitLayout>,
}

impl FlatLayout {
    /// Lays out `specs` for `world` shards.
    ///
    /// # Errors
    /// `world == 0`, duplicate unit or parameter names.
    pub fn new(world: usize, specs: &[UnitSpec]) -> EngineResult<Self> {
        let mut units: Vec<UnitLayout> = Vec::with_capacity(specs.len());
        for s in specs {
            if units.iter().any(|u| u.name == s.name) {
                return Err(EngineError::Layout(format!("unit {:?} listed twice", s.name)));
            }
            let u = UnitLayout::new(s.name.clone(), &s.params, world)?;
            for p in &u.params {
                if units.iter().any(|o| o.param(&p.name).is_some()) {
                    return Err(EngineError::Layout(format!(
                        "parameter {:?} appears in two units",
                        p.name
                    )));
                }
            }
            units.push(u);
        }
        Ok(FlatLayout { world, units })
    }

    /// The unit specs this layout was built from (world-independent).
    pub fn specs(&self) -> Vec<UnitSpec> {
        self.units
            .iter()
            .map(|u| UnitSpec {
                name: u.name.clone(),
                params: u
                    .params
                    .iter()
                    .map(|p| (p.name.clone(), p.shape.clone()))
                    .collect(),
            })
            .collect()
    }

    /// The same units laid out for another number of shards (resharding).
    ///
    /// # Errors
    /// `world == 0`.
    pub fn with_world(&self, world: usize) -> EngineResult<Self> {
        FlatLayout::new(world, &self.specs())
    }

    /// Rank `rank`'s shard of unit `unit` in padded unit coordinates.
    pub fn shard_range(&self, unit: usize, rank: usize) -> Range<usize> {
        self.units[unit].shard_range(rank)
    }

    /// Ψ: total parameters (unpadded).
    pub fn total_numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Ψ_pad: total padded elements (`world ·` [`FlatLayout::total_shard_len`]).
    pub fn total_padded_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded_numel).sum()
    }

    /// Elements one rank owns over all units (`Σ shard_len`).
    pub fn total_shard_len(&self) -> usize {
        self.units.iter().map(|u| u.shard_len).sum()
    }

    /// The largest unit's padded size (bounds a gathered unit buffer).
    pub fn max_unit_padded_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded_numel).max().unwrap_or(0)
    }

    /// Index of a unit by name.
    pub fn unit_index(&self, name: &str) -> Option<usize> {
        self.units.iter().position(|u| u.name == name)
    }

    /// `(unit index, param index)` of a parameter by name.
    pub fn find_param(&self, name: &str) -> Option<(usize, usize)> {
        self.units.iter().enumerate().find_map(|(ui, u)| {
            u.params
                .iter()
                .position(|p| p.name == name)
                .map(|pi| (ui, pi))
        })
    }

    /// Checks that `other` has the same units and parameters (any world size).
    ///
    /// # Errors
    /// [`EngineError::Layout`] naming the first difference.
    pub fn check_same_model(&self, other: &FlatLayout) -> EngineResult<()> {
        if self.units.len() != other.units.len() {
            return Err(EngineError::Layout(format!(
                "{} units vs {}",
                self.units.len(),
                other.units.len()
            )));
        }
        for (a, b) in self.units.iter().zip(&other.units) {
            if a.name != b.name || a.params.len() != b.params.len() {
                return Err(EngineError::Layout(format!("unit {:?} vs {:?}", a.name, b.name)));
            }
            for (p, q) in a.params.iter().zip(&b.params) {
                if p.name != q.name || p.shape != q.shape {
                    return Err(EngineError::Layout(format!(
                        "parameter {:?} {:?} vs {:?} {:?}",
                        p.name, p.shape, q.name, q.shape
                    )));
                }
            }
        }
        Ok(())
    }
}

/// FSDP sharding strategies (PyTorch's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FsdpSharding {
    /// Parameters, gradients and optimizer state sharded (= ZeRO-3).
    FullShard,
    /// Gradients and optimizer state sharded (= ZeRO-2).
    ShardGradOp,
    /// Nothing sharded (= DDP).
    NoShard,
    /// FULL_SHARD inside a host, replicated across hosts.
    HybridShard,
}

/// Data-parallel strategy; one engine implements them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Replicated everything; bucketed all-reduce of gradients.
    Ddp,
    /// Optimizer state sharded.
    Zero1,
    /// Optimizer state and gradients sharded.
    Zero2,
    /// Optimizer state, gradients and parameters sharded.
    Zero3,
    /// FSDP naming (mapped onto the above, plus hybrid).
    Fsdp(FsdpSharding),
}

impl Strategy {
    /// The equivalent ZeRO stage (0 = DDP); hybrid is stage 3 inside a host.
    pub fn zero_stage(self) -> u8 {
        match self {
            Strategy::Ddp | Strategy::Fsdp(FsdpSharding::NoShard) => 0,
            Strategy::Zero1 => 1,
            Strategy::Zero2 | Strategy::Fsdp(FsdpSharding::ShardGradOp) => 2,
            Strategy::Zero3
            | Strategy::Fsdp(FsdpSharding::FullShard)
            | Strategy::Fsdp(FsdpSharding::HybridShard) => 3,
        }
    }

    /// Whether sharding is limited to a host and replicated across hosts.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Strategy::Fsdp(FsdpSharding::HybridShard))
    }

    /// Optimizer state (and fp32 master) sharded.
    pub fn shards_optimizer(self) -> bool {
        self.zero_stage() >= 1
    }

    /// Gradients sharded (reduce-scatter).
    pub fn shards_grads(self) -> bool {
        self.zero_stage() >= 2
    }

    /// Parameters sharded (gathered per unit around its forward and backward).
    pub fn shards_params(self) -> bool {
        self.zero_stage() >= 3
    }

    /// The canonical name accepted by [`FromStr`].
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::Fsdp(FsdpSharding::FullShard) => "fsdp",
            Strategy::Fsdp(FsdpSharding::ShardGradOp) => "fsdp-shard-grad-op",
            Strategy::Fsdp(FsdpSharding::NoShard) => "fsdp-no-shard",
            Strategy::Fsdp(FsdpSharding::HybridShard) => "hybrid",
        }
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = EngineError;

    /// `ddp | zero1 | zero2 | zero3 | fsdp (full_shard) | fsdp-shard-grad-op | fsdp-no-shard |
    /// hybrid (hybrid_shard)`; case-insensitive, `_` and `-` interchangeable.
    fn from_str(s: &str) -> EngineResult<Self> {
        let k = s.to_ascii_lowercase().replace('_', "-");
        Ok(match k.as_str() {
            "ddp" | "zero0" => Strategy::Ddp,
            "zero1" => Strategy::Zero1,
            "zero2" => Strategy::Zero2,
            "zero3" => Strategy::Zero3,
            "fsdp" | "full-shard" | "fsdp-full-shard" => Strategy::Fsdp(FsdpSharding::FullShard),
            "shard-grad-op" | "fsdp-shard-grad-op" => Strategy::Fsdp(FsdpSharding::ShardGradOp),
            "no-shard" | "fsdp-no-shard" => Strategy::Fsdp(FsdpSharding::NoShard),
            "hybrid" | "hybrid-shard" | "fsdp-hybrid" | "fsdp-hybrid-shard" => {
                Strategy::Fsdp(FsdpSharding::HybridShard)
            }
            _ => return Err(EngineError::UnknownStrategy(s.to_string())),
        })
    }
}

/// Per-step values common to every tile of the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepParams {
    /// The step number after increment (1 for the first update; AdamW's bias correction).
    pub step: u64,
    /// Learning rate of this step (after the schedule).
    pub lr: f64,
    /// Multiplier applied to every gradient before the update (clipping coefficient times the
    /// loss-scale inverse); exactly `1.0` means "no scaling" and is skipped.
    pub grad_scale: f32,
}

/// An optimizer over flat fp32 shards, updated tile by tile.
///
/// Contract: the update of element `i` depends only on element `i` of `param`, `grad` and the
/// state slots, and on `StepParams`; so any tiling of a shard gives bitwise the same result.
pub trait TileOptimizer: Send + Sync {
    /// Number of f32 state slots per element (AdamW: 2 = `m`, `v`; SGD with momentum: 1).
    fn state_slots(&self) -> usize;

    /// Short name stored in checkpoints (`adamw`, `sgd`).
    fn name(&self) -> &'static str;

    /// Updates one tile in place. `param`, `grad` and every `state[i]` have the same length and
    /// `state.len() == self.state_slots()`.
    fn step_tile(&self, p: &StepParams, param: &mut [f32], grad: &[f32], state: &mut [&mut [f32]]);
}

/// A tile handed to the update closure of [`OptimStateStore::update_unit`].
#[derive(Debug)]
pub struct StateTile<'a> {
    /// Offset of the tile within the unit's shard (`0..shard_len` coordinates).
    pub offset: usize,
    /// fp32 master values of the tile (updated in place).
    pub master: &'a mut [f32],
    /// Optimizer state slots of the tile (updated in place).
    pub state: &'a mut [&'a mut [f32]],
}

/// Where the fp32 master shard and optimizer state live when the engine does not own them
/// (CPU or NVMe offload). The engine owns gradients and the compute parameters; it runs the
/// step by calling [`OptimStateStore::update_unit`] per unit with a closure that updates one
/// tile (and copies the new master values into the compute parameters).
pub trait OptimStateStore: Send {
    /// Short name for logs and the benchmark summary (`cpu`, `nvme`).
    fn kind(&self) -> &'static str;

    /// Stores the initial master shard of `unit` and `slots` zeroed state slots of the same
    /// length.
    ///
    /// # Errors
    /// IO or allocation failures of the store.
    fn init_unit(&mut self, unit: usize, master: &[f32], slots: usize) -> EngineResult<()>;

    /// Feeds unit `unit`'s master and state tile by tile to `f` and persists what `f` wrote.
    ///
    /// # Errors
    /// IO failures, or what `f` returned.
    fn update_unit(
        &mut self,
        unit: usize,
        f: &mut dyn FnMut(StateTile<'_>) -> EngineResult<()>,
    ) -> EngineResult<()>;

    /// Reads unit `unit`'s master shard and state slots (checkpoints).
    ///
    /// # Errors
    /// IO failures.
    fn read_unit(&mut self, unit: usize) -> EngineResult<(Vec<f32>, Vec<Vec<f32>>)>;

    /// Replaces unit `unit`'s master shard and state slots (checkpoint load).
    ///
    /// # Errors
    /// IO failures or wrong lengths.
    fn write_unit(&mut self, unit: usize, master: &[f32], state: &[Vec<f32>]) -> EngineResult<()>;

    /// Bytes of master/state held in this process's memory right now (memory accounting).
    fn resident_bytes(&self) -> u64;
}

/// What one rank exposes for checkpoints, and accepts back on load.
///
/// `layout.world` is the sharding group size (1 for DDP/NO_SHARD, the host size for hybrid,
/// the world for ZeRO-1/2/3) and `shard_rank` this rank's index in it; `master[u]` and
/// `state[u][slot]` cover `layout.shard_range(u, shard_rank)` (padded, `shard_len` elements).
#[derive(Debug, Clone, PartialEq)]
pub struct ShardState {
    /// The strategy that produced the state.
    pub strategy: Strategy,
    /// Total ranks in the job.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Index of this rank in its sharding group.
    pub shard_rank: usize,
    /// Layout with `world` = sharding group size.
    pub layout: FlatLayout,
    /// Completed optimizer steps.
    pub step: u64,
    /// Optimizer name ([`TileOptimizer::name`]).
    pub optimizer: String,
    /// Per unit: fp32 master shard.
    pub master: Vec<Vec<f32>>,
    /// Per unit, per state slot (AdamW: `[m, v]`).
    pub state: Vec<Vec<Vec<f32>>>,
    /// Dynamic loss scale (f16 mixed precision), if any.
    pub loss_scale: Option<f32>,
    /// Steps without overflow since the loss scale last changed (it grows after the scaler's
    /// growth interval of them): saved so a resumed run grows it at the same step.
    pub loss_scale_good_steps: u32,
}

#[cfg(test)]
mod tests;
