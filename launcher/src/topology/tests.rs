use std::collections::HashSet;
use std::path::Path;

use super::*;

/// 2 packages, one NUMA node each, 8 cores of 2 hardware threads, numbered the Linux way: CPUs
/// 0-7 are the first threads of cores 0-7, CPUs 8-15 their SMT siblings (core k: CPUs k and k+8).
/// Package/node 0 has cores 0-3, package/node 1 cores 4-7; each pair of cores shares an L3 cache.
pub(crate) fn linux_machine() -> Topology {
    let cpus = (0..16)
        .map(|id| {
            let core = id % 8;
            Cpu { id, core, package: core / 4, node: core / 4, l3: Some(core / 2 * 2) }
        })
        .collect();
    Topology { cpus, numa_known: true, notes: Vec::new() }
}

/// The UUID the fixtures give GPU `minor`.
pub(crate) fn uuid(minor: u32) -> String {
    format!("GPU-{minor:08x}-aaaa-bbbb-cccc-dddddddddddd")
}

/// Four GPUs in PCI bus order: GPUs 0 and 1 on NUMA node 1, GPUs 2 and 3 on node 0; device minors
/// in the same order.
pub(crate) fn four_gpus() -> Vec<PciGpu> {
    [("0000:01:00.0", 1), ("0000:41:00.0", 1), ("0000:81:00.0", 0), ("0000:c1:00.0", 0)]
        .into_iter()
        .zip(0..)
        .map(|((addr, node), minor)| PciGpu { addr: addr.to_owned(), node: Some(node), minor: Some(minor), uuid: Some(uuid(minor)) })
        .collect()
}

/// Eight GPUs in PCI bus order, device minors 0-7 in the same order: GPUs 0-3 on NUMA node 0,
/// GPUs 4-7 on node 1.
pub(crate) fn eight_gpus() -> Vec<PciGpu> {
    (0..8u32)
        .map(|minor| PciGpu {
            addr: format!("0000:{:02x}:00.0", 0x10 * (minor + 1)),
            node: Some(minor as usize / 4),
            minor: Some(minor),
            uuid: Some(uuid(minor)),
        })
        .collect()
}

/// The driver's `information` file of a GPU, as it prints it.
fn information(minor: u32) -> String {
    format!(
        "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 17\nGPU UUID: \t {}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\nBus Location: \t 0000:01:00.0\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n",
        uuid(minor)
    )
}

