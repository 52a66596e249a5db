//! Fused CPU kernels with backward passes, for ops where candle's composed version is slow
//! (many small passes and temporaries, and in backward a zero-filled gradient plus an add per
//! graph edge): LayerNorm over the last dimension, the causal softmax of attention (optionally
//! scaled), the whole causal attention of a packed `qkv` projection (gemm calls per head),
//! a linear layer's bias add and bias + exact GELU (vectorizable erf/exp, run with AVX-512 or
//! AVX2 when the CPU has them). f32 only; other dtypes fall back to composed candle ops.
//! [`tune_allocator`] keeps freed activations in the process (see there).
//!
//! candle's own `candle_nn::ops::layer_norm` / `softmax_last_dim` have no backward, which is why
//! these exist.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let all = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => Err(candle_core::Error::Msg(format!(
            "{op}: input must be contiguous"
        ))),
    }
}

/// Rows of 0 elements are refused by name (the kernels walk rows with `chunks_exact`, which
/// panics on a length of 0).
fn no_empty_rows(y: &Tensor, op: &str) -> candle_core::Result<()> {
    if y.dims().last() == Some(&0) {
        return Err(candle_core::Error::Msg(format!("{op}: rows of 0 elements ({:?})", y.dims())));
    }
    Ok(())
}

/// The contiguous rows `y` (`[.., o]`) and bias `b` (`[o]`) of a bias op, checked to fit.
fn rows_and_bias<'a>(
    s1: &'a CpuStorage,
    l1: &Layout,
    s2: &'a CpuStorage,
    l2: &Layout,
    op: &str,
) -> candle_core::Result<(&'a [f32], &'a [f32])> {
    let y = contiguous(s1, l1, op)?;
    let b = contiguous(s2, l2, op)?;
    if l1.dims().last().copied() != Some(b.len()) {
        return Err(candle_core::Error::Msg(format!(
            "{op}: bias of {} for {:?}",
            b.len(),
            l1.dims()
        )));
    }
    Ok((y, b))
}

