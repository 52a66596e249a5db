//! Shared-memory backend for ranks on one host.
//!
//! One segment per group, created by group rank 0 in `/dev/shm` (unlinked as soon as every
//! rank has mapped it). Layout: a global line with the futex word, one 256-byte control block
//! per rank (arrival counter, op headers, abort record, pid), then two data buffers of
//! `shm_chunk_bytes` per rank.
//!
//! Synchronization is an epoch counter per rank: a rank "arrives" by publishing its counter
//! (release) and waits until every counter reaches its own (acquire), spinning briefly and then
//! sleeping on a shared futex. Data buffers alternate between two sets, so a buffer is only
//! rewritten after every rank has passed the next synchronization point: each chunk needs one
//! (single-slot ops) or two (reduce-scatter + all-gather) synchronizations and no barrier.
//!
//! Reductions: rank r folds sub-slice r of the chunk in rank order 0..N-1 (so both cores reduce
//! in parallel, and results are deterministic), reading its own contribution straight from its
//! input and the others' from their buffers (a rank publishes only the sub-slices others
//! fold), then every rank copies the others' reduced sub-slices out. Every rank so reads its
//! input once and writes its output once, and the buffers stay in cache. Large outputs that
//! are not in cache (all-gather, broadcast, reduce-scatter) are written with streaming stores. Messages up to
//! `shm_small_bytes` take a one-sync path where each rank folds the whole buffer itself.
//!
//! Failure detection: every wait has the op deadline; a peer that exits is seen through a
//! pidfd; a rank that fails publishes an abort record that every waiting peer checks.

use std::fs::OpenOptions;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::dtype::{ReduceOp, fold_bytes_to, store_fence, stream_copy};
use super::error::{CommError, Result};
use super::op::{OpHeader, Traffic, block_range};
use super::tcp::TcpBackend;
use super::window::WindowMap;
use super::{Backend, Ctx};

const MAGIC: u64 = 0x7273_7275_6e73_686d; // "rsrunshm"
const FUTEX_OFF: usize = 64;
const SLEEPERS_OFF: usize = 128;
const CTRL_BASE: usize = 256;
const CTRL_STRIDE: usize = 256;
const SEQ_OFF: usize = 0;
const HDR_OFF: usize = 64;
const ABORT_OFF: usize = 128;
const ORIGIN_OFF: usize = 132;
const KIND_OFF: usize = 136;
/// How long a rank that saw a peer's abort flag waits for the peer's error text in the store.
const ABORT_TEXT_WAIT: Duration = Duration::from_millis(200);
const PID_OFF: usize = 140;
/// Two parity slots of `(window id, offset)`: where this rank's buffer of the current op lies
/// (id 0: not in a window).
const WIN_OFF: usize = 160;

const ABORT_DIED: u32 = 1;
const ABORT_TIMEOUT: u32 = 2;
const ABORT_MISMATCH: u32 = 3;
const ABORT_OTHER: u32 = 4;

pub(crate) struct Mapping {
    pub(crate) base: *mut u8,
    pub(crate) len: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-rank access goes through atomics or
// through regions the protocol hands to exactly one writer at a time.
unsafe impl Send for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` come from a successful mmap and are unmapped exactly once.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

pub(crate) fn map_file(file: &std::fs::File, len: usize) -> Result<Mapping> {
    // SAFETY: mapping a regular file we opened read-write, MAP_SHARED, with its full length.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CommError::io(
            "mapping the shared-memory segment",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(Mapping {
        base: p.cast(),
        len,
    })
}

/// How old a segment file of a dead creator must be before [`sweep_stale_segments`] removes
/// it: a live group unlinks its files as soon as every rank attached, well within this.
const STALE_SEGMENT_AGE: Duration = Duration::from_secs(600);

/// Removes the segment files (`rsrun-comm-PID-…`, `rsrun-win-PID-…`) in `dir` that this user's
/// earlier ranks left: their creator is gone (`kill(PID, 0)` says no such process) and they are
/// older than [`STALE_SEGMENT_AGE`]. A rank killed (SIGKILL) between creating a segment and
/// every peer attaching never unlinks it, and tmpfs keeps its pages (a DDP window is world ×
/// the gradients) until someone does. Returns how many were removed.
pub(crate) fn sweep_stale_segments(dir: &std::path::Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix("rsrun-comm-").or_else(|| name.strip_prefix("rsrun-win-")) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<libc::pid_t>().ok()).filter(|p| *p > 0) else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        let old = meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age >= STALE_SEGMENT_AGE);
        if meta.uid() != me || !meta.is_file() || !old {
            continue;
        }
        // SAFETY: signal 0 only checks that the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(file = %entry.path().display(), "removed a shared-memory segment left by an earlier rank");
            removed += 1;
        }
    }
    removed
}

/// Creates a fresh file of `len` bytes for a segment in `/dev/shm` (the temp dir where there is
/// none), mode 0600. With `reserve`, its pages are allocated now (`posix_fallocate`), so a full
/// tmpfs is an error here rather than a `SIGBUS` at first touch. The first call of a process
/// also removes what killed ranks left there ([`sweep_stale_segments`]).
fn create_segment_file(tag: &str, len: usize, reserve: bool) -> Result<(std::fs::File, PathBuf)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static SWEPT: std::sync::Once = std::sync::Once::new();
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    SWEPT.call_once(|| {
        sweep_stale_segments(&dir);
    });
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let path = dir.join(format!(
        "rsrun-{tag}-{}-{nanos:x}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| CommError::io(format!("creating {}", path.display()), e))?;
    let sized = if reserve {
        // tmpfs's fallocate stops with EINTR when a signal arrives (a forwarded SIGUSR1 while a
        // worker starts), and is not restarted: try again, rather than take it for a full disk.
        let mut tries = 0;
        loop {
            // SAFETY: a valid descriptor we own; the call only allocates file space.
            match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) } {
                0 => break Ok(()),
                // (tmpfs starts over each time: a few signals, not a stream of them.)
                libc::EINTR if tries < 100 => tries += 1,
                e => break Err(std::io::Error::from_raw_os_error(e)),
            }
        }
    } else {
        file.set_len(len as u64)
    };
    if let Err(e) = sized {
        let _ = std::fs::remove_file(&path);
        return Err(CommError::io(format!("sizing {} to {len} bytes", path.display()), e));
    }
    Ok((file, path))
}

fn futex_wait(word: &AtomicU32, val: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` points into the live mapping; FUTEX_WAIT (shared) only reads it and sleeps
    // at most `timeout`.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            val,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` points into the live mapping; FUTEX_WAKE does not access memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The inode of this process's pid namespace: a peer's pid means something here only when its
/// namespace is the same (ranks of pods that share /dev/shm and the network, but not their pids,
/// would otherwise probe unrelated pids).
fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// How a peer's death is seen.
#[derive(Debug)]
enum Liveness {
    /// Its pidfd turns readable when it exits.
    Pidfd(OwnedFd),
    /// No pidfd (a kernel before 5.3, a seccomp filter that refuses it, no descriptor left):
    /// `kill(pid, 0)` failing with ESRCH says it exited (a reused pid only delays that).
    Pid(libc::pid_t),
    /// Its pid is not ours to probe (another pid namespace, or not known): only the op's
    /// deadline sees it gone.
    Unknown,
}

impl Liveness {
    /// For a peer that published `pid` from pid namespace `ns`, seen from namespace `ours`.
    fn of(pid: u32, ns: Option<u64>, ours: Option<u64>) -> Liveness {
        if pid == 0 || ns.is_none() || ns != ours {
            return Liveness::Unknown;
        }
        match pidfd_open(pid) {
            Ok(fd) => Liveness::Pidfd(fd),
            Err(_) => match libc::pid_t::try_from(pid) {
                Ok(p) => Liveness::Pid(p),
                Err(_) => Liveness::Unknown,
            },
        }
    }

