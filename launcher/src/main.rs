//! `rsrun`: parse arguments, resolve the plan, start the guardian and the runtime, run, print the
//! console stream and the failure summary, exit with the root cause's code.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use rsrun_launcher::cli::LaunchArgs;
use rsrun_launcher::console::Console;
use rsrun_launcher::logs::{ConsoleEvent, ConsoleMode, ConsoleModes};
use rsrun_launcher::signals::Signals;
use rsrun_launcher::worker::Guardian;
use rsrun_launcher::{HostInfo, LaunchPlan, RunContext};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // clap prints usage errors itself and exits 2.
    let args = LaunchArgs::parse();
    init_tracing();
    let plan = match LaunchPlan::resolve(&args, &HostInfo::probe()) {
        Ok(plan) => plan,
        Err(err) => {
            eprintln!("rsrun: error: {err}");
            return ExitCode::from(2);
        }
    };
    if plan.dry_run {
        let mut out = std::io::stdout().lock();
        for note in &plan.notes {
            let _ = writeln!(out, "rsrun: {note}");
        }
        let _ = out.write_all(rsrun_launcher::dry_run::render(&plan).as_bytes());
        return ExitCode::SUCCESS;
    }
    for note in &plan.notes {
        eprintln!("rsrun: {note}");
    }
    match launch(plan) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("rsrun: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

fn launch(plan: LaunchPlan) -> anyhow::Result<i32> {
    // SAFETY: no thread has been started yet (tracing's subscriber starts none): the runtime and the
    // console thread are created below.
    let guardian = match unsafe { Guardian::start() } {
        Ok(g) => Some(Arc::new(g)),
        Err(err) => {
            tracing::warn!(%err, "no guardian process: workers are still covered by PDEATHSIG");
            None
        }
    };
    // One thread: workers are forked from it, and PR_SET_PDEATHSIG follows the forking thread.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let (tx, rx) = mpsc::channel(1024);
    let console_modes =
        ConsoleModes { stdout: console_mode(&std::io::stdout()), stderr: console_mode(&std::io::stderr()) };
    let console = std::thread::Builder::new()
        .name("console".into())
        .spawn(move || console_loop(rx, console_modes))
        .context("cannot start the console thread")?;
    let policy = plan.signals.clone();
    let outcome = runtime.block_on(async move {
        let signals = Signals::install(&policy).context("cannot install signal handlers")?;
        let cx = RunContext { console: tx, console_modes, shutdown: CancellationToken::new(), signals, guardian };
        rsrun_launcher::run(plan, cx).await
    });
    // Every console sender is gone once run returns: the thread drains and ends.
    drop(runtime);
    let _ = console.join();
    let outcome = outcome?;
    if let Some(report) = &outcome.report {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(report.render().as_bytes());
    }
    Ok(outcome.exit_code)
}

fn init_tracing() {
    let filter = std::env::var("RSRUN_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        // The embedded rendezvous service logs every failure report; the launcher's summary says it.
        .unwrap_or_else(|_| "warn,rsrun_rendezvous=error".to_owned());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
}

/// A terminal that understands escape sequences draws progress in place; anything else is plain.
fn console_mode(stream: &impl IsTerminal) -> ConsoleMode {
    let dumb = std::env::var_os("TERM").is_some_and(|t| t == "dumb");
    if stream.is_terminal() && !dumb { ConsoleMode::Terminal } else { ConsoleMode::Plain }
}

/// Renders console events ([`Console`]): worker stdout lines to stdout, everything else to stderr;
/// on a terminal, the rendezvous status and progress lines are drawn in place.
fn console_loop(mut rx: mpsc::Receiver<ConsoleEvent>, modes: ConsoleModes) {
    let out = std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout());
    let err = std::io::BufWriter::with_capacity(16 * 1024, std::io::stderr());
    let mut console = Console::new(modes, out, err);
    while let Some(first) = rx.blocking_recv() {
        console.handle(first, Instant::now());
        // A batch ends when the channel is empty (or is long): the block is drawn once per batch.
        for _ in 0..1024 {
            let Ok(ev) = rx.try_recv() else { break };
            console.handle(ev, Instant::now());
        }
        console.settle();
    }
    console.finish();
}
