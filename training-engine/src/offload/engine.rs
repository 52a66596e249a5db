//! Asynchronous block I/O: an io_uring driver thread, or a pread/pwrite thread pool.
//!
//! A [`Job`] is a list of phases; each phase is a list of positioned reads or writes, split into
//! `block_size` requests. The engine keeps at most `queue_depth` requests in flight; a phase
//! starts when the previous one completed successfully (the offload pipeline chains "write tile
//! i back, then read tile i+B into the same buffer"). Every completion is checked: a negative
//! result is an OS error naming the file, a short transfer is resubmitted for the rest, and a
//! read that hits end of file is a "truncated" error. Nothing here aborts the process.
//!
//! Buffer safety: requests carry raw pointers. [`IoEngine::submit`] is `unsafe`; its contract is
//! that the memory stays valid and untouched until the returned [`Ticket`] has completed
//! ([`Ticket::wait`], which [`Ticket`]'s `Drop` also does). A failed job still waits for every
//! request already handed to the kernel before it reports completion.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::{EngineKind, OffloadError};

/// Direction of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    Read,
    Write,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Read => "read",
            Dir::Write => "write",
        }
    }
}

/// One positioned transfer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IoReq {
    pub(crate) fd: RawFd,
    pub(crate) offset: u64,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) dir: Dir,
}

// SAFETY: the pointer is only dereferenced by the kernel or a pool thread while the submitter
// keeps the memory alive and unaliased (the contract of `IoEngine::submit`).
unsafe impl Send for IoReq {}

/// A job: phases run one after the other; requests within a phase run concurrently.
pub(crate) struct Job {
    pub(crate) phases: Vec<Vec<IoReq>>,
    /// File the requests go to (for error messages).
    pub(crate) path: Arc<Path>,
}

#[derive(Default)]
struct Progress {
    /// Requests of the current phase not completed yet.
    pending: usize,
    /// Phases not started yet (front is next).
    later: VecDeque<Vec<IoReq>>,
    error: Option<OffloadError>,
    done: bool,
}

struct JobCtx {
    path: Arc<Path>,
    progress: Mutex<Progress>,
    cv: Condvar,
}

impl JobCtx {
    fn lock(&self) -> MutexGuard<'_, Progress> {
        // A poisoned lock only means another thread panicked while holding it; the counters
        // are still meaningful, so keep going rather than propagate the panic.
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self) -> bool {
        self.lock().error.is_some()
    }

    fn fail(&self, err: OffloadError) {
        let mut p = self.lock();
        if p.error.is_none() {
            p.error = Some(err);
        }
    }

    /// One request finished (or was skipped). Returns the next phase's requests when the
    /// current phase is complete and the job has not failed.
    fn finish_one(&self) -> Option<Vec<IoReq>> {
        let mut p = self.lock();
        p.pending -= 1;
        if p.pending > 0 {
            return None;
        }
        loop {
            match p.later.pop_front() {
                Some(next) if p.error.is_none() && !next.is_empty() => {
                    p.pending = next.len();
                    return Some(next);
                }
                Some(_) if p.error.is_none() => continue,
                _ => {
                    p.later.clear();
                    p.done = true;
                    self.cv.notify_all();
                    return None;
                }
            }
        }
    }

    fn error(&self, req: &IoReq, err: io::Error) -> OffloadError {
        OffloadError::Io {
            op: req.dir.name(),
            path: self.path.to_path_buf(),
            offset: req.offset,
            source: err,
        }
    }
}

/// How often a job that has not completed is reported while it is waited for.
const STALL_REPORT: std::time::Duration = std::time::Duration::from_secs(60);

/// Completion handle of a submitted job.
pub(crate) struct Ticket {
    ctx: Option<Arc<JobCtx>>,
}

impl Ticket {
    /// Blocks until every request of the job completed; returns the first error.
    pub(crate) fn wait(mut self) -> Result<(), OffloadError> {
        self.wait_inner()
    }

