use std::time::{Duration, Instant};

use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Feeds `(ms since start, chunk)` pairs, polling at every deadline that passes between them, then
/// ends the stream; returns every action with the time it came.
fn run(mode: ConsoleMode, cap: usize, chunks: &[(u64, &[u8])]) -> Vec<(u64, Action)> {
    run_with(LineAssembler::new(mode, cap), chunks)
}

/// [`run`] with a given assembler.
fn run_with(mut a: LineAssembler, chunks: &[(u64, &[u8])]) -> Vec<(u64, Action)> {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut out = Vec::new();
    let mut record = |out: &mut Vec<Action>, at: Instant| {
        for action in out.drain(..) {
            got.push(((at - t0).as_millis() as u64, action));
        }
    };
    for &(at, chunk) in chunks {
        let at = t0 + ms(at);
        while let Some(d) = a.next_deadline().filter(|&d| d <= at) {
            a.poll(d, &mut out);
            record(&mut out, d);
        }
        a.push(chunk, at, &mut out);
        record(&mut out, at);
    }
    let end = t0 + ms(chunks.last().map_or(0, |c| c.0));
    a.finish(&mut out);
    record(&mut out, end);
    got
}

fn line(text: &str, show: Show) -> Action {
    Action::Line { text: text.as_bytes().to_vec(), show }
}

fn update(text: &str) -> Action {
    Action::Update(text.as_bytes().to_vec())
}

#[test]
fn ordinary_lines_and_crlf_are_plain_lines_in_both_modes() {
    for mode in [ConsoleMode::Plain, ConsoleMode::Terminal] {
        let got = run(mode, 1024, &[(0, b"one\ntwo\r\n\nthr"), (5, b"ee\r"), (6, b"\nlast")]);
        assert_eq!(
            got,
            vec![
                (0, line("one", Show::Print)),
                (0, line("two", Show::Print)),
                (0, line("", Show::Print)),
                (6, line("three", Show::Print)),
                (6, line("last", Show::Print)),
            ],
            "{mode:?}"
        );
    }
}

#[test]
fn plain_prints_only_the_final_state_of_a_fast_bar() {
    let got = run(ConsoleMode::Plain, 1024, &[(0, b"a\rb\rc\n")]);
    assert_eq!(got, vec![(0, line("c", Show::Print))]);
}

#[test]
fn plain_prints_at_most_one_update_per_second() {
    // tqdm style: "\r" then the state; a state is complete when the next "\r" arrives.
    let mut chunks: Vec<(u64, Vec<u8>)> = (0..=25).map(|i| (i * 100, format!("\r{i:>3}%").into_bytes())).collect();
    chunks.push((2550, b"\n".to_vec()));
    let chunks: Vec<(u64, &[u8])> = chunks.iter().map(|(t, c)| (*t, c.as_slice())).collect();
    let got = run(ConsoleMode::Plain, 1024, &chunks);
    assert_eq!(
        got,
        vec![
            (100, update("  0%")),
            (1100, update("  9%")),
            (2100, update(" 19%")),
            (2550, line(" 25%", Show::Print)),
        ]
    );
}

#[test]
fn plain_shows_a_stalled_bar_and_does_not_repeat_it() {
    let got = run(ConsoleMode::Plain, 1024, &[(0, b"\rstep 1"), (50, b"\rstep 2"), (5000, b"\n")]);
    // "step 1" at once; "step 2" once idle for a second; the final state is the same: not again.
    assert_eq!(
        got,
        vec![(50, update("step 1")), (1050, update("step 2")), (5000, line("step 2", Show::Already))]
    );
}

#[test]
fn plain_throttle_is_per_stream_across_lines() {
    let got = run(ConsoleMode::Plain, 1024, &[(0, b"\ra\rb"), (10, b"\n"), (20, b"\rc\rd"), (3000, b"")]);
    // "c" waits for the second since line 1's update; "d" once idle and a second after "c".
    assert_eq!(
        got,
        vec![
            (0, update("a")),
            (10, line("b", Show::Print)),
            (1000, update("c")),
            (2000, update("d")),
            (3000, line("d", Show::Already)),
        ]
    );
}