    fn exited(&self) -> bool {
        match self {
            Liveness::Pidfd(fd) => {
                let mut p = [libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
                super::mesh::poll_fds(&mut p, Duration::ZERO);
                p[0].revents & libc::POLLIN != 0
            }
            Liveness::Pid(p) => {
                // SAFETY: kill with signal 0 sends nothing; it only checks that the pid exists.
                let rc = unsafe { libc::kill(*p, 0) };
                rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
            Liveness::Unknown => false,
        }
    }
}

pub(crate) struct ShmBackend {
    ctx: Ctx,
    map: Mapping,
    slot: usize,
    data_base: usize,
    epoch: u64,
    parity: usize,
    /// How each peer's death is seen (`Unknown` for this rank).
    liveness: Vec<Liveness>,
    pids: Vec<u32>,
    p2p: Option<TcpBackend>,
    spin: Duration,
    /// Recent waits, per kind: how long to spin before sleeping (see [`SpinBudget`]).
    budget: std::cell::Cell<SpinBudget>,
    /// Windows allocated so far (the same count on every rank: allocation is collective). While
    /// 0, ops skip the registration check.
    windows_made: u64,
    /// Live windows, for finding the one an op's buffer lies in.
    windows: Vec<Weak<WindowMap>>,
    /// The running op's deadline (see `Backend::set_op_deadline`).
    op_deadline: Option<Instant>,
}

/// Which synchronization a wait is: the first of an op, where peers may still be computing
/// (milliseconds away), or one inside an op, where every peer is copying its chunk (microseconds).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum WaitKind {
    Arrival,
    Step,
}

/// A spin budget proportional to the expected wait: an exponential moving average of recent
/// waits of each kind. A wait spins for at most twice the expected time, and not at all when
/// the expected wait exceeds the spin cap (then it sleeps on the futex at once), so a
/// communication thread waiting for a peer that is still computing does not take a core from
/// the compute threads; waits inside an op, a chunk copy apart, spin and stay cheap.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpinBudget {
    arrival_ns: f64,
    step_ns: f64,
}

impl SpinBudget {
    pub(crate) fn new() -> Self {
        SpinBudget {
            arrival_ns: 0.0,
            step_ns: 0.0,
        }
    }

    /// How long to spin for a wait of `kind`, capped at `cap`.
    pub(crate) fn spin_for(&self, kind: WaitKind, cap: Duration) -> Duration {
        let expect = match kind {
            WaitKind::Arrival => self.arrival_ns,
            WaitKind::Step => self.step_ns,
        };
        let cap_ns = cap.as_nanos() as f64;
        if expect > cap_ns {
            // Expected to be long: sleep at once (a short spin still catches a lucky arrival).
            return cap.min(Duration::from_micros(1));
        }
        Duration::from_nanos((2.0 * expect).clamp(1_000.0, cap_ns.max(1_000.0)) as u64)
    }

