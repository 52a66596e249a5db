//! Starting worker processes so that none outlives rsrun.
//!
//! Every worker:
//! - runs in a session of its own (`setsid`, as torchrun's `start_new_session=True`), and so in a
//!   process group of its own, which — the worker and whatever it started — is signalled as one
//!   (`killpg`). Outside rsrun's session the terminal is not its controlling terminal, so a worker
//!   that reads an inherited terminal (`breakpoint()` under `--nproc-per-node 1`) reads it instead
//!   of being stopped by `SIGTTIN` as a background group of rsrun's session would be;
//! - has `PR_SET_PDEATHSIG = SIGKILL`, so it dies with rsrun even on `kill -9`. rsrun forks workers
//!   only from the runtime's one thread (a current-thread runtime on the main thread): the death signal
//!   follows the *thread* that forked, and the main thread lives as long as the process;
//! - is owned by a [`WorkerProcess`] whose drop kills its group;
//! - gets rsrun's stdin, as torchrun's workers do, or /dev/null ([`WorkerStdin`]: an agent's stdin
//!   carries its head's messages), and stdout/stderr as pipes (see [`crate::logs`]);
//! - optionally gets a datagram socket for progress reports (`RSRUN_PROGRESS_FD`) and a CPU affinity;
//! - inherits no other descriptor: whatever rsrun itself inherited without `FD_CLOEXEC` (a
//!   scheduler's pipe, a shell's redirection) is closed at exec (`close_range(3, ~0,
//!   CLOSE_RANGE_CLOEXEC)`, and on kernels without it, before 5.11, [`close_inherited_on_exec`]
//!   at rsrun's start).
//!
//! Grandchildren that outlive their worker would escape PDEATHSIG; the [`Guardian`] covers them: a
//! small process forked at startup, in its own session, that holds the read end of a pipe from rsrun.
//! rsrun tells it each worker's process group; when the pipe reaches EOF — rsrun exited, however it
//! exited, `kill -9` included — the guardian SIGKILLs every group it was told about. A process that
//! left its worker's group (`setsid`, a daemon's double fork) is in none of those groups, and after
//! a `kill -9` rsrun is no longer there to have adopted it (see [`become_subreaper`]): every worker
//! carries this launch's random mark in `RSRUN_LAUNCH_MARKS` and passes it on to what it starts, so
//! whenever rsrun is gone (after a normal end too, not only a `kill -9`) the guardian also stops,
//! then SIGKILLs, every process of ours whose environment carries the mark (`kill_marked`).
//!
//! The mark is looked for in each process's *initial* environment block (`/proc/PID/environ`, what
//! it was exec'd with), so a process that escapes it is not found by it: one exec'd with a fresh
//! environment (`env -i`, Python's `subprocess` with `env={...}`, `sudo` with `env_reset`), or one
//! that overwrote that area of its memory (`setproctitle` may). Such a process is still killed at a
//! normal end of rsrun when rsrun adopted it ([`kill_adopted`]); after a `kill -9` of rsrun, only
//! when it stayed in its worker's process group.

use std::io::{self, BufRead, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram as StdUnixDatagram;
use std::path::Path;
use std::process::Stdio;
use std::sync::Mutex;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, ChildStderr, ChildStdout, Command};

/// CPUs this process may run on, ascending (empty when unreadable).
pub fn allowed_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect(),
        Err(_) => Vec::new(),
    }
}

/// What to start.
#[derive(Debug)]
pub struct SpawnSpec<'a> {
    /// Executable (absolute or relative to the current directory).
    pub exe: &'a Path,
    /// argv\[1..\].
    pub argv: Vec<String>,
    /// Variables set on top of rsrun's environment (values as the OS has them: paths may not be
    /// UTF-8).
    pub env: Vec<(String, std::ffi::OsString)>,
    /// CPU affinity; `None` inherits rsrun's.
    pub cpus: Option<&'a [usize]>,
    /// Give the worker a progress socket (RSRUN_PROGRESS_FD).
    pub progress: bool,
    /// What the worker reads as its stdin.
    pub stdin: WorkerStdin,
}

/// What a worker reads as its stdin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerStdin {
    /// rsrun's own stdin, as torchrun's workers get theirs: a terminal, a pipe, a file.
    Inherit,
    /// /dev/null: the agent of a whole-job launch, whose stdin is its head's message stream.
    Null,
}

