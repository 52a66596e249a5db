//! Reaching the rendezvous in a cluster, where node rank 0 hosts it and the other nodes may start
//! first (multinode.md §3.2, §4.2):
//!
//! - [`resolve`]: the rendezvous host's name is resolved with retries (250 ms → 5 s backoff) until
//!   the join timeout, because a pod's DNS name appears only once the pod runs; the console says what
//!   this node waits for (`waiting for trainer-node-0-0.trainer:29500 (NXDOMAIN)`).
//! - [`host`]: node rank 0 hosts an embedded service that serves **its job only** (other job ids are
//!   refused, naming both). Under Slurm the derived port may be taken (another step derived the same
//!   one): node 0 then tries the next ports, up to `port_probe` of them.
//! - [`find`]: the other nodes of a Slurm step try the same ports and join the first service that
//!   serves their job; a service of another job is named while they wait and in the timeout error.
//!
//! What listens at a port is told by [`probe`]: a TCP connect, then a `Status` call for a job id the
//! service cannot serve, whose refusal names the job it does serve.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::auth::served_job;
use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
use rsrun_rendezvous::server::{EmbeddedServer, ServerConfig, spawn_with};
use tracing::debug;

use crate::logs::{ConsoleEvent, ConsoleTx};

/// First retry delay while the name does not resolve or node 0's service is not found.
const BACKOFF_FIRST: Duration = Duration::from_millis(250);
/// Longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Deadline of one TCP connect of a probe.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Deadline of one probe's `Status` call.
const PROBE_TIMEOUT: Duration = Duration::from_millis(1500);

/// The status line while waiting: shown as it changes, closed when the wait ends.
struct StatusLine<'a> {
    console: &'a ConsoleTx,
    shown: bool,
}

impl<'a> StatusLine<'a> {
    fn new(console: &'a ConsoleTx) -> Self {
        StatusLine { console, shown: false }
    }

    async fn show(&mut self, text: String) {
        let _ = self.console.send(ConsoleEvent::Status(text)).await;
        self.shown = true;
    }

    async fn done(self) {
        if self.shown {
            let _ = self.console.send(ConsoleEvent::StatusDone).await;
        }
    }
}

/// Why a name did not resolve, as an operator says it.
pub fn resolve_reason(err: &std::io::Error) -> String {
    let text = err.to_string();
    let lower = text.to_ascii_lowercase();
    if ["name or service not known", "no address associated", "nodename nor servname", "not known", "no address for"]
        .iter()
        .any(|p| lower.contains(p))
    {
        "NXDOMAIN".to_owned()
    } else if lower.contains("temporary failure") {
        "DNS not answering".to_owned()
    } else {
        format!("DNS: {text}")
    }
}

/// Resolves `host:port`, retrying until `deadline` while the name does not resolve; the console shows
/// `waiting for HOST:PORT (NXDOMAIN)`.
///
/// # Errors
/// The name still did not resolve when `deadline` passed; the error names it and the last reason.
pub async fn resolve(host: &str, port: u16, deadline: Duration, console: &ConsoleTx) -> anyhow::Result<SocketAddr> {
    resolve_with(host, port, deadline, console, || {
        let target = (host.to_owned(), port);
        async move { Ok(tokio::net::lookup_host(target).await?.collect()) }
    })
    .await
}

