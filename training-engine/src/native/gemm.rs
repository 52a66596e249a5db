//! Single-threaded f32 matrix products for the native path, with microkernels for AVX-512
//! (6×64 tile), AVX2+FMA (6×16) and baseline x86-64, chosen at run time ([`super::isa`]).
//!
//! The structure is BLIS's: for each `KC`-deep slab, a block of the right operand is packed
//! into `NR`-column micro-panels (k-major, zero-padded), for each `MC`-row block of the left
//! operand it is packed into `MR`-row micro-panels, and the microkernel keeps an `MR×NR` tile
//! of the result in registers over the whole slab: one broadcast of a left element feeds
//! `NR/lanes` fused multiply-adds. Packing reads any strides, so transposed operands (`x·wᵀ`,
//! `dyᵀ·x`) cost nothing extra. Destinations are row-major (unit column stride).
//!
//! Also here: the three products of a linear layer `y = x·wᵀ` (`x` is `n×k`, `w` is `o×k`,
//! row-major) and the causal variants that attention uses, which skip the tiles above the
//! diagonal.

use std::cell::RefCell;

use super::isa::{Isa, isa};
use super::profile::Layout;

/// A matrix operand: base pointer and strides in elements (`rs` between rows, `cs` between
/// columns).
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub(crate) ptr: *const f32,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl Mat {
    /// The transpose (same memory, strides swapped).
    fn t(self) -> Mat {
        Mat {
            ptr: self.ptr,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// Which part of the product is needed: all of it, or only what a causal (lower-triangular)
/// pattern uses.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Shape {
    /// The whole product.
    Full,
    /// Only `dst[i][j]` with `j ≤ i` is needed (scores `q·kᵀ` of a causal attention); entries
    /// above the diagonal are left unspecified.
    LowerOut,
    /// The left operand is lower-triangular (`lhs[i][p] = 0` for `p > i`: causal
    /// probabilities times values), so row `i` only sums over `p ≤ i`.
    LowerLhs,
    /// The left operand is upper-triangular (`lhs[i][p] = 0` for `p < i`: the transpose of
    /// causal probabilities), so row `i` only sums over `p ≥ i`.
    UpperLhs,
}

/// What a fresh product starts from instead of zero: `dst[i][j] = bias[j] + res[i][j] +
/// (lhs·rhs)[i][j]`, either part absent when null. The kernels add it to a tile while the tile
/// is still in registers, so a linear layer's bias and residual cost no pass of their own over
/// the output (and no read of a cold destination).
#[derive(Clone, Copy)]
pub(crate) struct Init {
    /// `n` floats, one per column; or null.
    bias: *const f32,
    /// An `m×n` matrix with row stride `res_rs`; or null.
    res: *const f32,
    res_rs: usize,
}

impl Init {
    /// Start from zero.
    const NONE: Init = Init {
        bias: std::ptr::null(),
        res: std::ptr::null(),
        res_rs: 0,
    };

    /// The same start for the tile whose first element is `[row][col]`.
    fn at(self, row: usize, col: usize) -> Init {
        Init {
            bias: if self.bias.is_null() { self.bias } else { self.bias.wrapping_add(col) },
            res: if self.res.is_null() { self.res } else { self.res.wrapping_add(row * self.res_rs + col) },
            res_rs: self.res_rs,
        }
    }

    /// The start of element `[i][j]` of a tile ([`Init::at`] its corner).
    ///
    /// # Safety
    /// The element is inside the product.
    unsafe fn get(self, i: usize, j: usize) -> f32 {
        // SAFETY: inside bias / res by the caller's contract.
        unsafe {
            let b = if self.bias.is_null() { 0.0 } else { *self.bias.add(j) };
            let r = if self.res.is_null() { 0.0 } else { *self.res.add(i * self.res_rs + j) };
            b + r
        }
    }
}

/// Cache blocking of one SIMD level (the tile shape `MR×NR` is a const parameter of the
/// instantiation, see [`gemm_at`]).
#[derive(Clone, Copy)]
struct Blocking {
    kc: usize,
    mc: usize,
    nc: usize,
}

/// 64-byte aligned storage for packed panels.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

#[derive(Default)]
struct Packs {
    a: Vec<Line>,
    b: Vec<Line>,
}

fn lines(buf: &mut Vec<Line>, floats: usize) -> *mut f32 {
    let n = floats.div_ceil(16);
    if buf.len() < n {
        buf.resize(n, Line([0.0; 16]));
    }
    buf.as_mut_ptr().cast::<f32>()
}

thread_local! {
    static PACKS: RefCell<Packs> = RefCell::new(Packs::default());
}

/// `dst (m×n) = [dst +] lhs (m×k) · rhs (k×n)` at the process's SIMD level.
///
/// # Safety
/// Every operand addresses its whole matrix under its strides (for the triangular shapes,
/// at least the part the shape reads); `dst` has unit column stride and does not overlap
/// `lhs` or `rhs`.
pub(crate) unsafe fn gemm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    acc: bool,
    lhs: Mat,
    rhs: Mat,
    shape: Shape,
) {
    // SAFETY: forwarded.
    unsafe { gemm_at(isa(), (m, n, k), dst, dst_rs, acc, lhs, rhs, shape) }
}

/// [`gemm`] at a given SIMD level (which the CPU must support).
///
/// # Safety
/// As [`gemm`]; `level` is supported by the CPU.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_at(
    level: Isa,
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    acc: bool,
    lhs: Mat,
    rhs: Mat,
    shape: Shape,
) {
    // SAFETY: forwarded.
    unsafe { gemm_from(level, (m, n, k, dst, dst_rs, acc, lhs, rhs, shape, Init::NONE)) }
}

/// [`gemm_at`] where a fresh product (`acc` false) starts from `init` instead of zero.
///
/// # Safety
/// As [`gemm_at`]; `init` addresses `n` bias floats and an `m×n` residual where present, and is
/// [`Init::NONE`] unless the shape is [`Shape::Full`].
unsafe fn gemm_from(level: Isa, args: Args) {
    if !super::profile::enabled() {
        // SAFETY: forwarded.
        return unsafe { gemm_run(level, args) };
    }
    let start = std::time::Instant::now();
    // SAFETY: forwarded.
    unsafe { gemm_run(level, args) };
    let (m, n, k, _, _, _, lhs, rhs, shape, _) = args;
    let pattern = match shape {
        Shape::Full => "full",
        Shape::LowerOut => "lower-out",
        Shape::LowerLhs => "lower-lhs",
        Shape::UpperLhs => "upper-lhs",
    };
    super::profile::record((m, n, k), pattern, Layout::of(lhs.rs, lhs.cs), Layout::of(rhs.rs, rhs.cs), start.elapsed());
}

