use proptest::prelude::*;

use super::*;

fn names(list: &str) -> Vec<String> {
    expand(list).unwrap_or_else(|e| panic!("{list}: {e}"))
}

fn fails(list: &str) -> String {
    match expand(list) {
        Ok(v) => panic!("{list} expanded to {v:?}"),
        Err(e) => e.to_string(),
    }
}

/// Every row of multinode.md §3.3, pinned from Slurm 22.05.8 `scontrol show hostnames`.
#[test]
fn scontrol_show_hostnames_table() {
    let rows: &[(&str, &[&str])] = &[
        ("gpu[01-04,07],cpu3", &["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node[08-11]", &["node08", "node09", "node10", "node11"]),
        ("node[001-3]", &["node001", "node002", "node003"]),
        ("node[9-011]", &["node9", "node10", "node11"]),
        ("a[1-2]b[3-4]", &["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("rack[1-2]-node[01-02]", &["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("n[1-2][3-4]", &["n13", "n14", "n23", "n24"]),
        ("node-[001-002]", &["node-001", "node-002"]),
        ("jean-zay-ia[810-811]", &["jean-zay-ia810", "jean-zay-ia811"]),
        ("alpha,beta,gamma", &["alpha", "beta", "gamma"]),
        ("linux[1,2]", &["linux1", "linux2"]),
        ("nodeA,nodeB[001,003],nodeC", &["nodeA", "nodeB001", "nodeB003", "nodeC"]),
        ("host[001,003-004,006]", &["host001", "host003", "host004", "host006"]),
        ("node[1-3],node2", &["node1", "node2", "node3", "node2"]),
        ("node[1-2,2-3]", &["node1", "node2", "node2", "node3"]),
        ("node[01-02],node[1-2]", &["node01", "node02", "node1", "node2"]),
        ("10.0.0.[1-3]", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
        ("node1 node2", &["node1", "node2"]),
        ("n[1-2],,m[3]", &["n1", "n2", "m3"]),
        ("node[1-2],", &["node1", "node2"]),
        ("", &[]),
    ];
    for (input, want) in rows {
        assert_eq!(names(input), *want, "{input}");
    }
}

#[test]
fn node_1_10_is_not_padded() {
    let got = names("node[1-10]");
    assert_eq!(got.len(), 10);
    assert_eq!(got[0], "node1");
    assert_eq!(got[9], "node10");
}

#[test]
fn range_limit_is_65536() {
    let got = names("node[0-65535]");
    assert_eq!(got.len(), 65_536);
    assert_eq!(got[65_535], "node65535");
    assert!(fails("node[0-65536]").contains("too many hosts in range"));
    // The widest range: no overflow of its count (a panic, or a wrapped count that passed).
    assert!(fails("n[0-18446744073709551615]").contains("too many hosts in range"));
}

#[test]
fn lo_above_hi_names_the_range() {
    assert_eq!(fails("n[3-1]"), "invalid hostlist \"n[3-1]\": range start 3 > end 1");
    assert_eq!(fails("node[010-9]"), "invalid hostlist \"node[010-9]\": range start 10 > end 9");
    assert!(fails("node[3-1]").contains("range start 3 > end 1"));
}

#[test]
fn malformed_brackets_are_errors() {
    for bad in ["node[-1]", "node[1--2]", "node[]", "node[a-c]", "node[1x2]", "node[1-2]-ib", "node[1,,2]"] {
        let e = fails(bad);
        assert!(e.starts_with(&format!("invalid hostlist \"{bad}\"")), "{bad}: {e}");
    }
    // Slurm prints `node]` here; rsrun refuses.
    assert_eq!(fails("node[1-2"), "invalid hostlist \"node[1-2\": unclosed '['");
    assert!(fails("a,node]").contains("']' without '['"));
    assert!(fails("n[1[2]]").contains("nested"));
}

#[test]
fn products_are_bounded() {
    assert!(fails("a[0-65535]b[0-65535]").contains("more than"));
}

#[test]
fn counts() {
    assert_eq!(expand_counts("2(x3),1").unwrap(), vec![2, 2, 2, 1]);
    assert_eq!(expand_counts("1(x2)").unwrap(), vec![1, 1]);
    assert_eq!(expand_counts("72(x2),36").unwrap(), vec![72, 72, 36]);
    assert_eq!(expand_counts("4").unwrap(), vec![4]);
    for bad in ["", "x", "2(x0)", "2(x3", "2(3)", "1,,2", "-1"] {
        assert!(expand_counts(bad).is_err(), "{bad}");
    }
}

#[test]
fn compress_examples() {
    let c = |l: &str| compress(&names(l));
    assert_eq!(c("gpu[01-04,07],cpu3"), "gpu[01-04,07],cpu3");
    assert_eq!(c("node[01-02],node[1-2]"), "node[01-02,1-2]");
    assert_eq!(c("node[1-3],node2"), "node[1-3,2]");
    assert_eq!(c("node[9-11]"), "node[9-11]");
    assert_eq!(c("alpha,beta"), "alpha,beta");
    assert_eq!(c("a[1-2]b[3-4]"), "a1b[3-4],a2b[3-4]");
    assert_eq!(c("n1"), "n1");
    assert_eq!(c("10.0.0.[1-3]"), "10.0.0.[1-3]");
    assert_eq!(compress(&["123", "124"]), "123,124");
    assert_eq!(compress::<&str>(&[]), "");
    // Ranges longer than Slurm's limit are split.
    let many = names("n[0-65535],n[65536-70000]");
    assert_eq!(compress(&many), "n[0-65535,65536-70000]");
}

/// Hostlist expressions in the grammar: prefixes with letters, digits, '-' and '.', bracket groups
/// of ranges with padding, separators.
fn hostlist_expr() -> impl Strategy<Value = String> {
    let range = (0u32..40, 0u32..6, 0usize..4).prop_map(|(lo, len, pad)| {
        let lo_s = format!("{lo:0w$}", w = pad.max(1));
        if len == 0 { lo_s } else { format!("{lo_s}-{}", lo + len) }
    });
    let group = proptest::collection::vec(range, 1..4).prop_map(|r| format!("[{}]", r.join(",")));
    let prefix = "[a-z][a-z0-9.-]{0,4}";
    let token = (prefix, proptest::collection::vec((group, "[a-z-]{0,2}"), 0..3)).prop_map(|(p, groups)| {
        let mut t = p;
        let n = groups.len();
        for (i, (g, sep)) in groups.into_iter().enumerate() {
            t.push_str(&g);
            if i + 1 < n {
                t.push_str(&sep);
            }
        }
        t
    });
    proptest::collection::vec((token, prop_oneof![Just(","), Just(" "), Just(",,")]), 0..5).prop_map(|ts| {
        ts.into_iter().map(|(t, sep)| format!("{t}{sep}")).collect::<String>()
    })
}

proptest! {
    #[test]
    fn compress_expands_back(x in hostlist_expr()) {
        let hosts = expand(&x).unwrap();
        let again = expand(&compress(&hosts)).unwrap();
        prop_assert_eq!(again, hosts);
    }
}

/// Sizes are checked before anything is expanded: a long padding width or prefix would allocate
/// gigabytes (65,536 names of 100,000 characters). Messages truncate the value.
#[test]
fn long_names_and_padding_are_refused_before_expanding() {
    assert_eq!(fails(&"b".repeat(254)), format!("invalid hostlist \"{}...\": host name of 254 characters (at most 253, the DNS limit)", "b".repeat(40)));
    assert_eq!(names(&"c".repeat(253)).len(), 1);
    assert_eq!(names(&format!("{}[1-2]", "d".repeat(252)))[1].len(), 253);
    let e = fails(&format!("{}[0-65535]x[0-15]", "a".repeat(1000)));
    assert!(e.ends_with(": host names of up to 1008 characters (at most 253, the DNS limit)"), "{e}");
    assert!(e.len() < 200, "{e}");
    let e = fails(&format!("n[{}-65535]", "0".repeat(100_000)));
    assert!(e.starts_with("invalid hostlist \"n[0000"), "{e}");
    assert!(e.contains("padding width 100000 of \"0000") && e.contains("(at most 253, the DNS limit)"), "{e}");
    assert!(e.len() < 300, "{e}");
    // Count × length: a million names of 101 characters.
    let e = fails(&format!("{}[0-65535]x[0-15]", "e".repeat(93)));
    assert!(e.ends_with("expands to more than 64 MiB of host names (names of up to 101 characters)"), "{e}");
}
