//! The library a trainer embeds to run under `rsrun` (or `torchrun`).
//!
//! # Brief overview
//!
//! - [`WorkerContext::from_env`] reads the launcher's environment once into typed fields: rank, local
//!   rank, world sizes, node rank, restart count, job id, round.
//! - [`WorkerContext::store`] is a client of the job's key-value store in the rendezvous service
//!   (RSRUN_RDZV_ENDPOINT, authenticated with the token file in RSRUN_TOKEN_FILE);
//!   [`WorkerContext::barrier`] and [`WorkerContext::unique_id`] (the 128-byte NCCL id exchange) are
//!   built on it.
//! - [`WorkerContext::progress`] is the hang detector's heartbeat: one datagram on the socket rsrun
//!   passed as RSRUN_PROGRESS_FD. It never blocks and costs about a microsecond. rsrun's
//!   `--hang-timeout` applies to workers that have reported progress at least once.
//! - [`WorkerContext::install_panic_hook`] and [`WorkerContext::report_error`] write
//!   TORCHELASTIC_ERROR_FILE in torchelastic's schema, so rsrun's (and torchrun's) failure summary shows
//!   the message and the backtrace.
//!
//! ```no_run
//! # async fn train() -> Result<(), rsrun_worker_runtime::WorkerError> {
//! use rsrun_worker_runtime::WorkerContext;
//! let ctx = WorkerContext::from_env()?;
//! ctx.install_panic_hook();
//! ctx.barrier("start", std::time::Duration::from_secs(60)).await?;
//! for step in 0..100 {
//!     // ... one training step ...
//!     ctx.progress(step);
//! }
//! # Ok(()) }
//! ```
//!
//! The progress protocol, for workers in other languages: RSRUN_PROGRESS_FD names an inherited
//! `AF_UNIX`/`SOCK_DGRAM` socket; send one datagram per step whose first 8 bytes are the step number
//! (little-endian u64). In Python, without ever blocking the training loop:
//! `fd = int(os.environ["RSRUN_PROGRESS_FD"]); os.set_blocking(fd, False)` once, then per step
//! `try: os.write(fd, step.to_bytes(8, "little"))` / `except OSError: pass` (a full buffer means
//! the launcher has recent heartbeats enough; a closed peer means it is gone).

pub mod engine_store;

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::client::{ClientConfig, RdzvClient, StoreClient};

/// Everything that can go wrong in the worker runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// A variable the launcher sets is missing.
    #[error("environment variable {name} is not set (is this process started by rsrun or torchrun?)")]
    MissingVar {
        /// The variable.
        name: &'static str,
    },
    /// A variable holds something unexpected.
    #[error("environment variable {name}={value:?} is malformed: expected {expected}")]
    BadVar {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        expected: String,
    },
    /// The store needs the rendezvous service (rsrun's c10d backend or `--standalone`).
    #[error("no rendezvous service: RSRUN_RDZV_ENDPOINT is not set (static backend or torchrun)")]
    NoRendezvous,
    /// A file could not be read or written.
    #[error("cannot access {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A rendezvous call failed.
    #[error(transparent)]
    Rdzv(#[from] RdzvError),
    /// No unique id could be produced or received.
    #[error("unique id: {0}")]
    UniqueId(String),
    /// A store client was asked for outside a tokio runtime.
    #[error("the store client needs a tokio runtime: call it from async code (or inside Runtime::block_on / enter)")]
    NoRuntime,
}

/// The variables [`WorkerContext::from_vars`] reads as text.
const TEXT_VARS: [&str; 15] = [
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_PORT",
    "MASTER_ADDR",
    "RSRUN_ROUND",
    "RSRUN_JOB_ID",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "RSRUN_RDZV_ENDPOINT",
    "RSRUN_NODE_ID",
];

/// A worker's place in the job, read from the environment.
#[derive(Debug, Clone)]
pub struct WorkerContext {
    /// Global rank (RANK).
    pub rank: u32,
    /// Rank on this node (LOCAL_RANK).
    pub local_rank: u32,
    /// Workers in the job (WORLD_SIZE).
    pub world_size: u32,
    /// Workers on this node (LOCAL_WORLD_SIZE; unset: LOCAL_RANK + 1).
    pub local_world_size: u32,
    /// This node's rank (GROUP_RANK).
    pub node_rank: u32,
    /// Nodes in the job (GROUP_WORLD_SIZE).
    pub num_nodes: u32,
    /// Failure restarts so far (TORCHELASTIC_RESTART_COUNT).
    pub restart_count: u32,
    /// Restart budget (TORCHELASTIC_MAX_RESTARTS).
    pub max_restarts: u32,
    /// Job id (RSRUN_JOB_ID, else TORCHELASTIC_RUN_ID).
    pub job_id: String,
    /// Rendezvous round (RSRUN_ROUND; `None` under torchrun).
    pub round: Option<u64>,
    /// MASTER_ADDR.
    pub master_addr: String,
    /// MASTER_PORT.
    pub master_port: u16,
    /// RSRUN_RDZV_ENDPOINT.
    pub rdzv_endpoint: Option<String>,
    /// RSRUN_NODE_ID: this node's id at the rendezvous (the unique id's publisher is checked
    /// against it).
    pub node_id: Option<String>,
    /// RSRUN_TOKEN_FILE.
    pub token_file: Option<PathBuf>,
    /// RSRUN_TLS_CA: CA certificate to verify a TLS rendezvous service with.
    pub tls_ca: Option<PathBuf>,
    /// TORCHELASTIC_ERROR_FILE (`None` when unset or empty).
    pub error_file: Option<PathBuf>,
    progress: Option<Arc<UnixDatagram>>,
    /// What [`WorkerContext::barrier`] and [`WorkerContext::unique_id`] keep between calls
    /// (shared by clones).
    shared: Arc<Shared>,
}

/// State kept between a context's calls.
#[derive(Debug, Default)]
struct Shared {
    /// One store client for every call, on a runtime of its own (made at the first call): a
    /// client per call re-read the token file, opened a connection (a TLS handshake), and forgot
    /// which daemon of an HA group leads, trying a dead first one again every time.
    client: std::sync::Mutex<Option<Arc<engine_store::EngineStore>>>,
    /// The ids this rank generated, per name: a retried publication sends the same bytes (a new
    /// id would be refused as a second one, while the other ranks may hold the first).
    generated: std::sync::Mutex<std::collections::HashMap<String, [u8; 128]>>,
}

