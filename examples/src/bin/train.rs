//! `train`: the main job. A byte-level GPT (the reference workload by default) trained with any of the
//! engine's strategies, on a learnable synthetic corpus or any file.
//!
//! ```text
//! rsrun --standalone --nproc-per-node 2 target/release/train --steps 200
//! rsrun --standalone --nproc-per-node 2 target/release/train --strategy zero3 --deterministic
//! target/release/train --grad-accum 2          # one process, same samples as two ranks
//! ```
//!
//! Checkpoints and restarts: with `--checkpoint-dir D --checkpoint-every N` every rank takes part in
//! a sharded checkpoint every N steps (and after the last step); `--resume auto` (the default) loads
//! the latest committed checkpoint under D if there is one, restores the data position (the global
//! step), so the sample stream continues exactly, and appends to `metrics.jsonl`. Under
//! `rsrun --max-restarts K` a failed worker group restarts and resumes from the last checkpoint; in
//! deterministic mode the final `params_sha256` equals an uninterrupted run's.
//!
//! Rank 0 shows progress (see [`ProgressView`]: a bar on a terminal; under rsrun, carriage-return
//! updates that rsrun draws in place; alone on a pipe, a line every 5 %), writes `metrics.jsonl` and a
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
use rsrun_training_engine::checkpoint::Progress;
use rsrun_training_engine::engine::{Engine, EngineConfig, Offload, Precision, ReduceDtype};
use rsrun_training_engine::offload::{DEFAULT_IO_TIMEOUT, NvmeConfig, check_io_timeout};
use rsrun_training_engine::layout::Strategy;
use rsrun_training_engine::model::{Batch, Gpt, GptConfig};
use rsrun_training_engine::optim::{AdamW, OptimizerConfig, Schedule};
use sha2::{Digest, Sha256};

/// Large buffers (activations, gradients, optimizer state) on transparent huge pages
/// (`RSRUN_HUGE_PAGES=0` turns it off).
#[global_allocator]
static ALLOC: rsrun_training_engine::hugepage::HugePageAlloc = rsrun_training_engine::hugepage::HugePageAlloc;

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
    #[arg(long, default_value_t = 1.0, value_parser = norm_bound)]
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
    /// Compute precision of the parameters (fp32 master weights either way): fp32, bf16 or f16
    /// (f16 with dynamic loss scaling).
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// Dtype of the gradient buffers and their reduction in bf16/f16 (FSDP reduce_dtype):
    /// compute (16-bit gradients, upcast at the optimizer step) or fp32. Ignored in fp32.
    #[arg(long, default_value = "compute")]
    reduce_dtype: String,
    /// Where the fp32 master weights and the optimizer state live: none (memory), cpu, nvme.
    #[arg(long, default_value = "none")]
    offload: String,
    /// Directory of the NVMe swap files (required by --offload nvme).
    #[arg(long)]
    nvme_path: Option<PathBuf>,
    /// Deadline in seconds of every wait for the NVMe tier's I/O (--offload nvme; default 300,
    /// at most 86400): a device that does not answer in time fails the step instead of hanging it.
    #[arg(long)]
    nvme_io_timeout: Option<u64>,
    /// Root directory of sharded checkpoints.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every N steps (needs --checkpoint-dir; 0 = only after the last step).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u64,
    /// Checkpoints kept (the newest; 0 keeps all).
    #[arg(long, default_value_t = 2)]
    keep_checkpoints: usize,
    /// auto (the latest checkpoint under --checkpoint-dir, if any), none, or a checkpoint path.
    #[arg(long, default_value = "auto")]
    resume: String,
    /// Test hook for restart tests: rank 1 (rank 0 alone) aborts just before step N, but only in
    /// the first attempt (TORCHELASTIC_RESTART_COUNT unset or 0).
    #[arg(long, hide = true)]
    fail_at_step: Option<u64>,
    /// Test hook for hang detection: rank 1 (rank 0 alone) stops making progress just before
    /// step N (it sleeps), in every attempt.
    #[arg(long, hide = true)]
    hang_at_step: Option<u64>,
}

/// Where training starts.
enum Resume {
    None,
    Auto,
    Path(PathBuf),
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
    /// Ranks on this host (LOCAL_WORLD_SIZE).
    local_world: usize,
    job: String,
    store: Arc<dyn Store>,
    /// The launcher's context (None when run alone): the progress heartbeat and the error file.
    ctx: Option<rsrun_worker_runtime::WorkerContext>,
}

