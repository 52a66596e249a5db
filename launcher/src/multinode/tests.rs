//! Dry-run fixtures: Slurm modes A, B and C, `--preserve-env`, and Kubernetes v1-static, v1-elastic
//! and v2, resolved through `LaunchPlan::resolve` with a constructed environment.

use super::*;
use crate::dry_run::render;
use crate::plan::tests::parse_env;
use crate::plan::{Endpoint, HostMode, LaunchPlan};

fn plan(args: &[&str], env: &[(&str, &str)]) -> Result<LaunchPlan, String> {
    let (a, h) = parse_env(args, env);
    LaunchPlan::resolve(&a, &h).map_err(|e| e.to_string())
}

fn sources(p: &LaunchPlan) -> Vec<String> {
    p.sources.iter().map(|s| format!("{} = {} ({})", s.name, s.value, s.source)).collect()
}

/// `srun --nodes=2 --ntasks-per-node=1 rsrun true` on node `node` of gpu[01-02], 4 GPUs each.
fn slurm_a(node: &str, name: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_JOB_NODELIST", "gpu[01-02]".into()),
        ("SLURM_STEP_NODELIST", "gpu[01-02]".into()),
        ("SLURM_STEP_NUM_NODES", "2".into()),
        ("SLURM_STEP_NUM_TASKS", "2".into()),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x2)".into()),
        ("SLURM_NNODES", "2".into()),
        ("SLURM_NODEID", node.into()),
        ("SLURM_PROCID", node.into()),
        ("SLURM_LOCALID", "0".into()),
        ("SLURMD_NODENAME", name.into()),
        ("SLURM_GPUS_ON_NODE", "4".into()),
        ("SLURM_LAUNCH_NODE_IPADDR", "10.9.9.9".into()),
    ]
}

fn env_ref<'a>(v: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    v.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn with(mut v: Vec<(&'static str, String)>, k: &'static str, val: &str) -> Vec<(&'static str, String)> {
    v.retain(|(n, _)| *n != k);
    v.push((k, val.to_owned()));
    v
}

fn without(mut v: Vec<(&'static str, String)>, k: &str) -> Vec<(&'static str, String)> {
    v.retain(|(n, _)| *n != k);
    v
}

// 61000 + (4242 * 37 + 0) mod 4536 = 61000 + 156954 mod 4536 = 61000 + 2730.
const SLURM_PORT: u16 = 63730;

#[test]
fn slurm_mode_a_node_1() {
    let p = plan(&["true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap();
    assert_eq!(p.mode, LaunchMode::SlurmA);
    assert_eq!(p.nodes, NodeRange { min: 2, max: 2 });
    assert_eq!(p.nproc_per_node, 4);
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: SLURM_PORT }, host: HostMode::Never }
    );
    assert_eq!(p.job_id, "slurm-4242.0.r0");
    assert_eq!(p.rank_hint, Some(1));
    assert_eq!(p.task_ranks, None);
    assert_eq!(
        sources(&p),
        [
            "nnodes = 2 (SLURM_STEP_NUM_NODES)",
            "node rank = 1 (SLURM_NODEID)",
            "node list = gpu[01-02] (SLURM_STEP_NODELIST)",
            "rendezvous port = 63730 (61000 + (SLURM_JOB_ID*37 + SLURM_STEP_ID) mod 4536)",
            "nproc per node = 4 (SLURM_GPUS_ON_NODE)",
            "rendezvous = gpu01:63730 (first host of SLURM_STEP_NODELIST)",
            "run id = slurm-4242.0.r0 (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_RESTART_COUNT)",
            "shutdown grace = 25s (Slurm sends SIGKILL KillWait after SIGTERM, 30 s by default)",
        ]
    );
    let text = render(&p);
    assert!(text.contains("launch       : Slurm mode A: srun started one rsrun per node"), "{text}");
    assert!(
        text.contains("ports        : 63730..63737: node rank 0 hosts on the first free one (a service of job 'slurm-4242.0.r0' only)"),
        "{text}"
    );
    assert!(text.contains("worker rank 7 (local_rank 3, node_rank 1)"), "{text}");
    assert!(!text.contains("10.9.9.9"), "SLURM_LAUNCH_NODE_IPADDR is never used: {text}");
}

#[test]
fn slurm_mode_a_node_0_hosts_the_service() {
    let p = plan(&["--nproc-per-node", "2", "true"], &env_ref(&slurm_a("0", "gpu01"))).unwrap();
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: SLURM_PORT }, host: HostMode::Always }
    );
    assert_eq!(p.nproc_per_node, 2);
    assert!(sources(&p).contains(&"nproc per node = 2 (--nproc-per-node)".to_owned()));
}

#[test]
fn slurm_mode_a_on_loopback_as_in_the_simulation() {
    // multinode.md §5.6: names that resolve with no help.
    let env = with(with(slurm_a("1", "127.0.0.2"), "SLURM_STEP_NODELIST", "127.0.0.[1-2]"), "SLURM_GPUS_ON_NODE", "0");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert_eq!(p.nproc_per_node, 1);
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "127.0.0.1".into(), port: SLURM_PORT }, host: HostMode::Never });
}

#[test]
fn slurm_self_check_and_shape() {
    let e = plan(&["true"], &env_ref(&slurm_a("1", "gpu07"))).unwrap_err();
    assert!(e.starts_with("SLURMD_NODENAME=gpu07 but node SLURM_NODEID=1 of SLURM_STEP_NODELIST is gpu02"), "{e}");
    let e = plan(&["true"], &env_ref(&with(slurm_a("1", "gpu02"), "SLURM_STEP_NUM_NODES", "3"))).unwrap_err();
    assert_eq!(e, "SLURM_STEP_NODELIST=gpu[01-02] has 2 hosts but SLURM_STEP_NUM_NODES is 3");
    let e = plan(&["true"], &env_ref(&with(slurm_a("1", "gpu02"), "SLURM_STEP_NODELIST", "gpu[02-01]"))).unwrap_err();
    assert_eq!(e, "SLURM_STEP_NODELIST=gpu[02-01]: invalid hostlist \"gpu[02-01]\": range start 2 > end 1");
    let e = plan(&["true"], &env_ref(&with(slurm_a("1", "gpu02"), "SLURM_STEP_TASKS_PER_NODE", "1(x3)"))).unwrap_err();
    assert!(e.contains("does not match 2 nodes"), "{e}");
    // SLURMD_NODENAME unset: no check.
    assert!(plan(&["true"], &env_ref(&without(slurm_a("1", "x"), "SLURMD_NODENAME"))).is_ok());
}

