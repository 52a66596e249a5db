//! Fused CPU kernels with backward passes, for ops where candle's composed version is slow
//! (many small passes and temporaries): LayerNorm over the last dimension and the causal
//! softmax of attention. f32 only; other dtypes fall back to composed candle ops.
//!
//! candle's own `candle_nn::ops::layer_norm` / `softmax_last_dim` have no backward, which is why
//! these exist.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let all = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => Err(candle_core::Error::Msg(format!("{op}: input must be contiguous"))),
    }
}

/// LayerNorm over the last dimension: `(x − mean) / √(var + eps) · w + b` (biased variance,
/// as PyTorch).
///
/// # Errors
/// Candle errors (shapes).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    if x.dtype() != DType::F32 {
        let x32 = x.to_dtype(DType::F32)?;
        let y = layer_norm(
            &x32,
            &w.to_dtype(DType::F32)?,
            &b.to_dtype(DType::F32)?,
            eps,
        )?;
        return y.to_dtype(x.dtype());
    }
    x.contiguous()?.apply_op3(w, b, LayerNorm { eps })
}

struct LayerNorm {
    eps: f32,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "layer-norm")?;
        let w = contiguous(s2, l2, "layer-norm")?;
        let b = contiguous(s3, l3, "layer-norm")?;
        let d = l1.dims().last().copied().unwrap_or(1);
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            let (mean, rstd) = moments(xr, self.eps);
            for i in 0..d {
                yr[i] = (xr[i] - mean) * rstd * w[i] + b[i];
            }
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let n = x.elem_count();
        let packed = x.apply_op3_no_bwd(w, &dy.contiguous()?, &LayerNormBwd { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, d)?.reshape(w.shape())?;
        let db = packed.narrow(0, n + d, d)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

fn moments(xr: &[f32], eps: f32) -> (f32, f32) {
    let d = xr.len() as f32;
    let mean = xr.iter().sum::<f32>() / d;
    let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Returns `[dx (n), dw (d), db (d)]` flattened.
struct LayerNormBwd {
    eps: f32,
}

impl CustomOp3 for LayerNormBwd {
    fn name(&self) -> &'static str {
        "fused-layer-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s1, l1, "layer-norm-bwd")?;
        let w = contiguous(s2, l2, "layer-norm-bwd")?;
        let dy = contiguous(s3, l3, "layer-norm-bwd")?;
        let d = w.len();
        let n = x.len();
        let mut out = vec![0f32; n + 2 * d];
        let (dx, rest) = out.split_at_mut(n);
        let (dw, db) = rest.split_at_mut(d);
        let mut xhat = vec![0f32; d];
        let mut g = vec![0f32; d];
        for ((xr, dyr), dxr) in x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d)) {
            let (mean, rstd) = moments(xr, self.eps);
            let mut sum_g = 0f32;
            let mut sum_gx = 0f32;
            for i in 0..d {
                xhat[i] = (xr[i] - mean) * rstd;
                g[i] = dyr[i] * w[i];
                sum_g += g[i];
                sum_gx += g[i] * xhat[i];
                dw[i] += dyr[i] * xhat[i];
                db[i] += dyr[i];
            }
            let inv_d = 1.0 / d as f32;
            for i in 0..d {
                dxr[i] = rstd * (g[i] - inv_d * sum_g - xhat[i] * inv_d * sum_gx);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from(n + 2 * d)))
    }
}

/// Softmax over the last dimension of `[.., t, t]` scores with a causal mask (row `i` attends to
/// columns `0..=i`; masked entries are exactly 0).
///
/// # Errors
/// Candle errors (shapes).
pub fn causal_softmax(att: &Tensor) -> candle_core::Result<Tensor> {
    causal_softmax_scaled(att, 1.0)
}

/// [`causal_softmax`] of `scale · att` (the attention's 1/√d folded into the kernel, saving a
/// pass and a graph node over the scores forward and backward).
///
/// # Errors
/// Candle errors (shapes).
pub fn causal_softmax_scaled(att: &Tensor, scale: f32) -> candle_core::Result<Tensor> {
    if att.dtype() != DType::F32 {
        let y = causal_softmax_scaled(&att.to_dtype(DType::F32)?, scale)?;
        return y.to_dtype(att.dtype());
    }
    att.contiguous()?.apply_op1(CausalSoftmax { scale })
}

struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "causal-softmax")?;
        let t = l.dims().last().copied().unwrap_or(1);
        let mut y = vec![0f32; x.len()];
        for (r, (xr, yr)) in x.chunks_exact(t).zip(y.chunks_exact_mut(t)).enumerate() {
            let valid = r % t + 1;
            let s = self.scale;
            let max = xr[..valid].iter().copied().fold(f32::NEG_INFINITY, f32::max) * s;
            for j in 0..valid {
                yr[j] = exp_f32(xr[j] * s - max);
            }
            let sum: f32 = yr[..valid].iter().sum();
            let inv = 1.0 / sum;
            for v in &mut yr[..valid] {
                *v *= inv;
            }
        }
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&dy.contiguous()?, &SoftmaxBwd { scale: self.scale })?))
    }
}

/// `dx = scale · y ⊙ (dy − Σ_j dy_j y_j)` per row.
struct SoftmaxBwd {
    scale: f32,
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "causal-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, "softmax-bwd")?;
        let dy = contiguous(s2, l2, "softmax-bwd")?;
        let t = l1.dims().last().copied().unwrap_or(1);
        let mut dx = vec![0f32; y.len()];
        for (r, ((yr, dyr), dxr)) in y
            .chunks_exact(t)
            .zip(dy.chunks_exact(t))
            .zip(dx.chunks_exact_mut(t))
            .enumerate()
        {
            let valid = r % t + 1;
            let dot: f32 = (0..valid).map(|j| yr[j] * dyr[j]).sum();
            let s = self.scale;
            for j in 0..valid {
                dxr[j] = s * (yr[j] * (dyr[j] - dot));
            }
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Keeps freed heap memory in the process instead of returning it to the kernel (glibc
/// `mallopt`: mmap threshold 32 MiB, no trimming, 64 MiB top pad).
///
/// Every candle op allocates its output, and most activations and gradients of a training step
/// are 0.1–4 MiB: with glibc's defaults many of them are fresh `mmap`s or re-grown heap tops,
/// so each step pays tens of thousands of page faults plus zeroing (measured: ~20 % of a
/// reference-GPT step on a 2-vCPU VM). With these settings the steady state reuses the same
/// pages (a caching allocator, as PyTorch's). Process-wide and idempotent; a no-op off glibc.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes allocator parameters; valid values per mallopt(3).
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
                libc::mallopt(libc::M_TOP_PAD, 64 << 20);
            }
        });
    }
}

// === Bias add, bias + GELU, and vectorizable erf / exp ===

/// `e^x` for `x ≤ 88` (Cephes polynomial, ~1 ulp), branch-free so loops over it vectorize.
/// Inputs below −87 return ≈ 1.6e−38 instead of denormals/0.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let e = p * r * r + r + 1.0;
    e * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `erf(x)` as a rational approximation on `[−4, 4]` (Eigen/XLA `fast_erf`, |err| ≲ 2e−7),
/// branch-free so loops over it vectorize.
#[inline(always)]
fn erf_f32(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = -2.726_142_3e-10f32;
    p = p * x2 + 2.770_681_4e-8;
    p = p * x2 + -2.101_024e-6;
    p = p * x2 + -5.692_506_4e-5;
    p = p * x2 + -7.349_906_3e-4;
    p = p * x2 + -2.954_600_1e-3;
    p = p * x2 + -1.609_603_3e-2;
    let mut q = -1.456_607_2e-5f32;
    q = q * x2 + -2.133_740_6e-4;
    q = q * x2 + -1.682_827e-3;
    q = q * x2 + -7.373_329_3e-3;
    q = q * x2 + -1.426_474e-2;
    x * p / q
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

fn colsum_into(dy: &[f32], o: usize, db: &mut [f32]) {
    for r in dy.chunks_exact(o) {
        for (d, x) in db.iter_mut().zip(r) {
            *d += *x;
        }
    }
}

/// `y + b` with `b` broadcast over the last dimension of `y` (a linear layer's bias). The
/// backward is `(dy, Σ_rows dy)`: candle's broadcast-add backward reduces the bias gradient
/// with a slow strided `sum_keepdim` and materialises a zero tensor per input.
///
/// # Errors
/// Candle errors (shapes).
pub fn bias_add(y: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if y.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return y.broadcast_add(b);
    }
    y.contiguous()?.apply_op2(b, BiasAdd)
}

struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, "bias-add")?;
        let b = contiguous(s2, l2, "bias-add")?;
        let o = b.len();
        if l1.dims().last().copied() != Some(o) {
            return Err(candle_core::Error::Msg(format!("bias-add: bias of {o} for {:?}", l1.dims())));
        }
        let mut out = Vec::with_capacity(y.len());
        for r in y.chunks_exact(o) {
            out.extend(r.iter().zip(b).map(|(a, c)| a + c));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = dy.contiguous()?.apply_op1_no_bwd(&ColSum { o: b.elem_count() })?;
        Ok((Some(dy.clone()), Some(db.reshape(b.shape())?)))
    }
}