/// LayerNorm over the last dimension: `(x − mean) / √(var + eps) · w + b` (biased variance,
/// as PyTorch).
///
/// # Errors
/// Candle errors (shapes).
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let d = x.dims().last().copied().unwrap_or(1);
    if d == 0 {
        return Err(candle_core::Error::Msg(format!("layer norm over rows of 0 elements ({:?})", x.dims())));
    }
    if w.elem_count() != d || b.elem_count() != d {
        return Err(candle_core::Error::Msg(format!(
            "layer norm over rows of {d}: weight of {} and bias of {} elements",
            w.elem_count(),
            b.elem_count()
        )));
    }
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 || b.dtype() != DType::F32 {
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
        for ((xr, dyr), dxr) in x
            .chunks_exact(d)
            .zip(dy.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
        {
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
    // The mask is the lower triangle of square T×T blocks: row r of a block sees r + 1 columns.
    let dims = att.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] || dims[dims.len() - 1] == 0 {
        return Err(candle_core::Error::Msg(format!("causal softmax of scores {dims:?}: the last two dimensions must be equal (T×T), T at least 1")));
    }
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
            let max = xr[..valid]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
                * s;
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
        Ok(Some(res.apply_op2_no_bwd(
            &dy.contiguous()?,
            &SoftmaxBwd { scale: self.scale },
        )?))
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

/// `e^x` (see [`crate::native::ops::exp`]), unfused, so every SIMD level rounds the same.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    crate::native::ops::exp::<false>(x)
}

/// `erf(x)` (see [`crate::native::ops::erf`]), unfused.
#[inline(always)]
fn erf_f32(x: f32) -> f32 {
    crate::native::ops::erf::<false>(x)
}

/// Runs `$f(args)` compiled for AVX-512F, AVX2 or baseline x86-64, as the engine's ISA level
/// says (the CPU's, or a lower one forced by RSRUN_ISA; the crate itself is built for baseline
/// x86-64). The kernels are plain
/// element-wise IEEE arithmetic without `mul_add`, so every variant returns bitwise the same.
macro_rules! simd_dispatch {
    ($f:ident($($a:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn avx512(f: impl FnOnce()) {
                f()
            }
            #[target_feature(enable = "avx2")]
            fn avx2(f: impl FnOnce()) {
                f()
            }
            // The engine's level (RSRUN_ISA may force a lower one, to measure or test).
            match crate::native::isa::isa() {
                // SAFETY: `isa()` only reports levels the CPU supports (AVX-512F among them).
                crate::native::isa::Isa::Avx512 => unsafe { avx512(|| $f($($a),*)) },
                // SAFETY: as above (the AVX2 level has AVX2).
                crate::native::isa::Isa::Avx2 => unsafe { avx2(|| $f($($a),*)) },
                crate::native::isa::Isa::Baseline => $f($($a),*),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            $f($($a),*)
        }
    }};
}

/// `out = gelu(y + b)` rows of `b.len()`.
#[inline(always)]
fn bias_gelu_fwd(y: &[f32], b: &[f32], out: &mut [f32]) {
    let o = b.len();
    for (r, orow) in y.chunks_exact(o).zip(out.chunks_exact_mut(o)) {
        for ((d, a), c) in orow.iter_mut().zip(r).zip(b) {
            let u = a + c;
            *d = 0.5 * u * (1.0 + erf_f32(u * FRAC_1_SQRT_2));
        }
    }
}

/// `du = dy · gelu'(y + b)` rows of `b.len()`.
#[inline(always)]
fn bias_gelu_bwd(y: &[f32], b: &[f32], dy: &[f32], du: &mut [f32]) {
    let o = b.len();
    for ((r, g), d) in y
        .chunks_exact(o)
        .zip(dy.chunks_exact(o))
        .zip(du.chunks_exact_mut(o))
    {
        for (((d, a), c), g) in d.iter_mut().zip(r).zip(b).zip(g) {
            let u = a + c;
            let cdf = 0.5 * (1.0 + erf_f32(u * FRAC_1_SQRT_2));
            let pdf = FRAC_1_SQRT_2PI * exp_f32(-0.5 * u * u);
            *d = g * (cdf + u * pdf);
        }
    }
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
    no_empty_rows(y, "bias add")?;
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
        let (y, b) = rows_and_bias(s1, l1, s2, l2, "bias-add")?;
        let o = b.len();
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
        let db = dy
            .contiguous()?
            .apply_op1_no_bwd(&ColSum { o: b.elem_count() })?;
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
    no_empty_rows(y, "bias gelu")?;
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
        let (y, b) = rows_and_bias(s1, l1, s2, l2, "bias-gelu")?;
        let mut out = vec![0f32; y.len()];
        simd_dispatch!(bias_gelu_fwd(y, b, &mut out));
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
        let (y, b) = rows_and_bias(s1, l1, s2, l2, "bias-gelu-bwd")?;
        let dy = contiguous(s3, l3, "bias-gelu-bwd")?;
        if dy.len() != y.len() {
            return Err(candle_core::Error::Msg(format!(
                "bias-gelu-bwd: gradient of {} elements for an output of {}",
                dy.len(),
                y.len()
            )));
        }
        let (n, o) = (y.len(), b.len());
        let mut out = vec![0f32; n + o];
        let (du, db) = out.split_at_mut(n);
        simd_dispatch!(bias_gelu_bwd(y, b, dy, du));
        colsum_into(du, o, db);
        Ok((CpuStorage::F32(out), Shape::from(n + o)))
    }
}

// === Fused causal attention ===

/// `dst (m×n) = beta · lhs (m×k) · rhs (k×n)`, or `dst += …` when `acc`; strides in elements
/// (`rs` row, `cs` column). One thread unless candle is configured for more.
///
/// # Safety
/// Every pointer must address its whole matrix under the given strides; `dst` must not
/// overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn mm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    (dst_rs, dst_cs): (usize, usize),
    acc: bool,
    lhs: *const f32,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const f32,
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
) {
    let threads = candle_core::utils::get_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            acc,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            par,
        );
    }
}