#[test]
fn slurm_options_that_contradict_the_step_are_errors() {
    let env = slurm_a("1", "gpu02");
    assert_eq!(
        plan(&["--nnodes", "3", "true"], &env_ref(&env)).unwrap_err(),
        "--nnodes 3 but the Slurm step has 2 nodes (SLURM_STEP_NUM_NODES)"
    );
    assert_eq!(
        plan(&["--node-rank", "0", "true"], &env_ref(&env)).unwrap_err(),
        "--node-rank 0 but this is node 1 of the Slurm step (SLURM_NODEID)"
    );
    assert!(plan(&["--nnodes", "2", "--node-rank", "1", "true"], &env_ref(&env)).is_ok());
}

#[test]
fn slurm_explicit_flags_win() {
    let env = slurm_a("1", "gpu02");
    let p = plan(&["--rdzv-endpoint", "head:29400", "--rdzv-id", "mine", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "head".into(), port: 29400 }, host: HostMode::Auto });
    assert_eq!(p.job_id, "mine");
    assert!(sources(&p).contains(&"rendezvous = head:29400 (--rdzv-endpoint)".to_owned()));
    let p = plan(&["--rdzv-backend", "static", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "gpu01".into(), master_port: SLURM_PORT });
    let p = plan(&["--standalone", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Standalone);
    assert!(p.notes.iter().any(|n| n.contains("--standalone")));
}

#[test]
fn slurm_ports_and_run_ids() {
    let env = with(slurm_a("1", "gpu02"), "SLURM_STEP_RESV_PORTS", "12000-12003");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: 12000 }, host: HostMode::Never });
    assert!(sources(&p).contains(&"rendezvous port = 12000 (SLURM_STEP_RESV_PORTS)".to_owned()));
    let env = with(with(slurm_a("1", "gpu02"), "SLURM_ARRAY_JOB_ID", "4200"), "SLURM_ARRAY_TASK_ID", "7");
    let env = with(with(env, "SLURM_RESTART_COUNT", "2"), "SLURM_STEP_ID", "3");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert_eq!(p.job_id, "slurm-4200_7.3.r2");
    // 61000 + (4242*37 + 3) mod 4536 = 61000 + 2733.
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: 63733 }, host: HostMode::Never });
    assert!(plan(&["true"], &env_ref(&with(slurm_a("1", "gpu02"), "SLURM_STEP_RESV_PORTS", "x"))).is_err());
}

#[test]
fn slurm_preserve_env_prefers_the_step_values() {
    // `srun --preserve-env` keeps the job's SLURM_NNODES/SLURM_NTASKS/SLURM_TASKS_PER_NODE.
    let env = with(with(with(slurm_a("1", "gpu02"), "SLURM_NNODES", "4"), "SLURM_NTASKS", "4"), "SLURM_TASKS_PER_NODE", "1(x4)");
    let env = with(env, "SLURM_JOB_NODELIST", "gpu[01-04]");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert_eq!(p.nodes, NodeRange { min: 2, max: 2 });
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: SLURM_PORT }, host: HostMode::Never });
}

/// `srun --nodes=2 --ntasks-per-node=2 rsrun true`: task PROCID on node NODEID.
fn slurm_b(procid: u32) -> Vec<(&'static str, String)> {
    let node = procid / 2;
    let v = slurm_a(&node.to_string(), &format!("gpu0{}", node + 1));
    let v = with(with(v, "SLURM_STEP_NUM_TASKS", "4"), "SLURM_STEP_TASKS_PER_NODE", "2(x2)");
    with(with(v, "SLURM_PROCID", &procid.to_string()), "SLURM_LOCALID", &(procid % 2).to_string())
}

#[test]
fn slurm_mode_b_maps_the_task_ranks() {
    let p = plan(&["true"], &env_ref(&slurm_b(3))).unwrap();
    assert_eq!(p.mode, LaunchMode::SlurmB);
    assert_eq!(p.nodes, NodeRange { min: 4, max: 4 });
    assert_eq!(p.nproc_per_node, 1);
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 3, master_addr: "gpu01".into(), master_port: SLURM_PORT });
    assert_eq!(p.job_id, "slurm-4242.0.r0");
    assert_eq!(
        p.task_ranks,
        Some(TaskRanks { rank: 3, local_rank: 1, world_size: 4, local_world_size: 2, node_rank: 1, num_nodes: 2 })
    );
    let text = render(&p);
    for line in [
        "worker rank 3 (local_rank 1, node_rank 1; from srun):",
        "    LOCAL_RANK=1",
        "    RANK=3",
        "    GROUP_RANK=1",
        "    LOCAL_WORLD_SIZE=2",
        "    WORLD_SIZE=4",
        "    GROUP_WORLD_SIZE=2",
        "    MASTER_ADDR=gpu01",
        "    MASTER_PORT=<port of the TCPStore the rendezvous serves for the round>",
        "source       : rank = 3 (SLURM_PROCID)",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    // One worker per task, every task.
    for procid in 0..4 {
        let p = plan(&["true"], &env_ref(&slurm_b(procid))).unwrap();
        assert_eq!(p.task_ranks.as_ref().map(|t| t.rank), Some(procid));
        assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: procid, master_addr: "gpu01".into(), master_port: SLURM_PORT });
    }
}

#[test]
fn slurm_mode_b_refuses_a_double_launch() {
    let e = plan(&["--nproc-per-node", "8", "true"], &env_ref(&slurm_b(0))).unwrap_err();
    assert_eq!(
        e,
        "srun started 2 tasks on this node (SLURM_STEP_TASKS_PER_NODE=2(x2)), and each task is already one worker: --nproc-per-node 8 would start 32 workers instead of 4; use `srun --ntasks-per-node=1 rsrun --nproc-per-node 8` or drop --nproc-per-node"
    );
    // PET_NPROC_PER_NODE counts as given too.
    let env = with(slurm_b(0), "PET_NPROC_PER_NODE", "8");
    assert!(plan(&["true"], &env_ref(&env)).unwrap_err().contains("already one worker"));
    assert!(plan(&["--nproc-per-node", "1", "true"], &env_ref(&slurm_b(0))).is_ok());
}

