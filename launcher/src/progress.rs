//! Carriage-return progress: one worker stream's bytes assembled into lines and in-place updates.
//!
//! A worker drawing a progress bar (tqdm, indicatif, `print(..., end="\r")`) rewrites its current
//! line: it writes `\r` and the new state, and `\n` only when the bar is done. [`LineAssembler`] turns
//! the raw bytes of one stream into [`Action`]s for the console. It is pure: the input is chunks with
//! the time they were read, the output is actions, and [`LineAssembler::next_deadline`] says when to
//! call [`LineAssembler::poll`] if nothing else arrives. The pump in [`crate::logs`] is the I/O.
//!
//! Rules:
//! - `\n` ends a line; a `\r` right before it is part of the line end (`\r\n` is a plain newline).
//! - Any other `\r` returns to the start of the line: the line is a progress line, cut into segments.
//!   What it shows is its latest non-empty segment (workers rewrite the whole line, as tqdm and
//!   indicatif do).
//! - A line's final state, what it shows when `\n` (or EOF) arrives, is an ordinary line: the console
//!   keeps it, and so do the failure report's tail and the filtered logs. Intermediate states are
//!   console-only updates.
//! - [`ConsoleMode::Terminal`]: each read that changes what a progress line shows gives one
//!   [`Action::Update`], drawn in place. The unfinished last segment is shown too, without a trailing
//!   incomplete escape sequence or UTF-8 character.
//! - [`ConsoleMode::Plain`]: at most one update per [`PLAIN_EVERY`] per stream, printed as an ordinary
//!   line, and only of complete segments; the unfinished last segment counts as complete once it was
//!   idle that long. The final state is always given, and printed unless the last update showed it.
//! - [`ConsoleMode::Terminal`], when the worker reads a terminal ([`LineAssembler::with_prompts`]):
//!   an ordinary line left unfinished for [`PROMPT_IDLE`] is shown in place as it stands, and
//!   finished in place once its `\n` comes: a prompt (`input("> ")`, pdb's `(Pdb) `, which end no
//!   line until the user answered) is on the terminal when the user is to answer it. Otherwise, and
//!   on plain consoles, lines are printed only when they end (a block-buffered stream's flush that
//!   cut a line in two does not leave half of it on the screen).
//! - A `\r` at the end of a read may be the first half of a `\r\n`: the next byte decides, or
//!   [`CR_SETTLE`] without one makes it a return.
//! - A line reaching the cap is cut there (an ordinary line), so memory stays bounded without `\n`.
//!
//! The bytes themselves are never changed: escape sequences pass through, and the per-rank log files
//! get the raw stream before any of this.

use std::time::{Duration, Instant};

use crate::logs::ConsoleMode;

/// Plain consoles: the least time between two printed updates of one stream.
pub const PLAIN_EVERY: Duration = Duration::from_secs(1);

/// How long a `\r` that ended a read waits for a `\n` before it counts as a return.
pub const CR_SETTLE: Duration = Duration::from_millis(100);

/// Terminal: how long an unfinished ordinary line waits for more before it is shown as it stands.
pub const PROMPT_IDLE: Duration = Duration::from_millis(200);

/// What the console should do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The current state of an unfinished progress line (no newline): drawn in place on a terminal,
    /// printed as an ordinary line on a plain console.
    Update(Vec<u8>),
    /// A line ended with this final state (no newline).
    Line {
        /// The final state.
        text: Vec<u8>,
        /// How the console shows it.
        show: Show,
    },
}

/// How the console shows a finished line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Show {
    /// As an ordinary line.
    Print,
    /// Terminal: as an ordinary line in place of the line's in-place state.
    Finish,
    /// Plain: not again, the last update printed exactly this.
    Already,
}

/// One stream's line assembly (see the module docs).
#[derive(Debug)]
pub struct LineAssembler {
    mode: ConsoleMode,
    /// A segment reaching this many bytes ends the line.
    cap: usize,
    /// The current segment: bytes since the last `\r`, or since the line started.
    seg: Vec<u8>,
    /// When `seg` last grew (plain consoles show an idle segment).
    seg_at: Option<Instant>,
    /// The latest complete non-empty segment of a progress line.
    last: Vec<u8>,
    /// The current line had a `\r` that was not part of a `\r\n`.
    progress: bool,
    /// A `\r` ended a read: a return or half of `\r\n`, decided by the next byte or at `CR_SETTLE`.
    cr_at: Option<Instant>,
    /// What the console shows of the current line: the in-place state (terminal) or the last printed
    /// update (plain).
    shown: Option<Vec<u8>>,
    /// Plain: when this stream last printed an update (any line).
    printed_at: Option<Instant>,
    /// Show an idle unfinished ordinary line in place (terminal; see the module docs).
    prompts: bool,
}

