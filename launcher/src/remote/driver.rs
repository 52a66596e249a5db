//! The head: host the rendezvous, start one agent per host, relay their output, stop them, and
//! exit with the job's root cause.
//!
//! ```text
//! resolve plan ─▶ rendezvous (embedded, token per job) ─▶ one task per host:
//!   wait for a place in the fan-out window (--ssh-fanout hosts connecting at once)
//!   spawn `ssh … HOST 'exec rsrun agent --stdin'` (or the local agent), own process group
//!   stdin  ◀─ NodeLaunch, then Control{START|STOP|FORCE}; closing it is the last word (EOF);
//!     written by a task of its own, so an ssh that never reads it blocks no timer and no kill
//!   stdout ─▶ AgentEvent frames: Ready (checked, waiting), worker lines, notes, StartFailed, Exit;
//!     a stream that does not begin with one (a wrapper printed there) fails the host at once,
//!     quoting its first bytes
//!   stderr ─▶ ssh's and the agent's own diagnostics (kept until Ready, for the start-failure line),
//!     read as bytes (a line need not be UTF-8)
//!   output ─▶ console through bounded queues: a slow console holds back ssh's pipes, not the head
//!   Ready (or failure) frees the place in the window; no Ready within the start timeout fails it
//!   a start that sshd dropped in the key exchange is retried
//! every host Ready: compare the host identities the agents reported (two entries on one machine →
//!   STOP to all, exit 2); --check → STOP to all, one line per host, exit 0; else START to all
//! event loop: console lines prefixed with the host; start failures → stop everyone, exit 2;
//!   first stop signal → Control STOP(sig) to all, wait --shutdown-timeout + 5 s;
//!   second signal / that deadline → Control FORCE and EOF, 2 s, SIGKILL the ssh clients' process
//!     groups (a forking --rsh wrapper's ssh included);
//!   an agent gone without its Exit frame (connection lost) → stop the others.
//! exit: start failures 2; a stop signal 128 + sig; else the job's root cause as the rendezvous
//!   recorded it (its exit code or 128 + signal), named with host, rank and code.
//! ```

use std::collections::VecDeque;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::Signal;
use rand::Rng;
use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
use rsrun_rendezvous::proto::{self, AgentReady, Control, DeviceList, NodeLaunch, agent_event, console_line, control};
use rsrun_rendezvous::server::{EmbeddedServer, ServerConfig, spawn_with};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::logs::{ConsoleEvent, ConsoleTx};
use crate::signals::{SignalAction, Signals};

use super::identity::{HostIdentity, same_machine, same_machine_error};
use super::plan::{RemoteNode, RemotePlan, RemoteRdzv};
use super::preflight::{self, SshTarget, StartFailure, classify, describe, is_retryable};
use super::wire::{self, FirstFrame, NODE_LAUNCH_PROTOCOL, RSRUN_VERSION, decode_event, read_frame_async};

/// After a FORCE, how long before the ssh clients (or local agents) are SIGKILLed.
const KILL_AFTER: Duration = Duration::from_secs(2);
/// Beyond --shutdown-timeout, how long agents get to stop after a STOP before FORCE.
const STOP_SLACK: Duration = Duration::from_secs(5);
/// After one agent ended with a failure, how long (beyond --shutdown-timeout) the others get to end on
/// their own (the rendezvous tells them the job failed) before they are stopped.
const FOLLOW_SLACK: Duration = Duration::from_secs(10);
/// After an agent process ended, how long its pipes get to deliver the last lines.
const DRAIN: Duration = Duration::from_secs(2);
/// stderr lines kept per host for the start-failure line.
const TAIL: usize = 20;
/// Bytes of a garbled stdout quoted in the start-failure line.
const GARBLED_BYTES: usize = 160;

/// What an agent's stdout reader hands the host task.
enum FromAgent {
    /// A message of the agent protocol.
    Event(agent_event::Event),
    /// The stream began with something else: its first bytes.
    Garbled(Vec<u8>),
    /// A later message broke the protocol (too large, undecodable): why.
    Broken(String),
}

/// The start-failure line for an agent whose stdout began with `bytes` instead of a message:
/// their first line (at most [`GARBLED_BYTES`]), quoted.
fn garbled(bytes: &[u8]) -> String {
    let mut shown = &bytes[..bytes.len().min(GARBLED_BYTES)];
    if let Some(nl) = shown.iter().position(|&b| b == b'\n') {
        shown = &shown[..=nl];
    }
    format!(
        "the agent's stdout is not rsrun's agent protocol; it began with {:?}: the ssh command or --rsh wrapper (or a login script on the host) printed there, and stdout must carry only the agent's messages",
        String::from_utf8_lossy(shown)
    )
}

/// What [`run_head`] needs besides the plan.
#[derive(Debug)]
pub struct HeadContext {
    /// Console events (host-prefixed agent lines, notes).
    pub console: ConsoleTx,
    /// Signals the head handles.
    pub signals: Signals,
}

/// How the head ended.
#[derive(Debug)]
pub struct HeadOutcome {
    /// The exit code: 0, 2 (hosts did not start), 128 + signal, or the root cause's code.
    pub exit_code: i32,
    /// Lines for stderr after the agents' output (start failures, the root cause).
    pub summary: Vec<String>,
    /// When every agent said it started (for benchmarks), from the start of [`run_head`].
    pub all_ready_after: Option<Duration>,
    /// Lines for stdout (`--check`: one line per host that is ready).
    pub report: Vec<String>,
}

/// A command from the event loop to one host's task.
#[derive(Debug)]
enum HostCmd {
    Control(Control),
    /// Close the agent's stdin (EOF).
    Close,
    /// SIGKILL the ssh client (or the local agent).
    Kill,
}

/// How a host's agent process ended.
#[derive(Debug)]
struct Ended {
    status: Option<ExitStatus>,
    /// The code of the agent's Exit frame, when it sent one.
    exit_frame: Option<i32>,
    ready: bool,
    /// Why it did not start (when it never became ready).
    failure: Option<StartFailure>,
    /// Last stderr lines.
    tail: Vec<String>,
    /// The head had asked it to stop (or killed it).
    stopped: bool,
    /// The agent's stream broke the protocol after it started (the head killed it).
    broken: Option<String>,
}

/// What a host's task tells the event loop: a few per host, never held back by the console.
#[derive(Debug)]
enum HostEvent {
    Ready(AgentReady),
    Ended(Ended),
}

/// A host's output for the console. It goes through bounded queues: a slow console holds back the
/// agents' output (down to ssh's pipes and the agents' own writes), not the event loop, and the
/// head's memory stays bounded.
#[derive(Debug)]
enum HostOutput {
    Line(console_line::Stream, Vec<u8>),
    Note(String),
    Stderr(String),
}

