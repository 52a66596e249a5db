//! Where each worker's CPUs are: the machine's CPU topology (SMT cores, packages, NUMA nodes, L3
//! domains), the NUMA node of each GPU, and the assignment of CPUs to workers that `--cpu-bind`
//! and torchrun's `--numa-binding` ask for.
//!
//! The readers ([`read_topology`], [`read_pci_gpus`], [`count_dev_nodes`], [`read_online_cpus`])
//! are the thin I/O: they read a sysfs, a procfs and a devtmpfs root ([`Roots::real`] is `/sys`,
//! `/proc` and `/dev`; tests point them at a fake tree) and never fail: what is missing degrades
//! (each CPU a core of its own, one NUMA node, no GPU locality) with a note. Everything else
//! ([`gpu_nodes`], [`assign`]) is pure.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// One usable CPU (a hardware thread) and where it sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpu {
    /// The CPU id, as `sched_setaffinity` numbers it.
    pub id: usize,
    /// Its physical core: the smallest CPU id among the core's hardware threads (SMT siblings).
    pub core: usize,
    /// Its package (socket), `physical_package_id`.
    pub package: usize,
    /// Its NUMA node.
    pub node: usize,
    /// Its L3 cache domain (core complex): the smallest CPU id sharing that cache; `None` when
    /// unknown.
    pub l3: Option<usize>,
}

/// The usable CPUs of a machine and their places.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// The usable CPUs, ascending by id.
    pub cpus: Vec<Cpu>,
    /// Whether the NUMA nodes were read (when not, every CPU is in node 0).
    pub numa_known: bool,
    /// What could not be read and what was assumed instead.
    pub notes: Vec<String>,
}

/// A physical core: its usable hardware threads, and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Core {
    /// Its package.
    pub package: usize,
    /// Its NUMA node.
    pub node: usize,
    /// Its usable CPUs (SMT siblings), ascending.
    pub cpus: Vec<usize>,
}

impl Topology {
    /// The topology that a list of NUMA nodes (the CPUs of each, in node order) tells and nothing
    /// more: each CPU a core of its own, each node a package of its own, no L3 domains.
    pub fn from_nodes(nodes: &[Vec<usize>]) -> Topology {
        let mut cpus: Vec<Cpu> = nodes
            .iter()
            .enumerate()
            .flat_map(|(node, ids)| ids.iter().map(move |&id| Cpu { id, core: id, package: node, node, l3: None }))
            .collect();
        cpus.sort_by_key(|c| c.id);
        Topology { cpus, numa_known: !nodes.is_empty(), notes: Vec::new() }
    }

    /// The NUMA nodes that hold usable CPUs, ascending.
    pub fn nodes(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.cpus.iter().map(|c| c.node).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The packages that hold usable CPUs, ascending.
    pub fn packages(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.cpus.iter().map(|c| c.package).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The usable CPUs of NUMA node `node`, ascending.
    pub fn node_cpus(&self, node: usize) -> Vec<usize> {
        self.cpus.iter().filter(|c| c.node == node).map(|c| c.id).collect()
    }

    /// The usable CPUs of package `package`, ascending.
    pub fn package_cpus(&self, package: usize) -> Vec<usize> {
        self.cpus.iter().filter(|c| c.package == package).map(|c| c.id).collect()
    }

    /// The package of NUMA node `node` (that of its first usable CPU).
    pub fn package_of_node(&self, node: usize) -> Option<usize> {
        self.cpus.iter().find(|c| c.node == node).map(|c| c.package)
    }

    /// The physical cores in topology order: by package, NUMA node, then core.
    pub fn cores(&self) -> Vec<Core> {
        let mut by_core: BTreeMap<(usize, usize, usize), Vec<usize>> = BTreeMap::new();
        for c in &self.cpus {
            by_core.entry((c.package, c.node, c.core)).or_default().push(c.id);
        }
        by_core.into_iter().map(|((package, node, _), cpus)| Core { package, node, cpus }).collect()
    }
}

/// Parses a Linux CPU list (`0-3,8,10-11`).
///
/// # Errors
/// A malformed list.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.parse().map_err(|_| format!("bad cpu '{a}'"))?;
                let b: usize = b.parse().map_err(|_| format!("bad cpu '{b}'"))?;
                if a > b {
                    return Err(format!("bad range '{part}'"));
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| format!("bad cpu '{part}'"))?),
        }
    }
    Ok(out)
}

/// A list of ids in Linux's compact form (`0-2,5,7-8`); `ids` ascending.
pub fn cpu_list(ids: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let start = ids[i];
        let mut end = start;
        while i + 1 < ids.len() && ids[i + 1] == end + 1 {
            i += 1;
            end = ids[i];
        }
        out.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    out.join(",")
}

