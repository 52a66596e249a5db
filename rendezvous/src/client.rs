//! The typed async client of the rendezvous service, used by the launcher and the worker runtime.
//!
//! Every call has a deadline. Calls that fail because the service is unreachable (restarting, say)
//! are retried with exponential backoff until that deadline, over a lazily reconnecting channel, so a
//! `kill -9` and restart of the daemon is a pause, not an error. Every store write (set, multi-set,
//! add, compare-set, delete) and barrier arrival carries a request id, drawn once per call and
//! sent again by its retries, so a retry whose first attempt was applied (its answer lost) is
//! answered from the daemon's memory instead of being applied again.
//!
//! The endpoint may list several daemons (`h1:29400,h2:29400`): a highly available group. A standby
//! refuses with a hint naming the leader, and the client goes there at once; an endpoint that does
//! not answer sends it to the next one, backing off at most 500 ms. Every answer of an HA leader
//! carries its epoch; the client remembers the highest it saw and refuses answers of a lower one (a
//! deposed leader that has not noticed), so what it observes never goes back in time.
//!
//! ```no_run
//! # async fn demo() -> Result<(), rsrun_rendezvous::RdzvError> {
//! use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
//! let client = RdzvClient::connect(ClientConfig::new("127.0.0.1:29400"))?;
//! let store = client.store("job7", 1);
//! store.set("greeting", b"hello").await?;
//! # Ok(()) }
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use prost::Message;
use rsrun_proto::v1 as pb;
use rsrun_proto::v1::rendezvous_client::RendezvousClient;
use tokio::sync::watch;
use tokio::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

use crate::RdzvError;

/// The wire types, re-exported for users of the client.
pub use rsrun_proto::v1 as proto;

/// How long a background keep-alive tolerates an unreachable service before it declares the node
/// lost (a daemon restart takes seconds; this bound is for a head node that is gone for good).
pub const KEEP_ALIVE_GIVE_UP: Duration = Duration::from_secs(120);

/// Where and how to reach the service.
#[derive(Clone)]
pub struct ClientConfig {
    /// `host:port`, `[v6]:port`, or a full `http://` / `https://` URI; or several, comma-separated
    /// (the daemons of a highly available group).
    pub endpoint: String,
    /// Bearer token, when the service requires one.
    pub token: Option<String>,
    /// CA certificate (PEM) to verify a TLS service with; implies `https`.
    pub tls_ca: Option<PathBuf>,
    /// TCP/TLS connect timeout.
    pub connect_timeout: Duration,
    /// Deadline of a non-blocking call, including its retries; blocking calls get this on top of
    /// their own wait.
    pub rpc_timeout: Duration,
}

/// Without the token (a `{:?}` of a config, a client or a store client in a log would print it).
impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls_ca", &self.tls_ca)
            .field("connect_timeout", &self.connect_timeout)
            .field("rpc_timeout", &self.rpc_timeout)
            .finish()
    }
}

impl ClientConfig {
    /// Defaults: 5 s connect timeout, 30 s per call, no token, no TLS.
    pub fn new(endpoint: impl Into<String>) -> Self {
        ClientConfig {
            endpoint: endpoint.into(),
            token: None,
            tls_ca: None,
            connect_timeout: Duration::from_secs(5),
            rpc_timeout: Duration::from_secs(30),
        }
    }
}

/// Adds the bearer token to every call.
#[derive(Clone)]
pub struct TokenInjector {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl std::fmt::Debug for TokenInjector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenInjector").field("header", &self.header.as_ref().map(|_| "<redacted>")).finish()
    }
}

impl tonic::service::Interceptor for TokenInjector {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            req.metadata_mut().insert("authorization", h.clone());
        }
        Ok(req)
    }
}

type Inner = RendezvousClient<InterceptedService<Channel, TokenInjector>>;

/// A node's request to join a job.
#[derive(Debug, Clone)]
pub struct JoinSpec {
    /// Job (run) id.
    pub job_id: String,
    /// This node's id, stable for the life of the launcher.
    pub node_id: String,
    /// Addresses other nodes can reach this node at.
    pub addrs: Vec<String>,
    /// Workers on this node.
    pub local_world_size: u32,
    /// Preferred node rank.
    pub rank_hint: Option<u32>,
    /// The job's membership configuration (must match the other nodes').
    pub config: JobSpec,
    /// How long to wait for the round to form.
    pub timeout: Duration,
    /// A port reserved on this node: MASTER_PORT if it becomes group rank 0.
    pub master_port: u16,
    /// Host name, for people.
    pub hostname: String,
}

/// A job's membership configuration as the client states it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    /// Fewest nodes.
    pub min_nodes: u32,
    /// Most nodes.
    pub max_nodes: u32,
    /// Wait for more nodes after `min_nodes` joined.
    pub last_call: Duration,
    /// Lease of a node; keep-alives must come more often (a third of it is a good interval).
    pub lease: Duration,
    /// Global restart budget.
    pub max_restarts: u32,
    /// Fixed node ranks (static backend): `rank_hint` is this node's rank, duplicates fail the job.
    pub fixed_ranks: bool,
}

impl JobSpec {
    fn to_pb(&self) -> pb::JobConfig {
        pb::JobConfig {
            min_nodes: self.min_nodes,
            max_nodes: self.max_nodes,
            last_call_ms: self.last_call.as_millis() as u64,
            lease_ms: self.lease.as_millis() as u64,
            max_restarts: self.max_restarts,
            fixed_ranks: self.fixed_ranks,
        }
    }
}

/// One daemon's channel.
#[derive(Debug, Clone)]
struct Conn {
    name: String,
    client: Inner,
}

/// The daemons a client talks to, which one it uses now, and the highest epoch it heard.
struct Conns {
    list: RwLock<Vec<Conn>>,
    current: AtomicUsize,
    epoch: AtomicU64,
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
    ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for Conns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.list.read().unwrap_or_else(|p| p.into_inner()).iter().map(|c| c.name.clone()).collect();
        f.debug_struct("Conns")
            .field("endpoints", &names)
            .field("current", &self.current)
            .field("epoch", &self.epoch)
            .field("token", &self.header.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.ca_pem.is_some())
            .finish()
    }
}

