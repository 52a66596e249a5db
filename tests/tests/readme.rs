//! Every shell command in README.md's fenced `sh` blocks is run here, as printed, with only what
//! cannot run on one test machine substituted: host names become 127.0.0.1, fixed ports become free
//! ports, system paths become temporary directories, and cluster-sized counts (nodes, workers,
//! steps) shrink. A README command without a test here, or a test whose command is no longer in the
//! README, fails `every_readme_command_is_run_by_a_test`.
//!
//! This is a test binary of its own so that the README's build command does not compete for the
//! cores with the timing-sensitive end-to-end tests; inside it the tests take turns (`SERIAL`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::Duration;

use rsrun_tests::{KillOnDrop, RUN_DEADLINE, bin, code, free_port, text, tls_files};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

/// Whether a tool beyond the Rust toolchain that a documented command uses is here (`probe`, a
/// shell command, succeeds). The README's test command works on a machine with only the Rust
/// toolchain: without the tool the test says so and skips. CI (`.ci/run`, which installs them)
/// sets RSRUN_TEST_REQUIRE_TOOLS=1: there a missing tool fails the test.
fn have(test: &str, what: &str, probe: &str) -> bool {
    let here = std::process::Command::new("sh")
        .args(["-c", probe])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !here {
        assert!(std::env::var_os("RSRUN_TEST_REQUIRE_TOOLS").is_none(), "{test}: {what} is missing (`{probe}` failed), and RSRUN_TEST_REQUIRE_TOOLS is set");
        eprintln!("{test}: {what} is missing (`{probe}` failed); skipped");
    }
    here
}

const PYTHON_VENV: &str = "python3 -c 'import ensurepip, venv'";

/// The commands of README.md's fenced `sh` blocks: continuation lines joined, trailing comments cut.
fn readme_commands() -> Vec<String> {
    let text = std::fs::read_to_string(workspace().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            in_sh = !in_sh && matches!(info.trim(), "sh" | "bash" | "shell" | "console");
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = strip_comment(line);
        let code = code.trim();
        if code.is_empty() && pending.is_empty() {
            continue;
        }
        match code.strip_suffix('\\') {
            Some(head) => {
                pending.push_str(head.trim());
                pending.push(' ');
            }
            None => {
                pending.push_str(code);
                out.push(std::mem::take(&mut pending).trim().to_owned());
            }
        }
    }
    out
}

/// Every fenced block of README.md closes with a bare fence: text after a closing fence makes
/// CommonMark read it as no fence at all, and from there on prose renders as code and code as prose
/// (the command list above would not notice).
#[test]
fn readme_fences_are_well_formed() {
    let text = std::fs::read_to_string(workspace().join("README.md")).unwrap();
    let mut open: Option<usize> = None;
    for (i, line) in text.lines().enumerate() {
        let Some(info) = line.trim_start().strip_prefix("```") else { continue };
        match open {
            Some(_) => {
                assert!(info.trim().is_empty(), "README.md:{}: a closing fence with text after it: {line:?}", i + 1);
                open = None;
            }
            None => {
                assert!(!info.trim().contains(char::is_whitespace), "README.md:{}: an opening fence with more than an info word: {line:?}", i + 1);
                open = Some(i + 1);
            }
        }
    }
    assert_eq!(open, None, "README.md: the block opened at this line never closes");
}

/// `cmd   # comment` → `cmd` (a `#` inside quotes or a word is kept).
fn strip_comment(line: &str) -> String {
    let (mut single, mut double) = (false, false);
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return line[..i].to_owned(),
            _ => {}
        }
        prev = c;
    }
    line.to_owned()
}

/// Asserts that README.md shows `cmd` exactly, and returns it.
fn readme(cmd: &str) -> String {
    let cmds = readme_commands();
    assert!(cmds.iter().any(|c| c == cmd), "README.md no longer shows {cmd:?}; its commands are:\n{cmds:#?}");
    cmd.to_owned()
}

const QUICKSTART: &str =
    "cargo build --release --workspace && ./target/release/rsrun --standalone --nproc-per-node 2 ./target/release/train --steps 60";
const TEST_COMMAND: &str = "cargo test --workspace";
const TORCH_SCRIPT: &str = "rsrun --standalone --nproc-per-node 4 train.py --lr 3e-4";
const TORCH_MODULE: &str = "rsrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29400 --rdzv-id job7 -m my.module";
const TOKENS: &str = "openssl rand -hex 32 > /etc/rsrun/tokens";
const DAEMON: &str = "rsrun-rendezvous serve --listen 0.0.0.0:29400 --token-file /etc/rsrun/tokens --data-dir /var/lib/rsrun --tls-cert cert.pem --tls-key key.pem --metrics-listen 0.0.0.0:9400";
const CLUSTER_NODE: &str = "rsrun --nnodes 4 --nproc-per-node 8 --rdzv-endpoint head:29400 --rdzv-id job7 --rdzv-token-file /etc/rsrun/tokens --rdzv-tls-ca ca.pem --max-restarts 3 train --steps 1000";
const DAEMON_STATUS: &str = "rsrun-rendezvous status --endpoint head:29400 --token-file /etc/rsrun/tokens --tls-ca ca.pem";
const STATIC_0: &str = "rsrun --nnodes 2 --node-rank 0 --master-addr head --master-port 29500 --nproc-per-node 8 train";
const STATIC_1: &str = "rsrun --nnodes 2 --node-rank 1 --master-addr head --master-port 29500 --nproc-per-node 8 train";

const HOSTFILE_WRITE: &str = r"printf '# two hosts\nnode1 slots=2\nnode2 slots=2\n' > hosts";
const HOSTFILE_DRY_RUN: &str = "rsrun --hostfile hosts --dry-run true";
const HOSTS_INCLUDE_DRY_RUN: &str = "rsrun -H 'node[1-2]:2' --include 'node1:1@node2' --dry-run true";
const SLURM_DRY_RUN: &str = "SLURM_JOB_ID=4242 SLURM_STEP_ID=0 SLURM_STEP_NODELIST='127.0.0.[1-2]' SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_TASKS_PER_NODE='1(x2)' SLURM_NODEID=1 rsrun --dry-run true";
const K8S_DRY_RUN: &str = "PET_NNODES=2 PET_NODE_RANK=1 PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=29500 PET_NPROC_PER_NODE=2 rsrun --dry-run true";

