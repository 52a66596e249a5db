//! A full disk (a 1 MiB tmpfs mounted by the test, as root) gives clear errors naming the
//! path, for checkpoints and NVMe offload, and leaves the previous checkpoint loadable.
//! Skipped with a message where mounting is not permitted.

use std::path::{Path, PathBuf};
use std::process::Command;

use rsrun_training_engine::checkpoint::{self, LoadTarget};
use rsrun_training_engine::layout::{FlatLayout, Strategy};
use rsrun_training_engine::offload::{NvmeConfig, NvmeStore};

use crate::support::{progress, specs, states};

/// A tmpfs mounted for the test; unmounted (lazily if busy) on drop.
struct Tmpfs {
    dir: PathBuf,
    _holder: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let holder = tempfile::tempdir().ok()?;
        let dir = holder.path().join("mnt");
        std::fs::create_dir(&dir).ok()?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .ok()?;
        if !out.status.success() {
            eprintln!(
                "skipping ENOSPC test: cannot mount tmpfs ({})",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            return None;
        }
        Some(Tmpfs {
            dir,
            _holder: holder,
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// Fills the file system holding `dir` with one file; returns its path.
fn fill(dir: &Path) -> PathBuf {
    use std::os::fd::AsRawFd;
    let path = dir.join("filler");
    let f = std::fs::File::create(&path).unwrap();
    let mut len: i64 = 0;
    let mut chunk: i64 = 1 << 20;
    while chunk >= 4096 {
        // SAFETY: plain syscall on an open fd.
        let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, len, chunk) };
        if rc == 0 {
            len += chunk;
        } else {
            chunk /= 2;
        }
    }
    path
}

#[test]
fn full_disk_gives_clear_errors_and_keeps_old_checkpoint() {
    let Some(fs) = Tmpfs::mount("1M") else {
        return;
    };
    let root = fs.dir.join("ckpt");
    // ~90 KiB per save at this scale.
    let scale = 300;
    let first = checkpoint::save_local(
        &root,
        &states(Strategy::Zero2, 2, 1, scale),
        &progress(1),
        0,
    )
    .unwrap();
    let filler = fill(&fs.dir);

    let err = checkpoint::save_local(
        &root,
        &states(Strategy::Zero2, 2, 2, scale),
        &progress(2),
        0,
    )
    .unwrap_err();
    let msg = err.to_string();
    eprintln!("checkpoint on a full disk: {msg}");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{msg}");
    assert!(
        msg.contains(fs.dir.to_str().unwrap()) && msg.contains("shard-0000"),
        "{msg}"
    );
    assert_eq!(checkpoint::latest(&root).unwrap(), first);
    checkpoint::verify(&first).unwrap();
    let layout = FlatLayout::new(1, &specs(scale)).unwrap();
    let (got, _) = checkpoint::load(
        &first,
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
    assert_eq!(got, states(Strategy::Ddp, 1, 1, scale)[0]);

    // NVMe offload on the full disk: a clear error at creation, no file left behind.
    let mut cfg = NvmeConfig::new(&fs.dir, "rank-00000.swap");
    cfg.sub_group_elems = 1 << 16;
    let err = NvmeStore::new(&[1 << 18], 2, &cfg).unwrap_err();
    let msg = err.to_string();
    eprintln!("nvme offload on a full disk: {msg}");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{msg}");
    assert!(msg.contains("rank-00000.swap"), "{msg}");
    assert!(!fs.dir.join("rank-00000.swap").exists());

    // Space back: the save succeeds and moves `latest`.
    std::fs::remove_file(filler).unwrap();
    let second = checkpoint::save_local(
        &root,
        &states(Strategy::Zero2, 2, 2, scale),
        &progress(2),
        0,
    )
    .unwrap();
    assert_eq!(checkpoint::latest(&root).unwrap(), second);
}