/// A started worker: the process handle and its pipes.
#[derive(Debug)]
pub struct Spawned {
    /// Owns the process group.
    pub process: WorkerProcess,
    /// The child, for `wait`. Dropping it kills the worker process itself (`kill_on_drop`).
    pub child: Child,
    /// The worker's stdout.
    pub stdout: ChildStdout,
    /// The worker's stderr.
    pub stderr: ChildStderr,
    /// rsrun's end of the progress socket.
    pub progress: Option<tokio::net::UnixDatagram>,
}

/// Owns a worker's process group: dropping it SIGKILLs the group (unless [`WorkerProcess::disarm`]ed).
#[derive(Debug)]
pub struct WorkerProcess {
    pid: i32,
    armed: bool,
}

impl WorkerProcess {
    /// The worker's pid, which is also its process group id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Sends `sig` to the worker's whole process group. Errors (the group is gone) are ignored.
    pub fn signal_group(&self, sig: Signal) {
        if self.armed {
            let _ = killpg(Pid::from_raw(self.pid), sig);
        }
    }

    /// Stops signalling the group: it was torn down (SIGKILLed and the leader reaped), and its id may
    /// be reused by an unrelated process group from now on.
    pub fn disarm(&mut self) {
        self.armed = false;
    }

    /// Whether dropping this value still signals the group.
    pub fn is_armed(&self) -> bool {
        self.armed
    }

    /// Whether the group still has a process (`killpg(pgid, 0)`; `EPERM` means it has one). Once the
    /// leader is reaped and this is false, the id may be reused by an unrelated group.
    pub fn group_exists(&self) -> bool {
        group_exists(self.pid)
    }
}

/// Whether process group `pgid` still has a process (`killpg(pgid, 0)`; `EPERM` means it has one).
pub fn group_exists(pgid: i32) -> bool {
    !matches!(killpg(Pid::from_raw(pgid), None), Err(nix::errno::Errno::ESRCH))
}

/// Whether one of process groups `pgids` has a process that is not a zombie (a zombie has
/// exited: where rsrun runs as PID 1 nobody may reap the orphans, and waiting for them would
/// always take the whole grace), in one scan of `/proc`. Without a readable `/proc`, whether one
/// of them has any process.
pub fn any_group_running(pgids: &[i32]) -> bool {
    let fallback = || pgids.iter().any(|g| group_exists(*g));
    let Ok(dir) = std::fs::read_dir("/proc") else { return fallback() };
    let mut read_any = false;
    for e in dir.flatten() {
        let name = e.file_name();
        if !name.to_str().is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        // A process may exit between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        read_any = true;
        if let Some((state, pgrp)) = stat_state_and_group(&stat)
            && pgids.contains(&pgrp)
            && !matches!(state, 'Z' | 'X')
        {
            return true;
        }
    }
    // Nothing readable: ask the groups themselves.
    if read_any { false } else { fallback() }
}

/// The state and process group of a `/proc/<pid>/stat` line (`pid (comm) state ppid pgrp ...`;
/// `comm` may hold spaces and parentheses, so the fields start after the last `)`).
pub(crate) fn stat_state_and_group(stat: &str) -> Option<(char, i32)> {
    stat_fields(stat).map(|(state, _, pgrp)| (state, pgrp))
}

/// The fields of a `/proc/<pid>/stat` line after `comm` (which may hold spaces and
/// parentheses): from the 3rd, the state, on.
fn stat_after_comm(stat: &str) -> Option<&str> {
    Some(&stat[stat.rfind(')')? + 1..])
}

/// The state, parent and process group of a `/proc/<pid>/stat` line.
fn stat_fields(stat: &str) -> Option<(char, i32, i32)> {
    let mut f = stat_after_comm(stat)?.split_ascii_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((state, ppid, f.next()?.parse().ok()?))
}

/// Marks every descriptor rsrun inherited above stderr close-on-exec (call it first in `main`).
pub fn close_inherited_on_exec() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return };
    // Collected first: the listing itself holds a descriptor.
    let fds: Vec<i32> = dir.flatten().filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok())).filter(|fd| *fd > 2).collect();
    for fd in fds {
        // SAFETY: fcntl on a descriptor number; one that is gone (the listing's own) fails harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
            }
        }
    }
}