const SSH_RUN: &str = "rsrun -H node1:8,node2:8 --rdzv-endpoint node1 train --steps 1000";
const SSH_DRY_RUN: &str = "rsrun -H node1:8,node2:8 --dry-run train --steps 1000";
const SSH_CHECK: &str = "rsrun -H node1:8,node2:8 --check train --steps 1000";
const FAKE_RSH_RUN: &str = "./target/release/rsrun -H h1:2,h2:2 --rsh tests/fake-rsh --allow-same-host --rdzv-endpoint 127.0.0.1:0 ./target/release/hello --steps 3";

const ETCD_MEMBER: &str = "etcd --name e1 --data-dir /var/lib/etcd --listen-client-urls http://e1:2379 --advertise-client-urls http://e1:2379 --listen-peer-urls http://e1:2380 --initial-advertise-peer-urls http://e1:2380 --initial-cluster e1=http://e1:2380,e2=http://e2:2380,e3=http://e3:2380 --auto-compaction-retention 1h";
const HA_DAEMON: &str = "rsrun-rendezvous serve --listen 0.0.0.0:29400 --advertise h1:29400 --token-file /etc/rsrun/tokens --tls-cert cert.pem --tls-key key.pem --etcd-endpoints e1:2379,e2:2379,e3:2379 --etcd-prefix /rsrun --leader-lease-ttl 5";
const HA_NODE: &str = "rsrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint h1:29400,h2:29400,h3:29400 --rdzv-id job8 --rdzv-token-file /etc/rsrun/tokens --rdzv-tls-ca ca.pem train --steps 1000";
const HA_STATUS: &str = "rsrun-rendezvous status --endpoint h1:29400,h2:29400,h3:29400 --token-file /etc/rsrun/tokens --tls-ca ca.pem";
const ETCD_ROOT_ENV: &str = r#"export ETCDCTL_USER="root:$(cat /etc/etcd/root-password)""#;
const ETCD_USER: &str = r#"etcdctl user add rsrun --new-user-password "$(cat /etc/rsrun/etcd-password)""#;
const ETCD_ROLE: &str = "etcdctl role add rsrun && etcdctl role grant-permission rsrun --prefix=true readwrite /rsrun/ && etcdctl user grant-role rsrun rsrun";
const HA_DAEMON_AUTH: &str = "rsrun-rendezvous serve --listen 0.0.0.0:29400 --advertise h1:29400 --token-file /etc/rsrun/tokens --tls-cert cert.pem --tls-key key.pem --etcd-endpoints e1:2379,e2:2379,e3:2379 --etcd-user rsrun --etcd-password-file /etc/rsrun/etcd-password";

const BENCH: &str = "scripts/bench-vs-torch.sh 30";
const GEMM_PROFILE: &str = "./target/release/engine-bench --steps 12 --gemm-profile";
const GPU_BUILD: &str = "cargo build --release -p rsrun-examples --features nccl --bin gpu-smoke";
const GPU_RUN: &str = "./target/release/rsrun --standalone --nproc-per-node 1 ./target/release/gpu-smoke";

const TORCH_VENV: &str = "scripts/torch-venv.sh";
const TEST_WHEEL: &str = "scripts/test-wheel.sh";
const ENGINE_SINGLE: &str = "./target/release/engine-bench --steps 20";
const ENGINE_DDP: &str = "./target/release/rsrun --standalone --nproc-per-node 2 ./target/release/engine-bench --strategy ddp --steps 20";
const COLLECTIVES: &str = "./target/release/collectives-bench --spawn 2 --backends shm --sizes 67108864";
const LAUNCH_BENCH: &str = "scripts/launch-bench.sh";
const RDZV_BENCH: &str = "./target/release/rendezvous-bench --agents 10000";
const RDZV_BENCH_HA: &str = "./target/release/rendezvous-bench --agents 1024 --compare-ha";
const HA_FAILOVER_BENCH: &str = "./target/release/ha-failover-bench --trials 50";
const TCPSTORE_BENCH: &str = "./target/release/tcpstore-bench";

const PIP_VENV: &str = "python3 -m venv .venv";
const PIP_INSTALL: &str = ".venv/bin/pip install .";
const PIP_VERSIONS: &str = ".venv/bin/rsrun --version && .venv/bin/rsrun-rendezvous --version";
const PIP_PYTHON_M: &str = r#".venv/bin/python -m rsrun --standalone --nproc-per-node 2 python3 -c 'import os; print(os.environ["RANK"])'"#;

/// Every command a test below runs.
const COVERED: &[&str] = &[
    QUICKSTART,
    TEST_COMMAND,
    TORCH_SCRIPT,
    TORCH_MODULE,
    TOKENS,
    DAEMON,
    CLUSTER_NODE,
    DAEMON_STATUS,
    STATIC_0,
    STATIC_1,
    HOSTFILE_WRITE,
    HOSTFILE_DRY_RUN,
    HOSTS_INCLUDE_DRY_RUN,
    SLURM_DRY_RUN,
    K8S_DRY_RUN,
    SSH_RUN,
    SSH_DRY_RUN,
    SSH_CHECK,
    FAKE_RSH_RUN,
    ETCD_MEMBER,
    HA_DAEMON,
    HA_NODE,
    HA_STATUS,
    ETCD_ROOT_ENV,
    ETCD_USER,
    ETCD_ROLE,
    HA_DAEMON_AUTH,
    BENCH,
    GEMM_PROFILE,
    GPU_BUILD,
    GPU_RUN,
    TORCH_VENV,
    TEST_WHEEL,
    ENGINE_SINGLE,
    ENGINE_DDP,
    COLLECTIVES,
    LAUNCH_BENCH,
    RDZV_BENCH,
    RDZV_BENCH_HA,
    HA_FAILOVER_BENCH,
    TCPSTORE_BENCH,
    PIP_VENV,
    PIP_INSTALL,
    PIP_VERSIONS,
    PIP_PYTHON_M,
];

#[test]
fn every_readme_command_is_run_by_a_test() {
    let shown: BTreeSet<String> = readme_commands().into_iter().collect();
    let covered: BTreeSet<String> = COVERED.iter().map(|s| s.to_string()).collect();
    let untested: Vec<_> = shown.difference(&covered).collect();
    let stale: Vec<_> = covered.difference(&shown).collect();
    assert!(untested.is_empty(), "README.md commands that no test runs: {untested:#?}");
    assert!(stale.is_empty(), "tests for commands README.md no longer shows: {stale:#?}");
}

