//! Serving: listener, token auth, TLS, metrics endpoint, graceful shutdown; and the embedded
//! in-memory service the launcher runs for `--standalone`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rsrun_proto::v1::rendezvous_server::RendezvousServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Identity, Server, ServerTlsConfig};

use crate::RdzvError;
use crate::auth::{AuthInterceptor, TokenTable};
use crate::ha::{self, HaConfig};
use crate::metrics::Metrics;
use crate::service::{Core, CoreConfig, Service};
use crate::tcpstore::TcpStoreLimits;
use crate::validate::Limits;

/// Everything `rsrun-rendezvous serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Durable state directory; `None` keeps state in memory.
    pub data_dir: Option<PathBuf>,
    /// Token file; `None` accepts every caller.
    pub token_file: Option<PathBuf>,
    /// TLS certificate and key (PEM).
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Prometheus text endpoint.
    pub metrics_listen: Option<SocketAddr>,
    /// Allow a non-loopback listener without a token or without TLS (an embedded service, like
    /// torchrun's agent store, or a trusted network).
    pub insecure: bool,
    /// Limits.
    pub limits: Limits,
    /// Serve PyTorch's TCPStore for every running round (`None`: the jobs' rank 0 hosts it).
    pub tcpstore: Option<TcpStoreLimits>,
    /// Serve this job only (an embedded service hosted by a launcher for its own job): calls naming
    /// another job are refused with `PERMISSION_DENIED` naming both jobs.
    pub only_job: Option<String>,
    /// Highly available: keep the log in etcd, as the leader or a standby of a group of daemons
    /// (exclusive with `data_dir`).
    pub ha: Option<HaConfig>,
}

impl ServerConfig {
    /// An in-memory, unauthenticated configuration listening on `listen`.
    pub fn in_memory(listen: SocketAddr) -> Self {
        ServerConfig {
            listen,
            data_dir: None,
            token_file: None,
            tls: None,
            metrics_listen: None,
            insecure: false,
            limits: Limits::default(),
            tcpstore: Some(TcpStoreLimits::default()),
            only_job: None,
            ha: None,
        }
    }
}

/// HA: the largest store value (a log record must fit an etcd request with room to spare).
pub const HA_MAX_VALUE_BYTES: usize = 512 << 10;
/// HA: the default largest store value.
pub const HA_DEFAULT_VALUE_BYTES: usize = 256 << 10;
/// HA: the default store bytes per job.
pub const HA_DEFAULT_STORE_BYTES_PER_JOB: usize = 16 << 20;
/// HA: store writes are refused once all jobs together hold this much (snapshots and etcd
/// history stay well under etcd's 2 GiB quota).
pub const HA_MAX_TOTAL_STORE_BYTES: usize = 512 << 20;

/// Where the server ended up listening.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// The gRPC address.
    pub addr: SocketAddr,
    /// The metrics address, when enabled.
    pub metrics_addr: Option<SocketAddr>,
}

