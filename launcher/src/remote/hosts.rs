//! TEMPORARY host-list parser, to be replaced by `multinode::hostfile` at merge.
//!
//! Only the trivial forms are accepted here: `-H h1:2,h2:2` and hostfile lines `HOST slots=N` or
//! `HOST:N` with `#` comments and blank lines. The full grammar (hostlists, `[ipv6]:N`, `max_slots`,
//! include/exclude filters, the §1.5 messages) is the `multinode` branch's; at merge this file goes
//! away and `plan.rs` converts its `Vec<HostEntry>` with
//! `entries.into_iter().map(|e| RemoteHost { host: e.host, slots: e.slots, devices: e.devices })`.

use crate::plan::PlanError;

use super::RemoteHost;

fn invalid(flag: &'static str, value: &str, expected: &str) -> PlanError {
    PlanError::Invalid { flag, value: value.to_owned(), expected: expected.to_owned() }
}

/// A host name that cannot be taken for an ssh option or break a command line.
fn check_host(host: &str, flag: &'static str, entry: &str) -> Result<(), PlanError> {
    let ok = !host.is_empty()
        && !host.starts_with('-')
        && host.chars().all(|c| c.is_ascii_alphanumeric() || "._-@:".contains(c));
    if ok { Ok(()) } else { Err(invalid(flag, entry, "a host name of letters, digits and . _ - @ (not starting with '-')")) }
}

fn slots(n: &str, flag: &'static str, entry: &str) -> Result<u32, PlanError> {
    match n.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(invalid(flag, entry, "HOST:N with N a number of slots > 0")),
    }
}

/// `-H h1:2,h2:2`.
///
/// # Errors
/// An entry that is not `HOST:N` with N > 0, or an empty list.
pub(crate) fn parse_host_list(s: &str) -> Result<Vec<RemoteHost>, PlanError> {
    const FLAG: &str = "--hosts";
    let mut out = Vec::new();
    for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let Some((host, n)) = entry.rsplit_once(':') else {
            return Err(invalid(FLAG, entry, "HOST:N with N a number of slots > 0"));
        };
        check_host(host, FLAG, entry)?;
        out.push(RemoteHost { host: host.to_owned(), slots: slots(n, FLAG, entry)?, devices: None });
    }
    if out.is_empty() {
        return Err(invalid(FLAG, s, "at least one HOST:N"));
    }
    Ok(out)
}

/// Hostfile text: `HOST slots=N` or `HOST:N` per line, `#` comments, blank lines.
///
/// # Errors
/// A line in another form (naming the file and line), or no host at all.
pub(crate) fn parse_hostfile(text: &str, origin: &str) -> Result<Vec<RemoteHost>, PlanError> {
    const FLAG: &str = "--hostfile";
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = format!("{origin}:{}: {line}", i + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (host, n) = match fields.as_slice() {
            [host, s] => match s.strip_prefix("slots=") {
                Some(n) => (*host, n),
                None => return Err(invalid(FLAG, &at, "`HOST slots=N` or `HOST:N`")),
            },
            [entry] => match entry.rsplit_once(':') {
                Some((host, n)) => (host, n),
                None => return Err(invalid(FLAG, &at, "`HOST slots=N` or `HOST:N`")),
            },
            _ => return Err(invalid(FLAG, &at, "`HOST slots=N` or `HOST:N`")),
        };
        check_host(host, FLAG, &at)?;
        out.push(RemoteHost { host: host.to_owned(), slots: slots(n, FLAG, &at)?, devices: None });
    }
    if out.is_empty() {
        return Err(invalid(FLAG, origin, "a file listing at least one host"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lists() {
        let h = parse_host_list("h1:2, h2:4").unwrap();
        assert_eq!(h.iter().map(|h| (h.host.as_str(), h.slots)).collect::<Vec<_>>(), [("h1", 2), ("h2", 4)]);
        for bad in ["h1", "h1:0", "h1:x", "-oProxyCommand=x:1", "a b:1", ""] {
            assert!(parse_host_list(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hostfiles() {
        let h = parse_hostfile("# nodes\nw0 slots=2\n\nw1:3  # comment\n", "hf").unwrap();
        assert_eq!(h.iter().map(|h| (h.host.as_str(), h.slots)).collect::<Vec<_>>(), [("w0", 2), ("w1", 3)]);
        let e = parse_hostfile("w0 slots=2\nw1 gpus=2\n", "hf").unwrap_err().to_string();
        assert!(e.contains("hf:2: w1 gpus=2"), "{e}");
        assert!(parse_hostfile("# empty\n", "hf").is_err());
    }
}
