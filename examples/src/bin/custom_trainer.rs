//! `custom_trainer`: how to embed rsrun's worker runtime and training engine in your own loop.
//!
//! Run it under the launcher (any number of workers and nodes):
//!
//! ```text
//! rsrun --standalone --nproc-per-node 2 target/release/custom_trainer
//! ```
//!
//! The whole integration is four steps, marked ① to ④ below.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rsrun_training_engine::comm::{CommOptions, ProcessGroup};
use rsrun_training_engine::engine::{Engine, EngineConfig};
use rsrun_training_engine::layout::Strategy;
use rsrun_training_engine::model::{Batch, Gpt, GptConfig};
use rsrun_training_engine::optim::{AdamW, OptimizerConfig};
use rsrun_worker_runtime::WorkerContext;
use rsrun_worker_runtime::engine_store::EngineStore;

/// Optional, one line: large buffers on transparent huge pages (4–6 % off the reference GPT's
/// step here; `RSRUN_HUGE_PAGES=0` turns it off at run time).
#[global_allocator]
static ALLOC: rsrun_training_engine::hugepage::HugePageAlloc = rsrun_training_engine::hugepage::HugePageAlloc;

fn main() -> anyhow::Result<()> {
    // The libraries' warnings on stderr, in this worker's log (RSRUN_LOG / RUST_LOG filter them).
    rsrun_examples::init_tracing("custom_trainer").map_err(anyhow::Error::msg)?;
    // ① Who am I? rsrun sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) plus its own;
    //    `from_env` reads them once, and names any variable that is missing or malformed.
    let ctx = WorkerContext::from_env().context("start me with rsrun")?;
    // A panic anywhere below ends up in the failure report rsrun prints (error.json).
    ctx.install_panic_hook();

    // ② Collectives bootstrap through the rendezvous store the launcher already uses: no
    //    MASTER_ADDR/PORT juggling, and it works across hosts. Backend `Auto` picks shared memory
    //    between ranks on one host and TCP between hosts.
    let store = Arc::new(EngineStore::new(&ctx)?);
    let world = ctx.world_size as usize;
    let rank = ctx.rank as usize;
    let pg = ProcessGroup::new(rank, world, store, "custom", CommOptions::default())?;

    // ③ The engine owns the parameters as flat, sharded units; the strategy is one value.
    let model = Gpt::new(GptConfig { vocab: 256, d_model: 64, layers: 2, heads: 4, seq: 32 });
    let optimizer = OptimizerConfig::AdamW(AdamW { lr: 3e-3, ..AdamW::default() });
    let mut engine = Engine::new(model, EngineConfig::new(Strategy::Zero3, optimizer), pg)?;

    // ④ Your loop: build this rank's micro-batches, step, report progress.
    let text: Vec<u32> = b"hello rsrun! ".iter().cycle().take(4096).map(|b| u32::from(*b)).collect();
    for step in 0..30u64 {
        // Each rank reads its own rows (offset by rank) of a toy corpus.
        let rows: Vec<Vec<u32>> = (0..4).map(|i| {
            let start = ((step as usize * 4 + i) * world + rank) * 7 % (text.len() - 33);
            text[start..start + 33].to_vec()
        }).collect();
        let out = engine.train_step(&[Batch::from_rows(&rows)?])?;
        // The launcher's hang detector watches this heartbeat (--hang-timeout).
        ctx.progress(step);
        if rank == 0 && (step + 1) % 10 == 0 {
            println!("step {} loss {:.4} lr {:.2e}", step + 1, out.loss, out.lr);
        }
    }
    // Every rank must take part in collectives, including this final gather of the parameters.
    let params = engine.full_params()?;
    let n: usize = params.iter().map(Vec::len).sum();
    // A job-wide barrier through the rendezvous store, e.g. before writing results.
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(ctx.barrier("custom-trainer-done", Duration::from_secs(60)))?;
    if rank == 0 {
        println!("done: {n} parameters trained by {world} ranks");
    }
    Ok(())
}