// ------------------------------------------------------------------------------------------------
// Reading the machine.

/// Where the readers look.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    /// The sysfs root (`/sys`).
    pub sys: PathBuf,
    /// The procfs root (`/proc`).
    pub proc: PathBuf,
    /// The device directory (`/dev`).
    pub dev: PathBuf,
}

impl Roots {
    /// The machine's own: `/sys`, `/proc` and `/dev`.
    pub fn real() -> Roots {
        Roots { sys: PathBuf::from("/sys"), proc: PathBuf::from("/proc"), dev: PathBuf::from("/dev") }
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

fn read_number(path: &Path) -> Option<i64> {
    read_trimmed(path)?.parse().ok()
}

fn read_list(path: &Path) -> Option<Vec<usize>> {
    parse_cpu_list(&read_trimmed(path)?).ok().filter(|l| !l.is_empty())
}

/// Reads where the CPUs of `allowed` sit, under the sysfs root `sys`: NUMA nodes from
/// `devices/system/node/node*/cpulist`; per CPU (`devices/system/cpu/cpuN/`) its core from
/// `topology/thread_siblings_list` (else `topology/core_id` within its package), its package from
/// `topology/physical_package_id` and its L3 domain from `cache/index3/shared_cpu_list`. What is
/// missing is assumed (a core of its own, node 0, the node's number as package, no L3 domain) and
/// said in a note. Files shared by SMT siblings or by an L3 domain are read once.
pub fn read_topology(sys: &Path, allowed: &[usize]) -> Topology {
    let mut allowed = allowed.to_vec();
    allowed.sort_unstable();
    allowed.dedup();
    let mut notes = Vec::new();
    let cpu_dir = sys.join("devices/system/cpu");
    let node_dir = sys.join("devices/system/node");

    let mut node_of: HashMap<usize, usize> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir(&node_dir) {
        for entry in dir.filter_map(Result::ok) {
            let name = entry.file_name();
            let Some(node) = name.to_str().and_then(|n| n.strip_prefix("node")).and_then(|n| n.parse::<usize>().ok()) else {
                continue;
            };
            for cpu in read_list(&entry.path().join("cpulist")).unwrap_or_default() {
                node_of.entry(cpu).or_insert(node);
            }
        }
    }
    let numa_known = allowed.iter().any(|c| node_of.contains_key(c));
    let default_node = allowed.iter().filter_map(|c| node_of.get(c)).min().copied().unwrap_or(0);
    if !allowed.is_empty() && !numa_known {
        notes.push(format!(
            "CPU topology: no NUMA node under {} lists this process's CPUs: all of them counted as one node",
            node_dir.display()
        ));
    }

    // Per CPU: (id, core, package if read).
    let mut placed: Vec<(usize, usize, Option<usize>)> = Vec::with_capacity(allowed.len());
    let mut core_of: HashMap<usize, usize> = HashMap::new();
    let mut package_of_core: HashMap<usize, usize> = HashMap::new();
    let mut by_core_id: HashMap<(Option<usize>, usize), usize> = HashMap::new();
    let mut l3_of: HashMap<usize, usize> = HashMap::new();
    let (mut no_core, mut no_package) = (Vec::new(), Vec::new());
    for &c in &allowed {
        let dir = cpu_dir.join(format!("cpu{c}"));
        let mut core = core_of.get(&c).copied();
        if core.is_none()
            && let Some(siblings) = read_list(&dir.join("topology/thread_siblings_list")).filter(|l| l.contains(&c))
        {
            let key = siblings.iter().copied().min().unwrap_or(c);
            for s in siblings {
                core_of.entry(s).or_insert(key);
            }
            core = Some(key);
        }
        let package = core.and_then(|k| package_of_core.get(&k).copied()).or_else(|| {
            let p = read_number(&dir.join("topology/physical_package_id")).and_then(|p| usize::try_from(p).ok());
            if let (Some(k), Some(p)) = (core, p) {
                package_of_core.insert(k, p);
            }
            p
        });
        let core = match core {
            Some(k) => k,
            None => match read_number(&dir.join("topology/core_id")).and_then(|id| usize::try_from(id).ok()) {
                // `allowed` is ascending: a core's key is its first usable CPU.
                Some(id) => *by_core_id.entry((package, id)).or_insert(c),
                None => {
                    no_core.push(c);
                    c
                }
            },
        };
        if package.is_none() {
            no_package.push(c);
        }
        if !l3_of.contains_key(&c)
            && let Some(shared) = read_list(&dir.join("cache/index3/shared_cpu_list")).filter(|l| l.contains(&c))
        {
            let key = shared.iter().copied().min().unwrap_or(c);
            for s in shared {
                l3_of.entry(s).or_insert(key);
            }
        }
        placed.push((c, core, package));
    }

    let unlisted: Vec<usize> = allowed.iter().copied().filter(|c| !node_of.contains_key(c)).collect();
    if numa_known && !unlisted.is_empty() {
        notes.push(format!(
            "CPU topology: CPUs {} are in no NUMA node's cpulist: counted in node {default_node}",
            cpu_list(&unlisted)
        ));
    }
    if !no_core.is_empty() {
        notes.push(format!(
            "CPU topology: no thread_siblings_list or core_id for CPUs {} under {}: each counted as a core of its own",
            cpu_list(&no_core),
            cpu_dir.display()
        ));
    }
    if !no_package.is_empty() {
        notes.push(format!(
            "CPU topology: no physical_package_id for CPUs {} under {}: each counted in the package numbered as its NUMA node",
            cpu_list(&no_package),
            cpu_dir.display()
        ));
    }
    let cpus = placed
        .into_iter()
        .map(|(id, core, package)| {
            let node = node_of.get(&id).copied().unwrap_or(default_node);
            Cpu { id, core, package: package.unwrap_or(node), node, l3: l3_of.get(&id).copied() }
        })
        .collect();
    Topology { cpus, numa_known, notes }
}

/// An NVIDIA GPU: its PCI address, the NUMA node the device is attached to, and what the driver
/// says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciGpu {
    /// The PCI address, `0000:3b:00.0`.
    pub addr: String,
    /// Its NUMA node (`numa_node`); `None` when that reads -1 or cannot be read.
    pub node: Option<usize>,
    /// Its device minor (`/dev/nvidiaN`, the number Slurm's GPU ids give), from the driver's
    /// `information` file (`Device Minor:`); `None` when not read.
    pub minor: Option<u32>,
    /// Its UUID (`GPU-...`), from the same file (`GPU UUID:`); `None` when not read.
    pub uuid: Option<String>,
}

/// The `Device Minor:` and the `GPU UUID:` of the driver's `information` file of a GPU
/// (`<proc>/driver/nvidia/gpus/<addr>/information`: `Key: \t value` lines).
pub fn parse_gpu_information(text: &str) -> (Option<u32>, Option<String>) {
    let (mut minor, mut uuid) = (None, None);
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        match key.trim() {
            "Device Minor" => minor = value.parse().ok(),
            // An unprivileged reader may see `GPU-????????-...` on some drivers: no UUID then.
            "GPU UUID" if value.starts_with("GPU-") && !value.contains('?') => uuid = Some(value.to_owned()),
            _ => {}
        }
    }
    (minor, uuid)
}