fn put(root: &Path, rel: &str, text: &str) {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// `linux_machine` as sysfs shows it, with or without `thread_siblings_list` and the L3 caches.
fn fake_sysfs(root: &Path, siblings: bool, l3: bool) {
    put(root, "devices/system/node/node0/cpulist", "0-3,8-11\n");
    put(root, "devices/system/node/node1/cpulist", "4-7,12-15\n");
    put(root, "devices/system/node/possible", "0-1\n");
    for c in 0..16 {
        let core = c % 8;
        let base = format!("devices/system/cpu/cpu{c}");
        put(root, &format!("{base}/topology/physical_package_id"), &format!("{}\n", core / 4));
        put(root, &format!("{base}/topology/core_id"), &format!("{}\n", core % 4));
        if siblings {
            put(root, &format!("{base}/topology/thread_siblings_list"), &format!("{core},{}\n", core + 8));
        }
        if l3 {
            let d = core / 2 * 2;
            put(root, &format!("{base}/cache/index3/shared_cpu_list"), &format!("{d}-{},{}-{}\n", d + 1, d + 8, d + 9));
        }
    }
}

fn assign_quiet(mode: BindMode, topo: &Topology, gpu_nodes: &[Option<usize>]) -> Vec<Vec<usize>> {
    assign(mode, topo, gpu_nodes, &mut Vec::new())
}

/// No two sets share a CPU, and every set holds whole cores (all SMT siblings together).
fn assert_disjoint_whole_cores(topo: &Topology, sets: &[Vec<usize>]) {
    let mut seen = HashSet::new();
    for set in sets {
        for &cpu in set {
            assert!(seen.insert(cpu), "CPU {cpu} is in two sets: {sets:?}");
        }
        for core in topo.cores() {
            let inside = core.cpus.iter().filter(|c| set.contains(c)).count();
            assert!(inside == 0 || inside == core.cpus.len(), "core {:?} split by {set:?}", core.cpus);
        }
    }
}

#[test]
fn the_reader_reads_cores_packages_nodes_and_l3_domains() {
    let dir = tempfile::tempdir().unwrap();
    fake_sysfs(dir.path(), true, true);
    let all: Vec<usize> = (0..16).collect();
    let topo = read_topology(dir.path(), &all);
    assert_eq!(topo, linux_machine());
    // Without thread_siblings_list, core_id within the package tells the same cores.
    let dir = tempfile::tempdir().unwrap();
    fake_sysfs(dir.path(), false, true);
    assert_eq!(read_topology(dir.path(), &all), linux_machine());
    // Only the usable CPUs are placed.
    let dir = tempfile::tempdir().unwrap();
    fake_sysfs(dir.path(), true, true);
    let topo = read_topology(dir.path(), &[4, 5, 12, 13]);
    assert_eq!(topo.nodes(), vec![1]);
    assert_eq!(topo.packages(), vec![1]);
    assert_eq!(topo.cores().iter().map(|c| c.cpus.clone()).collect::<Vec<_>>(), vec![vec![4, 12], vec![5, 13]]);
    assert!(topo.notes.is_empty(), "{:?}", topo.notes);
}

#[test]
fn a_missing_sysfs_degrades_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let topo = read_topology(&dir.path().join("absent"), &[0, 1, 2]);
    assert!(!topo.numa_known);
    assert_eq!(
        topo.cpus,
        (0..3).map(|id| Cpu { id, core: id, package: 0, node: 0, l3: None }).collect::<Vec<_>>(),
        "each CPU its own core, one node"
    );
    assert!(topo.notes.iter().any(|n| n.contains("NUMA node")), "{:?}", topo.notes);
    assert!(topo.notes.iter().any(|n| n.contains("a core of its own")), "{:?}", topo.notes);
    assert_eq!(assign_quiet(BindMode::Cores, &topo, &[None; 3]), vec![vec![0], vec![1], vec![2]]);
    let mut notes = Vec::new();
    assert_eq!(assign(BindMode::Node, &topo, &[None, None], &mut notes), vec![vec![0, 1, 2]; 2]);
    assert!(notes.iter().any(|n| n.contains("one NUMA node")), "{notes:?}");
    // No L3 caches: core-complex takes the whole node, and says so.
    let dir = tempfile::tempdir().unwrap();
    fake_sysfs(dir.path(), true, false);
    let topo = read_topology(dir.path(), &(0..16).collect::<Vec<_>>());
    let mut notes = Vec::new();
    let sets = assign(BindMode::CoreComplex, &topo, &[Some(1)], &mut notes);
    assert_eq!(sets, vec![vec![4, 5, 6, 7, 12, 13, 14, 15]]);
    assert!(notes.iter().any(|n| n.contains("no L3 cache domain")), "{notes:?}");
}

#[test]
fn cores_are_whole_physical_cores_never_shared() {
    let topo = linux_machine();
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[None; 4], &mut notes);
    assert_eq!(sets, vec![vec![0, 1, 8, 9], vec![2, 3, 10, 11], vec![4, 5, 12, 13], vec![6, 7, 14, 15]]);
    assert_disjoint_whole_cores(&topo, &sets);
    assert!(notes.iter().any(|n| n.contains("2 whole physical core(s) per worker")), "{notes:?}");
    // Shares that do not divide: the lower local ranks get one more.
    let sets = assign_quiet(BindMode::Cores, &topo, &[None; 3]);
    assert_eq!(sets.iter().map(Vec::len).collect::<Vec<_>>(), vec![6, 6, 4]);
    assert_disjoint_whole_cores(&topo, &sets);
    // More workers than hardware threads: one core each, round-robin, said in a note.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[None; 20], &mut notes);
    assert_eq!(sets[0], vec![0, 8]);
    assert_eq!(sets[8], vec![0, 8]);
    assert!(notes.iter().any(|n| n.contains("20 workers share 8 physical cores")), "{notes:?}");
}

