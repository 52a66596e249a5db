//! Training engine (see ARCHITECTURE.md).
//!
//! - [`comm`]: collectives (process groups over shared memory, TCP, hierarchical; NCCL with
//!   the `nccl` feature).

pub mod comm;
