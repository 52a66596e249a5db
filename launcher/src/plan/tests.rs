use super::*;

/// A host with 4 CPUs, 2 NUMA nodes, no GPU, and PATH containing /bin and /usr/bin.
pub(crate) fn host() -> HostInfo {
    let mut env = HashMap::new();
    env.insert("PATH".to_owned(), "/usr/bin:/bin".to_owned());
    HostInfo {
        env,
        cwd: std::env::temp_dir(),
        cpus: vec![0, 1, 2, 3],
        placement: crate::plan::Placement::known(Topology::from_nodes(&[vec![0, 1], vec![2, 3]]), None),
        gpus: 0,
        hostname: "testhost".into(),
        exe_dir: None,
    }
}

/// Parses argv (without the program name) with a clean `PET_*`-free environment, recording origins
/// as the binary does.
pub(crate) fn parse(args: &[&str]) -> LaunchArgs {
    LaunchArgs::try_parse_with_origins_from(std::iter::once("rsrun").chain(args.iter().copied())).unwrap()
}

/// Parses argv as the binary would inside an environment `env`: every `PET_<NAME>` in it becomes
/// the option `--<name>` unless argv already has it (clap's fallback), with its origin recorded as
/// that variable; the host's environment is `env` plus `host()`'s.
pub(crate) fn parse_env(args: &[&str], env: &[(&str, &str)]) -> (LaunchArgs, HostInfo) {
    let mut argv: Vec<String> = vec!["rsrun".into()];
    let mut from_env = Vec::new();
    let (opts, program) = args.split_at(args.len() - 1);
    argv.extend(opts.iter().map(|s| s.to_string()));
    for (k, v) in env {
        if let Some(name) = k.strip_prefix("PET_") {
            let id = name.to_ascii_lowercase();
            let flag = format!("--{}", id.replace('_', "-"));
            if !opts.iter().any(|o| *o == flag || o.starts_with(&format!("{flag}="))) {
                argv.push(format!("{flag}={v}"));
                from_env.push((id, k.to_string()));
            }
        }
    }
    argv.push(program[0].to_owned());
    let mut a = LaunchArgs::try_parse_with_origins_from(argv).unwrap();
    for (id, var) in from_env {
        a.origins.set(&id, crate::cli::Origin::Env(var));
    }
    let mut h = host();
    h.env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    (a, h)
}

fn resolve(args: &[&str]) -> Result<LaunchPlan, PlanError> {
    LaunchPlan::resolve(&parse(args), &host())
}

fn err(args: &[&str]) -> String {
    resolve(args).unwrap_err().to_string()
}

#[test]
fn nnodes() {
    assert_eq!(NodeRange::parse("2").unwrap(), NodeRange { min: 2, max: 2 });
    assert_eq!(NodeRange::parse("1:4").unwrap(), NodeRange { min: 1, max: 4 });
    for bad in ["0", "3:2", "abc", "0:1", "", "1:", "-1"] {
        let e = NodeRange::parse(bad).unwrap_err().to_string();
        assert!(e.contains("--nnodes") && e.contains(&format!("'{bad}'")), "{e}");
    }
}

#[test]
fn nproc() {
    assert_eq!(resolve(&["--nproc-per-node", "cpu", "true"]).unwrap().nproc_per_node, 4);
    assert_eq!(resolve(&["--nproc-per-node", "auto", "true"]).unwrap().nproc_per_node, 4);
    assert!(err(&["--nproc-per-node", "0", "true"]).contains("invalid value '0' for --nproc-per-node"));
    assert!(err(&["--nproc-per-node", "gpu", "true"]).contains("no GPU"));
    // A bare hostfile host's agent: its GPUs, else one.
    assert_eq!(resolve(&["--nproc-per-node", "gpu-or-1", "true"]).unwrap().nproc_per_node, 1);
    let mut gpus = host();
    gpus.gpus = 8;
    assert_eq!(LaunchPlan::resolve(&parse(&["--nproc-per-node", "gpu-or-1", "true"]), &gpus).unwrap().nproc_per_node, 8);
}

#[test]
fn endpoints() {
    let ep = |s| Endpoint::parse(s, "--rdzv-endpoint", 29400);
    assert_eq!(ep("host").unwrap(), Endpoint { host: "host".into(), port: 29400 });
    assert_eq!(ep("host:1234").unwrap().port, 1234);
    assert_eq!(ep("[::1]:5").unwrap(), Endpoint { host: "::1".into(), port: 5 });
    assert_eq!(ep("::1").unwrap().host, "::1");
    assert_eq!(ep("[::1]:5").unwrap().to_string(), "[::1]:5");
    for bad in ["", ":29400", "host:abc", "host:70000", "[::1", "a b:1"] {
        assert!(ep(bad).is_err(), "{bad}");
    }
}

#[test]
fn program_resolution() {
    let p = resolve(&["true", "a", "${local_rank}"]).unwrap();
    assert_eq!(p.program.kind, ProgramKind::Executable);
    assert_eq!(p.program.argv(3), vec!["a", "3"]);
    // torchrun's Template(arg).safe_substitute(local_rank=...): `$local_rank` is substituted too,
    // anything else with a `$` stays; `$$` too (a shell's pid; Template would make it `$`).
    let p = resolve(&["sh", "-c", "echo $$ $local_rank ${local_rank}x $local_rankx $HOME ${x} $5 $"]).unwrap();
    assert_eq!(p.program.argv(2), vec!["-c", "echo $$ 2 2x $local_rankx $HOME ${x} $5 $"]);
    assert_eq!(substitute_local_rank("$$local_rank", "1"), "$$local_rank");
    assert_eq!(substitute_local_rank("a$local_rank.b", "1"), "a1.b");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.py"), "print(1)").unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    let plan = LaunchPlan::resolve(&parse(&["train.py", "--lr", "1"]), &h);
    if let Ok(plan) = plan {
        assert_eq!(plan.program.kind, ProgramKind::PythonScript);
        assert_eq!(plan.program.argv(0), vec!["-u", "train.py", "--lr", "1"]);
    }
    let e = LaunchPlan::resolve(&parse(&["nope.py"]), &h).unwrap_err().to_string();
    assert!(e.contains("nope.py") && e.contains("not found"), "{e}");
    // A path to a non-executable script without .py, and a package directory, run under Python
    // (torchrun runs every PROGRAM that way).
    std::fs::create_dir_all(dir.path().join("scripts/pkg")).unwrap();
    std::fs::write(dir.path().join("scripts/train"), "print(1)").unwrap();
    std::fs::write(dir.path().join("scripts/pkg/__main__.py"), "print(1)").unwrap();
    for program in ["scripts/train", "scripts/pkg"] {
        if let Ok(plan) = LaunchPlan::resolve(&parse(&[program]), &h) {
            assert_eq!(plan.program.kind, ProgramKind::PythonScript, "{program}");
            assert_eq!(plan.program.argv(0), vec!["-u", program]);
        }
    }
    // A file here comes before a program of that name on PATH (torchrun's rule): a script runs
    // under Python, an executable as it is, and a note names the one on PATH.
    std::fs::write(dir.path().join("true"), "print(1)").unwrap();
    if let Ok(plan) = LaunchPlan::resolve(&parse(&["true"]), &h) {
        assert_eq!(plan.program.kind, ProgramKind::PythonScript);
        assert!(plan.notes.iter().any(|n| n.contains("'true' is a file here and /usr/bin/true on PATH")), "{:?}", plan.notes);
    }
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path().join("true"), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let plan = LaunchPlan::resolve(&parse(&["true"]), &h).unwrap();
    assert_eq!(plan.program.kind, ProgramKind::Executable);
    assert_eq!(plan.program.exe, dir.path().join("true"));
    let e = err(&["definitely-not-a-program-xyz"]);
    assert!(e.contains("not found"), "{e}");
    assert!(err(&["-m", "--no-python", "x"]).contains("cannot be used together"));
}