/// More workers than physical cores but no more than hardware threads: the SMT siblings are split,
/// each worker with threads of its own, a core split between two workers at most.
#[test]
fn cores_split_smt_siblings_when_workers_outnumber_cores() {
    let topo = linux_machine();
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[None; 10], &mut notes);
    // Cores 0 and 1 (CPUs 0,8 and 1,9) take two workers each, the other six one each.
    assert_eq!(sets[..4], [vec![0], vec![8], vec![1], vec![9]]);
    assert_eq!(sets[4..], [vec![2, 10], vec![3, 11], vec![4, 12], vec![5, 13], vec![6, 14], vec![7, 15]]);
    assert!(notes.iter().any(|n| n.contains("10 workers on 8 physical cores") && n.contains("up to 2 workers")), "{notes:?}");
    // As many workers as hardware threads: one each.
    let sets = assign_quiet(BindMode::Cores, &topo, &[None; 16]);
    let mut all: Vec<usize> = sets.iter().flatten().copied().collect();
    assert!(sets.iter().all(|s| s.len() == 1), "{sets:?}");
    all.sort_unstable();
    assert_eq!(all, (0..16).collect::<Vec<_>>());
    // Every worker's threads are its own, and within one core shared by at most two workers.
    for n in 9..=16 {
        let sets = assign_quiet(BindMode::Cores, &topo, &vec![None; n]);
        let mut seen = HashSet::new();
        for set in &sets {
            assert!(!set.is_empty());
            assert!(set.iter().all(|c| seen.insert(*c)), "{n} workers: {sets:?}");
            assert!(set.iter().all(|c| c % 8 == set[0] % 8), "{n} workers: {set:?} spans cores");
        }
        for core in 0..8 {
            let sharing = sets.iter().filter(|s| s[0] % 8 == core).count();
            assert!((1..=2).contains(&sharing), "{n} workers: core {core} taken by {sharing}");
        }
    }
    // Cores of one thread (no SMT) next to cores of two: the extra workers go where threads are spare.
    let cpus = vec![
        Cpu { id: 0, core: 0, package: 0, node: 0, l3: None },
        Cpu { id: 1, core: 1, package: 0, node: 0, l3: None },
        Cpu { id: 2, core: 2, package: 0, node: 0, l3: None },
        Cpu { id: 3, core: 1, package: 0, node: 0, l3: None },
    ];
    let hybrid = Topology { cpus, numa_known: true, notes: Vec::new() };
    assert_eq!(assign_quiet(BindMode::Cores, &hybrid, &[None; 4]), vec![vec![0], vec![1], vec![3], vec![2]]);
}

#[test]
fn cores_come_from_the_gpus_numa_node_first() {
    let topo = linux_machine();
    // GPUs 0 and 1 on node 1, GPUs 2 and 3 on node 0.
    let near = [Some(1), Some(1), Some(0), Some(0)];
    let sets = assign_quiet(BindMode::Cores, &topo, &near);
    assert_eq!(sets, vec![vec![4, 5, 12, 13], vec![6, 7, 14, 15], vec![0, 1, 8, 9], vec![2, 3, 10, 11]]);
    assert_disjoint_whole_cores(&topo, &sets);
    // Two workers near node 1 share its cores fairly; the rest of their shares come from node 0.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[Some(1), Some(1)], &mut notes);
    assert_eq!(sets, vec![vec![0, 1, 4, 5, 8, 9, 12, 13], vec![2, 3, 6, 7, 10, 11, 14, 15]]);
    assert_disjoint_whole_cores(&topo, &sets);
    assert!(notes.iter().any(|n| n.contains("too few cores")), "{notes:?}");
    // A GPU on a node without usable CPUs counts as unknown, with a note.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[Some(7), None], &mut notes);
    assert_eq!(sets, vec![vec![0, 1, 2, 3, 8, 9, 10, 11], vec![4, 5, 6, 7, 12, 13, 14, 15]]);
    assert!(notes.iter().any(|n| n.contains("without any of this process's CPUs")), "{notes:?}");
}

#[test]
fn numa_and_node_take_the_gpus_node() {
    let topo = linux_machine();
    let node0 = vec![0, 1, 2, 3, 8, 9, 10, 11];
    let node1 = vec![4, 5, 6, 7, 12, 13, 14, 15];
    for mode in [BindMode::Numa, BindMode::Node] {
        let sets = assign_quiet(mode, &topo, &[Some(1), Some(1), Some(0), Some(0)]);
        assert_eq!(sets, vec![node1.clone(), node1.clone(), node0.clone(), node0.clone()], "{mode:?}");
    }
    // `--cpu-bind numa` without GPUs spreads over the nodes in order, quietly, as it always did.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Numa, &topo, &[None; 4], &mut notes);
    assert_eq!(sets, vec![node0.clone(), node0.clone(), node1.clone(), node1.clone()]);
    assert!(notes.is_empty(), "{notes:?}");
    // torchrun's --numa-binding without GPUs falls back the same way, and says so.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Node, &topo, &[None, None], &mut notes);
    assert_eq!(sets, vec![node0, node1]);
    assert!(notes.iter().any(|n| n.contains("--numa-binding node: no GPU NUMA node known for local rank(s) 0-1")), "{notes:?}");
}

