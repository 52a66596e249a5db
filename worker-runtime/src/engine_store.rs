//! The training engine's [`Store`] over the rendezvous store: how collectives bootstrap under rsrun.
//!
//! The engine's store is synchronous (training loops are); the rendezvous client is async. An
//! [`EngineStore`] owns a one-thread tokio runtime and hands each call to it, waiting on a plain
//! channel, so it works from any thread, inside or outside another runtime.
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use rsrun_training_engine::comm::{CommOptions, ProcessGroup, ReduceOp};
//! use rsrun_worker_runtime::{WorkerContext, engine_store::EngineStore};
//! let ctx = WorkerContext::from_env()?;
//! let store = Arc::new(EngineStore::new(&ctx)?);
//! let pg = ProcessGroup::new(ctx.rank as usize, ctx.world_size as usize, store, "main", CommOptions::default())?;
//! let mut grads = vec![1.0f32; 1024];
//! pg.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok(()) }
//! ```

use std::time::Duration;

use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::client::StoreClient;
use rsrun_training_engine::comm::{CommError, Store};

use crate::{WorkerContext, WorkerError};

/// The one-thread runtime that runs an [`EngineStore`]'s calls.
fn store_runtime() -> Result<tokio::runtime::Runtime, WorkerError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("rsrun-store")
        .enable_all()
        .build()
        .map_err(|e| WorkerError::Io { path: "tokio runtime".into(), source: e })
}

/// The rendezvous store of this worker's job and round, as the engine's blocking [`Store`].
#[derive(Debug)]
pub struct EngineStore {
    store: StoreClient,
    /// Always `Some` until dropped; taken in `Drop` to shut down without blocking (dropping a
    /// runtime inside another runtime's context would panic).
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for EngineStore {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl EngineStore {
    /// Connects to the job's store (fenced to the worker's round).
    ///
    /// # Errors
    /// No rendezvous service in the environment, a bad endpoint or token file, or no runtime thread.
    pub fn new(ctx: &WorkerContext) -> Result<Self, WorkerError> {
        let rt = store_runtime()?;
        let store = {
            let _in_rt = rt.enter();
            ctx.store()
        };
        match store {
            Ok(store) => Ok(EngineStore { store, rt: Some(rt) }),
            Err(e) => {
                // Dropping a runtime inside another runtime's context would panic.
                rt.shutdown_background();
                Err(e)
            }
        }
    }

    /// Wraps an existing store client. Its connection is a task of the runtime it was created
    /// on, which must keep running on threads of its own while the engine calls: the engine's
    /// calls block their thread until that task answers, so a client of a current-thread
    /// runtime whose one thread makes the engine's calls never answers (every call then times
    /// out). [`EngineStore::new`] runs a client of its own and has no such limit.
    ///
    /// # Errors
    /// The store's runtime cannot start.
    pub fn from_client(store: StoreClient) -> Result<Self, WorkerError> {
        let rt = store_runtime()?;
        Ok(EngineStore { store, rt: Some(rt) })
    }

    /// The store client (its channel lives on this store's runtime).
    pub(crate) fn client(&self) -> &StoreClient {
        &self.store
    }

    /// Runs `fut` on this store's runtime; the result can be awaited from any runtime.
    pub(crate) async fn spawn<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T, RdzvError> {
        let Some(rt) = &self.rt else {
            return Err(RdzvError::Unavailable("the store is shut down".into()));
        };
        rt.spawn(fut).await.map_err(|e| RdzvError::Unavailable(format!("store call ended without an answer: {e}")))
    }

    fn run<T: Send + 'static>(&self, key: &str, fut: impl Future<Output = Result<T, RdzvError>> + Send + 'static) -> Result<T, RdzvError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let Some(rt) = &self.rt else {
            return Err(RdzvError::Unavailable("the store is shut down".into()));
        };
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().unwrap_or_else(|_| Err(RdzvError::Unavailable(format!("store call for {key:?} was dropped"))))
    }
}

fn to_comm(key: &str, timeout: Option<Duration>, e: RdzvError) -> CommError {
    match (e, timeout) {
        (RdzvError::Timeout(_), Some(t)) => CommError::StoreTimeout { key: key.into(), timeout_ms: t.as_millis() as u64 },
        (e, _) => CommError::Store { key: key.into(), reason: e.to_string() },
    }
}

impl Store for EngineStore {
    fn set(&self, key: &str, value: &[u8]) -> rsrun_training_engine::comm::Result<()> {
        let (s, k, v) = (self.store.clone(), key.to_string(), value.to_vec());
        self.run(key, async move { s.set(&k, &v).await }).map_err(|e| to_comm(key, None, e))
    }

    fn get(&self, key: &str, timeout: Duration) -> rsrun_training_engine::comm::Result<Vec<u8>> {
        let (s, k) = (self.store.clone(), key.to_string());
        // A zero timeout still waits a moment: the engine uses it for "now or never" reads only.
        let wait = timeout.max(Duration::from_millis(1));
        self.run(key, async move { s.get(&k, wait).await }).map_err(|e| to_comm(key, Some(timeout), e))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use rsrun_training_engine::comm::{BackendKind, CommOptions, ProcessGroup, ReduceOp};

    use super::*;

    /// Two ranks bootstrap a TCP process group through a real rendezvous service and all-reduce.
    #[test]
    fn process_group_bootstraps_through_the_rendezvous_store() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (srv, store) = rt.block_on(async {
            let (srv, client, round) = crate::test_round("job", "n0", 2).await;
            (srv, client.store("job", round).round_scoped())
        });
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = EngineStore::from_client(store.clone()).unwrap();
                std::thread::spawn(move || {
                    let opts = CommOptions { backend: BackendKind::Tcp, ..CommOptions::default() };
                    let pg = ProcessGroup::new(rank, 2, Arc::new(store), "pg", opts).unwrap();
                    let mut v = vec![rank as f32 + 1.0; 1000];
                    pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                    v
                })
            })
            .collect();
        for h in handles {
            assert!(h.join().unwrap().iter().all(|x| *x == 3.0));
        }
        drop(srv);
    }
}