#[test]
fn implicit_standalone_and_static() {
    let p = resolve(&["true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Standalone);
    assert_eq!(p.job_id.len(), 32);
    let p = resolve(&["--master-port", "1234", "true"]).unwrap();
    assert_eq!(
        p.rdzv,
        RdzvPlan::Static { node_rank: 0, master_addr: "127.0.0.1".into(), master_port: 1234 }
    );
    assert_eq!(p.job_id, "none");
    let p = resolve(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "h".into(), master_port: 29500 });
    assert!(err(&["--nnodes", "2", "--node-rank", "2", "true"]).contains("--node-rank"));
    // Out of range where the rank would not be used is refused too (it was silently ignored).
    for args in [&["--node-rank", "3", "true"][..], &["--standalone", "--node-rank", "1", "true"], &["--nnodes", "1:2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "true"]] {
        let e = err(args);
        assert!(e.contains("invalid value") && e.contains("--node-rank") && e.contains("below the number of nodes"), "{args:?}: {e}");
    }
    assert!(err(&["--local-addr", "not valid!", "true"]).contains("--local-addr"));
    let p = resolve(&["--standalone", "--master-port", "1234", "true"]).unwrap();
    assert!(p.notes.iter().any(|n| n.contains("ignored with --standalone")), "{:?}", p.notes);
    // A master address no resolver takes is refused, not waited for until the join timeout.
    let e = err(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "bad host", "true"]);
    assert_eq!(e, "invalid value 'bad host' for --master-addr: expected the host name or IP address of node rank 0");
    // A value from the environment is named by its variable.
    let (a, h) = parse_env(&["true"], &[("PET_NNODES", "abc")]);
    let e = LaunchPlan::resolve(&a, &h).unwrap_err().to_string();
    assert!(e.starts_with("PET_NNODES=abc: invalid value 'abc' for --nnodes"), "{e}");
    // Static without --node-rank on several nodes: node rank 0, and a note that says so.
    let p = resolve(&["--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 0, master_addr: "h".into(), master_port: 29500 });
    assert!(p.notes.iter().any(|n| n.contains("without --node-rank")), "{:?}", p.notes);
}

#[test]
fn an_endpoint_without_backend_or_node_rank_means_c10d() {
    // The README's cluster command: every node the same, ranks from the rendezvous.
    let p = resolve(&["--nnodes", "2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Daemon { endpoint: Endpoint { host: "h".into(), port: 29400 }, host: HostMode::Auto });
    assert!(p.notes.iter().any(|n| n.contains("using c10d")), "{:?}", p.notes);
    // With --node-rank it is torchrun's static backend at the endpoint.
    let p = resolve(&["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "h".into(), master_port: 29400 });
    // PET_RDZV_BACKEND or the flag still decide.
    let p = resolve(&["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "h:29400", "true"]).unwrap();
    assert!(matches!(p.rdzv, RdzvPlan::Static { node_rank: 0, .. }));
    // As torchrun's static backend: the endpoint, host and port, wins over --master-addr/port.
    let p = resolve(&["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "static", "--rdzv-endpoint", "h:29400", "--master-addr", "other", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Static { node_rank: 1, master_addr: "h".into(), master_port: 29400 });
    assert!(p.notes.iter().any(|n| n.contains("--master-addr/--master-port are not used")), "{:?}", p.notes);
}

#[test]
fn a_group_of_daemons() {
    let p = resolve(&["--nnodes", "2", "--rdzv-endpoint", "h1:29400, h2:29401", "--rdzv-id", "j", "true"]).unwrap();
    let eps = vec![Endpoint { host: "h1".into(), port: 29400 }, Endpoint { host: "h2".into(), port: 29401 }];
    assert_eq!(p.rdzv, RdzvPlan::Group { endpoints: eps });
    assert_eq!(p.mode, LaunchMode::Rendezvous);
    // Default ports, IPv6, and what a group cannot be.
    let p = resolve(&["--rdzv-endpoint", "h1,[::1]:7", "--rdzv-id", "j", "true"]).unwrap();
    assert_eq!(p.rdzv, RdzvPlan::Group { endpoints: vec![Endpoint { host: "h1".into(), port: 29400 }, Endpoint { host: "::1".into(), port: 7 }] });
    assert!(err(&["--rdzv-endpoint", "h1:1,h1:1", "true"]).contains("listed twice"));
    assert!(err(&["--rdzv-endpoint", "h1:0,h2:1", "true"]).contains("fixed ports"));
    assert!(err(&["--rdzv-endpoint", "h1:1,", "true"]).contains("--rdzv-endpoint"));
    assert!(err(&["--rdzv-endpoint", "h1:1,h2:1", "--rdzv-conf", "is_host=true", "true"]).contains("never hosted"));
    assert!(err(&["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h1:1,h2:1", "true"]).contains("several daemons"));
}

#[test]
fn daemon() {
    let p = resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--nnodes", "1:3", "true"])
        .unwrap();
    assert_eq!(
        p.rdzv,
        RdzvPlan::Daemon { endpoint: Endpoint { host: "h".into(), port: 1 }, host: HostMode::Auto }
    );
    assert_eq!(p.nodes, NodeRange { min: 1, max: 3 });
    // torchrun's missing endpoint is localhost:29400; one node hosts its own on a free port.
    let p = resolve(&["--rdzv-backend", "c10d", "true"]).unwrap();
    assert!(matches!(p.rdzv, RdzvPlan::Standalone), "{:?}", p.rdzv);
    assert!(p.notes.iter().any(|n| n.contains("without --rdzv-endpoint: one node")), "{:?}", p.notes);
    let p = resolve(&["--rdzv-backend", "c10d", "--nnodes", "2", "--rdzv-id", "j", "true"]).unwrap();
    assert!(format!("{:?}", p.rdzv).contains("localhost") && format!("{:?}", p.rdzv).contains("29400"), "{:?}", p.rdzv);
    assert!(p.notes.iter().any(|n| n.contains("localhost:29400, as torchrun")), "{:?}", p.notes);
    assert!(err(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:x", "true"]).contains("'h:x'"));
    assert!(err(&["--rdzv-backend", "etcd", "--rdzv-endpoint", "h", "true"]).contains("not supported"));
    assert!(err(&["--rdzv-backend", "zk", "true"]).contains("--rdzv-backend"));
    let p = resolve(&[
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h",
        "--rdzv-conf",
        "join_timeout=5,last_call_timeout=1.5,keep_alive_interval=1,keep_alive_max_attempt=2,foo=1",
        "true",
    ])
    .unwrap();
    assert_eq!(p.timeouts.join, Duration::from_secs(5));
    assert_eq!(p.timeouts.last_call, Duration::from_millis(1500));
    assert_eq!(p.timeouts.lease, Duration::from_secs(2));
    assert!(p.notes.iter().any(|n| n.contains("'foo'")));
    assert!(err(&["--rdzv-conf", "join_timeout=", "true"]).contains("non-empty"));
}

#[test]
fn aliases_and_abbreviations() {
    let p = resolve(&["--nproc_per_node", "2", "--nnode", "1", "--max_restarts=2", "true"]).unwrap();
    assert_eq!(p.nproc_per_node, 2);
    assert_eq!(p.max_restarts, 2);
    assert_eq!(p.extra_env[0], ("OMP_NUM_THREADS".to_owned(), "1".to_owned()));
}

#[test]
fn trailing_args_go_to_the_program() {
    let a = parse(&["--nproc-per-node", "2", "prog", "--nproc-per-node", "7", "-m"]);
    assert_eq!(a.program(), "prog");
    assert_eq!(a.program_args(), ["--nproc-per-node", "7", "-m"]);
    let e = LaunchArgs::try_parse_with_origins_from(["rsrun", "--bogus", "prog"]).unwrap_err().to_string();
    assert!(e.contains("unexpected argument '--bogus'"), "{e}");
    // Short options with their value attached, as torchrun's argparse reads them.
    let a = parse(&["-t3", "-r0:1", "prog", "-t3"]);
    assert_eq!((a.tee.as_deref(), a.redirects.as_deref(), a.program(), a.program_args()), (Some("3"), Some("0:1"), "prog", &["-t3".to_owned()][..]));
}

#[test]
fn logs_and_filters() {
    let p = resolve(&["--nproc-per-node", "4", "-r", "0:1,1:3", "--tee", "1:2", "--ranks-filter", "0,1,2-3", "true"]).unwrap();
    assert!(!p.logs.on_console(0, 0, 1));
    assert!(p.logs.on_console(0, 0, 2));
    assert!(p.logs.on_console(1, 1, 2));
    assert!(!p.logs.on_console(1, 1, 1));
    assert!(p.logs.on_console(0, 2, 2));
    assert!(!p.logs.on_console(4, 4, 2));
    assert!(err(&["-r", "4", "true"]).contains("--redirects"));
    assert!(err(&["--ranks-filter", "3-1", "true"]).contains("--ranks-filter"));
    assert!(err(&["--log-prefix", "${nope}", "true"]).contains("--log-prefix"));
    let p = resolve(&["--log-prefix", "${hostname}:${rank}| ", "true"]).unwrap();
    assert_eq!(expand_prefix(&p.logs.prefix, &[("hostname", "h"), ("rank", "3")]), "h:3| ");
    // torchrun's string.Template: $name too, $$ is $, a lone $ stays.
    let p = resolve(&["--log-line-prefix-template", "[$rank/$local_rank] $$ $ ${role_name}x", "true"]).unwrap();
    assert_eq!(expand_prefix(&p.logs.prefix, &[("rank", "3"), ("local_rank", "1"), ("role_name", "w")]), "[3/1] $ $ wx");
    assert!(err(&["--log-prefix", "${nope} ", "true"]).contains("$name; $$ for a $"));
    // A bare name that is no macro stays, as torchrun's safe_substitute leaves it.
    let p = resolve(&["--log-prefix", "$HOME $5 $rank| ", "true"]).unwrap();
    assert_eq!(expand_prefix(&p.logs.prefix, &[("rank", "3")]), "$HOME $5 3| ");
    assert_eq!(split_escaped("a,,b,c"), vec!["a,b", "c"]);
}

#[test]
fn durations_and_signals() {
    assert_eq!(parse_duration("500ms", "x").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("2m", "x").unwrap(), Duration::from_secs(120));
    assert_eq!(parse_duration("1.5", "x").unwrap(), Duration::from_millis(1500));
    assert!(parse_duration("-1", "x").is_err());
    assert!(parse_duration("soon", "x").is_err());
    let p = resolve(&["--signal-policy", "USR1=stop", "--shutdown-timeout", "3", "true"]).unwrap();
    assert_eq!(p.timeouts.shutdown, Duration::from_secs(3));
    assert!(err(&["--signal-policy", "USR1=explode", "true"]).contains("--signal-policy"));
}

#[test]
fn binding() {
    let p = resolve(&["--nproc-per-node", "2", "--cpu-bind", "cores", "true"]).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![vec![0, 1], vec![2, 3]]));
    let p = resolve(&["--nproc-per-node", "4", "--cpu-bind", "numa", "true"]).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]));
    let p = resolve(&["--nproc-per-node", "2", "--gpu-bind", "local-rank", "true"]).unwrap();
    assert_eq!(p.gpu_bind, GpuBind::LocalRank(vec!["0".into(), "1".into()]));
    assert!(err(&["--cpu-bind", "sockets", "true"]).contains("--cpu-bind"));
    assert_eq!(parse_cpu_list("0-2,5").unwrap(), vec![0, 1, 2, 5]);
}

/// Binding follows each local rank's GPU: its CUDA_VISIBLE_DEVICES entry (or its local rank),
/// located by PCI; torchrun's --numa-binding works, and not together with a different --cpu-bind.
#[test]
fn cpu_binding_follows_each_workers_gpu() {
    let mut h = host();
    h.cpus = (0..16).collect();
    // 2 packages/nodes of 4 cores x 2 threads (core k: CPUs k and k+8); GPUs 0,1 on node 1, 2,3 on node 0.
    h.placement = crate::plan::Placement::known(crate::topology::tests::linux_machine(), Some(crate::topology::tests::four_gpus()));
    let plan = |args: &[&str], h: &HostInfo| LaunchPlan::resolve(&parse(args), h);
    let p = plan(&["--nproc-per-node", "4", "--cpu-bind", "cores", "true"], &h).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![vec![4, 5, 12, 13], vec![6, 7, 14, 15], vec![0, 1, 8, 9], vec![2, 3, 10, 11]]));
    assert!(p.notes.iter().any(|n| n.contains("NUMA node of each local rank's GPU (PCI numa_node): 1,1,0,0")), "{:?}", p.notes);
    let p = plan(&["--nproc-per-node", "4", "--cpu-bind", "numa", "true"], &h).unwrap();
    let (node0, node1) = (vec![0, 1, 2, 3, 8, 9, 10, 11], vec![4, 5, 6, 7, 12, 13, 14, 15]);
    assert_eq!(p.cpu_sets, Some(vec![node1.clone(), node1.clone(), node0.clone(), node0.clone()]));
    // CUDA_VISIBLE_DEVICES=2,3: local rank 0 uses physical GPU 2, on node 0.
    h.env.insert("CUDA_VISIBLE_DEVICES".into(), "2,3".into());
    let p = plan(&["--nproc-per-node", "2", "--gpu-bind", "local-rank", "--numa-binding", "node", "true"], &h).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![node0.clone(), node0.clone()]));
    assert!(p.notes.iter().any(|n| n.contains("CUDA_DEVICE_ORDER")), "{:?}", p.notes);
    let p = plan(&["--nproc-per-node", "2", "--numa-binding", "exclusive", "true"], &h).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![vec![0, 1, 8, 9], vec![2, 3, 10, 11]]));
    let p = plan(&["--nproc-per-node", "2", "--numa-binding", "socket", "true"], &h).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![node0.clone(), node0]));
    // --cpu-bind numa is --numa-binding node; any other pair is refused, naming both.
    assert!(plan(&["--cpu-bind", "numa", "--numa-binding", "node", "true"], &h).is_ok());
    let e = plan(&["--cpu-bind", "cores", "--numa-binding", "exclusive", "true"], &h).unwrap_err().to_string();
    assert!(e.contains("--cpu-bind cores") && e.contains("--numa-binding exclusive"), "{e}");
}