/// `Σ_rows x` of a contiguous `[.., o]` tensor, as `[o]`.
struct ColSum {
    o: usize,
}

impl CustomOp1 for ColSum {
    fn name(&self) -> &'static str {
        "col-sum"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "col-sum")?;
        let mut db = vec![0f32; self.o];
        colsum_into(x, self.o, &mut db);
        Ok((CpuStorage::F32(db), Shape::from(self.o)))
    }
}

/// Exact (erf) GELU of `y + b`, `b` broadcast over the last dimension: the MLP's first
/// projection bias and activation in one pass, with a one-pass backward (candle's `gelu_erf`
/// backward is about ten element-wise ops).
///
/// # Errors
/// Candle errors (shapes).
pub fn bias_gelu(y: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if y.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return y.broadcast_add(b)?.gelu_erf();
    }
    y.contiguous()?.apply_op2(b, BiasGelu)
}

struct BiasGelu;

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, "bias-gelu")?;
        let b = contiguous(s2, l2, "bias-gelu")?;
        let o = b.len();
        if l1.dims().last().copied() != Some(o) {
            return Err(candle_core::Error::Msg(format!("bias-gelu: bias of {o} for {:?}", l1.dims())));
        }
        let mut out = vec![0f32; y.len()];
        for (r, orow) in y.chunks_exact(o).zip(out.chunks_exact_mut(o)) {
            for ((d, a), c) in orow.iter_mut().zip(r).zip(b) {
                let u = a + c;
                *d = 0.5 * u * (1.0 + erf_f32(u * FRAC_1_SQRT_2));
            }
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = y.elem_count();
        let o = b.elem_count();
        let packed = y.apply_op3_no_bwd(b, &dy.contiguous()?, &BiasGeluBwd)?;
        let du = packed.narrow(0, 0, n)?.reshape(y.shape())?;
        let db = packed.narrow(0, n, o)?.reshape(b.shape())?;
        Ok((Some(du), Some(db)))
    }
}

/// Returns `[du (n), db (o)]` with `du = dy · gelu'(y + b)`, `db = Σ_rows du`.
struct BiasGeluBwd;

impl CustomOp3 for BiasGeluBwd {
    fn name(&self) -> &'static str {
        "bias-gelu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, "bias-gelu-bwd")?;
        let b = contiguous(s2, l2, "bias-gelu-bwd")?;
        let dy = contiguous(s3, l3, "bias-gelu-bwd")?;
        let (n, o) = (y.len(), b.len());
        let mut out = vec![0f32; n + o];
        let (du, db) = out.split_at_mut(n);
        for ((r, g), d) in y.chunks_exact(o).zip(dy.chunks_exact(o)).zip(du.chunks_exact_mut(o)) {
            for (((d, a), c), g) in d.iter_mut().zip(r).zip(b).zip(g) {
                let u = a + c;
                let cdf = 0.5 * (1.0 + erf_f32(u * FRAC_1_SQRT_2));
                let pdf = FRAC_1_SQRT_2PI * exp_f32(-0.5 * u * u);
                *d = g * (cdf + u * pdf);
            }
        }
        colsum_into(du, o, db);
        Ok((CpuStorage::F32(out), Shape::from(n + o)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn erf_ref(x: f64) -> f64 {
        // Taylor series; fine in f64 for |x| ≤ 6 (the tail beyond is 1 to f32 precision).
        if x.abs() > 6.0 {
            return x.signum();
        }
        let (mut term, mut sum) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn fast_erf_and_exp_are_accurate() {
        let mut worst_erf = 0f64;
        let mut worst_exp = 0f64;
        for i in -80_000..=80_000 {
            let x = i as f32 * 1e-4;
            worst_erf = worst_erf.max((f64::from(erf_f32(x)) - erf_ref(f64::from(x))).abs());
            let e = f64::from(x * 10.0).exp();
            worst_exp = worst_exp.max(((f64::from(exp_f32(x * 10.0)) - e) / e).abs());
        }
        assert!(worst_erf < 5e-7, "erf abs error {worst_erf}");
        assert!(worst_exp < 5e-7, "exp rel error {worst_exp}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(-200.0) >= 0.0 && exp_f32(-200.0) < 1e-37);
    }
}
