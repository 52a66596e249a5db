//! The command line that starts a host's agent, and which hosts are this machine.
//!
//! Through ssh (or `--rsh CMD`, called the same way), the argv is exactly:
//!
//! ```text
//! ssh -T -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4
//!     [-F CFG] [-p PORT] [-i ID] [-l USER] [-o K=V ...] -- HOST "exec '/abs/rsrun' agent --stdin"
//! ```
//!
//! - `-T`: no tty. A tty would merge stderr into stdout, translate CRLF, and its hang-up semantics are
//!   racy; the agent's liveness is its stdin instead (EOF = the head is gone).
//! - `--` before HOST, and host names that cannot start with `-`: no option injection.
//! - The only string a remote shell parses is that constant; the plan travels on stdin.
//! - The host-key policy is the user's ssh configuration: rsrun never adds
//!   `StrictHostKeyChecking=no`.
//! - ssh keeps the first value of an option: one of the four `-o` defaults that `--ssh-option` also
//!   sets (`--ssh-option ServerAliveInterval=5`) is left out, so the user's value applies.
//!
//! A local host (see [`is_local_host`]) starts `rsrun agent --stdin` directly, unless `--ssh-local`.

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// ssh settings shared by every host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshConfig {
    /// `ssh`, or the `--rsh` command split on spaces.
    pub program: Vec<String>,
    /// `ConnectTimeout`.
    pub connect_timeout: Duration,
    /// `-F`.
    pub config: Option<PathBuf>,
    /// `-p`.
    pub port: Option<u16>,
    /// `-i`.
    pub identity: Option<PathBuf>,
    /// `-l`.
    pub user: Option<String>,
    /// `-o K=V`, in order.
    pub options: Vec<String>,
}

/// The hidden subcommand of a host's agent.
pub const AGENT_ARGS: [&str; 2] = ["agent", "--stdin"];

/// `'...'` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c)) {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The one string the remote shell runs: `exec '/abs/rsrun' agent --stdin`.
pub fn remote_command(rsrun: &Path) -> String {
    let path = rsrun.to_string_lossy();
    format!("exec '{}' {}", path.replace('\'', "'\\''"), AGENT_ARGS.join(" "))
}

/// The full argv that starts `host`'s agent over ssh (or `--rsh`): the host's own `user=`/`port=`
/// override `--ssh-user`/`--ssh-port`, and ssh connects to its `addr=` when it has one.
pub fn ssh_argv(ssh: &SshConfig, host: &super::RemoteHost, rsrun: &Path) -> Vec<OsString> {
    let mut v: Vec<OsString> = ssh.program.iter().map(OsString::from).collect();
    let mut push = |s: &str| v.push(OsString::from(s));
    push("-T");
    // ssh keeps the first value it gets for an option: a default of ours that the user sets with
    // --ssh-option is left out, so that the user's value (later on the line) is the one ssh uses.
    let defaults = [
        ("BatchMode", "yes".to_owned()),
        ("ConnectTimeout", ssh.connect_timeout.as_secs().max(1).to_string()),
        ("ServerAliveInterval", "15".to_owned()),
        ("ServerAliveCountMax", "4".to_owned()),
    ];
    for (key, value) in defaults {
        if !ssh.options.iter().any(|o| option_key(o).eq_ignore_ascii_case(key)) {
            push("-o");
            push(&format!("{key}={value}"));
        }
    }
    if let Some(cfg) = &ssh.config {
        v.push("-F".into());
        v.push(cfg.clone().into_os_string());
    }
    if let Some(port) = host.port.or(ssh.port) {
        v.push("-p".into());
        v.push(port.to_string().into());
    }
    if let Some(id) = &ssh.identity {
        v.push("-i".into());
        v.push(id.clone().into_os_string());
    }
    if let Some(user) = host.user.as_ref().or(ssh.user.as_ref()) {
        v.push("-l".into());
        v.push(user.into());
    }
    for o in &ssh.options {
        v.push("-o".into());
        v.push(o.into());
    }
    v.push("--".into());
    v.push(host.target().into());
    v.push(remote_command(rsrun).into());
    v
}

/// The key of an ssh `-o` option: `KEY=VALUE` (or `KEY VALUE`, as ssh also reads it).
pub fn option_key(option: &str) -> &str {
    option.split(['=', ' ', '\t']).next().unwrap_or("").trim()
}

/// The value of an ssh `-o` option (what follows [`option_key`] and its separator).
pub fn option_value(option: &str) -> &str {
    let o = option.trim_start();
    // The key ends at an ASCII separator (or the end), so this is a character boundary.
    o.get(option_key(o).len()..).unwrap_or("").trim_start_matches(['=', ' ', '\t']).trim()
}