    fn wait_inner(&mut self) -> Result<(), OffloadError> {
        let Some(ctx) = self.ctx.take() else {
            return Ok(());
        };
        let mut p = ctx.lock();
        // No deadline: the buffers stay lent to the kernel until it answers, so giving up early
        // would break `submit`'s contract. A device that does not answer is said, every minute.
        let started = std::time::Instant::now();
        while !p.done {
            let (next, waited) = ctx
                .cv
                .wait_timeout(p, STALL_REPORT)
                .unwrap_or_else(|e| e.into_inner());
            p = next;
            if waited.timed_out() && !p.done {
                tracing::warn!(
                    path = %ctx.path.display(),
                    pending = p.pending,
                    "offload I/O on {} has not completed after {} s (a stalled or failing device?)",
                    ctx.path.display(),
                    started.elapsed().as_secs()
                );
            }
        }
        match p.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Waiting here keeps the submitted buffers borrowed until the kernel is done with them.
        let _ = self.wait_inner();
    }
}

/// Work handed to the backend: one request of a job.
type Op = (Arc<JobCtx>, IoReq);

/// The asynchronous I/O engine (one per store).
pub(crate) struct IoEngine {
    kind: EngineKind,
    block_size: usize,
    backend: Backend,
}

enum Backend {
    Uring {
        tx: Option<Sender<Op>>,
        thread: Option<JoinHandle<()>>,
    },
    Pool {
        shared: Arc<PoolShared>,
        threads: Vec<JoinHandle<()>>,
    },
}

impl IoEngine {
    /// Starts an engine. `want` = `None` tries io_uring and falls back to the thread pool when
    /// the ring cannot be set up (old kernel, seccomp, `io_uring_disabled` sysctl).
    ///
    /// # Errors
    /// [`OffloadError::Engine`] when io_uring was required and cannot be set up, or a thread
    /// cannot be spawned.
    pub(crate) fn start(
        want: Option<EngineKind>,
        block_size: usize,
        queue_depth: usize,
    ) -> Result<Self, OffloadError> {
        let queue_depth = queue_depth.max(1);
        if want != Some(EngineKind::ThreadPool) {
            let started = usable_ring(queue_depth).and_then(|ring| {
                let (tx, rx) = mpsc::channel();
                let thread = std::thread::Builder::new()
                    .name("rsrun-uring".into())
                    .spawn(move || uring_loop(ring, rx, queue_depth))
                    .map_err(|e| format!("cannot spawn its thread: {e}"))?;
                Ok((tx, thread))
            });
            match started {
                Ok((tx, thread)) => {
                    return Ok(IoEngine {
                        kind: EngineKind::IoUring,
                        block_size,
                        backend: Backend::Uring {
                            tx: Some(tx),
                            thread: Some(thread),
                        },
                    });
                }
                Err(why) if want == Some(EngineKind::IoUring) => {
                    return Err(OffloadError::Engine(format!("io_uring setup failed: {why}")));
                }
                Err(why) => tracing::debug!(%why, "io_uring unusable: pread/pwrite threads instead"),
            }
        }
        let shared = Arc::new(PoolShared {
            queue: Mutex::new(PoolQueue {
                ops: VecDeque::new(),
                closed: false,
            }),
            cv: Condvar::new(),
        });
        let mut threads = Vec::with_capacity(queue_depth);
        for i in 0..queue_depth {
            let worker = shared.clone();
            match std::thread::Builder::new().name(format!("rsrun-aio-{i}")).spawn(move || pool_loop(&worker)) {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The threads started so far wait on the queue: closed, they end.
                    shared.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).closed = true;
                    shared.cv.notify_all();
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(OffloadError::Engine(format!("spawn i/o thread: {e}")));
                }
            }
        }
        Ok(IoEngine {
            kind: EngineKind::ThreadPool,
            block_size,
            backend: Backend::Pool { shared, threads },
        })
    }

    /// Which backend runs.
    pub(crate) fn kind(&self) -> EngineKind {
        self.kind
    }

    /// Submits a job.
    ///
    /// # Safety
    /// Every request's `ptr..ptr+len` must stay valid (and, for reads, not be accessed by
    /// anyone else) until the returned ticket has completed, and `fd` must stay open as long.
    pub(crate) unsafe fn submit(&self, job: Job) -> Ticket {
        let mut phases: VecDeque<Vec<IoReq>> = job
            .phases
            .into_iter()
            .map(|p| split(p, self.block_size))
            .collect();
        let ctx = Arc::new(JobCtx {
            path: job.path,
            progress: Mutex::new(Progress::default()),
            cv: Condvar::new(),
        });
        let first = loop {
            match phases.pop_front() {
                Some(p) if p.is_empty() => continue,
                other => break other,
            }
        };
        let Some(first) = first else {
            let mut p = ctx.lock();
            p.done = true;
            drop(p);
            return Ticket { ctx: Some(ctx) };
        };
        {
            let mut p = ctx.lock();
            p.pending = first.len();
            p.later = phases;
        }
        self.enqueue(&ctx, first);
        Ticket { ctx: Some(ctx) }
    }

    fn enqueue(&self, ctx: &Arc<JobCtx>, reqs: Vec<IoReq>) {
        match &self.backend {
            Backend::Uring { tx, .. } => {
                let mut unsent = reqs.len();
                if let Some(tx) = tx {
                    for r in reqs {
                        if tx.send((ctx.clone(), r)).is_err() {
                            break;
                        }
                        unsent -= 1;
                    }
                }
                // The driver thread is gone (it only exits when the engine is dropped, or if
                // it panicked): fail what it will never complete.
                for _ in 0..unsent {
                    ctx.fail(OffloadError::Engine("io_uring thread stopped".into()));
                    let _ = ctx.finish_one();
                }
            }
            Backend::Pool { shared, .. } => {
                let mut q = shared.lock();
                q.ops.extend(reqs.into_iter().map(|r| (ctx.clone(), r)));
                drop(q);
                shared.cv.notify_all();
            }
        }
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        match &mut self.backend {
            Backend::Uring { tx, thread } => {
                drop(tx.take());
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
            Backend::Pool { shared, threads } => {
                shared.lock().closed = true;
                shared.cv.notify_all();
                for t in threads.drain(..) {
                    let _ = t.join();
                }
            }
        }
    }
}