#[test]
fn socket_takes_the_gpus_package() {
    // One package of two NUMA nodes (sub-NUMA clustering), 4 CPUs each.
    let cpus = (0..8).map(|id| Cpu { id, core: id, package: 0, node: id / 4, l3: None }).collect();
    let snc = Topology { cpus, numa_known: true, notes: Vec::new() };
    assert_eq!(assign_quiet(BindMode::Socket, &snc, &[Some(1)]), vec![(0..8).collect::<Vec<_>>()]);
    assert_eq!(assign_quiet(BindMode::Node, &snc, &[Some(1)]), vec![vec![4, 5, 6, 7]]);
    // Without GPUs: the packages in turn.
    let topo = linux_machine();
    let mut notes = Vec::new();
    let sets = assign(BindMode::Socket, &topo, &[None, None], &mut notes);
    assert_eq!(sets, vec![vec![0, 1, 2, 3, 8, 9, 10, 11], vec![4, 5, 6, 7, 12, 13, 14, 15]]);
    assert!(notes.iter().any(|n| n.contains("package")), "{notes:?}");
}

#[test]
fn exclusive_gives_disjoint_cores_within_each_gpus_node() {
    let topo = linux_machine();
    let sets = assign_quiet(BindMode::Exclusive, &topo, &[Some(1), Some(1), Some(0), Some(0)]);
    assert_eq!(sets, vec![vec![4, 5, 12, 13], vec![6, 7, 14, 15], vec![0, 1, 8, 9], vec![2, 3, 10, 11]]);
    assert_disjoint_whole_cores(&topo, &sets);
    // Three ranks near node 0 share its 4 cores (the lowest one more); node 1 stays free.
    let sets = assign_quiet(BindMode::Exclusive, &topo, &[Some(0), Some(0), Some(0)]);
    assert_eq!(sets, vec![vec![0, 1, 8, 9], vec![2, 10], vec![3, 11]]);
    assert_disjoint_whole_cores(&topo, &sets);
    // More ranks than the node's cores: round-robin, with a note.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Exclusive, &topo, &[Some(0); 5], &mut notes);
    assert_eq!(sets[4], vec![0, 8]);
    assert!(notes.iter().any(|n| n.contains("5 ranks share the 4 physical core(s) of NUMA node 0")), "{notes:?}");
}

#[test]
fn core_complex_picks_l3_domains_within_the_gpus_node() {
    let topo = linux_machine();
    let sets = assign_quiet(BindMode::CoreComplex, &topo, &[Some(1), Some(1), Some(0), Some(0)]);
    assert_eq!(sets, vec![vec![4, 5, 12, 13], vec![6, 7, 14, 15], vec![0, 1, 8, 9], vec![2, 3, 10, 11]]);
    // A third rank on node 0 shares a domain, with a note.
    let mut notes = Vec::new();
    let sets = assign(BindMode::CoreComplex, &topo, &[Some(0); 3], &mut notes);
    assert_eq!(sets, vec![vec![0, 1, 8, 9], vec![2, 3, 10, 11], vec![0, 1, 8, 9]]);
    assert!(notes.iter().any(|n| n.contains("3 ranks share the 2 L3 domain(s) of NUMA node 0")), "{notes:?}");
    // The largest domain first.
    let cpus = (0..6).map(|id| Cpu { id, core: id, package: 0, node: 0, l3: Some(if id < 2 { 0 } else { 2 }) }).collect();
    let uneven = Topology { cpus, numa_known: true, notes: Vec::new() };
    assert_eq!(assign_quiet(BindMode::CoreComplex, &uneven, &[Some(0), Some(0)]), vec![vec![2, 3, 4, 5], vec![0, 1]]);
}