/// Causal multi-head self-attention of a packed projection `qkv [b·t, 3·d]` (per row `q | k | v`,
/// each `h` heads of `d/h`): `softmax(scale · q kᵀ, causal) v`, heads concatenated, as
/// `[b·t, d]`. One graph node instead of the reshape/permute/copy/narrow/transpose chain
/// (each of which costs candle a zero-filled gradient and an add in backward); the backward
/// recomputes the probabilities (¼ of the attention FLOPs) instead of keeping them.
///
/// # Errors
/// Candle errors (shapes, non-f32).
pub fn causal_attention(
    qkv: &Tensor,
    b: usize,
    t: usize,
    heads: usize,
    scale: f32,
) -> candle_core::Result<Tensor> {
    qkv.contiguous()?
        .apply_op1(Attention { b, t, heads, scale })
}

#[derive(Clone, Copy)]
struct Attention {
    b: usize,
    t: usize,
    heads: usize,
    scale: f32,
}

impl Attention {
    fn check(&self, l: &Layout) -> candle_core::Result<usize> {
        let (n, d3) = l.shape().dims2()?;
        if n != self.b * self.t || d3 % (3 * self.heads) != 0 {
            return Err(candle_core::Error::Msg(format!(
                "attention: qkv {:?} for b={} t={} h={}",
                l.dims(),
                self.b,
                self.t,
                self.heads
            )));
        }
        Ok(d3 / 3)
    }

    /// `p = softmax(scale · q kᵀ)` (causal) for batch `bi`, head `hi`; `p` is `t×t`.
    fn probs(&self, qkv: &[f32], d: usize, bi: usize, hi: usize, p: &mut [f32]) {
        let t = self.t;
        let hd = d / self.heads;
        let base = bi * t * 3 * d + hi * hd;
        // SAFETY: q and k (t×hd, row stride 3d) lie inside `qkv`; `p` is t×t and separate.
        unsafe {
            mm(
                (t, t, hd),
                p.as_mut_ptr(),
                (t, 1),
                false,
                qkv.as_ptr().add(base),
                (3 * d, 1),
                qkv.as_ptr().add(base + d),
                (1, 3 * d),
                1.0,
            );
        }
        let s = self.scale;
        for (r, row) in p.chunks_exact_mut(t).enumerate() {
            let valid = r + 1;
            let max = row[..valid]
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max)
                * s;
            for x in &mut row[..valid] {
                *x = exp_f32(*x * s - max);
            }
            let inv = 1.0 / row[..valid].iter().sum::<f32>();
            for x in &mut row[..valid] {
                *x *= inv;
            }
            row[valid..].fill(0.0);
        }
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let qkv = contiguous(s, l, "attention")?;
        let d = self.check(l)?;
        let (t, hd) = (self.t, d / self.heads);
        let mut y = vec![0f32; self.b * t * d];
        let mut p = vec![0f32; t * t];
        for bi in 0..self.b {
            for hi in 0..self.heads {
                self.probs(qkv, d, bi, hi, &mut p);
                let v = bi * t * 3 * d + 2 * d + hi * hd;
                // SAFETY: y's block (t×hd, row stride d) and v (row stride 3d) are in bounds.
                unsafe {
                    mm(
                        (t, hd, t),
                        y.as_mut_ptr().add(bi * t * d + hi * hd),
                        (d, 1),
                        false,
                        p.as_ptr(),
                        (t, 1),
                        qkv.as_ptr().add(v),
                        (3 * d, 1),
                        1.0,
                    );
                }
            }
        }
        Ok((CpuStorage::F32(y), Shape::from((self.b * t, d))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(
            &dy.contiguous()?,
            &AttentionBwd(*self),
        )?))
    }
}

/// `dqkv` from `qkv` and `dy`.
struct AttentionBwd(Attention);

