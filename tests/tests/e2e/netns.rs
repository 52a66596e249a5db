//! "Hosts" made of network namespaces, one per host, joined by a bridge in one more namespace
//! (addresses 10.201.X.1, .2, ...): a daemon with a token and TLS on host 1 (it listens on a
//! non-loopback address, which needs both), one launcher per host.
//!
//! - Two hosts: a job completes, and a launcher without the token is turned away.
//! - Three hosts (issue 9, acceptance test 5): each host has its own hostname (a UTS namespace) and
//!   address, workers get `MASTER_ADDR` = host 1's address; taking host 3's link down mid-run ends
//!   the round on hosts 1 and 2 within the lease, host 3's launcher stops its workers and exits
//!   naming the rendezvous endpoint, and no worker survives.
//! - One command over three hosts (`--rsh` into each namespace; same boot id, distinct network
//!   namespaces): three hosts without `--allow-same-host`; a host listed twice, under its name and
//!   its address, is refused with the same-machine error before any worker starts.
//!
//! Needs root and iproute2; skipped with a message otherwise. Only these namespaces' own addresses
//! are ever contacted. Namespaces and links are removed on drop, a failed assertion included.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, alive, bin, code, read_pids, text, wait_until};

/// N hosts: namespace `hosts[i]` holds veth `devs[i]` with address `subnet.(i+1)`; its peer
/// `ports[i]` is a port of bridge `br0` in namespace `bridge`.
struct Netns {
    hosts: Vec<String>,
    bridge: String,
    devs: Vec<String>,
    ports: Vec<String>,
    subnet: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Netns {
    /// Creates `n` host namespaces bridged together, or `None` (with a printed reason) when not
    /// permitted. Names are unique per process and per call (tests run in parallel).
    fn create(n: usize) -> Option<Netns> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let (pid, seq) = (std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        // Interface names stay within IFNAMSIZ - 1 = 15 bytes: "r" + pid (<= 7) + "x" + seq + "h" + i.
        let net = Netns {
            hosts: (0..n).map(|i| format!("rsrun-{pid}-{seq}-h{}", i + 1)).collect(),
            bridge: format!("rsrun-{pid}-{seq}-br"),
            devs: (0..n).map(|i| format!("r{pid}x{seq}h{i}")).collect(),
            ports: (0..n).map(|i| format!("r{pid}x{seq}b{i}")).collect(),
            subnet: format!("10.201.{}", (pid + seq) % 250 + 1),
        };
        if !ip(&["netns", "add", &net.bridge]) {
            eprintln!("skipped: cannot create network namespaces here (needs root and iproute2)");
            return None;
        }
        // From here on, dropping `net` removes whatever was created.
        let br = net.bridge.as_str();
        let mut ok = ip(&["-n", br, "link", "add", "br0", "type", "bridge"])
            && ip(&["-n", br, "link", "set", "br0", "up"])
            && ip(&["-n", br, "link", "set", "lo", "up"]);
        for i in 0..n {
            let (ns, dev, port) = (net.hosts[i].as_str(), net.devs[i].as_str(), net.ports[i].as_str());
            ok = ok
                && ip(&["netns", "add", ns])
                && ip(&["link", "add", dev, "type", "veth", "peer", "name", port])
                && ip(&["link", "set", dev, "netns", ns])
                && ip(&["link", "set", port, "netns", br])
                && ip(&["-n", br, "link", "set", port, "master", "br0"])
                && ip(&["-n", br, "link", "set", port, "up"])
                && ip(&["-n", ns, "addr", "add", &format!("{}/24", net.addr(i)), "dev", dev])
                && ip(&["-n", ns, "link", "set", dev, "up"])
                && ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        if !ok {
            eprintln!("skipped: cannot set up the bridged veth links between the test namespaces");
            return None;
        }
        Some(net)
    }

    /// `program` run inside host `host`'s namespace, with a clean launcher environment.
    fn exec(&self, host: usize, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.hosts[host]]).arg(program);
        Self::clean_env(&mut cmd);
        cmd
    }

