//! Shared test helpers: thread groups, reference values, element conversions.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use half::{bf16, f16};
use rsrun_training_engine::comm::{
    BackendKind, CommOptions, Element, LocalStore, ProcessGroup, ReduceOp, Result,
};

/// Element types with exact conversions from small integers.
pub(crate) trait TestElem: Element + PartialEq + Debug {
    fn from_f64(x: f64) -> Self;
    /// The kernel's `Avg` of an exactly representable sum.
    fn avg_of(sum: f64, n: usize) -> Self;
    /// Whether `got` is an `Avg` over `n` ranks of `want`'s value: exact, but for f16, whose
    /// staged backends scale each input by 1/n before summing (NCCL's PreMulSum: sums of f16
    /// overflow where means do not), a rounding per rank.
    fn avg_close(got: &Self, want: &Self, _n: usize) -> bool {
        got == want
    }
}

/// `got == want` for every op but f16's `Avg` ([`TestElem::avg_close`]).
fn reduce_matches<T: TestElem>(got: &[T], want: &[T], op: ReduceOp, n: usize) -> bool {
    match op {
        ReduceOp::Avg => got.len() == want.len() && got.iter().zip(want).all(|(g, w)| T::avg_close(g, w, n)),
        _ => got == want,
    }
}

macro_rules! float_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn avg_of(sum: f64, n: usize) -> Self {
                (sum as $t) / (n as $t)
            }
        }
    };
}
float_elem!(f32);
float_elem!(f64);

macro_rules! int_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn avg_of(sum: f64, n: usize) -> Self {
                ((sum as i64) / n as i64) as $t
            }
        }
    };
}
int_elem!(i32);
int_elem!(i64);
int_elem!(u8);

macro_rules! half_elem {
    ($t:ty) => {
        impl TestElem for $t {
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
            fn avg_of(sum: f64, n: usize) -> Self {
                <$t>::from_f32(sum as f32 / n as f32)
            }
        }
    };
}
half_elem!(bf16);

impl TestElem for f16 {
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn avg_of(sum: f64, n: usize) -> Self {
        f16::from_f32(sum as f32 / n as f32)
    }
    fn avg_close(got: &Self, want: &Self, n: usize) -> bool {
        // Within one f16 ulp of the mean (at least 1's) per rank.
        let (g, w) = (got.to_f32(), want.to_f32());
        let ulp = w.abs().max(1.0) / 1024.0;
        (g - w).abs() <= ulp * n as f32
    }
}

/// Input value of `rank` at index `i`: small non-negative integers, exact in every dtype, and
/// sums over 4 ranks stay exact too.
pub(crate) fn val(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64
}

pub(crate) fn input<T: TestElem>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::from_f64(val(rank, i))).collect()
}

pub(crate) fn expected_reduce<T: TestElem>(
    world: usize,
    len: usize,
    op: ReduceOp,
    at: impl Fn(usize) -> usize,
) -> Vec<T> {
    (0..len)
        .map(|i| {
            let vals: Vec<f64> = (0..world).map(|r| val(r, at(i))).collect();
            match op {
                ReduceOp::Sum => T::from_f64(vals.iter().sum()),
                ReduceOp::Avg => T::avg_of(vals.iter().sum(), world),
                ReduceOp::Max => T::from_f64(vals.iter().cloned().fold(f64::MIN, f64::max)),
                ReduceOp::Min => T::from_f64(vals.iter().cloned().fold(f64::MAX, f64::min)),
            }
        })
        .collect()
}

