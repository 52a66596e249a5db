//! Collective communication: process groups over shared memory, TCP, or both.
//!
//! # Overview
//! A [`ProcessGroup`] is created by every rank with the same `prefix` and a shared [`Store`]
//! (the worker runtime implements it over the rendezvous store; [`LocalStore`] and
//! [`FileStore`] serve tests). During bootstrap each rank publishes its host identity
//! (boot id + hostname + network-namespace inode) and the backend is chosen per group:
//!
//! | ranks | backend |
//! |---|---|
//! | one | `local` (copies) |
//! | all on one host | `shm`: shared segment, futex sync, parallel reduction |
//! | each on its own host | `tcp`: pipelined ring / Bruck for small messages |
//! | mixed | `hierarchical`: shm inside hosts + TCP between host leaders |
//!
//! [`CommOptions::backend`] forces one. Every op starts with a check that all ranks issued
//! the same op (kind, dtype, element count, root, reduce op, sequence number); a difference is
//! reported as [`CommError::Mismatch`] on every rank. Any failure (peer death, timeout,
//! mismatch) poisons the group: later ops return the same error.
//!
//! # Layout rules
//! - `all_gather(input, output)`: `output.len() == world × input.len()`, rank-major: rank j's
//!   input lands at `output[j·S..(j+1)·S]` (NCCL layout).
//! - `reduce_scatter(input, output)`: `input.len() == world × output.len()`; rank r receives the
//!   reduction of `input[r·S..(r+1)·S]` over all ranks (NCCL layout).
//! - Totals not divisible by the world size are padded by the caller: [`padded_len`] and
//!   [`shard_range`] define the convention (`S = ceil(total / world)`, rank r owns
//!   `[r·S, min((r+1)·S, total))`, padding at the end).
//! - Buffers of length 0 are allowed everywhere (the op still synchronizes and checks headers).
//!
//! # Deterministic mode
//! With [`CommOptions::deterministic`], every reduction folds contributions in rank order
//! 0..N−1 (`((x0 ⊕ x1) ⊕ x2) ⊕ …`), in `f32` for bf16/f16 with one final rounding, so results
//! can be reproduced bit for bit by a single process folding shards in the same order. The
//! shm backend and the small-message TCP path always fold this way; the TCP ring and the
//! two-rank TCP all_reduce are also bitwise rank-order for 2 ranks (the ops are commutative),
//! and otherwise deterministic mode
//! replaces the ring reduce-scatter with a direct one and hierarchical all_reduce with flat TCP.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use rsrun_training_engine::comm::{CommOptions, LocalStore, ProcessGroup, ReduceOp};
//! let store = Arc::new(LocalStore::new());
//! let handles: Vec<_> = (0..2)
//!     .map(|rank| {
//!         let store = store.clone();
//!         std::thread::spawn(move || {
//!             let pg = ProcessGroup::new(rank, 2, store, "doc", CommOptions::default())?;
//!             let mut v = vec![rank as f32 + 1.0; 5];
//!             pg.all_reduce(&mut v, ReduceOp::Sum)?;
//!             assert_eq!(v, vec![3.0; 5]);
//!             Ok::<_, rsrun_training_engine::comm::CommError>(())
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     h.join().unwrap().unwrap();
//! }
//! ```

mod dtype;
mod error;
mod hier;
mod mesh;
pub(crate) use mesh::random_token;
#[cfg(feature = "nccl")]
pub mod nccl;
mod op;
mod shm;
mod store;
mod tcp;
mod window;

use std::net::IpAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use op::{CommStats, OpKind, OpStats};
pub use store::{FileStore, LocalStore, Store};
pub use window::{CommBuffer, SharedBuf};

use op::{OpHeader, Traffic};

/// Which transport a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Chosen from host identities (see the module docs).
    Auto,
    /// Shared memory; every rank must be on the same host.
    Shm,
    /// TCP between every pair of ranks.
    Tcp,
    /// Shared memory inside hosts, TCP between host leaders.
    Hierarchical,
}

impl std::str::FromStr for BackendKind {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => BackendKind::Auto,
            "shm" => BackendKind::Shm,
            "tcp" => BackendKind::Tcp,
            "hierarchical" | "hier" => BackendKind::Hierarchical,
            _ => {
                return Err(CommError::InvalidArgument(format!(
                    "unknown backend {s:?} (auto|shm|tcp|hierarchical)"
                )));
            }
        })
    }
}