/// Makes rsrun the subreaper of everything its workers start: a process that leaves its worker's
/// process group (`setsid`, Python's `start_new_session=True`, a daemon's double fork) and outlives
/// its parent becomes rsrun's child instead of init's, so that [`kill_adopted`] finds it. Call it
/// before any worker starts.
pub fn become_subreaper() {
    // SAFETY: a plain prctl on this process.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        tracing::debug!(err = %io::Error::last_os_error(), "PR_SET_CHILD_SUBREAPER refused: processes that leave their worker's group are not followed");
        return;
    }
    SUBREAPER.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Set once [`become_subreaper`] succeeded: only then are rsrun's other children its adoptions (a
/// test process runs other tests' workers as its children too).
static SUBREAPER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Kills what rsrun adopted (see [`become_subreaper`]): its children that are no worker (a worker
/// is only ever signalled as its group), not the guardian (`guardian`, 0 for none) and not in
/// rsrun's own process group (what rsrun itself runs: `scontrol`); their groups with them (a
/// `setsid` process leads its own). Reaps those that died. Returns the pids killed.
pub fn kill_adopted(guardian: i32, workers: &[i32]) -> Vec<i32> {
    if !SUBREAPER.load(std::sync::atomic::Ordering::Relaxed) {
        return Vec::new();
    }
    let me = std::process::id() as i32;
    // SAFETY: getpgrp cannot fail.
    let own_group = unsafe { libc::getpgrp() };
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut adopted = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if pid == guardian || workers.contains(&pid) {
            continue;
        }
        // A process may exit between the listing and the read.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        if let Some((state, ppid, pgrp)) = stat_fields(&stat)
            && ppid == me
            && pgrp != own_group
        {
            adopted.push((pid, pgrp, state));
        }
    }
    let mut killed = Vec::new();
    for &(pid, pgrp, state) in &adopted {
        if !matches!(state, 'Z' | 'X') {
            // SAFETY: plain kill(2) of a process that is our child (it cannot be reaped, and its
            // pid reused, before we wait for it below).
            unsafe {
                if pgrp > 1 {
                    libc::kill(-pgrp, libc::SIGKILL);
                }
                libc::kill(pid, libc::SIGKILL);
            }
            killed.push(pid);
        }
    }
    // Reap them (an adopted process is nobody else's to wait for); a moment at most.
    for &(pid, _, _) in &adopted {
        for _ in 0..50 {
            // SAFETY: waitpid of a child of ours, without blocking.
            let r = unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
            if r != 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    killed
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.signal_group(Signal::SIGKILL);
    }
}

/// Starts a worker.
///
/// # Errors
/// The fork or exec failed (missing executable, permission, affinity refused, ...).
pub fn spawn(spec: SpawnSpec<'_>) -> io::Result<Spawned> {
    let parent = std::process::id() as libc::pid_t;
    let (progress_parent, progress_child) = if spec.progress {
        let (a, b) = StdUnixDatagram::pair()?;
        (Some(a), Some(b))
    } else {
        (None, None)
    };
    let child_fd = progress_child.as_ref().map(|s| s.as_raw_fd());

    let cpuset = spec.cpus.map(|cpus| {
        // SAFETY: cpu_set_t is a plain bit array; all-zero is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            if c < libc::CPU_SETSIZE as usize {
                // SAFETY: c is below CPU_SETSIZE, so the bit is inside `set`.
                unsafe { libc::CPU_SET(c, &mut set) };
            }
        }
        set
    });

    let mut cmd = Command::new(spec.exe);
    cmd.args(&spec.argv)
        .envs(spec.env.iter().map(|(k, v)| (k.as_str(), v.as_os_str())))
        .stdin(match spec.stdin {
            WorkerStdin::Inherit => Stdio::inherit(),
            WorkerStdin::Null => Stdio::null(),
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(marks) = LAUNCH_MARKS.get() {
        cmd.env(crate::env::LAUNCH_MARKS_VAR, marks);
    }
    if let Some(fd) = child_fd {
        cmd.env(crate::env::PROGRESS_FD_VAR, fd.to_string());
        cmd.env(crate::env::PROGRESS_PEER_VAR, parent.to_string());
    }
    let nofile = rsrun_rendezvous::rlimit::original_soft_nofile();
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // system calls (setsid, prctl, getppid, close_range, fcntl, sched_setaffinity, getrlimit,
    // setrlimit, _exit); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // A session, and so a process group, of its own (see the module docs). A freshly
            // forked child leads no group, so this cannot fail with EPERM.
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // rsrun died between fork and prctl: the death signal will never come.
            if libc::getppid() != parent {
                libc::_exit(137);
            }
            // Descriptors rsrun inherited without FD_CLOEXEC must not reach the worker: mark every
            // one above stderr close-on-exec (std's stdio are already in place), then clear it on
            // the progress socket alone. A kernel without close_range (ENOSYS, before 5.9) or its
            // CLOEXEC flag (EINVAL, 5.9 and 5.10) leaves them as they are.
            libc::syscall(libc::SYS_close_range, 3_u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
            if let Some(fd) = child_fd {
                let flags = libc::fcntl(fd, libc::F_GETFD);
                if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            if let Some(set) = &cpuset
                && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) != 0
            {
                return Err(io::Error::last_os_error());
            }
            // The open-file limit rsrun raised for the store it serves: the worker gets the one
            // rsrun started with (see `rsrun_rendezvous::rlimit`).
            if let Some(soft) = nofile {
                let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                    lim.rlim_cur = soft.min(lim.rlim_max);
                    libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
                }
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    drop(progress_child);
    let pid = child.id().ok_or_else(|| io::Error::other("worker exited before rsrun saw its pid"))? as i32;
    let process = WorkerProcess { pid, armed: true };
    let stdout = child.stdout.take().ok_or_else(|| io::Error::other("worker stdout not piped"))?;
    let stderr = child.stderr.take().ok_or_else(|| io::Error::other("worker stderr not piped"))?;
    let progress = match progress_parent {
        Some(s) => {
            s.set_nonblocking(true)?;
            Some(tokio::net::UnixDatagram::from_std(s)?)
        }
        None => None,
    };
    Ok(Spawned { process, child, stdout, stderr, progress })
}

/// The process that kills every worker group when rsrun goes away (see the module docs).
#[derive(Debug)]
pub struct Guardian {
    pipe: Mutex<std::fs::File>,
    /// The guardian's pid (0 for none: tests' recording guardian): a child of rsrun that
    /// [`kill_adopted`] leaves alone.
    pid: i32,
}

impl Guardian {
    /// Forks the guardian.
    ///
    /// # Safety
    /// The process must be single-threaded (call it first thing in `main`, before any runtime or
    /// thread starts): the forked child keeps running Rust code that allocates.
    ///
    /// # Errors
    /// The pipe or the fork failed, or a guardian was started in this process already (its mark is
    /// the one workers carry: one launch per process).
    pub unsafe fn start() -> io::Result<Guardian> {
        // One guardian, one mark per process: a second one's mark would not reach the workers
        // (`LAUNCH_MARKS` is set once), and it would find nothing to kill by it.
        if LAUNCH_MARKS.get().is_some() {
            return Err(io::Error::other("a guardian was started in this process already"));
        }
        let mark = crate::plan::random_id();
        let marks = match std::env::var(crate::env::LAUNCH_MARKS_VAR) {
            Ok(outer) if !outer.is_empty() => format!("{outer}:{mark}"),
            _ => mark.clone(),
        };
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: fds is a valid two-element array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by nobody else.
        let (read_end, write_end) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: the caller guarantees that the process is single-threaded.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                drop(write_end);
                guardian_main(read_end, &mark)
            }
            pid => {
                drop(read_end);
                // Workers carry the mark only once a guardian will look for it. Unset above, and
                // the process is single-threaded (the caller's promise): this cannot fail.
                let set = LAUNCH_MARKS.set(marks);
                debug_assert!(set.is_ok(), "LAUNCH_MARKS was set between the check and the fork");
                Ok(Guardian { pipe: Mutex::new(std::fs::File::from(write_end)), pid })
            }
        }
    }

    /// A guardian that only records what it is told into `file` (tests: no process is forked).
    #[cfg(test)]
    pub(crate) fn recording(file: std::fs::File) -> Guardian {
        Guardian { pipe: Mutex::new(file), pid: 0 }
    }

    /// The guardian process's pid (0 for a recording one).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Another handle on the same guardian (its own descriptor of the pipe), for a thread that
    /// outlives the borrow it was handed.
    ///
    /// # Errors
    /// The descriptor could not be duplicated.
    pub fn try_clone(&self) -> io::Result<Guardian> {
        let pipe = self.pipe.lock().unwrap_or_else(|e| e.into_inner());
        Ok(Guardian { pipe: Mutex::new(pipe.try_clone()?), pid: self.pid })
    }

    /// Adds a process group to kill if rsrun dies.
    pub fn watch(&self, pgid: i32) {
        self.send(&format!("+{pgid}\n"));
    }

    /// Removes a process group (it was torn down).
    pub fn unwatch(&self, pgid: i32) {
        self.send(&format!("-{pgid}\n"));
    }

    fn send(&self, line: &str) {
        // A poisoned lock still holds a usable file; writes below PIPE_BUF are atomic.
        let mut pipe = self.pipe.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(err) = pipe.write_all(line.as_bytes()) {
            tracing::warn!(%err, "the guardian process is gone; workers are still covered by PDEATHSIG");
        }
    }
}

