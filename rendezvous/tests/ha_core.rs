//! The executor's HA roles without etcd: a standby refuses, a promoted daemon serves over its
//! `LogStore`, reads wait for a leadership confirmation, a demotion fails every waiter of the
//! ended term with a hint naming the new leader, and a leader answers nothing from its lease's
//! local deadline on. (The real etcd log is tested in `tests/tests/ha/`.)

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::ha::election::LeaseTimer;
use rsrun_rendezvous::journal::{self, Entry};
use rsrun_rendezvous::logstore::LogStore;
use rsrun_rendezvous::proto::{self as pb, rendezvous_server::Rendezvous};
use rsrun_rendezvous::service::{Core, CoreConfig, DaemonIdentity, LEADER_STAMP_KEY, LeaderLease, Role, Service};
use rsrun_rendezvous::state::{Command, JobSpec, JoinCmd, Outcome, Scope, State};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Request;

/// An election lease whose local deadline the test moves by hand (the HA node's keeper moves it
/// with every acknowledged renewal).
#[derive(Debug)]
struct HandLease(Mutex<Option<Instant>>);

impl HandLease {
    fn until(at: Option<Instant>) -> Arc<HandLease> {
        Arc::new(HandLease(Mutex::new(at)))
    }
    fn set(&self, at: Option<Instant>) {
        *self.0.lock().unwrap() = at;
    }
}

impl LeaderLease for HandLease {
    fn answer_until(&self) -> Option<Instant> {
        *self.0.lock().unwrap()
    }
}

/// A lease that lasts the whole test.
fn long_lease() -> Arc<HandLease> {
    HandLease::until(Some(Instant::now() + Duration::from_secs(3600)))
}

/// A log that keeps what it is given and counts confirmations.
#[derive(Default, Clone)]
struct MemLog {
    appended: Arc<Mutex<Vec<(u64, u64)>>>,
    confirms: Arc<Mutex<u32>>,
}

impl LogStore for MemLog {
    fn append(&mut self, records: &[u8], first_seq: u64, last_seq: u64) -> Result<(), RdzvError> {
        let entries = journal::decode_records(records).map_err(RdzvError::Unavailable)?;
        assert_eq!(entries.first().map(|e| e.seq), Some(first_seq));
        assert_eq!(entries.last().map(|e| e.seq), Some(last_seq));
        self.appended.lock().unwrap().push((first_seq, last_seq));
        Ok(())
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Ok(())
    }
    fn confirm(&mut self) -> Result<(), RdzvError> {
        *self.confirms.lock().unwrap() += 1;
        Ok(())
    }
    fn reads_need_confirmation(&self) -> bool {
        true
    }
    fn compact_every(&self) -> u64 {
        u64::MAX
    }
}

fn join(node: &str) -> Command {
    Command::Join(JoinCmd {
        job: "j".into(),
        node: node.into(),
        addrs: vec!["127.0.0.1".into()],
        hostname: node.into(),
        local_world_size: 1,
        rank_hint: None,
        master_port: 1,
        spec: JobSpec { min_nodes: 1, max_nodes: 1, last_call_ms: 0, lease_ms: 60_000, max_restarts: 0, fixed_ranks: false },
    })
}

fn standby_core() -> Arc<Core> {
    let cfg = CoreConfig {
        ha: Some(DaemonIdentity { daemon_id: "d1".into(), advertise: "127.0.0.1:1".into() }),
        ..CoreConfig::default()
    };
    Core::start(cfg, CancellationToken::new(), &TaskTracker::new()).unwrap()
}

