//! Why a host's agent did not start, in one line, from ssh's exit code and last stderr lines.
//!
//! | stderr contains | classified as |
//! |---|---|
//! | `Permission denied (publickey` | authentication |
//! | `REMOTE HOST IDENTIFICATION HAS CHANGED` | changed host key |
//! | `Host key verification failed` / `host key is known` | unknown host key |
//! | `Could not resolve hostname` | DNS |
//! | `Connection refused` | no sshd / wrong port |
//! | `Connection timed out` / `No route to host` / `Network is unreachable` | network |
//! | `kex_exchange_identification` | sshd overload (MaxStartups): **retried** |
//! | exit 127, or `not found` / `No such file` | rsrun missing at that path |
//! | anything else | ssh error, with the last stderr line verbatim |

/// Retries of a connection that sshd dropped during the key exchange (MaxStartups).
pub const KEX_RETRIES: u32 = 4;

/// The wait before retry `attempt` (1-based) of a dropped key exchange, from a uniform draw `u` in
/// [0, 1): exponential with jitter, `250 ms · 2^(attempt-1) · (1 + u)` (250-500 ms, 0.5-1 s, 1-2 s,
/// 2-4 s). Retries spread out, so they do not meet sshd's throttle again all at once.
pub fn kex_backoff(attempt: u32, u: f64) -> std::time::Duration {
    let base = 0.25 * f64::from(1u32 << attempt.clamp(1, 8).saturating_sub(1));
    std::time::Duration::from_secs_f64(base * (1.0 + u.clamp(0.0, 1.0)))
}

/// How a start failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartFailure {
    /// Public-key authentication refused.
    Auth(String),
    /// No key for the host in known_hosts (strict checking).
    UnknownHostKey(String),
    /// The host's key differs from the one in known_hosts.
    ChangedHostKey(String),
    /// The name does not resolve.
    Dns(String),
    /// Nothing listens at the ssh port.
    Refused(String),
    /// Timed out or unreachable.
    Network(String),
    /// sshd dropped the connection during the key exchange, on every attempt.
    Kex(String),
    /// The remote shell found no rsrun at the path.
    RsrunNotFound(String),
    /// The agent started and refused its plan (its own message).
    Agent(String),
    /// No sign of life from the agent before the start deadline.
    Timeout(std::time::Duration),
    /// Anything else.
    Other {
        /// The exit code (`None`: killed by a signal).
        code: Option<i32>,
        /// The last stderr line.
        last: String,
    },
}

/// Classifies a failed start from the exit code and stderr.
pub fn classify(code: Option<i32>, stderr: &[String]) -> StartFailure {
    let find = |needles: &[&str]| -> Option<String> {
        stderr.iter().rev().find(|l| needles.iter().any(|n| l.contains(n))).map(|l| l.trim().to_owned())
    };
    // ssh's "Permission denied (publickey,password)." names the methods it tried; an OS error
    // ("Permission denied (os error 13)") is no authentication failure.
    if let Some(l) = find(&["Permission denied (publickey", "Permission denied (password", "Permission denied (keyboard", "Permission denied (gssapi", "Permission denied (hostbased"]) {
        // "root@h: Permission denied (publickey)." → "Permission denied (publickey)".
        let start = l.find("Permission denied").unwrap_or(0);
        return StartFailure::Auth(l[start..].trim_end_matches('.').to_owned());
    }
    // OpenSSH prints the banner first and "Host key verification failed." last: the banner decides.
    if stderr.iter().any(|l| l.contains("REMOTE HOST IDENTIFICATION HAS CHANGED")) {
        return StartFailure::ChangedHostKey("REMOTE HOST IDENTIFICATION HAS CHANGED".to_owned());
    }
    if let Some(l) = find(&["Host key verification failed", "host key is known"]) {
        return StartFailure::UnknownHostKey(l.trim_end_matches('.').to_owned());
    }
    if let Some(l) = find(&["Could not resolve hostname"]) {
        return StartFailure::Dns(l);
    }
    if let Some(l) = find(&["Connection refused"]) {
        return StartFailure::Refused(l);
    }
    if let Some(l) = find(&["Connection timed out", "No route to host", "Network is unreachable", "Operation timed out"]) {
        return StartFailure::Network(l);
    }
    if let Some(l) = find(&["kex_exchange_identification"]) {
        return StartFailure::Kex(l);
    }
    if code == Some(127) || code == Some(126) {
        let last = find(&["not found", "No such file", "Permission denied"]).or_else(|| stderr.last().cloned()).unwrap_or_default();
        return StartFailure::RsrunNotFound(last);
    }
    StartFailure::Other { code, last: stderr.iter().rev().find(|l| !l.trim().is_empty()).cloned().unwrap_or_default() }
}