    /// Records a wait of `kind` that took `took`.
    pub(crate) fn record(&mut self, kind: WaitKind, took: Duration) {
        let x = took.as_nanos() as f64;
        let v = match kind {
            WaitKind::Arrival => &mut self.arrival_ns,
            WaitKind::Step => &mut self.step_ns,
        };
        *v = if *v == 0.0 { x } else { 0.8 * *v + 0.2 * x };
    }
}

impl ShmBackend {
    /// Creates or attaches the group's segment by `deadline` (the bootstrap's). `with_p2p` also
    /// connects a TCP mesh for send/recv, by the same deadline.
    pub(crate) fn new(ctx: &Ctx, with_p2p: bool, deadline: Instant) -> Result<Self> {
        const SEGMENT_FAILED: &str = "error";
        let (rank, world) = (ctx.rank, ctx.world);
        let boot_err = |reason: String| CommError::Bootstrap {
            prefix: ctx.prefix.clone(),
            reason,
        };
        let slot = ctx.opts.shm_chunk_bytes.max(4096).next_multiple_of(4096);
        let data_base = (CTRL_BASE + world * CTRL_STRIDE).next_multiple_of(4096);
        let len = data_base + world * 2 * slot;
        let name_key = format!("{}/shm/name", ctx.prefix);
        let (map, path) = if rank == 0 {
            // Reserved, not sparse: a full /dev/shm (Docker's 64 MiB) is an error here, not a
            // SIGBUS at the first touch of a page.
            let (file, path) = match create_segment_file("comm", len, true) {
                Ok(made) => made,
                Err(e) => {
                    // Told to the other ranks at once (best effort), who otherwise waited out
                    // the bootstrap for a name, and then blamed the store key.
                    let _ = ctx.store.set(&name_key, format!("{SEGMENT_FAILED}\n{e}").as_bytes());
                    return Err(e);
                }
            };
            let made = map_file(&file, len).and_then(|map| {
                // SAFETY: offset 0..24 is inside the mapping, 8-aligned; nobody else has it yet.
                unsafe {
                    (map.base as *mut u64).write(MAGIC);
                    (map.base as *mut u64).add(1).write(world as u64);
                    (map.base as *mut u64).add(2).write(slot as u64);
                }
                ctx.store
                    .set(&name_key, format!("{}\n{len}", path.display()).as_bytes())?;
                Ok(map)
            });
            match made {
                Ok(map) => (map, Some(path)),
                Err(e) => {
                    let _ = std::fs::remove_file(&path);
                    return Err(e);
                }
            }
        } else {
            let v = ctx.store.get(
                &name_key,
                deadline.saturating_duration_since(Instant::now()),
            )?;
            let v = String::from_utf8_lossy(&v).to_string();
            let (p, l) = v
                .split_once('\n')
                .ok_or_else(|| boot_err(format!("bad segment record {v:?}")))?;
            if p == SEGMENT_FAILED {
                return Err(boot_err(format!("rank {} could not create the shared-memory segment: {l}", ctx.names[0])));
            }
            let l: usize = l
                .parse()
                .map_err(|_| boot_err(format!("bad segment length {l:?}")))?;
            if l != len {
                return Err(boot_err(format!(
                    "segment length {l} differs from {len} (different shm_chunk_bytes on ranks?)"
                )));
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|e| {
                    CommError::io(
                        format!("opening {p} (ranks on different hosts or /dev/shm not shared?)"),
                        e,
                    )
                })?;
            let map = map_file(&file, len)?;
            // SAFETY: offset 0 is inside the mapping and 8-aligned; written before the name was published.
            let magic = unsafe { (map.base as *const u64).read_volatile() };
            if magic != MAGIC {
                return Err(boot_err(format!("segment {p} has a bad magic {magic:#x}")));
            }
            (map, None)
        };
        let mut me = ShmBackend {
            ctx: ctx.clone(),
            map,
            slot,
            data_base,
            epoch: 0,
            parity: 0,
            liveness: Vec::new(),
            pids: vec![0; world],
            p2p: None,
            spin: ctx.opts.spin,
            budget: std::cell::Cell::new(SpinBudget::new()),
            windows_made: 0,
            windows: Vec::new(),
            op_deadline: None,
        };
        let pid = std::process::id();
        me.u32_at(me.ctrl(rank) + PID_OFF)
            .store(pid, Ordering::Release);
        let ns = pid_namespace();
        let mut namespaces = vec![None; world];
        let mut attach_err = ctx
            .store
            .set(
                &format!("{}/shm/attached/{rank}", ctx.prefix),
                format!("{pid} {}", ns.unwrap_or(0)).as_bytes(),
            )
            .err();
        for (j, ns_j) in namespaces.iter_mut().enumerate() {
            if attach_err.is_some() {
                break;
            }
            let key = format!("{}/shm/attached/{j}", ctx.prefix);
            match ctx
                .store
                .get(&key, deadline.saturating_duration_since(Instant::now()))
            {
                Ok(v) => {
                    // "PID PIDNS" (0: its namespace is not known).
                    let v = String::from_utf8_lossy(&v);
                    let mut f = v.split(' ');
                    me.pids[j] = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
                    *ns_j = f.next().and_then(|n| n.parse().ok()).filter(|n| *n != 0);
                }
                Err(e) => {
                    attach_err = Some(e);
                    break;
                }
            }
        }
        if let Some(path) = path {
            // Every rank has mapped it (or bootstrap failed): the name is no longer needed.
            let _ = std::fs::remove_file(path);
        }
        if let Some(e) = attach_err {
            return Err(e);
        }
        me.liveness = (0..world)
            .map(|j| if j == rank || me.pids[j] == pid { Liveness::Unknown } else { Liveness::of(me.pids[j], namespaces[j], ns) })
            .collect();
        let unseen: Vec<usize> = (0..world).filter(|&j| j != rank && matches!(me.liveness[j], Liveness::Unknown)).map(|j| ctx.names[j]).collect();
        if !unseen.is_empty() {
            tracing::debug!(ranks = ?unseen, "peers whose exit cannot be watched (this process, or another pid namespace): seen only at the op's deadline");
        }
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        if world > cores {
            // Oversubscribed: spinning would steal the core from the rank we wait for.
            me.spin = me.spin.min(Duration::from_micros(2));
        }
        if with_p2p {
            let mut sub = ctx.clone();
            sub.prefix = format!("{}/p2p", ctx.prefix);
            me.p2p = Some(TcpBackend::new(&sub, deadline)?);
        }
        Ok(me)
    }

    fn ctrl(&self, j: usize) -> usize {
        CTRL_BASE + j * CTRL_STRIDE
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= self.map.len && off.is_multiple_of(8));
        // SAFETY: every caller passes a fixed, 8-aligned control offset inside the mapping; the
        // mapping outlives `&self`; these words are only ever accessed atomically.
        unsafe { &*(self.map.base.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= self.map.len && off.is_multiple_of(4));
        // SAFETY: as for `u64_at`, with 4-byte alignment.
        unsafe { &*(self.map.base.add(off) as *const AtomicU32) }
    }

    fn data(&self, j: usize, b: usize) -> *mut u8 {
        // In bounds: data_base + (world*2)*slot == mapping length.
        self.map
            .base
            .wrapping_add(self.data_base + (j * 2 + b) * self.slot)
    }

    fn next_buf(&mut self) -> usize {
        let b = self.parity;
        self.parity ^= 1;
        b
    }

    fn arrive(&mut self) {
        self.epoch += 1;
        self.u64_at(self.ctrl(self.ctx.rank) + SEQ_OFF)
            .store(self.epoch, Ordering::Release);
        self.u32_at(FUTEX_OFF).fetch_add(1, Ordering::SeqCst);
        if self.u32_at(SLEEPERS_OFF).load(Ordering::SeqCst) > 0 {
            futex_wake(self.u32_at(FUTEX_OFF));
        }
    }

    /// The store value at `key`, which rank `from` sets, by `deadline`: asked for in short slices,
    /// and between them an abort of any rank or the exit of `from` fails the wait at once (not at
    /// the deadline, 300 s by default, while a window file waits to be unlinked).
    fn watched_get(&self, key: &str, from: usize, deadline: Instant) -> Result<Vec<u8>> {
        const SLICE: Duration = Duration::from_millis(100);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(v) = super::store::try_get(&*self.ctx.store, key, left.min(SLICE))? {
                return Ok(v);
            }
            self.check_aborts()?;
            if self.liveness[from].exited() {
                return Err(self.exited_peer(from, "shared buffer setup"));
            }
            if Instant::now() >= deadline {
                return Err(CommError::StoreTimeout { key: key.to_owned(), timeout_ms: self.ctx.opts.timeout.as_millis() as u64 });
            }
        }
    }

    /// The error of group rank `j`, whose process exited, during `op`.
    fn exited_peer(&self, j: usize, op: &str) -> CommError {
        CommError::PeerFailed { peer: self.ctx.names[j], op: op.to_string(), detail: format!("process {} exited", self.pids[j]) }
    }

    fn all_arrived(&self) -> bool {
        (0..self.ctx.world)
            .all(|j| self.u64_at(self.ctrl(j) + SEQ_OFF).load(Ordering::Acquire) >= self.epoch)
    }

    fn check_aborts(&self) -> Result<()> {
        for j in 0..self.ctx.world {
            if j == self.ctx.rank {
                continue;
            }
            let c = self.ctrl(j);
            if self.u32_at(c + ABORT_OFF).load(Ordering::Acquire) != 0 {
                let origin = self.u32_at(c + ORIGIN_OFF).load(Ordering::Relaxed) as usize;
                // The whole error, as the aborting rank publishes it right after raising its
                // flag (best effort: else the kind the flag carries).
                let published = super::store::try_get(&*self.ctx.store, &super::mesh::abort_key(&self.ctx.prefix, j), ABORT_TEXT_WAIT)
                    .ok()
                    .flatten()
                    .and_then(|v| String::from_utf8_lossy(&v).split_once('\n').map(|(_, why)| why.to_string()));
                let detail = published.unwrap_or_else(|| {
                    match self.u32_at(c + KIND_OFF).load(Ordering::Relaxed) {
                        ABORT_DIED => "process died",
                        ABORT_TIMEOUT => "timed out",
                        ABORT_MISMATCH => "mismatched collective",
                        _ => "error",
                    }
                    .to_string()
                });
                return Err(CommError::Aborted {
                    by: self.ctx.names[j],
                    origin,
                    detail,
                });
            }
        }
        Ok(())
    }

