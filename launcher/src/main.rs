//! `rsrun`: parse arguments, resolve the plan, start the guardian and the runtime, run, print the
//! console stream and the failure summary, exit with the root cause's code.
//!
//! Three modes: a node (the default), a head (`--hosts`/`--hostfile`: starts an agent per host), and
//! the hidden `rsrun agent --stdin` that a head starts on each host (the plan arrives on stdin).

use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rsrun_launcher::cli::LaunchArgs;
use rsrun_launcher::console::Console;
use rsrun_launcher::logs::{ConsoleEvent, ConsoleMode, ConsoleModes};
use rsrun_launcher::multinode::LaunchMode;
use rsrun_launcher::remote::command::AGENT_ARGS;
use rsrun_launcher::remote::{HeadContext, RemotePlan};
use rsrun_launcher::signals::Signals;
use rsrun_launcher::worker::Guardian;
use rsrun_launcher::{HostInfo, LaunchPlan, RunContext};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // First of all, while single-threaded: no descriptor rsrun inherited reaches a worker, an
    // agent or scontrol (the workers' close_range(CLOEXEC) needs Linux 5.11; RHEL 8 and Ubuntu
    // 20.04 run older kernels, where it failed and every inherited descriptor leaked).
    rsrun_launcher::worker::close_inherited_on_exec();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.len() == 3 && argv[1] == AGENT_ARGS[0] && argv[2] == AGENT_ARGS[1] {
        // A node agent reports through the head: a bad RSRUN_LOG there costs its logs, not the job.
        if let Err(e) = init_tracing() {
            eprintln!("rsrun: {e}");
        }
        raise_nofile_limit();
        return agent_main();
    }
    // clap prints usage errors itself and exits 2.
    let args = LaunchArgs::parse_with_origins();
    if let Err(e) = init_tracing() {
        eprintln!("rsrun: error: {e}");
        return ExitCode::from(2);
    }
    if args.is_remote() {
        raise_nofile_limit();
        return head_main(&args);
    }
    let plan = match LaunchPlan::resolve(&args, &HostInfo::probe()) {
        Ok(plan) => plan,
        Err(err) => {
            eprintln!("rsrun: error: {err}");
            return ExitCode::from(2);
        }
    };
    if plan.dry_run {
        // The plan's notes are part of it (`note :` lines).
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(rsrun_launcher::dry_run::render(&plan).as_bytes());
        return ExitCode::SUCCESS;
    }
    for note in &plan.notes {
        eprintln!("rsrun: {note}");
    }
    if let LaunchMode::SlurmC { srun } = &plan.mode {
        // Before any raise: srun passes this process's limits on to its tasks.
        return exec_under_srun(srun);
    }
    raise_nofile_limit();
    match launch(plan) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("rsrun: error: {err:#}");
            // A configuration problem found at run time is a start failure, like a plan error.
            ExitCode::from(if rsrun_launcher::plan::StartError::is_in(&err) { 2 } else { 1 })
        }
    }
}

/// A node may serve the job's PyTorch store (a descriptor per rank of the job) and an embedded
/// rendezvous, and a head one connection per host: the soft open-file limit goes up to the hard
/// one, and workers get the limit rsrun started with back (`rsrun_rendezvous::rlimit`).
fn raise_nofile_limit() {
    rsrun_rendezvous::rlimit::raise_nofile_limit();
}

/// Slurm mode C: replaces this process with `srun ... <this rsrun> <the same arguments>`; each task
/// then runs in mode A.
fn exec_under_srun(srun: &[String]) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(err) => {
            eprintln!("rsrun: error: cannot find this rsrun's path for srun: {err}");
            return ExitCode::from(2);
        }
    };
    let mut cmd = std::process::Command::new(&srun[0]);
    cmd.args(&srun[1..]).arg(exe).args(std::env::args_os().skip(1));
    for var in rsrun_launcher::multinode::slurm::PER_TASK_REQUESTS {
        cmd.env_remove(var);
    }
    let err = cmd.exec();
    eprintln!("rsrun: error: cannot run {}: {err}", srun[0]);
    ExitCode::from(2)
}