pub(crate) fn unique_prefix(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// Options for a forced backend; hierarchical groups simulate two hosts (rank parity).
pub(crate) fn opts_for(kind: BackendKind, rank: usize) -> CommOptions {
    let mut o = CommOptions {
        backend: kind,
        timeout: Duration::from_secs(60),
        // Small chunks and segments so that modest sizes exercise the multi-chunk paths.
        shm_chunk_bytes: 64 << 10,
        shm_small_bytes: 4 << 10,
        tcp_small_bytes: 4 << 10,
        tcp_segment_bytes: 16 << 10,
        ..CommOptions::default()
    };
    if kind == BackendKind::Hierarchical {
        o.host_identity = Some(format!("simulated-host-{}", rank % 2));
    }
    o
}

/// Runs `f` on `world` threads, each with its own group member; returns each rank's result.
pub(crate) fn run_threads<R: Send + 'static>(
    world: usize,
    opts: impl Fn(usize) -> CommOptions,
    f: impl Fn(ProcessGroup) -> Result<R> + Send + Sync + 'static,
) -> Vec<Result<R>> {
    let store = Arc::new(LocalStore::new());
    let prefix = unique_prefix("t");
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, prefix, f, o) = (store.clone(), prefix.clone(), f.clone(), opts(rank));
            std::thread::spawn(move || {
                let pg = ProcessGroup::new(rank, world, store, &prefix, o)?;
                f(pg)
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Checks every op on `pg` for dtype `T` and each length in `lens` against the reference.
pub(crate) fn check_ops<T: TestElem>(pg: &ProcessGroup, lens: &[usize]) -> Result<()> {
    let (r, n) = (pg.rank(), pg.world_size());
    for &len in lens {
        let ctx = |what: &str| {
            format!(
                "{what} dtype={} len={len} world={n} rank={r} backend={}",
                std::any::type_name::<T>(),
                pg.backend()
            )
        };
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut buf = input::<T>(r, len);
            pg.all_reduce(&mut buf, op)?;
            let want = expected_reduce::<T>(n, len, op, |i| i);
            assert!(reduce_matches(&buf, &want, op, n), "{}: got {buf:?}, want {want:?}", ctx(&format!("all_reduce {op:?}")));
        }
        let root = len % n;
        let mut buf = input::<T>(r, len);
        pg.broadcast(&mut buf, root)?;
        assert_eq!(buf, input::<T>(root, len), "{}", ctx("broadcast"));

        let root = (len + 1) % n;
        let mut buf = input::<T>(r, len);
        pg.reduce(&mut buf, ReduceOp::Sum, root)?;
        let want = if r == root {
            expected_reduce::<T>(n, len, ReduceOp::Sum, |i| i)
        } else {
            input::<T>(r, len)
        };
        assert_eq!(buf, want, "{}", ctx("reduce"));

        let inp = input::<T>(r, len);
        let mut out = vec![T::from_f64(0.0); len * n];
        pg.all_gather(&inp, &mut out)?;
        let want: Vec<T> = (0..n).flat_map(|j| input::<T>(j, len)).collect();
        assert_eq!(out, want, "{}", ctx("all_gather"));

        let inp = input::<T>(r, len * n);
        let mut out = vec![T::from_f64(0.0); len];
        pg.reduce_scatter(&inp, &mut out, ReduceOp::Sum)?;
        assert_eq!(
            out,
            expected_reduce::<T>(n, len, ReduceOp::Sum, |i| r * len + i),
            "{}",
            ctx("reduce_scatter")
        );
        let mut out = vec![T::from_f64(0.0); len];
        pg.reduce_scatter(&inp, &mut out, ReduceOp::Max)?;
        assert_eq!(
            out,
            expected_reduce::<T>(n, len, ReduceOp::Max, |i| r * len + i),
            "{}",
            ctx("reduce_scatter max")
        );

        if n > 1 {
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let mine = input::<T>(r, len);
            let mut got = vec![T::from_f64(0.0); len];
            if r % 2 == 0 {
                pg.send(&mine, next)?;
                pg.recv(&mut got, prev)?;
            } else {
                pg.recv(&mut got, prev)?;
                pg.send(&mine, next)?;
            }
            assert_eq!(got, input::<T>(prev, len), "{}", ctx("send/recv"));
        }
        pg.barrier()?;
    }
    Ok(())
}

/// The whole dtype matrix.
pub(crate) fn check_all_dtypes(pg: &ProcessGroup, lens: &[usize]) -> Result<()> {
    check_ops::<f32>(pg, lens)?;
    check_ops::<f64>(pg, lens)?;
    check_ops::<bf16>(pg, lens)?;
    check_ops::<f16>(pg, lens)?;
    check_ops::<i32>(pg, lens)?;
    check_ops::<i64>(pg, lens)?;
    check_ops::<u8>(pg, lens)?;
    Ok(())
}