    /// A peer that has not arrived and whose process exited fails `op` (the collective waiting).
    fn check_dead(&self, op: &str) -> Result<()> {
        for j in 0..self.ctx.world {
            if self.u64_at(self.ctrl(j) + SEQ_OFF).load(Ordering::Acquire) >= self.epoch {
                continue;
            }
            if self.liveness[j].exited() {
                return Err(self.exited_peer(j, op));
            }
        }
        Ok(())
    }

    /// Waits until every rank has arrived at our epoch (spinning for the budget of `kind`, then
    /// sleeping on the futex).
    fn wait_all(&self, op: &str, deadline: Instant, kind: WaitKind) -> Result<()> {
        if self.all_arrived() {
            let mut b = self.budget.get();
            b.record(kind, Duration::ZERO);
            self.budget.set(b);
            return Ok(());
        }
        let start = Instant::now();
        let r = self.wait_slow(op, deadline, kind, start);
        let mut b = self.budget.get();
        b.record(kind, start.elapsed());
        self.budget.set(b);
        r
    }

    fn wait_slow(&self, op: &str, deadline: Instant, kind: WaitKind, start: Instant) -> Result<()> {
        let spin = self.budget.get().spin_for(kind, self.spin);
        let mut i: u32 = 0;
        loop {
            std::hint::spin_loop();
            if self.all_arrived() {
                return Ok(());
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) {
                self.check_aborts()?;
                if start.elapsed() >= spin {
                    break;
                }
            }
        }
        let futex = self.u32_at(FUTEX_OFF);
        let sleepers = self.u32_at(SLEEPERS_OFF);
        loop {
            self.check_aborts()?;
            self.check_dead(op)?;
            let now = Instant::now();
            if now >= deadline {
                // Grace period: if the late peer gave up first (blaming someone else), report
                // that. A peer that arrives meanwhile completes the op. (Short: a TCP mesh
                // waiting on this rank follows who waited on whom for a second, and must see
                // this rank's verdict within it.)
                let grace = now + Duration::from_millis(50).min(self.ctx.opts.timeout);
                while Instant::now() < grace {
                    self.check_aborts()?;
                    if self.all_arrived() {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                let Some(peer) = (0..self.ctx.world).find(|j| {
                    self.u64_at(self.ctrl(*j) + SEQ_OFF).load(Ordering::Acquire) < self.epoch
                }) else {
                    return Ok(());
                };
                return Err(CommError::Timeout {
                    peer: self.ctx.names[peer],
                    op: op.to_string(),
                    waited_ms: self.ctx.opts.timeout.as_millis() as u64,
                });
            }
            sleepers.fetch_add(1, Ordering::SeqCst);
            let v = futex.load(Ordering::SeqCst);
            if self.all_arrived() {
                sleepers.fetch_sub(1, Ordering::SeqCst);
                return Ok(());
            }
            futex_wait(futex, v, (deadline - now).min(Duration::from_millis(10)));
            sleepers.fetch_sub(1, Ordering::SeqCst);
            if self.all_arrived() {
                return Ok(());
            }
        }
    }

    /// A synchronization inside an op (every peer is already in it).
    fn sync(&mut self, op: &str, deadline: Instant) -> Result<()> {
        self.arrive();
        self.wait_all(op, deadline, WaitKind::Step)
    }

    /// The first synchronization of an op: publishes our header and checks everyone's.
    fn first_sync(&mut self, h: &OpHeader, deadline: Instant) -> Result<()> {
        let slot = ((self.epoch + 1) % 2) as usize;
        let base = self.ctrl(self.ctx.rank) + HDR_OFF + slot * 24;
        for (k, w) in h.to_words().iter().enumerate() {
            self.u64_at(base + 8 * k).store(*w, Ordering::Relaxed);
        }
        self.check_aborts()?;
        self.arrive();
        self.wait_all(h.kind.name(), deadline, WaitKind::Arrival)?;
        for j in 0..self.ctx.world {
            let b = self.ctrl(j) + HDR_OFF + slot * 24;
            let w = [0, 1, 2].map(|k| self.u64_at(b + 8 * k).load(Ordering::Relaxed));
            let theirs = OpHeader::from_words(w);
            if theirs != Some(*h) {
                return Err(CommError::Mismatch {
                    rank: self.ctx.names[self.ctx.rank],
                    peer: self.ctx.names[j],
                    ours: h.describe(),
                    theirs: theirs
                        .map_or_else(|| "an unknown operation".to_string(), |t| t.describe()),
                });
            }
        }
        // A peer that gave up after arriving (e.g. it timed out earlier) must fail us too.
        self.check_aborts()
    }

    /// The running op's deadline (it may be longer than the group's timeout: see
    /// `ProcessGroup::with_op_timeout`), else the group's timeout from now.
    fn deadline(&self) -> Instant {
        self.op_deadline.unwrap_or_else(|| Instant::now() + self.ctx.opts.timeout)
    }

    /// Allocates a registered window of `bytes` per rank (collective, in the same order on every
    /// rank). `None` when rank 0 could not create it (e.g. `/dev/shm` is full): every rank then
    /// falls back to a heap buffer.
    fn make_window(&mut self, bytes: usize) -> Result<Option<Arc<WindowMap>>> {
        let (rank, world) = (self.ctx.rank, self.ctx.world);
        self.windows_made += 1;
        self.windows.retain(|w| w.strong_count() > 0);
        let id = self.windows_made;
        let slot = bytes.max(1).next_multiple_of(4096);
        let len = slot.checked_mul(world).ok_or_else(|| {
            CommError::InvalidArgument(format!("shared buffer of {bytes} bytes × {world} ranks overflows"))
        })?;
        let key = format!("{}/shm/win/{id}", self.ctx.prefix);
        let deadline = Instant::now() + self.ctx.opts.timeout;
        let map = if rank == 0 {
            match create_segment_file("win", len, true).and_then(|(file, path)| {
                match map_file(&file, len) {
                    Ok(m) => Ok((m, path)),
                    Err(e) => {
                        let _ = std::fs::remove_file(&path);
                        Err(e)
                    }
                }
            }) {
                Ok((map, path)) => {
                    let published = self
                        .ctx
                        .store
                        .set(&key, format!("{}\n{len}", path.display()).as_bytes());
                    let mut acked = published.map(|_| ());
                    for j in 1..world {
                        if acked.is_err() {
                            break;
                        }
                        acked = self.watched_get(&format!("{key}/attached/{j}"), j, deadline).map(|_| ());
                    }
                    // Every rank has mapped it (or one failed): the name is no longer needed.
                    let _ = std::fs::remove_file(&path);
                    acked?;
                    Some(map)
                }
                Err(e) => {
                    tracing::warn!(error = %e, bytes, "no room for a registered buffer; using heap buffers (staged collectives)");
                    self.ctx.store.set(&key, b"none")?;
                    None
                }
            }
        } else {
            let v = self.watched_get(&key, 0, deadline)?;
            let v = String::from_utf8_lossy(&v).to_string();
            if v == "none" {
                None
            } else {
                let bad = || CommError::Bootstrap {
                    prefix: self.ctx.prefix.clone(),
                    reason: format!("bad window record {v:?} (expected PATH\\nLENGTH of {len})"),
                };
                let (p, l) = v.split_once('\n').ok_or_else(bad)?;
                if l.parse::<usize>().ok() != Some(len) {
                    return Err(bad());
                }
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .map_err(|e| CommError::io(format!("opening window {p}"), e))?;
                let map = map_file(&file, len)?;
                self.ctx
                    .store
                    .set(&format!("{key}/attached/{rank}"), b"1")?;
                Some(map)
            }
        };
        Ok(map.map(|map| {
            let w = Arc::new(WindowMap {
                id,
                map,
                slot,
                rank,
            });
            self.windows.push(Arc::downgrade(&w));
            w
        }))
    }

    /// `(window id, offset)` of our buffer `[p, p + len)` when it lies in a live window.
    fn locate(&self, p: *const u8, len: usize) -> Option<(u64, usize, Arc<WindowMap>)> {
        self.windows.iter().find_map(|w| {
            let w = w.upgrade()?;
            let (id, off) = w.locate(p, len)?;
            Some((id, off, w))
        })
    }

    /// The first synchronization of an op that can run zero-copy: publishes where our buffer
    /// lies next to the header and returns the window when every rank's buffer is at the same
    /// offset of the same one (then each rank may access every rank's buffer in the op).
    fn first_sync_win(
        &mut self,
        h: &OpHeader,
        p: *const u8,
        len: usize,
        deadline: Instant,
    ) -> Result<Option<(Arc<WindowMap>, usize)>> {
        let mine = self.locate(p, len);
        let (id, off) = mine.as_ref().map_or((0, 0), |(i, o, _)| (*i, *o as u64));
        let parity = ((self.epoch + 1) % 2) as usize;
        let at = |me: &Self, j: usize| me.ctrl(j) + WIN_OFF + parity * 16;
        self.u64_at(at(self, self.ctx.rank)).store(id, Ordering::Relaxed);
        self.u64_at(at(self, self.ctx.rank) + 8)
            .store(off, Ordering::Relaxed);
        self.first_sync(h, deadline)?;
        // Published before every rank's arrival, which `first_sync` acquired.
        let same = (0..self.ctx.world).all(|j| {
            self.u64_at(at(self, j)).load(Ordering::Relaxed) == id
                && self.u64_at(at(self, j) + 8).load(Ordering::Relaxed) == off
        });
        Ok(match mine {
            Some((_, o, w)) if same && id != 0 => Some((w, o)),
            _ => None,
        })
    }

    /// Zero-copy all_gather into a window (after [`Self::first_sync_win`] on the output): rank r
    /// writes its input into block r of every rank's output, then one synchronization. Outputs
    /// of at least [`STREAM_MIN`] are written with streaming stores, as the staged path's are
    /// (64 MiB on a 2-vCPU Zen 3: 0.54–0.82 of the memcpy bound before, 0.87–1.15 after).
    fn all_gather_window(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        w: &WindowMap,
        off: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let s = input.len();
        let dsts: Vec<*mut u8> = (0..n)
            .map(|j| {
                if j == r {
                    out[r * s..].as_mut_ptr()
                } else {
                    w.slot_ptr(j).wrapping_add(off + r * s)
                }
            })
            .collect();
        let piece = 4 * WINDOW_PIECE;
        let stream = out.len() >= STREAM_MIN;
        let mut c = 0;
        while c < s {
            let l = piece.min(s - c);
            for d in &dsts {
                // SAFETY: every rank is inside this op with its output at `off` of window `w`
                // (n × s bytes), so block r of each is valid and written only by us until the
                // next synchronization; `input` is a distinct user buffer.
                unsafe { copy_out(d.add(c), input.as_ptr().add(c), l, stream) };
            }
            c += l;
        }
        self.end_window_op(h, t, (n - 1) * s)
    }

    /// Zero-copy all_reduce on a window (after [`Self::first_sync_win`]): rank r folds block r
    /// of every rank's buffer in rank order, a cache-sized piece at a time, into its own buffer
    /// and copies each piece into the peers' block r while it is hot; one more synchronization
    /// and every buffer holds the whole result.
    fn all_reduce_window(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        w: &WindowMap,
        off: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let esz = h.dtype.size();
        let mine = block_range(buf.len() / esz, n, r);
        let (ms, ml) = (mine.start * esz, mine.len() * esz);
        let own = buf[ms..].as_mut_ptr();
        let bufs: Vec<*mut u8> = (0..n)
            .map(|j| if j == r { own } else { w.slot_ptr(j).wrapping_add(off + ms) })
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(n);
        let piece = (WINDOW_PIECE / esz).max(1) * esz;
        let mut c = 0;
        while c < ml {
            let l = piece.min(ml - c);
            let srcs: Vec<*const u8> = bufs.iter().map(|p| p.wrapping_add(c) as *const u8).collect();
            // SAFETY: every rank is inside this op (first_sync_win) with its buffer at `off` of
            // window `w`, `buf.len()` bytes long, so block r of each is valid and only we touch
            // it until the next synchronization; `own` aliases exactly source r.
            unsafe {
                fold_bytes_to(h.dtype, op, own.add(c), &srcs, l, avg, false)?;
                // Plain stores: the fold has just read these lines of each peer's block, so they
                // are in cache (streaming stores here took 11.9–13.9 ms for 64 MiB on a Zen 3
                // against 11.6–12.6 without).
                for (j, p) in bufs.iter().enumerate() {
                    if j != r {
                        std::ptr::copy_nonoverlapping(own.add(c), p.add(c), l);
                    }
                }
            }
            c += l;
        }
        self.end_window_op(h, t, (n - 1) * ml + (buf.len() - ml))
    }

    /// Zero-copy reduce_scatter of a registered input (after [`Self::first_sync_win`] on it):
    /// rank r folds block r of every rank's input in rank order, read in place from the
    /// window, straight into its output (streamed when `stream`), a piece at a time; one more
    /// synchronization, so that no rank changes its input while a peer still reads it. Each rank
    /// reads its block of every input once and writes its output once: the op's memory-traffic
    /// bound, with nothing staged.
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_window(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        op: ReduceOp,
        w: &WindowMap,
        off: usize,
        stream: bool,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let bl = out.len();
        let ins: Vec<*const u8> = (0..n)
            .map(|j| if j == r { input[r * bl..].as_ptr() } else { w.slot_ptr(j).wrapping_add(off + r * bl) as *const u8 })
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(n);
        let piece = (4 * WINDOW_PIECE / h.dtype.size()).max(1) * h.dtype.size();
        let mut c = 0;
        while c < bl {
            let l = piece.min(bl - c);
            let srcs: Vec<*const u8> = ins.iter().map(|p| p.wrapping_add(c)).collect();
            // SAFETY: every rank is inside this op (first_sync_win) with its input at `off` of
            // window `w`, `n × bl` bytes long, so block r of each is valid, and no rank writes
            // its input until the next synchronization; `out` is an exclusively borrowed user
            // buffer, disjoint from every input.
            unsafe { fold_bytes_to(h.dtype, op, out[c..].as_mut_ptr(), &srcs, l, avg, stream)? };
            c += l;
        }
        self.end_window_op(h, t, (n - 1) * bl)
    }

    /// Ends a zero-copy op: one more synchronization (no rank goes on while a peer still reads
    /// or writes its buffer), and `bytes` each way in the op's traffic.
    fn end_window_op(&mut self, h: &OpHeader, t: &mut Traffic, bytes: usize) -> Result<()> {
        self.sync(h.kind.name(), self.deadline())?;
        t.sent += bytes as u64;
        t.recv += bytes as u64;
        t.zero_copy = true;
        Ok(())
    }

    /// Copies `len` bytes from `src` into our own data buffer `b` at `off`.
    fn put(&self, b: usize, off: usize, src: &[u8]) {
        debug_assert!(off + src.len() <= self.slot);
        // SAFETY: our buffer `b` is ours alone until the next arrive (double-buffer protocol);
        // `off + len <= slot` keeps the write inside it; `src` is a distinct user buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.data(self.ctx.rank, b).add(off),
                src.len(),
            )
        }
    }