/// The `RSRUN_LAUNCH_MARKS` value workers get: the inherited marks and this launch's own (set by
/// [`Guardian::start`]; workers carry none without a guardian).
static LAUNCH_MARKS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn guardian_main(read_end: OwnedFd, mark: &str) -> ! {
    // Every process that carries the mark started after this one, as this user (read now: what
    // `kill_marked` skips unread).
    let since = std::fs::read_to_string("/proc/self/stat").ok().and_then(|s| stat_start_time(&s)).unwrap_or(0);
    // SAFETY: geteuid cannot fail.
    let euid = unsafe { libc::geteuid() };
    let scope = Scope { since, uid: (euid != 0).then_some(euid) };
    // SAFETY: plain system calls in a single-threaded child; the descriptors are our own.
    unsafe {
        libc::setsid();
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1, libc::SIGUSR2, libc::SIGPIPE] {
            libc::signal(sig, libc::SIG_IGN);
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
    let mut groups = std::collections::BTreeSet::new();
    let reader = io::BufReader::new(std::fs::File::from(read_end));
    for line in reader.lines() {
        let Ok(line) = line else { break };
        let (op, n) = line.split_at(line.len().min(1));
        if let Ok(pgid) = n.parse::<i32>() {
            match op {
                "+" => {
                    groups.insert(pgid);
                }
                "-" => {
                    groups.remove(&pgid);
                }
                _ => {}
            }
        }
    }
    for pgid in groups {
        if pgid > 1 {
            // SAFETY: a plain system call.
            unsafe {
                libc::killpg(pgid, libc::SIGKILL);
            }
        }
    }
    kill_marked(mark, scope);
    // SAFETY: exit without running the parent's atexit handlers or destructors.
    unsafe { libc::_exit(0) }
}

/// Whether an environment block (`/proc/PID/environ`: `NAME=value` entries, NUL-separated) carries
/// `mark` among its `RSRUN_LAUNCH_MARKS`.
fn environ_carries(environ: &[u8], mark: &str) -> bool {
    let key = crate::env::LAUNCH_MARKS_VAR.as_bytes();
    environ.split(|b| *b == 0).any(|entry| {
        entry.len() > key.len()
            && entry.starts_with(key)
            && entry[key.len()] == b'='
            && entry[key.len() + 1..].split(|b| *b == b':').any(|m| m == mark.as_bytes())
    })
}

/// Which processes may carry the guardian's mark: those started no earlier than the guardian
/// (`since`, `/proc/PID/stat`'s start time, in clock ticks after boot) and, unless the guardian runs
/// as root (`uid` `None`), whose real, effective and saved uids are the guardian's (what reading a
/// process's environment takes anyway). Only those get their environment read: that read may wait
/// on the process's memory map lock, which an unrelated process in uninterruptible sleep can hold
/// for long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Scope {
    since: u64,
    uid: Option<u32>,
}

