//! Sharded, resharding, crash-safe checkpoints, and consolidation to safetensors.
//!
//! # Layout on disk
//! ```text
//! <root>/latest                       "step-000000120\n", replaced atomically, written last
//! <root>/step-000000120/
//!     shard-00000.bin … shard-0000{W-1}.bin   one per shard of the sharding group
//!     metadata.json                   global table, written by rank 0 at commit
//! <root>/step-000000140.incomplete/   a save in progress (never loaded)
//! ```
//!
//! A shard file holds, per unit, the rank's fp32 master shard and each optimizer state slot
//! (padded shard coordinates, `shard_len` elements), each section with a CRC-32, behind a JSON
//! header with its own CRC-32 (see [`format`]). `metadata.json` holds the format version, the
//! parameter table (units → name, shape, offset, numel; numel, padded numel, shard length),
//! the strategy, world size and sharding group size, the step, the optimizer and its number of
//! state slots, the loss scale, the data position, epoch and RNG state (hex), and for every
//! shard file its size and header CRC-32.
//!
//! # Who writes
//! Only the first replica of the sharding group writes. For DDP (`layout.world == 1`) that is
//! rank 0 alone, writing the one full copy; for ZeRO/FSDP every rank writes its shard
//! (`rank == shard_rank`, [`is_writer`]); for hybrid sharding the ranks of the first host do,
//! which the engine picks from its groups ([`write_shard`]): with ranks placed round-robin
//! over the hosts they are not the ranks `0..shard_world`.
//!
//! # Save protocol (collective)
//! 1. rank 0: [`begin_save`] removes a leftover `step-N.incomplete/` and creates it fresh;
//!    barrier.
//! 2. every rank: [`save_shard`] writes `shard-R.bin.tmp`, fsyncs it, renames it to
//!    `shard-R.bin` and fsyncs the directory (non-writers do nothing); barrier. The engine
//!    writes through [`write_shard_with`], which takes the tensors one unit at a time (the
//!    header's space reserved first, its CRCs filled in last): a rank never holds a second
//!    copy of its whole state.
//! 3. rank 0: [`commit`] checks every shard file (size, header, step), writes
//!    `metadata.json` (temp, fsync, rename, directory fsync), renames the directory to
//!    `step-N/` and fsyncs the root, then replaces `latest` the same way, and only then removes
//!    checkpoints beyond `keep_last`.
//!
//! A crash or error at any point leaves `latest` on the previous committed checkpoint, which
//! stays untouched; loaders never look at `.incomplete` directories. [`save_local`] runs the
//! three steps in one process (tests, single-process jobs).
//!
//! # Load and resharding
//! [`load`] verifies the metadata and every shard file's size and header CRC, then computes the
//! requested rank's shard of each unit under the *target* layout (any sharding group size, any
//! strategy) and reads the overlapping ranges from the saved shards, checking the CRC-32 of
//! every section it reads. Padding is dropped and re-added as the new layout requires (padding
//! is zero). [`ShardLoad`] does the same a batch of units at a time ([`LOAD_BATCH_BYTES`]),
//! which is how the engine loads. [`verify`] checks every byte; [`export_safetensors`] writes the full fp32
//! parameters by name and shape.
//!
//! Errors name the file and what is wrong: bad magic, header or section checksum mismatch,
//! truncated file, model/optimizer mismatch, I/O errors with the OS error (`ENOSPC`, `EIO`).

mod format;
mod fsutil;

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use format::{FORMAT_VERSION, FileMeta, Metadata, ParamMeta, Section, ShardHeader, UnitMeta};

use crate::error::EngineError;
use crate::layout::{FlatLayout, ShardState, Strategy, UnitLayout};
use format::{MAGIC, PREFIX};
use fsutil::{commit_tmp, create_tmp, exchange, io, sync_dir, write_atomic};

/// The largest step a checkpoint may record: an optimizer's bias correction takes the step as
/// an `i32`, and a run of two billion steps is a damaged file, not a run.
pub const MAX_STEP: u64 = i32::MAX as u64;

/// Name of the pointer file in the checkpoint root.
pub const LATEST: &str = "latest";
/// Name of the metadata file in a checkpoint directory.
pub const METADATA: &str = "metadata.json";

/// Checkpoint errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// An OS call failed.
    #[error("checkpoint {op} of {path} failed: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file is damaged (bad magic, checksum mismatch, truncated, unparsable).
    #[error("corrupt checkpoint file {path}: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    /// The checkpoint does not fit the model or optimizer it is loaded into.
    #[error("checkpoint {path} does not match: {reason}")]
    Mismatch { path: PathBuf, reason: String },
    /// No committed checkpoint under the root.
    #[error("no committed checkpoint in {0}")]
    NotFound(PathBuf),
    /// A bad argument (rank out of range, inconsistent state).
    #[error("checkpoint: {0}")]
    InvalidArgument(String),
}

impl CheckpointError {
    /// The OS error number, when the failure came from the OS.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            CheckpointError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

impl From<CheckpointError> for EngineError {
    fn from(e: CheckpointError) -> Self {
        EngineError::Checkpoint(e.to_string())
    }
}

/// Training progress saved with the checkpoint (by rank 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    /// Samples consumed by the data loader (global).
    pub data_position: u64,
    pub epoch: u64,
    /// Opaque RNG state.
    pub rng_state: Vec<u8>,
}

/// Directory name of the checkpoint of `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:09}")
}

fn incomplete_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("{}.incomplete", step_dir_name(step)))
}

fn shard_file_name(shard_rank: usize) -> String {
    format!("shard-{shard_rank:05}.bin")
}

/// Whether this rank writes a shard file (see the module docs).
pub fn is_writer(state: &ShardState) -> bool {
    state.rank == state.shard_rank
}

/// Step 1 (rank 0): reserves a fresh `step-N.incomplete/` under `root`.
///
/// # Errors
/// I/O errors naming the path.
pub fn begin_save(root: &Path, step: u64) -> Result<PathBuf, CheckpointError> {
    // The directories made now (the root and any missing parents, deepest first): each is in
    // its parent's entries only once that parent is synced; without it, a crash could lose the
    // first checkpoint along with them.
    let made: Vec<&Path> = root.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.exists()).collect();
    std::fs::create_dir_all(root).map_err(io("create directory", root))?;
    for dir in &made {
        if let Some(parent) = dir.parent() {
            sync_dir(parent)?;
        }
    }
    let dir = incomplete_dir(root, step);
    if dir.exists() {
        // A leftover of an interrupted save (or the old copy an exchange left): out of the way
        // under a name of its own, removed when it can be (a shard still open on NFS must
        // not fail this save).
        set_aside(root, &dir)?;
    }
    std::fs::create_dir(&dir).map_err(io("create directory", &dir))?;
    sync_dir(root)?;
    Ok(dir)
}

/// `shard_rank` must name one of `shards` shards.
fn check_shard_rank(shard_rank: usize, shards: usize) -> Result<(), CheckpointError> {
    if shard_rank >= shards {
        return Err(CheckpointError::InvalidArgument(format!("shard rank {shard_rank} out of range for {shards} shards")));
    }
    Ok(())
}