impl LineAssembler {
    /// An empty assembler; lines longer than `cap` bytes (at least 1) are cut.
    pub fn new(mode: ConsoleMode, cap: usize) -> Self {
        LineAssembler {
            mode,
            cap: cap.max(1),
            seg: Vec::new(),
            seg_at: None,
            last: Vec::new(),
            progress: false,
            cr_at: None,
            shown: None,
            printed_at: None,
            prompts: false,
        }
    }

    /// Shows an ordinary line left unfinished for [`PROMPT_IDLE`] in place on a terminal: the
    /// worker reads a terminal, so the line may be a prompt waiting for an answer.
    pub fn with_prompts(mut self, prompts: bool) -> Self {
        self.prompts = prompts;
        self
    }

    /// Takes a chunk read at `now`; appends what the console should do to `out`.
    pub fn push(&mut self, chunk: &[u8], now: Instant, out: &mut Vec<Action>) {
        let mut rest = chunk;
        if rest.is_empty() {
            return;
        }
        if self.cr_at.take().is_some() {
            if rest[0] == b'\n' {
                self.end_line(out);
                rest = &rest[1..];
            } else {
                self.carriage_return();
            }
        }
        while let Some(i) = rest.iter().position(|&b| b == b'\r' || b == b'\n') {
            self.extend(&rest[..i], now, out);
            if rest[i] == b'\n' {
                self.end_line(out);
                rest = &rest[i + 1..];
            } else if i + 1 == rest.len() {
                self.cr_at = Some(now);
                rest = &[];
            } else if rest[i + 1] == b'\n' {
                self.end_line(out);
                rest = &rest[i + 2..];
            } else {
                self.carriage_return();
                rest = &rest[i + 1..];
            }
        }
        self.extend(rest, now, out);
        self.show(now, out);
    }

    /// When [`poll`](Self::poll) has something to do if nothing arrives before; `None`: nothing.
    pub fn next_deadline(&self) -> Option<Instant> {
        let cr = self.cr_at.map(|t| t + CR_SETTLE);
        let update = match self.mode {
            // An idle unfinished line (a prompt) is shown once it was idle long enough.
            ConsoleMode::Terminal if self.progress => None,
            ConsoleMode::Terminal => self
                .seg_at
                .filter(|_| self.prompts && !self.prompt().is_empty() && !self.is_shown(self.prompt()))
                .map(|at| at + PROMPT_IDLE),
            ConsoleMode::Plain if !self.progress => None,
            ConsoleMode::Plain => {
                let next_print = self.printed_at.map(|t| t + PLAIN_EVERY);
                let last_due = || (!self.last.is_empty() && !self.is_shown(&self.last)).then_some(next_print).flatten();
                match self.seg_at {
                    // A printed idle segment stays what the line shows until the next `\r`.
                    Some(_) if self.is_shown(&self.seg) => None,
                    Some(at) => {
                        let idle = at + PLAIN_EVERY;
                        // Until the segment is idle, the last complete one is printed when due.
                        let last = last_due().filter(|&t| t < idle);
                        min_some(last, Some(next_print.map_or(idle, |p| p.max(idle))))
                    }
                    None => last_due(),
                }
            }
        };
        min_some(cr, update)
    }

    /// Time passed: settles a trailing `\r` and prints a due update.
    pub fn poll(&mut self, now: Instant, out: &mut Vec<Action>) {
        if let Some(at) = self.cr_at
            && now >= at + CR_SETTLE
        {
            self.cr_at = None;
            self.carriage_return();
        }
        self.show(now, out);
    }

    /// The stream ended: a trailing `\r` is a return, and an unfinished line ends with what it shows.
    pub fn finish(&mut self, out: &mut Vec<Action>) {
        if self.cr_at.take().is_some() {
            self.carriage_return();
        }
        if !self.seg.is_empty() || !self.last.is_empty() {
            self.end_line(out);
        }
    }

    fn extend(&mut self, mut bytes: &[u8], now: Instant, out: &mut Vec<Action>) {
        while !bytes.is_empty() {
            let take = bytes.len().min(self.cap - self.seg.len());
            self.seg.extend_from_slice(&bytes[..take]);
            self.seg_at = Some(now);
            bytes = &bytes[take..];
            if self.seg.len() == self.cap {
                // A line cut at the cap keeps whole characters: the bytes of one cut in two go
                // to the next line instead of showing as two invalid pieces.
                let keep = self.seg.len() - utf8_tail(&self.seg);
                let carry = if keep > 0 { self.seg.split_off(keep) } else { Vec::new() };
                self.end_line(out);
                self.seg = carry;
            }
        }
    }

