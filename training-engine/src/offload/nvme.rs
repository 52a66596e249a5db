//! The NVMe tier: optimizer state in a swap file, streamed through staging buffers.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::ops::Range;

use super::cpu::check_unit;
use super::engine::{Dir, IoEngine, Job, Lease, Span, Ticket};
use super::{
    ALIGN, AlignedBuf, DEFAULT_IO_TIMEOUT, EngineKind, OffloadError, OffloadStats, TierBytes,
    TileSpec, check_io_timeout, round_up, tile_specs,
};
use crate::error::{EngineError, EngineResult};
use crate::layout::{OptimStateStore, StateTile};

/// Configuration of an [`NvmeStore`] (DeepSpeed's `aio` knobs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeConfig {
    /// Directory of the swap file (`--nvme-path`).
    pub dir: PathBuf,
    /// Swap file name, unique per rank (e.g. `rank-00003.swap`).
    pub file_name: String,
    /// Bytes per I/O request (a multiple of 4 KiB; default 1 MiB).
    pub block_size: usize,
    /// Requests in flight (default 8).
    pub queue_depth: usize,
    /// Tile staging buffers; 2 is double buffering (default 2, minimum 1).
    pub buffer_count: usize,
    /// Tile size in elements (DeepSpeed's `sub_group_size`).
    pub sub_group_elems: usize,
    /// `None` picks io_uring and falls back to the thread pool when it cannot be set up.
    pub engine: Option<EngineKind>,
    /// Deadline of every wait for the tier's I/O (default [`DEFAULT_IO_TIMEOUT`], 300 s; from
    /// [`MIN_IO_TIMEOUT`](super::MIN_IO_TIMEOUT) to [`MAX_IO_TIMEOUT`](super::MAX_IO_TIMEOUT)):
    /// a job the device has not completed by then fails with [`OffloadError::TimedOut`], and
    /// the store is unusable from then on ([`OffloadError::Poisoned`]).
    pub io_timeout: Duration,
}

impl NvmeConfig {
    /// Defaults: 1 MiB blocks, queue depth 8, 2 buffers, 4 Mi-element (16 MiB) tiles, auto
    /// engine, a 300 s I/O timeout.
    pub fn new(dir: impl Into<PathBuf>, file_name: impl Into<String>) -> Self {
        NvmeConfig {
            dir: dir.into(),
            file_name: file_name.into(),
            block_size: 1 << 20,
            queue_depth: 8,
            buffer_count: 2,
            sub_group_elems: 4 << 20,
            engine: None,
            io_timeout: DEFAULT_IO_TIMEOUT,
        }
    }

    /// Checks the values ([`NvmeStore::new`] does too, before it creates anything).
    ///
    /// # Errors
    /// [`OffloadError::InvalidArgument`] naming the value out of range.
    pub fn validate(&self) -> Result<(), OffloadError> {
        // One request's length travels as a u32 (io_uring's `len`).
        if self.block_size == 0 || !self.block_size.is_multiple_of(ALIGN) || self.block_size > MAX_BLOCK {
            return Err(OffloadError::InvalidArgument(format!(
                "block_size {} is not a positive multiple of {ALIGN} up to {MAX_BLOCK}",
                self.block_size
            )));
        }
        if self.queue_depth == 0 || self.buffer_count == 0 || self.sub_group_elems == 0 {
            return Err(OffloadError::InvalidArgument(format!(
                "queue_depth {}, buffer_count {} and sub_group_elems {} must be positive",
                self.queue_depth, self.buffer_count, self.sub_group_elems
            )));
        }
        // io_uring takes at most 32768 entries; past it the pool fallback would start that many
        // threads.
        if self.queue_depth > MAX_QUEUE_DEPTH {
            return Err(OffloadError::InvalidArgument(format!(
                "queue_depth {}: expected at most {MAX_QUEUE_DEPTH} requests in flight",
                self.queue_depth
            )));
        }
        check_io_timeout(self.io_timeout)
    }
}

/// One tile-sized staging buffer and the job using it.
struct Staging {
    /// The job using the buffer, if any.
    pending: Option<Ticket>,
    /// The buffer: `None` while it is lent to the pending job (the job owns it, and the wait
    /// hands it back), and for good once a wait gave up on that job (it stays with the job,
    /// which the kernel may still write into; the store is poisoned then).
    buf: Option<AlignedBuf>,
    /// Bytes of the buffer, lent or not (for [`NvmeStore::memory`]).
    bytes: usize,
    /// The tile whose current slot is being (or has been) read into `buf`, if any.
    holds: Option<usize>,
    /// The pending job is a read ahead of need (a prefetch): its error is dropped with the
    /// tile, which is read again when it is needed, instead of failing whatever waits next (a
    /// checkpoint save, another unit's update).
    speculative: bool,
}

