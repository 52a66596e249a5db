//! NCCL communicator over CUDA device buffers (feature `nccl`).
//!
//! cudarc is built with dynamic loading, so nothing CUDA-related is needed at build time. At run
//! time [`probe`] checks that `libcuda` and `libnccl` can be loaded; a missing library is a
//! [`CommError::CudaUnavailable`], never a panic (cudarc panics on a missing library when a
//! symbol is first used, so every call into it is also guarded by `catch_unwind`).
//!
//! The 128-byte NCCL unique id is created by rank 0 and travels through the same [`Store`]
//! as the CPU process groups (the worker runtime's exchange).
//!
//! A cudarc `Comm` is not `Send`: keep an [`NcclGroup`] on one thread (the training loop's or
//! a dedicated communication thread).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
pub use cudarc::nccl::NcclType;
use cudarc::nccl::{Comm, Id};

use super::dtype::ReduceOp;
use super::error::{CommError, Result};
use super::store::Store;

fn guarded<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(CommError::CudaUnavailable(format!("{what}: {msg}")))
        }
    }
}

/// Checks that the CUDA driver and NCCL libraries can be loaded.
///
/// # Errors
/// [`CommError::CudaUnavailable`] naming the missing library.
pub fn probe() -> Result<()> {
    guarded("probing libcuda", || {
        // SAFETY: only tries to dlopen the library candidates; no symbol is called.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(CommError::CudaUnavailable(
                "the CUDA driver library (libcuda.so) was not found".into(),
            ))
        }
    })?;
    guarded("probing libnccl", || {
        // SAFETY: as above.
        if unsafe { cudarc::nccl::sys::is_culib_present() } {
            Ok(())
        } else {
            Err(CommError::CudaUnavailable(
                "the NCCL library (libnccl.so) was not found".into(),
            ))
        }
    })
}

fn nccl_op(op: ReduceOp) -> cudarc::nccl::ReduceOp {
    match op {
        ReduceOp::Sum => cudarc::nccl::ReduceOp::Sum,
        ReduceOp::Avg => cudarc::nccl::ReduceOp::Avg,
        ReduceOp::Max => cudarc::nccl::ReduceOp::Max,
        ReduceOp::Min => cudarc::nccl::ReduceOp::Min,
    }
}

fn nccl_err(op: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> CommError {
    move |e| CommError::Nccl {
        op,
        detail: format!("{e:?}"),
    }
}

/// An NCCL communicator for one process and one GPU.
pub struct NcclGroup {
    comm: Comm,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclGroup {
    /// Creates the communicator on GPU `device`; rank 0 publishes the unique id under
    /// `{prefix}/nccl/id`.
    ///
    /// # Errors
    /// [`CommError::CudaUnavailable`] without CUDA/NCCL, store timeouts, NCCL init errors.
    pub fn new(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        prefix: &str,
        device: usize,
        timeout: Duration,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::InvalidRank {
                what: "own",
                rank,
                world,
            });
        }
        probe()?;
        let key = format!("{prefix}/nccl/id");
        guarded("creating the NCCL communicator", || {
            let id = if rank == 0 {
                let id = Id::new().map_err(nccl_err("ncclGetUniqueId"))?;
                let bytes: Vec<u8> = id.internal().iter().map(|c| *c as u8).collect();
                store.set(&key, &bytes)?;
                id
            } else {
                let bytes = store.get(&key, timeout)?;
                if bytes.len() != 128 {
                    return Err(CommError::Store {
                        key: key.clone(),
                        reason: format!("nccl id has {} bytes, expected 128", bytes.len()),
                    });
                }
                let mut raw = [0 as std::ffi::c_char; 128];
                for (d, s) in raw.iter_mut().zip(&bytes) {
                    *d = *s as std::ffi::c_char;
                }
                Id::uninit(raw)
            };
            let ctx = CudaContext::new(device)
                .map_err(|e| CommError::CudaUnavailable(format!("opening GPU {device}: {e:?}")))?;
            let stream = ctx.default_stream();
            let comm =
                Comm::from_rank(stream, rank, world, id).map_err(nccl_err("ncclCommInitRank"))?;
            Ok(NcclGroup { comm, rank, world })
        })
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
        self.comm.stream()
    }

    /// In-place all-reduce (enqueued on [`NcclGroup::stream`]).
    ///
    /// # Errors
    /// NCCL errors.
    pub fn all_reduce<T: NcclType>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        guarded("ncclAllReduce", || {
            self.comm
                .all_reduce_in_place(buf, &nccl_op(op))
                .map(|_| ())
                .map_err(nccl_err("all_reduce"))
        })
    }

    /// In-place broadcast from `root`.
    ///
    /// # Errors
    /// NCCL errors.
    pub fn broadcast<T: NcclType>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        guarded("ncclBroadcast", || {
            self.comm
                .broadcast_in_place(buf, root as i32)
                .map(|_| ())
                .map_err(nccl_err("broadcast"))
        })
    }

    /// All-gather: `output.len() == world × input.len()`, rank-major.
    ///
    /// # Errors
    /// Length mismatch or NCCL errors.
    pub fn all_gather<T: NcclType>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        if output.len() != input.len() * self.world {
            return Err(CommError::Length {
                op: "all_gather",
                what: "output",
                expected: input.len() * self.world,
                actual: output.len(),
            });
        }
        guarded("ncclAllGather", || {
            self.comm
                .all_gather(input, output)
                .map(|_| ())
                .map_err(nccl_err("all_gather"))
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
        guarded("ncclReduceScatter", || {
            self.comm
                .reduce_scatter(input, output, &nccl_op(op))
                .map(|_| ())
                .map_err(nccl_err("reduce_scatter"))
        })
    }

    /// Point-to-point send.
    ///
    /// # Errors
    /// NCCL errors.
    pub fn send<T: NcclType>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        guarded("ncclSend", || {
            self.comm.send(buf, dst as i32).map_err(nccl_err("send"))
        })
    }

    /// Point-to-point receive.
    ///
    /// # Errors
    /// NCCL errors.
    pub fn recv<T: NcclType>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        guarded("ncclRecv", || {
            self.comm
                .recv(buf, src as i32)
                .map(|_| ())
                .map_err(nccl_err("recv"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalStore;

    /// Up to the hardware boundary: without CUDA this must be a clear error, not a panic.
    #[test]
    fn missing_cuda_is_an_error_not_a_panic() {
        let store: Arc<dyn Store> = Arc::new(LocalStore::new());
        match NcclGroup::new(0, 1, store, "t", 0, Duration::from_secs(1)) {
            Ok(g) => assert_eq!(g.world_size(), 1), // a machine with a GPU
            Err(CommError::CudaUnavailable(msg)) => assert!(msg.contains("lib"), "{msg}"),
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
}