fn fake_roots(dir: &Path) -> Roots {
    Roots { sys: dir.join("sys"), proc: dir.join("proc"), dev: dir.join("dev") }
}

#[test]
fn gpus_are_read_in_pci_bus_order_with_their_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let roots = fake_roots(dir.path());
    assert_eq!(read_pci_gpus(&roots), None, "no driver: no list");
    for (addr, node, minor) in [("0000:c1:00.0", 0, 3), ("0000:41:00.0", 1, 1), ("0000:01:00.0", 1, 0), ("0000:81:00.0", 0, 2)] {
        put(&roots.proc, &format!("driver/nvidia/gpus/{addr}/information"), &information(minor));
        put(&roots.sys, &format!("bus/pci/devices/{addr}/numa_node"), &format!("{node}\n"));
    }
    assert_eq!(read_pci_gpus(&roots), Some(four_gpus()));
    // An information file without the minor or the UUID: those are unknown.
    put(&roots.proc, "driver/nvidia/gpus/0000:41:00.0/information", "Model: test\n");
    let gpus = read_pci_gpus(&roots).unwrap();
    assert_eq!((gpus[1].minor, gpus[1].uuid.as_deref()), (None, None));
    assert_eq!(gpus[0], four_gpus()[0]);
    // The driver's sysfs directory when /proc has no list; numa_node -1 is unknown.
    let dir = tempfile::tempdir().unwrap();
    let roots = fake_roots(dir.path());
    for name in ["0001:02:00.0", "0000:ff:00.0"] {
        std::fs::create_dir_all(roots.sys.join("bus/pci/drivers/nvidia").join(name)).unwrap();
    }
    put(&roots.sys, "bus/pci/drivers/nvidia/bind", "");
    put(&roots.sys, "bus/pci/drivers/nvidia/module/refcnt", "1\n");
    put(&roots.sys, "bus/pci/devices/0000:ff:00.0/numa_node", "-1\n");
    put(&roots.sys, "bus/pci/devices/0001:02:00.0/numa_node", "3\n");
    assert_eq!(
        read_pci_gpus(&roots),
        Some(vec![
            PciGpu { addr: "0000:ff:00.0".into(), node: None, minor: None, uuid: None },
            PciGpu { addr: "0001:02:00.0".into(), node: Some(3), minor: None, uuid: None },
        ])
    );
}

#[test]
fn the_drivers_information_file_gives_the_minor_and_the_uuid() {
    assert_eq!(parse_gpu_information(&information(5)), (Some(5), Some(uuid(5))));
    assert_eq!(parse_gpu_information("Model: x\n"), (None, None));
    // A masked UUID is none.
    assert_eq!(parse_gpu_information("GPU UUID: \t GPU-????????-????\nDevice Minor: \t 2\n"), (Some(2), None));
}

#[test]
fn device_nodes_and_online_cpus_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let roots = fake_roots(dir.path());
    assert_eq!(count_dev_nodes(&roots.dev), None, "no /dev: not known");
    for name in ["nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm", "nvidia-modeset", "null"] {
        put(&roots.dev, name, "");
    }
    std::fs::create_dir_all(roots.dev.join("nvidia-caps")).unwrap();
    assert_eq!(count_dev_nodes(&roots.dev), Some(3));
    assert_eq!(read_online_cpus(&roots.sys), None);
    put(&roots.sys, "devices/system/cpu/online", "0-15,32-47\n");
    assert_eq!(read_online_cpus(&roots.sys), Some(32));
}

fn entries(list: &[&str]) -> Vec<Option<String>> {
    list.iter().map(|s| Some(s.to_string())).collect()
}

fn cuda<'a>(visible: Option<&'a str>, slurm: Option<(&'a str, &'a str)>, dev_nodes: Option<usize>) -> CudaEnv<'a> {
    CudaEnv { visible, device_order: Some("PCI_BUS_ID"), slurm_gpus: slurm, dev_nodes }
}

