//! Offload I/O benchmark: plain O_DIRECT bandwidth vs the offload engine on the same file size
//! and disk, and an AdamW step with the state in memory vs on NVMe.
//!
//! ```text
//! cargo run --release -p rsrun-training-engine --example offload_bench -- [DIR] [MIB] [ELEMS_M]
//! ```
//! DIR defaults to the current directory, MIB (file size for bandwidth) to 256, ELEMS_M
//! (optimizer elements, millions) to 16.

use rsrun_training_engine::offload::bench::{measure_bandwidth, measure_step};
use rsrun_training_engine::offload::{DEFAULT_IO_TIMEOUT, EngineKind, NvmeConfig};

#[allow(clippy::print_stdout)]
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::path::PathBuf::from(args.first().map_or(".", String::as_str));
    let mib: usize = args.get(1).map_or(Ok(256), |s| s.parse())?;
    let elems_m: usize = args.get(2).map_or(Ok(16), |s| s.parse())?;
    let gbs = |b: f64| b / 1e9;
    let mut worst = f64::MAX;
    for engine in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let r = measure_bandwidth(&dir, mib << 20, 1 << 20, 8, Some(engine), 3, DEFAULT_IO_TIMEOUT)?;
        let (w, rd) = r.ratios();
        println!(
            "bandwidth {:?} {} MiB block 1 MiB qd 8: plain O_DIRECT write {:.2} GB/s read {:.2} GB/s | \
             engine write {:.2} GB/s read {:.2} GB/s | ratio write {:.2} read {:.2}",
            r.engine,
            mib,
            gbs(r.plain_write),
            gbs(r.plain_read),
            gbs(r.engine_write),
            gbs(r.engine_read),
            w,
            rd
        );
        if engine == EngineKind::IoUring {
            worst = w.min(rd);
        }
    }
    let units = 4;
    let per_unit = (elems_m << 20) / units;
    let mut cfg = NvmeConfig::new(&dir, "offload-bench.swap");
    cfg.sub_group_elems = 1 << 20;
    let s = measure_step(units, per_unit, &cfg, 5)?;
    let state_mib = (s.elems * 12) >> 20;
    println!(
        "adamw step, {} M elements ({state_mib} MiB of master+m+v): in-memory {:.1} ms, nvme {:.1} ms \
         (io wait {:.1} ms, {:.2} GB/s moved) -> nvme/in-memory speed {:.2}; host bytes cpu {} MiB, \
         nvme {} MiB ({})",
        s.elems >> 20,
        s.cpu_step * 1e3,
        s.nvme_step * 1e3,
        s.nvme_io_wait * 1e3,
        gbs(s.nvme_bandwidth),
        s.cpu_step / s.nvme_step,
        s.cpu_host_bytes >> 20,
        s.nvme_host_bytes >> 20,
        s.describe
    );
    println!(
        "summary: offload io_uring engine/plain O_DIRECT min ratio {worst:.2} (target >= 0.80); \
         optimizer-only step nvme/in-memory {:.2}",
        s.cpu_step / s.nvme_step
    );
    Ok(())
}
