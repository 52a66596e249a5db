//! Several launchers started with the same documented arguments form one job with distinct global
//! ranks, or stop with an error naming the conflict: the static backend verifies its node ranks
//! through a rendezvous hosted by node rank 0, and `--rdzv-endpoint` without a backend means c10d.

use std::collections::BTreeSet;
use std::process::Output;

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, bin, code, free_port, rsrun, text};

fn launcher(dir: &std::path::Path, args: &[&str]) -> KillOnDrop {
    let mut cmd = rsrun(dir);
    cmd.args(args).arg(bin("hello")).args(["--steps", "2"]);
    KillOnDrop::spawn(&mut cmd)
}

fn all(nodes: Vec<KillOnDrop>) -> Vec<Output> {
    let handles: Vec<_> = nodes.into_iter().map(|n| std::thread::spawn(move || n.output_within(RUN_DEADLINE))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `(rank, world)` of every "hello from rank R of W" line.
fn ranks(outs: &[Output]) -> Vec<(u32, u32)> {
    let mut v = Vec::new();
    for o in outs {
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            if let Some(rest) = line.split("hello from rank ").nth(1) {
                let mut it = rest.split_whitespace();
                let r = it.next().and_then(|r| r.parse().ok());
                let w = it.nth(1).and_then(|w| w.parse().ok());
                if let (Some(r), Some(w)) = (r, w) {
                    v.push((r, w));
                }
            }
        }
    }
    v.sort();
    v
}

#[test]
fn readme_cluster_command_without_backend_forms_one_job() {
    // The README's cluster command, twice, on one host: no --rdzv-backend, no --node-rank.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", &endpoint, "--rdzv-id", "readme-job"];
    let outs = all(vec![launcher(dir.path(), &args), launcher(dir.path(), &args)]);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    assert_eq!(ranks(&outs), vec![(0, 4), (1, 4), (2, 4), (3, 4)], "{}\n{}", text(&outs[0]), text(&outs[1]));
}

#[test]
fn static_backend_with_distinct_node_ranks_forms_one_job() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let node = |rank: &str| {
        launcher(
            dir.path(),
            &["--nnodes", "3", "--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", &port, "--node-rank", rank],
        )
    };
    // Node rank 0 last: the others wait for it to host the rendezvous.
    let outs = all(vec![node("2"), node("1"), node("0")]);
    for o in &outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
    assert_eq!(ranks(&outs), (0..6).map(|r| (r, 6)).collect::<Vec<_>>());
    // Node rank k runs global ranks 2k and 2k+1.
    for (o, k) in outs.iter().zip([2u32, 1, 0]) {
        let mine: BTreeSet<u32> = ranks(std::slice::from_ref(o)).into_iter().map(|(r, _)| r).collect();
        assert_eq!(mine, BTreeSet::from([2 * k, 2 * k + 1]), "{}", text(o));
    }
}

#[test]
fn static_backend_with_duplicate_node_ranks_fails_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let node = |rank: &str| {
        launcher(dir.path(), &["--nnodes", "3", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", &port, "--node-rank", rank])
    };
    let outs = all(vec![node("0"), node("1"), node("1")]);
    // Node rank 1 twice, node rank 2 never: the job fails before any worker starts, and every
    // launcher says why.
    for o in &outs {
        assert_ne!(code(&o.status), 0, "{}", text(o));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("duplicate node rank 1") && stderr.contains("--node-rank 1"), "{}", text(o));
    }
    assert!(ranks(&outs).is_empty(), "no worker may start with a duplicate node rank");
}

#[test]
fn static_backend_without_node_rank_on_two_nodes_fails_instead_of_two_rank_0() {
    // torchrun's static invocation copied to two nodes without --node-rank: before, both ran RANK=0
    // GROUP_RANK=0 WORLD_SIZE=2 and "succeeded".
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", &port];
    let outs = all(vec![launcher(dir.path(), &args), launcher(dir.path(), &args)]);
    for o in &outs {
        assert_ne!(code(&o.status), 0, "{}", text(o));
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(stderr.contains("duplicate node rank 0"), "{}", text(o));
    }
    assert!(ranks(&outs).is_empty(), "no worker may start with a duplicate node rank");
}

#[test]
fn static_backend_names_the_node_ranks_that_never_joined() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let out = launcher(
        dir.path(),
        &["--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", &port, "--node-rank", "0", "--rdzv-conf", "join_timeout=2"],
    )
    .output_within(RUN_DEADLINE);
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("node rank(s) 1, 2 of 3 never joined") && stderr.contains("joined: 0 = "), "{}", text(&out));
}

#[test]
fn static_node_rank_0_must_host_at_its_own_address() {
    let dir = tempfile::tempdir().unwrap();
    // 192.0.2.1 (TEST-NET-1) is never an address of this host; nothing is sent to it.
    let out = launcher(dir.path(), &["--nnodes", "2", "--master-addr", "192.0.2.1", "--master-port", "29511", "--node-rank", "0"])
        .output_within(RUN_DEADLINE);
    assert_ne!(code(&out.status), 0, "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("192.0.2.1 is not an address of this host"), "{}", text(&out));
}
