//! The election, as pure decisions over what the daemon observed (table-tested like client-go's
//! `tryAcquireOrRenew`, with explicit times; the I/O is in `mod.rs`).
//!
//! A daemon campaigns with a key `P/election/<lease:016x>` attached to its session lease; the key's
//! creation revision `R` is its fencing token (its epoch when it leads). The campaigner with the
//! lowest creation revision leads; every other one waits for the deletion of the key just below its
//! own (no thundering herd), which happens when that daemon's lease expires or is revoked.
//!
//! Leadership is only ever *assumed* from the lease: [`LeaseTimer`] keeps the deadline by which etcd
//! may have expired the lease (measured from the *send* time of the acknowledged renewal), schedules
//! renewals before it, and says when to self-fence (stop answering) — `margin` before that deadline.
//! Safety does not rest on this timer: every leader write is a Txn guarded by `create_revision(K) ==
//! R`, so a leader whose lease lapsed commits nothing. The timer makes it stop answering first: the
//! executor checks the fencing point as each answer goes out (`crate::service::standing`).

use std::time::Duration;

use tokio::time::Instant;

/// What a campaigner does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Its key has the lowest creation revision: it leads (after the takeover barrier).
    Lead,
    /// Wait until this key (the campaigner just below) is deleted, then decide again.
    WaitFor {
        /// The predecessor's key.
        key: Vec<u8>,
        /// Its creation revision.
        revision: i64,
    },
    /// Its own key is gone (lease expired or revoked): campaign again with a new lease.
    Lost,
}

/// Decides from the campaigners' keys and creation revisions (`(key, create_revision)`, any order)
/// what the campaigner owning `own` (created at `own_revision`) does.
pub fn decide(own: &[u8], own_revision: i64, campaigners: &[(Vec<u8>, i64)]) -> Decision {
    if !campaigners.iter().any(|(k, r)| k == own && *r == own_revision) {
        return Decision::Lost;
    }
    match campaigners.iter().filter(|(_, r)| *r < own_revision).max_by_key(|(_, r)| *r) {
        None => Decision::Lead,
        Some((key, revision)) => Decision::WaitFor { key: key.clone(), revision: *revision },
    }
}

/// The election lease as this daemon must assume it: when it may lapse at the earliest, when to
/// renew, when to stop answering.
#[derive(Debug, Clone)]
pub struct LeaseTimer {
    ttl: Duration,
    margin: Duration,
    /// Earliest moment etcd may expire the lease: the send time of the last acknowledged
    /// grant or renewal, plus the TTL it acknowledged.
    deadline: Option<Instant>,
}

impl LeaseTimer {
    /// A timer for leases of `ttl`; the self-fencing margin is max(0.5 s, TTL/10).
    pub fn new(ttl: Duration) -> Self {
        LeaseTimer { ttl, margin: (ttl / 10).max(Duration::from_millis(500)), deadline: None }
    }

    /// The requested TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The self-fencing margin.
    pub fn margin(&self) -> Duration {
        self.margin
    }

    /// A grant or renewal sent at `sent_at` was acknowledged with `ttl_secs` (0 or less: the lease
    /// is gone). Returns whether the lease is alive.
    pub fn acknowledged(&mut self, sent_at: Instant, ttl_secs: i64) -> bool {
        if ttl_secs <= 0 {
            self.deadline = None;
            return false;
        }
        let d = sent_at + Duration::from_secs(ttl_secs as u64);
        // An older renewal acknowledged late never moves the deadline back.
        self.deadline = Some(self.deadline.map_or(d, |old| old.max(d)));
        true
    }

    /// The deadline by which etcd may have expired the lease (`None`: no live lease).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// When to stop answering unless a renewal arrives first.
    pub fn fence_at(&self) -> Option<Instant> {
        self.deadline.map(|d| d.checked_sub(self.margin).unwrap_or(d))
    }

    /// Whether the daemon must have stopped answering by `now`.
    pub fn fenced(&self, now: Instant) -> bool {
        self.fence_at().is_none_or(|f| now >= f)
    }

    /// When to send the next renewal: a third of the way to the fencing point (so two more tries
    /// fit before it), and at least 50 ms from now.
    pub fn next_renewal(&self, now: Instant) -> Instant {
        match self.fence_at() {
            None => now,
            Some(f) if f <= now => now,
            Some(f) => now + ((f - now) / 3).max(Duration::from_millis(50)).min(f - now),
        }
    }

