//! The resolved, validated launch plan: the second phase of configuration.
//!
//! [`LaunchPlan::resolve`] turns [`LaunchArgs`] plus a snapshot of the host ([`HostInfo`]: environment,
//! usable CPUs, NUMA nodes, GPUs) into a [`LaunchPlan`]. Every user error is found here, before any
//! process starts, and reported as a [`PlanError`] naming the flag, the bad value and what was expected
//! (the binary exits 2 on it).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cli::LaunchArgs;
use crate::multinode::{self, HostTable, LaunchMode, Source, Sourced, TaskRanks};
use crate::signals::SignalPolicy;
use crate::topology::{self, BindMode, PciGpu, Roots, Topology};

pub use crate::topology::parse_cpu_list;

/// The default port of the rendezvous daemon (torchrun's c10d default).
pub const DEFAULT_RDZV_PORT: u16 = 29400;
/// The static backend's default MASTER_PORT (torchrun's).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// A user error in the command line or the `PET_*` environment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A flag's value is malformed or out of range.
    #[error("invalid value '{value}' for {flag}: expected {expected}")]
    Invalid {
        /// The flag, e.g. `--nnodes`.
        flag: &'static str,
        /// What the user gave.
        value: String,
        /// What is accepted.
        expected: String,
    },
    /// Flags that cannot be used together, or a missing requirement.
    #[error("{0}")]
    Conflict(String),
    /// The program cannot be found or run.
    #[error("{0}")]
    Program(String),
    /// A hostfile, host list, `--include`/`--exclude`, Slurm or Kubernetes problem; the message is
    /// complete (multinode.md §1.5).
    #[error("{0}")]
    Hosts(String),
    /// A malformed hostlist expression (`n[3-1]`): the token and why.
    #[error("invalid hostlist \"{list}\": {reason}")]
    Hostlist {
        /// The offending token.
        list: String,
        /// Why it is wrong.
        reason: String,
    },
    /// An error found at a place: `hostfile ./hosts:3`, `-H "w1,w2:4"`, `SLURM_STEP_NODELIST=...`.
    #[error("{place}: {error}")]
    At {
        /// Where.
        place: String,
        /// What.
        error: Box<PlanError>,
    },
}

/// A configuration problem that only shows once the node runs: the rendezvous refuses this job (it
/// serves another job, or the token is not accepted), node rank 0's name resolves to a loopback
/// address. Like a [`PlanError`], rsrun exits 2 (the job could not start), where infrastructure
/// failures exit 1.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StartError(pub String);

impl StartError {
    /// Whether `err` (or what it wraps) is a [`StartError`].
    pub fn is_in(err: &anyhow::Error) -> bool {
        err.chain().any(|e| e.is::<StartError>())
    }
}

fn invalid(flag: &'static str, value: &str, expected: impl Into<String>) -> PlanError {
    PlanError::Invalid { flag, value: value.to_owned(), expected: expected.into() }
}

/// A rendezvous endpoint on port 0 (a free port picked at start) is for a single node: the other
/// nodes could never find that port. `flag` is where `value` came from.
pub(crate) fn port_zero_only_alone(endpoint: &Endpoint, nodes: NodeRange, flag: &'static str, value: &str) -> Result<(), PlanError> {
    if endpoint.port == 0 && nodes.max > 1 {
        return Err(invalid(flag, value, "a fixed port (port 0 only works for a single node)"));
    }
    Ok(())
}

/// What the launcher needs to know about the machine it runs on. [`HostInfo::probe`] reads the real
/// one; tests build their own.
#[derive(Debug, Clone)]
pub struct HostInfo {
    /// The launcher's environment (workers inherit it).
    pub env: HashMap<String, String>,
    /// The current directory (default log directory base, relative program paths).
    pub cwd: PathBuf,
    /// CPUs this process may run on (sched_getaffinity), ascending.
    pub cpus: Vec<usize>,
    /// Where each of `cpus` sits and where the GPUs are (`--cpu-bind`, `--numa-binding`), read
    /// on first use.
    pub placement: Placement,
    /// Number of NVIDIA GPUs visible (CUDA_VISIBLE_DEVICES, else /proc/driver/nvidia/gpus).
    pub gpus: u32,
    /// This host's name.
    pub hostname: String,
    /// The directory of this rsrun's executable (a venv's `bin/` when pip installed it there).
    pub exe_dir: Option<PathBuf>,
}

/// The host's CPU topology (SMT core, package, NUMA node and L3 domain of each usable CPU), its
/// NVIDIA GPUs in PCI bus order with their NUMA nodes, and what tells which of them CUDA numbers.
/// Read from sysfs, procfs and `/dev` on first use only: a few files per core, which only
/// `--cpu-bind` and `--numa-binding` need (a launch without them reads none).
#[derive(Debug, Clone)]
pub struct Placement {
    /// Where to read them, and the usable CPUs; `None` for a placement given whole.
    source: Option<(Roots, Vec<usize>)>,
    cell: std::sync::OnceLock<Probed>,
}

/// What [`Placement`] reads.
#[derive(Debug, Clone, Default)]
pub struct Probed {
    /// Where each usable CPU sits.
    pub topology: Topology,
    /// The driver's GPUs in PCI bus order (`None`: the driver's list cannot be read).
    pub pci_gpus: Option<Vec<PciGpu>>,
    /// How many `/dev/nvidiaN` device nodes this process sees (`None`: not read).
    pub dev_nodes: Option<usize>,
    /// How many CPUs the host has online (`None`: not read).
    pub online_cpus: Option<usize>,
}

impl Placement {
    /// Read from `roots` when first needed, for the usable `cpus`.
    pub fn probe(roots: Roots, cpus: Vec<usize>) -> Placement {
        Placement { source: Some((roots, cpus)), cell: std::sync::OnceLock::new() }
    }

    /// A placement known already (tests, a host described by hand): its topology and GPUs, nothing
    /// more.
    pub fn known(topology: Topology, pci_gpus: Option<Vec<PciGpu>>) -> Placement {
        Placement::known_probed(Probed { topology, pci_gpus, dev_nodes: None, online_cpus: None })
    }

    /// A placement known already, whole.
    pub fn known_probed(probed: Probed) -> Placement {
        Placement { source: None, cell: std::sync::OnceLock::from(probed) }
    }

    /// What was read, read now if it was not yet.
    pub fn get(&self) -> &Probed {
        self.cell.get_or_init(|| match &self.source {
            Some((roots, cpus)) => Probed {
                topology: topology::read_topology(&roots.sys, cpus),
                pci_gpus: topology::read_pci_gpus(roots),
                dev_nodes: topology::count_dev_nodes(&roots.dev),
                online_cpus: topology::read_online_cpus(&roots.sys),
            },
            // `known` fills the cell: only an empty host reaches this.
            None => Probed { topology: topology::read_topology(Path::new("/nonexistent"), &[]), ..Probed::default() },
        })
    }
}

impl HostInfo {
    /// Reads the real host.
    pub fn probe() -> Self {
        let env = unicode_env(std::env::vars_os());
        let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        let cpus = crate::worker::allowed_cpus();
        let placement = Placement::probe(Roots::real(), cpus.clone());
        let gpus = count_gpus(&env);
        let hostname = hostname::get()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_owned());
        let exe_dir = std::env::current_exe().ok().and_then(|p| p.parent().map(Path::to_path_buf));
        HostInfo { env, cwd, cpus, placement, gpus, hostname, exe_dir }
    }

    fn var(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str)
    }
}

/// The variables of `vars` whose name and value are Unicode. The others (a value in Latin-1, which
/// an `--env-file` forwards byte-exact) are left out here, where a `String` is needed; the process
/// environment still holds them, and workers inherit them as they are.
fn unicode_env(vars: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>) -> HashMap<String, String> {
    vars.filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))).collect()
}

fn count_gpus(env: &HashMap<String, String>) -> u32 {
    // The driver's list of the machine's GPUs; `None` where it cannot be read (no driver, or a
    // sandbox that hides it).
    let physical = std::fs::read_dir("/proc/driver/nvidia/gpus").ok().map(|d| d.count() as u32);
    visible_gpus(env.get("CUDA_VISIBLE_DEVICES").map(String::as_str), physical)
}

/// The GPUs a process sees, as the CUDA runtime counts them: `CUDA_VISIBLE_DEVICES` up to its
/// first entry that names no device (empty, `-1`, an index past the machine's), and never more
/// than the machine has when that is known (a list on a machine without a driver is no GPU).
fn visible_gpus(list: Option<&str>, physical: Option<u32>) -> u32 {
    let Some(list) = list else { return physical.unwrap_or(0) };
    let valid = |s: &str| match s.parse::<u32>() {
        Ok(i) => physical.is_none_or(|n| i < n),
        // UUIDs (GPU-..., MIG-...) name devices too.
        Err(_) => !s.is_empty() && !s.starts_with('-'),
    };
    let n = list.split(',').map(str::trim).take_while(|s| valid(s)).count() as u32;
    physical.map_or(n, |p| n.min(p))
}

/// `MIN:MAX` nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// The round forms once this many nodes joined (after the last-call wait).
    pub min: u32,
    /// The round forms at once when this many joined.
    pub max: u32,
}

impl NodeRange {
    /// Parses `N` or `MIN:MAX` with `0 < MIN <= MAX`.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(s: &str) -> Result<Self, PlanError> {
        const EXPECTED: &str = "N or MIN:MAX with 0 < MIN <= MAX";
        let bad = || invalid("--nnodes", s, EXPECTED);
        let (min, max) = match s.trim().split_once(':') {
            Some((a, b)) => (a.trim().parse::<u32>().map_err(|_| bad())?, b.trim().parse::<u32>().map_err(|_| bad())?),
            None => {
                let n = s.trim().parse::<u32>().map_err(|_| bad())?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(bad());
        }
        Ok(NodeRange { min, max })
    }

    /// Whether the job is elastic (MIN < MAX).
    pub fn is_elastic(&self) -> bool {
        self.min < self.max
    }
}

impl fmt::Display for NodeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max { write!(f, "{}", self.min) } else { write!(f, "{}:{}", self.min, self.max) }
    }
}

/// A `HOST:PORT` endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// Port; 0 means "any free port" (single-node only).
    pub port: u16,
}

impl Endpoint {
    /// Parses `host`, `host:port`, `[v6]` or `[v6]:port`; the port defaults to `default_port`.
    ///
    /// # Errors
    /// An empty host, a bad port, or unbalanced brackets.
    pub fn parse(s: &str, flag: &'static str, default_port: u16) -> Result<Self, PlanError> {
        let expected = "HOST[:PORT] (IPv6 as [ADDR]:PORT) with PORT in 0..65535";
        let bad = || invalid(flag, s, expected);
        let s_trim = s.trim();
        let (host, port) = if let Some(rest) = s_trim.strip_prefix('[') {
            let (host, after) = rest.split_once(']').ok_or_else(bad)?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(bad)?),
            };
            (host, port)
        } else {
            match s_trim.rsplit_once(':') {
                // A bare IPv6 literal without brackets: no port.
                Some((h, _)) if h.contains(':') => (s_trim, None),
                Some((h, p)) => (h, Some(p)),
                None => (s_trim, None),
            }
        };
        if !plausible_host(host) {
            return Err(bad());
        }
        let port = match port {
            Some(p) => p.parse::<u16>().map_err(|_| bad())?,
            None => default_port,
        };
        Ok(Endpoint { host: host.to_owned(), port })
    }
}

