//! Models the engine trains: a [`UnitModel`] is a sequence of units, each a function of its
//! flat parameters and the previous unit's output; the last unit returns the scalar loss.
//!
//! [`Gpt`] is the reference byte-level GPT of `shared/bench/reference_gpt.py`: token and
//! position embeddings (unit 0), `L` pre-LayerNorm blocks (units 1..=L: LayerNorm → causal
//! multi-head attention → projection, residual; LayerNorm → MLP(4D, exact GELU) → projection,
//! residual) and the final LayerNorm plus a bias-free head with the mean cross-entropy loss
//! (unit L+1). Initialisation follows PyTorch's defaults (Linear: U(±1/√fan_in) for weight and
//! bias; Embedding: N(0, 1); LayerNorm: ones and zeros) from a seeded RNG, so every rank builds
//! the same values independently of the world size.

use candle_core::{D, DType, Device, Tensor};

use crate::kernels;
use crate::native::NativeUnits;
use crate::layout::UnitSpec;

/// One micro-batch on one rank.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Token ids, `u32` `[b, t]`.
    pub inputs: Tensor,
    /// Next-token targets, `u32` `[b·t]`.
    pub targets: Tensor,
}

impl Batch {
    /// A batch from row-major token rows of length `t + 1` (inputs are the first `t` tokens,
    /// targets the last `t`).
    ///
    /// # Errors
    /// Candle errors (shape mismatch).
    pub fn from_rows(rows: &[Vec<u32>]) -> candle_core::Result<Batch> {
        let b = rows.len();
        let t = rows.first().map_or(0, |r| r.len().saturating_sub(1));
        let mut x = Vec::with_capacity(b * t);
        let mut y = Vec::with_capacity(b * t);
        for r in rows {
            x.extend_from_slice(&r[..t]);
            y.extend_from_slice(&r[1..=t]);
        }
        Ok(Batch {
            inputs: Tensor::from_vec(x, (b, t), &Device::Cpu)?,
            targets: Tensor::from_vec(y, b * t, &Device::Cpu)?,
        })
    }
}

/// A model split into units for per-unit gather/free and unit-by-unit backward.
pub trait UnitModel: Send + Sync {
    /// Why the model cannot be built, if it cannot (checked before anything else by
    /// [`crate::engine::Engine::new`]). `Ok` by default.
    ///
    /// # Errors
    /// What is wrong with the configuration, naming the values.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }

    /// Units in forward order with their parameters (names and shapes).
    fn specs(&self) -> Vec<UnitSpec>;

    /// Initial values of unit `unit`, flat and unpadded, deterministic in `seed`.
    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32>;

    /// Runs unit `unit`. `params` are its parameters in layout order (already shaped); `x` is
    /// the previous unit's output (`None` for unit 0). The last unit returns the scalar loss
    /// (mean over the batch's tokens, `f32`).
    ///
    /// # Errors
    /// Candle errors.
    fn forward_unit(
        &self,
        unit: usize,
        params: &[Tensor],
        x: Option<&Tensor>,
        batch: &Batch,
    ) -> candle_core::Result<Tensor>;

    /// A hand-written fp32 forward/backward of the same units, which the engine then uses for
    /// fp32 training instead of candle's autograd (see [`crate::native`]). `None` by default.
    fn native(&self) -> Option<&dyn NativeUnits> {
        None
    }
}

/// GPT hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary (256 for bytes).
    pub vocab: usize,
    /// Model width D.
    pub d_model: usize,
    /// Blocks L.
    pub layers: usize,
    /// Heads H (D must be divisible by H).
    pub heads: usize,
    /// Context length T.
    pub seq: usize,
}

impl GptConfig {
    /// Whether these hyper-parameters make a model: every size at least 1, `d_model` a multiple
    /// of `heads`, and every matrix (and the whole model) addressable.
    ///
    /// # Errors
    /// The first value that does not fit, named.
    pub fn check(&self) -> Result<(), String> {
        let GptConfig { vocab: v, d_model: d, layers, heads: h, seq: t } = *self;
        for (name, x) in [("vocab", v), ("d_model", d), ("heads", h), ("seq", t)] {
            if x == 0 {
                return Err(format!("{name} 0: must be at least 1"));
            }
        }
        if d % h != 0 {
            return Err(format!("d_model {d} is not a multiple of heads {h}"));
        }
        // Elements of the largest matrices and of the whole model, in 64-bit arithmetic.
        let block = d.checked_mul(d).and_then(|dd| dd.checked_mul(12)).and_then(|x| x.checked_add(d.checked_mul(13)?));
        let total = block
            .and_then(|b| b.checked_mul(layers))
            .and_then(|x| x.checked_add(v.checked_mul(d)?.checked_mul(2)?))
            .and_then(|x| x.checked_add(t.checked_mul(d)?))
            .and_then(|x| x.checked_add(t.checked_mul(t)?));
        match total {
            Some(n) if n <= (isize::MAX as usize) / 4 => Ok(()),
            _ => Err(format!("a model of vocab {v}, d_model {d}, {layers} layers and seq {t} has more parameters than memory can address")),
        }
    }