/// How many GPU device nodes (`nvidia0`, `nvidia1`, ...; not `nvidiactl` or `nvidia-uvm`) the
/// device directory `dev` holds; `None` when it cannot be listed.
pub fn count_dev_nodes(dev: &Path) -> Option<usize> {
    let entries = std::fs::read_dir(dev).ok()?;
    Some(
        entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_prefix("nvidia"))
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            })
            .count(),
    )
}

/// How many CPUs the kernel has online (`<sys>/devices/system/cpu/online`); `None` when unreadable.
pub fn read_online_cpus(sys: &Path) -> Option<usize> {
    read_list(&sys.join("devices/system/cpu/online")).map(|l| l.len())
}

/// `domain:bus:device.function` as numbers, or `None` when `addr` is not a PCI address.
fn pci_key(addr: &str) -> Option<(u32, u32, u32, u32)> {
    let (domain, rest) = addr.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// The machine's NVIDIA GPUs in PCI bus order (CUDA's numbering under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID`), listed by the driver (`<proc>/driver/nvidia/gpus/<addr>`,
/// else the devices bound to `<sys>/bus/pci/drivers/nvidia`), each with
/// `<sys>/bus/pci/devices/<addr>/numa_node` and the device minor and UUID of
/// `<proc>/driver/nvidia/gpus/<addr>/information`. `None` when neither list can be read. The
/// driver lists every GPU of the machine, also those a cgroup (Slurm's `ConstrainDevices`) keeps
/// this process from opening; see [`gpu_nodes`].
pub fn read_pci_gpus(roots: &Roots) -> Option<Vec<PciGpu>> {
    let list = |dir: PathBuf| -> Option<Vec<String>> {
        let entries = std::fs::read_dir(dir).ok()?;
        Some(
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|name| pci_key(name).is_some())
                .collect(),
        )
    };
    let mut addrs = list(roots.proc.join("driver/nvidia/gpus"))
        .filter(|a| !a.is_empty())
        .or_else(|| list(roots.sys.join("bus/pci/drivers/nvidia")))?;
    addrs.sort_by_key(|a| pci_key(a));
    addrs.dedup();
    let devices = roots.sys.join("bus/pci/devices");
    let information = roots.proc.join("driver/nvidia/gpus");
    Some(
        addrs
            .into_iter()
            .map(|addr| {
                let node = read_number(&devices.join(&addr).join("numa_node")).and_then(|n| usize::try_from(n).ok());
                let (minor, uuid) = std::fs::read_to_string(information.join(&addr).join("information"))
                    .map_or((None, None), |text| parse_gpu_information(&text));
                PciGpu { addr, node, minor, uuid }
            })
            .collect(),
    )
}

