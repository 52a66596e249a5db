use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::*;

/// A console whose events the test reads back.
fn console() -> (ConsoleTx, tokio::sync::mpsc::Receiver<ConsoleEvent>) {
    tokio::sync::mpsc::channel(1024)
}

fn statuses(rx: &mut tokio::sync::mpsc::Receiver<ConsoleEvent>) -> (Vec<String>, bool) {
    let mut lines = Vec::new();
    let mut done = false;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            ConsoleEvent::Status(t) => lines.push(t),
            ConsoleEvent::StatusDone => done = true,
            _ => {}
        }
    }
    (lines, done)
}

fn nxdomain() -> std::io::Error {
    std::io::Error::other("failed to lookup address information: Name or service not known")
}

#[test]
fn resolution_failures_are_named_as_operators_say_them() {
    assert_eq!(resolve_reason(&nxdomain()), "NXDOMAIN");
    let temp = std::io::Error::other("failed to lookup address information: Temporary failure in name resolution");
    assert_eq!(resolve_reason(&temp), "DNS not answering");
    assert_eq!(resolve_reason(&std::io::Error::other("boom")), "DNS: boom");
}

/// Node rank 0's pod is not up yet: its name does not resolve for a while, and the node waits,
/// saying what for, instead of failing at once.
#[tokio::test(flavor = "current_thread")]
async fn a_name_that_resolves_late_is_waited_for() {
    let (tx, mut rx) = console();
    let calls = AtomicU32::new(0);
    let want: SocketAddr = "10.0.0.7:29500".parse().unwrap();
    let got = resolve_with("trainer-node-0-0.trainer", 29500, Duration::from_secs(60), &tx, || {
        let n = calls.fetch_add(1, Ordering::SeqCst);
        async move { if n < 2 { Err(nxdomain()) } else { Ok(vec![want]) } }
    })
    .await
    .unwrap();
    assert_eq!(got, want);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let (lines, done) = statuses(&mut rx);
    assert!(!lines.is_empty() && done, "{lines:?}");
    assert!(
        lines[0].starts_with("rsrun: waiting for trainer-node-0-0.trainer:29500 (NXDOMAIN), where node rank 0 hosts the rendezvous"),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_name_that_never_resolves_fails_at_the_join_timeout_naming_it() {
    let (tx, mut rx) = console();
    let err = resolve_with("nope.invalid", 29500, Duration::from_millis(300), &tx, || async { Err(nxdomain()) })
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot resolve nope.invalid:29500") && err.contains("NXDOMAIN") && err.contains("join_timeout"), "{err}");
    let (_, done) = statuses(&mut rx);
    assert!(done, "the status line is closed");
}

#[test]
fn candidate_ports_stop_at_65535() {
    let a: SocketAddr = "127.0.0.1:65533".parse().unwrap();
    let ports: Vec<u16> = candidates(a, 7).iter().map(SocketAddr::port).collect();
    assert_eq!(ports, vec![65533, 65534, 65535]);
    assert_eq!(candidates(a, 0).len(), 1);
}

fn hc(job: &str, port_probe: u16) -> HostConfig<'_> {
    HostConfig { job, token_file: None, token: None, port_probe }
}

/// Two Slurm steps derived the same port: the second step's node 0 hosts on a next port, its other
/// nodes find it there, and each service refuses the other job naming both.
#[tokio::test(flavor = "current_thread")]
async fn node_0_moves_to_a_next_port_and_the_others_find_it() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let p: SocketAddr = SocketAddr::from(([127, 0, 0, 1], port));
    let (a_addr, a) = host(p, &hc("slurm-1.0.r0", 7)).await.unwrap();
    assert_eq!(a_addr, p);
    let _a = a.expect("job A hosts");

    // Job B derived the same port.
    let (b_addr, b) = host(p, &hc("slurm-2.0.r0", 7)).await.unwrap();
    assert!(b_addr.port() > p.port() && b_addr.port() <= p.port() + 7, "{b_addr}");
    let _b = b.expect("job B hosts on a next port");

    assert_eq!(probe(p, "slurm-2.0.r0", None).await, Found::OtherJob("slurm-1.0.r0".into()));
    assert_eq!(probe(p, "slurm-1.0.r0", None).await, Found::Ours);
    assert_eq!(probe(b_addr, "slurm-2.0.r0", None).await, Found::Ours);

    let (tx, _rx) = console();
    let found = find("127.0.0.1", p, 7, "slurm-2.0.r0", None, Duration::from_secs(30), &tx).await.unwrap();
    assert_eq!(found, b_addr);

    // Another launcher claiming node rank 0 of job A joins A's service (the rendezvous then names
    // both claimants); it does not host a second one.
    let (again, none) = host(p, &hc("slurm-1.0.r0", 7)).await.unwrap();
    assert_eq!(again, p);
    assert!(none.is_none());

    // Without probing (Kubernetes, typed ports), a port held by another job is an error naming it.
    let err = host(p, &hc("k8s-x", 0)).await.unwrap_err().to_string();
    assert!(err.contains("\"k8s-x\"") && err.contains("serves job \"slurm-1.0.r0\""), "{err}");

    // A third job's node that never finds its node 0 names what each port holds.
    let err = find("127.0.0.1", p, 7, "slurm-3.0.r0", None, Duration::from_millis(200), &tx).await.unwrap_err().to_string();
    assert!(err.contains("\"slurm-3.0.r0\"") && err.contains("serves job \"slurm-1.0.r0\"") && err.contains("serves job \"slurm-2.0.r0\""), "{err}");
    assert!(err.contains(&format!("127.0.0.1:{}..{}", p.port(), p.port() + 7)), "{err}");
}