#[tokio::test]
async fn a_standby_refuses_a_leader_serves_and_a_demotion_fails_every_waiter() {
    let core = standby_core();
    core.set_leader_hint("10.0.0.9:29400", 5);
    let err = core.execute(join("a")).await.unwrap_err();
    assert_eq!(err, RdzvError::NotLeader { leader: "10.0.0.9:29400".into(), epoch: 5 });
    assert!(core.read(|s| Ok(s.jobs.len())).await.is_err(), "a standby answers no read");

    // The replica follows the log; a gap is refused.
    let e1 = Entry { seq: 1, at: 1_000, cmd: join("a") };
    assert_eq!(core.replica_apply(&[e1.clone(), e1.clone()]).unwrap(), 1);
    let gap = Entry { seq: 3, at: 1_001, cmd: join("b") };
    assert!(core.replica_apply(&[gap]).unwrap_err().to_string().contains("expected sequence 2"));

    // Promoted: commands go to its log, reads wait for a confirmation begun after them.
    let log = MemLog::default();
    core.promote(7, Box::new(log.clone()), long_lease()).unwrap();
    assert_eq!(core.role(), Role::Leader { epoch: 7 });
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    core.execute(Command::StoreSet { scope: scope.clone(), key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).await.unwrap();
    assert_eq!(log.appended.lock().unwrap().last(), Some(&(2, 2)));
    let confirms = *log.confirms.lock().unwrap();
    let v = core.read(|s| Ok(s.job("j")?.store.get("k").cloned())).await.unwrap();
    assert_eq!(v, Some(b"v".to_vec()));
    assert!(*log.confirms.lock().unwrap() > confirms, "the read did not wait for a confirmation");
    // Time never goes below the last logged entry's.
    assert!(core.position().1 >= 1_000);

    // A waiter of the term...
    let waiter = {
        let core = core.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            core.wait_for("j", Some(scope.key_topic("never")), deadline, |s| Ok(s.job("j")?.store.get("never").cloned()), |_| String::new()).await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    // ...fails when the daemon steps down, naming the new leader; so does every later call.
    core.demote("10.0.0.8:29400", 9);
    let got = tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap().unwrap_err();
    assert_eq!(got, RdzvError::NotLeader { leader: "10.0.0.8:29400".into(), epoch: 9 });
    let err = core.execute(join("c")).await.unwrap_err();
    assert!(matches!(err, RdzvError::NotLeader { epoch: 9, .. }), "{err}");
    // A demoted daemon's replica is replaced from the log before anything else.
    core.replica_reset(State::default(), 0, 0).unwrap();
    assert_eq!(core.position(), (0, 0));
}

#[tokio::test]
async fn the_refusal_travels_as_unavailable_with_a_typed_hint() {
    let status = tonic::Status::from(RdzvError::NotLeader { leader: "h2:29400".into(), epoch: 12 });
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(!status.details().is_empty(), "the hint must travel in the status details");
    assert_eq!(RdzvError::from(status), RdzvError::NotLeader { leader: "h2:29400".into(), epoch: 12 });
    // Without a hint (an election is running) it is still retryable.
    let e = RdzvError::from(tonic::Status::from(RdzvError::NotLeader { leader: String::new(), epoch: 0 }));
    assert!(e.is_retryable() && e.to_string().contains("election"), "{e}");
}

/// A log whose every write takes a while, so callers are always waiting for durability.
struct SlowLog;

impl LogStore for SlowLog {
    fn append(&mut self, _records: &[u8], _first_seq: u64, _last_seq: u64) -> Result<(), RdzvError> {
        std::thread::sleep(Duration::from_millis(3));
        Ok(())
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Ok(())
    }
    fn compact_every(&self) -> u64 {
        u64::MAX
    }
}

/// A step-down wakes every caller waiting for durability; each then asks who leads. The HA node
/// demotes twice in a row (the leader loop, then the end of its session), so those callers ask
/// while the second demotion holds the executor's lock and publishes the new term. A caller that
/// held the durability channel while it took the lock deadlocked with it, and with two runtime
/// threads blocked the daemon answered nothing, not even `DaemonInfo` (CI, stop 24).
#[test]
fn step_downs_with_callers_waiting_for_durability_never_deadlock() {
    // The rounds run on a thread of their own, watched from here with a plain channel: a deadlock
    // can block every runtime thread, timers included, and must still fail the test, not hang it.
    let (progress, rounds) = std::sync::mpsc::channel::<(u64, u64)>();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        rt.block_on(async {
            let core = standby_core();
            for round in 0..200u64 {
                core.replica_reset(State::default(), 0, 0).unwrap();
                core.promote(round + 1, Box::new(SlowLog), long_lease()).unwrap();
                core.execute(join("a")).await.unwrap();
                let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
                let callers: Vec<_> = (0..8)
                    .map(|i| {
                        let (core, scope) = (core.clone(), scope.clone());
                        tokio::spawn(async move {
                            for n in 0u64.. {
                                let cmd = Command::StoreSet { scope: scope.clone(), key: format!("k{i}-{n}"), value: vec![1], request_id: String::new() };
                                if core.execute(cmd).await.is_err() {
                                    return n;
                                }
                            }
                            0
                        })
                    })
                    .collect();
                tokio::time::sleep(Duration::from_millis(2)).await;
                let c = core.clone();
                tokio::task::spawn_blocking(move || {
                    c.demote("", 0);
                    c.demote("", 0);
                })
                .await
                .unwrap();
                let mut acknowledged = 0;
                for c in callers {
                    acknowledged += c.await.unwrap();
                }
                if progress.send((round, acknowledged)).is_err() {
                    return;
                }
            }
        });
        // Never waits for its threads (they would be stuck after a deadlock).
        rt.shutdown_background();
    });
    let (mut done, mut acknowledged) = (None, 0);
    loop {
        match rounds.recv_timeout(Duration::from_secs(20)) {
            Ok((r, n)) => (done, acknowledged) = (Some(r), acknowledged + n),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("the step-down after round {done:?} deadlocked with the callers waiting for durability")
            }
        }
    }
    assert_eq!(done, Some(199), "the rounds ended early");
    // The callers' calls went through the log (each acknowledged one waited for durability).
    assert!(acknowledged > 0, "no call was acknowledged in 200 rounds");
}