fn launch(plan: LaunchPlan) -> anyhow::Result<i32> {
    // SAFETY: no thread has been started yet (tracing's subscriber starts none): the runtime and the
    // console thread are created below.
    rsrun_launcher::worker::become_subreaper();
    let guardian = match unsafe { Guardian::start() } {
        Ok(g) => Some(Arc::new(g)),
        Err(err) => {
            tracing::warn!(%err, "no guardian process: workers are still covered by PDEATHSIG");
            None
        }
    };
    let policy = plan.signals.clone();
    // Workers read rsrun's stdin: a terminal's settings a worker changed and did not undo (echo
    // off at a password prompt when it was stopped) are put back at the end.
    let terminal = rsrun_launcher::terminal::SavedTerminal::save();
    let outcome = with_console(move |tx, console_modes| async move {
        let signals = Signals::install(&policy).context("cannot install signal handlers")?;
        // --requeue-on-preempt: node rank 0 watches for the preemption notice.
        let requeuer = match &plan.requeue {
            Some(r) => rsrun_launcher::requeue::Requeuer::start(r, &policy, plan.timeouts.shutdown, tx.clone())
                .context("cannot install signal handlers")?,
            None => None,
        };
        let cx = RunContext { console: tx, console_modes, shutdown: CancellationToken::new(), signals, guardian, service_gone: None };
        let outcome = rsrun_launcher::run(plan, cx).await;
        if let Some(r) = requeuer {
            r.finish().await;
        }
        outcome
    });
    // Only after a job that did not end well (see `terminal`).
    let ended_well = outcome.as_ref().is_ok_and(|o| o.exit_code == 0);
    if !ended_well && terminal.as_ref().is_some_and(|t| t.restore()) {
        tracing::info!("a worker left the terminal's settings changed: put back as rsrun found them");
    }
    let outcome = outcome?;
    if let Some(report) = &outcome.report {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(report.render().as_bytes());
    }
    Ok(outcome.exit_code)
}

/// How long the launcher's exit waits for blocking work still running (a log file's last write):
/// a hung disk must not keep rsrun from exiting.
const BLOCKING_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Shuts the runtime down, leaving behind blocking work that outlasts [`BLOCKING_AT_EXIT`]
/// (dropping it would wait for that work without end).
fn end_runtime(runtime: tokio::runtime::Runtime) {
    runtime.shutdown_timeout(BLOCKING_AT_EXIT);
}

/// Runs `body` on a single-threaded runtime (workers are forked from its thread, and
/// PR_SET_PDEATHSIG follows the forking thread) with the console on a thread of its own, and waits
/// until the console has drained (every sender is gone once `body` returns).
fn with_console<T, F>(body: impl FnOnce(mpsc::Sender<ConsoleEvent>, ConsoleModes) -> F) -> anyhow::Result<T>
where
    F: std::future::Future<Output = anyhow::Result<T>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the tokio runtime")?;
    let (tx, rx) = mpsc::channel(1024);
    let console_modes =
        ConsoleModes { stdout: console_mode(&std::io::stdout()), stderr: console_mode(&std::io::stderr()), prompts: std::io::stdin().is_terminal() };
    let console = std::thread::Builder::new()
        .name("console".into())
        .spawn(move || console_loop(rx, console_modes))
        .context("cannot start the console thread")?;
    let outcome = runtime.block_on(body(tx, console_modes));
    end_runtime(runtime);
    let _ = console.join();
    outcome
}