#[test]
fn slurm_mode_b_warns_about_per_task_gpu_binding() {
    let env = with(slurm_b(1), "CUDA_VISIBLE_DEVICES", "1");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert!(p.notes.contains(&"LOCAL_RANK=1 but this task sees 1 GPU; use --virtual-local-rank or srun --gpu-bind=none".to_owned()));
}

/// `--gpu-bind local-rank` in mode B: the task's one worker gets device SLURM_LOCALID of the node,
/// not device 0.
#[test]
fn slurm_mode_b_gpu_bind_follows_slurm_localid() {
    let env = with(slurm_b(3), "CUDA_VISIBLE_DEVICES", "4,5");
    let p = plan(&["--gpu-bind", "local-rank", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.gpu_bind, crate::plan::GpuBind::LocalRank(vec!["5".into()]));
    assert!(render(&p).contains("    CUDA_VISIBLE_DEVICES=5\n"), "{}", render(&p));
    // Without CUDA_VISIBLE_DEVICES, devices are numbered on the node.
    let p = plan(&["--gpu-bind", "local-rank", "true"], &env_ref(&slurm_b(1))).unwrap();
    assert_eq!(p.gpu_bind, crate::plan::GpuBind::LocalRank(vec!["1".into()]));
    // srun already bound one GPU per task: binding again by local rank is an error naming both values.
    let env = with(slurm_b(1), "CUDA_VISIBLE_DEVICES", "3");
    let e = plan(&["--gpu-bind", "local-rank", "true"], &env_ref(&env)).unwrap_err();
    assert!(e.contains("SLURM_LOCALID=1 but CUDA_VISIBLE_DEVICES=3 lists 1 device(s)"), "{e}");
    // What the note on such a task advises, --virtual-local-rank, works: the task's one GPU.
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert!(p.notes.iter().any(|n| n.contains("use --virtual-local-rank")), "{:?}", p.notes);
    let p = plan(&["--virtual-local-rank", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.gpu_bind, crate::plan::GpuBind::LocalRank(vec!["3".into()]));
    // Task 0 with one GPU is no mismatch: no note.
    let p = plan(&["true"], &env_ref(&with(slurm_b(0), "CUDA_VISIBLE_DEVICES", "3"))).unwrap();
    assert!(!p.notes.iter().any(|n| n.contains("sees 1 GPU")), "{:?}", p.notes);
}

/// Slurm mode B with a CPU binding: each task takes its entry of the assignment of all the node's
/// tasks, not the whole node as a lone worker would.
#[test]
fn slurm_mode_b_binds_each_task_as_one_of_the_nodes_tasks() {
    use crate::plan::{Placement, Probed};
    use crate::topology::tests::{four_gpus, linux_machine};
    let resolve = |args: &[&str], env: Vec<(&'static str, String)>, probed: Probed| {
        let (a, mut h) = parse_env(args, &env_ref(&env));
        h.placement = Placement::known_probed(probed);
        LaunchPlan::resolve(&a, &h).map_err(|e| e.to_string())
    };
    // 2 nodes/packages of 4 cores x 2 threads (core k: CPUs k and k+8); GPUs 0,1 on node 1, 2,3 on node 0.
    let machine = || Probed { topology: linux_machine(), pci_gpus: Some(four_gpus()), dev_nodes: None, online_cpus: Some(16) };
    // Every task sees the node's GPUs 0,1 (both near NUMA node 1): the two tasks split the cores,
    // near their GPUs first, without overlap.
    let halves = [vec![0, 1, 4, 5, 8, 9, 12, 13], vec![2, 3, 6, 7, 10, 11, 14, 15]];
    for procid in 0..2u32 {
        let env = with(slurm_b(procid), "CUDA_VISIBLE_DEVICES", "0,1");
        let p = resolve(&["--cpu-bind", "cores", "true"], env, machine()).unwrap();
        assert_eq!(p.cpu_sets, Some(vec![halves[procid as usize].clone()]), "task {procid}");
        assert!(!p.notes.iter().any(|n| n.contains("online CPUs")), "{:?}", p.notes);
    }
    // Disjoint whole cores of the GPUs' node, one share per task (GPUs 2,3 on node 0).
    for (procid, want) in [(0u32, vec![0, 1, 8, 9]), (1, vec![2, 3, 10, 11])] {
        let env = with(slurm_b(procid), "CUDA_VISIBLE_DEVICES", "2,3");
        let p = resolve(&["--numa-binding", "exclusive", "true"], env, machine()).unwrap();
        assert_eq!(p.cpu_sets, Some(vec![want]), "task {procid}");
    }
    // srun bound each task its own GPU: the others' are not known here, so the disjoint shares
    // follow the topology alone (the same in every task).
    let in_order = [vec![0, 1, 2, 3, 8, 9, 10, 11], vec![4, 5, 6, 7, 12, 13, 14, 15]];
    for procid in 0..2u32 {
        let env = with(slurm_b(procid), "CUDA_VISIBLE_DEVICES", &(procid + 2).to_string());
        let p = resolve(&["--cpu-bind", "cores", "true"], env, machine()).unwrap();
        assert_eq!(p.cpu_sets, Some(vec![in_order[procid as usize].clone()]), "task {procid}");
        assert!(p.notes.iter().any(|n| n.contains("the other tasks' GPUs are not known here")), "{:?}", p.notes);
    }
    // A binding to the GPU's node needs only this task's GPU: task 1's GPU 0 is on node 1.
    let env = with(slurm_b(1), "CUDA_VISIBLE_DEVICES", "0");
    let p = resolve(&["--numa-binding", "node", "true"], env, machine()).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![vec![4, 5, 6, 7, 12, 13, 14, 15]]));
    // srun already narrowed the task's CPUs: said, with what to do.
    let mut restricted = machine();
    restricted.online_cpus = Some(32);
    let env = with(slurm_b(0), "CUDA_VISIBLE_DEVICES", "0,1");
    let p = resolve(&["--cpu-bind", "cores", "true"], env, restricted).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![halves[0].clone()]));
    assert!(p.notes.iter().any(|n| n.contains("16 of the host's 32 online CPUs") && n.contains("srun --cpu-bind=none")), "{:?}", p.notes);
}