    fn carriage_return(&mut self) {
        self.progress = true;
        if !self.seg.is_empty() {
            self.last = std::mem::take(&mut self.seg);
        }
        self.seg_at = None;
    }

    fn end_line(&mut self, out: &mut Vec<Action>) {
        let text = if self.seg.is_empty() && self.progress {
            std::mem::take(&mut self.last)
        } else {
            std::mem::take(&mut self.seg)
        };
        let show = match (&self.shown, self.mode) {
            (None, _) => Show::Print,
            (Some(_), ConsoleMode::Terminal) => Show::Finish,
            (Some(s), ConsoleMode::Plain) if *s == text => Show::Already,
            (Some(_), ConsoleMode::Plain) => Show::Print,
        };
        out.push(Action::Line { text, show });
        self.seg.clear();
        self.seg_at = None;
        self.last.clear();
        self.progress = false;
        self.cr_at = None;
        self.shown = None;
    }

    /// What an unfinished ordinary line shows in place: its bytes so far, without an unfinished
    /// escape sequence or character.
    fn prompt(&self) -> &[u8] {
        displayable(&self.seg)
    }

    fn show(&mut self, now: Instant, out: &mut Vec<Action>) {
        let state: &[u8] = match self.mode {
            // An ordinary line: shown only as a prompt, on a terminal, once idle for PROMPT_IDLE
            // (see the module docs).
            _ if !self.progress => {
                let idle = self.seg_at.is_some_and(|at| now >= at + PROMPT_IDLE);
                if !(self.prompts && self.mode == ConsoleMode::Terminal && idle) {
                    return;
                }
                self.prompt()
            }
            ConsoleMode::Terminal => {
                let partial = displayable(&self.seg);
                if partial.is_empty() { &self.last } else { partial }
            }
            ConsoleMode::Plain => {
                if self.printed_at.is_some_and(|t| now < t + PLAIN_EVERY) {
                    return;
                }
                match self.seg_at {
                    Some(at) if !self.seg.is_empty() && now >= at + PLAIN_EVERY => &self.seg,
                    _ => &self.last,
                }
            }
        };
        if state.is_empty() || self.is_shown(state) {
            return;
        }
        let state = state.to_vec();
        if self.mode == ConsoleMode::Plain {
            self.printed_at = Some(now);
        }
        self.shown = Some(state.clone());
        out.push(Action::Update(state));
    }

    fn is_shown(&self, state: &[u8]) -> bool {
        self.shown.as_deref() == Some(state)
    }
}

fn min_some(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// How far back an unfinished escape sequence is looked for; longer ones are shown as they are.
const ESCAPE_LOOKBACK: usize = 256;

/// `seg` without a trailing escape sequence or UTF-8 character that is still being written.
fn displayable(seg: &[u8]) -> &[u8] {
    let mut end = seg.len();
    let from = end.saturating_sub(ESCAPE_LOOKBACK);
    if let Some(esc) = seg[from..].iter().rposition(|&b| b == 0x1b).map(|i| from + i)
        && !escape_complete(&seg[esc..])
    {
        end = esc;
    }
    let s = &seg[..end];
    for i in (s.len().saturating_sub(3)..s.len()).rev() {
        let b = s[i];
        if b & 0xc0 == 0x80 {
            continue;
        }
        let len = match b {
            0xf0.. => 4,
            0xe0.. => 3,
            0xc0.. => 2,
            _ => 1,
        };
        if i + len > s.len() {
            end = i;
        }
        break;
    }
    &seg[..end]
}

/// Whether `seq` (starting with ESC) holds a whole escape sequence.
fn escape_complete(seq: &[u8]) -> bool {
    match seq.get(1) {
        None => false,
        // CSI: parameter and intermediate bytes, then one final byte in 0x40..=0x7e.
        Some(b'[') => seq[2..].iter().any(|b| (0x40..=0x7e).contains(b)),
        // OSC: ends with BEL or ST (`ESC \`, whose ESC is the last one found).
        Some(b']') => seq[2..].contains(&0x07),
        Some(_) => true,
    }
}

/// How many bytes at the end of `b` begin a UTF-8 character that is not complete (0 to 3).
fn utf8_tail(b: &[u8]) -> usize {
    for back in 1..=3.min(b.len()) {
        let byte = b[b.len() - back];
        if byte & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for the lead
        }
        let need = match byte {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if need > back { back } else { 0 };
    }
    0
}

#[cfg(test)]
mod tests;