// ------------------------------------------------------------------------------------------------
// The pure part: which GPU each worker uses, and its CPUs.

/// What this process's environment says about which GPUs CUDA numbers, and how.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaEnv<'a> {
    /// CUDA_VISIBLE_DEVICES (`None`: unset).
    pub visible: Option<&'a str>,
    /// CUDA_DEVICE_ORDER.
    pub device_order: Option<&'a str>,
    /// The job's GPUs as Slurm lists them, `(variable, value)`: SLURM_STEP_GPUS, else
    /// SLURM_JOB_GPUS (device minors: `4,5,6,7`).
    pub slurm_gpus: Option<(&'a str, &'a str)>,
    /// How many `/dev/nvidiaN` device nodes this process sees (`None`: not read).
    pub dev_nodes: Option<usize>,
}

/// The GPUs that CUDA numbers 0, 1, ... for this process, as indices into `gpus` (the driver's
/// list, in PCI bus order), with a note when they are not simply all of them; or why that is not
/// known.
///
/// - Under Slurm (`slurm_gpus`), the job's GPUs by device minor. With `ConstrainDevices` CUDA can
///   open only those, so it numbers them alone, and Slurm's CUDA_VISIBLE_DEVICES counts from 0
///   (`0,1,2,3` for the GPUs 4-7); without it, Slurm's CUDA_VISIBLE_DEVICES is the ids themselves
///   (`4,5,6,7`), which number all GPUs. A CUDA_VISIBLE_DEVICES equal to the job's list, or naming
///   ids of the job past its count, is the latter; anything else the former.
/// - Else, a `/dev` that shows some `nvidiaN` nodes but not as many as the driver lists GPUs (a
///   container or cgroup hides some): which of them CUDA numbers is not known.
/// - Else all of `gpus`.
fn cuda_numbering(gpus: &[PciGpu], env: &CudaEnv<'_>) -> Result<(Vec<usize>, Option<String>), String> {
    let all: Vec<usize> = (0..gpus.len()).collect();
    if let Some((var, value)) = env.slurm_gpus {
        let Ok(ids) = parse_cpu_list(value) else {
            return Err(format!("{var}={value} is not a list of GPU ids: which GPUs CUDA numbers is not known"));
        };
        if !ids.is_empty() {
            let numbers: Option<Vec<usize>> =
                env.visible.map(|v| v.split(',').map(str::trim).filter_map(|s| s.parse().ok()).collect());
            let numbers_all = match &numbers {
                Some(v) => *v == ids || (v.iter().any(|&i| i >= ids.len()) && v.iter().all(|i| ids.contains(i))),
                None => ids.len() == gpus.len(),
            };
            if numbers_all {
                return Ok((all, None));
            }
            let mut wanted = ids.clone();
            wanted.sort_unstable();
            wanted.dedup();
            let mine: Vec<usize> =
                all.iter().copied().filter(|&k| gpus[k].minor.is_some_and(|m| wanted.binary_search(&(m as usize)).is_ok())).collect();
            if mine.len() != wanted.len() {
                return Err(format!(
                    "{var}={value} names the job's GPUs by device minor, and the driver's list does not show the Device Minor of each: which GPUs CUDA numbers is not known"
                ));
            }
            return Ok((
                mine,
                Some(format!(
                    "GPU numbers count the job's GPUs only ({var}={value}, device minors: a cgroup hides the others from CUDA), in PCI bus order"
                )),
            ));
        }
    }
    if let Some(k) = env.dev_nodes
        && k > 0
        && k != gpus.len()
    {
        return Err(format!(
            "/dev shows {k} GPU device node(s) where the driver lists {} GPUs (a container or cgroup hides some): which of them CUDA numbers is not known",
            gpus.len()
        ));
    }
    Ok((all, None))
}

