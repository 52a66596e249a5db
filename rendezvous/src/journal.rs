//! Durable state: an fsync'd append-only log of commands plus snapshot compaction.
//!
//! Layout of `--data-dir`:
//! - `snapshot`: `RSRUNSN1` magic, last included sequence number (u64 LE), payload length (u64 LE),
//!   CRC-32 of the payload (u32 LE), payload = postcard-encoded [`State`].
//! - `journal-<first seq, 20 digits>.log`: records `[len u32 LE][crc32 u32 LE][postcard Entry]`.
//! - `lock`: held with `flock` so two daemons never share a directory.
//! - `format`: the encoding version of the records and the snapshot ([`FORMAT_VERSION`]). A directory
//!   written in another version is refused with an error naming both versions, never misread.
//!
//! Every record carries its sequence number; recovery loads the snapshot and replays the records
//! after the snapshot's sequence, so a crash between writing a snapshot and deleting the older logs
//! replays nothing twice. A torn record at the very end of the last log (a write the crash cut short,
//! which was therefore never acknowledged) is truncated; damage anywhere else is an error naming the
//! file and offset, never silently skipped.
//!
//! Snapshots and log switches are written atomically: temp file, fsync, rename, fsync of the directory.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::os::unix::fs::OpenOptionsExt as _;

use serde::{Deserialize, Serialize};

use crate::RdzvError;
use crate::state::{Command, Ms, State};
use crate::validate::Limits;

const SNAPSHOT_MAGIC: &[u8; 8] = b"RSRUNSN1";
/// Version of the postcard encoding of [`Entry`] and [`State`]; bumped whenever a journaled type
/// changes shape. 2: `JobSpec::fixed_ranks`. 3: `State::retired`. Directories without a
/// `format` file hold version 1.
pub const FORMAT_VERSION: u32 = 3;
/// Largest record accepted when reading (a longer length field is damage, not data).
const MAX_RECORD: u32 = 512 << 20;

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

