//! Shared pieces of the example programs: the `train` job's data pipeline and loss plot.

pub mod data;
pub mod plot;