/// `host:port` of an endpoint as written (scheme dropped), for matching leader hints.
fn bare(endpoint: &str) -> &str {
    let e = endpoint.trim();
    e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or(e).trim_end_matches('/')
}

fn channel(raw: &str, cfg: &ClientConfig, ca_pem: Option<&[u8]>, header: Option<MetadataValue<tonic::metadata::Ascii>>) -> Result<Inner, RdzvError> {
    let bad = |message: String| RdzvError::Connect { endpoint: raw.to_string(), message };
    let raw = raw.trim();
    if ca_pem.is_some() && raw.starts_with("http://") {
        // The connector speaks TLS only to https:// URIs: with http:// the CA went unused and the
        // token and every call travelled in clear, without a word.
        return Err(bad("http:// with a TLS CA: the calls (and the token) would travel unencrypted; use https:// or host:port".into()));
    }
    let uri = if raw.starts_with("http://") || raw.starts_with("https://") {
        raw.to_string()
    } else {
        let scheme = if ca_pem.is_some() { "https" } else { "http" };
        format!("{scheme}://{raw}")
    };
    let parsed: tonic::codegen::http::Uri = uri.parse().map_err(|e| bad(format!("not a host:port address ({e})")))?;
    let host = parsed.host().filter(|h| !h.is_empty()).ok_or_else(|| bad("no host".into()))?.to_string();
    // The text after the authority's last colon (not one inside an IPv6 literal).
    let authority = uri.split_once("://").map_or(uri.as_str(), |(_, r)| r).split('/').next().unwrap_or("");
    let port_text = match authority.rsplit_once(':') {
        Some((h, p)) if h.ends_with(']') || !h.contains(':') => p,
        _ => "",
    };
    match parsed.port_u16() {
        Some(0) => return Err(bad("port 0; expected the daemon's port (its default is 29400)".into())),
        Some(_) => {}
        None if !port_text.is_empty() => return Err(bad(format!("port {port_text:?} is not a number in 1..65535"))),
        None => return Err(bad("no port; expected host:port (the daemon's default is 29400)".into())),
    }
    let mut endpoint = Endpoint::from_shared(uri.clone())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true);
    if let Some(pem) = ca_pem {
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        endpoint = endpoint
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)).domain_name(host))
            .map_err(|e| bad(format!("TLS configuration: {e}")))?;
    }
    let channel = endpoint.connect_lazy();
    Ok(RendezvousClient::with_interceptor(channel, TokenInjector { header }).max_decoding_message_size(usize::MAX))
}

impl Conns {
    fn pick(&self) -> (usize, Conn) {
        let list = self.list.read().unwrap_or_else(|p| p.into_inner());
        let i = self.current.load(Ordering::Relaxed) % list.len();
        (i, list[i].clone())
    }

    fn len(&self) -> usize {
        self.list.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// After endpoint `i` failed: the next one.
    fn rotate(&self, i: usize) {
        let n = self.len();
        let _ = self.current.compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Goes to the daemon a standby named (adding it when the list lacks it). Returns whether the
    /// client moved.
    fn go_to(&self, leader: &str, cfg: &ClientConfig) -> bool {
        let want = bare(leader);
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        let at = match list.iter().position(|c| bare(&c.name) == want) {
            Some(i) => i,
            None => match channel(want, cfg, self.ca_pem.as_deref(), self.header.clone()) {
                Ok(client) => {
                    list.push(Conn { name: want.to_owned(), client });
                    list.len() - 1
                }
                Err(e) => {
                    tracing::debug!(leader, error = %e, "unusable leader hint");
                    return false;
                }
            },
        };
        self.current.swap(at, Ordering::Relaxed) != at
    }

    /// Checks an answer's epoch against the highest seen.
    fn check_epoch(&self, md: &tonic::metadata::MetadataMap) -> Result<(), RdzvError> {
        let Some(v) = md.get_bin(crate::service::LEADER_STAMP_KEY) else { return Ok(()) };
        let Some(stamp) = v.to_bytes().ok().and_then(|b| pb::LeaderStamp::decode(b.as_ref()).ok()) else { return Ok(()) };
        let seen = self.epoch.fetch_max(stamp.epoch, Ordering::Relaxed);
        if stamp.epoch < seen {
            return Err(RdzvError::StaleEpoch { got: stamp.epoch, seen });
        }
        Ok(())
    }
}

/// How long past its own wait a blocking call's answer may take (the server answers when the wait
/// ends; this covers the trip and a busy daemon).
pub const BLOCKING_SLACK: Duration = Duration::from_secs(5);

/// The longest wait a blocking call asks for: a day, the longest a daemon accepts by default
/// (`validate::Limits::max_timeout_ms`). Longer ones, `Duration::MAX` for "forever" included,
/// wait this long, so "forever" is not refused and no deadline overflows.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// With several daemons, the slack one attempt gets past its wait: a third of the call timeout,
/// at least 2 s (10 s by default), so a hung daemon leaves two more tries within the call. (A
/// blocking call's own slack is shorter: there HTTP/2 keep-alive ends a dead connection.)
fn attempt_slack(rpc_timeout: Duration) -> Duration {
    (rpc_timeout / 3).max(Duration::from_secs(2))
}

/// Checks that a file's contents (a CA file, a daemon's `--tls-cert`) are one or more PEM
/// certificates, or says why not (`holds no PEM certificate ...`, to follow the file's name).
///
/// # Errors
/// The contents hold no PEM certificate, or a malformed one.
pub fn check_pem_certificates(pem: &[u8]) -> Result<(), String> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    match CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>() {
        Ok(certs) if !certs.is_empty() => Ok(()),
        Ok(_) => Err("holds no PEM certificate (expected -----BEGIN CERTIFICATE-----)".into()),
        Err(e) => Err(format!("is not a readable PEM certificate file: {e:?}")),
    }
}

/// The TLS handshake's failure behind a status, said with what to check; `None` when the status
/// is no TLS failure.
fn tls_failure(status: &Status) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(err) = source {
        let found = err
            .downcast_ref::<rustls::Error>()
            .or_else(|| err.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()?.downcast_ref::<rustls::Error>()));
        if let Some(tls) = found {
            let hint = match tls {
                rustls::Error::InvalidCertificate(_) => {
                    "its certificate is not signed by the CA file given, is expired, or does not name the host of the endpoint"
                }
                rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } | rustls::Error::InappropriateHandshakeMessage { .. } => {
                    "the daemon does not speak TLS (started without --tls-cert?): give no CA file"
                }
                _ => "check the daemon's --tls-cert against the CA file given",
            };
            return Some(format!("{tls}; {hint}"));
        }
        source = err.source();
    }
    None
}

