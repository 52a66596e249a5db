//! Golden cases: multinode.md §1.2 (DeepSpeed and Horovod parser behaviour, and rsrun's answer),
//! §1.4 (include/exclude worked examples) and §1.5 (every error message, exactly).

use super::*;
use crate::cli::LaunchArgs;
use crate::plan::tests::host;

/// Resolves the table for `args` with `file` written as `./hosts` in a fresh current directory.
fn table(file: &str, args: &[&str]) -> Result<HostTable, String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hosts"), file).unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    let argv = ["rsrun"].into_iter().chain(args.iter().copied()).chain(["true"]);
    let a = LaunchArgs::try_parse_with_origins_from(argv).unwrap();
    resolve_table(&a, &h).map(|t| t.expect("a host table")).map_err(|e| e.to_string())
}

/// `host:slots` or `host:[devices]` per node, for compact assertions.
fn summary(t: &HostTable) -> Vec<String> {
    t.entries
        .iter()
        .map(|e| match &e.devices {
            Some(d) => format!("{}:{d:?}", e.host),
            None => format!("{}:{}", e.host, e.slots),
        })
        .collect()
}

fn file(text: &str) -> Result<Vec<String>, String> {
    table(text, &["--hostfile", "./hosts"]).map(|t| summary(&t))
}

fn file_err(text: &str) -> String {
    file(text).unwrap_err()
}

const W3: &str = "w0 slots=4\nw1 slots=4\nw2 slots=4\n";

fn w3(args: &[&str]) -> Result<Vec<String>, String> {
    let mut v = vec!["--hostfile", "./hosts"];
    v.extend_from_slice(args);
    table(W3, &v).map(|t| summary(&t))
}

// ---- §1.2: what DeepSpeed's and Horovod's parsers do with these lines, and what rsrun does ----

#[test]
fn r1_2_max_slots_is_accepted() {
    assert_eq!(file("w slots=2 max_slots=4").unwrap(), ["w:2"]);
}

#[test]
fn r1_2_trailing_garbage_in_slots_is_an_error() {
    // DeepSpeed: {w: 2}.
    assert_eq!(file_err("w slots=2abc"), "hostfile ./hosts:1: slots must be an integer 1..4096, got \"2abc\" in \"w slots=2abc\"");
}

#[test]
fn r1_2_zero_slots_is_an_error() {
    // DeepSpeed and Horovod: accepted, the node starts 0 processes.
    assert!(file_err("w slots=0").contains("slots=0 on host \"w\""));
    assert!(table("", &["-H", "w1:0"]).unwrap_err().contains("slots=0 on host \"w1\""));
}

#[test]
fn r1_2_spaces_around_equals_are_named() {
    assert_eq!(file_err("w  slots = 2"), "hostfile ./hosts:1: \"w  slots = 2\": write slots=2 (no spaces around '=')");
    assert!(file_err("w slots =2").contains("write slots=2"));
    assert!(file_err("w slots= 2").contains("write slots=2"));
}

#[test]
fn r1_2_bare_host_and_mpich_forms_are_accepted() {
    // DeepSpeed: "bad entry" for both.
    assert_eq!(file("w").unwrap(), ["w:auto"]);
    assert_eq!(file("w:2").unwrap(), ["w:2"]);
    assert_eq!(table("w\n", &["--hostfile", "./hosts", "--nproc-per-node", "3"]).map(|t| summary(&t)).unwrap(), ["w:3"]);
}

#[test]
fn r1_2_trailing_comment() {
    assert_eq!(file("w slots=2 # c").unwrap(), ["w:2"]);
    assert_eq!(file("w:2# c").unwrap(), ["w:2"]);
}

#[test]
fn r1_2_duplicates_are_errors() {
    assert_eq!(
        file_err("worker-1 slots=1\nworker-0 slots=1\nworker-1 slots=2"),
        "hostfile ./hosts:3: duplicate host \"worker-1\" (first on line 1); list each host once with slots=N"
    );
    // Horovod: 'w1:2,w1:3' silently becomes two local rank 0s.
    assert!(table("", &["-H", "w1:2,w1:3"]).unwrap_err().contains("duplicate host \"w1\""));
    // After hostlist expansion.
    assert!(file_err("n[1-3] slots=1\nn2 slots=1").contains("duplicate host \"n2\" (first on line 1)"));
}

