//! NCCL communicator over CUDA device buffers (feature `nccl`).
//!
//! Nothing CUDA-related is needed at build time: cudarc loads the CUDA driver at run time, and
//! [`loader`] finds `libnccl` itself (it also finds the copy pip installed for PyTorch, which
//! cudarc's own loader misses). [`probe`] checks both; a missing library is a
//! [`CommError::CudaUnavailable`] naming what was tried, never a panic (cudarc panics on a
//! missing driver when a symbol is first used, so driver calls are also guarded by
//! `catch_unwind`).
//!
//! Every wait has a deadline: the communicator is created non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`) and polled with `ncclCommGetAsyncError`
//! until it is ready, and [`NcclGroup::synchronize`] polls the stream the same way; when the
//! group's timeout passes first (a rank that never joins, a peer that died mid-collective),
//! the communicator is aborted and every later call reports the same error.
//!
//! The 128-byte unique id is created by rank 0 ([`unique_id`]) and travels through a
//! [`Store`] ([`NcclGroup::new`]) or the worker runtime's rendezvous exchange
//! ([`NcclGroup::from_unique_id`]).
//!
//! An [`NcclGroup`] is neither `Send` nor `Sync`: keep it on one thread (the training loop's
//! or a dedicated communication thread).

pub mod loader;

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};

use super::dtype::ReduceOp;
use super::error::{CommError, Result};
use super::store::Store;
use loader::{IN_PROGRESS, Nccl, RawComm, RawConfig, RawUniqueId, SUCCESS, nccl};

/// Element types NCCL reduces, with their `ncclDataType_t`.
pub trait NcclType: DeviceRepr {
    /// The `ncclDataType_t` value.
    const DTYPE: c_int;
}

macro_rules! nccl_type {
    ($($t:ty => $v:expr),* $(,)?) => {
        $(impl NcclType for $t { const DTYPE: c_int = $v; })*
    };
}
nccl_type!(i8 => 0, u8 => 1, i32 => 2, u32 => 3, i64 => 4, u64 => 5, half::f16 => 6, f32 => 7,
    f64 => 8, half::bf16 => 9);

fn guarded<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(CommError::CudaUnavailable(format!(
            "{what}: {}",
            super::panic_message(&*p)
        ))),
    }
}

/// Checks that the CUDA driver and NCCL libraries can be loaded.
///
/// # Errors
/// [`CommError::CudaUnavailable`] naming the missing library.
pub fn probe() -> Result<()> {
    probe_driver()?;
    nccl().map(|_| ())
}

/// The NCCL version (`major.minor.patch`) and the file it was loaded from.
///
/// # Errors
/// [`CommError::CudaUnavailable`] when NCCL cannot be loaded.
pub fn nccl_version() -> Result<(String, String)> {
    let lib = nccl()?;
    Ok((lib.version_string(), lib.path.clone()))
}

/// The number of CUDA devices.
///
/// # Errors
/// [`CommError::CudaUnavailable`] without a driver or when the driver fails (no device).
pub fn device_count() -> Result<usize> {
    probe_driver()?;
    guarded("counting CUDA devices", || {
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .map_err(|e| CommError::CudaUnavailable(format!("cuDeviceGetCount: {e:?}")))
    })
}

fn probe_driver() -> Result<()> {
    guarded("probing libcuda", || {
        // SAFETY: only tries to dlopen the library candidates.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(CommError::CudaUnavailable(
                "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver on this \
                 machine"
                    .into(),
            ))
        }
    })
}

/// A new NCCL unique id (`ncclGetUniqueId`), for rank 0 to hand to the others.
///
/// # Errors
/// NCCL cannot be loaded, or the call fails (e.g. no usable network interface for bootstrap).
pub fn unique_id() -> Result<[u8; 128]> {
    let lib = nccl()?;
    let mut raw = RawUniqueId { internal: [0; 128] };
    // SAFETY: writes the 128-byte id.
    let rc = unsafe { (lib.get_unique_id)(&mut raw) };
    if rc != SUCCESS {
        return Err(CommError::Nccl {
            op: "ncclGetUniqueId",
            detail: lib.describe(rc, None),
        });
    }
    Ok(raw.internal.map(|c| c as u8))
}

fn nccl_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

/// An NCCL communicator for one process and one GPU.
pub struct NcclGroup {
    lib: &'static Nccl,
    comm: RawComm,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// The first failure; every later call returns it.
    failed: RefCell<Option<CommError>>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("nccl", &self.lib.version_string())
            .finish()
    }
}

