//! Which variables travel to the hosts, and with which values (the forwarding policy).
//!
//! The forwarded set is built in this order, later sources overriding earlier ones:
//! 1. by default, variables of this environment with a known prefix ([`PREFIXES`]: `NCCL_`,
//!    `TORCH_`, `CUDA_` but not `CUDA_VISIBLE_DEVICES`, ...) or name ([`NAMES`]: `PATH`,
//!    `LD_LIBRARY_PATH`, ...); with `--export-all`, every variable except [`EXCLUDED`];
//! 2. `KEY=VALUE` lines of `~/.rsrun_env`, then `./.rsrun_env` (like DeepSpeed's `.deepspeed_env`);
//! 3. `--env-file FILE`, in order;
//! 4. `-x NAME` (this environment's value) and `-x NAME=VALUE`, in order.
//!
//! Values are literal: they travel inside the `NodeLaunch` message and no shell ever parses them, so
//! quotes, `$(...)`, newlines and long values arrive byte-exact. Files are dotenv without expansion:
//! `KEY=VALUE`, `#` comment lines, blank lines; the value is everything after the first `=`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::plan::PlanError;

/// Prefixes forwarded by default.
pub const PREFIXES: &[&str] =
    &["NCCL_", "TORCH_", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "UCX_", "FI_", "HF_", "WANDB_", "MLFLOW_", "PYTHON", "RSRUN_"];
/// Names forwarded by default.
pub const NAMES: &[&str] = &["PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX"];
/// Never forwarded by `--export-all` (or the prefixes): they describe this shell, this host or this
/// launcher, not the job. Entries ending in `*` are prefixes.
pub const EXCLUDED: &[&str] = &[
    "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "SSH_*", "DISPLAY", "TERM", "BASH_FUNC_*", "CUDA_VISIBLE_DEVICES",
    // Directories of this machine's login session: the agent's private directory (its token file)
    // goes in TMPDIR.
    "TMPDIR", "XDG_RUNTIME_DIR",
    "SLURM_*", "KUBERNETES_*", "PET_*",
    // This launcher's own multi-node settings: an agent must never take itself for a head.
    "RSRUN_HOSTS", "RSRUN_HOSTFILE", "RSRUN_RSH", "RSRUN_SSH_*", "RSRUN_REMOTE_RSRUN", "RSRUN_TOKEN_FILE",
    // The head's own options, which an agent's rsrun would read as its own (a requeue runner on
    // every host, a --check that starts nothing, a cwd note): the head passes on what applies.
    "RSRUN_REQUEUE_ON_PREEMPT", "RSRUN_CHDIR", "RSRUN_INCLUDE", "RSRUN_EXCLUDE", "RSRUN_CHECK", "RSRUN_ALLOW_SAME_HOST",
    // Marks of the launches this head runs under, which mean nothing on another host.
    "RSRUN_LAUNCH_MARKS",
];
/// The per-host environment file, read from the home directory and then the current directory.
pub const ENV_FILE_NAME: &str = ".rsrun_env";
/// Longest `NAME=VALUE` string Linux accepts in an environment (MAX_ARG_STRLEN, 32 pages, minus the
/// terminating NUL): a longer one makes every exec of a worker fail with "Argument list too long".
pub const MAX_ENV_STRING: usize = 32 * 4096 - 1;

/// The forwarded variables and where each came from (for `--dry-run`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardedEnv {
    /// Name → value.
    pub vars: BTreeMap<String, Vec<u8>>,
    /// Name → source (`environment`, `--export-all`, `FILE:LINE`, `-x`).
    pub sources: BTreeMap<String, String>,
}

impl ForwardedEnv {
    fn set(&mut self, name: &str, value: &[u8], source: String) {
        self.vars.insert(name.to_owned(), value.to_vec());
        self.sources.insert(name.to_owned(), source);
    }
}

fn excluded(name: &str) -> bool {
    EXCLUDED.iter().any(|e| match e.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => name == *e,
    })
}

fn forwarded_by_default(name: &str) -> bool {
    !excluded(name) && (NAMES.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p)))
}

/// A name an environment can hold.
fn check_name(name: &str, flag: &'static str, entry: &str) -> Result<(), PlanError> {
    if name.is_empty() || name.contains('=') || name.contains('\0') || name.contains(char::is_whitespace) {
        return Err(PlanError::Invalid {
            flag,
            value: entry.to_owned(),
            expected: "NAME or NAME=VALUE with a non-empty NAME without '=' or spaces".into(),
        });
    }
    Ok(())
}

