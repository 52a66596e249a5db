//! `--dry-run`: the resolved plan as text — nodes, ranks, and per worker the command line and the
//! environment rsrun sets. Nothing is started.

use std::fmt::Write as _;

use crate::env::{RoundAssignment, worker_env};
use crate::multinode::{HostTable, LaunchMode, Slots};
use crate::plan::{GpuBind, HostMode, LaunchPlan, RdzvPlan};

/// The number of a run's first round.
const FIRST_ROUND: u64 = 1;

/// Renders the plan. For elastic backends, ranks are only known once the round forms; the text shows
/// this node as node rank `--node-rank` (or 0) of MAX nodes and says so.
pub fn render(plan: &LaunchPlan) -> String {
    let mut s = String::new();
    let nproc = plan.nproc_per_node;
    let (node_rank, num_nodes, exact) = match &plan.rdzv {
        RdzvPlan::Static { node_rank, .. } => (*node_rank, plan.nodes.max, true),
        RdzvPlan::Standalone if plan.hosts.is_some() => (0, plan.nodes.max, true),
        RdzvPlan::Standalone => (0, 1, true),
        RdzvPlan::Daemon { .. } | RdzvPlan::Group { .. } => (plan.rank_hint.unwrap_or(0).min(plan.nodes.max - 1), plan.nodes.max, false),
    };
    // Nodes may differ in slots (a host table): the table's world size is the truth.
    let world_size = plan.hosts.as_ref().and_then(HostTable::world_size).unwrap_or(num_nodes * nproc);
    let _ = writeln!(s, "rsrun dry run (nothing is started)");
    let _ = writeln!(s, "job          : {}", plan.job_id);
    let rdzv = match &plan.rdzv {
        RdzvPlan::Standalone => "standalone: in-memory rendezvous inside rsrun on a loopback ephemeral port".to_owned(),
        RdzvPlan::Daemon { endpoint, host } => format!(
            "rsrun-rendezvous daemon at {endpoint}{}{}",
            match &plan.tls_ca {
                Some(ca) => format!(" over TLS (CA {})", ca.display()),
                None => String::new(),
            },
            match host {
                HostMode::Auto => " (hosted by this launcher if the endpoint is this host and nothing listens)",
                HostMode::Always => " (hosted by this launcher: is_host=true)",
                HostMode::Never => "",
            }
        ),
        RdzvPlan::Group { endpoints } => format!(
            "highly available rsrun-rendezvous daemons at {}{} (the leader answers; a failover is a pause)",
            crate::plan::endpoint_list(endpoints),
            match &plan.tls_ca {
                Some(ca) => format!(" over TLS (CA {})", ca.display()),
                None => String::new(),
            }
        ),
        RdzvPlan::Static { node_rank, master_addr, master_port } => format!(
            "static: node rank 0 hosts the rendezvous at {master_addr}:{master_port}{}; fixed node ranks, verified; no elasticity",
            if *node_rank == 0 { " (this node)" } else { "" }
        ),
    };
    let _ = writeln!(s, "launch       : {}", plan.mode);
    if let LaunchMode::SlurmC { srun } = &plan.mode {
        let _ = writeln!(s, "srun         : {} <absolute path of rsrun> <the same arguments>", srun.join(" "));
    }
    let rdzv = match (&plan.mode, &plan.rdzv) {
        (LaunchMode::Hosts, RdzvPlan::Standalone) => {
            "embedded in this launcher, bound to the address that routes to the hosts (ssh launcher)".to_owned()
        }
        _ => rdzv,
    };
    let _ = writeln!(s, "rendezvous   : {rdzv}");
    let port = match &plan.rdzv {
        RdzvPlan::Daemon { endpoint, .. } => Some(endpoint.port),
        RdzvPlan::Static { master_port, .. } => Some(*master_port),
        RdzvPlan::Standalone | RdzvPlan::Group { .. } => None,
    };
    if let Some(port) = port
        && plan.port_probe > 0
    {
        let last = port.saturating_add(plan.port_probe);
        let _ = writeln!(
            s,
            "ports        : {port}..{last}: node rank 0 hosts on the first free one (a service of job '{}' only); the other nodes search them for that job",
            plan.job_id
        );
    }
    for src in &plan.sources {
        let _ = writeln!(s, "source       : {} = {} ({})", src.name, src.value, src.source);
    }
    if let Some(table) = &plan.hosts {
        render_table(&mut s, table);
    }
    let _ = writeln!(
        s,
        "nodes        : {}{}",
        plan.nodes,
        if exact {
            format!(" (this node: rank {node_rank})")
        } else {
            format!(" (ranks are assigned when the round forms; shown as node rank {node_rank} of {num_nodes})")
        }
    );
    let _ = writeln!(
        s,
        "workers      : {nproc} per node, world size {}{}",
        world_size,
        if exact { "" } else { " (at MAX nodes)" }
    );
    let _ = writeln!(s, "restarts     : {} (one budget for the whole job)", plan.max_restarts);
    let t = &plan.timeouts;
    let _ = writeln!(
        s,
        "timeouts     : shutdown {:?}, hang {}, exit barrier {:?}, join {:?}, last call {:?}, lease {:?}",
        t.shutdown,
        t.hang.map(|h| format!("{h:?}")).unwrap_or_else(|| "off".into()),
        t.exit_barrier,
        t.join,
        t.last_call,
        t.lease
    );
    let _ = writeln!(s, "signals      : {}", plan.signals);
    if let Some(r) = &plan.requeue {
        let _ = writeln!(
            s,
            "requeue      : after a preemption signal ({}), once the workers exit or the shutdown grace passes, node rank 0 runs `{}` once ({})",
            crate::requeue::watched(&plan.signals).iter().map(|s| s.as_str().trim_start_matches("SIG")).collect::<Vec<_>>().join(", "),
            r.argv().join(" "),
            if r.runner { "this node" } else { "not this node" }
        );
    }
    match &plan.logs.dir {
        Some(d) => {
            // The same path the run takes (the job id made a safe path component).
            let attempt = plan.logs.attempt_dir(&plan.job_id, FIRST_ROUND).unwrap_or_else(|| d.clone());
            let job_dir = attempt.parent().unwrap_or(d.as_path());
            let _ = writeln!(s, "logs         : {}/attempt_<round>/<rank>/{{stdout,stderr}}.log", job_dir.display());
        }
        None => {
            let _ = writeln!(s, "logs         : disabled (--log-dir /dev/null)");
        }
    }
    let _ = writeln!(s, "prefix       : {:?}", plan.logs.prefix);
    for n in &plan.notes {
        let _ = writeln!(s, "note         : {n}");
    }
    // The first round is round 1 (the rendezvous counts from 1; a static or standalone run too):
    // its variables and its attempt directory as the run will have them.
    let a = RoundAssignment {
        round: FIRST_ROUND,
        node_rank,
        num_nodes,
        rank_offset: node_rank * nproc,
        local_world_size: nproc,
        world_size,
        master_addr: String::new(),
        master_port: 0,
        agent_store: true,
        restart_count: 0,
        max_restarts: plan.max_restarts,
        // As the run makes it (crate::plan::node_id), the pid only known then.
        node_id: crate::plan::node_id(&plan.hostname, 0).trim_end_matches("-0").to_owned() + "-<pid>",
        rdzv_endpoint: match &plan.rdzv {
            RdzvPlan::Static { master_addr, master_port, .. } => Some(format!("{master_addr}:{master_port}")),
            RdzvPlan::Standalone => Some("127.0.0.1:<port>".into()),
            RdzvPlan::Daemon { endpoint, .. } => Some(endpoint.to_string()),
            RdzvPlan::Group { endpoints } => Some(crate::plan::endpoint_list(endpoints)),
        },
    };
    for local_rank in 0..nproc {
        let rank = a.rank(local_rank);
        let error_file = plan.logs.worker_dir(&plan.job_id, FIRST_ROUND, rank).map(|d| d.join("error.json"));
        let _ = writeln!(s);
        match &plan.task_ranks {
            Some(t) => {
                let _ = writeln!(s, "worker rank {rank} (local_rank {}, node_rank {}; from srun):", t.local_rank, t.node_rank);
            }
            None if plan.hosts.is_some() => {
                let _ = writeln!(s, "worker rank {rank} (local_rank {local_rank}, node_rank {node_rank}; as started on the first host):");
            }
            None => {
                let _ = writeln!(s, "worker rank {rank} (local_rank {local_rank}, node_rank {node_rank}):");
            }
        }
        let argv = plan.program.argv(local_rank);
        let cmd: Vec<String> =
            std::iter::once(plan.program.exe.display().to_string()).chain(argv).map(|a| shell_quote(&a)).collect();
        let _ = writeln!(s, "  command : {}", cmd.join(" "));
        if let Some(sets) = &plan.cpu_sets {
            let _ = writeln!(s, "  cpus    : {}", cpu_list(&sets[local_rank as usize]));
        }
        if let GpuBind::LocalRank(_) = plan.gpu_bind {
            let _ = writeln!(s, "  gpu     : bound by CUDA_VISIBLE_DEVICES");
        }
        let _ = writeln!(s, "  env     :");
        for (k, v) in worker_env(plan, &a, local_rank, error_file.as_deref()) {
            let v = match k.as_str() {
                "MASTER_ADDR" => match &plan.rdzv {
                    RdzvPlan::Static { master_addr, .. } => master_addr.clone(),
                    RdzvPlan::Standalone => "127.0.0.1".into(),
                    RdzvPlan::Daemon { .. } | RdzvPlan::Group { .. } => "<address of the rendezvous service>".into(),
                },
                "MASTER_PORT" => "<port of the TCPStore the rendezvous serves for the round>".into(),
                _ => v.to_string_lossy().into_owned(),
            };
            let _ = writeln!(s, "    {k}={v}");
        }
        let _ = writeln!(s, "    RSRUN_PROGRESS_FD=<fd of the progress socket>");
        let _ = writeln!(s, "    RSRUN_PROGRESS_PEER=<pid of the rsrun that made it>");
        let _ = writeln!(s, "    RSRUN_LAUNCH_MARKS=<this launch's random mark, after those of launches around it>");
    }
    s
}

