//! The crate's error type.

/// Every error the training engine reports.
///
/// Errors are `Clone` so that a process group which failed once can report the same cause
/// (naming the same peer rank) for every later operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    // === Store and bootstrap ===
    /// A store key did not appear in time.
    #[error("store key {key:?} did not appear within {timeout_ms} ms")]
    StoreTimeout { key: String, timeout_ms: u64 },
    /// The store failed (IO error, bad value).
    #[error("store operation on key {key:?} failed: {reason}")]
    Store { key: String, reason: String },
    /// Bootstrapping the process group failed.
    #[error("bootstrap of group {prefix:?} failed: {reason}")]
    Bootstrap { prefix: String, reason: String },

    // === Peers ===
    /// A peer process died or closed its connection.
    #[error("peer rank {peer} failed during {op}: {detail}")]
    PeerFailed {
        peer: usize,
        op: String,
        detail: String,
    },
    /// A peer did not take part in an operation before the deadline.
    #[error("timed out after {waited_ms} ms waiting for rank {peer} in {op}")]
    Timeout {
        peer: usize,
        op: String,
        waited_ms: u64,
    },
    /// Ranks issued different collectives (op, size, dtype, root or reduce op differ).
    #[error("collective mismatch: rank {rank} called {ours} but rank {peer} called {theirs}")]
    Mismatch {
        rank: usize,
        peer: usize,
        ours: String,
        theirs: String,
    },
    /// Another rank aborted the group; `origin` is the rank it blamed.
    #[error("group aborted by rank {by}: rank {origin} failed: {detail}")]
    Aborted {
        by: usize,
        origin: usize,
        detail: String,
    },

    // === Arguments ===
    /// A buffer has the wrong number of elements.
    #[error("{op}: {what} has {actual} elements, expected {expected}")]
    Length {
        op: &'static str,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A rank argument is out of range.
    #[error("{what} rank {rank} is out of range for world size {world}")]
    InvalidRank {
        what: &'static str,
        rank: usize,
        world: usize,
    },
    /// Any other invalid argument or option.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The requested backend cannot serve this group.
    #[error("backend {backend} unsupported here: {reason}")]
    Unsupported {
        backend: &'static str,
        reason: String,
    },

    // === System ===
    /// An operating-system call failed.
    #[error("{context}: {message}")]
    Io { context: String, message: String },
    /// CUDA or NCCL libraries are not available (feature `nccl`).
    #[error("cuda unavailable: {0}")]
    CudaUnavailable(String),
    /// An NCCL call failed (feature `nccl`).
    #[error("nccl error in {op}: {detail}")]
    Nccl { op: &'static str, detail: String },
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    /// The rank this error blames, if any (the dead, slow or mismatched peer).
    pub fn peer(&self) -> Option<usize> {
        match self {
            CommError::PeerFailed { peer, .. }
            | CommError::Timeout { peer, .. }
            | CommError::Mismatch { peer, .. } => Some(*peer),
            CommError::Aborted { origin, .. } => Some(*origin),
            _ => None,
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