/// Splits requests into pieces of at most `block` bytes.
fn split(reqs: Vec<IoReq>, block: usize) -> Vec<IoReq> {
    let block = block.max(1);
    let mut out = Vec::with_capacity(reqs.len());
    for r in reqs {
        let mut done = 0;
        while done < r.len {
            let len = block.min(r.len - done);
            out.push(IoReq {
                // The pointer arithmetic stays inside the request's buffer.
                ptr: r.ptr.wrapping_add(done),
                offset: r.offset + done as u64,
                len,
                ..r
            });
            done += len;
        }
    }
    out
}

// === io_uring backend ===

/// A ring of `queue_depth` entries that can do the work: set up, able to read and write (a 5.1 –
/// 5.5 kernel sets a ring up but has no READ/WRITE opcodes: every request failed with EINVAL),
/// and able to enter (a seccomp or LSM rule that allows the setup but not `io_uring_enter` made
/// every request fail); else why not, for the thread pool to take over.
fn usable_ring(queue_depth: usize) -> Result<io_uring::IoUring, String> {
    use io_uring::opcode;
    let mut ring = io_uring::IoUring::new(queue_depth.next_power_of_two() as u32).map_err(|e| e.to_string())?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(|e| format!("cannot probe its opcodes: {e}"))?;
    if !probe.is_supported(opcode::Read::CODE) || !probe.is_supported(opcode::Write::CODE) {
        return Err("the kernel's io_uring has no READ/WRITE (Linux 5.6 or later)".into());
    }
    // SAFETY: a NOP names no memory; the ring is empty, so the push cannot overflow.
    unsafe { ring.submission().push(&opcode::Nop::new().build().user_data(u64::MAX)) }.map_err(|e| e.to_string())?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring_enter failed: {e}"))?;
    let nop = ring.completion().next().map(|c| c.result());
    match nop {
        Some(res) if res >= 0 => Ok(ring),
        Some(res) => Err(format!("a NOP failed: {}", io::Error::from_raw_os_error(-res))),
        None => Err("a NOP did not complete".into()),
    }
}

/// Times one request is reissued after a completion of `EAGAIN` or `EINTR` before it fails: a
/// request the kernel split into several bios completes with `EAGAIN` on older kernels (5.10 –
/// 5.19) when a bio gets no tag at once, and the application must issue it again.
const MAX_REISSUES: u32 = 16;

