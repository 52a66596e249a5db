//! A group of real `rsrun-rendezvous serve --etcd-endpoints` daemons over a real 3-member etcd
//! cluster, with a user-space proxy on every daemon↔etcd link and in front of every daemon (so a
//! test can partition either side), and the helpers the scenarios need: which daemon leads,
//! `kill -9`, SIGTERM, SIGSTOP/SIGCONT, restart on the same address.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use rsrun_rendezvous::client::{ClientConfig, RdzvClient};
use rsrun_rendezvous::ha::etcd::{Etcd, EtcdConfig};
use rsrun_rendezvous::proto::{DaemonInfoResponse, DaemonRole};
use rsrun_tests::etcd::EtcdCluster;
use rsrun_tests::proxy::{Fault, Proxy};
use rsrun_tests::{KillOnDrop, bin, free_port};

pub(crate) fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) on a child we own.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// One daemon of the group.
pub(crate) struct DaemonProc {
    /// Where it listens.
    pub(crate) listen: SocketAddr,
    /// The proxy clients reach it through (its `--advertise`).
    pub(crate) front: Proxy,
    /// One proxy per etcd member, its only way to etcd.
    pub(crate) to_etcd: Vec<Proxy>,
    child: Option<KillOnDrop>,
    log: PathBuf,
}

impl DaemonProc {
    /// The address clients use (the front proxy).
    pub(crate) fn endpoint(&self) -> String {
        self.front.addr().to_string()
    }

    pub(crate) fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(KillOnDrop::pid)
    }

    pub(crate) fn running(&self) -> bool {
        self.child.is_some()
    }
}

/// Daemons plus etcd, all stopped on drop.
pub(crate) struct HaGroup {
    pub(crate) etcd: EtcdCluster,
    pub(crate) daemons: Vec<DaemonProc>,
    pub(crate) prefix: String,
    pub(crate) ttl: u64,
    extra: Vec<String>,
    /// `(user, password)` the test's own etcd client uses (auth on).
    pub(crate) etcd_user: Option<(String, String)>,
    dir: tempfile::TempDir,
    pub(crate) rt: tokio::runtime::Runtime,
}

impl HaGroup {
    /// `n` daemons with lease TTL `ttl` seconds over a fresh 3-member cluster (`None`: no etcd).
    pub(crate) fn start(test: &str, n: usize, ttl: u64) -> Option<HaGroup> {
        Self::start_with(test, n, ttl, &[])
    }

    /// [`HaGroup::start`] with extra `serve` arguments for every daemon.
    pub(crate) fn start_with(test: &str, n: usize, ttl: u64, extra: &[&str]) -> Option<HaGroup> {
        let etcd = EtcdCluster::start(test, 3)?;
        Some(Self::over(etcd, n, ttl, extra, None))
    }

    /// `n` daemons over a running cluster; `etcd_user` is what the test's own etcd client logs in as.
    pub(crate) fn over(etcd: EtcdCluster, n: usize, ttl: u64, extra: &[&str], etcd_user: Option<(String, String)>) -> HaGroup {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let dir = tempfile::tempdir().expect("tempdir");
        let extra = extra.iter().map(|s| s.to_string()).collect();
        let mut g = HaGroup { etcd, daemons: Vec::new(), prefix: "/rsrun-test".into(), ttl, extra, etcd_user, dir, rt };
        for i in 0..n {
            let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
            let front = Proxy::start(listen);
            let to_etcd = g.etcd.members.iter().map(|m| Proxy::start(m.endpoint().parse().expect("addr"))).collect();
            g.daemons.push(DaemonProc { listen, front, to_etcd, child: None, log: g.dir.path().join(format!("daemon{i}.log")) });
            g.spawn(i);
            // The first one leads: start the others once it does, so the order is known.
            if i == 0 {
                g.wait_leader(Duration::from_secs(30));
            }
        }
        g
    }