/// Slurm's port may be taken by another step that derived the same one: node 0 probes the next 7
/// ports and the others search them; a typed port or endpoint is used as given.
#[test]
fn slurm_ports_are_probed_unless_typed() {
    assert_eq!(plan(&["true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap().port_probe, slurm::PORT_PROBE);
    assert_eq!(plan(&["true"], &env_ref(&slurm_b(2))).unwrap().port_probe, slurm::PORT_PROBE);
    // A reservation is probed within itself only: the ports past it are another step's.
    let env = with(slurm_a("1", "gpu02"), "SLURM_STEP_RESV_PORTS", "12000-12003");
    assert_eq!(plan(&["true"], &env_ref(&env)).unwrap().port_probe, 3);
    let env = with(slurm_a("1", "gpu02"), "SLURM_STEP_RESV_PORTS", "12000-12099");
    assert_eq!(plan(&["true"], &env_ref(&env)).unwrap().port_probe, slurm::PORT_PROBE);
    let env = with(slurm_a("1", "gpu02"), "SLURM_STEP_RESV_PORTS", "12000,12007");
    assert_eq!(plan(&["true"], &env_ref(&env)).unwrap().port_probe, 0);
    let typed = plan(&["--rdzv-endpoint", "gpu01:29400", "true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap();
    assert_eq!(typed.port_probe, 0);
    let typed = plan(&["--master-port", "29500", "true"], &env_ref(&slurm_b(2))).unwrap();
    assert_eq!(typed.port_probe, 0);
    // Kubernetes: the operator declared the port.
    assert_eq!(plan(&["true"], &pytorchjob_v1_worker()).unwrap().port_probe, 0);
}

/// §3.5: under Slurm USR1/USR2 reach the workers and supervision goes on; SIGTERM stops them within
/// 25 s, before KillWait's SIGKILL. A longer typed grace is kept, with a warning.
#[test]
fn slurm_signal_defaults() {
    use crate::signals::SignalAction;
    use nix::sys::signal::Signal;
    let p = plan(&["true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap();
    assert_eq!(p.signals.action(Signal::SIGUSR1), Some(SignalAction::Forward));
    assert_eq!(p.signals.action(Signal::SIGUSR2), Some(SignalAction::Forward));
    assert_eq!(p.signals.action(Signal::SIGTERM), Some(SignalAction::Stop));
    assert_eq!(p.timeouts.shutdown, std::time::Duration::from_secs(25));
    assert!(render(&p).contains("timeouts     : shutdown 25s"), "{}", render(&p));
    let p = plan(&["--shutdown-timeout", "60", "true"], &env_ref(&slurm_b(0))).unwrap();
    assert_eq!(p.timeouts.shutdown, std::time::Duration::from_secs(60));
    assert!(p.notes.iter().any(|n| n.contains("--shutdown-timeout 60s is longer than 25s: Slurm sends SIGKILL KillWait after SIGTERM")), "{:?}", p.notes);
    let p = plan(&["--shutdown-timeout", "10", "true"], &env_ref(&slurm_b(0))).unwrap();
    assert_eq!(p.timeouts.shutdown, std::time::Duration::from_secs(10));
    // The policy stays configurable: `#SBATCH --signal=HUP@120` needs HUP forwarded.
    let p = plan(&["--signal-policy", "HUP=forward", "true"], &env_ref(&slurm_a("0", "gpu01"))).unwrap();
    assert_eq!(p.signals.action(Signal::SIGHUP), Some(SignalAction::Forward));
    // Outside a cluster the grace stays torchrun's 30 s.
    let p = plan(&["--standalone", "true"], &[]).unwrap();
    assert_eq!(p.timeouts.shutdown, std::time::Duration::from_secs(30));
}

fn slurm_batch(nodes: &str) -> Vec<(&'static str, String)> {
    vec![
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_JOB_NODELIST", "gpu[01-02]".into()),
        ("SLURM_JOB_NUM_NODES", nodes.into()),
        ("SLURM_NNODES", nodes.into()),
        ("SLURM_GPUS_ON_NODE", "2".into()),
        ("SLURM_NODEID", "0".into()),
        ("SLURMD_NODENAME", "gpu01".into()),
    ]
}

#[test]
fn slurm_mode_c_reruns_under_srun() {
    let p = plan(&["true"], &env_ref(&slurm_batch("2"))).unwrap();
    let srun = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL"];
    assert_eq!(p.mode, LaunchMode::SlurmC { srun: srun.iter().map(|s| s.to_string()).collect() });
    let text = render(&p);
    assert!(text.contains("srun         : srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --export=ALL <absolute path of rsrun> <the same arguments>"), "{text}");
    // Explicit rendezvous options: this node only, as configured.
    let p = plan(&["--nnodes", "2", "--master-addr", "h", "true"], &env_ref(&slurm_batch("2"))).unwrap();
    assert_eq!(p.mode, LaunchMode::Static);
    assert!(p.notes.iter().any(|n| n.contains("outside an srun step, with --")), "{:?}", p.notes);
}

#[test]
fn slurm_batch_on_one_node_runs_locally() {
    let p = plan(&["true"], &env_ref(&slurm_batch("1"))).unwrap();
    assert_eq!(p.mode, LaunchMode::SlurmLocal);
    assert_eq!(p.rdzv, RdzvPlan::Standalone);
    assert_eq!(p.nproc_per_node, 2);
}

/// A shell that is itself a one-node step (`srun --pty bash` in a 2-node allocation) runs rsrun
/// on that one node, and says how to use the whole allocation.
#[test]
fn an_interactive_step_smaller_than_the_allocation_is_noted() {
    let mut env = slurm_a("0", "gpu01");
    for (k, v) in [
        ("SLURM_STEP_NODELIST", "gpu01"),
        ("SLURM_STEP_NUM_NODES", "1"),
        ("SLURM_STEP_NUM_TASKS", "1"),
        ("SLURM_STEP_TASKS_PER_NODE", "1"),
        ("SLURM_NNODES", "1"),
    ] {
        env = with(env, k, v);
    }
    env = with(with(env, "SLURM_JOB_NUM_NODES", "2"), "SLURM_PTY_PORT", "40000");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    let note = p.notes.iter().find(|n| n.contains("interactive step")).unwrap_or_else(|| panic!("{:?}", p.notes));
    assert!(note.contains("of 1 node(s) (SLURM_STEP_NUM_NODES) of an allocation of 2"), "{note}");
    // A batch step of the whole allocation says nothing.
    let p = plan(&["true"], &env_ref(&with(slurm_a("0", "gpu01"), "SLURM_JOB_NUM_NODES", "2"))).unwrap();
    assert!(!p.notes.iter().any(|n| n.contains("interactive step")), "{:?}", p.notes);
}

/// An salloc shell (no SLURMD_NODENAME: it runs where salloc was typed, a login node) never runs
/// the job where it stands, even for one node; srun puts it on the allocation.
#[test]
fn an_salloc_shell_runs_the_job_on_the_allocation_through_srun() {
    let env = without(slurm_batch("1"), "SLURMD_NODENAME");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    let srun = ["srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL"];
    assert_eq!(p.mode, LaunchMode::SlurmC { srun: srun.iter().map(|s| s.to_string()).collect() });
    assert!(p.notes.iter().any(|n| n.contains("an salloc shell")), "{:?}", p.notes);
}

/// Mode C's srun does not inherit the batch script's per-task requests, which would give each
/// node's one rsrun a single task's share (one GPU of eight).
#[test]
fn slurm_mode_c_drops_per_task_requests() {
    let env = with(with(slurm_batch("2"), "SLURM_GPUS_PER_TASK", "1"), "SLURM_TRES_PER_TASK", "cpu:4,gres/gpu:1");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    let note = p.notes.iter().find(|n| n.contains("per-task requests")).unwrap_or_else(|| panic!("{:?}", p.notes));
    assert!(note.contains("SLURM_TRES_PER_TASK=cpu:4,gres/gpu:1, SLURM_GPUS_PER_TASK=1"), "{note}");
}

#[test]
fn slurm_and_host_tables() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hosts"), "a slots=1\n").unwrap();
    let run = |env: &[(&'static str, String)]| {
        let (a, mut h) = parse_env(&["--hostfile", "./hosts", "true"], &env_ref(env));
        h.cwd = dir.path().to_owned();
        LaunchPlan::resolve(&a, &h).map_err(|e| e.to_string())
    };
    let p = run(&slurm_batch("2")).unwrap();
    assert_eq!(p.mode, LaunchMode::Hosts);
    assert!(p.notes.iter().any(|n| n.contains("over ssh, not with srun")));
    assert!(run(&slurm_a("0", "gpu01")).unwrap_err().starts_with("--hostfile/-H inside an srun step of several tasks"));
    // A step of one task (`srun --pty bash` on one node of the allocation) runs rsrun once: the
    // host table starts the job over ssh, as from a batch script.
    let one = with(with(with(slurm_a("0", "gpu01"), "SLURM_STEP_NUM_TASKS", "1"), "SLURM_STEP_NUM_NODES", "1"), "SLURM_STEP_NODELIST", "gpu01");
    let one = with(with(one, "SLURM_STEP_TASKS_PER_NODE", "1"), "SLURM_PTY_PORT", "4000");
    let p = run(&one).unwrap();
    assert_eq!(p.mode, LaunchMode::Hosts);
    assert!(p.notes.iter().any(|n| n.contains("a step of one task")), "{:?}", p.notes);
}

/// Mode B takes RANK from SLURM_PROCID and LOCAL_RANK from SLURM_LOCALID: a cyclic task layout
/// (rank 1 on node 1) breaks torchrun's contiguous ranks per node, and is named.
#[test]
fn slurm_mode_b_refuses_ranks_that_are_not_in_blocks_per_node() {
    // `srun -N2 -n4 --distribution=cyclic`: node 1 runs ranks 1 and 3; rank 1 is its task 0.
    let cyclic = with(with(with(slurm_b(2), "SLURM_PROCID", "1"), "SLURM_NODEID", "1"), "SLURMD_NODENAME", "gpu02");
    let cyclic = with(with(cyclic, "SLURM_LOCALID", "0"), "SLURM_DISTRIBUTION", "cyclic");
    let e = plan(&["true"], &env_ref(&cyclic)).unwrap_err().to_string();
    assert!(e.contains("SLURM_PROCID=1 on node SLURM_NODEID=1") && e.contains("expected 2; SLURM_DISTRIBUTION=cyclic") && e.contains("--distribution=block"), "{e}");
}

#[test]
fn hostfile_dry_run_shows_the_node_table() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hosts"), "# cluster\nw0 slots=4\nw1 slots=4\nw2 slots=2\n").unwrap();
    let (a, mut h) = parse_env(&["--hostfile", "./hosts", "-i", "w0@w1:0,2@w2", "true"], &[]);
    h.cwd = dir.path().to_owned();
    let p = LaunchPlan::resolve(&a, &h).unwrap();
    assert_eq!(p.mode, LaunchMode::Hosts);
    assert_eq!(p.nodes, NodeRange { min: 3, max: 3 });
    assert_eq!(p.nproc_per_node, 4);
    let t = p.hosts.as_ref().unwrap();
    assert_eq!(t.entries[1].devices, Some(vec![0, 2]));
    assert_eq!(t.world_size(), Some(8));
    let text = render(&p);
    for line in [
        "launch       : hostfile/ssh: one command starts every node",
        "hosts        : 3 nodes from hostfile ./hosts, world size 8",
        "  node  host  slots  devices    ranks        source",
        "  0     w0    4      0-3        0-3          ./hosts:2",
        "  1     w1    2      0,2        4-5          ./hosts:3",
        "  2     w2    2      0-1        6-7          ./hosts:4",
        "source       : nnodes = 3 (3 hosts in hostfile ./hosts)",
        "    WORLD_SIZE=8",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

// ---- Kubernetes ----

/// A PyTorchJob v1 pod (master + 1 worker, nprocPerNode 2): the worker's environment.
fn pytorchjob_v1_worker() -> Vec<(&'static str, &'static str)> {
    vec![
        ("MASTER_ADDR", "job-master-0"),
        ("MASTER_PORT", "23456"),
        ("WORLD_SIZE", "4"),
        ("RANK", "1"),
        ("PET_MASTER_ADDR", "job-master-0"),
        ("PET_MASTER_PORT", "23456"),
        ("PET_NODE_RANK", "1"),
        ("PET_NNODES", "2"),
        ("PET_NPROC_PER_NODE", "2"),
        ("PYTHONUNBUFFERED", "1"),
    ]
}

#[test]
fn k8s_v1_static() {
    let p = plan(&["true"], &pytorchjob_v1_worker()).unwrap();
    assert_eq!(p.mode, LaunchMode::K8sV1Static);
    assert_eq!(p.nodes, NodeRange { min: 2, max: 2 });
    assert_eq!(p.nproc_per_node, 2);
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "job-master-0".into(), port: 23456 }, host: HostMode::Never }
    );
    assert_eq!(p.job_id, "k8s-job-master-0");
    assert_eq!(p.rank_hint, Some(1));
    assert_eq!(
        sources(&p),
        [
            "nnodes = 2 (PET_NNODES)",
            "node rank = 1 (PET_NODE_RANK)",
            "rendezvous = job-master-0:23456 (PET_MASTER_ADDR and PET_MASTER_PORT, hosted by node rank 0)",
            "run id = k8s-job-master-0 (k8s-<PET_MASTER_ADDR>)",
            "nproc per node = 2 (PET_NPROC_PER_NODE)",
            "shutdown grace = 25s (the kubelet sends SIGKILL terminationGracePeriodSeconds after SIGTERM, 30 s by default)",
        ]
    );
    for note in [
        "ignored RANK=1 from the environment (PyTorchJob sets it to the node index)",
        "ignored MASTER_PORT=23456 from the environment (rsrun sets it for each worker)",
    ] {
        assert!(p.notes.contains(&note.to_owned()), "{:?}", p.notes);
    }
    let text = render(&p);
    assert!(text.contains("    RANK=2\n"), "{text}");
    assert!(text.contains("    MASTER_PORT=<port of the TCPStore the rendezvous serves for the round>"), "{text}");
    assert!(!text.contains("    MASTER_PORT=23456"), "{text}");
}

#[test]
fn k8s_v1_elastic() {
    let env = [
        ("PET_RDZV_ENDPOINT", "job-worker-0:29400"),
        ("PET_RDZV_BACKEND", "c10d"),
        ("PET_RDZV_ID", "job-uid"),
        ("PET_NNODES", "1:3"),
        ("PET_NPROC_PER_NODE", "1"),
        ("PET_MAX_RESTARTS", "3"),
    ];
    let p = plan(&["true"], &env).unwrap();
    assert_eq!(p.mode, LaunchMode::K8sV1Elastic);
    assert_eq!(p.nodes, NodeRange { min: 1, max: 3 });
    // worker-0's DNS record appears once its pod is up: the name is waited for, not refused.
    assert!(p.mode.endpoint_may_resolve_late());
    assert!(!LaunchMode::Rendezvous.endpoint_may_resolve_late() && !LaunchMode::SlurmA.endpoint_may_resolve_late());
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "job-worker-0".into(), port: 29400 }, host: HostMode::Auto }
    );
    assert_eq!(p.job_id, "job-uid");
    assert_eq!(p.max_restarts, 3);
    assert_eq!(
        sources(&p),
        [
            "nnodes = 1:3 (PET_NNODES)",
            "rendezvous = job-worker-0:29400 (PET_RDZV_ENDPOINT)",
            "run id = job-uid (PET_RDZV_ID)",
            "nproc per node = 1 (PET_NPROC_PER_NODE)",
            "shutdown grace = 25s (the kubelet sends SIGKILL terminationGracePeriodSeconds after SIGTERM, 30 s by default)",
        ]
    );
    // No PET_RDZV_BACKEND: still the rendezvous service, not the static backend.
    let p = plan(&["true"], &env[..1]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "job-worker-0".into(), port: 29400 }, host: HostMode::Auto });
    assert_eq!(p.job_id, "k8s-job-worker-0");
    // Port 0 cannot be found by the other pods: refused as the flag is, naming the variable.
    let err = plan(&["true"], &[("PET_RDZV_ENDPOINT", "127.0.0.1:0"), ("PET_NNODES", "2")]).unwrap_err().to_string();
    assert!(err.contains("PET_RDZV_ENDPOINT") && err.contains("127.0.0.1:0") && err.contains("a fixed port"), "{err}");
    // One node may host on a free port.
    assert!(plan(&["true"], &[("PET_RDZV_ENDPOINT", "127.0.0.1:0"), ("PET_NNODES", "1")]).is_ok());
}

