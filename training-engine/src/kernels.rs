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
    if att.dtype() != DType::F32 {
        let y = causal_softmax(&att.to_dtype(DType::F32)?)?;
        return y.to_dtype(att.dtype());
    }
    att.contiguous()?.apply_op1(CausalSoftmax)
}

struct CausalSoftmax;

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
            let max = xr[..valid].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for j in 0..valid {
                let e = (xr[j] - max).exp();
                yr[j] = e;
                sum += e;
            }
            let inv = 1.0 / sum;
            for v in &mut yr[..valid] {
                *v *= inv;
            }
        }
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&dy.contiguous()?, &SoftmaxBwd)?))
    }
}

/// `dx = y ⊙ (dy − Σ_j dy_j y_j)` per row.
struct SoftmaxBwd;

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
            for j in 0..valid {
                dxr[j] = yr[j] * (dyr[j] - dot);
            }
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}
