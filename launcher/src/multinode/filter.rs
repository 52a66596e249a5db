//! `--include` / `--exclude` (DeepSpeed's syntax, extended; multinode.md §1.4).
//!
//! ```text
//! filter    = nodespec { "@" nodespec } ;
//! nodespec  = hostexpr [ ":" slotlist ] ;     hostexpr may be a hostlist: w[0-3]
//! slotlist  = slotrange { "," slotrange } ;
//! slotrange = int [ "-" int ] ;
//! ```
//!
//! A host with no `:slots` means all of its slots; a host whose slots become empty is dropped. The
//! result keeps the host table's order, not the filter's (`-i w1@w0` still puts w0 first). Unlike
//! DeepSpeed, a host named alone is kept whole (`-i w1`), a host before `@` is kept
//! (`-i w0@w1:1`), and a slot out of range is an error (`-i w1:4` on a 4-slot host).

use std::collections::{BTreeSet, HashMap};

use super::hostfile::{self, HostEntry, Slots};
use super::hostlist;
use crate::plan::PlanError;

/// Which filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--include`: keep only these.
    Include,
    /// `--exclude`: drop these.
    Exclude,
}

impl Kind {
    fn flag(self) -> &'static str {
        match self {
            Kind::Include => "--include",
            Kind::Exclude => "--exclude",
        }
    }
}

/// One `host[:slots]` of a filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// The spec as written (messages).
    pub text: String,
    /// Expanded host names.
    pub hosts: Vec<String>,
    /// The slots named, sorted and deduplicated; `None` means all.
    pub slots: Option<BTreeSet<u32>>,
}

/// A parsed `--include` / `--exclude`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    /// Include or exclude.
    pub kind: Kind,
    /// The node specs, in the order given.
    pub specs: Vec<NodeSpec>,
}

fn err(msg: String) -> PlanError {
    PlanError::Hosts(msg)
}

impl Filter {
    /// Parses `w0@w1:0,2`, `w[0-3]:0-1,3`.
    ///
    /// # Errors
    /// Empty specs, bad host expressions, slots that are not numbers, empty slot lists.
    pub fn parse(kind: Kind, text: &str) -> Result<Filter, PlanError> {
        let flag = kind.flag();
        let mut specs = Vec::new();
        let mut hosts = 0usize;
        for spec in text.split('@').map(str::trim) {
            if spec.is_empty() {
                return Err(err(format!("{flag} \"{text}\": empty host (write HOST[:SLOTS]@HOST[:SLOTS])")));
            }
            let (host_part, slot_part) = hostfile::split_count(spec);
            let expr = hostfile::parse_hostexpr(host_part)
                .map_err(|e| PlanError::At { place: format!("{flag} \"{spec}\""), error: Box::new(e) })?;
            if expr.user.is_some() {
                return Err(err(format!("{flag} \"{spec}\": a filter names hosts, not users")));
            }
            hosts += expr.hosts.len();
            if hosts > hostlist::MAX_HOSTS {
                return Err(err(format!("{flag}: more than {} hosts in all", hostlist::MAX_HOSTS)));
            }
            let slots = match slot_part {
                None => None,
                Some(list) => Some(parse_slots(flag, spec, list)?),
            };
            specs.push(NodeSpec { text: spec.to_owned(), hosts: expr.hosts, slots });
        }
        Ok(Filter { kind, specs })
    }

