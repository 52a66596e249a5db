//! Shared pieces of the example programs: the `train` job's data pipeline and loss plot, and
//! what the benchmarks measure about the machine.

pub mod data;
pub mod machine;
pub mod plot;