struct InFlight {
    ctx: Arc<JobCtx>,
    req: IoReq,
    /// Push order: the kernel consumes submission entries in this order.
    seq: u64,
}

/// Consecutive failures of `io_uring_enter` after which the ring is given up.
const MAX_ENTER_FAILURES: u32 = 1000;

/// What the driver does after `io_uring_enter` failed with `errno`, the `streak`-th failure in
/// a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EnterError {
    /// Interrupted, or the kernel is short of memory or completion space for a moment: try
    /// again (after reaping completions).
    Retry,
    /// Fail the requests not handed to the ring yet, and try again.
    FailQueued,
    /// The ring is unusable (a bad descriptor or argument, or failing for good): fail every
    /// request the kernel has not taken, wait for those it has, and stop submitting.
    Dead,
}

fn on_enter_error(errno: Option<i32>, streak: u32) -> EnterError {
    match errno {
        Some(libc::EINTR) => EnterError::Retry,
        Some(libc::EBADF | libc::EBADFD | libc::EFAULT | libc::EINVAL | libc::ENXIO | libc::EOPNOTSUPP) => {
            EnterError::Dead
        }
        _ if streak >= MAX_ENTER_FAILURES => EnterError::Dead,
        Some(libc::EAGAIN | libc::EBUSY) => EnterError::Retry,
        _ => EnterError::FailQueued,
    }
}

/// The in-flight slots whose submission entries the kernel has not consumed: the last
/// `unconsumed` pushed.
fn unconsumed_slots(slots: &[Option<InFlight>], unconsumed: usize) -> Vec<usize> {
    let mut pushed: Vec<(u64, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.as_ref().map(|f| (f.seq, i)))
        .collect();
    pushed.sort_unstable();
    let skip = pushed.len().saturating_sub(unconsumed);
    pushed[skip..].iter().map(|(_, i)| *i).collect()
}

