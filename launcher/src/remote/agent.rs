//! The agent side: `rsrun agent --stdin`, started by the head on each host.
//!
//! The binary calls, in order and before any thread starts:
//! 1. [`read_launch`]: the first frame on stdin, a `NodeLaunch`, version-checked (within
//!    [`LAUNCH_WAIT`]);
//! 2. [`prepare`]: enter the cwd, set the forwarded environment, write the token and the TLS CA to
//!    private files, and resolve this node's [`LaunchPlan`] with rsrun's own parser and validation. A failure is
//!    one line for the head (`cwd /x does not exist on w2`), and exit 2;
//! 3. it says `AgentReady` (with its host identity) and waits for the head's word ([`wait_for_start`]):
//!    `Control{START}` once every host is ready and the identities were checked; STOP (a refusal, or
//!    `--check`) or EOF ends it with exit 0 before anything started; no word within the plan's
//!    `start_wait_secs` (the head is unreachable) ends it with exit 2;
//! 4. then it runs the ordinary agent ([`crate::agent::run`], daemon-backed rendezvous) with its
//!    console going to stdout as `AgentEvent` frames ([`console_loop`]), and a reader of the rest of
//!    stdin ([`control_loop`]) that turns `Control{STOP}`, `Control{FORCE}` and EOF into stop signals.
//!    EOF means the head is gone (`kill -9` included): the workers get the stop signal, the shutdown
//!    grace, then SIGKILL, exactly as on Ctrl-C.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use prost::Message;
use rsrun_rendezvous::proto::{AgentEvent, ConsoleLine, Control, NodeLaunch, agent_event, console_line, control};
use tokio::sync::mpsc;

use crate::cli::LaunchArgs;
use crate::logs::ConsoleEvent;
use crate::plan::{HostInfo, LaunchPlan};
use crate::signals::{SignalAction, SignalInjector};

use super::plan::{NodePlace, agent_argv};
use super::wire::{decode_launch, read_frame, write_frame};

/// How long an agent waits for its launch plan on stdin (the head writes it as soon as ssh runs).
pub const LAUNCH_WAIT: Duration = Duration::from_secs(300);
/// How long an agent waits for START after `AgentReady` when the plan does not say.
pub const START_WAIT: Duration = Duration::from_secs(600);

/// Reads a file descriptor (stdin) directly, each read waiting at most until a deadline: a head that
/// is unreachable before START does not keep an agent (and its token file) waiting for hours.
/// Unbuffered: nothing past a frame is taken from the stream, which later readers (std's `Stdin`)
/// read on.
#[derive(Debug)]
pub struct DeadlineReader<'a> {
    fd: BorrowedFd<'a>,
    deadline: Instant,
    limit: Duration,
}

impl<'a> DeadlineReader<'a> {
    /// Reads `fd` until `limit` from now.
    pub fn new(fd: BorrowedFd<'a>, limit: Duration) -> Self {
        DeadlineReader { fd, deadline: Instant::now() + limit, limit }
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("nothing came within {:.0}s", self.limit.as_secs_f64()),
                ));
            }
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                continue;
            }
            // Readable, or hung up (the read says EOF).
            match nix::unistd::read(self.fd, buf) {
                Ok(n) => return Ok(n),
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// Reads and checks the `NodeLaunch` (blocking; give a [`DeadlineReader`] to bound the wait).
///
/// # Errors
/// EOF before the message, a read error (the deadline passed), or a message this rsrun refuses (see
/// [`super::wire::decode_launch`]); the text is meant for the head.
pub fn read_launch(stdin: &mut impl Read, this_host: &str) -> Result<NodeLaunch, String> {
    match read_frame(stdin) {
        Ok(Some(buf)) => decode_launch(&buf, this_host),
        Ok(None) => Err("stdin closed before the launch plan arrived".into()),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            Err(format!("no launch plan on stdin: {e} (is the head unreachable from {this_host}?)"))
        }
        Err(e) => Err(format!("cannot read the launch plan from stdin: {e}")),
    }
}

