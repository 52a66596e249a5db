//! The host grammar (multinode.md §1.3) and the node table.
//!
//! One grammar for hostfile lines and `-H` items, accepting what DeepSpeed, OpenMPI and MPICH write:
//!
//! ```text
//! line    = [ entry ] [ "#" comment ]            blank lines and CRLF accepted; at most 1 MiB
//! entry   = hostexpr ":" count                   MPICH / horovod
//!         | hostexpr { ws attr }                 DeepSpeed / OpenMPI; a bare host is allowed
//! attr    = "slots=" count | "max_slots=" count | "port=" port | "user=" name | "addr=" address
//! hostexpr = [ user "@" ] ( hostlist | "[" ipv6 "]" )
//! count   = 1..4096
//! -H      = item { "," item } ;  item = hostexpr [ ":" count ]   (commas inside [...] do not split)
//! ```
//!
//! File order is node order: node 0 is the first host and holds global rank 0; ranks are contiguous
//! per node. [`resolve_table`] applies, in this fixed order: the hostfile or `-H` →
//! `--include`/`--exclude` → `--nnodes` (the first N nodes; MAX for `MIN:MAX`) →
//! `--nproc-per-node` (slots `[0, N)`). Conflicts are errors, never silent truncation.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::{Source, filter, hostlist};
use crate::cli::LaunchArgs;
use crate::plan::{HostInfo, NodeRange, PlanError};

/// Largest slot count.
pub const MAX_SLOTS: u32 = 4096;
// A slot count is a node's worker count: it must pass the plan's per-node limit.
const _: () = assert!(MAX_SLOTS <= crate::plan::MAX_NPROC_PER_NODE);
/// Largest hostfile.
pub const MAX_HOSTFILE_BYTES: u64 = 1 << 20;

/// How many workers a host runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slots {
    /// `slots=N`, `host:N`, or `--nproc-per-node N`.
    Count(u32),
    /// A bare host and no `--nproc-per-node`: the host's GPU count, else 1, found at preflight.
    Auto,
}

impl Slots {
    /// The agent's `--nproc-per-node`: the count, or `gpu-or-1` (its GPUs, else one).
    pub fn agent_value(self) -> String {
        match self {
            Slots::Count(n) => n.to_string(),
            Slots::Auto => "gpu-or-1".to_owned(),
        }
    }
}

impl std::fmt::Display for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Slots::Count(n) => write!(f, "{n}"),
            Slots::Auto => f.write_str("auto"),
        }
    }
}

/// One node of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostEntry {
    /// Host name or address (an IPv6 literal without brackets).
    pub host: String,
    /// Workers on this host.
    pub slots: Slots,
    /// The local device indices picked by `--include host:0,2` / `--exclude host:1`; `None` means
    /// slots `0..slots`. When set, `slots` is its length. Slot `i` is entry `i` of the host's
    /// inherited CUDA_VISIBLE_DEVICES list, or device `i` when none is set.
    pub devices: Option<Vec<u32>>,
    /// ssh user (`user@host` or `user=`).
    pub user: Option<String>,
    /// ssh port (`port=`).
    pub port: Option<u16>,
    /// Address to connect to instead of the name (`addr=`).
    pub addr: Option<String>,
    /// Where the host was listed: `hosts.txt:3` or `-H`.
    pub source: Source,
}

/// The job's nodes in node-rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTable {
    /// The nodes; index = node rank.
    pub entries: Vec<HostEntry>,
    /// What listed them, for messages: `hostfile ./hosts` or `-H`.
    pub origin: String,
}

impl HostTable {
    /// Global ranks of each node (`None` from the first node whose slots are `auto`: they are known
    /// after preflight).
    pub fn rank_ranges(&self) -> Vec<Option<std::ops::Range<u32>>> {
        let mut next = Some(0u32);
        self.entries
            .iter()
            .map(|e| match (next, e.slots) {
                (Some(start), Slots::Count(n)) => {
                    next = Some(start + n);
                    Some(start..start + n)
                }
                _ => {
                    next = None;
                    None
                }
            })
            .collect()
    }

