//! Slurm hostlist expressions: `gpu[01-04,07],cpu3`, `rack[1-2]-node[01-02]`.
//!
//! [`expand`] gives exactly what Slurm 22.05.8's `scontrol show hostnames` prints for every row of the
//! reference table (multinode.md §3.3), with one deliberate deviation: an unclosed `[` is an error
//! (Slurm appends a `]` and carries on). Errors name the token, where `scontrol` prints to stderr and
//! still exits 0.
//!
//! Grammar:
//!
//! ```text
//! hostlist = token { sep token } ;   sep = "," | " " | "\t"  (runs collapse; commas inside [...] do not split)
//! token    = plain | prefix "[" ranges "]" ;     nothing may follow the last "]"
//! prefix   = { char | "[" ranges "]" } ;          earlier brackets multiply: a[1-2]b[3-4]
//! ranges   = range { "," range } ;
//! range    = digits [ "-" digits ] ;              lo <= hi; width = length of lo's digit string
//! ```
//!
//! Numbers print zero-padded to the width of `lo` (`node[001-3]` is node001..node003, `node[9-011]`
//! is node9..node11). A range holds at most 65,536 hosts; duplicates and order are kept. Sizes are
//! checked before anything is expanded: a padding width or a host name longer than 253 characters
//! (the DNS limit), more than [`MAX_HOSTS`] names, or more than [`MAX_EXPANDED_BYTES`] of names is an
//! error.

use crate::plan::PlanError;

/// Most hosts one range may hold (Slurm's `MAX_RANGE`).
pub const MAX_RANGE: u64 = 65_536;
/// Most hosts one expression may expand to (rsrun's bound; Slurm has none, and `a[0-65535]b[0-65535]`
/// would be four billion names).
pub const MAX_HOSTS: usize = 1 << 20;
/// Longest host name (and padding width): the DNS limit of RFC 1035.
pub const MAX_NAME_LEN: usize = 253;
/// Most bytes of host names one expression may expand to (MAX_HOSTS names of 64 characters).
pub const MAX_EXPANDED_BYTES: u64 = 64 << 20;

fn bad(list: &str, reason: impl Into<String>) -> PlanError {
    PlanError::Hostlist { list: clip(list), reason: reason.into() }
}

/// `s` for a message: its first 40 characters and "..." when it is longer.
pub(crate) fn clip(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((end, _)) => format!("{}...", &s[..end]),
        None => s.to_owned(),
    }
}

/// Expands a hostlist expression into host names, in order, duplicates kept.
///
/// # Errors
/// [`PlanError::Hostlist`] naming the offending token and why.
pub fn expand(list: &str) -> Result<Vec<String>, PlanError> {
    let mut out = Vec::new();
    let mut bytes = 0u64;
    for token in split_tokens(list)? {
        let groups = parse_token(token)?;
        // Sized before anything is expanded: the count and the longest name.
        let (count, len) = token_size(token, &groups)?;
        let total = (out.len() as u64).saturating_add(count);
        bytes = bytes.saturating_add(count.saturating_mul(len as u64));
        if total > MAX_HOSTS as u64 {
            return Err(bad(list, format!("more than {MAX_HOSTS} hosts")));
        }
        if bytes > MAX_EXPANDED_BYTES {
            return Err(bad(
                list,
                format!("expands to more than {} MiB of host names (names of up to {len} characters)", MAX_EXPANDED_BYTES >> 20),
            ));
        }
        out.extend(expand_groups(token, &groups));
    }
    Ok(out)
}

/// Splits at separators outside brackets; empty tokens (runs of separators) are dropped.
///
/// # Errors
/// An unclosed `[` or a stray `]`.
pub fn split_tokens(list: &str) -> Result<Vec<&str>, PlanError> {
    let mut tokens = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err(bad(token_at(list, start), "nested '['"));
                }
                depth += 1;
            }
            ']' => {
                if depth == 0 {
                    return Err(bad(token_at(list, start), "']' without '['"));
                }
                depth -= 1;
            }
            ',' | ' ' | '\t' if depth == 0 => {
                if i > start {
                    tokens.push(&list[start..i]);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(bad(&list[start..], "unclosed '['"));
    }
    if start < list.len() {
        tokens.push(&list[start..]);
    }
    Ok(tokens)
}

/// The token that starts at `start` (for messages).
fn token_at(list: &str, start: usize) -> &str {
    let rest = &list[start..];
    let end = rest.find([' ', '\t']).unwrap_or(rest.len());
    &rest[..end]
}

