use super::*;
use crate::layout::{FsdpSharding, UnitSpec};

fn specs() -> Vec<UnitSpec> {
    vec![
        UnitSpec {
            name: "embed".into(),
            params: vec![("tok".into(), vec![5, 3]), ("pos".into(), vec![7])],
        },
        UnitSpec {
            name: "block.0".into(),
            params: vec![("w".into(), vec![4, 4]), ("b".into(), vec![4])],
        },
        UnitSpec {
            name: "head".into(),
            params: vec![("out".into(), vec![3])],
        },
    ]
}

/// The "true" full state: master value and state slots of element `i` of unit `u`.
fn value(u: usize, tensor: usize, i: usize) -> f32 {
    (u * 1000 + tensor * 100) as f32 + i as f32 * 0.5
}

/// Rank states for `strategy` over `world` ranks, built from the full state.
fn states(strategy: Strategy, world: usize, step: u64) -> Vec<ShardState> {
    let shard_world = if strategy.shards_optimizer() {
        world
    } else {
        1
    };
    let layout = FlatLayout::new(shard_world, &specs()).unwrap();
    (0..world)
        .map(|rank| {
            let shard_rank = if shard_world == 1 { 0 } else { rank };
            let tensor = |u: usize, t: usize| -> Vec<f32> {
                let unit = &layout.units[u];
                unit.shard_range(shard_rank)
                    .map(|i| if i < unit.numel { value(u, t, i) } else { 0.0 })
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
                master: (0..3).map(|u| tensor(u, 0)).collect(),
                state: (0..3).map(|u| vec![tensor(u, 1), tensor(u, 2)]).collect(),
                loss_scale: Some(1024.0),
                loss_scale_good_steps: 7,
            }
        })
        .collect()
}

fn progress() -> Progress {
    Progress {
        data_position: 4242,
        epoch: 3,
        rng_state: vec![1, 2, 3, 0xff],
    }
}

fn load_as(dir: &Path, strategy: Strategy, world: usize, rank: usize) -> ShardState {
    let shard_world = if strategy.shards_optimizer() {
        world
    } else {
        1
    };
    let layout = FlatLayout::new(shard_world, &specs()).unwrap();
    let shard_rank = if shard_world == 1 { 0 } else { rank };
    let (s, p) = load(
        dir,
        &LoadTarget {
            layout: &layout,
            strategy,
            world,
            rank,
            shard_rank,
            optimizer: "adamw",
        },
    )
    .unwrap();
    assert_eq!(p, progress());
    s
}