/// Whether the daemon at `endpoint` answers a plain HTTP/2 preface with a TLS alert record (a
/// TLS daemon, reached without a CA file). At most a second.
async fn speaks_tls(endpoint: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(bare(endpoint)).await.ok()?;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.ok()?;
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await.ok()?;
        // Content type 21 (alert), protocol version 3.x.
        Some(head == [0x15, 0x03])
    };
    matches!(tokio::time::timeout(Duration::from_secs(1), probe).await, Ok(Some(true)))
}

/// A connection to the rendezvous service (cheap to clone; clones share the channels).
#[derive(Debug, Clone)]
pub struct RdzvClient {
    conns: Arc<Conns>,
    cfg: Arc<ClientConfig>,
}

fn request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

impl RdzvClient {
    /// Prepares a lazily connecting client. Nothing is sent until the first call.
    ///
    /// # Errors
    /// A malformed endpoint, an unreadable CA file or a token that cannot travel in a header.
    pub fn connect(cfg: ClientConfig) -> Result<Self, RdzvError> {
        let bad = |message: String| RdzvError::Connect { endpoint: cfg.endpoint.clone(), message };
        let ca_pem = match &cfg.tls_ca {
            Some(ca) => {
                let pem = crate::files::read_bounded(ca).map_err(|e| bad(format!("cannot read CA file {}: {e}", ca.display())))?;
                check_pem_certificates(&pem).map_err(|why| bad(format!("CA file {} {why}", ca.display())))?;
                Some(pem)
            }
            None => None,
        };
        let header = match &cfg.token {
            None => None,
            Some(t) if t.len() > crate::auth::MAX_TOKEN_BYTES => {
                return Err(bad(format!("the token has {} characters; at most {} travel in a header", t.len(), crate::auth::MAX_TOKEN_BYTES)));
            }
            Some(t) => {
                let mut h = format!("Bearer {t}")
                    .parse::<MetadataValue<tonic::metadata::Ascii>>()
                    .map_err(|_| bad("the token contains characters that cannot travel in a header".into()))?;
                // Never indexed by HPACK (nor shown by debug output of the headers).
                h.set_sensitive(true);
                Some(h)
            }
        };
        let names: Vec<&str> = cfg.endpoint.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
        if names.is_empty() {
            return Err(bad("empty; expected host:port (several: comma-separated)".into()));
        }
        let mut list = Vec::with_capacity(names.len());
        for name in names {
            list.push(Conn { name: name.to_owned(), client: channel(name, &cfg, ca_pem.as_deref(), header.clone())? });
        }
        let conns = Conns { list: RwLock::new(list), current: AtomicUsize::new(0), epoch: AtomicU64::new(0), header, ca_pem };
        Ok(RdzvClient { conns: Arc::new(conns), cfg: Arc::new(cfg) })
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// The highest leader epoch this client heard (0: no HA daemon answered yet).
    pub fn epoch(&self) -> u64 {
        self.conns.epoch.load(Ordering::Relaxed)
    }

    /// The endpoint calls go to now.
    pub fn current_endpoint(&self) -> String {
        self.conns.pick().1.name
    }

    /// Asks one daemon about itself (never redirected): its HA role, epoch and replica.
    pub async fn daemon_info_at(&self, endpoint: &str) -> Result<pb::DaemonInfoResponse, RdzvError> {
        let mut c = channel(endpoint, &self.cfg, self.conns.ca_pem.as_deref(), self.conns.header.clone())?;
        match tokio::time::timeout(self.cfg.rpc_timeout, c.daemon_info(pb::DaemonInfoRequest {})).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(RdzvError::from(s)),
            Err(_) => Err(RdzvError::Timeout(format!("{endpoint} did not answer within {:?}", self.cfg.rpc_timeout))),
        }
    }