/// Whether CUDA_VISIBLE_DEVICES entry `entry` (a UUID, or the prefix of one that CUDA accepts)
/// names the GPU whose UUID is `uuid`.
fn uuid_names(entry: &str, uuid: &str) -> bool {
    let (e, u) = (entry.to_ascii_lowercase(), uuid.to_ascii_lowercase());
    e == u || (e.len() > "gpu-".len() && e.starts_with("gpu-") && u.starts_with(&e))
}

/// The NUMA node of the GPU each worker uses. `devices[i]` is worker `i`'s entry as this process
/// sees CUDA_VISIBLE_DEVICES (an index in CUDA's order, or a UUID; `None`, empty or `-1`: no GPU,
/// no locality); `gpus` the machine's GPUs in PCI bus order (`None`: not known).
///
/// An index counts the GPUs CUDA can open (see `cuda_numbering`: under Slurm's
/// `ConstrainDevices` the job's alone, from SLURM_STEP_GPUS or SLURM_JOB_GPUS; not known where a
/// container hides some and Slurm says nothing), in PCI bus order under
/// `CUDA_DEVICE_ORDER=PCI_BUS_ID` (`env.device_order`) and, by default, fastest first, which is the
/// same order for identical GPUs: a note says so when it matters. A UUID is looked up in the
/// driver's `GPU UUID:` lines; one not there (a MIG instance) gives no locality. Each guess and
/// each unknown is noted.
pub fn gpu_nodes(devices: &[Option<String>], gpus: Option<&[PciGpu]>, env: &CudaEnv<'_>, notes: &mut Vec<String>) -> Vec<Option<usize>> {
    let Some(gpus) = gpus.filter(|g| !g.is_empty()) else { return vec![None; devices.len()] };
    let numbering = cuda_numbering(gpus, env);
    let mut by_number = false;
    let mut unknown_uuids: Vec<&str> = Vec::new();
    let nodes: Vec<Option<usize>> = devices
        .iter()
        .map(|d| {
            let d = d.as_deref()?.trim();
            // `-1` is CUDA's "no GPU" (so is any entry it cannot read as a device).
            if d.is_empty() || d.starts_with('-') {
                return None;
            }
            match d.parse::<usize>() {
                Ok(i) => {
                    by_number = true;
                    let (order, _) = numbering.as_ref().ok()?;
                    order.get(i).and_then(|&k| gpus[k].node)
                }
                Err(_) => {
                    let named: Vec<&PciGpu> =
                        gpus.iter().filter(|g| g.uuid.as_deref().is_some_and(|u| uuid_names(d, u))).collect();
                    match named.as_slice() {
                        [g] => g.node,
                        _ => {
                            unknown_uuids.push(d);
                            None
                        }
                    }
                }
            }
        })
        .collect();
    if by_number {
        match &numbering {
            Ok((_, Some(note))) => notes.push(note.clone()),
            Ok((_, None)) => {}
            Err(why) => notes.push(format!("{why}; GPUs named by number in CUDA_VISIBLE_DEVICES get no NUMA locality (by UUID they do)")),
        }
    }
    if !unknown_uuids.is_empty() {
        notes.push(format!(
            "CUDA_VISIBLE_DEVICES names GPUs by UUID ({}) that the driver's GPU UUID lines do not show (a MIG instance, or no readable information file): their NUMA nodes are not known to rsrun",
            unknown_uuids.join(",")
        ));
    }
    if nodes.iter().any(Option::is_some) {
        let shown: Vec<String> = nodes.iter().map(|n| n.map_or_else(|| "?".to_owned(), |n| n.to_string())).collect();
        notes.push(format!("NUMA node of each local rank's GPU (PCI numa_node): {}", shown.join(",")));
        let numbered = numbering.as_ref().map_or(0, |(order, _)| order.len());
        if by_number && numbered > 1 && env.device_order.map(str::trim) != Some("PCI_BUS_ID") {
            notes.push(
                "GPU locality takes CUDA's GPU numbers in PCI bus order: CUDA_DEVICE_ORDER is not PCI_BUS_ID, and its default order (fastest first) is the same only when the GPUs are identical"
                    .into(),
            );
        }
    }
    nodes
}

/// How workers' CPUs are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BindMode {
    /// `--cpu-bind cores`: an equal share of whole physical cores, from the GPU's NUMA node first.
    Cores,
    /// `--cpu-bind numa`: the CPUs of one NUMA node (the GPU's when known).
    Numa,
    /// `--numa-binding node`: the CPUs of the GPU's NUMA node.
    Node,
    /// `--numa-binding socket`: the CPUs of the GPU's package.
    Socket,
    /// `--numa-binding exclusive`: whole cores of the GPU's NUMA node, disjoint between its ranks.
    Exclusive,
    /// `--numa-binding core-complex`: an L3 domain of the GPU's NUMA node, one per rank.
    CoreComplex,
}