/// `bash -c CMD` in `dir` with this build's binaries first on PATH (as after an install).
fn shell(dir: &Path, cmd: &str) -> Command {
    let bin_dir = bin("rsrun").parent().unwrap().to_owned();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut c = Command::new("bash");
    c.arg("-c").arg(cmd).current_dir(dir).env("PATH", path).env("RUST_BACKTRACE", "0");
    for (k, _) in std::env::vars() {
        if k.starts_with("PET_") || k.starts_with("TORCHELASTIC_") || k.starts_with("SLURM_") || k == "RSRUN_LOG" {
            c.env_remove(k);
        }
    }
    c
}

fn run_all(cmds: Vec<Command>, deadline: Duration) -> Vec<Output> {
    let handles: Vec<_> = cmds
        .into_iter()
        .map(|mut c| {
            let child = KillOnDrop::spawn(&mut c);
            std::thread::spawn(move || child.output_within(deadline))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn ok(outs: &[Output]) {
    for o in outs {
        assert_eq!(code(&o.status), 0, "{}", text(o));
    }
}

fn stdout_of(outs: &[Output]) -> String {
    outs.iter().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).collect()
}

/// The first half of the README's first command (`cargo build --release --workspace`), once.
fn release_build() {
    static DONE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    DONE.get_or_init(|| {
        let build = readme(QUICKSTART).split(" && ").next().unwrap().to_owned();
        assert_eq!(build, "cargo build --release --workspace");
        let out = run_all(vec![shell(&workspace(), &build)], Duration::from_secs(3600)).remove(0);
        assert_eq!(code(&out.status), 0, "{}", text(&out));
    });
}

#[test]
fn quickstart_builds_and_trains() {
    let _turn = serial();
    // As printed, in the repository root: the release build (minutes the first time) and the run.
    let out = run_all(vec![shell(&workspace(), &readme(QUICKSTART))], Duration::from_secs(3600)).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let all = text(&out);
    assert!(all.contains("summary:") && all.contains("params_sha256="), "{all}");
    assert!(all.contains("metrics.jsonl") && all.contains("loss.svg"), "{all}");
}

#[test]
fn readme_test_command_is_what_ci_runs() {
    let cmd = readme(TEST_COMMAND);
    // This command runs this test: CI runs it, verbatim, on a fresh clone.
    let ci = std::fs::read_to_string(workspace().join(".ci/run")).unwrap();
    assert!(ci.lines().any(|l| l.trim() == cmd), ".ci/run does not run {cmd:?}:\n{ci}");
}

#[test]
fn pytorch_script_and_module_commands() {
    let _turn = serial();
    if !have("pytorch_script_and_module_commands", "python3", "python3 -c ''") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let probe = "import os, sys\nprint(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} args {sys.argv[1:]}\", flush=True)\n";
    std::fs::write(dir.path().join("train.py"), probe).unwrap();
    std::fs::create_dir_all(dir.path().join("my")).unwrap();
    std::fs::write(dir.path().join("my/__init__.py"), "").unwrap();
    std::fs::write(dir.path().join("my/module.py"), probe).unwrap();

    let outs = run_all(vec![shell(dir.path(), &readme(TORCH_SCRIPT))], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    for r in 0..4 {
        assert!(s.contains(&format!("rank {r} of 4 args ['--lr', '3e-4']")), "{s}");
    }

    let cmd = readme(TORCH_MODULE).replace("head:29400", &format!("127.0.0.1:{}", free_port()));
    let outs = run_all(vec![shell(dir.path(), &cmd), shell(dir.path(), &cmd)], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    for r in 0..16 {
        assert!(s.contains(&format!("rank {r} of 16 args []")), "{s}");
    }
}

#[test]
fn cluster_daemon_with_tokens_tls_and_two_nodes() {
    let _turn = serial();
    if !have("cluster_daemon_with_tokens_tls_and_two_nodes", "openssl (the token recipe)", "command -v openssl") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tls_files(d);
    std::fs::create_dir_all(d.join("etc/rsrun")).unwrap();
    let (port, metrics) = (free_port().to_string(), free_port().to_string());
    let paths = |c: &str| c.replace("/etc/rsrun", &d.join("etc/rsrun").display().to_string()).replace("/var/lib/rsrun", &d.join("var/lib/rsrun").display().to_string());

    let out = run_all(vec![shell(d, &paths(&readme(TOKENS)))], RUN_DEADLINE).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert_eq!(std::fs::read_to_string(d.join("etc/rsrun/tokens")).unwrap().trim().len(), 64);

    // The daemon listens on every interface, as documented; the test only talks to 127.0.0.1.
    let daemon_cmd = paths(&readme(DAEMON)).replace(":29400", &format!(":{port}")).replace(":9400", &format!(":{metrics}"));
    let mut daemon = shell(d, &format!("exec {daemon_cmd}"));
    let daemon = KillOnDrop::spawn(&mut daemon);
    let up = rsrun_tests::wait_until(Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_ok());
    assert!(up, "the daemon did not listen on {port}");

    // Every node runs the same command: a small cluster (2 nodes × 1 worker, 3 steps) on one host.
    let node = paths(&readme(CLUSTER_NODE))
        .replace("head:29400", &format!("127.0.0.1:{port}"))
        .replace("--nnodes 4 --nproc-per-node 8", "--nnodes 2 --nproc-per-node 1")
        .replace("--steps 1000", "--steps 3");
    let outs = run_all(vec![shell(d, &node), shell(d, &node)], RUN_DEADLINE * 3);
    ok(&outs);
    assert!(text(&outs[0]).contains("summary:") || text(&outs[1]).contains("summary:"), "{}\n{}", text(&outs[0]), text(&outs[1]));
    // The job, as status shows it over TLS.
    let status = paths(&readme(DAEMON_STATUS)).replace("head:29400", &format!("127.0.0.1:{port}"));
    let out = run_all(vec![shell(d, &status)], RUN_DEADLINE).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("job job7"), "{}", text(&out));

    // The durable state is where the README says.
    assert!(d.join("var/lib/rsrun/format").is_file());
    drop(daemon);
}

#[test]
fn static_backend_pair() {
    let _turn = serial();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let small = |c: &str| {
        c.replace("--master-addr head", "--master-addr 127.0.0.1")
            .replace("29500", &port)
            .replace("--nproc-per-node 8", "--nproc-per-node 1")
            .replace(" train", " train --steps 3")
    };
    let outs = run_all(
        vec![shell(dir.path(), &small(&readme(STATIC_1))), shell(dir.path(), &small(&readme(STATIC_0)))],
        RUN_DEADLINE * 3,
    );
    ok(&outs);
    // Node rank 0 runs global rank 0: its launcher shows the summary.
    assert!(text(&outs[1]).contains("summary:"), "{}", text(&outs[1]));
}

#[test]
fn cluster_path_dry_runs() {
    let _turn = serial();
    let dir = tempfile::tempdir().unwrap();
    let run = |cmd: &str| {
        let out = run_all(vec![shell(dir.path(), &readme(cmd))], RUN_DEADLINE).remove(0);
        assert_eq!(code(&out.status), 0, "{cmd}\n{}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(HOSTFILE_WRITE);
    let s = run(HOSTFILE_DRY_RUN);
    for needle in ["  0     node1  2      0-1        0-1          hosts:2", "  1     node2  2      0-1        2-3          hosts:3"] {
        assert!(s.contains(needle), "{needle:?} missing:\n{s}");
    }
    let s = run(HOSTS_INCLUDE_DRY_RUN);
    assert!(s.contains("  0     node1  1      1          0            -H"), "{s}");
    assert!(s.contains("world size 3"), "{s}");
    let s = run(SLURM_DRY_RUN);
    assert!(s.contains("Slurm mode A") && s.contains("node rank = 1 (SLURM_NODEID)") && s.contains("job          : slurm-4242.0.r0"), "{s}");
    // The README: the derived port and the 7 probed after it; the SIGTERM grace below KillWait.
    assert!(s.contains("ports        : 63730..63737") && s.contains("timeouts     : shutdown 25s"), "{s}");
    let s = run(K8S_DRY_RUN);
    assert!(s.contains("Kubernetes") && s.contains("node rank = 1 (PET_NODE_RANK)"), "{s}");
}

#[test]
fn one_command_for_the_whole_job() {
    let _turn = serial();
    let root = workspace();
    // As printed, in the repository root, after the README's first command built the release
    // binaries: two "hosts" through the fake rsh.
    release_build();
    let outs = run_all(vec![shell(&root, &readme(FAKE_RSH_RUN))], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    for r in 0..4 {
        assert!(s.contains(&format!("hello from rank {r} of 4")), "{s}");
    }

    // The ssh form, with the fake rsh standing in for ssh (every "host" is this machine) and a
    // small job: 1 worker per host, 3 steps.
    let dir = tempfile::tempdir().unwrap();
    let rsh = root.join("tests/fake-rsh");
    let cmd = readme(SSH_RUN)
        .replacen("rsrun ", &format!("rsrun --rsh {} --allow-same-host ", rsh.display()), 1)
        .replace("node1:8,node2:8", "node1:1,node2:1")
        .replace("--rdzv-endpoint node1", "--rdzv-endpoint 127.0.0.1:0")
        .replace("--steps 1000", "--steps 3");
    let outs = run_all(vec![shell(dir.path(), &cmd)], RUN_DEADLINE * 3);
    ok(&outs);
    assert!(text(&outs[0]).contains("summary:"), "{}", text(&outs[0]));

    let outs = run_all(vec![shell(dir.path(), &readme(SSH_DRY_RUN))], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    assert!(s.contains("node1") && s.contains("node2") && s.contains("agent --stdin"), "{s}");

    // --check through the fake rsh: one line per host, no worker.
    let check = readme(SSH_CHECK)
        .replacen("rsrun ", &format!("rsrun --rsh {} --allow-same-host ", rsh.display()), 1)
        .replace("node1:8,node2:8", "node1:1,node2:1");
    let outs = run_all(vec![shell(dir.path(), &check)], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    for h in ["node1", "node2"] {
        let line = s.lines().find(|l| l.starts_with(&format!("{h}: ready (ssh): hostname "))).unwrap_or_else(|| panic!("{h}:\n{s}"));
        assert!(line.contains(", 1 worker, ") && line.contains(" GPU") && line.ends_with("/train"), "{line}");
    }
    assert!(text(&outs[0]).contains("all 2 hosts are ready; no worker was started"), "{}", text(&outs[0]));
}

/// `pip install .` from the clone (maturin from PyPI builds the launcher and the rendezvous service),
/// then the installed programs; with torch available, the PyTorch compatibility script runs through
/// the installed `rsrun`.
#[test]
fn pip_install_from_a_clone() {
    let _turn = serial();
    if !have("pip_install_from_a_clone", "python3 with venv", PYTHON_VENV) {
        return;
    }
    let venv = tempfile::tempdir().unwrap();
    let v = venv.path().join("venv");
    let at = |c: &str| readme(c).replace(".venv", &v.display().to_string());
    for cmd in [PIP_VENV, PIP_INSTALL, PIP_VERSIONS] {
        // The wheel's build goes where scripts/test-wheel.sh puts it, not over target/release:
        // its dependency features differ from the workspace's.
        let mut sh = shell(&workspace(), &at(cmd));
        sh.env("CARGO_TARGET_DIR", workspace().join("target/wheel"));
        let out = run_all(vec![sh], Duration::from_secs(1800)).remove(0);
        assert_eq!(code(&out.status), 0, "{cmd}\n{}", text(&out));
    }
    // The installed programs, from anywhere.
    let elsewhere = tempfile::tempdir().unwrap();
    let outs = run_all(vec![shell(elsewhere.path(), &at(PIP_PYTHON_M))], RUN_DEADLINE);
    ok(&outs);
    let s = stdout_of(&outs);
    // Each rank prints its own RANK (the console prefix alone holds both digits).
    assert!(s.lines().any(|l| l == "[rank 0] 0") && s.lines().any(|l| l == "[rank 1] 1"), "{s}");
    if let Some(python) = rsrun_tests::python_with_torch() {
        let script = workspace().join("tests/python/allreduce.py");
        let mut cmd = Command::new(v.join("bin/rsrun"));
        cmd.current_dir(elsewhere.path())
            .env("PYTHON_EXEC", &python)
            .args(["--standalone", "--nproc-per-node", "2"])
            .arg(&script);
        let out = KillOnDrop::spawn(&mut cmd).output_within(RUN_DEADLINE * 3);
        assert_eq!(code(&out.status), 0, "{}", text(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains("allreduce ok rank=1 world=2"), "{}", text(&out));
    }
}

/// Waits until something accepts connections at `127.0.0.1:port`.
fn listens(port: u16) -> bool {
    rsrun_tests::wait_until(Duration::from_secs(30), || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
}

/// The README's highly available group, as printed but on one machine: three etcd members, three
/// daemons, a two-node job through the group, `status`; then the leader is killed and `status`
/// names another one.
#[test]
fn ha_group_over_three_etcd_members() {
    let _turn = serial();
    if rsrun_tests::etcd::require_etcd("ha_group_over_three_etcd_members").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Three members: names, URLs and data directories per member, on free loopback ports.
    let ports: Vec<(u16, u16)> = (0..3).map(|_| (free_port(), free_port())).collect();
    let initial = (0..3).map(|i| format!("e{}=http://127.0.0.1:{}", i + 1, ports[i].1)).collect::<Vec<_>>().join(",");
    let mut etcd = Vec::new();
    for (i, (client, peer)) in ports.iter().enumerate() {
        let cmd = readme(ETCD_MEMBER)
            .replace("e1=http://e1:2380,e2=http://e2:2380,e3=http://e3:2380", &initial)
            .replace("--name e1", &format!("--name e{}", i + 1))
            .replace("http://e1:2379", &format!("http://127.0.0.1:{client}"))
            .replace("http://e1:2380", &format!("http://127.0.0.1:{peer}"))
            .replace("/var/lib/etcd", &d.join(format!("etcd{i}")).display().to_string());
        etcd.push(KillOnDrop::spawn(&mut shell(d, &format!("exec {cmd} 2>{}", d.join(format!("etcd{i}.log")).display()))));
    }
    let etcd_eps = ports.iter().map(|(c, _)| format!("127.0.0.1:{c}")).collect::<Vec<_>>().join(",");
    let put = format!("ETCDCTL_API=3 etcdctl --endpoints={etcd_eps} --command-timeout=2s put /ready 1");
    assert!(
        rsrun_tests::wait_until(Duration::from_secs(30), || shell(d, &put).output().is_ok_and(|o| o.status.success())),
        "the README's etcd members never accepted a write"
    );
    std::fs::create_dir_all(d.join("etc/rsrun")).unwrap();
    std::fs::write(d.join("etc/rsrun/tokens"), "0123456789abcdef0123456789abcdef\n").unwrap();
    // One certificate for the three daemons here: it names 127.0.0.1, where they all advertise.
    tls_files(d);
    let paths = |c: &str| c.replace("/etc/rsrun", &d.join("etc/rsrun").display().to_string());
    // Three daemons on every interface, as printed, each with its own --advertise; the first one
    // started leads.
    let dports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let mut daemons = Vec::new();
    for (i, port) in dports.iter().enumerate() {
        let cmd = paths(&readme(HA_DAEMON))
            .replace("0.0.0.0:29400", &format!("0.0.0.0:{port}"))
            .replace("--advertise h1:29400", &format!("--advertise 127.0.0.1:{port}"))
            .replace("e1:2379,e2:2379,e3:2379", &etcd_eps);
        daemons.push(Some(KillOnDrop::spawn(&mut shell(d, &format!("exec {cmd}")))));
        assert!(listens(*port), "daemon {i} did not listen");
    }
    let group = dports.iter().map(|p| format!("127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    let node = paths(&readme(HA_NODE))
        .replace("h1:29400,h2:29400,h3:29400", &group)
        .replace("--nproc-per-node 8", "--nproc-per-node 1")
        .replace("--steps 1000", "--steps 3");
    let outs = run_all(vec![shell(d, &node), shell(d, &node)], RUN_DEADLINE * 3);
    ok(&outs);
    assert!(text(&outs[0]).contains("summary:") || text(&outs[1]).contains("summary:"), "{}\n{}", text(&outs[0]), text(&outs[1]));
    let status = paths(&readme(HA_STATUS)).replace("h1:29400,h2:29400,h3:29400", &group);
    let out = run_all(vec![shell(d, &status)], RUN_DEADLINE).remove(0);
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(s.starts_with("leader 127.0.0.1:") && s.matches(" standby ").count() == 2 && s.contains("job job8"), "{s}");
    // The leader dies: status names another one.
    let leader = s.split_whitespace().nth(1).unwrap().to_owned();
    let i = dports.iter().position(|p| leader.ends_with(&format!(":{p}"))).expect("the leader is one of the daemons");
    drop(daemons[i].take());
    let out = run_all(vec![shell(d, &status)], RUN_DEADLINE).remove(0);
    let s = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(s.starts_with("leader 127.0.0.1:") && !s.starts_with(&format!("leader {leader} ")), "{s}");
    drop(daemons);
    drop(etcd);
}

/// The README's etcd RBAC recipe and a daemon that logs in as the user it creates.
#[test]
fn ha_etcd_auth_recipe() {
    let _turn = serial();
    let Some(etcd) = rsrun_tests::etcd::EtcdCluster::start("ha_etcd_auth_recipe", 3) else { return };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for f in ["etc/etcd", "etc/rsrun"] {
        std::fs::create_dir_all(d.join(f)).unwrap();
    }
    std::fs::write(d.join("etc/etcd/root-password"), "rootpw\n").unwrap();
    std::fs::write(d.join("etc/rsrun/etcd-password"), "rsrunpw\n").unwrap();
    // What the README takes as done once: a root user and auth on.
    for args in [&["user", "add", "root", "--new-user-password", "rootpw"][..], &["auth", "enable"]] {
        let out = etcd.etcdctl(args);
        assert!(out.status.success(), "etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::write(d.join("etc/rsrun/tokens"), "0123456789abcdef0123456789abcdef\n").unwrap();
    tls_files(d);
    let paths = |c: &str| c.replace("/etc/rsrun", &d.join("etc/rsrun").display().to_string()).replace("/etc/etcd", &d.join("etc/etcd").display().to_string());
    let recipe = [ETCD_ROOT_ENV, ETCD_USER, ETCD_ROLE].iter().map(|c| paths(&readme(c))).collect::<Vec<_>>().join(" && ");
    let mut sh = shell(d, &recipe);
    sh.env("ETCDCTL_API", "3").env("ETCDCTL_ENDPOINTS", etcd.endpoints_csv());
    let out = run_all(vec![sh], RUN_DEADLINE).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let port = free_port();
    let cmd = paths(&readme(HA_DAEMON_AUTH))
        .replace("0.0.0.0:29400", &format!("0.0.0.0:{port}"))
        .replace("--advertise h1:29400", &format!("--advertise 127.0.0.1:{port}"))
        .replace("e1:2379,e2:2379,e3:2379", &etcd.endpoints_csv());
    let daemon = KillOnDrop::spawn(&mut shell(d, &format!("exec {cmd}")));
    assert!(listens(port), "the daemon did not listen");
    let status = format!("rsrun-rendezvous status --endpoint 127.0.0.1:{port} --token-file {} --tls-ca ca.pem", d.join("etc/rsrun/tokens").display());
    let out = run_all(vec![shell(d, &status)], RUN_DEADLINE).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with(&format!("leader 127.0.0.1:{port}")), "{}", text(&out));
    // Its keys are where the role allows, nothing else was written.
    let keys = etcd.etcdctl(&["--user=root:rootpw", "get", "", "--prefix", "--keys-only"]);
    let keys = String::from_utf8_lossy(&keys.stdout).into_owned();
    assert!(keys.lines().filter(|l| !l.is_empty()).all(|k| k.starts_with("/rsrun/") || k == "/rsrun-test/ready"), "{keys}");
    drop(daemon);
}

#[test]
fn performance_against_pytorch() {
    let _turn = serial();
    let Some(py) = rsrun_tests::python_with_torch() else {
        eprintln!("performance_against_pytorch: no python with torch (set RSRUN_TEST_PYTHON); skipped");
        return;
    };
    // As printed, with 6 steps instead of 30 (torch's script drops 3 warm-up steps), two rounds
    // instead of three (enough to check that each side's best round counts), and the test's
    // torch instead of the script's own venv.
    let cmd = readme(BENCH).replace(" 30", " 6");
    let mut c = shell(&workspace(), &cmd);
    c.env("RSRUN_BENCH_PYTHON", &py).env("RSRUN_BENCH_ROUNDS", "2");
    let out = run_all(vec![c], Duration::from_secs(1800)).remove(0);
    let all = text(&out);
    assert_eq!(code(&out.status), 0, "{all}");
    let engine = all.lines().find(|l| l.starts_with("summary: single_tok_ratio_vs_torch=")).unwrap_or_else(|| panic!("{all}"));
    for key in [
        "single_tok_ratio_vs_torch",
        "ddp_tok_ratio_vs_torch",
        "ddp_speedup",
        "pair_speedup",
        "ddp_frac_of_pair",
        "zero3_vs_ddp",
        "fsdp_tok_ratio_vs_torch",
        "mfu",
    ] {
        assert!(number(engine, key) > 0.0, "{key}: {engine}");
    }
    // The collectives' anchor ran too (a gloo failure is said, not a missing section).
    assert!(all.contains("gloo (same run):\nallreduce world=2"), "{all}");
    assert!(engine.contains(" cpu=") && engine.contains(" isa="), "{engine}");
    // Where DDP's step goes: shares of it, waiting in collectives and on the communication thread.
    for key in ["ddp_comm_wait_frac", "ddp_comm_thread_cpu_frac"] {
        let v = number(engine, key);
        assert!((0.0..=1.0).contains(&v), "{key}: {engine}");
    }
    // Two rounds (RSRUN_BENCH_ROUNDS above), and each side's best round is what the ratios compare.
    let rounds: Vec<&str> = all.lines().filter(|l| l.starts_with("round ")).collect();
    assert!(rounds.len() == 2 && rounds[1].starts_with("round 2 of 2,"), "{all}");
    let best = |side: usize| -> f64 {
        let pick = |l: &str| -> f64 {
            let pair = l.split(" single ").nth(1).and_then(|r| r.split(' ').next()).unwrap_or_else(|| panic!("{l}"));
            pair.split('/').nth(side).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{l}"))
        };
        rounds.iter().map(|l| pick(l)).fold(f64::MIN, f64::max)
    };
    let expect = (best(0) / best(1) * 100.0).round() / 100.0;
    assert!((number(engine, "single_tok_ratio_vs_torch") - expect).abs() < 0.011, "best rounds give {expect}: {all}");
    let coll = all.lines().find(|l| l.starts_with("summary: allreduce_frac_of_bound=")).unwrap_or_else(|| panic!("{all}"));
    for key in ["allreduce_frac_of_bound", "reduce_scatter_frac", "all_gather_frac", "tcp_frac_of_loopback", "tcp_frac_of_exchange"] {
        assert!(number(coll, key) > 0.0, "{coll}");
    }
    // Each fraction is the median of five rounds that pair the limit with the op.
    let bounds: Vec<&str> = all.lines().filter(|l| l.starts_with("bound: ")).collect();
    assert!(bounds.len() >= 4, "{all}");
    for l in &bounds {
        let rounds = rsrun_tests::field(l, "paired_rounds").unwrap_or_else(|| panic!("{l}"));
        let mut r: Vec<f64> = rounds.split('/').map(|x| x.parse().unwrap_or_else(|_| panic!("{l}"))).collect();
        assert_eq!(r.len(), 5, "{l}");
        r.sort_by(f64::total_cmp);
        assert!((number(l, "frac") - r[2]).abs() < 0.006, "frac is the median round: {l}");
    }
    // `--isa avx2`, as the README shows it inline: both sides at AVX2+FMA (on an AVX2-only CPU
    // the same as without it), one round of 4 steps.
    let cmd = readme(BENCH).replace(" 30", " --isa avx2 4");
    assert!(cmd.starts_with("scripts/bench-vs-torch.sh --isa avx2 4"), "{cmd}");
    let mut c = shell(&workspace(), &cmd);
    c.env("RSRUN_BENCH_PYTHON", &py).env("RSRUN_BENCH_ROUNDS", "1");
    let out = run_all(vec![c], Duration::from_secs(1800)).remove(0);
    let all = text(&out);
    assert_eq!(code(&out.status), 0, "{all}");
    let engine = all.lines().find(|l| l.starts_with("summary: single_tok_ratio_vs_torch=")).unwrap_or_else(|| panic!("{all}"));
    assert!(number(engine, "single_tok_ratio_vs_torch") > 0.0, "{engine}");
    // A CPU without AVX2+FMA runs the baseline kernels whatever is asked.
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if cpuinfo.contains(" avx2") && cpuinfo.contains(" fma") {
        assert!(engine.ends_with(" isa=avx2"), "{engine}");
    }
}

#[test]
fn gemm_profile_of_the_engine() {
    let _turn = serial();
    release_build();
    // As printed, with 5 steps (2 measured) instead of 12.
    let cmd = readme(GEMM_PROFILE).replace("--steps 12", "--steps 5");
    let out = run_all(vec![shell(&workspace(), &cmd)], RUN_DEADLINE).remove(0);
    let all = text(&out);
    assert_eq!(code(&out.status), 0, "{all}");
    let shapes: Vec<&str> = all.lines().filter(|l| l.starts_with("gemm_profile: ")).collect();
    // The reference GPT: 4 linear products' forward, input and weight gradients, the head's, and
    // attention's blocks; every shape ran at least once per measured step.
    assert!(shapes.len() >= 10, "{all}");
    for l in &shapes {
        assert!(number(l, "calls_per_step") >= 1.0 && number(l, "gflops") > 0.0, "{l}");
    }
    assert!(shapes.iter().any(|l| l.contains("pattern=lower-out")), "attention's causal scores: {all}");
    let total = all.lines().find(|l| l.starts_with("gemm_profile_total: ")).unwrap_or_else(|| panic!("{all}"));
    let share = number(total, "gemm_share_of_step");
    assert!(share > 0.3 && share < 1.5, "{total}");
    assert!(number(total, "kernel_hot_gflops") > 0.0, "{total}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.trim_end().lines().last().is_some_and(|l| l.starts_with("summary: ")), "the summary stays last: {all}");
    // MFU paired with the peak sampled after each step, and against the first peak.
    let summary = stdout.trim_end().lines().last().unwrap_or_default();
    assert!(number(summary, "mfu") > 0.0 && number(summary, "mfu_vs_first_peak") > 0.0, "{summary}");
}

#[test]
fn gpu_smoke_build_and_run() {
    let _turn = serial();
    release_build();
    let outs = run_all(vec![shell(&workspace(), &readme(GPU_BUILD))], Duration::from_secs(3600));
    ok(&outs);
    let out = run_all(vec![shell(&workspace(), &readme(GPU_RUN))], RUN_DEADLINE).remove(0);
    let all = text(&out);
    if std::path::Path::new("/dev/nvidiactl").exists() {
        assert_eq!(code(&out.status), 0, "{all}");
        assert!(all.contains("summary: gpu_smoke=pass") && all.contains("unique_id=rendezvous"), "{all}");
    } else {
        // No GPU here: exit 77 (skipped), the reason named, through rsrun's exit code.
        assert_eq!(code(&out.status), 77, "{all}");
        assert!(all.contains("gpu-smoke: skipped:"), "{all}");
    }
}

/// A `key=number` field of `line`, which must be there.
fn number(line: &str, key: &str) -> f64 {
    let v = rsrun_tests::field(line, key).unwrap_or_else(|| panic!("no {key}= in {line}"));
    v.parse().unwrap_or_else(|_| panic!("{key}={v} is not a number in {line}"))
}

/// The `summary:` lines of a run that must have exited 0 (without rsrun's `[rank N] ` prefix).
fn summaries(out: &Output) -> Vec<String> {
    let all = text(out);
    assert_eq!(code(&out.status), 0, "{all}");
    let unprefixed = |l: &str| l.strip_prefix('[').and_then(|r| Some(r.split_once("] ")?.1.to_owned())).unwrap_or_else(|| l.to_owned());
    let lines: Vec<String> =
        String::from_utf8_lossy(&out.stdout).lines().map(unprefixed).filter(|l| l.starts_with("summary: ")).collect();
    assert!(!lines.is_empty(), "no summary line: {all}");
    lines
}

#[test]
fn torch_venv_script() {
    let _turn = serial();
    let cmd = readme(TORCH_VENV);
    let ci = std::fs::read_to_string(workspace().join(".ci/run")).unwrap();
    assert!(ci.lines().any(|l| l.contains(&cmd)), ".ci/run does not run {cmd:?}:\n{ci}");
    // Making the venv downloads gigabytes, which .ci/run does once before the tests; here the
    // script runs again where it made one, finds torch, and names the same python.
    let made = std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/rsrun-torch-venv/bin/python"));
    let Some(made) = made.filter(|p| rsrun_tests::python_with_torch().is_some_and(|py| &py == p)) else {
        eprintln!("torch_venv_script: the tests' python is not the script's venv (.ci/run makes it); skipped");
        return;
    };
    let out = run_all(vec![shell(&workspace(), &cmd)], RUN_DEADLINE).remove(0);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let last = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().to_owned();
    assert_eq!(Path::new(&last), made, "{}", text(&out));
}

#[test]
fn wheel_check_script() {
    let _turn = serial();
    if !have("wheel_check_script", "python3 with venv", PYTHON_VENV) {
        return;
    }
    // As printed: it builds the wheel and installs it into fresh venvs (PyPI for maturin).
    let out = run_all(vec![shell(&workspace(), &readme(TEST_WHEEL))], Duration::from_secs(3600)).remove(0);
    let all = text(&out);
    assert_eq!(code(&out.status), 0, "{all}");
    assert!(all.contains("test-wheel: PASS") && all.contains("python -m rsrun: both ranks ran"), "{all}");
}

#[test]
fn engine_and_collective_benchmarks_alone() {
    let _turn = serial();
    release_build();
    // As printed, with 4 steps (the first 3 are warm-up) instead of 20.
    let single = run_all(vec![shell(&workspace(), &readme(ENGINE_SINGLE).replace("--steps 20", "--steps 4"))], RUN_DEADLINE).remove(0);
    let line = summaries(&single).pop().unwrap();
    assert!(number(&line, "tok_per_s_total") > 0.0 && number(&line, "mfu") > 0.0, "{line}");
    assert!(text(&single).contains("machine:"), "{}", text(&single));
    let ddp = run_all(vec![shell(&workspace(), &readme(ENGINE_DDP).replace("--steps 20", "--steps 4"))], RUN_DEADLINE).remove(0);
    let line = summaries(&ddp).pop().unwrap();
    assert!(line.contains("strategy=ddp") && line.contains("world=2") && number(&line, "tok_per_s_total") > 0.0, "{line}");
    // Every rank's comm line.
    let all = text(&ddp);
    assert!(all.matches("comm:").count() >= 2, "{all}");
    // As printed: its headline fractions are the 64 MiB ones.
    let coll = run_all(vec![shell(&workspace(), &readme(COLLECTIVES))], RUN_DEADLINE * 3).remove(0);
    let all = text(&coll);
    let line = summaries(&coll).pop().unwrap();
    for key in ["allreduce_frac_of_bound", "reduce_scatter_frac", "all_gather_frac", "memcpy_gbps"] {
        assert!(number(&line, key) > 0.0, "{line}");
    }
    for op in ["all_reduce", "reduce_scatter", "all_gather"] {
        let seen = all.lines().any(|l| l.contains(&format!("op={op} backend=shm ")) && l.contains(" world=2 bytes=67108864 "));
        assert!(seen, "{op}: {all}");
    }
    // The TCP backend's all_reduce, as the README shows it inline (`--backends tcp`, and with
    // `--ops all_reduce` and RSRUN_HUGE_PAGES=0 where the huge-page allocator is compared).
    for env in ["", "RSRUN_HUGE_PAGES=0 "] {
        let cmd = format!("{env}{}", readme(COLLECTIVES).replace("--backends shm", "--backends tcp --ops all_reduce"));
        let tcp = run_all(vec![shell(&workspace(), &cmd)], RUN_DEADLINE * 3).remove(0);
        let all = text(&tcp);
        assert_eq!(code(&tcp.status), 0, "{cmd}\n{all}");
        assert!(all.lines().any(|l| l.contains("op=all_reduce backend=tcp ") && l.contains(" world=2 bytes=67108864 ")), "{cmd}\n{all}");
        let line = summaries(&tcp).pop().unwrap();
        assert!(number(&line, "tcp_frac_of_loopback") > 0.0, "{line}");
    }
}

#[test]
fn launch_and_rendezvous_benchmarks() {
    let _turn = serial();
    release_build();
    // As printed, with 3 single-node runs and 1 eight-node run instead of 21 and 5.
    let out = run_all(vec![shell(&workspace(), &format!("{} --runs 3 --node-runs 1", readme(LAUNCH_BENCH)))], Duration::from_secs(1800)).remove(0);
    let lines = summaries(&out);
    let launch = lines.iter().find(|l| l.starts_with("summary: workers=8 ")).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(number(launch, "launch_ms") > 0.0 && number(launch, "peak_rss_mib") > 0.0, "{launch}");
    let nodes = lines.iter().find(|l| l.starts_with("summary: nodes=8 ")).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(number(nodes, "all_done_ms") > 0.0, "{nodes}");
    // torchrun, the anchor, in the same run where the test has a Python with torch.
    if std::env::var_os("RSRUN_TEST_PYTHON").is_some() {
        for key in ["torchrun_launch_ms", "torchrun_peak_rss_mib", "torchrun_over_rsrun"] {
            assert!(number(launch, key) > 0.0, "{key}: {launch}");
        }
        assert!(number(nodes, "torchrun_all_done_ms") > 0.0, "{nodes}");
    } else if !launch.contains("torchrun_launch_ms=na") {
        // No test Python named, but the bench found scripts/torch-venv.sh's own venv: measured.
        assert!(number(launch, "torchrun_launch_ms") > 0.0, "{launch}");
    }
    // 256 agents instead of 10,000.
    let out = run_all(vec![shell(&workspace(), &readme(RDZV_BENCH).replace("10000", "256"))], RUN_DEADLINE).remove(0);
    let line = summaries(&out).pop().unwrap();
    assert!(line.starts_with("summary: agents=256 ") && number(&line, "round_s") > 0.0 && number(&line, "p99_rpc_ms") > 0.0, "{line}");
    if rsrun_tests::etcd::require_etcd("launch_and_rendezvous_benchmarks --compare-ha").is_none() {
        return;
    }
    let out = run_all(vec![shell(&workspace(), &readme(RDZV_BENCH_HA).replace("1024", "64"))], Duration::from_secs(600)).remove(0);
    let line = summaries(&out).pop().unwrap();
    for key in ["ha_round_s", "data_dir_round_s", "memory_round_s"] {
        assert!(number(&line, key) > 0.0, "{line}");
    }
}

#[test]
fn ha_failover_benchmark() {
    let _turn = serial();
    release_build();
    if rsrun_tests::etcd::require_etcd("ha_failover_benchmark").is_none() {
        return;
    }
    // As printed, with 2 kill -9 trials instead of 50 and one of each other kind instead of 5.
    let cmd = readme(HA_FAILOVER_BENCH).replace("--trials 50", "--trials 2 --sigterm-trials 1 --anchor-trials 1");
    let out = run_all(vec![shell(&workspace(), &cmd)], Duration::from_secs(600)).remove(0);
    let line = summaries(&out).pop().unwrap();
    assert!(line.contains("trials=2") && number(&line, "failover_s_median") > 0.0, "{line}");
    // A kill -9 failover waits for the leader's lease: at least TTL − TTL/3 of the default 5 s.
    assert!(number(&line, "failover_s_max") >= 3.0, "{line}");
}

#[test]
fn tcpstore_benchmark_against_torch() {
    let _turn = serial();
    release_build();
    let Some(py) = rsrun_tests::python_with_torch() else {
        eprintln!("tcpstore_benchmark_against_torch: no python with torch (set RSRUN_TEST_PYTHON); skipped");
        return;
    };
    // As printed, with 1 s of load in 1 round instead of 5 s in 3, 256 connections instead of
    // 10,000, and the tests' torch.
    let cmd = format!("{} --secs 1 --rounds 1 --connections 256 --python {}", readme(TCPSTORE_BENCH), py.display());
    let out = run_all(vec![shell(&workspace(), &cmd)], RUN_DEADLINE * 3).remove(0);
    let lines = summaries(&out);
    let ops = lines.iter().find(|l| l.contains("tcpstore_ops_per_s=")).unwrap_or_else(|| panic!("{lines:?}"));
    for key in ["tcpstore_ops_per_s", "torch_libuv_ops_per_s", "ratio"] {
        assert!(number(ops, key) > 0.0, "{ops}");
    }
    let conns = lines.iter().find(|l| l.starts_with("summary: connections=256 ")).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(number(conns, "connect_s") > 0.0, "{conns}");
}