/// How long this agent waits for START (`start_wait_secs` of the plan, else [`START_WAIT`]).
pub fn start_wait(launch: &NodeLaunch) -> Duration {
    match launch.start_wait_secs {
        0 => START_WAIT,
        s => Duration::from_secs(u64::from(s)),
    }
}

/// A private directory removed on drop (the token file lives there).
#[derive(Debug)]
pub struct PrivateDir(PathBuf);

impl PrivateDir {
    /// Creates `$TMPDIR/PREFIX-PID-RANDOM`, accessible to this user only.
    ///
    /// # Errors
    /// The directory cannot be created.
    pub(crate) fn create(prefix: &str) -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), crate::plan::random_id()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(PrivateDir(dir))
    }

    /// Writes `name` readable by this user only.
    pub(crate) fn write(&self, name: &str, contents: &[u8]) -> std::io::Result<PathBuf> {
        let p = self.0.join(name);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&p)?;
        f.write_all(contents)?;
        Ok(p)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// This node's plan, ready to run.
#[derive(Debug)]
pub struct PreparedAgent {
    /// The resolved plan.
    pub plan: LaunchPlan,
    /// The host as the head names it.
    pub host: String,
    /// This agent's node id at the rendezvous.
    pub node_id: String,
    /// Holds the token and TLS CA files for the agent's lifetime.
    pub private_dir: Option<PrivateDir>,
    /// GPUs this host shows the agent.
    pub gpus: u32,
    /// The rendezvous service lives in the head (it is gone when stdin reaches EOF).
    pub rdzv_in_head: bool,
}

/// Applies `launch` to this process and resolves the node's plan (see the module docs).
///
/// # Safety
/// Sets environment variables: the process must be single-threaded.
///
/// # Errors
/// A missing cwd, an unusable token directory, or a plan this host rejects, as one line naming the
/// host.
pub unsafe fn prepare(launch: &NodeLaunch) -> Result<PreparedAgent, String> {
    let host = &launch.host;
    let cwd = Path::new(&launch.cwd);
    if let Err(e) = std::env::set_current_dir(cwd) {
        return Err(format!(
            "cwd {} does not exist on {host} ({e}); run from a directory every host has (a shared file system), or pass --chdir DIR",
            cwd.display()
        ));
    }
    for (k, v) in &launch.env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains(&0) {
            return Err(format!("invalid variable {k:?} in the launch plan"));
        }
        // SAFETY: the caller guarantees that no other thread runs.
        unsafe { std::env::set_var(k, OsStr::from_bytes(v)) };
    }
    if let Some(d) = &launch.devices {
        let inherited = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let list = visible_devices(&d.ids, inherited.as_deref(), host)?;
        // SAFETY: as above.
        unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", list) };
    }
    let secrets = write_secrets(launch)?;
    let place = NodePlace {
        nnodes: launch.nnodes,
        nproc_per_node: &launch.nproc_per_node,
        node_rank: launch.node_rank,
        endpoint: &launch.rdzv_endpoint,
        job_id: &launch.job_id,
        token_file: secrets.token_file.as_deref(),
        tls_ca_file: secrets.tls_ca_file.as_deref(),
    };
    let argv = agent_argv(&launch.options, place, &launch.program);
    let info = HostInfo::probe();
    let plan = node_plan(argv, &info, host)?;
    let node_id = crate::plan::node_id(&plan.hostname, std::process::id());
    Ok(PreparedAgent { plan, host: host.clone(), node_id, private_dir: secrets.dir, gpus: info.gpus, rdzv_in_head: launch.rdzv_in_head })
}

