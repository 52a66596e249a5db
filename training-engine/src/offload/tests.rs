use std::sync::Arc;
use std::time::{Duration, Instant};

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
    let ro = Arc::new(std::fs::File::open(&path).unwrap());
    for engine in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let eng = engine::IoEngine::start(Some(engine), 4096, 2, Duration::from_secs(60)).unwrap();
        let job = job_on(&path, &ro, AlignedBuf::zeroed(2048).unwrap(), 0, 8192);
        let (result, lease) = eng.submit(job).wait();
        let err = result.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF), "{err}");
        assert!(err.to_string().contains("ro.bin"), "{err}");
        assert!(lease.is_some(), "a failed job that is done hands its buffer back");
    }
}

/// A job writing `len` bytes from the start of `buf` at `offset` of `file`.
fn job_on(path: &std::path::Path, file: &Arc<std::fs::File>, buf: AlignedBuf, offset: u64, len: usize) -> engine::Job {
    engine::Job {
        phases: vec![vec![engine::Span { offset, at: 0, len, dir: engine::Dir::Write }]],
        path: path.to_path_buf().into(),
        lease: engine::Lease { buf, file: file.clone() },
    }
}

/// A buffer of `elems` elements, all `value`.
fn buf_of(elems: usize, value: f32) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(elems).unwrap();
    buf.fill(value);
    buf
}

/// Polls `cond` until it holds; fails the test after 20 s.
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "still not {what} after 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A new plain (buffered) file for the engine tests to write.
fn new_file(path: &std::path::Path) -> Arc<std::fs::File> {
    Arc::new(std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(path).unwrap())
}

/// A job whose request the device does not answer: the wait gives up after the timeout with an
/// error naming the file, the offset, the requests pending and the timeout; the job keeps its
/// buffer and file while the request is in flight (the late write still carries the buffer's
/// bytes, and only then are they let go), and the engine is poisoned: later jobs fail at once,
/// saying why. Dropping the engine does not hang.
#[test]
fn a_stalled_job_times_out_keeps_its_buffer_lent_and_poisons_the_engine() {
    let dir = tempfile::tempdir().unwrap();
    for kind in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let path = dir.path().join(format!("stuck-{kind:?}.bin"));
        let file = new_file(&path);
        // One request per job (the block is larger than the job).
        let eng = engine::IoEngine::start(Some(kind), 1 << 20, 2, Duration::from_millis(200)).unwrap();
        eng.hold(true);
        let ticket = eng.submit(job_on(&path, &file, buf_of(2048, 7.5), 4096, 8192));
        wait_until("held", || eng.held() == 1);
        let t0 = Instant::now();
        let (result, lease) = ticket.wait();
        let waited = t0.elapsed();
        let err = result.unwrap_err();
        assert!(matches!(err, OffloadError::TimedOut { offset: 4096, pending: 1, .. }), "{err}");
        let msg = err.to_string();
        for part in [
            format!("offload write of {}", path.display()),
            "at offset 4096".into(),
            "timed out after 200ms".into(),
            "1 request(s) still pending".into(),
        ] {
            assert!(msg.contains(&part), "{part:?} not in {msg}");
        }
        assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(5), "{waited:?}");
        assert!(lease.is_none(), "{kind:?}: the buffer stays lent to the request in flight");
        assert_eq!(Arc::strong_count(&file), 2, "{kind:?}: the job still holds its lease");
        assert!(eng.poisoned().is_some_and(|why| why == msg), "{:?}", eng.poisoned());

        // Poisoned: a later job fails at once, saying why, and its buffer comes back.
        let t0 = Instant::now();
        let (result, lease) = eng.submit(job_on(&path, &file, buf_of(1024, 1.0), 0, 4096)).wait();
        let err = result.unwrap_err();
        assert!(matches!(err, OffloadError::Poisoned { .. }), "{err}");
        let poisoned = err.to_string();
        assert!(poisoned.contains("is unusable") && poisoned.contains(&msg), "{poisoned}");
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert!(lease.is_some(), "nothing was issued: the buffer comes back");
        drop(lease);

        // The device answers late: the write goes out of the buffer the job still owns, and
        // only then does the job let go of its lease.
        eng.hold(false);
        wait_until("let go of", || Arc::strong_count(&file) == 1);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 4096 + 8192, "{kind:?}");
        assert!(bytes[..4096].iter().all(|&b| b == 0), "{kind:?}: nothing else was written");
        assert!(
            bytes[4096..].chunks_exact(4).all(|c| c == 7.5f32.to_ne_bytes()),
            "{kind:?}: the late write carried the held buffer's bytes"
        );
        let t0 = Instant::now();
        drop(eng);
        assert!(t0.elapsed() < Duration::from_secs(5), "dropping the engine took {:?}", t0.elapsed());
    }
}