/// Whether per-rank logs can be written under `dir`: it is a writable directory, or its nearest
/// existing ancestor is (the directories are made at start).
fn check_log_dir(dir: &Path, given: bool) -> Result<(), PlanError> {
    let value = dir.display().to_string();
    let expected = |why: String| {
        let hint = if given { "" } else { " (the default; give --log-dir DIR, or --log-dir /dev/null for none)" };
        invalid("--log-dir", &value, format!("a directory this user can write{hint}: {why}"))
    };
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(m) if m.is_dir() => {
                return nix::unistd::access(at, nix::unistd::AccessFlags::W_OK | nix::unistd::AccessFlags::X_OK)
                    .map_err(|e| expected(format!("{} is not writable ({e})", at.display())));
            }
            Ok(_) => return Err(expected(format!("{} is not a directory", at.display()))),
            Err(_) => match at.parent() {
                Some(parent) => at = parent,
                None => return Ok(()),
            },
        }
    }
}

/// `.rsrun/logs` under the current directory; where that cannot be written (a read-only root
/// file system in a container), `rsrun-UID/logs` in the temporary directory (`TMPDIR`, else
/// `/tmp`), as torchrun falls back to a fresh temporary directory, said in a note. The error names
/// the current directory's problem when neither can be written, or when `rsrun-UID` is not a
/// directory of this user's own (another user's, or a symbolic link, in a shared `/tmp`).
fn default_log_dir(host: &HostInfo, notes: &mut Vec<String>) -> Result<PathBuf, PlanError> {
    let dir = host.cwd.join(".rsrun").join("logs");
    let Err(e) = check_log_dir(&dir, false) else { return Ok(dir) };
    // SAFETY: getuid(2) cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    let base = PathBuf::from(host.var("TMPDIR").filter(|t| t.starts_with('/')).unwrap_or("/tmp")).join(format!("rsrun-{uid}"));
    // Made now, this user's only (0700), and checked after: in a shared /tmp another user could
    // otherwise plant it (or a link by its name) before the first worker's logs go there.
    {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&base);
    }
    let own_dir = |m: &std::fs::Metadata| m.is_dir() && std::os::unix::fs::MetadataExt::uid(m) == uid;
    // An own directory an earlier rsrun made with the umask's mode (0755) is closed up first.
    if let Ok(m) = std::fs::symlink_metadata(&base)
        && own_dir(&m)
        && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o077 != 0
    {
        let _ = std::fs::set_permissions(&base, std::os::unix::fs::PermissionsExt::from_mode(0o700));
    }
    let ours = std::fs::symlink_metadata(&base)
        .is_ok_and(|m| own_dir(&m) && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o077 == 0);
    let tmp = base.join("logs");
    if !ours || check_log_dir(&tmp, false).is_err() {
        return Err(e);
    }
    notes.push(format!("{} cannot hold the logs ({e}): they go to {} (give --log-dir DIR to choose)", dir.display(), tmp.display()));
    Ok(tmp)
}

/// A host name or address a resolver could take: not empty, no whitespace, no `/`.
pub(crate) fn plausible_host(host: &str) -> bool {
    !host.is_empty() && !host.contains(char::is_whitespace) && !host.contains('/')
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// The endpoints of a group, comma-separated (as `--rdzv-endpoint` takes them).
pub fn endpoint_list(endpoints: &[Endpoint]) -> String {
    endpoints.iter().map(Endpoint::to_string).collect::<Vec<_>>().join(",")
}

/// How this node finds its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RdzvPlan {
    /// An in-memory rendezvous inside this launcher on a loopback ephemeral port (`--standalone`, or
    /// torchrun's implicit single-node mode).
    Standalone,
    /// The rsrun-rendezvous daemon at `endpoint`.
    Daemon {
        /// Where the daemon listens.
        endpoint: Endpoint,
        /// Host an embedded service if the endpoint is this host and nothing listens there.
        host: HostMode,
    },
    /// A highly available group of rsrun-rendezvous daemons (`--rdzv-endpoint h1:29400,h2:29400`,
    /// daemons started with `--etcd-endpoints`): the client follows the leader and rides through a
    /// failover. Never hosted by a launcher.
    Group {
        /// Every daemon of the group, as given.
        endpoints: Vec<Endpoint>,
    },
    /// torchrun's static backend: fixed node ranks, no elasticity. Node rank 0 hosts the rendezvous
    /// at `master_addr:master_port`; the others join it, and duplicate or missing node ranks are
    /// errors.
    Static {
        /// This node's rank (`--node-rank`).
        node_rank: u32,
        /// Where node rank 0 hosts the rendezvous (`--master-addr`, or the endpoint's host).
        master_addr: String,
        /// Its port (`--master-port`, or the endpoint's port).
        master_port: u16,
    },
}

/// Whether this launcher hosts the rendezvous service itself (torchrun's `is_host`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostMode {
    /// Host one when the endpoint is a local address and nothing listens there.
    Auto,
    /// Always host one (`is_host=true`).
    Always,
    /// Never host one (`is_host=false`).
    Never,
}

/// How the program is run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgramKind {
    /// `python -u SCRIPT ARGS`.
    PythonScript,
    /// `python -u -m MODULE ARGS`.
    PythonModule,
    /// `PROGRAM ARGS`.
    Executable,
}

/// The worker command line, before `${local_rank}` substitution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramPlan {
    /// How it runs.
    pub kind: ProgramKind,
    /// What is exec'd: the interpreter or the resolved executable.
    pub exe: PathBuf,
    /// Arguments before the user's (`-u [-m] script`).
    pub lead_args: Vec<String>,
    /// The user's arguments, unsubstituted.
    pub args: Vec<String>,
    /// The program as the user named it (for messages).
    pub name: String,
}

impl ProgramPlan {
    /// argv\[1..\] for the worker with `local_rank`: the user's arguments go through torchrun's
    /// substitution of `$local_rank` / `${local_rank}` ([`substitute_local_rank`]).
    pub fn argv(&self, local_rank: u32) -> Vec<String> {
        let lr = local_rank.to_string();
        self.lead_args
            .iter()
            .cloned()
            .chain(self.args.iter().map(|a| substitute_local_rank(a, &lr)))
            .collect()
    }
}

/// torchrun's substitution of the local rank in every argument of the script (Python's
/// `string.Template(arg).safe_substitute(local_rank=lr)`): `$local_rank` and `${local_rank}`
/// become `lr`, and any other `$` stays as it is (`$HOME`, `${x}`, a `$` at the end). One
/// difference, on purpose: `$$` stays `$$` (Template makes it `$`), so that a shell one-liner's
/// `$$` (`sh -c 'echo $$ > pid'`) keeps meaning the shell's pid.
pub fn substitute_local_rank(arg: &str, lr: &str) -> String {
    safe_substitute(arg, &[("local_rank", lr)], "$$")
}

/// Which standard streams a setting applies to (torchrun's `Std`: 0 none, 1 out, 2 err, 3 both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StdMask(pub u8);

impl StdMask {
    /// Includes stdout.
    pub fn out(self) -> bool {
        self.0 & 1 != 0
    }
    /// Includes stderr.
    pub fn err(self) -> bool {
        self.0 & 2 != 0
    }
}

/// A `--redirects`/`--tee` value: one mask for all local ranks, or per local rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StdSpec {
    /// Applies to local ranks not in `per_rank`.
    pub all: StdMask,
    /// Per local rank.
    pub per_rank: BTreeMap<u32, StdMask>,
}

impl StdSpec {
    /// Parses `N` or `LR:N,LR:N` with N in 0..=3.
    ///
    /// # Errors
    /// Anything else.
    pub fn parse(s: &str, flag: &'static str) -> Result<Self, PlanError> {
        let expected = "0..3 (0 none, 1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,...";
        let bad = || invalid(flag, s, expected);
        let mask = |v: &str| match v.trim().parse::<u8>() {
            Ok(n) if n <= 3 => Ok(StdMask(n)),
            _ => Err(bad()),
        };
        let s = s.trim();
        if s.is_empty() {
            return Ok(StdSpec::default());
        }
        if !s.contains(':') {
            return Ok(StdSpec { all: mask(s)?, per_rank: BTreeMap::new() });
        }
        let mut per_rank = BTreeMap::new();
        for part in s.split(',') {
            let (lr, v) = part.split_once(':').ok_or_else(bad)?;
            // As torchrun: a later entry for the same local rank wins.
            per_rank.insert(lr.trim().parse::<u32>().map_err(|_| bad())?, mask(v)?);
        }
        Ok(StdSpec { all: StdMask(0), per_rank })
    }

    /// The mask for `local_rank`.
    pub fn for_local_rank(&self, local_rank: u32) -> StdMask {
        self.per_rank.get(&local_rank).copied().unwrap_or(self.all)
    }
}

/// A set of ranks given as `0,2-5`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSet(Vec<(u32, u32)>);

impl RankSet {
    /// Parses `R`, `A-B` and comma lists of them.
    ///
    /// # Errors
    /// Anything else (an empty list included).
    pub fn parse(s: &str, flag: &'static str) -> Result<Self, PlanError> {
        let bad = || invalid(flag, s, "ranks like 0,2-5");
        let mut ranges = Vec::new();
        for part in s.split(',').map(str::trim) {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?),
                None => {
                    let r: u32 = part.parse().map_err(|_| bad())?;
                    (r, r)
                }
            };
            if a > b {
                return Err(bad());
            }
            ranges.push((a, b));
        }
        Ok(RankSet(ranges))
    }

    /// The lowest rank in the set.
    pub fn min(&self) -> u32 {
        self.0.iter().map(|&(a, _)| a).min().unwrap_or(0)
    }

    /// The highest rank in the set.
    pub fn max(&self) -> u32 {
        self.0.iter().map(|&(_, b)| b).max().unwrap_or(0)
    }

    /// Whether `rank` is in the set.
    pub fn contains(&self, rank: u32) -> bool {
        self.0.iter().any(|&(a, b)| (a..=b).contains(&rank))
    }
}