impl Scope {
    /// Whether a process of start time `start` may carry the mark (its uids not yet considered).
    fn started_in(&self, start: u64) -> bool {
        start >= self.since
    }

    /// Whether a process whose `/proc/PID/status` reads `status` runs as the guardian's user.
    fn owns(&self, status: &str) -> bool {
        self.uid.is_none_or(|uid| status_uids(status) == Some([uid; 3]))
    }
}

/// The start time of a `/proc/PID/stat` line (field 22, clock ticks after boot).
fn stat_start_time(stat: &str) -> Option<u64> {
    // The fields after `comm` start with the 3rd (state): the 22nd is the 20th of them.
    stat_after_comm(stat)?.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The real, effective and saved uids of a `/proc/PID/status` (its `Uid:` line).
fn status_uids(status: &str) -> Option<[u32; 3]> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut f = line.split_ascii_whitespace().map(str::parse::<u32>);
    Some([f.next()?.ok()?, f.next()?.ok()?, f.next()?.ok()?])
}

/// The bookkeeping of [`kill_marked`]'s passes over `/proc`: the marked processes found so far,
/// by pid and start time (a pid reused by another process is another process), and when to stop.
#[derive(Debug)]
struct Sweep {
    found: std::collections::HashSet<(u32, u64)>,
    quiet: u32,
    deadline: std::time::Instant,
}