/// Process-group options. Defaults are in [`CommOptions::default`].
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Transport selection (default `Auto`).
    pub backend: BackendKind,
    /// Deadline for bootstrap and for every single operation (default 300 s). A peer that does
    /// not take part in time is reported as [`CommError::Timeout`] naming it.
    pub timeout: Duration,
    /// Fixed rank-order reductions (default off; see the module docs).
    pub deterministic: bool,
    /// Overrides the detected host identity (tests use it to simulate several hosts).
    pub host_identity: Option<String>,
    /// Address peers use to reach this rank over TCP (default: the interface routing to
    /// `MASTER_ADDR`, else 127.0.0.1).
    pub advertise_addr: Option<IpAddr>,
    /// Size of each of the two shared-memory data buffers per rank, i.e. the pipelining chunk
    /// (default 256 KiB: a chunk stays in L2 between copy-in, reduction and copy-out).
    pub shm_chunk_bytes: usize,
    /// Messages up to this size take the one-synchronization shm path (default 32 KiB).
    pub shm_small_bytes: usize,
    /// all_reduce messages up to this size use Bruck all-gather + local fold over TCP
    /// (latency-optimal, ceil(log2 N) rounds; default 64 KiB).
    pub tcp_small_bytes: usize,
    /// Pipelining segment of the TCP ring: a received segment is reduced while the next one
    /// arrives (default: an eighth of this host's L2 cache per core as a power of two within
    /// 64–256 KiB, 256 KiB where the size is unknown). Ranks may differ: each op runs on the
    /// smallest of theirs.
    pub tcp_segment_bytes: usize,
    /// How long a shm wait spins before sleeping on the futex (default 50 µs; reduced to 2 µs
    /// when a host runs more ranks than it has cores).
    pub spin: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            backend: BackendKind::Auto,
            timeout: Duration::from_secs(300),
            deterministic: false,
            host_identity: None,
            advertise_addr: None,
            shm_chunk_bytes: 256 << 10,
            shm_small_bytes: 32 << 10,
            tcp_small_bytes: 64 << 10,
            tcp_segment_bytes: tcp::default_segment_bytes(),
            spin: Duration::from_micros(50),
        }
    }
}

/// Group-level context handed to backends.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Group rank → the rank number used in error messages (rank in the root group).
    pub(crate) names: Arc<Vec<usize>>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) prefix: String,
    pub(crate) opts: CommOptions,
    /// The group's ranks span more than one host (its TCP meshes must not advertise loopback).
    pub(crate) multi_host: bool,
}

impl Ctx {
    /// The context of the subgroup `members` (group ranks of `self`), which must contain us.
    pub(crate) fn sub(&self, members: &[usize], prefix: String) -> Result<Ctx> {
        let rank = members
            .iter()
            .position(|r| *r == self.rank)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "rank {} is not a member of subgroup {members:?}",
                    self.names[self.rank]
                ))
            })?;
        Ok(Ctx {
            rank,
            world: members.len(),
            names: Arc::new(members.iter().map(|r| self.names[*r]).collect()),
            store: self.store.clone(),
            prefix,
            opts: self.opts.clone(),
            multi_host: self.multi_host,
        })
    }
}

/// A transport implementation; buffers are raw bytes of `h.dtype` elements.
pub(crate) trait Backend: Send {
    fn name(&self) -> &'static str;
    fn all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()>;
    fn broadcast(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        root: usize,
        t: &mut Traffic,
    ) -> Result<()>;
    fn reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        root: usize,
        t: &mut Traffic,
    ) -> Result<()>;
    fn all_gather(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        t: &mut Traffic,
    ) -> Result<()>;
    fn reduce_scatter(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()>;
    fn barrier(&mut self, h: &OpHeader, t: &mut Traffic) -> Result<()>;
    fn send(&mut self, h: &OpHeader, buf: &[u8], dst: usize, t: &mut Traffic) -> Result<()>;
    fn recv(&mut self, h: &OpHeader, buf: &mut [u8], src: usize, t: &mut Traffic) -> Result<()>;
    /// Tells peers this rank gives up (best effort), so that they fail fast.
    fn abort(&mut self, err: &CommError);
    /// Allocates a registered window of `bytes` per rank (collective); `None`: this backend
    /// has none, callers use heap buffers.
    fn alloc_window(&mut self, _bytes: usize) -> Result<Option<Arc<window::WindowMap>>> {
        Ok(None)
    }
    /// The deadline of the op about to run (`None` after it): every wait of the op, in every
    /// stage and sub-backend, ends by it, so one op never takes more than the timeout (plus
    /// the blame wait) however many synchronizations it has.
    fn set_op_deadline(&mut self, _deadline: Option<Instant>) {}
}

/// The single-rank backend.
struct LocalBackend;

impl Backend for LocalBackend {
    fn name(&self) -> &'static str {
        "local"
    }
    fn all_reduce(
        &mut self,
        _: &OpHeader,
        _: &mut [u8],
        _: ReduceOp,
        _: &mut Traffic,
    ) -> Result<()> {
        Ok(())
    }
    fn broadcast(&mut self, _: &OpHeader, _: &mut [u8], _: usize, _: &mut Traffic) -> Result<()> {
        Ok(())
    }
    fn reduce(
        &mut self,
        _: &OpHeader,
        _: &mut [u8],
        _: ReduceOp,
        _: usize,
        _: &mut Traffic,
    ) -> Result<()> {
        Ok(())
    }
    fn all_gather(
        &mut self,
        _: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        _: &mut Traffic,
    ) -> Result<()> {
        out.copy_from_slice(input);
        Ok(())
    }
    fn reduce_scatter(
        &mut self,
        _: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        _: ReduceOp,
        _: &mut Traffic,
    ) -> Result<()> {
        out.copy_from_slice(input);
        Ok(())
    }
    fn barrier(&mut self, _: &OpHeader, _: &mut Traffic) -> Result<()> {
        Ok(())
    }
    fn send(&mut self, _: &OpHeader, _: &[u8], dst: usize, _: &mut Traffic) -> Result<()> {
        Err(CommError::InvalidRank {
            what: "send destination",
            rank: dst,
            world: 1,
        })
    }
    fn recv(&mut self, _: &OpHeader, _: &mut [u8], src: usize, _: &mut Traffic) -> Result<()> {
        Err(CommError::InvalidRank {
            what: "recv source",
            rank: src,
            world: 1,
        })
    }
    fn abort(&mut self, _: &CommError) {}
}

