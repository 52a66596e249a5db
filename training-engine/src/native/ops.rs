//! Element-wise and row-wise f32 kernels of the native path, compiled for the process's SIMD
//! level ([`simd_fn`]). Rows are contiguous and row-major. Reductions keep 16 independent
//! partial sums so the loops vectorize; results are deterministic for a given SIMD level.

use super::isa::{fmadd, simd_fn};

/// Lanes of the partial sums in reductions (one AVX-512 register, two AVX2 ones).
const L: usize = 16;

#[inline(always)]
fn sum<const F: bool>(x: &[f32]) -> f32 {
    let mut acc = [0f32; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for i in 0..L {
            acc[i] += c[i];
        }
    }
    let mut s = hsum(&acc);
    for v in chunks.remainder() {
        s += v;
    }
    s
}

#[inline(always)]
fn dot<const F: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; L];
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut ca = a.chunks_exact(L);
    let mut cb = b.chunks_exact(L);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..L {
            acc[i] = fmadd::<F>(x[i], y[i], acc[i]);
        }
    }
    let mut s = hsum(&acc);
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s = fmadd::<F>(*x, *y, s);
    }
    s
}

#[inline(always)]
fn hsum(acc: &[f32; L]) -> f32 {
    // Pairwise, in a fixed order.
    let mut v = *acc;
    let mut w = L / 2;
    while w > 0 {
        for i in 0..w {
            v[i] += v[i + w];
        }
        w /= 2;
    }
    v[0]
}

#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for i in 0..L {
            acc[i] = acc[i].max(c[i]);
        }
    }
    let mut m = acc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in chunks.remainder() {
        m = m.max(*v);
    }
    m
}

/// `e^x` for `x ≤ 88` (Cephes polynomial, ~1 ulp), branch-free so loops over it vectorize;
/// inputs below −87 give ≈ 1.6e−38 instead of denormals.
#[allow(clippy::excessive_precision)] // coefficients as published
#[inline(always)]
pub(crate) fn exp<const F: bool>(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    const MAGIC: f32 = 12_582_912.0; // 1.5·2²³: round to nearest, n in the low mantissa bits
    let y = fmadd::<F>(x, std::f32::consts::LOG2_E, MAGIC);
    let n = y - MAGIC;
    let r = fmadd::<F>(n, 2.121_944_4e-4, fmadd::<F>(n, -0.693_359_4, x));
    let mut p = 1.987_569_1e-4f32;
    p = fmadd::<F>(p, r, 1.398_199_9e-3);
    p = fmadd::<F>(p, r, 8.333_452e-3);
    p = fmadd::<F>(p, r, 4.166_579_6e-2);
    p = fmadd::<F>(p, r, 1.666_666_5e-1);
    p = fmadd::<F>(p, r, 5.000_000_1e-1);
    let e = fmadd::<F>(p * r, r, r) + 1.0;
    let pow2 = f32::from_bits(y.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23);
    e * pow2
}

/// `erf(x)` through Numerical Recipes' Chebyshev `erfc` (relative error < 1.2e−7).
#[allow(clippy::excessive_precision)] // coefficients as published
#[inline(always)]
pub(crate) fn erf<const F: bool>(x: f32) -> f32 {
    let z = x.abs();
    let t = 1.0 / fmadd::<F>(0.5, z, 1.0);
    let mut p = 0.170_872_77f32;
    p = fmadd::<F>(p, t, -0.822_152_23);
    p = fmadd::<F>(p, t, 1.488_515_87);
    p = fmadd::<F>(p, t, -1.135_203_98);
    p = fmadd::<F>(p, t, 0.278_868_07);
    p = fmadd::<F>(p, t, -0.186_288_06);
    p = fmadd::<F>(p, t, 0.096_784_18);
    p = fmadd::<F>(p, t, 0.374_091_96);
    p = fmadd::<F>(p, t, 1.000_023_68);
    p = fmadd::<F>(p, t, -1.265_512_23);
    let erfc = t * exp::<F>(fmadd::<F>(-z, z, p));
    (1.0 - erfc).copysign(x)
}