    /// The largest slot count, when every node's slots are known.
    pub fn max_slots(&self) -> Option<u32> {
        self.entries.iter().try_fold(0u32, |acc, e| match e.slots {
            Slots::Count(n) => Some(acc.max(n)),
            Slots::Auto => None,
        })
    }

    /// Workers in the job, when every node's slots are known.
    pub fn world_size(&self) -> Option<u32> {
        self.entries.iter().try_fold(0u32, |acc, e| match e.slots {
            Slots::Count(n) => acc.checked_add(n),
            Slots::Auto => None,
        })
    }
}

/// A parsed host expression: the user and the expanded names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostExpr {
    /// `user@` prefix.
    pub user: Option<String>,
    /// Expanded host names (IPv6 literals without brackets).
    pub hosts: Vec<String>,
}

fn hosts_err(msg: impl Into<String>) -> PlanError {
    PlanError::Hosts(msg.into())
}

fn at(place: impl Into<String>, error: PlanError) -> PlanError {
    PlanError::At { place: place.into(), error: Box::new(error) }
}

/// Splits `item` into the host expression and what follows its `:` (`None` without one). An item
/// whose host (after any `user@`) starts with `[` and has a `:` inside the brackets is an IPv6
/// literal: `[fe80::1]:4`, `root@[fe80::1]:4`.
pub fn split_count(item: &str) -> (&str, Option<&str>) {
    let start = match item.find('@') {
        Some(at) if item[at + 1..].starts_with('[') => at + 1,
        _ => 0,
    };
    if item[start..].starts_with('[')
        && let Some(close) = item[start..].find(']').map(|c| start + c)
        && item[start..close].contains(':')
    {
        return match item[close + 1..].strip_prefix(':') {
            Some(count) => (&item[..=close], Some(count)),
            None => (item, None),
        };
    }
    match item.split_once(':') {
        Some((h, c)) => (h, Some(c)),
        None => (item, None),
    }
}

/// DeepSpeed's and OpenMPI's files may hold a bare IPv6 address (`fe80::1 slots=4`), whose colons
/// would read as a count: asked for in brackets, instead of "slots must be an integer".
fn check_bare_ipv6(item: &str) -> Result<(), PlanError> {
    let addr = item.rsplit_once('@').map_or(item, |(_, h)| h);
    if addr.parse::<std::net::Ipv6Addr>().is_ok() {
        return Err(hosts_err(format!("invalid host \"{addr}\": write an IPv6 address in brackets, [{addr}] ([{addr}]:N for a count)")));
    }
    Ok(())
}

/// Parses a host expression: `[user@](hostlist | [ipv6])`.
///
/// # Errors
/// An invalid user, host name or hostlist.
pub fn parse_hostexpr(expr: &str) -> Result<HostExpr, PlanError> {
    let (user, rest) = match expr.rsplit_once('@') {
        Some((u, h)) => {
            check_name("user", u)?;
            (Some(u.to_owned()), h)
        }
        None => (None, expr),
    };
    if let Some(inner) = rest.strip_prefix('[').and_then(|r| r.strip_suffix(']'))
        && inner.contains(':')
    {
        if inner.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(hosts_err(format!("invalid host \"{rest}\": not an IPv6 address")));
        }
        return Ok(HostExpr { user, hosts: vec![inner.to_owned()] });
    }
    if rest.is_empty() {
        return Err(hosts_err(format!("invalid host \"{expr}\": empty host name")));
    }
    if rest.starts_with('-') {
        return Err(hosts_err(format!("invalid host \"{rest}\": host names may not start with '-'")));
    }
    let hosts = hostlist::expand(rest)?;
    if hosts.is_empty() {
        return Err(hosts_err(format!("invalid host \"{rest}\": no host name in it")));
    }
    for h in &hosts {
        check_name("host", h)?;
    }
    Ok(HostExpr { user, hosts })
}