fn required(get: &dyn Fn(&str) -> Option<String>, name: &'static str) -> Result<String, WorkerError> {
    get(name).ok_or(WorkerError::MissingVar { name })
}

/// A whole number from `min` to `max`, else an error naming the variable, its value and `what`
/// with the range.
fn number(get: &dyn Fn(&str) -> Option<String>, name: &'static str, what: &str, min: u64, max: u64) -> Result<u64, WorkerError> {
    let v = required(get, name)?;
    match v.trim().parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(WorkerError::BadVar { name, value: v, expected: format!("{what}, a whole number from {min} to {max}") }),
    }
}

/// [`number`] as a `u32` (the range is within `u32`).
fn number32(get: &dyn Fn(&str) -> Option<String>, name: &'static str, what: &str, min: u32) -> Result<u32, WorkerError> {
    // Invariant: number() returns at most u32::MAX here.
    number(get, name, what, min.into(), u32::MAX.into()).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// [`number32`], or `default` when the variable is unset.
fn optional_number32(get: &dyn Fn(&str) -> Option<String>, name: &'static str, what: &str, min: u32, default: u32) -> Result<u32, WorkerError> {
    match get(name) {
        None => Ok(default),
        Some(_) => number32(get, name, what, min),
    }
}

/// `index` (variable `name`) must be below `size` (variable `size_name`).
fn below(name: &'static str, index: u32, size_name: &str, size: u32) -> Result<(), WorkerError> {
    if index < size {
        return Ok(());
    }
    Err(WorkerError::BadVar { name, value: index.to_string(), expected: format!("a value below {size_name}={size}") })
}

impl WorkerContext {
    /// Reads the process environment.
    ///
    /// # Errors
    /// A missing or malformed variable, named in the error.
    pub fn from_env() -> Result<Self, WorkerError> {
        let ctx = Self::from_vars_os(&|k| std::env::var_os(k))?;
        Ok(WorkerContext { progress: progress_socket(), ..ctx })
    }

    /// [`WorkerContext::from_vars`] over values as the OS has them: the paths (error file, token
    /// file, CA file) are taken byte for byte, and any other variable that is not UTF-8 is an
    /// error naming it (not taken for unset).
    ///
    /// # Errors
    /// A missing or malformed variable, named in the error.
    pub fn from_vars_os(get: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> Result<Self, WorkerError> {
        const PATHS: [&str; 3] = ["TORCHELASTIC_ERROR_FILE", "RSRUN_TOKEN_FILE", "RSRUN_TLS_CA"];
        for name in TEXT_VARS {
            if let Some(v) = get(name)
                && v.to_str().is_none()
            {
                return Err(WorkerError::BadVar { name, value: v.to_string_lossy().into_owned(), expected: "UTF-8 text".into() });
            }
        }
        let text = |k: &str| if PATHS.contains(&k) { None } else { get(k).and_then(|v| v.into_string().ok()) };
        let path = |k: &str| get(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let ctx = Self::from_vars(&text)?;
        Ok(WorkerContext {
            token_file: path("RSRUN_TOKEN_FILE"),
            tls_ca: path("RSRUN_TLS_CA"),
            error_file: path("TORCHELASTIC_ERROR_FILE"),
            ..ctx
        })
    }

    /// Reads variables through `get` (tests, embedding). No progress socket is attached.
    ///
    /// # Errors
    /// A missing or malformed variable, named in the error.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, WorkerError> {
        let world_size = number32(get, "WORLD_SIZE", "the number of ranks", 1)?;
        let rank = number32(get, "RANK", "this process's rank", 0)?;
        below("RANK", rank, "WORLD_SIZE", world_size)?;
        let local_rank = number32(get, "LOCAL_RANK", "this process's rank on its node", 0)?;
        // rsrun and torchrun always set it; unset, the fewest ranks LOCAL_RANK allows.
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(_) => number32(get, "LOCAL_WORLD_SIZE", "the number of ranks on this node", 1)?,
            // Unset: the fewest ranks LOCAL_RANK allows, and LOCAL_RANK is what to blame.
            None => {
                below("LOCAL_RANK", local_rank, "WORLD_SIZE", world_size)?;
                local_rank + 1
            }
        };
        below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)?;
        if local_world_size > world_size {
            return Err(WorkerError::BadVar {
                name: "LOCAL_WORLD_SIZE",
                value: local_world_size.to_string(),
                expected: format!("at most WORLD_SIZE={world_size} ranks on this node"),
            });
        }
        // A rank is its node's offset plus its local rank (LOCAL_RANK is 0 under
        // --virtual-local-rank, which keeps this true).
        if local_rank > rank {
            return Err(WorkerError::BadVar {
                name: "LOCAL_RANK",
                value: local_rank.to_string(),
                expected: format!("at most RANK={rank} (a rank is its node's first rank plus its local rank)"),
            });
        }
        let node_rank = optional_number32(get, "GROUP_RANK", "this node's rank", 0, 0)?;
        if get("GROUP_WORLD_SIZE").is_none() && node_rank >= world_size {
            // Without GROUP_WORLD_SIZE the node count is taken as GROUP_RANK + 1: the value to
            // blame is GROUP_RANK itself.
            return Err(WorkerError::BadVar {
                name: "GROUP_RANK",
                value: node_rank.to_string(),
                expected: format!("below WORLD_SIZE={world_size} (every node runs a rank)"),
            });
        }
        let num_nodes = optional_number32(get, "GROUP_WORLD_SIZE", "the number of nodes", 1, node_rank.saturating_add(1))?;
        below("GROUP_RANK", node_rank, "GROUP_WORLD_SIZE", num_nodes)?;
        if num_nodes > world_size {
            return Err(WorkerError::BadVar {
                name: "GROUP_WORLD_SIZE",
                value: num_nodes.to_string(),
                expected: format!("at most WORLD_SIZE={world_size} nodes (every node runs a rank)"),
            });
        }
        if get("GROUP_WORLD_SIZE").is_some() && local_world_size.saturating_add(num_nodes - 1) > world_size {
            // This node runs LOCAL_WORLD_SIZE ranks and every other node at least one.
            return Err(WorkerError::BadVar {
                name: "WORLD_SIZE",
                value: world_size.to_string(),
                expected: format!(
                    "at least LOCAL_WORLD_SIZE={local_world_size} + {} (this node's ranks and one on each other of \
                     GROUP_WORLD_SIZE={num_nodes} nodes)",
                    num_nodes - 1
                ),
            });
        }
        // Invariant: number() returns at most u16::MAX here.
        let master_port = number(get, "MASTER_PORT", "a TCP port", 1, u16::MAX.into()).map(|p| u16::try_from(p).unwrap_or(u16::MAX))?;
        let master_addr = required(get, "MASTER_ADDR")?;
        if master_addr.trim().is_empty() {
            return Err(WorkerError::BadVar { name: "MASTER_ADDR", value: master_addr, expected: "a host name or address".into() });
        }
        let rdzv_endpoint = get("RSRUN_RDZV_ENDPOINT").filter(|s| !s.is_empty());
        let round = match get("RSRUN_ROUND") {
            Some(_) => Some(number(get, "RSRUN_ROUND", "the rendezvous round", 0, u64::MAX)?),
            // rsrun sets both: an endpoint without a round would write into round 0's keys.
            None if rdzv_endpoint.is_some() => return Err(WorkerError::MissingVar { name: "RSRUN_ROUND" }),
            None => None,
        };
        let nonempty = |k: &str| get(k).filter(|s| !s.trim().is_empty());
        let job_id = nonempty("RSRUN_JOB_ID").or_else(|| nonempty("TORCHELASTIC_RUN_ID")).unwrap_or_else(|| "none".into());
        let restart_count = optional_number32(get, "TORCHELASTIC_RESTART_COUNT", "the restarts so far", 0, 0)?;
        let max_restarts = optional_number32(get, "TORCHELASTIC_MAX_RESTARTS", "the restart budget", 0, restart_count)?;
        if restart_count > max_restarts {
            return Err(WorkerError::BadVar {
                name: "TORCHELASTIC_RESTART_COUNT",
                value: restart_count.to_string(),
                expected: format!("at most TORCHELASTIC_MAX_RESTARTS={max_restarts}"),
            });
        }
        Ok(WorkerContext {
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            num_nodes,
            restart_count,
            max_restarts,
            job_id,
            round,
            master_addr,
            master_port,
            rdzv_endpoint,
            node_id: get("RSRUN_NODE_ID").filter(|s| !s.is_empty()),
            token_file: get("RSRUN_TOKEN_FILE").filter(|s| !s.is_empty()).map(PathBuf::from),
            tls_ca: get("RSRUN_TLS_CA").filter(|s| !s.is_empty()).map(PathBuf::from),
            error_file: get("TORCHELASTIC_ERROR_FILE").filter(|s| !s.is_empty()).map(PathBuf::from),
            progress: None,
            shared: Arc::default(),
        })
    }

    /// Whether this is global rank 0.
    pub fn is_rank0(&self) -> bool {
        self.rank == 0
    }

    /// A client of this round's store: keys live in the round's own namespace, so a restarted
    /// job (a new round) never reads the previous round's addresses, barrier arrivals or ids — the
    /// equivalent of torchrun's per-round `PrefixStore`. Call it inside a tokio runtime.
    ///
    /// # Errors
    /// No rendezvous service (static backend, torchrun), an unreadable token file, or a bad endpoint.
    pub fn store(&self) -> Result<StoreClient, WorkerError> {
        Ok(self.job_store()?.round_scoped())
    }

    /// A client of the job-wide store (keys survive restarts; writes are still fenced to this
    /// round). Call it inside a tokio runtime.
    ///
    /// # Errors
    /// As [`WorkerContext::store`].
    pub fn job_store(&self) -> Result<StoreClient, WorkerError> {
        let endpoint = self.rdzv_endpoint.clone().ok_or(WorkerError::NoRendezvous)?;
        // The client's connection is a task of the current runtime: outside one, say so (the
        // connect would panic).
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(WorkerError::NoRuntime);
        }
        let mut cfg = ClientConfig::new(endpoint);
        if let Some(path) = &self.token_file {
            cfg.token = Some(rsrun_rendezvous::auth::read_client_token(path)?);
        }
        cfg.tls_ca = self.tls_ca.clone();
        let client = RdzvClient::connect(cfg)?;
        // (Fields are public: an endpoint set by hand without a round must not mean round 0.)
        let round = self.round.ok_or(WorkerError::MissingVar { name: "RSRUN_ROUND" })?;
        Ok(client.store(&self.job_id, round))
    }

    /// Waits until every rank of the job reached barrier `name`.
    ///
    /// # Errors
    /// Not every rank arrived within `timeout`, or the store is unavailable.
    pub async fn barrier(&self, name: &str, timeout: Duration) -> Result<(), WorkerError> {
        let shared = self.shared_store()?;
        let (name, member, world) = (name.to_owned(), self.rank.to_string(), self.world_size);
        let store = shared.client().clone();
        shared.spawn(async move { store.barrier(&name, &member, world, timeout).await }).await??;
        Ok(())
    }

    /// The client [`WorkerContext::barrier`] and [`WorkerContext::unique_id`] share, made at the
    /// first call, on a runtime of its own (so it outlives the caller's runtime, if need be).
    fn shared_store(&self) -> Result<Arc<engine_store::EngineStore>, WorkerError> {
        if self.rdzv_endpoint.is_none() {
            return Err(WorkerError::NoRendezvous);
        }
        let mut slot = self.shared.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(store) = &*slot {
            return Ok(store.clone());
        }
        let store = Arc::new(engine_store::EngineStore::new(self)?);
        *slot = Some(store.clone());
        Ok(store)
    }

    /// The round's 128-byte NCCL unique id under `name` ("" for the default communicator).
    ///
    /// Rank 0 publishes `own` when given, else (with the `cuda` feature and a loadable NCCL) one it
    /// generates; every other rank waits up to `timeout` for it.
    ///
    /// # Errors
    /// Rank 0 has no id to publish, or the id did not arrive in time.
    pub async fn unique_id(&self, name: &str, own: Option<[u8; 128]>, timeout: Duration) -> Result<[u8; 128], WorkerError> {
        let shared = self.shared_store()?;
        let store = shared.client().clone();
        let key = name.to_owned();
        if self.is_rank0() {
            let id = match own {
                Some(id) => id,
                None => {
                    let mut generated = self.shared.generated.lock().unwrap_or_else(|p| p.into_inner());
                    match generated.get(name) {
                        Some(id) => *id,
                        None => {
                            let id = generate_unique_id()?;
                            generated.insert(name.to_owned(), id);
                            id
                        }
                    }
                }
            };
            // The service checks that this node runs rank 0 in the round.
            let node = self.node_id.clone().ok_or(WorkerError::MissingVar { name: "RSRUN_NODE_ID" })?;
            let rank = self.rank;
            // The same id again is answered as the first (a retry); another id under a name used
            // in this round is refused: an NCCL id serves one communicator's init, so a new
            // communicator needs a new name. Retried while the service is unreachable (a restart,
            // a failover), up to `timeout` like the other ranks' wait (one call retries for the
            // RPC timeout only): publishing the same bytes again is answered as the first.
            // (`Duration::MAX` means "as long as it takes": the client's longest wait, a day.)
            let timeout = timeout.min(rsrun_rendezvous::client::MAX_WAIT);
            let publish = async move {
                let deadline = tokio::time::Instant::now() + timeout;
                tokio::time::timeout_at(deadline, async {
                    loop {
                        match store.publish_unique_id(&key, &node, rank, &id).await {
                            // A daemon that accepts but does not answer (busy, failing over)
                            // times one call out: tried again too, while time is left.
                            Err(e)
                                if (e.is_retryable() || matches!(e, RdzvError::Timeout(_)))
                                    && tokio::time::Instant::now() < deadline =>
                            {
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                            other => return other,
                        }
                    }
                })
                .await
            };
            match shared.spawn(publish).await? {
                Ok(Ok(())) => return Ok(id),
                Ok(Err(RdzvError::AlreadyExists(why))) => {
                    return Err(WorkerError::UniqueId(format!("{why}: a new communicator in this round needs a name of its own")));
                }
                Ok(Err(e)) => return Err(e.into()),
                Err(_) => {
                    return Err(RdzvError::Timeout(format!("publishing unique id {name:?} took longer than {timeout:?}")).into());
                }
            }
        }
        let got = shared.spawn(async move { store.get_unique_id(&key, timeout).await }).await??;
        Self::received(got)
    }

    fn received(bytes: Vec<u8>) -> Result<[u8; 128], WorkerError> {
        bytes
            .try_into()
            .map_err(|b: Vec<u8>| WorkerError::UniqueId(format!("received {} bytes, expected 128", b.len())))
    }

    /// Reports progress (a heartbeat for `--hang-timeout`). Never blocks; a no-op when rsrun gave no
    /// progress socket.
    pub fn progress(&self, step: u64) {
        if let Some(sock) = &self.progress {
            // A full socket buffer means the launcher has plenty of recent heartbeats: drop this one.
            let _ = sock.send(&step.to_le_bytes());
        }
    }

    /// Writes the error file (TORCHELASTIC_ERROR_FILE) with `message` and an optional traceback.
    /// A no-op when the launcher set no error file.
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn report_error(&self, message: &str, traceback: Option<&str>) -> Result<(), WorkerError> {
        match &self.error_file {
            Some(path) => write_error_file(path, message, traceback),
            None => Ok(()),
        }
    }

    /// Installs a panic hook that writes the error file (message, location, backtrace) before the
    /// previous hook runs. The process's first panic is written, and a panic of the main thread
    /// replaces what another thread's wrote: later panics elsewhere (a poisoned lock, a thread
    /// that saw the first one fail) are consequences, while the main thread's ends the process
    /// (a worker thread's panic that the program caught and handled must not stand for it). When
    /// the main thread's panic replaces another thread's, the other's message and backtrace stay
    /// in the report as the panic before it (`handle.join().unwrap()` on a thread that panicked
    /// would otherwise leave only `called Result::unwrap() on an Err value: Any { .. }`).
    ///
    /// A panic another thread caught and handled still leaves its report: a worker that then
    /// exits with an error without panicking should [`WorkerContext::report_error`] its own.
    pub fn install_panic_hook(&self) {
        let Some(path) = self.error_file.clone() else { return };
        let previous = std::panic::take_hook();
        // The first panic of another thread than main: (its message, its backtrace).
        let first: OnceLock<(String, String)> = OnceLock::new();
        // Whether the main thread's panic was written: what panics after it elsewhere (a thread
        // whose channel the unwinding main thread dropped) is a consequence, and keeps off.
        let main_reported = std::sync::atomic::AtomicBool::new(false);
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            let main = thread.name() == Some("main");
            let payload = info.payload_as_str().unwrap_or("Box<dyn Any>");
            let location = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
            let message = format!("panic: {payload}{location}");
            if main {
                let backtrace = std::backtrace::Backtrace::force_capture().to_string();
                let (message, backtrace) = match first.get() {
                    Some((m, b)) => (
                        format!("{message} (after a panic in another thread: {m})"),
                        format!("{backtrace}\nthe panic before it ({m}):\n{b}"),
                    ),
                    None => (message, backtrace),
                };
                main_reported.store(true, std::sync::atomic::Ordering::SeqCst);
                let _ = write_error_file(&path, &message, Some(&backtrace));
            } else if first.get().is_none() && !main_reported.load(std::sync::atomic::Ordering::SeqCst) {
                let name = thread.name().map_or_else(|| format!("{:?}", thread.id()), |n| format!("'{n}'"));
                let backtrace = std::backtrace::Backtrace::force_capture().to_string();
                let entry = (format!("{message} (thread {name})"), backtrace);
                // Only the first of racing threads writes.
                if first.set(entry).is_ok()
                    && let Some((m, b)) = first.get()
                {
                    let _ = write_error_file(&path, m, Some(b));
                }
            }
            previous(info);
        }));
    }
}

