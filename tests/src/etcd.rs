//! A real etcd cluster on 127.0.0.1 for the HA tests: Debian's `etcd-server` (3.4.23), members on
//! free ports with their data directories in a temporary directory on tmpfs (`/dev/shm` when it
//! exists), one log file per member (printed when a test fails), and the faults the tests inject:
//! find the etcd leader, `kill -9`, `SIGSTOP`/`SIGCONT`, restart a member on its data directory.
//!
//! `.ci/run` installs `etcd-server` and sets `RSRUN_TEST_ETCD`, which makes the HA tests fail rather
//! than skip; elsewhere, without `/usr/bin/etcd`, [`EtcdCluster::start`] returns `None` after
//! printing why, and the tests skip.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::free_port;

/// The etcd binary, if installed.
pub fn etcd_binary() -> Option<PathBuf> {
    ["/usr/bin/etcd", "/usr/local/bin/etcd"].iter().map(PathBuf::from).find(|p| p.is_file())
}

/// The etcd binary to test with: `RSRUN_TEST_ETCD` when set (`.ci/run` sets it after installing
/// `etcd-server`; a path that is not there fails the test), else the installed one, else `None`
/// after saying that the test skips.
pub fn require_etcd(test: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("RSRUN_TEST_ETCD").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "{test}: RSRUN_TEST_ETCD={} is not a file; the HA tests must run here", p.display());
        return Some(p);
    }
    match etcd_binary() {
        Some(p) => Some(p),
        None => {
            eprintln!("SKIPPED {test}: etcd is not installed (apt-get install etcd-server etcd-client; .ci/run does)");
            None
        }
    }
}

/// One member.
#[derive(Debug)]
pub struct Member {
    /// Its name (`m1`...).
    pub name: String,
    /// Client port on 127.0.0.1.
    pub client_port: u16,
    /// Peer port on 127.0.0.1.
    pub peer_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Member {
    /// `127.0.0.1:PORT` of its client URL.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }
}

/// Client TLS of a cluster: `(ca.pem, cert.pem, key.pem)`; members serve https with `cert`/`key`,
/// require client certificates signed by `ca`, and the same pair identifies the test's clients.
pub type Tls = (PathBuf, PathBuf, PathBuf);

/// A running cluster, killed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    binary: PathBuf,
    /// The members, in order.
    pub members: Vec<Member>,
    dir: tempfile::TempDir,
    token: String,
    tls: Option<Tls>,
    /// `user:password` for etcdctl once auth is on.
    pub etcdctl_user: Option<String>,
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) on a child we own.
    unsafe {
        libc::kill(pid, sig);
    }
}

impl EtcdCluster {
    /// Starts `n` members and waits until a write succeeds (`None`: etcd is not installed; the
    /// message says so). Retries with other ports if a port was taken meanwhile.
    pub fn start(test: &str, n: usize) -> Option<EtcdCluster> {
        Self::start_with(test, n, None)
    }

    /// [`EtcdCluster::start`], serving clients over mutual TLS when `tls` is given.
    pub fn start_with(test: &str, n: usize, tls: Option<Tls>) -> Option<EtcdCluster> {
        let binary = require_etcd(test)?;
        let mut last = String::new();
        for _ in 0..3 {
            match Self::try_start(&binary, n, tls.clone()) {
                Ok(c) => return Some(c),
                Err(e) => last = e,
            }
        }
        panic!("{test}: cannot start a {n}-member etcd cluster: {last}");
    }