/// Under Slurm's ConstrainDevices, CUDA_VISIBLE_DEVICES=0,1 are the job's GPUs (SLURM_STEP_GPUS=4,5,
/// device minors): the binding follows those, not the machine's first two.
#[test]
fn cpu_binding_follows_slurms_gpu_numbering() {
    let mut h = host();
    h.cpus = (0..16).collect();
    // GPUs 0-3 on NUMA node 0, 4-7 on node 1.
    h.placement = crate::plan::Placement::known(crate::topology::tests::linux_machine(), Some(crate::topology::tests::eight_gpus()));
    h.env.insert("CUDA_VISIBLE_DEVICES".into(), "0,1".into());
    let args = parse(&["--nproc-per-node", "2", "--numa-binding", "node", "true"]);
    let (node0, node1) = (vec![0, 1, 2, 3, 8, 9, 10, 11], vec![4, 5, 6, 7, 12, 13, 14, 15]);
    assert_eq!(LaunchPlan::resolve(&args, &h).unwrap().cpu_sets, Some(vec![node0.clone(), node0]));
    h.env.insert("SLURM_STEP_GPUS".into(), "4,5".into());
    let p = LaunchPlan::resolve(&args, &h).unwrap();
    assert_eq!(p.cpu_sets, Some(vec![node1.clone(), node1]));
    assert!(p.notes.iter().any(|n| n.contains("job's GPUs only (SLURM_STEP_GPUS=4,5")), "{:?}", p.notes);
}

