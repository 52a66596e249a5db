use std::cell::RefCell;
use std::rc::Rc;

use super::*;

/// What was written, to which stream, in order.
type Recording = Vec<(StreamKind, Vec<u8>)>;

/// Both writers append to one shared recording, as two streams on one terminal do.
#[derive(Debug, Clone, Default)]
struct Shared(Rc<RefCell<Recording>>);

#[derive(Debug)]
struct Writer(Shared, StreamKind);

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (self.0).0.borrow_mut().push((self.1, buf.to_vec()));
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn bytes(&self, only: Option<StreamKind>) -> Vec<u8> {
        self.0.borrow().iter().filter(|(s, _)| only.is_none_or(|o| o == *s)).flat_map(|(_, b)| b.clone()).collect()
    }
}

type TestConsole = Console<std::io::BufWriter<Writer>, std::io::BufWriter<Writer>>;

/// A console over buffered writers (like the binary's), so a missing flush would reorder output.
fn console(modes: ConsoleModes) -> (TestConsole, Shared) {
    let shared = Shared::default();
    let out = std::io::BufWriter::new(Writer(shared.clone(), StreamKind::Stdout));
    let err = std::io::BufWriter::new(Writer(shared.clone(), StreamKind::Stderr));
    (Console::new(modes, out, err), shared)
}

const TERMINAL: ConsoleModes = ConsoleModes { stdout: ConsoleMode::Terminal, stderr: ConsoleMode::Terminal, prompts: false };
const WIDTH: usize = 24;

/// A minimal terminal: the characters left on screen after `bytes`, `WIDTH` columns wide. It knows
/// what the console writes: text, `\n` (as the tty's ONLCR makes it), `\r`, cursor up, erase below,
/// erase line, wrapping on and off; colours are ignored.
fn screen(bytes: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(bytes);
    let mut rows: Vec<Vec<char>> = vec![Vec::new()];
    let (mut row, mut col, mut wrap) = (0usize, 0usize, true);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' => {
                row += 1;
                col = 0;
            }
            '\r' => col = 0,
            '\x1b' => {
                assert_eq!(chars.next(), Some('['), "only CSI sequences are expected");
                let mut params = String::new();
                let fin = loop {
                    let c = chars.next().expect("unfinished escape sequence");
                    if ('\x40'..='\x7e').contains(&c) {
                        break c;
                    }
                    params.push(c);
                };
                let n: usize = params.trim_start_matches('?').parse().unwrap_or(0);
                match (fin, params.as_str()) {
                    ('A', _) => row = row.checked_sub(n.max(1)).expect("cursor up past the top"),
                    ('J', "") => {
                        rows.truncate(row + 1);
                        if let Some(r) = rows.get_mut(row) {
                            r.truncate(col);
                        }
                    }
                    ('K', "2") => rows.get_mut(row).map_or((), |r| r.clear()),
                    ('l', "?7") => wrap = false,
                    ('h', "?7") => wrap = true,
                    ('m', _) => {}
                    other => panic!("unexpected escape sequence {other:?}"),
                }
            }
            c => {
                if col == WIDTH {
                    if wrap {
                        row += 1;
                        col = 0;
                    } else {
                        col = WIDTH - 1;
                    }
                }
                while rows.len() <= row {
                    rows.push(Vec::new());
                }
                let r = &mut rows[row];
                while r.len() <= col {
                    r.push(' ');
                }
                r[col] = c;
                col += 1;
            }
        }
        while rows.len() <= row {
            rows.push(Vec::new());
        }
    }
    let mut lines: Vec<String> = rows.iter().map(|r| r.iter().collect::<String>().trim_end().to_owned()).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    lines
}

fn progress(source: u64, stream: StreamKind, text: &str, done: bool) -> ConsoleEvent {
    ConsoleEvent::Progress { source, stream, text: text.as_bytes().to_vec(), done }
}

fn feed<O: Write, E: Write>(c: &mut Console<O, E>, batches: Vec<Vec<ConsoleEvent>>) {
    let now = Instant::now();
    for batch in batches {
        for ev in batch {
            c.handle(ev, now);
        }
        c.settle();
    }
}

