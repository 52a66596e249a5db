//! The console renderer: [`ConsoleEvent`]s to rsrun's stdout and stderr.
//!
//! The binary owns the real streams and decides what they are ([`ConsoleModes`]); this renderer only
//! writes to the two writers it is given, so tests pass buffers.
//!
//! On a terminal, the in-place lines (the rendezvous status and each worker stream's unfinished
//! progress line) form a block of rows at the bottom, below every ordinary line:
//! - an ordinary line (a worker line, a note) clears the block, is written, and the block is drawn
//!   again under it at the end of the batch ([`Console::settle`]);
//! - a progress update replaces its row; a finished progress line leaves the block and is written as
//!   an ordinary line;
//! - rows are drawn with line wrapping off (`ESC [?7l`), so each takes exactly one screen row and the
//!   block can be cleared by moving up; a row longer than the screen is cut at its right edge;
//! - the block is drawn on stderr when stderr is a terminal, else on stdout when stdout is one, and
//!   only output to a terminal stream is interleaved with it (a piped stream needs no clearing).
//!
//! On a plain console there is no block: worker lines are written as they come (plain progress is
//! already throttled by the pumps), and the status is printed when it changes, at most every few
//! seconds when only its elapsed time changes.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::logs::{ConsoleEvent, ConsoleMode, ConsoleModes, StreamKind};

/// Plain consoles: how often an unchanged status (only its elapsed time moves) is printed again.
const PLAIN_STATUS_EVERY: Duration = Duration::from_secs(5);

/// At most this many rows are drawn in place; the rest are counted on one more row.
const MAX_ROWS: usize = 16;

/// Clear to the end of the screen.
const CLEAR_BELOW: &[u8] = b"\x1b[J";
/// Line wrapping off and on (DECAWM).
const WRAP_OFF: &[u8] = b"\x1b[?7l";
const WRAP_ON: &[u8] = b"\x1b[?7h";

/// An in-place row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Row {
    Status,
    Progress(u64),
}

/// Renders console events to `out` (rsrun's stdout) and `err` (rsrun's stderr).
#[derive(Debug)]
pub struct Console<O: Write, E: Write> {
    out: O,
    err: E,
    modes: ConsoleModes,
    /// Where the block is drawn: stderr if it is a terminal, else stdout if it is one.
    screen: Option<StreamKind>,
    /// The in-place rows, in order of appearance.
    rows: Vec<(Row, Vec<u8>)>,
    /// How many screen rows the drawn block takes (0: none drawn, the cursor is at a line start).
    drawn: usize,
    /// The block must be drawn again.
    dirty: bool,
    /// The writer written last; the other is flushed before it, to keep their order on the screen.
    last: Option<StreamKind>,
    /// Plain consoles: the last printed status without its elapsed time, and when.
    plain_status: Option<(String, Instant)>,
}

impl<O: Write, E: Write> Console<O, E> {
    /// A console writing to `out` and `err`, which are what `modes` says.
    pub fn new(modes: ConsoleModes, out: O, err: E) -> Self {
        let screen = if modes.stderr == ConsoleMode::Terminal {
            Some(StreamKind::Stderr)
        } else if modes.stdout == ConsoleMode::Terminal {
            Some(StreamKind::Stdout)
        } else {
            None
        };
        Console { out, err, modes, screen, rows: Vec::new(), drawn: 0, dirty: false, last: None, plain_status: None }
    }

    /// Handles one event at `now`. The block is drawn again by [`settle`](Self::settle), after a batch.
    pub fn handle(&mut self, ev: ConsoleEvent, now: Instant) {
        match ev {
            ConsoleEvent::Stdout(line) => self.line(StreamKind::Stdout, &line),
            ConsoleEvent::Stderr(line) => self.line(StreamKind::Stderr, &line),
            ConsoleEvent::Note(text) => self.line(StreamKind::Stderr, &with_newline(text.into_bytes())),
            ConsoleEvent::Progress { source, stream, text, done } => {
                let row = Row::Progress(source);
                if done {
                    self.remove_row(row);
                    self.line(stream, &with_newline(text));
                } else if self.modes.of(stream) == ConsoleMode::Terminal && self.screen.is_some() {
                    self.set_row(row, text);
                } else {
                    // Pumps send updates only for terminal streams; print one that comes anyway.
                    self.line(stream, &with_newline(text));
                }
            }
            ConsoleEvent::Status(text) => {
                if self.modes.stderr == ConsoleMode::Terminal {
                    self.set_row(Row::Status, text.into_bytes());
                    return;
                }
                // Compare without the trailing elapsed time "(12s)".
                let key = text.rsplit_once(" (").map_or(text.as_str(), |(k, _)| k).to_owned();
                let due = match &self.plain_status {
                    Some((prev, at)) => *prev != key || now.duration_since(*at) >= PLAIN_STATUS_EVERY,
                    None => true,
                };
                if due {
                    self.line(StreamKind::Stderr, &with_newline(text.into_bytes()));
                    self.plain_status = Some((key, now));
                }
            }
            ConsoleEvent::StatusDone => {
                self.plain_status = None;
                // Keep the final status visible.
                if let Some(text) = self.remove_row(Row::Status) {
                    self.line(StreamKind::Stderr, &with_newline(text));
                }
            }
        }
    }

