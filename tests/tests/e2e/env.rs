//! Environment parity with torchrun (reference §2): every worker gets exactly torchrun's variables,
//! with values an unmodified PyTorch script accepts, plus rsrun's own.

use std::collections::BTreeMap;
use std::path::Path;

use rsrun_tests::{code, rsrun, run, text};

fn read_env(path: &Path) -> BTreeMap<String, String> {
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    raw.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            kv.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned()))
        })
        .collect()
}

const TORCHRUN_VARS: &[&str] = &[
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
];

#[test]
fn worker_environment_matches_torchrun() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .env("RSRUN_TEST_INHERITED", "yes")
        .args(["--standalone", "--nproc-per-node", "3", "--max-restarts", "2", "--role", "trainer"])
        .args(["sh", "-c", "cat /proc/self/environ > env.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let envs: Vec<_> = (0..3).map(|r| read_env(&dir.path().join(format!("env.{r}")))).collect();
    let launcher: BTreeMap<String, String> = std::env::vars().collect();
    let mut ports = Vec::new();
    for (rank, env) in envs.iter().enumerate() {
        for k in TORCHRUN_VARS {
            assert!(env.contains_key(*k), "rank {rank}: {k} missing");
        }
        let get = |k: &str| env.get(k).map(String::as_str).unwrap_or("");
        assert_eq!(get("RANK"), rank.to_string());
        assert_eq!(get("LOCAL_RANK"), rank.to_string());
        assert_eq!(get("ROLE_RANK"), rank.to_string());
        assert_eq!(get("GROUP_RANK"), "0");
        assert_eq!(get("ROLE_NAME"), "trainer");
        assert_eq!(get("LOCAL_WORLD_SIZE"), "3");
        assert_eq!(get("WORLD_SIZE"), "3");
        assert_eq!(get("ROLE_WORLD_SIZE"), "3");
        assert_eq!(get("GROUP_WORLD_SIZE"), "1");
        assert_eq!(get("MASTER_ADDR"), "127.0.0.1");
        assert_eq!(get("TORCHELASTIC_RESTART_COUNT"), "0");
        assert_eq!(get("TORCHELASTIC_MAX_RESTARTS"), "2");
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
        assert_eq!(get("TORCHELASTIC_SIGNALS_TO_HANDLE"), "SIGHUP,SIGINT,SIGQUIT,SIGTERM");
        assert_eq!(get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "1");
        assert_eq!(get("OMP_NUM_THREADS"), "1");
        assert_eq!(get("RSRUN_TEST_INHERITED"), "yes", "the launcher's environment is inherited");
        assert_eq!(get("TORCHELASTIC_RUN_ID"), get("RSRUN_JOB_ID"));
        assert!(get("TORCHELASTIC_RUN_ID").len() >= 16, "standalone run ids are random");
        let error_file = get("TORCHELASTIC_ERROR_FILE");
        assert!(
            error_file.ends_with(&format!("/{rank}/error.json")) && error_file.contains("/attempt_"),
            "error file {error_file}"
        );
        assert!(get("RSRUN_RDZV_ENDPOINT").starts_with("127.0.0.1:"));
        assert!(!get("RSRUN_ROUND").is_empty() && !get("RSRUN_NODE_ID").is_empty());
        assert!(get("RSRUN_PROGRESS_FD").parse::<i32>().is_ok());
        assert!(get("RSRUN_PROGRESS_PEER").parse::<i32>().is_ok_and(|p| p > 1));
        let port: u16 = get("MASTER_PORT").parse().expect("MASTER_PORT is a port");
        assert_ne!(port, 0);
        ports.push(port);
        // Nothing torchrun does not set leaks in: no PET_*, no NODE_RANK/LOCAL_SIZE, and nothing
        // else that is not rsrun's own or inherited.
        for k in env.keys() {
            let allowed = TORCHRUN_VARS.contains(&k.as_str())
                || k.starts_with("RSRUN_")
                || launcher.contains_key(k)
                || k == "PWD"
                || k == "SHLVL"
                || k == "_";
            assert!(allowed, "rank {rank}: unexpected variable {k}");
            assert!(!k.starts_with("PET_"), "rank {rank}: {k}");
        }
        for k in ["NODE_RANK", "LOCAL_SIZE", "CROSS_RANK"] {
            assert!(!env.contains_key(k) || launcher.contains_key(k), "rank {rank}: {k}");
        }
    }
    assert!(ports.windows(2).all(|w| w[0] == w[1]), "one MASTER_PORT for the round: {ports:?}");
    // No token in argv or env (the token travels as a file path only).
    for env in &envs {
        assert!(!env.keys().any(|k| k.contains("TOKEN") && k != "RSRUN_TOKEN_FILE"));
    }
}

#[test]
fn user_omp_num_threads_is_kept_and_single_worker_gets_none() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .env("OMP_NUM_THREADS", "7")
        .args(["--nproc-per-node", "2", "sh", "-c", "cat /proc/self/environ > env.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert_eq!(read_env(&dir.path().join("env.1")).get("OMP_NUM_THREADS").map(String::as_str), Some("7"));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("OMP_NUM_THREADS=1"));
    let out = run(rsrun(dir.path()).args(["sh", "-c", "cat /proc/self/environ > single.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(!read_env(&dir.path().join("single.0")).contains_key("OMP_NUM_THREADS"));
}

#[test]
fn static_backend_hosts_the_rendezvous_at_master_addr_and_port() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let out = run(rsrun(dir.path())
        .args(["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", &port])
        .args(["--nproc-per-node", "2", "sh", "-c", "cat /proc/self/environ > env.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let env = read_env(&dir.path().join("env.1"));
    assert_eq!(env["MASTER_ADDR"], "127.0.0.1");
    // Node rank 0 serves the rendezvous at --master-port, and the round's store there too: the
    // workers' MASTER_PORT is --master-port, as under torchrun.
    assert_eq!(env["RSRUN_RDZV_ENDPOINT"], format!("127.0.0.1:{port}"));
    assert_eq!(env["MASTER_PORT"], port);
    assert_eq!(env["TORCHELASTIC_RUN_ID"], "none");
    assert_eq!((env["RANK"].as_str(), env["WORLD_SIZE"].as_str(), env["GROUP_RANK"].as_str()), ("1", "2", "0"));
}

/// A descriptor rsrun inherited without FD_CLOEXEC (a scheduler's pipe, a shell redirection) does
/// not reach the workers; the progress socket still does.
#[test]
fn inherited_descriptors_do_not_leak_into_workers() {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    const LEAKED: i32 = 57;
    let dir = tempfile::tempdir().unwrap();
    let file = std::fs::File::open("/dev/null").unwrap();
    let raw = file.as_raw_fd();
    let mut cmd = rsrun(dir.path());
    cmd.args(["--nproc-per-node", "2", "sh", "-c", "ls /proc/self/fd > fds.$RANK; echo $RSRUN_PROGRESS_FD > progress.$RANK"]);
    // SAFETY: dup2 is async-signal-safe; the new descriptor has no FD_CLOEXEC, as one a shell or
    // scheduler hands down.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(raw, LEAKED) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = run(&mut cmd);
    drop(file);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..2 {
        let fds: Vec<String> = std::fs::read_to_string(dir.path().join(format!("fds.{rank}"))).unwrap().split_whitespace().map(str::to_owned).collect();
        let progress = std::fs::read_to_string(dir.path().join(format!("progress.{rank}"))).unwrap().trim().to_owned();
        assert!(!fds.contains(&LEAKED.to_string()), "rank {rank} inherited fd {LEAKED}: {fds:?}");
        assert!(fds.contains(&progress), "rank {rank} lost its progress socket {progress}: {fds:?}");
    }
}

/// `rsrun-rendezvous serve --no-tcpstore` (README): the daemon serves no TCPStore, so the store is
/// rank 0's own, as under torchrun: TORCHELASTIC_USE_AGENT_STORE=False and MASTER_ADDR:MASTER_PORT
/// on the node of rank 0 (a port that node reserved), not a port of the daemon's.
#[test]
fn a_daemon_without_tcpstore_leaves_the_store_to_rank_0() {
    let daemon = rsrun_tests::Daemon::start_with("127.0.0.1:0", &[std::ffi::OsStr::new("--no-tcpstore")]);
    let dir = tempfile::tempdir().unwrap();
    let out = run(rsrun(dir.path())
        .args(["--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", &daemon.addr, "--rdzv-id", "no-store"])
        .args(["sh", "-c", "cat /proc/self/environ > env.$RANK"]));
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let daemon_port = daemon.addr.rsplit_once(':').unwrap().1.to_owned();
    for rank in 0..2 {
        let env = read_env(&dir.path().join(format!("env.{rank}")));
        assert_eq!(env["TORCHELASTIC_USE_AGENT_STORE"], "False", "rank {rank}");
        assert_eq!(env["MASTER_ADDR"], "127.0.0.1", "rank {rank}");
        assert_ne!(env["MASTER_PORT"], daemon_port, "rank {rank}");
        assert_eq!(env["RSRUN_RDZV_ENDPOINT"], daemon.addr, "rank {rank}");
    }
}

/// rsrun raises its own open-file limit to the hard one (its node serves the job's PyTorch store:
/// a descriptor per rank) and gives its workers back the soft limit it started with.
#[test]
fn workers_keep_the_open_file_limit_rsrun_raised_for_itself() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = rsrun(dir.path());
    cmd.args(["--standalone", "--nproc-per-node", "2"]).args([
        "sh",
        "-c",
        "ulimit -n > nofile.$RANK; grep 'Max open files' /proc/$PPID/limits > rsrun.$RANK",
    ]);
    let mut hard = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct on our stack.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut hard) }, 0);
    let soft = 256.min(hard.rlim_max);
    // SAFETY: only setrlimit (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit { rlim_cur: soft, rlim_max: hard.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = run(&mut cmd);
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    for rank in 0..2 {
        let worker = std::fs::read_to_string(dir.path().join(format!("nofile.{rank}"))).unwrap();
        assert_eq!(worker.trim(), soft.to_string(), "rank {rank}'s soft limit");
        let line = std::fs::read_to_string(dir.path().join(format!("rsrun.{rank}"))).unwrap();
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "Max open files  SOFT  HARD  files"
        assert_eq!(fields.get(3), fields.get(4), "rsrun's limits: {line}");
        let hard_text = if hard.rlim_max == libc::RLIM_INFINITY { "unlimited".to_owned() } else { hard.rlim_max.to_string() };
        assert_eq!(fields.get(4).copied(), Some(hard_text.as_str()), "rsrun's limits: {line}");
    }
}

/// Runs `cmd` with `input` on a piped stdin (then closed); its output within 60 s.
fn with_input(cmd: &mut std::process::Command, input: &[u8]) -> std::process::Output {
    use std::io::Write;
    cmd.stdin(std::process::Stdio::piped());
    let mut child = rsrun_tests::KillOnDrop::spawn(cmd);
    let mut stdin = child.0.stdin.take().expect("piped stdin");
    stdin.write_all(input).expect("writing the child's stdin");
    drop(stdin);
    child.output_within(std::time::Duration::from_secs(60))
}

/// Workers read rsrun's stdin, as torchrun's do: a pipe, and rsrun's controlling terminal too. A
/// worker in a process group of rsrun's session would be stopped by SIGTTIN reading that terminal
/// in the background (and hang); in a session of its own, as torchrun starts its workers, it reads
/// it. `script` runs rsrun in the foreground of a pseudo-terminal that is its controlling terminal
/// and types what it reads on its own stdin into it; the worker's prompt, a line it leaves
/// unfinished while it waits, is on that terminal before the answer.
#[test]
fn workers_read_rsruns_stdin_a_terminal_included() {
    let dir = tempfile::tempdir().unwrap();
    let worker = ["sh", "-c", "read x; echo \"got:$x\""];
    let out = with_input(rsrun(dir.path()).args(["--standalone", "--nproc-per-node", "1"]).args(worker), b"over a pipe\n");
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("got:over a pipe"), "{}", text(&out));

    let have_script = std::process::Command::new("script").arg("--version").output().is_ok_and(|o| o.status.success());
    if !have_script {
        assert!(std::env::var_os("RSRUN_TEST_REQUIRE_TOOLS").is_none(), "script (util-linux) is missing, and RSRUN_TEST_REQUIRE_TOOLS is set");
        eprintln!("script (util-linux) is missing: the terminal half is skipped");
        return;
    }
    let base = rsrun(dir.path());
    let script = || {
        let mut cmd = std::process::Command::new("script");
        // `script` runs the line with $SHELL.
        cmd.current_dir(dir.path()).env("SHELL", "/bin/sh");
        for (k, v) in base.get_envs() {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        cmd
    };
    let line = format!(
        "'{}' --standalone --nproc-per-node 1 sh -c 'printf \"name? \"; sleep 1; read x; echo \"got:$x\"; cut -d\" \" -f6 /proc/$$/stat > sid; cut -d\" \" -f6 /proc/$PPID/stat > rsrun.sid'",
        base.get_program().to_string_lossy()
    );
    let terminal_line = format!(
        "stty -g > stty.before; '{}' --standalone --nproc-per-node 1 sh -c 'stty -echo; stty -a > stty.worker; exit 3'; echo rsrun=$?; stty -g > stty.after",
        base.get_program().to_string_lossy()
    );
    let out = with_input(script().args(["-qec", &line, "/dev/null"]), b"typed\n");
    assert_eq!(code(&out.status), 0, "{}", text(&out));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(shown.contains("name? got:typed"), "{}", text(&out));
    // The prompt, a line that stayed unfinished, was drawn in place before the answer came.
    assert!(shown.contains("[rank 0] name? \x1b[?7h"), "{}", text(&out));
    let sid = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap_or_else(|e| panic!("{f}: {e}")).trim().to_owned();
    assert_ne!(sid("sid"), sid("rsrun.sid"), "the worker runs in a session of its own");

    // A worker that turned the terminal's echo off and failed with it off: rsrun puts the
    // settings back as it found them when it ends.
    let out = with_input(script().args(["-qec", &terminal_line, "/dev/null"]), b"");
    assert!(String::from_utf8_lossy(&out.stdout).contains("rsrun=3"), "{}", text(&out));
    let flags = |f: &str| -> Vec<String> { sid(f).split_whitespace().map(|w| w.trim_end_matches(';').to_owned()).collect() };
    assert!(flags("stty.worker").contains(&"-echo".to_owned()), "the worker turned echo off: {:?}", flags("stty.worker"));
    assert_eq!(sid("stty.after"), sid("stty.before"), "the terminal's settings after rsrun are those before it");
}