/// The console queue shared by every host's task (then [`relay_output`] to the console).
const OUTPUT_QUEUE: usize = 1024;
/// Per host: messages read from the agent's stdout and stderr lines not yet handled.
const READ_QUEUE: usize = 64;
/// Per host: output waiting for a place in the console queue; while it is full the host's pipes
/// are not read.
const HOST_QUEUE: usize = 256;
/// stderr lines held until the agent is ready (the newest ones are kept).
const HELD: usize = 1000;
/// Longest stderr line kept whole (a longer one is cut into lines of this size).
const STDERR_LINE: usize = 64 * 1024;

/// Sends every host's output to the console, prefixed with its host, until every host's task has
/// ended.
async fn relay_output(mut rx: mpsc::Receiver<(usize, HostOutput)>, hosts: Vec<String>, console: ConsoleTx) {
    while let Some((idx, out)) = rx.recv().await {
        let host = hosts.get(idx).map_or("?", String::as_str);
        match out {
            HostOutput::Line(stream, data) => {
                let mut line = Vec::with_capacity(host.len() + 1 + data.len());
                line.extend_from_slice(host.as_bytes());
                line.push(b' ');
                line.extend_from_slice(&data);
                let ev = match stream {
                    console_line::Stream::Stderr => ConsoleEvent::Stderr(line),
                    _ => ConsoleEvent::Stdout(line),
                };
                let _ = console.send(ev).await;
            }
            HostOutput::Note(text) => {
                for l in text.lines() {
                    let _ = console.send(ConsoleEvent::Note(format!("{host} {l}"))).await;
                }
            }
            HostOutput::Stderr(l) => {
                let _ = console.send(ConsoleEvent::Stderr(format!("{host} {l}\n").into_bytes())).await;
            }
        }
    }
}

#[derive(Debug, Default)]
struct HostState {
    ready: bool,
    /// What the agent reported when it became ready.
    info: Option<AgentReady>,
    node_id: Option<String>,
    ended: Option<Ended>,
    failure: Option<StartFailure>,
    /// The agent went away without an Exit frame while the job ran.
    lost: Option<String>,
}

/// The embedded service (or the daemon's endpoint) and a client of it.
struct Rendezvous {
    _server: Option<EmbeddedServer>,
    endpoint: String,
    client: Option<RdzvClient>,
}

async fn start_rendezvous(plan: &RemotePlan) -> anyhow::Result<Rendezvous> {
    match &plan.rdzv {
        RemoteRdzv::Embedded { bind, advertise } => {
            // A name of this machine that resolves to loopback here (Debian's `127.0.1.1` line)
            // is out of the other hosts' reach: they would retry until the join timeout. A
            // loopback IP given as such is meant (an --rsh transport may run every "host" here).
            if advertise.parse::<std::net::IpAddr>().is_err() {
                let hosts: Vec<String> = plan.nodes.iter().map(|n| n.host.target().to_owned()).collect();
                crate::reach::refuse_loopback_of(crate::reach::HEAD, advertise, *bind, &hosts).await?;
            }
            let (dir, token_file) = match &plan.token {
                Some(t) => {
                    let dir = super::agent::PrivateDir::create("rsrun-head")?;
                    let f = dir.write("tokens", format!("{t} {}\n", plan.job_id).as_bytes())?;
                    (Some(dir), Some(f))
                }
                None => (None, None),
            };
            let mut cfg = ServerConfig::in_memory(*bind);
            cfg.token_file = token_file;
            // One job: its rounds' stores are served on this port too (`shared_port`).
            cfg.only_job = Some(plan.job_id.clone());
            // A plain service for this job only, like torchrun's agent store (a daemon on a
            // non-loopback address needs TLS): its random per-job token keeps other callers out.
            cfg.insecure = true;
            let server = spawn_with(cfg)
                .await
                .map_err(|e| anyhow::anyhow!("cannot host the rendezvous service at {bind}: {e}"))?;
            // The service read its tokens before it listened: the file goes now, so that not even
            // a kill -9 of this head leaves the job's token on disk.
            drop(dir);
            let port = server.addr.port();
            let endpoint = if advertise.contains(':') { format!("[{advertise}]:{port}") } else { format!("{advertise}:{port}") };
            info!(job = %plan.job_id, %endpoint, "hosting the rendezvous service");
            let client = client(&endpoint, plan.token.clone(), None);
            Ok(Rendezvous { _server: Some(server), endpoint, client })
        }
        RemoteRdzv::External { endpoint } => {
            let endpoint = endpoint.to_string();
            let client = client(&endpoint, plan.token.clone(), plan.tls_ca.as_ref().map(|ca| ca.path.clone()));
            Ok(Rendezvous { _server: None, endpoint, client })
        }
    }
}

fn client(endpoint: &str, token: Option<String>, tls_ca: Option<std::path::PathBuf>) -> Option<RdzvClient> {
    let mut cfg = ClientConfig::new(endpoint.to_owned());
    cfg.token = token;
    cfg.tls_ca = tls_ca;
    cfg.rpc_timeout = Duration::from_secs(5);
    match RdzvClient::connect(cfg) {
        Ok(c) => Some(c),
        Err(err) => {
            warn!(%err, "no rendezvous client: the exit code comes from the agents alone");
            None
        }
    }
}

fn node_launch(plan: &RemotePlan, node: &RemoteNode, endpoint: &str) -> NodeLaunch {
    NodeLaunch {
        protocol_version: NODE_LAUNCH_PROTOCOL,
        rsrun_version: RSRUN_VERSION.to_owned(),
        host: node.host.host.clone(),
        job_id: plan.job_id.clone(),
        node_rank: node.node_rank,
        nnodes: plan.nodes.len() as u32,
        nproc_per_node: node.host.slots.agent_value(),
        devices: node.host.devices.as_ref().map(|d| DeviceList { ids: d.clone() }),
        rdzv_endpoint: endpoint.to_owned(),
        token: plan.token.clone().unwrap_or_default(),
        cwd: plan.cwd.display().to_string(),
        env: plan.env.vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        program: plan.program.clone(),
        options: plan.options.clone(),
        rdzv_in_head: matches!(plan.rdzv, RemoteRdzv::Embedded { .. }),
        rdzv_tls_ca: plan.tls_ca.as_ref().map(|ca| ca.pem.clone()).unwrap_or_default(),
        start_wait_secs: u32::try_from(start_wait(plan).as_secs()).unwrap_or(u32::MAX),
    }
}

/// How long an agent waits for START after it said it is ready: until every other host could have
/// started (each window of `--ssh-fanout` hosts in turn, each with every retry of a dropped key
/// exchange), and a minute more.
fn start_wait(plan: &RemotePlan) -> Duration {
    let waves = u32::try_from(plan.nodes.len().div_ceil(plan.fanout.max(1))).unwrap_or(u32::MAX);
    let per_host = plan.start_timeout.saturating_mul(preflight::KEX_RETRIES + 1) + Duration::from_secs(8);
    per_host.saturating_mul(waves) + Duration::from_secs(60)
}