/// This machine's identity for shared-memory eligibility: hostname, kernel boot id and the
/// inode of the network namespace (so network namespaces on one machine count as hosts).
pub fn host_identity() -> String {
    use std::os::unix::fs::MetadataExt;
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let netns = std::fs::metadata("/proc/self/ns/net")
        .map(|m| m.ino())
        .unwrap_or(0);
    format!(
        "{}/{}/net:{netns}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// Length of a buffer padded to a multiple of `world` (the sharding convention).
pub fn padded_len(total: usize, world: usize) -> usize {
    total.div_ceil(world.max(1)) * world.max(1)
}

/// The range of the unpadded `total` elements owned by `rank` (`S = ceil(total/world)`).
pub fn shard_range(total: usize, world: usize, rank: usize) -> Range<usize> {
    let s = total.div_ceil(world.max(1));
    (rank * s).min(total)..((rank + 1) * s).min(total)
}

type Job = Box<dyn FnOnce() + Send>;

struct State {
    backend: Box<dyn Backend>,
    seq: u64,
    failed: Option<CommError>,
    /// Bounds every operation instead of `opts.timeout` while set (see
    /// [`ProcessGroup::with_op_timeout`]).
    op_timeout: Option<Duration>,
}

impl State {
    /// Fails the group with `e` (the peers are told through the backend's abort); every later op
    /// returns it.
    fn fail(&mut self, e: CommError) -> CommError {
        self.backend.abort(&e);
        self.failed = Some(e.clone());
        e
    }
}

/// The message of a caught panic (its `&str` or `String` payload).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".into())
}

struct Inner {
    ctx: Ctx,
    /// Host index of every group rank (hosts numbered by first rank).
    host_of: Vec<usize>,
    host_ids: Vec<String>,
    backend_name: &'static str,
    state: Mutex<State>,
    stats: Mutex<CommStats>,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    pending: (Mutex<u64>, Condvar),
    groups_created: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave them half-updated (plain field writes).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A communicator over a fixed set of ranks.
///
/// Cheap to clone (shared handle). Ops are blocking; the `*_async` variants run on one
/// communication thread per group and return a [`Work`] handle. Sync ops first wait for all
/// outstanding async ops, so ops execute in issue order. Every rank must issue the same
/// collectives in the same order.
///
/// A panic inside a backend (a bug) fails the group and tells the peers; a sync op then lets
/// the panic go on to its caller, an async op settles its [`Work`] with the group's error.
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

impl ProcessGroup {
    /// The deadline of one operation (`CommOptions::timeout`).
    pub fn op_timeout(&self) -> Duration {
        self.inner.ctx.opts.timeout
    }

    /// Runs `f` with every operation of this group bounded by `timeout` (capped as the group's) instead of
    /// the group's own: an agreement that waits while one rank writes a checkpoint of gigabytes
    /// must not fail the group at the ordinary deadline. A peer that dies is still seen at once.
    /// One scope at a time per group (the previous bound comes back when `f` returns).
    pub fn with_op_timeout<R>(&self, timeout: Duration, f: impl FnOnce() -> R) -> R {
        struct Restore<'a>(&'a Inner, Option<Duration>);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                lock(&self.0.state).op_timeout = self.1;
            }
        }
        let timeout = timeout.clamp(Duration::from_millis(1), MAX_TIMEOUT);
        let previous = lock(&self.inner.state).op_timeout.replace(timeout);
        let _restore = Restore(&self.inner, previous);
        f()
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.ctx.rank)
            .field("world", &self.inner.ctx.world)
            .field("backend", &self.inner.backend_name)
            .field("prefix", &self.inner.ctx.prefix)
            .finish()
    }
}

/// The options every rank of a group must share: each rank picks the backend, the algorithm
/// (one-sync or chunked, small or ring) and the slot size by them without asking its peers, so
/// a difference would pair different protocols (a stale read, a garbled blob, a panic on a
/// length) instead of failing. Compared at [`ProcessGroup::new`].
/// The version of what ranks exchange (segment layout, TCP frames and handshakes): ranks of
/// builds that disagree on it are told at bootstrap, not by garbled data. Raise it with any
/// change of the wire.
const WIRE_VERSION: u32 = 3;

/// The longest timeout honoured: "forever" (`Duration::MAX`) would overflow every deadline.
const MAX_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

fn agreed_options(o: &CommOptions) -> String {
    format!(
        "wire={WIRE_VERSION} backend={:?} deterministic={} shm_chunk_bytes={} shm_small_bytes={} tcp_small_bytes={}",
        o.backend, o.deterministic, o.shm_chunk_bytes, o.shm_small_bytes, o.tcp_small_bytes
    )
}

