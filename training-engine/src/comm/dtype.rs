//! Element types and the reduction kernels.
//!
//! Reductions are computed tile by tile (1024 elements) into an accumulator in the element's
//! accumulation type, so that the loops vectorize and sources may alias the destination.
//!
//! Numerics:
//! - `f32`, `f64`: accumulate in the element type.
//! - `bf16`, `f16`: accumulate in `f32`, round once when the tile is stored. A fold of N
//!   inputs in one kernel call (shared memory, deterministic TCP, small TCP messages) therefore
//!   rounds once; the pipelined TCP ring folds one peer per step and rounds at every step.
//! - integers: wrapping arithmetic; `Avg` is the wrapped sum divided by N, truncating toward zero.
//! - `Max`/`Min` of floats propagate NaN (as `torch.max` does): the result is NaN if any rank's
//!   element is, whatever the order the ranks are folded in.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use super::error::{CommError, Result};

/// The element types collectives accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    F64 = 2,
    BF16 = 3,
    F16 = 4,
    I32 = 5,
    I64 = 6,
    U8 = 7,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name, as in error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    pub(crate) fn from_u8(v: u8) -> Option<DType> {
        Some(match v {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::BF16,
            4 => DType::F16,
            5 => DType::I32,
            6 => DType::I64,
            7 => DType::U8,
            _ => return None,
        })
    }
}

/// Reduction operators. `Avg` is `Sum` followed by a division by the group size (as Gloo does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 1,
    Avg = 2,
    Max = 3,
    Min = 4,
}

impl ReduceOp {
    pub(crate) fn from_u8(v: u8) -> Option<ReduceOp> {
        Some(match v {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Max,
            4 => ReduceOp::Min,
            _ => return None,
        })
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

/// A plain-old-data element type that collectives can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The runtime tag of this type.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

const TILE: usize = 1024;

/// Arithmetic on the accumulation type.
trait Acc: Copy + Default + Send + Sync + 'static {
    fn add(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn div_n(a: Self, n: usize) -> Self;
}

macro_rules! acc_float {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                // A NaN wins from either side: the result does not depend on the order.
                if b > a || b.is_nan() { b } else { a }
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if b < a || b.is_nan() { b } else { a }
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                a / (n as $t)
            }
        }
    };
}
acc_float!(f32);
acc_float!(f64);

macro_rules! acc_int {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if b > a { b } else { a }
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if b < a { b } else { a }
            }
            #[inline(always)]
            fn div_n(a: Self, n: usize) -> Self {
                // n is a group size (>= 1); it fits every integer type we use except u8 for
                // groups larger than 255, where the average of u8 values is always 0.
                match <$t>::try_from(n) {
                    Ok(d) => a / d,
                    Err(_) => 0,
                }
            }
        }
    };
}
acc_int!(i32);
acc_int!(i64);
acc_int!(u8);

/// Element ↔ accumulator conversion.
trait Kern: bytemuck::Pod + Send + Sync {
    type A: Acc;
    /// The element is its own accumulator (`A` is `Self`): no conversion on load or store.
    const NATIVE: bool;
    fn load(src: &[Self], acc: &mut [Self::A]);
    fn combine(src: &[Self], acc: &mut [Self::A], op: ReduceOp);
    fn store(acc: &[Self::A], dst: &mut [Self]);
}

#[inline(always)]
fn combine_acc<A: Acc>(src: &[A], acc: &mut [A], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = A::add(*a, *s);
            }
        }
        ReduceOp::Max => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = A::max(*a, *s);
            }
        }
        ReduceOp::Min => {
            for (a, s) in acc.iter_mut().zip(src) {
                *a = A::min(*a, *s);
            }
        }
    }
}

macro_rules! kern_native {
    ($t:ty) => {
        impl Kern for $t {
            type A = $t;
            const NATIVE: bool = true;
            #[inline(always)]
            fn load(src: &[Self], acc: &mut [Self::A]) {
                acc.copy_from_slice(src);
            }
            #[inline(always)]
            fn combine(src: &[Self], acc: &mut [Self::A], op: ReduceOp) {
                combine_acc(src, acc, op);
            }
            #[inline(always)]
            fn store(acc: &[Self::A], dst: &mut [Self]) {
                dst.copy_from_slice(acc);
            }
        }
    };
}
kern_native!(f32);
kern_native!(f64);
kern_native!(i32);
kern_native!(i64);
kern_native!(u8);