impl Sweep {
    /// Passes in a row that must find no new marked process: every one found is stopped and can
    /// fork no more, so once a whole pass finds none, none is left to find; the second pass covers a
    /// process forked, by one not yet stopped, behind the first pass's position in `/proc`.
    const QUIET_PASSES: u32 = 2;

    fn new(deadline: std::time::Instant) -> Sweep {
        Sweep { found: std::collections::HashSet::new(), quiet: 0, deadline }
    }

    /// Whether the process `(pid, start)` was found already.
    fn knows(&self, pid: u32, start: u64) -> bool {
        self.found.contains(&(pid, start))
    }

    /// Records a marked process; whether it is new.
    fn record(&mut self, pid: u32, start: u64) -> bool {
        self.found.insert((pid, start))
    }

    /// Ends a pass that found `new` processes not known before: whether another pass is due (not
    /// when enough passes in a row found none, or the deadline passed at `now`).
    fn another_pass(&mut self, new: usize, now: std::time::Instant) -> bool {
        self.quiet = if new == 0 { self.quiet + 1 } else { 0 };
        self.quiet < Self::QUIET_PASSES && now < self.deadline
    }
}

/// Sends `sig` through `pidfd`, or to `pid` where the kernel has no pidfds (`None`, before 5.3).
fn signal_process(pidfd: Option<&OwnedFd>, pid: u32, sig: libc::c_int) {
    // SAFETY: plain system calls; the pidfd is ours.
    unsafe {
        match pidfd {
            Some(fd) => {
                libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<libc::siginfo_t>(), 0);
            }
            None => {
                libc::kill(pid as libc::pid_t, sig);
            }
        }
    }
}