impl ProcessGroup {
    /// Creates the group; every rank calls this with the same `world`, `prefix` and options.
    ///
    /// `prefix` namespaces all store keys of this group and must be unique per group and per
    /// rendezvous round.
    ///
    /// # Errors
    /// Invalid rank/options, store failures, peers missing at the deadline, or a forced
    /// backend that cannot serve the group (e.g. `Shm` across hosts).
    pub fn new(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        prefix: &str,
        mut opts: CommOptions,
    ) -> Result<Self> {
        opts.timeout = opts.timeout.min(MAX_TIMEOUT);
        if world == 0 || rank >= world {
            return Err(CommError::InvalidRank {
                what: "own",
                rank,
                world,
            });
        }
        if opts.timeout.is_zero() {
            return Err(CommError::InvalidArgument(
                "timeout must be positive".into(),
            ));
        }
        let ctx = Ctx {
            rank,
            world,
            names: Arc::new((0..world).collect()),
            store,
            prefix: prefix.to_string(),
            opts,
            // Known once the hosts are exchanged (`from_ctx`).
            multi_host: false,
        };
        let my_id = ctx.opts.host_identity.clone().unwrap_or_else(host_identity);
        let ours = agreed_options(&ctx.opts);
        ctx.store
            .set(&format!("{prefix}/host/{rank}"), format!("{ours}\n{my_id}").as_bytes())?;
        let deadline = Instant::now() + ctx.opts.timeout;
        let mut ids = Vec::with_capacity(world);
        for j in 0..world {
            let v = ctx.store.get(
                &format!("{prefix}/host/{j}"),
                deadline.saturating_duration_since(Instant::now()),
            )?;
            let v = String::from_utf8_lossy(&v).to_string();
            let (theirs, id) = v.split_once('\n').unwrap_or(("", v.as_str()));
            if theirs != ours {
                return Err(CommError::Bootstrap {
                    prefix: ctx.prefix.clone(),
                    reason: format!(
                        "rank {j} has {theirs:?} but rank {rank} has {ours:?}: every rank must pass the same options (each picks its algorithm by them alone)"
                    ),
                });
            }
            ids.push(id.to_string());
        }
        Self::from_ctx(ctx, ids, deadline)
    }

    /// Builds the group's backend by `deadline`: the whole bootstrap (host exchange, shared
    /// memory, meshes) shares one timeout, so a missing peer fails it after `opts.timeout`, not
    /// after a timeout per phase.
    fn from_ctx(mut ctx: Ctx, host_ids: Vec<String>, deadline: Instant) -> Result<Self> {
        let mut hosts: Vec<&str> = Vec::new();
        let host_of: Vec<usize> = host_ids
            .iter()
            .map(|id| match hosts.iter().position(|h| *h == id) {
                Some(i) => i,
                None => {
                    hosts.push(id);
                    hosts.len() - 1
                }
            })
            .collect();
        let n_hosts = hosts.len();
        ctx.multi_host = n_hosts > 1;
        let kind = match ctx.opts.backend {
            _ if ctx.world == 1 => None,
            BackendKind::Auto if n_hosts == 1 => Some(BackendKind::Shm),
            BackendKind::Auto if n_hosts == ctx.world => Some(BackendKind::Tcp),
            BackendKind::Auto => Some(BackendKind::Hierarchical),
            k => Some(k),
        };
        let backend: Box<dyn Backend> = match kind {
            None => Box::new(LocalBackend),
            Some(BackendKind::Shm) => {
                if n_hosts > 1 {
                    return Err(CommError::Unsupported {
                        backend: "shm",
                        reason: format!("ranks span {n_hosts} hosts"),
                    });
                }
                Box::new(shm::ShmBackend::new(&ctx, true, deadline)?)
            }
            Some(BackendKind::Tcp) => Box::new(tcp::TcpBackend::new(&ctx, deadline)?),
            Some(BackendKind::Hierarchical) | Some(BackendKind::Auto) => {
                Box::new(hier::HierBackend::new(&ctx, host_of.clone(), deadline)?)
            }
        };
        let backend_name = backend.name();
        Ok(ProcessGroup {
            inner: Arc::new(Inner {
                ctx,
                host_of,
                host_ids,
                backend_name,
                state: Mutex::new(State {
                    backend,
                    seq: 0,
                    failed: None,
                    op_timeout: None,
                }),
                stats: Mutex::new(CommStats::default()),
                queue: Mutex::new(None),
                pending: (Mutex::new(0), Condvar::new()),
                groups_created: AtomicU64::new(0),
            }),
        })
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.inner.ctx.rank
    }

    /// Number of ranks in the group.
    pub fn world_size(&self) -> usize {
        self.inner.ctx.world
    }