/// [`gemm_from`] without the profile.
///
/// # Safety
/// As [`gemm_from`].
unsafe fn gemm_run(level: Isa, args: Args) {
    let (m, n, k, dst, dst_rs, acc, _, _, shape, init) = args;
    debug_assert!(shape == Shape::Full || (init.bias.is_null() && init.res.is_null()));
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !acc {
            for i in 0..m {
                for j in 0..n {
                    // SAFETY: [i][j] is inside dst, bias and res.
                    unsafe { *dst.add(i * dst_rs + j) = init.get(i, j) };
                }
            }
        }
        return;
    }
    // SAFETY (each arm): forwarded; the caller guarantees the level.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => run_avx512(args),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => run_avx2(args),
            _ => blocked::<4, 8>(Blocking { kc: 256, mc: 64, nc: 512 }, kernel_scalar, args),
        }
    }
    // An upper-triangular left operand with more rows than columns: rows i ≥ k have no
    // contributing slab, and a fresh product must still define them.
    if !acc && shape == Shape::UpperLhs {
        for i in k.min(m)..m {
            // SAFETY: row i of dst is inside dst.
            unsafe { std::ptr::write_bytes(dst.add(i * dst_rs), 0, n) };
        }
    }
}

/// The loop nest and packing compiled for AVX-512 (so panel copies are zmm moves). Blocks of
/// 48 left rows (eight tiles): with huge pages, 1–3 % off the reference step against 96 and
/// 192 (kc 128 and 512 were 7 % and 1–2 % slower than 256).
///
/// # Safety
/// As [`gemm_at`]; the CPU has AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn run_avx512(args: Args) {
    // SAFETY: forwarded.
    unsafe { blocked::<6, 64>(Blocking { kc: 256, mc: 48, nc: 1024 }, kernel_avx512, args) }
}

/// As [`run_avx512`] for AVX2.
///
/// # Safety
/// As [`gemm_at`]; the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(args: Args) {
    // SAFETY: forwarded.
    unsafe { blocked::<6, 16>(Blocking { kc: 256, mc: 96, nc: 1024 }, kernel_avx2, args) }
}

/// `c (MR×NR, row stride rs) = [c +] A·B` over `k`, with `A[r][p]` at `a + r·ar + p·ap`
/// (packed: `ar = 1, ap = MR`; a row-major left operand read in place: `ar = rs, ap = 1`) and
/// `B` a packed `NR`-column micro-panel.
/// A kernel that does not load `c` adds the tile's [`Init`] instead.
type Kernel = unsafe fn(usize, *const f32, usize, usize, *const f32, *mut f32, usize, bool, Init);
type Args = (usize, usize, usize, *mut f32, usize, bool, Mat, Mat, Shape, Init);

