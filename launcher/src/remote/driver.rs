//! The head: host the rendezvous, start one agent per host, relay their output, stop them, and
//! exit with the job's root cause.
//!
//! ```text
//! resolve plan ─▶ rendezvous (embedded, token per job) ─▶ one task per host:
//!   wait for a place in the fan-out window (--ssh-fanout hosts connecting at once)
//!   spawn `ssh … HOST 'exec rsrun agent --stdin'` (or the local agent), own process group
//!   stdin  ◀─ NodeLaunch, then Control{START|STOP|FORCE}; closing it is the last word (EOF)
//!   stdout ─▶ AgentEvent frames: Ready (checked, waiting), worker lines, notes, StartFailed, Exit;
//!     a stream that does not begin with one (a wrapper printed there) fails the host at once,
//!     quoting its first bytes
//!   stderr ─▶ ssh's and the agent's own diagnostics (kept until Ready, for the start-failure line)
//!   Ready (or failure) frees the place in the window; no Ready within the start timeout fails it
//!   a start that sshd dropped in the key exchange is retried
//! every host Ready: compare the host identities the agents reported (two entries on one machine →
//!   STOP to all, exit 2); --check → STOP to all, one line per host, exit 0; else START to all
//! event loop: console lines prefixed with the host; start failures → stop everyone, exit 2;
//!   first stop signal → Control STOP(sig) to all, wait --shutdown-timeout + 5 s;
//!   second signal / that deadline → Control FORCE and EOF, 2 s, SIGKILL the ssh clients;
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
use super::preflight::{self, StartFailure, classify, describe, is_retryable};
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
}