/// Runs the whole job from this head until every agent has ended.
///
/// # Errors
/// The rendezvous service cannot be hosted. Everything else (hosts that do not start, failures) is in
/// the [`HeadOutcome`].
pub async fn run_head(plan: RemotePlan, mut cx: HeadContext) -> anyhow::Result<HeadOutcome> {
    let started = Instant::now();
    let rdzv = start_rendezvous(&plan).await?;
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<(usize, HostEvent)>();
    let (out_tx, out_rx) = mpsc::channel::<(usize, HostOutput)>(OUTPUT_QUEUE);
    let names = plan.nodes.iter().map(|n| n.host.host.clone()).collect();
    let relay = tokio::spawn(relay_output(out_rx, names, cx.console.clone()));
    let mut tasks = JoinSet::new();
    let mut cmds = Vec::with_capacity(plan.nodes.len());
    // The fan-out window: a host holds a place from its ssh's start until its agent is ready (or
    // failed), so at most `fanout` connections are being set up at once.
    let window = std::sync::Arc::new(Semaphore::new(plan.fanout.max(1)));
    for (idx, node) in plan.nodes.iter().enumerate() {
        let frame = wire::encode(&node_launch(&plan, node, &rdzv.endpoint));
        let (tx, rx) = mpsc::unbounded_channel();
        cmds.push(tx);
        let span = info_span!("agent", job = %plan.job_id, node = node.node_rank, host = %node.host.host);
        let start = HostStart { idx, node: node.clone(), frame, timeout: plan.start_timeout, window: window.clone() };
        tasks.spawn(host_task(start, rx, ev_tx.clone(), out_tx.clone()).instrument(span));
    }
    drop(ev_tx);
    drop(out_tx);

    let n = plan.nodes.len();
    let mut hosts: Vec<HostState> = (0..n).map(|_| HostState::default()).collect();
    let mut signalled: Option<Signal> = None;
    let mut n_signals = 0u32;
    let mut stopping = false;
    let mut force_at: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    let mut follow_at: Option<Instant> = None;
    let mut all_ready_after = None;
    // Every agent was told to START (or, --check / a same-machine refusal, to stop).
    let mut released = false;
    let mut refused: Option<String> = None;
    let far = || Instant::now() + Duration::from_secs(86_400 * 365);

    let send_all = |cmds: &[mpsc::UnboundedSender<HostCmd>], hosts: &[HostState], make: &dyn Fn() -> Vec<HostCmd>| {
        for (tx, h) in cmds.iter().zip(hosts) {
            if h.ended.is_none() {
                for c in make() {
                    let _ = tx.send(c);
                }
            }
        }
    };
    let stop = |sig: Signal| move || vec![HostCmd::Control(Control { action: control::Action::Stop as i32, signal: sig as i32 })];
    let force = || vec![HostCmd::Control(Control { action: control::Action::Force as i32, signal: 0 }), HostCmd::Close];
    let start = || vec![HostCmd::Control(Control { action: control::Action::Start as i32, signal: 0 })];

    while hosts.iter().any(|h| h.ended.is_none()) {
        if !released && !stopping && hosts.iter().all(|h| h.ready && h.ended.is_none()) {
            // Every host checked its plan and waits: compare their identities, then go (or not).
            released = true;
            let ids: Vec<(&str, HostIdentity)> = plan
                .nodes
                .iter()
                .zip(&hosts)
                .map(|(node, h)| {
                    let r = h.info.as_ref();
                    let id = HostIdentity {
                        boot_id: r.map(|r| r.boot_id.clone()).unwrap_or_default(),
                        netns_inode: r.map_or(0, |r| r.netns_inode),
                    };
                    (node.host.host.as_str(), id)
                })
                .collect();
            if let Some((a, b)) = same_machine(&ids).filter(|_| !plan.allow_same_host) {
                refused = Some(same_machine_error(a, b, "same boot id and network namespace"));
            }
            if refused.is_some() || plan.check {
                stopping = true;
                force_at = Some(Instant::now() + plan.shutdown + STOP_SLACK);
                send_all(&cmds, &hosts, &stop(Signal::SIGTERM));
            } else {
                info!(hosts = n, "every host is ready: starting the job");
                send_all(&cmds, &hosts, &start);
            }
        }
        tokio::select! {
            ev = ev_rx.recv() => {
                let Some((idx, ev)) = ev else { break };
                let host = plan.nodes[idx].host.host.as_str();
                match ev {
                    HostEvent::Ready(r) => {
                        debug!(host, node_id = %r.node_id, pid = r.pid, "agent ready");
                        hosts[idx].ready = true;
                        hosts[idx].node_id = Some(r.node_id.clone());
                        hosts[idx].info = Some(r);
                        if all_ready_after.is_none() && hosts.iter().all(|h| h.ready) {
                            all_ready_after = Some(started.elapsed());
                            info!(hosts = n, after = ?started.elapsed(), "every agent started");
                        }
                    }
                    HostEvent::Ended(e) => {
                        debug!(host, status = ?e.status, exit_frame = ?e.exit_frame, stopped = e.stopped, "agent ended");
                        // A host the head stopped before it was ready did not fail (it was not let
                        // start), unless ssh or the agent said why it could not start anyway.
                        let own_failure = !e.ready
                            && (!e.stopped || e.failure.as_ref().is_some_and(|f| !matches!(f, StartFailure::Other { .. })));
                        let failed_start = own_failure && hosts[idx].failure.is_none();
                        let lost = e.ready && e.exit_frame.is_none() && !e.stopped;
                        let failed = e.exit_frame.is_some_and(|c| c != 0);
                        if failed_start {
                            hosts[idx].failure = Some(e.failure.clone().unwrap_or(StartFailure::Other {
                                code: e.status.and_then(|s| s.code()),
                                last: e.tail.last().cloned().unwrap_or_default(),
                            }));
                        } else if lost {
                            hosts[idx].lost = Some(lost_text(host, &e));
                        }
                        hosts[idx].ended = Some(e);
                        if (failed_start || lost) && !stopping {
                            // The round cannot form or go on without this host: stop the others.
                            stopping = true;
                            force_at = Some(Instant::now() + plan.shutdown + STOP_SLACK);
                            send_all(&cmds, &hosts, &stop(Signal::SIGTERM));
                        } else if failed && follow_at.is_none() && !stopping {
                            follow_at = Some(Instant::now() + plan.shutdown + FOLLOW_SLACK);
                        }
                    }
                }
            }
            (sig, action) = cx.signals.recv() => {
                match action {
                    SignalAction::Stop => {}
                    SignalAction::Forward => {
                        // Every host's workers get it (a Slurm --signal warning that asks them to
                        // checkpoint), as a local rsrun passes it on to its own.
                        info!(signal = %sig, "passing the signal on to every host's workers");
                        send_all(&cmds, &hosts, &|| {
                            vec![HostCmd::Control(Control { action: control::Action::Forward as i32, signal: sig as i32 })]
                        });
                        continue;
                    }
                    SignalAction::Ignore => {
                        info!(signal = %sig, "signal ignored (--signal-policy)");
                        continue;
                    }
                }
                n_signals += 1;
                signalled.get_or_insert(sig);
                if n_signals == 1 {
                    if !stopping {
                        info!(signal = %sig, "stopping every agent");
                        stopping = true;
                        force_at = Some(Instant::now() + plan.shutdown + STOP_SLACK);
                        send_all(&cmds, &hosts, &stop(sig));
                    }
                } else if kill_at.is_none() {
                    warn!(signal = %sig, "second stop signal: killing the workers now");
                    kill_at = Some(Instant::now() + KILL_AFTER);
                    send_all(&cmds, &hosts, &force);
                }
            }
            _ = tokio::time::sleep_until(follow_at.unwrap_or_else(far)), if follow_at.is_some() && !stopping => {
                warn!("agents still running after another host's agent failed: stopping them");
                stopping = true;
                force_at = Some(Instant::now() + plan.shutdown + STOP_SLACK);
                send_all(&cmds, &hosts, &stop(Signal::SIGTERM));
            }
            _ = tokio::time::sleep_until(force_at.unwrap_or_else(far)), if force_at.is_some() && kill_at.is_none() => {
                warn!("agents did not stop in time: killing the workers now");
                kill_at = Some(Instant::now() + KILL_AFTER);
                send_all(&cmds, &hosts, &force);
            }
            _ = tokio::time::sleep_until(kill_at.unwrap_or_else(far)), if kill_at.is_some() => {
                send_all(&cmds, &hosts, &|| vec![HostCmd::Kill]);
                kill_at = Some(far());
            }
        }
    }
    drop(cmds);
    while tasks.join_next().await.is_some() {}
    // Every host's output reaches the console before the summary.
    let _ = relay.await;
    let mut outcome = match refused {
        Some(msg) => HeadOutcome {
            exit_code: 2,
            summary: vec![format!("rsrun: error: {msg}"), "rsrun: nothing ran".to_owned()],
            all_ready_after: None,
            report: Vec::new(),
        },
        None => decide(&plan, &hosts, signalled, rdzv.client.as_ref()).await,
    };
    outcome.all_ready_after = all_ready_after;
    Ok(outcome)
}