/// --numa-binding reads PET_NUMA_BINDING as torchrun does; a conflict names what the user set (a
/// variable, not a flag never typed).
#[test]
fn binding_options_from_the_environment() {
    let cmd = <LaunchArgs as clap::CommandFactory>::command();
    let arg = cmd.get_arguments().find(|a| a.get_id() == "numa_binding").unwrap();
    assert_eq!(arg.get_env().and_then(|e| e.to_str()), Some("PET_NUMA_BINDING"));
    let (a, h) = parse_env(&["true"], &[("PET_NUMA_BINDING", "node")]);
    assert_eq!(LaunchPlan::resolve(&a, &h).unwrap().cpu_sets, Some(vec![vec![0, 1]]));
    let (a, h) = parse_env(&["--numa-binding", "exclusive", "true"], &[("PET_CPU_BIND", "cores")]);
    let e = LaunchPlan::resolve(&a, &h).unwrap_err().to_string();
    assert!(e.starts_with("PET_CPU_BIND=cores and --numa-binding exclusive both choose"), "{e}");
    let (a, h) = parse_env(&["--cpu-bind", "cores", "true"], &[("PET_NUMA_BINDING", "socket")]);
    let e = LaunchPlan::resolve(&a, &h).unwrap_err().to_string();
    assert!(e.starts_with("--cpu-bind cores and PET_NUMA_BINDING=socket both choose"), "{e}");
    // Typed, both are named as flags.
    let e = LaunchPlan::resolve(&parse(&["--cpu-bind", "cores", "--numa-binding", "socket", "true"]), &host()).unwrap_err().to_string();
    assert!(e.starts_with("--cpu-bind cores and --numa-binding socket both choose"), "{e}");
}