/// Checks (or, for a new directory, writes) the directory's encoding version.
fn check_format(dir: &Path, has_data: bool) -> Result<(), RdzvError> {
    let path = dir.join("format");
    let found = match fs::read_to_string(&path) {
        Ok(text) => text.trim().parse::<u32>().map_err(|_| storage(&path, "not a format version", format!("{:?}", text.trim())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !has_data => {
            return write_atomic(dir, &path, format!("{FORMAT_VERSION}\n").as_bytes());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 1,
        Err(e) => return Err(storage(&path, "cannot read", e)),
    };
    if found != FORMAT_VERSION {
        return Err(storage(
            &path,
            "unsupported journal format",
            format!(
                "the data directory holds format {found}, this rsrun-rendezvous reads format {FORMAT_VERSION}: let its jobs end under the rsrun-rendezvous that wrote it, or start with an empty --data-dir"
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

/// Reads the records of one log. Returns the entries and the length of the valid prefix.
fn read_log(path: &Path, is_last: bool) -> Result<(Vec<Entry>, u64, u64), RdzvError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| storage(path, "cannot read journal", e))?;
    let mut entries = Vec::new();
    let mut at = 0usize;
    while at < bytes.len() {
        let torn = |why: &str| -> Result<(Vec<Entry>, u64, u64), RdzvError> {
            Err(storage(path, &format!("journal damaged at offset {at}"), why))
        };
        if bytes.len() - at < 8 {
            if is_last {
                break;
            }
            return torn("record header cut short");
        }
        let len = u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        let crc = u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
        let end = at + 8 + len as usize;
        // No write makes a record this long: the length itself is damaged, and taking it for a
        // torn tail would throw away every acknowledged record after `at`.
        if len > MAX_RECORD {
            return torn(&format!("record length {len} exceeds the largest record ({MAX_RECORD} bytes)"));
        }
        if end > bytes.len() {
            if !is_last {
                return torn("record cut short");
            }
            // A torn final write, unless a whole record follows: then this length is damaged,
            // and taking it for a torn tail would drop the acknowledged records after it.
            if let Some(next) = next_valid_record(&bytes, at + 1) {
                return torn(&format!("record length {len} runs past the end of the log, but a valid record starts at offset {next}"));
            }
            break;
        }
        let payload = &bytes[at + 8..end];
        // A write the crash cut short can only be at the end of the last log: the final record, or a
        // tail the file system zero-filled (size persisted, data not). Anything followed by valid
        // data is damage.
        let zero_tail = bytes[at..].iter().all(|b| *b == 0);
        if crc32fast::hash(payload) != crc || len == 0 {
            if is_last && (end == bytes.len() || zero_tail) {
                break;
            }
            return torn("checksum mismatch");
        }
        let entry: Entry = match postcard::from_bytes(payload) {
            Ok(e) => e,
            Err(e) => {
                if is_last && zero_tail {
                    break;
                }
                return torn(&format!("undecodable record: {e}"));
            }
        };
        entries.push(entry);
        at = end;
    }
    Ok((entries, at as u64, (bytes.len() - at) as u64))
}

/// The offset of the first whole, valid record (its checksum matches and it decodes) at or after
/// `from`, if any: what tells a damaged length in the middle of a log from a torn final write.
fn next_valid_record(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len().saturating_sub(8)).find(|&p| {
        let len = u32::from_le_bytes([bytes[p], bytes[p + 1], bytes[p + 2], bytes[p + 3]]) as usize;
        let crc = u32::from_le_bytes([bytes[p + 4], bytes[p + 5], bytes[p + 6], bytes[p + 7]]);
        let end = p + 8 + len;
        len > 0
            && end <= bytes.len()
            && crc32fast::hash(&bytes[p + 8..end]) == crc
            && postcard::from_bytes::<Entry>(&bytes[p + 8..end]).is_ok()
    })
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
            let (entries, valid, torn) = read_log(path, is_last)?;
            if is_last {
                check_snapshot_seq(&snap_path, snapshot_seq, *first, entries.last().map(|e| e.seq))?;
            }
            if torn > 0 {
                tracing::warn!(path = %path.display(), torn_bytes = torn, "truncating a torn journal tail (an unacknowledged write)");
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
        let journal = Journal { dir: dir.to_path_buf(), log, log_path, log_bytes: 0, poisoned: None, _lock: lock };
        let last_at = last_at.max(state.latest_activity());
        Ok((journal, Recovered { state, seq, replayed, truncated_bytes, last_at }))
    }

    fn create_log(dir: &Path, path: &Path) -> Result<File, RdzvError> {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(FILE_MODE)
            .open(path)
            .map_err(|e| storage(path, "cannot create journal", e))?;
        fsync_dir(dir)?;
        Ok(f)
    }

    /// Appends framed records and makes them durable (fdatasync).
    ///
    /// # Errors
    /// The write or the sync failed (e.g. the disk is full). A failed append may have left a partial
    /// record; the caller retries the same bytes, and recovery truncates a torn tail.
    pub fn append(&mut self, records: &[u8]) -> Result<(), RdzvError> {
        if let Some(why) = &self.poisoned {
            return Err(storage(&self.log_path, "journal unusable until restart", why));
        }
        if let Err(e) = self.log.write_all(records).and_then(|_| self.log.sync_data()) {
            // Undo a partial write so a retry does not leave garbage in the middle of the log.
            if let Err(undo) = self.log.set_len(self.log_bytes) {
                self.poisoned = Some(format!("a failed append ({e}) could not be undone ({undo})"));
            }
            return Err(storage(&self.log_path, "cannot append to journal", e));
        }
        self.log_bytes += records.len() as u64;
        Ok(())
    }

    /// Bytes in the current log.
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
            self.log_bytes = 0;
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
        Command::StoreSet { scope: Scope { job: "j".into(), round: 1, round_scoped: false }, key: key.into(), value: b"v".to_vec() }
    }

    fn write(j: &mut Journal, first: u64, cmds: &[Command]) {
        let mut buf = Vec::new();
        for (i, cmd) in cmds.iter().enumerate() {
            buf.extend(encode(&Entry { seq: first + i as u64, at: 10, cmd: cmd.clone() }).unwrap());
        }
        j.append(&buf).unwrap();
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
            // A torn record at the tail: half of one more entry.
            let rec = encode(&Entry { seq: 5, at: 10, cmd: set("k3") }).unwrap();
            j.log.write_all(&rec[..rec.len() / 2]).unwrap();
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
        assert_eq!(fs::read_to_string(dir.path().join("format")).unwrap().trim(), FORMAT_VERSION.to_string());
        // Data written before the format file existed is version 1.
        fs::remove_file(dir.path().join("format")).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("holds format 1") && err.contains(&format!("reads format {FORMAT_VERSION}")), "{err}");
        fs::write(dir.path().join("format"), "9\n").unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("holds format 9"), "{err}");
        fs::write(dir.path().join("format"), "x\n").unwrap();
        assert!(Journal::open(dir.path()).unwrap_err().to_string().contains("not a format version"));
    }

    /// A data directory whose log holds three records; returns the log's path.
    fn three_records(dir: &Path) -> PathBuf {
        let (mut j, _) = Journal::open(dir).unwrap();
        write(&mut j, 1, &[join("a"), join("b"), set("k1")]);
        j.log_path.clone()
    }

    #[test]
    fn damage_in_the_middle_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();

        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        bytes[12] ^= 0xff; // inside the first record
        fs::write(&log_path, bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("journal-") && err.contains("damaged at offset 0"), "{err}");
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
        bytes[..4].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("damaged at offset 0") && err.contains("exceeds the largest record"), "{err}");
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

    /// A damaged length in the first of three records of the last log points past its end: not a
    /// torn write (two whole records follow), so recovery refuses instead of dropping them.
    #[test]
    fn a_damaged_length_followed_by_whole_records_is_not_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let log_path = three_records(dir.path());
        let mut bytes = fs::read(&log_path).unwrap();
        let first_len = u32::from_le_bytes(bytes[..4].try_into().unwrap());
        let past_the_end = bytes.len() as u32;
        bytes[..4].copy_from_slice(&past_the_end.to_le_bytes());
        fs::write(&log_path, &bytes).unwrap();
        let err = Journal::open(dir.path()).unwrap_err().to_string();
        let next = 8 + first_len as usize;
        assert!(err.contains("damaged at offset 0") && err.contains(&format!("a valid record starts at offset {next}")), "{err}");
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