#[test]
fn reshard_across_world_sizes_and_strategies() {
    let strategies = [
        Strategy::Ddp,
        Strategy::Zero1,
        Strategy::Zero3,
        Strategy::Fsdp(FsdpSharding::ShardGradOp),
    ];
    for from in strategies {
        for from_world in [1, 2, 3, 4] {
            let tmp = tempfile::tempdir().unwrap();
            let dir = save_local(tmp.path(), &states(from, from_world, 7), &progress(), 0).unwrap();
            assert_eq!(latest(tmp.path()).unwrap(), dir);
            verify(&dir).unwrap();
            for to in strategies {
                for to_world in [1, 2, 4] {
                    let want = states(to, to_world, 7);
                    for (rank, want) in want.iter().enumerate() {
                        let got = load_as(&dir, to, to_world, rank);
                        assert_eq!(
                            &got, want,
                            "{from}@{from_world} -> {to}@{to_world} rank {rank}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn export_safetensors_has_full_params() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero3, 4, 1), &progress(), 0).unwrap();
    let out = tmp.path().join("model.safetensors");
    export_safetensors(&dir, &out).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let layout = FlatLayout::new(1, &specs()).unwrap();
    for (u, unit) in layout.units.iter().enumerate() {
        for p in &unit.params {
            let t = st.tensor(&p.name).unwrap();
            assert_eq!(t.shape(), &p.shape[..]);
            assert_eq!(t.dtype(), safetensors::Dtype::F32);
            let vals = format::f32_from_bytes(t.data());
            let want: Vec<f32> = p.range().map(|i| value(u, 0, i)).collect();
            assert_eq!(vals, want, "{}", p.name);
        }
    }
}

#[test]
fn corruption_is_detected_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0).unwrap();
    let shard = dir.join("shard-00001.bin");
    let good = std::fs::read(&shard).unwrap();
    let try_load = || {
        let layout = FlatLayout::new(2, &specs()).unwrap();
        load(
            &dir,
            &LoadTarget {
                layout: &layout,
                strategy: Strategy::Zero2,
                world: 2,
                rank: 1,
                shard_rank: 1,
                optimizer: "adamw",
            },
        )
        .map(|_| ())
    };
    // A flipped data bit.
    let mut bad = good.clone();
    let last = bad.len() - 3;
    bad[last] ^= 0x40;
    std::fs::write(&shard, &bad).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(
        e.contains("shard-00001.bin") && e.contains("checksum mismatch"),
        "{e}"
    );
    assert!(verify(&dir).is_err());
    // Truncated.
    std::fs::write(&shard, &good[..good.len() - 100]).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(
        e.contains("shard-00001.bin") && e.contains("truncated"),
        "{e}"
    );
    // Bad magic.
    let mut bad = good.clone();
    bad[0] = b'X';
    std::fs::write(&shard, &bad).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("bad magic"), "{e}");
    // A damaged header.
    let mut bad = good.clone();
    bad[20] ^= 1;
    std::fs::write(&shard, &bad).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("header checksum"), "{e}");
    // Missing file.
    std::fs::remove_file(&shard).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("shard-00001.bin") && e.contains("open"), "{e}");
    // A FIFO in its place is named, not waited on forever.
    assert!(std::process::Command::new("mkfifo").arg(&shard).status().unwrap().success());
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("shard-00001.bin") && e.contains("not a regular file"), "{e}");
    std::fs::remove_file(&shard).unwrap();
    std::fs::write(&shard, &good).unwrap();
    try_load().unwrap();
    // metadata.json carries its own checksum: one changed digit is caught.
    let meta_bytes = std::fs::read(dir.join(METADATA)).unwrap();
    let mut meta: serde_json::Value = serde_json::from_slice(&meta_bytes).unwrap();
    assert!(meta["checksum"].is_u64(), "{meta}");
    let mut edited = meta.clone();
    edited["data_position"] = serde_json::json!(edited["data_position"].as_u64().unwrap() + 1);
    std::fs::write(dir.join(METADATA), serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("metadata.json") && e.contains("checksum mismatch"), "{e}");
    // Without a checksum (an older checkpoint) it is read as before; a shard file name that
    // leads out of the checkpoint is refused, and so is a loss scale that is no scale.
    meta.as_object_mut().unwrap().remove("checksum");
    let mut edited = meta.clone();
    edited["files"][1]["name"] = serde_json::json!("../shard-00001.bin");
    std::fs::write(dir.join(METADATA), serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("file 1 is named \"../shard-00001.bin\", expected \"shard-00001.bin\""), "{e}");
    let mut edited = meta.clone();
    edited["loss_scale"] = serde_json::json!(-1.0);
    std::fs::write(dir.join(METADATA), serde_json::to_vec_pretty(&edited).unwrap()).unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("loss_scale -1, expected a finite number above 0"), "{e}");
    std::fs::write(dir.join(METADATA), serde_json::to_vec_pretty(&meta).unwrap()).unwrap();
    try_load().unwrap();
    // Broken metadata.
    std::fs::write(dir.join(METADATA), b"{\"format_version\": 1").unwrap();
    let e = try_load().unwrap_err().to_string();
    assert!(e.contains("metadata.json"), "{e}");
}

#[test]
fn mismatched_model_or_optimizer_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero1, 2, 5), &progress(), 0).unwrap();
    let mut other = specs();
    other[1].params[0].1 = vec![4, 5];
    let layout = FlatLayout::new(2, &other).unwrap();
    let target = LoadTarget {
        layout: &layout,
        strategy: Strategy::Zero1,
        world: 2,
        rank: 0,
        shard_rank: 0,
        optimizer: "adamw",
    };
    let e = load(&dir, &target).unwrap_err().to_string();
    assert!(e.contains("does not match") && e.contains("\"w\""), "{e}");
    let layout = FlatLayout::new(2, &specs()).unwrap();
    let e = load(
        &dir,
        &LoadTarget {
            layout: &layout,
            optimizer: "sgd",
            ..target
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("optimizer"), "{e}");
}