/// A TrainJob (Trainer v2) pod: `PET_*` only, plus garbage worker-level names.
fn trainjob_v2(rank: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("PET_NNODES", "2"),
        ("PET_NPROC_PER_NODE", "2"),
        ("PET_NODE_RANK", rank),
        ("PET_MASTER_ADDR", "tj-node-0-0.tj"),
        ("PET_MASTER_PORT", "29500"),
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_PORT", "1"),
    ]
}

#[test]
fn k8s_v2() {
    let p = plan(&["true"], &trainjob_v2("0")).unwrap();
    assert_eq!(p.mode, LaunchMode::K8sV2);
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "tj-node-0-0.tj".into(), port: 29500 }, host: HostMode::Always }
    );
    assert_eq!(p.job_id, "k8s-tj-node-0-0.tj");
    assert_eq!(p.rank_hint, Some(0));
    assert_eq!(p.nodes, NodeRange { min: 2, max: 2 });
    assert!(!p.notes.iter().any(|n| n.contains("ephemeral")), "the store is served at PET_MASTER_PORT, nothing to note: {:?}", p.notes);
    let text = render(&p);
    assert!(text.contains("launch       : Kubernetes TrainJob v2"), "{text}");
    assert!(text.contains("    MASTER_PORT=<port of the TCPStore the rendezvous serves for the round>"), "{text}");
    assert!(text.contains("    WORLD_SIZE=4\n") && text.contains("    RANK=1\n"), "{text}");
    let p = plan(&["true"], &trainjob_v2("1")).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "tj-node-0-0.tj".into(), port: 29500 }, host: HostMode::Never });
    let text = render(&p);
    assert!(text.contains("    RANK=2\n") && text.contains("    RANK=3\n"), "{text}");
}

