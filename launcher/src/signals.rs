//! Signals received by rsrun and what each one does (`--signal-policy`).
//!
//! torchrun turns every handled signal into a shutdown. rsrun lets each signal choose:
//! - `stop`: send the signal to every worker's process group, wait `--shutdown-timeout`, SIGKILL what
//!   is left, and exit with 128 + the signal number. A second stop signal during the grace period kills
//!   at once. One that arrives while rsrun is already stopping the workers (after a failure, a hang,
//!   or the round ending elsewhere) still ends the job: no restart, no re-join, 128 + the signal.
//! - `forward`: send the signal to every worker's process group and keep supervising (SLURM's SIGUSR1
//!   "checkpoint now" warning, for example).
//! - `ignore`: log it and do nothing.
//!
//! The default is `INT,TERM,HUP,QUIT=stop` and `USR1,USR2=forward`.

use std::collections::BTreeMap;
use std::fmt;

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// What rsrun does when it receives a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalAction {
    /// Forward, wait the shutdown grace, kill, exit 128 + signal.
    Stop,
    /// Forward to every worker and keep supervising.
    Forward,
    /// Do nothing.
    Ignore,
}

impl fmt::Display for SignalAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SignalAction::Stop => "stop",
            SignalAction::Forward => "forward",
            SignalAction::Ignore => "ignore",
        })
    }
}

/// The action for each handled signal. Signals not in the map keep their default disposition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalPolicy {
    actions: BTreeMap<i32, (Signal, SignalAction)>,
    /// Signals the user named (`--signals-to-handle`, `--signal-policy`): handled even when rsrun
    /// started with them ignored.
    given: Vec<i32>,
}

impl SignalPolicy {
    /// `INT,TERM,HUP,QUIT=stop`, `USR1,USR2=forward`.
    pub fn default_policy() -> Self {
        let mut actions = BTreeMap::new();
        for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
            actions.insert(sig as i32, (sig, SignalAction::Stop));
        }
        for sig in [Signal::SIGUSR1, Signal::SIGUSR2] {
            actions.insert(sig as i32, (sig, SignalAction::Forward));
        }
        SignalPolicy { actions, given: Vec::new() }
    }

    /// torchrun's `--signals-to-handle`: the listed signals stop the job. SIGUSR1/2 keep the default
    /// `forward` unless listed.
    ///
    /// # Errors
    /// A name that is not a signal rsrun can handle.
    pub fn with_stop_signals(mut self, list: &str) -> Result<Self, String> {
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let sig = parse_signal(name)?;
            self.actions.insert(sig as i32, (sig, SignalAction::Stop));
            self.given.push(sig as i32);
        }
        Ok(self)
    }

    /// Applies `SIG=ACTION,...` on top of this policy.
    ///
    /// # Errors
    /// A malformed entry, an unknown signal or an unknown action.
    pub fn with_overrides(mut self, spec: &str) -> Result<Self, String> {
        let mut seen = Vec::new();
        for entry in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((name, action)) = entry.split_once('=') else {
                return Err(format!("'{entry}' is not SIGNAL=ACTION"));
            };
            let sig = parse_signal(name.trim())?;
            let action = match action.trim().to_ascii_lowercase().as_str() {
                "stop" => SignalAction::Stop,
                "forward" => SignalAction::Forward,
                "ignore" => SignalAction::Ignore,
                other => {
                    return Err(format!("unknown action '{other}' for {sig} (expected stop, forward or ignore)"));
                }
            };
            if seen.contains(&sig) {
                return Err(format!("{sig} is given twice"));
            }
            seen.push(sig);
            self.actions.insert(sig as i32, (sig, action));
            self.given.push(sig as i32);
        }
        Ok(self)
    }

    /// The action for `sig`, if rsrun handles it.
    pub fn action(&self, sig: Signal) -> Option<SignalAction> {
        self.actions.get(&(sig as i32)).map(|(_, a)| *a)
    }

    /// Handled signals and their actions, ordered by signal number.
    pub fn entries(&self) -> impl Iterator<Item = (Signal, SignalAction)> + '_ {
        self.actions.values().copied()
    }
}

impl fmt::Display for SignalPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (sig, action) in self.entries() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{}={action}", sig.as_str().trim_start_matches("SIG"))?;
        }
        Ok(())
    }
}

/// Parses `SIGTERM`, `TERM`, `term` or `15`.
///
/// # Errors
/// An unknown name, or a signal that cannot be caught (SIGKILL, SIGSTOP) or that rsrun needs for
/// itself (SIGCHLD, SIGSEGV, ...).
pub fn parse_signal(name: &str) -> Result<Signal, String> {
    let sig = if let Ok(n) = name.parse::<i32>() {
        Signal::try_from(n).map_err(|_| format!("unknown signal number {n}"))?
    } else {
        let upper = name.to_ascii_uppercase();
        let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
        full.parse::<Signal>().map_err(|_| format!("unknown signal '{name}'"))?
    };
    match sig {
        Signal::SIGKILL | Signal::SIGSTOP => Err(format!("{sig} cannot be caught")),
        Signal::SIGCHLD | Signal::SIGSEGV | Signal::SIGBUS | Signal::SIGFPE | Signal::SIGILL
        | Signal::SIGPIPE | Signal::SIGTTIN | Signal::SIGTTOU | Signal::SIGTSTP | Signal::SIGCONT => {
            Err(format!("{sig} cannot be given a policy"))
        }
        _ => Ok(sig),
    }
}

