//! The reference GPT's units on the native path (the same function as `model::Gpt` on
//! candle: embeddings, pre-LayerNorm blocks with causal attention and an exact-GELU MLP, final
//! LayerNorm, bias-free head, mean cross-entropy).

use super::gemm::Shape;
use super::{NativeBatch, NativeUnits, Scratch, UnitCache, gemm, ops, sized};
use crate::error::{EngineError, EngineResult};
use crate::model::{Gpt, GptConfig};

const EPS: f32 = 1e-5;

/// Saved buffers of a block, in order: LN1 mean, rstd and output, qkv, attention probabilities,
/// attention output, the residual stream after attention (x2), LN2 mean, rstd and output, the
/// GELU derivative at the MLP pre-activation (gelu'(u)) and the GELU (g).
const BLOCK_SAVED: usize = 12;

/// Scratch buffers of a backward: dg (MLP hidden), dh, dx2, datt, dqkv, dp (one t×t block).
const SCRATCH: usize = 6;

fn bad(msg: String) -> EngineError {
    EngineError::Tensor(msg)
}

impl Gpt {
    /// Parameter lengths of unit `unit`, in layout order.
    fn param_lens(&self, unit: usize) -> Vec<usize> {
        let GptConfig {
            vocab: v,
            d_model: d,
            layers,
            seq,
            ..
        } = self.config();
        if unit == 0 {
            vec![v * d, seq * d]
        } else if unit == layers + 1 {
            vec![d, d, v * d]
        } else {
            vec![d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
        }
    }

    fn check(&self, unit: usize, params: &[&[f32]], x: &[f32], batch: &NativeBatch) -> EngineResult<usize> {
        let GptConfig {
            vocab: v,
            d_model: d,
            layers,
            seq,
            ..
        } = self.config();
        self.config().check().map_err(bad)?;
        if unit > layers + 1 {
            return Err(bad(format!("unit {unit} of a GPT with {} units", layers + 2)));
        }
        let lens = self.param_lens(unit);
        if params.len() != lens.len() || params.iter().zip(&lens).any(|(p, l)| p.len() != *l) {
            return Err(bad(format!(
                "unit {unit}: parameters of {:?} elements, expected {lens:?}",
                params.iter().map(|p| p.len()).collect::<Vec<_>>()
            )));
        }
        let n = batch.b * batch.t;
        if batch.t == 0 || batch.t > seq || batch.inputs.len() != n || batch.targets.len() != n {
            return Err(bad(format!(
                "batch of {}×{} with {} ids and {} targets (context {seq})",
                batch.b,
                batch.t,
                batch.inputs.len(),
                batch.targets.len()
            )));
        }
        if unit == 0 {
            if let Some(id) = batch.inputs.iter().find(|&&i| i as usize >= v) {
                return Err(bad(format!("token id {id} out of range for vocabulary {v}")));
            }
        } else if x.len() != n * d {
            return Err(bad(format!("unit {unit}: input of {} elements, expected {}", x.len(), n * d)));
        }
        if unit == layers + 1
            && let Some(id) = batch.targets.iter().find(|&&i| i as usize >= v)
        {
            return Err(bad(format!("target id {id} out of range for vocabulary {v}")));
        }
        Ok(n)
    }
}

/// Splits `buf` into consecutive mutable pieces of `lens`.
fn split_mut<'a>(mut buf: &'a mut [f32], lens: &[usize]) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(lens.len());
    for &l in lens {
        let (a, b) = buf.split_at_mut(l);
        out.push(a);
        buf = b;
    }
    out
}