#[test]
fn compat_flags_warn() {
    let p = resolve(&["--start-method", "fork", "--numa-binding", "node", "true"]).unwrap();
    assert!(p.notes.iter().any(|n| n.contains("--start-method")));
    // --numa-binding binds (no GPU here: the NUMA nodes in turn, said in a note).
    assert_eq!(p.cpu_sets, Some(vec![vec![0, 1]]));
    assert!(p.notes.iter().any(|n| n.contains("--numa-binding node: no GPU NUMA node known")), "{:?}", p.notes);
    // torchrun's choices still hold for them (argparse refuses others, exit 2).
    for (flag, bad) in [("--start-method", "thread"), ("--numa-binding", "everywhere")] {
        let e = LaunchArgs::try_parse_with_origins_from(["rsrun", flag, bad, "true"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(bad), "{e}");
    }
}

#[test]
fn job_ids_the_rendezvous_would_reject_are_plan_errors() {
    let daemon = |id: &str| resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", id, "true"]);
    assert_eq!(daemon("none").unwrap().job_id, "none");
    assert!(daemon("9b2f63c6-1e1a-4b8e-bb2e-0c9a3f6a7d11").is_ok());
    assert!(daemon("team@cluster:run.7_a").is_ok());
    assert!(daemon(&"x".repeat(128)).is_ok());
    for bad in ["my job", "a/b", "ünïcode", &"x".repeat(129)] {
        let e = daemon(bad).unwrap_err().to_string();
        assert!(e.contains("--rdzv-id") && e.contains("at most 128") || e.contains("--rdzv-id") && e.contains(". _ : @ -"), "{bad}: {e}");
    }
    // Implicit standalone (one node, no port) sends the id to the embedded service too.
    assert!(resolve(&["--rdzv-id", "a b", "true"]).is_err());
    // So does the static backend (node rank 0 hosts a rendezvous).
    assert!(resolve(&["--nnodes", "2", "--master-addr", "h", "--rdzv-id", "a b", "true"]).is_err());
}

#[test]
fn nproc_is_bounded_like_the_rendezvous() {
    let max = MAX_NPROC_PER_NODE.to_string();
    let over = (MAX_NPROC_PER_NODE + 1).to_string();
    assert_eq!(resolve(&["--nproc-per-node", &max, "true"]).unwrap().nproc_per_node, MAX_NPROC_PER_NODE);
    let e = err(&["--nproc-per-node", &over, "true"]);
    assert!(e.contains("--nproc-per-node") && e.contains(&format!("at most {max} workers per node")), "{e}");
}

#[test]
fn world_size_overflow_is_a_plan_error() {
    let e = err(&["--nnodes", "4000000000", "--master-addr", "h", "--nproc-per-node", "2", "true"]);
    assert!(e.contains("world size does not fit"), "{e}");
    let e = err(&["--nnodes", "1:1200000", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--nproc-per-node", "4096", "true"]);
    assert!(e.contains("world size does not fit"), "{e}");
}

#[test]
fn node_ids_are_always_valid() {
    assert_eq!(node_id("gpu-node-07", 4242), "gpu-node-07-4242");
    assert_eq!(node_id("host name/é", 1), "host_name__-1");
    assert_eq!(node_id("", 1), "node-1");
    let long_a = format!("{}.a.example.com", "n".repeat(300));
    let long_b = format!("{}.b.example.com", "n".repeat(300));
    for h in [&long_a, &long_b] {
        let id = node_id(h, u32::MAX);
        assert!(id.len() <= MAX_JOB_ID_LEN, "{} > {MAX_JOB_ID_LEN}: {id}", id.len());
        assert!(rsrun_rendezvous::validate::id("node_id", &id).is_ok(), "{id}");
        assert!(id.ends_with(&format!("-{}", u32::MAX)), "{id}");
    }
    assert_ne!(node_id(&long_a, 7), node_id(&long_b, 7), "names sharing a long prefix must differ");
}

#[test]
fn keep_alive_timeout_and_tls_ca() {
    let d = |conf: &str| resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-conf", conf, "true"]);
    assert_eq!(d("").unwrap().timeouts.keep_alive_give_up, rsrun_rendezvous::client::KEEP_ALIVE_GIVE_UP);
    assert_eq!(d("keep_alive_timeout=7.5").unwrap().timeouts.keep_alive_give_up, Duration::from_millis(7500));
    assert!(d("keep_alive_timeout=0").unwrap_err().to_string().contains("keep_alive_timeout"));
    let e = err(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-tls-ca", "/nonexistent/ca.pem", "true"]);
    assert!(e.contains("--rdzv-tls-ca") && e.contains("readable"), "{e}");
    // A file without a certificate (a key, a truncated copy) is refused before anything starts.
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("ca.pem");
    std::fs::write(&truncated, "-----BEGIN CERTIFICATE-----\nMIIB\n").unwrap();
    let e = err(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-tls-ca", truncated.to_str().unwrap(), "true"]);
    assert!(e.contains("--rdzv-tls-ca") && e.contains("ca.pem") && e.contains("PEM CA certificates"), "{e}");
}

#[test]
fn a_token_file_is_read_as_a_daemon_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    let with = |text: &str| {
        std::fs::write(&file, text).unwrap();
        resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-token-file", file.to_str().unwrap(), "true"])
    };
    // The first token of a `TOKEN JOB` line, not the whole line.
    let p = with("# for job j\n0123456789abcdef-token j\nsecond-token-0123456789\n").unwrap();
    assert_eq!(p.token.as_deref(), Some("0123456789abcdef-token"));
    let e = with("short\n").unwrap_err().to_string();
    assert!(e.contains("--rdzv-token-file") && e.contains("line 1: token of 5 characters"), "{e}");
    let e = with("\n# nothing\n").unwrap_err().to_string();
    assert!(e.contains("--rdzv-token-file") && e.contains("holds no token"), "{e}");
}

#[test]
fn monitor_interval_rdzv_conf_and_ssh_port_bounds() {
    let e = err(&["--monitor-interval", "1e-9", "true"]);
    assert!(e.contains("--monitor-interval") && e.contains("at least 1ms"), "{e}");
    let e = err(&["--monitor-interval", "5m", "--hang-timeout", "1", "true"]);
    assert!(e.contains("no longer than --hang-timeout"), "{e}");
    assert!(resolve(&["--monitor-interval", "0.5", "--hang-timeout", "1", "true"]).is_ok());
    let d = |conf: &str| resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-conf", conf, "true"]);
    let e = d("lease_timeout=0").unwrap_err().to_string();
    assert!(e.contains("lease_timeout=SECONDS > 0"), "{e}");
    assert!(d("timeout=abc").unwrap_err().to_string().contains("--rdzv-conf"));
    let p = d("timeout=900").unwrap();
    assert!(p.notes.iter().any(|n| n.contains("timeout=900: not used")), "{:?}", p.notes);
    // A bad duration names its key; values past the service's ranges are refused here, naming
    // the flag, instead of by a Join the service refuses.
    let e = d("join_timeout=1e400").unwrap_err().to_string();
    assert!(e.contains("join_timeout=1e400") && e.contains("join_timeout=DURATION"), "{e}");
    for (conf, want) in [
        ("keep_alive_interval=30m", "a lease (lease_timeout, or keep_alive_interval x keep_alive_max_attempt) of at most 3600s (got 5400s)"),
        ("last_call_timeout=2d", "last_call_timeout=DURATION"),
        ("last_call_timeout=25h", "last_call_timeout of at most 86400s (got 90000s)"),
        ("join_timeout=100000", "join_timeout of at most 86400s"),
        // torchrun refuses these too.
        ("join_timeout=0", "join_timeout=SECONDS > 0"),
        ("read_timeout=0", "read_timeout=SECONDS > 0"),
    ] {
        let e = d(conf).unwrap_err().to_string();
        assert!(e.contains("--rdzv-conf") && e.contains(want), "{conf}: {e}");
    }
    assert!(d("lease_timeout=1h,last_call_timeout=24h,join_timeout=24h").is_ok());
    // torchrun's heartbeat_timeout bounds one heartbeat: the lease stays interval x attempts.
    let p = d("heartbeat_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=4").unwrap();
    assert_eq!(p.timeouts.lease, Duration::from_secs(4));
    assert!(p.notes.iter().any(|n| n.contains("heartbeat_timeout=5: torchrun's deadline of one heartbeat")), "{:?}", p.notes);
    assert!(d("heartbeat_timeout=abc").unwrap_err().to_string().contains("heartbeat_timeout=DURATION"));
    // A bounded value is said; torchrun's short booleans are taken.
    let p = d("read_timeout=120").unwrap();
    assert!(p.notes.iter().any(|n| n.contains("read_timeout=120: each rendezvous call is bounded by 1 to 30 s")), "{:?}", p.notes);
    assert!(d("is_host=f").is_ok() && d("is_host=t").is_ok());
    let e = LaunchArgs::try_parse_with_origins_from(["rsrun", "--ssh-port", "0", "true"]).unwrap_err().to_string();
    assert!(e.contains("--ssh-port") && e.contains("0"), "{e}");
}

#[test]
fn a_value_clap_refuses_is_traced_to_its_variable() {
    let var = |v: &str| (v == "PET_MAX_RESTARTS").then(|| std::ffi::OsString::from("abc"));
    let argv: Vec<std::ffi::OsString> = ["rsrun", "--max-restarts=abc", "true"].iter().map(Into::into).collect();
    let e = LaunchArgs::try_parse_with_origins_from(&argv).unwrap_err();
    // Typed on the command line: nothing to add.
    assert_eq!(crate::cli::env_source_of(&e, var, &argv), None);
    // The same value from the variable (as clap's env fallback sees it).
    let bare: Vec<std::ffi::OsString> = ["rsrun", "true"].iter().map(Into::into).collect();
    assert_eq!(crate::cli::env_source_of(&e, var, &bare).as_deref(), Some("PET_MAX_RESTARTS=abc"));
}

#[test]
fn ranks_that_do_not_exist_and_keys_given_twice_are_refused() {
    for (args, want) in [
        (&["--nproc-per-node", "2", "--local-ranks-filter", "5", "true"][..], "--local-ranks-filter"),
        (&["--nproc-per-node", "2", "--ranks-filter", "2-7", "true"], "--ranks-filter"),
        (&["--nproc-per-node", "2", "--redirects", "5:1", "true"], "--redirects"),
        (&["--nproc-per-node", "2", "--tee", "2:1,3:3", "true"], "--tee"),
    ] {
        let e = err(args);
        assert!(e.contains(want) && e.contains("does not exist"), "{args:?}: {e}");
    }
    // Some of the ranks exist: the others are ignored, as torchrun does, and said.
    for (args, want) in [
        (&["--nproc-per-node", "2", "--ranks-filter", "0,7", "true"][..], "--ranks-filter 0,7: ranks 2 and above do not exist here"),
        (&["--nproc-per-node", "2", "--tee", "0:1,2:3", "true"], "--tee 0:1,2:3: local ranks 2 and above do not exist here"),
        (&["--nproc-per-node", "2", "--local-ranks-filter", "0,4", "true"], "--local-ranks-filter 0,4: local ranks 2 and above"),
    ] {
        let p = resolve(args).unwrap();
        assert!(p.notes.iter().any(|n| n.contains(want)), "{args:?}: {:?}", p.notes);
    }
    assert!(resolve(&["--nnodes", "2", "--node-rank", "0", "--master-addr", "h", "--nproc-per-node", "2", "--ranks-filter", "3", "true"]).is_ok());
    assert!(err(&["--signal-policy", "INT=stop,INT=ignore", "true"]).contains("given twice"));
    // torchrun's flags keep torchrun's rule: the last value wins (said in a note for --rdzv-conf).
    assert_eq!(resolve(&["--redirects", "0:0,0:1", "true"]).unwrap().logs.redirects.for_local_rank(0), StdMask(1));
    let p = resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout=5,join_timeout=6", "true"]).unwrap();
    assert_eq!(p.timeouts.join, Duration::from_secs(6));
    assert!(p.notes.iter().any(|n| n.contains("join_timeout is given more than once; the last value, 6, counts")), "{:?}", p.notes);
}

#[test]
fn a_log_dir_that_cannot_be_one_is_a_plan_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("afile");
    std::fs::write(&file, "").unwrap();
    for d in [file.clone(), file.join("below")] {
        let e = err(&["--log-dir", d.to_str().unwrap(), "true"]);
        assert!(e.contains("for --log-dir") && e.contains("afile is not a directory"), "{e}");
    }
    let fine = dir.path().join("new").join("logs");
    assert!(resolve(&["--log-dir", fine.to_str().unwrap(), "true"]).is_ok());
    assert!(resolve(&["--log-dir", "/dev/null", "true"]).is_ok());
    // The default under a current directory that cannot hold it (a read-only root file system)
    // goes to TMPDIR/rsrun-UID/logs, said in a note; a given --log-dir stays an error.
    let mut h = host();
    h.cwd = file.join("cwd");
    let tmp = tempfile::tempdir().unwrap();
    h.env.insert("TMPDIR".into(), tmp.path().to_str().unwrap().into());
    let p = LaunchPlan::resolve(&parse(&["true"]), &h).unwrap();
    let want = tmp.path().join(format!("rsrun-{}", unsafe { libc::getuid() })).join("logs");
    assert_eq!(p.logs.dir.as_deref(), Some(want.as_path()));
    assert!(p.notes.iter().any(|n| n.contains("cannot hold the logs") && n.contains("afile is not a directory")), "{:?}", p.notes);
    let e = LaunchPlan::resolve(&parse(&["--log-dir", "logs", "true"]), &h).unwrap_err().to_string();
    assert!(e.contains("for --log-dir") && e.contains("afile is not a directory"), "{e}");
    // Made now, this user's only.
    let base = want.parent().unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(base).unwrap().permissions()) & 0o777, 0o700);
    // One an earlier rsrun made with the umask's mode is closed up.
    std::fs::set_permissions(base, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    LaunchPlan::resolve(&parse(&["true"]), &h).unwrap();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(base).unwrap().permissions()) & 0o777, 0o700);
    // Not into an rsrun-UID that is a symbolic link (someone else's, in a shared /tmp).
    std::fs::remove_dir_all(base).unwrap();
    let other = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(other.path(), base).unwrap();
    let e = LaunchPlan::resolve(&parse(&["true"]), &h).unwrap_err().to_string();
    assert!(e.contains("(the default; give --log-dir DIR"), "{e}");
}