/// A parsed range inside brackets.
#[derive(Debug, Clone, Copy)]
struct Range {
    lo: u64,
    hi: u64,
    width: usize,
}

impl Range {
    /// Characters of the longest number it prints (zero-padded to `width`).
    fn max_len(&self) -> usize {
        self.width.max(self.hi.to_string().len())
    }
}

/// A token's pieces: the literal text before each bracket group, and the group's ranges.
type Groups<'a> = Vec<(&'a str, Vec<Range>)>;

/// Parses a token into its bracket groups (none for a plain name).
fn parse_token(token: &str) -> Result<Groups<'_>, PlanError> {
    let mut groups = Vec::new();
    if !token.contains('[') {
        return Ok(groups);
    }
    if !token.ends_with(']') {
        // Slurm: "Invalid hostlist" (pdsh allows a suffix, Slurm does not).
        return Err(bad(token, "nothing may follow the last ']'"));
    }
    let mut rest = token;
    while let Some(open) = rest.find('[') {
        // `split_tokens` guarantees every '[' has its ']' and that brackets do not nest.
        let Some(close) = rest[open..].find(']').map(|c| open + c) else {
            return Err(bad(token, "unclosed '['"));
        };
        groups.push((&rest[..open], parse_ranges(token, &rest[open + 1..close])?));
        rest = &rest[close + 1..];
    }
    // `token` ends with ']', so nothing is left after the last group.
    debug_assert!(rest.is_empty());
    Ok(groups)
}

/// How many names `token` expands to (saturating) and the length of the longest.
///
/// # Errors
/// A name longer than [`MAX_NAME_LEN`].
fn token_size(token: &str, groups: &Groups<'_>) -> Result<(u64, usize), PlanError> {
    if groups.is_empty() {
        if token.len() > MAX_NAME_LEN {
            return Err(bad(token, format!("host name of {} characters (at most {MAX_NAME_LEN}, the DNS limit)", token.len())));
        }
        return Ok((1, token.len()));
    }
    let mut count = 1u64;
    let mut len = 0usize;
    for (literal, ranges) in groups {
        count = count.saturating_mul(ranges.iter().map(|r| r.hi - r.lo + 1).sum());
        len = len.saturating_add(literal.len()).saturating_add(ranges.iter().map(Range::max_len).max().unwrap_or(0));
    }
    if len > MAX_NAME_LEN {
        return Err(bad(token, format!("host names of up to {len} characters (at most {MAX_NAME_LEN}, the DNS limit)")));
    }
    Ok((count, len))
}

/// Expands a token whose size was checked by [`token_size`].
fn expand_groups(token: &str, groups: &Groups<'_>) -> Vec<String> {
    if groups.is_empty() {
        return vec![token.to_owned()];
    }
    let mut names = vec![String::new()];
    for (literal, ranges) in groups {
        let count: u64 = ranges.iter().map(|r| r.hi - r.lo + 1).sum();
        let mut next = Vec::with_capacity(names.len().saturating_mul(count as usize));
        for name in &names {
            for r in ranges {
                for n in r.lo..=r.hi {
                    next.push(format!("{name}{literal}{n:0w$}", w = r.width));
                }
            }
        }
        names = next;
    }
    names
}

fn parse_ranges(token: &str, inner: &str) -> Result<Vec<Range>, PlanError> {
    if inner.is_empty() {
        return Err(bad(token, "empty brackets"));
    }
    let mut out = Vec::new();
    for part in inner.split(',') {
        let (lo_s, hi_s) = match part.split_once('-') {
            Some((a, b)) => (a, Some(b)),
            None => (part, None),
        };
        let number = |s: &str| -> Result<u64, PlanError> {
            if s.is_empty() {
                return Err(bad(token, format!("range \"{}\" is not N or N-M", clip(part))));
            }
            if !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad(token, format!("\"{}\" in range \"{}\" is not a number", clip(s), clip(part))));
            }
            s.parse::<u64>().map_err(|_| bad(token, format!("number \"{}\" is too large", clip(s))))
        };
        let lo = number(lo_s)?;
        if lo_s.len() > MAX_NAME_LEN {
            // Refused before the numbers are printed at this width.
            return Err(bad(
                token,
                format!("padding width {} of \"{}\" is longer than a host name may be (at most {MAX_NAME_LEN}, the DNS limit)", lo_s.len(), clip(lo_s)),
            ));
        }
        let hi = match hi_s {
            Some(h) => number(h)?,
            None => lo,
        };
        if lo > hi {
            return Err(bad(token, format!("range start {lo} > end {hi}")));
        }
        if hi - lo >= MAX_RANGE {
            return Err(bad(token, format!("too many hosts in range \"{}\" (at most {MAX_RANGE})", clip(part))));
        }
        out.push(Range { lo, hi, width: lo_s.len() });
    }
    Ok(out)
}