impl NcclGroup {
    /// Creates the communicator on GPU `device`; rank 0 publishes the unique id under
    /// `{prefix}/nccl/id` of `store`, the others wait up to `timeout` for it.
    ///
    /// # Errors
    /// [`CommError::CudaUnavailable`] without CUDA/NCCL, store timeouts, NCCL init errors or a
    /// communicator that is not ready within `timeout`.
    pub fn new(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        prefix: &str,
        device: usize,
        timeout: Duration,
    ) -> Result<Self> {
        check_rank(rank, world)?;
        probe()?;
        let key = format!("{prefix}/nccl/id");
        let id = if rank == 0 {
            let id = unique_id()?;
            store.set(&key, &id)?;
            id
        } else {
            let bytes = store.get(&key, timeout)?;
            bytes.as_slice().try_into().map_err(|_| CommError::Store {
                key: key.clone(),
                reason: format!("nccl id has {} bytes, expected 128", bytes.len()),
            })?
        };
        Self::from_unique_id(rank, world, &id, device, timeout)
    }

    /// Creates the communicator on GPU `device` from a unique id every rank already holds (the
    /// worker runtime's `WorkerContext::unique_id` exchange). `timeout` bounds the setup and
    /// every later [`NcclGroup::synchronize`].
    ///
    /// # Errors
    /// As [`NcclGroup::new`].
    pub fn from_unique_id(
        rank: usize,
        world: usize,
        id: &[u8; 128],
        device: usize,
        timeout: Duration,
    ) -> Result<Self> {
        check_rank(rank, world)?;
        if timeout.is_zero() {
            return Err(CommError::InvalidArgument("timeout must be positive".into()));
        }
        probe()?;
        let lib = nccl()?;
        let (ctx, stream) = guarded("opening the GPU", || {
            let ctx = CudaContext::new(device)
                .map_err(|e| CommError::CudaUnavailable(format!("opening GPU {device}: {e:?}")))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| CommError::CudaUnavailable(format!("a stream on GPU {device}: {e:?}")))?;
            Ok((ctx, stream))
        })?;
        ctx.bind_to_thread()
            .map_err(|e| CommError::CudaUnavailable(format!("binding GPU {device}: {e:?}")))?;
        let raw_id = RawUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut config = RawConfig::non_blocking();
        let mut comm: RawComm = std::ptr::null_mut();
        let (n, r) = (to_int(world, "world size")?, to_int(rank, "rank")?);
        // SAFETY: `comm` and `config` outlive the call; the id is passed by value as nccl.h says.
        let rc = unsafe { (lib.comm_init_rank_config)(&mut comm, n, raw_id, r, &mut config) };
        if rc != SUCCESS && rc != IN_PROGRESS {
            if !comm.is_null() {
                // SAFETY: a communicator NCCL handed out; aborted once and never used again.
                unsafe { (lib.comm_abort)(comm) };
            }
            return Err(CommError::Nccl {
                op: "ncclCommInitRankConfig",
                detail: lib.describe(rc, None),
            });
        }
        let group = NcclGroup {
            lib,
            comm,
            ctx,
            stream,
            rank,
            world,
            timeout,
            failed: RefCell::new(None),
        };
        group.settle("ncclCommInitRankConfig", Instant::now() + timeout)?;
        Ok(group)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The stream the collectives are enqueued on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }

    /// The CUDA context of this group's GPU.
    pub fn context(&self) -> Arc<CudaContext> {
        self.ctx.clone()
    }

    /// In-place all-reduce (enqueued on [`NcclGroup::stream`]).
    ///
    /// # Errors
    /// NCCL errors, or the group failed earlier.
    pub fn all_reduce<T: NcclType>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        let count = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        // SAFETY (every enqueue below): device pointers of live buffers of `count` elements of
        // `T::DTYPE`, kept alive (and ordered on this stream) by the `_sync` guards until the call
        // returned; the communicator and stream are this group's.
        self.call("ncclAllReduce", |l, comm, s| unsafe {
            (l.all_reduce)(ptr as *const c_void, ptr as *mut c_void, count, T::DTYPE, nccl_op(op), comm, s)
        })
    }

    /// Out-of-place all-reduce: `recv = op(send of every rank)`; `recv.len() == send.len()`.
    ///
    /// # Errors
    /// Length mismatch or NCCL errors.
    pub fn all_reduce_into<T: NcclType>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if recv.len() != send.len() {
            return Err(CommError::Length {
                op: "all_reduce",
                what: "output",
                expected: send.len(),
                actual: recv.len(),
            });
        }
        let count = send.len();
        let (src, _s1) = send.device_ptr(&self.stream);
        let (dst, _s2) = recv.device_ptr_mut(&self.stream);
        // SAFETY: as `all_reduce`, with distinct input and output buffers.
        self.call("ncclAllReduce", |l, comm, s| unsafe {
            (l.all_reduce)(src as *const c_void, dst as *mut c_void, count, T::DTYPE, nccl_op(op), comm, s)
        })
    }

    /// In-place broadcast from `root`.
    ///
    /// # Errors
    /// An out-of-range root, NCCL errors.
    pub fn broadcast<T: NcclType>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        let root = self.peer(root, "root")?;
        let count = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        self.call("ncclBroadcast", |l, comm, s| unsafe {
            (l.broadcast)(ptr as *const c_void, ptr as *mut c_void, count, T::DTYPE, root, comm, s)
        })
    }

    /// All-gather: `output.len() == world × input.len()`, rank-major.
    ///
    /// # Errors
    /// Length mismatch or NCCL errors.
    pub fn all_gather<T: NcclType>(&self, input: &CudaSlice<T>, output: &mut CudaSlice<T>) -> Result<()> {
        if output.len() != input.len() * self.world {
            return Err(CommError::Length {
                op: "all_gather",
                what: "output",
                expected: input.len() * self.world,
                actual: output.len(),
            });
        }
        let count = input.len();
        let (src, _s1) = input.device_ptr(&self.stream);
        let (dst, _s2) = output.device_ptr_mut(&self.stream);
        self.call("ncclAllGather", |l, comm, s| unsafe {
            (l.all_gather)(src as *const c_void, dst as *mut c_void, count, T::DTYPE, comm, s)
        })
    }

    /// Reduce-scatter: `input.len() == world × output.len()`, rank-major.
    ///
    /// # Errors
    /// Length mismatch or NCCL errors.
    pub fn reduce_scatter<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        if input.len() != output.len() * self.world {
            return Err(CommError::Length {
                op: "reduce_scatter",
                what: "input",
                expected: output.len() * self.world,
                actual: input.len(),
            });
        }
        let count = output.len();
        let (src, _s1) = input.device_ptr(&self.stream);
        let (dst, _s2) = output.device_ptr_mut(&self.stream);
        self.call("ncclReduceScatter", |l, comm, s| unsafe {
            (l.reduce_scatter)(src as *const c_void, dst as *mut c_void, count, T::DTYPE, nccl_op(op), comm, s)
        })
    }

    /// Point-to-point send to `dst`.
    ///
    /// # Errors
    /// An out-of-range peer, NCCL errors.
    pub fn send<T: NcclType>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        let peer = self.peer(dst, "destination")?;
        let count = buf.len();
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        self.call("ncclSend", |l, comm, s| unsafe {
            (l.send)(ptr as *const c_void, count, T::DTYPE, peer, comm, s)
        })
    }

    /// Point-to-point receive from `src`.
    ///
    /// # Errors
    /// An out-of-range peer, NCCL errors.
    pub fn recv<T: NcclType>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        let peer = self.peer(src, "source")?;
        let count = buf.len();
        let (ptr, _sync) = buf.device_ptr_mut(&self.stream);
        self.call("ncclRecv", |l, comm, s| unsafe {
            (l.recv)(ptr as *mut c_void, count, T::DTYPE, peer, comm, s)
        })
    }

    /// Runs `ops` inside `ncclGroupStart`/`ncclGroupEnd` (fused launches, or a send and a receive
    /// between the same two ranks without deadlock).
    ///
    /// # Errors
    /// The first error of `ops`, or of the group end.
    pub fn grouped(&self, ops: impl FnOnce(&Self) -> Result<()>) -> Result<()> {
        self.healthy()?;
        // SAFETY: no arguments; balanced by the group end below on every path.
        let rc = unsafe { (self.lib.group_start)() };
        if rc != SUCCESS {
            return Err(self.fail("ncclGroupStart", rc));
        }
        let inner = ops(self);
        // SAFETY: closes the group opened above.
        let rc = unsafe { (self.lib.group_end)() };
        inner?;
        if rc != SUCCESS && rc != IN_PROGRESS {
            return Err(self.fail("ncclGroupEnd", rc));
        }
        self.settle("ncclGroupEnd", Instant::now() + self.timeout)
    }

    /// Waits until every enqueued operation finished on the GPU, at most the group's timeout;
    /// on a timeout or an asynchronous NCCL error the communicator is aborted.
    ///
    /// # Errors
    /// [`CommError::Timeout`] naming the wait, or the NCCL/CUDA error.
    pub fn synchronize(&self) -> Result<()> {
        self.healthy()?;
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.poison(CommError::Nccl { op: "cuEventRecord", detail: format!("{e:?}") }))?;
        let start = Instant::now();
        let deadline = start + self.timeout;
        let mut pause = Duration::from_micros(2);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(self.poison(CommError::Nccl {
                        op: "cuEventQuery",
                        detail: format!("{e:?}"),
                    }));
                }
            }
            self.async_state("synchronize")?;
            if Instant::now() >= deadline {
                return Err(self.timed_out("synchronize", start));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn peer(&self, peer: usize, what: &'static str) -> Result<c_int> {
        if peer >= self.world {
            return Err(CommError::InvalidRank {
                what,
                rank: peer,
                world: self.world,
            });
        }
        to_int(peer, what)
    }

    fn healthy(&self) -> Result<()> {
        match &*self.failed.borrow() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Enqueues one NCCL call and waits until NCCL accepted it (non-blocking communicators may
    /// answer `ncclInProgress`).
    fn call(
        &self,
        op: &'static str,
        f: impl FnOnce(&Nccl, RawComm, *mut c_void) -> c_int,
    ) -> Result<()> {
        self.healthy()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CommError::CudaUnavailable(format!("binding the GPU: {e:?}")))?;
        let rc = f(self.lib, self.comm, self.stream.cu_stream() as *mut c_void);
        match rc {
            SUCCESS => Ok(()),
            IN_PROGRESS => self.settle(op, Instant::now() + self.timeout),
            rc => Err(self.fail(op, rc)),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the communicator is not `ncclInProgress`.
    fn settle(&self, op: &'static str, deadline: Instant) -> Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(2);
        while self.async_state(op)? {
            if Instant::now() >= deadline {
                return Err(self.timed_out(op, start));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }

    /// `Ok(true)` while the communicator is still in progress.
    fn async_state(&self, op: &'static str) -> Result<bool> {
        let mut state: c_int = SUCCESS;
        // SAFETY: a live communicator; writes one int.
        let rc = unsafe { (self.lib.comm_get_async_error)(self.comm, &mut state) };
        if rc != SUCCESS {
            return Err(self.fail(op, rc));
        }
        match state {
            SUCCESS => Ok(false),
            IN_PROGRESS => Ok(true),
            state => Err(self.fail(op, state)),
        }
    }

    fn timed_out(&self, op: &'static str, start: Instant) -> CommError {
        // NCCL does not say which rank is missing; with one rank the culprit is this one.
        let peer = if self.world == 1 { 0 } else { (self.rank + 1) % self.world };
        self.poison(CommError::Timeout {
            peer,
            op: format!("{op} (NCCL, world {}): a rank did not take part", self.world),
            waited_ms: start.elapsed().as_millis() as u64,
        })
    }

    fn fail(&self, op: &'static str, rc: c_int) -> CommError {
        self.poison(CommError::Nccl {
            op,
            detail: self.lib.describe(rc, Some(self.comm)),
        })
    }

    /// Records the first failure and aborts the communicator (pending operations end).
    fn poison(&self, err: CommError) -> CommError {
        let mut failed = self.failed.borrow_mut();
        if failed.is_none() {
            // SAFETY: a live communicator; after the abort only `Drop` touches it (and skips it).
            unsafe { (self.lib.comm_abort)(self.comm) };
            *failed = Some(err.clone());
        }
        err
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if self.failed.get_mut().is_none() && !self.comm.is_null() {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: a live communicator that was not aborted; never used again. Abort rather
            // than destroy: destroy waits for peers, which may be gone.
            unsafe { (self.lib.comm_abort)(self.comm) };
        }
    }
}

fn check_rank(rank: usize, world: usize) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(CommError::InvalidRank {
            what: "own",
            rank,
            world,
        });
    }
    Ok(())
}

fn to_int(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| CommError::InvalidArgument(format!("{what} {v} does not fit NCCL's int")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalStore;

    /// Up to the hardware boundary: without CUDA this must be a clear error, not a panic.
    #[test]
    fn missing_cuda_is_an_error_not_a_panic() {
        let store: Arc<dyn Store> = Arc::new(LocalStore::new());
        match NcclGroup::new(0, 1, store, "t", 0, Duration::from_secs(5)) {
            Ok(g) => assert_eq!(g.world_size(), 1), // a machine with a GPU
            Err(CommError::CudaUnavailable(msg)) => assert!(msg.contains("lib"), "{msg}"),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    #[test]
    fn bad_ranks_are_refused_before_any_library_is_touched() {
        let id = [0u8; 128];
        let err = NcclGroup::from_unique_id(2, 2, &id, 0, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, CommError::InvalidRank { rank: 2, world: 2, .. }), "{err}");
        let err = NcclGroup::from_unique_id(0, 0, &id, 0, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, CommError::InvalidRank { .. }), "{err}");
    }

    #[test]
    fn a_missing_library_file_is_named() {
        // Only meaningful where no NCCL is installed; elsewhere the probe succeeds.
        if let Err(CommError::CudaUnavailable(msg)) = nccl().map(|_| ()) {
            assert!(msg.contains("libnccl.so.2"), "{msg}");
            assert!(msg.contains(loader::NCCL_LIBRARY_ENV), "{msg}");
        }
    }
}