#[test]
fn cuda_visible_devices_maps_local_ranks_to_physical_gpus() {
    let gpus = four_gpus();
    // CUDA_VISIBLE_DEVICES=2,3: local rank 0 uses physical GPU 2, on node 0.
    let mut notes = Vec::new();
    let env = CudaEnv { visible: Some("2,3"), ..CudaEnv::default() };
    assert_eq!(gpu_nodes(&entries(&["2", "3"]), Some(gpus.as_slice()), &env, &mut notes), vec![Some(0), Some(0)]);
    assert!(notes.iter().any(|n| n.ends_with(": 0,0")), "{notes:?}");
    assert!(notes.iter().any(|n| n.contains("CUDA_DEVICE_ORDER is not PCI_BUS_ID")), "{notes:?}");
    let mut notes = Vec::new();
    let env = cuda(None, None, Some(4));
    assert_eq!(gpu_nodes(&entries(&["0", "1", "2", "3"]), Some(gpus.as_slice()), &env, &mut notes), vec![Some(1), Some(1), Some(0), Some(0)]);
    assert!(!notes.iter().any(|n| n.contains("CUDA_DEVICE_ORDER")), "{notes:?}");
    // An unknown UUID gives no locality, and says so; an index the machine lacks neither.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["GPU-5c1e", "0", "9"]), Some(gpus.as_slice()), &cuda(None, None, None), &mut notes), vec![None, Some(1), None]);
    assert!(notes.iter().any(|n| n.contains("UUID") && n.contains("GPU-5c1e")), "{notes:?}");
    // No GPU list: nothing known, nothing said.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["0", "1"]), None, &CudaEnv::default(), &mut notes), vec![None, None]);
    assert!(notes.is_empty(), "{notes:?}");
}

/// UUIDs (whole, or the prefix CUDA accepts) are found through the driver's GPU UUID lines; `-1`
/// is CUDA's "no GPU", not a UUID.
#[test]
fn uuids_are_looked_up_and_minus_one_is_no_gpu() {
    let gpus = four_gpus();
    let mut notes = Vec::new();
    // Whole (in any case), a prefix (GPU-00000003, GPU 3's), a MIG instance's, and `-1`.
    let mig = "MIG-0b9e1c2d-1111-2222-3333-444444444444";
    let list = [uuid(2).to_uppercase(), uuid(3)[..12].to_owned(), mig.to_owned(), "-1".to_owned()];
    let devices: Vec<Option<String>> = list.iter().cloned().map(Some).collect();
    assert_eq!(gpu_nodes(&devices, Some(gpus.as_slice()), &cuda(None, None, None), &mut notes), vec![Some(0), Some(0), None, None]);
    let unknown: Vec<&String> = notes.iter().filter(|n| n.contains("by UUID")).collect();
    assert_eq!(unknown.len(), 1, "{notes:?}");
    assert!(unknown[0].contains(&format!("({mig})")), "only the MIG instance is unknown: {notes:?}");
    // A prefix two GPUs share names neither.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["GPU-0000000"]), Some(gpus.as_slice()), &cuda(None, None, None), &mut notes), vec![None]);
    // `-1` alone: no GPU, and nothing to say about UUIDs.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["-1"]), Some(gpus.as_slice()), &cuda(Some("-1"), None, None), &mut notes), vec![None]);
    assert!(!notes.iter().any(|n| n.contains("UUID")), "{notes:?}");
}