fn place() -> anyhow::Result<Place> {
    if std::env::var_os("RANK").is_none() {
        return Ok(Place { rank: 0, world: 1, local_world: 1, job: "local".into(), store: Arc::new(LocalStore::new()), ctx: None });
    }
    let ctx = rsrun_worker_runtime::WorkerContext::from_env().context("reading the rank environment")?;
    // A panic reaches rsrun's failure summary (TORCHELASTIC_ERROR_FILE) with its message.
    ctx.install_panic_hook();
    let store: Arc<dyn Store> = if std::env::var_os("RSRUN_RDZV_ENDPOINT").is_some() {
        Arc::new(rsrun_worker_runtime::engine_store::EngineStore::new(&ctx).context("connecting to the rendezvous store")?)
    } else {
        bail!("train needs rsrun's rendezvous store to bootstrap its collectives: start it with rsrun (not torchrun or the static backend)");
    };
    Ok(Place {
        rank: ctx.rank as usize,
        world: ctx.world_size as usize,
        local_world: ctx.local_world_size as usize,
        job: ctx.job_id.clone(),
        store,
        ctx: Some(ctx),
    })
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

/// How rank 0 shows its progress.
enum ProgressView {
    /// Its own stderr is a terminal: an indicatif bar, redrawn in place.
    Bar(indicatif::ProgressBar),
    /// Under rsrun (stderr is rsrun's pipe): the bar as carriage-return updates on stderr (`\r` and
    /// the whole line, `\n` after the last step), as tqdm does. rsrun's console draws them in
    /// place on a terminal, or prints one a second on a pipe, prefixed with the rank; the rank's
    /// log file keeps every update. At most one update per [`CR_EVERY`], plus the last.
    CarriageReturn {
        /// When the last update was written.
        last: Option<Instant>,
    },
    /// Alone on a pipe or a file: a plain line on stdout every 5 % of the steps.
    Lines,
}

/// The least time between two carriage-return updates.
const CR_EVERY: Duration = Duration::from_millis(100);

impl ProgressView {
    fn choose(steps: u64) -> ProgressView {
        if std::io::stderr().is_terminal() {
            let pb = indicatif::ProgressBar::new(steps);
            pb.set_style(
                indicatif::ProgressStyle::with_template("{bar:30.cyan/blue} {pos}/{len} {msg} ETA {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            ProgressView::Bar(pb)
        } else if std::env::var_os("RSRUN_JOB_ID").is_some() {
            ProgressView::CarriageReturn { last: None }
        } else {
            ProgressView::Lines
        }
    }

    /// Shows that `done` of `steps` steps are done.
    fn step(&mut self, done: u64, steps: u64, status: &str, eta: Duration) {
        let line = || {
            let filled = (done * 20 / steps) as usize;
            format!("[{}{}] step {done}/{steps} {status} ETA {}", "#".repeat(filled), "-".repeat(20 - filled), fmt_duration(eta))
        };
        match self {
            ProgressView::Bar(pb) => {
                pb.set_message(status.to_string());
                pb.inc(1);
            }
            ProgressView::CarriageReturn { last } => {
                if done == steps || last.is_none_or(|t| t.elapsed() >= CR_EVERY) {
                    *last = Some(Instant::now());
                    let mut err = std::io::stderr().lock();
                    // Progress is best effort: a closed stderr must not stop training.
                    let _ = write!(err, "\r{}", line()).and_then(|()| err.flush());
                }
            }
            ProgressView::Lines => {
                if done.is_multiple_of((steps / 20).max(1)) || done == steps {
                    println!("{}", line());
                }
            }
        }
    }

    /// Ends the display: clears the bar, or ends the carriage-return line.
    fn finish(self) {
        match self {
            ProgressView::Bar(pb) => pb.finish_and_clear(),
            ProgressView::CarriageReturn { last: Some(_) } => eprintln!(),
            ProgressView::CarriageReturn { last: None } | ProgressView::Lines => {}
        }
    }
}

fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 { format!("{}h{:02}m", s / 3600, (s % 3600) / 60) } else if s >= 60 { format!("{}m{:02}s", s / 60, s % 60) } else { format!("{s}s") }
}

/// A gradient-norm bound: a finite number ≥ 0 (0: no clipping).
fn norm_bound(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("expected a finite norm >= 0 (0 disables clipping), got {v:?}")),
    }
}

