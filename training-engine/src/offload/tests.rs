use super::*;
use crate::error::EngineError;
use crate::layout::{OptimStateStore, StepParams, TileOptimizer};

fn grads(lens: &[usize], step: u64) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(u, &n)| {
            (0..n)
                .map(|i| (((i * 7 + u * 13 + step as usize * 5) % 23) as f32 - 11.0) * 1e-2)
                .collect()
        })
        .collect()
}

fn init(lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(u, &n)| {
            (0..n)
                .map(|i| ((i + 3 * u) % 17) as f32 * 0.1 - 0.8)
                .collect()
        })
        .collect()
}

fn adam_steps(store: &mut dyn OptimStateStore, lens: &[usize], from: u64, to: u64) {
    let opt = crate::optim::AdamW::default();
    for s in from..=to {
        let g = grads(lens, s);
        let p = StepParams {
            step: s,
            lr: 1e-3,
            grad_scale: 1.0,
        };
        for (u, gu) in g.iter().enumerate() {
            store
                .update_unit(u, &mut |t| {
                    let n = t.master.len();
                    opt.step_tile(&p, t.master, &gu[t.offset..t.offset + n], t.state);
                    Ok(())
                })
                .unwrap();
        }
    }
}

fn snapshot(store: &mut dyn OptimStateStore, n_units: usize) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for u in 0..n_units {
        let (m, st) = store.read_unit(u).unwrap();
        out.push(m.iter().map(|x| x.to_bits()).collect());
        for s in st {
            out.push(s.iter().map(|x| x.to_bits()).collect());
        }
    }
    out
}

fn filled(store: &mut dyn OptimStateStore, lens: &[usize]) {
    for (u, m) in init(lens).iter().enumerate() {
        store.init_unit(u, m, 2).unwrap();
    }
}

#[test]
fn tiles_cover_units_without_crossing() {
    let t = tile_specs(&[5, 0, 3], 2);
    let got: Vec<_> = t.iter().map(|t| (t.unit, t.start, t.len)).collect();
    assert_eq!(
        got,
        vec![(0, 0, 2), (0, 2, 2), (0, 4, 1), (2, 0, 2), (2, 2, 1)]
    );
}

#[test]
fn aligned_buf_is_page_aligned_and_padded() {
    let mut b = AlignedBuf::zeroed(1025).unwrap();
    assert_eq!(b.as_mut_ptr() as usize % ALIGN, 0);
    assert_eq!(b.capacity_bytes(), 8192);
    assert!(b.iter().all(|&x| x == 0.0));
    let e = AlignedBuf::zeroed(0).unwrap();
    assert_eq!(e.capacity_bytes(), ALIGN);
}

/// Memory that is not there (here 4 EiB, a valid layout no machine has) is an error the rank
/// reports, not an abort of the process.
#[test]
fn an_allocation_the_host_cannot_give_is_an_error() {
    let Err(e) = AlignedBuf::zeroed(1 << 60) else { panic!("no host has 4 EiB") };
    assert!(matches!(e, OffloadError::Alloc { bytes } if bytes == 1 << 62), "{e}");
    assert!(AlignedBuf::zeroed(usize::MAX / 2).is_err(), "past the address space");
}

