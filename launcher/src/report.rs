//! The failure report: one summary naming the root cause, then the other affected ranks.
//!
//! The root cause is the first failure observed: on this node, the first worker whose exit (or hang)
//! rsrun saw; across nodes, the failure the rendezvous daemon recorded first for the job. Workers that
//! rsrun itself stopped afterwards are listed as affected, never as causes.
//!
//! Error files use torchelastic's schema, so PyTorch's `@record` tracebacks (and the worker runtime's
//! panic reports) show up:
//! `{"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": "<traceback>",
//! "timestamp": "<epoch s>"}}, "errorCode": <n>}` (`message` may also be a plain string).

use std::fmt::Write as _;
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

    fn describe(&self) -> String {
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
}

/// Reads a torchelastic error file. `None` when absent or unreadable.
pub fn read_error_file(path: &Path) -> Option<ErrorFileInfo> {
    let text = std::fs::read_to_string(path).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let msg = v.get("message")?;
    if let Some(s) = msg.as_str() {
        return Some(ErrorFileInfo { message: s.to_owned(), traceback: None, timestamp: None });
    }
    let message = msg.get("message").and_then(|m| m.as_str()).unwrap_or("<no message>").to_owned();
    let extra = msg.get("extraInfo");
    let traceback = extra.and_then(|e| e.get("py_callstack")).and_then(|t| t.as_str()).map(str::to_owned);
    let timestamp = extra
        .and_then(|e| e.get("timestamp"))
        .and_then(|t| t.as_str().and_then(|s| s.parse::<u64>().ok()).or_else(|| t.as_u64()))
        .map(|s| UNIX_EPOCH + Duration::from_secs(s));
    Some(ErrorFileInfo { message, traceback, timestamp })
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
            let _ = writeln!(s, "  error      : {}", e.message);
            if let Some(tb) = e.traceback.as_deref().filter(|t| !t.trim().is_empty()) {
                const MAX_TRACEBACK_LINES: usize = 40;
                let lines: Vec<&str> = tb.lines().collect();
                let _ = writeln!(s, "  traceback  :");
                for line in lines.iter().take(MAX_TRACEBACK_LINES) {
                    let _ = writeln!(s, "    {line}");
                }
                if lines.len() > MAX_TRACEBACK_LINES {
                    let _ = writeln!(s, "    ... {} more lines in the error file", lines.len() - MAX_TRACEBACK_LINES);
                }
            }
        }
        if let Some(m) = &r.message {
            let _ = writeln!(s, "  message    :");
            for line in m.lines() {
                let _ = writeln!(s, "    {line}");
            }
        }
        if !r.stderr_tail.is_empty() {
            let _ = writeln!(s, "  stderr (last {} lines):", r.stderr_tail.len());
            for line in &r.stderr_tail {
                let _ = writeln!(s, "    | {line}");
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
        std::fs::write(&p, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(read_error_file(&p).unwrap().message, "plain");
        assert!(read_error_file(&dir.path().join("missing.json")).is_none());
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
}