impl BindMode {
    /// torchrun's `--numa-binding` value, or `None` for another.
    pub fn from_numa_binding(s: &str) -> Option<BindMode> {
        match s {
            "node" => Some(BindMode::Node),
            "socket" => Some(BindMode::Socket),
            "exclusive" => Some(BindMode::Exclusive),
            "core-complex" => Some(BindMode::CoreComplex),
            _ => None,
        }
    }

    /// The option that asks for it, as typed.
    pub fn flag(self) -> &'static str {
        match self {
            BindMode::Cores => "--cpu-bind cores",
            BindMode::Numa => "--cpu-bind numa",
            BindMode::Node => "--numa-binding node",
            BindMode::Socket => "--numa-binding socket",
            BindMode::Exclusive => "--numa-binding exclusive",
            BindMode::CoreComplex => "--numa-binding core-complex",
        }
    }

    fn is_numa_binding(self) -> bool {
        !matches!(self, BindMode::Cores | BindMode::Numa)
    }
}

/// The CPUs (ascending) of each worker under `mode`, and notes saying what was chosen.
/// `gpu_nodes[i]` is the NUMA node of worker `i`'s GPU (`None`: unknown; see [`gpu_nodes`]); a
/// worker whose GPU's node has none of the usable CPUs counts as unknown. Every set is non-empty
/// when `topo` has CPUs.
pub fn assign(mode: BindMode, topo: &Topology, gpu_nodes: &[Option<usize>], notes: &mut Vec<String>) -> Vec<Vec<usize>> {
    let n = gpu_nodes.len();
    if n == 0 || topo.cpus.is_empty() {
        return vec![Vec::new(); n];
    }
    let nodes = topo.nodes();
    let near: Vec<Option<usize>> = gpu_nodes.iter().map(|g| g.filter(|node| nodes.contains(node))).collect();
    let elsewhere: Vec<usize> = (0..n).filter(|&i| gpu_nodes[i].is_some() && near[i].is_none()).collect();
    if !elsewhere.is_empty() {
        notes.push(format!(
            "{}: the GPU of local rank(s) {} is on a NUMA node without any of this process's CPUs",
            mode.flag(),
            cpu_list(&elsewhere)
        ));
    }
    match mode {
        BindMode::Cores => bind_cores(topo, &near, notes),
        BindMode::Numa | BindMode::Node => {
            if nodes.len() == 1 {
                notes.push(format!("{}: one NUMA node; every worker gets all its CPUs", mode.flag()));
            }
            node_anchors(mode, &nodes, &near, notes).into_iter().map(|node| topo.node_cpus(node)).collect()
        }
        BindMode::Socket => {
            let packages = topo.packages();
            let unknown: Vec<usize> = (0..n).filter(|&i| near[i].is_none()).collect();
            if !unknown.is_empty() {
                notes.push(format!(
                    "{}: no GPU NUMA node known for local rank(s) {}: spread over the {} package(s) in order",
                    mode.flag(),
                    cpu_list(&unknown),
                    packages.len()
                ));
            }
            (0..n)
                .map(|i| {
                    let package = near[i].and_then(|node| topo.package_of_node(node)).unwrap_or(packages[i * packages.len() / n]);
                    topo.package_cpus(package)
                })
                .collect()
        }
        BindMode::Exclusive => bind_exclusive(mode, topo, &nodes, &near, notes),
        BindMode::CoreComplex => bind_core_complex(mode, topo, &nodes, &near, notes),
    }
}

/// Each worker's NUMA node: its GPU's, else spread over `nodes` in order (worker `i` of `n` on
/// node `i * nodes / n`, as `--cpu-bind numa` always did), with a note when that is a fallback.
fn node_anchors(mode: BindMode, nodes: &[usize], near: &[Option<usize>], notes: &mut Vec<String>) -> Vec<usize> {
    let n = near.len();
    let unknown: Vec<usize> = (0..n).filter(|&i| near[i].is_none()).collect();
    // `--cpu-bind numa` without any GPU locality is the plain spread it always was.
    if !unknown.is_empty() && (mode.is_numa_binding() || unknown.len() < n) {
        notes.push(format!(
            "{}: no GPU NUMA node known for local rank(s) {}: spread over the {} NUMA node(s) in order",
            mode.flag(),
            cpu_list(&unknown),
            nodes.len()
        ));
    }
    (0..n).map(|i| near[i].unwrap_or(nodes[i * nodes.len() / n])).collect()
}