    /// Matrix-multiply FLOPs of one training step per token (forward and backward, nothing
    /// recomputed), as MFU counts them (PaLM, appendix B): `3 × (L·(24·D² + 4·T·D) + 2·D·V)`;
    /// the attention scores and values count the whole `T×T` square.
    pub fn train_flops_per_token(&self) -> f64 {
        let (d, t, l, v) = (self.d_model as f64, self.seq as f64, self.layers as f64, self.vocab as f64);
        3.0 * (l * (24.0 * d * d + 4.0 * t * d) + 2.0 * d * v)
    }

    /// The reference workload (D=256, L=4, H=4, T=128, V=256).
    pub fn reference() -> Self {
        GptConfig {
            vocab: 256,
            d_model: 256,
            layers: 4,
            heads: 4,
            seq: 128,
        }
    }
}

/// The reference byte-level GPT.
#[derive(Debug, Clone)]
pub struct Gpt {
    cfg: GptConfig,
    /// Use the fused CPU kernels (LayerNorm, causal softmax) instead of composed candle ops.
    fused: bool,
}

impl Gpt {
    /// A GPT with the fused kernels.
    pub fn new(cfg: GptConfig) -> Self {
        Gpt { cfg, fused: true }
    }

    /// Chooses between fused kernels (default) and plain candle ops (reference for tests).
    pub fn with_fused(mut self, fused: bool) -> Self {
        self.fused = fused;
        self
    }

    /// The configuration.
    pub fn config(&self) -> GptConfig {
        self.cfg
    }

    fn layer_norm(&self, x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused {
            return kernels::layer_norm(x, w, b, 1e-5);
        }
        let x32 = x.to_dtype(DType::F32)?;
        let mean = x32.mean_keepdim(D::Minus1)?;
        let xc = x32.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?;
        y.to_dtype(x.dtype())?.broadcast_mul(w)?.broadcast_add(b)
    }

    /// Causal self-attention from candle ops (the reference for the fused kernel, and the
    /// path for non-f32 compute): `qkv [b·t, 3d]` → `[b·t, d]`.
    fn attention_composed(&self, qkv: &Tensor, b: usize, t: usize) -> candle_core::Result<Tensor> {
        let GptConfig {
            d_model: d,
            heads: h,
            ..
        } = self.cfg;
        let hd = d / h;
        // [3, b, h, t, hd]
        let qkv = qkv.reshape((b, t, 3, h, hd))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
        let q = qkv.get(0)?;
        let k = qkv.get(1)?;
        let v = qkv.get(2)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let att = q.matmul(&k.t()?)?;
        let att = if self.fused {
            kernels::causal_softmax_scaled(&att, scale as f32)?
        } else {
            let att = (att * scale)?;
            let mask: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let mask = Tensor::from_vec(mask, (t, t), att.device())?.to_dtype(att.dtype())?;
            candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?
        };
        let y = att.matmul(&v)?; // [b, h, t, hd]
        y.transpose(1, 2)?.reshape((b * t, d))
    }

    /// [`linear`], with the fused bias kernel when `fused`.
    fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
        match b {
            Some(b) if self.fused => kernels::bias_add(&linear(x, w, None)?, b),
            _ => linear(x, w, b),
        }
    }
}

/// `x [n, in] · wᵀ [in, out] (+ b)`.
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> candle_core::Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

impl UnitModel for Gpt {
    fn check(&self) -> Result<(), String> {
        self.cfg.check()
    }

    fn specs(&self) -> Vec<UnitSpec> {
        let GptConfig {
            vocab: v,
            d_model: d,
            layers,
            seq: t,
            ..
        } = self.cfg;
        let mut units = vec![UnitSpec {
            name: "embed".into(),
            params: vec![
                ("tok.weight".into(), vec![v, d]),
                ("pos.weight".into(), vec![t, d]),
            ],
        }];
        for l in 0..layers {
            let p = |n: &str| format!("blocks.{l}.{n}");
            units.push(UnitSpec {
                name: format!("block.{l}"),
                params: vec![
                    (p("ln1.weight"), vec![d]),
                    (p("ln1.bias"), vec![d]),
                    (p("qkv.weight"), vec![3 * d, d]),
                    (p("qkv.bias"), vec![3 * d]),
                    (p("proj.weight"), vec![d, d]),
                    (p("proj.bias"), vec![d]),
                    (p("ln2.weight"), vec![d]),
                    (p("ln2.bias"), vec![d]),
                    (p("fc.weight"), vec![4 * d, d]),
                    (p("fc.bias"), vec![4 * d]),
                    (p("out.weight"), vec![d, 4 * d]),
                    (p("out.bias"), vec![d]),
                ],
            });
        }
        units.push(UnitSpec {
            name: "head".into(),
            params: vec![
                ("ln.weight".into(), vec![d]),
                ("ln.bias".into(), vec![d]),
                ("head.weight".into(), vec![v, d]),
            ],
        });
        units
    }