/// A unit's tensors must be `shard_len` elements each, and `slots` state slots.
fn check_unit_lengths(unit: &UnitLayout, master: usize, state: &[usize], slots: usize) -> Result<(), CheckpointError> {
    if master != unit.shard_len || state.len() != slots || state.iter().any(|l| *l != unit.shard_len) {
        return Err(CheckpointError::InvalidArgument(format!(
            "unit {:?}: buffers do not have shard_len {} elements and {slots} slots",
            unit.name, unit.shard_len
        )));
    }
    Ok(())
}

fn check_state(state: &ShardState) -> Result<usize, CheckpointError> {
    let slots = state.state.first().map_or(0, Vec::len);
    let units = state.layout.units.len();
    check_shard_rank(state.shard_rank, state.layout.world)?;
    if state.master.len() != units || state.state.len() != units {
        return Err(CheckpointError::InvalidArgument(format!(
            "state has {} master and {} state units, layout has {units}",
            state.master.len(),
            state.state.len()
        )));
    }
    for (u, unit) in state.layout.units.iter().enumerate() {
        let lens: Vec<usize> = state.state[u].iter().map(Vec::len).collect();
        check_unit_lengths(unit, state.master[u].len(), &lens, slots)?;
    }
    Ok(slots)
}

/// Step 2 (every rank): writes this rank's shard file into the reserved directory. Returns
/// the file written, or `None` for a rank that does not write ([`is_writer`]).
///
/// # Errors
/// Inconsistent state, or I/O errors naming the file (`ENOSPC`, `EIO`); the temp file is
/// removed on error.
pub fn save_shard(root: &Path, state: &ShardState) -> Result<Option<PathBuf>, CheckpointError> {
    check_state(state)?;
    if !is_writer(state) {
        return Ok(None);
    }
    write_shard(root, state).map(Some)
}

/// [`save_shard`] for a rank its caller chose to write its shard (one rank for every shard
/// rank: the engine picks, under hybrid sharding, the ranks of the first replica, wherever
/// the job placed them).
///
/// # Errors
/// As [`save_shard`].
pub fn write_shard(root: &Path, state: &ShardState) -> Result<PathBuf, CheckpointError> {
    check_state(state)?;
    write_shard_with(root, &state.info(), |u| {
        Ok::<_, CheckpointError>((
            Cow::Borrowed(&state.master[u][..]),
            state.state[u].iter().map(|v| Cow::Borrowed(&v[..])).collect(),
        ))
    })
}

/// What a checkpoint records of a rank's shard besides its tensors: what [`write_shard_with`]
/// and [`commit_info`] need, while the tensors come one unit at a time.
#[derive(Debug, Clone, Copy)]
pub struct ShardInfo<'a> {
    /// The strategy that produced the state.
    pub strategy: Strategy,
    /// Total ranks in the job.
    pub world: usize,
    /// Index of this rank in its sharding group.
    pub shard_rank: usize,
    /// Layout with `world` = sharding group size.
    pub layout: &'a FlatLayout,
    /// Completed optimizer steps.
    pub step: u64,
    /// Optimizer name.
    pub optimizer: &'a str,
    /// Optimizer state tensors per weight (AdamW 2, SGD 1).
    pub state_slots: usize,
    /// Dynamic loss scale (f16 mixed precision), if any.
    pub loss_scale: Option<f32>,
    /// Steps without overflow since the loss scale last changed.
    pub loss_scale_good_steps: u32,
}

impl ShardState {
    /// Everything but the tensors, for [`write_shard_with`] and [`commit_info`].
    pub fn info(&self) -> ShardInfo<'_> {
        ShardInfo {
            strategy: self.strategy,
            world: self.world,
            shard_rank: self.shard_rank,
            layout: &self.layout,
            step: self.step,
            optimizer: &self.optimizer,
            state_slots: self.state.first().map_or(0, Vec::len),
            loss_scale: self.loss_scale,
            loss_scale_good_steps: self.loss_scale_good_steps,
        }
    }
}

/// One unit's tensors as [`write_shard_with`] takes them: the fp32 master shard, then each
/// optimizer state slot, every one `shard_len` elements long.
pub type UnitTensors<'a> = (Cow<'a, [f32]>, Vec<Cow<'a, [f32]>>);

fn check_info(info: &ShardInfo<'_>) -> Result<(), CheckpointError> {
    check_shard_rank(info.shard_rank, info.layout.world)?;
    if info.state_slots > MAX_STATE_SLOTS {
        return Err(CheckpointError::InvalidArgument(format!(
            "{} optimizer state slots: expected at most {MAX_STATE_SLOTS}",
            info.state_slots
        )));
    }
    Ok(())
}

/// Writes this rank's shard file into the reserved directory, taking the tensors from `unit`
/// one unit at a time, in order: only one unit's tensors are held at once, so a rank whose
/// master and optimizer state fill most of its memory (or live in an offload tier) saves
/// without a second copy of them all. The header's space is reserved first (sized for the
/// widest checksums); each section's CRC-32 is computed as it is written, and the header goes
/// in last, before the fsync and the rename.
///
/// # Errors
/// `unit`'s own error; a unit whose tensors do not have the layout's `shard_len` elements and
/// `state_slots` slots; I/O errors naming the file (`ENOSPC`, `EIO`). The temp file is
/// removed on error.
pub fn write_shard_with<'s, E: From<CheckpointError>>(
    root: &Path,
    info: &ShardInfo<'_>,
    mut unit: impl FnMut(usize) -> Result<UnitTensors<'s>, E>,
) -> Result<PathBuf, E> {
    check_info(info)?;
    let slots = info.state_slots;
    let dir = incomplete_dir(root, info.step);
    let path = dir.join(shard_file_name(info.shard_rank));
    // Sections in file order; the CRCs are filled in as the data is written.
    let mut sections: Vec<Section> = info
        .layout
        .units
        .iter()
        .enumerate()
        .flat_map(|(unit, ul)| {
            (0..=slots).map(move |tensor| Section {
                unit,
                tensor,
                offset: 0,
                len: ul.shard_len,
                crc32: u32::MAX,
            })
        })
        .collect();
    let header = |sections: &[Section], data_start: u64| -> Result<(Vec<u8>, u64), CheckpointError> {
        let file_size = data_start + sections.iter().map(|s| 4 * s.len as u64).sum::<u64>();
        let header = ShardHeader {
            format_version: FORMAT_VERSION,
            step: info.step,
            shard_rank: info.shard_rank,
            shard_world: info.layout.world,
            state_slots: slots,
            data_start,
            file_size,
            sections: sections.to_vec(),
        };
        let json = serde_json::to_vec(&header)
            .map_err(|e| CheckpointError::InvalidArgument(format!("cannot encode shard header: {e}")))?;
        Ok((json, file_size))
    };
    // The header's length depends on the offsets' digits: iterate to a fixed point, with every
    // CRC at its widest (u32::MAX), so the real header always fits the space reserved.
    let mut data_start = 4096u64;
    loop {
        let mut off = data_start;
        for s in &mut sections {
            s.offset = off;
            off += 4 * s.len as u64;
        }
        let (json, _) = header(&sections, data_start)?;
        let need = (PREFIX + json.len()).div_ceil(4096) as u64 * 4096;
        if need <= data_start {
            break;
        }
        data_start = need;
    }
    let (file, tmp) = create_tmp(&path)?;
    let failed = |op: &'static str, source: std::io::Error| CheckpointError::Io {
        op,
        path: tmp.clone(),
        source,
    };
    let written = (|| -> Result<File, E> {
        let mut w = BufWriter::with_capacity(1 << 20, file);
        w.write_all(&vec![0u8; data_start as usize]).map_err(|e| failed("write", e))?;
        let mut k = 0;
        for (u, ul) in info.layout.units.iter().enumerate() {
            let (master, state) = unit(u)?;
            let lens: Vec<usize> = state.iter().map(|s| s.len()).collect();
            check_unit_lengths(ul, master.len(), &lens, slots)?;
            for v in std::iter::once(&master).chain(&state) {
                let bytes = format::f32_bytes(v);
                sections[k].crc32 = crc32fast::hash(&bytes);
                w.write_all(&bytes).map_err(|e| failed("write", e))?;
                k += 1;
            }
        }
        let file = w.into_inner().map_err(|e| failed("write", e.into_error()))?;
        let (json, file_size) = header(&sections, data_start)?;
        if (PREFIX + json.len()) as u64 > data_start {
            return Err(CheckpointError::InvalidArgument(format!(
                "shard header of {} bytes outgrew the {data_start} reserved for it",
                json.len()
            ))
            .into());
        }
        let len = file.metadata().map_err(|e| failed("stat", e))?.len();
        if len != file_size {
            return Err(failed("write", std::io::Error::other(format!("{len} bytes written, expected {file_size}"))).into());
        }
        let mut head = Vec::with_capacity(PREFIX + json.len());
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&(json.len() as u32).to_le_bytes());
        head.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
        head.extend_from_slice(&json);
        file.write_all_at(&head, 0).map_err(|e| failed("write", e))?;
        Ok(file)
    })();
    let file = match written {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    commit_tmp(file, &tmp, &path)?;
    Ok(path)
}