    /// Like [`Netns::exec`], in a UTS namespace of its own whose hostname is `hostname` (so the
    /// program and its workers see that name). `ip`, `unshare` and `sh` all exec: the child's pid is
    /// `program`'s.
    fn exec_named(&self, host: usize, hostname: &str, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.hosts[host], "unshare", "--uts", "sh", "-c", "hostname \"$0\" && exec \"$@\"", hostname])
            .arg(program);
        Self::clean_env(&mut cmd);
        cmd
    }

    fn clean_env(cmd: &mut Command) {
        cmd.env("RUST_BACKTRACE", "0").env_remove("RSRUN_LOG").env_remove("RUST_LOG");
        for (k, _) in std::env::vars() {
            if k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") || k == "OMP_NUM_THREADS" {
                cmd.env_remove(k);
            }
        }
    }

    fn addr(&self, host: usize) -> String {
        format!("{}.{}", self.subnet, host + 1)
    }

    /// Takes host `host`'s only link down (or up): a partition, with no RST or FIN for anyone.
    fn set_link(&self, host: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        assert!(ip(&["-n", &self.hosts[host], "link", "set", &self.devs[host], state]), "cannot set host {host}'s link {state}");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in self.hosts.iter().chain([&self.bridge]) {
            // Deleting a namespace removes its interfaces, and with them their veth peers.
            ip(&["netns", "delete", n]);
        }
        // A veth pair created but not yet moved (setup failed half-way) is still here.
        for d in &self.devs {
            ip(&["link", "delete", d]);
        }
    }
}

/// A process whose stdout and stderr lines are collected as they arrive, with their arrival time.
struct Watched {
    child: KillOnDrop,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Watched {
    fn spawn(cmd: &mut Command) -> Watched {
        let mut child = KillOnDrop::spawn(cmd);
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams: [Box<dyn Read + Send>; 2] =
            [Box::new(child.0.stdout.take().expect("stdout")), Box::new(child.0.stderr.take().expect("stderr"))];
        for s in streams {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(s).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            });
        }
        Watched { child, lines }
    }

    /// When the first line matching `pred` arrived.
    fn seen(&self, pred: impl Fn(&str) -> bool) -> Option<Instant> {
        self.lines.lock().unwrap().iter().find(|(_, l)| pred(l)).map(|(t, _)| *t)
    }

    fn text(&self) -> String {
        self.lines.lock().unwrap().iter().map(|(_, l)| format!("{l}\n")).collect()
    }

    /// The exit status, waiting up to `deadline`; `None` if it is still running.
    fn wait_exit(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let mut status = None;
        wait_until(deadline, || {
            status = self.child.0.try_wait().expect("try_wait");
            status.is_some()
        });
        // Let the readers take the last lines.
        std::thread::sleep(Duration::from_millis(200));
        status
    }
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe {
        libc::kill(pid, sig);
    }
}

/// `KEY=VALUE` from an `env` dump.
fn env_value(dump: &str, key: &str) -> Option<String> {
    dump.lines().find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')).map(str::to_owned))
}