impl NativeUnits for Gpt {
    fn forward(
        &self,
        unit: usize,
        params: &[&[f32]],
        x: &[f32],
        batch: &NativeBatch,
        cache: &mut UnitCache,
    ) -> EngineResult<()> {
        let n = self.check(unit, params, x, batch)?;
        let GptConfig {
            vocab: v,
            d_model: d,
            layers,
            heads: h,
            ..
        } = self.config();
        let t = batch.t;
        if unit == 0 {
            let out = sized(&mut cache.out, n * d);
            for (i, (row, &id)) in out.chunks_exact_mut(d).zip(&batch.inputs).enumerate() {
                let tok = &params[0][id as usize * d..][..d];
                let pos = &params[1][(i % t) * d..][..d];
                for ((o, a), b) in row.iter_mut().zip(tok).zip(pos) {
                    *o = a + b;
                }
            }
            return Ok(());
        }
        if unit == layers + 1 {
            cache.saved.resize_with(4, Vec::new);
            let [hf, mean, rstd, probs] = &mut cache.saved[..] else {
                unreachable!("resized to 4 above")
            };
            let (hf, mean, rstd) = (sized(hf, n * d), sized(mean, n), sized(rstd, n));
            ops::layer_norm_fwd(x, params[0], params[1], EPS, hf, mean, rstd);
            let probs = sized(probs, n * v);
            gemm::linear(n, d, v, hf, params[2], None, None, probs);
            let mut total = 0f64;
            ops::softmax_xent(probs, v, &batch.targets, &mut total);
            let out = sized(&mut cache.out, 1);
            out[0] = (total / n as f64) as f32;
            return Ok(());
        }
        let p = params;
        let (f, hd) = (4 * d, d / h);
        cache.saved.resize_with(BLOCK_SAVED, Vec::new);
        let [mean1, rstd1, h1, qkv, probs, att, x2, mean2, rstd2, h2, u, g] = &mut cache.saved[..] else {
            unreachable!("resized to BLOCK_SAVED above")
        };
        let (mean1, rstd1, h1) = (sized(mean1, n), sized(rstd1, n), sized(h1, n * d));
        ops::layer_norm_fwd(x, p[0], p[1], EPS, h1, mean1, rstd1);
        let qkv = sized(qkv, n * 3 * d);
        gemm::linear(n, d, 3 * d, h1, p[2], Some(p[3]), None, qkv);
        let probs = sized(probs, batch.b * h * t * t);
        let att = sized(att, n * d);
        attention_fwd(batch.b, t, h, d, 1.0 / (hd as f32).sqrt(), qkv, probs, att);
        let x2 = sized(x2, n * d);
        gemm::linear(n, d, d, att, p[4], Some(p[5]), Some(x), x2);
        let (mean2, rstd2, h2) = (sized(mean2, n), sized(rstd2, n), sized(h2, n * d));
        ops::layer_norm_fwd(x2, p[6], p[7], EPS, h2, mean2, rstd2);
        let u = sized(u, n * f);
        gemm::linear(n, d, f, h2, p[8], Some(p[9]), None, u);
        let g = sized(g, n * f);
        // `u` becomes gelu'(u), all the backward needs of it.
        ops::gelu_fwd(u, g);
        let out = sized(&mut cache.out, n * d);
        gemm::linear(n, f, d, g, p[10], Some(p[11]), Some(x2), out);
        Ok(())
    }

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
    ) -> EngineResult<()> {
        let n = self.check(unit, params, x, batch)?;
        let GptConfig {
            vocab: v,
            d_model: d,
            layers,
            heads: h,
            ..
        } = self.config();
        let lens = self.param_lens(unit);
        let total: usize = lens.iter().sum();
        if grads.len() < total {
            return Err(bad(format!("unit {unit}: gradient buffer of {} elements, need {total}", grads.len())));
        }
        let mut g = split_mut(&mut grads[..total], &lens);
        let t = batch.t;
        if unit == 0 {
            if dy.len() != n * d {
                return Err(bad(format!("unit 0: output gradient of {} elements, expected {}", dy.len(), n * d)));
            }
            let [g_tok, g_pos] = &mut g[..] else {
                unreachable!("two parameters")
            };
            if !acc {
                g_tok.fill(0.0);
                g_pos.fill(0.0);
            }
            for (i, (row, &id)) in dy.chunks_exact(d).zip(&batch.inputs).enumerate() {
                for (a, b) in g_tok[id as usize * d..][..d].iter_mut().zip(row) {
                    *a += b;
                }
                for (a, b) in g_pos[(i % t) * d..][..d].iter_mut().zip(row) {
                    *a += b;
                }
            }
            dx.clear();
            return Ok(());
        }
        scratch.bufs.resize_with(SCRATCH, Vec::new);
        if unit == layers + 1 {
            let &[dl] = dy else {
                return Err(bad(format!("loss gradient of {} elements, expected 1", dy.len())));
            };
            let [hf, mean, rstd, probs] = &cache.saved[..] else {
                return Err(bad("head backward before its forward".into()));
            };
            let [g_lnw, g_lnb, g_head] = &mut g[..] else {
                unreachable!("three parameters")
            };
            let [s_dg, s_dh, ..] = &mut scratch.bufs[..] else {
                unreachable!("resized to SCRATCH above")
            };
            // dlogits = (softmax − onehot) · dl / n, built in place of the probabilities' copy.
            let dlog = sized(s_dg, n * v);
            dlog.copy_from_slice(probs);
            let s = dl / n as f32;
            for (row, &tg) in dlog.chunks_exact_mut(v).zip(&batch.targets) {
                row[tg as usize] -= 1.0;
                for e in row.iter_mut() {
                    *e *= s;
                }
            }
            if !acc {
                g_lnw.fill(0.0);
                g_lnb.fill(0.0);
            }
            gemm::dyt_x(n, d, v, dlog, hf, g_head, acc);
            let dh = sized(s_dh, n * d);
            gemm::dy_w(n, d, v, dlog, params[2], dh, false);
            let dx = sized(dx, n * d);
            ops::layer_norm_bwd(dh, x, params[0], mean, rstd, &[], dx, g_lnw, g_lnb);
            return Ok(());
        }
        if dy.len() != n * d {
            return Err(bad(format!("unit {unit}: output gradient of {} elements, expected {}", dy.len(), n * d)));
        }
        let p = params;
        let (f, hd) = (4 * d, d / h);
        let [mean1, rstd1, h1, qkv, probs, att, x2, mean2, rstd2, h2, u, gl] = &cache.saved[..] else {
            return Err(bad(format!("unit {unit}: backward before its forward")));
        };
        let [g_ln1w, g_ln1b, g_wqkv, g_bqkv, g_wproj, g_bproj, g_ln2w, g_ln2b, g_wfc, g_bfc, g_wout, g_bout] =
            &mut g[..]
        else {
            unreachable!("twelve parameters")
        };
        let [s_dg, s_dh, s_dx2, s_datt, s_dqkv, s_dp] = &mut scratch.bufs[..] else {
            unreachable!("resized to SCRATCH above")
        };
        if !acc {
            // The weight gradients are overwritten by their products; the small ones the
            // element-wise kernels accumulate into start from zero.
            for b in [&mut *g_ln1w, g_ln1b, g_bqkv, g_bproj, g_ln2w, g_ln2b, g_bfc, g_bout] {
                b.fill(0.0);
            }
        }
        // MLP.
        gemm::dyt_x(n, f, d, dy, gl, g_wout, acc);
        ops::colsum(dy, g_bout);
        let dg = sized(s_dg, n * f);
        gemm::dy_w(n, f, d, dy, p[10], dg, false);
        ops::gelu_bwd_colsum(dg, u, g_bfc);
        gemm::dyt_x(n, d, f, dg, h2, g_wfc, acc);
        let dh = sized(s_dh, n * d);
        gemm::dy_w(n, d, f, dg, p[8], dh, false);
        let dx2 = sized(s_dx2, n * d);
        ops::layer_norm_bwd(dh, x2, p[6], mean2, rstd2, dy, dx2, g_ln2w, g_ln2b);
        // Attention.
        gemm::dyt_x(n, d, d, dx2, att, g_wproj, acc);
        ops::colsum(dx2, g_bproj);
        let datt = sized(s_datt, n * d);
        gemm::dy_w(n, d, d, dx2, p[4], datt, false);
        let dqkv = sized(s_dqkv, n * 3 * d);
        let dp = sized(s_dp, t * t);
        attention_bwd(batch.b, t, h, d, 1.0 / (hd as f32).sqrt(), qkv, probs, datt, dqkv, dp);
        gemm::dyt_x(n, d, 3 * d, dqkv, h1, g_wqkv, acc);
        ops::colsum(dqkv, g_bqkv);
        gemm::dy_w(n, d, 3 * d, dqkv, p[2], dh, false);
        let dx = sized(dx, n * d);
        ops::layer_norm_bwd(dh, x, p[0], mean1, rstd1, dx2, dx, g_ln1w, g_ln1b);
        Ok(())
    }
}