#[test]
fn r1_2_empty_or_only_comments() {
    assert_eq!(file_err(""), "hostfile ./hosts: no hosts (empty, or only comments)");
    assert_eq!(file_err("# a\n\n   # b\n"), "hostfile ./hosts: no hosts (empty, or only comments)");
}

#[test]
fn r1_2_horovod_crashes_on_blank_lines_comments_and_bare_hosts() {
    assert_eq!(file("\n# hosts\nw1\n\nw2 slots=2\n").unwrap(), ["w1:auto", "w2:2"]);
}

#[test]
fn r1_2_crlf_tabs_and_indentation() {
    assert_eq!(file("w0 slots=2\r\n\tw1\tslots=3 \r\n").unwrap(), ["w0:2", "w1:3"]);
}

#[test]
fn r1_2_include_host_alone_keeps_all_slots() {
    // DS#6671: DeepSpeed HEAD gives {}.
    let f = "worker-0 slots=4\nworker-1 slots=4\n";
    let t = table(f, &["--hostfile", "./hosts", "-i", "worker-1"]).unwrap();
    assert_eq!(summary(&t), ["worker-1:4"]);
}

#[test]
fn r1_2_include_keeps_the_host_before_at() {
    // DeepSpeed PR #8239: worker-0 silently dropped.
    let f = "worker-0 slots=4\nworker-1 slots=4\n";
    let t = table(f, &["--hostfile", "./hosts", "-i", "worker-0@worker-1:1"]).unwrap();
    assert_eq!(summary(&t), ["worker-0:4", "worker-1:[1]"]);
}

#[test]
fn r1_2_include_slot_out_of_range_is_an_error() {
    // DeepSpeed HEAD accepts {worker-1: [4]}.
    let f = "worker-0 slots=4\nworker-1 slots=4\n";
    assert_eq!(
        table(f, &["--hostfile", "./hosts", "-i", "worker-1:4"]).unwrap_err(),
        "--include \"worker-1:4\": host worker-1 has slots 0-3"
    );
}

#[test]
fn r1_2_include_slot_list_and_exclude_slot() {
    let f = "worker-0 slots=4\nworker-1 slots=4\n";
    assert_eq!(summary(&table(f, &["--hostfile", "./hosts", "-i", "worker-1:0,2"]).unwrap()), ["worker-1:[0, 2]"]);
    assert_eq!(
        summary(&table(f, &["--hostfile", "./hosts", "-e", "worker-1:0"]).unwrap()),
        ["worker-0:4", "worker-1:[1, 2, 3]"]
    );
}

#[test]
fn r1_2_include_bad_slots_and_ipv6() {
    let f = "h1 slots=2\n[::1] slots=2\n";
    assert_eq!(table(f, &["--hostfile", "./hosts", "-i", "h1:x"]).unwrap_err(), "--include \"h1:x\": slot \"x\" is not a number");
    assert_eq!(table(f, &["--hostfile", "./hosts", "-i", "h1:0:1"]).unwrap_err(), "--include \"h1:0:1\": slot \"0:1\" is not a number");
    // DeepSpeed: "too many values to unpack".
    assert_eq!(summary(&table(f, &["--hostfile", "./hosts", "-i", "[::1]:0"]).unwrap()), ["::1:[0]"]);
}

#[test]
fn r1_2_include_unknown_host() {
    let f = "worker-0 slots=4\nworker-1 slots=4\n";
    assert_eq!(
        table(f, &["--hostfile", "./hosts", "-i", "nosuch"]).unwrap_err(),
        "--include: host \"nosuch\" is not in the hostfile (2 hosts: worker-0, worker-1)"
    );
}