/// Binds, recovers state and serves until `shutdown` is cancelled. `on_bound` is called once the
/// listeners are bound (the binary prints the address there).
///
/// # Errors
/// Bad configuration (a non-loopback address without a token and TLS unless `insecure`, unreadable
/// token or TLS files), a listener that cannot bind, or a data directory that cannot be recovered.
pub async fn serve(config: ServerConfig, shutdown: CancellationToken, on_bound: impl FnOnce(Bound)) -> Result<(), RdzvError> {
    let tokens = config.token_file.as_deref().map(TokenTable::load).transpose()?;
    if !config.listen.ip().is_loopback() && tokens.is_none() && !config.insecure {
        return Err(RdzvError::invalid(
            "listen",
            format!(
                "{} is not a loopback address and no --token-file was given: anyone who can reach it could join jobs \
                 and read their keys. Give --token-file (and --tls-cert/--tls-key), or --insecure to accept the risk",
                config.listen
            ),
        ));
    }
    if !config.listen.ip().is_loopback() && config.tls.is_none() {
        if !config.insecure {
            return Err(RdzvError::invalid(
                "listen",
                format!(
                    "{} is not a loopback address and no --tls-cert/--tls-key were given: the tokens and every store \
                     value would cross the network in clear text, for anyone on the path to read and replay. Give \
                     --tls-cert and --tls-key (clients then pass --rdzv-tls-ca), or --insecure to accept the risk",
                    config.listen
                ),
            ));
        }
        tracing::warn!(listen = %config.listen, "serving without TLS on a non-loopback address (--insecure): tokens travel in clear text");
    }
    // The server and its TLS identity are built before anything binds, so an unusable certificate
    // or key is told before "listening on" is printed.
    let mut builder = Server::builder()
        .max_concurrent_streams(Some(4096))
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .trace_fn(|req| tracing::debug_span!("rpc", path = %req.uri().path()));
    if let Some((cert, key)) = &config.tls {
        builder = builder.tls_config(tls_identity(cert, key)?).map_err(|e| {
            RdzvError::invalid(
                "tls",
                format!("unusable certificate {} or key {}: {}", cert.display(), key.display(), error_chain(&e)),
            )
        })?;
    }
    let etcd = match &config.ha {
        None => None,
        Some(ha) => {
            if config.data_dir.is_some() {
                return Err(RdzvError::invalid("data_dir", "--data-dir and --etcd-endpoints exclude each other: HA daemons keep their log in etcd"));
            }
            if config.limits.max_value_bytes > HA_MAX_VALUE_BYTES {
                return Err(RdzvError::invalid(
                    "max_value_bytes",
                    format!("{} bytes; with --etcd-endpoints at most {HA_MAX_VALUE_BYTES} (a log batch must fit etcd's request limit)", config.limits.max_value_bytes),
                ));
            }
            Some(ha::etcd::Etcd::connect(ha.etcd.clone())?)
        }
    };
    // The store's deep backlog: a service of one job takes its round store's connections on this
    // port (`shared_port`), thousands of ranks at once.
    let listener = crate::tcpstore::server::listen_socket(config.listen)
        .and_then(TcpListener::from_std)
        .map_err(|e| RdzvError::invalid("listen", format!("cannot bind {}: {e}", config.listen)))?;
    let addr = listener.local_addr().map_err(|e| RdzvError::Unavailable(format!("listener address: {e}")))?;
    let mut ha_cfg = config.ha.clone();
    if let Some(h) = ha_cfg.as_mut() {
        if h.identity.advertise.is_empty() {
            if addr.ip().is_unspecified() {
                return Err(RdzvError::invalid(
                    "advertise",
                    format!("missing: the daemon listens on {addr} (every interface), so give --advertise HOST:PORT, the address clients reach it at"),
                ));
            }
            h.identity.advertise = addr.to_string();
        }
        if h.identity.daemon_id.is_empty() {
            h.identity.daemon_id = h.identity.advertise.clone();
        }
    }
    let tracker = TaskTracker::new();
    // A service of one job serves its running round's store on this port too (`shared_port`).
    let shared_job = config.only_job.clone().filter(|_| config.tcpstore.is_some() && config.ha.is_none());
    let core = Core::start(
        CoreConfig {
            data_dir: config.data_dir.clone(),
            limits: config.limits.clone(),
            tcpstore: config.tcpstore,
            listen: Some(addr.ip()),
            ha: ha_cfg.as_ref().map(|h| h.identity.clone()),
            max_total_store_bytes: ha_cfg.as_ref().map(|_| HA_MAX_TOTAL_STORE_BYTES),
            shared_store_port: shared_job.as_ref().map(|_| addr.port()),
        },
        shutdown.clone(),
        &tracker,
    )?;
    if let (Some(ha_cfg), Some(etcd)) = (ha_cfg, etcd) {
        // Up to 30 s while etcd is not reachable yet; a stop signal ends the wait.
        let prepared = tokio::select! {
            r = ha::prepare(&etcd, &ha_cfg.prefix, Duration::from_secs(30)) => r.map(|()| true),
            () = shutdown.cancelled() => Ok(false),
        };
        if !matches!(prepared, Ok(true)) {
            shutdown.cancel();
            tracker.close();
            tracker.wait().await;
            return prepared.map(|_| ());
        }
        ha::spawn(core.clone(), ha_cfg, etcd, shutdown.clone(), &tracker);
    }
    let metrics_addr = match config.metrics_listen {
        None => None,
        Some(m) => match spawn_metrics(m, core.metrics.clone(), shutdown.clone(), &tracker).await {
            Ok(a) => Some(a),
            Err(e) => {
                // The core's tasks stop first (they hold the data directory's lock): an embedded
                // caller may try again.
                shutdown.cancel();
                tracker.close();
                tracker.wait().await;
                return Err(e);
            }
        },
    };
    on_bound(Bound { addr, metrics_addr });
    tracing::info!(%addr, durable = config.data_dir.is_some(), ha = config.ha.is_some(), auth = tokens.is_some(), tls = config.tls.is_some(), "rendezvous service listening");
    // HA: a request (so a log record) must fit one etcd log batch.
    let decode_limit = if config.ha.is_some() { 1 << 20 } else { (config.limits.max_value_bytes + (1 << 20)).max(4 << 20) };
    let svc = RendezvousServer::new(Service::new(core.clone()))
        .max_decoding_message_size(decode_limit)
        .max_encoding_message_size(usize::MAX);
    let svc = InterceptedService::new(svc, AuthInterceptor::new(tokens).serving_only(config.only_job.as_deref()));
    let stop = shutdown.clone();
    let router = builder.add_service(svc);
    // tonic's own TCP_NODELAY applies only to the listeners it binds: the accept loop sets it
    // (small writes of watch streams would otherwise wait on delayed ACKs).
    let grpc = crate::shared_port::serve(listener, core.clone(), shared_job, shutdown.clone(), &tracker);
    let served = router
        .serve_with_incoming_shutdown(tokio_stream::wrappers::ReceiverStream::new(grpc), async move { stop.cancelled().await })
        .await;
    let result = served.map_err(|e| RdzvError::Unavailable(format!("server failed: {e}")));
    shutdown.cancel();
    tracker.close();
    tracker.wait().await;
    result
}

