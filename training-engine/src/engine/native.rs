//! The engine's forward and backward on the native fp32 path (`crate::native`): the same unit
//! order, ZeRO-3 gather/free, and per-unit reductions as the candle path in `engine.rs`, with
//! activations in reused [`UnitCache`]s and weight gradients accumulated straight into the
//! gradient buffers.

use candle_core::{CpuStorage, Storage, Var};

use super::{Engine, Reductions, flat};
use crate::error::{EngineError, EngineResult};
use crate::layout::UnitLayout;
use crate::model::{Batch, UnitModel};
use crate::native::{NativeBatch, Scratch, UnitCache};

/// Buffers of the native path, kept across steps.
#[derive(Debug, Default)]
pub(super) struct NativeState {
    caches: Vec<UnitCache>,
    scratch: Scratch,
    dy: Vec<f32>,
    dx: Vec<f32>,
    /// A unit's gradients of one micro-batch when its accumulation buffer already holds earlier
    /// micro-batches' (added afterwards, so accumulation rounds as the candle path does).
    fresh: Vec<f32>,
}

/// Runs `f` on a unit's parameters, one slice per parameter: from the ZeRO-3 gathered flat
/// buffer when there is one, else from the `Var`s.
fn unit_params<R>(vars: &[Var], gathered: &[f32], ul: &UnitLayout, f: impl FnOnce(&[&[f32]]) -> R) -> EngineResult<R> {
    if gathered.is_empty() {
        return with_params(vars, f);
    }
    if gathered.len() < ul.numel {
        return Err(EngineError::Tensor(format!(
            "unit {}: {} gathered values for {} parameters",
            ul.name,
            gathered.len(),
            ul.numel
        )));
    }
    let slices: Vec<&[f32]> = ul.params.iter().map(|p| &gathered[p.range()]).collect();
    Ok(f(&slices))
}

/// Runs `f` on the f32 data of `vars` (one slice per parameter).
fn with_params<R>(vars: &[Var], f: impl FnOnce(&[&[f32]]) -> R) -> EngineResult<R> {
    let guards: Vec<_> = vars.iter().map(|v| v.as_tensor().storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(vars.len());
    for (i, (s, l)) in guards.iter().enumerate() {
        match (&**s, l.contiguous_offsets()) {
            (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => slices.push(&v[a..b]),
            _ => {
                return Err(EngineError::Tensor(format!(
                    "parameter {i} is not contiguous f32 on the CPU"
                )));
            }
        }
    }
    Ok(f(&slices))
}

impl<M: UnitModel> Engine<M> {
    /// Whether steps run on the native path: the model offers it and training is fp32.
    pub(super) fn native_enabled(&self) -> bool {
        self.model.native().is_some() && self.cfg.precision == super::Precision::Fp32
    }

    /// [`Engine::forward_backward`] on the native path; `first` says the gradient buffers hold
    /// nothing yet this step.
    pub(super) fn forward_backward_native(&mut self, batch: &Batch, sync: bool, first: bool) -> EngineResult<f32> {
        let nb = NativeBatch::from_batch(batch)?;
        let n = self.units.len();
        if n == 0 {
            return Err(EngineError::Config("model has no units".into()));
        }
        let z3 = self.cfg.strategy.shards_params();
        let stage = self.cfg.strategy.zero_stage();
        self.native.caches.resize_with(n, UnitCache::default);
        for ui in 0..n {
            if z3 {
                self.ensure_gathered(ui)?;
                if ui + 1 < n {
                    self.prefetch(ui + 1)?;
                }
            }
            let native = self
                .model
                .native()
                .ok_or_else(|| EngineError::Config("model has no native path".into()))?;
            let (before, rest) = self.native.caches.split_at_mut(ui);
            let x: &[f32] = before.last().map_or(&[], |c| c.out.as_slice());
            let u = &self.units[ui];
            unit_params(&u.vars, &u.gathered, &self.layout.units[ui], |p| {
                native.forward(ui, p, x, &nb, &mut rest[0])
            })??;
            if z3 && ui + 1 < n {
                self.free_unit(ui)?;
            }
        }
        let loss = match self.native.caches[n - 1].out.as_slice() {
            [l] => *l,
            other => {
                return Err(EngineError::Tensor(format!(
                    "the last unit returned {} values, expected the scalar loss",
                    other.len()
                )));
            }
        };
        let mut works = Reductions::default();
        let st = &mut self.native;
        st.dy.clear();
        st.dy.push(self.scaler.map_or(1.0, |s| s.scale));
        for ui in (0..n).rev() {
            if z3 {
                self.ensure_gathered(ui)?;
                if ui > 0 {
                    self.prefetch(ui - 1)?;
                }
            }
            let native = self
                .model
                .native()
                .ok_or_else(|| EngineError::Config("model has no native path".into()))?;
            let ul = &self.layout.units[ui];
            let st = &mut self.native;
            let (before, rest) = st.caches.split_at_mut(ui);
            let x: &[f32] = before.last().map_or(&[], |c| c.out.as_slice());
            let cache = &mut rest[0];
            let vars = self.units[ui].vars.clone();
            // The gathered parameters move out while the unit's gradient buffer is written.
            let gathered = std::mem::take(&mut self.units[ui].gathered);
            // Every buffer below is overwritten (`acc` false): no zeroing first.
            let mut run = |grads: &mut [f32]| {
                unit_params(&vars, &gathered, ul, |p| {
                    native.backward(ui, p, x, &nb, cache, &st.dy, grads, false, &mut st.dx, &mut st.scratch)
                })?
            };
            let mut flat = flat::FlatBuf::default();
            let mut fresh_back = None;
            if stage >= 2 {
                // A fresh zeroed buffer per unit and micro-batch, reduce-scattered below.
                flat = flat::FlatBuf::zeros(flat::FlatDtype::F32, ul.padded_numel);
                let g = flat
                    .as_f32_mut()
                    .ok_or_else(|| EngineError::Config("fp32 gradient buffer expected".into()))?;
                run(&mut g[..ul.numel])?;
            } else if first {
                let mut buf = std::mem::take(&mut self.units[ui].grad);
                let r = match buf.as_f32_mut() {
                    Some(g) => run(&mut g[..ul.numel]),
                    None => Err(EngineError::Config("fp32 gradient buffer expected".into())),
                };
                self.units[ui].grad = buf;
                r?;
            } else {
                let mut fresh = std::mem::take(&mut st.fresh);
                fresh.resize(ul.numel, 0.0);
                let r = run(&mut fresh);
                self.units[ui].grad.add_f32(0, &fresh);
                fresh_back = Some(fresh);
                r?;
            }
            drop(run);
            if let Some(f) = fresh_back {
                self.native.fresh = f;
            }
            self.units[ui].gathered = gathered;
            let st = &mut self.native;
            std::mem::swap(&mut st.dy, &mut st.dx);
            if z3 {
                self.free_unit(ui)?;
            }
            self.reduce_unit(ui, flat, sync, first, &mut works)?;
        }
        self.finish_reductions(works)?;
        Ok(loss)
    }
}