    /// Runs one call, retrying while the service is unreachable. The closure gets the wait left for
    /// the server side (for blocking calls).
    ///
    /// Deadlines: a blocking call (`wait` > 0) stops retrying an unreachable service once `wait`
    /// passed, so `join_timeout=3` fails after about 3 s; a plain call retries for the configured
    /// call timeout. An attempt that reached the service may take `wait` plus a slack to answer:
    /// the call timeout for a plain call, at most [`BLOCKING_SLACK`] for a blocking one (so a peer
    /// that accepts connections but never answers, not an rsrun daemon, holds `join_timeout=5`
    /// for about 10 s, not 35). A failed TLS handshake is not retried (unless another daemon of the list may still
    /// answer): the configuration has to change.
    async fn call<T, Fut>(&self, what: &str, wait: Duration, mut f: impl FnMut(Inner, Duration) -> Fut) -> Result<T, RdzvError>
    where
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let start = Instant::now();
        let (wait, rpc_timeout) = (wait.min(MAX_WAIT), self.cfg.rpc_timeout.min(MAX_WAIT));
        let slack = if wait.is_zero() { rpc_timeout } else { rpc_timeout.min(BLOCKING_SLACK) };
        let deadline = start + wait + slack;
        let retry_until = start + if wait.is_zero() { rpc_timeout } else { wait };
        let mut tls_failed: Vec<usize> = Vec::new();
        let mut tls_note = String::new();
        let mut probed = false;
        let mut backoff = Duration::from_millis(25);
        let mut attempts = 0u32;
        let mut redirects = 0u32;
        // Daemons that failed (not a standby's refusal) during this call: a hint naming one is
        // not followed again in it (a standby whose hint names a dead or unreachable leader sent
        // the client back and forth between the two, never trying the rest of the list).
        let mut failed: Vec<String> = Vec::new();
        let mut last_unreachable: Option<RdzvError> = None;
        loop {
            attempts += 1;
            let now = Instant::now();
            let server_wait = wait.saturating_sub(now - start);
            let (idx, conn) = self.conns.pick();
            // With several daemons, one attempt gets its wait plus a part of the call timeout: a
            // daemon that hangs (a frozen process holding its connections open) must leave time to
            // ask the next one, which may have taken over meanwhile.
            let several = self.conns.len() > 1;
            let attempt_end = if several { deadline.min(now + server_wait + attempt_slack(rpc_timeout)) } else { deadline };
            let result = tokio::time::timeout(attempt_end.saturating_duration_since(now), f(conn.client, server_wait)).await;
            let result = match result {
                Err(_) if attempt_end < deadline => {
                    Ok(Err(Status::unavailable(format!("{} did not answer within {:?}", conn.name, attempt_end - now))))
                }
                other => other,
            };
            let err = match result {
                Ok(Ok(resp)) => match self.conns.check_epoch(resp.metadata()) {
                    Ok(()) => return Ok(resp.into_inner()),
                    Err(e) => {
                        self.conns.rotate(idx);
                        e
                    }
                },
                Ok(Err(status)) => match tls_failure(&status) {
                    Some(message) => {
                        let err = RdzvError::Tls { endpoint: conn.name.clone(), message };
                        if !tls_failed.contains(&idx) {
                            tls_failed.push(idx);
                        }
                        if tls_failed.len() >= self.conns.len() {
                            return Err(err);
                        }
                        tls_note = format!(" (and {err})");
                        // Another daemon of the list may still answer: treated as unreachable.
                        RdzvError::Unavailable(err.to_string())
                    }
                    // A transport failure of a client without a CA file: a daemon that speaks TLS
                    // breaks the connection off (asked once per call; it answers within a second).
                    None if self.conns.ca_pem.is_none()
                        && !probed
                        && (std::error::Error::source(&status).is_some() || status.code() == tonic::Code::Internal) =>
                    {
                        probed = true;
                        if speaks_tls(&conn.name).await {
                            return Err(RdzvError::Tls {
                                endpoint: conn.name.clone(),
                                message: "the daemon answers with TLS: give the CA file that signed its certificate".into(),
                            });
                        }
                        RdzvError::from(status)
                    }
                    None => RdzvError::from(status),
                },
                // The deadline passed during an attempt: if earlier attempts could not reach the
                // service, that is the story to tell, not the timeout of the last try.
                Err(_) => match last_unreachable {
                    Some(e) => {
                        return Err(RdzvError::Unavailable(format!(
                            "{what}: rendezvous service at {} unreachable after {attempts} attempts over {:?}: {e}{tls_note}",
                            self.cfg.endpoint,
                            start.elapsed()
                        )));
                    }
                    None => {
                        return Err(RdzvError::Timeout(format!(
                            "{what} to {} did not answer within {:?}",
                            self.cfg.endpoint,
                            wait + slack
                        )));
                    }
                },
            };
            if !err.is_retryable() {
                return Err(err);
            }
            let left = retry_until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(RdzvError::Unavailable(format!(
                    "{what}: rendezvous service at {} unreachable after {attempts} attempts over {:?}: {err}{tls_note}",
                    self.cfg.endpoint,
                    start.elapsed()
                )));
            }
            // Where to try next: the leader a standby named (at once), else the next daemon (the list
            // may have grown by a leader a standby named).
            let cap = if several { Duration::from_millis(500) } else { Duration::from_secs(2) };
            // A hint this client cannot use (it names this daemon, or cannot be parsed) moves on
            // to the next daemon like any other refusal, instead of asking the same standby again.
            if !matches!(err, RdzvError::NotLeader { .. }) && !failed.iter().any(|f| bare(f) == bare(&conn.name)) {
                failed.push(conn.name.clone());
            }
            // A hint of an older epoch than one this client heard is stale: not followed.
            let usable = |leader: &str, epoch: u64| {
                !leader.is_empty()
                    && (epoch == 0 || epoch >= self.conns.epoch.load(Ordering::Relaxed))
                    && !failed.iter().any(|f| bare(f) == bare(leader))
            };
            let redirected = matches!(&err, RdzvError::NotLeader { leader, epoch } if usable(leader, *epoch) && self.conns.go_to(leader, &self.cfg));
            if !redirected && several {
                self.conns.rotate(idx);
            }
            tracing::debug!(what, attempts, endpoint = %conn.name, error = %err, "rendezvous unreachable, retrying");
            last_unreachable = Some(err);
            // A redirect is followed at once, once: two daemons whose stale hints name each other
            // are asked at the backoff's pace, not in a busy loop.
            redirects = if redirected { redirects + 1 } else { 0 };
            if redirects == 1 {
                continue;
            }
            tokio::time::sleep(backoff.min(left)).await;
            backoff = (backoff * 2).min(cap);
        }
    }

    /// Joins the job's next round and waits until it forms.
    pub async fn join(&self, spec: JoinSpec) -> Result<pb::JoinResponse, RdzvError> {
        let config = spec.config.to_pb();
        self.call("join", spec.timeout, |mut c, left| {
            let req = pb::JoinRequest {
                job_id: spec.job_id.clone(),
                node_id: spec.node_id.clone(),
                addrs: spec.addrs.clone(),
                local_world_size: spec.local_world_size,
                rank_hint: spec.rank_hint,
                config: Some(config),
                timeout_ms: ms(left),
                master_port: u32::from(spec.master_port),
                hostname: spec.hostname.clone(),
            };
            async move { c.join(req).await }
        })
        .await
    }

    /// Renews the node's lease and returns the job's view.
    pub async fn keep_alive(&self, job: &str, node: &str) -> Result<pb::JobView, RdzvError> {
        let r = self
            .call("keep-alive", Duration::ZERO, |mut c, _| {
                let req = pb::KeepAliveRequest { job_id: job.into(), node_id: node.into() };
                async move { c.keep_alive(req).await }
            })
            .await?;
        r.view.ok_or_else(|| RdzvError::Unavailable("keep-alive answer without a view".into()))
    }

    /// Leaves the job.
    pub async fn leave(&self, job: &str, node: &str, reason: &str) -> Result<(), RdzvError> {
        self.call("leave", Duration::ZERO, |mut c, _| {
            let req = pb::LeaveRequest { job_id: job.into(), node_id: node.into(), reason: reason.into() };
            async move { c.leave(req).await }
        })
        .await
        .map(|_| ())
    }

    /// Follows the job's view: a background task keeps a server-push stream open (reconnecting with
    /// backoff) and publishes every view. It ends when the receiver is dropped, the job ends, or the
    /// job is gone.
    pub fn watch(&self, job: &str, node: &str) -> watch::Receiver<Option<pb::JobView>> {
        let (tx, rx) = watch::channel(None);
        let client = self.clone();
        let (job, node) = (job.to_string(), node.to_string());
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(25);
            let mut redirected = false;
            loop {
                let cap = if client.conns.len() > 1 { Duration::from_millis(500) } else { Duration::from_secs(2) };
                let (idx, conn) = client.conns.pick();
                let mut c = conn.client;
                let req = pb::WatchRequest { job_id: job.clone(), node_id: node.clone() };
                let opened = tokio::select! {
                    r = c.watch(req) => r,
                    _ = tx.closed() => return,
                };
                match opened {
                    // A deposed leader's stream: the next daemon, at the backoff's growing pace.
                    Ok(stream) if client.conns.check_epoch(stream.metadata()).is_err() => {
                        redirected = false;
                        client.conns.rotate(idx);
                    }
                    Ok(stream) => {
                        redirected = false;
                        let mut stream = stream.into_inner();
                        loop {
                            let next = tokio::select! {
                                n = stream.message() => n,
                                _ = tx.closed() => return,
                            };
                            match next {
                                Ok(Some(ev)) => {
                                    backoff = Duration::from_millis(25);
                                    let Some(view) = ev.view else { continue };
                                    let terminal = view.state == pb::JobState::Completed as i32 || view.state == pb::JobState::Failed as i32;
                                    let _ = tx.send(Some(view));
                                    if terminal {
                                        return;
                                    }
                                }
                                Ok(None) | Err(_) => break,
                            }
                        }
                    }
                    Err(status) => {
                        let e = RdzvError::from(status);
                        if !e.is_retryable() {
                            tracing::debug!(%job, error = %e, "watch ends");
                            return;
                        }
                        match &e {
                            // Followed at once, once in a row (two stale hints naming each other
                            // must not make a busy loop).
                            RdzvError::NotLeader { leader, .. } if !leader.is_empty() && client.conns.go_to(leader, &client.cfg) => {
                                let again = redirected;
                                redirected = true;
                                if !again {
                                    continue;
                                }
                            }
                            _ => {
                                redirected = false;
                                client.conns.rotate(idx);
                            }
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = tx.closed() => return,
                }
                backoff = (backoff * 2).min(cap);
            }
        });
        rx
    }

    /// Renews the lease every `interval` in the background until the handle is dropped. The handle
    /// reports the first error that means the node is out (its lease expired, the job is gone), or
    /// that the service stayed unreachable for [`KEEP_ALIVE_GIVE_UP`]. It never fences the node
    /// ([`KeepAlivePolicy::lease`] is `None`).
    pub fn spawn_keep_alive(&self, job: &str, node: &str, interval: Duration) -> KeepAliveHandle {
        self.spawn_keep_alive_with(job, node, KeepAlivePolicy { interval, lease: None, margin: Duration::ZERO, give_up: KEEP_ALIVE_GIVE_UP })
    }

    /// [`RdzvClient::spawn_keep_alive`] with an explicit policy: how long the service may stay
    /// unreachable (a daemon restart takes seconds; a dead head node never comes back), and the
    /// lease after which the node fences itself.
    ///
    /// Self-fencing: the service drops a node whose lease it has not renewed for the lease's
    /// length, counted from when it received the last renewal, and may then start a round without
    /// it. This side counts from when that renewal was *sent* (the join's: a third of the lease
    /// before this task starts, the service's renewal period for a waiting join), so it reaches the
    /// lease's end no later than the service does; it fences `margin` before that end (the time its
    /// workers get to stop) and says so on [`KeepAliveHandle::lapsed`]: the node's workers must
    /// stop now, whether the service is gone or only this node is cut off. From then on the task
    /// sends `Leave`, never another renewal (a renewal that arrives while its answer is lost would
    /// keep a node without workers in the round): the service's answer ends it, on `lost` —
    /// [`RdzvError::NotMember`] when the node left or had been dropped already — and the node joins
    /// again. A service that never answers is the give-up as before.
    ///
    /// Every attempt is bounded by `interval`: one that does not answer in time (a daemon gone
    /// without a reset) counts as a failed renewal, and the next goes to the next daemon of a
    /// highly available group.
    pub fn spawn_keep_alive_with(&self, job: &str, node: &str, policy: KeepAlivePolicy) -> KeepAliveHandle {
        let (tx, rx) = watch::channel(None);
        let (lapsed_tx, lapsed) = watch::channel(None);
        let client = self.clone();
        let (job, node) = (job.to_string(), node.to_string());
        let task = tokio::spawn(async move {
            let attempt_limit = policy.interval.max(Duration::from_millis(100));
            let mut tick = tokio::time::interval(policy.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut last_ok = Instant::now();
            // When the fence comes (`None`: never, or already fenced): the lease, less the margin,
            // after the send time of the last answered renewal.
            let fence_after = |sent: Instant, lease: Duration| sent + lease.saturating_sub(policy.margin);
            let mut fence_at = policy.lease.map(|lease| fence_after(last_ok, lease.saturating_sub(lease / 3)));
            let mut renewed_at = last_ok;
            let mut last_err = String::new();
            let mut fenced = false;
            loop {
                // The next renewal (or, once fenced, the next leave), unless the fence comes first.
                let attempt = async {
                    tick.tick().await;
                    let sent = Instant::now();
                    let what = if fenced { "leave" } else { "keep-alive" };
                    // The daemon this attempt goes to: a timeout moves on from it, not from one
                    // another call moved to meanwhile.
                    let (idx, _) = client.conns.pick();
                    let call = async {
                        if fenced {
                            client.leave(&job, &node, "its lease lapsed at the node, which stopped its workers").await.map(|()| None)
                        } else {
                            client.keep_alive(&job, &node).await.map(Some)
                        }
                    };
                    let result = match tokio::time::timeout(attempt_limit, call).await {
                        Ok(r) => r,
                        Err(_) => {
                            client.conns.rotate(idx);
                            Err(RdzvError::Timeout(format!("{what} to {} did not answer within {attempt_limit:?}", client.cfg.endpoint)))
                        }
                    };
                    (sent, result)
                };
                let fenced_now = tokio::select! {
                    r = attempt => Err(r),
                    () = tokio::time::sleep_until(fence_at.unwrap_or_else(Instant::now)), if fence_at.is_some() => Ok(()),
                };
                let (sent, result) = match fenced_now {
                    Ok(()) => {
                        fenced = true;
                        fence_at = None;
                        let why = format!(
                            "no keep-alive was answered by the rendezvous service at {} for {:.1?}, within {:.1?} of the end of this node's lease there{}",
                            client.cfg.endpoint,
                            renewed_at.elapsed(),
                            policy.margin,
                            if last_err.is_empty() { String::new() } else { format!(" (last error: {last_err})") }
                        );
                        tracing::warn!(%job, %node, "{why}: fencing this node");
                        let _ = lapsed_tx.send(Some(why));
                        // The leave goes out at once.
                        tick.reset_immediately();
                        continue;
                    }
                    Err(r) => r,
                };
                match result {
                    Ok(Some(_)) => {
                        last_ok = Instant::now();
                        renewed_at = sent;
                        if !fenced {
                            fence_at = policy.lease.map(|lease| fence_after(sent, lease));
                        }
                    }
                    Ok(None) => {
                        let _ = tx.send(Some(RdzvError::NotMember {
                            job: job.clone(),
                            node: node.clone(),
                            reason: "its lease lapsed at the node, which stopped its workers and left".into(),
                        }));
                        return;
                    }
                    Err(e) if e.is_retryable() || matches!(e, RdzvError::Timeout(_)) => {
                        if last_ok.elapsed() >= policy.give_up {
                            let _ = tx.send(Some(RdzvError::Unavailable(format!(
                                "rendezvous service at {} unreachable for {:?} (last error: {e})",
                                client.cfg.endpoint,
                                last_ok.elapsed()
                            ))));
                            return;
                        }
                        tracing::warn!(%job, %node, error = %e, "keep-alive failed, retrying");
                        last_err = e.to_string();
                    }
                    Err(e) => {
                        let _ = tx.send(Some(e));
                        return;
                    }
                }
            }
        });
        KeepAliveHandle { task, lost: rx, lapsed }
    }

    /// Reports a worker failure; the answer says restart (re-join) or failed.
    pub async fn report_failure(
        &self,
        job: &str,
        round: u64,
        node: &str,
        failure: pb::FailureInfo,
        restartable: bool,
    ) -> Result<pb::ReportFailureResponse, RdzvError> {
        self.call("report-failure", Duration::ZERO, |mut c, _| {
            let req = pb::ReportFailureRequest {
                job_id: job.into(),
                round,
                node_id: node.into(),
                failure: Some(failure.clone()),
                restartable,
            };
            async move { c.report_failure(req).await }
        })
        .await
    }

    /// Fails the whole job now.
    pub async fn fail_job(&self, job: &str, node: &str, reason: &str) -> Result<(), RdzvError> {
        self.call("fail-job", Duration::ZERO, |mut c, _| {
            let req = pb::FailJobRequest { job_id: job.into(), node_id: node.into(), reason: reason.into() };
            async move { c.fail_job(req).await }
        })
        .await
        .map(|_| ())
    }

    /// Says this node's workers all succeeded.
    pub async fn finish(&self, job: &str, round: u64, node: &str) -> Result<pb::JobView, RdzvError> {
        let r = self
            .call("finish", Duration::ZERO, |mut c, _| {
                let req = pb::FinishRequest { job_id: job.into(), round, node_id: node.into() };
                async move { c.finish(req).await }
            })
            .await?;
        r.view.ok_or_else(|| RdzvError::Unavailable("finish answer without a view".into()))
    }

    /// Waits up to `timeout` for the job to complete or fail; `true` when it ended.
    pub async fn await_job_end(&self, job: &str, timeout: Duration) -> Result<(pb::JobView, bool), RdzvError> {
        let r = self
            .call("await-job-end", timeout, |mut c, left| {
                let req = pb::AwaitJobEndRequest { job_id: job.into(), timeout_ms: ms(left) };
                async move { c.await_job_end(req).await }
            })
            .await?;
        let view = r.view.ok_or_else(|| RdzvError::Unavailable("answer without a view".into()))?;
        Ok((view, r.ended))
    }

    /// The operator view of one job or of all visible jobs.
    pub async fn status(&self, job: Option<&str>) -> Result<pb::StatusResponse, RdzvError> {
        self.call("status", Duration::ZERO, |mut c, _| {
            let req = pb::StatusRequest { job_id: job.unwrap_or_default().into() };
            async move { c.status(req).await }
        })
        .await
    }

    /// The job-scoped store, fenced to `round`.
    pub fn store(&self, job: &str, round: u64) -> StoreClient {
        StoreClient { client: self.clone(), scope: pb::StoreScope { job_id: job.into(), round, round_scoped: false } }
    }
}

