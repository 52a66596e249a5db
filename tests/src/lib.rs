//! Shared helpers for the end-to-end tests: find the built binaries, run them in temporary
//! directories with deadlines, start a rendezvous daemon on a free loopback port, check processes.
//!
//! The tests run the real `rsrun`, `hello` and `rsrun-rendezvous` binaries of this workspace. Build
//! them first: `cargo build --workspace && cargo test -p rsrun-tests`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// Generous deadline for a launcher run in a test (correctness, not speed).
pub const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// `target/<profile>` of the running test binary.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/e2e-<hash>
    exe.parent().and_then(Path::parent).expect("target directory").to_owned()
}

/// Path of a workspace binary; panics with the build command when it is missing.
pub fn bin(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(p.is_file(), "{} is not built: run `cargo build --workspace` before `cargo test -p rsrun-tests`", p.display());
    p
}

/// A `rsrun` command running in `dir`, with a clean launcher environment.
pub fn rsrun(dir: &Path) -> Command {
    let mut cmd = Command::new(bin("rsrun"));
    cmd.current_dir(dir).env("RUST_BACKTRACE", "0").env_remove("RSRUN_LOG").env_remove("RUST_LOG");
    for (k, _) in std::env::vars() {
        if k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") || k == "OMP_NUM_THREADS" {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// A child that is killed (and reaped) when dropped.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl KillOnDrop {
    /// Spawns `cmd` with piped stdout and stderr.
    pub fn spawn(cmd: &mut Command) -> Self {
        KillOnDrop(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn"))
    }

    /// The pid.
    pub fn pid(&self) -> i32 {
        self.0.id() as i32
    }

    /// Waits up to `deadline` for the exit and collects the output; kills and panics on timeout.
    pub fn output_within(mut self, deadline: Duration) -> Output {
        let start = Instant::now();
        loop {
            if self.0.try_wait().expect("try_wait").is_some() {
                break;
            }
            if start.elapsed() > deadline {
                let _ = self.0.kill();
                let out = self.take_output();
                panic!(
                    "process did not exit within {deadline:?}\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.take_output()
    }

    fn take_output(&mut self) -> Output {
        use std::io::Read;
        let mut stdout = Vec::new();
        let mut stderr = Vec::new();
        if let Some(mut s) = self.0.stdout.take() {
            let _ = s.read_to_end(&mut stdout);
        }
        if let Some(mut s) = self.0.stderr.take() {
            let _ = s.read_to_end(&mut stderr);
        }
        let status = self.0.wait().expect("wait");
        Output { status, stdout, stderr }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cmd` to completion within [`RUN_DEADLINE`].
pub fn run(cmd: &mut Command) -> Output {
    KillOnDrop::spawn(cmd).output_within(RUN_DEADLINE)
}

/// stdout and stderr as one string, for assertion messages.
pub fn text(out: &Output) -> String {
    format!(
        "status: {:?}\n--- stdout ---\n{}--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The exit code (panics when killed by a signal).
pub fn code(status: &ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| panic!("no exit code: {status:?}"))
}

/// Whether `pid` is a live (non-zombie) process.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // "pid (comm) S ..." — the state follows the last ')'.
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
            !matches!(state, Some("Z") | Some("X") | None)
        }
        Err(_) => false,
    }
}

/// Polls `f` every 20 ms until it holds or `deadline` passes.
pub fn wait_until(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// Reads a file's pids (one per line).
pub fn read_pids(path: &Path) -> Vec<i32> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// An `rsrun-rendezvous serve` on a free loopback port, killed on drop.
#[derive(Debug)]
pub struct Daemon {
    child: KillOnDrop,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl Daemon {
    /// Starts the daemon and waits for its `listening on ADDR` line.
    pub fn start() -> Self {
        Self::start_with("127.0.0.1:0", &[])
    }

    /// Starts the daemon on `listen` with extra `serve` arguments (e.g. `--data-dir DIR`).
    pub fn start_with(listen: &str, extra: &[&std::ffi::OsStr]) -> Self {
        let mut child = KillOnDrop(
            Command::new(bin("rsrun-rendezvous"))
                .args(["serve", "--listen", listen])
                .args(extra)
                .env("RSRUN_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn rsrun-rendezvous"),
        );
        let stdout = child.0.stdout.take().expect("daemon stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining so the daemon never blocks on a full pipe.
            for _ in lines {}
        });
        let line = rx.recv_timeout(Duration::from_secs(30)).expect("daemon printed no address");
        let addr = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected first line {line:?}")).to_owned();
        Daemon { child, addr }
    }

    /// The daemon's pid.
    pub fn pid(&self) -> i32 {
        self.child.pid()
    }

    /// `kill -9` and reap.
    pub fn kill9(mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
    }
}

/// `python3` with torch importable, if any (`RSRUN_TEST_PYTHON` overrides the interpreter).
pub fn python_with_torch() -> Option<PathBuf> {
    let py = std::env::var("RSRUN_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    ok.then(|| PathBuf::from(py))
}
