//! Which hosts of a job are the same machine, judged by what the agents report, not by names
//! (multinode.md §1.3): the kernel's boot id and the inode of the network namespace, the identity the
//! training engine uses for shared memory. Two network namespaces on one kernel share the boot id but
//! not the namespace inode, so they count as two hosts (the namespace tests rely on it); one machine
//! reached under two names (`node1` and its address, `localhost` and `127.0.0.1`) reports the same
//! pair twice.

use std::os::unix::fs::MetadataExt;

/// A host's identity as its agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id` (empty when unreadable).
    pub boot_id: String,
    /// Inode of `/proc/self/ns/net` (0 when unreadable).
    pub netns_inode: u64,
}

impl HostIdentity {
    /// This process's host identity.
    pub fn probe() -> Self {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_owned()).unwrap_or_default();
        let netns_inode = std::fs::metadata("/proc/self/ns/net").map(|m| m.ino()).unwrap_or(0);
        HostIdentity { boot_id, netns_inode }
    }

    /// Whether the identity can be compared (an agent that could not read its boot id is never
    /// called a duplicate).
    pub fn is_known(&self) -> bool {
        !self.boot_id.is_empty()
    }
}

/// The first two hosts, in list order, that report the same identity: `(earlier, later)`.
pub fn same_machine<'a>(hosts: &[(&'a str, HostIdentity)]) -> Option<(&'a str, &'a str)> {
    let mut seen: std::collections::HashMap<&HostIdentity, &'a str> = std::collections::HashMap::new();
    for (name, id) in hosts {
        if !id.is_known() {
            continue;
        }
        if let Some(first) = seen.get(id) {
            return Some((first, name));
        }
        seen.insert(id, name);
    }
    None
}

/// The error for two entries on one machine (multinode.md §1.5).
pub fn same_machine_error(a: &str, b: &str, why: &str) -> String {
    format!(
        "hosts \"{a}\" and \"{b}\" are the same machine ({why}); list it once, or pass --allow-same-host to run several nodes on one machine"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(boot: &str, ns: u64) -> HostIdentity {
        HostIdentity { boot_id: boot.into(), netns_inode: ns }
    }

    #[test]
    fn same_boot_id_and_namespace_is_one_machine() {
        let hosts = [("node1", id("b1", 7)), ("node2", id("b2", 7)), ("10.0.0.1", id("b1", 7))];
        assert_eq!(same_machine(&hosts), Some(("node1", "10.0.0.1")));
    }

    #[test]
    fn namespaces_of_one_kernel_are_distinct_hosts() {
        let hosts = [("h1", id("b", 1)), ("h2", id("b", 2)), ("h3", id("b", 3))];
        assert_eq!(same_machine(&hosts), None);
    }

    #[test]
    fn unknown_identities_never_match() {
        let hosts = [("h1", id("", 0)), ("h2", id("", 0))];
        assert_eq!(same_machine(&hosts), None);
    }

    #[test]
    fn this_process_has_an_identity() {
        let me = HostIdentity::probe();
        assert!(me.is_known() && me.netns_inode != 0, "{me:?}");
        assert_eq!(me, HostIdentity::probe());
    }

    #[test]
    fn the_error_names_both_hosts() {
        assert_eq!(
            same_machine_error("localhost", "10.0.0.5", "same boot id and network namespace"),
            "hosts \"localhost\" and \"10.0.0.5\" are the same machine (same boot id and network namespace); list it once, or pass --allow-same-host to run several nodes on one machine"
        );
    }
}
