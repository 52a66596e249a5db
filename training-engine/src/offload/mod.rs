//! Optimizer-state offload: a host tier ([`CpuStore`]) and an NVMe tier ([`NvmeStore`]), both
//! implementing the engine's [`OptimStateStore`](crate::layout::OptimStateStore).
//!
//! # Overview
//! The optimizer state of a rank's shard (fp32 master parameters and the optimizer's state
//! slots, e.g. AdamW's `m` and `v`) is cut into *tiles* (DeepSpeed's sub-groups) of at most
//! `sub_group_elems` elements, never crossing a unit boundary. The engine runs the step unit by
//! unit with [`OptimStateStore::update_unit`](crate::layout::OptimStateStore::update_unit); its
//! closure gets one tile at a time ([`StateTile`](crate::layout::StateTile)) and updates it in
//! place (the engine's [`TileOptimizer`](crate::layout::TileOptimizer), e.g.
//! [`AdamW`](crate::optim::AdamW), on the matching gradient slice).
//!
//! - [`CpuStore`] is the host tier: page-aligned buffers allocated apart from the compute tier
//!   (the model's parameters and gradients), their bytes accounted in [`TierBytes::host`]. On
//!   a GPU build the compute tier lives on the device; on this CPU-only build it is host memory
//!   too, but the two tiers stay separate allocations with separate accounting.
//! - [`NvmeStore`] keeps every tile in one swap file under [`NvmeConfig::dir`] opened with
//!   `O_DIRECT` (the page cache is bypassed, so resident memory drops by the offloaded bytes)
//!   and holds only `buffer_count` tile-sized staging buffers. The step is double-buffered:
//!   while the closure updates tile `i`, the engine writes tile `i-1` back and reads tile
//!   `i+1`; each staging buffer runs the chained job "write tile `i` back, then read tile
//!   `i+B`" (`B = buffer_count`). After a unit, the first tiles of the next unit (and after the
//!   last unit, of the first one: the next step) are prefetched, so those reads overlap what
//!   the engine does in between (parameter copies, the next forward and backward). I/O goes
//!   through io_uring with `queue_depth` requests of `block_size` bytes in flight, or through
//!   a pread/pwrite thread pool when io_uring cannot be set up ([`EngineKind`], forcible).
//!
//! # File layout and failure atomicity (NVMe)
//! Tile `t` owns two *slots*; a slot holds the tile's tensors back to back (master, then each
//! state slot), every tensor padded to 4 KiB (the true length is [`TileSpec::len`]):
//!
//! ```text
//! [tile 0: slot A (master | m | v) | slot B (master | m | v)] [tile 1: slot A | slot B] …
//! ```
//!
//! An update reads each tile's current slot and writes the other one; the tiles of a unit
//! switch to their new slots only when every write of that unit completed. A failed
//! `update_unit` (I/O error, full disk, closure error) therefore leaves that unit exactly as it
//! was before the call; earlier units of the same step keep their update (the engine treats a
//! failed step as fatal). The price is twice the file space. The file is preallocated with
//! `fallocate` when the store is created, so a disk that is too small fails at creation with
//! `ENOSPC` naming the file rather than in the middle of training.
//!
//! # Errors
//! Every failure is an [`OffloadError`] naming the file, the operation, the offset and the OS
//! error (`ENOSPC`, `EIO`, …), converted into [`EngineError::Offload`] at the trait boundary;
//! completions are checked one by one, short transfers are resubmitted, nothing aborts.
//!
//! # Deadlines and buffer ownership (NVMe)
//! Every wait for the tier's I/O has a deadline, [`NvmeConfig::io_timeout`] (default
//! [`DEFAULT_IO_TIMEOUT`], 300 s; a stalled job is reported every minute until then). A job the
//! device has not completed by then fails with [`OffloadError::TimedOut`] (the file, the
//! direction and first offset of the stuck phase, the requests still pending, the timeout), and
//! the tier is *poisoned*: every later operation fails at once with [`OffloadError::Poisoned`],
//! saying why, instead of going on with a swap file that may be half written.
//!
//! Giving up on a job does not give its memory back: the kernel (io_uring) or a pool thread may
//! still read from or write into it. So a job owns what its requests point into, a *lease* (the
//! staging buffer, and the file, so that a late request never lands in another file that
//! reused the descriptor's number), from submission until the backend has let go of its last
//! request; a wait that completes hands the lease back, one that gives up leaves it with the
//! job, which frees it when the late completions arrive (or never, if they never do: leaked on
//! purpose rather than freed under the kernel). Dropping an engine waits for its threads up to
//! the same deadline, then leaves them running with whatever they hold.

