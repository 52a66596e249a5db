//! Durable state: an fsync'd append-only log of commands plus snapshot compaction.
//!
//! Layout of `--data-dir`:
//! - `snapshot`: `RSRUNSN1` magic, last included sequence number (u64 LE), payload length (u64 LE),
//!   CRC-32 of the payload (u32 LE), payload = postcard-encoded [`State`].
//! - `journal-<first seq, 20 digits>.log`: the `RSRUNJL4` magic (written with the file, atomically),
//!   then one batch frame per append (a group commit; a group larger than 1 GiB, the largest
//!   batch recovery accepts, is split into several batches, each replayed whole or not at all):
//!   `[RSJB][record count u32 LE][payload length u32 LE][CRC-32 u32 LE][payload]`, the CRC over the
//!   count, the length and the payload; the payload is the group's records
//!   `[len u32 LE][crc32 u32 LE][postcard Entry]` (as [`encode`] frames them, and etcd stores them).
//! - `lock`: held with `flock` so two daemons never share a directory.
//! - `format`: the directory's version ([`FORMAT_VERSION`]: the encoding of the records and the
//!   snapshot, and the framing of the logs). Any other version is refused with an error naming both
//!   versions, never misread.
//!
//! Every record carries its sequence number; recovery loads the snapshot and replays the records
//! after the snapshot's sequence, so a crash between writing a snapshot and deleting the older logs
//! replays nothing twice. A group commit is one batch, and a batch is replayed whole or not at all:
//! none of its records was acknowledged before its fsync returned, so a batch that a crash cut short
//! (the last one of the last log, torn, or zero-filled where the size was persisted and the data
//! not) is truncated, with a warning naming the file, the offset and the bytes dropped. Damage
//! anywhere else (in an earlier log, or followed by valid batches that continue the sequence to
//! the end of the log) is an error naming the file and offset, never silently skipped. (Bytes that
//! merely look like a batch inside the torn one, such as a stored value holding a batch frame,
//! neither continue the sequence nor chain to the end, so they do not make a torn tail damage.)
//!
//! Snapshots, new logs and the `format` file are written atomically: temp file, fsync, rename,
//! fsync of the directory.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::os::unix::fs::OpenOptionsExt as _;

use serde::{Deserialize, Serialize};

use crate::RdzvError;
use crate::state::{Command, Ms, State};
use crate::validate::Limits;

const SNAPSHOT_MAGIC: &[u8; 8] = b"RSRUNSN1";
/// Version of a data directory (its `format` file) and of the postcard encoding of [`Entry`] and
/// [`State`] (what etcd's format key holds); bumped whenever a journaled type or the framing
/// changes shape. 2: `JobSpec::fixed_ranks`. 3: `State::retired`. 4: request ids of `StoreSet`,
/// `StoreMultiSet` and `StoreDelete` (and their `Dedup` answers), each remembered answer kept with
/// its call's fingerprint and its time (`state::Remembered`), and logs of batch frames.
/// Directories without a `format` file hold version 1.
pub const FORMAT_VERSION: u32 = 4;
/// The version of a data directory, its `format` file.
const DIR_FORMAT: u32 = FORMAT_VERSION;
/// Largest record accepted (a longer length field is damage, not data).
const MAX_RECORD: u32 = 512 << 20;
/// First bytes of every log of a format-4 directory. Read as the length of a bare record (what
/// logs of formats 1 to 3 start with) it is past [`MAX_RECORD`]: the two framings never look alike.
const LOG_MAGIC: &[u8; 8] = b"RSRUNJL4";
/// First bytes of every batch frame.
const BATCH_MAGIC: &[u8; 4] = b"RSJB";
/// Bytes of a batch header: magic, record count, payload length, CRC-32.
const BATCH_HEADER: usize = 16;
/// Largest batch payload accepted (a longer length field is damage, not data). The executor never
/// queues more than 256 MiB of unwritten records plus one record (at most [`MAX_RECORD`]) for one
/// append; [`Journal::append`] splits a larger one into several batches rather than write one
/// that recovery would refuse.
const MAX_BATCH: u32 = 1 << 30;

/// One journaled command.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// Sequence number, 1-based and contiguous.
    pub seq: u64,
    /// When it was applied.
    pub at: Ms,
    /// What was applied.
    pub cmd: Command,
}

/// Encodes one entry as a framed record.
pub fn encode(entry: &Entry) -> Result<Vec<u8>, RdzvError> {
    let payload = postcard::to_allocvec(entry)
        .map_err(|e| RdzvError::Storage { path: "journal".into(), message: format!("cannot encode entry: {e}") })?;
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

fn storage(path: &Path, what: &str, e: impl std::fmt::Display) -> RdzvError {
    RdzvError::Storage { path: path.display().to_string(), message: format!("{what}: {e}") }
}

/// The open journal of a data directory.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    log: File,
    log_path: PathBuf,
    log_bytes: u64,
    /// Set when a failed append could not be undone: the log may hold a partial record, so no
    /// further record may follow it. Cleared only by a restart (recovery truncates the tail).
    poisoned: Option<String>,
    _lock: nix::fcntl::Flock<File>,
}

/// What recovery found.
#[derive(Debug)]
pub struct Recovered {
    /// The rebuilt state.
    pub state: State,
    /// The last sequence number in it.
    pub seq: u64,
    /// Records replayed from logs (after the snapshot).
    pub replayed: u64,
    /// Bytes cut off a torn tail.
    pub truncated_bytes: u64,
    /// The newest time the state has seen: the last replayed record's, else the latest activity
    /// of a job in the snapshot. The service's clock never goes below it (a host clock set back
    /// across a restart must not stamp new records before old ones).
    pub last_at: crate::state::Ms,
}

fn log_name(first_seq: u64) -> String {
    format!("journal-{first_seq:020}.log")
}

fn fsync_dir(dir: &Path) -> Result<(), RdzvError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| storage(dir, "cannot fsync directory", e))
}

