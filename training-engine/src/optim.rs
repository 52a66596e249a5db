//! Optimizers over flat fp32 shards ([`TileOptimizer`]), the learning-rate schedule and the
//! cross-shard gradient norm.
//!
//! [`AdamW`] follows `torch.optim.AdamW` (single-tensor path) with its defaults
//! (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2), per element:
//! `p ← p·(1 − lr·wd)`; `m ← m + (1−β1)(g − m)` (torch's `lerp`); `v ← β2·v + (1−β2)·g²`;
//! `p ← p − (lr / (1−β1^t)) · m / (√v / √(1−β2^t) + eps)`. Scalars are computed in f64 and
//! applied in f32, like PyTorch's CPU kernels.
//! [`Sgd`] follows `torch.optim.SGD` with momentum (dampening 0, no Nesterov):
//! `g ← g + wd·p`; `b ← μ·b + g` (`b = g` on the first step); `p ← p − lr·b`.

use crate::layout::{StepParams, TileOptimizer};

/// AdamW hyper-parameters (PyTorch defaults in [`AdamW::default`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Base learning rate (the schedule scales it).
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl TileOptimizer for AdamW {
    fn state_slots(&self) -> usize {
        2
    }

    fn name(&self) -> &'static str {
        "adamw"
    }

    fn step_tile(&self, p: &StepParams, param: &mut [f32], grad: &[f32], state: &mut [&mut [f32]]) {
        // Past i32::MAX steps beta^t is 0 already: saturating is exact (a cast would wrap).
        let t = i32::try_from(p.step).unwrap_or(i32::MAX);
        let decay = (1.0 - p.lr * self.weight_decay) as f32;
        let w1 = (1.0 - self.beta1) as f32;
        let b2 = self.beta2 as f32;
        let w2 = (1.0 - self.beta2) as f32;
        let step_size = (p.lr / (1.0 - self.beta1.powi(t))) as f32;
        let bc2_sqrt = (1.0 - self.beta2.powi(t)).sqrt() as f32;
        let eps = self.eps as f32;
        let scale = p.grad_scale;
        let (m, rest) = state.split_at_mut(1);
        let (m, v) = (&mut *m[0], &mut *rest[0]);
        for i in 0..param.len() {
            let g = if scale == 1.0 { grad[i] } else { grad[i] * scale };
            let mut x = param[i];
            if decay != 1.0 {
                x *= decay;
            }
            m[i] += w1 * (g - m[i]);
            v[i] = v[i] * b2 + w2 * g * g;
            let denom = v[i].sqrt() / bc2_sqrt + eps;
            param[i] = x - step_size * (m[i] / denom);
        }
    }
}

/// SGD with momentum (PyTorch semantics, dampening 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sgd {
    /// Base learning rate.
    pub lr: f64,
    /// Momentum μ (0 disables the buffer).
    pub momentum: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
}

impl TileOptimizer for Sgd {
    fn state_slots(&self) -> usize {
        usize::from(self.momentum != 0.0)
    }

    fn name(&self) -> &'static str {
        "sgd"
    }

    fn step_tile(&self, p: &StepParams, param: &mut [f32], grad: &[f32], state: &mut [&mut [f32]]) {
        let lr = p.lr as f32;
        let wd = self.weight_decay as f32;
        let mu = self.momentum as f32;
        for i in 0..param.len() {
            let mut g = grad[i] * p.grad_scale;
            if wd != 0.0 {
                g += wd * param[i];
            }
            if let Some(buf) = state.first_mut() {
                buf[i] = if p.step == 1 { g } else { mu * buf[i] + g };
                g = buf[i];
            }
            param[i] -= lr * g;
        }
    }
}

/// Which optimizer the engine runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerConfig {
    /// AdamW.
    AdamW(AdamW),
    /// SGD with momentum.
    Sgd(Sgd),
}

impl OptimizerConfig {
    /// The base learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerConfig::AdamW(a) => a.lr,
            OptimizerConfig::Sgd(s) => s.lr,
        }
    }

    /// As a [`TileOptimizer`].
    pub fn as_tile(&self) -> &dyn TileOptimizer {
        match self {
            OptimizerConfig::AdamW(a) => a,
            OptimizerConfig::Sgd(s) => s,
        }
    }
}

/// Linear warmup then cosine decay to `min_lr_ratio · lr` at `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Steps of linear warmup (lr·step/warmup for step ≤ warmup).
    pub warmup_steps: u64,
    /// Step at which the cosine reaches its minimum (constant afterwards).
    pub total_steps: u64,
    /// Final lr as a fraction of the base lr.
    pub min_lr_ratio: f64,
}

impl Schedule {
    /// Learning rate of step `step` (1-based).
    pub fn lr(&self, base: f64, step: u64) -> f64 {
        if step <= self.warmup_steps && self.warmup_steps > 0 {
            return base * step as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps.min(step)) as f64 / span).min(1.0);
        let min = base * self.min_lr_ratio;
        min + 0.5 * (base - min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// Σ g² of a slice, accumulated in f64 (so the global norm hardly depends on partitioning).
pub fn sum_sq(g: &[f32]) -> f64 {
    g.iter().map(|x| f64::from(*x) * f64::from(*x)).sum()
}

/// PyTorch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`.
pub fn clip_coef(total_norm: f64, max_norm: f64) -> f32 {
    (max_norm / (total_norm + 1e-6)).min(1.0) as f32
}

#[cfg(test)]
mod tests;