fn main() -> ExitCode {
    // First of all: a SIGUSR1/SIGUSR2 that rsrun passes on while this worker starts (Slurm's
    // warning right after a restart) asks for a checkpoint instead of killing it (the default).
    signals::install();
    // Each rank's share of the cores for candle's rayon pool (read lazily, at its first use):
    // rsrun's OMP_NUM_THREADS=1 does not reach it, and every rank of a node would otherwise run
    // a thread per core (8 ranks on 64 cores: 512 threads). RAYON_NUM_THREADS, when set, wins.
    // A rank bound to its own CPUs (--cpu-bind) has its share already.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        // SAFETY: sysconf reads a system value; it touches no memory of ours.
        let online = usize::try_from(unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).unwrap_or(cpus);
        let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).filter(|n| *n > 0).unwrap_or(1);
        let share = if cpus < online { cpus } else { (cpus / local).max(1) };
        // SAFETY: set before any other thread of this process exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", share.to_string()) };
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train: error: {e:#}");
            // The launcher's failure report shows the error file: an error, like a panic, goes
            // there (a collective's timeout names the rank that stopped).
            if let Ok(ctx) = rsrun_worker_runtime::WorkerContext::from_env() {
                let _ = ctx.report_error(&format!("{e:#}"), None);
            }
            // Bad flags and inputs exit 2, like the launcher; failures while training exit 1.
            let bad_input = e.chain().any(|c| c.downcast_ref::<BadInput>().is_some());
            ExitCode::from(if bad_input { 2 } else { 1 })
        }
    }
}

