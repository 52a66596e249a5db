//! Asynchronous block I/O: an io_uring driver thread, or a pread/pwrite thread pool.
//!
//! A [`Job`] is a list of phases; each phase is a list of positioned reads or writes, split into
//! `block_size` requests. The engine keeps at most `queue_depth` requests in flight; a phase
//! starts when the previous one completed successfully (the offload pipeline chains "write tile
//! i back, then read tile i+B into the same buffer"). Every completion is checked: a negative
//! result is an OS error naming the file, a short transfer is resubmitted for the rest, and a
//! read that hits end of file is a "truncated" error. Nothing here aborts the process.
//!
//! # Buffer ownership
//! A job owns what its requests point into, its [`Lease`] (the buffer, and the file behind the
//! descriptor), so [`IoEngine::submit`] is safe: its spans are checked against the buffer and
//! turned into raw requests inside the engine. The lease lives in the job's shared context
//! (`JobCtx`), and the backend holds an `Arc` of that context for every request of the job it
//! has queued, is running in a pool thread's syscall, or has handed to the kernel.
//!
//! **Invariant:** a lease is handed back or freed only when no request of its job can touch it
//! any more: [`Ticket::wait`] takes it back once the job is done (every request completed, or
//! was skipped without being issued); otherwise it is freed with the context, when the last
//! `Arc` goes, i.e. after the backend let go of the job's last request. A request the kernel
//! never answers keeps it forever: leaked on purpose (its `InFlight` slot is forgotten even if
//! the driver thread unwinds), never freed under the kernel.
//!
//! # Deadlines
//! [`Ticket::wait`] waits at most the engine's `io_timeout` (a stalled job is reported every
//! minute until then). On expiry it returns [`OffloadError::TimedOut`] without the lease (the
//! job keeps it, see above), marks the job failed (its requests not issued yet are skipped) and
//! poisons the engine: every later job fails at once with [`OffloadError::Poisoned`], and a
//! wait on a job that is still running gives up at once too. Dropping a [`Ticket`] does not
//! wait: it cancels what was not issued and leaves the lease with the job. Dropping the engine
//! waits for its threads up to `io_timeout` (a short grace once poisoned), then leaves those
//! still stuck in a request running, detached, with what they hold. (The backend threads' own
//! waits for work are not waits for an answer: they end when the engine closes.)

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{AlignedBuf, EngineKind, MAX_IO_TIMEOUT, OffloadError, check_io_timeout};

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

/// One positioned transfer, as the backends issue it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IoReq {
    pub(crate) fd: RawFd,
    pub(crate) offset: u64,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    pub(crate) dir: Dir,
}

// SAFETY: the pointer points into the lease of the request's job, which the job's context owns
// as long as any request of the job is queued or in flight (the module's invariant); it is only
// dereferenced by the kernel or a pool thread.
unsafe impl Send for IoReq {}

/// One transfer of a [`Job`]: `len` bytes at byte `at` of the job's buffer, read from or
/// written to `offset` in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) offset: u64,
    pub(crate) at: usize,
    pub(crate) len: usize,
    pub(crate) dir: Dir,
}

/// What a job's requests point into: the buffer they read into or write from, and the file
/// behind their descriptor (kept open, so that a late request never goes to another file that
/// reused the number). Owned by the job from [`IoEngine::submit`] until [`Ticket::wait`] hands
/// it back.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) buf: AlignedBuf,
    pub(crate) file: Arc<File>,
}

/// A job: phases run one after the other; requests within a phase run concurrently.
pub(crate) struct Job {
    pub(crate) phases: Vec<Vec<Span>>,
    /// File the requests go to (for error messages).
    pub(crate) path: Arc<Path>,
    pub(crate) lease: Lease,
}

#[derive(Default)]
struct Progress {
    /// Requests of the current phase not completed yet.
    pending: usize,
    /// Phases not started yet (front is next).
    later: VecDeque<Vec<IoReq>>,
    error: Option<OffloadError>,
    done: bool,
    /// The job's buffer and file: here from `submit` until the ticket takes them back (the job
    /// is done), or, when the ticket gave up on the job, until the context is dropped.
    lease: Option<Lease>,
    /// Direction and first file offset of the current phase (for the timeout error).
    phase: Option<(Dir, u64)>,
}

/// Makes `reqs` the current phase.
fn start_phase(p: &mut Progress, reqs: &[IoReq]) {
    p.pending = reqs.len();
    p.phase = reqs.iter().min_by_key(|r| r.offset).map(|r| (r.dir, r.offset));
}

