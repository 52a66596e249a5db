//! Training-engine benchmark on the reference workload of `shared/bench/README.md`:
//! byte-level GPT D=256 L=4 H=4 T=128, B=8 per rank, AdamW lr 3e-4, fp32, one compute thread
//! per rank, random tokens.
//!
//! ```text
//! engine-bench --strategy ddp                                   # single process (baseline)
//! rsrun --standalone --nproc-per-node 2 target/release/engine-bench --strategy zero3
//! engine-bench --offload nvme --nvme-path /mnt/nvme             # + offloaded/in-memory ratio
//! ```
//!
//! With `--offload cpu|nvme` the benchmark also runs the same steps with the state in memory,
//! checks that both runs end with bitwise-identical parameters, and reports the step-time
//! ratio; with `nvme` it measures plain O_DIRECT and the offload engine on a file of the
//! offloaded size in `--nvme-path` (`offload::bench::measure_bandwidth`) and the I/O bandwidth
//! achieved inside the optimizer step.
//!
//! Prints the machine first (CPU model, the SIMD level the kernels run at; `RSRUN_ISA=avx2`
//! forces a lower one) and the core's FMA peak, measured by a short FMA loop at that level in
//! the same run; model FLOPs utilization is each rank's matmul FLOP rate
//! (`GptConfig::train_flops_per_token`) over that peak (`mfu_vs_first_peak`). A single process
//! also samples the peak for 20 ms after every measured step, and `mfu` is the median of each
//! step's rate over the peak sampled right after it (a shared host's slow spells slow both);
//! distributed runs report the first figure as `mfu`.
//!
//! The single-process run records its tokens/s and the FMA peak in
//! `$TMPDIR/engine-bench-single.tok_per_s`; distributed runs read them (so the ranks do not
//! measure the peak while competing for cores). Ends with one line:
//! `summary: strategy=<s> world=<n> step_ms_median=... tok_per_s_total=... speedup_vs_single=...
//! mfu=... mfu_vs_first_peak=... fma_peak_gflops=... model_state_mib_per_rank=... peak_rss_mib=...
//! comm_wait_frac=... comm_thread_cpu_frac=...`.
//!
//! Distributed runs print, on every rank, where its step time goes: `comm: wait_ms_median=...
//! wait_frac=... compute_ms_median=... comm_thread_cpu_ms_per_step=... comm_thread_cpu_frac=...`.
//! The wait is the time the compute thread spent in collectives or waiting for its
//! asynchronous ones (`StepOutput::comm_wait`: communication not hidden behind compute, and
//! the wait for the slower rank), `compute` the rest of the step; the communication thread's
//! CPU time (from `/proc/self/task/*/schedstat`, `na` where the kernel has no such file) is
//! what it took from the core the rank computes on. The summary repeats `wait_frac` as
//! `comm_wait_frac` and `comm_thread_cpu_frac` (both 0 for a single DDP process; a single ZeRO-3
//! process still gathers on its communication thread, so only the wait is 0 there).
//!
//! `--gemm-profile` adds, before the summary, one `gemm_profile:` line per product shape of the
//! measured steps (calls and milliseconds per step, GFLOP/s counted as full products, fraction
//! of the FMA peak) and a `gemm_profile_total:` line: the products' share of the step, their
//! combined fraction of the peak, and the microkernel's own rate over panels that stay in L1,
//! the ceiling no product can pass at this blocking.

#![allow(clippy::print_stdout)]

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use rsrun_training_engine::comm::{CommOptions, FileStore, LocalStore, ProcessGroup, Store};
use rsrun_training_engine::engine::{Engine, EngineConfig, Offload, Precision};
use rsrun_training_engine::offload::NvmeConfig;
use rsrun_training_engine::offload::bench::measure_bandwidth;
use rsrun_training_engine::layout::Strategy;
use rsrun_training_engine::model::{Batch, Gpt, GptConfig, global_batch, rank_rows};
use rsrun_training_engine::native::profile::{self, GemmStat};
use rsrun_training_engine::optim::{AdamW, OptimizerConfig};
use rsrun_examples::median;