/// Writes an error file in torchelastic's schema (what PyTorch's `@record` writes), atomically:
/// a file beside it, renamed over it, so the launcher reads a whole report or none.
///
/// # Errors
/// The file cannot be written.
pub fn write_error_file(path: &Path, message: &str, traceback: Option<&str>) -> Result<(), WorkerError> {
    // The launcher reads error files of up to 1 MiB: a message or traceback past its share keeps
    // its head and its end (where the cause usually is), so the report is read whole.
    let message = clip(message, ERROR_FILE_PART);
    let traceback = traceback.map(|t| clip(t, ERROR_FILE_PART));
    let traceback = traceback.as_deref();
    let message = message.as_ref();
    let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    // torchrun's failure summary shows `py_callstack` alone whenever the key is there, and the
    // message only when it is not: so the key is left out without a traceback, and a traceback
    // ends with the message, as Python's (`Traceback ... ValueError: bad`) does.
    let mut extra = serde_json::json!({ "timestamp": timestamp.to_string() });
    if let Some(tb) = traceback {
        extra["py_callstack"] = serde_json::Value::String(format!("{}\n{message}", tb.trim_end()));
    }
    let body = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": extra,
        }
    });
    let io = |source| WorkerError::Io { path: path.to_owned(), source };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}.{}", std::process::id(), SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::write(&tmp, body.to_string()).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io)
}