    /// The end of a batch of events: draws the block again if it changed, and flushes.
    pub fn settle(&mut self) {
        if self.dirty {
            self.dirty = false;
            self.clear();
            self.draw();
        }
        self.flush();
    }

    /// No more events: leaves the block as it is, moves to a fresh line below it, and flushes.
    pub fn finish(&mut self) {
        self.settle();
        if self.drawn > 0
            && let Some(screen) = self.screen
        {
            self.write(screen, b"\n");
            self.drawn = 0;
        }
        self.flush();
    }

    /// The writers, for tests.
    pub fn into_inner(self) -> (O, E) {
        (self.out, self.err)
    }

    /// Writes an ordinary line (with its newline) to `stream`, clearing the block first when they
    /// share the screen.
    fn line(&mut self, stream: StreamKind, line: &[u8]) {
        if self.modes.of(stream) == ConsoleMode::Terminal && self.drawn > 0 {
            self.clear();
            self.dirty = true;
        }
        self.write(stream, line);
    }

    fn set_row(&mut self, row: Row, text: Vec<u8>) {
        match self.rows.iter_mut().find(|(r, _)| *r == row) {
            Some((_, t)) if *t == text => return,
            Some((_, t)) => *t = text,
            None => self.rows.push((row, text)),
        }
        self.dirty = true;
    }

    fn remove_row(&mut self, row: Row) -> Option<Vec<u8>> {
        let idx = self.rows.iter().position(|(r, _)| *r == row)?;
        self.dirty = true;
        Some(self.rows.remove(idx).1)
    }

    /// Erases the drawn block; the cursor ends at the start of its first row.
    fn clear(&mut self) {
        let Some(screen) = self.screen else { return };
        if self.drawn == 0 {
            return;
        }
        let mut seq = b"\r".to_vec();
        if self.drawn > 1 {
            seq.extend_from_slice(format!("\x1b[{}A", self.drawn - 1).as_bytes());
        }
        seq.extend_from_slice(CLEAR_BELOW);
        self.write(screen, &seq);
        self.drawn = 0;
    }

    /// Draws the rows at the cursor (a line start); the cursor ends after the last row.
    fn draw(&mut self) {
        let Some(screen) = self.screen else { return };
        if self.rows.is_empty() {
            return;
        }
        let mut block = WRAP_OFF.to_vec();
        let mut n_rows = 0;
        for (_, text) in self.rows.iter().take(MAX_ROWS) {
            if n_rows > 0 {
                block.push(b'\n');
            }
            block.extend_from_slice(text);
            n_rows += 1;
        }
        if self.rows.len() > MAX_ROWS {
            block.extend_from_slice(format!("\n(and {} more in progress)", self.rows.len() - MAX_ROWS).as_bytes());
            n_rows += 1;
        }
        block.extend_from_slice(WRAP_ON);
        self.write(screen, &block);
        self.drawn = n_rows;
    }

    fn write(&mut self, stream: StreamKind, bytes: &[u8]) {
        if self.last.is_some_and(|l| l != stream) {
            self.flush();
        }
        self.last = Some(stream);
        // A console that cannot be written (a closed pipe) is not an error of the job.
        let _ = match stream {
            StreamKind::Stdout => self.out.write_all(bytes),
            StreamKind::Stderr => self.err.write_all(bytes),
        };
    }

    fn flush(&mut self) {
        let _ = self.out.flush();
        let _ = self.err.flush();
    }
}

fn with_newline(mut line: Vec<u8>) -> Vec<u8> {
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests;
