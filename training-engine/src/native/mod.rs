//! The native fp32 path: hand-written forward and backward of a model's units on plain `f32`
//! slices, without a candle graph.
//!
//! A candle step allocates every activation and gradient, zero-fills a gradient tensor per
//! graph edge and adds them up, and runs bias adds, residual adds and gradient accumulation as
//! separate passes (measured on the reference GPT: ~10 % of the step in memset, ~12 % in
//! element-wise adds). Here every buffer lives in a per-unit [`UnitCache`] reused across steps,
//! bias and residual adds are folded into the gemm's starting value, weight gradients are
//! accumulated by the gemm straight into the engine's gradient buffer, and the element-wise
//! kernels ([`ops`]) run at the CPU's SIMD level ([`isa`]). The engine uses this path for fp32
//! training when [`crate::model::UnitModel::native`] offers it; 16-bit precision and the
//! composed reference model go through candle.
//!
//! The candle path is the reference: tests check that both give the same outputs and
//! gradients (`native/tests.rs`).

pub mod isa;
pub(crate) mod gemm;
pub(crate) mod ops;
pub mod profile;
mod gpt;

use crate::error::EngineResult;

/// One micro-batch as the native path reads it.
#[derive(Debug, Clone, Default)]
pub struct NativeBatch {
    /// Rows.
    pub b: usize,
    /// Tokens per row.
    pub t: usize,
    /// Token ids, `b·t`, row-major.
    pub inputs: Vec<u32>,
    /// Next-token targets, `b·t`.
    pub targets: Vec<u32>,
}

impl NativeBatch {
    /// The ids of a candle [`crate::model::Batch`].
    ///
    /// # Errors
    /// Tensor errors (not `u32`, wrong rank).
    pub fn from_batch(batch: &crate::model::Batch) -> EngineResult<Self> {
        let (b, t) = batch.inputs.dims2()?;
        Ok(NativeBatch {
            b,
            t,
            inputs: batch.inputs.flatten_all()?.to_vec1::<u32>()?,
            targets: batch.targets.flatten_all()?.to_vec1::<u32>()?,
        })
    }
}

/// What a unit's forward keeps for its backward, and its output; reused across steps (buffers
/// only grow).
#[derive(Debug, Default)]
pub struct UnitCache {
    /// The unit's output (the scalar loss for the last unit).
    pub out: Vec<f32>,
    /// Saved activations, laid out by the model.
    pub saved: Vec<Vec<f32>>,
}

/// Backward-time temporaries shared by all units (sized by the largest user).
#[derive(Debug, Default)]
pub struct Scratch {
    /// Buffers, laid out by the model.
    pub bufs: Vec<Vec<f32>>,
}

/// `buf` resized to `n` elements (contents unspecified where the caller overwrites them).
pub(crate) fn sized(buf: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if buf.len() != n {
        buf.resize(n, 0.0);
    }
    buf.as_mut_slice()
}

/// Hand-written fp32 forward and backward of a model's units.
pub trait NativeUnits: Send + Sync {
    /// Runs unit `unit` on its parameters (`params[i]` is parameter `i` of the unit's spec, in
    /// layout order) and input `x` (the previous unit's output; empty for unit 0). Writes the
    /// output into `cache.out` and keeps what the backward needs in `cache`.
    ///
    /// # Errors
    /// Shape mismatches, ids out of range.
    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        x: &[f32],
        batch: &NativeBatch,
        cache: &mut UnitCache,
    ) -> EngineResult<()>;

    /// Backward of unit `unit` after its forward: `dy` is the gradient of its output (for the
    /// last unit, one element: the gradient of the loss, i.e. the loss scale). Writes the
    /// parameter gradients into `grads` (the unit's flat gradient in layout order), adding them
    /// to its contents when `acc` and overwriting them otherwise (so a fresh buffer needs no
    /// zeroing), and writes the gradient of `x` into `dx` (left empty for unit 0).
    ///
    /// # Errors
    /// Shape mismatches.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        unit: usize,
        params: &[&[f32]],
        x: &[f32],
        batch: &NativeBatch,
        cache: &mut UnitCache,
        dy: &[f32],
        grads: &mut [f32],
        acc: bool,
        dx: &mut Vec<f32>,
        scratch: &mut Scratch,
    ) -> EngineResult<()>;
}

#[cfg(test)]
mod tests;