/// Host and user names: letters, digits, `-`, `_`, `.`; not starting with `-` (an ssh option).
fn check_name(what: &str, name: &str) -> Result<(), PlanError> {
    if name.is_empty() {
        return Err(hosts_err(format!("invalid {what} \"\": empty {what} name")));
    }
    if name.starts_with('-') {
        return Err(hosts_err(format!("invalid {what} \"{name}\": {what} names may not start with '-'")));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "-_.".contains(*c))) {
        return Err(hosts_err(format!(
            "invalid {what} \"{name}\": {c:?} is not allowed ({what} names use letters, digits, '-', '_' and '.')"
        )));
    }
    Ok(())
}

/// Parses a slot count `1..=4096`; `what` is the text quoted in the message.
fn parse_count(value: &str, what: &str, key: &str) -> Result<u32, PlanError> {
    match value.parse::<u32>() {
        Ok(n) if (1..=MAX_SLOTS).contains(&n) && !value.starts_with('+') => Ok(n),
        _ => Err(hosts_err(format!("{key} must be an integer 1..{MAX_SLOTS}, got \"{value}\" in \"{what}\""))),
    }
}

const ATTRS: &[&str] = &["slots", "max_slots", "port", "user", "addr"];

/// One hostfile line's entry before expansion.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LineEntry {
    expr: HostExpr,
    /// The host expression as written (messages).
    written: String,
    slots: Option<u32>,
    user: Option<String>,
    port: Option<u16>,
    addr: Option<String>,
}

/// Parses one line (comment already removed, trimmed, non-empty).
fn parse_line(text: &str) -> Result<LineEntry, PlanError> {
    let words: Vec<&str> = text.split([' ', '\t']).filter(|w| !w.is_empty()).collect();
    // "slots = 4", "slots =4", "slots= 4": DeepSpeed's "bad entry", made specific.
    for (i, w) in words.iter().enumerate().skip(1) {
        let spaced = if *w == "=" {
            words.get(i + 1).map(|v| (words[i - 1], *v))
        } else if let Some(v) = w.strip_prefix('=') {
            Some((words[i - 1], v))
        } else if let Some(k) = w.strip_suffix('=')
            && !k.contains('=')
            && let Some(v) = words.get(i + 1)
            && !v.contains('=')
        {
            Some((k, *v))
        } else {
            None
        };
        if let Some((k, v)) = spaced {
            return Err(hosts_err(format!("\"{text}\": write {k}={v} (no spaces around '=')")));
        }
    }
    let first = words[0];
    check_bare_ipv6(first)?;
    let (host_part, count) = split_count(first);
    let expr = parse_hostexpr(host_part)?;
    let mut entry = LineEntry {
        expr,
        written: host_part.to_owned(),
        slots: None,
        user: None,
        port: None,
        addr: None,
    };
    if let Some(count) = count {
        if count == "0" {
            return Err(zero_slots(host_part));
        }
        entry.slots = Some(parse_count(count, text, "slots")?);
        if let Some(extra) = words.get(1) {
            return Err(hosts_err(format!("unexpected text \"{extra}\" after \"{first}\"")));
        }
        return Ok(entry);
    }
    let mut max_slots = None;
    let mut seen: Vec<&str> = Vec::new();
    for (i, w) in words.iter().enumerate().skip(1) {
        let Some((k, v)) = w.split_once('=') else {
            return Err(hosts_err(format!("unexpected text \"{w}\" after \"{}\"", words[i - 1])));
        };
        if !ATTRS.contains(&k) {
            return Err(hosts_err(match suggest(k) {
                Some(s) => format!("unknown attribute \"{w}\" (did you mean \"{s}={v}\"?)"),
                None => format!("unknown attribute \"{w}\" (known: {})", ATTRS.join(", ")),
            }));
        }
        if seen.contains(&k) {
            return Err(hosts_err(format!("attribute \"{k}\" given twice in \"{text}\"")));
        }
        seen.push(k);
        match k {
            "slots" => {
                if v == "0" {
                    return Err(zero_slots(host_part));
                }
                entry.slots = Some(parse_count(v, text, "slots")?);
            }
            "max_slots" => max_slots = Some(parse_count(v, text, "max_slots")?),
            "port" => {
                entry.port = Some(v.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
                    hosts_err(format!("port must be an integer 1..65535, got \"{v}\" in \"{text}\""))
                })?)
            }
            "user" => {
                check_name("user", v)?;
                entry.user = Some(v.to_owned());
            }
            _ => {
                // addr: an IP address or a host name, never an option or shell syntax (ssh
                // hands it to ProxyCommand and --rsh wrappers may build shell strings with it).
                if v.parse::<std::net::IpAddr>().is_err() && check_name("addr", v).is_err() {
                    return Err(hosts_err(format!(
                        "invalid addr \"{v}\" in \"{text}\": expected an IP address or a host name (letters, digits, '-', '_' and '.', not starting with '-')"
                    )));
                }
                entry.addr = Some(v.to_owned());
            }
        }
    }
    // OpenMPI's max_slots: accepted; it must be >= slots, otherwise it is ignored. rsrun never
    // oversubscribes, so it has no further effect.
    let _ = max_slots;
    Ok(entry)
}