/// The standard normal distribution function `Φ(x)` and density `φ(x)` together, sharing
/// one exponential: erf by Abramowitz & Stegun 7.1.26 (absolute error ≤ 1.5e−7), whose factor
/// `e^{−z²}` at `z = |x|/√2` is the density's `e^{−x²/2}`. Negative `x` get `Φ = erfc/2`
/// directly, without the cancellation of `1 − erf`.
#[allow(clippy::excessive_precision)] // coefficients as published
#[inline(always)]
pub(crate) fn normal_cdf_pdf<const F: bool>(x: f32) -> (f32, f32) {
    let e = exp::<F>(-0.5 * x * x);
    let t = 1.0 / fmadd::<F>(0.327_591_1 * FRAC_1_SQRT_2, x.abs(), 1.0);
    let mut p = 1.061_405_429f32;
    p = fmadd::<F>(p, t, -1.453_152_027);
    p = fmadd::<F>(p, t, 1.421_413_741);
    p = fmadd::<F>(p, t, -0.284_496_736);
    p = fmadd::<F>(p, t, 0.254_829_592);
    // Φ(−|x|) = erfc(|x|/√2) / 2.
    let tail = 0.5 * p * t * e;
    let cdf = if x < 0.0 { tail } else { 1.0 - tail };
    (cdf, FRAC_1_SQRT_2PI * e)
}

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const FRAC_1_SQRT_2PI: f32 = 0.398_942_3;

simd_fn! {
    /// LayerNorm of rows of `w.len()`: `y = (x − mean)·rstd·w + b` (biased variance, as
    /// PyTorch), keeping `mean` and `rstd = 1/√(var + eps)` per row for the backward.
    pub(crate) fn layer_norm_fwd(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let d = w.len();
        let inv_d = 1.0 / d as f32;
        for (((xr, yr), m), rs) in x
            .chunks_exact(d)
            .zip(y.chunks_exact_mut(d))
            .zip(mean.iter_mut())
            .zip(rstd.iter_mut())
        {
            let mu = sum::<FMA>(xr) * inv_d;
            let mut acc = [0f32; L];
            let mut chunks = xr.chunks_exact(L);
            for c in &mut chunks {
                for i in 0..L {
                    let v = c[i] - mu;
                    acc[i] = fmadd::<FMA>(v, v, acc[i]);
                }
            }
            let mut var = hsum(&acc);
            for v in chunks.remainder() {
                var = fmadd::<FMA>(v - mu, v - mu, var);
            }
            let r = 1.0 / (var * inv_d + eps).sqrt();
            *m = mu;
            *rs = r;
            for i in 0..d {
                yr[i] = fmadd::<FMA>((xr[i] - mu) * r, w[i], b[i]);
            }
        }
    }
}