    fn init_unit(&self, unit: usize, seed: u64) -> Vec<f32> {
        let spec = &self.specs()[unit];
        let mut rng = SplitMix::new(seed ^ (unit as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut out = Vec::new();
        for (i, (name, shape)) in spec.params.iter().enumerate() {
            let n: usize = shape.iter().product();
            if name.ends_with("ln1.weight") || name.ends_with("ln2.weight") || name == "ln.weight"
            {
                out.extend(std::iter::repeat_n(1.0f32, n));
            } else if name.ends_with("ln1.bias") || name.ends_with("ln2.bias") || name == "ln.bias"
            {
                out.extend(std::iter::repeat_n(0.0f32, n));
            } else if unit == 0 {
                out.extend((0..n).map(|_| rng.normal()));
            } else {
                // Linear weight [out, in] or bias [out] of the preceding weight: bound 1/√fan_in.
                let fan_in = if shape.len() == 2 {
                    shape[1]
                } else {
                    spec.params[i - 1].1[1]
                };
                let bound = 1.0 / (fan_in as f64).sqrt();
                out.extend((0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32));
            }
        }
        out
    }

    fn native(&self) -> Option<&dyn NativeUnits> {
        // The composed (unfused) model is the reference for the fused kernels: it stays on
        // candle.
        self.fused.then_some(self as &dyn NativeUnits)
    }

    fn forward_unit(
        &self,
        unit: usize,
        p: &[Tensor],
        x: Option<&Tensor>,
        batch: &Batch,
    ) -> candle_core::Result<Tensor> {
        self.cfg.check().map_err(candle_core::Error::Msg)?;
        let GptConfig {
            d_model: d,
            layers,
            heads: h,
            ..
        } = self.cfg;
        let (b, t) = batch.inputs.dims2()?;
        if unit == 0 {
            let ids = batch.inputs.flatten_all()?;
            let tok = p[0].index_select(&ids, 0)?.reshape((b, t, d))?;
            let pos = p[1].narrow(0, 0, t)?;
            return tok.broadcast_add(&pos);
        }
        let x = x.ok_or_else(|| candle_core::Error::Msg(format!("unit {unit} needs an input")))?;
        if unit == layers + 1 {
            let y = self.layer_norm(&x.reshape((b * t, d))?, &p[0], &p[1])?;
            let logits = linear(&y, &p[2], None)?.to_dtype(DType::F32)?;
            return candle_nn::loss::cross_entropy(&logits, &batch.targets);
        }
        let hd = d / h;
        let x2 = x.reshape((b * t, d))?;
        let y = self.layer_norm(&x2, &p[0], &p[1])?;
        let qkv = self.linear(&y, &p[2], Some(&p[3]))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let y = if self.fused && qkv.dtype() == DType::F32 {
            kernels::causal_attention(&qkv, b, t, h, scale as f32)?
        } else {
            self.attention_composed(&qkv, b, t)?
        };
        let x2 = (x2 + self.linear(&y, &p[4], Some(&p[5]))?)?;
        let y = self.layer_norm(&x2, &p[6], &p[7])?;
        let y = if self.fused {
            kernels::bias_gelu(&linear(&y, &p[8], None)?, &p[9])?
        } else {
            linear(&y, &p[8], Some(&p[9]))?.gelu_erf()?
        };
        let x2 = (x2 + self.linear(&y, &p[10], Some(&p[11]))?)?;
        x2.reshape((b, t, d))
    }
}

/// A small deterministic RNG (SplitMix64) for initialisation and synthetic data.
#[derive(Debug, Clone)]
pub struct SplitMix {
    state: u64,
    spare: Option<f32>,
}

impl SplitMix {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        SplitMix {
            state: seed,
            spare: None,
        }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let a = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some((r * a.sin()) as f32);
        (r * a.cos()) as f32
    }
}

/// The global batch of step `step`: `global_batch` rows of `seq + 1` random tokens, fixed by
/// `(seed, step)` and independent of the world size. Rank `r` of `n` takes rows
/// `[r·B/n, (r+1)·B/n)` ([`rank_rows`]).
pub fn global_batch(seed: u64, step: u64, global_batch: usize, seq: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = SplitMix::new(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ step);
    (0..global_batch)
        .map(|_| (0..=seq).map(|_| (rng.next_u64() % vocab as u64) as u32).collect())
        .collect()
}

/// Rows of `rows` that rank `rank` of `world` takes (equal contiguous slices).
pub fn rank_rows(rows: &[Vec<u32>], rank: usize, world: usize) -> Vec<Vec<u32>> {
    let per = rows.len() / world.max(1);
    rows[rank * per..(rank + 1) * per].to_vec()
}