/// Optimizer state in one `O_DIRECT` swap file; see the module docs for layout and
/// failure atomicity. The file is removed when the store is dropped.
pub struct NvmeStore {
    // Field order is drop order: staging (its pending jobs keep their buffers until the backend
    // lets go of them; `drop` waits for them first), then the engine (joins its threads, up to
    // `io_timeout`), then the file (each job holds its own reference while it may be used).
    staging: Vec<Staging>,
    engine: IoEngine,
    file: Arc<File>,
    path: Arc<Path>,
    direct: bool,
    unit_lens: Vec<usize>,
    /// State slots per element; a tile slot holds `1 + slots` tensors.
    slots: usize,
    tiles: Vec<TileSpec>,
    /// Tiles of each unit (contiguous in tile order).
    unit_tiles: Vec<Range<usize>>,
    /// Padded bytes of one tensor of each tile.
    region: Vec<usize>,
    /// File offset of each tile's slot 0.
    base: Vec<u64>,
    /// Current slot (0 or 1) of each tile.
    cur: Vec<u8>,
    file_bytes: u64,
    /// The unit updated last (predicts the order: ascending, or descending as in backward).
    last_unit: Option<usize>,
    stats: OffloadStats,
}

impl std::fmt::Debug for NvmeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeStore")
            .field("path", &self.path)
            .field("engine", &self.engine.kind())
            .field("direct", &self.direct)
            .field("tiles", &self.tiles.len())
            .field("file_bytes", &self.file_bytes)
            .finish()
    }
}

/// The largest `block_size`: 1 GiB, well inside io_uring's 32-bit request length.
const MAX_BLOCK: usize = 1 << 30;

impl NvmeStore {
    /// Creates a new swap file, unlinks it at once, for unit shards of `unit_lens` elements with
    /// `slots` state slots per element, preallocates it and starts the I/O engine. The state
    /// starts at zero.
    ///
    /// # Errors
    /// An invalid config, [`OffloadError::Io`] naming the file when it cannot be created or
    /// preallocated (`ENOSPC` for a disk that is too small), [`OffloadError::Engine`] when the
    /// requested engine cannot start.
    pub fn new(unit_lens: &[usize], slots: usize, cfg: &NvmeConfig) -> Result<Self, OffloadError> {
        cfg.validate()?;
        let tiles = tile_specs(unit_lens, cfg.sub_group_elems);
        let unit_tiles = (0..unit_lens.len())
            .map(|u| {
                let start = tiles
                    .iter()
                    .position(|t| t.unit >= u)
                    .unwrap_or(tiles.len());
                let end = tiles.iter().position(|t| t.unit > u).unwrap_or(tiles.len());
                start..end
            })
            .collect();
        let n_tensors = 1 + slots;
        let region: Vec<usize> = tiles.iter().map(|t| round_up(t.len * 4)).collect();
        let mut base = Vec::with_capacity(tiles.len());
        let mut file_bytes = 0u64;
        for r in &region {
            base.push(file_bytes);
            file_bytes += (2 * n_tensors * *r) as u64;
        }
        let (file, direct, path) = open_swap(&cfg.dir.join(&cfg.file_name))?;
        let path: Arc<Path> = path.into();
        if !direct {
            tracing::warn!(path = %path.display(), "the file system refuses O_DIRECT: the NVMe tier goes through the page cache (slower, and it competes with the job for memory)");
        }
        // Unlinked at once: the space lives as long as the descriptor, so a rank that is killed
        // (SIGKILL, an abort, a restart by the launcher) cannot leave gigabytes behind.
        if let Err(e) = std::fs::remove_file(&path) {
            // One more try, so that the name does not stay behind in --nvme-path.
            let _ = std::fs::remove_file(&path);
            return Err(OffloadError::Io {
                op: "unlink",
                path: path.to_path_buf(),
                offset: 0,
                source: e,
            });
        }
        let cleanup = |file: File, e: OffloadError| {
            drop(file);
            e
        };
        if let Err(e) = preallocate(&file, file_bytes) {
            let err = OffloadError::Io {
                op: "allocate",
                path: path.to_path_buf(),
                offset: 0,
                source: e,
            };
            return Err(cleanup(file, err));
        }
        let engine = match IoEngine::start(cfg.engine, cfg.block_size, cfg.queue_depth, cfg.io_timeout) {
            Ok(e) => e,
            Err(e) => return Err(cleanup(file, e)),
        };
        let max_region = region.iter().copied().max().unwrap_or(ALIGN);
        let mut staging = Vec::new();
        for _ in 0..cfg.buffer_count.min(tiles.len().max(1)) {
            match AlignedBuf::zeroed(n_tensors * max_region / 4) {
                Ok(buf) => staging.push(Staging {
                    pending: None,
                    bytes: buf.capacity_bytes(),
                    buf: Some(buf),
                    holds: None,
                    speculative: false,
                }),
                Err(e) => return Err(cleanup(file, e)),
            }
        }
        Ok(NvmeStore {
            staging,
            engine,
            file: Arc::new(file),
            path,
            direct,
            unit_lens: unit_lens.to_vec(),
            slots,
            cur: vec![0; tiles.len()],
            tiles,
            unit_tiles,
            region,
            base,
            file_bytes,
            last_unit: None,
            stats: OffloadStats::default(),
        })
    }