/// Per-rank files and the console stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogPlan {
    /// Base directory; `None` when disabled with `--log-dir /dev/null`.
    pub dir: Option<PathBuf>,
    /// Streams kept off the console (`--redirects`), unless tee'd.
    pub redirects: StdSpec,
    /// Streams shown on the console and written to files (`--tee`).
    pub tee: StdSpec,
    /// Console line prefix template.
    pub prefix: String,
    /// Console only for these local ranks.
    pub local_ranks: Option<RankSet>,
    /// Console only for these global ranks.
    pub ranks: Option<RankSet>,
    /// Substrings copied to `filtered_stdout.log`.
    pub dup_stdout: Vec<String>,
    /// Substrings copied to `filtered_stderr.log`.
    pub dup_stderr: Vec<String>,
}

impl LogPlan {
    /// Whether `stream` (1 = stdout, 2 = stderr) of this worker is shown on the console.
    pub fn on_console(&self, local_rank: u32, rank: u32, stream: u8) -> bool {
        if self.local_ranks.as_ref().is_some_and(|s| !s.contains(local_rank)) {
            return false;
        }
        if self.ranks.as_ref().is_some_and(|s| !s.contains(rank)) {
            return false;
        }
        let redirected = self.redirects.for_local_rank(local_rank).0 & stream != 0;
        let teed = self.tee.for_local_rank(local_rank).0 & stream != 0;
        !redirected || teed
    }

    /// The directory of one worker's files in one attempt.
    pub fn worker_dir(&self, job_id: &str, round: u64, rank: u32) -> Option<PathBuf> {
        self.attempt_dir(job_id, round).map(|d| d.join(rank.to_string()))
    }

    /// `<dir>/<job>/attempt_<round>`.
    pub fn attempt_dir(&self, job_id: &str, round: u64) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(sanitize_path_component(job_id)).join(format!("attempt_{round}")))
    }
}

fn sanitize_path_component(s: &str) -> String {
    let s: String = s.chars().map(|c| if c == '/' || c == '\0' { '_' } else { c }).collect();
    if s == "." || s == ".." || s.is_empty() { format!("_{s}") } else { s }
}

/// `--rdzv-tls-ca FILE` (relative to `host`'s working directory), read and checked: the path and
/// its PEM certificates.
///
/// # Errors
/// An unreadable file, or one without PEM certificates, naming the flag and the file.
pub(crate) fn read_tls_ca(path: &Path, host: &HostInfo) -> Result<(PathBuf, Vec<u8>), PlanError> {
    let p = host.cwd.join(path);
    let pem = rsrun_rendezvous::files::read_bounded(&p)
        .map_err(|e| invalid("--rdzv-tls-ca", &path.display().to_string(), format!("a readable PEM file ({e})")))?;
    rsrun_rendezvous::client::check_pem_certificates(&pem)
        .map_err(|why| invalid("--rdzv-tls-ca", &path.display().to_string(), format!("a file of PEM CA certificates (it {why})")))?;
    Ok((p, pem))
}

/// The prefix macros accepted in `--log-prefix`.
pub const PREFIX_MACROS: &[&str] = &["rank", "local_rank", "node_rank", "role_name", "hostname", "round"];

/// Expands a prefix template as torchrun's `string.Template.safe_substitute`: `${name}` and
/// `$name` of `vars`, `$$` is `$`, anything else stays as written.
pub fn expand_prefix(template: &str, vars: &[(&str, &str)]) -> String {
    safe_substitute(template, vars, "$")
}

/// Python's `string.Template(template).safe_substitute(vars)`: `${name}` and `$name` (the longest
/// identifier after the `$`) of `vars` become their values, `$$` becomes `dollar_dollar`, and
/// anything else stays as written (`$HOME`, `${x}`, `$5`, a `$` at the end).
fn safe_substitute(template: &str, vars: &[(&str, &str)], dollar_dollar: &str) -> String {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let lookup = |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push_str(dollar_dollar);
            rest = r;
            continue;
        }
        let braced = after.strip_prefix('{').and_then(|b| b.find('}').map(|end| (&b[..end], &b[end + 1..])));
        let bare_len = if after.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') { after.find(|c: char| !is_ident(c)).unwrap_or(after.len()) } else { 0 };
        let (name, r) = match braced {
            Some((name, r)) => (name, r),
            None => (&after[..bare_len], &after[bare_len..]),
        };
        match lookup(name).filter(|_| !name.is_empty()) {
            Some(v) => {
                out.push_str(v);
                rest = r;
            }
            None => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn check_prefix(template: &str, flag: &'static str) -> Result<(), PlanError> {
    let mut rest = template;
    while let Some(i) = rest.find('$') {
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            rest = r;
            continue;
        }
        // `${name}` must name a macro; a bare `$name` that names none stays as written (torchrun's
        // safe_substitute: `$HOME`, `$5`).
        let Some(b) = after.strip_prefix('{') else {
            rest = after;
            continue;
        };
        let Some(end) = b.find('}') else {
            return Err(invalid(flag, template, "a template with ${...} macros closed by '}'"));
        };
        let name = &b[..end];
        if !PREFIX_MACROS.contains(&name) {
            return Err(invalid(flag, template, format!("macros among ${{{}}} (or $name; $$ for a $)", PREFIX_MACROS.join("}, ${"))));
        }
        rest = &b[end + 1..];
    }
    Ok(())
}

/// CUDA_VISIBLE_DEVICES per worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuBind {
    /// Inherited unchanged.
    None,
    /// Worker `i` sees only the `i`-th device of this list.
    LocalRank(Vec<String>),
}

/// Timeouts and periods, all validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeouts {
    /// Hang-detector tick (`--monitor-interval`).
    pub monitor_interval: Duration,
    /// Grace between the stop signal and SIGKILL.
    pub shutdown: Duration,
    /// No progress for this long = hung.
    pub hang: Option<Duration>,
    /// Exit barrier after this node's success.
    pub exit_barrier: Duration,
    /// Waiting for a round to form.
    pub join: Duration,
    /// After MIN nodes joined, wait this long for more.
    pub last_call: Duration,
    /// A node that has not renewed its lease for this long is dead.
    pub lease: Duration,
    /// Per-RPC deadline for store operations and control calls (`read_timeout`).
    pub rpc: Duration,
    /// How long the rendezvous service may stay unreachable (no successful keep-alive) before this
    /// node gives up on the job (`keep_alive_timeout`).
    pub keep_alive_give_up: Duration,
}

/// Everything needed to run the job on this node, validated.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Job id shared by all nodes (TORCHELASTIC_RUN_ID, RSRUN_JOB_ID).
    pub job_id: String,
    /// How nodes find each other.
    pub rdzv: RdzvPlan,
    /// Node count range.
    pub nodes: NodeRange,
    /// Workers on this node.
    pub nproc_per_node: u32,
    /// Preferred node rank for elastic backends.
    pub rank_hint: Option<u32>,
    /// ROLE_NAME.
    pub role: String,
    /// What each worker runs.
    pub program: ProgramPlan,
    /// The job's restart budget.
    pub max_restarts: u32,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Logs and console.
    pub logs: LogPlan,
    /// Signal actions.
    pub signals: SignalPolicy,
    /// CUDA_VISIBLE_DEVICES per worker.
    pub gpu_bind: GpuBind,
    /// `--virtual-local-rank`: LOCAL_RANK=0 for every worker.
    pub virtual_local_rank: bool,
    /// CPU affinity per local rank (`None`: inherited).
    pub cpu_sets: Option<Vec<Vec<usize>>>,
    /// Addresses advertised to peers (`--local-addr`); empty means "detect".
    pub local_addr: Option<String>,
    /// This host's name.
    pub hostname: String,
    /// Token file for the rendezvous daemon.
    pub token_file: Option<PathBuf>,
    /// Token read from `token_file`.
    pub token: Option<String>,
    /// CA certificate of the rendezvous daemon's TLS certificate (`--rdzv-tls-ca`; daemon backend
    /// only): set, the launcher and its workers connect with TLS.
    pub tls_ca: Option<PathBuf>,
    /// Environment rsrun adds for every worker besides the rank variables (OMP_NUM_THREADS=1,
    /// TORCH_NCCL_ASYNC_ERROR_HANDLING=1 when unset).
    pub extra_env: Vec<(String, String)>,
    /// One-line notes and warnings for the console, in order.
    pub notes: Vec<String>,
    /// Print the plan and exit.
    pub dry_run: bool,
    /// How the job is launched: single node, c10d, static, hostfile/ssh, Slurm A/B/C, Kubernetes.
    pub mode: LaunchMode,
    /// What the workers read as stdin: rsrun's own (as torchrun's workers do), except under an
    /// agent of a whole-job launch, whose stdin is its head's message stream (/dev/null then).
    pub worker_stdin: crate::worker::WorkerStdin,
    /// The node table of `--hostfile` / `-H` (after `--include`/`--exclude`, `--nnodes`,
    /// `--nproc-per-node`), in node-rank order; the ssh launcher starts one agent per entry.
    pub hosts: Option<HostTable>,
    /// Slurm mode B: srun started this process as one rank; RANK, LOCAL_RANK, LOCAL_WORLD_SIZE,
    /// GROUP_RANK and GROUP_WORLD_SIZE come from Slurm (the static backend runs one worker).
    pub task_ranks: Option<TaskRanks>,
    /// How many ports after the rendezvous port node rank 0 tries when it is taken, and the other
    /// nodes search (Slurm's derived or reserved port: 7; 0 otherwise).
    pub port_probe: u16,
    /// Slurm: the step's hosts in node order; node rank 0's name resolving to a loopback address
    /// while another host's does not is refused (the `127.0.1.1` trap, multinode.md §3.2).
    pub node_list: Vec<String>,
    /// The resolved topology values and where each came from (flag, `PET_*`, `SLURM_*`, hostfile
    /// line), in display order.
    pub sources: Vec<Sourced>,
    /// `--requeue-on-preempt`: the Slurm job node rank 0 requeues after a preemption signal.
    pub requeue: Option<multinode::slurm::Requeue>,
    /// rsrun's own `TORCHELASTIC_ERROR_FILE` (relative to the current directory), when it was given
    /// one: a failed job's root cause is copied there, as torchrun does (workers get their own). An
    /// agent started by a head has none.
    pub parent_error_file: Option<PathBuf>,
}

/// Parses `30`, `2.5`, `500ms`, `30s`, `5m`, `1h`.
///
/// # Errors
/// Anything else, or a negative value.
pub fn parse_duration(s: &str, flag: &'static str) -> Result<Duration, PlanError> {
    let bad = || invalid(flag, s, "a duration like 30, 2.5, 500ms, 30s, 5m or 1h");
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 || v * scale > 1e9 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * scale))
}