/// Checks (or, for a new directory, writes) the directory's version.
fn check_format(dir: &Path, has_data: bool) -> Result<(), RdzvError> {
    let path = dir.join("format");
    let found = match fs::read_to_string(&path) {
        Ok(text) => text.trim().parse::<u32>().map_err(|_| storage(&path, "not a format version", format!("{:?}", text.trim())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !has_data => {
            write_atomic(dir, &path, format!("{DIR_FORMAT}\n").as_bytes())?;
            return Ok(());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 1,
        Err(e) => return Err(storage(&path, "cannot read", e)),
    };
    if found != DIR_FORMAT {
        return Err(storage(
            &path,
            "unsupported journal format",
            format!(
                "the data directory holds format {found}, this rsrun-rendezvous reads format {DIR_FORMAT}: let its jobs end under the rsrun-rendezvous that wrote it, or start with an empty --data-dir"
            ),
        ));
    }
    Ok(())
}

/// Files of the data directory hold every job's keys: readable by the daemon's user only.
const FILE_MODE: u32 = 0o600;

/// Writes `bytes` to `path` atomically: temp file, fsync, rename, directory fsync.
fn write_atomic(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), RdzvError> {
    let tmp = path.with_extension("tmp");
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .open(&tmp)
        .map_err(|e| storage(&tmp, "cannot create", e))?;
    f.write_all(bytes).map_err(|e| storage(&tmp, "cannot write", e))?;
    f.sync_all().map_err(|e| storage(&tmp, "cannot fsync", e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| storage(path, "cannot rename into place", e))?;
    fsync_dir(dir)
}

fn logs_in(dir: &Path) -> Result<Vec<(u64, PathBuf)>, RdzvError> {
    let mut logs = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| storage(dir, "cannot list", e))? {
        let entry = entry.map_err(|e| storage(dir, "cannot list", e))?;
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(seq) = name.strip_prefix("journal-").and_then(|s| s.strip_suffix(".log")) {
            if let Ok(seq) = seq.parse::<u64>() {
                logs.push((seq, entry.path()));
            }
        }
    }
    logs.sort();
    Ok(logs)
}

fn read_snapshot(path: &Path) -> Result<Option<(State, u64)>, RdzvError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(storage(path, "cannot read snapshot", e)),
    };
    if bytes.len() < 28 || &bytes[..8] != SNAPSHOT_MAGIC {
        return Err(storage(path, "not an rsrun snapshot", "bad magic or too short"));
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
    let seq = word(8);
    let len = word(16) as usize;
    let crc = u32::from_le_bytes(bytes[24..28].try_into().unwrap_or([0; 4]));
    let payload = bytes.get(28..28usize.saturating_add(len)).ok_or_else(|| storage(path, "snapshot is truncated", format!("{len} payload bytes announced")))?;
    if crc32fast::hash(payload) != crc {
        return Err(storage(path, "snapshot checksum mismatch", "the file is damaged"));
    }
    let mut state: State = postcard::from_bytes(payload).map_err(|e| storage(path, "cannot decode snapshot", e))?;
    state.recount();
    Ok(Some((state, seq)))
}

/// The postcard encoding of a state: the payload of a snapshot, on disk and in etcd alike.
pub fn encode_state(state: &State) -> Result<Vec<u8>, RdzvError> {
    postcard::to_allocvec(state).map_err(|e| RdzvError::Storage { path: "snapshot".into(), message: format!("cannot encode state: {e}") })
}

/// Decodes framed records (as [`encode`] writes them) that must be whole: a short, damaged or
/// undecodable record is an error naming its offset, never skipped (etcd keeps what it acknowledged
/// whole, so there is no torn tail to forgive).
pub fn decode_records(bytes: &[u8]) -> Result<Vec<Entry>, String> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        if bytes.len() - at < 8 {
            return Err(format!("record header cut short at offset {at}"));
        }
        let len = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as usize;
        let crc = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
        let payload = bytes.get(at + 8..at + 8 + len).ok_or_else(|| format!("record at offset {at} cut short ({len} bytes announced)"))?;
        if crc32fast::hash(payload) != crc {
            return Err(format!("checksum mismatch in the record at offset {at}"));
        }
        out.push(postcard::from_bytes(payload).map_err(|e| format!("undecodable record at offset {at}: {e}"))?);
        at += 8 + len;
    }
    Ok(out)
}

fn snapshot_bytes(state: &State, seq: u64) -> Result<Vec<u8>, RdzvError> {
    let payload = encode_state(state)?;
    let mut out = Vec::with_capacity(payload.len() + 28);
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// What one log held.
struct LogRead {
    /// Its records, in order.
    entries: Vec<Entry>,
    /// Bytes of its valid prefix: where a torn tail starts.
    valid: u64,
    /// Bytes of the torn tail after it (0: none).
    torn: u64,
    /// Why the tail is a write a crash cut short (empty when there is none).
    why: String,
}

/// Reads one log, whose first record is `first` (its name's): batch frames after [`LOG_MAGIC`].
/// Only the last log (`is_last`) may end in a torn tail.
fn read_log(path: &Path, first: u64, is_last: bool) -> Result<LogRead, RdzvError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| storage(path, "cannot read journal", e))?;
    if bytes.starts_with(LOG_MAGIC) {
        return read_batches(path, &bytes, first, is_last);
    }
    Err(storage(
        path,
        "journal damaged at offset 0",
        format!(
            "the log starts with {:02x?}, not with {:?} as every log of a format-{DIR_FORMAT} directory does",
            &bytes[..bytes.len().min(LOG_MAGIC.len())],
            String::from_utf8_lossy(LOG_MAGIC)
        ),
    ))
}

/// Why the bytes at an offset of a log are not a valid batch.
enum BadBatch {
    /// What a write that a crash cut short leaves: a header or a payload cut short, a header the
    /// file system zero-filled (the size persisted, the data not), a checksum that does not match.
    Torn(String),
    /// What no write cut short leaves: a length past any batch's, a batch whose checksum matches
    /// but whose records do not, a batch that another batch's header follows.
    Damaged(String),
}

