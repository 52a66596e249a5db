//! Shared helpers for the end-to-end tests: find (and build) the workspace binaries, run them in
//! temporary directories with deadlines, start a rendezvous daemon on a free loopback port, check
//! processes.
//!
//! The tests run the real `rsrun`, `hello`, `train` and `rsrun-rendezvous` binaries of this
//! workspace. `cargo test` builds binaries only for packages that have integration tests of their
//! own, so the first call to [`bin`] in a test process runs `cargo build --workspace --all-targets`
//! with the same cargo, profile and target directory: after `cargo test --workspace` that only
//! links the missing binaries, after `cargo test -p rsrun-tests` it also brings stale ones up to
//! date. No manual build step is needed.

pub mod etcd;
pub mod proxy;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Generous deadline for a launcher run in a test (correctness, not speed).
pub const RUN_DEADLINE: Duration = Duration::from_secs(60);

/// `target/<profile>` of the running test binary.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/e2e-<hash>
    exe.parent().and_then(Path::parent).expect("target directory").to_owned()
}

/// Path of a workspace binary, built (once per test process) if missing or stale.
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    if let Err(err) = BUILT.get_or_init(build_workspace_binaries) {
        panic!("{err}");
    }
    let p = target_dir().join(name);
    assert!(p.is_file(), "{} is not built by `cargo build --workspace`: is {name:?} a binary of this workspace?", p.display());
    p
}

/// `cargo build --workspace --all-targets` into the test binary's own target directory and profile.
///
/// `--all-targets` resolves features exactly as `cargo test --workspace` does (dev-dependencies
/// included), so nothing that the test run already compiled is compiled again.
fn build_workspace_binaries() -> Result<(), String> {
    if std::env::var_os("RSRUN_TESTS_NO_BUILD").is_some() {
        return Ok(());
    }
    cargo_build(&["--workspace", "--all-targets"])
}

/// `cargo build ARGS` with the running test's cargo, profile and target directory.
fn cargo_build(args: &[&str]) -> Result<(), String> {
    let profile_dir = target_dir();
    let profile = profile_dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug").to_owned();
    let target_root = profile_dir.parent().ok_or("test binary outside a target directory")?.to_owned();
    // The running test's package directory, as cargo sets it for the test process; the path
    // compiled in is only the fallback: a target directory copied from another checkout (whose
    // compiled library cargo then reuses) would otherwise build that checkout's sources here.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let workspace = manifest_dir.parent().ok_or("the test package has no parent directory")?.to_owned();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&workspace).arg("build").args(args).args(["--quiet", "--target-dir"]).arg(&target_root);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    // What cargo sets for the test process itself describes this package, not the build.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_CRATE_", "CARGO_BIN_", "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR"]
            .iter()
            .any(|p| k.starts_with(p))
        {
            cmd.env_remove(&*k);
        }
    }
    let started = Instant::now();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {} to build test binaries: {e}", Path::new(&cargo).display()))?;
    if !out.status.success() {
        return Err(format!(
            "`cargo build {}` (for the e2e tests' binaries) failed with {}:\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    if started.elapsed() > Duration::from_secs(5) {
        eprintln!("e2e: `cargo build {}` took {:.1?}", args.join(" "), started.elapsed());
    }
    Ok(())
}

/// Binary `name` of `package` built with `features` (none: `""`), copied into `dir`. Cargo puts
/// every build of a binary at its one usual path, whatever its features, so a test that needs a
/// given build takes its own copy: the build and the copy are one step under a process-wide
/// lock, and no other test's build of the binary lands in between.
pub fn bin_with_features(package: &str, name: &str, features: &str, dir: &Path) -> PathBuf {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // The workspace build first, so it does not overwrite the featured binary afterwards.
    bin("rsrun");
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut args = vec!["-p", package, "--bin", name];
    if !features.is_empty() {
        args.extend(["--features", features]);
    }
    if let Err(e) = cargo_build(&args) {
        panic!("{e}");
    }
    let built = target_dir().join(name);
    let copy = dir.join(name);
    std::fs::copy(&built, &copy).unwrap_or_else(|e| panic!("copying {}: {e}", built.display()));
    copy
}

/// A `rsrun` command running in `dir`, with a clean launcher environment.
pub fn rsrun(dir: &Path) -> Command {
    let mut cmd = Command::new(bin("rsrun"));
    // Workers read rsrun's stdin: never the test run's (a terminal, when run by hand).
    cmd.current_dir(dir).stdin(Stdio::null()).env("RUST_BACKTRACE", "0").env_remove("RSRUN_LOG").env_remove("RUST_LOG");
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
    /// Both pipes are drained meanwhile (a child that wrote more than a pipe holds would block
    /// on it and never exit).
    pub fn output_within(mut self, deadline: Duration) -> Output {
        let stdout = self.0.stdout.take().map(drain);
        let stderr = self.0.stderr.take().map(drain);
        let start = Instant::now();
        let mut timed_out = false;
        let status = loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                break status;
            }
            if start.elapsed() > deadline {
                timed_out = true;
                let _ = self.0.kill();
                break self.0.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let collect = |h: Option<std::thread::JoinHandle<Vec<u8>>>| h.map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        let out = Output { status, stdout: collect(stdout), stderr: collect(stderr) };
        if timed_out {
            panic!(
                "process did not exit within {deadline:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        out
    }
}

/// Reads `r` to its end on a thread of its own.
fn drain(mut r: impl std::io::Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        buf
    })
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
/// The value of `key=` among the whitespace-separated words of `line` (a `summary:` line).
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

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
        let (child, addr) = serve(&bin("rsrun-rendezvous"), listen, extra, "warn", Stdio::inherit()).unwrap_or_else(|e| panic!("{e}"));
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

/// Starts `BINARY serve --listen LISTEN EXTRA...` (an `rsrun-rendezvous`, logging at `RSRUN_LOG=log`
/// to `stderr`) and returns it, killed on drop, with the address of its `listening on ADDR` line
/// (waited for up to 40 s). Shared by the tests and the benchmarks.
pub fn serve<S: AsRef<std::ffi::OsStr>>(binary: &Path, listen: &str, extra: &[S], log: &str, stderr: Stdio) -> Result<(KillOnDrop, String), String> {
    let mut child = KillOnDrop(
        Command::new(binary)
            .args(["serve", "--listen", listen])
            .args(extra)
            .env("RSRUN_LOG", log)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?,
    );
    let stdout = child.0.stdout.take().ok_or("no daemon stdout")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        if let Some(Ok(line)) = lines.next() {
            let _ = tx.send(line);
        }
        // Keep draining so the daemon never blocks on a full pipe.
        for _ in lines {}
    });
    let line = rx.recv_timeout(Duration::from_secs(40)).map_err(|_| format!("{} printed no address", binary.display()))?;
    let addr = line.trim().strip_prefix("listening on ").ok_or_else(|| format!("unexpected first line {line:?}"))?.to_owned();
    Ok((child, addr))
}