#[test]
fn r1_2_horovod_hosts_arg_forms() {
    assert_eq!(
        table("", &["-H", "w1,w2:4"]).unwrap_err(),
        "-H \"w1,w2:4\": host \"w1\" has no slot count; write w1:N or pass --nproc-per-node"
    );
    // Horovod: IPv6 impossible.
    assert_eq!(summary(&table("", &["-H", "[::1]:2"]).unwrap()), ["::1:2"]);
    assert_eq!(summary(&table("", &["-H", "[fe80::1]:4,h2:1"]).unwrap()), ["fe80::1:4", "h2:1"]);
    assert_eq!(summary(&table("", &["-H", " h1:2 , h2:4 "]).unwrap()), ["h1:2", "h2:4"]);
    assert_eq!(summary(&table("", &["-H", "w1,w2:4", "--nproc-per-node", "2"]).unwrap()), ["w1:2", "w2:2"]);
}

// ---- §1.3: the grammar ----

#[test]
fn grammar_hostlists_users_and_attributes() {
    let t = table("n[01-03] slots=2 port=2222 user=bob\nalice@m[1,3]:1\n", &["--hostfile", "./hosts"]).unwrap();
    assert_eq!(summary(&t), ["n01:2", "n02:2", "n03:2", "m1:1", "m3:1"]);
    assert_eq!(t.entries[0].port, Some(2222));
    assert_eq!(t.entries[2].user.as_deref(), Some("bob"));
    assert_eq!(t.entries[3].user.as_deref(), Some("alice"));
    assert_eq!(t.entries[4].source, Source::Line { file: "./hosts".into(), line: 2 });
    assert_eq!(t.entries[4].source.to_string(), "./hosts:2");
    let t = table("w addr=10.0.0.5 slots=1\n", &["--hostfile", "./hosts"]).unwrap();
    assert_eq!(t.entries[0].addr.as_deref(), Some("10.0.0.5"));
    let t = table("", &["-H", "n[1-2]:3,x:1"]).unwrap();
    assert_eq!(summary(&t), ["n1:3", "n2:3", "x:1"]);
    assert_eq!(t.entries[0].source, Source::HostsArg);
    assert_eq!(t.rank_ranges(), vec![Some(0..3), Some(3..6), Some(6..7)]);
    assert_eq!(t.world_size(), Some(7));
}

#[test]
fn grammar_rejects() {
    assert!(file_err("w slots=5000").contains("got \"5000\""));
    assert!(file_err("w slots=2 slots=3").contains("attribute \"slots\" given twice"));
    assert!(file_err("w port=0").contains("port must be an integer 1..65535"));
    assert!(file_err("w:2 slots=3").contains("unexpected text \"slots=3\" after \"w:2\""));
    assert!(file_err("w;rm slots=1").contains("invalid host \"w;rm\""));
    assert!(file_err("w colour=red").contains("unknown attribute \"colour=red\" (known: slots, max_slots, port, user, addr)"));
    assert!(file_err("-u@w slots=1").contains("user names may not start with '-'"));
    assert!(file_err("[fe80::zz] slots=1").contains("not an IPv6 address"));
    assert!(file_err("w addr=-oX slots=1").contains("invalid addr"));
    // Shell syntax never reaches ssh (or a ProxyCommand, or an --rsh wrapper's shell).
    for bad in ["10.0.0.5|touch>/tmp/x", "gw&&id", "h(1)", "a{b}"] {
        let e = file_err(&format!("w addr={bad} slots=1"));
        assert!(e.contains("invalid addr") && e.contains("expected an IP address or a host name"), "{bad}: {e}");
    }
    assert!(table("w addr=fe80::1 slots=1\nv addr=gw-2.example slots=1\n", &["--hostfile", "./hosts"]).is_ok());
    assert!(table("", &["-H", "a:1,,b:1"]).unwrap_err().contains("empty host"));
    // A bare IPv6 address is asked for in brackets (its colons are no count).
    for (text, addr) in [("fe80::1 slots=4", "fe80::1"), ("::1 slots=2", "::1"), ("bob@2001:db8::7", "2001:db8::7")] {
        let e = file_err(text);
        assert!(e.contains(&format!("write an IPv6 address in brackets, [{addr}]")), "{text}: {e}");
    }
    assert!(table("", &["-H", "fe80::1"]).unwrap_err().contains("in brackets, [fe80::1]"));
    assert_eq!(file("[fe80::1] slots=4").unwrap(), vec!["fe80::1:4"]);
    // An expression of separators alone names no host.
    assert!(file_err(", slots=4").contains("no host name in it"), "{}", file_err(", slots=4"));
}

