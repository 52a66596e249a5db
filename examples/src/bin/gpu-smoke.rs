//! `gpu-smoke`: does NCCL work here, through rsrun? (feature `nccl`)
//!
//! ```text
//! cargo build --release -p rsrun-launcher -p rsrun-examples --features nccl
//! rsrun --standalone --nproc-per-node 1 target/release/gpu-smoke     # one GPU per worker
//! target/release/gpu-smoke                                          # alone: world of one
//! ```
//!
//! Under rsrun, rank 0 creates the NCCL unique id and every rank receives it through the
//! rendezvous (the worker runtime's exchange); alone, the id is made locally. Each rank opens
//! GPU `LOCAL_RANK` (or `--device`), creates the communicator, checks every collective against
//! values computed on the host (all_reduce sum/avg/max/min in f32, bf16 and f16, broadcast,
//! all_gather, reduce_scatter, and a send/receive ring when there are several ranks), then times
//! an out-of-place all_reduce of `--mib` MiB (with one rank, a device-to-device copy). Ends with
//! `summary: gpu_smoke=pass world=... device="..." nccl=... unique_id=rendezvous|local
//! all_reduce_mib=... all_reduce_ms=... algbw_gbps=... busbw_gbps=...`.
//!
//! Exit codes: 0 every check passed; 1 a check failed (the line says which and where);
//! 77 skipped: no NVIDIA driver, no GPU, no NCCL library, or built without the `nccl` feature
//! (the line says which, and how to fix it).
#![allow(clippy::print_stdout)]

#[cfg(not(feature = "nccl"))]
fn main() {
    eprintln!(
        "gpu-smoke: skipped: built without the `nccl` feature; build it with \
         `cargo build --release -p rsrun-examples --features nccl --bin gpu-smoke`"
    );
    std::process::exit(77);
}

#[cfg(feature = "nccl")]
fn main() -> std::process::ExitCode {
    smoke::main()
}

