//! Two "hosts" made of network namespaces joined by a veth pair (10.201.X.1 and 10.201.X.2): the
//! daemon and one launcher on host A, another launcher on host B, token-authenticated because the
//! daemon listens on a non-loopback address. Needs root and iproute2; skipped with a message otherwise.
//! Only these namespaces' own addresses are ever contacted.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, bin, code, text};

struct Netns {
    names: [String; 2],
    subnet: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Netns {
    /// Creates the two namespaces and the link, or `None` (with a printed reason) when not permitted.
    fn create() -> Option<Netns> {
        let id = std::process::id();
        let names = [format!("rsrun-{id}-a"), format!("rsrun-{id}-b")];
        let subnet = format!("10.201.{}", id % 250 + 1);
        if !ip(&["netns", "add", &names[0]]) {
            eprintln!("skipped: cannot create network namespaces here (needs root and iproute2)");
            return None;
        }
        let ns = Netns { names: names.clone(), subnet: subnet.clone() };
        let (va, vb) = (format!("rv{id}a"), format!("rv{id}b"));
        let ok = ip(&["netns", "add", &names[1]])
            && ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])
            && ip(&["link", "set", &va, "netns", &names[0]])
            && ip(&["link", "set", &vb, "netns", &names[1]])
            && ip(&["-n", &names[0], "addr", "add", &format!("{subnet}.1/24"), "dev", &va])
            && ip(&["-n", &names[1], "addr", "add", &format!("{subnet}.2/24"), "dev", &vb])
            && ip(&["-n", &names[0], "link", "set", &va, "up"])
            && ip(&["-n", &names[1], "link", "set", &vb, "up"])
            && ip(&["-n", &names[0], "link", "set", "lo", "up"])
            && ip(&["-n", &names[1], "link", "set", "lo", "up"]);
        if !ok {
            eprintln!("skipped: cannot set up the veth link between the test namespaces");
            return None;
        }
        Some(ns)
    }

    fn exec(&self, host: usize, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.names[host]]).arg(program);
        cmd.env("RUST_BACKTRACE", "0").env_remove("RSRUN_LOG").env_remove("RUST_LOG");
        for (k, _) in std::env::vars() {
            if k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") || k == "OMP_NUM_THREADS" {
                cmd.env_remove(k);
            }
        }
        cmd
    }

    fn addr(&self, host: usize) -> String {
        format!("{}.{}", self.subnet, host + 1)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            // Deleting a namespace also removes its end of the veth pair.
            ip(&["netns", "delete", n]);
        }
    }
}

#[test]
fn two_hosts_in_network_namespaces_through_an_authenticated_daemon() {
    let Some(net) = Netns::create() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "netns-test-token-0123456789abcdef\n").unwrap();
    let mut daemon = KillOnDrop::spawn(
        net.exec(0, &bin("rsrun-rendezvous"))
            .args(["serve", "--listen", &format!("{}:0", net.addr(0)), "--token-file"])
            .arg(&tokens)
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
            .args(["--rdzv-conf", "last_call_timeout=0.5,join_timeout=30"]);
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
