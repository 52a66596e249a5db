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

/// Four GPUs in PCI bus order: GPUs 0 and 1 on NUMA node 1, GPUs 2 and 3 on node 0.
pub(crate) fn four_gpus() -> Vec<PciGpu> {
    [("0000:01:00.0", 1), ("0000:41:00.0", 1), ("0000:81:00.0", 0), ("0000:c1:00.0", 0)]
        .into_iter()
        .map(|(addr, node)| PciGpu { addr: addr.to_owned(), node: Some(node) })
        .collect()
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
    // More workers than cores: one core each, round-robin, said in a note.
    let mut notes = Vec::new();
    let sets = assign(BindMode::Cores, &topo, &[None; 10], &mut notes);
    assert_eq!(sets[0], vec![0, 8]);
    assert_eq!(sets[8], vec![0, 8]);
    assert!(notes.iter().any(|n| n.contains("10 workers share 8 physical cores")), "{notes:?}");
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

#[test]
fn gpus_are_read_in_pci_bus_order_with_their_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let roots = Roots { sys: dir.path().join("sys"), proc: dir.path().join("proc") };
    assert_eq!(read_pci_gpus(&roots), None, "no driver: no list");
    for (addr, node) in [("0000:c1:00.0", 0), ("0000:41:00.0", 1), ("0000:01:00.0", 1), ("0000:81:00.0", 0)] {
        put(&roots.proc, &format!("driver/nvidia/gpus/{addr}/information"), "Model: test\n");
        put(&roots.sys, &format!("bus/pci/devices/{addr}/numa_node"), &format!("{node}\n"));
    }
    assert_eq!(read_pci_gpus(&roots), Some(four_gpus()));
    // The driver's sysfs directory when /proc has no list; numa_node -1 is unknown.
    let dir = tempfile::tempdir().unwrap();
    let roots = Roots { sys: dir.path().join("sys"), proc: dir.path().join("proc") };
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
            PciGpu { addr: "0000:ff:00.0".into(), node: None },
            PciGpu { addr: "0001:02:00.0".into(), node: Some(3) },
        ])
    );
}

#[test]
fn cuda_visible_devices_maps_local_ranks_to_physical_gpus() {
    fn entries(list: &[&str]) -> Vec<Option<String>> {
        list.iter().map(|s| Some(s.to_string())).collect()
    }
    let gpus = four_gpus();
    // CUDA_VISIBLE_DEVICES=2,3: local rank 0 uses physical GPU 2, on node 0.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["2", "3"]), Some(gpus.as_slice()), None, &mut notes), vec![Some(0), Some(0)]);
    assert!(notes.iter().any(|n| n.ends_with(": 0,0")), "{notes:?}");
    assert!(notes.iter().any(|n| n.contains("CUDA_DEVICE_ORDER is not PCI_BUS_ID")), "{notes:?}");
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["0", "1", "2", "3"]), Some(gpus.as_slice()), Some("PCI_BUS_ID"), &mut notes), vec![Some(1), Some(1), Some(0), Some(0)]);
    assert!(!notes.iter().any(|n| n.contains("CUDA_DEVICE_ORDER")), "{notes:?}");
    // UUIDs give no locality, and say so; an index the machine lacks neither.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["GPU-5c1e", "0", "9"]), Some(gpus.as_slice()), None, &mut notes), vec![None, Some(1), None]);
    assert!(notes.iter().any(|n| n.contains("UUID") && n.contains("GPU-5c1e")), "{notes:?}");
    // No GPU list: nothing known, nothing said.
    let mut notes = Vec::new();
    assert_eq!(gpu_nodes(&entries(&["0", "1"]), None, None, &mut notes), vec![None, None]);
    assert!(notes.is_empty(), "{notes:?}");
}

#[test]
fn cpu_lists_parse_and_print() {
    assert_eq!(parse_cpu_list("0-2,5, 7-8\n").unwrap(), vec![0, 1, 2, 5, 7, 8]);
    assert!(parse_cpu_list("3-1").is_err());
    assert!(parse_cpu_list("x").is_err());
    assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    assert_eq!(cpu_list(&[]), "");
}