/// Compresses host names into one hostlist expression that [`expand`]s back to the same list (order
/// and duplicates kept): runs of names that differ only in a trailing number become `prefix[a-b,c]`.
/// Names that cannot be written in the grammar (brackets, separators) are not expected here; they are
/// copied unchanged.
pub fn compress<S: AsRef<str>>(hosts: &[S]) -> String {
    // (prefix, ranges) groups; a name without a trailing number is a group with no ranges.
    let mut groups: Vec<(String, Vec<Range>)> = Vec::new();
    for h in hosts {
        let h = h.as_ref();
        let Some((prefix, digits, n)) = split_number(h) else {
            groups.push((h.to_owned(), Vec::new()));
            continue;
        };
        let width = digits.len();
        if let Some((p, ranges)) = groups.last_mut()
            && !ranges.is_empty()
            && p.as_str() == prefix
        {
            if let Some(last) = ranges.last_mut()
                && last.hi.checked_add(1) == Some(n)
                && format!("{n:0w$}", w = last.width) == digits
                && n - last.lo < MAX_RANGE
            {
                last.hi = n;
            } else {
                ranges.push(Range { lo: n, hi: n, width });
            }
            continue;
        }
        groups.push((prefix.to_owned(), vec![Range { lo: n, hi: n, width }]));
    }
    let parts: Vec<String> = groups
        .into_iter()
        .map(|(prefix, ranges)| {
            if ranges.is_empty() {
                return prefix;
            }
            if let [r] = ranges.as_slice()
                && r.lo == r.hi
            {
                return format!("{prefix}{:0w$}", r.lo, w = r.width);
            }
            let inner: Vec<String> = ranges
                .iter()
                .map(|r| {
                    if r.lo == r.hi {
                        format!("{:0w$}", r.lo, w = r.width)
                    } else {
                        format!("{:0w$}-{:0w$}", r.lo, r.hi, w = r.width)
                    }
                })
                .collect();
            format!("{prefix}[{}]", inner.join(","))
        })
        .collect();
    parts.join(",")
}

/// `node017` → (`node`, `017`, 17). `None` without a trailing number, for an all-digit name (a group
/// would start with '['), or when the number does not fit.
fn split_number(h: &str) -> Option<(&str, &str, u64)> {
    let start = h.len() - h.bytes().rev().take_while(u8::is_ascii_digit).count();
    if start == 0 || start == h.len() || h.len() - start > 18 {
        return None;
    }
    let digits = &h[start..];
    Some((&h[..start], digits, digits.parse().ok()?))
}

/// Expands Slurm's count lists (`SLURM_TASKS_PER_NODE`, `SLURM_JOB_CPUS_PER_NODE`): `2(x3),1` is
/// `[2, 2, 2, 1]`.
///
/// # Errors
/// [`PlanError::Hostlist`] (the list and why) for anything but `count["(x"rep")"]{,...}`.
pub fn expand_counts(list: &str) -> Result<Vec<u32>, PlanError> {
    let bad = |why: String| PlanError::Hostlist { list: list.to_owned(), reason: why };
    let mut out = Vec::new();
    if list.trim().is_empty() {
        return Err(bad("empty count list".into()));
    }
    for part in list.trim().split(',') {
        let (count, rep) = match part.split_once("(x") {
            Some((c, r)) => {
                let r = r.strip_suffix(')').ok_or_else(|| bad(format!("\"{part}\" is not N or N(xR)")))?;
                (c, r.parse::<u32>().ok().filter(|r| *r > 0).ok_or_else(|| bad(format!("bad repeat \"{r}\"")))?)
            }
            None => (part, 1),
        };
        let count = count.parse::<u32>().map_err(|_| bad(format!("\"{part}\" is not N or N(xR)")))?;
        if out.len() + rep as usize > MAX_HOSTS {
            return Err(bad(format!("more than {MAX_HOSTS} entries")));
        }
        out.extend(std::iter::repeat_n(count, rep as usize));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