/// A background keep-alive; stops when dropped.
#[derive(Debug)]
pub struct KeepAliveHandle {
    task: tokio::task::JoinHandle<()>,
    /// Becomes `Some` when the node is out of the job (lease expired, job gone).
    pub lost: watch::Receiver<Option<RdzvError>>,
    /// Becomes `Some` (why) when the node's lease lapsed at this end: its workers must stop (see
    /// [`RdzvClient::spawn_keep_alive_with`]). `lost` follows once the service answers again or
    /// the task gives up.
    pub lapsed: watch::Receiver<Option<String>>,
}

/// How a background keep-alive renews, fences and gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeepAlivePolicy {
    /// Period of the renewals.
    pub interval: Duration,
    /// The node's lease at the service: once no renewal has been answered for this long (less
    /// `margin`), counted from when the last answered one was sent, the node fences itself.
    /// `None`: never (the service lives in this process, or the caller has no workers to stop).
    pub lease: Option<Duration>,
    /// How long before the lease's end the node fences itself: the time its workers get to stop.
    pub margin: Duration,
    /// How long the service may stay unreachable before the node is reported lost.
    pub give_up: Duration,
}

impl Drop for KeepAliveHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The key-value store of one job (and optionally one round), plus barriers and the unique-id
/// exchange.
#[derive(Debug, Clone)]
pub struct StoreClient {
    client: RdzvClient,
    scope: pb::StoreScope,
}