#[test]
fn nvme_matches_cpu_bitwise_for_every_engine_and_buffer_count() {
    let lens = [3000usize, 0, 1029, 4096];
    let mut cpu = CpuStore::new(&lens, 2, 1000).unwrap();
    filled(&mut cpu, &lens);
    adam_steps(&mut cpu, &lens, 1, 4);
    let want = snapshot(&mut cpu, lens.len());
    let dir = tempfile::tempdir().unwrap();
    for engine in [EngineKind::IoUring, EngineKind::ThreadPool] {
        for buffer_count in [1, 2, 3] {
            let mut cfg = NvmeConfig::new(dir.path(), format!("s-{engine:?}-{buffer_count}"));
            cfg.sub_group_elems = 1000;
            cfg.block_size = 4096;
            cfg.queue_depth = 4;
            cfg.buffer_count = buffer_count;
            cfg.engine = Some(engine);
            let mut nvme = NvmeStore::new(&lens, 2, &cfg).unwrap();
            assert_eq!(nvme.engine_kind(), engine);
            assert!(nvme.is_direct(), "ext4/tmpfs support O_DIRECT");
            filled(&mut nvme, &lens);
            adam_steps(&mut nvme, &lens, 1, 2);
            nvme.prefetch(3).unwrap();
            adam_steps(&mut nvme, &lens, 3, 4);
            assert_eq!(
                snapshot(&mut nvme, lens.len()),
                want,
                "{engine:?} buffers {buffer_count}"
            );
            let st = nvme.stats();
            assert_eq!(st.unit_updates, 16);
            assert!(st.bytes_read > 0 && st.bytes_written > 0);
            // Unlinked while open: nothing is left behind however the process ends.
            assert!(!nvme.path().exists(), "swap file unlinked at once");
            assert!(nvme.file().metadata().unwrap().len() > 0);
        }
    }
}

#[test]
fn failed_step_leaves_previous_state() {
    let lens = [5000usize, 700];
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NvmeConfig::new(dir.path(), "fail.swap");
    cfg.sub_group_elems = 1024;
    let mut nvme = NvmeStore::new(&lens, 2, &cfg).unwrap();
    filled(&mut nvme, &lens);
    adam_steps(&mut nvme, &lens, 1, 1);
    let before = snapshot(&mut nvme, lens.len());
    let err = nvme
        .update_unit(0, &mut |t| {
            t.master.fill(1e9);
            if t.offset == 3072 {
                return Err(EngineError::Offload("injected at tile 3".into()));
            }
            Ok(())
        })
        .unwrap_err();
    assert!(err.to_string().contains("tile 3"), "{err}");
    assert_eq!(snapshot(&mut nvme, lens.len()), before);
    // The store keeps working, and a retried step equals the uninterrupted run.
    adam_steps(&mut nvme, &lens, 2, 2);
    let mut cpu = CpuStore::new(&lens, 2, 1024).unwrap();
    filled(&mut cpu, &lens);
    adam_steps(&mut cpu, &lens, 1, 2);
    assert_eq!(
        snapshot(&mut nvme, lens.len()),
        snapshot(&mut cpu, lens.len())
    );
}

#[test]
fn truncated_swap_file_is_an_error_naming_the_file() {
    let lens = [8192usize];
    let dir = tempfile::tempdir().unwrap();
    for engine in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let mut cfg = NvmeConfig::new(dir.path(), "trunc.swap");
        cfg.sub_group_elems = 2048;
        cfg.engine = Some(engine);
        let mut nvme = NvmeStore::new(&lens, 2, &cfg).unwrap();
        nvme.file().set_len(4096).unwrap();
        let err = nvme.update_unit(0, &mut |_| Ok(())).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("trunc.swap") && msg.contains("read"), "{msg}");
        // The store reports the same failure again rather than panicking.
        assert!(nvme.update_unit(0, &mut |_| Ok(())).is_err());
    }
}

#[test]
fn bad_fd_write_error_is_reported_by_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.bin");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let ro = std::fs::File::open(&path).unwrap();
    for engine in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let eng = engine::IoEngine::start(Some(engine), 4096, 2).unwrap();
        let mut buf = AlignedBuf::zeroed(2048).unwrap();
        let job = engine::Job {
            phases: vec![vec![engine::IoReq {
                fd: std::os::fd::AsRawFd::as_raw_fd(&ro),
                offset: 0,
                ptr: buf.as_mut_ptr(),
                len: 8192,
                dir: engine::Dir::Write,
            }]],
            path: path.clone().into(),
        };
        // SAFETY: buf and ro outlive the wait.
        let err = unsafe { eng.submit(job) }.wait().unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
        assert!(err.to_string().contains("ro.bin"), "{err}");
    }
}

