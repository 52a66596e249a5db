//! A thin typed layer over the generated etcd v3 client (`rsrun_proto::etcd`): endpoint failover,
//! `hasleader`, TLS and password auth with token refresh, per-call deadlines, paginated
//! revision-pinned ranges, a bidirectional watch, and Txn builders.
//!
//! Every call is one attempt on the current endpoint; an answer that never came ([`EtcdError::Uncertain`])
//! moves to the next endpoint, and whether to try again is the caller's decision (a write may have
//! been applied: the log retries the same bytes, see `log.rs`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use rsrun_proto::etcd::etcdserverpb as epb;
use rsrun_proto::etcd::mvccpb;
use tokio::sync::mpsc;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Request, Status};

use crate::RdzvError;

/// The generated etcd API, for tests and tools that talk to etcd beside a daemon.
pub use rsrun_proto::etcd::{etcdserverpb, mvccpb as kv};

/// Largest answer accepted from etcd (a page of log keys, a snapshot chunk range).
const MAX_DECODE: usize = 256 << 20;

/// How to reach etcd.
#[derive(Debug, Clone, Default)]
pub struct EtcdConfig {
    /// `host:port` or `http(s)://host:port`, one per member.
    pub endpoints: Vec<String>,
    /// CA certificate (PEM) verifying the members; implies https.
    pub ca: Option<PathBuf>,
    /// Client certificate and key (PEM) for mTLS (etcd maps the CN to a user with
    /// `--client-cert-auth`).
    pub cert_key: Option<(PathBuf, PathBuf)>,
    /// User name and password (etcd's password auth; the token is refreshed when it expires).
    pub user: Option<(String, String)>,
    /// Deadline of one unary call.
    pub request_timeout: Duration,
}

/// What went wrong with one etcd call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdError {
    /// No answer (transport error, deadline, election in progress): a write may or may not have
    /// been applied.
    Uncertain(String),
    /// The revision asked for was compacted away.
    Compacted(String),
    /// etcd refused the request (permission, size, malformed): it was not applied.
    Refused(String),
}

impl std::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdError::Uncertain(m) => write!(f, "etcd did not answer: {m}"),
            EtcdError::Compacted(m) => write!(f, "etcd history compacted: {m}"),
            EtcdError::Refused(m) => write!(f, "etcd refused the request: {m}"),
        }
    }
}

impl From<EtcdError> for RdzvError {
    fn from(e: EtcdError) -> Self {
        RdzvError::Unavailable(e.to_string())
    }
}

fn classify(endpoint: &str, s: &Status) -> EtcdError {
    let m = format!("{endpoint}: {} ({:?})", s.message(), s.code());
    match s.code() {
        _ if s.message().contains("required revision has been compacted") => EtcdError::Compacted(m),
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Aborted | Code::Internal => {
            EtcdError::Uncertain(m)
        }
        _ => EtcdError::Refused(m),
    }
}

fn auth_expired(s: &Status) -> bool {
    s.code() == Code::Unauthenticated || s.message().contains("invalid auth token") || s.message().contains("user name is empty")
}

/// Adds `hasleader` (a member cut off from the etcd leader refuses instead of serving stale
/// watches) and the auth token to every call.
#[derive(Debug, Clone)]
pub struct EtcdMeta {
    token: Arc<RwLock<Option<AsciiMetadataValue>>>,
}

impl tonic::service::Interceptor for EtcdMeta {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert("hasleader", MetadataValue::from_static("true"));
        if let Some(t) = self.token.read().unwrap_or_else(|p| p.into_inner()).clone() {
            req.metadata_mut().insert("token", t);
        }
        Ok(req)
    }
}

type Ch = InterceptedService<Channel, EtcdMeta>;

struct Shared {
    cfg: EtcdConfig,
    channels: Vec<(String, Channel)>,
    current: AtomicUsize,
    token: Arc<RwLock<Option<AsciiMetadataValue>>>,
    auth_lock: tokio::sync::Mutex<()>,
}

/// A connection to an etcd cluster (cheap to clone).
#[derive(Clone)]
pub struct Etcd {
    s: Arc<Shared>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd").field("endpoints", &self.s.cfg.endpoints).finish()
    }
}

