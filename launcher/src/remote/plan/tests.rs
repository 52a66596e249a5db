use std::path::Path;

use super::*;
use crate::plan::tests::{host, parse};

const EXE: &str = "/opt/rsrun/bin/rsrun";

fn resolve(args: &[&str]) -> Result<RemotePlan, PlanError> {
    RemotePlan::resolve(&parse(args), &host(), Path::new(EXE))
}

fn err(args: &[&str]) -> String {
    resolve(args).unwrap_err().to_string()
}

fn argv(n: &RemoteNode) -> Vec<String> {
    n.argv.iter().map(|a| a.to_string_lossy().into_owned()).collect()
}

#[test]
fn hosts_become_nodes_in_order_with_contiguous_ranks() {
    let p = resolve(&["-H", "w1:2,w2:4,localhost:1", "--allow-same-host", "--rdzv-endpoint", "127.0.0.1:0", "true"]).unwrap();
    let got: Vec<(&str, u32, Option<u32>, bool)> =
        p.nodes.iter().map(|n| (n.host.host.as_str(), n.node_rank, n.rank_offset, n.local)).collect();
    assert_eq!(got, [("w1", 0, Some(0), false), ("w2", 1, Some(2), false), ("localhost", 2, Some(6), true)]);
    assert_eq!(p.world_size(), Some(7));
    assert_eq!(
        argv(&p.nodes[1]),
        [
            "ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15", "-o",
            "ServerAliveCountMax=4", "--", "w2", "exec '/opt/rsrun/bin/rsrun' agent --stdin",
        ]
    );
    assert_eq!(argv(&p.nodes[2]), [EXE, "agent", "--stdin"]);
    assert!(matches!(&p.rdzv, RemoteRdzv::Embedded { bind, advertise } if bind.port() == 0 && advertise == "127.0.0.1"));
    assert!(p.token.as_ref().is_some_and(|t| t.len() >= 16), "a token per job");
    assert!(p.job_id.starts_with("ssh-testhost-"), "{}", p.job_id);
}

#[test]
fn ssh_flags_and_rsh() {
    let p = resolve(&[
        "-H", "w1:1", "--rsh", "/t/fake-rsh -v", "--ssh-port", "2222", "--ssh-identity", "/k/id", "--ssh-connect-timeout", "3",
        "--ssh-option", "StrictHostKeyChecking=accept-new", "--remote-rsrun", "/usr/local/bin/rsrun", "--rdzv-endpoint",
        "127.0.0.1", "true",
    ])
    .unwrap();
    assert_eq!(
        argv(&p.nodes[0]),
        [
            "/t/fake-rsh", "-v", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", "-o", "ServerAliveInterval=15", "-o",
            "ServerAliveCountMax=4", "-p", "2222", "-i", "/k/id", "-o", "StrictHostKeyChecking=accept-new", "--", "w1",
            "exec '/usr/local/bin/rsrun' agent --stdin",
        ]
    );
    // --ssh-local reaches a local host through ssh too.
    let p = resolve(&["-H", "127.0.0.1:1", "--ssh-local", "true"]).unwrap();
    assert!(!p.nodes[0].local && argv(&p.nodes[0])[0] == "ssh");
}