/// Causal attention of a packed `qkv [b·t, 3d]` into `y [b·t, d]`, keeping the probabilities
/// (`[b, h, t, t]`) for the backward.
#[allow(clippy::too_many_arguments)]
fn attention_fwd(b: usize, t: usize, h: usize, d: usize, scale: f32, qkv: &[f32], probs: &mut [f32], y: &mut [f32]) {
    let hd = d / h;
    for bi in 0..b {
        for hi in 0..h {
            let base = bi * t * 3 * d + hi * hd;
            let p = &mut probs[(bi * h + hi) * t * t..][..t * t];
            // SAFETY (both products): q, k, v are t×hd blocks of `qkv` (row stride 3d), `p` is
            // t×t, the output block is t×hd of `y` (row stride d); all in bounds (b·t rows),
            // destinations distinct from sources.
            unsafe {
                gemm::gemm(
                    (t, t, hd),
                    p.as_mut_ptr(),
                    t,
                    false,
                    gemm::Mat { ptr: qkv.as_ptr().add(base), rs: 3 * d, cs: 1 },
                    gemm::Mat { ptr: qkv.as_ptr().add(base + d), rs: 1, cs: 3 * d },
                    Shape::LowerOut,
                );
            }
            ops::causal_softmax(p, t, 0, scale);
            unsafe {
                gemm::gemm(
                    (t, hd, t),
                    y.as_mut_ptr().add(bi * t * d + hi * hd),
                    d,
                    false,
                    gemm::Mat { ptr: p.as_ptr(), rs: t, cs: 1 },
                    gemm::Mat { ptr: qkv.as_ptr().add(base + 2 * d), rs: 3 * d, cs: 1 },
                    Shape::LowerLhs,
                );
            }
        }
    }
}

