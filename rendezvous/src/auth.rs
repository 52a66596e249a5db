//! Token authentication and per-job authorization.
//!
//! A token file holds one token per line, optionally followed by the jobs it may touch:
//!
//! ```text
//! # admin: every job, and `status` of every job
//! 3f9c0e...            
//! # team A: only jobs whose id starts with "teamA-"
//! 77ab01...  teamA-*
//! # exactly one job
//! 5d2e44...  job7
//! # team B: its jobs, at most 20 of them at once
//! 9a41c7...  teamB-*  jobs=20
//! ```
//!
//! Clients send `authorization: Bearer <token>` on every RPC. A missing or unknown token is
//! `UNAUTHENTICATED`; a known token used on another job is `PERMISSION_DENIED`. Either way nothing
//! changes. Without a token file every caller may touch every job (loopback or `--insecure` only).
//!
//! `jobs=N` caps the jobs a token may start: a join that would create a job (or start an ended
//! one over) is `RESOURCE_EXHAUSTED` while N jobs that the token may touch are live (any not
//! ended-and-empty, whoever created them), so one team cannot take the service's `--max-jobs`
//! from the others ([`JobQuota`]).

use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Status};

use crate::RdzvError;
use crate::state::State;


/// The longest token accepted (it travels in every call's `authorization` header).
pub const MAX_TOKEN_BYTES: usize = 4096;
/// Which jobs a caller may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Every job.
    Any,
    /// Jobs whose id equals the string.
    Job(String),
    /// Jobs whose id starts with the string.
    Prefix(String),
    /// The one job an embedded service serves (a launcher hosting the rendezvous for its own job):
    /// every other job id is refused, naming both (see [`served_job`]).
    Served(String),
}

impl Principal {
    /// Whether the caller may touch `job`.
    pub fn allows(&self, job: &str) -> bool {
        match self {
            Principal::Any => true,
            Principal::Job(j) | Principal::Served(j) => j == job,
            Principal::Prefix(p) => job.starts_with(p.as_str()),
        }
    }

    /// `Ok` when the caller may touch `job`.
    pub fn check(&self, job: &str) -> Result<(), RdzvError> {
        match self {
            _ if self.allows(job) => Ok(()),
            Principal::Served(served) => Err(RdzvError::PermissionDenied(format!(
                "{SERVES_ONLY}{served:?} (embedded in a launcher of that job); job {job:?} cannot use it: a launcher of another job chose the same address and port"
            ))),
            _ => Err(RdzvError::PermissionDenied(format!("this token may not access job {job:?}"))),
        }
    }
}

/// How a single-job service's refusal begins; [`served_job`] reads the job back.
pub const SERVES_ONLY: &str = "this rendezvous service serves only job ";

/// The job a single-job service serves, read from its refusal of another job (`None` for any other
/// message).
pub fn served_job(message: &str) -> Option<&str> {
    let rest = &message[message.find(SERVES_ONLY)? + SERVES_ONLY.len()..];
    // Job ids are validated (letters, digits and `._:@-`), so their Debug form is the id in quotes.
    let rest = rest.strip_prefix('"')?;
    Some(&rest[..rest.find('"')?])
}

/// How many live jobs a caller's token may hold (its file line's `jobs=N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobQuota(pub usize);

impl JobQuota {
    /// `Ok` when `principal` may have `job` created (or started over) in `state`: the join
    /// leaves at most this many live jobs among those it may touch. A join to a live job always
    /// passes (its job is counted already).
    ///
    /// # Errors
    /// [`RdzvError::ResourceExhausted`] naming the quota and some of the jobs that hold it.
    pub fn admit(self, principal: &Principal, state: &State, job: &str) -> Result<(), RdzvError> {
        let live = |j: &crate::state::Job| !j.starts_over_on_join();
        if state.jobs.get(job).is_some_and(live) {
            return Ok(());
        }
        let held: Vec<&str> = state.jobs.values().filter(|j| live(j) && principal.allows(&j.id)).map(|j| j.id.as_str()).collect();
        if held.len() < self.0 {
            return Ok(());
        }
        let shown: Vec<String> = held.iter().take(5).map(|j| format!("{j:?}")).collect();
        let more = if held.len() > shown.len() { format!(" and {} more", held.len() - shown.len()) } else { String::new() };
        Err(RdzvError::ResourceExhausted(format!(
            "this token may hold {} live jobs at once (jobs= in the service's token file) and holds {}: {}{more}; job {job:?} can start once one of them ends",
            self.0,
            held.len(),
            shown.join(", ")
        )))
    }
}

