//! `hello`: the smallest trainer that uses the worker runtime.
//!
//! ```text
//! cargo build --bin hello --bin rsrun
//! rsrun --standalone --nproc-per-node 4 target/debug/hello --steps 20
//! ```
//!
//! Every rank prints its place in the job, the ranks meet at a barrier in the rendezvous store, rank 0
//! publishes a 128-byte unique id that every rank receives (as an NCCL communicator would), and each
//! "training step" reports progress for rsrun's hang detector. Flags make a chosen rank panic, exit
//! with a code, or hang, to see rsrun's failure report, restarts and hang detection.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rsrun_worker_runtime::WorkerContext;

#[derive(Debug, Parser)]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    steps: u64,
    /// Time per step, in milliseconds.
    #[arg(long, default_value_t = 10)]
    step_ms: u64,
    /// This global rank panics at step 1 (of the first attempt only, with --only-first-attempt).
    #[arg(long)]
    panic_rank: Option<u32>,
    /// This global rank exits with this code at step 1: `RANK:CODE`.
    #[arg(long)]
    exit_rank: Option<String>,
    /// This global rank stops reporting progress at step 1 and sleeps.
    #[arg(long)]
    hang_rank: Option<u32>,
    /// Inject the failures above only when TORCHELASTIC_RESTART_COUNT is 0.
    #[arg(long)]
    only_first_attempt: bool,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ctx = WorkerContext::from_env().context("hello must run under rsrun or torchrun")?;
    ctx.install_panic_hook();
    let result = run(&args, &ctx).await;
    // The launcher's failure report shows the error file: an error, like a panic, goes there.
    if let Err(e) = &result {
        let _ = ctx.report_error(&format!("{e:#}"), None);
    }
    result
}

async fn run(args: &Args, ctx: &WorkerContext) -> anyhow::Result<()> {
    println!(
        "hello from rank {} of {} (local rank {} of {}, node {} of {}, restart {}, job {}, round {})",
        ctx.rank,
        ctx.world_size,
        ctx.local_rank,
        ctx.local_world_size,
        ctx.node_rank,
        ctx.num_nodes,
        ctx.restart_count,
        ctx.job_id,
        ctx.round.map(|r| r.to_string()).unwrap_or_else(|| "-".into()),
    );

    if ctx.rdzv_endpoint.is_some() {
        let timeout = Duration::from_secs(60);
        ctx.barrier("hello.start", timeout).await.context("start barrier")?;
        let mut own = [0u8; 128];
        own[..8].copy_from_slice(&ctx.round.unwrap_or(0).to_le_bytes());
        let id = ctx.unique_id("hello", ctx.is_rank0().then_some(own), timeout).await.context("unique id")?;
        println!("rank {} got unique id {:02x}{:02x}{:02x}{:02x}...", ctx.rank, id[0], id[1], id[2], id[3]);
    }

    let inject = !args.only_first_attempt || ctx.restart_count == 0;
    let exit_rank = match &args.exit_rank {
        Some(s) => {
            let (r, c) = s.split_once(':').context("--exit-rank expects RANK:CODE")?;
            Some((r.parse::<u32>()?, c.parse::<i32>()?))
        }
        None => None,
    };
    for step in 0..args.steps {
        if inject && step == 1 {
            if args.panic_rank == Some(ctx.rank) {
                panic!("rank {} failed on purpose at step {step}", ctx.rank);
            }
            if let Some((r, code)) = exit_rank
                && r == ctx.rank
            {
                eprintln!("rank {r} exits with code {code}");
                std::process::exit(code);
            }
            if args.hang_rank == Some(ctx.rank) {
                eprintln!("rank {} stops making progress", ctx.rank);
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        }
        ctx.progress(step);
        tokio::time::sleep(Duration::from_millis(args.step_ms)).await;
    }
    println!("rank {} done after {} steps", ctx.rank, args.steps);
    Ok(())
}