#[test]
fn check_needs_a_host_list() {
    assert_eq!(
        err(&["--check", "true"]),
        "--check needs --hosts or --hostfile: it checks every host of a whole-job launch and starts nothing"
    );
}

#[test]
fn requeue_on_preempt_needs_slurm_and_names_node_rank_0() {
    assert_eq!(
        err(&["--requeue-on-preempt", "true"]),
        "--requeue-on-preempt needs a Slurm job (SLURM_JOB_ID is not set): it runs `scontrol requeue <job id>`"
    );
    let step = |node: &str| {
        vec![
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_STEP_NODELIST", "127.0.0.[1-2]"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_NODEID", if node == "0" { "0" } else { "1" }),
        ]
    };
    for (node, runner) in [("0", true), ("1", false)] {
        let (a, h) = parse_env(&["--requeue-on-preempt", "true"], &step(node));
        let p = LaunchPlan::resolve(&a, &h).unwrap();
        let r = p.requeue.clone().unwrap();
        assert_eq!((r.job.as_str(), r.runner), ("4242", runner), "node {node}");
        assert_eq!(r.argv(), ["scontrol", "requeue", "4242"]);
        let text = crate::dry_run::render(&p);
        let who = if runner { "this node" } else { "not this node" };
        assert!(
            text.contains(&format!("requeue      : after a preemption signal (TERM, USR1, USR2), once the workers exit or the shutdown grace passes, node rank 0 runs `scontrol requeue 4242` once ({who})")),
            "{text}"
        );
    }
    // An array task requeues ARRAY_JOB_ID_TASK_ID.
    let mut env = step("0");
    env.extend([("SLURM_ARRAY_JOB_ID", "900"), ("SLURM_ARRAY_TASK_ID", "3")]);
    let (a, h) = parse_env(&["--requeue-on-preempt", "true"], &env);
    assert_eq!(LaunchPlan::resolve(&a, &h).unwrap().requeue.unwrap().job, "900_3");
    // Mode B: the task with SLURM_PROCID=0.
    let mode_b = [
        ("SLURM_JOB_ID", "4343"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEP_NODELIST", "127.0.0.[1-2]"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_NODEID", "0"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "1"),
    ];
    let (a, h) = parse_env(&["--requeue-on-preempt", "true"], &mode_b);
    assert!(!LaunchPlan::resolve(&a, &h).unwrap().requeue.unwrap().runner, "rank 1 of node 0 is not the runner");
    // Not with the ssh launcher.
    let e = err(&["-H", "w1:1", "--requeue-on-preempt", "--rdzv-endpoint", "127.0.0.1", "true"]);
    assert!(e.starts_with("--requeue-on-preempt needs a Slurm job"), "{e}");
}