#[test]
fn failed_save_keeps_previous_latest() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let first = save_local(root, &states(Strategy::Zero3, 2, 10), &progress(), 0).unwrap();
    // Step 20: only rank 0 writes (rank 1 "crashed"); commit must refuse.
    begin_save(root, 20).unwrap();
    let st = states(Strategy::Zero3, 2, 20);
    save_shard(root, &st[0]).unwrap();
    let e = commit(root, &st[0], &progress(), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("shard-00001.bin"), "{e}");
    assert_eq!(latest(root).unwrap(), first);
    assert_eq!(
        load_as(&first, Strategy::Zero3, 2, 1),
        states(Strategy::Zero3, 2, 10)[1]
    );
    // A retry of the same step succeeds and cleans the leftover.
    let second = save_local(root, &st, &progress(), 0).unwrap();
    assert_eq!(latest(root).unwrap(), second);
    assert!(!root.join("step-000000020.incomplete").exists());
    // Re-saving the same step replaces it; keep_last prunes.
    save_local(root, &st, &progress(), 1).unwrap();
    assert_eq!(committed(root).unwrap().len(), 1);
    assert_eq!(latest(root).unwrap(), second);
    // A dangling pointer falls back to the newest committed checkpoint.
    std::fs::write(root.join(LATEST), "step-000000099\n").unwrap();
    assert_eq!(latest(root).unwrap(), second);
    // A pointer to a checkpoint that lost its metadata is damage, not a reason to go back.
    std::fs::write(root.join(LATEST), "step-000000020\n").unwrap();
    std::fs::remove_file(second.join("metadata.json")).unwrap();
    let e = latest(root).unwrap_err().to_string();
    assert!(e.contains("step-000000020") && e.contains("metadata.json") && e.contains("damaged"), "{e}");
    // A `latest` that is a FIFO is an error, not a wait.
    std::fs::remove_file(root.join(LATEST)).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(root.join(LATEST)).status().unwrap().success());
    let e = latest(root).unwrap_err().to_string();
    assert!(e.contains("latest") && e.contains("not a regular file"), "{e}");
    std::fs::remove_file(root.join(LATEST)).unwrap();
    // A pointer out of the root is damage too, whatever it points at.
    for outside in ["../other/step-000000020", "/tmp", ".."] {
        std::fs::write(root.join(LATEST), format!("{outside}\n")).unwrap();
        let e = latest(root).unwrap_err().to_string();
        assert!(e.contains(&format!("names {outside:?}, expected a checkpoint directory")), "{e}");
    }
}

#[test]
fn only_first_replica_writes() {
    let tmp = tempfile::tempdir().unwrap();
    let ddp = states(Strategy::Ddp, 3, 1);
    begin_save(tmp.path(), 1).unwrap();
    let written: Vec<_> = ddp
        .iter()
        .map(|s| save_shard(tmp.path(), s).unwrap())
        .collect();
    assert!(written[0].is_some() && written[1].is_none() && written[2].is_none());
}

#[test]
fn resaving_a_step_is_whole_at_every_instant() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let old = states(Strategy::Zero2, 2, 20);
    let dir = save_local(root, &old, &progress(), 1).unwrap();
    // The new copy swaps names with the old one in one step: nothing is left beside it.
    let mut new = old.clone();
    for s in &mut new {
        s.master[0][0] += 1.0;
    }
    assert_eq!(save_local(root, &new, &progress(), 1).unwrap(), dir);
    let mut names: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["latest", "step-000000020"]);
    assert_eq!(load_as(&latest(root).unwrap(), Strategy::Zero2, 2, 0), new[0]);
    // Where the file system cannot swap, a crash between the two renames leaves the step
    // under its aside name with `latest` naming it: that copy is loaded, not "no checkpoint".
    let aside = root.join("step-000000020.replaced");
    std::fs::rename(&dir, &aside).unwrap();
    assert_eq!(latest(root).unwrap(), aside);
    assert_eq!(load_as(&aside, Strategy::Zero2, 2, 1), new[1]);
    // And the next save of the step cleans it up.
    save_local(root, &old, &progress(), 1).unwrap();
    assert!(!aside.exists());
    assert_eq!(latest(root).unwrap(), dir);
}