#[cfg(feature = "nccl")]
mod smoke {
    use std::process::ExitCode;
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail};
    use clap::Parser;
    use half::{bf16, f16};
    use rsrun_training_engine::comm::ReduceOp;
    use rsrun_training_engine::comm::nccl::{self, CudaSlice, NcclGroup, NcclType};
    use rsrun_worker_runtime::WorkerContext;

    #[derive(Debug, Parser)]
    #[command(about = "NCCL smoke test: collectives checked against the host, and a timed all_reduce")]
    struct Args {
        /// GPU to use (default: LOCAL_RANK under rsrun, else 0).
        #[arg(long)]
        device: Option<usize>,
        /// Size of the timed all_reduce, in MiB of f32.
        #[arg(long, default_value_t = 256)]
        mib: usize,
        /// Timed all_reduce iterations (after 5 warm-up ones).
        #[arg(long, default_value_t = 20)]
        iters: usize,
        /// Deadline for the id exchange, the communicator setup and every wait, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout_s: u64,
    }

    /// Why the smoke test did not run (exit 77).
    struct Skip(String);

    pub(super) fn main() -> ExitCode {
        let args = Args::parse();
        match run(&args) {
            Ok(Ok(())) => ExitCode::SUCCESS,
            Ok(Err(Skip(why))) => {
                eprintln!("gpu-smoke: skipped: {why}");
                ExitCode::from(77)
            }
            Err(e) => {
                eprintln!("gpu-smoke: FAILED: {e:#}");
                ExitCode::FAILURE
            }
        }
    }

    fn run(args: &Args) -> Result<std::result::Result<(), Skip>> {
        if args.mib == 0 || args.iters == 0 || args.timeout_s == 0 {
            bail!("--mib, --iters and --timeout-s must be positive");
        }
        let timeout = Duration::from_secs(args.timeout_s);
        // Under rsrun/torchrun: the job's ranks; alone: a world of one.
        let ctx = match std::env::var_os("RANK") {
            Some(_) => Some(WorkerContext::from_env().context("reading the rank environment")?),
            None => None,
        };
        let (rank, world) = ctx.as_ref().map_or((0, 1), |c| (c.rank as usize, c.world_size as usize));
        let device = args.device.unwrap_or_else(|| ctx.as_ref().map_or(0, |c| c.local_rank as usize));

        let count = match nccl::device_count() {
            Ok(n) => n,
            Err(e) => return Ok(Err(Skip(e.to_string()))),
        };
        if count == 0 {
            return Ok(Err(Skip(format!(
                "the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES={:?})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
            ))));
        }
        if device >= count {
            bail!("GPU {device} requested, but this machine has {count} (use --device or fewer workers per node)");
        }
        let (version, path) = match nccl::nccl_version() {
            Ok(v) => v,
            Err(e) => return Ok(Err(Skip(e.to_string()))),
        };
        println!("gpu-smoke: rank {rank} of {world}, GPU {device} of {count}, NCCL {version} from {path}");

        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (id, source) = match &ctx {
            Some(c) if c.rdzv_endpoint.is_some() => {
                let id = rt
                    .block_on(c.unique_id("gpu-smoke", None, timeout))
                    .context("exchanging the NCCL unique id through the rendezvous")?;
                (id, "rendezvous")
            }
            Some(c) if world > 1 => bail!(
                "rank {} of {world} has no rendezvous to receive the NCCL id from (run under rsrun)",
                c.rank
            ),
            _ => (nccl::unique_id().context("ncclGetUniqueId")?, "local"),
        };
        println!(
            "gpu-smoke: unique id from the {source} exchange: {:02x}{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}...",
            id[0], id[1], id[2], id[3], id[4], id[5], id[6], id[7]
        );

        let started = Instant::now();
        let group = NcclGroup::from_unique_id(rank, world, &id, device, timeout).context("creating the NCCL communicator")?;
        let name = group.context().name().unwrap_or_else(|_| "unknown GPU".into());
        println!("gpu-smoke: communicator ready on {name} in {:.1?}", started.elapsed());

        checks(&group).context("checking the collectives")?;

        // Timed out-of-place all_reduce (in place, a world of one would be a no-op; out of place
        // it is at least a device-to-device copy).
        let n = args.mib * 1024 * 1024 / 4;
        let stream = group.stream();
        let host: Vec<f32> = (0..n).map(|i| (i % 251) as f32).collect();
        let send = stream.clone_htod(&host).map_err(cuda)?;
        let mut recv = stream.alloc_zeros::<f32>(n).map_err(cuda)?;
        for _ in 0..5 {
            group.all_reduce_into(&send, &mut recv, ReduceOp::Sum)?;
        }
        group.synchronize()?;
        let mut times = Vec::with_capacity(args.iters);
        for _ in 0..args.iters {
            let t = Instant::now();
            group.all_reduce_into(&send, &mut recv, ReduceOp::Sum)?;
            group.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        // Spot-check the timed result too.
        let got = download(&group, &recv)?;
        if let Some(i) = (0..n).step_by(4099).find(|&i| got[i] != host[i] * world as f32) {
            bail!("timed all_reduce: element {i} is {}, expected {}", got[i], host[i] * world as f32);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let bytes = (n * 4) as f64;
        let algbw = bytes / median / 1e9;
        let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
        println!(
            "summary: gpu_smoke=pass world={world} device=\"{name}\" nccl={version} unique_id={source} \
             all_reduce_mib={} all_reduce_ms={:.3} algbw_gbps={algbw:.1} busbw_gbps={busbw:.1}",
            args.mib,
            median * 1e3
        );
        Ok(Ok(()))
    }

    fn cuda(e: impl std::fmt::Debug) -> anyhow::Error {
        anyhow::anyhow!("CUDA: {e:?}")
    }

    /// A value that every element type represents exactly (small integers).
    fn pattern(rank: usize, i: usize) -> f32 {
        ((rank + 1) * (i % 7 + 1)) as f32
    }

    fn upload<T: NcclType + Copy>(g: &NcclGroup, v: &[T]) -> Result<CudaSlice<T>> {
        g.stream().clone_htod(v).map_err(cuda)
    }

    fn download<T: NcclType + Copy>(g: &NcclGroup, s: &CudaSlice<T>) -> Result<Vec<T>> {
        g.synchronize()?;
        g.stream().clone_dtoh(s).map_err(cuda)
    }

    fn expect_eq(what: &str, got: &[f32], want: &[f32]) -> Result<()> {
        expect_near(what, got, want, 0.0)
    }

    /// Equal within `rel` relative error (0: exactly).
    fn expect_near(what: &str, got: &[f32], want: &[f32], rel: f32) -> Result<()> {
        if got.len() != want.len() {
            bail!("{what}: {} elements, expected {}", got.len(), want.len());
        }
        if let Some(i) = (0..got.len()).find(|&i| (got[i] - want[i]).abs() > rel * want[i].abs() || got[i].is_nan()) {
            bail!("{what}: element {i} is {}, expected {}", got[i], want[i]);
        }
        println!("gpu-smoke: ok   {what}");
        Ok(())
    }

    fn all_reduce_as<T: NcclType + Copy>(
        g: &NcclGroup,
        what: &str,
        to: fn(f32) -> T,
        from: fn(T) -> f32,
        op: ReduceOp,
        want: impl Fn(usize) -> f32,
    ) -> Result<()> {
        // NCCL averages floats by multiplying with 1/W: one rounding away from sum/W.
        let rel = if matches!(op, ReduceOp::Avg) { 1e-6 } else { 0.0 };
        let n = 4099; // not a multiple of anything NCCL might chunk by
        let host: Vec<T> = (0..n).map(|i| to(pattern(g.rank(), i))).collect();
        let mut dev = upload(g, &host)?;
        g.all_reduce(&mut dev, op)?;
        let got: Vec<f32> = download(g, &dev)?.into_iter().map(from).collect();
        let want: Vec<f32> = (0..n).map(want).collect();
        expect_near(what, &got, &want, rel)
    }

    fn checks(g: &NcclGroup) -> Result<()> {
        let (rank, world) = (g.rank(), g.world_size());
        let ranks = || 0..world;
        let sum = |i| ranks().map(|r| pattern(r, i)).sum::<f32>();
        all_reduce_as::<f32>(g, "all_reduce f32 sum", |x| x, |x| x, ReduceOp::Sum, sum)?;
        all_reduce_as::<f32>(g, "all_reduce f32 avg", |x| x, |x| x, ReduceOp::Avg, |i| {
            // Sum of (r+1)·k over ranks, over the world: k·(W+1)/2, exact for these values.
            sum(i) / world as f32
        })?;
        all_reduce_as::<f32>(g, "all_reduce f32 max", |x| x, |x| x, ReduceOp::Max, |i| pattern(world - 1, i))?;
        all_reduce_as::<f32>(g, "all_reduce f32 min", |x| x, |x| x, ReduceOp::Min, |i| pattern(0, i))?;
        all_reduce_as::<bf16>(g, "all_reduce bf16 sum", bf16::from_f32, bf16::to_f32, ReduceOp::Sum, sum)?;
        all_reduce_as::<f16>(g, "all_reduce f16 sum", f16::from_f32, f16::to_f32, ReduceOp::Sum, sum)?;

        let n = 1031;
        let host: Vec<f32> = (0..n).map(|i| pattern(rank, i) + 100.0).collect();
        let mut dev = upload(g, &host)?;
        g.broadcast(&mut dev, world - 1)?;
        let want: Vec<f32> = (0..n).map(|i| pattern(world - 1, i) + 100.0).collect();
        expect_eq(&format!("broadcast from rank {}", world - 1), &download(g, &dev)?, &want)?;

        let input = upload(g, &host)?;
        let mut gathered = g.stream().alloc_zeros::<f32>(n * world).map_err(cuda)?;
        g.all_gather(&input, &mut gathered)?;
        let want: Vec<f32> = ranks().flat_map(|r| (0..n).map(move |i| pattern(r, i) + 100.0)).collect();
        expect_eq("all_gather", &download(g, &gathered)?, &want)?;

        let full: Vec<f32> = (0..n * world).map(|i| pattern(rank, i)).collect();
        let input = upload(g, &full)?;
        let mut shard = g.stream().alloc_zeros::<f32>(n).map_err(cuda)?;
        g.reduce_scatter(&input, &mut shard, ReduceOp::Sum)?;
        let want: Vec<f32> = (0..n).map(|i| sum(rank * n + i)).collect();
        expect_eq("reduce_scatter sum", &download(g, &shard)?, &want)?;

        if world > 1 {
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let out = upload(g, &host)?;
            let mut inbox = g.stream().alloc_zeros::<f32>(n).map_err(cuda)?;
            g.grouped(|g| {
                g.send(&out, next)?;
                g.recv(&mut inbox, prev)
            })?;
            let want: Vec<f32> = (0..n).map(|i| pattern(prev, i) + 100.0).collect();
            expect_eq("send/recv ring", &download(g, &inbox)?, &want)?;
        }
        Ok(())
    }
}
