//! The engine's error type (training, layout, optimizer, checkpoint and offload errors).
//!
//! Collective failures keep their own [`CommError`](crate::comm::CommError) and are wrapped
//! here by [`EngineError::Comm`].

use crate::comm::CommError;

/// Every error the training engine (outside `comm`) reports.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    // === Configuration ===
    /// A configuration value is invalid.
    #[error("invalid config: {0}")]
    Config(String),
    /// An unknown strategy name.
    #[error("unknown strategy {0:?} (ddp|zero1|zero2|zero3|fsdp|fsdp-shard-grad-op|fsdp-no-shard|hybrid)")]
    UnknownStrategy(String),

    // === Layout and shapes ===
    /// Two layouts or a layout and a buffer disagree.
    #[error("layout mismatch: {0}")]
    Layout(String),
    /// A buffer has the wrong number of elements.
    #[error("{what}: has {actual} elements, expected {expected}")]
    Length {
        what: String,
        expected: usize,
        actual: usize,
    },

    // === Numerics ===
    /// The loss or a gradient is not finite (and no loss scaler handles it).
    #[error("non-finite {what} at step {step}")]
    NonFinite { what: &'static str, step: u64 },

    // === Backends ===
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tensor operation (candle) failed.
    #[error("tensor op failed: {0}")]
    Tensor(String),
    /// An operating-system call failed (checkpoint or offload IO).
    #[error("{context}: {message}")]
    Io { context: String, message: String },
    /// A checkpoint is malformed or does not fit this engine.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// The offload store failed.
    #[error("offload: {0}")]
    Offload(String),
    /// An earlier call failed part-way and left this engine's state undefined (some units
    /// updated, buffers handed to collectives): it trains, saves and loads no more.
    #[error("the engine is unusable since {0}: build a new engine and load a checkpoint")]
    Unusable(String),
}

impl EngineError {
    /// An [`EngineError::Io`] from an IO error with context (e.g. the path).
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        EngineError::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }
}

/// Result alias for the engine.
pub type EngineResult<T, E = EngineError> = std::result::Result<T, E>;
