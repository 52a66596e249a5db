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
    let got: Vec<(&str, u32, u32, bool)> =
        p.nodes.iter().map(|n| (n.host.host.as_str(), n.node_rank, n.rank_offset, n.local)).collect();
    assert_eq!(got, [("w1", 0, 0, false), ("w2", 1, 2, false), ("localhost", 2, 6, true)]);
    assert_eq!(p.world_size(), 7);
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
    assert!(err(&["-H", "localhost:1,127.0.0.1:1", "true"]).contains("are both this machine; pass --allow-same-host"));
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
    let place = NodePlace { nnodes: 1, nproc_per_node: "2", node_rank: 0, endpoint: "10.0.0.1:5", job_id: "j", token_file: None };
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