/// A server identity from PEM files, each checked for what it must hold: one or more certificates
/// in the first, a private key in the second (rustls reads them only when the first client connects).
fn tls_identity(cert: &Path, key: &Path) -> Result<ServerTlsConfig, RdzvError> {
    use rustls_pki_types::PrivateKeyDer;
    use rustls_pki_types::pem::PemObject;
    let read = |p: &Path, flag: &str| {
        crate::files::read_bounded(p).map_err(|e| RdzvError::invalid("tls", format!("cannot read {flag} {}: {e}", p.display())))
    };
    let (cert_pem, key_pem) = (read(cert, "--tls-cert")?, read(key, "--tls-key")?);
    crate::client::check_pem_certificates(&cert_pem)
        .map_err(|why| RdzvError::invalid("tls", format!("--tls-cert {} {why}", cert.display())))?;
    if let Err(e) = PrivateKeyDer::from_pem_slice(&key_pem) {
        return Err(RdzvError::invalid(
            "tls",
            format!("--tls-key {} holds no PEM private key (expected -----BEGIN PRIVATE KEY----- or an RSA/EC key): {e:?}", key.display()),
        ));
    }
    Ok(ServerTlsConfig::new().identity(Identity::from_pem(cert_pem, key_pem)))
}

/// An error and its sources, as one line (tonic's transport errors say just "transport error").
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

async fn spawn_metrics(addr: SocketAddr, metrics: Arc<Metrics>, shutdown: CancellationToken, tracker: &TaskTracker) -> Result<SocketAddr, RdzvError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| RdzvError::invalid("metrics_listen", format!("cannot bind {addr}: {e}")))?;
    let bound = listener.local_addr().map_err(|e| RdzvError::Unavailable(format!("metrics address: {e}")))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = metrics.clone();
            async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], m.render()) }
        }),
    );
    tracker.spawn(async move {
        let r = axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await;
        if let Err(e) = r {
            tracing::error!(error = %e, "metrics endpoint failed");
        }
    });
    Ok(bound)
}

/// An in-memory rendezvous service running inside this process (the launcher's `--standalone`).
/// It stops when dropped.
#[derive(Debug)]
pub struct EmbeddedServer {
    /// Where it listens.
    pub addr: SocketAddr,
    cancel: CancellationToken,
    handle: Option<tokio::task::JoinHandle<Result<(), RdzvError>>>,
}

impl EmbeddedServer {
    /// Stops the service and waits for it.
    pub async fn shutdown(mut self) -> Result<(), RdzvError> {
        self.cancel.cancel();
        match self.handle.take() {
            Some(h) => h.await.map_err(|e| RdzvError::Unavailable(format!("embedded server task: {e}")))?,
            None => Ok(()),
        }
    }
}

impl Drop for EmbeddedServer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Starts an in-memory service on `listen` (use port 0 for a free port) and returns once it listens.
pub async fn spawn_embedded(listen: SocketAddr) -> Result<EmbeddedServer, RdzvError> {
    spawn_with(ServerConfig::in_memory(listen)).await
}

/// Starts a service with any configuration inside this process and returns once it listens.
pub async fn spawn_with(config: ServerConfig) -> Result<EmbeddedServer, RdzvError> {
    let cancel = CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let c = cancel.clone();
    let handle = tokio::spawn(async move {
        serve(config, c, move |b| {
            let _ = tx.send(b.addr);
        })
        .await
    });
    match rx.await {
        Ok(addr) => Ok(EmbeddedServer { addr, cancel, handle: Some(handle) }),
        Err(_) => match handle.await {
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Err(RdzvError::Unavailable("embedded server stopped before listening".into())),
            Err(e) => Err(RdzvError::Unavailable(format!("embedded server task: {e}"))),
        },
    }
}