macro_rules! kern_half {
    ($t:ty) => {
        impl Kern for $t {
            type A = f32;
            const NATIVE: bool = false;
            #[inline(always)]
            fn load(src: &[Self], acc: &mut [f32]) {
                src.convert_to_f32_slice(acc);
            }
            #[inline(always)]
            fn combine(src: &[Self], acc: &mut [f32], op: ReduceOp) {
                let mut tmp = [0f32; TILE];
                let tmp = &mut tmp[..src.len()];
                src.convert_to_f32_slice(tmp);
                combine_acc(tmp, acc, op);
            }
            #[inline(always)]
            fn store(acc: &[f32], dst: &mut [Self]) {
                dst.convert_from_f32_slice(acc);
            }
        }
    };
}
kern_half!(bf16);
kern_half!(f16);

fn misaligned(what: &str) -> CommError {
    CommError::InvalidArgument(format!("{what} buffer is not aligned for its element type"))
}

/// `o[i] = f(x[i], y[i])` for `i < n`, then `/ avg_n` when given, in blocks of 16 elements each
/// read whole before it is written, so `o` may alias `x` or `y` exactly (an in-place fold) and
/// the blocks still vectorize (a plain loop over raw pointers that may alias gets a run-time
/// overlap check, and exact aliasing fails it: the scalar loop ran).
///
/// # Safety
/// `x`, `y` valid for `n` reads, `o` for `n` writes; `o` equal to or disjoint from each of them.
#[inline(always)]
unsafe fn pair_with<A: Acc>(o: *mut A, x: *const A, y: *const A, n: usize, avg_n: Option<usize>, f: impl Fn(A, A) -> A) {
    const V: usize = 16;
    let mut i = 0;
    // SAFETY (all accesses): inside the `n` elements of each by the caller's contract; each
    // block's inputs are read into registers before its output is written.
    unsafe {
        while i + V <= n {
            let xa = std::ptr::read_unaligned(x.add(i).cast::<[A; V]>());
            let ya = std::ptr::read_unaligned(y.add(i).cast::<[A; V]>());
            let mut r = [A::default(); V];
            for k in 0..V {
                r[k] = f(xa[k], ya[k]);
            }
            // A second loop over the block: one closure doing both kept the block scalar.
            if let Some(d) = avg_n {
                for v in &mut r {
                    *v = A::div_n(*v, d);
                }
            }
            std::ptr::write_unaligned(o.add(i).cast::<[A; V]>(), r);
            i += V;
        }
        while i < n {
            let v = f(*x.add(i), *y.add(i));
            *o.add(i) = match avg_n {
                Some(d) => A::div_n(v, d),
                None => v,
            };
            i += 1;
        }
    }
}

/// `o = x op y` over `n` elements, then `/ avg_n` when given (see [`pair_with`]).
///
/// # Safety
/// As [`pair_with`].
#[inline(always)]
unsafe fn pair<A: Acc>(op: ReduceOp, o: *mut A, x: *const A, y: *const A, n: usize, avg_n: Option<usize>) {
    // SAFETY (each arm): forwarded.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => pair_with(o, x, y, n, avg_n, A::add),
            ReduceOp::Max => pair_with(o, x, y, n, avg_n, A::max),
            ReduceOp::Min => pair_with(o, x, y, n, avg_n, A::min),
        }
    }
}