/// Kills every process (but this one) whose environment carries `mark`: pass after pass over
/// `/proc`, each newly found one is stopped (SIGSTOP: a stopped process cannot fork), until passes
/// find no new one or 2 s went by; then all of them get SIGKILL. Only the processes `scope` admits
/// have their environment read. Each is opened as a pidfd before its environment is read and
/// signalled through it, so a pid reused in between is not hit; a process that cannot be opened is
/// skipped (it is gone, or a descriptor is lacking: the next pass tries again), except on a kernel
/// without pidfds, where it is signalled by pid.
fn kill_marked(mark: &str, scope: Scope) {
    let me = std::process::id();
    let mut sweep = Sweep::new(std::time::Instant::now() + std::time::Duration::from_secs(2));
    let mut stopped: Vec<(Option<OwnedFd>, u32)> = Vec::new();
    loop {
        let Ok(dir) = std::fs::read_dir("/proc") else { break };
        let mut new = 0;
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            if pid == me {
                continue;
            }
            // Cheap reads first (a process may exit between the listing and the read).
            let Some(start) = std::fs::read_to_string(e.path().join("stat")).ok().and_then(|s| stat_start_time(&s)) else {
                continue;
            };
            if !scope.started_in(start) || sweep.knows(pid, start) {
                continue;
            }
            if scope.uid.is_some() && !std::fs::read_to_string(e.path().join("status")).is_ok_and(|s| scope.owns(&s)) {
                continue;
            }
            // SAFETY: pidfd_open(2) with a pid and no flags; the result is checked.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
            let pidfd = if fd >= 0 {
                // SAFETY: pidfd_open returned a new descriptor that nothing else owns.
                Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
            } else if io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                None
            } else {
                continue;
            };
            // Unreadable (exited, a zombie's empty block): not ours to kill.
            let Ok(environ) = std::fs::read(e.path().join("environ")) else { continue };
            if !environ_carries(&environ, mark) {
                continue;
            }
            signal_process(pidfd.as_ref(), pid, libc::SIGSTOP);
            if sweep.record(pid, start) {
                new += 1;
            }
            stopped.push((pidfd, pid));
        }
        if !sweep.another_pass(new, std::time::Instant::now()) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    for (pidfd, pid) in &stopped {
        signal_process(pidfd.as_ref(), *pid, libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::stat_state_and_group;

    #[test]
    fn launch_marks_are_matched_whole_in_their_own_variable() {
        use super::environ_carries;
        let m = "0123abcd";
        assert!(environ_carries(b"A=1\0RSRUN_LAUNCH_MARKS=0123abcd\0B=2\0", m));
        assert!(environ_carries(b"RSRUN_LAUNCH_MARKS=ffff:0123abcd:eeee", m));
        assert!(!environ_carries(b"RSRUN_LAUNCH_MARKS=0123abcde", m), "a prefix of another mark");
        assert!(!environ_carries(b"RSRUN_LAUNCH_MARKSX=0123abcd", m), "another variable");
        assert!(!environ_carries(b"OTHER=0123abcd\0", m));
        assert!(!environ_carries(b"", m));
    }

    #[test]
    fn start_times_and_uids_are_read_from_proc() {
        use super::{stat_start_time, status_uids};
        // Field 22 (start time), after a command name with spaces and parentheses of its own.
        let stat = "1234 (python3 (x) y) S 1 1234 1234 0 -1 4194560 1000 0 0 0 10 5 0 0 20 0 1 0 987654 123456789 1000";
        assert_eq!(stat_start_time(stat), Some(987_654));
        assert_eq!(stat_start_time("1 (x) S 1 1 1"), None, "cut short");
        assert_eq!(stat_start_time("garbage"), None);
        let status = "Name:\tsleep\nUmask:\t0022\nState:\tS (sleeping)\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t100\n";
        assert_eq!(status_uids(status), Some([1000, 1000, 1000]));
        assert_eq!(status_uids("Name:\tx\n"), None);
    }

    /// Only processes started after the guardian, running as its user (unless it is root), get
    /// their environment read.
    #[test]
    fn the_scan_reads_only_processes_that_may_carry_the_mark() {
        use super::Scope;
        let user = Scope { since: 500, uid: Some(1000) };
        assert!(user.started_in(500) && user.started_in(501));
        assert!(!user.started_in(499), "started before the guardian: no worker of this launch");
        let ours = "Uid:\t1000\t1000\t1000\t1000\n";
        assert!(user.owns(ours));
        assert!(!user.owns("Uid:\t0\t0\t0\t0\n"), "root's");
        assert!(!user.owns("Uid:\t1000\t0\t0\t0\n"), "a setuid program: its environment is not ours to read");
        assert!(!user.owns("Name:\tx\n"), "unreadable");
        let root = Scope { since: 500, uid: None };
        assert!(root.owns("Uid:\t1000\t1000\t1000\t1000\n") && root.owns(""));
    }

    /// Marked processes are counted once each (by pid and start time); the passes end once two in a
    /// row found none new, or at the deadline.
    #[test]
    fn the_sweep_ends_after_quiet_passes_or_at_its_deadline() {
        use super::Sweep;
        use std::time::{Duration, Instant};
        let t0 = Instant::now();
        let mut sweep = Sweep::new(t0 + Duration::from_secs(2));
        assert!(sweep.record(10, 100));
        assert!(sweep.knows(10, 100));
        assert!(!sweep.record(10, 100), "found again: not new");
        assert!(!sweep.knows(10, 101), "the same pid, started later: another process");
        assert!(sweep.another_pass(1, t0));
        assert!(sweep.another_pass(0, t0), "one quiet pass is not enough");
        assert!(sweep.another_pass(2, t0), "a new one resets the count");
        assert!(sweep.another_pass(0, t0));
        assert!(!sweep.another_pass(0, t0), "two quiet passes in a row");
        let mut late = Sweep::new(t0 + Duration::from_secs(2));
        assert!(!late.another_pass(5, t0 + Duration::from_secs(2)), "the deadline ends it, new ones or not");
    }

    #[test]
    fn stat_lines_are_read_after_the_command_name() {
        assert_eq!(stat_state_and_group("42 (python) S 1 42 42 0 -1"), Some(('S', 42)));
        // A command name with spaces and parentheses of its own.
        assert_eq!(stat_state_and_group("7 (a) Z 9 (b)) Z 3 11 11 0"), Some(('Z', 11)));
        assert_eq!(stat_state_and_group("garbage"), None);
        assert_eq!(stat_state_and_group("1 (x) R 1 notanumber"), None);
    }
}