/// A range end that makes `[prefix, end)` every key starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// `create_revision(key) == rev` (0: the key is absent).
pub fn created_at(key: &[u8], rev: i64) -> epb::Compare {
    epb::Compare {
        result: epb::compare::CompareResult::Equal as i32,
        target: epb::compare::CompareTarget::Create as i32,
        key: key.to_vec(),
        target_union: Some(epb::compare::TargetUnion::CreateRevision(rev)),
        range_end: Vec::new(),
    }
}

/// `mod_revision(key) == rev` (0: the key is absent).
pub fn modified_at(key: &[u8], rev: i64) -> epb::Compare {
    epb::Compare {
        result: epb::compare::CompareResult::Equal as i32,
        target: epb::compare::CompareTarget::Mod as i32,
        key: key.to_vec(),
        target_union: Some(epb::compare::TargetUnion::ModRevision(rev)),
        range_end: Vec::new(),
    }
}

/// A put inside a Txn.
pub fn put_op(key: &[u8], value: Vec<u8>, lease: i64) -> epb::RequestOp {
    epb::RequestOp {
        request: Some(epb::request_op::Request::RequestPut(epb::PutRequest { key: key.to_vec(), value, lease, ..Default::default() })),
    }
}

/// A read of one key inside a Txn.
pub fn get_op(key: &[u8]) -> epb::RequestOp {
    epb::RequestOp { request: Some(epb::request_op::Request::RequestRange(epb::RangeRequest { key: key.to_vec(), ..Default::default() })) }
}

/// A delete of `[key, end)` inside a Txn.
pub fn delete_op(key: &[u8], end: &[u8]) -> epb::RequestOp {
    epb::RequestOp {
        request: Some(epb::request_op::Request::RequestDeleteRange(epb::DeleteRangeRequest {
            key: key.to_vec(),
            range_end: end.to_vec(),
            prev_kv: false,
        })),
    }
}

/// The key-values a Txn's `i`-th response (a range) returned.
pub fn txn_range(resp: &epb::TxnResponse, i: usize) -> Vec<mvccpb::KeyValue> {
    match resp.responses.get(i).and_then(|r| r.response.as_ref()) {
        Some(epb::response_op::Response::ResponseRange(r)) => r.kvs.clone(),
        _ => Vec::new(),
    }
}

fn uri(raw: &str, tls: bool) -> String {
    let raw = raw.trim();
    if raw.starts_with("http://") || raw.starts_with("https://") {
        raw.to_owned()
    } else {
        format!("{}://{raw}", if tls { "https" } else { "http" })
    }
}

