//! Shared pieces of the example programs: the `train` job's data pipeline, memory check and
//! loss plot, and what the benchmarks measure about the machine.

pub mod data;
pub mod machine;
pub mod memory;
pub mod plot;

/// Installs a log subscriber writing to stderr, so that the libraries' warnings (a checkpoint
/// taken in place of the one `latest` names, a collective's slow peer) reach the worker's log:
/// `RSRUN_LOG`, else `RUST_LOG`, else `warn`.
///
/// # Errors
/// `RSRUN_LOG` is set but is no log filter (the message names it).
pub fn init_tracing(program: &str) -> Result<(), String> {
    let log = rsrun_rendezvous::logging::from_env("warn")?;
    // Another subscriber already installed (a test harness) keeps its place.
    let _ = tracing_subscriber::fmt().with_env_filter(log.filter).with_writer(std::io::stderr).with_ansi(false).try_init();
    if let Some(note) = log.note {
        tracing::warn!("{program}: {note}");
    }
    Ok(())
}

/// The median of `v` (the upper of the two middle values for an even count), which must not be
/// empty: what the benchmarks report of repeated measurements.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}
