//! The open-file limit of a process that serves many connections (the rendezvous daemon, and a
//! launcher whose node serves the job's PyTorch store: one descriptor per rank of the job).
//!
//! The soft limit is often 1024 (systemd's default, most shells) while the hard limit allows far
//! more. Past it, `accept` fails with EMFILE and a torch client, which reads the PING reply of its
//! handshake without a timeout, waits for good. So the soft limit is raised to the hard one; a
//! launcher gives its workers the soft limit it found ([`original_soft_nofile`]), since raising it
//! for programs that use `select` would break them.

use std::sync::atomic::{AtomicU64, Ordering};

/// The soft limit before [`raise_nofile_limit`] raised it (`u64::MAX`: not raised).
static ORIGINAL_SOFT: AtomicU64 = AtomicU64::new(u64::MAX);

/// Raises the soft RLIMIT_NOFILE to the hard limit. Failures are logged, not fatal (the limit
/// stays as it was).
pub fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                // Only the first raise records what the process started with.
                let _ = ORIGINAL_SOFT.compare_exchange(u64::MAX, soft, Ordering::SeqCst, Ordering::SeqCst);
                tracing::debug!(from = soft, to = hard, "raised the open-file limit");
            }
            Err(e) => tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-file limit"),
    }
}

/// The soft limit this process had before [`raise_nofile_limit`] raised it, if it did: what a
/// child should get back before it execs.
pub fn original_soft_nofile() -> Option<u64> {
    match ORIGINAL_SOFT.load(Ordering::SeqCst) {
        u64::MAX => None,
        soft => Some(soft),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::resource::{Resource, getrlimit, setrlimit};

    #[test]
    fn raises_to_the_hard_limit_and_remembers_the_soft_one() {
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        if soft == hard {
            // Lower it first so that there is something to raise (allowed without privileges).
            setrlimit(Resource::RLIMIT_NOFILE, hard.min(512), hard).unwrap();
        }
        let before = getrlimit(Resource::RLIMIT_NOFILE).unwrap().0;
        raise_nofile_limit();
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap(), (hard, hard));
        assert_eq!(original_soft_nofile(), Some(before));
        // A second raise keeps the first soft limit.
        raise_nofile_limit();
        assert_eq!(original_soft_nofile(), Some(before));
    }
}