/// What the forwarding depends on.
#[derive(Debug, Clone, Copy)]
pub struct EnvSources<'a> {
    /// This launcher's environment.
    pub env: &'a HashMap<String, String>,
    /// `--export-all`.
    pub export_all: bool,
    /// `-x` entries, in order.
    pub exports: &'a [String],
    /// `--env-file` paths (already absolute), in order.
    pub env_files: &'a [std::path::PathBuf],
    /// The home directory (for `~/.rsrun_env`), if known.
    pub home: Option<&'a Path>,
    /// The current directory (for `./.rsrun_env`).
    pub cwd: &'a Path,
}

/// Builds the forwarded set (see the module docs).
///
/// # Errors
/// An unreadable `--env-file`, a malformed line (naming file and line), `-x NAME` for a variable
/// that is not set, or a value too long for any process environment.
pub fn forwarded_env(src: EnvSources<'_>) -> Result<ForwardedEnv, PlanError> {
    let mut out = ForwardedEnv::default();
    let mut names: Vec<&String> = src.env.keys().collect();
    names.sort();
    for name in names {
        if (src.export_all && !excluded(name)) || forwarded_by_default(name) {
            let source = if src.export_all { "--export-all" } else { "environment" };
            out.set(name, src.env[name].as_bytes(), source.to_owned());
        }
    }
    let mut files: Vec<(std::path::PathBuf, bool)> = Vec::new();
    if let Some(home) = src.home {
        files.push((home.join(ENV_FILE_NAME), false));
    }
    let local = src.cwd.join(ENV_FILE_NAME);
    if src.home.is_none_or(|h| h != src.cwd) {
        files.push((local, false));
    }
    files.extend(src.env_files.iter().map(|p| (p.clone(), true)));
    for (path, required) in files {
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(PlanError::Invalid {
                    flag: "--env-file",
                    value: path.display().to_string(),
                    expected: format!("a readable file ({e})"),
                });
            }
        };
        read_env_file(&text, &path, &mut out)?;
    }
    for entry in src.exports {
        match entry.split_once('=') {
            Some((name, value)) => {
                check_name(name, "-x/--export", entry)?;
                out.set(name, value.as_bytes(), "-x".into());
            }
            None => {
                check_name(entry, "-x/--export", entry)?;
                let Some(value) = src.env.get(entry) else {
                    return Err(PlanError::Conflict(format!(
                        "-x {entry}: {entry} is not set in this environment (use -x {entry}=VALUE)"
                    )));
                };
                out.set(entry, value.as_bytes(), "-x".into());
            }
        }
    }
    for (name, value) in &out.vars {
        if value.contains(&0) {
            return Err(PlanError::Conflict(format!("{name} ({}): a value cannot contain a NUL byte", out.sources[name])));
        }
        let len = name.len() + 1 + value.len();
        if len > MAX_ENV_STRING {
            return Err(PlanError::Conflict(format!(
                "{name} ({}): NAME=VALUE is {len} bytes, but Linux limits one environment string to {MAX_ENV_STRING} bytes (MAX_ARG_STRLEN): no worker could start with it; pass it in a file instead",
                out.sources[name]
            )));
        }
    }
    Ok(out)
}