    /// The I/O backend in use.
    pub fn engine_kind(&self) -> EngineKind {
        self.engine.kind()
    }

    /// Whether the file is open with `O_DIRECT` (false only on file systems refusing it).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Where the swap file was created (it is unlinked at once, and its space freed when the
    /// store is dropped or the process ends, however it ends).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open swap file.
    #[cfg(test)]
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The I/O engine (for its test hook).
    #[cfg(test)]
    pub(crate) fn engine(&self) -> &IoEngine {
        &self.engine
    }

    /// The tiles, in update order.
    pub fn tiles(&self) -> &[TileSpec] {
        &self.tiles
    }

    /// Shard length of each unit.
    pub fn unit_lens(&self) -> &[usize] {
        &self.unit_lens
    }

    /// Memory held, per tier: the staging buffers, and the swap file.
    pub fn memory(&self) -> TierBytes {
        TierBytes {
            host: self.staging.iter().map(|s| s.bytes).sum(),
            file: self.file_bytes,
        }
    }

    /// Counters.
    pub fn stats(&self) -> OffloadStats {
        self.stats
    }

    /// A short description for logs.
    pub fn describe(&self) -> String {
        format!(
            "nvme {} {} {}",
            match self.engine.kind() {
                EngineKind::IoUring => "io_uring",
                EngineKind::ThreadPool => "pread/pwrite pool",
            },
            if self.direct { "O_DIRECT" } else { "buffered" },
            self.path.display()
        )
    }

    /// Bytes of one slot of tile `t` (all its tensors).
    fn slot_bytes(&self, t: usize) -> usize {
        (1 + self.slots) * self.region[t]
    }

    fn slot_offset(&self, t: usize, slot: u8) -> u64 {
        self.base[t] + u64::from(slot % 2) * self.slot_bytes(t) as u64
    }

    /// A transfer of the first `len` bytes of a staging buffer.
    fn span(offset: u64, len: usize, dir: Dir) -> Span {
        Span {
            offset,
            at: 0,
            len,
            dir,
        }
    }

    /// Reading tile `t`'s current slot (into a staging buffer).
    fn read_span(&self, t: usize) -> Span {
        Self::span(self.slot_offset(t, self.cur[t]), self.slot_bytes(t), Dir::Read)
    }

    /// Writing tile `t`'s other slot (from a staging buffer).
    fn write_span(&self, t: usize) -> Span {
        Self::span(self.slot_offset(t, self.cur[t] + 1), self.slot_bytes(t), Dir::Write)
    }

    /// Fails once a wait gave up on a job: the swap file may be half written, and buffers may
    /// still be lent to the kernel.
    fn usable(&self) -> Result<(), OffloadError> {
        match self.engine.poisoned() {
            Some(why) => Err(OffloadError::Poisoned {
                path: self.path.to_path_buf(),
                reason: why.to_owned(),
            }),
            None => Ok(()),
        }
    }