    /// The backend in use: `local`, `shm`, `tcp` or `hierarchical`.
    pub fn backend(&self) -> &'static str {
        self.inner.backend_name
    }

    /// Rank numbers of the group members in the root group (how errors name peers).
    pub fn global_ranks(&self) -> &[usize] {
        &self.inner.ctx.names
    }

    /// The host index (0..num_hosts) of `rank`; 0 for a rank out of range.
    pub fn host_of(&self, rank: usize) -> usize {
        self.inner.host_of.get(rank).copied().unwrap_or(0)
    }

    /// Number of distinct hosts in the group.
    pub fn num_hosts(&self) -> usize {
        self.inner
            .host_of
            .iter()
            .copied()
            .max()
            .map_or(0, |m| m + 1)
    }

    /// Traffic counters since creation (or the last [`ProcessGroup::reset_stats`]).
    pub fn stats(&self) -> CommStats {
        *lock(&self.inner.stats)
    }

    /// Zeroes the traffic counters.
    pub fn reset_stats(&self) {
        *lock(&self.inner.stats) = CommStats::default();
    }

    fn wait_idle(&self) {
        let (m, cv) = &self.inner.pending;
        let mut g = lock(m);
        while *g > 0 {
            g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Allocates a zeroed buffer of `len` elements registered with this group: on the shm
    /// backend every rank maps every rank's buffer, so all_reduce, all_gather (output) and
    /// reduce_scatter (input) on these buffers read and write the peers' memory directly, with
    /// no staging copies (NCCL's `ncclMemAlloc`). Other backends give a heap buffer. Collective:
    /// every rank calls it in the same order with the same `len`. The zero-copy path is taken
    /// when every rank passes its buffer of the same allocation at the same offset; anything
    /// else (including plain `Vec`s) runs the staged algorithm with the same result.
    ///
    /// # Errors
    /// Store or mapping failures (the group is then unusable), a failed group, or a length that
    /// overflows.
    pub fn alloc_shared<T: Element>(&self, len: usize) -> Result<SharedBuf<T>> {
        self.wait_idle();
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            CommError::InvalidArgument(format!("shared buffer of {len} elements overflows"))
        })?;
        let mut st = lock(&self.inner.state);
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        match st.backend.alloc_window(bytes) {
            Ok(Some(w)) => Ok(SharedBuf::window(w, len)),
            Ok(None) => Ok(SharedBuf::heap(len)),
            Err(e) => Err(st.fail(e)),
        }
    }

    /// Reduces `buf` across ranks in place; every rank gets the result.
    ///
    /// # Errors
    /// Peer failure, timeout or mismatch (the group is then unusable).
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.wait_idle();
        self.inner
            .all_reduce(T::DTYPE, bytemuck::cast_slice_mut(buf), op)
    }

    /// Copies `root`'s `buf` to every rank.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`], or `root` out of range.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.wait_idle();
        self.inner
            .broadcast(T::DTYPE, bytemuck::cast_slice_mut(buf), root)
    }

    /// Reduces `buf` across ranks into `root`'s `buf`; other ranks' buffers are unchanged.
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast`].
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.wait_idle();
        self.inner
            .reduce(T::DTYPE, bytemuck::cast_slice_mut(buf), op, root)
    }

    /// Gathers every rank's `input` into `output` (rank-major, `world × input.len()`).
    ///
    /// # Errors
    /// [`CommError::Length`] for a wrong output length, else as [`ProcessGroup::all_reduce`].
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.wait_idle();
        self.inner.all_gather(
            T::DTYPE,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
        )
    }

    /// Reduces `input` (`world × output.len()`, rank-major) and leaves block `rank` in `output`.
    ///
    /// # Errors
    /// [`CommError::Length`] for a wrong input length, else as [`ProcessGroup::all_reduce`].
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.wait_idle();
        self.inner.reduce_scatter(
            T::DTYPE,
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            op,
        )
    }

    /// Returns when every rank has entered the barrier.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`].
    pub fn barrier(&self) -> Result<()> {
        self.wait_idle();
        self.inner.barrier()
    }

    /// Sends `buf` to `dst`, which must post a matching [`ProcessGroup::recv`] (same dtype and length).
    ///
    /// # Errors
    /// Invalid rank, peer failure or timeout.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.wait_idle();
        self.inner.send(T::DTYPE, bytemuck::cast_slice(buf), dst)
    }

    /// Receives into `buf` from `src`.
    ///
    /// # Errors
    /// Invalid rank, peer failure, timeout, or a mismatched send (dtype or length).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.wait_idle();
        self.inner
            .recv(T::DTYPE, bytemuck::cast_slice_mut(buf), src)
    }

    fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let slot = Arc::new(WorkSlot {
            result: Mutex::new(None),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
        });
        *lock(&self.inner.pending.0) += 1;
        let guard = JobGuard {
            slot: slot.clone(),
            inner: self.inner.clone(),
        };
        let job: Job = Box::new(move || {
            let r = f(&guard.inner);
            guard.slot.complete(r);
            // Dropping the guard ends the pending count.
        });
        let mut q = lock(&self.inner.queue);
        let tx = q.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            std::thread::Builder::new()
                .name(format!("comm-{}", self.inner.ctx.rank))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        // A job that panics is settled with an error by its guard; the thread
                        // lives on for the jobs queued behind it (the panic hook has reported it).
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                })
                .map(|_| ())
                .unwrap_or(()); // if spawning fails, `send` below fails and the work reports it
            tx
        });
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // The thread is gone: the job's guard settles the work with an error.
            drop(job);
            *q = None;
        }
        Work { slot }
    }

    /// Async [`ProcessGroup::all_reduce`]: the buffer is returned by [`Work::wait`]
    /// (`Vec<T>` or [`SharedBuf<T>`]).
    pub fn all_reduce_async<B: CommBuffer>(&self, mut buf: B, op: ReduceOp) -> Work<B> {
        self.submit(move |inner| {
            inner
                .all_reduce(B::Elem::DTYPE, bytemuck::cast_slice_mut(buf.elems_mut()), op)
                .map(|_| buf)
        })
    }

    /// Async [`ProcessGroup::broadcast`].
    pub fn broadcast_async<B: CommBuffer>(&self, mut buf: B, root: usize) -> Work<B> {
        self.submit(move |inner| {
            inner
                .broadcast(B::Elem::DTYPE, bytemuck::cast_slice_mut(buf.elems_mut()), root)
                .map(|_| buf)
        })
    }

    /// Async [`ProcessGroup::all_gather`]: returns `(input, output)`.
    pub fn all_gather_async<I: CommBuffer, O: CommBuffer<Elem = I::Elem>>(
        &self,
        input: I,
        mut output: O,
    ) -> Work<(I, O)> {
        self.submit(move |inner| {
            inner
                .all_gather(
                    I::Elem::DTYPE,
                    bytemuck::cast_slice(input.elems()),
                    bytemuck::cast_slice_mut(output.elems_mut()),
                )
                .map(|_| (input, output))
        })
    }

    /// Async [`ProcessGroup::reduce_scatter`]: returns `(input, output)`.
    pub fn reduce_scatter_async<I: CommBuffer, O: CommBuffer<Elem = I::Elem>>(
        &self,
        input: I,
        mut output: O,
        op: ReduceOp,
    ) -> Work<(I, O)> {
        self.submit(move |inner| {
            inner
                .reduce_scatter(
                    I::Elem::DTYPE,
                    bytemuck::cast_slice(input.elems()),
                    bytemuck::cast_slice_mut(output.elems_mut()),
                    op,
                )
                .map(|_| (input, output))
        })
    }

    /// Async [`ProcessGroup::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(|inner| inner.barrier())
    }

    /// Creates a subgroup of `ranks` (group ranks; the subgroup rank is the position in the
    /// list). Every rank of this group must call it, in the same order as other `new_group`
    /// calls; non-members get `None`.
    ///
    /// # Errors
    /// Invalid or duplicate ranks, or the subgroup's bootstrap failed.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let k = self.inner.groups_created.fetch_add(1, Ordering::SeqCst);
        let world = self.world_size();
        for (i, r) in ranks.iter().enumerate() {
            if *r >= world {
                return Err(CommError::InvalidRank {
                    what: "subgroup member",
                    rank: *r,
                    world,
                });
            }
            if ranks[..i].contains(r) {
                return Err(CommError::InvalidArgument(format!(
                    "rank {r} listed twice in new_group"
                )));
            }
        }
        if ranks.is_empty() {
            return Err(CommError::InvalidArgument(
                "new_group needs at least one rank".into(),
            ));
        }
        if !ranks.contains(&self.rank()) {
            return Ok(None);
        }
        self.make_subgroup(ranks, format!("{}/g{k}", self.inner.ctx.prefix))
            .map(Some)
    }

    fn make_subgroup(&self, ranks: &[usize], prefix: String) -> Result<ProcessGroup> {
        let mut ctx = self.inner.ctx.sub(ranks, prefix)?;
        if ctx.opts.backend == BackendKind::Hierarchical {
            // Hierarchical is a composition; a subgroup picks what fits its own members.
            ctx.opts.backend = BackendKind::Auto;
        }
        let ids = ranks
            .iter()
            .map(|r| self.inner.host_ids[*r].clone())
            .collect();
        let deadline = Instant::now() + ctx.opts.timeout;
        Self::from_ctx(ctx, ids, deadline)
    }

    /// Splits the group by host for hybrid sharding: returns `(intra, inter)` where `intra`
    /// holds the ranks on this rank's host and `inter` the ranks with the same local index on
    /// every host. Every rank must call it (it counts as one `new_group` call).
    ///
    /// # Errors
    /// As [`ProcessGroup::new_group`].
    pub fn split_by_host(&self) -> Result<(ProcessGroup, ProcessGroup)> {
        let k = self.inner.groups_created.fetch_add(1, Ordering::SeqCst);
        let host_of = &self.inner.host_of;
        let me = self.rank();
        let my_host = host_of[me];
        let intra: Vec<usize> = (0..self.world_size())
            .filter(|r| host_of[*r] == my_host)
            .collect();
        let local_idx = intra.iter().position(|r| *r == me).unwrap_or(0);
        let n_hosts = self.num_hosts();
        let inter: Vec<usize> = (0..n_hosts)
            .filter_map(|h| {
                (0..self.world_size())
                    .filter(|r| host_of[*r] == h)
                    .nth(local_idx)
            })
            .collect();
        let p = &self.inner.ctx.prefix;
        let a = self.make_subgroup(&intra, format!("{p}/g{k}/host{my_host}"))?;
        let b = self.make_subgroup(&inter, format!("{p}/g{k}/local{local_idx}"))?;
        Ok((a, b))
    }
}

