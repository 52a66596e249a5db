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
//! ```
//!
//! Clients send `authorization: Bearer <token>` on every RPC. A missing or unknown token is
//! `UNAUTHENTICATED`; a known token used on another job is `PERMISSION_DENIED`. Either way nothing
//! changes. Without a token file every caller may touch every job (loopback or `--insecure` only).

use std::path::Path;
use std::sync::Arc;

use tonic::{Request, Status};

use crate::RdzvError;

/// Which jobs a caller may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// Every job.
    Any,
    /// Jobs whose id equals the string.
    Job(String),
    /// Jobs whose id starts with the string.
    Prefix(String),
}

impl Principal {
    /// Whether the caller may touch `job`.
    pub fn allows(&self, job: &str) -> bool {
        match self {
            Principal::Any => true,
            Principal::Job(j) => j == job,
            Principal::Prefix(p) => job.starts_with(p.as_str()),
        }
    }

    /// `Ok` when the caller may touch `job`.
    pub fn check(&self, job: &str) -> Result<(), RdzvError> {
        if self.allows(job) {
            Ok(())
        } else {
            Err(RdzvError::PermissionDenied(format!("this token may not access job {job:?}")))
        }
    }
}

/// The tokens a daemon accepts.
#[derive(Debug, Clone)]
pub struct TokenTable {
    entries: Vec<(Vec<u8>, Principal)>,
}

impl TokenTable {
    /// Parses a token file's text.
    ///
    /// # Errors
    /// A line with more than two fields, a token shorter than 16 characters, or no token at all.
    pub fn parse(text: &str, origin: &str) -> Result<Self, RdzvError> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let bad = |why: String| RdzvError::invalid("token file", format!("{origin} line {}: {why}", i + 1));
            if fields.len() > 2 {
                return Err(bad(format!("{} fields; expected `TOKEN [JOB or PREFIX*]`", fields.len())));
            }
            let token = fields[0];
            if token.len() < 16 {
                return Err(bad(format!("token of {} characters; use at least 16 (e.g. `openssl rand -hex 32`)", token.len())));
            }
            let principal = match fields.get(1) {
                None => Principal::Any,
                Some(p) if *p == "*" => Principal::Any,
                Some(p) => match p.strip_suffix('*') {
                    Some(prefix) => Principal::Prefix(prefix.to_string()),
                    None => Principal::Job((*p).to_string()),
                },
            };
            entries.push((token.as_bytes().to_vec(), principal));
        }
        if entries.is_empty() {
            return Err(RdzvError::invalid("token file", format!("{origin} holds no token")));
        }
        Ok(TokenTable { entries })
    }

    /// Reads and parses a token file.
    pub fn load(path: &Path) -> Result<Self, RdzvError> {
        let text = std::fs::read_to_string(path).map_err(|e| RdzvError::invalid("token file", format!("cannot read {}: {e}", path.display())))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The principal of a presented token, comparing in constant time.
    pub fn lookup(&self, presented: &[u8]) -> Option<&Principal> {
        let mut found = None;
        for (token, principal) in &self.entries {
            if constant_time_eq(token, presented) && found.is_none() {
                found = Some(principal);
            }
        }
        found
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads the first token of a client-side token file (the same file format; the job part is ignored).
pub fn read_client_token(path: &Path) -> Result<String, RdzvError> {
    let text = std::fs::read_to_string(path).map_err(|e| RdzvError::invalid("token file", format!("cannot read {}: {e}", path.display())))?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .and_then(|l| l.split_whitespace().next())
        .map(str::to_string)
        .ok_or_else(|| RdzvError::invalid("token file", format!("{} holds no token", path.display())))
}

/// The gRPC interceptor: resolves the caller's token into a [`Principal`] stored in the request.
#[derive(Debug, Clone)]
pub struct AuthInterceptor {
    table: Option<Arc<TokenTable>>,
}

impl AuthInterceptor {
    /// `None` accepts every caller as [`Principal::Any`].
    pub fn new(table: Option<TokenTable>) -> Self {
        AuthInterceptor { table: table.map(Arc::new) }
    }
}

impl tonic::service::Interceptor for AuthInterceptor {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
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
                    tracing::warn!(%peer, "rejected a call without a token");
                    return Err(RdzvError::Unauthenticated("missing token: send `authorization: Bearer <token>` (rsrun --rdzv-token-file)".into()).into());
                };
                match table.lookup(presented.as_bytes()) {
                    Some(p) => p.clone(),
                    None => {
                        tracing::warn!(%peer, "rejected a call with a wrong token");
                        return Err(RdzvError::Unauthenticated("invalid token".into()).into());
                    }
                }
            }
        };
        req.extensions_mut().insert(principal);
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_scopes_tokens() {
        let t = TokenTable::parse("# c\n0123456789abcdef\nfedcba9876543210 teamA-*\naaaaaaaaaaaaaaaa job7\n", "f").unwrap();
        assert_eq!(t.lookup(b"0123456789abcdef"), Some(&Principal::Any));
        let p = t.lookup(b"fedcba9876543210").unwrap();
        assert!(p.allows("teamA-x") && !p.allows("teamB"));
        let p = t.lookup(b"aaaaaaaaaaaaaaaa").unwrap();
        assert!(p.allows("job7") && !p.allows("job70"));
        assert!(t.lookup(b"nope").is_none());
        let e = p.check("other").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn rejects_bad_files() {
        assert!(TokenTable::parse("short\n", "f").unwrap_err().to_string().contains("f line 1: token of 5 characters"));
        assert!(TokenTable::parse("# only comments\n", "f").unwrap_err().to_string().contains("holds no token"));
        assert!(TokenTable::parse("0123456789abcdef a b\n", "f").is_err());
    }
}