/// The BLIS loop nest for an `MR×NR` kernel. A row-major left operand (unit column stride) is
/// read in place, full row panels at a time (its rows are contiguous in k, which is what the
/// kernel's broadcasts walk); only a final partial panel is packed (zero-padded).
///
/// # Safety
/// As [`gemm_at`]; `kernel` runs on this CPU and computes `MR×NR` tiles.
#[inline(always)]
unsafe fn blocked<const MR: usize, const NR: usize>(bl: Blocking, kernel: Kernel, args: Args) {
    let (m, n, k, dst, dst_rs, acc, lhs, rhs, shape, init) = args;
    // Equal slabs of at most `kc` (no short last slab).
    let bl = Blocking {
        kc: k.div_ceil(k.div_ceil(bl.kc)),
        ..bl
    };
    let mut packs = PACKS.with(|p| p.take());
    let apack = lines(&mut packs.a, bl.mc.div_ceil(MR) * MR * bl.kc);
    let bpack = lines(&mut packs.b, bl.nc.div_ceil(NR) * NR * bl.kc);
    let a_direct = lhs.cs == 1;
    let mut tile = [0f32; 6 * 64];
    for jc in (0..n).step_by(bl.nc) {
        let nc = bl.nc.min(n - jc);
        for pc in (0..k).step_by(bl.kc) {
            let kc = bl.kc.min(k - pc);
            // SAFETY: the block is inside rhs; bpack holds nc.div_ceil(NR)·NR·kc floats.
            unsafe { pack::<NR>(rhs.t(), jc, pc, nc, kc, bpack) };
            for ic in (0..m).step_by(bl.mc) {
                let mc = bl.mc.min(m - ic);
                // Causal shapes: skip whole blocks that contribute nothing.
                match shape {
                    Shape::LowerLhs if pc > ic + mc - 1 => continue,
                    Shape::UpperLhs if pc + kc <= ic => continue,
                    Shape::LowerOut if jc > ic + mc - 1 => continue,
                    _ => {}
                }
                // SAFETY: the block (or its partial last panel) is inside lhs; apack holds
                // mc.div_ceil(MR)·MR·kc floats.
                unsafe {
                    if !a_direct {
                        pack::<MR>(lhs, ic, pc, mc, kc, apack);
                    } else if mc % MR != 0 {
                        let tail = mc / MR * MR;
                        pack::<MR>(lhs, ic + tail, pc, mc - tail, kc, apack.add(tail * kc));
                    }
                }
                for jr in (0..nc).step_by(NR) {
                    let nr = NR.min(nc - jr);
                    for ir in (0..mc).step_by(MR) {
                        let mr = MR.min(mc - ir);
                        let (row0, col0) = (ic + ir, jc + jr);
                        let (r_lo, r_hi) = (row0, row0 + mr - 1);
                        let skip = match shape {
                            Shape::Full => false,
                            // Every needed column j ≤ r_hi.
                            Shape::LowerOut => col0 > r_hi,
                            // Row i sums over p ≤ i: this slab starts after the last row.
                            Shape::LowerLhs => pc > r_hi,
                            // Row i sums over p ≥ i: this slab ends before the first row.
                            Shape::UpperLhs => pc + kc <= r_lo,
                        };
                        if skip {
                            continue;
                        }
                        // Accumulate onto dst unless this is the tile's first slab of a fresh
                        // product (an upper-triangular left operand starts at the slab holding
                        // the tile's first row).
                        let first_slab = match shape {
                            Shape::UpperLhs => pc <= r_lo && r_lo < pc + kc,
                            _ => pc == 0,
                        };
                        let load = acc || !first_slab;
                        // Triangular left operands: only the part of the slab the tile's rows
                        // reach (row i sums p ≤ i, resp. p ≥ i), so the tile does not multiply
                        // the zeros past its last (before its first) row.
                        let (k0, k1) = match shape {
                            Shape::LowerLhs => (0, kc.min(r_hi + 1 - pc)),
                            Shape::UpperLhs => (r_lo.saturating_sub(pc), kc),
                            _ => (0, kc),
                        };
                        let (a, ar, ap) = if a_direct && mr == MR {
                            (lhs.ptr.wrapping_add(row0 * lhs.rs + pc), lhs.rs, 1)
                        } else {
                            (apack.wrapping_add(ir * kc) as *const f32, 1, MR)
                        };
                        let (a, b) = (a.wrapping_add(k0 * ap), bpack.wrapping_add(jr * kc + k0 * NR));
                        let kc = k1 - k0;
                        // SAFETY: the left panel is MR×kc inside lhs or the pack, the right one
                        // NR·kc floats inside the pack; the destination tile is inside dst
                        // (full tile) or `tile`.
                        unsafe {
                            let c = dst.add(row0 * dst_rs + col0);
                            if mr == MR && nr == NR {
                                kernel(kc, a, ar, ap, b, c, dst_rs, load, init.at(row0, col0));
                            } else {
                                kernel(kc, a, ar, ap, b, tile.as_mut_ptr(), NR, false, Init::NONE);
                                let start = init.at(row0, col0);
                                for i in 0..mr {
                                    let crow = c.add(i * dst_rs);
                                    for j in 0..nr {
                                        let v = tile[i * NR + j];
                                        *crow.add(j) = if load { *crow.add(j) + v } else { v + start.get(i, j) };
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    PACKS.with(|p| p.replace(packs));
}

/// GFLOP/s of `level`'s microkernel over one left and one right panel that stay in L1 (64 k
/// deep, the tile accumulated onto a hot destination), best of repeated runs for at least
/// `dur`: the rate no product of this blocking can beat, against which a product's own rate
/// shows what packing and cache misses cost it.
///
/// # Panics
/// If the CPU does not support `level`.
pub(crate) fn kernel_hot_gflops(level: Isa, dur: std::time::Duration) -> f64 {
    assert!(level <= Isa::detected(), "{level:?} is not supported by this CPU");
    match level {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => kernel_rate::<6, 64>(kernel_avx512, dur),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => kernel_rate::<6, 16>(kernel_avx2, dur),
        _ => kernel_rate::<4, 8>(kernel_scalar, dur),
    }
}

fn kernel_rate<const MR: usize, const NR: usize>(kernel: Kernel, dur: std::time::Duration) -> f64 {
    const KC: usize = 64;
    const CALLS: usize = 2000;
    let a = vec![0.5f32; MR * KC];
    let b = vec![0.25f32; NR * KC];
    let mut c = vec![0f32; MR * NR];
    let (ap, ar) = (MR, 1);
    let start = std::time::Instant::now();
    let mut best = 0f64;
    while best == 0.0 || start.elapsed() < dur {
        let t = std::time::Instant::now();
        for _ in 0..CALLS {
            // SAFETY: the caller checked the level; `a` is an MR×KC panel (k stride MR, the
            // kernels' packed stride), `b` an NR×KC panel and `c` an MR×NR tile.
            unsafe { kernel(KC, a.as_ptr(), ar, ap, b.as_ptr(), c.as_mut_ptr(), NR, true, Init::NONE) };
        }
        let s = t.elapsed().as_secs_f64();
        if s > 0.0 {
            best = best.max((CALLS * 2 * MR * NR * KC) as f64 / s / 1e9);
        }
    }
    std::hint::black_box(&c);
    best
}

/// Packs `m[i0.., p0..]` (`rows×kc`) into `W`-row micro-panels, k-major (`panel[p·W + r]`),
/// rows past `rows` zero. The left operand's `MR`-row panels directly; the right operand's
/// `NR`-column panels as rows of its transpose ([`Mat::t`]).
///
/// # Safety
/// The block is inside `m`; `out` holds `rows.div_ceil(W)·W·kc` floats.
#[inline(always)]
unsafe fn pack<const W: usize>(m: Mat, i0: usize, p0: usize, rows: usize, kc: usize, out: *mut f32) {
    // Register-transpose chunk: 16 columns (AVX-512), 8 (AVX2), or the whole panel.
    let chunk = if W >= 32 && W.is_multiple_of(16) {
        16
    } else if W >= 16 && W.is_multiple_of(8) {
        8
    } else {
        W
    };
    // A column-major block (each k a run of `rows` contiguous floats, e.g. `dyᵀ`): one sweep
    // over k fills every full panel, so each source line is read once, in order (panel by panel,
    // each k would read W floats of a line and come back to it for the next panel, and with a
    // 4 KiB row stride those lines share an L1 set).
    let mut first = 0;
    if m.rs == 1 && rows >= W {
        let full = rows / W;
        // SAFETY: inside the block / the panels by the caller's contract (a wide copy writes
        // slots p and p + 1 < kc of one panel and reads rows of the block).
        unsafe {
            let base = m.ptr.add(i0 + p0 * m.cs);
            // The AVX kernels' six-row panels: one 8-float move per panel instead of a 16- and
            // an 8-byte one (`simd::copy6_wide`; the weight-gradient products at AVX2 took
            // ~3 % less time), exact copies at the last k.
            let wide = W == 6 && isa() >= Isa::Avx2;
            for p in 0..kc {
                let src = base.add(p * m.cs);
                #[cfg(target_arch = "x86_64")]
                let done = if wide && p + 1 < kc { simd::copy6_wide(src, full, out.add(p * W), W * kc) } else { 0 };
                #[cfg(not(target_arch = "x86_64"))]
                let done = {
                    let _ = wide; // no AVX level off x86-64
                    0
                };
                for pi in done..full {
                    std::ptr::copy_nonoverlapping(src.add(pi * W), out.add(pi * W * kc + p * W), W);
                }
            }
        }
        first = full * W;
    }
    for (pi, ib) in (first..rows).step_by(W).enumerate().map(|(i, ib)| (i + first / W, ib)) {
        let valid = W.min(rows - ib);
        let panel = out.wrapping_add(pi * W * kc);
        // SAFETY (all accesses): inside the block / the panel by the caller's contract.
        unsafe {
            let base = m.ptr.add((i0 + ib) * m.rs + p0 * m.cs);
            if m.cs == 1 && valid == W {
                // Row-major block: transposed in SIMD registers, a chunk of rows at a time.
                for c in (0..W).step_by(chunk) {
                    transpose_into(base.add(c * m.rs), m.rs, chunk, kc, panel.add(c), W);
                }
            } else {
                for r in 0..valid {
                    let src = base.add(r * m.rs);
                    for p in 0..kc {
                        *panel.add(p * W + r) = *src.add(p * m.cs);
                    }
                }
                for r in valid..W {
                    for p in 0..kc {
                        *panel.add(p * W + r) = 0.0;
                    }
                }
            }
        }
    }
}

/// `out[p·os + i] = src[i·stride + p]` for `i < w`, `p < kc`: `w` contiguous runs (rows of a
/// row-major matrix) interleaved k-major.
///
/// # Safety
/// The `w` runs of `kc` floats are readable; `out` holds `os·(kc − 1) + w` floats, `w ≤ os`.
#[inline(always)]
unsafe fn transpose_into(src: *const f32, stride: usize, w: usize, kc: usize, out: *mut f32, os: usize) {
    let mut done = 0;
    // SAFETY (SIMD arms): the CPU has the level's features (`isa()` never exceeds them);
    // accesses are inside the runs and `out`.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        if w > 8 && w <= 16 && isa() == Isa::Avx512 {
            done = simd::transpose16(src, stride, w, kc, out, os);
        } else if w > 4 && w <= 8 && isa() >= Isa::Avx2 {
            done = simd::transpose8(src, stride, w, kc, out, os);
        }
    }
    // SAFETY: inside the runs and `out`.
    unsafe {
        for p in done..kc {
            for i in 0..w {
                *out.add(p * os + i) = *src.add(i * stride + p);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Transposes `w ≤ 16` runs of `kc` floats (stride `stride`) in 16×16 register blocks;
    /// returns how many k were done (a multiple of 16).
    ///
    /// # Safety
    /// AVX-512F; the runs are readable; `out` holds `os·kc` floats, `w ≤ os`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose16(src: *const f32, stride: usize, w: usize, kc: usize, out: *mut f32, os: usize) -> usize {
        let mask: __mmask16 = if w >= 16 { 0xffff } else { (1u16 << w) - 1 };
        let mut p = 0;
        while p + 16 <= kc {
            // SAFETY: rows i < w are readable for 16 floats at p; stores are masked to w lanes.
            unsafe {
                let mut r = [_mm512_setzero_ps(); 16];
                for (i, v) in r.iter_mut().enumerate().take(w) {
                    *v = _mm512_loadu_ps(src.add(i * stride + p));
                }
                t16(&mut r);
                for (q, v) in r.iter().enumerate() {
                    _mm512_mask_storeu_ps(out.add((p + q) * os), mask, *v);
                }
            }
            p += 16;
        }
        p
    }

    /// Copies six floats per panel, `src[6·pi..6·pi + 6]` to `dst + pi·panel`, for the first
    /// `full − 1` of `full` panels with one 8-float load and store each (the two extra floats
    /// land in the panel's next k slot, which its own copy overwrites later, and are read from
    /// the next panel's rows); returns how many panels it did (the caller copies the rest
    /// exactly).
    ///
    /// # Safety
    /// AVX; `src` is readable for `6·full` floats and each `dst + pi·panel` writable for 8
    /// floats, `pi < full − 1`.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn copy6_wide(src: *const f32, full: usize, dst: *mut f32, panel: usize) -> usize {
        let n = full.saturating_sub(1);
        for pi in 0..n {
            // SAFETY: by the contract.
            unsafe { _mm256_storeu_ps(dst.add(pi * panel), _mm256_loadu_ps(src.add(6 * pi))) };
        }
        n
    }

    /// As [`transpose16`] in 8×8 AVX blocks for `w ≤ 8`.
    ///
    /// # Safety
    /// AVX2; as [`transpose16`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn transpose8(src: *const f32, stride: usize, w: usize, kc: usize, out: *mut f32, os: usize) -> usize {
        let lanes: [i32; 8] = std::array::from_fn(|i| if i < w { -1 } else { 0 });
        // SAFETY: reads 8 i32.
        let mask = unsafe { _mm256_loadu_si256(lanes.as_ptr().cast()) };
        let mut p = 0;
        while p + 8 <= kc {
            // SAFETY: rows i < w are readable for 8 floats at p; stores write w lanes (masked
            // unless all 8).
            unsafe {
                let mut r = [_mm256_setzero_ps(); 8];
                for (i, v) in r.iter_mut().enumerate().take(w) {
                    *v = _mm256_loadu_ps(src.add(i * stride + p));
                }
                t8(&mut r);
                for (q, v) in r.iter().enumerate() {
                    // A full-width panel takes plain stores: AMD cores before Zen 4 run
                    // VMASKMOVPS stores as microcode (many times a plain store's cost), and the
                    // AVX2 right-operand pack is all full-width blocks.
                    if w >= 8 {
                        _mm256_storeu_ps(out.add((p + q) * os), *v);
                    } else {
                        _mm256_maskstore_ps(out.add((p + q) * os), mask, *v);
                    }
                }
            }
            p += 8;
        }
        p
    }

    /// In-register 16×16 transpose: lane j of output row i is lane i of input row j.
    #[target_feature(enable = "avx512f")]
    fn t16(r: &mut [__m512; 16]) {
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_shuffle_ps::<0xEE>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_shuffle_ps::<0xEE>(t[4 * i + 1], t[4 * i + 3]);
        }
        let mut v = [_mm512_setzero_ps(); 16];
        for h in 0..2 {
            for j in 0..4 {
                v[8 * h + j] = _mm512_shuffle_f32x4::<0x88>(u[8 * h + j], u[8 * h + 4 + j]);
                v[8 * h + 4 + j] = _mm512_shuffle_f32x4::<0xDD>(u[8 * h + j], u[8 * h + 4 + j]);
            }
        }
        for j in 0..8 {
            r[j] = _mm512_shuffle_f32x4::<0x88>(v[j], v[8 + j]);
            r[8 + j] = _mm512_shuffle_f32x4::<0xDD>(v[j], v[8 + j]);
        }
    }

    /// In-register 8×8 transpose.
    #[target_feature(enable = "avx2")]
    fn t8(r: &mut [__m256; 8]) {
        let mut t = [_mm256_setzero_ps(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm256_setzero_ps(); 8];
        for i in 0..2 {
            u[4 * i] = _mm256_shuffle_ps::<0x44>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm256_shuffle_ps::<0xEE>(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm256_shuffle_ps::<0x44>(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm256_shuffle_ps::<0xEE>(t[4 * i + 1], t[4 * i + 3]);
        }
        for j in 0..4 {
            r[j] = _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]);
            r[4 + j] = _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]);
        }
    }
}

/// 6×64 tile in 24 zmm accumulators: per k, four vector loads of the right panel and six
/// broadcasts of the left one feed 24 fused multiply-adds. The k loop is written in assembly
/// ([`kloop_avx512`]; LLVM's version of the same loop recomputes row addresses and ran ~6 %
/// slower).
///
/// # Safety
/// AVX-512F+FMA; `A[r][p]` at `a + r·ar + p·ap` is readable for r < 6, p < k, with `ap` 1 (a
/// row-major operand read in place) or 6 (a packed panel), any other `ap` panics; `b` holds
/// 64·k floats; `c` is a 6×64 tile with row stride `rs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)] // the kernel ABI: operands, strides, flags
unsafe fn kernel_avx512(
    k: usize,
    a: *const f32,
    ar: usize,
    ap: usize,
    b: *const f32,
    c: *mut f32,
    rs: usize,
    load: bool,
    init: Init,
) {
    use std::arch::x86_64::*;
    // The k loop writes every accumulator before the epilogue reads it (no zeroing stores).
    let mut acc = std::mem::MaybeUninit::<[__m512; 24]>::uninit();
    // SAFETY: the loop reads A and B inside the bounds of the contract and writes only `acc`;
    // every clobbered vector register is declared. Prefetches only hint (the tile is valid
    // memory); they bring the destination in while the k loop runs.
    unsafe {
        if load {
            for r in 0..6 {
                for q in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(c.add(r * rs + 16 * q).cast());
                }
            }
        } else if !init.res.is_null() {
            for r in 0..6 {
                for q in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(init.res.add(r * init.res_rs + 16 * q).cast());
                }
            }
        }
        // The blocked loop passes a left operand read in place (k stride 1) or a packed panel
        // (k stride MR = 6); the unrolled loop takes the stride as a compile-time displacement.
        match ap {
            1 => kloop_avx512::<1>(k, a, ar, b, acc.as_mut_ptr().cast()),
            6 => kloop_avx512::<6>(k, a, ar, b, acc.as_mut_ptr().cast()),
            _ => panic!("k stride {ap}: the kernels take 1 (in place) or 6 (packed)"),
        }
        // SAFETY (assume_init): the k loop stored all twenty-four accumulators.
        let acc = acc.assume_init();
        for (r, row) in acc.chunks_exact(4).enumerate() {
            let cr = c.add(r * rs);
            for (q, v) in row.iter().enumerate() {
                let mut v = *v;
                if load {
                    v = _mm512_add_ps(v, _mm512_loadu_ps(cr.add(16 * q)));
                } else {
                    if !init.bias.is_null() {
                        v = _mm512_add_ps(v, _mm512_loadu_ps(init.bias.add(16 * q)));
                    }
                    if !init.res.is_null() {
                        v = _mm512_add_ps(v, _mm512_loadu_ps(init.res.add(r * init.res_rs + 16 * q)));
                    }
                }
                _mm512_storeu_ps(cr.add(16 * q), v);
            }
        }
    }
}

/// 6×16 tile in 12 ymm accumulators (BLIS's Haswell shape); the k loop in assembly
/// ([`kloop_avx2`]).
///
/// # Safety
/// AVX2+FMA; `A` as for [`kernel_avx512`]; `b` holds 16·k floats; `c` is a 6×16 tile with row
/// stride `rs`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)] // the kernel ABI: operands, strides, flags
unsafe fn kernel_avx2(
    k: usize,
    a: *const f32,
    ar: usize,
    ap: usize,
    b: *const f32,
    c: *mut f32,
    rs: usize,
    load: bool,
    init: Init,
) {
    use std::arch::x86_64::*;
    // The k loop writes every accumulator before the epilogue reads it (no zeroing stores).
    let mut acc = std::mem::MaybeUninit::<[__m256; 12]>::uninit();
    // SAFETY: as in `kernel_avx512`.
    unsafe {
        // The destination tile is written at the end whether or not it is read, so its lines
        // are asked for now, fresh products included (their tiles are often in no cache): the
        // epilogue's stores then do not wait on them. Fresh 1024×1024×256 products on the Zen 3
        // went from medians of 61, 60 and 79 to 68, 64 and 80 GFLOP/s in three in-process A/B
        // runs of 60 alternating calls each.
        for r in 0..6 {
            _mm_prefetch::<_MM_HINT_T0>(c.add(r * rs).cast());
        }
        if !load && !init.res.is_null() {
            for r in 0..6 {
                _mm_prefetch::<_MM_HINT_T0>(init.res.add(r * init.res_rs).cast());
            }
        }
        // The blocked loop passes a left operand read in place (k stride 1) or a packed panel
        // (k stride MR = 6); the unrolled loop takes the stride as a compile-time displacement.
        match ap {
            1 => kloop_avx2::<1>(k, a, ar, b, acc.as_mut_ptr().cast()),
            6 => kloop_avx2::<6>(k, a, ar, b, acc.as_mut_ptr().cast()),
            _ => panic!("k stride {ap}: the kernels take 1 (in place) or 6 (packed)"),
        }
        // SAFETY (assume_init): the k loop stored all twelve accumulators.
        let acc = acc.assume_init();
        for (r, row) in acc.chunks_exact(2).enumerate() {
            let cr = c.add(r * rs);
            let (mut v0, mut v1) = (row[0], row[1]);
            if load {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(cr));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(cr.add(8)));
            } else {
                if !init.bias.is_null() {
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(init.bias));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(init.bias.add(8)));
                }
                if !init.res.is_null() {
                    let rr = init.res.add(r * init.res_rs);
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(rr));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(rr.add(8)));
                }
            }
            _mm256_storeu_ps(cr, v0);
            _mm256_storeu_ps(cr.add(8), v1);
        }
    }
}