#[test]
fn k8s_node_rank_from_the_indexed_job_never_from_rank() {
    let mut env = trainjob_v2("0");
    env.retain(|(k, _)| *k != "PET_NODE_RANK");
    let e = plan(&["true"], &env).unwrap_err();
    assert!(e.starts_with("PET_NNODES=2 but neither PET_NODE_RANK nor JOB_COMPLETION_INDEX is set"), "{e}");
    env.push(("JOB_COMPLETION_INDEX", "1"));
    let p = plan(&["true"], &env).unwrap();
    assert_eq!(p.rank_hint, Some(1));
    assert!(sources(&p).contains(&"node rank = 1 (JOB_COMPLETION_INDEX)".to_owned()));
    // Out of range: named as the variable that set it, not as a flag nobody typed.
    env.retain(|(k, _)| *k != "JOB_COMPLETION_INDEX");
    env.push(("JOB_COMPLETION_INDEX", "5"));
    let e = plan(&["true"], &env).unwrap_err();
    assert!(e.starts_with("JOB_COMPLETION_INDEX=5: expected a node rank below PET_NNODES=2"), "{e}");
}

#[test]
fn k8s_explicit_static_backend_keeps_torchrun_parity() {
    let p = plan(&["--rdzv-backend", "static", "true"], &trainjob_v2("1")).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "tj-node-0-0.tj".into(), master_port: 29500 });
    assert_eq!(p.mode, LaunchMode::K8sV2);
    let p = plan(&["true"], &[trainjob_v2("1"), vec![("PET_RDZV_BACKEND", "static")]].concat()).unwrap();
    assert!(matches!(p.rdzv, RdzvPlan::Static { .. }));
}