    /// Time left before the fencing point.
    pub fn remaining(&self, now: Instant) -> Duration {
        self.fence_at().map(|f| f.saturating_duration_since(now)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn election_table() {
        struct Case {
            name: &'static str,
            own: (&'static str, i64),
            campaigners: Vec<(&'static str, i64)>,
            want: Decision,
        }
        let cases = vec![
            Case { name: "acquire when alone", own: ("a", 10), campaigners: vec![("a", 10)], want: Decision::Lead },
            Case {
                name: "acquire when every other campaigner came later",
                own: ("a", 10),
                campaigners: vec![("b", 12), ("a", 10), ("c", 11)],
                want: Decision::Lead,
            },
            Case {
                name: "do not acquire from a live holder",
                own: ("b", 12),
                campaigners: vec![("a", 10), ("b", 12)],
                want: Decision::WaitFor { key: k("a"), revision: 10 },
            },
            Case {
                name: "wait for the campaigner just below, not the leader",
                own: ("c", 20),
                campaigners: vec![("a", 10), ("c", 20), ("b", 15), ("d", 30)],
                want: Decision::WaitFor { key: k("b"), revision: 15 },
            },
            Case {
                name: "acquire once the holder's key expired",
                own: ("b", 12),
                campaigners: vec![("b", 12)],
                want: Decision::Lead,
            },
            Case {
                name: "own key expired: campaign again",
                own: ("b", 12),
                campaigners: vec![("a", 10)],
                want: Decision::Lost,
            },
            Case {
                name: "own key re-created at another revision is not ours",
                own: ("b", 12),
                campaigners: vec![("b", 40)],
                want: Decision::Lost,
            },
        ];
        for c in cases {
            let list: Vec<(Vec<u8>, i64)> = c.campaigners.iter().map(|(key, r)| (k(key), *r)).collect();
            assert_eq!(decide(&k(c.own.0), c.own.1, &list), c.want, "{}", c.name);
        }
    }

    #[test]
    fn lease_timer_renews_before_and_fences_at_the_margin() {
        let t0 = Instant::now();
        let mut t = LeaseTimer::new(Duration::from_secs(5));
        assert_eq!(t.margin(), Duration::from_millis(500));
        assert!(t.fenced(t0), "no lease yet: fenced");
        // Granted: sent at t0, acknowledged later; the deadline counts from the send.
        assert!(t.acknowledged(t0, 5));
        assert_eq!(t.deadline(), Some(t0 + Duration::from_secs(5)));
        assert_eq!(t.fence_at(), Some(t0 + Duration::from_millis(4500)));
        assert!(!t.fenced(t0 + Duration::from_millis(4499)));
        assert!(t.fenced(t0 + Duration::from_millis(4500)));
        // The first renewal a third of the way to the fencing point.
        assert_eq!(t.next_renewal(t0), t0 + Duration::from_millis(1500));
        // A renewal sent at 1.5 s moves the deadline to 6.5 s.
        assert!(t.acknowledged(t0 + Duration::from_millis(1500), 5));
        assert_eq!(t.fence_at(), Some(t0 + Duration::from_millis(6000)));
        // A late acknowledgement of an older renewal never moves it back.
        assert!(t.acknowledged(t0 + Duration::from_millis(1000), 5));
        assert_eq!(t.fence_at(), Some(t0 + Duration::from_millis(6000)));
        // Renewals failing: the schedule tightens but never passes the fencing point.
        let late = t0 + Duration::from_millis(5900);
        assert!(t.next_renewal(late) <= t0 + Duration::from_millis(6000));
        assert_eq!(t.next_renewal(t0 + Duration::from_millis(7000)), t0 + Duration::from_millis(7000));
        // etcd says the lease is gone.
        assert!(!t.acknowledged(t0 + Duration::from_secs(2), 0));
        assert!(t.fenced(t0 + Duration::from_secs(2)));
    }

    /// Leadership as the executor judges it when an answer goes out ([`standing`] over the
    /// timer's fencing point): it holds before the local deadline, which is strictly before etcd
    /// may expire the lease, and not at or after it; a keep-alive whose reply came late counts
    /// from when it was sent.
    #[test]
    fn leadership_holds_before_the_local_deadline_and_not_at_or_after_it() {
        use crate::service::{Role, Standing, standing};
        let leader = Role::Leader { epoch: 7 };
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut t = LeaseTimer::new(Duration::from_secs(5));
        assert_eq!(standing(&leader, t.fence_at(), t0), Standing::Lapsed, "no lease yet: no answers");
        // Granted at t0 with TTL 5 s: answers until 4.5 s, strictly before etcd's earliest expiry.
        assert!(t.acknowledged(t0, 5));
        assert!(t.fence_at() < t.deadline());
        assert_eq!(standing(&leader, t.fence_at(), t0), Standing::Serve);
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(4499)), Standing::Serve);
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(4500)), Standing::Lapsed);
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(9000)), Standing::Lapsed);
        // A keep-alive sent at 1 s whose reply arrived at 4 s: etcd renewed the lease no earlier
        // than 1 s, so answers stop at 5.5 s, not at 8.5 s (the reply's time plus 4.5 s).
        let (sent, arrived) = (t0 + ms(1000), t0 + ms(4000));
        assert!(t.acknowledged(sent, 5));
        assert_eq!(t.deadline(), Some(t0 + ms(6000)));
        assert_eq!(standing(&leader, t.fence_at(), arrived), Standing::Serve);
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(5499)), Standing::Serve);
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(5500)), Standing::Lapsed);
        assert_eq!(standing(&leader, t.fence_at(), arrived + ms(4500)), Standing::Lapsed);
        // A keep-alive sent at 5.4 s, just before the deadline, with no reply yet at 5.6 s: the
        // old deadline holds until a reply is in.
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(5600)), Standing::Lapsed);
        // etcd says the lease is gone: no answers, whatever the time.
        assert!(!t.acknowledged(t0 + ms(2000), 0));
        assert_eq!(standing(&leader, t.fence_at(), t0 + ms(2000)), Standing::Lapsed);
    }

    /// The executor reads the fencing point the keeper sets ([`super::super::FenceClock`]).
    #[test]
    fn the_fence_clock_is_the_executors_lease() {
        use crate::service::LeaderLease;
        let fence = super::super::FenceClock::default();
        assert_eq!(fence.answer_until(), None);
        let at = Instant::now() + Duration::from_secs(3);
        fence.set(Some(at));
        assert_eq!(fence.answer_until(), Some(at));
        fence.set(None);
        assert_eq!(fence.answer_until(), None);
    }

    #[test]
    fn long_ttls_get_a_tenth_as_margin() {
        let t = LeaseTimer::new(Duration::from_secs(15));
        assert_eq!(t.margin(), Duration::from_millis(1500));
    }
}