#[test]
fn trailing_cr_waits_for_a_possible_newline() {
    // `print(..., end="\r")`: each state ends with "\r". Split "\r" | "\n" is a newline.
    let got = run(ConsoleMode::Terminal, 1024, &[(0, b"hello\r"), (10, b"\nstep 0\r"), (500, b"step 1\r"), (700, b"\n")]);
    assert_eq!(
        got,
        vec![
            (10, line("hello", Show::Print)),
            (110, update("step 0")),
            (500, update("step 1")),
            (700, line("step 1", Show::Finish)),
        ]
    );
}

#[test]
fn terminal_updates_every_change_with_partial_segments_trimmed() {
    let got = run(
        ConsoleMode::Terminal,
        1024,
        &[
            (0, b"\r 10%|#"),
            (1, b"#|"),
            (2, b"\r 20%\x1b[3"),
            (3, b"2m|##"),
            (4, b"\x1b[0m|\r \xe2\x96"),
            (5, b"\x88|"),
            (6, b"\r \xe2\x96\x88|"),
            (7, b"\n"),
        ],
    );
    assert_eq!(
        got,
        vec![
            (0, update(" 10%|#")),
            (1, update(" 10%|##|")),
            (2, update(" 20%")),
            (3, update(" 20%\x1b[32m|##")),
            // A split character is not drawn half: the new segment shows its first space only.
            (4, update(" ")),
            (5, update(" \u{2588}|")),
            (7, line(" \u{2588}|", Show::Finish)),
        ]
    );
}

#[test]
fn terminal_bar_then_ordinary_text_on_the_same_line() {
    // tqdm(leave=False) clears its bar with spaces and a "\r", and the next output starts there.
    let got = run(ConsoleMode::Terminal, 1024, &[(0, b"\rbar 1\rbar 2"), (1, b"\r     \r"), (2, b"done\n")]);
    assert_eq!(
        got,
        vec![(0, update("bar 2")), (1, update("     ")), (2, line("done", Show::Finish))]
    );
}

#[test]
fn eof_ends_an_unfinished_bar_with_its_last_state() {
    // Plain printed "1/3" (the only complete segment when the read came).
    for (mode, show) in [(ConsoleMode::Terminal, Show::Finish), (ConsoleMode::Plain, Show::Print)] {
        let got = run(mode, 1024, &[(0, b"\r1/3\r2/3\r")]);
        assert_eq!(got.last(), Some(&(0, line("2/3", show))), "{mode:?}: {got:?}");
    }
}

#[test]
fn long_lines_are_cut_at_the_cap() {
    let got = run(ConsoleMode::Plain, 4, &[(0, b"abcdefghij"), (1, b"\rxy\rzzzzzz\n")]);
    assert_eq!(
        got,
        vec![
            (0, line("abcd", Show::Print)),
            (0, line("efgh", Show::Print)),
            (1, line("zzzz", Show::Print)),
            (1, line("zz", Show::Print)),
        ]
    );
    // Endless updates without "\n" keep at most two segments.
    let mut a = LineAssembler::new(ConsoleMode::Terminal, 8);
    let mut out = Vec::new();
    let t = Instant::now();
    for i in 0..10_000 {
        a.push(format!("\rstep {i}").as_bytes(), t, &mut out);
    }
    assert!(a.seg.capacity() <= 64 && a.last.capacity() <= 64, "memory is bounded");
}

/// A line cut at the cap keeps whole UTF-8 characters: "aé" + "€" at a cap of 4 bytes is cut
/// after "aé" (3 bytes), and the euro sign starts the next piece.
#[test]
fn a_cut_line_keeps_whole_characters() {
    let got = run(ConsoleMode::Plain, 4, &[(0, "aé€\n".as_bytes())]);
    assert_eq!(got, vec![(0, line("aé", Show::Print)), (0, line("€", Show::Print))]);
    assert_eq!(utf8_tail("a€".as_bytes()), 0);
    assert_eq!(utf8_tail(&"a€".as_bytes()[..3]), 2);
    assert_eq!(utf8_tail(&[b'a', 0xF0]), 1);
    assert_eq!(utf8_tail(&[0x80, 0x80, 0x80]), 0, "not UTF-8 at all: cut where the cap is");
}