#[test]
fn user_errors_name_the_value() {
    assert!(err(&["-H", "w1:0", "true"]).contains("slots=0 on host \"w1\""));
    assert_eq!(
        err(&["-H", "localhost:1,127.0.0.1:1", "true"]),
        "hosts \"localhost\" and \"127.0.0.1\" are the same machine (both name this machine); list it once, or pass --allow-same-host to run several nodes on one machine"
    );
    assert!(err(&["-H", "w1:1,w1:1", "true"]).contains("duplicate host \"w1\""));
    assert!(err(&["-H", "w1:1,w2:1", "--nnodes", "3", "true"]).contains("--nnodes 3 but -H lists 2 hosts"));
    assert!(err(&["-H", "w1:1", "--node-rank", "1", "true"]).contains("--node-rank cannot be used"));
    assert!(err(&["-H", "w1:1", "--ssh-option", "BatchMode", "true"]).contains("invalid value 'BatchMode' for --ssh-option"));
    assert!(err(&["-H", "w1:1", "--remote-rsrun", "rsrun", "true"]).contains("--remote-rsrun"));
    assert!(err(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1:0", "--shutdown-timeout", "x", "true"])
        .contains("invalid value 'x' for --shutdown-timeout"));
    assert!(err(&["-H", "w1:1", "--rdzv-endpoint", "0.0.0.0", "true"]).contains("not 0.0.0.0"));
    assert!(err(&["-H", "w1:1", "--hostfile", "x", "true"]).contains("cannot be used together"));
    assert!(err(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1", "-x", "NOPE_NOT_SET", "true"]).contains("-x NOPE_NOT_SET"));
}

#[test]
fn per_node_options_round_trip_through_the_parser() {
    let p = resolve(&[
        "-H", "w1:2", "--rdzv-endpoint", "127.0.0.1", "--max-restarts", "2", "--shutdown-timeout", "1.5", "--tee", "3",
        "--log-prefix", "[${rank}] ", "--rdzv-conf", "join_timeout=30", "--no-python", "sh", "-c", "echo \"$RANK\"",
    ])
    .unwrap();
    assert_eq!(p.shutdown, Duration::from_secs_f64(1.5));
    let place = NodePlace { nnodes: 1, nproc_per_node: "2", node_rank: 0, endpoint: "10.0.0.1:5", job_id: "j", token_file: None, tls_ca_file: None };
    let args = parse(&agent_argv(&p.options, place, &p.program).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(args.max_restarts, 2);
    assert_eq!(args.shutdown_timeout.as_deref(), Some("1.5"));
    assert_eq!(args.log_prefix.as_deref(), Some("[${rank}] "));
    assert_eq!(args.rdzv_conf, "join_timeout=30,is_host=false");
    assert!(args.no_python);
    assert_eq!(args.node_rank, Some(0));
    assert_eq!(args.rdzv_endpoint, "10.0.0.1:5");
    assert_eq!(args.command, ["sh", "-c", "echo \"$RANK\""]);
    let plan = LaunchPlan::resolve(&args, &host()).unwrap();
    assert_eq!(plan.nproc_per_node, 2);
    assert_eq!(plan.rank_hint, Some(0));
}

#[test]
fn dry_run_lists_hosts_env_names_and_argv() {
    let dir = tempfile::tempdir().unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    h.env.insert("NCCL_DEBUG".into(), "INFO".into());
    let args = parse(&["-H", "w1:2,w2:2", "--rdzv-endpoint", "127.0.0.1", "-x", "SECRET=hunter2", "--dry-run", "true"]);
    let p = RemotePlan::resolve(&args, &h, Path::new(EXE)).unwrap();
    let text = super::super::dry_run::render(&p);
    assert!(text.contains("node 1   w2                   slots 2   ranks 2-3 (ssh)"), "{text}");
    assert!(text.contains("  NCCL_DEBUG                       environment"), "{text}");
    assert!(text.contains("  SECRET                           -x"), "{text}");
    assert!(!text.contains("hunter2"), "values are not shown: {text}");
    assert!(text.contains("  w2: ssh -T -o BatchMode=yes -o ConnectTimeout=10 -o ServerAliveInterval=15 -o ServerAliveCountMax=4 -- w2 'exec '\\''/opt/rsrun/bin/rsrun'\\'' agent --stdin'"), "{text}");
}

#[test]
fn hostfile_user_port_and_addr_reach_the_ssh_argv() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "w1 slots=1\nw2 slots=2 user=alice port=2200 addr=10.9.9.9\nbob@w3 slots=1\n").unwrap();
    let args = parse(&["--hostfile", hosts.to_str().unwrap(), "--ssh-user", "me", "--ssh-port", "22", "--rdzv-endpoint", "127.0.0.1", "--dry-run", "true"]);
    let p = RemotePlan::resolve(&args, &host(), Path::new(EXE)).unwrap();
    let tail = |i: usize| argv(&p.nodes[i])[10..].to_vec();
    assert_eq!(tail(0), ["-p", "22", "-l", "me", "--", "w1", "exec '/opt/rsrun/bin/rsrun' agent --stdin"]);
    assert_eq!(tail(1), ["-p", "2200", "-l", "alice", "--", "10.9.9.9", "exec '/opt/rsrun/bin/rsrun' agent --stdin"]);
    assert_eq!(tail(2), ["-p", "22", "-l", "bob", "--", "w3", "exec '/opt/rsrun/bin/rsrun' agent --stdin"]);
    assert_eq!(p.nodes[1].host.host, "w2", "the name stays the host's label");
    let text = super::super::dry_run::render(&p);
    assert!(text.contains("node 1   w2                   slots 2   ranks 1-2 (ssh, user alice, port 2200, to 10.9.9.9)"), "{text}");
    // Two names that reach one address are one machine.
    std::fs::write(&hosts, "w1 slots=1 addr=10.9.9.9\nw2 slots=1 addr=10.9.9.9\n").unwrap();
    let e = RemotePlan::resolve(&parse(&["--hostfile", hosts.to_str().unwrap(), "true"]), &host(), Path::new(EXE)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "hosts \"w1\" and \"w2\" are the same machine (both reach 10.9.9.9); list it once, or pass --allow-same-host to run several nodes on one machine"
    );
    // One address behind different ssh ports (containers behind one gateway) is no conflict
    // by name; the same port twice is.
    std::fs::write(&hosts, "w1 slots=1 addr=10.9.9.9 port=2201\nw2 slots=1 addr=10.9.9.9 port=2202\n").unwrap();
    RemotePlan::resolve(&parse(&["--hostfile", hosts.to_str().unwrap(), "true"]), &host(), Path::new(EXE)).unwrap();
    std::fs::write(&hosts, "w1 slots=1 addr=10.9.9.9 port=2201\nw2 slots=1 addr=10.9.9.9 port=2201\n").unwrap();
    let e = RemotePlan::resolve(&parse(&["--hostfile", hosts.to_str().unwrap(), "true"]), &host(), Path::new(EXE)).unwrap_err();
    assert!(e.to_string().contains("(both reach 10.9.9.9:2201)"), "{e}");
    // An addr= that is this machine starts a local agent.
    std::fs::write(&hosts, "w1 slots=1 addr=127.0.0.1\n").unwrap();
    let p = RemotePlan::resolve(&parse(&["--hostfile", hosts.to_str().unwrap(), "true"]), &host(), Path::new(EXE)).unwrap();
    assert!(p.nodes[0].local);
    // ... unless a port or user of its own names an ssh server of its own (a container's sshd
    // behind this host's port 2222): reached over ssh, with them.
    std::fs::write(&hosts, "localhost slots=1 port=2222\nbob@127.0.0.1 slots=1\n").unwrap();
    let p = RemotePlan::resolve(&parse(&["--hostfile", hosts.to_str().unwrap(), "--allow-same-host", "true"]), &host(), Path::new(EXE)).unwrap();
    assert!(!p.nodes[0].local && !p.nodes[1].local);
    assert!(argv(&p.nodes[0]).windows(2).any(|w| w == ["-p", "2222"]), "{:?}", argv(&p.nodes[0]));
    assert!(argv(&p.nodes[1]).windows(2).any(|w| w == ["-l", "bob"]), "{:?}", argv(&p.nodes[1]));
}

#[test]
fn fanout_check_and_same_host_in_the_plan_and_dry_run() {
    let p = resolve(&["-H", "w1:1,w2:1,w3:1", "--ssh-fanout", "2", "--check", "--rdzv-endpoint", "127.0.0.1", "true"]).unwrap();
    assert_eq!((p.fanout, p.check, p.allow_same_host), (2, true, false));
    let text = super::super::dry_run::render(&p);
    assert!(text.contains("fan-out      : at most 2 of 3 ssh hosts connecting at once (--ssh-fanout)"), "{text}");
    assert!(text.contains("same machine : refused before any worker starts"), "{text}");
    assert!(text.contains("check        : preflight only (--check)"), "{text}");
    let p = resolve(&["-H", "w1:1", "--allow-same-host", "--rdzv-endpoint", "127.0.0.1", "true"]).unwrap();
    assert_eq!((p.fanout, p.check, p.allow_same_host), (128, false, true), "default fan-out 128");
    // clap refuses a zero window, naming the value.
    let e = crate::cli::LaunchArgs::try_parse_with_origins_from(["rsrun", "-H", "w1:1", "--ssh-fanout", "0", "true"]).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("invalid value '0' for '--ssh-fanout <N>'"), "{e}");
    let e = crate::cli::LaunchArgs::try_parse_with_origins_from(["rsrun", "-H", "w1:1", "--ssh-fanout", "many", "true"]).unwrap_err();
    assert!(e.to_string().contains("invalid value 'many' for '--ssh-fanout <N>'"), "{e}");
}

#[test]
fn chdir_sets_every_hosts_directory() {
    let p = resolve(&["-H", "w1:1", "--chdir", "/shared/run7", "--rdzv-endpoint", "127.0.0.1", "true"]).unwrap();
    assert_eq!(p.cwd, Path::new("/shared/run7"));
    assert!(super::super::dry_run::render(&p).contains("cwd          : /shared/run7\n"));
    assert_eq!(
        err(&["-H", "w1:1", "--chdir", "run7", "true"]),
        "invalid value 'run7' for --chdir: expected an absolute path (the directory on every host)"
    );
    // The head's own plan carries no "no effect" note for its multi-node flags.
    let node = LaunchPlan::resolve(&parse(&["-H", "w1:1", "-x", "A=1", "--chdir", "/x", "true"]), &host()).unwrap();
    assert!(!node.notes.iter().any(|n| n.contains("no effect")), "{:?}", node.notes);
}

/// A working directory that is not UTF-8 is refused at the head: the agents get the directory
/// as text, and a lossy copy would send them to one that does not exist.
#[test]
fn a_non_utf8_working_directory_is_refused_by_name() {
    use std::os::unix::ffi::OsStringExt;
    let mut h = host();
    h.cwd = std::path::PathBuf::from(std::ffi::OsString::from_vec(b"/data/caf\xe9".to_vec()));
    let args = parse(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1", "true"]);
    let e = RemotePlan::resolve(&args, &h, Path::new(EXE)).unwrap_err().to_string();
    assert!(e.starts_with("invalid value '/data/caf\u{fffd}' for the working directory: expected a UTF-8 path"), "{e}");
    // --chdir with a UTF-8 directory is the way out.
    let args = parse(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1", "--chdir", "/data/cafe", "true"]);
    assert!(RemotePlan::resolve(&args, &h, Path::new(EXE)).is_ok());
}

/// The per-node check resolves node 0 as its agent will: the log filters name ranks of the whole
/// table (world 10 here), which the first host's slots alone do not bound.
#[test]
fn per_node_check_takes_ranks_of_the_whole_table() {
    assert!(resolve(&["-H", "w1:2,w2:8", "--rdzv-endpoint", "127.0.0.1:0", "--ranks-filter", "9", "true"]).is_ok());
    assert!(resolve(&["-H", "w1:2,w2:8", "--rdzv-endpoint", "127.0.0.1:0", "--local-ranks-filter", "5", "true"]).is_ok());
}

/// The head need not have the program (a login node): its node plan says what it could not find,
/// and the remote plan resolves; in `--chdir DIR` that the head has, the program is found there. A
/// malformed value is still refused by the head.
#[test]
fn the_head_does_not_need_the_program() {
    let login = tempfile::tempdir().unwrap();
    let shared = tempfile::tempdir().unwrap();
    let script = shared.path().join("run.sh");
    std::fs::write(&script, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut h = host();
    h.cwd = login.path().to_owned();
    let chdir = shared.path().to_str().unwrap();
    let args = parse(&["-H", "w1:1,w2:1", "--rdzv-endpoint", "127.0.0.1", "--no-python", "./run.sh"]);
    let node = head_node_plan(&args, &h).unwrap();
    assert!(matches!(&node, Err(PlanError::Program(m)) if m.contains("'./run.sh' not found")), "{node:?}");
    assert!(RemotePlan::resolve(&args, &h, Path::new(EXE)).is_ok());
    let args = parse(&["-H", "w1:1,w2:1", "--rdzv-endpoint", "127.0.0.1", "--chdir", chdir, "--no-python", "./run.sh"]);
    let node = head_node_plan(&args, &h).unwrap().unwrap();
    assert_eq!(node.program.exe, shared.path().join("./run.sh"));
    let args = parse(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1", "--chdir", chdir, "--monitor-interval", "soon", "--no-python", "./run.sh"]);
    let err = head_node_plan(&args, &h).unwrap_err().to_string();
    assert!(err.contains("invalid value 'soon' for --monitor-interval"), "{err}");
}

/// `--rdzv-tls-ca` with an external daemon: the head reads and checks the CA, which every agent gets
/// in its launch plan; the head's own rendezvous is plaintext, so there it is only a note.
#[test]
fn the_tls_ca_of_an_external_daemon_is_read_by_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    let key = rcgen::KeyPair::generate().unwrap();
    let pem = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap().self_signed(&key).unwrap().pem();
    std::fs::write(&ca, &pem).unwrap();
    let ca_s = ca.to_str().unwrap();
    let p = resolve(&["-H", "w1:1,w2:1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.9:29400", "--rdzv-tls-ca", ca_s, "true"]).unwrap();
    assert_eq!(p.tls_ca, Some(TlsCa { path: ca.clone(), pem: pem.into_bytes() }));
    assert!(super::super::dry_run::render(&p).contains(&format!("rsrun-rendezvous daemon at 10.0.0.9:29400, TLS verified with {ca_s}")));
    std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\nMIIB\n").unwrap();
    let e = err(&["-H", "w1:1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.9:29400", "--rdzv-tls-ca", ca_s, "true"]);
    assert!(e.starts_with(&format!("invalid value '{ca_s}' for --rdzv-tls-ca: expected a file of PEM CA certificates")), "{e}");
    let p = resolve(&["-H", "w1:1", "--rdzv-endpoint", "127.0.0.1", "--rdzv-tls-ca", "/nonexistent/ca.pem", "true"]).unwrap();
    assert_eq!(p.tls_ca, None);
    assert!(p.notes.iter().any(|n| n.starts_with("--rdzv-tls-ca is not used")), "{:?}", p.notes);
}

/// `--ssh-option` for one of rsrun's own ssh settings replaces it; a ConnectTimeout set so also sets
/// how long the head waits for the agent to start.
#[test]
fn ssh_options_replace_rsrun_defaults() {
    let p = resolve(&["-H", "w1:1", "--ssh-option", "ServerAliveInterval=5", "--ssh-option", "ConnectTimeout=45", "--rdzv-endpoint", "127.0.0.1", "true"]).unwrap();
    assert_eq!(
        argv(&p.nodes[0]),
        [
            "ssh", "-T", "-o", "BatchMode=yes", "-o", "ServerAliveCountMax=4", "-o", "ServerAliveInterval=5", "-o", "ConnectTimeout=45",
            "--", "w1", "exec '/opt/rsrun/bin/rsrun' agent --stdin",
        ]
    );
    assert_eq!(p.ssh.connect_timeout, Duration::from_secs(45));
    assert_eq!(p.start_timeout, Duration::from_secs(45) + START_SLACK);
}

/// A bare hostfile host without --nproc-per-node: its agent starts one worker per GPU there, else
/// one (`--nproc-per-node gpu-or-1`); the ranks after it are known once the agents start.
#[test]
fn a_bare_hostfile_host_gets_auto_slots() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    std::fs::write(&hosts, "w1 slots=2\nw2\nw3 slots=1\n").unwrap();
    let args = parse(&["--hostfile", hosts.to_str().unwrap(), "--rdzv-endpoint", "127.0.0.1", "--dry-run", "true"]);
    let p = RemotePlan::resolve(&args, &host(), Path::new(EXE)).unwrap();
    assert_eq!(p.nodes[1].host.slots, Slots::Auto);
    let offsets: Vec<Option<u32>> = p.nodes.iter().map(|n| n.rank_offset).collect();
    assert_eq!(offsets, [Some(0), Some(2), None]);
    assert_eq!(p.world_size(), None);
    assert_eq!(p.nodes[1].host.slots.agent_value(), "gpu-or-1");
    assert!(p.notes.iter().any(|n| n.contains("w2: no slot count")), "{:?}", p.notes);
    let text = super::super::dry_run::render(&p);
    assert!(text.contains("world size known at start (hosts with auto slots)"), "{text}");
    assert!(text.contains("node 1   w2                   slots auto ranks 2-"), "{text}");
    assert!(text.contains("node 2   w3                   slots 1   ranks known at start"), "{text}");
    // With --nproc-per-node, a bare host gets that count.
    std::fs::write(&hosts, "w1\nw2\nw3\n").unwrap();
    let args = parse(&["--hostfile", hosts.to_str().unwrap(), "--nproc-per-node", "3", "--rdzv-endpoint", "127.0.0.1", "true"]);
    let p = RemotePlan::resolve(&args, &host(), Path::new(EXE)).unwrap();
    assert_eq!(p.nodes[1].host.slots, Slots::Count(3));
    assert_eq!(p.world_size(), Some(9));
}