/// The whole table's bound, the same as one hostlist expression's.
fn too_many_hosts() -> PlanError {
    hosts_err(format!("more than {} hosts in all", hostlist::MAX_HOSTS))
}

fn zero_slots(host: &str) -> PlanError {
    hosts_err(format!("slots=0 on host \"{host}\"; remove the line or use --exclude {host}"))
}

/// The attribute `k` was probably meant to be (edit distance 1 or 2, or a prefix).
fn suggest(k: &str) -> Option<&'static str> {
    ATTRS
        .iter()
        .copied()
        .map(|a| (edit_distance(k, a), a))
        .filter(|(d, a)| *d <= 2 || a.starts_with(k) || k.starts_with(a))
        .min_by_key(|(d, _)| *d)
        .map(|(_, a)| a)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Parses hostfile text. `name` is the path as the user gave it (`./hosts`), used in messages and
/// sources; `default_slots` is `--nproc-per-node` when given.
///
/// # Errors
/// Every §1.5 message, as `hostfile NAME:LINE: ...`.
pub fn parse_hostfile(name: &str, text: &str, default_slots: Option<u32>) -> Result<Vec<HostEntry>, PlanError> {
    let mut out: Vec<HostEntry> = Vec::new();
    let mut first_line: HashMap<String, usize> = HashMap::new();
    // A byte-order mark (a Windows editor's) is no part of the first host's name.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (idx, raw) in text.split('\n').enumerate() {
        let line_no = idx + 1;
        let place = || format!("hostfile {name}:{line_no}");
        let raw = raw.strip_suffix('\r').unwrap_or(raw);
        let content = raw.split_once('#').map(|(a, _)| a).unwrap_or(raw).trim_matches([' ', '\t']);
        if content.is_empty() {
            continue;
        }
        let entry = parse_line(content).map_err(|e| at(place(), e))?;
        if out.len() + entry.expr.hosts.len() > hostlist::MAX_HOSTS {
            return Err(at(place(), too_many_hosts()));
        }
        for h in entry.expr.hosts {
            if let Some(first) = first_line.get(&h) {
                return Err(at(
                    place(),
                    hosts_err(format!(
                        "duplicate host \"{h}\" (first on line {first}); list each host once with slots=N"
                    )),
                ));
            }
            first_line.insert(h.clone(), line_no);
            out.push(HostEntry {
                host: h,
                slots: entry.slots.or(default_slots).map(Slots::Count).unwrap_or(Slots::Auto),
                devices: None,
                user: entry.user.clone().or_else(|| entry.expr.user.clone()),
                port: entry.port,
                addr: entry.addr.clone(),
                source: Source::Line { file: name.to_owned(), line: line_no },
            });
        }
    }
    if out.is_empty() {
        return Err(hosts_err(format!("hostfile {name}: no hosts (empty, or only comments)")));
    }
    Ok(out)
}