#[test]
fn two_hosts_in_network_namespaces_through_an_authenticated_daemon() {
    let Some(net) = Netns::create(2) else { return };
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "netns-test-token-0123456789abcdef\n").unwrap();
    let (ca, cert, key) = rsrun_tests::tls_files_for(dir.path(), &[&net.addr(0)]);
    let mut daemon = KillOnDrop::spawn(
        net.exec(0, &bin("rsrun-rendezvous"))
            .args(["serve", "--listen", &format!("{}:0", net.addr(0)), "--token-file"])
            .arg(&tokens)
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .stdout(Stdio::piped())
            .stderr(Stdio::null()),
    );
    let mut line = String::new();
    BufReader::new(daemon.0.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let endpoint = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("daemon said {line:?}")).to_string();
    assert!(endpoint.starts_with(&net.addr(0)), "{endpoint}");
    let node = |host: usize, token: Option<&Path>| {
        let mut cmd = net.exec(host, &bin("rsrun"));
        cmd.current_dir(dir.path())
            .args(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint])
            .args(["--rdzv-id", "netns", "--local-addr", &net.addr(host)])
            .args(["--rdzv-conf", "last_call_timeout=0.5,join_timeout=30", "--rdzv-tls-ca"])
            .arg(&ca);
        if let Some(t) = token {
            cmd.arg("--rdzv-token-file").arg(t);
        }
        cmd.arg(bin("hello")).args(["--steps", "3"]).stdout(Stdio::piped()).stderr(Stdio::piped());
        KillOnDrop::spawn(&mut cmd)
    };
    // Without the token, host B is turned away with a clear error.
    let denied = node(1, None).output_within(Duration::from_secs(30));
    assert_ne!(code(&denied.status), 0);
    let err = text(&denied);
    assert!(err.contains("token") || err.contains("nauthenticated"), "{err}");
    let a = node(0, Some(&tokens));
    let b = node(1, Some(&tokens));
    let ta = std::thread::spawn(move || a.output_within(RUN_DEADLINE));
    let ob = b.output_within(RUN_DEADLINE);
    let oa = ta.join().unwrap();
    assert_eq!(code(&oa.status), 0, "{}", text(&oa));
    assert_eq!(code(&ob.status), 0, "{}", text(&ob));
    let all = String::from_utf8_lossy(&oa.stdout).into_owned() + &String::from_utf8_lossy(&ob.stdout);
    for rank in 0..4 {
        assert!(all.contains(&format!("hello from rank {rank} of 4")), "rank {rank} missing:\n{all}");
        assert!(all.contains(&format!("rank {rank} got unique id")), "{all}");
    }
}