impl Etcd {
    /// Prepares lazily connecting channels to every endpoint.
    ///
    /// # Errors
    /// No endpoint, a malformed endpoint, or unreadable TLS files.
    pub fn connect(cfg: EtcdConfig) -> Result<Etcd, RdzvError> {
        if cfg.endpoints.is_empty() {
            return Err(RdzvError::invalid("etcd_endpoints", "empty; expected HOST:PORT[,HOST:PORT...]"));
        }
        let read = |p: &PathBuf, what: &str| {
            crate::files::read_bounded(p).map_err(|e| RdzvError::invalid("etcd_tls", format!("cannot read the {what} {}: {e}", p.display())))
        };
        let ca = cfg.ca.as_ref().map(|p| read(p, "CA certificate")).transpose()?;
        let identity = match &cfg.cert_key {
            Some((c, k)) => Some(Identity::from_pem(read(c, "client certificate")?, read(k, "client key")?)),
            None => None,
        };
        // No system roots are loaded: etcd's certificate is verified against --etcd-ca only.
        if identity.is_some() && ca.is_none() {
            return Err(RdzvError::invalid("etcd_tls", "--etcd-cert without --etcd-ca: expected the CA that signed etcd's certificate too"));
        }
        let tls = ca.is_some() || identity.is_some();
        let mut channels = Vec::new();
        for raw in &cfg.endpoints {
            let u = uri(raw, tls);
            let bad = |m: String| RdzvError::invalid("etcd_endpoints", format!("{raw:?}: {m}; expected HOST:PORT or https://HOST:PORT"));
            // tonic speaks TLS by the scheme alone: an http:// endpoint would send the password
            // in the clear despite the TLS files, and https:// without a CA cannot verify etcd.
            let scheme = raw.trim();
            if tls && scheme.starts_with("http://") {
                return Err(bad("http:// with --etcd-ca/--etcd-cert would not use TLS".into()));
            }
            if ca.is_none() && scheme.starts_with("https://") {
                return Err(bad("https:// needs --etcd-ca, the CA that signed etcd's certificate".into()));
            }
            let parsed: tonic::codegen::http::Uri = u.parse().map_err(|e| bad(format!("{e}")))?;
            let host = parsed.host().filter(|h| !h.is_empty()).ok_or_else(|| bad("no host".into()))?.to_owned();
            if parsed.port_u16().is_none() {
                return Err(bad("no port".into()));
            }
            let mut ep = Endpoint::from_shared(u.clone())
                .map_err(|e| bad(e.to_string()))?
                .connect_timeout(cfg.request_timeout.min(Duration::from_secs(3)))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(2))
                .keep_alive_timeout(Duration::from_secs(3))
                .keep_alive_while_idle(true);
            if tls {
                let mut t = ClientTlsConfig::new().domain_name(host.trim_start_matches('[').trim_end_matches(']').to_owned());
                if let Some(ca) = &ca {
                    t = t.ca_certificate(Certificate::from_pem(ca.clone()));
                }
                if let Some(id) = &identity {
                    t = t.identity(id.clone());
                }
                ep = ep.tls_config(t).map_err(|e| bad(format!("TLS configuration: {e}")))?;
            }
            channels.push((raw.clone(), ep.connect_lazy()));
        }
        Ok(Etcd {
            s: Arc::new(Shared {
                cfg,
                channels,
                current: AtomicUsize::new(0),
                token: Arc::new(RwLock::new(None)),
                auth_lock: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The endpoints, as configured.
    pub fn endpoints(&self) -> &[String] {
        &self.s.cfg.endpoints
    }

    fn pick(&self) -> (usize, String, Ch) {
        let i = self.s.current.load(Ordering::Relaxed) % self.s.channels.len();
        let (name, ch) = &self.s.channels[i];
        (i, name.clone(), InterceptedService::new(ch.clone(), EtcdMeta { token: self.s.token.clone() }))
    }

    /// Moves on to the next endpoint (after a call on endpoint `i` got no answer).
    fn rotate(&self, i: usize) {
        let n = self.s.channels.len();
        let _ = self.s.current.compare_exchange(i, (i + 1) % n, Ordering::Relaxed, Ordering::Relaxed);
    }

    async fn authenticate(&self, stale: Option<AsciiMetadataValue>) -> Result<(), EtcdError> {
        let Some((user, password)) = self.s.cfg.user.clone() else { return Ok(()) };
        let _g = self.s.auth_lock.lock().await;
        // Someone refreshed it meanwhile.
        let now = self.s.token.read().unwrap_or_else(|p| p.into_inner()).clone();
        if now.is_some() && now != stale {
            return Ok(());
        }
        let (i, name, _) = self.pick();
        let (_, ch) = &self.s.channels[i];
        let mut c = epb::auth_client::AuthClient::new(ch.clone());
        let req = epb::AuthenticateRequest { name: user.clone(), password };
        let r = tokio::time::timeout(self.s.cfg.request_timeout, c.authenticate(req)).await;
        let token = match r {
            Err(_) => {
                self.rotate(i);
                return Err(EtcdError::Uncertain(format!("{name}: authenticate timed out")));
            }
            Ok(Err(s)) => {
                let e = classify(&name, &s);
                if matches!(e, EtcdError::Uncertain(_)) {
                    self.rotate(i);
                }
                return Err(e);
            }
            Ok(Ok(resp)) => resp.into_inner().token,
        };
        let v: AsciiMetadataValue = token
            .parse()
            .map_err(|_| EtcdError::Refused(format!("{name}: the auth token of user {user:?} cannot travel in a header")))?;
        *self.s.token.write().unwrap_or_else(|p| p.into_inner()) = Some(v);
        Ok(())
    }

    /// One unary call on the current endpoint within `timeout`, authenticating first when needed
    /// (and once more when the token expired).
    async fn unary<T, F, Fut>(&self, timeout: Duration, mut f: F) -> Result<T, EtcdError>
    where
        F: FnMut(Ch) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        if self.s.cfg.user.is_some() && self.s.token.read().unwrap_or_else(|p| p.into_inner()).is_none() {
            self.authenticate(None).await?;
        }
        for attempt in 0..2 {
            let token = self.s.token.read().unwrap_or_else(|p| p.into_inner()).clone();
            let (i, name, ch) = self.pick();
            match tokio::time::timeout(timeout, f(ch)).await {
                Err(_) => {
                    self.rotate(i);
                    return Err(EtcdError::Uncertain(format!("{name}: no answer within {timeout:?}")));
                }
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(s)) if attempt == 0 && self.s.cfg.user.is_some() && auth_expired(&s) => {
                    self.authenticate(token).await?;
                }
                Ok(Err(s)) => {
                    let e = classify(&name, &s);
                    if matches!(e, EtcdError::Uncertain(_)) {
                        self.rotate(i);
                    }
                    return Err(e);
                }
            }
        }
        Err(EtcdError::Refused("authentication failed twice".into()))
    }

    /// One Txn.
    pub async fn txn(&self, req: epb::TxnRequest) -> Result<epb::TxnResponse, EtcdError> {
        self.unary(self.s.cfg.request_timeout, |ch| {
            let mut c = epb::kv_client::KvClient::new(ch).max_decoding_message_size(MAX_DECODE).max_encoding_message_size(MAX_DECODE);
            let req = req.clone();
            async move { c.txn(req).await }
        })
        .await
    }

    /// One Range.
    pub async fn range(&self, req: epb::RangeRequest) -> Result<epb::RangeResponse, EtcdError> {
        self.unary(self.s.cfg.request_timeout.max(Duration::from_secs(10)), |ch| {
            let mut c = epb::kv_client::KvClient::new(ch).max_decoding_message_size(MAX_DECODE);
            let req = req.clone();
            async move { c.range(req).await }
        })
        .await
    }

    /// One Put (tests and set-up; the leader's writes are guarded Txns).
    pub async fn put(&self, key: &[u8], value: Vec<u8>) -> Result<epb::PutResponse, EtcdError> {
        let req = epb::PutRequest { key: key.to_vec(), value, ..Default::default() };
        self.unary(self.s.cfg.request_timeout, |ch| {
            let mut c = epb::kv_client::KvClient::new(ch).max_encoding_message_size(MAX_DECODE);
            let req = req.clone();
            async move { c.put(req).await }
        })
        .await
    }

    /// Compacts the history up to `revision` (tests only: a daemon never compacts).
    pub async fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        self.unary(self.s.cfg.request_timeout, |ch| {
            let mut c = epb::kv_client::KvClient::new(ch);
            async move { c.compact(epb::CompactionRequest { revision, physical: true }).await }
        })
        .await
        .map(|_| ())
    }

    /// Every key of `[key, end)` at `revision` (0: now), in pages of `page` keys, all read at the
    /// same revision (the first page's, when `revision` is 0). Returns the key-values and the
    /// revision read at.
    ///
    /// # Errors
    /// Transport errors (no retry here), or the revision was compacted.
    pub async fn range_all(&self, key: &[u8], end: &[u8], revision: i64, page: i64) -> Result<(Vec<mvccpb::KeyValue>, i64), EtcdError> {
        let mut out = Vec::new();
        let mut from = key.to_vec();
        let mut rev = revision;
        loop {
            let req = epb::RangeRequest { key: from.clone(), range_end: end.to_vec(), limit: page, revision: rev, ..Default::default() };
            let resp = self.range(req).await?;
            if rev <= 0 {
                rev = resp.header.as_ref().map(|h| h.revision).unwrap_or(0);
            }
            let more = resp.more;
            if let Some(last) = resp.kvs.last() {
                from = last.key.clone();
                from.push(0);
            }
            let empty = resp.kvs.is_empty();
            out.extend(resp.kvs);
            if !more || empty {
                return Ok((out, rev));
            }
        }
    }

    /// Grants a lease; returns its id and the TTL etcd chose (at least its minimum, 2 s by default).
    pub async fn lease_grant(&self, ttl_secs: i64) -> Result<(i64, i64), EtcdError> {
        let r = self
            .unary(self.s.cfg.request_timeout, |ch| {
                let mut c = epb::lease_client::LeaseClient::new(ch);
                async move { c.lease_grant(epb::LeaseGrantRequest { ttl: ttl_secs, id: 0 }).await }
            })
            .await?;
        if !r.error.is_empty() {
            return Err(EtcdError::Refused(r.error));
        }
        Ok((r.id, r.ttl))
    }

    /// Revokes a lease (its keys are deleted at once).
    pub async fn lease_revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.unary(self.s.cfg.request_timeout, |ch| {
            let mut c = epb::lease_client::LeaseClient::new(ch);
            async move { c.lease_revoke(epb::LeaseRevokeRequest { id }).await }
        })
        .await
        .map(|_| ())
    }