#[test]
fn exchange_swaps_two_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    std::fs::write(a.join("x"), b"1").unwrap();
    // tmpfs, ext4, xfs and btrfs can; elsewhere nothing changes and the caller renames.
    if fsutil::exchange(&a, &b).unwrap() {
        assert!(b.join("x").is_file() && !a.join("x").exists());
    } else {
        assert!(a.join("x").is_file());
    }
    let e = fsutil::exchange(&tmp.path().join("gone"), &b).unwrap_err().to_string();
    assert!(e.contains("gone"), "{e}");
}

#[test]
fn unreadable_latest_is_an_error_not_a_fresh_start() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    assert!(matches!(latest(&root.join("none")), Err(CheckpointError::NotFound(_))));
    assert!(matches!(latest(root), Err(CheckpointError::NotFound(_))));
    save_local(root, &states(Strategy::Ddp, 1, 3), &progress(), 0).unwrap();
    std::fs::remove_file(root.join(LATEST)).unwrap();
    std::fs::create_dir(root.join(LATEST)).unwrap();
    let e = latest(root).unwrap_err();
    assert!(matches!(e, CheckpointError::Io { .. }), "{e}");
    assert!(e.to_string().contains("latest"), "{e}");
    std::fs::remove_dir(root.join(LATEST)).unwrap();
    std::fs::write(root.join(LATEST), [0xff, 0xfe]).unwrap();
    assert!(matches!(latest(root), Err(CheckpointError::Io { .. })));
}

/// Rewrites `metadata.json` of `dir` through `edit`.
/// Edits metadata.json and seals it with a matching checksum (as a hostile or buggy writer
/// could): what the checks behind the checksum see.
fn edit_metadata(dir: &Path, edit: impl FnOnce(&mut Metadata)) {
    let mut meta = read_metadata(dir).unwrap();
    edit(&mut meta);
    meta.checksum = Some(meta.crc());
    std::fs::write(dir.join(METADATA), serde_json::to_vec(&meta).unwrap()).unwrap();
}

#[test]
fn inconsistent_parameter_table_is_named_not_a_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0).unwrap();
    let good = std::fs::read(dir.join(METADATA)).unwrap();
    let out = tmp.path().join("model.safetensors");
    type Edit = fn(&mut Metadata);
    let cases: [(&str, Edit); 9] = [
        ("offset 8, expected 15", |m| m.units[0].params[1].offset = 8),
        ("numel 16 for shape [4, 5]", |m| m.units[1].params[0].shape = vec![4, 5]),
        ("numel 23, its parameters hold 22", |m| m.units[0].numel = 23),
        ("shard_len 9223372036854775808", |m| {
            m.units[0].shard_len = 1 << 63;
            m.units[0].padded_numel = 0;
        }),
        ("numel 1 for shape [18446744073709551615, 2]", |m| {
            m.units[2].params[0].shape = vec![usize::MAX, 2];
            m.units[2].params[0].numel = 1;
        }),
        // Consistent but past what can be addressed once padded to the shards: no overflow panic.
        ("more elements than memory can address", |m| {
            m.units[2].params[0].shape = vec![usize::MAX];
            m.units[2].params[0].numel = usize::MAX;
        }),
        ("state_slots 18446744073709551615: expected at most 8", |m| m.state_slots = usize::MAX),
        // AdamW's bias correction takes the step as an i32: a wrapped one made the weights NaN.
        ("step 2147483648: expected at most 2147483647", |m| m.step = 1 << 31),
        // A whole table that agrees with itself but not with the files' sizes: an export would
        // size a 4 TiB parameter from it.
        ("its units need 6597069766908 bytes of sections in each shard file", |m| {
            let u = &mut m.units[2];
            (u.params[0].shape, u.params[0].numel) = (vec![1 << 40], 1 << 40);
            (u.numel, u.padded_numel, u.shard_len) = (1 << 40, 1 << 40, 1 << 39);
        }),
    ];
    for (want, edit) in cases {
        edit_metadata(&dir, edit);
        for e in [
            export_safetensors(&dir, &out).unwrap_err().to_string(),
            verify(&dir).unwrap_err().to_string(),
        ] {
            assert!(e.contains("metadata.json") && e.contains(want), "{want}: {e}");
        }
        std::fs::write(dir.join(METADATA), &good).unwrap();
    }
    export_safetensors(&dir, &out).unwrap();
    assert!(!out.with_extension("safetensors.tmp").exists());
    // A load refuses it too, before it allocates a tensor per declared slot.
    edit_metadata(&dir, |m| m.state_slots = 1 << 40);
    let layout = FlatLayout::new(2, &specs()).unwrap();
    let target = LoadTarget { layout: &layout, strategy: Strategy::Zero2, world: 2, rank: 0, shard_rank: 0, optimizer: "adamw" };
    let e = load(&dir, &target).unwrap_err().to_string();
    assert!(e.contains("state_slots 1099511627776: expected at most 8"), "{e}");
    std::fs::write(dir.join(METADATA), &good).unwrap();
}