impl Inner {
    fn exec(
        &self,
        h: OpHeader,
        f: impl FnOnce(&mut dyn Backend, &OpHeader, &mut Traffic) -> Result<()>,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let mut h = h;
        if !matches!(h.kind, OpKind::Send | OpKind::Recv) {
            st.seq += 1;
            h.seq = st.seq;
        }
        let mut t = Traffic::default();
        let timeout = st.op_timeout.unwrap_or(self.ctx.opts.timeout);
        st.backend.set_op_deadline(Some(Instant::now() + timeout));
        // A panic inside a backend leaves it mid-protocol: the group is failed (and the peers
        // told) before the panic goes on, so no later op runs on the broken state.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            f(&mut *st.backend, &h, &mut t)
        }));
        st.backend.set_op_deadline(None);
        let outcome = match run {
            Ok(r) => r,
            Err(panic) => {
                st.fail(CommError::Io {
                    context: format!("{} (op {})", h.kind.name(), h.seq),
                    message: format!("the backend panicked: {}", panic_message(&*panic)),
                });
                drop(st);
                std::panic::resume_unwind(panic);
            }
        };
        match outcome {
            Ok(()) => {
                lock(&self.stats).record(h.kind, t);
                Ok(())
            }
            // The backends say how long the group's timeout is; a longer one ran out here.
            Err(CommError::Timeout { peer, op, .. }) if st.op_timeout.is_some() => {
                Err(st.fail(CommError::Timeout { peer, op, waited_ms: timeout.as_millis() as u64 }))
            }
            Err(e) => Err(st.fail(e)),
        }
    }

    fn check_root(&self, what: &'static str, root: usize) -> Result<()> {
        if root >= self.ctx.world {
            return Err(CommError::InvalidRank {
                what,
                rank: root,
                world: self.ctx.world,
            });
        }
        Ok(())
    }

    fn all_reduce(&self, dt: DType, buf: &mut [u8], op: ReduceOp) -> Result<()> {
        let h = OpHeader::new(OpKind::AllReduce, dt, Some(op), 0, buf.len() / dt.size());
        self.exec(h, |b, h, t| b.all_reduce(h, buf, op, t))
    }

    fn broadcast(&self, dt: DType, buf: &mut [u8], root: usize) -> Result<()> {
        self.check_root("broadcast root", root)?;
        let h = OpHeader::new(OpKind::Broadcast, dt, None, root, buf.len() / dt.size());
        self.exec(h, |b, h, t| b.broadcast(h, buf, root, t))
    }

    fn reduce(&self, dt: DType, buf: &mut [u8], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root("reduce root", root)?;
        let h = OpHeader::new(OpKind::Reduce, dt, Some(op), root, buf.len() / dt.size());
        self.exec(h, |b, h, t| b.reduce(h, buf, op, root, t))
    }

    fn all_gather(&self, dt: DType, input: &[u8], out: &mut [u8]) -> Result<()> {
        let w = self.ctx.world;
        if out.len() != input.len() * w {
            return Err(CommError::Length {
                op: "all_gather",
                what: "output",
                expected: input.len() * w / dt.size(),
                actual: out.len() / dt.size(),
            });
        }
        let h = OpHeader::new(OpKind::AllGather, dt, None, 0, out.len() / dt.size());
        self.exec(h, |b, h, t| b.all_gather(h, input, out, t))
    }

    fn reduce_scatter(&self, dt: DType, input: &[u8], out: &mut [u8], op: ReduceOp) -> Result<()> {
        let w = self.ctx.world;
        if input.len() != out.len() * w {
            return Err(CommError::Length {
                op: "reduce_scatter",
                what: "input",
                expected: out.len() * w / dt.size(),
                actual: input.len() / dt.size(),
            });
        }
        let h = OpHeader::new(
            OpKind::ReduceScatter,
            dt,
            Some(op),
            0,
            input.len() / dt.size(),
        );
        self.exec(h, |b, h, t| b.reduce_scatter(h, input, out, op, t))
    }

    fn barrier(&self) -> Result<()> {
        let h = OpHeader::new(OpKind::Barrier, DType::U8, None, 0, 0);
        self.exec(h, |b, h, t| b.barrier(h, t))
    }

    fn check_peer(&self, what: &'static str, peer: usize) -> Result<()> {
        if peer >= self.ctx.world || peer == self.ctx.rank {
            return Err(CommError::InvalidRank {
                what,
                rank: peer,
                world: self.ctx.world,
            });
        }
        Ok(())
    }

    fn send(&self, dt: DType, buf: &[u8], dst: usize) -> Result<()> {
        self.check_peer("send destination", dst)?;
        let h = OpHeader::new(OpKind::Send, dt, None, 0, buf.len() / dt.size());
        self.exec(h, |b, h, t| b.send(h, buf, dst, t))
    }

    fn recv(&self, dt: DType, buf: &mut [u8], src: usize) -> Result<()> {
        self.check_peer("recv source", src)?;
        let h = OpHeader::new(OpKind::Recv, dt, None, 0, buf.len() / dt.size());
        self.exec(h, |b, h, t| b.recv(h, buf, src, t))
    }
}

