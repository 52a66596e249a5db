//! What the benchmarks print about the machine they ran on, and the physical limits they compare
//! against, measured in the same run: the core's FMA peak, memcpy bandwidth, one loopback TCP
//! stream.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rsrun_training_engine::native::isa::{Isa, isa};

/// The CPU model name (`/proc/cpuinfo`), or "unknown".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| "unknown".into())
}

/// One line for a benchmark's output: CPU model, the SIMD level the kernels run at, and the
/// best one the CPU has (they differ when `RSRUN_ISA` forces a lower level).
pub fn describe() -> String {
    let mut s = format!(
        "machine: cpu=\"{}\" isa={} isa_detected={} cores={}",
        cpu_model(),
        isa().name(),
        Isa::detected().name(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if let Some(note) = Isa::forced_note() {
        s += &format!(" note=\"{note}\"");
    }
    s
}

/// Single-thread f32 FMA peak at `level` in GFLOP/s: twelve independent chains of fused
/// multiply-adds on full vectors (enough to cover the latency of two FMA pipes), for about
/// `dur`.
pub fn fma_peak_gflops(level: Isa, dur: Duration) -> f64 {
    let iters = 1_000_000;
    let mut best = 0f64;
    let start = Instant::now();
    while start.elapsed() < dur {
        let t = Instant::now();
        let (lanes, sink) = fma_loop(level, iters);
        std::hint::black_box(sink);
        let s = t.elapsed().as_secs_f64();
        best = best.max((iters * 12 * lanes * 2) as f64 / s / 1e9);
    }
    best
}

fn fma_loop(level: Isa, iters: usize) -> (usize, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the level is supported (`isa()` and `Isa::detected()` never exceed the CPU).
        match level {
            Isa::Avx512 if level <= Isa::detected() => return (16, unsafe { fma512(iters) }),
            Isa::Avx2 if level <= Isa::detected() => return (8, unsafe { fma256(iters) }),
            _ => {}
        }
    }
    // Baseline: four-lane SSE multiply and add (no FMA), counted as two flops per lane.
    let mut a = [[1.0f32; 4]; 12];
    let (b, c) = (std::hint::black_box(0.999_999f32), std::hint::black_box(1e-7f32));
    for _ in 0..iters {
        for v in a.iter_mut() {
            for x in v.iter_mut() {
                *x = *x * b + c;
            }
        }
    }
    (4, a.iter().flatten().sum())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn fma512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_set1_ps(1.0); 12];
    let b = _mm512_set1_ps(std::hint::black_box(0.999_999));
    let c = _mm512_set1_ps(std::hint::black_box(1e-7));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, b, c);
        }
    }
    a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma256(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_set1_ps(1.0); 12];
    let b = _mm256_set1_ps(std::hint::black_box(0.999_999));
    let c = _mm256_set1_ps(std::hint::black_box(1e-7));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, b, c);
        }
    }
    let mut out = [0f32; 8];
    let mut s = _mm256_setzero_ps();
    for v in a {
        s = _mm256_add_ps(s, v);
    }
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

/// Single-thread memcpy bandwidth in GB/s counting bytes read plus bytes written, best of a few
/// copies of `bytes` (pages touched beforehand).
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * bytes as f64 / best / 1e9
}

/// One TCP stream over loopback: GB/s of `bytes` sent from a writer thread to a reader, best
/// of three runs.
///
/// # Errors
/// Socket errors.
pub fn loopback_tcp_gbps(bytes: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut best = 0f64;
    for _ in 0..3 {
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            let mut s = TcpStream::connect(addr)?;
            s.set_nodelay(true)?;
            let buf = vec![7u8; 4 << 20];
            let mut left = bytes;
            while left > 0 {
                let n = left.min(buf.len());
                s.write_all(&buf[..n])?;
                left -= n;
            }
            Ok(())
        });
        let (mut r, _) = listener.accept()?;
        let mut buf = vec![0u8; 4 << 20];
        let t = Instant::now();
        let mut got = 0;
        while got < bytes {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        let s = t.elapsed().as_secs_f64();
        writer
            .join()
            .map_err(|_| std::io::Error::other("loopback writer panicked"))??;
        best = best.max(got as f64 / s / 1e9);
    }
    Ok(best)
}