    /// Renews a lease once (a keep-alive stream of one request); returns the new TTL (0 or less:
    /// the lease is gone).
    pub async fn lease_keep_alive(&self, id: i64) -> Result<i64, EtcdError> {
        // Short: a member that does not answer at once is left for the next one well before the
        // fencing point.
        self.unary(self.s.cfg.request_timeout.min(Duration::from_secs(1)), |ch| {
            let mut c = epb::lease_client::LeaseClient::new(ch);
            async move {
                let req = futures::stream::iter([epb::LeaseKeepAliveRequest { id }]).chain(futures::stream::pending());
                let mut stream = c.lease_keep_alive(req).await?.into_inner();
                match stream.message().await? {
                    Some(r) => Ok(tonic::Response::new(r)),
                    None => Err(Status::unavailable("the keep-alive stream ended without an answer")),
                }
            }
        })
        .await
        .map(|r| r.ttl)
    }

    /// The status of every member that answers: `(endpoint, member id, leader id)`.
    pub async fn member_status(&self) -> Vec<(String, u64, u64)> {
        let mut out = Vec::new();
        for (name, ch) in &self.s.channels {
            let mut c = epb::maintenance_client::MaintenanceClient::new(InterceptedService::new(ch.clone(), EtcdMeta { token: self.s.token.clone() }));
            if let Ok(Ok(r)) = tokio::time::timeout(self.s.cfg.request_timeout, c.status(epb::StatusRequest {})).await {
                let r = r.into_inner();
                out.push((name.clone(), r.header.map(|h| h.member_id).unwrap_or(0), r.leader));
            }
        }
        out
    }

