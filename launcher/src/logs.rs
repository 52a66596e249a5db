//! Worker output: per-rank files and the merged, prefixed console stream.
//!
//! Each worker's stdout and stderr are pipes. One task per pipe ([`pump`]) reads it and
//! - appends the raw bytes to `<log-dir>/<job>/attempt_<round>/<rank>/{stdout,stderr}.log` (always,
//!   unless `--log-dir /dev/null`);
//! - sends each complete line, prefixed, to the console as a [`ConsoleEvent`] (unless filtered or
//!   redirected). The binary owns the terminal and writes these; the library never prints;
//! - keeps the last lines of stderr for the failure report;
//! - copies lines matching `--duplicate-std*-filters` to `attempt_<round>/filtered_std*.log`.
//!
//! No file is tailed: the pipe is the only source, so console lines appear as soon as the worker
//! writes them and nothing is lost at exit.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;

/// Something for the console. Worker lines arrive complete (prefix, line, `\n`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsoleEvent {
    /// A worker's stdout line, for rsrun's stdout.
    Stdout(Vec<u8>),
    /// A worker's stderr line, for rsrun's stderr.
    Stderr(Vec<u8>),
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
pub type DuplicateSink = (Arc<Vec<String>>, Arc<Mutex<std::fs::File>>);

/// Where one stream goes.
#[derive(Debug, Default)]
pub struct StreamSink {
    /// The per-rank log file.
    pub file: Option<std::fs::File>,
    /// The console and this worker's line prefix.
    pub console: Option<(ConsoleTx, Vec<u8>)>,
    /// Last lines, for the failure report.
    pub tail: Option<SharedTail>,
    /// `--duplicate-std*-filters`: substrings and the shared filtered file.
    pub duplicate: Option<DuplicateSink>,
}

/// Lines longer than this are cut into pieces for the console.
const MAX_LINE: usize = 64 * 1024;

/// Copies `reader` to the sink until EOF.
///
/// Writes to the log file are plain blocking writes: they land in the page cache and take
/// microseconds, which is cheaper than bouncing each chunk through tokio's blocking pool.
pub async fn pump<R: AsyncRead + Unpin>(mut reader: R, kind: StreamKind, mut sink: StreamSink) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut partial: Vec<u8> = Vec::new();
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => {
                tracing::debug!(%err, "worker pipe read failed");
                break;
            }
        };
        let chunk = &buf[..n];
        if let Some(file) = &mut sink.file
            && let Err(err) = file.write_all(chunk)
        {
            tracing::warn!(%err, "cannot write a worker log file; continuing without it");
            sink.file = None;
        }
        let mut rest = chunk;
        while let Some(i) = memchr(b'\n', rest) {
            if partial.is_empty() {
                emit(&mut sink, kind, &rest[..i]).await;
            } else {
                partial.extend_from_slice(&rest[..i]);
                let line = std::mem::take(&mut partial);
                emit(&mut sink, kind, &line).await;
            }
            rest = &rest[i + 1..];
        }
        partial.extend_from_slice(rest);
        if partial.len() >= MAX_LINE {
            let line = std::mem::take(&mut partial);
            emit(&mut sink, kind, &line).await;
        }
    }
    if !partial.is_empty() {
        emit(&mut sink, kind, &partial).await;
    }
}

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&b| b == needle)
}

async fn emit(sink: &mut StreamSink, kind: StreamKind, line: &[u8]) {
    if let Some(tail) = &sink.tail {
        tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }
    if let Some((needles, file)) = &sink.duplicate {
        let text = String::from_utf8_lossy(line);
        if needles.iter().any(|n| text.contains(n.as_str())) {
            let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = f.write_all(line).and_then(|_| f.write_all(b"\n"));
        }
    }
    if let Some((tx, prefix)) = &sink.console {
        let mut out = Vec::with_capacity(prefix.len() + line.len() + 1);
        out.extend_from_slice(prefix);
        out.extend_from_slice(line);
        out.push(b'\n');
        let ev = match kind {
            StreamKind::Stdout => ConsoleEvent::Stdout(out),
            StreamKind::Stderr => ConsoleEvent::Stderr(out),
        };
        if tx.send(ev).await.is_err() {
            // The console is gone (rsrun is exiting): keep writing files only.
            sink.console = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn lines_are_prefixed_tailed_and_filed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stderr.log");
        let dup_path = dir.path().join("filtered_stderr.log");
        let (tx, mut rx) = mpsc::channel(16);
        let tail = Arc::new(Mutex::new(Tail::new(2)));
        let sink = StreamSink {
            file: Some(std::fs::File::create(&path).unwrap()),
            console: Some((tx, b"[rank 3] ".to_vec())),
            tail: Some(tail.clone()),
            duplicate: Some((
                Arc::new(vec!["loss".into()]),
                Arc::new(Mutex::new(std::fs::File::create(&dup_path).unwrap())),
            )),
        };
        let input: &[u8] = b"one\ntwo loss=1\r\nthree";
        pump(input, StreamKind::Stderr, sink).await;
        let mut got = Vec::new();
        while let Ok(ev) = rx.try_recv() {
            got.push(ev);
        }
        assert_eq!(
            got,
            vec![
                ConsoleEvent::Stderr(b"[rank 3] one\n".to_vec()),
                ConsoleEvent::Stderr(b"[rank 3] two loss=1\r\n".to_vec()),
                ConsoleEvent::Stderr(b"[rank 3] three\n".to_vec()),
            ]
        );
        assert_eq!(tail.lock().unwrap().lines(), vec!["two loss=1", "three"]);
        assert_eq!(std::fs::read(&path).unwrap(), input);
        assert_eq!(std::fs::read_to_string(&dup_path).unwrap(), "two loss=1\r\n");
    }
}