/// The log of a leader that was deposed while it was paused: every guarded write fails.
struct DeposedLog;

impl LogStore for DeposedLog {
    fn append(&mut self, _records: &[u8], _first_seq: u64, _last_seq: u64) -> Result<(), RdzvError> {
        Err(RdzvError::NotLeader { leader: String::new(), epoch: 0 })
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Ok(())
    }
    fn confirm(&mut self) -> Result<(), RdzvError> {
        Err(RdzvError::NotLeader { leader: String::new(), epoch: 0 })
    }
    fn reads_need_confirmation(&self) -> bool {
        true
    }
    fn compact_every(&self) -> u64 {
        u64::MAX
    }
}

/// A leader resuming from a pause past its lease answers nothing read from its state before a
/// confirmation: not a refusal the state implies, nor the first view of a watch.
#[tokio::test]
async fn a_deposed_leader_answers_neither_refusals_nor_first_views() {
    let core = standby_core();
    core.replica_apply(&[Entry { seq: 1, at: 1_000, cmd: join("a") }]).unwrap();
    core.promote(3, Box::new(DeposedLog), long_lease()).unwrap();
    let (_rx, term) = core.subscribe_view("j").unwrap();
    let seq = core.position().0;
    let first = tokio::time::timeout(Duration::from_secs(10), core.durable(term, seq, true)).await.unwrap();
    assert!(matches!(first, Err(RdzvError::NotLeader { .. })), "{first:?}");
    let missing = Scope { job: "no-such-job".into(), round: 1, round_scoped: false };
    let refused = tokio::time::timeout(Duration::from_secs(10), core.execute(Command::StoreSet { scope: missing, key: "k".into(), value: vec![1], request_id: String::new() }))
        .await
        .unwrap();
    assert!(matches!(refused, Err(RdzvError::NotLeader { .. })), "{refused:?}");
}

/// One write: its first and last sequence numbers and its bytes.
type Attempt = (u64, u64, Vec<u8>);

/// A log whose first write lands but is not acknowledged (etcd did not answer): it records
/// every attempt.
#[derive(Default, Clone)]
struct UnsureLog {
    attempts: Arc<Mutex<Vec<Attempt>>>,
}

impl LogStore for UnsureLog {
    fn append(&mut self, records: &[u8], first_seq: u64, last_seq: u64) -> Result<(), RdzvError> {
        let mut a = self.attempts.lock().unwrap();
        a.push((first_seq, last_seq, records.to_vec()));
        if a.len() == 1 {
            return Err(RdzvError::Unavailable("etcd did not answer".into()));
        }
        Ok(())
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Ok(())
    }
    fn compact_every(&self) -> u64 {
        u64::MAX
    }
}

