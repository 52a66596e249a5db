//! Measurements for `engine-bench`: plain O_DIRECT bandwidth against the offload engine on the
//! same file size and disk, and the optimizer step with the state in memory or on NVMe.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::{Dir, IoEngine, Job, Lease, Span};
use super::{AlignedBuf, CpuStore, EngineKind, NvmeConfig, NvmeStore, OffloadError, round_up};
use crate::error::{EngineError, EngineResult};
use crate::layout::{OptimStateStore, StepParams, TileOptimizer};

/// Bandwidth of plain synchronous O_DIRECT I/O (`dd oflag=direct`/`iflag=direct` style: one
/// `block_size` request at a time) against the offload engine on the same file.
#[derive(Debug, Clone, PartialEq)]
pub struct BandwidthReport {
    pub bytes: u64,
    pub block_size: usize,
    pub queue_depth: usize,
    pub engine: EngineKind,
    /// Bytes per second.
    pub plain_write: f64,
    pub plain_read: f64,
    pub engine_write: f64,
    pub engine_read: f64,
}

impl BandwidthReport {
    /// `engine / plain` for writes and reads.
    pub fn ratios(&self) -> (f64, f64) {
        (
            self.engine_write / self.plain_write,
            self.engine_read / self.plain_read,
        )
    }
}

fn io_err(op: &'static str, path: &Path, source: std::io::Error) -> OffloadError {
    OffloadError::Io {
        op,
        path: path.to_path_buf(),
        offset: 0,
        source,
    }
}

/// Measures plain O_DIRECT and engine bandwidth on a `bytes`-sized file in `dir` (best of
/// `repeats` runs each); each engine transfer may take at most `io_timeout`. The file is
/// removed afterwards.
///
/// # Errors
/// Any I/O error, naming the file; [`OffloadError::TimedOut`] for a transfer past
/// `io_timeout`; [`OffloadError::InvalidArgument`] for an `io_timeout` out of range.
pub fn measure_bandwidth(
    dir: &Path,
    bytes: usize,
    block_size: usize,
    queue_depth: usize,
    engine: Option<EngineKind>,
    repeats: usize,
    io_timeout: Duration,
) -> Result<BandwidthReport, OffloadError> {
    let bytes = round_up(bytes);
    // A new file of our own (exclusive, no symlink followed, 0600; a taken name gets a random
    // suffix), unlinked at once: two jobs with equal pids on a shared path never share it, and
    // a killed run leaves nothing behind.
    let (file, _direct, path) = super::nvme::open_swap(&dir.join(format!("rsrun-bw-{}.bin", std::process::id())))?;
    let _ = std::fs::remove_file(&path);
    let file = Arc::new(file);
    let fd = file.as_raw_fd();
    let mut buf = AlignedBuf::zeroed(bytes / 4)?;
    for (i, x) in buf.iter_mut().enumerate() {
        *x = i as f32;
    }
    let eng = IoEngine::start(engine, block_size, queue_depth, io_timeout)?;
    let shared_path: Arc<Path> = path.clone().into();
    let (mut pw, mut pr, mut ew, mut er) = (f64::MAX, f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..repeats.max(1) {
        // Plain: one block at a time.
        let t = Instant::now();
        plain(fd, &mut buf, block_size, Dir::Write).map_err(|e| io_err("write", &path, e))?;
        pw = pw.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        plain(fd, &mut buf, block_size, Dir::Read).map_err(|e| io_err("read", &path, e))?;
        pr = pr.min(t.elapsed().as_secs_f64());
        for dir in [Dir::Write, Dir::Read] {
            // The job owns the buffer (and the file) until it is done: a wait that times out
            // leaves them to it.
            let job = Job {
                phases: vec![vec![Span {
                    offset: 0,
                    at: 0,
                    len: bytes,
                    dir,
                }]],
                path: shared_path.clone(),
                lease: Lease {
                    buf,
                    file: file.clone(),
                },
            };
            let t = Instant::now();
            let (result, lease) = eng.submit(job).wait();
            let s = t.elapsed().as_secs_f64();
            result?;
            let Some(lease) = lease else {
                return Err(OffloadError::Engine("a completed job did not hand its buffer back".into()));
            };
            buf = lease.buf;
            match dir {
                Dir::Write => ew = ew.min(s),
                Dir::Read => er = er.min(s),
            }
        }
    }
    let b = bytes as f64;
    Ok(BandwidthReport {
        bytes: bytes as u64,
        block_size,
        queue_depth,
        engine: eng.kind(),
        plain_write: b / pw,
        plain_read: b / pr,
        engine_write: b / ew,
        engine_read: b / er,
    })
}

fn plain(fd: i32, buf: &mut AlignedBuf, block: usize, dir: Dir) -> std::io::Result<()> {
    let total = buf.capacity_bytes();
    let base = buf.as_mut_ptr();
    let mut off = 0usize;
    while off < total {
        let len = block.min(total - off);
        // SAFETY: `base + off .. + len` is inside `buf`'s allocation.
        let n = unsafe {
            let p = base.add(off);
            match dir {
                Dir::Write => libc::pwrite(fd, p.cast(), len, off as libc::off_t),
                Dir::Read => libc::pread(fd, p.cast(), len, off as libc::off_t),
            }
        };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if n <= 0 {
            return Err(if n == 0 {
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short transfer")
            } else {
                std::io::Error::last_os_error()
            });
        }
        off += n as usize;
    }
    Ok(())
}

/// Times of one AdamW step over `elems` elements of optimizer state.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    pub elems: usize,
    /// Seconds per step with the state in the host tier.
    pub cpu_step: f64,
    /// Seconds per step with the state on NVMe.
    pub nvme_step: f64,
    /// Seconds per NVMe step the caller waited on I/O.
    pub nvme_io_wait: f64,
    /// Bytes moved per NVMe step (read + write) divided by `nvme_step`.
    pub nvme_bandwidth: f64,
    /// Host bytes of the CPU store and of the NVMe store (staging buffers).
    pub cpu_host_bytes: usize,
    pub nvme_host_bytes: usize,
    pub describe: String,
}