    /// Opens a watch on the current endpoint and waits for its creation.
    ///
    /// # Errors
    /// No answer, or the start revision was compacted ([`EtcdError::Compacted`]).
    pub async fn watch(&self, create: epb::WatchCreateRequest) -> Result<WatchStream, EtcdError> {
        if self.s.cfg.user.is_some() && self.s.token.read().unwrap_or_else(|p| p.into_inner()).is_none() {
            self.authenticate(None).await?;
        }
        let (i, name, ch) = self.pick();
        let (tx, rx) = mpsc::channel::<epb::WatchRequest>(16);
        let first = epb::WatchRequest { request_union: Some(epb::watch_request::RequestUnion::CreateRequest(create)) };
        tx.send(first).await.map_err(|_| EtcdError::Uncertain("watch request channel closed".into()))?;
        let mut c = epb::watch_client::WatchClient::new(ch).max_decoding_message_size(MAX_DECODE);
        let opened = tokio::time::timeout(self.s.cfg.request_timeout.max(Duration::from_secs(5)), async {
            let mut stream = c.watch(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
            let created = stream.message().await?;
            Ok::<_, Status>((stream, created))
        })
        .await;
        let (stream, created) = match opened {
            Err(_) => {
                self.rotate(i);
                return Err(EtcdError::Uncertain(format!("{name}: the watch was not created in time")));
            }
            Ok(Err(s)) => {
                if self.s.cfg.user.is_some() && auth_expired(&s) {
                    let t = self.s.token.read().unwrap_or_else(|p| p.into_inner()).clone();
                    let _ = self.authenticate(t).await;
                }
                let e = classify(&name, &s);
                if matches!(e, EtcdError::Uncertain(_)) {
                    self.rotate(i);
                }
                return Err(e);
            }
            Ok(Ok(x)) => x,
        };
        let Some(created) = created else {
            self.rotate(i);
            return Err(EtcdError::Uncertain(format!("{name}: the watch stream ended before it was created")));
        };
        if created.compact_revision != 0 {
            return Err(EtcdError::Compacted(format!("{name}: watch start compacted (history begins at {})", created.compact_revision)));
        }
        if created.canceled {
            self.rotate(i);
            return Err(EtcdError::Uncertain(format!("{name}: the watch was cancelled: {}", created.cancel_reason)));
        }
        Ok(WatchStream { tx, stream, endpoint: name, index: i, etcd: self.clone() })
    }
}

/// An open watch.
pub struct WatchStream {
    tx: mpsc::Sender<epb::WatchRequest>,
    stream: tonic::Streaming<epb::WatchResponse>,
    endpoint: String,
    index: usize,
    etcd: Etcd,
}

impl std::fmt::Debug for WatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchStream").field("endpoint", &self.endpoint).finish()
    }
}