impl StoreClient {
    /// The same store, in the round's own namespace (dropped when the round ends).
    pub fn round_scoped(mut self) -> Self {
        self.scope.round_scoped = true;
        self
    }

    /// The job id.
    pub fn job(&self) -> &str {
        &self.scope.job_id
    }

    /// The round the store is fenced to.
    pub fn round(&self) -> u64 {
        self.scope.round
    }

    /// Sets a key. A retry whose first attempt was applied is not applied again (it would
    /// overwrite what another client wrote meanwhile).
    pub async fn set(&self, key: &str, value: &[u8]) -> Result<(), RdzvError> {
        let id = request_id();
        self.client
            .call("store set", Duration::ZERO, |mut c, _| {
                let req = pb::StoreSetRequest {
                    scope: Some(self.scope.clone()),
                    key: key.into(),
                    value: value.to_vec(),
                    request_id: id.clone(),
                };
                async move { c.store_set(req).await }
            })
            .await
            .map(|_| ())
    }

    /// Gets a key, waiting up to `timeout` for it to exist.
    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, RdzvError> {
        let r = self
            .client
            .call("store get", timeout, |mut c, left| {
                // Zero means "do not wait": keep at least 1 ms once a wait was asked for.
                let wait = if timeout.is_zero() { 0 } else { ms(left).max(1) };
                let req = pb::StoreGetRequest { scope: Some(self.scope.clone()), key: key.into(), timeout_ms: wait };
                async move { c.store_get(req).await }
            })
            .await?;
        Ok(r.value)
    }