/// The longest shard header read: about 100 bytes a section, so room for a million sections.
const MAX_HEADER_BYTES: u64 = 128 << 20;

/// Opens a checkpoint file for reading: only a regular file (a FIFO in its place would block the
/// open, and the load with it, forever; a directory or device is no checkpoint file).
fn open_regular(path: &Path) -> Result<File, CheckpointError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io("open", path))?;
    let kind = f.metadata().map_err(io("stat", path))?.file_type();
    if !kind.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_dir() {
            "a directory"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "a device or special file"
        };
        return Err(CheckpointError::Corrupt { path: path.to_path_buf(), reason: format!("not a regular file: {what}") });
    }
    Ok(f)
}

/// The largest `metadata.json` or `latest` read (a sparse file of terabytes is no metadata).
const MAX_SMALL_FILE: u64 = 1 << 30;

/// Reads a small checkpoint file (`metadata.json`, `latest`) whole, through [`open_regular`].
fn read_small(path: &Path) -> Result<Vec<u8>, std::io::Error> {
    let f = open_regular(path).map_err(|e| match e {
        CheckpointError::Io { source, .. } => source,
        e => std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
    })?;
    let mut buf = Vec::new();
    f.take(MAX_SMALL_FILE + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > MAX_SMALL_FILE {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("larger than {MAX_SMALL_FILE} bytes")));
    }
    Ok(buf)
}

/// Reads and checks a shard file's header (magic, header CRC, declared size).
/// Returns the header, its CRC-32, the file's size and the file (open, so what is read next is
/// the file whose header was checked).
fn read_header(path: &Path) -> Result<(ShardHeader, u32, u64, File), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        reason,
    };
    let mut f = open_regular(path)?;
    let size = f.metadata().map_err(io("stat", path))?.len();
    let mut prefix = [0u8; PREFIX];
    if size < PREFIX as u64 {
        return Err(corrupt(format!("truncated: {size} bytes")));
    }
    f.read_exact(&mut prefix).map_err(io("read", path))?;
    if prefix[..8] != MAGIC {
        return Err(corrupt("bad magic (not an rsrun shard file)".into()));
    }
    let len = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as u64;
    let crc = u32::from_le_bytes([prefix[12], prefix[13], prefix[14], prefix[15]]);
    if len > MAX_HEADER_BYTES {
        return Err(corrupt(format!(
            "header length {len} bytes, more than the {MAX_HEADER_BYTES} any shard header needs"
        )));
    }
    if PREFIX as u64 + len > size {
        return Err(corrupt(format!("truncated header: {size} bytes")));
    }
    let mut json = vec![0u8; len as usize];
    f.read_exact(&mut json).map_err(io("read", path))?;
    if crc32fast::hash(&json) != crc {
        return Err(corrupt("header checksum mismatch".into()));
    }
    let header: ShardHeader =
        serde_json::from_slice(&json).map_err(|e| corrupt(format!("bad header: {e}")))?;
    if header.format_version != FORMAT_VERSION {
        return Err(corrupt(format!(
            "format version {} (expected {FORMAT_VERSION})",
            header.format_version
        )));
    }
    if header.file_size != size {
        return Err(corrupt(format!(
            "truncated or extended: {size} bytes, header says {}",
            header.file_size
        )));
    }
    Ok((header, crc, size, f))
}

/// Whether shard header `h` (of a file of `size` bytes) holds exactly one section per unit
/// and tensor (master and `slots` state slots), each of its unit's `shard_lens` elements and
/// within the file.
fn sections_fit(h: &ShardHeader, shard_lens: &[usize], slots: usize, size: u64) -> bool {
    // Saturating: a hostile `state_slots` must fail the comparison, not overflow.
    let expect = shard_lens.len().saturating_mul(slots.saturating_add(1));
    if h.sections.len() != expect || h.state_slots != slots {
        return false;
    }
    // (As many as the header holds sections.)
    let mut seen = vec![false; expect];
    h.sections.iter().all(|s| {
            s.unit < shard_lens.len()
                && s.tensor <= slots
                && s.len == shard_lens[s.unit]
                && !std::mem::replace(&mut seen[s.unit * (slots + 1) + s.tensor], true)
                && (s.len as u64)
                    .checked_mul(4)
                    .and_then(|b| s.offset.checked_add(b))
                    .is_some_and(|end| end <= size)
    })
}

/// Step 3 (rank 0, after every rank's [`save_shard`]): checks the shard files, writes
/// `metadata.json`, publishes the directory and moves `latest` to it; then keeps only the
/// newest `keep_last` checkpoints (0 keeps all). Returns the checkpoint directory.
///
/// # Errors
/// A missing or damaged shard file, or I/O errors naming the path. `latest` is unchanged
/// unless the call succeeded.
pub fn commit(
    root: &Path,
    state: &ShardState,
    progress: &Progress,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    check_state(state)?;
    commit_info(root, &state.info(), progress, keep_last)
}