/// A variable that is not Unicode (a Latin-1 value) is no panic: it is left out of the `String`
/// view, the others are kept.
#[test]
fn a_non_unicode_variable_is_left_out_of_the_host_env() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let vars = vec![
        (OsString::from("PATH"), OsString::from("/bin")),
        (OsString::from("LABEL"), OsString::from_vec(b"caf\xe9".to_vec())),
        (OsString::from_vec(b"N\xff".to_vec()), OsString::from("x")),
    ];
    let env = unicode_env(vars.into_iter());
    assert_eq!(env.len(), 1);
    assert_eq!(env["PATH"], "/bin");
}

/// The dry run shows the paths and ids the run will use: the log directory of a job id that is
/// not a plain path component (`..` becomes `_..`), and the node id's form (`host-<pid>`).
#[test]
fn the_dry_run_shows_the_log_directory_and_node_id_the_run_uses() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().to_str().unwrap();
    let p = resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "..", "--log-dir", logs, "true"]).unwrap();
    let text = crate::dry_run::render(&p);
    let want = p.logs.attempt_dir("..", 0).unwrap();
    assert!(want.ends_with("_../attempt_0"), "{}", want.display());
    assert!(text.contains(&format!("logs         : {}/attempt_<round>/", want.parent().unwrap().display())), "{text}");
    assert!(text.contains("RSRUN_NODE_ID=testhost-<pid>"), "{text}");
}

/// A typed --log-line-prefix-template wins over the other spelling's PET_LOG_PREFIX.
#[test]
fn a_typed_prefix_wins_over_the_other_spellings_variable() {
    let (a, h) = parse_env(&["--log-line-prefix-template", "T| ", "true"], &[("PET_LOG_PREFIX", "E| ")]);
    assert_eq!(LaunchPlan::resolve(&a, &h).unwrap().logs.prefix, "T| ");
    let (a, h) = parse_env(&["true"], &[("PET_LOG_PREFIX", "E| ")]);
    assert_eq!(LaunchPlan::resolve(&a, &h).unwrap().logs.prefix, "E| ");
}

/// `python -m rsrun` hands its interpreter over: Python programs run under it (as torchrun's run
/// under sys.executable), unless PYTHON_EXEC names another.
#[test]
fn python_of_the_module_runs_the_scripts() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.py"), "print(1)").unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    h.env.insert(PYTHON_OF_MODULE_VAR.into(), "/bin/sh".into());
    let plan = LaunchPlan::resolve(&parse(&["train.py"]), &h).unwrap();
    assert_eq!(plan.program.exe, Path::new("/bin/sh"));
    h.env.insert("PYTHON_EXEC".into(), "/bin/true".into());
    let plan = LaunchPlan::resolve(&parse(&["train.py"]), &h).unwrap();
    assert_eq!(plan.program.exe, Path::new("/bin/true"));
}