/// Whether the failure is worth another attempt.
pub fn is_retryable(f: &StartFailure) -> bool {
    matches!(f, StartFailure::Kex(_))
}

/// Where ssh connected: the address (`addr=`, else the host name) and the port when not 22.
#[derive(Debug, Clone, Copy)]
pub struct SshTarget<'a> {
    /// The address ssh was given.
    pub addr: &'a str,
    /// `port=` of the host, else `--ssh-port`.
    pub port: Option<u16>,
}

impl SshTarget<'_> {
    /// For a host name: where the ssh config may send it instead (`HostName`, `Port`).
    fn config_hint(&self) -> String {
        if self.addr.parse::<std::net::IpAddr>().is_ok() {
            return String::new();
        }
        format!(
            " (if an ssh config maps {0} to another HostName or Port, scan those: `ssh -G {0}` prints them)",
            super::command::shell_quote(self.addr)
        )
    }

    /// `ssh-keyscan` for this address and port, and the known_hosts entry name (`[addr]:port`).
    fn keyscan(&self) -> (String, String) {
        let addr = super::command::shell_quote(self.addr);
        match self.port.filter(|p| *p != 22) {
            Some(p) => (format!("ssh-keyscan -p {p} -H {addr}"), super::command::shell_quote(&format!("[{}]:{p}", self.addr))),
            None => (format!("ssh-keyscan -H {addr}"), addr),
        }
    }
}