simd_fn! {
    /// LayerNorm backward, added to a residual gradient: `dx = resid + ∂LN/∂x · dh` (`resid`
    /// empty: no residual); `dw += Σ_rows dh ⊙ x̂`, `db += Σ_rows dh`.
    pub(crate) fn layer_norm_bwd(
        dh: &[f32],
        x: &[f32],
        w: &[f32],
        mean: &[f32],
        rstd: &[f32],
        resid: &[f32],
        dx: &mut [f32],
        dw: &mut [f32],
        db: &mut [f32],
    ) {
        let d = w.len();
        let inv_d = 1.0 / d as f32;
        let (w, dw, db) = (&w[..d], &mut dw[..d], &mut db[..d]);
        for (r, ((dhr, xr), dxr)) in dh
            .chunks_exact(d)
            .zip(x.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
            .enumerate()
        {
            let (mu, rs) = (mean[r], rstd[r]);
            let mut ag = [0f32; L];
            let mut agx = [0f32; L];
            let full = d / L * L;
            for ((dhc, xc), (wc, (dwc, dbc))) in dhr[..full]
                .chunks_exact(L)
                .zip(xr[..full].chunks_exact(L))
                .zip(w[..full].chunks_exact(L).zip(dw[..full].chunks_exact_mut(L).zip(db[..full].chunks_exact_mut(L))))
            {
                for i in 0..L {
                    let xh = (xc[i] - mu) * rs;
                    let g = dhc[i] * wc[i];
                    ag[i] += g;
                    agx[i] = fmadd::<FMA>(g, xh, agx[i]);
                    dwc[i] = fmadd::<FMA>(dhc[i], xh, dwc[i]);
                    dbc[i] += dhc[i];
                }
            }
            let (mut sg, mut sgx) = (hsum(&ag), hsum(&agx));
            for j in full..d {
                let xh = (xr[j] - mu) * rs;
                let g = dhr[j] * w[j];
                sg += g;
                sgx = fmadd::<FMA>(g, xh, sgx);
                dw[j] = fmadd::<FMA>(dhr[j], xh, dw[j]);
                db[j] += dhr[j];
            }
            let (mg, mgx) = (sg * inv_d, sgx * inv_d);
            if resid.is_empty() {
                for j in 0..d {
                    let xh = (xr[j] - mu) * rs;
                    dxr[j] = rs * (dhr[j] * w[j] - fmadd::<FMA>(xh, mgx, mg));
                }
            } else {
                let rr = &resid[r * d..][..d];
                for j in 0..d {
                    let xh = (xr[j] - mu) * rs;
                    dxr[j] = fmadd::<FMA>(rs, dhr[j] * w[j] - fmadd::<FMA>(xh, mgx, mg), rr[j]);
                }
            }
        }
    }
}

simd_fn! {
    /// Exact (erf) GELU, `g = u·Φ(u)`, and its derivative `gelu'(u) = Φ(u) + u·φ(u)`, which
    /// replaces `u` in place (the backward needs only the derivative).
    pub(crate) fn gelu_fwd(u: &mut [f32], g: &mut [f32]) {
        for (v, o) in u.iter_mut().zip(g.iter_mut()) {
            let x = *v;
            let (cdf, pdf) = normal_cdf_pdf::<FMA>(x);
            *o = x * cdf;
            *v = fmadd::<FMA>(x, pdf, cdf);
        }
    }
}

simd_fn! {
    /// GELU backward in place from the saved derivative, `dg ← dg · gelu'(u)`, and the bias
    /// gradient of the layer that produced `u`: `db += Σ_rows dg` (rows of `db.len()`).
    pub(crate) fn gelu_bwd_colsum(dg: &mut [f32], dgelu: &[f32], db: &mut [f32]) {
        let o = db.len();
        for (dr, ur) in dg.chunks_exact_mut(o).zip(dgelu.chunks_exact(o)) {
            for j in 0..o {
                let du = dr[j] * ur[j];
                dr[j] = du;
                db[j] += du;
            }
        }
    }
}

simd_fn! {
    /// `db += Σ_rows dy` (rows of `db.len()`).
    pub(crate) fn colsum(dy: &[f32], db: &mut [f32]) {
        let o = db.len();
        for r in dy.chunks_exact(o) {
            for j in 0..o {
                db[j] += r[j];
            }
        }
    }
}

simd_fn! {
    /// Causal softmax of scaled scores in place: row `i` of the `t×t` block `s` (rows
    /// `row0 + i` of the full matrix) becomes `softmax(scale · s[i, 0..=row0+i])`, zero after.
    pub(crate) fn causal_softmax(s: &mut [f32], t: usize, row0: usize, scale: f32) {
        for (i, row) in s.chunks_exact_mut(t).enumerate() {
            let valid = (row0 + i + 1).min(t);
            let m = max_of(&row[..valid]) * scale;
            let mut acc = [0f32; L];
            let (head, tail) = row[..valid].split_at_mut(valid / L * L);
            for c in head.chunks_exact_mut(L) {
                for k in 0..L {
                    let e = exp::<FMA>(fmadd::<FMA>(c[k], scale, -m));
                    c[k] = e;
                    acc[k] += e;
                }
            }
            let mut total = hsum(&acc);
            for v in tail.iter_mut() {
                *v = exp::<FMA>(fmadd::<FMA>(*v, scale, -m));
                total += *v;
            }
            let inv = 1.0 / total;
            for v in &mut row[..valid] {
                *v *= inv;
            }
            row[valid..].fill(0.0);
        }
    }
}

simd_fn! {
    /// Softmax backward of a causal block in place: `dp ← scale · p ⊙ (dp − Σ_j dp_j p_j)` on
    /// the valid prefix of each row (as [`causal_softmax`]), zero after.
    pub(crate) fn causal_softmax_bwd(dp: &mut [f32], p: &[f32], t: usize, row0: usize, scale: f32) {
        for (i, (gr, pr)) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
            let valid = (row0 + i + 1).min(t);
            let dotv = dot::<FMA>(&pr[..valid], &gr[..valid]);
            for j in 0..valid {
                gr[j] = scale * (pr[j] * (gr[j] - dotv));
            }
            gr[valid..].fill(0.0);
        }
    }
}

