//! `train`: the main job. A byte-level GPT (the reference workload by default) trained with any of the
//! engine's strategies, on a learnable synthetic corpus or any file.
//!
//! ```text
//! rsrun --standalone --nproc-per-node 2 target/release/train --steps 200
//! rsrun --standalone --nproc-per-node 2 target/release/train --strategy zero3 --deterministic
//! target/release/train --grad-accum 2          # one process, same samples as two ranks
//! ```
//!
//! Rank 0 shows progress (a bar on a terminal, periodic lines otherwise), writes `metrics.jsonl` and a
//! loss-curve SVG into the run directory, and ends with a `summary:` line whose `params_sha256` is the
//! hash of the consolidated fp32 parameters.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use rsrun_examples::data::{Corpus, DataSpec, Sampler};
use rsrun_examples::plot;
use rsrun_training_engine::comm::{BackendKind, CommOptions, LocalStore, ProcessGroup, Store};
use rsrun_training_engine::engine::{Engine, EngineConfig};
use rsrun_training_engine::layout::Strategy;
use rsrun_training_engine::model::{Batch, Gpt, GptConfig};
use rsrun_training_engine::optim::{AdamW, OptimizerConfig, Schedule};
use sha2::{Digest, Sha256};

#[derive(Parser, Debug)]
#[command(name = "train", about = "Train a byte-level GPT with rsrun's engine (DDP, ZeRO-1/2/3, FSDP)")]
struct Args {
    /// Model width.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=8192))]
    d_model: u32,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    layers: u32,
    /// Attention heads (must divide --d-model).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    heads: u32,
    /// Context length in bytes.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=65536))]
    seq_len: u32,
    /// Sequences per rank per micro-step.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch: u32,
    /// Vocabulary size (bytes need 256).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(256..=1_000_000))]
    vocab: u32,
    /// Data-parallel strategy: ddp, zero1, zero2, zero3, fsdp, hybrid.
    #[arg(long, default_value = "ddp")]
    strategy: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    steps: u64,
    /// Micro-steps accumulated per optimizer step (no communication in between).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    grad_accum: u32,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Linear warmup steps before the cosine decay.
    #[arg(long, default_value_t = 10)]
    warmup: u64,
    /// Learning-rate schedule.
    #[arg(long, value_enum, default_value_t = LrSchedule::Cosine)]
    schedule: LrSchedule,
    /// Clip gradients to this global norm (0 disables).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Seed of the initialisation and the data order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Fixed reduction order: results are bitwise identical across strategies and world sizes.
    #[arg(long)]
    deterministic: bool,
    /// `synthetic` or a file read as bytes.
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// Where metrics.jsonl and the loss curve go (default: .rsrun/runs/<job or time>).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Progress output: a bar (text) or JSON lines.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LrSchedule {
    Cosine,
    Constant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Where this process sits in the job.
struct Place {
    rank: usize,
    world: usize,
    job: String,
    store: Arc<dyn Store>,
}

fn place() -> anyhow::Result<Place> {
    if std::env::var_os("RANK").is_none() {
        return Ok(Place { rank: 0, world: 1, job: "local".into(), store: Arc::new(LocalStore::new()) });
    }
    let ctx = rsrun_worker_runtime::WorkerContext::from_env().context("reading the rank environment")?;
    let store: Arc<dyn Store> = if std::env::var_os("RSRUN_RDZV_ENDPOINT").is_some() {
        Arc::new(rsrun_worker_runtime::engine_store::EngineStore::new(&ctx).context("connecting to the rendezvous store")?)
    } else {
        bail!("train needs rsrun's rendezvous store to bootstrap its collectives: start it with rsrun (not torchrun or the static backend)");
    };
    Ok(Place { rank: ctx.rank as usize, world: ctx.world_size as usize, job: ctx.job_id.clone(), store })
}

fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map(|kib| kib / 1024.0)
            .unwrap_or(0.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 { format!("{}h{:02}m", s / 3600, (s % 3600) / 60) } else if s >= 60 { format!("{}m{:02}s", s / 60, s % 60) } else { format!("{s}s") }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train: error: {e:#}");
            // Bad flags and inputs exit 2, like the launcher; failures while training exit 1.
            let bad_input = e.chain().any(|c| c.downcast_ref::<BadInput>().is_some());
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// An error in the user's flags or inputs.
#[derive(Debug)]
struct BadInput(String);

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BadInput {}

fn run() -> anyhow::Result<()> {
    let args = Args::try_parse().map_err(|e| {
        let _ = e.print();
        if e.use_stderr() { anyhow::Error::new(BadInput("invalid arguments".into())) } else { std::process::exit(0) }
    })?;
    let strategy: Strategy = args
        .strategy
        .parse()
        .map_err(|_| BadInput(format!("unknown --strategy {:?}; expected ddp, zero1, zero2, zero3, fsdp or hybrid", args.strategy)))?;
    if args.d_model % args.heads != 0 {
        return Err(BadInput(format!("--heads {} does not divide --d-model {}", args.heads, args.d_model)).into());
    }
    let data: DataSpec = args.data.parse().map_err(BadInput)?;
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(BadInput(format!("--lr {} must be a positive number", args.lr)).into());
    }
    let place = place()?;
    let (rank, world) = (place.rank, place.world);
    // One compute thread per rank: ranks share the machine's cores.
    let seq = args.seq_len as usize;
    let corpus = Corpus::load(&data, args.seed, 4 << 20, seq).map_err(|e| BadInput(format!("{e:#}")))?;
    let mut sampler = Sampler::new(corpus.bytes().len(), seq, args.seed, args.batch as usize, args.grad_accum as usize, world);

    let opts = CommOptions {
        backend: BackendKind::Auto,
        deterministic: args.deterministic,
        timeout: Duration::from_secs(300),
        ..CommOptions::default()
    };
    let pg = ProcessGroup::new(rank, world, place.store.clone(), &format!("train/{}", place.job), opts.clone()).context("creating the process group")?;
    // A second, tiny group for the loop's own bookkeeping (mean loss, memory per rank), so it never
    // interleaves with the engine's collectives.
    let stats_pg = ProcessGroup::new(rank, world, place.store.clone(), &format!("train/{}/stats", place.job), opts).context("creating the stats group")?;
    let gpt = GptConfig {
        vocab: args.vocab as usize,
        d_model: args.d_model as usize,
        layers: args.layers as usize,
        heads: args.heads as usize,
        seq,
    };
    let mut cfg = EngineConfig::new(strategy, OptimizerConfig::AdamW(AdamW { lr: args.lr, ..AdamW::default() }));
    cfg.seed = args.seed;
    cfg.clip_grad_norm = (args.clip > 0.0).then_some(args.clip);
    cfg.schedule = match args.schedule {
        LrSchedule::Cosine => Some(Schedule { warmup_steps: args.warmup, total_steps: args.steps, min_lr_ratio: 0.1 }),
        LrSchedule::Constant => None,
    };
    let mut engine = Engine::new(Gpt::new(gpt), cfg, pg).context("building the engine")?;
    let n_params: usize = engine.layout().units.iter().map(|u| u.numel).sum();

    let run_dir = args.run_dir.clone().unwrap_or_else(|| PathBuf::from(".rsrun/runs").join(&place.job));
    let mut metrics = None;
    if rank == 0 {
        std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
        let path = run_dir.join("metrics.jsonl");
        metrics = Some(std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?));
    }
    let json = args.log_format == LogFormat::Json;
    let tokens_per_step = (args.batch * args.seq_len * args.grad_accum) as f64 * world as f64;
    let bar = (rank == 0 && !json && std::io::stderr().is_terminal()).then(|| {
        let pb = indicatif::ProgressBar::new(args.steps);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} {msg} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    });
    if rank == 0 && !json {
        println!(
            "training {} parameters ({} units), strategy {}, world {world}, global batch {} x {} bytes{}",
            n_params,
            engine.layout().units.len(),
            strategy.name(),
            sampler.global_batch(),
            seq,
            if args.deterministic { ", deterministic reductions" } else { "" }
        );
    }
    let mut losses = Vec::with_capacity(args.steps as usize);
    let mut step_ms = Vec::with_capacity(args.steps as usize);
    let started = Instant::now();
    let line_every = (args.steps / 20).max(1);
    for step in 0..args.steps {
        let micro: Vec<Batch> = (0..args.grad_accum as usize)
            .map(|m| {
                let (x, y) = sampler.batch(corpus.bytes(), step, rank, m);
                let (b, t) = (args.batch as usize, seq);
                Ok(Batch {
                    inputs: candle_core::Tensor::from_vec(x, (b, t), &candle_core::Device::Cpu)?,
                    targets: candle_core::Tensor::from_vec(y, b * t, &candle_core::Device::Cpu)?,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        let t0 = Instant::now();
        let out = engine.train_step(&micro).with_context(|| format!("step {}", step + 1))?;
        let dt = t0.elapsed();
        step_ms.push(dt.as_secs_f64() * 1e3);
        // The loss shown is the mean over ranks (a tiny all-reduce of one number).
        let mut loss = [out.loss];
        stats_pg.all_reduce(&mut loss, rsrun_training_engine::comm::ReduceOp::Avg)?;
        let loss = loss[0];
        losses.push((step + 1, f64::from(loss)));
        let (rss, _) = rss_mib();
        let mut rss_all = vec![rss as f32; 1];
        let mut gathered = vec![0f32; world];
        stats_pg.all_gather(&rss_all[..], &mut gathered)?;
        rss_all = gathered;
        if rank == 0 {
            let tok_s = tokens_per_step / dt.as_secs_f64();
            let elapsed = started.elapsed();
            let eta = elapsed.mul_f64((args.steps - step - 1) as f64 / (step + 1) as f64);
            let mem = rss_all.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join("/");
            if let Some(m) = metrics.as_mut() {
                writeln!(
                    m,
                    "{{\"step\":{},\"loss\":{loss},\"lr\":{},\"step_ms\":{:.3},\"tok_per_s\":{tok_s:.1},\"grad_norm\":{},\"rss_mib\":[{mem_json}]}}",
                    step + 1,
                    out.lr,
                    dt.as_secs_f64() * 1e3,
                    out.grad_norm.map_or("null".to_string(), |g| format!("{g}")),
                    mem_json = rss_all.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>().join(",")
                )?;
            }
            if json {
                println!(
                    "{{\"event\":\"step\",\"step\":{},\"steps\":{},\"loss\":{loss},\"tok_per_s\":{tok_s:.1},\"eta_s\":{:.1}}}",
                    step + 1,
                    args.steps,
                    eta.as_secs_f64()
                );
            } else if let Some(pb) = &bar {
                pb.set_message(format!("loss {loss:.4} | {tok_s:.0} tok/s | mem {mem} MiB"));
                pb.inc(1);
            } else if (step + 1) % line_every == 0 || step + 1 == args.steps {
                let filled = ((step + 1) * 20 / args.steps) as usize;
                println!(
                    "[{}{}] step {}/{} loss {loss:.4} {tok_s:.0} tok/s ETA {} mem {mem} MiB",
                    "#".repeat(filled),
                    "-".repeat(20 - filled),
                    step + 1,
                    args.steps,
                    fmt_duration(eta)
                );
            }
        }
    }
    if let Some(pb) = bar {
        pb.finish_and_clear();
    }
    // Consolidated parameters (every rank takes part in the gather), hashed as little-endian f32.
    let params = engine.full_params()?;
    let mut hasher = Sha256::new();
    for unit in &params {
        for v in unit {
            hasher.update(v.to_le_bytes());
        }
    }
    let hash = format!("{:x}", hasher.finalize());
    let (_, peak) = rss_mib();
    let mut peak_all = vec![0f32; world];
    stats_pg.all_gather(&[peak as f32], &mut peak_all)?;
    if rank == 0 {
        if let Some(mut m) = metrics.take() {
            m.flush()?;
        }
        let svg = plot::loss_svg(&format!("train: {} world {world}, {} steps", strategy.name(), args.steps), &losses);
        let svg_path = run_dir.join("loss.svg");
        std::fs::write(&svg_path, svg).with_context(|| format!("cannot write {}", svg_path.display()))?;
        let mut sorted = step_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let total_time = step_ms.iter().sum::<f64>() / 1e3;
        let tok_per_s = tokens_per_step * args.steps as f64 / total_time;
        let peak_max = peak_all.iter().cloned().fold(0f32, f32::max);
        if json {
            println!("{{\"event\":\"done\",\"metrics\":\"{}\",\"plot\":\"{}\"}}", run_dir.join("metrics.jsonl").display(), svg_path.display());
        } else {
            println!("metrics: {}", run_dir.join("metrics.jsonl").display());
            println!("loss curve: {}", svg_path.display());
        }
        println!(
            "summary: strategy={} world={world} steps={} final_loss={:.4} tok_per_s_total={tok_per_s:.0} step_ms_median={median:.1} peak_rss_mib={peak_max:.0} params_sha256={hash}",
            strategy.name(),
            args.steps,
            losses.last().map_or(f64::NAN, |l| l.1),
        );
    }
    Ok(())
}