fn lost_text(host: &str, e: &Ended) -> String {
    if let Some(why) = &e.broken {
        return format!("{host}: lost the agent: it sent {why} and was stopped (another rsrun version there?)");
    }
    let how = match e.status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(sig)) => format!("was killed by signal {sig}"),
            _ => "ended".into(),
        },
        None => "could not be waited for".into(),
    };
    match e.tail.last() {
        Some(l) => format!("{host}: lost the agent: ssh {how} ({l})"),
        None => format!("{host}: lost the agent: ssh {how}"),
    }
}

/// The exit code and summary once every agent has ended.
async fn decide(plan: &RemotePlan, hosts: &[HostState], signalled: Option<Signal>, client: Option<&RdzvClient>) -> HeadOutcome {
    let rsrun = plan.remote_rsrun.display().to_string();
    let failed: Vec<String> = plan
        .nodes
        .iter()
        .zip(hosts)
        .filter_map(|(node, h)| {
            let target = SshTarget { addr: node.host.target(), port: node.host.port.or(plan.ssh.port) };
            h.failure.as_ref().map(|f| describe(&node.host.host, target, f, &rsrun, plan.ssh.connect_timeout))
        })
        .collect();
    let report = if plan.check { check_report(plan, hosts) } else { Vec::new() };
    if !failed.is_empty() {
        let mut summary: Vec<String> = failed.iter().map(|l| format!("rsrun: error: {l}")).collect();
        summary.push(format!("rsrun: {} of {} hosts did not start; nothing ran", failed.len(), plan.nodes.len()));
        return HeadOutcome { exit_code: 2, summary, all_ready_after: None, report };
    }
    if plan.check && signalled.is_none() {
        let summary = vec![format!("rsrun: --check: all {} hosts are ready; no worker was started", plan.nodes.len())];
        return HeadOutcome { exit_code: 0, summary, all_ready_after: None, report };
    }
    if let Some(sig) = signalled {
        // A stop signal sets the exit code; a failure before it is still reported (a host lost,
        // or an agent that exited with its own code, not the signal's).
        let code = 128 + sig as i32;
        let failed_before =
            hosts.iter().any(|h| h.lost.is_some() || h.ended.as_ref().and_then(|e| e.exit_frame).is_some_and(|c| c != 0 && c != code));
        if !failed_before || plan.check {
            return HeadOutcome { exit_code: code, summary: Vec::new(), all_ready_after: None, report: Vec::new() };
        }
        let mut outcome = failure_outcome(plan, hosts, client, Some(code)).await;
        outcome.summary.push(format!("rsrun: stopped by {}; exiting {code}", crate::signals::signal_name(sig as i32)));
        outcome.exit_code = code;
        return outcome;
    }
    failure_outcome(plan, hosts, client, None).await
}

/// The job's outcome from the rendezvous' view and the hosts' ends; `stopped_with`: the code of a
/// stop signal's exit, which an agent's own code is not taken for.
async fn failure_outcome(plan: &RemotePlan, hosts: &[HostState], client: Option<&RdzvClient>, stopped_with: Option<i32>) -> HeadOutcome {
    // The job's root cause, as the rendezvous recorded it.
    let view = match client {
        Some(c) => match tokio::time::timeout(Duration::from_secs(5), c.await_job_end(&plan.job_id, Duration::ZERO)).await {
            Ok(Ok((v, _))) => Some(v),
            Ok(Err(err)) => {
                debug!(%err, "no job view");
                None
            }
            Err(_) => None,
        },
        None => None,
    };
    let host_of = |node_id: &str, fallback: &str| -> String {
        plan.nodes
            .iter()
            .zip(hosts)
            .find(|(_, h)| h.node_id.as_deref() == Some(node_id))
            .map(|(n, _)| n.host.host.clone())
            .unwrap_or_else(|| fallback.to_owned())
    };
    let mut summary = Vec::new();
    for h in hosts {
        if let Some(l) = &h.lost {
            summary.push(format!("rsrun: error: {l}"));
        }
    }
    if let Some(v) = &view
        && v.state() == proto::JobState::Failed
    {
        let (code, what) = match &v.root_cause {
            Some(rc) if rc.signal != 0 => (128 + rc.signal, format!("killed by {}", crate::signals::signal_name(rc.signal))),
            Some(rc) if rc.rank >= 0 => (if rc.exit_code == 0 { 1 } else { rc.exit_code & 0xff }, format!("exit code {}", rc.exit_code)),
            _ => (1, "failed".to_owned()),
        };
        let who = match &v.root_cause {
            Some(rc) if rc.rank >= 0 => format!(
                "rank {} (local_rank {}) on {}",
                rc.rank,
                rc.local_rank,
                host_of(&rc.node_id, if rc.hostname.is_empty() { &rc.node_id } else { &rc.hostname })
            ),
            Some(rc) => format!("node on {}", host_of(&rc.node_id, &rc.node_id)),
            None => "unknown".to_owned(),
        };
        summary.push(format!("rsrun: job {} failed: root cause {who}: {what} -> rsrun exits {code} ({})", plan.job_id, v.reason));
        return HeadOutcome { exit_code: code, summary, all_ready_after: None, report: Vec::new() };
    }
    // No failure recorded: a lost host first (the head stopped the others because of it, so
    // their codes are its consequence), else the agents' own codes, the first failure in host
    // order.
    if let Some(i) = hosts.iter().position(|h| h.lost.is_some()) {
        summary.push(format!(
            "rsrun: job {} failed: the head lost the agent on {} (above) and stopped the other hosts -> rsrun exits 1",
            plan.job_id, plan.nodes[i].host.host
        ));
        return HeadOutcome { exit_code: 1, summary, all_ready_after: None, report: Vec::new() };
    }
    let codes: Vec<(usize, i32)> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (i, h.ended.as_ref().and_then(|e| e.exit_frame).unwrap_or(0)))
        .collect();
    match codes.iter().find(|(_, c)| *c != 0 && Some(*c) != stopped_with) {
        Some((i, c)) => {
            summary.push(format!("rsrun: the agent on {} exited with code {c}", plan.nodes[*i].host.host));
            HeadOutcome { exit_code: *c, summary, all_ready_after: None, report: Vec::new() }
        }
        None => HeadOutcome { exit_code: 0, summary, all_ready_after: None, report: Vec::new() },
    }
}