/// The most bytes of the message, and of the traceback, in an error file (JSON escaping can
/// grow text up to six times: 64 KiB each stays far below the launcher's 1 MiB).
const ERROR_FILE_PART: usize = 64 << 10;

/// `text` cut to at most about `max` bytes, on character boundaries: its first and last halves,
/// with a note of what was left out between them.
fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let half = max / 2;
    let head_end = (0..=half).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
    let tail_start = (text.len() - half..=text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len());
    std::borrow::Cow::Owned(format!(
        "{}\n[... {} bytes left out ...]\n{}",
        &text[..head_end],
        tail_start - head_end,
        &text[tail_start..]
    ))
}

fn generate_unique_id() -> Result<[u8; 128], WorkerError> {
    #[cfg(feature = "cuda")]
    {
        rsrun_training_engine::comm::nccl::unique_id().map_err(|e| WorkerError::UniqueId(e.to_string()))
    }
    #[cfg(not(feature = "cuda"))]
    Err(WorkerError::UniqueId(
        "rank 0 has no id to publish: pass one, or build with the `cuda` feature on a machine with NCCL".into(),
    ))
}

/// The progress socket named by RSRUN_PROGRESS_FD, adopted once per process.
fn progress_socket() -> Option<Arc<UnixDatagram>> {
    static SOCKET: OnceLock<Option<Arc<UnixDatagram>>> = OnceLock::new();
    SOCKET
        .get_or_init(|| {
            let value = std::env::var("RSRUN_PROGRESS_FD").ok()?;
            // An inherited variable can outlive its descriptor (a child of the trainer: the
            // socket is close-on-exec there), and the number may then name another socket.
            // The socket's peer must be the process that made it (rsrun, RSRUN_PROGRESS_PEER):
            // a datagram socket the trainer opened itself (syslog's /dev/log) may have taken the
            // number.
            let peer: Option<libc::pid_t> = match std::env::var("RSRUN_PROGRESS_PEER") {
                Err(_) => None,
                Ok(p) => match p.trim().parse() {
                    Ok(pid) => Some(pid),
                    // Set but unreadable: no socket is adopted unchecked.
                    Err(_) => {
                        tracing::warn!(RSRUN_PROGRESS_PEER = %p, "RSRUN_PROGRESS_PEER is not a process id; progress heartbeats are off");
                        return None;
                    }
                },
            };
            let fd: RawFd = match value.trim().parse() {
                Ok(fd) if fd >= 3 && is_unix_datagram_socket(fd) && peer_is_rsrun(peer, peer_pid(fd), || peer_is_unnamed(fd)) => fd,
                _ => {
                    tracing::warn!(
                        RSRUN_PROGRESS_FD = %value,
                        "RSRUN_PROGRESS_FD does not name an inherited AF_UNIX datagram socket; progress heartbeats are off"
                    );
                    return None;
                }
            };
            // SAFETY: the launcher passed this descriptor for this purpose; it is checked to be a
            // datagram socket and adopted exactly once (OnceLock).
            let sock = unsafe { UnixDatagram::from_raw_fd(fd) };
            // Keep it from leaking into the trainer's own children.
            // SAFETY: plain fcntl on a descriptor we own.
            unsafe {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags >= 0 {
                    libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                }
            }
            sock.set_nonblocking(true).ok()?;
            Some(Arc::new(sock))
        })
        .clone()
}