    /// Submits `phases` on staging buffer `b` (which must have no pending job), lending the
    /// buffer (and the file) to the job until [`wait`](Self::wait) takes it back.
    fn submit(&mut self, b: usize, phases: Vec<Vec<Span>>) -> Result<(), OffloadError> {
        debug_assert!(self.staging[b].pending.is_none());
        let Some(buf) = self.staging[b].buf.take() else {
            return Err(lent(&self.engine, &self.path));
        };
        for r in phases.iter().flatten() {
            match r.dir {
                Dir::Read => self.stats.bytes_read += r.len as u64,
                Dir::Write => self.stats.bytes_written += r.len as u64,
            }
        }
        let job = Job {
            phases,
            path: self.path.clone(),
            lease: Lease {
                buf,
                file: self.file.clone(),
            },
        };
        self.staging[b].pending = Some(self.engine.submit(job));
        self.staging[b].speculative = false;
        Ok(())
    }

    /// Waits for staging buffer `b`'s job (at most `io_timeout`) and takes the buffer back.
    fn wait(&mut self, b: usize) -> Result<(), OffloadError> {
        let speculative = std::mem::take(&mut self.staging[b].speculative);
        let Some(ticket) = self.staging[b].pending.take() else {
            return Ok(());
        };
        let (result, lease) = ticket.wait();
        let Some(lease) = lease else {
            // Given up on (it timed out, or another job did): the buffer stays with the job and
            // the store is poisoned. Never dropped as a failed prefetch is.
            self.staging[b].holds = None;
            return Err(result.err().unwrap_or_else(|| lent(&self.engine, &self.path)));
        };
        self.staging[b].buf = Some(lease.buf);
        result.or_else(|e| {
            self.staging[b].holds = None;
            if speculative {
                tracing::debug!(error = %e, "a prefetch read failed; the tile is read again when needed");
                Ok(())
            } else {
                Err(e)
            }
        })
    }