/// Gradient of [`attention_fwd`]: `dqkv` from `dy [b·t, d]` and the kept probabilities.
#[allow(clippy::too_many_arguments)]
fn attention_bwd(
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    scale: f32,
    qkv: &[f32],
    probs: &[f32],
    dy: &[f32],
    dqkv: &mut [f32],
    dp: &mut [f32],
) {
    let hd = d / h;
    for bi in 0..b {
        for hi in 0..h {
            let base = bi * t * 3 * d + hi * hd;
            let (q, k, v) = (base, base + d, base + 2 * d);
            let dyo = bi * t * d + hi * hd;
            let p = &probs[(bi * h + hi) * t * t..][..t * t];
            // SAFETY (all products): every block is in bounds of its buffer under its strides
            // (b·t rows); destinations (dp, dqkv) never overlap sources (qkv, probs, dy, dp).
            unsafe {
                // dP = dY · Vᵀ
                gemm::gemm(
                    (t, t, hd),
                    dp.as_mut_ptr(),
                    t,
                    false,
                    gemm::Mat { ptr: dy.as_ptr().add(dyo), rs: d, cs: 1 },
                    gemm::Mat { ptr: qkv.as_ptr().add(v), rs: 1, cs: 3 * d },
                    Shape::LowerOut,
                );
                // dV = Pᵀ · dY
                gemm::gemm(
                    (t, hd, t),
                    dqkv.as_mut_ptr().add(v),
                    3 * d,
                    false,
                    gemm::Mat { ptr: p.as_ptr(), rs: 1, cs: t },
                    gemm::Mat { ptr: dy.as_ptr().add(dyo), rs: d, cs: 1 },
                    Shape::UpperLhs,
                );
            }
            ops::causal_softmax_bwd(dp, p, t, 0, scale);
            unsafe {
                // dQ = dS · K
                gemm::gemm(
                    (t, hd, t),
                    dqkv.as_mut_ptr().add(q),
                    3 * d,
                    false,
                    gemm::Mat { ptr: dp.as_ptr(), rs: t, cs: 1 },
                    gemm::Mat { ptr: qkv.as_ptr().add(k), rs: 3 * d, cs: 1 },
                    Shape::LowerLhs,
                );
                // dK = dSᵀ · Q
                gemm::gemm(
                    (t, hd, t),
                    dqkv.as_mut_ptr().add(k),
                    3 * d,
                    false,
                    gemm::Mat { ptr: dp.as_ptr(), rs: 1, cs: t },
                    gemm::Mat { ptr: qkv.as_ptr().add(q), rs: 3 * d, cs: 1 },
                    Shape::UpperLhs,
                );
            }
        }
    }
}
