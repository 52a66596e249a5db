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
