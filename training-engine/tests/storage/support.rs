//! Shared helpers: a small model's rank states, and re-executing this test binary as a child.

use std::process::{Child, Command, Stdio};

use rsrun_training_engine::checkpoint::Progress;
use rsrun_training_engine::layout::{FlatLayout, ShardState, Strategy, UnitSpec};

/// Env var naming the child role's argument; the child test returns at once without it.
pub(crate) const CHILD_ENV: &str = "RSRUN_STORAGE_CHILD";

pub(crate) fn specs(scale: usize) -> Vec<UnitSpec> {
    (0..3)
        .map(|u| UnitSpec {
            name: format!("block.{u}"),
            params: vec![
                (format!("block.{u}.w"), vec![scale, 7]),
                (format!("block.{u}.b"), vec![5 + u]),
            ],
        })
        .collect()
}

/// Every rank's state at `step` (values depend on the step, so a torn mix is detectable).
pub(crate) fn states(strategy: Strategy, world: usize, step: u64, scale: usize) -> Vec<ShardState> {
    let shard_world = if strategy.shards_optimizer() {
        world
    } else {
        1
    };
    let layout = FlatLayout::new(shard_world, &specs(scale)).unwrap();
    (0..world)
        .map(|rank| {
            let shard_rank = if shard_world == 1 { 0 } else { rank };
            let t = |u: usize, k: usize| -> Vec<f32> {
                let unit = &layout.units[u];
                unit.shard_range(shard_rank)
                    .map(|i| {
                        if i < unit.numel {
                            (step * 10_000 + (u * 3 + k) as u64 * 100) as f32 + i as f32
                        } else {
                            0.0
                        }
                    })
                    .collect()
            };
            ShardState {
                strategy,
                world,
                rank,
                shard_rank,
                layout: layout.clone(),
                step,
                optimizer: "adamw".into(),
                master: (0..3).map(|u| t(u, 0)).collect(),
                state: (0..3).map(|u| vec![t(u, 1), t(u, 2)]).collect(),
                loss_scale: None,
                loss_scale_good_steps: 0,
            }
        })
        .collect()
}

pub(crate) fn progress(step: u64) -> Progress {
    Progress {
        data_position: step * 64,
        epoch: 0,
        rng_state: step.to_le_bytes().to_vec(),
    }
}

/// Starts this test binary running only test `name`, with `CHILD_ENV=arg`.
pub(crate) fn spawn_child(name: &str, arg: &str) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, arg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}