    /// (Re)starts daemon `i` on its address.
    pub(crate) fn spawn(&mut self, i: usize) {
        let d = &self.daemons[i];
        assert!(d.child.is_none(), "daemon {i} runs");
        let etcd: Vec<String> = d.to_etcd.iter().map(|p| p.addr().to_string()).collect();
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&d.log).expect("daemon log");
        let mut args: Vec<String> = vec!["--advertise".into(), d.endpoint(), "--daemon-id".into(), format!("d{i}")];
        args.extend(["--etcd-endpoints".into(), etcd.join(","), "--etcd-prefix".into(), self.prefix.clone()]);
        args.extend(["--leader-lease-ttl".into(), self.ttl.to_string()]);
        args.extend(self.extra.iter().cloned());
        let level = std::env::var("HA_DAEMON_LOG").unwrap_or_else(|_| "info".into());
        let (child, _) = rsrun_tests::serve(&bin("rsrun-rendezvous"), &d.listen.to_string(), &args, &level, Stdio::from(log))
            .unwrap_or_else(|e| panic!("daemon {i} did not start: {e}\n{}", self.logs()));
        self.daemons[i].child = Some(child);
    }

    /// Every daemon's client endpoint, comma-separated (what a client is given).
    pub(crate) fn endpoints(&self) -> String {
        self.daemons.iter().map(DaemonProc::endpoint).collect::<Vec<_>>().join(",")
    }

    /// A client of the whole group.
    pub(crate) fn client(&self) -> RdzvClient {
        let mut cfg = ClientConfig::new(self.endpoints());
        cfg.rpc_timeout = Duration::from_secs(40);
        cfg.connect_timeout = Duration::from_secs(1);
        let _g = self.rt.enter();
        RdzvClient::connect(cfg).expect("client")
    }

    /// An etcd client of the test (direct, no proxy).
    pub(crate) fn etcd_client(&self) -> Etcd {
        let _g = self.rt.enter();
        Etcd::connect(EtcdConfig {
            endpoints: self.etcd.endpoints(),
            request_timeout: Duration::from_secs(3),
            ca: self.etcd.tls().map(|t| t.0.clone()),
            cert_key: self.etcd.tls().map(|t| (t.1.clone(), t.2.clone())),
            user: self.etcd_user.clone(),
        })
        .expect("etcd")
    }

    /// What daemon `i` says about itself (direct, not through its proxy).
    pub(crate) fn info(&self, i: usize) -> Option<DaemonInfoResponse> {
        if !self.daemons[i].running() {
            return None;
        }
        let client = self.client();
        let addr = self.daemons[i].listen.to_string();
        self.rt.block_on(async { tokio::time::timeout(Duration::from_millis(1500), client.daemon_info_at(&addr)).await.ok()?.ok() })
    }

    /// The index of the daemon that says it leads, if exactly one does.
    pub(crate) fn leader(&self) -> Option<usize> {
        let leaders: Vec<usize> =
            (0..self.daemons.len()).filter(|&i| self.info(i).is_some_and(|d| d.role == DaemonRole::Leader as i32)).collect();
        (leaders.len() == 1).then(|| leaders[0])
    }

    /// Waits until one daemon leads and returns it.
    pub(crate) fn wait_leader(&self, within: Duration) -> usize {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(start.elapsed() < within, "no daemon leads after {within:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until a daemon other than `old` leads.
    pub(crate) fn wait_new_leader(&self, old: usize, within: Duration) -> usize {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader().filter(|&l| l != old) {
                return l;
            }
            assert!(start.elapsed() < within, "no other daemon than {old} leads after {within:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9` of daemon `i`.
    pub(crate) fn kill9(&mut self, i: usize) {
        if let Some(c) = self.daemons[i].child.take() {
            drop(c);
        }
    }

    /// Whether daemon `i`'s process still runs (started and not exited).
    pub(crate) fn alive(&mut self, i: usize) -> bool {
        self.daemons[i].child.as_mut().is_some_and(|c| c.0.try_wait().ok().flatten().is_none())
    }

    /// SIGTERM of daemon `i`, waiting for it to exit.
    pub(crate) fn terminate(&mut self, i: usize) {
        if let Some(mut c) = self.daemons[i].child.take() {
            signal(c.pid(), libc::SIGTERM);
            let start = Instant::now();
            while c.0.try_wait().ok().flatten().is_none() && start.elapsed() < Duration::from_secs(20) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub(crate) fn pause(&self, i: usize) {
        if let Some(pid) = self.daemons[i].pid() {
            signal(pid, libc::SIGSTOP);
        }
    }

    pub(crate) fn resume(&self, i: usize) {
        if let Some(pid) = self.daemons[i].pid() {
            signal(pid, libc::SIGCONT);
        }
    }

    /// Cuts (or heals, with `Fault::None`) daemon `i` from every etcd member.
    pub(crate) fn etcd_link(&self, i: usize, fault: Fault) {
        for p in &self.daemons[i].to_etcd {
            p.set(fault);
        }
    }

    /// Cuts (or heals) the clients' way to daemon `i`.
    pub(crate) fn client_link(&self, i: usize, fault: Fault) {
        self.daemons[i].front.set(fault);
    }

    /// The tail of every daemon's log.
    pub(crate) fn logs(&self) -> String {
        let mut out = String::new();
        for (i, d) in self.daemons.iter().enumerate() {
            let text = std::fs::read_to_string(&d.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- daemon {i} ({}) ---\n", d.endpoint()));
            for l in &lines[lines.len().saturating_sub(25)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// One daemon's whole log.
    pub(crate) fn log_of(&self, i: usize) -> String {
        std::fs::read_to_string(&self.daemons[i].log).unwrap_or_default()
    }
}

impl Drop for HaGroup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
        for d in &mut self.daemons {
            if let Some(c) = d.child.take() {
                signal(c.pid(), libc::SIGCONT);
            }
            d.front.set(Fault::None);
        }
    }
}
