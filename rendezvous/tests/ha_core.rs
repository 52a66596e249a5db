//! The executor's HA roles without etcd: a standby refuses, a promoted daemon serves over its
//! `LogStore`, reads wait for a leadership confirmation, and a demotion fails every waiter of the
//! ended term with a hint naming the new leader. (The real etcd log is tested in `tests/tests/ha/`.)

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rsrun_rendezvous::RdzvError;
use rsrun_rendezvous::journal::{self, Entry};
use rsrun_rendezvous::logstore::LogStore;
use rsrun_rendezvous::service::{Core, CoreConfig, DaemonIdentity, Role};
use rsrun_rendezvous::state::{Command, JobSpec, JoinCmd, Scope, State};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    core.promote(7, Box::new(log.clone())).unwrap();
    assert_eq!(core.role(), Role::Leader { epoch: 7 });
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    core.execute(Command::StoreSet { scope: scope.clone(), key: "k".into(), value: b"v".to_vec() }).await.unwrap();
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
                core.promote(round + 1, Box::new(SlowLog)).unwrap();
                core.execute(join("a")).await.unwrap();
                let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
                let callers: Vec<_> = (0..8)
                    .map(|i| {
                        let (core, scope) = (core.clone(), scope.clone());
                        tokio::spawn(async move {
                            for n in 0u64.. {
                                let cmd = Command::StoreSet { scope: scope.clone(), key: format!("k{i}-{n}"), value: vec![1] };
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
    core.promote(3, Box::new(DeposedLog)).unwrap();
    let (_rx, term) = core.subscribe_view("j").unwrap();
    let seq = core.position().0;
    let first = tokio::time::timeout(Duration::from_secs(10), core.durable(term, seq, true)).await.unwrap();
    assert!(matches!(first, Err(RdzvError::NotLeader { .. })), "{first:?}");
    let missing = Scope { job: "no-such-job".into(), round: 1, round_scoped: false };
    let refused = tokio::time::timeout(Duration::from_secs(10), core.execute(Command::StoreSet { scope: missing, key: "k".into(), value: vec![1] }))
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
    core.promote(1, Box::new(log.clone())).unwrap();
    let first = tokio::spawn({
        let core = core.clone();
        async move { core.execute(join("a")).await }
    });
    // The retry comes 500 ms after the failed attempt; a command arrives in between.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(log.attempts.lock().unwrap().len(), 1);
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    let second = core.execute(Command::StoreSet { scope, key: "k".into(), value: b"v".to_vec() });
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
    core.promote(3, Box::new(NoSnapshots { appended: appended.clone() })).unwrap();
    let scope = Scope { job: "j".into(), round: 1, round_scoped: false };
    core.execute(join("a")).await.unwrap();
    for i in 0..5 {
        core.execute(Command::StoreSet { scope: scope.clone(), key: format!("k{i}"), value: b"v".to_vec() }).await.unwrap();
    }
    assert_eq!(*appended.lock().unwrap(), 6);
}