    /// Gets a key if it exists, without waiting.
    pub async fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, RdzvError> {
        match self.get(key, Duration::ZERO).await {
            Ok(v) => Ok(Some(v)),
            Err(RdzvError::Rpc { code: tonic::Code::NotFound, message }) if message.starts_with("key ") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Adds `delta` to an integer key (created at 0) and returns the new value. Retries are not
    /// applied twice.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, RdzvError> {
        let id = request_id();
        let r = self
            .client
            .call("store add", Duration::ZERO, |mut c, _| {
                let req = pb::StoreAddRequest { scope: Some(self.scope.clone()), key: key.into(), delta, request_id: id.clone() };
                async move { c.store_add(req).await }
            })
            .await?;
        Ok(r.value)
    }

    /// Sets `key` to `desired` if it holds `expected` (`None`: if it does not exist). Returns whether
    /// it swapped and the value after the call.
    pub async fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<(bool, Option<Vec<u8>>), RdzvError> {
        let id = request_id();
        let r = self
            .client
            .call("store compare-set", Duration::ZERO, |mut c, _| {
                let req = pb::StoreCompareSetRequest {
                    scope: Some(self.scope.clone()),
                    key: key.into(),
                    expected: expected.map(<[u8]>::to_vec),
                    desired: desired.to_vec(),
                    request_id: id.clone(),
                };
                async move { c.store_compare_set(req).await }
            })
            .await?;
        Ok((r.swapped, r.current))
    }

    /// Waits until every key exists.
    pub async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), RdzvError> {
        self.client
            .call("store wait", timeout, |mut c, left| {
                let req = pb::StoreWaitRequest {
                    scope: Some(self.scope.clone()),
                    keys: keys.iter().map(|k| k.to_string()).collect(),
                    timeout_ms: ms(left).max(1),
                };
                async move { c.store_wait(req).await }
            })
            .await
            .map(|_| ())
    }

    /// Deletes a key; `true` when it existed (when this call's first applied attempt found it:
    /// a retry answers that attempt's result).
    pub async fn delete(&self, key: &str) -> Result<bool, RdzvError> {
        let id = request_id();
        let r = self
            .client
            .call("store delete", Duration::ZERO, |mut c, _| {
                let req = pb::StoreDeleteRequest { scope: Some(self.scope.clone()), key: key.into(), request_id: id.clone() };
                async move { c.store_delete(req).await }
            })
            .await?;
        Ok(r.deleted)
    }

    /// Gets several keys, waiting up to `timeout` for each.
    pub async fn multi_get(&self, keys: &[&str], timeout: Duration) -> Result<Vec<Vec<u8>>, RdzvError> {
        let r = self
            .client
            .call("store multi-get", timeout, |mut c, left| {
                let wait = if timeout.is_zero() { 0 } else { ms(left).max(1) };
                let req = pb::StoreMultiGetRequest {
                    scope: Some(self.scope.clone()),
                    keys: keys.iter().map(|k| k.to_string()).collect(),
                    timeout_ms: wait,
                };
                async move { c.store_multi_get(req).await }
            })
            .await?;
        Ok(r.values)
    }

    /// Sets several keys at once (all or nothing). Retries are not applied twice, as for
    /// [`StoreClient::set`].
    pub async fn multi_set(&self, entries: &[(&str, &[u8])]) -> Result<(), RdzvError> {
        let id = request_id();
        self.client
            .call("store multi-set", Duration::ZERO, |mut c, _| {
                let req = pb::StoreMultiSetRequest {
                    scope: Some(self.scope.clone()),
                    entries: entries.iter().map(|(k, v)| pb::KeyValue { key: k.to_string(), value: v.to_vec() }).collect(),
                    request_id: id.clone(),
                };
                async move { c.store_multi_set(req).await }
            })
            .await
            .map(|_| ())
    }