/// [`resolve`] over any lookup (tests inject failures).
pub(crate) async fn resolve_with<F, Fut>(
    host: &str,
    port: u16,
    deadline: Duration,
    console: &ConsoleTx,
    mut lookup: F,
) -> anyhow::Result<SocketAddr>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::io::Result<Vec<SocketAddr>>>,
{
    let started = tokio::time::Instant::now();
    let mut backoff = BACKOFF_FIRST;
    let mut line = StatusLine::new(console);
    loop {
        let err = match lookup().await {
            Ok(addrs) => match addrs.first() {
                Some(a) => {
                    line.done().await;
                    return Ok(*a);
                }
                None => std::io::Error::new(std::io::ErrorKind::NotFound, format!("no address for {host}")),
            },
            Err(e) => e,
        };
        let waited = started.elapsed();
        let reason = resolve_reason(&err);
        if waited >= deadline {
            line.done().await;
            bail!(
                "cannot resolve {host}:{port}, where node rank 0 hosts the rendezvous, within {deadline:?} (join_timeout): {reason} ({err})"
            );
        }
        debug!(%host, port, %err, "rendezvous host does not resolve yet");
        line.show(format!(
            "rsrun: waiting for {host}:{port} ({reason}), where node rank 0 hosts the rendezvous ({:.0}s)",
            waited.as_secs_f64()
        ))
        .await;
        tokio::time::sleep(backoff.min(deadline - waited)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// How many other hosts of the node list are resolved, at most, to tell a loopback address of node
/// rank 0 from an all-loopback test list.
const LOOPBACK_CHECK_HOSTS: usize = 16;
/// Deadline of each of those lookups.
const LOOPBACK_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// The `127.0.1.1` trap (multinode.md §3.2): node rank 0's name `first` resolved to `addr`. When that
/// is a loopback address while another host of the list resolves to a non-loopback one, the other
/// nodes cannot reach node rank 0 there: the error says so. A list whose hosts all resolve to
/// loopback is a one-machine test, and passes. `others` are the other hosts with what they resolved to.
pub fn loopback_conflict(first: &str, addr: std::net::IpAddr, others: &[(String, Vec<std::net::IpAddr>)]) -> Option<String> {
    loopback_conflict_of(NODE_RANK_0, first, addr, others)
}

/// Whose rendezvous a name is checked for: node rank 0's (the daemon and static modes), or a
/// head's (`--hosts`/`--hostfile` with its own service at `--rdzv-endpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    /// Whose host the name is: "node rank 0's host".
    host: &'static str,
    /// Whose service the others cannot reach: "node rank 0's rendezvous".
    service: &'static str,
}

/// Node rank 0 hosts the rendezvous.
pub const NODE_RANK_0: Holder = Holder { host: "node rank 0's host", service: "node rank 0's rendezvous" };
/// A head hosts the rendezvous of the hosts it starts.
pub const HEAD: Holder = Holder { host: "the head's --rdzv-endpoint", service: "the head's rendezvous" };

/// [`loopback_conflict`] for the rendezvous of `holder`.
pub fn loopback_conflict_of(holder: Holder, first: &str, addr: std::net::IpAddr, others: &[(String, Vec<std::net::IpAddr>)]) -> Option<String> {
    let Holder { host: whose_host, service } = holder;
    if !addr.is_loopback() {
        return None;
    }
    let (other, ip) = others.iter().find_map(|(h, ips)| ips.iter().find(|ip| !ip.is_loopback()).map(|ip| (h, ip)))?;
    let debian = if addr == std::net::IpAddr::from([127, 0, 1, 1]) {
        format!(" (the `127.0.1.1 {first}` line of Debian's /etc/hosts)")
    } else {
        String::new()
    };
    Some(format!(
        "{whose_host} {first} resolves to {addr} here, a loopback address{debian}, while {other} resolves to {ip}: the other nodes cannot reach {service} there; map {first} to its network address in /etc/hosts, or pass --rdzv-endpoint ADDR:PORT"
    ))
}

/// [`loopback_conflict`] with the other hosts of `list` resolved (up to 16 of them, 2 s each, until
/// one resolves to a non-loopback address).
///
/// # Errors
/// The conflict, as a [`crate::plan::StartError`].
pub async fn refuse_loopback(first: &str, addr: SocketAddr, list: &[String]) -> Result<(), crate::plan::StartError> {
    refuse_loopback_of(NODE_RANK_0, first, addr, list).await
}

/// [`refuse_loopback`] for the rendezvous of `holder`.
///
/// # Errors
/// The conflict, as a [`crate::plan::StartError`].
pub async fn refuse_loopback_of(holder: Holder, first: &str, addr: SocketAddr, list: &[String]) -> Result<(), crate::plan::StartError> {
    if !addr.ip().is_loopback() {
        return Ok(());
    }
    let mut others = Vec::new();
    for h in list.iter().filter(|h| h.as_str() != first).take(LOOPBACK_CHECK_HOSTS) {
        let ips: Vec<std::net::IpAddr> = match tokio::time::timeout(LOOPBACK_LOOKUP_TIMEOUT, tokio::net::lookup_host((h.as_str(), addr.port()))).await {
            Ok(Ok(a)) => a.map(|a| a.ip()).collect(),
            _ => Vec::new(),
        };
        let done = ips.iter().any(|ip| !ip.is_loopback());
        others.push((h.clone(), ips));
        if done {
            break;
        }
    }
    match loopback_conflict_of(holder, first, addr.ip(), &others) {
        Some(msg) => Err(crate::plan::StartError(msg)),
        None => Ok(()),
    }
}

/// What answers at one address, for a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// A service that serves this job (node 0's embedded service).
    Ours,
    /// A single-job service of another job.
    OtherJob(String),
    /// An rsrun-rendezvous that serves every job (a daemon, not node 0's embedded service).
    AnyJob,
    /// Nothing usable: connection refused, no answer, something else than a rendezvous.
    Nothing(String),
}

impl Found {
    fn describe(&self) -> String {
        match self {
            Found::Ours => "serves this job".to_owned(),
            Found::OtherJob(j) => format!("serves job {j:?}"),
            Found::AnyJob => "an rsrun-rendezvous daemon, not node rank 0's service".to_owned(),
            Found::Nothing(why) => why.clone(),
        }
    }
}

/// Why a TCP connect failed, in a few words.
fn connect_reason(err: &std::io::Error) -> String {
    match err.kind() {
        std::io::ErrorKind::ConnectionRefused => "connection refused".to_owned(),
        std::io::ErrorKind::TimedOut => "no answer".to_owned(),
        _ => err.to_string(),
    }
}

/// Whether something accepts connections at `addr`, and why not.
pub async fn tcp_reason(addr: SocketAddr) -> Option<String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(connect_reason(&e)),
        Err(_) => Some("no answer".to_owned()),
    }
}