/// `count` items shared by `k` takers as evenly as possible, the first ones one more.
fn fair(count: usize, k: usize) -> Vec<usize> {
    (0..k).map(|j| count / k + usize::from(j < count % k)).collect()
}

fn flatten(cores: &[&Core]) -> Vec<usize> {
    let mut cpus: Vec<usize> = cores.iter().flat_map(|c| c.cpus.iter().copied()).collect();
    cpus.sort_unstable();
    cpus
}

/// `--cpu-bind cores`: each worker an equal share of whole physical cores (SMT siblings together).
/// Without GPU locality, contiguous in topology order; with it, each worker's share comes from its
/// GPU's NUMA node first (the node's cores shared fairly among the workers near it), and what a
/// node lacks from the cores left, the same package first. More workers than cores: the cores'
/// hardware threads split between them ([`split_siblings`]); more than hardware threads: one core
/// each, round-robin.
fn bind_cores(topo: &Topology, near: &[Option<usize>], notes: &mut Vec<String>) -> Vec<Vec<usize>> {
    let flag = BindMode::Cores.flag();
    let n = near.len();
    let cores = topo.cores();
    let c = cores.len();
    let threads = topo.cpus.len();
    if n > c && n <= threads {
        return split_siblings(&cores, n, threads, notes);
    }
    if n > c {
        notes.push(format!("{flag}: {n} workers share {c} physical cores ({threads} CPUs; one core each, round-robin)"));
        return (0..n).map(|i| cores[i % c].cpus.clone()).collect();
    }
    let quota = fair(c, n);
    let (lo, hi) = (c / n, c.div_ceil(n));
    let each = if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") };
    if near.iter().all(Option::is_none) {
        notes.push(format!(
            "{flag}: {each} whole physical core(s) per worker ({c} cores, {threads} CPUs: SMT siblings stay together), in topology order"
        ));
        let mut start = 0;
        return quota
            .iter()
            .map(|&q| {
                let mine: Vec<&Core> = cores[start..start + q].iter().collect();
                start += q;
                flatten(&mine)
            })
            .collect();
    }
    notes.push(format!(
        "{flag}: {each} whole physical core(s) per worker ({c} cores, {threads} CPUs: SMT siblings stay together), from the NUMA node of its GPU first"
    ));
    let mut taken = vec![false; c];
    let mut got: Vec<Vec<usize>> = vec![Vec::new(); n];
    for node in topo.nodes() {
        let workers: Vec<usize> = (0..n).filter(|&i| near[i] == Some(node)).collect();
        if workers.is_empty() {
            continue;
        }
        let free: Vec<usize> = (0..c).filter(|&k| cores[k].node == node).collect();
        let want: usize = workers.iter().map(|&w| quota[w]).sum();
        let shares: Vec<usize> = if want <= free.len() {
            workers.iter().map(|&w| quota[w]).collect()
        } else {
            fair(free.len(), workers.len()).into_iter().zip(&workers).map(|(s, &w)| s.min(quota[w])).collect()
        };
        let mut next = 0;
        for (&w, &s) in workers.iter().zip(&shares) {
            for &k in &free[next..next + s] {
                taken[k] = true;
                got[w].push(k);
            }
            next += s;
        }
    }
    // The shares still short (no GPU locality, or a node with too few cores): from the cores
    // left, in the package of the worker's GPU first, then in topology order. The quotas add up to
    // the cores, so exactly enough are left.
    let mut short = Vec::new();
    for (w, mine) in got.iter_mut().enumerate() {
        let need = quota[w] - mine.len();
        if need == 0 {
            continue;
        }
        if near[w].is_some() {
            short.push(w);
        }
        let package = near[w].and_then(|node| topo.package_of_node(node));
        let mut left: Vec<usize> = (0..c).filter(|&k| !taken[k]).collect();
        left.sort_by_key(|&k| (package.is_some_and(|p| cores[k].package != p), k));
        for &k in left.iter().take(need) {
            taken[k] = true;
            mine.push(k);
        }
    }
    if !short.is_empty() {
        notes.push(format!(
            "{flag}: the NUMA node of the GPU of local rank(s) {} has too few cores for their share: the rest are nearby cores",
            cpu_list(&short)
        ));
    }
    got.iter().map(|ks| flatten(&ks.iter().map(|&k| &cores[k]).collect::<Vec<_>>())).collect()
}