/// `out = fold(srcs[0], srcs[1], ...)` in order, then `/ avg_n` when given. With `stream`, each
/// tile of `out` is written with streaming stores ([`stream_copy`]) and one store fence ends the
/// call.
///
/// Elements that are their own accumulator ([`Kern::NATIVE`]) fold two sources in one pass
/// straight into `out` ([`pair`]), and more sources a tile at a time: the first two in one pass
/// into the tile, the rest into it in place; the half types convert each source into an `f32`
/// tile. (A tile loaded from the first source, combined with the second and copied out took
/// 2–2.5× the time of one pass on a Zen 3, in cache and out of it.)
///
/// # Safety
/// `out` must be valid for writes and every `srcs[i]` valid for reads of `n` elements of `K`,
/// all suitably aligned; no other thread may write those bytes during the call. `out` may be
/// equal to (alias exactly) one of the sources, but must not partially overlap any of them.
unsafe fn fold_raw<K: Kern>(
    op: ReduceOp,
    out: *mut K,
    srcs: &[*const K],
    n: usize,
    avg_n: Option<usize>,
    stream: bool,
) {
    if K::NATIVE && srcs.len() >= 2 {
        // SAFETY: the caller's contract; `K::A` is `K` (NATIVE).
        unsafe { fold_native::<K::A>(op, out.cast(), srcs, n, avg_n, stream) };
        return;
    }
    let mut acc = [<K::A as Default>::default(); TILE];
    // The stored tile when streaming (`K::store` converts into it, then it is streamed out).
    let mut staged = stream.then(|| [K::zeroed(); TILE]);
    let mut off = 0;
    while off < n {
        let len = TILE.min(n - off);
        let acc = &mut acc[..len];
        for (i, src) in srcs.iter().enumerate() {
            // SAFETY: the caller guarantees `src` is valid for `n` reads; `off + len <= n`.
            let s = unsafe { std::slice::from_raw_parts(src.add(off), len) };
            if i == 0 {
                K::load(s, acc);
            } else {
                K::combine(s, acc, op);
            }
        }
        if let Some(d) = avg_n {
            for a in acc.iter_mut() {
                *a = K::A::div_n(*a, d);
            }
        }
        if let Some(staged) = staged.as_mut() {
            let tile = &mut staged[..len];
            K::store(acc, tile);
            // SAFETY: the caller guarantees `out` is valid for `n` writes; `tile` is ours.
            unsafe { stream_copy(out.add(off).cast(), tile.as_ptr().cast(), len * size_of::<K>()) };
        } else {
            // SAFETY: the caller guarantees `out` is valid for `n` writes; the source slices of
            // this tile are no longer used, so an `out` that aliases a source is fine.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.add(off), len) };
            K::store(acc, dst);
        }
        off += len;
    }
    if stream {
        store_fence();
    }
}

/// [`fold_raw`] for two or more sources of an element that is its own accumulator (`srcs` are
/// `A`s), a tile at a time: the first two sources in one pass into the tile, the middle ones
/// into it in place, the last one in one pass from the tile into `out` (or, with `stream`, into
/// the tile, which is then streamed out). Two sources without `stream`: one pass into `out`.
///
/// # Safety
/// As [`fold_raw`].
unsafe fn fold_native<A: Acc>(op: ReduceOp, out: *mut A, srcs: &[*const impl Sized], n: usize, avg_n: Option<usize>, stream: bool) {
    let src = |i: usize, off: usize| srcs[i].cast::<A>().wrapping_add(off);
    let last = srcs.len() - 1;
    if last == 1 && !stream {
        // SAFETY: the caller's contract.
        return unsafe { pair(op, out, src(0, 0), src(1, 0), n, avg_n) };
    }
    let mut tile = [A::default(); TILE];
    let t = tile.as_mut_ptr();
    let mut off = 0;
    while off < n {
        let len = TILE.min(n - off);
        // SAFETY: each source is valid for `off + len` reads and `out` for as many writes; the
        // tile is ours and holds `len`; the in-place folds alias it exactly, and `out` aliases at
        // most one source exactly, whose part at `off` was read before it is written.
        unsafe {
            let end = if stream { last + 1 } else { last };
            pair(op, t, src(0, off), src(1, off), len, avg_n.filter(|_| last == 1));
            for i in 2..end {
                pair(op, t, t, src(i, off), len, avg_n.filter(|_| i == last));
            }
            if stream {
                stream_copy(out.add(off).cast(), t.cast(), len * size_of::<A>());
            } else if last >= 2 {
                pair(op, out.add(off), t, src(last, off), len, avg_n);
            }
        }
        off += len;
    }
    if stream {
        store_fence();
    }
}