/// [`commit`] from a shard's [`ShardInfo`] (rank 0's, with the layout and step the checkpoint
/// records), without its tensors.
///
/// # Errors
/// As [`commit`].
pub fn commit_info(
    root: &Path,
    state: &ShardInfo<'_>,
    progress: &Progress,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    check_info(state)?;
    let slots = state.state_slots;
    let inc = incomplete_dir(root, state.step);
    let name = step_dir_name(state.step);
    let mut files = Vec::with_capacity(state.layout.world);
    let shard_lens: Vec<usize> = state.layout.units.iter().map(|u| u.shard_len).collect();
    for j in 0..state.layout.world {
        let path = inc.join(shard_file_name(j));
        let (h, crc, size, _) = read_header(&path)?;
        if h.step != state.step || h.shard_rank != j || h.shard_world != state.layout.world {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!(
                    "holds step {} shard {}/{}, expected step {} shard {j}/{}",
                    h.step, h.shard_rank, h.shard_world, state.step, state.layout.world
                ),
            });
        }
        // What a load checks against `metadata.json`, checked before it is written: a shard
        // saved with another layout or optimizer would make a checkpoint no load accepts, and
        // moving `latest` to it would prune the good ones.
        if !sections_fit(&h, &shard_lens, slots, size) {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!(
                    "its {} sections and {} state slots do not match the layout's {} units and {slots} slots",
                    h.sections.len(),
                    h.state_slots,
                    shard_lens.len()
                ),
            });
        }
        files.push(FileMeta {
            name: shard_file_name(j),
            shard_rank: j,
            size,
            header_crc32: crc,
        });
    }
    let mut meta = Metadata {
        format_version: FORMAT_VERSION,
        step: state.step,
        strategy: state.strategy.name().to_string(),
        world: state.world,
        shard_world: state.layout.world,
        optimizer: state.optimizer.to_string(),
        state_slots: slots,
        loss_scale: state.loss_scale,
        loss_scale_good_steps: state.loss_scale_good_steps,
        data_position: progress.data_position,
        epoch: progress.epoch,
        rng_state: format::to_hex(&progress.rng_state),
        units: format::units_meta(state.layout),
        files,
        checksum: None,
    };
    meta.checksum = Some(meta.crc());
    let json = serde_json::to_vec_pretty(&meta)
        .map_err(|e| CheckpointError::InvalidArgument(format!("cannot encode metadata: {e}")))?;
    write_atomic(&inc.join(METADATA), &json)?;
    let fin = root.join(&name);
    let replaced = root.join(format!("{name}.replaced"));
    if fin.exists() && exchange(&inc, &fin)? {
        // Re-saving a step: the new copy and the old one swapped names in one step, so a
        // crash leaves `step-N` whole, old or new; the old copy is now the `.incomplete`
        // directory, which the next save of this step removes if we do not get to it.
        // The old copy (now named `.incomplete`) goes with the leftovers swept once `latest`
        // names the new one.
    } else {
        if fin.exists() {
            // A file system without RENAME_EXCHANGE: move the old copy aside first. A crash
            // before the next rename leaves `latest` naming `step-N`, and [`latest`] loads
            // `step-N.replaced`, the same checkpoint.
            if replaced.exists() {
                set_aside(root, &replaced)?;
            }
            std::fs::rename(&fin, &replaced).map_err(io("rename", &fin))?;
        }
        std::fs::rename(&inc, &fin).map_err(io("rename", &inc))?;
    }
    sync_dir(root)?;
    write_atomic(&root.join(LATEST), format!("{name}\n").as_bytes())?;
    // `latest` names the new checkpoint: the save is done. What follows only frees space, and a
    // failure there (an old step someone made read-only, a shard still open on NFS) is logged,
    // never a failed save: that would stop a run whose checkpoint is whole, at every save.
    // Leftovers first (this step's own `.replaced` copy among them), so that a checkpoint an
    // interrupted re-save left aside counts among those kept.
    sweep_leftovers(root);
    if keep_last > 0 {
        // Only this run's line counts: checkpoints of later steps left by another run (a
        // `--resume` from an older step into the same root) are not this run's to keep or to
        // count, else each save would delete this run's previous one.
        match committed(root) {
            Ok(mut all) => {
                all.retain(|(step, _)| *step <= state.step);
                for (_, dir) in all.iter().rev().skip(keep_last) {
                    if *dir != fin {
                        retire_checkpoint(root, dir);
                    }
                }
            }
            Err(e) => tracing::warn!(root = %root.display(), "old checkpoints not pruned: {e}"),
        }
    }
    Ok(fin)
}

/// Suffix of a checkpoint directory being deleted: [`committed`] never counts it.
const DELETING: &str = ".deleting";

/// Deletes a committed checkpoint without ever leaving `step-N` with its `metadata.json` but
/// not all of its shards: it is renamed to `step-N.deleting` first (durably), then removed.
/// Failures are logged.
fn retire_checkpoint(root: &Path, dir: &Path) {
    let mut aside = dir.as_os_str().to_owned();
    aside.push(DELETING);
    let aside = PathBuf::from(aside);
    if let Err(e) = std::fs::rename(dir, &aside) {
        tracing::warn!(checkpoint = %dir.display(), "old checkpoint not pruned: cannot rename it to {}: {e}", aside.display());
        return;
    }
    if let Err(e) = sync_dir(root) {
        tracing::warn!(root = %root.display(), "{e}");
    }
    discard(&aside);
}

/// Removes a directory that no checkpoint needs; a failure is logged.
fn discard(dir: &Path) {
    #[cfg(test)]
    if tests::FAIL_DISCARD.with(std::cell::Cell::get) {
        tracing::warn!(dir = %dir.display(), "not removed (test hook)");
        return;
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!(dir = %dir.display(), "could not remove it ({e}); it holds no checkpoint that is needed: remove it by hand");
    }
}

/// Renames `dir`, which no checkpoint needs, to a name of its own ending in [`DELETING`]
/// (durably), then removes it; a failure to remove is logged ([`sweep_leftovers`] tries again).
fn set_aside(root: &Path, dir: &Path) -> Result<(), CheckpointError> {
    let mut aside = dir.as_os_str().to_owned();
    aside.push(format!(".{:016x}{DELETING}", crate::comm::random_token()));
    let aside = PathBuf::from(aside);
    std::fs::rename(dir, &aside).map_err(io("rename a leftover", dir))?;
    sync_dir(root)?;
    discard(&aside);
    Ok(())
}

/// Removes what interrupted saves and prunes left in `root`: `step-N.deleting` (and the names
/// [`set_aside`] gives), `step-N.incomplete` (an interrupted save's, or the old copy a re-save
/// swapped out: only rank 0 commits, after its save is whole, so none is in progress), and
/// `step-N.replaced` once `step-N` is committed; a `step-N.replaced` without `step-N` (the
/// only copy of that step) is renamed back to `step-N`.
fn sweep_leftovers(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("step-") {
            continue;
        }
        let path = entry.path();
        if name.ends_with(DELETING) || name.ends_with(".incomplete") {
            discard(&path);
        } else if let Some(step) = name.strip_suffix(".replaced") {
            if root.join(step).join(METADATA).is_file() {
                discard(&path);
            } else if !root.join(step).exists() && path.join(METADATA).is_file() {
                // A crash between a re-save's two renames, and the run went on (from this copy,
                // which `latest` led to): it is the only copy of that step, so it gets its name
                // back and is a committed checkpoint again, kept or pruned as any other.
                match std::fs::rename(&path, root.join(step)).map_err(io("rename", &path)).and_then(|()| sync_dir(root)) {
                    Ok(()) => tracing::info!(checkpoint = step, root = %root.display(), "a checkpoint left aside by an interrupted re-save has its name back"),
                    Err(e) => tracing::warn!(root = %root.display(), "{e}"),
                }
            }
        }
    }
}