/// `--cpu-bind cores` with more workers than physical cores but no more than hardware threads:
/// every core takes one worker, then, round after round, each core with a thread to spare one
/// more, until every worker has one (with two threads a core: the first cores take two workers,
/// the others one); a core's workers share its threads evenly. So each worker has hardware
/// threads of its own, all in one core, and a core of two threads is split between two workers at
/// most. In topology order, without GPU locality.
fn split_siblings(cores: &[Core], n: usize, threads: usize, notes: &mut Vec<String>) -> Vec<Vec<usize>> {
    let flag = BindMode::Cores.flag();
    let c = cores.len();
    let mut takers = vec![1usize; c];
    // The caller has c < n <= threads: a round that is due always finds a core with a spare thread.
    let mut extra = n - c;
    while extra > 0 {
        for (k, core) in cores.iter().enumerate() {
            if extra > 0 && takers[k] < core.cpus.len() {
                takers[k] += 1;
                extra -= 1;
            }
        }
    }
    let mut out = Vec::with_capacity(n);
    for (core, &t) in cores.iter().zip(&takers) {
        let mut start = 0;
        for q in fair(core.cpus.len(), t) {
            out.push(core.cpus[start..start + q].to_vec());
            start += q;
        }
    }
    let most = takers.iter().copied().max().unwrap_or(1);
    notes.push(format!(
        "{flag}: {n} workers on {c} physical cores ({threads} CPUs): the SMT siblings of a core are split between up to {most} workers, each with hardware thread(s) of its own, in topology order (without GPU locality)"
    ));
    out
}

/// The workers (local ranks, ascending) whose node is `node`.
fn workers_on(anchor: &[usize], node: usize) -> Vec<usize> {
    (0..anchor.len()).filter(|&i| anchor[i] == node).collect()
}

/// `--numa-binding exclusive`: the whole cores of each worker's NUMA node, shared by the workers on
/// it into disjoint, contiguous shares (the lower local ranks one more when they do not divide).
fn bind_exclusive(mode: BindMode, topo: &Topology, nodes: &[usize], near: &[Option<usize>], notes: &mut Vec<String>) -> Vec<Vec<usize>> {
    let anchor = node_anchors(mode, nodes, near, notes);
    let cores = topo.cores();
    let mut out = vec![Vec::new(); near.len()];
    for &node in nodes {
        let workers = workers_on(&anchor, node);
        if workers.is_empty() {
            continue;
        }
        let here: Vec<&Core> = cores.iter().filter(|c| c.node == node).collect();
        let c = here.len();
        if c < workers.len() {
            notes.push(format!(
                "{}: {} ranks share the {c} physical core(s) of NUMA node {node} (one core each, round-robin)",
                mode.flag(),
                workers.len()
            ));
            for (j, &w) in workers.iter().enumerate() {
                out[w] = here[j % c].cpus.clone();
            }
            continue;
        }
        let mut start = 0;
        for (&w, q) in workers.iter().zip(fair(c, workers.len())) {
            out[w] = flatten(&here[start..start + q]);
            start += q;
        }
    }
    out
}

/// `--numa-binding core-complex`: each worker one L3 domain of its NUMA node, the largest first,
/// a different one for each worker on the node while there are enough (then round-robin).
fn bind_core_complex(mode: BindMode, topo: &Topology, nodes: &[usize], near: &[Option<usize>], notes: &mut Vec<String>) -> Vec<Vec<usize>> {
    let anchor = node_anchors(mode, nodes, near, notes);
    let mut out = vec![Vec::new(); near.len()];
    for &node in nodes {
        let workers = workers_on(&anchor, node);
        if workers.is_empty() {
            continue;
        }
        let cpus: Vec<&Cpu> = topo.cpus.iter().filter(|c| c.node == node).collect();
        let mut domains: Vec<Vec<usize>> = if cpus.iter().all(|c| c.l3.is_some()) {
            let mut by_l3: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for c in &cpus {
                by_l3.entry(c.l3.unwrap_or(c.id)).or_default().push(c.id);
            }
            by_l3.into_values().collect()
        } else {
            notes.push(format!(
                "{}: no L3 cache domain (cache/index3/shared_cpu_list) for some CPUs of NUMA node {node}: the whole node counts as one",
                mode.flag()
            ));
            vec![cpus.iter().map(|c| c.id).collect()]
        };
        // The largest domains first, then by their first CPU (torch's order).
        domains.sort_by_key(|d| (std::cmp::Reverse(d.len()), d.first().copied()));
        if workers.len() > domains.len() {
            notes.push(format!(
                "{}: {} ranks share the {} L3 domain(s) of NUMA node {node} (round-robin)",
                mode.flag(),
                workers.len(),
                domains.len()
            ));
        }
        for (j, &w) in workers.iter().enumerate() {
            out[w] = domains[j % domains.len()].clone();
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