/// The CRC-32 of a batch: over its record count, its payload length and its payload.
fn batch_crc(count: u32, len: u32, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&count.to_le_bytes());
    h.update(&len.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// The header of a batch of `count` records. The caller keeps `payload` within [`MAX_BATCH`]
/// bytes, so its length fits the u32 field.
fn batch_header(count: u32, payload: &[u8]) -> [u8; BATCH_HEADER] {
    let len = payload.len() as u32;
    let mut h = [0u8; BATCH_HEADER];
    h[..4].copy_from_slice(BATCH_MAGIC);
    h[4..8].copy_from_slice(&count.to_le_bytes());
    h[8..12].copy_from_slice(&len.to_le_bytes());
    h[12..].copy_from_slice(&batch_crc(count, len, payload).to_le_bytes());
    h
}

/// A batch header and the range of a group's records that is its payload.
type BatchFrame = ([u8; BATCH_HEADER], Range<usize>);

/// Frames the records of one group commit (as [`encode`] writes them, concatenated) as batches:
/// one, unless the group is larger than [`MAX_BATCH`]. Each batch is a header and the range of
/// `records` that is its payload.
fn batch_frames(records: &[u8]) -> Result<Vec<BatchFrame>, String> {
    let mut frames = Vec::new();
    let (mut start, mut at, mut count) = (0usize, 0usize, 0u32);
    while at < records.len() {
        let Some(head) = records.get(at..at + 8) else {
            return Err(format!("record header cut short at offset {at} of {} bytes", records.len()));
        };
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        if len > MAX_RECORD {
            return Err(format!("the record at offset {at} has {len} bytes, more than the largest record ({MAX_RECORD} bytes)"));
        }
        let end = at + 8 + len as usize;
        if end > records.len() {
            return Err(format!("the record at offset {at} announces {len} bytes, past the end of the {} bytes given", records.len()));
        }
        if count > 0 && end - start > MAX_BATCH as usize {
            frames.push((batch_header(count, &records[start..at]), start..at));
            (start, count) = (at, 0);
        }
        count += 1;
        at = end;
    }
    if count > 0 {
        frames.push((batch_header(count, &records[start..at]), start..at));
    }
    Ok(frames)
}

/// Reads the batch at `at`: its entries and the offset where it ends.
fn read_batch(bytes: &[u8], at: usize) -> Result<(Vec<Entry>, usize), BadBatch> {
    let Some(header) = bytes.get(at..at + BATCH_HEADER) else {
        return Err(BadBatch::Torn(format!("batch header cut short ({} of {BATCH_HEADER} bytes)", bytes.len().saturating_sub(at))));
    };
    let word = |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let (count, len, crc) = (word(4), word(8), word(12));
    let start = at + BATCH_HEADER;
    let end = start + len as usize;
    let checksum_matches = len <= MAX_BATCH && end <= bytes.len() && batch_crc(count, len, &bytes[start..end]) == crc;
    if &header[..4] != BATCH_MAGIC {
        if checksum_matches {
            return Err(BadBatch::Damaged(format!(
                "batch magic {:02x?} is not {BATCH_MAGIC:02x?}, though the checksum of the batch it heads matches",
                &header[..4]
            )));
        }
        return Err(BadBatch::Torn(format!("no batch header (it starts with {:02x?})", &header[..4])));
    }
    // No write makes a batch this long: the length itself is damaged, and taking it for a torn
    // tail would throw away every acknowledged record after `at`.
    if len > MAX_BATCH {
        return Err(BadBatch::Damaged(format!("batch length {len} exceeds the largest batch ({MAX_BATCH} bytes)")));
    }
    if end > bytes.len() {
        return Err(BadBatch::Torn(format!("batch of {len} bytes cut short after {} bytes", bytes.len() - start)));
    }
    if !checksum_matches {
        // A batch whose length leads to the next batch's header was whole when that one was
        // appended (an append starts only after the one before it returned).
        if bytes.get(end..end + BATCH_MAGIC.len()) == Some(BATCH_MAGIC.as_slice()) {
            return Err(BadBatch::Damaged(format!("checksum mismatch in a batch of {len} bytes that the next batch's header follows")));
        }
        return Err(BadBatch::Torn(format!("checksum mismatch in a batch of {len} bytes")));
    }
    let entries = decode_records(&bytes[start..end])
        .map_err(|e| BadBatch::Damaged(format!("the batch's checksum matches, but its payload does not hold whole records: {e} of the payload")))?;
    if entries.is_empty() || entries.len() != count as usize {
        return Err(BadBatch::Damaged(format!("the batch header counts {count} records, its payload holds {}", entries.len())));
    }
    Ok((entries, end))
}

/// The offset of the first batch at or after `from` that acknowledged records after the bad bytes
/// would start, if any: what tells damage in the middle of a log from a torn final write. A
/// candidate counts only if it is valid (its checksum matches and its records decode), its first
/// record continues the sequence (past `after_seq`, the last record replayed before the bad
/// bytes), and the batches from it, each continuing the sequence, run exactly to the end of the
/// log. A torn batch's own payload may hold what looks like a batch (a stored value is any bytes
/// a client sent): such a frame would have to carry the next sequence numbers and the crash would
/// have to cut the torn batch exactly where it ends, and taken for acknowledged records it made
/// the daemon refuse to start over an ordinary torn write.
fn next_valid_batch(bytes: &[u8], from: usize, after_seq: u64) -> Option<usize> {
    (from..bytes.len().saturating_sub(BATCH_HEADER - 1))
        .find(|&p| bytes[p..].starts_with(BATCH_MAGIC) && chains_to_end(bytes, p, after_seq))
}

/// Whether the batches from `at` on are valid, each continues the sequence past the one before
/// (the first past `after_seq`), and the last ends exactly at the end of `bytes`.
fn chains_to_end(bytes: &[u8], mut at: usize, after_seq: u64) -> bool {
    let mut last = after_seq;
    while at < bytes.len() {
        let Ok((entries, end)) = read_batch(bytes, at) else { return false };
        // `read_batch` never answers an empty batch.
        let (Some(first), Some(newest)) = (entries.first(), entries.last()) else { return false };
        if first.seq <= last {
            return false;
        }
        last = newest.seq;
        at = end;
    }
    at == bytes.len()
}

/// Writes batches ([`batch_frames`] of `records`) and syncs them.
fn write_frames(log: &mut File, records: &[u8], frames: &[([u8; BATCH_HEADER], Range<usize>)]) -> std::io::Result<()> {
    for (header, payload) in frames {
        log.write_all(header)?;
        // In bounds: `batch_frames` made every range within `records`.
        log.write_all(&records[payload.clone()])?;
    }
    log.sync_data()
}

/// Reads the batches of a log that starts with [`LOG_MAGIC`]. A batch is taken whole or not at
/// all; the last log may end in one batch that a crash cut short, which is dropped whole (none of
/// its records was acknowledged: the fsync that would have made them durable never returned).
/// `first` is the log's first sequence number (its name's).
fn read_batches(path: &Path, bytes: &[u8], first: u64, is_last: bool) -> Result<LogRead, RdzvError> {
    let mut entries = Vec::new();
    let mut at = LOG_MAGIC.len();
    let mut why = String::new();
    while at < bytes.len() {
        let problem = match read_batch(bytes, at) {
            Ok((batch, end)) => {
                entries.extend(batch);
                at = end;
                continue;
            }
            Err(problem) => problem,
        };
        let damaged = |why: String| storage(path, &format!("journal damaged at offset {at}"), why);
        let torn = match problem {
            BadBatch::Damaged(why) => return Err(damaged(why)),
            BadBatch::Torn(why) => why,
        };
        if !is_last {
            return Err(damaged(format!("{torn}, in a log that a newer log follows")));
        }
        // Only the last append can have been cut short, and nothing follows it: valid batches
        // after `at` that continue the sequence to the end of the log mean the bytes at `at`
        // were whole once, and taking them for a torn tail would drop the acknowledged records
        // from there on.
        let after_seq = entries.last().map_or(first.saturating_sub(1), |e: &Entry| e.seq);
        if let Some(next) = next_valid_batch(bytes, at + 1, after_seq) {
            return Err(damaged(format!("{torn}, but a valid batch starts at offset {next}")));
        }
        why = torn;
        break;
    }
    Ok(LogRead { entries, valid: at as u64, torn: (bytes.len() - at) as u64, why })
}

/// The snapshot's sequence number against the newest log (first sequence `first`, last record
/// `last`): every record the snapshot covers was journaled first, and a compaction starts the log
/// after its snapshot's sequence, so the snapshot can be ahead of neither (the header's sequence
/// is outside the snapshot's checksum; a damaged one would drop every record up to it unseen).
fn check_snapshot_seq(snap_path: &Path, snapshot: u64, first: u64, last: Option<u64>) -> Result<(), RdzvError> {
    let covered = last.unwrap_or(0).max(first.saturating_sub(1));
    if snapshot > covered || snapshot == u64::MAX {
        return Err(storage(
            snap_path,
            "snapshot is ahead of the journal",
            format!(
                "it claims sequence {snapshot}, but the newest log (journal-{first:020}.log) ends at sequence {covered}: the snapshot or the log is damaged"
            ),
        ));
    }
    Ok(())
}

impl Journal {
    /// Opens (creating if needed) a data directory, recovers its state, compacts it into a fresh
    /// snapshot and starts a new log.
    ///
    /// # Errors
    /// The directory cannot be created or locked (another daemon uses it), or its files are damaged
    /// anywhere but a torn tail.
    pub fn open(dir: &Path) -> Result<(Journal, Recovered), RdzvError> {
        if dir.exists() && !dir.is_dir() {
            return Err(storage(dir, "the data directory is not a directory", "a file of that name exists"));
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            // The directories made now, deepest first: each is durable in its parent only once
            // that parent is synced (else a power cut could lose them, and the records in them).
            let made: Vec<&Path> = dir.ancestors().take_while(|p| !p.as_os_str().is_empty() && !p.exists()).collect();
            // A new directory is the daemon's user's only (an existing one keeps its mode).
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| storage(dir, "cannot create data directory", e))?;
            for d in &made {
                let parent = d.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                fsync_dir(parent)?;
            }
        }
        let lock_path = dir.join("lock");
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(FILE_MODE)
            .open(&lock_path)
            .map_err(|e| storage(&lock_path, "cannot open lock file", e))?;
        let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            storage(&lock_path, "data directory is in use by another rsrun-rendezvous", e)
        })?;
        let snap_path = dir.join("snapshot");
        let logs = logs_in(dir)?;
        check_format(dir, snap_path.exists() || !logs.is_empty())?;
        let snapshot = read_snapshot(&snap_path)?;
        // Every log after the first start follows a snapshot: a log that does not start at the
        // first record, with no snapshot, lost the records before it.
        if snapshot.is_none()
            && let Some((first, path)) = logs.first()
            && *first > 1
        {
            return Err(storage(
                &snap_path,
                "snapshot missing",
                format!("{} starts at sequence {first}: the records before it are only in the snapshot", path.display()),
            ));
        }
        let (mut state, mut seq) = snapshot.unwrap_or_default();
        let snapshot_seq = seq;
        let mut diverged = false;
        let mut replayed = 0;
        let mut truncated_bytes = 0;
        let mut last_at = 0;
        for (i, (first, path)) in logs.iter().enumerate() {
            let is_last = i + 1 == logs.len();
            let LogRead { entries, valid, torn, why } = read_log(path, *first, is_last)?;
            if is_last {
                check_snapshot_seq(&snap_path, snapshot_seq, *first, entries.last().map(|e| e.seq))?;
            }
            if torn > 0 {
                tracing::warn!(
                    path = %path.display(),
                    offset = valid,
                    dropped_bytes = torn,
                    reason = %why,
                    "truncating a torn journal tail: the last write, which a crash cut short and which was acknowledged to no one"
                );
                truncated_bytes = torn;
                let f = OpenOptions::new().write(true).open(path).map_err(|e| storage(path, "cannot open", e))?;
                f.set_len(valid).and_then(|_| f.sync_all()).map_err(|e| storage(path, "cannot truncate", e))?;
            }
            for entry in entries {
                if entry.seq <= seq {
                    continue;
                }
                if entry.seq != seq + 1 {
                    return Err(storage(path, "journal has a gap", format!("expected sequence {}, found {}", seq + 1, entry.seq)));
                }
                if let Err(e) = state.apply(&entry.cmd, entry.at, &Limits::unbounded()) {
                    // A command that succeeded when it was journaled must succeed again; say so
                    // loudly, and keep the logs for a look (below).
                    tracing::error!(seq = entry.seq, path = %path.display(), error = %e, "journal replay diverged");
                    diverged = true;
                }
                seq = entry.seq;
                last_at = last_at.max(entry.at);
                replayed += 1;
            }
        }
        if logs.is_empty() && seq == u64::MAX {
            return Err(storage(&snap_path, "snapshot sequence out of range", format!("{seq}")));
        }
        // Compact: one snapshot holding everything, then a fresh log.
        write_atomic(dir, &snap_path, &snapshot_bytes(&state, seq)?)?;
        let log_path = dir.join(log_name(seq + 1));
        let log = Self::create_log(dir, &log_path)?;
        for (_, path) in logs {
            if path == log_path {
                continue;
            }
            if diverged {
                // The evidence of a replay that diverged stays, out of the way of the next start.
                let mut kept = path.as_os_str().to_owned();
                kept.push(".diverged");
                fs::rename(&path, &kept).map_err(|e| storage(&path, "cannot set aside a diverged journal", e))?;
                tracing::error!(kept = %Path::new(&kept).display(), "a journal whose replay diverged is kept");
            } else {
                fs::remove_file(&path).map_err(|e| storage(&path, "cannot remove old journal", e))?;
            }
        }
        fsync_dir(dir)?;
        let log_bytes = LOG_MAGIC.len() as u64;
        let journal = Journal { dir: dir.to_path_buf(), log, log_path, log_bytes, poisoned: None, _lock: lock };
        let last_at = last_at.max(state.latest_activity());
        Ok((journal, Recovered { state, seq, replayed, truncated_bytes, last_at }))
    }

    /// Creates a log that holds only its [`LOG_MAGIC`], atomically (a crash leaves it whole or
    /// absent, never without its magic), and opens it for appending.
    fn create_log(dir: &Path, path: &Path) -> Result<File, RdzvError> {
        write_atomic(dir, path, LOG_MAGIC)?;
        OpenOptions::new().append(true).open(path).map_err(|e| storage(path, "cannot open journal", e))
    }

    /// Appends the framed records of one group commit (as [`encode`] writes them, concatenated) as
    /// one batch frame, and makes them durable (fdatasync). Recovery replays a batch whole or not
    /// at all, so a crash during the write loses the group whole (none of it was acknowledged).
    ///
    /// # Errors
    /// `records` are not whole framed records, or the write or the sync failed (e.g. the disk is
    /// full). A failed write is undone (if that fails too, the journal refuses appends until a
    /// restart, whose recovery truncates the torn batch); the caller retries the same bytes.
    pub fn append(&mut self, records: &[u8]) -> Result<(), RdzvError> {
        if let Some(why) = &self.poisoned {
            return Err(storage(&self.log_path, "journal unusable until restart", why));
        }
        let frames = batch_frames(records).map_err(|why| storage(&self.log_path, "cannot frame journal records", why))?;
        if frames.is_empty() {
            return Ok(());
        }
        if let Err(e) = write_frames(&mut self.log, records, &frames) {
            // Undo a partial write so a retry does not leave garbage in the middle of the log.
            if let Err(undo) = self.log.set_len(self.log_bytes) {
                self.poisoned = Some(format!("a failed append ({e}) could not be undone ({undo})"));
            }
            return Err(storage(&self.log_path, "cannot append to journal", e));
        }
        self.log_bytes += frames.iter().map(|(_, payload)| (BATCH_HEADER + payload.len()) as u64).sum::<u64>();
        Ok(())
    }

    /// Bytes in the current log (its magic included).
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes
    }

    /// Writes a snapshot of `state` (which includes every record up to `seq`), switches to a new log
    /// starting at `seq + 1` and removes the older logs.
    pub fn compact(&mut self, state: &State, seq: u64) -> Result<(), RdzvError> {
        write_atomic(&self.dir, &self.dir.join("snapshot"), &snapshot_bytes(state, seq)?)?;
        let path = self.dir.join(log_name(seq + 1));
        if path != self.log_path {
            self.log = Self::create_log(&self.dir, &path)?;
            self.log_path = path;
            self.log_bytes = LOG_MAGIC.len() as u64;
        }
        for (_, old) in logs_in(&self.dir)? {
            if old != self.log_path {
                fs::remove_file(&old).map_err(|e| storage(&old, "cannot remove old journal", e))?;
            }
        }
        fsync_dir(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{JobSpec, JoinCmd, Scope};

    fn join(node: &str) -> Command {
        Command::Join(JoinCmd {
            job: "j".into(),
            node: node.into(),
            addrs: vec!["127.0.0.1".into()],
            hostname: "h".into(),
            local_world_size: 1,
            rank_hint: None,
            master_port: 1,
            spec: JobSpec { min_nodes: 2, max_nodes: 2, last_call_ms: 0, lease_ms: 1000, max_restarts: 0, fixed_ranks: false },
        })
    }

    fn set(key: &str) -> Command {
        Command::StoreSet { scope: Scope { job: "j".into(), round: 1, round_scoped: false }, key: key.into(), value: b"v".to_vec(), request_id: String::new() }
    }

    /// The framed records of `cmds`, numbered from `first`: what the executor hands to `append`.
    fn framed(first: u64, cmds: &[Command]) -> Vec<u8> {
        let mut buf = Vec::new();
        for (i, cmd) in cmds.iter().enumerate() {
            buf.extend(encode(&Entry { seq: first + i as u64, at: 10, cmd: cmd.clone() }).unwrap());
        }
        buf
    }

    /// One group commit.
    fn write(j: &mut Journal, first: u64, cmds: &[Command]) {
        j.append(&framed(first, cmds)).unwrap();
    }

    /// The bytes `append` writes for one group: its batch frame.
    fn batch(first: u64, cmds: &[Command]) -> Vec<u8> {
        let records = framed(first, cmds);
        let frames = batch_frames(&records).unwrap();
        assert_eq!(frames.len(), 1);
        let (header, payload) = &frames[0];
        [header.as_slice(), &records[payload.clone()]].concat()
    }

    /// The offset and payload length of each batch of a log.
    fn batches(log: &[u8]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut at = LOG_MAGIC.len();
        while at + BATCH_HEADER <= log.len() {
            let len = u32::from_le_bytes(log[at + 8..at + 12].try_into().unwrap()) as usize;
            out.push((at, len));
            at += BATCH_HEADER + len;
        }
        out
    }

    #[test]
    fn recovers_snapshot_plus_log_and_truncates_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let limits = Limits::default();
        {
            let (mut j, rec) = Journal::open(dir.path()).unwrap();
            assert_eq!(rec.seq, 0);
            write(&mut j, 1, &[join("a"), join("b"), set("k1")]);
            let mut state = State::default();
            for c in [join("a"), join("b"), set("k1")] {
                state.apply(&c, 10, &limits).unwrap();
            }
            j.compact(&state, 3).unwrap();
            write(&mut j, 4, &[set("k2")]);
            // A torn batch at the tail: half of one more group commit.
            let torn = batch(5, &[set("k3"), set("k4")]);
            j.log.write_all(&torn[..torn.len() / 2]).unwrap();
        }
        let (j, rec) = Journal::open(dir.path()).unwrap();
        assert_eq!(rec.seq, 4);
        assert_eq!(rec.replayed, 1);
        assert!(rec.truncated_bytes > 0);
        assert_eq!(rec.last_at, 10, "the newest record's time");
        let job = rec.state.job("j").unwrap();
        assert!(job.store.contains_key("k1") && job.store.contains_key("k2") && !job.store.contains_key("k3"));
        drop(j);
        // Everything in the snapshot now: the time comes from the jobs' latest activity.
        let (_j, rec) = Journal::open(dir.path()).unwrap();
        assert_eq!((rec.replayed, rec.last_at), (0, 10));
    }

    #[test]
    fn another_format_is_refused_naming_both_versions() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(dir.path()).unwrap();
            write(&mut j, 1, &[join("a")]);
        }
        assert_eq!(fs::read_to_string(dir.path().join("format")).unwrap().trim(), DIR_FORMAT.to_string());
        // Data written before the format file existed is version 1.
        fs::remove_file(dir.path().join("format")).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("format") && err.contains("holds format 1") && err.contains(&format!("reads format {DIR_FORMAT}")), "{err}");
        fs::write(dir.path().join("format"), "9\n").unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("holds format 9"), "{err}");
        fs::write(dir.path().join("format"), "x\n").unwrap();
        assert!(Journal::open(dir.path()).unwrap_err().to_string().contains("not a format version"));
    }

    /// A data directory whose log holds three records in two batches (two group commits);
    /// returns the log's path.
    fn three_records(dir: &Path) -> PathBuf {
        let (mut j, _) = Journal::open(dir).unwrap();
        write(&mut j, 1, &[join("a"), join("b")]);
        write(&mut j, 3, &[set("k1")]);
        j.log_path.clone()
    }

    #[test]
    fn damage_in_the_middle_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();

        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        bytes[12] ^= 0xff; // the first batch's record count
        fs::write(&log_path, bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("journal-") && err.contains("damaged at offset 8"), "{err}");
    }

    /// A group commit that a crash cut at any byte (the file ends there, or keeps its size with
    /// zeros from there on) is dropped whole: the records before it replay, none of its own, and
    /// the journal takes new groups that replay after the next restart.
    #[test]
    fn a_group_cut_at_any_byte_is_dropped_whole() {
        let template = tempfile::tempdir().unwrap();
        let (log_file, before, after) = {
            let (mut j, _) = Journal::open(template.path()).unwrap();
            write(&mut j, 1, &[join("a"), join("b")]);
            let before = j.log_bytes() as usize;
            write(&mut j, 3, &[set("k1"), set("k2"), set("k3")]);
            (j.log_path.file_name().unwrap().to_owned(), before, j.log_bytes() as usize)
        };
        let log = fs::read(template.path().join(&log_file)).unwrap();
        assert_eq!(log.len(), after);
        assert_eq!(batches(&log), [(LOG_MAGIC.len(), before - LOG_MAGIC.len() - BATCH_HEADER), (before, after - before - BATCH_HEADER)]);
        for zero_filled in [false, true] {
            for cut in before..after {
                let what = format!("group cut at byte {cut} of {before}..{after} (zero-filled: {zero_filled})");
                let dir = tempfile::tempdir().unwrap();
                for name in ["format", "snapshot"] {
                    fs::copy(template.path().join(name), dir.path().join(name)).unwrap();
                }
                if zero_filled && log[cut..].iter().all(|b| *b == 0) {
                    // Zeros from here on are the group's own bytes (a trailing empty request id):
                    // the file is whole.
                    continue;
                }
                let mut torn = log[..cut].to_vec();
                if zero_filled {
                    // The size persisted, the data from `cut` on did not.
                    torn.resize(after, 0);
                }
                fs::write(dir.path().join(&log_file), &torn).unwrap();
                let (mut j, rec) = Journal::open(dir.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!((rec.seq, rec.replayed, rec.truncated_bytes), (2, 2, (torn.len() - before) as u64), "{what}");
                let job = rec.state.job("j").unwrap();
                assert!(["k1", "k2", "k3"].iter().all(|k| !job.store.contains_key(*k)), "{what}: part of the group replayed");
                write(&mut j, 3, &[set("n1"), set("n2")]);
                drop(j);
                let (_j, rec) = Journal::open(dir.path()).unwrap_or_else(|e| panic!("{what}, second restart: {e}"));
                assert_eq!((rec.seq, rec.replayed, rec.truncated_bytes), (4, 2, 0), "{what}");
                let job = rec.state.job("j").unwrap();
                assert!(job.store.contains_key("n1") && job.store.contains_key("n2") && !job.store.contains_key("k1"), "{what}");
            }
        }
    }

    /// A torn group whose stored value holds a well-formed batch frame (a value is whatever a
    /// client sent) is still a torn tail, cut at any byte: the frame inside it does not continue
    /// the sequence (an old sequence number), or does not run to the end of the log (one far
    /// ahead), so it is not taken for acknowledged records after damage (the daemon refused to
    /// start). Only a cut exactly at the end of a frame that continues the sequence reads as
    /// damage: those bytes are what acknowledged records after damage look like.
    #[test]
    fn a_batch_frame_inside_a_torn_groups_value_does_not_make_it_damage() {
        for inner_seq in [1u64, 1000] {
            let template = tempfile::tempdir().unwrap();
            let inner = batch(inner_seq, &[set("evil")]);
            let (log_file, before, after) = {
                let (mut j, _) = Journal::open(template.path()).unwrap();
                write(&mut j, 1, &[join("a"), join("b")]);
                let before = j.log_bytes() as usize;
                let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
                let carrier = Command::StoreSet { scope, key: "v".into(), value: inner.clone(), request_id: String::new() };
                write(&mut j, 3, &[carrier]);
                (j.log_path.file_name().unwrap().to_owned(), before, j.log_bytes() as usize)
            };
            let log = fs::read(template.path().join(&log_file)).unwrap();
            let inner_at = log.windows(inner.len()).position(|w| w == inner.as_slice()).unwrap();
            let inner_end = inner_at + inner.len();
            assert!(before < inner_at && inner_end < after);
            for cut in before..after {
                if inner_seq > 2 && cut == inner_end {
                    continue;
                }
                let what = format!("inner sequence {inner_seq}, group cut at byte {cut} of {before}..{after}");
                let dir = tempfile::tempdir().unwrap();
                for name in ["format", "snapshot"] {
                    fs::copy(template.path().join(name), dir.path().join(name)).unwrap();
                }
                fs::write(dir.path().join(&log_file), &log[..cut]).unwrap();
                let (_j, rec) = Journal::open(dir.path()).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!((rec.seq, rec.replayed, rec.truncated_bytes), (2, 2, (cut - before) as u64), "{what}");
                let job = rec.state.job("j").unwrap();
                assert!(!job.store.contains_key("v") && !job.store.contains_key("evil"), "{what}");
            }
        }
    }

    /// Damage followed by more data is no torn write: refused, naming the file and the offset of
    /// the damaged batch, and nothing is truncated.
    #[test]
    fn corruption_in_the_middle_is_refused_with_its_offset() {
        // A damaged payload byte in the first batch, a whole batch after it.
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        let b = batches(&bytes);
        assert_eq!(b.len(), 2);
        let (first, second) = (b[0].0, b[1].0);
        bytes[first + BATCH_HEADER + 3] ^= 0x40;
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&log_path.display().to_string()), "{err}");
        assert!(err.contains(&format!("damaged at offset {first}")) && err.contains("checksum mismatch"), "{err}");
        assert!(err.contains("the next batch's header follows"), "{err}");
        assert_eq!(fs::read(&log_path).unwrap(), bytes, "nothing was truncated");

        // The same, and the batch after it torn: the damaged batch's length still leads to the
        // next batch's header, so it was whole once.
        bytes.truncate(second + BATCH_HEADER + 2);
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&format!("damaged at offset {first}")) && err.contains("the next batch's header follows"), "{err}");
        assert_eq!(fs::read(&log_path).unwrap(), bytes, "nothing was truncated");

        // A damaged magic on the last batch, whose checksum still matches: whole, so not torn.
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        let second = batches(&bytes)[1].0;
        bytes[second] ^= 0x01;
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&format!("damaged at offset {second}")) && err.contains("checksum of the batch it heads matches"), "{err}");
        assert_eq!(fs::read(&log_path).unwrap(), bytes, "nothing was truncated");

        // A torn batch in a log that a newer log follows: only the last log may end torn.
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        let second = batches(&bytes)[1].0;
        bytes.truncate(second + BATCH_HEADER + 2);
        fs::write(&log_path, &bytes).unwrap();
        let newer = [LOG_MAGIC.as_slice(), &batch(3, &[set("k2")])[..]].concat();
        fs::write(dir.path().join(log_name(3)), newer).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains(&log_path.display().to_string()) && err.contains(&format!("damaged at offset {second}")), "{err}");
        assert!(err.contains("a newer log follows"), "{err}");
    }

    /// A complete group replays all its records.
    #[test]
    fn a_whole_group_replays_all_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let log_path = {
            let (mut j, _) = Journal::open(dir.path()).unwrap();
            write(&mut j, 1, &[join("a"), join("b")]);
            write(&mut j, 3, &[set("k1"), set("k2"), set("k3")]);
            j.log_path.clone()
        };
        let bytes = fs::read(&log_path).unwrap();
        assert!(bytes.starts_with(LOG_MAGIC));
        // One batch frame per append; the group's header counts its three records.
        let b = batches(&bytes);
        assert_eq!(b.len(), 2);
        let (group, len) = b[1];
        assert_eq!(group + BATCH_HEADER + len, bytes.len());
        assert_eq!(&bytes[group..group + 4], BATCH_MAGIC);
        assert_eq!(u32::from_le_bytes(bytes[group + 4..group + 8].try_into().unwrap()), 3);
        let (_j, rec) = Journal::open(dir.path()).unwrap();
        assert_eq!((rec.seq, rec.replayed, rec.truncated_bytes), (5, 5, 0));
        let job = rec.state.job("j").unwrap();
        assert!(["k1", "k2", "k3"].iter().all(|k| job.store.contains_key(*k)));
    }

    /// A format-3 directory (another encoding, bare records) is refused naming both versions,
    /// never misread; a bare-record log in a format-4 directory is damage at offset 0.
    #[test]
    fn an_older_directory_or_a_bare_record_log_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(log_name(1)), framed(1, &[join("a")])).unwrap();
        fs::write(dir.path().join("format"), "3\n").unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("holds format 3") && err.contains(&format!("reads format {DIR_FORMAT}")), "{err}");
        fs::write(dir.path().join("format"), format!("{DIR_FORMAT}\n")).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("damaged at offset 0") && err.contains("format-4 directory"), "{err}");
    }

    #[test]
    fn zero_filled_tail_is_a_torn_write_not_damage() {
        let dir = tempfile::tempdir().unwrap();

        {
            let (mut j, _) = Journal::open(dir.path()).unwrap();
            write(&mut j, 1, &[join("a"), set("k1")]);
            j.log.write_all(&[0u8; 4096]).unwrap();
        }
        let (_j, rec) = Journal::open(dir.path()).unwrap();
        assert_eq!(rec.seq, 2);
        assert_eq!(rec.truncated_bytes, 4096);
    }

    #[test]
    fn second_daemon_on_same_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();

        let (_j, _) = Journal::open(dir.path()).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("in use by another rsrun-rendezvous"), "{err}");
    }

    /// Damage outside the checksums: a snapshot sequence beyond the journal, and a record length
    /// no write makes, are refused instead of dropping acknowledged records (the daemon panicked,
    /// or started empty and deleted the journal).
    #[test]
    fn a_damaged_snapshot_sequence_or_record_length_is_refused() {
        for seq in [1000u64, u64::MAX] {
            let dir = tempfile::tempdir().unwrap();
            three_records(dir.path());
            let p = dir.path().join("snapshot");
            let mut b = fs::read(&p).unwrap();
            b[8..16].copy_from_slice(&seq.to_le_bytes());
            fs::write(&p, b).unwrap();
            let err = Journal::open(dir.path()).unwrap_err().to_string();
            assert!(err.contains("snapshot is ahead of the journal") && err.contains(&format!("claims sequence {seq}")), "{err}");
            assert!(err.contains("ends at sequence 3"), "{err}");
        }
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        // The length of the log's last batch (nothing after it tells damage from a torn write):
        // no write makes a batch this long.
        bytes.truncate(batches(&bytes)[1].0);
        bytes[16..20].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("damaged at offset 8") && err.contains("exceeds the largest batch"), "{err}");
        assert_eq!(fs::read(&log_path).unwrap(), bytes, "nothing was truncated");
        // A legitimate state: a crash after a compaction's snapshot, before its new log.
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(dir.path()).unwrap();
            write(&mut j, 1, &[join("a"), join("b")]);
            let mut state = State::default();
            for c in [join("a"), join("b")] {
                state.apply(&c, 10, &Limits::default()).unwrap();
            }
            write_atomic(dir.path(), &dir.path().join("snapshot"), &snapshot_bytes(&state, 2).unwrap()).unwrap();
        }
        let (_j, rec) = Journal::open(dir.path()).unwrap();
        assert_eq!((rec.seq, rec.replayed), (2, 0));
    }

    /// A damaged length in the first of two batches of the last log points past its end: not a
    /// torn write (a whole batch follows), so recovery refuses instead of dropping it.
    #[test]
    fn a_damaged_length_followed_by_whole_records_is_not_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        let first_len = u32::from_le_bytes(bytes[16..20].try_into().unwrap());
        let past_the_end = bytes.len() as u32;
        bytes[16..20].copy_from_slice(&past_the_end.to_le_bytes());
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        let next = LOG_MAGIC.len() + BATCH_HEADER + first_len as usize;
        assert!(err.contains("damaged at offset 8") && err.contains(&format!("a valid batch starts at offset {next}")), "{err}");
        assert_eq!(fs::read(&log_path).unwrap(), bytes, "nothing was truncated");
    }

    /// A log that does not start at the first record, with no snapshot, lost what the snapshot
    /// held: refused, not recovered as an empty state.
    #[test]
    fn a_missing_snapshot_is_refused_when_the_log_starts_later() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(dir.path()).unwrap();
            write(&mut j, 1, &[join("a"), join("b")]);
        }
        // The restart compacted: snapshot at 2, an empty journal from 3.
        drop(Journal::open(dir.path()).unwrap());
        fs::remove_file(dir.path().join("snapshot")).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("snapshot missing") && err.contains("starts at sequence 3"), "{err}");
    }

    /// The data directory and its files are the daemon's user's only: they hold every job's keys.
    #[test]
    fn the_data_directory_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("data");
        let log_path = three_records(&dir);
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        for f in [log_path, dir.join("snapshot"), dir.join("lock")] {
            assert_eq!(mode(&f), 0o600, "{}", f.display());
        }
    }

    #[test]
    fn damaged_snapshot_is_an_error() {
        let dir = tempfile::tempdir().unwrap();

        drop(Journal::open(dir.path()).unwrap());
        let p = dir.path().join("snapshot");
        let mut b = fs::read(&p).unwrap();
        let n = b.len();
        b[n - 1] ^= 1;
        fs::write(&p, b).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
    }
}