    /// Keys in the store's scope.
    pub async fn num_keys(&self) -> Result<u64, RdzvError> {
        let r = self
            .client
            .call("store num-keys", Duration::ZERO, |mut c, _| {
                let req = pb::StoreNumKeysRequest { scope: Some(self.scope.clone()) };
                async move { c.store_num_keys(req).await }
            })
            .await?;
        Ok(r.num_keys)
    }

    /// Waits at barrier `name` until `participants` distinct members arrived. Returns the barrier's
    /// generation after release.
    pub async fn barrier(&self, name: &str, member: &str, participants: u32, timeout: Duration) -> Result<u64, RdzvError> {
        let id = request_id();
        let r = self
            .client
            .call("barrier", timeout, |mut c, left| {
                let req = pb::BarrierRequest {
                    scope: Some(self.scope.clone()),
                    name: name.into(),
                    member: member.into(),
                    participants,
                    timeout_ms: ms(left).max(1),
                    request_id: id.clone(),
                };
                async move { c.barrier(req).await }
            })
            .await?;
        Ok(r.generation)
    }

    /// Publishes the round's NCCL unique id (global rank 0 only, from `node`, the member of the
    /// round that runs it; write-once).
    pub async fn publish_unique_id(&self, name: &str, node: &str, rank: u32, id: &[u8]) -> Result<(), RdzvError> {
        self.client
            .call("publish unique id", Duration::ZERO, |mut c, _| {
                let req = pb::PublishUniqueIdRequest {
                    job_id: self.scope.job_id.clone(),
                    round: self.scope.round,
                    rank,
                    unique_id: id.to_vec(),
                    name: name.into(),
                    node_id: node.into(),
                };
                async move { c.publish_unique_id(req).await }
            })
            .await
            .map(|_| ())
    }

    /// Waits for the round's NCCL unique id.
    pub async fn get_unique_id(&self, name: &str, timeout: Duration) -> Result<Vec<u8>, RdzvError> {
        let r = self
            .client
            .call("get unique id", timeout, |mut c, left| {
                let req = pb::GetUniqueIdRequest {
                    job_id: self.scope.job_id.clone(),
                    round: self.scope.round,
                    name: name.into(),
                    timeout_ms: ms(left).max(1),
                };
                async move { c.get_unique_id(req).await }
            })
            .await?;
        Ok(r.unique_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA file with an http:// endpoint is refused (the connector would ignore the CA and
    /// send everything, the token too, in clear); a config, a client and its debug output never
    /// show the token; a token past the header limit is named.
    #[tokio::test]
    async fn tls_is_never_silently_dropped_and_the_token_never_shown() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").unwrap();
        let mut cfg = ClientConfig::new("http://head:29400");
        cfg.tls_ca = Some(ca);
        cfg.token = Some("s3cret-token-0123456789".into());
        let e = RdzvClient::connect(cfg.clone()).unwrap_err().to_string();
        assert!(e.contains("http:// with a TLS CA"), "{e}");
        assert!(!format!("{cfg:?}").contains("s3cret"), "{cfg:?}");
        let plain = ClientConfig { token: Some("s3cret-token-0123456789".into()), ..ClientConfig::new("127.0.0.1:1") };
        let client = RdzvClient::connect(plain).unwrap();
        assert!(!format!("{client:?}").contains("s3cret"), "{client:?}");
        let huge = ClientConfig { token: Some("t".repeat(crate::auth::MAX_TOKEN_BYTES + 1)), ..ClientConfig::new("127.0.0.1:1") };
        assert!(RdzvClient::connect(huge).unwrap_err().to_string().contains("at most 4096 travel in a header"));
    }
    use tonic::metadata::{MetadataMap, MetadataValue};

    fn stamped(epoch: u64) -> MetadataMap {
        let mut m = MetadataMap::new();
        let stamp = pb::LeaderStamp { epoch, leader_endpoint: "h:1".into() }.encode_to_vec();
        m.insert_bin(crate::service::LEADER_STAMP_KEY, MetadataValue::from_bytes(&stamp));
        m
    }

    #[tokio::test]
    async fn answers_of_an_older_epoch_are_refused() {
        let c = RdzvClient::connect(ClientConfig::new("127.0.0.1:1,127.0.0.1:2")).unwrap();
        assert!(c.conns.check_epoch(&stamped(5)).is_ok());
        assert!(c.conns.check_epoch(&stamped(7)).is_ok());
        assert!(c.conns.check_epoch(&stamped(7)).is_ok());
        assert_eq!(c.conns.check_epoch(&stamped(5)), Err(RdzvError::StaleEpoch { got: 5, seen: 7 }));
        // A daemon that is not highly available stamps nothing.
        assert!(c.conns.check_epoch(&MetadataMap::new()).is_ok());
        assert_eq!(c.epoch(), 7);
    }

    #[tokio::test]
    async fn a_leader_hint_selects_the_listed_daemon_or_adds_it() {
        let c = RdzvClient::connect(ClientConfig::new(" 127.0.0.1:1 , http://127.0.0.1:2 ")).unwrap();
        assert_eq!(c.current_endpoint(), "127.0.0.1:1");
        assert!(c.conns.go_to("127.0.0.1:2", &c.cfg), "the hint names the second daemon");
        assert_eq!(c.current_endpoint(), "http://127.0.0.1:2");
        assert!(!c.conns.go_to("127.0.0.1:2", &c.cfg), "already there");
        assert!(c.conns.go_to("127.0.0.1:3", &c.cfg), "a daemon the list lacks is added");
        assert_eq!(c.current_endpoint(), "127.0.0.1:3");
        assert_eq!(c.conns.len(), 3);
        // A failed endpoint moves the client on, round the list.
        c.conns.rotate(2);
        assert_eq!(c.current_endpoint(), "127.0.0.1:1");
        assert!(RdzvClient::connect(ClientConfig::new(" , ")).is_err());
    }
}