/// What answers at `addr` for `job`.
pub async fn probe(addr: SocketAddr, job: &str, token: Option<&str>) -> Found {
    if let Some(why) = tcp_reason(addr).await {
        return Found::Nothing(why);
    }
    let mut cfg = ClientConfig::new(addr.to_string());
    cfg.token = token.map(str::to_owned);
    cfg.rpc_timeout = Duration::from_secs(1);
    let client = match RdzvClient::connect(cfg) {
        Ok(c) => c,
        Err(e) => return Found::Nothing(e.to_string()),
    };
    // A job id the service does not serve: a single-job service's refusal names the job it serves.
    let other = if job == "rsrun-probe" { "rsrun-probe-2" } else { "rsrun-probe" };
    match tokio::time::timeout(PROBE_TIMEOUT, client.status(Some(other))).await {
        Err(_) => Found::Nothing("no answer".to_owned()),
        Ok(Ok(_)) => Found::AnyJob,
        Ok(Err(RdzvError::PermissionDenied(msg))) => match served_job(&msg) {
            Some(j) if j == job => Found::Ours,
            Some(j) => Found::OtherJob(j.to_owned()),
            None => Found::Nothing(format!("refused: {msg}")),
        },
        // NOT_FOUND for the made-up job: a daemon that would serve it.
        Ok(Err(RdzvError::Rpc { message, .. })) if message.contains("does not exist") => Found::AnyJob,
        Ok(Err(e)) => Found::Nothing(format!("not an rsrun rendezvous ({e})")),
    }
}

/// The addresses node 0 tries: `target`, then up to `extra` next ports (never past 65535).
pub fn candidates(target: SocketAddr, extra: u16) -> Vec<SocketAddr> {
    (0..=extra)
        .filter_map(|i| target.port().checked_add(i))
        .map(|p| SocketAddr::new(target.ip(), p))
        .collect()
}

/// `HOST:P` or `HOST:P..Q`.
fn range_text(host: &str, ports: &[SocketAddr]) -> String {
    match (ports.first(), ports.last()) {
        (Some(a), Some(b)) if a.port() != b.port() => format!("{host}:{}..{}", a.port(), b.port()),
        (Some(a), _) => format!("{host}:{}", a.port()),
        _ => host.to_owned(),
    }
}