/// The swap file is always a new one: a file of the same name (another job's, in the same
/// directory) is not truncated, a symlink planted at the name is not written through, and the
/// tier still starts under another name, leaving both as they were.
#[test]
fn the_swap_file_never_takes_over_an_existing_name() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = NvmeConfig::new(dir.path(), "x.swap");
    let sentinel = dir.path().join("sentinel");
    std::fs::write(&sentinel, b"keep me").unwrap();
    std::os::unix::fs::symlink(&sentinel, dir.path().join("x.swap")).unwrap();
    let mut nvme = NvmeStore::new(&[10], 2, &cfg).unwrap();
    nvme.init_unit(0, &[1.0; 10], 2).unwrap();
    drop(nvme);
    assert_eq!(std::fs::read(&sentinel).unwrap(), b"keep me");
    assert!(std::fs::symlink_metadata(dir.path().join("x.swap")).unwrap().file_type().is_symlink());
    std::fs::remove_file(dir.path().join("x.swap")).unwrap();
    std::fs::write(dir.path().join("x.swap"), b"another job's").unwrap();
    drop(NvmeStore::new(&[10], 2, &cfg).unwrap());
    assert_eq!(std::fs::read(dir.path().join("x.swap")).unwrap(), b"another job's");
    // Nothing of ours is left behind (the file was unlinked once open).
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn invalid_arguments_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NvmeConfig::new(dir.path(), "x.swap");
    for bad in [1000usize, 0, 4 << 30] {
        cfg.block_size = bad;
        let err = NvmeStore::new(&[10], 2, &cfg).unwrap_err();
        assert!(matches!(err, OffloadError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(&bad.to_string()), "{err}");
    }
    cfg.block_size = 1 << 20;
    cfg.queue_depth = 100_000;
    let err = NvmeStore::new(&[10], 2, &cfg).unwrap_err().to_string();
    assert!(err.contains("queue_depth 100000: expected at most 4096"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing created");
    let mut cpu = CpuStore::new(&[10], 2, 4).unwrap();
    assert!(cpu.init_unit(1, &[0.0; 10], 2).is_err());
    assert!(cpu.init_unit(0, &[0.0; 9], 2).is_err());
    assert!(cpu.init_unit(0, &[0.0; 10], 1).is_err());
    let missing = NvmeConfig::new(dir.path().join("no/such/dir"), "x.swap");
    let err = NvmeStore::new(&[10], 2, &missing).unwrap_err();
    assert!(err.to_string().contains("no/such/dir"), "{err}");
}

#[test]
fn descending_and_random_unit_order_match_cpu() {
    let lens = [2000usize, 3000, 0, 1500];
    let opt = crate::optim::AdamW::default();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NvmeConfig::new(dir.path(), "order.swap");
    cfg.sub_group_elems = 512;
    let mut nvme = NvmeStore::new(&lens, 2, &cfg).unwrap();
    let mut cpu = CpuStore::new(&lens, 2, 512).unwrap();
    filled(&mut nvme, &lens);
    filled(&mut cpu, &lens);
    let orders: [&[usize]; 3] = [&[3, 2, 1, 0], &[3, 2, 1, 0], &[1, 3, 0, 2]];
    for (i, order) in orders.iter().enumerate() {
        let s = i as u64 + 1;
        let g = grads(&lens, s);
        let p = StepParams {
            step: s,
            lr: 1e-3,
            grad_scale: 1.0,
        };
        for store in [&mut nvme as &mut dyn OptimStateStore, &mut cpu] {
            for &u in order.iter() {
                store
                    .update_unit(u, &mut |t| {
                        let n = t.master.len();
                        opt.step_tile(&p, t.master, &g[u][t.offset..t.offset + n], t.state);
                        Ok(())
                    })
                    .unwrap();
            }
        }
    }
    assert_eq!(
        snapshot(&mut nvme, lens.len()),
        snapshot(&mut cpu, lens.len())
    );
}