impl CustomOp2 for AttentionBwd {
    fn name(&self) -> &'static str {
        "causal-attention-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let a = &self.0;
        let qkv = contiguous(s1, l1, "attention-bwd")?;
        let dy = contiguous(s2, l2, "attention-bwd")?;
        let d = a.check(l1)?;
        if dy.len() != a.b * a.t * d {
            return Err(candle_core::Error::Msg("attention-bwd: dy shape".into()));
        }
        let (t, hd) = (a.t, d / a.heads);
        let mut dqkv = vec![0f32; qkv.len()];
        let mut p = vec![0f32; t * t];
        let mut dp = vec![0f32; t * t];
        for bi in 0..a.b {
            for hi in 0..a.heads {
                a.probs(qkv, d, bi, hi, &mut p);
                let base = bi * t * 3 * d + hi * hd;
                let (q, k, v) = (base, base + d, base + 2 * d);
                let dyo = bi * t * d + hi * hd;
                // SAFETY (all calls): every block is in bounds of its buffer under its strides;
                // destinations never overlap sources (dqkv, dp vs qkv, dy, p).
                unsafe {
                    // dP = dY · Vᵀ
                    mm(
                        (t, t, hd),
                        dp.as_mut_ptr(),
                        (t, 1),
                        false,
                        dy.as_ptr().add(dyo),
                        (d, 1),
                        qkv.as_ptr().add(v),
                        (1, 3 * d),
                        1.0,
                    );
                    // dV = Pᵀ · dY
                    mm(
                        (t, hd, t),
                        dqkv.as_mut_ptr().add(v),
                        (3 * d, 1),
                        false,
                        p.as_ptr(),
                        (1, t),
                        dy.as_ptr().add(dyo),
                        (d, 1),
                        1.0,
                    );
                }
                // dS = scale · P ⊙ (dP − Σ_j dP_j P_j), causal.
                for (r, (pr, gr)) in p.chunks_exact(t).zip(dp.chunks_exact_mut(t)).enumerate() {
                    let valid = r + 1;
                    let dot: f32 = (0..valid).map(|j| pr[j] * gr[j]).sum();
                    for j in 0..valid {
                        gr[j] = a.scale * (pr[j] * (gr[j] - dot));
                    }
                    gr[valid..].fill(0.0);
                }
                unsafe {
                    // dQ = dS · K
                    mm(
                        (t, hd, t),
                        dqkv.as_mut_ptr().add(q),
                        (3 * d, 1),
                        false,
                        dp.as_ptr(),
                        (t, 1),
                        qkv.as_ptr().add(k),
                        (3 * d, 1),
                        1.0,
                    );
                    // dK = dSᵀ · Q
                    mm(
                        (t, hd, t),
                        dqkv.as_mut_ptr().add(k),
                        (3 * d, 1),
                        false,
                        dp.as_ptr(),
                        (1, t),
                        qkv.as_ptr().add(q),
                        (3 * d, 1),
                        1.0,
                    );
                }
            }
        }
        Ok((CpuStorage::F32(dqkv), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    /// Shapes the kernels cannot serve are errors naming them, not a panic inside a custom op
    /// (a short LayerNorm weight) or a silently wrong mask (non-square scores).
    #[test]
    fn mismatched_shapes_are_errors() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((3, 8), DType::F32, &dev).unwrap();
        let short = Tensor::ones(7, DType::F32, &dev).unwrap();
        let ok = Tensor::ones(8, DType::F32, &dev).unwrap();
        let e = super::layer_norm(&x, &short, &ok, 1e-5).unwrap_err().to_string();
        assert!(e.contains("rows of 8") && e.contains("weight of 7"), "{e}");
        // A bf16 weight with f32 rows is converted, not refused.
        let y = super::layer_norm(&x, &ok.to_dtype(DType::BF16).unwrap(), &ok, 1e-5).unwrap();
        assert_eq!(y.dims(), &[3, 8]);
        let scores = Tensor::zeros((2, 4, 5), DType::F32, &dev).unwrap();
        let e = super::causal_softmax(&scores).unwrap_err().to_string();
        assert!(e.contains("[2, 4, 5]") && e.contains("T×T"), "{e}");
        let square = Tensor::zeros((2, 4, 4), DType::F32, &dev).unwrap();
        assert_eq!(super::causal_softmax(&square).unwrap().dims(), &[2, 4, 4]);
        // Rows of 0 elements: named, not a chunks_exact(0) panic.
        let empty = Tensor::zeros((3, 0), DType::F32, &dev).unwrap();
        let none = Tensor::zeros(0, DType::F32, &dev).unwrap();
        for e in [
            super::layer_norm(&empty, &none, &none, 1e-5).unwrap_err().to_string(),
            super::bias_add(&empty, &none).unwrap_err().to_string(),
            super::bias_gelu(&empty, &none).unwrap_err().to_string(),
            super::causal_softmax(&Tensor::zeros((2, 0, 0), DType::F32, &dev).unwrap()).unwrap_err().to_string(),
        ] {
            assert!(e.contains("0 elements") || e.contains("T at least 1"), "{e}");
        }
    }
}
