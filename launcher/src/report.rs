//! The failure report: one summary naming the root cause, then the other affected ranks.
//!
//! The root cause on this node is the failure with the smallest error-file timestamp (torchrun's
//! rule), among the first worker whose exit rsrun saw and the workers that failed on their own
//! (not stopped by rsrun) with a timestamp no later than that exit; without such a timestamp it is
//! the first exit (or the hang) rsrun saw. Across nodes it is the failure the rendezvous daemon
//! recorded first for the job. Workers that rsrun itself stopped afterwards are listed as affected,
//! never as causes.
//!
//! Error files use torchelastic's schema, so PyTorch's `@record` tracebacks (and the worker runtime's
//! panic reports) show up:
//! `{"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": "<traceback>",
//! "timestamp": "<epoch s>"}}, "errorCode": <n>}` (`message` may also be a plain string). A worker
//! writes its file itself, so rsrun reads it defensively ([`read_error_file`]): regular files of at
//! most [`ERROR_FILE_LIMIT`] bytes only, never following a symbolic link or waiting on a FIFO.
//!
//! When rsrun itself was given a `TORCHELASTIC_ERROR_FILE` (a scheduler such as TorchX watching it),
//! a failed job's root cause is copied there with `message.errorCode` set, as torchrun's `@record`
//! does ([`write_parent_error_file`]).

use std::fmt::Write as _;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::signals::signal_name;

/// How a worker ended badly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitKind {
    /// Exited with a non-zero code.
    Code(i32),
    /// Killed by a signal.
    Signal(i32),
    /// Reported no progress for `idle` (then stopped by rsrun).
    Hang {
        /// Time since its last progress report.
        idle: Duration,
        /// The last step it reported.
        last_step: u64,
    },
    /// Could not be started.
    SpawnError(String),
    /// The failure was not a worker's (a node left, the job was failed by an operator, ...).
    Other,
}

impl ExitKind {
    /// rsrun's exit code for this failure: the worker's code, 128 + signal, 124 for a hang (as
    /// `timeout(1)`), 127 when it could not start, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            ExitKind::Code(c) if *c != 0 => *c & 0xff,
            ExitKind::Code(_) | ExitKind::Other => 1,
            ExitKind::Signal(s) => 128 + s,
            ExitKind::Hang { .. } => 124,
            ExitKind::SpawnError(_) => 127,
        }
    }

    /// The worker's exit code as torch's `ProcessFailure.exitcode` has it: the code, or minus the
    /// signal; rsrun's own code ([`ExitKind::exit_code`]) for what is not a worker's exit.
    pub fn worker_exit_code(&self) -> i32 {
        match self {
            ExitKind::Code(c) => *c,
            ExitKind::Signal(s) => -s,
            other => other.exit_code(),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            ExitKind::Code(c) => format!("exit code {c}"),
            ExitKind::Signal(s) => format!("killed by {} (signal {s})", signal_name(*s)),
            ExitKind::Hang { idle, last_step } => {
                format!("hung: no progress for {:.1}s (last step {last_step})", idle.as_secs_f64())
            }
            ExitKind::SpawnError(e) => format!("could not start: {e}"),
            ExitKind::Other => "failed".to_owned(),
        }
    }
}

/// What an error file said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFileInfo {
    /// `message.message` (or `message` when it is a string).
    pub message: String,
    /// `message.extraInfo.py_callstack`.
    pub traceback: Option<String>,
    /// `message.extraInfo.timestamp` (epoch seconds).
    pub timestamp: Option<SystemTime>,
    /// When the file was last written (its modification time, to the file system's precision):
    /// the timestamp counts whole seconds, which cannot tell a file written before a peer's
    /// exit from one written just after it in the same second.
    pub written: Option<SystemTime>,
}

/// The most of an error file rsrun reads (a larger one is reported, not parsed).
pub const ERROR_FILE_LIMIT: u64 = 1 << 20;