fn read_env_file(text: &[u8], path: &Path, out: &mut ForwardedEnv) -> Result<(), PlanError> {
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        let trimmed = line.trim_ascii_start();
        if trimmed.is_empty() || trimmed.starts_with(b"#") {
            continue;
        }
        let at = format!("{}:{}", path.display(), i + 1);
        let Some(eq) = trimmed.iter().position(|&b| b == b'=') else {
            return Err(PlanError::Invalid {
                flag: "--env-file",
                value: format!("{at}: {}", String::from_utf8_lossy(trimmed)),
                expected: "KEY=VALUE lines, # comments and blank lines".into(),
            });
        };
        let name = std::str::from_utf8(&trimmed[..eq]).map(str::trim_end).unwrap_or("");
        check_name(name, "--env-file", &format!("{at}: {}", String::from_utf8_lossy(trimmed)))?;
        out.set(name, &trimmed[eq + 1..], at);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn sources<'a>(e: &'a HashMap<String, String>, cwd: &'a Path) -> EnvSources<'a> {
        EnvSources { env: e, export_all: false, exports: &[], env_files: &[], home: None, cwd }
    }

    #[test]
    fn default_set_prefixes_and_names() {
        let dir = tempfile::tempdir().unwrap();
        let e = env(&[
            ("PATH", "/bin"), ("NCCL_DEBUG", "INFO"), ("CUDA_HOME", "/cuda"), ("CUDA_VISIBLE_DEVICES", "0"),
            ("HOME", "/root"), ("RSRUN_LOG", "debug"), ("RSRUN_HOSTS", "a:1"), ("SSH_AUTH_SOCK", "/x"),
        ]);
        let f = forwarded_env(sources(&e, dir.path())).unwrap();
        assert_eq!(f.vars.keys().collect::<Vec<_>>(), ["CUDA_HOME", "NCCL_DEBUG", "PATH", "RSRUN_LOG"]);
        let mut s = sources(&e, dir.path());
        s.export_all = true;
        let f = forwarded_env(s).unwrap();
        assert!(f.vars.contains_key("HOME"));
        assert!(!f.vars.contains_key("SSH_AUTH_SOCK") && !f.vars.contains_key("CUDA_VISIBLE_DEVICES"));
        assert!(!f.vars.contains_key("RSRUN_HOSTS"));
    }

    /// `--export-all` does not send this machine's session directories: the head's TMPDIR need not
    /// exist on a host, and the agent writes its token file there.
    #[test]
    fn export_all_keeps_session_directories_home() {
        let dir = tempfile::tempdir().unwrap();
        let e = env(&[("TMPDIR", "/tmp/user-1000"), ("XDG_RUNTIME_DIR", "/run/user/1000"), ("LANG", "C.UTF-8")]);
        let f = forwarded_env(EnvSources { export_all: true, ..sources(&e, dir.path()) }).unwrap();
        assert_eq!(f.vars.keys().collect::<Vec<_>>(), ["LANG"]);
        // Named with -x, it goes.
        let exports = vec!["TMPDIR".to_owned()];
        let f = forwarded_env(EnvSources { export_all: true, exports: &exports, ..sources(&e, dir.path()) }).unwrap();
        assert!(f.vars.contains_key("TMPDIR"));
    }

    #[test]
    fn files_then_exports_override_and_stay_literal() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(ENV_FILE_NAME), "# c\n\nA=from-local\nQ=a \"b\" $(id)\n").unwrap();
        let extra = dir.path().join("extra.env");
        std::fs::write(&extra, "A=from-file\r\nB= spaced = kept \n").unwrap();
        let e = env(&[("NL", "x\ny")]);
        let exports = vec!["NL".to_owned(), "C=$HOME".to_owned()];
        let files = vec![extra.clone()];
        let s = EnvSources { exports: &exports, env_files: &files, ..sources(&e, dir.path()) };
        let f = forwarded_env(s).unwrap();
        let get = |k: &str| String::from_utf8(f.vars[k].clone()).unwrap();
        assert_eq!(get("A"), "from-file");
        assert_eq!(get("B"), " spaced = kept ");
        assert_eq!(get("Q"), "a \"b\" $(id)");
        assert_eq!(get("NL"), "x\ny");
        assert_eq!(get("C"), "$HOME");
        assert_eq!(f.sources["A"], format!("{}:1", extra.display()));
    }

    #[test]
    fn errors_name_the_value() {
        let dir = tempfile::tempdir().unwrap();
        let e = env(&[]);
        let exports = vec!["MISSING".to_owned()];
        let err = forwarded_env(EnvSources { exports: &exports, ..sources(&e, dir.path()) }).unwrap_err().to_string();
        assert!(err.contains("-x MISSING: MISSING is not set"), "{err}");
        let bad = dir.path().join("bad.env");
        std::fs::write(&bad, "OK=1\nnot a pair\n").unwrap();
        let files = vec![bad];
        let err = forwarded_env(EnvSources { env_files: &files, ..sources(&e, dir.path()) }).unwrap_err().to_string();
        assert!(err.contains("bad.env:2: not a pair"), "{err}");
        let exports = vec![format!("BIG={}", "x".repeat(MAX_ENV_STRING))];
        let err = forwarded_env(EnvSources { exports: &exports, ..sources(&e, dir.path()) }).unwrap_err().to_string();
        assert!(err.contains("BIG (-x): NAME=VALUE is") && err.contains("MAX_ARG_STRLEN"), "{err}");
    }
}