/// `--check`: one line per host whose agent was ready, in host order.
fn check_report(plan: &RemotePlan, hosts: &[HostState]) -> Vec<String> {
    plan.nodes
        .iter()
        .zip(hosts)
        .filter_map(|(node, h)| {
            let r = h.info.as_ref()?;
            let how = if node.local { "local, no ssh" } else { "ssh" };
            Some(format!(
                "{}: ready ({how}): hostname {}, rsrun {}, {} worker{}, {} GPU{}, program {}",
                node.host.host,
                r.hostname,
                r.rsrun_version,
                r.workers,
                if r.workers == 1 { "" } else { "s" },
                r.gpus,
                if r.gpus == 1 { "" } else { "s" },
                r.program
            ))
        })
        .collect()
}

/// What one host's task starts.
struct HostStart {
    idx: usize,
    node: RemoteNode,
    /// The encoded `NodeLaunch`.
    frame: Vec<u8>,
    /// How long the agent may take to become ready once its command started.
    timeout: Duration,
    /// The fan-out window.
    window: std::sync::Arc<Semaphore>,
}

/// One host: wait for a place in the fan-out window, start its agent (retrying a dropped key
/// exchange), feed its stdin, relay its output. A stop that comes while the host still waits for its
/// place ends it without starting anything.
async fn host_task(
    start: HostStart,
    mut cmds: mpsc::UnboundedReceiver<HostCmd>,
    events: mpsc::UnboundedSender<(usize, HostEvent)>,
    output: mpsc::Sender<(usize, HostOutput)>,
) {
    let HostStart { idx, node, frame, timeout, window } = start;
    let send = |ev: HostEvent| {
        let _ = events.send((idx, ev));
    };
    let outlet = Outlet { idx, tx: output };
    let not_started = || Ended { status: None, exit_frame: None, ready: false, failure: None, tail: Vec::new(), stopped: true, broken: None };
    let mut attempt = 0;
    loop {
        let permit = tokio::select! {
            p = window.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => {
                    send(HostEvent::Ended(not_started()));
                    return;
                }
            },
            c = cmds.recv() => {
                // Anything the head says before this host started means "do not start".
                debug!(cmd = ?c, "stopped before starting");
                send(HostEvent::Ended(not_started()));
                return;
            }
        };
        let ended = run_attempt(&node, &frame, timeout, permit, &mut cmds, &send, &outlet).await;
        if !ended.ready
            && !ended.stopped
            && attempt < preflight::KEX_RETRIES
            && ended.failure.as_ref().is_some_and(is_retryable)
        {
            attempt += 1;
            let wait = preflight::kex_backoff(attempt, rand::rng().random_range(0.0..1.0));
            info!(attempt, ?wait, "sshd dropped the connection in the key exchange; retrying");
            tokio::time::sleep(wait).await;
            continue;
        }
        send(HostEvent::Ended(ended));
        return;
    }
}

/// Where a host's console output goes: the shared, bounded console queue, tagged with the host.
struct Outlet {
    idx: usize,
    tx: mpsc::Sender<(usize, HostOutput)>,
}

/// The process group of a host's transport: ssh (or the `--rsh` wrapper and whatever it started, a
/// forked ssh included), or a local agent. It is killed as a whole, and on drop, unless it was
/// released: once its leader is reaped and it is empty, its id may be reused by an unrelated group.
#[derive(Debug)]
struct TransportGroup {
    pgid: Option<nix::unistd::Pid>,
}

impl TransportGroup {
    /// SIGKILLs every process of the group (errors: the group is gone).
    fn kill(&self) {
        if let Some(pgid) = self.pgid {
            let _ = nix::sys::signal::killpg(pgid, Signal::SIGKILL);
        }
    }

    /// Forgets the group if it has no process left (call once its leader is reaped).
    fn release_if_empty(&mut self) {
        if let Some(pgid) = self.pgid
            && matches!(nix::sys::signal::killpg(pgid, None), Err(nix::errno::Errno::ESRCH))
        {
            self.pgid = None;
        }
    }
}

impl Drop for TransportGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads one line (at most `max` bytes: a longer one comes as several) and converts it lossily: the
/// stream's bytes need not be UTF-8 (a login banner in Latin-1). `None` at EOF or on a read error.
async fn next_line_lossy(r: &mut (impl tokio::io::AsyncBufRead + Unpin), max: usize) -> Option<String> {
    let mut buf = Vec::new();
    match (&mut *r).take(max as u64).read_until(b'\n', &mut buf).await {
        Ok(0) | Err(_) => None,
        Ok(_) => {
            if buf.last() == Some(&b'\n') {
                buf.pop();
            }
            Some(String::from_utf8_lossy(&buf).into_owned())
        }
    }
}