/// Dropping a ticket whose request is in flight returns at once, and the job keeps its buffer
/// until the request completes (it is no timeout: the engine is not poisoned).
#[test]
fn a_dropped_ticket_does_not_wait_and_its_job_keeps_the_buffer() {
    let dir = tempfile::tempdir().unwrap();
    for kind in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let path = dir.path().join(format!("dropped-{kind:?}.bin"));
        let file = new_file(&path);
        let eng = engine::IoEngine::start(Some(kind), 1 << 20, 2, Duration::from_secs(60)).unwrap();
        eng.hold(true);
        let ticket = eng.submit(job_on(&path, &file, buf_of(1024, 3.25), 0, 4096));
        wait_until("held", || eng.held() == 1);
        let t0 = Instant::now();
        drop(ticket);
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert_eq!(Arc::strong_count(&file), 2, "{kind:?}: the job still holds its lease");
        eng.hold(false);
        wait_until("let go of", || Arc::strong_count(&file) == 1);
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() == 4096 && bytes.chunks_exact(4).all(|c| c == 3.25f32.to_ne_bytes()), "{kind:?}");
        assert!(eng.poisoned().is_none());
        // The engine goes on.
        let (result, lease) = eng.submit(job_on(&path, &file, buf_of(1024, 1.0), 4096, 4096)).wait();
        result.unwrap();
        assert!(lease.is_some());
    }
}

/// A span outside the job's buffer is refused before anything is issued.
#[test]
fn a_span_outside_its_buffer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("span.bin");
    let file = new_file(&path);
    let eng = engine::IoEngine::start(Some(EngineKind::ThreadPool), 4096, 2, Duration::from_secs(60)).unwrap();
    for (at, len) in [(0, 8192), (4096, 1), (usize::MAX, 2)] {
        let mut job = job_on(&path, &file, AlignedBuf::zeroed(1024).unwrap(), 0, len);
        job.phases[0][0].at = at;
        let (result, lease) = eng.submit(job).wait();
        let err = result.unwrap_err();
        assert!(matches!(err, OffloadError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("4096-byte buffer"), "{err}");
        assert!(lease.is_some());
    }
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 0, "nothing written");
}

/// The NVMe tier on a device that stops answering: the update fails within `io_timeout` with
/// the timeout error, and every later operation fails at once saying why (the swap file may be
/// half written); the store drops without hanging once the device answers again.
#[test]
fn a_stalled_device_fails_the_update_in_time_and_poisons_the_tier() {
    let lens = [4096usize, 2048];
    let dir = tempfile::tempdir().unwrap();
    for kind in [EngineKind::IoUring, EngineKind::ThreadPool] {
        let mut cfg = NvmeConfig::new(dir.path(), format!("stall-{kind:?}.swap"));
        cfg.sub_group_elems = 1024;
        cfg.engine = Some(kind);
        cfg.io_timeout = Duration::from_millis(200);
        let mut nvme = NvmeStore::new(&lens, 2, &cfg).unwrap();
        filled(&mut nvme, &lens);
        nvme.engine().hold(true);
        let t0 = Instant::now();
        let err = nvme.update_unit(0, &mut |_| Ok(())).unwrap_err().to_string();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        assert!(
            err.contains("offload read of") && err.contains(&format!("stall-{kind:?}.swap")) && err.contains("timed out after 200ms"),
            "{err}"
        );
        let t0 = Instant::now();
        let zeros = vec![0.0f32; 2048];
        let errors = [
            nvme.update_unit(1, &mut |_| Ok(())).unwrap_err(),
            nvme.read_unit(0).unwrap_err(),
            nvme.write_unit(1, &zeros, &[zeros.clone(), zeros.clone()]).unwrap_err(),
            nvme.init_unit(1, &zeros, 2).unwrap_err(),
            nvme.prefetch(1).unwrap_err(),
        ];
        for e in errors {
            let msg = e.to_string();
            assert!(msg.contains("is unusable") && msg.contains("timed out after 200ms"), "{msg}");
        }
        assert!(t0.elapsed() < Duration::from_secs(1), "later operations fail fast: {:?}", t0.elapsed());
        nvme.engine().hold(false);
        let t0 = Instant::now();
        drop(nvme);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}

/// `io_timeout` is validated: zero and more than a day are refused, naming the value, before
/// anything is created; the default is 300 s.
#[test]
fn io_timeout_is_validated() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = NvmeConfig::new(dir.path(), "t.swap");
    assert_eq!(cfg.io_timeout, Duration::from_secs(300));
    assert_eq!(cfg.io_timeout, DEFAULT_IO_TIMEOUT);
    for (bad, shown) in [
        (Duration::ZERO, "io_timeout 0ns"),
        (Duration::from_secs(86_401), "io_timeout 86401s"),
        (Duration::MAX, "io_timeout 18446744073709551615"),
    ] {
        cfg.io_timeout = bad;
        let err = NvmeStore::new(&[10], 2, &cfg).unwrap_err();
        assert!(matches!(err, OffloadError::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains(shown) && err.to_string().contains("expected from 1ms to 86400s"), "{err}");
        assert!(cfg.validate().is_err());
        let Err(err) = engine::IoEngine::start(None, 4096, 2, bad) else { panic!("{bad:?} accepted") };
        assert!(err.to_string().contains(shown), "{err}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing created");
    for good in [MIN_IO_TIMEOUT, Duration::from_millis(200), MAX_IO_TIMEOUT] {
        cfg.io_timeout = good;
        cfg.validate().unwrap();
        drop(NvmeStore::new(&[10], 2, &cfg).unwrap());
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