fn parse_nproc(s: &str, host: &HostInfo) -> Result<u32, PlanError> {
    let cpus = host.cpus.len().max(1) as u32;
    match s.trim() {
        "cpu" => Ok(cpus),
        "gpu" | "cuda" => {
            if host.gpus == 0 {
                Err(PlanError::Conflict(
                    "--nproc-per-node gpu: no GPU is visible (CUDA_VISIBLE_DEVICES, /proc/driver/nvidia)".into(),
                ))
            } else {
                Ok(host.gpus)
            }
        }
        "auto" => Ok(if host.gpus > 0 { host.gpus } else { cpus }),
        // What a bare hostfile host gets (multinode.md §1): one worker per GPU, else one.
        "gpu-or-1" => Ok(host.gpus.max(1)),
        other => match other.parse::<u32>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(invalid("--nproc-per-node", s, "a number > 0, auto, cpu, gpu or gpu-or-1")),
        },
    }
    .and_then(|n| {
        if n > MAX_NPROC_PER_NODE {
            Err(invalid(
                "--nproc-per-node",
                s,
                format!("at most {MAX_NPROC_PER_NODE} workers per node (resolved to {n})"),
            ))
        } else {
            Ok(n)
        }
    })
}

/// Most workers on one node: what the rendezvous service accepts at Join.
pub const MAX_NPROC_PER_NODE: u32 = rsrun_rendezvous::validate::MAX_LOCAL_WORLD_SIZE;
/// Longest job id the rendezvous service accepts.
pub const MAX_JOB_ID_LEN: usize = rsrun_rendezvous::validate::MAX_ID_LEN;

/// Checks a job id the way the rendezvous service does at Join: 1 to 128 characters of
/// `[A-Za-z0-9._:@-]` (torchrun's `none` and uuids pass).
fn check_job_id(id: &str) -> Result<(), PlanError> {
    rsrun_rendezvous::validate::id("job_id", id).map_err(|e| {
        let why = match e {
            rsrun_rendezvous::RdzvError::InvalidArgument { message, .. } => message,
            other => other.to_string(),
        };
        invalid("--rdzv-id", id, format!("an id of 1 to {MAX_JOB_ID_LEN} characters among letters, digits and . _ : @ - ({why})"))
    })
}

/// This node's id at the rendezvous: `HOSTNAME-PID`, always a valid id of at most 128 characters.
/// Characters the service rejects become `_`; a long host name is cut and keeps a hash of the whole
/// name, so that two long names sharing a prefix still differ.
pub fn node_id(hostname: &str, pid: u32) -> String {
    let clean: String = hostname
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._:@-".contains(c) { c } else { '_' })
        .collect();
    let clean = if clean.is_empty() { "node".to_owned() } else { clean };
    let suffix = format!("-{pid}");
    let room = MAX_JOB_ID_LEN - suffix.len();
    if clean.len() <= room {
        return format!("{clean}{suffix}");
    }
    // FNV-1a of the full name: stable, and different names rarely collide in a job.
    let hash = hostname.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let tag = format!("-{hash:016x}");
    format!("{}{tag}{suffix}", &clean[..room - tag.len()])
}

/// A random 128-bit secret (hex) from the kernel's generator: the token that alone guards a
/// plain service, so never a guessable fallback.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub fn secret_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf))?;
    Ok(hex(&buf))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Random 128-bit hex id (like torchrun's uuid4 run ids).
pub fn random_id() -> String {
    secret_token().unwrap_or_else(|_| {
        // Not cryptographic: only needs to differ between jobs on this host.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let mut buf = [0u8; 16];
        buf[..8].copy_from_slice(&(t.as_nanos() as u64).to_le_bytes());
        buf[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        hex(&buf)
    })
}

/// Finds `name` on `PATH` (or checks it when it contains a `/`).
pub fn find_executable(name: &str, host: &HostInfo) -> Option<PathBuf> {
    if name.contains('/') {
        let p = host.cwd.join(name);
        return is_executable(&p).then_some(p);
    }
    let path = host.var("PATH").unwrap_or("/usr/local/bin:/usr/bin:/bin");
    path.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(name)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false)
}

/// Set by `python -m rsrun` to its `sys.executable`: the workers' Python when PYTHON_EXEC is unset.
pub const PYTHON_OF_MODULE_VAR: &str = "RSRUN_PYTHON_OF_MODULE";

/// Whether `path` starts with a `#!` line that runs Python (`#!/usr/bin/env python3`): such a
/// script runs as torchrun runs it, `python -u SCRIPT` (direct, its output went block-buffered
/// into the pipe, and PYTHON_EXEC was not used).
fn python_shebang(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 128];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
    let first = head[..n].split(|b| *b == b'\n').next().unwrap_or_default();
    first.starts_with(b"#!") && String::from_utf8_lossy(first).split(|c: char| c == '/' || c.is_whitespace()).any(|w| w.starts_with("python"))
}

fn python(host: &HostInfo) -> Result<PathBuf, PlanError> {
    if let Some(exec) = host.var("PYTHON_EXEC").filter(|s| !s.is_empty()) {
        return find_executable(exec, host).ok_or_else(|| {
            PlanError::Program(format!("PYTHON_EXEC={exec} is not an executable file or a name on PATH"))
        });
    }
    // `python -m rsrun`: the interpreter that ran it, as torchrun's workers get `sys.executable`
    // (a venv's python off PATH), not the first python3 on PATH.
    if let Some(exec) = host.var(PYTHON_OF_MODULE_VAR).filter(|s| !s.is_empty())
        && let Some(p) = find_executable(exec, host)
    {
        return Ok(p);
    }
    // An rsrun that pip installed into a venv (or a conda env) runs as that env's own, activated
    // or not: its Python, as `/venv/bin/torchrun` gives its workers `sys.executable` (the first
    // python3 on PATH was the system's, without the env's packages).
    if let Some(dir) = &host.exe_dir
        && let Some(root) = dir.parent()
        && (root.join("pyvenv.cfg").is_file() || root.join("conda-meta").is_dir())
        && let Some(p) = ["python3", "python"].iter().map(|n| dir.join(n)).find(|p| is_executable(p))
    {
        return Ok(p);
    }
    find_executable("python3", host).or_else(|| find_executable("python", host)).ok_or_else(|| {
        PlanError::Program(
            "no Python interpreter found on PATH (set PYTHON_EXEC, or use --no-python for a binary)".into(),
        )
    })
}

fn resolve_program(args: &LaunchArgs, host: &HostInfo, notes: &mut Vec<String>) -> Result<ProgramPlan, PlanError> {
    let name = args.program().to_owned();
    if name.is_empty() {
        return Err(PlanError::Program("missing PROGRAM: nothing to run".into()));
    }
    if name.starts_with('-') {
        return Err(PlanError::Program(format!(
            "unknown option '{name}' (see rsrun --help; PROGRAM cannot start with '-')"
        )));
    }
    let user_args = args.program_args().to_vec();
    if args.module && args.no_python {
        return Err(PlanError::Conflict("-m/--module and --no-python cannot be used together".into()));
    }
    let python_script = |notes: &mut Vec<String>| -> Result<ProgramPlan, PlanError> {
        let _ = notes;
        let script = host.cwd.join(&name);
        if !script.is_file() && !script.join("__main__.py").is_file() {
            return Err(PlanError::Program(format!("program '{name}' not found: no such file")));
        }
        Ok(ProgramPlan {
            kind: ProgramKind::PythonScript,
            exe: python(host)?,
            lead_args: vec!["-u".into(), name.clone()],
            args: user_args.clone(),
            name: name.clone(),
        })
    };
    if args.run_path {
        if args.no_python {
            notes.push("--run-path takes precedence over --no-python (as in torchrun)".into());
        }
        notes.push("--run-path: rsrun runs the script with `python -u`".into());
        return python_script(notes);
    }
    if args.module {
        return Ok(ProgramPlan {
            kind: ProgramKind::PythonModule,
            exe: python(host)?,
            lead_args: vec!["-u".into(), "-m".into(), name.clone()],
            args: user_args.clone(),
            name,
        });
    }
    let direct = |exe: PathBuf| ProgramPlan {
        kind: ProgramKind::Executable,
        exe,
        lead_args: Vec::new(),
        args: user_args.clone(),
        name: name.clone(),
    };
    if args.no_python {
        return find_executable(&name, host).map(direct).ok_or_else(|| {
            PlanError::Program(format!("program '{name}' not found: not an executable file or a name on PATH"))
        });
    }
    if name.ends_with(".py") {
        return python_script(notes);
    }
    // A file of that name here comes first, as in torchrun (`rsrun test` runs ./test, not
    // /usr/bin/test): an executable runs as it is, any other file under Python (torchrun runs
    // scripts without the .py suffix that way).
    let here = host.cwd.join(&name);
    if !name.contains('/') && here.is_file() {
        if let Some(on_path) = find_executable(&name, host) {
            notes.push(format!(
                "'{name}' is a file here and {} on PATH: running the file here (give the path to run the other)",
                on_path.display()
            ));
        }
        if is_executable(&here) && !python_shebang(&here) {
            return Ok(direct(here));
        }
        return python_script(notes);
    }
    // A path to a file that is not executable (or is a Python script by its `#!` line), or a
    // package directory (its __main__.py; `mypkg` as well as `./mypkg`), runs under Python, as
    // torchrun runs every PROGRAM: `python -u` keeps its output unbuffered.
    if (name.contains('/') && here.is_file() && (!is_executable(&here) || python_shebang(&here)))
        || here.join("__main__.py").is_file()
    {
        return python_script(notes);
    }
    if let Some(exe) = find_executable(&name, host) {
        return Ok(direct(exe));
    }
    Err(PlanError::Program(format!(
        "program '{name}' not found: not a file, and no executable of that name on PATH"
    )))
}

/// torchrun's default `timeout` of the static rendezvous.
const STATIC_RDZV_TIMEOUT: Duration = Duration::from_secs(900);
/// The default `join_timeout` of the c10d rendezvous.
const JOIN_TIMEOUT: Duration = Duration::from_secs(600);

struct RdzvConf {
    /// `join_timeout`, when given.
    join: Option<Duration>,
    /// torchrun's `timeout` key: the static backend's wait for every node.
    timeout: Option<Duration>,
    last_call: Duration,
    lease: Duration,
    rpc: Duration,
    give_up: Duration,
    host: HostMode,
}