    /// Applies the filter to `entries` (`what` names the table in messages: `the hostfile`, `-H`).
    ///
    /// # Errors
    /// A host not in the table, a slot out of range, slots of a host whose count is `auto`, or
    /// nothing left.
    pub fn apply(&self, entries: &[HostEntry], what: &str) -> Result<Vec<HostEntry>, PlanError> {
        let flag = self.kind.flag();
        // Per table index: the selected (include) or removed (exclude) slots; None = all.
        let mut picked: Vec<Option<Option<BTreeSet<u32>>>> = vec![None; entries.len()];
        // Host names are unique in a table (duplicates are errors).
        let index: HashMap<&str, usize> = entries.iter().enumerate().map(|(i, e)| (e.host.as_str(), i)).collect();
        for spec in &self.specs {
            for h in &spec.hosts {
                let Some(&idx) = index.get(h.as_str()) else {
                    let names: Vec<&str> = entries.iter().take(8).map(|e| e.host.as_str()).collect();
                    return Err(err(format!(
                        "{flag}: host \"{h}\" is not in {what} ({} host{}: {}{})",
                        entries.len(),
                        if entries.len() == 1 { "" } else { "s" },
                        names.join(", "),
                        if entries.len() > 8 { ", ..." } else { "" }
                    )));
                };
                let e = &entries[idx];
                let slots = match &spec.slots {
                    None => None,
                    Some(set) => {
                        let Slots::Count(n) = e.slots else {
                            return Err(err(format!(
                                "{flag} \"{}\": host {h} has no slot count (slots are detected at preflight); give it slots=N",
                                spec.text
                            )));
                        };
                        if set.iter().any(|s| *s >= n) {
                            return Err(err(format!(
                                "{flag} \"{}\": host {h} has slots {}",
                                spec.text,
                                if n == 1 { "0".to_owned() } else { format!("0-{}", n - 1) }
                            )));
                        }
                        Some(set.clone())
                    }
                };
                // Union with an earlier spec of the same host; None (all) absorbs.
                picked[idx] = Some(match (picked[idx].take(), slots) {
                    (None, s) => s,
                    (Some(None), _) | (Some(_), None) => None,
                    (Some(Some(mut a)), Some(b)) => {
                        a.extend(b);
                        Some(a)
                    }
                });
            }
        }
        let mut out = Vec::new();
        for (e, pick) in entries.iter().zip(picked) {
            let all = |e: &HostEntry| -> BTreeSet<u32> {
                match e.slots {
                    Slots::Count(n) => (0..n).collect(),
                    Slots::Auto => BTreeSet::new(),
                }
            };
            let kept: Option<Option<BTreeSet<u32>>> = match (self.kind, pick) {
                (Kind::Include, None) => None,
                (Kind::Include, Some(None)) => Some(None),
                (Kind::Include, Some(Some(s))) => Some(Some(s)),
                (Kind::Exclude, None) => Some(None),
                (Kind::Exclude, Some(None)) => None,
                (Kind::Exclude, Some(Some(s))) => {
                    let left: BTreeSet<u32> = all(e).difference(&s).copied().collect();
                    (!left.is_empty()).then_some(Some(left))
                }
            };
            match kept {
                None => {}
                Some(None) => out.push(e.clone()),
                Some(Some(devices)) => {
                    let mut e = e.clone();
                    e.slots = Slots::Count(devices.len() as u32);
                    e.devices = Some(devices.into_iter().collect());
                    out.push(e);
                }
            }
        }
        if out.is_empty() {
            return Err(err(format!("{flag}: no hosts left in {what}")));
        }
        Ok(out)
    }
}

fn parse_slots(flag: &str, spec: &str, list: &str) -> Result<BTreeSet<u32>, PlanError> {
    if list.trim().is_empty() {
        return Err(err(format!("{flag} \"{spec}\": empty slot list")));
    }
    let number = |s: &str| -> Result<u32, PlanError> {
        let s = s.trim();
        match s.parse::<u32>() {
            Ok(n) if !s.starts_with('+') => Ok(n),
            _ => Err(err(format!("{flag} \"{spec}\": slot \"{s}\" is not a number"))),
        }
    };
    let mut out = BTreeSet::new();
    for part in list.split(',') {
        if part.trim().is_empty() {
            return Err(err(format!("{flag} \"{spec}\": empty slot in \"{list}\"")));
        }
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (number(a)?, number(b)?);
                if a > b {
                    return Err(err(format!("{flag} \"{spec}\": slot range \"{part}\" is empty (start > end)")));
                }
                if b >= hostfile::MAX_SLOTS {
                    return Err(err(format!("{flag} \"{spec}\": slot {b} is above {}", hostfile::MAX_SLOTS - 1)));
                }
                out.extend(a..=b);
            }
            None => {
                out.insert(number(part)?);
            }
        }
    }
    Ok(out)
}