#[test]
fn terminal_shows_an_idle_unfinished_line_in_place_and_finishes_it_there() {
    // A prompt: shown once idle, then finished in place when its line ends.
    let got = run_with(prompting(), &[(0, b"ok\n(Pdb) "), (150, b""), (1000, b"> x.py(3)\n")]);
    assert_eq!(got, vec![(0, line("ok", Show::Print)), (200, update("(Pdb) ")), (1000, line("(Pdb) > x.py(3)", Show::Finish))]);
    // Written in pieces closer together than PROMPT_IDLE: one line, as before.
    let got = run_with(prompting(), &[(0, b"Epoch 1"), (150, b": loss"), (300, b" 0.5\n")]);
    assert_eq!(got, vec![(300, line("Epoch 1: loss 0.5", Show::Print))]);
    // More of the same line after it was shown is shown again once idle; an unfinished escape
    // sequence waits for its end.
    let got = run_with(prompting(), &[(0, b"name? "), (500, b"x \x1b[1"), (1000, b"m\n")]);
    assert_eq!(got, vec![(200, update("name? ")), (700, update("name? x ")), (1000, line("name? x \x1b[1m", Show::Finish))]);
    // A plain console, or a worker that reads no terminal, gets the line when it ends, and only
    // then (a block-buffered stream's flush may cut a line anywhere).
    for a in [LineAssembler::new(ConsoleMode::Plain, 1024).with_prompts(true), LineAssembler::new(ConsoleMode::Terminal, 1024)] {
        let got = run_with(a, &[(0, b"(Pdb) "), (1000, b"> x.py(3)\n")]);
        assert_eq!(got, vec![(1000, line("(Pdb) > x.py(3)", Show::Print))]);
    }
}

fn prompting() -> LineAssembler {
    LineAssembler::new(ConsoleMode::Terminal, 1024).with_prompts(true)
}

#[test]
fn deadlines_never_spin() {
    // After every poll at its deadline, the next deadline is later (or gone).
    let mut a = LineAssembler::new(ConsoleMode::Plain, 1024);
    let t0 = Instant::now();
    let mut out = Vec::new();
    a.push(b"\ra\rb\rc", t0, &mut out);
    a.push(b"\rd\r", t0 + ms(300), &mut out);
    let mut now = t0 + ms(300);
    let mut n_polls = 0;
    while let Some(d) = a.next_deadline() {
        assert!(d > now || n_polls == 0, "deadline {d:?} does not move past {now:?}");
        now = d.max(now);
        a.poll(now, &mut out);
        n_polls += 1;
        assert!(n_polls < 10, "{out:?}");
    }
    assert_eq!(out, vec![update("b"), update("d")]);

    // A terminal's idle prompt: one deadline, one update, then none.
    let mut a = prompting();
    let mut out = Vec::new();
    a.push(b"(Pdb) ", t0, &mut out);
    let d = a.next_deadline().expect("a deadline for the prompt");
    assert_eq!(d, t0 + PROMPT_IDLE);
    a.poll(d, &mut out);
    assert_eq!(a.next_deadline(), None);
    assert_eq!(out, vec![update("(Pdb) ")]);
}

#[test]
fn displayable_trims_unfinished_escapes_and_characters() {
    assert_eq!(displayable(b"ab\x1b"), b"ab");
    assert_eq!(displayable(b"ab\x1b[1;3"), b"ab");
    assert_eq!(displayable(b"ab\x1b[1;31mc"), b"ab\x1b[1;31mc");
    assert_eq!(displayable(b"ab\x1b]8;;http://x"), b"ab");
    assert_eq!(displayable(b"ab\x1b]8;;http://x\x07c"), b"ab\x1b]8;;http://x\x07c");
    assert_eq!(displayable(b"ab\x1b]8;;x\x1b\\c"), b"ab\x1b]8;;x\x1b\\c");
    assert_eq!(displayable(b"a\xe2\x96"), b"a");
    assert_eq!(displayable(b"a\xe2\x96\x88"), b"a\xe2\x96\x88");
    assert_eq!(displayable(b"a\xf0\x9f\x98"), b"a");
    assert_eq!(displayable(b"\xc3"), b"");
}