fn parse_rdzv_conf(s: &str, notes: &mut Vec<String>) -> Result<RdzvConf, PlanError> {
    const FLAG: &str = "--rdzv-conf";
    let mut conf = RdzvConf {
        join: None,
        timeout: None,
        last_call: Duration::from_secs(30),
        lease: Duration::ZERO,
        rpc: Duration::from_secs(60),
        give_up: rsrun_rendezvous::client::KEEP_ALIVE_GIVE_UP,
        host: HostMode::Auto,
    };
    let mut keep_alive = Duration::from_secs(5);
    let mut attempts: u32 = 3;
    let mut seen: Vec<&str> = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((k, v)) = entry.split_once('=') else {
            return Err(invalid(FLAG, entry, "KEY=VALUE"));
        };
        let (k, v) = (k.trim(), v.trim());
        // As torchrun: a later value wins (wrappers append overrides to a default list), said once.
        if seen.contains(&k) {
            notes.push(format!("--rdzv-conf: {k} is given more than once; the last value, {v}, counts"));
        }
        seen.push(k);
        if v.is_empty() {
            return Err(invalid(FLAG, entry, "KEY=VALUE with a non-empty value"));
        }
        // The key and its value in the error: "--rdzv-conf join_timeout=1e400".
        let duration = |v: &str| parse_duration(v, FLAG).map_err(|_| invalid(FLAG, entry, format!("{k}=DURATION like 30, 2.5, 500ms, 30s, 5m or 1h")));
        match k {
            "join_timeout" => {
                let join = duration(v)?;
                // torchrun: "The join timeout must be a positive integer."
                if join.is_zero() {
                    return Err(invalid(FLAG, entry, "join_timeout=SECONDS > 0"));
                }
                conf.join = Some(join);
            }
            "last_call_timeout" => conf.last_call = duration(v)?,
            "keep_alive_interval" => keep_alive = duration(v)?,
            "keep_alive_max_attempt" => {
                attempts = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| invalid(FLAG, entry, "a count > 0"))?
            }
            // torchrun's deadline of one heartbeat write (5 s), not how long a silent node lives
            // (keep_alive_interval x keep_alive_max_attempt, 15 s): taken as the lease, torchrun's
            // own default written out cut the lease to 5 s and overrode the keep-alive pair.
            "heartbeat_timeout" => {
                duration(v)?;
                notes.push(format!(
                    "--rdzv-conf heartbeat_timeout={v}: torchrun's deadline of one heartbeat; rsrun bounds each keep-alive by read_timeout, and a node's lease is keep_alive_interval x keep_alive_max_attempt (or lease_timeout)"
                ));
            }
            "lease_timeout" => {
                conf.lease = duration(v)?;
                if conf.lease.is_zero() {
                    return Err(invalid(FLAG, entry, format!("{k}=SECONDS > 0")));
                }
            }
            "read_timeout" => {
                conf.rpc = duration(v)?;
                if conf.rpc.is_zero() {
                    return Err(invalid(FLAG, entry, "read_timeout=SECONDS > 0"));
                }
                if conf.rpc > Duration::from_secs(30) || conf.rpc < Duration::from_secs(1) {
                    notes.push(format!("--rdzv-conf read_timeout={v}: each rendezvous call is bounded by 1 to 30 s; the nearest is used"));
                }
            }
            "keep_alive_timeout" => {
                conf.give_up = duration(v)?;
                if conf.give_up.is_zero() {
                    return Err(invalid(FLAG, entry, "keep_alive_timeout=SECONDS > 0"));
                }
            }
            "is_host" => {
                conf.host = match v.to_ascii_lowercase().as_str() {
                    // torchrun's get_as_bool: 1/true/t/yes/y and 0/false/f/no/n.
                    "1" | "true" | "t" | "yes" | "y" | "on" => HostMode::Always,
                    "0" | "false" | "f" | "no" | "n" | "off" => HostMode::Never,
                    _ => return Err(invalid(FLAG, entry, "is_host=true|false")),
                }
            }
            "timeout" => {
                let t = duration(v)?;
                if t.is_zero() {
                    return Err(invalid(FLAG, entry, "timeout=SECONDS > 0"));
                }
                conf.timeout = Some(t);
            }
            "close_timeout" | "store_type" | "cas_backoff_max_seconds" | "rank" => {
                notes.push(format!("--rdzv-conf {k}: not used by rsrun's rendezvous"));
            }
            other => notes.push(format!("--rdzv-conf: unknown key '{other}' ignored")),
        }
    }
    if conf.lease.is_zero() {
        conf.lease = keep_alive * attempts;
    }
    if conf.lease < Duration::from_millis(100) {
        return Err(invalid(FLAG, s, "a lease (keep_alive_interval x keep_alive_max_attempt) of at least 100ms"));
    }
    // The service's ranges, checked here so the error names the flag (not a refused Join).
    const HOUR: Duration = Duration::from_secs(3600);
    for (what, value, max) in [
        ("a lease (lease_timeout, or keep_alive_interval x keep_alive_max_attempt)", conf.lease, HOUR),
        ("last_call_timeout", conf.last_call, 24 * HOUR),
        ("join_timeout", conf.join.unwrap_or(JOIN_TIMEOUT), 24 * HOUR),
    ] {
        if value > max {
            return Err(invalid(FLAG, s, format!("{what} of at most {max:?} (got {value:?})")));
        }
    }
    Ok(conf)
}