/// One start of a host's agent, until the process ended and its pipes drained. `permit` (the host's
/// place in the fan-out window) is given back when the agent is ready or the attempt ended.
///
/// Nothing here waits on the agent or the console while a command, the start deadline or the
/// agent's end is due: stdin is written by a task of its own (an ssh that never reads it cannot
/// block a STOP or a kill), and output waits in bounded queues, which are read only while there is
/// room further on (a slow console holds back the agent, not the head).
async fn run_attempt(
    node: &RemoteNode,
    frame: &[u8],
    timeout: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
    cmds: &mut mpsc::UnboundedReceiver<HostCmd>,
    send: &impl Fn(HostEvent),
    outlet: &Outlet,
) -> Ended {
    let mut permit = Some(permit);
    let mut cmd = Command::new(&node.argv[0]);
    cmd.args(&node.argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C on the terminal reaches the head only, which stops the
        // agents in order; and a kill reaches whatever the transport started.
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let failure = StartFailure::Other { code: None, last: format!("cannot run {}: {e}", node.argv[0].to_string_lossy()) };
            return Ended { status: None, exit_frame: None, ready: false, failure: Some(failure), tail: Vec::new(), stopped: false, broken: None };
        }
    };
    // The child leads its own group (process_group(0)): its pid is the group id.
    let mut group = TransportGroup { pgid: child.id().and_then(|p| i32::try_from(p).ok()).map(nix::unistd::Pid::from_raw) };
    let ready_by = Instant::now() + timeout;
    debug!(pid = child.id(), argv = ?node.argv, "agent process started");
    let mut readers = JoinSet::new();
    // stdin: the plan, then Control messages, in order; dropping the sender is EOF (after what is
    // queued).
    let mut stdin_tx: Option<mpsc::UnboundedSender<Vec<u8>>> = None;
    if let Some(mut stdin) = child.stdin.take() {
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let _ = tx.send(frame.to_vec());
        stdin_tx = Some(tx);
        readers.spawn(async move {
            while let Some(buf) = rx.recv().await {
                if let Err(err) = stdin.write_all(&buf).await {
                    debug!(%err, "cannot write to the agent's stdin (the agent will say why)");
                    return;
                }
            }
        });
    }
    // Readers run as tasks: a frame or a line is never cut by the select below.
    let (out_tx, mut out_rx) = mpsc::channel::<FromAgent>(READ_QUEUE);
    if let Some(stdout) = child.stdout.take() {
        let tx = out_tx.clone();
        readers.spawn(async move {
            let mut r = BufReader::with_capacity(64 * 1024, stdout);
            // The first bytes must begin a message of the agent protocol: text there (a
            // wrapper's or a login script's) is quoted at once instead of being read as a frame
            // length and waited for until the start timeout.
            let mut head = Vec::new();
            loop {
                match wire::first_frame(&head) {
                    FirstFrame::Plausible => break,
                    FirstFrame::Garbled => {
                        head.extend_from_slice(r.buffer());
                        let _ = tx.send(FromAgent::Garbled(head)).await;
                        return;
                    }
                    FirstFrame::NeedMore => {
                        let mut b = [0u8; 1];
                        match r.read(&mut b).await {
                            Ok(1) => head.push(b[0]),
                            // Ended (or failed) before a whole message: what it wrote is quoted;
                            // nothing at all is an agent that exited silently.
                            _ => {
                                if !head.is_empty() {
                                    let _ = tx.send(FromAgent::Garbled(head)).await;
                                }
                                return;
                            }
                        }
                    }
                }
            }
            // The length's bytes, to quote a first "message" that does not decode.
            let mut length_bytes = Some(head[..head.len() - 1].to_vec());
            let mut r = std::io::Cursor::new(head).chain(r);
            loop {
                match read_frame_async(&mut r).await {
                    Ok(Some(buf)) => match (decode_event(&buf), length_bytes.take()) {
                        (Ok(ev), _) => {
                            // A full queue holds this reader back, and with it the agent's stdout.
                            if let Some(e) = ev.event
                                && tx.send(FromAgent::Event(e)).await.is_err()
                            {
                                return;
                            }
                        }
                        (Err(_), Some(mut raw)) => {
                            raw.extend_from_slice(&buf);
                            let _ = tx.send(FromAgent::Garbled(raw)).await;
                            return;
                        }
                        (Err(err), None) => {
                            let _ = tx.send(FromAgent::Broken(format!("an undecodable message of {} bytes ({err})", buf.len()))).await;
                            return;
                        }
                    },
                    Ok(None) => break,
                    Err(err) if err.kind() == std::io::ErrorKind::InvalidData => {
                        let _ = tx.send(FromAgent::Broken(format!("a broken message ({err})"))).await;
                        return;
                    }
                    Err(err) => {
                        debug!(%err, "agent stdout ended");
                        break;
                    }
                }
            }
        });
    }
    let (err_tx, mut err_rx) = mpsc::channel::<String>(READ_QUEUE);
    if let Some(stderr) = child.stderr.take() {
        readers.spawn(async move {
            let mut r = BufReader::new(stderr);
            while let Some(l) = next_line_lossy(&mut r, STDERR_LINE).await {
                if err_tx.send(l).await.is_err() {
                    return;
                }
            }
        });
    }
    drop(out_tx);

    let mut timed_out = false;
    let mut ready = false;
    let mut exit_frame = None;
    let mut start_failed: Option<String> = None;
    let mut broken: Option<String> = None;
    let mut tail: VecDeque<String> = VecDeque::new();
    let mut held: VecDeque<String> = VecDeque::new();
    // Output for the console queue, in the order it was read.
    let mut queue: VecDeque<HostOutput> = VecDeque::new();
    let mut status: Option<ExitStatus> = None;
    let mut stop_asked = false;
    let mut cmds_open = true;
    let (mut out_open, mut err_open) = (true, true);
    let mut drain_until: Option<Instant> = None;
    loop {
        if status.is_some() && !out_open && !err_open {
            break;
        }
        let room = queue.len() < HOST_QUEUE;
        // After the agent process ended, its pipes get DRAIN from the last progress to deliver the
        // rest. Time the console holds this host back does not count: its last lines and its Exit
        // frame are still in the pipes then, and a console slower than DRAIN would lose them.
        if !room && drain_until.is_some() {
            drain_until = Some(Instant::now() + DRAIN);
        }
        let progress = |drain_until: &mut Option<Instant>| {
            if drain_until.is_some() {
                *drain_until = Some(Instant::now() + DRAIN);
            }
        };
        tokio::select! {
            c = cmds.recv(), if cmds_open => match c {
                Some(HostCmd::Control(ctl)) => {
                    // START lets the host go; only STOP and FORCE make its end one the head asked
                    // for (an agent gone after START without its Exit frame is a lost host).
                    if ctl.action() != control::Action::Start {
                        stop_asked = true;
                    }
                    if let Some(tx) = &stdin_tx {
                        let _ = tx.send(wire::encode(&ctl));
                    }
                }
                Some(HostCmd::Close) => {
                    stop_asked = true;
                    stdin_tx = None;
                }
                Some(HostCmd::Kill) => {
                    stop_asked = true;
                    group.kill();
                }
                None => {
                    cmds_open = false;
                    stdin_tx = None;
                }
            },
            permit = outlet.tx.reserve(), if !queue.is_empty() => match permit {
                Ok(p) => {
                    if let Some(o) = queue.pop_front() {
                        p.send((outlet.idx, o));
                    }
                    progress(&mut drain_until);
                }
                // The head is ending: nobody shows output any more.
                Err(_) => queue.clear(),
            },
            ev = out_rx.recv(), if out_open && room => {
                progress(&mut drain_until);
                match ev {
                    Some(FromAgent::Garbled(bytes)) => {
                        start_failed = Some(garbled(&bytes));
                        group.kill();
                    }
                    Some(FromAgent::Broken(why)) => {
                        warn!(%why, "the agent broke the protocol: stopping it");
                        if !ready {
                            start_failed = Some(format!("the agent sent {why}"));
                        }
                        broken = Some(why);
                        group.kill();
                    }
                    Some(FromAgent::Event(agent_event::Event::Ready(r))) => {
                        ready = true;
                        permit = None;
                        queue.extend(held.drain(..).map(HostOutput::Stderr));
                        send(HostEvent::Ready(r));
                    }
                    Some(FromAgent::Event(agent_event::Event::Line(l))) => queue.push_back(HostOutput::Line(l.stream(), l.data)),
                    Some(FromAgent::Event(agent_event::Event::Note(t))) => queue.push_back(HostOutput::Note(t)),
                    Some(FromAgent::Event(agent_event::Event::StartFailed(m))) => start_failed = Some(m),
                    Some(FromAgent::Event(agent_event::Event::Exit(x))) => exit_frame = Some(x.code),
                    None => out_open = false,
                }
            },
            l = err_rx.recv(), if err_open && room => {
                progress(&mut drain_until);
                match l {
                    Some(l) => {
                        if tail.len() == TAIL {
                            tail.pop_front();
                        }
                        tail.push_back(l.clone());
                        if ready {
                            queue.push_back(HostOutput::Stderr(l));
                        } else {
                            if held.len() == HELD {
                                held.pop_front();
                            }
                            held.push_back(l);
                        }
                    }
                    None => err_open = false,
                }
            },
            st = child.wait(), if status.is_none() => {
                status = Some(st.unwrap_or_else(|_| ExitStatus::from_raw(255 << 8)));
                group.release_if_empty();
                drain_until = Some(Instant::now() + DRAIN);
            }
            _ = tokio::time::sleep_until(drain_until.unwrap_or_else(Instant::now)), if drain_until.is_some() && room => {
                // Something (a grandchild) holds the pipes open: stop waiting for them.
                break;
            }
            _ = tokio::time::sleep_until(ready_by), if !ready && !timed_out && !stop_asked && status.is_none() => {
                warn!(?timeout, "the agent did not start in time");
                timed_out = true;
                group.kill();
            }
        }
    }
    drop(permit);
    readers.abort_all();
    // What is still in the transport's group (a process an --rsh wrapper forked holding the pipes)
    // goes with this attempt.
    group.release_if_empty();
    drop(group);
    // The agent has ended: the rest of its output waits for the console.
    for o in queue {
        if outlet.tx.send((outlet.idx, o)).await.is_err() {
            break;
        }
    }
    let tail: Vec<String> = tail.into();
    let failure = if ready {
        None
    } else if timed_out {
        Some(StartFailure::Timeout(timeout))
    } else if let Some(m) = start_failed {
        Some(StartFailure::Agent(m))
    } else {
        Some(classify(status.and_then(|s| s.code()), &tail))
    };
    Ended { status, exit_frame, ready, failure, tail, stopped: stop_asked, broken }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::remote::RemoteHost;

    fn node(argv: &[&str]) -> RemoteNode {
        RemoteNode { host: RemoteHost::named("t", 1), node_rank: 0, rank_offset: Some(0), local: true, argv: argv.iter().map(Into::into).collect() }
    }

    /// A process is gone (or a zombie nobody reaped yet: it runs no more).
    fn gone(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => crate::worker::stat_state_and_group(&stat).is_some_and(|(state, _)| state == 'Z'),
            Err(_) => true,
        }
    }

    struct Attempt {
        cmds: mpsc::UnboundedSender<HostCmd>,
        output: mpsc::Receiver<(usize, HostOutput)>,
        ended: tokio::task::JoinHandle<Ended>,
    }

    /// Starts `run_attempt` for `argv` with `frame` as the plan and a console queue of `queue`.
    fn attempt(argv: &[&str], frame: Vec<u8>, timeout: Duration, queue: usize) -> Attempt {
        let (cmds, mut cmd_rx) = mpsc::unbounded_channel();
        let (tx, output) = mpsc::channel(queue);
        let node = node(argv);
        let ended = tokio::spawn(async move {
            let permit = std::sync::Arc::new(Semaphore::new(1)).acquire_owned().await.unwrap();
            run_attempt(&node, &frame, timeout, permit, &mut cmd_rx, &|_| {}, &Outlet { idx: 0, tx }).await
        });
        Attempt { cmds, output, ended }
    }

    /// A stop signal during the teardown after a host's failure: the head exits with the signal's
    /// code, and still names the failure (before, the summary was empty).
    #[tokio::test]
    async fn a_stop_signal_after_a_failure_keeps_the_failure_in_the_summary() {
        let args = crate::plan::tests::parse(&["-H", "w1:1,w2:1", "--rdzv-endpoint", "127.0.0.1", "true"]);
        let plan = RemotePlan::resolve(&args, &crate::plan::tests::host(), std::path::Path::new("/opt/rsrun")).unwrap();
        let ended = |frame: i32| Ended { status: None, exit_frame: Some(frame), ready: true, failure: None, tail: Vec::new(), stopped: false, broken: None };
        let hosts = |w2: i32| vec![
            HostState { ready: true, ended: Some(ended(130)), ..HostState::default() },
            HostState { ready: true, ended: Some(ended(w2)), ..HostState::default() },
        ];
        let out = decide(&plan, &hosts(3), Some(Signal::SIGINT), None).await;
        assert_eq!(out.exit_code, 130);
        let text = out.summary.join("\n");
        assert!(text.contains("the agent on w2 exited with code 3") && text.contains("stopped by SIGINT"), "{text}");
        // A plain Ctrl-C (every host stopped by it) says nothing more.
        let out = decide(&plan, &hosts(130), Some(Signal::SIGINT), None).await;
        assert_eq!((out.exit_code, out.summary.len()), (130, 0), "{:?}", out.summary);
    }

    /// A transport that never reads its stdin (ssh stalled before the session opened) and a plan
    /// larger than a pipe holds: the start deadline still fires and the attempt ends.
    #[tokio::test]
    async fn a_transport_that_never_reads_stdin_still_times_out() {
        let a = attempt(&["sh", "-c", "exec sleep 30"], vec![0x0a; 1 << 20], Duration::from_millis(500), 8);
        let ended = tokio::time::timeout(Duration::from_secs(10), a.ended).await.expect("the attempt hung on its stdin").unwrap();
        assert_eq!(ended.failure, Some(StartFailure::Timeout(Duration::from_millis(500))));
    }

    /// A kill reaches the transport's whole process group: an `--rsh` wrapper that forks (instead of
    /// exec'ing) the real ssh does not leave it running.
    #[tokio::test]
    async fn a_kill_reaches_what_the_transport_forked() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let script = format!("sleep 600 & echo $! > {}; wait", pid_file.display());
        let a = attempt(&["sh", "-c", &script], Vec::new(), Duration::from_secs(60), 8);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let pid = loop {
            if let Some(p) = std::fs::read_to_string(&pid_file).ok().and_then(|s| s.trim().parse::<i32>().ok()) {
                break p;
            }
            assert!(std::time::Instant::now() < deadline, "the wrapper did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        a.cmds.send(HostCmd::Kill).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(10), a.ended).await.unwrap().unwrap();
        assert!(ended.stopped);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !gone(pid) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !gone(pid) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
            panic!("the forked process {pid} survived the kill");
        }
    }

    /// A console that does not keep up holds the agent back (its writes block) instead of growing
    /// the head's memory, and a kill is still served.
    #[tokio::test]
    async fn a_slow_console_holds_the_agent_back() {
        let dir = tempfile::tempdir().unwrap();
        let frames = dir.path().join("frames");
        let done = dir.path().join("done");
        let line = |i: usize| {
            let data = format!("{i:06} {}\n", "x".repeat(4089)).into_bytes();
            wire::encode(&proto::AgentEvent {
                event: Some(agent_event::Event::Line(proto::ConsoleLine { stream: console_line::Stream::Stdout as i32, data })),
            })
        };
        // 16 MiB of output.
        std::fs::write(&frames, (0..4096).flat_map(line).collect::<Vec<u8>>()).unwrap();
        let script = format!("cat {} && touch {}; exec sleep 30", frames.display(), done.display());
        let mut a = attempt(&["sh", "-c", &script], Vec::new(), Duration::from_secs(60), 4);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!done.exists(), "the agent wrote all its output although nobody read it");
        // What the head holds: the console queue, the host's queue, the reader's, the pipe.
        let mut got = 0;
        while let Ok((_, HostOutput::Line(_, data))) = a.output.try_recv() {
            assert!(data.starts_with(format!("{got:06} ").as_bytes()), "lines in order");
            got += 1;
        }
        assert!(got <= 4, "{got}");
        a.cmds.send(HostCmd::Kill).unwrap();
        // The rest arrives in order once it is read; the kill ended the agent.
        let reader = tokio::spawn(async move {
            let mut n = got;
            while let Some((_, HostOutput::Line(_, data))) = a.output.recv().await {
                assert!(data.starts_with(format!("{n:06} ").as_bytes()), "lines in order");
                n += 1;
            }
            n
        });
        let ended = tokio::time::timeout(Duration::from_secs(10), a.ended).await.expect("a kill is served under backpressure").unwrap();
        assert!(ended.stopped);
        let n = reader.await.unwrap();
        assert!(n < 4096, "the agent was killed before it wrote everything: {n}");
    }

    /// An agent that wrote its last output and its Exit frame and ended, behind a console slower
    /// than the drain deadline: everything still arrives (the deadline counts only the time the
    /// console keeps up), the Exit frame included.
    #[tokio::test]
    async fn a_console_slower_than_the_drain_deadline_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let frames = dir.path().join("frames");
        let line = |i: usize| {
            let data = format!("{i:06} {}\n", "x".repeat(4089)).into_bytes();
            wire::encode(&proto::AgentEvent {
                event: Some(agent_event::Event::Line(proto::ConsoleLine { stream: console_line::Stream::Stdout as i32, data })),
            })
        };
        // More lines than the console's and the host's queues hold (4 + 256), few enough that the
        // rest fits the reader's queue: the agent writes everything and ends, then the Exit frame.
        let mut bytes: Vec<u8> = (0..300).flat_map(line).collect();
        bytes.extend(wire::encode(&proto::AgentEvent { event: Some(agent_event::Event::Exit(proto::AgentExit { code: 3 })) }));
        std::fs::write(&frames, bytes).unwrap();
        let script = format!("exec cat {}", frames.display());
        let mut a = attempt(&["sh", "-c", &script], Vec::new(), Duration::from_secs(60), 4);
        // Nobody reads for longer than DRAIN.
        tokio::time::sleep(DRAIN + Duration::from_secs(1)).await;
        let reader = tokio::spawn(async move {
            let mut n = 0;
            while let Some((_, out)) = a.output.recv().await {
                if let HostOutput::Line(_, data) = out {
                    assert!(data.starts_with(format!("{n:06} ").as_bytes()), "lines in order");
                    n += 1;
                }
            }
            n
        });
        let ended = tokio::time::timeout(Duration::from_secs(20), a.ended).await.expect("the attempt ends").unwrap();
        assert_eq!(ended.exit_frame, Some(3), "the Exit frame behind the slow console");
        assert_eq!(reader.await.unwrap(), 300, "every line behind the slow console");
    }

    /// The agents wait for START as long as every host may take to start: windows of the fan-out,
    /// each with its retries, and a minute.
    #[test]
    fn agents_wait_for_start_as_long_as_the_slowest_window() {
        let hosts: Vec<String> = (0..10).map(|i| format!("w{i}:1")).collect();
        let args = crate::plan::tests::parse(&["-H", &hosts.join(","), "--ssh-fanout", "4", "--rdzv-endpoint", "127.0.0.1", "true"]);
        let plan = RemotePlan::resolve(&args, &crate::plan::tests::host(), std::path::Path::new("/r")).unwrap();
        assert_eq!(plan.start_timeout, Duration::from_secs(30));
        // 3 windows of (5 tries of 30 s, 8 s of backoff), and 60 s.
        assert_eq!(start_wait(&plan), Duration::from_secs(3 * (5 * 30 + 8) + 60));
        assert_eq!(node_launch(&plan, &plan.nodes[0], "127.0.0.1:1").start_wait_secs, 534);
    }

    /// stderr is read as bytes: a line that is not UTF-8 comes lossily, and the lines after it come.
    #[tokio::test]
    async fn stderr_lines_need_not_be_utf8() {
        let mut r = BufReader::new(std::io::Cursor::new(b"caf\xe9\nPermission denied\nlong".to_vec()));
        assert_eq!(next_line_lossy(&mut r, 1024).await.as_deref(), Some("caf\u{fffd}"));
        assert_eq!(next_line_lossy(&mut r, 1024).await.as_deref(), Some("Permission denied"));
        assert_eq!(next_line_lossy(&mut r, 2).await.as_deref(), Some("lo"));
        assert_eq!(next_line_lossy(&mut r, 1024).await.as_deref(), Some("ng"));
        assert_eq!(next_line_lossy(&mut r, 1024).await, None);
    }
}