/// An rsrun that pip installed into a venv runs its scripts under the venv's Python, activated
/// or not (`/venv/bin/torchrun` gives its workers `sys.executable`); an rsrun elsewhere takes
/// python3 from PATH.
#[test]
fn an_rsrun_in_a_venv_runs_the_venvs_python() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("venv/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("python3"), "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(bin.join("python3"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.path().join("train.py"), "print(1)").unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    h.exe_dir = Some(bin.clone());
    // Not a venv yet (no pyvenv.cfg): PATH's python3, wherever that is.
    if let Ok(plan) = LaunchPlan::resolve(&parse(&["train.py"]), &h) {
        assert_ne!(plan.program.exe, bin.join("python3"));
    }
    std::fs::write(dir.path().join("venv/pyvenv.cfg"), "home = /usr/bin\n").unwrap();
    let plan = LaunchPlan::resolve(&parse(&["train.py"]), &h).unwrap();
    assert_eq!(plan.program.exe, bin.join("python3"));
}

/// An executable Python script (by its `#!` line) and a package directory named without a
/// slash run as torchrun runs them, `python -u PROGRAM`; an executable shell script runs as it is.
#[test]
fn python_scripts_by_their_shebang_and_bare_package_directories_run_under_python() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("train", "#!/usr/bin/env python3\nprint(1)\n"), ("tool", "#!/bin/sh\necho 1\n")] {
        std::fs::write(dir.path().join(name), text).unwrap();
        std::fs::set_permissions(dir.path().join(name), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::create_dir_all(dir.path().join("mypkg")).unwrap();
    std::fs::write(dir.path().join("mypkg/__main__.py"), "print(1)").unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    h.env.insert("PYTHON_EXEC".into(), "/bin/true".into());
    for program in ["train", "./train", "mypkg"] {
        let plan = LaunchPlan::resolve(&parse(&[program]), &h).unwrap();
        assert_eq!(plan.program.kind, ProgramKind::PythonScript, "{program}");
        assert_eq!(plan.program.argv(0), vec!["-u", program], "{program}");
        assert_eq!(plan.program.exe, Path::new("/bin/true"), "{program}: PYTHON_EXEC");
    }
    for program in ["tool", "./tool"] {
        let plan = LaunchPlan::resolve(&parse(&[program]), &h).unwrap();
        assert_eq!(plan.program.kind, ProgramKind::Executable, "{program}");
    }
}

/// `--master-addr [::1]` (torchrun's help shows the bracketed form) is the address ::1, not a
/// name to look up until the join timeout; brackets around anything else are named.
#[test]
fn a_bracketed_ipv6_master_addr_is_the_address() {
    let plan = resolve(&["--master-addr", "[::1]", "--master-port", "29566", "true"]).unwrap();
    assert!(matches!(&plan.rdzv, RdzvPlan::Static { master_addr, .. } if master_addr == "::1"), "{:?}", plan.rdzv);
    let a = LaunchArgs::try_parse_with_origins_from(["rsrun", "--local-addr", "[fe80::1]", "true"]).unwrap();
    assert_eq!(a.local_addr.as_deref(), Some("fe80::1"));
    let e = LaunchArgs::try_parse_with_origins_from(["rsrun", "--master-addr", "[node1]", "true"]).unwrap_err().to_string();
    assert!(e.contains("brackets hold an IPv6 address"), "{e}");
}

/// CUDA_VISIBLE_DEVICES counts as the CUDA runtime counts it: up to the first entry that names no
/// device, and never past the machine's GPUs when the driver lists them.
#[test]
fn visible_gpus_follow_the_cuda_runtime() {
    assert_eq!(visible_gpus(None, Some(8)), 8);
    assert_eq!(visible_gpus(None, None), 0);
    assert_eq!(visible_gpus(Some("0,1"), Some(8)), 2);
    assert_eq!(visible_gpus(Some("0,1"), Some(0)), 0, "a list on a machine without GPUs");
    assert_eq!(visible_gpus(Some("0,1"), None), 2, "no driver list: the variable is all we know");
    assert_eq!(visible_gpus(Some("0,-1,1"), Some(8)), 1, "the runtime stops at -1");
    assert_eq!(visible_gpus(Some("0,9,1"), Some(8)), 1, "and at an index the machine lacks");
    assert_eq!(visible_gpus(Some(""), Some(8)), 0);
    assert_eq!(visible_gpus(Some("GPU-3f2a,GPU-77b1"), Some(8)), 2);
}

/// torchrun's static rendezvous waits `timeout` for every node, 900 s unless given; c10d waits
/// join_timeout and says that `timeout` is not its.
#[test]
fn the_static_backend_waits_timeout() {
    let st = |conf: &str| resolve(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "h", "--rdzv-conf", conf, "true"]).unwrap();
    assert_eq!(st("last_call_timeout=1").timeouts.join, Duration::from_secs(900));
    assert_eq!(st("timeout=3600").timeouts.join, Duration::from_secs(3600));
    // rsrun's own key still counts when torchrun's is not given.
    assert_eq!(st("join_timeout=60").timeouts.join, Duration::from_secs(60));
    let p = resolve(&["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--rdzv-conf", "timeout=3600,join_timeout=60", "true"]).unwrap();
    assert_eq!(p.timeouts.join, Duration::from_secs(60));
    assert!(p.notes.iter().any(|n| n.contains("timeout=3600: not used by the c10d backend")), "{:?}", p.notes);
}

/// An argument that is not UTF-8 (a Latin-1 file name) is a usage error, never a panic, and
/// rsrun says which one it is (clap does not).
#[test]
fn a_non_utf8_argument_is_refused_by_position() {
    use std::ffi::OsString;
    use std::os::unix::ffi::OsStringExt;
    let argv = vec![
        OsString::from("rsrun"),
        OsString::from("--nproc-per-node"),
        OsString::from("2"),
        OsString::from("cat"),
        OsString::from_vec(b"caf\xe9.txt".to_vec()),
    ];
    let Err(err) = crate::cli::LaunchArgs::try_parse_with_origins_from(argv.clone()) else { panic!("accepted") };
    assert_eq!(err.kind(), clap::error::ErrorKind::InvalidUtf8);
    let which = crate::cli::non_utf8_argument(&argv).unwrap();
    assert!(which.starts_with("argument 4 (\"caf\u{fffd}.txt\") is not valid UTF-8"), "{which}");
    assert_eq!(crate::cli::non_utf8_argument(&argv[..4]), None);
}