/// Splits a `-H` list at commas outside brackets.
fn split_items(list: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    items
}

/// Parses a `-H` list: `h1:2,h2:4`, `n[1-4]:8`, `[fe80::1]:4`. A host without a count gets
/// `default_slots` (`--nproc-per-node`), and is an error without it.
///
/// # Errors
/// Every `-H` message of §1.5, as `-H "LIST": ...`.
pub fn parse_hosts_arg(list: &str, default_slots: Option<u32>) -> Result<Vec<HostEntry>, PlanError> {
    let place = format!("-H \"{list}\"");
    let mut out: Vec<HostEntry> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for item in split_items(list).into_iter().map(str::trim) {
        if item.is_empty() {
            return Err(at(&place, hosts_err("empty host (two commas, or a comma at an end)")));
        }
        check_bare_ipv6(item)?;
        let (host_part, count) = split_count(item);
        let expr = parse_hostexpr(host_part).map_err(|e| at(&place, e))?;
        let slots = match count {
            Some("0") => return Err(at(&place, zero_slots(host_part))),
            Some(c) => parse_count(c, item, "slots").map_err(|e| at(&place, e))?,
            None => default_slots.ok_or_else(|| {
                at(
                    &place,
                    hosts_err(format!(
                        "host \"{host_part}\" has no slot count; write {host_part}:N or pass --nproc-per-node"
                    )),
                )
            })?,
        };
        if out.len() + expr.hosts.len() > hostlist::MAX_HOSTS {
            return Err(at(&place, too_many_hosts()));
        }
        for h in expr.hosts {
            if !seen.insert(h.clone()) {
                return Err(at(&place, hosts_err(format!("duplicate host \"{h}\"; list each host once with :N"))));
            }
            out.push(HostEntry {
                host: h,
                slots: Slots::Count(slots),
                devices: None,
                user: expr.user.clone(),
                port: None,
                addr: None,
                source: Source::HostsArg,
            });
        }
    }
    Ok(out)
}