/// `P: why; Q: why`, folding equal reasons (`P, Q: connection refused`).
fn summary(found: &[(SocketAddr, Found)]) -> String {
    let mut groups: Vec<(String, Vec<u16>)> = Vec::new();
    for (addr, f) in found {
        let why = match f {
            Found::OtherJob(j) => format!("serves job {j:?}, another job that chose the same port"),
            other => other.describe(),
        };
        match groups.iter_mut().find(|(w, _)| *w == why) {
            Some((_, ports)) => ports.push(addr.port()),
            None => groups.push((why, vec![addr.port()])),
        }
    }
    groups
        .iter()
        .map(|(why, ports)| {
            let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
            format!("{}: {why}", ports.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// How node 0 hosts.
#[derive(Debug)]
pub struct HostConfig<'a> {
    /// The job the service serves (every other job id is refused).
    pub job: &'a str,
    /// Token file the service checks, if any.
    pub token_file: Option<std::path::PathBuf>,
    /// The token this launcher presents (to probe a taken port).
    pub token: Option<&'a str>,
    /// Next ports to try when the port is taken (Slurm: 7).
    pub port_probe: u16,
}

/// Node 0 hosts an embedded single-job service at `target`, or at the first of the next
/// `port_probe` ports that is free. A port where a service of this same job already listens is
/// joined instead (another launcher claims this node rank: the rendezvous names both).
///
/// # Errors
/// Every candidate port is taken by something else; the error lists what each one holds.
pub async fn host(target: SocketAddr, cfg: &HostConfig<'_>) -> anyhow::Result<(SocketAddr, Option<EmbeddedServer>)> {
    let ports = candidates(target, cfg.port_probe);
    let mut found = Vec::new();
    for addr in &ports {
        let mut sc = ServerConfig::in_memory(*addr);
        sc.token_file = cfg.token_file.clone();
        sc.insecure = true;
        sc.only_job = Some(cfg.job.to_owned());
        match spawn_with(sc).await {
            Ok(server) => return Ok((server.addr, Some(server))),
            Err(err) => {
                let what = probe(*addr, cfg.job, cfg.token).await;
                debug!(%addr, %err, ?what, "cannot host the rendezvous here");
                match what {
                    Found::Ours => return Ok((*addr, None)),
                    Found::Nothing(_) => found.push((*addr, Found::Nothing(err.to_string()))),
                    other => found.push((*addr, other)),
                }
            }
        }
    }
    bail!(
        "node rank 0 cannot host the rendezvous of job {:?} at {}: {}",
        cfg.job,
        range_text(&target.ip().to_string(), &ports),
        summary(&found)
    )
}

/// A node other than 0 finds node 0's service for `job` among `target` and the next `port_probe`
/// ports, retrying until `deadline`; the console shows what each port holds while it waits.
///
/// # Errors
/// No port served the job when `deadline` passed; the error names what each port holds (another
/// job's service is named with its job id).
pub async fn find(
    host: &str,
    target: SocketAddr,
    port_probe: u16,
    job: &str,
    token: Option<&str>,
    deadline: Duration,
    console: &ConsoleTx,
) -> anyhow::Result<SocketAddr> {
    let ports = candidates(target, port_probe);
    let started = Instant::now();
    let mut backoff = BACKOFF_FIRST;
    let mut line = StatusLine::new(console);
    loop {
        let mut found = Vec::new();
        for addr in &ports {
            let f = probe(*addr, job, token).await;
            if f == Found::Ours {
                line.done().await;
                return Ok(*addr);
            }
            found.push((*addr, f));
        }
        let waited = started.elapsed();
        if waited >= deadline {
            line.done().await;
            bail!(
                "node rank 0's rendezvous for job {job:?} was not found at {} within {deadline:?} (join_timeout): {}; is node rank 0 running?",
                range_text(host, &ports),
                summary(&found)
            );
        }
        line.show(format!(
            "rsrun: waiting for node rank 0's rendezvous for job {job:?} at {} ({}) ({:.0}s)",
            range_text(host, &ports),
            summary(&found),
            waited.as_secs_f64()
        ))
        .await;
        tokio::time::sleep(backoff.min(deadline - waited)).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests;
