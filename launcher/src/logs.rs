//! Worker output: per-rank files and the merged, prefixed console stream.
//!
//! Each worker's stdout and stderr are pipes. One task per pipe ([`pump`]) reads it and
//! - appends the raw bytes to `<log-dir>/<job>/attempt_<round>/<rank>/{stdout,stderr}.log` (always,
//!   unless `--log-dir /dev/null`);
//! - assembles lines ([`crate::progress`]: `\r` progress lines, `\r\n`, the length cap) and sends
//!   them, prefixed, to the console as [`ConsoleEvent`]s (unless filtered or redirected). The binary
//!   owns the terminal and renders these ([`crate::console`]); the library never prints;
//! - keeps the last lines of stderr for the failure report;
//! - copies lines matching `--duplicate-std*-filters` to `attempt_<round>/filtered_std*.log`.
//!
//! No file is tailed: the pipe is the only source, so console lines appear as soon as the worker
//! writes them and nothing is lost at exit.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::progress::{Action, LineAssembler, Show};

/// Something for the console. Worker lines arrive complete (prefix, line, `\n`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsoleEvent {
    /// A worker's stdout line, for rsrun's stdout.
    Stdout(Vec<u8>),
    /// A worker's stderr line, for rsrun's stderr.
    Stderr(Vec<u8>),
    /// A worker's carriage-return progress line, on a stream whose console is a terminal: drawn in
    /// place until it is done.
    Progress {
        /// The worker stream (unique in this rsrun process).
        source: u64,
        /// Which of rsrun's streams it belongs to.
        stream: StreamKind,
        /// The prefixed state, without a newline.
        text: Vec<u8>,
        /// The line ended: `text` is its final state, printed as an ordinary line in its place.
        done: bool,
    },
    /// One line from rsrun itself (notes, restarts, the failure summary), for stderr.
    Note(String),
    /// The rendezvous status: on a terminal it replaces the previous status line in place.
    Status(String),
    /// The status line is finished (left as is on a terminal, nothing otherwise).
    StatusDone,
}

/// Where console events go.
pub type ConsoleTx = mpsc::Sender<ConsoleEvent>;

/// Which stream a pump reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// stdout.
    Stdout,
    /// stderr.
    Stderr,
}

/// What one of rsrun's console streams is; the binary decides (`IsTerminal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsoleMode {
    /// A terminal: progress lines are drawn in place.
    Terminal,
    /// A pipe or file: progress lines are printed as ordinary lines, at most one a second per stream.
    Plain,
}

/// The console mode of rsrun's stdout and stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsoleModes {
    /// rsrun's stdout (worker stdout lines).
    pub stdout: ConsoleMode,
    /// rsrun's stderr (worker stderr lines, notes, the rendezvous status).
    pub stderr: ConsoleMode,
    /// rsrun's stdin is a terminal: a worker that reads it may leave a prompt unfinished on its
    /// line, shown in place on a terminal console ([`crate::progress`]).
    pub prompts: bool,
}

impl ConsoleModes {
    /// Both streams plain.
    pub const PLAIN: ConsoleModes = ConsoleModes { stdout: ConsoleMode::Plain, stderr: ConsoleMode::Plain, prompts: false };

    /// The mode of the stream that `kind` lines go to.
    pub fn of(&self, kind: StreamKind) -> ConsoleMode {
        match kind {
            StreamKind::Stdout => self.stdout,
            StreamKind::Stderr => self.stderr,
        }
    }
}

/// The last lines of a stream.
#[derive(Debug)]
pub struct Tail {
    lines: VecDeque<String>,
    cap: usize,
}

impl Tail {
    /// Keeps at most `cap` lines.
    pub fn new(cap: usize) -> Self {
        Tail { lines: VecDeque::with_capacity(cap.min(64)), cap }
    }

    fn push(&mut self, line: &[u8]) {
        if self.cap == 0 {
            return;
        }
        if self.lines.len() == self.cap {
            self.lines.pop_front();
        }
        let s = String::from_utf8_lossy(line);
        self.lines.push_back(s.trim_end_matches('\r').to_owned());
    }

    /// The kept lines, oldest first.
    pub fn lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

/// A shared tail.
pub type SharedTail = Arc<Mutex<Tail>>;

/// `--duplicate-std*-filters`: the substrings, and the attempt's shared filtered file.
pub type DuplicateSink = (Arc<Vec<String>>, Arc<tokio::sync::Mutex<LogFile>>);

/// A log file written off the launcher's thread. The launcher runs on one thread; a plain write
/// to a slow or hung disk (NFS) would hold up its keep-alives, signals and every other worker's
/// output. Each write here runs on tokio's blocking pool instead, one at a time per file, so such a
/// disk holds up only this stream: its pipe fills and its worker waits, as if it wrote the file
/// itself. A failed write is reported once, naming the file, and the file is dropped.
#[derive(Debug)]
pub struct LogFile {
    file: Option<tokio::fs::File>,
    path: std::path::PathBuf,
}

impl LogFile {
    /// Wraps a file opened (created, or opened for appending) at `path`.
    pub fn new(file: std::fs::File, path: std::path::PathBuf) -> Self {
        LogFile { file: Some(tokio::fs::File::from_std(file)), path }
    }

    /// Writes `bytes` in one `write_all` (a line of a shared file never interleaves with another
    /// writer's). An error, here or from the previous write, ends the file's writing.
    pub async fn write(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        let Some(file) = self.file.as_mut() else { return };
        if let Err(err) = file.write_all(bytes).await {
            self.failed(&err);
        }
    }

    /// Waits for the last write to land (its error, if any, is reported).
    pub async fn flush(&mut self) {
        use tokio::io::AsyncWriteExt;
        let Some(file) = self.file.as_mut() else { return };
        if let Err(err) = file.flush().await {
            self.failed(&err);
        }
    }