/// The three save steps in one process: `states` are the states of every rank (or at least
/// of every writer, and rank 0's first).
///
/// # Errors
/// As [`begin_save`], [`save_shard`] and [`commit`].
pub fn save_local(
    root: &Path,
    states: &[ShardState],
    progress: &Progress,
    keep_last: usize,
) -> Result<PathBuf, CheckpointError> {
    let Some(first) = states.first() else {
        return Err(CheckpointError::InvalidArgument("no state to save".into()));
    };
    begin_save(root, first.step)?;
    for s in states {
        save_shard(root, s)?;
    }
    commit(root, first, progress, keep_last)
}

/// Committed checkpoints under `root` (directories `step-N` with a `metadata.json`), oldest
/// first.
///
/// # Errors
/// The root cannot be listed.
pub fn committed(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io("list", root))? {
        let entry = entry.map_err(io("list", root))?;
        let name = entry.file_name();
        let Some(step) = name
            .to_str()
            .and_then(|n| n.strip_prefix("step-"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(METADATA).is_file() {
            out.push((step, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The checkpoint `latest` points to; if `latest` is missing, or names a directory that is gone (a
/// crash while a step was re-saved), the newest committed checkpoint.
///
/// # Errors
/// [`CheckpointError::NotFound`] when there is none (no `latest`, no committed directory, or no
/// root); [`CheckpointError::Corrupt`] when `latest` names a directory without its
/// `metadata.json` (a committed checkpoint always has one, so it was damaged: resuming from an
/// older one instead would silently lose steps); [`CheckpointError::Io`] when `latest` or the
/// root cannot be read (permissions, I/O errors, a `latest` that is not text): never taken
/// for "no checkpoint", which would start the job over.
pub fn latest(root: &Path) -> Result<PathBuf, CheckpointError> {
    let pointer = root.join(LATEST);
    match read_small(&pointer).and_then(|b| String::from_utf8(b).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))) {
        Ok(s) => {
            let name = s.trim();
            // `latest` names a checkpoint of this root: one path component, never `..` or `/x`.
            let component = std::path::Path::new(name).components().collect::<Vec<_>>();
            if !name.is_empty() && !matches!(component[..], [std::path::Component::Normal(_)]) {
                return Err(CheckpointError::Corrupt {
                    path: pointer,
                    reason: format!("names {name:?}, expected a checkpoint directory of {} such as step-000000100", root.display()),
                });
            }
            let dir = root.join(name);
            if !name.is_empty() && dir.join(METADATA).is_file() {
                return Ok(dir);
            }
            if !name.is_empty() && dir.is_dir() {
                return Err(CheckpointError::Corrupt {
                    path: dir.join(METADATA),
                    reason: format!(
                        "missing, though `latest` names {name}: the checkpoint is damaged (resume from another step-N explicitly, or remove `latest` to start from the newest intact one)"
                    ),
                });
            }
            // A crash between the two renames of a re-save on a file system without
            // RENAME_EXCHANGE: the checkpoint `latest` names waits under its aside name.
            let aside = root.join(format!("{name}.replaced"));
            if !name.is_empty() && !name.contains('/') && aside.join(METADATA).is_file() {
                tracing::warn!(latest = name, root = %root.display(), "`latest` names a checkpoint that was being re-saved; using its previous copy");
                return Ok(aside);
            }
            tracing::warn!(latest = name, root = %root.display(), "`latest` names no checkpoint; using the newest committed one");
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("read", &pointer)(e)),
    }
    match committed(root) {
        Ok(c) => c
            .last()
            .map(|(_, d)| d.clone())
            .ok_or_else(|| CheckpointError::NotFound(root.to_path_buf())),
        Err(CheckpointError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Err(CheckpointError::NotFound(root.to_path_buf()))
        }
        Err(e) => Err(e),
    }
}

/// Reads `metadata.json` of a checkpoint directory.
///
/// # Errors
/// Missing or unparsable metadata, or another format version.
pub fn read_metadata(dir: &Path) -> Result<Metadata, CheckpointError> {
    let path = dir.join(METADATA);
    let bytes = read_small(&path).map_err(io("read", &path))?;
    let meta: Metadata = serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Corrupt {
        path: path.clone(),
        reason: format!("bad metadata: {e}"),
    })?;
    if meta.format_version != FORMAT_VERSION {
        return Err(CheckpointError::Corrupt {
            path,
            reason: format!(
                "format version {} (expected {FORMAT_VERSION})",
                meta.format_version
            ),
        });
    }
    if let Some(want) = meta.checksum
        && meta.crc() != want
    {
        return Err(CheckpointError::Corrupt {
            path,
            reason: format!("checksum mismatch (metadata says {want:#010x}, its fields give {:#010x}): changed after it was written", meta.crc()),
        });
    }
    if meta.step > MAX_STEP {
        return Err(CheckpointError::Corrupt {
            path,
            reason: format!("step {}: expected at most {MAX_STEP}", meta.step),
        });
    }
    if let Some(scale) = meta.loss_scale
        && !(scale.is_finite() && scale > 0.0)
    {
        return Err(CheckpointError::Corrupt { path, reason: format!("loss_scale {scale}, expected a finite number above 0") });
    }
    Ok(meta)
}

/// An opened checkpoint whose metadata was verified; its shard files are opened and checked one
/// at a time ([`Reader::shard`]), only those a load needs: a rank of a ZeRO-3 job of 1,024 ranks
/// reads the one or two shards that overlap its own, not 1,024 headers with 1,024 descriptors
/// held open.
struct Reader {
    dir: PathBuf,
    meta: Metadata,
    layout: FlatLayout,
    /// Shard files opened and checked so far (at most [`MAX_OPEN_SHARDS`]), kept open: a load
    /// that reads a shard in several batches (or checks it first, then installs it) reads the
    /// files it checked, even if the directory is replaced or pruned meanwhile.
    open: std::sync::Mutex<Vec<(usize, std::sync::Arc<Shard>)>>,
}

/// Most shard files a [`Reader`] keeps open (a load from many more saved shards reopens the
/// rest as needed).
const MAX_OPEN_SHARDS: usize = 64;

/// Most optimizer state tensors per weight a checkpoint may declare (AdamW keeps 2, SGD 1).
const MAX_STATE_SLOTS: usize = 8;

/// One shard file of a [`Reader`], its header checked against `metadata.json`.
struct Shard {
    path: PathBuf,
    file: File,
    header: ShardHeader,
}

impl Reader {
    fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let meta = read_metadata(dir)?;
        let layout = meta.layout();
        let meta_path = dir.join(METADATA);
        let bad = |reason: String| CheckpointError::Corrupt {
            path: meta_path.clone(),
            reason,
        };
        if meta.files.len() != meta.shard_world || meta.shard_world == 0 {
            return Err(bad(format!(
                "{} files for {} shards",
                meta.files.len(),
                meta.shard_world
            )));
        }
        if meta.state_slots > MAX_STATE_SLOTS {
            // Before a load allocates that many tensors per unit.
            return Err(bad(format!(
                "state_slots {}: expected at most {MAX_STATE_SLOTS} (an optimizer keeps a few tensors per weight)",
                meta.state_slots
            )));
        }
        for u in &meta.units {
            check_unit(u, meta.shard_world).map_err(|reason| bad(format!("unit {:?}: {reason}", u.name)))?;
        }
        for (j, fm) in meta.files.iter().enumerate() {
            // Shard j's file is always named for j: a name from the file may not lead elsewhere
            // (`../x`, an absolute path).
            if fm.name != shard_file_name(j) {
                return Err(bad(format!("file {j} is named {:?}, expected {:?}", fm.name, shard_file_name(j))));
            }
        }
        // Every shard file holds each unit's sections: the sizes the parameter table implies
        // must fit the sizes recorded for the files (which `Reader::shard` checks against each
        // file it opens, and an export against every file before it sizes anything).
        let per_shard = meta.units.iter().try_fold(0u64, |acc, u| {
            (u.shard_len as u64)
                .checked_mul(4)
                .and_then(|b| b.checked_mul(meta.state_slots as u64 + 1))
                .and_then(|b| acc.checked_add(b))
        });
        for fm in &meta.files {
            if per_shard.is_none_or(|need| need > fm.size) {
                return Err(bad(format!(
                    "its units need {} bytes of sections in each shard file, {} holds {}",
                    per_shard.map_or_else(|| "more than 2^64".to_owned(), |n| n.to_string()),
                    fm.name,
                    fm.size
                )));
            }
        }
        Ok(Reader {
            dir: dir.to_path_buf(),
            meta,
            layout,
            open: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Shard file `j`, opened and checked once ([`Reader::open`] keeps up to
    /// [`MAX_OPEN_SHARDS`] of them).
    fn shard_kept(&self, j: usize) -> Result<std::sync::Arc<Shard>, CheckpointError> {
        // A poisoned lock only means another reader's thread panicked between push and return:
        // the list itself is whole.
        let mut open = self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((_, s)) = open.iter().find(|(k, _)| *k == j) {
            return Ok(s.clone());
        }
        let shard = std::sync::Arc::new(self.shard(j)?);
        if open.len() < MAX_OPEN_SHARDS {
            open.push((j, shard.clone()));
        }
        Ok(shard)
    }

    /// Opens shard file `j` and checks its header against `metadata.json`.
    fn shard(&self, j: usize) -> Result<Shard, CheckpointError> {
        let meta = &self.meta;
        let fm = &meta.files[j];
        let path = self.dir.join(&fm.name);
        let (h, crc, size, file) = read_header(&path)?;
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: path.clone(),
            reason,
        };
        if size != fm.size {
            return Err(corrupt(format!("{size} bytes, metadata says {}", fm.size)));
        }
        if crc != fm.header_crc32 || fm.shard_rank != j || h.shard_rank != j {
            return Err(corrupt(
                "header does not match metadata.json (file from another checkpoint?)".into(),
            ));
        }
        let shard_lens: Vec<usize> = meta.units.iter().map(|u| u.shard_len).collect();
        if !sections_fit(&h, &shard_lens, meta.state_slots, size) || h.step != meta.step {
            return Err(corrupt("sections do not match metadata.json".into()));
        }
        Ok(Shard { path, file, header: h })
    }

    /// Reads section (`unit`, `tensor`) of `shard` through its CRC-32, [`SECTION_CHUNK`] bytes at
    /// a time, copying elements `want` (section coordinates) into `out` (`want.len()` long): a
    /// rank that keeps a slice of a bigger saved shard (a DDP checkpoint loaded into ZeRO-3)
    /// never holds the whole section, and the check still covers every byte of it.
    fn section_into(
        &self,
        shard: &Shard,
        unit: usize,
        tensor: usize,
        want: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let Shard { path, file, header } = shard;
        let Some(s) = header
            .sections
            .iter()
            .find(|s| s.unit == unit && s.tensor == tensor)
        else {
            return Err(CheckpointError::Corrupt {
                path: path.clone(),
                reason: format!("no section for unit {unit} tensor {tensor}"),
            });
        };
        if want.end > s.len || want.start > want.end || out.len() != want.len() {
            return Err(CheckpointError::InvalidArgument(format!(
                "elements {want:?} of a section of {} into {}",
                s.len,
                out.len()
            )));
        }
        // (`Reader::shard` checked `offset + 4 * len` within the file.)
        let total = 4 * s.len;
        let mut buf = vec![0u8; total.min(SECTION_CHUNK)];
        let mut hasher = crc32fast::Hasher::new();
        let mut pos = 0;
        while pos < total {
            let n = (total - pos).min(SECTION_CHUNK);
            let chunk = &mut buf[..n];
            file.read_exact_at(chunk, s.offset + pos as u64).map_err(io("read", path))?;
            hasher.update(chunk);
            // Elements of this chunk (SECTION_CHUNK is a multiple of 4) that were asked for.
            let (first, last) = (pos / 4, (pos + n) / 4);
            let (a, b) = (want.start.max(first), want.end.min(last));
            if a < b {
                let bytes = &chunk[4 * (a - first)..4 * (b - first)];
                for (o, c) in out[a - want.start..b - want.start].iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            pos += n;
        }
        if hasher.finalize() != s.crc32 {
            return Err(CheckpointError::Corrupt {
                path: path.clone(),
                reason: format!(
                    "checksum mismatch in unit {:?} {} (offset {})",
                    self.meta.units[unit].name,
                    tensor_name(tensor),
                    s.offset
                ),
            });
        }
        Ok(())
    }

    /// Fills every request: `(unit, tensor, range, out)` receives elements `range` (unit
    /// coordinates, within `numel`) of `tensor` of `unit`. Shard by shard, each opened only when
    /// a request overlaps it (and kept open, up to [`MAX_OPEN_SHARDS`], for the next call).
    fn gather_all(&self, requests: &mut [(usize, usize, std::ops::Range<usize>, &mut [f32])]) -> Result<(), CheckpointError> {
        for j in 0..self.meta.shard_world {
            let overlaps = |unit: usize, range: &std::ops::Range<usize>| {
                let old = self.layout.units[unit].shard_range(j);
                old.start.max(range.start) < old.end.min(range.end)
            };
            if !requests.iter().any(|(u, _, range, _)| overlaps(*u, range)) {
                continue;
            }
            let shard = self.shard_kept(j)?;
            for (unit, tensor, range, out) in requests.iter_mut() {
                let old = self.layout.units[*unit].shard_range(j);
                let (start, end) = (old.start.max(range.start), old.end.min(range.end));
                if start >= end {
                    continue;
                }
                self.section_into(
                    &shard,
                    *unit,
                    *tensor,
                    start - old.start..end - old.start,
                    &mut out[start - range.start..end - range.start],
                )?;
            }
        }
        Ok(())
    }
}

/// A unit of `metadata.json` must be what the engine's layout ([`UnitLayout::new`]) makes of its
/// parameters over `shard_world` (at least 1) shards: each numel the product of its shape, offsets
/// back to back from 0, and the shard length and padding it derives. The reason when it is not.
fn check_unit(u: &UnitMeta, shard_world: usize) -> Result<(), String> {
    for p in &u.params {
        if p.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(p.numel) {
            return Err(format!("parameter {:?} has numel {} for shape {:?}", p.name, p.numel, p.shape));
        }
    }
    let specs: Vec<(String, Vec<usize>)> = u.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect();
    let want = UnitLayout::new(u.name.clone(), &specs, shard_world).map_err(|e| e.to_string())?;
    if let Some((p, w)) = u.params.iter().zip(&want.params).find(|(p, w)| p.offset != w.offset) {
        return Err(format!("parameter {:?} at offset {}, expected {}", p.name, p.offset, w.offset));
    }
    if u.numel != want.numel {
        return Err(format!("numel {}, its parameters hold {}", u.numel, want.numel));
    }
    if (u.shard_len, u.padded_numel) != (want.shard_len, want.padded_numel) {
        return Err(format!(
            "shard_len {} and padded_numel {} for numel {} over {shard_world} shards (expected {} and {})",
            u.shard_len, u.padded_numel, u.numel, want.shard_len, want.padded_numel
        ));
    }
    Ok(())
}

fn tensor_name(tensor: usize) -> String {
    match tensor {
        0 => "master".into(),
        s => format!("state slot {}", s - 1),
    }
}

/// What to load a checkpoint into: the target layout (its `world` is the new sharding group
/// size), strategy, world, rank and shard rank, and the optimizer's name.
#[derive(Debug, Clone, Copy)]
pub struct LoadTarget<'a> {
    pub layout: &'a FlatLayout,
    pub strategy: Strategy,
    pub world: usize,
    pub rank: usize,
    pub shard_rank: usize,
    pub optimizer: &'a str,
}

/// Loads checkpoint directory `dir` for `target`, resharding as needed: the whole shard at
/// once (see [`ShardLoad`] to take it a batch of units at a time).
///
/// # Errors
/// Damaged files ([`CheckpointError::Corrupt`] naming the file), a different model or
/// optimizer ([`CheckpointError::Mismatch`]), I/O errors.
pub fn load(
    dir: &Path,
    target: &LoadTarget<'_>,
) -> Result<(ShardState, Progress), CheckpointError> {
    let l = ShardLoad::open(dir, target)?;
    let (master, state) = l.read_units(0..target.layout.units.len())?.into_iter().unzip();
    Ok((
        ShardState {
            strategy: target.strategy,
            world: target.world,
            rank: target.rank,
            shard_rank: target.shard_rank,
            layout: target.layout.clone(),
            step: l.step(),
            optimizer: l.reader.meta.optimizer.clone(),
            master,
            state,
            loss_scale: l.loss_scale(),
            loss_scale_good_steps: l.loss_scale_good_steps(),
        },
        l.progress,
    ))
}

/// One unit of a rank's shard as [`ShardLoad::read_units`] returns it: the fp32 master shard
/// and each optimizer state slot.
pub type UnitState = (Vec<f32>, Vec<Vec<f32>>);

/// Most bytes of a rank's shard [`ShardLoad::batches`] puts in one batch (a unit bigger than
/// this is a batch of its own).
pub const LOAD_BATCH_BYTES: usize = 256 << 20;

/// Tests' override of [`LOAD_BATCH_BYTES`] (0: none), so that a small model's load runs the
/// several-batch path too. Batching changes only when units are read, never what is loaded.
#[cfg(test)]
pub(crate) static TEST_LOAD_BATCH_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn load_batch_bytes() -> usize {
    #[cfg(test)]
    {
        let v = TEST_LOAD_BATCH_BYTES.load(std::sync::atomic::Ordering::Relaxed);
        if v > 0 {
            return v;
        }
    }
    LOAD_BATCH_BYTES
}

/// A checkpoint opened to load one rank's shard under a target layout (resharding as needed), a
/// batch of units at a time ([`ShardLoad::read_units`]), so a rank whose state fills most of its
/// memory (or goes to an offload tier) never holds a second copy of all of it. The metadata,
/// model and optimizer were checked at [`ShardLoad::open`]; each shard file's header and every
/// section's CRC-32 are checked as they are read.
pub struct ShardLoad<'a> {
    reader: Reader,
    target: LoadTarget<'a>,
    progress: Progress,
}

impl<'a> ShardLoad<'a> {
    /// Opens `dir` (a checkpoint directory) for `target`.
    ///
    /// # Errors
    /// Damaged metadata ([`CheckpointError::Corrupt`]), a different model or optimizer
    /// ([`CheckpointError::Mismatch`]), a shard rank outside the target layout, I/O errors.
    pub fn open(dir: &Path, target: &LoadTarget<'a>) -> Result<Self, CheckpointError> {
        let r = Reader::open(dir)?;
        let mismatch = |reason: String| CheckpointError::Mismatch {
            path: dir.to_path_buf(),
            reason,
        };
        r.layout
            .check_same_model(target.layout)
            .map_err(|e| mismatch(e.to_string()))?;
        if r.meta.optimizer != target.optimizer {
            return Err(mismatch(format!(
                "saved with optimizer {:?}, loading into {:?}",
                r.meta.optimizer, target.optimizer
            )));
        }
        check_shard_rank(target.shard_rank, target.layout.world)?;
        let rng_state = format::from_hex(&r.meta.rng_state).ok_or_else(|| CheckpointError::Corrupt {
            path: r.dir.join(METADATA),
            reason: "bad rng_state hex".into(),
        })?;
        let progress = Progress {
            data_position: r.meta.data_position,
            epoch: r.meta.epoch,
            rng_state,
        };
        Ok(ShardLoad {
            reader: r,
            target: *target,
            progress,
        })
    }

    /// The saved step.
    pub fn step(&self) -> u64 {
        self.reader.meta.step
    }

    /// The saved training progress (data position, epoch, RNG state).
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Optimizer state tensors per weight in the checkpoint.
    pub fn state_slots(&self) -> usize {
        self.reader.meta.state_slots
    }

    /// The saved dynamic loss scale, if any (checked finite and above 0).
    pub fn loss_scale(&self) -> Option<f32> {
        self.reader.meta.loss_scale
    }

    /// Steps without overflow since the loss scale last changed.
    pub fn loss_scale_good_steps(&self) -> u32 {
        self.reader.meta.loss_scale_good_steps
    }

    /// The target's units in consecutive batches of at most [`LOAD_BATCH_BYTES`] of this
    /// rank's master and optimizer state (at least one unit each), covering every unit in order.
    pub fn batches(&self) -> Vec<std::ops::Range<usize>> {
        self.batches_within(load_batch_bytes())
    }

    /// [`ShardLoad::batches`] of at most `budget` bytes each.
    fn batches_within(&self, budget: usize) -> Vec<std::ops::Range<usize>> {
        let per = |u: &UnitLayout| u.shard_len.saturating_mul(4).saturating_mul(1 + self.state_slots());
        let units = &self.target.layout.units;
        let mut out = Vec::new();
        let mut first = 0;
        while first < units.len() {
            let (mut end, mut bytes) = (first + 1, per(&units[first]));
            while end < units.len() && bytes.saturating_add(per(&units[end])) <= budget {
                bytes += per(&units[end]);
                end += 1;
            }
            out.push(first..end);
            first = end;
        }
        out
    }

    /// This rank's master shard and optimizer state slots of each target unit in `units`, in
    /// the target layout (padding zero), read from the saved shards that overlap them (each
    /// opened once, and its sections' CRC-32s checked).
    ///
    /// # Errors
    /// Damaged shard files (naming the file), I/O errors, units outside the target layout.
    pub fn read_units(&self, units: std::ops::Range<usize>) -> Result<Vec<UnitState>, CheckpointError> {
        let layout = self.target.layout;
        if units.end > layout.units.len() || units.start > units.end {
            return Err(CheckpointError::InvalidArgument(format!(
                "units {units:?}: the layout has {}",
                layout.units.len()
            )));
        }
        let slots = self.state_slots();
        // Every tensor of every unit asked for, padding left at zero.
        let mut tensors: Vec<Vec<Vec<f32>>> = layout.units[units.clone()]
            .iter()
            .map(|unit| (0..=slots).map(|_| vec![0.0f32; unit.shard_len]).collect())
            .collect();
        {
            let mut requests = Vec::with_capacity(tensors.len() * (1 + slots));
            for (ui, outs) in units.clone().zip(tensors.iter_mut()) {
                let unit = &layout.units[ui];
                let range = unit.shard_range(self.target.shard_rank);
                let valid = range.start.min(unit.numel)..range.end.min(unit.numel);
                for (tensor, out) in outs.iter_mut().enumerate() {
                    let n = valid.len();
                    requests.push((ui, tensor, valid.clone(), &mut out[..n]));
                }
            }
            self.reader.gather_all(&mut requests)?;
        }
        Ok(tensors
            .into_iter()
            .map(|unit| {
                let mut it = unit.into_iter();
                (it.next().unwrap_or_default(), it.collect())
            })
            .collect())
    }
}

/// Checks every file and every section checksum of checkpoint `dir`.
///
/// # Errors
/// The first problem found, naming the file.
pub fn verify(dir: &Path) -> Result<Metadata, CheckpointError> {
    let r = Reader::open(dir)?;
    for j in 0..r.meta.shard_world {
        let shard = r.shard(j)?;
        for u in 0..r.meta.units.len() {
            for t in 0..=r.meta.state_slots {
                r.section_into(&shard, u, t, 0..0, &mut [])?;
            }
        }
    }
    Ok(r.meta)
}

/// Bytes of a section read (and checksummed) at a time by [`Reader::section_into`]; a
/// multiple of 4. (Tests' sections span many chunks, cut at odd places.)
#[cfg(not(test))]
const SECTION_CHUNK: usize = 8 << 20;
#[cfg(test)]
const SECTION_CHUNK: usize = 52;

/// Parameters gathered at once by [`export_safetensors`].
const EXPORT_BATCH_BYTES: usize = 1 << 30;

/// Writes the full fp32 parameters (the master weights, padding stripped) of checkpoint `dir`
/// to one safetensors file `out`, by parameter name and shape; atomically. Streams batches of
/// units of about [`EXPORT_BATCH_BYTES`]: memory holds one batch, not the model (three times
/// over), and each shard file is opened once per batch, not once per unit.
///
/// # Errors
/// Damaged checkpoint files, or I/O errors naming the path.
pub fn export_safetensors(dir: &Path, out: &Path) -> Result<(), CheckpointError> {
    let r = Reader::open(dir)?;
    // Every file is read, and the parameters are sized from `metadata.json`: its recorded file
    // sizes (which bound the parameters, see `Reader::open`) must be the files' sizes first.
    for fm in &r.meta.files {
        let path = dir.join(&fm.name);
        let size = std::fs::metadata(&path).map_err(io("stat", &path))?.len();
        if size != fm.size {
            return Err(CheckpointError::Corrupt {
                path,
                reason: format!("{size} bytes, metadata.json says {}", fm.size),
            });
        }
    }
    // The header: every tensor's dtype, shape and byte range, back to back in unit order.
    let mut tensors = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("step".into(), r.meta.step.to_string().into());
    meta.insert("format".into(), "pt".into());
    tensors.insert("__metadata__".into(), meta.into());
    let mut offset: u64 = 0;
    for p in r.layout.units.iter().flat_map(|u| &u.params) {
        // (Bounded by the shard files' sizes, checked at `Reader::open`.)
        let end = (p.numel as u64).checked_mul(4).and_then(|b| offset.checked_add(b)).ok_or_else(|| {
            CheckpointError::Corrupt {
                path: dir.join(METADATA),
                reason: format!("parameter {:?}: {} elements", p.name, p.numel),
            }
        })?;
        let entry = serde_json::json!({ "dtype": "F32", "shape": p.shape, "data_offsets": [offset, end] });
        if tensors.insert(p.name.clone(), entry).is_some() || p.name == "__metadata__" {
            return Err(CheckpointError::InvalidArgument(format!("safetensors: parameter name {:?} is not unique", p.name)));
        }
        offset = end;
    }
    let mut header = serde_json::to_vec(&serde_json::Value::Object(tensors))
        .map_err(|e| CheckpointError::InvalidArgument(format!("safetensors header: {e}")))?;
    // The data starts 8-byte aligned, as the safetensors writer pads it (with spaces).
    header.resize(header.len().next_multiple_of(8), b' ');
    let (file, tmp) = create_tmp(out)?;
    let written = (|| -> Result<File, CheckpointError> {
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let wio = |e| CheckpointError::Io { op: "write", path: tmp.clone(), source: e };
        w.write_all(&(header.len() as u64).to_le_bytes()).map_err(wio)?;
        w.write_all(&header).map_err(wio)?;
        let units = &r.layout.units;
        let mut first = 0;
        while first < units.len() {
            // Units first..end: at least one, then as many as fit the batch.
            let mut end = first + 1;
            let mut bytes = units[first].numel.saturating_mul(4);
            while end < units.len() && bytes.saturating_add(units[end].numel.saturating_mul(4)) <= EXPORT_BATCH_BYTES {
                bytes += units[end].numel * 4;
                end += 1;
            }
            let mut flats: Vec<Vec<f32>> = units[first..end].iter().map(|u| vec![0.0f32; u.numel]).collect();
            let mut requests: Vec<_> =
                flats.iter_mut().enumerate().map(|(i, flat)| (first + i, 0, 0..flat.len(), flat.as_mut_slice())).collect();
            r.gather_all(&mut requests)?;
            for flat in &flats {
                w.write_all(&format::f32_bytes(flat)).map_err(wio)?;
            }
            first = end;
        }
        w.into_inner().map_err(|e| wio(e.into_error()))
    })();
    match written {
        Ok(file) => commit_tmp(file, &tmp, out),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests;
