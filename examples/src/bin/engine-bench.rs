//! Training-engine benchmark on the reference workload of `shared/bench/README.md`:
//! byte-level GPT D=256 L=4 H=4 T=128, B=8 per rank, AdamW lr 3e-4, fp32, one compute thread
//! per rank, random tokens.
//!
//! ```text
//! engine-bench --strategy ddp                                   # single process (baseline)
//! rsrun --standalone --nproc-per-node 2 target/release/engine-bench --strategy zero3
//! ```
//!
//! The single-process run records its tokens/s in `$TMPDIR/engine-bench-single.tok_per_s`;
//! distributed runs read it for `speedup_vs_single`. Ends with one line:
//! `summary: strategy=<s> world=<n> step_ms_median=... tok_per_s_total=... speedup_vs_single=...
//! model_state_mib_per_rank=... peak_rss_mib=...`.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rsrun_training_engine::comm::{CommOptions, FileStore, LocalStore, ProcessGroup, Store};
use rsrun_training_engine::engine::{Engine, EngineConfig};
use rsrun_training_engine::layout::Strategy;
use rsrun_training_engine::model::{Batch, Gpt, GptConfig, global_batch, rank_rows};
use rsrun_training_engine::optim::{AdamW, OptimizerConfig};

#[derive(Parser, Debug)]
#[command(about = "rsrun training-engine benchmark (reference GPT workload)")]
struct Args {
    /// ddp | zero1 | zero2 | zero3 | fsdp | fsdp-shard-grad-op | fsdp-no-shard | hybrid
    #[arg(long, default_value = "ddp")]
    strategy: String,
    /// Optimizer-state offload: only `none` is wired into this benchmark so far.
    #[arg(long, default_value = "none")]
    offload: String,
    /// Optimizer steps (the first 3 are warm-up and excluded from the median).
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Per-rank batch size.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Deterministic (rank-order) reductions.
    #[arg(long)]
    deterministic: bool,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn env_usize(k: &str) -> Option<usize> {
    std::env::var(k).ok().and_then(|v| v.parse().ok())
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()))
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: set before any other thread exists (candle's rayon pool reads it lazily).
    unsafe { std::env::set_var("RAYON_NUM_THREADS", args.threads.to_string()) };
    if args.offload != "none" {
        bail!("--offload {} is not wired into engine-bench yet (only `none`)", args.offload);
    }
    let strategy: Strategy = args.strategy.parse()?;
    let rank = env_usize("RANK").unwrap_or(0);
    let world = env_usize("WORLD_SIZE").unwrap_or(1);
    let store: Arc<dyn Store> = if world == 1 {
        Arc::new(LocalStore::new())
    } else if std::env::var_os("RSRUN_RDZV_ENDPOINT").is_some() {
        let ctx = rsrun_worker_runtime::WorkerContext::from_env()?;
        Arc::new(rsrun_worker_runtime::engine_store::EngineStore::new(&ctx)?)
    } else {
        let run = std::env::var("TORCHELASTIC_RUN_ID").unwrap_or_else(|_| "none".into());
        let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "0".into());
        Arc::new(FileStore::new(
            std::env::temp_dir().join(format!("engine-bench-{run}-{port}")),
        )?)
    };
    let opts = CommOptions {
        deterministic: args.deterministic,
        timeout: Duration::from_secs(300),
        ..CommOptions::default()
    };
    let pg = ProcessGroup::new(rank, world, store, "engine-bench", opts).context("process group")?;
    let model_cfg = GptConfig::reference();
    let mut cfg = EngineConfig::new(
        strategy,
        OptimizerConfig::AdamW(AdamW {
            lr: 3e-4,
            ..AdamW::default()
        }),
    );
    cfg.seed = 0;
    let mut engine = Engine::new(Gpt::new(model_cfg), cfg, pg)?;
    engine.reset_traffic();
    let mut times = Vec::new();
    let mut loss = 0f32;
    for step in 0..args.steps {
        let rows = global_batch(1234, step, args.batch * world, model_cfg.seq, model_cfg.vocab);
        let batch = Batch::from_rows(&rank_rows(&rows, rank, world))?;
        let t0 = Instant::now();
        loss = engine.train_step(std::slice::from_ref(&batch))?.loss;
        times.push(t0.elapsed().as_secs_f64());
    }
    let mut tail: Vec<f64> = times.iter().skip(3.min(times.len().saturating_sub(1))).copied().collect();
    tail.sort_by(f64::total_cmp);
    let med = tail[tail.len() / 2];
    let tok_total = (args.batch * model_cfg.seq * world) as f64 / med;
    let baseline = std::env::temp_dir().join("engine-bench-single.tok_per_s");
    let speedup = if world == 1 {
        std::fs::write(&baseline, format!("{tok_total}"))?;
        "1.00".to_string()
    } else {
        std::fs::read_to_string(&baseline)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .map_or_else(|| "na".into(), |b| format!("{:.2}", tok_total / b))
    };
    let mem = engine.memory();
    let sent_mib = engine.bytes_sent() as f64 / args.steps as f64 / (1 << 20) as f64;
    if rank == 0 {
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "params={} loss={loss:.4} comm_mib_sent_per_step={sent_mib:.2} gathered_peak_mib={:.2} comm_peak_mib={:.2}",
            engine.layout().total_numel(),
            mem.gathered_peak as f64 / (1 << 20) as f64,
            mem.comm_peak as f64 / (1 << 20) as f64,
        )?;
        writeln!(
            out,
            "summary: strategy={strategy} world={world} step_ms_median={:.1} tok_per_s_total={tok_total:.0} speedup_vs_single={speedup} model_state_mib_per_rank={:.2} peak_rss_mib={:.0}",
            med * 1e3,
            mem.model_state() as f64 / (1 << 20) as f64,
            peak_rss_mib(),
        )?;
    }
    Ok(())
}