/// The k loop of [`kernel_avx2`], unrolled by two: the left operand's k stride is the
/// compile-time `AP` floats (1: a row-major operand read in place; 6: a packed panel), so both
/// steps address it with immediate displacements and the pointers advance once per two k (an
/// odd k enters the loop at its second step, the pointers backed up by one step). Rows
/// 0–2 are addressed from `a`, rows 3–5 from `a + 3·ar`. Against one k per iteration this took
/// 5–6 % off the whole training step at AVX2 (alternating A/B runs); by four gained nothing more.
///
/// # Safety
/// AVX2+FMA; `A[r][p]` at `a + r·ar + p·AP` readable for r < 6, p < k; `b` holds 16·k floats;
/// `acc` is writable for 12 ymm (the accumulators come back there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kloop_avx2<const AP: usize>(k: usize, a: *const f32, ar: usize, b: *const f32, acc: *mut f32) {
    use std::arch::asm;
    // SAFETY: as in `kernel_avx2`.
    unsafe {
        asm!(
            "vxorps ymm0, ymm0, ymm0",
            "vxorps ymm1, ymm1, ymm1",
            "vxorps ymm2, ymm2, ymm2",
            "vxorps ymm3, ymm3, ymm3",
            "vxorps ymm4, ymm4, ymm4",
            "vxorps ymm5, ymm5, ymm5",
            "vxorps ymm6, ymm6, ymm6",
            "vxorps ymm7, ymm7, ymm7",
            "vxorps ymm8, ymm8, ymm8",
            "vxorps ymm9, ymm9, ymm9",
            "vxorps ymm10, ymm10, ymm10",
            "vxorps ymm11, ymm11, ymm11",
            // ceil(k / 2) iterations; an odd k enters at the second step with the
            // pointers one step back, so no tail copy of the step is needed.
            "add {k}, 1",
            "shr {k}, 1",
            "jz 3f",
            "test {odd}, 1",
            "jz 2f",
            "sub {a0}, {d}",
            "sub {a3}, {d}",
            "sub {b}, 64",
            "jmp 5f",
            "2:",
            "vmovups ymm12, [{b} + 0]",
            "vmovups ymm13, [{b} + 32]",
            "vbroadcastss ymm14, [{a0}]",
            "vfmadd231ps ymm0, ymm14, ymm12",
            "vfmadd231ps ymm1, ymm14, ymm13",
            "vbroadcastss ymm15, [{a0} + {ar}*4]",
            "vfmadd231ps ymm2, ymm15, ymm12",
            "vfmadd231ps ymm3, ymm15, ymm13",
            "vbroadcastss ymm14, [{a0} + {ar}*8]",
            "vfmadd231ps ymm4, ymm14, ymm12",
            "vfmadd231ps ymm5, ymm14, ymm13",
            "vbroadcastss ymm15, [{a3}]",
            "vfmadd231ps ymm6, ymm15, ymm12",
            "vfmadd231ps ymm7, ymm15, ymm13",
            "vbroadcastss ymm14, [{a3} + {ar}*4]",
            "vfmadd231ps ymm8, ymm14, ymm12",
            "vfmadd231ps ymm9, ymm14, ymm13",
            "vbroadcastss ymm15, [{a3} + {ar}*8]",
            "vfmadd231ps ymm10, ymm15, ymm12",
            "vfmadd231ps ymm11, ymm15, ymm13",
            "5:",
            "vmovups ymm12, [{b} + 64]",
            "vmovups ymm13, [{b} + 96]",
            "vbroadcastss ymm14, [{a0} + {d}]",
            "vfmadd231ps ymm0, ymm14, ymm12",
            "vfmadd231ps ymm1, ymm14, ymm13",
            "vbroadcastss ymm15, [{a0} + {ar}*4 + {d}]",
            "vfmadd231ps ymm2, ymm15, ymm12",
            "vfmadd231ps ymm3, ymm15, ymm13",
            "vbroadcastss ymm14, [{a0} + {ar}*8 + {d}]",
            "vfmadd231ps ymm4, ymm14, ymm12",
            "vfmadd231ps ymm5, ymm14, ymm13",
            "vbroadcastss ymm15, [{a3} + {d}]",
            "vfmadd231ps ymm6, ymm15, ymm12",
            "vfmadd231ps ymm7, ymm15, ymm13",
            "vbroadcastss ymm14, [{a3} + {ar}*4 + {d}]",
            "vfmadd231ps ymm8, ymm14, ymm12",
            "vfmadd231ps ymm9, ymm14, ymm13",
            "vbroadcastss ymm15, [{a3} + {ar}*8 + {d}]",
            "vfmadd231ps ymm10, ymm15, ymm12",
            "vfmadd231ps ymm11, ymm15, ymm13",
            "add {a0}, {d2}",
            "add {a3}, {d2}",
            "add {b}, 128",
            "dec {k}",
            "jnz 2b",
            "3:",
            "vmovups [{acc} + 0], ymm0",
            "vmovups [{acc} + 32], ymm1",
            "vmovups [{acc} + 64], ymm2",
            "vmovups [{acc} + 96], ymm3",
            "vmovups [{acc} + 128], ymm4",
            "vmovups [{acc} + 160], ymm5",
            "vmovups [{acc} + 192], ymm6",
            "vmovups [{acc} + 224], ymm7",
            "vmovups [{acc} + 256], ymm8",
            "vmovups [{acc} + 288], ymm9",
            "vmovups [{acc} + 320], ymm10",
            "vmovups [{acc} + 352], ymm11",
            a0 = inout(reg) a => _,
            a3 = inout(reg) a.wrapping_add(3 * ar) => _,
            ar = in(reg) ar,
            b = inout(reg) b => _,
            k = inout(reg) k => _,
            odd = in(reg) k,
            acc = in(reg) acc,
            d = const AP * 4,
            d2 = const AP * 8,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack),
        );
    }
}