/// Whether the socket's peer is the rsrun that passed it: its pid is `expected`
/// (RSRUN_PROGRESS_PEER; no check when unset). A peer outside this process's pid namespace (the
/// trainer runs in a container of its own) reads as pid 0: then the socket must be one end of
/// a socket pair (an unnamed peer), which a socket the trainer connected itself (to `/dev/log`)
/// is not.
fn peer_is_rsrun(expected: Option<libc::pid_t>, seen: Option<libc::pid_t>, unnamed_peer: impl FnOnce() -> bool) -> bool {
    match (expected, seen) {
        (None, _) => true,
        (Some(_), Some(0)) => unnamed_peer(),
        (Some(p), Some(q)) => p == q,
        (Some(_), None) => false,
    }
}

/// The pid of the process at the other end of the socket `fd` (for a socketpair, the one that
/// made it); 0 when that process is outside this pid namespace.
fn peer_pid(fd: RawFd) -> Option<libc::pid_t> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for writes of the sizes given.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    (rc == 0 && cred.pid >= 0).then_some(cred.pid)
}

/// Whether `fd`'s peer has no address (the other end of a socket pair).
fn peer_is_unnamed(fd: RawFd) -> bool {
    // SAFETY: an all-zero sockaddr_un is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    // SAFETY: addr and len are valid for writes of the sizes given.
    let rc = unsafe { libc::getpeername(fd, (&mut addr as *mut libc::sockaddr_un).cast(), &mut len) };
    rc == 0 && len as usize <= std::mem::size_of::<libc::sa_family_t>()
}