/// The one line printed for a host that did not start (`host`: its label in the hostfile).
pub fn describe(host: &str, target: SshTarget<'_>, f: &StartFailure, rsrun: &str, connect_timeout: std::time::Duration) -> String {
    match f {
        StartFailure::Auth(l) => format!("{host}: ssh authentication failed ({l})"),
        StartFailure::UnknownHostKey(l) => {
            let (scan, _) = target.keyscan();
            let hint = target.config_hint();
            format!(
                "{host}: unknown ssh host key ({l}): add it with `{scan} >> ~/.ssh/known_hosts`{hint} after checking the fingerprint, or pass --ssh-option StrictHostKeyChecking=accept-new"
            )
        }
        StartFailure::ChangedHostKey(l) => {
            let (scan, entry) = target.keyscan();
            let hint = target.config_hint();
            format!(
                "{host}: the ssh host key CHANGED ({l}): this may be an attack, or the host was reinstalled; once its new key is verified, replace the old one with `ssh-keygen -R {entry} && {scan} >> ~/.ssh/known_hosts`{hint}"
            )
        }
        StartFailure::Dns(l) => format!("{host}: cannot resolve the host name ({l})"),
        StartFailure::Refused(l) => format!("{host}: connection refused: no sshd listening there, or a wrong --ssh-port ({l})"),
        StartFailure::Network(l) => {
            format!("{host}: host unreachable or timed out (ConnectTimeout={}s) ({l})", connect_timeout.as_secs())
        }
        StartFailure::Kex(l) => format!(
            "{host}: sshd dropped the connection during the key exchange {} times ({l}); raise MaxStartups in sshd_config",
            KEX_RETRIES + 1
        ),
        StartFailure::RsrunNotFound(l) => format!(
            "{host}: rsrun not found at {rsrun} on {host} ({l}); install the same rsrun there or pass --remote-rsrun PATH"
        ),
        StartFailure::Agent(m) => format!("{host}: {m}"),
        StartFailure::Timeout(d) => format!("{host}: the agent did not start within {:.0}s", d.as_secs_f64()),
        StartFailure::Other { code, last } => {
            let why = if last.trim().is_empty() {
                "nothing on stderr: does the ssh command (or --rsh) run its arguments on the host?".to_owned()
            } else {
                last.clone()
            };
            match code {
                Some(c) => format!("{host}: the agent exited with code {c} before starting ({why})"),
                None => format!("{host}: the agent was killed before starting ({why})"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    #[test]
    fn openssh_messages() {
        let t = std::time::Duration::from_secs(10);
        let to = SshTarget { addr: "h2", port: None };
        let c = |code, s: &str| describe("h2", to, &classify(code, &lines(s)), "/opt/rsrun", t);
        assert_eq!(c(Some(255), "h2: Permission denied (publickey)."), "h2: ssh authentication failed (Permission denied (publickey))");
        assert_eq!(
            c(Some(255), "root@127.0.0.1: Permission denied (publickey,password)."),
            "h2: ssh authentication failed (Permission denied (publickey,password))"
        );
        let k = c(
            Some(255),
            "No ED25519 host key is known for [127.0.0.1]:2222 and you have requested strict checking.\nHost key verification failed.",
        );
        assert!(k.starts_with("h2: unknown ssh host key (Host key verification failed)") && k.contains("`ssh-keyscan -H h2 >> ~/.ssh/known_hosts`"), "{k}");
        // The address and port ssh used, not the host's label: the entry must be [addr]:port.
        let failure = classify(Some(255), &lines("Host key verification failed."));
        let at = SshTarget { addr: "127.0.0.1", port: Some(2222) };
        let k = describe("h2", at, &failure, "/opt/rsrun", t);
        assert!(k.contains("`ssh-keyscan -p 2222 -H 127.0.0.1 >> ~/.ssh/known_hosts` after"), "{k}");
        // A name may be mapped by an ssh config: say how to see where to.
        assert!(c(Some(255), "Host key verification failed.").contains("`ssh -G h2` prints them"));
        let changed = classify(
            Some(255),
            &lines("@@@@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n@@@@@@@\nIT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\nHost key verification failed."),
        );
        assert!(matches!(changed, StartFailure::ChangedHostKey(_)), "{changed:?}");
        let k = describe("h2", at, &changed, "/opt/rsrun", t);
        assert!(k.contains("CHANGED") && k.contains("`ssh-keygen -R '[127.0.0.1]:2222' && ssh-keyscan -p 2222 -H 127.0.0.1 >> ~/.ssh/known_hosts`"), "{k}");
        assert!(!k.contains("accept-new"), "accept-new does not replace a changed key: {k}");
        assert!(c(Some(255), "ssh: connect to host 127.0.0.1 port 2299: Connection refused").contains("connection refused"));
        assert!(c(Some(255), "ssh: connect to host 10.77.0.2 port 22: Connection timed out").contains("ConnectTimeout=10s"));
        assert!(c(Some(255), "ssh: Could not resolve hostname nope: Name or service not known").contains("cannot resolve"));
        let kex = classify(Some(255), &lines("kex_exchange_identification: read: Connection reset by peer"));
        assert!(is_retryable(&kex), "{kex:?}");
        assert!(c(Some(127), "sh: 1: exec: /opt/rsrun: not found").contains("rsrun not found at /opt/rsrun on h2"));
        assert_eq!(c(Some(255), "weird\nlast words\n"), "h2: the agent exited with code 255 before starting (last words)");
        // An OS error is not an ssh login failure.
        let os = c(Some(1), "rsrun: error: cannot open /work/x: Permission denied (os error 13)");
        assert!(!os.contains("authentication"), "{os}");
        assert!(c(Some(0), "").contains("(nothing on stderr: does the ssh command (or --rsh) run its arguments"), "{}", c(Some(0), ""));
    }

    #[test]
    fn kex_retries_back_off_exponentially_with_jitter() {
        let ms = |a, u| kex_backoff(a, u).as_millis();
        assert_eq!((ms(1, 0.0), ms(1, 0.999_999)), (250, 499));
        assert_eq!((ms(2, 0.0), ms(3, 0.0), ms(4, 0.5)), (500, 1000, 3000));
        let total: u128 = (1..=KEX_RETRIES).map(|a| ms(a, 1.0)).sum();
        assert!(total <= 7500, "at most {total} ms of waiting in all");
    }
}
