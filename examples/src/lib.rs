//! Shared pieces of the example programs: the `train` job's data pipeline, memory check and
//! loss plot, and what the benchmarks measure about the machine.

pub mod data;
pub mod machine;
pub mod memory;
pub mod plot;

/// The median of `v` (the upper of the two middle values for an even count), which must not be
/// empty: what the benchmarks report of repeated measurements.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}