/// The node table: host, node rank, slots, devices, global ranks, where it was listed.
fn render_table(s: &mut String, table: &HostTable) {
    let world = table.world_size().map(|w| w.to_string()).unwrap_or_else(|| "known after preflight".into());
    let _ = writeln!(s, "hosts        : {} nodes from {}, world size {world}", table.entries.len(), table.origin);
    let width = table.entries.iter().map(|e| e.host.len()).max().unwrap_or(4).max(4);
    let _ = writeln!(s, "  {:<4}  {:<width$}  {:<5}  {:<9}  {:<11}  source", "node", "host", "slots", "devices", "ranks");
    for (i, (e, ranks)) in table.entries.iter().zip(table.rank_ranges()).enumerate() {
        let devices = match (&e.devices, e.slots) {
            (Some(d), _) => cpu_list(&d.iter().map(|x| *x as usize).collect::<Vec<_>>()),
            (None, Slots::Count(n)) if n > 1 => format!("0-{}", n - 1),
            (None, Slots::Count(_)) => "0".to_owned(),
            (None, Slots::Auto) => "all".to_owned(),
        };
        let ranks = match ranks {
            Some(r) if r.len() == 1 => r.start.to_string(),
            Some(r) => format!("{}-{}", r.start, r.end - 1),
            None => "after preflight".to_owned(),
        };
        let _ = writeln!(s, "  {i:<4}  {:<width$}  {:<5}  {devices:<9}  {ranks:<11}  {}", e.host, e.slots.to_string(), e.source);
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn cpu_list(cpus: &[usize]) -> String {
    crate::topology::cpu_list(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::{host, parse};

    #[test]
    fn shows_ranks_env_and_commands() {
        let args = parse(&["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.1.1", "--nproc-per-node", "2", "--cpu-bind", "cores", "true", "x y", "${local_rank}"]);
        let plan = LaunchPlan::resolve(&args, &host()).unwrap();
        let text = render(&plan);
        assert!(text.contains("worker rank 3 (local_rank 1, node_rank 1)"), "{text}");
        assert!(text.contains("command : /usr/bin/true 'x y' 1") || text.contains("command : /bin/true 'x y' 1"), "{text}");
        assert!(text.contains("    WORLD_SIZE=4"), "{text}");
        assert!(text.contains("    MASTER_ADDR=10.1.1.1"), "{text}");
        assert!(text.contains("    MASTER_PORT=<port of the TCPStore the rendezvous serves for the round>"), "{text}");
        assert!(text.contains("static: node rank 0 hosts the rendezvous at 10.1.1.1:29500"), "{text}");
        assert!(text.contains("  cpus    : 2-3"), "{text}");
        assert_eq!(cpu_list(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