/// A Windows editor's byte-order mark is no part of the first host's name.
#[test]
fn a_byte_order_mark_is_not_a_host_name() {
    assert_eq!(file("\u{feff}w0 slots=2\nw1 slots=2\n").unwrap(), vec!["w0:2", "w1:2"]);
}

/// PET_NNODES and PET_NPROC_PER_NODE left in the environment (a pod's) do not cut or resize a
/// host table, as the typed options do.
#[test]
fn pet_variables_do_not_shape_a_host_table() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hosts"), W3).unwrap();
    let (a, mut h) = crate::plan::tests::parse_env(&["--hostfile", "./hosts", "true"], &[("PET_NNODES", "2"), ("PET_NPROC_PER_NODE", "auto")]);
    h.cwd = dir.path().to_owned();
    let t = resolve_table(&a, &h).unwrap().unwrap();
    assert_eq!(summary(&t), vec!["w0:4", "w1:4", "w2:4"]);
    let c = crate::multinode::resolve(&a, &h).unwrap();
    assert!(c.notes.iter().any(|n| n.contains("PET_NNODES in the environment is not used")), "{:?}", c.notes);
}

#[test]
fn mixed_slots_give_contiguous_ranks() {
    let t = table("a slots=2\nb slots=1\nc\n", &["--hostfile", "./hosts"]).unwrap();
    assert_eq!(t.rank_ranges(), vec![Some(0..2), Some(2..3), None]);
    assert_eq!(t.world_size(), None);
}

// ---- §1.4: worked examples with w0, w1, w2 at 4 slots ----

#[test]
fn r1_4_include_host() {
    assert_eq!(w3(&["-i", "w1"]).unwrap(), ["w1:4"]);
}

#[test]
fn r1_4_include_host_at_host_slots() {
    assert_eq!(w3(&["-i", "w0@w1:0,2"]).unwrap(), ["w0:4", "w1:[0, 2]"]);
}

#[test]
fn r1_4_include_slot_ranges() {
    assert_eq!(w3(&["-i", "w1:0-1,3"]).unwrap(), ["w1:[0, 1, 3]"]);
}

#[test]
fn r1_4_include_duplicate_slots() {
    assert_eq!(w3(&["-i", "w1:0,0"]).unwrap(), ["w1:[0]"]);
}

#[test]
fn r1_4_exclude_slot() {
    assert_eq!(w3(&["-e", "w1:0"]).unwrap(), ["w0:4", "w1:[1, 2, 3]", "w2:4"]);
}

#[test]
fn r1_4_exclude_hostlist() {
    assert_eq!(w3(&["-e", "w[0-1]"]).unwrap(), ["w2:4"]);
}

#[test]
fn r1_4_include_out_of_range() {
    assert_eq!(w3(&["-i", "w1:4"]).unwrap_err(), "--include \"w1:4\": host w1 has slots 0-3");
}

#[test]
fn r1_4_include_unknown() {
    assert_eq!(w3(&["-i", "w9"]).unwrap_err(), "--include: host \"w9\" is not in the hostfile (3 hosts: w0, w1, w2)");
}

#[test]
fn r1_4_include_and_exclude() {
    assert_eq!(w3(&["-i", "w1", "-e", "w2"]).unwrap_err(), "--include and --exclude cannot be used together");
}

#[test]
fn r1_4_include_and_nnodes() {
    assert_eq!(w3(&["-i", "w0", "--nnodes", "2"]).unwrap_err(), "--include selects 1 node but --nnodes is 2");
    assert_eq!(w3(&["-e", "w0", "--nnodes", "3"]).unwrap_err(), "--exclude leaves 2 nodes but --nnodes is 3");
    assert_eq!(w3(&["-i", "w0@w2", "--nnodes", "2"]).unwrap(), ["w0:4", "w2:4"]);
}