/// Marks a job that its ticket gave up on (timed out, or dropped) as failed: the backend skips
/// the requests it has not issued yet, and starts no further phase. The lease stays with the job.
fn abandon(p: &mut Progress, why: &str) {
    if p.error.is_none() {
        p.error = Some(OffloadError::Engine(why.to_owned()));
    }
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

    /// Ends a job that issued nothing: its lease goes straight back to the ticket.
    fn finish_now(&self, lease: Lease, error: Option<OffloadError>) {
        let mut p = self.lock();
        p.lease = Some(lease);
        p.error = error;
        p.done = true;
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
                    start_phase(&mut p, &next);
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
const STALL_REPORT: Duration = Duration::from_secs(60);

/// How long dropping a poisoned engine waits for its threads (one is stuck in a request the
/// device did not answer; the others end at once).
const POISONED_GRACE: Duration = Duration::from_millis(100);

/// Completion handle of a submitted job.
pub(crate) struct Ticket {
    ctx: Option<Arc<JobCtx>>,
    /// The engine's `io_timeout`.
    timeout: Duration,
    /// The engine's poison, set by the first wait that times out.
    poison: Arc<OnceLock<String>>,
}

impl Ticket {
    /// Waits until every request of the job completed, at most the engine's `io_timeout`;
    /// returns the job's result (the first error) and its lease.
    ///
    /// The lease is `None` only with an error, when the job is not done: it did not complete in
    /// time ([`OffloadError::TimedOut`], which poisons the engine), or another job of the engine
    /// had timed out already ([`OffloadError::Poisoned`]). The job keeps the lease then, and
    /// frees it once the backend let go of its last request.
    pub(crate) fn wait(mut self) -> (Result<(), OffloadError>, Option<Lease>) {
        let Some(ctx) = self.ctx.take() else {
            // Only `wait`, which consumes the ticket, and `drop` take the context.
            return (Err(OffloadError::Engine("a job was waited for twice".into())), None);
        };
        let started = Instant::now();
        // The timeout is validated (at most a day), so the sums cannot overflow.
        let deadline = started + self.timeout.min(MAX_IO_TIMEOUT);
        let mut report = started + STALL_REPORT;
        let mut p = ctx.lock();
        loop {
            if p.done {
                let lease = p.lease.take();
                let result = p.error.take().map_or(Ok(()), Err);
                return (result, lease);
            }
            if let Some(why) = self.poison.get() {
                // Another job of this engine did not complete in time: the device is not
                // answering, so do not wait the whole timeout again for this one.
                abandon(&mut p, "given up: the engine is poisoned");
                let err = OffloadError::Poisoned {
                    path: ctx.path.to_path_buf(),
                    reason: why.clone(),
                };
                return (Err(err), None);
            }
            let now = Instant::now();
            if now >= deadline {
                let (dir, offset) = p.phase.unwrap_or((Dir::Read, 0));
                let err = OffloadError::TimedOut {
                    op: dir.name(),
                    path: ctx.path.to_path_buf(),
                    offset,
                    pending: p.pending,
                    timeout: self.timeout,
                };
                abandon(&mut p, "given up: it did not complete in time");
                let _ = self.poison.set(err.to_string());
                tracing::error!(
                    path = %ctx.path.display(),
                    pending = p.pending,
                    "{err}; this offload tier is unusable from now on (its buffers stay lent to the requests in flight)"
                );
                return (Err(err), None);
            }
            let (next, _) = ctx
                .cv
                .wait_timeout(p, deadline.min(report).saturating_duration_since(now))
                .unwrap_or_else(|e| e.into_inner());
            p = next;
            if !p.done && report < deadline && Instant::now() >= report {
                tracing::warn!(
                    path = %ctx.path.display(),
                    pending = p.pending,
                    "offload I/O on {} has not completed after {} s (a stalled or failing device?); giving up after {:?}",
                    ctx.path.display(),
                    started.elapsed().as_secs(),
                    self.timeout
                );
                report += STALL_REPORT;
            }
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // No wait: the job owns its lease until the backend let go of its last request. What
        // was not issued yet is skipped.
        if let Some(ctx) = self.ctx.take() {
            let mut p = ctx.lock();
            if !p.done {
                abandon(&mut p, "its ticket was dropped before it completed");
            }
        }
    }
}

/// Work handed to the backend: one request of a job.
type Op = (Arc<JobCtx>, IoReq);

/// A test hook: while held, every request a backend is about to issue waits, as if the device
/// did not answer it. Nothing in other builds.
#[derive(Clone, Default)]
struct Hook {
    #[cfg(test)]
    gate: Arc<Gate>,
}

impl Hook {
    /// Called by a backend with a request it is about to issue (the job has not failed).
    fn before_io(&self) {
        #[cfg(test)]
        self.gate.pass();
    }
}

#[cfg(test)]
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    cv: Condvar,
}

#[cfg(test)]
#[derive(Default)]
struct GateState {
    held: bool,
    /// Requests waiting at the gate.
    waiting: usize,
}

#[cfg(test)]
impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pass(&self) {
        // The tests release the gate; a deadline all the same, so that a failing test never
        // leaves a thread stuck.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut s = self.lock();
        s.waiting += 1;
        while s.held {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            s = self.cv.wait_timeout(s, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
        s.waiting -= 1;
    }
}

#[cfg(test)]
impl IoEngine {
    /// Holds (`true`) or releases every request that the backend is about to issue from now on.
    pub(crate) fn hold(&self, held: bool) {
        self.hook.gate.lock().held = held;
        self.hook.gate.cv.notify_all();
    }

    /// Requests held now.
    pub(crate) fn held(&self) -> usize {
        self.hook.gate.lock().waiting
    }
}

/// The asynchronous I/O engine (one per store).
pub(crate) struct IoEngine {
    kind: EngineKind,
    block_size: usize,
    io_timeout: Duration,
    /// Set by the first wait that timed out: why. Every later job fails at once.
    poison: Arc<OnceLock<String>>,
    // Read by the test-only `hold`/`held`.
    #[cfg_attr(not(test), allow(dead_code))]
    hook: Hook,
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
    /// Starts an engine whose waits last at most `io_timeout`. `want` = `None` tries io_uring
    /// and falls back to the thread pool when the ring cannot be set up (old kernel, seccomp,
    /// `io_uring_disabled` sysctl).
    ///
    /// # Errors
    /// [`OffloadError::InvalidArgument`] for an `io_timeout` out of range;
    /// [`OffloadError::Engine`] when io_uring was required and cannot be set up, or a thread
    /// cannot be spawned.
    pub(crate) fn start(
        want: Option<EngineKind>,
        block_size: usize,
        queue_depth: usize,
        io_timeout: Duration,
    ) -> Result<Self, OffloadError> {
        check_io_timeout(io_timeout)?;
        let queue_depth = queue_depth.max(1);
        let hook = Hook::default();
        let poison = Arc::new(OnceLock::new());
        if want != Some(EngineKind::ThreadPool) {
            let ring_hook = hook.clone();
            let started = usable_ring(queue_depth).and_then(|ring| {
                let (tx, rx) = mpsc::channel();
                let thread = std::thread::Builder::new()
                    .name("rsrun-uring".into())
                    .spawn(move || uring_loop(ring, rx, queue_depth, ring_hook))
                    .map_err(|e| format!("cannot spawn its thread: {e}"))?;
                Ok((tx, thread))
            });
            match started {
                Ok((tx, thread)) => {
                    return Ok(IoEngine {
                        kind: EngineKind::IoUring,
                        block_size,
                        io_timeout,
                        poison,
                        hook,
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
            let worker_hook = hook.clone();
            match std::thread::Builder::new()
                .name(format!("rsrun-aio-{i}"))
                .spawn(move || pool_loop(&worker, &worker_hook))
            {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The threads started so far wait on the queue: closed, they end.
                    shared.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).closed = true;
                    shared.cv.notify_all();
                    let deadline = Instant::now() + io_timeout;
                    for t in threads {
                        join_by(t, deadline);
                    }
                    return Err(OffloadError::Engine(format!("spawn i/o thread: {e}")));
                }
            }
        }
        Ok(IoEngine {
            kind: EngineKind::ThreadPool,
            block_size,
            io_timeout,
            poison,
            hook,
            backend: Backend::Pool { shared, threads },
        })
    }

    /// Which backend runs.
    pub(crate) fn kind(&self) -> EngineKind {
        self.kind
    }

    /// Why the engine is unusable: a wait gave up on a job the device did not complete in time.
    pub(crate) fn poisoned(&self) -> Option<&str> {
        self.poison.get().map(String::as_str)
    }

    /// Submits a job; it owns its lease until [`Ticket::wait`] hands it back (see the module
    /// docs). A span outside the lease's buffer fails the job with
    /// [`OffloadError::InvalidArgument`], and a poisoned engine fails it with
    /// [`OffloadError::Poisoned`], both before anything is issued.
    pub(crate) fn submit(&self, job: Job) -> Ticket {
        let Job {
            phases,
            path,
            mut lease,
        } = job;
        let ctx = Arc::new(JobCtx {
            path,
            progress: Mutex::new(Progress::default()),
            cv: Condvar::new(),
        });
        let ticket = Ticket {
            ctx: Some(ctx.clone()),
            timeout: self.io_timeout,
            poison: self.poison.clone(),
        };
        if let Some(why) = self.poison.get() {
            let err = OffloadError::Poisoned {
                path: ctx.path.to_path_buf(),
                reason: why.clone(),
            };
            ctx.finish_now(lease, Some(err));
            return ticket;
        }
        let cap = lease.buf.capacity_bytes();
        if let Some(s) = phases
            .iter()
            .flatten()
            .find(|s| s.at.checked_add(s.len).is_none_or(|end| end > cap))
        {
            let err = OffloadError::InvalidArgument(format!(
                "a {} of {} bytes at byte {} of a {cap}-byte buffer",
                s.dir.name(),
                s.len,
                s.at
            ));
            ctx.finish_now(lease, Some(err));
            return ticket;
        }
        let fd = lease.file.as_raw_fd();
        // The allocation does not move with the `AlignedBuf` that owns it: the pointers stay
        // valid while the lease sits in the job's context.
        let base = lease.buf.as_mut_ptr();
        let mut phases: VecDeque<Vec<IoReq>> = phases
            .into_iter()
            .map(|p| {
                let reqs = p
                    .into_iter()
                    .map(|s| IoReq {
                        fd,
                        offset: s.offset,
                        // Inside the buffer: checked above.
                        ptr: base.wrapping_add(s.at),
                        len: s.len,
                        dir: s.dir,
                    })
                    .collect();
                split(reqs, self.block_size)
            })
            .collect();
        let first = loop {
            match phases.pop_front() {
                Some(p) if p.is_empty() => continue,
                other => break other,
            }
        };
        let mut p = ctx.lock();
        p.lease = Some(lease);
        let Some(first) = first else {
            p.done = true;
            drop(p);
            return ticket;
        };
        start_phase(&mut p, &first);
        p.later = phases;
        drop(p);
        self.enqueue(&ctx, first);
        ticket
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
        // The threads end once the requests they hold are done. One stuck in a request the
        // device never answers is left running after the deadline, detached, with the jobs it
        // holds: their leases are leaked, never freed under the kernel.
        let grace = if self.poison.get().is_some() { POISONED_GRACE } else { self.io_timeout };
        let deadline = Instant::now() + grace.min(MAX_IO_TIMEOUT);
        match &mut self.backend {
            Backend::Uring { tx, thread } => {
                drop(tx.take());
                if let Some(t) = thread.take() {
                    join_by(t, deadline);
                }
            }
            Backend::Pool { shared, threads } => {
                shared.lock().closed = true;
                shared.cv.notify_all();
                for t in threads.drain(..) {
                    join_by(t, deadline);
                }
            }
        }
    }
}

/// Joins `t` if it ends by `deadline`; else leaves it running (detached), and says so.
fn join_by(t: JoinHandle<()>, deadline: Instant) {
    let mut pause = Duration::from_micros(50);
    while !t.is_finished() {
        if Instant::now() >= deadline {
            tracing::warn!(
                thread = t.thread().name().unwrap_or("?"),
                "an offload i/o thread did not end in time (a request the device does not answer?): left running, with the buffers of the requests it holds"
            );
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
    let _ = t.join();
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

/// The driver's in-flight slots. An entry still here when they are dropped (only if the driver
/// thread unwinds: it returns only with nothing in flight) was handed to the kernel, which may
/// still use its buffer: it is forgotten, its job's lease leaked, rather than freed.
struct Slots(Vec<Option<InFlight>>);

impl Drop for Slots {
    fn drop(&mut self) {
        for slot in &mut self.0 {
            if let Some(in_flight) = slot.take() {
                std::mem::forget(in_flight);
            }
        }
    }
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

fn uring_loop(mut ring: io_uring::IoUring, rx: Receiver<Op>, queue_depth: usize, hook: Hook) {
    let mut queue: VecDeque<Op> = VecDeque::new();
    let mut slots = Slots((0..queue_depth).map(|_| None).collect());
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
            hook.before_io();
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
            // SAFETY: the buffer and the file are the job's lease, which its context (held by
            // the slot below until the completion is reaped) owns; the ring has `queue_depth`
            // (rounded up to a power of two) entries and at most `queue_depth` are in flight,
            // so the push cannot overflow.
            let pushed = unsafe { ring.submission().push(&entry) };
            if pushed.is_err() {
                queue.push_front((ctx, req));
                break;
            }
            free.pop();
            seq += 1;
            slots.0[slot] = Some(InFlight { ctx, req, seq });
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
                        for slot in unconsumed_slots(&slots.0, unconsumed) {
                            if let Some(InFlight { ctx, .. }) = slots.0[slot].take() {
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
            let Some(InFlight { ctx, req, .. }) = slots.0.get_mut(slot).and_then(Option::take) else {
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

fn pool_loop(shared: &PoolShared, hook: &Hook) {
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
        if !ctx.failed() {
            hook.before_io();
            if let Err(e) = positioned(&req) {
                ctx.fail(ctx.error(&req, e));
            }
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
        // SAFETY: `ptr..ptr+len` is inside the request's buffer, its job's lease, which the job's
        // context (held by this thread's op) owns.
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