#[test]
fn header_length_is_capped_before_reading() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0).unwrap();
    let shard = dir.join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    let e = verify(&dir).unwrap_err().to_string();
    assert!(e.contains("shard-00000.bin") && e.contains("header length 4294967295"), "{e}");
}

#[test]
fn a_bare_file_name_has_the_current_directory_as_its_parent() {
    fsutil::sync_dir(Path::new("")).unwrap();
    fsutil::sync_dir(Path::new("model.safetensors").parent().unwrap()).unwrap();
}

/// Pruning keeps this run's newest checkpoints: later steps left in the root by another run are
/// neither counted nor deleted.
#[test]
fn pruning_counts_only_steps_up_to_the_one_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    save_local(root, &states(Strategy::Ddp, 1, 900), &progress(), 0).unwrap();
    for step in [100, 200, 300] {
        save_local(root, &states(Strategy::Ddp, 1, step), &progress(), 2).unwrap();
    }
    let steps: Vec<u64> = committed(root).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [200, 300, 900]);
    assert_eq!(latest(root).unwrap(), root.join("step-000000300"));
}

thread_local! {
    /// Makes `discard` fail (as root, permissions cannot).
    pub(super) static FAIL_DISCARD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Once `latest` names the new checkpoint the save has succeeded: a prune that cannot remove an
/// old checkpoint (read-only, a shard still open on NFS) is logged, not a failed save that would
/// stop the run at every save; the old one is out of the way under `step-N.deleting`.
#[test]
fn a_prune_that_fails_does_not_fail_the_save() {
    let tmp = tempfile::tempdir().unwrap();
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 1), &progress(), 1).unwrap();
    FAIL_DISCARD.with(|f| f.set(true));
    let saved = save_local(tmp.path(), &states(Strategy::Zero2, 2, 2), &progress(), 1);
    FAIL_DISCARD.with(|f| f.set(false));
    let dir = saved.expect("the save committed");
    assert_eq!(latest(tmp.path()).unwrap(), dir);
    assert_eq!(committed(tmp.path()).unwrap(), vec![(2, dir)]);
    assert!(tmp.path().join(format!("{}{DELETING}", step_dir_name(1))).is_dir(), "moved out of the way first");
    // The next save sweeps what was left.
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 3), &progress(), 1).unwrap();
    let names: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(DELETING)), "{names:?}");
}

/// A `.replaced` copy is swept once its step is committed again, and kept while `latest`
/// may still need it.
#[test]
fn leftovers_of_interrupted_saves_are_swept() {
    let tmp = tempfile::tempdir().unwrap();
    let two = save_local(tmp.path(), &states(Strategy::Zero2, 2, 2), &progress(), 0).unwrap();
    let mut replaced = two.as_os_str().to_owned();
    replaced.push(".replaced");
    std::fs::create_dir(&replaced).unwrap();
    let orphan = tmp.path().join(format!("{}.replaced", step_dir_name(9)));
    std::fs::create_dir(&orphan).unwrap();
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 3), &progress(), 0).unwrap();
    assert!(!std::path::Path::new(&replaced).exists(), "step 2 is committed: its old copy goes");
    assert!(orphan.is_dir(), "step 9 is not committed: its only copy stays");
    // A save killed mid-write (a preemption) leaves its `.incomplete` directory: the next commit
    // removes it, whatever its step, instead of one full checkpoint more per preemption.
    let killed = incomplete_dir(tmp.path(), 7);
    std::fs::create_dir_all(killed.join("junk")).unwrap();
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 4), &progress(), 0).unwrap();
    assert!(!killed.exists(), "an interrupted save's directory stays");
    // A crash between a re-save's two renames left step 4 only as `step-4.replaced`, and the run
    // went on from it: the next commit gives it its name back, a checkpoint like any other
    // (kept, loadable, and pruned in its turn), not a copy on disk forever.
    let four = tmp.path().join(step_dir_name(4));
    let aside = tmp.path().join(format!("{}.replaced", step_dir_name(4)));
    std::fs::rename(&four, &aside).unwrap();
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 6), &progress(), 0).unwrap();
    assert!(!aside.exists() && four.join(METADATA).is_file(), "step 4 is not back under its name");
    assert_eq!(load_as(&four, Strategy::Zero2, 2, 1), states(Strategy::Zero2, 2, 4)[1]);
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 8), &progress(), 2).unwrap();
    assert!(!four.exists(), "step 4 is past keep_last 2 (6 and 8 are kept)");
}