/// `--hosts`/`--hostfile`: resolve the remote plan, then run the head.
fn head_main(args: &LaunchArgs) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(err) => {
            eprintln!("rsrun: error: cannot find this rsrun's own path (for the hosts): {err}");
            return ExitCode::from(2);
        }
    };
    let host = HostInfo::probe();
    // The node plan (ranks, sources: shown by --dry-run) and the remote plan (ssh argv, forwarded
    // env). The program is each host's to find: a head on a login node need not have it.
    let resolved = rsrun_launcher::remote::plan::head_node_plan(args, &host)
        .and_then(|node| Ok((node, RemotePlan::resolve(args, &host, &exe)?)));
    let (node_plan, plan) = match resolved {
        Ok(plans) => plans,
        Err(err) => {
            eprintln!("rsrun: error: {err}");
            return ExitCode::from(2);
        }
    };
    if plan.dry_run {
        let mut out = std::io::stdout().lock();
        match node_plan {
            Ok(mut node_plan) => {
                for note in node_plan.notes.iter().chain(&plan.notes) {
                    let _ = writeln!(out, "rsrun: {note}");
                }
                // One job id: the remote plan's, which the agents will use.
                node_plan.job_id.clone_from(&plan.job_id);
                let _ = out.write_all(rsrun_launcher::dry_run::render(&node_plan).as_bytes());
                let _ = writeln!(out);
            }
            Err(err) => {
                for note in &plan.notes {
                    let _ = writeln!(out, "rsrun: {note}");
                }
                let _ = writeln!(out, "rsrun: no node plan on this machine ({err}); each host's agent checks it there");
            }
        }
        let _ = out.write_all(rsrun_launcher::remote::dry_run::render(&plan).as_bytes());
        return ExitCode::SUCCESS;
    }
    for note in &plan.notes {
        eprintln!("rsrun: {note}");
    }
    let run = || -> anyhow::Result<i32> {
        let policy = plan.signals.clone();
        let outcome = with_console(move |tx, _| async move {
            let signals = Signals::install(&policy).context("cannot install signal handlers")?;
            rsrun_launcher::remote::run_head(plan, HeadContext { console: tx, signals }).await
        })?;
        let mut out = std::io::stdout().lock();
        for line in &outcome.report {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
        let mut err = std::io::stderr().lock();
        for line in &outcome.summary {
            let _ = writeln!(err, "{line}");
        }
        Ok(outcome.exit_code)
    };
    match run() {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("rsrun: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

/// `rsrun agent --stdin`: one host's node of a job started by a head. stdout carries `AgentEvent`
/// frames only; stderr is free text that the head relays.
fn agent_main() -> ExitCode {
    use rsrun_launcher::remote::agent;
    use rsrun_rendezvous::proto::{AgentExit, AgentReady, agent_event::Event};

    let hostname = HostInfo::probe().hostname;
    let mut out = std::io::stdout();
    let fail = |out: &mut std::io::Stdout, msg: String| {
        eprintln!("rsrun agent: error: {msg}");
        agent::send(out, Event::StartFailed(msg));
        agent::send(out, Event::Exit(AgentExit { code: 2 }));
        ExitCode::from(2)
    };
    // Still single-threaded: the plan is read, and the environment set, before any thread starts.
    // stdin is read directly, with a deadline, until START; the control thread reads on after it.
    let stdin = std::io::stdin();
    let launch = match agent::read_launch(&mut agent::DeadlineReader::new(stdin.as_fd(), agent::LAUNCH_WAIT), &hostname) {
        Ok(l) => l,
        Err(msg) => return fail(&mut out, msg),
    };
    // SAFETY: no thread has been started yet.
    let prepared = match unsafe { agent::prepare(&launch) } {
        Ok(p) => p,
        Err(msg) => return fail(&mut out, msg),
    };
    let agent::PreparedAgent { plan, host, node_id, private_dir, gpus, rdzv_in_head } = prepared;
    for note in &plan.notes {
        agent::send(&mut out, Event::Note(format!("rsrun: {note}")));
    }
    let identity = rsrun_launcher::remote::identity::HostIdentity::probe();
    agent::send(
        &mut out,
        Event::Ready(AgentReady {
            node_id: node_id.clone(),
            hostname: plan.hostname.clone(),
            pid: std::process::id(),
            rsrun_version: env!("CARGO_PKG_VERSION").to_owned(),
            boot_id: identity.boot_id,
            netns_inode: identity.netns_inode,
            workers: plan.nproc_per_node,
            gpus,
            program: plan.program.exe.display().to_string(),
        }),
    );
    // Still single-threaded: nothing starts before the head has seen every host (same-machine check,
    // --check).
    let wait = agent::start_wait(&launch);
    match agent::wait_for_start(&mut agent::DeadlineReader::new(stdin.as_fd(), wait)) {
        agent::Go::Start => {}
        agent::Go::Stop => {
            drop(private_dir);
            agent::send(&mut out, Event::Exit(AgentExit { code: 0 }));
            return ExitCode::SUCCESS;
        }
        agent::Go::TimedOut => {
            drop(private_dir);
            return fail(
                &mut out,
                format!(
                    "no word from the head within {:.0}s after {host} was ready (is the head unreachable?); nothing was started",
                    wait.as_secs_f64()
                ),
            );
        }
    }
    // The rendezvous lives in the head: when the head is gone, so is the service (no leave there).
    let head_gone = CancellationToken::new();
    let service_gone = if rdzv_in_head { Some(head_gone.clone()) } else { None };
    let run = move || -> anyhow::Result<rsrun_launcher::Outcome> {
        // SAFETY: still no other thread.
        rsrun_launcher::worker::become_subreaper();
    let guardian = match unsafe { Guardian::start() } {
            Ok(g) => Some(Arc::new(g)),
            Err(err) => {
                tracing::warn!(%err, "no guardian process: workers are still covered by PDEATHSIG");
                None
            }
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the tokio runtime")?;
        let (tx, rx) = mpsc::channel(1024);
        let console = std::thread::Builder::new()
            .name("console".into())
            .spawn(move || agent::console_loop(rx, std::io::stdout()))
            .context("cannot start the console thread")?;
        let policy = plan.signals.clone();
        let outcome = runtime.block_on(async move {
            let signals = Signals::install(&policy).context("cannot install signal handlers")?;
            let injector = signals.injector();
            // The rest of stdin: Control messages, then EOF when the head is gone. A plain thread: it
            // blocks in read(2) and ends with the process.
            std::thread::Builder::new()
                .name("control".into())
                .spawn(move || agent::control_loop(&mut std::io::stdin().lock(), &injector, &head_gone))
                .context("cannot start the control thread")?;
            // The agent's console is a pipe to the head: progress comes as ordinary lines.
            let cx = RunContext {
                console: tx,
                console_modes: ConsoleModes::PLAIN,
                shutdown: CancellationToken::new(),
                signals,
                guardian,
                service_gone,
            };
            rsrun_launcher::run(plan, cx).await
        });
        end_runtime(runtime);
        let _ = console.join();
        outcome
    };
    let outcome = run();
    drop(private_dir);
    let code = match outcome {
        Ok(outcome) => {
            // The full report comes from the host where the root cause ran (it has the stderr tail and
            // the error file); the other hosts' agents say nothing more than their exit code.
            if let Some(report) = &outcome.report
                && report.root.node_id == node_id
            {
                agent::send(&mut out, Event::Note(report.render()));
            }
            outcome.exit_code
        }
        Err(err) => {
            let msg = format!("rsrun: error on {host}: {err:#}");
            eprintln!("{msg}");
            agent::send(&mut out, Event::Note(msg));
            if rsrun_launcher::plan::StartError::is_in(&err) { 2 } else { 1 }
        }
    };
    agent::send(&mut out, Event::Exit(AgentExit { code }));
    ExitCode::from(code.clamp(0, 255) as u8)
}

/// Installs the log subscriber.
///
/// # Errors
/// `RSRUN_LOG` is no log filter (the message names it).
fn init_tracing() -> Result<(), String> {
    // The embedded rendezvous service logs every failure report; the launcher's summary says it.
    let log = rsrun_rendezvous::logging::from_env("warn,rsrun_rendezvous=error")?;
    tracing_subscriber::fmt()
        .with_env_filter(log.filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    if let Some(note) = log.note {
        eprintln!("rsrun: {note}");
    }
    Ok(())
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