simd_fn! {
    /// Mean cross-entropy over rows of `logits` (rows of `v`), turning the logits into the
    /// softmax probabilities in place. Returns the sum (not the mean) of `−log p[target]`.
    pub(crate) fn softmax_xent(logits: &mut [f32], v: usize, targets: &[u32], out: &mut f64) {
        let mut total = 0f64;
        for (row, &tg) in logits.chunks_exact_mut(v).zip(targets) {
            let m = max_of(row);
            // The target's logit against the max, before the row becomes probabilities: the loss
            // is `ln s − (x_t − m)`, exact however far below the max the target is (through
            // `exp`, which floors its argument at −87, it stopped at 87).
            let xt = row[tg as usize] - m;
            let mut acc = [0f32; L];
            let (head, tail) = row.split_at_mut(v / L * L);
            for c in head.chunks_exact_mut(L) {
                for k in 0..L {
                    let e = exp::<FMA>(c[k] - m);
                    acc[k] += e;
                    c[k] = e;
                }
            }
            let mut s = hsum(&acc);
            for x in tail.iter_mut() {
                *x = exp::<FMA>(*x - m);
                s += *x;
            }
            let inv = 1.0 / s;
            // A NaN or infinite logit makes the loss NaN, as the reference's does (a NaN in the
            // row makes `s` NaN; an infinite max makes `x_t − m` NaN): a finite loss would hide
            // the divergence from the engine's check while NaN gradients reach the weights.
            total += f64::from(s).ln() - f64::from(xt);
            for x in row.iter_mut() {
                *x *= inv;
            }
        }
        *out = total;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_infinite_logit_gives_a_nan_loss() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            // Two rows of 19 (a vector body and a tail): the bad value in row 1, target elsewhere.
            let mut logits: Vec<f32> = (0..38).map(|i| (i % 7) as f32 * 0.1).collect();
            logits[19 + 5] = bad;
            let mut out = 0f64;
            softmax_xent(&mut logits, 19, &[3, 2], &mut out);
            if bad == f32::NEG_INFINITY {
                // exp(-inf) is 0: a finite row, as in the reference.
                assert!(out.is_finite(), "{bad}: {out}");
            } else {
                assert!(out.is_nan(), "{bad}: {out}");
            }
        }
        let mut logits = vec![0f32; 19];
        let mut out = 0f64;
        softmax_xent(&mut logits, 19, &[0], &mut out);
        assert!((out - (19f64).ln()).abs() < 1e-5, "{out}");
        // A target far below the max: its loss is the gap (it stopped at 87, where `exp` floors
        // its argument), as the reference's log-softmax gives; the probabilities stay exact.
        for gap in [50f32, 100.0, 200.0, 1000.0] {
            let mut logits = vec![0f32; 19];
            logits[7] = gap;
            let mut out = 0f64;
            softmax_xent(&mut logits, 19, &[0], &mut out);
            let want = f64::from(gap) + (1.0 + 18.0 * (-f64::from(gap)).exp()).ln();
            assert!((out - want).abs() < 1e-3 * want, "gap {gap}: {out}, want {want}");
            assert!((logits[7] - 1.0).abs() < 1e-6 && logits[0] >= 0.0, "{logits:?}");
        }
    }

    #[test]
    fn exp_and_the_normal_distribution_are_accurate_at_every_level() {
        let mut worst = (0f64, 0f64, 0f64, 0f64);
        for i in -80_000..=80_000 {
            let x = i as f32 * 1e-4;
            let e = f64::from(x * 10.0).exp();
            worst.0 = worst.0.max(((f64::from(exp::<true>(x * 10.0)) - e) / e).abs());
            worst.0 = worst.0.max(((f64::from(exp::<false>(x * 10.0)) - e) / e).abs());
            let r = libm_erf(f64::from(x));
            worst.3 = worst.3.max((f64::from(erf::<true>(x)) - r).abs());
            worst.3 = worst.3.max((f64::from(erf::<false>(x)) - r).abs());
            let xd = f64::from(x);
            let cdf = 0.5 * (1.0 + libm_erf(xd * std::f64::consts::FRAC_1_SQRT_2));
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            for (c, p) in [normal_cdf_pdf::<true>(x), normal_cdf_pdf::<false>(x)] {
                worst.1 = worst.1.max((f64::from(c) - cdf).abs());
                worst.2 = worst.2.max((f64::from(p) - pdf).abs());
            }
        }
        assert!(worst.0 < 5e-7, "exp rel error {}", worst.0);
        // A & S bound 1.5e−7 on erf, halved in Φ, plus f32 rounding of the terms.
        assert!(worst.1 < 4e-7, "normal cdf abs error {}", worst.1);
        assert!(worst.2 < 2e-7, "normal pdf abs error {}", worst.2);
        assert!(worst.3 < 5e-7, "erf abs error {}", worst.3);
    }

    /// erf by its Taylor series (|x| ≤ 3) or asymptotic erfc (|x| > 3), in f64.
    fn libm_erf(x: f64) -> f64 {
        let z = x.abs();
        if z > 3.0 {
            let z2 = z * z;
            let s = 1.0 - 1.0 / (2.0 * z2) + 3.0 / (4.0 * z2 * z2) - 15.0 / (8.0 * z2.powi(3));
            return (1.0 - (-z2).exp() / (z * std::f64::consts::PI.sqrt()) * s).copysign(x);
        }
        let (mut term, mut acc) = (x, x);
        for n in 1..200 {
            term *= -x * x / n as f64;
            acc += term / (2 * n + 1) as f64;
        }
        acc * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn reductions_handle_every_tail_length() {
        for n in [0usize, 1, 15, 16, 17, 33, 100] {
            let x: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let want: f32 = x.iter().sum();
            assert!((sum::<true>(&x) - want).abs() < 1e-4, "n={n}");
            let d: f32 = x.iter().map(|v| v * v).sum();
            assert!((dot::<false>(&x, &x) - d).abs() < 1e-3 * d.max(1.0), "n={n}");
            let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_of(&x), m, "n={n}");
        }
    }

    #[test]
    fn causal_softmax_rows_sum_to_one_and_mask() {
        let t = 19;
        let mut s: Vec<f32> = (0..t * t).map(|i| ((i * 7) % 11) as f32 * 0.3).collect();
        causal_softmax(&mut s, t, 0, 0.5);
        for (i, row) in s.chunks_exact(t).enumerate() {
            let total: f32 = row.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "row {i}: {total}");
            assert!(row[i + 1..].iter().all(|v| *v == 0.0));
        }
    }
}