#[test]
fn slurm_wins_over_kubernetes_and_flags_over_both() {
    // The pod's PET_NODE_RANK=0 and PET_MASTER_* lose to SLURM_NODEID=1 and the Slurm node list.
    let slurm = slurm_a("1", "gpu02");
    let env: Vec<(&str, &str)> = [env_ref(&slurm), trainjob_v2("0")].concat();
    let p = plan(&["true"], &env).unwrap();
    assert_eq!(p.mode, LaunchMode::SlurmA);
    assert_eq!(p.rank_hint, Some(1));
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: SLURM_PORT }, host: HostMode::Never });
    let env: Vec<(&str, &str)> = [env_ref(&slurm), vec![("PET_RDZV_ENDPOINT", "elsewhere:1"), ("PET_RDZV_ID", "pet")]].concat();
    let p = plan(&["true"], &env).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01".into(), port: SLURM_PORT }, host: HostMode::Never });
    assert_eq!(p.job_id, "slurm-4242.0.r0");
    let p = plan(&["--rdzv-id", "x", "true"], &trainjob_v2("0")).unwrap();
    assert_eq!(p.job_id, "x");
}

#[test]
fn no_cluster_modes() {
    assert_eq!(plan(&["true"], &[]).unwrap().mode, LaunchMode::SingleNode);
    let p = plan(&["--nnodes", "2", "--master-addr", "h", "true"], &[]).unwrap();
    assert_eq!(p.mode, LaunchMode::Static);
    assert_eq!(
        sources(&p),
        ["nnodes = 2 (--nnodes)", "nproc per node = 1 (default)", "node rank = 0 (default)", "MASTER_ADDR = h (--master-addr)", "MASTER_PORT = 29500 (default)", "run id = none (default)"]
    );
    let p = plan(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "true"], &[]).unwrap();
    assert_eq!(p.mode, LaunchMode::Rendezvous);
    // One node with PET_MASTER_* is no Kubernetes job.
    let p = plan(&["true"], &[("PET_MASTER_ADDR", "a"), ("PET_MASTER_PORT", "5")]).unwrap();
    assert_eq!(p.mode, LaunchMode::Static);
}

// ---- One mode per Slurm step, typed addresses, task 0's node, limits ----

/// `srun -N2 -n3 rsrun true`: SLURM_STEP_TASKS_PER_NODE=2,1. Every task of the step runs mode B,
/// including the one alone on node 1 (LOCAL_WORLD_SIZE=1): a mode A agent there would wait for a
/// rendezvous nobody else joins.
fn slurm_uneven(procid: u32) -> Vec<(&'static str, String)> {
    let (node, local) = if procid < 2 { (0, procid) } else { (1, 0) };
    let v = slurm_a(&node.to_string(), &format!("gpu0{}", node + 1));
    let v = with(with(v, "SLURM_STEP_NUM_TASKS", "3"), "SLURM_STEP_TASKS_PER_NODE", "2,1");
    with(with(v, "SLURM_PROCID", &procid.to_string()), "SLURM_LOCALID", &local.to_string())
}

#[test]
fn slurm_uneven_tasks_per_node_run_mode_b_on_every_node() {
    for procid in 0..3 {
        let p = plan(&["true"], &env_ref(&slurm_uneven(procid))).unwrap();
        assert_eq!(p.mode, LaunchMode::SlurmB, "task {procid}");
        assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: procid, master_addr: "gpu01".into(), master_port: SLURM_PORT });
    }
    let p = plan(&["true"], &env_ref(&slurm_uneven(2))).unwrap();
    assert_eq!(
        p.task_ranks,
        Some(TaskRanks { rank: 2, local_rank: 0, world_size: 3, local_world_size: 1, node_rank: 1, num_nodes: 2 })
    );
    assert_eq!(p.nproc_per_node, 1);
    assert!(render(&p).contains("    LOCAL_WORLD_SIZE=1\n"), "{}", render(&p));
    // The double launch is refused on that node too.
    let e = plan(&["--nproc-per-node", "4", "true"], &env_ref(&slurm_uneven(2))).unwrap_err();
    assert!(e.starts_with("srun started 1 task on this node (SLURM_STEP_TASKS_PER_NODE=2,1)"), "{e}");
}