/// Why an error file was not read.
#[derive(Debug)]
enum ErrorFileProblem {
    /// No such file: the worker wrote none.
    Absent,
    /// Not JSON, or not torchelastic's schema.
    NotJson,
    /// A symbolic link (not followed).
    Symlink,
    /// Not a regular file: what it is.
    NotRegular(&'static str),
    /// Larger than [`ERROR_FILE_LIMIT`]: its size.
    TooLarge(u64),
    /// Opening or reading failed.
    Io(std::io::Error),
}

impl std::fmt::Display for ErrorFileProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorFileProblem::Absent => f.write_str("it does not exist"),
            ErrorFileProblem::NotJson => f.write_str("it is not torchelastic's JSON"),
            ErrorFileProblem::Symlink => f.write_str("it is a symbolic link (not followed)"),
            ErrorFileProblem::NotRegular(kind) => write!(f, "it is a {kind}, not a regular file"),
            ErrorFileProblem::TooLarge(n) => {
                write!(f, "it is {n} bytes, over the {} KiB read limit", ERROR_FILE_LIMIT / 1024)
            }
            ErrorFileProblem::Io(e) => write!(f, "{e}"),
        }
    }
}

/// The JSON of an error file, read defensively: the worker controls the path's last component, so
/// it is opened with `O_NOFOLLOW` (a link to `/dev/zero` is not followed), `O_NONBLOCK` (a FIFO
/// does not block the open) and `O_CLOEXEC`, must be a regular file (`fstat` of the open file), and
/// at most [`ERROR_FILE_LIMIT`] bytes are read.
fn read_error_json(path: &Path) -> Result<(serde_json::Value, Option<SystemTime>), ErrorFileProblem> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match (e.kind(), e.raw_os_error()) {
            (std::io::ErrorKind::NotFound, _) => ErrorFileProblem::Absent,
            (_, Some(libc::ELOOP)) => ErrorFileProblem::Symlink,
            _ => ErrorFileProblem::Io(e),
        })?;
    let meta = file.metadata().map_err(ErrorFileProblem::Io)?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let kind = if ft.is_fifo() {
            "FIFO"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_block_device() {
            "block device"
        } else if ft.is_socket() {
            "socket"
        } else if ft.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(ErrorFileProblem::NotRegular(kind));
    }
    // One byte past the limit tells a file at the limit from a larger one (its size may still grow).
    let mut buf = Vec::new();
    (&file).take(ERROR_FILE_LIMIT + 1).read_to_end(&mut buf).map_err(ErrorFileProblem::Io)?;
    if buf.len() as u64 > ERROR_FILE_LIMIT {
        return Err(ErrorFileProblem::TooLarge(meta.len().max(buf.len() as u64)));
    }
    let v: serde_json::Value = serde_json::from_slice(&buf).map_err(|_| ErrorFileProblem::NotJson)?;
    if v.get("message").is_none() {
        return Err(ErrorFileProblem::NotJson);
    }
    Ok((v, meta.modified().ok()))
}

/// Reads a torchelastic error file (see [`read_error_json`] for how). `None` when absent or not
/// torchelastic's JSON; a file that is not read (a FIFO, a device, a symbolic link, one over
/// [`ERROR_FILE_LIMIT`], an open error) gives an [`ErrorFileInfo`] whose message says why, for the
/// report.
///
/// Blocking I/O (bounded, but the log directory may be on a network file system): call it off the
/// async runtime.
pub fn read_error_file(path: &Path) -> Option<ErrorFileInfo> {
    let (v, written) = match read_error_json(path) {
        Ok(v) => v,
        Err(ErrorFileProblem::Absent | ErrorFileProblem::NotJson) => return None,
        Err(problem) => {
            return Some(ErrorFileInfo { message: format!("<error file not read: {problem}>"), traceback: None, timestamp: None, written: None });
        }
    };
    let msg = v.get("message")?;
    // torch's `ProcessFailure`: a string message has its timestamp at the top level, a dict one
    // in `extraInfo`; `int(...)` of a string or a number (a float too).
    let seconds = |t: &serde_json::Value| {
        t.as_str()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .or_else(|| t.as_f64())
            .filter(|s| s.is_finite() && *s >= 0.0)
            // A time past what SystemTime holds is no time (checked: `+` would panic the reader).
            .and_then(|s| UNIX_EPOCH.checked_add(Duration::from_secs(s as u64)))
    };
    if let Some(s) = msg.as_str() {
        let timestamp = v.get("timestamp").and_then(seconds);
        return Some(ErrorFileInfo { message: s.to_owned(), traceback: None, timestamp, written });
    }
    let message = msg.get("message").and_then(|m| m.as_str()).unwrap_or("<no message>").to_owned();
    let extra = msg.get("extraInfo");
    let traceback = extra.and_then(|e| e.get("py_callstack")).and_then(|t| t.as_str()).map(str::to_owned);
    let timestamp = extra.and_then(|e| e.get("timestamp")).and_then(seconds);
    Some(ErrorFileInfo { message, traceback, timestamp, written })
}