/// Clears the flag and wakes the thread when dropped.
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool, Option<std::thread::Thread>);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = &self.1 {
            t.unpark();
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
    rsrun_examples::init_tracing("train").map_err(BadInput)?;
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
    let precision: Precision = args
        .precision
        .parse()
        .map_err(|_| BadInput(format!("unknown --precision {:?}; expected fp32, bf16 or f16", args.precision)))?;
    let reduce_dtype: ReduceDtype = args
        .reduce_dtype
        .parse()
        .map_err(|_| BadInput(format!("unknown --reduce-dtype {:?}; expected fp32 or compute", args.reduce_dtype)))?;
    let nvme_io_timeout = match args.nvme_io_timeout {
        Some(_) if args.offload != "nvme" => {
            return Err(BadInput(format!("--nvme-io-timeout is only used with --offload nvme (got --offload {})", args.offload)).into());
        }
        Some(secs) => {
            let timeout = Duration::from_secs(secs);
            check_io_timeout(timeout).map_err(|e| BadInput(format!("--nvme-io-timeout {secs}: {e}")))?;
            timeout
        }
        None => DEFAULT_IO_TIMEOUT,
    };
    let offload = match (args.offload.as_str(), &args.nvme_path) {
        ("none", _) => Offload::None,
        ("cpu", _) => Offload::Cpu,
        ("nvme", Some(dir)) => {
            check_writable_dir(dir, "--nvme-path")?;
            let mut cfg = NvmeConfig::new(dir, "train");
            cfg.io_timeout = nvme_io_timeout;
            Offload::Nvme(cfg)
        }
        ("nvme", None) => return Err(BadInput("--offload nvme needs --nvme-path DIR".into()).into()),
        (o, _) => return Err(BadInput(format!("unknown --offload {o:?}; expected none, cpu or nvme")).into()),
    };
    if args.nvme_path.is_some() && !matches!(offload, Offload::Nvme(_)) {
        return Err(BadInput(format!("--nvme-path is only used with --offload nvme (got --offload {})", args.offload)).into());
    }
    if args.checkpoint_every > 0 && args.checkpoint_dir.is_none() {
        return Err(BadInput(format!("--checkpoint-every {} needs --checkpoint-dir DIR", args.checkpoint_every)).into());
    }
    if let Some(dir) = &args.checkpoint_dir {
        check_writable_dir(dir, "--checkpoint-dir")?;
    }
    let resume = match args.resume.as_str() {
        "none" => Resume::None,
        "auto" => Resume::Auto,
        p => {
            let path = PathBuf::from(p);
            if !path.exists() {
                return Err(BadInput(format!("--resume {p:?}: no such checkpoint (expected auto, none, or a checkpoint directory or root)")).into());
            }
            Resume::Path(path)
        }
    };
    let place = place()?;
    let (rank, world) = (place.rank, place.world);
    let run_dir = args.run_dir.clone().unwrap_or_else(|| PathBuf::from(".rsrun/runs").join(&place.job));
    if rank == 0 {
        // Before the engine is built: a bad --run-dir is a bad flag (exit 2), found at once.
        check_writable_dir(&run_dir, "--run-dir")?;
    }
    // One compute thread per rank: ranks share the machine's cores.
    let seq = args.seq_len as usize;
    let corpus = Corpus::load(&data, args.seed, 4 << 20, seq).map_err(|e| BadInput(format!("{e:#}")))?;
    let mut sampler = Sampler::new(corpus.bytes().len(), seq, args.seed, args.batch as usize, args.grad_accum as usize, world);
    // Saved with every checkpoint; a resume must match it for the data to go on where it stopped.
    let identity = rsrun_examples::data::DataIdentity {
        seed: args.seed,
        global_batch: sampler.global_batch(),
        data: rsrun_examples::data::fingerprint(corpus.bytes()),
    };

    let gpt = GptConfig {
        vocab: args.vocab as usize,
        d_model: args.d_model as usize,
        layers: args.layers as usize,
        heads: args.heads as usize,
        seq,
    };
    // Refuse a model this host cannot hold before allocating any of it (it would abort on a
    // failed allocation, or be killed by the kernel partway through a step). Before the process
    // groups: no rank of this host can get past their rendezvous and allocate while another one
    // still measures what is available (it would count that rank's memory twice).
    let plan = rsrun_examples::memory::Plan {
        gpt,
        strategy,
        shard_world: if strategy.is_hybrid() { place.local_world } else { world },
        precision,
        reduce_dtype,
        offload: offload.clone(),
        batch: args.batch as usize,
        windows: sampler.windows_per_epoch(),
    };
    let need = rsrun_examples::memory::need(&plan).map_err(|e| BadInput(format!("{e}")))?;
    if let Some(why) = rsrun_examples::memory::available().and_then(|a| rsrun_examples::memory::refusal(&need, place.local_world as u64, a)) {
        return Err(BadInput(why).into());
    }
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
    // Every rank must read the same data in the same order (each takes its own samples of every
    // global step): a node whose copy of --data differs, or a rank with another --seed or
    // --batch, would train on samples the others do not see, or on some twice, without an error.
    // The flags that decide which collectives each step runs go along: ranks with another
    // --steps or checkpoint schedule would enter a save while the others enter a step, and fail
    // with a mismatch or a timeout instead of naming the flag.
    let loop_shape: [(&str, u64); 4] = [
        ("--steps", args.steps),
        ("--checkpoint-every", args.checkpoint_every),
        ("--checkpoint-dir (1: given)", u64::from(args.checkpoint_dir.is_some())),
        ("--schedule (1: cosine)", u64::from(args.schedule == LrSchedule::Cosine)),
    ];
    let mut mine = identity.encode();
    let data_len = mine.len();
    for (_, v) in loop_shape {
        mine.extend_from_slice(&v.to_le_bytes());
    }
    let mut all = vec![0u8; mine.len() * world];
    stats_pg.all_gather(&mine[..], &mut all[..]).context("comparing the ranks' data")?;
    for (r, theirs) in all.chunks(mine.len()).enumerate() {
        if let Some(rsrun_examples::data::SavedIdentity::Full { identity: other, .. }) =
            rsrun_examples::data::DataIdentity::decode(&theirs[..data_len])
            && let Some(why) = identity.differences(&other, &format!("rank {r}'s"), "the ranks would take overlapping or missing samples")
        {
            return Err(BadInput(format!(
                "rank {rank} reads the data otherwise than rank {r}: it has {why}; every rank must pass the same --data (the same \
                 file on a shared file system, or identical copies), --seed, --batch and --grad-accum"
            ))
            .into());
        }
        let words = theirs[data_len..].chunks_exact(8).map(|w| u64::from_le_bytes(w.try_into().unwrap_or([0; 8])));
        let differ: Vec<String> = loop_shape
            .iter()
            .zip(words)
            .filter(|((_, v), w)| v != w)
            .map(|((name, v), w)| format!("{name} {v} (rank {r}'s is {w})"))
            .collect();
        if !differ.is_empty() {
            return Err(BadInput(format!(
                "rank {rank} runs another loop than rank {r}: it has {}; every rank must pass the same flags",
                differ.join(", ")
            ))
            .into());
        }
    }
    let mut cfg = EngineConfig::new(strategy, OptimizerConfig::AdamW(AdamW { lr: args.lr, ..AdamW::default() }));
    cfg.seed = args.seed;
    cfg.clip_grad_norm = (args.clip > 0.0).then_some(args.clip);
    cfg.schedule = match args.schedule {
        LrSchedule::Cosine => Some(Schedule { warmup_steps: args.warmup, total_steps: args.steps, min_lr_ratio: 0.1 }),
        LrSchedule::Constant => None,
    };
    if rank == 0 && args.schedule == LrSchedule::Cosine && args.warmup >= args.steps && args.steps > 0 {
        let reach = if args.warmup == args.steps { "reaches --lr only at the last step" } else { "never reaches --lr" };
        eprintln!(
            "train: note: --warmup {} is not below --steps {}: the learning rate stays in its linear warmup and {reach} {} (no cosine decay)",
            args.warmup, args.steps, args.lr
        );
    }
    cfg.precision = precision;
    cfg.reduce_dtype = reduce_dtype;
    cfg.offload = offload.clone();
    let mut engine = Engine::new(Gpt::new(gpt), cfg, pg).context("building the engine")?;
    // Resume: the latest checkpoint (auto) or the given one; the data position is the global step.
    let resume_from = match (&resume, &args.checkpoint_dir) {
        (Resume::Path(p), _) => Some(p.clone()),
        // No checkpoint yet: a fresh start. A damaged latest one is an error, not a fresh start.
        (Resume::Auto, Some(d)) => match rsrun_training_engine::checkpoint::latest(d) {
            Ok(_) => Some(d.clone()),
            Err(rsrun_training_engine::checkpoint::CheckpointError::NotFound(_)) => None,
            Err(e) => {
                // Said to the other ranks first (they would only see this rank go), then here.
                let mut failed = [0f32, 0.0, 1.0];
                let _ = stats_pg.all_reduce(&mut failed, rsrun_training_engine::comm::ReduceOp::Sum);
                return Err(e).with_context(|| format!("--resume auto in {}", d.display()));
            }
        },
        _ => None,
    };
    // Every rank must take the same decision: a checkpoint directory on node-local disks lets
    // rank 0 resume while the others start afresh, and their collectives no longer pair.
    let mut found = [f32::from(u8::from(resume_from.is_some())), f32::from(u8::from(resume_from.is_none())), 0.0];
    stats_pg.all_reduce(&mut found, rsrun_training_engine::comm::ReduceOp::Sum)?;
    if found[2] > 0.0 {
        let dir = args.checkpoint_dir.as_deref().map_or_else(|| args.resume.clone(), |d| d.display().to_string());
        return Err(BadInput(format!("{dir}: {} of {world} ranks cannot read its latest checkpoint (--resume auto): see their errors", found[2])).into());
    }
    if found[0] > 0.0 && found[1] > 0.0 {
        let dir = args.checkpoint_dir.as_deref().map_or_else(|| args.resume.clone(), |d| d.display().to_string());
        return Err(BadInput(format!(
            "{dir}: {} of {world} ranks find a checkpoint to resume from and {} do not; the checkpoint directory must be one that every rank shares",
            found[0], found[1]
        ))
        .into());
    }
    let mut start = 0u64;
    if let Some(from) = &resume_from {
        let (dir, progress) = engine.load_checkpoint(from).with_context(|| format!("resuming from {}", from.display()))?;
        // The data position (global loop step) is authoritative for the sampler; the engine's
        // step count can lag it when f16 loss scaling skipped steps.
        start = progress.data_position;
        let optimizer_step = engine.step_count();
        // Train saves the loop steps done as the data position, and the optimizer steps can only
        // lag them (a skipped f16 step): a position behind the step is damage, not a place to
        // resume from.
        if start < optimizer_step {
            return Err(BadInput(format!(
                "checkpoint {}: data_position {start} is behind its optimizer step {optimizer_step} (train saves data_position >= step); its metadata.json is damaged",
                dir.display()
            ))
            .into());
        }
        if start > args.steps {
            return Err(BadInput(format!(
                "checkpoint {} was saved after step {start} (its data_position; optimizer step {optimizer_step}), beyond --steps {}",
                dir.display(),
                args.steps
            ))
            .into());
        }
        // The samples the checkpoint's run consumed (over every global batch it ran at): this
        // run goes on from there, at its own global batch (another world size).
        let samples = match rsrun_examples::data::DataIdentity::decode(&progress.rng_state) {
            Some(saved) => {
                if let Some(why) = identity.mismatch(&saved) {
                    return Err(BadInput(format!("cannot resume from {}: this run has {why}", dir.display())).into());
                }
                if let Some(was) = saved.global_batch()
                    && was != sampler.global_batch()
                    && rank == 0
                {
                    eprintln!(
                        "train: note: a global batch of {} samples (the checkpoint's run had {was}): the data goes on from the samples it consumed",
                        sampler.global_batch()
                    );
                }
                saved.samples_at(start)
            }
            None => {
                if rank == 0 {
                    eprintln!("train: note: checkpoint {}: no data record of train's; the data order is not checked", dir.display());
                }
                None
            }
        };
        let samples = samples.unwrap_or_else(|| start.saturating_mul(sampler.global_batch()));
        sampler.resume_at(start, samples);
        if rank == 0 && args.log_format == LogFormat::Text {
            println!("resumed from {} at step {start} (restart {})", dir.display(), restart_count());
        }
    }
    let n_params: usize = engine.layout().units.iter().map(|u| u.numel).sum();

    let mut metrics = None;
    // Set once a write to metrics.jsonl failed (it is best effort from then on).
    let mut metrics_lost = false;
    let mut losses = Vec::with_capacity(args.steps as usize);
    if rank == 0 {
        std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run directory {}", run_dir.display()))?;
        let path = run_dir.join("metrics.jsonl");
        let file = if start > 0 {
            // Keep the lines up to the resumed step (later ones were lost with the failed attempt)
            // and append after them.
            let old = match std::fs::read_to_string(&path) {
                Ok(text) => text,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(e).with_context(|| format!("cannot read {} to keep its earlier steps", path.display())),
            };
            let kept: String = old
                .lines()
                .filter(|l| metric_step(l).is_some_and(|s| s <= start))
                .map(|l| format!("{l}\n"))
                .collect();
            // Replaced whole (a kill in the middle of a rewrite in place lost every earlier
            // attempt's lines).
            let tmp = run_dir.join(format!(".metrics.jsonl.{}", std::process::id()));
            std::fs::write(&tmp, &kept)
                .and_then(|()| std::fs::rename(&tmp, &path))
                .with_context(|| format!("cannot rewrite {}", path.display()))?;
            for l in kept.lines() {
                if let (Some(s), Some(loss)) = (metric_step(l), metric_loss(l)) {
                    losses.push((s, loss));
                }
            }
            std::fs::OpenOptions::new().append(true).open(&path)
        } else {
            std::fs::File::create(&path)
        };
        metrics = Some(std::io::BufWriter::new(file.with_context(|| format!("cannot open {}", path.display()))?));
    }
    let json = args.log_format == LogFormat::Json;
    let tokens_per_step = f64::from(args.batch) * f64::from(args.seq_len) * f64::from(args.grad_accum) * world as f64;
    let mut view = (rank == 0 && !json).then(|| ProgressView::choose(args.steps));
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
        if precision != Precision::Fp32 || offload != Offload::None {
            println!("precision {precision}, reduce dtype {reduce_dtype}, offload {}", offload.name());
        }
    }
    if let Some(ProgressView::Bar(pb)) = &view {
        pb.set_position(start);
    }
    let mut step_ms = Vec::with_capacity(args.steps as usize);
    let started = Instant::now();
    let fail_rank = if world > 1 { 1 } else { 0 };
    for step in start..args.steps {
        if args.fail_at_step == Some(step + 1) && rank == fail_rank && restart_count() == 0 {
            eprintln!("train: --fail-at-step {}: rank {rank} aborts (test hook)", step + 1);
            std::process::abort();
        }
        if args.hang_at_step == Some(step + 1) && rank == fail_rank {
            eprintln!("train: --hang-at-step {}: rank {rank} stops making progress (test hook)", step + 1);
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
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
        // The heartbeat of rsrun's --hang-timeout: a rank stuck in a step stops sending it.
        if let Some(ctx) = &place.ctx {
            ctx.progress(step + 1);
        }
        let dt = t0.elapsed();
        step_ms.push(dt.as_secs_f64() * 1e3);
        // The loss shown is the mean over ranks, in the same tiny all-reduce as whether any rank
        // got SIGUSR1/SIGUSR2 (Slurm's `--signal` warning, passed on by rsrun): every rank then
        // sees the request at the same step and checkpoints there together.
        let mut shared = [out.loss, if signals::take_save_request() { 1.0 } else { 0.0 }];
        stats_pg.all_reduce(&mut shared, rsrun_training_engine::comm::ReduceOp::Sum)?;
        let loss = shared[0] / world as f32;
        let save_requested = shared[1] > 0.0;
        // JSON has no NaN or infinity (a skipped f16 step's loss): null.
        let loss_json = if loss.is_finite() { loss.to_string() } else { "null".to_string() };
        losses.push((step + 1, f64::from(loss)));
        let (rss, _) = rss_mib();
        let mut rss_all = vec![rss as f32; 1];
        let mut gathered = vec![0f32; world];
        stats_pg.all_gather(&rss_all[..], &mut gathered)?;
        rss_all = gathered;
        if rank == 0 {
            let tok_s = tokens_per_step / dt.as_secs_f64();
            let elapsed = started.elapsed();
            let eta = elapsed.mul_f64((args.steps - step - 1) as f64 / (step + 1 - start) as f64);
            let mem = rss_all.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join("/");
            if let Some(m) = metrics.as_mut()
                && let Err(e) = writeln!(
                    m,
                    "{{\"step\":{},\"loss\":{loss_json},\"lr\":{},\"step_ms\":{:.3},\"tok_per_s\":{tok_s:.1},\"grad_norm\":{},\"rss_mib\":[{mem_json}]}}",
                    step + 1,
                    out.lr,
                    dt.as_secs_f64() * 1e3,
                    // JSON has no NaN or infinity: an overflowing norm is null.
                    out.grad_norm.filter(|g| g.is_finite()).map_or("null".to_string(), |g| format!("{g}")),
                    mem_json = rss_all.iter().map(|m| format!("{m:.1}")).collect::<Vec<_>>().join(",")
                )
            {
                // Metrics are a record, not the run: a full disk there must not stop training
                // (nor the checkpoint a preemption asked for).
                eprintln!("train: warning: metrics.jsonl is not written any more: {e}");
                metrics = None;
                metrics_lost = true;
            }
            if json {
                println!(
                    "{{\"event\":\"step\",\"step\":{},\"steps\":{},\"loss\":{loss_json},\"tok_per_s\":{tok_s:.1},\"eta_s\":{:.1}}}",
                    step + 1,
                    args.steps,
                    eta.as_secs_f64()
                );
            } else if let Some(v) = view.as_mut() {
                let status = format!("loss {loss:.4} | {tok_s:.0} tok/s | mem {mem} MiB");
                v.step(step + 1, args.steps, &status, eta);
            }
        }
        // After the metrics line of this step, so a resumed run's metrics.jsonl is complete.
        if save_requested && args.checkpoint_dir.is_none() && rank == 0 {
            // The signal no longer kills the process (it asks for a checkpoint): say it was seen.
            eprintln!("train: SIGUSR1/SIGUSR2 at step {}: no checkpoint is saved without --checkpoint-dir", step + 1);
        }
        if let Some(root) = &args.checkpoint_dir {
            let done = step + 1;
            let every = args.checkpoint_every > 0 && done % args.checkpoint_every == 0;
            if save_requested && rank == 0 {
                eprintln!("train: checkpoint of step {done} on SIGUSR1/SIGUSR2");
            }
            if every || done == args.steps || save_requested {
                if let Some(m) = metrics.as_mut()
                    && let Err(e) = m.flush()
                {
                    eprintln!("train: warning: metrics.jsonl is not written any more: {e}");
                    metrics = None;
                    metrics_lost = true;
                }
                let progress =
                    Progress { data_position: done, epoch: sampler.epoch_of(done), rng_state: identity.encode_at(sampler.samples_before(done)) };
                // A save of gigabytes (and the other ranks' wait for it) is no hang: the
                // heartbeat of --hang-timeout goes on meanwhile.
                // For as long as the other ranks wait for the save at most (an hour): a save
                // that never returns is still a hang.
                let saving = std::sync::atomic::AtomicBool::new(true);
                let saved = std::thread::scope(|s| {
                    let beat = place.ctx.as_ref().map(|ctx| {
                        s.spawn(|| {
                            let until = Instant::now() + Duration::from_secs(3600);
                            while saving.load(std::sync::atomic::Ordering::Relaxed) && Instant::now() < until {
                                ctx.progress(done);
                                std::thread::park_timeout(Duration::from_secs(1));
                            }
                        })
                    });
                    // Stops the heartbeat however the save ends (a panic too: the scope waits for
                    // the thread before the panic goes on).
                    let _stop = StopOnDrop(&saving, beat.as_ref().map(|b| b.thread().clone()));
                    engine.save_checkpoint(root, &progress, args.keep_checkpoints)
                });
                let dir = saved.with_context(|| format!("saving the checkpoint of step {done} under {}", root.display()))?;
                if view.as_ref().is_some_and(|v| !matches!(v, ProgressView::Bar(_))) {
                    println!("checkpoint: {}", dir.display());
                }
            }
        }
    }
    if let Some(v) = view {
        v.finish();
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
        // The record of a finished run: a failure to write it is said, and the run still ends well.
        if let Some(mut m) = metrics.take()
            && let Err(e) = m.flush()
        {
            eprintln!("train: warning: metrics.jsonl is not written any more: {e}");
            metrics_lost = true;
        }
        let svg = plot::loss_svg(&format!("train: {} world {world}, {} steps", strategy.name(), args.steps), &losses);
        let svg_path = run_dir.join("loss.svg");
        // Replaced whole: a kill while it is written leaves the previous plot, not half of one.
        let tmp = run_dir.join(format!(".loss.svg.{}", std::process::id()));
        if let Err(e) = std::fs::write(&tmp, svg).and_then(|()| std::fs::rename(&tmp, &svg_path)) {
            let _ = std::fs::remove_file(&tmp);
            eprintln!("train: warning: cannot write {}: {e}", svg_path.display());
        }
        let mut sorted = step_ms.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
        let total_time = step_ms.iter().sum::<f64>() / 1e3;
        let tok_per_s = tokens_per_step * step_ms.len() as f64 / total_time;
        let peak_max = peak_all.iter().cloned().fold(0f32, f32::max);
        if json {
            let done = serde_json::json!({
                "event": "done",
                "metrics": run_dir.join("metrics.jsonl").display().to_string(),
                "plot": svg_path.display().to_string(),
            });
            println!("{done}");
        } else {
            let incomplete = if metrics_lost { " (incomplete: see the warning above)" } else { "" };
            println!("metrics: {}{incomplete}", run_dir.join("metrics.jsonl").display());
            println!("loss curve: {}", svg_path.display());
        }
        // A run resumed at its last step trains nothing: no loss or rate to report.
        let final_loss = losses.last().map_or_else(|| "na".to_owned(), |l| format!("{:.4}", l.1));
        let (tok_per_s, median) = if step_ms.is_empty() {
            ("na".to_owned(), "na".to_owned())
        } else {
            (format!("{tok_per_s:.0}"), format!("{median:.1}"))
        };
        println!(
            "summary: strategy={} world={world} precision={precision} offload={} resumed_from_step={start} steps={} final_loss={final_loss} tok_per_s_total={tok_per_s} step_ms_median={median} peak_rss_mib={peak_max:.0} params_sha256={hash}",
            strategy.name(),
            offload.name(),
            args.steps,
        );
    }
    Ok(())
}