/// Large buffers (activations, gradients, optimizer state) on transparent huge pages
/// (`RSRUN_HUGE_PAGES=0` turns it off).
#[global_allocator]
static ALLOC: rsrun_training_engine::hugepage::HugePageAlloc = rsrun_training_engine::hugepage::HugePageAlloc;

#[derive(Parser, Debug)]
#[command(about = "rsrun training-engine benchmark (reference GPT workload)")]
struct Args {
    /// ddp | zero1 | zero2 | zero3 | fsdp | fsdp-shard-grad-op | fsdp-no-shard | hybrid
    #[arg(long, default_value = "ddp")]
    strategy: String,
    /// Optimizer-state offload: none | cpu | nvme (nvme needs --nvme-path).
    #[arg(long, default_value = "none")]
    offload: String,
    /// Directory of the NVMe swap files (`--offload nvme`).
    #[arg(long)]
    nvme_path: Option<PathBuf>,
    /// Compute precision: fp32 | bf16 | f16.
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// Optimizer steps (the first 3 are warm-up and excluded from the median), at least 1.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Per-rank batch size (sequences), at least 1.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    batch: usize,
    /// Deterministic (rank-order) reductions.
    #[arg(long)]
    deterministic: bool,
    /// Compute threads per rank, at least 1.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    threads: usize,
    /// Time every matrix product of the measured steps by shape and print where the step's
    /// gemm time goes (fp32 native path), next to the microkernel's rate with its operands in L1.
    #[arg(long)]
    gemm_profile: bool,
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
    let strategy: Strategy = args.strategy.parse()?;
    let precision: Precision = args.precision.parse()?;
    let offload = match (args.offload.as_str(), &args.nvme_path) {
        ("none", _) => Offload::None,
        ("cpu", _) => Offload::Cpu,
        ("nvme", Some(dir)) => {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create --nvme-path {}", dir.display()))?;
            Offload::Nvme(NvmeConfig::new(dir, "engine-bench"))
        }
        ("nvme", None) => bail!("--offload nvme needs --nvme-path DIR"),
        (o, _) => bail!("unknown --offload {o:?} (none|cpu|nvme)"),
    };
    let rank = env_usize("RANK").unwrap_or(0);
    let world = env_usize("WORLD_SIZE").unwrap_or(1);
    let baseline = std::env::temp_dir().join("engine-bench-single.tok_per_s");
    // (tokens/s, FMA peak) of the last single-process run.
    let recorded: Option<(f64, f64)> = std::fs::read_to_string(&baseline).ok().and_then(|s| {
        let mut it = s.split_whitespace().map(|v| v.parse::<f64>().ok());
        Some((it.next()??, it.next()??))
    });
    let peak = match recorded {
        Some((_, p)) if world > 1 => p,
        _ => rsrun_examples::machine::fma_peak_gflops(rsrun_training_engine::native::isa::isa(), Duration::from_millis(300)),
    };
    if rank == 0 {
        println!("{}", rsrun_examples::machine::describe());
        println!("fma_peak_gflops_per_core={peak:.1}");
    }
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
    let model_cfg = GptConfig::reference();
    let mut cfg = EngineConfig::new(
        strategy,
        OptimizerConfig::AdamW(AdamW {
            lr: 3e-4,
            ..AdamW::default()
        }),
    );
    cfg.seed = 0;
    cfg.precision = precision;
    // The in-memory baseline first (offload runs only), then the configured run.
    let mut baseline_run = None;
    if offload != Offload::None {
        let pg = ProcessGroup::new(rank, world, store.clone(), "engine-bench-mem", opts.clone()).context("process group")?;
        let mut run = bench_run(Engine::new(Gpt::new(model_cfg), cfg.clone(), pg)?, &args, rank, world)?;
        baseline_run = Some((run.median, run.engine.full_params()?));
    }
    cfg.offload = offload.clone();
    let pg = ProcessGroup::new(rank, world, store, "engine-bench", opts).context("process group")?;
    let Run {
        mut engine,
        median: med,
        loss,
        io_bytes,
        gemms,
        paired,
        waits,
        comm_cpu,
    } = bench_run(Engine::new(Gpt::new(model_cfg), cfg, pg)?, &args, rank, world)?;
    let mut offload_line = None;
    let mut offload_summary = String::new();
    if let Some((mem_med, mem_params)) = baseline_run {
        let identical = engine.full_params()? == mem_params;
        if !identical {
            bail!("the offloaded run's parameters differ from the in-memory run's");
        }
        let ratio = med / mem_med;
        let m = engine.memory();
        let mut line = format!(
            "offload={} {} step_ms_in_memory={:.1} step_ms_offloaded={:.1} offloaded_step_ratio={ratio:.2} bitwise_identical={identical} offloaded_host_mib={:.2} offloaded_nvme_mib={:.2}",
            offload.name(),
            engine.offload_describe().unwrap_or_default().replace(' ', "_"),
            mem_med * 1e3,
            med * 1e3,
            m.offloaded_host as f64 / (1 << 20) as f64,
            m.offloaded_nvme as f64 / (1 << 20) as f64,
        );
        offload_summary = format!(" offload={} offloaded_step_ratio={ratio:.2}", offload.name());
        if let (Offload::Nvme(c), Some(bytes)) = (&offload, io_bytes) {
            let step_bw = bytes / med;
            // Plain O_DIRECT vs the offload engine on a file of the offloaded size.
            let size = (m.offloaded_nvme as usize / 2).max(64 << 20);
            let bw = measure_bandwidth(&c.dir, size, c.block_size, c.queue_depth, c.engine, 2, c.io_timeout)?;
            let gb = |x: f64| x / 1e9;
            line += &format!(
                "\nnvme_bandwidth: file_mib={} plain_write_gbps={:.2} plain_read_gbps={:.2} engine({:?},qd{})_write_gbps={:.2} engine_read_gbps={:.2} engine/plain write={:.2} read={:.2} step_io_gbps={:.2} step_io/plain_avg={:.2}",
                bw.bytes >> 20,
                gb(bw.plain_write),
                gb(bw.plain_read),
                bw.engine,
                bw.queue_depth,
                gb(bw.engine_write),
                gb(bw.engine_read),
                bw.ratios().0,
                bw.ratios().1,
                gb(step_bw),
                step_bw / ((bw.plain_write + bw.plain_read) / 2.0),
            );
            offload_summary += &format!(
                " step_io_gbps={:.2} plain_odirect_read_gbps={:.2} plain_odirect_write_gbps={:.2}",
                gb(step_bw),
                gb(bw.plain_read),
                gb(bw.plain_write)
            );
        }
        offload_line = Some(line);
    }
    let tok_total = (args.batch * model_cfg.seq * world) as f64 / med;
    let speedup = if world == 1 && offload_line.is_none() && precision == Precision::Fp32 {
        std::fs::write(&baseline, format!("{tok_total} {peak}"))?;
        "1.00".to_string()
    } else {
        recorded.map_or_else(|| "na".into(), |(b, _)| format!("{:.2}", tok_total / b))
    };
    // Per rank: each rank computes on its own core. Against the peak measured at the start;
    // a single process also pairs each step with the peak sampled right after it and takes the
    // median of those ratios (`mfu`): a shared host's slow spells, which last seconds, then
    // slow both sides of a ratio alike.
    let step_flops = (args.batch * model_cfg.seq) as f64 * model_cfg.train_flops_per_token();
    let mfu_first = tok_total / world as f64 * model_cfg.train_flops_per_token() / (peak * 1e9);
    let mfu = if paired.is_empty() {
        mfu_first
    } else {
        median(&paired.iter().map(|(t, p)| step_flops / t / (p * 1e9)).collect::<Vec<_>>())
    };
    // Where the step goes (rank 0): waiting in collectives, and the rest (compute).
    let wait_frac = median(&waits.iter().map(|(t, w)| w / t).collect::<Vec<_>>());
    let wait_ms = median(&waits.iter().map(|(_, w)| w * 1e3).collect::<Vec<_>>());
    let compute_ms = median(&waits.iter().map(|(t, w)| (t - w) * 1e3).collect::<Vec<_>>());
    let measured_s: f64 = waits.iter().map(|(t, _)| t).sum();
    let cpu_ms = comm_cpu.map_or_else(|| "na".to_string(), |c| format!("{:.1}", c * 1e3 / waits.len() as f64));
    let cpu_frac = comm_cpu.map_or_else(|| "na".to_string(), |c| format!("{:.3}", c / measured_s));
    let mem = engine.memory();
    let sent_mib = engine.bytes_sent() as f64 / args.steps as f64 / (1 << 20) as f64;
    // Every rank says where its step went: a rank that waits on a slower one shows it here.
    if world > 1 {
        writeln!(std::io::stdout().lock(), "comm: wait_ms_median={wait_ms:.1} wait_frac={wait_frac:.3} compute_ms_median={compute_ms:.1} comm_thread_cpu_ms_per_step={cpu_ms} comm_thread_cpu_frac={cpu_frac}")?;
    }
    if rank == 0 {
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "params={} loss={loss:.4} comm_mib_sent_per_step={sent_mib:.2} gathered_peak_mib={:.2} comm_peak_mib={:.2}",
            engine.layout().total_numel(),
            mem.gathered_peak as f64 / (1 << 20) as f64,
            mem.comm_peak as f64 / (1 << 20) as f64,
        )?;
        if let Some(l) = &offload_line {
            writeln!(out, "{l}")?;
        }
        if args.gemm_profile {
            print_gemm_profile(&mut out, &gemms, args.steps.saturating_sub(warm_steps(args.steps)), med, peak)?;
        }
        writeln!(
            out,
            "summary: strategy={strategy} world={world} precision={precision}{offload_summary} step_ms_median={:.1} tok_per_s_total={tok_total:.0} speedup_vs_single={speedup} mfu={mfu:.3} mfu_vs_first_peak={mfu_first:.3} fma_peak_gflops={peak:.1} model_state_mib_per_rank={:.2} peak_rss_mib={:.0} comm_wait_frac={wait_frac:.3} comm_thread_cpu_frac={cpu_frac}",
            med * 1e3,
            mem.model_state() as f64 / (1 << 20) as f64,
            peak_rss_mib(),
        )?;
    }
    Ok(())
}