/// torchrun's copy of the root cause for its own parent (`@record` on the launcher, torchrun.md
/// §4.4): the root cause's error file, read as [`read_error_file`] does, with `message.errorCode`
/// set to the worker's exit code (negative for a signal, as torch's `ProcessFailure`); without a
/// readable one (a binary, a worker on another node), a record of the failure in the same schema.
/// Written atomically (a temporary file in the same directory, then a rename).
///
/// # Errors
/// Writing or renaming the file failed (the message names the path).
pub fn write_parent_error_file(path: &Path, report: &FailureReport) -> std::io::Result<()> {
    let root = &report.root;
    let code = root.exit.worker_exit_code();
    let copied = root.error.as_ref().and(root.error_file.as_deref()).and_then(|p| read_error_json(p).ok()).map(|(v, _)| v);
    let mut data = copied.unwrap_or_else(|| {
        let time = root.error.as_ref().and_then(|e| e.timestamp).unwrap_or(root.time);
        let secs = time.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        serde_json::json!({
            "message": {
                "message": format!("ChildFailedError: {} FAILED: {}", report.program, root.headline()),
                "extraInfo": { "py_callstack": report.render(), "timestamp": secs.to_string() },
            }
        })
    });
    // As torch: a plain-string `message` is copied as it is.
    if let Some(m) = data.get_mut("message").and_then(serde_json::Value::as_object_mut) {
        m.insert("errorCode".into(), code.into());
    }
    let bytes = serde_json::to_vec(&data).map_err(std::io::Error::other)?;
    write_atomically(path, &bytes).map_err(|e| std::io::Error::new(e.kind(), format!("error file {}: {e}", path.display())))
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader sees the old file or the whole new one.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let name = path.file_name().ok_or_else(|| std::io::Error::other("the path names no file"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".rsrun-{}.tmp", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// One failed or affected worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    /// Global rank (`None` when the failure is not a worker's).
    pub rank: Option<u32>,
    /// Local rank.
    pub local_rank: Option<u32>,
    /// Node id at the rendezvous.
    pub node_id: String,
    /// Host name.
    pub hostname: String,
    /// Process id (0 when unknown).
    pub pid: i32,
    /// How it ended.
    pub exit: ExitKind,
    /// When rsrun saw it end.
    pub time: SystemTime,
    /// Its TORCHELASTIC_ERROR_FILE.
    pub error_file: Option<PathBuf>,
    /// The error file's content, when the worker wrote one.
    pub error: Option<ErrorFileInfo>,
    /// Last lines of its stderr.
    pub stderr_tail: Vec<String>,
    /// Free text (a remote failure's message, a hang's details).
    pub message: Option<String>,
    /// True when rsrun stopped it (after the root cause, or for a restart).
    pub stopped_by_rsrun: bool,
}

impl WorkerFailure {
    /// A short one-line description: `rank 3 (local_rank 1) on host: exit code 7`.
    pub fn headline(&self) -> String {
        let who = match (self.rank, self.local_rank) {
            (Some(r), Some(l)) => format!("rank {r} (local_rank {l})"),
            (Some(r), None) => format!("rank {r}"),
            _ => "node".to_owned(),
        };
        let host = if self.hostname.is_empty() { &self.node_id } else { &self.hostname };
        format!("{who} on {host}: {}", self.exit.describe())
    }

    /// A compact message for the rendezvous daemon (shown by the other nodes): the error file's
    /// message, else the last stderr lines.
    pub fn remote_message(&self) -> String {
        let mut s = String::new();
        if let Some(e) = &self.error {
            s.push_str(&e.message);
            if let Some(tb) = &e.traceback {
                s.push('\n');
                s.push_str(tb);
            }
        } else if let Some(m) = &self.message {
            s.push_str(m);
        }
        if !self.stderr_tail.is_empty() {
            if !s.is_empty() {
                s.push('\n');
            }
            s.push_str("stderr:\n");
            for line in self.stderr_tail.iter().rev().take(10).collect::<Vec<_>>().into_iter().rev() {
                s.push_str(line);
                s.push('\n');
            }
        }
        if s.len() > 4096 {
            let mut cut = s.len() - 4096;
            while !s.is_char_boundary(cut) {
                cut += 1;
            }
            s = format!("...{}", &s[cut..]);
        }
        s
    }
}

/// The summary printed when the job fails.
#[derive(Debug, Clone)]
pub struct FailureReport {
    /// Job id.
    pub job_id: String,
    /// The program, as named by the user.
    pub program: String,
    /// The round that failed.
    pub round: u64,
    /// Restarts consumed.
    pub restart_count: u32,
    /// Restart budget.
    pub max_restarts: u32,
    /// The first failure.
    pub root: WorkerFailure,
    /// Other failed or stopped workers of this node.
    pub others: Vec<WorkerFailure>,
    /// Why the job failed (e.g. "restart budget exhausted").
    pub reason: String,
}

impl FailureReport {
    /// rsrun's exit code: the root cause's.
    pub fn exit_code(&self) -> i32 {
        self.root.exit.exit_code()
    }

    /// The human-readable summary.
    pub fn render(&self) -> String {
        const RULE: &str = "============================================================";
        const THIN: &str = "------------------------------------------------------------";
        let mut s = String::new();
        let r = &self.root;
        let _ = writeln!(s, "{RULE}");
        let _ = writeln!(
            s,
            "rsrun: {} FAILED (job {}, round {}, restarts {}/{}): {}",
            self.program, self.job_id, self.round, self.restart_count, self.max_restarts, self.reason
        );
        let _ = writeln!(s, "{THIN}");
        let _ = writeln!(s, "Root cause (first observed failure):");
        if let Some(rank) = r.rank {
            match r.local_rank {
                Some(lr) => {
                    let _ = writeln!(s, "  rank       : {rank} (local_rank {lr})");
                }
                None => {
                    let _ = writeln!(s, "  rank       : {rank}");
                }
            }
        }
        let host = if r.hostname.is_empty() || r.node_id.is_empty() || r.hostname == r.node_id {
            if r.hostname.is_empty() { r.node_id.clone() } else { r.hostname.clone() }
        } else {
            format!("{} (node {})", r.hostname, r.node_id)
        };
        let _ = writeln!(s, "  node       : {host}");
        let code = self.exit_code();
        let _ = writeln!(s, "  exit       : {} -> rsrun exits {code}", r.exit.describe());
        if r.pid > 0 {
            let _ = writeln!(s, "  pid        : {}", r.pid);
        }
        let time = r.error.as_ref().and_then(|e| e.timestamp).unwrap_or(r.time);
        let _ = writeln!(s, "  time       : {}", format_utc(time));
        match &r.error_file {
            Some(p) if r.error.is_some() => {
                let _ = writeln!(s, "  error_file : {}", p.display());
            }
            _ => {
                let _ = writeln!(s, "  error_file : <N/A>");
            }
        }
        if let Some(e) = &r.error {
            // The message's first line after the label, the rest under it (a load_state_dict
            // error is thousands of lines: its first and last ones are kept).
            let mut lines = e.message.lines();
            let _ = writeln!(s, "  error      : {}", shown(lines.next().unwrap_or_default()));
            let rest: Vec<&str> = lines.collect();
            write_lines(&mut s, &rest, "    ", MAX_MESSAGE_LINES, 0, "of the message in the error file");
            if let Some(tb) = e.traceback.as_deref().filter(|t| !t.trim().is_empty()) {
                // Its first line ("Traceback (most recent call last):") and its last ones: the
                // frame that failed and the exception are at the end.
                let lines: Vec<&str> = tb.lines().collect();
                let _ = writeln!(s, "  traceback  :");
                write_lines(&mut s, &lines, "    ", MAX_TRACEBACK_LINES, 1, "in the error file");
            }
        }
        if let Some(m) = &r.message {
            let _ = writeln!(s, "  message    :");
            let lines: Vec<&str> = m.lines().collect();
            write_lines(&mut s, &lines, "    ", MAX_MESSAGE_LINES, 0, "");
        }
        if !r.stderr_tail.is_empty() {
            let _ = writeln!(s, "  stderr (last {} lines):", r.stderr_tail.len());
            for line in &r.stderr_tail {
                let _ = writeln!(s, "    | {}", shown(line));
            }
        }
        if !self.others.is_empty() {
            let _ = writeln!(s, "{THIN}");
            let _ = writeln!(s, "Other ranks affected:");
            for o in &self.others {
                let suffix = if o.stopped_by_rsrun { " (stopped by rsrun)" } else { "" };
                let _ = writeln!(s, "  {}{suffix}", o.headline());
            }
        }
        let _ = writeln!(s, "{RULE}");
        s
    }
}

/// `2026-11-22 08:19:40 UTC`.
pub fn format_utc(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Most lines of a traceback the report shows (its first, and the last ones).
const MAX_TRACEBACK_LINES: usize = 40;
/// Most lines of a message the report shows (the first and last ones).
const MAX_MESSAGE_LINES: usize = 40;
/// Most bytes of one line the report shows.
const MAX_LINE_BYTES: usize = 512;

/// Writes `lines` indented by `indent`: all of them when they fit `max`, else the first `head`
/// and the last ones, with the number left out (`where_`: where the rest is).
fn write_lines(s: &mut String, lines: &[&str], indent: &str, max: usize, head: usize, where_: &str) {
    if lines.len() <= max {
        for line in lines {
            let _ = writeln!(s, "{indent}{}", shown(line));
        }
        return;
    }
    let tail = max - head;
    for line in &lines[..head] {
        let _ = writeln!(s, "{indent}{}", shown(line));
    }
    let skipped = lines.len() - head - tail;
    let _ = writeln!(s, "{indent}... {skipped} lines left out{}{where_} ...", if where_.is_empty() { "" } else { " " });
    for line in &lines[lines.len() - tail..] {
        let _ = writeln!(s, "{indent}{}", shown(line));
    }
}

/// A line of a worker's output or error file as the report prints it: control characters made
/// visible (an escape sequence in a worker's stderr cleared the terminal or retitled it), and cut
/// at [`MAX_LINE_BYTES`] with the length said.
pub(crate) fn shown(line: &str) -> String {
    let mut out = String::with_capacity(line.len().min(MAX_LINE_BYTES + 32));
    for (i, c) in line.char_indices() {
        if i >= MAX_LINE_BYTES {
            let _ = write!(out, "... ({} bytes)", line.len());
            break;
        }
        match c {
            '\t' => out.push('\t'),
            c if c.is_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(exit: ExitKind) -> WorkerFailure {
        WorkerFailure {
            rank: Some(1),
            local_rank: Some(1),
            node_id: "n0".into(),
            hostname: "host".into(),
            pid: 42,
            exit,
            time: UNIX_EPOCH + Duration::from_secs(1_795_854_780),
            error_file: None,
            error: None,
            stderr_tail: vec!["boom".into()],
            message: None,
            stopped_by_rsrun: false,
        }
    }

    #[test]
    fn exit_codes() {
        assert_eq!(ExitKind::Code(7).exit_code(), 7);
        assert_eq!(ExitKind::Signal(11).exit_code(), 139);
        assert_eq!(ExitKind::Code(0).exit_code(), 1);
        assert_eq!(ExitKind::Hang { idle: Duration::from_secs(1), last_step: 3 }.exit_code(), 124);
    }

    #[test]
    fn utc() {
        assert_eq!(format_utc(UNIX_EPOCH), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_utc(UNIX_EPOCH + Duration::from_secs(1_795_854_780)), "2026-11-28 08:33:00 UTC");
        assert_eq!(format_utc(UNIX_EPOCH + Duration::from_secs(951_782_400)), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn error_file_schema() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("error.json");
        std::fs::write(
            &p,
            r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "Traceback\n  x", "timestamp": "1700000000"}}}"#,
        )
        .unwrap();
        let e = read_error_file(&p).unwrap();
        assert_eq!(e.message, "RuntimeError: boom");
        assert_eq!(e.traceback.as_deref(), Some("Traceback\n  x"));
        assert_eq!(e.timestamp, Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
        // A timestamp past what the system time holds is no timestamp, not a panic.
        std::fs::write(&p, r#"{"message": {"message": "m", "extraInfo": {"timestamp": 18446744073709551615}}}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap().timestamp, None);
        std::fs::write(&p, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap().message, "plain");
        assert!(read_error_file(&dir.path().join("missing.json")).is_none());
        // torch's string form keeps its timestamp at the top level; a float counts (int(...)).
        std::fs::write(&p, r#"{"message": "plain", "timestamp": "1700000000"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap().timestamp, Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
        std::fs::write(&p, r#"{"message": {"message": "m", "extraInfo": {"timestamp": 1700000000.75}}}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap().timestamp, Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
    }

    /// What a worker wrote reaches the report bounded and inert: control characters shown, not
    /// sent to the terminal (an escape sequence cleared it); a huge line cut; a long traceback
    /// keeps its first line and its end (the frame that failed); a long message its ends.
    #[test]
    fn worker_text_in_the_report_is_bounded_and_inert() {
        let mut root = failure(ExitKind::Code(1));
        root.stderr_tail = vec!["\x1b[2J\x1b[Hgone\x07".into(), "x".repeat(100_000)];
        let tb: Vec<String> = std::iter::once("Traceback (most recent call last):".to_owned())
            .chain((0..100).map(|i| format!("  frame {i}")))
            .chain(std::iter::once("ValueError: at the end".to_owned()))
            .collect();
        let message: Vec<String> = (0..1000).map(|i| format!("missing key {i}")).collect();
        root.error = Some(ErrorFileInfo { message: message.join("\n"), traceback: Some(tb.join("\n")), timestamp: None, written: None });
        let text = report_with(root).render();
        assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text}");
        assert!(text.contains("| \\x1b[2J\\x1b[Hgone\\x07"), "{text}");
        assert!(text.contains("... (100000 bytes)") && text.len() < 20_000, "{} bytes", text.len());
        assert!(text.contains("    Traceback (most recent call last):\n    ... 62 lines left out in the error file ...\n      frame 62"), "{text}");
        assert!(text.contains("ValueError: at the end"), "{text}");
        assert!(text.contains("error      : missing key 0\n") && text.contains("missing key 999") && !text.contains("missing key 500\n"), "{text}");
    }

    #[test]
    fn render_names_root_cause() {
        let mut other = failure(ExitKind::Signal(15));
        other.rank = Some(0);
        other.local_rank = Some(0);
        other.stopped_by_rsrun = true;
        let report = FailureReport {
            job_id: "j".into(),
            program: "train".into(),
            round: 0,
            restart_count: 0,
            max_restarts: 0,
            root: failure(ExitKind::Signal(11)),
            others: vec![other],
            reason: "no restarts left".into(),
        };
        let text = report.render();
        assert!(text.contains("rank       : 1 (local_rank 1)"), "{text}");
        assert!(text.contains("killed by SIGSEGV (signal 11) -> rsrun exits 139"), "{text}");
        assert!(text.contains("| boom"), "{text}");
        assert!(text.contains("rank 0 (local_rank 0) on host: killed by SIGTERM (signal 15) (stopped by rsrun)"), "{text}");
        assert_eq!(report.exit_code(), 139);
    }

    /// Runs `f` on a thread of its own; fails (instead of hanging) when it takes over 10 s.
    fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("reading the error file blocked")
    }

    #[test]
    fn error_file_fifo_is_reported_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("error.json");
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = within_10s(move || read_error_file(&p)).expect("a FIFO is reported");
        assert_eq!(e.message, "<error file not read: it is a FIFO, not a regular file>");
        assert_eq!((e.traceback, e.timestamp), (None, None));
    }

    #[test]
    fn error_file_over_the_limit_and_links_are_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.json");
        let mut text = String::from(r#"{"message": "#);
        text.push('"');
        text.push_str(&"x".repeat(2 << 20));
        text.push_str("\"}");
        std::fs::write(&big, &text).unwrap();
        let e = read_error_file(&big).expect("an oversized file is reported");
        assert_eq!(e.message, format!("<error file not read: it is {} bytes, over the 1024 KiB read limit>", text.len()));
        // A link to /dev/zero would be read forever if followed.
        let link = dir.path().join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = within_10s(move || read_error_file(&link)).expect("a link is reported");
        assert_eq!(e.message, "<error file not read: it is a symbolic link (not followed)>");
        // At the limit is still read.
        let edge = dir.path().join("edge.json");
        let mut text = String::from(r#"{"message": ""#);
        text.push_str(&"y".repeat(ERROR_FILE_LIMIT as usize - text.len() - 2));
        text.push_str("\"}");
        assert_eq!(text.len() as u64, ERROR_FILE_LIMIT);
        std::fs::write(&edge, &text).unwrap();
        assert!(read_error_file(&edge).unwrap().message.starts_with("yyy"));
    }

    fn report_with(root: WorkerFailure) -> FailureReport {
        FailureReport {
            job_id: "j".into(),
            program: "train".into(),
            round: 0,
            restart_count: 0,
            max_restarts: 0,
            root,
            others: Vec::new(),
            reason: "no restarts left".into(),
        }
    }

    #[test]
    fn parent_error_file_copies_the_root_cause_with_its_error_code() {
        let dir = tempfile::tempdir().unwrap();
        let child = dir.path().join("error.json");
        std::fs::write(
            &child,
            r#"{"message": {"message": "RuntimeError: boom", "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000"}}}"#,
        )
        .unwrap();
        let mut root = failure(ExitKind::Signal(11));
        root.error = read_error_file(&child);
        root.error_file = Some(child);
        let parent = dir.path().join("parent.json");
        std::fs::write(&parent, "stale").unwrap();
        write_parent_error_file(&parent, &report_with(root)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&parent).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "RuntimeError: boom");
        assert_eq!(v["message"]["extraInfo"]["py_callstack"], "tb");
        assert_eq!(v["message"]["errorCode"], -11, "torch's exit code of a signal");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "no temporary file is left: {names:?}");
    }

    #[test]
    fn parent_error_file_without_a_worker_error_file_records_the_failure() {
        let dir = tempfile::tempdir().unwrap();
        let parent = dir.path().join("parent.json");
        write_parent_error_file(&parent, &report_with(failure(ExitKind::Code(7)))).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&parent).unwrap()).unwrap();
        assert_eq!(v["message"]["errorCode"], 7);
        let msg = v["message"]["message"].as_str().unwrap();
        assert!(msg.starts_with("ChildFailedError: train FAILED: rank 1 (local_rank 1) on host: exit code 7"), "{msg}");
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "1795854780");
        assert!(v["message"]["extraInfo"]["py_callstack"].as_str().unwrap().contains("| boom"));
        // The file a worker made unreadable is not copied: the failure is recorded instead.
        let fifo = dir.path().join("fifo.json");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let mut root = failure(ExitKind::Code(3));
        root.error = read_error_file(&fifo);
        root.error_file = Some(fifo);
        let report = report_with(root);
        within_10s(move || write_parent_error_file(&parent, &report)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("parent.json")).unwrap()).unwrap();
        assert_eq!(v["message"]["errorCode"], 3);
        assert!(v["message"]["message"].as_str().unwrap().starts_with("ChildFailedError: "));
    }
}
