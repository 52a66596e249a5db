//! `--dry-run` with `--hosts`/`--hostfile`: the node table, the rendezvous, the forwarded variables
//! (names and where each came from; values are never shown) and every host's exact argv.

use std::fmt::Write as _;

use super::command::shell_quote;
use super::plan::{RemotePlan, RemoteRdzv};
use super::Slots;

/// Renders the plan.
pub fn render(plan: &RemotePlan) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "rsrun dry run (nothing is started)");
    let _ = writeln!(s, "job          : {}", plan.job_id);
    let rdzv = match &plan.rdzv {
        RemoteRdzv::Embedded { bind, advertise } => format!(
            "hosted by this rsrun at {bind}{}, reached as {advertise}; a token per job",
            if bind.port() == 0 { " (port chosen at start)" } else { "" }
        ),
        RemoteRdzv::External { endpoint } => match &plan.tls_ca {
            Some(ca) => format!("rsrun-rendezvous daemon at {endpoint}, TLS verified with {} (sent to every host)", ca.path.display()),
            None => format!("rsrun-rendezvous daemon at {endpoint}"),
        },
    };
    let _ = writeln!(s, "rendezvous   : {rdzv}");
    let world = match plan.world_size() {
        Some(w) => w.to_string(),
        None => "known at start (hosts with auto slots)".to_owned(),
    };
    let _ = writeln!(s, "nodes        : {} hosts, world size {world}", plan.nodes.len());
    for n in &plan.nodes {
        let ranks = match (n.rank_offset, n.host.slots) {
            (Some(o), Slots::Count(c)) => format!("{o}-{}", o + c - 1),
            (Some(o), Slots::Auto) => format!("{o}-"),
            (None, _) => "known at start".to_owned(),
        };
        let devices = match &n.host.devices {
            Some(d) => format!(", devices {}", d.iter().map(u32::to_string).collect::<Vec<_>>().join(",")),
            None => String::new(),
        };
        let mut how = if n.local { "local, no ssh".to_owned() } else { "ssh".to_owned() };
        if !n.local {
            if let Some(u) = &n.host.user {
                how.push_str(&format!(", user {u}"));
            }
            if let Some(p) = n.host.port {
                how.push_str(&format!(", port {p}"));
            }
            if let Some(a) = &n.host.addr {
                how.push_str(&format!(", to {a}"));
            }
        }
        let _ = writeln!(
            s,
            "  node {:<3} {:<20} slots {:<3} ranks {ranks}{devices} ({how})",
            n.node_rank, n.host.host, n.host.slots.to_string(),
        );
    }
    let ssh_hosts = plan.nodes.iter().filter(|n| !n.local).count();
    let _ = writeln!(
        s,
        "fan-out      : at most {} of {ssh_hosts} ssh host{} connecting at once (--ssh-fanout)",
        plan.fanout,
        if ssh_hosts == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        s,
        "same machine : {}",
        if plan.allow_same_host {
            "allowed (--allow-same-host)"
        } else {
            "refused before any worker starts (boot id and network namespace the agents report)"
        }
    );
    if plan.check {
        let _ = writeln!(s, "check        : preflight only (--check): every agent checks its host and stops; no worker starts");
    }
    let _ = writeln!(s, "cwd          : {}", plan.cwd.display());
    let _ = writeln!(s, "program      : {}", plan.program.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "));
    let _ = writeln!(s, "options      : {}", plan.options.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" "));
    let _ = writeln!(s, "shutdown     : {:?} grace, then SIGKILL", plan.shutdown);
    if plan.env.vars.is_empty() {
        let _ = writeln!(s, "forwarded env: none");
    } else {
        let _ = writeln!(s, "forwarded env: {} variables (values are not shown)", plan.env.vars.len());
        for (name, source) in &plan.env.sources {
            let _ = writeln!(s, "  {name:<32} {source}");
        }
    }
    let _ = writeln!(s, "commands     : (stdin carries the plan; EOF stops the agent)");
    for n in &plan.nodes {
        let argv: Vec<String> = n.argv.iter().map(|a| shell_quote(&a.to_string_lossy())).collect();
        let _ = writeln!(s, "  {}: {}", n.host.host, argv.join(" "));
    }
    s
}