/// A join for another job at a single-job service is refused, and the refusal names both jobs.
#[tokio::test(flavor = "current_thread")]
async fn a_single_job_service_refuses_a_join_of_another_job() {
    use rsrun_rendezvous::client::{JobSpec, JoinSpec};
    let (addr, server) = host(SocketAddr::from(([127, 0, 0, 1], 0)), &hc("slurm-1.0.r0", 0)).await.unwrap();
    let _server = server.unwrap();
    let client = RdzvClient::connect(ClientConfig::new(addr.to_string())).unwrap();
    let spec = JoinSpec {
        job_id: "slurm-2.0.r0".into(),
        node_id: "n".into(),
        addrs: vec!["127.0.0.1".into()],
        local_world_size: 1,
        rank_hint: None,
        config: JobSpec {
            min_nodes: 1,
            max_nodes: 1,
            last_call: Duration::ZERO,
            lease: Duration::from_secs(10),
            max_restarts: 0,
            fixed_ranks: false,
        },
        timeout: Duration::from_secs(5),
        master_port: 1,
        hostname: "h".into(),
    };
    let err = client.join(spec).await.unwrap_err().to_string();
    assert!(err.contains("serves only job \"slurm-1.0.r0\"") && err.contains("job \"slurm-2.0.r0\" cannot use it"), "{err}");
}

#[test]
fn node_rank_0_on_loopback_is_refused_unless_every_host_is() {
    let lo: std::net::IpAddr = "127.0.1.1".parse().unwrap();
    let net: std::net::IpAddr = "10.1.0.2".parse().unwrap();
    let others = vec![("node2".to_owned(), vec![net])];
    let msg = loopback_conflict("node1", lo, &others).unwrap();
    assert_eq!(
        msg,
        "node rank 0's host node1 resolves to 127.0.1.1 here, a loopback address (the `127.0.1.1 node1` line of Debian's /etc/hosts), while node2 resolves to 10.1.0.2: the other nodes cannot reach node rank 0's rendezvous there; map node1 to its network address in /etc/hosts, or pass --rdzv-endpoint ADDR:PORT"
    );
    // An all-loopback list is a one-machine test.
    let all_lo = vec![("127.0.0.2".to_owned(), vec!["127.0.0.2".parse().unwrap()])];
    assert_eq!(loopback_conflict("127.0.0.1", "127.0.0.1".parse().unwrap(), &all_lo), None);
    // A network address for node rank 0 is always fine; unresolved others do not count.
    assert_eq!(loopback_conflict("node1", net, &others), None);
    assert_eq!(loopback_conflict("node1", lo, &[("node2".to_owned(), Vec::new())]), None);
}

#[tokio::test]
async fn refuse_loopback_resolves_the_other_hosts() {
    let at = |ip: &str| std::net::SocketAddr::new(ip.parse().unwrap(), 29500);
    let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let e = refuse_loopback("localhost", at("127.0.0.1"), &list(&["localhost", "192.0.2.7"])).await.unwrap_err();
    assert!(e.0.contains("while 192.0.2.7 resolves to 192.0.2.7"), "{e}");
    assert!(refuse_loopback("127.0.0.1", at("127.0.0.1"), &list(&["127.0.0.1", "127.0.0.2"])).await.is_ok());
    assert!(refuse_loopback("n", at("192.0.2.1"), &list(&["n", "192.0.2.7"])).await.is_ok());
    // A head's --rdzv-endpoint on loopback, with a host elsewhere: named as the head's.
    let e = refuse_loopback_of(HEAD, "localhost", at("127.0.0.1"), &list(&["192.0.2.7", "192.0.2.8"])).await.unwrap_err();
    assert!(e.0.starts_with("the head's --rdzv-endpoint localhost resolves to 127.0.0.1 here"), "{e}");
    assert!(e.0.contains("cannot reach the head's rendezvous there"), "{e}");
}