/// The `CUDA_VISIBLE_DEVICES` for the slots `ids` that `--include`/`--exclude` picked: slot `i`
/// is entry `i` of the host's own list when it has one (an allocation's `4,5,6,7`, or UUIDs), the
/// device `i` otherwise.
///
/// # Errors
/// A slot past the end of the host's list, naming both.
pub(crate) fn visible_devices(ids: &[u32], inherited: Option<&str>, host: &str) -> Result<String, String> {
    let Some(own) = inherited.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    };
    let entries: Vec<&str> = own.split(',').map(str::trim).collect();
    let picked: Result<Vec<&str>, String> = ids
        .iter()
        .map(|&i| {
            entries.get(i as usize).copied().ok_or_else(|| {
                format!(
                    "--include/--exclude picks slot {i} on {host}, but its CUDA_VISIBLE_DEVICES={own:?} lists {} devices (slot i is its entry i)",
                    entries.len()
                )
            })
        })
        .collect();
    Ok(picked?.join(","))
}

/// The token and the TLS CA of a launch plan, in files only this user can read.
#[derive(Debug)]
struct Secrets {
    /// Holds the files; removed on drop.
    dir: Option<PrivateDir>,
    token_file: Option<PathBuf>,
    tls_ca_file: Option<PathBuf>,
}

/// Writes the token and the TLS CA of `launch` (those it has) to a new private directory (0700,
/// files 0600).
///
/// # Errors
/// The directory or a file cannot be written, as one line naming the host.
fn write_secrets(launch: &NodeLaunch) -> Result<Secrets, String> {
    let host = &launch.host;
    let mut s = Secrets { dir: None, token_file: None, tls_ca_file: None };
    if launch.token.is_empty() && launch.rdzv_tls_ca.is_empty() {
        return Ok(s);
    }
    let dir = PrivateDir::create("rsrun-agent").map_err(|e| format!("cannot create a private directory for the token on {host}: {e}"))?;
    if !launch.token.is_empty() {
        let f = dir
            .write("token", format!("{}\n", launch.token).as_bytes())
            .map_err(|e| format!("cannot write the token file on {host}: {e}"))?;
        s.token_file = Some(f);
    }
    if !launch.rdzv_tls_ca.is_empty() {
        let f = dir.write("ca.pem", &launch.rdzv_tls_ca).map_err(|e| format!("cannot write the TLS CA file on {host}: {e}"))?;
        s.tls_ca_file = Some(f);
    }
    s.dir = Some(dir);
    Ok(s)
}

/// Resolves this node's plan from the head's `argv` ([`agent_argv`]) on `info`; `host` names the host
/// in errors.
fn node_plan(argv: Vec<String>, info: &HostInfo, host: &str) -> Result<LaunchPlan, String> {
    let mut args = LaunchArgs::try_parse_with_origins_from(std::iter::once("rsrun".to_owned()).chain(argv))
        .map_err(|e| format!("invalid options on {host}: {}", e.to_string().lines().next().unwrap_or("")))?;
    // Whatever this host's environment says (RSRUN_* variables are forwarded), this process is an
    // agent, never a head: the head's own options do not apply here.
    args.hosts = None;
    args.hostfile = None;
    args.dry_run = false;
    args.check = false;
    // The head chose the rendezvous (--rdzv-endpoint in `argv`): a PET_STANDALONE here does not apply.
    args.standalone = false;
    // The head placed this node (node rank, nnodes, nproc, rendezvous): the cluster variables of this
    // host (PET_MASTER_*, SLURM_*) are not read.
    let mut plan = LaunchPlan::resolve_agent(&args, info).map_err(|e| format!("{e} (on {host})"))?;
    // The head chose the node rank (the host order); saying so on every host is noise.
    plan.notes.retain(|n| !n.starts_with("--node-rank "));
    Ok(plan)
}

/// The head's word after `AgentReady`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Go {
    /// Join the rendezvous and start the workers.
    Start,
    /// Stop without starting anything: `--check`, a refused host list, or the head is gone (EOF).
    Stop,
    /// No word from the head in time (given a [`DeadlineReader`]): stop without starting anything,
    /// as a start failure.
    TimedOut,
}