/// A write retried after an uncertain outcome carries exactly the bytes of the first attempt
/// (the etcd log's slot holds them if it landed); commands that came meanwhile follow in a
/// write of their own.
#[tokio::test]
async fn a_retried_write_is_the_same_bytes_and_later_commands_follow_it() {
    let core = standby_core();
    let log = UnsureLog::default();
    core.promote(1, Box::new(log.clone()), long_lease()).unwrap();
    let first = tokio::spawn({
        let core = core.clone();
        async move { core.execute(join("a")).await }
    });
    // The retry comes 500 ms after the failed attempt; a command arrives in between.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(log.attempts.lock().unwrap().len(), 1);
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    let second = core.execute(Command::StoreSet { scope, key: "k".into(), value: b"v".to_vec(), request_id: String::new() });
    // Both callers are told their change is not durable yet (the client retries such calls).
    let (a, b) = tokio::time::timeout(Duration::from_secs(10), async { (first.await.unwrap(), second.await) }).await.unwrap();
    assert!(matches!(a, Err(RdzvError::Unavailable(_))), "{a:?}");
    assert!(b.is_err(), "{b:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while log.attempts.lock().unwrap().len() < 3 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let attempts = log.attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 3, "{:?}", attempts.iter().map(|(f, l, _)| (f, l)).collect::<Vec<_>>());
    assert_eq!(attempts[0], attempts[1], "the retry changed the write");
    assert_eq!((attempts[2].0, attempts[2].1), (2, 2));
}

/// A log whose snapshots always fail (a full snapshot directory, an etcd refusing large writes).
struct NoSnapshots {
    appended: Arc<Mutex<u64>>,
}

impl LogStore for NoSnapshots {
    fn append(&mut self, _records: &[u8], _first_seq: u64, last_seq: u64) -> Result<(), RdzvError> {
        *self.appended.lock().unwrap() = last_seq;
        Ok(())
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Err(RdzvError::Unavailable("no room for a snapshot".into()))
    }
    fn compact_every(&self) -> u64 {
        1
    }
}

/// A snapshot that fails is dropped, not retried in front of the records: every change after it
/// is still written and answered (a retried snapshot held them back, and every call failed).
#[tokio::test]
async fn a_failing_snapshot_does_not_hold_back_the_records_after_it() {
    let core = standby_core();
    let appended = Arc::new(Mutex::new(0));
    core.promote(3, Box::new(NoSnapshots { appended: appended.clone() }), long_lease()).unwrap();
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    core.execute(join("a")).await.unwrap();
    for i in 0..5 {
        core.execute(Command::StoreSet { scope: scope.clone(), key: format!("k{i}"), value: b"v".to_vec(), request_id: String::new() }).await.unwrap();
    }
    assert_eq!(*appended.lock().unwrap(), 6);
}

/// Through the gRPC handlers: a leader answers (with its stamp) before its lease's local deadline;
/// from the deadline on it answers UNAVAILABLE without a leader hint, steps down by itself (the HA
/// node, waiting on `deposed`, hears of it), and no longer says it leads.
#[tokio::test]
async fn a_leader_answers_until_its_lease_deadline_then_refuses_and_steps_down() {
    let core = standby_core();
    let lease = long_lease();
    core.promote(5, Box::new(MemLog::default()), lease.clone()).unwrap();
    let svc = Service::new(core.clone());
    core.execute(join("a")).await.unwrap();
    let scope = pb::StoreScope { job_id: "j".into(), round: 1, round_scoped: false };
    let set = pb::StoreSetRequest { scope: Some(scope.clone()), key: "k".into(), value: b"v".to_vec(), request_id: String::new() };
    let answered = svc.store_set(Request::new(set)).await.unwrap();
    assert!(answered.metadata().get_bin(LEADER_STAMP_KEY).is_some(), "a leader's answer carries its stamp");
    // The HA node's leader loop waits for the end of the term.
    let deposed = tokio::spawn({
        let core = core.clone();
        async move { core.deposed().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The deadline: no renewal was acknowledged in time (or its reply came too late).
    lease.set(Some(Instant::now()));
    let get = pb::StoreGetRequest { scope: Some(scope.clone()), key: "k".into(), timeout_ms: 0 };
    let refused = svc.store_get(Request::new(get)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    // No leader to name: the answer carries no hint (an empty NotLeader has no details).
    assert!(refused.details().is_empty() && refused.message().contains("not the leader"), "{refused:?}");
    assert_eq!(core.role(), Role::Standby { leader: String::new(), epoch: 0 });
    let ended = tokio::time::timeout(Duration::from_secs(5), deposed).await.unwrap().unwrap();
    assert!(matches!(ended, RdzvError::NotLeader { .. }), "{ended:?}");
    // Every later call is refused; a lease renewed after the fact does not bring it back.
    lease.set(Some(Instant::now() + Duration::from_secs(3600)));
    let set = pb::StoreSetRequest { scope: Some(scope), key: "k2".into(), value: b"v".to_vec(), request_id: String::new() };
    let refused = svc.store_set(Request::new(set)).await.unwrap_err();
    // No leader to name: the answer carries no hint (an empty NotLeader has no details).
    assert!(refused.details().is_empty() && refused.message().contains("not the leader"), "{refused:?}");
    let info = svc.daemon_info(Request::new(pb::DaemonInfoRequest {})).await.unwrap().into_inner();
    assert_eq!(info.role, pb::DaemonRole::Standby as i32);
}

/// `DaemonInfo` of a leader past its deadline says it is a standby, even before any other call
/// or its timer noticed.
#[tokio::test]
async fn a_leader_past_its_lease_deadline_does_not_say_it_leads() {
    let core = standby_core();
    let lease = long_lease();
    core.promote(8, Box::new(MemLog::default()), lease.clone()).unwrap();
    let svc = Service::new(core.clone());
    let info = svc.daemon_info(Request::new(pb::DaemonInfoRequest {})).await.unwrap().into_inner();
    assert_eq!((info.role, info.epoch), (pb::DaemonRole::Leader as i32, 8));
    lease.set(None);
    let info = svc.daemon_info(Request::new(pb::DaemonInfoRequest {})).await.unwrap().into_inner();
    assert_eq!((info.role, info.leader_endpoint.as_str()), (pb::DaemonRole::Standby as i32, ""));
}

/// A log whose writes and confirmations wait until the test opens its gate (a leader that stalls
/// while a write is in flight).
#[derive(Clone, Default)]
struct GatedLog {
    /// (open, writes waiting at the gate)
    gate: Arc<(Mutex<(bool, u32)>, Condvar)>,
}

impl GatedLog {
    fn set_open(&self, open: bool) {
        let (m, c) = &*self.gate;
        m.lock().unwrap().0 = open;
        c.notify_all();
    }
    fn waiting(&self) -> u32 {
        self.gate.0.lock().unwrap().1
    }
    fn pass(&self) {
        let (m, c) = &*self.gate;
        let mut g = m.lock().unwrap();
        g.1 += 1;
        while !g.0 {
            g = c.wait(g).unwrap();
        }
        g.1 -= 1;
    }
}

impl LogStore for GatedLog {
    fn append(&mut self, _records: &[u8], _first_seq: u64, _last_seq: u64) -> Result<(), RdzvError> {
        self.pass();
        Ok(())
    }
    fn compact(&mut self, _state: &State, _seq: u64) -> Result<(), RdzvError> {
        Ok(())
    }
    fn confirm(&mut self) -> Result<(), RdzvError> {
        self.pass();
        Ok(())
    }
    fn reads_need_confirmation(&self) -> bool {
        true
    }
    fn compact_every(&self) -> u64 {
        u64::MAX
    }
}

/// A write applied before the lease's local deadline whose log write is acknowledged only after
/// it (the leader stalled in between) is not acknowledged to its caller: the answer is checked
/// when it goes out, not when the call came in.
#[tokio::test]
async fn a_write_made_durable_after_the_lease_deadline_is_not_acknowledged() {
    let core = standby_core();
    let lease = long_lease();
    let log = GatedLog::default();
    log.set_open(true);
    core.promote(6, Box::new(log.clone()), lease.clone()).unwrap();
    core.execute(join("a")).await.unwrap();
    log.set_open(false);
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    let write = tokio::spawn({
        let core = core.clone();
        async move { core.execute(Command::StoreSet { scope, key: "k".into(), value: b"v".to_vec(), request_id: String::new() }).await }
    });
    let start = std::time::Instant::now();
    while log.waiting() == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the write never reached the log");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The deadline passes while the write is in flight; then the log acknowledges it.
    lease.set(Some(Instant::now()));
    log.set_open(true);
    let got = tokio::time::timeout(Duration::from_secs(10), write).await.unwrap().unwrap();
    assert_eq!(got, Err(RdzvError::NotLeader { leader: String::new(), epoch: 0 }));
    assert_eq!(core.role(), Role::Standby { leader: String::new(), epoch: 0 });
}

/// The HA node's own lease arithmetic as the executor's lease (the keeper's `FenceClock` holds the
/// same fencing point).
#[derive(Debug)]
struct TimerLease(Mutex<LeaseTimer>);

impl LeaderLease for TimerLease {
    fn answer_until(&self) -> Option<Instant> {
        self.0.lock().unwrap().fence_at()
    }
}

async fn role_of(svc: &Service) -> i32 {
    svc.daemon_info(Request::new(pb::DaemonInfoRequest {})).await.unwrap().into_inner().role
}

/// Under tokio's paused clock: granted at 0 s with TTL 5 s, renewed by a keep-alive sent at 1 s
/// whose reply came at 3 s, the leader answers until 5.5 s (the send plus the TTL, less the
/// 0.5 s margin), not until 7.5 s (the reply plus the same), and not at 5.5 s.
#[tokio::test(start_paused = true)]
async fn a_late_keep_alive_reply_counts_from_its_send_under_paused_time() {
    let t0 = Instant::now();
    let lease = Arc::new(TimerLease(Mutex::new(LeaseTimer::new(Duration::from_secs(5)))));
    assert!(lease.0.lock().unwrap().acknowledged(t0, 5));
    let core = standby_core();
    core.promote(2, Box::new(MemLog::default()), lease.clone()).unwrap();
    let svc = Service::new(core.clone());
    tokio::time::advance(Duration::from_millis(1000)).await;
    let sent = Instant::now();
    tokio::time::advance(Duration::from_millis(2000)).await;
    assert!(lease.0.lock().unwrap().acknowledged(sent, 5), "the reply, 2 s after its request");
    tokio::time::advance(Duration::from_millis(2499)).await;
    assert_eq!(Instant::now() - t0, Duration::from_millis(5499));
    assert_eq!(role_of(&svc).await, pb::DaemonRole::Leader as i32);
    assert_eq!(core.role(), Role::Leader { epoch: 2 });
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(role_of(&svc).await, pb::DaemonRole::Standby as i32);
    assert_eq!(core.role(), Role::Standby { leader: String::new(), epoch: 0 });
}

/// A leader past its deadline steps down within a second even when no call comes: its timer
/// looks at least once a second.
#[tokio::test(start_paused = true)]
async fn a_leader_past_its_lease_deadline_steps_down_without_any_call() {
    let core = standby_core();
    core.promote(2, Box::new(MemLog::default()), HandLease::until(Some(Instant::now() + Duration::from_secs(2)))).unwrap();
    tokio::time::sleep(Duration::from_millis(1900)).await;
    assert_eq!(core.role(), Role::Leader { epoch: 2 });
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(core.role(), Role::Standby { leader: String::new(), epoch: 0 });
}

/// A retried write whose first attempt was applied (its answer lost) is answered from the state
/// machine's memory once the service-wide store cap is reached: the cap is for writes that grow
/// the store, and the retry grows nothing (it was refused, though applied). A new write is still
/// refused.
#[tokio::test]
async fn a_retry_of_an_applied_write_is_answered_past_the_store_cap() {
    let cfg = CoreConfig {
        ha: Some(DaemonIdentity { daemon_id: "d1".into(), advertise: "127.0.0.1:1".into() }),
        max_total_store_bytes: Some(16),
        ..CoreConfig::default()
    };
    let core = Core::start(cfg, CancellationToken::new(), &TaskTracker::new()).unwrap();
    core.promote(1, Box::new(MemLog::default()), long_lease()).unwrap();
    core.execute(join("a")).await.unwrap();
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    let set = |v: &[u8], id: &str| Command::StoreSet { scope: scope.clone(), key: "k".into(), value: v.to_vec(), request_id: id.into() };
    let add = |id: &str| Command::StoreAdd { scope: scope.clone(), key: "n".into(), delta: 1, request_id: id.into() };
    let cas = |id: &str| Command::StoreCas { scope: scope.clone(), key: "c".into(), expected: None, desired: b"1".to_vec(), request_id: id.into() };
    assert_eq!(core.execute(add("a1")).await.unwrap(), Outcome::Added(1));
    assert_eq!(core.execute(cas("c1")).await.unwrap(), Outcome::Cas { swapped: true, current: Some(b"1".to_vec()) });
    // 4 bytes held, under the cap: this set takes the service to 21.
    assert_eq!(core.execute(set(&[7; 16], "s1")).await.unwrap(), Outcome::Done);
    let err = core.execute(set(b"x", "s2")).await.unwrap_err();
    assert!(matches!(err, RdzvError::ResourceExhausted(_)), "{err}");
    // The retries of the applied writes answer as their first attempts did, and change nothing.
    assert_eq!(core.execute(set(&[7; 16], "s1")).await.unwrap(), Outcome::Done);
    assert_eq!(core.execute(add("a1")).await.unwrap(), Outcome::Added(1));
    assert_eq!(core.execute(cas("c1")).await.unwrap(), Outcome::Cas { swapped: true, current: Some(b"1".to_vec()) });
    let n = core.read(|s| Ok(s.job("j")?.store.get("n").cloned())).await.unwrap();
    assert_eq!(n, Some(b"1".to_vec()));
    // A different call under an applied id is not a retry: the cap refuses it first.
    let err = core.execute(set(b"other", "s1")).await.unwrap_err();
    assert!(matches!(err, RdzvError::ResourceExhausted(_)), "{err}");
}