fn split_escaped(s: &str) -> Vec<String> {
    // torchrun: comma-separated, ",," escapes a comma.
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ',' {
            if chars.peek() == Some(&',') {
                chars.next();
                cur.push(',');
            } else {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    out.push(cur);
    out.into_iter().filter(|s| !s.is_empty()).collect()
}

/// CPU affinity per local rank, from `--cpu-bind` or torchrun's `--numa-binding` (one of them; `--cpu-bind
/// numa` with `--numa-binding node` is the same request), placed on the host's topology near each
/// worker's GPU ([`topology::assign`]); `None`: inherited.
///
/// Slurm mode B (`task`): this process is one of the node's `local_world_size` tasks, one worker
/// each; the assignment is made for all of them and this task takes its local rank's entry, so
/// that the tasks' shares do not overlap.
fn cpu_sets(
    args: &LaunchArgs,
    nproc: u32,
    host: &HostInfo,
    gpu_bind: &GpuBind,
    task: Option<&TaskRanks>,
    notes: &mut Vec<String>,
) -> Result<Option<Vec<Vec<usize>>>, PlanError> {
    let cpu_bind = args.cpu_bind.trim();
    let by_cpu_bind = match cpu_bind {
        "none" => None,
        "cores" => Some(BindMode::Cores),
        "numa" => Some(BindMode::Numa),
        other => return Err(invalid("--cpu-bind", other, "none, cores or numa")),
    };
    let numa_binding = args.numa_binding.as_deref().map(str::trim);
    let by_numa_binding = match numa_binding {
        None => None,
        Some(m) => Some(
            BindMode::from_numa_binding(m)
                .ok_or_else(|| invalid("--numa-binding", m, "node, socket, exclusive or core-complex"))?,
        ),
    };
    // An option as the user gave it: `--cpu-bind cores`, or `PET_CPU_BIND=cores`.
    let as_given = |id: &str, flag: &str, value: &str| match args.origin(id) {
        crate::cli::Origin::Env(var) => format!("{var}={value}"),
        _ => format!("{flag} {value}"),
    };
    let mode = match (by_cpu_bind, by_numa_binding) {
        (None, None) => return Ok(None),
        (Some(m), None) | (None, Some(m)) | (Some(BindMode::Numa), Some(m @ BindMode::Node)) => m,
        (Some(_), Some(_)) => {
            return Err(PlanError::Conflict(format!(
                "{} and {} both choose the workers' CPUs: give one of them (--cpu-bind cores or numa, or torchrun's --numa-binding node, socket, exclusive or core-complex)",
                as_given("cpu_bind", "--cpu-bind", cpu_bind),
                as_given("numa_binding", "--numa-binding", numa_binding.unwrap_or_default())
            )));
        }
    };
    let probed = host.placement.get();
    let topo = &probed.topology;
    if topo.cpus.is_empty() {
        return Err(PlanError::Conflict(format!("{}: cannot read this process's CPU set", mode.flag())));
    }
    if mode == BindMode::Numa && !topo.numa_known {
        return Err(PlanError::Conflict("--cpu-bind numa: no NUMA topology under /sys/devices/system/node".into()));
    }
    notes.extend(topo.notes.iter().cloned());
    let visible = host.var("CUDA_VISIBLE_DEVICES");
    let cuda = topology::CudaEnv {
        visible,
        device_order: host.var("CUDA_DEVICE_ORDER"),
        slurm_gpus: ["SLURM_STEP_GPUS", "SLURM_JOB_GPUS"]
            .into_iter()
            .find_map(|var| host.var(var).filter(|v| !v.trim().is_empty()).map(|v| (var, v))),
        dev_nodes: probed.dev_nodes,
    };
    let devices = worker_devices(gpu_bind, visible, nproc, task);
    let Some(t) = task else {
        let gpu_nodes = topology::gpu_nodes(&devices, probed.pci_gpus.as_deref(), &cuda, notes);
        return Ok(Some(topology::assign(mode, topo, &gpu_nodes, notes)));
    };
    // Slurm mode B: the node's tasks, each placed as if this process ran them all.
    let local_world = (t.local_world_size as usize).max(1);
    let me = (t.local_rank as usize).min(local_world - 1);
    let mine = devices.into_iter().next().flatten();
    let (mut all, others_known) = task_devices(mine, visible, local_world, me);
    let disjoint = matches!(mode, BindMode::Cores | BindMode::Exclusive | BindMode::CoreComplex);
    if local_world > 1 && !others_known && disjoint {
        // Each task would place its own GPU's share where another task, knowing only its own,
        // places one too: the shares follow the topology alone, the same in every task.
        notes.push(format!(
            "{}: srun bound each of this node's {local_world} tasks to GPUs of its own, so the other tasks' GPUs are not known here: the tasks' shares follow the CPU topology alone (the same in every task, so they do not overlap)",
            mode.flag()
        ));
        all = vec![None; local_world];
    }
    if let Some(online) = probed.online_cpus
        && local_world > 1
        && topo.cpus.len() < online
    {
        notes.push(format!(
            "{}: this task may run on {} of the host's {online} online CPUs (srun's task binding, or the job's cpuset): its share is taken from those, as one of the node's {local_world} tasks; `srun --cpu-bind=none` lets rsrun place the tasks, `--cpu-bind none` keeps srun's placement",
            mode.flag(),
            topo.cpus.len()
        ));
    }
    let gpu_nodes = topology::gpu_nodes(&all, probed.pci_gpus.as_deref(), &cuda, notes);
    let mut sets = topology::assign(mode, topo, &gpu_nodes, notes);
    Ok(Some(vec![std::mem::take(&mut sets[me])]))
}

/// Slurm mode B: the GPU of each of the node's `local_world` tasks as this task can tell, and
/// whether the others' are known. Its own is `mine` (local rank `me`); the others' are their entries
/// of CUDA_VISIBLE_DEVICES when it lists one for each task (srun did not bind GPUs per task), their
/// local ranks without one; else (srun bound this task its own GPU) not known.
fn task_devices(mine: Option<String>, visible: Option<&str>, local_world: usize, me: usize) -> (Vec<Option<String>>, bool) {
    let list: Option<Vec<&str>> = visible.map(|l| l.split(',').map(str::trim).filter(|s| !s.is_empty()).collect());
    let known = list.as_ref().is_none_or(|l| l.len() >= local_world);
    let devices = (0..local_world)
        .map(|j| match &list {
            _ if j == me => mine.clone(),
            None => Some(j.to_string()),
            Some(l) if known => l.get(j).map(|d| (*d).to_owned()),
            Some(_) => None,
        })
        .collect();
    (devices, known)
}

/// The GPU each worker uses, as this process's CUDA_VISIBLE_DEVICES names it (an index in CUDA's
/// order, or a UUID): its own device under `--gpu-bind local-rank` (or Slurm's binding), else the
/// local rank's entry of the inherited list, or the local rank itself without one (torch's
/// `cuda:LOCAL_RANK`); `None` where there is none.
fn worker_devices(gpu_bind: &GpuBind, visible: Option<&str>, nproc: u32, task: Option<&TaskRanks>) -> Vec<Option<String>> {
    let n = nproc as usize;
    match gpu_bind {
        GpuBind::LocalRank(devices) => (0..n).map(|i| devices.get(i).cloned()).collect(),
        GpuBind::None => {
            let list: Option<Vec<String>> =
                visible.map(|l| l.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect());
            (0..n)
                .map(|i| {
                    let local_rank = task.map_or(i, |t| t.local_rank as usize);
                    match &list {
                        None => Some(local_rank.to_string()),
                        Some(l) => match l.get(local_rank) {
                            Some(d) => Some(d.clone()),
                            // srun bound this task's one GPU.
                            None if task.is_some() && l.len() == 1 => Some(l[0].clone()),
                            None => None,
                        },
                    }
                })
                .collect()
        }
    }
}

impl LaunchPlan {
    /// Validates `args` against `host` and resolves every default.
    ///
    /// # Errors
    /// The first user error found.
    pub fn resolve(args: &LaunchArgs, host: &HostInfo) -> Result<LaunchPlan, PlanError> {
        Self::resolve_as(args, host, Role::Launcher)
    }

    /// [`LaunchPlan::resolve`] for an agent the head started (`rsrun agent --stdin`). The head decided
    /// the topology and the rendezvous and passed them as options, so this host's cluster variables
    /// (`SLURM_*`, `PET_*`) are not read; and the ranks the log options name were checked by the head
    /// against the whole host table, whose nodes may differ in slots.
    ///
    /// # Errors
    /// The first user error found.
    pub fn resolve_agent(args: &LaunchArgs, host: &HostInfo) -> Result<LaunchPlan, PlanError> {
        Self::resolve_as(args, host, Role::Agent)
    }

    fn resolve_as(args: &LaunchArgs, host: &HostInfo, role: Role) -> Result<LaunchPlan, PlanError> {
        Self::resolve_options(args, host, role).map_err(|err| match err {
            // A value that came from the environment (`PET_NNODES=abc`) is named by its variable:
            // the user typed no such flag.
            PlanError::Invalid { flag, ref value, .. } => match args.origin(&flag.trim_start_matches('-').replace('-', "_")) {
                crate::cli::Origin::Env(var) => PlanError::At { place: format!("{var}={value}"), error: Box::new(err) },
                _ => err,
            },
            other => other,
        })
    }

    fn resolve_options(args: &LaunchArgs, host: &HostInfo, role: Role) -> Result<LaunchPlan, PlanError> {
        let mut notes = Vec::new();
        // The cluster path first: a host table, Slurm, Kubernetes (explicit options > Slurm >
        // Kubernetes/PET_*); what it leaves undecided comes from the options below. An agent has
        // its place in the job from the head, as options.
        let cluster = match role {
            Role::Launcher => multinode::resolve(args, host)?,
            Role::Agent => multinode::Cluster::plain(LaunchMode::SingleNode),
        };
        notes.extend(cluster.notes.iter().cloned());
        let nodes = match cluster.nodes {
            Some(n) => n,
            None => NodeRange::parse(&args.nnodes)?,
        };
        let nproc_per_node = match cluster.nproc_per_node {
            Some(n) => n,
            None => parse_nproc(&args.nproc_per_node, host)?,
        };
        let program = resolve_program(args, host, &mut notes)?;
        let rconf = parse_rdzv_conf(&args.rdzv_conf, &mut notes)?;

        // Rendezvous: --standalone, implicit single-node standalone, static, or the daemon.
        // Several endpoints: the daemons of a highly available group.
        let group: Vec<Endpoint> = if args.rdzv_endpoint.contains(',') {
            let mut eps = Vec::new();
            for part in args.rdzv_endpoint.split(',') {
                let ep = Endpoint::parse(part, "--rdzv-endpoint", DEFAULT_RDZV_PORT)?;
                if ep.port == 0 {
                    return Err(invalid("--rdzv-endpoint", &args.rdzv_endpoint, "fixed ports for every daemon of a group (HOST:PORT,HOST:PORT...)"));
                }
                if eps.contains(&ep) {
                    return Err(invalid("--rdzv-endpoint", &args.rdzv_endpoint, format!("distinct daemons; {ep} is listed twice")));
                }
                eps.push(ep);
            }
            eps
        } else {
            Vec::new()
        };
        let endpoint = (!args.rdzv_endpoint.trim().is_empty())
            .then(|| match group.first() {
                Some(first) => Ok(first.clone()),
                None => Endpoint::parse(&args.rdzv_endpoint, "--rdzv-endpoint", DEFAULT_RDZV_PORT),
            })
            .transpose()?;
        let backend = match args.rdzv_backend.trim().to_ascii_lowercase() {
            // Deviation from torchrun (which picks static): an endpoint without a fixed node rank
            // means "meet at the rendezvous", and the static backend would give every such node
            // node rank 0 (duplicate ranks).
            b if b.is_empty() && endpoint.is_some() && args.node_rank.is_none() => {
                if nodes.max > 1 {
                    notes.push("--rdzv-endpoint without --rdzv-backend: using c10d (ranks assigned by the rendezvous)".into());
                }
                "c10d".to_owned()
            }
            b if b.is_empty() => "static".to_owned(),
            b => b,
        };
        if let Some(addr) = args.local_addr.as_deref().filter(|a| !plausible_host(a.trim())) {
            return Err(invalid("--local-addr", addr, "this node's host name or IP address"));
        }
        // A node rank no node of the job can have is a mistake whichever backend would use it (a
        // PET_NODE_RANK in a pod does not count against a typed --standalone, which uses none).
        let typed = |id: &str| args.origin(id) == crate::cli::Origin::CommandLine;
        if let Some(r) = args.node_rank
            && r >= nodes.max
            && (!typed("standalone") || typed("node_rank"))
        {
            return Err(invalid("--node-rank", &r.to_string(), format!("a rank below the number of nodes ({})", nodes.max)));
        }
        let mut rank_hint = None;
        let (rdzv, job_id) = if let Some((rdzv, job_id, hint)) = cluster.rdzv.clone() {
            rank_hint = hint;
            (rdzv, job_id)
        } else if args.standalone {
            if nodes.max > 1 {
                return Err(PlanError::Conflict(format!(
                    "--standalone runs a single node, but --nnodes is {nodes}"
                )));
            }
            if endpoint.is_some() || args.rdzv_id.is_some() || backend != "static" {
                notes.push("--standalone overrides --rdzv-backend/--rdzv-endpoint/--rdzv-id".into());
            }
            if args.master_addr.is_some() || args.master_port.is_some() {
                notes.push("--master-addr/--master-port are ignored with --standalone: the node picks a free local port".into());
            }
            (RdzvPlan::Standalone, random_id())
        } else {
            match backend.as_str() {
                "static" if !group.is_empty() => {
                    return Err(PlanError::Conflict(format!(
                        "--rdzv-endpoint {} lists several daemons, which only the c10d backend uses (a highly available group); the static backend takes one --master-addr:--master-port",
                        args.rdzv_endpoint
                    )));
                }
                "static" => {
                    if endpoint.is_none() && args.master_port.is_none() && nodes.max == 1 {
                        // torchrun 2.15: single node without a port → c10d on localhost:0.
                        (RdzvPlan::Standalone, args.rdzv_id.clone().unwrap_or_else(random_id))
                    } else {
                        if nodes.is_elastic() {
                            notes.push(format!(
                                "--rdzv-backend static is not elastic: running {} nodes (MAX of --nnodes {nodes})",
                                nodes.max
                            ));
                        }
                        let node_rank = match args.node_rank {
                            Some(r) => r,
                            None => {
                                if nodes.max > 1 {
                                    notes.push(format!(
                                        "static backend without --node-rank: this node is node rank 0 (every node of {} needs its own --node-rank)",
                                        nodes.max
                                    ));
                                }
                                0
                            }
                        };
                        if node_rank >= nodes.max {
                            return Err(invalid(
                                "--node-rank",
                                &node_rank.to_string(),
                                format!("a rank below the number of nodes ({})", nodes.max),
                            ));
                        }
                        if let Some(addr) = args.master_addr.as_deref().filter(|a| !plausible_host(a.trim())) {
                            return Err(invalid("--master-addr", addr, "the host name or IP address of node rank 0"));
                        }
                        // As torchrun: a --rdzv-endpoint names the rendezvous, host and port;
                        // --master-addr/--master-port stand in only without one.
                        let (master_addr, master_port) = match &endpoint {
                            Some(e) => {
                                if args.master_addr.is_some() || args.master_port.is_some() {
                                    notes.push(format!(
                                        "--master-addr/--master-port are not used: --rdzv-endpoint {}:{} names the rendezvous (as with torchrun's static backend)",
                                        e.host, e.port
                                    ));
                                }
                                (e.host.clone(), e.port)
                            }
                            None => (
                                args.master_addr.as_deref().map_or_else(|| "127.0.0.1".into(), |a| a.trim().to_owned()),
                                args.master_port.unwrap_or(DEFAULT_MASTER_PORT),
                            ),
                        };
                        if master_port == 0 {
                            return Err(match &endpoint {
                                Some(_) => invalid("--rdzv-endpoint", &args.rdzv_endpoint, "HOST:PORT with a port in 1..65535 (the static backend's master port)"),
                                None => invalid("--master-port", "0", "a port in 1..65535"),
                            });
                        }
                        (
                            RdzvPlan::Static { node_rank, master_addr, master_port },
                            args.rdzv_id.clone().unwrap_or_else(|| "none".into()),
                        )
                    }
                }
                "c10d" | "rsrun" => {
                    // torchrun reads a missing endpoint as localhost:29400 and hosts the store there
                    // (localhost is this machine). One node needs no fixed port: it hosts its own
                    // rendezvous on a free one, as with --standalone.
                    let endpoint = match endpoint {
                        Some(e) => e,
                        None if nodes.max == 1 => {
                            notes.push(format!(
                                "--rdzv-backend {backend} without --rdzv-endpoint: one node, so it hosts its own rendezvous on a free port (as --standalone)"
                            ));
                            Endpoint { host: "127.0.0.1".into(), port: 0 }
                        }
                        None => {
                            notes.push(format!(
                                "--rdzv-backend {backend} without --rdzv-endpoint: localhost:{DEFAULT_RDZV_PORT}, as torchrun; launchers on other machines cannot reach it (give --rdzv-endpoint HOST:PORT)"
                            ));
                            Endpoint { host: "localhost".into(), port: DEFAULT_RDZV_PORT }
                        }
                    };
                    if args.master_addr.is_some() || args.master_port.is_some() {
                        notes.push(format!(
                            "--master-addr/--master-port are ignored with --rdzv-backend {backend}: the rank-0 node picks them"
                        ));
                    }
                    rank_hint = args.node_rank;
                    if let Some(r) = rank_hint {
                        notes.push(format!("--node-rank {r}: used as this node's preferred rank"));
                    }
                    port_zero_only_alone(&endpoint, nodes, "--rdzv-endpoint", &args.rdzv_endpoint)?;
                    if endpoint.port == 0 {
                        (RdzvPlan::Standalone, args.rdzv_id.clone().unwrap_or_else(random_id))
                    } else {
                        let id = match &args.rdzv_id {
                            Some(id) => id.clone(),
                            None => {
                                notes.push(
                                    "no --rdzv-id: using job id 'none'; jobs sharing a daemon without distinct ids merge"
                                        .into(),
                                );
                                "none".into()
                            }
                        };
                        if group.is_empty() {
                            (RdzvPlan::Daemon { endpoint, host: rconf.host }, id)
                        } else {
                            if rconf.host == HostMode::Always {
                                return Err(PlanError::Conflict(
                                    "--rdzv-conf is_host=true with several --rdzv-endpoint daemons: a group of daemons is started with `rsrun-rendezvous serve --etcd-endpoints`, never hosted by a launcher".into(),
                                ));
                            }
                            (RdzvPlan::Group { endpoints: group.clone() }, id)
                        }
                    }
                }
                "etcd" | "etcd-v2" => {
                    return Err(PlanError::Conflict(format!(
                        "--rdzv-backend {backend} is not supported: run `rsrun-rendezvous serve` and use --rdzv-backend c10d --rdzv-endpoint HOST:PORT (for a rendezvous that survives its host, run several `rsrun-rendezvous serve --etcd-endpoints ...` daemons and list them all: --rdzv-endpoint h1:29400,h2:29400)"
                    )));
                }
                other => return Err(invalid("--rdzv-backend", other, "c10d (alias rsrun) or static")),
            }
        };
        // What the rendezvous service would reject at Join, found before anything starts.
        check_job_id(&job_id)?;
        // Global ranks must fit: MAX nodes × workers per node.
        if nodes.max.checked_mul(nproc_per_node).is_none_or(|w| w > i32::MAX as u32) {
            return Err(PlanError::Conflict(format!(
                "--nnodes {nodes} with --nproc-per-node {nproc_per_node}: the world size does not fit in a rank (at most {})",
                i32::MAX
            )));
        }

        let mut shutdown_source = None;
        let shutdown = match &args.shutdown_timeout {
            Some(s) => parse_duration(s, "--shutdown-timeout")?,
            None => match host.var("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") {
                Some(s) => parse_duration(s, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")?,
                // Under Slurm and Kubernetes SIGTERM is the preemption notice, and SIGKILL follows
                // 30 s later (KillWait, terminationGracePeriodSeconds): stop the workers before.
                None => match cluster_sigterm_grace(&cluster.mode) {
                    Some((grace, why)) => {
                        shutdown_source = Some(Sourced {
                            name: "shutdown grace",
                            value: format!("{grace:?}"),
                            source: Source::Derived(why.to_owned()),
                        });
                        grace
                    }
                    None => Duration::from_secs(30),
                },
            },
        };
        if let Some((grace, why)) = cluster_sigterm_grace(&cluster.mode)
            && shutdown > grace
        {
            notes.push(format!(
                "--shutdown-timeout {shutdown:?} is longer than {grace:?}: {why}, so the workers may be killed before the grace ends"
            ));
        }
        let monitor_interval = parse_duration(&args.monitor_interval, "--monitor-interval")?;
        if monitor_interval < Duration::from_millis(1) {
            return Err(invalid("--monitor-interval", &args.monitor_interval, "a period of at least 1ms"));
        }
        let hang = args.hang_timeout.as_deref().map(|s| parse_duration(s, "--hang-timeout")).transpose()?;
        if hang.is_some_and(|h| h.is_zero()) {
            return Err(invalid("--hang-timeout", args.hang_timeout.as_deref().unwrap_or(""), "a duration > 0"));
        }
        if let Some(h) = hang.filter(|h| monitor_interval > *h) {
            return Err(invalid(
                "--monitor-interval",
                &args.monitor_interval,
                format!("a period no longer than --hang-timeout ({h:?}), which is checked once per period"),
            ));
        }
        let timeouts = Timeouts {
            monitor_interval,
            shutdown,
            hang,
            exit_barrier: parse_duration(&args.exit_barrier_timeout, "--exit-barrier-timeout")?,
            // torchrun's static rendezvous waits `timeout` (900 s unless given) for every node
            // (rsrun's join_timeout too, when given); c10d waits join_timeout.
            join: match &rdzv {
                RdzvPlan::Static { .. } => match (rconf.timeout, rconf.join) {
                    (Some(t), _) => t.min(Duration::from_secs(24 * 3600)),
                    (None, join) => join.unwrap_or(STATIC_RDZV_TIMEOUT),
                },
                _ => {
                    if let Some(t) = rconf.timeout {
                        notes.push(format!("--rdzv-conf timeout={}: not used by the c10d backend (it waits join_timeout)", t.as_secs_f64()));
                    }
                    rconf.join.unwrap_or(JOIN_TIMEOUT)
                }
            },
            last_call: rconf.last_call,
            lease: rconf.lease,
            rpc: rconf.rpc,
            keep_alive_give_up: rconf.give_up,
        };

        // Logs.
        let dir = match &args.log_dir {
            Some(d) if d == Path::new("/dev/null") => {
                notes.push("--log-dir /dev/null: no per-rank log files or error files".into());
                None
            }
            // Found now, not as every worker's start failure (which restarts the job for nothing).
            Some(d) => {
                let d = host.cwd.join(d);
                check_log_dir(&d, true)?;
                Some(d)
            }
            None => Some(default_log_dir(host, &mut notes)?),
        };
        // A typed flag wins over the other spelling's PET_ variable.
        let typed_template = args.origin("log_line_prefix_template") == crate::cli::Origin::CommandLine;
        let (prefix, prefix_flag) = match (&args.log_prefix, &args.log_line_prefix_template) {
            (Some(_), Some(p)) if typed_template && args.origin("log_prefix") != crate::cli::Origin::CommandLine => {
                (p.clone(), "--log-line-prefix-template")
            }
            (Some(p), _) => (p.clone(), "--log-prefix"),
            (None, Some(p)) => (p.clone(), "--log-line-prefix-template"),
            (None, None) => match host.var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") {
                Some(p) => (p.to_owned(), "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
                None => ("[rank ${rank}] ".to_owned(), "--log-prefix"),
            },
        };
        check_prefix(&prefix, prefix_flag)?;
        let filter = |v: &Option<String>, flag| -> Result<Option<RankSet>, PlanError> {
            match v.as_deref().map(str::trim) {
                None | Some("") => Ok(None),
                Some(s) => RankSet::parse(s, flag).map(Some),
            }
        };
        let logs = LogPlan {
            dir,
            redirects: StdSpec::parse(args.redirects.as_deref().unwrap_or(""), "--redirects")?,
            tee: StdSpec::parse(args.tee.as_deref().unwrap_or(""), "--tee")?,
            prefix,
            local_ranks: filter(&args.local_ranks_filter, "--local-ranks-filter")?,
            ranks: filter(&args.ranks_filter, "--ranks-filter")?,
            dup_stdout: args.duplicate_stdout_filters.as_deref().map(split_escaped).unwrap_or_default(),
            dup_stderr: args.duplicate_stderr_filters.as_deref().map(split_escaped).unwrap_or_default(),
        };
        // Ranks no worker of the job has: a typo that would hide every line or change nothing. Nodes
        // of a host table may differ in slots: local ranks go up to the largest slot count, ranks to
        // the table's world size (unknown while a host's slots are `auto`). An agent is one node of
        // the head's table: the head checked them.
        let limits = match (role, &cluster.hosts) {
            (Role::Agent, _) => None,
            (Role::Launcher, Some(table)) => table.max_slots().zip(table.world_size()),
            (Role::Launcher, None) => Some((nproc_per_node, nodes.max.saturating_mul(nproc_per_node))),
        };
        // As torchrun, ranks past the job's are ignored (a script written for 8 GPUs runs on 4),
        // said in a note; a value none of whose ranks exists is an error.
        let mut beyond = |flag: &'static str, value: &Option<String>, (lowest, highest): (u32, u32), limit: u32, what: &str| {
            let value = value.as_deref().unwrap_or("");
            if lowest >= limit {
                return Err(invalid(flag, value, format!("{what} below {limit} (rank {lowest} does not exist)")));
            }
            if highest >= limit {
                notes.push(format!("{flag} {value}: {what} {limit} and above do not exist here; they are ignored"));
            }
            Ok(())
        };
        if let Some((local_max, world_max)) = limits {
            if let Some(set) = &logs.local_ranks {
                beyond("--local-ranks-filter", &args.local_ranks_filter, (set.min(), set.max()), local_max, "local ranks")?;
            }
            if let Some(set) = &logs.ranks {
                beyond("--ranks-filter", &args.ranks_filter, (set.min(), set.max()), world_max, "ranks")?;
            }
            for (flag, spec, value) in [("--redirects", &logs.redirects, &args.redirects), ("--tee", &logs.tee, &args.tee)] {
                if let (Some(&lo), Some(&hi)) = (spec.per_rank.keys().next(), spec.per_rank.keys().next_back()) {
                    beyond(flag, value, (lo, hi), local_max, "local ranks")?;
                }
            }
        }

        // Signals.
        let mut signals = SignalPolicy::default_policy();
        if let Some(list) = &args.signals_to_handle {
            signals = signals
                .with_stop_signals(list)
                .map_err(|e| invalid("--signals-to-handle", list, format!("signal names ({e})")))?;
        }
        if let Some(spec) = &args.signal_policy {
            signals = signals
                .with_overrides(spec)
                .map_err(|e| invalid("--signal-policy", spec, format!("SIG=stop|forward|ignore,... ({e})")))?;
        }

        // Devices.
        let gpu_mode = args.gpu_bind.trim().to_ascii_lowercase().replace('_', "-");
        let gpu_bind = match (gpu_mode.as_str(), args.virtual_local_rank) {
            ("none", false) => GpuBind::None,
            // Slurm mode B: this process is one task, the worker's local rank is SLURM_LOCALID.
            ("none" | "local-rank", _) if let Some(t) = &cluster.task_ranks => {
                let devices: Vec<String> = match host.var("CUDA_VISIBLE_DEVICES") {
                    Some(list) => list.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect(),
                    None => (0..t.local_world_size).map(|i| i.to_string()).collect(),
                };
                match devices.get(t.local_rank as usize) {
                    Some(d) => GpuBind::LocalRank(vec![d.clone()]),
                    // --virtual-local-rank (what the note on a task with one GPU advises) and srun
                    // bound this task's GPU: that one device is the worker's.
                    None if gpu_mode == "none" && devices.len() == 1 => GpuBind::LocalRank(devices),
                    None => {
                        return Err(PlanError::Conflict(format!(
                            "--gpu-bind local-rank: SLURM_LOCALID={} but CUDA_VISIBLE_DEVICES={} lists {} device(s); srun already bound the GPUs of this task: drop --gpu-bind, or run srun --gpu-bind=none",
                            t.local_rank,
                            host.var("CUDA_VISIBLE_DEVICES").unwrap_or(""),
                            devices.len()
                        )));
                    }
                }
            }
            ("none" | "local-rank", _) => {
                let devices: Vec<String> = match host.var("CUDA_VISIBLE_DEVICES") {
                    Some(list) => list.split(',').map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect(),
                    None => (0..nproc_per_node).map(|i| i.to_string()).collect(),
                };
                if (devices.len() as u32) < nproc_per_node {
                    return Err(PlanError::Conflict(format!(
                        "--gpu-bind local-rank: {nproc_per_node} workers but CUDA_VISIBLE_DEVICES lists {} devices",
                        devices.len()
                    )));
                }
                GpuBind::LocalRank(devices)
            }
            (other, _) => return Err(invalid("--gpu-bind", other, "none or local-rank")),
        };
        let cpu_sets = cpu_sets(args, nproc_per_node, host, &gpu_bind, cluster.task_ranks.as_ref(), &mut notes)?;

        // Token.
        let token = match &args.rdzv_token_file {
            Some(path) => {
                // The first token of the file, checked as a daemon checks its token file (a
                // `TOKEN JOB` line gives TOKEN; a short token is refused naming the line).
                let p = host.cwd.join(path);
                let t = rsrun_rendezvous::auth::read_client_token(&p).map_err(|e| {
                    invalid("--rdzv-token-file", &path.display().to_string(), format!("a file holding a token ({e})"))
                })?;
                Some(t)
            }
            None => None,
        };

        // TLS to the daemon.
        let read_ca = |path: &PathBuf| read_tls_ca(path, host).map(|(p, _)| p);
        let tls_ca = match (&args.rdzv_tls_ca, &rdzv) {
            (None, _) => None,
            (Some(path), RdzvPlan::Group { .. }) => Some(read_ca(path)?),
            (Some(path), RdzvPlan::Daemon { host: mode, .. }) => {
                let p = read_ca(path)?;
                if *mode == HostMode::Always {
                    return Err(PlanError::Conflict(
                        "--rdzv-tls-ca with --rdzv-conf is_host=true: a launcher hosts a plain (non-TLS) service; run `rsrun-rendezvous serve --tls-cert --tls-key` instead".into(),
                    ));
                }
                Some(p)
            }
            (Some(_), RdzvPlan::Standalone) => {
                notes.push("--rdzv-tls-ca is not used with --standalone: the in-memory rendezvous is on loopback".into());
                None
            }
            (Some(_), RdzvPlan::Static { .. }) => {
                notes.push("--rdzv-tls-ca is not used by the static backend: node rank 0 hosts a plain (non-TLS) rendezvous".into());
                None
            }
        };

        // Multi-node flags without --hosts/--hostfile.
        let multinode_flags = !args.export.is_empty() || !args.env_file.is_empty() || args.export_all || !args.ssh_option.is_empty() || args.chdir.is_some();
        if multinode_flags && !args.is_remote() {
            notes.push("-x/--env-file/--export-all/--ssh-option/--chdir have no effect without --hosts or --hostfile".into());
        }

        // Compatibility flags without an effect.
        if let Some(m) = &args.start_method {
            notes.push(format!("--start-method {m} has no effect: rsrun starts PROGRAM as a process"));
        }
        if let Some(h) = &args.event_log_handler {
            notes.push(format!("--event-log-handler {h} has no effect: rsrun's events go to its log (RSRUN_LOG)"));
        }
        if let Some(s) = &args.logs_specs {
            notes.push(format!("--logs-specs {s} has no effect: rsrun has one log layout (--log-dir)"));
        }
        if let Some(s) = &args.print_completion {
            notes.push(format!("--print-completion {s} is not provided by rsrun"));
        }

        // Environment defaults (torchrun's).
        let mut extra_env = Vec::new();
        if nproc_per_node > 1 && !host.env.contains_key("OMP_NUM_THREADS") {
            notes.push(format!(
                "OMP_NUM_THREADS=1 for each of the {nproc_per_node} workers (set OMP_NUM_THREADS to choose)"
            ));
            extra_env.push(("OMP_NUM_THREADS".to_owned(), "1".to_owned()));
        }
        if !host.env.contains_key("TORCH_NCCL_ASYNC_ERROR_HANDLING") {
            extra_env.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING".to_owned(), "1".to_owned()));
        }

        let mode = match (&cluster.mode, &rdzv) {
            (LaunchMode::SingleNode, RdzvPlan::Static { .. }) => LaunchMode::Static,
            (LaunchMode::SingleNode, RdzvPlan::Daemon { .. } | RdzvPlan::Group { .. }) => LaunchMode::Rendezvous,
            (m, _) => m.clone(),
        };
        let mut sources = topology_sources(args, &cluster, nodes, nproc_per_node, &rdzv, &job_id);
        sources.extend(shutdown_source);
        let requeue = if args.requeue_on_preempt { Some(multinode::slurm::requeue(&mode, &host.env)?) } else { None };
        if args.check && !args.is_remote() {
            return Err(PlanError::Conflict(
                "--check needs --hosts or --hostfile: it checks every host of a whole-job launch and starts nothing".into(),
            ));
        }

        Ok(LaunchPlan {
            job_id,
            rdzv,
            nodes,
            nproc_per_node,
            rank_hint,
            role: args.role.clone(),
            program,
            max_restarts: args.max_restarts,
            timeouts,
            logs,
            signals,
            gpu_bind,
            virtual_local_rank: args.virtual_local_rank,
            cpu_sets,
            local_addr: args.local_addr.as_deref().map(|a| a.trim().to_owned()),
            hostname: host.hostname.clone(),
            token_file: args.rdzv_token_file.as_ref().map(|p| host.cwd.join(p)),
            token,
            tls_ca,
            extra_env,
            notes,
            dry_run: args.dry_run,
            mode,
            worker_stdin: match role {
                Role::Launcher => crate::worker::WorkerStdin::Inherit,
                Role::Agent => crate::worker::WorkerStdin::Null,
            },
            hosts: cluster.hosts,
            task_ranks: cluster.task_ranks,
            port_probe: cluster.port_probe,
            node_list: cluster.node_list,
            sources,
            requeue,
            parent_error_file: match role {
                Role::Launcher => host.var("TORCHELASTIC_ERROR_FILE").filter(|p| !p.is_empty()).map(|p| host.cwd.join(p)),
                Role::Agent => None,
            },
        })
    }
}

/// Who resolves the plan: a launcher started by the user (or srun, or a pod), or an agent started by
/// the head of a whole-job launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Launcher,
    Agent,
}

/// The SIGTERM grace of a cluster whose SIGKILL follows SIGTERM after 30 s by default, and why.
fn cluster_sigterm_grace(mode: &LaunchMode) -> Option<(Duration, &'static str)> {
    match mode {
        LaunchMode::SlurmA | LaunchMode::SlurmB | LaunchMode::SlurmC { .. } => {
            Some((Duration::from_secs(25), "Slurm sends SIGKILL KillWait after SIGTERM, 30 s by default"))
        }
        LaunchMode::K8sV1Static | LaunchMode::K8sV1Elastic | LaunchMode::K8sV2 => Some((
            Duration::from_secs(25),
            "the kubelet sends SIGKILL terminationGracePeriodSeconds after SIGTERM, 30 s by default",
        )),
        _ => None,
    }
}

/// The cluster path's sources, completed with the options' own for the values it left to them.
fn topology_sources(
    args: &LaunchArgs,
    cluster: &multinode::Cluster,
    nodes: NodeRange,
    nproc: u32,
    rdzv: &RdzvPlan,
    job_id: &str,
) -> Vec<Sourced> {
    let mut out = cluster.sources.clone();
    let has = |out: &[Sourced], name: &str| out.iter().any(|s| s.name == name);
    let opt = |id: &str, flag: &str| multinode::option_source(args, id, flag);
    if !has(&out, "nnodes") {
        out.push(Sourced { name: "nnodes", value: nodes.to_string(), source: opt("nnodes", "--nnodes") });
    }
    if !has(&out, "nproc per node") && cluster.hosts.is_none() {
        out.push(Sourced {
            name: "nproc per node",
            value: nproc.to_string(),
            source: opt("nproc_per_node", "--nproc-per-node"),
        });
    }
    match rdzv {
        RdzvPlan::Static { node_rank, master_addr, master_port } => {
            if !has(&out, "node rank") && !has(&out, "rank") {
                out.push(Sourced { name: "node rank", value: node_rank.to_string(), source: opt("node_rank", "--node-rank") });
            }
            // A --rdzv-endpoint wins over --master-addr/--master-port (see `resolve`).
            let from_endpoint = !args.rdzv_endpoint.trim().is_empty();
            if !has(&out, "MASTER_ADDR") {
                let source = if args.master_addr.is_some() && !from_endpoint { opt("master_addr", "--master-addr") } else { opt("rdzv_endpoint", "--rdzv-endpoint") };
                out.push(Sourced { name: "MASTER_ADDR", value: master_addr.clone(), source });
            }
            if !has(&out, "MASTER_PORT") && !has(&out, "rendezvous port") {
                let source = if args.master_port.is_some() && !from_endpoint { opt("master_port", "--master-port") } else { opt("rdzv_endpoint", "--rdzv-endpoint") };
                out.push(Sourced { name: "MASTER_PORT", value: master_port.to_string(), source });
            }
        }
        RdzvPlan::Daemon { endpoint, .. } => {
            if !has(&out, "rendezvous") {
                out.push(Sourced { name: "rendezvous", value: endpoint.to_string(), source: opt("rdzv_endpoint", "--rdzv-endpoint") });
            }
        }
        RdzvPlan::Group { endpoints } => {
            if !has(&out, "rendezvous") {
                out.push(Sourced { name: "rendezvous", value: endpoint_list(endpoints), source: opt("rdzv_endpoint", "--rdzv-endpoint") });
            }
        }
        RdzvPlan::Standalone => {}
    }
    if !has(&out, "run id") && !matches!(rdzv, RdzvPlan::Standalone) {
        let source = if args.rdzv_id.is_some() { opt("rdzv_id", "--rdzv-id") } else { Source::Default };
        out.push(Sourced { name: "run id", value: job_id.to_owned(), source });
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