/// Whether `fd` is an `AF_UNIX` `SOCK_DGRAM` socket (what rsrun passes).
fn is_unix_datagram_socket(fd: RawFd) -> bool {
    let opt = |name: libc::c_int| -> Option<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: v and len are valid for writes of the sizes given.
        let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, name, (&mut v as *mut libc::c_int).cast(), &mut len) };
        (rc == 0).then_some(v)
    };
    opt(libc::SO_TYPE) == Some(libc::SOCK_DGRAM) && opt(libc::SO_DOMAIN) == Some(libc::AF_UNIX)
}

/// A one-node job round on an embedded service, for this crate's tests.
#[cfg(test)]
pub(crate) async fn test_round(job: &str, node: &str, local_world_size: u32) -> (rsrun_rendezvous::server::EmbeddedServer, RdzvClient, u64) {
    use rsrun_rendezvous::client::{JobSpec, JoinSpec};
    let srv = rsrun_rendezvous::server::spawn_embedded("127.0.0.1:0".parse().expect("a loopback address")).await.expect("an embedded service");
    let client = RdzvClient::connect(ClientConfig::new(srv.addr.to_string())).expect("a client");
    let joined = client
        .join(JoinSpec {
            job_id: job.into(),
            node_id: node.into(),
            addrs: vec!["127.0.0.1".into()],
            local_world_size,
            rank_hint: None,
            config: JobSpec { min_nodes: 1, max_nodes: 1, last_call: Duration::ZERO, lease: Duration::from_secs(60), max_restarts: 0, fixed_ranks: false },
            timeout: Duration::from_secs(10),
            master_port: 1,
            hostname: "h".into(),
        })
        .await
        .expect("the join");
    let round = joined.round.expect("a round").round;
    (srv, client, round)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    const BASE: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("GROUP_RANK", "1"),
        ("GROUP_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RESTART_COUNT", "2"),
        ("RSRUN_JOB_ID", "j"),
        ("RSRUN_ROUND", "5"),
    ];

    #[test]
    fn typed_context() {
        let ctx = WorkerContext::from_vars(&vars(BASE)).unwrap();
        assert_eq!((ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size), (3, 1, 4, 2));
        assert_eq!((ctx.node_rank, ctx.num_nodes, ctx.restart_count), (1, 2, 2));
        assert_eq!(ctx.job_id, "j");
        assert_eq!(ctx.round, Some(5));
        assert!(matches!(ctx.store(), Err(WorkerError::NoRendezvous)));
    }

    /// Paths are taken byte for byte; any other variable that is not UTF-8 is named, not taken for
    /// unset.
    #[test]
    fn os_values_keep_paths_and_name_text_that_is_not_utf8() {
        use std::ffi::{OsStr, OsString};
        use std::os::unix::ffi::OsStrExt;
        let odd = OsStr::from_bytes(b"/l/r\xfcn/error.json").to_owned();
        let with = |extra: (&'static str, OsString)| {
            let mut map: HashMap<String, OsString> = BASE.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
            map.insert(extra.0.to_owned(), extra.1);
            move |k: &str| map.get(k).cloned()
        };
        let ctx = WorkerContext::from_vars_os(&with(("TORCHELASTIC_ERROR_FILE", odd.clone()))).unwrap();
        assert_eq!(ctx.error_file.as_deref(), Some(Path::new(&odd)));
        assert_eq!(ctx.rank, 3);
        let e = WorkerContext::from_vars_os(&with(("RANK", OsStr::from_bytes(b"\xff").to_owned()))).unwrap_err().to_string();
        assert!(e.contains("RANK=") && e.contains("expected UTF-8 text"), "{e}");
    }

    /// Outside a tokio runtime the store is an error, not a panic in the connect.
    #[test]
    fn a_store_outside_a_runtime_is_an_error() {
        let mut v: Vec<(&str, &str)> = BASE.to_vec();
        v.push(("RSRUN_RDZV_ENDPOINT", "127.0.0.1:9"));
        let ctx = WorkerContext::from_vars(&vars(&v)).unwrap();
        assert!(matches!(ctx.store(), Err(WorkerError::NoRuntime)));
    }

    /// A message or traceback past its share keeps its head and its end.
    #[test]
    fn long_error_reports_keep_their_head_and_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("error.json");
        let message = format!("HEAD{}é{}TAIL", "x".repeat(200 << 10), "y".repeat(200 << 10));
        write_error_file(&path, &message, Some(&"t".repeat(5 << 20))).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len < 256 << 10, "{len} bytes");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let m = v["message"]["message"].as_str().unwrap();
        assert!(m.starts_with("HEAD") && m.ends_with("TAIL") && m.contains("bytes left out"), "{}", &m[..100]);
    }

    /// The context of the one rank of `job`'s `round` (node "n") on `srv`.
    fn rank0_of(job: &str, round: u64, srv: &rsrun_rendezvous::server::EmbeddedServer) -> WorkerContext {
        let (round, endpoint) = (round.to_string(), srv.addr.to_string());
        let v: Vec<(&str, &str)> = vec![
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
            ("RSRUN_JOB_ID", job),
            ("RSRUN_ROUND", &round),
            ("RSRUN_RDZV_ENDPOINT", &endpoint),
            ("RSRUN_NODE_ID", "n"),
        ];
        WorkerContext::from_vars(&vars(&v)).unwrap()
    }

    /// Rank 0 publishing the same id again gets it (a retry); another id under the same name is
    /// an error that says a new communicator needs a new name.
    #[tokio::test(flavor = "current_thread")]
    async fn rank0_republishing_is_a_retry_or_an_error() {
        let (srv, _client, round) = test_round("uid", "n", 1).await;
        let ctx = rank0_of("uid", round, &srv);
        let first = ctx.unique_id("nccl", Some([1; 128]), Duration::from_secs(5)).await.unwrap();
        let again = ctx.unique_id("nccl", Some([1; 128]), Duration::from_secs(5)).await.unwrap();
        assert_eq!((first, again), ([1; 128], [1; 128]));
        let e = ctx.unique_id("nccl", Some([2; 128]), Duration::from_secs(5)).await.unwrap_err().to_string();
        assert!(e.contains("write-once") && e.contains("needs a name of its own"), "{e}");
    }

    #[test]
    fn errors_name_the_variable() {
        let missing: Vec<_> = BASE.iter().copied().filter(|(k, _)| *k != "RANK").collect();
        let e = WorkerContext::from_vars(&vars(&missing)).unwrap_err().to_string();
        assert!(e.contains("variable RANK is not set"), "{e}");
        let mut bad: Vec<_> = BASE.iter().copied().filter(|(k, _)| *k != "WORLD_SIZE").collect();
        bad.push(("WORLD_SIZE", "four"));
        let e = WorkerContext::from_vars(&vars(&bad)).unwrap_err().to_string();
        assert!(e.contains("WORLD_SIZE=\"four\""), "{e}");
    }

    /// Each variable's range and its relations to the others, named with the values.
    #[test]
    fn inconsistent_values_are_named_with_both_sides() {
        let with = |changes: &[(&'static str, Option<&'static str>)]| -> Result<WorkerContext, String> {
            let mut map: Vec<(&str, &str)> = BASE.to_vec();
            for (k, v) in changes {
                map.retain(|(name, _)| name != k);
                if let Some(v) = v {
                    map.push((k, v));
                }
            }
            WorkerContext::from_vars(&vars(&map)).map_err(|e| e.to_string())
        };
        let cases: &[(&[(&str, Option<&str>)], &str)] = &[
            (&[("WORLD_SIZE", Some("0"))], "WORLD_SIZE=\"0\" is malformed: expected the number of ranks, a whole number from 1 to"),
            (&[("RANK", Some("4"))], "RANK=\"4\" is malformed: expected a value below WORLD_SIZE=4"),
            (&[("RANK", Some("-1"))], "RANK=\"-1\" is malformed: expected this process's rank, a whole number from 0 to"),
            (&[("LOCAL_RANK", Some("2"))], "LOCAL_RANK=\"2\" is malformed: expected a value below LOCAL_WORLD_SIZE=2"),
            (&[("LOCAL_WORLD_SIZE", Some("8"))], "LOCAL_WORLD_SIZE=\"8\" is malformed: expected at most WORLD_SIZE=4 ranks on this node"),
            (&[("GROUP_RANK", Some("2"))], "GROUP_RANK=\"2\" is malformed: expected a value below GROUP_WORLD_SIZE=2"),
            (&[("MASTER_PORT", Some("70000"))], "MASTER_PORT=\"70000\" is malformed: expected a TCP port, a whole number from 1 to 65535"),
            (&[("MASTER_PORT", Some("0"))], "MASTER_PORT=\"0\" is malformed: expected a TCP port"),
            (&[("MASTER_ADDR", Some(" "))], "MASTER_ADDR=\" \" is malformed: expected a host name or address"),
            (&[("RSRUN_ROUND", Some("x"))], "RSRUN_ROUND=\"x\" is malformed: expected the rendezvous round"),
            (&[("RANK", Some("0"))], "LOCAL_RANK=\"1\" is malformed: expected at most RANK=0"),
            (&[("GROUP_WORLD_SIZE", Some("5"))], "GROUP_WORLD_SIZE=\"5\" is malformed: expected at most WORLD_SIZE=4 nodes"),
            // Four ranks here and one more node: at least five ranks.
            (&[("LOCAL_WORLD_SIZE", Some("4"))], "WORLD_SIZE=\"4\" is malformed: expected at least LOCAL_WORLD_SIZE=4 + 1 (this node's ranks"),
            // Unset LOCAL_WORLD_SIZE is not blamed for LOCAL_RANK.
            (&[("LOCAL_WORLD_SIZE", None), ("LOCAL_RANK", Some("4"))], "LOCAL_RANK=\"4\" is malformed: expected a value below WORLD_SIZE=4"),
            // Without GROUP_WORLD_SIZE, an impossible GROUP_RANK is blamed, not a made-up node count.
            (&[("GROUP_WORLD_SIZE", None), ("GROUP_RANK", Some("4"))], "GROUP_RANK=\"4\" is malformed: expected below WORLD_SIZE=4 (every node runs a rank)"),
            (&[("GROUP_WORLD_SIZE", None), ("GROUP_RANK", Some("4294967295"))], "GROUP_RANK=\"4294967295\" is malformed: expected below WORLD_SIZE=4"),
            (&[("TORCHELASTIC_MAX_RESTARTS", Some("1"))], "TORCHELASTIC_RESTART_COUNT=\"2\" is malformed: expected at most TORCHELASTIC_MAX_RESTARTS=1"),
            (&[("RSRUN_ROUND", None), ("RSRUN_RDZV_ENDPOINT", Some("127.0.0.1:9"))], "variable RSRUN_ROUND is not set"),
        ];
        for (changes, want) in cases {
            let e = with(changes).err().unwrap_or_else(|| panic!("{changes:?} accepted"));
            assert!(e.contains(want), "{changes:?}: {e}");
        }
        // Unset sizes default to the fewest ranks their index allows.
        let ctx = with(&[("LOCAL_WORLD_SIZE", None), ("GROUP_WORLD_SIZE", None)]).unwrap();
        assert_eq!((ctx.local_world_size, ctx.num_nodes), (2, 2));
        let ctx = with(&[("GROUP_RANK", None), ("GROUP_WORLD_SIZE", None), ("TORCHELASTIC_RESTART_COUNT", None)]).unwrap();
        assert_eq!((ctx.node_rank, ctx.num_nodes, ctx.restart_count), (0, 1, 0));
        // An empty job id is no job id: torchrun's run id is next.
        let ctx = with(&[("RSRUN_JOB_ID", Some("")), ("TORCHELASTIC_RUN_ID", Some("tr"))]).unwrap();
        assert_eq!(ctx.job_id, "tr");
    }

    /// The progress socket's peer is the process that made the pair; a socket of the trainer's
    /// own with no peer has none, so its number is never taken for rsrun's.
    #[test]
    fn the_progress_socket_peer_is_its_maker() {
        use std::os::fd::AsRawFd;
        let (a, _b) = UnixDatagram::pair().unwrap();
        assert_eq!(peer_pid(a.as_raw_fd()), Some(std::process::id() as libc::pid_t));
        let lone = UnixDatagram::unbound().unwrap();
        assert!(is_unix_datagram_socket(lone.as_raw_fd()));
        assert_ne!(peer_pid(lone.as_raw_fd()), Some(std::process::id() as libc::pid_t));
    }

    /// A peer outside the trainer's pid namespace reads as pid 0: the socket is still rsrun's
    /// when it is one end of a pair, and not when it is connected to a named socket (syslog's).
    #[test]
    fn a_peer_in_another_pid_namespace_is_taken_only_for_a_socket_pair() {
        use std::os::fd::AsRawFd;
        assert!(peer_is_rsrun(None, None, || false));
        assert!(peer_is_rsrun(Some(7), Some(7), || false));
        assert!(!peer_is_rsrun(Some(7), Some(8), || true));
        assert!(!peer_is_rsrun(Some(7), None, || true));
        assert!(peer_is_rsrun(Some(7), Some(0), || true));
        assert!(!peer_is_rsrun(Some(7), Some(0), || false));
        let (a, _b) = UnixDatagram::pair().unwrap();
        assert!(peer_is_unnamed(a.as_raw_fd()));
        let dir = tempfile::tempdir().unwrap();
        let log = UnixDatagram::bind(dir.path().join("log")).unwrap();
        let client = UnixDatagram::unbound().unwrap();
        client.connect(dir.path().join("log")).unwrap();
        assert!(!peer_is_unnamed(client.as_raw_fd()), "a socket connected to a path has a named peer");
        assert!(!peer_is_unnamed(UnixDatagram::unbound().unwrap().as_raw_fd()), "no peer at all");
        drop(log);
    }

    /// barrier() and unique_id() share one client on a runtime of their own: it serves calls from
    /// a runtime started after the first caller's ended.
    #[test]
    fn barrier_and_unique_id_share_a_client_that_outlives_the_callers_runtime() {
        let service_rt = tokio::runtime::Runtime::new().unwrap();
        let (srv, _client, round) = service_rt.block_on(test_round("shared", "n", 1));
        let ctx = rank0_of("shared", round, &srv);
        let caller = || tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        caller().block_on(ctx.barrier("b1", Duration::from_secs(5))).unwrap();
        let first = ctx.shared_store().unwrap();
        // The first caller's runtime is gone; the next call runs on a new one.
        let id = caller().block_on(ctx.unique_id("nccl", Some([3; 128]), Duration::from_secs(5))).unwrap();
        assert_eq!(id, [3; 128]);
        caller().block_on(ctx.clone().barrier("b2", Duration::from_secs(5))).unwrap();
        assert!(Arc::ptr_eq(&first, &ctx.shared_store().unwrap()), "one client for every call and every clone");
        drop(ctx);
        drop(first);
        let _ = service_rt.block_on(srv.shutdown());
    }

    /// The report is replaced whole (no temporary left beside it), and only the first panic of
    /// the process is written.
    #[test]
    fn error_reports_are_atomic_and_the_first_panic_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("error.json");
        write_error_file(&path, "first", None).unwrap();
        write_error_file(&path, "second", None).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "second");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "a temporary file was left");
        let mut env: Vec<(&str, &str)> = BASE.to_vec();
        let p = path.to_str().unwrap().to_owned();
        env.push(("TORCHELASTIC_ERROR_FILE", &p));
        let ctx = WorkerContext::from_vars(&vars(&env)).unwrap();
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        ctx.install_panic_hook();
        let _ = std::thread::spawn(|| panic!("the cause")).join();
        let _ = std::thread::spawn(|| panic!("a consequence")).join();
        let message = || {
            let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            v["message"]["message"].as_str().unwrap().to_owned()
        };
        assert!(message().starts_with("panic: the cause at "), "{}", message());
        // The main thread's panic ends the process: it replaces a panic another thread had (one
        // the program may have caught and handled).
        let _ = std::thread::Builder::new().name("main".into()).spawn(|| panic!("the end")).unwrap().join();
        // A thread that panics after it (its channel dropped by main's unwinding) is a
        // consequence: main's report stays.
        let _ = std::thread::spawn(|| panic!("after the end")).join();
        std::panic::set_hook(before);
        assert!(message().starts_with("panic: the end at "), "{}", message());
        // ... and keeps the earlier panic as the one before it (the cause, when main unwrapped a
        // join of the thread that panicked).
        assert!(message().contains("(after a panic in another thread: panic: the cause at "), "{}", message());
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(v["message"]["extraInfo"]["py_callstack"].as_str().unwrap().contains("the panic before it (panic: the cause"));
    }

    /// Building the store inside an async context without a rendezvous fails with the reason,
    /// instead of panicking while its private runtime is dropped.
    #[tokio::test]
    async fn an_engine_store_without_a_service_is_an_error_inside_a_runtime() {
        let ctx = WorkerContext::from_vars(&vars(BASE)).unwrap();
        let e = engine_store::EngineStore::new(&ctx).unwrap_err();
        assert!(matches!(e, WorkerError::NoRendezvous), "{e}");
    }

    #[test]
    fn error_file_schema() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/error.json");
        write_error_file(&path, "panic: boom", Some("frame 0\n")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "panic: boom");
        // torchrun shows the callstack alone when there is one: it ends with the message.
        assert_eq!(v["message"]["extraInfo"]["py_callstack"], "frame 0\npanic: boom");
        assert!(v["message"]["extraInfo"]["timestamp"].as_str().unwrap().parse::<u64>().is_ok());
        // Without a traceback the key is absent, so torchrun shows the message (not a blank).
        write_error_file(&path, "loss is NaN", None).unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "loss is NaN");
        assert!(v["message"]["extraInfo"].get("py_callstack").is_none(), "{v}");
    }
}