    fn failed(&mut self, err: &std::io::Error) {
        tracing::warn!(path = %self.path.display(), %err, "cannot write the log file {}: {err}; continuing without it", self.path.display());
        self.file = None;
    }
}

/// A stream's way to the console.
#[derive(Debug)]
pub struct ConsoleSink {
    /// The console.
    pub tx: ConsoleTx,
    /// This worker's line prefix.
    pub prefix: Vec<u8>,
    /// What the console stream is (from [`ConsoleModes::of`]).
    pub mode: ConsoleMode,
    /// The worker reads a terminal: an unfinished line may be a prompt ([`ConsoleModes::prompts`]).
    pub prompts: bool,
}

/// Where one stream goes.
#[derive(Debug, Default)]
pub struct StreamSink {
    /// The per-rank log file.
    pub file: Option<LogFile>,
    /// The console; `None` when filtered or redirected.
    pub console: Option<ConsoleSink>,
    /// Last lines, for the failure report.
    pub tail: Option<SharedTail>,
    /// `--duplicate-std*-filters`: substrings and the shared filtered file.
    pub duplicate: Option<DuplicateSink>,
    /// Once cancelled, lines no longer go to the console (the round is over but the pipe is still
    /// open); the file, tail and filtered file still get them.
    pub quiet: Option<CancellationToken>,
}

/// Lines longer than this are cut into pieces for the console.
const MAX_LINE: usize = 64 * 1024;

/// Source ids of [`ConsoleEvent::Progress`].
static NEXT_SOURCE: AtomicU64 = AtomicU64::new(0);

/// Copies `reader` to the sink until EOF, then waits for the log file's last write.
pub async fn pump<R: AsyncRead + Unpin>(mut reader: R, kind: StreamKind, mut sink: StreamSink) {
    let source = NEXT_SOURCE.fetch_add(1, Ordering::Relaxed);
    let mode = sink.console.as_ref().map_or(ConsoleMode::Plain, |c| c.mode);
    let prompts = sink.console.as_ref().is_some_and(|c| c.prompts);
    let mut lines = LineAssembler::new(mode, MAX_LINE).with_prompts(prompts);
    let mut actions = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let deadline = lines.next_deadline().map(tokio::time::Instant::from_std);
        let read = tokio::select! {
            read = reader.read(&mut buf) => Some(read),
            () = sleep_until(deadline) => None,
        };
        let now = tokio::time::Instant::now().into_std();
        match read {
            None => lines.poll(now, &mut actions),
            Some(Ok(0)) => break,
            Some(Ok(n)) => {
                let chunk = &buf[..n];
                if let Some(file) = &mut sink.file {
                    file.write(chunk).await;
                }
                lines.push(chunk, now, &mut actions);
            }
            Some(Err(err)) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Some(Err(err)) => {
                tracing::debug!(%err, "worker pipe read failed");
                break;
            }
        }
        for action in actions.drain(..) {
            emit(&mut sink, kind, source, action).await;
        }
    }
    lines.finish(&mut actions);
    for action in actions.drain(..) {
        emit(&mut sink, kind, source, action).await;
    }
    if let Some(file) = &mut sink.file {
        file.flush().await;
    }
    if let Some((_, file)) = &sink.duplicate {
        file.lock().await.flush().await;
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn emit(sink: &mut StreamSink, kind: StreamKind, source: u64, action: Action) {
    let (text, show) = match action {
        Action::Update(text) => (text, None),
        Action::Line { text, show } => {
            keep_line(sink, &text).await;
            (text, Some(show))
        }
    };
    if sink.quiet.as_ref().is_some_and(CancellationToken::is_cancelled) {
        sink.console = None;
    }
    let Some(console) = &sink.console else { return };
    let mut line = Vec::with_capacity(console.prefix.len() + text.len() + 1);
    line.extend_from_slice(&console.prefix);
    line.extend_from_slice(&text);
    let ev = match (show, console.mode) {
        (Some(Show::Already), _) => return,
        (None, ConsoleMode::Terminal) => ConsoleEvent::Progress { source, stream: kind, text: line, done: false },
        (Some(Show::Finish), _) => ConsoleEvent::Progress { source, stream: kind, text: line, done: true },
        // Ordinary lines, and plain consoles' updates.
        (Some(Show::Print), _) | (None, ConsoleMode::Plain) => {
            line.push(b'\n');
            match kind {
                StreamKind::Stdout => ConsoleEvent::Stdout(line),
                StreamKind::Stderr => ConsoleEvent::Stderr(line),
            }
        }
    };
    let sent = match &sink.quiet {
        // A send waiting on a full console channel ends when the console is muted.
        Some(quiet) => tokio::select! {
            biased;
            () = quiet.cancelled() => false,
            sent = console.tx.send(ev) => sent.is_ok(),
        },
        None => console.tx.send(ev).await.is_ok(),
    };
    if !sent {
        // The console is gone (rsrun is exiting) or muted: keep writing files only.
        sink.console = None;
    }
}

/// A finished line goes to the failure report's tail and the filtered logs.
async fn keep_line(sink: &StreamSink, line: &[u8]) {
    if let Some(tail) = &sink.tail {
        tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }
    if let Some((needles, file)) = &sink.duplicate {
        let text = String::from_utf8_lossy(line);
        if needles.iter().any(|n| text.contains(n.as_str())) {
            // One write per line: the file is opened for appending and shared with the other agents
            // of the node, whose lines must not land between a line and its newline.
            let mut buf = Vec::with_capacity(line.len() + 1);
            buf.extend_from_slice(line);
            buf.push(b'\n');
            file.lock().await.write(&buf).await;
        }
    }
}

#[cfg(test)]
mod tests;