/// One token file line: the token, whom it lets in, and its job quota.
#[derive(Debug, Clone)]
struct TokenEntry {
    token: Vec<u8>,
    principal: Principal,
    quota: Option<JobQuota>,
}

/// The tokens a daemon accepts.
#[derive(Debug, Clone)]
pub struct TokenTable {
    entries: Vec<TokenEntry>,
}

impl TokenTable {
    /// Parses a token file's text: `TOKEN [JOB or PREFIX* or *] [jobs=N]` per line.
    ///
    /// # Errors
    /// A line with more fields, a token shorter than 16 characters, a `jobs=` that is not a whole
    /// number from 1 on, or no token at all.
    pub fn parse(text: &str, origin: &str) -> Result<Self, RdzvError> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = |why: String| RdzvError::invalid("token file", format!("{origin} line {}: {why}", i + 1));
            // The quota is the last field when it is one (`TOKEN jobs=N` scopes nothing).
            let mut quota = None;
            let mut fields = fields.as_slice();
            if let [rest @ .., last] = fields
                && let Some(n) = last.strip_prefix("jobs=")
            {
                let n: usize = n
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| bad(format!("{last:?}: expected jobs=N with N a whole number from 1 on")))?;
                quota = Some(JobQuota(n));
                fields = rest;
            }
            if fields.is_empty() || fields.len() > 2 {
                return Err(bad(format!("{} fields; expected `TOKEN [JOB or PREFIX* or *] [jobs=N]`", line.split_whitespace().count())));
            }
            let token = fields[0];
            if token.len() < 16 {
                return Err(bad(format!("token of {} characters; use at least 16 (e.g. `openssl rand -hex 32`)", token.len())));
            }
            if token.len() > MAX_TOKEN_BYTES {
                // A longer one overflows the HTTP/2 header limit: every call would fail with an
                // unknown status, retried until its deadline, instead of this error.
                return Err(bad(format!("token of {} characters; use at most {MAX_TOKEN_BYTES}", token.len())));
            }
            let principal = match fields.get(1) {
                None => Principal::Any,
                Some(p) if *p == "*" => Principal::Any,
                Some(p) => match p.strip_suffix('*') {
                    Some(prefix) => Principal::Prefix(prefix.to_string()),
                    None => Principal::Job((*p).to_string()),
                },
            };
            entries.push(TokenEntry { token: token.as_bytes().to_vec(), principal, quota });
        }
        if entries.is_empty() {
            return Err(RdzvError::invalid("token file", format!("{origin} holds no token")));
        }
        Ok(TokenTable { entries })
    }

    /// Reads and parses a token file.
    pub fn load(path: &Path) -> Result<Self, RdzvError> {
        let text = crate::files::read_bounded_string(path).map_err(|e| RdzvError::invalid("token file", format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The principal of a presented token, comparing in constant time.
    pub fn lookup(&self, presented: &[u8]) -> Option<&Principal> {
        self.entry(presented).map(|e| &e.principal)
    }

    /// The job quota of a presented token (`None`: unknown token, or no `jobs=`).
    pub fn quota(&self, presented: &[u8]) -> Option<JobQuota> {
        self.entry(presented).and_then(|e| e.quota)
    }

    fn entry(&self, presented: &[u8]) -> Option<&TokenEntry> {
        let mut found = None;
        for e in &self.entries {
            if constant_time_eq(&e.token, presented) && found.is_none() {
                found = Some(e);
            }
        }
        found
    }
}

/// Whether `token` (a secret) equals `presented`, in a time that depends on the presented length
/// only: neither where they differ nor the secret's length shows in the timing.
fn constant_time_eq(token: &[u8], presented: &[u8]) -> bool {
    if token.is_empty() {
        return presented.is_empty();
    }
    let diff = presented.iter().enumerate().fold(0u8, |acc, (i, p)| acc | (p ^ token[i % token.len()]));
    diff == 0 && token.len() == presented.len()
}

/// Warns about a refused call at most once a second, with the count of those refused meanwhile
/// (anyone who can reach the port can send them).
fn warn_refused(peer: &str, what: &'static str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_SECOND: AtomicU64 = AtomicU64::new(0);
    static QUIET: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if LAST_SECOND.swap(now, Ordering::Relaxed) == now {
        QUIET.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let also = QUIET.swap(0, Ordering::Relaxed);
    tracing::warn!(%peer, also_refused_since = also, "rejected a call {what}");
}

/// Reads the first token of a client-side token file (the same file format; the job part is ignored).
///
/// # Errors
/// The file cannot be read, or a daemon would refuse it ([`TokenTable::parse`]: a token under 16
/// characters, a malformed line, no token), so a client fails at once naming the file and the line
/// instead of presenting a token no service accepts.
pub fn read_client_token(path: &Path) -> Result<String, RdzvError> {
    let text = crate::files::read_bounded_string(path).map_err(|e| RdzvError::invalid("token file", format!("cannot read {}: {e}", path.display())))?;
    let table = TokenTable::parse(&text, &path.display().to_string())?;
    table
        .entries
        .first()
        .map(|e| String::from_utf8_lossy(&e.token).into_owned())
        .ok_or_else(|| RdzvError::invalid("token file", format!("{} holds no token", path.display())))
}

/// The gRPC interceptor: resolves the caller's token into a [`Principal`] stored in the request.
#[derive(Debug, Clone)]
pub struct AuthInterceptor {
    table: Option<Arc<TokenTable>>,
    /// The one job this service serves (an embedded service), if any.
    only_job: Option<Arc<str>>,
}

impl AuthInterceptor {
    /// `None` accepts every caller as [`Principal::Any`].
    pub fn new(table: Option<TokenTable>) -> Self {
        AuthInterceptor { table: table.map(Arc::new), only_job: None }
    }

    /// Narrows every caller to `job` ([`Principal::Served`]): the service refuses other job ids.
    pub fn serving_only(mut self, job: Option<&str>) -> Self {
        self.only_job = job.map(Arc::from);
        self
    }
}

impl tonic::service::Interceptor for AuthInterceptor {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let mut quota = None;
        let principal = match &self.table {
            None => Principal::Any,
            Some(table) => {
                let peer = req.remote_addr().map(|a| a.to_string()).unwrap_or_else(|| "unknown".into());
                let presented = req
                    .metadata()
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "));
                let Some(presented) = presented else {
                    warn_refused(&peer, "without a token");
                    return Err(RdzvError::Unauthenticated("missing token: send `authorization: Bearer <token>` (rsrun --rdzv-token-file)".into()).into());
                };
                match table.entry(presented.as_bytes()) {
                    Some(e) => {
                        quota = e.quota;
                        e.principal.clone()
                    }
                    None => {
                        warn_refused(&peer, "with a wrong token");
                        return Err(RdzvError::Unauthenticated("invalid token".into()).into());
                    }
                }
            }
        };
        let principal = match &self.only_job {
            None => principal,
            Some(job) => {
                principal.check(job).map_err(Status::from)?;
                Principal::Served(job.to_string())
            }
        };
        req.extensions_mut().insert(principal);
        if let Some(q) = quota {
            req.extensions_mut().insert(q);
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_token_is_checked_as_a_daemon_would() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tok");
        std::fs::write(&f, "# c\n0123456789abcdef job7\nfedcba9876543210\n").unwrap();
        assert_eq!(read_client_token(&f).unwrap(), "0123456789abcdef");
        std::fs::write(&f, "secret\n").unwrap();
        let e = read_client_token(&f).unwrap_err().to_string();
        assert!(e.contains("line 1: token of 6 characters; use at least 16"), "{e}");
        std::fs::write(&f, "# only a comment\n").unwrap();
        assert!(read_client_token(&f).unwrap_err().to_string().contains("holds no token"));
    }

    #[test]
    fn parses_and_scopes_tokens() {
        let t = TokenTable::parse("# c\n0123456789abcdef\nfedcba9876543210 teamA-*\naaaaaaaaaaaaaaaa job7\n", "f").unwrap();
        assert_eq!(t.lookup(b"0123456789abcdef"), Some(&Principal::Any));
        let p = t.lookup(b"fedcba9876543210").unwrap();
        assert!(p.allows("teamA-x") && !p.allows("teamB"));
        let p = t.lookup(b"aaaaaaaaaaaaaaaa").unwrap();
        assert!(p.allows("job7") && !p.allows("job70"));
        assert!(t.lookup(b"nope").is_none());
        // A prefix, an extension or a repetition of a token is no match.
        for wrong in [&b"0123456789abcde"[..], b"0123456789abcdef0", b"0123456789abcdef0123456789abcdef", b""] {
            assert!(t.lookup(wrong).is_none(), "{:?}", String::from_utf8_lossy(wrong));
        }
        let e = p.check("other").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn a_single_job_service_refuses_other_jobs_naming_both() {
        let p = Principal::Served("slurm-4242.0.r0".into());
        assert!(p.check("slurm-4242.0.r0").is_ok());
        let e = p.check("slurm-4343.0.r0").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let msg = e.to_string();
        assert!(msg.contains("\"slurm-4242.0.r0\"") && msg.contains("\"slurm-4343.0.r0\""), "{msg}");
        assert_eq!(served_job(&msg), Some("slurm-4242.0.r0"));
        // Through gRPC and back, the served job is still readable.
        let back = RdzvError::from(Status::from(e));
        assert_eq!(served_job(&back.to_string()), Some("slurm-4242.0.r0"));
        assert_eq!(served_job("this token may not access job \"x\""), None);
        // The interceptor narrows an unrestricted caller to the served job.
        let mut i = AuthInterceptor::new(None).serving_only(Some("job7"));
        let req = tonic::service::Interceptor::call(&mut i, Request::new(())).unwrap();
        assert_eq!(req.extensions().get::<Principal>(), Some(&Principal::Served("job7".into())));
        // A token scoped to another job is refused outright.
        let t = TokenTable::parse("aaaaaaaaaaaaaaaa job8\n", "f").unwrap();
        let mut i = AuthInterceptor::new(Some(t)).serving_only(Some("job7"));
        let mut req = Request::new(());
        req.metadata_mut().insert("authorization", "Bearer aaaaaaaaaaaaaaaa".parse().unwrap());
        assert_eq!(tonic::service::Interceptor::call(&mut i, req).unwrap_err().code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn job_quotas_parse_and_count_the_live_jobs_in_scope() {
        use crate::state::{Command, JobSpec, JoinCmd};
        use crate::validate::Limits;
        let t = TokenTable::parse("0123456789abcdef teamA-* jobs=2\nfedcba9876543210 jobs=1\naaaaaaaaaaaaaaaa\n", "f").unwrap();
        assert_eq!(t.quota(b"0123456789abcdef"), Some(JobQuota(2)));
        assert_eq!(t.lookup(b"0123456789abcdef"), Some(&Principal::Prefix("teamA-".into())));
        assert_eq!((t.lookup(b"fedcba9876543210"), t.quota(b"fedcba9876543210")), (Some(&Principal::Any), Some(JobQuota(1))));
        assert_eq!(t.quota(b"aaaaaaaaaaaaaaaa"), None);
        for bad in ["0123456789abcdef jobs=0", "0123456789abcdef teamA-* jobs=x", "jobs=3", "0123456789abcdef a b jobs=1"] {
            let e = TokenTable::parse(bad, "f").unwrap_err().to_string();
            assert!(e.contains("f line 1"), "{bad}: {e}");
        }

        let spec = JobSpec { min_nodes: 2, max_nodes: 2, last_call_ms: 0, lease_ms: 60_000, max_restarts: 0, fixed_ranks: false };
        let mut st = State::default();
        let apply = |st: &mut State, cmd: Command| st.apply(&cmd, 1_000, &Limits::default()).map(|_| ()).unwrap();
        let join = |job: &str| {
            Command::Join(JoinCmd {
                job: job.into(),
                node: "n".into(),
                addrs: vec!["10.0.0.1".into()],
                hostname: "h".into(),
                local_world_size: 1,
                rank_hint: None,
                master_port: 1,
                spec: spec.clone(),
            })
        };
        let (p, q) = (Principal::Prefix("teamA-".into()), JobQuota(2));
        apply(&mut st, join("teamA-1"));
        apply(&mut st, join("teamB-1"));
        assert!(q.admit(&p, &st, "teamA-2").is_ok(), "another team's job does not count");
        apply(&mut st, join("teamA-2"));
        let e = q.admit(&p, &st, "teamA-3").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.to_string().contains("may hold 2 live jobs at once") && e.to_string().contains("\"teamA-1\", \"teamA-2\""), "{e}");
        assert!(q.admit(&p, &st, "teamA-1").is_ok(), "a join to a live job needs no room");
        // A failed job counts while a node is still in it; ended and empty, it frees its place.
        apply(&mut st, Command::FailJob { job: "teamA-1".into(), node: "n".into(), reason: "r".into() });
        assert!(q.admit(&p, &st, "teamA-3").is_err());
        apply(&mut st, Command::Leave { job: "teamA-1".into(), node: "n".into(), reason: String::new() });
        assert!(q.admit(&p, &st, "teamA-3").is_ok());
        // Starting the ended job over takes a place like a new one.
        apply(&mut st, join("teamA-3"));
        assert!(q.admit(&p, &st, "teamA-1").is_err());
    }

    #[test]
    fn rejects_bad_files() {
        assert!(TokenTable::parse("short\n", "f").unwrap_err().to_string().contains("f line 1: token of 5 characters"));
        assert!(TokenTable::parse("# only comments\n", "f").unwrap_err().to_string().contains("holds no token"));
        assert!(TokenTable::parse("0123456789abcdef a b\n", "f").is_err());
    }
}