/// A typed --master-addr names node rank 0 under Slurm, where the mode uses one.
#[test]
fn slurm_typed_master_addr_is_used() {
    // Mode B: the static rendezvous of task 0.
    let p = plan(&["--master-addr", "gpu01-ib", "true"], &env_ref(&slurm_b(3))).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 3, master_addr: "gpu01-ib".into(), master_port: SLURM_PORT });
    assert!(sources(&p).contains(&"MASTER_ADDR = gpu01-ib (--master-addr)".to_owned()), "{:?}", sources(&p));
    // Mode A, static backend.
    let p = plan(&["--rdzv-backend", "static", "--master-addr", "gpu01-ib", "true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "gpu01-ib".into(), master_port: SLURM_PORT });
    // Mode A, rendezvous service: still hosted by node 0, reached at the typed address.
    let p = plan(&["--master-addr", "gpu01-ib", "true"], &env_ref(&slurm_a("1", "gpu02"))).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "gpu01-ib".into(), port: SLURM_PORT }, host: HostMode::Never });
    assert_eq!(
        plan(&["--master-addr", "a b", "true"], &env_ref(&slurm_b(3))).unwrap_err(),
        "invalid value 'a b' for --master-addr: expected the host name or IP address of node rank 0"
    );
    // PET_MASTER_ADDR is no typed option: the node list wins.
    let env = with(slurm_b(3), "PET_MASTER_ADDR", "elsewhere");
    let p = plan(&["true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 3, master_addr: "gpu01".into(), master_port: SLURM_PORT });
}

/// Mode B: task 0 hosts the static rendezvous the others look for on node 0 of the list; with
/// SLURM_HOSTFILE or `--distribution=arbitrary` it may run elsewhere.
#[test]
fn slurm_mode_b_task_0_must_run_on_node_0() {
    let env = with(with(slurm_b(0), "SLURM_NODEID", "1"), "SLURMD_NODENAME", "gpu02");
    let e = plan(&["true"], &env_ref(&env)).unwrap_err();
    assert_eq!(
        e,
        "SLURM_PROCID=0 runs on node SLURM_NODEID=1 (gpu02), but the other tasks look for its rendezvous on node 0 of SLURM_STEP_NODELIST (gpu01): a custom task layout (SLURM_HOSTFILE, srun --distribution=arbitrary) is not supported; put task 0 on the first node, or pass --master-addr gpu02"
    );
    // The user says where task 0 is.
    let p = plan(&["--master-addr", "gpu02", "true"], &env_ref(&env)).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 0, master_addr: "gpu02".into(), master_port: SLURM_PORT });
    // Other tasks on other nodes are fine (node 1's first task is rank 2 in blocks).
    assert!(plan(&["true"], &env_ref(&slurm_b(2))).is_ok());
}

/// SLURM_GPUS_ON_NODE becomes the worker count: the per-node limit of --nproc-per-node applies.
#[test]
fn slurm_gpus_on_node_is_bounded() {
    let env = with(slurm_a("1", "gpu02"), "SLURM_GPUS_ON_NODE", "5000");
    assert_eq!(
        plan(&["true"], &env_ref(&env)).unwrap_err(),
        "SLURM_GPUS_ON_NODE=5000: expected at most 4096 (workers per node); pass --nproc-per-node"
    );
    let env = with(slurm_a("1", "gpu02"), "SLURM_GPUS_ON_NODE", "4096");
    assert_eq!(plan(&["true"], &env_ref(&env)).unwrap().nproc_per_node, 4096);
}

/// Typed options win over the operator's variables: --rdzv-endpoint names the service, --standalone
/// runs one node.
#[test]
fn k8s_typed_rdzv_endpoint_and_standalone_win() {
    let p = plan(&["--rdzv-endpoint", "rdzv.svc:29400", "true"], &trainjob_v2("1")).unwrap();
    assert_eq!(p.mode, LaunchMode::K8sV2);
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "rdzv.svc".into(), port: 29400 }, host: HostMode::Auto });
    assert_eq!(p.rank_hint, Some(1));
    assert!(sources(&p).contains(&"rendezvous = rdzv.svc:29400 (--rdzv-endpoint)".to_owned()), "{:?}", sources(&p));
    let p = plan(&["--standalone", "true"], &trainjob_v2("1")).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Standalone);
    assert_eq!(p.nodes, NodeRange { min: 1, max: 1 });
    assert!(p.notes.iter().any(|n| n.contains("--standalone")), "{:?}", p.notes);
    let env = [("PET_RDZV_ENDPOINT", "job-worker-0:29400"), ("PET_NNODES", "1:3")];
    let p = plan(&["--standalone", "true"], &env).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Standalone);
    // A typed node count still contradicts --standalone.
    assert!(plan(&["--standalone", "--nnodes", "2", "true"], &trainjob_v2("1")).unwrap_err().contains("--standalone runs a single node"));
}

/// Nodes of a host table may differ in slots: the ranks filters are checked against the table's world
/// size and the largest slot count, not the first host's.
#[test]
fn hosts_with_mixed_slots_check_ranks_against_the_table() {
    let ok = |args: &[&str]| plan(args, &[]).map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(ok(&["-H", "a:2,b:8", "--ranks-filter", "9", "true"]), Ok(()));
    assert_eq!(
        ok(&["-H", "a:2,b:8", "--ranks-filter", "10", "true"]).unwrap_err(),
        "invalid value '10' for --ranks-filter: expected ranks below 10 (rank 10 does not exist)"
    );
    assert_eq!(ok(&["-H", "a:2,b:8", "--local-ranks-filter", "5", "true"]), Ok(()));
    assert_eq!(ok(&["-H", "a:8,b:2", "--tee", "7:3", "true"]), Ok(()));
    assert_eq!(
        ok(&["-H", "a:8,b:2", "--local-ranks-filter", "8", "true"]).unwrap_err(),
        "invalid value '8' for --local-ranks-filter: expected local ranks below 8 (rank 8 does not exist)"
    );
    // Bare hosts get --nproc-per-node: its per-node limit applies.
    assert_eq!(
        ok(&["-H", "a,b", "--nproc-per-node", "5000", "true"]).unwrap_err(),
        "invalid value '5000' for --nproc-per-node: expected at most 4096 workers per node"
    );
}