/// Waits (blocking) for `Control{START}` after `AgentReady`. STOP, FORCE, EOF, a read error or a
/// message that is not a `Control` mean [`Go::Stop`]; the reader's deadline, [`Go::TimedOut`].
pub fn wait_for_start(stdin: &mut impl Read) -> Go {
    match read_frame(stdin) {
        Ok(Some(frame)) => match Control::decode(frame.as_slice()) {
            Ok(c) if c.action() == control::Action::Start => Go::Start,
            Ok(c) => {
                tracing::info!(action = ?c.action(), "the head says stop before the start");
                Go::Stop
            }
            Err(err) => {
                tracing::warn!(%err, "not a Control message after the launch plan; stopping");
                Go::Stop
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Go::TimedOut,
        Ok(None) | Err(_) => {
            tracing::info!("stdin closed before the start: the head is gone");
            Go::Stop
        }
    }
}

/// Writes one event frame; errors (the head is gone) are ignored: EOF on stdin follows.
pub fn send(out: &mut impl Write, event: agent_event::Event) {
    let _ = write_frame(out, &AgentEvent { event: Some(event) });
}

/// The agent's console: each event becomes an `AgentEvent` frame on `out` (the agent's stdout). The
/// rendezvous status line is not sent: the head shows the job's progress itself.
pub fn console_loop(mut rx: mpsc::Receiver<ConsoleEvent>, mut out: impl Write) {
    let mut buf = Vec::with_capacity(64 * 1024);
    while let Some(first) = rx.blocking_recv() {
        let mut ev = Some(first);
        while let Some(e) = ev.take() {
            let event = match e {
                ConsoleEvent::Stdout(data) => {
                    Some(agent_event::Event::Line(ConsoleLine { stream: console_line::Stream::Stdout as i32, data }))
                }
                ConsoleEvent::Stderr(data) => {
                    Some(agent_event::Event::Line(ConsoleLine { stream: console_line::Stream::Stderr as i32, data }))
                }
                // The agent's console is a pipe to the head (plain mode), so progress arrives as
                // ordinary lines; should a drawn line reach here, its final state is sent as a line.
                ConsoleEvent::Progress { stream, mut text, done: true, .. } => {
                    text.push(b'\n');
                    let stream = match stream {
                        crate::logs::StreamKind::Stdout => console_line::Stream::Stdout,
                        crate::logs::StreamKind::Stderr => console_line::Stream::Stderr,
                    };
                    Some(agent_event::Event::Line(ConsoleLine { stream: stream as i32, data: text }))
                }
                ConsoleEvent::Note(text) => Some(agent_event::Event::Note(text)),
                ConsoleEvent::Progress { .. } | ConsoleEvent::Status(_) | ConsoleEvent::StatusDone => None,
            };
            if let Some(event) = event {
                // Encoding into a Vec cannot fail (it grows as needed).
                let _ = AgentEvent { event: Some(event) }.encode_length_delimited(&mut buf);
            }
            // Batch what is already queued into one write.
            if buf.len() < 256 * 1024 {
                ev = rx.try_recv().ok();
            }
        }
        if !buf.is_empty() {
            let _ = out.write_all(&buf).and_then(|_| out.flush());
            buf.clear();
        }
    }
}

/// Reads `Control` frames after `START` until EOF, turning them into stop signals: STOP is one stop
/// signal (the head's, SIGTERM by default), FORCE is two (the second kills at once), and EOF — the
/// head is gone — is one SIGTERM stop, after cancelling `head_gone`. Returns at EOF or when the
/// injector's stream is gone.
pub fn control_loop(stdin: &mut impl Read, injector: &SignalInjector, head_gone: &tokio_util::sync::CancellationToken) {
    loop {
        let frame = match read_frame(stdin) {
            Ok(Some(f)) => f,
            Ok(None) | Err(_) => {
                tracing::info!("stdin closed: the head is gone; stopping the workers");
                head_gone.cancel();
                injector.inject(Signal::SIGTERM, SignalAction::Stop);
                return;
            }
        };
        let Ok(c) = Control::decode(frame.as_slice()) else {
            tracing::warn!("ignoring a message on stdin that is not a Control");
            continue;
        };
        let sig = Signal::try_from(c.signal).ok().filter(|s| *s != Signal::SIGKILL).unwrap_or(Signal::SIGTERM);
        let ok = match c.action() {
            control::Action::Stop => {
                tracing::info!(signal = %sig, "the head asks to stop");
                injector.inject(sig, SignalAction::Stop)
            }
            control::Action::Force => {
                tracing::info!("the head asks to kill the workers now");
                injector.inject(sig, SignalAction::Stop) && injector.inject(sig, SignalAction::Stop)
            }
            control::Action::Forward => match Signal::try_from(c.signal) {
                // What the head's --signal-policy passes on (never SIGKILL or SIGSTOP, which no
                // handler receives).
                Ok(s) if !matches!(s, Signal::SIGKILL | Signal::SIGSTOP) => {
                    tracing::info!(signal = %s, "the head passes a signal on to the workers");
                    injector.inject(s, SignalAction::Forward)
                }
                _ => {
                    tracing::warn!(signal = c.signal, "ignoring a FORWARD of a signal that is not one to pass on");
                    true
                }
            },
            control::Action::Start | control::Action::Unspecified => true,
        };
        if !ok {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signals::Signals;

    /// Slot i is entry i of the host's own CUDA_VISIBLE_DEVICES (an allocation's devices, or
    /// UUIDs); without one it is device i; a slot past the list is named.
    #[test]
    fn picked_slots_map_through_the_hosts_own_device_list() {
        assert_eq!(visible_devices(&[0, 2], None, "w1").unwrap(), "0,2");
        assert_eq!(visible_devices(&[0, 2], Some(""), "w1").unwrap(), "0,2");
        assert_eq!(visible_devices(&[1], Some("4,5,6,7"), "w1").unwrap(), "5");
        assert_eq!(visible_devices(&[0, 3], Some("GPU-aa, GPU-bb,GPU-cc,GPU-dd"), "w1").unwrap(), "GPU-aa,GPU-dd");
        let e = visible_devices(&[2], Some("4,5"), "w1").unwrap_err();
        assert!(e.contains("slot 2 on w1") && e.contains("CUDA_VISIBLE_DEVICES=\"4,5\" lists 2 devices"), "{e}");
    }

    #[tokio::test]
    async fn control_messages_and_eof_become_stop_signals() {
        let mut signals = Signals::none();
        let injector = signals.injector();
        // A forwarded SIGUSR1 (a Slurm preemption warning at the head) reaches the workers and
        // stops nothing; a FORWARD of SIGKILL is ignored.
        let mut bytes = super::super::wire::encode(&Control { action: control::Action::Forward as i32, signal: Signal::SIGUSR1 as i32 });
        bytes.extend(super::super::wire::encode(&Control { action: control::Action::Forward as i32, signal: Signal::SIGKILL as i32 }));
        bytes.extend(super::super::wire::encode(&Control { action: control::Action::Stop as i32, signal: 2 }));
        bytes.extend(super::super::wire::encode(&Control { action: control::Action::Force as i32, signal: 0 }));
        let gone = tokio_util::sync::CancellationToken::new();
        control_loop(&mut std::io::Cursor::new(bytes), &injector, &gone);
        assert!(gone.is_cancelled(), "EOF: the head is gone");
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(signals.recv().await);
        }
        assert_eq!(
            got,
            [
                (Signal::SIGUSR1, SignalAction::Forward),
                (Signal::SIGINT, SignalAction::Stop),
                (Signal::SIGTERM, SignalAction::Stop),
                (Signal::SIGTERM, SignalAction::Stop),
                (Signal::SIGTERM, SignalAction::Stop), // EOF
            ]
        );
    }

    #[test]
    fn only_start_starts() {
        let frame = |a: control::Action| super::super::wire::encode(&Control { action: a as i32, signal: 0 });
        assert_eq!(wait_for_start(&mut std::io::Cursor::new(frame(control::Action::Start))), Go::Start);
        assert_eq!(wait_for_start(&mut std::io::Cursor::new(frame(control::Action::Stop))), Go::Stop);
        assert_eq!(wait_for_start(&mut std::io::Cursor::new(frame(control::Action::Force))), Go::Stop);
        assert_eq!(wait_for_start(&mut std::io::Cursor::new(Vec::new())), Go::Stop, "EOF");
        assert_eq!(wait_for_start(&mut std::io::Cursor::new(vec![2, 0xff, 0xff])), Go::Stop, "garbage");
    }

    /// A head that is unreachable before START does not keep the agent waiting: reading the plan,
    /// and waiting for START, end at their deadline, with an error that says so.
    #[test]
    fn reading_stdin_before_start_has_a_deadline() {
        use std::os::fd::AsFd;
        let (r, w) = nix::unistd::pipe().unwrap();
        let started = Instant::now();
        let err = read_launch(&mut DeadlineReader::new(r.as_fd(), Duration::from_millis(200)), "w2").unwrap_err();
        assert_eq!(err, "no launch plan on stdin: nothing came within 0s (is the head unreachable from w2?)");
        assert_eq!(wait_for_start(&mut DeadlineReader::new(r.as_fd(), Duration::from_millis(200))), Go::TimedOut);
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(400) && took < Duration::from_secs(5), "{took:?}");
        // In time: the plan, then START, read without taking a byte past either (the rest of the
        // stream is the control loop's).
        let launch = NodeLaunch {
            protocol_version: super::super::wire::NODE_LAUNCH_PROTOCOL,
            rsrun_version: super::super::wire::RSRUN_VERSION.into(),
            host: "w2".into(),
            start_wait_secs: 7,
            ..Default::default()
        };
        let mut bytes = super::super::wire::encode(&launch);
        bytes.extend(super::super::wire::encode(&Control { action: control::Action::Start as i32, signal: 0 }));
        bytes.extend(super::super::wire::encode(&Control { action: control::Action::Stop as i32, signal: 2 }));
        nix::unistd::write(&w, &bytes).unwrap();
        let got = read_launch(&mut DeadlineReader::new(r.as_fd(), Duration::from_secs(5)), "w2").unwrap();
        assert_eq!(got, launch);
        assert_eq!(start_wait(&got), Duration::from_secs(7));
        assert_eq!(start_wait(&NodeLaunch::default()), START_WAIT);
        assert_eq!(wait_for_start(&mut DeadlineReader::new(r.as_fd(), Duration::from_secs(5))), Go::Start);
        drop(w);
        let rest = read_frame(&mut std::fs::File::from(r)).unwrap().unwrap();
        assert_eq!(Control::decode(rest.as_slice()).unwrap().action(), control::Action::Stop);
    }

    #[test]
    fn a_missing_cwd_names_the_host() {
        let launch = NodeLaunch { host: "w2".into(), cwd: "/nonexistent/rsrun-test".into(), ..Default::default() };
        // SAFETY: prepare returns at the cwd check, before it touches the environment.
        let err = unsafe { prepare(&launch) }.unwrap_err();
        assert!(err.starts_with("cwd /nonexistent/rsrun-test does not exist on w2"), "{err}");
    }

    /// The head placed the node: cluster variables in this host's environment (a pod's PET_MASTER_*,
    /// Slurm's SLURM_*) do not replace its rendezvous or worker count, and the log filters name ranks
    /// of the whole job (hosts a:8,b:2: local rank 5 exists on a, not on this node b).
    #[test]
    fn the_heads_options_win_over_this_hosts_cluster_variables() {
        let mut info = crate::plan::tests::host();
        for (k, v) in [
            ("PET_MASTER_ADDR", "pod-master-0"),
            ("PET_MASTER_PORT", "23456"),
            ("PET_NODE_RANK", "0"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_JOB_NUM_NODES", "4"),
            ("SLURM_GPUS_ON_NODE", "8"),
        ] {
            info.env.insert(k.into(), v.into());
        }
        let place = NodePlace {
            nnodes: 2,
            nproc_per_node: "2",
            node_rank: 1,
            endpoint: "10.0.0.1:29400",
            job_id: "ssh-head-1-2",
            token_file: None,
            tls_ca_file: None,
        };
        let argv = agent_argv(&["--local-ranks-filter=5".into(), "--rdzv-conf=is_host=false".into()], place, &["true".into()]);
        let plan = node_plan(argv, &info, "b").unwrap();
        assert_eq!(plan.mode, crate::multinode::LaunchMode::Rendezvous);
        assert_eq!(
            plan.rdzv,
            crate::plan::RdzvPlan::Daemon {
                endpoint: crate::plan::Endpoint { host: "10.0.0.1".into(), port: 29400 },
                host: crate::plan::HostMode::Never
            }
        );
        assert_eq!(plan.nproc_per_node, 2);
        assert_eq!(plan.rank_hint, Some(1));
        assert_eq!(plan.job_id, "ssh-head-1-2");
    }

    /// The TLS CA of the launch plan becomes a private file that the node plan verifies the daemon
    /// with; the token file sits beside it; both go with the directory.
    #[test]
    fn the_tls_ca_and_the_token_become_private_files() {
        use std::os::unix::fs::PermissionsExt;
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap().pem();
        let launch = NodeLaunch { host: "w2".into(), token: "0123456789abcdef".into(), rdzv_tls_ca: pem.clone().into_bytes(), ..Default::default() };
        let secrets = write_secrets(&launch).unwrap();
        let (token, ca) = (secrets.token_file.clone().unwrap(), secrets.tls_ca_file.clone().unwrap());
        assert_eq!(std::fs::read_to_string(&ca).unwrap(), pem);
        assert_eq!(std::fs::read_to_string(&token).unwrap(), "0123456789abcdef\n");
        for f in [&token, &ca] {
            assert_eq!(std::fs::metadata(f).unwrap().permissions().mode() & 0o777, 0o600, "{}", f.display());
        }
        let place = NodePlace {
            nnodes: 1,
            nproc_per_node: "1",
            node_rank: 0,
            endpoint: "10.0.0.1:29400",
            job_id: "j",
            token_file: secrets.token_file.as_deref(),
            tls_ca_file: secrets.tls_ca_file.as_deref(),
        };
        let plan = node_plan(agent_argv(&["--rdzv-conf=is_host=false".into()], place, &["true".into()]), &crate::plan::tests::host(), "w2").unwrap();
        assert_eq!(plan.tls_ca.as_deref(), Some(ca.as_path()));
        drop(secrets);
        assert!(!ca.exists() && !token.exists(), "removed with the agent");
        // Neither: no directory at all.
        assert!(write_secrets(&NodeLaunch::default()).unwrap().dir.is_none());
    }

    #[test]
    fn console_events_become_frames() {
        let (tx, rx) = mpsc::channel(8);
        tx.try_send(ConsoleEvent::Stdout(b"[rank 0] hi\n".to_vec())).unwrap();
        tx.try_send(ConsoleEvent::Status("waiting".into())).unwrap();
        tx.try_send(ConsoleEvent::Note("note".into())).unwrap();
        drop(tx);
        let mut out = Vec::new();
        console_loop(rx, &mut out);
        let mut r = std::io::Cursor::new(out);
        let e1 = AgentEvent::decode(read_frame(&mut r).unwrap().unwrap().as_slice()).unwrap();
        assert_eq!(
            e1.event,
            Some(agent_event::Event::Line(ConsoleLine { stream: console_line::Stream::Stdout as i32, data: b"[rank 0] hi\n".to_vec() }))
        );
        let e2 = AgentEvent::decode(read_frame(&mut r).unwrap().unwrap().as_slice()).unwrap();
        assert_eq!(e2.event, Some(agent_event::Event::Note("note".into())));
        assert!(read_frame(&mut r).unwrap().is_none());
    }
}