/// The k loop of [`kernel_avx512`], unrolled by two as [`kloop_avx2`] (6–7 % off the step at
/// AVX-512 against one k per iteration).
///
/// # Safety
/// AVX-512F+FMA; `A[r][p]` at `a + r·ar + p·AP` readable for r < 6, p < k; `b` holds 64·k
/// floats; `acc` is writable for 24 zmm (the accumulators come back there).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
unsafe fn kloop_avx512<const AP: usize>(k: usize, a: *const f32, ar: usize, b: *const f32, acc: *mut f32) {
    use std::arch::asm;
    // SAFETY: as in `kernel_avx512`.
    unsafe {
        asm!(
            "vpxord zmm0, zmm0, zmm0",
            "vpxord zmm1, zmm1, zmm1",
            "vpxord zmm2, zmm2, zmm2",
            "vpxord zmm3, zmm3, zmm3",
            "vpxord zmm4, zmm4, zmm4",
            "vpxord zmm5, zmm5, zmm5",
            "vpxord zmm6, zmm6, zmm6",
            "vpxord zmm7, zmm7, zmm7",
            "vpxord zmm8, zmm8, zmm8",
            "vpxord zmm9, zmm9, zmm9",
            "vpxord zmm10, zmm10, zmm10",
            "vpxord zmm11, zmm11, zmm11",
            "vpxord zmm12, zmm12, zmm12",
            "vpxord zmm13, zmm13, zmm13",
            "vpxord zmm14, zmm14, zmm14",
            "vpxord zmm15, zmm15, zmm15",
            "vpxord zmm16, zmm16, zmm16",
            "vpxord zmm17, zmm17, zmm17",
            "vpxord zmm18, zmm18, zmm18",
            "vpxord zmm19, zmm19, zmm19",
            "vpxord zmm20, zmm20, zmm20",
            "vpxord zmm21, zmm21, zmm21",
            "vpxord zmm22, zmm22, zmm22",
            "vpxord zmm23, zmm23, zmm23",
            // ceil(k / 2) iterations; an odd k enters at the second step with the
            // pointers one step back, so no tail copy of the step is needed.
            "add {k}, 1",
            "shr {k}, 1",
            "jz 3f",
            "test {odd}, 1",
            "jz 2f",
            "sub {a0}, {d}",
            "sub {a3}, {d}",
            "sub {b}, 256",
            "jmp 5f",
            "2:",
            "vmovups zmm24, [{b} + 0]",
            "vmovups zmm25, [{b} + 64]",
            "vmovups zmm26, [{b} + 128]",
            "vmovups zmm27, [{b} + 192]",
            "vbroadcastss zmm28, [{a0}]",
            "vfmadd231ps zmm0, zmm28, zmm24",
            "vfmadd231ps zmm1, zmm28, zmm25",
            "vfmadd231ps zmm2, zmm28, zmm26",
            "vfmadd231ps zmm3, zmm28, zmm27",
            "vbroadcastss zmm29, [{a0} + {ar}*4]",
            "vfmadd231ps zmm4, zmm29, zmm24",
            "vfmadd231ps zmm5, zmm29, zmm25",
            "vfmadd231ps zmm6, zmm29, zmm26",
            "vfmadd231ps zmm7, zmm29, zmm27",
            "vbroadcastss zmm28, [{a0} + {ar}*8]",
            "vfmadd231ps zmm8, zmm28, zmm24",
            "vfmadd231ps zmm9, zmm28, zmm25",
            "vfmadd231ps zmm10, zmm28, zmm26",
            "vfmadd231ps zmm11, zmm28, zmm27",
            "vbroadcastss zmm29, [{a3}]",
            "vfmadd231ps zmm12, zmm29, zmm24",
            "vfmadd231ps zmm13, zmm29, zmm25",
            "vfmadd231ps zmm14, zmm29, zmm26",
            "vfmadd231ps zmm15, zmm29, zmm27",
            "vbroadcastss zmm28, [{a3} + {ar}*4]",
            "vfmadd231ps zmm16, zmm28, zmm24",
            "vfmadd231ps zmm17, zmm28, zmm25",
            "vfmadd231ps zmm18, zmm28, zmm26",
            "vfmadd231ps zmm19, zmm28, zmm27",
            "vbroadcastss zmm29, [{a3} + {ar}*8]",
            "vfmadd231ps zmm20, zmm29, zmm24",
            "vfmadd231ps zmm21, zmm29, zmm25",
            "vfmadd231ps zmm22, zmm29, zmm26",
            "vfmadd231ps zmm23, zmm29, zmm27",
            "5:",
            "vmovups zmm24, [{b} + 256]",
            "vmovups zmm25, [{b} + 320]",
            "vmovups zmm26, [{b} + 384]",
            "vmovups zmm27, [{b} + 448]",
            "vbroadcastss zmm28, [{a0} + {d}]",
            "vfmadd231ps zmm0, zmm28, zmm24",
            "vfmadd231ps zmm1, zmm28, zmm25",
            "vfmadd231ps zmm2, zmm28, zmm26",
            "vfmadd231ps zmm3, zmm28, zmm27",
            "vbroadcastss zmm29, [{a0} + {ar}*4 + {d}]",
            "vfmadd231ps zmm4, zmm29, zmm24",
            "vfmadd231ps zmm5, zmm29, zmm25",
            "vfmadd231ps zmm6, zmm29, zmm26",
            "vfmadd231ps zmm7, zmm29, zmm27",
            "vbroadcastss zmm28, [{a0} + {ar}*8 + {d}]",
            "vfmadd231ps zmm8, zmm28, zmm24",
            "vfmadd231ps zmm9, zmm28, zmm25",
            "vfmadd231ps zmm10, zmm28, zmm26",
            "vfmadd231ps zmm11, zmm28, zmm27",
            "vbroadcastss zmm29, [{a3} + {d}]",
            "vfmadd231ps zmm12, zmm29, zmm24",
            "vfmadd231ps zmm13, zmm29, zmm25",
            "vfmadd231ps zmm14, zmm29, zmm26",
            "vfmadd231ps zmm15, zmm29, zmm27",
            "vbroadcastss zmm28, [{a3} + {ar}*4 + {d}]",
            "vfmadd231ps zmm16, zmm28, zmm24",
            "vfmadd231ps zmm17, zmm28, zmm25",
            "vfmadd231ps zmm18, zmm28, zmm26",
            "vfmadd231ps zmm19, zmm28, zmm27",
            "vbroadcastss zmm29, [{a3} + {ar}*8 + {d}]",
            "vfmadd231ps zmm20, zmm29, zmm24",
            "vfmadd231ps zmm21, zmm29, zmm25",
            "vfmadd231ps zmm22, zmm29, zmm26",
            "vfmadd231ps zmm23, zmm29, zmm27",
            "add {a0}, {d2}",
            "add {a3}, {d2}",
            "add {b}, 512",
            "dec {k}",
            "jnz 2b",
            "3:",
            "vmovups [{acc} + 0], zmm0",
            "vmovups [{acc} + 64], zmm1",
            "vmovups [{acc} + 128], zmm2",
            "vmovups [{acc} + 192], zmm3",
            "vmovups [{acc} + 256], zmm4",
            "vmovups [{acc} + 320], zmm5",
            "vmovups [{acc} + 384], zmm6",
            "vmovups [{acc} + 448], zmm7",
            "vmovups [{acc} + 512], zmm8",
            "vmovups [{acc} + 576], zmm9",
            "vmovups [{acc} + 640], zmm10",
            "vmovups [{acc} + 704], zmm11",
            "vmovups [{acc} + 768], zmm12",
            "vmovups [{acc} + 832], zmm13",
            "vmovups [{acc} + 896], zmm14",
            "vmovups [{acc} + 960], zmm15",
            "vmovups [{acc} + 1024], zmm16",
            "vmovups [{acc} + 1088], zmm17",
            "vmovups [{acc} + 1152], zmm18",
            "vmovups [{acc} + 1216], zmm19",
            "vmovups [{acc} + 1280], zmm20",
            "vmovups [{acc} + 1344], zmm21",
            "vmovups [{acc} + 1408], zmm22",
            "vmovups [{acc} + 1472], zmm23",
            a0 = inout(reg) a => _,
            a3 = inout(reg) a.wrapping_add(3 * ar) => _,
            ar = in(reg) ar,
            b = inout(reg) b => _,
            k = inout(reg) k => _,
            odd = in(reg) k,
            acc = in(reg) acc,
            d = const AP * 4,
            d2 = const AP * 8,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
            out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _, out("zmm16") _, out("zmm17") _,
            out("zmm18") _, out("zmm19") _, out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
            out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _, out("zmm28") _, out("zmm29") _,
            options(nostack),
        );
    }
}