/// Steps excluded from the median (and from the gemm profile).
fn warm_steps(steps: u64) -> u64 {
    3.min(steps.saturating_sub(1))
}

/// The `--gemm-profile` lines of `steps` measured steps.
fn print_gemm_profile(out: &mut impl Write, gemms: &[GemmStat], steps: u64, step_s: f64, peak_gflops: f64) -> Result<()> {
    let steps = steps.max(1) as f64;
    let (mut time, mut flops) = (0f64, 0f64);
    for g in gemms {
        time += g.time.as_secs_f64();
        flops += g.flops;
        writeln!(
            out,
            "gemm_profile: m={} n={} k={} pattern={} lhs={} rhs={} calls_per_step={:.0} ms_per_step={:.2} gflops={:.1} frac_of_peak={:.2}",
            g.m,
            g.n,
            g.k,
            g.pattern,
            g.lhs,
            g.rhs,
            g.calls as f64 / steps,
            g.time.as_secs_f64() * 1e3 / steps,
            g.flops_per_s() / 1e9,
            g.flops_per_s() / 1e9 / peak_gflops,
        )?;
    }
    let level = rsrun_training_engine::native::isa::isa();
    let hot = profile::kernel_hot_gflops(level, Duration::from_millis(200)).unwrap_or(0.0);
    let rate = if time > 0.0 { flops / time / 1e9 } else { 0.0 };
    writeln!(
        out,
        "gemm_profile_total: gemm_ms_per_step={:.1} step_ms={:.1} gemm_share_of_step={:.2} gemm_gflops={rate:.1} gemm_frac_of_peak={:.2} kernel_hot_gflops={hot:.1} kernel_hot_frac_of_peak={:.2} isa={level:?}",
        time * 1e3 / steps,
        step_s * 1e3,
        time / steps / step_s,
        rate / peak_gflops,
        hot / peak_gflops,
    )?;
    Ok(())
}