#[test]
fn terminal_bars_stay_below_ordinary_lines() {
    let (mut c, shared) = console(TERMINAL);
    let err = StreamKind::Stderr;
    feed(
        &mut c,
        vec![
            vec![ConsoleEvent::Status("waiting (1s)".into())],
            vec![ConsoleEvent::Status("waiting (2s)".into())],
            vec![ConsoleEvent::StatusDone],
            vec![ConsoleEvent::Stdout(b"[0] start\n".to_vec())],
            vec![progress(7, err, "[0] 10%", false)],
            vec![progress(8, err, "[1] 5%", false), ConsoleEvent::Stdout(b"[1] hello\n".to_vec())],
            vec![progress(7, err, "[0] 20%", false)],
            vec![ConsoleEvent::Note("rsrun: a note".into())],
        ],
    );
    assert_eq!(
        screen(&shared.bytes(None)),
        vec!["waiting (2s)", "[0] start", "[1] hello", "rsrun: a note", "[0] 20%", "[1] 5%"]
    );
    feed(
        &mut c,
        vec![
            vec![progress(7, err, "[0] 100%", true)],
            vec![progress(8, err, "[1] 50%", false)],
            vec![ConsoleEvent::Stderr(b"[1] warn\n".to_vec())],
        ],
    );
    c.finish();
    let shown = screen(&shared.bytes(None));
    assert_eq!(shown, vec!["waiting (2s)", "[0] start", "[1] hello", "rsrun: a note", "[0] 100%", "[1] warn", "[1] 50%"]);
    // Ordinary stdout lines stayed on stdout, with no escape sequences.
    assert_eq!(shared.bytes(Some(StreamKind::Stdout)), b"[0] start\n[1] hello\n");
    // The cursor ends on a fresh line below the block.
    assert!(shared.bytes(None).ends_with(b"\n"));
}

#[test]
fn a_row_wider_than_the_screen_is_cut_and_still_cleared() {
    let (mut c, shared) = console(TERMINAL);
    let long = format!("[0] {}", "#".repeat(3 * WIDTH));
    feed(
        &mut c,
        vec![
            vec![progress(1, StreamKind::Stderr, &long, false)],
            vec![progress(2, StreamKind::Stderr, "[1] bar", false)],
            vec![ConsoleEvent::Stderr(b"[1] line\n".to_vec())],
            vec![progress(1, StreamKind::Stderr, "[0] short", false)],
        ],
    );
    assert_eq!(screen(&shared.bytes(None)), vec!["[1] line", "[0] short", "[1] bar"]);
}

#[test]
fn stdout_piped_stderr_terminal() {
    let (mut c, shared) =
        console(ConsoleModes { stdout: ConsoleMode::Plain, stderr: ConsoleMode::Terminal, prompts: false });
    feed(
        &mut c,
        vec![
            vec![progress(1, StreamKind::Stderr, "[0] 1/3", false)],
            // A piped stdout line does not disturb the block.
            vec![ConsoleEvent::Stdout(b"[0] out\n".to_vec())],
            vec![progress(1, StreamKind::Stderr, "[0] 3/3", true)],
        ],
    );
    c.finish();
    assert_eq!(shared.bytes(Some(StreamKind::Stdout)), b"[0] out\n");
    assert_eq!(screen(&shared.bytes(Some(StreamKind::Stderr))), vec!["[0] 3/3"]);
}

#[test]
fn plain_console_writes_lines_only() {
    let (mut c, shared) = console(ConsoleModes::PLAIN);
    let t0 = Instant::now();
    let events = [
        (0, ConsoleEvent::Status("waiting for 2 nodes (0s)".into())),
        (1, ConsoleEvent::Status("waiting for 2 nodes (1s)".into())),
        (2, ConsoleEvent::Status("waiting for 1 node (2s)".into())),
        (7, ConsoleEvent::Status("waiting for 1 node (7s)".into())),
        (8, ConsoleEvent::StatusDone),
        (8, ConsoleEvent::Stdout(b"[0] 1/2\n".to_vec())),
        (9, progress(3, StreamKind::Stdout, "[0] 2/2", true)),
        (9, ConsoleEvent::Note("rsrun: done".into())),
    ];
    for (s, ev) in events {
        c.handle(ev, t0 + Duration::from_secs(s));
        c.settle();
    }
    c.finish();
    assert_eq!(shared.bytes(Some(StreamKind::Stdout)), b"[0] 1/2\n[0] 2/2\n");
    assert_eq!(
        String::from_utf8(shared.bytes(Some(StreamKind::Stderr))).unwrap(),
        "waiting for 2 nodes (0s)\nwaiting for 1 node (2s)\nwaiting for 1 node (7s)\nrsrun: done\n"
    );
}

#[test]
fn many_bars_are_capped() {
    let (mut c, shared) = console(TERMINAL);
    let batch = (0..MAX_ROWS as u64 + 3).map(|i| progress(i, StreamKind::Stderr, &format!("[{i}] bar"), false)).collect();
    feed(&mut c, vec![batch, vec![ConsoleEvent::Stderr(b"x\n".to_vec())]]);
    let shown = screen(&shared.bytes(None));
    assert_eq!(shown.len(), 1 + MAX_ROWS + 1, "{shown:?}");
    assert_eq!(shown[0], "x");
    assert_eq!(shown.last().unwrap(), "(and 3 more in progress)");
}