/// Rank 0 commits only shards that a load will accept: one saved with another number of
/// optimizer state slots (or another layout) is refused before `latest` moves, so older
/// checkpoints are not pruned in favour of one that can never load.
#[test]
fn a_commit_refuses_shards_that_no_load_accepts() {
    let tmp = tempfile::tempdir().unwrap();
    let good = save_local(tmp.path(), &states(Strategy::Zero2, 2, 3), &progress(), 1).unwrap();
    let mut mixed = states(Strategy::Zero2, 2, 5);
    for s in &mut mixed[1].state {
        s.truncate(1);
    }
    let e = save_local(tmp.path(), &mixed, &progress(), 1).unwrap_err().to_string();
    assert!(
        e.contains("shard-00001.bin") && e.contains("do not match the layout's 3 units and 2 slots"),
        "{e}"
    );
    assert_eq!(latest(tmp.path()).unwrap(), good);
    assert!(good.join(METADATA).is_file(), "the good checkpoint was pruned");
}

/// A nested checkpoint root is created with every level, and usable at once.
#[test]
fn a_nested_root_is_created_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("run7").join("ckpts");
    let dir = save_local(&root, &states(Strategy::Zero2, 2, 3), &progress(), 0).unwrap();
    assert_eq!(latest(&root).unwrap(), dir);
}

/// Re-saving a step whose old copy cannot be removed (a shard still open on NFS) still commits:
/// the leftovers are set aside under names of their own and swept later.
#[test]
fn a_resave_whose_old_copy_cannot_be_removed_still_commits() {
    let tmp = tempfile::tempdir().unwrap();
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0).unwrap();
    std::fs::create_dir_all(incomplete_dir(tmp.path(), 5).join("old")).unwrap();
    FAIL_DISCARD.with(|f| f.set(true));
    let first = save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0);
    let second = save_local(tmp.path(), &states(Strategy::Zero2, 2, 5), &progress(), 0);
    FAIL_DISCARD.with(|f| f.set(false));
    let dir = second.expect("the second re-save committed");
    assert_eq!(first.expect("the first re-save committed"), dir);
    assert_eq!(latest(tmp.path()).unwrap(), dir);
    save_local(tmp.path(), &states(Strategy::Zero2, 2, 6), &progress(), 0).unwrap();
    let names: Vec<String> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(DELETING) || n.ends_with(".incomplete")), "{names:?}");
}

/// A rank loads only the shard files its own shard overlaps, one open at a time: at world 1,024 a
/// rank reads one or two files, not 1,024 headers with as many descriptors held open. A file it
/// does not need can be missing for it; the rank that needs it names it.
#[test]
fn a_load_reads_only_the_shards_it_overlaps() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero3, 4, 7), &progress(), 0).unwrap();
    std::fs::remove_file(dir.join(shard_file_name(3))).unwrap();
    for rank in 0..3 {
        assert_eq!(load_as(&dir, Strategy::Zero3, 4, rank), states(Strategy::Zero3, 4, 7)[rank], "rank {rank}");
    }
    let layout = FlatLayout::new(4, &specs()).unwrap();
    let target = LoadTarget { layout: &layout, strategy: Strategy::Zero3, world: 4, rank: 3, shard_rank: 3, optimizer: "adamw" };
    let e = load(&dir, &target).unwrap_err().to_string();
    assert!(e.contains(&shard_file_name(3)), "{e}");
    // Checks and exports that need every file still find it missing.
    assert!(verify(&dir).unwrap_err().to_string().contains(&shard_file_name(3)));
}