/// `python3` with torch importable, if any. `RSRUN_TEST_PYTHON` names the interpreter (CI sets it,
/// from `scripts/torch-venv.sh`); when it is set, torch must import — a broken venv fails the tests
/// instead of skipping them.
pub fn python_with_torch() -> Option<PathBuf> {
    let explicit = std::env::var("RSRUN_TEST_PYTHON").ok().filter(|p| !p.is_empty());
    let py = explicit.clone().unwrap_or_else(|| "python3".into());
    let out = Command::new(&py).args(["-c", "import torch, torch.distributed as d; assert d.is_available()"]).output();
    let ok = out.as_ref().map(|o| o.status.success()).unwrap_or(false);
    if !ok && explicit.is_some() {
        panic!(
            "RSRUN_TEST_PYTHON={py} cannot import torch.distributed: {}",
            match &out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            }
        );
    }
    ok.then(|| PathBuf::from(py))
}

/// A CA, and a certificate it signed for 127.0.0.1 and localhost, written into `dir`:
/// `(ca.pem, cert.pem, key.pem)`.
pub fn tls_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    tls_files_for(dir, &["127.0.0.1", "localhost"])
}

/// [`tls_files`] with a server certificate for `names` (host names or IP addresses).
pub fn tls_files_for(dir: &Path, names: &[&str]) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .expect("leaf params")
        .signed_by(&leaf_key, &issuer)
        .expect("leaf certificate");
    let (ca, cert, key) = (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&ca, ca_cert.pem()).expect("write ca.pem");
    std::fs::write(&cert, leaf.pem()).expect("write cert.pem");
    std::fs::write(&key, leaf_key.serialize_pem()).expect("write key.pem");
    (ca, cert, key)
}

/// A port for flags that cannot take port 0 (and for a server restarted on its old address):
/// free on 127.0.0.1 and 0.0.0.0 when handed out, never handed out twice by this process, and
/// taken from just below the kernel's ephemeral range, which neither a bind to port 0 nor an
/// outgoing connection of a test running beside this one uses: a port the kernel picked and
/// this process then let go could be picked again by any of those before its user binds it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const SPAN: u32 = 8_000;
    let ephemeral_lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if ephemeral_lo >= 1_024 + SPAN {
        let base = ephemeral_lo - SPAN;
        // Processes that run at once start at different places.
        let seed = std::process::id().wrapping_mul(2_654_435_761) % SPAN;
        for _ in 0..SPAN {
            let port = (base + (seed + NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
            let free = |ip: &str| std::net::TcpListener::bind((ip, port)).is_ok();
            if free("127.0.0.1") && free("0.0.0.0") {
                return port;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0").local_addr().expect("local addr").port()
}

#[cfg(test)]
mod harness_tests {
    use super::*;

    /// A child that writes more than a pipe holds on both streams still exits, and every byte is
    /// collected.
    #[test]
    fn output_within_drains_both_pipes_while_it_waits() {
        let out = KillOnDrop::spawn(Command::new("sh").args(["-c", "head -c 300000 /dev/zero; head -c 200000 /dev/zero >&2"]))
            .output_within(Duration::from_secs(60));
        assert!(out.status.success());
        assert_eq!((out.stdout.len(), out.stderr.len()), (300_000, 200_000));
    }

    /// Ports are handed out once each, below the ephemeral range, and bindable.
    #[test]
    fn free_ports_are_distinct_and_below_the_ephemeral_range() {
        let lo: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap().split_whitespace().next().unwrap().parse().unwrap();
        let ports: Vec<u16> = (0..200).map(|_| free_port()).collect();
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!(p < lo, "port {p} is in the ephemeral range from {lo}");
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap_or_else(|e| panic!("port {p}: {e}"));
        }
    }
}