/// What [`bench_run`] measured.
struct Run {
    engine: Engine<Gpt>,
    /// Median step time in seconds (after the warm-up steps).
    median: f64,
    /// The last step's loss.
    loss: f32,
    /// Offload bytes moved per step (read + write), if offloaded.
    io_bytes: Option<f64>,
    /// The `--gemm-profile` entries of the measured steps (empty without the flag).
    gemms: Vec<GemmStat>,
    /// Single process: each measured step's seconds and the FMA peak (GFLOP/s) sampled right
    /// after it.
    paired: Vec<(f64, f64)>,
    /// Each measured step's seconds and its `comm_wait` seconds.
    waits: Vec<(f64, f64)>,
    /// CPU seconds the communication threads ran during the measured steps (`None` without
    /// per-thread schedstat).
    comm_cpu: Option<f64>,
}

/// Runs the benchmark steps, profiling the products of the measured ones with `--gemm-profile`.
fn bench_run(mut engine: Engine<Gpt>, args: &Args, rank: usize, world: usize) -> Result<Run> {
    let model_cfg = engine.model().config();
    engine.reset_traffic();
    let mut times = Vec::new();
    let mut paired = Vec::new();
    let mut loss = 0f32;
    let warm = warm_steps(args.steps);
    let mut io0 = None;
    let mut waits = Vec::new();
    let mut cpu0 = None;
    profile::take();
    for step in 0..args.steps {
        if step == warm {
            io0 = engine.offload_stats();
            cpu0 = comm_thread_cpu_ns();
            profile::enable(args.gemm_profile);
        }
        let rows = global_batch(1234, step, args.batch * world, model_cfg.seq, model_cfg.vocab);
        let batch = Batch::from_rows(&rank_rows(&rows, rank, world))?;
        let t0 = Instant::now();
        let out = engine.train_step(std::slice::from_ref(&batch))?;
        loss = out.loss;
        let t = t0.elapsed().as_secs_f64();
        times.push(t);
        if step >= warm {
            waits.push((t, out.comm_wait.as_secs_f64()));
        }
        if world == 1 && step >= warm {
            // The core's peak now (registers only: the caches stay as the step left them).
            paired.push((t, rsrun_examples::machine::fma_peak_gflops(rsrun_training_engine::native::isa::isa(), PAIRED_PEAK)));
        }
    }
    let io = match (io0, engine.offload_stats()) {
        (Some(a), Some(b)) => Some(
            (b.bytes_read - a.bytes_read + b.bytes_written - a.bytes_written) as f64
                / (args.steps - warm).max(1) as f64,
        ),
        _ => None,
    };
    let comm_cpu = match (cpu0, comm_thread_cpu_ns()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / 1e9),
        _ => None,
    };
    let med = median(&times.iter().skip(warm as usize).copied().collect::<Vec<_>>());
    profile::enable(false);
    Ok(Run {
        engine,
        median: med,
        loss,
        io_bytes: io,
        gemms: profile::take(),
        paired,
        waits,
        comm_cpu,
    })
}

/// Nanoseconds this process's communication threads (named `comm-<rank>`) have run on a CPU,
/// from `/proc/self/task/<tid>/schedstat`; 0 before the first asynchronous op starts one.
/// `None` where the kernel keeps no per-thread schedstat.
fn comm_thread_cpu_ns() -> Option<u64> {
    std::fs::metadata("/proc/self/schedstat").ok()?;
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let dir = task.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !name.starts_with("comm-") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// How long the FMA peak is sampled after each measured single-process step.
const PAIRED_PEAK: Duration = Duration::from_millis(20);