impl WatchStream {
    /// The next response; an error or the end of the stream means the watch is gone (and the
    /// connection moves on to the next endpoint).
    pub async fn next(&mut self) -> Result<epb::WatchResponse, EtcdError> {
        // A watch created with `fragment` gets a large response in pieces (each under etcd's
        // request size): they are joined here, so callers see whole revisions.
        let mut joined: Option<epb::WatchResponse> = None;
        loop {
            let r = match self.stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.etcd.rotate(self.index);
                    return Err(EtcdError::Uncertain(format!("{}: the watch stream ended", self.endpoint)));
                }
                Err(s) => {
                    let e = classify(&self.endpoint, &s);
                    self.etcd.rotate(self.index);
                    return Err(e);
                }
            };
            if r.compact_revision != 0 {
                return Err(EtcdError::Compacted(format!("{}: history compacted up to {}", self.endpoint, r.compact_revision)));
            }
            if r.canceled {
                self.etcd.rotate(self.index);
                return Err(EtcdError::Uncertain(format!("{}: the watch was cancelled: {}", self.endpoint, r.cancel_reason)));
            }
            let last = !r.fragment;
            let whole = match joined.take() {
                None => r,
                Some(mut j) => {
                    j.events.extend(r.events);
                    j.header = r.header;
                    j
                }
            };
            if last {
                return Ok(epb::WatchResponse { fragment: false, ..whole });
            }
            joined = Some(whole);
        }
    }

    /// Asks for a progress notification (a response with the current revision and no events).
    /// Never waits: a request stream that stopped draining must not stall the caller's loop (the
    /// connection's keepalive ends such a watch; a request that does not fit is simply not sent).
    pub fn request_progress(&self) {
        let req = epb::WatchRequest { request_union: Some(epb::watch_request::RequestUnion::ProgressRequest(epb::WatchProgressRequest {})) };
        let _ = self.tx.try_send(req);
    }

    /// The endpoint the watch runs on.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect(endpoint: &str, ca: Option<PathBuf>) -> Result<Etcd, RdzvError> {
        Etcd::connect(EtcdConfig {
            endpoints: vec![endpoint.to_owned()],
            ca,
            request_timeout: Duration::from_secs(1),
            ..EtcdConfig::default()
        })
    }

    #[tokio::test]
    async fn the_scheme_must_agree_with_the_tls_files() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let key = rcgen::KeyPair::generate().unwrap();
        std::fs::write(&ca, rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap().pem()).unwrap();
        let e = connect("http://etcd-a:2379", Some(ca.clone())).err().unwrap().to_string();
        assert!(e.contains("\"http://etcd-a:2379\"") && e.contains("would not use TLS"), "{e}");
        let e = connect("https://etcd-a:2379", None).err().unwrap().to_string();
        assert!(e.contains("\"https://etcd-a:2379\"") && e.contains("needs --etcd-ca"), "{e}");
        // Without a scheme the TLS files pick it; matching schemes are accepted.
        let cert = dir.path().join("cert.pem");
        std::fs::write(&cert, b"").unwrap();
        let e = Etcd::connect(EtcdConfig {
            endpoints: vec!["etcd-a:2379".into()],
            cert_key: Some((cert.clone(), cert)),
            ..EtcdConfig::default()
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("--etcd-cert without --etcd-ca"), "{e}");
        for (endpoint, ca) in [("etcd-a:2379", Some(ca.clone())), ("etcd-a:2379", None), ("https://etcd-a:2379", Some(ca)), ("http://etcd-a:2379", None)] {
            connect(endpoint, ca).unwrap();
        }
    }
}