/// Reads `--hostfile` / `-H` and applies `--include`/`--exclude`, `--nnodes` and `--nproc-per-node`,
/// in that order. `None` when neither option is given.
///
/// # Errors
/// Every hostfile, `-H` and filter error; a missing or unreadable hostfile.
pub fn resolve_table(args: &LaunchArgs, host: &HostInfo) -> Result<Option<HostTable>, PlanError> {
    let filter_given = args.include.is_some() || args.exclude.is_some();
    // Typed options shape the table; a PET_NNODES or PET_NPROC_PER_NODE left in the environment
    // (a pod's, a shell's) does not cut or resize it (see `multinode::resolve`'s note).
    let typed = |id: &str| args.origin(id) == crate::cli::Origin::CommandLine;
    let nproc = || -> Result<Option<u32>, PlanError> {
        if !typed("nproc_per_node") {
            return Ok(None);
        }
        let n = args.nproc_per_node.trim().parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
            hosts_err(format!(
                "--nproc-per-node {} with a host table: give a number (slots are per host; a bare host without it is detected at preflight)",
                args.nproc_per_node
            ))
        })?;
        // It becomes the slot count of bare hosts: the plan's per-node limit applies.
        if n > crate::plan::MAX_NPROC_PER_NODE {
            return Err(PlanError::Invalid {
                flag: "--nproc-per-node",
                value: args.nproc_per_node.trim().to_owned(),
                expected: format!("at most {} workers per node", crate::plan::MAX_NPROC_PER_NODE),
            });
        }
        Ok(Some(n))
    };
    let (mut entries, origin, what, nproc) = match (&args.hostfile, &args.hosts) {
        (None, None) => {
            if let Some(flag) = [("include", "--include"), ("exclude", "--exclude")]
                .iter()
                .find(|(id, _)| args.given(id))
                .map(|(_, f)| f)
            {
                return Err(hosts_err(format!("{flag} needs a host table: --hostfile FILE or -H HOST:N,...")));
            }
            return Ok(None);
        }
        _ if args.hostfile.is_some() && args.hosts.is_some() => {
            return Err(PlanError::Conflict("--hostfile and -H/--hosts cannot be used together".into()));
        }
        (Some(path), _) => {
            let nproc = nproc()?;
            let name = path.display().to_string();
            let text = read_hostfile(&host.cwd.join(path), &name)?;
            (parse_hostfile(&name, &text, nproc)?, format!("hostfile {name}"), "the hostfile".to_owned(), nproc)
        }
        (None, Some(list)) => {
            if !list.contains(':') && host.cwd.join(list).is_file() {
                return Err(hosts_err(format!("-H \"{list}\": this is a file; did you mean --hostfile {list}?")));
            }
            let nproc = nproc()?;
            let entries = parse_hosts_arg(list, nproc)?;
            (entries, "-H".to_owned(), "-H".to_owned(), nproc)
        }
    };
    match (&args.include, &args.exclude) {
        (Some(_), Some(_)) => return Err(hosts_err("--include and --exclude cannot be used together")),
        (Some(spec), None) | (None, Some(spec)) => {
            if let Some(n) = nproc {
                return Err(hosts_err(format!(
                    "--nproc-per-node {n} with {}: the filter picks the slots; drop one of them",
                    if args.include.is_some() { "--include" } else { "--exclude" }
                )));
            }
            let kind = if args.include.is_some() { filter::Kind::Include } else { filter::Kind::Exclude };
            let f = filter::Filter::parse(kind, spec)?;
            entries = f.apply(&entries, &what)?;
        }
        (None, None) => {}
    }
    if typed("nnodes") {
        let range = NodeRange::parse(&args.nnodes)?;
        let want = range.max as usize;
        if filter_given {
            if entries.len() != want {
                let (flag, verb) =
                    if args.include.is_some() { ("--include", "selects") } else { ("--exclude", "leaves") };
                let n = entries.len();
                return Err(hosts_err(format!(
                    "{flag} {verb} {n} node{} but --nnodes is {}",
                    if n == 1 { "" } else { "s" },
                    args.nnodes.trim()
                )));
            }
        } else if entries.len() < want {
            return Err(hosts_err(format!(
                "--nnodes {} but {what} lists {} host{}",
                args.nnodes.trim(),
                entries.len(),
                if entries.len() == 1 { "" } else { "s" }
            )));
        }
        entries.truncate(want);
    }
    if let Some(n) = nproc
        && !filter_given
    {
        for e in &mut entries {
            match e.slots {
                Slots::Count(s) if s < n => {
                    return Err(hosts_err(format!(
                        "--nproc-per-node {n} but host \"{}\" has slots={s} ({})",
                        e.host, e.source
                    )));
                }
                _ => e.slots = Slots::Count(n),
            }
        }
    }
    Ok(Some(HostTable { entries, origin }))
}

fn read_hostfile(path: &Path, name: &str) -> Result<String, PlanError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(hosts_err(format!("--hostfile {name}: no such file")));
        }
        Err(e) => return Err(hosts_err(format!("--hostfile {name}: {e}"))),
    };
    if !meta.is_file() {
        return Err(hosts_err(format!("--hostfile {name}: not a regular file")));
    }
    if meta.len() > MAX_HOSTFILE_BYTES {
        return Err(hosts_err(format!("--hostfile {name}: {} bytes, more than 1 MiB", meta.len())));
    }
    let bytes = std::fs::read(path).map_err(|e| hosts_err(format!("--hostfile {name}: {e}")))?;
    String::from_utf8(bytes).map_err(|e| hosts_err(format!("--hostfile {name}: not UTF-8 (byte {})", e.utf8_error().valid_up_to())))
}

#[cfg(test)]
mod tests;