    /// Waits for every pending job and forgets prefetched tiles; returns the first error.
    fn drain(&mut self) -> Result<(), OffloadError> {
        let mut first = Ok(());
        for b in 0..self.staging.len() {
            let r = self.wait(b);
            self.staging[b].holds = None;
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Starts reading the first tiles of `unit` (no-op for tiles already there).
    fn prefetch_unit(&mut self, unit: usize) -> Result<(), OffloadError> {
        let n_bufs = self.staging.len();
        let tiles = self.unit_tiles[unit].clone();
        for t in tiles.take(n_bufs) {
            let b = t % n_bufs;
            if self.staging[b].holds == Some(t) {
                continue;
            }
            self.wait(b)?;
            let read = self.read_span(t);
            self.submit(b, vec![vec![read]])?;
            self.staging[b].holds = Some(t);
            self.staging[b].speculative = true;
        }
        Ok(())
    }

    /// Starts reading the first tiles of `unit`, so that the reads overlap whatever the caller
    /// does before [`OptimStateStore::update_unit`] (e.g. the backward pass). The store does
    /// this by itself for the next unit after each update.
    ///
    /// # Errors
    /// A bad unit, or the error of a previous job that was still pending.
    pub fn prefetch(&mut self, unit: usize) -> EngineResult<()> {
        if unit >= self.unit_lens.len() {
            return Err(self.bad_unit(unit));
        }
        self.usable()?;
        Ok(self.prefetch_unit(unit)?)
    }

    fn bad_unit(&self, unit: usize) -> EngineError {
        EngineError::Offload(format!(
            "unit {unit} out of range ({} units)",
            self.unit_lens.len()
        ))
    }

    /// The pipelined update of one unit; on error the unit's tiles keep their slots.
    fn run_unit(
        &mut self,
        unit: usize,
        f: &mut dyn FnMut(StateTile<'_>) -> EngineResult<()>,
        waited: &mut f64,
    ) -> EngineResult<()> {
        let tiles = self.unit_tiles[unit].clone();
        let n_bufs = self.staging.len();
        let n_tensors = 1 + self.slots;
        self.prefetch_unit(unit)?;
        for t in tiles.clone() {
            let b = t % n_bufs;
            let t0 = Instant::now();
            let r = self.wait(b);
            *waited += t0.elapsed().as_secs_f64();
            r?;
            if self.staging[b].holds != Some(t) {
                // Its prefetch failed (the error dropped with it): read it now, and wait.
                let read = self.read_span(t);
                self.submit(b, vec![vec![read]])?;
                self.staging[b].holds = Some(t);
                self.wait(b)?;
            }
            self.staging[b].holds = None;
            let tile = self.tiles[t].clone();
            let q = self.region[t] / 4;
            let Some(buf) = self.staging[b].buf.as_mut() else {
                return Err(lent(&self.engine, &self.path).into());
            };
            let all = &mut buf[..n_tensors * q];
            let (master, state) = all.split_at_mut(q);
            let mut state: Vec<&mut [f32]> = state
                .chunks_exact_mut(q)
                .map(|c| &mut c[..tile.len])
                .collect();
            f(StateTile {
                offset: tile.start,
                master: &mut master[..tile.len],
                state: &mut state,
            })?;
            // Write tile t to its other slot, then read tile t+B of this unit into the buffer.
            let mut phases = vec![vec![self.write_span(t)]];
            if t + n_bufs < tiles.end {
                phases.push(vec![self.read_span(t + n_bufs)]);
                self.staging[b].holds = Some(t + n_bufs);
            }
            self.submit(b, phases)?;
        }
        Ok(())
    }
}

impl OptimStateStore for NvmeStore {
    fn kind(&self) -> &'static str {
        "nvme"
    }

    fn init_unit(&mut self, unit: usize, master: &[f32], slots: usize) -> EngineResult<()> {
        check_unit(&self.unit_lens, self.slots, unit, master.len(), slots)?;
        let zeros = vec![0.0f32; master.len()];
        let state: Vec<&[f32]> = (0..slots).map(|_| &zeros[..]).collect();
        self.write_tensors(unit, master, &state)
    }

    fn update_unit(
        &mut self,
        unit: usize,
        f: &mut dyn FnMut(StateTile<'_>) -> EngineResult<()>,
    ) -> EngineResult<()> {
        if unit >= self.unit_lens.len() {
            return Err(self.bad_unit(unit));
        }
        self.usable()?;
        let mut waited = 0.0;
        let result = self.run_unit(unit, f, &mut waited);
        let t0 = Instant::now();
        let drained = self.drain();
        waited += t0.elapsed().as_secs_f64();
        self.stats.io_wait_secs += waited;
        result?;
        drained?;
        for t in self.unit_tiles[unit].clone() {
            self.cur[t] ^= 1;
        }
        self.stats.unit_updates += 1;
        // Prefetch the next unit with tiles, in the order the caller goes (ascending, or
        // descending when it updates units as backward produces their gradients), wrapping
        // around to the next step.
        let n_units = self.unit_lens.len();
        let descending = self.last_unit == Some((unit + 1) % n_units) && n_units > 1;
        self.last_unit = Some(unit);
        if let Some(next) = (1..=n_units)
            .map(|k| {
                if descending {
                    (unit + n_units - k) % n_units
                } else {
                    (unit + k) % n_units
                }
            })
            .find(|&u| !self.unit_tiles[u].is_empty())
        {
            self.prefetch_unit(next)?;
        }
        Ok(())
    }

    fn read_unit(&mut self, unit: usize) -> EngineResult<(Vec<f32>, Vec<Vec<f32>>)> {
        if unit >= self.unit_lens.len() {
            return Err(self.bad_unit(unit));
        }
        self.usable()?;
        self.drain()?;
        let n = self.unit_lens[unit];
        let mut master = vec![0.0f32; n];
        let mut state = vec![vec![0.0f32; n]; self.slots];
        for t in self.unit_tiles[unit].clone() {
            let read = self.read_span(t);
            self.submit(0, vec![vec![read]])?;
            self.wait(0)?;
            let tile = self.tiles[t].clone();
            let q = self.region[t] / 4;
            let Some(buf) = self.staging[0].buf.as_ref() else {
                return Err(lent(&self.engine, &self.path).into());
            };
            master[tile.range()].copy_from_slice(&buf[..tile.len]);
            for (s, out) in state.iter_mut().enumerate() {
                let at = (1 + s) * q;
                out[tile.range()].copy_from_slice(&buf[at..at + tile.len]);
            }
        }
        Ok((master, state))
    }

    fn write_unit(&mut self, unit: usize, master: &[f32], state: &[Vec<f32>]) -> EngineResult<()> {
        check_unit(&self.unit_lens, self.slots, unit, master.len(), state.len())?;
        if let Some(s) = state.iter().find(|s| s.len() != master.len()) {
            return Err(EngineError::Length {
                what: format!("offload unit {unit} state slot"),
                expected: master.len(),
                actual: s.len(),
            });
        }
        let state: Vec<&[f32]> = state.iter().map(|s| &s[..]).collect();
        self.write_tensors(unit, master, &state)
    }

    fn resident_bytes(&self) -> u64 {
        self.memory().host as u64
    }
}

impl NvmeStore {
    /// Writes a whole unit into the tiles' other slots, then switches them (atomic per unit).
    fn write_tensors(&mut self, unit: usize, master: &[f32], state: &[&[f32]]) -> EngineResult<()> {
        self.usable()?;
        self.drain()?;
        for t in self.unit_tiles[unit].clone() {
            let tile = self.tiles[t].clone();
            let q = self.region[t] / 4;
            let Some(buf) = self.staging[0].buf.as_mut() else {
                return Err(lent(&self.engine, &self.path).into());
            };
            for (i, src) in std::iter::once(master)
                .chain(state.iter().copied())
                .enumerate()
            {
                let dst = &mut buf[i * q..(i + 1) * q];
                dst[..tile.len].copy_from_slice(&src[tile.range()]);
                dst[tile.len..].fill(0.0);
            }
            let write = self.write_span(t);
            self.submit(0, vec![vec![write]])?;
            self.wait(0)?;
        }
        for t in self.unit_tiles[unit].clone() {
            self.cur[t] ^= 1;
        }
        Ok(())
    }
}

impl Drop for NvmeStore {
    fn drop(&mut self) {
        // Each wait has the deadline (none once poisoned); a job given up on keeps its buffer.
        let _ = self.drain();
    }
}

/// The error for a staging buffer that is not there: it stays lent to a job that a wait gave
/// up on (the store is poisoned then).
fn lent(engine: &IoEngine, path: &Path) -> OffloadError {
    match engine.poisoned() {
        Some(why) => OffloadError::Poisoned {
            path: path.to_path_buf(),
            reason: why.to_owned(),
        },
        None => OffloadError::Engine(format!(
            "a staging buffer of {} is still lent to an unfinished job",
            path.display()
        )),
    }
}

/// Creates the swap file, then switches it to `O_DIRECT`, or leaves it buffered when the file
/// system refuses `O_DIRECT` (`EINVAL`: tmpfs before Linux 6.6, some FUSE mounts); returns it,
/// whether it is direct, and its path. Always a new file (`O_EXCL|O_NOFOLLOW`): a name another
/// job took in the same directory (equal pids in two containers) or a symlink planted there is
/// never truncated or written through; such a name gets a random suffix instead. (Creating
/// with `O_DIRECT` itself would not do: the kernel creates the file before it refuses the flag,
/// and a second, buffered `O_EXCL` open then finds the name taken.)
pub(super) fn open_swap(path: &Path) -> Result<(File, bool, PathBuf), OffloadError> {
    let mut candidate = path.to_path_buf();
    for _ in 0..8 {
        let r = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            // Only ours while it still has its name (it is unlinked right after): another user
            // of a shared --nvme-path must not open the weights in that moment.
            .mode(0o600)
            .open(&candidate);
        match r {
            Ok(f) => {
                // The file is ours from here on: a failure removes it, not only reports it.
                let direct = set_direct(&f).map_err(|e| {
                    let _ = std::fs::remove_file(&candidate);
                    open_error(&candidate, e)
                })?;
                return Ok((f, direct, candidate));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let mut name = path.as_os_str().to_owned();
                name.push(format!(".{:016x}", crate::comm::random_token()));
                candidate = PathBuf::from(name);
            }
            Err(e) => return Err(open_error(&candidate, e)),
        }
    }
    Err(open_error(path, std::io::Error::new(std::io::ErrorKind::AlreadyExists, "every name tried is taken")))
}

/// Turns on `O_DIRECT` for `f`: `Ok(false)` when its file system does not support it.
fn set_direct(f: &File) -> std::io::Result<bool> {
    let fd = f.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function borrows for the call.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) } == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINVAL) { Ok(false) } else { Err(e) }
}

/// The most requests in flight ([`NvmeConfig::queue_depth`]).
const MAX_QUEUE_DEPTH: usize = 4096;

fn open_error(path: &Path, source: std::io::Error) -> OffloadError {
    OffloadError::Io {
        op: "open",
        path: path.to_path_buf(),
        offset: 0,
        source,
    }
}

/// Reserves `bytes` on disk (so a full disk is found now), or sizes the file sparsely where
/// `fallocate` is unsupported.
fn preallocate(file: &File, bytes: u64) -> std::io::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: plain syscall on an open fd.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return file.set_len(bytes);
    }
    Err(e)
}
