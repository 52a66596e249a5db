//! A pending Join whose round formed and ended before its waiter looked (a scale-up join came in
//! the same instant) joins the next round instead of waiting for one that cannot form without it.

use std::time::{Duration, Instant};

use rsrun_rendezvous::proto::{self as pb, rendezvous_server::Rendezvous};
use rsrun_rendezvous::service::{Core, CoreConfig, Service};
use rsrun_rendezvous::state::{Command, JobSpec, JoinCmd};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Request;

const SPEC: JobSpec = JobSpec { min_nodes: 2, max_nodes: 3, last_call_ms: 0, lease_ms: 60_000, max_restarts: 0, fixed_ranks: false };

fn join(node: &str) -> Command {
    Command::Join(JoinCmd {
        job: "race".into(),
        node: node.into(),
        addrs: vec!["127.0.0.1".into()],
        hostname: node.into(),
        local_world_size: 1,
        rank_hint: None,
        master_port: 29_500,
        spec: SPEC.clone(),
    })
}

#[test]
fn a_pending_join_that_missed_its_round_joins_the_next() {
    // One thread: nothing runs between the commands below but what they do themselves.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cancel = CancellationToken::new();
        let core = Core::start(CoreConfig::default(), cancel.clone(), &TaskTracker::new()).unwrap();
        let svc = Service::new(core.clone());
        let a = tokio::spawn(async move {
            let req = pb::JoinRequest {
                job_id: "race".into(),
                node_id: "a".into(),
                addrs: vec!["127.0.0.1".into()],
                local_world_size: 1,
                rank_hint: None,
                config: Some(pb::JobConfig { min_nodes: 2, max_nodes: 3, last_call_ms: 0, lease_ms: 60_000, max_restarts: 0, fixed_ranks: false }),
                timeout_ms: 10_000,
                master_port: 29_500,
                hostname: "a".into(),
            };
            svc.join(Request::new(req)).await.map(|r| r.into_inner())
        });
        // A's join is in and waiting.
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        // B completes round 1 with A, and C's join at once ends it for a scale-up round, all
        // before A's waiter looks again.
        core.execute(join("b")).await.unwrap();
        core.execute(join("c")).await.unwrap();
        // B's launcher joins round 2 as soon as it hears of the end; round 2 waits for A, the
        // other survivor.
        core.execute(join("b")).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), a).await.expect("A waited for a round that could not form").unwrap().unwrap();
        assert_eq!(got.round.as_ref().map(|r| r.round), Some(2), "{got:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        cancel.cancel();
    });
}

/// While a round forms nobody holds rank 0: a publication then is refused, so that whoever asked
/// first cannot decide the write-once id of the round about to run (T9).
#[test]
fn no_unique_id_is_published_while_the_round_forms() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cancel = CancellationToken::new();
        let core = Core::start(CoreConfig::default(), cancel.clone(), &TaskTracker::new()).unwrap();
        let svc = Service::new(core.clone());
        core.execute(join("b")).await.unwrap();
        let e = svc
            .publish_unique_id(Request::new(pb::PublishUniqueIdRequest {
                job_id: "race".into(),
                round: 1,
                rank: 0,
                unique_id: vec![1; 128],
                name: String::new(),
                node_id: "b".into(),
            }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("is still forming"), "{e:?}");
        cancel.cancel();
    });
}