struct WorkSlot<T> {
    result: Mutex<Option<Result<T>>>,
    cv: Condvar,
    done: AtomicBool,
}

/// Settles an async job however it ends: after the job stored its result, or with an error when
/// the job panicked or was dropped unrun (its communication thread could not start). Either way
/// the pending count goes down, so neither [`Work::wait`] nor the next synchronous op waits for
/// it forever. A job that did not finish may have left this rank out of step with its peers, so
/// it fails the group (and tells the peers) unless that already happened.
struct JobGuard<R> {
    slot: Arc<WorkSlot<R>>,
    inner: Arc<Inner>,
}

impl<R> Drop for JobGuard<R> {
    fn drop(&mut self) {
        if !self.slot.done.load(Ordering::Acquire) {
            let message = if std::thread::panicking() {
                "the operation panicked on the communication thread"
            } else {
                "the communication thread ended before the operation ran"
            };
            // Unwinding has released any lock the job held (`exec` drops its own before it lets
            // a backend's panic go on), so the state lock is free here.
            let mut st = lock(&self.inner.state);
            let err = match &st.failed {
                Some(e) => e.clone(),
                None => st.fail(CommError::Io {
                    context: "async op".into(),
                    message: message.into(),
                }),
            };
            drop(st);
            self.slot.complete(Err(err));
        }
        let (m, cv) = &self.inner.pending;
        *lock(m) -= 1;
        cv.notify_all();
    }
}