#[test]
fn r1_4_nnodes_and_nproc_cap() {
    assert_eq!(w3(&["--nnodes", "2", "--nproc-per-node", "2"]).unwrap(), ["w0:2", "w1:2"]);
    assert_eq!(w3(&["--nnodes", "1:2"]).unwrap(), ["w0:4", "w1:4"]);
    assert!(w3(&["--nproc-per-node", "5"]).unwrap_err().contains("--nproc-per-node 5 but host \"w0\" has slots=4 (./hosts:1)"));
    assert!(w3(&["-i", "w1", "--nproc-per-node", "2"]).unwrap_err().contains("the filter picks the slots"));
}

#[test]
fn r1_4_order_is_the_hostfile_order() {
    assert_eq!(w3(&["-i", "w2@w0:1"]).unwrap(), ["w0:[1]", "w2:4"]);
}

#[test]
fn r1_4_filter_edge_cases() {
    assert_eq!(w3(&["-e", "w0@w1@w2"]).unwrap_err(), "--exclude: no hosts left in the hostfile");
    assert_eq!(w3(&["-e", "w1:0-3"]).unwrap(), ["w0:4", "w2:4"]);
    assert_eq!(w3(&["-i", "w1:1@w1:0"]).unwrap(), ["w1:[0, 1]"]);
    assert_eq!(w3(&["-i", "w1:1@w1"]).unwrap(), ["w1:4"]);
    assert!(w3(&["-i", "w1:3-1"]).unwrap_err().contains("slot range \"3-1\" is empty"));
    assert!(w3(&["-i", "w1@"]).unwrap_err().contains("empty host"));
    assert!(table("", &["-i", "w1"]).unwrap_err().contains("--include needs a host table"));
    assert!(table("a\n", &["--hostfile", "./hosts", "-i", "a:0"]).unwrap_err().contains("has no slot count"));
    assert_eq!(
        table("", &["-H", "a:2,b:2", "-i", "c"]).unwrap_err(),
        "--include: host \"c\" is not in -H (2 hosts: a, b)"
    );
}

// ---- §1.5: every message, exactly ----