/// Under Slurm's ConstrainDevices the job's GPUs 4-7 are CUDA's 0-3: the numbers go through
/// SLURM_STEP_GPUS (device minors); without it Slurm's numbers are the minors themselves.
#[test]
fn slurm_job_gpus_translate_cuda_numbers() {
    let gpus = eight_gpus();
    let slurm = Some(("SLURM_STEP_GPUS", "4,5,6,7"));
    // Constrained: CUDA_VISIBLE_DEVICES=0,1,2,3 are the GPUs 4-7, on node 1.
    let mut notes = Vec::new();
    let env = cuda(Some("0,1,2,3"), slurm, Some(8));
    assert_eq!(gpu_nodes(&entries(&["0", "1", "2", "3"]), Some(gpus.as_slice()), &env, &mut notes), vec![Some(1); 4]);
    assert!(notes.iter().any(|n| n.contains("job's GPUs only") && n.contains("SLURM_STEP_GPUS=4,5,6,7")), "{notes:?}");
    // Not constrained: CUDA_VISIBLE_DEVICES=4,5,6,7 number all GPUs.
    let mut notes = Vec::new();
    let env = cuda(Some("4,5,6,7"), slurm, Some(8));
    assert_eq!(gpu_nodes(&entries(&["4", "5"]), Some(gpus.as_slice()), &env, &mut notes), vec![Some(1), Some(1)]);
    assert!(!notes.iter().any(|n| n.contains("job's GPUs only")), "{notes:?}");
    // A subset of the job's ids past its count: all GPUs too.
    let env = cuda(Some("5,6"), slurm, None);
    assert_eq!(gpu_nodes(&entries(&["5", "6"]), Some(gpus.as_slice()), &env, &mut Vec::new()), vec![Some(1), Some(1)]);
    // The job's GPUs 0 and 1 either way: the same GPUs.
    let env = cuda(Some("0,1"), Some(("SLURM_JOB_GPUS", "0,1")), None);
    assert_eq!(gpu_nodes(&entries(&["0", "1"]), Some(gpus.as_slice()), &env, &mut Vec::new()), vec![Some(0), Some(0)]);
    // No CUDA_VISIBLE_DEVICES: the local ranks count the job's GPUs (a range is read too).
    let env = cuda(None, Some(("SLURM_JOB_GPUS", "3-4")), None);
    assert_eq!(gpu_nodes(&entries(&["0", "1"]), Some(gpus.as_slice()), &env, &mut Vec::new()), vec![Some(0), Some(1)]);
    // CUDA numbers the job's GPUs in PCI bus order, whatever their minors' order.
    let mut swapped = eight_gpus();
    swapped[4].minor = Some(5);
    swapped[5].minor = Some(4);
    swapped[5].node = Some(0);
    let env = cuda(Some("0,1"), Some(("SLURM_STEP_GPUS", "5,4")), None);
    assert_eq!(gpu_nodes(&entries(&["0", "1"]), Some(swapped.as_slice()), &env, &mut Vec::new()), vec![Some(1), Some(0)]);
    // Minors the driver's list does not show: numbers give no locality, with a note; UUIDs still do.
    let mut no_minors = eight_gpus();
    no_minors[6].minor = None;
    let mut notes = Vec::new();
    let env = cuda(Some("0,1"), slurm, None);
    let devices = vec![Some("0".to_owned()), Some(uuid(6))];
    assert_eq!(gpu_nodes(&devices, Some(no_minors.as_slice()), &env, &mut notes), vec![None, Some(1)]);
    assert!(notes.iter().any(|n| n.contains("Device Minor") && n.contains("no NUMA locality")), "{notes:?}");
    // A malformed Slurm list: unknown, said.
    let mut notes = Vec::new();
    let env = cuda(Some("0"), Some(("SLURM_STEP_GPUS", "gpu:4")), None);
    assert_eq!(gpu_nodes(&entries(&["0"]), Some(gpus.as_slice()), &env, &mut notes), vec![None]);
    assert!(notes.iter().any(|n| n.contains("SLURM_STEP_GPUS=gpu:4")), "{notes:?}");
}

/// A container that hides some GPUs from /dev while the driver lists them all, and no Slurm to say
/// which: GPU numbers give no locality; UUIDs still do.
#[test]
fn hidden_gpus_without_slurm_make_numbers_unknown() {
    let gpus = eight_gpus();
    let mut notes = Vec::new();
    let env = cuda(Some("0,1"), None, Some(2));
    let devices = vec![Some("0".to_owned()), Some(uuid(5))];
    assert_eq!(gpu_nodes(&devices, Some(gpus.as_slice()), &env, &mut notes), vec![None, Some(1)]);
    assert!(notes.iter().any(|n| n.contains("/dev shows 2 GPU device node(s) where the driver lists 8")), "{notes:?}");
    // As many device nodes as GPUs, or none at all (created on first use): numbers count them all.
    for dev_nodes in [Some(8), Some(0), None] {
        let mut notes = Vec::new();
        let env = cuda(Some("0,4"), None, dev_nodes);
        assert_eq!(gpu_nodes(&entries(&["0", "4"]), Some(gpus.as_slice()), &env, &mut notes), vec![Some(0), Some(1)], "{dev_nodes:?}");
        assert!(!notes.iter().any(|n| n.contains("/dev shows")), "{notes:?}");
    }
}

#[test]
fn cpu_lists_parse_and_print() {
    assert_eq!(parse_cpu_list("0-2,5, 7-8\n").unwrap(), vec![0, 1, 2, 5, 7, 8]);
    assert!(parse_cpu_list("3-1").is_err());
    assert!(parse_cpu_list("x").is_err());
    assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    assert_eq!(cpu_list(&[]), "");
}