mod aligned;
pub mod bench;
mod cpu;
mod engine;
mod nvme;

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::EngineError;

pub use aligned::{ALIGN, AlignedBuf, round_up};
pub use cpu::CpuStore;
pub use nvme::{NvmeConfig, NvmeStore};

/// Default of [`NvmeConfig::io_timeout`]: how long a wait for the NVMe tier's I/O lasts at most.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(300);
/// The shortest `io_timeout` accepted.
pub const MIN_IO_TIMEOUT: Duration = Duration::from_millis(1);
/// The longest `io_timeout` accepted: a day (longer is no deadline any more).
pub const MAX_IO_TIMEOUT: Duration = Duration::from_secs(24 * 60 * 60);

/// Checks an `io_timeout`: zero (every wait would fail) and more than [`MAX_IO_TIMEOUT`] are
/// refused.
///
/// # Errors
/// [`OffloadError::InvalidArgument`] naming the value.
pub fn check_io_timeout(timeout: Duration) -> Result<(), OffloadError> {
    if (MIN_IO_TIMEOUT..=MAX_IO_TIMEOUT).contains(&timeout) {
        Ok(())
    } else {
        Err(OffloadError::InvalidArgument(format!(
            "io_timeout {timeout:?}: expected from {MIN_IO_TIMEOUT:?} to {MAX_IO_TIMEOUT:?}"
        )))
    }
}

/// Errors of the offload tiers.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    /// A read, write, open, allocate or sync on a swap file failed.
    #[error("offload {op} of {path} at offset {offset} failed: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    /// The I/O engine could not start or stopped.
    #[error("offload i/o engine: {0}")]
    Engine(String),
    /// A job did not complete within the `io_timeout` (a device that does not answer): `op`
    /// and `offset` are the direction and first file offset of the phase it was stuck in,
    /// `pending` that phase's requests not completed. The job keeps its buffer (the kernel may
    /// still use it), and the tier is poisoned from then on.
    #[error(
        "offload {op} of {path} at offset {offset} timed out after {timeout:?}: {pending} request(s) still pending (a stalled device?)"
    )]
    TimedOut {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        pending: usize,
        timeout: Duration,
    },
    /// An earlier job of the tier timed out: nothing more is done with its swap file, which may
    /// be half written. `reason` is that timeout.
    #[error("offload tier on {path} is unusable: {reason}")]
    Poisoned { path: PathBuf, reason: String },
    /// A buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes for offload buffers")]
    Alloc { bytes: usize },
    /// A caller argument does not match the store (unit, length, config value).
    #[error("offload: {0}")]
    InvalidArgument(String),
}

impl From<OffloadError> for EngineError {
    fn from(e: OffloadError) -> Self {
        EngineError::Offload(e.to_string())
    }
}

impl OffloadError {
    /// The OS error number, when the failure came from the OS.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            OffloadError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Which asynchronous I/O backend an [`NvmeStore`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// One io_uring driven by a dedicated thread.
    IoUring,
    /// `queue_depth` threads doing pread/pwrite.
    ThreadPool,
}

/// One tile: `len` elements starting at `start` in unit `unit`'s shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TileSpec {
    pub unit: usize,
    pub start: usize,
    pub len: usize,
}

impl TileSpec {
    /// Element range within the unit's shard.
    pub fn range(&self) -> Range<usize> {
        self.start..self.start + self.len
    }
}

/// Cuts unit shards of the given lengths into tiles of at most `sub_group_elems` elements.
/// Empty units have no tile.
pub fn tile_specs(unit_lens: &[usize], sub_group_elems: usize) -> Vec<TileSpec> {
    let step = sub_group_elems.max(1);
    let mut out = Vec::new();
    for (unit, &n) in unit_lens.iter().enumerate() {
        let mut start = 0;
        while start < n {
            let len = step.min(n - start);
            out.push(TileSpec { unit, start, len });
            start += len;
        }
    }
    out
}

/// Memory held by a store, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBytes {
    /// Host memory allocated by the store (the host tier, or NVMe staging buffers).
    pub host: usize,
    /// Bytes of optimizer state kept in files (0 for the host tier).
    pub file: u64,
}

/// I/O counters of a store.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct OffloadStats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Completed `update_unit` calls.
    pub unit_updates: u64,
    /// Seconds the caller spent blocked on I/O inside `update_unit` (not hidden by the update).
    pub io_wait_secs: f64,
}

/// Resident set size and its peak of this process in bytes (`VmRSS`, `VmHWM` from
/// `/proc/self/status`); `None` where that file is unavailable.
pub fn resident_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

#[cfg(test)]
mod tests;
