//! What the benchmarks print about the machine they ran on, and the physical limits they compare
//! against, measured in the same run: the core's FMA peak, memcpy bandwidth, one loopback TCP
//! stream, and a two-way TCP exchange between two processes (a two-rank all_reduce's traffic).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rsrun_training_engine::native::isa::{Isa, isa};

/// The value of the first `key : value` line of `/proc/cpuinfo` whose key is exactly `key`,
/// with its whitespace runs collapsed to single spaces.
fn cpuinfo_field(info: &str, key: &str) -> Option<String> {
    info.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim() == key)
        .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The CPU model name (`/proc/cpuinfo`), or "unknown".
pub fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo_field(&info, "model name").unwrap_or_else(|| "unknown".into())
}

/// The CPU's `cpu family` and `model` numbers (`/proc/cpuinfo`), which name the
/// microarchitecture where a virtual machine's model name does not (an "AMD EPYC" of family 23
/// is Zen 1 or Zen 2, of family 25 Zen 3 or Zen 4); "?" for a missing one.
pub fn cpu_family_model() -> (String, String) {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key| cpuinfo_field(&info, key).unwrap_or_else(|| "?".into());
    (field("cpu family"), field("model"))
}

/// One line for a benchmark's output: CPU model (with its family and model numbers), the SIMD
/// level the kernels run at, and the best one the CPU has (they differ when `RSRUN_ISA` forces
/// a lower level).
pub fn describe() -> String {
    let (family, model) = cpu_family_model();
    let mut s = format!(
        "machine: cpu=\"{}\" family={family} model={model} isa={} isa_detected={} cores={}",
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
    let (b, c) = (
        std::hint::black_box(0.999_999f32),
        std::hint::black_box(1e-7f32),
    );
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
/// copies of `bytes` on each kind of [`Pages`] (pages touched beforehand).
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let mut best = f64::MAX;
    for pages in Pages::ALL {
        let src = PageBuf::new(bytes, 1, pages);
        let mut dst = PageBuf::new(bytes, 0, pages);
        for _ in 0..5 {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst[..]);
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    2.0 * bytes as f64 / best / 1e9
}

/// Single-thread bandwidth of an in-place fold (`a[i] += b[i]` over two buffers of `bytes`, as a
/// reduction folds a peer's data into its own) in GB/s counting bytes read plus bytes written
/// (3 × `bytes`), best of a few folds on each kind of [`Pages`]. Its writes go to lines it just
/// read, so it pays no read-for-ownership; a memcpy's writes to lines it never read do, which
/// left memcpy's figure below what an in-place collective moves (its all_reduce ran at 1.1–1.2×
/// a memcpy "bound"). A memory-bound op's limit is the better of the two.
pub fn fold_gbps(bytes: usize) -> f64 {
    let mut best = f64::MAX;
    for pages in Pages::ALL {
        let mut a = PageBuf::new(bytes, 1, pages);
        let b = PageBuf::new(bytes, 2, pages);
        for _ in 0..5 {
            let t = Instant::now();
            fold_into(&mut a, std::hint::black_box(&b));
            std::hint::black_box(&a[..]);
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    3.0 * bytes as f64 / best / 1e9
}

/// `a[i] += b[i]` over 8-byte words (integer adds: the values do not matter, the traffic does).
fn fold_into(a: &mut [u8], b: &[u8]) {
    for (x, y) in a.chunks_exact_mut(8).zip(b.chunks_exact(8)) {
        let (Ok(xa), Ok(ya)) = (<[u8; 8]>::try_from(&x[..]), <[u8; 8]>::try_from(y)) else { continue };
        x.copy_from_slice(&u64::from_ne_bytes(xa).wrapping_add(u64::from_ne_bytes(ya)).to_ne_bytes());
    }
}

/// The memory limit of an op over a footprint of `2 × half` bytes, GB/s read + written: the
/// better of a memcpy of `half` into `half` and an in-place fold of `half` into `half`.
pub fn memory_gbps(half: usize) -> (f64, f64) {
    (memcpy_gbps(half), fold_gbps(half))
}

/// Where a limit's buffers come from. The kernel copies TCP payloads to and from user pages,
/// and what backs those pages moves the figures both ways (on a 2-vCPU Zen 3, huge pages ran a
/// two-way 64 MiB exchange at 2.2–2.7 GB/s each way against 0.9–1.2 on 4 KiB pages, while one
/// stream out of a 4 MiB buffer was faster on 4 KiB pages), so every limit is measured on both
/// and the better counts: a limit must not be lowered by the choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pages {
    /// The global allocator: rsrun's huge-page allocator where the binary installs it.
    Global,
    /// The system allocator (`malloc`): whatever pages the kernel hands out.
    System,
}

impl Pages {
    /// Both kinds.
    pub const ALL: [Pages; 2] = [Pages::System, Pages::Global];
}

/// A byte buffer from the allocator `Pages` names, every byte set (pages touched).
pub struct PageBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
    pages: Pages,
}

impl PageBuf {
    /// `len` bytes set to `fill`.
    ///
    /// # Panics
    /// When `len` exceeds `isize::MAX` (no buffer can be that large).
    pub fn new(len: usize, fill: u8, pages: Pages) -> Self {
        use std::alloc::GlobalAlloc;
        let layout = match std::alloc::Layout::from_size_align(len.max(1), 64) {
            Ok(l) => l,
            Err(_) => panic!("a {len}-byte buffer is larger than isize::MAX"),
        };
        // SAFETY: the layout has a non-zero size.
        let p = unsafe {
            match pages {
                Pages::Global => std::alloc::alloc(layout),
                Pages::System => std::alloc::System.alloc(layout),
            }
        };
        let Some(ptr) = std::ptr::NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: `ptr` points to `layout.size()` writable bytes.
        unsafe { ptr.as_ptr().write_bytes(fill, layout.size()) };
        PageBuf { ptr, layout, pages }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` owns `layout.size()` initialised bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        use std::alloc::GlobalAlloc;
        // SAFETY: allocated with this layout by the allocator `pages` names, freed once.
        unsafe {
            match self.pages {
                Pages::Global => std::alloc::dealloc(self.ptr.as_ptr(), self.layout),
                Pages::System => std::alloc::System.dealloc(self.ptr.as_ptr(), self.layout),
            }
        }
    }
}

/// One TCP stream over loopback: GB/s of `bytes` sent from a writer thread's 4 MiB buffer to a
/// reader's, best of three runs on each kind of [`Pages`].
///
/// # Errors
/// Socket errors.
pub fn loopback_tcp_gbps(bytes: usize) -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut best = 0f64;
    for pages in Pages::ALL {
        for _ in 0..3 {
            let writer = std::thread::spawn(move || -> std::io::Result<()> {
                let mut s = TcpStream::connect(addr)?;
                s.set_nodelay(true)?;
                let buf = PageBuf::new(4 << 20, 7, pages);
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(buf.len());
                    s.write_all(&buf[..n])?;
                    left -= n;
                }
                Ok(())
            });
            let (mut r, _) = listener.accept()?;
            let mut buf = PageBuf::new(4 << 20, 0, pages);
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
    }
    Ok(best)
}

/// Most bytes one `write` of [`tcp_exchange_secs`] hands over, as the TCP backend's two-way
/// exchange does (it alternates writes and reads in steps this size).
const EXCHANGE_BURST: usize = 256 << 10;

/// Sends `tx` and receives `rx.len()` bytes into `rx` at once over `s` (switched to
/// non-blocking here): writes of at most 256 KiB alternate with reads of whatever arrived, and
/// `poll` waits when neither can move. Returns the seconds it took. Run by two processes at
/// once, one at each end of a connection, this moves a two-rank all_reduce's traffic (each rank
/// sends and receives the buffer's size, however the op is scheduled) with nothing else to do:
/// no reduction and no ordering between the directions, so a TCP all_reduce on the same host
/// cannot beat it. (Between two threads of one process the same exchange ran at less than half
/// the speed here, so it is measured between the ranks' processes.)
///
/// # Errors
/// Socket errors, the peer closing early, or the exchange still unfinished after 60 s.
pub fn tcp_exchange_secs(mut s: &TcpStream, tx: &[u8], rx: &mut [u8]) -> std::io::Result<f64> {
    use std::io::ErrorKind::{Interrupted, WouldBlock};
    use std::os::fd::AsRawFd;
    s.set_nodelay(true)?;
    s.set_nonblocking(true)?;
    let t = Instant::now();
    let deadline = t + Duration::from_secs(60);
    let (mut sent, mut got) = (0, 0);
    while sent < tx.len() || got < rx.len() {
        let mut moved = false;
        if sent < tx.len() {
            match s.write(&tx[sent..(sent + EXCHANGE_BURST).min(tx.len())]) {
                Ok(n) => {
                    sent += n;
                    moved |= n > 0;
                }
                Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
        if got < rx.len() {
            match s.read(&mut rx[got..]) {
                Ok(0) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "tcp exchange: the peer closed after {got} of {} bytes",
                            rx.len()
                        ),
                    ));
                }
                Ok(n) => {
                    got += n;
                    moved = true;
                }
                Err(e) if matches!(e.kind(), WouldBlock | Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
        if !moved {
            if Instant::now() > deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "tcp exchange: {sent} bytes sent and {got} received of {} after 60 s",
                        tx.len()
                    ),
                ));
            }
            let mut fd = libc::pollfd {
                fd: s.as_raw_fd(),
                events: if sent < tx.len() { libc::POLLOUT } else { 0 }
                    | if got < rx.len() { libc::POLLIN } else { 0 },
                revents: 0,
            };
            // SAFETY: one valid pollfd on our stack; the count matches.
            unsafe { libc::poll(&mut fd, 1, 100) };
        }
    }
    Ok(t.elapsed().as_secs_f64())
}
