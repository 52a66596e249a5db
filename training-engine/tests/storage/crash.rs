//! A crash (SIGKILL) at a random point of a save leaves a loadable, verified checkpoint:
//! `latest` always names a committed checkpoint whose every byte checks out and whose content
//! is one whole step (never a mix of two saves).

use std::time::Duration;

use rand::Rng;
use rsrun_training_engine::checkpoint::{self, LoadTarget};
use rsrun_training_engine::layout::{FlatLayout, Strategy};

use crate::support::{CHILD_ENV, progress, spawn_child, specs, states};

const SCALE: usize = 2000;
const WORLD: usize = 2;

/// Child role: saves steps `start, start+1, …` forever (until killed), keeping 2.
#[test]
fn child_saver() {
    let Ok(arg) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (root, start) = arg.split_once('|').unwrap();
    let mut step: u64 = start.parse().unwrap();
    loop {
        let st = states(Strategy::Zero3, WORLD, step, SCALE);
        checkpoint::save_local(root.as_ref(), &st, &progress(step), 2).unwrap();
        step += 1;
    }
}

fn check_latest(root: &std::path::Path) -> u64 {
    let dir = checkpoint::latest(root).unwrap();
    let meta = checkpoint::verify(&dir).unwrap();
    // Load resharded to world 1 and compare with the full state of that step.
    let layout = FlatLayout::new(1, &specs(SCALE)).unwrap();
    let (got, p) = checkpoint::load(
        &dir,
        &LoadTarget {
            layout: &layout,
            strategy: Strategy::Ddp,
            world: 1,
            rank: 0,
            shard_rank: 0,
            optimizer: "adamw",
        },
    )
    .unwrap();
    assert_eq!(got, states(Strategy::Ddp, 1, meta.step, SCALE)[0]);
    assert_eq!(p, progress(meta.step));
    meta.step
}

#[test]
fn kill_during_save_leaves_previous_checkpoint_loadable() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let st = states(Strategy::Zero3, WORLD, 1, SCALE);
    checkpoint::save_local(root, &st, &progress(1), 2).unwrap();
    let mut rng = rand::rng();
    let mut next = 2u64;
    let mut advanced = 0;
    for _ in 0..20 {
        let mut child = spawn_child("crash::child_saver", &format!("{}|{next}", root.display()));
        std::thread::sleep(Duration::from_millis(rng.random_range(5..60)));
        child.kill().unwrap();
        child.wait().unwrap();
        let step = check_latest(root);
        if step >= next {
            advanced += 1;
        }
        // No incomplete directory is ever taken for a checkpoint; the next save reuses or
        // cleans leftovers.
        next = step + 100;
    }
    eprintln!("kill loop: latest advanced in {advanced}/20 iterations");
}