#[derive(Debug)]
enum HostEvent {
    Ready(AgentReady),
    Line(console_line::Stream, Vec<u8>),
    Note(String),
    Stderr(String),
    Ended(Ended),
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

/// The embedded service with its token file (removed on drop).
struct Rendezvous {
    _server: Option<EmbeddedServer>,
    _token_dir: Option<super::agent::PrivateDir>,
    endpoint: String,
    client: Option<RdzvClient>,
}

async fn start_rendezvous(plan: &RemotePlan) -> anyhow::Result<Rendezvous> {
    match &plan.rdzv {
        RemoteRdzv::Embedded { bind, advertise } => {
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
            let server = spawn_with(cfg)
                .await
                .map_err(|e| anyhow::anyhow!("cannot host the rendezvous service at {bind}: {e}"))?;
            let port = server.addr.port();
            let endpoint = if advertise.contains(':') { format!("[{advertise}]:{port}") } else { format!("{advertise}:{port}") };
            info!(job = %plan.job_id, %endpoint, "hosting the rendezvous service");
            let client = client(&endpoint, plan.token.clone());
            Ok(Rendezvous { _server: Some(server), _token_dir: dir, endpoint, client })
        }
        RemoteRdzv::External { endpoint } => {
            let endpoint = endpoint.to_string();
            let client = client(&endpoint, plan.token.clone());
            Ok(Rendezvous { _server: None, _token_dir: None, endpoint, client })
        }
    }
}

fn client(endpoint: &str, token: Option<String>) -> Option<RdzvClient> {
    let mut cfg = ClientConfig::new(endpoint.to_owned());
    cfg.token = token;
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
        nproc_per_node: node.host.slots.to_string(),
        devices: node.host.devices.as_ref().map(|d| DeviceList { ids: d.clone() }),
        rdzv_endpoint: endpoint.to_owned(),
        token: plan.token.clone().unwrap_or_default(),
        cwd: plan.cwd.display().to_string(),
        env: plan.env.vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        program: plan.program.clone(),
        options: plan.options.clone(),
        rdzv_in_head: matches!(plan.rdzv, RemoteRdzv::Embedded { .. }),
    }
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
        tasks.spawn(host_task(start, rx, ev_tx.clone()).instrument(span));
    }
    drop(ev_tx);

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
                    HostEvent::Line(stream, data) => {
                        let mut line = Vec::with_capacity(host.len() + 1 + data.len());
                        line.extend_from_slice(host.as_bytes());
                        line.push(b' ');
                        line.extend_from_slice(&data);
                        let ev = match stream {
                            console_line::Stream::Stderr => ConsoleEvent::Stderr(line),
                            _ => ConsoleEvent::Stdout(line),
                        };
                        let _ = cx.console.send(ev).await;
                    }
                    HostEvent::Note(text) => {
                        for l in text.lines() {
                            let _ = cx.console.send(ConsoleEvent::Note(format!("{host} {l}"))).await;
                        }
                    }
                    HostEvent::Stderr(l) => {
                        let _ = cx.console.send(ConsoleEvent::Stderr(format!("{host} {l}\n").into_bytes())).await;
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
                if action != SignalAction::Stop {
                    info!(signal = %sig, %action, "signal not forwarded to remote agents");
                    continue;
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
        .filter_map(|(node, h)| h.failure.as_ref().map(|f| describe(&node.host.host, f, &rsrun, plan.ssh.connect_timeout)))
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
        return HeadOutcome { exit_code: 128 + sig as i32, summary: Vec::new(), all_ready_after: None, report: Vec::new() };
    }
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
    // No failure recorded: the agents' own codes, the first failure in host order.
    let codes: Vec<(usize, i32)> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| (i, h.ended.as_ref().and_then(|e| e.exit_frame).unwrap_or(if h.lost.is_some() { 1 } else { 0 })))
        .collect();
    match codes.iter().find(|(_, c)| *c != 0) {
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
async fn host_task(start: HostStart, mut cmds: mpsc::UnboundedReceiver<HostCmd>, events: mpsc::UnboundedSender<(usize, HostEvent)>) {
    let HostStart { idx, node, frame, timeout, window } = start;
    let send = |ev: HostEvent| {
        let _ = events.send((idx, ev));
    };
    let not_started = || Ended { status: None, exit_frame: None, ready: false, failure: None, tail: Vec::new(), stopped: true };
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
        let ended = run_attempt(&node, &frame, timeout, permit, &mut cmds, &send).await;
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

/// One start of a host's agent, until the process ended and its pipes drained. `permit` (the host's
/// place in the fan-out window) is given back when the agent is ready or the attempt ended.
async fn run_attempt(
    node: &RemoteNode,
    frame: &[u8],
    timeout: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
    cmds: &mut mpsc::UnboundedReceiver<HostCmd>,
    send: &impl Fn(HostEvent),
) -> Ended {
    let mut permit = Some(permit);
    let mut cmd = Command::new(&node.argv[0]);
    cmd.args(&node.argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C on the terminal reaches the head only, which stops the
        // agents in order.
        .process_group(0)
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let failure = StartFailure::Other { code: None, last: format!("cannot run {}: {e}", node.argv[0].to_string_lossy()) };
            return Ended { status: None, exit_frame: None, ready: false, failure: Some(failure), tail: Vec::new(), stopped: false };
        }
    };
    debug!(pid = child.id(), argv = ?node.argv, "agent process started");
    let mut stdin = child.stdin.take();
    // Readers run as tasks: a frame or a line is never cut by the select below.
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<FromAgent>();
    let mut readers = JoinSet::new();
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
                        let _ = tx.send(FromAgent::Garbled(head));
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
                                    let _ = tx.send(FromAgent::Garbled(head));
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
                            if let Some(e) = ev.event {
                                let _ = tx.send(FromAgent::Event(e));
                            }
                        }
                        (Err(_), Some(mut raw)) => {
                            raw.extend_from_slice(&buf);
                            let _ = tx.send(FromAgent::Garbled(raw));
                            return;
                        }
                        (Err(err), None) => warn!(%err, "undecodable message from the agent"),
                    },
                    Ok(None) => break,
                    Err(err) => {
                        debug!(%err, "agent stdout ended");
                        break;
                    }
                }
            }
        });
    }
    let (err_tx, mut err_rx) = mpsc::unbounded_channel::<String>();
    if let Some(stderr) = child.stderr.take() {
        readers.spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                let _ = err_tx.send(l);
            }
        });
    }
    drop(out_tx);
    if let Some(s) = stdin.as_mut()
        && let Err(err) = s.write_all(frame).await
    {
        debug!(%err, "cannot write the launch plan (the agent will say why)");
    }

    let ready_by = Instant::now() + timeout;
    let mut timed_out = false;
    let mut ready = false;
    let mut exit_frame = None;
    let mut start_failed: Option<String> = None;
    let mut tail: VecDeque<String> = VecDeque::new();
    let mut held: Vec<String> = Vec::new();
    let mut status: Option<ExitStatus> = None;
    let mut stop_asked = false;
    let mut cmds_open = true;
    let (mut out_open, mut err_open) = (true, true);
    let mut drain_until: Option<Instant> = None;
    loop {
        if status.is_some() && !out_open && !err_open {
            break;
        }
        tokio::select! {
            c = cmds.recv(), if cmds_open => match c {
                Some(HostCmd::Control(ctl)) => {
                    stop_asked = true;
                    if let Some(s) = stdin.as_mut() && s.write_all(&wire::encode(&ctl)).await.is_err() {
                        stdin = None;
                    }
                }
                Some(HostCmd::Close) => {
                    stop_asked = true;
                    stdin = None;
                }
                Some(HostCmd::Kill) => {
                    stop_asked = true;
                    let _ = child.start_kill();
                }
                None => {
                    cmds_open = false;
                    stdin = None;
                }
            },
            ev = out_rx.recv(), if out_open => match ev {
                Some(FromAgent::Garbled(bytes)) => {
                    start_failed = Some(garbled(&bytes));
                    let _ = child.start_kill();
                }
                Some(FromAgent::Event(agent_event::Event::Ready(r))) => {
                    ready = true;
                    permit = None;
                    for l in held.drain(..) {
                        send(HostEvent::Stderr(l));
                    }
                    send(HostEvent::Ready(r));
                }
                Some(FromAgent::Event(agent_event::Event::Line(l))) => send(HostEvent::Line(l.stream(), l.data)),
                Some(FromAgent::Event(agent_event::Event::Note(t))) => send(HostEvent::Note(t)),
                Some(FromAgent::Event(agent_event::Event::StartFailed(m))) => start_failed = Some(m),
                Some(FromAgent::Event(agent_event::Event::Exit(x))) => exit_frame = Some(x.code),
                None => out_open = false,
            },
            l = err_rx.recv(), if err_open => match l {
                Some(l) => {
                    if tail.len() == TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(l.clone());
                    if ready { send(HostEvent::Stderr(l)) } else { held.push(l) }
                }
                None => err_open = false,
            },
            st = child.wait(), if status.is_none() => {
                status = Some(st.unwrap_or_else(|_| ExitStatus::from_raw(255 << 8)));
                drain_until = Some(Instant::now() + DRAIN);
            }
            _ = tokio::time::sleep_until(drain_until.unwrap_or_else(Instant::now)), if drain_until.is_some() => {
                // Something (a grandchild) holds the pipes open: stop waiting for them.
                break;
            }
            _ = tokio::time::sleep_until(ready_by), if !ready && !timed_out && !stop_asked && status.is_none() => {
                warn!(?timeout, "the agent did not start in time");
                timed_out = true;
                let _ = child.start_kill();
            }
        }
    }
    drop(permit);
    readers.abort_all();
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
    Ended { status, exit_frame, ready, failure, tail, stopped: stop_asked }
}