/// The argv of a local agent (no ssh).
pub fn local_argv(rsrun: &Path) -> Vec<OsString> {
    let mut v = vec![rsrun.as_os_str().to_owned()];
    v.extend(AGENT_ARGS.iter().map(OsString::from));
    v
}

/// Whether `host` names this machine, judged from the name alone (no DNS): `localhost`, a loopback
/// address, this host's name (or its first label), or an address a local socket can bind.
pub fn is_local_host(host: &str, hostname: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if h.eq_ignore_ascii_case("localhost") || h.eq_ignore_ascii_case("localhost.localdomain") {
        return true;
    }
    if let Ok(ip) = h.parse::<IpAddr>() {
        return crate::localaddr::is_own_address(ip);
    }
    let short = |s: &str| s.split('.').next().unwrap_or(s).to_ascii_lowercase();
    !hostname.is_empty() && (h.eq_ignore_ascii_case(hostname) || short(h) == short(hostname) && !h.contains('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_argv_is_exact() {
        let ssh = SshConfig {
            program: vec!["ssh".into()],
            connect_timeout: Duration::from_secs(7),
            config: Some("/c/ssh_config".into()),
            port: Some(2222),
            identity: Some("/k/id".into()),
            user: Some("me".into()),
            options: vec!["StrictHostKeyChecking=accept-new".into()],
        };
        let w2 = super::super::RemoteHost::named("w2", 1);
        let argv: Vec<String> =
            ssh_argv(&ssh, &w2, Path::new("/opt/it's/rsrun")).into_iter().map(|s| s.into_string().unwrap()).collect();
        assert_eq!(
            argv,
            [
                "ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-o", "ServerAliveInterval=15", "-o",
                "ServerAliveCountMax=4", "-F", "/c/ssh_config", "-p", "2222", "-i", "/k/id", "-l", "me", "-o",
                "StrictHostKeyChecking=accept-new", "--", "w2", "exec '/opt/it'\\''s/rsrun' agent --stdin",
            ]
        );
    }

    /// ssh keeps the first value of an option: the user's `--ssh-option` for one of rsrun's own
    /// settings (any case) replaces it instead of coming after it, ignored.
    #[test]
    fn ssh_options_override_the_defaults() {
        let ssh = SshConfig {
            program: vec!["ssh".into()],
            connect_timeout: Duration::from_secs(10),
            config: None,
            port: None,
            identity: None,
            user: None,
            options: vec!["ServerAliveInterval=5".into(), "connecttimeout=30".into(), "Compression=yes".into()],
        };
        let argv: Vec<String> =
            ssh_argv(&ssh, &super::super::RemoteHost::named("w1", 1), Path::new("/r")).into_iter().map(|s| s.into_string().unwrap()).collect();
        assert_eq!(
            argv,
            [
                "ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveCountMax=4", "-o", "ServerAliveInterval=5", "-o",
                "connecttimeout=30", "-o", "Compression=yes", "--", "w1", "exec '/r' agent --stdin",
            ]
        );
        assert_eq!(option_key("ServerAliveInterval=5"), "ServerAliveInterval");
        assert_eq!(option_key("ServerAliveInterval 5"), "ServerAliveInterval");
        assert_eq!(option_value("ServerAliveInterval=5"), "5");
        assert_eq!(option_value(" ConnectTimeout 30 "), "30");
        assert_eq!(option_value("Compression"), "");
    }

    #[test]
    fn per_host_user_port_and_addr_override_the_flags() {
        let ssh = SshConfig {
            program: vec!["ssh".into()],
            connect_timeout: Duration::from_secs(10),
            config: None,
            port: Some(2222),
            identity: None,
            user: Some("me".into()),
            options: Vec::new(),
        };
        let mut h = super::super::RemoteHost::named("w3", 1);
        h.user = Some("alice".into());
        h.port = Some(2200);
        h.addr = Some("10.1.2.3".into());
        let argv: Vec<String> = ssh_argv(&ssh, &h, Path::new("/r")).into_iter().map(|s| s.into_string().unwrap()).collect();
        let tail = &argv[10..];
        assert_eq!(tail, ["-p", "2200", "-l", "alice", "--", "10.1.2.3", "exec '/r' agent --stdin"]);
    }

    #[test]
    fn local_hosts() {
        for h in ["localhost", "127.0.0.1", "127.0.0.3", "::1", "[::1]", "node7", "NODE7", "node7.cluster"] {
            assert!(is_local_host(h, "node7.cluster"), "{h}");
        }
        for h in ["node8", "h1", "10.255.255.254", "node7.other"] {
            assert!(!is_local_host(h, "node7.cluster"), "{h}");
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc-1.2/x"), "abc-1.2/x");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