impl<T> WorkSlot<T> {
    fn complete(&self, r: Result<T>) {
        *lock(&self.result) = Some(r);
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// Handle of an async operation.
pub struct Work<T> {
    slot: Arc<WorkSlot<T>>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    /// True once the operation finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.slot.done.load(Ordering::Acquire)
    }

    /// Blocks until the operation finishes; returns its buffers. Bounded by the group timeout.
    ///
    /// # Errors
    /// The operation's error.
    pub fn wait(self) -> Result<T> {
        let mut g = lock(&self.slot.result);
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            g = self.slot.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod guard_tests {
    use super::*;

    /// The whole bootstrap shares one timeout: a peer that shows up late in the host exchange
    /// and then never publishes its address fails the group at `timeout` after the start, not
    /// at a second full timeout after the host exchange (up to four with the hierarchical
    /// backend).
    #[test]
    fn the_bootstrap_shares_one_timeout() {
        within_10s(|| {
            let timeout = std::time::Duration::from_millis(2000);
            let opts = CommOptions { timeout, backend: BackendKind::Tcp, ..CommOptions::default() };
            let store = Arc::new(LocalStore::new());
            let late = store.clone();
            let ours = agreed_options(&opts);
            let peer = std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(1800));
                late.set("boot/host/0", format!("{ours}\nhost-0").as_bytes())
            });
            let t0 = Instant::now();
            let Err(err) = ProcessGroup::new(1, 2, store, "boot", opts) else {
                panic!("rank 0 never publishes its address")
            };
            let took = t0.elapsed();
            peer.join().unwrap().unwrap();
            assert!(err.to_string().contains("boot/tcp/0"), "waits for rank 0's address: {err}");
            assert_eq!(err.peer(), Some(0), "rank 0, which never published its address, is named: {err}");
            // 2 s of budget; a timeout per phase would end at 1.8 + 2 = 3.8 s.
            assert!(took < std::time::Duration::from_millis(3500), "took {took:?}: {err}");
        })
    }

    fn solo(prefix: &str) -> ProcessGroup {
        ProcessGroup::new(0, 1, Arc::new(LocalStore::new()), prefix, CommOptions::default()).unwrap()
    }

    /// Runs `f` on a thread of its own and fails if it does not end within 10 s (a hang must fail
    /// the test, not stall it).
    fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(10)) {
            Ok(v) => v,
            Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung for 10 s"),
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test body panicked (above)"),
        }
    }

    #[test]
    fn a_panicking_async_op_settles_its_work_and_fails_the_group() {
        within_10s(|| {
            let pg = solo("guard-async");
            let work = pg.submit(|_: &Inner| -> Result<()> { panic!("boom in a job") });
            let err = work.wait().unwrap_err();
            assert!(err.to_string().contains("panicked on the communication thread"), "{err}");
            // The pending count went down (a sync op would otherwise wait forever), and the
            // group is failed: this rank may be out of step with its peers.
            let mut v = vec![1.0f32, 2.0];
            let err = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            assert!(err.to_string().contains("panicked on the communication thread"), "{err}");
            // The communication thread lives on and answers the next async op.
            let err = pg.all_reduce_async(v, ReduceOp::Sum).wait().unwrap_err();
            assert!(err.to_string().contains("panicked on the communication thread"), "{err}");
        });
    }

    #[test]
    fn a_panic_inside_a_backend_fails_the_group() {
        within_10s(|| {
            let pg = solo("guard-exec");
            let h = OpHeader::new(OpKind::AllReduce, DType::F32, Some(ReduceOp::Sum), 0, 2);
            let inner = pg.inner.clone();
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = inner.exec(h, |_, _, _| panic!("boom in a backend"));
            }));
            assert!(panicked.is_err(), "the panic goes on to the caller");
            let mut v = vec![1.0f32, 2.0];
            let err = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
            assert!(err.to_string().contains("the backend panicked: boom in a backend"), "{err}");
            // An async op of the failed group reports the same error instead of hanging.
            let err = pg.all_reduce_async(v, ReduceOp::Sum).wait().unwrap_err();
            assert!(err.to_string().contains("the backend panicked"), "{err}");
        });
    }
}