#[test]
fn three_hosts_a_partitioned_host_ends_the_round_and_leaves_no_worker() {
    let uts = Command::new("unshare").args(["--uts", "true"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !uts.is_ok_and(|s| s.success()) {
        eprintln!("skipped: `unshare --uts` is not permitted here (needs root and util-linux)");
        return;
    }
    let Some(net) = Netns::create(3) else { return };
    const HOSTS: usize = 3;
    const NPROC: usize = 2;
    // A short lease; host 3's launcher stops its workers by its own lease, and gives up on an
    // unreachable service after 15 s.
    const LEASE: Duration = Duration::from_secs(3);
    // The round must end within the lease + 1 s; the rest is slack for this loaded 2-core machine.
    const SLACK: Duration = Duration::from_secs(6);
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "netns3-test-token-0123456789abcdef\n").unwrap();
    let (ca, cert, key) = rsrun_tests::tls_files_for(dir.path(), &[&net.addr(0)]);
    let daemon_log = dir.path().join("daemon.log");
    let mut daemon = KillOnDrop::spawn(
        net.exec(0, &bin("rsrun-rendezvous"))
            .args(["serve", "--listen", &format!("{}:0", net.addr(0)), "--token-file"])
            .arg(&tokens)
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&daemon_log).unwrap()),
    );
    let mut out = BufReader::new(daemon.0.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    let endpoint = line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("daemon said {line:?}")).to_string();
    assert!(endpoint.starts_with(&format!("{}:", net.addr(0))), "{endpoint}");
    let status = || {
        let out = net
            .exec(0, &bin("rsrun-rendezvous"))
            .args(["status", "--endpoint", &endpoint, "--job", "netns3", "--token-file"])
            .arg(&tokens)
            .arg("--tls-ca")
            .arg(&ca)
            .output()
            .expect("rsrun-rendezvous status");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let round_of = |status: &str| -> Option<u64> {
        let rest = status.split_once("  round ")?.1;
        rest.split_whitespace().next()?.parse().ok()
    };

    // Each worker records its pid, environment and hostname in its host's directory, then runs for
    // at least 20 s (400 steps of 50 ms).
    let script = concat!(
        "echo $$ >> pids; env > \"env.$LOCAL_RANK\"; hostname > \"hostname.$LOCAL_RANK\"; ",
        "exec \"$1\" --steps 400 --step-ms 50"
    );
    let host_dir = |h: usize| -> PathBuf { dir.path().join(format!("h{}", h + 1)) };
    let conf = format!(
        "last_call_timeout=0.5,join_timeout=60,lease_timeout={},keep_alive_interval=1,keep_alive_timeout=15,read_timeout=1",
        LEASE.as_secs()
    );
    let mut nodes: Vec<Watched> = (0..HOSTS)
        .map(|h| {
            std::fs::create_dir(host_dir(h)).unwrap();
            // No --local-addr: each launcher finds its own namespace's address.
            let mut cmd = net.exec_named(h, &format!("node{}", h + 1), &bin("rsrun"));
            cmd.current_dir(host_dir(h))
                .args(["--nnodes", "3", "--nproc-per-node", &NPROC.to_string(), "--rdzv-backend", "c10d"])
                .args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "netns3", "--rdzv-conf", &conf, "--rdzv-token-file"])
                .arg(&tokens)
                .arg("--rdzv-tls-ca")
                .arg(&ca)
                .args(["sh", "-c", script, "sh"])
                .arg(bin("hello"));
            Watched::spawn(&mut cmd)
        })
        .collect();
    let all_text = |nodes: &[Watched]| -> String {
        let mut s = format!("--- daemon log ---\n{}", std::fs::read_to_string(&daemon_log).unwrap_or_default());
        for (h, n) in nodes.iter().enumerate() {
            s += &format!("--- node{} (launcher pid {}) ---\n{}", h + 1, n.child.pid(), n.text());
        }
        s
    };

    // All six workers run: each passed the start barrier and received rank 0's unique id.
    let world = HOSTS * NPROC;
    let running = wait_until(Duration::from_secs(90), || {
        (0..world).all(|r| nodes.iter().any(|n| n.seen(|l| l.contains(&format!("rank {r} got unique id"))).is_some()))
    });
    assert!(running, "the job never ran on all hosts:\n{}", all_text(&nodes));
    let pids: Vec<Vec<i32>> = (0..HOSTS).map(|h| read_pids(&host_dir(h).join("pids"))).collect();
    for (h, p) in pids.iter().enumerate() {
        assert_eq!(p.len(), NPROC, "node{} workers: {p:?}\n{}", h + 1, all_text(&nodes));
    }

    // 1. Distinct hostnames and addresses; MASTER_ADDR is host 1's namespace address.
    for h in 0..HOSTS {
        for lr in 0..NPROC {
            let name = std::fs::read_to_string(host_dir(h).join(format!("hostname.{lr}"))).unwrap();
            assert_eq!(name.trim(), format!("node{}", h + 1));
            let env = std::fs::read_to_string(host_dir(h).join(format!("env.{lr}"))).unwrap();
            let master = env_value(&env, "MASTER_ADDR").unwrap_or_default();
            assert_eq!(master, net.addr(0), "node{} local rank {lr}: MASTER_ADDR={master:?}", h + 1);
            assert!(!master.starts_with("127.") && master != "localhost" && master != "::1", "{master}");
            assert_eq!(env_value(&env, "WORLD_SIZE").as_deref(), Some("6"), "{env}");
        }
    }
    let before = status();
    let round = round_of(&before).unwrap_or_else(|| panic!("no round in the daemon's status:\n{before}"));
    for h in 0..HOSTS {
        let row = before
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("node{}-", h + 1)))
            .unwrap_or_else(|| panic!("node{} missing from the daemon's status:\n{before}", h + 1));
        assert!(row.contains(&format!(" {} ", net.addr(h))), "node{} does not advertise {}:\n{before}", h + 1, net.addr(h));
    }

    // 2. Partition host 3.
    let down = Instant::now();
    net.set_link(2, false);
    let ended = |l: &str| l.starts_with("rsrun: round ") && l.contains(" ended (");
    let mut daemon_saw: Option<Instant> = None;
    let survivors_noticed = |nodes: &[Watched]| nodes[..2].iter().all(|n| n.seen(ended).is_some());
    // Polls both views: the survivors' consoles (asserted on) and the daemon's status (reported).
    wait_until(LEASE + Duration::from_secs(1) + SLACK + Duration::from_secs(20), || {
        if daemon_saw.is_none() && round_of(&status()).is_some_and(|r| r > round) {
            daemon_saw = Some(Instant::now());
        }
        daemon_saw.is_some() && survivors_noticed(&nodes)
    });
    assert!(
        survivors_noticed(&nodes),
        "hosts 1 and 2 never saw the round end after host 3's link went down:\n{}",
        all_text(&nodes)
    );
    let daemon_saw = daemon_saw.unwrap_or_else(|| panic!("the daemon's status never left round {round}:\n{}", status()));
    let survivors_saw = nodes[..2].iter().filter_map(|n| n.seen(ended)).max().unwrap();
    let to_round_end = survivors_saw.saturating_duration_since(down);
    let daemon_text = format!("{:.2?}", daemon_saw.saturating_duration_since(down));
    eprintln!(
        "netns: link down -> round {round} ended on hosts 1 and 2 after {to_round_end:.2?} \
         (the daemon's status showed the next round after {daemon_text}; lease {LEASE:?})"
    );
    assert!(
        to_round_end <= LEASE + Duration::from_secs(1) + SLACK,
        "the round ended {to_round_end:?} after the link went down (lease {LEASE:?}):\n{}",
        all_text(&nodes)
    );
    // The survivors stopped their workers of that round.
    for (h, p) in pids.iter().enumerate().take(2) {
        let gone = wait_until(Duration::from_secs(30), || p.iter().all(|&w| !alive(w)));
        assert!(gone, "node{} workers {p:?} survived the round", h + 1);
    }

    // Host 3's launcher, cut off, stops its workers by its own lease (T4), long before it gives up
    // on the service, and then exits naming the endpoint.
    let stopped = wait_until(Duration::from_secs(45), || pids[2].iter().all(|&w| !alive(w)));
    assert!(stopped, "node3's workers {:?} still run {:?} after the partition:\n{}", pids[2], down.elapsed(), all_text(&nodes));
    let host3_stopped = down.elapsed();
    assert!(
        host3_stopped <= LEASE + Duration::from_secs(1) + SLACK,
        "node3's workers stopped {host3_stopped:?} after the partition, not by its lease {LEASE:?}:\n{}",
        all_text(&nodes)
    );
    let st = nodes[2].wait_exit(Duration::from_secs(45));
    let host3_exited = down.elapsed();
    let st = st.unwrap_or_else(|| panic!("node3's launcher still runs {host3_exited:?} after the partition:\n{}", all_text(&nodes)));
    eprintln!("netns: node3 workers gone after {host3_stopped:.2?}, its launcher exited ({st}) after {host3_exited:.2?}");
    assert_ne!(code(&st), 0, "{}", all_text(&nodes));
    let t3 = nodes[2].text();
    assert!(
        t3.contains(&format!("lost contact with the rendezvous service at {endpoint}")),
        "node3's launcher did not name the rendezvous endpoint {endpoint}:\n{}",
        all_text(&nodes)
    );
    // Once the link is back, host 3 still has no worker; the survivors started none either (the
    // job needs 3 nodes, so they wait for a new round).
    net.set_link(2, true);
    std::thread::sleep(Duration::from_secs(1));
    let after: Vec<Vec<i32>> = (0..HOSTS).map(|h| read_pids(&host_dir(h).join("pids"))).collect();
    assert_eq!(after, pids, "workers were started after the partition:\n{}", all_text(&nodes));
    for p in &after {
        for &w in p {
            assert!(!alive(w), "worker {w} is still alive:\n{}", all_text(&nodes));
        }
    }

    // The survivors wait for a third node; stop them. Nothing is left behind.
    for n in &nodes[..2] {
        kill(n.child.pid(), libc::SIGTERM);
    }
    for (h, n) in nodes.iter_mut().enumerate().take(2) {
        let st = n.wait_exit(Duration::from_secs(30));
        assert!(st.is_some(), "node{}'s launcher ignored SIGTERM", h + 1);
    }
    let everyone: Vec<i32> = (0..HOSTS).flat_map(|h| read_pids(&host_dir(h).join("pids"))).collect();
    assert_eq!(everyone.len(), world, "{everyone:?}");
    assert!(everyone.iter().all(|&w| !alive(w)), "a worker outlived its launcher: {everyone:?}");
    drop(nodes);
    drop(daemon);
    // Nothing of the network is left: no namespace, no veth end.
    let names: Vec<String> = net.hosts.iter().chain([&net.bridge]).cloned().collect();
    let links: Vec<String> = net.devs.iter().chain(&net.ports).cloned().collect();
    drop(net);
    let listed = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout).into_owned();
    let mut left: Vec<&str> =
        listed.lines().filter_map(|l| l.split_whitespace().next()).filter(|n| names.iter().any(|m| m == n)).collect();
    left.extend(links.iter().map(String::as_str).filter(|l| ip(&["link", "show", "dev", l])));
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// An rsh (`--rsh`) for the namespace hosts: called like ssh, `[OPTIONS] [--] HOST COMMAND`, it runs
/// COMMAND in the network namespace of HOST, which may be named by any of its names.
fn netns_rsh(dir: &Path, net: &Netns, names: &[(&str, usize)]) -> PathBuf {
    let cases: String = names.iter().map(|(name, h)| format!("  {name}) ns={};;\n", net.hosts[*h])).collect();
    let script = format!(
        "#!/bin/sh\n\
         while [ $# -gt 0 ]; do case \"$1\" in -o|-p|-i|-l|-F) shift 2;; --) shift; break;; -*) shift;; *) break;; esac; done\n\
         host=$1; shift\n\
         case \"$host\" in\n{cases}  *) echo \"ssh: Could not resolve hostname $host: Name or service not known\" >&2; exit 255;;\nesac\n\
         exec ip netns exec \"$ns\" sh -c \"$*\"\n"
    );
    let path = dir.join("netns-rsh");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

/// Issue 9, acceptance test 5: one command over three namespace hosts (`--rsh` into each namespace,
/// the head in host 1's). The three share the kernel's boot id but not the network namespace: they
/// run as three hosts, without `--allow-same-host`. The same host listed twice, under its name and
/// its address, is refused with the same-machine error before any worker starts.
#[test]
fn one_command_over_three_namespaces_refuses_a_host_listed_twice() {
    let Some(net) = Netns::create(3) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (a1, a2) = (net.addr(1), net.addr(2));
    let rsh = netns_rsh(dir.path(), &net, &[("node1", 0), ("node2", 1), (&a1, 1), ("node3", 2), (&a2, 2)]);
    let head = |hosts: &str| {
        let mut cmd = net.exec(0, &bin("rsrun"));
        cmd.current_dir(dir.path())
            .args(["-H", hosts, "--rsh"])
            .arg(&rsh)
            .args(["--rdzv-endpoint", &format!("{}:0", net.addr(0)), "--shutdown-timeout", "1"])
            .args(["sh", "-c", "readlink /proc/self/ns/net > ns.$RANK"]);
        KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE)
    };

    // Three namespaces: three hosts.
    let out = head("node1:1,node2:1,node3:1");
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let ns: Vec<String> = (0..3).map(|r| std::fs::read_to_string(dir.path().join(format!("ns.{r}"))).unwrap()).collect();
    assert!(ns[0] != ns[1] && ns[1] != ns[2] && ns[0] != ns[2], "each rank in its host's namespace: {ns:?}");
    for r in 0..3 {
        std::fs::remove_file(dir.path().join(format!("ns.{r}"))).unwrap();
    }

    // node2 and its address are one machine.
    let out = head(&format!("node1:1,node2:1,{a1}:1"));
    assert_eq!(code(&out.status), 2, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "rsrun: error: hosts \"node2\" and \"{a1}\" are the same machine (same boot id and network namespace); list it once, or pass --allow-same-host"
        )),
        "{}",
        text(&out)
    );
    let started: Vec<_> = std::fs::read_dir(dir.path()).unwrap().filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with("ns.")).collect();
    assert!(started.is_empty(), "no worker started");
}