    /// Copies bytes from rank `j`'s data buffer `b` at `off` into `dst`, with streaming stores
    /// when `stream` (see [`copy_out`]).
    fn get(&self, j: usize, b: usize, off: usize, dst: &mut [u8], stream: bool) {
        debug_assert!(off + dst.len() <= self.slot);
        // SAFETY: rank j finished writing this region before arriving at the epoch we waited
        // for, and will not rewrite it until we arrive at a later one; bounds as in `put`; `dst`
        // is a distinct user buffer.
        unsafe {
            copy_out(
                dst.as_mut_ptr(),
                self.data(j, b).add(off),
                dst.len(),
                stream,
            )
        }
    }

    /// Folds `len` bytes at `off` of every rank's buffer `b` (rank order) into `out`; our own
    /// contribution is read from `own` instead of our buffer when given. `stream`: `out` is
    /// written with streaming stores (see [`fold_bytes_to`]).
    ///
    /// # Safety
    /// `out` must be valid for `len` writes and either disjoint from the shared buffers or
    /// exactly our own buffer at `off` (then not `stream`); `own`, when given, valid for `len`
    /// reads and not partially overlapping `out`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn fold_from_all(
        &self,
        h: &OpHeader,
        op: ReduceOp,
        b: usize,
        off: usize,
        len: usize,
        own: Option<*const u8>,
        out: *mut u8,
        stream: bool,
    ) -> Result<()> {
        let srcs: Vec<*const u8> = (0..self.ctx.world)
            .map(|j| match own {
                Some(p) if j == self.ctx.rank => p,
                _ => self.data(j, b).wrapping_add(off) as *const u8,
            })
            .collect();
        let avg = (op == ReduceOp::Avg).then_some(self.ctx.world);
        // SAFETY: every source region was published before the epoch we waited for and stays
        // untouched until our next arrive; aliasing of `out` is as documented above.
        unsafe { fold_bytes_to(h.dtype, op, out, &srcs, len, avg, stream) }
    }

    /// The chunk loop shared by all_reduce and reduce (reduce-scatter + all-gather per chunk).
    /// `gather_to`: None = every rank copies the result out; Some(root) = only root does.
    ///
    /// Per chunk, rank r owns block r: it publishes only the other ranks' blocks of its input,
    /// folds block r from its own input and the peers' buffers (rank order) into its buffer and
    /// its output, and after the second synchronization copies the peers' reduced blocks out.
    /// Each rank thus reads its input once and writes its output once; the shared buffers stay
    /// in cache.
    fn chunked_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        gather_to: Option<usize>,
        synced: bool,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let esz = h.dtype.size();
        let per = (self.slot / esz / n) * n;
        if per == 0 {
            return Err(CommError::InvalidArgument(format!(
                "shm_chunk_bytes {} too small for world {n}",
                self.slot
            )));
        }
        // No streaming stores here: every output line was read moments ago (publishing or
        // folding), so it is in cache and a plain store costs no read-for-ownership.
        let count = buf.len() / esz;
        let mut off = 0;
        // `synced`: the op's first synchronization (with the header check) already happened.
        let mut first = !synced;
        while off < count || first {
            let c = per.min(count - off);
            let chunk = off * esz..(off + c) * esz;
            let b = self.next_buf();
            for j in (0..n).filter(|j| *j != r) {
                let sub = block_range(c, n, j);
                let (s, l) = (sub.start * esz, sub.len() * esz);
                self.put(b, s, &buf[chunk.start + s..chunk.start + s + l]);
            }
            if first {
                self.first_sync(h, deadline)?;
                first = false;
            } else {
                self.sync(h.kind.name(), deadline)?;
            }
            let mine = block_range(c, n, r);
            let (ms, ml) = (mine.start * esz, mine.len() * esz);
            let own = buf[chunk.start + ms..].as_ptr();
            // SAFETY: `out` is our own buffer at `ms` (the region we did not publish), disjoint
            // from `own`, which is the user buffer.
            unsafe {
                self.fold_from_all(
                    h,
                    op,
                    b,
                    ms,
                    ml,
                    Some(own),
                    self.data(r, b).wrapping_add(ms),
                    false,
                )?
            };
            let clen = c * esz;
            if gather_to.is_none() || gather_to == Some(r) {
                self.get(
                    r,
                    b,
                    ms,
                    &mut buf[chunk.start + ms..chunk.start + ms + ml],
                    false,
                );
            }
            self.sync(h.kind.name(), deadline)?;
            if gather_to.is_none() || gather_to == Some(r) {
                for j in (0..n).filter(|j| *j != r) {
                    let sub = block_range(c, n, j);
                    let (s, l) = (sub.start * esz, sub.len() * esz);
                    self.get(
                        j,
                        b,
                        s,
                        &mut buf[chunk.start + s..chunk.start + s + l],
                        false,
                    );
                }
                t.recv += (clen - ml + (n - 1) * ml) as u64;
            } else {
                t.recv += ((n - 1) * ml) as u64;
            }
            match gather_to {
                None => t.sent += (clen - ml + (n - 1) * ml) as u64,
                Some(root) if root == r => t.sent += (clen - ml) as u64,
                Some(_) => t.sent += (clen - ml + ml) as u64,
            }
            off += c;
        }
        Ok(())
    }
}