/// Runs `steps` AdamW steps over `units` units of `elems_per_unit` elements with the state in a
/// [`CpuStore`] and in an [`NvmeStore`] built from `cfg`, checks that the results are bitwise
/// equal, and reports the median time per step.
///
/// # Errors
/// I/O errors, or [`EngineError::Offload`] if the results differ.
pub fn measure_step(
    units: usize,
    elems_per_unit: usize,
    cfg: &NvmeConfig,
    steps: usize,
) -> EngineResult<StepReport> {
    let lens = vec![elems_per_unit; units];
    let init: Vec<f32> = (0..elems_per_unit)
        .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
        .collect();
    let grad: Vec<f32> = (0..elems_per_unit)
        .map(|i| ((i % 89) as f32 - 44.0) * 1e-3)
        .collect();
    let opt = crate::optim::AdamW::default();
    let mut cpu = CpuStore::new(&lens, 2, cfg.sub_group_elems)?;
    let mut nvme = NvmeStore::new(&lens, 2, cfg)?;
    for u in 0..units {
        cpu.init_unit(u, &init, 2)?;
        nvme.init_unit(u, &init, 2)?;
    }
    let steps = steps.max(1);
    let run = |store: &mut dyn OptimStateStore| -> EngineResult<Vec<f64>> {
        let mut times = Vec::with_capacity(steps);
        for s in 1..=steps as u64 {
            let p = StepParams {
                step: s,
                lr: 1e-3,
                grad_scale: 1.0,
            };
            let t = Instant::now();
            for u in 0..units {
                store.update_unit(u, &mut |tile| {
                    let g = &grad[tile.offset..tile.offset + tile.master.len()];
                    opt.step_tile(&p, tile.master, g, tile.state);
                    Ok(())
                })?;
            }
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        Ok(times)
    };
    let cpu_times = run(&mut cpu)?;
    let before = nvme.stats();
    let nvme_times = run(&mut nvme)?;
    let after = nvme.stats();
    for u in 0..units {
        if cpu.read_unit(u)? != nvme.read_unit(u)? {
            return Err(EngineError::Offload(format!(
                "nvme and cpu state of unit {u} differ after {steps} steps"
            )));
        }
    }
    let nvme_step = nvme_times[steps / 2];
    let moved = (after.bytes_read - before.bytes_read + after.bytes_written - before.bytes_written)
        as f64
        / steps as f64;
    Ok(StepReport {
        elems: units * elems_per_unit,
        cpu_step: cpu_times[steps / 2],
        nvme_step,
        nvme_io_wait: (after.io_wait_secs - before.io_wait_secs) / steps as f64,
        nvme_bandwidth: moved / nvme_step,
        cpu_host_bytes: cpu.memory().host,
        nvme_host_bytes: nvme.memory().host,
        describe: nvme.describe(),
    })
}