    fn try_start(binary: &Path, n: usize, tls: Option<Tls>) -> Result<EtcdCluster, String> {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = tempfile::Builder::new().prefix("rsrun-etcd-").tempdir_in(base).map_err(|e| e.to_string())?;
        let token = format!("rsrun-test-{}-{}", std::process::id(), dir.path().file_name().and_then(|s| s.to_str()).unwrap_or("x"));
        let mut members = Vec::new();
        let mut ports = std::collections::BTreeSet::new();
        for i in 1..=n {
            let (mut c, mut p) = (free_port(), free_port());
            while ports.contains(&c) || ports.contains(&p) || c == p {
                c = free_port();
                p = free_port();
            }
            ports.insert(c);
            ports.insert(p);
            members.push(Member {
                name: format!("m{i}"),
                client_port: c,
                peer_port: p,
                data_dir: dir.path().join(format!("m{i}")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            });
        }
        let mut cluster = EtcdCluster { binary: binary.to_owned(), members, dir, token, tls, etcdctl_user: None };
        for i in 0..n {
            cluster.spawn(i, "new")?;
        }
        cluster.wait_writable(Duration::from_secs(20))?;
        Ok(cluster)
    }

    fn initial_cluster(&self) -> String {
        self.members.iter().map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port)).collect::<Vec<_>>().join(",")
    }

    fn spawn(&mut self, i: usize, state: &str) -> Result<(), String> {
        let initial = self.initial_cluster();
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&m.log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.binary);
        if let Some((ca, cert, key)) = &self.tls {
            cmd.arg("--cert-file").arg(cert).arg("--key-file").arg(key).arg("--trusted-ca-file").arg(ca).arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &format!("{scheme}://127.0.0.1:{}", m.client_port)])
            .args(["--advertise-client-urls", &format!("{scheme}://127.0.0.1:{}", m.client_port)])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{}", m.peer_port)])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{}", m.peer_port)])
            .args(["--initial-cluster", &initial, "--initial-cluster-token", &self.token, "--initial-cluster-state", state])
            .args(["--pre-vote=true", "--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        m.child = Some(child);
        Ok(())
    }

    /// Client endpoints, `127.0.0.1:PORT` each.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::endpoint).collect()
    }

    /// The client endpoints comma-separated (for `--etcd-endpoints`).
    pub fn endpoints_csv(&self) -> String {
        self.endpoints().join(",")
    }

    /// `etcdctl` against the running members.
    pub fn etcdctl(&self, args: &[&str]) -> Output {
        let eps: Vec<String> = self.members.iter().filter(|m| m.child.is_some()).map(Member::endpoint).collect();
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3").arg(format!("--endpoints={}", eps.join(","))).args(["--command-timeout=2s", "--dial-timeout=1s"]);
        if let Some((ca, cert, key)) = &self.tls {
            cmd.arg(format!("--cacert={}", ca.display())).arg(format!("--cert={}", cert.display())).arg(format!("--key={}", key.display()));
        }
        if let Some(u) = &self.etcdctl_user {
            cmd.arg(format!("--user={u}"));
        }
        cmd.args(args).output().expect("run etcdctl")
    }

    /// Waits until a linearizable write succeeds.
    pub fn wait_writable(&self, within: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            let out = self.etcdctl(&["put", "/rsrun-test/ready", "1"]);
            if out.status.success() {
                return Ok(());
            }
            if start.elapsed() > within {
                return Err(format!("no write succeeded within {within:?}: {}\n{}", String::from_utf8_lossy(&out.stderr), self.logs_tail()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The index of the member that leads (`None`: no member answers as leader).
    pub fn leader(&self) -> Option<usize> {
        let out = self.etcdctl(&["endpoint", "status", "-w", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        for e in v.as_array()? {
            let status = &e["Status"];
            let me = status["header"]["member_id"].as_u64()?;
            if status["leader"].as_u64() == Some(me) {
                let ep = e["Endpoint"].as_str()?;
                return self.members.iter().position(|m| ep.ends_with(&format!(":{}", m.client_port)));
            }
        }
        None
    }

    /// Waits for a leader and returns it.
    pub fn wait_leader(&self, within: Duration) -> usize {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(start.elapsed() < within, "no etcd leader within {within:?}\n{}", self.logs_tail());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `kill -9` of member `i` (reaped).
    pub fn kill9(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// `SIGSTOP` of member `i`.
    pub fn pause(&self, i: usize) {
        if let Some(pid) = self.members[i].pid() {
            signal(pid, libc::SIGSTOP);
        }
    }

    /// `SIGCONT` of member `i`.
    pub fn resume(&self, i: usize) {
        if let Some(pid) = self.members[i].pid() {
            signal(pid, libc::SIGCONT);
        }
    }

    /// Restarts every member (`kill -9` of all, then each on its data directory): what an outage of
    /// the whole cluster looks like to its clients (every auth token is forgotten).
    pub fn restart_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill9(i);
        }
        for i in 0..self.members.len() {
            self.spawn(i, "existing").expect("restart the member");
        }
    }

    /// Restarts a killed member on its data directory (`--initial-cluster-state existing`).
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "member {i} still runs");
        self.spawn(i, "existing").expect("restart the member");
    }

    /// The last lines of every member's log.
    pub fn logs_tail(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(&m.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- etcd {} ({}) ---\n", m.name, m.log.display()));
            for l in &lines[lines.len().saturating_sub(15)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// The client TLS files, when the members serve TLS.
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
    }

    /// The temporary directory holding data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs_tail());
        }
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                if let Some(pid) = Some(c.id() as i32) {
                    signal(pid, libc::SIGCONT);
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
