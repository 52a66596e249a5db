//! Resident memory drops by the offloaded bytes with the NVMe tier (O_DIRECT: no page cache).
//! Measured in a child process so that other tests' allocations do not disturb VmRSS.

use rsrun_training_engine::layout::{OptimStateStore, StepParams, TileOptimizer};
use rsrun_training_engine::offload::{CpuStore, NvmeConfig, NvmeStore, resident_memory};

use rsrun_training_engine::optim::AdamW;

use crate::support::{CHILD_ENV, spawn_child};

const ELEMS: usize = 4 << 20; // 16 MiB per tensor, 48 MiB of master + Adam state
const SUB_GROUP: usize = 256 << 10; // 1 MiB per tensor per tile

fn rss() -> i64 {
    resident_memory().unwrap().0 as i64
}

fn step(store: &mut dyn OptimStateStore, master: &[f32], grad: &[f32]) -> i64 {
    store.init_unit(0, master, 2).unwrap();
    let p = StepParams {
        step: 1,
        lr: 1e-3,
        grad_scale: 1.0,
    };
    let opt = AdamW::default();
    store
        .update_unit(0, &mut |t| {
            let n = t.master.len();
            opt.step_tile(&p, t.master, &grad[t.offset..t.offset + n], t.state);
            Ok(())
        })
        .unwrap();
    rss()
}

/// Child role: `cpu|DIR` or `nvme|DIR`; prints `rss: DELTA HOST_BYTES SUM` for the parent.
#[test]
#[allow(clippy::print_stdout)]
fn child_measure() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (tier, dir) = arg.split_once('|').unwrap();
    let master: Vec<f32> = (0..ELEMS).map(|i| (i % 13) as f32).collect();
    let grad: Vec<f32> = (0..ELEMS).map(|i| (i % 7) as f32 * 0.1).collect();
    let base = rss();
    let (delta, host, result) = if tier == "nvme" {
        let mut cfg = NvmeConfig::new(dir, "rss.swap");
        cfg.sub_group_elems = SUB_GROUP;
        let mut nvme = NvmeStore::new(&[ELEMS], 2, &cfg).unwrap();
        let delta = step(&mut nvme, &master, &grad) - base;
        (delta, nvme.memory().host, nvme.read_unit(0).unwrap())
    } else {
        let mut cpu = CpuStore::new(&[ELEMS], 2, SUB_GROUP).unwrap();
        let delta = step(&mut cpu, &master, &grad) - base;
        (delta, cpu.memory().host, cpu.read_unit(0).unwrap())
    };
    let sum: f64 = result.0.iter().map(|&x| f64::from(x)).sum();
    println!("rss: {delta} {host} {sum}");
}

fn measure(tier: &str, dir: &std::path::Path) -> (i64, i64, String) {
    let out = spawn_child("rss::child_measure", &format!("{tier}|{}", dir.display()))
        .wait_with_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The harness may print "test … ... " before the child's line.
    let line = stdout
        .lines()
        .find_map(|l| l.find("rss: ").map(|i| l[i..].to_string()))
        .unwrap_or_else(|| panic!("no rss line in {stdout}"));
    let v: Vec<&str> = line.split_whitespace().collect();
    (
        v[1].parse().unwrap(),
        v[2].parse().unwrap(),
        v[3].to_string(),
    )
}

#[test]
fn nvme_offload_reduces_resident_memory() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (cpu_delta, cpu_host, cpu_sum) = measure("cpu", tmp.path());
    let (nvme_delta, nvme_host, nvme_sum) = measure("nvme", tmp.path());
    let line = format!(
        "resident growth: cpu tier {cpu_delta} B (state {cpu_host} B), nvme tier {nvme_delta} B \
         (staging {nvme_host} B)"
    );
    eprintln!("{line}");
    assert_eq!(cpu_sum, nvme_sum, "same result in both tiers");
    let offloaded = cpu_host - nvme_host;
    // The host tier's state is resident; the NVMe tier holds only its staging buffers.
    assert!(cpu_delta >= cpu_host * 9 / 10, "{line}");
    assert!(nvme_delta <= nvme_host + (4 << 20), "{line}");
    assert!(cpu_delta - nvme_delta >= offloaded * 9 / 10, "{line}");
}
