//! Training engine (see ARCHITECTURE.md).
//!
//! - [`comm`]: collectives (process groups over shared memory, TCP, hierarchical; NCCL with
//!   the `nccl` feature).
//! - [`layout`]: flat-parameter units, padding and sharding; [`layout::Strategy`]; the
//!   optimizer/offload hook ([`layout::TileOptimizer`], [`layout::OptimStateStore`]) and the
//!   checkpoint view ([`layout::ShardState`]).
//! - [`model`]: [`model::UnitModel`] and the reference GPT; [`kernels`]: fused CPU ops on
//!   candle; [`native`]: the hand-written fp32 forward/backward the engine uses when a model
//!   offers it, with SIMD kernels dispatched at run time ([`native::isa`]).
//! - [`engine`]: [`engine::Engine`] (DDP, ZeRO-1/2/3, FSDP, hybrid); [`optim`]: AdamW, SGD,
//!   schedule, clipping.
//! - [`offload`]: optimizer state in a host tier or an NVMe swap file (io_uring O_DIRECT,
//!   pread/pwrite fallback), both [`layout::OptimStateStore`]s; [`checkpoint`]: sharded,
//!   crash-safe, resharding checkpoints and safetensors export.
//! - [`hugepage`]: [`hugepage::HugePageAlloc`], a global allocator for trainer binaries that
//!   backs large buffers with transparent huge pages.
//! - [`error`]: the crate's error type, [`EngineError`].

pub mod checkpoint;
pub mod comm;
pub mod engine;
pub mod error;
pub mod hugepage;
pub mod kernels;
pub mod layout;
pub mod model;
pub mod native;
pub mod optim;
pub mod offload;

pub use error::{EngineError, EngineResult};