/// A shard is written from its units one at a time, in order, each taken when it is written:
/// the bytes match a write from the whole state, and an error from a unit removes the temp file.
#[test]
fn shard_is_written_a_unit_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let st = states(Strategy::Zero3, 2, 4);
    let whole = save_local(tmp.path(), &st, &progress(), 0).unwrap();
    let streamed = tempfile::tempdir().unwrap();
    begin_save(streamed.path(), 4).unwrap();
    for s in &st {
        let mut asked = Vec::new();
        let path = write_shard_with(streamed.path(), &s.info(), |u| {
            asked.push(u);
            Ok::<_, CheckpointError>((Cow::Owned(s.master[u].clone()), s.state[u].iter().map(|v| Cow::Owned(v.clone())).collect()))
        })
        .unwrap();
        assert_eq!(asked, vec![0, 1, 2]);
        let name = path.file_name().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(whole.join(name)).unwrap(), "{name:?}");
    }
    commit_info(streamed.path(), &st[0].info(), &progress(), 0).unwrap();
    verify(&streamed.path().join(step_dir_name(4))).unwrap();
    assert!(load_as(&streamed.path().join(step_dir_name(4)), Strategy::Zero3, 2, 1) == st[1]);

    // The unit source fails at unit 1: its error comes back, and no temp file stays.
    begin_save(streamed.path(), 5).unwrap();
    let err = write_shard_with(streamed.path(), &states(Strategy::Zero3, 2, 5)[0].info(), |u| {
        if u == 1 {
            return Err(CheckpointError::InvalidArgument("tier read failed".into()));
        }
        Ok((Cow::Owned(st[0].master[u].clone()), st[0].state[u].iter().map(|v| Cow::Owned(v.clone())).collect()))
    })
    .unwrap_err();
    assert!(err.to_string().contains("tier read failed"), "{err}");
    // A unit of the wrong length is refused, naming it.
    let err = write_shard_with(streamed.path(), &states(Strategy::Zero3, 2, 5)[0].info(), |u| {
        Ok::<_, CheckpointError>((Cow::Owned(vec![0.0; 1]), st[0].state[u].iter().map(|v| Cow::Owned(v.clone())).collect()))
    })
    .unwrap_err();
    assert!(err.to_string().contains("unit \"embed\""), "{err}");
    let inc = streamed.path().join(format!("{}.incomplete", step_dir_name(5)));
    assert_eq!(std::fs::read_dir(&inc).unwrap().count(), 0, "temp files left in {}", inc.display());
}

/// Loading a batch of units at a time reads what loading the whole shard does, in any batching.
#[test]
fn shard_loads_in_batches_of_units() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = save_local(tmp.path(), &states(Strategy::Zero1, 2, 5), &progress(), 0).unwrap();
    for (world, rank) in [(1, 0), (3, 2), (4, 1)] {
        let layout = FlatLayout::new(world, &specs()).unwrap();
        let target = LoadTarget { layout: &layout, strategy: Strategy::Zero3, world, rank, shard_rank: rank, optimizer: "adamw" };
        let l = ShardLoad::open(&dir, &target).unwrap();
        // (Not `batches()`: an engine test lowers its budget for the whole test binary.)
        assert_eq!(l.batches_within(LOAD_BATCH_BYTES), vec![0..3], "a small shard is one batch");
        assert_eq!(l.batches_within(1), vec![0..1, 1..2, 2..3], "a unit bigger than the budget is a batch of its own");
        let (whole, _) = load(&dir, &target).unwrap();
        for b in [0..1, 1..3, 2..3, 3..3] {
            let got = l.read_units(b.clone()).unwrap();
            for (ui, (m, st)) in b.zip(got) {
                assert!(m == whole.master[ui] && st == whole.state[ui], "unit {ui} at {rank}/{world}");
            }
        }
        assert!(l.read_units(2..4).unwrap_err().to_string().contains("units 2..4: the layout has 3"));
        assert_eq!((l.step(), l.progress(), l.state_slots(), l.loss_scale()), (5, &progress(), 2, Some(1024.0)));
    }
}