/// The name of signal number `n` (`SIGSEGV`), or `signal n` when unknown.
pub fn signal_name(n: i32) -> String {
    Signal::try_from(n).map(|s| s.as_str().to_owned()).unwrap_or_else(|_| format!("signal {n}"))
}

/// A stream of the signals the policy handles, delivered with their action.
#[derive(Debug)]
pub struct Signals {
    rx: mpsc::UnboundedReceiver<(Signal, SignalAction)>,
    /// Keeps the channel open (so `recv` pends when no handler is installed) and feeds injectors.
    tx: mpsc::UnboundedSender<(Signal, SignalAction)>,
}

/// Delivers a signal to a [`Signals`] stream as if rsrun had received it: a remote agent turns its
/// head's `Control` messages (and EOF on stdin) into stop signals this way.
#[derive(Debug, Clone)]
pub struct SignalInjector {
    tx: mpsc::UnboundedSender<(Signal, SignalAction)>,
}

impl SignalInjector {
    /// Delivers `sig` with `action`; `false` when the stream is gone.
    pub fn inject(&self, sig: Signal, action: SignalAction) -> bool {
        self.tx.send((sig, action)).is_ok()
    }
}

/// Whether `sig`'s disposition is `SIG_IGN` now (as inherited, before rsrun installs handlers).
fn ignored_at_start(sig: Signal) -> bool {
    // SAFETY: sigaction with a null new action only reads the current one into `old`.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig as i32, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

impl Signals {
    /// Installs handlers for every signal in `policy`. Must run inside a tokio runtime.
    ///
    /// # Errors
    /// The OS refused a handler.
    pub fn install(policy: &SignalPolicy) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        for (sig, action) in policy.entries() {
            // SIGHUP that rsrun started with ignored (`nohup rsrun ...`, `trap '' HUP`) stays
            // ignored unless the user named it: a logout's SIGHUP tore down a nohup'd run. (Only
            // SIGHUP: a shell starts every background job with SIGINT and SIGQUIT ignored, and
            // `kill -INT` of an `rsrun ... &` must still stop it, as torchrun's handlers do.)
            if sig == Signal::SIGHUP && !policy.given.contains(&(sig as i32)) && ignored_at_start(sig) {
                tracing::info!(signal = %sig, "ignored when rsrun started (nohup?): it stays ignored");
                continue;
            }
            let mut stream = signal(SignalKind::from_raw(sig as i32))?;
            let tx = tx.clone();
            // Ends when the receiver is dropped (the send fails) or the runtime shuts down.
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send((sig, action)).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Signals { rx, tx })
    }

    /// A stream that yields only injected signals (tests, embedding).
    pub fn none() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Signals { rx, tx }
    }

    /// An injector for this stream.
    pub fn injector(&self) -> SignalInjector {
        SignalInjector { tx: self.tx.clone() }
    }

    /// The next signal received. Pends forever when no handler is installed.
    pub async fn recv(&mut self) -> (Signal, SignalAction) {
        match self.rx.recv().await {
            Some(s) => s,
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy() {
        let p = SignalPolicy::default_policy();
        assert_eq!(p.action(Signal::SIGTERM), Some(SignalAction::Stop));
        assert_eq!(p.action(Signal::SIGUSR1), Some(SignalAction::Forward));
        assert_eq!(p.action(Signal::SIGALRM), None);
        assert_eq!(p.to_string(), "HUP=stop,INT=stop,QUIT=stop,USR1=forward,USR2=forward,TERM=stop");
    }

    #[test]
    fn overrides() {
        let p = SignalPolicy::default_policy()
            .with_overrides("SIGUSR1=stop, term=ignore,12=ignore")
            .unwrap();
        assert_eq!(p.action(Signal::SIGUSR1), Some(SignalAction::Stop));
        assert_eq!(p.action(Signal::SIGTERM), Some(SignalAction::Ignore));
        assert_eq!(p.action(Signal::SIGUSR2), Some(SignalAction::Ignore));
        assert!(SignalPolicy::default_policy().with_overrides("USR1").is_err());
        assert!(SignalPolicy::default_policy().with_overrides("USR1=maybe").is_err());
        assert!(SignalPolicy::default_policy().with_overrides("KILL=stop").is_err());
        assert!(SignalPolicy::default_policy().with_overrides("NOPE=stop").is_err());
    }

    #[test]
    fn stop_signals() {
        let p = SignalPolicy::default_policy().with_stop_signals("SIGUSR2,SIGTERM").unwrap();
        assert_eq!(p.action(Signal::SIGUSR2), Some(SignalAction::Stop));
        assert_eq!(signal_name(11), "SIGSEGV");
    }
}