/// Piece of a zero-copy reduction: folded, then copied to the peers while still in L1.
const WINDOW_PIECE: usize = 16 << 10;

/// Outputs at least this large are written with streaming (non-temporal) stores: they cannot
/// stay in cache anyway, and a streaming store skips the read-for-ownership of each line, which
/// otherwise doubles the memory traffic of the copy-out.
const STREAM_MIN: usize = 8 << 20;

/// Copies `len` bytes from `src` to `dst`, with streaming stores when `stream` (x86-64; a plain
/// copy elsewhere). A streaming copy ends with a store fence, so its bytes are ordered before a
/// later release (plain stores need none).
///
/// # Safety
/// `dst` valid for `len` writes, `src` for `len` reads, not overlapping.
unsafe fn copy_out(dst: *mut u8, src: *const u8, len: usize, stream: bool) {
    // SAFETY (both): the caller's bounds.
    if stream {
        unsafe { stream_copy(dst, src, len) };
        store_fence();
    } else {
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

impl Backend for ShmBackend {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn alloc_window(&mut self, bytes: usize) -> Result<Option<Arc<WindowMap>>> {
        self.make_window(bytes)
    }

    fn all_reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        let n = self.ctx.world;
        let len = buf.len();
        if len <= self.ctx.opts.shm_small_bytes.min(self.slot) {
            let deadline = self.deadline();
            let b = self.next_buf();
            self.put(b, 0, buf);
            self.first_sync(h, deadline)?;
            // SAFETY: `buf` is an exclusively borrowed user buffer, disjoint from the segment.
            unsafe { self.fold_from_all(h, op, b, 0, len, None, buf.as_mut_ptr(), false)? };
            t.sent += ((n - 1) * len) as u64;
            t.recv += ((n - 1) * len) as u64;
            return Ok(());
        }
        if self.windows_made > 0 {
            let deadline = self.deadline();
            return match self.first_sync_win(h, buf.as_ptr(), len, deadline)? {
                Some((w, off)) => self.all_reduce_window(h, buf, op, &w, off, t),
                None => self.chunked_reduce(h, buf, op, None, true, t),
            };
        }
        self.chunked_reduce(h, buf, op, None, false, t)
    }

    fn reduce(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        op: ReduceOp,
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let len = buf.len();
        if len <= self.ctx.opts.shm_small_bytes.min(self.slot) {
            let deadline = self.deadline();
            let b = self.next_buf();
            self.put(b, 0, buf);
            self.first_sync(h, deadline)?;
            if r == root {
                // SAFETY: as in all_reduce.
                unsafe { self.fold_from_all(h, op, b, 0, len, None, buf.as_mut_ptr(), false)? };
                t.recv += ((n - 1) * len) as u64;
            } else {
                t.sent += len as u64;
            }
            return Ok(());
        }
        // Work on a copy so non-root buffers stay unchanged.
        if r == root {
            self.chunked_reduce(h, buf, op, Some(root), false, t)
        } else {
            // Vec<u8> may be unaligned for the element type: use an aligned copy.
            let mut aligned = super::dtype::AlignedBuf::new();
            let a = aligned.get(len);
            a.copy_from_slice(buf);
            self.chunked_reduce(h, a, op, Some(root), false, t)
        }
    }

    fn broadcast(
        &mut self,
        h: &OpHeader,
        buf: &mut [u8],
        root: usize,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let stream = buf.len() >= STREAM_MIN;
        let mut off = 0;
        let mut first = true;
        while off < buf.len() || first {
            let c = self.slot.min(buf.len() - off);
            let b = self.next_buf();
            if r == root {
                self.put(b, 0, &buf[off..off + c]);
            }
            if first {
                self.first_sync(h, deadline)?;
                first = false;
            } else {
                self.sync("broadcast", deadline)?;
            }
            if r == root {
                t.sent += ((n - 1) * c) as u64;
            } else {
                self.get(root, b, 0, &mut buf[off..off + c], stream);
                t.recv += c as u64;
            }
            off += c;
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        let n = self.ctx.world;
        let s = input.len();
        let stream = out.len() >= STREAM_MIN;
        let mut synced = false;
        if self.windows_made > 0 {
            match self.first_sync_win(h, out.as_ptr(), out.len(), deadline)? {
                Some((w, woff)) => return self.all_gather_window(h, input, out, &w, woff, t),
                None => synced = true,
            }
        }
        let mut off = 0;
        let mut first = !synced;
        while off < s || first {
            let c = self.slot.min(s - off);
            let b = self.next_buf();
            self.put(b, 0, &input[off..off + c]);
            if first {
                self.first_sync(h, deadline)?;
                first = false;
            } else {
                self.sync("all_gather", deadline)?;
            }
            for j in 0..n {
                let dst = &mut out[j * s + off..j * s + off + c];
                if j == self.ctx.rank {
                    // Our own block comes straight from the input, not back through our buffer.
                    // SAFETY: `input` and `out` are distinct user buffers of at least these bounds.
                    unsafe { copy_out(dst.as_mut_ptr(), input[off..].as_ptr(), c, stream) };
                } else {
                    self.get(j, b, 0, dst, stream);
                }
            }
            t.sent += ((n - 1) * c) as u64;
            t.recv += ((n - 1) * c) as u64;
            off += c;
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        h: &OpHeader,
        input: &[u8],
        out: &mut [u8],
        op: ReduceOp,
        t: &mut Traffic,
    ) -> Result<()> {
        let deadline = self.deadline();
        let (r, n) = (self.ctx.rank, self.ctx.world);
        let esz = h.dtype.size();
        let per = self.slot / esz / n;
        if per == 0 {
            return Err(CommError::InvalidArgument(format!(
                "shm_chunk_bytes {} too small for world {n}",
                self.slot
            )));
        }
        let cs = out.len() / esz;
        // A big output is in no cache and no one reads it within the op: streaming stores skip
        // each line's read-for-ownership (a quarter of the op's memory traffic at two ranks).
        let stream = out.len() >= STREAM_MIN;
        let mut synced = false;
        if self.windows_made > 0 {
            match self.first_sync_win(h, input.as_ptr(), input.len(), deadline)? {
                Some((w, woff)) => return self.reduce_scatter_window(h, input, out, op, &w, woff, stream, t),
                None => synced = true,
            }
        }
        let mut off = 0;
        let mut first = !synced;
        while off < cs || first {
            let c = per.min(cs - off);
            let b = self.next_buf();
            // Our own block is folded straight from the input.
            for j in (0..n).filter(|j| *j != r) {
                let src = (j * cs + off) * esz..(j * cs + off + c) * esz;
                self.put(b, j * c * esz, &input[src]);
            }
            if first {
                self.first_sync(h, deadline)?;
                first = false;
            } else {
                self.sync("reduce_scatter", deadline)?;
            }
            let dst = &mut out[off * esz..(off + c) * esz];
            let own = input[(r * cs + off) * esz..].as_ptr();
            // SAFETY: `out` and `input` are exclusively borrowed user buffers, disjoint from the
            // segment and from each other.
            unsafe {
                self.fold_from_all(h, op, b, r * c * esz, c * esz, Some(own), dst.as_mut_ptr(), stream)?
            };
            t.sent += ((n - 1) * c * esz) as u64;
            t.recv += ((n - 1) * c * esz) as u64;
            off += c;
        }
        Ok(())
    }

    fn barrier(&mut self, h: &OpHeader, _t: &mut Traffic) -> Result<()> {
        let deadline = self.deadline();
        self.first_sync(h, deadline)
    }

    fn send(&mut self, h: &OpHeader, buf: &[u8], dst: usize, t: &mut Traffic) -> Result<()> {
        match &mut self.p2p {
            Some(p) => p.send(h, buf, dst, t),
            None => Err(CommError::Unsupported {
                backend: "shm",
                reason: "send/recv inside a hierarchical group".into(),
            }),
        }
    }

    fn recv(&mut self, h: &OpHeader, buf: &mut [u8], src: usize, t: &mut Traffic) -> Result<()> {
        match &mut self.p2p {
            Some(p) => p.recv(h, buf, src, t),
            None => Err(CommError::Unsupported {
                backend: "shm",
                reason: "send/recv inside a hierarchical group".into(),
            }),
        }
    }

    fn set_op_deadline(&mut self, deadline: Option<Instant>) {
        self.op_deadline = deadline;
        if let Some(p) = &mut self.p2p {
            p.set_op_deadline(deadline);
        }
    }

    fn abort(&mut self, err: &CommError) {
        let c = self.ctrl(self.ctx.rank);
        let kind = match err {
            CommError::PeerFailed { .. } => ABORT_DIED,
            CommError::Timeout { .. } => ABORT_TIMEOUT,
            CommError::Mismatch { .. } => ABORT_MISMATCH,
            _ => ABORT_OTHER,
        };
        let origin = err.peer().unwrap_or(self.ctx.names[self.ctx.rank]);
        self.u32_at(c + ORIGIN_OFF)
            .store(origin as u32, Ordering::Relaxed);
        self.u32_at(c + KIND_OFF).store(kind, Ordering::Relaxed);
        self.u32_at(c + ABORT_OFF).store(1, Ordering::Release);
        self.u32_at(FUTEX_OFF).fetch_add(1, Ordering::SeqCst);
        futex_wake(self.u32_at(FUTEX_OFF));
        // Then the whole error for the peers (after the flag: a store that does not answer must
        // not keep them waiting; best effort; the TCP mesh publishes the same record under the
        // same key).
        let _ = self.ctx.store.set(&super::mesh::abort_key(&self.ctx.prefix, self.ctx.rank), format!("{origin}\n{err}").as_bytes());
        if let Some(p) = &mut self.p2p {
            p.abort(err);
        }
    }
}

#[cfg(test)]
mod spin_tests {
    use super::*;

    #[test]
    fn the_spin_budget_follows_the_expected_wait() {
        let cap = Duration::from_micros(50);
        let mut b = SpinBudget::new();
        // Nothing known yet: a short spin.
        assert_eq!(b.spin_for(WaitKind::Step, cap), Duration::from_micros(1));
        for _ in 0..20 {
            b.record(WaitKind::Step, Duration::from_micros(8));
            b.record(WaitKind::Arrival, Duration::from_millis(3));
        }
        // Chunk handoffs of ~8 µs: spin about twice that.
        let s = b.spin_for(WaitKind::Step, cap);
        assert!(
            s >= Duration::from_micros(14) && s <= Duration::from_micros(17),
            "{s:?}"
        );
        // A peer milliseconds away: sleep at once.
        assert_eq!(b.spin_for(WaitKind::Arrival, cap), Duration::from_micros(1));
        // Never past the cap.
        for _ in 0..20 {
            b.record(WaitKind::Step, Duration::from_micros(40));
        }
        assert!(b.spin_for(WaitKind::Step, cap) <= cap);
    }
}

#[cfg(test)]
mod sweep_tests {
    use super::*;

    /// Segment files of a creator that is gone and older than the grace are removed; a live
    /// creator's, a fresh one's and other files stay.
    #[test]
    fn stale_segments_of_dead_ranks_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        // A pid that was used and is gone.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let live = std::process::id();
        let old = std::time::SystemTime::now() - STALE_SEGMENT_AGE - Duration::from_secs(5);
        let file = |name: &str, aged: bool| {
            let path = dir.path().join(name);
            let f = std::fs::File::create(&path).unwrap();
            if aged {
                f.set_modified(old).unwrap();
            }
            path
        };
        let stale = [file(&format!("rsrun-comm-{dead}-1a-0"), true), file(&format!("rsrun-win-{dead}-1b-1"), true)];
        let kept = [
            file(&format!("rsrun-comm-{live}-1c-2"), true),
            file(&format!("rsrun-comm-{dead}-1d-3"), false),
            file(&format!("other-{dead}"), true),
        ];
        assert_eq!(sweep_stale_segments(dir.path()), 2);
        for p in &stale {
            assert!(!p.exists(), "{} was left", p.display());
        }
        for p in &kept {
            assert!(p.exists(), "{} was removed", p.display());
        }
    }
}

#[cfg(test)]
mod liveness_tests {
    use super::*;

    /// A peer's exit is seen through its pidfd, through `kill(pid, 0)` where there is no pidfd,
    /// and not at all (never falsely) when its pid belongs to another namespace.
    #[test]
    fn a_peers_exit_is_seen_in_its_namespace_only() {
        let ns = pid_namespace();
        assert!(ns.is_some(), "/proc/self/ns/pid is readable");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let pidfd = Liveness::of(pid, ns, ns);
        assert!(matches!(pidfd, Liveness::Pidfd(_)), "{pidfd:?}");
        let probe = Liveness::Pid(pid as libc::pid_t);
        let other_ns = Liveness::of(pid, ns.map(|n| n + 1), ns);
        assert!(matches!(other_ns, Liveness::Unknown));
        assert!(matches!(Liveness::of(pid, None, ns), Liveness::Unknown), "a peer that sent no namespace");
        assert!(!pidfd.exited() && !probe.exited() && !other_ns.exited());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(pidfd.exited() && probe.exited());
        assert!(!other_ns.exited());
    }
}