/// Copies `len` bytes from `src` to `dst` with streaming (non-temporal) stores where x86-64 has
/// them (the unaligned head and the tail under 64 bytes are plain copies; a plain copy off
/// x86-64). A streaming store skips the read-for-ownership of the line it fills: copying into a
/// destination that is in no cache moves half the bytes of a plain copy. The stores are weakly
/// ordered: [`store_fence`] before anything that publishes them.
///
/// # Safety
/// `dst` valid for `len` writes, `src` for `len` reads, not overlapping.
pub(crate) unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.align_offset(16).min(len);
        // SAFETY: the caller's bounds; `dst + head` is 16-aligned, so every `_mm_stream_si128`
        // target is aligned; SSE2 is part of the x86-64 baseline.
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            let (mut d, mut s) = (dst.add(head), src.add(head));
            let mut left = len - head;
            while left >= 64 {
                let a = _mm_loadu_si128(s as *const __m128i);
                let b = _mm_loadu_si128(s.add(16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(48) as *const __m128i);
                _mm_stream_si128(d as *mut __m128i, a);
                _mm_stream_si128(d.add(16) as *mut __m128i, b);
                _mm_stream_si128(d.add(32) as *mut __m128i, c);
                _mm_stream_si128(d.add(48) as *mut __m128i, e);
                d = d.add(64);
                s = s.add(64);
                left -= 64;
            }
            std::ptr::copy_nonoverlapping(s, d, left);
        }
        return;
    }
    // SAFETY: the caller's bounds.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Orders the streaming stores of [`stream_copy`] before later stores (a release included).
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Byte-level entry point: folds `srcs` (each `nbytes` long) into `out` in source order, writing
/// `out` with streaming stores when `stream` (for an output too big to stay in cache, which no
/// one reads right after: it costs no read-for-ownership then).
///
/// # Safety
/// As [`fold_raw`], with `nbytes` bytes per pointer; `nbytes` must be a multiple of the element
/// size; with `stream`, `out` aliases no source.
pub(crate) unsafe fn fold_bytes_to(
    dt: DType,
    op: ReduceOp,
    out: *mut u8,
    srcs: &[*const u8],
    nbytes: usize,
    avg_n: Option<usize>,
    stream: bool,
) -> Result<()> {
    let sz = dt.size();
    if !nbytes.is_multiple_of(sz) {
        return Err(CommError::InvalidArgument(format!(
            "{nbytes} bytes is not a whole number of {} elements",
            dt.name()
        )));
    }
    if !(out as usize).is_multiple_of(sz) || srcs.iter().any(|p| !(*p as usize).is_multiple_of(sz))
    {
        return Err(misaligned(dt.name()));
    }
    if srcs.is_empty() {
        return Ok(());
    }
    let n = nbytes / sz;
    macro_rules! go {
        ($t:ty) => {{
            let s: Vec<*const $t> = srcs.iter().map(|p| *p as *const $t).collect();
            // SAFETY: forwarded from the caller; alignment checked above.
            unsafe { fold_raw::<$t>(op, out as *mut $t, &s, n, avg_n, stream) }
        }};
    }
    match dt {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => go!(bf16),
        DType::F16 => go!(f16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        DType::U8 => go!(u8),
    }
    Ok(())
}

/// `acc = acc op x` elementwise.
pub(crate) fn fold_into(dt: DType, op: ReduceOp, acc: &mut [u8], x: &[u8]) -> Result<()> {
    fold_pair(dt, op, acc, x, None)
}

/// `acc = (acc + x) / n` for [`ReduceOp::Avg`] (the sum taken in f32 for 16-bit floats and
/// rounded once, so two f16 values whose sum passes 65504 still average right), `acc = acc ⊕ x`
/// for the other ops.
pub(crate) fn fold_into_avg(dt: DType, op: ReduceOp, acc: &mut [u8], x: &[u8], n: usize) -> Result<()> {
    match op {
        ReduceOp::Avg => fold_pair(dt, ReduceOp::Sum, acc, x, Some(n)),
        _ => fold_pair(dt, op, acc, x, None),
    }
}

fn fold_pair(dt: DType, op: ReduceOp, acc: &mut [u8], x: &[u8], avg_n: Option<usize>) -> Result<()> {
    if acc.len() != x.len() {
        return Err(CommError::InvalidArgument(format!(
            "reduce operands differ in length: {} vs {} bytes",
            acc.len(),
            x.len()
        )));
    }
    let p = acc.as_mut_ptr();
    // SAFETY: both slices are valid for their length; `out` aliases exactly source 0.
    unsafe { fold_bytes_to(dt, op, p, &[p as *const u8, x.as_ptr()], acc.len(), avg_n, false) }
}

/// Whether a staged average over `dt` (a ring, or the hierarchical stages, which fold partial
/// sums in the element type) scales every input by `1/n` first and then sums, as NCCL's
/// PreMulSum does: for f16, whose partial sums overflow (past 65504) where the mean does not.
pub(crate) fn premultiplies_avg(dt: DType) -> bool {
    dt == DType::F16
}

/// `out = fold(srcs in order)`, with the average applied once at the end when `avg_n` is given.
pub(crate) fn fold_many(
    dt: DType,
    op: ReduceOp,
    out: &mut [u8],
    srcs: &[&[u8]],
    avg_n: Option<usize>,
) -> Result<()> {
    if let Some(bad) = srcs.iter().find(|s| s.len() != out.len()) {
        return Err(CommError::InvalidArgument(format!(
            "reduce operands differ in length: {} vs {} bytes",
            bad.len(),
            out.len()
        )));
    }
    let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: `out` is exclusively borrowed, so it cannot overlap the shared source borrows.
    unsafe { fold_bytes_to(dt, op, out.as_mut_ptr(), &ptrs, out.len(), avg_n, false) }
}

/// `buf /= n` elementwise (the `Avg` finish step).
pub(crate) fn divide(dt: DType, buf: &mut [u8], n: usize) -> Result<()> {
    let p = buf.as_mut_ptr();
    // SAFETY: a fold of one source aliasing the output is a copy; the division is applied in place.
    unsafe { fold_bytes_to(dt, ReduceOp::Sum, p, &[p as *const u8], buf.len(), Some(n), false) }
}

/// A heap buffer aligned to 64 bytes, used as scratch space for received data.
pub(crate) struct AlignedBuf {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn new() -> Self {
        AlignedBuf {
            words: Vec::new(),
            len: 0,
        }
    }

    /// Resizes to `len` bytes (contents unspecified) and returns the bytes.
    pub(crate) fn get(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(64);
        if self.words.len() < words {
            self.words.resize(words, [0u64; 8]);
        }
        self.len = len;
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut self.words[..]);
        &mut bytes[..len]
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        let bytes: &[u8] = bytemuck::cast_slice(&self.words[..]);
        &bytes[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_many_orders_and_averages() {
        let a = [1.0f32, 5.0, -3.0];
        let b = [2.0f32, 1.0, 7.0];
        let mut out = [0f32; 3];
        fold_many(
            DType::F32,
            ReduceOp::Avg,
            bytemuck::cast_slice_mut(&mut out),
            &[bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)],
            Some(2),
        )
        .unwrap();
        assert_eq!(out, [1.5, 3.0, 2.0]);
        let mut m = a;
        fold_into(
            DType::F32,
            ReduceOp::Max,
            bytemuck::cast_slice_mut(&mut m),
            bytemuck::cast_slice(&b),
        )
        .unwrap();
        assert_eq!(m, [2.0, 5.0, 7.0]);
    }

    /// Every fold of f32 elements equals the element-by-element fold in source order, then the
    /// division: 2–5 sources, every op, averaged or not, streamed or not, lengths around the tile
    /// and the 16-element block, into a separate output or in place into each source in turn.
    #[test]
    fn native_folds_match_the_elementwise_fold_in_any_aliasing() {
        let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
        for k in 2..=5usize {
            for len in [0usize, 1, 15, 16, 17, 1023, 1024, 1025, 2100] {
                let srcs: Vec<Vec<f32>> = (0..k)
                    .map(|j| (0..len).map(|i| ((i * (j + 3)) % 17) as f32 * 0.37 - 2.0 + j as f32).collect())
                    .collect();
                for op in ops {
                    let avg = (op == ReduceOp::Avg).then_some(k);
                    let want: Vec<f32> = (0..len)
                        .map(|i| {
                            let mut a = srcs[0][i];
                            for s in &srcs[1..] {
                                a = match op {
                                    ReduceOp::Sum | ReduceOp::Avg => Acc::add(a, s[i]),
                                    ReduceOp::Max => Acc::max(a, s[i]),
                                    ReduceOp::Min => Acc::min(a, s[i]),
                                };
                            }
                            avg.map_or(a, |d| <f32 as Acc>::div_n(a, d))
                        })
                        .collect();
                    for stream in [false, true] {
                        // None: a separate output; Some(j): in place into source j (not streamed).
                        for into in std::iter::once(None).chain((0..k).filter(|_| !stream).map(Some)) {
                            let mut bufs = srcs.clone();
                            let mut sep = vec![0f32; len];
                            let ptrs: Vec<*const u8> = bufs.iter().map(|b| b.as_ptr().cast()).collect();
                            let out: *mut u8 = match into {
                                None => sep.as_mut_ptr().cast(),
                                Some(j) => bufs[j].as_mut_ptr().cast(),
                            };
                            // SAFETY: every pointer addresses `len` f32; `out` is disjoint or
                            // exactly one source.
                            unsafe { fold_bytes_to(DType::F32, op, out, &ptrs, len * 4, avg, stream).unwrap() };
                            let got = match into {
                                None => &sep,
                                Some(j) => &bufs[j],
                            };
                            assert!(
                                got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()),
                                "{k} sources, {len} elements, {op:?}, stream {stream}, into {into:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A fold written with streaming stores writes what a plain one does, at any alignment of
    /// the output and any length (heads, 64-byte blocks, tails, lengths under a store block,
    /// lengths past one tile), and nothing past its end.
    #[test]
    fn a_streamed_fold_writes_what_a_plain_one_does() {
        let mut compared = 0;
        for dt in [DType::F32, DType::BF16, DType::U8, DType::F64] {
            let sz = dt.size();
            for elems in [0usize, 1, 3, 63, 64, 65, 1023, 1024, 1025, 3000] {
                for shift in [0usize, 1, 3, 5] {
                    let len = elems * sz;
                    let a: Vec<u8> = (0..len).map(|i| (i * 7 % 13) as u8).collect();
                    let b: Vec<u8> = (0..len).map(|i| (i * 5 % 11) as u8).collect();
                    let mut plain = vec![0xAAu8; len + 16 * sz];
                    let mut streamed = plain.clone();
                    let off = shift * sz;
                    let srcs = [a.as_ptr(), b.as_ptr()];
                    // SAFETY: both outputs hold `off + len` bytes, element-aligned (Vec<u8> of a
                    // multiple of sz is not guaranteed aligned: checked below), disjoint from a, b.
                    let (p, q) = unsafe {
                        (
                            fold_bytes_to(dt, ReduceOp::Max, plain.as_mut_ptr().add(off), &srcs, len, None, false),
                            fold_bytes_to(dt, ReduceOp::Max, streamed.as_mut_ptr().add(off), &srcs, len, None, true),
                        )
                    };
                    match (p, q) {
                        (Ok(()), Ok(())) => {
                            assert!(plain == streamed, "{dt:?} {elems} elements at +{off}");
                            compared += 1;
                        }
                        // A byte vector's element alignment differs: both refuse the same way.
                        (Err(e), Err(f)) => assert_eq!(e.to_string(), f.to_string()),
                        (p, q) => panic!("{dt:?} {elems} elements: plain {p:?}, streamed {q:?}"),
                    }
                }
            }
        }
        // Only empty vectors (a dangling, byte-aligned pointer) may be refused.
        assert!(compared >= 144, "{compared} of 160 cases compared");
    }

    /// Max and Min give NaN when either side is NaN, so that ranks folding in different orders
    /// (the two-rank TCP exchange folds each block on another rank) agree.
    #[test]
    fn max_and_min_propagate_nan_from_either_side() {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            for (x, y) in [(1.0f32, f32::NAN), (f32::NAN, 1.0)] {
                let mut acc = [x];
                fold_into(DType::F32, op, bytemuck::cast_slice_mut(&mut acc), bytemuck::cast_slice(&[y])).unwrap();
                assert!(acc[0].is_nan(), "{op:?} of {x} and {y} gave {}", acc[0]);
            }
        }
    }

    #[test]
    fn half_accumulates_in_f32_and_rounds_once() {
        // 256 + 1 + 1 in bf16 step by step stays 256 (1 is below half an ulp); in f32 it is 258.
        let v: Vec<Vec<bf16>> = [256.0f32, 1.0, 1.0]
            .iter()
            .map(|x| vec![bf16::from_f32(*x); 2000])
            .collect();
        let srcs: Vec<&[u8]> = v.iter().map(|x| bytemuck::cast_slice(&x[..])).collect();
        let mut out = vec![bf16::ZERO; 2000];
        fold_many(
            DType::BF16,
            ReduceOp::Sum,
            bytemuck::cast_slice_mut(&mut out),
            &srcs,
            None,
        )
        .unwrap();
        assert!(out.iter().all(|x| x.to_f32() == 258.0));
    }

    #[test]
    fn integers_wrap_and_truncate() {
        let a = [250u8, 3];
        let b = [10u8, 4];
        let mut out = [0u8; 2];
        fold_many(DType::U8, ReduceOp::Avg, &mut out, &[&a, &b], Some(2)).unwrap();
        assert_eq!(out, [2, 3]);
        let mut i = [-7i64];
        divide(DType::I64, bytemuck::cast_slice_mut(&mut i), 2).unwrap();
        assert_eq!(i, [-3]);
    }
}
