//! Shared pieces of the example programs: the `train` job's data pipeline, memory check and
//! loss plot, and what the benchmarks measure about the machine.

pub mod data;
pub mod machine;
pub mod memory;
pub mod plot;
