//! Where the native path's matrix products spend their time: an opt-in per-shape profile, in
//! the spirit of DeepSpeed's flops profiler, for finding which products hold model FLOPs
//! utilization down.
//!
//! While [`enable`]d on a thread, every product that thread runs through the native gemm adds
//! its wall time and FLOPs to the entry of its shape (`m×n×k`, causal pattern, operand
//! layouts); [`take`] returns the entries and clears them. Disabled, a product pays one
//! thread-local flag read. The native path computes on the thread that calls the engine's
//! step, so enabling the profile there covers every product of the step.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::time::Duration;

/// How an operand is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Unit column stride: rows are contiguous.
    RowMajor,
    /// Unit row stride: columns are contiguous (a transposed operand such as `dyᵀ`).
    ColMajor,
    /// Neither stride is 1.
    Strided,
}

impl Layout {
    pub(crate) fn of(rs: usize, cs: usize) -> Layout {
        if cs == 1 {
            Layout::RowMajor
        } else if rs == 1 {
            Layout::ColMajor
        } else {
            Layout::Strided
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::RowMajor => "row",
            Layout::ColMajor => "col",
            Layout::Strided => "strided",
        })
    }
}

/// The products of one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct GemmStat {
    /// Rows of the result.
    pub m: usize,
    /// Columns of the result.
    pub n: usize,
    /// The summed dimension.
    pub k: usize,
    /// `full`, or the causal pattern: `lower-out` (only `j ≤ i` is computed), `lower-lhs` /
    /// `upper-lhs` (a triangular left operand).
    pub pattern: &'static str,
    /// Layout of the left operand.
    pub lhs: Layout,
    /// Layout of the right operand.
    pub rhs: Layout,
    /// Products run.
    pub calls: u64,
    /// Their wall time.
    pub time: Duration,
    /// Their FLOPs counted as full products (`2·m·n·k` each, causal ones included, as model
    /// FLOPs count attention).
    pub flops: f64,
}

impl GemmStat {
    /// FLOPs per second of wall time (0 when no time was measured).
    pub fn flops_per_s(&self) -> f64 {
        let s = self.time.as_secs_f64();
        if s > 0.0 { self.flops / s } else { 0.0 }
    }
}

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(false) };
    static STATS: RefCell<Vec<GemmStat>> = const { RefCell::new(Vec::new()) };
}

/// Starts (`true`) or stops (`false`) profiling the products this thread runs. Entries
/// gathered so far stay until [`take`].
pub fn enable(on: bool) {
    ENABLED.with(|e| e.set(on));
}

/// Whether this thread profiles its products.
pub fn enabled() -> bool {
    ENABLED.with(Cell::get)
}

/// This thread's entries, most time first, and clears them.
pub fn take() -> Vec<GemmStat> {
    let mut v = STATS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    v.sort_by_key(|e| std::cmp::Reverse(e.time));
    v
}

/// Adds one product to its shape's entry.
pub(crate) fn record((m, n, k): (usize, usize, usize), pattern: &'static str, lhs: Layout, rhs: Layout, time: Duration) {
    let flops = 2.0 * (m as f64) * (n as f64) * (k as f64);
    STATS.with(|s| {
        let mut s = s.borrow_mut();
        let key = |e: &GemmStat| (e.m, e.n, e.k, e.pattern, e.lhs, e.rhs) == (m, n, k, pattern, lhs, rhs);
        match s.iter_mut().find(|e| key(e)) {
            Some(e) => {
                e.calls += 1;
                e.time += time;
                e.flops += flops;
            }
            None => s.push(GemmStat {
                m,
                n,
                k,
                pattern,
                lhs,
                rhs,
                calls: 1,
                time,
                flops,
            }),
        }
    });
}

/// GFLOP/s of the microkernel at `level` with its operands in L1 (the ceiling of any product
/// at that level, next to the FMA peak), measured for at least `dur`; `None` when the CPU does
/// not support `level`.
pub fn kernel_hot_gflops(level: super::isa::Isa, dur: Duration) -> Option<f64> {
    (level <= super::isa::Isa::detected()).then(|| super::gemm::kernel_hot_gflops(level, dur))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::native::gemm::{Mat, Shape, gemm_at};
    use crate::native::isa::Isa;

    /// `c (m×n) = a·b` at the baseline level, `a` row-major or transposed in place.
    fn product((m, n, k): (usize, usize, usize), a_col_major: bool, shape: Shape) {
        let a = vec![1f32; m * k];
        let b = vec![2f32; k * n];
        let mut c = vec![0f32; m * n];
        let lhs = if a_col_major {
            Mat {
                ptr: a.as_ptr(),
                rs: 1,
                cs: m,
            }
        } else {
            Mat {
                ptr: a.as_ptr(),
                rs: k,
                cs: 1,
            }
        };
        // SAFETY: the operands hold their matrices under these strides; c is separate.
        unsafe {
            gemm_at(
                Isa::Baseline,
                (m, n, k),
                c.as_mut_ptr(),
                n,
                false,
                lhs,
                Mat {
                    ptr: b.as_ptr(),
                    rs: n,
                    cs: 1,
                },
                shape,
            )
        };
        assert_eq!(c[0], 2.0 * k as f32, "the product itself still runs");
    }

    #[test]
    fn each_shape_gets_its_calls_flops_and_time_and_nothing_is_kept_while_disabled() {
        take();
        product((8, 8, 8), false, Shape::Full);
        assert!(!enabled());
        assert!(take().is_empty(), "a disabled thread records nothing");

        enable(true);
        product((30, 20, 10), false, Shape::Full);
        product((30, 20, 10), false, Shape::Full);
        product((30, 20, 10), true, Shape::Full);
        product((16, 16, 4), false, Shape::LowerOut);
        enable(false);
        product((30, 20, 10), false, Shape::Full);

        let stats = take();
        assert_eq!(stats.len(), 3, "{stats:?}");
        let find = |pattern: &str, lhs: Layout| stats.iter().find(|s| s.pattern == pattern && s.lhs == lhs).unwrap();
        let row = find("full", Layout::RowMajor);
        assert_eq!((row.m, row.n, row.k, row.rhs, row.calls), (30, 20, 10, Layout::RowMajor, 2));
        assert_eq!(row.flops, 2.0 * 2.0 * 30.0 * 20.0 * 10.0);
        assert_eq!(find("full", Layout::ColMajor).calls, 1);
        let causal = find("lower-out", Layout::RowMajor);
        assert_eq!(
            (causal.calls, causal.flops),
            (1, 2.0 * 16.0 * 16.0 * 4.0),
            "causal products count as full ones"
        );
        assert!(stats.windows(2).all(|w| w[0].time >= w[1].time), "most time first");
        assert!(stats.iter().all(|s| s.time > Duration::ZERO && s.flops_per_s() > 0.0));
        assert!(take().is_empty(), "take clears");
    }

    #[test]
    fn layouts_and_the_hot_kernel_rate() {
        assert_eq!(Layout::of(7, 1), Layout::RowMajor);
        assert_eq!(Layout::of(1, 7), Layout::ColMajor);
        assert_eq!(Layout::of(3, 7), Layout::Strided);
        assert_eq!(Layout::ColMajor.to_string(), "col");
        for level in [Isa::Baseline, Isa::Avx2, Isa::Avx512] {
            let rate = kernel_hot_gflops(level, Duration::from_millis(5));
            if level <= Isa::detected() {
                let r = rate.unwrap();
                assert!(r.is_finite() && r > 0.0, "{level:?}: {r}");
            } else {
                assert_eq!(rate, None, "{level:?} is not supported here");
            }
        }
    }
}