fn uring_loop(mut ring: io_uring::IoUring, rx: Receiver<Op>, queue_depth: usize) {
    let mut queue: VecDeque<Op> = VecDeque::new();
    let mut slots: Vec<Option<InFlight>> = (0..queue_depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..queue_depth).rev().collect();
    let mut closed = false;
    let mut seq = 0u64;
    let mut streak = 0u32;
    // Set once the ring failed for good: why, for every request from then on.
    let mut dead: Option<String> = None;
    // Reissues of requests that completed with EAGAIN/EINTR, by job and offset.
    let mut reissued: std::collections::HashMap<(usize, u64), u32> = std::collections::HashMap::new();
    loop {
        let in_flight = queue_depth - free.len();
        if in_flight == 0 && queue.is_empty() {
            if closed {
                return;
            }
            match rx.recv() {
                Ok(op) => queue.push_back(op),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(op) => queue.push_back(op),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        if let Some(why) = &dead {
            fail_queued(&mut queue, why);
        }
        // Fill the ring up to the queue depth.
        while let Some(slot) = free.last().copied() {
            let Some((ctx, req)) = queue.pop_front() else {
                break;
            };
            if ctx.failed() {
                // The job failed already: skip its remaining requests.
                finish(&ctx, &mut queue);
                continue;
            }
            let entry = match req.dir {
                Dir::Read => io_uring::opcode::Read::new(
                    io_uring::types::Fd(req.fd),
                    req.ptr,
                    req.len as u32,
                )
                .offset(req.offset)
                .build(),
                Dir::Write => io_uring::opcode::Write::new(
                    io_uring::types::Fd(req.fd),
                    req.ptr,
                    req.len as u32,
                )
                .offset(req.offset)
                .build(),
            }
            .user_data(slot as u64);
            // SAFETY: the buffer and fd stay valid until completion (the `submit` contract);
            // the ring has `queue_depth` (rounded up to a power of two) entries and at most
            // `queue_depth` are in flight, so the push cannot overflow.
            let pushed = unsafe { ring.submission().push(&entry) };
            if pushed.is_err() {
                queue.push_front((ctx, req));
                break;
            }
            free.pop();
            seq += 1;
            slots[slot] = Some(InFlight { ctx, req, seq });
        }
        if free.len() == queue_depth {
            continue;
        }
        if dead.is_some() {
            // Nothing is submitted any more: the completions of what the kernel took arrive
            // in the shared completion ring on their own.
            std::thread::sleep(std::time::Duration::from_millis(1));
        } else {
            match ring.submit_and_wait(1) {
                Ok(_) => streak = 0,
                Err(e) => {
                    let interrupted = e.raw_os_error() == Some(libc::EINTR);
                    if !interrupted {
                        streak += 1;
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    let action = on_enter_error(e.raw_os_error(), streak);
                    let msg = format!("io_uring_enter failed: {e}");
                    if action != EnterError::Retry {
                        // Requests already in the kernel still complete (and are reaped below);
                        // fail the ones not handed to the ring yet.
                        fail_queued(&mut queue, &msg);
                    }
                    if action == EnterError::Dead {
                        let why = format!("{msg}; this store's io_uring stopped (after {streak} failures in a row)");
                        tracing::error!("{why}");
                        // Without SQPOLL the kernel reads submission entries only inside
                        // io_uring_enter, which is never called again: those it did not
                        // consume will never be read, so their buffers are free now.
                        let unconsumed = ring.submission().len();
                        for slot in unconsumed_slots(&slots, unconsumed) {
                            if let Some(InFlight { ctx, .. }) = slots[slot].take() {
                                free.push(slot);
                                ctx.fail(OffloadError::Engine(why.clone()));
                                finish(&ctx, &mut queue);
                            }
                        }
                        dead = Some(why);
                    }
                }
            }
        }
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in done {
            let slot = slot as usize;
            let Some(InFlight { ctx, req, .. }) = slots.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            free.push(slot);
            let key = (Arc::as_ptr(&ctx) as usize, req.offset);
            let tries = if reissued.is_empty() { 0 } else { reissued.remove(&key).unwrap_or(0) };
            if (res == -libc::EAGAIN || res == -libc::EINTR) && tries < MAX_REISSUES && !ctx.failed() {
                // The same request again (a read, or the same bytes written: idempotent), after
                // a pause that grows with the tries.
                reissued.insert(key, tries + 1);
                std::thread::sleep(std::time::Duration::from_millis(u64::from(tries + 1)));
                queue.push_front((ctx, req));
            } else if res < 0 {
                ctx.fail(ctx.error(&req, io::Error::from_raw_os_error(-res)));
                finish(&ctx, &mut queue);
            } else if res == 0 {
                ctx.fail(ctx.error(&req, zero_transfer(req.dir)));
                finish(&ctx, &mut queue);
            } else if (res as usize) < req.len {
                // Short transfer: resubmit the rest first.
                let n = block_aligned(res as usize);
                let rest = IoReq {
                    ptr: req.ptr.wrapping_add(n),
                    offset: req.offset + n as u64,
                    len: req.len - n,
                    ..req
                };
                queue.push_front((ctx, rest));
            } else {
                finish(&ctx, &mut queue);
            }
        }
    }
}

/// Fails every request not handed to the ring yet, with `why`.
fn fail_queued(queue: &mut VecDeque<Op>, why: &str) {
    for (ctx, _) in std::mem::take(queue) {
        ctx.fail(OffloadError::Engine(why.to_owned()));
        finish(&ctx, queue);
    }
}

fn finish(ctx: &Arc<JobCtx>, queue: &mut VecDeque<Op>) {
    if let Some(next) = ctx.finish_one() {
        queue.extend(next.into_iter().map(|r| (ctx.clone(), r)));
    }
}

fn zero_transfer(dir: Dir) -> io::Error {
    match dir {
        Dir::Read => io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "unexpected end of file (truncated)",
        ),
        Dir::Write => io::Error::new(io::ErrorKind::WriteZero, "write returned 0 bytes"),
    }
}

// === thread-pool backend ===

struct PoolQueue {
    ops: VecDeque<Op>,
    closed: bool,
}

struct PoolShared {
    queue: Mutex<PoolQueue>,
    cv: Condvar,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolQueue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn pool_loop(shared: &PoolShared) {
    loop {
        let (ctx, req) = {
            let mut q = shared.lock();
            loop {
                if let Some(op) = q.ops.pop_front() {
                    break op;
                }
                if q.closed {
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        if !ctx.failed()
            && let Err(e) = positioned(&req)
        {
            ctx.fail(ctx.error(&req, e));
        }
        if let Some(next) = ctx.finish_one() {
            let mut q = shared.lock();
            q.ops.extend(next.into_iter().map(|r| (ctx.clone(), r)));
            drop(q);
            shared.cv.notify_all();
        }
    }
}

/// pread/pwrite the whole request, retrying short transfers and EINTR.
fn positioned(req: &IoReq) -> io::Result<()> {
    let mut done = 0usize;
    while done < req.len {
        let ptr = req.ptr.wrapping_add(done);
        let len = req.len - done;
        let off = (req.offset + done as u64) as libc::off_t;
        // SAFETY: `ptr..ptr+len` is inside the request's buffer, valid per the submit contract.
        let n = unsafe {
            match req.dir {
                Dir::Read => libc::pread(req.fd, ptr.cast(), len, off),
                Dir::Write => libc::pwrite(req.fd, ptr.cast(), len, off),
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(zero_transfer(req.dir));
        }
        done += block_aligned(n as usize);
    }
    Ok(())
}

/// How much of a short transfer of `n` bytes counts as done: whole blocks of [`ALIGN`] when there
/// is at least one. The swap file is opened with O_DIRECT, where the rest must start on a block
/// boundary (a resubmission from the middle of a block fails with EINVAL, which would hide the
/// cause); the part of a block done twice is the same bytes again.
///
/// [`ALIGN`]: super::aligned::ALIGN
fn block_aligned(n: usize) -> usize {
    let align = super::aligned::ALIGN;
    if n >= align { n - n % align } else { n }
}

#[cfg(test)]
mod enter_tests {
    use super::*;

    /// A short O_DIRECT transfer goes on from a block boundary; less than a block counts as is.
    #[test]
    fn short_transfers_resume_on_a_block_boundary() {
        assert_eq!(block_aligned(4096 * 3 + 512), 4096 * 3);
        assert_eq!(block_aligned(8192), 8192);
        assert_eq!(block_aligned(1000), 1000);
    }

    #[test]
    fn enter_errors_retry_fail_the_queue_or_stop_the_ring() {
        assert_eq!(on_enter_error(Some(libc::EINTR), 0), EnterError::Retry);
        assert_eq!(on_enter_error(Some(libc::EAGAIN), 3), EnterError::Retry);
        assert_eq!(on_enter_error(Some(libc::EBUSY), 3), EnterError::Retry);
        assert_eq!(on_enter_error(Some(libc::ENOMEM), 1), EnterError::FailQueued);
        assert_eq!(on_enter_error(None, 1), EnterError::FailQueued);
        for fatal in [libc::EBADF, libc::EFAULT, libc::EINVAL, libc::ENXIO, libc::EOPNOTSUPP] {
            assert_eq!(on_enter_error(Some(fatal), 1), EnterError::Dead, "errno {fatal}");
        }
        // Anything that keeps failing stops the ring, even what is transient once.
        assert_eq!(on_enter_error(Some(libc::EAGAIN), MAX_ENTER_FAILURES), EnterError::Dead);
        assert_eq!(on_enter_error(Some(libc::ENOMEM), MAX_ENTER_FAILURES), EnterError::Dead);
    }

    #[test]
    fn the_entries_the_kernel_did_not_take_are_the_last_pushed() {
        let ctx = Arc::new(JobCtx {
            path: Arc::from(Path::new("/tmp/x")),
            progress: Mutex::new(Progress::default()),
            cv: Condvar::new(),
        });
        let req = IoReq { fd: -1, offset: 0, ptr: std::ptr::null_mut(), len: 1, dir: Dir::Read };
        let mut slots: Vec<Option<InFlight>> = (0..6).map(|_| None).collect();
        // Slots are reused out of order: the push sequence decides, not the slot index.
        for (slot, seq) in [(4, 1), (0, 2), (5, 3), (2, 4)] {
            slots[slot] = Some(InFlight { ctx: ctx.clone(), req, seq });
        }
        assert_eq!(unconsumed_slots(&slots, 0), Vec::<usize>::new());
        assert_eq!(unconsumed_slots(&slots, 2), vec![5, 2]);
        assert_eq!(unconsumed_slots(&slots, 9), vec![4, 0, 5, 2]);
    }
}