/// TORCHELASTIC_RESTART_COUNT (0 outside rsrun/torchrun or in the first attempt).
/// SIGUSR1 and SIGUSR2 ask for a checkpoint at the next step boundary (their default action would
/// end the process: a preemption warning would kill the job it warns).
mod signals {
    use std::sync::atomic::{AtomicBool, Ordering};

    static SAVE: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_signal(_: libc::c_int) {
        // Async-signal-safe: one atomic store.
        SAVE.store(true, Ordering::SeqCst);
    }

    pub(super) fn install() {
        for sig in [libc::SIGUSR1, libc::SIGUSR2] {
            // SAFETY: the handler only stores to an atomic; the sigaction struct is fully set.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }

    /// Whether a signal asked for a checkpoint since the last call.
    pub(super) fn take_save_request() -> bool {
        SAVE.swap(false, Ordering::SeqCst)
    }
}

fn restart_count() -> u64 {
    std::env::var("TORCHELASTIC_RESTART_COUNT").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Creates `dir` if needed and checks that a file can be written in it (a bad flag otherwise).
fn check_writable_dir(dir: &std::path::Path, flag: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| BadInput(format!("{flag} {}: cannot create directory: {e}", dir.display())))?;
    // Unique among the ranks of every host sharing the directory (pods in pid namespaces of
    // their own share pids): the rank and the time too.
    let rank = std::env::var("RANK").unwrap_or_default();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let probe = dir.join(format!(".rsrun-write-test-{rank}-{}-{nanos:x}", std::process::id()));
    std::fs::write(&probe, b"ok").map_err(|e| BadInput(format!("{flag} {}: directory is not writable: {e}", dir.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

fn metric_field(line: &str, key: &str) -> Option<f64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?.get(key)?.as_f64()
}

fn metric_step(line: &str) -> Option<u64> {
    metric_field(line, "step").map(|s| s as u64)
}

fn metric_loss(line: &str) -> Option<f64> {
    metric_field(line, "loss")
}