#[test]
fn r1_5_messages() {
    let cases: &[(&str, &[&str], &str)] = &[
        ("w1 slots=1\nw2 slots=1\nw1 slots=2\n", &[], "hostfile ./hosts:3: duplicate host \"w1\" (first on line 1); list each host once with slots=N"),
        ("w1 slots=1\nw2  slots = 4\n", &[], "hostfile ./hosts:2: \"w2  slots = 4\": write slots=4 (no spaces around '=')"),
        ("w1 slots=1\nw2 slots=\n", &[], "hostfile ./hosts:2: slots must be an integer 1..4096, got \"\" in \"w2 slots=\""),
        ("a\nb\nc\nd\nw3 slots=0\n", &[], "hostfile ./hosts:5: slots=0 on host \"w3\"; remove the line or use --exclude w3"),
        ("a\nb\nc\nw slot=4\n", &[], "hostfile ./hosts:4: unknown attribute \"slot=4\" (did you mean \"slots=4\"?)"),
        ("a\nb\nc\nd\ne\nw slots=2 abc\n", &[], "hostfile ./hosts:6: unexpected text \"abc\" after \"slots=2\""),
        ("a\nb\nc\nd\ne\nf\n-oProxyCommand=x\n", &[], "hostfile ./hosts:7: invalid host \"-oProxyCommand=x\": host names may not start with '-'"),
        ("a\nb\nc\nd\ne\nf\ng\nn[3-1]\n", &[], "hostfile ./hosts:8: invalid hostlist \"n[3-1]\": range start 3 > end 1"),
        ("# nothing\n", &[], "hostfile ./hosts: no hosts (empty, or only comments)"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w9"], "--include: host \"w9\" is not in the hostfile (3 hosts: w0, w1, w2)"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w1:4"], "--include \"w1:4\": host w1 has slots 0-3"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w1:a"], "--include \"w1:a\": slot \"a\" is not a number"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w1:"], "--include \"w1:\": empty slot list"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w1", "-e", "w0"], "--include and --exclude cannot be used together"),
        ("w0 slots=4\nw1 slots=4\nw2 slots=4\n", &["-i", "w1", "--nnodes", "2"], "--include selects 1 node but --nnodes is 2"),
        ("w0\nw1\nw2\nw3\n", &["--nnodes", "5"], "--nnodes 5 but the hostfile lists 4 hosts"),
    ];
    for (text, extra, want) in cases {
        let mut args = vec!["--hostfile", "./hosts"];
        args.extend_from_slice(extra);
        assert_eq!(table(text, &args).unwrap_err(), *want, "{text:?} {extra:?}");
    }
    assert_eq!(table("", &["--hostfile", "./hostz"]).unwrap_err(), "--hostfile ./hostz: no such file");
    assert_eq!(
        table("", &["-H", "w1,w2:4"]).unwrap_err(),
        "-H \"w1,w2:4\": host \"w1\" has no slot count; write w1:N or pass --nproc-per-node"
    );
    assert_eq!(table("w1 slots=1\n", &["-H", "./hosts"]).unwrap_err(), "-H \"./hosts\": this is a file; did you mean --hostfile ./hosts?");
}

#[test]
fn r1_5_messages_reach_the_plan_and_name_the_line() {
    // Through LaunchPlan::resolve, as the binary reports them (exit 2).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hosts"), "w1 slots=2\nw1 slots=2\n").unwrap();
    let mut h = host();
    h.cwd = dir.path().to_owned();
    let a = LaunchArgs::try_parse_with_origins_from(["rsrun", "--hostfile", "./hosts", "true"]).unwrap();
    let e = crate::plan::LaunchPlan::resolve(&a, &h).unwrap_err();
    assert!(matches!(e, PlanError::At { .. }));
    assert_eq!(e.to_string(), "hostfile ./hosts:2: duplicate host \"w1\" (first on line 1); list each host once with slots=N");
}

// ---- Users with IPv6 literals; limits across lines and items ----

#[test]
fn user_at_ipv6_literal() {
    let t = table("", &["-H", "root@[fe80::1]:4,bob@h2:1"]).unwrap();
    assert_eq!(summary(&t), ["fe80::1:4", "h2:1"]);
    assert_eq!(t.entries[0].user.as_deref(), Some("root"));
    let t = table("root@[fe80::1]:2\nroot@[fe80::2] slots=3\n", &["--hostfile", "./hosts"]).unwrap();
    assert_eq!(summary(&t), ["fe80::1:2", "fe80::2:3"]);
    assert_eq!(t.entries[1].user.as_deref(), Some("root"));
    assert_eq!(split_count("root@[fe80::1]:4"), ("root@[fe80::1]", Some("4")));
    assert_eq!(split_count("root@[fe80::1]"), ("root@[fe80::1]", None));
    assert_eq!(split_count("root@n[1-2]:4"), ("root@n[1-2]", Some("4")));
}

/// The 1M-host bound of one hostlist expression holds for the whole table: across hostfile lines and
/// `-H` items (65,536 × 16 = 1,048,576 hosts, then one more).
#[test]
fn the_host_limit_holds_across_lines_and_items() {
    assert_eq!(
        file_err("a[0-65535]x[0-15]\nb\n"),
        "hostfile ./hosts:2: more than 1048576 hosts in all"
    );
    assert_eq!(
        table("", &["-H", "a[0-65535]x[0-15]:1,b:1"]).unwrap_err(),
        "-H \"a[0-65535]x[0-15]:1,b:1\": more than 1048576 hosts in all"
    );
}

/// Duplicate checks and filter lookups are hashed: a table of 262,144 hosts filtered by 196,608 names
/// takes no time (a scan per name would take 5e10 comparisons).
#[test]
fn large_tables_and_filters_are_not_quadratic() {
    let t = table("", &["-H", "n[0-65535]x[0-3]:1", "-e", "n[0-65535]x[0-2]"]).unwrap();
    assert_eq!(t.entries.len(), 65_536);
    assert_eq!(t.entries[0].host, "n0x3");
    assert!(table("", &["-H", "n[0-65535]x[0-3]:1,n7x2:1"]).unwrap_err().contains("duplicate host \"n7x2\""));
}