/// 4×8 tile in plain arithmetic (auto-vectorized for SSE2).
///
/// # Safety
/// `A` as for [`kernel_avx512`] (4 rows); `b` holds 8·k floats; `c` is a 4×8 tile with row
/// stride `rs`.
#[allow(clippy::too_many_arguments)] // the kernel ABI: operands, strides, flags
unsafe fn kernel_scalar(
    k: usize,
    a: *const f32,
    ar: usize,
    ap: usize,
    b: *const f32,
    c: *mut f32,
    rs: usize,
    load: bool,
    init: Init,
) {
    let mut acc = [[0f32; 8]; 4];
    // SAFETY: in bounds by the contract.
    unsafe {
        for p in 0..k {
            let bp = std::slice::from_raw_parts(b.add(p * 8), 8);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = *a.add(r * ar + p * ap);
                for j in 0..8 {
                    row[j] += av * bp[j];
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            let cr = c.add(r * rs);
            for (j, v) in row.iter().enumerate() {
                *cr.add(j) = if load { *cr.add(j) + v } else { *v + init.get(r, j) };
            }
        }
    }
}

fn check(what: &str, len: usize, want: usize) {
    // Shapes are validated where units start; this guards the unsafe calls below.
    assert!(len >= want, "{what}: {len} elements, need {want}");
}

/// `out (n×o) = x (n×k) · wᵀ [+ bias] [+ res]`: a linear layer's output, with its bias and its
/// residual input `res` (`n×o`) when given, added to each tile as it leaves the registers.
#[allow(clippy::too_many_arguments)] // a linear layer's operands
pub(crate) fn linear(n: usize, k: usize, o: usize, x: &[f32], w: &[f32], bias: Option<&[f32]>, res: Option<&[f32]>, out: &mut [f32]) {
    linear_at(isa(), (n, k, o), x, w, bias, res, out);
}

/// [`linear`] at a given SIMD level (at most [`Isa::detected`]).
fn linear_at(level: Isa, (n, k, o): (usize, usize, usize), x: &[f32], w: &[f32], bias: Option<&[f32]>, res: Option<&[f32]>, out: &mut [f32]) {
    assert!(level <= Isa::detected(), "{level:?} is not supported by this CPU");
    check("x", x.len(), n * k);
    check("w", w.len(), o * k);
    check("out", out.len(), n * o);
    if let Some(b) = bias {
        check("bias", b.len(), o);
    }
    if let Some(r) = res {
        check("res", r.len(), n * o);
    }
    let init = Init {
        bias: bias.map_or(std::ptr::null(), <[f32]>::as_ptr),
        res: res.map_or(std::ptr::null(), <[f32]>::as_ptr),
        res_rs: o,
    };
    // SAFETY: lengths checked above; `out` is a distinct &mut; the level runs on this CPU.
    unsafe {
        gemm_from(
            level,
            (
                n,
                o,
                k,
                out.as_mut_ptr(),
                o,
                false,
                Mat { ptr: x.as_ptr(), rs: k, cs: 1 },
                Mat { ptr: w.as_ptr(), rs: 1, cs: k },
                Shape::Full,
                init,
            ),
        );
    }
}

/// `dw (o×k) = [dw +] dyᵀ · x` (`dy` is `n×o`).
pub(crate) fn dyt_x(n: usize, k: usize, o: usize, dy: &[f32], x: &[f32], dw: &mut [f32], acc: bool) {
    check("dy", dy.len(), n * o);
    check("x", x.len(), n * k);
    check("dw", dw.len(), o * k);
    // SAFETY: lengths checked above; `dw` is a distinct &mut.
    unsafe {
        gemm(
            (o, k, n),
            dw.as_mut_ptr(),
            k,
            acc,
            Mat { ptr: dy.as_ptr(), rs: 1, cs: o },
            Mat { ptr: x.as_ptr(), rs: k, cs: 1 },
            Shape::Full,
        );
    }
}

/// `dx (n×k) = [dx +] dy · w` (`dy` is `n×o`, `w` is `o×k`).
pub(crate) fn dy_w(n: usize, k: usize, o: usize, dy: &[f32], w: &[f32], dx: &mut [f32], acc: bool) {
    check("dy", dy.len(), n * o);
    check("w", w.len(), o * k);
    check("dx", dx.len(), n * k);
    // SAFETY: lengths checked above; `dx` is a distinct &mut.
    unsafe {
        gemm(
            (n, k, o),
            dx.as_mut_ptr(),
            k,
            acc,
            Mat { ptr: dy.as_ptr(), rs: o, cs: 1 },
            Mat { ptr: w.as_ptr(), rs: k, cs: 1 },
            Shape::Full,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SplitMix;

    fn naive(m: usize, n: usize, k: usize, a: &[f32], (ars, acs): (usize, usize), b: &[f32], (brs, bcs): (usize, usize)) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| f64::from(a[i * ars + p * acs]) * f64::from(b[p * brs + j * bcs])).sum();
            }
        }
        c
    }

    fn levels() -> Vec<Isa> {
        [Isa::Baseline, Isa::Avx2, Isa::Avx512].into_iter().filter(|l| *l <= Isa::detected()).collect()
    }

    #[test]
    fn products_match_a_naive_reference_at_every_level_and_layout() {
        let mut rng = SplitMix::new(3);
        let sizes = [(1, 1, 1), (13, 33, 7), (25, 17, 300), (12, 32, 256), (37, 70, 513), (150, 40, 9), (2, 1100, 20)];
        for level in levels() {
            for &(m, n, k) in &sizes {
                for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                    let a: Vec<f32> = (0..m * k).map(|_| rng.normal()).collect();
                    let b: Vec<f32> = (0..k * n).map(|_| rng.normal()).collect();
                    let sa = if ta { (1, m) } else { (k, 1) };
                    let sb = if tb { (1, k) } else { (n, 1) };
                    let want = naive(m, n, k, &a, sa, &b, sb);
                    for acc in [false, true] {
                        let rs = n + 3; // a destination row stride wider than n
                        let mut c: Vec<f32> = (0..m * rs).map(|i| (i % 5) as f32).collect();
                        let before = c.clone();
                        // SAFETY: operands sized for their strides; c is separate.
                        unsafe {
                            gemm_at(
                                level,
                                (m, n, k),
                                c.as_mut_ptr(),
                                rs,
                                acc,
                                Mat { ptr: a.as_ptr(), rs: sa.0, cs: sa.1 },
                                Mat { ptr: b.as_ptr(), rs: sb.0, cs: sb.1 },
                                Shape::Full,
                            );
                        }
                        for i in 0..m {
                            for j in 0..rs {
                                let got = f64::from(c[i * rs + j]);
                                let base = f64::from(before[i * rs + j]);
                                if j >= n {
                                    assert_eq!(got, base, "{level:?} wrote past the row");
                                    continue;
                                }
                                let w = want[i * n + j] + if acc { base } else { 0.0 };
                                let tol = 1e-4 * (k as f64).sqrt() * (1.0 + w.abs());
                                assert!((got - w).abs() < tol, "{level:?} {m}x{n}x{k} ta={ta} tb={tb} acc={acc} [{i},{j}]: {got} vs {w}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_linear_layer_adds_its_bias_and_residual_at_every_level() {
        let mut rng = SplitMix::new(5);
        // Full tiles, partial rows and columns, several k-slabs, and k = 0.
        for &(n, k, o) in &[(1, 1, 1), (13, 33, 7), (25, 300, 17), (12, 256, 64), (37, 513, 70), (6, 0, 16)] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
            let w: Vec<f32> = (0..o * k).map(|_| rng.normal()).collect();
            let bias: Vec<f32> = (0..o).map(|_| rng.normal()).collect();
            let res: Vec<f32> = (0..n * o).map(|_| rng.normal()).collect();
            let prod = naive(n, o, k, &x, (k, 1), &w, (1, k));
            for level in levels() {
                for (with_bias, with_res) in [(false, false), (true, false), (false, true), (true, true)] {
                    let mut out = vec![f32::NAN; n * o];
                    linear_at(level, (n, k, o), &x, &w, with_bias.then_some(&bias[..]), with_res.then_some(&res[..]), &mut out);
                    for i in 0..n {
                        for j in 0..o {
                            let b = if with_bias { f64::from(bias[j]) } else { 0.0 };
                            let want = prod[i * o + j] + b + if with_res { f64::from(res[i * o + j]) } else { 0.0 };
                            let got = f64::from(out[i * o + j]);
                            let tol = 1e-4 * ((k + 1) as f64).sqrt() * (1.0 + want.abs());
                            assert!((got - want).abs() < tol, "{level:?} {n}x{k}x{o} bias={with_bias} res={with_res} [{i},{j}]: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn causal_shapes_compute_what_they_promise() {
        let mut rng = SplitMix::new(9);
        for level in levels() {
            for t in [1usize, 5, 12, 40, 150, 300] {
                let hd = 7;
                let q: Vec<f32> = (0..t * hd).map(|_| rng.normal()).collect();
                let kk: Vec<f32> = (0..t * hd).map(|_| rng.normal()).collect();
                // LowerOut: scores q·kᵀ, checked on and below the diagonal.
                let want = naive(t, t, hd, &q, (hd, 1), &kk, (1, hd));
                let mut s = vec![f32::NAN; t * t];
                // SAFETY: sized above.
                unsafe {
                    gemm_at(level, (t, t, hd), s.as_mut_ptr(), t, false, Mat { ptr: q.as_ptr(), rs: hd, cs: 1 }, Mat { ptr: kk.as_ptr(), rs: 1, cs: hd }, Shape::LowerOut);
                }
                for i in 0..t {
                    for j in 0..=i {
                        assert!((f64::from(s[i * t + j]) - want[i * t + j]).abs() < 1e-3, "{level:?} t={t} lower-out [{i},{j}]");
                    }
                }
                // A lower-triangular left operand (zeros above the diagonal), and its transpose.
                let mut p: Vec<f32> = (0..t * t).map(|_| rng.normal()).collect();
                for i in 0..t {
                    for j in i + 1..t {
                        p[i * t + j] = 0.0;
                    }
                }
                let v: Vec<f32> = (0..t * hd).map(|_| rng.normal()).collect();
                for (shape, sa) in [(Shape::LowerLhs, (t, 1)), (Shape::UpperLhs, (1, t))] {
                    let want = naive(t, hd, t, &p, sa, &v, (hd, 1));
                    for acc in [false, true] {
                        let mut y = vec![0.5f32; t * hd];
                        // SAFETY: sized above.
                        unsafe {
                            gemm_at(level, (t, hd, t), y.as_mut_ptr(), hd, acc, Mat { ptr: p.as_ptr(), rs: sa.0, cs: sa.1 }, Mat { ptr: v.as_ptr(), rs: hd, cs: 1 }, shape);
                        }
                        for i in 0..t * hd {
                            let w = want[i] + if acc { 0.5 } else { 0.0 };
                            assert!((f64::from(y[i]) - w).abs() < 1e-3 * (1.0 + w.abs()), "{level:?} t={t} {shape:?} acc={acc} [{i}]: {} vs {w}", y[i]);
                        }
                    }
                }
            }
        }
    }
}
